"""Warm standbys (Note [Warm standby]): which spares a config gets,
and, with a real daemon on this CPU (`daemon.warm_standby = "on"`), that a SIGKILLed inference
worker is replaced by its booted spare (the same process, under the dead worker's name), that
its stream continues, and that a fresh spare follows."""

from __future__ import annotations

import json
import os
import signal
import time

import pylsl
import pytest

from daemon_harness import (REPO, Daemon, Recorder, cpu_seconds, process_state,
                            wait_for_state)
from facecast.daemon import layout
from facecast.daemon.process import WorkerProcess, WorkerState
from facecast.shared import config as config_mod


def _config(daemon_toml: str = "", transports: tuple[str, ...] = ("", "")) -> config_mod.Config:
    cameras = "".join(
        f'[[cameras]]\nid = "cam{k}"\nsource = "synthetic"\n'
        + (f'transport = "{transport}"\n' if transport else "")
        for k, transport in enumerate(transports))
    return config_mod.loads(f"[daemon]\n{daemon_toml}\n{cameras}")


def _names(specs) -> list[str]:
    return [spec.name for spec in specs]


def test_auto_keeps_a_spare_of_every_role_on_every_device():
    # On the CPU too: a cold start on a busy 2-core machine misses 2 s (capture: 2.02 s).
    assert _names(layout.standby_plan(_config(), gpu_count=0)) == [
        "standby:capture:cpu", "standby:detection:cpu", "standby:roi_landmark:cpu",
        "standby:output"]
    specs = layout.standby_plan(_config(), gpu_count=1)
    assert _names(specs) == ["standby:capture:cuda:0", "standby:detection:cuda:0",
                             "standby:roi_landmark:cuda:0", "standby:output"]
    assert all(spec.standby and spec.camera_ids == () for spec in specs)
    assert [spec.device for spec in specs] == ["cuda:0"] * 3 + ["cpu"]
    # Two GPUs: a set per device (cameras are dealt round-robin), one output spare.
    assert len(layout.standby_plan(_config(), gpu_count=2)) == 7


def test_on_is_auto_and_off_has_none():
    assert (layout.standby_plan(_config('warm_standby = "on"'), gpu_count=0)
            == layout.standby_plan(_config(), gpu_count=0))
    assert layout.standby_plan(_config('warm_standby = "off"'), gpu_count=1) == []


def test_bad_warm_standby_value_names_the_key_and_the_choices():
    with pytest.raises(config_mod.ConfigError) as error:
        _config('warm_standby = "yes"')
    assert "daemon.warm_standby" in str(error.value) and "auto" in str(error.value)


def test_hand_over_gives_the_spare_process_to_the_dead_worker():
    class FakePopen:
        pid = 4242

        def poll(self):
            return None

    spare = WorkerProcess(layout.WorkerSpec("standby:detection:cpu", "detection", (), "cpu",
                                            standby=True))
    dead = WorkerProcess(layout.WorkerSpec("detection:cpu", "detection", ("cam0",), "cpu"))
    spare.popen, spare.state = FakePopen(), WorkerState.STANDBY
    dead.state = WorkerState.BACKOFF
    spare.hand_over(dead, respawn_delay_s=3.0)
    assert dead.pid == 4242 and dead.state == "booting" and dead.alive()
    assert spare.popen is None and spare.state == "pending" and not spare.alive()
    assert spare.next_start_monotonic > time.monotonic() + 2.0


# --- a real daemon ------------------------------------------------------------------------------


@pytest.fixture
def daemon(spare_daemon):
    # config/default.toml: warm_standby = "auto" keeps CPU spares as well. Its cameras at
    # SPARE_TEST_FPS (Note [Spares only where a test needs them]), shared with the other tests of
    # spares (Note [One daemon for several test files]).
    return spare_daemon


TAKEN_OVER: list[tuple[str, int]] = []  # (worker, its restarts) of each takeover seen here


def _kill_and_watch_the_standby_take_over(daemon, role: str, name: str, device: str) -> float:
    """SIGKILL `name`; its spare's process must carry on under that name, the camera's first
    Face stream must continue, and a fresh spare must follow. Returns the stream's gap (s)."""
    spare_name = "standby:output" if role == "output" else f"standby:{role}:{device}"
    spare = daemon.wait_for_worker(spare_name, "standby", timeout_s=60.0)
    victim = daemon.wait_for_worker(name, "running", timeout_s=60.0)
    records = daemon.resolve("Face", count=4)
    watched = next(r for r in records if r.source_id.endswith("-synth0-face0"))
    recorder = Recorder([watched])
    try:
        killed_at = pylsl.local_clock()
        os.kill(victim.pid, signal.SIGKILL)
        promoted = daemon.wait_for_worker(name, "running", timeout_s=30, not_pid=victim.pid)
        assert promoted.pid == spare.pid, (promoted, spare, daemon.log_tail())
        assert promoted.restarts == victim.restarts + 1
        TAKEN_OVER.append((name, promoted.restarts))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(t > killed_at for t in watched.timestamps):
            time.sleep(0.05)
        resumed = [t for t in watched.timestamps if t > killed_at]
        assert resumed, f"{watched.name} did not continue after {name} was killed"
        gap_s = resumed[0] - killed_at
        print(f"{name}: stream resumed {gap_s:.2f} s after the SIGKILL (warm standby)")
    finally:
        recorder.stop()
    fresh = daemon.wait_for_worker(spare_name, "standby", not_pid=spare.pid, timeout_s=60.0)
    assert fresh.pid not in (spare.pid, victim.pid)
    log = (daemon.tmp / "daemon.log").read_text()
    assert f"worker {name}: warm standby pid {spare.pid} takes over" in log
    return gap_s


@pytest.mark.daemon
def test_spares_are_paused_while_they_stand_by(daemon):
    # Note [Spares paused while they stand by]: each spare's process stopped (the kernel's "T"),
    # so that no CPU goes to it; the takeovers below are by such paused spares.
    spares = [w for w in daemon.status().workers if w.standby]
    assert {w.name for w in spares} == {"standby:capture:cpu", "standby:detection:cpu",
                                        "standby:roi_landmark:cpu", "standby:output"}
    for spare in spares:
        assert wait_for_state(spare.pid, {"T"}) == "T", (spare, daemon.log_tail())
    cpu_before = {w.pid: cpu_seconds(w.pid) for w in spares}
    status = {w.name: w for w in daemon.status().workers}  # a round trip through the daemon
    for spare in spares:
        assert status[spare.name].pid == spare.pid and status[spare.name].state == "standby"
        assert status[spare.name].detail.endswith("paused until promoted"), status[spare.name]
        assert process_state(spare.pid) == "T"
        assert cpu_seconds(spare.pid) == cpu_before[spare.pid]
    log = (daemon.tmp / "daemon.log").read_text()
    assert all(f"{w.name} (pid {w.pid}) paused until promoted" in log for w in spares)


@pytest.mark.daemon
@pytest.mark.parametrize("role, name", [("roi_landmark", "roi_landmark:cpu:0"),
                                        ("detection", "detection:cpu"),
                                        ("output", "output")])
def test_a_killed_worker_is_replaced_by_its_warm_standby(daemon, role, name):
    _kill_and_watch_the_standby_take_over(daemon, role, name, "cpu")


@pytest.mark.daemon
def test_restart_events_say_the_standby_took_over(daemon):
    # The events that went to the Markers stream, as `facecast status` keeps them: those of the
    # kills above (the shared daemon's other tests restart workers of their own, cold too).
    restarts = [json.loads(line.partition(" ")[2]) for line in daemon.status().recent_events
                if line.startswith("worker_restart ")]
    ours = [event for event in restarts if (event["worker"], event["restarts"]) in TAKEN_OVER]
    assert {event["worker"] for event in ours} >= {"roi_landmark:cpu:0", "detection:cpu",
                                                   "output"}, restarts
    assert all(event["warm_standby"] is True for event in ours), ours


@pytest.mark.daemon
@pytest.mark.gpu
def test_gpu_workers_killed_are_replaced_by_their_warm_standbys(installed_models, tmp_path):
    """On a GPU, with CUDA IPC (the default `warm_standby = "auto"`): a capture, roi_landmark and
    detection worker killed in turn are each replaced by their device's spare. The gaps are
    printed (the soak's long form holds them to 2 s)."""
    from facecast.shared.transport.cuda_driver import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        pytest.skip(f"needs CUDA IPC: {reason}")
    text = (REPO / "config/default.toml").read_text().replace(
        'transport = "auto"', 'transport = "cuda_ipc"') + '\n[models]\ndevice = "cuda"\n'
    daemon = Daemon(tmp_path, config_text=text)
    try:
        assert daemon.notify.wait_for("READY=1", timeout_s=120), daemon.log_tail()
        gaps_s = {name: _kill_and_watch_the_standby_take_over(daemon, role, name, "cuda:0")
                  for role, name in (("capture", "capture:synth0"),
                                     ("roi_landmark", "roi_landmark:cuda:0:0"),
                                     ("detection", "detection:cuda:0"))}
        print("gaps after SIGKILL with warm standbys (s):",
              {name: round(gap, 2) for name, gap in gaps_s.items()})
    finally:
        daemon.close()
