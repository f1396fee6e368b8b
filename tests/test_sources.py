"""Capture sources: the synthetic scene and its ground truth, looping video files, V4L2 requests,
and network streams against real peers on loopback that go away and come back.

Peers (skipped, with the reason, where missing):
- RTSP: GStreamer's RTSP server (gst-rtsp-server through the system Python's PyGObject), see
  tests/rtsp_peer.py. Debian:
  apt-get install -y --no-install-recommends python3-gi gir1.2-gst-rtsp-server-1.0 \
      gstreamer1.0-plugins-base gstreamer1.0-plugins-good
- HTTP: ffmpeg serving multipart JPEG with `-listen 1`. Debian: apt-get install -y ffmpeg
"""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pylsl
import pytest

from rtsp_peer import RtspPeer
from rtsp_peer import free_port as _free_port
from rtsp_peer import stop as _stop

from facecast.shared.config import CameraConfig
from facecast.workers.capture import sources
from facecast.workers.capture.sources import (
    FileSource,
    SourceConfigError,
    SourceLost,
    StreamSource,
    SyntheticScene,
    SyntheticSource,
    ReopenBackoff,
    V4L2Source,
    open_source,
    source_kind,
)

PEER_TIMEOUT_S = 15.0


# --- source kinds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("synthetic", "synthetic"),
        (0, "v4l2"),
        ("2", "v4l2"),
        ("/dev/video4", "v4l2"),
        ("/dev/v4l/by-id/usb-Logitech_C920-video-index0", "v4l2"),
        ("rtsp://user:pw@10.0.0.5:554/stream1", "stream"),
        ("RTSPS://cam/x", "stream"),
        ("http://cam.local/video.mjpg", "stream"),
        ("https://cam.local/video.mjpg", "stream"),
        ("file:///data/lab.mp4", "file"),
        ("recordings/session 1.mkv", "file"),
    ],
)
def test_source_kind(source: str | int, kind: str) -> None:
    assert source_kind(source) == kind


@pytest.mark.parametrize("source", ["ftp://cam/x.mp4", "", -1, True])
def test_impossible_sources_are_config_errors(source: str | int) -> None:
    with pytest.raises(SourceConfigError):
        source_kind(source)
    # ...and opening says so (not SourceLost, which the capture worker would retry).
    camera = CameraConfig(id="bad", source="ftp://cam/x.mp4")
    with pytest.raises(SourceConfigError, match="unsupported URL scheme 'ftp'"):
        open_source(camera)


def test_a_password_in_an_impossible_source_is_masked_in_the_error() -> None:
    with pytest.raises(SourceConfigError) as caught:
        source_kind("ftp://lab:s3cret@cam/x.mp4")
    assert "s3cret" not in str(caught.value) and "ftp://lab:***@cam/x.mp4" in str(caught.value)


# --- synthetic ------------------------------------------------------------------------------------


def test_synthetic_scene_is_a_pure_function_of_time_and_camera() -> None:
    first = SyntheticScene(640, 480, seed="cam0")
    again = SyntheticScene(640, 480, seed="cam0")
    other = SyntheticScene(640, 480, seed="cam1")
    t_s = 12345.678
    frame = first.render(t_s)
    assert frame.shape == (480, 640, 3) and frame.dtype == np.uint8 and frame.flags.c_contiguous
    np.testing.assert_array_equal(frame, again.render(t_s))
    assert first.faces_at(t_s) == again.faces_at(t_s)
    assert first.faces_at(t_s) != other.faces_at(t_s)  # cameras move differently
    assert not np.array_equal(frame, first.render(t_s + 0.5))  # and the faces do move


@pytest.mark.parametrize(("width", "height"), [(1280, 720), (640, 480), (1920, 1080), (320, 240)])
def test_synthetic_ground_truth_stays_in_frame_apart_and_smooth(width: int, height: int) -> None:
    scene = SyntheticScene(width, height, seed="camX")
    fps = 30.0
    previous = None
    for k in range(0, 30 * 20, 3):  # 20 s of scene time, every third frame
        t_s = 1000.0 + k / fps
        faces = scene.faces_at(t_s)
        assert [face.name for face in faces] == ["astronaut", "grace_hopper"]
        for face in faces:
            x1, y1, x2, y2 = face.box_px
            assert 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height, (t_s, face)
            assert x2 - x1 == pytest.approx(y2 - y1, rel=0.01)
            # Big enough for the short-range detector on a letterboxed frame.
            assert face.size_px >= 0.18 * max(width, height) or face.size_px >= 0.35 * height
        left, right = faces
        assert left.box_px[2] < right.box_px[0], "face boxes must not overlap"
        if previous is not None:
            for face, before in zip(faces, previous):
                step_px = math.dist(face.center_px, before.center_px) / 3  # per frame
                assert step_px < 0.01 * max(width, height)
        previous = faces


def _photo_face(name: str, size_px: int) -> np.ndarray:
    photo = sources._photo_bgr(name)
    (box,) = [p.face_box_px for p in sources._PHOTOS if p.name == name]
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    return cv2.resize(photo[y1:y2, x1:x2], (size_px, size_px), interpolation=cv2.INTER_AREA)


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel() - a.mean()
    b = b.astype(np.float64).ravel() - b.mean()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_synthetic_ground_truth_boxes_frame_the_rendered_faces() -> None:
    scene = SyntheticScene(1280, 720, seed="cam0")
    for t_s in (100.0, 101.7, 104.2):
        frame = scene.render(t_s)
        for face in scene.faces_at(t_s):
            size = int(round(face.size_px))
            x1, y1 = (int(round(v)) for v in face.box_px[:2])
            expected = _photo_face(face.name, size)
            on_box = _correlation(frame[y1 : y1 + size, x1 : x1 + size], expected)
            shift = size // 8  # an eighth of a face off
            off_box = _correlation(frame[y1 + shift : y1 + shift + size, x1 : x1 + size], expected)
            assert on_box > 0.95, (t_s, face.name, on_box)
            assert off_box < on_box - 0.05, (t_s, face.name, on_box, off_box)


def test_shipped_face_crops_are_the_photos_and_their_boxes_mediapipes() -> None:
    """workers/capture/synthetic_faces/*.png are exact crops of the public-domain photos, and the
    face box in crop pixels is the box MediaPipe found on the whole photo (the fixtures)."""
    fixtures = Path(__file__).parent / "models" / "fixtures" / "mediapipe_faces.npz"
    if not fixtures.exists():
        pytest.skip(f"{fixtures} is not in this checkout")
    skimage_data = pytest.importorskip("skimage.data")
    cbook = pytest.importorskip("matplotlib.cbook")
    originals = {
        "astronaut": np.ascontiguousarray(skimage_data.astronaut()[..., ::-1]),
        "grace_hopper": cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))),
    }
    with np.load(fixtures) as data:
        for photo in sources._PHOTOS:
            crop = sources._photo_bgr(photo.name)
            original = originals[photo.name]
            scores = cv2.matchTemplate(original, crop, cv2.TM_SQDIFF)
            _, _, (left, top), _ = cv2.minMaxLoc(scores)
            height, width = crop.shape[:2]
            np.testing.assert_array_equal(original[top:top + height, left:left + width], crop)
            x1, y1, x2, y2 = photo.face_box_px
            detected = data[f"{photo.name}/boxes_px"][0]
            np.testing.assert_allclose(detected, (x1 + left, y1 + top, x2 + left, y2 + top),
                                       atol=1e-3)


def test_synthetic_source_paces_in_real_time_and_reports_ground_truth() -> None:
    camera = CameraConfig(id="syn", source="synthetic", width=320, height=240, fps=50.0)
    with open_source(camera) as source:
        assert isinstance(source, SyntheticSource)
        assert (source.granted.width, source.granted.height, source.granted.fps) == (320, 240, 50.0)
        start_s = time.monotonic()
        timestamps = []
        for _ in range(21):
            frame, capture_ts_lsl = source.read()
            assert abs(capture_ts_lsl - pylsl.local_clock()) < 0.1
            timestamps.append(capture_ts_lsl)
        elapsed_s = time.monotonic() - start_s
        assert 0.36 <= elapsed_s < 0.8, elapsed_s  # 20 periods of 20 ms
        assert np.all(np.diff(timestamps) > 0)
        assert np.mean(np.diff(timestamps)) == pytest.approx(0.02, abs=0.004)
        # The last frame is the scene at its capture timestamp.
        np.testing.assert_array_equal(frame, source.scene.render(timestamps[-1]))
        assert source.ground_truth(timestamps[-1]) == SyntheticScene.for_camera(camera).faces_at(
            timestamps[-1]
        )

        # A reader that falls behind is not handed a burst of stale frames: they are skipped.
        time.sleep(0.25)
        source.read()
        assert source.frames_skipped >= 10
        # It goes on at the camera's rate: the first read after the skip may be due at once
        # (where the missed periods ended), the next ones each a period later; a burst of the
        # missed frames would take no time.
        before_s = time.monotonic()
        for _ in range(10):
            source.read()
        assert 0.17 <= time.monotonic() - before_s < 0.5, time.monotonic() - before_s


# --- video files ----------------------------------------------------------------------------------


def _write_numbered_video(path: Path, frames: int, fps: float, size: tuple[int, int]) -> None:
    width, height = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), fps, (width, height))
    assert writer.isOpened(), "OpenCV cannot write MJPG/AVI here"
    for k in range(frames):
        writer.write(np.full((height, width, 3), 20 * k + 10, np.uint8))
    writer.release()


def _frame_number(frame: np.ndarray) -> int:
    return int(round((float(frame.mean()) - 10) / 20))


def test_video_file_loops_at_its_native_fps(tmp_path: Path) -> None:
    path = tmp_path / "numbered.avi"
    _write_numbered_video(path, frames=10, fps=40.0, size=(96, 64))
    camera = CameraConfig(id="file", source=str(path), fps=5.0)  # the file's own rate wins
    with open_source(camera) as source:
        assert isinstance(source, FileSource)
        assert source.granted == sources.Granted(96, 64, 40.0, "MJPG", "FFMPEG")
        start_s = time.monotonic()
        numbers, timestamps = [], []
        for _ in range(25):
            frame, capture_ts_lsl = source.read()
            assert frame.shape == (64, 96, 3)
            numbers.append(_frame_number(frame))
            timestamps.append(capture_ts_lsl)
        elapsed_s = time.monotonic() - start_s
    assert numbers == list(range(10)) * 2 + list(range(5))
    assert source.loops == 2
    assert 0.55 <= elapsed_s < 1.0, elapsed_s  # 24 periods of 25 ms
    assert np.mean(np.diff(timestamps)) == pytest.approx(0.025, abs=0.004)


def test_missing_file_is_a_source_not_found_naming_it(tmp_path: Path) -> None:
    # Note [Sources that can never work]: not found, a kind of lost that the capture worker
    # gives up on at a camera's first open.
    camera = CameraConfig(id="gone", source=str(tmp_path / "nope.mp4"))
    with pytest.raises(sources.SourceNotFound, match="no such video file.*nope.mp4") as caught:
        open_source(camera)
    assert isinstance(caught.value, SourceLost) and caught.value.camera_id == "gone"
    camera = CameraConfig(id="dir", source=str(tmp_path))
    with pytest.raises(sources.SourceNotFound, match="not a regular file"):
        open_source(camera)


def test_a_file_that_is_there_but_unreadable_is_only_lost(tmp_path: Path) -> None:
    path = tmp_path / "not-a-video.mp4"
    path.write_bytes(b"no video here")
    with pytest.raises(SourceLost) as caught:
        open_source(CameraConfig(id="junk", source=str(path)))
    assert not isinstance(caught.value, sources.SourceNotFound)


# --- V4L2 -----------------------------------------------------------------------------------------


def test_v4l2_device_that_does_not_exist_is_not_found_with_the_device_named(
        tmp_path: Path) -> None:
    camera = CameraConfig(id="usb", source="/dev/video-facecast-test-none")
    with pytest.raises(sources.SourceNotFound, match="no V4L2 device.*video-facecast-test-none"):
        open_source(camera)
    with pytest.raises(sources.SourceNotFound, match="/dev/video9999"):
        open_source(CameraConfig(id="usb", source=9999))
    regular = Path(f"/dev/shm/facecast-test-{tmp_path.name}")  # a /dev path, a regular file
    regular.write_bytes(b"")
    try:
        with pytest.raises(sources.SourceNotFound, match="is not a V4L2 device"):
            open_source(CameraConfig(id="usb", source=str(regular)))
    finally:
        regular.unlink()
    # A device node that is there is only lost when it cannot be opened: it may be busy.
    with pytest.raises(SourceLost) as caught:
        open_source(CameraConfig(id="usb", source="/dev/null"))
    assert not isinstance(caught.value, sources.SourceNotFound)


class _FakeV4L2Capture:
    """Stands in for a driver that grants 640x480 MJPG at 15 fps whatever is asked."""

    def __init__(self, device: int | str, api: int) -> None:
        self.device, self.api = device, api
        self.calls: list[tuple[int, float]] = []
        _FakeV4L2Capture.last = self

    def isOpened(self) -> bool:  # noqa: N802 - OpenCV's name
        return True

    def set(self, prop: int, value: float) -> bool:
        self.calls.append((prop, value))
        return True

    def get(self, prop: int) -> float:
        return {
            cv2.CAP_PROP_FRAME_WIDTH: 640.0,
            cv2.CAP_PROP_FRAME_HEIGHT: 480.0,
            cv2.CAP_PROP_FPS: 15.0,
            cv2.CAP_PROP_FOURCC: float(cv2.VideoWriter.fourcc(*"MJPG")),
        }[prop]

    def grab(self) -> bool:
        return True

    def retrieve(self) -> tuple[bool, np.ndarray]:
        return True, np.zeros((480, 640, 3), np.uint8)

    def release(self) -> None:
        pass


def test_v4l2_requests_in_order_and_logs_what_was_granted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sources.cv2, "VideoCapture", _FakeV4L2Capture)
    monkeypatch.setattr(V4L2Source, "_check_device_node", lambda self: None)  # no /dev/video2
    camera = CameraConfig(id="usb0", source="2", width=1280, height=720, fps=30.0, fourcc="MJPG")
    with caplog.at_level(logging.INFO, logger="facecast.workers.capture.sources"):
        source = open_source(camera)
    assert isinstance(source, V4L2Source)
    fake = _FakeV4L2Capture.last
    assert (fake.device, fake.api) == (2, cv2.CAP_V4L2)
    assert [prop for prop, _value in fake.calls] == [
        cv2.CAP_PROP_FOURCC,
        cv2.CAP_PROP_FRAME_WIDTH,
        cv2.CAP_PROP_FRAME_HEIGHT,
        cv2.CAP_PROP_FPS,
    ]
    assert source.granted == sources.Granted(640, 480, 15.0, "MJPG", "V4L2")
    (record,) = [r for r in caplog.records if "granted" in r.getMessage()]
    assert record.levelno == logging.WARNING  # less than was asked for
    assert "640x480 @ 15 fps MJPG" in record.getMessage()
    assert "1280x720 @ 30 fps MJPG" in record.getMessage()
    frame, capture_ts_lsl = source.read()
    assert frame.shape == (480, 640, 3) and capture_ts_lsl > 0


# --- backoff --------------------------------------------------------------------------------------


def test_reopen_backoff_grows_caps_resets_and_never_sleeps() -> None:
    backoff = ReopenBackoff(first_delay_s=1.0, max_delay_s=4.0, jitter_fraction=0.0)
    assert backoff.wait_s() == 0.0  # a first open is never delayed
    delays = [backoff.failed() for _ in range(5)]
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.failures == 5
    assert 3.0 < backoff.wait_s() <= 4.0  # due a capped delay after the last failure
    backoff.succeeded()
    assert (backoff.wait_s(), backoff.failures) == (0.0, 0)
    assert backoff.failed() == 1.0  # a new loss starts over

    jittered = ReopenBackoff(first_delay_s=1.0, max_delay_s=1.0, jitter_fraction=0.1)
    spread = [jittered.failed() for _ in range(200)]
    assert all(0.9 <= delay_s <= 1.1 for delay_s in spread)
    assert max(spread) - min(spread) > 0.05  # cameras lost together do not retry in lockstep


@pytest.mark.parametrize("arguments", [
    dict(first_delay_s=0.0), dict(first_delay_s=5.0, max_delay_s=1.0), dict(factor=0.5),
    dict(jitter_fraction=1.0),
])
def test_reopen_backoff_refuses_settings_that_would_spin_or_shrink(arguments: dict) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        ReopenBackoff(**arguments)


def _reopen(open_fn, backoff: ReopenBackoff, on_failure=None) -> sources.FrameSource:
    """The capture worker's reconnect loop (workers/capture/worker.py), without its control
    socket."""
    while True:
        time.sleep(backoff.wait_s())
        try:
            source = open_fn()
        except SourceLost as error:
            backoff.failed()
            if on_failure is not None:
                on_failure(backoff.failures, error)
            continue
        backoff.succeeded()
        return source


# --- network peers --------------------------------------------------------------------------------


def _read_until_lost(source: sources.FrameSource, timeout_s: float) -> SourceLost:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            source.read()
        except SourceLost as lost:
            return lost
    raise AssertionError(f"the source kept delivering {timeout_s} s after its peer was killed")


def _check_live_frames(
    source: sources.FrameSource, count: int, shape: tuple[int, int, int]
) -> None:
    previous_ts = 0.0
    for _ in range(count):
        frame, capture_ts_lsl = source.read()
        assert frame.shape == shape and frame.dtype == np.uint8
        assert previous_ts < capture_ts_lsl <= pylsl.local_clock()
        previous_ts = capture_ts_lsl


@pytest.fixture
def rtsp_peer(gst_python: str) -> Iterator[RtspPeer]:
    peer = RtspPeer(gst_python)
    try:
        yield peer
    finally:
        peer.kill()


def test_rtsp_peer_goes_away_and_comes_back(rtsp_peer: RtspPeer) -> None:
    camera = CameraConfig(id="rtsp", source=rtsp_peer.url, fps=25.0)

    # Not there yet: a lost source that says where it looked.
    with pytest.raises(SourceLost, match=f"127.0.0.1:{rtsp_peer.port}/cam"):
        open_source(camera, open_timeout_s=5.0, read_timeout_s=3.0)

    rtsp_peer.start()
    source = open_source(camera, open_timeout_s=PEER_TIMEOUT_S, read_timeout_s=3.0)
    assert isinstance(source, StreamSource)
    assert (source.granted.width, source.granted.height) == (320, 240)
    _check_live_frames(source, 10, (240, 320, 3))

    rtsp_peer.kill()
    lost = _read_until_lost(source, timeout_s=PEER_TIMEOUT_S)
    assert rtsp_peer.url in lost.reason
    source.close()

    # The capture worker's loop: retry with backoff; the peer comes back after the first failure.
    failures: list[str] = []

    def peer_returns(attempt: int, error: SourceLost) -> None:
        failures.append(error.reason)
        if attempt == 1:
            rtsp_peer.start()

    reopened = _reopen(
        lambda: open_source(camera, open_timeout_s=PEER_TIMEOUT_S, read_timeout_s=3.0),
        ReopenBackoff(first_delay_s=0.2),
        on_failure=peer_returns,
    )
    assert reopened is not None and len(failures) == 1
    with reopened:
        _check_live_frames(reopened, 10, (240, 320, 3))


@pytest.fixture(scope="module")
def ffmpeg() -> str:
    path = shutil.which("ffmpeg")
    if path is None:
        pytest.skip("no HTTP peer: ffmpeg is not installed (Debian: apt-get install -y ffmpeg)")
    return path


def test_http_mjpeg_peer_goes_away_and_comes_back(ffmpeg: str, tmp_path: Path) -> None:
    video = tmp_path / "numbered.avi"
    _write_numbered_video(video, frames=10, fps=25.0, size=(160, 120))
    port = _free_port()
    url = f"http://127.0.0.1:{port}/cam.mjpg"
    command = [
        ffmpeg, "-hide_banner", "-loglevel", "error", "-re", "-stream_loop", "-1", "-i", str(video),
        "-c:v", "mjpeg", "-f", "mpjpeg", "-listen", "1", url,
    ]  # fmt: skip
    camera = CameraConfig(id="http", source=url)

    # Until ffmpeg listens, opening fails at once (connection refused) and is retried.
    peer = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        source = _reopen(
            lambda: open_source(camera, open_timeout_s=5.0, read_timeout_s=3.0),
            ReopenBackoff(first_delay_s=0.1, max_delay_s=0.5),
        )
        assert isinstance(source, StreamSource)
        _check_live_frames(source, 10, (120, 160, 3))

        peer.kill()
        peer.wait(timeout=10)
        lost = _read_until_lost(source, timeout_s=PEER_TIMEOUT_S)
        assert f"127.0.0.1:{port}" in lost.reason
        source.close()

        peer = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        reopened = _reopen(
            lambda: open_source(camera, open_timeout_s=5.0, read_timeout_s=3.0),
            ReopenBackoff(first_delay_s=0.1, max_delay_s=0.5),
        )
        assert reopened is not None
        with reopened:
            _check_live_frames(reopened, 10, (120, 160, 3))
    finally:
        _stop(peer)
