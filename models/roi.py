"""Rotated regions of interest: from detections and from landmarks, batched crops, projection back.

Coordinates are image pixels in MediaPipe's convention (a normalized coordinate times the image
size; OpenCV's pixel-index grid, pixel i's centre at i), and a rect's rotation is in radians,
clockwise on screen (y points down), so that ``R(θ) = [[cos, -sin], [sin, cos]]`` maps the rect's
own axes onto the image's.

Note [ROI crop convention]
    MediaPipe's ``ImageToTensorCalculator`` (OpenCV path) maps the rotated rect's four corners
    onto the output's corners (0, 0), (S, 0), (S, S), (0, S) and warps with bilinear
    interpolation; output pixel (u, v) therefore samples the image at
    ``centre + R(θ) · ((u / S − ½)·w, (v / S − ½)·h)`` in index coordinates. Landmarks come back
    the same way (``LandmarkProjectionCalculator``): ``centre + R(θ) · ((x / S − ½)·w, …)`` and
    ``z · w / S``. Using exactly this pair keeps facecast's landmarks on MediaPipe's to well under
    a pixel; a half-pixel-centre convention would shift them by ½·(w/S − 1) px.

Note [one grid_sample for many frames]
    ``F.grid_sample`` needs one input image per grid. Rather than copying a frame per ROI, the
    frames of a batch are stacked into one tall image (rows of frame k start at ``row_offset[k]``)
    and every ROI's sampling grid is offset into its frame's rows. Sample coordinates are clamped
    to their own frame first, which is both MediaPipe's ``BORDER_REPLICATE`` and what keeps
    bilinear taps from reaching a neighbouring frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

# Landmarks of the 468/478 mesh that MediaPipe's tasks FaceLandmarker uses for the tracking
# ROI's rotation: the outer corners of the two eyes (subject's right, then left). The legacy
# face_landmark_landmarks_to_roi graph used 33 and 133 (both corners of one eye); the longer
# baseline is steadier.
MESH_ROTATION_START_INDEX = 33
MESH_ROTATION_END_INDEX = 263
ROI_SCALE = 1.5  # RectTransformationCalculator scale_x = scale_y for the face mesh


@dataclass
class RotatedRects:
    """N rotated rectangles in image pixels."""

    center_xy_px: torch.Tensor  # (N, 2)
    size_wh_px: torch.Tensor  # (N, 2)
    rotation_rad: torch.Tensor  # (N,)

    def __len__(self) -> int:
        return self.center_xy_px.shape[0]

    def __getitem__(self, index) -> "RotatedRects":
        return RotatedRects(self.center_xy_px[index], self.size_wh_px[index], self.rotation_rad[index])

    @staticmethod
    def cat(rects: Sequence["RotatedRects"]) -> "RotatedRects":
        return RotatedRects(
            torch.cat([r.center_xy_px for r in rects]),
            torch.cat([r.size_wh_px for r in rects]),
            torch.cat([r.rotation_rad for r in rects]),
        )

    def to(self, device) -> "RotatedRects":
        return RotatedRects(self.center_xy_px.to(device), self.size_wh_px.to(device), self.rotation_rad.to(device))

    def corners_px(self) -> torch.Tensor:
        """(N, 4, 2) corners: top-left, top-right, bottom-right, bottom-left in the rect's frame."""
        unit = torch.tensor([[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5], [-0.5, 0.5]],
                            dtype=self.center_xy_px.dtype, device=self.center_xy_px.device)
        return self.to_image(unit[None] * self.size_wh_px[:, None, :])

    def to_image(self, offsets_px: torch.Tensor) -> torch.Tensor:
        """Map offsets from each rect's centre, in the rect's own axes, to image pixels.

        offsets_px: (N, P, 2) → (N, P, 2).
        """
        cos, sin = torch.cos(self.rotation_rad)[:, None], torch.sin(self.rotation_rad)[:, None]
        x, y = offsets_px[..., 0], offsets_px[..., 1]
        return torch.stack([cos * x - sin * y, sin * x + cos * y], dim=-1) + self.center_xy_px[:, None, :]


def _wrap_radians(angle_rad: torch.Tensor) -> torch.Tensor:
    return angle_rad - 2 * math.pi * torch.floor((angle_rad + math.pi) / (2 * math.pi))


def rects_from_boxes_and_points(
    boxes_px: torch.Tensor,
    start_xy_px: torch.Tensor,
    end_xy_px: torch.Tensor,
    scale: float = ROI_SCALE,
    target_angle_rad: float = 0.0,
) -> RotatedRects:
    """MediaPipe's ``DetectionsToRectsCalculator`` + ``RectTransformationCalculator(square_long)``.

    The rect is centred on the axis-aligned box, rotated so that the start→end vector becomes
    horizontal (plus ``target_angle_rad``), made square on its longer side and scaled.
    boxes_px (N, 4) x1,y1,x2,y2; start/end (N, 2).
    """
    center = (boxes_px[:, 0:2] + boxes_px[:, 2:4]) / 2
    size = boxes_px[:, 2:4] - boxes_px[:, 0:2]
    delta = end_xy_px - start_xy_px
    rotation = _wrap_radians(torch.atan2(delta[:, 1], delta[:, 0]) - target_angle_rad)
    side = size.max(dim=1).values * scale
    return RotatedRects(center, torch.stack([side, side], dim=1), rotation)


def rects_from_detections(boxes_px: torch.Tensor, keypoints_px: torch.Tensor, scale: float = ROI_SCALE) -> RotatedRects:
    """Face-mesh ROI from BlazeFace detections: rotation by the eye line (keypoints 0 → 1)."""
    return rects_from_boxes_and_points(boxes_px, keypoints_px[:, 0], keypoints_px[:, 1], scale)


def rects_from_landmarks(landmarks_px: torch.Tensor, scale: float = ROI_SCALE) -> RotatedRects:
    """Tracking ROI from the previous frame's mesh (MediaPipe's face_landmarks_to_roi):
    the landmarks' axis-aligned bounding box, rotated by the eye-corner line, square, x1.5."""
    xy = landmarks_px[..., :2]
    boxes = torch.cat([xy.min(dim=1).values, xy.max(dim=1).values], dim=1)
    return rects_from_boxes_and_points(
        boxes, xy[:, MESH_ROTATION_START_INDEX], xy[:, MESH_ROTATION_END_INDEX], scale
    )


def letterbox_rect(height_px: int, width_px: int) -> tuple[float, float, float]:
    """The square, unrotated ROI that letterboxes a whole frame into a square model input
    (``keep_aspect_ratio``: the short side is padded equally on both sides).

    Returns (centre x, centre y, side) in pixels.
    """
    return width_px / 2.0, height_px / 2.0, float(max(height_px, width_px))


def tile_origins_px(length_px: int, tile_px: int, min_overlap_px: int) -> list[int]:
    """Start offsets of tiles covering [0, length) with at least ``min_overlap_px`` of overlap,
    evenly spread, the first at 0 and the last flush with the end. Empty when one tile is not
    smaller than the length (no tiling needed along that axis)."""
    if tile_px >= length_px:
        return []
    if min_overlap_px >= tile_px:
        raise ValueError(f"tile overlap {min_overlap_px} px must be smaller than the tile ({tile_px} px)")
    count = math.ceil((length_px - min_overlap_px) / (tile_px - min_overlap_px))
    count = max(count, 2)
    step = (length_px - tile_px) / (count - 1)
    return [int(round(i * step)) for i in range(count)]


def tile_rects(height_px: int, width_px: int, tile_px: int, min_overlap_px: int) -> list[tuple[float, float, float]]:
    """Square tiles (centre x, centre y, side px) over a frame; none for a frame that fits in one
    tile. Along an axis shorter than a tile the tile is centred (and letterboxed)."""
    xs = tile_origins_px(width_px, tile_px, min_overlap_px)
    ys = tile_origins_px(height_px, tile_px, min_overlap_px)
    if not xs and not ys:
        return []
    centers_x = [x + tile_px / 2 for x in xs] or [width_px / 2]
    centers_y = [y + tile_px / 2 for y in ys] or [height_px / 2]
    return [(cx, cy, float(tile_px)) for cy in centers_y for cx in centers_x]


class FrameBatch:
    """A batch of frames on one device, ready for :func:`crop_rois` (see Note [one grid_sample
    for many frames]).

    Accepts a list of HxWx3 uint8 numpy arrays or tensors (sizes may differ) or a uint8 tensor
    (B, H, W, 3). ``bgr=True`` (OpenCV's order, the default) swaps to the RGB order the models
    were trained on.
    """

    def __init__(self, frames, device: torch.device | str, dtype: torch.dtype = torch.float32, bgr: bool = True):
        device = torch.device(device)
        if isinstance(frames, torch.Tensor):
            if frames.dim() != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
                raise ValueError(f"a frame tensor must be uint8 (B, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
            tensors = list(frames.to(device))
        elif frames and all(isinstance(frame, torch.Tensor) for frame in frames):
            # Frames straight from the rings: views on the GPU (CUDA IPC) or copies (shm).
            tensors = []
            for i, frame in enumerate(frames):
                if frame.dim() != 3 or frame.shape[-1] != 3 or frame.dtype != torch.uint8:
                    raise ValueError(f"frame {i} must be a uint8 (H, W, 3) tensor, got {frame.dtype} {tuple(frame.shape)}")
                tensors.append(frame.to(device, non_blocking=True))
        else:
            tensors = []
            for i, frame in enumerate(frames):
                if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
                    desc = f"{frame.dtype} {frame.shape}" if isinstance(frame, np.ndarray) else type(frame).__name__
                    raise ValueError(f"frame {i} must be an HxWx3 uint8 numpy array, got {desc}")
                tensors.append(torch.from_numpy(np.ascontiguousarray(frame)).to(device, non_blocking=True))
        if not tensors:
            raise ValueError("no frames")
        self.device = device
        self.dtype = dtype
        self.sizes_hw = [(int(t.shape[0]), int(t.shape[1])) for t in tensors]
        max_width = max(w for _, w in self.sizes_hw)
        offsets = np.cumsum([0] + [h for h, _ in self.sizes_hw])
        self.row_offset = torch.tensor(offsets[:-1], dtype=torch.float32, device=device)
        self.frame_hw = torch.tensor(self.sizes_hw, dtype=torch.float32, device=device)
        if all(w == max_width for _, w in self.sizes_hw):
            tall = torch.cat(tensors, dim=0)
        else:
            tall = torch.cat([F.pad(t, (0, 0, 0, max_width - t.shape[1])) for t in tensors], dim=0)
        if bgr:
            tall = tall.flip(-1)
        # (1, 3, sum(H), maxW), values 0..255.
        self.tall = tall.permute(2, 0, 1)[None].to(dtype)

    def __len__(self) -> int:
        return len(self.sizes_hw)


def crop_rois(
    frames: FrameBatch,
    frame_index: torch.Tensor,
    rects: RotatedRects,
    out_size_px: int,
    border: str = "replicate",
) -> torch.Tensor:
    """Crop N rotated rects out of a frame batch in one ``grid_sample`` call.

    Returns (N, S, S, 3) float in 0..1 (NHWC, RGB, the models' layout). ``border`` is
    "replicate" (MediaPipe's default) or "zero" (black, the detectors' letterbox padding).
    See Note [ROI crop convention].
    """
    if border not in ("replicate", "zero"):
        raise ValueError(f"border must be 'replicate' or 'zero', got {border!r}")
    n = len(rects)
    device = frames.device
    if n == 0:
        return torch.zeros(0, out_size_px, out_size_px, 3, device=device)
    frame_index = frame_index.to(device=device, dtype=torch.long)
    rects = rects.to(device)
    steps = torch.arange(out_size_px, dtype=torch.float32, device=device) / out_size_px - 0.5
    v, u = torch.meshgrid(steps, steps, indexing="ij")
    unit = torch.stack([u, v], dim=-1).reshape(1, -1, 2)  # (1, S*S, 2), in [-0.5, 0.5)
    points = rects.to_image(unit * rects.size_wh_px[:, None, :].float())  # (N, S*S, 2) index coords
    hw = frames.frame_hw[frame_index]  # (N, 2)
    max_x = (hw[:, 1] - 1)[:, None]
    max_y = (hw[:, 0] - 1)[:, None]
    x = points[..., 0]
    y = points[..., 1]
    inside = (x >= -0.5) & (x <= max_x + 0.5) & (y >= -0.5) & (y <= max_y + 0.5)
    x = torch.minimum(x.clamp(min=0), max_x)
    y = torch.minimum(y.clamp(min=0), max_y) + frames.row_offset[frame_index][:, None]
    tall_h, tall_w = frames.tall.shape[2], frames.tall.shape[3]
    # align_corners=True: normalized −1 and +1 are the centres of the first and last pixels.
    grid_x = x / max(tall_w - 1, 1) * 2 - 1
    grid_y = y / max(tall_h - 1, 1) * 2 - 1
    grid = torch.stack([grid_x, grid_y], dim=-1).reshape(1, n * out_size_px, out_size_px, 2)
    sampled = F.grid_sample(frames.tall, grid.to(frames.dtype), mode="bilinear", padding_mode="border",
                            align_corners=True)  # (1, 3, N*S, S)
    out = sampled[0].reshape(3, n, out_size_px, out_size_px).permute(1, 2, 3, 0).float() / 255.0
    if border == "zero":
        out = out * inside.reshape(n, out_size_px, out_size_px, 1)
    return out


def project_points(points_model_px: torch.Tensor, rects: RotatedRects, input_size_px: int) -> torch.Tensor:
    """Map points predicted in a model's input (pixels of the S x S crop) back to the image.

    points (N, P, 2 or 3); z, if present, is scaled like x (by rect width / S), giving a depth
    in image pixels. See Note [ROI crop convention].
    """
    rects = rects.to(points_model_px.device)
    xy = points_model_px[..., :2] / input_size_px - 0.5
    image_xy = rects.to_image(xy * rects.size_wh_px[:, None, :])
    if points_model_px.shape[-1] == 2:
        return image_xy
    z = points_model_px[..., 2:3] * (rects.size_wh_px[:, None, 0:1] / input_size_px)
    return torch.cat([image_xy, z], dim=-1)


def project_boxes(boxes_model_px: torch.Tensor, rects: RotatedRects, input_size_px: int) -> torch.Tensor:
    """Map axis-aligned boxes from unrotated crops (letterbox, tiles) back to image pixels."""
    corners = torch.stack([boxes_model_px[..., 0:2], boxes_model_px[..., 2:4]], dim=-2)  # (N, M, 2, 2)
    n, m = corners.shape[:2]
    projected = project_points(corners.reshape(n, m * 2, 2), rects, input_size_px).reshape(n, m, 2, 2)
    return torch.cat([projected[..., 0, :], projected[..., 1, :]], dim=-1)
