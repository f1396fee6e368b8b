"""DESIGN.md §2's seven CUDA IPC rules, each shown to catch its broken variant (Note [CUDA IPC rules]).

Runs on a machine with an NVIDIA GPU, its driver and pycuda (`pip install facecast[gpu]`);
elsewhere every test here is skipped with the reason. Consumers that open IPC handles run in
separate processes (rule 6), started through tests/peers.py.
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq

from facecast.shared.transport import frames, messages
from facecast.shared.transport.cuda_driver import cuda_unavailable_reason
from facecast.shared.transport.ring_errors import TransportUnavailable
from facecast.shared.transport.rings import Verdict, read_batch
from peers import Peers
from test_frames import SHM_CASES, tamper_after_publish
from test_shm_ring import staged_round_trip

_REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"needs CUDA: {_REASON}")]

FRAME_1080P = "1080,1920,3"




def attach_in_fresh_process(description, tmp_path: Path) -> dict:
    path = tmp_path / "ring.msgpack"
    path.write_bytes(messages.encode(description))
    proc = Peers("").start("attach", description=str(path), device="cuda")
    return Peers.result(proc)


def cuda_producer(**faults):
    from facecast.shared.transport.cuda_ring import CudaFaults, CudaRingProducer

    return CudaRingProducer("rules", (64, 96, 3), slot_count=4, faults=CudaFaults(**faults))


# --- rule 1: handles name whole allocations ---------------------------------------------------


def test_rule1_own_allocation_rounded_to_2mib_passes_validation(tmp_path):
    producer = cuda_producer()
    try:
        assert producer.offset_bytes == 0
        assert producer.allocation_bytes % (2 * 1024 * 1024) == 0
        assert attach_in_fresh_process(producer.description(), tmp_path)["ok"]
    finally:
        producer.close()


def test_rule1_torch_tensor_handle_without_offset_fails_validation(tmp_path):
    producer = cuda_producer(ring_inside_torch_tensor=True, omit_offset=True)
    try:
        assert producer.offset_bytes > 0  # the ring is not at its allocation's base
        result = attach_in_fresh_process(producer.description(), tmp_path)
        assert not result["ok"] and "handshake failed" in result["reason"], result
    finally:
        producer.close()


def test_rule1_torch_tensor_handle_with_offset_maps_correctly(tmp_path):
    producer = cuda_producer(ring_inside_torch_tensor=True)
    try:
        assert attach_in_fresh_process(producer.description(), tmp_path)["ok"]
    finally:
        producer.close()


# --- rule 2: export once, open once, cache; a new epoch means new handles ------------------------


def test_rule2_one_open_per_epoch_and_stale_epochs_are_refused(peers):
    consumer = peers.start("consumer", device="cuda", until_seq=299)
    producer = peers.start("producer", frames=300, fps=200, transport="cuda_ipc")
    assert Peers.result(producer)["transport"] == "cuda_ipc"
    seen = Peers.result(consumer)
    assert seen["ipc_opens"] == 1 and seen["transports"] == ["cuda_ipc"], seen
    assert seen["received"] > 100 and seen["mismatched"] == 0, seen

    from facecast.shared.transport.cuda_ring import CudaRingReader

    first, second = cuda_producer(), cuda_producer()
    reader = CudaRingReader(first.description(), checksum_every=1)
    try:
        message = second.write(np.zeros((64, 96, 3), np.uint8), 0, 0.0)
        read = reader.read(message)  # a mapping of epoch A must never serve epoch B
        assert read.verdict is Verdict.STALE_EPOCH and read.tensor is None
    finally:
        reader.close()
        first.close()
        second.close()


# --- rule 3: memory IPC orders nothing; events do -------------------------------------------------


SLOW_COPY_CYCLES = 40_000_000  # ~20 ms of GPU sleep before every copy: publish races the copy


def test_rule3_consumer_that_skips_the_event_wait_is_caught_by_checksums(peers):
    consumer = peers.start("consumer", device="cuda", until_seq=149, skip_event_wait=True)
    producer = peers.start("producer", frames=150, fps=30, transport="cuda_ipc",
                           delay_copy_cycles=SLOW_COPY_CYCLES)
    Peers.result(producer)
    seen = Peers.result(consumer)
    assert seen["counts"].get("checksum_mismatch", 0) >= 1, seen  # the race happened ...
    assert seen["mismatched"] == 0, seen  # ... and no wrong frame got through
    assert seen["transports"][-1] == "shm" and seen["fallbacks"] == 1, seen


def test_rule3_event_wait_orders_the_slow_copy(peers):
    consumer = peers.start("consumer", device="cuda", until_seq=149)
    producer = peers.start("producer", frames=150, fps=30, transport="cuda_ipc",
                           delay_copy_cycles=SLOW_COPY_CYCLES)
    Peers.result(producer)
    seen = Peers.result(consumer)
    assert seen["counts"].get("checksum_mismatch", 0) == 0, seen
    assert seen["transports"] == ["cuda_ipc"] and seen["mismatched"] == 0, seen


# --- rule 4: slots get overwritten ----------------------------------------------------------------


def test_rule4_a_slow_consumer_uses_its_own_copy_while_the_slots_are_overwritten(peers):
    """Note [The consumer's own copy]: the consumer holds each frame 60 ms while the producer
    goes round its 4 slots in 40 ms. A view of the slot would have changed under it (that is what
    this test caught before the copy); its own copy is the frame it checked, every time."""
    consumer = peers.start("consumer", device="cuda", until_seq=199, slow_s=0.06, timeout_s=60)
    producer = peers.start("producer", frames=200, fps=100, slots=4, transport="cuda_ipc")
    Peers.result(producer)
    seen = Peers.result(consumer, timeout_s=90)
    assert seen["received"] > 0 and seen["mismatched"] == 0, seen
    assert seen["transports"] == ["cuda_ipc"], seen


# --- rule 5: one context ------------------------------------------------------------------------


def test_rule5_mapping_in_a_non_primary_context_is_refused():
    from facecast.shared.transport import cuda_driver
    from facecast.shared.transport.cuda_ring import CudaRingReader

    producer = cuda_producer()
    cuda = cuda_driver.driver(0)
    stray = cuda.Device(0).make_context()  # the broken variant: a context of its own
    try:
        with pytest.raises(TransportUnavailable, match="primary context"):
            CudaRingReader(producer.description(), force_ipc_open=True)
    finally:
        stray.pop()
        stray.detach()
        producer.close()


# --- rule 6: no same-process open ---------------------------------------------------------------


def test_rule6_same_process_reader_uses_the_pointer_and_ipc_open_is_refused_cleanly():
    from facecast.shared.transport.cuda_ring import CudaRingReader

    producer = cuda_producer()
    try:
        frame = np.random.default_rng(3).integers(0, 256, (64, 96, 3), dtype=np.uint8)
        message = producer.write(frame, 0, 0.0)
        reader = CudaRingReader(producer.description(), checksum_every=1)
        read = reader.read(message)
        assert read.ok and torch.equal(read.tensor.cpu(), torch.from_numpy(frame))
        reader.close()
        with pytest.raises(TransportUnavailable):
            CudaRingReader(producer.description(), force_ipc_open=True)
    finally:
        producer.close()


# --- rule 7: same device, same driver -----------------------------------------------------------


@pytest.mark.parametrize(
    "tamper, reason",
    [({"device_uuid": "GPU-00000000-0000-0000-0000-000000000000"}, "cannot see"),
     ({"driver_version": 1}, "driver version differs")],
)
def test_rule7_other_device_or_driver_is_refused(tmp_path, tamper, reason):
    producer = cuda_producer()
    try:
        description = producer.description()
        handles = msgspec.structs.replace(description.cuda, **tamper)
        result = attach_in_fresh_process(
            msgspec.structs.replace(description, cuda=handles), tmp_path
        )
        assert not result["ok"] and reason in result["reason"], result
    finally:
        producer.close()


# --- whole-path checks ----------------------------------------------------------------------------


def test_10000_random_1080p_frames_cross_process_with_zero_mismatches(peers):
    consumer = peers.start("consumer", device="cuda", shape=FRAME_1080P, until_seq=9999,
                           timeout_s=300)
    producer = peers.start("producer", shape=FRAME_1080P, frames=10000, fps=400,
                           transport="cuda_ipc")
    assert Peers.result(producer, timeout_s=300)["transport"] == "cuda_ipc"
    seen = Peers.result(consumer, timeout_s=300)
    assert seen["last_seq"] == 9999 and seen["mismatched"] == 0, seen
    assert seen["counts"].get("checksum_mismatch", 0) == 0, seen
    assert seen["received"] >= 5000, seen  # every received frame was compared byte for byte


def test_slot_corrupted_after_publish_falls_back_to_shm_within_one_frame(peers):
    consumer = peers.start("consumer", device="cuda", until_seq=299)
    producer = peers.start("producer", frames=300, fps=100, transport="cuda_ipc", corrupt_at=150)
    produced = Peers.result(producer)
    seen = Peers.result(consumer)
    assert produced["fallbacks"] == 1 and "checksum mismatch" in produced["fallback_reason"], (
        produced, seen)
    assert seen["counts"].get("checksum_mismatch") == 1, seen
    assert seen["transports"] == ["cuda_ipc", "shm"] and seen["mismatched"] == 0, seen
    assert seen["last_seq"] == 299  # frames kept flowing
    # The new ring's description came in band: at most the one frame in flight is lost.
    assert seen["counts"].get("awaiting_ring", 0) <= 1, seen


def test_gpu_memory_returns_to_baseline_after_sigkill(peers):
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def used_bytes() -> int:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used

    baseline = used_bytes()
    consumer = peers.start("consumer", device="cuda", shape=FRAME_1080P, timeout_s=60)
    producer = peers.start("producer", shape=FRAME_1080P, frames=100000, fps=30, slots=16,
                           transport="cuda_ipc")
    time.sleep(5)
    assert used_bytes() > baseline + 16 * 1080 * 1920 * 3  # the ring is really there
    for proc in (producer, consumer):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 15
    while used_bytes() > baseline + 64 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert used_bytes() <= baseline + 64 * 2**20, (baseline, used_bytes())


# --- staged writes (Note [Staged writes]), batched reads (Note [One sync per batch]) ---------------


def test_staged_writes_round_trip_byte_exact_across_processes(peers):
    used, seen = staged_round_trip(peers, "cuda_ipc", (1080, 1920, 3), 600, 100, device="cuda")
    assert used == "cuda_ipc"
    assert seen["transports"] == ["cuda_ipc"] and seen["ipc_opens"] == 1, seen
    assert seen["mismatched"] == 0 and seen["last_seq"] == 599, seen
    assert seen["counts"].get("checksum_mismatch", 0) == 0, seen
    assert seen["received"] >= 200, seen  # every one compared byte for byte


@pytest.mark.parametrize("shape", [(64, 96, 3), (63, 95, 3)], ids=["words", "with-tail"])
@pytest.mark.parametrize("kind", ["full", "sampled"])
def test_a_host_frame_carries_the_checksum_of_its_own_bytes(kind, shape):
    """Note [Producer checksum]: computed on the GPU from the producer's own device copy, the
    value is the host form's of the camera's bytes, and the slot holds those bytes; each slot's
    frames go through its graph (Note [A frame's GPU work in one graph])."""
    from facecast.shared.transport.cuda_ring import CudaRingProducer

    producer = CudaRingProducer("rules", shape, slot_count=4, checksum_kind=kind)
    try:
        rng = np.random.default_rng(7)
        for seq in range(10):  # round the ring twice: each graph replays again
            frame = rng.integers(0, 256, shape, dtype=np.uint8)
            message = producer.write(frame, seq, 0.0)
            assert message.checksum == frames.checksum(frame, kind)
            slot = producer.slots[message.slot, : frame.size].cpu().numpy()
            assert np.array_equal(slot, frame.reshape(-1))
        assert len(producer._frame_graphs) == 4  # captured, one per slot, and what ran
    finally:
        producer.close()


def test_cameras_of_one_process_make_rings_and_capture_graphs_while_the_others_write():
    """Note [A frame's GPU work in one graph]: as a capture worker's camera threads do at start,
    16 threads at once each make a ring and write frames, so that rings are made and graphs
    captured while other cameras write. Every ring is made, every camera's graphs are captured
    (the first form lost 26-29 of 64 rings to shared memory, and 30-35 captures), and every
    frame carries its own bytes' checksum and lands in its slot."""
    import threading

    from facecast.shared.transport import cuda_driver
    from facecast.shared.transport.cuda_ring import CudaRingProducer

    shape, cameras, frames_each = (270, 480, 3), 16, 40
    wrong: list[str] = []
    graphs: list[int] = []
    together = threading.Barrier(cameras)

    def camera(k: int) -> None:
        rng = np.random.default_rng(k)
        together.wait()
        try:
            producer = CudaRingProducer(f"rules{k}", shape, slot_count=4)
        except TransportUnavailable as exc:
            wrong.append(f"camera {k}: no CUDA ring: {exc}")
            cuda_driver.release_thread()
            return
        try:
            for seq in range(frames_each):
                frame = rng.integers(0, 256, shape, dtype=np.uint8)
                message = producer.write(frame, seq, 0.0)
                slot = producer.slots[message.slot, : frame.size].cpu().numpy()
                if (message.checksum != frames.checksum(frame)
                        or not np.array_equal(slot, frame.reshape(-1))):
                    wrong.append(f"camera {k} frame {seq}")
            graphs.append(len(producer._frame_graphs))
        finally:
            producer.close()
            cuda_driver.release_thread()  # as a camera thread ends (PyCUDA's context stack)

    threads = [threading.Thread(target=camera, args=(k,)) for k in range(cameras)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []
    assert graphs == [4] * cameras  # every camera captured a graph per slot


def test_staging_view_is_handed_out_only_after_its_slots_upload_finished():
    from facecast.shared.transport.cuda_ring import CudaRingReader

    producer = cuda_producer(delay_copy_cycles=SLOW_COPY_CYCLES)  # 4 slots, ~20 ms per upload
    try:
        first = producer.staging_view()
        assert torch.from_numpy(first).is_pinned()  # the slot's pinned staging buffer
        first[...] = 1
        published = [producer.publish_staged(0, 0.0)]
        for seq in range(1, 4):
            producer.staging_view()[...] = seq + 1
            published.append(producer.publish_staged(seq, 0.0))
        assert not producer.events[0].query()  # slot 0's upload is still queued behind sleeps
        again = producer.staging_view()  # slot 0's staging buffer, wanted again
        assert again is first and producer.events[0].query()  # ... only once it was uploaded
        reader = CudaRingReader(producer.description(), checksum_every=1)  # rule 6: in-process
        try:
            for seq in (1, 2, 3):
                read = reader.read(published[seq])
                assert read.ok and bool((read.tensor == seq + 1).all())
        finally:
            reader.close()
    finally:
        producer.close()


def test_a_staged_frame_pending_during_a_fallback_goes_out_on_the_shm_ring(runtime_dir):
    from facecast.shared.transport.messages import TransportFault
    from facecast.shared.transport.rings import ShmRingReader
    from facecast.shared.transport.endpoints import ring_control as ring_control_endpoint
    from facecast.shared.transport.publisher import FramePublisher

    shape = (64, 96, 3)
    frame = np.random.default_rng(5).integers(0, 256, shape, dtype=np.uint8)
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", transport="cuda_ipc")
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ring_control_endpoint(runtime_dir, "cam0"))
        try:
            publisher.publish(frame, 0.0)
            assert publisher.producer.transport == "cuda_ipc"
            publisher.staging_view(shape)[...] = frame
            dealer.send(messages.encode(TransportFault(
                camera_id="cam0", ring_epoch=publisher.producer.ring_epoch, reason="test")))
            deadline = time.monotonic() + 10
            while publisher.producer.transport == "cuda_ipc" and time.monotonic() < deadline:
                publisher.serve_control()  # served between staging_view and publish_staged
                time.sleep(0.01)
            assert publisher.producer.transport == "shm"
            message = publisher.publish_staged(1.0)
            assert message.transport == "shm"
            reader = ShmRingReader(publisher.producer.description(), checksum_every=1)
            try:
                read = reader.read(message)
                assert read.ok and np.array_equal(read.tensor.numpy(), frame)
            finally:
                reader.close()
        finally:
            dealer.close()
            publisher.close()


def test_one_sync_settles_a_batch_of_gpu_checksums_and_judges_each_frame():
    from facecast.shared.transport.cuda_ring import CudaRingReader

    producers = [cuda_producer(), cuda_producer(corrupt_after_publish=True)]
    readers = [CudaRingReader(p.description(), checksum_every=1) for p in producers]
    try:
        frame = np.random.default_rng(8).integers(0, 256, (64, 96, 3), dtype=np.uint8)
        written = [p.write(frame, 0, 0.0) for p in producers]
        reads = read_batch(list(zip(readers, written)))
        assert [r.verdict for r in reads] == [Verdict.OK, Verdict.CHECKSUM_MISMATCH]
        assert torch.equal(reads[0].tensor.cpu(), torch.from_numpy(frame))
        assert reads[1].tensor is None
    finally:
        for reader in readers:
            reader.close()
        for producer in producers:
            producer.close()


def test_a_batch_read_lies_in_one_buffer_that_the_models_use_where_it_lies():
    """Note [A batch's frames in one buffer]: the copies of one read_batch are slices of one
    device buffer, in order; a frame refused by its checks leaves a gap; FrameBatch.in_place
    takes the rest where they lie, and crops from it equal crops from a stacked copy."""
    from facecast.models import roi
    from facecast.shared.transport.cuda_ring import CudaRingReader

    producers = [cuda_producer(), cuda_producer(corrupt_after_publish=True), cuda_producer()]
    readers = [CudaRingReader(p.description(), checksum_every=1) for p in producers]
    try:
        rng = np.random.default_rng(9)
        deck = [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in producers]
        reads = read_batch([(r, p.write(f, 0, 0.0)) for r, p, f in zip(readers, producers, deck)])
        assert [r.verdict for r in reads] == [Verdict.OK, Verdict.CHECKSUM_MISMATCH, Verdict.OK]
        kept = [reads[0].tensor, reads[2].tensor]
        for tensor, frame in zip(kept, (deck[0], deck[2])):
            assert torch.equal(tensor.cpu(), torch.from_numpy(frame))
        assert kept[0].untyped_storage().data_ptr() == kept[1].untyped_storage().data_ptr()
        assert kept[1].data_ptr() - kept[0].data_ptr() == 2 * kept[0].numel()  # the gap kept

        in_place = roi.FrameBatch.in_place(kept, "cuda")
        assert in_place.pixels.data_ptr() == kept[0].data_ptr()  # no copy
        assert in_place.row_offsets_px == [0, 128]
        stacked = roi.FrameBatch([t.clone() for t in kept], "cuda")
        rects = roi.RotatedRects(torch.tensor([[40.0, 30.0], [50.0, 33.0]], device="cuda"),
                                 torch.tensor([[40.0, 40.0], [60.0, 50.0]], device="cuda"),
                                 torch.tensor([0.3, -0.2], device="cuda"))
        index = torch.tensor([0, 1], device="cuda")
        assert torch.equal(roi.crop_rois(in_place, index, rects, 32),
                           roi.crop_rois(stacked, index, rects, 32))
    finally:
        for reader in readers:
            reader.close()
        for producer in producers:
            producer.close()


def test_shm_reader_on_the_gpu_pins_its_mapping_and_checks_the_generation_after_the_dma():
    from facecast.shared.transport.rings import ShmRingProducer, ShmRingReader

    shape = (1080, 1920, 3)
    producer = ShmRingProducer("pin", shape, slot_count=4)
    reader = ShmRingReader(producer.description(), device="cuda", checksum_every=1)
    rng = np.random.default_rng(9)
    try:
        assert reader.pinned, reader.pin_failure  # Note [Pinned shm mappings]
        for seq in range(8):
            frame = rng.integers(0, 256, shape, dtype=np.uint8)
            read = reader.read(producer.write(frame, seq, 0.0))
            assert read.ok and read.tensor.device.type == "cuda"
            assert torch.equal(read.tensor.cpu(), torch.from_numpy(frame))
        message = producer.write(frame, 8, 0.0)
        issue_copy = reader._slot_tensor

        def overwritten_during_the_dma(message, read, into):
            tensor = issue_copy(message, read, into)
            producer.header.begin_write(message.slot)  # the producer reuses the slot meanwhile
            return tensor

        reader._slot_tensor = overwritten_during_the_dma
        assert reader.read(message).verdict is Verdict.OVERWRITTEN
    finally:
        reader.close()
        producer.close()


# --- the frame checksum on the GPU (Note [Frame checksum]) -------------------


def test_gpu_checksums_equal_the_host_checksums_on_frames_of_odd_sizes():
    rng = np.random.default_rng(12)
    for shape in [(1, 1, 3), (5, 7, 3), (33, 47, 3), (721, 1279, 3), (1080, 1920, 3),
                  (2160, 3840, 3)]:
        frame = rng.integers(0, 256, shape, dtype=np.uint8)
        on_gpu = torch.from_numpy(frame).cuda()
        for kind in frames.CHECKSUM_KINDS:
            assert frames.checksum_tensor(on_gpu, kind) == frames.checksum(frame, kind), (shape,
                                                                                         kind)
        unaligned = torch.empty(frame.nbytes + 1, dtype=torch.uint8, device="cuda")[1:]
        unaligned.copy_(on_gpu.reshape(-1))  # storage offset 1: no int64 view in place
        assert frames.checksum_tensor(unaligned) == frames.checksum(frame)
        on_gpu.view(-1)[frame.nbytes // 2] ^= 1  # one byte, on the device
        assert frames.checksum_tensor(on_gpu) != frames.checksum(frame)


@pytest.mark.parametrize("change, position", SHM_CASES)
def test_a_third_process_writing_through_the_ipc_handle_is_never_accepted_and_the_camera_falls_back(
        runtime_dir, change, position):
    """At the default config: the tamperer opens the ring's CUDA IPC handle in its own process
    and changes one byte, a 16x16 patch or the whole slot after the frame was published."""
    outcome = tamper_after_publish(runtime_dir, "cuda_ipc", "cuda", change, position)
    assert outcome["ring_transport"] == "cuda_ipc", outcome
    assert not outcome["accepted"] and outcome["checksum_mismatch"] == 1, outcome
    assert outcome["transport_after"] == "shm", outcome
    assert "checksum mismatch" in outcome["fallback_reason"], outcome
    assert outcome["reason_after"] == outcome["fallback_reason"], outcome  # the marker's reason
    assert outcome["clean_frame_accepted"], outcome


@pytest.mark.parametrize("change, position", SHM_CASES)
def test_a_shm_slot_changed_by_a_third_process_is_caught_on_the_gpu_copy(runtime_dir, change,
                                                                         position):
    """A consumer on a GPU checks the copy it made (Note [Pinned shm mappings]), on the GPU."""
    outcome = tamper_after_publish(runtime_dir, "shm", "cuda", change, position)
    assert not outcome["accepted"] and outcome["checksum_mismatch"] == 1, outcome
    assert outcome["clean_frame_accepted"], outcome


def test_a_receive_does_not_wait_for_the_consumers_queued_work(runtime_dir):
    """Note [Reads on their own stream]: the roi_landmark worker reads the next frames while its
    batch is measured; the read (copy, checksum, its one sync) must not wait behind the kernels
    the consumer queued before it, and the frame it hands over is ordered after its copy on the
    consumer's stream."""
    from facecast.shared.transport.publisher import FramePublisher
    from facecast.shared.transport.subscriber import FrameSubscriber

    shape = (1080, 1920, 3)
    frame = np.random.default_rng(11).integers(0, 256, shape, dtype=np.uint8)
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", transport="cuda_ipc")
        subscriber = FrameSubscriber(context, runtime_dir, ["cam0"], device="cuda",
                                     checksum_every=1)
        try:
            deadline = time.monotonic() + 20
            while not subscriber.readers and time.monotonic() < deadline:
                publisher.publish(np.zeros(shape, np.uint8), 0.0)
                publisher.serve_control()
                subscriber.receive(timeout_ms=50)
            assert subscriber.readers, subscriber.status
            subscriber.receive(timeout_ms=200)  # whatever is left of the attach
            # The GPU's sleep is measured, not assumed: clock rates differ.
            start = time.monotonic()
            torch.cuda._sleep(100_000_000)
            torch.cuda.synchronize()
            cycles_per_s = 100_000_000 / (time.monotonic() - start)
            publisher.publish(frame, 1.0)
            torch.cuda._sleep(int(3.0 * cycles_per_s))  # the consumer's batch: 3 s of kernels
            start = time.monotonic()
            received = []
            while not received and time.monotonic() - start < 2.0:
                received = subscriber.receive(timeout_ms=100)
            read_s = time.monotonic() - start
            still_measuring = not torch.cuda.current_stream().query()
            assert received and read_s < 2.0, (received, read_s)
            assert still_measuring  # the read came back while the consumer's work ran
            [got] = received
            assert got.message.capture_ts_lsl == 1.0 and got.read.ok
            assert torch.equal(got.tensor, torch.from_numpy(frame).to("cuda"))
        finally:
            subscriber.close()
            publisher.close()
