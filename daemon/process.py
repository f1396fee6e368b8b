"""One worker process as the supervisor sees it: its state machine, spawn, signal, reap, and the
restart policy (STYLE §5: exponential backoff reset after a stable uptime; a worker that flaps is
given up on; a worker that could not boot is not respawned).

Runs in the supervisor only.

Note [Worker states]
    Every state a worker's record can be in is a `WorkerState`, and every change goes through
    `WorkerProcess.move_to`, which refuses a change that `TRANSITIONS` does not list (a bug in
    the supervisor, never a worker's doing): a record cannot go from "failed" to "running"
    because a late heartbeat arrived, say. The states:

    pending   a process to start when `next_start_monotonic` comes (a spare whose process was
              promoted, a worker started afresh by a reload);
    booting   its process runs and has not said it is up;
    running   it heartbeats from its main loop;
    standby   a warm spare, booted and waiting (Note [Warm standby]), its process paused
              meanwhile (Note [Spares paused while they stand by]);
    backoff   its process ended unexpectedly; it starts again at `next_start_monotonic`;
    failed    it could not boot (exit code EXIT_BOOT_ERROR): never respawned;
    flapping  it ended too often within a window: given up on;
    stopping  the supervisor sent SIGTERM (and maybe SIGKILL) and waits for it to go;
    stopped   no process, none wanted.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from facecast.daemon.layout import WorkerSpec
from facecast.shared.exit_codes import EXIT_BOOT_ERROR
from facecast.shared.transport.messages import (
    CameraReport,
    StageTiming,
    TorchMemory,
    WorkerStatus,
)

log = logging.getLogger(__name__)

STUCK_AFTER_KILL_S = 2.0  # a SIGKILLed process still there after this is stuck in the kernel
# Note [A closed worker is not killed]
#     At a stop a worker sends Closed once it has closed everything it owns (rings, decoders,
#     sockets, outlets), just before os._exit (Note [Quick exit]); what is left of its end is
#     the kernel's and the driver's (its CUDA context, GPU memory, decoder sessions). With 128
#     NVDEC cameras on two H100s (2026-11-27, the log's "closed in" and "ended ... after its
#     SIGTERM" lines) every worker had closed within 0.9 s of its SIGTERM, but the processes
#     ended one after another, 0.1-0.5 s apart, the last 4.8-4.9 s after it: the SIGKILLs at
#     the stage's deadline (3.5 s) ended nothing sooner (a killed process still took up to 1.3
#     s) and logged six to nine workers as killed. So a worker that said it closed gets up to
#     CLOSED_END_S past its deadline to end before it is killed; and the next stage of the
#     shutdown begins once every worker of this one has closed, stopped or been killed (the
#     output worker's turn had waited for those processes' ends, then it was killed 0.2 s after
#     its own SIGTERM).
CLOSED_END_S = 10.0


class WorkerState(enum.StrEnum):
    """Note [Worker states]. The values are what `WorkerStatus.state` carries."""

    PENDING = "pending"
    BOOTING = "booting"
    RUNNING = "running"
    STANDBY = "standby"
    BACKOFF = "backoff"
    FAILED = "failed"
    FLAPPING = "flapping"
    STOPPING = "stopping"
    STOPPED = "stopped"


S = WorkerState
_ENDED = {S.BACKOFF, S.FAILED, S.FLAPPING}  # what an unexpected exit leads to
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    S.STOPPED: frozenset({S.BOOTING, S.PENDING}),
    S.PENDING: frozenset({S.BOOTING, S.STOPPED}),
    # (-> stopped: the process had ended, unreaped, when the stop reached it.)
    S.BOOTING: frozenset({S.RUNNING, S.STANDBY, S.STOPPING, S.STOPPED} | _ENDED),
    S.RUNNING: frozenset({S.STOPPING, S.STOPPED} | _ENDED),
    # A spare's process is handed to a dead worker: the spare's record waits for a new one.
    S.STANDBY: frozenset({S.PENDING, S.STOPPING, S.STOPPED} | _ENDED),
    # Restarted cold (booting) or by a promoted spare (booting as well).
    S.BACKOFF: frozenset({S.BOOTING, S.STOPPED}),
    S.FAILED: frozenset({S.STOPPED}),
    S.FLAPPING: frozenset({S.STOPPED}),
    S.STOPPING: frozenset({S.STOPPED}),
}
GIVEN_UP_STATES = frozenset({S.FAILED, S.FLAPPING})


class IllegalTransition(RuntimeError):
    """The supervisor tried a state change that Note [Worker states] does not allow."""


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
    secret: str = field(default="", repr=False)  # its process's (Note [Worker connections])
    state: WorkerState = WorkerState.STOPPED  # change it with move_to (Note [Worker states])
    restarts: int = 0
    consecutive_failures: int = 0
    started_monotonic: float = 0.0
    held: bool = False  # told to wait for Release before booting (Note [Boot order])
    last_heartbeat_monotonic: float = 0.0
    next_start_monotonic: float = 0.0
    stop_sent_monotonic: float = 0.0  # stopping: when its SIGTERM went
    stop_deadline_monotonic: float = 0.0  # stopping: SIGKILL when this passes
    abort_sent_monotonic: float | None = None  # hung: SIGABRT first (its stack to the log)
    kill_sent_monotonic: float | None = None
    paused: bool = False  # a spare's process stopped by SIGSTOP (Note [Spares paused while they stand by])
    closed_monotonic: float | None = None  # said Closed: its process is ending
    last_exit: str = ""
    detail: str = ""  # why it is in its state (boot error, hang, flapping)
    boot_error: str = ""
    trouble: str = ""  # from its heartbeats: what keeps it from doing its work, if anything
    rejected_messages: int = 0  # from its heartbeats: malformed messages it refused
    reports: list[CameraReport] = field(default_factory=list)
    stages: dict[str, StageTiming] = field(default_factory=dict)
    torch_memory: TorchMemory | None = None  # from its heartbeats: torch's view of its GPU memory
    _restart_times: collections.deque = field(default_factory=collections.deque)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else 0

    def move_to(self, new: WorkerState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"worker {self.name}: {self.state} -> {new} is not allowed")
        self.state = new

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def routing_id(self) -> bytes:
        """Its connection's identity on the control socket (Note [Worker connections]); b""
        without a process."""
        return f"{self.name}#{self.secret}".encode() if self.secret else b""

    def start(self, control_endpoint: str, env: dict[str, str]) -> None:
        # Note [Worker connections]: a secret of the process's own, through a pipe (not its
        # arguments, which every user sees, nor its environment, which /proc shows its user).
        secret = secrets.token_hex(16)
        popen = subprocess.Popen(
            [sys.executable, "-m", "facecast.workers", self.spec.role, self.name, control_endpoint],
            env=env, stdin=subprocess.PIPE, close_fds=True,
        )
        try:
            popen.stdin.write(f"{secret}\n".encode())
            popen.stdin.close()
        except OSError as exc:  # it died at once: reaped as any dead worker is
            log.warning("could not hand %s its secret: %s", self.name, exc)
        self.adopt(popen, secret)
        log.info("started %s (pid %d)", self.name, self.popen.pid)

    def hand_over(self, successor: WorkerProcess, respawn_delay_s: float) -> None:
        """This warm standby's process becomes `successor`'s (it was told to take the name);
        this spare starts afresh after `respawn_delay_s` (Note [Warm standby])."""
        popen, self.popen = self.popen, None
        secret, self.secret = self.secret, ""
        self.move_to(WorkerState.PENDING)  # refused unless this is a spare in standby
        successor.adopt(popen, secret)
        self.next_start_monotonic = time.monotonic() + respawn_delay_s

    def adopt(self, popen: subprocess.Popen, secret: str = "") -> None:
        """`popen` is now this worker's process, booting (a fresh one, or a promoted spare);
        `secret`, the one it was spawned with (Note [Worker connections])."""
        self.move_to(WorkerState.BOOTING)
        self.popen = popen
        self.secret = secret
        now = time.monotonic()
        self.started_monotonic = self.last_heartbeat_monotonic = now
        self.held = False  # its Assignment says (Note [Boot order])
        self.abort_sent_monotonic = self.kill_sent_monotonic = self.closed_monotonic = None
        self.paused = False  # a promoted spare's process was continued first (`resume`)
        self.reports, self.stages, self.boot_error, self.trouble = [], {}, "", ""
        self.rejected_messages = 0
        self.torch_memory = None

    def signal(self, signum: int) -> None:
        """`signum` to its process; a paused one is continued after it, so that it acts on it
        (SIGKILL needs no continuing)."""
        if self.alive():
            try:
                os.kill(self.popen.pid, signum)
            except ProcessLookupError:
                return
            now = time.monotonic()
            if signum == signal.SIGKILL and self.kill_sent_monotonic is None:
                self.kill_sent_monotonic = now
            elif signum == signal.SIGABRT and self.abort_sent_monotonic is None:
                self.abort_sent_monotonic = now
            if signum != signal.SIGKILL:
                self.resume()

    def pause(self) -> None:
        """Note [Spares paused while they stand by]: stop a standing-by spare's process (again,
        if it should be paused already: a second SIGSTOP changes nothing)."""
        if self.state is WorkerState.STANDBY and self.alive():
            try:
                os.kill(self.popen.pid, signal.SIGSTOP)
            except ProcessLookupError:
                return  # reaped as any dead worker is
            if not self.paused:
                log.info("%s (pid %d) paused until promoted", self.name, self.pid)
            self.paused = True

    def resume(self) -> None:
        """Continue a paused process. SIGCONT goes to any live spare, paused or not as far as
        this record knows: it changes nothing for a running process."""
        if self.spec.standby and self.alive():
            try:
                os.kill(self.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.paused = False

    def on_closed(self) -> None:
        """It closed everything it owns; its process is ending (Note [A closed worker is not
        killed])."""
        if self.state is WorkerState.STOPPING and self.closed_monotonic is None:
            self.closed_monotonic = time.monotonic()  # (outside a stop it changes nothing)

    def done_with_its_work(self) -> bool:
        """Stopped, closed or SIGKILLed: nothing more comes from it, whatever its process's end
        still takes (Note [A closed worker is not killed])."""
        return (self.state is WorkerState.STOPPED or self.closed_monotonic is not None
                or self.kill_sent_monotonic is not None)

    def stuck(self, now_monotonic: float) -> bool:
        """SIGKILLed long ago and still there: stuck in the kernel (a GPU driver hang, say)."""
        return (self.kill_sent_monotonic is not None and self.alive()
                and now_monotonic - self.kill_sent_monotonic > STUCK_AFTER_KILL_S)

    def begin_stop(self, deadline_monotonic: float) -> None:
        """SIGTERM now; the supervisor's loop SIGKILLs it at the deadline (`advance_stop`)."""
        if self.state in (WorkerState.STOPPING, WorkerState.STOPPED):
            return
        if self.alive():
            self.move_to(WorkerState.STOPPING)
            self.stop_sent_monotonic = time.monotonic()
            self.stop_deadline_monotonic = deadline_monotonic
            self.signal(signal.SIGTERM)
        else:
            self.popen = None
            self.move_to(WorkerState.STOPPED)

    def advance_stop(self, now_monotonic: float) -> bool:
        """One tick of a stop in progress; True once the worker is stopped (or given up on as
        stuck). Never waits (the supervisor's loop goes on meanwhile)."""
        if self.state is WorkerState.STOPPED:
            return True
        if not self.alive():
            self.popen = None
            self.move_to(WorkerState.STOPPED)
            return True
        deadline_monotonic = self.stop_deadline_monotonic
        if self.closed_monotonic is not None:  # Note [A closed worker is not killed]
            deadline_monotonic += CLOSED_END_S
        if self.kill_sent_monotonic is None and now_monotonic >= deadline_monotonic:
            if self.closed_monotonic is None:
                log.warning("worker %s did not stop in time; killing it", self.name)
            else:
                log.warning("worker %s did not end after closing in time; killing it", self.name)
            self.signal(signal.SIGKILL)
        elif self.stuck(now_monotonic):
            log.error("worker %s (pid %d) is stuck even after SIGKILL; leaving it", self.name,
                      self.pid)
            self.popen = None
            self.move_to(WorkerState.STOPPED)
            return True
        return False

    def reap(self) -> int | None:
        """The exit code once the process has ended (and is reaped), else None."""
        if self.popen is None:
            return None
        return self.popen.poll()

    def on_exit(self, returncode: int) -> WorkerState:
        """Decide what happens after an unexpected exit; returns the new state."""
        now = time.monotonic()
        uptime_s = now - self.started_monotonic
        self.last_exit = describe_exit(returncode)
        self.popen = None
        if returncode == EXIT_BOOT_ERROR:
            self.detail = self.boot_error or "could not boot (see its log)"
            self.move_to(WorkerState.FAILED)
            return self.state
        self.consecutive_failures = 1 if uptime_s >= self.policy.stable_uptime_s else (
            self.consecutive_failures + 1)
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > self.policy.flap_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.policy.flap_restarts:
            self.detail = (f"{len(self._restart_times)} exits within "
                           f"{self.policy.flap_window_s:g} s (last: {self.last_exit}); not restarted")
            self.move_to(WorkerState.FLAPPING)
            return self.state
        self.next_start_monotonic = now + self.policy.delay_s(self.consecutive_failures)
        self.move_to(WorkerState.BACKOFF)
        return self.state

    @property
    def exit_reason(self) -> str:
        """Why the last run ended, as status and markers say it: a hang or a give-up reason
        when there is one, else how the process exited."""
        if self.detail.startswith("hung") or self.state in GIVEN_UP_STATES:
            return self.detail
        return self.last_exit

    def status(self) -> WorkerStatus:
        uptime_s = time.monotonic() - self.started_monotonic if self.alive() else 0.0
        return WorkerStatus(name=self.name, role=self.spec.role, pid=self.pid,
                            state=self.state.value, restarts=self.restarts,
                            uptime_s=round(uptime_s, 1), last_exit=self.last_exit,
                            detail="; ".join(part for part in (
                                self.detail or self.trouble,
                                "paused until promoted" if self.paused else "") if part),
                            rejected_messages=self.rejected_messages,
                            standby=self.spec.standby,
                            # A process that is gone holds no memory, whatever it said last.
                            torch_memory=self.torch_memory if self.alive() else None)
