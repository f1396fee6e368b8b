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

from facecast.shared import frames, shm
from peers import Peers
from facecast.shared.rings import (
    ShmRingProducer,
    ShmRingReader,
    TransportUnavailable,
    Verdict,
)





def own_segments(pid: int) -> list[str]:
    return [name for name in shm.list_segments() if name.startswith(f"facecast-{pid}-")]


def test_round_trip_1000_random_frames_to_4_consumer_processes(peers):
    shape = "240,320,3"
    consumers = [peers.start("consumer", shape=shape, until_seq=999) for _ in range(4)]
    producer = peers.start("producer", shape=shape, frames=1000, fps=100, transport="shm")
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


def test_producer_restart_gives_new_epoch_and_consumer_reattaches(peers):
    shape = "96,128,3"
    consumer = peers.start("consumer", shape=shape, timeout_s=20, until_seq=10**9)
    first = peers.start("producer", shape=shape, frames=100000, fps=100, transport="shm")
    time.sleep(2.0)
    first.send_signal(signal.SIGKILL)
    first.wait()
    removed = shm.sweep_dead_owners()
    assert removed and own_segments(first.pid) == []
    second = peers.start("producer", shape=shape, frames=300, fps=100, transport="shm")
    Peers.result(second)
    consumer.send_signal(signal.SIGTERM) if consumer.poll() is None else None
    seen = Peers.result(consumer)
    assert len(seen["epochs"]) == 2, seen  # attached to the first ring, then to the new one
    assert seen["epochs"][0] != seen["epochs"][1]
    assert seen["mismatched"] == 0 and seen["received"] > 100, seen


def test_consumer_killed_leaves_producer_and_other_consumers_running(peers):
    shape = "96,128,3"
    victim = peers.start("consumer", shape=shape, until_seq=599)
    survivor = peers.start("consumer", shape=shape, until_seq=599)
    producer = peers.start("producer", shape=shape, frames=600, fps=100, transport="shm")
    time.sleep(2.0)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    started = time.monotonic()
    assert Peers.result(producer)["published"] == 600
    # 600 frames at 100 fps: the producer never waited for the dead consumer.
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
        assert shm.sweep_dead_owners() == [] or all(
            not name.startswith(f"facecast-{os.getpid()}-") for name in shm.sweep_dead_owners()
        )
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
    assert frames.sparse_checksum(frame) == frames.sparse_checksum_tensor(torch.from_numpy(frame))
    shifted = np.roll(flat, 4096)  # what a mapping at the wrong offset would read
    assert frames.sparse_checksum(shifted) != frames.sparse_checksum(flat)
    assert frames.sparse_checksum(np.zeros_like(flat)) != 0
