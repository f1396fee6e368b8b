"""Config decoding: typed, strict, errors that name the key and what is allowed (DESIGN.md §6)."""

from pathlib import Path

import pytest

from facecast.shared import config

ROOT = Path(__file__).resolve().parents[1]


def test_default_config_loads_with_two_synthetic_cameras():
    loaded = config.load(ROOT / "config" / "default.toml")
    assert [c.id for c in loaded.cameras] == ["synth0", "synth1"]
    assert all(c.source == "synthetic" for c in loaded.cameras)
    assert loaded.transport_for(loaded.cameras[0]) == "auto"


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[daemon]\ntransport = "gpu"', "daemon.transport: Invalid enum value 'gpu' (allowed: 'auto', 'cuda_ipc', 'shm'"),
        ("[daemon]\nring_slot = 8", "daemon.ring_slot: unknown key (allowed here: runtime_dir"),
        ("[daemon]\nring_slots = 1", "daemon.ring_slots: Expected `int` >= 2"),
        ('[[cameras]]\nid = "a b"\nsource = 0', "cameras[0].id: Expected `str` matching regex"),
        ('[[cameras]]\nid = "a"\nsource = 0\nfps = 0', "cameras[0].fps: Expected `float` > 0.0"),
        ('[[cameras]]\nid = "a"\nsource = 0\ntransport = "x"', "cameras[0].transport: Invalid enum value 'x'"),
        ('[[cameras]]\nid = "a"\nsource = 0\n[[cameras]]\nid = "a"\nsource = 1', "camera id 'a' appears twice"),
        ("[daemon\n", "not valid TOML"),
        ('[[cameras]]\nsource = 0', "cameras[0]: Object missing required field `id`"),
        ('[output]\npose = "yes"', "output.pose: Expected `bool`, got `str` (allowed: bool; measure body pose"),
        ("[output]\nbody_pose = true", "output.body_pose: unknown key (allowed here: max_faces, landmarks, pose)"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(text, expected):
    with pytest.raises(config.ConfigError) as error:
        config.loads(text, origin="lab.toml")
    assert str(error.value).startswith("lab.toml: ")
    assert expected in str(error.value)


def test_camera_transport_overrides_the_daemon_default():
    loaded = config.loads('[daemon]\ntransport = "cuda_ipc"\n[[cameras]]\nid = "a"\nsource = 0\ntransport = "shm"\n[[cameras]]\nid = "b"\nsource = 1')
    assert [loaded.transport_for(c) for c in loaded.cameras] == ["shm", "cuda_ipc"]


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(config.ConfigError, match="cannot read config file"):
        config.load(tmp_path / "nope.toml")
