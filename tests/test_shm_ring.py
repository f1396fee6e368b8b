"""The shared-memory ring across real processes (DESIGN.md §2; Notes [Slot generations], [Probe slot])."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import multiprocessing

import zmq

from facecast.shared.transport import frames, shm
from peers import DECK_SIZE, Peers, make_deck
from facecast.shared.transport.rings import (
    ShmRingProducer,
    ShmRingReader,
    TransportUnavailable,
    Verdict,
    read_batch,
)





# The frame runs' rate where what a test checks does not depend on it: 200 fps, so that each run
# of hundreds of frames takes half the real time of 100 fps (the suite's 8 minutes, issue 20).
RING_TEST_FPS = 200
# The rate of the runs whose liveness bound is a share of the frames a consumer received (the
# round trip to four consumers, the producer restart, the staged frames): what a reader keeps up
# with depends on the rate and on what else runs. Beside a busy process, one of four readers got
# 251 of 1000 at 200 fps against a bound of 250; beside a busy process and a test daemon of the
# other pytest-xdist worker (Note [Tests side by side]), the restarted ring's reader got 88 of 300
# at 200 fps against a bound of 100. These bounds were set at 100 fps, and run at it, in the
# daemon tests' lane (marker `timing`, Note [Tests side by side]), never beside a daemon.
SHARE_BOUND_FPS = 100


def own_segments(pid: int) -> list[str]:
    return [name for name in shm.list_segments() if name.startswith(f"facecast-{pid}-")]


@pytest.mark.timing  # Note [Tests side by side]
def test_round_trip_1000_random_frames_to_4_consumer_processes(peers):
    shape = "240,320,3"
    consumers = peers.start_many(4, "consumer", shape=shape, until_seq=999)
    producer = peers.start("producer", shape=shape, frames=1000, fps=SHARE_BOUND_FPS,
                           transport="shm")
    assert Peers.result(producer)["published"] == 1000
    for consumer in consumers:
        seen = Peers.result(consumer)
        assert seen["mismatched"] == 0, seen
        assert seen["last_seq"] == 999, seen
        # Consumers skip to the newest frame when behind (counted); on an idle machine they get
        # nearly all, on a loaded 2-core CI machine still a large share. A liveness bound only.
        assert seen["received"] >= 250, seen
        # Every frame from the first one this consumer got is accounted for: read, or counted
        # as skipped or overwritten. (On a loaded machine the subscription may complete a few
        # frames after the producer started: those frames were never this consumer's.)
        assert seen["first_seq"] < 500, seen
        accounted = seen["first_seq"] + sum(seen["counts"].values())
        assert accounted >= 990, seen
        assert seen["counts"].get("checksum_mismatch", 0) == 0, seen
    assert own_segments(producer.pid) == []


def test_overwritten_slot_is_detected_never_handed_on():
    producer = ShmRingProducer("ovr", (48, 64, 3), slot_count=4)
    reader = ShmRingReader(producer.description(), checksum_every=1)
    try:
        deck = [np.full((48, 64, 3), value, np.uint8) for value in range(10)]
        first = producer.write(deck[0], 0, 0.0)
        for seq in range(1, 6):  # wraps the 4-slot ring: slot 0 now holds frame 4
            latest = producer.write(deck[seq], seq, 0.0)
        stale = reader.read(first)
        assert stale.verdict is Verdict.OVERWRITTEN and stale.tensor is None
        fresh = reader.read(latest)
        assert fresh.ok and int(fresh.tensor[0, 0, 0]) == 5
        # A slot in the middle of a write (odd generation) is not readable either.
        producer.header.begin_write(latest.slot)
        assert reader.read(latest).verdict is Verdict.OVERWRITTEN
        assert reader.counts[Verdict.OVERWRITTEN] == 2
    finally:
        reader.close()
        producer.close()


def test_concurrent_writes_never_yield_a_torn_frame():
    """A slow reader racing a fast writer on a 2-slot ring: every OK read is one whole frame."""
    shape = (256, 256, 3)
    producer = ShmRingProducer("torn", shape, slot_count=2)
    reader = ShmRingReader(producer.description(), checksum_every=1)
    messages: list = []
    stop = threading.Event()

    def write_forever():
        seq = 0
        while not stop.is_set():
            messages.append(producer.write(np.full(shape, seq % 251, np.uint8), seq, 0.0))
            seq += 1

    writer = threading.Thread(target=write_forever)
    writer.start()
    ok = overwritten = 0
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if not messages:
                continue
            message = messages[-1]
            read = reader.read(message)
            if read.ok:
                values = np.unique(read.tensor.numpy())
                assert values.tolist() == [message.frame_seq % 251], "torn or stale frame"
                ok += 1
            else:
                assert read.verdict is Verdict.OVERWRITTEN
                overwritten += 1
    finally:
        stop.set()
        writer.join(timeout=5)
        reader.close()
        producer.close()
    assert ok > 0
    assert ok + overwritten == sum(reader.counts.values())


@pytest.mark.timing  # Note [Tests side by side]
def test_producer_restart_gives_new_epoch_and_consumer_reattaches(peers):
    shape = "96,128,3"
    consumer = peers.start("consumer", shape=shape, timeout_s=20, until_seq=10**9,
                           say_first_frame=True)
    first = peers.start("producer", shape=shape, frames=100000,
                        fps=SHARE_BOUND_FPS, transport="shm")
    assert "first_frame" in Peers.next_line(consumer)  # it reads the first ring
    first.send_signal(signal.SIGKILL)
    first.wait()
    removed = shm.sweep_dead_owners(owner_pid=first.pid)  # not other runs' segments
    assert removed and own_segments(first.pid) == []
    second = peers.start("producer", shape=shape, frames=300, fps=SHARE_BOUND_FPS, transport="shm")
    Peers.result(second)
    consumer.send_signal(signal.SIGTERM) if consumer.poll() is None else None
    seen = Peers.result(consumer)
    assert len(seen["epochs"]) == 2, seen  # attached to the first ring, then to the new one
    assert seen["epochs"][0] != seen["epochs"][1]
    assert seen["mismatched"] == 0 and seen["received"] > 100, seen


def test_consumer_killed_leaves_producer_and_other_consumers_running(peers):
    shape = "96,128,3"
    victim, survivor = peers.start_many(2, "consumer", shape=shape, until_seq=599,
                                        say_first_frame=True)
    producer = peers.start("producer", shape=shape, frames=600,
                           fps=RING_TEST_FPS, transport="shm")
    assert "first_frame" in Peers.next_line(victim)  # killed while it reads
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    started = time.monotonic()
    assert Peers.result(producer)["published"] == 600
    # 600 frames at RING_TEST_FPS (3 s): the producer never waited for the dead consumer.
    assert time.monotonic() - started < 10
    seen = Peers.result(survivor)
    assert seen["last_seq"] == 599 and seen["mismatched"] == 0, seen


def test_nothing_left_in_dev_shm_after_sigkill_and_sweep(peers):
    producer = peers.start("producer", frames=100000, fps=50, transport="shm")
    consumer = peers.start("consumer", until_seq=10**9, timeout_s=30)
    deadline = time.monotonic() + 10
    while not own_segments(producer.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert own_segments(producer.pid), "the producer never created its ring"
    for proc in (consumer, producer):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert own_segments(producer.pid), "nothing to sweep: the test would prove nothing"
    shm.sweep_dead_owners()
    assert own_segments(producer.pid) == []


def test_sweep_leaves_live_owners_alone():
    producer = ShmRingProducer("live", (8, 8, 3), slot_count=2)
    try:
        # What else the sweep removes (dead owners' segments of other runs) is not this test's.
        removed = shm.sweep_dead_owners()
        assert [name for name in removed if name.startswith(f"facecast-{os.getpid()}-")] == []
        assert len(own_segments(os.getpid())) == 2
    finally:
        producer.close()
    assert own_segments(os.getpid()) == []


def test_reader_refuses_a_ring_whose_probe_slot_is_wrong():
    producer = ShmRingProducer("probe", (16, 16, 3), slot_count=2)
    try:
        producer._slots[2, 100] ^= 0xFF  # the probe slot no longer holds the epoch's pattern
        with pytest.raises(TransportUnavailable, match="probe slot"):
            ShmRingReader(producer.description())
    finally:
        producer.close()


def test_checksum_mismatch_is_a_verdict_not_a_frame():
    producer = ShmRingProducer("sum", (16, 16, 3), slot_count=2)
    reader = ShmRingReader(producer.description(), checksum_every=1)
    try:
        message = producer.write(np.zeros((16, 16, 3), np.uint8), 0, 0.0)
        producer._slots[message.slot, 0] = 7  # corrupted after publish, generation intact
        read = reader.read(message)
        assert read.verdict is Verdict.CHECKSUM_MISMATCH and read.tensor is None
    finally:
        reader.close()
        producer.close()


def test_sparse_checksum_sees_shifts_and_agrees_between_numpy_and_torch():
    import torch

    frame = np.random.default_rng(1).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    flat = frame.reshape(-1)
    assert frames.sparse_checksum(frame) == frames.checksum_tensor(torch.from_numpy(frame),
                                                                   "sampled")
    # The fast form (Note [Sparse checksum]) is still the defined sum of (byte + 1) * weight.
    plan = frames.sample_plan(flat.size)
    defined = int(((flat[plan.positions].astype(np.int64) + 1) * plan.weights).sum())
    assert frames.sparse_checksum(frame) == defined
    pending = frames.sparse_checksum_start(torch.from_numpy(frame))
    assert frames.settle_checksums([pending]) == [defined]
    assert frames.sparse_checksum(frame[:, ::2]) == frames.sparse_checksum(frame[:, ::2].copy())
    shifted = np.roll(flat, 4096)  # what a mapping at the wrong offset would read
    assert frames.sparse_checksum(shifted) != frames.sparse_checksum(flat)
    assert frames.sparse_checksum(np.zeros_like(flat)) != 0


# --- staged writes (Note [Staged writes]) and batched reads (Note [One sync per batch]) ----------


def test_staged_write_is_made_in_private_memory_and_round_trips():
    """Note [Staged writes], Note [Checksum of what the camera gave]: the view is the producer's
    own memory, so nothing another process writes into the slot meanwhile is certified."""
    shape = (48, 64, 3)
    producer = ShmRingProducer("stg", shape, slot_count=2)
    reader = ShmRingReader(producer.description(), checksum_every=1)
    rng = np.random.default_rng(7)
    try:
        older = producer.write(rng.integers(0, 256, shape, dtype=np.uint8), 0, 0.0)
        producer.write(rng.integers(0, 256, shape, dtype=np.uint8), 1, 0.0)
        view = producer.staging_view()  # slot 0 again: the one `older` is in
        assert view.shape == shape and view.dtype == np.uint8 and view.flags.writeable
        assert not np.shares_memory(view, producer._slots)  # private, not what consumers map
        assert producer.staging_view() is view  # asked again before publishing: the same one
        frame = rng.integers(0, 256, shape, dtype=np.uint8)
        view[...] = frame
        # Until the commit the slot still holds the older frame, and it can still be read.
        assert reader.read(older).ok
        producer._slots[older.slot, :7] = 0  # a foreign write into the slot before the commit
        message = producer.publish_staged(2, 1.5)
        assert message.slot == older.slot and message.frame_seq == 2
        assert reader.read(older).verdict is Verdict.OVERWRITTEN
        assert message.checksum == frames.checksum(frame)  # the default: full
        read = reader.read(message)
        assert read.ok
        np.testing.assert_array_equal(read.tensor.numpy(), frame)
        view[...] = 0  # the slot changes: the reader's tensor was its own copy
        np.testing.assert_array_equal(read.tensor.numpy(), frame)
        with pytest.raises(RuntimeError, match="nothing staged"):
            producer.publish_staged(3, 2.0)
    finally:
        reader.close()
        producer.close()


def test_read_batch_judges_every_frame_on_its_own():
    shape = (16, 24, 3)
    producers = [ShmRingProducer(f"b{i}", shape, slot_count=2) for i in range(3)]
    readers = [ShmRingReader(p.description(), checksum_every=1) for p in producers]
    try:
        deck = [np.full(shape, 10 * i + 1, np.uint8) for i in range(3)]
        messages = [p.write(f, 0, 0.0) for p, f in zip(producers, deck)]
        producers[1]._slots[messages[1].slot, 5] ^= 0xFF  # corrupted after publish
        stale = producers[2].write(deck[2], 1, 0.0)
        producers[2].write(deck[2], 2, 0.0)
        producers[2].write(deck[2], 3, 0.0)  # slot of `stale` reused
        reads = read_batch([(readers[0], messages[0]), (readers[1], messages[1]),
                            (readers[2], stale)])
        assert [r.verdict for r in reads] == [Verdict.OK, Verdict.CHECKSUM_MISMATCH,
                                              Verdict.OVERWRITTEN]
        np.testing.assert_array_equal(reads[0].tensor.numpy(), deck[0])
        assert reads[1].tensor is None and reads[2].tensor is None
        assert [r.counts[Verdict.OK] for r in readers] == [1, 0, 0]
        assert reads[0].ok and not reads[1].ok
    finally:
        for reader in readers:
            reader.close()
        for producer in producers:
            producer.close()


def test_publisher_staged_api(runtime_dir):
    from facecast.shared.transport.publisher import FramePublisher

    shape = (24, 32, 3)
    rng = np.random.default_rng(11)
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", slot_count=4, transport="shm")
        try:
            with pytest.raises(RuntimeError, match="without staging_view"):
                publisher.publish_staged(0.0)
            frame = rng.integers(0, 256, shape, dtype=np.uint8)
            publisher.staging_view(shape)[...] = frame
            staged = publisher.publish_staged(1.0)
            copied = publisher.publish(frame, 2.0)  # both ways mix; sequence numbers go on
            assert (staged.frame_seq, copied.frame_seq) == (0, 1)
            reader = ShmRingReader(publisher.producer.description(), checksum_every=1)
            try:
                for message in (staged, copied):
                    read = reader.read(message)
                    assert read.ok
                    np.testing.assert_array_equal(read.tensor.numpy(), frame)
                publisher.corrupt_next_frame()  # fault injection reaches staged frames too
                publisher.staging_view(shape)[...] = frame
                assert reader.read(publisher.publish_staged(3.0)).verdict is Verdict.CHECKSUM_MISMATCH
            finally:
                reader.close()
            epoch = publisher.producer.ring_epoch
            publisher.staging_view((12, 16, 3))  # another resolution: a new ring
            assert publisher.producer.ring_epoch != epoch
            assert publisher.publish_staged(4.0).shape == (12, 16, 3)
        finally:
            publisher.close()


def run_staged_producer(runtime_dir: str, transport: str, shape, frames_total: int, fps: float,
                        results) -> None:
    """A capture process whose source makes each frame in the ring (Note [Staged writes]),
    from the same deck as tests/peers.py's producer, so peers' consumer checks every byte."""
    from facecast.shared.transport.publisher import FramePublisher

    deck = make_deck(0, shape)
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", transport=transport)
        try:
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:  # let the subscriber connect before frame 0
                publisher.serve_control()
                time.sleep(0.005)
            next_monotonic = time.monotonic()
            for _ in range(frames_total):
                view = publisher.staging_view(shape)
                np.copyto(view, deck[publisher.frame_seq % DECK_SIZE])
                publisher.publish_staged(time.monotonic())
                next_monotonic += 1.0 / fps
                while (pause := next_monotonic - time.monotonic()) > 0:
                    publisher.serve_control()
                    time.sleep(min(pause, 0.002))
            results.put(publisher.status.transport)
            linger_deadline = time.monotonic() + 0.5
            while time.monotonic() < linger_deadline:
                publisher.serve_control()
                time.sleep(0.01)
        finally:
            publisher.close()


def staged_round_trip(peers, transport: str, shape, frames_total: int, fps: float,
                      device: str = "host") -> tuple[str, dict]:
    spawn = multiprocessing.get_context("spawn")  # never fork (DESIGN §1)
    results = spawn.Queue()
    consumer = peers.start("consumer", shape=",".join(map(str, shape)), device=device,
                           until_seq=frames_total - 1, timeout_s=120)
    producer = spawn.Process(target=run_staged_producer,
                             args=(peers.runtime_dir, transport, shape, frames_total, fps, results))
    producer.start()
    seen = Peers.result(consumer, timeout_s=150)
    producer.join(timeout=30)
    assert producer.exitcode == 0, producer.exitcode
    return results.get(timeout=5), seen


@pytest.mark.timing  # Note [Tests side by side]
def test_staged_frames_cross_processes_byte_exact(peers):
    used, seen = staged_round_trip(peers, "shm", (120, 160, 3), 400, SHARE_BOUND_FPS)
    assert used == "shm"
    assert seen["mismatched"] == 0 and seen["last_seq"] == 399, seen
    assert seen["counts"].get("checksum_mismatch", 0) == 0, seen
    assert seen["received"] >= 100, seen  # every one compared byte for byte (liveness bound)


def test_one_receive_reads_the_newest_frame_of_every_camera(runtime_dir):
    from facecast.shared.transport.publisher import FramePublisher
    from facecast.shared.transport.subscriber import FrameSubscriber

    shape = (8, 8, 3)
    cameras = ["cam0", "cam1", "cam2"]
    with zmq.Context() as context:
        publishers = [FramePublisher(context, runtime_dir, c, slot_count=8, transport="shm")
                      for c in cameras]
        subscriber = FrameSubscriber(context, runtime_dir, cameras, checksum_every=1)
        try:
            deadline = time.monotonic() + 10
            while len(subscriber.readers) < 3 and time.monotonic() < deadline:
                # The first frame creates the ring; later ones make a late subscriber ask for it.
                for publisher in publishers:
                    publisher.publish(np.zeros(shape, np.uint8), 0.0)
                subscriber.receive(timeout_ms=50)
            assert len(subscriber.readers) == 3, subscriber.status
            for value in (1, 2, 3):
                for index, publisher in enumerate(publishers):
                    publisher.publish(np.full(shape, 10 * index + value, np.uint8), float(value))
            time.sleep(0.2)  # all nine messages queued
            received = subscriber.receive(timeout_ms=1000)
            assert sorted(f.message.camera_id for f in received) == cameras
            for frame in received:
                index = cameras.index(frame.message.camera_id)
                assert int(frame.tensor[0, 0, 0]) == 10 * index + 3  # the newest of each
                assert subscriber.status[frame.message.camera_id].counts["skipped"] >= 2
        finally:
            subscriber.close()
            for publisher in publishers:
                publisher.close()


def test_receive_reads_only_wanted_cameras_and_counts_no_skip_for_the_rest(runtime_dir):
    """The detection worker reads a camera's frame only when a pass is due (receive(wanted=));
    the frames it passes over are neither read (no verdict) nor counted as skipped."""
    from facecast.shared.transport.publisher import FramePublisher
    from facecast.shared.transport.subscriber import FrameSubscriber

    shape = (8, 8, 3)
    cameras = ["cam0", "cam1"]
    with zmq.Context() as context:
        publishers = {c: FramePublisher(context, runtime_dir, c, slot_count=8, transport="shm")
                      for c in cameras}
        subscriber = FrameSubscriber(context, runtime_dir, cameras, checksum_every=1)
        try:
            deadline = time.monotonic() + 10
            while len(subscriber.readers) < 2 and time.monotonic() < deadline:
                for publisher in publishers.values():
                    publisher.publish(np.zeros(shape, np.uint8), 0.0)
                subscriber.receive(timeout_ms=50)
            assert len(subscriber.readers) == 2, subscriber.status
            # The attach loop's last frames may still be on their way (a busy machine): read
            # them before counting, or the first wanted frame counts one of them as skipped.
            while subscriber.receive(timeout_ms=500):
                pass
            ok_before = {c: subscriber.status[c].counts["ok"] for c in cameras}
            skipped_before = {c: subscriber.status[c].counts["skipped"] for c in cameras}
            wanted_now = {"cam1"}
            got = []
            for value in range(1, 6):  # one frame per receive: nothing is older than the newest
                for publisher in publishers.values():
                    publisher.publish(np.full(shape, value, np.uint8), float(value))
                time.sleep(0.05)
                got += subscriber.receive(timeout_ms=1000, wanted=wanted_now.__contains__)
            assert [f.message.camera_id for f in got] == ["cam1"] * 5
            assert [int(f.tensor[0, 0, 0]) for f in got] == [1, 2, 3, 4, 5]
            assert subscriber.status["cam0"].counts["ok"] == ok_before["cam0"]  # never read
            assert subscriber.status["cam1"].counts["ok"] == ok_before["cam1"] + 5
            assert {c: subscriber.status[c].counts["skipped"] for c in cameras} == skipped_before
            # Wanted again: the next frame is read at once, from the ring it stayed attached to.
            publishers["cam0"].publish(np.full(shape, 9, np.uint8), 9.0)
            time.sleep(0.05)
            [frame] = subscriber.receive(timeout_ms=1000)
            assert frame.message.camera_id == "cam0" and int(frame.tensor[0, 0, 0]) == 9
            assert subscriber.status["cam0"].counts["skipped"] == skipped_before["cam0"]
        finally:
            subscriber.close()
            for publisher in publishers.values():
                publisher.close()


def test_every_frame_host_only_reads_each_frame_in_order_as_numpy(runtime_dir):
    """The recorder's way (issue 20: one ring reader): every frame, in order, host only (numpy,
    no torch); a corrupted frame is a mismatch verdict and a frame_mismatch event."""
    from facecast.shared.transport.publisher import FramePublisher
    from facecast.shared.transport.subscriber import FrameSubscriber

    shape = (8, 8, 3)
    events = []
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", slot_count=8, transport="shm")
        subscriber = FrameSubscriber(context, runtime_dir, ["cam0"], device=None, checksum_every=1,
                                     on_event=lambda kind, **fields: events.append((kind, fields)),
                                     every_frame=True)
        poller = zmq.Poller()
        subscriber.register(poller)
        try:
            assert subscriber.device is None
            publisher.publish(np.zeros(shape, np.uint8), 0.0)  # creates the ring
            subscriber.request_description("cam0")
            deadline = time.monotonic() + 10
            while "cam0" not in subscriber.readers and time.monotonic() < deadline:
                publisher.serve_control()
                list(subscriber.every_frame(poller.poll(50)))
            assert "cam0" in subscriber.readers, subscriber.status
            # ZeroMQ's late joiner: the frames' subscription may be live only after the ring's
            # description came (a frame lost so on a loaded 2-core machine, 2026-11-28). Frames
            # of zeros at time 0 until one arrives; the numbered frames come after it.
            deadline = time.monotonic() + 10
            live = False
            while not live and time.monotonic() < deadline:
                publisher.publish(np.zeros(shape, np.uint8), 0.0)
                live = bool(list(subscriber.every_frame(poller.poll(50))))
            assert live, subscriber.status
            for value in range(1, 6):
                if value == 4:
                    publisher.corrupt_next_frame()
                publisher.publish(np.full(shape, value, np.uint8), float(value))
            got, verdicts = [], []
            deadline = time.monotonic() + 10
            while len(verdicts) < 5 and time.monotonic() < deadline:
                for message in subscriber.every_frame(poller.poll(100)):
                    if message.capture_ts_lsl == 0.0:
                        continue  # the ring's first frame and the zeros', passed over
                    assert subscriber.attached(message)
                    read = subscriber.read(message)
                    verdicts.append(read.verdict.value)
                    if read.ok:
                        assert isinstance(read.tensor, np.ndarray)
                        got.append(int(read.tensor[0, 0, 0]))
            assert verdicts == ["ok", "ok", "ok", "checksum_mismatch", "ok"], verdicts
            assert got == [1, 2, 3, 5]
            assert [kind for kind, _ in events] == ["frame_mismatch"], events
        finally:
            subscriber.close()
            publisher.close()


def test_slot_overwritten_during_the_copy_is_dropped():
    shape = (32, 32, 3)
    # A sampled ring checked 1 in 30: no checksum this frame, only the generation catches it.
    producer = ShmRingProducer("race", shape, slot_count=2, checksum_kind="sampled")
    reader = ShmRingReader(producer.description(), checksum_every=30)
    try:
        message = producer.write(np.ones(shape, np.uint8), 0, 0.0)
        copy_slot = reader._slot_tensor

        def overwritten_during_the_copy(message, read, into):
            tensor = copy_slot(message, read, into)
            producer.header.begin_write(message.slot)  # the producer reuses the slot meanwhile
            return tensor

        reader._slot_tensor = overwritten_during_the_copy
        read = reader.read(message)
        assert read.verdict is Verdict.OVERWRITTEN and read.tensor is None
    finally:
        reader.close()
        producer.close()


def test_cuda_ipc_files_of_dead_processes_are_swept_and_live_ones_kept():
    """The CUDA driver's /dev/shm/cuda.shm.* files of a SIGKILLed worker stay behind; the
    supervisor's shutdown removes those of dead processes only."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_file = shm.SHM_DIR / f"cuda.shm.0.{dead.pid:x}.1"
    live_file = shm.SHM_DIR / f"cuda.shm.0.{os.getpid():x}.1"
    dead_file.write_bytes(b"x")
    live_file.write_bytes(b"x")
    try:
        removed = shm.sweep_dead_cuda_ipc_files()
        assert dead_file.name in removed and not dead_file.exists()
        assert live_file.exists() and live_file.name not in removed
    finally:
        dead_file.unlink(missing_ok=True)
        live_file.unlink(missing_ok=True)


def test_a_batch_gives_each_device_copy_its_slice_of_one_buffer_in_order():
    """Note [A batch's frames in one buffer]: the readers that copy to a device share one
    buffer per device, each its frame's bytes, back to back in the order of the requests; a
    reader that copies on the host gets none."""
    import torch

    from facecast.shared.transport.rings import _batch_buffers

    class Reader:  # what _batch_buffers asks of a reader
        def __init__(self, device, frame_bytes):
            self.copy_device, self.frame_bytes = device, frame_bytes

    cpu = torch.device("cpu")
    requests = [(Reader(cpu, 6), None), (Reader(None, 5), None), (Reader(cpu, 4), None)]
    first, host, last = _batch_buffers(requests)
    assert host is None and (first.numel(), last.numel()) == (6, 4)
    assert first.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
    assert last.data_ptr() - first.data_ptr() == 6
    assert _batch_buffers([(Reader(None, 5), None)]) == [None]


def test_frames_back_to_back_in_a_batch_buffer_are_checksummed_together():
    """Note [Frames of a batch checksummed together]: the due full checksums of consecutive
    rows of one size in whole words are one computation; every other frame (another size, a
    size not in words, the sampled kind, a host copy, rows not at a word's address, a run with
    one frame due) is checksummed alone, and every frame gets its own value."""
    import torch

    from facecast.shared.transport.rings import (SlotRead, Verdict, _batch_buffers,
                                                 start_checksums)

    class Reader:  # what _batch_buffers and start_checksums ask of a reader
        def __init__(self, device, frame_bytes, kind="full"):
            self.copy_device, self.frame_bytes, self.checksum_kind = device, frame_bytes, kind
            self.alone = 0

        def _checksum_start(self, message, read):
            self.alone += 1
            return frames.checksum_start(read.tensor, self.checksum_kind)

    cpu = torch.device("cpu")
    readers = [Reader(cpu, 16), Reader(cpu, 16), Reader(cpu, 16),  # a run of three
               Reader(cpu, 24), Reader(cpu, 24),  # another size: a run of its own
               Reader(cpu, 24, "sampled"), Reader(cpu, 12),  # alone
               Reader(None, 16),  # copied on the host: alone
               Reader(cpu, 16), Reader(cpu, 16),  # at byte 132 of the buffer: alone
               Reader(cpu, 12),  # alone; the next at byte 176
               Reader(cpu, 16), Reader(cpu, 16)]  # a run with one frame due: alone
    due = [True, False, True, True, True, True, True, True, True, True, True, False, True]
    buffers = _batch_buffers([(reader, None) for reader in readers])
    rng = np.random.default_rng(12)
    reads = []
    for reader, into, is_due in zip(readers, buffers, due):
        pixels = rng.integers(0, 256, reader.frame_bytes, dtype=np.uint8)
        read = SlotRead(Verdict.OK, torch.from_numpy(pixels) if into is None else into, reader)
        read.tensor.copy_(torch.from_numpy(pixels))
        read._checksum_due = is_due
        reads.append(read)
    start_checksums(reads, buffers)

    assert [read._checksum is not None for read in reads] == due
    assert [reader.alone for reader in readers] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1]
    assert buffers[8].storage_offset() == 132 and buffers[11].storage_offset() == 176
    together = [reads[0]._checksum, reads[2]._checksum, reads[3]._checksum, reads[4]._checksum]
    assert [item.row for item in together] == [0, 2, 0, 1]
    assert together[0].device_value is together[1].device_value
    checked = [read for read in reads if read._checksum is not None]
    assert frames.settle_checksums([read._checksum for read in checked]) == [
        frames.checksum(read.tensor.numpy(), read._reader.checksum_kind) for read in checked]
