"""The output worker's LSL streams, read back by real pylsl inlets on loopback.

tests/conftest.py points $LSLAPICFG at a loopback-only configuration before pylsl loads.
Every test uses its own host name, so its source_ids are unique to it.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid

import numpy as np
import pylsl
import pytest

from facecast.shared.version import __version__
from facecast.workers.output.outlets import (
    BLENDSHAPE_NAMES,
    FACE_LANDMARK_COUNT,
    POSE_LANDMARK_NAMES,
    FaceOutlets,
    FaceSample,
    MarkerOutlet,
    PoseOutlet,
    close_in_parallel,
    encode_event,
)

RESOLVE_TIMEOUT_S = 10.0
# Capture timestamps deliberately far from "now": a sample stamped with its push time fails.
CAPTURE_TS_OFFSET_S = -50.0


def test_lsl_uses_the_loopback_test_config() -> None:
    path = os.environ.get("LSLAPICFG", "")
    assert path and os.path.exists(path), "tests/conftest.py must set LSLAPICFG"


def _unique_host() -> str:
    return f"test{uuid.uuid4().hex[:12]}"


def _resolve(stream_type: str, source_ids: list[str]) -> list[pylsl.StreamInfo]:
    """Resolve by type, keep ours, in the order of `source_ids`."""
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    found: dict[str, pylsl.StreamInfo] = {}
    while time.monotonic() < deadline and len(found) < len(source_ids):
        for info in pylsl.resolve_byprop("type", stream_type, minimum=len(source_ids), timeout=1.0):
            if info.source_id() in source_ids:
                found[info.source_id()] = info
    missing = sorted(set(source_ids) - set(found))
    assert not missing, f"streams of type {stream_type} not resolved: {missing}"
    return [found[source_id] for source_id in source_ids]


def _open_inlet(info: pylsl.StreamInfo) -> pylsl.StreamInlet:
    inlet = pylsl.StreamInlet(info, max_buflen=60, processing_flags=0)
    inlet.open_stream(timeout=RESOLVE_TIMEOUT_S)
    return inlet


def _channels(full_info: pylsl.StreamInfo, *fields: str) -> list[tuple[str, ...]]:
    channel = full_info.desc().child("channels").child("channel")
    result = []
    while not channel.empty():
        result.append(tuple(channel.child_value(field) for field in fields))
        channel = channel.next_sibling()
    return result


def _pull(inlet: pylsl.StreamInlet, count: int) -> tuple[np.ndarray, np.ndarray]:
    samples: list[list[float]] = []
    timestamps: list[float] = []
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    while len(samples) < count and time.monotonic() < deadline:
        chunk, chunk_timestamps = inlet.pull_chunk(timeout=0.2)
        samples.extend(chunk)
        timestamps.extend(chunk_timestamps)
    assert len(samples) == count, f"expected {count} samples, got {len(samples)}"
    return np.asarray(samples, dtype=np.float64), np.asarray(timestamps, dtype=np.float64)


def _face(track_id: int, presence: float = 0.9, offset: float = 0.0, **parts: object) -> FaceSample:
    return FaceSample(
        track_id=track_id,
        presence=presence,
        box_px=(100.0 + offset, 50.0 + offset, 220.0 + offset, 190.5 + offset),
        head_pose_deg=(10.0, -5.0, 2.5),
        head_translation_cm=(1.0, -2.0, 45.0),
        **parts,  # type: ignore[arg-type]
    )


def test_blendshape_names_are_mediapipes_52_in_order() -> None:
    assert len(BLENDSHAPE_NAMES) == 52
    assert len(set(BLENDSHAPE_NAMES)) == 52
    assert BLENDSHAPE_NAMES[0] == "_neutral"
    assert list(BLENDSHAPE_NAMES) == sorted(BLENDSHAPE_NAMES)  # MediaPipe's list is alphabetical
    assert {"eyeBlinkLeft", "jawOpen", "mouthSmileRight", "noseSneerRight"} <= set(BLENDSHAPE_NAMES)
    assert len(POSE_LANDMARK_NAMES) == 33 and len(set(POSE_LANDMARK_NAMES)) == 33


def test_face_streams_metadata_and_samples_round_trip() -> None:
    host = _unique_host()
    blendshape_scores = np.linspace(0.0, 1.0, 52, dtype=np.float32)
    outlets = FaceOutlets(host, "cam0", max_faces=2, fps=30.0, landmarks=False)
    infos = _resolve("Face", outlets.source_ids)
    inlets = [_open_inlet(info) for info in infos]

    for slot, info in enumerate(infos):
        assert info.name() == f"facecast cam0 face{slot}"
        assert info.type() == "Face"
        assert info.source_id() == f"facecast-{host}-cam0-face{slot}"
        # Note [Rates that survive XDF loading]: irregular, the camera's rate in the metadata.
        assert info.nominal_srate() == pylsl.IRREGULAR_RATE
        assert info.channel_format() == pylsl.cf_float32
        assert info.channel_count() == 12 + 52

    full = inlets[1].info(timeout=RESOLVE_TIMEOUT_S)
    assert full.desc().child("facecast").child_value("camera_fps") == "30"
    channels = _channels(full, "label", "unit", "type")
    assert channels[:12] == [
        ("track_id", "none", "TrackId"),
        ("presence", "normalized", "Score"),
        ("box_x1", "pixels", "BoxX1"),
        ("box_y1", "pixels", "BoxY1"),
        ("box_x2", "pixels", "BoxX2"),
        ("box_y2", "pixels", "BoxY2"),
        ("head_yaw", "degrees", "OrientationH"),
        ("head_pitch", "degrees", "OrientationP"),
        ("head_roll", "degrees", "OrientationR"),
        ("head_tx", "centimeters", "PositionX"),
        ("head_ty", "centimeters", "PositionY"),
        ("head_tz", "centimeters", "PositionZ"),
    ]
    assert [label for label, _unit, _type in channels[12:]] == list(BLENDSHAPE_NAMES)
    assert {(unit, kind) for _label, unit, kind in channels[12:]} == {("normalized", "Blendshape")}
    acquisition = full.desc().child("acquisition")
    assert acquisition.child_value("manufacturer") == "facecast"
    assert acquisition.child_value("version") == __version__
    facecast = full.desc().child("facecast")
    assert facecast.child_value("camera") == "cam0"
    assert facecast.child_value("slot") == "1"
    assert facecast.child("blendshapes").child_value("available") == "true"
    assert facecast.child("head_translation").child_value("available") == "true"

    capture_ts_lsl = [pylsl.local_clock() + CAPTURE_TS_OFFSET_S + k / 30.0 for k in range(4)]
    frames = [
        [_face(7, blendshapes=blendshape_scores)],  # track 7 takes slot 0
        [_face(9, presence=0.8, offset=5.0), _face(7, blendshapes=blendshape_scores)],
        [_face(9, presence=0.8, offset=5.0)],  # 7 occluded: slot 0 held for it, NaN
        [],  # nobody
    ]
    published = [outlets.push_frame(ts, faces) for ts, faces in zip(capture_ts_lsl, frames)]
    assert published == [[7, None], [7, 9], [None, 9], [None, None]]

    slot0, slot0_ts = _pull(inlets[0], 4)
    slot1, slot1_ts = _pull(inlets[1], 4)
    # The timestamps read back are the capture timestamps pushed (LSL keeps them as doubles).
    np.testing.assert_allclose(slot0_ts, capture_ts_lsl, rtol=0, atol=1e-9)
    np.testing.assert_allclose(slot1_ts, capture_ts_lsl, rtol=0, atol=1e-9)

    expected_head = [7, np.float32(0.9), 100, 50, 220, 190.5, 10, -5, 2.5, 1, -2, 45]
    np.testing.assert_array_equal(slot0[0, :12], expected_head)
    np.testing.assert_allclose(slot0[0, 12:], blendshape_scores, atol=1e-7)
    assert np.isnan(slot1[0]).all()  # empty slot: NaN in every channel
    np.testing.assert_array_equal(slot1[1, :6], [9, np.float32(0.8), 105, 55, 225, 195.5])
    assert np.isnan(slot1[1, 12:]).all()  # no blendshapes given: NaN
    assert np.isnan(slot0[2]).all() and slot1[2, 0] == 9
    assert np.isnan(slot0[3]).all() and np.isnan(slot1[3]).all()
    outlets.close()


def test_without_the_bundle_its_channels_are_left_out() -> None:
    """Note [No channel that is always NaN]: without face_landmarker.task the blendshape and
    head translation channels are not in the stream at all; the landmarks follow the head pose."""
    host = _unique_host()
    reason = "face_landmarker.task not installed (run `facecast models install`)"
    outlets = FaceOutlets(
        host, "camL", max_faces=1, fps=25.0, landmarks=True, blendshapes_missing_reason=reason
    )
    (info,) = _resolve("Face", outlets.source_ids)
    assert info.channel_count() == 9 + FACE_LANDMARK_COUNT * 3
    inlet = _open_inlet(info)
    full = inlet.info(timeout=RESOLVE_TIMEOUT_S)
    channels = _channels(full, "label", "unit", "type")
    assert channels[8] == ("head_roll", "degrees", "OrientationR")
    assert channels[9] == ("landmark000_x", "pixels", "PositionX")
    assert channels[10] == ("landmark000_y", "pixels", "PositionY")
    assert channels[-1] == ("landmark477_z", "pixels", "PositionZ")
    labels = {label for label, _, _ in channels}
    assert not labels & {"head_tx", "head_ty", "head_tz", *BLENDSHAPE_NAMES}
    for part in ("blendshapes", "head_translation"):
        element = full.desc().child("facecast").child(part)
        assert element.child_value("available") == "false"
        assert element.child_value("channels") == "not published"
        assert element.child_value("reason") == reason

    landmarks_px = np.arange(FACE_LANDMARK_COUNT * 3, dtype=np.float32).reshape(-1, 3) / 4
    capture_ts = pylsl.local_clock() + CAPTURE_TS_OFFSET_S
    # Scores and a translation given anyway have no channel: they do not shift the landmarks.
    outlets.push_frame(
        capture_ts, [_face(3, blendshapes=np.ones(52), landmarks_px=landmarks_px)]
    )
    samples, timestamps = _pull(inlet, 1)
    assert timestamps[0] == pytest.approx(capture_ts, abs=1e-9)
    np.testing.assert_array_equal(samples[0, :9], [3, np.float32(0.9), 100, 50, 220, 190.5, 10, -5, 2.5])
    np.testing.assert_array_equal(samples[0, 9:], landmarks_px.reshape(-1))
    assert np.isfinite(samples[0]).all()
    outlets.close()


def test_every_channel_is_filled_by_a_complete_face() -> None:
    """With the bundle, a face with every part fills every channel, landmarks included."""
    host = _unique_host()
    outlets = FaceOutlets(host, "camF", max_faces=1, fps=25.0, landmarks=True)
    (info,) = _resolve("Face", outlets.source_ids)
    assert info.channel_count() == 12 + 52 + FACE_LANDMARK_COUNT * 3
    inlet = _open_inlet(info)
    landmarks_px = np.ones((FACE_LANDMARK_COUNT, 3), np.float32)
    capture_ts = pylsl.local_clock() + CAPTURE_TS_OFFSET_S
    outlets.push_frame(capture_ts, [_face(5, blendshapes=np.full(52, 0.25), landmarks_px=landmarks_px)])
    samples, _ = _pull(inlet, 1)
    assert np.isfinite(samples[0]).all()
    np.testing.assert_array_equal(samples[0, 9:12], [1, -2, 45])
    np.testing.assert_array_equal(samples[0, 12:64], np.full(52, 0.25, np.float32))
    outlets.close()


def test_slot_assignment_keeps_people_in_their_streams() -> None:
    outlets = FaceOutlets(_unique_host(), "camS", max_faces=2, fps=10.0, landmarks=False)
    t0 = pylsl.local_clock()
    assert outlets.push_frame(t0, [_face(1, 0.5), _face(2, 0.9)]) == [2, 1]  # best score first
    assert outlets.push_frame(t0 + 0.1, [_face(1), _face(2)]) == [2, 1]
    # Track 2 occluded for 0.5 s: its slot stays reserved; newcomer 3 is dropped (no free slot).
    assert outlets.push_frame(t0 + 0.2, [_face(1), _face(3)]) == [None, 1]
    assert outlets.faces_dropped == 1
    assert outlets.push_frame(t0 + 0.6, [_face(2), _face(1)]) == [2, 1]  # 2 is back in slot 0
    # Track 1 leaves for good: after slot_hold_s its slot is free for track 4.
    assert outlets.push_frame(t0 + 1.0, [_face(2)]) == [2, None]
    assert outlets.push_frame(t0 + 2.1, [_face(2), _face(4)]) == [2, 4]
    assert outlets.slot_tracks() == [2, 4]
    outlets.close()


def test_capture_timestamp_is_required() -> None:
    outlets = FaceOutlets(_unique_host(), "camT", max_faces=1, fps=30.0, landmarks=False)
    for bad_ts in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="capture_ts_lsl"):
            outlets.push_frame(bad_ts, [])
    with pytest.raises(ValueError, match="box_px"):
        short_box = FaceSample(
            track_id=1, presence=1.0, box_px=(1.0, 2.0)  # type: ignore[arg-type]
        )
        outlets.push_frame(1.0, [short_box])
    outlets.close()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(max_faces=0), "max_faces"),
        (dict(fps=0.0), "fps"),
        (dict(camera_id=""), "camera_id"),
    ],
)
def test_bad_construction_is_refused(arguments: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = dict(
        host="h", camera_id="c", max_faces=1, fps=30.0, landmarks=False
    )
    kwargs.update(arguments)
    with pytest.raises(ValueError, match=message):
        FaceOutlets(**kwargs)  # type: ignore[arg-type]


def test_pose_stream_follows_xdf_mocap_conventions() -> None:
    host = _unique_host()
    outlet = PoseOutlet(host, "cam0", fps=30.0)
    (info,) = _resolve("MoCap", [f"facecast-{host}-cam0-pose"])
    assert info.name() == "facecast cam0 pose"
    assert info.channel_count() == 33 * 4
    assert info.channel_format() == pylsl.cf_float32
    inlet = _open_inlet(info)
    channels = _channels(inlet.info(timeout=RESOLVE_TIMEOUT_S), "label", "marker", "type", "unit")
    assert channels[:4] == [
        ("nose_x", "nose", "PositionX", "meters"),
        ("nose_y", "nose", "PositionY", "meters"),
        ("nose_z", "nose", "PositionZ", "meters"),
        ("nose_visibility", "nose", "Confidence", "normalized"),
    ]
    assert [marker for _l, marker, _t, _u in channels[::4]] == list(POSE_LANDMARK_NAMES)

    points_m = np.random.default_rng(0).normal(size=(33, 3)).astype(np.float32)
    visibility = np.linspace(0, 1, 33, dtype=np.float32)
    capture_ts = [pylsl.local_clock() + CAPTURE_TS_OFFSET_S + k for k in range(2)]
    outlet.push_frame(capture_ts[0], points_m, visibility)
    outlet.push_frame(capture_ts[1], None)
    samples, timestamps = _pull(inlet, 2)
    np.testing.assert_allclose(timestamps, capture_ts, rtol=0, atol=1e-9)
    per_marker = samples[0].reshape(33, 4)
    np.testing.assert_array_equal(per_marker[:, :3], points_m)
    np.testing.assert_array_equal(per_marker[:, 3], visibility)
    assert np.isnan(samples[1]).all()
    outlet.close()


def test_markers_are_compact_json_with_their_timestamps() -> None:
    host = _unique_host()
    markers = MarkerOutlet(host)
    (info,) = _resolve("Markers", [f"facecast-{host}-markers"])
    assert info.channel_count() == 1
    assert info.channel_format() == pylsl.cf_string
    assert info.nominal_srate() == pylsl.IRREGULAR_RATE
    inlet = _open_inlet(info)

    lost_ts_lsl = pylsl.local_clock() + CAPTURE_TS_OFFSET_S
    sent = [
        markers.event("start", version=__version__),
        markers.event(
            "camera_lost", event_ts_lsl=lost_ts_lsl, camera="cam0", reason="EOF", fps=math.nan
        ),
        markers.event("transport_fallback", camera="cam1", kind="cuda_ipc", to="shm"),
    ]
    assert sent[1] == '{"event":"camera_lost","camera":"cam0","reason":"EOF","fps":null}'
    received = []
    for _ in sent:
        sample, timestamp = inlet.pull_sample(timeout=RESOLVE_TIMEOUT_S)
        assert sample is not None
        received.append((sample[0], timestamp))
    assert [text for text, _ts in received] == sent
    assert received[1][1] == pytest.approx(lost_ts_lsl, abs=1e-9)
    assert json.loads(received[2][0]) == {
        "event": "transport_fallback",
        "camera": "cam1",
        "kind": "cuda_ipc",
        "to": "shm",
    }
    with pytest.raises(ValueError, match="event"):
        markers.event("x", event="y")
    markers.close()


def test_markers_sent_before_a_reader_reach_it_once_it_connects() -> None:
    """Note [Markers wait for a reader]: a restarted output worker's new Markers outlet holds
    its events until an inlet has found it, then sends them in order with their timestamps."""
    host = _unique_host()
    markers = MarkerOutlet(host, hold_s=60.0)
    restart_ts_lsl = pylsl.local_clock() + CAPTURE_TS_OFFSET_S
    sent = [markers.event("worker_restart", event_ts_lsl=restart_ts_lsl, worker="output"),
            markers.event("camera_back", camera="cam0")]
    assert markers.held == 2  # nobody reads the new outlet yet
    (info,) = _resolve("Markers", [f"facecast-{host}-markers"])
    inlet = _open_inlet(info)
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    while markers.held and time.monotonic() < deadline:  # the owner's loop, until a reader
        markers.send_held()
        time.sleep(0.01)
    assert markers.held == 0
    received = [inlet.pull_sample(timeout=RESOLVE_TIMEOUT_S) for _ in sent]
    assert [sample[0] for sample, _ts in received] == sent
    assert received[0][1] == pytest.approx(restart_ts_lsl, abs=1e-9)
    markers.close()


def test_held_markers_wait_for_a_second_reader_that_is_back_soon_after_the_first() -> None:
    """A daemon's Markers stream has two readers or more (the console's, LabRecorder's): once
    the first has found the new outlet, the markers wait `settle_s` for the others."""
    host = _unique_host()
    markers = MarkerOutlet(host, hold_s=60.0, settle_s=30.0)
    sent = markers.event("worker_restart", worker="output")
    (info,) = _resolve("Markers", [f"facecast-{host}-markers"])
    first = _open_inlet(info)
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    while markers.reader_since_monotonic is None and time.monotonic() < deadline:
        markers.send_held()  # the owner's loop
        time.sleep(0.01)
    assert markers.reader_since_monotonic is not None and markers.held == 1  # settling
    second = _open_inlet(info)
    markers.send_held(now_monotonic=markers.reader_since_monotonic + 29.0)
    assert markers.held == 1
    markers.send_held(now_monotonic=markers.reader_since_monotonic + 30.0)
    assert markers.held == 0
    for inlet in (first, second):
        sample, _ts = inlet.pull_sample(timeout=RESOLVE_TIMEOUT_S)
        assert sample == [sent]
    with pytest.raises(ValueError, match="settle_s"):
        MarkerOutlet(_unique_host(), settle_s=-1.0)
    markers.close()


def test_held_markers_go_out_after_the_hold_or_at_close_without_a_reader() -> None:
    unread = MarkerOutlet(_unique_host(), hold_s=60.0)
    unread.event("start")
    unread.send_held(now_monotonic=time.monotonic() + 30.0)
    assert unread.held == 1  # still within the hold, and no reader
    unread.send_held(now_monotonic=time.monotonic() + 61.0)
    assert unread.held == 0
    unread.event("stop")
    assert unread.held == 1
    unread.close()
    assert unread.held == 0
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="hold_s"):
            MarkerOutlet(_unique_host(), hold_s=bad)


def test_event_encoding_handles_numpy_and_odd_values() -> None:
    text = encode_event(
        "worker_restart",
        {
            "worker": "detection",
            "restarts": np.int64(3),
            "uptime_s": np.float32(1.5),
            "x": [1, math.inf],
        },
    )
    assert text == (
        '{"event":"worker_restart","worker":"detection","restarts":3,"uptime_s":1.5,"x":[1,null]}'
    )


def test_output_worker_publishes_the_best_pose_of_each_frame_that_measured_pose() -> None:
    from facecast.shared.transport import messages
    from facecast.workers.output.worker import OutputWorker

    host = _unique_host()
    worker = OutputWorker.__new__(OutputWorker)  # only its pose path: no sockets, no supervisor
    worker.pose_outlets = {"cam0": PoseOutlet(host, "cam0", fps=30.0)}
    (info,) = _resolve("MoCap", [f"facecast-{host}-cam0-pose"])
    inlet = _open_inlet(info)
    rng = np.random.default_rng(2)

    def pose(presence: float) -> messages.PoseResult:
        return messages.PoseResult.from_arrays(
            presence=presence, score=presence, box_px=(0, 0, 10, 10),
            landmarks=rng.uniform(size=(33, 5)), world_landmarks_m=rng.normal(size=(33, 3)))

    weak, strong = pose(0.6), pose(0.95)
    capture_ts = [pylsl.local_clock() + CAPTURE_TS_OFFSET_S + k for k in range(3)]

    def received(k: int, poses) -> messages.FaceResults:  # through the wire, as the worker gets it
        return messages.decode(messages.encode(messages.FaceResults(
            camera_id="cam0", frame_seq=k, capture_ts_lsl=capture_ts[k], faces=[], poses=poses)))

    worker._push_pose(received(0, [weak, strong]))
    worker._push_pose(received(1, None))  # pose not measured on this frame: no sample
    worker._push_pose(received(2, []))  # measured, nobody there: NaN
    samples, timestamps = _pull(inlet, 2)
    np.testing.assert_allclose(timestamps, [capture_ts[0], capture_ts[2]], rtol=0, atol=1e-9)
    per_marker = samples[0].reshape(33, 4)
    np.testing.assert_array_equal(per_marker[:, :3], strong.world_landmarks_array())
    np.testing.assert_array_equal(per_marker[:, 3], strong.landmarks_array()[:, 3])
    assert np.isnan(samples[1]).all()
    broken = messages.FaceResults(camera_id="cam0", frame_seq=3, capture_ts_lsl=capture_ts[2] + 1,
                                  faces=[], poses=[messages.PoseResult(
                                      presence=1.0, score=1.0, box_px=(0, 0, 1, 1),
                                      landmarks=b"", world_landmarks_m=b"")])
    with pytest.raises(ValueError, match="pose"):  # OutputWorker._push counts it as rejected
        worker._push_pose(broken)
    worker.pose_outlets["cam0"].close()


def test_outlets_closed_in_parallel_are_each_closed_once_and_gone_from_the_network() -> None:
    """Note [Closing outlets in parallel]: the output worker's many outlets, closed side by side."""
    host = _unique_host()
    # 12 streams: liblsl gives each outlet ports of the loopback config's PortRange (32), and
    # streams beyond it are not found through KnownPeers (README "Finding many streams").
    owners = [FaceOutlets(host, f"cam{k}", max_faces=2, fps=30.0, landmarks=False)
              for k in range(6)]
    source_ids = [source_id for owner in owners for source_id in owner.source_ids]
    _resolve("Face", source_ids)
    calls: list[int] = []

    def closer(index: int):
        def close() -> None:
            calls.append(index)
            owners[index].close()
        return close

    close_in_parallel([closer(k) for k in range(len(owners))])
    assert sorted(calls) == list(range(len(owners)))
    assert all(not owner._outlets for owner in owners)
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    while True:
        still = [info.source_id() for info in pylsl.resolve_byprop("type", "Face", timeout=1.0)
                 if info.source_id() in source_ids]
        if not still:
            break
        assert time.monotonic() < deadline, f"still on the network after closing: {still}"
