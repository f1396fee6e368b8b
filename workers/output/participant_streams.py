"""Streams per participant, and the synchrony between them, in the output worker.

Runs in the output worker (the owner of every LSL outlet), fed with each FaceResults after its
slot streams got their samples. The roi_landmark workers have named the faces already
(facecast.workers.inference.identity); here each name gets its own stream, fed from one camera at a time,
and, with `synchrony.enabled`, the Synchrony stream (facecast.workers.output.synchrony) gets every
participant's samples.

Note [Participant streams]
    One `Face` stream per participant, `facecast <name>`, source_id
    `facecast-<host>-participant-<name>`: the slot streams' channels, then `camera` (an index
    into desc/facecast/cameras) and `identity_confidence`. Whom: every participant of the
    gallery (identify = "embeddings") or of the seat map, opened at start so that a recorder
    finds them before they are seen; the gallery's changes open and close streams as
    people are enrolled and removed (Note [Gallery reload]). The
    metadata names the participant and the gallery revision the stream was opened with.
    Which camera: each participant has a source camera, the first that names them; every
    frame of the source camera gives one sample, their face in it or NaN while it does not
    show them. Another camera becomes the source when its face of them is SWITCH_LARGER
    times the source's (box width, the face seen best; a margin, so that two similar views
    do not flip the source every frame) or when the source has not shown them for
    SWITCH_AFTER_S; a `participant_camera` marker (participant, camera, previous) says when.
    A sample older than the stream's newest is dropped (results of two cameras arrive out of
    capture order around a switch), so a stream's timestamps only increase. Before a
    participant is first seen their stream has no samples. The slot streams are untouched:
    every face, named or not, stays in its camera's slot streams too.

Note [Synchrony in the output worker]
    The Synchrony stream's participants are the participant streams' (at least two; its
    channels are fixed when it is made, so a changed participant list makes a new outlet
    with the same source_id). Each participant sample pushed above also goes to the engine
    (its signal channels; NaN rows while absent). `step()` runs an update every 1 / update_hz
    seconds, up to the capture time that every camera with recent results has reached (the
    oldest of their newest published frames), so a camera whose results lag does not read as
    an absence; a sample is pushed only when that time moved on.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from facecast.shared.config import Config
from facecast.shared.transport.messages import FaceResults
from facecast.workers.inference.identity import GalleryWatch
from facecast.workers.output.outlets import (
    PARTICIPANT_EXTRA_CHANNELS,
    FaceLayout,
    FaceSample,
    MarkerOutlet,
    ParticipantOutlet,
    SynchronyOutlet,
)

log = logging.getLogger(__name__)

SWITCH_LARGER = 1.25
SWITCH_AFTER_S = 0.5
RECENT_CAMERA_S = 1.0  # a camera without results this long does not hold synchrony back


@dataclass
class _Person:
    outlet: ParticipantOutlet
    source_camera: str | None = None
    seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # camera → (ts, width px)
    newest_ts: float = -math.inf


class ParticipantStreams:
    """Note [Participant streams], Note [Synchrony in the output worker]."""

    def __init__(self, config: Config, host: str, markers: MarkerOutlet,
                 blendshapes_missing_reason: str) -> None:
        self.config = config
        self.host = host
        self.markers = markers
        self.blendshapes_missing_reason = blendshapes_missing_reason
        self.camera_ids = [camera.id for camera in config.cameras]
        rates = {camera.fps for camera in config.cameras}
        self.fps = rates.pop() if len(rates) == 1 else 0.0  # 0: irregular (cameras differ)
        self.layout = FaceLayout(config.output.landmarks, not blendshapes_missing_reason,
                                 not blendshapes_missing_reason, PARTICIPANT_EXTRA_CHANNELS)
        participants = config.participants
        self.watch = (GalleryWatch(participants.gallery)
                      if participants.identify == "embeddings" else None)
        self.people: dict[str, _Person] = {}
        self.synchrony = None  # (engine, outlet, columns) with two participants or more
        self._synchrony_ts = -math.inf
        self._next_update_monotonic = 0.0
        self._newest_by_camera: dict[str, tuple[float, float]] = {}  # → (ts, monotonic)
        self._refresh(time.monotonic())

    # -- who ------------------------------------------------------------------------------------

    def _names(self) -> list[str]:
        if self.watch is None:
            return list(dict.fromkeys(seat.participant for seat in self.config.participants.seats))
        return self.watch.gallery.names if self.watch.gallery is not None else []

    def _refresh(self, now_monotonic: float) -> None:
        if self.watch is not None:
            self.watch.poll(now_monotonic)
        names = self._names()
        if set(names) == set(self.people):
            return
        revision = self.watch.gallery.revision if self.watch and self.watch.gallery else 0
        identified_by = "face embeddings" if self.watch is not None else "seat map"
        for name in [n for n in self.people if n not in names]:
            self.people.pop(name).outlet.close()
            log.info("participant stream of %s closed (no longer a participant)", name)
        for name in names:
            if name not in self.people:
                self.people[name] = _Person(ParticipantOutlet(
                    self.host, name, self.camera_ids, self.fps, self.layout,
                    identified_by=identified_by, gallery_revision=revision))
        log.info("LSL: participant streams for %s", ", ".join(names) or "nobody")
        self._make_synchrony(names)

    def _make_synchrony(self, names: list[str]) -> None:
        from facecast.workers.output import synchrony

        if self.synchrony is not None:
            self.synchrony[1].close()
            self.synchrony = None
        settings = self.config.synchrony
        if not settings.enabled:
            return
        if len(names) < 2:
            log.warning("no Synchrony stream: it needs two participants or more (%s)",
                        ", ".join(names) or "none")
            return
        layout = synchrony.synchrony_layout(
            self.host, names, settings, blendshapes_missing_reason=self.blendshapes_missing_reason)
        engine = synchrony.SynchronyEngine(settings, names, signals=layout.signals)
        columns = synchrony.signal_columns(layout.signals, self.layout.labels)
        self.synchrony = (engine, SynchronyOutlet(layout), columns)
        self._synchrony_ts = -math.inf
        log.info("LSL: Synchrony stream for %d pair(s) of %s", len(engine.pairs), ", ".join(names))

    # -- each frame -------------------------------------------------------------------------------

    def on_result(self, result: FaceResults, samples: list[FaceSample]) -> None:
        """One camera's frame, with the FaceSamples its slot streams got (in result.faces order)."""
        camera_id, ts = result.camera_id, result.capture_ts_lsl
        self._newest_by_camera[camera_id] = (ts, time.monotonic())
        # name → (sample, box width px, identity confidence): the widest face of the name
        here: dict[str, tuple[FaceSample, float, float]] = {}
        for face, sample in zip(result.faces, samples):
            if not face.participant or face.participant not in self.people:
                continue
            width_px = face.box_px[2] - face.box_px[0]
            if face.participant not in here or width_px > here[face.participant][1]:
                here[face.participant] = (sample, width_px, face.identity_confidence)
        for name, (_, width_px, _) in here.items():
            person = self.people[name]
            person.seen[camera_id] = (ts, width_px)
            self._maybe_switch(name, person, camera_id, ts, width_px)
        camera_index = self.camera_ids.index(camera_id) if camera_id in self.camera_ids else -1
        for name, person in self.people.items():
            if person.source_camera != camera_id or ts <= person.newest_ts:
                continue
            sample, _, confidence = here.get(name, (None, 0.0, 0.0))
            values = person.outlet.push(ts, sample, camera_index, confidence)
            person.newest_ts = ts
            if self.synchrony is not None:
                engine, _, columns = self.synchrony
                engine.push(name, [ts], values[columns][None, :])

    def _maybe_switch(self, name: str, person: _Person, camera_id: str, ts: float,
                      width_px: float) -> None:
        source = person.source_camera
        if source == camera_id:
            return
        if source is not None:
            source_ts, source_width = person.seen.get(source, (-math.inf, 0.0))
            if ts - source_ts <= SWITCH_AFTER_S and width_px < SWITCH_LARGER * source_width:
                return
        person.source_camera = camera_id
        self.markers.event("participant_camera", participant=name, camera=camera_id,
                           previous=source or "")

    # -- the loop ------------------------------------------------------------------------------

    def step(self, now_monotonic: float) -> None:
        self._refresh(now_monotonic)
        if self.synchrony is None or now_monotonic < self._next_update_monotonic:
            return
        self._next_update_monotonic = now_monotonic + 1.0 / self.config.synchrony.update_hz
        recent = [ts for ts, seen_monotonic in self._newest_by_camera.values()
                  if now_monotonic - seen_monotonic <= RECENT_CAMERA_S]
        if not recent:
            return
        now_lsl = min(recent)
        engine, outlet, _ = self.synchrony
        update = engine.update(now_lsl)
        if update.timestamp_lsl > self._synchrony_ts:
            outlet.push(update.timestamp_lsl, update.sample)
            self._synchrony_ts = update.timestamp_lsl

    def close(self) -> None:
        for person in self.people.values():
            person.outlet.close()
        self.people.clear()
        if self.synchrony is not None:
            self.synchrony[1].close()
            self.synchrony = None
