"""Versioned messages and tolerant readers (STYLE.md §4), and transport decisions on a CPU machine."""

import logging

import msgspec
import numpy as np
import pytest
import zmq

from facecast.shared.transport import messages
from facecast.shared.transport.messages import BadMessage, FrameReady, MessageGate, TransportFault


def frame_message(**overrides) -> FrameReady:
    fields = dict(camera_id="cam0", transport="shm", ring_epoch=7, slot=1, slot_generation=4,
                  frame_seq=10, capture_ts_lsl=12.5, shape=(4, 4, 3), dtype="uint8",
                  strides_bytes=(12, 3, 1), pixel_format="bgr24", checksum=99)
    fields.update(overrides)
    return FrameReady(**fields)


def test_round_trip_keeps_every_field_and_ids_are_unique():
    first, second = frame_message(), frame_message()
    assert messages.decode(messages.encode(first)) == first
    assert first.id != second.id


def test_unknown_fields_are_ignored_by_readers():
    raw = msgspec.msgpack.decode(messages.encode(frame_message()))
    raw["added_by_a_newer_sender"] = [1, 2, 3]
    decoded = messages.decode(msgspec.msgpack.encode(raw))
    assert isinstance(decoded, FrameReady) and decoded.frame_seq == 10


@pytest.mark.parametrize(
    "payload, reason",
    [
        (msgspec.msgpack.encode({**msgspec.to_builtins(frame_message()), "v": 2}), "protocol version 2"),
        (messages.encode(frame_message())[:20], "not msgpack"),
        (b"\xc1garbage", "not msgpack"),
        (b"\x81\xa2\xff\xfe\x01", "not msgpack"),  # invalid UTF-8 in a string
        (b"\x91" * 100_000 + b"\xc0", "not msgpack"),  # nested deeper than the decoder goes
        (msgspec.msgpack.encode([1, 2]), "not a message envelope"),
        (msgspec.msgpack.encode({"type": "frame", "v": 1, "slot": "one"}), "invalid 'frame' message"),
        (msgspec.msgpack.encode({"type": "launch", "v": 1}), "invalid 'launch' message"),
    ],
    # Named, not shown: the first payload holds a message id made of this process's pid, and
    # every pytest-xdist worker must collect the same test ids.
    ids=["version 2", "truncated", "bad first byte", "bad utf-8", "nested too deep",
         "not an envelope", "bad field", "bad launch"],
)
def test_other_versions_truncated_and_garbage_messages_are_refused_with_a_reason(payload, reason):
    with pytest.raises(BadMessage, match=reason):
        messages.decode(payload)


def test_gate_counts_refusals_and_rate_limits_the_log(caplog):
    gate = MessageGate("test socket", log_interval_s=60)
    with caplog.at_level(logging.WARNING):
        for _ in range(100):
            assert gate.decode(b"\x00\x01junk") is None
    assert gate.rejected == 100
    assert len(caplog.records) == 1 and "test socket" in caplog.records[0].getMessage()
    good = TransportFault(camera_id="c", ring_epoch=1, reason="r")
    assert gate.decode(messages.encode(good)) == good


def test_choose_transport_decisions():
    from facecast.shared.transport.publisher import choose_transport

    assert choose_transport("shm", None) == ("shm", "")
    assert choose_transport("auto", None) == ("cuda_ipc", "")
    assert choose_transport("auto", "no GPU") == ("shm", "no GPU")
    assert choose_transport("cuda_ipc", "pycuda missing") == ("shm", "pycuda missing")
    with pytest.raises(ValueError, match="transport 'nvlink'"):
        choose_transport("nvlink", None)


def test_on_a_machine_without_cuda_auto_and_cuda_ipc_fall_back_to_shm_with_the_reason():
    from facecast.shared.transport.cuda_driver import cuda_unavailable_reason
    from facecast.shared.transport.publisher import make_producer

    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("this machine can use CUDA; the fallback decision is tested in test_cuda_rules")
    for requested in ("auto", "cuda_ipc"):
        producer = make_producer("fb", (8, 8, 3), 2, requested)
        try:
            assert producer.transport == "shm"
            assert producer.description().fallback_reason == reason
        finally:
            producer.close()


def test_publisher_survives_garbage_on_its_control_socket(tmp_path):
    from facecast.shared.transport.endpoints import ring_control as ring_control_endpoint
    from facecast.shared.transport.publisher import FramePublisher

    with zmq.Context() as context:
        publisher = FramePublisher(context, tmp_path, "g", transport="shm")
        intruder = context.socket(zmq.DEALER)
        intruder.connect(ring_control_endpoint(tmp_path, "g"))
        intruder.send(b"not a message")
        intruder.send(msgspec.msgpack.encode({"type": "describe_ring", "v": 99}))
        publisher.publish(np.zeros((8, 8, 3), np.uint8), 1.0)
        intruder.send(messages.encode(messages.DescribeRing(camera_id="g")))
        reply = None
        for _ in range(100):
            publisher.serve_control()
            if intruder.poll(20):
                reply = messages.decode(intruder.recv())
                break
        assert publisher._gate.rejected == 2
        assert isinstance(reply, messages.RingDescription) and reply.camera_id == "g"
        intruder.close()
        publisher.close()


# --- body pose in FaceResults ----------------------------------------------------------------------


def _pose_result(presence: float = 0.9) -> messages.PoseResult:
    rng = np.random.default_rng(1)
    return messages.PoseResult.from_arrays(
        presence=presence, score=0.8, box_px=(1, 2, 3, 4),
        landmarks=rng.normal(size=(33, 5)), world_landmarks_m=rng.normal(size=(33, 3)))


def test_face_results_carry_poses_and_old_senders_stay_valid():
    pose = _pose_result()
    sent = messages.FaceResults(camera_id="cam0", frame_seq=3, capture_ts_lsl=1.5, faces=[], poses=[pose])
    received = messages.decode(messages.encode(sent))
    assert received == sent
    rng = np.random.default_rng(1)
    np.testing.assert_array_equal(received.poses[0].landmarks_array(), rng.normal(size=(33, 5)).astype(np.float32))
    np.testing.assert_array_equal(received.poses[0].world_landmarks_array(),
                                  rng.normal(size=(33, 3)).astype(np.float32))
    # A sender that predates the field: no pose measured (None), which is not "nobody" ([]).
    old = msgspec.msgpack.decode(messages.encode(sent))
    del old["poses"]
    assert messages.decode(msgspec.msgpack.encode(old)).poses is None


def test_pose_arrays_are_checked_on_both_sides():
    with pytest.raises(ValueError, match=r"landmarks must have shape \(33, 5\)"):
        messages.PoseResult.from_arrays(presence=1, score=1, box_px=(0, 0, 1, 1),
                                        landmarks=np.zeros((33, 4)), world_landmarks_m=np.zeros((33, 3)))
    truncated = msgspec.structs.replace(_pose_result(), world_landmarks_m=b"\x00" * 12)
    with pytest.raises(ValueError, match="world_landmarks_m has 12 bytes, expected 396"):
        truncated.world_landmarks_array()


# --- track ids (Note [Track id blocks]) ------------------------------


def test_track_id_request_and_grant_round_trip_and_the_grant_echoes_the_request():
    request = messages.TrackIdsWanted(worker="roi_landmark:cpu:0")
    assert messages.decode(messages.encode(request)) == request
    block = messages.TrackIdBlock(start=1025, count=1024)
    grant = messages.TrackIdGrant(reply_to=request.id, block=block)
    received = messages.decode(messages.encode(grant))
    assert received == grant and received.reply_to == request.id
    assert (received.block.start, received.block.end) == (1025, 2049)
    refused = messages.TrackIdGrant(reply_to=request.id, error="used up")
    assert messages.decode(messages.encode(refused)) == refused


def test_an_assignment_carries_a_first_block_and_one_from_an_older_supervisor_has_none():
    sent = messages.Assignment(worker="roi_landmark:cpu:0", config=b"{}", camera_ids=["cam0"],
                               track_ids=messages.TrackIdBlock(start=1, count=1024))
    assert messages.decode(messages.encode(sent)) == sent
    old = msgspec.msgpack.decode(messages.encode(sent))
    del old["track_ids"]
    assert messages.decode(msgspec.msgpack.encode(old)).track_ids is None


def test_a_heartbeat_reports_trouble_and_one_from_an_older_worker_has_none():
    sent = messages.Heartbeat(worker="roi_landmark:cpu:0", state="running",
                              trouble="no track ids (used up): 3 new face(s) not published")
    assert messages.decode(messages.encode(sent)) == sent
    old = msgspec.msgpack.decode(messages.encode(sent))
    del old["trouble"]
    assert messages.decode(msgspec.msgpack.encode(old)).trouble == ""


def test_a_heartbeat_carries_torchs_memory_and_one_without_it_decodes_to_none():
    memory = messages.TorchMemory(allocated_mib=812.4, reserved_mib=1024.0,
                                  peak_allocated_mib=900.5)
    sent = messages.Heartbeat(worker="roi_landmark:cuda:0:0", state="running",
                              torch_memory=memory)
    received = messages.decode(messages.encode(sent))
    assert received == sent and received.torch_memory == memory
    # A worker whose torch has no CUDA sends none; one that predates the field leaves it out.
    without = messages.Heartbeat(worker="output", state="running")
    assert messages.decode(messages.encode(without)).torch_memory is None
    old = msgspec.msgpack.decode(messages.encode(sent))
    del old["torch_memory"]
    assert messages.decode(msgspec.msgpack.encode(old)).torch_memory is None


def test_a_malformed_grant_is_refused_by_the_gate_with_a_reason():
    gate = MessageGate("supervisor (to roi_landmark:cpu:0)")
    for bad in ({"start": "one", "count": 4}, {"start": 1}):
        raw = {"type": "track_id_grant", "v": 1, "id": "1-1", "reply_to": "1-0", "block": bad}
        assert gate.decode(msgspec.msgpack.encode(raw)) is None
    assert gate.rejected == 2 and "invalid 'track_id_grant' message" in gate.last_reason
