"""Kernels of facecast's own for chains of PyTorch kernels on a GPU, in Triton: the crops of
:func:`facecast.models.roi.crop_rois`, the detectors' decoding and the clustering of their
weighted NMS, the face stack's duplicate filter and transformation matrix, the layer norms
of the blendshape model, the landmark models' PReLUs (with the residual add before them) and
the float16 depthwise convolutions' biases. This module decides whether they can run
and launches them; their code is triton_kernel_code.py, imported only then.

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
    block sizes, the slots, the border and channel order, the output's dtype), a few in all.
    Integer arguments and pointers are not specialised on (`do_not_specialize`): another size
    or an address with other alignment never needs another compilation. But for the
    memory-bound kernels of graphs only (the PReLUs, the residual shortcuts and the biases, Note [PReLUs in one
    kernel]; the depthwise convolutions' pointers, Note [Float16 depthwise convolutions]),
    whose loads are vectorised only where Triton knows their pointers 16-byte aligned and
    their count a multiple of 16: those are specialised, a variant or two a dtype (the
    depthwise one also a variant per layer geometry: its kernel size, stride, padding and
    channels are constants), compiled by the graph's warm-up runs for the shapes and alignments
    its capture then meets (the allocator's blocks are aligned alike). Kernels are compiled
    without fused multiply-adds (`enable_fp_fusion=False`):
    each multiply and add is rounded on its own, as PyTorch's kernels round them. Where Triton
    is missing or cannot compile (it builds its launcher with the machine's C compiler), the
    PyTorch chains run as before and the reason is logged once; a kernel whose compilation or
    launch fails is given up alone, said once with its name, and the others go on
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

Note [The transformation matrix in one kernel]
    The facial transformation matrix (Note [Face geometry as MediaPipe computes it],
    face_geometry.py) is three weighted Procrustes fits in float64, each a Horn matrix squared
    twelve times (Note [Procrustes without a solver]): 174 kernels, 0.34 ms of the
    FaceLandmarker stack's 4.7 ms of kernel time at 64 faces in float32 (H100, 2026-11-27).
    Here one program per face does the three fits on its 33 weighted points, the 4x4 squarings
    in registers, in the same order of operations but for the sums' (float64: the matrices
    agree to ~1e-12).

Note [Layer norms in one kernel]
    The blendshape model (an MLP-Mixer) normalises its 97 tokens' 64 channels eight times, each
    as TFLite stores it: ten operators (mean, negation, squared difference, mean, plus epsilon,
    reciprocal square root, times gamma, two products, a sum), ten kernels on a GPU, 80 of its
    136. tflite_convert.fuse_layer_norms finds that chain and puts one step in its place
    (tflite_ops.LayerNormOverChannels), which on a GPU is this kernel: one program for a block
    of positions, each position's channels read once, the chain's operations in its order (the
    sums in another: float32 rounding apart); elsewhere the same ten operators in PyTorch.

Note [The duplicate filter in one kernel]
    The measuring stage's duplicate filter (Note [The duplicate filter as tensors], nms.py)
    builds (N, N) pair tables and steps through the places of a frame's faces: 157 kernels,
    0.3 ms of the FaceLandmarker stack's graph at 64 faces (H100, 2026-11-26). Here one program
    per face decides its frame's faces greedily, best first (by score, ties to the lower
    index: the filter's order), each kept unless its box overlaps a kept one's by an IoU above
    the limit (box_iou's arithmetic), and then says whether its own face is kept and its rank;
    every program of a frame repeats the frame's few steps, which costs less than sharing them.
    The same kept set and ranks as the tensors'.

Note [PReLUs in one kernel]
    The v2 landmarker (the FaceLandmarker stack's landmark model) is 34 residual blocks of a
    1x1 convolution, a PRELU, a depthwise convolution, a 1x1 convolution, the ADD of the block's
    input, and a PRELU: 69 PRELUs and 34 ADDs, each a kernel over the whole activation. PyTorch's
    F.prelu over channels_last activations broadcasts its slopes along the channels, which its
    elementwise kernels do without vectorised loads: in a profile of the landmark model at 64
    faces in float16 (H100, 2026-11-27, .footage probe) its PReLUs took 0.70 ms a forward and
    its ADDs 0.27 of the 3.4 ms. Here one kernel does a PRELU (tflite_ops.ChannelPRelu) over a
    channels-last image read as the flat array it is (position p is channel p % C), and
    tflite_convert.fuse_residual_prelus puts one step in place of an ADD whose only reader is a
    PRELU (tflite_ops.ResidualPRelu): one pass reads both operands and writes the PRELU of
    their sum. The sum is rounded to the activation's dtype before the PRELU, as PyTorch's ADD
    stores it, and the PRELU is PyTorch's (x if x > 0 else slope · x, in float32, rounded
    once): the same values, bit for bit. Images in other layouts run PyTorch's kernels.
    Only in CUDA graphs (their warm-up runs and capture: `graph_work`, cuda_graphs.Captured):
    on the host a Triton launch costs more than PyTorch's, and eager runs are bound by the
    host's launches. With the kernel in eager runs too, the stacks in float32 without graphs
    were slower: FaceLandmarker's 5,471 -> 4,733 faces/s at 64 faces, the attention mesh's
    7,161 -> 5,277, while in float16 with graphs they went 12,674 -> 15,399 and 12,778 ->
    16,367 (bench/models.py, H100, one loan, 2026-11-27).

Note [Residual shortcuts in one kernel]
    A residual block that halves its image (stride 2) has a shortcut of its own: a 2x2 stride-2
    MAX_POOL_2D of the block's input and, where the block widens, a PAD that appends zero
    channels, before the ADD and the PRELU (Note [PReLUs in one kernel]). The attention mesh has
    16 such blocks (9 of them widening), the v2 landmarker 6 (3). In a profile of the attention
    mesh's graph at 64 faces in float16 (H100, 2026-11-27 15:22, .footage probe) its pools were
    16 kernels and 113 us, PyTorch's channels-last max pool the slowest of them at 17 us each,
    and each PAD a fill and a copy. tflite_convert.fuse_pooled_residuals puts the pool and the
    PAD into the fused ADD+PRELU step that reads them (tflite_ops.PooledResidualPRelu), and
    here one kernel computes it: each output value takes the max of its 2x2 window of the
    block's input (cells past an odd size's last row or column never win, as TF's SAME padding
    of -inf), zero in the appended channels, adds it to the block's output rounded to its dtype
    as PyTorch's ADD does, and applies the PRELU: the operators' values, bit for bit. In CUDA
    graphs only, as the PReLUs; elsewhere the step runs the operators themselves.

Note [A convolution's bias in one kernel]
    PyTorch adds a cuDNN convolution's bias in a pass of its own (Note [Convolutions on the
    GPU]), a broadcast over channels_last outputs that its elementwise kernels do without
    vectorised loads. For the float16 depthwise convolutions, whose biases stay where they are
    (that Note says why), those passes were most of their time: the full-range detector's 42 at
    288 inputs took 2.82 ms with their biases and 1.25 without (H100, 2026-11-27,
    bench/conv_kernels.py). Here one kernel adds the bias into the convolution's output where
    it lies, read as the flat array it is: the same sum in float32 rounded once, the same
    values as PyTorch's pass, bit for bit. In CUDA graphs only, as the PReLUs (Note [PReLUs in
    one kernel]); elsewhere and for other layouts, PyTorch's pass. The detector's largest bias
    (288 x 32 x 96 x 96) took 0.25 ms as PyTorch's pass and 0.12 in the kernel
    (bench/kernels.py); detection over 32 1080p frames in float16 with graphs 4.63 -> 4.39 ms,
    the FaceLandmarker stack at 64 faces the same within the noise (one process, turns
    alternating, H100, 2026-11-27 13:13 UTC). Since that afternoon the other cuDNN
    convolutions without a fused ReLU take it too (Conv2d._convolve_then_bias): a profile of the
    FaceLandmarker stack in float16 showed the v2 landmarker's first convolution's bias,
    PyTorch's pass, at 49 us beside the 75 us convolution (H100, 13:45).

Note [The attention mesh's custom operators in kernels]
    face_landmark_with_attention's three custom operators (models/custom_ops.py) were written
    as batched PyTorch: on the CPU 195 operators for its three Landmarks2TransformMatrix, 84
    for its three TransformTensorBilinear and 55 for its five TransformLandmarks, 334 of the
    model's 735, each a kernel on a GPU, where a CUDA graph's node costs about 1.2 us of device
    time even when it does nothing (H100, 2026-11-27: a graph of 1,500 trivial kernels 1.79 ms)
    and the stack's graph had 796 kernels at 64 faces. In a graph's work each operator is one
    kernel here, in float32 throughout: the transform matrix of a face in one program (the
    rotation's cos and sin from the two landmarks' difference and the target angle's, the same
    angle as target - atan2(dy, dx) without atan2, which Triton's interpreter lacks), the
    feature map sampled bilinearly with zeros outside as grid_sample samples it (its positions
    computed directly, not through [-1, 1] and back; grid_sample rounded them to float16 in
    float16 models, the kernel does not), and the landmarks mapped and rounded once. Their
    values against the PyTorch operators: tests/models/triton_interpreter_checks.py. Not yet
    run on a GPU (written when the session's device time was spent): the next session's
    `gpu_tests` and `models_ab` say whether they hold and what they buy.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Output pixels per program of the crops: a crop of H x W is ceil(H·W / CROP_BLOCK) programs
# along the grid's x, the crops along its y.
CROP_BLOCK = 256
# The crops' output dtypes (the models' inputs), and the dtypes of the frame indices they read.
CROP_DTYPES = (torch.float32, torch.float16)
CROP_INDEX_DTYPES = (torch.int64, torch.int32, torch.float32)
# Positions per program of a layer norm.
LAYER_NORM_BLOCK = 16
# Anchors per program of the detectors' decoding.
DECODE_BLOCK = 128
# Values per program of the per-channel passes over channels-last images (the PReLUs, the biases).
CHANNEL_PASS_BLOCK = 1024
# Their activations' dtypes.
CHANNEL_PASS_DTYPES = (torch.float16, torch.float32)
# A depthwise convolution's program: DEPTHWISE_VALUES output values, its channels (at most
# DEPTHWISE_MAX_BLOCK_C of them) by as many pixels as make that.
DEPTHWISE_VALUES = 1024
DEPTHWISE_MAX_BLOCK_C = 64
# Its activations' dtypes and fused activations (TFLite's codes: none, ReLU, ReLU6).
DEPTHWISE_DTYPES = (torch.float16,)
DEPTHWISE_ACTIVATIONS = (0, 1, 3)
# The attention mesh's custom operators' kernels: their dtypes, and the values a program of
# the feature map's sampling (channels at most CUSTOM_OP_MAX_BLOCK_C of them, by pixels) or of
# the landmarks' mapping computes.
CUSTOM_OP_DTYPES = (torch.float16, torch.float32)
CUSTOM_OP_VALUES = 1024
CUSTOM_OP_MAX_BLOCK_C = 64
# The most faces the duplicate filter's kernel takes (each program holds every face's box).
MAX_FILTERED = 1024

_unavailable: str | None = None  # why no kernel can be used here (Triton missing, its import)
_graph_work = contextvars.ContextVar("facecast_graph_work", default=False)  # see graph_work
_failed: dict[str, str] = {}  # kernel name -> why it is not used, once it failed


def unavailable_reason(device: torch.device, kernel: str | None = None) -> str | None:
    """Why the kernels (or the one named ``kernel``) cannot run on ``device`` (None: they can)."""
    if device.type != "cuda" and not _interpreted():
        return "the kernels are for CUDA devices"
    if _unavailable is None:
        try:
            _kernels()
        except Exception as exc:  # noqa: BLE001 - any reason Triton cannot be had is a reason to say
            _give_up(None, exc)
    return _unavailable or (_failed.get(kernel) if kernel is not None else None)


def crop(frames, frame_index: torch.Tensor, rects, out_hw: tuple[int, int], border: str,
         dtype: torch.dtype, value_range: tuple[float, float], out: torch.Tensor | None = None
         ) -> torch.Tensor | None:
    """:func:`roi.crop_rois` (its arguments, checked there) in one kernel (Note [One kernel for
    a batch of crops]): (N, H, W, 3) of ``dtype``, into ``out`` where given; None where the
    kernel cannot serve (then PyTorch's kernels crop)."""
    if dtype not in CROP_DTYPES or unavailable_reason(frames.pixels.device, "facecast_crop") is not None:
        return None
    out_h, out_w = out_hw
    count = len(rects)
    device = frames.pixels.device
    if out is None:
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
    # The frames' indices as they come (a column of the measuring stage's ROI table is whole
    # float32s): no conversion pass.
    index = frame_index if frame_index.dtype in CROP_INDEX_DTYPES else frame_index.to(torch.int64)
    index = index.to(device)
    return _launch(out, "facecast_crop", (-(-out_h * out_w // CROP_BLOCK), count), (
        pixels, pixels.stride(0), frames.frame_table, index, index.stride(0), centre, size, rotation, out,
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
            or unavailable_reason(boxes.device, "facecast_nms_clusters") is not None):
        return None
    rows, candidates = scores.shape
    coords = keypoints.shape[2] * 2
    out_boxes = torch.empty(rows, max_detections, 4, device=boxes.device)
    out_keypoints = torch.empty(rows, max_detections, keypoints.shape[2], 2, device=boxes.device)
    out_scores = torch.empty(rows, max_detections, device=boxes.device)
    out_valid = torch.empty(rows, max_detections, dtype=torch.bool, device=boxes.device)
    if rows == 0:
        return out_boxes, out_keypoints, out_scores, out_valid
    launched = _launch(out_boxes, "facecast_nms_clusters", (rows,), (
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
    if raw_boxes.dim() != 3 or unavailable_reason(raw_boxes.device, "facecast_decode") is not None:
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
    launched = _launch(boxes, "facecast_decode", (-(-count // DECODE_BLOCK), rows), (
        raw_boxes.contiguous(), raw_scores.contiguous(), anchors.to(device, torch.float32).contiguous(),
        centre, size, rotation, boxes, scores, keypoints, valid, count, coords, float(input_hw[0]),
        float(input_hw[1]), float(coord_scale), float(anchor_size), float(min_score)),
        KEYPOINTS=keypoints_count, BLOCK=DECODE_BLOCK)
    return None if launched is None else (boxes, scores, keypoints, valid)


def face_matrices(landmarks_px: torch.Tensor, frame_wh_px: torch.Tensor, used: torch.Tensor, source,
                  near: float, near_height: float, mesh_points: int, squarings: int,
                  squarings_per_normalisation: int) -> torch.Tensor | None:
    """FaceGeometry.matrices by squaring (its arguments and tables: the fit's landmark indices,
    the canonical model's ProcrustesSource) in one kernel (Note [The transformation matrix in one
    kernel]): (N, 4, 4) float64; None where the kernel cannot serve."""
    if (landmarks_px.dim() != 3 or landmarks_px.shape[1] < mesh_points or landmarks_px.shape[2] != 3
            or landmarks_px.dtype not in (torch.float32, torch.float16)
            or unavailable_reason(landmarks_px.device, "facecast_face_matrices") is not None):
        return None
    count, device = landmarks_px.shape[0], landmarks_px.device
    out = torch.empty(count, 4, 4, dtype=torch.float64, device=device)
    if count == 0:
        return out
    return _launch(out, "facecast_face_matrices", (count,), (
        landmarks_px.contiguous(), frame_wh_px.to(device=device, dtype=torch.float64).contiguous(), used,
        source.weights, source.weighted_centred, source.centre, source.variance.reshape(1), out,
        landmarks_px.shape[1], used.shape[0], _float64_numbers(device, (float(near), float(near_height)))),
        MESH=mesh_points, BLOCK_MESH=_power_of_two(mesh_points), BLOCK_K=max(16, _power_of_two(used.shape[0])),
        SQUARINGS=squarings, EVERY=squarings_per_normalisation)


@functools.lru_cache(maxsize=8)
def _float64_numbers(device: torch.device, numbers: tuple[float, ...]) -> torch.Tensor:
    """``numbers`` as a float64 tensor on the device, made once (a copy made while a graph is
    captured would be a host-to-device copy, which it cannot hold): a kernel reads them from
    memory because a Python float argument reaches a Triton kernel as float32, which rounds
    away the float64 chain's last 29 bits (seen on the GPU: matrices 5e-6 apart)."""
    with torch.inference_mode(False):
        return torch.tensor(numbers, dtype=torch.float64, device=device)


def layer_norm_over_channels(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor | None:
    """tflite_ops.LayerNormOverChannels (x (N, C, H, W) float32, gamma (C,)) in one kernel (Note
    [Layer norms in one kernel]); None where the kernel cannot serve."""
    if (x.dim() != 4 or x.dtype != torch.float32 or x.shape[1] > 1024
            or unavailable_reason(x.device, "facecast_layer_norm") is not None):
        return None
    out = torch.empty_like(x)  # x's strides, where x is dense
    if out.stride() != x.stride():
        x = x.contiguous()
        out = torch.empty_like(x)
    count, channels, height, width = x.shape
    positions = count * height * width
    if positions == 0:
        return out
    return _launch(out, "facecast_layer_norm", (-(-positions // LAYER_NORM_BLOCK),), (
        x, gamma.contiguous(), out, positions, height, width, x.stride(0), x.stride(1), x.stride(2),
        x.stride(3), channels, float(eps)), BLOCK_P=LAYER_NORM_BLOCK, BLOCK_C=max(16, _power_of_two(channels)))


@contextlib.contextmanager
def graph_work():
    """The work of a CUDA graph (its warm-up runs and its capture, cuda_graphs.Captured): the
    kernels that pay only where the host's launches are replayed, not made again (`prelu`,
    `add_channel_bias`: Note [PReLUs in one kernel]), serve meanwhile."""
    token = _graph_work.set(True)
    try:
        yield
    finally:
        _graph_work.reset(token)


def in_graph_work() -> bool:
    """Whether this is a CUDA graph's work (`graph_work`)."""
    return _graph_work.get()


def prelu(x: torch.Tensor, alpha: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.prelu(x, alpha), or with ``residual`` F.prelu(x + residual, alpha), of an image (N, C,
    H, W) held channels-last, in one kernel (Note [PReLUs in one kernel]); None where the kernel
    cannot serve (`_channel_pass_serves`, or a residual held otherwise than x)."""
    if (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                  or residual.stride() != x.stride())) \
            or not _channel_pass_serves(x, alpha, "facecast_prelu"):
        return None
    out = torch.empty_like(x)  # x's strides
    count = x.numel()
    if count == 0:
        return out
    return _launch(out, "facecast_prelu", (-(-count // CHANNEL_PASS_BLOCK),), (
        x, x if residual is None else residual, alpha.to(x.dtype).contiguous(), out, count, x.shape[1]),
        RESIDUAL=residual is not None, BLOCK=CHANNEL_PASS_BLOCK)


def pooled_residual_prelu(x: torch.Tensor, alpha: torch.Tensor, source: torch.Tensor) -> torch.Tensor | None:
    """F.prelu(x + F.pad(max_pool2d(source, 2, 2), channels zero-extended to x's), alpha) of an
    image x (N, C, H, W) held channels-last, in one kernel (Note [Residual shortcuts in one
    kernel]): the pool over ``source`` (N, Cs <= C, 2H or 2H - 1, 2W or 2W - 1), channels-last,
    with TF's SAME padding where its size is odd; None where the kernel cannot serve
    (`_channel_pass_serves`, or a source of another dtype, layout or size)."""
    if not (_channel_pass_serves(x, alpha, "facecast_pooled_residual_prelu") and source.dim() == 4
            and source.dtype == x.dtype and source.is_contiguous(memory_format=torch.channels_last)
            and source.shape[0] == x.shape[0] and source.shape[1] <= x.shape[1]
            and source.shape[2] in (2 * x.shape[2], 2 * x.shape[2] - 1)
            and source.shape[3] in (2 * x.shape[3], 2 * x.shape[3] - 1) and source.numel() < 2 ** 31):
        return None
    out = torch.empty_like(x)  # x's strides
    count = x.numel()
    if count == 0:
        return out
    return _launch(out, "facecast_pooled_residual_prelu", (-(-count // CHANNEL_PASS_BLOCK),), (
        x, source, alpha.to(x.dtype).contiguous(), out, count, x.shape[1], *source.shape[1:], *x.shape[2:]),
        BLOCK=CHANNEL_PASS_BLOCK)


def add_channel_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor | None:
    """``x`` with ``bias`` (one per channel) added in place, for an image (N, C, H, W) held
    channels-last, in one kernel (Note [A convolution's bias in one kernel]); None, and ``x``
    untouched, where the kernel cannot serve (`_channel_pass_serves`)."""
    if not _channel_pass_serves(x, bias, "facecast_channel_bias"):
        return None
    count = x.numel()
    if count == 0:
        return x
    return _launch(x, "facecast_channel_bias", (-(-count // CHANNEL_PASS_BLOCK),), (
        x, bias.to(x.dtype).contiguous(), count, x.shape[1]), BLOCK=CHANNEL_PASS_BLOCK)


def depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
                   padding: tuple[int, int], activation: int) -> torch.Tensor | None:
    """F.conv2d(x, weight, bias, stride, padding, groups=C) and the fused activation (TFLite's
    code) of an image (N, C, H, W) held channels-last, in one kernel, float32 sums rounded once
    (Note [Float16 depthwise convolutions]): (N, C, OH, OW) channels-last; None where the kernel
    cannot serve (a graph's work only, DEPTHWISE_DTYPES and DEPTHWISE_ACTIVATIONS, a (C, 1, KH,
    KW) weight, no dilation)."""
    count, channels, height, width = x.shape if x.dim() == 4 else (0, 0, 0, 0)
    if not (_serves_graph_work(x.device, "facecast_depthwise") and x.dim() == 4
            and x.dtype in DEPTHWISE_DTYPES
            and activation in DEPTHWISE_ACTIVATIONS and x.is_contiguous(memory_format=torch.channels_last)
            and weight.dim() == 4 and weight.shape[:2] == (channels, 1)
            and (bias is None or bias.numel() == channels) and x.numel() < 2 ** 31):
        return None
    kernel_h, kernel_w = weight.shape[2:]
    out_h = (height + 2 * padding[0] - kernel_h) // stride[0] + 1
    out_w = (width + 2 * padding[1] - kernel_w) // stride[1] + 1
    out = torch.empty(count, channels, out_h, out_w, dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last)
    pixels = count * out_h * out_w
    if pixels == 0 or out.numel() >= 2 ** 31:
        return out if pixels == 0 else None
    block_c = min(_power_of_two(channels), DEPTHWISE_MAX_BLOCK_C)
    block_p = DEPTHWISE_VALUES // block_c
    weight = weight.to(x.dtype).contiguous()
    bias_arg = bias.to(x.dtype).contiguous() if bias is not None else weight
    return _launch(out, "facecast_depthwise", (-(-pixels // block_p), -(-channels // block_c)), (
        x, weight, bias_arg, out, pixels, height, width, out_h, out_w), CHANNELS=channels, BLOCK_C=block_c,
        KH=kernel_h, KW=kernel_w, STRIDE_H=stride[0], STRIDE_W=stride[1], PAD_H=padding[0], PAD_W=padding[1],
        HAS_BIAS=bias is not None, ACTIVATION=activation, BLOCK_P=block_p)


def landmarks_to_matrix(landmarks: torch.Tensor, subset: torch.Tensor, left: int, right: int,
                        target_rotation: float, output_wh: tuple[int, int],
                        scale_xy: tuple[float, float]) -> torch.Tensor | None:
    """custom_ops.Landmarks2TransformMatrix (its options as arguments) of landmarks (N, L, ≥2)
    in one kernel (Note [The attention mesh's custom operators in kernels]): the (N, 4, 4)
    float32 matrices; None where the kernel cannot serve (outside a graph's work, CUSTOM_OP_DTYPES)."""
    if not (_serves_graph_work(landmarks.device, "facecast_landmarks_to_matrix")
            and landmarks.dim() == 3 and landmarks.shape[-1] >= 2
            and landmarks.dtype in CUSTOM_OP_DTYPES and subset.dim() == 1 and subset.numel() > 0):
        return None
    count = landmarks.shape[0]
    out = torch.empty(count, 4, 4, device=landmarks.device)
    if count == 0:
        return out
    if landmarks.stride(2) != 1:
        landmarks = landmarks.contiguous()
    (output_w, output_h), (scale_x, scale_y) = output_wh, scale_xy
    return _launch(out, "facecast_landmarks_to_matrix", (count,), (
        landmarks, subset, out, landmarks.stride(1), landmarks.stride(0), left, right, subset.numel(),
        math.cos(target_rotation), math.sin(target_rotation), float(scale_x), float(scale_y), float(output_w),
        float(output_h)), BLOCK_K=max(16, _power_of_two(subset.numel())))


def transform_bilinear(features: torch.Tensor, matrix: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor | None:
    """custom_ops.TransformTensorBilinear of a feature map (N, C, H, W), any layout, through
    matrices (N, 4, 4), in one kernel (Note [The attention mesh's custom operators in
    kernels]): (N, C, OH, OW) of the features' dtype, held channels-last where the features are
    (so that the refinement branches that read it run in the layout our kernels serve: Note [Batch
    and layout]), NCHW otherwise; None where the kernel cannot serve (outside a graph's work,
    CUSTOM_OP_DTYPES)."""
    if not (_serves_graph_work(features.device, "facecast_transform_bilinear")
            and features.dim() == 4 and features.dtype in CUSTOM_OP_DTYPES
            and matrix.shape == (features.shape[0], 4, 4) and features.numel() < 2 ** 31):
        return None
    count, channels, height, width = features.shape
    out_h, out_w = out_hw
    layout = torch.channels_last if features.is_contiguous(memory_format=torch.channels_last) \
        and not features.is_contiguous() else torch.contiguous_format
    out = torch.empty(count, channels, out_h, out_w, dtype=features.dtype, device=features.device,
                      memory_format=layout)
    pixels = count * out_h * out_w
    if pixels == 0 or channels == 0:
        return out
    block_c = min(_power_of_two(channels), CUSTOM_OP_MAX_BLOCK_C)
    block_p = CUSTOM_OP_VALUES // block_c
    return _launch(out, "facecast_transform_bilinear", (-(-pixels // block_p), -(-channels // block_c)), (
        features, matrix.contiguous(), out, pixels, height, width, out_h, out_w, *features.stride(), *out.stride()),
        CHANNELS=channels, BLOCK_C=block_c, BLOCK_P=block_p)


def transform_landmarks(landmarks: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor | None:
    """custom_ops.TransformLandmarks of landmarks (N, L, 2 or 3) through matrices (N, 4, 4) in
    one kernel (Note [The attention mesh's custom operators in kernels]): (N, L, D) of the
    landmarks' dtype; None where the kernel cannot serve (outside a graph's work, CUSTOM_OP_DTYPES)."""
    if not (_serves_graph_work(landmarks.device, "facecast_transform_landmarks")
            and landmarks.dim() == 3 and landmarks.shape[-1] in (2, 3)
            and landmarks.dtype in CUSTOM_OP_DTYPES and matrix.shape == (landmarks.shape[0], 4, 4)):
        return None
    landmarks = landmarks.contiguous()
    out = torch.empty_like(landmarks)
    count = landmarks.shape[0] * landmarks.shape[1]
    if count == 0:
        return out
    return _launch(out, "facecast_transform_landmarks", (-(-count // CUSTOM_OP_VALUES),), (
        landmarks, matrix.contiguous(), out, landmarks.shape[1], count), DIMS=landmarks.shape[2],
        BLOCK=CUSTOM_OP_VALUES)


def _channel_pass_serves(x: torch.Tensor, per_channel: torch.Tensor, kernel: str) -> bool:
    """Whether a per-channel pass (`prelu`, `add_channel_bias`) can run as ``kernel`` over x: in
    a graph's work (`graph_work`), an image (N, C, H, W) of CHANNEL_PASS_DTYPES held
    channels-last (read as the flat array it is), one value of ``per_channel`` a channel, and
    fewer values than the kernels' int32 positions reach."""
    return (_serves_graph_work(x.device, kernel) and x.dim() == 4 and x.dtype in CHANNEL_PASS_DTYPES
            and x.is_contiguous(memory_format=torch.channels_last) and per_channel.numel() == x.shape[1]
            and x.numel() < 2 ** 31)


def _serves_graph_work(device: torch.device, kernel: str) -> bool:
    """Whether ``kernel``, one of those for CUDA graphs only (`graph_work`), runs now: in a
    graph's work, and usable on ``device``."""
    return _graph_work.get() and unavailable_reason(device, kernel) is None


def drop_overlapping(boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor,
                     eligible: torch.Tensor, max_iou: float, max_kept: int, max_group_size: int):
    """nms.drop_overlapping_batched in one kernel (Note [The duplicate filter in one kernel]):
    (kept (N,) bool, rank (N,) long); None where the kernel cannot serve (float32 boxes and
    scores, at most MAX_FILTERED faces)."""
    count = boxes.shape[0]
    if (boxes.dtype != torch.float32 or scores.dtype != torch.float32 or count > MAX_FILTERED
            or unavailable_reason(boxes.device, "facecast_duplicates") is not None):
        return None
    kept = torch.empty(count, dtype=torch.bool, device=boxes.device)
    rank = torch.empty(count, dtype=torch.int64, device=boxes.device)
    if count == 0:
        return kept, rank
    launched = _launch(kept, "facecast_duplicates", (count,), (
        boxes.contiguous(), scores.contiguous(), groups.contiguous(), eligible.contiguous(),
        kept, rank, count, max_iou, max_kept), STEPS=max_group_size,
        BLOCK_N=max(256, _power_of_two(count)))  # every graph bucket (up to 256 faces): one compilation
    return None if launched is None else (kept, rank)


NV12_BLOCK = 1024  # pixels a program of the NV12 conversion


@functools.lru_cache(maxsize=16)
def _nv12_scalars(terms) -> tuple[float, ...]:
    """nvdec's conversion ``terms`` (from_u, from_v, constant, y_scale: nvdec._terms) as the NV12
    kernels' scalar arguments, in float32 (y_scale, b_u, g_u, g_v, r_v, b_0, g_0, r_0): made
    once per camera's colour, not per frame."""
    import numpy as np

    from_u, from_v, constant, y_scale = (np.float32(value).tolist() for value in terms)
    return (y_scale, from_u[0], from_u[1], from_v[1], from_v[2], *constant)


def nv12_to_bgr(nv12: torch.Tensor, out: torch.Tensor, terms) -> torch.Tensor | None:
    """An NV12 frame (flat uint8, or (height * 3 / 2) x width) as BGR bytes into ``out``
    (contiguous height x width x 3 uint8, on nv12's device) in one kernel, on the current
    stream: nvdec's conversion with its ``terms`` (from_u, from_v, constant, y_scale: nvdec._terms),
    in float32 as PyTorch's kernels round it; None where the kernel cannot serve."""
    if unavailable_reason(nv12.device, "facecast_nv12_to_bgr") is not None:
        return None
    height, width = out.shape[:2]
    return _launch(out, "facecast_nv12_to_bgr", (math.ceil(height * width / NV12_BLOCK),),
                   (nv12, out, height, width, *_nv12_scalars(terms)), BLOCK=NV12_BLOCK)


NV12_SLOT_WORDS = 512  # checksum words (4 KiB of the frame) a program of the NV12 slot write


def nv12_slot_partial_count(nbytes: int) -> int:
    """How many partial sums ``nv12_to_slot`` leaves for a frame of ``nbytes`` bytes."""
    return math.ceil(nbytes // 8 / NV12_SLOT_WORDS)


def nv12_to_slot(nv12: torch.Tensor, out: torch.Tensor, height: int, width: int, terms,
                 word_weights: torch.Tensor, partials: torch.Tensor) -> torch.Tensor | None:
    """An NV12 frame (flat uint8) as height x width BGR bytes into ``out`` (flat uint8, a ring
    slot: height * width * 3 bytes, a multiple of 8) with nv12_to_bgr's arithmetic, and the
    partial sums of Note [Frame checksum] of the bytes written (``word_weights``: the frame
    size's weights, one per word) into ``partials`` (int64, nv12_slot_partial_count of them),
    whose sum mod 2**64 is the checksum; one kernel on the current stream (Note [NV12 into the
    slot]). ``partials``, or None where the kernel cannot serve."""
    if unavailable_reason(nv12.device, "facecast_nv12_to_slot") is not None:
        return None
    words = word_weights.numel()
    if words * 8 != height * width * 3 or partials.numel() != nv12_slot_partial_count(words * 8):
        raise ValueError(f"nv12_to_slot: {words} checksum words and {partials.numel()} partial "
                         f"sums for a {width}x{height} frame")
    return _launch(partials, "facecast_nv12_to_slot", (partials.numel(),), (
        nv12, out, word_weights, partials, height, width, words, *_nv12_scalars(terms)),
        WORDS=NV12_SLOT_WORDS)


def prepare(device: torch.device, crops) -> str | None:
    """Compile the crop kernel now for each (dtype, border) of ``crops`` and each dtype of
    frame index it meets (warm-up: Note [Kernels of our own]); the reason it cannot be used, or
    None."""
    from facecast.models.roi import FrameBatch, RotatedRects

    if (reason := unavailable_reason(device, "facecast_crop")) is not None:
        return reason
    frames = FrameBatch(torch.zeros(1, 4, 4, 3, dtype=torch.uint8, device=device), device)
    rects = RotatedRects(torch.full((1, 2), 2.0, device=device), torch.full((1, 2), 4.0, device=device),
                         torch.zeros(1, device=device))
    for dtype, border in dict.fromkeys(crops):
        for index_dtype in (torch.long, torch.float32):  # detection's, the measuring stage's
            index = torch.zeros(1, dtype=index_dtype, device=device)
            if crop(frames, index, rects, (2, 2), border, dtype, (0.0, 1.0)) is None:
                return unavailable_reason(device, "facecast_crop")
    return None


def _launch(result: torch.Tensor, name: str, grid: tuple, args: tuple, **constants) -> torch.Tensor | None:
    """``result`` once the kernel ``name`` is queued on the current stream; None if it could
    not be (its compilation or launch failed: then PyTorch's kernels do its work, from now on;
    the other kernels go on)."""
    try:
        getattr(_kernels(), name)[grid](*args, **constants, enable_fp_fusion=False)
    except Exception as exc:  # noqa: BLE001 - a compiler or launcher failure: PyTorch's kernels
        _give_up(name, exc)
        return None
    return result


def _power_of_two(count: int) -> int:
    return 1 << max(0, count - 1).bit_length()


def _interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on the CPU: the tests'."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _give_up(kernel: str | None, exc: Exception) -> None:
    """Say once why a kernel (or, with None, every kernel) is not used from now on."""
    global _unavailable
    reason = f"{type(exc).__name__}: {exc}".strip()
    if kernel is None:
        if _unavailable is None:
            _unavailable = reason
            log.warning("Triton's kernels (Note [Kernels of our own]) cannot be used (%s); PyTorch's "
                        "kernels do their work from now on", reason)
    elif kernel not in _failed:
        _failed[kernel] = reason
        log.warning("Triton's kernel %s (Note [Kernels of our own]) cannot be used (%s); PyTorch's "
                    "kernels do its work from now on", kernel, reason)


@functools.lru_cache(maxsize=1)
def _kernels():
    """The kernels' module, imported once per process (each kernel compiled at its first
    launch)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(_cache_home() / "facecast" / "triton"))
    from facecast.models import triton_kernel_code

    return triton_kernel_code


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
