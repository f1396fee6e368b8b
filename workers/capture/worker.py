"""The capture worker: the cameras of one capture group (Note [Capture groups]), each on a thread
of its own, so that a hung or dead source stays with
its camera.

Each camera (`CameraCapture`) reads its frames (facecast.workers.capture.sources), stamps them at grab
with `pylsl.local_clock()`, writes them into its ring and publishes them
(facecast.shared.transport.publisher.FramePublisher). It never waits for consumers. A lost source is
reported (`camera_lost` marker), retried with exponential backoff (sources.ReopenBackoff, the one
reconnect policy) while the group's other cameras go on, and reported again when it is back
(`camera_back`). A source that can never work (`SourceConfigError`, or a `SourceNotFound` at the
camera's first open: Note [Sources that can never work]) is given up on: not
retried, a `camera_failed` marker, and status says why; a worker whose every camera is given up on
is a boot error, which the supervisor does not respawn.

Note [Camera threads]
    A camera's thread does all of its camera's work, CUDA included: it creates the ring (so the
    ring's CUDA calls run on the thread that pushed the device's primary context, DESIGN §2
    rule 5), reads, publishes and answers its consumers' ring requests. Sources block in C
    (decoding, a socket, a driver) with the GIL released, so the threads of a group run side by
    side. The worker's main thread only talks to the supervisor: it forwards the cameras'
    events (ZeroMQ sockets are not thread-safe, so threads queue them), heartbeats, and watches
    its threads: one that raised ends the worker (a crash: the supervisor restarts the group,
    its warm spare first), one that made no progress for `daemon.heartbeat_timeout_s` (reads
    and opens time out after 5 s) ends it as hung.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time

import cv2
import numpy as np

from facecast.shared.config import CameraConfig, Config
from facecast.shared.transport.messages import CameraReport, InjectFault
from facecast.shared.stats import RateMeter
from facecast.shared.transport.publisher import FramePublisher
from facecast.workers.base import BootError, Worker
from facecast.workers.capture.decoding import (
    DecodeChoice,
    DecodeRequest,
    GpuDecodeFailed,
    is_trouble,
    may_use_nvdec,
)
from facecast.workers.capture.sources import (
    FrameSource,
    ReopenBackoff,
    SourceConfigError,
    SourceLost,
    SourceNotFound,
    drop_loops_made_ahead,
    make_loops_ahead,
    open_source,
    source_kind,
)

log = logging.getLogger(__name__)

REOPEN_FIRST_DELAY_S = 0.5
REOPEN_MAX_DELAY_S = 30.0
# Below the supervisor's heartbeat timeout: opening or reading a dead stream must not look like
# a hung camera.
OPEN_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 5.0
FIRST_OPEN_WAIT_S = OPEN_TIMEOUT_S + 30.0  # boot waits this long for every camera's first open
# At stop, how long the camera threads get to finish their step and close their decoder and
# ring: 16 NVDEC cameras of one process took over 1 s (H100, 2026-11-26); within the share of
# daemon.stop_timeout_s that capture gets (Note [Capture and inference stop together]).
STOP_JOIN_S = 2.0
SLOW_CLOSE_S = 0.5  # a camera's close longer than this says where its time went
# What status adds to a camera given up on (Note [Sources that can never work]).
NOT_RETRIED = ("not retried: it can never work as configured (correct the source and `facecast "
               "reload`, or put the file or device in place and restart facecast)")


def one_thread_per_camera() -> None:
    """Each camera has its own capture thread: that is the parallelism. OpenCV's and torch's
    thread pools add one thread per core that waits, spinning, between frames: on the 16-core
    GPU host one 1080p30 synthetic camera's capture worker was 1.3 cores busy where its
    rendering takes ~0.25 (bench/pipeline.py's CPU by role shows the effect of this). FFmpeg's
    decoding threads are its own and stay as they are."""
    cv2.setNumThreads(1)
    torch = sys.modules.get("torch")  # imported only on the CUDA path
    if torch is not None:
        torch.set_num_threads(1)


class CameraCapture:
    """One camera of a capture worker, run by its own thread (Note [Camera threads])."""

    def __init__(self, camera: CameraConfig, config: Config, worker: CaptureWorker) -> None:
        self.camera = camera
        self.config = config
        self.worker = worker
        self.publisher: FramePublisher | None = None
        self.source: FrameSource | None = None
        self.source_state = "opening"
        self.lost_reason = ""
        self.rate = RateMeter()
        self.reopen = ReopenBackoff(first_delay_s=REOPEN_FIRST_DELAY_S,
                                    max_delay_s=REOPEN_MAX_DELAY_S)
        self.progress_monotonic = time.monotonic()
        self.first_open_done = threading.Event()
        self.error: BaseException | None = None  # what ended the thread, if anything
        self.boot_error = ""
        self.given_up = ""  # why its source can never work (Note [Sources that can never work])
        # Its decoder and why (Note [Decoder choice]); the trouble status shows, if any.
        self.decode: DecodeChoice | None = None
        self.decode_trouble = ""
        self.gpu_decode_failed = ""  # Note [GPU decoder failing mid-stream]
        self._opened_once = False
        self._started_monotonic = time.monotonic()  # when its thread started (_run)
        self._boot_spans = ""  # its ring's and source's share of that start, once known
        self._was_lost = False
        self._seen_epoch = 0
        self._seen_fallbacks = 0
        # Fault injection arrives on the worker's main thread; the camera thread takes it from
        # here, so that the frame it spoils and the frame its marker names are the same one.
        self._fault_requests: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"capture-{camera.id}",
                                       daemon=True)

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        self._started_monotonic = time.monotonic()
        try:
            self._boot()
            self.progress_monotonic = time.monotonic()  # booting is not a hang (rendering, CUDA)
            self.first_open_done.set()
            while not self.worker.stopping and not self.given_up:
                self.step()
                self.progress_monotonic = time.monotonic()
        except BootError as exc:
            self.boot_error = str(exc)
        except BaseException as exc:  # noqa: BLE001 - the main thread ends the worker with it
            if self.worker.stopping:
                # Left in a step past STOP_JOIN_S, its sockets closed under it: the stop, not a
                # failure of the camera.
                log.info("camera %s: its capture thread ended by the stop (%s: %s)",
                         self.camera.id, type(exc).__name__, exc)
            else:
                log.exception("camera %s: its capture thread failed", self.camera.id)
                self.error = exc
        finally:
            self.first_open_done.set()
            self._close_in_thread()

    def _close_in_thread(self) -> None:
        """The thread's last act: its camera's source and ring are closed where their CUDA work
        ran, then the thread lets go of the primary context (cuda_driver.release_thread)."""
        started = time.monotonic()
        try:
            if self.source is not None:
                if self.worker.stopping:
                    self.source.close_at_exit()  # Note [Decoders left to the process's end]
                else:
                    self.source.close()
                self.source = None
            source_s = time.monotonic() - started
            if self.publisher is not None:
                self.publisher.close()
            closing_s = time.monotonic() - started
            if closing_s > SLOW_CLOSE_S:
                # Where a slow stop goes (docs/benchmarks.md, "Two GPUs": 16 NVDEC cameras a
                # process were still closing 2 s after SIGTERM).
                log.warning("camera %s: closing took %.2f s (source %.2f s, ring %.2f s)",
                            self.camera.id, closing_s, source_s, closing_s - source_s)
        except Exception:  # noqa: BLE001 - closing on the way out: say so, go on
            log.exception("camera %s: closing its source or ring failed", self.camera.id)
        finally:
            if self.worker.device.startswith("cuda"):
                from facecast.shared.transport import cuda_driver

                cuda_driver.release_thread()

    def _boot(self) -> None:
        requested = self.config.transport_for(self.camera)
        device, device_index, transport_reason = self.worker.device, 0, ""
        if device.startswith("cuda"):
            device_index = int(device.partition(":")[2] or 0)
            import torch

            torch.cuda.set_device(device_index)  # per thread, like the driver's context
        elif requested != "shm":
            # Models run on the CPU: a GPU ring would only add a copy back.
            transport_reason = (f'transport "{requested}", but models run on the CPU: shared '
                                "memory saves a copy to the GPU and back")
            log.info("camera %s: models run on the CPU, so its frames use shared memory",
                     self.camera.id)
            requested = "shm"
        self.publisher = FramePublisher(
            self.worker.context, self.worker.runtime_dir, self.camera.id,
            slot_count=self.config.daemon.ring_slots, transport=requested,
            device_index=device_index, checksum_kind=self.config.daemon.checksum,
            transport_reason=transport_reason,
        )
        one_thread_per_camera()  # after FramePublisher: on the CUDA path it imported torch
        ring_made_monotonic = time.monotonic()
        self._open()
        # Where a camera's first frame waited (its ring, its source's open), said with it.
        self._boot_spans = (f"ring {ring_made_monotonic - self._started_monotonic:.2f} s, "
                            f"open {time.monotonic() - ring_made_monotonic:.2f} s")

    def _open(self) -> None:
        request = DecodeRequest(requested=self.config.decode_for(self.camera),
                                device=self.worker.device, gpu_failed=self.gpu_decode_failed)
        try:
            self.source = open_source(self.camera, open_timeout_s=OPEN_TIMEOUT_S,
                                      read_timeout_s=READ_TIMEOUT_S, decode=request)
            self._opened_once = True
            self._decoder_chosen(request, self.source.decode)
        except SourceNotFound as exc:
            # Note [Sources that can never work]: not there from the start is a wrong config;
            # gone after it worked is a camera unplugged, which comes back.
            if self._opened_once:
                self._lost(exc.reason)
            else:
                self._give_up(exc.reason)
        except SourceLost as exc:
            self._lost(exc.reason)
        except SourceConfigError as exc:
            self._give_up(str(exc))

    def _decoder_chosen(self, request: DecodeRequest, choice: DecodeChoice) -> None:
        """Note [Decoder choice]: said when it changes (the first open included), not at every
        reconnect."""
        if choice == self.decode:
            return
        self.decode = choice
        trouble = is_trouble(request, choice, source_kind(self.camera.source))
        self.decode_trouble = f"decoded on the CPU: {choice.reason}" if trouble else ""
        (log.warning if trouble else log.info)(
            "camera %s: decoder %s", self.camera.id, choice.describe())
        self.worker.queue_event("decoder", camera=self.camera.id, decoder=choice.decoder,
                                reason=choice.reason)

    def _gpu_decoder_failed(self, reason: str) -> None:
        """Note [GPU decoder failing mid-stream]: the CPU decoder takes over at once."""
        log.warning("camera %s: its GPU decoder failed (%s); opening it again on the CPU "
                    "decoder", self.camera.id, reason)
        self.worker.queue_event("decoder_fallback", camera=self.camera.id, reason=reason)
        self.gpu_decode_failed = reason
        source, self.source = self.source, None
        try:
            source.close()
        except Exception:  # noqa: BLE001 - a failed decoder may fail to close: go on
            log.exception("camera %s: closing its failed GPU decoder", self.camera.id)
        self._open()

    def _give_up(self, reason: str) -> None:
        """Note [Sources that can never work]: the thread ends; the camera is not retried."""
        self.given_up = reason
        self.source_state = f"lost: {reason}; {NOT_RETRIED}"
        log.error("camera %s: %s; %s", self.camera.id, reason, NOT_RETRIED)
        self.worker.queue_event("camera_failed", camera=self.camera.id, reason=reason)

    def _lost(self, reason: str) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None
        retry_in_s = self.reopen.failed()
        if not self._was_lost or reason != self.lost_reason:
            log.warning("camera %s lost: %s; retrying in %.1f s", self.camera.id, reason,
                        retry_in_s)
            self.worker.queue_event("camera_lost", camera=self.camera.id, reason=reason)
        self._was_lost = True
        self.lost_reason = reason
        self.source_state = f"lost: {reason}"

    def step(self) -> None:
        self.publisher.serve_control()
        if self.source is None:
            wait_s = self.reopen.wait_s()
            if wait_s > 0:
                time.sleep(min(wait_s, 0.1))
                return
            self._open()
            if self.source is None:
                return
        staged = self._staging_view()
        try:
            if staged is not None:
                frame, capture_ts_lsl = self.source.read_into(staged)
            elif self.source.on_device:  # decoded on the GPU (Note [Frames born on the GPU])
                frame, capture_ts_lsl = self.source.read_decoded()
            else:
                frame, capture_ts_lsl = self.source.read()
        except SourceLost as exc:
            self._lost(exc.reason)
            return
        except GpuDecodeFailed as exc:
            self._gpu_decoder_failed(exc.reason)
            return
        corrupting = self._take_fault_request()
        if corrupting:
            self.publisher.corrupt_next_frame()
        if self.source.on_device:
            # As the decoder left it, valid until the next read (Note [NV12 into the slot]).
            try:
                message = self.publisher.publish_decoded(frame, capture_ts_lsl)
            except GpuDecodeFailed as exc:  # converting it failed
                self._gpu_decoder_failed(exc.reason)
                return
        elif frame is staged:  # decoded into the ring's staging memory
            message = self.publisher.publish_staged(capture_ts_lsl)
        else:
            message = self.publisher.publish(frame, capture_ts_lsl)
        if corrupting:
            # On the Markers stream, so that a recording says which frame was spoiled on purpose.
            self.worker.queue_event(
                "fault_injected", fault="corrupt_next_frame", camera=self.camera.id,
                frame_seq=message.frame_seq, capture_ts_lsl=message.capture_ts_lsl,
                transport=message.transport)
        self.rate.tick()
        if self.rate.total == 1:
            # A spare's takeover is judged by this (issue 22: every camera back within 2 s).
            log.info("camera %s: first frame published %.2f s after its thread started (%s)",
                     self.camera.id, time.monotonic() - self._started_monotonic,
                     self._boot_spans)
        if self.source_state != "ok":
            if self._was_lost:
                log.info("camera %s is back", self.camera.id)
                self.worker.queue_event("camera_back", camera=self.camera.id)
            self._was_lost = False
            self.source_state = "ok"
            self.reopen.succeeded()
        self._report_transport_changes()

    def _staging_view(self) -> np.ndarray | None:
        """Where the source may decode its next frame (Note [Staged writes]): the ring's staging
        memory for a frame of the size the source was granted; None for a source that cannot
        decode into memory it is given, or whose frame size is not known yet."""
        granted = self.source.granted
        if not self.source.decodes_into or granted.width <= 0 or granted.height <= 0:
            return None
        return self.publisher.staging_view((granted.height, granted.width, 3))

    def _take_fault_request(self) -> bool:
        try:
            self._fault_requests.get_nowait()
        except queue.Empty:
            return False
        return True

    def request_corrupt_next_frame(self) -> None:
        """Called by the main thread (fault injection): the camera thread spoils its next
        published frame and puts that frame's number on the Markers stream."""
        self._fault_requests.put("corrupt_next_frame")

    def _report_transport_changes(self) -> None:
        status = self.publisher.status
        if status.fallbacks != self._seen_fallbacks:
            self._seen_fallbacks = status.fallbacks
            self.worker.queue_event("transport_fallback", camera=self.camera.id,
                                    transport=status.transport, reason=status.fallback_reason)
        if status.ring_epoch != self._seen_epoch:
            self._seen_epoch = status.ring_epoch
            self.worker.queue_event("transport", camera=self.camera.id,
                                    transport=status.transport,
                                    reason=status.reason)  # never empty (Note [Transport reasons])

    # -- read by the main thread ----------------------------------------------------------------

    def report(self) -> CameraReport:
        status = self.publisher.status if self.publisher is not None else None
        return CameraReport(
            camera_id=self.camera.id, frames=self.rate.total, fps=round(self.rate.rate(), 2),
            source=self.source_state, transport=status.transport if status else "",
            ring_epoch=status.ring_epoch if status else 0,
            fallback_reason=status.fallback_reason if status else "",
            **_decoder_fields(self.decode),
        )


def _decoder_fields(choice: DecodeChoice | None) -> dict[str, str]:
    if choice is None:
        return {}
    return {"decoder": choice.decoder, "decode_reason": choice.reason}



class CaptureWorker(Worker):
    role = "capture"

    def prepare(self) -> None:
        """A standby on a GPU pays for torch, pycuda and the primary context now: they are most
        of a CUDA-IPC capture worker's boot. Whether CUDA works is still decided at boot. A
        worker held at boot (it knows its cameras) also makes its replayed cameras' loops
        (Note [Loops made while held])."""
        one_thread_per_camera()
        if self.device.startswith("cuda"):
            from facecast.shared.transport import cuda_driver
            from facecast.shared.transport.ring_errors import TransportUnavailable

            device_index = int(self.device.partition(":")[2] or 0)
            try:
                cuda_driver.driver(device_index)
            except TransportUnavailable as exc:
                log.info("%s: CUDA not ready (%s); boot decides the transport", self.name, exc)
            else:
                self._warm_nvdec_path(device_index)
        if self.hold and self.camera_ids:
            started_monotonic = time.monotonic()
            made = make_loops_ahead([self.camera(camera_id) for camera_id in self.camera_ids])
            if made:
                log.info("%s: made the loops of %d replayed camera(s) in %.1f s while held",
                         self.name, len(made), time.monotonic() - started_monotonic)

    def _warm_nvdec_path(self, device_index: int) -> None:
        """Note [NVDEC path warmed while standing by], where a camera of this worker (or, for a
        spare, of the config) may be decoded by NVDEC."""
        cameras = ([self.camera(camera_id) for camera_id in self.camera_ids] if self.camera_ids
                   else self.config.cameras)
        if not any(may_use_nvdec(self.config.decode_for(camera), source_kind(camera.source))
                   for camera in cameras):
            return
        from facecast.workers.capture import nvdec

        started_monotonic = time.monotonic()
        try:
            reason = nvdec.warm_up(device_index)
        except Exception as exc:  # noqa: BLE001 - only a head start: each camera's open decides
            log.warning("%s: warming the NVDEC path failed (%s: %s); its cameras pay for it at "
                        "open", self.name, type(exc).__name__, exc)
            return
        log.info("%s: NVDEC path warmed in %.2f s%s", self.name,
                 time.monotonic() - started_monotonic,
                 f" (NVDEC cannot serve here: {reason})" if reason else "")

    def boot(self) -> None:
        if not self.camera_ids:
            raise BootError("a capture worker needs at least one camera")
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.cameras = {camera_id: CameraCapture(self.camera(camera_id), self.config, self)
                        for camera_id in self.camera_ids}
        for capture in self.cameras.values():
            capture.thread.start()
        deadline = time.monotonic() + FIRST_OPEN_WAIT_S
        for capture in self.cameras.values():
            capture.first_open_done.wait(max(0.0, deadline - time.monotonic()))
            self._forward_events()
            if capture.boot_error:
                raise BootError(capture.boot_error)
            if capture.error is not None:
                raise capture.error
        # Every camera has opened (or failed to): a loop no source took is not wanted.
        dropped = drop_loops_made_ahead()
        if dropped:
            log.info("%s: %d loop(s) made while held were not used (a reload changed their "
                     "cameras)", self.name, dropped)
        given_up = [c for c in self.cameras.values() if c.given_up]
        if len(given_up) == len(self.cameras):  # Note [Sources that can never work]
            raise BootError("; ".join(f"camera {c.camera.id}: {c.given_up}" for c in given_up)
                            + f"; {NOT_RETRIED}")

    def queue_event(self, kind: str, **fields: str | int | float | bool) -> None:
        """From a camera thread: the main thread sends it (Note [Camera threads])."""
        self._events.put((kind, fields))

    def _forward_events(self) -> None:
        while True:
            try:
                kind, fields = self._events.get_nowait()
            except queue.Empty:
                return
            self.event(kind, **fields)

    def step(self) -> None:
        self._forward_events()
        now = time.monotonic()
        hung_after_s = self.config.daemon.heartbeat_timeout_s
        for camera_id, capture in self.cameras.items():
            if capture.error is not None:
                raise RuntimeError(f"camera {camera_id}: capture thread failed: "
                                   f"{capture.error!r}") from capture.error
            if capture.boot_error:
                raise RuntimeError(f"camera {camera_id}: {capture.boot_error}")
            if capture.given_up:
                continue  # its thread ended: no progress to expect
            if now - capture.progress_monotonic > hung_after_s:
                raise RuntimeError(f"camera {camera_id}: its capture thread made no progress "
                                   f"for {now - capture.progress_monotonic:.1f} s (hung)")
        time.sleep(0.05)

    def inject_fault(self, fault: InjectFault) -> None:
        """Note [Fault injection] (daemon/supervisor.py): the supervisor only forwards it when
        the daemon allows fault injection."""
        capture = self.cameras.get(fault.camera_id)
        if fault.kind != "corrupt_next_frame" or capture is None or capture.publisher is None:
            super().inject_fault(fault)
            return
        log.warning("camera %s: the next frame's slot will be corrupted after publishing "
                    "(fault injection)", fault.camera_id)
        capture.request_corrupt_next_frame()

    def camera_reports(self) -> list[CameraReport]:
        return [capture.report() for capture in self.cameras.values()]

    def trouble(self) -> str:
        """A camera that asked for the GPU decoder and is decoded on the CPU, or whose GPU
        decoder failed (Note [Decoder choice])."""
        return "; ".join(f"camera {camera_id}: {capture.decode_trouble}"
                         for camera_id, capture in getattr(self, "cameras", {}).items()
                         if capture.decode_trouble)

    def close(self) -> None:
        self.stopping = True
        cameras = getattr(self, "cameras", {})
        # A paced read ends within a frame period; a dead stream's read may take READ_TIMEOUT_S,
        # longer than the daemon's stop deadline gives: such a thread is closed around.
        deadline = time.monotonic() + STOP_JOIN_S
        for capture in cameras.values():
            if capture.thread.is_alive():
                capture.thread.join(max(0.0, deadline - time.monotonic()))
        for capture in cameras.values():
            if capture.thread.is_alive():
                # Its ring goes with the process (the supervisor sweeps what is left in
                # /dev/shm once it has reaped it); closing it under the thread could crash.
                log.warning("camera %s: its capture thread is still in a step or closing its "
                            "source after %.1f s; leaving it", capture.camera.id, STOP_JOIN_S)
        if hasattr(self, "_events"):
            self._forward_events()
