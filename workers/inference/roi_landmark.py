"""The roi_landmark worker (DESIGN §1, §3): for the newest frame of each of its cameras, it crops
every face's rotated ROI out of the ring slot, runs the landmark model (478 landmarks with
irises), head pose, and with face_landmarker.task the blendshapes and head translation, in one
batch across cameras and faces, names each face with a track id, and publishes the results for
the output worker.

Faces are followed from frame to frame by their own landmarks (FacePipeline.track); detections
from the detection worker add faces (a newcomer, a face found again). When a camera has no face
or lost one, this worker asks the detection worker for a pass on that camera's next frame.

Every frame it measures is the frame subscriber's own checked copy: one overwritten while it was
copied never reaches the models (Note [The consumer's own copy]).

With `participants.enabled`, every published face also names its participant
(facecast.workers.inference.identity: face embeddings on a schedule per track, batched over the step's
frames, or the seat map).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pylsl
import torch
import zmq

from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import (
    CameraReport,
    DetectionWanted,
    Detections,
    FaceResult,
    FaceResults,
    MeasuringBehind,
    MessageGate,
    PoseResult,
    TrackIdBlock,
    TrackIdGrant,
    TrackIdsWanted,
    TracksFull,
)
from facecast.shared.stats import RateMeter, StageTimer
from facecast.shared.transport.subscriber import FrameSubscriber
from facecast.workers.base import Worker
from facecast.workers.inference.identity import FrameFaces, Identities, identities_for
from facecast.workers.inference.pipelines import (
    close_frames,
    consumer_reports,
    open_frames,
    pipelines_for,
    prepare_pipelines,
    torch_device,
)
from facecast.workers.inference.tracking import TrackIds, TrackIdSource

if TYPE_CHECKING:
    from facecast.models.pipeline import PendingTrack

log = logging.getLogger(__name__)

# Note [Reading while the device measures]
#     A batch's models run on the device while this worker's host thread would only wait for
#     them; its host work (reading the next frames from their rings, then making, naming and
#     publishing a batch's faces) took as long again, one after the other: at 32 cameras on the
#     H200, picked up -> read 3.3 ms and read -> measured 14.5 ms a frame (Note [Latency
#     accounted]), and at 64 cameras one worker fell behind (12 % of frames dropped) where two
#     on the same GPU kept up. So `step` queues a batch's device work (FacePipeline.track_start),
#     reads the frames that have arrived meanwhile, and only then waits for the batch
#     (track_finish), publishes it, and queues the frames it read. The next batch's ROIs come
#     from this batch's landmarks, so one batch at most is on its way; a frame read while its
#     camera's previous frame is measured waits for that one (its "read -> measured" hop says
#     so). On a GPU the reads run on the subscriber's own stream, beside the batch's kernels
#     (Note [Reads on their own stream]). On the CPU the models run inside track_start, and
#     nothing changes but the order.

# A detection is used on a later frame of its camera (the detector runs beside us, not before
# us); after this much capture time the face may have moved out of the ROI it would give. One
# of the camera's previous frame is used whatever its age: it is the newest there can be, and
# with the age alone a camera slower than 1 / MAX_DETECTION_AGE_S never got a face (at 3 fps
# every detection was 333 ms old by the next frame, and no face was ever published).
MAX_DETECTION_AGE_S = 0.3
# Note [Detection while the device has room]: over each BEHIND_WINDOW_S, a worker that passed over
# more than BEHIND_SHARE of its cameras' frames says its measuring is behind. A frame now and then
# is not behind: at 32 cameras on the H100 0.13 % were passed over (2026-11-27), 3.1 % at 64.
BEHIND_WINDOW_S = 1.0
BEHIND_SHARE = 0.01
# TracksFull goes again this often though nothing changed (_say_which_are_full).
FULL_RESEND_S = 1.0
# Faces are held in their track id (and their LSL slot) this long while unseen.
TRACK_HOLD_S = 1.0
# Note [Tracks across a break]
#     A followed face's next ROI is its last frame's mesh (models/face_tracking.py), which holds
#     only where the frames are consecutive. A camera's frames break when a new ring brings
#     them (another ring epoch: a spare took the capture process's cameras over, or the camera
#     came back with another size) or after a gap longer than TRACK_BREAK_S (the source was
#     lost and reopened, or this worker fell far behind): the faces may be anywhere by then.
#     The old ROIs were still used on the first frame after a capture takeover (~1 s later):
#     where a face had moved out of them the mesh found nothing or, once in a few loaded runs
#     of tests/test_decoding.py's killed capture process, a box where the truth had no face
#     (2026-11-28). So at a break the camera's tracks are forgotten and the frame asks for a
#     detection, as a camera's first frame does; its faces keep their track ids where they are
#     found again within TRACK_HOLD_S (TrackIds). Without this, the CPU's killed-capture test
#     (two busy loops beside it, 2026-11-28 18:55) had such a box in 1 run of 5: the stale ROI's
#     mesh, 51 px wide where the face was 67 and 12 px off its centre; with it, none in 7. The
#     price: the camera's first frame or two after the break have no face while the detection
#     comes.
TRACK_BREAK_S = 1.0
# A request for track ids with no answer after this long was lost (a full control socket drops
# it, STYLE §11): ask again. A refusal (the daemon's ids are used up) is asked again far later.
TRACK_IDS_ASK_AGAIN_S = 2.0
TRACK_IDS_ASK_AGAIN_AFTER_REFUSAL_S = 60.0


class RoiLandmarkWorker(Worker):
    """Track ids: Note [Track id blocks]. The blocks the supervisor
    grants (the Assignment's first, then one per TrackIdsWanted) feed one TrackIdSource for all
    this worker's cameras; a face that needs a new id while it is dry is not published."""

    role = "roi_landmark"

    def __init__(self, name: str, control_endpoint: str, context: zmq.Context) -> None:
        # Before the Assignment, which brings the first block; kept across a promotion.
        self.track_id_source = TrackIdSource()
        self._track_ids_asked_monotonic: float | None = None  # a request not answered yet
        self._track_ids_unanswered_warned = False
        self._track_ids_refused = ""  # the supervisor's reason when it had no block for us
        self._track_ids_dry = False  # a new face found no id since the last grant
        self.faces_without_track_id = 0  # measured but not published: no id for them
        super().__init__(name, control_endpoint, context)

    def prepare(self) -> None:
        self.torch_device = torch_device(self.device)
        self.prepared = prepare_pipelines(self.config, self.torch_device, blendshapes=True,
                                          pose=self.config.output.pose,
                                          most_cameras=self.most_cameras)
        # A standby loads the embedding network too, so that a promotion does not wait on it.
        self.prepared_identities = (self._identities_key(), self._new_identities())

    def _identities_key(self) -> tuple:
        return (self.config.participants, self.config.models.dir, str(self.torch_device))

    def _new_identities(self) -> Identities:
        identities = identities_for(self.config.participants, self.torch_device,
                                    self.config.models.dir or None)
        log.info("%s: %s", self.name, identities.describe())
        return identities

    def boot(self) -> None:
        self.torch_device = torch_device(self.device)
        pipelines = pipelines_for(self.prepared, self.config, self.torch_device,
                                  blendshapes=True, pose=self.config.output.pose,
                                  most_cameras=self.most_cameras)
        self.prepared = None
        pipelines.report(self)  # Note [Model files checked at load]
        self.model_problem = pipelines.model_problem
        prepared_identities = getattr(self, "prepared_identities", None)
        self.prepared_identities = None
        self.identities = (prepared_identities[1] if prepared_identities is not None
                           and prepared_identities[0] == self._identities_key()
                           else self._new_identities())
        self.identities_config = self.config.participants
        self._identities_trouble_said = ""
        self.pipeline = pipelines.face
        self.pose_pipeline = pipelines.pose
        # Periodic passes for newcomers are the detection worker's (daemon.detect_interval_s).
        self.pipeline.detect_interval_frames = 1 << 62
        self.timer = StageTimer()
        self._measuring: _Measuring | None = None  # Note [Reading while the device measures]
        self.rates: dict[str, RateMeter] = {}
        self.faces: dict[str, int] = {}
        self.track_ids: dict[str, TrackIds] = {}
        self._pending: dict[str, Detections] = {}
        # Each camera's last frame started: (ring epoch, capture time) (Note [Tracks across a break])
        self._last_frame: dict[str, tuple[int, float]] = {}
        # Not self._gate: that one is the control socket's (Worker.serve_control).
        self._detections_gate = MessageGate("detections")
        self.detections = self.context.socket(zmq.SUB)
        self.detections.setsockopt(zmq.LINGER, 0)
        self.detections.connect(endpoints.detections(self.runtime_dir, self.device))
        self.requests = self.context.socket(zmq.PUSH)
        self.requests.setsockopt(zmq.LINGER, 0)
        self.requests.setsockopt(zmq.SNDHWM, 16)
        self.requests.connect(endpoints.detection_requests(self.runtime_dir, self.device))
        self._behind_window = _Window(time.monotonic())  # Note [Detection while the device has room]
        # Note [No search where no face could go]: what TracksFull last told the detection worker.
        self._full_said: tuple[list[str], list[str]] | None = None
        self._full_said_monotonic = -math.inf
        self.results = self.context.socket(zmq.PUB)
        self.results.setsockopt(zmq.LINGER, 100)
        self.results.setsockopt(zmq.SNDHWM, 1000)
        self.results.connect(endpoints.results(self.runtime_dir))
        self.subscriber: FrameSubscriber | None = None
        self._subscribe(previous=[])

    def _subscribe(self, previous: list[str]) -> None:
        for camera_id in previous:
            self.detections.setsockopt(zmq.UNSUBSCRIBE, camera_id.encode())
        for camera_id in self.camera_ids:
            self.detections.setsockopt(zmq.SUBSCRIBE, camera_id.encode())
        self.subscriber = open_frames(self, self.subscriber)

    def reassign(self, previous_camera_ids: list[str]) -> None:
        # A batch on its way (there is none before boot): its frames were ours when read.
        if getattr(self, "_measuring", None) is not None:
            self._finish(self._measuring)
            self._measuring = None
        for camera_id in set(previous_camera_ids) - set(self.camera_ids):
            self._reset(camera_id)
            self.track_ids.pop(camera_id, None)
            self._last_frame.pop(camera_id, None)
        self._subscribe(previous_camera_ids)
        # A reload's new [participants] table (Note [Gallery reload]).
        if self.identities_config != self.config.participants:
            self.identities = self._new_identities()
            self.identities_config = self.config.participants

    def step(self) -> None:
        """Note [Reading while the device measures]."""
        self._ask_for_track_ids_if_low()
        if self._measuring is None:
            received = self.subscriber.receive(timeout_ms=50)
            self._drain_detections()
            if not received:
                return
            self._measuring = self._start(received)
        upcoming = self.subscriber.receive(timeout_ms=0)
        self._drain_detections()
        self._finish(self._measuring)
        self._measuring = self._start(upcoming) if upcoming else None

    def _start(self, received) -> _Measuring:
        """The batch's device work queued (FacePipeline.track_start)."""
        camera_ids = [frame.message.camera_id for frame in received]
        for frame in received:
            self._forget_tracks_at_a_break(frame.message)
        detections = {}
        for index, frame in enumerate(received):
            found = self._pending.pop(frame.message.camera_id, None)
            if found is not None and self._usable(found, frame.message):
                detections[index] = _as_tensors(found)
        start = time.monotonic()
        pending = self.pipeline.track_start(
            self.pipeline.batch_in_place([frame.tensor for frame in received]), camera_ids,
            detections=detections)
        return _Measuring(received, pending, (time.monotonic() - start) * 1e3)

    def _finish(self, measuring: _Measuring) -> None:
        """The batch's faces, named and published, and the detections its cameras need."""
        received = measuring.received
        camera_ids = [frame.message.camera_id for frame in received]
        start = time.monotonic()
        faces_per_frame = self.pipeline.track_finish(measuring.pending)
        # The host's own time on the batch (queueing it, then waiting for it and making its
        # faces), not the frames read in between.
        self.timer.add_ms("landmarks", measuring.start_ms + (time.monotonic() - start) * 1e3)
        poses_per_frame = [None] * len(received)  # None: body pose is not measured
        if self.pose_pipeline is not None:
            start = time.monotonic()
            poses_per_frame = self.pose_pipeline.track(
                [frame.tensor for frame in received], camera_ids,
                timestamps_s=[frame.message.capture_ts_lsl for frame in received])
            self.timer.add_ms("pose", (time.monotonic() - start) * 1e3)
        named_frames = [(frame, self._track(frame, faces), poses)
                        for frame, faces, poses in zip(received, faces_per_frame, poses_per_frame)]
        start = time.monotonic()
        identities = self.identities.identify([
            FrameFaces(camera_id=frame.message.camera_id,
                       capture_ts_lsl=frame.message.capture_ts_lsl, tensor=frame.tensor,
                       track_ids=[track_id for track_id, _ in named],
                       boxes_px=[face.box for _, face in named],
                       landmarks_px=[face.landmarks for _, face in named])
            for frame, named, _ in named_frames])
        if self.identities_config.enabled:  # no "identity" stage in status where none is named
            self.timer.add_ms("identity", (time.monotonic() - start) * 1e3)
        self._say_identities_trouble()
        measured_ts_lsl = pylsl.local_clock()
        for (frame, named, poses), who in zip(named_frames, identities):
            self._publish(frame, named, poses, who, measured_ts_lsl)
        wanted = sorted({c for c in camera_ids if self.pipeline.wants_detection(c)})
        if wanted:
            self._ask(DetectionWanted(camera_ids=wanted))
        self._say_which_are_full()
        self._say_if_behind(len(received))

    def _ask(self, message: DetectionWanted | MeasuringBehind | TracksFull) -> bool:
        """False when it could not be sent."""
        try:
            self.requests.send(messages.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False  # the detection worker is busy or restarting: we ask again next batch
        return True

    def _say_which_are_full(self) -> None:
        """Note [No search where no face could go]: this worker's cameras whose tracks fill
        max_faces, to the detection worker, when that changes and every FULL_RESEND_S (so that a
        message lost to a busy or restarted detection worker is made good)."""
        said = (list(self.camera_ids), [c for c in self.camera_ids if not self.pipeline.has_room(c)])
        now = time.monotonic()
        if said == self._full_said and now - self._full_said_monotonic < FULL_RESEND_S:
            return
        if self._ask(TracksFull(camera_ids=said[0], full=said[1])):
            self._full_said, self._full_said_monotonic = said, now

    def _say_if_behind(self, measured: int) -> None:
        """After each batch of `measured` frames: at the end of each BEHIND_WINDOW_S, whether
        the frames passed over in it (its subscriber's "skipped" counts) were more than
        BEHIND_SHARE, and if so the device has no room for newcomer searches (Note [Detection
        while the device has room])."""
        window = self._behind_window
        skipped = sum(status.counts["skipped"] for status in self.subscriber.status.values())
        # A new subscriber (cameras reassigned) counts from 0: the window goes on from there.
        window.skipped += max(0, skipped - window.skipped_seen)
        window.skipped_seen = skipped
        window.measured += measured
        now = time.monotonic()
        if now - window.started_monotonic < BEHIND_WINDOW_S:
            return
        if window.skipped > BEHIND_SHARE * (window.measured + window.skipped):
            self._ask(MeasuringBehind(skipped=window.skipped))
        self._behind_window = _Window(now, skipped_seen=skipped)

    def _drain_detections(self) -> None:
        while self.detections.poll(0):
            parts = self.detections.recv_multipart()
            found = self._detections_gate.decode(parts[-1])
            if not isinstance(found, Detections) or found.camera_id not in self.camera_ids:
                continue
            newest = self._pending.get(found.camera_id)
            if newest is None or found.capture_ts_lsl >= newest.capture_ts_lsl:
                self._pending[found.camera_id] = found

    @staticmethod
    def _usable(found: Detections, frame: messages.FrameReady) -> bool:
        """Whether a detection may start faces on `frame`: of the same ring epoch, not of a
        later frame, and of this frame or the one before it, or recent enough."""
        age_s = frame.capture_ts_lsl - found.capture_ts_lsl
        if found.ring_epoch != frame.ring_epoch or age_s < -0.05:
            return False
        return frame.frame_seq - found.frame_seq <= 1 or age_s <= MAX_DETECTION_AGE_S

    def _forget_tracks_at_a_break(self, message: messages.FrameReady) -> None:
        """Note [Tracks across a break]."""
        last = self._last_frame.get(message.camera_id)
        self._last_frame[message.camera_id] = (message.ring_epoch, message.capture_ts_lsl)
        if last is not None and (last[0] != message.ring_epoch
                                 or message.capture_ts_lsl - last[1] > TRACK_BREAK_S):
            self._reset(message.camera_id)

    def _reset(self, camera_id: str) -> None:
        """Forget what was tracked on this camera."""
        self.pipeline.reset(camera_id)
        if self.pose_pipeline is not None:
            self.pose_pipeline.reset(camera_id)

    def _track(self, frame, faces):
        """The frame's faces with their track ids ([(track_id, face)]). (The frame is the
        subscriber's own checked copy: Note [The consumer's own copy].)"""
        message = frame.message
        camera_id = message.camera_id
        tracker = self.track_ids.get(camera_id)
        if tracker is None:
            tracker = self.track_ids[camera_id] = TrackIds(self.track_id_source,
                                                           hold_s=TRACK_HOLD_S)
        ids = tracker.assign([face.box for face in faces], message.capture_ts_lsl)
        named = [(track_id, face) for track_id, face in zip(ids, faces) if track_id is not None]
        if len(named) < len(faces):
            self._no_track_id_for(camera_id, len(faces) - len(named))
        return named

    def _say_identities_trouble(self) -> None:
        trouble = self.identities.trouble()
        if trouble and trouble != self._identities_trouble_said:
            log.error("%s: %s", self.name, trouble)
            self.event("participants_unavailable", reason=trouble)
        self._identities_trouble_said = trouble

    def _publish(self, frame, named, poses, identities, measured_ts_lsl: float) -> None:
        message = frame.message
        camera_id = message.camera_id
        with_landmarks = self.config.output.landmarks
        results = [
            FaceResult(
                track_id=track_id, presence=face.presence, score=face.score, box_px=face.box,
                head_pose_deg=face.head_pose, head_translation_cm=face.head_translation_cm,
                blendshapes=None if face.blendshapes is None else face.blendshapes.tolist(),
                landmarks_px=(np.ascontiguousarray(face.landmarks, dtype="<f4").tobytes()
                              if with_landmarks else None),
                participant=who.participant, identity_confidence=who.confidence,
            )
            for (track_id, face), who in zip(named, identities)
        ]
        reason = self.pipeline.blendshapes_unavailable_reason or ""
        self.results.send(messages.encode(FaceResults(
            camera_id=camera_id, frame_seq=message.frame_seq,
            capture_ts_lsl=message.capture_ts_lsl, faces=results,
            blendshapes_missing_reason=reason,
            poses=None if poses is None else [
                PoseResult.from_arrays(presence=p.presence, score=p.score, box_px=p.box,
                                       landmarks=p.landmarks,
                                       world_landmarks_m=p.world_landmarks_m)
                for p in poses],
            # Note [Latency accounted]
            frame_published_ts_lsl=message.published_ts_lsl,
            picked_up_ts_lsl=frame.picked_up_ts_lsl, read_ts_lsl=frame.read_ts_lsl,
            measured_ts_lsl=measured_ts_lsl, sent_ts_lsl=pylsl.local_clock(),
        )))
        self.rates.setdefault(camera_id, RateMeter()).tick()
        self.faces[camera_id] = len(results)

    # -- track ids (Note [Track id blocks]) ---------------------------------------------------

    def accept_track_ids(self, block: TrackIdBlock) -> None:
        try:
            self.track_id_source.add(block.start, block.count)
        except ValueError as exc:
            log.error("%s: refused a track id block from the supervisor: %s", self.name, exc)
            return
        log.debug("%s: track ids %d..%d", self.name, block.start, block.end - 1)
        self._track_ids_asked_monotonic = None
        self._track_ids_unanswered_warned = False
        self._track_ids_refused = ""
        if self._track_ids_dry:
            self._track_ids_dry = False
            log.warning("%s: track ids again; %d new face(s) went unpublished meanwhile",
                        self.name, self.faces_without_track_id)

    def on_track_id_grant(self, grant: TrackIdGrant) -> None:
        if grant.block is None:
            self._track_ids_refused = grant.error or "the supervisor gave no reason"
            log.error("%s: the supervisor has no track ids for us: %s", self.name,
                      self._track_ids_refused)
            return
        self.accept_track_ids(grant.block)

    def _ask_for_track_ids_if_low(self) -> None:
        """Ask for the next block while half of the newest is left (never wait for it)."""
        if not self.track_id_source.wants_more():
            return
        now = time.monotonic()
        if self._track_ids_asked_monotonic is not None:
            wait_s = (TRACK_IDS_ASK_AGAIN_AFTER_REFUSAL_S if self._track_ids_refused
                      else TRACK_IDS_ASK_AGAIN_S)
            if now - self._track_ids_asked_monotonic < wait_s:
                return
            if not self._track_ids_refused and not self._track_ids_unanswered_warned:
                self._track_ids_unanswered_warned = True
                log.warning("%s: no answer to a request for track ids within %.0f s; asking "
                            "again (%d id(s) left)", self.name, wait_s,
                            self.track_id_source.remaining)
        self.send(TrackIdsWanted(worker=self.name))
        self._track_ids_asked_monotonic = now

    def _no_track_id_for(self, camera_id: str, count: int) -> None:
        """`count` new faces of this frame got no id: they are left out (never a used id)."""
        self.faces_without_track_id += count
        if self._track_ids_dry:
            return
        self._track_ids_dry = True
        reason = self._track_ids_reason()
        log.error("%s: no track id left for a new face on camera %s (%s): new faces are not "
                  "published until ids come, rather than get an id used before (Note [Track id "
                  "blocks])", self.name, camera_id, reason)
        self.event("track_ids_dry", camera=camera_id, reason=reason)

    def _track_ids_reason(self) -> str:
        if self._track_ids_refused:
            return self._track_ids_refused
        if self.track_id_source.blocks_granted == 0:
            return "the supervisor has granted this worker no track ids yet"
        return "the next block of track ids has not come from the supervisor yet"

    def trouble(self) -> str:
        identities = getattr(self, "identities", None)
        if not self._track_ids_dry:
            said = identities.trouble() if identities is not None else ""
        else:
            said = (f"no track ids ({self._track_ids_reason()}): {self.faces_without_track_id} "
                    "new face(s) not published")
        return "; ".join(part for part in (getattr(self, "model_problem", ""), said) if part)

    def camera_reports(self) -> list[CameraReport]:
        return consumer_reports(self.camera_ids, self.subscriber, self.rates, self.faces)

    def stage_timings(self):
        return self.timer.timings()

    def close(self) -> None:
        close_frames(self)
        for name in ("detections", "requests", "results"):
            thing = getattr(self, name, None)
            if thing is not None:
                thing.close()


@dataclass
class _Window:
    """Frames measured and passed over since `started_monotonic` (`_say_if_behind`)."""

    started_monotonic: float
    measured: int = 0
    skipped: int = 0
    skipped_seen: int = 0  # the subscriber's count at the last batch


@dataclass
class _Measuring:
    """A batch whose device work is queued (Note [Reading while the device measures])."""

    received: list  # the subscriber's ReceivedFrames
    pending: PendingTrack
    start_ms: float  # the host's time queueing it


def _as_tensors(found: Detections) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    count = len(found.scores)
    boxes = torch.tensor(found.boxes_px, dtype=torch.float32).reshape(count, 4)
    # A pass that found no face gives (0, 0, 2): reshape(0, -1, 2) is ambiguous and raised,
    # which crash-looped this worker on any camera with nobody in view.
    keypoints = torch.tensor(found.keypoints_px, dtype=torch.float32).reshape(
        count, -1 if count else 0, 2)
    scores = torch.tensor(found.scores, dtype=torch.float32).reshape(count)
    return boxes, keypoints, scores
