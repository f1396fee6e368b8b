"""On the CPU the FaceLandmarker models and the short-range detector run in LiteRT (Note [LiteRT
on the CPU]): called as the converted models are, with their numbers; the rest stays torch; a
machine without LiteRT runs the converted models and says why."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from facecast.models import anchors, assets, tflite_convert
from facecast.models.face_detection import WHOLE_FRAME_INPUT_HW
from facecast.models.litert_models import LiteRTModel, LiteRTUnavailable
from facecast.models.pipeline import FacePipeline


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("member", ["face_landmarks_detector", "face_blendshapes"])
def test_a_model_in_litert_gives_the_converted_models_outputs(landmarker_bundle, member):
    path = getattr(landmarker_bundle, member)
    converted = tflite_convert.convert(path).eval()
    in_litert = LiteRTModel(path, threads=1)
    shape = converted.input_shapes[0][1:]
    inputs = torch.from_numpy(np.random.default_rng(7).random((3, *shape), np.float32))
    if member == "face_blendshapes":
        inputs = inputs * 300.0  # landmark pixels
    with torch.inference_mode():
        expected, got = converted(inputs), in_litert(inputs)
    assert len(got) == len(expected)
    for want, have in zip(expected, got):
        assert have.dtype == torch.float32
        assert have.reshape(3, -1).shape == want.reshape(3, -1).shape
        scale = want.abs().max().item() or 1.0
        assert (have.reshape(3, -1) - want.reshape(3, -1)).abs().max().item() <= 1e-3 * scale
    # Each sample is its own invoke: the second face's outputs are not the first's.
    assert not torch.equal(got[0][0], got[0][1])


@pytest.mark.parametrize("member", ["face_landmarks_detector", "face_blendshapes"])
def test_one_sample_gives_what_it_gives_in_a_batch(landmarker_bundle, member):
    """A batch of one takes its outputs straight from the interpreter's copies (_Invoker.run);
    each sample of a batch gets the same outputs, bit for bit, as float32 of the same shapes."""
    model = LiteRTModel(getattr(landmarker_bundle, member), threads=1)
    shape = model.input_shapes[0]
    inputs = torch.from_numpy(np.random.default_rng(8).random((2, *shape), np.float32) * 300.0)
    with torch.inference_mode():
        batched = model(inputs)
        alone = [model(inputs[k:k + 1]) for k in range(2)]
    for k, outputs in enumerate(alone):
        assert len(outputs) == len(batched)
        for have, want in zip(outputs, batched):
            assert have.dtype == want.dtype == torch.float32
            assert have.shape == want[k:k + 1].shape
            assert torch.equal(have, want[k:k + 1])


def test_a_wrong_input_is_refused_naming_the_shape(landmarker_bundle):
    model = LiteRTModel(landmarker_bundle.face_landmarks_detector, threads=1)
    with pytest.raises(ValueError, match=r"must be \(2, 256, 256, 3\), got \(2, 192, 192, 3\)"):
        model(torch.zeros(2, 192, 192, 3))
    with pytest.raises(ValueError, match="takes 1 input"):
        model(torch.zeros(1, 256, 256, 3), torch.zeros(1, 256, 256, 3))


@pytest.mark.parametrize("height, width", [WHOLE_FRAME_INPUT_HW, WHOLE_FRAME_INPUT_HW[::-1]])
def test_the_full_range_detector_takes_whole_frames_in_litert_as_converted(installed_models, model_dir,
                                                                             height, width):
    """Note [Whole frames in LiteRT]: the file's upsampling sizes scaled with the input, the
    outputs the converted model's at that size (allow_any_input_size)."""
    path = assets.model_path(anchors.FACE_FULL_RANGE.name, model_dir)
    converted = tflite_convert.convert(path).eval()
    tflite_convert.allow_any_input_size(converted)
    in_litert = LiteRTModel(path, threads=1, image_sizes_hw=[(height, width)])
    assert in_litert.takes((height, width, 3), (192, 192, 3)) and not in_litert.takes((288, 288, 3))
    frames = torch.from_numpy(np.random.default_rng(3).random((2, height, width, 3), np.float32) * 2 - 1)
    with torch.inference_mode():
        expected, got = converted(frames), in_litert(frames)
    anchors_per_frame = height * width // 16  # a 4x4 cell each, as at 192x192: 2304
    for want, have in zip(expected, got):
        assert have.shape == want.shape and have.shape[1] == anchors_per_frame
        assert (have - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    with pytest.raises(ValueError, match=r"must be \(1, 192, 192, 3\) or \(1, %d, %d, 3\)" % (height, width)):
        in_litert(torch.zeros(1, 288, 288, 3))


def test_a_size_the_upsamplings_cannot_reach_is_refused(installed_models, model_dir):
    with pytest.raises(LiteRTUnavailable, match=r"200x512 is not a multiple of its upsamplings \(12x12 at 192x192\)"):
        LiteRTModel(assets.model_path(anchors.FACE_FULL_RANGE.name, model_dir), threads=1,
                    image_sizes_hw=[(200, 512)])


def test_a_model_litert_cannot_run_is_refused_with_the_reason(installed_models, model_dir):
    """The attention mesh has MediaPipe's custom operators, which LiteRT lacks."""
    with pytest.raises(LiteRTUnavailable, match="face_landmark_with_attention does not load in LiteRT"):
        LiteRTModel(assets.model_path("face_landmark_with_attention", model_dir), threads=1)


def test_on_the_cpu_the_landmarker_models_run_in_litert_and_give_the_same_faces(
        landmarker_bundle, photos, one_thread):
    in_litert = FacePipeline("cpu", max_faces=2, face_landmarker_task=landmarker_bundle.task_path)
    in_torch = FacePipeline("cpu", max_faces=2, face_landmarker_task=landmarker_bundle.task_path,
                            cpu_runtime="torch")
    assert in_litert.model_runtimes == {
        anchors.FACE_SHORT_RANGE.name: "litert", anchors.FACE_FULL_RANGE.name: "litert",
        "face_landmarks_detector": "litert", "face_blendshapes": "litert"}
    assert set(in_torch.model_runtimes.values()) == {"torch"}
    assert in_litert.cpu_runtime_problem is None
    # The CPU stack's rotations by LAPACK, the GPU's code's by squaring (Note [Procrustes
    # without a solver]).
    assert in_litert.measurer.geometry.procrustes_method == "eigh"
    assert in_torch.measurer.geometry.procrustes_method == "squaring"
    frame = np.ascontiguousarray(photos["astronaut"][..., ::-1])
    (litert_faces,), (torch_faces,) = in_litert([frame]), in_torch([frame])
    assert len(litert_faces) == len(torch_faces) == 1
    face_width = float(np.ptp(torch_faces[0].landmarks[:, 0]))
    error = np.linalg.norm(litert_faces[0].landmarks[:, :2] - torch_faces[0].landmarks[:, :2], axis=1)
    # Float rounding apart, the same numbers (seen: 3e-5 px median on a 90 px face).
    assert error.max() < 1e-4 * face_width
    assert np.abs(litert_faces[0].blendshapes - torch_faces[0].blendshapes).max() < 1e-4
    # Degrees: the two runtimes' landmarks (above) through two Procrustes methods; seen 1.5e-3
    # on the crop from bytes (Note [Face crops from bytes on the CPU]), 1e-3 before.
    np.testing.assert_allclose(litert_faces[0].head_pose, torch_faces[0].head_pose, atol=3e-3)
    np.testing.assert_allclose(litert_faces[0].transform_matrix, torch_faces[0].transform_matrix, atol=1e-4)


def test_the_litert_models_run_on_the_threads_asked_for(landmarker_bundle, one_thread):
    """Note [Threads of the models]: `cpu_threads` for the landmark model and the full-range
    detector (torch's by default), one for the small models."""
    def threads(pipeline):
        models = {"landmarks": pipeline.measurer.mesh, "full range": pipeline.detector.full_range,
                  "short range": pipeline.detector.short_range,
                  "blendshapes": pipeline.measurer.blendshapes}
        assert all(isinstance(model, LiteRTModel) for model in models.values())
        return {name: model.threads for name, model in models.items()}

    task = landmarker_bundle.task_path
    assert threads(FacePipeline("cpu", max_faces=1, face_landmarker_task=task)) == {
        "landmarks": 1, "full range": 1, "short range": 1, "blendshapes": 1}  # torch's one
    assert threads(FacePipeline("cpu", max_faces=1, face_landmarker_task=task, cpu_threads=3)) == {
        "landmarks": 3, "full range": 3, "short range": 1, "blendshapes": 1}
    with pytest.raises(ValueError, match="cpu_threads must be at least 1, got 0"):
        FacePipeline("cpu", max_faces=1, face_landmarker_task=task, cpu_threads=0)


def test_without_litert_the_converted_models_run_and_the_pipeline_says_why(
        landmarker_bundle, monkeypatch, one_thread, caplog):
    monkeypatch.setitem(sys.modules, "ai_edge_litert.interpreter", None)  # import fails
    pipeline = FacePipeline("cpu", max_faces=1, face_landmarker_task=landmarker_bundle.task_path)
    assert set(pipeline.model_runtimes.values()) == {"torch"}
    assert "ai-edge-litert is not installed" in pipeline.cpu_runtime_problem
    said = [r.getMessage() for r in caplog.records if "converted torch modules" in r.getMessage()]
    assert len(said) == 1  # once, not per model


def test_a_cpu_runtime_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="cpu_runtime must be one of litert, torch, got 'xnnpack'"):
        FacePipeline("cpu", cpu_runtime="xnnpack")


def test_litert_says_nothing_on_stderr_but_what_others_write(landmarker_bundle):
    """LiteRT prints an INFO line when a process makes its first XNNPACK interpreter, which
    `facecast analyze --quiet` must not show; what else reaches stderr meanwhile still does."""
    code = (
        "import os, sys\n"
        "from facecast.models import litert_models\n"
        "with litert_models._without_the_delegates_info_line():\n"
        "    os.write(2, b'a line of another library\\n')\n"
        f"    litert_models.LiteRTModel({str(landmarker_bundle.face_blendshapes)!r}, threads=1)\n"
        "print('python says this', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "XNNPACK" not in done.stderr
    assert done.stderr.splitlines() == ["a line of another library", "python says this"]
