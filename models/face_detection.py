"""The face pipeline's detection stage: MediaPipe's short-range and full-range face detectors over
whole frames and their tiles, batched over every frame of a call (DESIGN §3).

The short-range detector sees each whole frame, letterboxed to 128x128, exactly as MediaPipe's
FaceMesh/FaceDetection run it; the full-range detector (192x192) sees each whole frame and the
overlapping square tiles of frames larger than a tile, which finds the small faces (down to
~70 px in 1080p) the short-range detector misses. Weighted NMS per source; a full-range
detection is kept only where no short-range detection overlaps it, so that wherever MediaPipe
finds a face, facecast's box is MediaPipe's box.

Which detector inputs a list of frame sizes needs is planned once (:class:`DetectorPlan`,
Note [Detection without per-frame work]); with ``cuda_graphs`` the pass is replayed from a graph
(Note [CUDA graphs of the pipeline]).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from facecast.models import anchors as anchors_mod
from facecast.models import roi as roi_mod
from facecast.models.cuda_graphs import (
    GraphCache,
    bucket,
    buckets_up_to,
    forward_in_buckets,
    shapes_up_to,
)
from facecast.models.nms import Detections, box_iou, weighted_nms

# Note [Detection without per-frame work]
#     Which inputs a detector gets (each frame's letterbox, and for the full-range detector the
#     frame's tiles), which frame each input belongs to, where its tile's borders lie inside the
#     frame, and how the inputs of one frame pool into one NMS row: all of it depends only on the
#     frames' sizes. It is worked out once per list of sizes, on the host, and kept on the device
#     (:class:`DetectorPlan`, cached). A detection pass is then a fixed sequence of batched
#     tensor operations (crops, forward, decode, the tile-border test, pooling, weighted NMS, the
#     merge of the two detectors, top-k) with no Python loop over frames, tiles or faces and no
#     wait for the device, until one transfer of every frame's results at the end. Measuring is the
#     same (models/face_mesh.py): one crop, one mesh pass, one transfer of everything the Face
#     objects need. This is also what lets a CUDA graph replay the stages (Note [CUDA graphs of
#     the pipeline]).
MAX_GRAPH_FRAMES = 32
PLAN_CACHE_SIZE = 32
NO_CUT = (-math.inf, -math.inf, math.inf, math.inf)
TILE_BORDER_MARGIN_PX = 4.0
# The frame size whose detector inputs `FaceDetector.warm_up` prepares even where no camera is
# configured at it: a camera's configured size is a request, and a file or stream delivers its
# own (up to 1080p is what lab cameras send; larger sizes are warmed where they are configured).
WARM_FRAME_HW = (1080, 1920)
# The detectors' smallest batch bucket (Note [Warm shapes]).
SMALLEST_DETECTOR_BATCH = 16


# Note [Faces only the full-range detector sees]
#     MediaPipe's FaceLandmarker runs the short-range detector only; facecast adds the
#     full-range one, with tiles, for faces too small for it (100 px faces in 1080p: facecast
#     finds all, MediaPipe none; docs/benchmarks.md). A face that only the full-range detector
#     sees must be at least FULL_RANGE_ONLY_MIN_WIDTH_PX wide. Measured on the CPU (2026-11-26):
#     in the rocket photo of tests/models/test_face_free.py it found a 32-35 px "face" at scores
#     0.665-0.752 in 10 of 30 frames, and the mesh's presence passed one of them (0.63): a false
#     face, where MediaPipe reports none. A score floor cannot tell it from real faces: the real
#     faces of test_speed_paths.py's 1080p scene scored 0.93-0.97 at 160-170 px, 0.87-0.93 at
#     ~100 px, but 0.78-0.84 at ~77 px. A width floor can: 40 px is below every real face the
#     tests and benchmarks place (70 px and up) and above that false one; a face narrower
#     than that is a few pixels in the detector's own input even in a tile, and its mesh (a
#     192-256 px input) an upsampled guess. A face the short-range detector also sees is
#     judged by that one.
FULL_RANGE_ONLY_MIN_WIDTH_PX = 40.0


@dataclass
class DetectorPlan:
    """Where one detector looks in frames of known sizes (Note [Detection without per-frame work])."""

    rects: roi_mod.RotatedRects  # (R,) model inputs: per frame its letterbox, then its tiles
    owner: torch.Tensor  # (R,) long: position of the input's frame among the planned frames
    cut_edges_px: torch.Tensor  # (R, 4): see cut_by_tile_border
    pool_rows: torch.Tensor  # (F, W) long: each frame's inputs, then padding (input 0)
    pool_used: torch.Tensor  # (F, W) bool: False on padding


def tile_cut_edges(tile, frame_h: int, frame_w: int, margin_px: float = TILE_BORDER_MARGIN_PX):
    """A tile's inner borders as thresholds (x1, y1, x2, y2) for :func:`cut_by_tile_border`;
    an edge that is the frame's own border never cuts (±inf)."""
    cx, cy, side = tile
    x1, y1, x2, y2 = cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2
    return (x1 + margin_px if x1 > 0 else -math.inf, y1 + margin_px if y1 > 0 else -math.inf,
            x2 - margin_px if x2 < frame_w else math.inf, y2 - margin_px if y2 < frame_h else math.inf)


def cut_by_tile_border(boxes_px: torch.Tensor, edges_px: torch.Tensor) -> torch.Tensor:
    """(R, A) True for boxes (R, A, 4) that reach a tile edge lying inside the frame: the face
    is cut there, and a neighbouring tile (or the whole-frame pass) sees it whole."""
    edges = edges_px[:, None, :]
    return ((boxes_px[..., 0] <= edges[..., 0]) | (boxes_px[..., 1] <= edges[..., 1])
            | (boxes_px[..., 2] >= edges[..., 2]) | (boxes_px[..., 3] >= edges[..., 3]))


class FaceDetector:
    """Both face detectors over batches of frames, merged; ``full_range=None`` runs the
    short-range detector alone (no tiles)."""

    def __init__(self, short_range: torch.nn.Module, full_range: torch.nn.Module | None, *,
                 device: torch.device, model_dtype: torch.dtype, max_faces: int, tile_px: int,
                 tile_overlap_px: int, graphs: GraphCache):
        self.short_range, self.full_range = short_range, full_range
        self.device, self.model_dtype, self.graphs = device, model_dtype, graphs
        self.max_faces = max_faces
        self.tile_px, self.tile_overlap_px = tile_px, tile_overlap_px
        self.anchors = {
            spec.name: anchors_mod.generate_anchors(spec.anchors).to(self.device)
            for spec in (anchors_mod.FACE_SHORT_RANGE, anchors_mod.FACE_FULL_RANGE)
        }
        self._plans: OrderedDict[tuple, tuple[DetectorPlan, DetectorPlan | None]] = OrderedDict()

    def detect(self, batch: roi_mod.FrameBatch, frame_indices: Sequence[int] | None = None):
        """Faces of the given frames (all by default): per frame, (boxes (M, 4) px,
        keypoints (M, 6, 2) px, scores (M,)), float32 tensors on the host, best first, at most
        ``max_faces`` (at most twice that without the full-range detector, as NMS leaves them).

        Every frame's slots reach the host in one copy, the one wait for the device: a caller
        then reads them without a copy (and a wait) per frame and per field (the detection
        worker's messages took three per frame before issue 24)."""
        frame_indices = list(range(len(batch)) if frame_indices is None else frame_indices)
        if not frame_indices:
            return []
        found = self.detect_batched(batch, frame_indices)
        frames, slots = found.scores.shape
        host = torch.cat([found.boxes, found.keypoints.reshape(frames, slots, -1), found.scores[..., None],
                          found.valid[..., None].float()], dim=-1).cpu()
        boxes, keypoints = host[..., :4], host[..., 4:-2].reshape(frames, slots, -1, 2)
        scores, counts = host[..., -2], host[..., -1].sum(dim=1).int().tolist()  # valid slots come first
        return [(boxes[f, :c], keypoints[f, :c], scores[f, :c]) for f, c in enumerate(counts)]

    def inputs_per_frame(self, height: int, width: int) -> tuple[int, int]:
        """How many inputs a frame of this size gives (short-range, full-range)."""
        tiles = len(roi_mod.tile_rects(height, width, self.tile_px, self.tile_overlap_px))
        return 1, (1 + tiles) if self.full_range is not None else 0

    def warm_up(self, frame_sizes_hw: Sequence[tuple[int, int]], max_frames: int) -> None:
        """On a GPU, run each detector once per batch bucket of as many inputs as ``max_frames``
        frames can give, of the sizes named or of 1080p, whichever has more; then, with graphs,
        every graph bucket of up to ``max_frames`` frames of each named size (Note [Warm
        shapes]). A camera whose frames turn out to have another size
        (a file or stream whose size the config did not know) then costs one graph capture,
        not seconds of cuDNN's preparations while its faces go unseen."""
        count = min(max_frames, MAX_GRAPH_FRAMES)
        if count < 1:
            return
        if self.device.type == "cuda":  # eager passes take every frame at once, graphs 32
            self._warm_models(frame_sizes_hw, count if self.graphs.enabled else max_frames)
        if not self.graphs.enabled:
            return
        for height, width in dict.fromkeys(frame_sizes_hw):
            frames = torch.zeros(count, height, width, 3, dtype=torch.uint8, device=self.device)
            for frames_in_bucket in buckets_up_to(count, MAX_GRAPH_FRAMES):
                self.detect(roi_mod.FrameBatch(frames[:frames_in_bucket], self.device))

    def _warm_models(self, frame_sizes_hw: Sequence[tuple[int, int]], frames: int) -> None:
        """Each detector once per batch bucket of the inputs that ``frames`` frames can give."""
        per_frame = [self.inputs_per_frame(h, w) for h, w in [*frame_sizes_hw, WARM_FRAME_HW]]
        for spec, model, inputs in (
                (anchors_mod.FACE_SHORT_RANGE, self.short_range, max(s for s, _ in per_frame)),
                (anchors_mod.FACE_FULL_RANGE, self.full_range, max(f for _, f in per_frame))):
            if model is None:
                continue
            size = spec.anchors.input_size_px
            for batch in shapes_up_to(bucket(frames) * inputs, SMALLEST_DETECTOR_BATCH):
                model(torch.zeros(batch, size, size, 3, dtype=self.model_dtype, device=self.device))

    def detect_batched(self, batch: roi_mod.FrameBatch, frame_indices: list[int]) -> Detections:
        """Both detectors over the frames, merged: (F, K) slots per frame, valid ones first."""
        sizes = tuple(batch.sizes_hw[i] for i in frame_indices)
        if len(set(sizes)) == 1 and self.graphs.replays("detect"):
            parts = []
            for start in range(0, len(frame_indices), MAX_GRAPH_FRAMES):
                part = self._detect_graphed(batch, frame_indices[start:start + MAX_GRAPH_FRAMES])
                if part is None:
                    break
                parts.append(part)
            else:
                return Detections(*(torch.cat(fields) for fields in zip(
                    *((p.boxes, p.keypoints, p.scores, p.valid) for p in parts))))
        index = roi_mod.from_host(frame_indices, self.device)
        return self.core(batch, index, self.plans_for(sizes))

    def core(self, batch: roi_mod.FrameBatch, frame_index: torch.Tensor, plans,
             on_stage: Callable[[str], None] | None = None) -> Detections:
        """The detection pass proper, a fixed sequence of tensor operations for the planned
        frames (Note [Detection without per-frame work]). ``on_stage`` is called after the
        preprocess (crops), forward and decode_nms stages (the benchmark's stage clock)."""
        short_plan, full_plan = plans
        short_spec, full_spec = anchors_mod.FACE_SHORT_RANGE, anchors_mod.FACE_FULL_RANGE
        short_crops = self.crops(batch, frame_index, short_plan, short_spec)
        full_crops = self.crops(batch, frame_index, full_plan, full_spec) if full_plan else None
        if on_stage:
            on_stage("preprocess")
        short_raw = self.outputs(False, short_crops)
        full_raw = self.outputs(True, full_crops) if full_plan else None
        if on_stage:
            on_stage("forward")
        short = self.decode(short_raw, short_plan, short_spec)
        full = self.decode(full_raw, full_plan, full_spec) if full_plan else None
        merged = self.merge(short, full)
        if on_stage:
            on_stage("decode_nms")
        return merged

    def plans_for(self, sizes_hw: tuple[tuple[int, int], ...]) -> tuple[DetectorPlan, DetectorPlan | None]:
        plans = self._plans.get(sizes_hw)
        if plans is None:
            plans = (self.make_plan(sizes_hw, tiles=False),
                     self.make_plan(sizes_hw, tiles=True) if self.full_range is not None else None)
            self._plans[sizes_hw] = plans
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(sizes_hw)
        return plans

    def make_plan(self, sizes_hw, tiles: bool) -> DetectorPlan:
        rows, owner, edges, per_frame = [], [], [], []
        for position, (height, width) in enumerate(sizes_hw):
            inputs = [(roi_mod.letterbox_rect(height, width), NO_CUT)]
            if tiles:
                inputs += [(rect, tile_cut_edges(rect, height, width))
                           for rect in roi_mod.tile_rects(height, width, self.tile_px, self.tile_overlap_px)]
            per_frame.append(list(range(len(rows), len(rows) + len(inputs))))
            for rect, edge in inputs:
                rows.append(rect)
                owner.append(position)
                edges.append(edge)
        width = max(len(frame_rows) for frame_rows in per_frame)
        table = torch.tensor(rows, dtype=torch.float32)
        return DetectorPlan(
            rects=roi_mod.RotatedRects(table[:, :2], table[:, 2:3].expand(-1, 2).contiguous(),
                                       torch.zeros(len(rows))).to(self.device),
            owner=torch.tensor(owner).to(self.device),
            cut_edges_px=torch.tensor(edges, dtype=torch.float32).to(self.device),
            pool_rows=torch.tensor([r + [0] * (width - len(r)) for r in per_frame]).to(self.device),
            pool_used=torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in per_frame]).to(self.device),
        )

    def crops(self, batch, frame_index: torch.Tensor, plan: DetectorPlan,
              spec: anchors_mod.DetectorSpec) -> torch.Tensor:
        size = spec.anchors.input_size_px
        # Letterbox and tiles are unrotated: coordinates per row and column (axis_aligned).
        return roi_mod.crop_rois(batch, frame_index[plan.owner], plan.rects, size, border="zero",
                                 dtype=self.model_dtype, value_range=(-1.0, 1.0), axis_aligned=True)

    def outputs(self, full_range: bool, crops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.full_range if full_range else self.short_range
        # On a GPU in batch buckets (Note [Warm shapes]).
        outputs = (forward_in_buckets(model, crops, SMALLEST_DETECTOR_BATCH)
                   if self.device.type == "cuda" else model(crops))
        boxes = next(o for o in outputs if o.dim() == 3 and o.shape[-1] > 1)
        scores = next(o for o in outputs if o.dim() == 3 and o.shape[-1] == 1)
        return boxes, scores

    def decode(self, raw, plan: DetectorPlan, spec: anchors_mod.DetectorSpec) -> Detections:
        """Decode, project to frame pixels, drop boxes cut by a tile border, pool each frame's
        inputs into one row, weighted NMS."""
        raw_boxes, raw_scores = raw
        size = spec.anchors.input_size_px
        decoded = anchors_mod.decode(raw_boxes, raw_scores, self.anchors[spec.name], spec)
        inputs = len(plan.rects)
        boxes = roi_mod.project_boxes(decoded.boxes * size, plan.rects, size)
        keypoints = roi_mod.project_points(
            (decoded.keypoints * size).reshape(inputs, -1, 2), plan.rects, size
        ).reshape(decoded.keypoints.shape)
        valid = (decoded.scores >= spec.min_score) & ~cut_by_tile_border(boxes, plan.cut_edges_px)
        # (F, W inputs, A anchors) → (F, W·A): a frame's inputs in order, then zero padding.
        frames = plan.pool_rows.shape[0]
        used = plan.pool_used[:, :, None]
        rows = plan.pool_rows
        return weighted_nms(
            torch.where(used[..., None], boxes[rows], 0.0).reshape(frames, -1, 4),
            torch.where(used, decoded.scores[rows], 0.0).reshape(frames, -1),
            torch.where(used[..., None, None], keypoints[rows], 0.0).reshape(frames, -1, spec.num_keypoints, 2),
            (valid[rows] & used).reshape(frames, -1),
            iou_threshold=spec.min_suppression_iou,
            max_detections=self.max_faces * 2,
        )

    def merge(self, short: Detections, full: Detections | None) -> Detections:
        """A full-range detection is kept only where no short-range one overlaps it, and then
        only at FULL_RANGE_ONLY_MIN_WIDTH_PX (Note [Faces only the full-range detector sees]); the
        best ``max_faces`` of both, by score."""
        if full is None:
            return short
        overlaps = (box_iou(full.boxes, short.boxes) * short.valid[:, None, :]).amax(dim=2) > 0.1
        wide_enough = full.boxes[..., 2] - full.boxes[..., 0] >= FULL_RANGE_ONLY_MIN_WIDTH_PX
        full_only = full.valid & ~overlaps & wide_enough
        valid = torch.cat([short.valid, full_only], dim=1)
        scores = torch.cat([short.scores, full.scores], dim=1)
        boxes = torch.cat([short.boxes, full.boxes], dim=1)
        keypoints = torch.cat([short.keypoints, full.keypoints], dim=1)
        ranked, order = torch.where(valid, scores, float("-inf")).topk(min(self.max_faces, scores.shape[1]), dim=1)
        return Detections(
            boxes=boxes.gather(1, order[..., None].expand(-1, -1, 4)),
            keypoints=keypoints.gather(1, order[..., None, None].expand(-1, -1, *keypoints.shape[2:])),
            scores=scores.gather(1, order),
            valid=torch.isfinite(ranked),
        )

    def _detect_graphed(self, batch: roi_mod.FrameBatch, frame_indices: list[int]) -> Detections | None:
        """:meth:`core` replayed from a CUDA graph (Note [CUDA graphs of the pipeline]); None when the stage cannot be captured."""
        height, width = batch.sizes_hw[frame_indices[0]]
        count = len(frame_indices)
        padded = bucket(count, MAX_GRAPH_FRAMES)

        def build():
            pixels = torch.zeros(padded * height, width, 3, dtype=torch.uint8, device=self.device)
            static = roi_mod.FrameBatch.from_pixels(pixels, [(height, width)] * padded, bgr=batch.bgr)
            index = torch.arange(padded, device=self.device)
            plans = self.plans_for(((height, width),) * padded)
            return (lambda: self.core(static, index, plans)), {"pixels": pixels}

        captured = self.graphs.get("detect", (height, width, padded, batch.bgr), build)
        if captured is None:
            return None
        pixels = captured.statics["pixels"]
        starts = [batch.row_offsets_px[i] for i in frame_indices]
        if batch.pixels.shape[1] == width and starts == list(range(starts[0], starts[0] + count * height, height)):
            pixels[:count * height].copy_(batch.pixels[starts[0]:starts[0] + count * height])
        else:
            for k, start in enumerate(starts):
                pixels[k * height:(k + 1) * height].copy_(batch.pixels[start:start + height, :width])
        out = captured.replay()
        return Detections(out.boxes[:count].clone(), out.keypoints[:count].clone(), out.scores[:count].clone(),
                          out.valid[:count].clone())
