"""Issue 21: a model file damaged under a running daemon (Note [Model files checked at load]). The
worker that loads it checks its size and SHA-256 then, and a
damaged official face_landmarker.task is replaced by the verified copy of its members or refused,
never loaded as the attention mesh with NaN blendshapes and nothing said. On the CPU."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from facecast.models import assets
from facecast.shared import config as config_mod
from facecast.workers.base import BootError
from facecast.workers.inference.pipelines import build_pipeline
from facecast.workers.capture.sources import SyntheticScene


@pytest.fixture(scope="module")
def installed() -> Path:
    try:
        assets.landmarker_task_path()
        for name in assets.MODELS:
            assets.model_path(name)
    except assets.ModelError as exc:
        pytest.skip(f"the models are not installed (facecast models install): {exc}")
    return assets.resolve_model_dir()


@pytest.fixture
def model_dir(installed, tmp_path) -> Path:
    """A model directory of this test's own, which it may damage."""
    target = tmp_path / "models"
    target.mkdir()
    for path in [*installed.glob("*.tflite"), installed / assets.LANDMARKER_TASK_FILE]:
        shutil.copy(path, target / path.name)
    return target


def _config(model_dir: Path, task: str = "") -> config_mod.Config:
    return config_mod.loads(f'[models]\ndir = "{model_dir}"\nface_landmarker_task = "{task}"\n\n'
                            '[[cameras]]\nid = "cam0"\nsource = "synthetic"\n')


def _truncate(path: Path, keep_bytes: int = 1_000_000) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes])


def _blendshapes(face_pipeline) -> np.ndarray:
    frame = SyntheticScene(640, 360, seed="model-files").render(0.0)
    faces = face_pipeline.track([frame], ["cam0"])[0]
    assert faces, "no face found in the synthetic frame"
    return np.array([face.blendshapes for face in faces], dtype=float)


def test_a_truncated_bundle_is_replaced_by_the_verified_copy_and_said(model_dir, caplog):
    cpu = torch.device("cpu")
    face, problem = build_pipeline(_config(model_dir), cpu, blendshapes=True)  # unpacks it
    assert face.landmarker == "face_landmarker" and problem == ""
    task = model_dir / assets.LANDMARKER_TASK_FILE
    _truncate(task)  # as a copy or a disk would, while the daemon runs

    face, problem = build_pipeline(_config(model_dir), cpu, blendshapes=True)
    assert face.landmarker == "face_landmarker"  # the bundle's models, from the verified copy
    assert problem.startswith(f"{task} is 1000000 bytes, expected {assets.LANDMARKER_TASK_BYTES} "
                              "(truncated; pinned SHA-256 64184e229b263107...); run `facecast "
                              "models install` to replace it"), problem
    assert "using the verified copy of its models in" in problem
    assert problem in caplog.text  # the log; the worker sends it as a marker and in status
    # The output worker, status and doctor ask `landmarker_bundle`: the channels stay.
    choice = assets.landmarker_bundle(None, model_dir)
    assert choice.available and "(truncated;" in choice.detail and "verified copy" in choice.detail
    blendshapes = _blendshapes(face)
    assert blendshapes.shape[1] == 52 and np.isfinite(blendshapes).all()


def test_a_truncated_bundle_without_a_verified_copy_is_refused(model_dir):
    _truncate(model_dir / assets.LANDMARKER_TASK_FILE)  # before any load: nothing unpacked
    with pytest.raises(BootError) as error:
        build_pipeline(_config(model_dir), torch.device("cpu"), blendshapes=True)
    assert not assets.landmarker_bundle(None, model_dir).available
    assert "(truncated; pinned SHA-256" in str(error.value) and "no verified copy of its models in" in \
        str(error.value), error.value


def test_a_damaged_verified_copy_is_no_copy(model_dir):
    build_pipeline(_config(model_dir), torch.device("cpu"), blendshapes=True)  # unpacks it
    cache = model_dir / "face_landmarker" / assets.LANDMARKER_TASK_SHA256[:16]
    _truncate(cache / "face_blendshapes.tflite", 1000)
    _truncate(model_dir / assets.LANDMARKER_TASK_FILE)
    with pytest.raises(BootError, match="no verified copy"):
        build_pipeline(_config(model_dir), torch.device("cpu"), blendshapes=True)


def test_a_truncated_tflite_model_is_refused_by_size(model_dir):
    path = model_dir / "face_detection_short_range.tflite"
    _truncate(path, 1000)
    with pytest.raises(BootError) as error:
        build_pipeline(_config(model_dir), torch.device("cpu"), blendshapes=False)
    assert str(error.value).startswith(
        f"model 'face_detection_short_range' at {path} is 1000 bytes, expected 229714 "
        "(truncated; pinned SHA-256 bbff11cebd1eb27a...)"), error.value


def test_a_users_bundle_that_does_not_parse_is_said_clearly(model_dir, tmp_path):
    cpu = torch.device("cpu")
    not_a_zip = tmp_path / "mine.task"
    not_a_zip.write_bytes(b"not a bundle")
    face, problem = build_pipeline(_config(model_dir, str(not_a_zip)), cpu, blendshapes=True)
    assert face.landmarker == "attention_mesh"
    assert problem == (f"models.face_landmarker_task {not_a_zip} is unusable, so no blendshapes "
                       f"or head translation: {not_a_zip} is not a face_landmarker.task bundle "
                       "(not a zip file)"), problem

    # Every member there, each with TFLite's magic, but no model in them.
    junk = tmp_path / "junk.task"
    with zipfile.ZipFile(junk, "w") as archive:
        for member in assets.LANDMARKER_TASK_MEMBERS:
            archive.writestr(member, b"\0\0\0\0TFL3" + bytes(64))
    face, problem = build_pipeline(_config(model_dir, str(junk)), cpu, blendshapes=True)
    assert face.landmarker == "attention_mesh"
    assert problem.startswith(f"{junk} does not parse as a face_landmarker.task, so no "
                              "blendshapes or head translation: blendshapes unavailable: "), problem
