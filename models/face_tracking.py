"""The face pipeline's tracking state, per camera: which faces each camera follows, and where its
next frame's ROIs lie (DESIGN §3).

As MediaPipe's face_landmarks_to_roi: a followed face's next ROI comes from this frame's
landmarks, not from a detection; the detector runs only when a camera has no face, lost one, or
every ``detect_interval_frames`` frames to pick up newcomers (:meth:`FaceTracks.wants_detection`).
A detection of a face that is already followed is dropped: the track's ROI follows the mesh,
which is the better one.

Note [Tracking without per-face work]
    A camera's followed faces are one block of rows (landmarks and boxes on the device, the
    boxes also on the host, from the measuring stage's one transfer), not one object per face.
    A step makes every camera's ROIs at once: one concatenation of the cameras' blocks, one
    copy of the new detections and of the ROIs' order to the device, the rects of all tracks and
    all detections in two batched calls, one gather into the ROIs' order. Which detections are
    dropped as already followed (IoU > TRACKED_DETECTION_IOU with a followed face's box) and
    which are cut by ``max_faces`` is decided on the host, with numpy, on the host's copies of
    the boxes: the daemon's detections arrive on the host, and the tracks' boxes came back in
    the previous step's table, so nothing waits for the device (before issue 24 the decision
    was read back from the device, one wait per step). After measuring, the faces kept in every
    frame become the cameras' new blocks in one gather. Python loops over cameras remain, none
    over faces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch

from facecast.models import roi as roi_mod
from facecast.models.face_mesh import Measured
from facecast.models.nms import box_iou

# A detection whose box overlaps a followed face's box by more than this is that face.
TRACKED_DETECTION_IOU = 0.3


def _no_boxes() -> np.ndarray:
    return np.zeros((0, 4), np.float32)


@dataclass
class _CameraState:
    landmarks_px: torch.Tensor | None = None  # (k, 478, 3) on the pipeline's device: the faces followed
    boxes_px: torch.Tensor | None = None  # (k, 4) on the device
    boxes_host_px: np.ndarray = field(default_factory=_no_boxes)  # (k, 4) float32: the same boxes
    frames_since_detection: int = 0
    lost_face: bool = False

    @property
    def face_count(self) -> int:
        return self.boxes_host_px.shape[0]


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
        return (state is None or not state.face_count or state.lost_face
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
        a frame. Counts the frames since each camera's last detection. (Note [Tracking without
        per-face work].)"""
        track_counts = np.array([state.face_count for state in states], dtype=np.int64)
        track_starts = np.cumsum(track_counts) - track_counts
        det_frames = [i for i in sorted(det_by_frame) if det_by_frame[i][0].shape[0]]
        det_counts = [det_by_frame[i][0].shape[0] for i in det_frames]
        det_starts = np.cumsum([0] + det_counts)
        det_boxes_host = _detection_boxes_on_host([det_by_frame[i][0] for i in det_frames])
        total_tracks = int(track_counts.sum())

        sources, owners, tracked = [], [], []  # per frame: rows in cat(tracks, detections)
        for i, state in enumerate(states):
            sources.append(np.arange(track_starts[i], track_starts[i] + track_counts[i]))
            owners.append(np.full(track_counts[i], i))
            tracked.append(np.ones(track_counts[i], bool))
            if i not in det_by_frame:
                state.frames_since_detection += 1
                continue
            state.frames_since_detection = 0
            if i not in det_frames:
                continue
            position = det_frames.index(i)
            boxes = det_boxes_host[det_starts[position]:det_starts[position + 1]]
            # A detection of a face already followed is dropped: the track's ROI is the better
            # one (it follows the mesh, not a coarse box). Then as many as max_faces leaves room.
            new = np.ones(boxes.shape[0], bool)
            if state.face_count:
                new = box_iou(boxes, state.boxes_host_px).max(axis=1) <= TRACKED_DETECTION_IOU
            new &= np.cumsum(new) <= self.max_faces - state.face_count
            rows = total_tracks + det_starts[position] + np.flatnonzero(new)
            sources.append(rows)
            owners.append(np.full(rows.shape[0], i))
            tracked.append(np.zeros(rows.shape[0], bool))
        owner = np.concatenate(owners)
        if not owner.shape[0]:
            return Rois([], [], None, None, None)

        # One copy to the device: the ROIs' order, and the detections when they are on the host.
        detections = [det_by_frame[i] for i in det_frames]
        on_host = bool(detections) and detections[0][0].device.type == "cpu"
        order_host = np.concatenate(sources).astype(np.float32)
        upload = [order_host]
        if on_host:
            upload.append(np.concatenate([torch.cat([part.reshape(part.shape[0], -1) for part in found], dim=1)
                                          .float().numpy() for found in detections]).ravel())
        uploaded = roi_mod.from_host(np.concatenate(upload), self.device)
        order = uploaded[:order_host.shape[0]].long()

        rects_parts, boxes_parts, scores_parts = [], [], []
        if total_tracks:
            followed = [state for state in states if state.face_count]
            track_landmarks = torch.cat([state.landmarks_px for state in followed])
            rects_parts.append(roi_mod.rects_from_landmarks(track_landmarks))
            boxes_parts.append(torch.cat([state.boxes_px for state in followed]))
            scores_parts.append(torch.zeros(total_tracks, device=self.device))
        if detections:
            if on_host:
                table = uploaded[order_host.shape[0]:].view(-1, 4 + detections[0][1][0].numel() + 1)
                det_boxes, det_keypoints, det_scores = (table[:, :4], table[:, 4:-1].reshape(table.shape[0], -1, 2),
                                                        table[:, -1])
            else:
                det_boxes, det_keypoints, det_scores = (torch.cat([found[part] for found in detections])
                                                        .to(self.device, torch.float32) for part in range(3))
            rects_parts.append(roi_mod.rects_from_detections(det_boxes, det_keypoints))
            boxes_parts.append(det_boxes)
            scores_parts.append(det_scores)
        return Rois(owner.tolist(), np.concatenate(tracked).tolist(), roi_mod.RotatedRects.cat(rects_parts)[order],
                    torch.cat(boxes_parts)[order], torch.cat(scores_parts)[order])

    def follow(self, states: list[_CameraState], owners: list[int], measured: Measured) -> None:
        """Keep the faces measured in each state's frame as its tracks; a track that held no face
        any more marks the camera as having lost one. (Note [Tracking without per-face work].)"""
        rois_per_frame = np.bincount(np.asarray(owners, dtype=np.int64), minlength=len(states))
        kept_per_frame = [len(rows) for rows in measured.rows]
        kept_rows = np.fromiter((k for rows in measured.rows for k in rows), np.int64, sum(kept_per_frame))
        if kept_rows.shape[0]:
            index = roi_mod.from_host(kept_rows, self.device)
            landmarks, boxes = measured.landmarks_px[index], measured.boxes_px[index]
            boxes_host = measured.boxes_host_px[kept_rows]
        start = 0
        for i, state in enumerate(states):
            state.lost_face = bool(state.face_count) and kept_per_frame[i] < rois_per_frame[i]
            stop = start + kept_per_frame[i]
            if stop > start:
                state.landmarks_px, state.boxes_px = landmarks[start:stop], boxes[start:stop]
                state.boxes_host_px = boxes_host[start:stop]
            else:
                state.landmarks_px, state.boxes_px, state.boxes_host_px = None, None, _no_boxes()
            start = stop


def _detection_boxes_on_host(boxes: list[torch.Tensor]) -> np.ndarray:
    """The detections' boxes (D, 4) float32 on the host, for the overlap test: as they are when
    they came from the host (the daemon's detection worker), else in one copy (after
    :meth:`FacePipeline.detect`'s own wait for the device, nothing is left to wait for)."""
    if not boxes:
        return _no_boxes()
    return torch.cat(boxes).float().cpu().numpy()
