"""The supervisor: the one process `facecast run` (and systemd) starts (DESIGN §1, §5).

It spawns the workers that `facecast.daemon.layout.plan` asks for, answers them on the control
socket (Hello → Assignment; Heartbeat; BootFailed; Event), restarts the ones that die or hang,
forwards events to the output worker's Markers stream, answers the CLI (status, reload, stop),
talks to systemd (READY=1, WATCHDOG=1, STATUS=, STOPPING=1), and stops everything in order.

Its rooms: `worker_table` (the workers, restarts, warm standbys, liveness, non-blocking stops),
`events` (the Markers events on their way), `runtime_dir` (lock, sockets, leftovers of a killed
predecessor), `gpu_monitor` (NVML), `process` (one worker's state machine). This module is the
loop that ties them together.

Note [Supervisor loop]
    Everything happens in one loop (`Supervisor.run`), one tick at most LOOP_TICK_MS apart, and
    nothing in it blocks: a reload that restarts workers and the shutdown are states the loop
    advances (`_advance_reload`, `_advance_shutdown`) while it goes on serving heartbeats, the
    CLI and systemd's watchdog, as gunicorn's arbiter does. Signal handlers only enqueue the
    signal (STYLE §2); the loop wakes up through `signal.set_wakeup_fd` and handles it like the
    control socket's `stop` and `reload` requests: one command path. An unexpected exception in
    the loop is logged with its traceback and leads to the same ordered shutdown (exit code 1),
    never to workers left running.

Note [Boot order]
    On the CPU every worker starts at once. On a GPU, a device's capture workers start once its
    detection and roi_landmark workers have booted. Those prepare a CUDA graph for every batch
    size they can meet (Note [Warm shapes]): thousands of short kernels and syncs, each of which
    waits for the GPU's time slice among every context on the device. With the capture workers
    already streaming (64 cameras on the H200: 8 capture contexts, 2 inference workers), the
    detection worker's graphs took 45 s and READY came after 51 s. Started on a quiet GPU, the
    inference workers are then there for the first frames; nothing is lost, since no frame
    exists before capture starts.

Note [Worker connections]
    The control socket is a file in the runtime directory: every process of the daemon's user
    can connect to it. Workers' messages (Hello, Heartbeat, BootFailed, Event, TrackIdsWanted)
    change what the daemon believes and what goes on the Markers stream (a forged
    `record_start` in a lab's recording; issue 21), so they are accepted only from the
    connections of the processes the supervisor started. At spawn the supervisor makes a
    random secret per process (128 bits, `WorkerProcess.start`) and writes it to the child's
    stdin, a pipe: not its arguments, which `ps` shows every user, nor its environment, which
    /proc shows every process of the user. The worker connects with the routing identity
    `name#secret` (`facecast.workers.base.connection_identity`), and the supervisor routes to
    and accepts from that identity only: a worker message whose connection is not the claimed
    worker's own is refused, counted with the malformed ones (`rejected_messages` in status)
    and logged. A promoted spare keeps its process's secret under its new name. Clients (the
    CLI, the console) connect with any identity and may send only the requests that
    `Supervisor._client_handlers` names; the replies go back on their own connection. What a same-user process
    could still do is read a worker's memory, which Yama's ptrace scope (1 on common
    distributions) denies to non-descendants; the runtime directory's mode keeps other users
    out altogether. One simpler design was refused: the bare worker name as the identity
    (before issue 21), which any connection can claim, and with ROUTER_HANDOVER the claim even
    cut the real worker off.

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
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from facecast.daemon import layout, reporting
from facecast.daemon.events import MarkerEvents
from facecast.daemon.gpu_monitor import GpuMonitor
from facecast.daemon.layout import ROLES_IN_STOP_ORDER, ReloadRefused, WorkerSpec
from facecast.daemon.process import GIVEN_UP_STATES, RestartPolicy, WorkerProcess, WorkerState
from facecast.daemon.recordings import Recordings
from facecast.daemon.runtime_dir import RuntimeDir
from facecast.daemon.sd_notify import Notifier
from facecast.daemon.track_ids import TrackIdAllocator
from facecast.daemon.worker_table import WorkerTable
from facecast.shared import config as config_mod
from facecast.shared import gallery
from facecast.shared.transport import endpoints, messages, shm
from facecast.shared.transport.messages import (
    Ack,
    Assignment,
    BootFailed,
    DaemonStatus,
    Event,
    Heartbeat,
    Hello,
    InjectFault,
    MessageGate,
    RecordRequest,
    ReloadRequest,
    StatusRequest,
    StopRequest,
    TrackIdsWanted,
)

log = logging.getLogger(__name__)

S = WorkerState
LOOP_TICK_MS = 100
STATUS_INTERVAL_S = 2.0
OUTPUT_FLUSH_S = 0.3  # time the output worker gets to push the stop marker before its TERM
# Of daemon.stop_timeout_s, each role still to stop after the current one keeps this much, so
# that a slow role (many CUDA processes exiting at once) does not leave the others nothing.
STOP_RESERVE_PER_ROLE_S = 0.5
FAULT_INJECTION_ENV = "FACECAST_ALLOW_FAULT_INJECTION"  # Note [Fault injection]
# Note [Worker connections]: what only a worker's own connection may send, and what anyone may.
GALLERY_CHECK_S = 2.0  # as the workers' (Note [Gallery reload])


@dataclass
class _Reload:
    """A reload being applied (Note [Supervisor loop]): these workers are stopping; once they
    are stopped, these specs start."""

    stopping: list[WorkerProcess]
    start: list[WorkerSpec]
    remove: list[str]
    summary: str


@dataclass
class _Shutdown:
    """The ordered shutdown in progress, role by role in ROLES_IN_STOP_ORDER: the console
    first, a recorder before capture, output last (DESIGN §5)."""

    deadline_monotonic: float
    started_monotonic: float = field(default_factory=time.monotonic)
    next_role: int = 0
    group: list[WorkerProcess] = field(default_factory=list)  # the role being stopped
    group_deadline_monotonic: float = 0.0  # its SIGKILL time
    terminate_at_monotonic: float = 0.0  # the output worker gets OUTPUT_FLUSH_S first
    done: bool = False


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
        self.face_models = reporting.face_models_line(config)
        self.config_path = config_path
        self.duration_s = duration_s
        self.notifier = notifier or Notifier(unset_environment=True)
        self.status_every_s = status_every_s
        self.gpu_monitor = GpuMonitor()
        self.gpu_count = self.gpu_monitor.count() if gpus is None else gpus
        if self.gpu_count == 0:
            log.info("no GPU (%s): models run on the CPU", self.gpu_monitor.note or "none found")
        self.allow_fault_injection = os.environ.get(FAULT_INJECTION_ENV) == "1"
        self.runtime = RuntimeDir(config.daemon.runtime_dir)
        self.control_endpoint = endpoints.control(self.runtime.path)
        self.events = MarkerEvents()
        self.track_ids = TrackIdAllocator()  # Note [Track id blocks]: one for the daemon's life
        self.workers = WorkerTable(self.control_endpoint, policy or RestartPolicy(),
                                   send=self._send_to, event=self.event)
        self.workers.log_level = config.daemon.log_level
        self.control: zmq.Socket | None = None
        self.ready = False
        self.started_monotonic = time.monotonic()
        self._pending_signals: collections.deque[int] = collections.deque()
        self._stop_requested = False
        self._reload: _Reload | None = None
        self._captures_to_start: list[WorkerSpec] = []  # Note [Boot order]
        self._start_at_ready: list[WorkerSpec] = []  # Note [Console after READY]
        self._shutdown: _Shutdown | None = None
        self._gate = MessageGate("control socket")
        self.recordings = Recordings(self.workers, self.gpu_count)  # Note [Recording]
        self._next_status_monotonic = 0.0
        self._next_watchdog_monotonic = 0.0
        self._next_live_line_monotonic = 0.0
        self._next_gallery_check_monotonic = 0.0
        self._gallery_seen = ""  # the gallery's last status line (Note [Gallery validation])

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
        self.control = context.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its name back
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)  # know when the output worker is away
        exit_code = 0
        try:
            self.control.bind(self.control_endpoint)
            poller = zmq.Poller()
            poller.register(self.control, zmq.POLLIN)
            # By its fd: zmq.Poller reports a plain socket by fd, and an unread wakeup byte
            # would make every later poll return at once (a busy loop after the first signal).
            wakeup_fd = wakeup_read.fileno()
            poller.register(wakeup_fd, zmq.POLLIN)
            self._start_workers()
            deadline = None if self.duration_s is None else time.monotonic() + self.duration_s
            try:
                while not (self._shutdown is not None and self._shutdown.done):
                    events = dict(poller.poll(LOOP_TICK_MS))
                    if wakeup_fd in events:
                        wakeup_read.recv(4096)
                    if deadline is not None and time.monotonic() >= deadline:
                        log.info("--duration reached; stopping")
                        deadline, self._stop_requested = None, True
                    self._tick(serve=self.control in events)
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
        # Note [Boot order]: on a GPU, capture starts once the device's inference workers are up.
        self._captures_to_start = [s for s in specs if s.role == "capture" and s.device != "cpu"]
        # Note [Console after READY].
        self._start_at_ready = [s for s in specs if s.role in layout.ROLES_STARTED_AT_READY]
        for spec in specs:
            if spec not in self._captures_to_start and spec not in self._start_at_ready:
                self.workers.start(spec)
        # The spares start once the daemon is READY (Note [Warm standby]).
        if self.config.record.start:
            reply = self.recordings.request(RecordRequest(action="start"), self.config,
                                            stopping=False)
            if not reply.ok:
                log.error("record.start: not recording: %s", reply.error)

    def _tick(self, serve: bool) -> None:
        """One turn of the loop: never blocks."""
        self._handle_signals()
        if serve:
            self._serve_control()
        self.workers.reap()
        self.workers.advance_stops()
        if self._shutdown is None and self._stop_requested:
            self._begin_shutdown()
        if self._shutdown is not None:
            self._advance_shutdown()
            return
        self.workers.check_liveness(self.config.daemon)
        self._start_captures_when_inference_is_up()
        self.recordings.forget_stopped_recorders()
        self.workers.start_due()
        self._advance_reload()
        self._check_gallery()
        self._flush_events()
        self._tick_systemd()
        self._print_live_status()

    def _start_captures_when_inference_is_up(self) -> None:
        """Note [Boot order]."""
        if not self._captures_to_start:
            return
        inference_devices = {w.spec.device for w in self.workers
                             if w.spec.role in ("detection", "roi_landmark") and not w.spec.standby
                             and w.state is not S.RUNNING and w.state not in GIVEN_UP_STATES}
        waiting = []
        for spec in self._captures_to_start:
            if spec.device in inference_devices:
                waiting.append(spec)
            else:
                self.workers.start(spec)
        self._captures_to_start = waiting

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
    # Shutdown: console first, output last, everything within daemon.stop_timeout_s (DESIGN §5)
    # ============================================================================================

    def _begin_shutdown(self) -> None:
        self._shutdown = _Shutdown(time.monotonic() + self.config.daemon.stop_timeout_s)
        self._reload = None  # its workers are stopped with the rest
        self.notifier.stopping()
        self.notifier.status("stopping")
        self.event("stop")

    def _advance_shutdown(self) -> None:
        shutdown = self._shutdown
        now = time.monotonic()
        while not shutdown.done:
            if shutdown.terminate_at_monotonic:
                if shutdown.terminate_at_monotonic > now:
                    return  # the output worker pushes the stop marker first
                shutdown.terminate_at_monotonic = 0.0
                self.workers.begin_stop(shutdown.group, shutdown.group_deadline_monotonic)
            # Again every tick: a worker of the group that ended by itself meanwhile (reaped as
            # an unexpected exit) is marked stopped instead of being waited for.
            self.workers.begin_stop(shutdown.group, shutdown.group_deadline_monotonic)
            if shutdown.group and not self.workers.all_stopped(shutdown.group):
                return
            if shutdown.next_role == len(ROLES_IN_STOP_ORDER):
                self._finish_stop(shutdown)
                shutdown.done = True
                return
            role = ROLES_IN_STOP_ORDER[shutdown.next_role]
            shutdown.next_role += 1
            shutdown.group = [w for w in self.workers if w.spec.role == role]
            roles_after = len(ROLES_IN_STOP_ORDER) - shutdown.next_role
            shutdown.group_deadline_monotonic = min(shutdown.deadline_monotonic, max(
                now + 0.3, shutdown.deadline_monotonic - STOP_RESERVE_PER_ROLE_S * roles_after))
            if role == "output":
                self._flush_events(settled=True)
                shutdown.terminate_at_monotonic = now + OUTPUT_FLUSH_S
                continue
            self.workers.begin_stop(shutdown.group, shutdown.group_deadline_monotonic)

    def _finish_stop(self, shutdown: _Shutdown) -> None:
        # Anything a worker left that reaping did not catch (DESIGN §5: nothing left in /dev/shm).
        segments, cuda_ipc_files = shm.sweep_all_dead()
        swept = segments + cuda_ipc_files
        if swept:
            log.info("removed %d file(s) of processes that are gone from /dev/shm", len(swept))
        log.info("stopped in %.2f s", time.monotonic() - shutdown.started_monotonic)

    def _finish_shutdown(self) -> None:
        """After an unexpected error in the loop: the ordered shutdown, ticked here."""
        try:
            if self._shutdown is None:
                self._begin_shutdown()
            while not self._shutdown.done:
                self.workers.reap()
                self.workers.advance_stops()
                self._advance_shutdown()
                time.sleep(LOOP_TICK_MS / 1000)
        except Exception:  # noqa: BLE001 - last resort: no worker outlives the supervisor
            log.exception("supervisor: the ordered shutdown failed; killing every worker")
            for worker in self.workers:
                worker.signal(signal.SIGKILL)

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
            on_worker = self._worker_handlers().get(type(message))
            on_client = self._client_handlers().get(type(message))
            if on_worker is not None:
                worker = self._worker_of(identity, message)
                if worker is not None:
                    on_worker(identity, worker, message)
            elif on_client is not None:
                on_client(identity, message)
            else:  # a message the supervisor sends, never receives (Assignment, Ack...)
                allowed = ", ".join(t.__name__ for t in self._client_handlers())
                self._gate.refuse(f"{type(message).__name__} is not a request a client may send "
                                  f"(allowed: {allowed})")

    def _worker_handlers(self) -> dict[type, Callable[..., None]]:
        """A handler per message that only a worker's own connection may send."""
        return {Hello: self._on_hello, Heartbeat: self._on_heartbeat,
                BootFailed: self._on_boot_failed, Event: self._on_event,
                TrackIdsWanted: self._on_track_ids_wanted}

    def _client_handlers(self) -> dict[type, Callable[..., None]]:
        """A handler per request that any connection of this user may send (the CLI's)."""
        return {StatusRequest: self._on_status_request, ReloadRequest: self._on_reload_request,
                StopRequest: self._on_stop_request, RecordRequest: self._on_record_request,
                InjectFault: self._on_inject_fault}

    # -- clients' requests ------------------------------------------------------------------------

    def _on_status_request(self, identity: bytes, message: StatusRequest) -> None:
        self._reply(identity, self.status(message.id))

    def _on_reload_request(self, identity: bytes, message: ReloadRequest) -> None:
        ok, error = self.reload()
        self._reply(identity, Ack(reply_to=message.id, ok=ok, error=error))

    def _on_stop_request(self, identity: bytes, message: StopRequest) -> None:
        self._reply(identity, Ack(reply_to=message.id))
        self._stop_requested = True

    def _on_record_request(self, identity: bytes, message: RecordRequest) -> None:
        self._reply(identity, self.recordings.request(message, self.config,
                                                      stopping=self._shutdown is not None))

    def _on_inject_fault(self, identity: bytes, message: InjectFault) -> None:
        self._reply(identity, self._inject_fault(message))

    def _worker_of(self, identity: bytes, message: messages.Message) -> WorkerProcess | None:
        """The worker whose own connection sent `message`, or None: refused, counted and logged
        (Note [Worker connections])."""
        claimed = getattr(message, "worker", None)
        if claimed is None and isinstance(message, Event):
            claimed = message.fields.get("worker", "")
        _, _, secret = identity.rpartition(b"#")
        owner = next((w for w in self.workers if w.secret and w.secret.encode() == secret),
                     None) if secret else None
        if owner is not None and owner.routing_id == identity and claimed in ("", owner.name):
            return owner
        if owner is not None:  # its process, under the name it had before a promotion
            log.debug("dropped a %s that %s sent before it was promoted",
                      type(message).__name__, owner.name)
            return None
        self._gate.refuse(f"{type(message).__name__} (as worker {claimed!r}) from a connection "
                          "that is not that worker's own; only the processes the supervisor "
                          "started may send it")
        return None

    # -- workers' messages (from their own connections only) -------------------------------------

    def _on_boot_failed(self, identity: bytes, worker: WorkerProcess, message: BootFailed) -> None:
        worker.boot_error = message.reason

    def _on_event(self, identity: bytes, worker: WorkerProcess, message: Event) -> None:
        log.info("event %s %s", message.kind, message.fields)
        self.events.add(message)
        self.recordings.on_event(message)

    def _on_track_ids_wanted(self, identity: bytes, worker: WorkerProcess,
                             message: TrackIdsWanted) -> None:
        self._reply(identity, self.track_ids.answer(message))

    def _send_to(self, worker_name: str, message: messages.Message) -> bool:
        """To a worker over its control connection; False when it is not connected."""
        worker = self.workers.get(worker_name)
        if worker is None or not worker.routing_id:
            return False
        try:
            self.control.send_multipart([worker.routing_id, messages.encode(message)])
        except zmq.ZMQError as exc:
            log.debug("could not send %s to %s: %s", type(message).__name__, worker_name, exc)
            return False
        return True

    def _reply(self, identity: bytes, message: messages.Message) -> None:
        try:
            self.control.send_multipart([identity, messages.encode(message)])
        except zmq.ZMQError as exc:  # the asker went away
            log.debug("could not answer a %s: %s", type(message).__name__, exc)

    def _on_hello(self, identity: bytes, worker: WorkerProcess, hello: Hello) -> None:
        if worker.pid != hello.pid:
            log.warning("ignoring hello from worker %r: pid %d, not %d", hello.worker, hello.pid,
                        worker.pid)
            return
        self._reply(identity, self._assignment(worker.spec))

    def _assignment(self, spec: WorkerSpec) -> Assignment:
        # Only a worker that publishes faces gets track ids; a spare gets its block with the
        # Assignment of the worker it replaces (Note [Track id blocks]).
        track_ids = (self.track_ids.grant(spec.name)
                     if spec.role == "roi_landmark" and not spec.standby else None)
        config = (self.recordings.config_for_recorder(self.config) if spec.role == "recorder"
                  else self.config)
        return Assignment(worker=spec.name, config=msgspec.json.encode(config),
                          camera_ids=list(spec.camera_ids), device=spec.device,
                          standby=spec.standby, track_ids=track_ids)

    def _on_heartbeat(self, identity: bytes, worker: WorkerProcess,
                      heartbeat: Heartbeat) -> None:
        if not worker.alive() or worker.state is S.STOPPING:
            return
        worker.last_heartbeat_monotonic = time.monotonic()
        worker.reports, worker.stages = heartbeat.cameras, heartbeat.stages
        worker.rejected_messages = heartbeat.rejected_messages
        if heartbeat.trouble != worker.trouble:
            log.log(logging.ERROR if heartbeat.trouble else logging.INFO, "worker %s: %s",
                    worker.name, heartbeat.trouble or "no trouble any more")
            worker.trouble = heartbeat.trouble
        if heartbeat.state in (S.RUNNING, S.STANDBY) and worker.state is S.BOOTING:
            worker.move_to(S(heartbeat.state))
            log.info("worker %s %s (pid %d, boot %.1f s)", worker.name, heartbeat.state,
                     worker.pid, time.monotonic() - worker.started_monotonic)

    def _inject_fault(self, fault: InjectFault) -> Ack:
        """Note [Fault injection]."""
        worker = self.workers.capture_of(fault.camera_id)
        if not self.allow_fault_injection:
            error = (f"fault injection is off: start the daemon with {FAULT_INJECTION_ENV}=1 "
                     "to allow it (tests only)")
        elif fault.kind not in messages.FAULT_KINDS:
            error = (f"unknown fault {fault.kind!r} (allowed: "
                     f"{', '.join(messages.FAULT_KINDS)})")
        elif worker is None or worker.state is not S.RUNNING:
            error = f"no running capture worker for camera {fault.camera_id!r}"
        elif not self._send_to(worker.name, fault):
            error = f"capture worker of camera {fault.camera_id!r} unreachable (restarting)"
        else:
            log.warning("fault injection: %s on camera %s", fault.kind, fault.camera_id)
            return Ack(reply_to=fault.id)
        log.warning("refused to inject %s on camera %s: %s", fault.kind, fault.camera_id, error)
        return Ack(reply_to=fault.id, ok=False, error=error)

    # ============================================================================================
    # Events for the Markers stream
    # ============================================================================================

    def event(self, kind: str, **fields: str | int | float | bool) -> None:
        """An event of the supervisor's own, for the Markers stream."""
        self.events.new(kind, **fields)

    def _flush_events(self, settled: bool = False) -> None:
        output = self.workers.get("output")
        up_since = output.started_monotonic if output and output.state is S.RUNNING else None
        self.events.flush(lambda event: self._send_to("output", event), up_since, settled)

    # ============================================================================================
    # Reload (Note [Supervisor loop]: applied over several ticks)
    # ============================================================================================

    def reload(self) -> tuple[bool, str]:
        """Re-read the config file and apply what changed; a bad file changes nothing."""
        if self._shutdown is not None:
            return False, "the daemon is stopping"
        if self._reload is not None:
            return False, "the previous reload is still being applied; try again in a moment"
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
        self.face_models = reporting.face_models_line(new)
        self.workers.log_level = new.daemon.log_level
        stale_standbys = self._stale_standbys(old)
        stopping = [w for w in (self.workers.get(s.name) for s in change.stop + change.restart)
                    if w is not None] + stale_standbys
        self.workers.begin_stop(stopping, time.monotonic() + new.daemon.stop_timeout_s)
        # A console not started yet (Note [Console after READY]) starts at READY as the new
        # config has it, or not at all; it has no process to reassign or stop.
        new_specs = {s.name: s for s in layout.plan(new, self.gpu_count)}
        self._start_at_ready = [new_specs[s.name] for s in self._start_at_ready
                                if s.name in new_specs]
        for spec in change.reassign:
            worker = self.workers.get(spec.name)
            if worker is None:
                continue  # not started yet: it starts with the new spec
            worker.spec = spec
            self._send_to(spec.name, self._assignment(spec))
        summary = (f"started {len(change.start)}, stopped {len(change.stop)}, restarted "
                   f"{len(change.restart)}, reassigned {len(change.reassign)} worker(s)")
        self._reload = _Reload(stopping=stopping, start=change.start + change.restart,
                               remove=[s.name for s in change.stop]
                               + [w.name for w in stale_standbys], summary=summary)
        self._advance_reload()
        return True, ""

    def _advance_reload(self) -> None:
        reload = self._reload
        if reload is None or not self.workers.all_stopped(reload.stopping):
            return
        for name in reload.remove:
            self.workers.remove(name)
        for spec in reload.start:
            self.workers.start(spec)
        if self.ready:
            self._start_missing_standbys()
        self._reload = None
        log.info("reloaded %s: %s", self.config_path, reload.summary)
        self.event("reload", config=self.config_path, result=reload.summary)
        self.notifier.ready(f"reloaded: {reload.summary}")

    def _stale_standbys(self, old: config_mod.Config) -> list[WorkerProcess]:
        """Spares the new config does not want, or whose models were loaded for the old one."""
        wanted = {spec.name for spec in layout.standby_plan(self.config, self.gpu_count)}
        models_changed = old.models != self.config.models or old.output != self.config.output
        return [w for w in self.workers if w.spec.standby and (
            w.name not in wanted or (models_changed and w.spec.role not in ("capture", "output")))]

    def _start_missing_standbys(self) -> None:
        """Note [Warm standby]: the spares this config asks for that have no record yet."""
        for spec in layout.standby_plan(self.config, self.gpu_count):
            if self.workers.get(spec.name) is None:
                self.workers.start(spec)

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
            for spec in self._start_at_ready:
                if self.workers.get(spec.name) is None:  # a reload may have started it
                    self.workers.start(spec)
            self._start_at_ready = []
            self._start_missing_standbys()
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

    def status(self, reply_to: str) -> DaemonStatus:
        cameras = reporting.reports_by_camera(self.config, self.workers)
        self.recordings.add_ended(cameras)  # Note [Recording]
        stages = {f"{worker.name}/{stage}": timing
                  for worker in self.workers for stage, timing in worker.stages.items()}
        return DaemonStatus(
            reply_to=reply_to, pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.started_monotonic, 1),
            config_path=self.config_path, ready=self.ready,
            workers=[w.status() for w in self.workers],
            cameras=cameras, stages=stages, gpus=self.gpu_monitor.status(),
            gpu_note=self.gpu_monitor.note, recent_events=self.events.recent(10),
            rejected_messages=self._gate.rejected, face_models=self.face_models,
            participants=self._gallery_line(),
        )

    def _gallery_line(self) -> str:
        """The gallery's status line; when it turns unusable (or usable again), the log and the
        Markers stream say so, once per change (Note [Gallery validation]): a bad gallery costs
        the names, never the daemon."""
        line = gallery.status_line(self.config.participants.gallery)
        if line != self._gallery_seen:
            if line.startswith(gallery.UNUSABLE):
                log.error("participants: %s; faces go unnamed by it until it is fixed", line)
                self.event("gallery_unusable", reason=line.removeprefix(gallery.UNUSABLE))
            elif self._gallery_seen.startswith(gallery.UNUSABLE):
                log.info("participants: %s", line)
                self.event("gallery_usable", detail=line)
            self._gallery_seen = line
        return line

    def _check_gallery(self) -> None:
        """Where faces are named by the gallery, its changes are noticed without a status
        request too (a stat every GALLERY_CHECK_S; the file is read only when it changed)."""
        participants = self.config.participants
        now = time.monotonic()
        if (not participants.enabled or participants.identify != "embeddings"
                or now < self._next_gallery_check_monotonic):
            return
        self._next_gallery_check_monotonic = now + GALLERY_CHECK_S
        self._gallery_line()
