"""Per-camera frame rings: one producer (the capture worker), many consumers in other processes.

Two implementations share one protocol (DESIGN.md §2): `ShmRingProducer`/`ShmRingReader` keep
the pixels in POSIX shared memory; `facecast.shared.transport.cuda_ring` keeps them in GPU
memory shared over CUDA IPC. Both keep the per-slot generations in a small shared-memory header
(`GenerationHeader`), both reserve a *probe* after the frame slots holding a known test pattern
for the handshake, and both describe themselves with a `RingDescription` message.

Note [Slot generations]
    Capture never waits for consumers, so a slot can be overwritten while someone reads it. Each
    slot has a 64-bit generation in the header, seqlock style: the producer makes it odd before it
    starts writing the slot and even (the next value) once the write is issued; the even value goes
    into the FrameReady message. A consumer compares the header with the message before it reads
    and again once its own copy of the slot is complete (Note [The consumer's own copy]). Any
    difference means the frame was overwritten while it was copied: it is dropped and counted,
    never handed on. DESIGN.md §2 rule 4; guarded by tests/test_shm_ring.py and
    tests/test_cuda_rules.py::test_rule4_*.

Note [Probe slot]
    After the last frame slot lies a probe that never carries frames: on shm a slot's worth
    (slot `slot_count`), on the GPU the ring's last `cuda_ring.PROBE_BYTES` (a frame-sized probe
    there cost 380 MiB of GPU memory at 64 1080p cameras). The producer fills it with
    `frames.test_pattern(size, epoch)` when it creates the ring; a consumer compares it byte for
    byte, through its own mapping, before it accepts any frame of that epoch. A mapping at the
    wrong address, of the wrong allocation or of an earlier epoch cannot pass.

Note [Staged writes]
    `write(frame)` copies a finished frame into the ring: into the shm slot, or into the CUDA
    ring's pinned staging buffer for the slot, from which it goes to the GPU. At 1080p that is
    6 MB, about a millisecond of one core: the largest host cost of a frame (see the stage table
    of bench/transport.py). A source that can decode or render into memory it is given takes
    `staging_view()` instead, writes the frame there and calls `publish_staged()`: the capture
    worker does so for the sources OpenCV decodes (V4L2, streams, files and the encoded
    synthetic loops on the CPU: `FrameSource.decodes_into`), whose retrieve writes into the view
    in place of a new array that `write` would copy again. The view is
    always producer-private memory, never the slot that consumers map: on CUDA the slot's pinned
    staging buffer, handed out only once the slot's previous upload from it has finished (its
    event); on shm one private buffer, copied into the slot at commit (there staging saves no
    copy; it is offered so that sources need not know the transport). The generation goes odd
    when the slot's content starts to change (the shm copy, the CUDA copy into the slot).
    Note [Checksum of what the camera gave] says why the memory is private.

Note [Checksum of what the camera gave]
    A frame's checksum says what the camera handed over, so it is computed from the producer's
    private bytes, never from the slot itself: on an shm ring from the caller's frame or the
    staging buffer, on the host, before they go to the slot; on a CUDA ring on the GPU, from
    the producer's own device copy of the staged bytes (Note [Producer checksum]). A checksum
    taken from shared memory certifies whatever is there: a third process that writes into a
    slot while the producer fills it (a writer looping over every slot, the one being filled
    included, did so on shm) would have its bytes certified and accepted by every consumer. A
    frame decoded on the GPU (Note [Frames born on the GPU]) is the same rule: its checksum is
    computed on the GPU from the decoder's converted frame, a tensor of the producer's own,
    never from the slot it is copied into; on an shm ring it comes to a private host copy
    first, and the checksum is that copy's.

Note [The consumer's own copy]
    Every reader hands out its own copy of the slot, never the slot itself: a host copy, a DMA
    of a (pinned) shm slot to the GPU, or a device-to-device copy of a CUDA slot (microseconds
    for a 1080p frame). The checksum is computed on that copy and the generation checked once
    it is complete, so the bytes a consumer uses are exactly the bytes it checked. Reading the
    slot in place would check one thing and use another: a third process that wrote into a CUDA
    slot after the consumer's checksum and before its models read the slot had its frame
    accepted (the generation, which only the producer changes, stayed the same).

Note [One sync per batch]
    Reading a frame ends with checks that need the GPU's work done: a checksum computed on the
    GPU (CUDA rings; shm frames copied to a GPU, Note [Pinned shm mappings]), or an asynchronous
    copy to the GPU that must be finished before the generation is checked again. One host sync
    per frame costs more than it seems when many processes share the GPU (the driver
    time-slices their contexts, so a sync can wait for other processes' work): a consumer of 32
    cameras paid it 960 times a second.
    `read_batch` therefore reads in four passes: every frame up to its sync (`_start`: verdict,
    event wait, tensor), the checksums queued on the device (`start_checksums`: the frames of a
    run in the batch's buffer together, Note [Frames of a batch checksummed together]), then
    one device-to-host transfer of all queued checksums per device (`settle`), then every
    frame's late checks (`_finish`: checksum comparison, generation after the copy).
    `FrameSubscriber.receive` reads the newest frame of every camera in one batch. Nothing is
    handed out before its checks passed.

Note [A batch's frames in one buffer]
    `read_batch` gives the copies that go to one device (CUDA slots; pinned shm slots copied to
    a GPU) one buffer for the batch, each frame its slice in the order read, instead of one
    allocation per frame. A consumer that takes the batch as one tall image (`FrameBatch.in_place`
    in models/roi.py: its crops and the detection pass read the frames by row offset) then uses
    the copies where they lie, where it stacked them into yet another buffer before: 400 MB of
    device memory and a copy of every frame per detection pass over 64 1080p cameras, 200 MB
    per batch of a roi_landmark worker of 32 (H100, 2026-11-26: the detection worker held 2.4
    GB where torch had 0.65 GB allocated, each roi_landmark worker 2.2 GB for 0.5 GB: the
    caching allocator keeps the eager passes' peak). A frame refused by its late checks leaves
    its slice unused; the others keep their place.

Note [Stage methods]
    Each stage of a frame's way through a ring is one method (producer: `_claim`, `_fill`,
    `_commit` with `header.begin_write`/`end_write`, `_upload` on CUDA, `_checksum`; consumer:
    `_precheck`, `_wait_for_slot`, `_slot_tensor`, `start_checksums` (with each lone frame's
    `_checksum_start`), `settle`, `generation_unchanged`). bench/transport.py times them by
    wrapping them on the instance (the module's functions on the module), so the library
    carries no timing code and pays nothing for it. Keep a stage one method.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
from abc import ABC, abstractmethod

import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: a capture worker never needs it
    import torch

from facecast.shared.transport import frames, shm
from facecast.shared.transport.messages import FrameReady, RingDescription
from facecast.shared.transport.ring_errors import TransportUnavailable

log = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 4096
_HEADER_MAGIC = 0xFACECA57
_GEN_STRIDE = 8  # uint64 words per slot: one cache line, so slots don't share lines
_HEADER_FIXED_WORDS = 8  # magic, epoch, slot_count, reserved


class Verdict(enum.Enum):
    OK = "ok"
    OVERWRITTEN = "overwritten"  # generation changed: the producer reused the slot
    STALE_EPOCH = "stale_epoch"  # the message names another ring epoch than the one mapped
    CHECKSUM_MISMATCH = "checksum_mismatch"  # memory read is not the frame that was published
    BAD_SHAPE = "bad_shape"  # the message does not fit the ring


def new_epoch() -> int:
    """A fresh ring epoch: random, so a restarted producer never repeats one."""
    return secrets.randbits(48) | 1


def aligned(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class GenerationHeader:
    """The seqlock generations of a ring's slots, in shared memory (Note [Slot generations])."""

    def __init__(self, segment: shm.SharedSegment, slot_count: int) -> None:
        self.segment = segment
        self.slot_count = slot_count
        self._words = np.frombuffer(segment.buffer, dtype=np.uint64)

    @staticmethod
    def size_bytes(slot_count: int) -> int:
        return (_HEADER_FIXED_WORDS + slot_count * _GEN_STRIDE) * 8

    @classmethod
    def create(cls, name: str, slot_count: int, ring_epoch: int) -> GenerationHeader:
        header = cls(shm.SharedSegment.create(name, cls.size_bytes(slot_count)), slot_count)
        header._words[1] = ring_epoch
        header._words[2] = slot_count
        header._words[0] = _HEADER_MAGIC  # last: marks the header complete
        return header

    @classmethod
    def attach(cls, name: str, slot_count: int, ring_epoch: int) -> GenerationHeader:
        header = cls(shm.SharedSegment.attach(name, cls.size_bytes(slot_count)), slot_count)
        magic, epoch, count = (int(w) for w in header._words[:3])
        if magic != _HEADER_MAGIC or epoch != ring_epoch or count != slot_count:
            header.close()
            raise TransportUnavailable(
                f"generation header {name} belongs to another ring (epoch {epoch:x}, "
                f"{count} slots; expected epoch {ring_epoch:x}, {slot_count} slots)"
            )
        return header

    def _index(self, slot: int) -> int:
        return _HEADER_FIXED_WORDS + slot * _GEN_STRIDE

    def get(self, slot: int) -> int:
        return int(self._words[self._index(slot)])

    def begin_write(self, slot: int) -> None:
        self._words[self._index(slot)] += 1  # odd: being written

    def end_write(self, slot: int) -> int:
        self._words[self._index(slot)] += 1  # even: complete
        return int(self._words[self._index(slot)])

    def close(self) -> None:
        self._words = None
        self.segment.close()


# ================================================================================================
# Producer side (runs in the capture worker)
# ================================================================================================


class RingProducer(ABC):
    """Writes frames into slots round-robin and describes each one with a FrameReady message.

    Two ways in: `write(frame)` copies a finished frame in; `staging_view()` then
    `publish_staged()` let the frame be made in place (Note [Staged writes]).
    """

    transport: str

    def __init__(
        self, camera_id: str, frame_shape: tuple[int, ...], slot_count: int,
        fallback_reason: str = "", checksum_kind: frames.ChecksumKind = "full",
    ) -> None:
        self.camera_id = camera_id
        self.checksum_kind = frames.check_kind(checksum_kind)
        self.frame_shape = tuple(frame_shape)
        self.frame_dtype = np.dtype(np.uint8)
        self.frame_bytes = int(np.prod(frame_shape))
        self.slot_bytes = aligned(self.frame_bytes, SLOT_ALIGN_BYTES)
        self.slot_count = slot_count
        self.ring_epoch = new_epoch()
        self.fallback_reason = fallback_reason
        self._strides_bytes = np.empty(frame_shape, np.uint8).strides
        self._next_slot = 0
        self._staged_slot: int | None = None
        self._staged_view: np.ndarray | None = None
        self._corrupt_next = False
        self.header = GenerationHeader.create(
            shm.segment_name(camera_id, self.ring_epoch, "hdr"), slot_count, self.ring_epoch
        )

    def write(self, frame: np.ndarray, frame_seq: int, capture_ts_lsl: float) -> FrameReady:
        """Copy a finished frame (the caller's own memory) into the next slot and describe it."""
        if frame.shape != self.frame_shape or frame.dtype != self.frame_dtype:
            raise ValueError(
                f"camera {self.camera_id}: frame {frame.shape} {frame.dtype} does not fit the ring "
                f"({self.frame_shape} uint8); a new resolution needs a new ring"
            )
        slot = self._slot_for_a_write()
        return self._publish(slot, self._stage(slot, frame), frame_seq, capture_ts_lsl)

    def staging_view(self) -> np.ndarray:
        """Where the next frame's pixels go: a writable (frame_shape) uint8 array that a source
        can decode or render into, saving `write`'s copy (Note [Staged writes]). Asking again
        before `publish_staged` returns the same array."""
        if self._staged_view is None:
            slot = self._take_slot()
            self._staged_view = self._claim(slot)
            self._staged_slot = slot
        return self._staged_view

    def publish_staged(self, frame_seq: int, capture_ts_lsl: float) -> FrameReady:
        """Commit what was written into `staging_view()` and describe it."""
        slot, pixels = self._staged_slot, self._staged_view
        if pixels is None:
            raise RuntimeError(f"camera {self.camera_id}: nothing staged (call staging_view first)")
        self._staged_slot = self._staged_view = None
        return self._publish(slot, pixels, frame_seq, capture_ts_lsl)

    def _slot_for_a_write(self) -> int:
        """The slot a finished frame goes into: the staged one where a frame was staged (and is
        dropped, never published), else the next."""
        slot = self._take_slot() if self._staged_view is None else self._staged_slot
        self._staged_slot = self._staged_view = None
        return slot

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.slot_count
        return slot

    def _stage(self, slot: int, frame: np.ndarray) -> np.ndarray:
        """The frame's bytes in producer-private memory that `_commit` can take into the slot:
        by default the slot's staging memory, filled with a copy."""
        staging = self._claim(slot)
        self._fill(staging, frame)
        return staging

    def write_device(self, frame: torch.Tensor, frame_seq: int, capture_ts_lsl: float,
                     scratch: bool = False) -> FrameReady:
        """A finished frame made on a GPU (the caller's own tensor, ready on its current
        stream: Note [Frames born on the GPU]) into the next slot. Here, a ring in host memory:
        the frame comes to the producer's private host memory first and is written as any host
        frame is, its checksum taken from that copy. cuda_ring.CudaRingProducer copies it
        device to device instead. `scratch`: the caller will not read the frame again, so its
        memory may serve the checksum's arithmetic (the CUDA ring's; unused here)."""
        return self.write(frame.contiguous().cpu().numpy(), frame_seq, capture_ts_lsl)

    def write_decoded(self, frame, frame_seq: int, capture_ts_lsl: float) -> FrameReady:
        """A frame decoded on a GPU, as its decoder left it (capture's gpu_decoded.DecodedFrame:
        Note [NV12 into the slot]) into the next slot. Here, its BGR form as `write_device`
        takes it; cuda_ring.CudaRingProducer lets the frame write itself into the slot."""
        return self.write_device(frame.bgr(), frame_seq, capture_ts_lsl, scratch=True)

    def _publish(self, slot: int, pixels: np.ndarray, frame_seq: int,
                 capture_ts_lsl: float) -> FrameReady:
        return self._committed(slot, self._commit(slot, pixels), frame_seq, capture_ts_lsl)

    def _committed(self, slot: int, checksum: int, frame_seq: int,
                   capture_ts_lsl: float) -> FrameReady:
        """The slot's content is issued (generation odd): make it even and describe the frame."""
        generation = self.header.end_write(slot)
        if self._corrupt_next:
            self._corrupt_next = False
            self._corrupt_slot(slot)
        return FrameReady(
            camera_id=self.camera_id,
            transport=self.transport,
            ring_epoch=self.ring_epoch,
            slot=slot,
            slot_generation=generation,
            frame_seq=frame_seq,
            capture_ts_lsl=capture_ts_lsl,
            shape=self.frame_shape,
            dtype="uint8",
            strides_bytes=self._strides_bytes,
            pixel_format="bgr24",
            checksum=checksum,
        )

    def description(self) -> RingDescription:
        return RingDescription(
            camera_id=self.camera_id,
            transport=self.transport,
            ring_epoch=self.ring_epoch,
            slot_count=self.slot_count,
            slot_bytes=self.slot_bytes,
            frame_shape=self.frame_shape,
            frame_dtype=str(self.frame_dtype),
            header_name=self.header.segment.name,
            producer_pid=os.getpid(),
            fallback_reason=self.fallback_reason,
            checksum_kind=self.checksum_kind,
            **self._description_fields(),
        )

    # The stages of a frame (Note [Stage methods]).

    def _fill(self, staging: np.ndarray, frame: np.ndarray) -> None:
        """Stage "copy in": the finished frame into the staging view (what staged writes save)."""
        np.copyto(staging, frame)

    def _checksum(self, pixels: np.ndarray) -> int:
        """Stage "checksum", on the host: Note [Frame checksum] (or [Sparse checksum]) in
        frames.py."""
        return frames.checksum(pixels, self.checksum_kind)

    @abstractmethod
    def _claim(self, slot: int) -> np.ndarray:
        """Stage "claim": the slot's staging memory, private to this producer, writable."""

    @abstractmethod
    def _commit(self, slot: int, pixels: np.ndarray) -> int:
        """Make the staged pixels (producer-private) the slot's content (generation odd
        meanwhile); return their checksum, computed from `pixels`, never from the slot (Note
        [Checksum of what the camera gave]). The caller then makes the generation even."""

    @abstractmethod
    def _corrupt_slot(self, slot: int) -> None:
        """Fault injection: change the committed slot's bytes, generation intact."""

    @abstractmethod
    def _description_fields(self) -> dict: ...

    def corrupt_next_frame(self) -> None:
        """Fault injection (tests, the soak run): overwrite the next frame's slot once it is
        committed, keeping its generation, so that only a consumer's checksum can catch it."""
        self._corrupt_next = True

    def close(self) -> None:
        self.header.close()


class ShmRingProducer(RingProducer):
    """A frame goes from the producer's own memory into the shared-memory slot in one copy: the
    caller's frame for `write`, one private staging buffer for `staging_view`. Its checksum is
    computed from that private memory (Note [Checksum of what the camera gave])."""

    transport = "shm"

    def __init__(self, camera_id, frame_shape, slot_count, fallback_reason: str = "",
                 checksum_kind: frames.ChecksumKind = "full") -> None:
        super().__init__(camera_id, frame_shape, slot_count, fallback_reason, checksum_kind)
        try:
            self.data = shm.SharedSegment.create(
                shm.segment_name(camera_id, self.ring_epoch, "data"),
                self.slot_bytes * (slot_count + 1),  # + the probe slot
            )
        except BaseException:
            self.header.close()
            raise
        self._slots = np.frombuffer(self.data.buffer, np.uint8).reshape(slot_count + 1, -1)
        self._slots[slot_count, :] = frames.test_pattern(self.slot_bytes, self.ring_epoch)
        self._slot_views = [
            self._slots[slot, : self.frame_bytes].reshape(self.frame_shape)
            for slot in range(slot_count)
        ]
        self._private: np.ndarray | None = None  # staging_view's buffer, made on first use

    def _claim(self, slot: int) -> np.ndarray:
        if self._private is None:
            self._private = np.empty(self.frame_shape, np.uint8)
        return self._private

    def _stage(self, slot: int, frame: np.ndarray) -> np.ndarray:
        return frame  # the caller's own frame: private already, no staging copy

    def _commit(self, slot: int, pixels: np.ndarray) -> int:
        # Odd while the slot changes: a consumer that reads meanwhile drops what it read.
        self.header.begin_write(slot)
        np.copyto(self._slot_views[slot], pixels)
        return self._checksum(pixels)

    def _corrupt_slot(self, slot: int) -> None:
        # After the generation was committed and before the FrameReady goes out: every consumer
        # that reads this frame reads wrong bytes that only the checksum can catch.
        pixels = self._slots[slot, : self.frame_bytes]
        np.bitwise_not(pixels, out=pixels)

    def _description_fields(self) -> dict:
        return {"data_name": self.data.name}

    def close(self) -> None:
        self._slots = self._slot_views = self._staged_view = self._private = None
        self.data.close()
        super().close()


# ================================================================================================
# Consumer side (runs in every consumer, through facecast.shared.transport.subscriber: detection
# and roi_landmark workers, the console, the recorder, tests, benchmarks)
# ================================================================================================


class SlotRead:
    """The result of reading one frame: a tensor (if the verdict is OK; a numpy array from a
    host-only shm reader) and a late check."""

    __slots__ = ("verdict", "tensor", "_reader", "_message", "_checksum_due", "_checksum",
                 "_needs_sync")

    def __init__(self, verdict: Verdict, tensor: torch.Tensor | None, reader=None, message=None):
        self.verdict = verdict
        self.tensor = tensor
        self._reader = reader
        self._message = message
        # Between RingReader._start and _finish: whether this frame is to be checked, its
        # checksum (an int, or a frames.PendingChecksum still on the device; None when this
        # frame is not checked), and whether a copy to the device is in flight (Note [One sync
        # per batch]).
        self._checksum_due = False
        self._checksum = None
        self._needs_sync = False

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK



class RingReader(ABC):
    """A consumer's mapping of one ring epoch. Attach once per epoch; close when it changes.

    `read()` reads one frame; `read_batch()` reads the newest frame of several cameras with one
    host sync in all (Note [One sync per batch]). The ring's description says which checksum its
    frames carry: "full" is checked on every frame; "sampled" on 1 frame in `checksum_every`.
    """

    def __init__(self, description: RingDescription, checksum_every: int = 30) -> None:
        self.description = description
        self.ring_epoch = description.ring_epoch
        self.checksum_kind = frames.check_kind(description.checksum_kind)
        self.checksum_every = max(1, checksum_every)  # "sampled" rings only
        self.frame_shape = tuple(description.frame_shape)
        self.frame_bytes = int(np.prod(description.frame_shape))
        self.counts = {verdict: 0 for verdict in Verdict}
        self._frames_seen = 0
        self.header = GenerationHeader.attach(
            description.header_name, description.slot_count, description.ring_epoch
        )

    def read(self, message: FrameReady) -> SlotRead:
        return read_batch([(self, message)])[0]

    def _start(self, message: FrameReady, into: torch.Tensor | None = None) -> SlotRead:
        """Everything up to the host sync but the checksum (`start_checksums`): verdict,
        ordering, tensor. `into`: where the copy goes, a uint8 tensor of the frame's bytes on
        `copy_device` (Note [A batch's frames in one buffer]); None: memory of its own."""
        verdict = self._precheck(message)
        if verdict is not Verdict.OK:
            return SlotRead(verdict, None, self, message)
        read = SlotRead(Verdict.OK, None, self, message)
        self._wait_for_slot(message.slot)
        read.tensor = self._slot_tensor(message, read, into)
        self._frames_seen += 1
        read._checksum_due = (self.checksum_kind == "full"
                              or self._frames_seen % self.checksum_every == 0)
        return read

    def _finish(self, read: SlotRead) -> None:
        """After the sync, the copy complete: if the generation held all along, the copy is the
        frame (Note [Slot generations]); then the checksum's verdict; counts."""
        message = read._message
        if read.verdict is Verdict.OK and not self.generation_unchanged(message):
            read.verdict, read.tensor, read._checksum = Verdict.OVERWRITTEN, None, None
        if read.verdict is Verdict.OK and read._checksum is not None:
            if read._checksum != message.checksum:
                read.verdict, read.tensor = Verdict.CHECKSUM_MISMATCH, None
        read._checksum = None
        self.counts[read.verdict] += 1

    # The stages of a read (Note [Stage methods]).

    def _precheck(self, message: FrameReady) -> Verdict:
        """Stage "verdict": the message names this epoch, fits the ring, generation before."""
        if message.ring_epoch != self.ring_epoch:
            return Verdict.STALE_EPOCH
        if (
            tuple(message.shape) != self.frame_shape
            or not 0 <= message.slot < self.description.slot_count
        ):
            return Verdict.BAD_SHAPE
        if self.header.get(message.slot) != message.slot_generation:
            return Verdict.OVERWRITTEN
        return Verdict.OK

    def _wait_for_slot(self, slot: int) -> None:
        """Stage "event wait": order this process's reads after the producer's write."""

    @property
    def copy_device(self) -> torch.device | None:
        """The GPU this reader's copies go to asynchronously, where they may share a batch's
        buffer (Note [A batch's frames in one buffer]); None: copies of their own."""
        return None

    @abstractmethod
    def _slot_tensor(self, message: FrameReady, read: SlotRead,
                     into: torch.Tensor | None) -> torch.Tensor:
        """Stage "tensor": the frame as a tensor on the consumer's device (in `into`, shaped
        as the frame, when given)."""

    @abstractmethod
    def _checksum_start(self, message: FrameReady, read: SlotRead):
        """Stage "checksum": an int, or a frames.PendingChecksum that read_batch settles."""

    def generation_unchanged(self, message: FrameReady) -> bool:
        """Stage "generation after"."""
        return self.header.get(message.slot) == message.slot_generation

    def close(self) -> None:
        self.header.close()

    def close_at_exit(self) -> None:
        """Closed because the process is ending (its worker's stop): what the process's end
        frees anyway may be left to it (CudaRingReader: Note [Mappings left to the process's
        end])."""
        self.close()


def read_batch(requests: list[tuple[RingReader, FrameReady]]) -> list[SlotRead]:
    """Read one frame from each (reader, message): Note [One sync per batch]."""
    buffers = _batch_buffers(requests)
    reads = [reader._start(message, into) for (reader, message), into in zip(requests, buffers)]
    start_checksums(reads, buffers)
    settle(reads)
    for read in reads:
        read._reader._finish(read)
    return reads


def _batch_buffers(requests: list[tuple[RingReader, FrameReady]]) -> list[torch.Tensor | None]:
    """Per request, its slice of one buffer per device for the batch's copies (Note [A
    batch's frames in one buffer]), in the order of the requests; None for a reader whose
    copies are not made on a GPU."""
    devices = [reader.copy_device for reader, _ in requests]
    starts, sizes = [], {}  # each request's offset in its device's buffer; each buffer's size
    for (reader, _), device in zip(requests, devices):
        starts.append(sizes.get(device, 0))
        sizes[device] = starts[-1] + reader.frame_bytes
    sizes.pop(None, None)
    if not sizes:
        return [None] * len(requests)
    import torch

    buffers = {device: torch.empty(nbytes, dtype=torch.uint8, device=device)
               for device, nbytes in sizes.items()}
    return [None if device is None else buffers[device][start:start + reader.frame_bytes]
            for (reader, _), device, start in zip(requests, devices, starts)]


def start_checksums(reads: list[SlotRead], buffers: list[torch.Tensor | None]) -> None:
    """Stage "checksum" of a batch: the due checksums queued (or computed, on the host). Frames
    back to back in the batch's buffer, of one size in whole words, with the full checksum, go
    together (Note [Frames of a batch checksummed together]); the others one by one
    (`RingReader._checksum_start`)."""
    run: list[tuple[SlotRead, torch.Tensor]] = []  # reads whose copies are consecutive rows
    for read, into in zip(reads, buffers):
        reader = read._reader
        in_rows = (into is not None and reader.checksum_kind == "full"
                   and reader.frame_bytes % frames.WORD_BYTES == 0
                   and into.storage_offset() % frames.WORD_BYTES == 0)
        if run and not (in_rows and _next_row(run[-1][1], into)):
            _start_run_checksums(run)
            run = []
        if in_rows:
            run.append((read, into))
        elif read._checksum_due:
            read._checksum = reader._checksum_start(read._message, read)
    if run:
        _start_run_checksums(run)


def _next_row(last: torch.Tensor, into: torch.Tensor) -> bool:
    """Whether `into` starts where `last` ends, on its device, and has its size."""
    return (into.device == last.device and into.numel() == last.numel()
            and into.data_ptr() == last.data_ptr() + last.numel())


def _start_run_checksums(run: list[tuple[SlotRead, torch.Tensor]]) -> None:
    """The due checksums of a run of `start_checksums`: all rows at once when two or more are
    due (the row of a frame refused before its copy is computed too, and its value unused)."""
    due = [read for read, _ in run if read._checksum_due]
    if len(due) < 2:
        for read in due:
            read._checksum = read._reader._checksum_start(read._message, read)
        return
    first = run[0][1]
    rows = first.as_strided((len(run), first.numel()), (first.numel(), 1))
    for (read, _), pending in zip(run, frames.full_checksums_start(rows)):
        if read._checksum_due:
            read._checksum = pending


def settle(reads: list[SlotRead]) -> None:
    """Stage "settle": the one host sync per device of a batch (Note [One sync per batch])."""
    pending = [read for read in reads if isinstance(read._checksum, frames.PendingChecksum)]
    synced = set()
    if pending:
        values = frames.settle_checksums([read._checksum for read in pending])
        for read, value in zip(pending, values):
            synced.add(read._checksum.device_value.device)
            read._checksum = value
    for read in reads:
        if read._needs_sync:
            read._needs_sync = False
            device = read.tensor.device
            if device not in synced:
                import torch

                torch.cuda.current_stream(device).synchronize()
                synced.add(device)


class ShmRingReader(RingReader):
    """Copies the slot out of shared memory to the consumer's device, or (`device=None`, host
    only) into a numpy array without importing torch: the recorder and the console never load
    it (tests/test_import_weight.py), the checks the same (Note [Slot generations], Note [The
    consumer's own copy]).

    Note [Pinned shm mappings]
        A consumer on a GPU registers its mapping of the ring with the CUDA driver
        (cuMemHostRegister through PyCUDA, in the primary context; the ring's pages are then
        pinned for this process), so each frame goes to the GPU as one asynchronous DMA at
        pinned-memory speed instead of a synchronous pageable copy through the driver's bounce
        buffers. The copy is in flight until the batch's sync (Note [One sync per batch]); the
        generation check comes after it, so an overwrite during the DMA is still caught. The
        checksum is computed on the copy, where it is (queued on the GPU after the DMA, or with
        numpy on a CPU consumer's copy): what is checked is exactly what is handed on, and a
        third process that changed the slot after publishing is caught whatever the generation
        says. Registration is best effort: where it fails (no driver, a driver that refuses)
        frames take the pageable copy, and the log and `pin_failure` say why. The registration
        is undone before the mapping is closed.
    """

    def __init__(
        self, description, device: str | torch.device | None = "cpu", checksum_every: int = 30,
        pin: bool = True,
    ):
        super().__init__(description, checksum_every)
        if device is None:
            self.device = None  # host only: numpy copies, no torch
        else:
            import torch

            self.device = torch.device(device)
        slot_count, slot_bytes = description.slot_count, description.slot_bytes
        try:
            self.data = shm.SharedSegment.attach(description.data_name, slot_bytes * (slot_count + 1))
        except (OSError, ValueError) as exc:
            self.header.close()
            raise TransportUnavailable(f"cannot attach shm ring {description.data_name}: {exc}")
        self._slots = np.frombuffer(self.data.buffer, np.uint8).reshape(slot_count + 1, -1)
        self._registered = None
        probe = self._slots[slot_count]
        if not np.array_equal(probe, frames.test_pattern(slot_bytes, self.ring_epoch)):
            self.close()
            raise TransportUnavailable(
                f"shm ring {description.data_name}: probe slot does not hold this epoch's pattern"
            )
        # Per slot, once per epoch: the numpy view, and the CPU tensor over it for device copies.
        self._slot_arrays = [
            self._slots[slot, : self.frame_bytes].reshape(self.frame_shape)
            for slot in range(slot_count)
        ]
        self._slot_tensors = None
        self.pinned = False
        self.pin_failure = ""  # why the mapping is not pinned, where pinning was tried
        if self.device is not None and self.device.type == "cuda":
            import torch

            self._slot_tensors = [torch.from_numpy(array) for array in self._slot_arrays]
            if pin:
                self._pin()

    def _pin(self) -> None:
        """Note [Pinned shm mappings]."""
        try:
            # Imported here: cuda_driver imports torch, which a capture worker never needs.
            from facecast.shared.transport import cuda_driver

            pointer = self._slots.ctypes.data
            cuda_driver.register_host_range(self.device.index or 0, pointer, self._slots.nbytes)
            self._registered = pointer
            self.pinned = True
        except Exception as exc:  # TransportUnavailable, the driver's error: the pageable copy
            self.pin_failure = str(exc) or type(exc).__name__
            log.info("shm ring of %s: pageable copies to %s (pinning the mapping failed: %s)",
                     self.description.camera_id, self.device, exc)

    @property
    def copy_device(self) -> torch.device | None:
        return self.device if self.pinned else None

    def _slot_tensor(self, message: FrameReady, read: SlotRead,
                     into: torch.Tensor | None) -> torch.Tensor | np.ndarray:
        # A copy, so the slot may be reused as soon as the generation check after it passes.
        if self.device is None:
            return self._slot_arrays[message.slot].copy()
        import torch

        if self._slot_tensors is None:
            return torch.from_numpy(self._slot_arrays[message.slot].copy())
        source = self._slot_tensors[message.slot]
        if not self.pinned:
            return source.to(self.device)  # synchronous: complete when it returns
        tensor = (into.view(self.frame_shape) if into is not None
                  else torch.empty(self.frame_shape, dtype=torch.uint8, device=self.device))
        tensor.copy_(source, non_blocking=True)
        read._needs_sync = True
        return tensor

    def _checksum_start(self, message: FrameReady, read: SlotRead):
        # On the copy, where it is (Note [Pinned shm mappings]).
        if self.device is None:
            return frames.checksum(read.tensor, self.checksum_kind)
        if read.tensor.device.type == "cpu":
            return frames.checksum(read.tensor.numpy(), self.checksum_kind)
        return frames.checksum_start(read.tensor, self.checksum_kind)  # settled with the batch

    def close(self) -> None:
        if self._registered is not None:
            try:
                from facecast.shared.transport import cuda_driver

                cuda_driver.unregister_host_range(self.device.index or 0, self._registered)
            except Exception as exc:
                log.debug("unregistering shm ring mapping: %s", exc)
            self._registered = None
        self._slots = self._slot_arrays = self._slot_tensors = None
        self.data.close()
        super().close()
