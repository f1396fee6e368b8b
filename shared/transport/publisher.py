"""The producer side of a camera's frames: its ring and its frame bus. Runs in the capture worker
(and in tests and benchmarks that play a camera).

Note [Transport fallback]
    `transport = "auto"` tries cuda_ipc and falls back to shm when CUDA cannot be used here at all
    (`choose_transport`), when the ring cannot be created, and, at run time, when any consumer
    reports a `TransportFault`: its handshake failed (Note [Probe slot]), the mapping raised, or a
    sampled checksum did not match. The publisher then retires the CUDA ring (kept alive a few
    seconds so consumers can unmap it), creates a shm ring with the reason attached, and publishes
    its description before the next frame: the camera is on shm from the next frame on. The
    reason is logged, kept in `TransportStatus` (for `facecast status` and the marker stream), and
    never turned into "no faces". Explicit `cuda_ipc` behaves the same way, logged as a warning.

Note [Transport reasons]
    Every ring a camera gets has a reason, in `TransportStatus.reason`, and the capture worker's
    `transport` marker carries it: why CUDA IPC ('transport "auto": a CUDA IPC ring on GPU 0'),
    why shared memory (asked for in the config, the capture worker's own reason such as models
    running on the CPU, CUDA unusable here, a consumer's fault), and why a new ring at all (the
    frame size changed). `fallback_reason` stays what it was: set only while a camera is on shm
    although CUDA IPC was asked for. A marker with an empty reason was a camera switching rings
    without saying why; `FramePublisher._ring_reason` never returns one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pylsl
import zmq

from facecast.shared.transport import endpoints, frames, messages
from facecast.shared.transport.messages import (
    Ack,
    DescribeRing,
    FrameReady,
    MessageGate,
    TransportFault,
)
from facecast.shared.transport.ring_errors import TransportUnavailable
from facecast.shared.transport.rings import RingProducer, ShmRingProducer

log = logging.getLogger(__name__)

RETIRED_RING_GRACE_S = 3.0


def choose_transport(requested: str, cuda_unavailable_reason: str | None) -> tuple[str, str]:
    """(transport to try, reason it is shm) for a camera; a pure decision, tested on any machine."""
    if requested not in ("auto", "cuda_ipc", "shm"):
        raise ValueError(f"transport {requested!r} is not one of auto, cuda_ipc, shm")
    if requested == "shm":
        return "shm", ""
    if cuda_unavailable_reason:
        return "shm", cuda_unavailable_reason
    return "cuda_ipc", ""


def make_producer(
    camera_id: str,
    frame_shape: tuple[int, ...],
    slot_count: int,
    requested: str,
    device_index: int = 0,
    checksum_kind: frames.ChecksumKind = "full",
    **cuda_options,
) -> RingProducer:
    """The camera's ring: CUDA when asked for and possible, else shm with the reason attached."""
    if requested == "shm":
        chosen, reason = "shm", ""  # no CUDA probe: an shm-only process never imports torch
    else:
        from facecast.shared.transport.cuda_driver import cuda_unavailable_reason

        chosen, reason = choose_transport(requested, cuda_unavailable_reason())
    if chosen == "cuda_ipc":
        try:
            from facecast.shared.transport.cuda_ring import CudaRingProducer

            return CudaRingProducer(camera_id, frame_shape, slot_count, device_index,
                                    checksum_kind=checksum_kind, **cuda_options)
        except TransportUnavailable as exc:
            reason = str(exc)
    if reason:
        level = logging.WARNING if requested == "cuda_ipc" else logging.INFO
        log.log(level, "camera %s uses shared memory: %s", camera_id, reason)
    return ShmRingProducer(camera_id, frame_shape, slot_count, fallback_reason=reason,
                           checksum_kind=checksum_kind)


@dataclass
class TransportStatus:
    """What status and markers report about one camera's transport."""

    camera_id: str
    transport: str = ""
    ring_epoch: int = 0
    reason: str = ""  # why the camera is on this ring (Note [Transport reasons]); "" before one
    fallback_reason: str = ""
    fallbacks: int = 0
    counts: Counter = field(default_factory=Counter)



class FramePublisher:
    """Writes a camera's frames into its ring and publishes them; capture never waits.

    `publish(frame)` copies a finished frame in; a source that can make the frame where it is
    told to takes `staging_view(shape)`, fills it, and calls `publish_staged(ts)`, which saves
    that copy (Note [Staged writes]). `checksum_kind` is what every frame's checksum
    covers (frames.py; consumers follow the ring's description); `transport_reason` says why
    `transport` was asked for, when the caller chose it for a reason of its own.
    """

    def __init__(
        self,
        context: zmq.Context,
        runtime_dir: str | Path,
        camera_id: str,
        slot_count: int = 8,
        transport: str = "auto",
        device_index: int = 0,
        checksum_kind: frames.ChecksumKind = "full",
        transport_reason: str = "",
        **cuda_options,
    ) -> None:
        self.camera_id = camera_id
        self.slot_count = slot_count
        self.requested = transport
        self.transport_reason = transport_reason
        self.device_index = device_index
        self.checksum_kind = frames.check_kind(checksum_kind)
        self._cuda_options = cuda_options
        self.producer: RingProducer | None = None
        self.status = TransportStatus(camera_id)
        self.frame_seq = 0
        self.corrupt_pending = False
        self._staged = False  # staging_view() was handed out and not yet published
        self._retired: list[tuple[RingProducer, float]] = []
        self._gate = MessageGate(f"ring control of {camera_id}")
        self._topic = camera_id.encode()
        self.frames = context.socket(zmq.PUB)
        self.frames.setsockopt(zmq.LINGER, 0)
        self.frames.setsockopt(zmq.SNDHWM, 64)  # slow subscribers lose messages, never block us
        self.frames.bind(endpoints.frames(runtime_dir, camera_id))
        self.control = context.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.control.bind(endpoints.ring_control(runtime_dir, camera_id))
        if transport != "shm":
            self._prepare_cuda()

    def _prepare_cuda(self) -> None:
        """Pay for torch, pycuda and the primary context now, not inside the first publish():
        that costs a second or two, and a camera must not stall (and then burst) its first
        frames behind it. Whether CUDA works is decided later, by make_producer."""
        from facecast.shared.transport import cuda_driver

        try:
            cuda_driver.driver(self.device_index)
        except TransportUnavailable:
            pass

    def publish(self, frame: np.ndarray, capture_ts_lsl: float) -> FrameReady:
        """Copy a finished frame into the camera's ring and publish it."""
        self._ensure_ring(frame.shape)
        self._staged = False  # a frame staged and never published is dropped
        self._arm_corruption()
        return self._send(self.producer.write(frame, self.frame_seq, capture_ts_lsl))

    def publish_decoded(self, frame, capture_ts_lsl: float) -> FrameReady:
        """Write a frame decoded on the GPU, as its decoder left it (capture's
        gpu_decoded.DecodedFrame), into the camera's ring and publish it (Note [Frames born on
        the GPU]): on a CUDA ring the frame writes its BGR bytes into the slot itself where it
        can (Note [NV12 into the slot]), else its BGR tensor is copied device to device; on
        shm, through a host copy."""
        self._ensure_ring(tuple(frame.shape))
        self._staged = False  # a frame staged and never published is dropped
        self._arm_corruption()
        return self._send(self.producer.write_decoded(frame, self.frame_seq, capture_ts_lsl))

    def staging_view(self, frame_shape: tuple[int, ...]) -> np.ndarray:
        """Where the next frame goes: decode or render it into this (frame_shape) uint8 array,
        then call `publish_staged`; that saves `publish`'s copy (Note [Staged writes]). Control
        requests are served here, not in `publish_staged`."""
        self._ensure_ring(tuple(frame_shape))
        self._staged = True
        return self.producer.staging_view()

    def publish_staged(self, capture_ts_lsl: float) -> FrameReady:
        """Publish the frame written into `staging_view()`."""
        if not self._staged:
            raise RuntimeError(f"camera {self.camera_id}: publish_staged() without staging_view()")
        self._staged = False
        self._arm_corruption()
        return self._send(self.producer.publish_staged(self.frame_seq, capture_ts_lsl))

    def _ensure_ring(self, frame_shape: tuple[int, ...]) -> None:
        self.serve_control()
        if self.producer is None or self.producer.frame_shape != frame_shape:
            previous_shape = self.producer.frame_shape if self.producer is not None else None
            producer = make_producer(
                self.camera_id, frame_shape, self.slot_count, self.requested,
                self.device_index, self.checksum_kind, **self._cuda_options,
            )
            reason = self._ring_reason(producer)
            if previous_shape is not None:
                reason = (f"frames changed from {'x'.join(map(str, previous_shape))} to "
                          f"{'x'.join(map(str, frame_shape))}: a new ring; {reason}")
            self._replace_ring(producer, reason)

    def _ring_reason(self, producer: RingProducer) -> str:
        """Why `make_producer` gave this camera this ring (Note [Transport reasons])."""
        if producer.fallback_reason:
            return producer.fallback_reason  # shm although CUDA IPC was asked for: why
        if producer.transport == "cuda_ipc":
            return f'transport "{self.requested}": a CUDA IPC ring on GPU {self.device_index}'
        return self.transport_reason or 'transport "shm" was asked for'

    def _arm_corruption(self) -> None:
        if self.corrupt_pending:
            self.corrupt_pending = False
            self.producer.corrupt_next_frame()

    def _send(self, message: FrameReady) -> FrameReady:
        """Stage "send": stamp, encode and publish (Note [Stage methods])."""
        self.frame_seq += 1
        message = msgspec.structs.replace(message, published_ts_lsl=pylsl.local_clock())
        self.frames.send_multipart([self._topic, messages.encode(message)], copy=False)
        return message

    def serve_control(self) -> None:
        """Answer consumers' requests without blocking; call it often, frames or not. (The
        socket's EVENTS, not a poll: a capture thread asks twice a frame, and each `poll(0)`
        made a Poller, 24 us of CPU.)"""
        while self.control.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            identity, payload = self.control.recv_multipart()[:2]
            request = self._gate.decode(payload)
            if isinstance(request, DescribeRing) and self.producer is not None:
                self.control.send_multipart([identity, messages.encode(self.producer.description())])
            elif isinstance(request, TransportFault):
                self._on_fault(request)
                self.control.send_multipart([identity, messages.encode(Ack(reply_to=request.id))])
        if not self._retired:
            return
        now = time.monotonic()
        for producer, deadline in list(self._retired):
            if now >= deadline:
                producer.close()
                self._retired.remove((producer, deadline))

    def _on_fault(self, fault: TransportFault) -> None:
        producer = self.producer
        if producer is None or fault.ring_epoch != producer.ring_epoch:
            return  # about an earlier ring: already handled
        if producer.transport != "cuda_ipc":
            log.error("camera %s: shm ring reported faulty: %s", self.camera_id, fault.reason)
            return
        reason = fault.reason or "a consumer reported a fault and gave no reason"
        log.warning("camera %s falls back to shared memory: %s", self.camera_id, reason)
        self.status.fallbacks += 1
        self._replace_ring(ShmRingProducer(
            self.camera_id, producer.frame_shape, self.slot_count, fallback_reason=reason,
            checksum_kind=self.checksum_kind,
        ), reason)

    def _replace_ring(self, producer: RingProducer, reason: str) -> None:
        if self.producer is not None:
            if self._staged and self.producer.frame_shape == producer.frame_shape:
                # A fallback served while a frame was staged: carry the frame over (rare: once).
                np.copyto(producer.staging_view(), self.producer.staging_view())
            else:
                self._staged = False
            self._retired.append((self.producer, time.monotonic() + RETIRED_RING_GRACE_S))
        self.producer = producer
        self.status.transport = producer.transport
        self.status.ring_epoch = producer.ring_epoch
        self.status.reason = reason
        self.status.fallback_reason = producer.fallback_reason
        # In band, before the first frame of the new epoch: consumers switch without a round trip.
        self.frames.send_multipart([self._topic, messages.encode(producer.description())])

    def corrupt_next_frame(self) -> None:
        """Fault injection for tests and the soak run: the next published frame's slot is
        overwritten once committed, generation intact, in whichever ring that frame goes to."""
        self.corrupt_pending = True

    def close(self) -> None:
        for producer in [p for p, _ in self._retired] + ([self.producer] if self.producer else []):
            producer.close()
        self._retired.clear()
        self.producer = None
        self.frames.close()
        self.control.close()
