"""The face pipeline's tracking state, per camera: which faces each camera follows, and where its
next frame's ROIs lie (DESIGN §3).

As MediaPipe's face_landmarks_to_roi: a followed face's next ROI comes from this frame's
landmarks, not from a detection; the detector runs only when a camera has no face, lost one, or
every ``detect_interval_frames`` frames to pick up newcomers (:meth:`FaceTracks.wants_detection`).
A detection of a face that is already followed is dropped: the track's ROI follows the mesh,
which is the better one.

Note [Tracking without per-face work]
    The faces that one step's cameras keep are one block (landmarks and boxes on the device, the
    boxes also on the host, from the measuring stage's one transfer); a camera holds a range of
    rows of its last step's block, not an object per face, and no tensor of its own. A step
    makes every camera's ROIs at once: the followed faces' rows gathered from their blocks (none
    at all when, as in the daemon's steady state, the cameras are the last step's in its order),
    one copy of the ROIs' order, the gather's rows and host-side detections to the device, the
    rects of all tracks and all detections in two batched calls, one gather into the ROIs'
    order. Which detections are dropped as already followed (IoU > TRACKED_DETECTION_IOU with a
    followed face's box) and which are cut by ``max_faces`` is decided on the host, with numpy,
    on the host's copies of the boxes, for the frames that have detections: the daemon's
    detections arrive on the host and the tracks' boxes came back in the previous step's table,
    so nothing waits for the device (before issue 24 the decision was read back from the
    device, one wait per step). After measuring, the faces kept in every frame become the new
    block in one gather. The Python loops left run over cameras, doing bookkeeping only.

Note [A tracking step without detections on the CPU]
    Between detection passes (14 frames of 15 in `facecast analyze`) a step on the CPU whose
    followed faces are the last step's block, whole and in order, and which has no detection,
    takes the ROIs straight from the block: the rects from its landmarks, its boxes as they
    are, scores 0. The general path gets the same values through steps that change nothing
    there (no detection to filter, the ROIs' order the block's own: an identity gather of
    each tensor, a one-part concatenation, the order's copy to the "device"), about 40 small
    numpy and torch calls of ~10 us each in place (the landmark model's invoke leaves the
    caches cold). Only on the CPU, where such calls cost host time and nothing else: a GPU's
    step keeps its one sequence of kernels. The rects are computed in numpy there
    (roi.rects_from_landmarks_on_host: the same values, ~20 torch calls fewer). The step before
    it, `follow`, keeps the measured rows themselves as the block where every measured face is
    kept in the measured order (one face a frame, always), not an identity gather of each:
    0.063 -> 0.030 ms a 720p frame in place (2026-11-27).
"""

from __future__ import annotations

from dataclasses import dataclass
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
class _Followed:
    """The faces that one step's cameras kept, all of them (Note [Tracking without per-face
    work])."""

    landmarks_px: torch.Tensor  # (n, 478, 3) on the pipeline's device
    boxes_px: torch.Tensor  # (n, 4) on the device
    boxes_host_px: np.ndarray  # (n, 4) float32: the same boxes on the host


@dataclass
class _CameraState:
    followed: _Followed | None = None  # the block holding this camera's faces
    first_row: int = 0  # ... from this row
    face_count: int = 0  # ... this many
    frames_since_detection: int = 0
    lost_face: bool = False

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + self.face_count)

    @property
    def boxes_host_px(self) -> np.ndarray:
        return self.followed.boxes_host_px[self.rows] if self.face_count else _no_boxes()

    @property
    def landmarks_px(self) -> torch.Tensor | None:
        """(k, 478, 3) on the device: the faces followed (a view of the block; for tests)."""
        return self.followed.landmarks_px[self.rows] if self.face_count else None

    @property
    def boxes_px(self) -> torch.Tensor | None:
        return self.followed.boxes_px[self.rows] if self.face_count else None


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
        for i, state in enumerate(states):
            state.frames_since_detection = 0 if i in det_by_frame else state.frames_since_detection + 1
        if self.device.type == "cpu" and not any(found[0].shape[0] for found in det_by_frame.values()):
            whole = self._followed_whole(states)  # Note [A tracking step without detections on the CPU]
            if whole is not None:
                return whole
        frames = len(states)
        track_counts = np.fromiter((state.face_count for state in states), np.int64, frames)
        total_tracks = int(track_counts.sum())
        track_owner = np.repeat(np.arange(frames), track_counts)
        blocks, track_rows, whole = self._followed_rows(states, track_counts)
        det_frames = [i for i in sorted(det_by_frame) if det_by_frame[i][0].shape[0]]
        det_counts = np.fromiter((det_by_frame[i][0].shape[0] for i in det_frames), np.int64, len(det_frames))
        det_owner = np.repeat(np.asarray(det_frames, np.int64), det_counts)
        # A detection of a face already followed is dropped: the track's ROI is the better one
        # (it follows the mesh, not a coarse box). Then as many as max_faces leaves room for.
        new = np.ones(det_owner.shape[0], bool)
        if det_owner.shape[0] and total_tracks:
            track_boxes_host = np.concatenate([block.boxes_host_px for block in blocks])[track_rows]
            iou = box_iou(_detection_boxes_on_host([det_by_frame[i][0] for i in det_frames]), track_boxes_host)
            new = (iou * (det_owner[:, None] == track_owner[None, :])).max(axis=1) <= TRACKED_DETECTION_IOU
        new_before_frame = np.cumsum(new) - new  # new detections of earlier rows
        frame_start = np.repeat(np.cumsum(det_counts) - det_counts, det_counts)
        rank = new_before_frame - new_before_frame[frame_start] + new  # 1-based among the frame's new ones
        new &= rank <= self.max_faces - track_counts[det_owner]
        # Per frame its tracks, then its new detections: rows of cat(tracks, detections).
        owner = np.concatenate([track_owner, det_owner[new]])
        if not owner.shape[0]:
            return Rois([], [], None, None, None)
        sources = np.concatenate([np.arange(total_tracks), total_tracks + np.flatnonzero(new)])
        order_host = np.argsort(owner, kind="stable")  # tracks came first in the concatenation
        owner, sources = owner[order_host], sources[order_host]
        tracked = order_host < total_tracks

        # One copy to the device: the ROIs' order, the followed faces' rows (unless a block is
        # used whole), and the detections when they are on the host.
        detections = [det_by_frame[i] for i in det_frames]
        on_host = bool(detections) and detections[0][0].device.type == "cpu"
        upload = [sources.astype(np.float32), track_rows.astype(np.float32)[:0 if whole else None]]
        if on_host:
            upload.append(np.concatenate([torch.cat([part.reshape(part.shape[0], -1) for part in found], dim=1)
                                          .float().numpy() for found in detections]).ravel())
        uploaded = roi_mod.from_host(np.concatenate(upload), self.device)
        order = uploaded[:sources.shape[0]].long()
        after_rows = sources.shape[0] + upload[1].shape[0]

        rects_parts, boxes_parts, scores_parts = [], [], []
        if total_tracks:
            landmarks, boxes = ((torch.cat([block.landmarks_px for block in blocks]),
                                 torch.cat([block.boxes_px for block in blocks])) if len(blocks) > 1
                                else (blocks[0].landmarks_px, blocks[0].boxes_px))
            if not whole:
                index = uploaded[sources.shape[0]:after_rows].long()
                landmarks, boxes = landmarks[index], boxes[index]
            rects_parts.append(roi_mod.rects_from_landmarks(landmarks))
            boxes_parts.append(boxes)
            scores_parts.append(torch.zeros(total_tracks, device=self.device))
        if detections:
            if on_host:
                table = uploaded[after_rows:].view(int(det_counts.sum()), -1)
                det_boxes, det_keypoints, det_scores = (table[:, :4], table[:, 4:-1].reshape(table.shape[0], -1, 2),
                                                        table[:, -1])
            else:
                det_boxes, det_keypoints, det_scores = (torch.cat([found[part] for found in detections])
                                                        .to(self.device, torch.float32) for part in range(3))
            rects_parts.append(roi_mod.rects_from_detections(det_boxes, det_keypoints))
            boxes_parts.append(det_boxes)
            scores_parts.append(det_scores)
        return Rois(owner.tolist(), tracked.tolist(), roi_mod.RotatedRects.cat(rects_parts)[order],
                    torch.cat(boxes_parts)[order], torch.cat(scores_parts)[order])

    def _followed_whole(self, states: list[_CameraState]) -> Rois | None:
        """Note [A tracking step without detections on the CPU]: the ROIs of the states' tracks
        when they are one block, whole and in the states' order (else None: the general path)."""
        block, owners = None, []
        for i, state in enumerate(states):
            if not state.face_count:
                continue
            if block is None:
                block = state.followed
            if state.followed is not block or state.first_row != len(owners):
                return None
            owners += [i] * state.face_count
        if block is None or len(owners) != block.boxes_host_px.shape[0]:
            return None
        return Rois(owners, [True] * len(owners), roi_mod.rects_from_landmarks_on_host(block.landmarks_px),
                    block.boxes_px, torch.zeros(len(owners), device=self.device))

    @staticmethod
    def _followed_rows(states: list[_CameraState], track_counts: np.ndarray
                       ) -> tuple[list[_Followed], np.ndarray, bool]:
        """The blocks holding the states' followed faces (in order of first use) and the rows,
        in the blocks one after the other, of the states' faces in order; whether that is the
        one block, whole and in order (the daemon's steady state: no gather). (Note [Tracking
        without per-face work].)"""
        with_faces = [state for state in states if state.face_count]
        if not with_faces:
            return [], np.zeros(0, np.int64), True
        blocks = list({id(state.followed): state.followed for state in with_faces}.values())
        block_start = {id(block): start for block, start in zip(
            blocks, np.cumsum([0] + [block.boxes_host_px.shape[0] for block in blocks]).tolist())}
        counts = track_counts[track_counts > 0]
        first_rows = np.fromiter((state.first_row + block_start[id(state.followed)] for state in with_faces),
                                 np.int64, len(with_faces))
        rows = np.arange(int(counts.sum())) + np.repeat(first_rows - (np.cumsum(counts) - counts), counts)
        whole = len(blocks) == 1 and rows.shape[0] == blocks[0].boxes_host_px.shape[0] and bool(
            (rows == np.arange(rows.shape[0])).all())
        return blocks, rows, whole

    def follow(self, states: list[_CameraState], owners: list[int], measured: Measured) -> None:
        """Keep the faces measured in each state's frame as its tracks; a track that held no face
        any more marks the camera as having lost one. (Note [Tracking without per-face work].)"""
        rois_per_frame = np.bincount(np.asarray(owners, dtype=np.int64), minlength=len(states))
        kept_per_frame = [len(rows) for rows in measured.rows]
        kept_rows = np.fromiter((k for rows in measured.rows for k in rows), np.int64, sum(kept_per_frame))
        followed = None
        kept = kept_rows.shape[0]
        if (kept and self.device.type == "cpu" and kept == measured.boxes_host_px.shape[0]
                and (kept_rows == np.arange(kept)).all()):
            # Every face kept, in the measured order (one face a frame, always): on the CPU the
            # measured rows as they are, not an identity gather of each (Note [A tracking step
            # without detections on the CPU]); the measured table is the step's own.
            followed = _Followed(measured.landmarks_px, measured.boxes_px, measured.boxes_host_px)
        elif kept:
            index = roi_mod.from_host(kept_rows, self.device)
            followed = _Followed(measured.landmarks_px[index], measured.boxes_px[index],
                                 measured.boxes_host_px[kept_rows])
        first_row = 0
        for i, state in enumerate(states):
            state.lost_face = bool(state.face_count) and kept_per_frame[i] < rois_per_frame[i]
            state.followed = followed if kept_per_frame[i] else None
            state.first_row, state.face_count = first_row, kept_per_frame[i]
            first_row += kept_per_frame[i]


def _detection_boxes_on_host(boxes: list[torch.Tensor]) -> np.ndarray:
    """The detections' boxes (D, 4) float32 on the host, for the overlap test: as they are when
    they came from the host (the daemon's detection worker), else in one copy (after
    :meth:`FacePipeline.detect`'s own wait for the device, nothing is left to wait for)."""
    if not boxes:
        return _no_boxes()
    return torch.cat(boxes).float().cpu().numpy()
