"""Issue 24 item 1: the measuring stage's per-face host work, moved onto the device and batched
(Note [Measuring on the device]), gives what the per-face code gave.

The references are facecast's per-face implementations from before issue 24, kept here (the
library keeps only the batched ones): MediaPipe's geometry pipeline in numpy (Note [Face geometry
as MediaPipe computes it]), head pose with Python-list indexing, and the measuring stage's host
loop with the greedy ``nms.drop_overlapping`` (which the body pose still uses). Inputs are real:
the CPU pipeline's landmarks on the two test photos, mirrored, rotated and scaled, and random
perturbations of them; duplicates (ROIs that converge on one face) and faces below min_presence
included. Each comparison runs on the CPU, and on CUDA where there is one (marker ``gpu``).
"""

from __future__ import annotations


import cv2
import numpy as np
import pytest
import torch

from facecast.models import nms, roi
from facecast.models.face_geometry import (
    _FLIP_YZ,
    PROCRUSTES_METHODS,
    FaceGeometry,
    determinant_3x3,
    head_pose_from_matrices,
    head_pose_on_host,
    rotation_and_translation,
    weighted_procrustes,
)
from facecast.models.face_mesh import SAME_FACE_IOU, boxes_from_landmarks
from facecast.models.head_pose import (
    CHIN_INDEX,
    FOREHEAD_INDEX,
    SYMMETRIC_PAIRS,
    euler_from_rotation,
    head_pose_deg,
    rotation_from_euler,
)
from facecast.models.pipeline import FacePipeline

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")])]


# -- the references: facecast's per-face implementations before issue 24 -----------------------


def reference_weighted_procrustes(source, target, weights):
    w = weights / weights.sum()
    source_centre = w @ source
    target_centre = np.einsum("k,nkc->nc", w, target)
    centred_source = source - source_centre
    covariance = np.einsum("k,nki,kj->nij", w, target - target_centre[:, None], centred_source)
    u, singular, vt = np.linalg.svd(covariance)
    reflection = np.sign(np.linalg.det(u) * np.linalg.det(vt))
    correction = np.ones((len(target), 3))
    correction[:, 2] = np.where(reflection < 0, -1.0, 1.0)
    rotation = (u * correction[:, None, :]) @ vt
    scale = (singular * correction).sum(-1) / (w @ (centred_source ** 2).sum(-1))
    translation = target_centre - scale[:, None] * (rotation @ source_centre)
    return scale, rotation, translation


def reference_matrices(geometry: FaceGeometry, landmarks_px: np.ndarray, frame_wh_px: np.ndarray) -> np.ndarray:
    used = np.flatnonzero(geometry.metadata.landmark_weights > 0)
    source = geometry.metadata.canonical_vertices_cm[used]
    weights = geometry.metadata.landmark_weights[used]
    near, near_height = geometry.near, geometry.near_height

    def fit(points):
        return reference_weighted_procrustes(source, points[:, used], weights)

    def unproject(screen, depth_offset, scale):
        depth = (screen[..., 2] - depth_offset + near) / scale[:, None]
        return np.stack([screen[..., 0] * depth / near, screen[..., 1] * depth / near, -depth], axis=-1)

    points = np.asarray(landmarks_px, np.float64)[:, :468]
    count = points.shape[0]
    out = np.tile(np.eye(4), (count, 1, 1))
    size = np.asarray(frame_wh_px, np.float64).reshape(count, 1, 2)
    width, height = size[..., 0], size[..., 1]
    near_width = near_height * width / height
    screen = np.empty_like(points)
    screen[..., 0] = points[..., 0] / width * near_width - near_width / 2
    screen[..., 1] = (1.0 - points[..., 1] / height) * near_height - near_height / 2
    screen[..., 2] = points[..., 2] / width * near_width
    depth_offset = screen[..., 2].mean(axis=1, keepdims=True)
    first_scale = fit(screen * np.array([1.0, 1.0, -1.0]))[0]
    second_scale = fit(unproject(screen, depth_offset, first_scale))[0]
    scale, rotation, translation = fit(unproject(screen, depth_offset, first_scale * second_scale))
    out[:, :3, :3] = scale[:, None, None] * rotation
    out[:, :3, 3] = translation
    return out


def reference_head_pose_from_matrices(matrices: np.ndarray) -> np.ndarray:
    rotations, _ = rotation_and_translation(np.asarray(matrices, np.float64))
    return euler_from_rotation(torch.from_numpy(_FLIP_YZ @ rotations @ _FLIP_YZ)).numpy()


def reference_head_pose_deg(landmarks: torch.Tensor) -> torch.Tensor:
    points = landmarks.double()
    right = points[:, [r for r, _ in SYMMETRIC_PAIRS]]
    left = points[:, [l for _, l in SYMMETRIC_PAIRS]]
    x_axis = torch.nn.functional.normalize((left - right).mean(dim=1), dim=-1)
    down = points[:, CHIN_INDEX] - points[:, FOREHEAD_INDEX]
    down = down - (down * x_axis).sum(-1, keepdim=True) * x_axis
    y_axis = torch.nn.functional.normalize(down, dim=-1)
    frame = torch.stack([x_axis, y_axis, torch.linalg.cross(x_axis, y_axis)], dim=-1)
    return euler_from_rotation(frame).to(landmarks.dtype)


def reference_kept(boxes: np.ndarray, presence: np.ndarray, groups: np.ndarray, min_presence: float,
                   max_kept: int) -> list[list[int]]:
    """The measuring stage's filter before issue 24: per frame, the faces at or above
    min_presence, ``nms.drop_overlapping`` by presence on their landmark bounds, the first
    max_kept."""
    kept = []
    for group in range(int(groups.max()) + 1):
        candidates = [k for k in np.flatnonzero(groups == group) if presence[k] >= min_presence]
        kept.append(nms.drop_overlapping(candidates, lambda k: boxes[k], lambda k: float(presence[k]),
                                         SAME_FACE_IOU)[:max_kept])
    return kept


def reference_faces(geometry, min_presence, max_faces, sizes_hw, owners, tracked, landmarks, presence, blendshapes,
                    roi_boxes, roi_scores):
    """The measuring stage's host half before issue 24, on the models' outputs: (faces as dicts,
    rows) per frame."""
    count = len(owners)
    is_tracked = torch.tensor(tracked)
    boxes = torch.where(is_tracked[:, None], boxes_from_landmarks(landmarks), roi_boxes.float()).numpy()
    scores = torch.where(is_tracked, presence, roi_scores.float()).numpy()
    landmarks_np = np.ascontiguousarray(landmarks.float().numpy()).reshape(count, 478, 3)
    presence_np = presence.float().numpy()
    poses = reference_head_pose_deg(landmarks).float().numpy()
    matrices = translations = None
    if geometry is not None:
        frame_wh = np.asarray([sizes_hw[frame][::-1] for frame in owners], np.float64)
        matrices = reference_matrices(geometry, landmarks_np, frame_wh)
        translations = matrices[:, :3, 3]
        poses = reference_head_pose_from_matrices(matrices)
    bounds = np.concatenate([landmarks_np[..., :2].min(1), landmarks_np[..., :2].max(1)], axis=1)
    rows = reference_kept(bounds, presence_np, np.asarray(owners), min_presence, max_faces)
    rows += [[] for _ in range(len(sizes_hw) - len(rows))]
    faces = [[{"box": boxes[k], "score": scores[k], "landmarks": landmarks_np[k], "head_pose": poses[k],
               "presence": presence_np[k], "tracked": tracked[k],
               "blendshapes": None if blendshapes is None else blendshapes[k].float().numpy(),
               "transform_matrix": None if matrices is None else matrices[k].astype(np.float32),
               "head_translation_cm": None if translations is None else translations[k]}
              for k in frame_rows] for frame_rows in rows]
    return faces, rows


# -- inputs: real landmarks ------------------------------------------------------------------------


def variants(photos: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The two photos (BGR) as they are, mirrored, rotated by 25° and by 90°, shrunk and enlarged
    into a wider frame: faces in frames of eight sizes and aspects, upright and rolled; and a
    frame with three faces side by side (more than the measuring stage keeps)."""
    frames = []
    for rgb in photos.values():
        bgr = np.ascontiguousarray(rgb[..., ::-1])
        height, width = bgr.shape[:2]
        turn = cv2.getRotationMatrix2D((width / 2, height / 2), 25, 1.0)
        wide = np.full((height, int(width * 1.8), 3), 90, np.uint8)
        small = cv2.resize(bgr, None, fx=0.6, fy=0.6, interpolation=cv2.INTER_AREA)
        wide[:small.shape[0], -small.shape[1]:] = small
        frames += [bgr, np.ascontiguousarray(bgr[:, ::-1]),
                   cv2.warpAffine(bgr, turn, (width, height), borderMode=cv2.BORDER_REFLECT101),
                   np.ascontiguousarray(cv2.rotate(bgr, cv2.ROTATE_90_CLOCKWISE)),
                   wide, cv2.resize(bgr, None, fx=1.5, fy=1.5, interpolation=cv2.INTER_LINEAR)]
    astronaut, grace_hopper = (np.ascontiguousarray(photos[name][..., ::-1]) for name in ("astronaut", "grace_hopper"))
    grace_hopper = cv2.resize(grace_hopper, None, fx=astronaut.shape[0] / grace_hopper.shape[0],
                              fy=astronaut.shape[0] / grace_hopper.shape[0], interpolation=cv2.INTER_AREA)
    frames.append(np.ascontiguousarray(np.concatenate([astronaut, grace_hopper, astronaut[:, ::-1]], axis=1)))
    return frames


MAX_FACES = 2  # what the measuring stage keeps per frame in these tests (the detector finds up to 4)


@pytest.fixture(scope="module")
def face_stack(landmarker_bundle):
    """FaceLandmarker's stack on the CPU (the transformation matrix's path)."""
    torch.set_num_threads(1)  # as the other model tests: 2 cores shared with a busy process
    return FacePipeline("cpu", max_faces=4, face_landmarker_task=landmarker_bundle.task_path)


@pytest.fixture(scope="module")
def attention_stack(installed_models):
    """The attention mesh on the CPU (head pose measured from the landmarks)."""
    torch.set_num_threads(1)
    return FacePipeline("cpu", max_faces=4, full_range=False)


@pytest.fixture(scope="module")
def frames(photos) -> list[np.ndarray]:
    return variants(photos)


@pytest.fixture(scope="module")
def detections(face_stack, frames):
    """Every frame's detections (boxes, keypoints, scores) and the FaceLandmarker stack's faces."""
    batch = roi.FrameBatch(frames, "cpu")
    with torch.inference_mode():
        found = face_stack.detect(batch)
    assert [len(scores) for _, _, scores in found] == [1] * (len(frames) - 1) + [3], "every variant's faces"
    return found


@pytest.fixture(scope="module")
def real_faces(face_stack, frames, detections) -> tuple[np.ndarray, np.ndarray]:
    """Landmarks (N, 478, 3) of every face of every variant, and their frames' (width, height)."""
    owners = [i for i, (boxes, _, _) in enumerate(detections) for _ in range(boxes.shape[0])]
    rects = roi.rects_from_detections(torch.cat([d[0] for d in detections]), torch.cat([d[1] for d in detections]))
    with torch.inference_mode():
        crops = roi.crop_rois(roi.FrameBatch(frames, "cpu"), torch.tensor(owners), rects, face_stack.measurer.input_px,
                              border="replicate")
        landmarks = face_stack.measurer.landmarks_core(crops, rects)[0]
    sizes = np.asarray([frames[i].shape[1::-1] for i in owners], np.float64)
    return landmarks.numpy(), sizes


def perturbed(landmarks: np.ndarray, sizes: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random variations of real faces: turned in 3D about their centre (yaw and pitch up to
    50°, roll up to 180°), scaled, moved, with noise on every point, in frames of other sizes."""
    rng = np.random.default_rng(seed)
    count = len(landmarks)
    angles = np.stack([rng.uniform(-50, 50, count), rng.uniform(-50, 50, count), rng.uniform(-180, 180, count)], -1)
    turn = rotation_from_euler(torch.from_numpy(angles)).numpy()
    centre = landmarks.mean(axis=1, keepdims=True)
    scale = rng.uniform(0.3, 3.0, (count, 1, 1))
    moved = scale * np.einsum("nij,nkj->nki", turn, landmarks - centre) + centre
    moved[..., :2] += rng.uniform(-100, 100, (count, 1, 2))
    moved += rng.normal(0, 1.0, moved.shape)
    return moved.astype(np.float32), sizes * rng.uniform(0.7, 2.0, (count, 1))


# -- the transformation matrix ------------------------------------------------------------------


@pytest.mark.parametrize("method", PROCRUSTES_METHODS)
@pytest.mark.parametrize("device", DEVICES)
def test_batched_procrustes_matches_the_per_face_fit_mirrors_included(landmarker_bundle, device, method):
    geometry = FaceGeometry.read(landmarker_bundle.geometry_metadata)
    used = np.flatnonzero(geometry.metadata.landmark_weights > 0)
    source = geometry.metadata.canonical_vertices_cm[used]
    weights = geometry.metadata.landmark_weights[used]
    rng = np.random.default_rng(5)
    count = 200
    turn = rotation_from_euler(torch.from_numpy(rng.uniform(-180, 180, (count, 3)))).numpy()
    target = (rng.uniform(0.2, 5, (count, 1, 1)) * np.einsum("nij,kj->nki", turn, source)
              + rng.normal(0, 30, (count, 1, 3)) + rng.normal(0, 0.3, (count, len(source), 3)))
    target[::2, :, 0] *= -1  # mirror images: the fit must undo a reflection
    expected = reference_weighted_procrustes(source, target, weights)
    as_tensor = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
    got = [part.cpu().numpy()
           for part in weighted_procrustes(as_tensor(source), as_tensor(target), as_tensor(weights), method)]
    for name, ours, theirs in zip(("scale", "rotation", "translation"), got, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-9, err_msg=name)
    np.testing.assert_allclose(determinant_3x3(torch.from_numpy(got[1])), 1.0, atol=1e-12)
    np.testing.assert_allclose(determinant_3x3(torch.from_numpy(turn)), np.linalg.det(turn), atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", PROCRUSTES_METHODS)
def test_batched_matrices_and_poses_match_the_per_face_pipeline(landmarker_bundle, real_faces, device, method):
    geometry = FaceGeometry.read(landmarker_bundle.geometry_metadata, procrustes_method=method)
    landmarks, sizes = real_faces
    cases = [(landmarks, sizes)] + [perturbed(landmarks, sizes, seed) for seed in range(8)]
    landmarks = np.concatenate([case[0] for case in cases])
    sizes = np.concatenate([case[1] for case in cases])
    expected = reference_matrices(geometry, landmarks, sizes)
    got = geometry.matrices(torch.from_numpy(landmarks).to(device), torch.from_numpy(sizes).to(device))
    assert got.dtype == torch.float64 and got.shape == (len(landmarks), 4, 4)
    np.testing.assert_allclose(got.cpu().numpy(), expected, rtol=1e-9, atol=1e-9)
    poses = head_pose_from_matrices(got).cpu().numpy()
    expected_poses = reference_head_pose_from_matrices(expected)
    assert np.abs(expected_poses[:, 0]).max() > 40 and np.abs(expected_poses[:, 2]).max() > 150
    np.testing.assert_allclose(poses, expected_poses, atol=1e-7)
    # A matrix with only the batch's own rows: no face's result depends on another's.
    one = geometry.matrices(torch.from_numpy(landmarks[3:4]).to(device), torch.from_numpy(sizes[3:4]).to(device))
    np.testing.assert_allclose(one.cpu().numpy(), expected[3:4], rtol=1e-9, atol=1e-9)


def test_numpy_geometry_on_the_cpu_matches_the_tensor_operations(landmarker_bundle, real_faces):
    """Note [Face geometry on the CPU in numpy]: the CPU stack's matrices and poses, computed in
    numpy, are the tensors' path's to float64 rounding (faces turned every way and a mirror
    image), with the frame sizes float32 as the measuring table holds them."""
    geometry = FaceGeometry.read(landmarker_bundle.geometry_metadata, procrustes_method="eigh")
    landmarks, sizes = real_faces
    cases = [(landmarks, sizes)] + [perturbed(landmarks, sizes, seed) for seed in range(4)]
    landmarks = np.concatenate([case[0] for case in cases])
    sizes = np.concatenate([case[1] for case in cases]).astype(np.float32)
    landmarks[1, :, 0] = 2 * landmarks[1, :, 0].mean() - landmarks[1, :, 0]  # a mirror image
    as_tensors = geometry._matrices_as_tensors(torch.from_numpy(landmarks), torch.from_numpy(sizes))
    got = geometry.matrices(torch.from_numpy(landmarks), torch.from_numpy(sizes))
    assert got.dtype == torch.float64 and got.shape == as_tensors.shape
    np.testing.assert_allclose(got.numpy(), as_tensors.numpy(), rtol=1e-9, atol=1e-9)
    poses = head_pose_on_host(got.numpy())
    assert poses.dtype == np.float64 and poses.shape == (len(landmarks), 3)
    np.testing.assert_allclose(poses, head_pose_from_matrices(as_tensors).numpy(), rtol=0, atol=1e-9)
    np.testing.assert_allclose(poses, reference_head_pose_from_matrices(as_tensors.numpy()), atol=1e-7)


def test_numpy_geometry_keeps_each_frame_sizes_mapping_and_gives_the_same_matrices(landmarker_bundle,
                                                                                     real_faces):
    """FaceGeometry.matrices_on_host keeps the screen mapping of the last few tables of frame
    sizes: frames of sizes met before, between others, get the matrices bit for bit that a
    geometry seeing them first computes."""
    landmarks, sizes = real_faces
    sizes = sizes.astype(np.float32)
    kept = FaceGeometry.read(landmarker_bundle.geometry_metadata, procrustes_method="eigh")
    tables = [sizes, sizes[:1], sizes[::-1] * 2, sizes] + [sizes * (1 + k) for k in range(10)] + [sizes]
    for table in tables:
        count = table.shape[0]
        fresh = FaceGeometry.read(landmarker_bundle.geometry_metadata, procrustes_method="eigh")
        expected = fresh.matrices_on_host(landmarks[:count], table)
        got = kept.matrices_on_host(landmarks[:count], table)
        np.testing.assert_array_equal(got, expected)
    assert len(kept._host_mappings) <= 8


@pytest.mark.parametrize("device", DEVICES)
def test_head_pose_from_landmarks_matches_the_per_face_code(real_faces, device):
    landmarks, sizes = real_faces
    cases = np.concatenate([landmarks] + [perturbed(landmarks, sizes, seed)[0] for seed in range(4)])
    points = torch.from_numpy(cases)
    expected = reference_head_pose_deg(points)
    got = head_pose_deg(points.to(device)).cpu()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 if device == "cuda" else 0)


# -- the duplicate filter -------------------------------------------------------------------------


def random_candidates(rng: np.random.Generator, groups: int, per_group: int):
    """Boxes in clusters (so that many pairs overlap, some just above and some just below
    SAME_FACE_IOU), presences on a coarse grid (ties) around min_presence."""
    count = groups * per_group
    owner = np.repeat(np.arange(groups), per_group)
    centre = rng.integers(0, 3, (count, 2)) * 40.0 + rng.normal(0, 6, (count, 2))
    side = rng.uniform(30, 60, (count, 1))
    boxes = np.concatenate([centre - side / 2, centre + side / 2], axis=1).astype(np.float32)
    presence = (rng.integers(0, 11, count) / 10).astype(np.float32)
    order = rng.permutation(count)  # groups interleaved, as ROIs of several frames may come
    return boxes[order], presence[order], owner[order]


@pytest.mark.parametrize("device", DEVICES)
def test_batched_duplicate_filter_keeps_what_the_greedy_filter_keeps(device):
    rng = np.random.default_rng(24)
    seen = {"dropped as duplicate": 0, "cut by max_kept": 0, "below min_presence": 0, "tied": 0}
    for trial in range(300):
        groups, per_group = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        max_kept = int(rng.integers(1, 5))
        boxes, presence, owner = random_candidates(rng, groups, per_group)
        expected = reference_kept(boxes, presence, owner, 0.5, max_kept)
        kept, rank = nms.drop_overlapping_batched(
            torch.from_numpy(boxes).to(device), torch.from_numpy(presence).to(device),
            torch.from_numpy(owner).to(device), torch.from_numpy(presence >= 0.5).to(device),
            SAME_FACE_IOU, max_kept, max_group_size=per_group)
        kept, rank = kept.cpu().numpy(), rank.cpu().numpy()
        got = [sorted(np.flatnonzero(kept & (owner == group)), key=lambda k: rank[k]) for group in range(groups)]
        assert got == expected, f"trial {trial}"
        for group in range(groups):
            members = np.flatnonzero(owner == group)
            eligible = [k for k in members if presence[k] >= 0.5]
            uncut = nms.drop_overlapping(eligible, lambda k: boxes[k], lambda k: float(presence[k]), SAME_FACE_IOU)
            seen["dropped as duplicate"] += len(eligible) - len(uncut)
            seen["cut by max_kept"] += len(uncut) > max_kept
            seen["below min_presence"] += len(members) - len(eligible)
            seen["tied"] += len(set(presence[eligible].tolist())) < len(eligible)
    assert min(seen.values()) >= 20, seen  # every rule was exercised many times


def test_the_duplicate_filter_in_numpy_is_the_tensor_operations_filter():
    """nms.drop_overlapping_on_host (the CPU stack's, Note [The CPU stack's results in numpy]):
    the kept set and ranks of drop_overlapping_batched, exactly, on groups of 1-8 candidates
    with duplicates, ties, candidates below min_presence and cuts at max_kept."""
    rng = np.random.default_rng(31)
    for trial in range(300):
        groups, per_group = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        max_kept = int(rng.integers(1, 5))
        boxes, presence, owner = random_candidates(rng, groups, per_group)
        owner = owner.astype(np.float32)  # the measuring table's frame column
        steps = max(per_group, int(np.bincount(owner.astype(np.int64)).max()))
        kept, rank = nms.drop_overlapping_on_host(boxes, presence, owner, presence >= 0.5, SAME_FACE_IOU, max_kept,
                                                  max_group_size=steps)
        expected_kept, expected_rank = nms.drop_overlapping_batched(
            torch.from_numpy(boxes), torch.from_numpy(presence), torch.from_numpy(owner),
            torch.from_numpy(presence >= 0.5), SAME_FACE_IOU, max_kept, max_group_size=steps)
        assert kept.dtype == bool and np.array_equal(kept, expected_kept.numpy()), f"trial {trial}"
        assert np.array_equal(rank, expected_rank.numpy()), f"trial {trial}"


# -- the measuring stage, end to end --------------------------------------------------------------


def duplicated_rois(detections, frames, rng):
    """Every detected face as its detection, again as a track (the ROI moved by a few percent: the
    same face, measured again, a duplicate), and once more moved by 40 % of its side (the mesh
    still follows the face, with a presence anywhere from 0 to 0.8); and one ROI per frame on its
    corner (no face)."""
    owners, boxes, keypoints, scores, tracked = [], [], [], [], []
    for frame, (frame_boxes, frame_keypoints, frame_scores) in enumerate(detections):
        for box, points, score in zip(frame_boxes, frame_keypoints, frame_scores):
            side = float(box[2] - box[0])
            for shift, is_tracked in ((0.0, False), (rng.uniform(0.02, 0.06), True), (0.4, True)):
                offset = torch.tensor([shift * side, -0.5 * shift * side])
                owners.append(frame)
                boxes.append(box + offset.repeat(2))
                keypoints.append(points + offset)
                scores.append(score)
                tracked.append(is_tracked)
        height, width = frames[frame].shape[:2]
        corner = torch.tensor([0.0, 0.0, width * 0.2, width * 0.2])
        owners.append(frame)
        boxes.append(corner)
        keypoints.append(torch.tensor([[0.06, 0.08], [0.14, 0.08]]).repeat(3, 1) * width)
        scores.append(torch.tensor(0.6))
        tracked.append(False)
    order = rng.permutation(len(owners)).tolist()  # ROIs of frames interleaved
    pick = lambda items: [items[k] for k in order]  # noqa: E731
    return (pick(owners), torch.stack(pick(boxes)), torch.stack(pick(keypoints)),
            torch.stack(pick(scores)), pick(tracked))


def compare_measured(stack, frames, detections, min_presence):
    rng = np.random.default_rng(7)
    owners, boxes, keypoints, scores, tracked = duplicated_rois(detections, frames, rng)
    rects = roi.rects_from_detections(boxes, keypoints)
    measurer = stack.measurer
    measurer.min_presence, measurer.max_faces = min_presence, MAX_FACES
    recorded = {}
    # The CPU stack's models and projections in numpy (Note [The CPU stack's results in numpy]).
    name = "landmarks_on_host" if measurer.results_on_host else "landmarks_core"
    models = getattr(measurer, name)

    def recording(crops, crop_rects):
        outputs = models(crops, crop_rects)
        recorded["outputs"] = tuple(torch.from_numpy(o) if isinstance(o, np.ndarray) else o for o in outputs)
        return outputs

    batch = roi.FrameBatch(frames, "cpu")
    setattr(measurer, name, recording)
    try:
        with torch.inference_mode():
            measured = measurer.measure(batch, owners, rects, boxes, scores, tracked)
    finally:
        delattr(measurer, name)
        measurer.min_presence, measurer.max_faces = 0.5, stack.max_faces
    expected_faces, expected_rows = reference_faces(measurer.geometry, min_presence, MAX_FACES, batch.sizes_hw, owners,
                                                    tracked, *recorded["outputs"], boxes, scores)
    assert measured.rows == expected_rows, (measured.rows, expected_rows)
    assert len(measured.faces) == len(frames)
    with_matrix = measurer.geometry is not None
    for faces, expected in zip(measured.faces, expected_faces):
        for face, want in zip(faces, expected, strict=True):
            assert face.box == tuple(float(v) for v in want["box"])
            assert face.score == float(want["score"]) and face.presence == float(want["presence"])
            assert face.tracked == want["tracked"]
            np.testing.assert_array_equal(face.landmarks, want["landmarks"])
            assert face.landmarks.dtype == np.float32 and face.landmarks.shape == (478, 3)
            np.testing.assert_allclose(face.head_pose, want["head_pose"], atol=1e-7 if with_matrix else 0)
            assert all(type(v) is float for v in face.head_pose + face.box)
            if with_matrix:
                np.testing.assert_array_equal(face.blendshapes, want["blendshapes"])
                assert face.transform_matrix.dtype == np.float32
                np.testing.assert_allclose(face.transform_matrix, want["transform_matrix"], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(face.head_translation_cm, want["head_translation_cm"], rtol=1e-9)
            else:
                assert face.blendshapes is None and face.transform_matrix is None
                assert face.head_translation_cm is None
    presence = recorded["outputs"][1].numpy()
    return {"faces": sum(map(len, measured.faces)), "rois": len(owners),
            "below": int((presence < min_presence).sum()),
            "frames_cut": sum(len(faces) == MAX_FACES < len(found[2]) for faces, found in zip(measured.faces, detections))}


def test_the_cpu_stacks_table_in_numpy_is_the_tensor_operations_table(face_stack, frames, detections, monkeypatch):
    """Note [The CPU stack's results in numpy]: the LiteRT stack's measuring table, computed in
    numpy, is the tensor operations' table (duplicates, untracked and tracked ROIs, a three-face
    frame): the landmarks, boxes, scores and the duplicate filter's choice the same, the
    blendshapes, matrices and poses to float rounding."""
    measurer = face_stack.measurer
    assert measurer.results_on_host, "FaceLandmarker's models in LiteRT on the CPU"
    owners, boxes, keypoints, scores, tracked = duplicated_rois(detections, frames, np.random.default_rng(3))
    rects = roi.rects_from_detections(boxes, keypoints)
    batch = roi.FrameBatch(frames, "cpu")
    roi_table = torch.tensor([[owner, float(is_tracked), *batch.sizes_hw[owner][::-1]]
                              for owner, is_tracked in zip(owners, tracked)], dtype=torch.float32)
    layout = measurer.layout
    with torch.inference_mode():
        crops = roi.crop_rois(batch, torch.tensor(owners), rects, measurer.input_px)
        inputs = (crops, rects, roi_table, boxes, scores, int(np.bincount(owners).max()))
        on_host = measurer.results_core(*inputs)
        monkeypatch.setattr(type(measurer), "results_on_host", property(lambda self: False))
        as_tensors = measurer.results_core(*inputs)
    assert on_host.dtype == torch.float32 and on_host.shape == as_tensors.shape == (len(owners), layout.columns)
    same = [layout.landmarks, layout.presence, layout.box, layout.score, layout.kept, layout.rank]
    for columns in same:
        torch.testing.assert_close(on_host[:, columns], as_tensors[:, columns], rtol=0, atol=0)
    assert 0 < on_host[:, layout.kept].sum() < len(owners), "some ROIs dropped as duplicates"
    torch.testing.assert_close(on_host[:, layout.blendshapes], as_tensors[:, layout.blendshapes], rtol=0, atol=1e-6)
    torch.testing.assert_close(on_host[:, layout.matrix], as_tensors[:, layout.matrix], rtol=1e-6, atol=1e-6)
    wide = lambda table: table[:, layout.wide].contiguous().view(torch.float64)  # noqa: E731
    torch.testing.assert_close(wide(on_host), wide(as_tensors), rtol=1e-9, atol=1e-9)


def test_measure_matches_the_per_face_host_code_with_the_transformation_matrix(face_stack, frames, detections):
    for min_presence in (0.3, 0.5, 0.9):
        counts = compare_measured(face_stack, frames, detections, min_presence)
        # Duplicates were dropped (three ROIs on each face), some ROIs fell below min_presence,
        # and the three-face frame kept MAX_FACES.
        assert counts["below"] >= len(frames), counts
        assert len(frames) <= counts["faces"] < counts["rois"] - counts["below"], counts
        assert counts["frames_cut"] == 1, counts


def test_measure_matches_the_per_face_host_code_with_the_attention_mesh(attention_stack, frames, detections):
    counts = compare_measured(attention_stack, frames, detections, 0.5)
    assert counts["below"] >= len(frames) and counts["frames_cut"] == 1, counts


@pytest.mark.parametrize("method", PROCRUSTES_METHODS)
def test_a_fit_without_spread_gives_the_identity_and_no_error(method):
    """Padding rows of a CUDA graph and degenerate faces: a covariance of zeros (every point on
    one spot) gives the identity rotation and scale 0, finite, where an SVD would be asked for
    the impossible (Note [Procrustes without a solver])."""
    source = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    target = torch.full((2, 4, 3), 5.0, dtype=torch.float64)
    scale, rotation, translation = weighted_procrustes(source, target, torch.ones(4, dtype=torch.float64), method)
    torch.testing.assert_close(rotation, torch.eye(3, dtype=torch.float64).expand(2, 3, 3))
    torch.testing.assert_close(scale, torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(translation, torch.full((2, 3), 5.0, dtype=torch.float64))


def test_an_unknown_procrustes_method_is_named(landmarker_bundle):
    with pytest.raises(ValueError, match="method must be one of .*'squaring'.*'eigh'.*got 'svd'"):
        weighted_procrustes(torch.eye(3, dtype=torch.float64), torch.eye(3, dtype=torch.float64)[None],
                            torch.ones(3, dtype=torch.float64), "svd")
    with pytest.raises(ValueError, match="procrustes_method must be one of .*got 'svd'"):
        FaceGeometry.read(landmarker_bundle.geometry_metadata, procrustes_method="svd")
