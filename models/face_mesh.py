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
   pixels (Note [Sampling the frames where they lie]).
2. **Landmarks**, face presence score; **blendshapes**; **head pose**, and with the bundle the
   **transformation matrix** (float64: Note [Face geometry as MediaPipe computes it]); the **duplicate filter** (Note [The duplicate filter
   as tensors]): all on the device, batched, one fixed sequence of
   tensor operations (one CUDA graph with ``cuda_graphs``) that ends in one table.
3. The one transfer to the host, where only the :class:`Face` objects are made (Note [Measuring
   on the device]).

One copy to the device, one crop, one pass and one transfer to the host per call (Note
[Detection without per-frame work]); with
``cuda_graphs`` the pass after the crop is replayed from graphs (Note [CUDA graphs of the
pipeline]).
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
from facecast.models.face_geometry import FaceGeometry, head_pose_from_matrices, head_pose_on_host
from facecast.models.head_pose import head_pose_deg
from facecast.models.nms import drop_overlapping_batched, drop_overlapping_on_host

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


@functools.lru_cache(maxsize=32)
def _constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small constant tensor on the device, made once (as :func:`_indices`)."""
    with torch.inference_mode(False):
        return torch.tensor(values, device=device, dtype=dtype)


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
class PendingMeasure:
    """:meth:`FaceMeasurer.measure_start`'s work on its way: the host's copy of the device's
    (N, C) table (pinned; on the CPU the table itself) and the event of that copy (None on the
    CPU)."""

    frames: int
    owners: list[int]
    tracked: list[bool]
    host: torch.Tensor | None
    copied: torch.cuda.Event | None


@dataclass
class Measured:
    """What :meth:`FaceMeasurer.measure` found: the faces of each frame, and for each kept
    face its row in the measured table, whose boxes and landmarks the tracks keep (host arrays
    from the one transfer: Note [The next ROIs on the host], models/face_tracking.py)."""

    faces: list[list[Face]]
    rows: list[list[int]]
    boxes_host_px: np.ndarray | None  # (N, 4) float32
    landmarks_host_px: np.ndarray | None  # (N, 478, 3) float32

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
    low, high = mesh.amin(dim=1), mesh.amax(dim=1)
    side = (high - low).amax(dim=1, keepdim=True)
    offset = _constant(TRACKED_BOX_CENTER_OFFSET, mesh.device, mesh.dtype)
    centre = (low + high) / 2 + side * offset
    half = side * TRACKED_BOX_SIDE / 2
    return torch.cat([centre - half, centre + half], dim=1)


# Note [The CPU stack's results in numpy]
#     With FaceLandmarker's models in LiteRT on the CPU (FacePipeline's cpu_runtime "litert",
#     whose geometry is LAPACK's: FaceGeometry.on_host), FaceMeasurer.results_core computes what
#     follows the models in numpy: the landmarks' decoding and projection to the frame, the
#     blendshape model's input, the boxes and scores, the bounds the duplicate filter compares,
#     the transformation matrix and head pose (Note [Face geometry on the CPU in numpy]) and the
#     table, and the duplicate filter (nms.drop_overlapping_on_host, its steps in numpy). The
#     models and the presence's sigmoid stay as they are. A one-face frame took ~300 torch
#     calls there (the matrix's three fits 155 of them), a four-face frame ~400 (the filter's
#     steps 107), ~35 now (counted in `facecast analyze`, 2026-11-27), each 5-10 us of
#     dispatch on the 2-core machine, more in `facecast analyze`, whose landmark invoke leaves
#     the caches cold; numpy's calls cost 1-2 us. The same operations in the same order on the
#     same dtypes: the table is the tensors' (landmarks, boxes, scores and the filter's choice
#     exactly, the rest to float rounding: tests/models/test_batched_geometry.py runs both on
#     real faces; the bench's four tables were byte for byte the same). A GPU, graphs, and the
#     torch runtime on the CPU (which tests trace and capture as a GPU's graph would) keep the
#     tensor operations.


def _project_points_on_host(points_model_px: np.ndarray, rects: roi_mod.RotatedRects,
                            input_px: int) -> np.ndarray:
    """roi.project_points of (N, P, 3) points from a square input of ``input_px``, in numpy
    (Note [The CPU stack's results in numpy]); the rects' cosines and sines are torch's."""
    size = rects.size_wh_px.numpy()
    cos, sin = torch.cos(rects.rotation_rad).numpy()[:, None], torch.sin(rects.rotation_rad).numpy()[:, None]
    # Each coordinate as contiguous rows (N, 3, P): the same operations per element as on the
    # points' strided columns, in SIMD steps (Note [Landmark extents over a contiguous axis]).
    rows = np.ascontiguousarray(points_model_px.transpose(0, 2, 1))
    x = (rows[:, 0] / input_px - 0.5) * size[:, 0:1]
    y = (rows[:, 1] / input_px - 0.5) * size[:, 1:2]
    centre = rects.center_xy_px.numpy()
    image = np.empty(points_model_px.shape, np.result_type(x, cos, centre))
    image[..., 0] = cos * x - sin * y + centre[:, 0:1]
    image[..., 1] = sin * x + cos * y + centre[:, 1:2]
    image[..., 2] = rows[:, 2] * (size[:, 0:1] / input_px)  # z goes with x
    return image


def _boxes_from_landmarks_on_host(landmarks_px: np.ndarray, xy_rows: np.ndarray | None = None) -> np.ndarray:
    """:func:`boxes_from_landmarks` in numpy (Note [The CPU stack's results in numpy]);
    ``xy_rows``: the landmarks' roi.xy_rows_on_host, where made already."""
    if xy_rows is None:
        xy_rows = roi_mod.xy_rows_on_host(landmarks_px)
    low, high = roi_mod.xy_extents_on_host(xy_rows, NUM_MESH_POINTS)  # Note [Landmark extents over a contiguous axis]
    side = (high - low).max(axis=1, keepdims=True)
    centre = (low + high) / 2 + side * np.asarray(TRACKED_BOX_CENTER_OFFSET, landmarks_px.dtype)
    half = side * TRACKED_BOX_SIDE / 2
    return np.concatenate([centre - half, centre + half], axis=1)


# Two ROIs whose landmarks' bounds overlap by more than this converged on one face (a track and a
# detection): only the more present stays.
SAME_FACE_IOU = 0.5


def landmark_bounds(landmarks_px: torch.Tensor) -> torch.Tensor:
    """(N, 4) x1, y1, x2, y2: the bounds of each face's landmarks (N, 478, ≥2), all of them
    (what the duplicate filter compares)."""
    points = landmarks_px[..., :2]
    return torch.cat([points.amin(dim=1), points.amax(dim=1)], dim=1)


# Note [Measuring on the device]
#     Everything a Face holds is computed on the device, batched, in one fixed sequence of tensor
#     operations (:meth:`FaceMeasurer.results_core`), which with ``cuda_graphs`` is the mesh
#     stage's CUDA graph: landmarks, presence, blendshapes, box and score, head pose, the
#     transformation matrix (Note [Procrustes without a solver]), and
#     which faces the duplicate filter keeps in which order (Note [The duplicate filter as
#     tensors]). Nothing in it waits for the device or copies from the host
#     (tests/models/test_speed_paths.py runs it under a dispatch spy that fails on either). The
#     host's per-ROI facts (frame, tracked or not, the frame's size) go to the device in one copy
#     before; the results come back as one float32 (N, C) table, one copy after; the float64
#     columns (head pose and translation: MediaPipe's matrix is fitted in float64) travel bit for
#     bit as pairs of float32 columns (a view, not a conversion). On the host what is left is
#     slicing that table with numpy and making the Face objects of the kept faces. Issue 24's
#     profile of the per-face host work this replaces (Procrustes, head pose and the greedy
#     filter per face, in Python) was ~21 ms a batch of 64 faces on the H100's host, against
#     ~6 ms of GPU work.
#
#     A graph holds a power-of-two number of ROIs (MAX_GRAPH_FACES at most); the rows past the
#     call's own hold whatever the last call left and belong to no frame (frame -1), so that
#     the duplicate filter never compares them with a real face. The duplicate filter's number
#     of steps is fixed per graph too: the largest number of ROIs in one frame, rounded up to a
#     power of two and at least ``max_faces`` (the tracker never gives a frame more), so the
#     daemon meets one graph per bucket of faces. More ROIs than MAX_GRAPH_FACES, or than
#     warm_up prepared (Note [Warmed for the largest share]), are split
#     between whole frames (a frame's ROIs must be measured together for the filter); ROIs
#     whose frames are interleaved (only tests make those) then run eagerly.


LANDMARKERS = ("attention_mesh", "face_landmarker")
# The host's per-ROI table (FaceMeasurer.measure): frame, tracked (0/1), frame width and height px.
ROI_COLUMNS = 4
PADDING_ROI = (-1.0, 0.0, 1.0, 1.0)
# The measuring graph's packed per-ROI input (FaceMeasurer._mesh_graph): centre x, y, size w, h,
# rotation, the detection's box x1, y1, x2, y2, and its score.
PER_ROI_COLUMNS = 10


@dataclass(frozen=True)
class TableLayout:
    """Where each result lies in the measuring stage's (N, C) float32 table (Note [Measuring on
    the device]): column slices; ``wide`` holds float64 values as pairs of float32 columns."""

    landmarks: slice
    presence: int
    box: slice
    score: int
    kept: int
    rank: int
    blendshapes: slice | None
    matrix: slice | None
    wide: slice  # float64: yaw, pitch, roll (and translation x, y, z cm with the matrix)

    @classmethod
    def make(cls, with_blendshapes: bool, with_matrix: bool) -> "TableLayout":
        widths = {"landmarks": NUM_LANDMARKS * 3, "presence": 1, "box": 4, "score": 1, "kept": 1, "rank": 1,
                  "blendshapes": len(BLENDSHAPE_NAMES) if with_blendshapes else 0,
                  "matrix": 16 if with_matrix else 0, "wide": 2 * (6 if with_matrix else 3)}
        bounds = dict(zip(widths, np.cumsum([0] + list(widths.values()))[:-1].tolist()))
        span = {name: slice(bounds[name], bounds[name] + width) for name, width in widths.items()}
        return cls(span["landmarks"], bounds["presence"], span["box"], bounds["score"], bounds["kept"],
                   bounds["rank"], span["blendshapes"] if with_blendshapes else None,
                   span["matrix"] if with_matrix else None, span["wide"])

    @property
    def columns(self) -> int:
        return self.wide.stop


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
        self.layout = TableLayout.make(blendshapes is not None, geometry is not None)
        # The most ROIs one pass on a GPU takes, once warm_up has prepared them (Note [Warmed for
        # the largest share]): more are split between whole frames. None: MAX_GRAPH_FACES.
        self.warmed_faces: int | None = None
        # The host's share of the last measure(): from the one transfer's arrival to the Face
        # objects (bench/models.py reports it).
        self.last_host_work_s = 0.0

    # -- the device's part ------------------------------------------------------------------------

    def measure(self, batch, owners: list[int], rects: roi_mod.RotatedRects, roi_boxes: torch.Tensor,
                roi_scores: torch.Tensor, tracked: list[bool]) -> Measured:
        """Mesh, head pose and blendshapes for every ROI of every frame, in one batch.

        owners: the frame of each ROI; roi_boxes / roi_scores: the detection's box and score
        (used for faces that were detected, not tracked); tracked: whether each ROI came from a
        track (its box then comes from its landmarks, its score is the mesh's presence).
        """
        return self.measure_finish(self.measure_start(batch, owners, rects, roi_boxes, roi_scores,
                                                      tracked))

    def measure_start(self, batch, owners: list[int], rects: roi_mod.RotatedRects,
                      roi_boxes: torch.Tensor, roi_scores: torch.Tensor,
                      tracked: list[bool]) -> PendingMeasure:
        """:meth:`measure`'s device work, queued with the copy of its results to the host;
        nothing waits for it until :meth:`measure_finish` (Note [Reading while the device
        measures])."""
        frames = len(batch)
        if not owners:
            return PendingMeasure(frames, owners, tracked, None, None)
        table = self.measure_on_device(batch, owners, rects, roi_boxes, roi_scores, tracked)
        if table.device.type != "cuda":
            return PendingMeasure(frames, owners, tracked, table, None)
        # Queued on the stream before anything later: a graph's output table, which the next
        # replay rewrites, is read here first (Note [The graph's table read in place]).
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        copied = torch.cuda.Event(blocking=True)  # the host sleeps on it, rather than spin
        copied.record()
        return PendingMeasure(frames, owners, tracked, host, copied)

    def measure_finish(self, pending: PendingMeasure) -> Measured:
        """The faces of :meth:`measure_start`'s work: the one wait for the device."""
        if not pending.owners:
            return Measured.nothing(pending.frames)
        if pending.copied is not None:
            pending.copied.synchronize()
        host = pending.host.numpy()
        host_start_s = time.perf_counter()
        faces, rows = self._faces(host, np.asarray(pending.owners), pending.tracked, pending.frames)
        self.last_host_work_s = time.perf_counter() - host_start_s
        return Measured(faces, rows, host[:, self.layout.box],
                        host[:, self.layout.landmarks].reshape(len(pending.owners), NUM_LANDMARKS, 3))

    def measure_on_device(self, batch, owners: list[int], rects: roi_mod.RotatedRects, roi_boxes: torch.Tensor,
                          roi_scores: torch.Tensor, tracked: list[bool]) -> torch.Tensor:
        """The device's part of :meth:`measure`: the (N, C) float32 table of :attr:`layout`,
        queued on the device (nothing here waits for it: Note [Measuring on the device])."""
        owner = np.asarray(owners)
        largest = int(np.bincount(owner).max())
        # The duplicate filter's steps: a graph's constant (and on a GPU the kernel's compiled
        # one), one bucket for every batch up to max_faces; eagerly on the CPU the largest
        # frame's, which gives the same answer in fewer operations (none for one face a frame).
        fixed = self.device.type == "cuda" or self.graphs.replays("mesh")
        group_steps = bucket(max(self.max_faces, largest)) if fixed else largest
        chunks = self._chunks(owner)
        # One host-to-device copy of the per-ROI facts, each chunk's rows padded to its graph.
        sizes_wh = np.asarray(batch.sizes_hw, np.float32)[:, ::-1]
        padded = [self._rows_for(stop - start) for start, stop in chunks]
        roi_host = np.tile(np.asarray(PADDING_ROI, np.float32), (sum(padded), 1))
        starts = np.cumsum([0] + padded)[:-1]
        for (start, stop), first in zip(chunks, starts):
            rows = slice(first, first + stop - start)
            roi_host[rows, 0] = owner[start:stop]
            roi_host[rows, 1] = np.asarray(tracked[start:stop], np.float32)
            roi_host[rows, 2:] = sizes_wh[owner[start:stop]]
        if len(chunks) == 1 and self.graphs.replays("mesh") and padded[0] <= self._chunk_faces():
            table = self._table_graphed_from_frames(batch, roi_host, rects, roi_boxes, roi_scores, group_steps)
            if table is not None:
                return table
        # The crops' frame index (every ROI, in order) travels in the same copy.
        uploaded = roi_mod.from_host(np.concatenate([roi_host.ravel(), owner.astype(np.float32)]), self.device)
        roi_table = uploaded[:roi_host.size].view(roi_host.shape)
        frame_index = uploaded[roi_host.size:].long()
        crops = roi_mod.crop_rois(batch, frame_index, rects, self.input_px, border="replicate",
                                  dtype=self.model_dtype, from_bytes=True)
        if len(chunks) == 1 and padded[0] == len(owners):  # one chunk of every ROI, as they are
            return self._chunk_table(crops, rects, roi_table, roi_boxes, roi_scores, group_steps)
        parts = [self._chunk_table(crops[start:stop], rects[start:stop], roi_table[first:first + rows],
                                   roi_boxes[start:stop], roi_scores[start:stop], group_steps)
                 for (start, stop), first, rows in zip(chunks, starts, padded)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _rows_for(self, count: int) -> int:
        """The rows a chunk of ``count`` ROIs runs as: on a GPU a power of two (its graph's, at
        most :meth:`_chunk_faces`; in eager mode the batch bucket: Note [Warm shapes])."""
        return bucket(count) if self.device.type == "cuda" or self.graphs.replays("mesh") else count

    def _chunk_faces(self) -> int:
        """The most ROIs one pass takes on a GPU or from a graph: what warm_up prepared (Note
        [Warmed for the largest share]), at most MAX_GRAPH_FACES."""
        return min(self.warmed_faces or MAX_GRAPH_FACES, MAX_GRAPH_FACES)

    def _chunks(self, owner: np.ndarray) -> list[tuple[int, int]]:
        """The ROIs as (start, stop) runs of whole frames of at most :meth:`_chunk_faces` each,
        or one run of all on the CPU without graphs or where the frames' ROIs interleave (Note
        [Measuring on the device])."""
        count, most = owner.shape[0], self._chunk_faces()
        if count <= most or (self.device.type != "cuda" and not self.graphs.replays("mesh")):
            return [(0, count)]
        frame_starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        if len(frame_starts) != len(np.unique(owner)):
            return [(0, count)]
        chunks, start = [], 0
        for frame_start, frame_stop in zip(frame_starts, np.r_[frame_starts[1:], count]):
            if frame_stop - start > most and frame_start > start:
                chunks.append((start, int(frame_start)))
                start = int(frame_start)
        chunks.append((start, count))
        return chunks if all(stop - begin <= most for begin, stop in chunks) else [(0, count)]

    def _chunk_table(self, crops: torch.Tensor, rects: roi_mod.RotatedRects, roi_table: torch.Tensor,
                     roi_boxes: torch.Tensor, roi_scores: torch.Tensor, group_steps: int) -> torch.Tensor:
        """:meth:`results_core` of ``count`` ROIs, ``roi_table`` padded to the rows they run as:
        replayed from the mesh stage's graph where graphs are on (and a chunk fits one),
        else eagerly."""
        count, rows = crops.shape[0], roi_table.shape[0]
        if self.graphs.replays("mesh") and rows <= self._chunk_faces():
            table = self._table_graphed(crops, rects, roi_table, roi_boxes, roi_scores, group_steps)
            if table is not None:
                return table
        if rows != count:  # padded with copies of the first ROI (real values: no degenerate rect in the models)
            index = torch.cat([torch.arange(count, device=crops.device),
                               torch.zeros(rows - count, dtype=torch.long, device=crops.device)])
            crops, rects, roi_boxes, roi_scores = crops[index], rects[index], roi_boxes[index], roi_scores[index]
        return self.results_core(crops, rects, roi_table, roi_boxes, roi_scores, group_steps)[:count]

    def results_core(self, crops: torch.Tensor, rects: roi_mod.RotatedRects, roi_table: torch.Tensor,
                     roi_boxes: torch.Tensor, roi_scores: torch.Tensor, group_steps: int) -> torch.Tensor:
        """The measuring stage proper, a fixed sequence of tensor operations (what a CUDA graph
        captures; Note [Measuring on the device]): the models, then every result of every ROI in
        one (N, C) float32 table of :attr:`layout`.

        roi_table (N, 4): frame (-1: a padding row), tracked (0/1), frame width and height px;
        roi_boxes (N, 4) / roi_scores (N,): the detection's box and score (for detected faces);
        group_steps: at least the most ROIs of one frame (:func:`nms.drop_overlapping_batched`).
        """
        if self.results_on_host:  # Note [The CPU stack's results in numpy]
            return self._results_on_host(crops, rects, roi_table, roi_boxes, roi_scores, group_steps)
        landmarks, presence, blendshapes = self.landmarks_core(crops, rects)
        owner, is_tracked, frame_wh = roi_table[:, 0], roi_table[:, 1] > 0, roi_table[:, 2:4]
        boxes = torch.where(is_tracked[:, None], boxes_from_landmarks(landmarks), roi_boxes.float())
        scores = torch.where(is_tracked, presence, roi_scores.float())
        count = landmarks.shape[0]
        # Two ROIs that converged on one face (a track and a detection): the more present stays.
        # Padding rows are frame -1: never compared with a real face.
        kept, rank = drop_overlapping_batched(
            landmark_bounds(landmarks), presence, owner, presence >= self.min_presence,
            SAME_FACE_IOU, self.max_faces, max_group_size=group_steps)
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

    @property
    def results_on_host(self) -> bool:
        """Whether :meth:`results_core` computes in numpy (Note [The CPU stack's results in
        numpy]): FaceLandmarker's models in LiteRT on the CPU, whose geometry is LAPACK's
        (FaceGeometry.on_host), which no graph captures and nothing traces."""
        return (self.landmarker == "face_landmarker" and self.blendshapes is not None
                and self.geometry is not None and self.geometry.on_host(self.device)
                and not self.graphs.enabled)

    def _results_on_host(self, crops: torch.Tensor, rects: roi_mod.RotatedRects, roi_table: torch.Tensor,
                         roi_boxes: torch.Tensor, roi_scores: torch.Tensor, group_steps: int) -> torch.Tensor:
        """:meth:`results_core` in numpy, the same table (Note [The CPU stack's results in
        numpy]): the models and the duplicate filter as they are, the rest step for step."""
        count = crops.shape[0]
        landmarks, presence, blendshapes = self.landmarks_on_host(crops, rects)
        table = roi_table.numpy()
        owner, is_tracked, frame_wh = table[:, 0], table[:, 1] > 0, table[:, 2:4]
        xy_rows = roi_mod.xy_rows_on_host(landmarks)  # Note [Landmark extents over a contiguous axis]
        boxes = np.where(is_tracked[:, None], _boxes_from_landmarks_on_host(landmarks, xy_rows),
                         roi_boxes.numpy().astype(np.float32, copy=False))
        scores = np.where(is_tracked, presence, roi_scores.numpy().astype(np.float32, copy=False))
        bounds = np.concatenate(roi_mod.xy_extents_on_host(xy_rows), axis=1)  # landmark_bounds
        kept, rank = drop_overlapping_on_host(bounds, presence, owner, presence >= self.min_presence, SAME_FACE_IOU,
                                              self.max_faces, max_group_size=group_steps)
        matrices = self.geometry.matrices_on_host(landmarks, frame_wh)  # Note [Face geometry on the CPU in numpy]
        wide = np.concatenate([head_pose_on_host(matrices), matrices[:, :3, 3]], axis=1)
        return torch.from_numpy(np.concatenate([
            landmarks.reshape(count, -1), presence[:, None], boxes, scores[:, None],
            kept[:, None].astype(np.float32), rank[:, None].astype(np.float32), blendshapes,
            matrices.reshape(count, 16).astype(np.float32), np.ascontiguousarray(wide).view(np.float32)],
            axis=1, dtype=np.float32))

    def landmarks_on_host(self, crops: torch.Tensor, rects: roi_mod.RotatedRects
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`landmarks_core` as numpy arrays, for :meth:`_results_on_host` (Note [The CPU
        stack's results in numpy]): the models, the landmarks decoded and projected, the
        presence, the blendshapes."""
        count = crops.shape[0]
        raw_landmarks, presence_logit, *_ = self.mesh(crops)
        if raw_landmarks[0].numel() != NUM_LANDMARKS * 3:  # refused with face_landmarker.decode's reason
            face_landmarker.decode((raw_landmarks, presence_logit))
        presence = torch.sigmoid(presence_logit.reshape(count).float()).numpy()
        landmarks = _project_points_on_host(raw_landmarks.numpy().reshape(count, NUM_LANDMARKS, 3), rects,
                                            self.input_px)
        # float32 (Note [Blendshapes in float32]); the model's input as blendshapes.model_input cuts it.
        (scores, *_) = self.blendshapes(torch.from_numpy(np.ascontiguousarray(
            landmarks[:, blendshapes_mod.LANDMARK_SUBSET, :2])))
        return landmarks, presence, scores.numpy().reshape(count, len(blendshapes_mod.BLENDSHAPE_NAMES))

    def _table_graphed(self, crops: torch.Tensor, rects: roi_mod.RotatedRects, roi_table: torch.Tensor,
                       roi_boxes: torch.Tensor, roi_scores: torch.Tensor, group_steps: int) -> torch.Tensor | None:
        """:meth:`results_core` of crops made before, replayed from a CUDA graph (Note [CUDA
        graphs of the pipeline]); None when the stage cannot be captured."""
        count, rows = crops.shape[0], roi_table.shape[0]
        captured = self._mesh_graph(rows, group_steps)
        if captured is None:
            return None
        statics = captured.statics
        statics["crops"][:count].copy_(crops)
        statics["roi_table"].copy_(roi_table)  # padding rows included: frame -1
        return self._replay(captured, count, rects, roi_boxes, roi_scores)

    def _table_graphed_from_frames(self, batch, roi_host: np.ndarray, rects: roi_mod.RotatedRects,
                                   roi_boxes: torch.Tensor, roi_scores: torch.Tensor,
                                   group_steps: int) -> torch.Tensor | None:
        """:meth:`_table_graphed` of one chunk with the host's ROI table as it is padded (Note
        [Measuring on the device]), the graph's inputs written where it reads them: the ROI
        table copied from the host into its static, the crops cut into theirs, the frames'
        indices read from the table's first column (no copies between)."""
        count, rows = len(rects), roi_host.shape[0]
        captured = self._mesh_graph(rows, group_steps)
        if captured is None:
            return None
        statics = captured.statics
        roi_mod.copy_from_host(roi_host, statics["roi_table"])
        roi_mod.crop_rois(batch, statics["roi_table"][:count, 0], rects, self.input_px, border="replicate",
                          dtype=self.model_dtype, out=statics["crops"][:count], from_bytes=True)
        return self._replay(captured, count, rects, roi_boxes, roi_scores)

    def _mesh_graph(self, rows: int, group_steps: int):
        """The measuring stage's graph for ``rows`` ROIs (cuda_graphs.Captured; None when the
        stage cannot be captured). Its static inputs: the crops, the ROI table, and the ROIs'
        rects, boxes and scores packed in one float32 table (PER_ROI_COLUMNS), one copy a call."""
        def build():
            per_roi = torch.zeros(rows, PER_ROI_COLUMNS, device=self.device)
            statics = {
                "crops": torch.zeros(rows, self.input_px, self.input_px, 3, dtype=self.model_dtype,
                                     device=self.device),
                "roi_table": torch.tensor([PADDING_ROI] * rows, device=self.device),
                "per_roi": per_roi,
            }
            static_rects = roi_mod.RotatedRects(per_roi[:, 0:2], per_roi[:, 2:4], per_roi[:, 4])
            return (lambda: self.results_core(statics["crops"], static_rects, statics["roi_table"],
                                              per_roi[:, 5:9], per_roi[:, 9], group_steps)), statics

        return self.graphs.get("mesh", (rows, self.model_dtype, group_steps), build)

    @staticmethod
    def _replay(captured, count: int, rects: roi_mod.RotatedRects, roi_boxes: torch.Tensor,
                roi_scores: torch.Tensor) -> torch.Tensor:
        """The ROIs' rects, boxes and scores into the graph's packed static (one pass), the
        replay, and the table's first ``count`` rows as they lie in the graph's output.

        Note [The graph's table read in place]
            The next replay of the same graph rewrites its output table, and a copy of the
            rows (a kernel a batch) once kept them safe. Their one reader is the copy to the
            host that measure_start queues right after, on the same stream, so it runs before
            any later replay: no copy is needed, and nothing else keeps the device table (the
            tracks keep the host's arrays since Note [The next ROIs on the host]). Where the
            graphs' bookkeeping runs on the CPU (tests), the table is the host's result itself,
            read after the next batch has started: there it is copied."""
        torch.cat([rects.center_xy_px.float(), rects.size_wh_px.float(), rects.rotation_rad.float()[:, None],
                   roi_boxes.float(), roi_scores.float()[:, None]], dim=1, out=captured.statics["per_roi"][:count])
        table = captured.replay()[:count]
        return table if table.is_cuda else table.clone()

    # -- the host's part ----------------------------------------------------------------------------

    def _faces(self, host: np.ndarray, owner: np.ndarray, tracked: list[bool], frames: int
               ) -> tuple[list[list[Face]], list[list[int]]]:
        """The Face objects of the kept faces and their rows, per frame, from the table of
        :meth:`measure_on_device` (Note [Measuring on the device]): numpy slices of the one
        table; Python only to make the objects."""
        layout = self.layout
        count = host.shape[0]
        rows = np.flatnonzero(host[:, layout.kept] > 0)
        rows = rows[np.lexsort((host[rows, layout.rank], owner[rows]))]  # per frame, best first
        landmarks = np.ascontiguousarray(host[:, layout.landmarks]).reshape(count, NUM_LANDMARKS, 3)
        blendshapes = (np.ascontiguousarray(host[:, layout.blendshapes]) if layout.blendshapes is not None
                       else [None] * count)
        matrices = (np.ascontiguousarray(host[:, layout.matrix]).reshape(count, 4, 4) if layout.matrix is not None
                    else [None] * count)
        wide = np.ascontiguousarray(host[rows, layout.wide]).view(np.float64)
        poses = map(tuple, wide[:, :3].tolist())
        translations = map(tuple, wide[:, 3:6].tolist()) if layout.matrix is not None else [None] * len(rows)
        frame_of_row = owner[rows].tolist()
        faces_per_frame: list[list[Face]] = [[] for _ in range(frames)]
        rows_per_frame: list[list[int]] = [[] for _ in range(frames)]
        for k, frame, box, score, presence, pose, translation in zip(
                rows.tolist(), frame_of_row, map(tuple, host[rows, layout.box].tolist()),
                host[rows, layout.score].tolist(), host[rows, layout.presence].tolist(), poses, translations):
            faces_per_frame[frame].append(Face(box, score, landmarks[k], pose, presence, blendshapes[k], tracked[k],
                                               matrices[k], translation))
            rows_per_frame[frame].append(k)
        return faces_per_frame, rows_per_frame

    # -- warm-up and the models -------------------------------------------------------------------

    def warm_up(self, max_faces: int) -> None:
        """On a GPU, run every batch bucket of up to ``max_faces`` faces once, captured as graphs
        where they are on (Note [Warm shapes]), with the duplicate
        filter's steps of frames of up to ``max_faces`` ROIs (Note [Measuring on the device])."""
        count = min(max_faces, MAX_GRAPH_FACES)
        if count >= 1 and (self.device.type == "cuda" or self.graphs.enabled):
            crops = torch.zeros(count, self.input_px, self.input_px, 3, dtype=self.model_dtype,
                                device=self.device)
            rects = roi_mod.RotatedRects(torch.zeros(count, 2, device=self.device),
                                         torch.full((count, 2), 100.0, device=self.device),
                                         torch.zeros(count, device=self.device))
            boxes, scores = torch.zeros(count, 4, device=self.device), torch.ones(count, device=self.device)
            for faces_in_bucket in buckets_up_to(count, MAX_GRAPH_FACES):
                roi_table = torch.tensor([PADDING_ROI] * faces_in_bucket, device=self.device)
                roi_table[:, 0] = torch.arange(faces_in_bucket, device=self.device)  # a frame each
                self._chunk_table(crops[:faces_in_bucket], rects[:faces_in_bucket], roi_table,
                                  boxes[:faces_in_bucket], scores[:faces_in_bucket], bucket(self.max_faces))
            self.warmed_faces = bucket(count, MAX_GRAPH_FACES)

    def landmarks_core(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        """(landmarks (N, 478, 3) px, presence (N,), blendshapes (N, 52) or None) of the crops:
        the models and their decoding, a fixed sequence of tensor operations (part of
        :meth:`results_core`)."""
        if self.landmarker == "face_landmarker":
            landmarks_model, presence = face_landmarker.decode(self.mesh(crops))
        else:
            landmarks_model, presence = refine_attention_mesh(self.mesh(crops))
        landmarks = roi_mod.project_points(landmarks_model, rects, self.input_px)
        # float32 even with half=True (Note [Blendshapes in float32]).
        blendshapes = (blendshapes_mod.blendshapes(self.blendshapes, landmarks)
                       if self.blendshapes is not None else None)
        return landmarks, presence, blendshapes
