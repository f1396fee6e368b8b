"""The replaying synthetic camera (`source = "synthetic-replay"`, Note [Synthetic replay]): its
frames are the live scene's at the scene time its truth names, it turns
round at the loop's ends without a jump, its truth is a pure function of the capture timestamp,
and the whole daemon's faces for such a camera follow that truth. What it costs is measured by
bench/pipeline.py, not here: a test is never timed."""

from __future__ import annotations

import math
import time

import numpy as np
import pylsl
import pytest

from daemon_harness import Recorder, frames_of, ready_daemon, score_against_truth
from facecast.shared import config as config_mod
from facecast.shared.config import CameraConfig
from facecast.workers.capture.sources import (
    SyntheticReplay,
    SyntheticReplaySource,
    SyntheticScene,
    open_source,
    source_kind,
    synthetic_truth,
)


def _camera(fps: float = 20.0, width: int = 320, height: int = 240) -> CameraConfig:
    return CameraConfig(id="replay0", source="synthetic-replay", width=width, height=height,
                        fps=fps)


def test_synthetic_replay_is_an_accepted_source() -> None:
    assert source_kind("synthetic-replay") == "synthetic-replay"
    loaded = config_mod.loads('[[cameras]]\nid = "cam0"\nsource = "synthetic-replay"\n')
    assert loaded.cameras[0].source == "synthetic-replay"
    assert isinstance(synthetic_truth(loaded.cameras[0]), SyntheticReplay)
    assert isinstance(synthetic_truth(CameraConfig(id="cam0", source="synthetic")),
                      SyntheticScene)
    with pytest.raises(ValueError, match="only \"synthetic\" and \"synthetic-replay\""):
        synthetic_truth(CameraConfig(id="cam0", source="/dev/video0"))


def test_replayed_frames_are_the_scene_rendered_at_their_scene_time() -> None:
    camera = _camera()
    with open_source(camera) as source:
        assert isinstance(source, SyntheticReplaySource)
        assert (source.granted.width, source.granted.height, source.granted.fps) == (320, 240, 20.0)
        replay, scene = source.replay, SyntheticScene.for_camera(camera)
        for _ in range(4):
            frame, capture_ts_lsl = source.read()
            assert abs(capture_ts_lsl - pylsl.local_clock()) < 0.5  # stamped at grab
            assert frame.shape == (240, 320, 3) and frame.dtype == np.uint8
            assert frame.flags.c_contiguous and not frame.flags.writeable  # a shared loop frame
            # Byte for byte the live scene's frame at the time the truth names.
            scene_time_s = replay.scene_time_s(capture_ts_lsl)
            np.testing.assert_array_equal(frame, scene.render(scene_time_s))
            assert source.ground_truth(capture_ts_lsl) == scene.faces_at(scene_time_s)
            assert source.ground_truth(capture_ts_lsl) == synthetic_truth(camera).faces_at(
                capture_ts_lsl)


def test_the_loop_is_rendered_once_and_sized_as_documented() -> None:
    replay = SyntheticReplay.for_camera(_camera(fps=30.0))
    loop = replay.render_loop()
    assert loop.shape == (SyntheticReplay.LOOP_FRAMES, 240, 320, 3)
    assert loop.nbytes == SyntheticReplay.LOOP_FRAMES * 320 * 240 * 3
    # The loop's last frame is the scene at (L - 1) / fps: a new render, not a repeat.
    np.testing.assert_array_equal(loop[-1], replay.scene.render((replay.loop_frames - 1) / 30.0))
    assert not np.array_equal(loop[-1], loop[-2])
    # The note's memory figure for a 1080p camera.
    assert SyntheticReplay.LOOP_FRAMES * 1920 * 1080 * 3 / 1e6 == pytest.approx(187, abs=0.5)


def test_the_loop_goes_back_and_forth_without_a_jump() -> None:
    short = SyntheticReplay(SyntheticScene(160, 120, seed="a"), fps=10.0, loop_frames=5)
    ticks = range(20)
    assert [short.loop_index((tick + 0.5) / 10.0) for tick in ticks] == [
        0, 1, 2, 3, 4, 3, 2, 1, 0, 1, 2, 3, 4, 3, 2, 1, 0, 1, 2, 3]

    # At any capture time (LSL clocks run for days), over several cycles: every next frame is a
    # neighbour of the last one, and every loop frame is shown.
    replay = SyntheticReplay.for_camera(_camera(fps=30.0))
    start_tick = 123_456_789
    indices = [replay.loop_index((start_tick + k + 0.5) / 30.0) for k in range(4 * 58)]
    assert set(np.abs(np.diff(indices))) == {1}
    assert set(indices) == set(range(replay.loop_frames))

    # The faces, too, move no farther from one frame to the next at the turns than anywhere
    # else (a loop played forwards only would jump back by ~25 steps at its end).
    centres = np.array([[face.center_px for face in replay.faces_at((start_tick + k + 0.5) / 30)]
                        for k in range(4 * 58)])
    steps_px = np.linalg.norm(np.diff(centres, axis=0), axis=2).max(axis=1)
    assert steps_px.min() > 0 and steps_px.max() <= 2 * np.median(steps_px), steps_px


def test_the_truth_is_a_pure_function_of_the_capture_time() -> None:
    camera = _camera(fps=25.0)
    replay, again = SyntheticReplay.for_camera(camera), synthetic_truth(camera)
    for capture_ts_lsl in (0.0, 0.039, 1.0, 7.31, 86_400.02, 1_234_567.891):
        tick = math.floor(capture_ts_lsl * 25.0 - replay.phase)  # Note [Capture phases]
        index = tick % (2 * (replay.loop_frames - 1))
        index = index if index < replay.loop_frames else 2 * (replay.loop_frames - 1) - index
        assert replay.loop_index(capture_ts_lsl) == index
        assert replay.scene_time_s(capture_ts_lsl) == index / 25.0
        assert replay.faces_at(capture_ts_lsl) == again.faces_at(capture_ts_lsl)
        assert replay.faces_at(capture_ts_lsl) == replay.scene.faces_at(index / 25.0)
    # Every capture within one of its ticks shows the same frame; the next tick another one.
    tick_s, start_s = 1 / 25.0, replay.phase / 25.0
    assert replay.faces_at(start_s + 100 * tick_s + 0.001) == replay.faces_at(
        start_s + 100 * tick_s + 0.039)
    assert replay.faces_at(start_s + 100 * tick_s + 0.001) != replay.faces_at(
        start_s + 101 * tick_s + 0.001)
    # Other cameras move differently (the scene's seed is the camera id).
    other = SyntheticReplay.for_camera(CameraConfig(id="replay1", source="synthetic-replay",
                                                    width=320, height=240, fps=25.0))
    assert other.faces_at(7.31) != replay.faces_at(7.31)
    with pytest.raises(ValueError, match="at least 2 frames"):
        SyntheticReplay(replay.scene, fps=25.0, loop_frames=1)


def test_captures_are_paced_like_a_camera_half_a_period_into_their_tick() -> None:
    fps = 20.0
    with open_source(_camera(fps=fps)) as source:
        stamps = np.array([source.read()[1] for _ in range(21)])
    assert np.all(np.diff(stamps) > 0)
    assert np.median(np.diff(stamps)) == pytest.approx(1 / fps, abs=0.01)
    # Where in its tick each capture fell (0: at the frame's first instant): half way, so that
    # a wake-up late by up to half a period still shows its own tick's frame. The median is
    # what the schedule aims at; a busy machine's late wake-ups only move single captures.
    ticks = stamps * fps - source.replay.phase
    into_tick = ticks - np.floor(ticks)
    assert 0.4 <= np.median(into_tick) <= 0.75, into_tick


def test_cameras_capture_at_their_own_phase_unless_one_is_configured() -> None:
    """Note [Capture phases]: free-running cameras each at a phase of their own, fixed by the
    id; a configured phase (0 for all: genlocked) replaces it."""
    from facecast.workers.capture.sources import capture_phase

    free = [capture_phase(CameraConfig(id=f"cam{k:02d}", source="synthetic-replay"))
            for k in range(64)]
    assert all(0.0 <= phase < 1.0 for phase in free)
    assert free == [capture_phase(CameraConfig(id=f"cam{k:02d}", source="synthetic-replay"))
                    for k in range(64)]  # the same in every process
    # Spread over the period as free-running cameras' phases are: no tenth of it holds more
    # than a quarter of the cameras (genlocked, one tenth holds them all).
    assert np.histogram(free, bins=10, range=(0, 1))[0].max() <= 16, sorted(free)
    genlocked = CameraConfig(id="cam07", source="synthetic-h264", phase=0.0)
    assert capture_phase(genlocked) == 0.0
    assert SyntheticReplay.for_camera(genlocked).phase == 0.0

    # Two cameras at phases a quarter of a period apart capture a quarter of a period apart.
    fps = 20.0
    stamps = {}
    for camera_id, phase in (("early", 0.0), ("late", 0.25)):
        with open_source(CameraConfig(id=camera_id, source="synthetic-replay", width=160,
                                      height=120, fps=fps, phase=phase)) as source:
            stamps[camera_id] = np.array([source.read()[1] for _ in range(11)])
    # Where each capture falls in the shared clock's period, counted from 0.4 of it: early at
    # 0.1 and late at 0.35 when on time, so that a late wake-up does not wrap round.
    into_period = {camera_id: np.median((ts * fps - 0.4) % 1.0)
                   for camera_id, ts in stamps.items()}
    assert into_period["late"] - into_period["early"] == pytest.approx(0.25, abs=0.1), into_period


def test_a_loop_rendered_while_held_is_the_one_the_source_replays(caplog) -> None:
    """Note [Loops made while held]: rendered ahead, replayed by the camera's source, once."""
    from facecast.workers.capture import sources

    camera = _camera()
    changed = CameraConfig(id="replay0", source="synthetic-replay", width=160, height=120,
                           fps=20.0)  # the same id, reloaded with another size: another loop
    assert sources.make_loops_ahead([camera, changed]) == ["replay0", "replay0"]
    with caplog.at_level("INFO", logger=sources.log.name):
        with open_source(camera) as source:
            frame, capture_ts_lsl = source.read()
            np.testing.assert_array_equal(
                frame, source.replay.scene.render(source.replay.scene_time_s(capture_ts_lsl)))
        with open_source(camera):
            pass
    opened = [r.getMessage() for r in caplog.records if "replays a" in r.getMessage()]
    assert "rendered while its capture worker was held" in opened[0]
    assert "rendered in" in opened[1]  # taken once: the next open renders its own
    assert sources.drop_loops_made_ahead() == 1  # the changed camera's


def test_a_phase_is_refused_where_nothing_captures_on_a_schedule() -> None:
    with pytest.raises(ValueError, match="phase: camera 'cam0' has source '/dev/video0'"):
        CameraConfig(id="cam0", source="/dev/video0", phase=0.5)
    with pytest.raises(ValueError, match="phase"):
        config_mod.loads('[[cameras]]\nid = "cam0"\nsource = "synthetic-replay"\nphase = 1.0\n')
    with pytest.raises(ValueError, match="0 <= phase < 1"):
        SyntheticReplay(SyntheticScene(160, 120, seed="a"), fps=10.0, phase=-0.1)


# --- through the whole daemon ---------------------------------------------------------------------

# Note [Spares only where a test needs them]: no warm spares.
CONFIG = ('[daemon]\ntransport = "shm"\nwarm_standby = "off"\n'
          '[output]\nmax_faces = 2\n[[cameras]]\nid = "replay0"\n'
          'source = "synthetic-replay"\nwidth = 640\nheight = 360\nfps = 15\n')


@pytest.fixture(scope="module")
def daemon(installed_models, tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("replay"), CONFIG) as daemon:
        yield daemon


@pytest.mark.daemon
def test_the_daemon_publishes_the_replayed_faces_where_its_truth_says(daemon):
    daemon.wait_for_faces(["replay0"])  # the recording starts in the steady state
    slots = daemon.resolve("Face", count=2)
    assert len(slots) == 2, daemon.log_tail()
    recorder = Recorder(slots)
    try:
        # Enough frames to cover the loop's turns (30 frames each way at 15 fps: 2 s).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(len(r.timestamps) for r in slots) < 90:
            time.sleep(0.1)
    finally:
        recorder.stop()
    frames, stamps = frames_of(slots)
    assert len(stamps) >= 60, (len(stamps), daemon.log_tail())
    truth = synthetic_truth(config_mod.loads(CONFIG).cameras[0])
    score = score_against_truth(frames, stamps, truth.faces_at)
    print("synthetic-replay through the daemon:", score.describe())
    assert score.good >= 0.95 * len(stamps), score.describe()
    # The frames published reach both ends of the loop (a busy CPU may skip single frames).
    shown = {truth.loop_index(stamp) for stamp in stamps}
    assert min(shown) <= 3 and max(shown) >= truth.loop_frames - 4, sorted(shown)
