"""PosePipeline: MediaPipe's body pose (BlazePose, 33 landmarks) per person, batched over frames,
with landmark-driven tracking per camera (DESIGN §3; the optional body pose of DESIGN §4).

The stages follow MediaPipe's legacy ``pose_landmark_cpu`` graph (mediapipe 0.10.21, whose
``pose_detection.tflite`` and ``pose_landmark_full.tflite`` facecast converts); the graph and
calculator names in the comments are where each rule comes from:

1. **Detection** (``pose_detection_cpu``): the whole frame letterboxed to 224x224 (zero
   border, values -1..1); SSD decoding of 2254 anchors (``anchors.POSE_DETECTION``); weighted
   NMS at IoU 0.3. Each detection carries 4 keypoints: 0 the hip centre, 1 a point whose
   distance from it encodes the whole body's size and direction (2 and 3: the same for the upper
   body, unused here). The detection's box is the *face's* box, so it is not a person box.
2. **ROI** (``pose_detection_to_roi``, :func:`rects_from_alignment_points`): centred on the hip
   centre, side = 2 x hip→scale-point distance x 1.25, rotated so that the hip→scale-point
   vector points up in the crop.
3. **Warp**: every ROI of every frame cropped to 256x256 (replicated border, values 0..1) in one
   batched bilinear crop (:func:`facecast.models.roi.crop_rois`).
4. **Landmarks** (``pose_landmark_full``, ``tensors_to_pose_landmarks_and_segmentation``): 39
   points (the 33 landmarks, the 2 auxiliary points that give the next frame's ROI, and 4
   unused), each x, y, z, visibility and presence logits; x, y refined from the 64x64 heatmaps
   (:func:`refine_from_heatmap`); world landmarks in meters; a pose presence score that
   MediaPipe thresholds at 0.5.
5. **Tracking** (``pose_landmarks_to_roi``, :meth:`PosePipeline.track`): the next frame's ROI
   comes from this frame's auxiliary points, smoothed over time (Note [Steady pose ROI]), exactly
   as from a detection; the detector runs only when a camera has no pose, lost one, or (with
   room for more people) every ``detect_interval_frames`` frames.

Not reproduced: MediaPipe's smoothing of the published landmarks and visibilities
(``pose_landmark_filtering``'s filters on the 33 landmarks; a published landmark is this frame's
own estimate, like the face pipeline's) and the segmentation mask.

Outputs are in the pixels of each input frame, like FacePipeline's: landmark z is on the scale
of x (pixels), negative toward the camera, relative to the hips' midpoint as in MediaPipe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from facecast.models import anchors as anchors_mod
from facecast.models import roi as roi_mod
from facecast.models.cuda_graphs import BatchBuckets, buckets_up_to
from facecast.models.nms import box_iou, drop_overlapping, weighted_nms

log = logging.getLogger(__name__)

LANDMARK_INPUT_PX = 256
NUM_LANDMARKS = 33  # MediaPipe's pose topology (names: workers.lsl_output.POSE_LANDMARK_NAMES)
NUM_MODEL_POINTS = 39  # the 33, then the auxiliary hip centre and scale point, then 4 unused
AUX_HIP_CENTRE_INDEX = 33
AUX_SCALE_POINT_INDEX = 34

# pose_detection_cpu's TensorsToDetections uses min_score_thresh 0.2, but every MediaPipe entry
# point overrides it with its min_detection_confidence, 0.5 by default (the legacy Pose solution
# and the tasks PoseLandmarker alike); the 0.2 of anchors.POSE_DETECTION is the graph's value.
POSE_DETECTOR = dataclasses.replace(anchors_mod.POSE_DETECTION, min_score=0.5)
# Detection keypoints that make the full-body ROI (pose_detection_to_roi).
DETECTION_HIP_CENTRE_KEYPOINT = 0
DETECTION_SCALE_KEYPOINT = 1

# AlignmentPointsRectsCalculator's rotation_vector_target_angle_degrees and
# RectTransformationCalculator's scale in pose_detection_to_roi and pose_landmarks_to_roi.
ROI_TARGET_ANGLE_RAD = math.pi / 2
ROI_SCALE = 1.25

# RefineLandmarksFromHeatmapCalculator: kernel_size 7 in the graph; min_confidence_to_refine is
# the option's default.
HEATMAP_KERNEL_PX = 7
HEATMAP_MIN_CONFIDENCE = 0.5

# pose_landmark_by_roi's ThresholdingCalculator on the pose flag (also MediaPipe's default
# min_tracking_confidence): below it the ROI holds no pose and the track is lost.
MIN_PRESENCE = 0.5

# A detection whose ROI overlaps a tracked ROI by more than this is the same person (the tasks
# PoseLandmarker associates its rects with AssociationNormRectCalculator at its
# min_tracking_confidence, 0.5 by default).
SAME_PERSON_ROI_IOU = 0.5


@dataclass
class Pose:
    """One person's body pose in one frame, in that frame's pixels."""

    landmarks: np.ndarray  # (33, 5) float32: x px, y px, z px (x's scale), visibility, presence
    world_landmarks_m: np.ndarray  # (33, 3) float32 meters, origin between the hips (see below)
    box: tuple[float, float, float, float]  # x1, y1, x2, y2 px: the landmarks' bounds, in the frame
    presence: float  # the landmark model's pose presence score (the "pose flag")
    score: float  # detector score on detection frames; presence when tracked
    roi: tuple[float, float, float, float]  # where the model looked: centre x, y px, side px, rotation rad
    tracked: bool = False  # True when the ROI came from the previous frame's landmarks

    # World landmarks keep MediaPipe's axes: x right, y down, z away from the camera, rotated
    # with the ROI (WorldLandmarkProjectionCalculator) so that they share the image's in-plane
    # orientation; they are neither scaled nor moved with the person.

    @property
    def xyz(self) -> np.ndarray:
        """(33, 3): x, y in pixels, z in pixels on x's scale (negative = closer than the hips)."""
        return self.landmarks[:, :3]

    @property
    def visibility(self) -> np.ndarray:
        """(33,) probability that each landmark is in view and not occluded."""
        return self.landmarks[:, 3]

    @property
    def landmark_presence(self) -> np.ndarray:
        """(33,) probability that each landmark lies inside the frame."""
        return self.landmarks[:, 4]


# Note [Steady pose ROI]
#     The ROI of a tracked pose comes from two points the model extrapolates (the hip centre and
#     the scale point), often far outside the frame for a person seen from the waist up. Raw,
#     they move by ~1% of the ROI from frame to frame even on a still image, the ROI with them,
#     and the landmarks by 3-7 px on a 100 px face (measured on the astronaut photo repeated:
#     the model's answer depends on the crop; 0.4-2 px with the filter below). MediaPipe
#     therefore smooths these two points
#     before making the ROI (pose_landmark_filtering, "to make ROI crop for pose landmarks
#     prediction very stable when object is not moving but responsive enough in case of sudden
#     movements") with a one-euro filter: min cutoff 0.01 Hz, beta 1, derivative cutoff 1 Hz,
#     speeds measured in object sizes (the points' bounding box, mean of width and height) per
#     second. facecast does the same with the frames' capture times. A still person keeps a
#     still ROI (weight 0.2% per frame for the new position at 30 fps); one moving by an object
#     size per second gets ~17%. The filter starts afresh with every new track.
AUX_MIN_CUTOFF_HZ = 0.01
AUX_BETA = 1.0
AUX_DERIVATIVE_CUTOFF_HZ = 1.0
# Used between frames when track() gets no timestamps.
DEFAULT_FRAME_INTERVAL_S = 1 / 30


class OneEuroFilter:
    """MediaPipe's OneEuroFilter (one_euro_filter.cc) over an array of values at once, with
    LandmarksSmoothingCalculator's object-scale normalisation of the speed (see Note [Steady pose
    ROI]). Each element has its own cutoff, as each landmark coordinate has its own filter there.
    """

    def __init__(self, min_cutoff_hz: float, beta: float, derivative_cutoff_hz: float):
        self.min_cutoff_hz = min_cutoff_hz
        self.beta = beta
        self.derivative_cutoff_hz = derivative_cutoff_hz
        self.last_ts_s: float | None = None
        self.last_raw: np.ndarray | None = None
        self.value: np.ndarray | None = None
        self.speed: np.ndarray | None = None

    @staticmethod
    def _alpha(cutoff_hz, interval_s: float):
        tau_s = 1.0 / (2 * math.pi * cutoff_hz)
        return 1.0 / (1.0 + tau_s / interval_s)

    def __call__(self, ts_s: float, raw: np.ndarray, object_scale: float) -> np.ndarray:
        raw = np.asarray(raw, dtype=np.float64)
        if object_scale < 1e-6:  # degenerate points: MediaPipe passes them through
            return raw
        if self.last_ts_s is None:
            self.last_ts_s, self.last_raw, self.value, self.speed = ts_s, raw, raw, np.zeros_like(raw)
            return raw
        interval_s = ts_s - self.last_ts_s
        if interval_s <= 0:  # a repeated or older timestamp: unfiltered, state kept
            return raw
        speed = (raw - self.last_raw) / object_scale / interval_s
        self.speed = self.speed + self._alpha(self.derivative_cutoff_hz, interval_s) * (speed - self.speed)
        alpha = self._alpha(self.min_cutoff_hz + self.beta * np.abs(self.speed), interval_s)
        self.value = self.value + alpha * (raw - self.value)
        self.last_ts_s, self.last_raw = ts_s, raw
        return self.value


@dataclass
class _Track:
    aux_xy_px: torch.Tensor  # (2, 2): hip centre, scale point, smoothed (the next ROI's points)
    aux_filter: OneEuroFilter


@dataclass
class _CameraState:
    tracks: list[_Track] = field(default_factory=list)
    frames_since_detection: int = 0
    lost_pose: bool = False
    frames_seen: int = 0  # the clock of the aux filters when track() gets no timestamps


ModelLoader = Callable[[str], torch.nn.Module]


def _model_loader(model_dir: str | os.PathLike | None) -> ModelLoader:
    def load(name: str) -> torch.nn.Module:
        from facecast.models import assets, tflite_convert

        return tflite_convert.convert(assets.model_path(name, model_dir))

    return load


# ---------------------------------------------------------------------------------------------
# ROI and decoding: plain functions, batched, so that tests can check them alone.
# ---------------------------------------------------------------------------------------------


def rects_from_alignment_points(centre_xy_px: torch.Tensor, scale_xy_px: torch.Tensor,
                                scale: float = ROI_SCALE) -> roi_mod.RotatedRects:
    """MediaPipe's AlignmentPointsRectsCalculator + RectTransformationCalculator(square_long).

    The rect is centred on ``centre`` (the hip centre), its side is twice the centre→scale-point
    distance times ``scale``, and it is rotated so that the centre→scale-point vector points up in
    the crop. centre, scale point: (N, 2) px.

    MediaPipe writes the rotation ``target − atan2(−dy, dx)`` (y flipped to point up) with a target
    of 90°. In facecast's convention (clockwise on screen, see roi.py) that is
    ``atan2(dy, dx) + 90°``: a scale point straight above the hips (dy < 0) gives 0, one to the
    right of them (a body lying with its head to the right) gives +90°. Note that
    ``roi.rects_from_boxes_and_points``'s ``target_angle_rad`` has the opposite sign, which is
    why this function does not reuse it.
    """
    delta = scale_xy_px - centre_xy_px
    side = 2.0 * torch.linalg.vector_norm(delta, dim=-1) * scale
    rotation = torch.atan2(delta[:, 1], delta[:, 0]) + ROI_TARGET_ANGLE_RAD
    rotation = rotation - 2 * math.pi * torch.floor((rotation + math.pi) / (2 * math.pi))  # to [-π, π)
    return roi_mod.RotatedRects(centre_xy_px.clone(), torch.stack([side, side], dim=1), rotation)


def refine_from_heatmap(xy_model_px: torch.Tensor, heatmap_logits: torch.Tensor,
                        input_size_px: int = LANDMARK_INPUT_PX, kernel_px: int = HEATMAP_KERNEL_PX,
                        min_confidence: float = HEATMAP_MIN_CONFIDENCE) -> torch.Tensor:
    """MediaPipe's RefineLandmarksFromHeatmapCalculator, batched.

    xy_model_px: (N, L, 2) in the model input's pixels; heatmap_logits: (N, H, W, L) (one channel
    per landmark, NHWC as the model gives it). Each landmark is replaced by the sigmoid-weighted
    mean cell of a ``kernel_px`` square of its heatmap around the cell it falls in, when the most
    confident cell there reaches ``min_confidence``; otherwise it is kept.

    As in MediaPipe: a landmark's cell is its normalized coordinate times the heatmap size,
    truncated toward zero; the kernel is cut at the heatmap's edges; the mean is taken over cell
    indices, not cell centres (half a cell up-left of them: MediaPipe's convention, kept so that
    the landmarks are MediaPipe's). A landmark outside the heatmap is kept. MediaPipe's bounds
    check compares the column with the height where it means the row; that differs from this one
    only for a point less than 3 cells below the heatmap, which MediaPipe may still pull up.
    """
    n, height, width, count = heatmap_logits.shape
    if xy_model_px.shape != (n, count, 2):
        raise ValueError(f"landmarks {tuple(xy_model_px.shape)} do not match heatmaps "
                         f"{tuple(heatmap_logits.shape)}")
    confidence = torch.sigmoid(heatmap_logits.float()).permute(0, 3, 1, 2).reshape(n, count, height * width)
    col = torch.trunc(xy_model_px[..., 0] / input_size_px * width).long()
    row = torch.trunc(xy_model_px[..., 1] / input_size_px * height).long()
    inside = (col >= 0) & (col < width) & (row >= 0) & (row < height)
    # A landmark far outside is not refined, but its window must still index sanely.
    col, row = col.clamp(-width, 2 * width), row.clamp(-height, 2 * height)
    half = (kernel_px - 1) // 2
    steps = torch.arange(-half, half + 1, device=xy_model_px.device)
    rows = row[..., None] + steps  # (N, L, K)
    cols = col[..., None] + steps
    in_kernel = (((rows >= 0) & (rows < height))[..., :, None]
                 & ((cols >= 0) & (cols < width))[..., None, :])  # (N, L, K, K)
    flat = rows.clamp(0, height - 1)[..., :, None] * width + cols.clamp(0, width - 1)[..., None, :]
    weights = confidence.gather(2, flat.reshape(n, count, -1)) * in_kernel.reshape(n, count, -1)
    total = weights.sum(dim=-1)
    weighted_row = (weights * rows[..., :, None].expand_as(in_kernel).reshape(n, count, -1)).sum(dim=-1)
    weighted_col = (weights * cols[..., None, :].expand_as(in_kernel).reshape(n, count, -1)).sum(dim=-1)
    refine = inside & (weights.amax(dim=-1) >= min_confidence) & (total > 0)
    safe_total = total.clamp(min=1e-12)
    refined = torch.stack([weighted_col / safe_total / width * input_size_px,
                           weighted_row / safe_total / height * input_size_px], dim=-1)
    return torch.where(refine[..., None], refined, xy_model_px)


@dataclass
class DecodedLandmarks:
    """pose_landmark_full's outputs for N ROIs, in the frames' pixels: all 39 points, of which
    the first :data:`NUM_LANDMARKS` are the pose and the next two the auxiliary points."""

    points_px: torch.Tensor  # (N, 39, 3) x, y px; z px on x's scale
    visibility: torch.Tensor  # (N, 39) probability
    landmark_presence: torch.Tensor  # (N, 39) probability
    world_m: torch.Tensor  # (N, 39, 3) meters, rotated like the ROI
    presence: torch.Tensor  # (N,) pose presence score


def decode_landmarks(outputs: Sequence[torch.Tensor], rects: roi_mod.RotatedRects,
                     input_size_px: int = LANDMARK_INPUT_PX) -> DecodedLandmarks:
    """Decode pose_landmark_full's outputs, in the tflite's order (landmarks (N, 195), pose flag
    (N, 1), segmentation, heatmaps (N, 64, 64, 39), world landmarks (N, 117)), for the ROIs they
    were cropped from."""
    if len(outputs) != 5:
        raise ValueError(f"pose_landmark_full has 5 outputs, got {len(outputs)}")
    raw, flag, _segmentation, heatmap, world = outputs
    n = raw.shape[0]
    raw = raw.reshape(n, NUM_MODEL_POINTS, 5).float()
    xy = refine_from_heatmap(raw[..., :2], heatmap)
    points = roi_mod.project_points(torch.cat([xy, raw[..., 2:3]], dim=-1), rects, input_size_px)
    # World landmarks are only rotated back (WorldLandmarkProjectionCalculator): they are in
    # meters around the hips, not in the crop's pixels.
    world = world.reshape(n, NUM_MODEL_POINTS, 3).float()
    cos = torch.cos(rects.rotation_rad)[:, None]
    sin = torch.sin(rects.rotation_rad)[:, None]
    world_xy = torch.stack([cos * world[..., 0] - sin * world[..., 1],
                            sin * world[..., 0] + cos * world[..., 1]], dim=-1)
    # The pose flag is already a probability (the graph applies no activation to it).
    return DecodedLandmarks(
        points_px=points,
        visibility=torch.sigmoid(raw[..., 3]),
        landmark_presence=torch.sigmoid(raw[..., 4]),
        world_m=torch.cat([world_xy, world[..., 2:3]], dim=-1),
        presence=flag.reshape(n).float(),
    )


def _axis_aligned(rects: roi_mod.RotatedRects) -> torch.Tensor:
    """x1, y1, x2, y2 of rects, ignoring their rotation (for "same person" overlaps)."""
    half = rects.size_wh_px / 2
    return torch.cat([rects.center_xy_px - half, rects.center_xy_px + half], dim=1)


def _same_person(rect: roi_mod.RotatedRects, others: roi_mod.RotatedRects) -> bool:
    """Whether a one-rect ROI overlaps any of ``others`` enough to hold the same person."""
    return bool(box_iou(_axis_aligned(rect), _axis_aligned(others)).max() > SAME_PERSON_ROI_IOU)


# ---------------------------------------------------------------------------------------------
# The pipeline.
# ---------------------------------------------------------------------------------------------


class PosePipeline:
    """Body poses of a batch of frames.

    ``pipeline(frames)`` detects in every frame (stateless); ``pipeline.track(frames,
    camera_ids)`` keeps per-camera tracks and detects only when needed. ``frames`` is a list of
    HxWx3 uint8 BGR numpy arrays (sizes may differ), a list of uint8 (H, W, 3) tensors, or a uint8
    tensor (B, H, W, 3), on any device (moved to ``device``).

    ``max_poses`` people per frame (MediaPipe's legacy Pose follows exactly one; its tasks
    PoseLandmarker takes a ``num_poses``). Models come from ``load_model`` (name → torch module),
    by default the installed MediaPipe files of ``model_dir`` (see facecast.models.assets).
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        max_poses: int = 1,
        *,
        min_detection_score: float = POSE_DETECTOR.min_score,
        min_presence: float = MIN_PRESENCE,
        detect_interval_frames: int = 15,
        frames_are_bgr: bool = True,
        model_dir: str | os.PathLike | None = None,
        load_model: ModelLoader | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("PosePipeline(device='cuda'): torch sees no CUDA device; use device='cpu'")
        if max_poses < 1:
            raise ValueError(f"max_poses must be at least 1, got {max_poses}")
        self.max_poses = max_poses
        self.spec = dataclasses.replace(POSE_DETECTOR, min_score=min_detection_score)
        self.min_presence = min_presence
        self.detect_interval_frames = detect_interval_frames
        self.frames_are_bgr = frames_are_bgr
        load = load_model or _model_loader(model_dir)
        self.detector = load(POSE_DETECTOR.name).to(self.device).eval()
        self.landmarker = load("pose_landmark_full").to(self.device).eval()
        if self.device.type == "cuda":  # Note [Warm shapes]
            self.detector = BatchBuckets(self.detector)
            self.landmarker = BatchBuckets(self.landmarker)
        self.anchors = anchors_mod.generate_anchors(self.spec.anchors).to(self.device)
        self._cameras: dict[Hashable, _CameraState] = {}

    # -- public API ------------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, max_frames: int) -> None:
        """Run both models once for every batch bucket a worker with ``max_frames`` cameras can
        meet (Note [Warm shapes]); only on a GPU, where a new batch size
        costs seconds."""
        if self.device.type != "cuda":
            return
        size = self.spec.anchors.input_size_px
        for model, count, side in ((self.detector, max_frames, size),
                                   (self.landmarker, max_frames * self.max_poses, LANDMARK_INPUT_PX)):
            for bucket in buckets_up_to(count):
                model(torch.zeros(bucket, side, side, 3, device=self.device))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def __call__(self, frames) -> list[list[Pose]]:
        batch = roi_mod.FrameBatch(frames, self.device, bgr=self.frames_are_bgr)
        detections = [(kp[: self.max_poses], scores[: self.max_poses]) for _, kp, scores in self.detect(batch)]
        rects = [self._rects_from_detections(keypoints) for keypoints, _ in detections]
        scores = [det_scores.tolist() for _, det_scores in detections]
        measured = self._measure(batch, rects, scores, [[False] * len(s) for s in scores])
        return [[pose for pose, _, _ in found] for found in measured]

    @torch.inference_mode()
    def track(self, frames, camera_ids: Sequence[Hashable],
              timestamps_s: Sequence[float] | None = None) -> list[list[Pose]]:
        """Like calling the pipeline, but with per-camera tracking state (one frame per camera
        per call, in ``camera_ids`` order): a frame whose camera holds its poses gets no detector
        pass, only the landmark model on the ROIs its previous landmarks give.

        ``timestamps_s``: each frame's capture time in seconds (any clock, increasing per camera),
        for the ROI smoothing of Note [Steady pose ROI]; None assumes frames
        ``DEFAULT_FRAME_INTERVAL_S`` apart.
        """
        batch = roi_mod.FrameBatch(frames, self.device, bgr=self.frames_are_bgr)
        if len(camera_ids) != len(batch):
            raise ValueError(f"{len(batch)} frames but {len(camera_ids)} camera ids")
        if timestamps_s is not None and len(timestamps_s) != len(batch):
            raise ValueError(f"{len(batch)} frames but {len(timestamps_s)} timestamps")
        states = [self._cameras.setdefault(cam, _CameraState()) for cam in camera_ids]
        detect_frames = [i for i, cam in enumerate(camera_ids) if self.wants_detection(cam)]
        det_by_frame = dict(zip(detect_frames, self.detect(batch, detect_frames) if detect_frames else []))

        rects_per_frame, scores_per_frame, tracked_per_frame = [], [], []
        for i, state in enumerate(states):
            rects = [self._rects_from_aux(track.aux_xy_px[None]) for track in state.tracks]
            scores = [math.nan] * len(rects)  # a tracked pose's score is its presence (below)
            tracked = [True] * len(rects)
            if i in det_by_frame:
                _, keypoints, det_scores = det_by_frame[i]
                for kp, score in zip(keypoints, det_scores.tolist()):
                    if len(rects) >= self.max_poses:
                        break
                    rect = self._rects_from_detections(kp[None])
                    # A person already tracked is followed by the track's ROI, which comes from
                    # the landmarks rather than from a coarse detection.
                    if rects and _same_person(rect, roi_mod.RotatedRects.cat(rects)):
                        continue
                    rects.append(rect)
                    scores.append(float(score))
                    tracked.append(False)
                state.frames_since_detection = 0
            else:
                state.frames_since_detection += 1
            rects_per_frame.append(roi_mod.RotatedRects.cat(rects) if rects else self._no_rects())
            scores_per_frame.append(scores)
            tracked_per_frame.append(tracked)

        measured = self._measure(batch, rects_per_frame, scores_per_frame, tracked_per_frame)
        poses_per_frame = []
        for i, (state, found, tracked) in enumerate(zip(states, measured, tracked_per_frame)):
            if timestamps_s is None:
                ts_s = state.frames_seen * DEFAULT_FRAME_INTERVAL_S
            else:
                ts_s = float(timestamps_s[i])
            state.frames_seen += 1
            tracks = []
            for _, aux_xy_px, roi_index in found:
                # The ROIs of a frame list its tracks first: a pose from one continues its filter.
                if roi_index < len(state.tracks):
                    aux_filter = state.tracks[roi_index].aux_filter
                else:
                    aux_filter = OneEuroFilter(AUX_MIN_CUTOFF_HZ, AUX_BETA, AUX_DERIVATIVE_CUTOFF_HZ)
                extent = aux_xy_px.max(axis=0) - aux_xy_px.min(axis=0)
                smoothed = aux_filter(ts_s, aux_xy_px, object_scale=float(extent.mean()))
                tracks.append(_Track(torch.tensor(smoothed, dtype=torch.float32, device=self.device), aux_filter))
            # A tracked ROI that no longer holds a pose means the person moved out of it (or
            # left): look for them with the detector on the next frame.
            state.lost_pose = sum(pose.tracked for pose, _, _ in found) < sum(tracked)
            state.tracks = tracks
            poses_per_frame.append([pose for pose, _, _ in found])
        return poses_per_frame

    def wants_detection(self, camera_id: Hashable) -> bool:
        """Whether the camera's next frame gets a detector pass: it has no pose, lost one, or
        has room for more people and it is time to look for them."""
        state = self._cameras.get(camera_id)
        return (state is None or not state.tracks or state.lost_pose
                or (len(state.tracks) < self.max_poses
                    and state.frames_since_detection >= self.detect_interval_frames))

    def reset(self, camera_id: Hashable | None = None) -> None:
        """Forget the tracks of one camera (or of all)."""
        if camera_id is None:
            self._cameras.clear()
        else:
            self._cameras.pop(camera_id, None)

    # -- detection -------------------------------------------------------------------------------

    def detect(self, batch: roi_mod.FrameBatch, frame_indices: Sequence[int] | None = None):
        """Poses detected in the given frames (all by default): per frame, (boxes (M, 4) px — of
        the face, as the detector gives them —, keypoints (M, 4, 2) px, scores (M,)), best first,
        at most ``2 * max_poses`` (room for people already tracked among the best)."""
        if frame_indices is None:
            frame_indices = list(range(len(batch)))
        size = self.spec.anchors.input_size_px
        table = torch.tensor([roi_mod.letterbox_rect(*batch.sizes_hw[i]) for i in frame_indices],
                             dtype=torch.float32, device=self.device)
        letterbox = roi_mod.RotatedRects(table[:, :2], table[:, 2:3].expand(-1, 2).contiguous(),
                                         torch.zeros(len(frame_indices), device=self.device))
        owner = torch.tensor(list(frame_indices), device=self.device)
        # The zero border of the crop is black, -1 after scaling: pose_detection_cpu's BORDER_ZERO
        # letterbox in the model's -1..1 range.
        crops = roi_mod.crop_rois(batch, owner, letterbox, size, border="zero") * 2 - 1
        raw_boxes, raw_scores = self.detector(crops)
        decoded = anchors_mod.decode(raw_boxes, raw_scores, self.anchors, self.spec)
        # Projecting through the letterbox rect is DetectionLetterboxRemovalCalculator and the
        # scaling to frame pixels in one step.
        boxes = roi_mod.project_boxes(decoded.boxes * size, letterbox, size)
        keypoints = roi_mod.project_points((decoded.keypoints * size).flatten(1, 2), letterbox, size
                                           ).reshape(decoded.keypoints.shape)
        result = weighted_nms(boxes, decoded.scores, keypoints, decoded.scores >= self.spec.min_score,
                              iou_threshold=self.spec.min_suppression_iou, max_detections=2 * self.max_poses)
        return [(d.boxes[0], d.keypoints[0], d.scores[0])
                for d in (result.select(k) for k in range(len(frame_indices)))]

    # -- ROI and landmarks -----------------------------------------------------------------------

    def _no_rects(self) -> roi_mod.RotatedRects:
        return roi_mod.RotatedRects(torch.zeros(0, 2, device=self.device), torch.zeros(0, 2, device=self.device),
                                    torch.zeros(0, device=self.device))

    def _rects_from_detections(self, keypoints_px: torch.Tensor) -> roi_mod.RotatedRects:
        if keypoints_px.shape[0] == 0:
            return self._no_rects()
        return rects_from_alignment_points(keypoints_px[:, DETECTION_HIP_CENTRE_KEYPOINT],
                                           keypoints_px[:, DETECTION_SCALE_KEYPOINT])

    @staticmethod
    def _rects_from_aux(aux_xy_px: torch.Tensor) -> roi_mod.RotatedRects:
        # pose_landmarks_to_roi: the auxiliary points play the detection keypoints' role.
        return rects_from_alignment_points(aux_xy_px[:, 0], aux_xy_px[:, 1])

    def _measure(self, batch, rects_per_frame, scores_per_frame, tracked_per_frame):
        """Landmarks for every ROI of every frame, in one batch. Returns per frame the poses found,
        each as (pose, its auxiliary points (2, 2) px as float64 numpy, the index of its ROI in
        the frame's ROIs)."""
        counts = [len(r) for r in rects_per_frame]
        if sum(counts) == 0:
            return [[] for _ in counts]
        rects = roi_mod.RotatedRects.cat(rects_per_frame)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=self.device),
                                        torch.tensor(counts, device=self.device))
        # pose_landmark_by_roi's ImageToTensor leaves the border mode unset: replicate on the CPU.
        crops = roi_mod.crop_rois(batch, owner, rects, LANDMARK_INPUT_PX, border="replicate")
        decoded = decode_landmarks(self.landmarker(crops), rects)

        landmarks = torch.cat([decoded.points_px[:, :NUM_LANDMARKS],
                               decoded.visibility[:, :NUM_LANDMARKS, None],
                               decoded.landmark_presence[:, :NUM_LANDMARKS, None]], dim=-1)
        landmarks_np = landmarks.cpu().numpy().astype(np.float32)
        world_np = decoded.world_m[:, :NUM_LANDMARKS].cpu().numpy().astype(np.float32)
        presence_np = decoded.presence.cpu().numpy()
        aux = decoded.points_px[:, [AUX_HIP_CENTRE_INDEX, AUX_SCALE_POINT_INDEX], :2]
        aux_np = aux.cpu().numpy().astype(np.float64)
        rect_rows = torch.cat([rects.center_xy_px, rects.size_wh_px[:, :1], rects.rotation_rad[:, None]],
                              dim=1).cpu().numpy()

        measured = []
        start = 0
        for frame, count in enumerate(counts):
            height, width = batch.sizes_hw[frame]
            found = []
            for k in range(start, start + count):
                presence = float(presence_np[k])
                if presence < self.min_presence:
                    continue
                tracked = tracked_per_frame[frame][k - start]
                xy = landmarks_np[k, :, :2]
                low = np.clip(xy.min(axis=0), 0, [width, height])
                high = np.clip(xy.max(axis=0), 0, [width, height])
                pose = Pose(
                    landmarks=landmarks_np[k],
                    world_landmarks_m=world_np[k],
                    box=(float(low[0]), float(low[1]), float(high[0]), float(high[1])),
                    presence=presence,
                    score=presence if tracked else scores_per_frame[frame][k - start],
                    roi=tuple(float(v) for v in rect_rows[k]),
                    tracked=tracked,
                )
                found.append((pose, aux_np[k], k - start))
            start += count
            # Two ROIs that converged on one person (two tracks, or a track and a detection):
            # the more present stays.
            measured.append(drop_overlapping(found, _roi_box, _presence, SAME_PERSON_ROI_IOU)[: self.max_poses])
        return measured


def _roi_box(found: tuple) -> torch.Tensor:
    """x1, y1, x2, y2 of the ROI of a (pose, ...) tuple, ignoring its rotation (as _same_person)."""
    centre_x, centre_y, side, rotation = found[0].roi
    rect = roi_mod.RotatedRects(torch.tensor([[centre_x, centre_y]]), torch.tensor([[side, side]]),
                                torch.tensor([rotation]))
    return _axis_aligned(rect)[0]


def _presence(found: tuple) -> float:
    return found[0].presence
