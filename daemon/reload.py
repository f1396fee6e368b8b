"""The supervisor's reload: the config file read again, and what changed applied (SIGHUP and
`facecast reload` alike; DESIGN §5).

A bad file changes nothing. A good one is applied over several ticks of the supervisor's loop
(Note [Supervisor loop]): `begin_reload` adopts the new config, reassigns the workers that only
need a new Assignment and begins stopping the ones it removes or restarts; `Reload.advance`
starts the new ones once those are stopped. Nothing here waits.

Runs in the supervisor only; it changes the supervisor's config and workers, as the supervisor's
own methods would (the `supervisor` argument, as circus's commands get the arbiter).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from facecast.daemon import layout, reporting
from facecast.daemon.control import assignment
from facecast.daemon.layout import ReloadRefused, WorkerSpec
from facecast.daemon.process import WorkerProcess
from facecast.daemon.worker_table import WorkerTable
from facecast.shared import config as config_mod

if TYPE_CHECKING:
    from facecast.daemon.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass
class Reload:
    """A reload being applied (Note [Supervisor loop]): these workers are stopping; once they
    are stopped, these specs start."""

    stopping: list[WorkerProcess]
    start: list[WorkerSpec]
    remove: list[str]
    summary: str

    def advance(self, supervisor: Supervisor) -> bool:
        """One tick's worth: True once the reload is applied (its workers stopped, the new ones
        started)."""
        workers = supervisor.workers
        if not workers.all_stopped(self.stopping):
            return False
        for name in self.remove:
            workers.remove(name)
        for spec in self.start:
            workers.start(spec)
        if supervisor.ready:
            supervisor.start_missing_standbys()
        log.info("reloaded %s: %s", supervisor.config_path, self.summary)
        supervisor.event("reload", config=supervisor.config_path, result=self.summary)
        supervisor.notifier.ready(f"reloaded: {self.summary}")
        return True


def begin_reload(supervisor: Supervisor) -> tuple[Reload | None, str]:
    """Re-read the config file and begin applying what changed: (the reload, "") or (None, why
    the file was refused), the running config kept."""
    supervisor.notifier.reloading()
    try:
        new = config_mod.load(supervisor.config_path)
        change = layout.reload_plan(supervisor.config, new, supervisor.gpu_count)
    except (config_mod.ConfigError, ReloadRefused) as exc:
        log.error("reload refused, keeping the running config: %s", exc)
        supervisor.event("reload_refused", reason=str(exc))
        supervisor.notifier.ready(f"reload refused: {exc}")
        return None, str(exc)
    old, supervisor.config = supervisor.config, new
    supervisor.face_models = reporting.face_models_line(new)
    workers = supervisor.workers
    workers.log_level = new.daemon.log_level
    stale_standbys = _stale_standbys(workers, old, new, supervisor.gpu_count)
    stopping = [w for w in (workers.get(s.name) for s in change.stop + change.restart)
                if w is not None] + stale_standbys
    workers.begin_stop(stopping, time.monotonic() + new.daemon.stop_timeout_s)
    # A console not started yet (Note [Console after READY]) starts at READY as the new
    # config has it, or not at all; it has no process to reassign or stop.
    new_specs = {s.name: s for s in layout.plan(new, supervisor.gpu_count)}
    supervisor.start_at_ready = [new_specs[s.name] for s in supervisor.start_at_ready
                                 if s.name in new_specs]
    for spec in change.reassign:
        worker = workers.get(spec.name)
        if worker is None:
            continue  # not started yet: it starts with the new spec
        worker.spec = spec
        supervisor.send_to(spec.name, assignment(supervisor, spec))
    summary = (f"started {len(change.start)}, stopped {len(change.stop)}, restarted "
               f"{len(change.restart)}, reassigned {len(change.reassign)} worker(s)")
    return Reload(stopping=stopping, start=change.start + change.restart,
                  remove=[s.name for s in change.stop] + [w.name for w in stale_standbys],
                  summary=summary), ""


def _stale_standbys(workers: WorkerTable, old: config_mod.Config, new: config_mod.Config,
                    gpu_count: int) -> list[WorkerProcess]:
    """Spares the new config does not want, or whose models were loaded for the old one."""
    wanted = {spec.name for spec in layout.standby_plan(new, gpu_count)}
    models_changed = old.models != new.models or old.output != new.output
    return [w for w in workers if w.spec.standby and (
        w.name not in wanted or (models_changed and w.spec.role not in ("capture", "output")))]
