"""SSD anchors of MediaPipe's BlazeFace/BlazePose detectors, and decoding of their raw outputs.

Semantics follow MediaPipe's ``SsdAnchorsCalculator`` (non-multiscale branch) and
``TensorsToDetectionsCalculator`` with the options of the graphs named below; the numbers are
copied from those graph configs (option values, not code):

- ``face_detection_short_range.pbtxt``: 128x128 input, strides 8,16,16,16 (4 layers), min_scale
  0.1484375, max_scale 0.75, aspect ratio 1 plus one interpolated anchor per layer,
  ``fixed_anchor_size`` → 16·16·2 + 8·8·6 = 896 anchors; x/y/w/h scales 128; score threshold 0.5.
- ``face_detection_full_range.pbtxt``: 192x192 input, one stride-4 layer, no interpolated anchor →
  48·48·1 = 2304 anchors; scales 192; score threshold 0.6.
- ``pose_detection_cpu.pbtxt``: 224x224 input, strides 8,16,32,32,32 (5 layers), aspect ratio 1
  plus interpolated (the option's proto default, 1.0) → 28·28·2 + 14·14·2 + 7·7·6 = 2254
  anchors; scales 224; 4 keypoints; score threshold 0.2.

Anchors are stored as an ``(A, 2)`` tensor of centres normalized to the model input
(``fixed_anchor_size`` makes every anchor 1x1, so width and height carry no information).

Decoding (``reverse_output_order: true`` → the raw box is x, y, w, h):
``x = raw_x / x_scale * anchor_w + anchor_x`` (anchor_w = 1), same for y and every keypoint;
``w = raw_w / w_scale``; the score is ``sigmoid(clip(raw, -100, 100))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SsdAnchorSpec:
    """The subset of MediaPipe's SsdAnchorsCalculatorOptions that these detectors use."""

    input_size_px: int
    strides: tuple[int, ...]
    min_scale: float
    max_scale: float
    interpolated_scale_aspect_ratio: float  # 0 → no extra anchor per layer
    anchor_offset: float = 0.5
    aspect_ratios: tuple[float, ...] = (1.0,)


@dataclass(frozen=True)
class DetectorSpec:
    """Everything needed to turn one detector's raw tensors into boxes and keypoints."""

    name: str  # the model name of facecast.models.assets
    anchors: SsdAnchorSpec
    num_anchors: int
    num_keypoints: int
    coord_scale_px: float  # x_scale = y_scale = w_scale = h_scale in the graph
    min_score: float
    min_suppression_iou: float  # NonMaxSuppressionCalculator's min_suppression_threshold


FACE_SHORT_RANGE = DetectorSpec(
    name="face_detection_short_range",
    anchors=SsdAnchorSpec(128, (8, 16, 16, 16), 0.1484375, 0.75, 1.0),
    num_anchors=896,
    num_keypoints=6,
    coord_scale_px=128.0,
    min_score=0.5,
    min_suppression_iou=0.3,
)

FACE_FULL_RANGE = DetectorSpec(
    name="face_detection_full_range",
    anchors=SsdAnchorSpec(192, (4,), 0.1484375, 0.75, 0.0),
    num_anchors=2304,
    num_keypoints=6,
    coord_scale_px=192.0,
    min_score=0.6,
    min_suppression_iou=0.3,
)

POSE_DETECTION = DetectorSpec(
    name="pose_detection",
    anchors=SsdAnchorSpec(224, (8, 16, 32, 32, 32), 0.1484375, 0.75, 1.0),
    num_anchors=2254,
    num_keypoints=4,
    coord_scale_px=224.0,
    min_score=0.2,
    min_suppression_iou=0.3,
)

# The six face keypoints, in the detector's output order. "Left"/"right" are the subject's.
FACE_KEYPOINT_NAMES = ("right_eye", "left_eye", "nose_tip", "mouth_center", "right_ear_tragion",
                       "left_ear_tragion")


def _anchors_per_cell(spec: SsdAnchorSpec, layer_index: int) -> int:
    """How many anchors one cell of a layer carries (only the count matters: fixed size)."""
    del layer_index  # every layer of these detectors has the same aspect ratios
    return len(spec.aspect_ratios) + (1 if spec.interpolated_scale_aspect_ratio > 0 else 0)


def generate_anchors(spec: SsdAnchorSpec, input_hw: tuple[int, int] | None = None) -> torch.Tensor:
    """Anchor centres, ``(A, 2)`` float32, (x, y) normalized to the model input, in the order
    of the model's outputs.

    ``input_hw``: the anchors of a fully convolutional detector run on an input of that size
    instead of its square one (Note [The full-range detector over the whole frame]): the same
    cells, more of them, their centres in units of the square input's side, as the raw outputs
    are (so :func:`decode` gives coordinates in those units, > 1 beyond the square).

    Consecutive layers with the same stride share one feature map, their anchors interleaved
    per cell (MediaPipe merges them the same way, which is why the 3 stride-16 layers of the
    short-range detector give 6 anchors per cell on one 8x8 map).
    """
    centres: list[torch.Tensor] = []
    layer = 0
    while layer < len(spec.strides):
        stride = spec.strides[layer]
        anchors_per_cell = 0
        last = layer
        while last < len(spec.strides) and spec.strides[last] == stride:
            anchors_per_cell += _anchors_per_cell(spec, last)
            last += 1
        if input_hw is None:
            cells = math.ceil(spec.input_size_px / stride)
            coords_x = coords_y = (torch.arange(cells, dtype=torch.float64) + spec.anchor_offset) / cells
        else:
            coords_y, coords_x = ((torch.arange(math.ceil(length / stride), dtype=torch.float64)
                                   + spec.anchor_offset) * stride / spec.input_size_px for length in input_hw)
        y, x = torch.meshgrid(coords_y, coords_x, indexing="ij")
        grid = torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # row-major cells
        centres.append(grid.repeat_interleave(anchors_per_cell, dim=0))
        layer = last
    return torch.cat(centres).to(torch.float32)


@dataclass
class RawDetections:
    """Decoded but not yet suppressed detections of a batch of detector inputs.

    All coordinates are normalized to the detector's input square (0..1).
    """

    boxes: torch.Tensor  # (B, A, 4) x1, y1, x2, y2
    keypoints: torch.Tensor  # (B, A, K, 2) x, y
    scores: torch.Tensor  # (B, A) probability


def decode(
    raw_boxes: torch.Tensor, raw_scores: torch.Tensor, anchors: torch.Tensor, spec: DetectorSpec
) -> RawDetections:
    """Decode a batch of raw detector outputs.

    raw_boxes: ``(B, A, 4 + 2K)``; raw_scores: ``(B, A, 1)`` or ``(B, A)`` logits;
    anchors: ``(A, 2)`` from :func:`generate_anchors`.
    """
    if raw_boxes.dim() != 3 or raw_boxes.shape[1] != anchors.shape[0]:
        raise ValueError(
            f"{spec.name}: raw boxes must be (batch, {anchors.shape[0]} anchors, coords), "
            f"got {tuple(raw_boxes.shape)}"
        )
    expected_coords = 4 + 2 * spec.num_keypoints
    if raw_boxes.shape[2] != expected_coords:
        raise ValueError(f"{spec.name}: expected {expected_coords} values per anchor, got {raw_boxes.shape[2]}")
    if anchors.dim() != 2 or anchors.shape[1] != 2:
        raise ValueError(f"{spec.name}: anchors must be (A, 2), got {tuple(anchors.shape)}")
    raw_boxes = raw_boxes.float()
    anchors = anchors.to(raw_boxes.device, raw_boxes.dtype)
    scale = spec.coord_scale_px
    centre = raw_boxes[..., 0:2] / scale + anchors  # anchor w = h = 1 (fixed_anchor_size)
    half_size = raw_boxes[..., 2:4] / scale / 2
    boxes = torch.cat([centre - half_size, centre + half_size], dim=-1)
    keypoints = raw_boxes[..., 4:].reshape(*raw_boxes.shape[:2], spec.num_keypoints, 2) / scale
    keypoints = keypoints + anchors[:, None, :]
    logits = raw_scores.float().reshape(raw_boxes.shape[:2])
    scores = torch.sigmoid(logits.clamp(-100.0, 100.0))  # score_clipping_thresh: 100
    return RawDetections(boxes=boxes, keypoints=keypoints, scores=scores)
