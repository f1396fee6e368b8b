"""Typed, versioned messages that travel over ZeroMQ between facecast processes.

Every message is a msgspec struct tagged with its ``type``, carrying the protocol version ``v``
and an ``id``; replies echo the request's id in ``reply_to`` (STYLE.md §4). Readers are
tolerant: unknown fields are ignored, so a newer sender can add fields. A message of another
protocol version, a truncated or garbage message is refused with a `BadMessage` that says why;
`MessageGate` turns those into a rate-limited log line and a counter, never into an exception
that could kill a worker.

Pixels never travel here: a `FrameReady` names a slot of a ring (see facecast.shared.transport.rings).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from typing import ClassVar, Literal, Union

import msgspec
import zmq

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
# Set as zmq.MAXMSGSIZE on every socket that others connect to: a peer that sends more is
# disconnected by libzmq instead of making us allocate it. The largest real message (FaceResults
# with 16 faces' landmarks, and a few body poses at ~1 KiB each) is ~100 KiB.
MAX_MESSAGE_BYTES = 4 << 20
# Per MessageGate.drain: 32 cameras' worth of a full SUB queue and more.
MAX_DRAIN_MESSAGES = 4096

TransportKind = Literal["cuda_ipc", "shm"]

_ids = itertools.count(1)


def next_message_id() -> str:
    """Process-unique, cheap correlation id: `<pid>-<counter>`."""
    return f"{os.getpid()}-{next(_ids)}"


class BadMessage(ValueError):
    """A message that cannot be used; the text says why (for the log)."""


class Message(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION
    id: str = msgspec.field(default_factory=next_message_id)


# --- frames and rings ----------------------------------------------------------------------------


class FrameReady(Message, tag="frame"):
    """One captured frame, now readable in a ring slot."""

    camera_id: str
    transport: TransportKind
    ring_epoch: int  # changes whenever the producer (re)allocates the ring
    slot: int
    slot_generation: int  # the slot's seqlock value once this frame was complete (even)
    frame_seq: int  # per camera, counts every captured frame, dropped or not
    capture_ts_lsl: float  # pylsl.local_clock() at grab
    shape: tuple[int, ...]
    dtype: str
    strides_bytes: tuple[int, ...]
    pixel_format: str  # "bgr24"
    checksum: int  # facecast.shared.transport.frames.checksum of the frame's bytes (uint64), of the
                   # ring's RingDescription.checksum_kind
    published_ts_lsl: float = 0.0  # pylsl.local_clock() as capture sent this message (Note
                                   # [Latency accounted]); 0: not stamped


class CudaRingHandles(msgspec.Struct, frozen=True):
    """What a consumer needs to map a CUDA ring (see Note [CUDA IPC rules])."""

    mem_handle: bytes  # cuIpcGetMemHandle of the allocation
    offset_bytes: int  # from the allocation base to slot 0 (cuMemGetAddressRange)
    allocation_bytes: int
    event_handles: list[bytes]  # one interprocess event per slot
    device_uuid: str  # the GPU the ring lives on
    device_index: int
    driver_version: int


class RingDescription(Message, tag="ring"):
    """Everything a consumer needs to attach a camera's ring for one epoch."""

    camera_id: str
    transport: TransportKind
    ring_epoch: int
    slot_count: int
    slot_bytes: int  # bytes reserved per slot (>= frame bytes, aligned)
    frame_shape: tuple[int, ...]
    frame_dtype: str
    header_name: str  # POSIX shm name of the generation header (both transports)
    data_name: str = ""  # POSIX shm name of the pixels (shm transport)
    cuda: CudaRingHandles | None = None
    producer_pid: int = 0
    fallback_reason: str = ""  # why this camera is on shm although cuda_ipc was asked for
    # What FrameReady.checksum covers (facecast.shared.transport.frames): "full", every byte, checked on
    # every frame; "sampled", a sparse sample, checked on 1 frame in daemon.checksum_every.
    # The producer chooses (daemon.checksum), so its consumers can never disagree with it.
    checksum_kind: Literal["full", "sampled"] = "full"


# --- control between a frame consumer and the capture worker --------------------------------------


class DescribeRing(Message, tag="describe_ring"):
    camera_id: str


class TransportFault(Message, tag="transport_fault"):
    """A consumer could not trust the camera's CUDA ring; the producer must fall back to shm."""

    camera_id: str
    ring_epoch: int
    reason: str


class Ack(Message, tag="ack"):
    reply_to: str
    ok: bool = True
    error: str = ""


# --- detections and results (detection → roi_landmark → output) -----------------------------------


class DetectionWanted(Message, tag="detection_wanted"):
    """A roi_landmark worker asks for a detection pass on these cameras' next frames: it has no
    face there, lost one, or it is time to look for newcomers."""

    camera_ids: list[str]


class MeasuringBehind(Message, tag="measuring_behind"):
    """A roi_landmark worker passed over `skipped` of its cameras' frames in its last second,
    more than one in a hundred: its measuring is behind them, and the device has no room for
    newcomer searches (Note [Detection while the device has room])."""

    skipped: int


class TracksFull(Message, tag="tracks_full"):
    """A roi_landmark worker's cameras (`camera_ids`: all of its own) and those of them whose
    tracks fill `output.max_faces` (`full`): the detection worker searches those for newcomers
    no more, since no newcomer could be followed there (Note [No search where no face could
    go], models/face_tracking.py). Sent when the set changes and once a second."""

    camera_ids: list[str]
    full: list[str]


class Detections(Message, tag="detections"):
    """Face detections in one frame of one camera, in that frame's pixels."""

    camera_id: str
    ring_epoch: int
    frame_seq: int
    capture_ts_lsl: float
    boxes_px: list[tuple[float, float, float, float]]  # x1, y1, x2, y2, best first
    keypoints_px: list[list[tuple[float, float]]]  # 6 keypoints per box (eyes, nose, mouth, ears)
    scores: list[float]


# Track ids travel in a float32 LSL channel, which holds every integer exactly up to 2**24: an id
# is at least 1 and below this (Note [Track id blocks]).
TRACK_ID_LIMIT = 1 << 24


class FaceResult(msgspec.Struct, frozen=True, kw_only=True):
    track_id: int  # unique for the daemon's life: from a TrackIdBlock granted to the sender
    presence: float
    score: float
    box_px: tuple[float, float, float, float]
    head_pose_deg: tuple[float, float, float]  # yaw, pitch, roll
    blendshapes: list[float] | None = None  # 52, in MediaPipe's order
    # MediaPipe's facial transformation matrix's translation (camera space, cm); with the bundle
    head_translation_cm: tuple[float, float, float] | None = None
    landmarks_px: bytes | None = None  # float32 (478, 3), little endian, when asked for
    # Who this is (participants.enabled; facecast.workers.inference.identity): an enrolled or seated
    # participant's name, "" when unknown or when participants are off; and how sure, 0..1.
    participant: str = ""
    identity_confidence: float = 0.0


POSE_LANDMARK_COUNT = 33  # MediaPipe's BlazePose topology
POSE_LANDMARK_VALUES = 5  # x px, y px, z px (x's scale), visibility, presence


class PoseResult(msgspec.Struct, frozen=True, kw_only=True):
    """One person's body pose (facecast.models.pose.Pose) in one frame."""

    presence: float  # the pose landmark model's presence score
    score: float  # detector score, or presence when tracked
    box_px: tuple[float, float, float, float]  # x1, y1, x2, y2: the landmarks' bounds in the frame
    landmarks: bytes  # float32 (33, 5) little endian: x, y px, z px, visibility, presence
    world_landmarks_m: bytes  # float32 (33, 3) little endian: meters, origin between the hips

    @classmethod
    def from_arrays(cls, *, presence: float, score: float, box_px, landmarks,
                    world_landmarks_m) -> PoseResult:
        """Pack numpy arrays of shapes (33, 5) and (33, 3) (a models.pose.Pose's fields)."""
        import numpy as np  # only where poses are packed or read: the CLI imports this module too

        packed = {}
        for name, array, columns in (("landmarks", landmarks, POSE_LANDMARK_VALUES),
                                     ("world_landmarks_m", world_landmarks_m, 3)):
            array = np.ascontiguousarray(array, dtype="<f4")
            if array.shape != (POSE_LANDMARK_COUNT, columns):
                raise ValueError(f"pose {name} must have shape ({POSE_LANDMARK_COUNT}, {columns}), "
                                 f"got {array.shape}")
            packed[name] = array.tobytes()
        return cls(presence=float(presence), score=float(score),
                   box_px=tuple(float(v) for v in box_px), **packed)

    def landmarks_array(self):
        """(33, 5) float32 view of ``landmarks``; ValueError when the bytes do not hold 33."""
        return _unpack(self.landmarks, "landmarks", POSE_LANDMARK_VALUES)

    def world_landmarks_array(self):
        """(33, 3) float32 view of ``world_landmarks_m``; ValueError when the bytes do not hold 33."""
        return _unpack(self.world_landmarks_m, "world_landmarks_m", 3)


def _unpack(data: bytes, name: str, columns: int):
    import numpy as np

    expected_bytes = POSE_LANDMARK_COUNT * columns * 4
    if len(data) != expected_bytes:
        raise ValueError(f"pose {name} has {len(data)} bytes, expected {expected_bytes} "
                         f"(float32 {POSE_LANDMARK_COUNT}x{columns})")
    return np.frombuffer(data, dtype="<f4").reshape(POSE_LANDMARK_COUNT, columns)


class FaceResults(Message, tag="faces"):
    """Every face measured in one frame of one camera: one LSL sample per face slot.

    ``poses``: the body poses found in the frame, best first, when this sender measured body pose
    on it ([] when it found nobody); None when it did not look (pose not enabled, or a sender
    that predates the field): the output worker then publishes no MoCap sample for the frame,
    rather than one that claims "nobody there".
    """

    camera_id: str
    frame_seq: int
    capture_ts_lsl: float
    faces: list[FaceResult]
    blendshapes_missing_reason: str = ""
    poses: list[PoseResult] | None = None
    # Where the frame was when (pylsl.local_clock(); Note [Latency accounted];
    # 0: not stamped, by a sender that does not): capture sent its FrameReady, the measuring
    # worker took it off the frame bus, had its checked copy, had measured it (the batch's
    # models, tracking and identities), and sent this message.
    frame_published_ts_lsl: float = 0.0
    picked_up_ts_lsl: float = 0.0
    read_ts_lsl: float = 0.0
    measured_ts_lsl: float = 0.0
    sent_ts_lsl: float = 0.0


# --- supervisor ↔ workers (control socket) ---------------------------------------------------------

WorkerRole = Literal["capture", "detection", "roi_landmark", "output", "console",
                     "recorder"]
WorkerState = Literal["booting", "running", "standby"]


class Hello(Message, tag="hello"):
    """First message of a worker on the control socket; the supervisor answers with Assignment."""

    worker: str  # e.g. "capture:cam0"
    role: WorkerRole
    pid: int


class TrackIdBlock(msgspec.Struct, frozen=True, kw_only=True):
    """Track ids `start` .. `start + count - 1`, granted by the supervisor to one roi_landmark
    worker and to no one else, ever (Note [Track id blocks])."""

    start: int
    count: int

    @property
    def end(self) -> int:
        """One past the last id of the block."""
        return self.start + self.count


class Assignment(Message, tag="assignment"):
    """What a worker is to do: the validated config and its share of the cameras. Sent in reply
    to Hello and again after a reload that changes this worker's cameras."""

    worker: str
    config: bytes  # msgspec.json of facecast.shared.config.Config (validated by the supervisor)
    camera_ids: list[str]
    device: str = "cpu"  # "cpu" or "cuda:<index>"
    # A warm standby: load what a worker of this role needs on this device, then wait for
    # Promote (Note [Warm standby]).
    standby: bool = False
    # roi_landmark workers: a first block of track ids (None from a supervisor that predates
    # it, and for a standby): the worker then asks with TrackIdsWanted.
    track_ids: TrackIdBlock | None = None
    # Held at boot: prepare (imports, the CUDA context), then wait for Release before booting
    # (Note [Boot order]).
    hold: bool = False
    # The most cameras a worker of this role on this device has, what its models are prepared
    # for (Note [Warmed for the largest share]); 0: all of the config's.
    most_cameras: int = 0


class TrackIdsWanted(Message, tag="track_ids_wanted"):
    """A roi_landmark worker has used half of its track ids: the supervisor answers with a
    TrackIdGrant (Note [Track id blocks])."""

    worker: str


class TrackIdGrant(Message, tag="track_id_grant"):
    """The answer to TrackIdsWanted: the next block, or none and why (the daemon's id space is
    used up). A worker keeps every block it is granted, asked for or not."""

    reply_to: str
    block: TrackIdBlock | None = None
    error: str = ""  # why there is no block


class Promote(Message, tag="promote"):
    """To a warm standby: take this worker's name (a new Hello under it follows)."""

    worker: str


class Release(Message, tag="release"):
    """To a worker held at boot (Assignment.hold): boot now (Note [Boot order])."""

    worker: str


class StageTiming(msgspec.Struct, frozen=True):
    p50_ms: float
    p99_ms: float
    count: int
    mean_ms: float | None = None  # the means of a frame's hops add up (Note [Latency accounted])


class CameraReport(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's view of one camera since its last heartbeat window."""

    camera_id: str
    frames: int = 0  # total this worker handled for the camera
    fps: float = 0.0
    faces: int = 0  # in the newest frame
    skipped: int = 0  # frames this worker never got to (newest-frame policy)
    source: str = ""  # capture only: "ok", "lost: <reason>", "opening"
    transport: str = ""
    ring_epoch: int = 0
    fallback_reason: str = ""
    # capture only: "gpu" (NVDEC) or "cpu" for a camera with compressed video, and why (Note
    # [Decoder choice]); "" for one without (a V4L2 or synthetic camera)
    decoder: str = ""
    decode_reason: str = ""
    latency_ms: StageTiming | None = None  # output only: capture → LSL push
    checksum_mismatches: int = 0  # frame consumers: slots whose bytes were not the published frame
    # recorder only (facecast.workers.recorder.worker): "recording", "stopped: <reason>", "" elsewhere
    recording: str = ""
    recording_file: str = ""  # the segment being written (path)
    recorded_frames: int = 0  # frames written in this recording, every segment
    recording_drops: int = 0  # frames captured during it that are not in its video


class TorchMemory(msgspec.Struct, frozen=True, kw_only=True):
    """torch's caching allocator's view of one worker process's GPU memory, MiB, every GPU it
    used together (facecast.workers.base.torch_memory). NVML's figure for the same process
    (WorkerStatus.gpu_memory_mib) minus `reserved_mib` is what torch does not manage: the CUDA
    context, cuBLAS/cuDNN handles and workspaces, and allocations made without torch (the rings,
    pycuda's mem_alloc)."""

    allocated_mib: float  # held by live tensors now
    reserved_mib: float  # held from the driver by the allocator: cached blocks, CUDA graph pools
    peak_allocated_mib: float  # the most `allocated_mib` has been since the process started


class Heartbeat(Message, tag="heartbeat"):
    """Sent by every worker from its main loop (progress, not a timer thread: a stuck loop goes
    silent). `busy_since_monotonic` is set while a step (inference, a read) is in progress."""

    worker: str
    state: WorkerState
    cameras: list[CameraReport] = msgspec.field(default_factory=list)
    stages: dict[str, StageTiming] = msgspec.field(default_factory=dict)
    rejected_messages: int = 0  # malformed messages its sockets refused (MessageGate), in total
    # What is wrong with this worker now, in one line for `facecast status` ("" when nothing):
    # e.g. a roi_landmark worker with no track id left for a new face.
    trouble: str = ""
    # None where torch has no CUDA in the process (not imported, models on the CPU, a worker
    # that never touches a GPU through torch), and from a worker that predates the field.
    torch_memory: TorchMemory | None = None


class BootFailed(Message, tag="boot_failed"):
    """The worker cannot start (bad source, missing model): do not respawn it (STYLE §5)."""

    worker: str
    reason: str


class Closed(Message, tag="closed"):
    """At a stop: the worker has closed everything it owns and its process is ending; what is
    left is the kernel's and the driver's (Note [A closed worker is not killed])."""

    worker: str


class Event(Message, tag="event"):
    """Something a lab user should see on the Markers stream (DESIGN §4)."""

    kind: str  # start, stop, camera_lost, camera_back, transport_fallback, worker_restart, ...
    fields: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)
    event_ts_lsl: float = 0.0  # 0: when the output worker pushes it


# --- recording (recorder → output; Note [Frame index and verdicts]) ---------


class RecordingState(Message, tag="recording_state"):
    """A recorder to the output worker, per camera, at start, at stop and every second between
    (a recorder that dies stops renewing it): frames captured from `from_ts_lsl` on, until
    `until_ts_lsl` when set, are decided by the recorder; their frame-index samples wait for
    its `FramesRecorded` verdict (or VERDICT_WAIT_S)."""

    camera_id: str
    recording: bool
    from_ts_lsl: float
    until_ts_lsl: float = 0.0  # 0: open-ended
    file: str = ""  # the segment being written (file name only)
    dropped: int = 0  # recording drops so far in this recording


class FramesRecorded(Message, tag="frames_recorded"):
    """A recorder's verdicts on frames of one camera: each (frame_seq, recording_frame,
    segment, segment_frame) was handed to the encoder; `dropped` counts this recording's drops."""

    camera_id: str
    frames: list[tuple[int, int, int, int]]
    dropped: int = 0


# --- CLI ↔ supervisor ------------------------------------------------------------------------------


class StatusRequest(Message, tag="status"):
    pass


class ReloadRequest(Message, tag="reload"):
    pass


class StopRequest(Message, tag="stop"):
    pass


class RecordRequest(Message, tag="record"):
    """`facecast record start|stop`: the supervisor answers with a RecordReply. "check" answers
    what "start" would do (or why not) and starts nothing (`record start --xdf` asks first)."""

    action: Literal["start", "stop", "check"]
    camera_ids: list[str] = msgspec.field(default_factory=list)  # []: every camera
    dir: str = ""  # absolute; "": the config's record.dir
    overlays: bool = False  # burn the faces in (`--overlays`); False: the config's record.overlays


class RecordReply(Message, tag="record_reply"):
    reply_to: str
    ok: bool = True
    error: str = ""
    camera_ids: list[str] = msgspec.field(default_factory=list)  # what is (or was) recorded
    dir: str = ""
    host: str = ""  # the daemon's host name: its streams' source ids start facecast-<host>-


FAULT_KINDS = ("corrupt_next_frame",)


class InjectFault(Message, tag="inject_fault"):
    """Soak and fault tests only (Note [Fault injection]): the supervisor
    refuses it unless the daemon was started with FACECAST_ALLOW_FAULT_INJECTION=1, and forwards
    it to the camera's capture worker otherwise. No CLI verb sends it."""

    kind: str  # one of FAULT_KINDS; checked by the supervisor so that a refusal says why
    camera_id: str


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: str
    pid: int
    state: str  # booting, running, standby, backoff, pending, failed, flapping, stopped
    restarts: int
    uptime_s: float
    last_exit: str = ""
    detail: str = ""
    rejected_messages: int = 0  # malformed messages it refused, since it (re)started
    standby: bool = False  # a warm spare (Note [Warm standby]), not one of the config's workers
    # Device memory its process holds on every GPU together (NVML), MiB; None where it holds none
    # or NVML cannot tell (no GPU, or process ids NVML reports from another pid namespace).
    gpu_memory_mib: float | None = None
    # torch's share of it, from the worker's last heartbeat; None where the worker's torch has
    # no CUDA (Heartbeat.torch_memory) or its process is gone.
    torch_memory: TorchMemory | None = None


class GpuStatus(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    name: str
    memory_used_mib: float
    memory_total_mib: float
    utilization_pct: float


class DaemonStatus(Message, tag="daemon_status"):
    reply_to: str
    pid: int
    uptime_s: float
    config_path: str
    ready: bool
    workers: list[WorkerStatus]
    cameras: dict[str, list[CameraReport]]  # camera id → one report per worker that sees it
    stages: dict[str, StageTiming]  # "<worker>/<stage>" → timing
    gpus: list[GpuStatus] = msgspec.field(default_factory=list)
    gpu_note: str = ""
    recent_events: list[str] = msgspec.field(default_factory=list)
    rejected_messages: int = 0  # malformed messages the control socket refused
    face_models: str = ""  # which face stack the config gets, and where its bundle came from
    participants: str = ""  # the gallery's path, revision and names (facecast.shared.gallery)


AnyMessage = Union[
    FrameReady, RingDescription, DescribeRing, TransportFault, Ack,
    DetectionWanted, MeasuringBehind, TracksFull, Detections, FaceResults,
    Hello, Assignment, Promote, Release, Heartbeat, BootFailed, Closed, Event, TrackIdsWanted,
    TrackIdGrant,
    StatusRequest, ReloadRequest, StopRequest, InjectFault, DaemonStatus,
    RecordingState, FramesRecorded, RecordRequest, RecordReply,
]

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder()  # untyped: reads type and version first
_typed_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> AnyMessage:
    """Decode one message, refusing other protocol versions with a reason."""
    try:
        envelope = _envelope_decoder.decode(payload)
    # msgspec raises more than DecodeError on hostile bytes: invalid UTF-8 in a string, and
    # nesting deeper than it recurses. Each killed the receiving process before (tests/soak).
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadMessage(f"not msgpack ({len(payload)} bytes): {exc}") from None
    if not isinstance(envelope, dict):
        raise BadMessage(f"not a message envelope but a {type(envelope).__name__}")
    version = envelope.get("v")
    if version != PROTOCOL_VERSION:
        raise BadMessage(
            f"protocol version {version!r} of a {envelope.get('type')!r} message is not "
            f"supported (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        return _typed_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise BadMessage(f"invalid {envelope.get('type')!r} message: {exc}") from None


class MessageGate:
    """Decodes incoming messages for a worker, logging refusals at most once per interval."""

    # All gates of this process together: what a worker's heartbeat reports.
    rejected_in_process: ClassVar[int] = 0

    def __init__(self, source: str, log_interval_s: float = 10.0) -> None:
        self.source = source
        self.rejected = 0
        self.last_reason = ""
        self._log_interval_s = log_interval_s
        self._next_log_monotonic = 0.0
        self._suppressed = 0

    def decode(self, payload: bytes) -> AnyMessage | None:
        try:
            return decode(payload)
        except BadMessage as exc:
            self._reject(str(exc))
            return None

    def drain(self, socket: zmq.Socket) -> Iterator[AnyMessage | None]:
        """What is queued on `socket` now, decoded (None for a refused one), without blocking;
        at most MAX_DRAIN_MESSAGES, so that a flood cannot hold the caller's loop. The payload is
        the last part of a message (the first of a multipart one may be a SUB topic)."""
        for _ in range(MAX_DRAIN_MESSAGES):
            try:
                parts = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            yield self.decode(parts[-1])

    def refuse(self, reason: str) -> None:
        """A message that decoded but that its sender may not send: counted and logged as a
        malformed one is."""
        self._reject(reason)

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        MessageGate.rejected_in_process += 1
        self.last_reason = reason
        now = time.monotonic()
        if now >= self._next_log_monotonic:
            more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
            log.warning("dropped a message from %s: %s%s", self.source, reason, more)
            self._next_log_monotonic = now + self._log_interval_s
            self._suppressed = 0
        else:
            self._suppressed += 1
