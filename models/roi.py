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

Note [Sampling the frames where they lie]
    A batch's frames are stacked into one tall uint8 image (rows of frame k start at
    ``row_offset[k]``), as the capture rings hold them: BGR (or RGB), one byte per channel, never
    converted as a whole. Every ROI of every frame is cropped by one bilinear gather from it:
    per output pixel the four neighbouring source pixels are fetched by flat index and blended
    in float32. Sample coordinates are clamped to their own frame first, which is both
    MediaPipe's ``BORDER_REPLICATE`` and what keeps the taps from reaching a neighbouring frame.
    Only the pixels a crop reads are ever touched: a 1080p frame's detector inputs (letterbox
    and whole frame) read about 164 k samples, where converting the frame to a float tensor first
    (what a ``grid_sample`` over the frames needs) writes 6.2 M values per frame. The arithmetic
    is ``grid_sample``'s (bilinear, ``align_corners=True``, border padding) without its
    normalize/unnormalize round trip; the two agree to float rounding (< 1e-4 of 255).

Note [Crop taps made once]
    A crop is two parts: where it samples (each output row's and column's two source rows and
    columns and their weights, from the rects and the frames' sizes and row offsets) and the
    blend of the four taps read from the pixels. The first is ~60 small kernels on (N, H, 1) and
    (N, 1, W) tensors, the second a dozen full-size passes. For the detection pass's CUDA graph
    the rects (letterbox, whole frame) and the static batch's layout never change, so its taps
    are made once, when the graph is built (FaceDetector.crop_taps), and each replay only blends:
    on the H100 (2026-11-26) the pass's crops were 130 kernels and 1.1 ms over 32 1080p frames.
    On a GPU both parts are now one Triton kernel (Note [One kernel for a batch of crops],
    models/triton_kernels.py); the taps and their blend are what runs where it cannot.

Note [Crops on the CPU]
    On the CPU the per-pixel gathers above are slow: a 256x256 crop of a 720p frame took 1.74 ms
    in torch (four index_select passes over 196 k values and their blends, one thread, the
    2-core machine, 2026-11-27), about a sixth of a one-face frame's time once the models ran in
    LiteRT (Note [LiteRT on the CPU]). There each crop is OpenCV's warpAffine instead, as
    MediaPipe's CPU path crops: the convention's affine map (Note [ROI crop convention]) from
    the output to the frame, bilinear, BORDER_REPLICATE, in float32 over the part of the frame
    the crop reads (converted to float first, so that the samples are not rounded to whole grey
    levels as a uint8 warp would round them), the channels swapped on the bytes read before the
    warp and every crop scaled in one pass after it: 0.21 ms a 256 crop of a 360 px ROI (0.52
    swapping and scaling each warped crop, strided), the same values within 0.004 grey levels
    (tests/models/test_stages.py holds the two to each other). The zero-bordered crops (the
    detectors' letterbox and whole frames, body pose's letterbox) are the same warp with the
    gathers' border put on after it, black where a sample lies more than half a pixel beyond the
    frame (a cut, where OpenCV's own constant border would blend the edge with black): a 720p
    frame's detection pass 13.1 ms against 19.3 with the gathers, LiteRT's invokes included
    (2026-11-27). A detection graph (the tests' stand-in for one on the CPU) keeps its taps,
    made once (Note [Crop taps made once]). MediaPipe's own CPU recipe, a uint8 warp then
    floats, was tried for every crop (2026-11-27) and not taken: rounded to whole grey levels,
    body pose's landmarks moved by up to 4 % of the frame and its visibilities by 0.1 against
    the float reference (tests/models/test_pose.py), for 0.04 ms a crop. The face meshes'
    crops take it since (next Note).

Note [Face crops from bytes on the CPU]
    The measuring stage's crops (FaceMeasurer: the FaceLandmarker's and the attention mesh's
    256x256 input) are warped from the frame's bytes on the CPU and made floats after the warp,
    as MediaPipe's CPU ImageToTensor makes them for these models (a uint8 warpPerspective, then
    convertTo float), so their samples round to whole grey levels (at most 0.5 off the float
    warp's, 0.25 on average). A face that fills a large part of the frame made the float warp's
    cost grow with it: the part's channel swap and float conversion, then OpenCV's float32
    warp, which has no SIMD path; from bytes the swap and the floats are the crop's 196 k values
    whatever the face's size. Measured on the 2-core machine (2026-11-28, one thread, a 1080p
    frame): a crop of a 630 px ROI 2.9-3.2 -> 1.0-1.1 ms, of a 300 px ROI 0.72-0.82 -> 0.83-0.88
    (the same within the noise); `facecast analyze` of a 1080p file with one face 71.6 -> 78.8
    frames/s in interleaved turns, 720p (a 420 px ROI) 83.3 -> 83.8 (docs/benchmarks.md). What
    it changes (the CPU stack over the 72 frames of ../shared/footage/single_face.mp4, a 150 px
    face in 640x360, tracking): the landmarks 0.019 px apart per frame (median; 0.039 at most),
    no point more than 0.3 px, blendshapes within 0.017 (float16 models against float32 on a
    GPU: 0.0196). Body pose and the detectors keep the float warp (above); a GPU's crops are
    the float kernel's (Note [One kernel for a batch of crops]), which this does not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from facecast.models import triton_kernels

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


def rect_arrays_from_landmarks(landmarks_px: np.ndarray, scale: float = ROI_SCALE
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`rects_from_landmarks`'s (centre (N, 2), size (N, 2), rotation (N,)) of float32
    landmarks (N, P, ≥2) in numpy, the same values: a tracking step's ROIs in ~10 numpy calls
    instead of ~20 torch calls (Note [The next ROIs on the host], models/face_tracking.py)."""
    xy = landmarks_px[..., :2]
    low, high = xy_extents_on_host(xy_rows_on_host(xy))
    return _rect_arrays(low, high, xy[:, MESH_ROTATION_START_INDEX], xy[:, MESH_ROTATION_END_INDEX], scale)


def rect_arrays_from_detections(boxes_px: np.ndarray, keypoints_px: np.ndarray, scale: float = ROI_SCALE
                                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`rects_from_detections`'s (centre, size, rotation) of float32 boxes (N, 4) and
    keypoints (N, K, 2) in numpy, the same values."""
    return _rect_arrays(boxes_px[:, 0:2], boxes_px[:, 2:4], keypoints_px[:, 0], keypoints_px[:, 1], scale)


def _rect_arrays(low: np.ndarray, high: np.ndarray, start_xy: np.ndarray, end_xy: np.ndarray,
                 scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`rects_from_boxes_and_points` in numpy (its target angle 0), the same values: the
    angle by torch's atan2 on the CPU, the rest IEEE arithmetic in the same order."""
    delta = end_xy - start_xy
    # The columns as strided views, as the tensors' path takes them: torch's CPU atan2 over a
    # contiguous input takes its vectorised form, whose last bit can differ.
    angle = torch.atan2(torch.from_numpy(delta[:, 1]), torch.from_numpy(delta[:, 0])).numpy()
    rotation = angle - 2 * math.pi * np.floor((angle + math.pi) / (2 * math.pi))  # _wrap_radians
    side = (high - low).max(axis=1) * scale
    return (low + high) / 2, np.stack([side, side], axis=1), rotation


# Note [Landmark extents over a contiguous axis]
#     The least and greatest x and y of a face's points, (N, P, 3) float32 landmarks reduced over
#     P: numpy reduces such a middle axis, strided by the point's 12 bytes, one element at a
#     time, 11 us a reduction for one face's 478 points (the 2-core machine, 2026-11-27); over a
#     contiguous last axis it takes SIMD steps, 1 us. A CPU step took six such reductions of each
#     face's landmarks (the boxes, the duplicate filter's bounds, the next ROIs), so the CPU stack
#     copies the coordinates once into (N, 2, P) rows (xy_rows_on_host, ~1 us) and reduces those.
#     A minimum and a maximum are the same in any order of the elements (a NaN comes out as
#     NaN either way): the same values (tests/models/test_batched_tracking.py).
def xy_rows_on_host(points_px: np.ndarray) -> np.ndarray:
    """(N, 2, P): each face's x and y (of points (N, P, ≥2)) as contiguous rows, for
    :func:`xy_extents_on_host` (Note [Landmark extents over a contiguous axis])."""
    return np.ascontiguousarray(points_px[..., :2].transpose(0, 2, 1))


def xy_extents_on_host(xy_rows: np.ndarray, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(low, high), (N, 2) each: the least and greatest x and y of each face's first ``count``
    points (all by default) of :func:`xy_rows_on_host`'s rows, the values of
    ``points[:, :count, :2].min(axis=1)`` and ``.max(axis=1)``."""
    rows = xy_rows[..., :count]
    return rows.min(axis=2), rows.max(axis=2)


def letterbox_rect(height_px: int, width_px: int) -> tuple[float, float, float]:
    """The square, unrotated ROI that letterboxes a whole frame into a square model input
    (``keep_aspect_ratio``: the short side is padded equally on both sides).

    Returns (centre x, centre y, side) in pixels.
    """
    return width_px / 2.0, height_px / 2.0, float(max(height_px, width_px))


def copy_from_host(values: np.ndarray, destination: torch.Tensor) -> torch.Tensor:
    """A small table from the host into ``destination``, as :func:`from_host` copies it (on a
    GPU pinned and without waiting for the device's queued work)."""
    table = torch.from_numpy(np.ascontiguousarray(values))
    if destination.device.type == "cuda":
        return destination.copy_(table.pin_memory(), non_blocking=True)
    return destination.copy_(table)


def from_host(values, device: torch.device) -> torch.Tensor:
    """A small table from the host on the device, copied without waiting for the device's
    queued work (pinned, non-blocking; the caching host allocator keeps the pinned buffer
    until the copy is done)."""
    table = torch.as_tensor(np.asarray(values))
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


class FrameBatch:
    """A batch of frames on one device, ready for :func:`crop_rois` (see Note [Sampling the
    frames where they lie]).

    Accepts a list of HxWx3 uint8 numpy arrays or tensors (sizes may differ) or a uint8 tensor
    (B, H, W, 3). ``bgr=True`` (OpenCV's order, the default) means the crops swap to the RGB
    order the models were trained on. ``dtype`` is the floating type of :attr:`tall`.

    A (B, H, W, 3) tensor already on ``device`` is used in place (no copy); a list is stacked
    into one new tensor, a snapshot of its frames.
    """

    def __init__(self, frames, device: torch.device | str, dtype: torch.dtype = torch.float32, bgr: bool = True):
        device = torch.device(device)
        if isinstance(frames, torch.Tensor):
            if frames.dim() != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
                raise ValueError(f"a frame tensor must be uint8 (B, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
            if frames.shape[0] == 0:
                raise ValueError("no frames")
            count, height, width, _ = frames.shape
            pixels = frames.to(device).reshape(count * height, width, 3)
            self._setup(pixels, [(int(height), int(width))] * int(count), device, dtype, bgr)
            return
        if frames and all(isinstance(frame, torch.Tensor) for frame in frames):
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
        sizes_hw = [(int(t.shape[0]), int(t.shape[1])) for t in tensors]
        max_width = max(w for _, w in sizes_hw)
        if all(w == max_width for _, w in sizes_hw):
            pixels = torch.cat(tensors, dim=0)
        else:
            pixels = torch.cat([F.pad(t, (0, 0, 0, max_width - t.shape[1])) for t in tensors], dim=0)
        self._setup(pixels, sizes_hw, device, dtype, bgr)

    @classmethod
    def in_place(cls, frames: Sequence[torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype = torch.float32, bgr: bool = True) -> "FrameBatch":
        """A batch over uint8 (H, W, 3) frame tensors that lie in rows of one buffer, in order
        (a batch read from the rings: Note [A batch's frames in one buffer]), used where they
        lie: no stacked copy. Frames that do not (other
        widths, other buffers, another device) are stacked as ``FrameBatch(frames)`` stacks them.
        Only for frames that nothing writes while the batch is in use: the batch does not
        snapshot them."""
        device = torch.device(device)
        rows = _rows_of_one_buffer(frames, device)
        if rows is None:
            return cls(list(frames), device, dtype, bgr)
        pixels, row_offsets = rows
        batch = cls.__new__(cls)
        batch._setup(pixels, [(int(f.shape[0]), int(f.shape[1])) for f in frames], device, dtype, bgr,
                     row_offsets)
        return batch

    @classmethod
    def from_pixels(cls, pixels: torch.Tensor, sizes_hw: Sequence[tuple[int, int]], dtype: torch.dtype = torch.float32,
                    bgr: bool = True) -> "FrameBatch":
        """A batch over frames already stacked row by row in one (sum H, max W, 3) uint8 tensor,
        used in place (e.g. the static input of a CUDA graph)."""
        if pixels.dim() != 3 or pixels.shape[-1] != 3 or pixels.dtype != torch.uint8:
            raise ValueError(f"pixels must be uint8 (rows, width, 3), got {pixels.dtype} {tuple(pixels.shape)}")
        sizes_hw = [(int(h), int(w)) for h, w in sizes_hw]
        if sum(h for h, _ in sizes_hw) != pixels.shape[0] or max(w for _, w in sizes_hw) != pixels.shape[1]:
            raise ValueError(f"frames of sizes {sizes_hw} do not stack to {tuple(pixels.shape[:2])}")
        batch = cls.__new__(cls)
        batch._setup(pixels, sizes_hw, pixels.device, dtype, bgr)
        return batch

    def _setup(self, pixels: torch.Tensor, sizes_hw: list[tuple[int, int]], device: torch.device,
               dtype: torch.dtype, bgr: bool, row_offsets_px: list[int] | None = None) -> None:
        self.device = device
        self.dtype = dtype
        self.bgr = bgr
        # (rows, max W, 3) uint8, the frames' own channel order: frame k's rows start at
        # row_offsets_px[k] (back to back, unless the frames were used where they lay: in_place).
        self.pixels = pixels
        self.sizes_hw = sizes_hw
        if row_offsets_px is None:
            row_offsets_px = np.cumsum([0] + [h for h, _ in sizes_hw])[:-1]
        self.row_offsets_px = [int(o) for o in row_offsets_px]
        self._frame_table = None
        if device.type != "cpu":  # made before any graph's capture, as the frames arrive
            self._frame_table = self._make_frame_table()
        self._tall = None

    def _make_frame_table(self) -> torch.Tensor:
        # One host-to-device copy for both per-frame tables.
        table = torch.tensor([[o, h, w] for o, (h, w) in zip(self.row_offsets_px, self.sizes_hw)],
                             dtype=torch.float32)
        if self.device.type == "cuda":  # without waiting for the device's queued work
            table = table.pin_memory()
        return table.to(self.device, non_blocking=True)

    @property
    def frame_table(self) -> torch.Tensor:
        """(F, 3) float32 on the device: each frame's row offset, height, width (the gathers'
        and the crop kernel's; on the CPU made on first use: OpenCV's crops read the lists)."""
        if self._frame_table is None:
            self._frame_table = self._make_frame_table()
        return self._frame_table

    @property
    def row_offset(self) -> torch.Tensor:
        return self.frame_table[:, 0]

    @property
    def frame_hw(self) -> torch.Tensor:
        return self.frame_table[:, 1:]

    @property
    def tall(self) -> torch.Tensor:
        """The frames as one (1, 3, sum(H), max W) image of ``dtype``, RGB, values 0..255: made on
        first use only (:func:`crop_rois` reads :attr:`pixels`)."""
        if self._tall is None:
            tall = self.pixels.flip(-1) if self.bgr else self.pixels
            self._tall = tall.permute(2, 0, 1)[None].to(self.dtype)
        return self._tall

    def __len__(self) -> int:
        return len(self.sizes_hw)


def _rows_of_one_buffer(frames: Sequence[torch.Tensor], device: torch.device
                        ) -> tuple[torch.Tensor, list[int]] | None:
    """(pixels, row offsets) when the frames are contiguous uint8 (H, W, 3) tensors of one
    width on ``device``, in ascending order in one buffer (FrameBatch.in_place); else None."""
    if not frames or not all(isinstance(f, torch.Tensor) for f in frames):
        return None
    first = frames[0]
    if len(frames) == 1:  # one frame (`facecast analyze` of one file): itself, in one buffer always
        usable = (first.dim() == 3 and first.dtype == torch.uint8 and first.shape[2] == 3
                  and first.device.type == device.type
                  and (device.index is None or first.device.index == device.index) and first.is_contiguous())
        return (first, [0]) if usable else None
    width = first.shape[1] if first.dim() == 3 else -1
    row_bytes = width * 3
    storage = first.untyped_storage().data_ptr()
    offsets, next_free = [], first.data_ptr()
    for frame in frames:
        if (frame.dim() != 3 or frame.dtype != torch.uint8 or frame.shape[1:] != (width, 3)
                or frame.device.type != device.type
                or device.index is not None and frame.device.index != device.index
                or not frame.is_contiguous()
                or frame.untyped_storage().data_ptr() != storage or frame.data_ptr() < next_free):
            return None
        offset = frame.data_ptr() - first.data_ptr()
        if offset % row_bytes:
            return None
        offsets.append(offset // row_bytes)
        next_free = frame.data_ptr() + frame.numel()
    rows = offsets[-1] + frames[-1].shape[0]
    return first.as_strided((rows, width, 3), (row_bytes, 3, 1)), offsets


def crop_rois(
    frames: FrameBatch,
    frame_index: torch.Tensor,
    rects: RotatedRects,
    out_size_px: int | tuple[int, int],
    border: str = "replicate",
    dtype: torch.dtype = torch.float32,
    *,
    value_range: tuple[float, float] = (0.0, 1.0),
    axis_aligned: bool = False,
    out: torch.Tensor | None = None,
    float_frames: dict[int, np.ndarray] | None = None,
    from_bytes: bool = False,
) -> torch.Tensor:
    """Crop N rotated rects out of a frame batch in one bilinear gather.

    Returns (N, S, S, 3) ``dtype`` (NHWC, RGB, the models' layout), or (N, H, W, 3) for an
    ``out_size_px`` of (H, W) (each rect's width onto W columns, its height onto H rows), pixel
    values 0..255 mapped
    linearly onto ``value_range`` (0..1 by default; the detectors take -1..1). ``border`` is
    "replicate" (MediaPipe's default) or "zero" (black, the detectors' letterbox padding: the
    low end of ``value_range``). ``axis_aligned=True`` promises that every rect's rotation is
    0 (letterbox and whole frames), which lets the sample coordinates be computed per row and per
    column instead of per pixel, with the same values. See Note [ROI crop convention] and Note
    [Sampling the frames where they lie]. Shapes depend only on N and S, and nothing waits for
    the device: the call can be captured in a CUDA graph. ``frame_index`` (N,) holds integers,
    or whole numbers as float32; ``out``, where given, a contiguous (N, S, S, 3) ``dtype`` tensor,
    receives the crops (the measuring stage's graph input: Note [Measuring on the device]).
    ``float_frames``: a dict that OpenCV's crops on the CPU may keep a whole frame's floats in
    for the next crop of the same frame (Note [A whole frame's floats once]). ``from_bytes``: on
    the CPU, warp the frame's bytes and convert the warped crop, as MediaPipe's CPU path does:
    its samples round to whole grey levels (Note [Face crops from bytes on the CPU]); on a GPU
    and in the taps it changes nothing.
    """
    if border not in ("replicate", "zero"):
        raise ValueError(f"border must be 'replicate' or 'zero', got {border!r}")
    out_hw = (out_size_px, out_size_px) if isinstance(out_size_px, int) else tuple(out_size_px)
    if out is not None and (out.shape != (len(rects), *out_hw, 3) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of {(len(rects), *out_hw, 3)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if frames.device.type == "cuda":  # Note [One kernel for a batch of crops]
        crops = triton_kernels.crop(frames, frame_index, rects, out_hw, border, dtype, value_range, out)
        if crops is not None:
            return crops
    if frame_index.is_floating_point():
        frame_index = frame_index.long()
    if frames.device.type == "cpu" and dtype == torch.float32:
        crops = _crop_rois_with_opencv(frames, frame_index, rects, out_size_px, border, value_range,
                                       float_frames, from_bytes)
    else:
        crops = crop_taps(frames, frame_index, rects, out_size_px, border, dtype, value_range=value_range,
                          axis_aligned=axis_aligned).crop(frames)
    return crops if out is None else out.copy_(crops)


def _crop_rois_with_opencv(frames: FrameBatch, frame_index: torch.Tensor, rects: RotatedRects,
                           out_size_px: int | tuple[int, int], border: str,
                           value_range: tuple[float, float],
                           float_frames: dict[int, np.ndarray] | None = None,
                           from_bytes: bool = False) -> torch.Tensor:
    """:func:`crop_rois` on the CPU, one warpAffine a rect (Note [Crops on the CPU]; ``from_bytes``:
    Note [Face crops from bytes on the CPU])."""
    out_h, out_w = (out_size_px, out_size_px) if isinstance(out_size_px, int) else out_size_px
    low, high = value_range
    scale = (high - low) / 255.0
    crops = np.empty((len(rects), out_h, out_w, 3), np.float32)
    pixels = frames.pixels.numpy()
    indices = frame_index.long().tolist()
    centres, sizes = rects.center_xy_px.tolist(), rects.size_wh_px.tolist()
    # The output's corner pixels, homogeneous: where they land bounds what a crop reads.
    output_corners = np.array([[0, 0, 1], [out_w - 1, 0, 1], [0, out_h - 1, 1], [out_w - 1, out_h - 1, 1]],
                              np.float64)
    columns, rows = np.arange(out_w, dtype=np.float64), np.arange(out_h, dtype=np.float64)[:, None]
    for n, (k, (cx, cy), (sw, sh), angle) in enumerate(zip(indices, centres, sizes, rects.rotation_rad.tolist())):
        height, width = frames.sizes_hw[k]
        top = frames.row_offsets_px[k]
        cos, sin = math.cos(angle), math.sin(angle)
        # Output pixel (j, i) samples centre + R(angle) · ((j / W − ½)·w, (i / H − ½)·h).
        to_frame = np.array([[cos * sw / out_w, -sin * sh / out_h, cx - 0.5 * cos * sw + 0.5 * sin * sh],
                             [sin * sw / out_w, cos * sh / out_h, cy - 0.5 * sin * sw - 0.5 * cos * sh]])
        corners = output_corners @ to_frame.T
        outside = None
        if border == "zero" and not ((corners >= -0.5).all() and (corners[:, 0] <= width - 0.5).all()
                                     and (corners[:, 1] <= height - 0.5).all()):
            # The gathers' zero border: a sample more than half a pixel beyond the frame is black.
            x = to_frame[0, 0] * columns + to_frame[0, 1] * rows + to_frame[0, 2]
            y = to_frame[1, 0] * columns + to_frame[1, 1] * rows + to_frame[1, 2]
            outside = (x < -0.5) | (x > width - 0.5) | (y < -0.5) | (y > height - 0.5)
        if from_bytes:
            # Straight from the frame's bytes, its own edge replicated; the channels swapped and
            # the floats made on the crop's pixels, not on the part's.
            warped = cv2.warpAffine(pixels[top:top + height, :width], to_frame, (out_w, out_h),
                                    flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                                    borderMode=cv2.BORDER_REPLICATE)
            crops[n] = cv2.cvtColor(warped, cv2.COLOR_BGR2RGB) if frames.bgr else warped
            if outside is not None:
                crops[n][outside] = 0.0
            continue
        # The part of the frame the samples and their right and lower neighbours fall in; a
        # crop beyond the frame's edge replicates the edge, as the frame's own border would.
        x0 = min(max(0, math.floor(corners[:, 0].min()) - 1), width - 1)
        y0 = min(max(0, math.floor(corners[:, 1].min()) - 1), height - 1)
        x1 = max(min(width, math.ceil(corners[:, 0].max()) + 2), x0 + 1)
        y1 = max(min(height, math.ceil(corners[:, 1].max()) + 2), y0 + 1)
        if float_frames is not None and 4 * (y1 - y0) * (x1 - x0) >= 3 * height * width:
            part = _float_frame(float_frames, frames, pixels, k)[y0:y1, x0:x1]  # Note [A whole frame's floats once]
        else:
            part = pixels[top + y0:top + y1, x0:x1]
            if frames.bgr:  # swapped on the bytes read, before the warp: no strided pass after it
                part = cv2.cvtColor(part, cv2.COLOR_BGR2RGB)
            part = part.astype(np.float32)
        to_frame[:, 2] -= (x0, y0)
        cv2.warpAffine(part, to_frame, (out_w, out_h), dst=crops[n],
                       flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REPLICATE)
        if outside is not None:
            crops[n][outside] = 0.0  # the low end of the value range, below
    crops *= scale  # every crop at once
    if low != 0.0:
        crops += low
    return torch.from_numpy(crops)


# Note [A whole frame's floats once]
#     The detection pass crops each frame twice on the CPU, both crops of the whole frame: the
#     short-range detector's letterbox and the full-range detector's input (Note [The full-range
#     detector over the whole frame]). Each warp reads the frame's RGB as float32 (Note [Crops on
#     the CPU]), and each made it afresh: a channel swap and a float conversion of the whole
#     frame, 2.8 million values at 720p and 6.2 at 1080p (25 MB of floats). Within one detection
#     pass (FaceDetector.core gives its crops one ``float_frames`` dict) a crop that reads most
#     of its frame (three quarters of it or more: the detectors' do) takes its part from one
#     float RGB copy of the whole frame, made by the first such crop and kept for the next. The
#     dict keeps one frame's: a pass over several frames crops the short-range inputs of all
#     before the full-range ones, so it saves nothing there and holds no more than one frame's
#     floats. The part's values are those its own conversion gives, and the warp reads them
#     through the copy's row stride: the same crops (tests/models/test_stages.py).
def _float_frame(float_frames: dict[int, np.ndarray], frames: FrameBatch, pixels: np.ndarray,
                 k: int) -> np.ndarray:
    """Frame ``k`` of the batch as float32 RGB (H, W, 3), made once a detection pass for the
    crops that read most of it (Note [A whole frame's floats once])."""
    converted = float_frames.get(k)
    if converted is None:
        height, width = frames.sizes_hw[k]
        top = frames.row_offsets_px[k]
        whole = pixels[top:top + height, :width]
        if frames.bgr:
            whole = cv2.cvtColor(whole, cv2.COLOR_BGR2RGB)
        converted = whole.astype(np.float32)
        float_frames.clear()
        float_frames[k] = converted
    return converted


@dataclass
class CropTaps:
    """Where :func:`crop_rois` samples and with what weights: everything of a crop but the
    frames' pixels (Note [Crop taps made once]). ``crop(frames)`` reads a batch of the layout the
    taps were made for (the same frame sizes and row offsets)."""

    shape: tuple[int, int, int]  # N, H, W of the crops
    col_left: torch.Tensor  # (N, 1 or H, W) int: the left taps' columns
    col_right: torch.Tensor
    row_up: torch.Tensor  # (N, H, 1 or W) int: the upper taps' first flat pixel of their row
    row_down: torch.Tensor
    weight_left: torch.Tensor  # the four taps' weights, ``compute`` dtype, broadcastable
    weight_right: torch.Tensor
    weight_up: torch.Tensor
    weight_down: torch.Tensor
    low: float
    dtype: torch.dtype

    def crop(self, frames: FrameBatch) -> torch.Tensor:
        n, out_h, out_w = self.shape
        if n == 0:
            return torch.zeros(0, out_h, out_w, 3, device=frames.device, dtype=self.dtype)
        flat = frames.pixels.reshape(-1, 3)

        def tap(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
            return flat.index_select(0, (row + col).reshape(-1)).reshape(n, out_h, out_w, 3)

        def blend(row: torch.Tensor) -> torch.Tensor:
            out = tap(row, self.col_left) * self.weight_left
            return out.addcmul_(tap(row, self.col_right), self.weight_right)

        out = blend(self.row_up).mul_(self.weight_up)
        out.addcmul_(blend(self.row_down), self.weight_down)
        if frames.bgr:
            out = out.flip(-1)
        if self.low != 0.0:
            out = out.add_(self.low)
        return out.to(self.dtype)


def crop_taps(
    frames: FrameBatch,
    frame_index: torch.Tensor,
    rects: RotatedRects,
    out_size_px: int | tuple[int, int],
    border: str = "replicate",
    dtype: torch.dtype = torch.float32,
    *,
    value_range: tuple[float, float] = (0.0, 1.0),
    axis_aligned: bool = False,
) -> CropTaps:
    """:func:`crop_rois`' sampling of the rects (its arguments but the pixels): the taps that
    ``CropTaps.crop`` blends."""
    if border not in ("replicate", "zero"):
        raise ValueError(f"border must be 'replicate' or 'zero', got {border!r}")
    n = len(rects)
    device = frames.device
    out_h, out_w = (out_size_px, out_size_px) if isinstance(out_size_px, int) else out_size_px
    if n == 0:
        nothing = torch.zeros(0, device=device)
        return CropTaps((0, out_h, out_w), *[nothing] * 8, 0.0, dtype)
    # Blending in float16 is as exact as the float16 result (0..255 keeps 3 significant digits).
    compute = torch.float16 if dtype == torch.float16 else torch.float32
    frame_index = frame_index.to(device=device, dtype=torch.long)
    rects = rects.to(device)
    steps_u = torch.arange(out_w, dtype=torch.float32, device=device) / out_w - 0.5
    steps_v = torch.arange(out_h, dtype=torch.float32, device=device) / out_h - 0.5
    size = rects.size_wh_px.float()
    along_u = (steps_u[None, :] * size[:, 0:1])[:, None, :]  # (N, 1, W): offsets along the rect's x
    along_v = (steps_v[None, :] * size[:, 1:2])[:, :, None]  # (N, H, 1): ... along its y
    centre_x = rects.center_xy_px[:, 0, None, None]
    centre_y = rects.center_xy_px[:, 1, None, None]
    if axis_aligned:
        x, y = along_u + centre_x, along_v + centre_y  # (N, 1, W) and (N, H, 1)
    else:  # RotatedRects.to_image, written with broadcasting: (N, H, W) each
        cos = torch.cos(rects.rotation_rad)[:, None, None]
        sin = torch.sin(rects.rotation_rad)[:, None, None]
        x = cos * along_u - sin * along_v + centre_x
        y = sin * along_u + cos * along_v + centre_y
    hw = frames.frame_hw[frame_index]  # (N, 2)
    max_x = (hw[:, 1] - 1)[:, None, None]
    max_y = (hw[:, 0] - 1)[:, None, None]
    if border == "zero":  # before the clamping below
        inside_x = (x >= -0.5) & (x <= max_x + 0.5)
        inside_y = (y >= -0.5) & (y <= max_y + 0.5)
    x = torch.minimum(x.clamp(min=0), max_x)
    y = torch.minimum(y.clamp(min=0), max_y)
    x0 = x.floor()
    y0 = y.floor()
    # Weights of the left/right and upper/lower taps; the output's scale (and, for a black
    # border, the inside test) folded in, so that the full-size passes are only the blend.
    low, high = value_range
    scale = (high - low) / 255.0
    weight_right = x - x0
    weight_down = y - y0
    weight_left = 1 - weight_right
    weight_up = (1 - weight_down) * scale
    weight_down = weight_down * scale
    if border == "zero":
        weight_left, weight_right = weight_left * inside_x, weight_right * inside_x
        weight_up, weight_down = weight_up * inside_y, weight_down * inside_y
    # Tap indices into the frames' flat pixels. The right and lower neighbours stay inside the
    # frame: on its last column (row) their weight is 0, and clamping keeps the tap off the
    # padding (or the next frame's first row).
    width = frames.pixels.shape[1]
    index_dtype = torch.int32 if frames.pixels.shape[0] * width < 2**31 else torch.long
    col_left = x0.to(index_dtype)
    col_right = col_left + (x0 < max_x).to(index_dtype)
    row_up = (y0 + frames.row_offset[frame_index][:, None, None]).to(index_dtype) * width
    row_down = row_up + (y0 < max_y).to(index_dtype) * width
    return CropTaps((n, out_h, out_w), col_left, col_right, row_up, row_down,
                    weight_left[..., None].to(compute), weight_right[..., None].to(compute),
                    weight_up[..., None].to(compute), weight_down[..., None].to(compute), low, dtype)


def project_points(points_model_px: torch.Tensor, rects: RotatedRects,
                   input_size_px: int | tuple[int, int]) -> torch.Tensor:
    """Map points predicted in a model's input (pixels of the S x S crop, or of an (H, W) one)
    back to the image.

    points (N, P, 2 or 3); z, if present, is scaled like x (by rect width / S), giving a depth
    in image pixels. See Note [ROI crop convention].
    """
    rects = rects.to(points_model_px.device)
    input_h, input_w = (input_size_px, input_size_px) if isinstance(input_size_px, int) else input_size_px
    if input_h == input_w:
        xy = points_model_px[..., :2] / input_w - 0.5
    else:  # by scalars, not a tensor made from host values: this runs inside CUDA graph captures
        xy = torch.stack([points_model_px[..., 0] / input_w, points_model_px[..., 1] / input_h], dim=-1) - 0.5
    image_xy = rects.to_image(xy * rects.size_wh_px[:, None, :])
    if points_model_px.shape[-1] == 2:
        return image_xy
    z = points_model_px[..., 2:3] * (rects.size_wh_px[:, None, 0:1] / input_w)  # z goes with x
    return torch.cat([image_xy, z], dim=-1)


def project_boxes(boxes_model_px: torch.Tensor, rects: RotatedRects,
                  input_size_px: int | tuple[int, int]) -> torch.Tensor:
    """Map axis-aligned boxes from unrotated crops (letterbox, whole frames) back to image pixels."""
    corners = torch.stack([boxes_model_px[..., 0:2], boxes_model_px[..., 2:4]], dim=-2)  # (N, M, 2, 2)
    n, m = corners.shape[:2]
    projected = project_points(corners.reshape(n, m * 2, 2), rects, input_size_px).reshape(n, m, 2, 2)
    return torch.cat([projected[..., 0, :], projected[..., 1, :]], dim=-1)
