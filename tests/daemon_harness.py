"""A real `facecast run` for the end-to-end tests: the daemon as a subprocess, a real
NOTIFY_SOCKET datagram socket, the control socket, and real pylsl inlets recording its streams.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pylsl

from facecast.daemon.control_client import request
from facecast.shared.messages import StatusRequest

REPO = Path(__file__).resolve().parent.parent


class NotifyListener:
    """systemd's side of sd_notify: a bound AF_UNIX datagram socket, every message kept."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.messages: list[tuple[float, str]] = []  # (monotonic time, datagram text)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def assignments(self) -> list[str]:
        """Every KEY=VALUE line, in arrival order."""
        return [line for _, text in self.messages for line in text.splitlines()]

    def wait_for(self, line: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if line in self.assignments():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


@dataclass
class StreamRecord:
    name: str
    source_id: str
    inlet: pylsl.StreamInlet
    timestamps: list[float] = field(default_factory=list)
    samples: list[np.ndarray] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # local_clock() when pulled


class Recorder:
    """Pulls every sample of the given inlets from a thread, with the arrival time."""

    def __init__(self, records: list[StreamRecord]) -> None:
        self.records = records
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for record in self.records:
                chunk, stamps = record.inlet.pull_chunk(timeout=0.0)
                if stamps:
                    now = pylsl.local_clock()
                    record.timestamps.extend(stamps)
                    record.samples.extend(np.asarray(s) if not isinstance(s, str) else s
                                          for s in chunk)
                    record.arrivals.extend([now] * len(stamps))
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Daemon:
    """`facecast run` with its own runtime directory, host name and notify socket."""

    def __init__(self, tmp: Path, config_text: str | None = None, watchdog_usec: int = 1_000_000,
                 env: dict[str, str] | None = None):
        self.tmp = tmp
        self.host = f"e2e{uuid.uuid4().hex[:8]}"
        self.runtime_dir = tmp / "run"
        self.config_path = tmp / "facecast.toml"
        text = config_text if config_text is not None else (REPO / "config/default.toml").read_text()
        self.config_path.write_text(text.replace(
            "[daemon]\n", f'[daemon]\nhost_name = "{self.host}"\nruntime_dir = "{self.runtime_dir}"\n'))
        self.notify = NotifyListener(tmp / "notify.sock")
        self.log_path = tmp / "daemon.log"
        environment = dict(os.environ, NOTIFY_SOCKET=self.notify.path,
                           WATCHDOG_USEC=str(watchdog_usec), **(env or {}))
        environment.pop("WATCHDOG_PID", None)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "facecast.daemon.cli", "run", "--config", str(self.config_path)],
            env=environment, stdout=self._log, stderr=subprocess.STDOUT, cwd=tmp,
        )

    def status(self, timeout_s: float = 5.0):
        return request(self.runtime_dir, StatusRequest(), timeout_s)

    def worker(self, name: str):
        return next(w for w in self.status().workers if w.name == name)

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def resolve(self, stream_type: str, count: int, timeout_s: float = 30.0) -> list[StreamRecord]:
        prefix = f"facecast-{self.host}-"
        deadline = time.monotonic() + timeout_s
        found: dict[str, pylsl.StreamInfo] = {}
        while time.monotonic() < deadline and len(found) < count:
            for info in pylsl.resolve_byprop("type", stream_type, minimum=count, timeout=2.0):
                if info.source_id().startswith(prefix):
                    found[info.source_id()] = info
        records = []
        for source_id, info in sorted(found.items()):
            inlet = pylsl.StreamInlet(info, max_buflen=60, recover=True)
            inlet.open_stream(timeout=10)
            records.append(StreamRecord(info.name(), source_id, inlet))
        return records

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def close(self) -> None:
        self.stop()
        self.notify.close()
        self._log.close()
