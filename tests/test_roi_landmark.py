"""The roi_landmark worker's handling of what the detection worker sends, and its side of the
track id protocol with the supervisor."""

import logging

import msgspec
import pytest
import zmq

from facecast.daemon.track_ids import TrackIdAllocator
from facecast.shared import config as config_mod
from facecast.shared.transport import messages
from facecast.shared.transport.messages import (
    Assignment,
    Detections,
    Event,
    TrackIdBlock,
    TrackIdsWanted,
)
from facecast.workers.inference.roi_landmark import (
    TRACK_IDS_ASK_AGAIN_AFTER_REFUSAL_S,
    TRACK_IDS_ASK_AGAIN_S,
    RoiLandmarkWorker,
    _as_tensors,
)
from facecast.workers.inference.tracking import TrackIds


def test_a_detection_pass_that_found_no_face_is_usable():
    # Regression (found by tests/soak): an empty pass raised in reshape and crash-looped the
    # roi_landmark worker on every camera with nobody in view.
    empty = Detections(camera_id="cam", ring_epoch=1, frame_seq=3, capture_ts_lsl=1.0,
                       boxes_px=[], keypoints_px=[], scores=[])
    boxes, keypoints, scores = _as_tensors(empty)
    assert boxes.shape == (0, 4) and keypoints.shape[0] == 0 and scores.shape == (0,)
    one = Detections(camera_id="cam", ring_epoch=1, frame_seq=3, capture_ts_lsl=1.0,
                     boxes_px=[(1.0, 2.0, 30.0, 31.0)], keypoints_px=[[(5.0, 6.0)] * 6],
                     scores=[0.9])
    boxes, keypoints, scores = _as_tensors(one)
    assert boxes.shape == (1, 4) and keypoints.shape == (1, 6, 2) and scores.shape == (1,)


def test_a_slow_cameras_detection_of_its_previous_frame_is_used():
    """A detection reaches the worker after the frame it was made on, so it starts faces on a
    later frame of its camera. The previous frame's is used whatever its age (at 3 fps it is
    333 ms old, and with an age limit alone such a camera never got a face); older ones only
    while recent (MAX_DETECTION_AGE_S); never another ring epoch's or a later frame's."""
    def frame(seq: int, fps: float, epoch: int = 1) -> messages.FrameReady:
        return messages.FrameReady(
            camera_id="cam", transport="shm", ring_epoch=epoch, slot=0, slot_generation=2,
            frame_seq=seq, capture_ts_lsl=100.0 + seq / fps, shape=(4, 4, 3), dtype="uint8",
            strides_bytes=(12, 3, 1), pixel_format="bgr24", checksum=0)

    def detections_of(message: messages.FrameReady) -> Detections:
        return Detections(camera_id="cam", ring_epoch=message.ring_epoch,
                          frame_seq=message.frame_seq, capture_ts_lsl=message.capture_ts_lsl,
                          boxes_px=[], keypoints_px=[], scores=[])

    usable = RoiLandmarkWorker._usable
    assert usable(detections_of(frame(10, 3.0)), frame(11, 3.0))  # 333 ms old: the newest there is
    assert usable(detections_of(frame(10, 3.0)), frame(10, 3.0))
    assert not usable(detections_of(frame(10, 3.0)), frame(12, 3.0))  # 667 ms old
    assert usable(detections_of(frame(10, 30.0)), frame(18, 30.0))  # 267 ms: recent enough
    assert not usable(detections_of(frame(10, 30.0)), frame(20, 30.0))  # 333 ms
    assert not usable(detections_of(frame(10, 3.0, epoch=1)), frame(11, 3.0, epoch=2))
    assert not usable(detections_of(frame(12, 3.0)), frame(11, 3.0))  # of a later frame


def test_a_cameras_tracks_are_forgotten_where_its_frames_break():
    """Note [Tracks across a break]: a camera's frames from a new ring (a spare took its capture
    over) or after a gap longer than TRACK_BREAK_S start without its old tracks (whose ROIs
    were the last frame's faces); consecutive frames, dropped ones between them included,
    keep them, and another camera's break is not this one's."""
    from types import SimpleNamespace

    from facecast.workers.inference import roi_landmark

    resets = []
    worker = RoiLandmarkWorker.__new__(RoiLandmarkWorker)
    worker.pipeline = SimpleNamespace(reset=resets.append,
                                      batch_in_place=lambda tensors: tensors,
                                      track_start=lambda batch, camera_ids, detections: None)
    worker.pose_pipeline = None
    worker._pending = {}
    worker._last_frame = {}

    def frames(*shown):
        return [SimpleNamespace(tensor=None, message=messages.FrameReady(
            camera_id=camera, transport="shm", ring_epoch=epoch, slot=0, slot_generation=2,
            frame_seq=0, capture_ts_lsl=ts, shape=(4, 4, 3), dtype="uint8",
            strides_bytes=(12, 3, 1), pixel_format="bgr24", checksum=0))
            for camera, epoch, ts in shown]

    gap = roi_landmark.TRACK_BREAK_S
    worker._start(frames(("a", 1, 10.0), ("b", 1, 10.0)))
    worker._start(frames(("a", 1, 10.1), ("b", 1, 10.1)))
    worker._start(frames(("a", 1, 10.1 + 0.9 * gap)))  # frames dropped between: the same run
    assert resets == []
    worker._start(frames(("a", 2, 10.2 + 0.9 * gap), ("b", 1, 10.2)))  # a's new ring
    assert resets == ["a"]
    worker._start(frames(("b", 1, 10.3 + 1.1 * gap)))  # b's source lost and back
    assert resets == ["a", "b"]
    worker._start(frames(("a", 2, 10.3 + gap), ("b", 1, 10.4 + 1.1 * gap)))
    assert resets == ["a", "b"]


# --- track ids from the supervisor (Note [Track id blocks]) ----------
# The worker's side of the protocol against a ROUTER playing the supervisor, answering with the
# supervisor's own allocator (no models: the track id half of the worker needs none).

WORKER = "roi_landmark:cpu:0"


@pytest.fixture
def control(runtime_dir):
    """(worker, supervisor's ROUTER) on a real ipc:// control socket."""
    endpoint = f"ipc://{runtime_dir}/control"
    with zmq.Context() as context:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        worker = RoiLandmarkWorker(WORKER, endpoint, context)
        try:
            yield worker, router
        finally:
            worker.control.close(linger=0)
            router.close()


def _receive(router, timeout_ms: int = 5000):
    assert router.poll(timeout_ms), "the worker sent nothing"
    identity, payload = router.recv_multipart()
    return identity, messages.decode(payload)


def _next_is_not_a_request(worker, router) -> None:
    """What the worker sent last was no TrackIdsWanted: a probe it sends now comes first."""
    worker.event("probe")
    _, message = _receive(router)
    assert isinstance(message, Event) and message.kind == "probe", message


def _answer(worker, router, allocator: TrackIdAllocator) -> None:
    identity, request = _receive(router)
    assert isinstance(request, TrackIdsWanted), request
    assert identity == WORKER.encode() and request.worker == WORKER
    router.send_multipart([identity, messages.encode(allocator.answer(request))])
    assert worker.control.poll(5000), "no grant reached the worker"
    worker.serve_control()


def test_the_first_block_comes_with_the_assignment(control):
    worker, router = control
    worker.event("probe")  # the connection is up once the supervisor hears from the worker
    identity, _ = _receive(router)
    config = config_mod.loads('[[cameras]]\nid = "cam0"\nsource = "synthetic"\n')
    router.send_multipart([identity, messages.encode(Assignment(
        worker=WORKER, config=msgspec.json.encode(config), camera_ids=["cam0"],
        track_ids=TrackIdBlock(start=4097, count=1024)))])
    assert worker.wait_for_assignment()
    assert isinstance(_receive(router)[1], messages.Hello)
    assert worker.track_id_source.take() == 4097
    worker._ask_for_track_ids_if_low()
    _next_is_not_a_request(worker, router)


def test_the_worker_asks_at_half_a_block_and_never_before(control):
    worker, router = control
    allocator = TrackIdAllocator(block_size=4)
    worker._ask_for_track_ids_if_low()  # nothing granted yet (a supervisor that predates it)
    _answer(worker, router, allocator)
    assert worker.track_id_source.remaining == 4
    worker._ask_for_track_ids_if_low()
    _next_is_not_a_request(worker, router)
    assert [worker.track_id_source.take() for _ in range(2)] == [1, 2]
    worker._ask_for_track_ids_if_low()
    _answer(worker, router, allocator)
    assert [worker.track_id_source.take() for _ in range(6)] == [3, 4, 5, 6, 7, 8]
    worker._ask_for_track_ids_if_low()
    worker._ask_for_track_ids_if_low()  # asked already: no second request while it is on its way
    _receive(router)
    _next_is_not_a_request(worker, router)


def test_a_dry_worker_says_so_asks_again_and_recovers(control, caplog):
    worker, router = control
    used_up = TrackIdAllocator(block_size=2, limit=3)
    used_up.grant("an earlier worker")
    worker._ask_for_track_ids_if_low()
    _answer(worker, router, used_up)  # refused: the space is used up
    assert TrackIds(worker.track_id_source).assign([(0.0, 0.0, 50.0, 50.0)], 1.0) == [None]
    with caplog.at_level(logging.ERROR):
        worker._no_track_id_for("cam0", 1)
        worker._no_track_id_for("cam0", 2)
    _, event = _receive(router)  # once per dry spell, on the Markers stream
    assert event.kind == "track_ids_dry" and event.fields["camera"] == "cam0"
    assert "used up" in event.fields["reason"]
    assert "3 new face(s) not published" in worker.trouble() and "used up" in worker.trouble()
    assert [r.getMessage() for r in caplog.records if "no track id left" in r.getMessage()]
    worker._ask_for_track_ids_if_low()  # a refusal is not asked again at once
    _next_is_not_a_request(worker, router)
    worker._track_ids_asked_monotonic -= TRACK_IDS_ASK_AGAIN_AFTER_REFUSAL_S
    worker._ask_for_track_ids_if_low()
    _answer(worker, router, TrackIdAllocator(first_id=100))  # say, a fresh space
    assert worker.trouble() == "" and worker.track_id_source.take() == 100


def test_an_unanswered_request_is_asked_again(control):
    worker, router = control
    worker._ask_for_track_ids_if_low()
    _receive(router)  # lost: never answered
    worker._ask_for_track_ids_if_low()
    _next_is_not_a_request(worker, router)
    worker._track_ids_asked_monotonic -= TRACK_IDS_ASK_AGAIN_S
    worker._ask_for_track_ids_if_low()
    _answer(worker, router, TrackIdAllocator())
    assert worker.track_id_source.take() == 1


# --- Note [Reading while the device measures] -------------------------------------------------


def test_the_next_frames_are_read_while_a_batch_is_measured(control):
    """`step` queues a batch, reads what has arrived meanwhile, and only then waits for the
    batch and publishes it; one batch at most is on its way; with nothing new the worker goes
    back to waiting for frames."""
    worker, _ = control
    calls = []
    batches = iter([["a"], ["b"], [], ["c"], []])

    class Subscriber:
        def receive(self, timeout_ms):
            batch = next(batches)
            calls.append(("receive", timeout_ms, batch))
            return batch

    worker.subscriber = Subscriber()
    worker._measuring = None
    worker._drain_detections = lambda: None
    worker._ask_for_track_ids_if_low = lambda: None
    worker._start = lambda received: calls.append(("start", received)) or received
    worker._finish = lambda measuring: calls.append(("finish", measuring))
    worker.step()
    assert calls == [("receive", 50, ["a"]), ("start", ["a"]), ("receive", 0, ["b"]),
                     ("finish", ["a"]), ("start", ["b"])]
    calls.clear()
    worker.step()  # b is on its way; nothing new came: b is published, nothing queued
    assert calls == [("receive", 0, []), ("finish", ["b"])] and worker._measuring is None
    calls.clear()
    worker.step()  # waiting for frames again
    assert calls == [("receive", 50, ["c"]), ("start", ["c"]), ("receive", 0, []),
                     ("finish", ["c"])]
