"""A camera's frame ring in GPU memory, shared with consumer processes over CUDA IPC.

Note [CUDA IPC rules]
    DESIGN.md §2 lists seven ways CUDA IPC silently delivers stale, shifted or empty frames. This
    module obeys them as follows; each is guarded by a test in tests/test_cuda_rules.py that
    runs the broken variant (the `CudaFaults` knobs below) and shows it is caught.

    1. Handles name whole allocations. The ring is its own cuMemAlloc allocation, rounded up to
       2 MiB; the description still carries `offset_bytes` from cuMemGetAddressRange, so a ring
       that starts inside an allocation (a PyTorch caching-allocator tensor) maps correctly.
    2. Export once, open once, cache. The producer exports the handles when it creates the ring;
       a consumer opens them once per epoch (`CudaRingReader`) and closes them when the epoch
       changes. A new epoch is always a new reader: mappings are never reused across producers.
    3. Memory IPC orders nothing: see Note [Events order slots]
    The producer copies each frame into its slot with an async device-to-device copy on its own
    stream, from its own device copy of the frame (Note [Producer checksum]), records the slot's
    interprocess event (disable-timing) on that stream, and only then publishes the FrameReady.
    The consumer makes its current stream wait on that event before it copies the slot, so its
    copy is of the finished write. Today the producer also waits for its stream before it
    publishes (the checksum's value), so the event's order is the consumer's guarantee and not
    the producer's habit: the rule-3 fault (`CudaFaults.delay_copy_cycles`) publishes before the
    copy and shows that the event alone keeps the consumer right. PyTorch's own CUDA tensor
    sharing waits on an event only when a storage is first shared, which is not enough for a
    ring that is re-read every frame. A host frame gets into its slot's pinned staging buffer by
    a copy, or is made there (Note [Staged writes]); the staging buffer is handed out again only
    once that slot's event has completed.

Note [Producer checksum]
    On a CUDA ring the producer computes each frame's checksum (Note [Frame checksum]) on the
    GPU, from a device copy that is its own, never from the slot:
    1. a host frame's staged bytes (pinned) go to the producer's own device buffer (`_upload`,
       async on the producer's stream); a frame decoded on the GPU is the caller's own tensor
       already (Note [Frames born on the GPU]);
    2. the slot's generation goes odd; the private copy's device-to-device copy into the slot
       is queued, then the slot's event, then the checksum of the private copy (`_to_slot`; of
       a host frame's private copy in place, sparing a temporary of the frame's size, and so of
       a GPU decoder's frame, which the capture worker hands over as scratch: `write_device`);
    3. the checksum's value is fetched on the same stream: one host sync per frame, which waits
       for the upload, the checksum and the copy (the FrameReady must carry the value before it
       is sent). With blocking waits (Note [Blocking waits]) the camera's capture thread sleeps
       meanwhile; every camera has a thread of its own.
    The value says what the camera handed over: the private buffer is written by this producer
    only, from its own staged bytes, so a third process's write into the slot, a bad copy into
    it or a stale slot is refused by every consumer (Note [Checksum of what the camera gave];
    tests/test_foreign_writer.py). What it trusts that the host form did not: the upload's DMA
    (PCIe checks and replays its own packets). The slot itself is never the source: a value
    computed from the slot would certify whatever landed there.
    Until 2026-11-26 it was computed on the host from the staged bytes while the upload ran.
    That is one pass of the CPU over every frame: 399 us per 1080p frame on the H200 host (781
    when frames cycle through memory, bench/checksum.py), and 27-44 % of the capture workers'
    6.0 cores at 64 replayed 1080p30 cameras on the H100 (py-spy, docs/benchmarks.md). On the
    GPU it is ~14 us of GPU time and ~36 us of CPU to queue per 1080p frame, 6 MB of device
    memory per camera of host frames (the private copy, made at its first frame), and a
    publish that waits for its own upload (upload + sync, 174 us at 1080p on the H200) and for
    its turn on a GPU that other processes share.
    The shm ring keeps the host form: its producer has no GPU.

Note [A frame's GPU work in one graph]
    Steps 1-3 of Note [Producer checksum] for a host frame are eight or so PyTorch calls (the
    upload, the copy into the slot, the checksum's views, product and sum, the fetch), and each
    costs the capture thread tens of microseconds of CPU, more with 16 camera threads of one
    process calling into the driver at once: on the H100 host (16 threads, 30 fps 1080p,
    2026-11-27) the upload took 138 us of CPU per frame, the checksum 150, its fetch 130, the
    whole write 550 besides the copy into pinned memory (about 1 ms). So each slot gets a CUDA
    graph, captured at the camera's first host frame, of exactly those steps: the slot's staging
    bytes to the producer's own device copy, that copy into the slot, the checksum of the copy
    in place, and its value into pinned host memory. A frame is then one replay on the
    producer's stream, the slot's event after it, and one sleeping wait for the stream (Note
    [Blocking waits]). What the graph computes is what the calls computed, from the same
    private bytes (tests/test_cuda_rules.py, tests/test_foreign_writer.py run on it); the event
    comes after the checksum instead of before it, so a consumer waits its ~14 us longer. A
    slot's graph reads and writes fixed addresses, which a host frame always has (the slot's
    staging buffer, the producer's device copy, the slot); a frame decoded on the GPU comes in
    a tensor of its own and keeps the calls. The graphs of one producer share one memory pool
    (the checksum's output and temporaries): they replay one after another, never at once.
    A capture is thread-local: the process's other camera threads go on writing their frames
    meanwhile. What they must not do then is what a capture forbids process-wide, a device-wide
    synchronisation: the first form let 16 cameras of a capture process create their rings
    (which end with one) while the first ones captured, and at 64 cameras (H100, 2026-11-27)
    30-35 captures failed ("operation failed due to a previous error during capture") and
    26-29 cameras' rings with them ("operation not permitted when stream is capturing"), which
    fell back to shared memory (two runs). So a capture, a ring's creation and an NVDEC
    decoder's take turns (`cuda_driver.CAPTURE_LOCK`); tests/test_cuda_rules.py makes rings and
    captures in many threads at once.

Note [Frames born on the GPU]
    A camera decoded by NVDEC (facecast.workers.capture.nvdec) hands the producer a finished BGR
    frame in device memory: a tensor of its own, converted from the decoder's NV12 output, ready
    on the capture thread's current stream. `write_device` takes it without a host copy: the
    producer's stream waits for the caller's current stream (the frame is complete), and the
    frame goes through Note [Producer checksum]'s steps 2 and 3 from the caller's tensor (the
    checksum is the decoder's frame's, never the slot's). After the sync the caller's tensor is
    no longer read, so its memory may go back to the caching allocator without record_stream.
    Nothing is staged: the decoder's frame is its own private buffer. On an shm ring (after a
    transport fallback) the frame is copied to the host first and written as a host frame
    (rings.RingProducer.write_device). NVDEC's frames skip the BGR tensor and the copy: Note
    [NV12 into the slot].

Note [NV12 into the slot]
    An NVDEC frame converted to a BGR tensor of its own, then copied into the slot and
    checksummed there, cost the capture thread a dozen PyTorch calls a frame: on one H200 (16
    NVDEC cameras at 1080p30 in one process, idle GPU, 2026-11-28, .footage's ablation probe)
    the conversion added 0.48 ms of CPU a frame and the ring's write 0.79, of 1.70 ms in all (the
    demuxing 0.12, NVDEC's decode call 0.30); the same calls in a tight loop take a fifth of
    that, so it is their count, not contention, that costs. So the capture worker hands the
    ring the decoder's frame as NVDEC left it (`write_decoded`, gpu_decoded.DecodedFrame): the
    slot's generation goes odd, and one Triton kernel on the producer's stream
    (triton_kernels.nv12_to_slot) reads the NV12 bytes, writes the BGR bytes into the slot with
    the conversion's arithmetic to the bit, and sums Note [Frame checksum] over the bytes it
    computed (per program, the host adding the partial sums after the one sync): then the
    slot's event. The value certifies what the producer made from the decoder's private buffer,
    never what is read back from the slot, as Note [Producer checksum] asks; a third process's
    write into the slot is refused as before. The decoder's buffer stays valid until its next
    decode, which comes after the sync. Where the kernel cannot serve (no Triton, a frame whose
    bytes are not whole 8-byte words, the sampled checksum, rule 3's fault), the frame is
    converted to its tensor and written as above. Measured (2026-11-28, one H200): the probe's
    1.64 ms of CPU a frame became 0.96 (NVDEC's decode alone 0.38); the daemon at 64 NVDEC
    cameras, two `ab_decode` pairs on one loan, capture 3.23 and 3.80 cores -> 2.75 and 2.65,
    the process tree 5.29 and 6.06 -> 4.98 and 4.84, GPU memory -350 and -190 MiB (no BGR
    tensors: the capture processes' torch reserve 576 and 616 -> 168 MiB).

    The frame stays on the camera's stream, where NVDEC's copy left it: the ring's stream waits
    for that one through one event (`DecodedFrame.ready_for`), not through the camera thread's
    current stream, and the partial sums come back into pinned memory (frames.PartialSums).
    A per-function probe of the capture step (one H200, 16 cameras, 2026-11-28) had found the
    two hand-overs between the three streams (events made, recorded and waited, the current
    stream asked three times) at ~0.15 ms of CPU a frame; with them, a tensor over NVDEC's
    buffer made per frame and the control socket's polls gone, 1.29 / 1.16 -> 1.03 / 1.06 ms a
    frame, and the daemon at 64 NVDEC cameras (`ab_decode`) capture 3.11 -> 2.42 cores, the
    tree 5.56 -> 4.74, p99 29.0 -> 22.5 ms.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from facecast.shared.transport import cuda_driver, frames
from facecast.shared.transport.messages import CudaRingHandles, FrameReady, RingDescription
from facecast.shared.transport.ring_errors import TransportUnavailable
from facecast.shared.transport.rings import RingProducer, RingReader, aligned

log = logging.getLogger(__name__)

ALLOCATION_ALIGN_BYTES = 2 * 1024 * 1024
# The probe after the frame slots (Note [Probe slot]): on the GPU not a whole slot. A slot is a
# frame (6 MB at 1080p), and a frame-sized probe per camera was 380 MiB of GPU memory at 64
# cameras for a handshake that a pattern of this size, at the end of the ring, settles as well:
# a mapping at a wrong address or of a wrong allocation or epoch reads other bytes there.
PROBE_BYTES = 64 * 1024


def _ring_bytes(slot_count: int, slot_bytes: int) -> int:
    """A ring's size: its frame slots, then the probe."""
    return slot_count * slot_bytes + PROBE_BYTES


def _slots_and_probe(ring: torch.Tensor, slot_count: int, slot_bytes: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A ring's bytes as (slot_count, slot_bytes) frame slots and the PROBE_BYTES after them."""
    frame_bytes = slot_count * slot_bytes
    slots, probe = ring[:frame_bytes], ring[frame_bytes:frame_bytes + PROBE_BYTES]
    return slots.view(slot_count, slot_bytes), probe


# Rings produced in this process, by epoch, for readers in the same process (rule 6).
_IN_PROCESS: weakref.WeakValueDictionary[int, CudaRingProducer] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class CudaFaults:
    """Deliberately broken behaviour, for the tests that prove each rule's guard works.

    Never set in production; every field defaults to correct behaviour.
    """

    ring_inside_torch_tensor: bool = False  # rule 1: ring is a view 2 MiB into a torch tensor
    omit_offset: bool = False  # rule 1: ... and the description says offset 0
    delay_copy_cycles: int = 0  # rule 3: the slot's copy after publish, behind a GPU sleep
    corrupt_after_publish: bool = False  # overwrite the next published slot after publishing


# ================================================================================================
# Producer side (runs in the capture worker)
# ================================================================================================


class CudaRingProducer(RingProducer):
    transport = "cuda_ipc"

    def __init__(
        self,
        camera_id: str,
        frame_shape: tuple[int, ...],
        slot_count: int,
        device_index: int = 0,
        faults: CudaFaults = CudaFaults(),
        checksum_kind: frames.ChecksumKind = "full",
    ) -> None:
        cuda = cuda_driver.driver(device_index)  # raises TransportUnavailable with the reason
        self.device_index = device_index
        self.faults = faults
        self.device_uuid, self.driver_version = cuda_driver.device_identity(device_index)
        super().__init__(camera_id, frame_shape, slot_count, checksum_kind=checksum_kind)
        ring_bytes = _ring_bytes(slot_count, self.slot_bytes)
        try:
            with cuda_driver.CAPTURE_LOCK:  # not while another camera captures its graphs
                self._create(cuda, ring_bytes)
        except TransportUnavailable:
            self.header.close()
            raise
        except Exception as exc:  # any CUDA API error here means: no CUDA ring for this camera
            self.header.close()
            raise TransportUnavailable(f"cannot create a CUDA ring: {exc}") from exc
        self._handles = CudaRingHandles(
            mem_handle=bytes(self._mem_handle),
            offset_bytes=0 if faults.omit_offset else self.offset_bytes,
            allocation_bytes=self.allocation_bytes,
            event_handles=[bytes(h) for h in self._event_handles],
            device_uuid=self.device_uuid,
            device_index=device_index,
            driver_version=self.driver_version,
        )
        self._corrupt_next = faults.corrupt_after_publish  # after RingProducer.__init__
        self._late_stream = None  # rule 3's fault only
        _IN_PROCESS[self.ring_epoch] = self

    def _create(self, cuda, ring_bytes: int) -> None:
        """The ring's memory, stream, events, staging buffers and probe, ready on the GPU."""
        device_index, slot_count = self.device_index, self.slot_count
        self._allocate(cuda, ring_bytes)
        self.stream = torch.cuda.Stream(device=device_index)
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(slot_count)]
        with torch.cuda.device(device_index):
            self._event_handles = [event.ipc_handle() for event in self.events]
        self._staging = [
            torch.empty(self.frame_bytes, dtype=torch.uint8, pin_memory=True)
            for _ in range(slot_count)
        ]
        # Per slot, made once: what _claim hands out and where _upload copies to.
        self._staging_views = [
            buffer.numpy().reshape(self.frame_shape) for buffer in self._staging
        ]
        self._slot_targets = [self.slots[slot, : self.frame_bytes] for slot in range(slot_count)]
        # The producer's own device copy of each host frame (Note [Producer checksum]),
        # made at the first host frame: a camera decoded on the GPU never has one, and 64 of
        # them held 400 MB of these for nothing.
        self._uploaded: torch.Tensor | None = None
        # Note [A frame's GPU work in one graph]: per slot, captured at the first host frame
        # (with the device copy above); where each replay leaves the checksum's value.
        self._frame_graphs: list[torch.cuda.CUDAGraph] | None = None
        self._graph_checksums: torch.Tensor | None = None  # pinned, a value per slot
        self._graph_checksum_offset = 0
        self.probe.copy_(torch.from_numpy(frames.test_pattern(PROBE_BYTES, self.ring_epoch)))
        # Load the checksum's kernels and weights now, not on the first frame.
        frames.prepare_checksum(self.checksum_kind, self.frame_bytes, self.slots.device)
        torch.cuda.synchronize(device_index)

    def _allocate(self, cuda, ring_bytes: int) -> None:
        if self.faults.ring_inside_torch_tensor:
            # Broken on purpose (rule 1): the ring starts 2 MiB into a caching-allocator tensor.
            self._torch_backing = torch.empty(
                ring_bytes + ALLOCATION_ALIGN_BYTES, dtype=torch.uint8, device=self.device_index
            )
            self.ring_pointer = self._torch_backing.data_ptr() + ALLOCATION_ALIGN_BYTES
            self.allocation = None
        else:
            self._torch_backing = None
            self.allocation = cuda.mem_alloc(aligned(ring_bytes, ALLOCATION_ALIGN_BYTES))
            self.ring_pointer = int(self.allocation)
        base_pointer, self.allocation_bytes = cuda.mem_get_address_range(self.ring_pointer)
        self.offset_bytes = self.ring_pointer - int(base_pointer)
        self._mem_handle = cuda.mem_get_ipc_handle(self.ring_pointer)
        self.slots, self.probe = _slots_and_probe(
            cuda_driver.tensor_at(self.ring_pointer, ring_bytes, self.device_index),
            self.slot_count, self.slot_bytes)

    def _claim(self, slot: int) -> np.ndarray:
        # The staging buffer of this slot is free once its previous upload finished: the
        # frame's sync waited for it, so this waits only under the rule-3 fault (the event
        # comes later).
        self.events[slot].synchronize()
        return self._staging_views[slot]

    def _commit(self, slot: int, pixels: np.ndarray) -> int:
        if self._frame_graphs is None and not self.faults.delay_copy_cycles:
            self._frame_graphs = self._capture_frame_graphs()
        self.header.begin_write(slot)
        if self._frame_graphs:
            return self._replay_frame_graph(slot)
        # The calls one by one: rule 3's fault, or graphs that could not be captured. The
        # private copy is scratch once it is in the slot.
        self._upload(slot)
        return self._to_slot(slot, self._uploaded, scratch=True)

    def _capture_frame_graphs(self) -> list[torch.cuda.CUDAGraph]:
        """Note [A frame's GPU work in one graph]: Note [Producer checksum]'s steps 1-3 of each
        slot, captured once ("thread_local": the other camera threads of this process go on
        calling CUDA meanwhile, but no ring or decoder is made: cuda_driver.CAPTURE_LOCK). None
        captured, with the reason in the log, where the driver refuses: the frames then take
        the calls."""
        if self._uploaded is None:
            self._uploaded = torch.empty(self.frame_bytes, dtype=torch.uint8,
                                         device=self.device_index)
        checksums = torch.zeros(self.slot_count, dtype=torch.int64, pin_memory=True)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        try:
            with (cuda_driver.CAPTURE_LOCK, torch.cuda.device(self.device_index),
                  torch.cuda.stream(self.stream)):
                for slot in range(self.slot_count):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        self._uploaded.copy_(self._staging[slot], non_blocking=True)
                        self._slot_targets[slot].copy_(self._uploaded, non_blocking=True)
                        pending = frames.checksum_start(self._uploaded, self.checksum_kind,
                                                        scratch=True)
                        checksums[slot].copy_(pending.device_value, non_blocking=True)
                    finally:
                        graph.capture_end()
                    graphs.append(graph)
        except RuntimeError as exc:
            log.warning("camera %s: a frame's GPU work cannot be captured as a CUDA graph (%s); "
                        "each frame takes the calls one by one", self.camera_id, exc)
            return []
        self._graph_checksum_offset = pending.offset
        self._graph_checksums = checksums
        return graphs

    def _replay_frame_graph(self, slot: int) -> int:
        """Stages "upload" and "to slot" as the slot's graph, the slot's event after it, and the
        checksum's value once the stream is done (Note [A frame's GPU work in one graph])."""
        with torch.cuda.stream(self.stream):
            self._frame_graphs[slot].replay()
            self.events[slot].record(self.stream)
        self.stream.synchronize()  # sleeps (Note [Blocking waits])
        return (int(self._graph_checksums[slot]) + self._graph_checksum_offset) & frames.MASK_64

    def _upload(self, slot: int) -> None:
        """Stage "upload": the slot's staging bytes to the producer's own device buffer, async on
        the producer's stream (Note [Producer checksum])."""
        if self._uploaded is None:
            self._uploaded = torch.empty(self.frame_bytes, dtype=torch.uint8,
                                         device=self.device_index)
        with torch.cuda.stream(self.stream):
            self._uploaded.copy_(self._staging[slot], non_blocking=True)

    def write_device(self, frame: torch.Tensor, frame_seq: int, capture_ts_lsl: float,
                     scratch: bool = False) -> FrameReady:
        """Note [Frames born on the GPU]: a frame already on this ring's GPU (the caller's own
        tensor, ready on its current stream) into the next slot, device to device. `scratch`:
        the caller will not read the frame again, so the checksum is computed in its memory,
        after the copy into the slot, as a host frame's in the producer's own device copy
        (no temporary of the frame's size a frame; Note [Producer checksum])."""
        if (tuple(frame.shape) != self.frame_shape or frame.dtype != torch.uint8
                or frame.device != self.slots.device):
            raise ValueError(
                f"camera {self.camera_id}: frame {tuple(frame.shape)} {frame.dtype} on "
                f"{frame.device} does not fit the ring ({self.frame_shape} uint8 on "
                f"{self.slots.device}); a new resolution needs a new ring")
        slot = self._slot_for_a_write()
        checksum = self._commit_device(slot, frame.contiguous(), scratch)
        return self._committed(slot, checksum, frame_seq, capture_ts_lsl)

    def write_decoded(self, frame, frame_seq: int, capture_ts_lsl: float) -> FrameReady:
        """Note [NV12 into the slot]: a frame decoded on this ring's GPU, as its decoder left it
        (gpu_decoded.DecodedFrame: this ring's stream made to wait for it by `ready_for`),
        written into the next slot by the frame itself with its checksum from the bytes it
        wrote; where it cannot (a frame that is a BGR tensor already, nvJPEG's; another kind of
        checksum; a fault of rule 3), its BGR form as `write_device` takes it."""
        if (not frame.writes_itself or self.checksum_kind != "full"
                or self.frame_bytes % frames.WORD_BYTES or self.faults.delay_copy_cycles
                or tuple(frame.shape) != self.frame_shape):
            return self.write_device(frame.bgr(), frame_seq, capture_ts_lsl, scratch=True)
        word_weights, _ = frames.frame_word_weights(self.frame_bytes, self.slots.device)
        slot = self._slot_for_a_write()
        frame.ready_for(self.stream)
        self.header.begin_write(slot)
        try:
            with torch.cuda.stream(self.stream):
                partials = frame.write_into(self._slot_targets[slot], word_weights)
                if partials is not None:
                    self.events[slot].record(self.stream)
                    checksum = partials.value()  # waits for the kernel
            if partials is None:  # (the kernel given up: the conversion, then the copy)
                bgr = frame.bgr()
                self.stream.wait_stream(torch.cuda.current_stream(self.slots.device))
                checksum = self._to_slot(slot, bgr.view(-1), scratch=True)
        except BaseException:
            # The generation even again (no message names it): a slot left odd would turn
            # odd-when-complete at its next write (a conversion failing here, GpuDecodeFailed,
            # leaves the camera to the CPU decoder, on this ring).
            self.header.end_write(slot)
            raise
        return self._committed(slot, checksum, frame_seq, capture_ts_lsl)

    def _commit_device(self, slot: int, frame: torch.Tensor, scratch: bool) -> int:
        """Note [Frames born on the GPU], step 1, then `_to_slot` from the caller's tensor."""
        self.stream.wait_stream(torch.cuda.current_stream(self.slots.device))
        self.header.begin_write(slot)
        return self._to_slot(slot, frame.view(-1), scratch=scratch)

    def _to_slot(self, slot: int, private: torch.Tensor, scratch: bool) -> int:
        """Stage "to slot": the producer's own device bytes copied into the slot, the slot's
        event, their checksum (in place when `scratch`: the copy into the slot is queued before
        it) and its value (one host sync): Note [Producer checksum], steps 2-3."""
        with torch.cuda.stream(self.stream):
            if self.faults.delay_copy_cycles:
                return self._to_slot_late(slot, private, scratch)
            self._slot_targets[slot].copy_(private, non_blocking=True)
            self.events[slot].record(self.stream)
            pending = frames.checksum_start(private, self.checksum_kind, scratch=scratch)
            # On this stream: the fetch waits for the copy and the checksum queued before it.
            return frames.settle_checksums([pending])[0]

    def _to_slot_late(self, slot: int, private: torch.Tensor, scratch: bool) -> int:
        """Broken on purpose (rule 3, `CudaFaults.delay_copy_cycles`): the copy into the slot
        runs on a second stream behind a GPU sleep, after the checksum's value came back, so the
        frame is published while its slot is still being written; only the event orders it."""
        late_copy = private.clone()  # the private buffer takes the next frame meanwhile
        pending = frames.checksum_start(private, self.checksum_kind, scratch=scratch)
        checksum = frames.settle_checksums([pending])[0]
        if self._late_stream is None:
            self._late_stream = torch.cuda.Stream(device=self.device_index)
        self._late_stream.wait_stream(self.stream)
        with torch.cuda.stream(self._late_stream):
            torch.cuda._sleep(self.faults.delay_copy_cycles)
            self._slot_targets[slot].copy_(late_copy, non_blocking=True)
            self.events[slot].record(self._late_stream)
        late_copy.record_stream(self._late_stream)
        return checksum

    def _corrupt_slot(self, slot: int) -> None:
        # The published slot changes under the consumer, generation intact.
        with torch.cuda.stream(self.stream):
            self._slot_targets[slot].bitwise_not_()
            self.events[slot].record(self.stream)

    def _description_fields(self) -> dict:
        return {"cuda": self._handles}

    def close(self) -> None:
        _IN_PROCESS.pop(self.ring_epoch, None)
        try:
            self.stream.synchronize()
            if self._late_stream is not None:
                self._late_stream.synchronize()
        except Exception:
            pass
        self.slots = self.probe = self._slot_targets = self._uploaded = None
        self._frame_graphs = self._graph_checksums = None
        self._staging = self._staging_views = self._staged_view = None
        self.events = None
        if self.allocation is not None:
            self.allocation.free()
            self.allocation = None
        self._torch_backing = None
        super().close()


# ================================================================================================
# Consumer side (runs in detection / roi_landmark workers, tests, benchmarks)
# ================================================================================================


# Note [Mappings left to the process's end]
#     At a worker's stop its ring readers' IPC mappings are not closed from Python: with 128
#     NVDEC cameras on two H100s (2026-11-27) the detection worker of each GPU, reading its 64
#     cameras' rings, took 3.3 s to close (the roi_landmark workers, 32 cameras each, 0.2-1.3 s),
#     cuIpcCloseMemHandle by cuIpcCloseMemHandle while the other processes kept the GPU busy,
#     and the stop's last stage waited for it. The process ends by os._exit right after (Note
#     [Quick exit]) and the driver unmaps what its context mapped, as it ends a capture worker's
#     decoders (Note [Decoders left to the process's end]); so there a reader's mapping is kept
#     here, never closed. A reader closed for any other reason (a new ring epoch, a camera
#     moved) closes its mapping as before.
_MAPPINGS_LEFT_TO_THE_EXIT: list = []


class CudaRingReader(RingReader):
    """Maps a CUDA ring once per epoch; each frame read is a device-to-device copy of its slot,
    checked on the copy (Note [The consumer's own copy])."""

    opens_total = 0  # cuIpcOpenMemHandle calls in this process (rule 2's test counts them)

    def __init__(
        self,
        description: RingDescription,
        checksum_every: int = 30,
        *,
        unsafe_skip_event_wait: bool = False,
        force_ipc_open: bool = False,
    ) -> None:
        super().__init__(description, checksum_every)
        self._ipc_memory = None
        self._unsafe_skip_event_wait = unsafe_skip_event_wait
        self.open_ms = 0.0
        try:
            self._map(description, force_ipc_open)
        except TransportUnavailable:
            self.close()
            raise
        except Exception as exc:  # a CUDA API error while mapping: the path is not proven
            self.close()
            raise TransportUnavailable(f"cannot map CUDA ring of {description.camera_id}: {exc}")

    def _map(self, description: RingDescription, force_ipc_open: bool) -> None:
        handles = description.cuda
        if handles is None:
            raise TransportUnavailable("ring description carries no CUDA handles")
        device_index = cuda_driver.local_device_index(handles.device_uuid)
        if device_index is None:
            raise TransportUnavailable(
                f"the ring lives on GPU {handles.device_uuid}, which this process cannot see"
            )
        cuda = cuda_driver.driver(device_index)
        cuda_driver.require_primary_context(device_index)
        local_driver = int(cuda.get_driver_version())
        if local_driver != handles.driver_version:
            raise TransportUnavailable(
                f"driver version differs: producer {handles.driver_version}, here {local_driver}"
            )
        self.device_index = device_index
        ring_bytes = _ring_bytes(description.slot_count, description.slot_bytes)
        producer = _IN_PROCESS.get(description.ring_epoch)
        if producer is not None and description.producer_pid == os.getpid() and not force_ipc_open:
            ring_pointer, self.events = producer.ring_pointer, producer.events  # rule 6
        else:
            started = time.perf_counter()
            # PyCUDA insists on a bytearray (msgspec decodes bytes).
            self._ipc_memory = cuda.IPCMemoryHandle(bytearray(handles.mem_handle))
            CudaRingReader.opens_total += 1
            ring_pointer = int(self._ipc_memory) + handles.offset_bytes
            self.events = [
                torch.cuda.Event.from_ipc_handle(device_index, handle)
                for handle in handles.event_handles
            ]
            self.open_ms = (time.perf_counter() - started) * 1000
        if handles.offset_bytes + ring_bytes > handles.allocation_bytes:
            raise TransportUnavailable(
                f"ring of {ring_bytes} bytes at offset {handles.offset_bytes} does not fit its "
                f"allocation of {handles.allocation_bytes} bytes"
            )
        self.slots, self.probe = _slots_and_probe(
            cuda_driver.tensor_at(ring_pointer, ring_bytes, device_index),
            description.slot_count, description.slot_bytes)
        self._prove_mapping(description)
        # One view per slot for the whole epoch, the source of each frame's copy.
        self._views = [
            self.slots[slot, : self.frame_bytes].view(self.frame_shape)
            for slot in range(description.slot_count)
        ]

    def _prove_mapping(self, description: RingDescription) -> None:
        """The handshake: the probe slot must hold this epoch's pattern (Note [Probe slot])."""
        expected = frames.test_pattern_tensor(PROBE_BYTES, description.ring_epoch, self.slots.device)
        if not torch.equal(self.probe, expected):
            mismatched = int((self.probe != expected).sum().item())
            raise TransportUnavailable(
                f"CUDA IPC handshake failed for {description.camera_id}: {mismatched} of "
                f"{PROBE_BYTES} probe bytes differ from the test pattern (wrong "
                "address, allocation or epoch)"
            )

    def _wait_for_slot(self, slot: int) -> None:
        if not self._unsafe_skip_event_wait:
            # Note [Events order slots]
            self.events[slot].wait(torch.cuda.current_stream(self.device_index))

    @property
    def copy_device(self) -> torch.device:
        return self.slots.device

    def _slot_tensor(self, message: FrameReady, read, into: torch.Tensor | None) -> torch.Tensor:
        # Our own copy, queued on the current stream after the event wait (Note [The consumer's
        # own copy]); complete at the batch's sync, before the generation check. In the batch's
        # buffer where read_batch gave one (Note [A batch's frames in one buffer]).
        source = self._views[message.slot]
        tensor = into.view(source.shape) if into is not None else torch.empty_like(source)
        tensor.copy_(source, non_blocking=True)
        read._needs_sync = True
        return tensor

    def _checksum_start(self, message: FrameReady, read) -> frames.PendingChecksum:
        # On the copy, after it on the same stream; settled with the batch.
        return frames.checksum_start(read.tensor, self.checksum_kind)

    def close_at_exit(self) -> None:
        """Note [Mappings left to the process's end]."""
        if self._ipc_memory is not None:
            _MAPPINGS_LEFT_TO_THE_EXIT.append(self._ipc_memory)
            self._ipc_memory = None
        self.close()

    def close(self) -> None:
        self.slots = self.probe = self._views = None
        self.events = None
        if self._ipc_memory is not None:
            try:
                self._ipc_memory.close()
            except Exception as exc:
                log.debug("closing IPC mapping: %s", exc)
            self._ipc_memory = None
        super().close()
