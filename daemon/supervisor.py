"""The supervisor: the one process `facecast run` (and systemd) starts (DESIGN §1, §5).

It spawns the workers that `facecast.daemon.layout.plan` asks for, answers them on the control
socket (Hello → Assignment; Heartbeat; BootFailed; Event), restarts the ones that die or hang,
forwards events to the output worker's Markers stream, answers the CLI (status, reload, stop),
talks to systemd (READY=1, WATCHDOG=1, STATUS=, STOPPING=1), and stops everything in order.

Everything happens in one loop (`Supervisor.run`). Signal handlers only enqueue the signal
(STYLE §2); the loop wakes up through `signal.set_wakeup_fd` and handles it like the control
socket's `stop` and `reload` requests: one command path.

Note [Supervisor liveness]
    A worker is alive when it heartbeats: workers send them from their main loop, so a worker
    stuck in a read or an inference goes silent and is SIGKILLed after
    `daemon.heartbeat_timeout_s` (`daemon.boot_timeout_s` while it boots), then restarted like a
    worker that died (facecast.daemon.process.RestartPolicy). WATCHDOG=1 goes to systemd from
    the same loop, so a stuck supervisor is restarted by systemd; it is withheld when a worker we
    SIGKILLed does not go away (a process stuck in the kernel, typically a GPU driver hang),
    which only a restart of the whole service can clear.

Note [Warm standby]
    A restarted worker on a GPU took about 4 s to work again (Python, torch, the CUDA context,
    the models loaded and run once), against a 2 s goal for every stream. So per device the
    supervisor keeps one booted spare of each role whose boot is slow there
    (`layout.standby_plan`, `daemon.warm_standby`): its Assignment says `standby`, it runs
    `Worker.prepare` and then waits, heartbeating, in state "standby". When a worker of that
    role and device dies or is killed as hung, the supervisor sends the spare `Promote` with the
    dead worker's name instead of spawning a process: the spare takes the name (process title,
    log lines, a new control connection under that identity) and says Hello; its Assignment and
    boot are then the normal ones, minus what prepare already did. A fresh spare is started
    STANDBY_RESPAWN_DELAY_S later, so that it does not take the CPU from the promoted worker's
    boot. A spare built for a config that a reload changed is replaced; if the config moved on
    between prepare and boot anyway, boot loads the models again (slow, never wrong).

Note [Fault injection]
    The soak test (tests/soak) spoils frames on purpose to prove that checksums catch them. The
    hook is an `InjectFault` control message, which no CLI verb sends, and the supervisor obeys
    it only when it was started with FACECAST_ALLOW_FAULT_INJECTION=1 (a unit file never sets
    it); otherwise it answers with the reason and changes nothing. An accepted fault goes to the
    camera's capture worker, which corrupts the next frame's slot after committing it and puts a
    `fault_injected` marker (with the frame's capture time) on the Markers stream.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import msgspec
import zmq

from facecast.daemon import layout
from facecast.daemon.layout import ROLES_IN_STOP_ORDER, ReloadRefused, WorkerSpec
from facecast.daemon.process import RestartPolicy, WorkerProcess
from facecast.daemon.sd_notify import Notifier
from facecast.shared import config as config_mod
from facecast.shared import endpoints, messages, shm
from facecast.shared.messages import (
    Ack,
    Assignment,
    BootFailed,
    CameraReport,
    DaemonStatus,
    Event,
    GpuStatus,
    Heartbeat,
    Hello,
    InjectFault,
    MessageGate,
    Promote,
    ReloadRequest,
    StatusRequest,
    StopRequest,
)
from facecast.shared.transport import runtime_dir_for

log = logging.getLogger(__name__)

LOOP_TICK_MS = 100
STATUS_INTERVAL_S = 2.0
UNKILLABLE_AFTER_S = 10.0  # a SIGKILLed worker still there after this: withhold WATCHDOG=1
OUTPUT_FLUSH_S = 0.3  # time the output worker gets to push the stop marker before its TERM
RECENT_EVENTS = 50
# pylsl inlets (LabRecorder's too) take a moment to find a re-created outlet; markers pushed
# before that are lost to them. Events wait this long after the output worker (re)starts.
MARKERS_SETTLE_S = 2.0
PENDING_EVENTS_MAX = 1000
FAULT_INJECTION_ENV = "FACECAST_ALLOW_FAULT_INJECTION"  # Note [Fault injection]
STANDBY_RESPAWN_DELAY_S = 3.0  # Note [Warm standby]


class AlreadyRunning(RuntimeError):
    pass


class GpuMonitor:
    """NVML, initialised once for the supervisor's life (an init can take seconds where the
    driver's persistence mode is off, far too slow for every `facecast status`). No CUDA
    context here: the supervisor stays light."""

    def __init__(self) -> None:
        self.note = ""
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # no driver, no library: the CPU it is  # noqa: BLE001
            self.note = f"NVML unavailable: {exc}"

    def count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount()) if self._nvml is not None else 0

    def status(self) -> list[GpuStatus]:
        if self._nvml is None:
            return []
        nvml, gpus = self._nvml, []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
                gpus.append(GpuStatus(
                    index=index, name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_used_mib=round(memory.used / 2**20, 1),
                    memory_total_mib=round(memory.total / 2**20, 1),
                    utilization_pct=float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                ))
        except Exception as exc:  # noqa: BLE001 - a GPU fell off the bus: report, don't die
            self.note = f"NVML query failed: {exc}"
        return gpus

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


class Supervisor:
    def __init__(
        self,
        config: config_mod.Config,
        config_path: str,
        *,
        duration_s: float | None = None,
        notifier: Notifier | None = None,
        status_every_s: float | None = None,
        gpus: int | None = None,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.duration_s = duration_s
        self.notifier = notifier or Notifier(unset_environment=True)
        self.status_every_s = status_every_s
        self.gpu_monitor = GpuMonitor()
        self.gpu_count = self.gpu_monitor.count() if gpus is None else gpus
        if self.gpu_count == 0:
            log.info("no GPU (%s): models run on the CPU", self.gpu_monitor.note or "none found")
        self.policy = policy or RestartPolicy()
        self.allow_fault_injection = os.environ.get(FAULT_INJECTION_ENV) == "1"
        self.runtime_dir = runtime_dir_for(config.daemon.runtime_dir)
        self.control_endpoint = endpoints.control(self.runtime_dir)
        self.workers: dict[str, WorkerProcess] = {}
        self.ready = False
        self.started_monotonic = time.monotonic()
        self._pending_signals: collections.deque[int] = collections.deque()
        self._stop_requested = False
        self._pending_events: collections.deque[Event] = collections.deque(maxlen=PENDING_EVENTS_MAX)
        self._recent_events: collections.deque[str] = collections.deque(maxlen=RECENT_EVENTS)
        self._gate = MessageGate("control socket")
        self._next_status_monotonic = 0.0
        self._next_watchdog_monotonic = 0.0
        self._next_live_line_monotonic = 0.0
        self._lock_file = None

    # ============================================================================================
    # The loop
    # ============================================================================================

    def run(self) -> int:
        self._take_lock()
        context = zmq.Context()
        wakeup_read, wakeup_write = socket.socketpair()
        wakeup_write.setblocking(False)
        previous_handlers = self._install_signal_handlers(wakeup_write)
        self.control = context.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its name back
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)  # know when the output worker is away
        try:
            self._remove_stale_sockets()
            self.control.bind(self.control_endpoint)
            poller = zmq.Poller()
            poller.register(self.control, zmq.POLLIN)
            poller.register(wakeup_read, zmq.POLLIN)
            self.notifier.status("starting workers")
            self.event("start", config=self.config_path, cameras=len(self.config.cameras))
            log.info("facecast supervisor %d: runtime dir %s, %d camera(s), %s", os.getpid(),
                     self.runtime_dir, len(self.config.cameras),
                     f"{self.gpu_count} GPU(s)" if self.gpu_count else "no GPU")
            for spec in layout.plan(self.config, self.gpu_count):
                self._start(WorkerProcess(spec, self.policy))
            for spec in layout.standby_plan(self.config, self.gpu_count):
                self._start(WorkerProcess(spec, self.policy))
            deadline = None if self.duration_s is None else time.monotonic() + self.duration_s
            while not self._stop_requested:
                events = dict(poller.poll(LOOP_TICK_MS))
                if wakeup_read in events:
                    wakeup_read.recv(4096)
                self._handle_signals()
                if self.control in events:
                    self._serve_control()
                self._reap()
                self._check_liveness()
                self._start_due()
                self._flush_events()
                self._tick_systemd()
                self._print_live_status()
                if deadline is not None and time.monotonic() >= deadline:
                    log.info("--duration reached; stopping")
                    self._stop_requested = True
            self.shutdown()
            return 0
        finally:
            signal.set_wakeup_fd(-1)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            self.control.close()
            context.term()
            wakeup_read.close()
            wakeup_write.close()
            self._remove_stale_sockets()
            self._release_lock()
            self.notifier.close()
            self.gpu_monitor.close()

    def _install_signal_handlers(self, wakeup_write: socket.socket) -> dict:
        def enqueue(signum, frame):  # nothing else here: the loop does the work (STYLE §2)
            self._pending_signals.append(signum)

        signal.set_wakeup_fd(wakeup_write.fileno(), warn_on_full_buffer=False)
        previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[signum] = signal.signal(signum, enqueue)
        return previous

    def _handle_signals(self) -> None:
        while self._pending_signals:
            signum = self._pending_signals.popleft()
            if signum == signal.SIGHUP:
                log.info("SIGHUP: reloading %s", self.config_path)
                self.reload()
            else:
                log.info("%s: stopping", signal.Signals(signum).name)
                self._stop_requested = True

    # ============================================================================================
    # Workers
    # ============================================================================================

    def _start(self, worker: WorkerProcess) -> None:
        env = dict(os.environ)
        env["FACECAST_LOG_LEVEL"] = self.config.daemon.log_level
        self.workers[worker.name] = worker
        worker.start(self.control_endpoint, env)

    def _reap(self) -> None:
        for worker in list(self.workers.values()):
            returncode = worker.reap()
            if returncode is None or worker.popen is None:
                continue
            if worker.state == "stopping":
                worker.popen, worker.state = None, "stopped"
                continue
            state = worker.on_exit(returncode)
            reason = worker.exit_reason
            log.log(logging.ERROR if state in ("failed", "flapping") else logging.WARNING,
                    "worker %s ended (%s): %s", worker.name, worker.last_exit,
                    {"backoff": "restarting", "failed": f"not restarted: {reason}",
                     "flapping": f"given up: {reason}"}[state])
            if state in ("failed", "flapping"):
                self.event("worker_failed", worker=worker.name, reason=reason)

    def _start_due(self) -> None:
        now = time.monotonic()
        for worker in list(self.workers.values()):
            if now < worker.next_start_monotonic:
                continue
            if worker.state == "pending":  # a spare was promoted: start the next one
                self._start(worker)
            elif worker.state == "backoff":
                worker.restarts += 1
                reason = worker.exit_reason
                worker.detail = ""
                standby = self._ready_standby(worker.spec)
                promoted = standby is not None and self._promote(standby, worker)
                if not promoted:
                    self._start(worker)
                self.event("worker_restart", worker=worker.name, reason=reason,
                           restarts=worker.restarts, warm_standby=promoted)

    def _ready_standby(self, spec: WorkerSpec) -> WorkerProcess | None:
        """A booted spare for a worker of this role and device (Note [Warm standby])."""
        if spec.standby:
            return None
        for worker in self.workers.values():
            if (worker.spec.standby and worker.spec.role == spec.role
                    and worker.spec.device == spec.device and worker.state == "standby"
                    and worker.alive()):
                return worker
        return None

    def _promote(self, standby: WorkerProcess, worker: WorkerProcess) -> bool:
        try:
            self.control.send_multipart([standby.name.encode(),
                                         messages.encode(Promote(worker=worker.name))])
        except zmq.ZMQError as exc:  # it went away just now: spawn as usual
            log.warning("could not promote %s: %s", standby.name, exc)
            return False
        log.info("worker %s: warm standby pid %d takes over", worker.name, standby.pid)
        standby.hand_over(worker, STANDBY_RESPAWN_DELAY_S)
        return True

    def _check_liveness(self) -> None:
        """Note [Supervisor liveness]."""
        now = time.monotonic()
        daemon = self.config.daemon
        for worker in self.workers.values():
            if not worker.alive() or worker.kill_sent_monotonic is not None:
                continue
            if worker.state == "booting" and now - worker.started_monotonic > daemon.boot_timeout_s:
                worker.detail = f"hung: did not start within {daemon.boot_timeout_s:g} s"
            elif (worker.state in ("running", "standby")
                  and now - worker.last_heartbeat_monotonic > daemon.heartbeat_timeout_s):
                worker.detail = (f"hung: no heartbeat for "
                                 f"{now - worker.last_heartbeat_monotonic:.1f} s")
            else:
                continue
            log.error("worker %s (pid %d) %s; killing it", worker.name, worker.pid, worker.detail)
            worker.signal(signal.SIGKILL)

    def _stop_workers(self, workers: list[WorkerProcess], deadline_monotonic: float) -> None:
        """TERM, wait until the deadline, KILL, reap (STYLE §7)."""
        for worker in workers:
            if worker.alive():
                worker.state = "stopping"
                worker.signal(signal.SIGTERM)
            elif worker.state != "stopped":
                worker.state, worker.popen = "stopped", None
        while any(w.alive() for w in workers) and time.monotonic() < deadline_monotonic:
            time.sleep(0.02)
        for worker in workers:
            if worker.alive():
                log.warning("worker %s did not stop in time; killing it", worker.name)
                worker.signal(signal.SIGKILL)
        for worker in workers:
            if worker.popen is not None:
                try:
                    worker.popen.wait(timeout=2.0)
                except Exception:  # noqa: BLE001 (subprocess.TimeoutExpired: reported below)
                    log.error("worker %s (pid %d) is stuck even after SIGKILL", worker.name,
                              worker.pid)
                worker.popen = None
            worker.state = "stopped"

    def shutdown(self) -> None:
        """Capture first, output last, everything within daemon.stop_timeout_s (DESIGN §5)."""
        start = time.monotonic()
        deadline = start + self.config.daemon.stop_timeout_s
        self.notifier.stopping()
        self.notifier.status("stopping")
        self.event("stop")
        for index, role in enumerate(ROLES_IN_STOP_ORDER):
            group = [w for w in self.workers.values() if w.spec.role == role]
            if role == "output":
                # The output worker pushes the stop marker before it goes.
                self._flush_events(settled=True)
                time.sleep(OUTPUT_FLUSH_S)
            groups_left = len(ROLES_IN_STOP_ORDER) - index
            group_deadline = time.monotonic() + max(0.3, (deadline - time.monotonic()) / groups_left)
            group_start = time.monotonic()
            self._stop_workers(group, min(group_deadline, deadline) if role != "output" else deadline)
            log.debug("stopped %d %s worker(s) in %.2f s", len(group), role,
                      time.monotonic() - group_start)
        # Rings of workers that were SIGKILLed at some point: their owner is gone (DESIGN §5).
        swept = shm.sweep_dead_owners() + shm.sweep_dead_cuda_ipc_files()
        if swept:
            log.info("removed %d shared-memory segment(s) left by killed workers", len(swept))
        log.info("stopped in %.2f s", time.monotonic() - start)

    # ============================================================================================
    # Control socket: workers and the CLI
    # ============================================================================================

    def _serve_control(self) -> None:
        while self.control.poll(0):
            frames = self.control.recv_multipart()
            identity, payload = frames[0], frames[-1]
            message = self._gate.decode(payload)
            if message is None:
                continue
            if isinstance(message, Hello):
                self._on_hello(identity, message)
            elif isinstance(message, Heartbeat):
                self._on_heartbeat(message)
            elif isinstance(message, BootFailed):
                worker = self.workers.get(message.worker)
                if worker is not None:
                    worker.boot_error = message.reason
            elif isinstance(message, Event):
                self._on_worker_event(message)
            elif isinstance(message, StatusRequest):
                self._reply(identity, self.status(message.id))
            elif isinstance(message, ReloadRequest):
                ok, error = self.reload()
                self._reply(identity, Ack(reply_to=message.id, ok=ok, error=error))
            elif isinstance(message, StopRequest):
                self._reply(identity, Ack(reply_to=message.id))
                self._stop_requested = True
            elif isinstance(message, InjectFault):
                self._reply(identity, self._inject_fault(message))

    def _reply(self, identity: bytes, message: messages.Message) -> None:
        try:
            self.control.send_multipart([identity, messages.encode(message)])
        except zmq.ZMQError as exc:  # the asker went away
            log.debug("could not answer %r: %s", identity, exc)

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        worker = self.workers.get(hello.worker)
        if worker is None or worker.pid != hello.pid or identity != hello.worker.encode():
            log.warning("ignoring hello from unknown worker %r (pid %d)", hello.worker, hello.pid)
            return
        self._reply(identity, self._assignment(worker.spec))

    def _assignment(self, spec: WorkerSpec) -> Assignment:
        return Assignment(worker=spec.name, config=msgspec.json.encode(self.config),
                          camera_ids=list(spec.camera_ids), device=spec.device,
                          standby=spec.standby)

    def _on_heartbeat(self, heartbeat: Heartbeat) -> None:
        worker = self.workers.get(heartbeat.worker)
        if worker is None or not worker.alive() or worker.state == "stopping":
            return
        worker.last_heartbeat_monotonic = time.monotonic()
        worker.reports, worker.stages = heartbeat.cameras, heartbeat.stages
        worker.rejected_messages = heartbeat.rejected_messages
        if heartbeat.state in ("running", "standby") and worker.state == "booting":
            worker.state = heartbeat.state
            log.info("worker %s %s (pid %d, boot %.1f s)", worker.name, heartbeat.state,
                     worker.pid, time.monotonic() - worker.started_monotonic)

    def _inject_fault(self, fault: InjectFault) -> Ack:
        """Note [Fault injection]."""
        worker = self.workers.get(f"capture:{fault.camera_id}")
        if not self.allow_fault_injection:
            error = (f"fault injection is off: start the daemon with {FAULT_INJECTION_ENV}=1 "
                     "to allow it (tests only)")
        elif fault.kind not in messages.FAULT_KINDS:
            error = (f"unknown fault {fault.kind!r} (allowed: "
                     f"{', '.join(messages.FAULT_KINDS)})")
        elif worker is None or worker.state != "running":
            error = f"no running capture worker for camera {fault.camera_id!r}"
        else:
            try:
                self.control.send_multipart([worker.name.encode(), messages.encode(fault)])
            except zmq.ZMQError as exc:  # it is restarting
                error = f"capture worker of camera {fault.camera_id!r} unreachable: {exc}"
            else:
                log.warning("fault injection: %s on camera %s", fault.kind, fault.camera_id)
                return Ack(reply_to=fault.id)
        log.warning("refused to inject %s on camera %s: %s", fault.kind, fault.camera_id, error)
        return Ack(reply_to=fault.id, ok=False, error=error)

    def _on_worker_event(self, event: Event) -> None:
        log.info("event %s %s", event.kind, event.fields)
        self._queue_event(event)

    def event(self, kind: str, **fields: str | int | float | bool) -> None:
        """An event of the supervisor's own, for the Markers stream."""
        import pylsl

        self._queue_event(Event(kind=kind, fields=fields, event_ts_lsl=pylsl.local_clock()))

    def _queue_event(self, event: Event) -> None:
        self._recent_events.append(f"{event.kind} {msgspec.json.encode(event.fields).decode()}")
        self._pending_events.append(event)

    def _flush_events(self, settled: bool = False) -> None:
        output = self.workers.get("output")
        if output is None or output.state != "running":
            return  # kept (bounded) until the output worker is up again
        if not settled and time.monotonic() - output.started_monotonic < MARKERS_SETTLE_S:
            return  # let inlets find the (re)created Markers outlet first, or they miss these
        while self._pending_events:
            try:
                self.control.send_multipart([b"output", messages.encode(self._pending_events[0])])
            except zmq.ZMQError:
                return  # not connected (yet): try again next tick
            self._pending_events.popleft()

    # ============================================================================================
    # Reload
    # ============================================================================================

    def reload(self) -> tuple[bool, str]:
        """Re-read the config file and apply what changed; a bad file changes nothing."""
        self.notifier.reloading()
        try:
            new = config_mod.load(self.config_path)
            change = layout.reload_plan(self.config, new, self.gpu_count)
        except (config_mod.ConfigError, ReloadRefused) as exc:
            log.error("reload refused, keeping the running config: %s", exc)
            self.event("reload_refused", reason=str(exc))
            self.notifier.ready(f"reload refused: {exc}")
            return False, str(exc)
        old, self.config = self.config, new
        stop = [self.workers[s.name] for s in change.stop + change.restart if s.name in self.workers]
        self._stop_workers(stop, time.monotonic() + self.config.daemon.stop_timeout_s)
        for spec in change.stop:
            self.workers.pop(spec.name, None)
        for spec in change.reassign:
            worker = self.workers[spec.name]
            worker.spec = spec
            self._reply(spec.name.encode(), self._assignment(spec))
        for spec in change.start + change.restart:
            self._start(WorkerProcess(spec, self.policy))
        self._replace_standbys(old)
        summary = (f"started {len(change.start)}, stopped {len(change.stop)}, restarted "
                   f"{len(change.restart)}, reassigned {len(change.reassign)} worker(s)")
        log.info("reloaded %s: %s", self.config_path, summary)
        self.event("reload", config=self.config_path, result=summary)
        self.notifier.ready(f"reloaded: {summary}")
        return True, ""

    def _replace_standbys(self, old: config_mod.Config) -> None:
        """After a reload: the spares the new config asks for, with models loaded for it."""
        wanted = {spec.name: spec for spec in layout.standby_plan(self.config, self.gpu_count)}
        models_changed = old.models != self.config.models or old.output != self.config.output
        stale = [w for w in self.workers.values() if w.spec.standby and (
            w.name not in wanted or (models_changed and w.spec.role != "capture"))]
        self._stop_workers(stale, time.monotonic() + self.config.daemon.stop_timeout_s)
        for worker in stale:
            del self.workers[worker.name]
        for name, spec in wanted.items():
            if name not in self.workers:
                self._start(WorkerProcess(spec, self.policy))

    # ============================================================================================
    # Status, readiness, systemd
    # ============================================================================================

    def _workers_up(self) -> bool:
        """Every worker of the config (not the spares) has booted, or was given up on: READY=1
        then means the streams carry measurements. (On a GPU the inference workers prepare their
        CUDA graphs at boot, Note [Warm shapes], which takes seconds after the first frames.)"""
        return all(w.state in ("running", "failed", "flapping")
                   for w in self.workers.values() if not w.spec.standby)

    def _cameras_settled(self) -> bool:
        """Every camera has produced a frame or been reported unavailable (DESIGN §5)."""
        for camera in self.config.cameras:
            worker = self.workers.get(f"capture:{camera.id}")
            if worker is None:
                continue
            if worker.state in ("failed", "flapping"):
                continue
            report = next(iter(worker.reports), None)
            if report is None or not (report.frames > 0 or report.source.startswith("lost")):
                return False
        return True

    def _tick_systemd(self) -> None:
        now = time.monotonic()
        if not self.ready and self._cameras_settled() and self._workers_up():
            self.ready = True
            log.info("ready: %s", self.summary())
            self.notifier.ready(self.summary())
        interval_s = self.notifier.watchdog_interval_s()
        if interval_s is not None and now >= self._next_watchdog_monotonic:
            stuck = [w.name for w in self.workers.values() if w.kill_sent_monotonic is not None
                     and w.alive() and now - w.kill_sent_monotonic > UNKILLABLE_AFTER_S]
            if stuck:
                log.error("withholding WATCHDOG=1: %s survive SIGKILL", ", ".join(stuck))
            else:
                self.notifier.watchdog()
            self._next_watchdog_monotonic = now + interval_s
        if now >= self._next_status_monotonic:
            self.notifier.status(self.summary())
            self._next_status_monotonic = now + STATUS_INTERVAL_S

    def summary(self) -> str:
        """One line for STATUS= and the log."""
        cameras = self._camera_views()
        fps = sum(v["fps"] for v in cameras.values())
        faces = sum(v["faces"] for v in cameras.values())
        unhealthy = [w.name for w in self.workers.values() if w.state not in ("running", "booting")]
        workers = "workers ok" if not unhealthy else "not running: " + ", ".join(unhealthy)
        return f"{len(cameras)} camera(s), {fps:.1f} fps out, {faces} face(s); {workers}"

    def _camera_views(self) -> dict[str, dict]:
        views = {}
        for camera in self.config.cameras:
            capture = self._report(f"capture:{camera.id}", camera.id)
            output = self._report("output", camera.id)
            views[camera.id] = {
                "fps": output.fps if output else 0.0,
                "capture_fps": capture.fps if capture else 0.0,
                "faces": output.faces if output else 0,
                "transport": capture.transport if capture else "",
                "source": capture.source if capture else "",
                "reason": capture.fallback_reason if capture else "",
                "latency": output.latency_ms if output else None,
            }
        return views

    def _report(self, worker_name: str, camera_id: str) -> CameraReport | None:
        worker = self.workers.get(worker_name)
        if worker is None:
            return None
        return next((r for r in worker.reports if r.camera_id == camera_id), None)

    def _print_live_status(self) -> None:
        if not self.status_every_s:
            return
        now = time.monotonic()
        if now < self._next_live_line_monotonic:
            return
        self._next_live_line_monotonic = now + self.status_every_s
        for camera_id, view in self._camera_views().items():
            latency = view["latency"]
            latency_text = (f"latency p50 {latency.p50_ms:.0f} ms p99 {latency.p99_ms:.0f} ms"
                            if latency else "latency -")
            source = "" if view["source"] in ("ok", "") else f", {view['source']}"
            print(f"{camera_id}: {view['fps']:.1f}/{view['capture_fps']:.1f} fps, "
                  f"{view['faces']} face(s), {view['transport'] or '-'}, {latency_text}{source}",
                  file=sys.stderr, flush=True)

    def status(self, reply_to: str) -> DaemonStatus:
        cameras: dict[str, list[CameraReport]] = {c.id: [] for c in self.config.cameras}
        stages = {}
        for worker in self.workers.values():
            for report in worker.reports:
                cameras.setdefault(report.camera_id, []).append(report)
            for stage, timing in worker.stages.items():
                stages[f"{worker.name}/{stage}"] = timing
        gpus = self.gpu_monitor.status()
        return DaemonStatus(
            reply_to=reply_to, pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.started_monotonic, 1),
            config_path=self.config_path, ready=self.ready,
            workers=[w.status() for w in self.workers.values()],
            cameras=cameras, stages=stages, gpus=gpus, gpu_note=self.gpu_monitor.note,
            recent_events=list(self._recent_events)[-10:],
            rejected_messages=self._gate.rejected,
        )

    # ============================================================================================
    # Runtime directory
    # ============================================================================================

    def _take_lock(self) -> None:
        path = Path(self.runtime_dir) / "supervisor.lock"
        self._lock_file = open(path, "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise AlreadyRunning(
                f"another facecast daemon is running with runtime directory {self.runtime_dir}"
            ) from None
        self._lock_file.write(f"{os.getpid()}\n")
        self._lock_file.flush()

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            Path(self._lock_file.name).unlink(missing_ok=True)
            self._lock_file.close()
            self._lock_file = None

    def _remove_stale_sockets(self) -> None:
        """ipc:// socket files of an earlier run that was killed (we hold the lock: it is ours)."""
        for path in Path(self.runtime_dir).iterdir():
            if path.is_socket():
                path.unlink(missing_ok=True)
