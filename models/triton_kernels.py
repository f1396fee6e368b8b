"""Kernels of facecast's own for chains of PyTorch kernels on a GPU, in Triton: the crops of
:func:`facecast.models.roi.crop_rois`, the detectors' decoding and the clustering of their
weighted NMS, and the face stack's duplicate filter.

Note [Kernels of our own]
    A CUDA graph takes the host's launches away but not the kernels: a chain of small PyTorch
    operators is still one kernel each, each reading and writing its tensors in full. Where a
    profile shows such a chain (bench/model_stages.py), one Triton kernel does its work in one
    pass. Triton compiles a kernel at its first launch in a process and keeps it in its cache
    on disk (TRITON_CACHE_DIR; by default here $XDG_CACHE_HOME/facecast/triton, the daemon's
    cache directory under systemd, whose user has no home): another process loads it in
    milliseconds. `prepare` compiles the crops at warm-up and a graph's eager warm-up runs
    compile the rest (Captured in cuda_graphs.py), so no batch waits for a compilation and none
    happens while a graph is captured (without graphs, a detection pass's decoding and NMS
    compile at the first pass). A kernel is compiled once per value of its constants (the
    block sizes, the slots, the border and channel order, the output's dtype), a few in all. Integer arguments and pointers are not specialised on
    (`do_not_specialize`): another size or an address with other alignment never needs another
    compilation. Kernels are compiled without fused multiply-adds (`enable_fp_fusion=False`):
    each multiply and add is rounded on its own, as PyTorch's kernels round them. Where Triton
    is missing, cannot compile (it builds its launcher with the machine's C compiler) or cannot
    launch, the PyTorch chains run as before and the reason is logged once
    (`unavailable_reason`). tests/models/test_triton_kernels.py holds each kernel to its chain,
    on the CPU through Triton's interpreter (tests/models/triton_interpreter_checks.py, in a
    process of its own: Triton decides at its import whether its own library is interpreted)
    and on the GPU compiled; bench/kernels.py times each against its chain.

Note [One kernel for a batch of crops]
    On a GPU crop_rois was PyTorch's kernels in two parts (Note [Crop taps made once]): about 40
    small kernels for where each output pixel samples, then a dozen full-size passes over the
    (N, H, W, 3) floats to gather the four taps and blend them. For a batch of 64 faces that
    was 1.0 ms of the FaceLandmarker stack's 6.7 ms of kernel time (H100, 2026-11-26,
    bench/model_stages.py), and about 50 launches queued from Python, under the GIL, ahead of
    the measuring stage's CUDA graph. Here one kernel does all of it for every output pixel:
    the rect's sample point (Note [ROI crop convention]), the clamp to its own frame, the black
    border's inside test, the four taps read as bytes where the frames lie (Note [Sampling the
    frames where they lie]), the blend, the channel swap, the value range, and one store in the
    output's dtype. The arithmetic is crop_taps' in the same order, in float32 throughout: for
    a float16 output crop_taps blends in float16, so there this is the more exact of the two;
    for float32 the two agree to float rounding (the rotation's cosine and sine may differ in
    their last bit).

Note [Weighted NMS in one kernel]
    The detectors' clustering (Note [Weighted NMS in few steps], nms.py) is one step of six
    operators per output slot and a dozen more for the blends: with eight slots about 60
    kernels in the detection pass's graph, for candidates that fit one thread block per row.
    Here one program per row does the same: the leader of each slot is its first unclustered
    candidate (they are sorted, best first), its cluster every unclustered candidate whose IoU
    with it is above the threshold (box_iou's arithmetic: the same memberships), and the
    cluster's box and keypoints its members' means weighted by their scores. The sums run in
    another order than PyTorch's reductions: the blends agree to float rounding.

Note [Detections decoded in one kernel]
    A detector's raw outputs become boxes, keypoints and scores in frame pixels in two chains
    (anchors.decode, then roi.project_boxes and project_points: 22 and 60 kernels of a detection
    pass over 32 1080p frames, 0.33 of its 4.9 ms of kernel time in float32, H100 2026-11-27).
    Here one program per block of a row's anchors reads each anchor's raw values once and
    writes the three results: the decode's arithmetic (offsets over the coordinate scale plus
    the anchor, the logit clamped to ±100 and its sigmoid), then the projection's (over the
    input's size, less a half, times the rect's size, rotated onto the frame), in their order.
    The sigmoid's exponential is Triton's, not PyTorch's: scores agree to float rounding, so an
    anchor at exactly the minimum score may fall on the other side.

Note [The duplicate filter in one kernel]
    The measuring stage's duplicate filter (Note [The duplicate filter as tensors], nms.py)
    builds (N, N) pair tables and steps through the places of a frame's faces: 157 kernels,
    0.3 ms of the FaceLandmarker stack's graph at 64 faces (H100, 2026-11-26). Here one program
    per face decides its frame's faces greedily, best first (by score, ties to the lower
    index: the filter's order), each kept unless its box overlaps a kept one's by an IoU above
    the limit (box_iou's arithmetic), and then says whether its own face is kept and its rank;
    every program of a frame repeats the frame's few steps, which costs less than sharing them.
    The same kept set and ranks as the tensors'.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Output pixels per program of the crops: a crop of H x W is ceil(H·W / CROP_BLOCK) programs
# along the grid's x, the crops along its y.
CROP_BLOCK = 256
# The crops' output dtypes (the models' inputs).
CROP_DTYPES = (torch.float32, torch.float16)
# Anchors per program of the detectors' decoding.
DECODE_BLOCK = 128
# The most faces the duplicate filter's kernel takes (each program holds every face's box).
MAX_FILTERED = 1024

_failed: str | None = None  # why the kernels are not used, once one failed


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (None: they can)."""
    if device.type != "cuda" and not _interpreted():
        return "the kernels are for CUDA devices"
    if _failed is not None:
        return _failed
    try:
        _kernels(_interpreted())
    except Exception as exc:  # noqa: BLE001 - any reason Triton cannot be had is a reason to say
        _give_up(exc)
    return _failed


def crop(frames, frame_index: torch.Tensor, rects, out_hw: tuple[int, int], border: str,
         dtype: torch.dtype, value_range: tuple[float, float]) -> torch.Tensor | None:
    """:func:`roi.crop_rois` (its arguments, checked there) in one kernel (Note [One kernel for
    a batch of crops]): (N, H, W, 3) of ``dtype``; None where the kernel cannot serve (then
    PyTorch's kernels crop)."""
    if dtype not in CROP_DTYPES or unavailable_reason(frames.pixels.device) is not None:
        return None
    out_h, out_w = out_hw
    count = len(rects)
    device = frames.pixels.device
    out = torch.empty(count, out_h, out_w, 3, dtype=dtype, device=device)
    if count == 0:
        return out
    pixels = frames.pixels
    if pixels.stride(2) != 1 or pixels.stride(1) != 3:
        pixels = pixels.contiguous()
    low, high = value_range
    # The rects' three tables as float32 rows (no-ops for the rects crop_rois is given).
    centre, size, rotation = (part.to(device=device, dtype=torch.float32).contiguous()
                              for part in (rects.center_xy_px, rects.size_wh_px, rects.rotation_rad))
    index = frame_index.to(device=device, dtype=torch.int64).contiguous()
    return _launch(out, "crop", (-(-out_h * out_w // CROP_BLOCK), count), (
        pixels, pixels.stride(0), frames.frame_table, index, centre, size, rotation, out,
        out_h, out_w, (high - low) / 255.0, low), ZERO_BORDER=border == "zero",
        BGR=bool(frames.bgr), BLOCK=CROP_BLOCK)


def nms_clusters(boxes: torch.Tensor, scores: torch.Tensor, keypoints: torch.Tensor,
                 valid: torch.Tensor, iou_threshold: float, max_detections: int):
    """nms._clusters (its sorted candidates: boxes (B, C, 4), scores (B, C), keypoints
    (B, C, K, 2), valid (B, C) bool) in one kernel (Note [Weighted NMS in one kernel]): the
    (boxes, keypoints, scores, valid) of (B, max_detections) slots; None where the kernel
    cannot serve (float32 candidates with keypoints only)."""
    if (boxes.dtype != torch.float32 or scores.dtype != torch.float32
            or keypoints.dtype != torch.float32 or keypoints.shape[2] == 0
            or unavailable_reason(boxes.device) is not None):
        return None
    rows, candidates = scores.shape
    coords = keypoints.shape[2] * 2
    out_boxes = torch.empty(rows, max_detections, 4, device=boxes.device)
    out_keypoints = torch.empty(rows, max_detections, keypoints.shape[2], 2, device=boxes.device)
    out_scores = torch.empty(rows, max_detections, device=boxes.device)
    out_valid = torch.empty(rows, max_detections, dtype=torch.bool, device=boxes.device)
    if rows == 0:
        return out_boxes, out_keypoints, out_scores, out_valid
    launched = _launch(out_boxes, "nms", (rows,), (
        boxes.contiguous(), scores.contiguous(), keypoints.contiguous(), valid.contiguous(),
        out_boxes, out_keypoints, out_scores, out_valid, candidates, coords, iou_threshold),
        SLOTS=max_detections, BLOCK_C=max(16, _power_of_two(candidates)),
        BLOCK_K=max(2, _power_of_two(coords)))
    return None if launched is None else (out_boxes, out_keypoints, out_scores, out_valid)


def decode_detections(raw_boxes: torch.Tensor, raw_scores: torch.Tensor, anchors: torch.Tensor,
                      rects, input_hw: tuple[int, int], coord_scale: float, anchor_size: float,
                      min_score: float):
    """anchors.decode then the projection onto the frames (FaceDetector.decode) in one kernel
    (Note [Detections decoded in one kernel]): (boxes (B, A, 4), scores (B, A), keypoints
    (B, A, K, 2), valid (B, A)), float32, for raw_boxes (B, A, 4 + 2K) and raw_scores (B, A[, 1])
    of B inputs sampled by ``rects`` (B); None where the kernel cannot serve."""
    if raw_boxes.dim() != 3 or unavailable_reason(raw_boxes.device) is not None:
        return None
    rows, count, coords = raw_boxes.shape
    keypoints_count = (coords - 4) // 2
    device = raw_boxes.device
    boxes = torch.empty(rows, count, 4, device=device)
    scores = torch.empty(rows, count, device=device)
    keypoints = torch.empty(rows, count, keypoints_count, 2, device=device)
    valid = torch.empty(rows, count, dtype=torch.bool, device=device)
    if rows == 0 or count == 0:
        return boxes, scores, keypoints, valid
    centre, size, rotation = (part.to(device=device, dtype=torch.float32).contiguous()
                              for part in (rects.center_xy_px, rects.size_wh_px, rects.rotation_rad))
    launched = _launch(boxes, "decode", (-(-count // DECODE_BLOCK), rows), (
        raw_boxes.contiguous(), raw_scores.contiguous(), anchors.to(device, torch.float32).contiguous(),
        centre, size, rotation, boxes, scores, keypoints, valid, count, coords, float(input_hw[0]),
        float(input_hw[1]), float(coord_scale), float(anchor_size), float(min_score)),
        KEYPOINTS=keypoints_count, BLOCK=DECODE_BLOCK)
    return None if launched is None else (boxes, scores, keypoints, valid)


def drop_overlapping(boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor,
                     eligible: torch.Tensor, max_iou: float, max_kept: int, max_group_size: int):
    """nms.drop_overlapping_batched in one kernel (Note [The duplicate filter in one kernel]):
    (kept (N,) bool, rank (N,) long); None where the kernel cannot serve (float32 boxes and
    scores, at most MAX_FILTERED faces)."""
    count = boxes.shape[0]
    if (boxes.dtype != torch.float32 or scores.dtype != torch.float32 or count > MAX_FILTERED
            or unavailable_reason(boxes.device) is not None):
        return None
    kept = torch.empty(count, dtype=torch.bool, device=boxes.device)
    rank = torch.empty(count, dtype=torch.int64, device=boxes.device)
    if count == 0:
        return kept, rank
    launched = _launch(kept, "duplicates", (count,), (
        boxes.contiguous(), scores.contiguous(), groups.contiguous(), eligible.contiguous(),
        kept, rank, count, max_iou, max_kept), STEPS=max_group_size,
        BLOCK_N=max(64, _power_of_two(count)))  # the graphs' buckets up to 64 faces: one compilation
    return None if launched is None else (kept, rank)


def prepare(device: torch.device, crops) -> str | None:
    """Compile the crop kernel now for each (dtype, border) of ``crops`` (warm-up: Note
    [Kernels of our own]); the reason the kernels cannot be used, or None."""
    from facecast.models.roi import FrameBatch, RotatedRects

    if unavailable_reason(device) is not None:
        return _failed
    frames = FrameBatch(torch.zeros(1, 4, 4, 3, dtype=torch.uint8, device=device), device)
    rects = RotatedRects(torch.full((1, 2), 2.0, device=device), torch.full((1, 2), 4.0, device=device),
                         torch.zeros(1, device=device))
    index = torch.zeros(1, dtype=torch.long, device=device)
    for dtype, border in dict.fromkeys(crops):
        if crop(frames, index, rects, (2, 2), border, dtype, (0.0, 1.0)) is None:
            return _failed
    return None


def _launch(result: torch.Tensor, name: str, grid: tuple, args: tuple, **constants) -> torch.Tensor | None:
    """``result`` once the kernel ``name`` is queued on the current stream; None if it could
    not be (compiler, launcher: then PyTorch's kernels, from now on)."""
    try:
        getattr(_kernels(_interpreted()), name)[grid](*args, **constants, enable_fp_fusion=False)
    except Exception as exc:  # noqa: BLE001 - a compiler or launcher failure: PyTorch's kernels
        _give_up(exc)
        return None
    return result


def _power_of_two(count: int) -> int:
    return 1 << max(0, count - 1).bit_length()


def _interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on the CPU: the tests'."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _give_up(exc: Exception) -> None:
    global _failed
    if _failed is None:
        _failed = f"{type(exc).__name__}: {exc}".strip()
        log.warning("Triton's kernels (Note [Kernels of our own]) cannot be used (%s); PyTorch's "
                    "kernels do their work from now on", _failed)


class _Kernels:
    """The kernels, defined once per process (each compiled at its first launch)."""

    def __init__(self) -> None:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["pixels", "row_bytes", "frame_table", "frame_index", "centre",
                                       "size", "rotation", "out", "out_h", "out_w", "scale", "low"])
        def crop(pixels, row_bytes, frame_table, frame_index, centre, size, rotation, out,
                 out_h, out_w, scale, low,
                 ZERO_BORDER: tl.constexpr, BGR: tl.constexpr, BLOCK: tl.constexpr):
            n = tl.program_id(1)
            p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            in_crop = p < out_h * out_w
            i = p // out_w
            j = p - i * out_w
            # The rect and its frame (FrameBatch.frame_table: row offset, height, width).
            k = tl.load(frame_index + n)
            row_offset = tl.load(frame_table + k * 3)
            max_y = tl.load(frame_table + k * 3 + 1) - 1
            max_x = tl.load(frame_table + k * 3 + 2) - 1
            centre_x, centre_y = tl.load(centre + n * 2), tl.load(centre + n * 2 + 1)
            width, height = tl.load(size + n * 2), tl.load(size + n * 2 + 1)
            angle = tl.load(rotation + n)
            cos, sin = tl.cos(angle), tl.sin(angle)
            # Output pixel (j, i) samples centre + R(angle) · ((j / W − ½)·w, (i / H − ½)·h).
            along_u = (tl.math.div_rn(j.to(tl.float32), out_w.to(tl.float32)) - 0.5) * width
            along_v = (tl.math.div_rn(i.to(tl.float32), out_h.to(tl.float32)) - 0.5) * height
            x = cos * along_u - sin * along_v + centre_x
            y = sin * along_u + cos * along_v + centre_y
            if ZERO_BORDER:  # before the clamping: a sample more than half a pixel out is black
                inside_x = ((x >= -0.5) & (x <= max_x + 0.5)).to(tl.float32)
                inside_y = ((y >= -0.5) & (y <= max_y + 0.5)).to(tl.float32)
            x = tl.minimum(tl.maximum(x, 0.0), max_x)
            y = tl.minimum(tl.maximum(y, 0.0), max_y)
            x0 = tl.floor(x)
            y0 = tl.floor(y)
            weight_right = x - x0
            weight_down = y - y0
            weight_left = 1 - weight_right
            weight_up = (1 - weight_down) * scale
            weight_down = weight_down * scale
            if ZERO_BORDER:
                weight_left, weight_right = weight_left * inside_x, weight_right * inside_x
                weight_up, weight_down = weight_up * inside_y, weight_down * inside_y
            # The taps' bytes: the right and lower neighbours stay inside the frame (crop_taps).
            left = x0.to(tl.int64) * 3
            right = left + (x0 < max_x).to(tl.int64) * 3
            up = (y0 + row_offset).to(tl.int64) * row_bytes
            down = up + (y0 < max_y).to(tl.int64) * row_bytes
            base = out + (n.to(tl.int64) * out_h * out_w + p) * 3
            for channel in tl.static_range(3):
                source = 2 - channel if BGR else channel
                up_left = tl.load(pixels + up + left + source, mask=in_crop, other=0).to(tl.float32)
                up_right = tl.load(pixels + up + right + source, mask=in_crop, other=0).to(tl.float32)
                down_left = tl.load(pixels + down + left + source, mask=in_crop, other=0).to(tl.float32)
                down_right = tl.load(pixels + down + right + source, mask=in_crop, other=0).to(tl.float32)
                value = (up_left * weight_left + up_right * weight_right) * weight_up
                value += (down_left * weight_left + down_right * weight_right) * weight_down
                tl.store(base + channel, value + low, mask=in_crop)

        @triton.jit(do_not_specialize=["boxes", "scores", "keypoints", "valid", "out_boxes",
                                       "out_keypoints", "out_scores", "out_valid", "candidates",
                                       "coords", "threshold"])
        def nms(boxes, scores, keypoints, valid, out_boxes, out_keypoints, out_scores, out_valid,
                candidates, coords, threshold,
                SLOTS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            c = tl.arange(0, BLOCK_C)
            in_row = c < candidates
            first = row * candidates + c
            x1 = tl.load(boxes + first * 4, mask=in_row, other=0.0)
            y1 = tl.load(boxes + first * 4 + 1, mask=in_row, other=0.0)
            x2 = tl.load(boxes + first * 4 + 2, mask=in_row, other=0.0)
            y2 = tl.load(boxes + first * 4 + 3, mask=in_row, other=0.0)
            score = tl.load(scores + first, mask=in_row, other=0.0)
            unclustered = tl.load(valid + first, mask=in_row, other=0) != 0
            q = tl.arange(0, BLOCK_K)
            point_mask = in_row[:, None] & (q < coords)[None, :]
            points = tl.load(keypoints + first[:, None] * coords + q[None, :], mask=point_mask, other=0.0)
            area = tl.maximum(x2 - x1, 0.0) * tl.maximum(y2 - y1, 0.0)
            for slot in tl.static_range(SLOTS):
                # The leader: the first unclustered candidate (argmax of a 0/1 row, 0 if none).
                leader = tl.min(tl.where(unclustered, c, BLOCK_C), axis=0)
                leader = tl.where(leader == BLOCK_C, 0, leader)
                is_leader = c == leader
                lead_x1 = tl.sum(tl.where(is_leader, x1, 0.0), axis=0)
                lead_y1 = tl.sum(tl.where(is_leader, y1, 0.0), axis=0)
                lead_x2 = tl.sum(tl.where(is_leader, x2, 0.0), axis=0)
                lead_y2 = tl.sum(tl.where(is_leader, y2, 0.0), axis=0)
                lead_area = tl.sum(tl.where(is_leader, area, 0.0), axis=0)
                # box_iou's arithmetic, in its order.
                inter_w = tl.maximum(tl.minimum(lead_x2, x2) - tl.maximum(lead_x1, x1), 0.0)
                inter_h = tl.maximum(tl.minimum(lead_y2, y2) - tl.maximum(lead_y1, y1), 0.0)
                intersection = inter_w * inter_h
                union = lead_area + area - intersection
                iou = tl.where(union > 0, tl.math.div_rn(intersection, tl.maximum(union, 1e-12)), 0.0)
                members = ((iou > threshold) | is_leader) & unclustered
                unclustered = unclustered & ~members
                weights = tl.where(members, score, 0.0)
                total = tl.maximum(tl.sum(weights, axis=0), 1e-12)
                slot_at = row * SLOTS + slot
                tl.store(out_boxes + slot_at * 4, tl.math.div_rn(tl.sum(weights * x1, axis=0), total))
                tl.store(out_boxes + slot_at * 4 + 1, tl.math.div_rn(tl.sum(weights * y1, axis=0), total))
                tl.store(out_boxes + slot_at * 4 + 2, tl.math.div_rn(tl.sum(weights * x2, axis=0), total))
                tl.store(out_boxes + slot_at * 4 + 3, tl.math.div_rn(tl.sum(weights * y2, axis=0), total))
                blended = tl.sum(weights[:, None] * points, axis=0)
                tl.store(out_keypoints + slot_at * coords + q, tl.math.div_rn(blended, total), mask=q < coords)
                tl.store(out_scores + slot_at, tl.max(weights, axis=0))
                tl.store(out_valid + slot_at, tl.max(members.to(tl.int32), axis=0) > 0)

        @triton.jit(do_not_specialize=["boxes", "scores", "groups", "eligible", "kept", "rank",
                                       "count", "max_iou", "max_kept"])
        def duplicates(boxes, scores, groups, eligible, kept, rank, count, max_iou, max_kept,
                       STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
            me = tl.program_id(0)
            j = tl.arange(0, BLOCK_N)
            in_batch = j < count
            x1 = tl.load(boxes + j * 4, mask=in_batch, other=0.0)
            y1 = tl.load(boxes + j * 4 + 1, mask=in_batch, other=0.0)
            x2 = tl.load(boxes + j * 4 + 2, mask=in_batch, other=0.0)
            y2 = tl.load(boxes + j * 4 + 3, mask=in_batch, other=0.0)
            score = tl.load(scores + j, mask=in_batch, other=0.0)
            group = tl.load(groups + j, mask=in_batch, other=0)
            my_group = tl.load(groups + me)
            my_score = tl.load(scores + me)
            mates = in_batch & (group == my_group)
            undecided = mates & (tl.load(eligible + j, mask=in_batch, other=0) != 0)
            area = tl.maximum(x2 - x1, 0.0) * tl.maximum(y2 - y1, 0.0)
            is_kept = j < 0  # all False
            for step in tl.static_range(STEPS):
                # The best undecided face of the frame: the highest score, ties the lower index.
                best = tl.max(tl.where(undecided, score, float("-inf")), axis=0)
                first = tl.min(tl.where(undecided & (score == best), j, BLOCK_N), axis=0)
                chosen = j == first  # none once every face is decided (first == BLOCK_N)
                c_x1 = tl.sum(tl.where(chosen, x1, 0.0), axis=0)
                c_y1 = tl.sum(tl.where(chosen, y1, 0.0), axis=0)
                c_x2 = tl.sum(tl.where(chosen, x2, 0.0), axis=0)
                c_y2 = tl.sum(tl.where(chosen, y2, 0.0), axis=0)
                c_area = tl.sum(tl.where(chosen, area, 0.0), axis=0)
                # box_iou's arithmetic (blocker first), against every face kept so far.
                inter_w = tl.maximum(tl.minimum(x2, c_x2) - tl.maximum(x1, c_x1), 0.0)
                inter_h = tl.maximum(tl.minimum(y2, c_y2) - tl.maximum(y1, c_y1), 0.0)
                intersection = inter_w * inter_h
                union = area + c_area - intersection
                iou = tl.where(union > 0, tl.math.div_rn(intersection, tl.maximum(union, 1e-12)), 0.0)
                blocked = tl.max((is_kept & (iou > max_iou)).to(tl.int32), axis=0) > 0
                is_kept = is_kept | (chosen & ~blocked)
                undecided = undecided & ~chosen
            # Its rank: the kept faces of its frame that come before it.
            before = (score > my_score) | ((score == my_score) & (j < me))
            my_rank = tl.sum((is_kept & mates & before).to(tl.int64), axis=0)
            me_kept = tl.max((is_kept & (j == me)).to(tl.int32), axis=0) > 0
            tl.store(kept + me, me_kept & (my_rank < max_kept))
            tl.store(rank + me, my_rank)

        @triton.jit(do_not_specialize=["raw_boxes", "raw_scores", "anchors", "centre", "size",
                                       "rotation", "boxes", "scores", "keypoints", "valid", "count",
                                       "coords", "input_h", "input_w", "coord_scale", "anchor_size",
                                       "min_score"])
        def decode(raw_boxes, raw_scores, anchors, centre, size, rotation, boxes, scores, keypoints,
                   valid, count, coords, input_h, input_w, coord_scale, anchor_size, min_score,
                   KEYPOINTS: tl.constexpr, BLOCK: tl.constexpr):
            row = tl.program_id(1).to(tl.int64)
            a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            in_row = a < count
            first = row * count + a
            raw = raw_boxes + first * coords
            anchor_x = tl.load(anchors + a * 2, mask=in_row, other=0.0)
            anchor_y = tl.load(anchors + a * 2 + 1, mask=in_row, other=0.0)
            centre_x, centre_y = tl.load(centre + row * 2), tl.load(centre + row * 2 + 1)
            width, height = tl.load(size + row * 2), tl.load(size + row * 2 + 1)
            angle = tl.load(rotation + row)
            cos, sin = tl.cos(angle), tl.sin(angle)
            # anchors.decode: centre over the scale plus the anchor, half the size over the scale.
            box_x = tl.load(raw, mask=in_row, other=0.0).to(tl.float32) / coord_scale + anchor_x
            box_y = tl.load(raw + 1, mask=in_row, other=0.0).to(tl.float32) / coord_scale + anchor_y
            half_w = tl.load(raw + 2, mask=in_row, other=0.0).to(tl.float32) / coord_scale / 2
            half_h = tl.load(raw + 3, mask=in_row, other=0.0).to(tl.float32) / coord_scale / 2
            # roi.project_points of decoded * the anchors' input size: over the input's size, less
            # a half, times the rect's size, rotated onto the frame about the rect's centre.
            for corner in tl.static_range(2):
                sign = -1.0 if corner == 0 else 1.0
                u = (box_x + sign * half_w) * anchor_size / input_w - 0.5
                v = (box_y + sign * half_h) * anchor_size / input_h - 0.5
                u, v = u * width, v * height
                tl.store(boxes + first * 4 + corner * 2, cos * u - sin * v + centre_x, mask=in_row)
                tl.store(boxes + first * 4 + corner * 2 + 1, sin * u + cos * v + centre_y, mask=in_row)
            for point in tl.static_range(KEYPOINTS):
                u = (tl.load(raw + 4 + point * 2, mask=in_row, other=0.0).to(tl.float32) / coord_scale
                     + anchor_x) * anchor_size / input_w - 0.5
                v = (tl.load(raw + 5 + point * 2, mask=in_row, other=0.0).to(tl.float32) / coord_scale
                     + anchor_y) * anchor_size / input_h - 0.5
                u, v = u * width, v * height
                at = keypoints + (first * KEYPOINTS + point) * 2
                tl.store(at, cos * u - sin * v + centre_x, mask=in_row)
                tl.store(at + 1, sin * u + cos * v + centre_y, mask=in_row)
            logit = tl.load(raw_scores + first, mask=in_row, other=0.0).to(tl.float32)
            score = 1.0 / (1.0 + tl.exp(-tl.minimum(tl.maximum(logit, -100.0), 100.0)))
            tl.store(scores + first, score, mask=in_row)
            tl.store(valid + first, score >= min_score, mask=in_row)

        self.crop, self.nms, self.duplicates, self.decode = crop, nms, duplicates, decode


@functools.lru_cache(maxsize=2)
def _kernels(interpreted: bool) -> _Kernels:
    """The kernels, one set per process (Triton decides at their definition whether they are
    interpreted, hence one set for each)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(_cache_home() / "facecast" / "triton"))
    return _Kernels()


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
