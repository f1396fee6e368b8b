"""The fault-injection hook the soak test uses (Note [Fault injection]):
refused unless the daemon allows it, and what it does to a shm ring: the slot changes after it
is committed, generation intact, so that only the checksum catches it."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from facecast.daemon.control import FAULT_INJECTION_ENV, inject_fault
from facecast.daemon.supervisor import Supervisor
from facecast.daemon.sd_notify import Notifier
from facecast.shared import config as config_mod
from facecast.shared.transport.messages import InjectFault
from facecast.shared.transport.rings import ShmRingProducer, ShmRingReader, Verdict
from facecast.shared.transport.publisher import FramePublisher


def _supervisor(runtime_dir) -> Supervisor:
    config = config_mod.loads(f'[daemon]\nruntime_dir = "{runtime_dir}"\n\n'
                              '[[cameras]]\nid = "cam0"\nsource = "synthetic"\n')
    return Supervisor(config, "facecast.toml", gpus=0, notifier=Notifier({}))


def test_the_supervisor_refuses_faults_unless_the_daemon_was_started_to_allow_them(
        runtime_dir, monkeypatch):
    corrupt = InjectFault(kind="corrupt_next_frame", camera_id="cam0")
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    refused = inject_fault(_supervisor(runtime_dir), corrupt)
    assert not refused.ok and refused.reply_to == corrupt.id
    assert f"{FAULT_INJECTION_ENV}=1" in refused.error

    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    allowed = _supervisor(runtime_dir)
    unknown = inject_fault(allowed, InjectFault(kind="melt_the_gpu", camera_id="cam0"))
    assert not unknown.ok and "unknown fault 'melt_the_gpu'" in unknown.error
    no_worker = inject_fault(allowed, corrupt)  # nothing started: no capture worker to ask
    assert not no_worker.ok and "no running capture worker for camera 'cam0'" in no_worker.error


def test_a_corrupted_shm_slot_keeps_its_generation_and_only_the_checksum_catches_it():
    rng = np.random.default_rng(5)
    producer = ShmRingProducer("fault", (24, 32, 3), slot_count=2)
    reader = ShmRingReader(producer.description(), checksum_every=1)
    try:
        frame = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
        producer.corrupt_next_frame()
        spoiled = producer.write(frame, 0, 1.0)
        assert producer.header.get(spoiled.slot) == spoiled.slot_generation  # committed, even
        assert reader.read(spoiled).verdict is Verdict.CHECKSUM_MISMATCH
        clean = producer.write(frame, 1, 2.0)  # once only
        read = reader.read(clean)
        assert read.verdict is Verdict.OK
        np.testing.assert_array_equal(read.tensor.numpy(), frame)
    finally:
        reader.close()
        producer.close()


def test_the_publisher_spoils_the_next_frame_even_before_its_ring_exists(runtime_dir):
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", slot_count=2, transport="shm")
        try:
            publisher.corrupt_next_frame()  # no frame yet, so no ring: armed all the same
            frame = np.full((8, 8, 3), 7, np.uint8)
            spoiled = publisher.publish(frame, 1.0)
            reader = ShmRingReader(publisher.producer.description(), checksum_every=1)
            try:
                assert reader.read(spoiled).verdict is Verdict.CHECKSUM_MISMATCH
                assert reader.read(publisher.publish(frame, 2.0)).verdict is Verdict.OK
            finally:
                reader.close()
        finally:
            publisher.close()


@pytest.mark.daemon
def test_a_mismatch_on_shm_reaches_the_markers_stream(default_daemon):
    """Note [Mismatches are events]: a frame whose bytes are not the camera's is a
    `frame_mismatch` marker, not only a counter. The consumers read the newest frame only, so a
    spoiled frame may be passed over by all of them: the test spoils frames until one is caught.
    The daemon (config/default.toml, fault injection allowed) is shared with other files that
    only watch it (Note [One daemon for several test files])."""
    import json
    import time

    from daemon_harness import Recorder
    from facecast.daemon.cli.control_client import request

    daemon = default_daemon
    try:
        markers = Recorder(daemon.resolve("Markers", count=1))
        try:
            found = None
            deadline = time.monotonic() + 60
            while found is None and time.monotonic() < deadline:
                reply = request(daemon.runtime_dir,
                                InjectFault(kind="corrupt_next_frame", camera_id="synth0"), 5.0)
                assert reply.ok, reply.error
                wait_until = time.monotonic() + 0.5
                while found is None and time.monotonic() < wait_until:
                    events = [json.loads(sample[0]) for sample in markers.records[0].samples]
                    found = next((e for e in events if e["event"] == "frame_mismatch"), None)
                    time.sleep(0.02)
        finally:
            markers.stop()
    finally:
        daemon.close_inlets()
    assert found is not None, daemon.log_tail()
    assert found["camera"] == "synth0" and found["transport"] == "shm", found
    assert found["frames"] >= 1 and "checksum mismatch" in found["reason"], found
    assert isinstance(found["frame_seq"], int) and found["worker"], found
