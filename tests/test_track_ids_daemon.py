"""Track ids stay unique across restarts of the roi_landmark worker (Note [Track id blocks]), end
to end: `facecast run` on this CPU with config/default.toml (two
synthetic cameras, two faces each, at 5 fps) and its warm spares (`daemon.warm_standby = "auto"`,
which is "on"), its Face streams read by real pylsl inlets; the daemon is the one the tests of
spares share (`spare_daemon`). The roi_landmark worker is SIGKILLed twice: once its warm standby takes over,
once it is started cold. No track id published after a kill was ever published before it, and
the two cameras never share an id.

Regression: every roi_landmark process counted ids from 1, so a recording that spanned a worker
restart had the same id for two different people.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pylsl
import pytest

from daemon_harness import Recorder
from facecast.shared.transport.messages import TRACK_ID_LIMIT

pytestmark = pytest.mark.daemon

CAMERAS = ("synth0", "synth1")
FACES_PER_CAMERA = 2  # the synthetic scene's two photos, both in view all the time
WORKER = "roi_landmark:cpu:0"
SPARE = "standby:roi_landmark:cpu"


@pytest.fixture
def daemon(spare_daemon):
    # Note [Spares only where a test needs them]: the cameras at SPARE_TEST_FPS; the daemon is
    # shared with the other tests of spares (Note [One daemon for several test files]).
    return spare_daemon


def _camera(daemon, record) -> str:
    return record.source_id.removeprefix(f"facecast-{daemon.host}-").rpartition("-face")[0]


def _ids(daemon, records, after_ts: float = -math.inf, before_ts: float = math.inf):
    """camera → the track ids its Face streams published for frames captured in the span."""
    ids = {camera: set() for camera in CAMERAS}
    for record in records:
        for stamp, sample in zip(list(record.timestamps), list(record.samples)):
            if after_ts < stamp < before_ts and not math.isnan(sample[0]):
                ids[_camera(daemon, record)].add(int(sample[0]))
    return ids


def _wait_for_every_face(daemon, records, after_ts: float, timeout_s: float = 60.0):
    """The ids of frames captured after `after_ts`, once every face of every camera has one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = _ids(daemon, records, after_ts=after_ts)
        if all(len(found) >= FACES_PER_CAMERA for found in ids.values()):
            return ids
        time.sleep(0.1)
    raise AssertionError(f"not every face got an id after {after_ts}: {ids}\n{daemon.log_tail()}")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _kill(pid: int) -> tuple[float, float]:
    """SIGKILL `pid`; (the LSL time just before, the LSL time once it is dead). A frame captured
    after the second can only have been measured by another process."""
    before_lsl = pylsl.local_clock()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} survived SIGKILL for 10 s"
        time.sleep(0.01)
    return before_lsl, pylsl.local_clock()


def _union(*id_maps) -> set[int]:
    return {i for ids in id_maps for found in ids.values() for i in found}


@pytest.mark.timeout(480)
def test_no_track_id_is_reused_after_the_roi_landmark_worker_is_killed(daemon):
    records = daemon.resolve("Face", count=len(CAMERAS) * 2)
    assert len(records) == len(CAMERAS) * 2, daemon.log_tail()
    recorder = Recorder(records)
    try:
        spare = daemon.wait_for_worker(SPARE, "standby", timeout_s=120.0)
        victim = daemon.wait_for_worker(WORKER, "running", timeout_s=120.0)
        _wait_for_every_face(daemon, records, after_ts=-math.inf)

        # 1. Warm: the spare takes the dead worker's name (and gets its own blocks).
        killed_lsl, dead_lsl = _kill(victim.pid)
        before = _ids(daemon, records, before_ts=killed_lsl)
        promoted = daemon.wait_for_worker(WORKER, "running", not_pid=victim.pid, timeout_s=120.0)
        assert promoted.pid == spare.pid, (promoted, spare, daemon.log_tail())
        after_warm = _wait_for_every_face(daemon, records, after_ts=dead_lsl)

        # 2. Cold: a fresh process. The (new) spare is killed first, so that none is ready.
        spare_now = daemon.worker(SPARE)
        if spare_now.pid:
            _kill(spare_now.pid)
        killed_again_lsl, dead_again_lsl = _kill(promoted.pid)
        between = _ids(daemon, records, after_ts=dead_lsl, before_ts=killed_again_lsl)
        restarted = daemon.wait_for_worker(WORKER, "running", not_pid=promoted.pid, timeout_s=120.0)
        assert restarted.pid not in (promoted.pid, spare.pid, spare_now.pid)
        after_cold = _wait_for_every_face(daemon, records, after_ts=dead_again_lsl)
    finally:
        recorder.stop()

    print("track ids before:", before, "after the warm standby:", after_warm,
          "after the cold restart:", after_cold)
    reused_warm = _union(after_warm) & _union(before)
    assert not reused_warm, f"ids {reused_warm} published again after the warm standby took over"
    reused_cold = _union(after_cold) & _union(before, between)
    assert not reused_cold, f"ids {reused_cold} published again after the cold restart"
    everything = _ids(daemon, records)
    assert not everything["synth0"] & everything["synth1"], everything  # daemon-wide, too
    assert all(1 <= i < TRACK_ID_LIMIT for i in _union(everything))
