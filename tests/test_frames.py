"""The frame checksum (Note [Frame checksum]): host and torch agree, every
byte counts, and a third process that changes a published shm slot never gets its frame accepted.

The GPU side of the same guarantees (the CUDA kernels' values, a third process writing through a
ring's CUDA IPC handle) is in tests/test_cuda_rules.py, which reuses `tamper_after_publish`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from facecast.shared import config as config_mod
from facecast.shared.transport import frames, messages
from facecast.shared.transport.rings import ShmRingProducer, ShmRingReader, Verdict
from peers import PATCH_SIDE, Peers

FRAME_1080P = (1080, 1920, 3)
MASK_64 = (1 << 64) - 1


def defined_checksum(flat: np.ndarray) -> int:
    """Note [Frame checksum]'s formula, word by word in Python integers: the reference that the
    fast forms must equal."""
    plan = frames.checksum_plan(flat.size)
    words = flat[: plan.word_count * 8].view("<u8")
    total = 0
    for p in range(plan.word_count):
        total += (int(plan.row_weights[p // frames.WORDS_PER_ROW])
                  * int(plan.column_weights[p % frames.WORDS_PER_ROW]) * int(words[p]))
    for t, byte in enumerate(flat[plan.word_count * 8:]):
        total += int(plan.tail_weights[t]) * int(byte)
    return total & MASK_64


def torch_value(array: np.ndarray, kind: str = "full") -> int:
    """The torch formulation (what a GPU runs), here on the CPU."""
    return frames.settle_checksums([frames.checksum_start(torch.from_numpy(array), kind)])[0]


@pytest.fixture(scope="module")
def frame_1080p() -> np.ndarray:
    return np.random.default_rng(1080).integers(0, 256, FRAME_1080P, dtype=np.uint8)


# --- host and torch compute the same, defined value -----------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 7, 8, 9, 8191, 8192, 8200, 3 * 8192 + 5, 61 * 67 * 3])
def test_host_and_torch_agree_with_the_definition_on_odd_sizes(nbytes):
    flat = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    expected = defined_checksum(flat)
    assert frames.full_checksum(flat) == expected
    assert torch_value(flat) == expected
    assert frames.checksum_tensor(torch.from_numpy(flat)) == expected


def test_host_and_torch_agree_on_random_frames_of_odd_shapes():
    rng = np.random.default_rng(2)
    for shape in [(1, 1, 3), (5, 7, 3), (33, 47, 3), (359, 641, 3), (721, 1279, 3), FRAME_1080P]:
        frame = rng.integers(0, 256, shape, dtype=np.uint8)
        value = frames.checksum(frame)
        assert 0 <= value <= MASK_64
        assert torch_value(frame) == value, shape
        # The same bytes through a non-contiguous view, and at an address that is no word's start.
        assert frames.checksum(np.ascontiguousarray(frame[:, ::-1])) == frames.checksum(
            frame[:, ::-1])
        unaligned = np.empty(frame.nbytes + 1, np.uint8)[1:]
        unaligned[...] = frame.reshape(-1)
        assert frames.checksum(unaligned) == value
        assert frames.settle_checksums(
            [frames.checksum_start(torch.from_numpy(unaligned))]) == [value]


@pytest.mark.parametrize("nbytes", [7, 8200, 61 * 67 * 3])
def test_a_checksum_in_scratch_memory_is_the_same_value(nbytes):
    """The CUDA producer computes its private copy's checksum in place (Note [Producer
    checksum]): the same value, and only a `scratch` frame's memory is written."""
    flat = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    kept, scratch = torch.from_numpy(flat.copy()), torch.from_numpy(flat.copy())
    assert frames.settle_checksums([frames.checksum_start(kept)]) == [defined_checksum(flat)]
    assert frames.settle_checksums([frames.checksum_start(scratch, scratch=True)]) == [
        defined_checksum(flat)]
    assert np.array_equal(kept.numpy(), flat)
    assert nbytes < 8 or not np.array_equal(scratch.numpy(), flat)  # written: it was scratch


def test_the_weights_are_odd_so_every_word_and_tail_byte_has_an_invertible_weight():
    plan = frames.checksum_plan(FRAME_1080P[0] * FRAME_1080P[1] * 3 + 5)
    for weights in (plan.row_weights, plan.column_weights, plan.tail_weights):
        assert weights.size and bool(np.all(weights & np.uint64(1)))
    assert plan.tail_weights.size == 5 and plan.short_row_words  # both edge cases present


def test_one_sync_settles_both_kinds_of_a_batch():
    rng = np.random.default_rng(3)
    batch = [rng.integers(0, 256, size, dtype=np.uint8) for size in (100, 5000, 70001)]
    pending = [frames.checksum_start(torch.from_numpy(f), kind)
               for f in batch for kind in frames.CHECKSUM_KINDS]
    expected = [frames.checksum(f, kind) for f in batch for kind in frames.CHECKSUM_KINDS]
    assert frames.settle_checksums(pending) == expected
    with pytest.raises(ValueError, match="not one of full, sampled"):
        frames.checksum(batch[0], "sparse")


def test_the_frames_of_a_batch_checksummed_together_have_each_frame_s_value(monkeypatch):
    """Note [Frames of a batch checksummed together]: rows of one buffer, in chunks, give each
    row the value of its frame alone, and settle with 0-d values of other frames in one fetch."""
    rng = np.random.default_rng(6)
    original = rng.integers(0, 256, (7, 8200), dtype=np.uint8)
    rows = torch.from_numpy(original.copy())
    expected = [defined_checksum(row) for row in original]
    monkeypatch.setattr(frames, "CHUNK_BYTES", 3 * 8200)  # chunks of 3, 3 and 1 rows
    pending = frames.full_checksums_start(rows)
    assert len({id(item.device_value) for item in pending}) == 1
    assert [item.row for item in pending] == list(range(7))
    other = rng.integers(0, 256, 101, dtype=np.uint8)
    second = frames.full_checksums_start(rows[:2].clone())
    mixed = [pending[5], frames.checksum_start(torch.from_numpy(other)), second[1], pending[0]]
    assert frames.settle_checksums(mixed) == [expected[5], defined_checksum(other), expected[1],
                                              expected[0]]
    assert frames.settle_checksums(pending) == expected
    assert np.array_equal(rows.numpy(), original)  # only read
    with pytest.raises(ValueError, match="whole words"):
        frames.full_checksums_start(rows[:, :8199].contiguous())
    with pytest.raises(ValueError, match="whole words"):
        frames.full_checksums_start(rows.reshape(-1)[1:8 * 2 + 1].reshape(2, 8))


# --- what changes the value -----------------------------------------------------------------------


def test_one_changed_byte_anywhere_changes_the_value(frame_1080p):
    """Note [Frame checksum]'s proof, tried: first, last, every offset within a word (the top
    bit of each, the hardest case for sums mod 2**64), many random positions, the tail."""
    odd = np.random.default_rng(4).integers(0, 256, frame_1080p.nbytes + 5, dtype=np.uint8)
    rng = np.random.default_rng(5)
    for flat in (frame_1080p.reshape(-1).copy(), odd):
        original = frames.checksum(flat)
        positions = [0, 1, flat.size - 1, flat.size - 2, *range(8 * 1000, 8 * 1000 + 8),
                     *rng.integers(0, flat.size, 300)]
        for position in positions:
            for change in (0x80, int(rng.integers(1, 256))):  # XOR: the byte always differs
                flat[position] ^= change
                assert frames.checksum(flat) != original, (flat.size, position, change)
                flat[position] ^= change
        assert frames.checksum(flat) == original  # every change undone: the same value again
    torch_frame = torch.from_numpy(frame_1080p.reshape(-1).copy())
    original = frames.checksum_tensor(torch_frame)
    for position in (0, torch_frame.numel() - 1, 12345):  # the torch form too
        torch_frame[position] ^= 1
        assert torch_value(torch_frame.numpy()) != original
        torch_frame[position] ^= 1


def test_a_changed_16x16_patch_changes_the_value(frame_1080p):
    original = frames.checksum(frame_1080p)
    rng = np.random.default_rng(6)
    corners = [(0, 0), (1064, 1904), *zip(rng.integers(0, 1064, 20), rng.integers(0, 1904, 20))]
    for row, column in corners:
        patched = frame_1080p.copy()
        patch = patched[row:row + PATCH_SIDE, column:column + PATCH_SIDE]
        for new in (255 - patch, np.zeros_like(patch),
                    rng.integers(0, 256, patch.shape, dtype=np.uint8)):
            patch[...] = new
            assert frames.checksum(patched) != original, (row, column)


def test_swapped_blocks_change_the_value(frame_1080p):
    """Every position has its own weight: blocks that trade places are seen, including whole
    8 KiB rows of the checksum's layout (a per-column sum alone would not see those)."""
    original = frames.checksum(frame_1080p)
    row_bytes = frames.WORDS_PER_ROW * frames.WORD_BYTES

    def swapped(first: slice, second: slice) -> np.ndarray:
        flat = frame_1080p.reshape(-1).copy()
        flat[first], flat[second] = flat[second].copy(), flat[first].copy()
        return flat

    cases = [
        (slice(0, row_bytes), slice(5 * row_bytes, 6 * row_bytes)),  # two layout rows
        (slice(0, 8), slice(8, 16)),  # two neighbouring words
        (slice(0, 5760), slice(5760, 2 * 5760)),  # two image rows
        (slice(0, frame_1080p.nbytes // 2), slice(frame_1080p.nbytes // 2, None)),  # halves
    ]
    for first, second in cases:
        assert frames.checksum(swapped(first, second)) != original, (first, second)
    patches = frame_1080p.copy()
    a, b = patches[0:16, 0:16].copy(), patches[500:516, 800:816].copy()
    patches[0:16, 0:16], patches[500:516, 800:816] = b, a
    assert frames.checksum(patches) != original


def test_stale_unwritten_and_shifted_frames_change_the_value(frame_1080p):
    original = frames.checksum(frame_1080p)
    stale = np.random.default_rng(7).integers(0, 256, FRAME_1080P, dtype=np.uint8)
    assert frames.checksum(stale) != original
    assert frames.checksum(np.zeros_like(frame_1080p)) != original  # an unwritten slot
    flat = frame_1080p.reshape(-1)
    for shift in (1, 3, 8, 4096, 8192, 5760):
        assert frames.checksum(np.roll(flat, shift)) != original, shift
    # A read at the wrong offset into a ring: the frame's bytes, then the next slot's.
    ring = np.concatenate([flat, stale.reshape(-1)])
    for offset in (8, 4096, 2 * 1024 * 1024):
        assert frames.checksum(ring[offset:offset + flat.size]) != original, offset


def test_the_sampled_kind_misses_a_byte_between_its_samples(frame_1080p):
    """Why "full" is the default: the broken variant, shown to pass a changed byte."""
    flat = frame_1080p.reshape(-1).copy()
    sampled_before, full_before = frames.checksum(flat, "sampled"), frames.checksum(flat)
    positions = set(frames.sample_plan(flat.size).positions.tolist())
    unsampled = next(p for p in range(1, flat.size) if p not in positions)
    flat[unsampled] ^= 0xFF
    assert frames.checksum(flat, "sampled") == sampled_before  # passes, wrong
    assert frames.checksum(flat) != full_before  # caught


def test_config_key_daemon_checksum_is_validated_strictly():
    camera = '[[cameras]]\nid = "a"\nsource = "synthetic"\n'
    assert config_mod.loads(camera).daemon.checksum == "full"  # the default
    sampled = config_mod.loads('[daemon]\nchecksum = "sampled"\n' + camera)
    assert sampled.daemon.checksum == "sampled"
    with pytest.raises(config_mod.ConfigError, match=r"daemon\.checksum: .*'full', 'sampled'"):
        config_mod.loads('[daemon]\nchecksum = "sparse"\n' + camera)


# --- rings: every frame checked at the default ----------------------------------------------------


def test_a_shm_ring_at_the_default_checks_every_frame_in_full():
    shape = (48, 64, 3)
    producer = ShmRingProducer("full", shape, slot_count=3)  # the defaults: full, 1 in 30 ignored
    reader = ShmRingReader(producer.description())
    try:
        assert producer.description().checksum_kind == "full" and reader.checksum_every == 30
        frame = np.random.default_rng(8).integers(0, 256, shape, dtype=np.uint8)
        for seq in range(4):
            message = producer.write(frame, seq, 0.0)
            assert message.checksum == frames.checksum(frame)
            if seq == 3:
                producer._slots[message.slot, 1234] ^= 1  # one byte, after publishing
            verdict = reader.read(message).verdict
            assert verdict is (Verdict.CHECKSUM_MISMATCH if seq == 3 else Verdict.OK), seq
    finally:
        reader.close()
        producer.close()


def tamper_after_publish(runtime_dir: str, transport: str, device: str, change: str,
                         position: int, checksum_kind: str = "full", checksum_every: int = 30,
                         shape: tuple[int, ...] = (120, 160, 3)) -> dict:
    """Publish frames to a FrameSubscriber at the given settings; after one of them is published,
    a third process (tests/peers.py tamper) changes its slot through the ring's shm name or CUDA
    IPC handle; only then does the subscriber receive. What happened to that frame and after."""
    from facecast.shared.transport.publisher import FramePublisher
    from facecast.shared.transport.subscriber import FrameSubscriber

    rng = np.random.default_rng(position)
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", slot_count=4, transport=transport,
                                   checksum_kind=checksum_kind)
        subscriber = FrameSubscriber(context, runtime_dir, ["cam0"], device=device,
                                     checksum_every=checksum_every)
        status = subscriber.status["cam0"]

        def verdicts() -> int:
            return sum(status.counts[v.value] for v in Verdict)

        def read_one(frame_seq: int) -> list:
            """Receive until the subscriber has judged one more frame; those handed out."""
            before, handed_out = verdicts(), []
            deadline = time.monotonic() + 30
            while verdicts() == before and time.monotonic() < deadline:
                publisher.serve_control()
                handed_out += [f for f in subscriber.receive(timeout_ms=50)
                               if f.message.frame_seq == frame_seq]
            assert verdicts() == before + 1, status
            return handed_out

        try:
            deadline = time.monotonic() + 30
            while "cam0" not in subscriber.readers and time.monotonic() < deadline:
                publisher.publish(np.zeros(shape, np.uint8), 0.0)  # first: makes the ring
                subscriber.receive(timeout_ms=50)
            assert "cam0" in subscriber.readers, status
            ring_transport = publisher.producer.transport
            frame = rng.integers(0, 256, shape, dtype=np.uint8)
            message = publisher.publish(frame, 1.0)
            path = Path(runtime_dir) / "ring.msgpack"
            path.write_bytes(messages.encode(publisher.producer.description()))
            Peers.result(Peers(runtime_dir).start(
                "tamper", description=str(path), slot=message.slot, change=change,
                position=position, seed=position))
            handed_out = read_one(message.frame_seq)
            outcome = {
                "ring_transport": ring_transport,
                "accepted": bool(handed_out),
                "wrong_bytes_handed_out": any(
                    not np.array_equal(f.tensor.cpu().numpy(), frame) for f in handed_out),
                "checksum_mismatch": status.counts[Verdict.CHECKSUM_MISMATCH.value],
            }
            deadline = time.monotonic() + 30
            while (publisher.status.fallbacks == 0 and ring_transport == "cuda_ipc"
                   and time.monotonic() < deadline):
                publisher.serve_control()  # a CUDA ring's fault comes back as a TransportFault
                subscriber.receive(timeout_ms=10)
            clean = publisher.publish(frame, 2.0)  # the camera goes on, on whichever ring
            after = read_one(clean.frame_seq)  # a new ring's description came in band first
            outcome.update(
                transport_after=publisher.producer.transport,
                fallback_reason=publisher.status.fallback_reason,
                reason_after=publisher.status.reason,
                clean_frame_accepted=bool(after) and np.array_equal(after[0].tensor.cpu().numpy(),
                                                                    frame),
            )
            return outcome
        finally:
            subscriber.close()
            publisher.close()


SHM_CASES = [("byte", 0), ("byte", 120 * 160 * 3 - 1), ("byte", 31337), ("patch", 20000),
             ("whole", 0)]


@pytest.mark.parametrize("change, position", SHM_CASES)
def test_a_third_process_changing_a_published_shm_slot_is_never_accepted(runtime_dir, change,
                                                                           position):
    outcome = tamper_after_publish(runtime_dir, "shm", "cpu", change, position)
    assert outcome["ring_transport"] == "shm"
    assert not outcome["accepted"] and outcome["checksum_mismatch"] == 1, outcome
    assert outcome["clean_frame_accepted"], outcome  # the next frame is fine again


def test_with_sampled_checksums_a_third_process_changing_one_byte_gets_through(runtime_dir):
    """The broken variant (the old default), run through the same harness: the tampered frame is
    accepted with wrong bytes, even with every frame checked. The test above can fail."""
    plan = frames.sample_plan(120 * 160 * 3)
    unsampled = next(p for p in range(1, 120 * 160 * 3) if p not in set(plan.positions.tolist()))
    outcome = tamper_after_publish(runtime_dir, "shm", "cpu", "byte", unsampled,
                                   checksum_kind="sampled", checksum_every=1)
    assert outcome["accepted"] and outcome["wrong_bytes_handed_out"], outcome
