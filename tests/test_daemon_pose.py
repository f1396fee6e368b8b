"""Body pose through the whole daemon (DESIGN §4 "optional pose stream per camera"): with
`output.pose = true`, each camera gets a `MoCap` stream whose samples carry the same capture
timestamps as its Face streams, measured by the roi_landmark worker (models/pose.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from daemon_harness import Recorder, ready_daemon
from facecast.workers.output.outlets import pose_channels

pytestmark = pytest.mark.daemon

CONFIG = """
[daemon]
transport = "shm"
warm_standby = "off"  # Note [Spares only where a test needs them]

[output]
max_faces = 1
pose = true

[[cameras]]
id = "synth0"
source = "synthetic"
width = 640
height = 360
fps = 10
"""


@pytest.fixture(scope="module")
def daemon(installed_models, tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("pose"), config_text=CONFIG) as daemon:
        yield daemon


def test_mocap_stream_follows_the_face_stream_frame_for_frame(daemon):
    [pose] = daemon.resolve("MoCap", count=1)
    [face] = daemon.resolve("Face", count=1)
    assert pose.source_id == f"facecast-{daemon.host}-synth0-pose"
    assert pose.inlet.info().channel_count() == len(pose_channels())
    recorder = Recorder([pose, face])
    try:
        # 20 frames of both (2 s at 10 fps; 10 are asserted), however long a busy machine takes.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(len(pose.timestamps),
                                                  len(face.timestamps)) < 20:
            time.sleep(0.1)
    finally:
        recorder.stop()
    assert len(pose.timestamps) >= 10, (len(pose.timestamps), daemon.log_tail())
    # Both are pushed per frame the roi_landmark worker measured, stamped with its capture time.
    shared = set(pose.timestamps) & set(face.timestamps)
    assert len(shared) >= 0.9 * min(len(pose.timestamps), len(face.timestamps))
    samples = np.asarray(pose.samples, dtype=np.float64)
    assert samples.shape[1] == len(pose_channels())
    # The synthetic scene shows heads only: whatever the detector makes of them, a found body
    # has finite coordinates within a few metres of the hips and visibility in [0, 1]; a frame
    # without one is all NaN (never a half-filled sample).
    for sample in samples:
        if np.isnan(sample).any():
            assert np.isnan(sample).all(), sample
            continue
        markers = sample.reshape(-1, 4)
        assert np.abs(markers[:, :3]).max() < 5.0, markers
        assert ((markers[:, 3] >= 0) & (markers[:, 3] <= 1)).all(), markers


def test_status_shows_the_pose_stage(daemon):
    stages = daemon.status().stages
    assert any(name.startswith("roi_landmark") and name.endswith("/pose") for name in stages), stages
