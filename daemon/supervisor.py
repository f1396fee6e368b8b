"""The supervisor: the one process `facecast run` (and systemd) starts (DESIGN §1, §5).

It spawns the workers that `facecast.daemon.layout.plan` asks for, answers them on the control
socket (Hello → Assignment; Heartbeat; BootFailed; Event), restarts the ones that die or hang,
forwards events to the output worker's Markers stream, answers the CLI (status, reload, stop),
talks to systemd (READY=1, WATCHDOG=1, STATUS=, STOPPING=1), and stops everything in order.

Its rooms: `control` (the control socket: a handler per message type, Note [Worker
connections]), `reload` (a reload applied tick by tick), `shutdown` (the ordered shutdown, tick by
tick), `worker_table` (the workers, restarts, warm standbys, liveness, non-blocking stops),
`events` (the Markers events on their way), `runtime_dir` (lock, sockets, leftovers of a killed
predecessor), `gpu_monitor` (NVML), `process` (one worker's state machine). This module is the
loop that ties them together, with boot, readiness, status and systemd.

Note [Supervisor loop]
    Everything happens in one loop (`Supervisor.run`), one tick at most LOOP_TICK_MS apart, and
    nothing in it blocks: a reload that restarts workers and the shutdown are states the loop
    advances (`Reload.advance`, `Shutdown.advance`) while it goes on serving heartbeats, the
    CLI and systemd's watchdog, as gunicorn's arbiter does. Signal handlers only enqueue the
    signal (STYLE §2); the loop wakes up through `signal.set_wakeup_fd` and handles it like the
    control socket's `stop` and `reload` requests: one command path. An unexpected exception in
    the loop is logged with its traceback and leads to the same ordered shutdown (exit code 1),
    never to workers left running.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import sys
import time

import zmq

from facecast.daemon import layout, reporting
from facecast.daemon.boot_order import BootOrder
from facecast.daemon.control import ControlSocket
from facecast.daemon.events import MarkerEvents
from facecast.daemon.gallery_watch import GalleryWatch
from facecast.daemon.gpu_monitor import GpuMonitor
from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import GIVEN_UP_STATES, RestartPolicy, WorkerState
from facecast.daemon.recordings import Recordings
from facecast.daemon.reload import Reload, begin_reload
from facecast.daemon.runtime_dir import RuntimeDir
from facecast.daemon.sd_notify import Notifier
from facecast.daemon.shutdown import Shutdown
from facecast.daemon.track_ids import TrackIdAllocator
from facecast.daemon.worker_table import WorkerTable
from facecast.shared import config as config_mod
from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import RecordRequest

log = logging.getLogger(__name__)

S = WorkerState
LOOP_TICK_MS = 100
STATUS_INTERVAL_S = 2.0


class Supervisor:
    """The daemon: its rooms, tied together by one loop (Note [Supervisor loop])."""

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
        self.face_models = reporting.face_models_line(config)
        self.config_path = config_path
        self.duration_s = duration_s
        self.notifier = notifier or Notifier(unset_environment=True)
        self.status_every_s = status_every_s
        self.gpu_monitor = GpuMonitor()
        self.gpu_count = self.gpu_monitor.count() if gpus is None else gpus
        if self.gpu_count == 0:
            log.info("no GPU (%s): models run on the CPU", self.gpu_monitor.note or "none found")
        self.runtime = RuntimeDir(config.daemon.runtime_dir)
        self.control_endpoint = endpoints.control(self.runtime.path)
        self.events = MarkerEvents()
        self.track_ids = TrackIdAllocator()  # Note [Track id blocks]: one for the daemon's life
        self.workers = WorkerTable(self.control_endpoint, policy or RestartPolicy(),
                                   send=self.send_to, event=self.event)
        self.workers.log_level = config.daemon.log_level
        self.control = ControlSocket(self.control_endpoint, self.workers)
        self.ready = False
        self.started_monotonic = time.monotonic()
        self._pending_signals: collections.deque[int] = collections.deque()
        self.stop_requested = False  # by a signal, `facecast stop` or --duration
        self._reload: Reload | None = None
        self.boot_order = BootOrder(self.workers, self.control)  # Note [Boot order]
        self.start_at_ready: list[WorkerSpec] = []  # Note [Console after READY]
        self.shutdown: Shutdown | None = None
        self.recordings = Recordings(self.workers, self.gpu_count)  # Note [Recording]
        self._next_status_monotonic = 0.0
        self._next_watchdog_monotonic = 0.0
        self._next_live_line_monotonic = 0.0
        self.gallery_watch = GalleryWatch(self.event)  # Note [Gallery validation]

    # ============================================================================================
    # The loop (Note [Supervisor loop])
    # ============================================================================================

    def run(self) -> int:
        leftovers = self.runtime.take_lock()
        if leftovers:
            log.warning("%s", leftovers.describe())
        context = zmq.Context()
        wakeup_read, wakeup_write = socket.socketpair()
        wakeup_write.setblocking(False)
        previous_handlers = self._install_signal_handlers(wakeup_write)
        control = self.control.open(context)
        exit_code = 0
        try:
            control.bind(self.control_endpoint)
            poller = zmq.Poller()
            poller.register(control, zmq.POLLIN)
            # By its fd: zmq.Poller reports a plain socket by fd, and an unread wakeup byte
            # would make every later poll return at once (a busy loop after the first signal).
            wakeup_fd = wakeup_read.fileno()
            poller.register(wakeup_fd, zmq.POLLIN)
            self._start_workers()
            deadline = None if self.duration_s is None else time.monotonic() + self.duration_s
            try:
                while not (self.shutdown is not None and self.shutdown.done):
                    events = dict(poller.poll(LOOP_TICK_MS))
                    if wakeup_fd in events:
                        wakeup_read.recv(4096)
                    if deadline is not None and time.monotonic() >= deadline:
                        log.info("--duration reached; stopping")
                        deadline, self.stop_requested = None, True
                    self._tick()
            except Exception:  # noqa: BLE001 - whatever it was, stop the workers in order
                log.exception("supervisor: unexpected error; stopping every worker in order")
                exit_code = 1
                self._finish_shutdown()
            return exit_code
        finally:
            signal.set_wakeup_fd(-1)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            self.control.close()
            context.term()
            wakeup_read.close()
            wakeup_write.close()
            self.runtime.remove_sockets()
            self.runtime.release()
            self.notifier.close()
            self.gpu_monitor.close()

    def _start_workers(self) -> None:
        self.notifier.status("starting workers")
        self.event("start", config=self.config_path, cameras=len(self.config.cameras))
        log.info("facecast supervisor %d: runtime dir %s, %d camera(s), %s", os.getpid(),
                 self.runtime.path, len(self.config.cameras),
                 f"{self.gpu_count} GPU(s)" if self.gpu_count else "no GPU")
        specs = layout.plan(self.config, self.gpu_count)
        self.boot_order.hold_captures(specs)
        # Note [Console after READY].
        self.start_at_ready = [s for s in specs if s.role in layout.ROLES_STARTED_AT_READY]
        for spec in specs:
            if spec not in self.start_at_ready:
                self.workers.start(spec)
        # The spares start once the daemon is READY (Note [Warm standby]).
        if self.config.record.start:
            reply = self.recordings.request(RecordRequest(action="start"), self.config,
                                            stopping=False)
            if not reply.ok:
                log.error("record.start: not recording: %s", reply.error)

    def _tick(self) -> None:
        """One turn of the loop: never blocks."""
        self._handle_signals()
        # Every turn, not only when the poll saw the socket: a worker's last message (Closed)
        # must be read before its end is reaped, and a turn woken by SIGCHLD may come first.
        self.control.serve(self)
        self.workers.reap()
        self.workers.advance_stops()
        if self.shutdown is None and self.stop_requested:
            self._begin_shutdown()
        if self.shutdown is not None:
            self.shutdown.advance()
            return
        self.workers.check_liveness(self.config.daemon)
        self.boot_order.release_captures_when_inference_is_up()
        self.recordings.forget_stopped_recorders()
        self.workers.start_due()
        self._advance_reload()
        self.gallery_watch.check(self.config.participants)
        self._flush_events()
        self._tick_systemd()
        self._print_live_status()

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
                self.stop_requested = True

    # ============================================================================================
    # Shutdown: console first, output last, everything within daemon.stop_timeout_s (DESIGN §5)
    # ============================================================================================

    def _begin_shutdown(self) -> None:
        self.shutdown = Shutdown(self.workers, self._flush_events,
                                 time.monotonic() + self.config.daemon.stop_timeout_s)
        self._reload = None  # its workers are stopped with the rest
        self.notifier.stopping()
        self.notifier.status("stopping")
        self.event("stop")

    def _finish_shutdown(self) -> None:
        """After an unexpected error in the loop: the ordered shutdown, ticked here."""
        try:
            if self.shutdown is None:
                self._begin_shutdown()
            self.shutdown.run_to_the_end(LOOP_TICK_MS / 1000)
        except Exception:  # noqa: BLE001 - last resort: no worker outlives the supervisor
            log.exception("supervisor: the ordered shutdown failed; killing every worker")
            for worker in self.workers:
                worker.signal(signal.SIGKILL)

    # ============================================================================================
    # Reload (Note [Supervisor loop]: applied over several ticks)
    # ============================================================================================

    def reload(self) -> tuple[bool, str]:
        """Re-read the config file and apply what changed; a bad file changes nothing."""
        if self.shutdown is not None:
            return False, "the daemon is stopping"
        if self._reload is not None:
            return False, "the previous reload is still being applied; try again in a moment"
        self._reload, error = begin_reload(self)
        if self._reload is None:
            return False, error
        self._advance_reload()
        return True, ""

    def _advance_reload(self) -> None:
        if self._reload is not None and self._reload.advance(self):
            self._reload = None

    def start_missing_standbys(self) -> None:
        """Note [Warm standby]: the spares this config asks for that have no record yet."""
        for spec in layout.standby_plan(self.config, self.gpu_count):
            if self.workers.get(spec.name) is None:
                self.workers.start(spec)

    # ============================================================================================
    # The control socket's outgoing side, and events for the Markers stream
    # ============================================================================================

    def send_to(self, worker_name: str, message: messages.Message) -> bool:
        """To a worker over its control connection; False when it is not connected."""
        return self.control.send_to(worker_name, message)

    def event(self, kind: str, **fields: str | int | float | bool) -> None:
        """An event of the supervisor's own, for the Markers stream."""
        self.events.new(kind, **fields)

    def _flush_events(self) -> None:
        output = self.workers.get("output")
        self.events.flush(lambda event: self.send_to("output", event),
                          output is not None and output.state is S.RUNNING)

    # ============================================================================================
    # Status, readiness, systemd
    # ============================================================================================

    def _workers_up(self) -> bool:
        """Every worker of the config (not the spares) has booted, or was given up on: READY=1
        then means the streams carry measurements. (On a GPU the inference workers prepare their
        CUDA graphs at boot, Note [Warm shapes], which takes seconds after the first frames.)"""
        return all(w.state is S.RUNNING or w.state in GIVEN_UP_STATES
                   for w in self.workers if not w.spec.standby)

    def _cameras_settled(self) -> bool:
        """Every camera has produced a frame or been reported unavailable (DESIGN §5)."""
        for camera in self.config.cameras:
            worker = self.workers.capture_of(camera.id)
            if worker is None or worker.state in GIVEN_UP_STATES:
                continue
            report = next((r for r in worker.reports if r.camera_id == camera.id), None)
            if report is None or not (report.frames > 0 or report.source.startswith("lost")):
                return False
        return True

    def _tick_systemd(self) -> None:
        now = time.monotonic()
        if not self.ready and self._cameras_settled() and self._workers_up():
            self.ready = True
            log.info("ready in %.1f s: %s", now - self.started_monotonic, self.summary())
            self.notifier.ready(self.summary())
            for spec in self.start_at_ready:
                if self.workers.get(spec.name) is None:  # a reload may have started it
                    self.workers.start(spec)
            self.start_at_ready = []
            self.start_missing_standbys()
        interval_s = self.notifier.watchdog_interval_s()
        if interval_s is not None and now >= self._next_watchdog_monotonic:
            stuck = self.workers.stuck()
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
        return reporting.summary(self.config, self.workers)

    def _print_live_status(self) -> None:
        if not self.status_every_s:
            return
        now = time.monotonic()
        if now < self._next_live_line_monotonic:
            return
        self._next_live_line_monotonic = now + self.status_every_s
        for line in reporting.camera_lines(self.config, self.workers):
            print(line, file=sys.stderr, flush=True)
