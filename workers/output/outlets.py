"""The LSL side of the output worker: Face (per slot and per participant), MoCap, frame-index,
Synchrony and Markers outlets (DESIGN §4).

Runs in the output worker process only, so that a crash anywhere else leaves consumers' streams
alone. Everything here is fixed at construction: an LSL stream's channel count and metadata cannot
change while inlets are connected, which is why `max_faces`, `landmarks` and whether blendshapes
and head translation are available are constructor arguments.

Note [No channel that is always NaN]
    A channel is published only when something fills it: a consumer (LabRecorder, an XDF file)
    cannot tell "never measured" from "no face" in a NaN, and a channel NaN in every sample of
    every recording is a broken promise. The 52 blendshape channels and head_tx/ty/tz come from
    face_landmarker.task (the blendshape model, the face geometry metadata); without the bundle
    they are left out of the stream, and its metadata (facecast/blendshapes,
    facecast/head_translation) says why. NaN then only ever means "this slot has no face in
    this frame" (or, in the landmark channels, a point the model did not give).

Note [Markers wait for a reader]
    An LSL inlet receives the samples pushed after it connected, none before. When the output
    worker restarts, its Markers outlet is created again, and every inlet that read the old one
    (LabRecorder's, with recovery) needs a moment to find it: on a busy 2-core machine more
    than the 2 s the supervisor once waited (CI, 2026-11-28: the worker_restart marker of the
    output worker itself was lost). So the outlet that owns the markers holds them until it has
    a reader (`have_consumers`), or until `hold_s` has passed since it was created (nobody
    reads them then, and a late reader would not get them from LSL either), and sends them in
    order. At close, whatever is still held is sent. A daemon has two readers at least, the
    console's and the lab's (LabRecorder), which reconnect about together but not at once: when
    the first to be back released the markers, the other missed them (the same e2e test,
    2026-11-28, the console first). So the markers go once the outlet has had a reader for
    `settle_s` (the output worker's: 2 s), time for the others to be back too. A reader later
    than that still misses them, as it would miss any sample pushed before it connected.

Every sample carries the frame's **capture** timestamp (`pylsl.local_clock()` domain, taken at
grab by the capture worker), never the time of the push; LSL keeps it as a double, so it never
passes through the float32 channels.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pylsl

from facecast.shared.face_schema import (
    BLENDSHAPE_NAMES,
    FACE_LANDMARK_COUNT,
    POSE_LANDMARK_NAMES,
)
from facecast.shared.version import __version__

log = logging.getLogger(__name__)

# The Face stream's fixed head: (label, unit, type). Head pose types follow XDF's MoCap
# conventions (OrientationH/P/R for heading/pitch/roll Euler angles, PositionX/Y/Z).
_FACE_HEAD_CHANNELS: tuple[tuple[str, str, str], ...] = (
    ("track_id", "none", "TrackId"),
    ("presence", "normalized", "Score"),
    ("box_x1", "pixels", "BoxX1"),
    ("box_y1", "pixels", "BoxY1"),
    ("box_x2", "pixels", "BoxX2"),
    ("box_y2", "pixels", "BoxY2"),
    ("head_yaw", "degrees", "OrientationH"),
    ("head_pitch", "degrees", "OrientationP"),
    ("head_roll", "degrees", "OrientationR"),
)
# MediaPipe's facial transformation matrix's translation: camera space, OpenGL axes (x right,
# y up, z toward the viewer: a face in front of the camera has tz < 0).
_HEAD_TRANSLATION_CHANNELS: tuple[tuple[str, str, str], ...] = (
    ("head_tx", "centimeters", "PositionX"),
    ("head_ty", "centimeters", "PositionY"),
    ("head_tz", "centimeters", "PositionZ"),
)


def face_channels(landmarks: bool, blendshapes: bool = True,
                  head_translation: bool = True) -> list[tuple[str, str, str]]:
    """The Face stream's channels as (label, unit, type), in stream order: only those that
    something fills (Note [No channel that is always NaN])."""
    channels = list(_FACE_HEAD_CHANNELS)
    if head_translation:
        channels += _HEAD_TRANSLATION_CHANNELS
    if blendshapes:
        channels += [(name, "normalized", "Blendshape") for name in BLENDSHAPE_NAMES]
    if landmarks:
        for index in range(FACE_LANDMARK_COUNT):
            for axis in "xyz":
                label = f"landmark{index:03d}_{axis}"
                channels.append((label, "pixels", f"Position{axis.upper()}"))
    return channels


def pose_channels() -> list[tuple[str, str, str, str]]:
    """The MoCap stream's channels as (label, unit, type, marker), in stream order."""
    channels: list[tuple[str, str, str, str]] = []
    for marker in POSE_LANDMARK_NAMES:
        for axis in "xyz":
            channels.append((f"{marker}_{axis}", "meters", f"Position{axis.upper()}", marker))
        channels.append((f"{marker}_visibility", "normalized", "Confidence", marker))
    return channels


@dataclass(frozen=True, slots=True)
class FaceSample:
    """One tracked face in one frame, as the output worker publishes it.

    box_px: (x1, y1, x2, y2) in frame pixels. head_pose_deg: (yaw, pitch, roll) in degrees.
    head_translation_cm: (tx, ty, tz) of the head in camera space, in centimeters (the
    translation of MediaPipe's facial transformation matrix). blendshapes: 52 scores in
    `BLENDSHAPE_NAMES` order. landmarks_px: (478, 3) in frame pixels (z on the x scale). Each is
    used only when the outlets publish its channels; a part missing from one face is NaN.
    Track ids travel in a float32 channel: exact up to 2**24.
    """

    track_id: int
    presence: float
    box_px: tuple[float, float, float, float]
    head_pose_deg: tuple[float, float, float] | None = None
    head_translation_cm: tuple[float, float, float] | None = None
    blendshapes: Sequence[float] | np.ndarray | None = None
    landmarks_px: np.ndarray | None = None


def face_stream_name(camera_id: str, slot: int) -> str:
    return f"facecast {camera_id} face{slot}"


def face_source_id(host: str, camera_id: str, slot: int) -> str:
    return f"facecast-{host}-{camera_id}-face{slot}"


def _check_capture_ts(capture_ts_lsl: float) -> float:
    # 0.0 would make liblsl stamp the sample with the push time: exactly what must not happen.
    is_number = isinstance(capture_ts_lsl, (int, float, np.floating))
    if not (is_number and math.isfinite(capture_ts_lsl)):
        raise ValueError(f"capture_ts_lsl must be a finite LSL time, got {capture_ts_lsl!r}")
    if capture_ts_lsl <= 0.0:
        raise ValueError(
            f"capture_ts_lsl must be > 0 (pylsl.local_clock() at grab), got {capture_ts_lsl!r}"
        )
    return float(capture_ts_lsl)


def _append_text(parent: Any, name: str, value: object) -> None:
    parent.append_child_value(name, str(value))


# Note [Closing outlets in parallel]
#     liblsl's outlet destructor takes about 26 ms (it stops the outlet's network threads), one
#     after another: 200 outlets took 5.2 s on the 2-core machine, longer than the daemon gives a
#     worker to stop, so at 32 and 64 cameras the output worker (2 Face streams and a frame-index
#     stream per camera) was SIGKILLed at every stop. The destructor is a C call that releases
#     the GIL, so threads close them side by side: the same 200 in 0.25 s. Each closer drops the
#     last reference to its outlets in its own thread (never an explicit second destroy).
CLOSING_THREADS = 16
CLOSING_TIMEOUT_S = 10.0


def close_in_parallel(closers: Sequence[Callable[[], None]]) -> None:
    """Call every closer (an outlet owner's `close`), on up to CLOSING_THREADS threads (Note
    [Closing outlets in parallel]); returns when all are done, or after CLOSING_TIMEOUT_S."""
    pending = list(closers)

    def close_some() -> None:
        while True:
            try:
                close = pending.pop()
            except IndexError:
                return
            try:
                close()
            except Exception:  # noqa: BLE001 - one outlet's trouble must not keep the others open
                log.exception("closing an LSL outlet failed")

    threads = [threading.Thread(target=close_some, name="close-outlets", daemon=True)
               for _ in range(min(CLOSING_THREADS, len(pending)))]
    for thread in threads:
        thread.start()
    deadline_monotonic = time.monotonic() + CLOSING_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline_monotonic - time.monotonic()))


# Note [Rates that survive XDF loading]
#     A stream of measured frames (Face, participant Face, MoCap) gets a sample for each frame the
#     face stack measured, which is fewer than the camera captures whenever it falls behind (9.9
#     of 15 Hz on 2 cores, 5-6 Hz under load), and the frame-index stream loses frames a capture
#     worker skips. Declared at the camera's rate, such streams were "regular" to XDF readers:
#     `pyxdf.load_xdf` with its defaults dejitters every stream with a nominal rate (a linear fit
#     of the timestamps), which moved Face timestamps by a median of 32 ms and up to 99 ms away
#     from their capture times (issue 21). So these streams declare an irregular rate, which
#     every reader leaves as stamped, and say the camera's rate in desc/facecast/camera_fps. A
#     sample's timestamp is its frame's capture time; the frame's number is on the camera's
#     frame-index stream at the same timestamp.
def _capture_timed(desc_facecast: Any, fps: float) -> None:
    """The metadata of a stream with one sample per (measured) frame, stamped at its capture
    time (Note [Rates that survive XDF loading])."""
    _append_text(desc_facecast, "timestamps", "capture time: pylsl.local_clock() at frame grab")
    _append_text(desc_facecast, "camera_fps", f"{fps:g}")
    _append_text(desc_facecast, "rate", "irregular: one sample per frame measured, at the "
                 "frame's capture time; frame numbers: the camera's frame-index stream, same "
                 "timestamps")


def _face_channels_desc(desc: Any, channels: list[tuple[str, str, str]]) -> None:
    """The XDF channel descriptions of a Face stream: label, unit, type per channel."""
    parent = desc.append_child("channels")
    for label, unit, kind in channels:
        channel = parent.append_child("channel")
        _append_text(channel, "label", label)
        _append_text(channel, "unit", unit)
        _append_text(channel, "type", kind)


def _acquisition(desc: Any, model: str) -> None:
    acquisition = desc.append_child("acquisition")
    _append_text(acquisition, "manufacturer", "facecast")
    _append_text(acquisition, "model", model)
    _append_text(acquisition, "version", __version__)
    # Timestamps are taken at frame grab: nothing downstream of the grab is in them.
    _append_text(acquisition, "compensated_lag", 0)


class FaceOutlets:
    """One `Face` stream per face slot of one camera (DESIGN §4).

    `push_frame()` publishes one sample on every slot for every frame: the face tracked in that
    slot, or NaN in every channel when the slot is empty. A track keeps its slot while it is
    seen, and the slot stays reserved for it for `slot_hold_s` of capture time after it was last
    seen (a short occlusion), so that a person does not jump between streams. Faces beyond the
    free slots are not published (counted in `faces_dropped`); the most confident get slots first.
    """

    def __init__(
        self,
        host: str,
        camera_id: str,
        max_faces: int,
        fps: float,
        landmarks: bool,
        *,
        blendshapes_missing_reason: str = "",
        head_translation_missing_reason: str | None = None,
        slot_hold_s: float = 1.0,
        max_buffered_s: int = 360,
    ) -> None:
        if not host or not camera_id:
            raise ValueError(f"host and camera_id must be non-empty, got {host!r}, {camera_id!r}")
        if not 1 <= max_faces <= 16:
            raise ValueError(f"max_faces must be 1..16 (output.max_faces), got {max_faces!r}")
        if not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be > 0 (the camera's nominal rate), got {fps!r}")
        self.host = host
        self.camera_id = camera_id
        self.max_faces = max_faces
        self.fps = float(fps)
        self.landmarks = bool(landmarks)
        self.blendshapes_missing_reason = blendshapes_missing_reason
        # Both come from face_landmarker.task: by default one reason covers both.
        self.head_translation_missing_reason = (blendshapes_missing_reason
                                                if head_translation_missing_reason is None
                                                else head_translation_missing_reason)
        self.slot_hold_s = float(slot_hold_s)
        self.layout = FaceLayout(self.landmarks, not self.blendshapes_missing_reason,
                                 not self.head_translation_missing_reason)
        self.channels = self.layout.channels
        self.channel_count = len(self.channels)
        self.faces_dropped = 0  # faces seen while every slot was taken
        self._slot_track: list[int | None] = [None] * max_faces
        self._slot_last_seen_ts_lsl: list[float] = [-math.inf] * max_faces
        self._empty = np.full(self.channel_count, np.nan, dtype=np.float32)
        self._outlets = [
            pylsl.StreamOutlet(self._info(slot), max_buffered=max_buffered_s)
            for slot in range(max_faces)
        ]
        log.info(
            "LSL: %d Face stream(s) for camera %s, %d channels each, %.3g Hz; blendshapes: %s",
            max_faces,
            camera_id,
            self.channel_count,
            self.fps,
            f"not published ({blendshapes_missing_reason})" if blendshapes_missing_reason
            else "published",
        )

    def _info(self, slot: int) -> pylsl.StreamInfo:
        info = pylsl.StreamInfo(
            face_stream_name(self.camera_id, slot),
            "Face",
            self.channel_count,
            pylsl.IRREGULAR_RATE,  # Note [Rates that survive XDF loading]
            pylsl.cf_float32,
            face_source_id(self.host, self.camera_id, slot),
        )
        desc = info.desc()
        _face_channels_desc(desc, self.channels)
        _acquisition(desc, "MediaPipe face models in PyTorch")
        facecast = desc.append_child("facecast")
        _append_text(facecast, "host", self.host)
        _append_text(facecast, "camera", self.camera_id)
        _append_text(facecast, "slot", slot)
        _append_text(facecast, "max_faces", self.max_faces)
        _append_text(facecast, "landmarks", "true" if self.landmarks else "false")
        _append_text(facecast, "landmark_count", FACE_LANDMARK_COUNT if self.landmarks else 0)
        _append_text(facecast, "empty_slot", "NaN in every channel")
        _capture_timed(facecast, self.fps)
        for part, reason in (("blendshapes", self.blendshapes_missing_reason),
                             ("head_translation", self.head_translation_missing_reason)):
            element = facecast.append_child(part)
            _append_text(element, "available", "false" if reason else "true")
            if reason:  # Note [No channel that is always NaN]
                _append_text(element, "channels", "not published")
                _append_text(element, "reason", reason)
        return info

    @property
    def source_ids(self) -> list[str]:
        return [face_source_id(self.host, self.camera_id, k) for k in range(self.max_faces)]

    def slot_tracks(self) -> list[int | None]:
        """The track id each slot holds (or is reserved for), by slot."""
        return list(self._slot_track)

    def push_frame(self, capture_ts_lsl: float, faces: Sequence[FaceSample]) -> list[int | None]:
        """Publish one frame: one sample per slot, all stamped `capture_ts_lsl`.

        Returns the track id published in each slot (None: the slot's sample is NaN).
        """
        capture_ts_lsl = _check_capture_ts(capture_ts_lsl)
        by_track = self._assign_slots(capture_ts_lsl, faces)
        published: list[int | None] = []
        for slot, outlet in enumerate(self._outlets):
            track_id = self._slot_track[slot]
            face = by_track.get(track_id) if track_id is not None else None
            sample = self._empty if face is None else self._sample(face)
            outlet.push_chunk(sample[np.newaxis, :], timestamp=capture_ts_lsl)
            published.append(None if face is None else face.track_id)
        return published

    def _assign_slots(
        self, capture_ts_lsl: float, faces: Sequence[FaceSample]
    ) -> dict[int, FaceSample]:
        by_track: dict[int, FaceSample] = {}
        for face in faces:
            other = by_track.get(face.track_id)
            if other is None or face.presence > other.presence:
                by_track[face.track_id] = face
        if len(by_track) != len(faces):
            log.warning("camera %s: the same track id twice in one frame", self.camera_id)
        for slot, track_id in enumerate(self._slot_track):
            if track_id is None:
                continue
            if track_id in by_track:
                self._slot_last_seen_ts_lsl[slot] = capture_ts_lsl
            elif capture_ts_lsl - self._slot_last_seen_ts_lsl[slot] > self.slot_hold_s:
                self._slot_track[slot] = None
        held = set(self._slot_track)
        newcomers = sorted(
            (face for face in by_track.values() if face.track_id not in held),
            key=lambda face: -face.presence,
        )
        for face in newcomers:
            slot = self._free_slot()
            if slot is None:
                self.faces_dropped += 1
                del by_track[face.track_id]
                continue
            self._slot_track[slot] = face.track_id
            self._slot_last_seen_ts_lsl[slot] = capture_ts_lsl
        return by_track

    def _free_slot(self) -> int | None:
        """The lowest empty slot. A slot held for an occluded track is not free: a newcomer waits
        (unpublished, counted in `faces_dropped`) rather than take over someone else's stream."""
        for slot, track_id in enumerate(self._slot_track):
            if track_id is None:
                return slot
        return None

    def _sample(self, face: FaceSample) -> np.ndarray:
        return self.layout.sample(face)

    def close(self) -> None:
        """Drop the outlets: their streams disappear from the network."""
        self._outlets.clear()

    def __enter__(self) -> FaceOutlets:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class FaceLayout:
    """A Face sample's channels (`face_channels()`, then `extra` channels, which the caller
    fills) and one face's values in them: shared by the slot streams and the participant
    streams (facecast.workers.output.participant_streams)."""

    def __init__(self, landmarks: bool, blendshapes: bool, head_translation: bool,
                 extra: Sequence[tuple[str, str, str]] = ()) -> None:
        self.channels = face_channels(landmarks, blendshapes, head_translation) + list(extra)
        self.labels = [label for label, _, _ in self.channels]
        labels = self.labels
        self._translation_at = labels.index("head_tx") if "head_tx" in labels else None
        self._blendshapes_at = labels.index(BLENDSHAPE_NAMES[0]) if BLENDSHAPE_NAMES[0] in labels else None
        self._landmarks_at = labels.index("landmark000_x") if landmarks else None
        self._landmarks_end = (None if self._landmarks_at is None
                               else self._landmarks_at + 3 * FACE_LANDMARK_COUNT)
        self.empty = np.full(len(self.channels), np.nan, dtype=np.float32)

    def sample(self, face: FaceSample) -> np.ndarray:
        """The face's values; NaN in what it lacks and in the extra channels."""
        sample = self.empty.copy()
        sample[0] = face.track_id
        sample[1] = face.presence
        sample[2:6] = _values(face.box_px, 4, "box_px")
        if face.head_pose_deg is not None:
            sample[6:9] = _values(face.head_pose_deg, 3, "head_pose_deg")
        if face.head_translation_cm is not None and self._translation_at is not None:
            at = self._translation_at
            sample[at:at + 3] = _values(face.head_translation_cm, 3, "head_translation_cm")
        if face.blendshapes is not None and self._blendshapes_at is not None:
            at = self._blendshapes_at
            sample[at:at + len(BLENDSHAPE_NAMES)] = _values(
                face.blendshapes, len(BLENDSHAPE_NAMES), "blendshapes"
            )
        if self._landmarks_at is not None and face.landmarks_px is not None:
            landmarks_px = np.asarray(face.landmarks_px, dtype=np.float32)
            if landmarks_px.shape != (FACE_LANDMARK_COUNT, 3):
                raise ValueError(
                    f"landmarks_px must have shape ({FACE_LANDMARK_COUNT}, 3), "
                    f"got {landmarks_px.shape}"
                )
            sample[self._landmarks_at:self._landmarks_end] = landmarks_px.reshape(-1)
        return sample


def _values(values: Sequence[float] | np.ndarray, count: int,
            what: str) -> Sequence[float] | np.ndarray:
    if isinstance(values, (tuple, list)):
        # What results' messages carry: numpy converts them in the sample's slice assignment,
        # without an array of their own (a face's sample 12 -> 6 us on a 2-core EPYC).
        if len(values) != count:
            raise ValueError(f"{what} must have {count} values, got {len(values)}")
        return values
    array = np.asarray(values, dtype=np.float32).reshape(-1)
    if array.shape != (count,):
        raise ValueError(f"{what} must have {count} values, got {array.shape[0]}")
    return array


PARTICIPANT_EXTRA_CHANNELS: tuple[tuple[str, str, str], ...] = (
    ("camera", "index", "CameraIndex"),  # into desc/facecast/cameras
    ("identity_confidence", "normalized", "Score"),
)


def participant_stream_name(participant: str) -> str:
    return f"facecast {participant}"


def participant_source_id(host: str, participant: str) -> str:
    return f"facecast-{host}-participant-{participant}"


class ParticipantOutlet:
    """One participant's `Face` stream: the Face channels of their face in the camera that sees
    them best, then `camera` (an index into desc/facecast/cameras) and `identity_confidence`
    (Note [Participant streams]). NaN in every channel
    while the source camera's frame does not show them."""

    def __init__(self, host: str, participant: str, camera_ids: Sequence[str], fps: float,
                 layout: FaceLayout, *, identified_by: str, gallery_revision: int,
                 max_buffered_s: int = 360) -> None:
        self.participant = participant
        self.layout = layout
        self.source_id = participant_source_id(host, participant)
        info = pylsl.StreamInfo(participant_stream_name(participant), "Face",
                                len(layout.channels), pylsl.IRREGULAR_RATE, pylsl.cf_float32,
                                self.source_id)  # Note [Rates that survive XDF loading]
        desc = info.desc()
        _face_channels_desc(desc, layout.channels)
        _acquisition(desc, "MediaPipe face models in PyTorch")
        facecast = desc.append_child("facecast")
        _append_text(facecast, "host", host)
        _append_text(facecast, "participant", participant)
        _append_text(facecast, "identified_by", identified_by)
        _append_text(facecast, "gallery_revision", gallery_revision)
        cameras = facecast.append_child("cameras")
        for camera_id in camera_ids:
            _append_text(cameras, "camera", camera_id)
        _append_text(facecast, "camera_channel", "index into cameras (0 = the first)")
        _append_text(facecast, "source_camera", "the camera with the participant's largest face; "
                     "another camera takes over when its face is 1.25x larger or the source has "
                     "not seen them for 0.5 s (a participant_camera marker says when)")
        _append_text(facecast, "absent", "NaN in every channel")
        _capture_timed(facecast, float(fps))
        self._outlet = pylsl.StreamOutlet(info, max_buffered=max_buffered_s)

    def push(self, capture_ts_lsl: float, face: FaceSample | None, camera_index: int,
             identity_confidence: float) -> np.ndarray:
        """One frame of the source camera; returns the sample pushed."""
        capture_ts_lsl = _check_capture_ts(capture_ts_lsl)
        sample = self.layout.empty.copy() if face is None else self.layout.sample(face)
        if face is not None:
            sample[-2] = camera_index
            sample[-1] = identity_confidence
        self._outlet.push_chunk(sample[np.newaxis, :], timestamp=capture_ts_lsl)
        return sample

    def close(self) -> None:
        self._outlet = None  # type: ignore[assignment]


class SynchronyOutlet:
    """The `Synchrony` stream (docs/synchrony.md) from its layout (facecast.workers.output.synchrony)."""

    def __init__(self, layout: Any, *, max_buffered_s: int = 360) -> None:
        from facecast.workers.output.synchrony import fill_desc

        self.layout = layout
        info = pylsl.StreamInfo(layout.name, layout.stream_type, layout.channel_count,
                                layout.nominal_srate, pylsl.cf_float32, layout.source_id)
        fill_desc(info.desc(), layout.desc)
        self._outlet = pylsl.StreamOutlet(info, max_buffered=max_buffered_s)

    def push(self, timestamp_lsl: float, sample: np.ndarray) -> None:
        self._outlet.push_chunk(np.asarray(sample, np.float32)[np.newaxis, :],
                                timestamp=_check_capture_ts(timestamp_lsl))

    def close(self) -> None:
        self._outlet = None  # type: ignore[assignment]


class PoseOutlet:
    """A camera's body pose as one `MoCap` stream, labelled per XDF's MoCap meta-data.

    33 markers (MediaPipe's BlazePose landmarks) x (X, Y, Z in meters: MediaPipe's world
    landmarks, origin between the hips; and visibility as a Confidence channel). One body per
    camera: the output worker publishes the most present person of each frame
    (facecast.models.pose.PosePipeline measures them).
    """

    def __init__(self, host: str, camera_id: str, fps: float, *, max_buffered_s: int = 360) -> None:
        if not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be > 0 (the camera's nominal rate), got {fps!r}")
        self.host = host
        self.camera_id = camera_id
        self.channels = pose_channels()
        self.channel_count = len(self.channels)
        self.source_id = f"facecast-{host}-{camera_id}-pose"
        info = pylsl.StreamInfo(
            f"facecast {camera_id} pose",
            "MoCap",
            self.channel_count,
            pylsl.IRREGULAR_RATE,  # Note [Rates that survive XDF loading]
            pylsl.cf_float32,
            self.source_id,
        )
        desc = info.desc()
        channels = desc.append_child("channels")
        for label, unit, kind, marker in self.channels:
            channel = channels.append_child("channel")
            _append_text(channel, "label", label)
            _append_text(channel, "marker", marker)
            _append_text(channel, "object", "body")
            _append_text(channel, "type", kind)
            _append_text(channel, "unit", unit)
        _acquisition(desc, "MediaPipe pose models in PyTorch")
        setup = desc.append_child("setup")
        markers = setup.append_child("markers")
        for name in POSE_LANDMARK_NAMES:
            marker = markers.append_child("marker")
            _append_text(marker, "label", name)
            _append_text(marker, "object", "body")
        facecast = desc.append_child("facecast")
        _append_text(facecast, "host", host)
        _append_text(facecast, "camera", camera_id)
        _append_text(facecast, "coordinates", "MediaPipe pose world landmarks: meters, hip-centred")
        _append_text(facecast, "axes", "x: image right, y: image down, z: away from the camera")
        _append_text(facecast, "person", "the most present body in the frame; NaN when none")
        _capture_timed(facecast, float(fps))
        self._empty = np.full(self.channel_count, np.nan, dtype=np.float32)
        self._outlet = pylsl.StreamOutlet(info, max_buffered=max_buffered_s)

    def push_frame(
        self,
        capture_ts_lsl: float,
        world_landmarks_m: np.ndarray | None,
        visibility: np.ndarray | None = None,
    ) -> None:
        """One sample per frame; None (no body found) publishes NaN."""
        capture_ts_lsl = _check_capture_ts(capture_ts_lsl)
        sample = self._empty.copy()
        if world_landmarks_m is not None:
            points = np.asarray(world_landmarks_m, dtype=np.float32)
            count = len(POSE_LANDMARK_NAMES)
            if points.shape != (count, 3):
                raise ValueError(
                    f"world_landmarks_m must have shape ({count}, 3), got {points.shape}"
                )
            per_marker = sample.reshape(count, 4)
            per_marker[:, :3] = points
            if visibility is not None:
                per_marker[:, 3] = _values(visibility, count, "visibility")
        self._outlet.push_chunk(sample[np.newaxis, :], timestamp=capture_ts_lsl)

    def close(self) -> None:
        self._outlet = None  # type: ignore[assignment]


class MarkerOutlet:
    """The daemon's one `Markers` stream: events as compact JSON strings.

    Each marker is `{"event": kind, ...fields}`, e.g.
    `{"event":"camera_lost","camera":"cam0","reason":"..."}`. Kinds the daemon sends: start,
    stop, camera_lost, camera_back, camera_failed, transport_fallback, worker_restart,
    model_missing, and the recordings' record_start, record_segment, record_stop, record_error
    (README "Recording").
    """

    def __init__(self, host: str, *, daemon_pid: int = 0, runtime_dir: str = "",
                 hold_s: float = 0.0, settle_s: float = 0.0) -> None:
        """`daemon_pid`, `runtime_dir`: the supervisor's, in the metadata, so that a second
        daemon that would publish the same ids can say where this one runs (Note [One daemon
        per stream id]). `hold_s`: how long after its creation markers wait for readers, and
        `settle_s` how long they wait once a first one is there (Note [Markers wait for a
        reader]); 0 sends each at once."""
        if not host:
            raise ValueError("host must be non-empty")
        for name, value in (("hold_s", hold_s), ("settle_s", settle_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self._hold_until_monotonic = time.monotonic() + hold_s
        self._settle_s = settle_s
        self.reader_since_monotonic: float | None = None  # since when it has had a reader
        self._held: list[tuple[str, float]] = []  # (text, timestamp), in order
        self.host = host
        self.source_id = f"facecast-{host}-markers"
        info = pylsl.StreamInfo(
            "facecast markers", "Markers", 1, pylsl.IRREGULAR_RATE, pylsl.cf_string, self.source_id
        )
        desc = info.desc()
        channel = desc.append_child("channels").append_child("channel")
        _append_text(channel, "label", "event")
        _append_text(channel, "type", "Marker")
        _append_text(channel, "format", "JSON object with key 'event'")
        _acquisition(desc, "facecast daemon events")
        facecast = desc.append_child("facecast")
        _append_text(facecast, "host", host)
        if daemon_pid:
            _append_text(facecast, "pid", daemon_pid)
        if runtime_dir:
            _append_text(facecast, "runtime_dir", runtime_dir)
        self._outlet = pylsl.StreamOutlet(info)

    def event(self, kind: str, /, *, event_ts_lsl: float | None = None, **fields: Any) -> str:
        """Send one marker and return its text. `event_ts_lsl` defaults to now."""
        if not kind:
            raise ValueError("event kind must be non-empty")
        if "event" in fields:
            raise ValueError("'event' is the kind; pick another field name")
        text = encode_event(kind, fields)
        timestamp = pylsl.local_clock() if event_ts_lsl is None else _check_capture_ts(event_ts_lsl)
        self._held.append((text, timestamp))
        self.send_held()
        return text

    @property
    def held(self) -> int:
        """Markers waiting for a reader (Note [Markers wait for a reader])."""
        return len(self._held)

    def send_held(self, *, now_monotonic: float | None = None, force: bool = False) -> None:
        """Send the held markers, in order, once the outlet has had a reader for `settle_s` or
        has waited `hold_s` (or `force`). Called with each event and from the owner's loop."""
        if not self._held:
            return
        now = time.monotonic() if now_monotonic is None else now_monotonic
        if not self._outlet.have_consumers():
            self.reader_since_monotonic = None
        elif self.reader_since_monotonic is None:
            self.reader_since_monotonic = now
        settled = (self.reader_since_monotonic is not None
                   and now - self.reader_since_monotonic >= self._settle_s)
        if not (force or settled or now >= self._hold_until_monotonic):
            return
        for text, timestamp in self._held:
            self._outlet.push_sample([text], timestamp=timestamp)
        self._held.clear()

    def close(self) -> None:
        if self._outlet is not None:
            self.send_held(force=True)
        self._outlet = None  # type: ignore[assignment]


def encode_event(kind: str, fields: Mapping[str, Any]) -> str:
    """Compact JSON; NaN/inf become null, numpy scalars plain numbers, anything else str()."""
    payload = {"event": kind, **{key: _jsonable(value) for key, value in fields.items()}}
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_jsonable(item) for item in value]
    return str(value)


# The frame-index stream's channels: (label, unit, meaning). Every value is an integer; the
# stream is double64 so that frame numbers stay exact (to 2**53) and never pass through float32.
FRAME_INDEX_CHANNELS: tuple[tuple[str, str, str], ...] = (
    ("frame_seq", "count", "the camera's frame number: +1 per captured frame; starts again at 0 "
     "when its capture worker restarts (a new ring epoch)"),
    ("recording_frame", "count", "the frame's index in the current recording's video, over "
     "every segment; -1: not in a video"),
    ("segment", "count", "the recording's segment file the frame is in (0, 1, ...); -1: none"),
    ("segment_frame", "count", "the frame's index inside that segment file (row of its sidecar "
     "CSV with status written); -1: none"),
    ("dropped", "count", "frames of this camera with no sample on this stream so far: captured "
     "(a frame_seq was taken) but their FrameReady never reached the output worker"),
    ("recording_dropped", "count", "frames captured during the current recording that are not "
     "in its video (Note [Recording drops]); -1: not recording"),
)


def frame_index_source_id(host: str, camera_id: str) -> str:
    return f"facecast-{host}-{camera_id}-frames"


class FrameIndexOutlet:
    """One camera's frame-index stream: one sample per captured frame, stamped with its capture
    time, whether or not video is recorded (README "Recording", DESIGN §4).

    Type `VideoExternal`: the type the LSL maintainers prefer for a stream of frame numbers of a
    video kept outside the XDF (sccn/xdf#63: `VideoCompressed` would promise the video inside
    it). The video's file names are not fixed when the stream is created (a new segment every
    record.segment_s), so the metadata says how they are named and the Markers stream names
    each one (record_start, record_segment, record_stop), as sccn/xdf#63 suggests: file names
    without directories.
    """

    def __init__(self, host: str, camera_id: str, fps: float, *, max_buffered_s: int = 360) -> None:
        if not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be > 0 (the camera's nominal rate), got {fps!r}")
        self.host = host
        self.camera_id = camera_id
        self.source_id = frame_index_source_id(host, camera_id)
        info = pylsl.StreamInfo(f"facecast {camera_id} frames", "VideoExternal",
                                len(FRAME_INDEX_CHANNELS), pylsl.IRREGULAR_RATE,
                                pylsl.cf_double64, self.source_id)
        # Note [Rates that survive XDF loading]
        desc = info.desc()
        channels = desc.append_child("channels")
        for label, unit, meaning in FRAME_INDEX_CHANNELS:
            channel = channels.append_child("channel")
            _append_text(channel, "label", label)
            _append_text(channel, "unit", unit)
            _append_text(channel, "type", "FrameIndex")
            _append_text(channel, "description", meaning)
        _acquisition(desc, "facecast frame index")
        synchronization = desc.append_child("synchronization")
        _append_text(synchronization, "can_drop_samples", "true")  # XDF's flag for video streams
        facecast = desc.append_child("facecast")
        _append_text(facecast, "host", host)
        _append_text(facecast, "camera", camera_id)
        _capture_timed(facecast, float(fps))
        video = facecast.append_child("video")
        _append_text(video, "files", "<camera>_<UTC start YYYYmmdd-HHMMSS.mmmZ>_<segment, 3 "
                     "digits>.<mkv|mp4> in record.dir or `facecast record start --dir`")
        _append_text(video, "file_names", "each segment's file name is on the Markers stream "
                     "'facecast markers': record_start (segment 0), record_segment, record_stop, "
                     "record_error, with keys camera, file, segment, dir")
        _append_text(video, "sidecar", "<same name>.csv: frame, recording_frame, frame_seq, "
                     "capture_ts_lsl, status (written or dropped: why)")
        _append_text(video, "container_timestamps", "pts = capture_ts_lsl - the file's tag "
                     "capture_ts_lsl_origin (the capture time of its first frame)")
        self._outlet = pylsl.StreamOutlet(info, max_buffered=max_buffered_s)

    def push(self, capture_ts_lsl: float, values: Sequence[float]) -> None:
        """One frame: values in FRAME_INDEX_CHANNELS order."""
        capture_ts_lsl = _check_capture_ts(capture_ts_lsl)
        if len(values) != len(FRAME_INDEX_CHANNELS):
            raise ValueError(f"a frame-index sample has {len(FRAME_INDEX_CHANNELS)} values, "
                             f"got {len(values)}")
        self._outlet.push_sample([float(v) for v in values], timestamp=capture_ts_lsl)

    def close(self) -> None:
        self._outlet = None  # type: ignore[assignment]
