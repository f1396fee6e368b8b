"""The supervisor's ordered shutdown: the console first, output last, every worker within
daemon.stop_timeout_s (DESIGN §5; STYLE §7, gunicorn's `Arbiter.stop`).

A shutdown is a state the supervisor's loop advances tick by tick (Note [Supervisor loop]):
`Shutdown.advance` looks at the clock and the workers, begins the next stage's stops when the
previous stage's are done, and returns; it never waits. Only after an unexpected error in the
loop is it ticked here, to its end (`Shutdown.run_to_the_end`).

Runs in the supervisor only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from facecast.daemon.layout import STOP_STAGES
from facecast.daemon.process import WorkerProcess
from facecast.daemon.worker_table import WorkerTable
from facecast.shared.transport import shm

log = logging.getLogger(__name__)

OUTPUT_FLUSH_S = 0.3  # time the output worker gets to push the stop marker before its TERM
# Of daemon.stop_timeout_s, each stage still to stop after the current one keeps this much, so
# that a slow stage (many CUDA processes exiting at once) does not leave the others nothing.
STOP_RESERVE_PER_STAGE_S = 0.5


@dataclass
class Shutdown:
    """The ordered shutdown in progress, stage by stage in STOP_STAGES: the console first, a
    recorder before capture, capture and inference together, output last (DESIGN §5).
    `flush_events` hands the Markers events still waiting to the output worker, before its
    TERM."""

    workers: WorkerTable
    flush_events: Callable[[], None]
    deadline_monotonic: float
    started_monotonic: float = field(default_factory=time.monotonic)
    next_stage: int = 0
    group: list[WorkerProcess] = field(default_factory=list)  # the stage being stopped
    asked: list[WorkerProcess] = field(default_factory=list)  # every stage's workers so far
    group_deadline_monotonic: float = 0.0  # its SIGKILL time
    terminate_at_monotonic: float = 0.0  # the output worker gets OUTPUT_FLUSH_S first
    done: bool = False

    def advance(self) -> None:
        """One tick's worth: never waits."""
        workers = self.workers
        now = time.monotonic()
        while not self.done:
            if self.terminate_at_monotonic:
                if self.terminate_at_monotonic > now:
                    return  # the output worker pushes the stop marker first
                self.terminate_at_monotonic = 0.0
                workers.begin_stop(self.group, self.group_deadline_monotonic)
            # Again every tick: a worker of the group that ended by itself meanwhile (reaped as
            # an unexpected exit) is marked stopped instead of being waited for.
            workers.begin_stop(self.group, self.group_deadline_monotonic)
            # Note [A closed worker is not killed]: the next stage does not wait for the driver
            # to end this one's processes; the shutdown's end does.
            if self.group and not workers.all_done_with_their_work(self.group):
                return
            if self.next_stage == len(STOP_STAGES):
                if not workers.all_stopped(self.asked):  # a closed or killed one still ending
                    return
                self._finish()
                self.done = True
                return
            roles = STOP_STAGES[self.next_stage]
            self.next_stage += 1
            self.group = [w for w in workers if w.spec.role in roles]
            self.asked += self.group
            stages_after = len(STOP_STAGES) - self.next_stage
            self.group_deadline_monotonic = min(self.deadline_monotonic, max(
                now + 0.3, self.deadline_monotonic - STOP_RESERVE_PER_STAGE_S * stages_after))
            if roles == ("output",):
                self.flush_events()
                self.terminate_at_monotonic = now + OUTPUT_FLUSH_S
                continue
            workers.begin_stop(self.group, self.group_deadline_monotonic)

    def _finish(self) -> None:
        # Anything a worker left that reaping did not catch (DESIGN §5: nothing left in /dev/shm).
        segments, cuda_ipc_files = shm.sweep_all_dead()
        swept = segments + cuda_ipc_files
        if swept:
            log.info("removed %d file(s) of processes that are gone from /dev/shm", len(swept))
        log.info("stopped in %.2f s", time.monotonic() - self.started_monotonic)

    def run_to_the_end(self, tick_s: float) -> None:
        """After an unexpected error in the loop: the ordered shutdown, ticked here."""
        while not self.done:
            self.workers.reap()
            self.workers.advance_stops()
            self.advance()
            time.sleep(tick_s)

