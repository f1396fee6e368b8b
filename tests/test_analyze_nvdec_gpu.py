"""`facecast analyze` on the real NVDEC (marker gpu; issue 23 item 1, Note [Analysis on NVDEC]):
the frames NVDEC gives are on the GPU and match PyAV's (PSNR >= 40 dB), and the tables of the face
stack on the GPU fed by NVDEC equal those fed by PyAV on the CPU within float tolerance: facecast's
recording (H.264 in Matroska, its sidecar), an MP4 with B-frames, a 1080p file (1088 coded rows).

Needs an NVIDIA GPU with its driver (libnvcuvid.so.1), PyCUDA and pynvvideocodec (the `gpu`
extra) and the models; elsewhere every test skips with the reason. Passed on an H100
(2026-11-26, with NVDEC's RGB output; the bt709 and yuvj420p cases came after that run); the same
paths with NVDEC played by FFmpeg on the CPU are tests/test_analyze_decoding.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("av", reason="PyAV (the `av` wheel) decodes and writes the videos")

from facecast.daemon.cli import analysis_decoding as ad
from facecast.daemon.cli import video_analysis as va
from facecast.workers.capture import decoding
from facecast.workers.inference.pipelines import build_pipeline
from test_analyze import FRAMES, RESUME_EVERY, _analyze, _rows, recording  # noqa: F401
from test_analyze_decoding import _assert_same_rows
from test_decoding import MIN_PSNR_DB, _psnr_db, _write_bt709_file, _write_video

_REASON = decoding.nvdec_unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=f"needs NVDEC: {_REASON}")]

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def gpu_pipeline(installed_models):
    face, problem = build_pipeline(va.StackConfig(), CUDA, blendshapes=True)
    assert face.landmarker == "face_landmarker" and not problem, problem
    return face


@pytest.mark.parametrize("what, nvdec_rgb", [("h264", True), ("bt709", True),
                                              ("yuvj420p", False)])
def test_nvdecs_frames_are_on_the_gpu_and_match_pyavs(tmp_path, what, nvdec_rgb):
    """NVDEC's own RGB for studio range (BT.601 or a BT.709-flagged stream), facecast's
    conversion for full range (Note [NV12 to BGR])."""
    video = Path(_write_bt709_file(tmp_path / "bt709.mp4", frames=30) if what == "bt709"
                 else _write_video(tmp_path / f"{what}.mp4", frames=30,
                                   pix_fmt="yuvj420p" if what == "yuvj420p" else "yuv420p"))
    decoder = ad.open_decoder(video, "gpu", None, CUDA)
    reference = va.PyAvDecoder(video)
    try:
        assert decoder.describe() == "NVDEC (GPU 0)", decoder.events
        assert decoder.gpu.nvdec_rgb is nvdec_rgb
        frames = list(decoder.frames())
        expected = list(reference.frames())
        assert [(f.index, f.pts) for f in frames] == [(f.index, f.pts) for f in expected]
        for frame, cpu in zip(frames, expected):
            assert isinstance(frame.image, torch.Tensor) and frame.image.device.type == "cuda"
            assert _psnr_db(frame.image.cpu().numpy(), cpu.image) >= MIN_PSNR_DB, frame.index
        assert len(decoder.events) == 1  # no fallback
    finally:
        decoder.close()
        reference.close()


def test_analysis_on_nvdec_equals_analysis_on_pyav(gpu_pipeline, recording, tmp_path):
    video = recording[0]
    on_cpu = _analyze(gpu_pipeline, [video], tmp_path / "pyav",
                      va.Settings(resume_every_frames=RESUME_EVERY, decode="cpu"))[0]
    on_gpu = _analyze(gpu_pipeline, [video], tmp_path / "nvdec",
                      va.Settings(resume_every_frames=RESUME_EVERY, decode="gpu"))[0]
    assert on_cpu.decoder.describe() == "PyAV (CPU)"
    assert on_gpu.decoder.describe() == "NVDEC (GPU 0)", on_gpu.decoder.events
    rows = _rows(on_gpu.table_path)
    assert sorted({int(row["frame"]) for row in rows}) == list(range(FRAMES))
    _assert_same_rows(rows, _rows(on_cpu.table_path))


@pytest.mark.parametrize("name, bframes, size", [("bframes.mp4", 3, (320, 240)),
                                                 ("1080p.mkv", 0, (1920, 1080))])
def test_nvdec_and_pyav_tables_agree_on_other_files(gpu_pipeline, tmp_path, name, bframes, size):
    video = Path(_write_video(tmp_path / name, bframes=bframes, size=size, frames=30, fps=15))
    on_cpu = _analyze(gpu_pipeline, [video], tmp_path / "pyav", va.Settings(decode="cpu"))[0]
    on_gpu = _analyze(gpu_pipeline, [video], tmp_path / "nvdec", va.Settings(decode="gpu"))[0]
    assert on_gpu.decoder.describe() == "NVDEC (GPU 0)", on_gpu.decoder.events
    rows = _rows(on_gpu.table_path)
    assert sorted({int(row["frame"]) for row in rows}) == list(range(30))
    _assert_same_rows(rows, _rows(on_cpu.table_path))
