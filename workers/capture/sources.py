"""Capture sources: where a capture worker's frames come from, behind one small interface.

Runs in the capture worker (one process per camera). `open_source(camera)` returns a
`FrameSource` whose `read()` gives `(frame_bgr, capture_ts_lsl)`: a C-contiguous uint8 HxWx3 BGR
frame and the `pylsl.local_clock()` time taken right at grab. A source that stops delivering
raises `SourceLost` with the reason; the capture worker reopens it when `ReopenBackoff` (below)
says a try is due. A source spec that can never work (an unknown URL scheme) is a
`SourceConfigError`, which must not be retried; a file or V4L2 device that is not on this
machine at all is a `SourceNotFound` (a `SourceLost`: Note [Sources that can never work]).

Kinds, chosen from `CameraConfig.source`:

- `"synthetic"`: real face photos (scikit-image's astronaut, matplotlib's grace_hopper) moving on
  a known smooth path over a plain background, paced in real time; its ground truth (face boxes
  as a function of capture time) is `SyntheticScene.faces_at()`, computable in any process.
  A camera's `staging` table says who sits where and when instead (Note [Staged scenes]).
- `"synthetic-replay"`: the same scene, a short loop rendered once at open and replayed back and
  forth at the camera's fps for next to no CPU (Note [Synthetic replay]); its ground truth is
  `SyntheticReplay.faces_at()`, also a pure function of the capture time.
- `"synthetic-h264"`, `"synthetic-mjpeg"`: that loop encoded once at open (PyAV, in memory) and
  decoded every frame by the video file decoder, as a real camera's stream is (Note [Encoded
  synthetic loop]); the same ground truth as synthetic-replay's.
- a V4L2 device: an index (`0`, `"0"`) or a `/dev/video*` path, through OpenCV's V4L2 backend
  with the requested size, fps and fourcc; what the driver granted is logged and kept.
- an `rtsp://`, `rtsps://`, `http://` or `https://` URL: OpenCV's FFMPEG backend, with open and
  read timeouts so that a dead peer is noticed; RTSP is carried over TCP unless
  $OPENCV_FFMPEG_CAPTURE_OPTIONS says otherwise.
- anything else: a video file (FFMPEG backend), looped and paced at its native fps.

These are the CPU decoder's sources. H.264/H.265 files and streams and "synthetic-h264" may be
decoded on the GPU instead (facecast.workers.capture.nvdec, the same kinds' NVDEC twins, whose
`read()` gives a torch tensor on the camera's GPU), and MJPEG files and streams and
"synthetic-mjpeg" by nvJPEG (facecast.workers.capture.nvjpeg, Note [nvJPEG path]):
`open_source(camera, decode=...)` chooses, and every source's `decode` says which decoder it got
and why (Note [Decoder choice]).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import logging
import math
import os
import random
import socket
import stat
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass
from pathlib import Path

import cv2
import msgspec
import numpy as np
import pylsl

from facecast.shared.camera_sources import (  # noqa: F401
    ENCODED_SYNTHETIC_CODECS,
    SourceConfigError,
    source_kind,
)
from facecast.shared.config import (
    SYNTHETIC_REPLAY_LOOP_FRAMES,
    CameraConfig,
    StagingConfig,
    redact_url,
)
from facecast.workers.capture import decoding
from facecast.workers.capture.decoding import (
    DecodeChoice,
    DecodeRequest,
    GpuDecodeUnavailable,
)

log = logging.getLogger(__name__)



class SourceLost(RuntimeError):
    """The source cannot deliver frames (now); `reason` says why. Retry with backoff."""

    def __init__(self, camera_id: str, reason: str) -> None:
        super().__init__(f"camera {camera_id}: {reason}")
        self.camera_id = camera_id
        self.reason = reason


class SourceNotFound(SourceLost):
    """What the source names is not on this machine: no such video file or V4L2 device, or it
    is not a regular file or a device.

    Note [Sources that can never work]
        A camera whose source is a typo, a file that is not there or a device this machine does
        not have would be retried every 30 s for as long as the daemon runs, each try a warning
        nobody reads, while status calls it "lost" as if it had worked. So the capture worker
        gives such a camera up when it finds this at the camera's *first* open (the config
        names something that is not there): not retried, a `camera_failed` marker, status says
        why, and a capture worker whose every camera is given up on exits as one that could not
        boot (EXIT_BOOT_ERROR: not respawned, status says why). A source that has opened once
        and then vanishes (a USB camera unplugged takes its /dev node with it, a file moved
        away) is lost, not given up on: it is retried and comes back when it is there again.
        Streams are never given up on: a camera that refuses a connection now may be switched
        on later. `facecast check-config` reports the same sources before a start
        (daemon/cli/check_config.py).
    """


@dataclass(frozen=True, slots=True)
class Granted:
    """What the source actually delivers (not what was asked for)."""

    width: int
    height: int
    fps: float  # nominal: the driver's/stream's/file's rate, or the configured one
    fourcc: str  # the pixel format or codec, e.g. "MJPG", "YUYV", "h264"; "" unknown
    backend: str  # "synthetic", "V4L2", "FFMPEG"

    def describe(self) -> str:
        fourcc = f" {self.fourcc}" if self.fourcc else ""
        return f"{self.width}x{self.height} @ {self.fps:.3g} fps{fourcc} ({self.backend})"


class FrameSource:
    """A camera's frames. Subclasses set `granted` when opened and implement `read()`.

    `decode` says which decoder makes the frames and why (Note [Decoder choice]); a source
    with `on_device` (the GPU decoder's, facecast.workers.capture.nvdec) gives torch tensors on
    the camera's GPU (`read`), and to the capture worker frames as the decoder left them
    (`read_decoded`), which it publishes with `publish_decoded`."""

    kind = "?"
    on_device = False
    decodes_into = False  # `read_into` decodes into memory it is given (Note [Staged writes])

    def __init__(self, camera: CameraConfig) -> None:
        self.camera = camera
        self.camera_id = camera.id
        self.granted: Granted = Granted(camera.width, camera.height, camera.fps, "", "?")
        self.frames_read = 0
        self.decode = DecodeChoice("cpu", "")  # open_source says why

    def read(self) -> tuple[np.ndarray, float]:
        """The next frame (BGR uint8 HxWx3) and its capture time (`pylsl.local_clock()`)."""
        raise NotImplementedError

    def read_into(self, out: np.ndarray) -> tuple[np.ndarray, float]:
        """`read`, decoding into `out` (a ring's staging view, Note [Staged writes]) where the
        frame fits it: the frame returned is then `out` itself, else a new array (a frame of
        another size or layout, which the caller publishes as it is). Where `decodes_into`."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def close_at_exit(self) -> None:
        """Closed because the process is ending (the worker's stop, Note [Quick exit]): what
        the process's end reclaims as well may be left to it."""
        self.close()

    def __enter__(self) -> FrameSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _lost(self, reason: str) -> SourceLost:
        return SourceLost(self.camera_id, reason)


def open_source(
    camera: CameraConfig, *, open_timeout_s: float = 10.0, read_timeout_s: float = 5.0,
    decode: DecodeRequest | None = None,
) -> FrameSource:
    """Open the camera's source with the decoder `decode` leads to (Note [Decoder choice];
    default: the CPU, as asked for); raises SourceLost (retry later) or SourceConfigError
    (don't). The source's `decode` says which decoder it got and why."""
    kind = source_kind(camera.source)
    request = decode if decode is not None else DecodeRequest()
    choice = decoding.plan(request, kind)
    if choice is None:
        if kind == "file":
            video_file_path(camera)  # no such file: lost (or given up on), whatever the decoder
        try:
            from facecast.workers.capture import nvdec

            return nvdec.open_gpu_source(camera, kind, request, open_timeout_s=open_timeout_s,
                                         read_timeout_s=read_timeout_s)
        except GpuDecodeUnavailable as exc:
            choice = DecodeChoice("cpu", f"{request.asked()}, but {exc.reason}")
        except (SourceLost, SourceConfigError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug of the GPU path must not lose the camera
            log.exception("camera %s: the GPU decoder could not open its source", camera.id)
            choice = DecodeChoice("cpu", f"{request.asked()}, but the GPU decoder could not "
                                  f"open it ({type(exc).__name__}: {exc})")
        log.info("camera %s: decoded on the CPU: %s", camera.id, choice.reason)
    source = _open_on_cpu(camera, kind, open_timeout_s, read_timeout_s)
    source.decode = choice
    return source


def _open_on_cpu(camera: CameraConfig, kind: str, open_timeout_s: float,
                 read_timeout_s: float) -> FrameSource:
    if kind == "synthetic":
        return SyntheticSource(camera)
    if kind == "synthetic-replay":
        return SyntheticReplaySource(camera)
    if kind in ENCODED_SYNTHETIC_CODECS:
        return EncodedSyntheticSource(camera)
    if kind == "v4l2":
        return V4L2Source(camera)
    if kind == "stream":
        return StreamSource(camera, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s)
    return FileSource(camera)


def video_file_path(camera: CameraConfig) -> Path:
    """The video file a camera's source names; SourceNotFound when it is not a regular file
    here (Note [Sources that can never work])."""
    source = str(camera.source)
    path = Path(source[len("file://"):] if source.startswith("file://") else source)
    if not path.exists():
        raise SourceNotFound(camera.id, f"no such video file {str(path)!r}")
    if not path.is_file():
        raise SourceNotFound(camera.id,
                             f"{str(path)!r} is not a regular file (allowed: a video file)")
    return path


class ReopenBackoff:
    """When a capture worker tries to reopen its lost source: the one reconnect policy.

    Exponential backoff with jitter: the first retry after `first_delay_s`, each further one
    `factor` times later, capped at `max_delay_s`; a frame read resets it (`succeeded`). It never
    sleeps: the capture worker's loop keeps answering the supervisor (heartbeats, ring control)
    while its camera is down, and asks `wait_s()` how long until the next try.
    """

    def __init__(self, *, first_delay_s: float = 0.5, max_delay_s: float = 30.0,
                 factor: float = 2.0, jitter_fraction: float = 0.1) -> None:
        if not 0 < first_delay_s <= max_delay_s or factor < 1 or not 0 <= jitter_fraction < 1:
            raise ValueError(
                "backoff needs 0 < first_delay_s <= max_delay_s, factor >= 1 and "
                f"0 <= jitter_fraction < 1; got {first_delay_s}, {max_delay_s}, {factor}, "
                f"{jitter_fraction}")
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.factor = factor
        self.jitter_fraction = jitter_fraction
        self.failures = 0  # since the last success
        self._next_delay_s = first_delay_s
        self._retry_at_monotonic = 0.0

    def failed(self) -> float:
        """The source was lost or a reopen failed: schedule the next try; returns its delay (s)."""
        jitter = 1.0 + self.jitter_fraction * (2.0 * random.random() - 1.0)
        delay_s = self._next_delay_s * jitter
        self._retry_at_monotonic = time.monotonic() + delay_s
        self._next_delay_s = min(self.max_delay_s, self._next_delay_s * self.factor)
        self.failures += 1
        return delay_s

    def wait_s(self) -> float:
        """Seconds until the next try is due (0: now)."""
        return max(0.0, self._retry_at_monotonic - time.monotonic())

    def succeeded(self) -> None:
        """The source delivers again: the next loss starts from `first_delay_s`."""
        self.failures = 0
        self._next_delay_s = self.first_delay_s
        self._retry_at_monotonic = 0.0


# --- pacing --------------------------------------------------------------------------------------


class _Pacer:
    """Hands out frame deadlines at `fps` on the monotonic clock; a late reader skips ahead.

    Like a real camera, frames are not queued for a slow reader: when `wait()` is called more
    than one period late, the missed frames are skipped (counted) and the schedule continues.
    """

    def __init__(self, fps: float) -> None:
        self.period_s = 1.0 / fps
        self.next_due_monotonic: float | None = None
        self.frames_skipped = 0

    def wait(self) -> None:
        now = time.monotonic()
        if self.next_due_monotonic is None:
            self.next_due_monotonic = now
        late_s = now - self.next_due_monotonic
        if late_s < 0:
            time.sleep(-late_s)
        elif late_s > self.period_s:
            missed = int(late_s / self.period_s)
            self.frames_skipped += missed
            self.next_due_monotonic += missed * self.period_s
        self.next_due_monotonic += self.period_s


# --- synthetic -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaceTruth:
    """Where a synthetic face is: the box MediaPipe's detector draws around it, in frame pixels."""

    name: str  # the person: "astronaut" or "grace_hopper"
    box_px: tuple[float, float, float, float]  # x1, y1, x2, y2

    @property
    def size_px(self) -> float:
        return self.box_px[2] - self.box_px[0]

    @property
    def center_px(self) -> tuple[float, float]:
        x1, y1, x2, y2 = self.box_px
        return (x1 + x2) / 2, (y1 + y2) / 2


@dataclass(frozen=True, slots=True)
class _Photo:
    name: str
    # The face box MediaPipe 0.10.21's short-range face detector finds on the unmodified photo
    # (tests/models/fixtures/mediapipe_faces.npz, "<name>/boxes_px"), in the pixels of the crop
    # that ships in synthetic_faces/ (scripts/make_synthetic_faces.py).
    face_box_px: tuple[float, float, float, float]


# Public-domain portraits (NASA's astronaut Eileen Collins, as in scikit-image; the US Navy's Grace
# Hopper, as in matplotlib), cropped around the face: the synthetic camera needs no test extras.
_PHOTO_DIR = Path(__file__).resolve().parent / "synthetic_faces"
_PHOTOS = (
    _Photo("astronaut", (47.56541, 56.87118, 142.9095, 152.21541)),
    _Photo("grace_hopper", (97.35315, 116.91507, 291.84296, 311.3939)),
)


@functools.lru_cache(maxsize=None)
def _photo_bgr(name: str) -> np.ndarray:
    path = _PHOTO_DIR / f"{name}.png"
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        raise FileNotFoundError(f"cannot read the synthetic source's face photo {path}")
    return image


@dataclass(frozen=True, slots=True)
class _Sprite:
    """A face photo cut out with a soft elliptical edge, and its face box in sprite pixels."""

    name: str
    bgra: np.ndarray  # uint8: BGR premultiplied by alpha, and alpha (255: opaque)
    face_box_px: tuple[float, float, float, float]


@functools.lru_cache(maxsize=None)
def _sprite(photo: _Photo) -> _Sprite:
    image = _photo_bgr(photo.name)
    x1, y1, x2, y2 = photo.face_box_px
    side = x2 - x1
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    # Keep hair, ears and chin: a square of twice the face box, a little lower than its centre.
    left, top = int(round(cx - side)), int(round(cy - 1.1 * side))
    right, bottom = int(round(cx + side)), int(round(cy + 1.05 * side))
    height_px, width_px = image.shape[:2]
    left, top = max(left, 0), max(top, 0)
    right, bottom = min(right, width_px), min(bottom, height_px)
    crop = image[top:bottom, left:right].astype(np.float32) / 255.0
    mask = np.zeros(crop.shape[:2], np.float32)
    center = (int(round(cx - left)), int(round(cy - top - 0.05 * side)))
    axes = (int(round(0.78 * side)), int(round(0.95 * side)))
    cv2.ellipse(mask, center, axes, 0.0, 0.0, 360.0, 1.0, thickness=-1)
    mask = cv2.GaussianBlur(mask, (0, 0), sigmaX=0.08 * side)
    bgra = np.dstack([crop * mask[..., None], mask]) * 255.0 + 0.5
    box = (x1 - left, y1 - top, x2 - left, y2 - top)
    return _Sprite(photo.name, np.ascontiguousarray(bgra.astype(np.uint8)), box)


class SyntheticScene:
    """Two real faces on a smooth, known path: a pure function of time.

    Note [Staged scenes]
        Tests of identity need people who move between cameras: `CameraConfig.staging` is a
        script of appearances (photo, seat, from_s, until_s) repeated every `cycle_s` seconds
        of capture time. A frame captured at `t` shows the appearances whose interval holds
        `t mod cycle_s`, each on its seat's smooth path (seat 0 on the left, 1 on the right):
        the truth stays a pure function of the capture time and the config, so a test process
        knows who is in every frame without talking to the capture worker. Every camera's
        cycle starts at the same capture times (multiples of cycle_s on `pylsl.local_clock()`),
        so a swap between two cameras happens in both at once. People move instantly between
        seats (a swap within one frame), as a track lost for a few frames would see them.
        Without staging, astronaut sits in seat 0 and grace_hopper in seat 1, always.

    `render(t_s)` and `faces_at(t_s)` depend only on the camera's id, size and `t_s`, so a test in
    another process can compute the ground truth of any frame from its capture timestamp (the
    synthetic source renders each frame at its own capture time, `t_s = capture_ts_lsl`).

    Face boxes are ~22% of the frame's long side: MediaPipe's short-range detector sees the
    frame letterboxed to 128x128 and misses faces much smaller than that (the fixture
    `canvas1080_medium`, a 0.9x grace_hopper in 1920x1080, has no detection).
    """

    FACE_SIZE_FRACTION = 0.22  # of max(width, height)
    PERIODS_S = ((7.0, 5.0, 11.0), (6.0, 8.0, 13.0))  # per face: x, y, scale
    SCALE_AMPLITUDE = 0.08

    def __init__(self, width: int, height: int, seed: str = "",
                 staging: StagingConfig | None = None) -> None:
        if width < 64 or height < 64:
            raise ValueError(f"a synthetic scene needs at least 64x64 pixels, got {width}x{height}")
        self.width = width
        self.height = height
        self.seed = seed
        self.staging = staging
        # Per seat (the path), not per photo: a staged person takes the seat's path.
        phase_rng = np.random.default_rng(zlib.crc32(seed.encode()))
        self._phases = phase_rng.uniform(0.0, 2.0 * math.pi, size=(len(_PHOTOS), 3))
        self._sprites = {photo.name: _sprite(photo) for photo in _PHOTOS}
        face_px = self.FACE_SIZE_FRACTION * max(width, height)
        self._base_face_px = min(face_px, 0.42 * height, 0.3 * width)
        self._background = self._make_background(width, height)

    @classmethod
    def for_camera(cls, camera: CameraConfig) -> SyntheticScene:
        return cls(camera.width, camera.height, seed=camera.id, staging=camera.staging)

    def seated_at(self, t_s: float) -> list[tuple[int, str]]:
        """(seat, photo name) of everyone in the frame at `t_s`, in seat order."""
        if self.staging is None:
            return [(seat, photo.name) for seat, photo in enumerate(_PHOTOS)]
        return [(shown.seat, shown.photo) for shown in self.staging.shown_at(t_s)]

    @staticmethod
    def _make_background(width: int, height: int) -> np.ndarray:
        # A plain studio-like backdrop: a soft vertical gradient, warm at the bottom.
        ramp = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
        top = np.array([158, 140, 128], np.float32)  # BGR
        bottom = np.array([107, 115, 128], np.float32)
        column = (top + (bottom - top) * ramp + 0.5).astype(np.uint8)
        return np.ascontiguousarray(np.broadcast_to(column, (height, width, 3)))

    def _placements(self, t_s: float) -> list[tuple[_Sprite, float, float, float]]:
        """(sprite, scale, offset_x, offset_y) mapping sprite pixels to frame pixels."""
        placements = []
        for index, name in self.seated_at(t_s):
            sprite = self._sprites[name]
            period_x, period_y, period_scale = self.PERIODS_S[index]
            phase_x, phase_y, phase_scale = self._phases[index]
            wave_scale = math.sin(2.0 * math.pi * t_s / period_scale + phase_scale)
            face_px = self._base_face_px * (1.0 + self.SCALE_AMPLITUDE * wave_scale)
            base_x = self.width * (0.27 + 0.46 * index)
            amplitude_x = max(0.0, 0.23 * self.width - 0.5 * face_px * (1 + self.SCALE_AMPLITUDE))
            amplitude_x = min(amplitude_x, 0.06 * self.width)
            amplitude_y = max(0.0, 0.5 * self.height - 0.5 * face_px - 0.04 * self.height)
            amplitude_y = min(amplitude_y, 0.08 * self.height)
            center_x = base_x + amplitude_x * math.sin(2.0 * math.pi * t_s / period_x + phase_x)
            center_y = 0.5 * self.height + amplitude_y * math.sin(
                2.0 * math.pi * t_s / period_y + phase_y
            )
            bx1, by1, bx2, by2 = sprite.face_box_px
            scale = face_px / (bx2 - bx1)
            offset_x = center_x - scale * (bx1 + bx2) / 2
            offset_y = center_y - scale * (by1 + by2) / 2
            placements.append((sprite, scale, offset_x, offset_y))
        return placements

    def faces_at(self, t_s: float) -> list[FaceTruth]:
        """The faces' boxes (frame pixels) in the frame rendered at `t_s`."""
        truths = []
        for sprite, scale, offset_x, offset_y in self._placements(t_s):
            x1, y1, x2, y2 = sprite.face_box_px
            box = (
                offset_x + scale * x1,
                offset_y + scale * y1,
                offset_x + scale * x2,
                offset_y + scale * y2,
            )
            truths.append(FaceTruth(sprite.name, box))
        return truths

    def render(self, t_s: float) -> np.ndarray:
        """The frame at time `t_s`: BGR uint8, height x width x 3."""
        frame = self._background.copy()
        for sprite, scale, offset_x, offset_y in self._placements(t_s):
            sprite_h, sprite_w = sprite.bgra.shape[:2]
            # The sprite's footprint in the frame, clipped; warp only that region.
            left = max(0, int(math.floor(offset_x)))
            top = max(0, int(math.floor(offset_y)))
            right = min(self.width, int(math.ceil(offset_x + scale * sprite_w)))
            bottom = min(self.height, int(math.ceil(offset_y + scale * sprite_h)))
            if right <= left or bottom <= top:
                continue
            sprite_to_region = np.array(
                [[scale, 0.0, offset_x - left], [0.0, scale, offset_y - top]], np.float64
            )
            # Pixel centres: sprite pixel i covers [i, i+1); OpenCV maps centres, so shift by
            # half a pixel on both sides to keep box coordinates exact under scaling.
            sprite_to_region[:, 2] += 0.5 * (scale - 1.0)
            region = cv2.warpAffine(
                sprite.bgra,
                sprite_to_region,
                (right - left, bottom - top),
                flags=cv2.INTER_LINEAR,
                borderMode=cv2.BORDER_CONSTANT,
                borderValue=(0, 0, 0, 0),
            )
            # Premultiplied "over", in saturating uint8 (a 1280x720 frame renders in ~2 ms).
            transparency = cv2.cvtColor(255 - region[..., 3], cv2.COLOR_GRAY2BGR)
            target = frame[top:bottom, left:right]
            target[...] = cv2.add(
                cv2.multiply(target, transparency, scale=1.0 / 255.0),
                cv2.cvtColor(region, cv2.COLOR_BGRA2BGR),
            )
        return frame


class SyntheticSource(FrameSource):
    """`SyntheticScene` paced in real time at the camera's fps; a frame shows its capture time."""

    kind = "synthetic"

    def __init__(self, camera: CameraConfig) -> None:
        super().__init__(camera)
        self.scene = SyntheticScene.for_camera(camera)
        self.granted = Granted(camera.width, camera.height, camera.fps, "BGR3", "synthetic")
        self._pacer = _Pacer(camera.fps)
        log.info("camera %s: %s source, %s", camera.id, self.kind, self.granted.describe())

    @property
    def frames_skipped(self) -> int:
        return self._pacer.frames_skipped

    def read(self) -> tuple[np.ndarray, float]:
        self._pacer.wait()
        capture_ts_lsl = pylsl.local_clock()
        frame = self._frame_at(capture_ts_lsl)
        self.frames_read += 1
        return frame, capture_ts_lsl

    def _frame_at(self, capture_ts_lsl: float) -> np.ndarray:
        return self.scene.render(capture_ts_lsl)

    def ground_truth(self, capture_ts_lsl: float) -> list[FaceTruth]:
        """The faces in the frame that was captured at `capture_ts_lsl`."""
        return self.scene.faces_at(capture_ts_lsl)


class SyntheticReplay:
    """Which frame of a short rendered loop of `scene` a synthetic-replay camera shows at a
    capture time, and its ground truth: pure functions of the capture timestamp, like the live
    scene's, and computable in any process without rendering anything.

    Note [Synthetic replay]
        The live synthetic camera renders each frame when it is grabbed: 13-17 ms of one core
        per 1080p frame, so 32 cameras at 30 fps need ~15 cores for rendering alone, which on a
        16-core host starves the daemon they are meant to measure. `source = "synthetic-replay"`
        renders `LOOP_FRAMES` frames of the same scene once, when the source opens, and then
        only hands them out: a frame costs the capture worker's one copy into its ring.
        Which frame: the capture clock's tick, `floor(capture_ts_lsl * fps)`, walks the loop
        back and forth (0, 1, .., L-1, L-2, .., 1, 0, 1, ..), so the faces move on the scene's
        smooth path and turn round at the ends, never jumping. Loop frame i shows the scene at
        `i / fps`; `faces_at(capture_ts_lsl)` is the scene's truth there. A capture is stamped
        when grabbed and paced like the live source's (`_Pacer`), with its schedule put half a
        period into a tick: a wake-up late by less than half a period still shows its own
        tick's frame, where a schedule on the ticks' edges would show frames twice or skip them
        with the scheduler's jitter.
        Memory: L x width x height x 3 bytes per camera, 30 x 6.2 MB = 187 MB at 1080p (6 GB
        for 32 cameras); rendering it takes about half a second of one core at open.

    Note [Capture phases]
        Each replayed camera has its own capture clock's ticks, `floor(capture_ts_lsl * fps -
        phase)`: its phase (`CameraConfig.phase`, a fraction of the period) says where in each
        period of the shared clock it captures. Cameras of one phase capture at the same
        instants, as genlocked (hardware-triggered) cameras do; free-running cameras, USB and IP
        cameras as labs mostly have them, each capture at a phase of their own. Until
        2026-11-27 every replayed camera had phase 0, so 64 cameras handed their 64 frames
        (400 MB at 1080p) to the capture workers at one instant, and the daemon's own first hop
        (grab to published: the copies into pinned memory and over PCIe, one after another)
        grew with the camera count, 3.1 / 8.6 / 19.6 ms mean at 8 / 32 / 64 cameras (H100,
        docs/benchmarks.md). A camera with no phase configured takes one from its id (CRC-32,
        as a fraction of 2**32): fixed for the id, so that the ground truth in another process
        is the same, and spread as free-running cameras' are. `phase = 0.0` on every camera
        (bench/pipeline.py --genlocked) gives the genlocked case back.
    """

    LOOP_FRAMES = SYNTHETIC_REPLAY_LOOP_FRAMES  # 1 s each way at 30 fps

    def __init__(self, scene: SyntheticScene, fps: float, loop_frames: int = LOOP_FRAMES,
                 phase: float = 0.0) -> None:
        if loop_frames < 2:
            raise ValueError(f"a replayed loop needs at least 2 frames, got {loop_frames}")
        if not fps > 0:
            raise ValueError(f"a replayed loop needs fps > 0, got {fps}")
        if not 0.0 <= phase < 1.0:
            raise ValueError(f"a replayed loop's phase is a fraction of a period, 0 <= phase < 1; "
                             f"got {phase}")
        self.scene = scene
        self.fps = fps
        self.loop_frames = loop_frames
        self.phase = phase

    @classmethod
    def for_camera(cls, camera: CameraConfig) -> SyntheticReplay:
        return cls(SyntheticScene.for_camera(camera), camera.fps, phase=capture_phase(camera))

    def tick(self, capture_ts_lsl: float) -> int:
        """The camera's capture clock's tick at `capture_ts_lsl` (Note [Capture phases])."""
        return math.floor(capture_ts_lsl * self.fps - self.phase)

    def due_ts_lsl(self, capture_ts_lsl):
        """When the frame captured at `capture_ts_lsl` (a number or a numpy array of them) was
        due: the middle of its tick, where the camera captures (`middle_of_tick_s`); its capture
        timestamp follows by the wake-up's lateness. The benches count frames by it
        (bench/accounting.py)."""
        return self.middle_of_tick_s(np.floor(np.asarray(capture_ts_lsl, np.float64) * self.fps
                                              - self.phase))

    def middle_of_tick_s(self, tick):
        """The capture time half a period into `tick` (a number, or a numpy array of them),
        where the camera captures (Note [Synthetic replay])."""
        return (tick + 0.5 + self.phase) / self.fps

    def schedule_half_into_ticks(self, pacer: _Pacer) -> None:
        """Schedule `pacer`'s captures half a period into this camera's ticks (Note [Synthetic
        replay], Note [Capture phases]); the pacer runs on the monotonic clock, the ticks on the
        capture clock."""
        lsl_minus_monotonic_s = pylsl.local_clock() - time.monotonic()
        tick = self.tick(time.monotonic() + lsl_minus_monotonic_s)
        pacer.next_due_monotonic = self.middle_of_tick_s(tick + 1) - lsl_minus_monotonic_s

    @property
    def cycle_frames(self) -> int:
        """Frames of one round trip through the loop: 0, 1, .., L-1, L-2, .., 1."""
        return 2 * (self.loop_frames - 1)

    def cycle_position(self, capture_ts_lsl: float) -> int:
        """Where in the round trip the frame captured at `capture_ts_lsl` is (0..cycle_frames-1):
        the frame number in the encoded loop's file (Note [Encoded synthetic loop])."""
        return self.tick(capture_ts_lsl) % self.cycle_frames

    def loop_index_of_position(self, position: int) -> int:
        """The loop frame at `position` of the round trip."""
        return position if position < self.loop_frames else self.cycle_frames - position

    def loop_index(self, capture_ts_lsl: float) -> int:
        """The loop frame shown at `capture_ts_lsl` (Note [Synthetic replay])."""
        return self.loop_index_of_position(self.cycle_position(capture_ts_lsl))

    def scene_time_s(self, capture_ts_lsl: float) -> float:
        """The scene time of the frame shown at `capture_ts_lsl`."""
        return self.loop_index(capture_ts_lsl) / self.fps

    def faces_at(self, capture_ts_lsl: float) -> list[FaceTruth]:
        """The faces' boxes (frame pixels) in the frame captured at `capture_ts_lsl`."""
        return self.scene.faces_at(self.scene_time_s(capture_ts_lsl))

    def render_loop(self) -> np.ndarray:
        """Every loop frame, (loop_frames, height, width, 3) BGR uint8, read-only."""
        frames = np.empty((self.loop_frames, self.scene.height, self.scene.width, 3), np.uint8)
        for index in range(self.loop_frames):
            frames[index] = self.scene.render(index / self.fps)
        frames.flags.writeable = False  # every read hands out a view: nobody may draw on it
        return frames


def synthetic_truth(camera: CameraConfig) -> SyntheticScene | SyntheticReplay:
    """The ground truth of a synthetic camera: its `faces_at(capture_ts_lsl)` gives the faces
    in the frame captured at that time, for "synthetic", "synthetic-replay" and the encoded
    loops ("synthetic-h264", "synthetic-mjpeg": the replayed loop's truth, Note [Encoded
    synthetic loop]) alike."""
    kind = source_kind(camera.source)
    if kind == "synthetic":
        return SyntheticScene.for_camera(camera)
    if kind == "synthetic-replay" or kind in ENCODED_SYNTHETIC_CODECS:
        return SyntheticReplay.for_camera(camera)
    raise ValueError(f"camera {camera.id}: source {camera.source!r} is not synthetic; only "
                     '"synthetic" and "synthetic-replay" (and its encoded loops, '
                     '"synthetic-h264" and "synthetic-mjpeg") have a ground truth')


def capture_phase(camera: CameraConfig) -> float:
    """Where in each frame period a replayed camera captures (Note [Capture phases]): its
    configured phase, else a fraction fixed by its id."""
    if camera.phase is not None:
        return camera.phase
    return zlib.crc32(camera.id.encode()) / 2**32


class SyntheticReplaySource(SyntheticSource):
    """`SyntheticReplay`: a loop of `SyntheticScene` rendered at open, replayed in real time at
    the camera's fps, back and forth (Note [Synthetic replay])."""

    kind = "synthetic-replay"

    def __init__(self, camera: CameraConfig) -> None:
        super().__init__(camera)
        self.replay = SyntheticReplay(self.scene, camera.fps, phase=capture_phase(camera))
        started_s = time.monotonic()
        made_ahead = take_loop_made_ahead(camera)
        self._loop = self.replay.render_loop() if made_ahead is None else made_ahead
        log.info("camera %s: replays a %d-frame loop back and forth (%.0f MB, %s)", camera.id,
                 self.replay.loop_frames, self._loop.nbytes / 1e6,
                 f"rendered in {time.monotonic() - started_s:.2f} s" if made_ahead is None
                 else "rendered while its capture worker was held")
        self.replay.schedule_half_into_ticks(self._pacer)

    def _frame_at(self, capture_ts_lsl: float) -> np.ndarray:
        return self._loop[self.replay.loop_index(capture_ts_lsl)]

    def ground_truth(self, capture_ts_lsl: float) -> list[FaceTruth]:
        """The faces in the frame that was captured at `capture_ts_lsl`."""
        return self.replay.faces_at(capture_ts_lsl)


# --- OpenCV-backed sources -----------------------------------------------------------------------


def fourcc_text(code: float) -> str:
    """OpenCV's CAP_PROP_FOURCC value as text, e.g. "MJPG"; "" when the backend does not say."""
    value = int(code) if math.isfinite(code) else 0
    if value <= 0:
        return ""
    text = "".join(chr((value >> (8 * k)) & 0xFF) for k in range(4))
    return text if text.isprintable() else f"0x{value:08x}"


def _as_bgr(frame: np.ndarray) -> np.ndarray:
    if frame.ndim == 2:
        frame = cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR)
    elif frame.shape[2] == 4:
        frame = cv2.cvtColor(frame, cv2.COLOR_BGRA2BGR)
    if frame.dtype != np.uint8:
        raise SourceConfigError(f"expected 8-bit BGR frames, the source delivers {frame.dtype}")
    return np.ascontiguousarray(frame)


class _OpenCVSource(FrameSource):
    """Shared grab/retrieve logic: the timestamp is taken right after grab() returns."""

    backend = "?"
    decodes_into = True

    def __init__(self, camera: CameraConfig) -> None:
        super().__init__(camera)
        self._capture: cv2.VideoCapture | None = None

    def read(self) -> tuple[np.ndarray, float]:
        return self._read(None)

    def read_into(self, out: np.ndarray) -> tuple[np.ndarray, float]:
        # OpenCV's retrieve writes into an array of the frame's size and type, and returns it;
        # that saves the copy of a new array into the ring's staging memory.
        return self._read(out)

    def _read(self, out: np.ndarray | None) -> tuple[np.ndarray, float]:
        """`read`, decoding into `out` where it is given (`read_into`)."""
        raise NotImplementedError

    def _grab(self, out: np.ndarray | None) -> tuple[np.ndarray, float]:
        if self._capture is None:
            raise self._lost("source is closed")
        if not self._capture.grab():
            raise self._lost(self._grab_failure())
        return self._retrieve(pylsl.local_clock(), out)

    def _retrieve(self, capture_ts_lsl: float,
                  out: np.ndarray | None) -> tuple[np.ndarray, float]:
        assert self._capture is not None
        ok, frame = self._capture.retrieve(out) if out is not None else self._capture.retrieve()
        if not ok or frame is None:
            raise self._lost(f"{self.backend}: grabbed a frame that could not be decoded")
        frame = _as_bgr(frame)
        height_px, width_px = frame.shape[:2]
        if self.granted.width <= 0 or self.granted.height <= 0:
            # The backend could not say before the first frame; the first frame tells.
            self.granted = dataclasses.replace(self.granted, width=width_px, height=height_px)
        elif (width_px, height_px) != (self.granted.width, self.granted.height):
            raise self._lost(
                f"frame size changed from {self.granted.width}x{self.granted.height} to "
                f"{width_px}x{height_px}; reopen to renegotiate"
            )
        self.frames_read += 1
        return frame, capture_ts_lsl

    def _grab_failure(self) -> str:
        return f"{self.backend}: no frame"

    def close(self) -> None:
        if self._capture is not None:
            self._capture.release()
            self._capture = None


class V4L2Source(_OpenCVSource):
    """A USB/V4L2 camera by index or /dev path; requested size, fps and fourcc, granted logged."""

    kind = "v4l2"
    backend = "V4L2"

    def __init__(self, camera: CameraConfig) -> None:
        super().__init__(camera)
        source = camera.source
        is_index = isinstance(source, int) or source.isdigit()
        self.device: int | str = int(source) if is_index else source
        self._check_device_node()
        capture = cv2.VideoCapture(self.device, cv2.CAP_V4L2)
        if not capture.isOpened():
            capture.release()
            raise self._lost(
                f"cannot open V4L2 device {self.device!r} (missing, busy, or not readable: is "
                "the daemon's user in group 'video'?)"
            )
        # Order matters: the pixel format first (it limits the sizes), then size, then rate.
        if camera.fourcc:
            capture.set(cv2.CAP_PROP_FOURCC, cv2.VideoWriter.fourcc(*camera.fourcc))
        capture.set(cv2.CAP_PROP_FRAME_WIDTH, camera.width)
        capture.set(cv2.CAP_PROP_FRAME_HEIGHT, camera.height)
        capture.set(cv2.CAP_PROP_FPS, camera.fps)
        fps = capture.get(cv2.CAP_PROP_FPS)
        self.granted = Granted(
            width=int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            fps=float(fps) if math.isfinite(fps) and fps > 0 else camera.fps,
            fourcc=fourcc_text(capture.get(cv2.CAP_PROP_FOURCC)),
            backend=self.backend,
        )
        self._capture = capture
        requested = Granted(camera.width, camera.height, camera.fps, camera.fourcc, self.backend)
        differs = (
            (self.granted.width, self.granted.height) != (camera.width, camera.height)
            or abs(self.granted.fps - camera.fps) > 0.01
            or (camera.fourcc and self.granted.fourcc != camera.fourcc)
        )
        (log.warning if differs else log.info)(
            "camera %s: V4L2 device %s granted %s; requested %s",
            camera.id,
            self.device,
            self.granted.describe(),
            requested.describe(),
        )

    def _check_device_node(self) -> None:
        """SourceNotFound when there is no such device node (Note [Sources that can never
        work]); anything else (busy, no permission) is left to the open, and retried."""
        path = f"/dev/video{self.device}" if isinstance(self.device, int) else self.device
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise SourceNotFound(self.camera_id, f"no V4L2 device {path} on this machine "
                                 "(`facecast cameras` lists them)") from None
        except OSError:
            return
        if not stat.S_ISCHR(mode):
            raise SourceNotFound(self.camera_id, f"{path} is not a V4L2 device")

    def _read(self, out: np.ndarray | None) -> tuple[np.ndarray, float]:
        return self._grab(out)

    def _grab_failure(self) -> str:
        return f"V4L2 device {self.device!r} delivered no frame (unplugged or driver error)"


_FFMPEG_OPTIONS_LOCK = threading.Lock()


def _open_ffmpeg(url: str, open_timeout_s: float, read_timeout_s: float) -> cv2.VideoCapture:
    """VideoCapture on the FFMPEG backend with timeouts; RTSP over TCP unless the user chose.

    RTSP over TCP: a lost peer closes the connection (noticed at once, not after the read
    timeout) and lossy lab Wi-Fi does not tear frames. OpenCV reads its FFMPEG options from
    $OPENCV_FFMPEG_CAPTURE_OPTIONS while opening, so it is set only around that call.
    """
    params = [
        cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
        int(open_timeout_s * 1000),
        cv2.CAP_PROP_READ_TIMEOUT_MSEC,
        int(read_timeout_s * 1000),
    ]
    name = "OPENCV_FFMPEG_CAPTURE_OPTIONS"
    is_rtsp = url.lower().startswith(("rtsp://", "rtsps://"))
    with _FFMPEG_OPTIONS_LOCK:
        previous = os.environ.get(name)
        if is_rtsp and previous is None:
            os.environ[name] = "rtsp_transport;tcp"
        try:
            return cv2.VideoCapture(url, cv2.CAP_FFMPEG, params)
        finally:
            if is_rtsp and previous is None:
                del os.environ[name]


_DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322, "http": 80, "https": 443}


def _why_no_stream(url: str, open_timeout_s: float, elapsed_s: float) -> str:
    """Why OpenCV could not open a stream, in a user's words. OpenCV says only that it failed,
    often at once (FFmpeg's "Connection refused" goes to stderr): a failure well inside the open
    timeout is looked at again with one TCP connection to the peer's port, so that a refused
    connection, an unknown host or an unreachable network is named as such instead of "within
    5 s" 0.02 s after the start. Only on a failure: a working camera never sees the extra
    connection."""
    shown = redact_url(url)
    if elapsed_s >= 0.9 * open_timeout_s:
        return (f"cannot open stream {shown} within {open_timeout_s:g} s (peer down, wrong "
                "path or credentials, or no video track)")
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 0)
    except ValueError:
        return f"cannot open stream {shown}: its port is not a number"
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port),
                                      timeout=max(0.2, open_timeout_s - elapsed_s)):
            pass
    except ConnectionRefusedError:
        return (f"cannot open stream {shown}: connection refused by {where} (nothing listens "
                "there: the camera is off or the port is wrong)")
    except socket.gaierror as exc:
        return f"cannot open stream {shown}: unknown host {host!r} ({exc.strerror})"
    except TimeoutError:
        return f"cannot open stream {shown}: {where} did not answer within {open_timeout_s:g} s"
    except OSError as exc:
        return f"cannot open stream {shown}: cannot connect to {where} ({exc.strerror or exc})"
    return (f"cannot open stream {shown}: {where} accepts connections but sent no video "
            "stream (wrong path or credentials, or no video track)")


class StreamSource(_OpenCVSource):
    """An RTSP or HTTP stream through OpenCV's FFMPEG backend; frames as fast as they come."""

    kind = "stream"
    backend = "FFMPEG"

    def __init__(
        self, camera: CameraConfig, *, open_timeout_s: float = 10.0, read_timeout_s: float = 5.0
    ) -> None:
        super().__init__(camera)
        self.url = str(camera.source)
        self.read_timeout_s = read_timeout_s
        started_monotonic = time.monotonic()
        capture = _open_ffmpeg(self.url, open_timeout_s, read_timeout_s)
        if not capture.isOpened():
            capture.release()
            raise self._lost(_why_no_stream(
                self.url, open_timeout_s, time.monotonic() - started_monotonic))
        fps = capture.get(cv2.CAP_PROP_FPS)
        self.granted = Granted(
            width=int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            fps=float(fps) if math.isfinite(fps) and 0 < fps <= 1000 else camera.fps,
            fourcc=fourcc_text(capture.get(cv2.CAP_PROP_FOURCC)),
            backend=self.backend,
        )
        self._capture = capture
        log.info(
            "camera %s: stream %s delivers %s",
            camera.id,
            redact_url(self.url),
            self.granted.describe(),
        )

    def _read(self, out: np.ndarray | None) -> tuple[np.ndarray, float]:
        return self._grab(out)

    def _grab_failure(self) -> str:
        return (
            f"stream {redact_url(self.url)} ended or sent nothing for {self.read_timeout_s:g} s "
            "(peer gone?)"
        )


class FileSource(_OpenCVSource):
    """A video file, looped, paced at its native fps (the configured fps if it has none)."""

    kind = "file"
    backend = "FFMPEG"

    def __init__(self, camera: CameraConfig, path: Path | None = None) -> None:
        super().__init__(camera)
        self.path = path if path is not None else video_file_path(camera)
        self.loops = 0
        self._capture = self._open()
        fps = self._capture.get(cv2.CAP_PROP_FPS)
        if not (math.isfinite(fps) and 0 < fps <= 1000):
            log.warning(
                "camera %s: %s has no usable frame rate (%r); pacing it at the configured %g fps",
                camera.id,
                self.path,
                fps,
                camera.fps,
            )
            fps = camera.fps
        self.granted = Granted(
            width=int(self._capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(self._capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            fps=float(fps),
            fourcc=fourcc_text(self._capture.get(cv2.CAP_PROP_FOURCC)),
            backend=self.backend,
        )
        self._pacer = _Pacer(self.granted.fps)
        log.info(
            "camera %s: file %s plays %s, looped", camera.id, self.path, self.granted.describe()
        )

    def _open(self) -> cv2.VideoCapture:
        capture = cv2.VideoCapture(str(self.path), cv2.CAP_FFMPEG)
        if not capture.isOpened():
            capture.release()
            raise self._lost(f"OpenCV's FFMPEG backend cannot open video file {str(self.path)!r}")
        return capture

    @property
    def frames_skipped(self) -> int:
        return self._pacer.frames_skipped

    def _read(self, out: np.ndarray | None) -> tuple[np.ndarray, float]:
        if self._capture is None:
            raise self._lost("source is closed")
        self._pacer.wait()
        if not self._capture.grab():
            # End of file: start again from a fresh open (seeking is unreliable in some
            # containers); a file that still yields nothing is lost.
            self._capture.release()
            self._capture = self._open()
            self.loops += 1
            if not self._capture.grab():
                raise self._lost(self._grab_failure())
        return self._retrieve(pylsl.local_clock(), out)

    def _grab_failure(self) -> str:
        return f"video file {str(self.path)!r} yields no frames"


# --- the synthetic scene, encoded ----------------------------------------------------------------


class EncodedSyntheticLoop:
    """A `SyntheticReplay`'s round trip (loop frames 0, 1, .., L-1, L-2, .., 1) encoded once to
    H.264 or MJPEG with PyAV, held in an anonymous memory file that `path` opens.

    Note [Encoded synthetic loop]
        Real cameras send compressed video, and decoding it is a cost a lab pays on every frame.
        `source = "synthetic-h264"` (or "synthetic-mjpeg") is synthetic-replay's loop encoded
        once when the source opens and then decoded frame by frame by the file source's decoder
        (OpenCV's FFMPEG backend; "synthetic-h264" on NVDEC where the GPU decoder takes it:
        nvdec.NvdecEncodedSyntheticSource, the same file, positions and truth), so that tests
        and benchmarks pay for decoding and still know every frame's faces.
        The file is the round trip played forwards, 2(L-1) frames, one an fps tick: frame p is
        loop frame `SyntheticReplay.loop_index_of_position(p)`. A capture is paced and stamped
        as synthetic-replay's (half a period into its tick, stamped when due, i.e. when a camera
        would have sent the compressed frame; decoding follows), and the frame it publishes is
        file frame `cycle_position(capture_ts_lsl)`: the decoder goes forward to it, decoding
        the frames a late reader skipped as a camera's stream would make it, and starts the
        file again after its last frame. So the truth is synthetic-replay's, a pure function of
        the capture time (`synthetic_truth`). H.264 is encoded as IP cameras send it: no
        B-frames (one packet, one frame, in capture order), an IDR frame a second, CABAC and
        deblocking on (libx264 "superfast", CRF 20); MJPEG at a fixed quantiser 3 (JPEG quality
        ~90, as USB cameras send). Both are 4:2:0, so width and height must be even; the
        colour conversion alone limits the decoded frames to ~38-41 dB PSNR against the renders.
        The file is a memfd (mode 0600), not a file in the runtime directory: nothing names it,
        the kernel frees it when the source closes it or the process dies however it dies, and
        only this user's processes can open /proc/<pid>/fd/<n>. A 1080p loop is 0.9 MB as
        H.264 (0.6 MB while libx264 ignored the options above and made one IDR frame and
        B-frames; 6 MB as MJPEG) against synthetic-replay's 187 MB of raw frames; encoding it
        took 1.6-1.9 s (MJPEG 0.9 s) at open on a 2-core CI machine, the frames rendered one by one,
        never all held; decoding a 1080p frame to BGR there costs ~12 ms (MJPEG ~9 ms) of CPU.
    """

    _CONTAINERS = {"h264": "mp4", "mjpeg": "avi"}
    # x264's own settings go through x264-params: given as codec options ("bframes", "keyint"),
    # libx264 ignored them and the loop had B-frames and one IDR frame in 58.
    H264_OPTIONS = {"preset": "superfast", "crf": "20"}
    MJPEG_QSCALE = 3

    def __init__(self, replay: SyntheticReplay, codec: str, name: str = "") -> None:
        if codec not in self._CONTAINERS:
            raise SourceConfigError(f"cannot encode a synthetic loop as {codec!r} (allowed: "
                                    f"{', '.join(self._CONTAINERS)})")
        width, height = replay.scene.width, replay.scene.height
        if width % 2 or height % 2:
            raise SourceConfigError(f"an encoded synthetic loop ({codec}, 4:2:0) needs an even "
                                    f"width and height, got {width}x{height}")
        self.replay = replay
        self.codec = codec
        self.frame_count = replay.cycle_frames
        started_s = time.monotonic()
        self._fd: int | None = os.memfd_create(f"facecast-synthetic-{codec}-{name}",
                                               os.MFD_CLOEXEC)
        try:
            os.fchmod(self._fd, 0o600)
            self.path = Path(f"/proc/{os.getpid()}/fd/{self._fd}")
            self._encode()
        except BaseException:
            self.close()
            raise
        self.encode_s = time.monotonic() - started_s
        self.nbytes = os.fstat(self._fd).st_size

    def _encode(self) -> None:
        import av  # only the encoded synthetic sources need PyAV in the capture worker

        replay = self.replay
        rate = fractions.Fraction(replay.fps).limit_denominator(1001)
        with av.open(str(self.path), mode="w", format=self._CONTAINERS[self.codec]) as output:
            if self.codec == "h264":
                keyint = max(1, round(replay.fps))
                stream = output.add_stream("libx264", rate=rate, options={
                    **self.H264_OPTIONS,
                    "x264-params": f"bframes=0:keyint={keyint}:min-keyint={keyint}"})
                stream.pix_fmt = "yuv420p"
            else:
                stream = output.add_stream("mjpeg", rate=rate)
                stream.pix_fmt = "yuvj420p"
                stream.codec_context.qmin = stream.codec_context.qmax = self.MJPEG_QSCALE
            stream.width, stream.height = replay.scene.width, replay.scene.height
            for position in range(self.frame_count):
                # Rendered again on the way back: one frame in memory, not the whole loop.
                scene_time_s = replay.loop_index_of_position(position) / replay.fps
                frame = av.VideoFrame.from_ndarray(replay.scene.render(scene_time_s),
                                                   format="bgr24")
                frame.pts = position
                output.mux(stream.encode(frame))
            output.mux(stream.encode(None))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> EncodedSyntheticLoop:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def capture_in_a_new_tick(replay: SyntheticReplay,
                          shown_position: int | None) -> tuple[float, int]:
    """(capture_ts_lsl, file position) of an encoded synthetic camera's capture now: when a
    camera would have sent its frame (Note [Encoded synthetic loop]). A pacer that caught up
    after a slow read (the first one decodes up to a whole loop) can wake again within the tick
    of the frame just shown; that capture waits for the next tick, as a reader of a real camera
    waits for its next frame, instead of asking the decoder for the frame it has shown, which
    it would reach only by going round the whole loop."""
    capture_ts_lsl = pylsl.local_clock()
    position = replay.cycle_position(capture_ts_lsl)
    if position == shown_position:
        next_tick_s = replay.middle_of_tick_s(replay.tick(capture_ts_lsl) + 1)
        time.sleep(max(0.0, next_tick_s - capture_ts_lsl))
        capture_ts_lsl = pylsl.local_clock()
        position = replay.cycle_position(capture_ts_lsl)
    return capture_ts_lsl, position


def encoded_loop(camera: CameraConfig, replay: SyntheticReplay) -> EncodedSyntheticLoop:
    """The camera's encoded loop: made while its capture worker was held, else now."""
    made_ahead = take_loop_made_ahead(camera)
    if made_ahead is not None:
        return made_ahead
    return EncodedSyntheticLoop(replay, ENCODED_SYNTHETIC_CODECS[source_kind(camera.source)],
                                name=camera.id)


# --- loops made while held (Note [Loops made while held]) -----------------------------------------

# Note [Loops made while held]
#     A replayed synthetic camera makes its loop when its source opens: 30 rendered 1080p frames
#     (about half a second of one core), or those frames encoded as H.264 or MJPEG (1-2 s, more
#     on a busy machine). On a GPU a capture worker opens its sources only once the supervisor
#     releases it (Note [Boot order]), so at 64 replayed cameras READY waited 6.2-6.7 s after
#     the release for the four capture workers to boot, rendering 16 loops each (about 8 s of
#     one core a worker) among their rings and CUDA work (H100, 2026-11-27: READY after 32.8 s;
#     44 s at 64 synthetic-h264 cameras, which encode theirs; not profiled further). The loops
#     are the synthetic cameras' own cost, which no real camera has, and need neither the GPU
#     nor the camera's ring: a held capture worker makes them while it waits
#     (`make_loops_ahead`, a thread a camera), and each source takes its own at open
#     (`take_loop_made_ahead`, by the camera's whole config, so that a reload's changed camera
#     makes a new one). At most LOOPS_AT_ONCE a worker are made at a time: the inference
#     workers are preparing their CUDA graphs meanwhile, on the CPU as much as on the GPU. What
#     no source took is dropped after the boot (`drop_loops_made_ahead`). Real sources still
#     open after the release: a camera opened and not read would queue stale frames meanwhile.

_REPLAYED_KINDS = ("synthetic-replay", *ENCODED_SYNTHETIC_CODECS)
LOOPS_AT_ONCE = 4
_loops_made_ahead: dict[bytes, np.ndarray | EncodedSyntheticLoop] = {}
_loops_lock = threading.Lock()


def _loop_key(camera: CameraConfig) -> bytes:
    return msgspec.json.encode(camera)


def make_loops_ahead(cameras: list[CameraConfig]) -> list[str]:
    """Note [Loops made while held]: the replayed cameras' loops, made side by side; the ids of
    the cameras whose loop was made. One that cannot be made now is made at open, where its
    error is the camera's."""
    made: list[str] = []
    turns = threading.BoundedSemaphore(LOOPS_AT_ONCE)

    def make(camera: CameraConfig) -> None:
        try:
            with turns:
                replay = SyntheticReplay.for_camera(camera)
                if source_kind(camera.source) == "synthetic-replay":
                    loop = replay.render_loop()
                else:
                    loop = EncodedSyntheticLoop(
                        replay, ENCODED_SYNTHETIC_CODECS[source_kind(camera.source)],
                        name=camera.id)
        except Exception as exc:  # noqa: BLE001 - the open says it again, as the camera's error
            log.info("camera %s: its loop is made when its source opens (%s: %s)", camera.id,
                     type(exc).__name__, exc)
            return
        with _loops_lock:
            _loops_made_ahead[_loop_key(camera)] = loop
            made.append(camera.id)

    # Daemon threads: a stop while they run ends the process without waiting for them.
    threads = [threading.Thread(target=make, args=(camera,), daemon=True,
                                name=f"loop-{camera.id}")
               for camera in cameras if source_kind(camera.source) in _REPLAYED_KINDS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return made


def take_loop_made_ahead(camera: CameraConfig):
    """The camera's loop made while held (a rendered loop or an EncodedSyntheticLoop, now the
    caller's), or None."""
    with _loops_lock:
        return _loops_made_ahead.pop(_loop_key(camera), None)


def drop_loops_made_ahead() -> int:
    """Free the loops that no source took (a camera changed by a reload while held); how many."""
    with _loops_lock:
        left = list(_loops_made_ahead.values())
        _loops_made_ahead.clear()
    for loop in left:
        if isinstance(loop, EncodedSyntheticLoop):
            loop.close()
    return len(left)


class EncodedSyntheticSource(FileSource):
    """"synthetic-h264" / "synthetic-mjpeg": the replayed loop encoded once at open and decoded
    by the file source's decoder at the camera's fps (Note [Encoded synthetic loop])."""

    def __init__(self, camera: CameraConfig) -> None:
        self.kind = source_kind(camera.source)
        self.replay = SyntheticReplay.for_camera(camera)
        self.encoded = encoded_loop(camera, self.replay)
        try:
            super().__init__(camera, path=self.encoded.path)
        except BaseException:
            self.encoded.close()
            raise
        log.info("camera %s: %s encoded its %d-frame round trip once (%.2f MB in memory, "
                 "%.2f s) and decodes it at %g fps", camera.id, self.kind,
                 self.encoded.frame_count, self.encoded.nbytes / 1e6, self.encoded.encode_s,
                 camera.fps)
        # The camera's rate, not the file's (rounded) one: the truth is on the camera's ticks.
        self._pacer = _Pacer(camera.fps)
        self.replay.schedule_half_into_ticks(self._pacer)
        self._next_position = 0  # the file frame the decoder gives next
        self.frames_decoded = 0

    def _read(self, out: np.ndarray | None) -> tuple[np.ndarray, float]:
        if self._capture is None:
            raise self._lost("source is closed")
        self._pacer.wait()
        capture_ts_lsl, position = capture_in_a_new_tick(
            self.replay, (self._next_position - 1) % self.encoded.frame_count
            if self.frames_decoded else None)
        # A late reader's frames are decoded, not shown; the file's end is its frame 0.
        while self._next_position % self.encoded.frame_count != position:
            self._grab_next()
        self._grab_next()
        return self._retrieve(capture_ts_lsl, out)

    def _grab_next(self) -> None:
        assert self._capture is not None
        if self._next_position == self.encoded.frame_count:
            self._capture.release()
            self._capture = self._open()
            self._next_position = 0
            self.loops += 1
        if not self._capture.grab():
            raise self._lost(f"{self.kind}: the encoded loop ended after {self._next_position} "
                             f"of its {self.encoded.frame_count} frames")
        self._next_position += 1
        self.frames_decoded += 1

    def ground_truth(self, capture_ts_lsl: float) -> list[FaceTruth]:
        """The faces in the frame that was captured at `capture_ts_lsl`."""
        return self.replay.faces_at(capture_ts_lsl)

    def close(self) -> None:
        super().close()
        self.encoded.close()
