"""The detection worker: one per device (DESIGN §1). It batches the newest frame of every camera
that needs a detection pass into one forward pass of the face detectors and publishes the boxes.

A camera needs a pass when a roi_landmark worker asks for one (`DetectionWanted`: it has no face
there or lost one), when `daemon.detect_interval_s` has passed since its last pass (newcomers),
and whenever the device has room (Note [Detection while the device has room]); the two searches
for newcomers skip a camera whose tracks fill `output.max_faces` (`TracksFull`: Note [No search
where no face could go], models/face_tracking.py). Between passes the roi_landmark workers
follow faces by their landmarks alone, as MediaPipe does.

Note [Detection while the device has room]
    A person who walks into view is found by the next detection pass over their camera; with
    passes only every `detect_interval_s` (0.5 s) a new face waited up to half a second, and on
    real footage of a person walking in facecast reported the face in 34-36 % of frames where
    MediaPipe's FaceLandmarker, detecting on every frame, reported 43 % (issue 24 item 5). So the
    worker also searches every camera with a new frame whenever it has been idle long enough
    that its passes take at most `daemon.detection_share` of the device's time: after a pass of
    d seconds, the next such pass may start d * (1 / share - 1) seconds after it ended. A pass
    over 32 1080p cameras of a few milliseconds on a GPU (share 0.5) thus comes every few frames
    and a face is published within a frame or two of its first; on the CPU, where a pass costs
    tens of milliseconds of a core the face stack needs, the share is 0.1 and passes come
    about as often as `detect_interval_s` made them. Passes asked for (`DetectionWanted`) and
    the interval's are never held back by the share: they are what tracking needs.
    While the device has no room, the frames that come are left on the frame bus, not taken
    off it: once room comes, the newest frame of every camera goes into one pass (they wait
    MAX_BUS_WAIT_S at most, then are taken and passed over, as on the CPU, where room comes
    seldom: a full queue would drop the newest). Taking them at once had passed them over,
    and where cameras publish within a millisecond or two of each other (the synthetic ones
    do, on the ticks of one clock) a pass over the first cameras of a tick left the others
    without room until their next frame, and the same camera tended to be late every tick:
    at 8 cameras on the H100 (GPU 31 % busy) a newcomer was published p50 4 frames, at most
    14 (the interval's 15), after their first frame (issue 24 item 5). On the CPU, two staged
    640x360 cameras at 10 fps and share 0.5: before, one camera was searched on 214 of 297
    frames and a newcomer's first pass came up to 3 frames late; after, 295 of 297, and on
    the first frame every time.
    Room is also what the measuring leaves. A pass over every camera every frame or two costs
    the device as much as the measuring (at 64 cameras on the H100, 2026-11-27: detection ~37 %
    of the GPU's time, the measuring ~46 %, the GPU 100 % busy and 3 % of frames dropped; with
    share 0.1 instead of 0.5 none were). So a roi_landmark worker of the device that passed
    over more than BEHIND_SHARE of its frames in a second (the newest-frame policy: its
    measuring is behind its cameras; a frame now and then is not) says so (MeasuringBehind),
    and the worker leaves the newcomers to the interval's passes until ROOM_AFTER_BEHIND_S after
    the last such message: "detection on every frame where the budget allows, tracking
    otherwise" (issue 24 item 5).
"""

from __future__ import annotations

import logging
import math
import time

import zmq

from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import (
    CameraReport,
    DetectionWanted,
    Detections,
    MeasuringBehind,
    MessageGate,
    TracksFull,
)
from facecast.shared.stats import RateMeter, StageTimer
from facecast.shared.transport.subscriber import FrameSubscriber
from facecast.workers.base import Worker
from facecast.workers.inference.pipelines import (
    close_frames,
    consumer_reports,
    open_frames,
    pipelines_for,
    prepare_pipelines,
    torch_device,
)

log = logging.getLogger(__name__)

# Frames wait on the bus for room this long at most (Note [Detection while the device has
# room]): a capture group's queue (NEWEST_FRAME_RCVHWM, 256 messages) holds about a second of its
# 8 cameras at 30 fps, and a full queue drops the newest messages, not the oldest.
MAX_BUS_WAIT_S = 0.25
# No room for newcomer searches this long after a roi_landmark worker of the device last said
# its measuring was behind (Note [Detection while the device has room]).
ROOM_AFTER_BEHIND_S = 1.0


class DetectionWorker(Worker):
    role = "detection"

    def prepare(self) -> None:
        self.torch_device = torch_device(self.device)
        self.prepared = prepare_pipelines(self.config, self.torch_device, blendshapes=False,
                                          pose=False, most_cameras=self.most_cameras)

    def boot(self) -> None:
        self.torch_device = torch_device(self.device)
        pipelines = pipelines_for(self.prepared, self.config, self.torch_device,
                                  blendshapes=False, pose=False, most_cameras=self.most_cameras)
        self.prepared = None
        self.pipeline = pipelines.face
        self.timer = StageTimer()
        self.rates: dict[str, RateMeter] = {}
        self.faces: dict[str, int] = {}
        self._last_pass_monotonic: dict[str, float] = {}
        self._wanted: set[str] = set()
        self._full: set[str] = set()  # Note [No search where no face could go]
        self.detection_share = detection_share(self.config.daemon.detection_share, self.device)
        self._room_from_monotonic = -math.inf  # Note [Detection while the device has room]
        self._behind_said_monotonic = -math.inf  # when the measuring last said it was behind
        self._bus_read_monotonic = -math.inf  # when the frames were last taken off the bus
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
        """Asked for; or, where its tracks leave room for a newcomer (Note [No search where no
        face could go]), not searched for newcomers within `detect_interval_s`, or the device
        has room (Note [Detection while the device has room])."""
        if camera_id in self._wanted:
            return True
        if camera_id in self._full:
            return False
        now = time.monotonic()
        if now >= self._room_from():
            return True
        last_pass = self._last_pass_monotonic.get(camera_id, -math.inf)
        return now - last_pass >= self.config.daemon.detect_interval_s

    def _until_due_s(self) -> float:
        """How long the frames may wait on the bus: 0 when a camera is asked for or the device
        has room, else until room comes, a camera's `detect_interval_s` is up (cameras with
        room for a newcomer) or the frames have waited MAX_BUS_WAIT_S."""
        if self._wanted:
            return 0.0
        searched = [camera_id for camera_id in self.camera_ids if camera_id not in self._full]
        due_monotonic = self._bus_read_monotonic + MAX_BUS_WAIT_S
        if searched:
            last_pass = min(self._last_pass_monotonic.get(camera_id, -math.inf)
                            for camera_id in searched)
            due_monotonic = min(due_monotonic, self._room_from(),
                                last_pass + self.config.daemon.detect_interval_s)
        return max(0.0, due_monotonic - time.monotonic())

    def _room_from(self) -> float:
        """When the device has room for a newcomer search: after the share's wait, and not
        while the measuring is behind (Note [Detection while the device has room])."""
        return max(self._room_from_monotonic,
                   self._behind_said_monotonic + ROOM_AFTER_BEHIND_S)

    def step(self) -> None:
        # Until a pass may be due, the frames wait on the bus: taken off it, they would be
        # passed over (Note [Detection while the device has room]). A request ends the wait.
        wait_s = self._until_due_s()
        if wait_s > 0:
            self.requests.poll(min(50, math.ceil(wait_s * 1e3)))
        while self.requests.poll(0):
            request = self._requests_gate.decode(self.requests.recv())
            if isinstance(request, DetectionWanted):
                self._wanted.update(request.camera_ids)
                self._full.difference_update(request.camera_ids)  # it has no face or lost one
            elif isinstance(request, TracksFull):
                self._full.difference_update(request.camera_ids)
                self._full.update(set(request.full) & set(request.camera_ids))
            elif isinstance(request, MeasuringBehind):
                self._behind_said_monotonic = time.monotonic()
        if self._until_due_s() > 0:
            return
        # Only the frames of cameras due for a pass are read from their rings.
        due = self.subscriber.receive(timeout_ms=50, wanted=self._due)
        self._bus_read_monotonic = time.monotonic()
        if not due:
            return
        start = now = time.monotonic()
        batch = self.pipeline.batch_in_place([frame.tensor for frame in due])
        found = self.pipeline.detect(batch)
        end = time.monotonic()
        self.timer.add_ms("detect", (end - start) * 1e3)
        self._room_from_monotonic = end + (end - start) * (1 / self.detection_share - 1)
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
        close_frames(self)
        for name in ("detections", "requests"):
            thing = getattr(self, name, None)
            if thing is not None:
                thing.close()


def detection_share(configured: float | str, device: str) -> float:
    """`daemon.detection_share` for a worker on `device` ("auto": 0.5 on a GPU, 0.1 on the CPU;
    Note [Detection while the device has room])."""
    if configured != "auto":
        return float(configured)
    return 0.1 if device == "cpu" else 0.5
