"""Frames born on the GPU, against the real NVDEC (marker gpu; issue 22 item 1): PyNvVideoCodec's
frames, converted to BGR on the GPU, against OpenCV's CPU decode of the same files (PSNR >= 40 dB), the synthetic H.264 camera's frames against its truth, device frames into a CUDA ring and
an shm ring checked by consumers, an H.264 RTSP camera, the daemon on GPU-decoded cameras in
one capture group, one of whose decoders fails mid-stream (injected) and goes on on the CPU
decoder while the other keeps publishing, and a capture process of eight NVDEC cameras
SIGKILLed, its cameras back within 2 s with nothing corrupt.

Needs an NVIDIA GPU with its driver (libnvcuvid.so.1), PyCUDA and pynvvideocodec (the `gpu`
extra); elsewhere every test skips with the reason. Written on a machine without a GPU: the same
paths with NVDEC played by FFmpeg on the CPU are tests/test_decoding.py, which pass there."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

# facecast needs PyAV; a GPU host without the wheel (.whl2a/) skips these tests.
pytest.importorskip("av", reason="PyAV (the `av` wheel) demuxes and encodes the test videos")

from daemon_harness import Daemon, Recorder, frames_of, score_against_truth
from facecast.shared import config as config_mod
from facecast.shared.config import CameraConfig
from facecast.shared.transport import frames
from facecast.workers.capture import decoding, nvdec
from facecast.workers.capture.decoding import DecodeRequest
from facecast.workers.capture.sources import open_source, synthetic_truth
from test_decoding import (  # noqa: F401 - h264_rtsp_camera is a fixture
    MIN_PSNR_DB,
    _opencv_frames,
    _psnr_db,
    _write_bt709_file,
    _write_video,
    a_capture_process_killed,
    h264_rtsp_camera,
)

_REASON = decoding.nvdec_unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=f"needs NVDEC: {_REASON}")]

GPU = DecodeRequest("gpu", "cuda:0")


def _camera(source: str, **fields) -> CameraConfig:
    return CameraConfig(id="nv0", source=source, **{"width": 320, "height": 240, "fps": 20.0,
                                                    **fields})


# --- NVDEC against the CPU decoder -----------------------------------------------------------------


@pytest.mark.parametrize("name, codec, container, bframes, size", [
    ("h264.mp4", "libx264", None, 0, (320, 240)),
    ("raw.h264", "libx264", "h264", 0, (320, 240)),  # Annex B: SimpleDecoder failed on it
    ("h265.mp4", "libx265", None, 0, (320, 240)),
    ("raw.hevc", "libx265", "hevc", 0, (320, 240)),
    ("bframes.mkv", "libx264", None, 3, (320, 240)),
    ("1080p.mp4", "libx264", None, 0, (1920, 1080)),  # coded 1088 rows, 1080 shown
])
def test_nvdec_frames_match_the_cpu_decoders(tmp_path, name, codec, container, bframes, size):
    path = _write_video(tmp_path / name, codec, container, bframes=bframes, size=size,
                        frames=40 if size[0] <= 640 else 20)
    references = _opencv_frames(path)
    with open_source(_camera(path), decode=GPU) as opened:
        assert isinstance(opened, nvdec.NvdecFileSource), opened.decode
        assert opened.decode.decoder == "gpu" and "on NVDEC (GPU 0)" in opened.decode.reason
        assert (opened.granted.width, opened.granted.height) == size
        for index in range(len(references) + 5):  # and round the file's end
            frame, _ = opened.read()
            assert frame.device.type == "cuda" and frame.shape == (size[1], size[0], 3)
            host = frame.cpu().numpy()
            if index < len(references):
                psnr_db = _psnr_db(host, references[index])
            else:  # after the jump, a decoder with B-frames may drop what it held
                psnr_db = max(_psnr_db(host, reference) for reference in references)
            assert psnr_db >= MIN_PSNR_DB, (name, index, psnr_db)
        assert opened.loops == 1


@pytest.mark.parametrize("what", ["bt709", "yuvj420p"])
def test_nvdec_colour_of_other_streams_matches_the_cpu_decoder(tmp_path, what):
    """Note [NV12 to BGR]: a camera's NV12 converted by facecast, BT.709-flagged or full
    range."""
    path = (_write_bt709_file(tmp_path / "bt709.mp4", frames=8) if what == "bt709"
            else _write_video(tmp_path / "yuvj420p.mp4", pix_fmt="yuvj420p", frames=8))
    references = _opencv_frames(path)
    with open_source(_camera(path), decode=GPU) as opened:
        assert isinstance(opened, nvdec.NvdecFileSource) and opened.nvdec_rgb is False
        for index, reference in enumerate(references):
            frame, _ = opened.read()
            psnr_db = _psnr_db(frame.cpu().numpy(), reference)
            assert psnr_db >= MIN_PSNR_DB, (what, index, psnr_db)


def test_nvdecs_synthetic_camera_shows_its_truth():
    camera = _camera("synthetic-h264", width=640, height=360)
    truth = synthetic_truth(camera)
    loop = truth.render_loop()
    with open_source(camera, decode=DecodeRequest("auto", "cuda:0")) as opened:
        assert isinstance(opened, nvdec.NvdecEncodedSyntheticSource), opened.decode
        for _ in range(opened.encoded.frame_count + 12):
            frame, capture_ts_lsl = opened.read()
            psnr_db = [_psnr_db(frame.cpu().numpy(), reference) for reference in loop]
            index = truth.loop_index(capture_ts_lsl)
            assert int(np.argmax(psnr_db)) == index and psnr_db[index] >= 34.0, index
        assert opened.loops >= 1


def test_an_h264_rtsp_camera_on_nvdec(h264_rtsp_camera):
    camera = CameraConfig(id="rtspnv", source=h264_rtsp_camera.url, width=320, height=240,
                          fps=25.0)
    with open_source(camera, open_timeout_s=5.0, read_timeout_s=5.0,
                     decode=DecodeRequest("auto", "cuda:0")) as opened:
        assert isinstance(opened, nvdec.NvdecStreamSource), opened.decode
        stamps = [opened.read()[1] for _ in range(50)]
        assert np.all(np.diff(stamps) >= 0)
        frame, _ = opened.read()
        assert frame.device.type == "cuda" and 0 < float(frame.float().mean()) < 128


# --- device frames into the rings (Note [Frames born on the GPU]) ---------------------------------


@pytest.mark.parametrize("scratch", [False, True], ids=["kept", "scratch"])
@pytest.mark.parametrize("kind", frames.CHECKSUM_KINDS)
def test_device_frames_into_a_cuda_ring_are_checked_by_its_consumers(kind, scratch):
    from facecast.shared.transport.cuda_ring import CudaRingProducer, CudaRingReader
    from facecast.shared.transport.rings import Verdict

    producer = CudaRingProducer("devcuda", (360, 640, 3), slot_count=3, checksum_kind=kind)
    reader = CudaRingReader(producer.description(), checksum_every=1)  # in-process (rule 6)
    try:
        generator = torch.Generator(device="cuda").manual_seed(5)
        for seq in range(6):  # twice round the ring
            frame = torch.randint(0, 256, (360, 640, 3), dtype=torch.uint8, device="cuda",
                                  generator=generator)
            given = frame.clone()
            message = producer.write_device(frame, seq, float(seq), scratch=scratch)
            assert message.checksum == frames.checksum(given.cpu().numpy(), kind)
            read = reader.read(message)
            assert read.verdict is Verdict.OK and torch.equal(read.tensor, given)
            if not scratch:  # the caller's frame as it was; a scratch one served the checksum
                assert torch.equal(frame, given)
        producer.corrupt_next_frame()
        message = producer.write_device(torch.zeros(360, 640, 3, dtype=torch.uint8,
                                                    device="cuda"), 6, 6.0)
        assert reader.read(message).verdict is Verdict.CHECKSUM_MISMATCH
        with pytest.raises(ValueError, match="does not fit the ring"):
            producer.write_device(torch.zeros(10, 10, 3, dtype=torch.uint8, device="cuda"), 7, 7.0)
    finally:
        reader.close()
        producer.close()


@pytest.mark.parametrize("kind", frames.CHECKSUM_KINDS)
def test_nvdec_frames_write_themselves_into_a_cuda_ring_slot_checked_by_its_consumers(
        kind, monkeypatch):
    """Note [NV12 into the slot]: with the full checksum each NVDEC frame is converted straight
    into the slot by the one kernel, its bytes those of the frame's BGR tensor, the checksum
    theirs; the sampled kind takes the tensor. Consumers accept them and refuse a slot spoiled
    after publishing."""
    from facecast.models import triton_kernels
    from facecast.shared.transport.cuda_ring import CudaRingProducer, CudaRingReader
    from facecast.shared.transport.rings import Verdict

    written = []
    kernel = triton_kernels.nv12_to_slot

    def counted(*args):
        written.append(kernel(*args))
        return written[-1]

    monkeypatch.setattr(triton_kernels, "nv12_to_slot", counted)
    with open_source(_camera("synthetic-h264", width=640, height=360), decode=GPU) as opened:
        assert isinstance(opened, nvdec.NvdecEncodedSyntheticSource), opened.decode
        producer = CudaRingProducer("nvslot", (360, 640, 3), slot_count=3, checksum_kind=kind)
        reader = CudaRingReader(producer.description(), checksum_every=1)  # in-process (rule 6)
        try:
            for seq in range(6):  # twice round the ring
                frame, capture_ts_lsl = opened.read_decoded()
                assert isinstance(frame, nvdec.NvdecFrame)
                expected = frame.bgr().clone()  # its tensor form, from the same NV12 bytes
                message = producer.write_decoded(frame, seq, capture_ts_lsl)
                assert message.checksum == frames.checksum(expected.cpu().numpy(), kind)
                read = reader.read(message)
                assert read.verdict is Verdict.OK and torch.equal(read.tensor, expected), seq
            if kind == "full":
                assert len(written) == 6 and all(w is not None for w in written), written
            else:
                assert written == []
            producer.corrupt_next_frame()
            frame, capture_ts_lsl = opened.read_decoded()
            message = producer.write_decoded(frame, 6, capture_ts_lsl)
            assert reader.read(message).verdict is Verdict.CHECKSUM_MISMATCH
        finally:
            reader.close()
            producer.close()


def test_a_device_frame_after_a_fallback_to_shm_goes_through_a_host_copy():
    from facecast.shared.transport.rings import ShmRingProducer, ShmRingReader, Verdict

    producer = ShmRingProducer("devshm", (360, 640, 3), 2)
    reader = ShmRingReader(producer.description(), device="cuda")
    try:
        frame = torch.randint(0, 256, (360, 640, 3), dtype=torch.uint8, device="cuda")
        message = producer.write_device(frame, 0, 0.0)
        read = reader.read(message)
        assert read.verdict is Verdict.OK and torch.equal(read.tensor, frame)
    finally:
        reader.close()
        producer.close()


# --- the daemon on GPU-decoded cameras -------------------------------------------------------------

FAIL_AFTER_FRAMES = 900  # 30 s at 30 fps: after READY, once the Markers inlet listens
DAEMON_CONFIG = (
    '[daemon]\ntransport = "cuda_ipc"\ndecode = "gpu"\ncameras_per_capture_worker = 2\n'
    'warm_standby = "off"\n'
    '[models]\ndevice = "cuda"\n[output]\nmax_faces = 2\n[web]\nenabled = false\n'
    # Both on GPU 0, in one capture group, where a host has more GPUs (round-robin would put
    # them in a group each: failed so on the two-GPU H200 host, 2026-11-28).
    '[[cameras]]\nid = "h264a"\nsource = "synthetic-h264"\nwidth = 1280\nheight = 720\n'
    'fps = 30\ngpu = 0\n'
    '[[cameras]]\nid = "h264b"\nsource = "synthetic-h264"\nwidth = 1280\nheight = 720\n'
    'fps = 30\ngpu = 0\n')


def _markers(record, kind: str) -> list[tuple[float, dict]]:
    found = []
    for stamp, sample in zip(list(record.timestamps), list(record.samples)):
        event = json.loads(sample[0] if not isinstance(sample, str) else sample)
        if event.get("event") == kind:
            found.append((stamp, event))
    return found


@pytest.mark.daemon
def test_the_daemon_on_gpu_decoded_cameras_and_one_decoder_failing(installed_models, tmp_path):
    parsed = config_mod.loads(DAEMON_CONFIG)
    daemon = Daemon(tmp_path, config_text=DAEMON_CONFIG, env={
        decoding.ALLOW_FAULTS_ENV: "1",
        decoding.INJECT_FAILURE_ENV: f"h264b@{FAIL_AFTER_FRAMES}"})
    try:
        assert daemon.notify.wait_for("READY=1", timeout_s=180), daemon.log_tail()
        group = daemon.worker("capture:cuda:0:0")
        assert group.detail == "", group  # both asked for the GPU and got it: no trouble
        log_text = daemon.log_path.read_text()
        for camera in ("h264a", "h264b"):
            assert f'camera {camera}: decoder gpu (decode = "gpu": H.264 ' in log_text
        markers = daemon.resolve("Markers", count=1)
        faces = daemon.resolve("Face", count=4)
        recorder = Recorder([*faces, *markers])
        try:
            deadline = time.monotonic() + FAIL_AFTER_FRAMES / 30 + 60
            while not _markers(markers[0], "decoder_fallback"):
                assert time.monotonic() < deadline, daemon.log_tail()
                time.sleep(0.2)
            time.sleep(10)  # the failed camera on the CPU decoder for a while
        finally:
            recorder.stop()
        [(failed_at, fallback)] = _markers(markers[0], "decoder_fallback")
        assert fallback["camera"] == "h264b"
        assert fallback["reason"].startswith(f"injected failure after {FAIL_AFTER_FRAMES} frames")
        chosen = [event for _, event in _markers(markers[0], "decoder")
                  if event["camera"] == "h264b"]
        assert chosen and chosen[-1]["decoder"] == "cpu", chosen
        assert chosen[-1]["reason"].startswith("its GPU decoder failed mid-stream")

        status = daemon.status()
        group_after = daemon.worker("capture:cuda:0:0")
        assert group_after.pid == group.pid and group_after.restarts == 0, group_after
        assert group_after.detail.startswith(
            "camera h264b: decoded on the CPU: its GPU decoder failed mid-stream (injected "
            "failure after"), group_after.detail
        for camera in ("h264a", "h264b"):
            capture = next(r for r in status.cameras[camera] if r.source)
            assert capture.source == "ok" and capture.transport == "cuda_ipc", capture

        for camera in ("h264a", "h264b"):
            slots = [r for r in faces if f"-{camera}-face" in r.source_id]
            frames_by_stamp, stamps = frames_of(slots)
            truth = synthetic_truth(parsed.camera(camera))
            score = score_against_truth(frames_by_stamp, stamps, truth.faces_at)
            print(f"{camera} through the daemon:", score.describe())
            assert score.good >= 0.9 * len(stamps), (camera, score.describe())
            gaps = np.diff(stamps)
            if camera == "h264a":  # the group's other camera never stopped
                assert gaps.max() < 1.0, (camera, gaps.max())
                assert stamps[-1] > failed_at + 8
            else:  # back on the CPU decoder within a couple of seconds
                after = stamps[stamps > failed_at]
                assert len(after) >= 0.8 * 30 * 8, (camera, len(after))
                assert after[0] - failed_at < 3.0, (camera, after[0] - failed_at)
    finally:
        daemon.close()


# --- a capture process of eight NVDEC cameras SIGKILLed (issue 22's tests) ------------------------


def test_a_capture_worker_on_a_gpu_warms_the_nvdec_path_before_it_has_cameras():
    """Note [NVDEC path warmed while standing by]: in a fresh process, `warm_up` finds NVDEC
    usable, loads its libraries and runs the NV12 slot kernel (a camera's first frame then only
    launches it)."""
    code = ("import sys, torch\n"
            "from facecast.models import triton_kernels\n"
            "from facecast.workers.capture import nvdec\n"
            "assert nvdec.warm_up(0) is None\n"
            "device = torch.device('cuda', 0)\n"
            "assert triton_kernels.unavailable_reason(device, 'facecast_nv12_to_slot') is None\n"
            "print(sorted(m for m in ('PyNvVideoCodec', 'av', 'triton') if m in sys.modules))\n")
    printed = _in_a_fresh_process(code)
    assert printed.strip().splitlines()[-1] == "['PyNvVideoCodec', 'av', 'triton']", printed


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_warming_the_nvdec_path_of_gpu_1_makes_no_context_on_gpu_0():
    """A capture process of GPU 1 warms its path on GPU 1 alone: a context on GPU 0 as well
    cost 518 MiB of GPU 0 per such process (2026-11-28). The driver's own list of the processes
    on each GPU (nvidia-smi) says where this one is."""
    code = ("import os, subprocess\n"
            "from facecast.workers.capture import nvdec\n"
            "assert nvdec.warm_up(1) is None\n"
            "print(subprocess.run(['nvidia-smi', '--query-compute-apps=pid,gpu_uuid', "
            "'--format=csv,noheader'], capture_output=True, text=True, check=True).stdout)\n"
            "print('pid', os.getpid())\n")
    printed = _in_a_fresh_process(code)
    *apps, own = printed.strip().splitlines()
    pid = own.split()[1]
    uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True).stdout
    gpu_of = {uuid.strip(): index.strip() for index, uuid in
              (line.split(",") for line in uuids.strip().splitlines())}
    on = sorted(gpu_of[uuid.strip()] for app_pid, uuid in
                (line.split(",") for line in apps if line.strip()) if app_pid.strip() == pid)
    assert on == ["1"], (on, printed)


def _in_a_fresh_process(code: str) -> str:
    """What `code` printed in a Python process of its own (nothing of this one's CUDA state)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.daemon
def test_a_capture_process_of_eight_nvdec_cameras_killed_is_back_within_2_s(installed_models,
                                                                            tmp_path):
    """One capture process decodes eight 640x360 H.264 cameras at 30 fps on NVDEC; SIGKILLed,
    its warm spare takes them over: every camera publishes again within 2 s of the kill (issue
    22), with nothing corrupt (tests/test_decoding.py's `a_capture_process_killed`)."""
    back_s = a_capture_process_killed(
        tmp_path, transport="cuda_ipc", decode="gpu", models="cuda", device="cuda:0",
        cameras=8, size=(640, 360), fps=30, samples_before=60, samples_after=30)
    assert max(back_s.values()) < 2.0, back_s
