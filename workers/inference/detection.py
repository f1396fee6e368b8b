"""The detection worker: one per device (DESIGN §1). It batches the newest frame of every camera
that needs a detection pass into one forward pass of the face detectors and publishes the boxes.

A camera needs a pass when a roi_landmark worker asks for one (`DetectionWanted`: it has no face
there or lost one) or when `daemon.detect_interval_s` has passed since its last pass (newcomers).
Between passes the roi_landmark workers follow faces by their landmarks alone, as MediaPipe does.
"""

from __future__ import annotations

import logging
import math
import time

import zmq

from facecast.models.roi import FrameBatch
from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import CameraReport, DetectionWanted, Detections, MessageGate
from facecast.shared.stats import RateMeter, StageTimer
from facecast.shared.transport.subscriber import FrameSubscriber
from facecast.workers.base import Worker
from facecast.workers.inference.pipelines import (
    consumer_reports,
    open_frames,
    pipelines_for,
    prepare_pipelines,
    torch_device,
)

log = logging.getLogger(__name__)


class DetectionWorker(Worker):
    role = "detection"

    def prepare(self) -> None:
        self.torch_device = torch_device(self.device)
        self.prepared = prepare_pipelines(self.config, self.torch_device, blendshapes=False,
                                          pose=False)

    def boot(self) -> None:
        self.torch_device = torch_device(self.device)
        pipelines = pipelines_for(self.prepared, self.config, self.torch_device,
                                  blendshapes=False, pose=False)
        self.prepared = None
        self.pipeline = pipelines.face
        self.timer = StageTimer()
        self.rates: dict[str, RateMeter] = {}
        self.faces: dict[str, int] = {}
        self._last_pass_monotonic: dict[str, float] = {}
        self._wanted: set[str] = set()
        self._requests_gate = MessageGate("detection requests")
        self.detections = self.context.socket(zmq.PUB)
        self.detections.setsockopt(zmq.LINGER, 0)
        self.detections.bind(endpoints.detections(self.runtime_dir, self.device))
        self.requests = self.context.socket(zmq.PULL)
        self.requests.setsockopt(zmq.LINGER, 0)
        self.requests.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
        self.requests.bind(endpoints.detection_requests(self.runtime_dir, self.device))
        self.subscriber: FrameSubscriber | None = None
        self._subscribe()

    def _subscribe(self) -> None:
        self.subscriber = open_frames(self, self.subscriber)

    def reassign(self, previous_camera_ids: list[str]) -> None:
        self._subscribe()

    def _due(self, camera_id: str) -> bool:
        """Asked for, or not searched for newcomers within `detect_interval_s`."""
        if camera_id in self._wanted:
            return True
        last_pass = self._last_pass_monotonic.get(camera_id, -math.inf)
        return time.monotonic() - last_pass >= self.config.daemon.detect_interval_s

    def step(self) -> None:
        while self.requests.poll(0):
            request = self._requests_gate.decode(self.requests.recv())
            if isinstance(request, DetectionWanted):
                self._wanted.update(request.camera_ids)
        # Only the frames of cameras due for a pass are read from their rings.
        due = self.subscriber.receive(timeout_ms=50, wanted=self._due)
        if not due:
            return
        start = now = time.monotonic()
        batch = FrameBatch([frame.tensor for frame in due], self.torch_device)
        found = self.pipeline.detect(batch)
        self.timer.add_ms("detect", (time.monotonic() - start) * 1e3)
        for frame, (boxes, keypoints, scores) in zip(due, found):
            camera_id = frame.message.camera_id
            self._wanted.discard(camera_id)
            self._last_pass_monotonic[camera_id] = now
            self.rates.setdefault(camera_id, RateMeter()).tick()
            self.faces[camera_id] = int(boxes.shape[0])
            message = Detections(
                camera_id=camera_id, ring_epoch=frame.message.ring_epoch,
                frame_seq=frame.message.frame_seq, capture_ts_lsl=frame.message.capture_ts_lsl,
                boxes_px=[tuple(b) for b in boxes.cpu().tolist()],
                keypoints_px=[[tuple(p) for p in k] for k in keypoints.cpu().tolist()],
                scores=scores.cpu().tolist(),
            )
            self.detections.send_multipart([camera_id.encode(), messages.encode(message)])

    def camera_reports(self) -> list[CameraReport]:
        return consumer_reports(self.camera_ids, self.subscriber, self.rates, self.faces)

    def stage_timings(self):
        return self.timer.timings()

    def close(self) -> None:
        for name in ("subscriber", "detections", "requests"):
            thing = getattr(self, name, None)
            if thing is not None:
                thing.close()
