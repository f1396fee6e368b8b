"""Which decoder a camera gets and why (Note [Decoder choice]), on any machine: every reason
for the CPU decoder that a machine without a GPU can produce, the config's decode keys, NV12 →
BGR against OpenCV's own decode (Note [NV12 to BGR]), the GPU path's demuxing, priming, pacing
and looping with NVDEC played on the CPU by FFmpeg (`CpuNvdec`: only the decoder call itself and
the device memory are stand-ins), a frame published from "device" memory onto an shm ring, and a
capture group whose GPU-decoded camera fails mid-stream and goes on on the CPU decoder while the
other camera keeps publishing (Note [GPU decoder failing mid-stream]), and a capture process of
H.264 cameras SIGKILLed, its cameras taken over by the warm spare with nothing corrupt.

The same checks against the real NVDEC are tests/test_nvdec_gpu.py (marker gpu)."""

from __future__ import annotations

import itertools
import math
import os
import queue
import signal
import sys
import time
import types

import cv2
import numpy as np
import pylsl
import pytest
import torch
import zmq

# facecast needs PyAV; a GPU host without the wheel (.whl2a/) skips these tests.
av = pytest.importorskip("av", reason="PyAV (the `av` wheel) demuxes and encodes the test videos")

from daemon_harness import (
    DETECTOR_SIZE_TOLERANCE,
    Daemon,
    Recorder,
    box_close,
    frames_of,
    score_against_truth,
)
from facecast.shared import config as config_mod
from facecast.shared.config import CameraConfig
from facecast.shared.transport import frames
from facecast.shared.transport.publisher import FramePublisher
from facecast.shared.transport.rings import ShmRingProducer, ShmRingReader, Verdict
from facecast.workers.capture import decoding, nvdec
from facecast.workers.capture import worker as capture_worker
from facecast.workers.capture.decoding import DecodeChoice, DecodeRequest, GpuDecodeFailed
from facecast.workers.capture.gpu_decoded import PacketReader
from facecast.workers.capture.nvdec import YuvToBgr, nv12_to_bgr
from facecast.workers.capture.sources import (
    EncodedSyntheticLoop,
    EncodedSyntheticSource,
    SyntheticReplay,
    SyntheticScene,
    open_source,
    synthetic_truth,
)

MIN_PSNR_DB = 40.0  # issue 22's bound for the GPU decoder against the CPU one


def _psnr_db(frame: np.ndarray, reference: np.ndarray) -> float:
    mse = np.mean((frame.astype(np.float64) - reference.astype(np.float64)) ** 2)
    return 10 * math.log10(255.0**2 / mse) if mse else math.inf


# --- the choice ------------------------------------------------------------------------------------

NO_NVDEC = "pynvvideocodec is not installed (pip install 'facecast[gpu]')"


@pytest.mark.parametrize("request_, kind, decoder, reason", [
    (DecodeRequest("gpu", "cuda:0"), "synthetic", "none", "makes raw frames: nothing to decode"),
    (DecodeRequest("auto", "cuda:0"), "synthetic-replay", "none", "makes raw frames"),
    (DecodeRequest("cpu", "cuda:0"), "file", "cpu", 'decode = "cpu"'),
    (DecodeRequest("auto", "cuda:0"), "v4l2", "cpu", "a V4L2 camera: OpenCV decodes"),
    (DecodeRequest("gpu", "cuda:0", gpu_failed="NVDEC failed on a packet (boom)"), "stream",
     "cpu", "its GPU decoder failed mid-stream (NVDEC failed on a packet (boom)); on the CPU "
     "decoder until its capture worker restarts"),
    (DecodeRequest("gpu", "cpu"), "synthetic-h264", "cpu",
     'decode = "gpu", but its capture worker runs on the CPU (no GPU here, or models.device = '
     '"cpu")'),
    (DecodeRequest("auto", "cuda:1"), "file", "cpu", f'decode = "auto", but {NO_NVDEC}'),
])
def test_every_reason_for_the_cpu_decoder_is_said(request_, kind, decoder, reason):
    choice = decoding.plan(request_, kind, nvdec_reason=lambda: NO_NVDEC,
                           nvjpeg_reason=lambda: "no nvImageCodec")  # MJPEG: test_mjpeg_decoding
    assert choice.decoder == decoder and reason in choice.reason, choice


def test_the_gpu_is_tried_only_where_it_can_be_and_nvdec_is_asked_last():
    asked = []

    def nvdec_reason():
        asked.append(True)
        return None

    assert decoding.plan(DecodeRequest("auto", "cuda:0"), "synthetic-h264", nvdec_reason) is None
    assert decoding.plan(DecodeRequest("gpu", "cuda:0"), "stream", nvdec_reason) is None
    assert len(asked) == 2
    # A CPU worker never asks (it would import torch: tests/test_import_weight.py).
    decoding.plan(DecodeRequest("auto", "cpu"), "file", nvdec_reason)
    assert len(asked) == 2
    with pytest.raises(ValueError, match="not one of auto, gpu, cpu"):
        decoding.plan(DecodeRequest("nvdec", "cuda:0"), "file", nvdec_reason)


@pytest.mark.parametrize("requested", decoding.DECODE_MODES)
@pytest.mark.parametrize("kind", ["file", "stream", "v4l2", "synthetic", "synthetic-replay",
                                  "synthetic-h264", "synthetic-mjpeg"])
def test_a_capture_worker_warms_nvdec_for_the_cameras_that_would_try_it(requested, kind):
    """Note [NVDEC path warmed while standing by]: from the config alone, the cameras whose
    open would try the GPU with NVDEC there and nvJPEG not (`plan` returns None) and no other."""
    tries_nvdec = decoding.plan(DecodeRequest(requested, "cuda:0"), kind,
                                nvdec_reason=lambda: None,
                                nvjpeg_reason=lambda: "no nvImageCodec") is None
    assert decoding.may_use_nvdec(requested, kind) == tries_nvdec


def test_trouble_is_the_gpu_asked_for_and_not_given_or_failed():
    cpu = DecodeChoice("cpu", "why")
    assert decoding.is_trouble(DecodeRequest("gpu", "cpu"), cpu, "synthetic-h264")
    assert decoding.is_trouble(DecodeRequest("auto", "cuda:0", gpu_failed="x"), cpu, "file")
    assert not decoding.is_trouble(DecodeRequest("auto", "cuda:0"), cpu, "file")
    # daemon.decode = "gpu" does not make a USB camera's or a raw source's decoder trouble.
    assert not decoding.is_trouble(DecodeRequest("gpu", "cuda:0"), cpu, "v4l2")
    assert not decoding.is_trouble(DecodeRequest("gpu", "cuda:0"),
                                   DecodeChoice("none", "raw"), "synthetic")
    assert not decoding.is_trouble(DecodeRequest("gpu", "cuda:0"),
                                   DecodeChoice("gpu", "NVDEC"), "file")


def test_nvdec_unavailable_reasons(monkeypatch):
    from facecast.shared.transport import cuda_driver

    decoding.nvdec_unavailable_reason.cache_clear()
    monkeypatch.setattr(cuda_driver, "cuda_unavailable_reason", lambda: "no CUDA here")
    assert decoding.nvdec_unavailable_reason() == "no CUDA here"

    decoding.nvdec_unavailable_reason.cache_clear()
    monkeypatch.setattr(cuda_driver, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(decoding.importlib.util, "find_spec", lambda name: None)
    assert decoding.nvdec_unavailable_reason() == NO_NVDEC

    # Installed but not loadable: its import raises RuntimeError without the driver.
    decoding.nvdec_unavailable_reason.cache_clear()
    monkeypatch.setattr(decoding.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)  # `import` raises ImportError
    reason = decoding.nvdec_unavailable_reason()
    assert reason.startswith("PyNvVideoCodec cannot be loaded ("), reason

    # Loadable, but the driver has no NVDEC library (this machine has no driver at all).
    decoding.nvdec_unavailable_reason.cache_clear()
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", types.ModuleType("PyNvVideoCodec"))
    reason = decoding.nvdec_unavailable_reason()
    if reason is not None:  # a machine with the driver has the library
        assert "libnvcuvid.so.1" in reason and "capability 'video'" in reason, reason
    decoding.nvdec_unavailable_reason.cache_clear()


def test_this_machine_without_a_gpu_says_why(monkeypatch):
    decoding.nvdec_unavailable_reason.cache_clear()
    try:
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        assert "no CUDA device is visible" in decoding.nvdec_unavailable_reason()
    finally:
        decoding.nvdec_unavailable_reason.cache_clear()


def test_injected_failures_need_fault_injection_allowed(monkeypatch):
    monkeypatch.setenv(decoding.INJECT_FAILURE_ENV, "cam0@30, cam1@5")
    monkeypatch.delenv(decoding.ALLOW_FAULTS_ENV, raising=False)
    assert decoding.injected_failure_after("cam0") is None
    monkeypatch.setenv(decoding.ALLOW_FAULTS_ENV, "1")
    assert decoding.injected_failure_after("cam0") == 30
    assert decoding.injected_failure_after("cam1") == 5
    assert decoding.injected_failure_after("cam2") is None


# --- the config ------------------------------------------------------------------------------------


def test_decode_is_inherited_and_overridden():
    loaded = config_mod.loads('[daemon]\ndecode = "cpu"\n'
                              '[[cameras]]\nid = "a"\nsource = "x.mp4"\n'
                              '[[cameras]]\nid = "b"\nsource = "rtsp://h/s"\ndecode = "gpu"\n')
    assert [loaded.decode_for(c) for c in loaded.cameras] == ["cpu", "gpu"]
    assert config_mod.loads('[[cameras]]\nid = "a"\nsource = "x.mp4"\n').daemon.decode == "auto"


@pytest.mark.parametrize("source, problem", [
    ("synthetic", "makes raw frames: there is nothing to decode"),
    ("synthetic-replay", "makes raw frames"),
    ("/dev/video0", "is a V4L2 camera, decoded by OpenCV on the CPU"),
    (0, "is a V4L2 camera"),
])
def test_decode_gpu_for_a_source_it_can_never_decode_is_a_config_error(source, problem):
    value = f'"{source}"' if isinstance(source, str) else source
    with pytest.raises(config_mod.ConfigError) as caught:
        config_mod.loads(f'[[cameras]]\nid = "cam"\nsource = {value}\ndecode = "gpu"\n')
    text = str(caught.value)
    assert "cameras[0].decode: camera 'cam' asks for decode = \"gpu\", but" in text, text
    assert problem in text and "allowed for H.264/H.265 and MJPEG video" in text, text
    # daemon.decode = "gpu" is for every camera the GPU can take: not an error.
    config_mod.loads(f'[daemon]\ndecode = "gpu"\n[[cameras]]\nid = "cam"\nsource = {value}\n')


def test_a_bad_decode_value_names_the_key_and_the_allowed():
    with pytest.raises(config_mod.ConfigError) as caught:
        config_mod.loads('[daemon]\ndecode = "nvdec"\n'
                         '[[cameras]]\nid = "a"\nsource = "x.mp4"\ndecode = "GPU"\n')
    text = str(caught.value)
    assert "2 problems" in text
    assert "daemon.decode: Invalid enum value 'nvdec' (allowed: 'auto', 'gpu', 'cpu'" in text
    assert "cameras[0].decode: Invalid enum value 'GPU' (allowed: 'auto', 'gpu', 'cpu', ''" in text


# --- opening on the CPU, with the reason -----------------------------------------------------------


def _camera(source: str = "synthetic-h264", **fields) -> CameraConfig:
    return CameraConfig(id="dec0", source=source, **{"width": 320, "height": 240, "fps": 20.0,
                                                     **fields})


def test_a_cpu_worker_asking_for_the_gpu_opens_on_the_cpu_with_the_reason():
    with open_source(_camera(), decode=DecodeRequest("gpu", "cpu")) as opened:
        assert isinstance(opened, EncodedSyntheticSource) and not opened.on_device
        assert opened.decode.decoder == "cpu"
        assert "its capture worker runs on the CPU" in opened.decode.reason
        frame, _ = opened.read()
        assert frame.shape == (240, 320, 3)
    with open_source(_camera("synthetic")) as opened:
        assert opened.decode.decoder == "none"


def test_a_gpu_worker_without_nvdec_opens_on_the_cpu_with_the_reason(monkeypatch):
    monkeypatch.setattr(decoding, "nvdec_unavailable_reason", lambda: NO_NVDEC)
    with open_source(_camera(), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert opened.decode == DecodeChoice("cpu", f'decode = "gpu", but {NO_NVDEC}')


# --- NV12 → BGR against OpenCV (Note [NV12 to BGR]) -------------------------------------------------


def _nv12_of(frame: av.VideoFrame) -> torch.Tensor:
    """A decoded 4:2:0 frame's planes as NV12 (no conversion: swscale would change a full-range
    frame's range on the way to nv12)."""
    planes = frame.to_ndarray()  # yuv420p / yuvj420p: Y, then U, then V, planar
    height, width = frame.height, frame.width
    u = planes[height:height + height // 4].reshape(height // 2, width // 2)
    v = planes[height + height // 4:].reshape(height // 2, width // 2)
    chroma = np.stack([u, v], axis=-1).reshape(height // 2, width)
    return torch.from_numpy(np.concatenate([planes[:height], chroma]))


def _write_bt709_file(path, size=(320, 240), frames=3) -> str:
    scene = SyntheticScene(*size)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=20, options={
            "x264-params": "colormatrix=bt709:colorprim=bt709:transfer=bt709:bframes=0"})
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(scene.render(index / 20), format="bgr24")
            frame.pts = index
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return str(path)


@pytest.mark.parametrize("what", ["synthetic-h264", "synthetic-mjpeg", "bt709"])
def test_nv12_to_bgr_matches_the_cpu_decoder(what, tmp_path):
    if what == "bt709":
        path, encoded = _write_bt709_file(tmp_path / "bt709.mp4"), None
    else:
        encoded = EncodedSyntheticLoop(SyntheticReplay.for_camera(_camera(what)),
                                       what.removeprefix("synthetic-"))
        path = str(encoded.path)
    try:
        capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
        with av.open(path) as container:
            stream = container.streams.video[0]
            context = stream.codec_context
            colour = YuvToBgr.of(context.colorspace, context.color_range, context.pix_fmt)
            assert colour == {"synthetic-h264": YuvToBgr("bt601", False),
                              "synthetic-mjpeg": YuvToBgr("bt601", True),
                              "bt709": YuvToBgr("bt709", False)}[what]
            for index, frame in enumerate(container.decode(stream)):
                ok, reference = capture.read()
                assert ok
                bgr = nv12_to_bgr(_nv12_of(frame), frame.height, frame.width, colour)
                assert bgr.shape == (frame.height, frame.width, 3) and bgr.dtype == torch.uint8
                psnr_db = _psnr_db(bgr.numpy(), reference)
                assert psnr_db >= 45.0, (what, index, psnr_db)  # 45.5-49.3 measured
                if index == 4:
                    break
        capture.release()
    finally:
        if encoded is not None:
            encoded.close()


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("full_range", [False, True])
def test_nv12_to_bgr_is_the_colour_formula_rounded(matrix, full_range):
    """Every value is the BT.601/709 formula (Note [NV12 to BGR]), evaluated in float64,
    rounded: within half a grey level of it everywhere, and its round-half-up but for float32's
    ties."""
    colour = YuvToBgr(matrix, full_range)
    height, width = 120, 160
    nv12 = torch.randint(0, 256, (height * 3 // 2, width), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(7))
    y_offset, y_scale, b_u, g_u, g_v, r_v, chroma_scale = colour.coefficients()
    planes = nv12.numpy().astype(np.float64)
    luma = (planes[:height] - y_offset) * y_scale
    chroma = (planes[height:].reshape(height // 2, width // 2, 2) - 128.0) * chroma_scale
    u, v = (chroma[..., k].repeat(2, axis=0).repeat(2, axis=1) for k in (0, 1))
    exact = np.clip(np.stack((luma + b_u * u, luma + g_u * u + g_v * v, luma + r_v * v), -1), 0, 255)
    bgr = nv12_to_bgr(nv12, height, width, colour).numpy().astype(np.float64)
    assert np.abs(bgr - exact).max() <= 0.5 + 1e-4
    assert np.mean(bgr == np.floor(exact + 0.5)) >= 0.9999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("full_range", [False, True])
def test_nv12_to_bgr_on_the_gpu_is_one_kernel_with_the_cpus_bytes(matrix, full_range, caplog):
    """On CUDA the conversion is one fused kernel (Note [NV12 to BGR]): the bytes of PyTorch's
    kernels on the same device and of the CPU's form, but for a grey level at float32's ties;
    where the fused kernel cannot run, PyTorch's kernels convert, and the reason is logged once."""
    colour = YuvToBgr(matrix, full_range)
    height, width = 1080, 1920
    nv12 = torch.randint(0, 256, (height * 3 // 2, width), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(11))
    on_gpu = nv12.cuda()
    nv12_to_bgr(on_gpu, height, width, colour)  # compiles it, and makes its channel numbers
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fused = nv12_to_bgr(on_gpu, height, width, colour)
        torch.cuda.synchronize()
    assert nvdec._fused_failed is None
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
    assert fused.shape == (height, width, 3) and fused.dtype == torch.uint8 and fused.is_cuda
    by_torch = nvdec.converted_by_torch(on_gpu, height, width, colour).cpu()
    on_cpu = nv12_to_bgr(nv12, height, width, colour)
    for other in (by_torch, on_cpu):
        difference = (fused.cpu().int() - other.int()).abs()
        assert difference.max() <= 1 and (difference > 0).sum() <= 2_000, int(
            (difference > 0).sum())
    # Into given memory (Note [NV12 to BGR into memory of the process's own]): Triton's kernel,
    # PyTorch's form's bytes but at float32's ties.
    from facecast.models import triton_kernels

    into = torch.empty_like(on_gpu.new_empty(height, width, 3))
    assert nv12_to_bgr(on_gpu, height, width, colour, out=into) is into
    assert triton_kernels.unavailable_reason(on_gpu.device, "facecast_nv12_to_bgr") is None
    difference = (into.cpu().int() - by_torch.int()).abs()
    assert difference.max() <= 1 and (difference > 0).sum() <= 2_000, int((difference > 0).sum())

    def broken(colour):
        raise RuntimeError("nvrtc: no such thing")

    original = nvdec._fused_kernel
    try:
        nvdec._fused_kernel = broken
        with caplog.at_level("WARNING", logger=nvdec.log.name):
            again = [nv12_to_bgr(on_gpu, height, width, colour).cpu() for _ in range(2)]
        assert all(torch.equal(frame, by_torch) for frame in again)
        assert nvdec._fused_failed == "RuntimeError: nvrtc: no such thing"
        warnings = [r.getMessage() for r in caplog.records if "fused kernel failed" in r.getMessage()]
        assert len(warnings) == 1, warnings
    finally:
        nvdec._fused_kernel, nvdec._fused_failed = original, None


def test_nv12_needs_an_even_size():
    with pytest.raises(ValueError, match="even width and height, got 3x2"):
        nv12_to_bgr(torch.zeros(3, 3, dtype=torch.uint8), 2, 3, YuvToBgr("bt601", False))


# --- the GPU path with NVDEC played on the CPU -------------------------------------------------------


class CpuNvdec:
    """A stand-in for nvdec.NvdecDecoder: FFmpeg (PyAV) decodes the Annex B packets the source
    feeds it, and its NV12 frames are kept by a made-up pointer. What it proves about the real
    path: the packets (filtered, parameter sets in front of keyframes) decode on their own, and
    the source's priming, pacing, positions, looping and stamping hold. With `rgb` its output
    is RGB, as NVDEC's converter gives it for studio-range streams (FFmpeg's conversion here).
    """

    buffers: dict[int, np.ndarray] = {}
    _pointers = itertools.count(1)
    made: list[CpuNvdec] = []

    def __init__(self, codec, device_index, stream, low_latency, rgb=False) -> None:
        self.context = av.CodecContext.create(codec, "r")
        self.context.thread_count = 1  # no frame threading: a packet's frame comes out at once
        self.low_latency = low_latency
        self.rgb = rgb
        self.size = (0, 0)
        self.packets: list[tuple[int, int]] = []
        self.ended = False
        self.closed = False
        CpuNvdec.made.append(self)

    def decode(self, data: bytes, pts: int) -> list[int]:
        assert not self.ended, "a packet after the end of the stream"
        self.packets.append((len(data), pts))
        self.ended = not data
        pointers = []
        for frame in self.context.decode(av.Packet(data) if data else None):
            pointer = next(self._pointers)
            CpuNvdec.buffers[pointer] = (frame.to_ndarray(format="rgb24") if self.rgb
                                         else _nv12_of(frame).numpy())
            self.size = (frame.width, frame.height)
            pointers.append(pointer)
        return pointers

    def frame_size(self) -> tuple[int, int]:
        return self.size

    def pixel_format(self) -> str:
        return "NV12"

    def close(self) -> None:
        self.closed = True


class _NoStream:
    def synchronize(self) -> None:
        pass


def _cpu_output_at(self, pointer: int, size_bytes: int) -> torch.Tensor:
    """`CpuNvdec`'s buffer where the sources read NVDEC's, as flat as theirs."""
    output = torch.from_numpy(CpuNvdec.buffers.pop(pointer)).reshape(-1)
    assert output.numel() == size_bytes, (output.numel(), size_bytes)
    return output


@pytest.fixture
def cpu_nvdec(monkeypatch):
    """The GPU path as it is, with `CpuNvdec` for NVDEC and host memory for the device's."""
    CpuNvdec.made.clear()
    monkeypatch.setattr(nvdec, "NvdecDecoder", CpuNvdec)
    monkeypatch.setattr(nvdec.NvdecSource, "_new_stream", lambda self: _NoStream())
    monkeypatch.setattr(nvdec.NvdecSource, "_output_at", _cpu_output_at)
    monkeypatch.setattr(nvdec.NvdecSource, "_hand_over", lambda self: None)
    monkeypatch.setattr(nvdec.NvdecSource, "_new_frame",
                        lambda self, height, width: torch.empty(height, width, 3, dtype=torch.uint8))
    monkeypatch.setattr(nvdec.NvdecSource, "_written_on_own_stream", lambda self, frame: None)
    monkeypatch.setattr(decoding, "nvdec_unavailable_reason", lambda: None)
    yield CpuNvdec
    CpuNvdec.buffers.clear()


def _write_video(path, codec="libx264", container=None, frames=40, fps=100, size=(320, 240),
                 bframes=0, pix_fmt="yuv420p") -> str:
    scene = SyntheticScene(*size)
    params = {"libx264": "x264-params", "libx265": "x265-params"}.get(codec)
    options = ({params: f"bframes={bframes}:keyint=20:min-keyint=20"
                + (":log-level=error" if codec == "libx265" else "")} if params else {})
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps, options=options)
        stream.width, stream.height = size
        stream.pix_fmt = pix_fmt
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(scene.render(index / 20), format="bgr24")
            frame.pts = index
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return str(path)


def _opencv_frames(path: str) -> list[np.ndarray]:
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    decoded = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        decoded.append(frame)
    capture.release()
    return decoded


@pytest.mark.parametrize("name, codec, container, bframes", [
    ("h264.mp4", "libx264", None, 0),
    ("raw.h264", "libx264", "h264", 0),  # Annex B already: what SimpleDecoder failed on
    ("h265.mp4", "libx265", None, 0),
    ("raw.hevc", "libx265", "hevc", 0),
    ("bframes.mkv", "libx264", None, 3),
])
def test_the_gpu_paths_file_frames_match_the_cpu_decoder(cpu_nvdec, tmp_path, name, codec,
                                                          container, bframes):
    path = _write_video(tmp_path / name, codec, container, bframes=bframes)
    references = _opencv_frames(path)
    camera = _camera(path)
    with open_source(camera, decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert isinstance(opened, nvdec.NvdecFileSource) and opened.on_device
        assert opened.decode.decoder == "gpu"
        expected = {"libx264": "H.264", "libx265": "H.265"}[codec]
        assert opened.decode.reason.startswith(f'decode = "gpu": {expected} '), opened.decode
        assert cpu_nvdec.made[-1].low_latency == (bframes == 0)
        stamps = []
        # Through the file's end and round again (a fresh open; with B-frames the frames the
        # decoder held come out as the next round's IDR picture arrives: Note [A looped file on
        # one decoder]).
        for index in range(len(references) + 10):
            frame, capture_ts_lsl = opened.read()
            stamps.append(capture_ts_lsl)
            reference = references[index % len(references)]
            assert frame.shape == reference.shape and frame.dtype == torch.uint8
            assert _psnr_db(frame.numpy(), reference) >= MIN_PSNR_DB, (name, index)
        assert opened.loops == 1
        assert np.all(np.diff(stamps) > 0), "capture times must increase"
        assert opened.starts_clean  # x264's and x265's files start with an IDR picture
        assert len(cpu_nvdec.made) == 1 and not cpu_nvdec.made[0].ended


def test_a_looped_file_that_starts_with_an_open_gop_gets_a_new_decoder_each_round(cpu_nvdec, tmp_path,
                                                                                  monkeypatch):
    """Note [A looped file on one decoder]: where the first picture is not an IDR one (a CRA
    whose leading pictures refer to the round before), the round ends its stream: the held
    frames come out, and a new decoder takes the next round; every frame in order."""
    path = _write_video(tmp_path / "open_gop.mkv", bframes=3, frames=30)
    references = _opencv_frames(path)
    monkeypatch.setattr(nvdec, "starts_with_idr", lambda codec, data: False)
    with open_source(_camera(path), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert not opened.starts_clean and not opened.low_latency
        for index in range(2 * len(references) + 5):
            frame, _ = opened.read()
            assert _psnr_db(frame.numpy(), references[index % len(references)]) >= MIN_PSNR_DB, index
        assert opened.loops == 2
    assert len(cpu_nvdec.made) == 3 and all(made.ended for made in cpu_nvdec.made[:2])


def test_at_the_process_stop_a_decoder_is_left_to_the_exit_and_otherwise_destroyed(cpu_nvdec, tmp_path,
                                                                                   monkeypatch):
    """Note [Decoders left to the process's end]: closing a camera because the worker stops
    leaves its NVDEC decoder to the process's exit (destroying one holds the GIL ~200 ms);
    closing it for any other reason (a fallback, a reopen) destroys it, freeing the session."""
    monkeypatch.setattr(nvdec, "_LEFT_TO_THE_EXIT", [])
    path = _write_video(tmp_path / "clip.mp4", frames=6)
    with open_source(_camera(path), decode=DecodeRequest("gpu", "cuda:0")) as reopened:
        reopened.read()
    assert cpu_nvdec.made[-1].closed and nvdec._LEFT_TO_THE_EXIT == []
    stopping = open_source(_camera(path), decode=DecodeRequest("gpu", "cuda:0"))
    stopping.read()
    stopping.close_at_exit()
    assert stopping.decoder is None and stopping.reader is None  # the source is closed
    assert not cpu_nvdec.made[-1].closed and nvdec._LEFT_TO_THE_EXIT == [cpu_nvdec.made[-1]]


def _nal(header: bytes) -> bytes:
    return b"\x00\x00\x00\x01" + header + b"\x88\x84\x00"


@pytest.mark.parametrize("codec, packet, idr", [
    # H.264: access unit delimiter, SPS, PPS, SEI, then the picture's slice
    ("h264", _nal(b"\x09") + _nal(b"\x67") + _nal(b"\x68") + _nal(b"\x06") + _nal(b"\x65"), True),
    ("h264", _nal(b"\x67") + _nal(b"\x68") + _nal(b"\x41"), False),  # a non-IDR slice
    ("h264", b"\x00\x00\x01\x65\x88", True),  # a three-byte start code
    ("h264", _nal(b"\x67") + _nal(b"\x68"), False),  # parameter sets, no picture
    # H.265 (two header bytes): VPS, SPS, PPS, then IDR_W_RADL / IDR_N_LP / CRA
    ("hevc", _nal(b"\x40\x01") + _nal(b"\x42\x01") + _nal(b"\x44\x01") + _nal(b"\x26\x01"), True),
    ("hevc", _nal(b"\x28\x01"), True),
    ("hevc", _nal(b"\x40\x01") + _nal(b"\x2a\x01"), False),  # CRA: an open GOP
    ("mjpeg", _nal(b"\x65"), False),
    ("h264", b"", False),
])
def test_an_idr_picture_is_told_by_its_nal_type(codec, packet, idr):
    assert nvdec.starts_with_idr(codec, packet) is idr


@pytest.mark.parametrize("pix_fmt", ["yuv420p", "yuvj420p"])
def test_a_cameras_nvdec_frames_are_converted_by_facecast(cpu_nvdec, tmp_path, pix_fmt):
    """Note [NV12 to BGR]: cameras get NV12 from NVDEC and facecast's conversion whatever their
    range (NVDEC's own RGB starved the capture threads at 64 cameras)."""
    path = _write_video(tmp_path / f"{pix_fmt}.mp4", pix_fmt=pix_fmt, frames=6)
    references = _opencv_frames(path)
    with open_source(_camera(path), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert isinstance(opened, nvdec.NvdecFileSource)
        assert cpu_nvdec.made[-1].rgb is False and opened.nvdec_rgb is False
        for reference in references:
            frame, _ = opened.read()
            assert _psnr_db(frame.numpy(), reference) >= MIN_PSNR_DB, pix_fmt


def test_the_gpu_paths_synthetic_camera_shows_its_truth(cpu_nvdec):
    camera = _camera()
    truth = synthetic_truth(camera)
    loop = truth.render_loop()
    with open_source(camera, decode=DecodeRequest("auto", "cuda:0")) as opened:
        opened_monotonic = time.monotonic()
        assert isinstance(opened, nvdec.NvdecEncodedSyntheticSource)
        assert cpu_nvdec.made[-1].low_latency
        for _ in range(opened.encoded.frame_count + 12):  # past the file's end
            frame, capture_ts_lsl = opened.read()
            psnr_db = [_psnr_db(frame.numpy(), reference) for reference in loop]
            index = truth.loop_index(capture_ts_lsl)
            assert int(np.argmax(psnr_db)) == index and psnr_db[index] >= 34.0, index
            assert opened.ground_truth(capture_ts_lsl) == truth.faces_at(capture_ts_lsl)
        assert opened.loops >= 1
        # What the camera sent since the open, and the first read's way into the loop: never
        # round the whole loop for the frame just shown (sources.capture_in_a_new_tick).
        sent = (time.monotonic() - opened_monotonic) * camera.fps
        assert opened.frames_decoded <= sent + opened.encoded.frame_count + 3


@pytest.mark.parametrize("codec", ["h264", "mjpeg"])
def test_a_rewound_encoded_loop_gives_the_packets_of_a_fresh_open(codec):
    """The encoded synthetic loop starts again by a seek, not a new open (PacketReader.rewind):
    round after round, the same bytes, keyframe flags included, as the first open gave."""
    camera = CameraConfig(id="loop", source=f"synthetic-{codec}", width=320, height=240)
    loop = EncodedSyntheticLoop(SyntheticReplay.for_camera(camera), codec, name="loop")
    try:
        fresh = PacketReader(str(loop.path))
        first_round = [fresh.read()[:2] for _ in range(loop.frame_count)]
        fresh.close()
        assert first_round[0][1], "the loop starts with a keyframe"
        reader = PacketReader(str(loop.path))
        for _ in range(loop.frame_count):
            reader.read()
        for _ in range(2):
            assert reader.read() is None
            reader.rewind()
            assert [reader.read()[:2] for _ in range(loop.frame_count)] == first_round
        reader.close()
    finally:
        loop.close()


@pytest.mark.parametrize("name, codec, pix_fmt, reason", [
    ("mpeg4.mp4", "mpeg4", "yuv420p", "its video is mpeg4; the GPU decoders take H.264 and H.265 "
     "(NVDEC) and MJPEG (nvJPEG)"),
    ("444.mp4", "libx264", "yuv444p", "its video is H.264 High 4:4:4 Predictive 320x240 yuv444p: "
     "the GPU path converts 8-bit 4:2:0 only"),
])
def test_what_the_gpu_does_not_take_opens_on_the_cpu_with_the_reason(cpu_nvdec, tmp_path, name,
                                                                   codec, pix_fmt, reason):
    path = _write_video(tmp_path / name, codec, pix_fmt=pix_fmt, frames=5)
    with open_source(_camera(path), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert not opened.on_device and opened.decode.decoder == "cpu"
        assert opened.decode.reason == f'decode = "gpu", but {reason}', opened.decode
        opened.read()


def test_a_decoder_that_cannot_be_made_leaves_the_camera_to_the_cpu(cpu_nvdec, monkeypatch):
    class Exhausted(CpuNvdec):
        def decode(self, data, pts):
            raise RuntimeError("cuvidCreateDecoder: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(nvdec, "NvdecDecoder", Exhausted)
    with open_source(_camera(), decode=DecodeRequest("auto", "cuda:0")) as opened:
        assert isinstance(opened, EncodedSyntheticSource)
        assert opened.decode.reason == (
            'decode = "auto", but NVDEC failed on a packet (RuntimeError: cuvidCreateDecoder: '
            "CUDA_ERROR_OUT_OF_MEMORY): engines or memory exhausted, or a profile this GPU does "
            "not support")

    def no_binding(*args):
        raise ImportError("No module named 'PyNvVideoCodec'")

    monkeypatch.setattr(nvdec, "NvdecDecoder", no_binding)
    with open_source(_camera(), decode=DecodeRequest("auto", "cuda:0")) as opened:
        assert "NVDEC could not make a decoder (ImportError: " in opened.decode.reason


def test_an_injected_failure_is_a_gpu_decoder_failure(cpu_nvdec, monkeypatch):
    monkeypatch.setenv(decoding.ALLOW_FAULTS_ENV, "1")
    monkeypatch.setenv(decoding.INJECT_FAILURE_ENV, "dec0@3")
    with open_source(_camera(), decode=DecodeRequest("auto", "cuda:0")) as opened:
        for _ in range(3):
            opened.read()
        with pytest.raises(GpuDecodeFailed, match="injected failure after 3 frames"):
            opened.read()


def test_a_mid_stream_decoder_error_is_a_gpu_decoder_failure(cpu_nvdec):
    with open_source(_camera(), decode=DecodeRequest("auto", "cuda:0")) as opened:
        opened.read()

        def broken(data, pts):
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")

        opened.decoder.decode = broken
        with pytest.raises(GpuDecodeFailed, match=r"NVDEC failed on a packet \(RuntimeError: "
                           r"CUDA_ERROR_LAUNCH_FAILED\)"):
            for _ in range(5):
                opened.read()


# --- device frames into a host ring ----------------------------------------------------------------


def test_a_device_frame_on_an_shm_ring_is_checked_by_its_consumers():
    rng = np.random.default_rng(7)
    producer = ShmRingProducer("dev0", (24, 32, 3), 2)
    reader = ShmRingReader(producer.description(), device=None)
    try:
        for seq in range(3):
            frame = torch.from_numpy(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
            message = producer.write_device(frame, seq, 1.0 + seq)
            assert message.checksum == frames.checksum(frame.numpy())
            read = reader.read(message)
            assert read.verdict is Verdict.OK and np.array_equal(read.tensor, frame.numpy())
        producer.corrupt_next_frame()
        message = producer.write_device(torch.zeros(24, 32, 3, dtype=torch.uint8), 3, 4.0)
        assert reader.read(message).verdict is Verdict.CHECKSUM_MISMATCH
    finally:
        reader.close()
        producer.close()


# --- a capture group: one camera's GPU decoder fails, the other camera goes on ---------------------


class _Worker:
    """What CameraCapture asks of its capture worker."""

    def __init__(self, context, runtime_dir, device):
        self.context, self.runtime_dir, self.device = context, runtime_dir, device
        self.stopping = False
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cameras = {}

    def queue_event(self, kind, **fields):
        self.events.put((kind, fields))

    def drained(self):
        found = []
        while not self.events.empty():
            found.append(self.events.get())
        return found


class SteppedGroup:
    """A capture group's cameras on one GPU (played on the CPU), opened as the capture worker
    opens them and stepped in turn on this thread, as their threads would step them; every
    frame each publishes (`published[camera]`: method, message) is read back from its shm ring
    and must be intact. tests/test_mjpeg_decoding.py uses it too."""

    def __init__(self, context, loaded, runtime_dir):
        self.worker = _Worker(context, runtime_dir, "cuda:0")
        self.captures = {}
        self.published: dict[str, list] = {camera.id: [] for camera in loaded.cameras}
        self._readers = {}
        for camera in loaded.cameras:
            capture = capture_worker.CameraCapture(camera, loaded, self.worker)
            capture.publisher = FramePublisher(context, runtime_dir, camera.id, slot_count=4,
                                               transport="shm")
            for method in ("publish", "publish_decoded", "publish_staged"):
                setattr(capture.publisher, method,
                        self._recording(getattr(capture.publisher, method), camera.id, method))
            capture._open()
            self.captures[camera.id] = capture
        self.worker.cameras = self.captures

    def _recording(self, publish, camera_id, method):
        def recording(*args, **kwargs):
            message = publish(*args, **kwargs)
            self.published[camera_id].append((method, message))
            return message
        return recording

    def step(self, rounds: int) -> None:
        for _ in range(rounds):
            for camera_id, capture in self.captures.items():
                capture.step()
                _, message = self.published[camera_id][-1]
                description = capture.publisher.producer.description()
                reader = self._readers.get(camera_id)
                if reader is None or reader.ring_epoch != description.ring_epoch:
                    reader = self._readers[camera_id] = ShmRingReader(description, device=None)
                assert reader.read(message).verdict is Verdict.OK

    def methods(self, camera_id: str) -> list[str]:
        return [method for method, _ in self.published[camera_id]]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        for capture in self.captures.values():
            capture._close_in_thread()


@pytest.mark.parametrize("stopping", [True, False])
def test_a_capture_thread_leaves_its_decoder_to_the_exit_only_at_the_workers_stop(
        cpu_nvdec, monkeypatch, runtime_dir, stopping):
    """Note [Decoders left to the process's end], in the capture worker: a camera thread's
    last act at the worker's stop leaves the NVDEC decoder to the process's exit; a thread
    that ends otherwise destroys it."""
    monkeypatch.setattr(nvdec, "_LEFT_TO_THE_EXIT", [])
    loaded = config_mod.loads(
        '[daemon]\ntransport = "shm"\n'
        '[[cameras]]\nid = "gpucam"\nsource = "synthetic-h264"\nwidth = 320\nheight = 240\n'
        'fps = 20\ndecode = "gpu"\n')
    with zmq.Context() as context:
        group = SteppedGroup(context, loaded, runtime_dir)
        group.step(3)
        decoder = group.captures["gpucam"].source.decoder
        group.worker.stopping = stopping
        group.close()
    assert group.captures["gpucam"].source is None
    assert decoder.closed is not stopping
    assert nvdec._LEFT_TO_THE_EXIT == ([decoder] if stopping else [])


def test_a_failing_gpu_decoder_falls_back_while_the_groups_other_camera_publishes(
        cpu_nvdec, monkeypatch, runtime_dir):
    monkeypatch.setenv(decoding.ALLOW_FAULTS_ENV, "1")
    monkeypatch.setenv(decoding.INJECT_FAILURE_ENV, "gpucam@8")
    loaded = config_mod.loads(
        '[daemon]\ntransport = "shm"\n'
        '[[cameras]]\nid = "gpucam"\nsource = "synthetic-h264"\nwidth = 320\nheight = 240\n'
        'fps = 20\ndecode = "gpu"\n'
        '[[cameras]]\nid = "cpucam"\nsource = "synthetic-h264"\nwidth = 320\nheight = 240\n'
        'fps = 20\ndecode = "cpu"\n')
    with zmq.Context() as context:
        group = SteppedGroup(context, loaded, runtime_dir)
        try:
            gpu, cpu = group.captures["gpucam"], group.captures["cpucam"]
            assert gpu.decode.decoder == "gpu" and gpu.source.on_device
            assert cpu.decode == DecodeChoice("cpu", 'decode = "cpu"')
            group.step(20)
            methods = group.methods("gpucam")
            # 8 frames from the GPU decoder, then the CPU's (decoded into the ring's staging
            # memory, Note [Staged writes]), with no step lost.
            assert methods[:8] == ["publish_decoded"] * 8 and set(methods[8:]) == {"publish_staged"}
            assert len(methods) == 19  # the step that failed published nothing
            assert group.methods("cpucam") == ["publish_staged"] * 20
            assert gpu.decode.decoder == "cpu" and not gpu.source.on_device
            assert gpu.decode.reason.startswith(
                "its GPU decoder failed mid-stream (injected failure after 8 frames")
            assert gpu.source_state == "ok" and gpu.gpu_decode_failed
            report = gpu.report()
            assert report.source == "ok" and report.frames == 19
            trouble = capture_worker.CaptureWorker.trouble(group.worker)
            assert trouble.startswith("camera gpucam: decoded on the CPU: its GPU decoder "
                                      "failed mid-stream (injected failure after 8 frames")
            events = [(kind, fields) for kind, fields in group.worker.drained()
                      if kind.startswith("decoder")]
            kinds = [(kind, fields["camera"]) for kind, fields in events]
            assert kinds == [("decoder", "gpucam"), ("decoder", "cpucam"),
                             ("decoder_fallback", "gpucam"), ("decoder", "gpucam")], kinds
            assert events[0][1]["decoder"] == "gpu" and events[3][1]["decoder"] == "cpu"
        finally:
            group.close()


# --- an RTSP camera --------------------------------------------------------------------------------


@pytest.fixture(params=["gstreamer", "rtsp-package"])
def h264_rtsp_camera(request):
    """An H.264 camera over RTSP from each of the peer's servers there is here (tests/rtsp_peer.py:
    the GPU machine has the `rtsp` package's only)."""
    import rtsp_peer

    if request.param == "gstreamer":
        python, missing = rtsp_peer.gst_python(), rtsp_peer.MISSING_REASON
    else:
        python, missing = rtsp_peer.python_h264_server(), rtsp_peer.PYTHON_H264_MISSING_REASON
    if python is None:
        pytest.skip(missing)
    peer = rtsp_peer.RtspPeer(python, width=320, height=240, fps=25, encoding="h264", server=request.param)
    peer.start()
    try:
        yield peer
    finally:
        peer.kill()


def test_an_h264_rtsp_camera_on_the_gpu_path(cpu_nvdec, h264_rtsp_camera):
    camera = CameraConfig(id="rtsp0", source=h264_rtsp_camera.url, width=320, height=240,
                          fps=25.0)
    with open_source(camera, open_timeout_s=5.0, read_timeout_s=5.0,
                     decode=DecodeRequest("auto", "cuda:0")) as opened:
        assert isinstance(opened, nvdec.NvdecStreamSource), opened.decode
        assert opened.decode.reason.startswith('decode = "auto": H.264 '), opened.decode
        assert (opened.granted.width, opened.granted.height) == (320, 240)
        assert cpu_nvdec.made[-1].low_latency
        stamps = []
        for _ in range(30):
            frame, capture_ts_lsl = opened.read()
            assert frame.shape == (240, 320, 3)
            stamps.append(capture_ts_lsl)
        # Each stamped when its packet was read (what arrives in a burst is stamped so).
        assert np.all(np.diff(stamps) >= 0)
        # a ball on black (videotestsrc's, or the `rtsp` package peer's): a frame with the ball,
        # not garbage.
        assert 0 < float(frame.float().mean()) < 128


def test_an_mjpeg_rtsp_camera_asking_for_the_gpu_without_nvimgcodec_is_decoded_on_the_cpu(
        cpu_nvdec, gst_python, monkeypatch):
    import rtsp_peer

    no_nvjpeg = "nvidia-nvimgcodec-cu13 is not installed (pip install 'facecast[gpu]')"
    monkeypatch.setattr(decoding, "nvjpeg_unavailable_reason", lambda: no_nvjpeg)

    peer = rtsp_peer.RtspPeer(gst_python, width=320, height=240, fps=25)
    peer.start()
    try:
        camera = CameraConfig(id="rtsp1", source=peer.url, width=320, height=240, fps=25.0)
        with open_source(camera, open_timeout_s=5.0, read_timeout_s=5.0,
                         decode=DecodeRequest("gpu", "cuda:0")) as opened:
            assert not opened.on_device
            assert opened.decode == DecodeChoice("cpu", f'decode = "gpu", but {no_nvjpeg}')
            frame, _ = opened.read()
            assert frame.shape == (240, 320, 3)
    finally:
        peer.kill()


# --- the daemon on a machine without a GPU ---------------------------------------------------------

CPU_DAEMON = ('[daemon]\nwarm_standby = "off"\n[web]\nenabled = false\n[output]\nmax_faces = 2\n'
              '[[cameras]]\nid = "asksgpu"\nsource = "synthetic-h264"\nwidth = 640\n'
              'height = 360\nfps = 10\ndecode = "gpu"\n'
              '[[cameras]]\nid = "autocam"\nsource = "synthetic-h264"\nwidth = 640\n'
              'height = 360\nfps = 10\n')


@pytest.mark.daemon
def test_asking_for_the_gpu_decoder_without_a_gpu_is_a_reason_in_status_not_a_crash(
        installed_models, tmp_path):
    from daemon_harness import Recorder, frames_of, ready_daemon, score_against_truth

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CPU decoder would not be the fallback")
    parsed = config_mod.loads(CPU_DAEMON)
    with ready_daemon(tmp_path, CPU_DAEMON) as daemon:
        asks = daemon.worker("capture:asksgpu")
        assert asks.state == "running" and asks.restarts == 0, asks
        assert asks.detail == (
            'camera asksgpu: decoded on the CPU: decode = "gpu", but its capture worker runs '
            'on the CPU (no GPU here, or models.device = "cpu"): its frames go through shared '
            "memory, so the CPU decodes them"), asks.detail
        auto = daemon.worker("capture:autocam")
        assert auto.state == "running" and auto.detail == "", auto  # auto: no trouble
        # Each camera's report says which decoder and why (status, the consoles).
        reports = {r.camera_id: r for reports in daemon.status().cameras.values()
                   for r in reports if r.source}
        assert reports["asksgpu"].decoder == reports["autocam"].decoder == "cpu", reports
        assert "its capture worker runs on the CPU" in reports["asksgpu"].decode_reason, reports
        log_text = daemon.log_path.read_text()
        assert 'camera autocam: decoder cpu (decode = "auto", but its capture worker runs' in \
            log_text
        records = daemon.resolve("Face", count=4)
        recorder = Recorder(records)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and min(len(r.timestamps) for r in records) < 30:
                time.sleep(0.1)
        finally:
            recorder.stop()
        for camera in ("asksgpu", "autocam"):
            slots = [r for r in records if f"-{camera}-face" in r.source_id]
            frames_by_stamp, stamps = frames_of(slots)
            assert len(stamps) >= 20, (camera, len(stamps), daemon.log_tail())
            score = score_against_truth(frames_by_stamp, stamps,
                                        synthetic_truth(parsed.camera(camera)).faces_at)
            assert score.good >= 0.9 * len(stamps), (camera, score.describe())


# --- facecast doctor --------------------------------------------------------------------------------

DOCTOR_CONFIG = ('[daemon]\ndecode = "auto"\n'
                 '[[cameras]]\nid = "ip0"\nsource = "rtsp://u:secret@10.0.0.5/s"\ndecode = "gpu"\n'
                 '[[cameras]]\nid = "usb0"\nsource = "/dev/video0"\n'
                 '[[cameras]]\nid = "raw0"\nsource = "synthetic-replay"\n'
                 '[[cameras]]\nid = "cpu0"\nsource = "x.mp4"\ndecode = "cpu"\n')


def test_doctor_says_why_there_is_no_gpu_decoding_and_what_each_camera_gets(monkeypatch):
    from facecast.daemon.cli import doctor

    monkeypatch.setattr(decoding, "nvdec_unavailable_reason", lambda: NO_NVDEC)
    result = doctor.check_nvdec(config_mod.loads(DOCTOR_CONFIG))
    assert result.state == doctor.WARN
    assert result.detail == (f"GPU decoding unavailable: {NO_NVDEC}; H.264/H.265 cameras are "
                             "decoded on the CPU")
    lines = "\n".join(result.lines)
    assert "secret" not in lines
    assert 'camera usb0: decode = "auto" -> cpu: a V4L2 camera' in lines
    assert "camera raw0: decode = \"auto\" -> none: source 'synthetic-replay' makes raw" in lines
    assert 'camera cpu0: decode = "cpu" -> cpu: decode = "cpu"' in lines
    assert 'camera ip0: decode = "gpu" -> cpu: decode = "gpu", but' in lines


def test_doctor_names_the_engines_where_nvdec_decodes(monkeypatch):
    from facecast.daemon.cli import doctor

    monkeypatch.setattr(decoding, "nvdec_unavailable_reason", lambda: None)
    caps = {"h264": {"supported": 1, "num_decoder_engines": 7, "width_max": 4096,
                     "height_max": 4096}, "hevc": {"supported": 0}}
    result = doctor.check_nvdec(None, decoder_caps=caps.__getitem__)
    assert result.state == doctor.OK
    assert result.detail == ("GPU decoding available (pynvvideocodec); H.264: 7 NVDEC engine(s), "
                             "up to 4096x4096; H.265: not supported by this GPU")
    assert doctor.check_nvdec(None, decoder_caps=lambda codec: 1 / 0).detail.endswith(
        "H.265: capabilities unknown (ZeroDivisionError: division by zero)")


# --- a capture process killed (issue 22: the GPU form is tests/test_nvdec_gpu.py's) ---------------


def a_capture_process_killed(tmp_path, *, transport: str, decode: str, models: str, device: str,
                             cameras: int, size: tuple[int, int], fps: int,
                             samples_before: int, samples_after: int,
                             least_right: float = 0.9) -> dict[str, float]:
    """A daemon whose one capture process reads `cameras` synthetic H.264 cameras (decoded by
    `decode`), with warm spares: once every Face stream has `samples_before` samples, that
    process is SIGKILLed. Its device's spare must take the cameras over; the frames published on
    either side of the kill must show the synthetic scene's faces (`least_right` of them with
    every face, none with a box where no face is); no consumer may have met a slot whose bytes
    were not the published frame; each camera must be captured again on `transport`. Returns
    each camera's seconds from the kill to its first frame captured after it (the Face streams'
    capture timestamps)."""
    names = [f"kill{k}" for k in range(cameras)]
    # Every camera on the one device (round-robin would spread them over a host's GPUs, a group
    # on each: the killed process would hold only some of them).
    pinned = f"gpu = {device.partition(':')[2]}\n" if device.startswith("cuda") else ""
    text = (f'[daemon]\ntransport = "{transport}"\ndecode = "{decode}"\n'
            f'cameras_per_capture_worker = {cameras}\nwarm_standby = "on"\n'
            f'[models]\ndevice = "{models}"\n[output]\nmax_faces = 2\n[web]\nenabled = false\n'
            + "".join(f'[[cameras]]\nid = "{name}"\nsource = "synthetic-h264"\nwidth = {size[0]}\n'
                      f'height = {size[1]}\nfps = {fps}\n{pinned}' for name in names))
    parsed = config_mod.loads(text)
    capture = f"capture:{device}:0"  # the group's worker (daemon/layout.py)
    daemon = Daemon(tmp_path, config_text=text)
    try:
        assert daemon.notify.wait_for("READY=1", timeout_s=180), daemon.log_tail()
        spare = daemon.wait_for_worker(f"standby:capture:{device}", "standby", timeout_s=120)
        victim = daemon.wait_for_worker(capture, "running")
        faces = daemon.resolve("Face", count=2 * cameras)
        assert len(faces) == 2 * cameras, [r.source_id for r in faces]
        recorder = Recorder(faces)
        try:
            deadline = time.monotonic() + 60
            while not all(len(r.timestamps) >= samples_before for r in faces):
                assert time.monotonic() < deadline, daemon.log_tail()
                time.sleep(0.1)
            killed_at = pylsl.local_clock()
            os.kill(victim.pid, signal.SIGKILL)
            promoted = daemon.wait_for_worker(capture, "running", timeout_s=30, not_pid=victim.pid)
            assert promoted.pid == spare.pid, (promoted, spare, daemon.log_tail())
            deadline = time.monotonic() + 60
            while not all(sum(t > killed_at for t in list(r.timestamps)) >= samples_after
                          for r in faces):
                assert time.monotonic() < deadline, daemon.log_tail()
                time.sleep(0.1)
        finally:
            recorder.stop()
        back_s = {}
        for name in names:
            slots = [r for r in faces if f"-{name}-face" in r.source_id]
            frames_by_stamp, stamps = frames_of(slots)
            after = stamps[stamps > killed_at]
            assert after.size, (name, "no frame after the kill")
            back_s[name] = float(after[0] - killed_at)
            faces_at = synthetic_truth(parsed.camera(name)).faces_at
            score = score_against_truth(frames_by_stamp, stamps, faces_at)
            print(f"{name}: back {back_s[name]:.2f} s after the SIGKILL; {score.describe()}")
            assert score.good >= least_right * score.frames, (name, score.describe())
            # A frame of another time or camera, or a torn one, would put a box where no face is:
            # off the face's centre. (Its size is the detector's on a detection frame, as the
            # first frames after the takeover are: Note [Tracks across a break]; on the GPU
            # boxes 10-12 % wider than the truth, centred on it, failed a 10 % size bound,
            # 2026-11-28.) Each stray as its seconds from the kill, its box and the true boxes.
            stray = [(round(stamp - killed_at, 3), sample[2:6].round(),
                      [face.box_px for face in faces_at(stamp)])
                     for stamp in stamps for sample in frames_by_stamp[stamp]
                     if not math.isnan(sample[2])
                     and not any(box_close(face.box_px, [sample[2:6]],
                                           size_tolerance=DETECTOR_SIZE_TOLERANCE)
                                 for face in faces_at(stamp))]
            assert not stray, (name, stray[:5], daemon.log_tail())
        status = daemon.status()
        for name in names:
            reports = status.cameras[name]
            assert sum(r.checksum_mismatches for r in reports) == 0, reports
            captured = next(r for r in reports if r.source)
            assert captured.source == "ok" and captured.transport == transport, captured
        return back_s
    finally:
        daemon.close()


@pytest.mark.daemon
def test_a_capture_process_of_h264_cameras_killed_is_taken_over_by_its_spare(installed_models,
                                                                           tmp_path):
    """The CPU form (no GPU here): two 320x240 H.264 cameras at 10 fps decoded on the CPU, one
    capture process, SIGKILLed; the spare's first frames within 5 s on this busy machine (the
    2 s of the GPU form is tests/test_nvdec_gpu.py's, on a machine of 16 cores)."""
    # Four in five frames with every face: on the 2-core machine running the whole suite beside
    # a busy loop, 26 of a camera's 30 frames had every face (2026-11-28); what this test
    # guards is nothing corrupt (no box where no face is, no checksum mismatch) and the spare.
    back_s = a_capture_process_killed(
        tmp_path, transport="shm", decode="cpu", models="cpu", device="cpu", cameras=2,
        size=(320, 240), fps=10, samples_before=30, samples_after=30, least_right=0.8)
    assert max(back_s.values()) < 5.0, back_s
