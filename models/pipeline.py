"""FacePipeline: detection → rotated ROI → 478-point attention mesh → head pose → blendshapes,
batched over frames and faces, with landmark-driven tracking per camera (DESIGN §3).

Stages, each one batched over every frame (and tile, and face) of a call:

1. **Detection** (:meth:`FacePipeline.detect`). MediaPipe's short-range detector on each whole
   frame, letterboxed to 128x128, exactly as MediaPipe's FaceMesh/FaceDetection run it; and the
   full-range detector (192x192) on each whole frame and on overlapping square tiles of frames
   larger than a tile, which finds the small faces (down to ~70 px in 1080p) the short-range
   detector misses. Weighted NMS per source; a full-range detection is kept only where no
   short-range detection overlaps it, so that wherever MediaPipe finds a face, facecast's box is
   MediaPipe's box.
2. **ROI** (:mod:`facecast.models.roi`): square, 1.5x the box, rotated by the eye line.
3. **Warp**: every ROI of every frame cropped to 192x192 in one bilinear gather from the frames'
   uint8 pixels (Note [Sampling the frames where they lie] in :mod:`facecast.models.roi`).
4. **Mesh**: ``face_landmark_with_attention`` (468 mesh points refined by its lips, eyes and iris
   heads into MediaPipe's 478 landmarks, see :func:`refine_attention_mesh`), face presence score.
5. **Head pose** (:mod:`facecast.models.head_pose`), **blendshapes** (from the 146-landmark subset,
   only when the user gives ``face_landmarker.task``).
6. **Tracking** (:meth:`FacePipeline.track`): per camera, the next frame's ROIs come from this
   frame's landmarks (MediaPipe's face_landmarks_to_roi); the detector runs only when a camera
   has no face, lost one, or every ``detect_interval_frames`` frames to pick up newcomers.

No stage loops over frames, tiles or faces in Python or waits for the device before its end
(Note [Detection without per-frame work]); with ``cuda_graphs=True`` detection and the mesh stage
are replayed from CUDA graphs (Note [CUDA graphs of the pipeline]), with ``half=True`` the models
run in float16. ``bench/models.py`` measures these paths.

Outputs are in the pixels of each input frame; landmark z is on the scale of x (pixels), negative
toward the camera, relative to the face's centre of mass as in MediaPipe.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from facecast.models import anchors as anchors_mod
from facecast.models import roi as roi_mod
from facecast.models import tflite_convert, tflite_ops
from facecast.models.head_pose import head_pose_deg
from facecast.models.nms import Detections, box_iou, weighted_nms

log = logging.getLogger(__name__)

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
    pose_landmarks: np.ndarray | None = None  # (33, 4) x, y px, z, visibility (not yet produced)
    tracked: bool = False  # True when the ROI came from the previous frame's landmarks


@dataclass
class _Track:
    landmarks_px: torch.Tensor  # (478, 3), on the pipeline's device
    box_px: torch.Tensor  # (4,)


@dataclass
class _CameraState:
    tracks: list[_Track] = field(default_factory=list)
    frames_since_detection: int = 0
    lost_face: bool = False


@dataclass
class _Measured:
    """What :meth:`FacePipeline._measure` found: the faces of each frame, and for each kept
    face its row in the device tensors (which the tracks keep, without a copy back)."""

    faces: list[list[Face]]
    rows: list[list[int]]
    landmarks_px: torch.Tensor | None  # (N, 478, 3)
    boxes_px: torch.Tensor | None  # (N, 4)


# Note [Detection without per-frame work]
#     Which inputs a detector gets (each frame's letterbox, and for the full-range detector the
#     frame's tiles), which frame each input belongs to, where its tile's borders lie inside the
#     frame, and how the inputs of one frame pool into one NMS row: all of it depends only on the
#     frames' sizes. It is worked out once per list of sizes, on the host, and kept on the device
#     (:class:`_DetectorPlan`, cached). A detection pass is then a fixed sequence of batched
#     tensor operations (crops, forward, decode, the tile-border test, pooling, weighted NMS, the
#     merge of the two detectors, top-k) with no Python loop over frames, tiles or faces and no
#     wait for the device, until one transfer of the per-frame counts at the end. Measuring is the
#     same: one crop, one mesh pass, one transfer of everything the Face objects need. This is
#     also what lets a CUDA graph replay the stages (Note [CUDA graphs of the pipeline]).
#
# Note [CUDA graphs of the pipeline]
#     With ``cuda_graphs=True`` the two fixed-shape stages are captured once per shape and then
#     replayed, which removes the launch of each of their ~1,000 (detection) and ~400 (mesh)
#     kernels from the host:
#     - detection (crops, both detectors, decode, NMS, merge) for B frames of one size, B rounded
#       up to a power of two (at most MAX_GRAPH_FRAMES per graph; more frames are split); its
#       input is a static uint8 frame buffer that the call's frames are copied into;
#     - the mesh stage (mesh model, refinement, projection, blendshapes) for N faces rounded up to
#       a power of two (at most MAX_GRAPH_FACES per graph); its inputs are the crops and rects.
#     Padding rows hold stale data and their results are dropped. Outputs are copied out of the
#     graph's static tensors before anything else replays, which is what lets all graphs of a
#     pipeline share one memory pool (replays never overlap: one stream, one caller). A stage
#     whose capture fails (an operation in it copies from host memory or waits for the device)
#     runs eagerly from then on; the reason is logged and kept in ``graph_fallbacks``. Frames of
#     different sizes in one call run eagerly too. Head pose (float64) and the Face objects are
#     computed after the replay, eagerly.
#
# Note [Warm shapes]
#     On the H200 (torch 2.11, CUDA 13) the first detection pass over a new number of frames took
#     3.7-4.2 s, the first mesh pass over a new number of faces ~1.5 s (the GPU libraries preparing
#     that shape; the same with or without channels_last weights); later passes ~10 ms. In the
#     daemon the batch sizes change all the time (cameras due for detection, faces in view), so
#     eager passes kept stalling for seconds. The graphs' power-of-two buckets bound the shapes,
#     and ``warm_up`` runs every bucket a worker can meet once, at boot (or in a warm standby),
#     before any camera waits on it. The pose models pad their batches the same way
#     (models/pose.py, BatchBuckets and PosePipeline.warm_up).
MAX_GRAPH_FRAMES = 32
MAX_GRAPH_FACES = 256
_PLAN_CACHE_SIZE = 32
_NO_CUT = (-math.inf, -math.inf, math.inf, math.inf)
TILE_BORDER_MARGIN_PX = 4.0


@dataclass
class _DetectorPlan:
    """Where one detector looks in frames of known sizes (Note [Detection without per-frame work])."""

    rects: roi_mod.RotatedRects  # (R,) model inputs: per frame its letterbox, then its tiles
    owner: torch.Tensor  # (R,) long: position of the input's frame among the planned frames
    cut_edges_px: torch.Tensor  # (R, 4): see _cut_by_tile_border
    pool_rows: torch.Tensor  # (F, W) long: each frame's inputs, then padding (input 0)
    pool_used: torch.Tensor  # (F, W) bool: False on padding


ModelLoader = Callable[[str], torch.nn.Module]


def _default_loader(name: str) -> torch.nn.Module:
    """Load a MediaPipe model as a torch module (the installer/converter of facecast.models)."""
    from facecast.models import assets

    return tflite_convert.convert(assets.model_path(name))


class FacePipeline:
    """Faces of a batch of frames.

    ``pipeline(frames)`` detects in every frame (stateless); ``pipeline.track(frames,
    camera_ids)`` keeps per-camera tracks and detects only when needed. ``frames`` is a list of
    HxWx3 uint8 BGR numpy arrays (sizes may differ) or a uint8 tensor (B, H, W, 3), BGR, on any
    device (it is moved to ``device``).

    Speed options (both off by default; results agree with the float32 eager path within the
    tolerances of tests/models/test_speed_paths.py):

    - ``half=True`` runs the models in float16 (crop sampling, geometry, decoding, NMS and head
      pose stay in float32/float64); CUDA devices only.
    - ``cuda_graphs=True`` replays detection and the mesh stage as CUDA graphs (Note [CUDA graphs
      of the pipeline]); CUDA devices only. ``graph_fallbacks`` names the stages that could not
      be captured, and why.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        max_faces: int = 4,
        *,
        use_tiles: bool = True,
        tile_px: int = 720,
        tile_overlap_px: int = 200,
        min_presence: float = 0.5,
        detect_interval_frames: int = 15,
        face_landmarker_task: str | Path | None = None,
        frames_are_bgr: bool = True,
        load_model: ModelLoader = _default_loader,
        half: bool = False,
        cuda_graphs: bool = False,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("FacePipeline(device='cuda'): torch sees no CUDA device; use device='cpu'")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, not {self.device}")
        if half and self.device.type != "cuda":
            # Seen with torch 2.13's CPU kernels: float16 is several times slower than float32,
            # and grid_sample (the attention mesh's TransformTensorBilinear) sometimes returns NaN.
            raise ValueError(f"half=True is for CUDA devices, not {self.device}: the CPU's float16 kernels are "
                             "slower than float32 and not reliable")
        if max_faces < 1:
            raise ValueError(f"max_faces must be at least 1, got {max_faces}")
        self.max_faces = max_faces
        self.use_tiles = use_tiles
        self.tile_px = tile_px
        self.tile_overlap_px = tile_overlap_px
        self.min_presence = min_presence
        self.detect_interval_frames = detect_interval_frames
        self.frames_are_bgr = frames_are_bgr
        self.half = half
        self.model_dtype = torch.float16 if half else torch.float32
        self.cuda_graphs = cuda_graphs

        self.short_range = self._prepare(load_model(anchors_mod.FACE_SHORT_RANGE.name))
        self.full_range = self._prepare(load_model(anchors_mod.FACE_FULL_RANGE.name)) if use_tiles else None
        self.mesh = self._prepare(load_model("face_landmark_with_attention"))
        self.anchors = {
            spec.name: anchors_mod.generate_anchors(spec.anchors).to(self.device)
            for spec in (anchors_mod.FACE_SHORT_RANGE, anchors_mod.FACE_FULL_RANGE)
        }
        self.blendshapes = None
        self.blendshapes_unavailable_reason = "no face_landmarker.task given"
        if face_landmarker_task is not None:
            self.blendshapes = self._load_blendshapes(Path(face_landmarker_task))
        self._cameras: dict[Hashable, _CameraState] = {}
        self._plans: OrderedDict[tuple, tuple[_DetectorPlan, _DetectorPlan | None]] = OrderedDict()
        self._graphs: dict[tuple, _Captured] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self._capture: Callable[..., _Captured] = _Captured  # tests replace it to run the graph logic on the CPU
        self.graph_fallbacks: dict[str, str] = {}

    def _prepare(self, module: torch.nn.Module) -> torch.nn.Module:
        """A loaded model, ready to run here: zero PADs folded into their convolutions, on the
        device, in the model dtype, eval mode; on CUDA with channels_last convolution weights (the
        activations already are: Note [Batch and layout]), which spares cuDNN a weight reorder
        per call. (On the CPU that measured no faster, so the weights stay as they are.)"""
        if isinstance(module, tflite_convert.TFLiteModule):
            tflite_convert.fuse_zero_padding(module)
        module = module.to(self.device, dtype=self.model_dtype).eval()
        if self.device.type == "cuda":
            for conv in module.modules():
                if isinstance(conv, tflite_ops.Conv2d):
                    conv.weight = conv.weight.contiguous(memory_format=torch.channels_last)
        return module

    def _from_host(self, values) -> torch.Tensor:
        """A small table from the host on the device, copied without waiting for the device's
        queued work (pinned, non-blocking; the caching host allocator keeps the pinned buffer
        until the copy is done)."""
        table = torch.as_tensor(np.asarray(values))
        if self.device.type == "cuda":
            return table.pin_memory().to(self.device, non_blocking=True)
        return table

    # -- public API ------------------------------------------------------------------------------

    @torch.inference_mode()
    def __call__(self, frames) -> list[list[Face]]:
        batch = roi_mod.FrameBatch(frames, self.device, bgr=self.frames_are_bgr)
        detections = self.detect(batch)
        owners = [i for i, (boxes, _, _) in enumerate(detections) for _ in range(boxes.shape[0])]
        if not owners:
            return [[] for _ in detections]
        boxes = torch.cat([d[0] for d in detections])
        keypoints = torch.cat([d[1] for d in detections])
        scores = torch.cat([d[2] for d in detections])
        rects = roi_mod.rects_from_detections(boxes, keypoints)
        return self._measure(batch, owners, rects, boxes, scores, [False] * len(owners)).faces

    @torch.inference_mode()
    def track(self, frames, camera_ids: Sequence[Hashable], detections=None) -> list[list[Face]]:
        """Like calling the pipeline, but with per-camera tracking state (one frame per camera
        per call, in ``camera_ids`` order).

        ``detections``: None to run the detector here whenever a camera needs it; or, when
        detection runs elsewhere (the daemon's detection worker), a dict from frame index to
        that frame's (boxes, keypoints, scores) as :meth:`detect` returns them, used to add
        new faces to the tracks (:meth:`wants_detection` says which cameras should get one).
        """
        batch = roi_mod.FrameBatch(frames, self.device, bgr=self.frames_are_bgr)
        if len(camera_ids) != len(batch):
            raise ValueError(f"{len(batch)} frames but {len(camera_ids)} camera ids")
        states = [self._cameras.setdefault(cam, _CameraState()) for cam in camera_ids]
        if detections is None:
            detect_frames = [i for i, cam in enumerate(camera_ids) if self.wants_detection(cam)]
            det_by_frame = dict(zip(detect_frames, self.detect(batch, detect_frames) if detect_frames else []))
        else:
            det_by_frame = dict(detections)

        # Every track of every frame, and every detection, each as one batch (Note [Detection
        # without per-frame work]).
        tracks = [track for state in states for track in state.tracks]
        track_owner = [i for i, state in enumerate(states) for _ in state.tracks]
        det_frames = [i for i in sorted(det_by_frame) if det_by_frame[i][0].shape[0]]
        det_owner = [i for i in det_frames for _ in range(det_by_frame[i][0].shape[0])]
        if det_owner:
            det_boxes, det_keypoints, det_scores = (
                torch.cat([det_by_frame[i][part] for i in det_frames]).to(self.device, torch.float32)
                for part in range(3))
        if tracks:
            track_landmarks = torch.stack([t.landmarks_px for t in tracks])
            track_boxes = torch.stack([t.box_px for t in tracks])
        # A detection of a face that is already tracked is dropped: the track's ROI is the
        # better one (it follows the mesh, not a coarse box).
        if det_owner and tracks:
            same_frame = self._from_host(np.equal.outer(det_owner, track_owner))
            overlaps = ((box_iou(det_boxes, track_boxes) * same_frame).amax(dim=1) > 0.3).tolist()
        else:
            overlaps = [False] * len(det_owner)

        owners, sources, tracked = [], [], []  # per ROI: frame, row in cat(tracks, detections), tracked?
        track_row = det_row = 0
        for i, state in enumerate(states):
            for _ in state.tracks:
                owners.append(i)
                sources.append(track_row)
                tracked.append(True)
                track_row += 1
            if i in det_by_frame:
                frame_rois = len(state.tracks)
                first = det_row
                while det_row < len(det_owner) and det_owner[det_row] == i:
                    det_row += 1
                for row in range(first, det_row):
                    if overlaps[row]:
                        continue
                    if frame_rois >= self.max_faces:
                        break
                    owners.append(i)
                    sources.append(len(tracks) + row)
                    tracked.append(False)
                    frame_rois += 1
                state.frames_since_detection = 0
            else:
                state.frames_since_detection += 1

        if owners:
            rects_parts, boxes_parts, scores_parts = [], [], []
            if tracks:
                rects_parts.append(roi_mod.rects_from_landmarks(track_landmarks))
                boxes_parts.append(track_boxes)
                scores_parts.append(torch.zeros(len(tracks), device=self.device))
            if det_owner:
                rects_parts.append(roi_mod.rects_from_detections(det_boxes, det_keypoints))
                boxes_parts.append(det_boxes)
                scores_parts.append(det_scores)
            order = self._from_host(sources)
            rects = roi_mod.RotatedRects.cat(rects_parts)[order]
            measured = self._measure(batch, owners, rects, torch.cat(boxes_parts)[order],
                                     torch.cat(scores_parts)[order], tracked)
        else:
            measured = _Measured([[] for _ in states], [[] for _ in states], None, None)

        for i, state in enumerate(states):
            state.lost_face = bool(state.tracks) and len(measured.faces[i]) < owners.count(i)
            state.tracks = [_Track(measured.landmarks_px[k], measured.boxes_px[k]) for k in measured.rows[i]]
        return measured.faces

    def wants_detection(self, camera_id: Hashable) -> bool:
        """Whether the camera's next frame should get a detection pass: it has no face, lost
        one, or it is time to look for newcomers."""
        state = self._cameras.get(camera_id)
        return (state is None or not state.tracks or state.lost_face
                or state.frames_since_detection >= self.detect_interval_frames)

    def reset(self, camera_id: Hashable | None = None) -> None:
        """Forget the tracks of one camera (or of all)."""
        if camera_id is None:
            self._cameras.clear()
        else:
            self._cameras.pop(camera_id, None)

    # -- detection -------------------------------------------------------------------------------

    @torch.inference_mode()
    def detect(self, batch: roi_mod.FrameBatch, frame_indices: Sequence[int] | None = None):
        """Faces of the given frames (all by default): per frame, (boxes (M, 4) px,
        keypoints (M, 6, 2) px, scores (M,)), best first, at most ``max_faces`` (at most twice
        that with ``use_tiles=False``, as NMS leaves them)."""
        frame_indices = list(range(len(batch)) if frame_indices is None else frame_indices)
        if not frame_indices:
            return []
        found = self._detect_batched(batch, frame_indices)
        counts = found.valid.sum(dim=1).tolist()  # the one wait for the device; valid slots come first
        return [(found.boxes[f, :c], found.keypoints[f, :c], found.scores[f, :c]) for f, c in enumerate(counts)]

    def _detect_batched(self, batch: roi_mod.FrameBatch, frame_indices: list[int]) -> Detections:
        """Both detectors over the frames, merged: (F, K) slots per frame, valid ones first."""
        sizes = tuple(batch.sizes_hw[i] for i in frame_indices)
        if self.cuda_graphs and len(set(sizes)) == 1 and "detect" not in self.graph_fallbacks:
            parts = []
            for start in range(0, len(frame_indices), MAX_GRAPH_FRAMES):
                part = self._detect_graphed(batch, frame_indices[start:start + MAX_GRAPH_FRAMES])
                if part is None:
                    break
                parts.append(part)
            else:
                return Detections(*(torch.cat(fields) for fields in zip(
                    *((p.boxes, p.keypoints, p.scores, p.valid) for p in parts))))
        index = self._from_host(frame_indices)
        return self._detect_core(batch, index, self._plans_for(sizes))

    def _detect_core(self, batch: roi_mod.FrameBatch, frame_index: torch.Tensor, plans,
                     on_stage: Callable[[str], None] | None = None) -> Detections:
        """The detection pass proper, a fixed sequence of tensor operations for the planned
        frames (Note [Detection without per-frame work]). ``on_stage`` is called after the
        preprocess (crops), forward and decode_nms stages (the benchmark's stage clock)."""
        short_plan, full_plan = plans
        short_spec, full_spec = anchors_mod.FACE_SHORT_RANGE, anchors_mod.FACE_FULL_RANGE
        short_crops = self._detector_crops(batch, frame_index, short_plan, short_spec)
        full_crops = self._detector_crops(batch, frame_index, full_plan, full_spec) if full_plan else None
        if on_stage:
            on_stage("preprocess")
        short_raw = self._detector_outputs(False, short_crops)
        full_raw = self._detector_outputs(True, full_crops) if full_plan else None
        if on_stage:
            on_stage("forward")
        short = self._detector_decode(short_raw, short_plan, short_spec)
        full = self._detector_decode(full_raw, full_plan, full_spec) if full_plan else None
        merged = self._merge_detectors(short, full)
        if on_stage:
            on_stage("decode_nms")
        return merged

    def _plans_for(self, sizes_hw: tuple[tuple[int, int], ...]) -> tuple[_DetectorPlan, _DetectorPlan | None]:
        plans = self._plans.get(sizes_hw)
        if plans is None:
            plans = (self._make_plan(sizes_hw, tiles=False),
                     self._make_plan(sizes_hw, tiles=True) if self.full_range is not None else None)
            self._plans[sizes_hw] = plans
            if len(self._plans) > _PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(sizes_hw)
        return plans

    def _make_plan(self, sizes_hw, tiles: bool) -> _DetectorPlan:
        rows, owner, edges, per_frame = [], [], [], []
        for position, (height, width) in enumerate(sizes_hw):
            inputs = [(roi_mod.letterbox_rect(height, width), _NO_CUT)]
            if tiles:
                inputs += [(rect, _tile_cut_edges(rect, height, width))
                           for rect in roi_mod.tile_rects(height, width, self.tile_px, self.tile_overlap_px)]
            per_frame.append(list(range(len(rows), len(rows) + len(inputs))))
            for rect, edge in inputs:
                rows.append(rect)
                owner.append(position)
                edges.append(edge)
        width = max(len(frame_rows) for frame_rows in per_frame)
        table = torch.tensor(rows, dtype=torch.float32)
        return _DetectorPlan(
            rects=roi_mod.RotatedRects(table[:, :2], table[:, 2:3].expand(-1, 2).contiguous(),
                                       torch.zeros(len(rows))).to(self.device),
            owner=torch.tensor(owner).to(self.device),
            cut_edges_px=torch.tensor(edges, dtype=torch.float32).to(self.device),
            pool_rows=torch.tensor([r + [0] * (width - len(r)) for r in per_frame]).to(self.device),
            pool_used=torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in per_frame]).to(self.device),
        )

    def _detector_crops(self, batch, frame_index: torch.Tensor, plan: _DetectorPlan,
                        spec: anchors_mod.DetectorSpec) -> torch.Tensor:
        size = spec.anchors.input_size_px
        # Letterbox and tiles are unrotated: coordinates per row and column (axis_aligned).
        return roi_mod.crop_rois(batch, frame_index[plan.owner], plan.rects, size, border="zero",
                                 dtype=self.model_dtype, value_range=(-1.0, 1.0), axis_aligned=True)

    def _detector_outputs(self, full_range: bool, crops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.full_range if full_range else self.short_range
        outputs = model(crops)
        boxes = next(o for o in outputs if o.dim() == 3 and o.shape[-1] > 1)
        scores = next(o for o in outputs if o.dim() == 3 and o.shape[-1] == 1)
        return boxes, scores

    def _detector_decode(self, raw, plan: _DetectorPlan, spec: anchors_mod.DetectorSpec) -> Detections:
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
        valid = (decoded.scores >= spec.min_score) & ~_cut_by_tile_border(boxes, plan.cut_edges_px)
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

    def _merge_detectors(self, short: Detections, full: Detections | None) -> Detections:
        """A full-range detection is kept only where no short-range one overlaps it; the best
        ``max_faces`` of both, by score."""
        if full is None:
            return short
        overlaps = (box_iou(full.boxes, short.boxes) * short.valid[:, None, :]).amax(dim=2) > 0.1
        valid = torch.cat([short.valid, full.valid & ~overlaps], dim=1)
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
        """:meth:`_detect_core` replayed from a CUDA graph (Note [CUDA graphs of the pipeline]);
        None when the stage cannot be captured."""
        height, width = batch.sizes_hw[frame_indices[0]]
        count = len(frame_indices)
        bucket = _bucket(count, MAX_GRAPH_FRAMES)

        def build():
            pixels = torch.zeros(bucket * height, width, 3, dtype=torch.uint8, device=self.device)
            static = roi_mod.FrameBatch.from_pixels(pixels, [(height, width)] * bucket, bgr=batch.bgr)
            index = torch.arange(bucket, device=self.device)
            plans = self._plans_for(((height, width),) * bucket)
            return (lambda: self._detect_core(static, index, plans)), {"pixels": pixels}

        captured = self._graph("detect", (height, width, bucket, batch.bgr), build)
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

    # -- ROI, mesh, pose, blendshapes ------------------------------------------------------------

    def _measure(self, batch, owners: list[int], rects: roi_mod.RotatedRects, roi_boxes: torch.Tensor,
                 roi_scores: torch.Tensor, tracked: list[bool]) -> _Measured:
        """Mesh, head pose and blendshapes for every ROI of every frame, in one batch.

        owners: the frame of each ROI; roi_boxes / roi_scores: the detection's box and score
        (used for faces that were detected, not tracked); tracked: whether each ROI came from a
        track (its box then comes from its landmarks, its score is the mesh's presence).
        """
        frames = len(batch)
        count = len(owners)
        if count == 0:
            return _Measured([[] for _ in range(frames)], [[] for _ in range(frames)], None, None)
        owner = self._from_host(owners)
        crops = roi_mod.crop_rois(batch, owner, rects, MESH_INPUT_PX, border="replicate", dtype=self.model_dtype)
        landmarks, presence, blendshapes = self._landmarks(crops, rects)
        # MediaPipe's z is relative to the face's centre of mass; the projected z already is
        # (the model predicts it so), kept as is.
        poses = head_pose_deg(landmarks)
        is_tracked = self._from_host(tracked)
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
            kept = _drop_duplicates(candidates)[: self.max_faces]
            faces_per_frame.append([face for face, _ in kept])
            rows_per_frame.append([k for _, k in kept])
        return _Measured(faces_per_frame, rows_per_frame, landmarks, boxes)

    @torch.inference_mode()
    def warm_up(self, frame_sizes_hw: Sequence[tuple[int, int]], max_frames: int = 0,
                max_faces: int = 0) -> None:
        """Capture and run once every graph bucket of detection over up to ``max_frames`` frames
        of each size, and of the mesh over up to ``max_faces`` faces (Note [Warm shapes]).
        Only with ``cuda_graphs``: eager shapes are unbounded."""
        if not self.cuda_graphs:
            return
        for height, width in dict.fromkeys(frame_sizes_hw):
            count = min(max_frames, MAX_GRAPH_FRAMES)
            if count < 1:
                break
            frames = torch.zeros(count, height, width, 3, dtype=torch.uint8, device=self.device)
            for bucket in _buckets_up_to(count, MAX_GRAPH_FRAMES):
                self.detect(roi_mod.FrameBatch(frames[:bucket], self.device))
        count = min(max_faces, MAX_GRAPH_FACES)
        if count >= 1:
            crops = torch.zeros(count, MESH_INPUT_PX, MESH_INPUT_PX, 3, dtype=self.model_dtype,
                                device=self.device)
            rects = roi_mod.RotatedRects(torch.zeros(count, 2, device=self.device),
                                         torch.full((count, 2), 100.0, device=self.device),
                                         torch.zeros(count, device=self.device))
            for bucket in _buckets_up_to(count, MAX_GRAPH_FACES):
                self._landmarks(crops[:bucket], rects[:bucket])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _landmarks(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        """(landmarks (N, 478, 3) px, presence (N,), blendshapes (N, 52) or None) of the crops."""
        if self.cuda_graphs and "mesh" not in self.graph_fallbacks:
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
        return self._landmarks_core(crops, rects)

    def _landmarks_core(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        landmarks_model, presence = refine_attention_mesh(self.mesh(crops))
        landmarks = roi_mod.project_points(landmarks_model, rects, MESH_INPUT_PX)
        blendshapes = self._run_blendshapes(landmarks) if self.blendshapes is not None else None
        return landmarks, presence, blendshapes

    def _landmarks_graphed(self, crops: torch.Tensor, rects: roi_mod.RotatedRects):
        count = crops.shape[0]
        bucket = _bucket(count, MAX_GRAPH_FACES)

        def build():
            statics = {
                "crops": torch.zeros(bucket, *crops.shape[1:], dtype=crops.dtype, device=self.device),
                "centre": torch.zeros(bucket, 2, device=self.device),
                "size": torch.zeros(bucket, 2, device=self.device),
                "rotation": torch.zeros(bucket, device=self.device),
            }
            static_rects = roi_mod.RotatedRects(statics["centre"], statics["size"], statics["rotation"])
            return (lambda: self._landmarks_core(statics["crops"], static_rects)), statics

        captured = self._graph("mesh", (bucket, crops.dtype), build)
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

    def _graph(self, stage: str, key: tuple, build) -> "_Captured | None":
        """The CUDA graph of a stage for one shape, captured on first use; None when the stage
        runs eagerly (Note [CUDA graphs of the pipeline])."""
        if stage in self.graph_fallbacks:
            return None
        captured = self._graphs.get((stage, key))
        if captured is None:
            try:
                fn, statics = build()
                captured = self._capture(fn, statics, self.device, self._graph_pool)
            except RuntimeError as error:
                lines = str(error).strip().splitlines()
                self.graph_fallbacks[stage] = lines[0] if lines else type(error).__name__
                log.warning("the %s stage cannot be captured in a CUDA graph (%s); it runs eagerly",
                            stage, self.graph_fallbacks[stage])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return None
            self._graphs[(stage, key)] = captured
        return captured

    def _load_blendshapes(self, task_path: Path):
        """The blendshape model from face_landmarker.task, or None with a one-line reason."""
        from facecast.models import assets

        try:
            bundle = assets.blendshape_model(task_path)
            model = self._prepare(tflite_convert.convert(bundle.face_blendshapes))
        except (assets.ModelError, OSError, ValueError) as error:
            self.blendshapes_unavailable_reason = f"blendshapes unavailable: {error}"
            log.warning("%s", self.blendshapes_unavailable_reason)
            return None
        self.blendshapes_unavailable_reason = None
        return model

    def _run_blendshapes(self, landmarks_px: torch.Tensor) -> torch.Tensor:
        # The model reads x, y of the 146-landmark subset in image pixels (MediaPipe's
        # LandmarksToTensorCalculator with IMAGE_SIZE).
        subset = landmarks_px[:, _indices(BLENDSHAPE_LANDMARK_SUBSET, landmarks_px.device), :2]
        (scores, *_) = self.blendshapes(subset.to(self.model_dtype).contiguous())
        return scores.reshape(landmarks_px.shape[0], len(BLENDSHAPE_NAMES)).float()


class _Captured:
    """One CUDA graph: ``fn`` (no arguments: it reads the static tensors ``statics``, which the
    caller fills before each replay) captured after two warm-up runs on a side stream."""

    def __init__(self, fn: Callable[[], object], statics: dict, device: torch.device, pool):
        self.statics = statics
        # The graph reads every tensor it was captured with by address, also those only ``fn``'s
        # closure holds (a static batch's offset tables, the frame index): they must live as long
        # as the graph. Dropping ``fn`` freed them, the allocator handed their memory out again,
        # and replays indexed with whatever was there (a device-side "index out of bounds" on the
        # H200, for the first detection graph of a pipeline).
        self.fn = fn
        previous = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(previous)
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisation (cuDNN plans, cached index tensors) stays out of the graph
                fn()
        previous.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn()
        finally:
            torch.cuda.set_stream(previous)

    def replay(self):
        self.graph.replay()
        return self.outputs


def _bucket(count: int, largest: int) -> int:
    """The power of two a batch of ``count`` (1..largest) is padded to."""
    return min(largest, 1 << max(0, count - 1).bit_length())


def _buckets_up_to(count: int, largest: int) -> list[int]:
    """Every bucket a batch of 1..count can be padded to."""
    return sorted({_bucket(n, largest) for n in range(1, count + 1)})


def _tile_cut_edges(tile, frame_h: int, frame_w: int, margin_px: float = TILE_BORDER_MARGIN_PX):
    """A tile's inner borders as thresholds (x1, y1, x2, y2) for :func:`_cut_by_tile_border`;
    an edge that is the frame's own border never cuts (±inf)."""
    cx, cy, side = tile
    x1, y1, x2, y2 = cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2
    return (x1 + margin_px if x1 > 0 else -math.inf, y1 + margin_px if y1 > 0 else -math.inf,
            x2 - margin_px if x2 < frame_w else math.inf, y2 - margin_px if y2 < frame_h else math.inf)


def _cut_by_tile_border(boxes_px: torch.Tensor, edges_px: torch.Tensor) -> torch.Tensor:
    """(R, A) True for boxes (R, A, 4) that reach a tile edge lying inside the frame: the face
    is cut there, and a neighbouring tile (or the whole-frame pass) sees it whole."""
    edges = edges_px[:, None, :]
    return ((boxes_px[..., 0] <= edges[..., 0]) | (boxes_px[..., 1] <= edges[..., 1])
            | (boxes_px[..., 2] >= edges[..., 2]) | (boxes_px[..., 3] >= edges[..., 3]))


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


def box_from_landmarks(landmarks_px: torch.Tensor) -> torch.Tensor:
    """A detector-style box (x1, y1, x2, y2) from a face's landmarks (Note [Box of a tracked face])."""
    return boxes_from_landmarks(landmarks_px[None])[0]


def _drop_duplicates(faces: list[tuple[Face, int]], max_iou: float = 0.5) -> list[tuple[Face, int]]:
    """Two ROIs that converged on one face (a track and a detection) → keep the more present.
    ``faces`` pairs each face with a key that is passed through."""
    kept: list[tuple[Face, int]] = []
    kept_boxes: list[np.ndarray] = []
    for face, key in sorted(faces, key=lambda item: item[0].presence, reverse=True):
        points = face.landmarks[:, :2]
        box = np.concatenate([points.min(0), points.max(0)])
        if any(_box_iou_np(box, other) > max_iou for other in kept_boxes):
            continue
        kept.append((face, key))
        kept_boxes.append(box)
    return kept


def _box_iou_np(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two x1,y1,x2,y2 float32 boxes, computed as :func:`box_iou` does (0 without area)."""
    inter_w = max(np.float32(0), min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(np.float32(0), min(a[3], b[3]) - max(a[1], b[1]))
    intersection = inter_w * inter_h
    area_a = max(np.float32(0), a[2] - a[0]) * max(np.float32(0), a[3] - a[1])
    area_b = max(np.float32(0), b[2] - b[0]) * max(np.float32(0), b[3] - b[1])
    union = area_a + area_b - intersection
    return float(intersection / union) if union > 0 else 0.0
