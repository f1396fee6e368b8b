"""What `facecast run` installs before it starts (daemon/cli/run.py): the face models always, the
face embedding network only when participants are named by their faces, and a failure to fetch
that network costs the names, never the start."""

from __future__ import annotations

from facecast.daemon.cli import run
from facecast.models import assets
from facecast.shared import config as config_mod

CAMERA = '[[cameras]]\nid = "m0"\nsource = "synthetic"\n'


def _config(model_dir, participants: str = "") -> config_mod.Config:
    return config_mod.loads(f'[models]\ndir = "{model_dir}"\n{participants}{CAMERA}')


def test_the_embedding_network_is_left_alone_without_participants(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(assets, "install_face_embedding_model", lambda *a, **k: asked.append(a))
    run._ensure_embedding_network(_config(tmp_path), allow_install=True)
    assert asked == []


def test_a_failed_fetch_of_the_network_lets_the_daemon_start_and_says_so(tmp_path, monkeypatch,
                                                                        capsys):
    def no_index(destination):
        raise assets.ModelDownloadError("pip could not download face-recognition-models==0.3.0")

    monkeypatch.setattr(assets, "_download_face_embedding_archive", no_index)
    config = _config(tmp_path, '[participants]\nenabled = true\nidentify = "embeddings"\n')
    run._ensure_embedding_network(config, allow_install=True)  # returns: the daemon starts
    err = capsys.readouterr().err
    assert f"{assets.FACE_EMBEDDING_FILE} missing" in err
    assert "running without naming participants: pip could not download" in err
    assert not (tmp_path / assets.FACE_EMBEDDING_FILE).exists()
