"""Note [Kernels of our own]: each Triton kernel gives its PyTorch chain's results (the crops:
CropTaps.crop's bilinear gathers; the weighted NMS's clustering: nms._clusters), on the CPU
through Triton's interpreter and on the GPU compiled; where the kernels cannot serve, the
chains run and the reason is said once."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import skimage.data
import torch

from facecast.models import nms, roi, triton_kernels

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter: the kernels on CPU tensors (numpy), the arithmetic a GPU runs.
    Triton decides at its import whether its own library (tl.sum...) is interpreted, so the
    variable comes first; and where a GPU is, the kernels are compiled there instead (its gpu
    tests below), since an interpreted library would stay so for the whole process."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the kernels run compiled (the gpu tests)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton", reason="Triton is not installed (the `test` extra has it)")
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.sum, InterpretedFunction):
        pytest.skip("Triton was imported in this process before, without its interpreter")
    monkeypatch.setattr(triton_kernels, "_failed", None)


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
    fused = triton_kernels.crop(batch, index, rects, out_hw, border, torch.float32, value_range)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert fused.shape == gathered.shape == (len(SPECS), *out_hw, 3) and fused.dtype == torch.float32
    assert (fused - gathered).abs().max().item() < 0.01 * grey
    half = triton_kernels.crop(batch, index, rects, out_hw, border, torch.float16, value_range)
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
    where_they_lie = triton_kernels.crop(in_place, index, rects, (64, 64), "replicate", torch.float32, (0.0, 1.0))
    assert torch.equal(where_they_lie,
                       triton_kernels.crop(stacked, index, rects, (64, 64), "replicate", torch.float32, (0.0, 1.0)))
    assert torch.equal(triton_kernels.crop(stacked, index[:0], rects[:0], (64, 64), "replicate", torch.float32,
                                        (0.0, 1.0)), torch.zeros(0, 64, 64, 3))


def _nms_candidates(rows: int, count: int, seed: int, device="cpu"):
    """Sorted candidates as nms._candidates makes them: boxes around a few faces a row (many
    overlapping, some degenerate, equal scores among them), invalid ones last with score 0."""
    gen = torch.Generator().manual_seed(seed)
    faces = torch.rand(rows, 3, 2, generator=gen) * 400
    which = torch.randint(0, 3, (rows, count), generator=gen)
    centres = faces.gather(1, which[..., None].expand(-1, -1, 2)) + torch.randn(rows, count, 2, generator=gen) * 6
    sizes = 40 + torch.rand(rows, count, 1, generator=gen) * 30
    boxes = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=-1)
    boxes[:, 5, 2:] = boxes[:, 5, :2]  # no area: IoU 0 with everything, its own cluster
    scores = (torch.rand(rows, count, generator=gen) * 8).round() / 8  # ties
    valid = torch.rand(rows, count, generator=gen) > 0.25
    valid[-1] = False  # a row with no detection
    keypoints = centres[..., None, :] + torch.randn(rows, count, 6, 2, generator=gen)
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    ranked, order = scores.topk(count, dim=1)
    pick = lambda field: field.gather(1, order.view(rows, count, *[1] * (field.dim() - 2)).expand_as(field))
    valid = torch.isfinite(ranked)
    return (pick(boxes).to(device), torch.where(valid, ranked, torch.zeros_like(ranked)).to(device),
            pick(keypoints).to(device), valid.to(device))


def _assert_same_clusters(fused, expected):
    boxes, keypoints, scores, valid = fused
    assert torch.equal(valid, expected.valid)
    assert torch.equal(scores, expected.scores)  # the leaders' scores, no arithmetic
    assert torch.allclose(boxes, expected.boxes, rtol=1e-5, atol=1e-3)
    assert torch.allclose(keypoints, expected.keypoints, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("count, slots", [(128, 8), (37, 4), (16, 8)])
def test_the_kernel_clusters_as_the_weighted_nms(interpreted, count, slots):
    """The same clusters (memberships, leaders' scores) and the same blends to float rounding
    as nms._clusters, with a candidate count that is not a power of two, more slots than
    clusters, degenerate boxes, tied scores and a row without a detection."""
    candidates = _nms_candidates(rows=6, count=count, seed=count)
    expected = nms._clusters(*candidates, 0.3, slots)
    assert expected.valid.any(dim=1)[:-1].all() and not expected.valid[-1].any()
    fused = triton_kernels.nms_clusters(*candidates, 0.3, slots)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    _assert_same_clusters(fused, expected)
    assert triton_kernels.nms_clusters(*(c[:0] for c in candidates), 0.3, slots)[3].shape == (0, slots)


def _faces_to_filter(count: int, seed: int, device="cpu"):
    """A batch's faces for the duplicate filter: frames of up to 8 faces, interleaved, several
    faces on one person (overlapping boxes), tied scores, some not eligible, padding rows."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, max(1, count // 5), (count,), generator=gen).float()
    groups[-3:] = -1.0  # padding rows: copies of real ones, in a group of their own
    people = torch.rand(count, 2, generator=gen) * 300
    same = torch.randint(0, count, (count,), generator=gen)
    centres = torch.where((torch.rand(count, 1, generator=gen) < 0.5), people[same], people)
    centres = centres + torch.randn(count, 2, generator=gen) * 5
    sizes = 60 + torch.rand(count, 1, generator=gen) * 40
    boxes = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=1)
    scores = (torch.rand(count, generator=gen) * 6).round() / 6
    eligible = torch.rand(count, generator=gen) > 0.2
    counts = torch.bincount((groups + 1).long())
    steps = int(counts.max())
    return [t.to(device) for t in (boxes, scores, groups, eligible)], steps


@pytest.mark.parametrize("count, max_kept", [(64, 4), (45, 2), (7, 8)])
def test_the_kernel_filters_duplicates_as_the_tensors(interpreted, count, max_kept):
    """The same kept faces and ranks as nms.drop_overlapping_batched's tensors."""
    (boxes, scores, groups, eligible), steps = _faces_to_filter(count, seed=count)
    expected = nms.drop_overlapping_batched(boxes, scores, groups, eligible, 0.5, max_kept, steps)
    assert 0 < int(expected[0].sum()) < int(eligible.sum())  # something was dropped
    fused = triton_kernels.drop_overlapping(boxes, scores, groups, eligible, 0.5, max_kept, steps)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])


def test_where_the_kernel_cannot_serve_it_says_why_once(monkeypatch, caplog):
    """Not for CPU tensors (OpenCV crops there); not for other dtypes; a failing compiler or
    launcher is logged once, and from then on crop_rois keeps PyTorch's kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels, "_failed", None)
    assert triton_kernels.unavailable_reason(torch.device("cpu")) == "the kernels are for CUDA devices"
    batch = roi.FrameBatch(_frames(True), "cpu")
    rects, index = _rects()
    assert triton_kernels.crop(batch, index, rects, (8, 8), "zero", torch.float32, (0.0, 1.0)) is None

    def no_compiler(interpreted):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(triton_kernels, "_kernels", no_compiler)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as for a GPU: the kernel is asked for
    with caplog.at_level(logging.WARNING, logger="facecast.models.triton_kernels"):
        for _ in range(3):
            assert triton_kernels.crop(batch, index, rects, (8, 8), "zero", torch.float32, (0.0, 1.0)) is None
        assert triton_kernels.prepare(torch.device("cpu"), [(torch.float32, "zero")]).startswith(
            "RuntimeError: Failed to find C compiler")
    warnings = [r.getMessage() for r in caplog.records if "Triton's kernels" in r.getMessage()]
    assert len(warnings) == 1 and "C compiler" in warnings[0] and "PyTorch's kernels" in warnings[0]
    assert triton_kernels.crop(batch, index, rects, (8, 8), "zero", torch.bfloat16, (0.0, 1.0)) is None


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_crop_rois_is_one_kernel_with_the_gathers_values():
    """On the GPU machine the kernel compiles and serves crop_rois (a promise of the speed
    path), with the gathers' values, at the measuring stage's and the detectors' shapes."""
    device = torch.device("cuda")
    assert triton_kernels.prepare(device, [(torch.float16, "replicate"), (torch.float32, "zero")]) is None
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
    assert triton_kernels.unavailable_reason(device) is None  # nothing fell back on the way


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_weighted_nms_clusters_in_one_kernel():
    """On the GPU machine nms._clusters runs the kernel, with the PyTorch chain's clusters."""
    device = torch.device("cuda")
    candidates = _nms_candidates(rows=64, count=128, seed=3, device=device)
    fused = triton_kernels.nms_clusters(*candidates, 0.3, 8)
    assert fused is not None, triton_kernels.unavailable_reason(device)
    expected = nms._clusters(*(c.cpu() for c in candidates), 0.3, 8)  # PyTorch's chain, on the CPU
    _assert_same_clusters(tuple(t.cpu() for t in fused), expected)
    found = nms.weighted_nms(candidates[0], candidates[1], candidates[2], candidates[3], 0.3, 8)
    assert torch.equal(found.valid.cpu(), expected.valid)


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_duplicate_filter_is_one_kernel():
    """On the GPU machine drop_overlapping_batched runs the kernel, with the tensors' result."""
    (boxes, scores, groups, eligible), steps = _faces_to_filter(256, seed=5, device="cuda")
    fused = triton_kernels.drop_overlapping(boxes, scores, groups, eligible, 0.5, 4, steps)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cuda"))
    expected = nms.drop_overlapping_batched(boxes.cpu(), scores.cpu(), groups.cpu(), eligible.cpu(), 0.5, 4,
                                            steps)
    assert torch.equal(fused[0].cpu(), expected[0]) and torch.equal(fused[1].cpu(), expected[1])
