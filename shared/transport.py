"""Frames between processes: rings for the pixels, ZeroMQ for the messages that name them.

A capture worker owns a `FramePublisher` per camera; detection and ROI/landmark workers own a
`FrameSubscriber`. Per camera there are two sockets under the runtime directory:

- ``frames-<camera>``: PUB → SUB. `RingDescription` whenever the ring changes (new epoch), then
  `FrameReady` for every frame. Topic = camera id.
- ``ring-<camera>``: ROUTER (publisher) ← DEALER (subscribers). `DescribeRing` from a consumer
  that joined late or missed a description; `TransportFault` from a consumer that could not prove
  or keep trusting the camera's CUDA ring.

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
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: a capture worker never needs it
    import torch
import zmq

from facecast.shared import endpoints, frames, messages, rings
from facecast.shared.frames import warm_up_checksums
from facecast.shared.messages import (
    Ack,
    DescribeRing,
    FrameReady,
    MessageGate,
    RingDescription,
    TransportFault,
)
from facecast.shared.ring_errors import TransportUnavailable
from facecast.shared.rings import RingProducer, RingReader, ShmRingProducer, Verdict

log = logging.getLogger(__name__)

RETIRED_RING_GRACE_S = 3.0
DESCRIBE_RETRY_S = 0.5
# A camera's checksum mismatches reach the Markers stream at most this often (the first at
# once, then one with the count since): a flood of bad frames must not flood the stream.
MISMATCH_EVENT_INTERVAL_S = 10.0


frames_endpoint = endpoints.frames
ring_control_endpoint = endpoints.ring_control


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
        from facecast.shared.cuda_driver import cuda_unavailable_reason

        chosen, reason = choose_transport(requested, cuda_unavailable_reason())
    if chosen == "cuda_ipc":
        try:
            from facecast.shared.cuda_ring import CudaRingProducer

            return CudaRingProducer(camera_id, frame_shape, slot_count, device_index,
                                    checksum_kind=checksum_kind, **cuda_options)
        except TransportUnavailable as exc:
            reason = str(exc)
    if reason:
        level = logging.WARNING if requested == "cuda_ipc" else logging.INFO
        log.log(level, "camera %s uses shared memory: %s", camera_id, reason)
    return ShmRingProducer(camera_id, frame_shape, slot_count, fallback_reason=reason,
                           checksum_kind=checksum_kind)


def open_reader(
    description: RingDescription, device: str | torch.device = "cpu", checksum_every: int = 30,
    **options,
) -> RingReader:
    """Attach the ring a description names; raises TransportUnavailable with the reason. The
    consumer's counterpart of `make_producer`, here above both ring modules so that rings.py
    need not import cuda_ring.py (facecast.shared.ring_errors says why)."""
    if description.transport == "shm":
        return rings.ShmRingReader(description, device=device, checksum_every=checksum_every)
    from facecast.shared.cuda_ring import CudaRingReader  # only where CUDA is used

    return CudaRingReader(description, checksum_every=checksum_every, **options)


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


class MismatchEvents:
    """Note [Mismatches are events]: every checksum mismatch, on either transport, becomes a
    `frame_mismatch` event (to the Markers stream through the worker's `event`), at most one per
    camera per MISMATCH_EVENT_INTERVAL_S, each with the count since the last."""

    def __init__(self, send: Callable[..., None] | None) -> None:
        self._send = send
        self._last_monotonic: dict[str, float] = {}
        self._unsent: Counter = Counter()

    def add(self, message: FrameReady, reason: str) -> None:
        if self._send is None:
            return
        camera_id = message.camera_id
        self._unsent[camera_id] += 1
        now = time.monotonic()
        if now - self._last_monotonic.get(camera_id, -math.inf) < MISMATCH_EVENT_INTERVAL_S:
            return
        self._last_monotonic[camera_id] = now
        self._send("frame_mismatch", camera=camera_id, transport=message.transport,
                   frame_seq=message.frame_seq, frames=self._unsent.pop(camera_id),
                   reason=reason)


# ================================================================================================
# Producer side (runs in the capture worker)
# ================================================================================================


class FramePublisher:
    """Writes a camera's frames into its ring and publishes them; capture never waits.

    `publish(frame)` copies a finished frame in; a source that can make the frame where it is
    told to takes `staging_view(shape)`, fills it, and calls `publish_staged(ts)`, which saves
    that copy (Note [Staged writes] in rings.py). `checksum_kind` is what every frame's checksum
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
        self.frames.bind(frames_endpoint(runtime_dir, camera_id))
        self.control = context.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.control.bind(ring_control_endpoint(runtime_dir, camera_id))
        if transport != "shm":
            self._prepare_cuda()

    def _prepare_cuda(self) -> None:
        """Pay for torch, pycuda and the primary context now, not inside the first publish():
        that costs a second or two, and a camera must not stall (and then burst) its first
        frames behind it. Whether CUDA works is decided later, by make_producer."""
        from facecast.shared import cuda_driver

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

    def staging_view(self, frame_shape: tuple[int, ...]) -> np.ndarray:
        """Where the next frame goes: decode or render it into this (frame_shape) uint8 array,
        then call `publish_staged`; that saves `publish`'s copy (Note [Staged writes] in
        rings.py). Control requests are served here, not in `publish_staged`."""
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
        """Stage "send": encode and publish (Note [Stage methods] in rings.py)."""
        self.frame_seq += 1
        self.frames.send_multipart([self._topic, messages.encode(message)], copy=False)
        return message

    def serve_control(self) -> None:
        """Answer consumers' requests without blocking; call it often, frames or not."""
        while self.control.poll(0):
            identity, payload = self.control.recv_multipart()[:2]
            request = self._gate.decode(payload)
            if isinstance(request, DescribeRing) and self.producer is not None:
                self.control.send_multipart([identity, messages.encode(self.producer.description())])
            elif isinstance(request, TransportFault):
                self._on_fault(request)
                self.control.send_multipart([identity, messages.encode(Ack(reply_to=request.id))])
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


# ================================================================================================
# Consumer side (runs in detection / roi_landmark workers, tests, benchmarks)
# ================================================================================================


@dataclass
class ReceivedFrame:
    message: FrameReady
    read: rings.SlotRead

    @property
    def tensor(self) -> torch.Tensor:
        return self.read.tensor


class FrameSubscriber:
    """Receives the newest frame of each camera, attached to its current ring, verified.

    Note [Mismatches are events]
        A frame whose bytes are not the ones the camera published is never handed on, and it is
        never only a counter: on a CUDA ring the camera falls back to shm (Note [Transport
        fallback]), on shm the frame is dropped; on both, `on_event` (a worker's `event`) gets a
        `frame_mismatch` event with the camera, transport, frame and reason, so that it reaches
        the Markers stream and a lab's recording says which data to distrust
        (`MismatchEvents`). The recorder, which reads every frame, reports its own the same way.
    """

    def __init__(
        self,
        context: zmq.Context,
        runtime_dir: str | Path,
        camera_ids: list[str],
        device: str | torch.device = "cpu",
        checksum_every: int = 30,
        on_event: Callable[..., None] | None = None,
        **reader_options,
    ) -> None:
        import torch

        self.mismatches = MismatchEvents(on_event)
        self.device = torch.device(device)
        warm_up_checksums(self.device)
        self.checksum_every = checksum_every
        self._reader_options = reader_options
        self.readers: dict[str, rings.RingReader] = {}
        self.status = {camera_id: TransportStatus(camera_id) for camera_id in camera_ids}
        self._last_seq: dict[str, int] = {}
        self._describe_sent: dict[str, float] = {}
        self._faulted_epochs: set[int] = set()
        self._gate = MessageGate("frame bus")
        self.frames = context.socket(zmq.SUB)
        self.frames.setsockopt(zmq.LINGER, 0)
        self.frames.setsockopt(zmq.RCVHWM, 256)
        self.control: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._poller.register(self.frames, zmq.POLLIN)
        for camera_id in camera_ids:
            self.frames.connect(frames_endpoint(runtime_dir, camera_id))
            self.frames.setsockopt(zmq.SUBSCRIBE, camera_id.encode())
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(ring_control_endpoint(runtime_dir, camera_id))
            self.control[camera_id] = dealer
            self._poller.register(dealer, zmq.POLLIN)

    def receive(
        self, timeout_ms: int = 100, wanted: Callable[[str], bool] | None = None
    ) -> list[ReceivedFrame]:
        """Verified frames, at most one per camera (the newest); [] when nothing came in time.

        Blocks in one poll for at most timeout_ms, then takes whatever has arrived without
        blocking again, and reads the newest frame of every camera as one batch (Note [One sync
        per batch] in rings.py). With `wanted`, only the cameras it accepts are read: the
        detection worker needs a camera's frame only when a pass is due, and reading the others
        would cost an event wait, or on shm a whole copy to the device, for nothing. Frames passed
        over this way are not counted as skipped."""
        newest: dict[str, FrameReady] = {}
        events = self._poller.poll(timeout_ms)
        if events:
            self._drain(events, newest)
        return self._read_all(newest, wanted) if newest else []

    def _drain(self, events, newest: dict[str, FrameReady]) -> None:
        """Stage "receive": everything waiting on the sockets, decoded; only the newest frame of
        each camera is kept (older ones are counted as skipped in _reader_for)."""
        for socket, _ in events:
            if socket is not self.frames:  # a ring-control reply
                self._handle(self._gate.decode(socket.recv()), newest)
        for message in self._gate.drain(self.frames):  # bounded: a flood cannot keep us here
            self._handle(message, newest)

    def _read_all(
        self, newest: dict[str, FrameReady], wanted: Callable[[str], bool] | None
    ) -> list[ReceivedFrame]:
        requests = []
        for message in newest.values():
            reader = self._reader_for(message)  # also keeps the ring attached while unwanted
            if reader is not None and (wanted is None or wanted(message.camera_id)):
                requests.append((reader, message))
        frames: list[ReceivedFrame] = []
        for (reader, message), read in zip(requests, rings.read_batch(requests)):
            if self._judge(reader, message, read):
                frames.append(ReceivedFrame(message, read))
        return frames

    def _handle(self, message, newest: dict[str, FrameReady]) -> None:
        if isinstance(message, RingDescription):
            self._attach(message)
        elif isinstance(message, FrameReady) and message.camera_id in self.status:
            newest[message.camera_id] = message  # older ones are skipped, counted in _read

    def _attach(self, description: RingDescription) -> None:
        camera_id = description.camera_id
        current = self.readers.get(camera_id)
        if description.ring_epoch in self._faulted_epochs or (
            current is not None and current.ring_epoch == description.ring_epoch
        ):
            return
        if current is not None:
            current.close()  # a new epoch always means new handles (rule 2)
            del self.readers[camera_id]
        status = self.status[camera_id]
        try:
            reader = open_reader(
                description, device=self.device, checksum_every=self.checksum_every,
                **(self._reader_options if description.transport == "cuda_ipc" else {}),
            )
        except TransportUnavailable as exc:
            self._report_fault(camera_id, description.ring_epoch, str(exc))
            return
        self.readers[camera_id] = reader
        self._describe_sent.pop(camera_id, None)
        status.transport, status.ring_epoch = description.transport, description.ring_epoch
        status.reason = description.fallback_reason or (
            f"the camera publishes on a {description.transport} ring")
        if description.fallback_reason:
            status.fallback_reason = description.fallback_reason
        log.info("attached %s ring of camera %s (epoch %x)", description.transport, camera_id,
                 description.ring_epoch)

    def _reader_for(self, message: FrameReady) -> rings.RingReader | None:
        camera_id = message.camera_id
        status = self.status[camera_id]
        last_seq = self._last_seq.get(camera_id)
        if last_seq is not None and message.frame_seq > last_seq + 1:
            # Frames this consumer never read: drained as older than the newest, or dropped by
            # ZeroMQ's high-water mark while we were busy. Capture did not wait for us.
            status.counts["skipped"] += message.frame_seq - last_seq - 1
        self._last_seq[camera_id] = message.frame_seq
        reader = self.readers.get(camera_id)
        if reader is None or reader.ring_epoch != message.ring_epoch:
            status.counts["awaiting_ring"] += 1
            self._request_description(camera_id)
            return None
        return reader

    def _judge(self, reader: rings.RingReader, message: FrameReady, read: rings.SlotRead) -> bool:
        """Count the verdict, act on a mismatch; True when the frame may be handed on."""
        camera_id = message.camera_id
        status = self.status[camera_id]
        status.counts[read.verdict.value] += 1
        if read.verdict is Verdict.CHECKSUM_MISMATCH and message.transport == "cuda_ipc":
            reason = (f"checksum mismatch on frame {message.frame_seq} (slot {message.slot}): the "
                      "mapped GPU memory is not the frame the camera published")
            self._report_fault(camera_id, message.ring_epoch, reason)
            self.mismatches.add(message, reason)
        elif read.verdict is Verdict.CHECKSUM_MISMATCH:
            # shm is already the fallback: drop the frame, counted, and say so (never silently).
            reason = (f"checksum mismatch on frame {message.frame_seq} (slot {message.slot}): its "
                      "shared-memory slot does not hold the bytes the camera published")
            log.warning("camera %s: frame %d dropped: %s (%d so far)", camera_id,
                        message.frame_seq, reason, status.counts["checksum_mismatch"])
            self.mismatches.add(message, reason)
        return read.ok

    def _request_description(self, camera_id: str) -> None:
        now = time.monotonic()
        if now - self._describe_sent.get(camera_id, -1e9) >= DESCRIBE_RETRY_S:
            self._describe_sent[camera_id] = now
            self.control[camera_id].send(messages.encode(DescribeRing(camera_id=camera_id)))

    def _report_fault(self, camera_id: str, ring_epoch: int, reason: str) -> None:
        status = self.status[camera_id]
        status.fallback_reason = reason
        if ring_epoch in self._faulted_epochs:
            return
        self._faulted_epochs.add(ring_epoch)
        status.fallbacks += 1
        log.warning("camera %s: CUDA ring not trusted, asking for shared memory: %s", camera_id,
                    reason)
        reader = self.readers.pop(camera_id, None)
        if reader is not None:
            reader.close()
        fault = TransportFault(camera_id=camera_id, ring_epoch=ring_epoch, reason=reason)
        self.control[camera_id].send(messages.encode(fault))

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        self.frames.close()
        for dealer in self.control.values():
            dealer.close()
