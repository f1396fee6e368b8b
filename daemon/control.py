"""The supervisor's side of the control socket: the ROUTER that workers and the CLI connect to,
and what the supervisor does with each message that arrives on it.

Dispatch is by table, one handler per message type (circus's `commands/`, one per verb):
WORKER_HANDLERS for what only a worker's own connection may send, CLIENT_HANDLERS for the
requests any connection of the daemon's user may send (Note [Worker connections]). A handler
gets the supervisor (as circus's commands get the arbiter), the sender's routing identity and
the message; it answers at once and never blocks (Note [Supervisor loop]): a request that takes
several ticks (`reload`, `stop`) is answered when it is begun, and the loop carries it on.

Runs in the supervisor only; the CLI's side is facecast.daemon.cli.control_client, which this
module does not import.

Note [Worker connections]
    The control socket is a file in the runtime directory: every process of the daemon's user
    can connect to it. Workers' messages (Hello, Heartbeat, BootFailed, Closed, Event, TrackIdsWanted)
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
    CLIENT_HANDLERS names; the replies go back on their own connection. What a same-user process
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

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from facecast.daemon import layout, reporting
from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import WorkerProcess, WorkerState
from facecast.daemon.worker_table import WorkerTable
from facecast.shared.transport import messages
from facecast.shared.transport.messages import (
    Ack,
    Assignment,
    BootFailed,
    Closed,
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

if TYPE_CHECKING:
    from facecast.daemon.supervisor import Supervisor

log = logging.getLogger(__name__)

S = WorkerState
FAULT_INJECTION_ENV = "FACECAST_ALLOW_FAULT_INJECTION"  # Note [Fault injection]


class ControlSocket:
    """The control socket's ROUTER, its gate (malformed and refused messages, counted), and the
    dispatch of what arrives to WORKER_HANDLERS and CLIENT_HANDLERS."""

    def __init__(self, endpoint: str, workers: WorkerTable) -> None:
        self.endpoint = endpoint
        self.workers = workers
        self.gate = MessageGate("control socket")
        self.allow_fault_injection = os.environ.get(FAULT_INJECTION_ENV) == "1"
        self.socket: zmq.Socket | None = None

    def open(self, context: zmq.Context) -> zmq.Socket:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its name back
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # know when the output worker is away
        return self.socket

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()

    def serve(self, supervisor: Supervisor) -> None:
        """Every message queued now, each to its handler; never blocks."""
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            identity, payload = frames[0], frames[-1]
            message = self.gate.decode(payload)
            if message is None:
                continue
            on_worker = WORKER_HANDLERS.get(type(message))
            on_client = CLIENT_HANDLERS.get(type(message))
            if on_worker is not None:
                worker = self._worker_of(identity, message)
                if worker is not None:
                    on_worker(supervisor, identity, worker, message)
            elif on_client is not None:
                on_client(supervisor, identity, message)
            else:  # a message the supervisor sends, never receives (Assignment, Ack...)
                allowed = ", ".join(t.__name__ for t in CLIENT_HANDLERS)
                self.gate.refuse(f"{type(message).__name__} is not a request a client may send "
                                 f"(allowed: {allowed})")

    def send_to(self, worker_name: str, message: messages.Message) -> bool:
        """To a worker over its control connection; False when it is not connected."""
        worker = self.workers.get(worker_name)
        if worker is None or not worker.routing_id:
            return False
        try:
            self.socket.send_multipart([worker.routing_id, messages.encode(message)])
        except zmq.ZMQError as exc:
            log.debug("could not send %s to %s: %s", type(message).__name__, worker_name, exc)
            return False
        return True

    def reply(self, identity: bytes, message: messages.Message) -> None:
        try:
            self.socket.send_multipart([identity, messages.encode(message)])
        except zmq.ZMQError as exc:  # the asker went away
            log.debug("could not answer a %s: %s", type(message).__name__, exc)

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
        self.gate.refuse(f"{type(message).__name__} (as worker {claimed!r}) from a connection "
                         "that is not that worker's own; only the processes the supervisor "
                         "started may send it")
        return None


def assignment(supervisor: Supervisor, spec: WorkerSpec) -> Assignment:
    """What a worker is to do: its Hello's answer, or a reload's reassignment."""
    # Only a worker that publishes faces gets track ids; a spare gets its block with the
    # Assignment of the worker it replaces (Note [Track id blocks]).
    track_ids = (supervisor.track_ids.grant(spec.name)
                 if spec.role == "roi_landmark" and not spec.standby else None)
    config = (supervisor.recordings.config_for_recorder(supervisor.config)
              if spec.role == "recorder" else supervisor.config)
    # Note [Boot order]: a capture worker that starts before its device's inference is up waits.
    hold = supervisor.boot_order.holds(spec)
    most_cameras = layout.most_cameras(supervisor.config, supervisor.gpu_count, spec.role, spec.device)
    return Assignment(worker=spec.name, config=msgspec.json.encode(config),
                      camera_ids=list(spec.camera_ids), device=spec.device,
                      standby=spec.standby, track_ids=track_ids, hold=hold,
                      most_cameras=most_cameras)


def daemon_status(supervisor: Supervisor, reply_to: str) -> DaemonStatus:
    """`facecast status`'s answer: what the daemon is doing and why."""
    workers = supervisor.workers
    cameras = reporting.reports_by_camera(supervisor.config, workers)
    supervisor.recordings.add_ended(cameras)  # Note [Recording]
    stages = {f"{worker.name}/{stage}": timing
              for worker in workers for stage, timing in worker.stages.items()}
    gpu_memory = supervisor.gpu_monitor.memory_by_pid()
    return DaemonStatus(
        reply_to=reply_to, pid=os.getpid(),
        uptime_s=round(time.monotonic() - supervisor.started_monotonic, 1),
        config_path=supervisor.config_path, ready=supervisor.ready,
        workers=[msgspec.structs.replace(status, gpu_memory_mib=gpu_memory.get(status.pid))
                 for status in (w.status() for w in workers)],
        cameras=cameras, stages=stages, gpus=supervisor.gpu_monitor.status(),
        gpu_note=supervisor.gpu_monitor.note, recent_events=supervisor.events.recent(10),
        rejected_messages=supervisor.control.gate.rejected, face_models=supervisor.face_models,
        participants=supervisor.gallery_watch.line(supervisor.config.participants),
    )


def inject_fault(supervisor: Supervisor, fault: InjectFault) -> Ack:
    """Note [Fault injection]."""
    worker = supervisor.workers.capture_of(fault.camera_id)
    if not supervisor.control.allow_fault_injection:
        error = (f"fault injection is off: start the daemon with {FAULT_INJECTION_ENV}=1 "
                 "to allow it (tests only)")
    elif fault.kind not in messages.FAULT_KINDS:
        error = (f"unknown fault {fault.kind!r} (allowed: "
                 f"{', '.join(messages.FAULT_KINDS)})")
    elif worker is None or worker.state is not S.RUNNING:
        error = f"no running capture worker for camera {fault.camera_id!r}"
    elif not supervisor.control.send_to(worker.name, fault):
        error = f"capture worker of camera {fault.camera_id!r} unreachable (restarting)"
    else:
        log.warning("fault injection: %s on camera %s", fault.kind, fault.camera_id)
        return Ack(reply_to=fault.id)
    log.warning("refused to inject %s on camera %s: %s", fault.kind, fault.camera_id, error)
    return Ack(reply_to=fault.id, ok=False, error=error)


# ================================================================================================
# Workers' messages: from their own connections only (Note [Worker connections])
# ================================================================================================

def _on_hello(supervisor: Supervisor, identity: bytes, worker: WorkerProcess,
              hello: Hello) -> None:
    if worker.pid != hello.pid:
        log.warning("ignoring hello from worker %r: pid %d, not %d", hello.worker, hello.pid,
                    worker.pid)
        return
    supervisor.control.reply(identity, assignment(supervisor, worker.spec))


def _on_heartbeat(supervisor: Supervisor, identity: bytes, worker: WorkerProcess,
                  heartbeat: Heartbeat) -> None:
    if not worker.alive() or worker.state is S.STOPPING:
        return
    worker.last_heartbeat_monotonic = time.monotonic()
    worker.reports, worker.stages = heartbeat.cameras, heartbeat.stages
    worker.rejected_messages = heartbeat.rejected_messages
    worker.torch_memory = heartbeat.torch_memory
    if heartbeat.trouble != worker.trouble:
        log.log(logging.ERROR if heartbeat.trouble else logging.INFO, "worker %s: %s",
                worker.name, heartbeat.trouble or "no trouble any more")
        worker.trouble = heartbeat.trouble
    if heartbeat.state in (S.RUNNING, S.STANDBY) and worker.state is S.BOOTING:
        worker.move_to(S(heartbeat.state))
        log.info("worker %s %s (pid %d, boot %.1f s)", worker.name, heartbeat.state,
                 worker.pid, time.monotonic() - worker.started_monotonic)
    if worker.state is S.STANDBY:
        # Note [Spares paused while they stand by]: a spare that heartbeats is running (its
        # first "standby", its last heartbeat before a pause, one continued by someone else or
        # for a promotion that could not be sent): stopped.
        worker.pause()


def _on_boot_failed(supervisor: Supervisor, identity: bytes, worker: WorkerProcess,
                    message: BootFailed) -> None:
    worker.boot_error = message.reason


def _on_closed(supervisor: Supervisor, identity: bytes, worker: WorkerProcess,
               message: Closed) -> None:
    worker.on_closed()


def _on_event(supervisor: Supervisor, identity: bytes, worker: WorkerProcess,
              message: Event) -> None:
    log.info("event %s %s", message.kind, message.fields)
    supervisor.events.add(message)
    supervisor.recordings.on_event(message)


def _on_track_ids_wanted(supervisor: Supervisor, identity: bytes, worker: WorkerProcess,
                         message: TrackIdsWanted) -> None:
    supervisor.control.reply(identity, supervisor.track_ids.answer(message))


# ================================================================================================
# Clients' requests: from any connection of the daemon's user (the CLI's, the console's)
# ================================================================================================

def _on_status_request(supervisor: Supervisor, identity: bytes, message: StatusRequest) -> None:
    supervisor.control.reply(identity, daemon_status(supervisor, message.id))


def _on_reload_request(supervisor: Supervisor, identity: bytes, message: ReloadRequest) -> None:
    ok, error = supervisor.reload()
    supervisor.control.reply(identity, Ack(reply_to=message.id, ok=ok, error=error))


def _on_stop_request(supervisor: Supervisor, identity: bytes, message: StopRequest) -> None:
    supervisor.control.reply(identity, Ack(reply_to=message.id))
    supervisor.stop_requested = True


def _on_record_request(supervisor: Supervisor, identity: bytes, message: RecordRequest) -> None:
    supervisor.control.reply(identity, supervisor.recordings.request(
        message, supervisor.config, stopping=supervisor.shutdown is not None))


def _on_inject_fault(supervisor: Supervisor, identity: bytes, message: InjectFault) -> None:
    supervisor.control.reply(identity, inject_fault(supervisor, message))


# A handler per message that only a worker's own connection may send.
WORKER_HANDLERS: dict[type, Callable[[Supervisor, bytes, WorkerProcess, Any], None]] = {
    Hello: _on_hello, Heartbeat: _on_heartbeat, BootFailed: _on_boot_failed, Closed: _on_closed,
    Event: _on_event, TrackIdsWanted: _on_track_ids_wanted,
}
# A handler per request that any connection of this user may send (the CLI's).
CLIENT_HANDLERS: dict[type, Callable[[Supervisor, bytes, Any], None]] = {
    StatusRequest: _on_status_request, ReloadRequest: _on_reload_request,
    StopRequest: _on_stop_request, RecordRequest: _on_record_request,
    InjectFault: _on_inject_fault,
}
