"""The face pipeline's tracking state, per camera: which faces each camera follows, and where its
next frame's ROIs lie (DESIGN §3).

As MediaPipe's face_landmarks_to_roi: a followed face's next ROI comes from this frame's
landmarks, not from a detection; the detector runs only when a camera has no face, lost one, or
every ``detect_interval_frames`` frames to pick up newcomers where one could still be followed
(:meth:`FaceTracks.wants_detection`). A detection of a face that is already followed is dropped:
the track's ROI follows the mesh, which is the better one.

Note [No search where no face could go]
    A detection pass starts faces only in the room a camera's tracks leave: a detection of a
    followed face is dropped, and new ones are cut at ``max_faces`` (`next_rois`). So where a
    camera follows ``max_faces`` faces, a search for newcomers cannot change what is measured,
    in this frame or any later one, and it is not made: the periodic and the device's-room
    passes (daemon.detect_interval_s, Note [Detection while the device has room],
    workers/inference/detection.py) look only where there is room (`has_room`); a camera that
    loses a face asks for a pass at once, as before. This is MediaPipe's gate too (its detector
    runs only while it tracks fewer faces than `num_faces`). The cost it saves is large: a pass
    is two detectors over the whole frame, about 2.8 ms of CPU a frame averaged in `facecast
    analyze` on the 2-core machine (a pass every 15th frame, 2026-11-28), and on a GPU at 64
    cameras with as many faces as `max_faces` the newcomer searches took ~37 % of the device's
    time (2026-11-27) while starting no face. What it gives up: nothing a stream showed, by
    the rule above; a face beyond ``max_faces`` was never followed.

Note [Tracking without per-face work]
    The faces that one step's cameras keep are one block (their landmarks and boxes, on the
    host, from the measuring stage's one transfer); a camera holds a range of rows of its last
    step's block, not an object per face. A step makes every camera's ROIs at once: the
    followed faces' rows gathered from their blocks (none at all when, as in the daemon's steady
    state, the cameras are the last step's in its order), the rects of all tracks and all
    detections in two batched calls, one gather into the ROIs' order. Which detections are
    dropped as already followed (IoU > TRACKED_DETECTION_IOU with a followed face's box) and
    which are cut by ``max_faces`` is decided with the rest, on the host: the daemon's
    detections arrive there, so nothing waits for the device (before issue 24 the decision was
    read back from the device, one wait per step). After measuring, the faces kept in every
    frame become the new block (the measured rows as they are where every face is kept in the
    measured order, else one gather). The Python loops left run over cameras, doing
    bookkeeping only.

Note [The next ROIs on the host]
    A step's ROIs are computed on the host in numpy, on any device, and go to the device in
    one copy (rects, boxes and scores: each a contiguous part of it). On a GPU they were
    device tensors made by ~30 kernels launched one by one (the rects, the gathers into the
    ROIs' order, the concatenations; `follow`'s gather 3 more), of the ~46 a measuring batch
    launched beside its graph (bench/gpu_trace.py, 2026-11-27 23:17), and the step's host
    calls were 29 % of a measuring worker's CPU samples at 64 cameras (py-spy, 2026-11-27
    18:58, H100); the host has every input already (the measured
    landmarks and boxes come back in the batch's one transfer, detections arrive on the host),
    and numpy over ~24 faces takes microseconds where each kernel launch costs the host and
    the GPU a turn. The values are the tensors' path's on the CPU exactly
    (roi.rect_arrays_from_landmarks and rect_arrays_from_detections: torch's atan2 on the CPU,
    the rest IEEE arithmetic in the same order; tests/models/test_batched_tracking.py); on a
    GPU they may differ from what its kernels gave in an angle's last bit. A step whose followed
    faces are the last step's block, whole and in order, with no detection (between detection
    passes: 14 frames of 15 in `facecast analyze`, most of the daemon's) takes the ROIs straight
    from the block, without the gathers' bookkeeping (about 40 small numpy and torch calls of
    ~10 us each on the 2-core machine, where the landmark model's invoke leaves the caches
    cold; 0.063 -> 0.030 ms a 720p frame for `follow`'s part, 2026-11-27).
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

    landmarks_host_px: np.ndarray  # (n, 478, 3) float32, from the measuring stage's one transfer
    boxes_host_px: np.ndarray  # (n, 4) float32, from it too


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
    def landmarks_host_px(self) -> np.ndarray | None:
        """(k, 478, 3): the faces followed (a view of the block; for tests)."""
        return self.followed.landmarks_host_px[self.rows] if self.face_count else None


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
        one, or it is time to look for newcomers and one could be followed (Note [No search
        where no face could go])."""
        state = self.cameras.get(camera_id)
        return (state is None or not state.face_count or state.lost_face
                or (state.frames_since_detection >= self.detect_interval_frames
                    and self.has_room(camera_id)))

    def has_room(self, camera_id: Hashable) -> bool:
        """Whether a newcomer found on the camera's next frame would be followed: it follows
        fewer than ``max_faces`` faces (Note [No search where no face could go])."""
        state = self.cameras.get(camera_id)
        return state is None or state.face_count < self.max_faces

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
        if not any(found[0].shape[0] for found in det_by_frame.values()):
            whole = self._followed_whole(states)  # Note [The next ROIs on the host]
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
        # Every track's landmarks and boxes and every detection's parts, on the host (Note [The
        # next ROIs on the host]): for the decisions below and the ROIs made from them.
        if total_tracks:
            landmarks, boxes = ((np.concatenate([block.landmarks_host_px for block in blocks]),
                                 np.concatenate([block.boxes_host_px for block in blocks])) if len(blocks) > 1
                                else (blocks[0].landmarks_host_px, blocks[0].boxes_host_px))
            if not whole:
                landmarks, boxes = landmarks[track_rows], boxes[track_rows]
        if det_frames:
            det_boxes, det_keypoints, det_scores = (
                np.concatenate([_on_host(det_by_frame[i][part]) for i in det_frames]) for part in range(3))
        # A detection of a face already followed is dropped: the track's ROI is the better one
        # (it follows the mesh, not a coarse box). Then as many as max_faces leaves room for.
        new = np.ones(det_owner.shape[0], bool)
        if det_owner.shape[0] and total_tracks:
            iou = box_iou(det_boxes, boxes)
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

        # The ROIs: every track's and every detection's, then the ROIs' rows of them, in one
        # copy to the device.
        parts = []
        if total_tracks:
            parts.append((*roi_mod.rect_arrays_from_landmarks(landmarks), boxes,
                          np.zeros(total_tracks, np.float32)))
        if det_frames:
            parts.append((*roi_mod.rect_arrays_from_detections(det_boxes, det_keypoints), det_boxes, det_scores))
        return _rois_on(self.device, owner.tolist(), tracked.tolist(),
                        *(np.concatenate(column)[sources] for column in zip(*parts)))

    def _followed_whole(self, states: list[_CameraState]) -> Rois | None:
        """Note [The next ROIs on the host]: the ROIs of the states' tracks when they are one
        block, whole and in the states' order (else None: the general path)."""
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
        return _rois_on(self.device, owners, [True] * len(owners),
                        *roi_mod.rect_arrays_from_landmarks(block.landmarks_host_px), block.boxes_host_px,
                        np.zeros(len(owners), np.float32))

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
        if kept and kept == measured.boxes_host_px.shape[0] and (kept_rows == np.arange(kept)).all():
            # Every face kept, in the measured order (one face a frame, always): the measured
            # rows as they are, not a copy (the host's table is the step's own).
            followed = _Followed(measured.landmarks_host_px, measured.boxes_host_px)
        elif kept:
            followed = _Followed(measured.landmarks_host_px[kept_rows], measured.boxes_host_px[kept_rows])
        first_row = 0
        for i, state in enumerate(states):
            state.lost_face = bool(state.face_count) and kept_per_frame[i] < rois_per_frame[i]
            state.followed = followed if kept_per_frame[i] else None
            state.first_row, state.face_count = first_row, kept_per_frame[i]
            first_row += kept_per_frame[i]


def _on_host(part: torch.Tensor) -> np.ndarray:
    """A detection's boxes, keypoints or scores as float32 numpy: as they are when they came
    from the host (the daemon's detection worker, FacePipeline.detect, after its own one wait
    for the device), else copied (a wait for the device: tests only)."""
    return part.detach().to("cpu", torch.float32).numpy()


def _rois_on(device: torch.device, owners: list[int], tracked: list[bool], center: np.ndarray,
             size: np.ndarray, rotation: np.ndarray, boxes: np.ndarray, scores: np.ndarray) -> Rois:
    """Rois of the host's columns, in one copy to ``device``: each a contiguous part of it."""
    count = len(owners)
    uploaded = roi_mod.from_host(np.concatenate([center.ravel(), size.ravel(), rotation.ravel(),
                                                 boxes.ravel(), scores.ravel()]).astype(np.float32, copy=False),
                                 device)
    center_t, size_t, rotation_t, boxes_t, scores_t = uploaded.split([2 * count, 2 * count, count, 4 * count, count])
    return Rois(owners, tracked, roi_mod.RotatedRects(center_t.view(count, 2), size_t.view(count, 2), rotation_t),
                boxes_t.view(count, 4), scores_t)
