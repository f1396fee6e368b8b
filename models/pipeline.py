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
3. **Warp**: every ROI of every frame cropped to 192x192 in one ``grid_sample``.
4. **Mesh**: ``face_landmark_with_attention`` (468 mesh points refined by its lips, eyes and iris
   heads into MediaPipe's 478 landmarks, see :func:`refine_attention_mesh`), face presence score.
5. **Head pose** (:mod:`facecast.models.head_pose`), **blendshapes** (from the 146-landmark subset,
   only when the user gives ``face_landmarker.task``).
6. **Tracking** (:meth:`FacePipeline.track`): per camera, the next frame's ROIs come from this
   frame's landmarks (MediaPipe's face_landmarks_to_roi); the detector runs only when a camera
   has no face, lost one, or every ``detect_interval_frames`` frames to pick up newcomers.

Outputs are in the pixels of each input frame; landmark z is on the scale of x (pixels), negative
toward the camera, relative to the face's centre of mass as in MediaPipe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from facecast.models import anchors as anchors_mod
from facecast.models import roi as roi_mod
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
        index = torch.tensor(mapping, device=landmarks.device)
        landmarks[:, index, :2] = head.reshape(n, len(mapping), 2).float()
    irises = []
    for iris, eye_mapping in ((left_iris, LEFT_EYE_TO_MESH), (right_iris, RIGHT_EYE_TO_MESH)):
        contour = torch.tensor(eye_mapping[:EYE_CONTOUR_POINTS], device=landmarks.device)
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
    landmarks_px: torch.Tensor  # (478, 3)
    box_px: torch.Tensor  # (4,)


@dataclass
class _CameraState:
    tracks: list[_Track] = field(default_factory=list)
    frames_since_detection: int = 0
    lost_face: bool = False


ModelLoader = Callable[[str], torch.nn.Module]


def _default_loader(name: str) -> torch.nn.Module:
    """Load a MediaPipe model as a torch module (the installer/converter of facecast.models)."""
    from facecast.models import assets, tflite_convert

    return tflite_convert.convert(assets.model_path(name))


class FacePipeline:
    """Faces of a batch of frames.

    ``pipeline(frames)`` detects in every frame (stateless); ``pipeline.track(frames,
    camera_ids)`` keeps per-camera tracks and detects only when needed. ``frames`` is a list of
    HxWx3 uint8 BGR numpy arrays (sizes may differ) or a uint8 tensor (B, H, W, 3), BGR, on any
    device (it is moved to ``device``).
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
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("FacePipeline(device='cuda'): torch sees no CUDA device; use device='cpu'")
        if max_faces < 1:
            raise ValueError(f"max_faces must be at least 1, got {max_faces}")
        self.max_faces = max_faces
        self.use_tiles = use_tiles
        self.tile_px = tile_px
        self.tile_overlap_px = tile_overlap_px
        self.min_presence = min_presence
        self.detect_interval_frames = detect_interval_frames
        self.frames_are_bgr = frames_are_bgr

        def load(name: str) -> torch.nn.Module:
            return load_model(name).to(self.device).eval()

        self.short_range = load(anchors_mod.FACE_SHORT_RANGE.name)
        self.full_range = load(anchors_mod.FACE_FULL_RANGE.name) if use_tiles else None
        self.mesh = load("face_landmark_with_attention")
        self.anchors = {
            spec.name: anchors_mod.generate_anchors(spec.anchors).to(self.device)
            for spec in (anchors_mod.FACE_SHORT_RANGE, anchors_mod.FACE_FULL_RANGE)
        }
        self.blendshapes = None
        self.blendshapes_unavailable_reason = "no face_landmarker.task given"
        if face_landmarker_task is not None:
            self.blendshapes = self._load_blendshapes(Path(face_landmarker_task))
        self._cameras: dict[Hashable, _CameraState] = {}

    # -- public API ------------------------------------------------------------------------------

    @torch.inference_mode()
    def __call__(self, frames) -> list[list[Face]]:
        batch = roi_mod.FrameBatch(frames, self.device, bgr=self.frames_are_bgr)
        detections = self.detect(batch)
        rois = [[(d_box, d_kp, d_score) for d_box, d_kp, d_score in zip(*det)] for det in detections]
        return self._measure(batch, [self._rects_from_detections(r) for r in rois], rois, tracked=None)

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
            det_by_frame = {i: tuple(t.to(self.device) for t in det) for i, det in detections.items()}

        rects_per_frame, rois_per_frame, tracked_per_frame = [], [], []
        for i, state in enumerate(states):
            rect_list, roi_list, tracked_list = [], [], []
            for track in state.tracks:
                rect_list.append(roi_mod.rects_from_landmarks(track.landmarks_px[None]))
                roi_list.append((track.box_px, None, None))
                tracked_list.append(track)
            if i in det_by_frame:
                boxes, keypoints, scores = det_by_frame[i]
                for box, kp, score in zip(boxes, keypoints, scores):
                    # A detection of a face that is already tracked is dropped: the track's ROI
                    # is the better one (it follows the mesh, not a coarse box).
                    if state.tracks and box_iou(box[None], self._track_boxes(state))[0].max() > 0.3:
                        continue
                    if len(rect_list) >= self.max_faces:
                        break
                    rect_list.append(self._rects_from_detections([(box, kp, score)]))
                    roi_list.append((box, kp, score))
                    tracked_list.append(None)
                state.frames_since_detection = 0
            else:
                state.frames_since_detection += 1
            rects_per_frame.append(roi_mod.RotatedRects.cat(rect_list) if rect_list else self._no_rects())
            rois_per_frame.append(roi_list)
            tracked_per_frame.append(tracked_list)

        faces = self._measure(batch, rects_per_frame, rois_per_frame, tracked=tracked_per_frame)
        for state, frame_faces, tracked_list in zip(states, faces, tracked_per_frame):
            state.lost_face = len(frame_faces) < len(tracked_list) and any(t is not None for t in tracked_list)
            state.tracks = [
                _Track(torch.as_tensor(f.landmarks, device=self.device), torch.tensor(f.box, device=self.device))
                for f in frame_faces
            ]
        return faces

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

    def detect(self, batch: roi_mod.FrameBatch, frame_indices: Sequence[int] | None = None):
        """Faces of the given frames (all by default): per frame, (boxes (M, 4) px,
        keypoints (M, 6, 2) px, scores (M,)), best first, at most ``max_faces``."""
        if frame_indices is None:
            frame_indices = list(range(len(batch)))
        short = self._run_detector(batch, frame_indices, anchors_mod.FACE_SHORT_RANGE, tiles=False)
        if self.full_range is None:
            return [(d.boxes[0], d.keypoints[0], d.scores[0]) for d in short]
        full = self._run_detector(batch, frame_indices, anchors_mod.FACE_FULL_RANGE, tiles=True)
        merged = []
        for s, f in zip(short, full):
            boxes, keypoints, scores = s.boxes[0], s.keypoints[0], s.scores[0]
            if f.boxes.shape[1]:
                if boxes.shape[0]:
                    overlaps = box_iou(f.boxes[0], boxes).max(dim=1).values > 0.1
                else:
                    overlaps = torch.zeros(f.boxes.shape[1], dtype=torch.bool, device=self.device)
                keep = ~overlaps
                boxes = torch.cat([boxes, f.boxes[0, keep]])
                keypoints = torch.cat([keypoints, f.keypoints[0, keep]])
                scores = torch.cat([scores, f.scores[0, keep]])
            order = scores.argsort(descending=True)[: self.max_faces]
            merged.append((boxes[order], keypoints[order], scores[order]))
        return merged

    def _run_detector(self, batch, frame_indices, spec: anchors_mod.DetectorSpec, tiles: bool) -> list[Detections]:
        """One forward pass over the letterboxed frames (and their tiles), decoded, projected to
        image pixels, weighted-NMS'd per frame."""
        rect_rows, owner = [], []  # one row per model input: (cx, cy, side); owner frame
        tile_inner = []  # per input: the tile's box, used to drop faces cut by a tile border
        for i in frame_indices:
            h, w = batch.sizes_hw[i]
            rect_rows.append(roi_mod.letterbox_rect(h, w))
            owner.append(i)
            tile_inner.append(None)
            if tiles:
                for rect in roi_mod.tile_rects(h, w, self.tile_px, self.tile_overlap_px):
                    rect_rows.append(rect)
                    owner.append(i)
                    tile_inner.append((rect, h, w))
        table = torch.tensor(rect_rows, dtype=torch.float32, device=self.device)
        rects = roi_mod.RotatedRects(table[:, :2], table[:, 2:3].expand(-1, 2).contiguous(),
                                     torch.zeros(len(rect_rows), device=self.device))
        owner_t = torch.tensor(owner, device=self.device)
        size = spec.anchors.input_size_px
        crops = roi_mod.crop_rois(batch, owner_t, rects, size, border="zero") * 2 - 1  # range -1..1
        raw_boxes, raw_scores = self._detector_outputs(tiles, crops)
        decoded = anchors_mod.decode(raw_boxes, raw_scores, self.anchors[spec.name], spec)
        boxes = roi_mod.project_boxes(decoded.boxes * size, rects, size)
        keypoints = roi_mod.project_points(
            (decoded.keypoints * size).reshape(len(rect_rows), -1, 2), rects, size
        ).reshape(decoded.keypoints.shape)
        valid = decoded.scores >= spec.min_score
        for row, inner in enumerate(tile_inner):
            if inner is not None:
                valid[row] &= ~_touches_inner_border(boxes[row], inner)
        # Pool every input of a frame into one NMS row.
        per_frame = []
        for i in frame_indices:
            rows = [r for r, o in enumerate(owner) if o == i]
            per_frame.append((boxes[rows].reshape(1, -1, 4), keypoints[rows].reshape(1, -1, spec.num_keypoints, 2),
                              decoded.scores[rows].reshape(1, -1), valid[rows].reshape(1, -1)))
        # Frames may have different numbers of tiles: pad to one width for a single NMS call.
        width = max(p[0].shape[1] for p in per_frame)

        def pad(t, value):
            extra = width - t.shape[1]
            if extra == 0:
                return t
            filler = torch.full((1, extra) + tuple(t.shape[2:]), value, dtype=t.dtype, device=t.device)
            return torch.cat([t, filler], dim=1)

        result = weighted_nms(
            torch.cat([pad(p[0], 0.0) for p in per_frame]),
            torch.cat([pad(p[2], 0.0) for p in per_frame]),
            torch.cat([pad(p[1], 0.0) for p in per_frame]),
            torch.cat([pad(p[3], False) for p in per_frame]),
            iou_threshold=spec.min_suppression_iou,
            max_detections=self.max_faces * 2,
        )
        return [result.select(k) for k in range(len(frame_indices))]

    def _detector_outputs(self, full_range: bool, crops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.full_range if full_range else self.short_range
        outputs = model(crops)
        boxes = next(o for o in outputs if o.dim() == 3 and o.shape[-1] > 1)
        scores = next(o for o in outputs if o.dim() == 3 and o.shape[-1] == 1)
        return boxes, scores

    # -- ROI, mesh, pose, blendshapes ------------------------------------------------------------

    def _no_rects(self) -> roi_mod.RotatedRects:
        return roi_mod.RotatedRects(torch.zeros(0, 2, device=self.device), torch.zeros(0, 2, device=self.device),
                                    torch.zeros(0, device=self.device))

    def _rects_from_detections(self, rois) -> roi_mod.RotatedRects:
        if not rois:
            return self._no_rects()
        boxes = torch.stack([r[0] for r in rois])
        keypoints = torch.stack([r[1] for r in rois])
        return roi_mod.rects_from_detections(boxes, keypoints)

    def _track_boxes(self, state: _CameraState) -> torch.Tensor:
        return torch.stack([t.box_px for t in state.tracks])

    def _measure(self, batch, rects_per_frame, rois_per_frame, tracked) -> list[list[Face]]:
        """Mesh, head pose and blendshapes for every ROI of every frame, in one batch."""
        counts = [len(r) for r in rects_per_frame]
        if sum(counts) == 0:
            return [[] for _ in counts]
        rects = roi_mod.RotatedRects.cat(rects_per_frame)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=self.device),
                                        torch.tensor(counts, device=self.device))
        crops = roi_mod.crop_rois(batch, owner, rects, MESH_INPUT_PX, border="replicate")
        landmarks_model, presence = refine_attention_mesh(self.mesh(crops))
        landmarks = roi_mod.project_points(landmarks_model, rects, MESH_INPUT_PX)
        # MediaPipe's z is relative to the face's centre of mass; the projected z already is
        # (the model predicts it so), kept as is.
        poses = head_pose_deg(landmarks)
        blendshapes = self._run_blendshapes(landmarks) if self.blendshapes is not None else None

        landmarks_np = landmarks.cpu().numpy().astype(np.float32)
        presence_np = presence.cpu().numpy()
        poses_np = poses.cpu().numpy()
        blend_np = blendshapes.cpu().numpy().astype(np.float32) if blendshapes is not None else None
        faces_per_frame: list[list[Face]] = []
        start = 0
        for frame, count in enumerate(counts):
            faces = []
            for k in range(start, start + count):
                if presence_np[k] < self.min_presence:
                    continue
                roi_box, _, det_score = rois_per_frame[frame][k - start]
                previous = tracked[frame][k - start] if tracked is not None else None
                if previous is None:
                    box = roi_box
                    score = float(det_score)
                else:
                    box = box_from_landmarks(landmarks[k])
                    score = float(presence_np[k])
                faces.append(Face(
                    box=tuple(float(v) for v in box.tolist()),
                    score=score,
                    landmarks=landmarks_np[k],
                    head_pose=tuple(float(v) for v in poses_np[k]),
                    presence=float(presence_np[k]),
                    blendshapes=None if blend_np is None else blend_np[k],
                    tracked=previous is not None,
                ))
            start += count
            faces_per_frame.append(_drop_duplicates(faces)[: self.max_faces])
        return faces_per_frame

    def _load_blendshapes(self, task_path: Path):
        """The blendshape model from face_landmarker.task, or None with a one-line reason."""
        from facecast.models import assets, tflite_convert

        try:
            bundle = assets.blendshape_model(task_path)
            model = tflite_convert.convert(bundle.face_blendshapes).to(self.device).eval()
        except (assets.ModelError, OSError, ValueError) as error:
            self.blendshapes_unavailable_reason = f"blendshapes unavailable: {error}"
            log.warning("%s", self.blendshapes_unavailable_reason)
            return None
        self.blendshapes_unavailable_reason = None
        return model

    def _run_blendshapes(self, landmarks_px: torch.Tensor) -> torch.Tensor:
        # The model reads x, y of the 146-landmark subset in image pixels (MediaPipe's
        # LandmarksToTensorCalculator with IMAGE_SIZE).
        subset = landmarks_px[:, list(BLENDSHAPE_LANDMARK_SUBSET), :2].contiguous()
        (scores, *_) = self.blendshapes(subset)
        return scores.reshape(landmarks_px.shape[0], len(BLENDSHAPE_NAMES))


def _touches_inner_border(boxes_px: torch.Tensor, tile, margin_px: float = 4.0) -> torch.Tensor:
    """Boxes that reach a tile edge lying inside the frame: the face is cut there, and a
    neighbouring tile (or the whole-frame pass) sees it whole."""
    (cx, cy, side), frame_h, frame_w = tile
    x1, y1, x2, y2 = cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2
    cut = torch.zeros(boxes_px.shape[0], dtype=torch.bool, device=boxes_px.device)
    if x1 > 0:
        cut |= boxes_px[:, 0] <= x1 + margin_px
    if y1 > 0:
        cut |= boxes_px[:, 1] <= y1 + margin_px
    if x2 < frame_w:
        cut |= boxes_px[:, 2] >= x2 - margin_px
    if y2 < frame_h:
        cut |= boxes_px[:, 3] >= y2 - margin_px
    return cut


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


def box_from_landmarks(landmarks_px: torch.Tensor) -> torch.Tensor:
    """A detector-style box (x1, y1, x2, y2) from a face's landmarks (Note [Box of a tracked face])."""
    mesh = landmarks_px[:NUM_MESH_POINTS, :2]
    low, high = mesh.min(dim=0).values, mesh.max(dim=0).values
    side = (high - low).max()
    centre = (low + high) / 2 + side * torch.tensor(TRACKED_BOX_CENTER_OFFSET, device=mesh.device)
    half = side * TRACKED_BOX_SIDE / 2
    return torch.cat([centre - half, centre + half])


def _drop_duplicates(faces: list[Face], max_iou: float = 0.5) -> list[Face]:
    """Two ROIs that converged on one face (a track and a detection) → keep the more present."""
    kept: list[Face] = []
    for face in sorted(faces, key=lambda f: f.presence, reverse=True):
        lm = face.landmarks[:, :2]
        box = torch.tensor([[*lm.min(0), *lm.max(0)]])
        if any(box_iou(box, torch.tensor([[*k.landmarks[:, :2].min(0), *k.landmarks[:, :2].max(0)]]))[0, 0] > max_iou
               for k in kept):
            continue
        kept.append(face)
    return kept
