"""Note [Detection while the device has room]: besides the passes roi_landmark asks for and the
`detect_interval_s` ones, the detection worker searches every camera with a new frame whenever
its passes have taken at most `daemon.detection_share` of its time, so that a face walking into
view is found within a frame or two where the device has room (issue 24 item 5).

A real daemon on the CPU, its detection worker's Detections read from its PUB socket as a
roi_landmark worker reads them."""

from __future__ import annotations

import time

import pytest
import zmq

from daemon_harness import ready_daemon
from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import Detections
from facecast.workers.inference.detection import detection_share

pytestmark = pytest.mark.daemon

# A pass every 60 s at most from the interval, and a face the roi_landmark worker keeps tracking
# (so it asks for no pass): every pass beyond the first few is the share's.
CONFIG = """
[daemon]
transport = "shm"
warm_standby = "off"  # Note [Spares only where a test needs them]
detect_interval_s = 60
detection_share = 1.0

[output]
max_faces = 1

[[cameras]]
id = "synth0"
source = "synthetic"
width = 640
height = 360
fps = 5
"""


@pytest.fixture(scope="module")
def daemon(installed_models, tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("schedule"), config_text=CONFIG) as running:
        yield running


def test_a_detection_worker_with_room_searches_every_frame(daemon):
    frames_searched: set[int] = set()
    with zmq.Context() as context, context.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, b"synth0")
        sub.connect(endpoints.detections(daemon.runtime_dir, "cpu"))
        gate = messages.MessageGate("test")
        deadline = time.monotonic() + 30
        # 5 frames/s: 4 s of frames, read until 20 distinct frames are covered or time is up.
        first_seq = last_seq = None
        while time.monotonic() < deadline and len(frames_searched) < 20:
            if not sub.poll(1000):
                continue
            _, body = sub.recv_multipart()
            found = gate.decode(body)
            assert isinstance(found, Detections)
            frames_searched.add(found.frame_seq)
            first_seq = found.frame_seq if first_seq is None else first_seq
            last_seq = found.frame_seq
    assert first_seq is not None, "no detection pass at all: " + daemon.log_tail()
    span = last_seq - first_seq + 1
    # Each pass takes tens of milliseconds of the 200 between frames: nearly every frame is
    # searched (some may be passed over while the machine is busy; the interval alone would
    # search none of them).
    assert len(frames_searched) >= 20 and len(frames_searched) >= 0.6 * span, (
        sorted(frames_searched), span)


@pytest.mark.parametrize("configured, device, share", [
    ("auto", "cpu", 0.1), ("auto", "cuda:0", 0.5), (0.25, "cuda:1", 0.25), (1.0, "cpu", 1.0),
])
def test_detection_share_of_a_device(configured, device, share):
    assert detection_share(configured, device) == share
