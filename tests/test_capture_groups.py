"""Capture groups (Note [Capture groups], Note [Camera threads]): which cameras share a capture
process, and, with a real daemon, that
one camera of a group that loses its source is retried while the group's other camera keeps
publishing, in the same process."""

from __future__ import annotations

import json
import time

import pytest

from daemon_harness import Daemon, Recorder
from facecast.daemon import layout
from facecast.shared import config as config_mod
from rtsp_peer import RtspPeer


def _config(count: int, per_worker: str = '"auto"', device: str = "auto") -> config_mod.Config:
    cameras = "".join(f'[[cameras]]\nid = "c{k:02d}"\nsource = "synthetic"\n'
                      for k in range(count))
    return config_mod.loads(f"[daemon]\ncameras_per_capture_worker = {per_worker}\n"
                            f'[models]\ndevice = "{device}"\n{cameras}')


def _captures(config: config_mod.Config, gpus: int) -> list[layout.WorkerSpec]:
    return [s for s in layout.plan(config, gpus) if s.role == "capture"]


def test_auto_keeps_a_process_per_camera_up_to_four_per_gpu():
    assert [s.name for s in _captures(_config(4), 1)] == [f"capture:c{k:02d}" for k in range(4)]
    assert [s.name for s in _captures(_config(64), 0)][:2] == ["capture:c00", "capture:c01"]
    assert len(_captures(_config(64), 0)) == 64  # the CPU has no contexts to save


def test_auto_groups_cameras_beyond_four_per_gpu_into_four_processes():
    for count, per_group, processes in ((5, 2, 3), (8, 2, 4), (9, 3, 3), (32, 8, 4), (64, 16, 4)):
        specs = _captures(_config(count), 1)
        assert len(specs) == processes and all(s.device == "cuda:0" for s in specs)
        assert [len(s.camera_ids) for s in specs][0] == per_group
        assert specs[0].name == "capture:cuda:0:0"
        # Every camera in exactly one group, in config order.
        assert [c for s in specs for c in s.camera_ids] == [f"c{k:02d}" for k in range(count)]
    two_gpus = _captures(_config(64), 2)  # round-robin: 32 a GPU, 4 groups of 8 each
    assert len(two_gpus) == 8 and {len(s.camera_ids) for s in two_gpus} == {8}
    assert layout.capture_worker_of(two_gpus, "c01") == "capture:cuda:1:0"


def test_a_fixed_group_size_and_its_bounds():
    assert [len(s.camera_ids) for s in _captures(_config(5, "2"), 0)] == [2, 2, 1]
    assert _captures(_config(5, "2"), 0)[2].name == "capture:c04"
    with pytest.raises(config_mod.ConfigError, match="cameras_per_capture_worker"):
        _config(2, "0")


def test_a_changed_group_restarts_its_capture_worker_on_reload():
    old, new = _config(3, "2"), _config(4, "2")
    change = layout.reload_plan(old, new, 0)
    # c03 makes c02's group of one a group of two: a new process for both, started once the
    # old one has stopped (its camera's sockets and ring are the new one's to create).
    assert [s.name for s in change.start] == ["capture:cpu:1"]
    assert [s.name for s in change.stop] == ["capture:c02"]
    assert "capture:cpu:0" in change.unchanged
    grown = layout.reload_plan(_config(2, "3"), _config(3, "3"), 0)
    assert {s.name for s in grown.restart} == {"capture:cpu:0"}  # same name, more cameras


# --- a real daemon --------------------------------------------------------------------------------


@pytest.mark.daemon
def test_one_camera_of_a_group_lost_and_back_while_the_other_publishes(gst_python, installed_models,
                                                                       tmp_path):
    peer = RtspPeer(gst_python, width=320, height=240)
    peer.start()
    text = ("[daemon]\ncameras_per_capture_worker = 2\nwarm_standby = \"off\"\n"
            "[output]\nmax_faces = 1\n"
            '[[cameras]]\nid = "synth0"\nsource = "synthetic"\nwidth = 640\nheight = 360\n'
            "fps = 15\n"
            f'[[cameras]]\nid = "rtsp0"\nsource = "{peer.url}"\nwidth = 320\nheight = 240\n'
            "fps = 15\n")
    daemon = Daemon(tmp_path, config_text=text)
    try:
        assert daemon.notify.wait_for("READY=1", timeout_s=120), daemon.log_tail()
        group = daemon.worker("capture:cpu:0")
        assert group.state == "running"
        markers = daemon.resolve("Markers", count=1)
        synth = next(r for r in daemon.resolve("Face", count=2)
                     if r.source_id.endswith("-synth0-face0"))
        recorder = Recorder([synth, *markers])
        try:
            peer.kill()
            lost_at = _wait_for_marker(markers[0], "camera_lost", "rtsp0", daemon)
            # The group's other camera goes on, in the same process, after the loss.
            deadline = time.monotonic() + 30
            while sum(t > lost_at + 1.0 for t in synth.timestamps) < 10:
                assert time.monotonic() < deadline, daemon.log_tail()
                time.sleep(0.1)
            peer.start()
            _wait_for_marker(markers[0], "camera_back", "rtsp0", daemon)
        finally:
            recorder.stop()
        after = daemon.worker("capture:cpu:0")
        assert after.pid == group.pid and after.restarts == 0
        reports = {r.camera_id: r for r in daemon.status().cameras["synth0"]}
        assert reports  # status still has the camera's reports
    finally:
        daemon.close()
        peer.kill()


def _wait_for_marker(record, kind: str, camera: str, daemon, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for stamp, sample in zip(list(record.timestamps), list(record.samples)):
            event = json.loads(sample[0] if not isinstance(sample, str) else sample)
            if event.get("event") == kind and event.get("camera") == camera:
                return stamp
        time.sleep(0.1)
    raise AssertionError(f"no {kind} marker for {camera} within {timeout_s} s\n"
                         f"{daemon.log_tail()}")
