"""Frames born on the GPU: H.264/H.265 demuxed on the CPU (PyAV), decoded by NVDEC (PyNvVideoCodec),
made BGR on the camera's GPU straight into the ring's slot (Note [NV12 into the slot]), or as a
device tensor where that cannot be (Note [NV12 to BGR]; `FramePublisher.publish_decoded`, Note
[Frames born on the GPU]).

Runs in the capture worker, on the camera's thread (Note [Camera threads]), and is imported only
where the GPU decoder is tried (decoding.plan): it imports torch and PyAV; PyNvVideoCodec is
imported when a decoder is made (its import needs the NVIDIA driver). What was read of
PyNvVideoCodec 2.2.4 is said where it is used. On the CPU, tests/test_decoding.py runs all of it
with FFmpeg playing NVDEC's part; on the GPU machine tests/test_nvdec_gpu.py (all passed on an
H200, 2026-11-26, but for its RTSP case: no GStreamer RTSP server there). The demuxer and what
the sources share with nvJPEG's are in gpu_decoded.py.

Note [NVDEC path]
    Per camera: a `PacketReader` (PyAV) demuxes the file or the RTSP/HTTP stream on the CPU and
    turns each packet into Annex B with FFmpeg's `h264_mp4toannexb`/`hevc_mp4toannexb` filter
    (MP4/MKV keep SPS/PPS out of band and length-prefix the NAL units; NVDEC's parser takes
    start codes; on a stream that is Annex B already the filter passes packets through, and
    the parameter sets of its SDP are put in front of each keyframe). Each packet is stamped
    with `pylsl.local_clock()` when the demuxer hands it over. PyAV rather than PyNvVideoCodec's
    own demuxer: its binding is CreateDemuxer(filename) alone, with no open or read timeout and
    no FFmpeg options, so a dead RTSP peer would hold the camera's thread until the worker is
    killed as hung, and RTSP could not be asked for over TCP as the CPU path asks for it;
    PyAV takes both (`timeout=(open, read)`, `rtsp_transport`), as OpenCV does on the CPU path,
    and runs on a machine without a GPU. `NvdecDecoder` feeds it to
    PyNvVideoCodec's low-level decoder (CreateDecoder + Decode(PacketData); not SimpleDecoder,
    which needs a seekable container and failed on a raw .h264 file: issue 22), created on the
    device's primary context (Note [One context]) and on a CUDA stream of the camera's own,
    with 0-frame latency (`DisplayDecodeLatencyType.LOW` and each packet flagged as one whole
    picture) where the stream has no B-frames, as cameras send them, and the native latency
    otherwise. A stream's frame is stamped with the read time of the packet whose decode gave
    it: for a camera (no B-frames) the time its own compressed frame was read. A file is played
    at its rate, as FileSource's: its frame is stamped when the pacer hands it out (a decode
    that gives several frames, B-frames or the end of the stream, would stamp them alike),
    and "synthetic-h264"'s as its CPU twin's (Note [Encoded synthetic loop]). A file starts
    again at its end: without B-frames into the same decoder (its first keyframe
    is one more keyframe of the stream); with them the end of the stream gets the frames the
    decoder holds out first, and a new decoder takes the next round.
    The decoder's output (RGB, or NV12: Note [NV12 to BGR]) is in a buffer it reuses at its
    next decode; `bgr_of` reads it on the same stream right away (stream order keeps the next
    decode from writing it first) into a new tensor, the producer-private frame whose checksum
    the ring computes before copying it into the slot. Before the frame is handed on, the capture thread's
    current stream waits for the camera's stream.
    At open the first frame is decoded: NVDEC creates its decoder when the parser meets the
    first sequence header, so running out of engines or memory, or a profile this GPU lacks,
    shows there, and the camera then opens on the CPU decoder with the reason
    (`GpuDecodeUnavailable`; Note [Decoder choice]). A stream is joined at its next keyframe
    (the decoder has nothing to refer to before it), within the open timeout.

Note [NV12 to BGR]
    The CPU path's frames are OpenCV's (its FFMPEG backend converts with FFmpeg's swscale), and
    a camera that falls back from the GPU decoder to the CPU one must not change colour, so the
    conversion is chosen to match it: BT.709 coefficients where the stream says BT.709
    (AVCOL_SPC_BT709), else BT.601; studio range (Y 16-235) unless the stream says full range
    (MJPEG's yuvj formats); chroma of each 2x2 block taken as it is (nearest, as swscale's
    unscaled converter does), in float32, rounded. Measured on the CPU against OpenCV 5.0's own
    decode of the same file (tests/test_decoding.py; the YUV planes from PyAV, which decodes
    H.264 bit-exactly as NVDEC must): the synthetic H.264 loop 45.5 dB PSNR (max difference 3
    grey levels), a BT.709-flagged stream 46.1 dB with the 709 matrix (42.9 with 601), the MJPEG
    loop (full range) 49.3 dB; bilinear chroma was worse (44.0 dB, max difference 27).
    In PyTorch's own kernels (the CPU's form) the work at full resolution is three: the luma
    scaled and added to its block's chroma terms (one broadcast add, written as the three BGR
    channels), the clamp, and the cast to uint8; the chroma terms (a quarter of the pixels) take two small ones, each a
    multiply-add on the chroma's raw bytes. The constants are folded into the terms, among them
    the chroma's 128 and the 0.5 that makes the truncating cast a rounding (half up). py-spy of
    a capture worker at 64 NVDEC cameras on the H100 (2026-11-26) found 19 % of its samples
    queueing an earlier form (ten full-size kernels and eight small ones, which rounded half to
    even); this one gives the same bytes but for one grey level at float32's ties (11 to 1,124
    of 6.2 million values of a random 1080p NV12 frame, by matrix and range), within half a
    grey level of the formula in float64 everywhere (tests/test_decoding.py). Until 2026-11-27
    the chroma terms took ten small kernels, each queued from Python under the GIL that a
    capture group's 16 camera threads share: 16 % of a capture worker's samples at 64 NVDEC
    cameras (H100, py-spy). Two A/B pairs at those 64 cameras on one H100 did not tell the two
    forms apart on rate (capture 3.7-5.4 ms of CPU a captured frame before, 3.2-4.1 after; the
    GPU 100 % busy, the captured rate moving more between runs than between forms:
    docs/benchmarks.md), but on memory: the capture processes held 1,272 MiB less (13,138 ->
    11,866 MiB in every run), the small tensors' blocks having been cached by torch's allocator
    per camera thread's stream.
    On a GPU that form is now the fallback: since 2026-11-27 the conversion is one fused kernel
    (`_fused_kernel`: the same terms in the same order, in float32, its constants literals in
    the code, compiled by NVRTC through PyTorch's jiterator at its first call), which reads the
    NV12 bytes and writes the BGR bytes, where the torch form wrote and read a float32 frame
    (25 MB at 1080p) and its chroma terms in between. On the H100 (2026-11-27, a 1080p frame,
    1,000 conversions queued back to back): 54 us a frame against 91, 26 us of CPU to queue it
    against 72, 5.9 MiB of device memory at its peak against 35.9 (the new frame only); the
    same bytes as PyTorch's kernels there and as the CPU's form but at float32's ties
    (tests/test_decoding.py). At 64 NVDEC cameras the capture processes held 10,186 MiB against
    11,468 (their torch reserve 2,784 against 4,066 MiB). Where NVRTC cannot compile or run it,
    PyTorch's kernels convert and the reason is logged once.
    `facecast analyze` skips it for studio-range files: NVDEC's decoder is asked for
    interleaved RGB (PyNvVideoCodec's OutputColorType.RGB, its own kernel on the camera's
    stream, with the stream's matrix, BT.601 where the stream names none) and `bgr_of` swaps
    the channels into the new tensor, one copy. Measured on the H100 (2026-11-26, a probe kept
    out of the repository, the analyze bench's 1080p synthetic H.264 file): its first frame
    45.77 dB PSNR against PyAV's CPU decode (this conversion: 45.56), at most 6 grey levels
    from this conversion; eight files decoded side by side by eight threads, 1,888 frames/s at
    0.87 ms of CPU a frame, against 949 frames/s at 2.13 ms with the conversion here (whose
    kernels each thread queues from Python while holding the GIL), and 2,346 frames/s with
    no conversion at all. Its conversion assumes studio range, so a full-range stream (MJPEG's
    yuvj formats) keeps the conversion here (`nvdec_converts`). Cameras keep it too: with
    NVDEC's RGB the daemon at 64 synthetic-h264 cameras (H100, 20:28 UTC the same day,
    `gpu_check.sh start decode_profile`) captured 76 of the 1,920 frames/s due (1,923 with
    the conversion here, 13:52 UTC), py-spy finding the capture threads in PyNvVideoCodec's
    `Decode` in 387 of 479 samples: with the inference workers keeping the GPU busy, its RGB
    output seems to wait for the device on each call (not yet looked into further).

Note [NV12 to BGR into memory of the process's own]
    torch's caching allocator keeps its blocks per stream, and with expandable segments (Note
    [Expandable segments]) maps a stream's large blocks in 20 MiB steps (kLargeBuffer): a
    camera's 6 MiB BGR frame (1080p), made on the camera's own stream, held 20 MiB of device
    memory per camera, which at 64 cameras is most of the capture processes' torch reserve
    (1,600 MiB against 48 live, H200 2026-11-28). So a camera's frame is allocated on its
    thread's current stream, which the process's camera threads share (torch's default
    stream), where the frames of 16 cameras pack into a few steps, and written on the camera's
    own stream; `record_stream` keeps the allocator from handing its memory out again before
    that stream is done with it. The write is one Triton kernel into the given memory
    (triton_kernels.nv12_to_bgr: the torch form's terms in its order, without fused
    multiply-adds), PyTorch's jiterator having no output argument; where Triton cannot serve,
    the conversion above is copied in. Measured (`bench/gpu_check.sh start ab_decode`, 64 NVDEC
    cameras, one H200, 2026-11-28 16:03 UTC, base d181a98): the capture processes' torch
    reserve 1,504 -> 556 MiB, their GPU memory 8,906 -> 7,958 MiB (-948), the rate, latency
    and CPU unchanged within a run's spread (0 dropped both; 5.39 and 5.52 cores).

Note [A looped file on one decoder]
    A file camera plays its file again from the start at its end. Where the file has B-frames,
    the decoder then holds the round's last frames (four, on the real clip), which an end of
    stream gets out; but a decoder that has had its end of stream takes nothing more, and
    making a new one each round cost the real clip's camera (640x360 H.264 High, 72 frames, 30
    fps) 27.3 of its 30 frames a second (H100, 2026-11-27, bench/real_footage.py; 29.6 decoded
    on the CPU): destroying a used PyNvVideoCodec decoder took 171-219 ms, holding the GIL
    that a capture group's camera threads share (a thread ticking every 0.5 ms stood still for
    220 ms), and the new decoder's first picture 41-47 ms (where NVDEC makes its session). So
    where the file starts with an IDR picture (H.264 NAL type 5, H.265 types 19-20: no picture
    after it refers to one before), one decoder plays every round: the next round's IDR
    picture is a clean start for the decoder, and the frames it held come out in order as it
    arrives (the probe: 68 frames out of the first round, then 72 every round, the 4 held ones
    first, one round 20 ms against 67 with a new decoder). A file that starts otherwise (an
    open GOP: a CRA picture whose leading pictures refer to frames of the round before) ends
    its stream and gets a new decoder each round, as before.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pylsl
import torch

from facecast.shared.config import CameraConfig
from facecast.shared.transport import frames
from facecast.workers.capture import decoding
from facecast.workers.capture.decoding import (
    GPU_CODECS,
    GPU_PIXEL_FORMATS,
    DecodeChoice,
    DecodeRequest,
    GpuDecodeFailed,
    GpuDecodeUnavailable,
)
from facecast.workers.capture.gpu_decoded import (
    READ_ERRORS,
    ConvertedFrame,
    DecodedFrame,
    EncodedLoopPlayback,
    FilePlayback,
    GpuDecodedSource,
    PacketReader,
    StreamPlayback,
    error_text,
)
from facecast.workers.capture.sources import (
    FrameSource,
    Granted,
    _why_no_stream,
    video_file_path,
)

log = logging.getLogger(__name__)

_AVCOL_SPC_BT709 = 1
_AVCOL_RANGE_JPEG = 2
# PyNvVideoCodec's codec enum member per FFmpeg codec name.
_NVDEC_CODECS = {"h264": "H264", "hevc": "HEVC"}


# --- NV12 → BGR (Note [NV12 to BGR]) --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class YuvToBgr:
    """The colour matrix and range of a stream's YUV."""

    matrix: str  # "bt601" or "bt709"
    full_range: bool

    @classmethod
    def of(cls, colorspace: object, color_range: object, pix_fmt: str | None) -> YuvToBgr:
        """From PyAV's codec context (AVColorSpace, AVColorRange, pixel format name)."""
        try:
            matrix = "bt709" if int(colorspace) == _AVCOL_SPC_BT709 else "bt601"
        except (TypeError, ValueError):
            matrix = "bt601"
        try:
            full = int(color_range) == _AVCOL_RANGE_JPEG
        except (TypeError, ValueError):
            full = False
        return cls(matrix, full or (pix_fmt or "").startswith("yuvj"))

    def coefficients(self) -> tuple[float, float, float, float, float, float, float]:
        """(y_offset, y_scale, b_from_u, g_from_u, g_from_v, r_from_v, chroma_scale)."""
        kr, kb = (0.2126, 0.0722) if self.matrix == "bt709" else (0.299, 0.114)
        kg = 1.0 - kr - kb
        y_offset, y_scale, chroma_scale = (0.0, 1.0, 1.0) if self.full_range else (
            16.0, 255.0 / 219.0, 255.0 / 224.0)
        return (y_offset, y_scale, 2.0 * (1.0 - kb), -2.0 * kb * (1.0 - kb) / kg,
                -2.0 * kr * (1.0 - kr) / kg, 2.0 * (1.0 - kr), chroma_scale)


def nv12_to_bgr(nv12: torch.Tensor, height: int, width: int, colour: YuvToBgr,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """An NV12 frame ((height * 3 / 2) x width uint8: the Y plane, then interleaved U, V at half
    resolution) as a height x width x 3 uint8 BGR tensor on the same device, on the current
    stream (Note [NV12 to BGR]): a new one, or `out` (contiguous, of that shape) where given
    (Note [NV12 to BGR into memory of the process's own]). Width and height must be even
    (4:2:0)."""
    if height % 2 or width % 2:
        raise ValueError(f"NV12 needs an even width and height, got {width}x{height}")
    if out is not None:
        from facecast.models import triton_kernels

        if triton_kernels.nv12_to_bgr(nv12, out, _terms(colour)) is None:
            out.copy_(nv12_to_bgr(nv12, height, width, colour))  # where the kernel cannot serve
        return out
    half_h, half_w = height // 2, width // 2
    if nv12.is_cuda and _fused_failed is None:
        # One kernel from the bytes to the bytes: each output byte is its luma, its block's U
        # and V, and its channel's number, broadcast to (half_h, 2, half_w, 2, 3).
        luma = nv12[:height].view(half_h, 2, half_w, 2, 1)
        chroma = nv12[height:height + half_h].view(half_h, 1, half_w, 1, 2)
        try:
            bgr = _fused_kernel(colour)(luma, chroma[..., 0:1], chroma[..., 1:2],
                                        _channels_on(nv12.device))
            return bgr.reshape(height, width, 3)
        except Exception as exc:  # NVRTC missing or refusing: PyTorch's kernels serve
            _fused_kernel_failed(exc)
    return converted_by_torch(nv12, height, width, colour)


def converted_by_torch(nv12: torch.Tensor, height: int, width: int, colour: YuvToBgr
                       ) -> torch.Tensor:
    """`nv12_to_bgr` in PyTorch's own kernels: the CPU's form, and the GPU's where the fused
    kernel cannot run."""
    half_h, half_w = height // 2, width // 2
    from_u, from_v, constant, y_scale = _chroma_terms_on(colour, nv12.device)
    chroma = nv12[height:height + half_h].reshape(half_h, half_w, 2)
    # Per 2x2 block of luma: what its chroma adds to B, G and R, with the chroma's 128, its
    # scale, the luma's offset and the rounding's 0.5 folded in: two kernels on the raw bytes.
    terms = torch.addcmul(constant, chroma[..., 0:1], from_u).addcmul_(chroma[..., 1:2], from_v)
    luma = nv12[:height].reshape(half_h, 2, half_w, 2, 1)
    bgr = torch.add(terms[:, None, :, None, :], luma, alpha=y_scale)
    # (half_h, 2, half_w, 2, 3) is (height, width, 3) in memory: row 2i+a, column 2j+b. The cast
    # truncates: after the 0.5, a rounding; the clamp keeps it to 0..255.
    return bgr.view(height, width, 3).clamp_(0.0, 255.99).to(torch.uint8)


# The fused conversion's element (Note [NV12 to BGR]): the torch form's terms above, in the
# same order and precision; the colour's constants are literals in the code, and the function's
# name is the colour's, so that no cache of compiled kernels can mistake one colour for another.
_FUSED_ELEMENT = """
template <typename T> T {name}(T y, T u, T v, T channel) {{
    float from_u = channel == 0 ? {b_u}f : (channel == 1 ? {g_u}f : 0.0f);
    float from_v = channel == 0 ? 0.0f : (channel == 1 ? {g_v}f : {r_v}f);
    float value = channel == 0 ? {b_0}f : (channel == 1 ? {g_0}f : {r_0}f);
    value = value + float(u) * from_u;
    value = value + float(v) * from_v;
    value = value + float(y) * {y_scale}f;
    return T(fminf(fmaxf(value, 0.0f), 255.99f));
}}
"""
_fused_failed: str | None = None  # why the fused kernel is not used, once it failed


def _fused_kernel_failed(exc: Exception) -> None:
    global _fused_failed
    if _fused_failed is None:
        _fused_failed = f"{type(exc).__name__}: {exc}"
        log.warning("NV12 to BGR: the fused kernel failed (%s); PyTorch's kernels convert "
                    "from now on", _fused_failed)


@functools.lru_cache(maxsize=4)
def _fused_kernel(colour: YuvToBgr):
    """The fused conversion for `colour`, made once per process (NVRTC, through PyTorch's
    jiterator: compiled at its first call, then cached in memory and on disk)."""
    from_u, from_v, (b_0, g_0, r_0), y_scale = _terms(colour)
    code = _FUSED_ELEMENT.format(
        name=f"nv12_to_bgr_{colour.matrix}_{'full' if colour.full_range else 'studio'}",
        b_u=_f32(from_u[0]), g_u=_f32(from_u[1]), g_v=_f32(from_v[1]), r_v=_f32(from_v[2]),
        b_0=_f32(b_0), g_0=_f32(g_0), r_0=_f32(r_0), y_scale=_f32(y_scale))
    return torch.cuda.jiterator._create_jit_fn(code)


def _terms(colour: YuvToBgr) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...],
                                      float]:
    """B, G, R per unit of U and of V, the constant term (the chroma's 128, the luma's offset
    and the rounding's 0.5 folded in), and the luma's scale."""
    y_offset, y_scale, b_u, g_u, g_v, r_v, chroma_scale = colour.coefficients()
    from_u = (b_u * chroma_scale, g_u * chroma_scale, 0.0)
    from_v = (0.0, g_v * chroma_scale, r_v * chroma_scale)
    constant = tuple(0.5 - y_offset * y_scale - 128.0 * (u + v) for u, v in zip(from_u, from_v))
    return from_u, from_v, constant, y_scale


def _f32(value: float) -> str:
    """`value` as a C float literal's digits that round to the float32 torch would use."""
    return repr(float(np.float32(value)))


@functools.lru_cache(maxsize=16)
def _channels_on(device: torch.device) -> torch.Tensor:
    """0, 1, 2 (B, G, R) as uint8 on the device: the fused conversion's channel input."""
    return torch.arange(3, dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=16)
def _chroma_terms_on(colour: YuvToBgr, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """`nv12_to_bgr`'s constants on the device, made once (a tensor made per frame would be a
    host-to-device copy per frame): B, G, R per unit of U and of V, the constant term, and the
    luma's scale."""
    from_u, from_v, constant, y_scale = _terms(colour)
    return (*(torch.tensor(values, dtype=torch.float32, device=device)
              for values in (from_u, from_v, constant)), y_scale)


def output_bytes(width: int, height: int, rgb: bool) -> int:
    """The size of one NVDEC output buffer: NV12, or interleaved RGB."""
    return width * height * 3 if rgb else width * height * 3 // 2


def nvdec_converts(colour: YuvToBgr) -> bool:
    """Whether NVDEC's own RGB output serves a stream of this colour (Note [NV12 to BGR]): its
    conversion takes studio range only."""
    return not colour.full_range


def bgr_of(output: torch.Tensor, height: int, width: int, colour: YuvToBgr,
           rgb: bool) -> torch.Tensor:
    """A new height x width x 3 uint8 BGR tensor of NVDEC's output buffer (flat uint8 on the
    device), on the current stream: its RGB (`rgb`, NvdecDecoder's) with the channels swapped,
    one copy; else its NV12 converted here (Note [NV12 to BGR])."""
    if rgb:
        return output.view(height, width, 3).flip(-1)
    return nv12_to_bgr(output.view(height * 3 // 2, width), height, width, colour)


# --- NVDEC through PyNvVideoCodec -----------------------------------------------------------------


class NvdecDecoder:
    """One PyNvVideoCodec decoder on the device's primary context and a given CUDA stream.

    The API used is PyNvVideoCodec 2.2.4's as its wheel states it (its bound signatures, read
    from the wheel on a machine without a GPU): CreateDecoder(gpuid, codec, cudacontext,
    cudastream, usedevicememory, latency), PyNvDecoder.Decode(PacketData) -> [DecodedFrame],
    PacketData's bsl_data (a pointer), bsl (its size), pts and decode_flag (VideoPacketFlag:
    ENDOFPICTURE 8), DecodedFrame.GetPtrToPlane(0) (the NV12 buffer: the Y
    plane of width x height bytes, the interleaved chroma right after it, rows not padded, as
    its NvDecoder copies them), GetWidth/GetHeight/GetPixelFormat. Passing the context and a
    stream explicitly is what NVIDIA's sample decode_with_cuda_control.py does; the decoder
    then queues its output copies on that stream and does not synchronise the host itself.
    """

    def __init__(self, codec: str, device_index: int, stream: torch.cuda.Stream,
                 low_latency: bool, rgb: bool = False) -> None:
        import PyNvVideoCodec as nvc  # needs the driver (decoding.nvdec_unavailable_reason)

        from facecast.shared.transport import cuda_driver

        cuda = cuda_driver.driver(device_index)  # the primary context, current on this thread
        self._nvc = nvc
        self._end_of_picture = int(nvc.VideoPacketFlag.ENDOFPICTURE) if low_latency else 0
        latency = (nvc.DisplayDecodeLatencyType.LOW if low_latency
                   else nvc.DisplayDecodeLatencyType.NATIVE)
        # RGB: the library's own conversion kernel on `stream` (Note [NV12 to BGR]).
        colour = nvc.OutputColorType.RGB if rgb else nvc.OutputColorType.NATIVE
        with cuda_driver.CAPTURE_LOCK:  # not during a ring's graph capture in another thread
            self._decoder = nvc.CreateDecoder(
                gpuid=device_index, codec=getattr(nvc.cudaVideoCodec, _NVDEC_CODECS[codec]),
                cudacontext=int(cuda.Context.get_current().handle),
                cudastream=int(stream.cuda_stream), usedevicememory=True, latency=latency,
                outputColorType=colour)

    def decode(self, data: bytes, pts: int) -> list[int]:
        """The output buffers (device pointers: NV12, or interleaved RGB rows of width x 3
        bytes with `rgb`) of the frames this packet completes, in display order; each is valid
        until the next decode on the decoder's stream. An empty packet is
        the end of the stream (its NvDecoder then flags it ENDOFSTREAM): what the decoder holds
        comes out, and the decoder takes nothing more."""
        payload = np.frombuffer(data, np.uint8)  # alive for the call: the parser reads it there
        packet = self._nvc.PacketData()
        packet.bsl_data = int(payload.ctypes.data) if payload.size else 0
        packet.bsl = int(payload.size)
        packet.pts = pts
        packet.decode_flag = self._end_of_picture if payload.size else 0
        return [int(frame.GetPtrToPlane(0)) for frame in self._decoder.Decode(packet)]

    def frame_size(self) -> tuple[int, int]:
        return int(self._decoder.GetWidth()), int(self._decoder.GetHeight())

    def pixel_format(self) -> str:
        return str(self._decoder.GetPixelFormat()).rpartition(".")[2]

    def close(self) -> None:
        self._decoder = None  # PyNvDecoder's destructor frees its decoder and buffers


# Note [Decoders left to the process's end]
#     Destroying a used PyNvVideoCodec decoder takes ~200 ms (171-219 ms, H100, 2026-11-27) and
#     holds the GIL all along, so the camera threads of a capture group, each closing its own at
#     the worker's stop, closed one after another: at 128 synthetic-h264 cameras on two GPUs (16
#     a process) each camera's closing took 1.0-1.5 s, 46 threads were still closing when the
#     worker gave up on them (STOP_JOIN_S), and the supervisor SIGKILLed 10 workers. At the
#     stop the process ends anyway, by os._exit (Note [Quick exit]), and the driver ends a
#     process's NVDEC sessions with its CUDA context: so there a decoder is only dropped from
#     its source and kept here, never destroyed from Python. Everywhere else (a camera falling
#     back to the CPU decoder, a reopen) it is destroyed, which frees its NVDEC session.
_LEFT_TO_THE_EXIT: list[NvdecDecoder] = []

# NVDEC's output buffers a source keeps as tensors (NvdecSource._output_at); a decoder reuses a
# few (its decode surfaces' copies), so this is only a bound.
MAX_OUTPUT_TENSORS = 64


# NAL unit types of a picture after which no picture refers to one before it (Note [A looped file
# on one decoder]): H.264's IDR slice; H.265's IDR_W_RADL and IDR_N_LP.
_IDR_NAL_TYPES = {"h264": {5}, "hevc": {19, 20}}
_PICTURE_NAL_TYPES = {"h264": range(1, 6), "hevc": range(0, 32)}  # the VCL NAL units


# Note [NVDEC path warmed while standing by]
#     A capture process's first NVDEC camera pays for what every later one shares: PyAV's and
#     PyNvVideoCodec's imports (the latter loads the driver's NVDEC library), Triton's import
#     and the load of the NV12 slot kernel from its cache, the pinned memory of the checksum's
#     fetch: 0.7-0.95 s on an H200. A warm spare that takes over a killed capture process's
#     cameras paid all of it after the kill: issue 22 asks every camera back within 2 s, and
#     tests/test_nvdec_gpu.py's eight 640x360 cameras took 2.03-2.08 s (two runs, 2026-11-28).
#     So a capture worker on a GPU whose config may decode a camera on NVDEC
#     (decoding.may_use_nvdec) does it in `prepare`, as a standby or held at boot (`warm_up`),
#     on a frame of 4x2 pixels; the decoder itself is made per camera at open (its codec and
#     size come from the stream). With it the same test's cameras published their first frames
#     0.77-1.03 s after the supervisor saw the death (one run; not an A/B of one code).


def warm_up(device_index: int) -> str | None:
    """Note [NVDEC path warmed while standing by]: the imports, the NV12 slot kernel and a
    checksum fetch, once, on the device; why NVDEC cannot serve here (the cameras' opens say it
    again), or None."""
    reason = decoding.nvdec_unavailable_reason()
    if reason:
        return reason
    from facecast.models import triton_kernels

    device = torch.device("cuda", device_index)
    # The device made current: the event, the pinned memory and the kernel's stream are the
    # current device's, and on the main thread that is GPU 0. Without it each capture process
    # of GPU 1 also made a context on GPU 0: 518 MiB each, 2.5 GiB on GPU 0 at 128 cameras
    # (two H200, 2026-11-28).
    with torch.cuda.device(device):
        height, width = 2, 4  # the smallest NV12 frame whose BGR bytes are whole checksum words
        nv12 = torch.zeros(height * 3 // 2 * width, dtype=torch.uint8, device=device)
        slot = torch.empty(height * width * 3, dtype=torch.uint8, device=device)
        word_weights, _ = frames.frame_word_weights(slot.numel(), device)
        partials = frames.PartialSums(triton_kernels.nv12_slot_partial_count(slot.numel()),
                                      device)
        if triton_kernels.nv12_to_slot(nv12, slot, height, width,
                                       _terms(YuvToBgr("bt601", False)), word_weights,
                                       partials.sums) is not None:
            partials.value()
        frames.warm_up_checksums(device)  # the path of a frame that cannot write itself
    return None


def starts_with_idr(codec: str, annex_b: bytes) -> bool:
    """Whether the first picture (VCL NAL unit) of an Annex B packet is an IDR picture."""
    if codec not in _IDR_NAL_TYPES:
        return False
    position = annex_b.find(b"\x00\x00\x01")
    while position >= 0 and position + 3 < len(annex_b):
        header = annex_b[position + 3]
        nal_type = header & 0x1F if codec == "h264" else (header >> 1) & 0x3F
        if nal_type in _PICTURE_NAL_TYPES[codec]:
            return nal_type in _IDR_NAL_TYPES[codec]
        position = annex_b.find(b"\x00\x00\x01", position + 3)
    return False


# --- the sources ----------------------------------------------------------------------------------


def unsupported_reason(reader: PacketReader, *, mjpeg_elsewhere: bool) -> str | None:
    """Why NVDEC and `nv12_to_bgr` cannot take what the reader found, or None; a camera's
    MJPEG goes to nvJPEG (`mjpeg_elsewhere`), a file analysed is NVDEC's or the CPU's."""
    if reader.codec not in GPU_CODECS:
        codecs = " and ".join(GPU_CODECS.values())
        takers = (f"the GPU decoders take {codecs} (NVDEC) and MJPEG (nvJPEG)" if mjpeg_elsewhere
                  else f"NVDEC takes {codecs}")
        return f"its video is {reader.codec or 'of an unknown codec'}; {takers}"
    if reader.pix_fmt and reader.pix_fmt not in GPU_PIXEL_FORMATS:
        return f"its video is {reader.describe()}: the GPU path converts 8-bit 4:2:0 only"
    if reader.width % 2 or reader.height % 2:
        return f"its video is {reader.describe()}: an odd size"
    return None


def colour_of(reader: PacketReader) -> YuvToBgr:
    """The NV12 → BGR conversion of the reader's video (Note [NV12 to BGR])."""
    return YuvToBgr.of(reader.colorspace, reader.color_range, reader.pix_fmt)


class NvdecFrame(DecodedFrame):
    """NVDEC's NV12 frame as the capture worker takes it: still in the decoder's buffer (valid
    until the decoder's next decode), converted where it goes (Note [NV12 into the slot])."""

    writes_itself = True

    def __init__(self, source: NvdecSource, nv12: torch.Tensor, height: int, width: int) -> None:
        self.source = source
        self.nv12 = nv12
        self.shape = (height, width, 3)

    def bgr(self) -> torch.Tensor:
        height, width, _ = self.shape
        frame = self.source._converted(self.nv12, height, width)
        self.source._hand_over()
        return frame

    def ready_for(self, stream: torch.cuda.Stream) -> None:
        self.source._decoded_ready_for(stream)

    def write_into(self, out: torch.Tensor, word_weights: torch.Tensor) -> frames.PartialSums | None:
        from facecast.models import triton_kernels

        height, width, _ = self.shape
        partials = self.source.partials_for(out.numel())
        written = triton_kernels.nv12_to_slot(self.nv12, out, height, width, self.source.terms,
                                              word_weights, partials.sums)
        return None if written is None else partials


class NvdecSource(GpuDecodedSource):
    """A camera's H.264/H.265 decoded by NVDEC (Note [NVDEC path])."""

    backend = "NVDEC"
    low_latency_always = False  # a source known to have no B-frames

    def __init__(self, camera: CameraConfig, request: DecodeRequest) -> None:
        super().__init__(camera, request)
        self.decoder: NvdecDecoder | None = None
        self._pts = 0
        # Frames decoded and not read yet: NVDEC's own buffers, valid until the next decode,
        # which comes only once this is empty (Note [NV12 into the slot]).
        self._ready: collections.deque[tuple[DecodedFrame, float]] = collections.deque()
        self._partials: frames.PartialSums | None = None  # NvdecFrame.write_into's
        self._outputs: dict[int, torch.Tensor] = {}  # NVDEC's buffers as tensors (_output_at)

    # -- opening

    def _start(self, reader: PacketReader, keyframe_deadline_s: float) -> DecodedFrame:
        """Check what the reader found, make the decoder, decode the first frame (Note [NVDEC
        path]); returns it (converted). GpuDecodeUnavailable says why the GPU cannot take it."""
        if reader.codec in decoding.JPEG_CODECS:
            raise _MjpegFound(reader)  # nvJPEG's, the reader open (open_gpu_source)
        self.reader = reader
        reason = unsupported_reason(reader, mjpeg_elsewhere=True) or decoding.nvdec_unavailable_reason()
        if reason:  # (plan may have let NVDEC's own reason by for MJPEG)
            raise GpuDecodeUnavailable(reason)
        self.colour = colour_of(reader)
        self.terms = _terms(self.colour)
        self.nvdec_rgb = False  # cameras: the conversion here (Note [NV12 to BGR])
        self.low_latency = self.low_latency_always or not reader.has_b_frames
        try:
            self.decoder = self._new_decoder()
        except Exception as exc:  # noqa: BLE001 - PyNvVCException, RuntimeError: the reason
            raise GpuDecodeUnavailable(
                f"NVDEC could not make a decoder ({error_text(exc)})") from exc
        deadline = time.monotonic() + keyframe_deadline_s
        self.starts_clean = True  # Note [A looped file on one decoder]
        while True:
            packet = self._next_packet_or_lost()
            if packet is None:
                raise GpuDecodeUnavailable(f"{reader.describe()} ended before its first frame")
            data, keyframe, read_ts = packet
            if keyframe:
                self.starts_clean = self.starts_clean and starts_with_idr(reader.codec, data)
                break
            self.starts_clean = False
            if time.monotonic() > deadline:
                raise GpuDecodeUnavailable(
                    f"no keyframe within {keyframe_deadline_s:g} s (the GPU decoder starts at "
                    "one: a longer keyframe interval than that?)")
        while True:
            pointers = self._decode(data, read_ts)  # GpuDecodeUnavailable until primed
            if pointers:
                break
            packet = self._next_packet_or_lost()
            if packet is None:
                raise GpuDecodeUnavailable(f"{reader.describe()} ended before its first frame")
            data, _, read_ts = packet
        pixel_format = self.decoder.pixel_format()
        if pixel_format != "NV12":
            raise GpuDecodeUnavailable(f"NVDEC gives {pixel_format} for {reader.describe()}; "
                                       "the GPU path converts NV12 only")
        try:
            # Converted now: a conversion that cannot work says so here, where the CPU decoder
            # can still take the camera.
            first, *more = [self._convert(pointer, defer=False) for pointer in pointers]
        except GpuDecodeFailed as exc:
            raise GpuDecodeUnavailable(exc.reason) from exc
        self._ready.extend((frame, read_ts) for frame in more)
        self._primed = True
        width, height = self.decoder.frame_size()
        self.decode = DecodeChoice("gpu", f"{self.request.asked()}: {reader.describe()} on "
                                   f"NVDEC (GPU {self.device_index})")
        self._first_read_ts = read_ts
        self.granted = Granted(width, height, reader.fps or self.camera.fps, reader.codec,
                               self.backend)
        return first

    # -- decoding

    def _decode(self, data: bytes, read_ts: float) -> list[int]:
        """NVDEC's frames for one packet (NV12 pointers), stamped `read_ts` by the caller; an
        empty packet ends the stream and gives what the decoder still holds."""
        pts, self._pts = self._pts, self._pts + 1
        try:
            pointers = self.decoder.decode(data, pts)
        except Exception as exc:  # noqa: BLE001 - whatever NVDEC raised, the reason says
            what = f"NVDEC failed on a packet ({error_text(exc)})"
            if self._primed:
                raise GpuDecodeFailed(what) from exc
            raise GpuDecodeUnavailable(
                f"{what}: engines or memory exhausted, or a profile this GPU does not "
                "support") from exc
        self.frames_decoded += len(pointers)
        return pointers

    def _decode_into_ready(self, data: bytes, read_ts: float, defer: bool = True) -> None:
        for pointer in self._decode(data, read_ts):
            self._ready.append((self._convert(pointer, defer), read_ts))

    def _convert(self, pointer: int, defer: bool = True) -> DecodedFrame:
        """NVDEC's frame at `pointer`, left in NVDEC's buffer to be converted where it goes
        (`defer`: Note [NV12 into the slot]; valid until the next decode) or converted now into
        a new BGR tensor on the camera's stream."""
        width, height = self.decoder.frame_size()
        if self._primed and (width, height) != (self.granted.width, self.granted.height):
            raise self._lost(f"frame size changed from {self.granted.width}x"
                             f"{self.granted.height} to {width}x{height}; reopen to renegotiate")
        try:
            output = self._output_at(pointer, output_bytes(width, height, self.nvdec_rgb))
        except Exception as exc:  # noqa: BLE001 - a CUDA error on NVDEC's buffer
            raise GpuDecodeFailed(f"NVDEC's frame cannot be read ({error_text(exc)})") from exc
        if defer and not self.nvdec_rgb:
            return NvdecFrame(self, output, height, width)
        return ConvertedFrame(self._converted(output, height, width))

    def _converted(self, output: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """NVDEC's output as a new BGR tensor, written on the camera's stream."""
        try:
            if self.nvdec_rgb:
                with torch.cuda.stream(self.stream):
                    return bgr_of(output, height, width, self.colour, self.nvdec_rgb)
            # Note [NV12 to BGR into memory of the process's own]: allocated on the thread's
            # current stream, written on the camera's.
            bgr = self._new_frame(height, width)
            with torch.cuda.stream(self.stream):
                nv12_to_bgr(output.view(height * 3 // 2, width), height, width, self.colour,
                            out=bgr)
            self._written_on_own_stream(bgr)
            return bgr
        except Exception as exc:  # noqa: BLE001 - a CUDA error while converting
            raise GpuDecodeFailed(f"converting NVDEC's frame failed ({error_text(exc)})") from exc

    def partials_for(self, nbytes: int) -> frames.PartialSums:
        """Where NvdecFrame.write_into's kernel leaves its partial sums: made once (a source's
        frames keep their size: `_convert`), reused for every frame (the ring fetches them
        before it asks for the next)."""
        from facecast.models import triton_kernels

        if self._partials is None:
            # From the default stream's blocks (Note [NV12 to BGR into memory of the process's
            # own]): the ring's stream would hold a block of its own for these few bytes.
            with torch.cuda.stream(torch.cuda.default_stream(self.device)):
                self._partials = frames.PartialSums(
                    triton_kernels.nv12_slot_partial_count(nbytes), self.device)
        return self._partials

    def _new_frame(self, height: int, width: int) -> torch.Tensor:
        """Memory for a BGR frame, from the thread's current stream's blocks (Note [NV12 to
        BGR into memory of the process's own]); a seam of tests/test_decoding.py."""
        return torch.empty((height, width, 3), dtype=torch.uint8, device=self.device)

    def _written_on_own_stream(self, frame: torch.Tensor) -> None:
        """The frame's memory is not handed out again before the camera's stream is done."""
        frame.record_stream(self.stream)

    def _output_at(self, pointer: int, size_bytes: int) -> torch.Tensor:
        """NVDEC's output buffer as a flat uint8 tensor (no copy); a seam of
        tests/test_decoding.py, as GpuDecodedSource's device seams. The decoder hands out the
        same few buffers over and over: each one's tensor is made once (44 us of CPU a frame
        otherwise, 2026-11-28), for as long as this decoder lives."""
        from facecast.shared.transport import cuda_driver

        output = self._outputs.get(pointer)
        if output is None or output.numel() != size_bytes:
            if len(self._outputs) >= MAX_OUTPUT_TENSORS:  # a decoder that never repeats one
                self._outputs.clear()
            output = self._outputs[pointer] = cuda_driver.tensor_at(pointer, size_bytes,
                                                                    self.device_index)
        return output

    def _new_decoder(self) -> NvdecDecoder:
        """A decoder for the reader's codec on the camera's stream (the last one's buffers
        forgotten)."""
        self._outputs.clear()
        return NvdecDecoder(self.reader.codec, self.device_index, self.stream, self.low_latency,
                            self.nvdec_rgb)

    def close(self) -> None:
        self._ready.clear()
        self._outputs.clear()
        super().close()

    def close_at_exit(self) -> None:
        """Note [Decoders left to the process's end]."""
        if self.decoder is not None:
            _LEFT_TO_THE_EXIT.append(self.decoder)
            self.decoder = None
        self.close()


class NvdecFileSource(FilePlayback, NvdecSource):
    """A video file, looped and paced at its native fps, as sources.FileSource, decoded on the
    GPU."""

    def __init__(self, camera: CameraConfig, request: DecodeRequest,
                 path: Path | None = None) -> None:
        super().__init__(camera, request)
        self.path = path if path is not None else video_file_path(camera)
        try:
            first = self._start(self._open_file(), keyframe_deadline_s=math.inf)
        except BaseException:
            self.close()
            raise
        self._ready.appendleft((first, self._first_read_ts))
        self._play()

    def _read_frame(self) -> tuple[DecodedFrame, float]:
        self._pacer.wait()
        while not self._ready:
            packet = self.reader.read()
            if packet is None:
                self._start_again()
                continue
            data, _, read_ts = packet
            self._decode_into_ready(data, read_ts)
        # A file is played, not read as it comes: its frame is captured when the pacer hands
        # it out, as FileSource's grab stamps it (frames a decode gives together would share
        # their packet's read time).
        return self._ready.popleft()[0], pylsl.local_clock()

    def _start_again(self) -> None:
        """The file's end: it starts again from a fresh open, as FileSource's. Without B-frames
        the decoder holds nothing and takes the file's first keyframe (its parameter sets in
        front) as any keyframe of a stream. With B-frames it holds the file's last frames: where
        the file starts with an IDR picture they come out as the next round's arrives, else the
        end of the stream gets them out and a new decoder takes the file again (Note [A looped
        file on one decoder])."""
        if not self.low_latency and not self.starts_clean:
            # Converted now: the decoder's buffers go with it.
            self._decode_into_ready(b"", pylsl.local_clock(), defer=False)
            self.decoder.close()
            self.decoder = None
            try:
                self.decoder = self._new_decoder()
            except Exception as exc:  # noqa: BLE001 - no decoder for the file's next round
                raise GpuDecodeFailed(f"NVDEC could not make a decoder again at the file's end "
                                      f"({error_text(exc)})") from exc
        self._open_next_round()


class NvdecStreamSource(StreamPlayback, NvdecSource):
    """An RTSP or HTTP stream of H.264/H.265, demuxed by PyAV, decoded on the GPU; frames as fast
    as they come, as sources.StreamSource."""

    def __init__(self, camera: CameraConfig, request: DecodeRequest, *,
                 open_timeout_s: float = 10.0, read_timeout_s: float = 5.0) -> None:
        super().__init__(camera, request)
        self.url = str(camera.source)
        self.read_timeout_s = read_timeout_s
        started_monotonic = time.monotonic()
        try:
            reader = PacketReader(self.url, stream=True, open_timeout_s=open_timeout_s,
                                  read_timeout_s=read_timeout_s)
        except READ_ERRORS:
            self.close()
            raise self._lost(_why_no_stream(self.url, open_timeout_s,
                                            time.monotonic() - started_monotonic)) from None
        try:
            first = self._start(reader, keyframe_deadline_s=open_timeout_s)
        except BaseException:
            self.close()
            raise
        self._ready.appendleft((first, self._first_read_ts))
        self._play()

    def _read_frame(self) -> tuple[DecodedFrame, float]:
        while not self._ready:
            data, _, read_ts = self._next_packet_or_ended()
            self._decode_into_ready(data, read_ts)
        return self._ready.popleft()


class NvdecEncodedSyntheticSource(EncodedLoopPlayback, NvdecSource):
    """"synthetic-h264" decoded on the GPU (EncodedLoopPlayback)."""

    kind = "synthetic-h264"
    low_latency_always = True  # encoded without B-frames

    def __init__(self, camera: CameraConfig, request: DecodeRequest) -> None:
        super().__init__(camera, request)
        self._encode_loop()
        try:
            self._start(self._open_loop(), keyframe_deadline_s=math.inf)  # file frame 0
            if self.frames_decoded != self._pts:
                raise GpuDecodeUnavailable(
                    f"NVDEC gave {self.frames_decoded} frames for the encoded loop's first "
                    f"{self._pts} packets (one a packet expected)")
        except BaseException:
            self.close()
            raise
        self._ready.clear()  # frames are taken by capture time, not in order (read)
        self._play(next_position=self._pts)  # the loop's frames decoded at open

    def _read_frame(self) -> tuple[DecodedFrame, float]:
        capture_ts_lsl, position = self._next_capture()
        # A late reader's frames are decoded, not converted; the file's end is its frame 0.
        while self._next_position % self.encoded.frame_count != position:
            self._decode_next()
        return self._convert(self._decode_next()), capture_ts_lsl

    def _decode_next(self) -> int:
        """The next file frame's NV12 buffer (one packet, one frame: no B-frames)."""
        position = self._next_position % self.encoded.frame_count
        data, _, read_ts = self._next_loop_packet()
        pointers = self._decode(data, read_ts)
        if len(pointers) != 1:
            raise GpuDecodeFailed(f"NVDEC gave {len(pointers)} frames for file frame "
                                  f"{position} of the encoded loop (one expected)")
        return pointers[0]


class _MjpegFound(Exception):
    """A file's or stream's video is MJPEG: nvJPEG's (Note [nvJPEG path]), with its reader,
    which stays open so that an HTTP camera is not connected to twice."""

    def __init__(self, reader: PacketReader) -> None:
        super().__init__(reader.codec)
        self.reader = reader


def open_gpu_source(camera: CameraConfig, kind: str, request: DecodeRequest, *,
                    open_timeout_s: float, read_timeout_s: float) -> FrameSource:
    """The camera's source on the GPU decoder its codec needs (NVDEC, or nvJPEG for MJPEG:
    facecast.workers.capture.nvjpeg); GpuDecodeUnavailable (the CPU decoder takes it), or what
    the CPU source would raise for a source that cannot be reached at all."""
    if kind == "synthetic-h264":
        return NvdecEncodedSyntheticSource(camera, request)
    if kind == "synthetic-mjpeg":
        from facecast.workers.capture import nvjpeg

        return nvjpeg.open_jpeg_source(camera, kind, request)
    try:
        if kind == "stream":
            return NvdecStreamSource(camera, request, open_timeout_s=open_timeout_s,
                                     read_timeout_s=read_timeout_s)
        if kind == "file":
            return NvdecFileSource(camera, request)
    except _MjpegFound as found:
        from facecast.workers.capture import nvjpeg

        return nvjpeg.open_jpeg_source(camera, kind, request, found.reader,
                                       read_timeout_s=read_timeout_s)
    raise GpuDecodeUnavailable(f"a {kind} source is not decoded on the GPU")
