"""Video files of one camera: an encoder interface, its CPU implementation (PyAV's bundled FFmpeg),
and the sidecar CSV that ties every frame of a file to the camera's frame_seq and capture time.

Runs in the recorder worker (facecast.workers.recorder.worker), in a camera's encoder thread; the
benchmark (bench/recording.py) uses it directly.

Note [Container timestamps]
    A frame's presentation timestamp in the file is its capture time: pts = capture_ts_lsl -
    origin_ts_lsl, in the stream's time base (1 ms in Matroska, whose muxer allows nothing
    finer; 1/90000 s in MP4), where origin_ts_lsl is the capture time of the segment's first
    frame, written into the file's metadata as `capture_ts_lsl_origin` (and every frame's exact
    capture time is in the sidecar). The file is therefore variable-frame-rate where the camera
    was: a dropped frame is a longer gap, never a duplicated picture, and frame k of the file
    (in presentation order, counted from 0) is row k of the sidecar. libx264 runs with
    `tune=zerolatency` (no B-frames, no lookahead): decode order is presentation order, nothing
    is buffered in the encoder (a crash loses at most the frames in flight, and memory stays
    flat at 1080p), at the price of a somewhat larger file. Two frames whose capture times
    round to the same tick get consecutive ticks (pts must increase); at <= 1000 fps in Matroska
    that never happens.

Note [Files that survive a crash]
    A recorder that is killed, or a disk that fills up, must leave a Matroska file that holds
    every frame its sidecar lists. FFmpeg holds packets in its 32 KB write buffer
    (`flush_packets=1` writes each one as it is muxed) and the Matroska muxer holds a whole
    cluster, up to 5 s (`cluster_time_limit=0`: a cluster per frame, a few bytes each); it also
    keeps the last packet back until the next one. Measured: 30 frames muxed, then SIGKILL:
    15 decodable with the write buffer flushed alone, 29 with both. So after a crash the file
    has every frame of its sidecar but at most the last, and a full disk fails the very frame
    that could not be written (one write per frame, nothing next to the encoding). An MP4 is
    readable only once closed (its index is written last): `record.container` says so.

Note [Encoders]
    `VideoEncoder` is the interface a recorder needs: open a file for a frame size, `write` BGR
    frames with their capture times, `close`. `PyAvEncoder` is the CPU implementation
    (libx264 or FFV1 from the FFmpeg that the `av` wheel bundles). An NVENC encoder for frames
    that are already on a GPU (cuda_ipc rings) is a second implementation of the same interface
    (not built yet: README "Recording" says so).
"""

from __future__ import annotations

import csv
import logging
from abc import ABC, abstractmethod
from fractions import Fraction
from pathlib import Path

import numpy as np

from facecast.shared import private_files

log = logging.getLogger(__name__)

SIDECAR_COLUMNS = ("frame", "recording_frame", "frame_seq", "capture_ts_lsl", "status", "overlay")
OVERLAY_VALUES = ("off", "drawn", "no results", "")  # Note [Overlays]
CONTAINER_FORMATS = {"mkv": "matroska", "mp4": "mp4"}
CONTAINER_TIME_BASES = {"mkv": Fraction(1, 1000), "mp4": Fraction(1, 90000)}
ORIGIN_TAG = "capture_ts_lsl_origin"


class RecordingWriteError(OSError):
    """A segment could not be written (disk full, I/O error, a file that cannot be created):
    that camera's recording stops; the message says which file and why."""


class VideoEncoder(ABC):
    """One segment file of one camera (Note [Encoders])."""

    def __init__(self, path: Path, width: int, height: int, fps: float) -> None:
        self.path = path
        self.width = width
        self.height = height
        self.fps = fps
        self.frames_written = 0

    @abstractmethod
    def write(self, frame_bgr: np.ndarray, capture_ts_lsl: float) -> None:
        """Encode one (height, width, 3) uint8 BGR frame; RecordingWriteError when it cannot."""

    @abstractmethod
    def close(self) -> None:
        """Flush and finish the file; RecordingWriteError when the last writes fail."""

    @abstractmethod
    def abandon(self) -> None:
        """Release the file after an error, without raising (what was written stays)."""


class PyAvEncoder(VideoEncoder):
    """libx264 or FFV1 through PyAV, into Matroska or MP4 (Note [Container timestamps])."""

    def __init__(self, path: Path, width: int, height: int, fps: float, *, container: str = "mkv",
                 codec: str = "libx264", preset: str = "veryfast", crf: int = 23,
                 threads: int = 1) -> None:
        super().__init__(path, width, height, fps)
        import av  # only in the recorder (and the bench): nothing else needs FFmpeg's libraries

        self._av = av
        self.time_base = CONTAINER_TIME_BASES[container]
        self._origin_ts_lsl: float | None = None
        self._last_pts = -1
        try:
            # Made 0600 here, before FFmpeg opens it (which keeps an existing file's mode): Note
            # [Private files] in facecast.shared.private_files.
            private_files.open_private(path).close()
            options = {"flush_packets": "1"}  # Note [Files that survive a crash]
            if container == "mkv":
                options["cluster_time_limit"] = "0"
            else:  # MP4 keeps a tag of ours (capture_ts_lsl_origin) only with this
                options["movflags"] = "use_metadata_tags"
            self._container = av.open(str(path), mode="w", format=CONTAINER_FORMATS[container],
                                      options=options)
        except (OSError, av.FFmpegError) as exc:
            raise RecordingWriteError(f"cannot create {path}: {exc}") from None
        stream = self._container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = width, height
        if codec == "libx264":
            stream.pix_fmt = "yuv420p"  # what every player decodes
            stream.codec_context.options = {"preset": preset, "crf": str(crf),
                                            "tune": "zerolatency"}
        else:  # ffv1: lossless; BGR frames stored as planar RGB without a colour conversion
            stream.pix_fmt = "bgr0"
        # One thread per camera: the recorder runs an encoder thread per camera, and cameras,
        # not one camera's slices, are what spread over the cores (docs/benchmarks.md).
        stream.codec_context.thread_count = threads
        stream.time_base = self.time_base
        # The encoder's own time base too: left at 1/fps it rounds every pts to a frame period
        # (Note [Container timestamps]: the capture times, not a constant frame rate).
        stream.codec_context.time_base = self.time_base
        self._stream = stream

    def write(self, frame_bgr: np.ndarray, capture_ts_lsl: float) -> None:
        if self._origin_ts_lsl is None:
            self._origin_ts_lsl = capture_ts_lsl
            self._container.metadata[ORIGIN_TAG] = repr(capture_ts_lsl)
        pts = round((capture_ts_lsl - self._origin_ts_lsl) / self.time_base)
        pts = max(pts, self._last_pts + 1)  # Note [Container timestamps]: pts must increase
        self._last_pts = pts
        frame = self._av.VideoFrame.from_ndarray(frame_bgr, format="bgr24")
        frame.pts = pts
        frame.time_base = self.time_base
        try:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        except (OSError, self._av.FFmpegError) as exc:
            raise RecordingWriteError(f"writing {self.path}: {exc}") from None
        self.frames_written += 1

    def close(self) -> None:
        try:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        except (OSError, self._av.FFmpegError) as exc:
            self.abandon()
            raise RecordingWriteError(f"finishing {self.path}: {exc}") from None

    def abandon(self) -> None:
        try:
            self._container.close()
        except Exception as exc:  # noqa: BLE001 - already failing; the first error is reported
            log.debug("closing %s after an error: %s", self.path, exc)


class Sidecar:
    """`<segment>.csv`: one row per frame of the segment's file, in file order, plus a row per
    frame captured during the recording that is not in any file (status says why):
    frame (index in this file, -1 for a drop), recording_frame (index over every segment),
    frame_seq (the camera's, as on the frame-index stream; -1 when unknown), capture_ts_lsl
    (repr: every digit of the double; empty when unknown), status ("written" or "dropped: ..."),
    overlay ("off" without record.overlays; with them "drawn": the frame's own results are drawn
    in, its faces or none, or "no results": none came in time, the frame is as captured; empty
    for a drop: Note [Overlays]).
    Flushed row by row: a crash or a full disk loses no row of a frame that is in the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            # 0600 whatever the umask: Note [Private files].
            self._file = private_files.open_private(path, binary=False)
            self._writer = csv.writer(self._file)
            self._writer.writerow(SIDECAR_COLUMNS)
            self._file.flush()
        except OSError as exc:
            raise RecordingWriteError(f"cannot write {path}: {exc.strerror}") from None

    def row(self, frame: int, recording_frame: int, frame_seq: int,
            capture_ts_lsl: float | None, status: str, overlay: str = "") -> None:
        if overlay not in OVERLAY_VALUES:
            raise ValueError(f"sidecar overlay {overlay!r}: allowed {OVERLAY_VALUES}")
        try:
            self._writer.writerow((frame, recording_frame, frame_seq,
                                   "" if capture_ts_lsl is None else repr(capture_ts_lsl), status,
                                   overlay))
            self._file.flush()
        except OSError as exc:
            raise RecordingWriteError(f"writing {self.path}: {exc.strerror}") from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as exc:
            raise RecordingWriteError(f"closing {self.path}: {exc.strerror}") from None
