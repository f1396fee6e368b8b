"""The capture worker: one process per camera (DESIGN §1), so a hung driver or a dead RTSP link
stays with its camera.

It reads the camera's frames (facecast.workers.sources), stamps them at grab with
`pylsl.local_clock()`, writes them into the camera's ring and publishes them
(facecast.shared.transport.FramePublisher). It never waits for consumers. A lost source is
reported (`camera_lost` marker), retried with exponential backoff (sources.ReopenBackoff, the
one reconnect policy), and reported again when it is back (`camera_back`); a source that can
never work as written (`SourceConfigError`) is a boot error, which the supervisor does not
respawn.
"""

from __future__ import annotations

import logging
import sys
import time

import cv2

from facecast.shared.messages import CameraReport, InjectFault
from facecast.shared.stats import RateMeter
from facecast.shared.transport import FramePublisher
from facecast.workers.base import BootError, Worker
from facecast.workers.sources import (
    FrameSource,
    ReopenBackoff,
    SourceConfigError,
    SourceLost,
    open_source,
    source_kind,
)

log = logging.getLogger(__name__)

REOPEN_FIRST_DELAY_S = 0.5
REOPEN_MAX_DELAY_S = 30.0
# Below the supervisor's heartbeat timeout: opening or reading a dead stream must not look like
# a hung worker.
OPEN_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 5.0


def one_thread_per_camera() -> None:
    """Each camera has its own capture process: that is the parallelism. OpenCV's and torch's
    thread pools inside it add one thread per core that waits, spinning, between frames: on the
    16-core GPU host one 1080p30 synthetic camera's capture worker was 1.3 cores busy where its
    rendering takes ~0.25 (bench/pipeline.py's CPU by role shows the effect of this). FFmpeg's
    decoding threads are its own and stay as they are."""
    cv2.setNumThreads(1)
    torch = sys.modules.get("torch")  # imported only on the CUDA path
    if torch is not None:
        torch.set_num_threads(1)


class CaptureWorker(Worker):
    role = "capture"

    def prepare(self) -> None:
        """A standby on a GPU pays for torch, pycuda and the primary context now: they are most
        of a CUDA-IPC capture worker's boot. Whether CUDA works is still decided at boot."""
        one_thread_per_camera()
        if self.device.startswith("cuda"):
            from facecast.shared import cuda_driver
            from facecast.shared.rings import TransportUnavailable

            try:
                cuda_driver.driver(int(self.device.partition(":")[2] or 0))
            except TransportUnavailable as exc:
                log.info("%s: CUDA not ready (%s); boot decides the transport", self.name, exc)

    def boot(self) -> None:
        if len(self.camera_ids) != 1:
            raise BootError(f"a capture worker takes exactly one camera, got {self.camera_ids}")
        self.camera_config = self.camera(self.camera_ids[0])
        try:
            self.source_kind = source_kind(self.camera_config.source)
        except SourceConfigError as exc:
            raise BootError(f"camera {self.camera_config.id}: {exc}") from None
        requested = self.config.transport_for(self.camera_config)
        device_index = 0
        transport_reason = ""
        if self.device.startswith("cuda"):
            device_index = int(self.device.partition(":")[2] or 0)
        elif requested != "shm":
            # Models run on the CPU: a GPU ring would only add a copy back.
            transport_reason = (f'transport "{requested}", but models run on the CPU: shared '
                                "memory saves a copy to the GPU and back")
            log.info("camera %s: models run on the CPU, so its frames use shared memory",
                     self.camera_config.id)
            requested = "shm"
        self.publisher = FramePublisher(
            self.context, self.runtime_dir, self.camera_config.id,
            slot_count=self.config.daemon.ring_slots, transport=requested,
            device_index=device_index, checksum_kind=self.config.daemon.checksum,
            transport_reason=transport_reason,
        )
        one_thread_per_camera()  # after FramePublisher: on the CUDA path it imported torch
        self.source: FrameSource | None = None
        self.source_state = "opening"
        self.lost_reason = ""
        self.rate = RateMeter()
        self.reopen = ReopenBackoff(first_delay_s=REOPEN_FIRST_DELAY_S,
                                    max_delay_s=REOPEN_MAX_DELAY_S)
        self._was_lost = False
        self._seen_epoch = 0
        self._seen_fallbacks = 0
        self._open()

    def _open(self) -> None:
        camera = self.camera_config
        try:
            self.source = open_source(camera, open_timeout_s=OPEN_TIMEOUT_S,
                                      read_timeout_s=READ_TIMEOUT_S)
        except SourceLost as exc:
            self._lost(exc.reason)
        except SourceConfigError as exc:
            raise BootError(f"camera {camera.id}: {exc}") from None

    def _lost(self, reason: str) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None
        retry_in_s = self.reopen.failed()
        if not self._was_lost or reason != self.lost_reason:
            log.warning("camera %s lost: %s; retrying in %.1f s", self.camera_config.id, reason,
                        retry_in_s)
            self.event("camera_lost", camera=self.camera_config.id, reason=reason)
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
        try:
            frame, capture_ts_lsl = self.source.read()
        except SourceLost as exc:
            self._lost(exc.reason)
            return
        corrupting = self.publisher.corrupt_pending
        message = self.publisher.publish(frame, capture_ts_lsl)
        if corrupting:
            # On the Markers stream, so that a recording says which frame was spoiled on purpose.
            self.event("fault_injected", fault="corrupt_next_frame", camera=self.camera_config.id,
                       frame_seq=message.frame_seq, capture_ts_lsl=message.capture_ts_lsl,
                       transport=message.transport)
        self.rate.tick()
        if self.source_state != "ok":
            if self._was_lost:
                log.info("camera %s is back", self.camera_config.id)
                self.event("camera_back", camera=self.camera_config.id)
            self._was_lost = False
            self.source_state = "ok"
            self.reopen.succeeded()
        self._report_transport_changes()

    def inject_fault(self, fault: InjectFault) -> None:
        """Note [Fault injection] (daemon/supervisor.py): the supervisor only forwards it when
        the daemon allows fault injection."""
        if fault.kind != "corrupt_next_frame" or fault.camera_id != self.camera_config.id:
            super().inject_fault(fault)
            return
        log.warning("camera %s: the next frame's slot will be corrupted after publishing "
                    "(fault injection)", self.camera_config.id)
        self.publisher.corrupt_next_frame()

    def _report_transport_changes(self) -> None:
        status = self.publisher.status
        if status.fallbacks != self._seen_fallbacks:
            self._seen_fallbacks = status.fallbacks
            self.event("transport_fallback", camera=self.camera_config.id,
                       transport=status.transport, reason=status.fallback_reason)
        if status.ring_epoch != self._seen_epoch:
            self._seen_epoch = status.ring_epoch
            self.event("transport", camera=self.camera_config.id, transport=status.transport,
                       reason=status.reason)  # never empty (Note [Transport reasons])

    def camera_reports(self) -> list[CameraReport]:
        status = self.publisher.status
        return [CameraReport(
            camera_id=self.camera_config.id, frames=self.rate.total, fps=round(self.rate.rate(), 2),
            source=self.source_state, transport=status.transport, ring_epoch=status.ring_epoch,
            fallback_reason=status.fallback_reason,
        )]

    def close(self) -> None:
        source = getattr(self, "source", None)
        if source is not None:
            source.close()
        publisher = getattr(self, "publisher", None)
        if publisher is not None:
            publisher.close()
