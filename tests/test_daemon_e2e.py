"""The whole daemon, end to end, on this machine's CPU: `facecast run` with config/default.toml
(two synthetic cameras made of real face photos), read by real pylsl inlets, its workers killed
with SIGKILL, reloaded, and stopped with SIGTERM (issue 4's tests; DESIGN §1, §4, §5).

The tests of this module share one daemon and run in order: streams, accuracy, restarts,
reload, stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pylsl
import pytest

from daemon_harness import (REPO, Daemon, Recorder, cpu_seconds, frames_of,
                            score_against_truth, wait_for_state)
from facecast.shared import config as config_mod
from facecast.shared.stats import FrameHops
from facecast.shared.transport import shm
from facecast.workers.output.outlets import face_channels
from facecast.workers.capture.sources import synthetic_truth

CAMERAS = ("synth0", "synth1")
MAX_FACES = 2
WORKERS_TO_KILL = ("capture:synth0", "detection:cpu", "roi_landmark:cpu:0", "output")
RESUME_LIMIT_S = 2.0
FRAMES_TO_SCORE = 100  # per camera: ~7 s at the cameras' 15 fps

pytestmark = pytest.mark.daemon


@pytest.fixture(scope="module")
def daemon(installed_models, tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("e2e"))
    try:
        assert daemon.notify.wait_for("READY=1", timeout_s=90), daemon.log_tail()
        # The measurements below are of the streams' steady state: the faces found. The warm
        # spares boot meanwhile, at nice +10 (Note [Spares at a lower priority]: 25-35 s beside
        # a busy process); the kill test waits for each role's spare before its kill.
        daemon.wait_for_faces(CAMERAS)
        yield daemon
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def face_streams(daemon):
    records = daemon.resolve("Face", count=len(CAMERAS) * MAX_FACES)
    recorder = Recorder(records)
    yield records
    recorder.stop()


@pytest.fixture(scope="module")
def markers(daemon):
    records = daemon.resolve("Markers", count=1)
    assert records, "no Markers stream"
    recorder = Recorder(records)
    yield records[0]
    recorder.stop()


def marker_events(record) -> list[dict]:
    return [json.loads(sample[0] if not isinstance(sample, str) else sample)
            for sample in record.samples]


def test_streams_resolve_by_type_with_source_ids_and_labelled_channels(daemon, face_streams,
                                                                       markers):
    expected = {f"facecast-{daemon.host}-{camera}-face{k}" for camera in CAMERAS
                for k in range(MAX_FACES)}
    assert {record.source_id for record in face_streams} == expected
    labels = [label for label, _, _ in face_channels(landmarks=False)]
    for record in face_streams:
        info = record.inlet.info(timeout=5)
        assert info.channel_count() == len(labels)
        assert info.channel_format() == pylsl.cf_float32
        assert info.nominal_srate() == pylsl.IRREGULAR_RATE  # Note [Rates that survive XDF loading]
        assert info.desc().child("facecast").child_value("camera_fps") == "15"
        channel = info.desc().child("channels").child("channel")
        got = []
        while not channel.empty():
            got.append((channel.child_value("label"), channel.child_value("unit")))
            channel = channel.next_sibling()
        assert [label for label, _ in got] == labels
        assert dict(got)["box_x1"] == "pixels" and dict(got)["head_yaw"] == "degrees"
    assert markers.source_id == f"facecast-{daemon.host}-markers"


def _frames_recorded(face_streams, camera: str) -> int:
    slots = [r for r in face_streams if f"-{camera}-face" in r.source_id]
    if not all(record.timestamps for record in slots):
        return 0
    return len(frames_of(slots)[1])


def test_face_boxes_follow_the_synthetic_ground_truth_with_capture_timestamps(face_streams):
    # What is published is right and stamped with its capture time; how many frames a loaded
    # 2-core machine keeps up with is bench/pipeline.py's question, not this test's: on CI's two
    # busy cores the CPU face stack measures fewer frames than the cameras' 15 fps and skips to
    # the newest frame, which is the designed behaviour (the newest-frame policy).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and min(
            _frames_recorded(face_streams, camera) for camera in CAMERAS) < FRAMES_TO_SCORE:
        time.sleep(0.2)
    scenes = {camera: synthetic_truth(config_mod.CameraConfig(
        id=camera, source="synthetic", width=640, height=360, fps=15)) for camera in CAMERAS}
    for camera in CAMERAS:
        slots = [r for r in face_streams if f"-{camera}-face" in r.source_id]
        for record in slots:
            stamps = np.asarray(record.timestamps)
            assert len(stamps) > 0, f"no samples on {record.name}"
            assert np.all(np.diff(stamps) > 0), f"timestamps of {record.name} do not increase"
            # Capture time, not push time: every sample arrives after its frame was captured,
            # and within a second of it.
            # (The recorder's thread may be between appending a stamp and its arrival.)
            arrived = min(len(record.arrivals), len(stamps))
            lag_s = np.asarray(record.arrivals[:arrived]) - stamps[:arrived]
            assert lag_s.min() > 0 and np.median(lag_s) < 1.0, (lag_s.min(), np.median(lag_s))
        # One sample per slot per frame, all slots stamped with the same capture time (over the
        # span every inlet was recording).
        frames, stamps = frames_of(slots)
        assert len(stamps) >= FRAMES_TO_SCORE, f"only {len(stamps)} frames of camera {camera}"
        assert all(len(frames[stamp]) == len(slots) for stamp in stamps)
        # No more samples than the camera made frames in that span (a frame published twice
        # under two stamps, or push times taken for capture times, could make more).
        camera_frames = (stamps[-1] - stamps[0]) * 15 + 2  # + jitter at both ends
        assert len(stamps) <= camera_frames, (len(stamps), camera_frames)
        score = score_against_truth(frames, stamps, scenes[camera].faces_at)
        assert score.good >= 0.95 * len(stamps), f"camera {camera}: {score.describe()}"


def test_status_accounts_for_every_millisecond_of_a_frames_latency(daemon, face_streams):
    """Note [Latency accounted]: the output worker times each hop of the same frames, from the
    grab to the LSL push, waits between processes included, so the hops' means add up to the
    mean latency; every hop runs forwards on the one clock."""
    wanted = [f"hop {number}: {hop}" for number, hop in enumerate(FrameHops.HOPS, start=1)]
    total = f"hop total: {FrameHops.TOTAL}"
    deadline = time.monotonic() + 30
    while True:  # the output worker's heartbeat brings its timings, about once a second
        stages = daemon.status().stages
        hops = {name.removeprefix("output/"): timing for name, timing in stages.items()
                if name.startswith("output/hop ")}
        if set(hops) == {*wanted, total} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(hops) == {*wanted, total}, sorted(stages)
    counts = {timing.count for timing in hops.values()}
    assert len(counts) == 1 and counts.pop() > 0, hops  # the same frames, every hop of each
    assert all(hops[name].p50_ms >= 0 for name in wanted), hops
    means_ms = sum(hops[name].mean_ms for name in wanted)
    assert means_ms == pytest.approx(hops[total].mean_ms, abs=0.01), hops
    # The total is the latency the cameras report (the same grab-to-push span, other windows).
    camera_p50_ms = [report.latency_ms.p50_ms for reports in daemon.status().cameras.values()
                     for report in reports if report.latency_ms is not None]
    assert camera_p50_ms and hops[total].p50_ms < 5 * max(camera_p50_ms), (hops, camera_p50_ms)


def test_each_worker_kind_killed_is_restarted_and_its_stream_continues(daemon, face_streams,
                                                                      markers):
    watched = next(r for r in face_streams if r.source_id.endswith("-synth0-face0"))
    gaps_s = {}
    for name in WORKERS_TO_KILL:
        before = daemon.worker(name)
        assert before.state == "running", before
        _wait_for_its_warm_standby(daemon, before.role)
        killed_at = pylsl.local_clock()
        os.kill(before.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = daemon.worker(name)
            if now.pid not in (0, before.pid) and now.state == "running":
                break
            time.sleep(0.1)
        assert now.restarts == before.restarts + 1, (now, daemon.log_tail())
        # The stream continues: the next sample captured after the kill.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                stamp > killed_at for stamp in watched.timestamps[-50:]):
            time.sleep(0.05)
        resumed = [s for s in watched.timestamps[-50:] if s > killed_at]
        assert resumed, f"{watched.name} did not continue after {name} was killed"
        gaps_s[name] = resumed[0] - killed_at
        _wait_for_marker(markers, "worker_restart", worker=name)  # before the next kill
    restarted = [e["worker"] for e in marker_events(markers) if e["event"] == "worker_restart"]
    assert restarted == list(WORKERS_TO_KILL), marker_events(markers)
    print("gap after SIGKILL (s):", {k: round(v, 2) for k, v in gaps_s.items()})
    slow = {k: v for k, v in gaps_s.items() if v > RESUME_LIMIT_S}
    assert not slow, f"streams resumed later than {RESUME_LIMIT_S} s: {slow}"


def _wait_for_marker(markers, kind: str, timeout_s: float = 30.0, **fields) -> None:
    """Until the Markers stream has brought an event `kind` with these fields."""
    deadline = time.monotonic() + timeout_s
    while not any(e["event"] == kind and all(e.get(k) == v for k, v in fields.items())
                  for e in marker_events(markers)):
        assert time.monotonic() < deadline, f"no {kind} {fields} marker: {marker_events(markers)}"
        time.sleep(0.05)


def _wait_for_every_spare_started(daemon, timeout_s: float = 30.0) -> None:
    """The fresh spare of each killed worker starts STANDBY_RESPAWN_DELAY_S after the takeover
    (Note [Warm standby]): until each spare has its process (booted or booting)."""
    deadline = time.monotonic() + timeout_s
    while not all(w.pid for w in daemon.status().workers if w.standby):
        assert time.monotonic() < deadline, daemon.status().workers
        time.sleep(0.1)


def _wait_for_its_warm_standby(daemon, role: str, timeout_s: float = 120.0) -> None:
    """The spares start at READY (Note [Warm standby]); the 2 s promise holds once the spare of
    the role is booted. Capture on the CPU has none: its cold start is the fast path. Spares
    boot at a lower CPU priority (Note [Spares at a lower priority]): with both cores of a
    2-core machine busy with other tests and one more busy process, the detection spare was
    still booting after 71 s (2026-11-28)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spares = [w for w in daemon.status().workers if w.standby and w.role == role]
        if not spares or all(w.state == "standby" for w in spares):
            return
        time.sleep(0.1)
    raise AssertionError(f"the {role} spare did not boot within {timeout_s} s: {spares}")


def test_reload_refuses_a_bad_file_and_applies_an_added_camera(daemon, face_streams, markers):
    _wait_for_every_spare_started(daemon)  # no worker starts during the reload
    good_text = daemon.config_path.read_text()
    pids = {w.name: w.pid for w in daemon.status().workers}
    daemon.config_path.write_text(good_text.replace("fps = 15", "fps = -3", 1))
    reload = [sys.executable, "-m", "facecast.daemon.cli", "reload", "--runtime-dir",
              str(daemon.runtime_dir)]
    refused = subprocess.run(reload, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2, refused
    assert "cameras[0].fps" in refused.stderr
    assert {w.name: w.pid for w in daemon.status().workers} == pids

    daemon.config_path.write_text(good_text + (
        '\n[[cameras]]\nid = "synth2"\nsource = "synthetic"\nwidth = 640\nheight = 360\n'
        "fps = 15\n"))
    applied = subprocess.run(reload, capture_output=True, text=True, timeout=30)
    assert applied.returncode == 0, applied
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = {w.name: w for w in daemon.status().workers}
        if workers.get("capture:synth2") and workers["capture:synth2"].state == "running":
            break
        time.sleep(0.2)
    assert workers["capture:synth2"].state == "running"
    # Only the new camera's worker started; the others kept running (new cameras are
    # handed to them).
    assert {name: w.pid for name, w in workers.items() if name in pids} == pids
    new_streams = daemon.resolve("Face", count=len(CAMERAS) * MAX_FACES + MAX_FACES)
    assert any(r.source_id.endswith("-synth2-face0") for r in new_streams)
    events = [e["event"] for e in marker_events(markers)]
    assert "reload_refused" in events and "reload" in events


def test_sighup_reloads_and_the_supervisor_loop_stays_idle(daemon, markers):
    """SIGHUP goes through the same path as `facecast reload`; after it (and any signal) the
    loop must go back to waiting: an unread wakeup byte once made every poll return at once."""
    reloads = sum(e["event"] == "reload" for e in marker_events(markers))
    os.kill(daemon.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while sum(e["event"] == "reload" for e in marker_events(markers)) == reloads:
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.1)
    window_s = 2.0  # a measuring window, not a wait for something to happen
    cpu_before_s, started = cpu_seconds(daemon.process.pid), time.monotonic()
    time.sleep(window_s)
    busy = (cpu_seconds(daemon.process.pid) - cpu_before_s) / (time.monotonic() - started)
    assert busy < 0.3, f"the supervisor used {busy:.0%} of a core while idle after SIGHUP"


def test_status_command_answers_what_the_daemon_is_doing(daemon):
    result = subprocess.run([sys.executable, "-m", "facecast.daemon.cli", "status",
                             "--runtime-dir", str(daemon.runtime_dir)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result
    text = result.stdout
    for name in ("output", "roi_landmark:cpu:0", "detection:cpu", "capture:synth0"):
        assert name in text
    assert "restarts" in text and "running" in text
    camera_line = next(line for line in text.splitlines() if line.startswith("synth0 "))
    assert "shm" in camera_line and "ms" in camera_line  # transport and latency p50/p99
    assert "roi_landmark:cpu:0/landmarks" in text  # per-stage latency
    assert "a frame, grab to LSL push" in text and "hop 4: read → measured" in text  # the hops
    assert "GPU: none" in text


def test_sigterm_stops_in_order_within_5_s_and_leaves_nothing(daemon, markers):
    # Its spares paused (Note [Spares paused while they stand by]): a stopped process acts on
    # SIGTERM only once continued, which the supervisor must do.
    daemon.wait_for_spares()
    for spare in (w for w in daemon.status().workers if w.standby):
        assert wait_for_state(spare.pid, {"T"}) == "T", spare
    worker_pids = [w.pid for w in daemon.status().workers]
    # Only this daemon's segments are checked (Note [A test's own shared memory] in
    # daemon_harness.py); the check must see them while it runs, or it would prove nothing.
    assert any(name.startswith(shm.PREFIX) for name in daemon.own_shm()), daemon.own_pids()
    started = time.monotonic()
    daemon.process.send_signal(signal.SIGTERM)
    returncode = daemon.process.wait(timeout=10)
    elapsed_s = time.monotonic() - started
    assert returncode == 0, daemon.log_tail()
    assert elapsed_s < 5.0
    for pid in worker_pids:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie_of_other(pid)
    assert daemon.own_shm() == []
    assert [p for p in daemon.runtime_dir.iterdir() if p.is_socket()] == []
    # None was killed, and each running worker said Closed before its process ended (Note [A
    # closed worker is not killed]); a spare may still be importing torch, before its handler.
    ended = [line for line in daemon.log_path.read_text().splitlines()
             if "after its SIGTERM (" in line]
    assert len(ended) == len(worker_pids), daemon.log_tail()
    assert not [line for line in ended if "SIGKILLed" in line], ended
    running = [line for line in ended if ": standby:" not in line]
    assert running and all("(closed at " in line for line in running), ended
    _wait_for_marker(markers, "stop")
    assert marker_events(markers)[-1]["event"] == "stop"
    # sd_notify, as a real NOTIFY_SOCKET received it: READY once, watchdog pings while up,
    # STOPPING at the end.
    lines = daemon.notify.assignments()
    assert lines.count("READY=1") >= 1
    ready_at = lines.index("READY=1")
    assert "WATCHDOG=1" in lines[ready_at:]
    assert "STOPPING=1" in lines and lines.index("STOPPING=1") > ready_at
    assert any(line.startswith("STATUS=") for line in lines)
    assert "WATCHDOG=1" not in lines[lines.index("STOPPING=1"):]


def _is_zombie_of_other(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_bad_config_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / "config/default.toml").read_text().replace(
        'transport = "auto"', 'transport = "carrier-pigeon"'))
    result = subprocess.run([sys.executable, "-m", "facecast.daemon.cli", "run", "--config",
                             str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "daemon.transport" in result.stderr and "'shm'" in result.stderr
