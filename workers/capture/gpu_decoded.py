"""What the capture worker's two GPU decoders share: the demuxer that hands them compressed
packets (`PacketReader`, PyAV on the CPU) and the frame source around a GPU decoder
(`GpuDecodedSource`), played in one of three ways: a video file at its own rate
(`FilePlayback`), a stream as fast as it comes (`StreamPlayback`), or the encoded synthetic
loop (`EncodedLoopPlayback`). The decoders are NVDEC for H.264/H.265 (nvdec.py, Note [NVDEC
path]) and nvImageCodec for MJPEG (nvjpeg.py, Note [nvJPEG path]); `facecast analyze` reads
its files with the same `PacketReader` (Note [Analysis on NVDEC]).

Runs in the capture worker, on the camera's thread (Note [Camera threads]); imported only where
a GPU decoder is tried: it imports torch and PyAV.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os

import av
import av.bitstream
import av.error
import pylsl
import torch

from facecast.shared.config import CameraConfig, redact_url
from facecast.shared.transport import frames
from facecast.workers.capture import decoding
from facecast.workers.capture.decoding import (
    GPU_CODECS,
    DecodeChoice,
    DecodeRequest,
    GpuDecodeFailed,
    GpuDecodeUnavailable,
)
from facecast.workers.capture.sources import (
    FrameSource,
    SyntheticReplay,
    _Pacer,
    capture_in_a_new_tick,
    encoded_loop,
)

log = logging.getLogger(__name__)

READ_ERRORS = (av.error.FFmpegError, OSError)  # what PyAV raises for a file or stream it cannot read


def error_text(exc: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


# --- demuxing on the CPU ---------------------------------------------------------------------------


def _stream_options(url: str) -> dict[str, str]:
    """FFmpeg options for a stream: the user's $OPENCV_FFMPEG_CAPTURE_OPTIONS ("key;value|..."),
    which the CPU path honours too (sources._open_ffmpeg), else RTSP over TCP."""
    given = os.environ.get("OPENCV_FFMPEG_CAPTURE_OPTIONS")
    if given is not None:
        options = {}
        for item in given.split("|"):
            key, _, value = item.partition(";")
            if key.strip():
                options[key.strip()] = value.strip()
        return options
    return {"rtsp_transport": "tcp"} if url.lower().startswith(("rtsp://", "rtsps://")) else {}


class PacketReader:
    """The compressed packets of a file's or a stream's first video stream, H.264/H.265 in
    Annex B (Note [NVDEC path]), each stamped when the demuxer handed it over. `read` gives
    what a camera needs; `read_timed` also each packet's presentation time and discard flag,
    for a file analysed frame by frame (Note [Analysis on NVDEC])."""

    def __init__(self, target: str, *, stream: bool = False, open_timeout_s: float = 10.0,
                 read_timeout_s: float = 5.0) -> None:
        self.target = target
        options = _stream_options(target) if stream else {}
        self.container = av.open(target, mode="r", options=options,
                                 timeout=(open_timeout_s, read_timeout_s) if stream else None)
        try:
            videos = self.container.streams.video
            if not videos:
                raise GpuDecodeUnavailable("it has no video stream")
            self.stream = videos[0]
            context = self.stream.codec_context
            self.codec = context.name or ""
            self.pix_fmt = context.pix_fmt or ""
            self.profile = context.profile or ""
            self.width, self.height = int(context.width or 0), int(context.height or 0)
            self.has_b_frames = bool(context.has_b_frames)
            self.colorspace, self.color_range = context.colorspace, context.color_range
            rate = self.stream.average_rate or self.stream.guessed_rate
            self.fps = float(rate) if rate else 0.0
            self._filter = (av.bitstream.BitStreamFilterContext(
                f"{self.codec}_mp4toannexb", in_stream=self.stream)
                if self.codec in GPU_CODECS else None)
            extradata = bytes(context.extradata or b"")
            annex_b = extradata.startswith((b"\0\0\1", b"\0\0\0\1"))
            self._parameter_sets = extradata if annex_b else b""
            self._packets = self.container.demux(self.stream)
            # (Annex B bytes, keyframe, read time, pts, discard) of packets demuxed, not read yet
            self._pending: collections.deque[tuple[bytes, bool, float, int | None, bool]] = (
                collections.deque())
        except BaseException:
            self.container.close()
            raise

    def rewind(self) -> None:
        """Back to the first packet, as a fresh open would give it (the Annex B filter puts
        the parameter sets in front of that keyframe again, since non-keyframes came before
        it), for a file in memory played round and round: opening the container again costs
        ~11 ms of CPU (FFmpeg probes the stream), a seek 0.07 ms (2026-11-26, a 1080p
        encoded synthetic loop; at 64 cameras the opens were 16 % of the capture workers' CPU
        on the H100)."""
        self.container.seek(0, stream=self.stream)
        self._packets = self.container.demux(self.stream)
        self._pending.clear()

    def describe(self) -> str:
        """E.g. "H.264 High 1920x1080 yuv420p"."""
        codec = GPU_CODECS.get(self.codec, self.codec or "an unknown codec")
        profile = f" {self.profile}" if self.profile else ""
        return f"{codec}{profile} {self.width}x{self.height} {self.pix_fmt or '?'}"

    def read(self) -> tuple[bytes, bool, float] | None:
        """(Annex B bytes, keyframe, pylsl.local_clock() when read) of the next packet; None at
        the end. A stream's errors (its read timeout included) raise PyAV's errors."""
        packet = self._next()
        return None if packet is None else packet[:3]

    def read_timed(self) -> tuple[bytes, bool, int | None, bool] | None:
        """(Annex B bytes, keyframe, pts, discard) of the next packet; None at the end."""
        packet = self._next()
        return None if packet is None else (packet[0], packet[1], packet[3], packet[4])

    def read_ahead(self) -> tuple[bytes, bool, float] | None:
        """The packet `read` gives next, left to it (None: there is none)."""
        packet = self._next()
        if packet is None:
            return None
        self._pending.appendleft(packet)
        return packet[:3]

    def _next(self) -> tuple[bytes, bool, float, int | None, bool] | None:
        while not self._pending:
            try:
                packet = next(self._packets)
            except StopIteration:
                return None
            if not packet.size:
                continue  # the demuxer's flush packet at the end
            read_ts = pylsl.local_clock()
            keyframe = bool(packet.is_keyframe)
            pts, discard = packet.pts, bool(packet.is_discard)
            filtered = self._filter.filter(packet) if self._filter is not None else [packet]
            for out in filtered:  # one packet for one (the Annex B filters)
                data = bytes(out)
                if keyframe and self._parameter_sets:
                    data = self._parameter_sets + data
                self._pending.append((data, keyframe, read_ts, pts, discard))
        return self._pending.popleft()

    def close(self) -> None:
        self.container.close()


# --- the frames -----------------------------------------------------------------------------------


class DecodedFrame:
    """A frame decoded on the GPU, as the capture worker hands it to the camera's ring: `shape`
    (height, width, 3) of its BGR form; `bgr()` that form, a tensor of the caller's own ready on
    its current stream; `write_into` its BGR bytes straight into a ring slot with their checksum
    where the decoder's own form allows (Note [NV12 into the slot]): where `writes_itself`. Such
    a frame is still the decoder's, ready on the camera's stream, not handed over to the
    caller's: `ready_for(stream)` makes the stream that will write it wait for it (one event,
    not the two hand-overs between three streams that cost ~0.1 ms of CPU a frame)."""

    shape: tuple[int, int, int]
    writes_itself = False

    def bgr(self) -> torch.Tensor:
        raise NotImplementedError

    def ready_for(self, stream: torch.cuda.Stream) -> None:
        """Work queued on `stream` from now on sees the frame (here: a frame handed over to
        the caller's current stream)."""
        stream.wait_stream(torch.cuda.current_stream(stream.device))

    def write_into(self, out: torch.Tensor, word_weights: torch.Tensor) -> frames.PartialSums | None:
        """Queue, on the current stream (made `ready_for` first), the frame's BGR bytes into
        `out` (flat uint8) and the partial sums of their checksum (`word_weights`:
        frames.frame_word_weights), computed from the bytes written, never read back; returns
        the sums, whose value the caller fetches before the source's next frame, or None where
        this frame cannot (nothing queued: the caller takes `bgr()`)."""
        return None


class ConvertedFrame(DecodedFrame):
    """A frame already converted to its BGR tensor (handed over by the source's `read`)."""

    def __init__(self, frame: torch.Tensor) -> None:
        self.frame = frame
        self.shape = tuple(frame.shape)

    def bgr(self) -> torch.Tensor:
        return self.frame


# --- the sources ----------------------------------------------------------------------------------


class GpuDecodedSource(FrameSource):
    """A camera's frames decoded on its GPU: `read()` gives (BGR uint8 HxWx3 tensor on the
    camera's GPU, capture_ts_lsl), the tensor the caller's own and ready on its current stream.
    The decoder's own part (opening it on the first frame, decoding a packet) is the
    subclass's (nvdec.NvdecSource, nvjpeg.NvjpegSource); how packets come is its playback's
    (FilePlayback, StreamPlayback, EncodedLoopPlayback)."""

    backend = "?"
    on_device = True

    def __init__(self, camera: CameraConfig, request: DecodeRequest) -> None:
        super().__init__(camera)
        self.request = request
        self.device_index = request.device_index
        self.device = torch.device("cuda", self.device_index)
        self.stream = self._new_stream()
        self.reader: PacketReader | None = None
        self.decoder = None
        self.decode: DecodeChoice | None = None
        self.frames_decoded = 0
        self.loops = 0
        self._primed = False
        self._inject_after = decoding.injected_failure_after(camera.id)
        self._decoded: torch.cuda.Event | None = None  # _decoded_ready_for's

    def _next_packet_or_lost(self) -> tuple[bytes, bool, float] | None:
        """StreamPlayback turns a reader's error into SourceLost."""
        return self.reader.read()

    def read(self) -> tuple[torch.Tensor, float]:
        frame, capture_ts_lsl = self.read_decoded()
        return frame.bgr(), capture_ts_lsl

    def read_decoded(self) -> tuple[DecodedFrame, float]:
        """The next frame as the decoder left it (Note [NV12 into the slot]): the capture
        worker's read; valid until the next."""
        if self.decoder is None:
            raise self._lost("source is closed")
        if self._inject_after is not None and self.frames_read >= self._inject_after:
            raise GpuDecodeFailed(f"injected failure after {self.frames_read} frames "
                                  f"({decoding.INJECT_FAILURE_ENV})")
        frame, capture_ts_lsl = self._read_frame()
        self.frames_read += 1
        if not isinstance(frame, DecodedFrame):
            frame = ConvertedFrame(frame)
        if not frame.writes_itself:  # converted on the camera's stream: now the caller's
            self._hand_over()
        return frame, capture_ts_lsl

    def _read_frame(self) -> tuple[DecodedFrame | torch.Tensor, float]:
        raise NotImplementedError

    # -- the device (small seams: tests/test_decoding.py and tests/test_mjpeg_decoding.py play
    #    the GPU on the CPU through them)

    def _new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def _hand_over(self) -> None:
        """The frame is the caller's on its current stream (Note [NVDEC path])."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _decoded_ready_for(self, stream: torch.cuda.Stream) -> None:
        """`stream` waits for what was queued on the camera's stream (a frame that writes
        itself: DecodedFrame.ready_for), through one event made once."""
        if self._decoded is None:
            self._decoded = torch.cuda.Event()
        self._decoded.record(self.stream)
        stream.wait_event(self._decoded)

    def close(self) -> None:
        """On the camera's thread (Note [Camera threads]); never raises."""
        try:
            self.stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - closing after a failure: say so, go on
            log.warning("camera %s: waiting for its GPU decoder's stream: %s", self.camera_id, exc)
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def _usable_fps(fps: float) -> bool:
    return math.isfinite(fps) and 0 < fps <= 1000


class FilePlayback:
    """A video file, looped and paced at its native fps, as sources.FileSource (a mixin of a
    GpuDecodedSource subclass: `_play` once the first frame is decoded)."""

    kind = "file"

    def _play(self: GpuDecodedSource) -> None:
        fps = self.granted.fps
        if not _usable_fps(fps):
            log.warning("camera %s: %s has no usable frame rate (%r); pacing it at the "
                        "configured %g fps", self.camera_id, self.path, fps, self.camera.fps)
            self.granted = dataclasses.replace(self.granted, fps=self.camera.fps)
        self._pacer = _Pacer(self.granted.fps)
        log.info("camera %s: file %s plays %s, looped", self.camera_id, self.path,
                 self.granted.describe())

    @property
    def frames_skipped(self) -> int:
        return self._pacer.frames_skipped

    def _open_file(self: GpuDecodedSource) -> PacketReader:
        try:
            return PacketReader(str(self.path))
        except READ_ERRORS as exc:
            raise self._lost(f"FFmpeg (PyAV) cannot open video file {str(self.path)!r} "
                             f"({error_text(exc)})") from exc

    def _open_next_round(self: GpuDecodedSource) -> None:
        """The file's end: it starts again from a fresh open, as FileSource's."""
        self.reader.close()
        self.reader = None
        self.reader = self._open_file()
        self.loops += 1
        if self.reader.read_ahead() is None:
            raise self._lost(f"video file {str(self.path)!r} yields no frames")


class StreamPlayback:
    """An RTSP or HTTP stream, frames as fast as they come, as sources.StreamSource (a mixin of
    a GpuDecodedSource subclass: `_play` once the first frame is decoded)."""

    kind = "stream"

    def _play(self: GpuDecodedSource) -> None:
        if not _usable_fps(self.granted.fps):
            self.granted = dataclasses.replace(self.granted, fps=self.camera.fps)
        log.info("camera %s: stream %s delivers %s", self.camera_id, redact_url(self.url),
                 self.granted.describe())

    def _next_packet_or_lost(self: GpuDecodedSource) -> tuple[bytes, bool, float] | None:
        try:
            return self.reader.read()
        except READ_ERRORS as exc:
            raise self._lost(f"stream {redact_url(self.url)} ended or sent nothing for "
                             f"{self.read_timeout_s:g} s (peer gone? {error_text(exc)})") from exc

    def _next_packet_or_ended(self: GpuDecodedSource) -> tuple[bytes, bool, float]:
        packet = self._next_packet_or_lost()
        if packet is None:
            raise self._lost(f"stream {redact_url(self.url)} ended")
        return packet


class EncodedLoopPlayback:
    """"synthetic-h264" or "synthetic-mjpeg" decoded on the GPU: the same encoded loop,
    pacing, file positions and ground truth as sources.EncodedSyntheticSource (Note [Encoded
    synthetic loop]); a mixin of a GpuDecodedSource subclass, which calls `_encode_loop` first
    and `_play` once the loop's first frame is decoded."""

    def _encode_loop(self: GpuDecodedSource) -> None:
        self.replay = SyntheticReplay.for_camera(self.camera)
        self.encoded = encoded_loop(self.camera, self.replay)

    def _open_loop(self: GpuDecodedSource) -> PacketReader:
        return PacketReader(str(self.encoded.path))

    def _play(self: GpuDecodedSource, next_position: int) -> None:
        self._next_position = next_position  # the file frame the reader gives next
        self.granted = dataclasses.replace(self.granted, fps=self.camera.fps)
        self._pacer = _Pacer(self.camera.fps)
        self.replay.schedule_half_into_ticks(self._pacer)
        log.info("camera %s: %s encoded its %d-frame round trip once (%.2f MB in memory, "
                 "%.2f s) and decodes it on the GPU at %g fps", self.camera_id, self.kind,
                 self.encoded.frame_count, self.encoded.nbytes / 1e6, self.encoded.encode_s,
                 self.camera.fps)

    @property
    def frames_skipped(self) -> int:
        return self._pacer.frames_skipped

    def _next_capture(self: GpuDecodedSource) -> tuple[float, int]:
        """Wait for the next tick: (when a camera would have sent its frame, which file frame
        that is)."""
        self._pacer.wait()
        return capture_in_a_new_tick(self.replay,
                                     (self._next_position - 1) % self.encoded.frame_count)

    def _next_loop_packet(self: GpuDecodedSource) -> tuple[bytes, bool, float]:
        """The next file frame's packet; the file's end is its frame 0."""
        if self._next_position == self.encoded.frame_count:
            self.reader.rewind()
            self._next_position = 0
            self.loops += 1
        packet = self.reader.read()
        if packet is None:
            raise self._lost(f"{self.kind}: the encoded loop ended after {self._next_position} "
                             f"of its {self.encoded.frame_count} frames")
        self._next_position += 1
        return packet

    def ground_truth(self, capture_ts_lsl: float):
        """The faces in the frame that was captured at `capture_ts_lsl`."""
        return self.replay.faces_at(capture_ts_lsl)

    def close(self) -> None:
        super().close()
        encoded = getattr(self, "encoded", None)
        if encoded is not None:
            encoded.close()
