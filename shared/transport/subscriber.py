"""The consumer side of a camera's frames: attached to its current ring, verified. Runs in every
consumer: the detection and roi_landmark workers, the console, the recorder, the output worker's
frame index, tests and benchmarks. It is the only code that attaches to a ring or speaks to a
ring's control socket, so a change to the protocol (descriptions, faults, epochs, mismatch events)
is made here and nowhere else.

What each consumer takes from it:
- `FrameSubscriber.receive`: the newest frame of each camera (the inference workers, the console);
- `FrameSubscriber.every_frame` and `read`: every frame, in order (the recorder: Note [Recording
  drops]);
- `FrameSubscriber(device=None)`: host only, numpy frames from shm rings and torch never imported
  (the console and the recorder, tests/test_import_weight.py);
- `FrameBus`: the frame buses' messages alone, no ring (the frame index: it never reads pixels).

Note [Reads on their own stream]
    On a GPU, a subscriber reads (the event wait, its own copy of the slot, the checksum and the
    batch's one sync: Note [One sync per batch]) on a CUDA stream of its own, not on the
    consumer's current stream. On the consumer's stream the read's sync would wait for whatever
    the consumer had queued before it: the roi_landmark worker reads the next frames while its
    previous batch is measured (Note [Reading while the device measures]), and there the sync
    waited for the whole batch, so that the frames were read only after it and the overlap was
    on the host alone. On a stream of their own the copies and checksums run beside the batch's
    kernels and the sync waits for them alone. The frames are then handed to the consumer's
    current stream: it waits for the read stream on the device (`wait_stream`: no host wait),
    and each frame's memory is marked as used on it (`record_stream`), so that the caching
    allocator does not give that memory to a later read while the consumer's kernels may still
    read it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pylsl

if TYPE_CHECKING:  # torch is imported where it is used, never by a host-only consumer
    import torch
import zmq

from facecast.shared.transport import endpoints, messages, rings
from facecast.shared.transport.frames import warm_up_checksums
from facecast.shared.transport.messages import (
    DescribeRing,
    FrameReady,
    MessageGate,
    RingDescription,
    TransportFault,
)
from facecast.shared.transport.publisher import TransportStatus
from facecast.shared.transport.ring_errors import TransportUnavailable
from facecast.shared.transport.rings import RingReader, Verdict

log = logging.getLogger(__name__)

DESCRIBE_RETRY_S = 0.5
# A camera's checksum mismatches reach the Markers stream at most this often (the first at
# once, then one with the count since): a flood of bad frames must not flood the stream.
MISMATCH_EVENT_INTERVAL_S = 10.0
NEWEST_FRAME_RCVHWM = 256  # messages queued on the frame bus: the newest frame is what counts
EVERY_FRAME_RCVHWM = 100_000  # every frame: deep enough for seconds of every camera's messages


def open_reader(
    description: RingDescription, device: str | torch.device | None = "cpu",
    checksum_every: int = 30, **options,
) -> RingReader:
    """Attach the ring a description names; raises TransportUnavailable with the reason. The
    consumer's counterpart of `make_producer`, here above both ring modules so that rings.py
    need not import cuda_ring.py (facecast.shared.transport.ring_errors says why).

    `device=None` is host only: an shm ring is read into numpy arrays without torch. A CUDA ring
    (only a producer on a GPU makes one) is always read through its GPU, whatever `device` says:
    its frames are device tensors, which `host_pixels` brings to the host (the NVENC encoder
    that would take them where they are is not built: Note [Encoders])."""
    if description.transport == "shm":
        return rings.ShmRingReader(description, device=device, checksum_every=checksum_every)
    from facecast.shared.transport.cuda_ring import CudaRingReader  # only where CUDA is used

    return CudaRingReader(description, checksum_every=checksum_every, **options)


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


def host_pixels(pixels: torch.Tensor | np.ndarray) -> np.ndarray:
    """A frame read as a numpy array in host memory: a host-only shm reader's copy as it is, a
    CUDA ring's device copy brought back (not run on a GPU yet: the CPU test machines have
    none)."""
    return pixels if isinstance(pixels, np.ndarray) else pixels.cpu().numpy()


class FrameBus:
    """The frame buses (`endpoints.frames`) of a set of cameras on one SUB socket, each message
    decoded through one gate: `RingDescription` when a ring changes, `FrameReady` for every
    frame. Every consumer's subscription; the frame index uses it alone, for the FrameReady
    messages (it never reads pixels, so it attaches no ring)."""

    def __init__(self, context: zmq.Context, runtime_dir: str | Path, source: str,
                 rcvhwm: int) -> None:
        self.runtime_dir = runtime_dir
        self.gate = MessageGate(source)
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)

    def add(self, camera_id: str) -> None:
        self.socket.connect(endpoints.frames(self.runtime_dir, camera_id))
        self.socket.setsockopt(zmq.SUBSCRIBE, camera_id.encode())

    def remove(self, camera_id: str) -> None:
        self.socket.setsockopt(zmq.UNSUBSCRIBE, camera_id.encode())
        self.socket.disconnect(endpoints.frames(self.runtime_dir, camera_id))

    def drain(self) -> Iterator[messages.AnyMessage | None]:
        """What is queued now, decoded, without blocking (bounded: MessageGate.drain)."""
        return self.gate.drain(self.socket)

    def close(self) -> None:
        self.socket.close()


@dataclass
class ReceivedFrame:
    message: FrameReady
    read: rings.SlotRead
    # pylsl.local_clock() when `receive` took the frame off the bus and when its checked copy was
    # ready (Note [Latency accounted]; 0 from `read`, which the every-frame consumers call).
    picked_up_ts_lsl: float = 0.0
    read_ts_lsl: float = 0.0

    @property
    def tensor(self) -> torch.Tensor | np.ndarray:
        """The frame, the consumer's own checked copy: on the subscriber's device, or a numpy
        array from a host-only subscriber's shm ring (a CUDA ring's stays on its GPU)."""
        return self.read.tensor


class FrameSubscriber:
    """Receives the frames of its cameras, attached to each one's current ring, verified: the
    newest of each camera (`receive`), or every one in order (`every_frame` and `read`, with
    `every_frame=True`, whose frame bus queues deep enough for seconds of frames). `device=None`
    reads host only (`open_reader`).

    Note [Mismatches are events]
        A frame whose bytes are not the ones the camera published is never handed on, and it is
        never only a counter: on a CUDA ring the camera falls back to shm (Note [Transport
        fallback]), on shm the frame is dropped; on both, `on_event` (a worker's `event`) gets a
        `frame_mismatch` event with the camera, transport, frame and reason, so that it reaches
        the Markers stream and a lab's recording says which data to distrust
        (`MismatchEvents`). The recorder, which reads every frame through `read`, reports its
        own here too.
    """

    def __init__(
        self,
        context: zmq.Context,
        runtime_dir: str | Path,
        camera_ids: list[str],
        device: str | torch.device | None = "cpu",
        checksum_every: int = 30,
        on_event: Callable[..., None] | None = None,
        every_frame: bool = False,
        **reader_options,
    ) -> None:
        self.mismatches = MismatchEvents(on_event)
        self.device = None  # host only (open_reader): torch is not imported
        if device is not None:
            import torch

            self.device = torch.device(device)
            warm_up_checksums(self.device)
        # Note [Reads on their own stream]
        self._read_stream = (torch.cuda.Stream(self.device)
                             if self.device is not None and self.device.type == "cuda" else None)
        self.checksum_every = checksum_every
        self._reader_options = reader_options
        self.readers: dict[str, rings.RingReader] = {}
        self.status = {camera_id: TransportStatus(camera_id) for camera_id in camera_ids}
        self._last_seq: dict[str, int] = {}
        self._describe_sent: dict[str, float] = {}
        self._faulted_epochs: set[int] = set()
        self.bus = FrameBus(context, runtime_dir, "frame bus",
                            EVERY_FRAME_RCVHWM if every_frame else NEWEST_FRAME_RCVHWM)
        self.control: dict[str, zmq.Socket] = {}
        for camera_id in camera_ids:
            self.bus.add(camera_id)
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoints.ring_control(runtime_dir, camera_id))
            self.control[camera_id] = dealer
        self._poller = zmq.Poller()
        self.register(self._poller)

    def register(self, poller: zmq.Poller) -> None:
        """Put this subscriber's sockets into a caller's poller, for `every_frame`: a consumer
        that waits on other sockets too (the recorder's results tap) polls them all at once."""
        poller.register(self.bus.socket, zmq.POLLIN)
        for dealer in self.control.values():
            poller.register(dealer, zmq.POLLIN)

    def receive(
        self, timeout_ms: int = 100, wanted: Callable[[str], bool] | None = None
    ) -> list[ReceivedFrame]:
        """Verified frames, at most one per camera (the newest); [] when nothing came in time.

        Blocks in one poll for at most timeout_ms, then takes whatever has arrived without
        blocking again, and reads the newest frame of every camera as one batch (Note [One sync
        per batch]). With `wanted`, only the cameras it accepts are read: the
        detection worker needs a camera's frame only when a pass is due, and reading the others
        would cost an event wait, or on shm a whole copy to the device, for nothing. Frames passed
        over this way are not counted as skipped."""
        newest: dict[str, FrameReady] = {}
        events = self._poller.poll(timeout_ms)
        picked_up_ts_lsl = pylsl.local_clock()
        if events:
            self._drain(events, newest)
        if not newest:
            return []
        frames = self._read_all(newest, wanted)
        read_ts_lsl = pylsl.local_clock()
        for frame in frames:
            frame.picked_up_ts_lsl, frame.read_ts_lsl = picked_up_ts_lsl, read_ts_lsl
        return frames

    def every_frame(self, events) -> Iterator[FrameReady]:
        """Every frame of the subscribed cameras that has arrived, in order, without blocking:
        `events` is a poll of the caller's poller (`register`). Rings are attached on the way,
        in the order their descriptions came, before the frames behind them. Each frame is read
        with `read` (or passed over) by the caller, who counts what it missed."""
        events = dict(events)
        for dealer in self.control.values():
            if dealer in events:  # a ring-control reply
                message = self.bus.gate.decode(dealer.recv())
                if isinstance(message, RingDescription) and message.camera_id in self.status:
                    self._attach(message)
        if self.bus.socket not in events:
            return
        for message in self.bus.drain():  # bounded: a flood cannot keep us here
            if isinstance(message, RingDescription) and message.camera_id in self.status:
                self._attach(message)
            elif isinstance(message, FrameReady) and message.camera_id in self.status:
                self._count_skipped(message)
                yield message

    def attached(self, message: FrameReady) -> bool:
        """Whether `message`'s ring is attached, so that `read` can read it; asks the camera for
        its description when not (every DESCRIBE_RETRY_S at most)."""
        return self._attached_reader(message) is not None

    def read(self, message: FrameReady) -> rings.SlotRead:
        """One frame (every-frame mode), verified and judged as `receive`'s frames are: a
        mismatch is acted on and reported here (Note [Mismatches are events]); its ring must be
        `attached`."""
        reader = self.readers[message.camera_id]
        with self._reading():
            read = reader.read(message)
        self._hand_over([read])
        self._judge(reader, message, read)
        return read

    def _drain(self, events, newest: dict[str, FrameReady]) -> None:
        """Stage "receive": everything waiting on the sockets, decoded; only the newest frame of
        each camera is kept (older ones are counted as skipped in _handle)."""
        for socket, _ in events:
            if socket is not self.bus.socket:  # a ring-control reply
                self._handle(self.bus.gate.decode(socket.recv()), newest)
        for message in self.bus.drain():  # bounded: a flood cannot keep us here
            self._handle(message, newest)

    def _read_all(
        self, newest: dict[str, FrameReady], wanted: Callable[[str], bool] | None
    ) -> list[ReceivedFrame]:
        requests = []
        for message in newest.values():
            reader = self._attached_reader(message)  # also keeps the ring attached while unwanted
            if reader is not None and (wanted is None or wanted(message.camera_id)):
                requests.append((reader, message))
        with self._reading():
            reads = rings.read_batch(requests)
        self._hand_over(reads)
        frames: list[ReceivedFrame] = []
        for (reader, message), read in zip(requests, reads):
            if self._judge(reader, message, read):
                frames.append(ReceivedFrame(message, read))
        return frames

    @contextlib.contextmanager
    def _reading(self):
        """Reads on this subscriber's own stream, on a GPU (Note [Reads on their own stream])."""
        if self._read_stream is None:
            yield
            return
        import torch

        with torch.cuda.stream(self._read_stream):
            yield

    def _hand_over(self, reads: list[rings.SlotRead]) -> None:
        """The frames read, ready for the consumer's current stream (Note [Reads on their own
        stream])."""
        if self._read_stream is None:
            return
        import torch

        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_stream(self._read_stream)
        for read in reads:
            if isinstance(read.tensor, torch.Tensor) and read.tensor.is_cuda:
                read.tensor.record_stream(consumer)

    def _handle(self, message, newest: dict[str, FrameReady]) -> None:
        if isinstance(message, RingDescription):
            self._attach(message)
        elif isinstance(message, FrameReady) and message.camera_id in self.status:
            # Counted as each message comes, not from the newest one's gap alone: a camera's
            # first frames can arrive just after its ring did (a consumer with no frame of it
            # yet), and those passed over must count too.
            self._count_skipped(message)
            if message.camera_id in newest:
                self.status[message.camera_id].counts["skipped"] += 1  # an older one passed over
            newest[message.camera_id] = message

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

    def _count_skipped(self, message: FrameReady) -> None:
        camera_id = message.camera_id
        last_seq = self._last_seq.get(camera_id)
        if last_seq is not None and message.frame_seq > last_seq + 1:
            # Frames this consumer never saw: dropped by ZeroMQ's high-water mark while we were
            # busy. Capture did not wait for us.
            self.status[camera_id].counts["skipped"] += message.frame_seq - last_seq - 1
        self._last_seq[camera_id] = message.frame_seq

    def _attached_reader(self, message: FrameReady) -> rings.RingReader | None:
        camera_id = message.camera_id
        reader = self.readers.get(camera_id)
        if reader is None or reader.ring_epoch != message.ring_epoch:
            self.status[camera_id].counts["awaiting_ring"] += 1
            self.request_description(camera_id)
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

    def request_description(self, camera_id: str) -> None:
        """Ask the camera for its ring's description (DescribeRing), at most every
        DESCRIBE_RETRY_S: a consumer that joined late or missed a description."""
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

    def close(self, at_exit: bool = False) -> None:
        """`at_exit`: the process is ending (its worker's stop): each reader's `close_at_exit`."""
        for reader in self.readers.values():
            if at_exit:
                reader.close_at_exit()
            else:
                reader.close()
        self.readers.clear()
        self.bus.close()
        for dealer in self.control.values():
            dealer.close()
