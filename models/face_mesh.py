"""The face pipeline's measuring stage: every ROI of every frame cropped, through a landmark model
(478 landmarks with irises), projected to frame pixels, with head pose, blendshapes and the facial
transformation matrix, in one batch (DESIGN §3); and the :class:`Face` it makes of each.

Two landmark models, chosen when the pipeline is built:

- with ``face_landmarker.task`` (MediaPipe FaceLandmarker's stack, model for model): its own v2
  landmarker (:mod:`facecast.models.face_landmarker`, 256x256, 478 points in one output) feeds
  its blendshape model (:mod:`facecast.models.blendshapes`); the facial transformation matrix
  (:mod:`facecast.models.face_geometry`) gives head rotation and translation in centimeters;
- without it: MediaPipe's attention mesh (``face_landmark_with_attention``, 192x192, 468 mesh
  points refined by its lips, eyes and iris heads into the 478, see :func:`refine_attention_mesh`),
  head pose measured from the landmarks (:mod:`facecast.models.head_pose`), no blendshapes, no
  translation.

1. **Warp**: every ROI cropped to the model's input in one bilinear gather from the frames' uint8
   pixels (Note [Sampling the frames where they lie] in :mod:`facecast.models.roi`).
2. **Landmarks**, face presence score; **blendshapes** on the device, in the same pass (and the
   same CUDA graph).
3. On the device too, batched: **head pose**, and with the bundle the **transformation matrix**
   (float64: Note [Face geometry as MediaPipe computes it]); the **duplicate filter** (Note [The
   duplicate filter as tensors] in :mod:`facecast.models.nms`). Then the one transfer to the
   host, where only the :class:`Face` objects are made (Note [Measuring on the device]).

One crop, one mesh pass and one transfer to the host per call (Note [Detection without
per-frame work] in :mod:`facecast.models.face_detection`); with ``cuda_graphs`` the mesh pass is
replayed from graphs (Note [CUDA graphs of the pipeline] in :mod:`facecast.models.cuda_graphs`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from facecast.models import blendshapes as blendshapes_mod
from facecast.models import face_landmarker
from facecast.models import roi as roi_mod
from facecast.models.cuda_graphs import GraphCache, bucket, buckets_up_to
from facecast.models.face_geometry import FaceGeometry, head_pose_from_matrices
from facecast.models.head_pose import head_pose_deg
from facecast.models.nms import drop_overlapping_batched

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

# The blendshape model's tables, under their former names (models/blendshapes.py).
BLENDSHAPE_LANDMARK_SUBSET = blendshapes_mod.LANDMARK_SUBSET
BLENDSHAPE_NAMES = blendshapes_mod.BLENDSHAPE_NAMES


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
    presence: float  # the landmark model's face presence probability
    blendshapes: np.ndarray | None = None  # (52,) float32 in BLENDSHAPE_NAMES order
    tracked: bool = False  # True when the ROI came from the previous frame's landmarks
    # With face_landmarker.task: MediaPipe's facial transformation matrix (4x4 float32, canonical
    # face model to camera space in cm, OpenGL axes) and its translation.
    transform_matrix: np.ndarray | None = None
    head_translation_cm: tuple[float, float, float] | None = None


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


def landmark_bounds(landmarks_px: torch.Tensor) -> torch.Tensor:
    """(N, 4) x1, y1, x2, y2: the bounds of each face's landmarks (N, 478, ≥2), all of them
    (what the duplicate filter compares)."""
    points = landmarks_px[..., :2]
    return torch.cat([points.amin(dim=1), points.amax(dim=1)], dim=1)


# Note [Measuring on the device]
#     Everything a Face holds is computed on the device, batched, before the one transfer:
#     landmarks, presence, blendshapes, box and score, head pose, the transformation matrix, and
#     which faces the duplicate filter keeps in which order. They travel as one float32 (N, C)
#     table; the float64 columns (head pose and translation: MediaPipe's matrix is fitted in
#     float64 and the host kept them so before issue 24) travel bit for bit as pairs of float32
#     columns (a view, not a conversion). On the host what is left is slicing that table and
#     making the Face objects of the kept faces: issue 24's profile of the per-face host work it
#     replaces (Procrustes, head pose and the greedy filter per face, in Python) was ~21 ms a
#     batch of 64 faces on the H100's host, against ~6 ms of GPU work.


LANDMARKERS = ("attention_mesh", "face_landmarker")


class FaceMeasurer:
    """The landmark model (and the blendshape model and face geometry, with face_landmarker.task)
    over batches of ROIs.

    ``landmarker``: "attention_mesh" (``mesh`` is face_landmark_with_attention) or
    "face_landmarker" (``mesh`` is the bundle's face_landmarks_detector).
    """

    def __init__(self, mesh: torch.nn.Module, blendshapes: torch.nn.Module | None, *, device: torch.device,
                 model_dtype: torch.dtype, max_faces: int, min_presence: float, graphs: GraphCache,
                 landmarker: str = "attention_mesh", geometry: FaceGeometry | None = None):
        if landmarker not in LANDMARKERS:
            raise ValueError(f"landmarker must be one of {LANDMARKERS}, got {landmarker!r}")
        self.mesh, self.blendshapes, self.geometry = mesh, blendshapes, geometry
        self.landmarker = landmarker
        self.input_px = face_landmarker.INPUT_PX if landmarker == "face_landmarker" else MESH_INPUT_PX
        self.device, self.model_dtype, self.graphs = device, model_dtype, graphs
        self.max_faces, self.min_presence = max_faces, min_presence
        # The host's share of the last measure(): from the one transfer's arrival to the Face
        # objects (bench/models.py reports it).
        self.last_host_work_s = 0.0

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
        crops = roi_mod.crop_rois(batch, owner, rects, self.input_px, border="replicate", dtype=self.model_dtype)
        landmarks, presence, blendshapes = self.landmarks(crops, rects)
        is_tracked = roi_mod.from_host(tracked, self.device)
        boxes = torch.where(is_tracked[:, None], boxes_from_landmarks(landmarks), roi_boxes.float())
        scores = torch.where(is_tracked, presence, roi_scores.float())
        frame_wh = (roi_mod.from_host(np.asarray(batch.sizes_hw)[owners, ::-1].copy(), self.device)
                    if self.geometry is not None else None)
        table = self._device_table(landmarks, presence, blendshapes, boxes, scores, owner,
                                   int(np.bincount(owners).max()), frame_wh)
        host = table.cpu().numpy()  # the one wait for the device
        host_start_s = time.perf_counter()
        faces = self._faces(host, owners, tracked, frames, with_blendshapes=blendshapes is not None)
        self.last_host_work_s = time.perf_counter() - host_start_s
        return Measured(*faces, landmarks, boxes)

    def _device_table(self, landmarks: torch.Tensor, presence: torch.Tensor, blendshapes: torch.Tensor | None,
                      boxes: torch.Tensor, scores: torch.Tensor, owner: torch.Tensor, max_faces_per_frame: int,
                      frame_wh: torch.Tensor | None) -> torch.Tensor:
        """Everything the Face objects need, one (N, C) float32 table on the device (Note
        [Measuring on the device]; :meth:`_faces` reads it): landmarks, presence, box, score,
        whether the duplicate filter keeps the face and its place, blendshapes, the
        transformation matrix, and (float64 as float32 pairs) head pose and translation."""
        count = landmarks.shape[0]
        # Two ROIs that converged on one face (a track and a detection): the more present stays.
        kept, rank = drop_overlapping_batched(
            landmark_bounds(landmarks.float()), presence.float(), owner, presence.float() >= self.min_presence,
            SAME_FACE_IOU, self.max_faces, max_group_size=max_faces_per_frame)
        parts = [landmarks.reshape(count, -1), presence[:, None], boxes, scores[:, None], kept[:, None],
                 rank[:, None]]
        if blendshapes is not None:
            parts.append(blendshapes)
        if self.geometry is not None:
            # Note [Face geometry as MediaPipe computes it]: MediaPipe's rotation as the pose.
            matrices = self.geometry.matrices(landmarks, frame_wh)
            parts.append(matrices.reshape(count, 16))
            wide = torch.cat([head_pose_from_matrices(matrices), matrices[:, :3, 3]], dim=1)
        else:
            wide = head_pose_deg(landmarks).double()
        parts.append(wide.contiguous().view(torch.float32))
        return torch.cat([p.float() for p in parts], dim=1)

    def _faces(self, host: np.ndarray, owners: list[int], tracked: list[bool], frames: int,
               with_blendshapes: bool) -> tuple[list[list[Face]], list[list[int]]]:
        """The Face objects of the kept faces and their rows, per frame, from the table of
        :meth:`measure` (Note [Measuring on the device]): vectorised, but for the objects."""
        count = host.shape[0]
        widths = [NUM_LANDMARKS * 3, 1, 4, 1, 1, 1, len(BLENDSHAPE_NAMES) if with_blendshapes else 0,
                  16 if self.geometry is not None else 0]
        bounds = np.cumsum([0] + widths)
        (landmarks_np, presence_np, boxes_np, scores_np, kept_np, rank_np, blend_np, matrices_np) = (
            host[:, start:stop] for start, stop in zip(bounds[:-1], bounds[1:]))
        wide = np.ascontiguousarray(host[:, bounds[-1]:]).view(np.float64)  # pose (, translation)
        owner_np = np.asarray(owners)
        rows = np.flatnonzero(kept_np[:, 0] > 0)
        rows = rows[np.lexsort((rank_np[rows, 0], owner_np[rows]))]  # per frame, best first
        landmarks_np = np.ascontiguousarray(landmarks_np).reshape(count, NUM_LANDMARKS, 3)
        blend_np = np.ascontiguousarray(blend_np) if with_blendshapes else None
        matrices_np = (np.ascontiguousarray(matrices_np).reshape(count, 4, 4) if self.geometry is not None
                       else None)
        poses = wide[rows, :3].tolist()
        translations = wide[rows, 3:6].tolist() if self.geometry is not None else [None] * len(rows)
        faces_per_frame: list[list[Face]] = [[] for _ in range(frames)]
        rows_per_frame: list[list[int]] = [[] for _ in range(frames)]
        for k, frame, box, score, presence, pose, translation in zip(
                rows.tolist(), owner_np[rows].tolist(), boxes_np[rows].tolist(), scores_np[rows, 0].tolist(),
                presence_np[rows, 0].tolist(), poses, translations):
            faces_per_frame[frame].append(Face(
                box=tuple(box), score=score, landmarks=landmarks_np[k], head_pose=tuple(pose), presence=presence,
                blendshapes=None if blend_np is None else blend_np[k], tracked=tracked[k],
                transform_matrix=None if matrices_np is None else matrices_np[k],
                head_translation_cm=None if translation is None else tuple(translation)))
            rows_per_frame[frame].append(k)
        return faces_per_frame, rows_per_frame

    def warm_up(self, max_faces: int) -> None:
        """On a GPU, run every batch bucket of up to ``max_faces`` faces once, captured as graphs
        where they are on (Note [Warm shapes])."""
        count = min(max_faces, MAX_GRAPH_FACES)
        if count >= 1 and (self.device.type == "cuda" or self.graphs.enabled):
            crops = torch.zeros(count, self.input_px, self.input_px, 3, dtype=self.model_dtype,
                                device=self.device)
            rects = roi_mod.RotatedRects(torch.zeros(count, 2, device=self.device),
                                         torch.full((count, 2), 100.0, device=self.device),
                                         torch.zeros(count, device=self.device))
            for faces_in_bucket in buckets_up_to(count, MAX_GRAPH_FACES):
                self.landmarks(crops[:faces_in_bucket], rects[:faces_in_bucket])
            self._warm_device_table()

    def _warm_device_table(self) -> torch.Tensor:
        """The results' device work once (its first SVD on a GPU creates the solver's handle),
        on a face made of the canonical model (the zero crops' landmarks may be anything, and
        an SVD of non-finite numbers raises)."""
        landmarks = torch.zeros(1, NUM_LANDMARKS, 3, device=self.device)
        if self.geometry is not None:
            canonical = torch.as_tensor(self.geometry.metadata.canonical_vertices_cm, dtype=torch.float32)
            face = canonical * torch.tensor([10.0, -10.0, -10.0]) + torch.tensor([320.0, 240.0, 0.0])
            landmarks[0, :NUM_MESH_POINTS] = face.to(self.device)
        one = torch.ones(1, device=self.device)
        blendshapes = (torch.zeros(1, len(BLENDSHAPE_NAMES), device=self.device)
                       if self.blendshapes is not None else None)
        frame_wh = torch.tensor([[640.0, 480.0]], device=self.device)
        return self._device_table(landmarks, one, blendshapes, torch.zeros(1, 4, device=self.device), one,
                                  torch.zeros(1, dtype=torch.long, device=self.device), 1, frame_wh).cpu()

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
        count = crops.shape[0]
        padded = bucket(count)
        if self.device.type != "cuda" or padded == count:
            return self.landmarks_core(crops, rects)
        # Eager on a GPU: in batch buckets too (Note [Warm shapes]),
        # padded with copies of the first face (real values: no degenerate rect in the models).
        rows = torch.cat([torch.arange(count, device=crops.device),
                          torch.zeros(padded - count, dtype=torch.long, device=crops.device)])
        landmarks, presence, blendshapes = self.landmarks_core(crops[rows], rects[rows])
        return (landmarks[:count], presence[:count],
                None if blendshapes is None else blendshapes[:count])

    def landmarks_core(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        """The mesh stage proper, a fixed sequence of tensor operations (what a CUDA graph
        captures)."""
        if self.landmarker == "face_landmarker":
            landmarks_model, presence = face_landmarker.decode(self.mesh(crops))
        else:
            landmarks_model, presence = refine_attention_mesh(self.mesh(crops))
        landmarks = roi_mod.project_points(landmarks_model, rects, self.input_px)
        # float32 even with half=True (Note [Blendshapes in float32]).
        blendshapes = (blendshapes_mod.blendshapes(self.blendshapes, landmarks)
                       if self.blendshapes is not None else None)
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

