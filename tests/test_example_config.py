"""The shipped configs load with the strict loader and say what their comments promise."""

from __future__ import annotations

import re
from pathlib import Path

from facecast.shared import config
from facecast.workers.capture.sources import source_kind

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "example-lab.toml"


def test_example_lab_config_has_four_usb_cameras_and_one_rtsp_camera_on_gpu_0():
    loaded = config.load(EXAMPLE)
    assert loaded.daemon.transport == "auto"
    usb = [camera for camera in loaded.cameras if source_kind(camera.source) == "v4l2"]
    streams = [camera for camera in loaded.cameras if source_kind(camera.source) == "stream"]
    assert len(loaded.cameras) == 5
    assert [camera.source for camera in usb] == [f"/dev/video{index}" for index in range(4)]
    for camera in usb:
        mode = (camera.width, camera.height, camera.fps, camera.fourcc)
        assert mode == (1920, 1080, 30.0, "MJPG"), camera.id
    assert len(streams) == 1 and str(streams[0].source).startswith("rtsp://")
    assert all(camera.gpu == 0 for camera in loaded.cameras)
    assert all(loaded.transport_for(camera) == "auto" for camera in loaded.cameras)


def test_example_lab_config_shows_every_key():
    # The example is the reference a user copies: a key added to shared/config.py belongs in it.
    text = EXAMPLE.read_text()
    keys_set = set(re.findall(r"^([a-z_]+) = ", text, flags=re.MULTILINE))
    # A lab's cameras are real ones; staging (synthetic cameras only) is shown commented out.
    if re.search(r"^#   \[cameras\.staging\]\n#   cycle_s = .*\n#   appearances = ", text,
                 flags=re.MULTILINE):
        keys_set.add("staging")
    # So is phase (replayed synthetic cameras only).
    if re.search(r'^#   source = "synthetic-replay"\n#   phase = ', text, flags=re.MULTILINE):
        keys_set.add("phase")
    for struct in (config.DaemonConfig, config.ModelsConfig, config.OutputConfig,
                   config.CameraConfig, config.WebConfig, config.RecordConfig,
                   config.ParticipantsConfig, config.SynchronyConfig):
        missing = set(struct.__struct_fields__) - keys_set
        assert not missing, f"{struct.__name__} keys missing from {EXAMPLE.name}: {sorted(missing)}"


def test_example_lab_config_records_video_without_overlays():
    # Burned-in overlays change the pictures for good: the example shows the key, off.
    assert re.search(r"^overlays = false$", EXAMPLE.read_text(), flags=re.MULTILINE)
    assert config.load(EXAMPLE).record.overlays is False


def test_default_config_still_loads_with_synthetic_cameras():
    loaded = config.load(ROOT / "config" / "default.toml")
    assert [camera.id for camera in loaded.cameras] == ["synth0", "synth1"]
    assert all(source_kind(camera.source) == "synthetic" for camera in loaded.cameras)
    assert loaded.daemon.transport == "auto"
