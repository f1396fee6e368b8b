"""MJPEG cameras on the GPU decoder (Note [nvJPEG path]), on any machine: which decoder an MJPEG
source gets and every reason for the CPU one that a machine without a GPU can produce
(Note [Decoder choice]); the nvJPEG path's demuxing, warm-up, backend fallback, pacing, looping,
stamping and mid-stream failure with OpenCV's imdecode playing nvImageCodec's part (`CpuJpeg`:
only the decode call itself and the device memory are stand-ins), its frames against the CPU
decoder's (PSNR >= 40 dB); and a capture group whose nvJPEG camera fails mid-stream and goes on
on the CPU decoder while the other camera keeps publishing (Note [GPU decoder failing
mid-stream]).

The same checks against the real nvImageCodec are tests/test_nvjpeg_gpu.py (marker gpu)."""

from __future__ import annotations

import sys
import time

import cv2
import numpy as np
import pytest
import torch
import zmq

# facecast needs PyAV; a GPU host without the wheel (.whl2a/) skips these tests.
av = pytest.importorskip("av", reason="PyAV (the `av` wheel) demuxes and encodes the test videos")

from facecast.shared import config as config_mod
from facecast.shared.config import CameraConfig
from facecast.workers.capture import decoding, nvdec, nvjpeg
from facecast.workers.capture import worker as capture_worker
from facecast.workers.capture.decoding import DecodeChoice, DecodeRequest, GpuDecodeFailed
from facecast.workers.capture.sources import (
    EncodedSyntheticSource,
    FileSource,
    SyntheticScene,
    open_source,
    synthetic_truth,
)
from test_decoding import MIN_PSNR_DB, NO_NVDEC, SteppedGroup, _NoStream, _psnr_db

NO_NVJPEG = "nvidia-nvimgcodec-cu13 is not installed (pip install 'facecast[gpu]')"
NO_CUDA = "no CUDA device is visible to PyTorch (no GPU or no NVIDIA driver)"


def _camera(source: str = "synthetic-mjpeg", **fields) -> CameraConfig:
    return CameraConfig(id="jpg0", source=source, **{"width": 320, "height": 240, "fps": 20.0,
                                                     **fields})


# --- the choice ------------------------------------------------------------------------------------


@pytest.mark.parametrize("request_, kind, nvdec_reason, nvjpeg_reason, expected", [
    # "synthetic-mjpeg" asks nvJPEG alone.
    (DecodeRequest("gpu", "cuda:0"), "synthetic-mjpeg", None, NO_NVJPEG,
     DecodeChoice("cpu", f'decode = "gpu", but {NO_NVJPEG}')),
    (DecodeRequest("auto", "cuda:0"), "synthetic-mjpeg", NO_NVDEC, None, None),
    # A file or stream: the CPU only when neither GPU decoder can be used, both reasons said.
    (DecodeRequest("auto", "cuda:0"), "file", NO_NVDEC, None, None),
    (DecodeRequest("auto", "cuda:0"), "stream", NO_NVDEC, NO_NVJPEG,
     DecodeChoice("cpu", f'decode = "auto", but {NO_NVDEC} (and for MJPEG, {NO_NVJPEG})')),
    (DecodeRequest("auto", "cuda:0"), "file", NO_CUDA, NO_CUDA,
     DecodeChoice("cpu", f'decode = "auto", but {NO_CUDA}')),
    # A USB camera's MJPEG stays on the CPU, saying why; a CPU worker never asks.
    (DecodeRequest("gpu", "cuda:0"), "v4l2", None, None,
     DecodeChoice("cpu", "a V4L2 camera: OpenCV decodes its frames on the CPU; its MJPEG is not "
                  "handed to the GPU yet (Note [nvJPEG path])")),
    (DecodeRequest("gpu", "cpu"), "synthetic-mjpeg", None, None,
     DecodeChoice("cpu", 'decode = "gpu", but its capture worker runs on the CPU (no GPU here, '
                  'or models.device = "cpu"): its frames go through shared memory, so the CPU '
                  "decodes them")),
    (DecodeRequest("cpu", "cuda:0"), "synthetic-mjpeg", None, None,
     DecodeChoice("cpu", 'decode = "cpu"')),
    (DecodeRequest("auto", "cuda:0", gpu_failed="nvImageCodec failed on a JPEG (boom)"),
     "synthetic-mjpeg", None, None,
     DecodeChoice("cpu", "its GPU decoder failed mid-stream (nvImageCodec failed on a JPEG "
                  "(boom)); on the CPU decoder until its capture worker restarts")),
])
def test_every_reason_for_an_mjpeg_sources_decoder_is_said(request_, kind, nvdec_reason,
                                                            nvjpeg_reason, expected):
    asked = []

    def ask(reason, name):
        def answer():
            asked.append(name)
            return reason
        return answer

    choice = decoding.plan(request_, kind, ask(nvdec_reason, "nvdec"),
                           ask(nvjpeg_reason, "nvjpeg"))
    assert choice == expected
    if request_.device == "cpu":
        assert not asked  # a CPU worker never imports torch for it
    if kind == "synthetic-mjpeg" and asked:
        assert asked == ["nvjpeg"]


def test_gpu_asked_for_an_mjpeg_source_and_not_given_is_trouble():
    cpu = DecodeChoice("cpu", "why")
    assert decoding.is_trouble(DecodeRequest("gpu", "cuda:0"), cpu, "synthetic-mjpeg")
    assert not decoding.is_trouble(DecodeRequest("gpu", "cuda:0"), cpu, "v4l2")


def test_nvjpeg_unavailable_reasons(monkeypatch):
    from facecast.shared.transport import cuda_driver

    decoding.nvjpeg_unavailable_reason.cache_clear()
    try:
        monkeypatch.setattr(cuda_driver, "cuda_unavailable_reason", lambda: "no CUDA here")
        assert decoding.nvjpeg_unavailable_reason() == "no CUDA here"

        decoding.nvjpeg_unavailable_reason.cache_clear()
        monkeypatch.setattr(cuda_driver, "cuda_unavailable_reason", lambda: None)
        monkeypatch.setattr(decoding.importlib.util, "find_spec", lambda name: None)
        assert decoding.nvjpeg_unavailable_reason() == NO_NVJPEG

        def no_namespace(name):
            raise ModuleNotFoundError("No module named 'nvidia'")

        decoding.nvjpeg_unavailable_reason.cache_clear()
        monkeypatch.setattr(decoding.importlib.util, "find_spec", no_namespace)
        assert decoding.nvjpeg_unavailable_reason() == NO_NVJPEG

        # Installed but not loadable (its extension needs libcuda.so.1).
        decoding.nvjpeg_unavailable_reason.cache_clear()
        monkeypatch.setattr(decoding.importlib.util, "find_spec", lambda name: object())
        monkeypatch.setitem(sys.modules, decoding.NVIMGCODEC_MODULE, None)  # import raises
        reason = decoding.nvjpeg_unavailable_reason()
        assert reason.startswith("nvImageCodec cannot be loaded ("), reason
    finally:
        decoding.nvjpeg_unavailable_reason.cache_clear()


def test_this_machine_opens_an_mjpeg_camera_asking_for_the_gpu_on_the_cpu_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/test_nvjpeg_gpu.py")
    with open_source(_camera(), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert isinstance(opened, EncodedSyntheticSource) and not opened.on_device
        assert opened.decode == DecodeChoice("cpu", f'decode = "gpu", but {NO_CUDA}')
        frame, _ = opened.read()
        assert frame.shape == (240, 320, 3)


def test_decode_gpu_for_an_mjpeg_source_is_valid_config_and_for_a_usb_camera_is_not():
    assert config_mod.gpu_decode_source_problem("synthetic-mjpeg") == ""
    assert config_mod.gpu_decode_source_problem("http://cam/mjpg/video.mjpg") == ""
    assert "is a V4L2 camera, decoded by OpenCV on the CPU (its MJPEG is not handed to the GPU" \
        in config_mod.gpu_decode_source_problem("/dev/video0")


# --- the nvJPEG path with the JPEG decode played on the CPU ---------------------------------------


class CpuJpeg:
    """A stand-in for nvjpeg.JpegDecoder: OpenCV's imdecode (libjpeg) decodes each JPEG the
    source feeds it into an RGB tensor in host memory, as nvImageCodec's Image is RGB in device
    memory. What it proves about the real path: every packet the source hands over is a whole
    JPEG, and the source's warm-up, backend fallback, pacing, positions, looping and stamping
    hold. `refuse` lists backends whose construction fails (as GPU_ONLY's did on the H100)."""

    made: list[CpuJpeg] = []
    refuse: set[str] = set()

    def __init__(self, device_index, stream, backend) -> None:
        if backend in CpuJpeg.refuse:
            raise RuntimeError("Could not create decoder. Code: 7")
        self.backend = backend
        self.jpegs = 0
        self.closed = False
        CpuJpeg.made.append(self)

    def decode(self, data: bytes) -> torch.Tensor:
        assert data[:2] == b"\xff\xd8", "not a JPEG"
        self.jpegs += 1
        bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if bgr is None:
            raise RuntimeError("no image")
        return torch.from_numpy(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def cpu_jpeg(monkeypatch):
    """The nvJPEG path as it is, with `CpuJpeg` for nvImageCodec and host memory for the
    device's; NVDEC not available (an MJPEG file must still reach nvJPEG)."""
    CpuJpeg.made.clear()
    CpuJpeg.refuse = set()
    monkeypatch.setattr(nvjpeg, "JpegDecoder", CpuJpeg)
    monkeypatch.setattr(nvjpeg.NvjpegSource, "_new_stream", lambda self: _NoStream())
    monkeypatch.setattr(nvjpeg.NvjpegSource, "_hand_over", lambda self: None)
    monkeypatch.setattr(nvdec.NvdecSource, "_new_stream", lambda self: _NoStream())
    monkeypatch.setattr(decoding, "nvjpeg_unavailable_reason", lambda: None)
    monkeypatch.setattr(decoding, "nvdec_unavailable_reason", lambda: NO_NVDEC)
    yield CpuJpeg
    CpuJpeg.refuse = set()


def _write_mjpeg(path, frames=30, fps=100, size=(320, 240), container=None) -> str:
    """An MJPEG file of the synthetic scene, as USB cameras send it (yuvj420p, q ~90)."""
    scene = SyntheticScene(*size)
    with av.open(str(path), mode="w", format=container) as output:
        stream = output.add_stream("mjpeg", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuvj420p"
        stream.codec_context.qmin = stream.codec_context.qmax = 3
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(scene.render(index / fps), format="bgr24")
            frame.pts = index
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
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


@pytest.mark.parametrize("name, container", [("mjpeg.avi", None), ("mjpeg.mkv", None),
                                             ("raw.mjpeg", "mjpeg")])
def test_the_gpu_paths_mjpeg_file_frames_match_the_cpu_decoder(cpu_jpeg, tmp_path, name,
                                                                container):
    path = _write_mjpeg(tmp_path / name, container=container)
    references = _opencv_frames(path)
    assert len(references) == 30
    with open_source(_camera(path), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert isinstance(opened, nvjpeg.NvjpegFileSource) and opened.on_device
        assert opened.decode.decoder == "gpu"
        assert opened.decode.reason == ('decode = "gpu": MJPEG 320x240 on nvImageCodec\'s '
                                        "hardware JPEG engine (GPU 0)"), opened.decode
        assert opened.granted.backend == "nvJPEG" and opened.granted.fourcc == "mjpeg"
        stamps = []
        for index in range(len(references) + 10):  # through the file's end and round again
            frame, capture_ts_lsl = opened.read()
            stamps.append(capture_ts_lsl)
            reference = references[index % len(references)]
            assert frame.shape == reference.shape and frame.dtype == torch.uint8
            assert frame.is_contiguous()
            assert _psnr_db(frame.numpy(), reference) >= MIN_PSNR_DB, (name, index)
        assert opened.loops == 1 and opened.frames_decoded == len(references) + 10
        assert np.all(np.diff(stamps) > 0), "capture times must increase"
        assert len(cpu_jpeg.made) == 1 and cpu_jpeg.made[0].backend == "hardware"
    assert cpu_jpeg.made[0].closed


def test_the_gpu_paths_synthetic_mjpeg_camera_shows_its_truth_as_the_cpu_decoder(cpu_jpeg):
    camera = _camera()
    truth = synthetic_truth(camera)
    loop = truth.render_loop()
    with open_source(camera, decode=DecodeRequest("cpu", "cuda:0")) as on_cpu:
        cpu_frames = {}
        for _ in range(on_cpu.encoded.frame_count + 4):
            frame, capture_ts_lsl = on_cpu.read()
            cpu_frames[truth.loop_index(capture_ts_lsl)] = frame
    with open_source(camera, decode=DecodeRequest("auto", "cuda:0")) as opened:
        opened_monotonic = time.monotonic()
        assert isinstance(opened, nvjpeg.NvjpegEncodedSyntheticSource) and opened.on_device
        assert opened.decode.reason.startswith('decode = "auto": MJPEG 320x240 on '
                                               "nvImageCodec's hardware JPEG engine")
        compared = 0
        for _ in range(opened.encoded.frame_count + 12):  # past the file's end
            frame, capture_ts_lsl = opened.read()
            psnr_db = [_psnr_db(frame.numpy(), reference) for reference in loop]
            index = truth.loop_index(capture_ts_lsl)
            assert int(np.argmax(psnr_db)) == index and psnr_db[index] >= 34.0, index
            assert opened.ground_truth(capture_ts_lsl) == truth.faces_at(capture_ts_lsl)
            if index in cpu_frames:
                compared += 1
                assert _psnr_db(frame.numpy(), cpu_frames[index]) >= MIN_PSNR_DB, index
        assert compared >= 10 and opened.loops >= 1
        # JPEG is intra-only: only the frames shown are decoded, a late reader's skipped ones
        # are not (the warm-up's first JPEG aside).
        assert opened.frames_decoded == opened.frames_read + 1
        sent = (time.monotonic() - opened_monotonic) * camera.fps
        assert opened.frames_read <= sent + 3


def test_the_hardware_backend_refused_falls_back_to_the_default_backends(cpu_jpeg):
    cpu_jpeg.refuse = {"hardware"}
    with open_source(_camera(), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert opened.on_device
        assert opened.decode.reason == (
            'decode = "gpu": MJPEG 320x240 on nvImageCodec\'s default backends (nvImageCodec\'s '
            "hardware JPEG engine: RuntimeError: Could not create decoder. Code: 7) (GPU 0)")
        frame, _ = opened.read()
        assert frame.shape == (240, 320, 3)


def test_no_backend_that_decodes_the_first_jpeg_leaves_the_camera_to_the_cpu(cpu_jpeg,
                                                                             tmp_path):
    cpu_jpeg.refuse = {"hardware", "default"}
    with open_source(_camera(), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert isinstance(opened, EncodedSyntheticSource) and not opened.on_device
        assert opened.decode.reason == (
            'decode = "gpu", but nvImageCodec could not decode its first JPEG (nvImageCodec\'s '
            "hardware JPEG engine: RuntimeError: Could not create decoder. Code: 7; "
            "nvImageCodec's default backends: RuntimeError: Could not create decoder. Code: 7)")
        assert decoding.is_trouble(DecodeRequest("gpu", "cuda:0"), opened.decode,
                                   "synthetic-mjpeg")
    path = _write_mjpeg(tmp_path / "m.avi", frames=5)
    with open_source(_camera(path), decode=DecodeRequest("auto", "cuda:0")) as opened:
        assert isinstance(opened, FileSource) and not opened.on_device
        assert opened.decode.reason.startswith('decode = "auto", but nvImageCodec could not')
        opened.read()


def test_an_mjpeg_file_without_nvimgcodec_and_an_h264_file_without_nvdec_go_to_the_cpu(
        cpu_jpeg, tmp_path, monkeypatch):
    h264 = tmp_path / "h.mp4"
    with av.open(str(h264), mode="w") as output:
        stream = output.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 320, 240, "yuv420p"
        for index in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((240, 320, 3), index * 40, np.uint8),
                                               format="bgr24")
            frame.pts = index
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    # NVDEC missing, nvJPEG here: plan lets the file by, its open finds H.264 and says why not.
    with open_source(_camera(str(h264)), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert not opened.on_device
        assert opened.decode == DecodeChoice("cpu", f'decode = "gpu", but {NO_NVDEC}')
        opened.read()
    # NVDEC here, nvJPEG missing: the MJPEG file's open (NVDEC's reader) says why not.
    monkeypatch.setattr(decoding, "nvdec_unavailable_reason", lambda: None)
    monkeypatch.setattr(decoding, "nvjpeg_unavailable_reason", lambda: NO_NVJPEG)
    path = _write_mjpeg(tmp_path / "m.avi", frames=5)
    with open_source(_camera(path), decode=DecodeRequest("gpu", "cuda:0")) as opened:
        assert isinstance(opened, FileSource) and not opened.on_device
        assert opened.decode == DecodeChoice("cpu", f'decode = "gpu", but {NO_NVJPEG}')
        opened.read()
    assert not cpu_jpeg.made


def test_a_mid_stream_jpeg_failure_and_an_injected_one_are_gpu_decoder_failures(cpu_jpeg,
                                                                                monkeypatch):
    with open_source(_camera(), decode=DecodeRequest("auto", "cuda:0")) as opened:
        opened.read()

        def broken(data):
            raise RuntimeError("nvImageCodec's hardware JPEG engine gave no image for a "
                               "1234-byte JPEG")

        opened.decoder.decode = broken
        with pytest.raises(GpuDecodeFailed, match=r"nvImageCodec failed on a JPEG "
                           r"\(RuntimeError: nvImageCodec's hardware JPEG engine gave no image"):
            opened.read()
    monkeypatch.setenv(decoding.ALLOW_FAULTS_ENV, "1")
    monkeypatch.setenv(decoding.INJECT_FAILURE_ENV, "jpg0@3")
    with open_source(_camera(), decode=DecodeRequest("auto", "cuda:0")) as opened:
        for _ in range(3):
            opened.read()
        with pytest.raises(GpuDecodeFailed, match="injected failure after 3 frames"):
            opened.read()


def test_an_mjpeg_rtsp_camera_on_the_gpu_path(cpu_jpeg, gst_python):
    """The stream path: the reader NVDEC's open made is handed over, not opened again."""
    import rtsp_peer

    peer = rtsp_peer.RtspPeer(gst_python, width=320, height=240, fps=25)
    peer.start()
    try:
        camera = CameraConfig(id="rtsp1", source=peer.url, width=320, height=240, fps=25.0)
        with open_source(camera, open_timeout_s=5.0, read_timeout_s=5.0,
                         decode=DecodeRequest("gpu", "cuda:0")) as opened:
            assert isinstance(opened, nvjpeg.NvjpegStreamSource) and opened.on_device
            assert opened.decode.reason.startswith('decode = "gpu": MJPEG 320x240 on '
                                                   "nvImageCodec's hardware JPEG engine")
            stamps = []
            for _ in range(10):
                frame, capture_ts_lsl = opened.read()
                assert frame.shape == (240, 320, 3)
                stamps.append(capture_ts_lsl)
            assert np.all(np.diff(stamps) >= 0)
            assert 0 < float(frame.float().mean()) < 128  # videotestsrc's ball on black
    finally:
        peer.kill()


# --- a capture group: one camera's nvJPEG decoder fails, the other camera goes on ------------------


def test_a_failing_nvjpeg_camera_falls_back_while_the_groups_other_camera_publishes(
        cpu_jpeg, monkeypatch, runtime_dir):
    monkeypatch.setenv(decoding.ALLOW_FAULTS_ENV, "1")
    monkeypatch.setenv(decoding.INJECT_FAILURE_ENV, "gpucam@8")
    loaded = config_mod.loads(
        '[daemon]\ntransport = "shm"\n'
        '[[cameras]]\nid = "gpucam"\nsource = "synthetic-mjpeg"\nwidth = 320\nheight = 240\n'
        'fps = 20\ndecode = "gpu"\n'
        '[[cameras]]\nid = "othercam"\nsource = "synthetic-mjpeg"\nwidth = 320\nheight = 240\n'
        'fps = 20\ndecode = "gpu"\n')
    with zmq.Context() as context:
        group = SteppedGroup(context, loaded, runtime_dir)
        try:
            gpu, other = group.captures["gpucam"], group.captures["othercam"]
            assert gpu.decode.decoder == "gpu" and gpu.source.on_device
            assert other.decode.decoder == "gpu" and other.source.on_device
            group.step(20)
            methods = group.methods("gpucam")
            # 8 frames from nvJPEG, then the CPU decoder's, with no step lost.
            assert methods[:8] == ["publish_decoded"] * 8 and set(methods[8:]) == {"publish_staged"}
            assert len(methods) == 19  # the step that failed published nothing
            # The other camera kept its GPU decoder and published every step.
            assert group.methods("othercam") == ["publish_decoded"] * 20
            assert gpu.decode.decoder == "cpu" and not gpu.source.on_device
            assert gpu.decode.reason.startswith(
                "its GPU decoder failed mid-stream (injected failure after 8 frames")
            assert other.decode.decoder == "gpu"
            trouble = capture_worker.CaptureWorker.trouble(group.worker)
            assert trouble.startswith("camera gpucam: decoded on the CPU: its GPU decoder "
                                      "failed mid-stream (injected failure after 8 frames")
            events = [(kind, fields["camera"]) for kind, fields in group.worker.drained()
                      if kind.startswith("decoder")]
            assert events == [("decoder", "gpucam"), ("decoder", "othercam"),
                              ("decoder_fallback", "gpucam"), ("decoder", "gpucam")], events
        finally:
            group.close()


def test_an_http_mjpeg_camera_on_the_gpu_path_and_its_peer_going_away(cpu_jpeg, tmp_path):
    """An HTTP camera's multipart JPEG (ffmpeg's mpjpeg muxer, as test_sources' peer): each part
    a whole JPEG for nvJPEG; the peer gone is a lost camera, not a decoder failure."""
    import shutil
    import socket
    import subprocess

    from facecast.workers.capture.sources import SourceLost

    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        pytest.skip("no HTTP peer: ffmpeg is not installed (Debian: apt-get install -y ffmpeg)")
    video = _write_mjpeg(tmp_path / "peer.avi", frames=25, fps=25)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/cam.mjpg"
    command = [ffmpeg, "-hide_banner", "-loglevel", "error", "-re", "-stream_loop", "-1", "-i",
               video, "-c:v", "copy", "-f", "mpjpeg", "-listen", "1", url]
    peer = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        camera = CameraConfig(id="http1", source=url, width=320, height=240, fps=25.0)
        deadline_monotonic = time.monotonic() + 30.0
        while True:  # until ffmpeg listens
            try:
                opened = open_source(camera, open_timeout_s=10.0, read_timeout_s=3.0,
                                     decode=DecodeRequest("gpu", "cuda:0"))
                break
            except SourceLost:
                if time.monotonic() > deadline_monotonic:
                    raise
                if peer.poll() is not None:
                    # `-listen 1` serves one client: an open that connected and then failed
                    # (timed out on the loaded 2-core machine, 2026-11-28) ended the peer.
                    peer = subprocess.Popen(command, stdin=subprocess.DEVNULL)
                time.sleep(0.1)
        with opened:
            assert isinstance(opened, nvjpeg.NvjpegStreamSource) and opened.on_device, \
                opened.decode
            assert opened.decode.reason.startswith('decode = "gpu": MJPEG 320x240 on ')
            references = _opencv_frames(video)
            for _ in range(10):
                frame, _ = opened.read()
                assert max(_psnr_db(frame.numpy(), reference)
                           for reference in references) >= MIN_PSNR_DB
            peer.kill()
            peer.wait(timeout=10)
            with pytest.raises(SourceLost, match=f"127.0.0.1:{port}"):
                for _ in range(200):
                    opened.read()
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(timeout=10)
