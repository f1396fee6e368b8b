"""FacePipeline against MediaPipe's own results on real photos (fixtures made once by
scripts/make_mediapipe_fixtures.py with mediapipe 0.10.21; versions in the fixture's JSON) and
against the known placement of faces pasted into 1080p canvases.

The pipelines' fixtures request ``installed_models`` (tests/models/conftest.py), which installs
the MediaPipe models on first use ($FACECAST_MODEL_DIR or the user's cache), so that this file
runs alone too.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from facecast.models.head_pose import head_pose_deg
from facecast.models.nms import box_iou

from counting import CountingModule  # tests/models/counting.py

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
IOU_MIN = 0.9
LANDMARK_MEDIAN_MAX_FRACTION = 0.02  # of the face box width
# Pasted faces: the truth is MediaPipe's mesh on the source photo, moved by the paste's
# similarity transform; resampling a 70 px face costs more than MediaPipe-vs-facecast does.
PASTED_LANDMARK_MEDIAN_MAX_FRACTION = 0.03
ROLL_TOLERANCE_DEG = 3.0


def _load_fixture_builder():
    spec = importlib.util.spec_from_file_location("make_mediapipe_fixtures",
                                                  REPO_ROOT / "scripts" / "make_mediapipe_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    meta = json.loads((FIXTURES / "mediapipe_faces.json").read_text())
    arrays = np.load(FIXTURES / "mediapipe_faces.npz")
    cases = {c.name: c for c in _load_fixture_builder().build_cases()}
    return meta, arrays, cases


def _pipeline(device: str):
    from facecast.models.pipeline import FacePipeline

    return FacePipeline(device, max_faces=4)  # its models: where installed_models put them


@pytest.fixture(scope="module")
def cpu_pipeline(installed_models):
    # One thread: on a 2-core machine with another busy process (CI), two OpenMP threads wait
    # for each other's time slices at every op (a 300-frame test ran past 300 s that way).
    torch.set_num_threads(1)
    return _pipeline("cpu")


@pytest.fixture(scope="module")
def gpu_pipeline(installed_models):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device on this machine")
    return _pipeline("cuda")


def _bgr(rgb: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rgb[..., ::-1])


def _case_names(kind: str) -> list[str]:
    meta = json.loads((FIXTURES / "mediapipe_faces.json").read_text())
    if kind == "mediapipe":
        return [c["name"] for c in meta["cases"] if c["num_mesh_faces"] > 0]
    return [c["name"] for c in meta["cases"] if c["placements"]]


def test_images_rebuild_as_the_fixtures_saw_them(reference):
    meta, _, cases = reference
    builder = _load_fixture_builder()
    for record in meta["cases"]:
        got = np.array(builder.thumbnail(cases[record["name"]].rgb))
        assert np.abs(got - np.array(record["thumbnail"])).max() <= 2, record["name"]


def check_against_mediapipe(pipeline, reference, name: str) -> list[tuple[float, float]]:
    """Every face MediaPipe meshed is found: box IoU with MediaPipe's detection box ≥ 0.9 and
    landmark median error ≤ 2% of the box width. Returns (iou, error fraction) per face."""
    _, arrays, cases = reference
    faces = pipeline([_bgr(cases[name].rgb)])[0]
    mp_boxes = arrays[f"{name}/boxes_px"]
    mp_landmarks = arrays[f"{name}/landmarks_px"]
    assert faces, f"{name}: MediaPipe found {len(mp_landmarks)} face(s), facecast none"
    ours_boxes = torch.tensor([f.box for f in faces])
    measured = []
    for mp_mesh in mp_landmarks:
        # The MediaPipe detection box of this mesh: the one holding the most of its points.
        inside = [((mp_mesh[:, 0] > b[0]) & (mp_mesh[:, 0] < b[2]) & (mp_mesh[:, 1] > b[1]) & (mp_mesh[:, 1] < b[3])).mean()
                  for b in mp_boxes]
        mp_box = mp_boxes[int(np.argmax(inside))]
        iou = box_iou(torch.tensor(mp_box[None]), ours_boxes)[0]
        best = int(iou.argmax())
        width = mp_box[2] - mp_box[0]
        error = np.median(np.linalg.norm(faces[best].landmarks[:, :2] - mp_mesh[:, :2], axis=1)) / width
        assert iou[best] >= IOU_MIN, f"{name}: box IoU {iou[best]:.3f} with MediaPipe's"
        assert error <= LANDMARK_MEDIAN_MAX_FRACTION, f"{name}: landmark median error {100 * error:.2f}% of the box"
        assert faces[best].landmarks.shape == (478, 3)
        measured.append((float(iou[best]), float(error)))
    return measured


@pytest.mark.parametrize("name", _case_names("mediapipe"))
def test_matches_mediapipe_on_cpu(cpu_pipeline, reference, name):
    check_against_mediapipe(cpu_pipeline, reference, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", _case_names("mediapipe"))
def test_matches_mediapipe_on_gpu(gpu_pipeline, reference, name):
    check_against_mediapipe(gpu_pipeline, reference, name)


def check_pasted_faces(pipeline, reference, name: str) -> list[tuple[float, float]]:
    """Faces pasted into a 1080p canvas are found where they were put, and meshed: landmark
    median error ≤ 3% of the face width against the source's MediaPipe mesh, moved by the paste."""
    _, arrays, cases = reference
    case = cases[name]
    faces = pipeline([_bgr(case.rgb)])[0]
    measured = []
    for placement in case.placements:
        expected = arrays[f"{placement.source}/landmarks_px"][0].copy()
        expected[:, :2] = expected[:, :2] * placement.scale + [placement.offset_x_px, placement.offset_y_px]
        expected_box = arrays[f"{placement.source}/boxes_px"][0] * placement.scale
        width = float(expected_box[2] - expected_box[0])
        errors = [np.median(np.linalg.norm(f.landmarks[:, :2] - expected[:, :2], axis=1)) / width for f in faces]
        assert errors, f"{name}: no face found; expected one {width:.0f} px wide at {expected[1, :2].round()}"
        error = min(errors)
        assert error <= PASTED_LANDMARK_MEDIAN_MAX_FRACTION, (
            f"{name}: the {width:.0f} px face at {expected[1, :2].round()} has median landmark error "
            f"{100 * error:.1f}% of its width")
        measured.append((width, float(error)))
    return measured


@pytest.mark.parametrize("name", _case_names("pasted"))
def test_pasted_faces_on_cpu(cpu_pipeline, reference, name):
    check_pasted_faces(cpu_pipeline, reference, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", _case_names("pasted"))
def test_pasted_faces_on_gpu(gpu_pipeline, reference, name):
    check_pasted_faces(gpu_pipeline, reference, name)


def test_smallest_pasted_face_is_about_70_px(reference):
    _, arrays, cases = reference
    placement = cases["canvas1080_tiny_only"].placements[0]
    box = arrays[f"{placement.source}/boxes_px"][0] * placement.scale
    assert 60 <= box[2] - box[0] <= 75


@pytest.mark.parametrize("source", ["astronaut", "grace_hopper"])
def test_in_plane_rotation_changes_roll_by_the_angle(cpu_pipeline, reference, source):
    _, _, cases = reference
    frames = [_bgr(cases[n].rgb) for n in (source, f"{source}_rot+30", f"{source}_rot-30")]
    upright, ccw, cw = (faces[0].head_pose for faces in cpu_pipeline(frames))
    # skimage rotates counter-clockwise for a positive angle; roll is clockwise-positive.
    assert ccw[2] - upright[2] == pytest.approx(-30, abs=ROLL_TOLERANCE_DEG)
    assert cw[2] - upright[2] == pytest.approx(30, abs=ROLL_TOLERANCE_DEG)
    for rotated in (ccw, cw):
        assert rotated[0] == pytest.approx(upright[0], abs=5) and rotated[1] == pytest.approx(upright[1], abs=5)


def test_head_pose_method_on_mediapipe_landmarks(reference):
    """The head-pose method alone, on MediaPipe's own meshes: the same ±30° roll property."""
    _, arrays, _ = reference
    for source in ("astronaut", "grace_hopper"):
        poses = {n: head_pose_deg(torch.tensor(arrays[f"{n}/landmarks_px"][:1], dtype=torch.float64))[0]
                 for n in (source, f"{source}_rot+30", f"{source}_rot-30")}
        assert (poses[f"{source}_rot+30"][2] - poses[source][2]).item() == pytest.approx(-30, abs=ROLL_TOLERANCE_DEG)
        assert (poses[f"{source}_rot-30"][2] - poses[source][2]).item() == pytest.approx(30, abs=ROLL_TOLERANCE_DEG)


def test_mixed_batch_equals_frames_one_by_one(cpu_pipeline, reference):
    _, _, cases = reference
    frames = [_bgr(cases[n].rgb) for n in ("astronaut", "grace_hopper", "canvas1080_tiny_only")]
    together = cpu_pipeline(frames)
    for frame, faces in zip(frames, together):
        alone = cpu_pipeline([frame])[0]
        assert len(alone) == len(faces)
        for a, b in zip(alone, faces):
            assert np.abs(a.landmarks - b.landmarks).max() < 0.05
            assert np.allclose(a.box, b.box, atol=0.05)


def test_tensor_batch_equals_numpy_list(cpu_pipeline, reference):
    _, _, cases = reference
    frames = [_bgr(cases[n].rgb) for n in ("astronaut", "astronaut_dark")]
    from_list = cpu_pipeline(frames)
    from_tensor = cpu_pipeline(torch.from_numpy(np.stack(frames)))
    for a, b in zip(from_list, from_tensor):
        assert len(a) == len(b) == 1
        assert np.abs(a[0].landmarks - b[0].landmarks).max() < 1e-3


def test_tracking_runs_the_detector_only_when_needed(cpu_pipeline, reference):
    _, _, cases = reference
    cpu_pipeline.reset()
    canvas = np.full((600, 800, 3), 110, np.uint8)
    face = _bgr(cases["grace_hopper"].rgb)[60:460, 60:460]
    moving = []
    for step in range(6):  # the face drifts 6 px right and 3 px down per frame
        frame = canvas.copy()
        frame[50 + 3 * step: 450 + 3 * step, 100 + 6 * step: 500 + 6 * step] = face
        moving.append(frame)
    detected_each_frame = [cpu_pipeline([frame])[0][0] for frame in moving]
    counter = CountingModule(cpu_pipeline.detector.short_range)
    original = cpu_pipeline.detector.short_range
    cpu_pipeline.detector.short_range = counter
    try:
        tracked = [cpu_pipeline.track([frame], ["cam0"])[0] for frame in moving]
        assert counter.calls == 1, "the detector ran on a frame where the track held"
        assert all(len(faces) == 1 for faces in tracked) and all(f[0].tracked for f in tracked[1:])
        for faces, detected in zip(tracked, detected_each_frame):
            error = np.median(np.linalg.norm(faces[0].landmarks[:, :2] - detected.landmarks[:, :2], axis=1))
            width = detected.box[2] - detected.box[0]
            assert error / width < 0.02
            assert box_iou(torch.tensor([faces[0].box]), torch.tensor([detected.box]))[0, 0] > 0.8
        # The face leaves: the track's mesh finds no face (no detector run on that frame) ...
        assert cpu_pipeline.track([canvas], ["cam0"])[0] == []
        assert counter.calls == 1
        # ... so the next frame runs the detector again, and finds the face again.
        assert len(cpu_pipeline.track([moving[0]], ["cam0"])[0]) == 1
        assert counter.calls == 2
    finally:
        cpu_pipeline.detector.short_range = original
        cpu_pipeline.reset()


def test_without_face_landmarker_task_blendshapes_are_none(cpu_pipeline, reference):
    _, _, cases = reference
    faces = cpu_pipeline([_bgr(cases["astronaut"].rgb)])[0]
    assert faces[0].blendshapes is None
    assert "face_landmarker.task" in cpu_pipeline.blendshapes_unavailable_reason


def test_tracked_boxes_stay_on_the_moving_faces_for_20_seconds(cpu_pipeline):
    """Landmark tracking over 300 frames of the synthetic scene: boxes of tracked faces come from
    the landmarks (Note [Box of a tracked face]) and never drift away from the truth."""
    from facecast.shared.config import CameraConfig
    from facecast.workers.capture.sources import SyntheticScene

    scene = SyntheticScene.for_camera(CameraConfig(id="synth0", source="synthetic", width=640,
                                                   height=360, fps=15))
    cpu_pipeline.reset()
    worst = 0.0
    tracked = 0
    for k in range(300):
        t_s = 100.0 + k / 15
        faces = cpu_pipeline.track([scene.render(t_s)], ["synth0"])[0]
        truth = scene.faces_at(t_s)
        assert len(faces) == len(truth), (k, len(faces))
        for face in faces:
            tracked += face.tracked
            x1, y1, x2, y2 = face.box
            best = min(truth, key=lambda f: abs(f.center_px[0] - (x1 + x2) / 2))
            error = max(abs((x1 + x2) / 2 - best.center_px[0]), abs((y1 + y2) / 2 - best.center_px[1]),
                        abs((x2 - x1) - best.size_px)) / best.size_px
            if face.tracked:  # detection frames carry the detector's own box
                worst = max(worst, error)
    assert tracked >= 500  # most faces were tracked, not detected
    assert worst < 0.08, worst
