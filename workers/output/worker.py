"""The output worker: owns every LSL outlet (DESIGN §1, §4), so that a crash of any other worker
never breaks an inlet's stream.

Per camera it keeps one `Face` stream per face slot (facecast.workers.output.outlets.FaceOutlets) and
pushes one sample per slot for every frame a roi_landmark worker measured, stamped with the
frame's capture time. With `output.pose`, each camera also gets one `MoCap` stream (PoseOutlet):
the best body pose of every frame on which a roi_landmark worker measured pose. It also owns the
daemon's one `Markers` stream: events from every worker and from the supervisor arrive here over
the control socket.

Per camera it also keeps the frame-index stream (`VideoExternal`, FrameIndexOutlet): one sample
per captured frame, recorded or not, from the camera's frame bus (its FrameReady messages, never
its pixels), joined with the recorder's verdicts while the camera is recorded
(facecast.workers.output.frame_index; Note [Frame index and verdicts]).

With `participants.enabled`, each participant also gets a `Face` stream of their own, fed from
the camera that sees them best, and with `synchrony.enabled` the `Synchrony` stream measures
pairs of them (facecast.workers.output.participant_streams).

Frames that no roi_landmark worker got to (it skipped to the newest frame) have no sample: a NaN
sample would claim "no face" for a frame nobody looked at. For the same reason a result that
carries no pose measurement (`FaceResults.poses` is None) adds no MoCap sample.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pylsl
import zmq

from facecast.models import assets
from facecast.shared.transport import endpoints
from facecast.shared.config import Config
from facecast.shared.transport.messages import (
    CameraReport,
    Event,
    FaceResults,
    FramesRecorded,
    MessageGate,
    RecordingState,
)
from facecast.shared.stats import FrameHops, LatencyWindow, RateMeter, window_timings
from facecast.workers.base import Worker, results_subscriber
from facecast.workers.output.frame_index import FrameIndexFeed
from facecast.workers.output.outlets import (
    FACE_LANDMARK_COUNT,
    FaceOutlets,
    FaceSample,
    FrameIndexOutlet,
    MarkerOutlet,
    PoseOutlet,
    close_in_parallel,
)
from facecast.workers.output.participant_streams import ParticipantStreams

log = logging.getLogger(__name__)

# Note [Markers wait for a reader]: how long a new Markers outlet holds the daemon's events
# for inlets to find it (liblsl's recovering inlets took over 2 s on a busy 2-core machine),
# and how long after the first one is back, for the others.
MARKERS_HOLD_S = 15.0
MARKERS_SETTLE_S = 2.0


class OutputWorker(Worker):
    role = "output"

    def boot(self) -> None:
        self.host = self.config.host()
        # The supervisor is this process's parent (Note [One daemon per stream id]).
        self.markers = MarkerOutlet(self.host, daemon_pid=os.getppid(),
                                    runtime_dir=self.runtime_dir, hold_s=MARKERS_HOLD_S,
                                    settle_s=MARKERS_SETTLE_S)
        self.blendshapes_missing = blendshapes_missing_reason(self.config)
        if self.blendshapes_missing:
            self.markers.event("model_missing", model="face_blendshapes",
                               reason=self.blendshapes_missing)
        self.outlets: dict[str, FaceOutlets] = {}
        self.participant_streams: ParticipantStreams | None = None
        self._participant_settings = None
        self._open_participant_streams()
        self.pose_outlets: dict[str, PoseOutlet] = {}  # only with output.pose
        # Every captured frame's number, recorded or not (README "Recording").
        self.frame_index_outlets: dict[str, FrameIndexOutlet] = {}
        self.frame_index = FrameIndexFeed(self.context, self.runtime_dir)
        self.latency: dict[str, LatencyWindow] = {}
        self.hops = FrameHops()  # Note [Latency accounted]
        self.rates: dict[str, RateMeter] = {}
        self.faces: dict[str, int] = {}
        self._results_gate = MessageGate("results")
        self.results = results_subscriber(self.context, rcvhwm=10_000)
        self.results.bind(endpoints.results(self.runtime_dir))
        # Note [Results tap]: a PUB drops what nobody reads.
        self.results_tap = self.context.socket(zmq.PUB)
        self.results_tap.setsockopt(zmq.LINGER, 0)
        self.results_tap.setsockopt(zmq.SNDHWM, 256)
        self.results_tap.bind(endpoints.results_tap(self.runtime_dir))
        self._open_outlets()

    def _open_outlets(self) -> None:
        for outlets in (self.outlets, self.pose_outlets, self.frame_index_outlets):
            for camera_id in list(outlets):
                if camera_id not in self.camera_ids:
                    outlets.pop(camera_id).close()
                    if outlets is self.frame_index_outlets:
                        self.frame_index.remove(camera_id)
        for camera_id in self.camera_ids:
            if camera_id not in self.outlets:
                camera = self.camera(camera_id)
                self.outlets[camera_id] = FaceOutlets(
                    self.host, camera_id, self.config.output.max_faces, camera.fps,
                    self.config.output.landmarks,
                    blendshapes_missing_reason=self.blendshapes_missing,
                )
            if camera_id not in self.frame_index_outlets:
                outlet = FrameIndexOutlet(self.host, camera_id, self.camera(camera_id).fps)
                self.frame_index_outlets[camera_id] = outlet
                self.frame_index.add(camera_id, outlet.push)
            if self.config.output.pose and camera_id not in self.pose_outlets:
                self.pose_outlets[camera_id] = PoseOutlet(self.host, camera_id, self.camera(camera_id).fps)

    def _open_participant_streams(self) -> None:
        """At boot, and after a reload that changed [participants], [synchrony] or the cameras."""
        settings = (self.config.participants, self.config.synchrony, tuple(self.config.cameras))
        if settings == self._participant_settings:
            return
        self._participant_settings = settings
        if self.participant_streams is not None:
            self.participant_streams.close()
            self.participant_streams = None
        if self.config.participants.enabled:
            self.participant_streams = ParticipantStreams(
                self.config, self.host, self.markers, self.blendshapes_missing)

    def reassign(self, previous_camera_ids: list[str]) -> None:
        self._open_outlets()
        self._open_participant_streams()

    def step(self) -> None:
        # The recorders' states before the frames (Note [Frame index and verdicts]).
        if self.results.poll(50):
            self._drain_results()
        self.frame_index.step(pylsl.local_clock())
        self.markers.send_held()  # Note [Markers wait for a reader]
        if self.participant_streams is not None:
            self.participant_streams.step(time.monotonic())

    def _drain_results(self) -> None:
        while self.results.poll(0):
            payload = self.results.recv()
            self.results_tap.send(payload, zmq.NOBLOCK)  # a PUB never blocks: drops instead
            received_ts_lsl = pylsl.local_clock()
            result = self._results_gate.decode(payload)
            if isinstance(result, FaceResults):
                self._push(result, received_ts_lsl)
            elif isinstance(result, (RecordingState, FramesRecorded)):
                self.frame_index.on_recorder_message(result, pylsl.local_clock())

    def _push(self, result: FaceResults, received_ts_lsl: float) -> None:
        outlets = self.outlets.get(result.camera_id)
        if outlets is None:
            return  # a camera removed by a reload, still draining
        samples = [
            FaceSample(
                track_id=face.track_id, presence=face.presence, box_px=face.box_px,
                head_pose_deg=face.head_pose_deg, head_translation_cm=face.head_translation_cm,
                blendshapes=face.blendshapes,
                landmarks_px=(None if face.landmarks_px is None else np.frombuffer(
                    face.landmarks_px, dtype="<f4").reshape(FACE_LANDMARK_COUNT, 3)),
            )
            for face in result.faces
        ]
        try:
            outlets.push_frame(result.capture_ts_lsl, samples)
        except ValueError as exc:  # a malformed result must not kill the streams
            self._results_gate._reject(f"result of camera {result.camera_id} not publishable: {exc}")
            return
        if self.participant_streams is not None:
            try:
                self.participant_streams.on_result(result, samples)
            except ValueError as exc:
                self._results_gate._reject(
                    f"participants of camera {result.camera_id} not publishable: {exc}")
        try:
            self._push_pose(result)
        except ValueError as exc:
            self._results_gate._reject(f"pose of camera {result.camera_id} not publishable: {exc}")
        pushed_ts_lsl = pylsl.local_clock()
        self.latency.setdefault(result.camera_id, LatencyWindow()).add_ms(
            (pushed_ts_lsl - result.capture_ts_lsl) * 1e3)
        self.hops.add((result.capture_ts_lsl, result.frame_published_ts_lsl,
                       result.picked_up_ts_lsl, result.read_ts_lsl, result.measured_ts_lsl,
                       result.sent_ts_lsl, received_ts_lsl, pushed_ts_lsl))
        self.rates.setdefault(result.camera_id, RateMeter()).tick()
        self.faces[result.camera_id] = len(samples)

    def _push_pose(self, result: FaceResults) -> None:
        """The frame's best pose on the camera's MoCap stream (NaN when nobody was found); no
        sample when the sender did not measure pose on this frame."""
        outlet = self.pose_outlets.get(result.camera_id)
        if outlet is None or result.poses is None:
            return
        if not result.poses:
            outlet.push_frame(result.capture_ts_lsl, None)
            return
        best = max(result.poses, key=lambda pose: pose.presence)
        outlet.push_frame(result.capture_ts_lsl, best.world_landmarks_array(), best.landmarks_array()[:, 3])

    def on_event(self, event: Event) -> None:
        timestamp = event.event_ts_lsl if event.event_ts_lsl > 0 else None
        self.markers.event(event.kind, event_ts_lsl=timestamp, **event.fields)

    def stage_timings(self):
        return self.hops.timings()

    def camera_reports(self) -> list[CameraReport]:
        latencies = window_timings([self.latency.get(camera_id) for camera_id in self.camera_ids])
        reports = []
        for camera_id, latency in zip(self.camera_ids, latencies):
            rate = self.rates.get(camera_id)
            reports.append(CameraReport(
                camera_id=camera_id, frames=rate.total if rate else 0,
                fps=round(rate.rate(), 2) if rate else 0.0, faces=self.faces.get(camera_id, 0),
                latency_ms=latency,
            ))
        return reports

    def close(self) -> None:
        if getattr(self, "participant_streams", None) is not None:
            self.participant_streams.close()
        # Note [Closing outlets in parallel]: hundreds of outlets at 64 cameras.
        close_in_parallel([owner.close for owners in ("outlets", "pose_outlets",
                                                     "frame_index_outlets")
                           for owner in getattr(self, owners, {}).values()])
        if getattr(self, "frame_index", None) is not None:
            self.frame_index.close()
        if getattr(self, "markers", None) is not None:
            self.markers.close()
        if getattr(self, "results", None) is not None:
            self.results.close()
        if getattr(self, "results_tap", None) is not None:
            self.results_tap.close()


def blendshapes_missing_reason(config: Config) -> str:
    """Why the blendshape and head translation channels are not published ("" when they are):
    both need face_landmarker.task, the configured one or the installed one (Note [No channel
    that is always NaN])."""
    choice = assets.landmarker_bundle(config.models.face_landmarker_task or None,
                                      config.models.dir or None)
    if choice.available:
        return ""
    return f"no usable face_landmarker.task: {choice.detail}"
