"""The frame-index streams' samples: every captured frame of every camera, joined with the
recorder's verdicts (which frame of which video it is). Runs in the output worker, which owns
the outlets (facecast.workers.output.outlets.FrameIndexOutlet).

The output worker subscribes to each camera's frame bus through the frame transport's `FrameBus`
(facecast.shared.transport.subscriber: FrameReady messages only, it never reads pixels nor attaches
a ring) and pushes one sample per frame, stamped with the frame's capture time. While a
recorder has the camera (its `RecordingState` window, Note [Frame index and verdicts]), a frame's
sample waits for the recorder's verdict, at most
VERDICT_WAIT_S of capture age, and samples leave in frame order; otherwise it leaves at once with
-1 in the recording channels.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import zmq

from facecast.shared.transport.messages import FrameReady, FramesRecorded, RecordingState
from facecast.shared.transport.subscriber import EVERY_FRAME_RCVHWM, FrameBus

log = logging.getLogger(__name__)

VERDICT_WAIT_S = 2.0  # > recorder.MAX_READ_AGE_S + the verdict's way here
STATE_EXPIRY_S = 3.0  # a recorder renews its state every second; a dead one stops
MAX_VERDICTS_KEPT = 4096


class CameraFrameIndex:
    """One camera: FrameReady and the recorder's messages in, samples (in frame order) out."""

    def __init__(self, camera_id: str, push: Callable[[float, list[float]], None]) -> None:
        self.camera_id = camera_id
        self._push = push
        # (frame_seq, capture_ts_lsl, frames dropped before this one)
        self.pending: deque[tuple[int, float, int]] = deque()
        self.verdicts: dict[int, tuple[int, int, int]] = {}
        self.state: RecordingState | None = None
        self.state_received_lsl = 0.0
        self.recording_dropped = 0
        self.last_seq: int | None = None
        self.last_epoch = 0
        self.dropped = 0
        self.published = 0

    def on_frame(self, message: FrameReady) -> None:
        if self.last_seq is not None and message.ring_epoch == self.last_epoch:
            self.dropped += max(0, message.frame_seq - self.last_seq - 1)
        self.last_seq, self.last_epoch = message.frame_seq, message.ring_epoch
        self.pending.append((message.frame_seq, message.capture_ts_lsl, self.dropped))

    def on_state(self, state: RecordingState, now_lsl: float) -> None:
        self.state, self.state_received_lsl = state, now_lsl
        self.recording_dropped = state.dropped

    def on_verdicts(self, message: FramesRecorded) -> None:
        for frame_seq, recording_frame, segment, segment_frame in message.frames:
            self.verdicts[frame_seq] = (recording_frame, segment, segment_frame)
        self.recording_dropped = message.dropped
        if len(self.verdicts) > MAX_VERDICTS_KEPT:  # verdicts of frames published without them
            oldest = sorted(self.verdicts)[: len(self.verdicts) - MAX_VERDICTS_KEPT]
            for frame_seq in oldest:
                del self.verdicts[frame_seq]

    def _decided_by_recorder(self, capture_ts_lsl: float, now_lsl: float) -> bool:
        state = self.state
        if state is None or capture_ts_lsl < state.from_ts_lsl:
            return False
        if state.until_ts_lsl > 0:
            return capture_ts_lsl <= state.until_ts_lsl
        return now_lsl - self.state_received_lsl < STATE_EXPIRY_S  # a live recorder's window

    def flush(self, now_lsl: float) -> None:
        while self.pending:
            frame_seq, capture_ts_lsl, dropped = self.pending[0]
            recorded = self._decided_by_recorder(capture_ts_lsl, now_lsl)
            verdict = self.verdicts.pop(frame_seq, None) if recorded else None
            if recorded and verdict is None and now_lsl - capture_ts_lsl < VERDICT_WAIT_S:
                return  # wait for the verdict; later frames wait behind it (frame order)
            self.pending.popleft()
            recording_frame, segment, segment_frame = verdict or (-1, -1, -1)
            self._push(capture_ts_lsl, [frame_seq, recording_frame, segment, segment_frame,
                                        dropped,
                                        self.recording_dropped if recorded else -1])
            self.published += 1


class FrameIndexFeed:
    """The frame buses of the output worker's cameras, and a `CameraFrameIndex` each."""

    def __init__(self, context: zmq.Context, runtime_dir: str) -> None:
        self.cameras: dict[str, CameraFrameIndex] = {}
        # Every frame's message, not the newest.
        self.bus = FrameBus(context, runtime_dir, "frame bus (frame index)", EVERY_FRAME_RCVHWM)

    def add(self, camera_id: str, push: Callable[[float, list[float]], None]) -> None:
        self.bus.add(camera_id)
        self.cameras[camera_id] = CameraFrameIndex(camera_id, push)

    def remove(self, camera_id: str) -> None:
        self.bus.remove(camera_id)
        self.cameras.pop(camera_id, None)

    def on_recorder_message(self, message: RecordingState | FramesRecorded,
                            now_lsl: float) -> None:
        camera = self.cameras.get(message.camera_id)
        if camera is None:
            return
        if isinstance(message, RecordingState):
            camera.on_state(message, now_lsl)
        else:
            camera.on_verdicts(message)

    def step(self, now_lsl: float) -> None:
        """Whatever frames arrived (without blocking), then every sample that may leave."""
        for message in self.bus.drain():
            if isinstance(message, FrameReady):
                camera = self.cameras.get(message.camera_id)
                if camera is not None:
                    camera.on_frame(message)
        for camera in self.cameras.values():
            camera.flush(now_lsl)

    def close(self) -> None:
        self.bus.close()
