"""Which decoder a video file gets in `facecast analyze`, and the NVDEC one: H.264/H.265 files
decoded on the GPU by the capture worker's NVDEC path (facecast.workers.capture.nvdec: PyAV
demuxes, PyNvVideoCodec decodes, NV12 -> BGR with torch), every frame in order, the frames
staying on the GPU into the face stack; PyAV on the CPU (video_analysis.PyAvDecoder) for the rest.

Runs in the `facecast analyze` process (CLI side), on the thread that decodes the file (Note
[Decoding ahead]). Imported by video_analysis where a file is opened; imports torch and PyAV;
PyNvVideoCodec only where a decoder is made (nvdec.NvdecDecoder). Written on a machine without a
GPU: the NVDEC calls are the capture path's, which passed its GPU tests on an H200
(tests/test_nvdec_gpu.py); this module's GPU run is tests/test_analyze_nvdec_gpu.py (marker gpu,
not run yet); tests/test_analyze.py runs it with FFmpeg in NVDEC's place (`CpuNvdec`).

Note [Analysis on NVDEC]
    `--decode auto|gpu|cpu` (Settings.decode). The GPU decoder is tried for a file when the face
    stack runs on a CUDA device (frames decoded on the GPU for a stack on the CPU would be
    copied straight back), `--decode` is not "cpu", and NVDEC can be used in this process
    (decoding.nvdec_unavailable_reason: no CUDA, pynvvideocodec missing or not loadable, no
    libnvcuvid); then the file's video must be H.264 or H.265, 8-bit 4:2:0, of an even size,
    start at a keyframe and have no packet its container says to discard (an edit list that
    starts mid-GOP: FFmpeg drops those frames, NVDEC would show them). Any of these not met,
    the file is decoded by PyAV on the CPU from its start, and the reason is said once (the
    process-wide ones once per run, a file's once per file). "gpu" and "auto" differ only in
    that: nothing is refused, the CPU decoder always stays.
    Frames: each packet (Annex B, gpu_decoded.PacketReader) goes to one NVDEC decoder of the file's
    own (nvdec.NvdecDecoder: 0-frame latency where the stream has no B-frames, the native
    latency and an end-of-stream flush otherwise), made on the thread that iterates the
    frames and used only there; each frame NVDEC gives is made BGR on the file's CUDA stream
    (nvdec.bgr_of, a new tensor: NVDEC reuses its buffer at the next decode; NVDEC's own RGB
    conversion for studio-range files, Note [NV12 to BGR]), the
    consumer's stream waits for it and the tensor is recorded on that stream (the caching
    allocator then does not reuse its memory while the stack still reads it). Frames come out
    in presentation order; each takes the smallest presentation time of the packets given so
    far and not yet shown (packet and frame are one to one in H.264/H.265 files), which is
    the time FFmpeg gives the same frame. Without B-frames each packet must give exactly one
    frame at once; a packet that gives none (NVDEC dropped a damaged frame) or more is a
    failure, so that no frame is ever stamped with another's time.
    A failure after the first frame (NVDEC or the conversion raising, the demuxer breaking
    off, the one-frame rule, frames not given by the end of the stream) leaves the rest of
    that file to PyAV (`FallbackDecoder`): it decodes the file again from its start and hands
    on only the frames after the last one the GPU gave (by presentation time; by count where
    the file has none, as raw .h264 files), so that no frame is lost or given twice; what
    follows (damage, concealment, unreadable packets) is the CPU decoder's, as in Note [Frames
    that are not in the table]. The reason is said once, with the frame it happened at. A
    resumed analysis (Note [Resume points]) chooses again: the table is the same within float
    tolerance whichever decoder gave a frame (the two decoders' BGR differ by a few grey levels:
    Note [NV12 to BGR]), byte for byte only with the same decoder.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from facecast.daemon.cli.video_analysis import DecodedFrame, FrameDecoder, PyAvDecoder
from facecast.workers.capture import decoding, gpu_decoded, nvdec
from facecast.workers.capture.decoding import GpuDecodeFailed, GpuDecodeUnavailable
from facecast.workers.capture.gpu_decoded import error_text

CPU_NAME = "PyAV (CPU)"
_PENDING_FRAMES_LIMIT = 32  # frames NVDEC may hold back with B-frames (its DPB holds at most 16)


def gpu_decode_problem(requested: str, device: torch.device) -> str | None:
    """Why no file of this run is decoded on the GPU (Note [Analysis on NVDEC]), or None: try
    each file on NVDEC."""
    if requested not in decoding.DECODE_MODES:
        raise ValueError(f"decode {requested!r} is not one of {', '.join(decoding.DECODE_MODES)}")
    if requested == "cpu":
        return "--decode cpu"
    if device.type != "cuda":
        return (f"the face stack runs on the CPU ({device}): frames decoded on the GPU would "
                "be copied back")
    return decoding.nvdec_unavailable_reason()


@dataclass(frozen=True)
class DecoderEvent:
    """The decoder of a file, or its change: `decoder` from the file's frame `at_frame` on (the
    decoder's count), and why."""

    decoder: str
    at_frame: int
    reason: str

    def describe(self) -> str:
        where = f" from frame {self.at_frame}" if self.at_frame else ""
        return f"{self.decoder}{where} ({self.reason})"


def open_decoder(path: Path, requested: str, gpu_problem: str | None,
                 device: torch.device) -> FallbackDecoder:
    """The file's decoder: NVDEC where it can take it (its reason otherwise, in `events`), PyAV
    on the CPU for the rest. VideoError when the file cannot be read at all."""
    cpu = PyAvDecoder(path)
    if gpu_problem is not None:
        return FallbackDecoder(cpu, None, DecoderEvent(CPU_NAME, 0, gpu_problem))
    try:
        gpu = NvdecFileDecoder(path, device, cpu.time_base)
    except GpuDecodeUnavailable as exc:
        return FallbackDecoder(cpu, None, DecoderEvent(
            CPU_NAME, 0, f"--decode {requested}, but {exc.reason}"))
    return FallbackDecoder(cpu, gpu, DecoderEvent(gpu.name, 0, f"--decode {requested}: "
                                                  f"{gpu.reader.describe()}"))


class FallbackDecoder(FrameDecoder):
    """A file's frames from NVDEC, the rest of them from PyAV where NVDEC cannot go on (Note
    [Analysis on NVDEC]); the header's numbers are PyAV's. `events` says which decoder gave
    which frames and why (appended on the decoding thread, read by the analyzer's)."""

    def __init__(self, cpu: PyAvDecoder, gpu: NvdecFileDecoder | None,
                 first: DecoderEvent) -> None:
        self.cpu, self.gpu = cpu, gpu
        self.fps, self.expected_frames = cpu.fps, cpu.expected_frames
        self.duration_s, self.time_base = cpu.duration_s, cpu.time_base
        self.events: list[DecoderEvent] = [first]

    def describe(self) -> str:
        """E.g. "NVDEC (GPU 0)", or "NVDEC (GPU 0), then PyAV (CPU) from frame 120"."""
        return ", then ".join(
            event.decoder + (f" from frame {event.at_frame}" if index else "")
            for index, event in enumerate(self.events))

    def frames(self, decode_from: int = 0) -> Iterator[DecodedFrame]:
        given, last_pts = 0, None
        if self.gpu is not None:
            try:
                with contextlib.closing(self.gpu.frames(decode_from)) as frames:
                    for frame in frames:
                        yield frame
                        given += 1
                        last_pts = frame.pts if frame.pts is not None else last_pts
                return
            except (GpuDecodeUnavailable, GpuDecodeFailed) as exc:
                self.events.append(DecoderEvent(CPU_NAME, given, exc.reason))
        skipped = 0
        for frame in self.cpu.frames(decode_from):
            if given and skipped < given and (
                    frame.pts is None or last_pts is None or frame.pts <= last_pts):
                skipped += 1  # given already by NVDEC
                continue
            yield frame

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
        self.cpu.close()


class NvdecFileDecoder:
    """A file's frames decoded by NVDEC on `device`, every one, in presentation order, as
    HxWx3 uint8 BGR tensors on that GPU (Note [Analysis on NVDEC]). Opening reads the header
    only (GpuDecodeUnavailable: NVDEC cannot take this file); the decoder is made by `frames`,
    on the thread that iterates it."""

    def __init__(self, path: Path, device: torch.device, time_base: Fraction) -> None:
        self.device_index = device.index or 0
        self.device = torch.device("cuda", self.device_index)
        self.name = f"NVDEC (GPU {self.device_index})"
        self.time_base = time_base
        try:
            self.reader = gpu_decoded.PacketReader(str(path))
        except gpu_decoded.READ_ERRORS as exc:
            raise GpuDecodeUnavailable(f"PyAV cannot demux it ({error_text(exc)})") from exc
        reader = self.reader
        problem = nvdec.unsupported_reason(reader, mjpeg_elsewhere=False)
        if problem:
            reader.close()
            raise GpuDecodeUnavailable(problem)
        self.colour = nvdec.colour_of(reader)
        self.nvdec_rgb = nvdec.nvdec_converts(self.colour)
        self.low_latency = not reader.has_b_frames
        self.stream, self.consumer_stream = self._new_streams()

    def frames(self, decode_from: int = 0) -> Iterator[DecodedFrame]:
        """GpuDecodeUnavailable before the first frame, GpuDecodeFailed after it."""
        reader, index, packets = self.reader, 0, 0
        pending: list[int] = []  # the presentation times of packets given, frames not yet out
        unknown = 0  # packets given without a time, frames not yet out
        decoder = None
        failure = GpuDecodeUnavailable
        try:
            try:
                decoder = nvdec.NvdecDecoder(reader.codec, self.device_index, self.stream,
                                             self.low_latency, self.nvdec_rgb)
            except Exception as exc:  # noqa: BLE001 - PyNvVCException, RuntimeError: the reason
                raise GpuDecodeUnavailable(f"NVDEC could not make a decoder ({error_text(exc)})") \
                    from exc
            while True:
                try:
                    packet = reader.read_timed()
                except gpu_decoded.READ_ERRORS as exc:
                    raise failure(f"the demuxer broke off ({error_text(exc)})") from exc
                if packet is None:
                    if self.low_latency:
                        break
                    data = b""  # the end of the stream: the frames NVDEC holds
                else:
                    data, keyframe, pts, discard = packet
                    if not packets and not keyframe:
                        raise GpuDecodeUnavailable("the file does not start at a keyframe")
                    if discard:
                        raise failure(f"its container says to discard packet {packets} (an "
                                      "edit list): FFmpeg drops its frame")
                    packets += 1
                    if pts is None:
                        unknown += 1
                    else:
                        heapq.heappush(pending, pts)
                try:
                    pointers = decoder.decode(data, packets)
                except Exception as exc:  # noqa: BLE001 - whatever NVDEC raised, the reason says
                    raise failure(f"NVDEC failed on packet {packets - 1} ({error_text(exc)})") from exc
                if data and self.low_latency and len(pointers) != 1:
                    raise failure(f"NVDEC gave {len(pointers)} frames for packet {packets - 1} "
                                  "(one expected: a stream without B-frames)")
                if len(pointers) > len(pending) + unknown:
                    raise failure(f"NVDEC gave more frames than packets ({packets})")
                for pointer in pointers:
                    if pending:
                        pts = heapq.heappop(pending)
                    else:
                        unknown, pts = unknown - 1, None
                    image = self._convert(decoder, pointer) if index >= decode_from else None
                    failure = GpuDecodeFailed
                    yield DecodedFrame(index, pts, None if pts is None
                                       else float(pts * self.time_base), image)
                    index += 1
                if not data:
                    break
                if len(pending) + unknown > _PENDING_FRAMES_LIMIT:
                    raise failure(f"NVDEC holds {len(pending) + unknown} frames back (dropped "
                                  "damaged ones?)")
            if pending or unknown:
                raise failure(f"NVDEC gave {index} frames for the file's {packets} packets")
        finally:
            if decoder is not None:
                try:
                    self.stream.synchronize()
                finally:
                    decoder.close()
            if threading.current_thread() is not threading.main_thread():
                self._release_thread()

    def _convert(self, decoder, pointer: int) -> torch.Tensor:
        width, height = decoder.frame_size()
        try:
            output = self._output_at(pointer, nvdec.output_bytes(width, height, self.nvdec_rgb))
            with torch.cuda.stream(self.stream):
                frame = nvdec.bgr_of(output, height, width, self.colour, self.nvdec_rgb)
            self._hand_over(frame)
        except Exception as exc:  # noqa: BLE001 - a CUDA error while converting
            raise GpuDecodeFailed(f"converting NVDEC's frame failed ({error_text(exc)})") from exc
        return frame

    # -- the device (seams: tests/test_analyze.py plays NVDEC on the CPU through them)

    def _new_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The file's own stream, and the stream of the thread that opens it (the face stack's,
        which reads the frames)."""
        return torch.cuda.Stream(device=self.device), torch.cuda.current_stream(self.device)

    def _output_at(self, pointer: int, size_bytes: int) -> torch.Tensor:
        """NVDEC's output buffer as a flat uint8 tensor (no copy)."""
        from facecast.shared.transport import cuda_driver

        return cuda_driver.tensor_at(pointer, size_bytes, self.device_index)

    def _hand_over(self, frame: torch.Tensor) -> None:
        """The frame is the face stack's on its stream (Note [Analysis on NVDEC])."""
        self.consumer_stream.wait_stream(self.stream)
        frame.record_stream(self.consumer_stream)

    @staticmethod
    def _release_thread() -> None:
        """A decoding thread pops the context NvdecDecoder pushed on it (cuda_driver.release_thread:
        PyCUDA aborts the process otherwise)."""
        from facecast.shared.transport import cuda_driver

        cuda_driver.release_thread()

    def close(self) -> None:
        self.reader.close()

