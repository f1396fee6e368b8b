"""What every worker process shares: its conversation with the supervisor and its main loop.

A worker is started by the supervisor as ``python -m facecast.workers <role> <name> <control>``
(see facecast.workers.__main__). It then:

1. connects a DEALER to the supervisor's control socket and says `Hello`;
2. waits for its `Assignment` (the validated config and its cameras);
   A warm standby's Assignment says `standby`: it prepares (`Worker.prepare`: imports, CUDA
   context, models run once), then waits, heartbeating, until `Promote` gives it the name of a
   worker that died; it says Hello again under that name and goes on (Note [Warm standby]);
3. boots (`Worker.boot`): opens sources, loads models. A `BootError` is reported as `BootFailed`
   and the process exits with `EXIT_BOOT_ERROR` (facecast.shared.exit_codes): the supervisor does
   not respawn it ("could not boot" is not "crashed", STYLE §5);
4. loops on `Worker.step` (each step waits at most ~100 ms), sending a `Heartbeat` about twice a
   second *from the loop itself*: a step that hangs silences the worker and the supervisor kills
   it (liveness is progress, STYLE §6);
5. stops at SIGTERM, or when the supervisor is gone, and returns exit code 0.

Signal handlers only set a flag (STYLE §2). SIGINT is ignored: a Ctrl-C in the terminal of a
foreground `facecast run` reaches every process of the group, and it is the supervisor's job to
stop the workers in order.

A worker's process title is `facecast.<name>`, e.g. `facecast.capture:cam0` (STYLE §12), and a
promoted standby's follows its new name (`set_process_name`).

Note [Stack dumps of a hung worker]
    A worker that stops heartbeating is hung somewhere: a read that never returns, a driver
    call, a deadlock. Killing it outright loses the one fact that matters, where. So every
    worker enables `faulthandler` first thing (`enable_stack_dumps`), and the supervisor sends
    a hung worker SIGABRT, waits a short grace, and only then SIGKILL (gunicorn's
    `murder_workers` does the same). faulthandler's handler is C code: it prints every Python
    thread's stack to the worker's stderr, which is the daemon's log, even while the main
    thread is stuck in C holding the GIL, where no Python signal handler could ever run; then
    the process dies of the SIGABRT. tests/test_worker_process.py proves both cases.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping
from typing import ClassVar

import msgspec
import setproctitle
import zmq

from facecast.shared import config as config_mod
from facecast.shared import cpu_priority
from facecast.shared.transport import messages
from facecast.shared.exit_codes import EXIT_BOOT_ERROR, EXIT_CRASH, EXIT_OK
from facecast.shared.transport.messages import (
    Assignment,
    BootFailed,
    Closed,
    CameraReport,
    Event,
    Heartbeat,
    Hello,
    InjectFault,
    MessageGate,
    Promote,
    Release,
    StageTiming,
    TorchMemory,
    TrackIdBlock,
    TrackIdGrant,
)
from facecast.workers.gpu_trace import GpuTraceWindow

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
ASSIGNMENT_TIMEOUT_S = 30.0

_PR_SET_PDEATHSIG = 1
COMM_BYTES = 15  # what the kernel keeps of a name for `top`, `ps -o comm`, `pgrep`
# Role abbreviations for that short name, so that the camera's part of it fits.
_COMM_ROLES = {"capture": "cap", "detection": "det", "roi_landmark": "roi", "output": "out",
               "standby": "sb", "recorder": "rec"}


def results_subscriber(context: zmq.Context, rcvhwm: int) -> zmq.Socket:
    """A SUB for FaceResults (the output worker's results, or its results tap): every message,
    none larger than messages.MAX_MESSAGE_BYTES; the caller binds or connects it."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
    socket.setsockopt(zmq.RCVHWM, rcvhwm)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    return socket


class StopWhileBooting(BaseException):
    """SIGTERM arrived before the worker's loop began (`run`). A BaseException, so that no
    `except Exception` in the boot path swallows it."""


class BootError(RuntimeError):
    """The worker cannot start with this config on this machine; the message says why."""


class Worker:
    """Base of the six worker roles (capture, detection, roi_landmark, output, recorder, console).
    Subclasses implement boot, step and close."""

    role: ClassVar[str] = ""

    def __init__(self, name: str, control_endpoint: str, context: zmq.Context) -> None:
        self.name = name
        self.control_endpoint = control_endpoint
        self.context = context
        self.config: config_mod.Config | None = None
        self.camera_ids: list[str] = []
        self.device = "cpu"
        self.standby = False
        self.hold = False  # prepare, then wait for Release before booting (Note [Boot order])
        self.most_cameras = 0  # what its models are prepared for (Note [Warmed for the largest share])
        self.prepared = None  # what prepare() made, for boot() (Note [Warm standby])
        self.stopping = False
        self.stop_requested_monotonic: float | None = None  # its SIGTERM's arrival
        self.state = "booting"
        self.priority_trouble = ""  # a promoted spare left at a lower priority
        self._gate = MessageGate(f"supervisor (to {name})")
        self._next_heartbeat_monotonic = 0.0
        self.control = self._connect_control()

    def _connect_control(self) -> zmq.Socket:
        control = self.context.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 100)  # a last event may still matter; never hang exit
        # Note [Worker connections]: the name and this process's
        # secret, which only the supervisor knows besides.
        control.setsockopt(zmq.IDENTITY, connection_identity(self.name, _connection_secret))
        control.setsockopt(zmq.SNDHWM, 1000)
        control.connect(self.control_endpoint)
        return control

    # -- what a role implements --------------------------------------------------------------

    def prepare(self) -> None:
        """As a warm standby: do now the slow part of boot that needs no camera (imports, the
        CUDA context, models loaded and run once), for self.config and self.device, so that
        boot after a promotion takes a fraction of a second. BootError: give up."""

    def boot(self) -> None:
        """Open what the worker needs (self.config, self.camera_ids are set). BootError: give up."""

    def step(self) -> None:
        """One iteration of the work; must return within about 100 ms when idle."""
        raise NotImplementedError

    def reassign(self, previous_camera_ids: list[str]) -> None:
        """The supervisor changed this worker's cameras or config (a reload)."""

    def on_event(self, event: Event) -> None:
        """An event the supervisor forwards (only the output worker gets them)."""

    def inject_fault(self, fault: InjectFault) -> None:
        """A fault the supervisor let through (Note [Fault injection]); only capture has any."""
        log.warning("%s: no fault %r to inject here; ignored", self.name, fault.kind)

    def camera_reports(self) -> list[CameraReport]:
        return []

    def stage_timings(self) -> dict[str, StageTiming]:
        return {}

    def trouble(self) -> str:
        """What is wrong with this worker now, in one line for its heartbeat ("": nothing)."""
        return ""

    def accept_track_ids(self, block: TrackIdBlock) -> None:
        """Track ids the supervisor granted this worker (roi_landmark only: Note [Track id
        blocks])."""
        log.warning("%s: track ids %d..%d granted to a %s worker, which has no use for them",
                    self.name, block.start, block.end - 1, self.role)

    def on_track_id_grant(self, grant: TrackIdGrant) -> None:
        """The supervisor's answer to this worker's TrackIdsWanted."""
        if grant.block is not None:
            self.accept_track_ids(grant.block)

    def close(self) -> None:
        """Release everything (rings, sockets, outlets). Called once, also after a failed boot."""

    # -- what every worker shares --------------------------------------------------------------

    def send(self, message: messages.Message) -> None:
        try:
            self.control.send(messages.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: control socket full; dropped a %s", self.name, type(message).__name__)

    def event(self, kind: str, **fields: str | int | float | bool) -> None:
        """A Markers-stream event (camera lost, fallback...), routed through the supervisor."""
        self.send(Event(kind=kind, fields={"worker": self.name, **fields}))

    def heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat_monotonic:
            return
        self._next_heartbeat_monotonic = now + HEARTBEAT_INTERVAL_S
        booted = self.state == "running"  # a standby has no cameras to report on
        self.send(Heartbeat(worker=self.name, state=self.state,
                            cameras=self.camera_reports() if booted else [],
                            stages=self.stage_timings() if booted else {},
                            rejected_messages=MessageGate.rejected_in_process,
                            trouble=(self.trouble() or self.priority_trouble)
                            if booted else "",
                            # In every state: a standby's or a held worker's memory counts too.
                            torch_memory=torch_memory()))

    def serve_control(self) -> None:
        """Handle what the supervisor sent, without blocking."""
        while self.control.poll(0):
            message = self._gate.decode(self.control.recv())
            if isinstance(message, Assignment):
                previous = list(self.camera_ids)
                self._apply(message)
                log.info("%s: reassigned to cameras %s", self.name, ", ".join(self.camera_ids))
                self.reassign(previous)
            elif isinstance(message, Event):
                self.on_event(message)
            elif isinstance(message, InjectFault):
                self.inject_fault(message)
            elif isinstance(message, TrackIdGrant):
                self.on_track_id_grant(message)

    def _apply(self, assignment: Assignment) -> None:
        self.config = msgspec.json.decode(assignment.config, type=config_mod.Config)
        self.camera_ids = list(assignment.camera_ids)
        self.device = assignment.device
        self.standby = assignment.standby
        self.hold = assignment.hold
        self.most_cameras = assignment.most_cameras  # Note [Warmed for the largest share]
        if assignment.track_ids is not None:
            self.accept_track_ids(assignment.track_ids)

    def wait_for_assignment(self) -> bool:
        self.send(Hello(worker=self.name, role=self.role, pid=os.getpid()))
        deadline = time.monotonic() + ASSIGNMENT_TIMEOUT_S
        while not self.stopping and time.monotonic() < deadline:
            if self.control.poll(100):
                message = self._gate.decode(self.control.recv())
                if isinstance(message, Assignment) and message.worker == self.name:
                    self._apply(message)
                    return True
        return False

    def stand_by(self) -> bool:
        """Note [Warm standby]: prepare, then wait until promoted (True, with the Assignment of
        the worker whose name it took) or stopped (False)."""
        started_monotonic = time.monotonic()
        self.prepare()
        self.state = "standby"
        log.info("%s: warm standby ready in %.1f s (%s)", self.name,
                 time.monotonic() - started_monotonic, self.device)
        # The supervisor pauses a spare that stands by, and a stopped process does not act on
        # SIGTERM: Note [Spares paused while they stand by].
        _die_with_parent(signal.SIGKILL)
        while not self.stopping:
            self.heartbeat_if_due()
            if not self.control.poll(100):
                continue
            message = self._gate.decode(self.control.recv())
            if isinstance(message, Promote):
                log.info("%s: promoted to %s", self.name, message.worker)
                _die_with_parent(signal.SIGTERM)
                # Note [Spares at a lower priority]: the workers' priority back, if allowed.
                self.priority_trouble = cpu_priority.restore_this_process()
                if self.priority_trouble:
                    log.warning("%s: %s", message.worker, self.priority_trouble)
                self._take_name(message.worker)
                return self.wait_for_assignment()
        return False

    def hold_until_released(self) -> bool:
        """Note [Boot order]: prepare while the device's inference workers boot, then wait for
        Release (True) or a stop (False). Still "booting" meanwhile, with heartbeats."""
        started_monotonic = time.monotonic()
        self.prepare()
        log.info("%s: prepared in %.1f s; held until the supervisor releases it", self.name,
                 time.monotonic() - started_monotonic)
        while not self.stopping:
            self.heartbeat_if_due()
            if not self.control.poll(100):
                continue
            message = self._gate.decode(self.control.recv())
            if isinstance(message, Release) and message.worker == self.name:
                return True
            if isinstance(message, Assignment) and message.worker == self.name:
                self._apply(message)  # a reload while held; it may release us too
                if not self.hold:
                    return True
        return False

    def _take_name(self, name: str) -> None:
        """Become `name`: process title, log lines, and the control socket's identity (the
        supervisor's ROUTER hands the dead worker's identity over to this connection)."""
        self.name = name
        set_process_name(name)
        set_log_format(name)
        self.control.close(linger=0)
        self.control = self._connect_control()
        self._gate = MessageGate(f"supervisor (to {name})")
        self.state = "booting"
        self._next_heartbeat_monotonic = 0.0

    def camera(self, camera_id: str) -> config_mod.CameraConfig:
        return self.config.camera(camera_id)

    @property
    def runtime_dir(self) -> str:
        return os.path.dirname(self.control_endpoint.removeprefix("ipc://"))


# --- torch's view of this process's GPU memory (for its heartbeats) ------------------------------

_BYTES_PER_MIB = 2**20


def torch_memory_from_stats(stats_by_device: Iterable[Mapping[str, int]]) -> TorchMemory:
    """The caching allocator's figures, one `torch.cuda.memory_stats(device)` mapping per device,
    summed over the devices, in MiB (a device whose mapping lacks a key counts 0 for it).

    The sum rather than the worker's own device (Worker.device): the console worker's is "cpu"
    while its previews may map CUDA rings of every GPU, and a device the process never used
    adds nothing. The peak is the sum of each device's own peak: exact for a worker on one GPU
    (all the others), an upper bound for one on several, whose peaks need not coincide."""
    allocated_bytes = reserved_bytes = peak_allocated_bytes = 0
    for stats in stats_by_device:
        allocated_bytes += stats.get("allocated_bytes.all.current", 0)
        reserved_bytes += stats.get("reserved_bytes.all.current", 0)
        peak_allocated_bytes += stats.get("allocated_bytes.all.peak", 0)
    return TorchMemory(allocated_mib=round(allocated_bytes / _BYTES_PER_MIB, 1),
                       reserved_mib=round(reserved_bytes / _BYTES_PER_MIB, 1),
                       peak_allocated_mib=round(peak_allocated_bytes / _BYTES_PER_MIB, 1))


def torch_memory() -> TorchMemory | None:
    """This process's figures for its heartbeat (torch_memory_from_stats), or None where torch
    has no CUDA here. Never imports torch nor makes a CUDA context for it: the output and
    console workers do not pay for torch, and capture on the CPU has no CUDA. Reading the
    allocator's counters is host-side only (no CUDA call). Nobody resets the peak
    (torch.cuda.reset_peak_memory_stats), so it is since the process started."""
    torch = sys.modules.get("torch")
    # A capture worker's camera thread may be importing torch at this moment: a module still
    # being imported is left alone (its torch.cuda may not be there yet) until it is whole.
    if torch is None or getattr(torch.__spec__, "_initializing", False):
        return None
    if not torch.cuda.is_initialized():
        return None
    return torch_memory_from_stats(torch.cuda.memory_stats(index)
                                   for index in range(torch.cuda.device_count()))


# --- the process around a Worker ------------------------------------------------------------------


def set_log_format(name: str) -> None:
    """Every log line names its worker (a promoted standby changes its name)."""
    formatter = logging.Formatter(
        f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)


def process_titles(name: str) -> tuple[str, str]:
    """The worker's titles: (the full one for `ps`, the short one for `top`).

    The full one is `facecast.<name>`, i.e. `facecast.<role>:<camera or device>` (STYLE §12).
    The short one is the kernel's 15-byte "comm": the role abbreviated and the name's tail kept
    rather than its head, since names differ at the end: `fc.cap:synth0` and `fc.cap:synth1`,
    where the head would give `fc.capture:synt` twice."""
    head, _, tail = name.partition(":")
    prefix = "fc." + _COMM_ROLES.get(head, head)
    if head == "standby":  # standby:<role>:<device>
        role, _, tail = tail.partition(":")
        prefix += "." + _COMM_ROLES.get(role, role)
    short = prefix if not tail else f"{prefix}:{tail}"
    if len(short.encode()) > COMM_BYTES:
        room = COMM_BYTES - len(prefix.encode()) - 1
        short = prefix[:COMM_BYTES] if room <= 0 else (
            f"{prefix}:" + tail.encode()[-room:].decode(errors="ignore"))
    return f"facecast.{name}", short


def set_process_name(name: str) -> None:
    """What `ps` (the full title) and `top` (the short one) show for this worker
    (`process_titles`). setproctitle rewrites the command line in place; it also sets the
    kernel's name to the title's first 15 bytes, which setthreadtitle then makes unique."""
    title, short = process_titles(name)
    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(short)  # the main thread's name is the process's name


def enable_stack_dumps() -> None:
    """Note [Stack dumps of a hung worker]: SIGABRT (and a crash in native code: SIGSEGV,
    SIGBUS, SIGFPE, SIGILL) prints every thread's Python stack to stderr before the process
    dies."""
    faulthandler.enable(file=sys.stderr, all_threads=True)


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """`signum` to this worker when the supervisor dies (even by SIGKILL): no orphaned cameras.
    SIGKILL while it stands by paused (Note [Spares paused while they stand by])."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def connection_identity(name: str, secret: str) -> bytes:
    """A worker's routing identity on the control socket (Note [Worker connections]):
    `name#secret`, or the bare name without a secret."""
    return f"{name}#{secret}".encode() if secret else name.encode()


_connection_secret = ""  # this process's, from its spawn (one per process: a promoted spare keeps it)


def run(worker_class: type[Worker], name: str, control_endpoint: str, secret: str = "") -> int:
    """The whole life of a worker process after its entry point (facecast.workers.__main__)
    set its title and stack dumps up; returns its exit code. `secret`: the one the supervisor
    gave this process (Note [Worker connections])."""
    global _connection_secret
    _connection_secret = secret
    parent_pid = os.getppid()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with zmq.Context() as context:
        worker = worker_class(name, control_endpoint, context)

        def request_stop(signum, frame):
            # A flag for the loop (STYLE §2)... except while booting, which has no loop to look
            # at it and can take tens of seconds (CUDA graphs for every batch size on a busy
            # GPU): a stop then ends the boot where it is, so the supervisor's stop deadline
            # is kept without SIGKILL. Everything the boot made is closed on the way out.
            worker.stopping = True
            if worker.stop_requested_monotonic is None:
                worker.stop_requested_monotonic = time.monotonic()
            if worker.state == "booting":
                raise StopWhileBooting

        signal.signal(signal.SIGTERM, request_stop)
        try:
            if not worker.wait_for_assignment():
                log.error("%s: no assignment from the supervisor at %s", name, control_endpoint)
                return EXIT_CRASH
            try:
                if worker.standby and not worker.stand_by():
                    return EXIT_OK
                if worker.hold and not worker.hold_until_released():
                    return EXIT_OK
                worker.boot()
            except BootError as exc:
                log.error("%s cannot start: %s", worker.name, exc)
                worker.send(BootFailed(worker=worker.name, reason=str(exc)))
                return EXIT_BOOT_ERROR
            worker.state = "running"
            log.info("%s running (pid %d, cameras %s, %s)", worker.name, os.getpid(),
                     ", ".join(worker.camera_ids) or "none", worker.device)
            gpu_trace = GpuTraceWindow.from_environment()  # Note [Where the GPU's time goes]
            while not worker.stopping:
                worker.serve_control()
                worker.step()
                worker.heartbeat_if_due()
                if gpu_trace is not None:
                    gpu_trace.tick(worker.name)
                if os.getppid() != parent_pid:
                    log.warning("%s: the supervisor is gone; stopping", worker.name)
                    break
            return EXIT_OK
        except StopWhileBooting:
            log.info("%s: stopped while booting", worker.name)
            return EXIT_OK
        finally:
            closing_monotonic = time.monotonic()
            worker.close()
            if worker.stop_requested_monotonic is not None:
                # Note [A closed worker is not killed]; with the time, where a slow stop goes.
                worker.send(Closed(worker=worker.name))
                log.info("%s closed in %.2f s, %.2f s after its SIGTERM", worker.name,
                         time.monotonic() - closing_monotonic,
                         time.monotonic() - worker.stop_requested_monotonic)
            worker.control.close()  # its linger sends what is queued (Closed)
