"""The supervisor's workers: who runs, starting and restarting them, warm standbys, liveness,
and stopping them without ever blocking the supervisor's loop.

Every method is one tick's worth of work: it looks at the clock and the processes, acts, and
returns. Waiting happens in the supervisor's loop (its poll), never here, so that heartbeats,
WATCHDOG=1 and the CLI are served while workers boot, stop or are replaced (a reload or a
shutdown is a state the loop advances, as gunicorn's arbiter does).

Runs in the supervisor only.

Note [Supervisor liveness]
    A worker is alive when it heartbeats: workers send them from their main loop, so a worker
    stuck in a read or an inference goes silent. After `daemon.heartbeat_timeout_s` of silence
    (`daemon.boot_timeout_s` while it boots) it is hung: it gets SIGABRT first, which
    faulthandler (enabled in every worker) turns into a dump of every thread's stack in the log,
    then SIGKILL if it is still there ABORT_GRACE_S later (gunicorn's murder_workers), and it is
    restarted like a worker that died (facecast.daemon.process.RestartPolicy). WATCHDOG=1 goes
    to systemd from the same loop, so a stuck supervisor is restarted by systemd; it is withheld
    when a worker we SIGKILLed does not go away (a process stuck in the kernel, typically a GPU
    driver hang), which only a restart of the whole service can clear.

Note [Warm standby]
    A restarted worker took seconds to work again (Python, torch, the CUDA context, the models
    loaded and run once; about 4 s on a GPU, 2 s for roi_landmark on a busy 2-core CPU), against
    a 2 s goal for every stream. So the supervisor keeps one booted spare of each role whose
    boot is slow (`layout.standby_plan`, `daemon.warm_standby`): its Assignment says `standby`,
    it runs `Worker.prepare` and then waits, heartbeating, in state "standby". When a worker of
    that role and device dies or is killed as hung, the supervisor sends the spare `Promote`
    with the dead worker's name instead of spawning a process: the spare takes the name (process
    title, log lines, a new control connection under that identity) and says Hello; its
    Assignment and boot are then the normal ones, minus what prepare already did. A fresh spare
    is started STANDBY_RESPAWN_DELAY_S later, so that it does not take the CPU from the promoted
    worker's boot, and spares run at a lower CPU priority until promoted (Note [Spares at a
    lower priority]). Spares start once the daemon is READY: booting with the config's workers, a
    GPU's spares prepared the same CUDA graphs at the same time as the workers READY waits for
    (64 cameras on the H200: READY after 60 s, the detection worker's graphs taking 45 s among 4
    processes preparing theirs). The price is on small CPUs: on 2 cores the spares' first
    seconds after READY took CPU from the streams, hence their lower priority (Note [Spares at
    a lower priority]). A spare built for a config that a reload
    changed is replaced; if the config moved on between prepare and boot anyway, boot loads the
    models again (slow, never wrong). An inference spare keeps its models and the GPU libraries'
    preparations but not its CUDA graphs, which it captures again when promoted (Note [Spares
    without graphs]).

Note [Spares paused while they stand by]
    A warm spare waits for Promote and does nothing else, yet on a GPU each cost 0.03-0.04
    cores beside the daemon at 64 cameras (H100, 2026-11-28), against 0.0015 on a CPU: nearly
    all of it in the CUDA driver's own thread of its context (`cuda-EvtHandlr`). That thread
    wakes whenever another process's blocking wait (Note [Blocking waits]) asks the GPU for an
    interrupt, two or more such waiters at a time, 190-930 times a second in
    bench/spare_wakeups.py, whether its own process waits for anything or not; spinning waits
    would spare it and cost each worker a core. So the supervisor stops a spare's process
    (SIGSTOP) as soon as it says it stands by: nothing of it is scheduled, its context, memory
    and prepared models stay. It is continued (SIGCONT) before it is sent Promote, and after
    any other signal the supervisor sends it (SIGTERM at a stop or a reload), so that it acts
    on it. A stopped spare cannot heartbeat, so liveness does not judge a paused one; a spare
    in standby that heartbeats (continued by anyone else, or for a promotion that could not be
    sent) is paused again. On the H100 a stopped, warm context beside the daemon's ring
    traffic woke 0 times a second (against 474 running) and, continued, replayed its CUDA
    graph right, the first replay taking ~40 ms (the driver's pending notices handled first;
    docs/benchmarks.md). A paused spare cannot act on SIGTERM from its dying supervisor
    either, so while it stands by its parent-death signal is SIGKILL (`Worker.stand_by`,
    workers/base.py): it holds no camera, ring or stream that needs closing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Iterator

from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import GIVEN_UP_STATES, RestartPolicy, WorkerProcess, WorkerState
from facecast.shared import cpu_priority
from facecast.shared.transport import shm
from facecast.shared.config import DaemonConfig
from facecast.shared.transport.messages import Promote

log = logging.getLogger(__name__)

S = WorkerState
ABORT_GRACE_S = 1.0  # a hung worker's time to dump its stacks after SIGABRT (Note [Supervisor liveness])
STANDBY_RESPAWN_DELAY_S = 3.0  # Note [Warm standby]


class WorkerTable:
    def __init__(self, control_endpoint: str, policy: RestartPolicy,
                 send: Callable[[str, object], bool],
                 event: Callable[..., None]) -> None:
        self.control_endpoint = control_endpoint
        self.policy = policy
        self._send = send  # (worker name, message) -> delivered
        self._event = event  # (kind, **fields): to the Markers stream
        self.log_level = "INFO"
        self._spare_priority_decided: tuple[bool, str] | None = None
        self._workers: dict[str, WorkerProcess] = {}

    # -- the table ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[WorkerProcess]:
        return iter(list(self._workers.values()))

    def get(self, name: str) -> WorkerProcess | None:
        return self._workers.get(name)

    def capture_of(self, camera_id: str) -> WorkerProcess | None:
        """The capture worker of a camera (Note [Capture groups])."""
        return next((w for w in self if w.spec.role == "capture" and not w.spec.standby
                     and camera_id in w.spec.camera_ids), None)

    def remove(self, name: str) -> None:
        self._workers.pop(name, None)

    # -- starting -------------------------------------------------------------------------------

    def _spare_priority(self) -> tuple[bool, str]:
        """Whether spares run lower (Note [Spares at a lower priority]); decided, and said in
        the log, once."""
        if self._spare_priority_decided is None:
            permitted, why_not = cpu_priority.restore_permitted()
            self._spare_priority_decided = (permitted, why_not)
            if permitted:
                log.info("warm spares prepare at nice +%d and get the workers' priority back "
                         "when promoted", cpu_priority.SPARE_NICE_INCREMENT)
            else:
                log.warning("warm spares prepare at the workers' priority: %s", why_not)
        return self._spare_priority_decided

    def start(self, spec: WorkerSpec) -> WorkerProcess:
        """A new worker for `spec`, its process started now."""
        worker = WorkerProcess(spec, self.policy)
        self._workers[spec.name] = worker
        self._spawn(worker)
        return worker

    def _spawn(self, worker: WorkerProcess) -> None:
        env = dict(os.environ)
        env["FACECAST_LOG_LEVEL"] = self.log_level
        env.pop(cpu_priority.SPARE_NICE_ENV, None)
        if worker.spec.standby:  # Note [Spares at a lower priority]
            lowered, why_not = self._spare_priority()
            env[cpu_priority.SPARE_NICE_ENV] = str(cpu_priority.SPARE_NICE_INCREMENT
                                                   if lowered else 0)
            worker.detail = "" if lowered else f"normal priority: {why_not}"
        worker.start(self.control_endpoint, env)

    def start_due(self) -> None:
        """Spares whose process was promoted get a new one; ended workers are restarted when
        their backoff is over, by their spare when one is ready (Note [Warm standby])."""
        now = time.monotonic()
        for worker in self:
            if now < worker.next_start_monotonic:
                continue
            if worker.state is S.PENDING:
                self._spawn(worker)
            elif worker.state is S.BACKOFF:
                worker.restarts += 1
                reason = worker.exit_reason
                worker.detail = ""
                standby = self._ready_standby(worker.spec)
                promoted = standby is not None and self._promote(standby, worker)
                if not promoted:
                    self._spawn(worker)
                self._event("worker_restart", worker=worker.name, reason=reason,
                            restarts=worker.restarts, warm_standby=promoted)

    def _ready_standby(self, spec: WorkerSpec) -> WorkerProcess | None:
        """A booted spare for a worker of this role and device (Note [Warm standby])."""
        if spec.standby:
            return None
        for worker in self:
            if (worker.spec.standby and worker.spec.role == spec.role
                    and worker.spec.device == spec.device and worker.state is S.STANDBY
                    and worker.alive()):
                return worker
        return None

    def _promote(self, standby: WorkerProcess, worker: WorkerProcess) -> bool:
        standby.resume()  # Note [Spares paused while they stand by]
        if not self._send(standby.name, Promote(worker=worker.name)):
            log.warning("could not promote %s: it is unreachable", standby.name)
            return False
        log.info("worker %s: warm standby pid %d takes over", worker.name, standby.pid)
        standby.hand_over(worker, STANDBY_RESPAWN_DELAY_S)
        return True

    # -- watching -------------------------------------------------------------------------------

    def reap(self) -> None:
        """Processes that ended: a stopping one is stopped (advance_stops); any other ended
        unexpectedly and gets its restart policy. Whatever it left in /dev/shm goes at once."""
        for worker in self:
            pid = worker.pid
            returncode = worker.reap()
            if returncode is None:
                continue
            if worker.state is S.STOPPING:
                self._ended_while_stopping(worker, pid)
                continue
            self._sweep(worker, pid)
            state = worker.on_exit(returncode)
            reason = worker.exit_reason
            log.log(logging.ERROR if state in GIVEN_UP_STATES else logging.WARNING,
                    "worker %s ended (%s): %s", worker.name, worker.last_exit,
                    {S.BACKOFF: "restarting", S.FAILED: f"not restarted: {reason}",
                     S.FLAPPING: f"given up: {reason}"}[state])
            if state in GIVEN_UP_STATES:
                self._event("worker_failed", worker=worker.name, reason=reason)

    def check_liveness(self, daemon: DaemonConfig) -> None:
        """Note [Supervisor liveness]: a hung worker gets SIGABRT, then SIGKILL."""
        now = time.monotonic()
        for worker in self:
            if not worker.alive() or worker.kill_sent_monotonic is not None or worker.paused:
                continue  # (a paused spare cannot heartbeat: Note [Spares paused while they stand by])
            if worker.abort_sent_monotonic is not None:
                if now - worker.abort_sent_monotonic >= ABORT_GRACE_S:
                    log.error("worker %s (pid %d) still there %.1f s after SIGABRT; killing it",
                              worker.name, worker.pid, now - worker.abort_sent_monotonic)
                    worker.signal(signal.SIGKILL)
                continue
            # A held worker (Note [Boot order]) that has prepared and waits for its release
            # heartbeats: it is judged as a running one until released, then its boot is timed.
            waiting = worker.held and worker.last_heartbeat_monotonic > worker.started_monotonic
            if (worker.state is S.BOOTING and not waiting
                    and now - worker.started_monotonic > daemon.boot_timeout_s):
                worker.detail = f"hung: did not start within {daemon.boot_timeout_s:g} s"
            elif ((worker.state in (S.RUNNING, S.STANDBY) or waiting)
                  and now - worker.last_heartbeat_monotonic > daemon.heartbeat_timeout_s):
                worker.detail = (f"hung: no heartbeat for "
                                 f"{now - worker.last_heartbeat_monotonic:.1f} s")
            else:
                continue
            log.error("worker %s (pid %d) %s; SIGABRT for its stacks, then SIGKILL", worker.name,
                      worker.pid, worker.detail)
            worker.signal(signal.SIGABRT)

    def stuck(self) -> list[str]:
        """Workers that survive SIGKILL (Note [Supervisor liveness])."""
        now = time.monotonic()
        return [w.name for w in self if w.stuck(now)]

    # -- stopping -------------------------------------------------------------------------------

    def begin_stop(self, workers: list[WorkerProcess], deadline_monotonic: float) -> None:
        """SIGTERM; `advance_stops` SIGKILLs what is left at the deadline (STYLE §7)."""
        for worker in workers:
            worker.begin_stop(deadline_monotonic)

    def advance_stops(self) -> None:
        now = time.monotonic()
        for worker in self:
            if worker.state is S.STOPPING:
                # A process that ended since `reap` looked is found ended here (advance_stop
                # reaps it and drops its popen): it gets reap's line and sweep all the same. A
                # loaded 2-core run had a worker's "ended" line missing (2026-11-28).
                popen = worker.popen
                if (worker.advance_stop(now) and popen is not None
                        and popen.returncode is not None):
                    self._ended_while_stopping(worker, popen.pid)

    def _ended_while_stopping(self, worker: WorkerProcess, pid: int) -> None:
        """A stopping worker's process ended: what it left in /dev/shm goes, and the log says
        when, with the worker's own "closed in" line beside it: where a slow stop went (its
        closing, or its process's end after it: the driver ending a CUDA context at scale)."""
        self._sweep(worker, pid)
        closed = ("never said Closed" if worker.closed_monotonic is None else
                  f"closed at {worker.closed_monotonic - worker.stop_sent_monotonic:.2f} s")
        log.info("%s (pid %d) ended %.2f s after its SIGTERM (%s)%s", worker.name, pid,
                 time.monotonic() - worker.stop_sent_monotonic, closed,
                 "" if worker.kill_sent_monotonic is None else ", SIGKILLed")
        worker.advance_stop(time.monotonic())

    @staticmethod
    def _sweep(worker: WorkerProcess, pid: int) -> None:
        left = shm.sweep_process(pid)
        if left:
            log.info("removed %d file(s) that %s (pid %d) left in /dev/shm", len(left),
                     worker.name, pid)

    @staticmethod
    def all_stopped(workers: list[WorkerProcess]) -> bool:
        return all(w.state is S.STOPPED for w in workers)

    @staticmethod
    def all_done_with_their_work(workers: list[WorkerProcess]) -> bool:
        """Each stopped, closed or SIGKILLed (Note [A closed worker is not killed])."""
        return all(w.done_with_its_work() for w in workers)
