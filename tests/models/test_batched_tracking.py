"""Issue 24 item 1: the tracking step without per-face work (Note [Tracking without per-face
work]) makes the ROIs, and keeps the faces, that the per-face code
made and kept.

The reference is facecast's per-face tracking state from before issue 24, kept here (one object
per followed face; the decision which detections are already followed read back from the
device). Both are driven through the same steps: cameras following 0 to 4 faces, detections on
some frames (near a followed face, so dropped, or new, more than ``max_faces`` leaves room for),
faces measured and kept at random (some tracks lost). CPU, and CUDA where there is one (marker
``gpu``: there the detections given are device tensors, the measured faces too); the reference
runs on the CPU, where the ROIs are made on either device (Note [The next ROIs on the host]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from facecast.models import roi as roi_mod
from facecast.models.face_mesh import Measured, boxes_from_landmarks
from facecast.models.face_tracking import FaceTracks
from facecast.models.nms import box_iou

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")])]
MAX_FACES = 4


# -- the reference: facecast's per-face tracking before issue 24 -------------------------------


@dataclass
class ReferenceTrack:
    landmarks_px: torch.Tensor
    box_px: torch.Tensor


@dataclass
class ReferenceState:
    tracks: list = field(default_factory=list)
    frames_since_detection: int = 0
    lost_face: bool = False


def reference_next_rois(states, det_by_frame, device, max_faces):
    tracks = [track for state in states for track in state.tracks]
    track_owner = [i for i, state in enumerate(states) for _ in state.tracks]
    det_frames = [i for i in sorted(det_by_frame) if det_by_frame[i][0].shape[0]]
    det_owner = [i for i in det_frames for _ in range(det_by_frame[i][0].shape[0])]
    if det_owner:
        det_boxes, det_keypoints, det_scores = (
            torch.cat([det_by_frame[i][part] for i in det_frames]).to(device, torch.float32) for part in range(3))
    if tracks:
        track_landmarks = torch.stack([t.landmarks_px for t in tracks])
        track_boxes = torch.stack([t.box_px for t in tracks])
    if det_owner and tracks:
        same_frame = torch.as_tensor(np.equal.outer(det_owner, track_owner)).to(device)
        overlaps = ((box_iou(det_boxes, track_boxes) * same_frame).amax(dim=1) > 0.3).tolist()
    else:
        overlaps = [False] * len(det_owner)
    owners, sources, tracked = [], [], []
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
                if frame_rois >= max_faces:
                    break
                owners.append(i)
                sources.append(len(tracks) + row)
                tracked.append(False)
                frame_rois += 1
            state.frames_since_detection = 0
        else:
            state.frames_since_detection += 1
    if not owners:
        return [], [], None, None, None
    rects_parts, boxes_parts, scores_parts = [], [], []
    if tracks:
        rects_parts.append(roi_mod.rects_from_landmarks(track_landmarks))
        boxes_parts.append(track_boxes)
        scores_parts.append(torch.zeros(len(tracks), device=device))
    if det_owner:
        rects_parts.append(roi_mod.rects_from_detections(det_boxes, det_keypoints))
        boxes_parts.append(det_boxes)
        scores_parts.append(det_scores)
    order = torch.tensor(sources, device=device)
    return (owners, tracked, roi_mod.RotatedRects.cat(rects_parts)[order], torch.cat(boxes_parts)[order],
            torch.cat(scores_parts)[order])


def reference_follow(states, owners, measured):
    for i, state in enumerate(states):
        state.lost_face = bool(state.tracks) and len(measured.faces[i]) < owners.count(i)
        state.tracks = [ReferenceTrack(torch.from_numpy(measured.landmarks_host_px[k]),
                                       torch.from_numpy(measured.boxes_host_px[k]))
                        for k in measured.rows[i]]


# -- the steps ---------------------------------------------------------------------------------


def face(rng, centre_xy, side_px):
    """Landmarks (478, 3) of a face-sized blob of points around a centre."""
    points = rng.normal(0, side_px / 4, (478, 3)).astype(np.float32)
    points[:, :2] += centre_xy
    return points


def detections(rng, state, device):
    """0 to 6 detections: near followed faces (the same face) and elsewhere (new ones)."""
    boxes = []
    for box in state.boxes_host_px[: rng.integers(0, state.face_count + 1)]:
        boxes.append(box + rng.normal(0, 3, 4))
    for _ in range(rng.integers(0, 5)):
        x, y = rng.uniform(0, 1500, 2)
        side = rng.uniform(60, 200)
        boxes.append(np.array([x, y, x + side, y + side]))
    count = len(boxes)
    boxes = torch.tensor(np.array(boxes).reshape(count, 4), dtype=torch.float32)
    keypoints = (boxes[:, None, :2] + torch.rand(count, 6, 2) * (boxes[:, None, 2:] - boxes[:, None, :2]))
    scores = torch.rand(count)
    return tuple(part.to(device) for part in (boxes, keypoints, scores))


def fake_measured(rng, owners, frames, device, keep=0.8):
    """As FaceMeasurer.measure leaves it: random faces, each frame keeping some of its ROIs
    (each with probability ``keep``)."""
    count = len(owners)
    landmarks = torch.from_numpy(np.stack([face(rng, rng.uniform(100, 1500, 2), rng.uniform(60, 200))
                                           for _ in range(count)])).to(device)
    boxes = boxes_from_landmarks(landmarks)
    rows = [[k for k in range(count) if owners[k] == frame and rng.random() < keep] for frame in range(frames)]
    faces = [[object()] * len(frame_rows) for frame_rows in rows]  # only counted
    return Measured(faces, rows, boxes.cpu().numpy(), landmarks.cpu().numpy())


def assert_same_rois(rois, expected, step, device):
    """The step's ROIs, on the pipeline's device, are the reference's (made on the CPU: Note
    [The next ROIs on the host]) exactly."""
    assert rois.owners == expected[0] and rois.tracked == expected[1], f"step {step}"
    if rois.owners:
        for got, want in ((rois.rects.center_xy_px, expected[2].center_xy_px),
                          (rois.rects.size_wh_px, expected[2].size_wh_px),
                          (rois.rects.rotation_rad, expected[2].rotation_rad),
                          (rois.boxes_px, expected[3]), (rois.scores, expected[4])):
            assert got.device.type == device and got.is_contiguous(), f"step {step}"
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_tracking_steps_match_the_per_face_code(device):
    rng = np.random.default_rng(11)
    tracks = FaceTracks(torch.device(device), MAX_FACES, detect_interval_frames=3)
    all_cameras = [f"cam{k}" for k in range(6)]
    references = {camera: ReferenceState() for camera in all_cameras}
    seen = {"dropped as followed": 0, "cut by max_faces": 0, "lost": 0, "rois": 0, "steps of some cameras": 0}
    for step in range(60):
        # Every camera in order (the daemon's steady state: the last step's block used whole), or
        # some of them in any order (faces from several earlier steps' blocks).
        cameras = (all_cameras if step % 3 == 0
                   else list(rng.permutation(all_cameras)[:rng.integers(1, len(all_cameras) + 1)]))
        seen["steps of some cameras"] += cameras != all_cameras
        reference = [references[camera] for camera in cameras]
        states = tracks.states(cameras)
        det_by_frame = {i: detections(rng, state, device) for i, state in enumerate(states)
                        if tracks.wants_detection(cameras[i]) or rng.random() < 0.2}
        expected = reference_next_rois(reference, det_by_frame, torch.device("cpu"), MAX_FACES)
        rois = tracks.next_rois(states, det_by_frame)
        assert_same_rois(rois, expected, step, device)
        assert [s.frames_since_detection for s in states] == [s.frames_since_detection for s in reference]
        detected = sum(det_by_frame[i][0].shape[0] for i in det_by_frame)
        new = sum(not t for t in rois.tracked)
        seen["dropped as followed"] += sum(
            int((box_iou(det_by_frame[i][0].cpu().numpy(), s.boxes_host_px).max(axis=1) > 0.3).sum())
            for i, s in enumerate(states) if i in det_by_frame and s.face_count and det_by_frame[i][0].shape[0])
        seen["cut by max_faces"] += detected - new > 0 and any(rois.owners.count(i) == MAX_FACES for i in det_by_frame)
        seen["rois"] += len(rois.owners)
        measured = (fake_measured(rng, rois.owners, len(cameras), device) if rois.owners
                    else Measured.nothing(len(cameras)))
        tracks.follow(states, rois.owners, measured)
        reference_follow(reference, rois.owners, measured)
        assert [s.lost_face for s in states] == [s.lost_face for s in reference], f"step {step}"
        seen["lost"] += sum(s.lost_face for s in states)
        for state, want in zip(states, reference):
            assert state.face_count == len(want.tracks)
            if want.tracks:
                np.testing.assert_array_equal(state.landmarks_host_px,
                                              torch.stack([t.landmarks_px for t in want.tracks]).numpy())
                np.testing.assert_array_equal(state.boxes_host_px, torch.stack([t.box_px for t in want.tracks]).numpy())
    assert min(seen.values()) >= 10, seen  # every rule was exercised


@pytest.mark.parametrize("device", DEVICES)
def test_steps_without_detections_match_the_per_face_code(device):
    """Note [The next ROIs on the host]: steps between detection passes, every camera in order
    and every face kept (`facecast analyze`'s steady state and the daemon's, the shortcut), make
    the ROIs and keep the faces that the per-face code does."""
    rng = np.random.default_rng(12)
    tracks = FaceTracks(torch.device(device), MAX_FACES, detect_interval_frames=4)
    cameras = [f"cam{k}" for k in range(3)]
    reference = [ReferenceState() for _ in cameras]
    without_detections = measured_whole = 0
    for step in range(24):
        states = tracks.states(cameras)
        det_by_frame = {i: detections(rng, state, device) for i, state in enumerate(states)
                        if tracks.wants_detection(cameras[i])}
        expected = reference_next_rois(reference, det_by_frame, torch.device("cpu"), MAX_FACES)
        without_detections += bool(expected[0]) and not any(
            found[0].shape[0] for found in det_by_frame.values())
        rois = tracks.next_rois(states, det_by_frame)
        assert_same_rois(rois, expected, step, device)
        assert [s.frames_since_detection for s in states] == [s.frames_since_detection for s in reference]
        measured = (fake_measured(rng, rois.owners, len(cameras), device, keep=1.0) if rois.owners
                    else Measured.nothing(len(cameras)))
        tracks.follow(states, rois.owners, measured)
        reference_follow(reference, rois.owners, measured)
        # Every face kept in the measured order: the tracks keep the measured rows as they are
        # (no gather), which the next step's ROIs above compare with the reference.
        measured_whole += any(state.followed is not None
                              and state.followed.landmarks_host_px is measured.landmarks_host_px
                              for state in states)
        for state, want in zip(states, reference):
            assert state.face_count == len(want.tracks)
    assert without_detections >= 12 and measured_whole >= 12


def test_rects_from_landmarks_in_numpy_are_the_tensor_operations_rects():
    """roi.rect_arrays_from_landmarks (a tracking step's ROIs of followed faces, Note [The next
    ROIs on the host]) gives rects_from_landmarks's values exactly: faces turned every way
    (the angle wrapped at ±π included), of any size, anywhere in the frame."""
    rng = np.random.default_rng(11)
    landmarks = torch.from_numpy((rng.normal(0, 1, (64, 478, 3)) * rng.uniform(5, 300, (64, 1, 1))
                                  + rng.uniform(0, 1900, (64, 1, 3))).astype(np.float32))
    # The eye corners' line straight left: an angle of exactly ±π, where the wrap decides.
    landmarks[0, roi_mod.MESH_ROTATION_END_INDEX, :2] = landmarks[0, roi_mod.MESH_ROTATION_START_INDEX, :2] - \
        torch.tensor([10.0, 0.0])
    expected = roi_mod.rects_from_landmarks(landmarks)
    got = roi_mod.rect_arrays_from_landmarks(landmarks.numpy())
    for name, ours in zip(("center_xy_px", "size_wh_px", "rotation_rad"), got):
        theirs = getattr(expected, name).numpy()
        assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape, name
        np.testing.assert_array_equal(ours, theirs, err_msg=name)
    assert np.abs(got[2]).max() <= np.pi


def test_rects_from_detections_in_numpy_are_the_tensor_operations_rects():
    """roi.rect_arrays_from_detections (a tracking step's ROIs of new faces, Note [The next ROIs
    on the host]) gives rects_from_detections's values exactly: boxes of any size anywhere,
    eyes turned every way (the angle wrapped at ±π included), one or several a step."""
    rng = np.random.default_rng(14)
    for count in (1, 5, 64):
        corner = rng.uniform(0, 1800, (count, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(20, 400, (count, 2))], axis=1).astype(np.float32)
        keypoints = rng.uniform(0, 1900, (count, 6, 2)).astype(np.float32)
        keypoints[0, 1] = keypoints[0, 0] - np.float32([10.0, 0.0])  # an angle of exactly ±π
        expected = roi_mod.rects_from_detections(torch.from_numpy(boxes), torch.from_numpy(keypoints))
        got = roi_mod.rect_arrays_from_detections(boxes, keypoints)
        for name, ours in zip(("center_xy_px", "size_wh_px", "rotation_rad"), got):
            theirs = getattr(expected, name).numpy()
            assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape, name
            np.testing.assert_array_equal(ours, theirs, err_msg=f"{name}, {count} detections")


def test_landmark_extents_over_contiguous_rows_are_the_strided_reductions():
    """roi.xy_extents_on_host of roi.xy_rows_on_host (Note [Landmark extents over a contiguous
    axis]) gives each face's least and greatest x and y over all its points, or its first
    ones, exactly as the reductions over the points' axis; a NaN comes out as NaN."""
    rng = np.random.default_rng(12)
    for faces in (1, 4, 9):
        landmarks = (rng.normal(0, 1, (faces, 478, 3)) * rng.uniform(5, 300, (faces, 1, 1))
                     + rng.uniform(-50, 1900, (faces, 1, 3))).astype(np.float32)
        if faces == 4:
            landmarks[2, 100, 1] = np.nan
        rows = roi_mod.xy_rows_on_host(landmarks)
        assert rows.shape == (faces, 2, 478) and rows.flags.c_contiguous
        for count in (None, 468):
            low, high = roi_mod.xy_extents_on_host(rows, count)
            points = landmarks[:, :count, :2]
            np.testing.assert_array_equal(low, points.min(axis=1))
            np.testing.assert_array_equal(high, points.max(axis=1))
            assert low.dtype == high.dtype == np.float32


def test_landmarks_projected_in_numpy_are_the_tensor_operations_points():
    """face_mesh._project_points_on_host (the CPU stack's landmarks, computed over contiguous
    rows of each coordinate) gives roi.project_points's values exactly: faces turned every
    way, of any size, one or several a batch."""
    from facecast.models.face_mesh import _project_points_on_host

    rng = np.random.default_rng(13)
    for faces in (1, 4, 7):
        points = (rng.uniform(-20, 276, (faces, 478, 3))).astype(np.float32)
        rects = roi_mod.RotatedRects(
            torch.from_numpy(rng.uniform(0, 1900, (faces, 2)).astype(np.float32)),
            torch.from_numpy(np.repeat(rng.uniform(40, 900, (faces, 1)), 2, axis=1).astype(np.float32)),
            torch.from_numpy(rng.uniform(-np.pi, np.pi, faces).astype(np.float32)))
        expected = roi_mod.project_points(torch.from_numpy(points), rects, 256).numpy()
        got = _project_points_on_host(points, rects, 256)
        assert got.dtype == expected.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def test_a_search_of_a_camera_whose_tracks_are_full_changes_nothing():
    """Note [No search where no face could go]: two trackers driven through the same steps, one
    given detections (followed faces and new ones) on every frame of a camera whose tracks fill
    max_faces, the other none there: the same ROIs, step after step, and the same faces kept.
    `has_room` says which cameras those are, and `wants_detection` asks no newcomer search of
    them (a lost face is still asked for)."""
    rng = np.random.default_rng(13)
    searched = FaceTracks(torch.device("cpu"), MAX_FACES, detect_interval_frames=2)
    skipped = FaceTracks(torch.device("cpu"), MAX_FACES, detect_interval_frames=2)
    cameras = [f"cam{k}" for k in range(4)]
    full_frames_searched = 0
    for step in range(80):
        states, other_states = searched.states(cameras), skipped.states(cameras)
        full = [not skipped.has_room(camera) for camera in cameras]
        assert full == [state.face_count == MAX_FACES for state in other_states]
        assert full == [not searched.has_room(camera) for camera in cameras]
        for camera, state, is_full in zip(cameras, other_states, full):
            if is_full:
                assert skipped.wants_detection(camera) == state.lost_face, step
        det_by_frame = {i: detections(rng, state, "cpu") for i, state in enumerate(states)
                        if searched.wants_detection(cameras[i]) or full[i] or rng.random() < 0.3}
        full_frames_searched += sum(full[i] and det_by_frame[i][0].shape[0] > 0 for i in det_by_frame)
        rois = searched.next_rois(states, det_by_frame)
        other_rois = skipped.next_rois(other_states, {i: found for i, found in det_by_frame.items()
                                                      if not full[i]})
        assert_same_rois(other_rois, (rois.owners, rois.tracked, rois.rects, rois.boxes_px, rois.scores)
                         if rois.owners else (rois.owners, rois.tracked), step, "cpu")
        # Keep most faces (so that cameras fill up and stay full), now and then lose some.
        measured = (fake_measured(rng, rois.owners, len(cameras), "cpu", keep=0.97) if rois.owners
                    else Measured.nothing(len(cameras)))
        searched.follow(states, rois.owners, measured)
        skipped.follow(other_states, rois.owners, measured)
        assert [s.face_count for s in states] == [s.face_count for s in other_states]
        assert [s.lost_face for s in states] == [s.lost_face for s in other_states]
    assert full_frames_searched >= 20
