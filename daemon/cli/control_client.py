"""CLI side of the control socket: ask the running supervisor something and wait for the reply.

Runs in the `facecast` command, never in the daemon. A DEALER (not a REQ that wedges after a
lost reply, STYLE §11), one request, a receive with a timeout, replies matched by `reply_to`.
Before asking, it checks the supervisor's lock (facecast.daemon.runtime_dir): a socket whose
lock nobody holds belongs to a supervisor that was killed, and waiting for its answer would
only end in a timeout.
"""

from __future__ import annotations

from pathlib import Path

import zmq

from facecast.daemon import runtime_dir as runtime_dir_mod
from facecast.shared.transport import endpoints, messages
from facecast.shared.config import Config


class NotRunning(RuntimeError):
    """No supervisor answered at the runtime directory."""


def runtime_dir_of(config: Config | None, runtime_dir: str = "") -> Path:
    """Where the daemon to talk to lives (facecast.daemon.runtime_dir.for_cli)."""
    return runtime_dir_mod.for_cli(config.daemon.runtime_dir if config is not None else "",
                                   runtime_dir)


def request(runtime_dir: str | Path, message: messages.Message, timeout_s: float = 5.0):
    endpoint = endpoints.control(runtime_dir)
    if not endpoints.socket_path(endpoint).exists():
        raise NotRunning(f"no facecast daemon at {runtime_dir} (no control socket there)")
    unsafe = runtime_dir_mod.cli_problem(Path(runtime_dir))
    if unsafe:  # another user's daemon, or a socket planted for us to talk to (issue 21)
        raise NotRunning(f"not talking to a daemon through {runtime_dir}: {unsafe}")
    held, pid = runtime_dir_mod.lock_owner(runtime_dir)
    if not held:
        owner = f" of supervisor pid {pid}" if pid else ""
        raise NotRunning(f"facecast is not running at {runtime_dir} (stale control socket{owner}, "
                         "which was killed; the next `facecast run` cleans it up)")
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
