"""`facecast analyze` on NVDEC (Note [Analysis on NVDEC]), on any machine: the NVDEC path of
facecast.daemon.cli.analysis_decoding with FFmpeg playing NVDEC's part (`CpuNvdec` of
tests/test_decoding.py: only the decoder call and the device memory are stand-ins), against the
PyAV path's tables on the same files: the same rows (frames, times, track ids; the numbers
within float tolerance, the two NV12 -> BGR conversions differing by a few grey levels); every
reason for the CPU decoder; a failure mid-file that leaves the rest of the file to PyAV with every
frame a row exactly once; a resume on NVDEC to the same table.

The same against the real NVDEC: tests/test_analyze_nvdec_gpu.py (marker gpu)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("av", reason="PyAV (the `av` wheel) decodes and writes the videos")

from facecast.daemon.cli import analysis_decoding as ad
from facecast.daemon.cli import analyze as analyze_command
from facecast.daemon.cli import video_analysis as va
from facecast.shared.face_schema import BLENDSHAPE_NAMES
from facecast.workers.capture import decoding, nvdec
from test_analyze import (  # noqa: F401 - pipeline, recording, analysed are fixtures
    FRAMES,
    RESUME_EVERY,
    _analyze,
    _rows,
    analysed,
    pipeline,
    recording,
)
from test_decoding import CpuNvdec, _cpu_output_at, _NoStream, _write_video

NVDEC_SETTINGS = va.Settings(resume_every_frames=RESUME_EVERY, decode="gpu")
# The numbers of a frame decoded by the two decoders (Note [NV12 to BGR]: 45.5 dB, at most 3
# grey levels apart on the synthetic scene): what the tracker's landmarks make of that. Seen on
# the 2-core machine: boxes 0.17 px, head pose 0.23 (degrees or cm), scores and most
# blendshapes below 0.05; but the gaze blendshapes follow the irises, a pixel or two in a crop,
# and after a fallback mid-file (which changes the frames the tracker follows from) one of them
# moved by 0.139 (eyeLookOutLeft). So blendshapes are held by their mean over a face (the
# expression) and each one only against a gross error. Boxes follow the landmarks, which the
# mesh gives at its crop's resolution (a 192-256 px crop of about 1.5 face widths): what a grey
# level moves grows with the face, so a box is held to PIXELS_ATOL or BOX_WIDTH_RTOL of its
# width, whichever is more (on the H100, 2026-11-26: 1.66 px at frame 14 of the 1080p file,
# whose faces are ~300 px wide, under a crop pixel there).
PIXELS_ATOL = 1.5
BOX_WIDTH_RTOL = 0.01
SCORES_ATOL = 0.1
DEGREES_ATOL = 2.0
BLENDSHAPES_MEAN_ATOL = 0.02
BLENDSHAPE_ATOL = 0.25


@pytest.fixture
def cpu_nvdec(monkeypatch):
    """analysis_decoding's NVDEC path as it is, with `CpuNvdec` for NVDEC, host memory for the
    device's, and a run that may try the GPU (the stack on the CPU here)."""
    CpuNvdec.made.clear()
    monkeypatch.setattr(nvdec, "NvdecDecoder", CpuNvdec)
    monkeypatch.setattr(ad.NvdecFileDecoder, "_new_streams", lambda self: (_NoStream(), None))
    monkeypatch.setattr(ad.NvdecFileDecoder, "_output_at", _cpu_output_at)
    monkeypatch.setattr(ad.NvdecFileDecoder, "_hand_over", lambda self, frame: None)
    monkeypatch.setattr(ad.NvdecFileDecoder, "_release_thread", staticmethod(lambda: None))
    monkeypatch.setattr(ad, "gpu_decode_problem", lambda requested, device: None)
    yield CpuNvdec
    CpuNvdec.buffers.clear()


def _assert_same_rows(rows: list[dict], reference: list[dict]) -> None:
    """The same frames, times, capture times, problems and track ids, in the same order; the
    channels within the two decoders' difference."""
    assert [(r["frame"], r["pts_s"], r["capture_ts_lsl"], r["problem"], r["track_id"])
            for r in rows] == [(r["frame"], r["pts_s"], r["capture_ts_lsl"], r["problem"],
                                r["track_id"]) for r in reference]
    for row, expected in zip(rows, reference):
        blendshape_differences = []
        for name, text in row.items():
            if name in ("frame", "pts_s", "capture_ts_lsl", "problem", "track_id") or not text:
                assert text == expected[name], (row["frame"], name)
                continue
            difference = abs(float(text) - float(expected[name]))
            if name in BLENDSHAPE_NAMES:
                blendshape_differences.append(difference)
                tolerance = BLENDSHAPE_ATOL
            else:
                width_px = float(expected["box_x2"]) - float(expected["box_x1"])
                tolerance = (max(PIXELS_ATOL, BOX_WIDTH_RTOL * width_px) if name.startswith("box_")
                             else DEGREES_ATOL if name.startswith("head_") else SCORES_ATOL)
            assert difference <= tolerance, (row["frame"], name, text, expected[name])
        if blendshape_differences:
            assert np.mean(blendshape_differences) <= BLENDSHAPES_MEAN_ATOL, (
                row["frame"], np.mean(blendshape_differences))


def _summary(item: va.FileAnalysis) -> dict:
    return json.loads(item.summary_path.read_text())


def test_nvdec_gives_the_rows_of_pyav(cpu_nvdec, pipeline, recording, analysed, tmp_path):
    item = _analyze(pipeline, [recording[0]], tmp_path, NVDEC_SETTINGS)[0]
    assert len(cpu_nvdec.made) == 1 and cpu_nvdec.made[0].low_latency  # the recorder: no B-frames
    assert cpu_nvdec.made[0].rgb  # studio range: NVDEC's own RGB (Note [NV12 to BGR])
    assert item.decoder.events[0].decoder == "NVDEC (GPU 0)", item.decoder.events
    assert len(item.decoder.events) == 1
    _assert_same_rows(_rows(item.table_path), _rows(analysed.table_path))
    summary = _summary(item)
    assert summary["decoder"] == "NVDEC (GPU 0)" and summary["ok"] and summary["complete"]
    assert (summary["frames"], summary["frames_measured"], summary["faces"]) == (
        FRAMES, FRAMES, 2 * FRAMES)


@pytest.mark.parametrize("name, codec, bframes", [("bframes.mp4", "libx264", 3),
                                                  ("h265.mkv", "libx265", 0)])
def test_nvdec_gives_pyavs_frames_and_times_with_b_frames_and_h265(cpu_nvdec, pipeline, tmp_path,
                                                                   name, codec, bframes):
    """No sidecar: frames counted, times from the packets in presentation order."""
    video = Path(_write_video(tmp_path / name, codec, bframes=bframes, frames=30, fps=15))
    reference = _analyze(pipeline, [video], tmp_path / "pyav", va.Settings(decode="cpu"))[0]
    item = _analyze(pipeline, [video], tmp_path / "nvdec", va.Settings(decode="gpu"))[0]
    assert _summary(item)["decoder"] == "NVDEC (GPU 0)"
    assert cpu_nvdec.made[-1].low_latency == (bframes == 0)
    if bframes:
        assert cpu_nvdec.made[-1].ended  # the end of the stream gave the frames it held
    rows = _rows(item.table_path)
    assert sorted({int(row["frame"]) for row in rows}) == list(range(30))
    _assert_same_rows(rows, _rows(reference.table_path))


def test_every_reason_for_the_cpu_decoder(pipeline, monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert ad.gpu_decode_problem("cpu", gpu) == "--decode cpu"
    assert ad.gpu_decode_problem("auto", cpu).startswith("the face stack runs on the CPU (cpu)")
    monkeypatch.setattr(decoding, "nvdec_unavailable_reason",
                        lambda: "pynvvideocodec is not installed (pip install 'facecast[gpu]')")
    assert ad.gpu_decode_problem("gpu", gpu) == (
        "pynvvideocodec is not installed (pip install 'facecast[gpu]')")
    monkeypatch.setattr(decoding, "nvdec_unavailable_reason", lambda: None)
    assert ad.gpu_decode_problem("auto", gpu) is None
    with pytest.raises(ValueError, match="not one of auto, gpu, cpu"):
        ad.gpu_decode_problem("nvdec", gpu)
    # The run's reason reaches the files' decoders and summaries.
    analyzer = va.Analyzer(pipeline, va.Settings(decode="gpu"))
    assert analyzer.gpu_decode_problem.startswith("the face stack runs on the CPU")


@pytest.mark.parametrize("name, codec, pix_fmt, reason", [
    ("mpeg4.mp4", "mpeg4", "yuv420p", "--decode gpu, but its video is mpeg4; NVDEC takes H.264 "
     "and H.265"),
    ("444.mp4", "libx264", "yuv444p", "--decode gpu, but its video is H.264 High 4:4:4 "
     "Predictive 320x240 yuv444p: the GPU path converts 8-bit 4:2:0 only"),
])
def test_a_file_nvdec_does_not_take_is_decoded_by_pyav_with_the_reason(
        cpu_nvdec, pipeline, tmp_path, name, codec, pix_fmt, reason):
    video = Path(_write_video(tmp_path / name, codec, pix_fmt=pix_fmt, frames=6))
    item = _analyze(pipeline, [video], tmp_path, va.Settings(decode="gpu"))[0]
    assert [(e.decoder, e.at_frame, e.reason) for e in item.decoder.events] == [
        ("PyAV (CPU)", 0, reason)]
    assert not cpu_nvdec.made
    assert sorted({int(row["frame"]) for row in _rows(item.table_path)}) == list(range(6))
    assert _summary(item)["decoder"] == "PyAV (CPU)"


def test_a_decoder_that_cannot_be_made_leaves_the_file_to_pyav(cpu_nvdec, pipeline, recording,
                                                                analysed, tmp_path, monkeypatch):
    def no_decoder(*args):
        raise RuntimeError("cuvidCreateDecoder: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(nvdec, "NvdecDecoder", no_decoder)
    item = _analyze(pipeline, [recording[0]], tmp_path, NVDEC_SETTINGS)[0]
    assert [(e.decoder, e.at_frame) for e in item.decoder.events] == [
        ("NVDEC (GPU 0)", 0), ("PyAV (CPU)", 0)]
    assert item.decoder.events[1].reason == (
        "NVDEC could not make a decoder (RuntimeError: cuvidCreateDecoder: "
        "CUDA_ERROR_OUT_OF_MEMORY)")
    # All of it PyAV's: the table of the PyAV run, byte for byte.
    assert item.table_path.read_bytes() == analysed.table_path.read_bytes()


class _FailsAfter(CpuNvdec):
    """NVDEC failing at its `fail_at`th packet (from 0)."""

    fail_at = 10

    def decode(self, data, pts):
        if len(self.packets) == self.fail_at:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")
        return super().decode(data, pts)


@pytest.mark.parametrize("decode_ahead", [True, False])
def test_a_failure_mid_file_leaves_the_rest_to_pyav_every_frame_once(
        cpu_nvdec, pipeline, recording, analysed, tmp_path, monkeypatch, decode_ahead):
    monkeypatch.setattr(nvdec, "NvdecDecoder", _FailsAfter)
    settings = va.Settings(resume_every_frames=RESUME_EVERY, decode="gpu",
                           decode_ahead=decode_ahead)
    item = _analyze(pipeline, [recording[0]], tmp_path, settings)[0]
    events = item.decoder.events
    assert [(e.decoder, e.at_frame) for e in events] == [("NVDEC (GPU 0)", 0), ("PyAV (CPU)", 10)]
    assert events[1].reason == "NVDEC failed on packet 10 (RuntimeError: CUDA_ERROR_LAUNCH_FAILED)"
    rows = _rows(item.table_path)
    # Every frame a row per face, once: none lost, none twice; the numbers as PyAV's.
    assert [int(row["frame"]) for row in rows] == [index for index in range(FRAMES)
                                                   for _ in range(2)]
    _assert_same_rows(rows, _rows(analysed.table_path))
    summary = _summary(item)
    assert summary["decoder"] == "NVDEC (GPU 0), then PyAV (CPU) from frame 10"
    assert summary["decoder_changes"][1] == {"decoder": "PyAV (CPU)", "at_frame": 10,
                                             "reason": events[1].reason}
    assert (summary["frames"], summary["frames_measured"], summary["faces"],
            summary["frames_unreadable"]) == (FRAMES, FRAMES, 2 * FRAMES, 0)


def test_a_failure_with_frames_held_back_gives_them_from_pyav(cpu_nvdec, pipeline, tmp_path,
                                                              monkeypatch):
    """With B-frames NVDEC holds frames back: those it had not given when it failed come from
    PyAV, once."""
    video = Path(_write_video(tmp_path / "bframes.mkv", bframes=3, frames=30, fps=15))
    reference = _analyze(pipeline, [video], tmp_path / "pyav", va.Settings(decode="cpu"))[0]
    monkeypatch.setattr(nvdec, "NvdecDecoder", _FailsAfter)
    item = _analyze(pipeline, [video], tmp_path / "nvdec", va.Settings(decode="gpu"))[0]
    [gpu, cpu] = item.decoder.events
    assert cpu.decoder == "PyAV (CPU)" and 0 < cpu.at_frame < 10  # frames were held back
    rows = _rows(item.table_path)
    assert sorted({int(row["frame"]) for row in rows}) == list(range(30))
    _assert_same_rows(rows, _rows(reference.table_path))


def test_an_interrupted_analysis_on_nvdec_resumes_to_the_same_table(cpu_nvdec, pipeline,
                                                                    recording, tmp_path):
    whole = _analyze(pipeline, [recording[0]], tmp_path / "whole", NVDEC_SETTINGS)[0]

    def interrupt(item: va.FileAnalysis) -> None:
        if item.next_frame >= 13:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _analyze(pipeline, [recording[0]], tmp_path / "cut", NVDEC_SETTINGS, on_progress=interrupt)
    resumed = _analyze(pipeline, [recording[0]], tmp_path / "cut", NVDEC_SETTINGS)[0]
    assert resumed.resumed_from_frame == 8
    assert resumed.table_path.read_bytes() == whole.table_path.read_bytes()


def test_files_on_both_decoders_are_measured_in_one_batch(cpu_nvdec, pipeline, recording,
                                                          analysed, tmp_path):
    """A file on NVDEC (tensors) and one on PyAV (numpy) in the same batches."""
    mpeg4 = Path(_write_video(tmp_path / "mpeg4.mp4", "mpeg4", frames=6))
    nvdec_item, pyav_item = _analyze(pipeline, [recording[0], mpeg4], tmp_path, NVDEC_SETTINGS)
    assert nvdec_item.decoder.describe() == "NVDEC (GPU 0)"
    assert pyav_item.decoder.describe() == "PyAV (CPU)"
    _assert_same_rows(_rows(nvdec_item.table_path), _rows(analysed.table_path))
    assert sorted({int(row["frame"]) for row in _rows(pyav_item.table_path)}) == list(range(6))


def test_the_command_says_each_reason_once(capsys):
    class Item:
        video = Path("a.mkv")

        class decoder:  # noqa: N801 - a stand-in
            events = [ad.DecoderEvent("NVDEC (GPU 0)", 0, "--decode gpu: H.264")]

    class Analyzer:
        gpu_decode_problem = None
        settings = va.Settings(decode="gpu")

        class pipeline:  # noqa: N801
            device = "cpu"

    notices = analyze_command._DecoderNotices(Analyzer, "gpu", quiet=False)
    notices.say_run()
    item = Item()
    notices(item)
    notices(item)
    assert capsys.readouterr().err == ""
    item.decoder.events = item.decoder.events + [
        ad.DecoderEvent("PyAV (CPU)", 10, "NVDEC failed on packet 10 (boom)")]
    for _ in range(3):
        notices(item)
    assert capsys.readouterr().err == (
        "facecast: a.mkv: PyAV (CPU) decodes from frame 10 on: NVDEC failed on packet 10 "
        "(boom)\n")
    # The run's reason, before the work, once; a file the GPU refused, once.
    Analyzer.gpu_decode_problem = "pynvvideocodec is not installed"
    notices = analyze_command._DecoderNotices(Analyzer, "gpu", quiet=False)
    notices.say_run()
    assert capsys.readouterr().err == ("facecast: decoding on the CPU (PyAV): --decode gpu, but "
                                       "pynvvideocodec is not installed\n")
    Analyzer.gpu_decode_problem = None
    other = Item()
    other.video = Path("b.avi")
    other.decoder = type("D", (), {"events": [ad.DecoderEvent(
        "PyAV (CPU)", 0, "--decode gpu, but its video is mpeg4")]})
    notices(other)
    notices(other)
    assert capsys.readouterr().err == (
        "facecast: b.avi: decoding on the CPU (PyAV): --decode gpu, but its video is mpeg4\n")
    # auto with the stack on the CPU: nothing to say; --quiet: nothing.
    quiet = analyze_command._DecoderNotices(Analyzer, "auto", quiet=False)
    quiet.say_run()
    quiet(other)
    assert capsys.readouterr().err == ""
