"""The face pipeline's detection stage: MediaPipe's short-range and full-range face detectors over
whole frames, batched over every frame of a call (DESIGN §3).

The short-range detector sees each whole frame, letterboxed to 128x128, exactly as MediaPipe's
FaceMesh/FaceDetection run it; the full-range detector sees each whole frame in one input (a 1080p
frame: 512x288, 3.75 frame pixels to an input pixel; Note [The full-range detector over the
whole frame]), which finds the small faces (from ~60 px in 1080p) the short-range detector misses.
Weighted NMS per detector; a full-range detection is kept only where no short-range detection
overlaps it, so that wherever MediaPipe finds a face, facecast's box is MediaPipe's box.

Which detector inputs a list of frame sizes needs is planned once (:class:`DetectorPlan`,
Note [Detection without per-frame work]); with ``cuda_graphs`` the pass is replayed from a graph
(Note [CUDA graphs of the pipeline]).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from facecast.models import anchors as anchors_mod
from facecast.models import roi as roi_mod
from facecast.models import tflite_convert
from facecast.models import triton_kernels
from facecast.models.cuda_graphs import (
    GraphCache,
    bucket,
    buckets_up_to,
    forward_in_buckets,
    shapes_up_to,
)
from facecast.models.litert_models import LiteRTModel
from facecast.models.nms import Detections, box_iou, weighted_nms_of_parts

# Note [Detection without per-frame work]
#     Which input each detector gets for a frame (the short-range one its letterbox, the
#     full-range one the whole frame at its scale), which frame each input belongs to, and the
#     anchors of the full-range input's size: all of it depends only on the frames' sizes. It is
#     worked out once per list of sizes, on the host, and kept on the device
#     (:class:`DetectorPlan`, cached). A detection pass is then a fixed sequence of batched
#     tensor operations (crops, forward, decode, weighted NMS, the merge of the two detectors,
#     top-k) with no Python loop over frames or faces and no wait for the device, until one
#     transfer of every frame's results at the end. Measuring is the
#     same (models/face_mesh.py): one crop, one mesh pass, one transfer of everything the Face
#     objects need. This is also what lets a CUDA graph replay the stages (Note [CUDA graphs of
#     the pipeline]).
MAX_GRAPH_FRAMES = 32
PLAN_CACHE_SIZE = 32

# Note [The full-range detector over the whole frame]
#     The full-range detector (BlazeFace's "back" model) is fully convolutional: convolutions,
#     fixed paddings, three 2x upsamplings and a head that lays its grid of anchors out in rows.
#     Given a larger input than its square 192x192 (tflite_convert.allow_any_input_size) it
#     answers for every 4x4 cell of it, as for the square. So a frame goes in whole: a landscape
#     frame into a 512x288 input (a portrait one 288x512), scaled to fit and padded black below or
#     to the right (a 1080p frame at 3.75 frame pixels an input pixel, 720p at 2.5, 640x360 at
#     1.25, 4K at 7.5). One input shape, not one per frame size, because each new shape costs
#     seconds of cuDNN's preparations (Note [Warm shapes]): a file camera whose 640x360 frames
#     were first given a 192 square stalled detection for seconds on the H100 (2026-11-26,
#     tests/test_real_footage_gpu.py), as a camera whose frames turn out to have another size than
#     configured must never do. (The portrait shape is prepared where a portrait size is
#     configured: preparing it everywhere would cost every boot three more shapes.)
#     Until 2026-11-26 a 1080p frame went in as a 192 letterbox and 8 overlapping 720 px tiles at
#     the same 3.75 scale: 9 inputs and 332 k input pixels against 147 k, a rule that dropped
#     boxes cut by a tile's border (another tile or the letterbox had to see the face whole), and
#     9 x 2304 candidates a frame into NMS against 9216. The outputs are not a tile's at the same
#     place: the network's receptive field is wider than a tile, so more of a face's
#     surroundings enter its score. Measured on the CPU with the bench's small-face scene (two
#     faces of one width, 30 frames, 2026-11-26): found at 60 px 56 of 60 (tiles 60), at 70 to 400
#     px all (tiles all), boxes matching no face 0 (tiles 1-6 per 60 at 60-120 px); faces under
#     FULL_RANGE_ONLY_MIN_WIDTH_PX are not reported either way (tests/models/test_face_free.py).
WHOLE_FRAME_INPUT_HW = (288, 512)  # landscape; a portrait frame's is (512, 288)
# The frame size whose detector inputs `FaceDetector.warm_up` prepares even where no camera is
# configured at it: a camera's configured size is a request, and a file or stream delivers its
# own (up to 1080p is what lab cameras send; larger sizes are warmed where they are configured).
WARM_FRAME_HW = (1080, 1920)
# The detectors' smallest batch bucket (Note [Warm shapes]).
SMALLEST_DETECTOR_BATCH = 16


# Note [Faces only the full-range detector sees]
#     MediaPipe's FaceLandmarker runs the short-range detector only; facecast adds the
#     full-range one, over the whole frame, for faces too small for it (100 px faces in 1080p: facecast
#     finds all, MediaPipe none; docs/benchmarks.md). A face that only the full-range detector
#     sees must be at least FULL_RANGE_ONLY_MIN_WIDTH_PX wide. Measured on the CPU (2026-11-26):
#     in the rocket photo of tests/models/test_face_free.py it found a 32-35 px "face" at scores
#     0.665-0.752 in 10 of 30 frames, and the mesh's presence passed one of them (0.63): a false
#     face, where MediaPipe reports none. A score floor cannot tell it from real faces: the real
#     faces of test_speed_paths.py's 1080p scene scored 0.93-0.97 at 160-170 px, 0.87-0.93 at
#     ~100 px, but 0.78-0.84 at ~77 px. A width floor can: 40 px is below every real face the
#     tests and benchmarks place (70 px and up) and above that false one; a face narrower
#     than that is a few pixels in the detector's own input (~11 at its 3.75 scale), and its mesh (a
#     192-256 px input) an upsampled guess. A face the short-range detector also sees is
#     judged by that one.
FULL_RANGE_ONLY_MIN_WIDTH_PX = 40.0


@dataclass
class DetectorPlan:
    """What one detector gets from frames of known sizes (Note [Detection without per-frame work]):
    one input per frame."""

    rects: roi_mod.RotatedRects  # (F,) where each frame's input samples it (axis-aligned)
    input_hw: tuple[int, int]  # the inputs' height and width
    anchors: torch.Tensor  # (A, 2) for inputs of that size (anchors_mod.generate_anchors)


@dataclass
class WholeFramePlan:
    """The full-range detector's inputs for frames of known sizes: frames whose inputs have one
    size go through it together (a frame's faces never depend on the sizes of the others)."""

    groups: list[tuple[torch.Tensor, DetectorPlan]]  # (positions of the group's frames, its plan)
    order: torch.Tensor | None  # frames' rows in the groups' concatenation; None: in order already


def full_range_input(height: int, width: int) -> tuple[float, tuple[int, int]]:
    """The full-range detector's input for a frame (Note [The full-range detector over the whole
    frame]): (frame pixels per input pixel, (input height, input width))."""
    input_h, input_w = WHOLE_FRAME_INPUT_HW if width >= height else WHOLE_FRAME_INPUT_HW[::-1]
    return max(height / input_h, width / input_w), (input_h, input_w)


def in_frame_order(found: list[Detections], order: torch.Tensor | None) -> Detections:
    """The groups' detections as one, each frame's row back at its position."""
    if len(found) == 1:
        return found[0]
    joined = (torch.cat(fields) for fields in zip(*((d.boxes, d.keypoints, d.scores, d.valid) for d in found)))
    return Detections(*(joined if order is None else (field[order] for field in joined)))


# Note [Only NMS's candidates decoded on the CPU]
#     Weighted NMS takes each frame's best `nms_candidates` valid anchors of each detector (Note
#     [Candidates per NMS slot]) and never looks at the others. On the CPU the decoding and the
#     projection to the frame are arithmetic on every anchor (9,216 of the full-range detector's
#     at 720p and 1080p, 896 of the short-range one's): about 2 ms of a pass on the 2-core
#     machine, for 128 candidates. So there the scores are computed first, the candidates
#     chosen as NMS chooses them (the same topk over the same masked scores), and only their
#     rows decoded and projected, by anchors.decode's arithmetic; NMS then chooses the same
#     candidates again from them (tests/models/test_speed_paths.py: the same detections, to
#     the bit, on frames of three sizes). A GPU's pass decodes every anchor, as before (one
#     fused kernel, or the graph's fixed sequence).
#
# Note [Candidates per NMS slot]
#     Weighted NMS compares every pair of a frame's candidates: at its default of 512 candidates
#     a frame, that pairwise IoU over 64 rows (32 frames, both detectors) was ~0.9 of a 6.9 ms
#     detection pass over 32 1080p frames (H100, fp16 + graphs, 2026-11-26: 5.99 ms with 128).
#     A face's cluster is a handful of anchors above the detectors' thresholds: at most 8 on the
#     test photos and the shared real clip, letterboxed, whole and upscaled to 1080p (measured
#     on the CPU, 2026-11-26). So each output slot gets CANDIDATES_PER_SLOT candidates, twice
#     the largest cluster seen: the best clusters' leaders and members are all among them, and
#     the results on the bench's 32 scenes were bit-identical to 512 candidates.
CANDIDATES_PER_SLOT = 16


def packed(found: Detections) -> torch.Tensor:
    """The detections of F frames as one (F, K, 4 + 2P + 2) float32 table: each slot's box,
    its P keypoints (x, y), its score, and 1.0 where it holds a detection (0.0 where not)."""
    frames, slots = found.scores.shape
    return torch.cat([found.boxes, found.keypoints.reshape(frames, slots, -1), found.scores[..., None],
                      found.valid[..., None].float()], dim=-1)


class FaceDetector:
    """Both face detectors over batches of frames, merged; ``full_range=None`` runs the
    short-range detector alone."""

    def __init__(self, short_range: torch.nn.Module, full_range: torch.nn.Module | None, *,
                 device: torch.device, model_dtype: torch.dtype, max_faces: int, graphs: GraphCache):
        self.short_range, self.full_range = short_range, full_range
        self.device, self.model_dtype, self.graphs = device, model_dtype, graphs
        self.max_faces = max_faces
        if isinstance(full_range, LiteRTModel):  # on the CPU: Note [Whole frames in LiteRT]
            if not full_range.takes(*[(*hw, 3) for hw in (WHOLE_FRAME_INPUT_HW, WHOLE_FRAME_INPUT_HW[::-1])]):
                raise ValueError(f"{full_range.name} in LiteRT must take {WHOLE_FRAME_INPUT_HW} and its "
                                 "transpose (LiteRTModel's image_sizes_hw)")
        elif full_range is not None:
            if not isinstance(full_range, tflite_convert.TFLiteModule):
                raise TypeError(f"the full-range detector must be a converted model (TFLiteModule) or a "
                                f"LiteRTModel that takes whole frames, got {type(full_range).__name__}")
            multiple = full_range.any_size_multiple or tflite_convert.allow_any_input_size(full_range)
            if any(side % multiple for side in WHOLE_FRAME_INPUT_HW):
                raise ValueError(f"{full_range.name} takes inputs in multiples of {multiple} px, "
                                 f"not {WHOLE_FRAME_INPUT_HW}")
        self.short_anchors = anchors_mod.generate_anchors(anchors_mod.FACE_SHORT_RANGE.anchors).to(self.device)
        self._plans: OrderedDict[tuple, tuple[DetectorPlan, WholeFramePlan | None]] = OrderedDict()

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
        host = self.detect_packed(batch, frame_indices).cpu()
        frames, slots = host.shape[:2]
        boxes, keypoints = host[..., :4], host[..., 4:-2].reshape(frames, slots, -1, 2)
        scores, counts = host[..., -2], host[..., -1].sum(dim=1).int().tolist()  # valid slots come first
        return [(boxes[f, :c], keypoints[f, :c], scores[f, :c]) for f, c in enumerate(counts)]

    def warm_up(self, frame_sizes_hw: Sequence[tuple[int, int]], max_frames: int) -> None:
        """On a GPU, run each detector once per batch bucket of up to ``max_frames`` inputs, of
        the sizes the frames named and 1080p give; then, with graphs,
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
            # Largest first: the smaller graphs share its frame buffer (Note [Static frames
            # shared by a stage's graphs]).
            for frames_in_bucket in reversed(buckets_up_to(count, MAX_GRAPH_FRAMES)):
                self.detect(roi_mod.FrameBatch(frames[:frames_in_bucket], self.device))

    def _warm_models(self, frame_sizes_hw: Sequence[tuple[int, int]], frames: int) -> None:
        """Each detector once per batch bucket of up to ``frames`` inputs, of each input size."""
        short_size = anchors_mod.FACE_SHORT_RANGE.anchors.input_size_px
        inputs = [(self.short_range, (short_size, short_size))]
        if self.full_range is not None:
            inputs += [(self.full_range, hw) for hw in dict.fromkeys(
                full_range_input(h, w)[1] for h, w in [*frame_sizes_hw, WARM_FRAME_HW])]
        for model, (height, width) in inputs:
            for batch in shapes_up_to(bucket(frames), SMALLEST_DETECTOR_BATCH):
                model(torch.zeros(batch, height, width, 3, dtype=self.model_dtype, device=self.device))

    def detect_packed(self, batch: roi_mod.FrameBatch, frame_indices: list[int]) -> torch.Tensor:
        """Both detectors over the frames, merged: (F, K, C) slots per frame, valid ones first,
        as :func:`packed` lays them out, on the device, for one copy to the host at once.

        A graph's packed table is its output, read in place (Note [The graph's table read in
        place], models/face_mesh.py): the caller's copy is queued before any later replay.
        Only where one batch takes several replays of the same graph are the earlier ones'
        rows copied out first."""
        sizes = tuple(batch.sizes_hw[i] for i in frame_indices)
        if len(set(sizes)) == 1 and self.graphs.replays("detect"):
            parts = []
            starts = range(0, len(frame_indices), MAX_GRAPH_FRAMES)
            for start in starts:
                part = self._detect_graphed(batch, frame_indices[start:start + MAX_GRAPH_FRAMES])
                if part is None:
                    break
                parts.append(part if start == starts[-1] else part.clone())
            else:
                return parts[0] if len(parts) == 1 else torch.cat(parts)
        index = roi_mod.from_host(frame_indices, self.device)
        return packed(self.core(batch, index, self.plans_for(sizes)))

    def core(self, batch: roi_mod.FrameBatch, frame_index: torch.Tensor, plans,
             on_stage: Callable[[str], None] | None = None,
             taps: list[roi_mod.CropTaps] | None = None) -> Detections:
        """The detection pass proper, a fixed sequence of tensor operations for the planned
        frames (Note [Detection without per-frame work]). ``on_stage`` is called after the
        preprocess (crops), forward and decode_nms stages (the benchmark's stage clock).
        ``taps``: :meth:`crop_taps` of these frames, made once for a CUDA graph's batch where
        the one-kernel crop cannot serve; without them the inputs are cropped here by
        :func:`roi.crop_rois` (on the CPU OpenCV's warps: Note [Crops on the CPU]; on a GPU one
        kernel: Note [One kernel for a batch of crops])."""
        short_plan, full_plan = plans
        short_spec, full_spec = anchors_mod.FACE_SHORT_RANGE, anchors_mod.FACE_FULL_RANGE
        full_groups = full_plan.groups if full_plan is not None else []
        if taps is None:
            float_frames = {}  # Note [A whole frame's floats once]
            short_crops = self._crops(batch, frame_index, short_plan, float_frames)
            full_crops = [self._crops(batch, frame_index[positions], plan, float_frames)
                          for positions, plan in full_groups]
        else:
            short_taps, *full_taps = taps
            short_crops = short_taps.crop(batch)
            full_crops = [group_taps.crop(batch) for group_taps in full_taps]
        if on_stage:
            on_stage("preprocess")
        short_raw = self.outputs(False, short_crops)
        full_raw = [self.outputs(True, crops) for crops in full_crops]
        if on_stage:
            on_stage("forward")
        # Note [One NMS for both detectors]
        # On the CPU only the anchors NMS can choose: Note [Only NMS's candidates decoded on the CPU].
        decode = self.decode if batch.device.type == "cuda" else self._decode_candidates
        short, *fulls = weighted_nms_of_parts(
            [decode(short_raw, short_plan, short_spec)]
            + [decode(raw, plan, full_spec) for raw, (_, plan) in zip(full_raw, full_groups)],
            iou_threshold=short_spec.min_suppression_iou, max_detections=self.max_faces * 2,
            max_candidates=self.nms_candidates)
        full = in_frame_order(fulls, full_plan.order) if full_plan is not None else None
        merged = self.merge(short, full)
        if on_stage:
            on_stage("decode_nms")
        return merged

    def plans_for(self, sizes_hw: tuple[tuple[int, int], ...]) -> tuple[DetectorPlan, WholeFramePlan | None]:
        plans = self._plans.get(sizes_hw)
        if plans is None:
            plans = (self.short_range_plan(sizes_hw),
                     self.full_range_plan(sizes_hw) if self.full_range is not None else None)
            self._plans[sizes_hw] = plans
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(sizes_hw)
        return plans

    def short_range_plan(self, sizes_hw) -> DetectorPlan:
        """Each frame letterboxed into the short-range detector's square."""
        size = anchors_mod.FACE_SHORT_RANGE.anchors.input_size_px
        table = torch.tensor([roi_mod.letterbox_rect(height, width) for height, width in sizes_hw],
                             dtype=torch.float32)
        rects = roi_mod.RotatedRects(table[:, :2], table[:, 2:3].expand(-1, 2).contiguous(), torch.zeros(len(table)))
        return DetectorPlan(rects.to(self.device), (size, size), self.short_anchors)

    def full_range_plan(self, sizes_hw) -> WholeFramePlan:
        """Each frame whole (Note [The full-range detector over the whole frame]); frames grouped
        by their input's shape."""
        inputs = [full_range_input(height, width) for height, width in sizes_hw]
        by_size: dict[tuple[int, int], list[int]] = {}
        for position, (_, input_hw) in enumerate(inputs):
            by_size.setdefault(input_hw, []).append(position)
        groups = []
        for input_hw, positions in by_size.items():
            # The rect a frame's input samples: input pixel (u, v) at frame pixel (u, v) x scale.
            sizes = torch.tensor([[input_hw[1] * inputs[p][0], input_hw[0] * inputs[p][0]] for p in positions])
            rects = roi_mod.RotatedRects(sizes / 2, sizes, torch.zeros(len(positions)))
            anchors = anchors_mod.generate_anchors(anchors_mod.FACE_FULL_RANGE.anchors, input_hw)
            groups.append((torch.tensor(positions).to(self.device),
                           DetectorPlan(rects.to(self.device), input_hw, anchors.to(self.device))))
        concatenated = [p for positions in by_size.values() for p in positions]
        order = None if concatenated == sorted(concatenated) else \
            torch.tensor(concatenated).argsort().to(self.device)
        return WholeFramePlan(groups, order)

    def crop_taps(self, batch: roi_mod.FrameBatch, frame_index: torch.Tensor, plans) -> list[roi_mod.CropTaps]:
        """Where the detectors' inputs sample the frames: the short-range letterbox's taps, then
        each full-range input shape's (Note [Crop taps made once])."""
        short_plan, full_plan = plans
        full_groups = full_plan.groups if full_plan is not None else []
        return [self._taps(batch, frame_index, short_plan)] + [
            self._taps(batch, frame_index[positions], plan) for positions, plan in full_groups]

    def _taps(self, batch: roi_mod.FrameBatch, frame_index: torch.Tensor, plan: DetectorPlan) -> roi_mod.CropTaps:
        # Letterbox and whole frames are unrotated: coordinates per row and column (axis_aligned).
        return roi_mod.crop_taps(batch, frame_index, plan.rects, plan.input_hw, border="zero",
                                 dtype=self.model_dtype, value_range=(-1.0, 1.0), axis_aligned=True)

    def _crops(self, batch: roi_mod.FrameBatch, frame_index: torch.Tensor, plan: DetectorPlan,
               float_frames: dict | None = None) -> torch.Tensor:
        """The inputs that :meth:`_taps` samples, cropped at once (``float_frames``: the pass's,
        Note [A whole frame's floats once])."""
        return roi_mod.crop_rois(batch, frame_index, plan.rects, plan.input_hw, border="zero",
                                 dtype=self.model_dtype, value_range=(-1.0, 1.0), axis_aligned=True,
                                 float_frames=float_frames)

    def outputs(self, full_range: bool, crops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.full_range if full_range else self.short_range
        # On a GPU in batch buckets (Note [Warm shapes]).
        outputs = (forward_in_buckets(model, crops, SMALLEST_DETECTOR_BATCH)
                   if self.device.type == "cuda" else model(crops))
        boxes = next(o for o in outputs if o.dim() == 3 and o.shape[-1] > 1)
        scores = next(o for o in outputs if o.dim() == 3 and o.shape[-1] == 1)
        return boxes, scores

    def decode(self, raw, plan: DetectorPlan, spec: anchors_mod.DetectorSpec
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode and project to frame pixels: (boxes, scores, keypoints, valid) per anchor, as
        weighted NMS takes them."""
        raw_boxes, raw_scores = raw
        # Decoded coordinates are in units of the detector's square side (anchors_mod.generate_anchors).
        size = spec.anchors.input_size_px
        if (raw_boxes.is_cuda and raw_boxes.dim() == 3 and raw_boxes.shape[1] == plan.anchors.shape[0]
                and raw_boxes.shape[2] == 4 + 2 * spec.num_keypoints):  # Note [Detections decoded in one kernel]
            fused = triton_kernels.decode_detections(raw_boxes, raw_scores, plan.anchors, plan.rects, plan.input_hw,
                                                     spec.coord_scale_px, size, spec.min_score)
            if fused is not None:
                return fused
        decoded = anchors_mod.decode(raw_boxes, raw_scores, plan.anchors, spec)
        frames = len(plan.rects)
        boxes = roi_mod.project_boxes(decoded.boxes * size, plan.rects, plan.input_hw)
        keypoints = roi_mod.project_points(
            (decoded.keypoints * size).reshape(frames, -1, 2), plan.rects, plan.input_hw
        ).reshape(decoded.keypoints.shape)
        return boxes, decoded.scores, keypoints, decoded.scores >= spec.min_score

    def _decode_candidates(self, raw, plan: DetectorPlan, spec: anchors_mod.DetectorSpec
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`decode` of the anchors weighted NMS can choose from, only (Note [Only NMS's
        candidates decoded on the CPU]): per frame its best :attr:`nms_candidates` by score,
        valid first, best first, as (boxes, scores, keypoints, valid) of (F, C) anchors."""
        raw_boxes, raw_scores = raw
        frames, num_anchors = raw_boxes.shape[:2]
        if num_anchors != plan.anchors.shape[0] or raw_boxes.shape[2] != 4 + 2 * spec.num_keypoints:
            anchors_mod.decode(raw_boxes, raw_scores, plan.anchors, spec)  # refused there, with its reason
        logits = raw_scores.float().reshape(frames, num_anchors)
        scores = torch.sigmoid(logits.clamp(-100.0, 100.0))  # as anchors.decode: score_clipping_thresh 100
        valid = scores >= spec.min_score
        masked = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
        order = masked.topk(min(self.nms_candidates, num_anchors), dim=1, sorted=True).indices  # (F, C)
        raw = raw_boxes.float().gather(1, order[..., None].expand(-1, -1, raw_boxes.shape[2]))
        anchors = plan.anchors.to(raw.dtype)[order]  # (F, C, 2)
        # anchors.decode's arithmetic on the chosen rows (anchor w = h = 1: fixed_anchor_size).
        scale, size = spec.coord_scale_px, spec.anchors.input_size_px
        centre = raw[..., 0:2] / scale + anchors
        half_size = raw[..., 2:4] / scale / 2
        boxes = torch.cat([centre - half_size, centre + half_size], dim=-1)
        keypoints = raw[..., 4:].reshape(frames, -1, spec.num_keypoints, 2) / scale + anchors[:, :, None, :]
        boxes = roi_mod.project_boxes(boxes * size, plan.rects, plan.input_hw)
        keypoints = roi_mod.project_points((keypoints * size).reshape(frames, -1, 2), plan.rects,
                                           plan.input_hw).reshape(keypoints.shape)
        chosen_scores = scores.gather(1, order)
        return boxes, chosen_scores, keypoints, valid.gather(1, order)

    @property
    def nms_candidates(self) -> int:
        """The candidates weighted NMS takes of each frame and detector (Note [Candidates per
        NMS slot])."""
        return CANDIDATES_PER_SLOT * self.max_faces * 2

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

    def _detect_graphed(self, batch: roi_mod.FrameBatch, frame_indices: list[int]) -> torch.Tensor | None:
        """:meth:`core` replayed from a CUDA graph (Note [CUDA graphs of the pipeline]), its
        :func:`packed` table's rows of these frames, in place in the graph's output; None when
        the stage cannot be captured."""
        height, width = batch.sizes_hw[frame_indices[0]]
        count = len(frame_indices)
        padded = bucket(count, MAX_GRAPH_FRAMES)

        def build():
            # Note [Static frames shared by a stage's graphs]
            pixels = self.graphs.shared_static(("detect", height, width),
                                               (padded * height, width, 3), torch.uint8)
            static = roi_mod.FrameBatch.from_pixels(pixels, [(height, width)] * padded, bgr=batch.bgr)
            index = torch.arange(padded, device=self.device)
            plans = self.plans_for(((height, width),) * padded)
            # Taps outside the graph (they never change) where the one-kernel crop cannot serve.
            taps = (self.crop_taps(static, index, plans)
                    if triton_kernels.unavailable_reason(self.device, "facecast_crop") else None)
            return (lambda: packed(self.core(static, index, plans, taps=taps))), {"pixels": pixels}

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
        return captured.replay()[:count]
