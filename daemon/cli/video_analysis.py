"""Recorded video through the live face stack (issue 23): every frame of each file decoded in
order, measured by the roi_landmark worker's FacePipeline with the detection worker's schedule,
named with the live track ids, and written as a table with the Face streams' channels.

Runs in the `facecast analyze` process (the CLI side: facecast.daemon.cli.analyze parses the command
and shows progress), never under the supervisor; it builds its models with
facecast.workers.inference.pipelines.build_pipeline, so the models, the config's face_landmarker.task and
max_faces are the daemon's. Each file is a "camera" of the pipeline; one frame of every file
still going is measured per step, in one batch (files batch as the live cameras do).

Note [Analysis as live]
    Live, the detection worker runs a detection pass on a camera whenever the roi_landmark
    worker asks for one (no face, a face lost) and every `daemon.detect_interval_s` for
    newcomers; the roi_landmark worker follows faces by their landmarks
    (`FacePipeline.track(..., detections=...)`, its own detection interval switched off) and
    names them with `TrackIds` (hold `TRACK_HOLD_S`). Here the same, on the video's clock
    (presentation time instead of capture time): a frame is due for a pass when the pipeline
    wants one for its file, or `detect_interval_s` of video time has passed since the last pass
    and the file's tracks leave room for a newcomer (Note [No search where no face could go],
    models/face_tracking.py: the detection worker skips those passes too).
    What live has and this does not: the pass lands one frame late live (the request travels
    while the next frame is measured), and live skips frames when it falls behind; offline, the
    pass is on the frame that wanted it and no frame is skipped. tests/test_analyze.py checks
    that a roi_landmark-style loop over the same frames gives the same numbers.

Note [Resume points]
    An interrupted analysis is resumed from the last resume point, and the result is the
    table an uninterrupted run writes, byte for byte. Every `resume_every_frames` frames of a
    file (default RESUME_EVERY_FRAMES) the face tracker of that file is reset, in every run,
    interrupted or not: the frame at a resume point is measured from a fresh detection pass,
    as the first frame of a file is, so what follows depends on nothing before it but the
    track ids. Just before it, the table is flushed and `<name>.faces.progress.json` written
    (atomically): the frame, the table's length in bytes, the counts so far, and what the file
    and the settings were. A re-run truncates the table to that length, gives `TrackIds` its
    state back by replaying the table's boxes and times through a fresh one (geometry only:
    milliseconds; the boxes are float32 in the table and in the run), decodes and discards the
    frames before the point and goes on. The cost of a resume point is one detection pass and
    one frame measured from a detector box instead of the last frame's landmarks, every
    RESUME_EVERY_FRAMES frames (10 s at 30 fps). Re-running the tracker from the file's start
    instead would cost the whole file again; keeping the tracker's device tensors in the
    progress file would tie it to a model version and device. Resume points also cut a file
    into pieces that do not depend on each other (but for track ids): the GPU session can
    measure them side by side, as cameras.

Note [Frames that are not in the table]
    Every frame has a row, at its own index. A frame FFmpeg decoded with errors concealed
    (flagged corrupt) is measured, and its `problem` says so; a packet the decoder cannot read
    is a row with the reason. FFmpeg's demuxer skips damaged data silently (seen: 2 KB
    overwritten in a Matroska file lost the frame after a concealed one, with no error), so
    frames are placed by their presentation time, not counted: in facecast's recordings every
    frame's time is known from the sidecar (capture time minus the first frame's, Note
    [Container timestamps]), and a frame the file lacks is a
    `missing` row; in other files, a gap in the times right after a damaged frame is taken as
    the frames skipped (at the stream's nominal rate). Frames a file should have but does not
    at its end (truncated: fewer than the sidecar lists, or than the container's frame count)
    are rows, each with the reason; where only the header's duration says so, one row says
    about how many are missing. (The recorder's files have no B-frames: decode order is
    presentation order, so an unreadable packet's row is the next frame's.)

Note [Body pose offline]
    With `--pose` (Settings.pose) the roi_landmark worker's PosePipeline measures every frame
    too, tracked per file as live (`track(..., timestamps_s=...)`: the capture times where
    the recorder's sidecar gives them, as live, else the presentation times), and the frame's most present body is a row of `<name>.pose.csv`: the MoCap
    stream's channels (33 markers' world landmarks in meters and visibility, the names and
    order of `pose_channels()`), as the output worker picks it (`_push_pose`), one row per
    frame, empty where no body was found, with the reason where the frame could not be read.
    A table of its own because live it is a stream of its own: one sample per frame, not per
    face. Its tracker is reset at the resume points with the face tracker's, its length kept
    in the progress file with the face table's (Note [Resume points]).

Note [Participants offline]
    With `--participants` (Settings.participants) every face row is named as live: the roi_landmark
    worker's EmbeddingIdentities (the gallery of `facecast enroll`, the config's
    match_distance and embed_interval_s: a track embedded when it appears, then on that
    schedule, a rename confirmed, one face per name), one per file, on the frames' capture
    times where the sidecar gives them, else their presentation times. Columns `participant`
    ("" unknown) and `identity_confidence` (0..1) end the row. Names are by embeddings only:
    a seat map names cameras and regions of a live setup, which a file is not. At each resume
    point the file's identities start afresh with its tracker (every face is embedded again
    on the next frame, as a track's first look is), so that a resumed run writes the same table
    (Note [Resume points]).

Note [Decoding ahead]
    Each file is decoded on a thread of its own, a few frames ahead of the models
    (`FramesAhead`): FFmpeg's decoding and PyAV's conversion to BGR release the GIL, so they run
    on another core while torch measures the frames before (seen on the 2-core machine: two
    files decoded on two threads in the time of one). Without it every frame's decoding (4-7 ms
    of a 1080p H.264 frame there) waited in line before the models; with several files (and
    on a GPU, whose stack outruns one core's decoder) the files' decoders run side by side. It
    changes no number: the frames, their order and the batches are the same. Frames held
    ahead are bounded (AHEAD_FRAMES_TOTAL over all files, at least 2 a file), and a file's
    thread stops, and is waited for, before its container is closed.

Note [Decoding at a lower priority]
    A decoding thread runs at DECODING_NICENESS (Linux's per-thread nice value), the measuring
    thread at the process's own. On the CPU stack the landmark model's invoke splits its work
    between the measuring thread and an XNNPACK worker (Note [Threads of the models]); the
    invoke ends when its slowest share does, so a decoding thread sharing the worker's core
    made every invoke wait for FFmpeg's turn. Decoding only has to keep the queue of
    Note [Decoding ahead] from running dry, which the time the measuring thread spends alone
    on its host work (crops, geometry, the table: about half of a frame, one core idle) gives
    it. At a lower priority the scheduler runs it there, not across the worker's share.
    Measured on the 2-core machine (2026-11-27, 120-frame H.264 files decoded ahead, one
    process taking turns between niceness 0, 5 and 10, five or six runs each, median):
    1080p one face 144.6 -> 151.8 (5) and 151.9 (10) frames/s, 720p one face 173.6 -> 176.7
    and 178.8, in a first run 201.2 -> 210.9 (10), 720p four faces 76.7 -> 79.3 (10); the
    process's CPU time a frame the same. 5 rather than 19: beside other busy processes a
    decoding thread at 19 gets ~1.5 % of a core against one of them (its weight 15 against
    1024) and the measuring thread would wait for frames; at 5 it keeps about a quarter.
    Only with the stack on the CPU: on a GPU the measuring thread mostly waits for the device
    and no XNNPACK worker shares a core, so NVDEC's and PyAV's threads keep the process's
    priority there, as before. It changes no number (the frames and their order are the same);
    where the system refuses (no such call), decoding keeps the process's priority.
"""

from __future__ import annotations

import bisect
import csv
import json
import logging
import math
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import msgspec
import numpy as np
import torch

from facecast.models.roi import FrameBatch
from facecast.shared import config as config_mod
from facecast.shared import cpu_priority
from facecast.shared import private_files
from facecast.shared.transport.messages import TRACK_ID_LIMIT
from facecast.shared.version import __version__
from facecast.workers.output.outlets import FaceLayout, FaceSample, face_channels, pose_channels
from facecast.workers.inference.roi_landmark import TRACK_HOLD_S
from facecast.workers.inference.tracking import TrackIds, TrackIdSource

log = logging.getLogger(__name__)

TABLE_VERSION = 1
RESUME_EVERY_FRAMES = 300  # Note [Resume points]
# A decoded frame's time matches a sidecar frame's within this (Matroska's 1 ms tick rounds by
# up to half of it; the recorder's "pts must increase" bump adds a tick at most at 1000 fps).
PTS_MATCH_S = 0.0011
LEADING_COLUMNS = ("frame", "pts_s", "capture_ts_lsl", "problem")
PARTICIPANT_COLUMNS = ("participant", "identity_confidence")  # Note [Participants offline]
TABLE_SUFFIX = ".faces.csv"
SUMMARY_SUFFIX = ".faces.json"
PARQUET_SUFFIX = ".faces.parquet"  # with Settings.parquet (facecast.daemon.cli.analysis_parquet)
POSE_SUFFIX = ".pose.csv"  # with Settings.pose: Note [Body pose offline]
POSE_PARQUET_SUFFIX = ".pose.parquet"
PROGRESS_SUFFIX = ".faces.progress.json"
# Note [Decoding ahead]: decoded frames held ahead of the models, over all files (a 1080p BGR
# frame is 6.2 MB), and per file at least/most.
AHEAD_FRAMES_TOTAL = 48
AHEAD_FRAMES_PER_FILE = (2, 8)
DECODER_STOP_TIMEOUT_S = 10.0
DECODING_NICENESS = 5  # Note [Decoding at a lower priority]: added to the process's own


class SetupError(Exception):
    """What was asked cannot be done with this setup (a gallery missing or empty): the message
    says what and how to fix it."""


class VideoError(Exception):
    """A file that cannot be analysed at all (missing, not a video, unreadable header): the
    message says which file and why."""


# -- decoding --------------------------------------------------------------------------------


@dataclass
class DecodedFrame:
    index: int  # the decoder's count from 0 (Note [Frames that are not in the table])
    pts: int | None  # presentation timestamp in the stream's time base (None: unknown)
    pts_s: float | None  # the same in seconds
    # HxWx3 uint8 BGR (a numpy array, or a tensor on the GPU from NVDEC); None when the frame
    # could not be read
    image: np.ndarray | torch.Tensor | None
    problem: str = ""  # why it could not be read, or what was wrong with it ("" when fine)


class FrameDecoder(ABC):
    """A video file's frames in presentation order. `PyAvDecoder` is the CPU implementation;
    facecast.daemon.cli.analysis_decoding's NVDEC decoder hands frames that are already on the
    GPU (uint8 HxWx3 tensors, which FacePipeline takes as they are), PyAV's for the rest of a
    file where NVDEC cannot go on (Note [Analysis on NVDEC])."""

    fps: float  # the stream's nominal rate (0.0 when the file does not say)
    expected_frames: int  # what the container's header says it holds (0: it does not say)
    duration_s: float  # the header's duration (0.0: it does not say)
    time_base: Fraction  # of DecodedFrame.pts

    @abstractmethod
    def frames(self, decode_from: int = 0) -> Iterator[DecodedFrame]:
        """Every frame; those the decoder counts before `decode_from` without their pixels
        (image None): they are decoded (the codec needs them) but not converted."""

    @abstractmethod
    def close(self) -> None: ...


class PyAvDecoder(FrameDecoder):
    """FFmpeg's software decoders through PyAV, frame by frame (Note [Frames that are not in
    the table])."""

    def __init__(self, path: Path) -> None:
        import av  # FFmpeg's libraries only where files are decoded

        self._av = av
        self.path = path
        if not path.exists():
            raise VideoError(f"{path}: no such file")
        if not path.is_file():
            raise VideoError(f"{path}: not a regular file (allowed: a video file)")
        try:
            # A file's metadata that is not UTF-8 must not refuse the file: PyAV before 19
            # raises on it unless told to ignore it; 19 decodes it with surrogateescape and has
            # no such argument.
            ignore_bad_metadata = ({"metadata_errors": "ignore"}
                                   if int(av.__version__.split(".")[0]) < 19 else {})
            self._container = av.open(str(path), **ignore_bad_metadata)
        except (av.FFmpegError, UnicodeDecodeError) as exc:
            raise VideoError(
                f"{path}: not a video FFmpeg can read ({_ffmpeg_reason(exc)})") from None
        if not self._container.streams.video:
            self._container.close()
            raise VideoError(f"{path}: has no video stream")
        self._stream = self._container.streams.video[0]
        self.time_base = Fraction(self._stream.time_base or Fraction(1, 1000))
        rate = self._stream.average_rate or self._stream.guessed_rate
        self.fps = float(rate) if rate else 0.0
        self.expected_frames = int(self._stream.frames or 0)
        # An unset time base is None before PyAV 19 and a falsy AVRational(0, 1) since.
        if self._stream.duration is not None and self._stream.time_base:
            self.duration_s = float(self._stream.duration * self._stream.time_base)
        elif self._container.duration is not None:
            self.duration_s = self._container.duration / 1e6  # AV_TIME_BASE
        else:
            self.duration_s = 0.0

    def frames(self, decode_from: int = 0) -> Iterator[DecodedFrame]:
        av = self._av
        index = 0
        packets = self._container.demux(self._stream)
        while True:
            try:
                packet = next(packets)
            except StopIteration:
                break
            except av.FFmpegError as exc:  # the demuxer gave up: the rest of the file is lost
                yield DecodedFrame(index, None, None, None, "unreadable: the container breaks "
                                   f"off here ({_ffmpeg_reason(exc)})")
                return
            try:
                decoded = packet.decode()
            except av.FFmpegError as exc:
                yield DecodedFrame(index, packet.pts, self._seconds(packet.pts), None,
                                   f"unreadable: {_ffmpeg_reason(exc)}")
                index += 1
                continue
            for frame in decoded:
                # Said of a skipped frame too: the analyzer places frames after damage by it.
                problem = ("decoded with errors concealed (FFmpeg flagged it corrupt)"
                           if frame.is_corrupt else "")
                image = frame.to_ndarray(format="bgr24") if index >= decode_from else None
                yield DecodedFrame(index, frame.pts, self._seconds(frame.pts), image, problem)
                index += 1

    def _seconds(self, pts: int | None) -> float | None:
        return None if pts is None else float(pts * self.time_base)

    def close(self) -> None:
        self._container.close()


def _ffmpeg_reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)


class _Ended:
    """What a decoding thread puts last: the end of the file, or the exception it raised."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class FramesAhead:
    """A file's frames, decoded on a thread of its own up to `depth` frames ahead of the reader
    (Note [Decoding ahead]). Iterate it from one thread; `close()` stops the thread and waits
    for it (bounded) before the decoder may be closed."""

    def __init__(self, frames: Iterator[DecodedFrame], depth: int, name: str, niceness: int = 0) -> None:
        if depth < 1:
            raise ValueError(f"decoding ahead needs a depth of at least 1 frame, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        self._niceness = niceness  # Note [Decoding at a lower priority]
        self._thread = threading.Thread(target=self._decode, args=(frames,), daemon=True,
                                        name=f"facecast-decode:{name}")
        self._thread.start()

    def _decode(self, frames: Iterator[DecodedFrame]) -> None:
        if self._niceness:
            cpu_priority.lower_this_thread(self._niceness)
        end = _Ended()
        try:
            for frame in frames:
                if not self._put(frame):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            end = _Ended(exc)
        finally:
            # Ended on this thread, whatever the reader did: a GPU decoder is let go on the
            # thread that used it (Note [Analysis on NVDEC]).
            close = getattr(frames, "close", None)
            if close is not None:
                close()
        self._put(end)

    def _put(self, item) -> bool:
        """Queue it, unless told to stop meanwhile (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> FramesAhead:
        return self

    def __next__(self) -> DecodedFrame:
        if self._ended:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._ended = True
                    raise RuntimeError(f"{self._thread.name} ended without a last frame") from None
        if isinstance(item, _Ended):
            self._ended = True
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> bool:
        """Stop decoding and wait for the thread (DECODER_STOP_TIMEOUT_S); False if it is still
        running (its decoder must then stay open)."""
        self._stop.set()
        while True:  # a thread blocked on a full queue sees the stop within 0.1 s anyway
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(DECODER_STOP_TIMEOUT_S)
        return not self._thread.is_alive()


# -- one file --------------------------------------------------------------------------------


def output_paths(video: Path, out_dir: Path | None) -> tuple[Path, Path, Path]:
    """(table, summary, progress) of a video: `<stem>.faces.csv`, `.faces.json` and
    `.faces.progress.json`, in `out_dir` or next to the video. (Not `<stem>.csv`: that is the
    recorder's sidecar.)"""
    directory = out_dir if out_dir is not None else video.parent
    return (directory / (video.stem + TABLE_SUFFIX), directory / (video.stem + SUMMARY_SUFFIX),
            directory / (video.stem + PROGRESS_SUFFIX))


def read_sidecar(video: Path) -> tuple[dict[int, str], str]:
    """The capture time (the sidecar's text: every digit of the double) of each frame of a
    facecast recording, by its index in the file, and where they came from (or why there are
    none). The sidecar is `<segment>.csv` next to the video, with the recorder's columns."""
    sidecar = video.with_suffix(".csv")
    if not sidecar.is_file():
        return {}, "none: no recorder sidecar next to the video"
    try:
        with open(sidecar, newline="") as handle:
            rows = csv.reader(handle)
            header = next(rows, None)
            # A tolerant reader: the columns it needs, by name, whatever else a later recorder adds.
            if header is None or not {"frame", "recording_frame", "capture_ts_lsl"} <= set(header):
                return {}, f"none: {sidecar.name} is not a facecast recorder sidecar"
            at_frame, at_ts = header.index("frame"), header.index("capture_ts_lsl")
            stamps = {int(row[at_frame]): row[at_ts] for row in rows
                      if len(row) > at_ts and row[at_frame] not in ("", "-1") and row[at_ts]}
    except (OSError, ValueError) as exc:
        return {}, f"none: {sidecar.name} unreadable ({exc})"
    return stamps, f"sidecar {sidecar.name}"


@dataclass
class Counts:
    frames: int = 0  # rows of decoded frames, measured
    frames_with_faces: int = 0
    faces: int = 0  # face rows
    unreadable: int = 0  # rows of frames that could not be read or are missing
    concealed: int = 0  # frames decoded with errors concealed (measured, flagged)

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class FileAnalysis:
    """One video's analysis: its decoder, its table, its track ids and its counts."""

    video: Path
    camera_id: str
    table_path: Path
    summary_path: Path
    progress_path: Path
    decoder: FrameDecoder | None = None
    parquet_path: Path | None = None  # where its Parquet table goes (None: not asked for)
    pose_table_path: Path | None = None  # Note [Body pose offline]
    identities: object = None  # an Identities (Note [Participants offline])
    parquet_problem: str = ""  # why it could not be written
    problem: str = ""  # why the file cannot be analysed at all
    capture_ts: dict[int, str] = field(default_factory=dict)
    capture_ts_source: str = ""
    counts: Counts = field(default_factory=Counts)
    track_ids: TrackIds | None = None
    resumed_from_frame: int = 0
    already_complete: bool = False
    problems: list[str] = field(default_factory=list)  # a few reasons, for the summary
    seconds: float = 0.0  # of work, over every run
    next_frame: int = 0  # the frame the next row is of
    total_frames: int = 0  # best guess, for progress (0: unknown)
    _frames: Iterator[DecodedFrame] | None = None  # a FramesAhead while run() runs
    _table = None
    _writer = None
    _pose_table = None
    _pose_writer = None
    _last_pass_pts_s: float = -math.inf
    _started_monotonic: float = 0.0
    # Placing decoded frames (Note [Frames that are not in the table]):
    _frame_times_s: list[float] = field(default_factory=list)  # the sidecar's, as pts seconds
    _decoded_next: int = 0  # the index the next decoded frame has if nothing was skipped
    _last_pts_s: float | None = None
    _damaged: bool = False  # the last frame was unreadable or concealed
    _next_resume_point: int = 0
    _seconds_before: float = 0.0
    done: bool = False


@dataclass(frozen=True)
class Settings:
    landmarks: bool = False  # the 1,434 landmark columns
    detect_interval_s: float = 0.5  # the config's daemon.detect_interval_s
    resume_every_frames: int = RESUME_EVERY_FRAMES
    # `<name>.faces.parquet` too, made from the finished CSV (pyarrow,
    # daemon/cli/analysis_parquet.py: Note [Parquet from the finished CSV]).
    parquet: bool = False
    pose: bool = False  # `<name>.pose.csv` (Note [Body pose offline]); needs a pose pipeline
    participants: bool = False  # Note [Participants offline]; needs an identities factory
    # Note [Decoding ahead]; off: each frame decoded when the models want it (the same table).
    decode_ahead: bool = True
    # Note [Analysis on NVDEC] (facecast.daemon.cli.analysis_decoding): "auto", "gpu" or "cpu".
    decode: str = "auto"


Progress = Callable[[FileAnalysis], None]


class Analyzer:
    """Videos through one FacePipeline (Note [Analysis as live], Note [Resume points])."""

    def __init__(self, pipeline, settings: Settings, *, landmarker_problem: str = "",
                 pose_pipeline=None, make_identities: Callable[[], object] | None = None) -> None:
        if settings.pose and pose_pipeline is None:
            raise ValueError("Settings(pose=True) needs a pose pipeline (build_analyzer makes one)")
        if settings.participants and make_identities is None:
            raise ValueError("Settings(participants=True) needs make_identities (build_analyzer "
                             "makes it)")
        self.make_identities = make_identities if settings.participants else None
        self.pipeline = pipeline
        self.pose_pipeline = pose_pipeline if settings.pose else None
        self.settings = settings
        self.landmarker_problem = landmarker_problem
        # Switched off as in the roi_landmark worker: passes follow the detection schedule.
        self.pipeline.detect_interval_frames = 1 << 62
        with_landmarker = pipeline.landmarker == "face_landmarker"
        self.channels = face_channels(settings.landmarks, blendshapes=with_landmarker,
                                      head_translation=with_landmarker)
        self.layout = FaceLayout(settings.landmarks, with_landmarker, with_landmarker)
        self.columns = list(LEADING_COLUMNS) + self.layout.labels + (
            list(PARTICIPANT_COLUMNS) if settings.participants else [])
        self.pose_channels = pose_channels()
        self.pose_columns = list(LEADING_COLUMNS) + [label for label, *_ in self.pose_channels]
        from facecast.daemon.cli import analysis_decoding

        # Why no file is decoded on the GPU in this run (None: each is tried on NVDEC).
        self.gpu_decode_problem = analysis_decoding.gpu_decode_problem(
            settings.decode, torch.device(pipeline.device))

    def settings_key(self) -> dict:
        """What a table depends on besides the video: a resume with other settings starts over."""
        return {"table_version": TABLE_VERSION, "landmarks": self.settings.landmarks,
                "detect_interval_s": self.settings.detect_interval_s,
                "resume_every_frames": self.settings.resume_every_frames,
                "max_faces": self.pipeline.max_faces, "landmarker": self.pipeline.landmarker,
                "columns": len(self.columns), "pose": self.settings.pose,
                "participants": self.settings.participants}

    # -- opening ---------------------------------------------------------------------------

    def open(self, videos: Sequence[Path], out_dir: Path | None, restart: bool = False
             ) -> list[FileAnalysis]:
        files = []
        seen: dict[Path, Path] = {}
        for index, video in enumerate(videos):
            table, summary, progress = output_paths(video, out_dir)
            item = FileAnalysis(video, f"file{index}", table, summary, progress,
                                parquet_path=table.with_name(video.stem + PARQUET_SUFFIX),
                                pose_table_path=(table.with_name(video.stem + POSE_SUFFIX)
                                                 if self.settings.pose else None))
            files.append(item)
            if table.resolve() in seen:
                item.problem = (f"{video}: its table would be {table}, as {seen[table.resolve()]}'s"
                                " (same name): give them different --out folders")
                continue
            seen[table.resolve()] = video
            try:
                item.decoder = self._open_decoder(video)
            except VideoError as exc:
                item.problem = str(exc)
                continue
            item.capture_ts, item.capture_ts_source = read_sidecar(video)
            self._start(item, restart)
        return files

    def _open_decoder(self, video: Path) -> FrameDecoder:
        """NVDEC where it takes the file, PyAV on the CPU for the rest (Note [Analysis on
        NVDEC]); VideoError when the file cannot be read at all."""
        from facecast.daemon.cli import analysis_decoding

        return analysis_decoding.open_decoder(video, self.settings.decode,
                                              self.gpu_decode_problem,
                                              torch.device(self.pipeline.device))

    def _video_identity(self, item: FileAnalysis) -> dict:
        stat = item.video.stat()
        return {"video": str(item.video.resolve()), "video_bytes": stat.st_size,
                "video_mtime_ns": stat.st_mtime_ns}

    def _start(self, item: FileAnalysis, restart: bool) -> None:
        decoder = item.decoder
        item.total_frames = decoder.expected_frames or len(item.capture_ts) or (
            round(decoder.duration_s * decoder.fps) if decoder.fps else 0)
        self.pipeline.reset(item.camera_id)  # an Analyzer may share its pipeline with another
        if self.pose_pipeline is not None:
            self.pose_pipeline.reset(item.camera_id)
        if self.make_identities is not None:
            item.identities = self.make_identities()
        source = TrackIdSource()
        source.add(1, TRACK_ID_LIMIT - 1)
        item.track_ids = TrackIds(source, hold_s=TRACK_HOLD_S)
        item._frame_times_s = recorded_pts_s(item.capture_ts)
        item._next_resume_point = self.settings.resume_every_frames
        saved = None if restart else self._saved_progress(item)
        # Face data of people: 0600 files, a 0700 folder if made here (Note [Private files] in
        # facecast.shared.private_files), as the recordings they come from.
        private_files.make_dirs(item.table_path.parent)
        if saved is not None and saved.get("complete"):
            item.already_complete = item.done = True
            item.counts = Counts(**saved["counts"])
            item.next_frame = item.resumed_from_frame = saved["frame"]
            item.seconds = saved["seconds"]
            item.problems = saved.get("problems", [])
            decoder.close()
            if self.settings.parquet and not _newer(item.parquet_path, item.table_path):
                self._write_parquet(item)  # finished before Parquet was asked for, or pyarrow there
                write_private_json(item.summary_path, self.summary(item))
            return
        # Parquet tables of an earlier run are the old tables': made again when this run ends.
        item.parquet_path.unlink(missing_ok=True)
        item.parquet_path.with_name(item.video.stem + POSE_PARQUET_SUFFIX).unlink(missing_ok=True)
        if saved is not None:
            os.truncate(item.table_path, saved["table_bytes"])
            self._replay_track_ids(item)
            item.counts = Counts(**saved["counts"])
            item.problems = saved.get("problems", [])
            item.next_frame = item.resumed_from_frame = saved["frame"]
            item._next_resume_point = saved["frame"]  # its reset again, as the first run did
            item._seconds_before = saved["seconds"]
            item._table = open(item.table_path, "a", newline="")
            item._writer = csv.writer(item._table)
            if item.pose_table_path is not None:
                os.truncate(item.pose_table_path, saved["pose_table_bytes"])
                item._pose_table = open(item.pose_table_path, "a", newline="")
                item._pose_writer = csv.writer(item._pose_table)
        else:
            item._table = private_files.open_private(item.table_path, binary=False)
            item._writer = csv.writer(item._table)
            item._writer.writerow(self.columns)
            if item.pose_table_path is not None:
                item._pose_table = private_files.open_private(item.pose_table_path, binary=False)
                item._pose_writer = csv.writer(item._pose_table)
                item._pose_writer.writerow(self.pose_columns)
        # The decoder counts no frame the file lacks: its count at the resume point is at least
        # this (converting a few frames too many costs a millisecond each).
        item._frames = decoder.frames(decode_from=max(0, item.next_frame - item.counts.unreadable))
        item._started_monotonic = time.monotonic()

    def _saved_progress(self, item: FileAnalysis) -> dict | None:
        """The progress file of an earlier run of the same video with the same settings, else
        None (then the file is analysed from its start)."""
        try:
            saved = json.loads(item.progress_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable (%s): analysing %s from its start", item.progress_path,
                        exc, item.video)
            return None
        if (saved.get("identity") != self._video_identity(item)
                or saved.get("settings") != self.settings_key()):
            log.warning("%s: made for another video or other settings: analysing %s from its "
                        "start", item.progress_path, item.video)
            return None
        if not saved.get("complete"):
            try:
                for path, length in ((item.table_path, saved["table_bytes"]),
                                     (item.pose_table_path, saved.get("pose_table_bytes"))):
                    if path is not None and (length is None or path.stat().st_size < length):
                        log.warning("%s is shorter than its progress file says: analysing %s "
                                    "from its start", path, item.video)
                        return None
            except OSError:
                return None
        return saved

    def _replay_track_ids(self, item: FileAnalysis) -> None:
        """TrackIds' state at the resume point, from the table's boxes and times (Note [Resume
        points])."""
        at = {name: self.columns.index(name) for name in
              ("frame", "pts_s", "problem", "track_id", "box_x1", "box_y2")}
        with open(item.table_path, newline="") as handle:
            rows = csv.reader(handle)
            next(rows)
            frame, pts_s, boxes = None, 0.0, []
            for row in rows:
                if row[at["problem"]].startswith(("unreadable", "missing")):
                    continue  # no picture: the live tracker never saw it either
                if int(row[at["frame"]]) != frame:
                    if frame is not None:
                        item.track_ids.assign(boxes, pts_s)
                    frame, boxes = int(row[at["frame"]]), []
                    pts_s = float(row[at["pts_s"]]) if row[at["pts_s"]] else math.nan
                if row[at["track_id"]]:
                    # The float32 the run gave TrackIds (the text is its shortest form).
                    boxes.append(tuple(float(np.float32(v))
                                       for v in row[at["box_x1"]:at["box_y2"] + 1]))
            if frame is not None:
                item.track_ids.assign(boxes, pts_s)

    # -- the loop --------------------------------------------------------------------------

    def run(self, files: Sequence[FileAnalysis], on_progress: Progress | None = None) -> None:
        """Until every file is done (or KeyboardInterrupt: the progress files stay at their
        last resume point)."""
        active = [f for f in files if not f.problem and not f.done]
        try:
            if self.settings.decode_ahead and active:
                low, high = AHEAD_FRAMES_PER_FILE
                depth = max(low, min(high, AHEAD_FRAMES_TOTAL // len(active)))
                # Note [Decoding at a lower priority]: with the stack on the CPU.
                niceness = DECODING_NICENESS if torch.device(self.pipeline.device).type == "cpu" else 0
                for item in active:
                    item._frames = FramesAhead(item._frames, depth, item.video.name, niceness)
            while active:
                batch: list[tuple[FileAnalysis, DecodedFrame]] = []
                for item in active:
                    frame = self._next_measurable(item)
                    if frame is not None:
                        batch.append((item, frame))
                if batch:
                    self._measure(batch)
                for item in active:
                    item.seconds = item._seconds_before + time.monotonic() - item._started_monotonic
                    if on_progress is not None:
                        on_progress(item)
                active = [f for f in active if not f.done]
        finally:
            for item in files:
                for table in ("_table", "_pose_table"):
                    if getattr(item, table) is not None:
                        getattr(item, table).close()
                        setattr(item, table, None)
                if isinstance(item._frames, FramesAhead):
                    stopped = item._frames.close()
                else:
                    stopped = True
                    close = getattr(item._frames, "close", None)
                    if close is not None:  # a generator: ended on this thread, which ran it
                        close()
                if not stopped:  # closing the container under a running decoder would crash
                    log.warning("%s: its decoding thread did not stop within %.0f s; its file "
                                "stays open until this process ends", item.video,
                                DECODER_STOP_TIMEOUT_S)
                elif item.decoder is not None:
                    item.decoder.close()

    def _next_measurable(self, item: FileAnalysis) -> DecodedFrame | None:
        """The file's next frame with a picture; rows of frames without one on the way; None
        when the file ended (then it is finished: missing frames, summary, progress)."""
        for frame in item._frames:
            frame.index = self._place(item, frame)
            if frame.index < item.next_frame:
                continue  # before the resume point
            for missing in range(item.next_frame, frame.index):
                self._before_row(item, missing)
                self._write_problem_row(item, missing, None, (
                    f"missing: not in the file (FFmpeg skipped damaged data before frame "
                    f"{frame.index})"))
            self._before_row(item, frame.index)
            item.next_frame = frame.index + 1
            if frame.image is None:
                self._write_problem_row(item, frame.index, frame.pts_s, frame.problem)
                continue
            return frame
        self._finish(item)
        return None

    @staticmethod
    def _place(item: FileAnalysis, frame: DecodedFrame) -> int:
        """The frame's index in the file (Note [Frames that are not in the table]): by its
        presentation time where the sidecar gives every frame's; else counted, with a gap in
        the times right after damage taken as frames the demuxer skipped."""
        index = item._decoded_next
        if item._frame_times_s and frame.pts_s is not None:
            found = _nearest(item._frame_times_s, frame.pts_s)
            if found is not None and found >= index:
                index = found
        elif (item._damaged and frame.pts_s is not None and item._last_pts_s is not None
              and item.decoder.fps):
            index += max(0, round((frame.pts_s - item._last_pts_s) * item.decoder.fps) - 1)
        item._damaged = bool(frame.problem)
        if frame.pts_s is not None:
            item._last_pts_s = frame.pts_s
        item._decoded_next = index + 1
        return index

    def _before_row(self, item: FileAnalysis, frame_index: int) -> None:
        """Note [Resume points]: at each, in every run, the progress is saved and the tracker
        starts afresh."""
        if frame_index == 0 or frame_index < item._next_resume_point:
            return
        every = self.settings.resume_every_frames
        item._next_resume_point = (frame_index // every + 1) * every
        self.pipeline.reset(item.camera_id)
        if self.pose_pipeline is not None:
            self.pose_pipeline.reset(item.camera_id)
        if self.make_identities is not None:  # Note [Participants offline]
            item.identities = self.make_identities()
        item._last_pass_pts_s = -math.inf
        self._save_progress(item, frame_index, complete=False)

    def _measure(self, batch: list[tuple[FileAnalysis, DecodedFrame]]) -> None:
        camera_ids = [item.camera_id for item, _ in batch]
        images = [frame.image for _, frame in batch]
        if all(isinstance(image, np.ndarray) for image in images):
            # PyAV's frames are arrays of their own that nothing writes again: measured (and
            # detected) where they lie, not stacked into a copy.
            frames = self.pipeline.batch_in_place([torch.from_numpy(image) for image in images])
        else:
            # Frames of NVDEC (tensors on the GPU, perhaps in the decoder's reused buffers) with
            # a file's frames of PyAV: one kind of frame, stacked into a batch of its own
            # (FrameBatch moves the host ones to the device).
            images = [torch.from_numpy(image) if isinstance(image, np.ndarray) else image
                      for image in images]
            frames = FrameBatch(images, self.pipeline.device, bgr=self.pipeline.frames_are_bgr)
        due = []  # the detection worker's `_due` on the video's clock (Note [Analysis as live])
        for index, (item, frame) in enumerate(batch):
            pts_s = frame.pts_s if frame.pts_s is not None else item._last_pass_pts_s
            if (self.pipeline.wants_detection(item.camera_id)
                    or (pts_s - item._last_pass_pts_s >= self.settings.detect_interval_s
                        and self.pipeline.has_room(item.camera_id))):
                due.append(index)
                item._last_pass_pts_s = pts_s
        detections = {}
        if due:
            detections = dict(zip(due, self.pipeline.detect(frames, due)))
        faces_per_frame = self.pipeline.track(frames, camera_ids, detections=detections)
        for (item, frame), faces in zip(batch, faces_per_frame):
            self._write_faces(item, frame, faces)
        if self.pose_pipeline is not None:  # Note [Body pose offline]
            poses_per_frame = self.pose_pipeline.track(
                images, camera_ids, timestamps_s=[_frame_time_s(item, frame) for item, frame in batch])
            for (item, frame), poses in zip(batch, poses_per_frame):
                self._write_pose(item, frame, poses)

    def _write_pose(self, item: FileAnalysis, frame: DecodedFrame, poses) -> None:
        """The frame's most present body, as the output worker publishes it (`_push_pose`)."""
        pts_s = frame.pts_s if frame.pts_s is not None else math.nan
        lead = [frame.index, _number(pts_s), item.capture_ts.get(frame.index, ""), frame.problem]
        if not poses:
            item._pose_writer.writerow(lead + [""] * len(self.pose_channels))
            return
        best = max(poses, key=lambda pose: pose.presence)
        sample = np.empty((len(best.world_landmarks_m), 4), np.float32)
        sample[:, :3] = best.world_landmarks_m
        sample[:, 3] = best.landmarks[:, 3]
        item._pose_writer.writerow(lead + _float32_cells(sample.ravel()))

    def _write_faces(self, item: FileAnalysis, frame: DecodedFrame, faces) -> None:
        pts_s = frame.pts_s if frame.pts_s is not None else math.nan
        # float32, as in the table: a resume replays the table's boxes (Note [Resume points]).
        boxes = [tuple(float(v) for v in np.asarray(face.box, np.float32)) for face in faces]
        ids = item.track_ids.assign(boxes, pts_s)
        lead = [frame.index, _number(pts_s), item.capture_ts.get(frame.index, ""), frame.problem]
        item.counts.frames += 1
        item.counts.concealed += bool(frame.problem)
        if frame.problem:
            self._note_problem(item, f"frame {frame.index}: {frame.problem}")
        if not faces:
            item._writer.writerow(lead + [""] * (len(self.columns) - len(lead)))
            return
        item.counts.frames_with_faces += 1
        names = self._participants(item, frame, ids, faces)
        # A frame's rows by track id, not by the faces' rank: two faces of nearly the same
        # presence swap ranks on a grey level (NVDEC's frames against PyAV's did, 2026-11-26),
        # and a table read row by row should not change with it.
        rows = sorted(zip(ids, faces, names), key=lambda row: (row[0] is None, row[0] or 0))
        for track_id, face, name in rows:
            item.counts.faces += 1
            sample = self.layout.sample(FaceSample(
                track_id=track_id, presence=face.presence, box_px=face.box,
                head_pose_deg=face.head_pose, head_translation_cm=face.head_translation_cm,
                blendshapes=face.blendshapes,
                landmarks_px=face.landmarks if self.settings.landmarks else None))
            item._writer.writerow(lead + [str(track_id)] + _float32_cells(sample[1:])
                                  + name)

    def _participants(self, item: FileAnalysis, frame: DecodedFrame, ids, faces) -> list[list]:
        """Each face's participant and identity_confidence cells, or none (Note [Participants
        offline])."""
        if item.identities is None:
            return [[] for _ in faces]
        from facecast.workers.inference.identity import FrameFaces

        named = [(track_id, face) for track_id, face in zip(ids, faces) if track_id is not None]
        who = item.identities.identify([FrameFaces(
            camera_id=item.camera_id, capture_ts_lsl=_frame_time_s(item, frame),
            tensor=(torch.from_numpy(frame.image) if isinstance(frame.image, np.ndarray)
                    else frame.image), track_ids=[track_id for track_id, _ in named],
            boxes_px=[face.box for _, face in named],
            landmarks_px=[face.landmarks for _, face in named])])[0]
        by_track = {track_id: identity for (track_id, _), identity in zip(named, who)}
        cells = []
        for track_id in ids:
            identity = by_track.get(track_id)
            cells.append(["", ""] if identity is None else
                         [identity.participant, _number(np.float32(identity.confidence))])
        return cells

    def _write_problem_row(self, item: FileAnalysis, index: int, pts_s: float | None,
                           problem: str) -> None:
        item.counts.unreadable += 1
        self._note_problem(item, f"frame {index}: {problem}")
        lead = [index, _number(pts_s), item.capture_ts.get(index, ""), problem]
        item._writer.writerow(lead + [""] * (len(self.columns) - len(lead)))
        if item._pose_writer is not None:
            item._pose_writer.writerow(lead + [""] * len(self.pose_channels))

    @staticmethod
    def _note_problem(item: FileAnalysis, problem: str) -> None:
        if len(item.problems) < 20:
            item.problems.append(problem)

    def _finish(self, item: FileAnalysis) -> None:
        """The file ended: rows for the frames it should have had, the summary, the progress
        file marked complete."""
        decoder = item.decoder
        expected, said_by = 0, ""
        if item.capture_ts:
            expected, said_by = max(item.capture_ts) + 1, "the recorder's sidecar lists"
        elif decoder.expected_frames:
            expected, said_by = decoder.expected_frames, "the container's header gives"
        if expected > item.next_frame:
            for index in range(item.next_frame, expected):
                self._write_problem_row(
                    item, index, None,
                    f"missing: the file ends after {item.next_frame} frames, {said_by} {expected}"
                    " (truncated?)")
            item.next_frame = expected
        elif not expected and decoder.fps and decoder.duration_s:
            about = round(decoder.duration_s * decoder.fps) - item.next_frame
            if about > 1:  # one frame of slack: a duration is rounded to the time base
                self._write_problem_row(
                    item, item.next_frame, None,
                    f"missing: about {about} frames: the file ends after {item.next_frame} "
                    f"frames, its header's duration of {decoder.duration_s:.3f} s at "
                    f"{decoder.fps:g} fps gives {item.next_frame + about} (truncated?)")
        item._table.flush()
        if item._pose_table is not None:
            item._pose_table.flush()
        item.seconds = item._seconds_before + time.monotonic() - item._started_monotonic
        item.done = True
        self._save_progress(item, item.next_frame, complete=True)
        if self.settings.parquet:
            self._write_parquet(item)
        write_private_json(item.summary_path, self.summary(item))

    def _write_parquet(self, item: FileAnalysis) -> None:
        """Note [Parquet from the finished CSV]; a failure is the file's `parquet_problem` (its
        CSV stands)."""
        from facecast.daemon.cli import analysis_parquet

        item.parquet_problem = analysis_parquet.pyarrow_problem()
        if item.parquet_problem:
            return
        try:
            analysis_parquet.write_from_csv(item.table_path, item.parquet_path, self.columns)
            if item.pose_table_path is not None:
                analysis_parquet.write_from_csv(
                    item.pose_table_path,
                    item.pose_table_path.with_name(item.video.stem + POSE_PARQUET_SUFFIX),
                    self.pose_columns)
        except Exception as exc:  # noqa: BLE001 - said in the summary; the CSV is the table
            item.parquet_problem = f"{item.parquet_path}: not written ({type(exc).__name__}: {exc})"
            log.error("%s", item.parquet_problem)

    def _save_progress(self, item: FileAnalysis, frame_index: int, complete: bool) -> None:
        for table in (item._table, item._pose_table):
            if table is not None:
                table.flush()
                os.fsync(table.fileno())
        seconds = item._seconds_before + time.monotonic() - item._started_monotonic
        write_private_json(item.progress_path, {
            "version": TABLE_VERSION, "identity": self._video_identity(item),
            "settings": self.settings_key(), "frame": frame_index,
            "table_bytes": item._table.tell(),
            "pose_table_bytes": item._pose_table.tell() if item._pose_table is not None else None,
            "counts": item.counts.as_dict(),
            "problems": item.problems, "seconds": seconds, "complete": complete})

    def summary(self, item: FileAnalysis) -> dict:
        """What `facecast analyze` prints and writes to `<name>.faces.json`."""
        if item.problem:
            return {"video": str(item.video), "ok": False, "error": item.problem}
        counts = item.counts
        return {
            "version": TABLE_VERSION, "facecast": __version__, "video": str(item.video),
            "table": str(item.table_path),
            "parquet": (str(item.parquet_path) if self.settings.parquet and item.done
                        and not item.parquet_problem else None),
            "parquet_problem": item.parquet_problem or None,
            "pose_table": str(item.pose_table_path) if item.pose_table_path else None,
            "ok": counts.unreadable == 0 and counts.concealed == 0,  # every frame read cleanly
            "complete": item.done,
            "frames": item.next_frame, "frames_measured": counts.frames,
            "frames_with_faces": counts.frames_with_faces, "faces": counts.faces,
            "frames_unreadable": counts.unreadable, "frames_concealed": counts.concealed,
            "problems": item.problems,
            "video_seconds": round(item.decoder.duration_s, 3) if item.decoder else None,
            "fps_nominal": item.decoder.fps if item.decoder else None,
            "seconds": round(item.seconds, 3),
            "frames_per_s": round(counts.frames / item.seconds, 2) if item.seconds > 0 else None,
            "resumed_from_frame": item.resumed_from_frame,
            "capture_timestamps": item.capture_ts_source,
            "device": str(self.pipeline.device),
            "decoder": _describe_decoder(item.decoder),
            "decoder_changes": [vars(event) for event in getattr(item.decoder, "events", [])],
            "landmarker": self.pipeline.landmarker,
            "landmarker_problem": self.landmarker_problem or None,
            "columns": ([{"name": name, "unit": unit} for name, unit in
                         (("frame", "count"), ("pts_s", "seconds"), ("capture_ts_lsl", "seconds"),
                          ("problem", "text"))]
                        + [{"name": label, "unit": unit} for label, unit, _ in self.channels]
                        + ([{"name": "participant", "unit": "text"},
                            {"name": "identity_confidence", "unit": "normalized"}]
                           if self.settings.participants else [])),
            **({"pose_columns": [{"name": label, "unit": unit}
                                 for label, unit, *_ in self.pose_channels]}
               if self.pose_pipeline is not None else {}),
        }


def _describe_decoder(decoder: FrameDecoder | None) -> str | None:
    """Which decoder gave the file's frames (Note [Analysis on NVDEC])."""
    if decoder is None:
        return None
    describe = getattr(decoder, "describe", None)
    return describe() if describe is not None else "PyAV (CPU)"


def _frame_time_s(item: FileAnalysis, frame: DecodedFrame) -> float:
    """The time PosePipeline smooths its ROI on and identities keep their schedule on (Note
    [Body pose offline], Note [Participants offline]): the capture time where the sidecar gives
    it, as live (the container's times are rounded to its tick: 67 ms
    for 66.7 ms in Matroska), else the presentation time, else the frame's index."""
    if frame.index in item.capture_ts:
        return float(item.capture_ts[frame.index])
    return frame.pts_s if frame.pts_s is not None else float(frame.index)


def _newer(path: Path, than: Path) -> bool:
    """Whether `path` exists and was written after `than`."""
    try:
        return path.stat().st_mtime_ns >= than.stat().st_mtime_ns
    except FileNotFoundError:
        return False


def recorded_pts_s(capture_ts: dict[int, str]) -> list[float]:
    """Each frame's presentation time as the recorder wrote it, in seconds, by frame index:
    its capture time minus the first frame's (Note [Container timestamps]; the container rounds it
    to its tick, PTS_MATCH_S allows
    for that). [] unless the sidecar lists every frame of the file from 0."""
    if not capture_ts or sorted(capture_ts) != list(range(len(capture_ts))):
        return []
    origin_ts = float(capture_ts[0])
    return [float(capture_ts[index]) - origin_ts for index in range(len(capture_ts))]


def _nearest(times_s: list[float], pts_s: float) -> int | None:
    """The index of the time within PTS_MATCH_S of `pts_s` (the container's rounding: 1 ms in
    Matroska), else None."""
    at = bisect.bisect_left(times_s, pts_s)
    best = min((i for i in (at - 1, at) if 0 <= i < len(times_s)),
               key=lambda i: abs(times_s[i] - pts_s), default=None)
    return best if best is not None and abs(times_s[best] - pts_s) <= PTS_MATCH_S else None


def _number(value) -> str:
    """A table cell: empty for None/NaN, else the shortest text that reads back to the same
    float32 (float64 for times)."""
    if value is None or value != value:
        return ""
    return str(value) if isinstance(value, np.floating) else repr(float(value))


def _float32_cells(values: np.ndarray) -> list[str]:
    """:func:`_number` of each value of a float32 array (a face's or a body's sample): the
    same cells without its per-value tests for None and other types (a one-face frame's ~70
    values, a four-face frame's ~280: 26 -> 21 us a face alone, 2026-11-27)."""
    return ["" if value != value else str(value) for value in values]


def write_private_json(path: Path, data: dict) -> None:
    """Atomically, 0600 (a reader, or a resume after a kill, sees the old file or the new one)."""
    private_files.write_atomically(path, (json.dumps(data, indent=1) + "\n").encode())


@dataclass(frozen=True)
class StackConfig:
    """The parts of a daemon's config that analysis uses: the models and output tables, which
    build_pipeline reads, and the daemon table's detection interval. (A whole Config also holds
    cameras, which analysis has none of.)"""

    models: config_mod.ModelsConfig = field(default_factory=config_mod.ModelsConfig)
    output: config_mod.OutputConfig = field(default_factory=config_mod.OutputConfig)
    daemon: config_mod.DaemonConfig = field(default_factory=config_mod.DaemonConfig)
    participants: config_mod.ParticipantsConfig = field(
        default_factory=config_mod.ParticipantsConfig)

    @classmethod
    def of(cls, config: config_mod.Config | None) -> StackConfig:
        return cls() if config is None else cls(config.models, config.output, config.daemon,
                                                config.participants)


def build_analyzer(config: StackConfig | config_mod.Config, device: torch.device, settings: Settings,
                   *, cpu_threads: int | None = None) -> Analyzer:
    """The daemon's face pipeline for this device (facecast.workers.inference.pipelines.build_pipeline:
    the same models, face_landmarker.task and max_faces; on the CPU its LiteRT models on
    ``cpu_threads``, Note [Threads of the models]), with Settings.pose its pose
    pipeline, with Settings.participants the identities of Note [Participants offline];
    BootError when a model cannot load, SetupError when the gallery is missing or empty."""
    from facecast.workers.base import BootError
    from facecast.workers.inference.pipelines import build_pipeline, build_pose_pipeline

    identities_factory = None
    if settings.participants:
        from facecast.models import assets
        from facecast.models.face_embedding import FaceEmbedder
        from facecast.workers.inference.identity import EmbeddingIdentities, GalleryWatch

        participants = msgspec.structs.replace(
            getattr(config, "participants", config_mod.ParticipantsConfig()), enabled=True,
            identify="embeddings", seats=[])
        watch = GalleryWatch(participants.gallery)  # read now: a bad gallery is said at once
        watch.poll(time.monotonic())
        if watch.problem:
            raise SetupError(f"--participants: {watch.problem} (the gallery `facecast enroll` "
                             "writes; participants.gallery in the config names another)")
        if watch.gallery is None or not watch.gallery.embeddings:
            raise SetupError(f"--participants: nobody is enrolled in {watch.path} "
                             "(`facecast enroll`)")
        try:
            embedder = FaceEmbedder.from_model_dir(config.models.dir or None, device)
        except assets.ModelError as exc:
            raise BootError(f"participants cannot be named: {exc}") from None

        def make_identities() -> EmbeddingIdentities:
            return EmbeddingIdentities(participants, embedder)

        identities_factory = make_identities
    # After the gallery's check: a bad gallery is said before seconds of model loading.
    pipeline, problem = build_pipeline(config, device, blendshapes=True, cpu_threads=cpu_threads)
    pose_pipeline = None
    if settings.pose:  # as the roi_landmark worker builds it with output.pose
        pose_pipeline = build_pose_pipeline(
            StackConfig(config.models, msgspec.structs.replace(config.output, pose=True),
                        config.daemon), device)
    return Analyzer(pipeline, settings, landmarker_problem=problem, pose_pipeline=pose_pipeline,
                    make_identities=identities_factory)
