"""One worker process as the supervisor sees it: spawn, signal, reap, and the restart policy
(STYLE §5: exponential backoff reset after a stable uptime; a worker that flaps is given up on;
a worker that could not boot is not respawned).

Runs in the supervisor only.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from facecast.daemon.layout import WorkerSpec
from facecast.shared.messages import CameraReport, StageTiming, WorkerStatus

log = logging.getLogger(__name__)

EXIT_BOOT_ERROR = 3  # facecast.workers.base.EXIT_BOOT_ERROR (not imported: no torch here)


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.0  # the first restart after a stable run is immediate
    second_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_uptime_s: float = 30.0  # a run this long resets the backoff
    flap_restarts: int = 6  # this many restarts ...
    flap_window_s: float = 120.0  # ... within this window: give up (state "flapping")

    def delay_s(self, consecutive_failures: int) -> float:
        if consecutive_failures <= 1:
            return self.first_delay_s
        return min(self.max_delay_s, self.second_delay_s * 2 ** (consecutive_failures - 2))


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class WorkerProcess:
    spec: WorkerSpec
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    popen: subprocess.Popen | None = None
    # booting, running, standby, backoff, pending (a spare to start), failed, flapping, stopping, stopped
    state: str = "stopped"
    restarts: int = 0
    consecutive_failures: int = 0
    started_monotonic: float = 0.0
    last_heartbeat_monotonic: float = 0.0
    next_start_monotonic: float = 0.0
    kill_sent_monotonic: float | None = None
    last_exit: str = ""
    detail: str = ""  # why it is in its state (boot error, hang, flapping)
    boot_error: str = ""
    rejected_messages: int = 0  # from its heartbeats: malformed messages it refused
    reports: list[CameraReport] = field(default_factory=list)
    stages: dict[str, StageTiming] = field(default_factory=dict)
    _restart_times: collections.deque = field(default_factory=collections.deque)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else 0

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, control_endpoint: str, env: dict[str, str]) -> None:
        self._begin(subprocess.Popen(
            [sys.executable, "-m", "facecast.workers", self.spec.role, self.name, control_endpoint],
            env=env, stdin=subprocess.DEVNULL, close_fds=True,
        ))
        log.info("started %s (pid %d)", self.name, self.popen.pid)

    def hand_over(self, successor: WorkerProcess, respawn_delay_s: float) -> None:
        """This warm standby's process becomes `successor`'s (it was told to take the name);
        this spare starts afresh after `respawn_delay_s` (Note [Warm standby])."""
        successor._begin(self.popen)
        self.popen = None
        self.state = "pending"
        self.next_start_monotonic = time.monotonic() + respawn_delay_s

    def _begin(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        now = time.monotonic()
        self.state = "booting"
        self.started_monotonic = self.last_heartbeat_monotonic = now
        self.kill_sent_monotonic = None
        self.reports, self.stages, self.boot_error = [], {}, ""
        self.rejected_messages = 0

    def signal(self, signum: int) -> None:
        if self.alive():
            try:
                os.kill(self.popen.pid, signum)
            except ProcessLookupError:
                return
            if signum == signal.SIGKILL and self.kill_sent_monotonic is None:
                self.kill_sent_monotonic = time.monotonic()

    def reap(self) -> int | None:
        """The exit code once the process has ended (and is reaped), else None."""
        if self.popen is None:
            return None
        return self.popen.poll()

    def on_exit(self, returncode: int) -> str:
        """Decide what happens after an unexpected exit; returns the new state."""
        now = time.monotonic()
        uptime_s = now - self.started_monotonic
        self.last_exit = describe_exit(returncode)
        self.popen = None
        if returncode == EXIT_BOOT_ERROR:
            self.state = "failed"
            self.detail = self.boot_error or "could not boot (see its log)"
            return self.state
        self.consecutive_failures = 1 if uptime_s >= self.policy.stable_uptime_s else (
            self.consecutive_failures + 1)
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > self.policy.flap_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.policy.flap_restarts:
            self.state = "flapping"
            self.detail = (f"{len(self._restart_times)} exits within "
                           f"{self.policy.flap_window_s:g} s (last: {self.last_exit}); not restarted")
            return self.state
        self.state = "backoff"
        self.next_start_monotonic = now + self.policy.delay_s(self.consecutive_failures)
        return self.state

    @property
    def exit_reason(self) -> str:
        """Why the last run ended, as status and markers say it: a hang or a give-up reason
        when there is one, else how the process exited."""
        if self.detail.startswith("hung") or self.state in ("failed", "flapping"):
            return self.detail
        return self.last_exit

    def status(self) -> WorkerStatus:
        uptime_s = time.monotonic() - self.started_monotonic if self.alive() else 0.0
        return WorkerStatus(name=self.name, role=self.spec.role, pid=self.pid, state=self.state,
                            restarts=self.restarts, uptime_s=round(uptime_s, 1),
                            last_exit=self.last_exit, detail=self.detail,
                            rejected_messages=self.rejected_messages,
                            standby=self.spec.standby)
