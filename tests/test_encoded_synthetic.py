"""The encoded synthetic cameras (`source = "synthetic-h264"` / `"synthetic-mjpeg"`, Note
[Encoded synthetic loop]): the replayed loop encoded once with PyAV and
decoded by the file source's CPU decoder, its frames the loop frames its truth names (by PSNR
against the renders), the file made once per open and gone at close, the errors for what is not
allowed, and two such cameras through the whole daemon with their faces where the truth says."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from daemon_harness import Recorder, frames_of, ready_daemon, score_against_truth
from facecast.shared import config as config_mod
from facecast.shared.camera_sources import SYNTHETIC_SOURCES
from facecast.shared.config import CameraConfig
from facecast.workers.capture import sources
from facecast.workers.capture.sources import (
    EncodedSyntheticLoop,
    EncodedSyntheticSource,
    SourceConfigError,
    SyntheticReplay,
    SyntheticScene,
    open_source,
    source_kind,
    synthetic_truth,
)

# The decoded frames against the renders: 4:2:0 colour alone costs ~38-41 dB (the Note); a
# neighbouring loop frame is ~28 dB away, so the bound also tells the right frame from its
# neighbours.
MIN_PSNR_DB = 34.0
CODECS = ("synthetic-h264", "synthetic-mjpeg")


def _camera(source: str, fps: float = 20.0, width: int = 320, height: int = 240) -> CameraConfig:
    return CameraConfig(id="enc0", source=source, width=width, height=height, fps=fps)


def _psnr_db(frame: np.ndarray, reference: np.ndarray) -> float:
    mse = np.mean((frame.astype(np.float64) - reference) ** 2)
    return 10 * math.log10(255.0**2 / mse) if mse else math.inf


def _facecast_memfds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:facecast-synthetic-"):
            found.append(target)
    return found


def test_the_encoded_sources_are_accepted_and_share_the_replays_truth() -> None:
    for source in CODECS:
        assert source in SYNTHETIC_SOURCES and source_kind(source) == source
        loaded = config_mod.loads(f'[[cameras]]\nid = "cam0"\nsource = "{source}"\n')
        truth = synthetic_truth(loaded.cameras[0])
        assert isinstance(truth, SyntheticReplay)
        replay_alike = synthetic_truth(CameraConfig(id="cam0", source="synthetic-replay"))
        assert truth.faces_at(1234.567) == replay_alike.faces_at(1234.567)


@pytest.mark.parametrize("source", ["synthetic-h265", "synthetic-H264", "synthetic_mjpeg",
                                    "Synthetic"])
def test_an_unknown_synthetic_source_is_a_config_error_naming_the_allowed(source: str) -> None:
    with pytest.raises(SourceConfigError, match="unknown synthetic source") as caught:
        source_kind(source)
    assert "'synthetic-h264', 'synthetic-mjpeg'" in str(caught.value)
    with pytest.raises(SourceConfigError):  # not SourceLost: the capture worker won't retry
        open_source(_camera(source))
    # A video file of such a name is still one, written as a path.
    assert source_kind(f"./{source}") == "file"


def test_an_odd_size_is_a_config_error() -> None:
    with pytest.raises(SourceConfigError, match="even width and height, got 321x240"):
        open_source(_camera("synthetic-h264", width=321))
    assert not _facecast_memfds()  # nothing left behind by the failed open


def test_a_staged_script_that_fits_the_loop_is_taken() -> None:
    """(One that does not fit: tests/test_staged_scene.py.)"""
    text = ('[[cameras]]\nid = "stg0"\nsource = "synthetic-h264"\n[cameras.staging]\n'
            'cycle_s = 1.0\n')
    assert config_mod.loads(text).cameras[0].staging.cycle_s == 1.0


def test_a_staged_replay_shows_what_its_script_says() -> None:
    """Staging on a replayed loop: the loop frame of a capture time shows the script at that
    frame's scene time (the truth and the pixels alike); the bench's newcomers use it."""
    staging = msgspec.convert({"cycle_s": 1.0, "appearances": [
        {"photo": "astronaut", "seat": 0, "from_s": 0.5, "until_s": 1.0}]},
        config_mod.StagingConfig)
    camera = CameraConfig(id="stg0", source="synthetic-replay", width=320, height=240, fps=20.0,
                          staging=staging)
    truth = synthetic_truth(camera)
    loop = truth.render_loop()
    empty = SyntheticScene(camera.width, camera.height, seed=camera.id,
                           staging=config_mod.StagingConfig(cycle_s=1.0)).render(0.0)
    fps = camera.fps
    for tick in range(truth.cycle_frames):
        capture_ts = (tick + 0.5) / fps
        index = truth.loop_index(capture_ts)
        names = [face.name for face in truth.faces_at(capture_ts)]
        assert names == (["astronaut"] if (index / fps) % 1.0 >= 0.5 else []), (tick, index)
        assert (np.abs(loop[index].astype(int) - empty.astype(int)).max() > 40) == bool(names)


@pytest.mark.parametrize("source", CODECS)
def test_decoded_frames_are_the_loop_frames_their_truth_names(source: str) -> None:
    camera = _camera(source)
    truth = synthetic_truth(camera)
    loop = truth.render_loop()
    with open_source(camera) as opened:
        assert isinstance(opened, EncodedSyntheticSource) and opened.kind == source
        granted = opened.granted
        assert (granted.width, granted.height, granted.fps) == (320, 240, 20.0)
        assert (granted.backend, granted.fourcc) == (
            "FFMPEG", "h264" if source == "synthetic-h264" else "MJPG")
        # Read at the camera's pace, compared afterwards: a reader that falls behind skips
        # frames (on a loaded machine, the comparisons in the loop made it skip the loop's last
        # frame both times round, 2026-11-28). Past the file's end (58 frames at 20 fps: 2.9 s),
        # so that the decoder starts it again, and until the loop's first and last frames have
        # both been shown (at most four times round the file).
        edges = {0, truth.loop_frames - 1}
        read: list[tuple[np.ndarray, float]] = []
        while len(read) < opened.encoded.frame_count + 12 or not edges <= {
                truth.loop_index(ts) for _, ts in read}:
            assert len(read) < 4 * opened.encoded.frame_count, "the loop's first or last frame never showed"
            frame, capture_ts_lsl = opened.read()
            read.append((frame.copy(), capture_ts_lsl))
        assert opened.loops >= 1, "the file was not started again after its last frame"
        # A late reader skips frames but the decoder decodes them all, as a stream makes it.
        assert opened.frames_decoded >= opened.frames_read
    for frame, capture_ts_lsl in read:
        assert frame.shape == (240, 320, 3) and frame.dtype == np.uint8
        index = truth.loop_index(capture_ts_lsl)
        psnr_db = [_psnr_db(frame, reference) for reference in loop]
        assert psnr_db[index] >= MIN_PSNR_DB, (index, psnr_db[index])
        assert int(np.argmax(psnr_db)) == index, (index, np.round(psnr_db, 1))
        assert opened.ground_truth(capture_ts_lsl) == truth.faces_at(capture_ts_lsl)


@pytest.mark.parametrize("source", CODECS)
def test_a_frame_decoded_into_given_memory_is_the_frame_read(source: str) -> None:
    """Note [Staged writes]: `read_into` decodes into the ring's staging view (the array it is
    given) and hands that array back; a view of another size gets a new array, the frame as
    `read` gives it."""
    camera = _camera(source)
    truth = synthetic_truth(camera)
    loop = truth.render_loop()
    with open_source(camera) as opened:
        assert opened.decodes_into
        staging = np.zeros((240, 320, 3), np.uint8)
        for _ in range(5):
            frame, capture_ts_lsl = opened.read_into(staging)
            assert frame is staging
            psnr_db = [_psnr_db(frame, reference) for reference in loop]
            assert int(np.argmax(psnr_db)) == truth.loop_index(capture_ts_lsl)
        wrong_size = np.zeros((120, 160, 3), np.uint8)
        frame, capture_ts_lsl = opened.read_into(wrong_size)
        assert frame is not wrong_size and frame.shape == (240, 320, 3)
        assert not wrong_size.any()
        psnr_db = [_psnr_db(frame, reference) for reference in loop]
        assert int(np.argmax(psnr_db)) == truth.loop_index(capture_ts_lsl)


def test_a_late_reader_gets_the_frame_of_its_capture_time() -> None:
    camera = _camera("synthetic-h264")
    truth = synthetic_truth(camera)
    loop = truth.render_loop()
    with open_source(camera) as opened:
        opened.read()
        time.sleep(0.33)  # 6-7 frames late
        frame, capture_ts_lsl = opened.read()
        assert opened.frames_skipped >= 5
        psnr_db = [_psnr_db(frame, reference) for reference in loop]
        assert int(np.argmax(psnr_db)) == truth.loop_index(capture_ts_lsl)


@pytest.fixture
def encodes(monkeypatch) -> list[str]:
    """The codec of every loop encoded while the test runs, in order."""
    encoded: list[str] = []
    original = EncodedSyntheticLoop._encode

    def counting(self) -> None:
        encoded.append(self.codec)
        original(self)

    monkeypatch.setattr(EncodedSyntheticLoop, "_encode", counting)
    return encoded


def test_the_file_is_made_once_per_open_private_and_gone_at_close(encodes) -> None:
    before = _facecast_memfds()
    with open_source(_camera("synthetic-mjpeg", fps=40.0, width=160, height=120)) as opened:
        path = opened.encoded.path
        assert path.parent == Path(f"/proc/{os.getpid()}/fd")
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.readlink(path).startswith("/memfd:facecast-synthetic-mjpeg-enc0")
        # Ours, and the decoder's own open of it.
        assert len(_facecast_memfds()) > len(before)
        assert opened.encoded.nbytes > 0
        for _ in range(opened.encoded.frame_count + 5):  # through the file's end and again
            opened.read()
        assert opened.loops >= 1
    assert encodes == ["mjpeg"]  # once at open, not at each start of the file
    assert _facecast_memfds() == before  # freed at close


def test_a_loop_encoded_while_held_is_the_one_the_source_decodes(encodes) -> None:
    """Note [Loops made while held]: encoded once, ahead, and taken by the camera's source; a
    loop that no source took is freed; one that cannot be made ahead fails at open as before."""
    before = _facecast_memfds()
    camera = _camera("synthetic-h264", fps=40.0, width=160, height=120)
    not_opened = CameraConfig(id="enc1", source="synthetic-mjpeg", width=160, height=120)
    odd = CameraConfig(id="odd", source="synthetic-h264", width=161, height=120)
    cameras = [camera, not_opened, odd, CameraConfig(id="usb", source="/dev/video0")]
    assert sorted(sources.make_loops_ahead(cameras)) == ["enc0", "enc1"]
    assert sorted(encodes) == ["h264", "mjpeg"] and len(_facecast_memfds()) == len(before) + 2
    with open_source(camera) as opened:
        assert len(encodes) == 2  # the loop made ahead, not a new one
        truth = synthetic_truth(camera)
        frame, capture_ts = opened.read()
        assert _psnr_db(frame, truth.scene.render(truth.scene_time_s(capture_ts))) >= 30.0
        # The same camera again (a reopen) encodes its own: the one made ahead is taken.
        with open_source(camera) as again:
            assert len(encodes) == 3 and again.encoded is not opened.encoded
    assert sources.drop_loops_made_ahead() == 1  # enc1's, which nothing opened
    assert sources.drop_loops_made_ahead() == 0
    assert _facecast_memfds() == before  # every loop's file freed
    with pytest.raises(SourceConfigError, match="even width and height"):
        open_source(odd)


def test_a_file_that_ends_early_is_a_lost_source() -> None:
    with open_source(_camera("synthetic-h264", fps=50.0, width=160, height=120)) as opened:
        opened.encoded.frame_count += 3  # the file has 3 frames fewer than the source expects
        with pytest.raises(sources.SourceLost, match="ended after 58 of its 61 frames"):
            for _ in range(opened.encoded.frame_count + 2):
                opened.read()


# --- through the whole daemon ---------------------------------------------------------------------

CAMERAS = ("h264cam", "mjpegcam")
# Note [Spares only where a test needs them]: no warm spares.
CONFIG = ('[daemon]\ntransport = "shm"\nwarm_standby = "off"\n'
          '[output]\nmax_faces = 2\n'
          '[[cameras]]\nid = "h264cam"\nsource = "synthetic-h264"\nwidth = 640\nheight = 360\n'
          'fps = 15\n'
          '[[cameras]]\nid = "mjpegcam"\nsource = "synthetic-mjpeg"\nwidth = 640\nheight = 360\n'
          'fps = 15\n')


@pytest.fixture(scope="module")
def daemon(installed_models, tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("encoded"), CONFIG) as daemon:
        yield daemon


@pytest.mark.daemon
def test_the_daemon_publishes_the_decoded_faces_where_the_truth_says(daemon):
    parsed = config_mod.loads(CONFIG)
    daemon.wait_for_faces(CAMERAS)  # the recording starts in the steady state
    records = daemon.resolve("Face", count=4)
    by_camera = {camera: [r for r in records if f"-{camera}-face" in r.source_id]
                 for camera in CAMERAS}
    assert all(len(slots) == 2 for slots in by_camera.values()), (
        [r.source_id for r in records], daemon.log_tail())
    recorder = Recorder(records)
    try:
        # 3 s of each camera at 15 fps: the loop's turn at both ends.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and min(len(r.timestamps) for r in records) < 45:
            time.sleep(0.1)
    finally:
        recorder.stop()
    for camera, slots in by_camera.items():
        frames, stamps = frames_of(slots)
        assert len(stamps) >= 30, (camera, len(stamps), daemon.log_tail())
        truth = synthetic_truth(parsed.camera(camera))
        score = score_against_truth(frames, stamps, truth.faces_at)
        print(f"{camera} ({parsed.camera(camera).source}) through the daemon:", score.describe())
        assert score.good >= 0.9 * len(stamps), (camera, score.describe())
