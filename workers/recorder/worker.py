"""The recorder worker: every frame of its cameras, from their rings into video files (DESIGN §1).

One recorder per device (`recorder:<device>`, facecast.daemon.layout.recorder_plan), started by
the supervisor only while a recording runs (`facecast record start`, or `record.start = true`),
and stopped (SIGTERM) by `facecast record stop`. Its own process: an encoder that crashes or a
disk that fills up ends this process's work, never a capture worker's or an LSL stream.

Per camera (`CameraRecording`) the main thread reads every frame the camera publishes, in order
(not the newest-frame policy of the inference workers), through the worker's `FrameSubscriber` in
its every-frame, host-only mode (facecast.shared.transport.subscriber: the one ring reader, which
attaches the rings, asks for their descriptions, copies a slot out, checks its generation and
checksum and reports a mismatch); it numbers the frame, hands it to the camera's encoder thread (a bounded
queue), and tells the output worker at once which frame of which file it will be (Note [Frame
index and verdicts]). The encoder thread writes the frame with its capture time as the
container's timestamp (Note [Container timestamps]) and a row
of the sidecar CSV. One thread per camera, because libx264 releases the GIL: cameras spread over
the cores (docs/benchmarks.md, "Recording").

Note [Recording drops]
    A frame captured during a recording is either in the file (sidecar status "written") or a
    drop, with a sidecar row and a count (status, the frame-index stream): the recorder never
    received its FrameReady (a gap in frame_seq: it fell behind the frame bus), its ring slot
    was overwritten before the recorder copied it, its checksum did not match, the ring was not
    attached yet, it was older than MAX_READ_AGE_S when the recorder got to it, or the
    encoder's queue (MAX_QUEUED_S of frames) was full. Capture never waits for the recorder
    (DESIGN §2, rule 4): a recorder that cannot keep up drops frames, it does not slow the
    camera or the LSL streams.

Note [Frame index and verdicts]
    The output worker owns the frame-index stream (facecast.workers.output.worker), and a sample's
    recording_frame must be the frame's index in the video, so the output worker waits for the
    recorder's verdict. The recorder announces, per camera, `RecordingState(from_ts_lsl)`:
    frames captured from then on are its to decide. `from_ts_lsl` is START_MARGIN_S after the
    recorder's boot, and the state is repeated on every loop until then and every
    STATE_RENEW_S after: ZeroMQ drops what a PUB sends before the SUB's subscription arrives,
    and a FrameReady of a frame captured after from_ts_lsl is sent after the state was. A verdict
    (`FramesRecorded`) is sent as soon as the frame is queued for encoding, before it is
    encoded; a frame older than MAX_READ_AGE_S is not recorded, so a verdict always comes well
    within the output worker's VERDICT_WAIT_S, after which it publishes the frame as not
    recorded. At stop, or when a camera's recording fails, `RecordingState(recording=False,
    until_ts_lsl)` closes the window; a recorder that dies stops renewing its state and the
    output worker stops waiting STATE_EXPIRY_S later. A frame that was queued but could not
    be written because the disk failed after its verdict is named by the record_error marker
    (`last_recording_frame`): the sidecar is the truth about what is in each file.

Note [Overlays]
    With `record.overlays` (or `record start --overlays`) each frame is encoded with its *own*
    faces drawn in (facecast.workers.face_drawing, the drawing of the console's previews: boxes,
    track ids, participant names): the FaceResults of the same camera, frame_seq and capture
    time, received as the console receives them, from the output worker's results tap (Note
    [Results tap]). Results come after their frame (capture → LSL
    p99 42 ms at 16 cameras on the H200, docs/benchmarks.md; longer on a busy CPU), so a frame,
    once read and numbered, waits in its camera's `held` line (main thread) until the first of:
    its results came; results of a later frame came (one roi_landmark worker measures a camera,
    in capture order, passing over frames when behind: a frame passed over never gets any); or
    OVERLAY_WAIT_S of capture time passed. Then it goes to the encoder, drawn on ("drawn" in the
    sidecar's overlay column; a FaceResults with no faces is the frame's results too, with
    nothing to draw) or as captured ("no results"): a frame is never dropped for want of
    results. OVERLAY_WAIT_S = 0.5 s is over ten times the GPU pipeline's p99; it costs memory,
    not frames: held frames count against the encoder's bound, which grows by as much
    (MAX_QUEUED_S + OVERLAY_WAIT_S of frames: at 1080p30, 15 frames or 93 MB more per camera).
    Drops wait their turn in `held` too, so that sidecar rows stay in frame order. The verdict
    (Note [Frame index and verdicts]) is sent when the frame is numbered, as without overlays:
    its place in the file is decided then, so the frame-index stream waits no longer. Frames
    are drawn on in the encoder thread (cameras in parallel), each on its own copy. Without
    overlays the recorder does not subscribe to the tap and nothing waits.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pylsl
import zmq

from facecast.shared.transport import endpoints, messages
from facecast.shared.config import RecordConfig
from facecast.shared.recording import recording_dir, segment_path, writable_dir_problem
from facecast.shared.transport.messages import (
    CameraReport,
    Event,
    FaceResults,
    FrameReady,
    FramesRecorded,
    MessageGate,
    RecordingState,
)
from facecast.shared.transport.subscriber import FrameSubscriber, host_pixels
from facecast.workers.base import BootError, Worker, results_subscriber
from facecast.workers.recorder.video_encoder import (
    PyAvEncoder,
    RecordingWriteError,
    Sidecar,
    VideoEncoder,
)

log = logging.getLogger(__name__)

START_MARGIN_S = 0.5  # Note [Frame index and verdicts]
STATE_RENEW_S = 1.0
MAX_READ_AGE_S = 1.0  # a frame older than this when read is a drop (Note [Recording drops])
MAX_QUEUED_S = 0.5  # frames waiting for the encoder, per camera (1080p: 6 MB each)
ENCODER_JOIN_S = 2.5  # at stop: what is queued gets written (inside daemon.stop_timeout_s)
OVERLAY_WAIT_S = 0.5  # of capture time, for a frame's results (Note [Overlays])
RESULTS_KEPT = 256  # per camera: results that came before their frame was read
MIN_OVERLAY_LINE_PX = 2  # a 1-pixel line loses its colour to 4:2:0 chroma subsampling


def draw_overlay(pixels: np.ndarray, results: FaceResults) -> None:
    """Note [Overlays]: the frame's faces drawn into its own copy, in the encoder thread.
    OpenCV is imported here, not at the top: a recorder without overlays never loads it."""
    from facecast.workers.face_drawing import draw_faces, line_thickness_px

    draw_faces(pixels, results, 1.0, max(MIN_OVERLAY_LINE_PX, line_thickness_px(pixels.shape[1])))


@dataclass
class _Queued:
    """One frame for the encoder thread, or (pixels None) one drop for the sidecar."""

    frame_seq: int
    capture_ts_lsl: float | None
    segment: int
    segment_frame: int = -1
    recording_frame: int = -1
    pixels: np.ndarray | None = None
    status: str = "written"
    # Note [Overlays]: "off", or (set when it leaves `held`) "drawn" with its results, or
    # "no results"; "" for a drop.
    overlay: str = "off"
    results: FaceResults | None = None


class CameraRecording:
    """One camera's recording: its frames (main thread, from the worker's FrameSubscriber)
    and its encoder thread."""

    def __init__(self, worker: RecorderWorker, camera_id: str, directory: Path, stamp: str,
                 from_ts_lsl: float) -> None:
        camera = worker.camera(camera_id)
        self.worker = worker
        self.camera_id = camera_id
        self.fps = camera.fps
        self.directory = directory
        self.stamp = stamp
        self.record: RecordConfig = worker.config.record
        self.from_ts_lsl = from_ts_lsl
        self.until_ts_lsl = 0.0
        self.last_seq: int | None = None
        self.last_epoch = 0
        # Numbering (main thread): Note [Frame index and verdicts].
        self.recording_frame = 0
        self.segment = -1
        self.segment_frame = 0
        self.segment_start_ts_lsl = 0.0
        self.last_capture_ts_lsl = 0.0
        self.dropped = 0
        self.verdicts: list[tuple[int, int, int, int]] = []
        self.files: list[str] = []
        self.state = "recording"
        self.failed_reported = False
        # Encoder thread.
        self.queue: queue.Queue[_Queued | None] = queue.Queue()
        self.queued_frames = 0  # frames (not drops) in the queue; the main thread's bound
        self.queued_lock = threading.Lock()
        self.overlays = self.record.overlays
        self.max_queued = max(2, round(
            (MAX_QUEUED_S + (OVERLAY_WAIT_S if self.overlays else 0.0)) * self.fps))
        # Note [Overlays] (main thread): frames and drops waiting for results, in frame order.
        self.held: collections.deque[_Queued] = collections.deque()
        self.held_frames = 0
        self.results: collections.OrderedDict[int, FaceResults] = collections.OrderedDict()
        self.newest_results_ts_lsl = -math.inf
        self.frames_written = 0  # encoder thread
        self.last_written_recording_frame = -1
        self.error = ""  # set by the encoder thread when writing failed
        self.current_file = ""
        self.thread = threading.Thread(target=self._encode_loop, name=f"encode:{camera_id}",
                                       daemon=True)
        self.thread.start()

    # -- main thread ---------------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        return self.state == "recording"

    def on_frame(self, message: FrameReady) -> None:
        if not self.recording or message.capture_ts_lsl < self.from_ts_lsl:
            return
        if self.last_seq is not None and message.ring_epoch == self.last_epoch:
            for missing_seq in range(self.last_seq + 1, min(message.frame_seq,
                                                           self.last_seq + 1 + 10_000)):
                self._drop(missing_seq, None, "dropped: never received (the recorder fell "
                           "behind the frame bus)")
        self.last_seq, self.last_epoch = message.frame_seq, message.ring_epoch
        subscriber = self.worker.subscriber
        if not subscriber.attached(message):  # it asks for the ring's description
            self._drop(message.frame_seq, message.capture_ts_lsl,
                       "dropped: the camera's ring was not attached yet")
            return
        age_s = pylsl.local_clock() - message.capture_ts_lsl
        if age_s > MAX_READ_AGE_S:
            self._drop(message.frame_seq, message.capture_ts_lsl,
                       f"dropped: {age_s:.2f} s old when the recorder got to it")
            return
        with self.queued_lock:
            full = self.queued_frames + self.held_frames >= self.max_queued
        if full:
            self._drop(message.frame_seq, message.capture_ts_lsl,
                       "dropped: the encoder was behind (its queue was full)")
            return
        read = subscriber.read(message)  # a mismatch is reported there (Note [Mismatches are events])
        if not read.ok:
            reason = f"{read.verdict.value} in the ring before the recorder read it"
            self._drop(message.frame_seq, message.capture_ts_lsl, f"dropped: {reason}")
            return
        pixels = host_pixels(read.tensor)  # the reader's own copy, checked
        self._number(message.capture_ts_lsl)
        self._enqueue(_Queued(message.frame_seq, message.capture_ts_lsl, self.segment,
                              self.segment_frame, self.recording_frame, pixels))
        self.verdicts.append((message.frame_seq, self.recording_frame, self.segment,
                              self.segment_frame))
        self.recording_frame += 1
        self.segment_frame += 1
        self.last_capture_ts_lsl = message.capture_ts_lsl

    def _number(self, capture_ts_lsl: float) -> None:
        """The frame's segment: a new one every record.segment_s of capture time."""
        if self.segment < 0 or capture_ts_lsl - self.segment_start_ts_lsl >= self.record.segment_s:
            self.segment += 1
            self.segment_frame = 0
            self.segment_start_ts_lsl = capture_ts_lsl
            path = self.path(self.segment)
            self.files.append(path.name)
            kind = "record_start" if self.segment == 0 else "record_segment"
            self.worker.send(Event(kind=kind, event_ts_lsl=capture_ts_lsl, fields={
                "worker": self.worker.name, "camera": self.camera_id, "file": path.name,
                "dir": str(self.directory), "segment": self.segment,
                "recording_frame": self.recording_frame,
                "sidecar": path.with_suffix(".csv").name}))

    def path(self, segment: int) -> Path:
        return segment_path(self.directory, self.camera_id, self.stamp, segment,
                            self.record.container)

    def _drop(self, frame_seq: int, capture_ts_lsl: float | None, status: str) -> None:
        self.dropped += 1
        self._enqueue(_Queued(frame_seq, capture_ts_lsl, self.segment, status=status, overlay=""))

    def _enqueue(self, item: _Queued) -> None:
        """To the encoder, or with overlays to the end of `held` (Note [Overlays])."""
        if self.overlays:
            self.held.append(item)
            self.held_frames += item.pixels is not None
            return
        self._to_encoder(item)

    def _to_encoder(self, item: _Queued) -> None:
        if item.pixels is not None:
            with self.queued_lock:
                self.queued_frames += 1
        self.queue.put(item)

    def on_results(self, results: FaceResults) -> None:
        """A FaceResults from the results tap (Note [Overlays]); kept until its frame leaves
        `held`, or RESULTS_KEPT later ones came."""
        if not self.recording or results.capture_ts_lsl < self.from_ts_lsl:
            return
        self.results[results.frame_seq] = results
        self.results.move_to_end(results.frame_seq)
        while len(self.results) > RESULTS_KEPT:
            self.results.popitem(last=False)
        self.newest_results_ts_lsl = max(self.newest_results_ts_lsl, results.capture_ts_lsl)

    def release(self, now_ts_lsl: float, closing: bool = False) -> None:
        """Frames of `held` whose wait is over go to the encoder, in order (Note [Overlays]);
        `closing`: every one, with the results that came."""
        while self.held:
            item = self.held[0]
            if item.pixels is not None:
                results = self.results.get(item.frame_seq)
                if results is not None and results.capture_ts_lsl != item.capture_ts_lsl:
                    results = None  # the same frame_seq of an earlier capture process
                if (results is None and not closing
                        and now_ts_lsl < item.capture_ts_lsl + OVERLAY_WAIT_S
                        and self.newest_results_ts_lsl <= item.capture_ts_lsl):
                    break
                self.results.pop(item.frame_seq, None)
                item.results = results
                item.overlay = "drawn" if results is not None else "no results"
                self.held_frames -= 1
            self.held.popleft()
            self._to_encoder(item)

    def next_release_ts_lsl(self) -> float:
        """When the first held frame's wait ends (math.inf when no frame waits)."""
        for item in self.held:
            if item.pixels is not None:
                return item.capture_ts_lsl + OVERLAY_WAIT_S
        return math.inf

    def check_failure(self) -> None:
        """An encoder thread that failed: stop this camera's recording, say why (once)."""
        if not self.error or self.failed_reported:
            return
        self.failed_reported = True
        self.state = f"stopped: {self.error}"
        self.held.clear()  # nothing more is written
        self.held_frames = 0
        self.until_ts_lsl = max(self.last_capture_ts_lsl, self.from_ts_lsl)
        log.error("camera %s: recording stopped: %s", self.camera_id, self.error)
        self.worker.send(Event(kind="record_error", fields={
            "worker": self.worker.name, "camera": self.camera_id, "reason": self.error,
            "file": Path(self.current_file).name, "dir": str(self.directory),
            "last_recording_frame": self.last_written_recording_frame,
            "frames": self.frames_written, "dropped": self.dropped}))

    def state_message(self) -> RecordingState:
        return RecordingState(camera_id=self.camera_id, recording=self.recording,
                              from_ts_lsl=self.from_ts_lsl, until_ts_lsl=self.until_ts_lsl,
                              file=Path(self.current_file).name, dropped=self.dropped)

    def take_verdicts(self) -> FramesRecorded | None:
        if not self.verdicts:
            return None
        verdicts, self.verdicts = self.verdicts, []
        return FramesRecorded(camera_id=self.camera_id, frames=verdicts, dropped=self.dropped)

    def finish(self, deadline_monotonic: float) -> None:
        """Stop: what is queued is written, the files are closed (bounded by the deadline)."""
        if self.recording:
            self.state = "stopped: record stop"
            self.until_ts_lsl = max(self.last_capture_ts_lsl, self.from_ts_lsl)
        self.release(pylsl.local_clock(), closing=True)
        self.queue.put(None)
        self.thread.join(max(0.1, deadline_monotonic - time.monotonic()))
        if self.thread.is_alive():
            log.error("camera %s: the encoder did not finish within the stop deadline; its last "
                      "file may lack its last frames", self.camera_id)

    def report(self) -> CameraReport:
        return CameraReport(camera_id=self.camera_id, frames=self.frames_written,
                            recording=self.state, recording_file=self.current_file,
                            recorded_frames=self.frames_written, recording_drops=self.dropped)

    # -- encoder thread ------------------------------------------------------------------------

    def _encode_loop(self) -> None:
        encoder: VideoEncoder | None = None
        sidecar: Sidecar | None = None
        open_segment = -1
        early_drops: list[_Queued] = []  # before the first frame: go into the first sidecar
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    break
                if item.pixels is not None:
                    with self.queued_lock:
                        self.queued_frames -= 1
                if self.error:
                    continue  # failed: the rest is let go (the main thread stops queueing)
                if item.segment != open_segment and item.segment >= 0 and item.pixels is not None:
                    self._close(encoder, sidecar)
                    encoder = sidecar = None
                    path = self.path(item.segment)
                    self.current_file = str(path)
                    sidecar = Sidecar(path.with_suffix(".csv"))
                    encoder = self._encoder(path, item.pixels.shape)
                    open_segment = item.segment
                    for drop in early_drops:
                        sidecar.row(-1, -1, drop.frame_seq, drop.capture_ts_lsl, drop.status,
                                    drop.overlay)
                    early_drops.clear()
                if item.pixels is None:
                    if sidecar is not None:
                        sidecar.row(-1, -1, item.frame_seq, item.capture_ts_lsl, item.status,
                                    item.overlay)
                    else:
                        early_drops.append(item)
                    continue
                if item.results is not None:
                    draw_overlay(item.pixels, item.results)
                encoder.write(item.pixels, item.capture_ts_lsl)
                sidecar.row(item.segment_frame, item.recording_frame, item.frame_seq,
                            item.capture_ts_lsl, "written", item.overlay)
                self.frames_written += 1
                self.last_written_recording_frame = item.recording_frame
            self._close(encoder, sidecar)
        except RecordingWriteError as exc:
            self.error = str(exc)
            for part in (encoder, sidecar):
                if isinstance(part, VideoEncoder):
                    part.abandon()
        except Exception as exc:  # noqa: BLE001 - an encoder bug stops this camera, not the rest
            log.exception("camera %s: encoder failed", self.camera_id)
            self.error = f"encoder failed: {type(exc).__name__}: {exc}"
        finally:
            # Drain, so that the main thread's bound on queued frames stays true.
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item.pixels is not None:
                    with self.queued_lock:
                        self.queued_frames -= 1

    def _encoder(self, path: Path, shape: tuple[int, ...]) -> VideoEncoder:
        height, width = shape[:2]
        return PyAvEncoder(path, width, height, self.fps, container=self.record.container,
                           codec=self.record.codec, preset=self.record.preset,
                           crf=self.record.crf)

    @staticmethod
    def _close(encoder: VideoEncoder | None, sidecar: Sidecar | None) -> None:
        if encoder is not None:
            encoder.close()
        if sidecar is not None:
            sidecar.close()


class RecorderWorker(Worker):
    role = "recorder"

    def boot(self) -> None:
        try:
            import av  # a missing PyAV is a boot error, not a crash loop
        except ImportError as exc:
            raise BootError(f"cannot record: PyAV is not installed ({exc}); pip install av")
        # The supervisor puts `record start --dir` into this worker's record.dir.
        directory = recording_dir("", self.config.record.dir)
        problem = writable_dir_problem(directory)
        if problem:
            raise BootError(f"cannot record: {problem}")
        self.directory = directory
        now_s = time.time()  # milliseconds too: a restart within a second gets new files
        stamp = (f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now_s))}."
                 f"{int(now_s * 1000) % 1000:03d}Z")
        self.bus = self.context.socket(zmq.PUB)
        self.bus.setsockopt(zmq.LINGER, 200)  # the last verdicts and states of a stop
        self.bus.connect(endpoints.results(self.runtime_dir))
        # Every frame, not the newest; host only (no torch: the recorder's boot stays short, it
        # starts at `facecast record start`); every frame's checksum, on "sampled" rings too.
        self.subscriber = FrameSubscriber(self.context, self.runtime_dir, self.camera_ids,
                                          device=None, checksum_every=1, on_event=self.event,
                                          every_frame=True)  # Note [Mismatches are events]
        self.poller = zmq.Poller()
        self.subscriber.register(self.poller)
        self.results: zmq.Socket | None = None
        if self.config.record.overlays:  # Note [Overlays]; off: no subscription at all
            self._gate_results = MessageGate("results tap (recorder)")
            self.results = results_subscriber(self.context, rcvhwm=10_000)
            self.results.connect(endpoints.results_tap(self.runtime_dir))
            self.poller.register(self.results, zmq.POLLIN)
        from_ts_lsl = pylsl.local_clock() + START_MARGIN_S
        self.cameras: dict[str, CameraRecording] = {}
        for camera_id in self.camera_ids:
            self.cameras[camera_id] = CameraRecording(self, camera_id, directory, stamp,
                                                      from_ts_lsl)
            self.subscriber.request_description(camera_id)  # its ring before its first frame
        self._from_ts_lsl = from_ts_lsl
        self._next_state_monotonic = 0.0
        log.info("recording %s into %s (%s, %s, segments of %g s; PyAV %s)",
                 ", ".join(self.camera_ids), directory, self.config.record.container,
                 self.config.record.codec, self.config.record.segment_s, av.__version__)

    def step(self) -> None:
        events = dict(self.poller.poll(self._poll_timeout_ms()))
        for message in self.subscriber.every_frame(events):
            self.cameras[message.camera_id].on_frame(message)
        if self.results is not None and self.results in events:
            self._drain_results()
        if self.results is not None:
            now_ts_lsl = pylsl.local_clock()
            for camera in self.cameras.values():
                camera.release(now_ts_lsl)
        for camera in self.cameras.values():
            camera.check_failure()
            verdicts = camera.take_verdicts()
            if verdicts is not None:
                self._publish(verdicts)
        self._renew_states()

    def _poll_timeout_ms(self) -> int:
        """100 ms, or less while a held frame's wait ends sooner (Note [Overlays])."""
        timeout_s = 0.1
        if self.results is not None:
            next_ts_lsl = min((c.next_release_ts_lsl() for c in self.cameras.values()),
                              default=math.inf)
            timeout_s = min(timeout_s, max(0.0, next_ts_lsl - pylsl.local_clock()))
        return math.ceil(timeout_s * 1000)

    def _drain_results(self) -> None:
        """The results tap's FaceResults to their cameras; the rest of what it carries (other
        cameras', the recorders' own verdicts and states) is not ours."""
        for message in self._gate_results.drain(self.results):
            if isinstance(message, FaceResults):
                camera = self.cameras.get(message.camera_id)
                if camera is not None:
                    camera.on_results(message)

    def _renew_states(self, force: bool = False) -> None:
        """Note [Frame index and verdicts]: on every loop until from_ts, then every second."""
        now = time.monotonic()
        starting = pylsl.local_clock() < self._from_ts_lsl + START_MARGIN_S
        if force or starting or now >= self._next_state_monotonic:
            self._next_state_monotonic = now + STATE_RENEW_S
            for camera in self.cameras.values():
                self._publish(camera.state_message())

    def _publish(self, message: messages.Message) -> None:
        try:
            self.bus.send(messages.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: output worker not keeping up; dropped a %s", self.name,
                        type(message).__name__)

    def camera_reports(self) -> list[CameraReport]:
        return [camera.report() for camera in getattr(self, "cameras", {}).values()]

    def trouble(self) -> str:
        failed = [f"{c.camera_id}: {c.state}" for c in self.cameras.values() if not c.recording]
        return "; ".join(failed)

    def close(self) -> None:
        cameras = getattr(self, "cameras", {})
        if getattr(self, "results", None) is not None:
            self._drain_results()  # the held frames' last results (Note [Overlays])
        deadline_monotonic = time.monotonic() + ENCODER_JOIN_S
        for camera in cameras.values():
            was_recording = camera.recording
            camera.finish(deadline_monotonic)
            camera.check_failure()
            verdicts = camera.take_verdicts()  # the last loop's, before the closing state
            if verdicts is not None:
                self._publish(verdicts)
            if was_recording or camera.files:
                self.send(Event(kind="record_stop", fields={
                    "worker": self.name, "camera": camera.camera_id,
                    "files": ",".join(camera.files), "dir": str(self.directory),
                    "frames": camera.frames_written, "dropped": camera.dropped,
                    "state": camera.state}))
        if cameras:
            self._renew_states(force=True)
        if getattr(self, "subscriber", None) is not None:
            self.subscriber.close()  # its rings too, once every camera's encoder has finished
        for socket in [getattr(self, "bus", None), getattr(self, "results", None)]:
            if socket is not None:
                socket.close()
