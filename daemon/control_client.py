"""CLI side of the control socket: ask the running supervisor something and wait for the reply.

Runs in the `facecast` command, never in the daemon. A DEALER (not a REQ that wedges after a
lost reply, STYLE §11), one request, a receive with a timeout, replies matched by `reply_to`.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from facecast.shared import endpoints, messages
from facecast.shared.config import Config


class NotRunning(RuntimeError):
    """No supervisor answered at the runtime directory."""


SYSTEM_RUNTIME_DIR = "/run/facecast"  # systemd's RuntimeDirectory=facecast


def runtime_dir_of(config: Config | None, runtime_dir: str = "") -> Path:
    """Where the daemon to talk to lives: given, else the config's, else the first of the places
    a daemon puts its control socket (this user's, then the system service's) that has one."""
    if runtime_dir:
        return Path(runtime_dir)
    if config is not None and config.daemon.runtime_dir:
        return Path(config.daemon.runtime_dir)
    candidates = [Path(p.split(":")[0]) for p in (os.environ.get("RUNTIME_DIRECTORY", ""),) if p]
    if os.environ.get("XDG_RUNTIME_DIR"):
        candidates.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "facecast")
    candidates += [Path(f"/tmp/facecast-{os.getuid()}"), Path(SYSTEM_RUNTIME_DIR)]
    for candidate in candidates:
        if endpoints.socket_path(endpoints.control(candidate)).exists():
            return candidate
    return candidates[0]


def request(runtime_dir: str | Path, message: messages.Message, timeout_s: float = 5.0):
    endpoint = endpoints.control(runtime_dir)
    if not endpoints.socket_path(endpoint).exists():
        raise NotRunning(f"no facecast daemon at {runtime_dir} (no control socket there)")
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send(messages.encode(message))
        gate = messages.MessageGate("supervisor")
        deadline_ms = int(timeout_s * 1000)
        while dealer.poll(deadline_ms):
            reply = gate.decode(dealer.recv())
            if reply is not None and getattr(reply, "reply_to", None) == message.id:
                return reply
        raise NotRunning(f"the facecast daemon at {runtime_dir} did not answer within {timeout_s:g} s")
