"""Sources that can never work (Note [Sources that can never work], issue 21 item 5), with a real
daemon: a camera whose video file is not there, in a capture group with a working camera, is
given up on (not retried, a `camera_failed` marker, status says why) while the other camera goes
on; a capture worker whose only camera names a directory could not boot: it is not respawned,
and status says why, for the worker and for its camera."""

from __future__ import annotations

import json
import time

import pytest

from daemon_harness import ready_daemon
from facecast.daemon.cli.status import render

pytestmark = pytest.mark.daemon


def _events(status, kind: str) -> list[dict]:
    found = []
    for line in status.recent_events:
        name, _, fields = line.partition(" ")
        if name == kind:
            found.append(json.loads(fields))
    return found


def test_a_source_that_can_never_work_is_given_up_on_and_said(installed_models, tmp_path):
    missing = tmp_path / "nothere.mp4"
    directory = tmp_path / "a-directory"
    directory.mkdir()
    text = ("[daemon]\ncameras_per_capture_worker = 2\nwarm_standby = \"off\"\n"
            "[output]\nmax_faces = 1\n"
            '[[cameras]]\nid = "ok0"\nsource = "synthetic-replay"\nwidth = 320\nheight = 240\n'
            "fps = 10\n"
            f'[[cameras]]\nid = "gone"\nsource = "{missing}"\nwidth = 320\nheight = 240\n'
            "fps = 10\n"
            f'[[cameras]]\nid = "dir0"\nsource = "{directory}"\nwidth = 320\nheight = 240\n'
            "fps = 10\n")
    with ready_daemon(tmp_path, text) as daemon:
        # The group [ok0, gone] runs on; gone's thread gave its camera up.
        status = daemon.status()
        group = next(w for w in status.workers if w.name == "capture:cpu:0")
        assert group.state == "running", render(status)
        gone = next(r for r in status.cameras["gone"] if r.source)
        assert gone.source.startswith("lost: no such video file") and str(missing) in gone.source
        assert "not retried" in gone.source
        # The worker of dir0 alone could not boot: failed, not respawned, and says why.
        lone = next(w for w in status.workers if w.name == "capture:dir0")
        assert lone.state == "failed" and lone.restarts == 0, render(status)
        assert "not a regular file" in lone.detail and "not retried" in lone.detail
        assert "not captured: capture:dir0 failed" in render(status)
        failed = {e["camera"]: e["reason"] for e in _events(status, "camera_failed")}
        assert set(failed) == {"gone", "dir0"}, status.recent_events
        assert [e["worker"] for e in _events(status, "worker_failed")] == ["capture:dir0"]
        # ok0 keeps publishing while nothing retries gone: a retry would say "lost" again with
        # another reason once the file is there; it stays given up on.
        missing.write_bytes(b"not a video either")
        frames_then = next(r for r in status.cameras["ok0"] if r.source).frames
        deadline = time.monotonic() + 30.0
        while True:  # 3 s of ok0's frames: past the first retries (0.5 s, 1 s) of a lost source
            status = daemon.status()
            ok0 = next(r for r in status.cameras["ok0"] if r.source)
            if ok0.frames >= frames_then + 30:
                break
            assert time.monotonic() < deadline, render(status)
            time.sleep(0.2)
        gone = next(r for r in status.cameras["gone"] if r.source)
        assert gone.source.startswith("lost: no such video file"), gone.source
        assert len(_events(status, "camera_failed")) == 2 and not _events(status, "camera_lost")
        assert next(w for w in status.workers if w.name == "capture:dir0").restarts == 0
