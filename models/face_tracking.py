"""The face pipeline's tracking state, per camera: which faces each camera follows, and where its
next frame's ROIs lie (DESIGN §3).

As MediaPipe's face_landmarks_to_roi: a followed face's next ROI comes from this frame's
landmarks, not from a detection; the detector runs only when a camera has no face, lost one, or
every ``detect_interval_frames`` frames to pick up newcomers (:meth:`FaceTracks.wants_detection`).
A detection of a face that is already followed is dropped: the track's ROI follows the mesh,
which is the better one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch

from facecast.models import roi as roi_mod
from facecast.models.face_mesh import Measured
from facecast.models.nms import box_iou


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
class Rois:
    """The ROIs of one tracking step, of every frame in one batch: each camera's tracks, then
    its new detections (None tensors when there is none)."""

    owners: list[int]  # the frame of each ROI
    tracked: list[bool]  # whether each ROI comes from a track
    rects: roi_mod.RotatedRects | None
    boxes_px: torch.Tensor | None  # (N, 4): the detection's box (a track's last box when tracked)
    scores: torch.Tensor | None  # (N,): the detection's score (0 when tracked)


class FaceTracks:
    """The faces each camera follows, keyed by camera id."""

    def __init__(self, device: torch.device, max_faces: int, detect_interval_frames: int):
        self.device = device
        self.max_faces = max_faces
        self.detect_interval_frames = detect_interval_frames
        self.cameras: dict[Hashable, _CameraState] = {}

    def states(self, camera_ids: Sequence[Hashable]) -> list[_CameraState]:
        """The state of each camera, in order; new cameras start with no face."""
        return [self.cameras.setdefault(cam, _CameraState()) for cam in camera_ids]

    def wants_detection(self, camera_id: Hashable) -> bool:
        """Whether the camera's next frame should get a detection pass: it has no face, lost
        one, or it is time to look for newcomers."""
        state = self.cameras.get(camera_id)
        return (state is None or not state.tracks or state.lost_face
                or state.frames_since_detection >= self.detect_interval_frames)

    def reset(self, camera_id: Hashable | None = None) -> None:
        """Forget the tracks of one camera (or of all)."""
        if camera_id is None:
            self.cameras.clear()
        else:
            self.cameras.pop(camera_id, None)

    def next_rois(self, states: list[_CameraState], det_by_frame: dict) -> Rois:
        """The ROIs of one frame per state: its tracks, then its detections (``det_by_frame``:
        frame index → (boxes, keypoints, scores)) of faces not tracked yet, up to ``max_faces``
        a frame. Counts the frames since each camera's last detection."""
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
            same_frame = roi_mod.from_host(np.equal.outer(det_owner, track_owner), self.device)
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

        if not owners:
            return Rois([], [], None, None, None)
        rects_parts, boxes_parts, scores_parts = [], [], []
        if tracks:
            rects_parts.append(roi_mod.rects_from_landmarks(track_landmarks))
            boxes_parts.append(track_boxes)
            scores_parts.append(torch.zeros(len(tracks), device=self.device))
        if det_owner:
            rects_parts.append(roi_mod.rects_from_detections(det_boxes, det_keypoints))
            boxes_parts.append(det_boxes)
            scores_parts.append(det_scores)
        order = roi_mod.from_host(sources, self.device)
        return Rois(owners, tracked, roi_mod.RotatedRects.cat(rects_parts)[order], torch.cat(boxes_parts)[order],
                    torch.cat(scores_parts)[order])

    def follow(self, states: list[_CameraState], owners: list[int], measured: Measured) -> None:
        """Keep the faces measured in each state's frame as its tracks; a track that held no face
        any more marks the camera as having lost one."""
        for i, state in enumerate(states):
            state.lost_face = bool(state.tracks) and len(measured.faces[i]) < owners.count(i)
            state.tracks = [_Track(measured.landmarks_px[k], measured.boxes_px[k]) for k in measured.rows[i]]
