"""The daemon's configuration: one TOML file decoded into typed, strictly validated structs.

Config is data (STYLE.md §10): decoding has no side effects and probes no hardware. An unknown
key or a bad value is a `ConfigError` that names the key path and what is allowed; the CLI turns it
into exit code 2 before anything starts.
"""

from __future__ import annotations

import re
import socket
import typing
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from facecast.workers.output.synchrony import SynchronyConfig

TransportName = Literal["auto", "cuda_ipc", "shm"]
# Which decoder a camera's compressed video gets (Note [Decoder choice]).
DecodeName = Literal["auto", "gpu", "cpu"]
DeviceName = Literal["auto", "cuda", "cpu"]
LogLevel = Literal["debug", "info", "warning", "error"]

CameraId = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z0-9_-]{1,32}$",
        description="camera name used in stream names and shared-memory names",
    ),
]


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the key path and what is allowed."""


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class DaemonConfig(_Strict):
    runtime_dir: Annotated[
        str,
        msgspec.Meta(
            description="where control and data sockets live; empty: $RUNTIME_DIRECTORY "
            "(systemd), else $XDG_RUNTIME_DIR/facecast, else /tmp/facecast-<uid>"
        ),
    ] = ""
    host_name: Annotated[
        str, msgspec.Meta(description="host part of stream names and source ids; empty: hostname")
    ] = ""
    transport: Annotated[
        TransportName,
        msgspec.Meta(description="frame transport for every camera unless a camera overrides it"),
    ] = "auto"
    ring_slots: Annotated[
        int, msgspec.Meta(ge=2, le=64, description="frames kept per camera ring")
    ] = 8
    decode: Annotated[
        DecodeName,
        msgspec.Meta(
            description="where every camera's compressed video (H.264/H.265 files and streams, "
            'synthetic-h264) is decoded unless a camera overrides it: "gpu" (NVDEC, through '
            'pynvvideocodec, straight into the camera\'s GPU ring), "cpu" (OpenCV/FFmpeg), or '
            '"auto": the GPU where it can, else the CPU; status says which and why'
        ),
    ] = "auto"
    checksum: Annotated[
        Literal["full", "sampled"],
        msgspec.Meta(
            description='what proves a frame is the camera\'s: "full", a checksum of every byte '
            'checked on every frame (host and GPU compute the same value); "sampled", a sparse '
            "sample of 4096 bytes checked on 1 frame in checksum_every (cheaper, and blind to a "
            "changed patch or byte between its samples)"
        ),
    ] = "full"
    checksum_every: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=10_000,
            description='checksum = "sampled" only: consumers check 1 frame in N ("full" checks '
            "every frame)",
        ),
    ] = 30
    log_level: LogLevel = "info"
    roi_landmark_workers: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=16)] | Literal["auto"],
        msgspec.Meta(
            description="roi_landmark worker processes per device (Note [Measuring workers per "
            "GPU]); auto: one per 32 of a GPU's cameras, one on the CPU"
        ),
    ] = "auto"
    cameras_per_capture_worker: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=256)] | Literal["auto"],
        msgspec.Meta(
            description="cameras one capture process serves, a thread each (Note [Capture "
            "groups]); auto: one per camera on the CPU and up to 4 "
            "cameras per GPU, beyond that groups so that a GPU has at most 4 capture processes "
            "(CUDA contexts)"
        ),
    ] = "auto"
    detect_interval_s: Annotated[
        float,
        msgspec.Meta(gt=0, le=60, description="a camera with faces is searched for newcomers at "
                     "least this often, while it follows fewer than output.max_faces (a newcomer "
                     "would have no stream beyond them)"),
    ] = 0.5
    detection_share: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=1)] | Literal["auto"],
        msgspec.Meta(
            description="the share of its device's time the detection worker may spend searching "
            "every camera for newcomers between the passes it must make (Note [Detection while "
            "the device has room]); auto: 0.5 on a GPU, 0.1 on the CPU"
        ),
    ] = "auto"
    heartbeat_timeout_s: Annotated[
        float,
        msgspec.Meta(ge=1, le=600, description="a running worker silent this long is killed and restarted"),
    ] = 10.0
    boot_timeout_s: Annotated[
        float,
        msgspec.Meta(ge=1, le=3600, description="how long a worker may take to start (models load)"),
    ] = 120.0
    stop_timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0, le=60, description="orderly shutdown deadline before workers are killed"),
    ] = 4.0
    warm_standby: Annotated[
        Literal["auto", "on", "off"],
        msgspec.Meta(
            description="keep a booted spare of each worker role per device and of the output "
            "worker, so that a dead worker is replaced within 2 s; auto (or on, its older name): "
            "on every device, the CPU included; off: none"
        ),
    ] = "auto"


class ModelsConfig(_Strict):
    dir: Annotated[
        str, msgspec.Meta(description="model cache; empty: $XDG_CACHE_HOME/facecast/models")
    ] = ""
    face_landmarker_task: Annotated[
        str,
        msgspec.Meta(
            description="path to your own MediaPipe face_landmarker.task (blendshapes, head "
                        "translation); empty: the one `facecast models install` installs"
        ),
    ] = ""
    device: Annotated[DeviceName, msgspec.Meta(description="where models run")] = "auto"
    cuda_graphs: Annotated[
        bool,
        msgspec.Meta(description="on a GPU, replay captured CUDA graphs of fixed batch sizes, "
                     "prepared at boot, instead of launching each kernel from Python (same results, "
                     "less CPU; without them every new batch size stalls for seconds)"),
    ] = True
    half: Annotated[
        bool,
        msgspec.Meta(description="on a GPU, run the models in float16 (faster; landmarks move by "
                     "a fraction of a percent of the face's size)"),
    ] = False


class OutputConfig(_Strict):
    max_faces: Annotated[
        int, msgspec.Meta(ge=1, le=16, description="face streams per camera, fixed at start")
    ] = 2
    landmarks: Annotated[bool, msgspec.Meta(description="add 478x3 landmarks to Face streams")] = (
        False
    )
    pose: Annotated[
        bool,
        msgspec.Meta(
            description="measure body pose (MediaPipe's 33 landmarks) and publish one MoCap "
            "stream per camera"
        ),
    ] = False


class WebConfig(_Strict):
    """The web console (facecast.workers.console.worker; README "Web console"): read-only previews and
    health in a browser, safe by default (Note [Console security])."""

    enabled: Annotated[
        bool, msgspec.Meta(description="serve the web console (its own worker process)")
    ] = False
    host: Annotated[
        str,
        msgspec.Meta(
            # A shape check here, so that a host name gets a message that names web.host at
            # once; __post_init__ then checks that it is a real address (web_host_problem).
            pattern=r"^(localhost|[0-9.]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$",
            description='address to bind: an IP address or "localhost" (never a name resolved '
            "at start); every request needs the token, on loopback too (any local user's "
            "browser reaches 127.0.0.1: README's Security section)",
        ),
    ] = "127.0.0.1"
    port: Annotated[
        int, msgspec.Meta(ge=0, le=65535, description="TCP port; 0: any free port (tests)")
    ] = 8420
    preview_fps: Annotated[
        float, msgspec.Meta(ge=5, le=15, description="preview frames per second per camera")
    ] = 10.0
    preview_width: Annotated[
        int,
        msgspec.Meta(ge=64, le=1920, description="width of a grid preview in pixels (height "
                     "keeps the camera's aspect); a camera's own page shows twice that"),
    ] = 320
    token: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^([A-Za-z0-9_~.-]{16,128})?$",
            description="secret for requests (16-128 characters of A-Z a-z 0-9 _ ~ . -); empty: "
            "one is generated, printed once and kept in web-token (mode 0600) in the runtime "
            "directory",
        ),
    ] = ""
    allow_control: Annotated[
        bool,
        msgspec.Meta(description="allow reload, stop and markers from the console (with the "
                     "token); false: read-only"),
    ] = False

    def __post_init__(self) -> None:
        problem = web_host_problem(self.host)
        if problem:
            raise ValueError(problem)


def web_host_problem(host: str) -> str:
    """Why `web.host` cannot be bound ("" when it can): an IP address literal or "localhost"; a
    name would be resolved at bind time, which config validation must not do (STYLE §10)."""
    import ipaddress

    if host == "localhost":
        return ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return (f"web.host: {host!r} is not an IP address (allowed: an IPv4 or IPv6 address, or "
                '"localhost"; "127.0.0.1" keeps the console on this machine)')
    return ""


RecordCodec = Literal["libx264", "ffv1"]
RecordPreset = Literal["ultrafast", "superfast", "veryfast", "faster", "fast", "medium"]


class RecordConfig(_Strict):
    """Video recording per camera (facecast.workers.recorder.worker; README "Recording")."""

    start: Annotated[
        bool, msgspec.Meta(description="record every camera from the daemon's start (else only "
                           "between `facecast record start` and `facecast record stop`)")
    ] = False
    dir: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^(/.*)?$",
            description="absolute directory for the videos and their sidecar CSVs; empty: "
            "$XDG_DATA_HOME/facecast/recordings (else ~/.local/share/facecast/recordings)",
        ),
    ] = ""
    segment_s: Annotated[
        float, msgspec.Meta(ge=1, le=86400, description="a new file every this many seconds of "
                            "capture time, without losing a frame")
    ] = 600.0
    container: Annotated[
        Literal["mkv", "mp4"],
        msgspec.Meta(description="mkv (default: a file cut short by a crash or a full disk stays "
                     "readable up to its last frame) or mp4 (readable only once closed)"),
    ] = "mkv"
    codec: Annotated[
        RecordCodec,
        msgspec.Meta(description="libx264 (H.264 on the CPU, FFmpeg as bundled with PyAV) or "
                     "ffv1 (lossless, mkv only, ~10x larger)"),
    ] = "libx264"
    preset: Annotated[
        RecordPreset, msgspec.Meta(description="libx264 speed preset: faster presets encode more "
                                   "cameras per core at a larger file (docs/benchmarks.md)")
    ] = "veryfast"
    crf: Annotated[
        int, msgspec.Meta(ge=0, le=51, description="libx264 quality: 0 lossless, 23 default, "
                          "higher is smaller and worse")
    ] = 23
    overlays: Annotated[
        bool, msgspec.Meta(description="burn each frame's own faces into the video: boxes, track "
                           "ids, participant names (`record start --overlays` turns it on for "
                           "one recording); the recorder then waits up to 0.5 s for a frame's "
                           "results (Note [Overlays])")
    ] = False

    def __post_init__(self) -> None:
        if self.codec == "ffv1" and self.container == "mp4":
            raise ValueError('record.codec "ffv1" cannot go into an mp4 file: use '
                             'record.container = "mkv", or record.codec = "libx264"')


class SeatConfig(_Strict):
    """A participant pinned to a camera, or to a region of its frame (Note [Seat map])."""

    participant: Annotated[
        str,
        msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,32}$", description="the participant's name "
                     "(becomes part of stream names)"),
    ]
    camera: Annotated[CameraId, msgspec.Meta(description="the camera the participant sits in")]
    region: Annotated[
        tuple[float, float, float, float],
        msgspec.Meta(description="x1, y1, x2, y2 of the seat as fractions of the frame's width "
                     "and height (a face whose box centre lies inside is this participant); "
                     "default: the whole frame"),
    ] = (0.0, 0.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        x1, y1, x2, y2 = self.region
        if not (0.0 <= x1 < x2 <= 1.0 and 0.0 <= y1 < y2 <= 1.0):
            raise ValueError(f"seat of {self.participant!r}: region {list(self.region)} must "
                             "be x1, y1, x2, y2 with 0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1 "
                             "(fractions of the frame)")


class ParticipantsConfig(_Strict):
    """Participants (README "Participants"): people named on every face of theirs, either by
    face embeddings matched to the gallery (`facecast enroll`) or by a seat map."""

    enabled: Annotated[
        bool, msgspec.Meta(description="name the faces: every FaceResult gets a participant")
    ] = False
    identify: Annotated[
        Literal["embeddings", "seats"],
        msgspec.Meta(description='"embeddings": match face embeddings to the gallery; '
                     '"seats": the seat map says who sits where, and no embedding is computed '
                     "(no biometrics at all)"),
    ] = "embeddings"
    gallery: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^(/.*)?$",
            description="absolute path of the gallery file; empty: participants.json in the state "
            "directory ($STATE_DIRECTORY under systemd, i.e. /var/lib/facecast; else "
            "$XDG_STATE_HOME/facecast, else ~/.local/state/facecast)",
        ),
    ] = ""
    match_distance: Annotated[
        float,
        msgspec.Meta(gt=0, le=2, description="a face is the enrolled participant nearest to it "
                     "when their embeddings are closer than this (Euclidean, dlib's measure: "
                     "0.6 is dlib's own threshold); farther from everyone: unknown"),
    ] = 0.6
    embed_interval_s: Annotated[
        float,
        msgspec.Meta(ge=0.2, le=600, description="a track is embedded when it appears, then "
                     "again every this many seconds (not every frame)"),
    ] = 2.0
    seats: Annotated[
        list[SeatConfig],
        msgspec.Meta(description='identify = "seats": who sits in which camera or region'),
    ] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.identify == "seats" and self.enabled and not self.seats:
            raise ValueError('participants.seats: identify = "seats" needs at least one '
                             "[[participants.seats]] table (participant, camera, region)")
        if self.identify == "embeddings" and self.seats:
            raise ValueError('participants.seats: a seat map is used only with identify = '
                             '"seats" (now "embeddings"); remove the seats or change identify')


# The face photos that ship with the synthetic source (facecast.workers.capture.sources._PHOTOS; a test
# keeps the two lists equal): config stays free of worker imports.
SyntheticPhoto = Literal["astronaut", "grace_hopper"]
SYNTHETIC_SEATS = 2  # the synthetic scene's places: 0 on the left, 1 on the right


class StagedAppearance(_Strict):
    """One person's time in one seat of a staged synthetic camera (Note [Staged scenes])."""

    photo: Annotated[
        SyntheticPhoto,
        msgspec.Meta(description="whose face: one of the photos the synthetic source ships"),
    ]
    seat: Annotated[
        int,
        msgspec.Meta(ge=0, le=SYNTHETIC_SEATS - 1, description="where: 0 left, 1 right"),
    ]
    from_s: Annotated[
        float, msgspec.Meta(ge=0, description="seconds into the cycle when the person appears")
    ]
    until_s: Annotated[
        float,
        msgspec.Meta(gt=0, description="seconds into the cycle when the person leaves "
                     "(exclusive; at most staging.cycle_s)"),
    ]


class StagingConfig(_Strict):
    """Who sits where and when in a synthetic camera: a script repeated every `cycle_s` seconds
    of capture time, so that its ground truth stays a pure function of the capture timestamp."""

    cycle_s: Annotated[
        float,
        msgspec.Meta(gt=0, le=86400, description="the script's length: a frame captured at "
                     "capture_ts_lsl shows what the script says at capture_ts_lsl mod cycle_s"),
    ]
    appearances: Annotated[
        list[StagedAppearance],
        msgspec.Meta(description="who is where and when; an empty seat shows the backdrop, an "
                     "empty list an empty room"),
    ] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        for index, shown in enumerate(self.appearances):
            name = f"appearances[{index}] ({shown.photo}, seat {shown.seat})"
            if not shown.from_s < shown.until_s <= self.cycle_s:
                problems.append(f"{name}: needs from_s < until_s <= cycle_s ({self.cycle_s:g}), "
                                f"got from_s = {shown.from_s:g}, until_s = {shown.until_s:g}")
            for earlier_index, earlier in enumerate(self.appearances[:index]):
                overlap = (max(shown.from_s, earlier.from_s) < min(shown.until_s, earlier.until_s))
                if overlap and shown.seat == earlier.seat:
                    problems.append(f"{name} overlaps appearances[{earlier_index}] "
                                    f"({earlier.photo}) in seat {shown.seat}: one face per seat")
                elif overlap and shown.photo == earlier.photo:
                    problems.append(f"{name} overlaps appearances[{earlier_index}]: "
                                    f"{shown.photo} cannot sit in two seats at once")
        if problems:
            raise ValueError("; ".join(problems))

    def shown_at(self, capture_ts_lsl: float) -> list[StagedAppearance]:
        """The appearances in the frame captured at `capture_ts_lsl`, in seat order."""
        into_cycle_s = capture_ts_lsl % self.cycle_s
        shown = [a for a in self.appearances if a.from_s <= into_cycle_s < a.until_s]
        return sorted(shown, key=lambda appearance: appearance.seat)


# Frames of the loop a replayed synthetic source renders once and plays back and forth (Note
# [Synthetic replay]): the scene time it shows, so how long a staged script on it may be.
SYNTHETIC_REPLAY_LOOP_FRAMES = 30
_REPLAYED_SOURCES = ("synthetic-replay", "synthetic-h264", "synthetic-mjpeg")


class CameraConfig(_Strict):
    id: CameraId
    source: Annotated[
        str | int,
        msgspec.Meta(
            description='"synthetic" (two real faces on a known path, rendered per frame), '
            '"synthetic-replay" (the same scene as a 30-frame loop rendered once and replayed '
            "back and forth: next to no CPU, 187 MB of memory per 1080p camera), "
            '"synthetic-h264" or "synthetic-mjpeg" (that loop encoded once and decoded every '
            "frame, as a real camera's stream is), a V4L2 index or /dev/video path, an rtsp:// "
            "or http:// URL, or a video file"
        ),
    ]
    width: Annotated[int, msgspec.Meta(ge=16, le=8192)] = 1280
    height: Annotated[int, msgspec.Meta(ge=16, le=8192)] = 720
    fps: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 30.0
    fourcc: Annotated[
        str, msgspec.Meta(pattern=r"^([A-Z0-9 ]{4})?$", description='e.g. "MJPG"; empty: driver default')
    ] = ""
    transport: Annotated[
        TransportName | Literal[""], msgspec.Meta(description='overrides daemon.transport; "" inherits')
    ] = ""
    gpu: Annotated[int, msgspec.Meta(ge=-1, le=63, description="GPU index; -1: round-robin")] = -1
    decode: Annotated[
        DecodeName | Literal[""],
        msgspec.Meta(description='overrides daemon.decode; "" inherits; "gpu" only for a '
                     "source with H.264/H.265 video (a file, an rtsp:// or http:// stream, "
                     '"synthetic-h264")'),
    ] = ""
    phase: Annotated[
        Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] | None,
        msgspec.Meta(description="replayed synthetic sources only (synthetic-replay, "
                     "synthetic-h264, synthetic-mjpeg): where in each frame period the camera "
                     "captures, as a fraction of the period; cameras of one phase capture at the "
                     "same instants, as genlocked cameras do; absent: a fraction drawn from the "
                     "camera's id, as free-running cameras' phases are (Note [Capture phases])"),
    ] = None
    staging: Annotated[
        StagingConfig | None,
        msgspec.Meta(description="synthetic sources only: stage people, i.e. which photo "
                     "sits in which seat and when (swap seats, leave, come back); on a replayed "
                     "loop the script must fit the loop's scene time; absent: astronaut on the "
                     "left and grace_hopper on the right, always"),
    ] = None

    def __post_init__(self) -> None:
        if self.phase is not None and self.source not in _REPLAYED_SOURCES:
            raise ValueError(f"phase: camera {self.id!r} has source {self.source!r}; only the "
                             f"replayed synthetic sources ({', '.join(_REPLAYED_SOURCES)}) capture "
                             "on a schedule that a phase can set")
        if self.staging is None or self.source == "synthetic":
            return
        if self.source not in _REPLAYED_SOURCES:
            raise ValueError(f"staging: camera {self.id!r} has source {self.source!r}; only the "
                             f"synthetic sources can be staged ({', '.join(_REPLAYED_SOURCES)} "
                             'and "synthetic")')
        loop_s = SYNTHETIC_REPLAY_LOOP_FRAMES / self.fps
        if self.staging.cycle_s > loop_s + 1e-9:
            raise ValueError(
                f"staging: camera {self.id!r} has source {self.source!r}, whose replayed loop "
                f"shows {SYNTHETIC_REPLAY_LOOP_FRAMES} frames ({loop_s:g} s at {self.fps:g} fps) "
                f"of scene time, back and forth: a script of cycle_s = "
                f"{self.staging.cycle_s:g} s does not fit in it; use cycle_s <= {loop_s:g}, or "
                'source = "synthetic" (rendered live, any script)')


class Config(_Strict):
    daemon: DaemonConfig = msgspec.field(default_factory=DaemonConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)
    web: WebConfig = msgspec.field(default_factory=WebConfig)
    record: RecordConfig = msgspec.field(default_factory=RecordConfig)
    participants: ParticipantsConfig = msgspec.field(default_factory=ParticipantsConfig)
    synchrony: SynchronyConfig = msgspec.field(default_factory=SynchronyConfig)
    cameras: list[CameraConfig] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        # (No camera at all is `loads`'s to refuse, where the file is a daemon's.)
        problems = _repeated_camera_ids([camera.id for camera in self.cameras])
        camera_ids = {camera.id for camera in self.cameras}
        problems += [f"participants.seats[{index}]: camera {seat.camera!r} is not configured "
                     f"(allowed: {', '.join(sorted(camera_ids))})"
                     for index, seat in enumerate(self.participants.seats)
                     if seat.camera not in camera_ids]
        problems += [f'cameras[{index}].decode: camera {camera.id!r} asks for decode = "gpu", '
                     f"but {problem}" for index, camera in enumerate(self.cameras)
                     if camera.decode == "gpu"
                     and (problem := gpu_decode_source_problem(camera.source))]
        if self.synchrony.enabled and not self.participants.enabled:
            problems.append("synchrony.enabled: the Synchrony stream is between participants: "
                            "it needs participants.enabled = true")
        if problems:
            raise ValueError("; ".join(problems))

    def camera(self, camera_id: str) -> CameraConfig:
        return next(c for c in self.cameras if c.id == camera_id)

    def transport_for(self, camera: CameraConfig) -> str:
        return camera.transport or self.daemon.transport

    def decode_for(self, camera: CameraConfig) -> str:
        return camera.decode or self.daemon.decode

    def host(self) -> str:
        return self.daemon.host_name or socket.gethostname()


def gpu_decode_source_problem(source: str | int) -> str:
    """Why a camera's source can never be decoded on the GPU ("" when it may be: its codec is
    known only once it is open). From the source's text alone, as config validation must
    (STYLE §10): no file is opened and no GPU asked."""
    # Imported here: camera_sources imports this module.
    from facecast.shared.camera_sources import SourceConfigError, source_kind

    try:
        kind = source_kind(source)
    except SourceConfigError:
        return ""  # the source's own error says what is wrong (check-config, the capture worker)
    allowed = ('allowed for H.264/H.265 and MJPEG video: a video file, an rtsp:// or http:// '
               'stream, "synthetic-h264", "synthetic-mjpeg"')
    if kind in ("synthetic", "synthetic-replay"):
        return f"source {source!r} makes raw frames: there is nothing to decode ({allowed})"
    if kind == "v4l2":
        return (f"source {source!r} is a V4L2 camera, decoded by OpenCV on the CPU (its MJPEG "
                f"is not handed to the GPU yet; {allowed})")
    return ""


# --- loading -----------------------------------------------------------------------------------


def load(path: str | Path, *, cameras_required: bool = True) -> Config:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    return loads(data, origin=str(path), cameras_required=cameras_required)


def loads(data: bytes | str, origin: str = "<config>", *, cameras_required: bool = True) -> Config:
    """Decode and validate; a ConfigError lists every problem of the file, not only the first.
    `cameras_required`: a daemon's file needs a camera; `facecast analyze`, which reads the
    models, output, daemon and participants tables only, takes a file without one."""
    try:
        raw = msgspec.toml.decode(data)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from None
    problems = _problems(raw, Config, "")
    if isinstance(raw, dict) and isinstance(raw.get("cameras", []), list):
        camera_ids = [camera.get("id") for camera in raw.get("cameras", [])
                      if isinstance(camera, dict) and isinstance(camera.get("id"), str)]
        problems += _camera_list_problems(camera_ids, cameras_required)
    if len(problems) == 1:
        raise ConfigError(f"{origin}: {problems[0]}")
    if problems:
        listed = "\n".join(f"  {problem}" for problem in problems)
        raise ConfigError(f"{origin}: {len(problems)} problems:\n{listed}")
    # The walk above only collects messages; the typed decode stays the one source of truth.
    try:
        return msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{origin}: {_explain(str(exc))}") from None


def _camera_list_problems(camera_ids: list[str], cameras_required: bool) -> list[str]:
    """The whole-file rules on `[[cameras]]` (`loads`)."""
    if not camera_ids and cameras_required:
        # Zero cameras used to start a daemon that measured nothing and said nothing about it.
        return ["cameras: no camera configured: add at least one [[cameras]] table with an id and "
                'a source (config/default.toml has two with source = "synthetic")']
    return _repeated_camera_ids(camera_ids)


def _repeated_camera_ids(camera_ids: list[str]) -> list[str]:
    """The rule on `[[cameras]]` that a Config itself holds (Config.__post_init__)."""
    repeated = sorted({camera_id for camera_id in camera_ids if camera_ids.count(camera_id) > 1})
    return [f"camera id {camera_id!r} appears twice; ids must be unique" for camera_id in repeated]


# Keys that facecast once read and no longer does: a clearer word than "unknown key".
_REMOVED_KEYS = {
    "daemon.handshake_timeout_s": "removed: nothing waited on it (a consumer validates a CUDA "
    "ring in one synchronous check, Note [Probe slot]); delete the line",
}


def _problems(value: object, annotation: object, json_path: str) -> list[str]:
    """Every error in `value` (decoded TOML) against `annotation`, each as `_explain` words it.

    msgspec stops at the first error of a document, so the walk goes down the structs and lists
    itself and lets msgspec judge each leaf: one message per bad key, with its path.
    """
    base = _strip_annotated(annotation)
    if isinstance(base, type) and issubclass(base, msgspec.Struct) and isinstance(value, dict):
        hints = typing.get_type_hints(base, include_extras=True)
        problems = []
        for key, item in value.items():
            key_path = f"{json_path}.{key}"
            if key not in hints:
                removed = _REMOVED_KEYS.get(key_path.removeprefix("."))
                unknown = f"Object contains unknown field `{key}` - at `${json_path}`"
                problems.append(f"{key_path.removeprefix('.')}: {removed}" if removed
                                else _explain(unknown))
            else:
                problems += _problems(item, hints[key], key_path)
        for field in msgspec.structs.fields(base):
            if field.required and field.encode_name not in value:
                problems.append(_explain(f"Object missing required field `{field.encode_name}` - "
                                         f"at `${json_path}`"))
        return problems
    if typing.get_origin(base) is list and isinstance(value, list):
        (item_type,) = typing.get_args(base) or (object,)
        problems = []
        for index, item in enumerate(value):
            problems += _problems(item, item_type, f"{json_path}[{index}]")
        return problems
    try:
        msgspec.convert(value, type=annotation)
    except msgspec.ValidationError as exc:
        match = _AT_PATH.match(str(exc))
        return [_explain(f"{match['what']} - at `${json_path}{match['path'] or ''}`")]
    return []



_AT_PATH = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")


def _explain(message: str) -> str:
    """Rewrite msgspec's message as `key.path: what is wrong (allowed: ...)`."""
    match = _AT_PATH.match(message)
    what, json_path = match["what"], match["path"] or ""
    key_path = re.sub(r"^\.", "", json_path)
    field_type = _type_at(Config, json_path)
    unknown = _UNKNOWN_FIELD.search(what)
    if unknown:
        key_path = f"{key_path}.{unknown['name']}" if key_path else unknown["name"]
        allowed = ", ".join(getattr(field_type, "__struct_fields__", ()))
        return f"{key_path}: unknown key (allowed here: {allowed})"
    if not key_path or what.startswith(f"{key_path}."):
        return what  # a struct's own rule (__post_init__): its message names the key and says all
    allowed = _describe_allowed(field_type)
    return f"{key_path}: {what}" + (f" (allowed: {allowed})" if allowed else "")


def _type_at(root: type, json_path: str) -> object:
    """Walk `$.cameras[0].fourcc`-style paths through the struct annotations."""
    current: object = root
    for name, index in re.findall(r"\.([A-Za-z_]+)|\[(\d+)\]", json_path):
        current = _strip_optional(_strip_annotated(current))
        if index:
            args = typing.get_args(current)
            current = args[0] if args else None
        elif isinstance(current, type) and issubclass(current, msgspec.Struct):
            current = typing.get_type_hints(current, include_extras=True).get(name)
        else:
            return None
    return current


def _strip_optional(tp: object) -> object:
    """`X | None` -> X, so that the walk goes into an optional table (cameras[0].staging)."""
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        present = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        if len(present) == 1:
            return _strip_annotated(present[0])
    return tp


def _strip_annotated(tp: object) -> object:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _describe_allowed(tp: object) -> str:
    if tp is None:
        return ""
    metas = [a for a in getattr(tp, "__metadata__", ()) if isinstance(a, msgspec.Meta)]
    base = _strip_annotated(tp)
    parts: list[str] = []
    literals = _literal_values(base)
    if literals:
        parts.append(", ".join(repr(v) for v in literals))
    elif isinstance(base, type) and issubclass(base, msgspec.Struct):
        parts.append("a table with keys " + ", ".join(base.__struct_fields__))
    elif base is not None:
        parts.append(getattr(base, "__name__", str(base)).replace("typing.", ""))
    for meta in metas:
        bounds = [
            f"{sym} {getattr(meta, attr)}"
            for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(meta, attr) is not None
        ]
        if bounds:
            parts.append(" and ".join(bounds))
        if meta.pattern:
            parts.append(f"matching {meta.pattern}")
        if meta.description:
            parts.append(meta.description)
    return "; ".join(parts)


def _literal_values(tp: object) -> list[object]:
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        values: list[object] = []
        for arg in typing.get_args(tp):
            values.extend(_literal_values(_strip_annotated(arg)))
        return values
    return []


# --- secrets -------------------------------------------------------------------------------------


# `scheme://` and a user (possibly empty) followed by `:`: where a password may begin.
_URL_USER = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^:/@\s]*):")


def redact_url(text: str) -> str:
    """`text` with the password of every `scheme://user:password@host` in it masked (`***`).

    A camera's `source` may carry its RTSP credentials: whatever shows a source (log lines,
    reasons in `facecast status` and on the Markers stream, `check-config`, `cameras --probe`)
    passes it through here first. Note [Masking passwords].

    Note [Masking passwords]
        Users write passwords as they are, not percent-encoded: `/`, a space and `@` occur in
        them (`rtsp://lab:p@ss w/rd@10.1.2.3/s1`), and the user may be empty
        (`rtsp://:pass@host`). Where the password ends cannot be known from the URL alone, so
        it ends at the *last* `@` before the next URL or the end of the line: a text after the
        URL that holds an `@` of its own is masked with it. Showing too little is a lost
        detail in a log line; showing too much is a leaked password (issue 21).
    """
    pieces, position = [], 0
    while (match := _URL_USER.search(text, position)) is not None:
        start = match.end()  # the password's first character
        line_end = text.find("\n", start)
        limit = len(text) if line_end < 0 else line_end
        following = _URL_USER.search(text, start)
        if following is not None and following.start() < limit:
            limit = following.start()
        at = text.rfind("@", start, limit)
        if at < 0:  # `scheme://host:port/...`: no credentials
            pieces.append(text[position:start])
            position = start
            continue
        pieces.append(text[position:start] + "***@")
        position = at + 1
    pieces.append(text[position:])
    return "".join(pieces)
