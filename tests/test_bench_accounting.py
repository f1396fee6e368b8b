"""bench/accounting.py: what the whole-daemon bench counts for facecast and for the MediaPipe
baseline alike (Note [One definition for both sides]), and bench/pipeline.py's use of it on
samples as pylsl inlets deliver them. No daemon, no MediaPipe: the counting itself."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import accounting  # noqa: E402 (bench/ is not a package)
import pipeline  # noqa: E402

from facecast.shared.config import CameraConfig, StagingConfig  # noqa: E402
from facecast.workers.capture.sources import SyntheticScene, synthetic_truth  # noqa: E402


def test_mesh_box_is_facecasts_box_of_a_tracked_face():
    """The baseline's meshes get the box facecast gives a tracked face (Note [Box of a tracked
    face]): same constants, same box to float32 precision."""
    torch = pytest.importorskip("torch")
    from facecast.models import face_mesh

    assert accounting.TRACKED_BOX_CENTER_OFFSET == face_mesh.TRACKED_BOX_CENTER_OFFSET
    assert accounting.TRACKED_BOX_SIDE == face_mesh.TRACKED_BOX_SIDE
    assert accounting.NUM_MESH_POINTS == face_mesh.NUM_MESH_POINTS
    rng = np.random.default_rng(3)
    for _ in range(5):
        landmarks = rng.uniform(100, 900, size=(478, 3)).astype(np.float32)
        expected = face_mesh.boxes_from_landmarks(torch.from_numpy(landmarks)[None])[0].numpy()
        np.testing.assert_allclose(accounting.mesh_box_px(landmarks), expected, rtol=0, atol=1e-3)


@pytest.mark.parametrize("phase_s", [0.0, 0.004, 0.0165, 0.0333])
def test_a_window_of_n_frame_periods_holds_n_frames_of_any_camera(phase_s):
    fps = 30.0
    window = accounting.Window.starting_at(1000.0, measure_s=2.0, fps=fps)
    assert window.frames_per_camera == 60 and window.length_s == pytest.approx(2.0)
    grid = 990.0 + phase_s + np.arange(1000) / fps  # a camera paced at fps, any phase
    assert sum(window.contains(ts) for ts in grid) == 60


def test_dropped_is_due_minus_published_never_clamped():
    window = accounting.Window.starting_at(0.0, measure_s=1.0, fps=30.0)
    short = accounting.frame_counts(cameras=2, window=window, published=45)
    assert (short["frames_due"], short["dropped"], short["dropped_pct"]) == (60, 15, 25.0)
    assert short["published_fps"] == 45.0
    # More published than due is a counting error and must show, not be hidden at 0.
    over = accounting.frame_counts(cameras=2, window=window, published=61)
    assert over["dropped"] == -1 and over["dropped_pct"] < 0


def test_a_replayed_frame_counts_by_when_it_was_due_and_once():
    """Note [Due, not stamped]: a frame due before the window's end but stamped after it counts,
    one stamped inside the window but due before its start does not, and a frame shown twice
    (a late wake-up that showed the next tick's frame) counts once."""
    fps = 30.0
    camera = "cam00"
    truth = synthetic_truth(CameraConfig(id=camera, source="synthetic-replay",
                                         width=pipeline.WIDTH, height=pipeline.HEIGHT, fps=fps))
    due = accounting.due_ts_lsl(truth, 200.0 + np.arange(0, 40) / fps)  # the camera's captures
    window = accounting.Window(float(due[4] + 0.1 / fps), 30, fps)  # due[5] .. due[34] inside
    assert window.holds(due).sum() == 30
    stamps = due[4:36] + 0.004  # 4 ms late, each
    stamps[0] = window.start_ts_lsl + 0.001  # due before the start, stamped after it
    stamps[30] = window.end_ts_lsl + 0.002  # due[34]: stamped after the end, due before it
    stamps = np.insert(stamps, 11, stamps[10] + 0.3 / fps)  # due[14] shown twice
    assert float(accounting.due_ts_lsl(truth, stamps[11])) == due[14]
    box = [(np.nan,) * 4]
    samples = {camera: (stamps, np.array(box * len(stamps)), stamps + 0.03)}
    counted = pipeline.published_frames(samples, window, [camera], "synthetic-replay")
    assert counted["published"] == 30 and counted["lost_between"] == 0
    dropped_two = np.delete(stamps, [7, 8])  # due[10] and due[11] never came
    counted = pipeline.published_frames({camera: (dropped_two, np.array(box * len(dropped_two)),
                                                  dropped_two + 0.03)}, window, [camera],
                                        "synthetic-replay")
    assert counted["published"] == 28 and counted["lost_between"] == 2


def test_frames_lost_between_published_ones_are_gaps_not_jitter_nor_edges():
    fps = 30.0
    rng = np.random.default_rng(5)
    stamps = 50.0 + np.arange(90) / fps + rng.uniform(-0.2, 0.2, 90) / fps  # a grid, each stamp off by < 1/4 period
    assert accounting.frames_lost_between(stamps, fps) == 0
    # Frames 10 and 40-42 never published: 4 lost, whatever order the stamps come in.
    kept = np.delete(stamps, [10, 40, 41, 42])
    assert accounting.frames_lost_between(kept[::-1], fps) == 4
    # Missing at the window's ends is not a gap between published frames.
    assert accounting.frames_lost_between(kept[3:-5], fps) == 4
    assert accounting.frames_lost_between([], fps) == 0
    assert accounting.frame_counts(1, accounting.Window.starting_at(0.0, 3.0, fps), 86,
                                   lost_between=4)["lost_between"] == 4


def test_faces_count_when_their_box_overlaps_a_true_face_enough():
    truths = SyntheticScene(1920, 1080, seed="cam00").faces_at(12.5)
    exact = [t.box_px for t in truths]
    x1, y1, x2, y2 = exact[0]
    width = x2 - x1
    moved_far = (x1 + 0.6 * width, y1, x2 + 0.6 * width, y2)  # IoU 0.25: not this face
    tally = accounting.FaceTally()
    tally.add(truths, exact)  # both found
    tally.add(truths, [moved_far])  # none found, one extra
    tally.add(truths, [exact[1], exact[1]])  # one found, the duplicate is extra
    tally.add(truths, [])  # a frame with no result: its faces count as not found
    summary = tally.summary()
    assert summary["frames"] == 4
    assert summary["found_of_true"] == "3/8" and summary["extra"] == 2
    assert summary["faces_per_frame"] == 0.75 and summary["true_faces_per_frame"] == 2.0
    assert summary["matched_iou_min"] == 1.0
    merged = accounting.FaceTally()
    merged.merge(tally.as_dict())
    merged.merge(tally.as_dict())
    assert merged.summary()["found_of_true"] == "6/16" and merged.summary()["frames"] == 8


@pytest.mark.parametrize("source", ["synthetic", "synthetic-replay"])
def test_published_frames_count_each_frame_once_from_every_slot_sample(source):
    """What the bench's inlets got, per camera: a frame is published once whatever the number
    of face slots, an all-NaN sample is a published frame without a face, samples captured
    outside the window do not count; faces against the camera's source's own truth."""
    fps = 30.0
    window = accounting.Window.starting_at(100.0, measure_s=1.0, fps=fps)
    scene = synthetic_truth(CameraConfig(id="cam00", source=source, width=pipeline.WIDTH,
                                         height=pipeline.HEIGHT, fps=fps))
    stamps, boxes = [], []
    # Frames as the camera captures them (a replayed one in the middle of its ticks), 1 ms
    # late: 3 before the window, 3 after.
    grid = accounting.due_ts_lsl(scene, 100.0 + np.arange(-3, 33) / fps)
    frame_ts = grid + 0.001
    published_in_window = [ts for ts in frame_ts
                           if window.contains(accounting.due_ts_lsl(scene, ts))][:-2]  # 2 never came
    for k, ts in enumerate(published_in_window + [frame_ts[0], frame_ts[-1]]):
        truth = [t.box_px for t in scene.faces_at(ts)]
        slot0 = truth[0]
        slot1 = truth[1] if k % 2 == 0 else (np.nan,) * 4  # a face missed on odd frames
        stamps += [ts, ts]
        boxes += [slot0, slot1]
    samples = {"cam00": (np.array(stamps), np.array(boxes, np.float64),
                         np.array(stamps) + 0.030)}
    counted = pipeline.published_frames(samples, window, ["cam00", "cam01"], source)
    assert counted["published"] == len(published_in_window) == 28
    assert counted["lost_between"] == 0  # its 2 unpublished frames were the window's last
    faces = counted["faces"].summary()
    assert faces["frames"] == 28 and faces["found_of_true"] == f"{28 + 14}/56"
    assert faces["extra"] == 0
    assert counted["inlet_latency"]["latency_p99_ms"] == pytest.approx(30.0, abs=0.01)
    # cam01 published nothing: all its frames are due and dropped.
    counts = accounting.frame_counts(2, window, counted["published"])
    assert counts["dropped"] == 60 - 28


@pytest.mark.parametrize("source", ["synthetic", "synthetic-replay"])
def test_a_newcomer_is_timed_from_the_first_frame_that_shows_them(source):
    """Note [A newcomer's delay], on the staged scene the bench gives its cameras: every
    appearance of NEWCOMER inside the window is found from the ground truth; its delay runs
    from the first frame showing them to the arrival of the first published frame whose boxes
    match them; an appearance never matched is missed; frames of the one who stays do not count."""
    fps = float(pipeline.FPS)
    window = accounting.Window.starting_at(200.0, measure_s=8.0, fps=fps)
    # cam02: a replayed camera's phase is its id's, 0.80 of a period here (Note [Capture
    # phases]), so its captures fall in the shared clock's next tick.
    config = CameraConfig(id="cam02", source=source, width=pipeline.WIDTH,
                          height=pipeline.HEIGHT, fps=fps,
                          staging=msgspec.convert(pipeline.NEWCOMER_STAGING, StagingConfig))
    truth = synthetic_truth(config)
    # The camera's own ticks: a replayed camera's phase is its id's (Note [Capture phases]).
    phase = getattr(truth, "phase", 0.0)
    assert phase == (pytest.approx(0.7996, abs=1e-4) if source == "synthetic-replay" else 0.0)
    ticks = np.arange(math.floor(window.start_ts_lsl * fps - phase) - 40,
                      math.floor(window.end_ts_lsl * fps - phase) + 40)
    frame_ts = (ticks + 0.5 + phase) / fps  # captured half a period into each tick
    shown = np.array([any(t.name == pipeline.NEWCOMER for t in truth.faces_at(ts))
                      for ts in frame_ts])
    firsts = np.flatnonzero(shown[1:] & ~shown[:-1]) + 1
    inside = [i for i in firsts if window.contains(frame_ts[i])
              and frame_ts[i + np.flatnonzero(~shown[i:])[0]] < window.end_ts_lsl]
    assert len(inside) >= 3
    missed_one, late_frames = inside[1], {inside[0]: 0, inside[2]: 3}
    stamps, boxes = [], []
    for index, ts in enumerate(frame_ts):
        faces = {t.name: t.box_px for t in truth.faces_at(ts)}
        stays = faces.get("grace_hopper", (np.nan,) * 4)
        newcomer = faces.get(pipeline.NEWCOMER, (np.nan,) * 4)
        first = max((i for i in firsts if i <= index), default=None)
        if first == missed_one or (first in late_frames and index - first < late_frames[first]):
            newcomer = (np.nan,) * 4  # not found yet (or never, in the missed appearance)
        stamps += [ts, ts]
        boxes += [stays, newcomer]
    arrivals = np.array(stamps) + 0.040  # each frame reaches the inlet 40 ms after its capture
    samples = {"cam02": (np.array(stamps), np.array(boxes, np.float64), arrivals)}
    counted = pipeline.published_frames(samples, window, ["cam02"], source, newcomers=True)
    newcomers = counted["newcomers"]
    assert newcomers["appearances"] == len(inside) and newcomers["missed"] == 1
    assert newcomers["frames_late_max"] == 3
    expected_ms = [40.0 + late_frames.get(i, 0) / fps * 1e3 for i in inside if i != missed_one]
    assert newcomers["delay_p50_ms"] == pytest.approx(np.percentile(expected_ms, 50), abs=0.05)
    assert newcomers["delay_max_ms"] == pytest.approx(40.0 + 3 / fps * 1e3, abs=0.05)
    assert newcomers["within_goal_pct"] == pytest.approx(
        100.0 * (len(inside) - 2) / len(inside), abs=0.1)  # the missed one and the 140 ms one
    # The staged scene's truth counts the faces: the newcomer is not missing when away.
    assert counted["faces"].summary()["extra"] == 0


def test_kills_are_counted_from_the_supervisors_log_lines():
    log = "\n".join([
        "x INFO facecast.daemon.process: started capture:cam00 (pid 11)",
        "x ERROR facecast.daemon.worker_table: worker capture:cam00 (pid 11) hung: did not start "
        "within 120 s; killing it",
        "x INFO facecast.daemon.supervisor: ready in 9.6 s: 1 camera",
        "x ERROR facecast.daemon.worker_table: worker detection:cpu (pid 12) hung: did not start "
        "within 120 s; killing it",
        "x WARNING facecast.daemon.process: worker output did not stop in time; killing it",
        "x WARNING facecast.daemon.process: worker capture:cuda:0:0 did not end after closing in "
        "time; killing it",
        "x ERROR facecast.daemon.process: worker output (pid 13) is stuck even after SIGKILL",
    ])
    assert pipeline.kills_in_log(log) == {
        "workers_hung_at_boot": 1, "workers_hung_booting_later": 1,
        "workers_sigkilled_at_stop": 2, "workers_stuck_after_sigkill": 1}


def test_the_log_lines_the_bench_counts_are_the_ones_the_daemon_writes():
    """The bench counts kills by the supervisor's wording: a rewording must fail here, not
    silently count 0."""
    source = "\n".join(path.read_text() for path in (REPO / "daemon").glob("*.py"))
    for line in (pipeline.LOG_SIGKILLED_AT_STOP, pipeline.LOG_SIGKILLED_AFTER_CLOSING,
                 pipeline.LOG_STUCK_AFTER_SIGKILL, pipeline.LOG_HUNG_BOOTING):
        assert line in source, line
    assert re.search(r'log\.info\("ready\b', source), "the supervisor's 'ready' line moved"
    assert pipeline.LOG_READY.search("x INFO facecast.daemon.supervisor: ready in 9.6 s: ok")


def test_camera_counts_take_spaces_or_commas():
    assert pipeline.camera_counts(["32,64"]) == [32, 64]
    assert pipeline.camera_counts(["1", "4", "8,16"]) == [1, 4, 8, 16]
    with pytest.raises(Exception, match="positive"):
        pipeline.camera_counts(["0"])


def test_a_spare_s_cores_and_its_threads_by_name_come_from_proc():
    """Issue 24 item 4 (a waiting spare costs nothing) is measured per spare and per thread:
    an idle spare shows no core, a busy one its cores, under the name of the thread that spent
    them (how the CUDA driver's thread was found spending an idle spare's CPU)."""
    import subprocess
    import time
    from types import SimpleNamespace

    busy_code = ("import threading, sys\n"
                 "def spin():\n"
                 "    tid = threading.get_native_id()\n"
                 "    open(f'/proc/self/task/{tid}/comm', 'w').write('spinner')\n"
                 "    print('spinning', flush=True)\n"
                 "    while True: pass\n"
                 "threading.Thread(target=spin, daemon=True).start()\n"
                 "sys.stdin.read()\n")
    idle = subprocess.Popen([sys.executable, "-c", "import sys; print('idle', flush=True); "
                             "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    busy = subprocess.Popen([sys.executable, "-c", busy_code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline().strip() == "idle"
        assert busy.stdout.readline().strip() == "spinning"
        status = SimpleNamespace(workers=[
            SimpleNamespace(pid=idle.pid, name="standby:output", standby=True),
            SimpleNamespace(pid=busy.pid, name="standby:roi_landmark:cuda:0", standby=True),
            SimpleNamespace(pid=busy.pid, name="roi_landmark:cuda:0:0", standby=False)])
        first, started = pipeline.spare_threads_cpu_s(status), time.monotonic()
        spent_before = pipeline.process_cpu_s(busy.pid)
        deadline = started + 60
        while pipeline.process_cpu_s(busy.pid) - spent_before < 0.3:  # the spinner's CPU, not a clock
            assert time.monotonic() < deadline, "the spinning process got no CPU in 60 s"
            time.sleep(0.01)
        last, window_s = pipeline.spare_threads_cpu_s(status), time.monotonic() - started
        cores = pipeline.spare_cores(first, last, window_s)
    finally:
        for process in (idle, busy):
            process.kill()
            process.wait()
    assert set(cores["per_spare"]) == {"standby:output", "standby:roi_landmark:cuda:0"}
    assert cores["per_spare"]["standby:roi_landmark:cuda:0"] >= 0.3 / window_s - 0.01
    assert cores["per_spare"]["standby:output"] < cores["per_spare"]["standby:roi_landmark:cuda:0"]
    assert next(iter(cores["by_thread"])) == "spinner"


def test_the_cameras_p99s_are_spread_beside_their_maximum():
    """One slow camera and many alike read differently, though the row's maximum is the same."""
    from accounting import camera_p99_spread

    one_slow = {f"cam{index:02d}": 20.0 + index * 0.1 for index in range(20)} | {"slow": 70.0}
    spread = camera_p99_spread(one_slow)
    assert spread["cameras"] == 21 and spread["median_ms"] == 21.0
    assert spread["p90_ms"] < 23.0 and spread["worst"] == [["slow", 70.0], ["cam19", 21.9],
                                                            ["cam18", 21.8]]
    assert camera_p99_spread({"a": None}) is None
    assert camera_p99_spread({"b": 30.0, "a": 30.0}, worst=2)["worst"] == [["a", 30.0],
                                                                         ["b", 30.0]]
