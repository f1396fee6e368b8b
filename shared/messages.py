"""Typed, versioned messages that travel over ZeroMQ between facecast processes.

Every message is a msgspec struct tagged with its ``type``, carrying the protocol version ``v``
and an ``id``; replies echo the request's id in ``reply_to`` (STYLE.md §4). Readers are
tolerant: unknown fields are ignored, so a newer sender can add fields. A message of another
protocol version, a truncated or garbage message is refused with a `BadMessage` that says why;
`MessageGate` turns those into a rate-limited log line and a counter, never into an exception
that could kill a worker.

Pixels never travel here: a `FrameReady` names a slot of a ring (see facecast.shared.rings).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Literal, Union

import msgspec

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1

TransportKind = Literal["cuda_ipc", "shm"]

_ids = itertools.count(1)


def next_message_id() -> str:
    """Process-unique, cheap correlation id: `<pid>-<counter>`."""
    return f"{os.getpid()}-{next(_ids)}"


class BadMessage(ValueError):
    """A message that cannot be used; the text says why (for the log)."""


class Message(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION
    id: str = msgspec.field(default_factory=next_message_id)


# --- frames and rings ----------------------------------------------------------------------------


class FrameReady(Message, tag="frame"):
    """One captured frame, now readable in a ring slot."""

    camera_id: str
    transport: TransportKind
    ring_epoch: int  # changes whenever the producer (re)allocates the ring
    slot: int
    slot_generation: int  # the slot's seqlock value once this frame was complete (even)
    frame_seq: int  # per camera, counts every captured frame, dropped or not
    capture_ts_lsl: float  # pylsl.local_clock() at grab
    shape: tuple[int, ...]
    dtype: str
    strides_bytes: tuple[int, ...]
    pixel_format: str  # "bgr24"
    checksum: int  # facecast.shared.frames.sparse_checksum of the frame's bytes


class CudaRingHandles(msgspec.Struct, frozen=True):
    """What a consumer needs to map a CUDA ring (see Note [CUDA IPC rules] in cuda_ring.py)."""

    mem_handle: bytes  # cuIpcGetMemHandle of the allocation
    offset_bytes: int  # from the allocation base to slot 0 (cuMemGetAddressRange)
    allocation_bytes: int
    event_handles: list[bytes]  # one interprocess event per slot
    device_uuid: str  # the GPU the ring lives on
    device_index: int
    driver_version: int


class RingDescription(Message, tag="ring"):
    """Everything a consumer needs to attach a camera's ring for one epoch."""

    camera_id: str
    transport: TransportKind
    ring_epoch: int
    slot_count: int
    slot_bytes: int  # bytes reserved per slot (>= frame bytes, aligned)
    frame_shape: tuple[int, ...]
    frame_dtype: str
    header_name: str  # POSIX shm name of the generation header (both transports)
    data_name: str = ""  # POSIX shm name of the pixels (shm transport)
    cuda: CudaRingHandles | None = None
    producer_pid: int = 0
    fallback_reason: str = ""  # why this camera is on shm although cuda_ipc was asked for


# --- control between a frame consumer and the capture worker --------------------------------------


class DescribeRing(Message, tag="describe_ring"):
    camera_id: str


class TransportFault(Message, tag="transport_fault"):
    """A consumer could not trust the camera's CUDA ring; the producer must fall back to shm."""

    camera_id: str
    ring_epoch: int
    reason: str


class Ack(Message, tag="ack"):
    reply_to: str
    ok: bool = True
    error: str = ""


AnyMessage = Union[FrameReady, RingDescription, DescribeRing, TransportFault, Ack]

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder()  # untyped: reads type and version first
_typed_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> AnyMessage:
    """Decode one message, refusing other protocol versions with a reason."""
    try:
        envelope = _envelope_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadMessage(f"not msgpack ({len(payload)} bytes): {exc}") from None
    if not isinstance(envelope, dict):
        raise BadMessage(f"not a message envelope but a {type(envelope).__name__}")
    version = envelope.get("v")
    if version != PROTOCOL_VERSION:
        raise BadMessage(
            f"protocol version {version!r} of a {envelope.get('type')!r} message is not "
            f"supported (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        return _typed_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise BadMessage(f"invalid {envelope.get('type')!r} message: {exc}") from None


class MessageGate:
    """Decodes incoming messages for a worker, logging refusals at most once per interval."""

    def __init__(self, source: str, log_interval_s: float = 10.0) -> None:
        self.source = source
        self.rejected = 0
        self.last_reason = ""
        self._log_interval_s = log_interval_s
        self._next_log_monotonic = 0.0
        self._suppressed = 0

    def decode(self, payload: bytes) -> AnyMessage | None:
        try:
            return decode(payload)
        except BadMessage as exc:
            self._reject(str(exc))
            return None

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        self.last_reason = reason
        now = time.monotonic()
        if now >= self._next_log_monotonic:
            more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
            log.warning("dropped a message from %s: %s%s", self.source, reason, more)
            self._next_log_monotonic = now + self._log_interval_s
            self._suppressed = 0
        else:
            self._suppressed += 1
