"""Which decoder a camera's compressed video gets, and why: NVDEC (H.264/H.265) or nvJPEG through
nvImageCodec (MJPEG) on the GPU, or OpenCV/FFmpeg on the CPU.

Runs in the capture worker (and `facecast doctor` asks the same questions). The decisions here
are pure functions of the config, the source's kind and what this process can see, so that every
reason can be tested on any machine; the GPU decoders themselves (facecast.workers.capture.nvdec,
.nvjpeg) are imported only where they are tried, and nothing here imports torch, PyNvVideoCodec
or nvImageCodec before a GPU is known to be in play (tests/test_import_weight.py: a CPU capture
worker never loads torch).

Note [Decoder choice]
    `decode = "auto" | "gpu" | "cpu"` (daemon.decode, overridable per camera). A camera gets one
    `DecodeChoice` each time its source opens: a decoder ("gpu": NVDEC through PyNvVideoCodec
    for H.264/H.265, nvJPEG through nvImageCodec for MJPEG (Note [nvJPEG path]), frames written
    into the camera's GPU ring without a host copy; "cpu": OpenCV's FFMPEG
    backend, today's path; "none": a synthetic source's raw frames) and the reason, which the
    capture worker logs, puts on the Markers stream (a `decoder` event when it changes), hands
    to status, and names in its heartbeat's trouble when the GPU was asked for and not given.
    In order, `plan` decides:
    - raw frames ("synthetic", "synthetic-replay"): "none", nothing to decode;
    - decode = "cpu": the CPU, as asked;
    - what the GPU path does not take (a V4L2 camera: OpenCV's V4L2 backend decodes its MJPEG
      and hands over BGR; Note [nvJPEG path] says why its JPEG bytes are not taken yet): the
      CPU, saying so;
    - a GPU decoder that failed mid-stream on this camera: the CPU for the rest of this capture
      worker's life (Note [GPU decoder failing mid-stream]);
    - a capture worker on the CPU (no GPU, or models.device = "cpu"): the CPU, since frames go
      to a shared-memory ring there and a GPU decode would be copied straight back;
    - no GPU decoder for it here: "synthetic-mjpeg" asks `nvjpeg_unavailable_reason` (no CUDA
      device, nvidia-nvimgcodec-cu13 not installed or not loadable), "synthetic-h264"
      `nvdec_unavailable_reason` (no CUDA device, pynvvideocodec not installed or not
      loadable, no libnvcuvid.so.1 in the driver); a file or stream, whose codec is known only
      once it is open, goes to the CPU only when neither can be used (both reasons said), and
      its open turns it to the CPU with the reason of the one its codec needs;
    - otherwise the GPU decoder is tried, and its open decides (nvdec.open_gpu_source): the
      stream's codec (H.264 and H.265 on NVDEC, MJPEG on nvJPEG), its pixel format (8-bit
      4:2:0 only, which NVDEC hands over as NV12), and the decoder's creation, which happens at
      its first frame (NVDEC engines or memory exhausted, a profile the GPU does not support;
      for MJPEG, neither nvImageCodec's hardware backend nor its default one decoding the first
      JPEG) each turn the camera to the CPU decoder with the reason (`GpuDecodeUnavailable`).
      A source that cannot be reached at all (a peer down, no such file) is lost as before,
      whatever the decoder.
    decode = "gpu" differs from "auto" only in what it says: a camera that asked for the GPU
    and got the CPU is the capture worker's trouble in status, and config validation refuses
    it for a source that can never be decoded on the GPU (config.gpu_decode_source_problem).
    Nothing is ever refused at run time for the decoder: the CPU one always stays.

Note [GPU decoder failing mid-stream]
    An exception from NVDEC, nvImageCodec (or a JPEG it gives no image for) or the conversion
    after a camera's first frame is a
    `GpuDecodeFailed`: the camera's thread closes its GPU source, says so (a warning, a
    `decoder_fallback` event, status), and opens the source again at once with the CPU decoder,
    without the reconnect backoff of a lost camera; the group's other cameras never see it
    (each camera has its own thread and source). The camera stays on the CPU until its capture
    worker restarts: a decoder that failed once may fail again, and a camera that flaps between
    decoders would show its frames' colours and timing change for no visible reason. A fault
    that breaks the CUDA context itself (an illegal address) is not a decoder's to contain: it
    ends the worker, which the supervisor restarts. Tests inject a failure with
    `FACECAST_INJECT_DECODER_FAILURE=<camera>@<frames>` (with FACECAST_ALLOW_FAULT_INJECTION=1,
    Note [Fault injection]).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

DECODE_MODES = ("auto", "gpu", "cpu")
# What the GPU path decodes: FFmpeg's codec name -> how status names it.
GPU_CODECS = {"h264": "H.264", "hevc": "H.265"}
# 8-bit 4:2:0, which NVDEC hands over as NV12 (the only layout nvdec.nv12_to_bgr converts).
GPU_PIXEL_FORMATS = ("yuv420p", "yuvj420p")
RAW_SOURCES = ("synthetic", "synthetic-replay")
JPEG_CODECS = {"mjpeg": "MJPEG"}  # what nvJPEG decodes (facecast.workers.capture.nvjpeg)
CPU_ONLY_SOURCES = RAW_SOURCES + ("v4l2",)  # what the GPU path does not take
NVIMGCODEC_MODULE = "nvidia.nvimgcodec"  # the wheel nvidia-nvimgcodec-cu13 (facecast[gpu])

INJECT_FAILURE_ENV = "FACECAST_INJECT_DECODER_FAILURE"  # Note [GPU decoder failing mid-stream]
ALLOW_FAULTS_ENV = "FACECAST_ALLOW_FAULT_INJECTION"  # the same switch as Note [Fault injection]


class GpuDecodeUnavailable(Exception):
    """The GPU decoder cannot take this camera (found at open): the CPU decoder does, with
    `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GpuDecodeFailed(Exception):
    """The camera's GPU decoder failed after its first frame (Note [GPU decoder failing
    mid-stream]); `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    """The decoder a camera's frames come from, and why (Note [Decoder choice])."""

    decoder: str  # "gpu" (NVDEC or nvJPEG), "cpu" (OpenCV/FFmpeg), "none" (raw frames)
    reason: str

    def describe(self) -> str:
        return f"{self.decoder} ({self.reason})"


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """What a camera's capture thread asks `plan` for."""

    requested: str = "cpu"  # the camera's decode setting: "auto", "gpu" or "cpu"
    device: str = "cpu"  # where its capture worker runs: "cpu" or "cuda:<index>"
    gpu_failed: str = ""  # why its GPU decoder failed mid-stream, if it did

    @property
    def device_index(self) -> int:
        return int(self.device.partition(":")[2] or 0)

    def asked(self) -> str:
        return f'decode = "{self.requested}"'


def may_use_nvdec(requested: str, source_kind: str) -> bool:
    """Whether a camera of this decode setting and source may be decoded by NVDEC, from the
    config alone (its codec is known at open): Note [NVDEC path warmed while standing by]."""
    return (requested != "cpu" and source_kind not in CPU_ONLY_SOURCES
            and source_kind != "synthetic-mjpeg")


def plan(request: DecodeRequest, source_kind: str,
         nvdec_reason=lambda: nvdec_unavailable_reason(),
         nvjpeg_reason=lambda: nvjpeg_unavailable_reason()) -> DecodeChoice | None:
    """The decoder of Note [Decoder choice], or None: try the GPU (its open decides the rest).
    `nvdec_reason()` and `nvjpeg_reason()` are asked last, and only on a GPU worker (they
    import torch)."""
    if request.requested not in DECODE_MODES:
        raise ValueError(f"decode {request.requested!r} is not one of {', '.join(DECODE_MODES)}")
    if source_kind in RAW_SOURCES:
        return DecodeChoice("none", f"source {source_kind!r} makes raw frames: nothing to decode")
    if request.requested == "cpu":
        return DecodeChoice("cpu", 'decode = "cpu"')
    if source_kind == "v4l2":
        return DecodeChoice("cpu", "a V4L2 camera: OpenCV decodes its frames on the CPU; its "
                            "MJPEG is not handed to the GPU yet (Note [nvJPEG path])")
    if request.gpu_failed:
        return DecodeChoice("cpu", f"its GPU decoder failed mid-stream ({request.gpu_failed}); "
                            "on the CPU decoder until its capture worker restarts")
    if not request.device.startswith("cuda"):
        return DecodeChoice("cpu", f"{request.asked()}, but its capture worker runs on the CPU "
                            "(no GPU here, or models.device = \"cpu\"): its frames go through "
                            "shared memory, so the CPU decodes them")
    if source_kind == "synthetic-mjpeg":
        reason = nvjpeg_reason()
    elif source_kind == "synthetic-h264":
        reason = nvdec_reason()
    else:  # a file or a stream: its codec is known at open (nvdec.open_gpu_source)
        reason = nvdec_reason()
        if reason:
            jpeg_reason = nvjpeg_reason()
            if not jpeg_reason:
                return None  # MJPEG would be decoded on the GPU; H.264 is told why not at open
            if jpeg_reason != reason:
                reason = f"{reason} (and for MJPEG, {jpeg_reason})"
    if reason:
        return DecodeChoice("cpu", f"{request.asked()}, but {reason}")
    return None


def is_trouble(request: DecodeRequest, choice: DecodeChoice, source_kind: str) -> bool:
    """Whether a camera's decoder is its capture worker's trouble (status's detail line): the
    GPU decoder failed mid-stream, or the GPU was asked for a source it can decode and the CPU
    decodes (daemon.decode = "gpu" does not make a USB camera's MJPEG trouble)."""
    if choice.decoder != "cpu":
        return False
    if request.gpu_failed:
        return True
    return request.requested == "gpu" and source_kind not in CPU_ONLY_SOURCES


@functools.lru_cache(maxsize=1)
def nvdec_unavailable_reason() -> str | None:
    """Why NVDEC cannot decode in this process (None: it may; the decoder's creation still
    decides). Imports torch (and PyNvVideoCodec, whose import loads the driver's encode library:
    it raises RuntimeError, not ImportError, on a machine without it); asked once per process."""
    from facecast.shared.transport.cuda_driver import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        return reason
    if importlib.util.find_spec("PyNvVideoCodec") is None:
        return "pynvvideocodec is not installed (pip install 'facecast[gpu]')"
    try:
        import PyNvVideoCodec  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - its import raises RuntimeError with a long guide
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"PyNvVideoCodec cannot be loaded ({first_line})"
    import ctypes

    try:
        ctypes.CDLL("libnvcuvid.so.1")
    except OSError as exc:
        return (f"the NVIDIA driver's NVDEC library cannot be loaded ({exc}; in a container, "
                "the driver capability 'video' is needed)")
    return None


@functools.lru_cache(maxsize=1)
def nvjpeg_unavailable_reason() -> str | None:
    """Why nvImageCodec cannot decode JPEGs on the GPU in this process (None: it may; the
    decoder's creation and the first JPEG still decide, Note [nvJPEG path]). Imports torch (and
    nvImageCodec, which loads its own nvJPEG and CUDA runtime from the wheel); asked once per
    process."""
    from facecast.shared.transport.cuda_driver import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        return reason
    try:
        found = importlib.util.find_spec(NVIMGCODEC_MODULE)
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        found = None
    if found is None:
        return "nvidia-nvimgcodec-cu13 is not installed (pip install 'facecast[gpu]')"
    try:
        importlib.import_module(NVIMGCODEC_MODULE)
    except Exception as exc:  # noqa: BLE001 - a missing libcuda or CUDA runtime: say which
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"nvImageCodec cannot be loaded ({first_line})"
    return None


def injected_failure_after(camera_id: str) -> int | None:
    """Frames after which this camera's GPU decoder fails on purpose (Note [GPU decoder failing
    mid-stream]), or None: `FACECAST_INJECT_DECODER_FAILURE=<camera>@<frames>[,...]`, honoured
    only with FACECAST_ALLOW_FAULT_INJECTION=1."""
    if os.environ.get(ALLOW_FAULTS_ENV) != "1":
        return None
    for item in os.environ.get(INJECT_FAILURE_ENV, "").split(","):
        name, _, frames = item.strip().partition("@")
        if name == camera_id:
            try:
                return max(0, int(frames or 0))
            except ValueError:
                log.warning("%s: %r is not <camera>@<frames>; ignored", INJECT_FAILURE_ENV, item)
    return None
