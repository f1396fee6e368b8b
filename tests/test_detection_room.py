"""Note [Detection while the device has room], the detection worker's own loop: with room, every
camera's frames are searched about every other frame, also where the cameras publish their frames
a millisecond apart, as a daemon's cameras do (issue 24 item 5: at 8 cameras on the H100 a
newcomer was published p50 4 frames, at most 14, after their first frame); while the measuring
is behind (MeasuringBehind, from the roi_landmark workers), only the interval's passes; a camera
whose tracks fill max_faces (TracksFull) is not searched for newcomers at all, only when asked
(Note [No search where no face could go]).

No daemon: `DetectionWorker.step` runs against a frame bus, a detector and a clock played by the
test. The bus behaves as FrameSubscriber.receive does: a poll until the first frame comes, then
the newest frame of each camera that has arrived, taken off the bus, read only where `wanted`
says so (the others are passed over)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from facecast.shared.stats import StageTimer
from facecast.shared.transport.messages import MessageGate
from facecast.workers.inference import detection
from facecast.workers.inference.detection import MAX_BUS_WAIT_S, DetectionWorker

FRAME_PERIOD_S = 1 / 30
PASS_S = 0.008  # a pass over any number of cameras, on the played clock
CAMERAS = ("cam00", "cam01", "cam02", "cam03")
PUBLISH_OFFSET_S = 0.001  # camera k publishes its frame k ms into each tick


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s


@dataclass
class _Message:
    camera_id: str
    frame_seq: int
    ring_epoch: int = 1

    @property
    def capture_ts_lsl(self) -> float:
        return self.frame_seq * FRAME_PERIOD_S


@dataclass
class _Frame:
    message: _Message
    tensor: torch.Tensor


class Bus:
    """The cameras' frames as FrameSubscriber.receive hands them out (module docstring)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.taken_up_to: dict[str, int] = {camera_id: -1 for camera_id in CAMERAS}
        self.reads_s: list[float] = []  # when frames were taken off the bus

    @staticmethod
    def published_s(camera_index: int, frame_seq: int) -> float:
        return frame_seq * FRAME_PERIOD_S + camera_index * PUBLISH_OFFSET_S

    def _arrived(self) -> dict[str, int]:
        """Per camera, the newest frame on the bus that was not taken yet."""
        arrived = {}
        for index, camera_id in enumerate(CAMERAS):
            newest = math.floor((self.clock.now_s - index * PUBLISH_OFFSET_S) / FRAME_PERIOD_S
                                + 1e-9)
            if newest > self.taken_up_to[camera_id]:
                arrived[camera_id] = newest
        return arrived

    def receive(self, timeout_ms: int = 100, wanted=None) -> list[_Frame]:
        self.reads_s.append(self.clock.now_s)
        arrived = self._arrived()
        if not arrived:  # the poll: until the next frame is published, or the timeout
            next_s = min(self.published_s(index, self.taken_up_to[camera_id] + 1)
                         for index, camera_id in enumerate(CAMERAS))
            self.clock.now_s = min(next_s, self.clock.now_s + timeout_ms / 1e3)
            arrived = self._arrived()
        frames = []
        for camera_id, frame_seq in arrived.items():
            self.taken_up_to[camera_id] = frame_seq
            if wanted is None or wanted(camera_id):
                frames.append(_Frame(_Message(camera_id, frame_seq), torch.zeros(4, 4, 3)))
        return frames


class Requests:
    """The roi_landmark workers' requests: none (a poll only lets the clock run), or the
    messages of `sent` (encoded, each at its time on the played clock)."""

    def __init__(self, clock: Clock, sent: list[tuple[float, bytes]] = ()) -> None:
        self.clock = clock
        self.sent = sorted(sent)

    def poll(self, timeout_ms: int = 0) -> int:
        if self.sent and self.sent[0][0] <= self.clock.now_s:
            return 1
        self.clock.now_s += timeout_ms / 1e3
        return 0

    def recv(self) -> bytes:
        return self.sent.pop(0)[1]


class Detector:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def batch_in_place(self, frames):  # the frames themselves stand for their batch
        return frames

    def detect(self, frames):
        self.clock.now_s += PASS_S
        return [(torch.zeros(0, 4), torch.zeros(0, 6, 2), torch.zeros(0)) for _ in frames]


class Published:
    def __init__(self) -> None:
        self.frames: dict[str, set[int]] = {camera_id: set() for camera_id in CAMERAS}

    def send_multipart(self, parts) -> None:
        found = detection.messages.decode(parts[1])
        self.frames[found.camera_id].add(found.frame_seq)


def _worker(clock: Clock, share: float, interval_s: float = 0.5
            ) -> tuple[DetectionWorker, Published]:
    """A booted DetectionWorker's state, with the test's bus, detector and sockets."""
    worker = DetectionWorker.__new__(DetectionWorker)
    worker.config = SimpleNamespace(daemon=SimpleNamespace(detect_interval_s=interval_s))
    worker.camera_ids = list(CAMERAS)
    worker.torch_device = torch.device("cpu")
    worker.pipeline = Detector(clock)
    worker.timer = StageTimer()
    worker.rates, worker.faces = {}, {}
    worker._last_pass_monotonic = {}
    worker._wanted = set()
    worker._full = set()
    worker.detection_share = share
    worker._room_from_monotonic = float("-inf")
    worker._behind_said_monotonic = float("-inf")
    worker._bus_read_monotonic = float("-inf")
    worker._requests_gate = MessageGate("detection requests")
    worker.requests = Requests(clock)
    worker.subscriber = Bus(clock)
    worker.detections = Published()
    return worker, worker.detections


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_with_room_every_camera_is_searched_about_every_other_frame(monkeypatch, share):
    """Passes of 8 ms in 33 ms frames have room at share 0.5 and 0.25 for a pass over every
    camera every frame or two. Before, the frames that came while the device had no room were
    taken off the bus and passed over: a pass over the first camera of a tick left the three
    others, a millisecond behind it, to the `detect_interval_s` passes (2 of 30 frames)."""
    clock = Clock()
    monkeypatch.setattr(detection, "time", SimpleNamespace(monotonic=clock.monotonic))
    worker, published = _worker(clock, share)
    while clock.now_s < 1.0:
        worker.step()
    frames = int(1.0 / FRAME_PERIOD_S)
    for camera_id, searched in published.frames.items():
        longest_gap = max(b - a for a, b in zip(sorted(searched), sorted(searched)[1:]))
        assert len(searched) >= frames / 2 and longest_gap <= 2, (camera_id, sorted(searched))


def _slow_passes(worker: DetectionWorker, clock: Clock, pass_s: float) -> None:
    def detect(frames):
        clock.now_s += pass_s
        return [(torch.zeros(0, 4), torch.zeros(0, 6, 2), torch.zeros(0)) for _ in frames]
    worker.pipeline.detect = detect


def test_without_room_a_camera_is_still_searched_every_interval(monkeypatch):
    """At the CPU's share (0.1) a pass may start 9 passes' time after the last one ended: the
    interval's passes (`detect_interval_s`) go on regardless, for every camera."""
    clock = Clock()
    monkeypatch.setattr(detection, "time", SimpleNamespace(monotonic=clock.monotonic))
    worker, published = _worker(clock, 0.1)
    _slow_passes(worker, clock, 0.1)  # room 0.9 s after each pass
    while clock.now_s < 3.0:
        worker.step()
    for camera_id, searched in published.frames.items():
        times = sorted(frame_seq * FRAME_PERIOD_S for frame_seq in searched)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert len(times) >= 5 and max(gaps) <= 0.5 + 0.1 + 2 * FRAME_PERIOD_S, (camera_id, times)


def test_frames_wait_on_the_bus_for_room_at_most_max_bus_wait_s(monkeypatch):
    """Room 0.9 s after each pass and no interval to end the wait: the frames are still taken
    off the bus every MAX_BUS_WAIT_S (and passed over), since a full queue drops the newest."""
    clock = Clock()
    monkeypatch.setattr(detection, "time", SimpleNamespace(monotonic=clock.monotonic))
    worker, _ = _worker(clock, 0.1, interval_s=60.0)
    _slow_passes(worker, clock, 0.1)
    while clock.now_s < 3.0:
        worker.step()
    reads_s = worker.subscriber.reads_s
    # A pass (100 ms) and one poll of the wait (50 ms) beyond the limit at most.
    assert max(b - a for a, b in zip(reads_s, reads_s[1:])) <= MAX_BUS_WAIT_S + 0.1 + 0.05 + 1e-9


def test_while_the_measuring_is_behind_newcomers_wait_for_the_interval(monkeypatch):
    """The roi_landmark workers say they passed over frames from 1.0 to 2.0 s: from then until
    ROOM_AFTER_BEHIND_S after the last time they said it, a camera is searched only on the
    interval's passes (every 0.5 s), before and after about every other frame."""
    clock = Clock()
    monkeypatch.setattr(detection, "time", SimpleNamespace(monotonic=clock.monotonic))
    worker, published = _worker(clock, 0.5)
    behind = detection.messages.encode(detection.MeasuringBehind(skipped=3))
    worker.requests = Requests(clock, [(1.0 + 0.1 * k, behind) for k in range(11)])
    while clock.now_s < 4.5:
        worker.step()
    no_room_s = (1.0 + FRAME_PERIOD_S, 2.0 + detection.ROOM_AFTER_BEHIND_S)
    for camera_id, searched in published.frames.items():
        times = sorted(frame_seq * FRAME_PERIOD_S for frame_seq in searched)
        before = [t for t in times if t < 1.0]
        during = [t for t in times if no_room_s[0] <= t < no_room_s[1]]
        after = [t for t in times if t >= no_room_s[1] + 2 * FRAME_PERIOD_S]
        assert len(before) >= 14 and len(after) >= 14, (camera_id, times)
        # 2 s without room: the interval's passes, 4 or 5 of them.
        assert 3 <= len(during) <= 5, (camera_id, during)
        assert max(b - a for a, b in zip(during, during[1:])) <= 0.5 + 3 * FRAME_PERIOD_S


def test_a_roi_landmark_worker_says_it_is_behind_when_it_passed_over_frames(monkeypatch):
    """Over each BEHIND_WINDOW_S: more than BEHIND_SHARE of the frames passed over (its
    subscriber's "skipped" counts) is said, once, with their number; fewer is not; a new
    subscriber (cameras reassigned) counts from where it starts."""
    from facecast.workers.inference import roi_landmark

    clock = Clock()
    monkeypatch.setattr(roi_landmark, "time", SimpleNamespace(monotonic=clock.monotonic))

    class Sent:
        def __init__(self) -> None:
            self.messages = []

        def send(self, payload, flags=0) -> None:
            message = detection.messages.decode(payload)
            self.messages.append((type(message).__name__, message.skipped))

    def batches(seconds: float, skipped_per_s: int, start: int = 0) -> int:
        """Batches of 4 frames every 1/30 s; returns the subscriber's count at the end."""
        count = start
        for k in range(round(seconds * 30)):
            clock.now_s += FRAME_PERIOD_S
            count = start + round((k + 1) * FRAME_PERIOD_S * skipped_per_s)
            worker.subscriber = SimpleNamespace(status={
                "cam0": SimpleNamespace(counts={"skipped": count})})
            worker._say_if_behind(4)
        return count

    worker = roi_landmark.RoiLandmarkWorker.__new__(roi_landmark.RoiLandmarkWorker)
    worker.requests = Sent()
    worker._behind_window = roi_landmark._Window(clock.now_s)
    count = batches(2.5, skipped_per_s=1)  # 1 in ~121 frames: 0.8 %, not behind
    assert worker.requests.messages == []
    batches(2.5, skipped_per_s=12, start=count)  # 12 in 132: behind
    said = worker.requests.messages  # a window a second: the first may straddle the change
    assert len(said) >= 2 and 11 <= said[-1][1] <= 13, said
    batches(1.1, skipped_per_s=0, start=0)  # a fresh subscriber, keeping up (this window may
    once = len(worker.requests.messages)    # still hold the end of the last one's)
    batches(2.5, skipped_per_s=0, start=0)
    assert len(worker.requests.messages) == once


def test_a_camera_whose_tracks_are_full_is_searched_only_when_asked(monkeypatch):
    """Note [No search where no face could go]: cam00 and cam01 are full from the start (the
    roi_landmark worker said so); cam01 asks for a pass at 1.0 s (it lost a face: no longer
    full) and cam00's worker says at 2.0 s that it has room again. With room for a pass every
    other frame, the full cameras get none until then; the others are searched as before."""
    clock = Clock()
    monkeypatch.setattr(detection, "time", SimpleNamespace(monotonic=clock.monotonic))
    worker, published = _worker(clock, 0.5)
    encode = detection.messages.encode
    worker.requests = Requests(clock, [
        (0.0, encode(detection.TracksFull(camera_ids=list(CAMERAS), full=["cam00", "cam01"]))),
        (1.0, encode(detection.DetectionWanted(camera_ids=["cam01"]))),
        (2.0, encode(detection.TracksFull(camera_ids=["cam00"], full=[]))),
    ])
    while clock.now_s < 3.0:
        worker.step()
    times = {camera_id: sorted(frame_seq * FRAME_PERIOD_S for frame_seq in searched)
             for camera_id, searched in published.frames.items()}
    assert not [t for t in times["cam00"] if t < 2.0], times["cam00"]
    assert len([t for t in times["cam00"] if t >= 2.0]) >= 14, times["cam00"]
    assert not [t for t in times["cam01"] if t < 1.0], times["cam01"]
    # Asked for at 1.0 s: the next frame, and from then on as a camera with room.
    assert times["cam01"][0] <= 1.0 + 2 * FRAME_PERIOD_S, times["cam01"]
    assert len([t for t in times["cam01"] if t >= 1.0]) >= 28, times["cam01"]
    for camera_id in ("cam02", "cam03"):
        assert len(times[camera_id]) >= 3.0 / FRAME_PERIOD_S / 2, (camera_id, times[camera_id])


def test_with_every_camera_full_the_frames_are_still_taken_off_the_bus(monkeypatch):
    """No camera to search, and no interval to end the wait: the frames are taken off the bus
    every MAX_BUS_WAIT_S all the same (a full queue drops the newest), and none is searched."""
    clock = Clock()
    monkeypatch.setattr(detection, "time", SimpleNamespace(monotonic=clock.monotonic))
    worker, published = _worker(clock, 0.5)
    full = detection.messages.encode(detection.TracksFull(camera_ids=list(CAMERAS),
                                                          full=list(CAMERAS)))
    worker.requests = Requests(clock, [(0.0, full)])
    while clock.now_s < 2.0:
        worker.step()
    assert not any(published.frames.values()), published.frames
    reads_s = worker.subscriber.reads_s
    assert len(reads_s) >= 2.0 / (MAX_BUS_WAIT_S + 0.05)
    assert max(b - a for a, b in zip(reads_s, reads_s[1:])) <= MAX_BUS_WAIT_S + 0.05 + 1e-9


def test_a_roi_landmark_worker_says_which_cameras_are_full_on_change_and_every_second(monkeypatch):
    """TracksFull: all of the worker's cameras and those whose tracks fill max_faces, sent when
    that changes and again every FULL_RESEND_S; a message the socket refused (the detection
    worker busy or restarting) is sent again on the next batch."""
    from facecast.workers.inference import roi_landmark

    clock = Clock()
    monkeypatch.setattr(roi_landmark, "time", SimpleNamespace(monotonic=clock.monotonic))

    class Socket:
        def __init__(self) -> None:
            self.sent, self.refuse = [], False

        def send(self, payload, flags=0) -> None:
            if self.refuse:
                raise roi_landmark.zmq.Again()
            message = detection.messages.decode(payload)
            self.sent.append((round(clock.now_s, 3), message.camera_ids, message.full))

    room = {"cam0": True, "cam1": True}
    worker = roi_landmark.RoiLandmarkWorker.__new__(roi_landmark.RoiLandmarkWorker)
    worker.camera_ids = ["cam0", "cam1"]
    worker.pipeline = SimpleNamespace(has_room=lambda camera_id: room[camera_id])
    worker.requests = Socket()
    worker._full_said, worker._full_said_monotonic = None, float("-inf")

    def batch(seconds: float = FRAME_PERIOD_S) -> None:
        clock.now_s += seconds
        worker._say_which_are_full()

    batch()
    batch()
    assert worker.requests.sent == [(0.033, ["cam0", "cam1"], [])]
    room["cam1"] = False
    batch()
    assert worker.requests.sent[-1] == (0.1, ["cam0", "cam1"], ["cam1"])
    for _ in range(29):
        batch()
    assert len(worker.requests.sent) == 2  # nothing new within FULL_RESEND_S
    batch(roi_landmark.FULL_RESEND_S)
    assert worker.requests.sent[-1][1:] == (["cam0", "cam1"], ["cam1"])
    worker.requests.refuse = True
    room["cam0"] = False
    batch()
    worker.requests.refuse = False
    batch()
    assert worker.requests.sent[-1][1:] == (["cam0", "cam1"], ["cam0", "cam1"])
