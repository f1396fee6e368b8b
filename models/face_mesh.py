"""The face pipeline's measuring stage: every ROI of every frame cropped, through MediaPipe's
attention mesh (478 landmarks with irises), projected to frame pixels, with head pose and
blendshapes, in one batch (DESIGN §3); and the :class:`Face` it makes of each.

1. **Warp**: every ROI cropped to 192x192 in one bilinear gather from the frames' uint8 pixels
   (Note [Sampling the frames where they lie] in :mod:`facecast.models.roi`).
2. **Mesh**: ``face_landmark_with_attention`` (468 mesh points refined by its lips, eyes and iris
   heads into MediaPipe's 478 landmarks, see :func:`refine_attention_mesh`), face presence score.
3. **Head pose** (:mod:`facecast.models.head_pose`), **blendshapes** (from the 146-landmark
   subset, only when the user gives ``face_landmarker.task``).

One crop, one mesh pass and one transfer to the host per call (Note [Detection without
per-frame work] in :mod:`facecast.models.face_detection`); with ``cuda_graphs`` the mesh pass is
replayed from graphs (Note [CUDA graphs of the pipeline] in :mod:`facecast.models.cuda_graphs`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from facecast.models import roi as roi_mod
from facecast.models.cuda_graphs import GraphCache, bucket, buckets_up_to
from facecast.models.head_pose import head_pose_deg
from facecast.models.nms import drop_overlapping

MESH_INPUT_PX = 192
NUM_MESH_POINTS = 468
NUM_LANDMARKS = 478

# ---------------------------------------------------------------------------------------------
# Attention-mesh output decoding. The index tables are MediaPipe's (option values of its graph
# tensors_to_face_landmarks_with_attention.pbtxt, Apache-2.0): which mesh point each point of the
# lips and eye heads replaces, in the heads' output order.
# ---------------------------------------------------------------------------------------------
LIPS_TO_MESH = (
    61, 146, 91, 181, 84, 17, 314, 405, 321, 375, 291, 185, 40, 39, 37, 0, 267, 269, 270, 409,
    78, 95, 88, 178, 87, 14, 317, 402, 318, 324, 308, 191, 80, 81, 82, 13, 312, 311, 310, 415,
    76, 77, 90, 180, 85, 16, 315, 404, 320, 307, 306, 184, 74, 73, 72, 11, 302, 303, 304, 408,
    62, 96, 89, 179, 86, 15, 316, 403, 319, 325, 292, 183, 42, 41, 38, 12, 268, 271, 272, 407,
)
LEFT_EYE_TO_MESH = (
    33, 7, 163, 144, 145, 153, 154, 155, 133, 246, 161, 160, 159, 158, 157, 173,
    130, 25, 110, 24, 23, 22, 26, 112, 243, 247, 30, 29, 27, 28, 56, 190,
    226, 31, 228, 229, 230, 231, 232, 233, 244, 113, 225, 224, 223, 222, 221, 189,
    35, 124, 46, 53, 52, 65, 143, 111, 117, 118, 119, 120, 121, 128, 245,
    156, 70, 63, 105, 66, 107, 55, 193,
)
RIGHT_EYE_TO_MESH = (
    263, 249, 390, 373, 374, 380, 381, 382, 362, 466, 388, 387, 386, 385, 384, 398,
    359, 255, 339, 254, 253, 252, 256, 341, 463, 467, 260, 259, 257, 258, 286, 414,
    446, 261, 448, 449, 450, 451, 452, 453, 464, 342, 445, 444, 443, 442, 441, 413,
    265, 353, 276, 283, 282, 295, 372, 340, 346, 347, 348, 349, 350, 357, 465,
    383, 300, 293, 334, 296, 336, 285, 417,
)
# The iris points take the mean depth of their eye's contour: the first 16 points of each eye
# head (lower contour, then upper contour without the corners).
EYE_CONTOUR_POINTS = 16
LEFT_IRIS_FIRST_INDEX = 468  # centre, then 4 edge points; the right iris follows at 473

# face_blendshapes_graph.cc: the 146 landmarks the blendshape model reads, and its 52 outputs.
BLENDSHAPE_LANDMARK_SUBSET = (
    0, 1, 4, 5, 6, 7, 8, 10, 13, 14, 17, 21, 33, 37, 39, 40, 46, 52, 53, 54, 55, 58, 61, 63, 65,
    66, 67, 70, 78, 80, 81, 82, 84, 87, 88, 91, 93, 95, 103, 105, 107, 109, 127, 132, 133, 136,
    144, 145, 146, 148, 149, 150, 152, 153, 154, 155, 157, 158, 159, 160, 161, 162, 163, 168, 172,
    173, 176, 178, 181, 185, 191, 195, 197, 234, 246, 249, 251, 263, 267, 269, 270, 276, 282, 283,
    284, 285, 288, 291, 293, 295, 296, 297, 300, 308, 310, 311, 312, 314, 317, 318, 321, 323, 324,
    332, 334, 336, 338, 356, 361, 362, 365, 373, 374, 375, 377, 378, 379, 380, 381, 382, 384, 385,
    386, 387, 388, 389, 390, 397, 398, 400, 402, 405, 409, 415, 454, 466, 468, 469, 470, 471, 472,
    473, 474, 475, 476, 477,
)
BLENDSHAPE_NAMES = (
    "_neutral", "browDownLeft", "browDownRight", "browInnerUp", "browOuterUpLeft",
    "browOuterUpRight", "cheekPuff", "cheekSquintLeft", "cheekSquintRight", "eyeBlinkLeft",
    "eyeBlinkRight", "eyeLookDownLeft", "eyeLookDownRight", "eyeLookInLeft", "eyeLookInRight",
    "eyeLookOutLeft", "eyeLookOutRight", "eyeLookUpLeft", "eyeLookUpRight", "eyeSquintLeft",
    "eyeSquintRight", "eyeWideLeft", "eyeWideRight", "jawForward", "jawLeft", "jawOpen", "jawRight",
    "mouthClose", "mouthDimpleLeft", "mouthDimpleRight", "mouthFrownLeft", "mouthFrownRight",
    "mouthFunnel", "mouthLeft", "mouthLowerDownLeft", "mouthLowerDownRight", "mouthPressLeft",
    "mouthPressRight", "mouthPucker", "mouthRight", "mouthRollLower", "mouthRollUpper",
    "mouthShrugLower", "mouthShrugUpper", "mouthSmileLeft", "mouthSmileRight", "mouthStretchLeft",
    "mouthStretchRight", "mouthUpperUpLeft", "mouthUpperUpRight", "noseSneerLeft", "noseSneerRight",
)


@functools.lru_cache(maxsize=32)
def _indices(mapping: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An index table as a tensor on the device, made once: a table made per call is a
    host-to-device copy each time, which a CUDA graph cannot capture. (A normal tensor even
    when first asked for under inference mode, so that it may index anywhere.)"""
    with torch.inference_mode(False):
        return torch.tensor(mapping, device=device)


def refine_attention_mesh(outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``face_landmark_with_attention``'s outputs, in the tflite's order (mesh, lips, left
    eye, right eye, left iris, right iris, face flag), into (N, 478, 3) landmarks in model-input
    pixels and (N,) face presence probabilities.

    As MediaPipe's LandmarksRefinementCalculator: the lips and eye heads overwrite x, y of their
    mesh points (keeping the mesh's z); the irises are appended with the mean z of their eye's
    contour.
    """
    if len(outputs) != 7:
        raise ValueError(f"face_landmark_with_attention has 7 outputs, got {len(outputs)}")
    mesh, lips, left_eye, right_eye, left_iris, right_iris, face_flag = outputs
    n = mesh.shape[0]
    landmarks = mesh.reshape(n, NUM_MESH_POINTS, 3).float().clone()
    for head, mapping in ((lips, LIPS_TO_MESH), (left_eye, LEFT_EYE_TO_MESH), (right_eye, RIGHT_EYE_TO_MESH)):
        landmarks[:, _indices(mapping, landmarks.device), :2] = head.reshape(n, len(mapping), 2).float()
    irises = []
    for iris, eye_mapping in ((left_iris, LEFT_EYE_TO_MESH), (right_iris, RIGHT_EYE_TO_MESH)):
        contour = _indices(eye_mapping[:EYE_CONTOUR_POINTS], landmarks.device)
        depth = landmarks[:, contour, 2].mean(dim=1)
        xy = iris.reshape(n, 5, 2).float()
        irises.append(torch.cat([xy, depth[:, None, None].expand(n, 5, 1)], dim=-1))
    presence = torch.sigmoid(face_flag.reshape(n).float())
    return torch.cat([landmarks] + irises, dim=1), presence


# At most this many faces per mesh graph; more are split (Note [CUDA graphs of the pipeline] in
# models/cuda_graphs.py).
MAX_GRAPH_FACES = 256


# ---------------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------------


@dataclass
class Face:
    """One face in one frame, in that frame's pixels."""

    box: tuple[float, float, float, float]  # x1, y1, x2, y2 px (detector-style box)
    score: float  # detector score on detection frames; mesh presence when tracked
    landmarks: np.ndarray  # (478, 3) float32: x, y px; z px on x's scale (negative = closer)
    head_pose: tuple[float, float, float]  # yaw, pitch, roll in degrees (see head_pose.py)
    presence: float  # the mesh model's face presence probability
    blendshapes: np.ndarray | None = None  # (52,) float32 in BLENDSHAPE_NAMES order
    tracked: bool = False  # True when the ROI came from the previous frame's landmarks


@dataclass
class Measured:
    """What :meth:`FaceMeasurer.measure` found: the faces of each frame, and for each kept
    face its row in the device tensors (which the tracks keep, without a copy back)."""

    faces: list[list[Face]]
    rows: list[list[int]]
    landmarks_px: torch.Tensor | None  # (N, 478, 3)
    boxes_px: torch.Tensor | None  # (N, 4)

    @classmethod
    def nothing(cls, frames: int) -> "Measured":
        """No face in any of ``frames`` frames."""
        return cls([[] for _ in range(frames)], [[] for _ in range(frames)], None, None)


# Note [Box of a tracked face]
#     On detection frames a face's box is the detector's (MediaPipe's convention). A tracked face
#     has no detection, so its box comes from its 468 mesh points: the square around them, moved
#     and scaled by these constants, so that it lands where MediaPipe's short-range detector puts
#     it on a face seen at full size. Measured against the synthetic scenes' ground truth
#     (MediaPipe 0.10.21's box of astronaut and grace_hopper on the unmodified photos), 144 faces
#     at 640x360, 1280x720 and 1920x1080: centre offset (0.016, 0.059) of the mesh's side, box
#     side 0.924 of it. The two faces differ by 7% in side (0.891 and 0.958): a tracked box is
#     within about 4% of MediaPipe's on these faces. Deriving the box afresh every frame cannot
#     drift, and a detection that started a track with an odd box (a small face, or the
#     full-range detector, whose convention differs) does not follow the face for its whole life.
TRACKED_BOX_CENTER_OFFSET = (0.016, 0.059)
TRACKED_BOX_SIDE = 0.924


def boxes_from_landmarks(landmarks_px: torch.Tensor) -> torch.Tensor:
    """Detector-style boxes (N, 4) x1, y1, x2, y2 from faces' landmarks (N, ≥468, 2 or 3)
    (Note [Box of a tracked face])."""
    mesh = landmarks_px[:, :NUM_MESH_POINTS, :2]
    low, high = mesh.min(dim=1).values, mesh.max(dim=1).values
    side = (high - low).max(dim=1, keepdim=True).values
    offset = torch.tensor(TRACKED_BOX_CENTER_OFFSET, dtype=mesh.dtype, device=mesh.device)
    centre = (low + high) / 2 + side * offset
    half = side * TRACKED_BOX_SIDE / 2
    return torch.cat([centre - half, centre + half], dim=1)


# Two ROIs whose landmarks' bounds overlap by more than this converged on one face (a track and a
# detection): only the more present stays.
SAME_FACE_IOU = 0.5


def _landmark_bounds(candidate: tuple[Face, int]) -> np.ndarray:
    points = candidate[0].landmarks[:, :2]
    return np.concatenate([points.min(0), points.max(0)])


def _presence(candidate: tuple[Face, int]) -> float:
    return candidate[0].presence


class FaceMeasurer:
    """The mesh model (and the blendshape model, when there is one) over batches of ROIs."""

    def __init__(self, mesh: torch.nn.Module, blendshapes: torch.nn.Module | None, *, device: torch.device,
                 model_dtype: torch.dtype, max_faces: int, min_presence: float, graphs: GraphCache):
        self.mesh, self.blendshapes = mesh, blendshapes
        self.device, self.model_dtype, self.graphs = device, model_dtype, graphs
        self.max_faces, self.min_presence = max_faces, min_presence

    def measure(self, batch, owners: list[int], rects: roi_mod.RotatedRects, roi_boxes: torch.Tensor,
                roi_scores: torch.Tensor, tracked: list[bool]) -> Measured:
        """Mesh, head pose and blendshapes for every ROI of every frame, in one batch.

        owners: the frame of each ROI; roi_boxes / roi_scores: the detection's box and score
        (used for faces that were detected, not tracked); tracked: whether each ROI came from a
        track (its box then comes from its landmarks, its score is the mesh's presence).
        """
        frames = len(batch)
        count = len(owners)
        if count == 0:
            return Measured.nothing(frames)
        owner = roi_mod.from_host(owners, self.device)
        crops = roi_mod.crop_rois(batch, owner, rects, MESH_INPUT_PX, border="replicate", dtype=self.model_dtype)
        landmarks, presence, blendshapes = self.landmarks(crops, rects)
        # MediaPipe's z is relative to the face's centre of mass; the projected z already is
        # (the model predicts it so), kept as is.
        poses = head_pose_deg(landmarks)
        is_tracked = roi_mod.from_host(tracked, self.device)
        boxes = torch.where(is_tracked[:, None], boxes_from_landmarks(landmarks), roi_boxes.float())
        scores = torch.where(is_tracked, presence, roi_scores.float())
        parts = [landmarks.reshape(count, -1), presence[:, None], poses, boxes, scores[:, None]]
        if blendshapes is not None:
            parts.append(blendshapes)
        host = torch.cat([p.float() for p in parts], dim=1).cpu().numpy()  # the one wait for the device
        points = NUM_LANDMARKS * 3
        landmarks_np = np.ascontiguousarray(host[:, :points]).reshape(count, NUM_LANDMARKS, 3)
        presence_np = host[:, points]
        poses_np = host[:, points + 1:points + 4]
        boxes_np = host[:, points + 4:points + 8]
        scores_np = host[:, points + 8]
        blend_np = np.ascontiguousarray(host[:, points + 9:]) if blendshapes is not None else None

        by_frame: list[list[int]] = [[] for _ in range(frames)]
        for k, frame in enumerate(owners):
            by_frame[frame].append(k)
        faces_per_frame, rows_per_frame = [], []
        for rows in by_frame:
            candidates = [
                (Face(
                    box=tuple(float(v) for v in boxes_np[k]),
                    score=float(scores_np[k]),
                    landmarks=landmarks_np[k],
                    head_pose=tuple(float(v) for v in poses_np[k]),
                    presence=float(presence_np[k]),
                    blendshapes=None if blend_np is None else blend_np[k],
                    tracked=tracked[k],
                ), k)
                for k in rows if presence_np[k] >= self.min_presence
            ]
            kept = drop_overlapping(candidates, _landmark_bounds, _presence, SAME_FACE_IOU)[: self.max_faces]
            faces_per_frame.append([face for face, _ in kept])
            rows_per_frame.append([k for _, k in kept])
        return Measured(faces_per_frame, rows_per_frame, landmarks, boxes)

    def warm_up(self, max_faces: int) -> None:
        """Run every graph bucket of up to ``max_faces`` faces once (Note [Warm shapes] in
        models/cuda_graphs.py)."""
        count = min(max_faces, MAX_GRAPH_FACES)
        if count >= 1:
            crops = torch.zeros(count, MESH_INPUT_PX, MESH_INPUT_PX, 3, dtype=self.model_dtype,
                                device=self.device)
            rects = roi_mod.RotatedRects(torch.zeros(count, 2, device=self.device),
                                         torch.full((count, 2), 100.0, device=self.device),
                                         torch.zeros(count, device=self.device))
            for faces_in_bucket in buckets_up_to(count, MAX_GRAPH_FACES):
                self.landmarks(crops[:faces_in_bucket], rects[:faces_in_bucket])

    def landmarks(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        """(landmarks (N, 478, 3) px, presence (N,), blendshapes (N, 52) or None) of the crops."""
        if self.graphs.replays("mesh"):
            parts = []
            for start in range(0, crops.shape[0], MAX_GRAPH_FACES):
                stop = min(crops.shape[0], start + MAX_GRAPH_FACES)
                part = self._landmarks_graphed(crops[start:stop], rects[start:stop])
                if part is None:
                    break
                parts.append(part)
            else:
                landmarks, presence, blendshapes = zip(*parts)
                return (torch.cat(landmarks), torch.cat(presence),
                        None if blendshapes[0] is None else torch.cat(blendshapes))
        return self.landmarks_core(crops, rects)

    def landmarks_core(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        """The mesh stage proper, a fixed sequence of tensor operations (what a CUDA graph
        captures)."""
        landmarks_model, presence = refine_attention_mesh(self.mesh(crops))
        landmarks = roi_mod.project_points(landmarks_model, rects, MESH_INPUT_PX)
        blendshapes = self._run_blendshapes(landmarks) if self.blendshapes is not None else None
        return landmarks, presence, blendshapes

    def _landmarks_graphed(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        count = crops.shape[0]
        padded = bucket(count, MAX_GRAPH_FACES)

        def build():
            statics = {
                "crops": torch.zeros(padded, *crops.shape[1:], dtype=crops.dtype, device=self.device),
                "centre": torch.zeros(padded, 2, device=self.device),
                "size": torch.zeros(padded, 2, device=self.device),
                "rotation": torch.zeros(padded, device=self.device),
            }
            static_rects = roi_mod.RotatedRects(statics["centre"], statics["size"], statics["rotation"])
            return (lambda: self.landmarks_core(statics["crops"], static_rects)), statics

        captured = self.graphs.get("mesh", (padded, crops.dtype), build)
        if captured is None:
            return None
        statics = captured.statics
        statics["crops"][:count].copy_(crops)
        statics["centre"][:count].copy_(rects.center_xy_px)
        statics["size"][:count].copy_(rects.size_wh_px)
        statics["rotation"][:count].copy_(rects.rotation_rad)
        landmarks, presence, blendshapes = captured.replay()
        return (landmarks[:count].clone(), presence[:count].clone(),
                None if blendshapes is None else blendshapes[:count].clone())

    def _run_blendshapes(self, landmarks_px: torch.Tensor) -> torch.Tensor:
        # The model reads x, y of the 146-landmark subset in image pixels (MediaPipe's
        # LandmarksToTensorCalculator with IMAGE_SIZE).
        subset = landmarks_px[:, _indices(BLENDSHAPE_LANDMARK_SUBSET, landmarks_px.device), :2]
        (scores, *_) = self.blendshapes(subset.to(self.model_dtype).contiguous())
        return scores.reshape(landmarks_px.shape[0], len(BLENDSHAPE_NAMES)).float()
