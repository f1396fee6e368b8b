"""Note [One kernel for a batch of crops]: the crops of a GPU in one Triton kernel are the
bilinear gathers' (CropTaps.crop, PyTorch's kernels), on the CPU through Triton's interpreter
and on the GPU compiled; and where the kernel cannot serve, PyTorch's kernels crop."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import skimage.data
import torch

from facecast.models import crop_kernel, roi

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter: the kernel on CPU tensors (numpy), the arithmetic a GPU runs."""
    pytest.importorskip("triton", reason="Triton is not installed (the `test` extra has it)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(crop_kernel, "_failed", None)


def _frames(bgr: bool) -> list[np.ndarray]:
    frames = [skimage.data.astronaut(), skimage.data.coffee()]  # 512x512 and 400x600: padded rows
    return [np.ascontiguousarray(frame[..., ::-1]) for frame in frames] if bgr else frames


# frame, centre, width and height, rotation
SPECS = [
    (0, (225.3, 130.7), (150.0, 150.0), math.radians(20)),
    (1, (300.0, 200.0), (260.0, 200.0), math.radians(-35)),
    (0, (480.0, 500.0), (120.0, 120.0), 0.3),  # over the bottom-right corner
    (1, (20.0, 390.0), (100.0, 100.0), 0.0),  # over the bottom-left corner of the shorter frame
    (1, (900.0, -300.0), (80.0, 80.0), 1.0),  # wholly beyond the frame
    (1, (599.0, 399.0), (3.0, 5.0), 0.0),  # on the last pixel: the right and lower taps stay in
]


def _rects(device="cpu") -> tuple[roi.RotatedRects, torch.Tensor]:
    rects = roi.RotatedRects(torch.tensor([s[1] for s in SPECS]), torch.tensor([s[2] for s in SPECS]),
                             torch.tensor([s[3] for s in SPECS]))
    return rects.to(device), torch.tensor([s[0] for s in SPECS], device=device)


@pytest.mark.parametrize("bgr, out_hw, value_range, border", [
    (True, (96, 96), (0.0, 1.0), "replicate"), (False, (64, 112), (-1.0, 1.0), "replicate"),
    (True, (64, 112), (-1.0, 1.0), "zero"), (False, (96, 96), (0.0, 255.0), "zero")])
def test_the_kernel_crops_as_the_gathers(interpreted, bgr, out_hw, value_range, border):
    """float32: the gathers' values to float rounding (< 0.01 of a grey level); float16: the
    float32 values rounded once (the gathers blend in float16, a little further off)."""
    batch = roi.FrameBatch(_frames(bgr), "cpu", bgr=bgr)
    rects, index = _rects()
    gathered = roi.crop_taps(batch, index, rects, out_hw, border=border, value_range=value_range).crop(batch)
    grey = (value_range[1] - value_range[0]) / 255.0
    fused = crop_kernel.crop(batch, index, rects, out_hw, border, torch.float32, value_range)
    assert fused is not None, crop_kernel.unavailable_reason(torch.device("cpu"))
    assert fused.shape == gathered.shape == (len(SPECS), *out_hw, 3) and fused.dtype == torch.float32
    assert (fused - gathered).abs().max().item() < 0.01 * grey
    half = crop_kernel.crop(batch, index, rects, out_hw, border, torch.float16, value_range)
    assert half.dtype == torch.float16
    # Rounded to float16 once: half a unit in the last place of the largest magnitude.
    bound = max(abs(value_range[0]), abs(value_range[1])) * 2.0 ** -11 + 0.01 * grey
    assert (half.float() - gathered).abs().max().item() <= bound
    if border == "zero":  # black beyond the frame
        assert (fused[4] == value_range[0]).all()


def test_the_kernel_reads_frames_where_they_lie(interpreted):
    """Frames in rows of one buffer with a gap (FrameBatch.in_place: row offsets) crop as the
    same frames stacked."""
    astronaut = np.ascontiguousarray(skimage.data.astronaut()[:300, :400, ::-1])
    coffee = np.ascontiguousarray(skimage.data.coffee()[:200, :400, ::-1])
    buffer = torch.zeros(astronaut.nbytes + 4 * 400 * 3 + coffee.nbytes, dtype=torch.uint8)
    first = buffer[:astronaut.nbytes].view(astronaut.shape)
    second = buffer[-coffee.nbytes:].view(coffee.shape)
    first.copy_(torch.from_numpy(astronaut))
    second.copy_(torch.from_numpy(coffee))
    in_place = roi.FrameBatch.in_place([first, second], "cpu")
    assert in_place.row_offsets_px == [0, 304]
    stacked = roi.FrameBatch([astronaut, coffee], "cpu")
    rects = roi.RotatedRects(torch.tensor([[200.0, 130.0], [200.0, 190.0], [390.0, 10.0]]),
                             torch.tensor([[150.0, 150.0], [180.0, 120.0], [60.0, 60.0]]),
                             torch.tensor([0.35, -0.5, 0.0]))
    index = torch.tensor([0, 1, 1])
    where_they_lie = crop_kernel.crop(in_place, index, rects, (64, 64), "replicate", torch.float32, (0.0, 1.0))
    assert torch.equal(where_they_lie,
                       crop_kernel.crop(stacked, index, rects, (64, 64), "replicate", torch.float32, (0.0, 1.0)))
    assert torch.equal(crop_kernel.crop(stacked, index[:0], rects[:0], (64, 64), "replicate", torch.float32,
                                        (0.0, 1.0)), torch.zeros(0, 64, 64, 3))


def test_where_the_kernel_cannot_serve_it_says_why_once(monkeypatch, caplog):
    """Not for CPU tensors (OpenCV crops there); not for other dtypes; a failing compiler or
    launcher is logged once, and from then on crop_rois keeps PyTorch's kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(crop_kernel, "_failed", None)
    assert crop_kernel.unavailable_reason(torch.device("cpu")) == "the kernel is for CUDA devices"
    batch = roi.FrameBatch(_frames(True), "cpu")
    rects, index = _rects()
    assert crop_kernel.crop(batch, index, rects, (8, 8), "zero", torch.float32, (0.0, 1.0)) is None

    def no_compiler(interpreted):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(crop_kernel, "_kernel", no_compiler)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as for a GPU: the kernel is asked for
    with caplog.at_level(logging.WARNING, logger="facecast.models.crop_kernel"):
        for _ in range(3):
            assert crop_kernel.crop(batch, index, rects, (8, 8), "zero", torch.float32, (0.0, 1.0)) is None
        assert crop_kernel.prepare(torch.device("cpu"), [(torch.float32, "zero")]).startswith(
            "RuntimeError: Failed to find C compiler")
    warnings = [r.getMessage() for r in caplog.records if "one-kernel crop" in r.getMessage()]
    assert len(warnings) == 1 and "C compiler" in warnings[0] and "PyTorch's kernels" in warnings[0]
    assert crop_kernel.crop(batch, index, rects, (8, 8), "zero", torch.bfloat16, (0.0, 1.0)) is None


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_crop_rois_is_one_kernel_with_the_gathers_values():
    """On the GPU machine the kernel compiles and serves crop_rois (a promise of the speed
    path), with the gathers' values, at the measuring stage's and the detectors' shapes."""
    device = torch.device("cuda")
    assert crop_kernel.prepare(device, [(torch.float16, "replicate"), (torch.float32, "zero")]) is None
    for bgr in (True, False):
        batch = roi.FrameBatch(_frames(bgr), device, bgr=bgr)
        rects, index = _rects(device)
        for border, value_range in (("replicate", (0.0, 1.0)), ("zero", (-1.0, 1.0))):
            gathered = roi.crop_taps(batch, index, rects, (256, 256), border=border,
                                     value_range=value_range).crop(batch)
            grey = (value_range[1] - value_range[0]) / 255.0
            fused = roi.crop_rois(batch, index, rects, 256, border=border, value_range=value_range)
            assert (fused - gathered).abs().max().item() < 0.01 * grey
            half = roi.crop_rois(batch, index, rects, 256, border=border, dtype=torch.float16,
                                 value_range=value_range)
            assert (half.float() - gathered).abs().max().item() <= 2.0 ** -11 + 0.01 * grey
    assert crop_kernel.unavailable_reason(device) is None  # nothing fell back on the way
