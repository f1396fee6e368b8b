"""Per-camera frame rings: one producer (the capture worker), many consumers in other processes.

Two implementations share one protocol (DESIGN.md §2): `ShmRingProducer`/`ShmRingReader` keep
the pixels in POSIX shared memory; `facecast.shared.cuda_ring` keeps them in GPU memory shared over
CUDA IPC. Both keep the per-slot generations in a small shared-memory header (`GenerationHeader`),
both reserve one extra *probe slot* holding a known test pattern for the handshake, and both
describe themselves with a `RingDescription` message.

Note [Slot generations]
    Capture never waits for consumers, so a slot can be overwritten while someone reads it. Each
    slot has a 64-bit generation in the header, seqlock style: the producer makes it odd before it
    starts writing the slot and even (the next value) once the write is issued; the even value goes
    into the FrameReady message. A consumer compares the header with the message before it reads
    and again after it has finished using the data (for a GPU view: after its stream has
    finished). Any difference means the frame was overwritten: the result is dropped and counted,
    never handed on. DESIGN.md §2 rule 4; guarded by tests/test_shm_ring.py and
    tests/gpu/test_cuda_rules.py::test_rule4_*.

Note [Probe slot]
    Slot `slot_count` (one past the last frame slot) never carries frames. The producer fills it
    with `frames.test_pattern(slot_bytes, epoch)` when it creates the ring; a consumer compares it
    byte for byte, through its own mapping, before it accepts any frame of that epoch. A mapping at
    the wrong address, of the wrong allocation or of an earlier epoch cannot pass.
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

from facecast.shared import frames, shm
from facecast.shared.messages import FrameReady, RingDescription

log = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 4096
_HEADER_MAGIC = 0xFACECA57
_GEN_STRIDE = 8  # uint64 words per slot: one cache line, so slots don't share lines
_HEADER_FIXED_WORDS = 8  # magic, epoch, slot_count, reserved


class TransportUnavailable(RuntimeError):
    """This process cannot use a ring of this transport; the message is the reason (for status)."""


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
    """Writes frames into slots round-robin and describes each one with a FrameReady message."""

    transport: str

    def __init__(
        self, camera_id: str, frame_shape: tuple[int, ...], slot_count: int, fallback_reason: str = ""
    ) -> None:
        self.camera_id = camera_id
        self.frame_shape = tuple(frame_shape)
        self.frame_dtype = np.dtype(np.uint8)
        self.frame_bytes = int(np.prod(frame_shape))
        self.slot_bytes = aligned(self.frame_bytes, SLOT_ALIGN_BYTES)
        self.slot_count = slot_count
        self.ring_epoch = new_epoch()
        self.fallback_reason = fallback_reason
        self._strides_bytes = np.empty(frame_shape, np.uint8).strides
        self._next_slot = 0
        self.header = GenerationHeader.create(
            shm.segment_name(camera_id, self.ring_epoch, "hdr"), slot_count, self.ring_epoch
        )

    def write(self, frame: np.ndarray, frame_seq: int, capture_ts_lsl: float) -> FrameReady:
        if frame.shape != self.frame_shape or frame.dtype != self.frame_dtype:
            raise ValueError(
                f"camera {self.camera_id}: frame {frame.shape} {frame.dtype} does not fit the ring "
                f"({self.frame_shape} uint8); a new resolution needs a new ring"
            )
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.slot_count
        checksum = frames.sparse_checksum(frame)
        self.header.begin_write(slot)
        self._copy_into_slot(slot, frame)
        generation = self.header.end_write(slot)
        return FrameReady(
            camera_id=self.camera_id,
            transport=self.transport,
            ring_epoch=self.ring_epoch,
            slot=slot,
            slot_generation=generation,
            frame_seq=frame_seq,
            capture_ts_lsl=capture_ts_lsl,
            shape=self.frame_shape,
            dtype=str(self.frame_dtype),
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
            **self._description_fields(),
        )

    @abstractmethod
    def _copy_into_slot(self, slot: int, frame: np.ndarray) -> None: ...

    @abstractmethod
    def _description_fields(self) -> dict: ...

    @abstractmethod
    def corrupt_next_frame(self) -> None:
        """Fault injection (tests, the soak run): overwrite the next frame's slot once it is
        committed, keeping its generation, so that only a consumer's checksum can catch it."""

    def close(self) -> None:
        self.header.close()


class ShmRingProducer(RingProducer):
    transport = "shm"

    def __init__(self, camera_id, frame_shape, slot_count, fallback_reason: str = "") -> None:
        super().__init__(camera_id, frame_shape, slot_count, fallback_reason)
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
        self._corrupt_next = False

    def write(self, frame: np.ndarray, frame_seq: int, capture_ts_lsl: float) -> FrameReady:
        message = super().write(frame, frame_seq, capture_ts_lsl)
        if self._corrupt_next:
            # Fault injection: the slot changes after its generation was committed and before the
            # FrameReady goes out, so every consumer that reads this frame reads wrong bytes that
            # only the checksum can catch (as CudaRingProducer.write does on the GPU).
            self._corrupt_next = False
            pixels = self._slots[message.slot, : self.frame_bytes]
            np.bitwise_not(pixels, out=pixels)
        return message

    def corrupt_next_frame(self) -> None:
        self._corrupt_next = True

    def _copy_into_slot(self, slot: int, frame: np.ndarray) -> None:
        np.copyto(self._slots[slot, : self.frame_bytes].reshape(self.frame_shape), frame)

    def _description_fields(self) -> dict:
        return {"data_name": self.data.name}

    def close(self) -> None:
        self._slots = None
        self.data.close()
        super().close()


# ================================================================================================
# Consumer side (runs in detection / roi_landmark workers, tests, benchmarks)
# ================================================================================================


class SlotRead:
    """The result of reading one frame: a tensor (if the verdict is OK) and a late check."""

    __slots__ = ("verdict", "tensor", "_reader", "_message")

    def __init__(self, verdict: Verdict, tensor: torch.Tensor | None, reader=None, message=None):
        self.verdict = verdict
        self.tensor = tensor
        self._reader = reader
        self._message = message

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK

    def still_valid(self) -> bool:
        """After the data was used (GPU work finished), was the slot left alone all along?"""
        if not self.ok:
            return False
        if not self._reader.zero_copy:
            return True  # the tensor is our own copy, checked when it was made
        return self._reader.generation_unchanged(self._message)


class RingReader(ABC):
    """A consumer's mapping of one ring epoch. Attach once per epoch; close when it changes."""

    zero_copy: bool  # True: read() returns a view of the slot, valid only while the slot is
    def __init__(self, description: RingDescription, checksum_every: int = 30) -> None:
        self.description = description
        self.ring_epoch = description.ring_epoch
        self.checksum_every = max(1, checksum_every)
        self.frame_bytes = int(np.prod(description.frame_shape))
        self.counts = {verdict: 0 for verdict in Verdict}
        self._frames_seen = 0
        self.header = GenerationHeader.attach(
            description.header_name, description.slot_count, description.ring_epoch
        )

    def read(self, message: FrameReady) -> SlotRead:
        verdict = self._precheck(message)
        if verdict is Verdict.OK:
            tensor = self._read_slot(message)
            verdict, tensor = self._postcheck(message, tensor)
        else:
            tensor = None
        self.counts[verdict] += 1
        return SlotRead(verdict, tensor, self, message)

    def _precheck(self, message: FrameReady) -> Verdict:
        if message.ring_epoch != self.ring_epoch:
            return Verdict.STALE_EPOCH
        if (
            tuple(message.shape) != tuple(self.description.frame_shape)
            or not 0 <= message.slot < self.description.slot_count
        ):
            return Verdict.BAD_SHAPE
        if self.header.get(message.slot) != message.slot_generation:
            return Verdict.OVERWRITTEN
        return Verdict.OK

    def _postcheck(self, message: FrameReady, tensor: torch.Tensor):
        self._frames_seen += 1
        if self._frames_seen % self.checksum_every == 0:
            if frames.sparse_checksum_tensor(tensor) != message.checksum:
                # The generation may explain it (overwritten while we read): say which.
                if not self.generation_unchanged(message):
                    return Verdict.OVERWRITTEN, None
                return Verdict.CHECKSUM_MISMATCH, None
        return Verdict.OK, tensor

    def generation_unchanged(self, message: FrameReady) -> bool:
        return self.header.get(message.slot) == message.slot_generation

    @abstractmethod
    def _read_slot(self, message: FrameReady) -> torch.Tensor: ...

    def close(self) -> None:
        self.header.close()


class ShmRingReader(RingReader):
    """Copies the slot out of shared memory to the consumer's device."""

    zero_copy = False

    def __init__(self, description, device: str | torch.device = "cpu", checksum_every: int = 30):
        super().__init__(description, checksum_every)
        import torch

        self.device = torch.device(device)
        slot_count, slot_bytes = description.slot_count, description.slot_bytes
        try:
            self.data = shm.SharedSegment.attach(description.data_name, slot_bytes * (slot_count + 1))
        except (OSError, ValueError) as exc:
            self.header.close()
            raise TransportUnavailable(f"cannot attach shm ring {description.data_name}: {exc}")
        self._slots = np.frombuffer(self.data.buffer, np.uint8).reshape(slot_count + 1, -1)
        probe = self._slots[slot_count]
        if not np.array_equal(probe, frames.test_pattern(slot_bytes, self.ring_epoch)):
            self.close()
            raise TransportUnavailable(
                f"shm ring {description.data_name}: probe slot does not hold this epoch's pattern"
            )

    def _read_slot(self, message: FrameReady) -> torch.Tensor:
        import torch

        view = self._slots[message.slot, : self.frame_bytes].reshape(message.shape)
        # A copy, so the slot may be reused as soon as the generation check below passes.
        tensor = torch.from_numpy(view.copy()) if self.device.type == "cpu" else torch.from_numpy(
            view
        ).to(self.device)
        return tensor

    def _postcheck(self, message, tensor):
        # The copy is complete: if the generation held during it, the copy is the frame.
        if not self.generation_unchanged(message):
            return Verdict.OVERWRITTEN, None
        return super()._postcheck(message, tensor)

    def close(self) -> None:
        self._slots = None
        self.data.close()
        super().close()


def open_reader(
    description: RingDescription, device: str | torch.device = "cpu", checksum_every: int = 30, **options
) -> RingReader:
    """Attach the ring a description names; raises TransportUnavailable with the reason."""
    if description.transport == "shm":
        return ShmRingReader(description, device=device, checksum_every=checksum_every)
    from facecast.shared.cuda_ring import CudaRingReader  # only where CUDA is used

    return CudaRingReader(description, checksum_every=checksum_every, **options)
