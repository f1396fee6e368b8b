"""Who each tracked face is: a participant's name and how sure, for the roi_landmark worker.

Runs in the roi_landmark worker, after its faces have track ids and before their results go
out (DESIGN §3, "Identity"). Two ways, chosen by `participants.identify`:

- `EmbeddingIdentities`: face embeddings (facecast.models.face_embedding, from the mesh the
  worker already has) matched to the gallery (facecast.shared.gallery), on a schedule per
  track (Note [Identity per track]);
- `SeatIdentities`: the seat map, where a face's place names it and no embedding is computed
  (Note [Seat map]).

Both answer `identify(batch)` with, per frame, one `Identity` per face; `UNKNOWN` is
the participant "" with confidence 0.

Note [Identity per track]
    Embedding every face of every frame would cost a ResNet pass per face per frame for an
    answer that changes only when the person does. A track (a face followed by its landmarks
    and named by its track id) is embedded on its first frame, then every
    `participants.embed_interval_s` of capture time; all faces due in one step are embedded
    in one batch (at most MAX_EMBEDDINGS_PER_STEP, the longest-waiting first). The identity
    belongs to the track: a short occlusion keeps the track id (TRACK_HOLD_S in
    facecast.workers.inference.roi_landmark) and with it the name; a longer one gives a new track, which
    is embedded on its first frame and so named again at once. An unknown track takes a name
    as soon as an embedding matches. A later embedding that disagrees with a named track (a
    profile view, a blurred frame, or a track that jumped to another face) does not rename it
    at once: the track is embedded again after CONFIRM_AFTER_S, and the name changes when
    CONFIRMATIONS embeddings in a row agree on the new answer, a name or unknown. A track that
    changes person without a break (only a synthetic scene does that) is therefore named
    wrongly until its next embedding, at most embed_interval_s + CONFIRM_AFTER_S. One name is worn by one face at a time: when two tracks
    seen within RECENT_S claim one participant, the closer embedding keeps the name and the
    other face is unknown (and embedded again soon). The match: the participant whose nearest
    enrolment is nearest, if closer than `participants.match_distance` (dlib's Euclidean
    measure); confidence = 1 - distance / match_distance (0 at the threshold, 1 for the
    enrolment itself).

Note [Gallery reload]
    The worker re-reads the gallery when its file changes: `GalleryWatch` looks at the file's
    size, modification time and inode every GALLERY_CHECK_S, so `facecast enroll` and
    `facecast participants remove` take effect within seconds, without a reload; a changed
    `[participants]` table takes effect on `facecast reload` (the worker is reassigned with the
    new config). Tracks named by a removed participant are unknown from that moment; other
    tracks are embedded again on their next turn. A gallery that cannot be read keeps the
    previous one in use (logged once per change); none at all names nobody.

Note [Seat map]
    For labs that want no biometrics: `identify = "seats"` and one `[[participants.seats]]`
    per participant, a camera and optionally a region (fractions of the frame). A face whose
    box centre lies in a seat's region is that seat's participant, confidence 1; when several
    faces are in one seat, the largest gets the name. No embedding network is loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:  # torch is imported where embeddings are made: the output worker, which
    import torch  # reads the gallery here (GalleryWatch), never loads it (issue 20)

from facecast.shared import gallery as gallery_mod
from facecast.shared.config import ParticipantsConfig

log = logging.getLogger(__name__)

MAX_EMBEDDINGS_PER_STEP = 8
CONFIRM_AFTER_S = 0.25
CONFIRMATIONS = 2
RECENT_S = 0.5
FORGET_AFTER_S = 10.0  # a track unseen this long (capture time) is gone for good
GALLERY_CHECK_S = 2.0


class Identity(NamedTuple):
    participant: str  # "" unknown
    confidence: float  # 0..1


UNKNOWN = Identity("", 0.0)


@dataclass
class FrameFaces:
    """One frame of the step: what identifying its faces needs."""

    camera_id: str
    capture_ts_lsl: float
    tensor: torch.Tensor  # (H, W, 3) uint8 BGR, the subscriber's checked copy of the frame
    track_ids: list[int]
    boxes_px: list[tuple[float, float, float, float]]
    landmarks_px: list[np.ndarray]  # (478, 3) per face


class Identities:
    """What the roi_landmark worker calls; `describe()` says what it does, for the log."""

    def identify(self, frames: Sequence[FrameFaces]) -> list[list[Identity]]:
        raise NotImplementedError

    def trouble(self) -> str:
        return ""

    def describe(self) -> str:
        raise NotImplementedError


class NoIdentities(Identities):
    """participants.enabled = false, or nothing to match with: every face unknown."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def identify(self, frames: Sequence[FrameFaces]) -> list[list[Identity]]:
        return [[UNKNOWN] * len(frame.track_ids) for frame in frames]

    def trouble(self) -> str:
        return self.reason

    def describe(self) -> str:
        return f"participants not named ({self.reason or 'participants.enabled = false'})"


# --- the seat map --------------------------------------------------------------------------------


class SeatIdentities(Identities):
    """Note [Seat map]."""

    def __init__(self, config: ParticipantsConfig) -> None:
        self.seats = list(config.seats)

    def identify(self, frames: Sequence[FrameFaces]) -> list[list[Identity]]:
        return [self._frame(frame) for frame in frames]

    def _frame(self, frame: FrameFaces) -> list[Identity]:
        height_px, width_px = int(frame.tensor.shape[0]), int(frame.tensor.shape[1])
        found = [UNKNOWN] * len(frame.boxes_px)
        for seat in self.seats:
            if seat.camera != frame.camera_id:
                continue
            rx1, ry1, rx2, ry2 = seat.region
            inside = []
            for index, (x1, y1, x2, y2) in enumerate(frame.boxes_px):
                cx, cy = (x1 + x2) / 2 / width_px, (y1 + y2) / 2 / height_px
                if rx1 <= cx < rx2 and ry1 <= cy < ry2 and not found[index].participant:
                    inside.append((x2 - x1, index))
            if inside:
                found[max(inside)[1]] = Identity(seat.participant, 1.0)
        return found

    def describe(self) -> str:
        return (f"participants named by the seat map ({len(self.seats)} seat(s)); no face "
                "embeddings")


# --- embeddings and the gallery ------------------------------------------------------------------


class GalleryWatch:
    """The gallery, re-read when its file changes (Note [Gallery reload])."""

    def __init__(self, path: os.PathLike | str) -> None:
        self.path = gallery_mod.gallery_path(str(path)) if path else gallery_mod.gallery_path()
        self.gallery: gallery_mod.Gallery | None = None
        self.problem = ""
        self._seen: tuple | None = None
        self._checked_monotonic = float("-inf")

    def poll(self, now_monotonic: float) -> bool:
        """Re-read the file if it changed since the last look; True when the gallery changed."""
        if now_monotonic - self._checked_monotonic < GALLERY_CHECK_S:
            return False
        self._checked_monotonic = now_monotonic
        try:
            stat = os.stat(self.path)
            seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except FileNotFoundError:
            seen = None
        except OSError as exc:
            seen = ("error", str(exc))
        if seen == self._seen and self.gallery is not None:
            return False
        self._seen = seen
        try:
            loaded = gallery_mod.load(self.path)
        except gallery_mod.GalleryError as exc:
            if self.problem != str(exc):
                log.error("participants: %s; %s", exc, "keeping the previous gallery"
                          if self.gallery is not None else "naming nobody")
            self.problem = str(exc)
            return False
        self.problem = ""
        changed = self.gallery is None or loaded.revision != self.gallery.revision or \
            loaded.embeddings.keys() != self.gallery.embeddings.keys()
        self.gallery = loaded
        if changed:
            log.info("participants: %s", loaded.describe())
        return changed


class Matcher:
    """Embeddings → the nearest participant within `match_distance` (Note [Identity per
    track])."""

    def __init__(self, gallery: gallery_mod.Gallery, match_distance: float) -> None:
        self.match_distance = match_distance
        self.names = gallery.names
        rows = [gallery.embeddings[name] for name in self.names]
        self.owners = np.concatenate([[index] * len(r) for index, r in enumerate(rows)]) \
            if rows else np.zeros(0, int)
        self.vectors = np.concatenate(rows) if rows else np.zeros((0, gallery_mod.EMBEDDING_SIZE),
                                                                  np.float32)

    def match(self, embeddings: np.ndarray) -> list[tuple[str, float]]:
        """Per embedding (N, 128): (name or "", distance to that name's nearest enrolment)."""
        if not len(self.names):
            return [("", float("inf"))] * len(embeddings)
        distances = np.linalg.norm(embeddings[:, None, :] - self.vectors[None], axis=-1)
        per_name = np.full((len(embeddings), len(self.names)), np.inf)
        np.minimum.at(per_name, (slice(None), self.owners), distances)
        best = per_name.argmin(axis=1)
        results = []
        for row, index in enumerate(best):
            distance = float(per_name[row, index])
            results.append((self.names[index] if distance < self.match_distance else "", distance))
        return results

    def confidence(self, name: str, distance: float) -> float:
        return float(np.clip(1.0 - distance / self.match_distance, 0.0, 1.0)) if name else 0.0


@dataclass
class _Track:
    name: str = ""
    distance: float = float("inf")
    next_embed_ts: float = float("-inf")  # capture time of the next embedding; -inf: now
    last_seen_ts: float = float("-inf")
    candidate: str | None = None  # a disagreeing answer waiting for confirmation
    candidate_count: int = 0
    embedded: bool = False


class EmbeddingIdentities(Identities):
    """Note [Identity per track]; the gallery: Note [Gallery reload]."""

    def __init__(self, config: ParticipantsConfig, embedder, watch: GalleryWatch | None = None
                 ) -> None:
        import time

        self._now_monotonic = time.monotonic
        self.config = config
        self.embedder = embedder  # facecast.models.face_embedding.FaceEmbedder
        self.watch = watch or GalleryWatch(config.gallery)
        self.tracks: dict[int, _Track] = {}
        self.embeddings_computed = 0
        self.matcher = Matcher(gallery_mod.Gallery(self.watch.path, 0, {}), config.match_distance)
        self._refresh_gallery()

    def _refresh_gallery(self) -> None:
        if not self.watch.poll(self._now_monotonic()) or self.watch.gallery is None:
            return
        self.matcher = Matcher(self.watch.gallery, self.config.match_distance)
        for track in self.tracks.values():
            if track.name and track.name not in self.matcher.names:
                track.name, track.distance = "", float("inf")  # removed: unknown from now on
            # Everyone again, against the new gallery, taken as a first look.
            track.next_embed_ts, track.embedded = float("-inf"), False

    def describe(self) -> str:
        gallery = self.watch.gallery.describe() if self.watch.gallery else self.watch.problem
        return (f"participants named by face embeddings every {self.config.embed_interval_s:g} s "
                f"per track; {gallery}")

    def trouble(self) -> str:
        return f"participants: {self.watch.problem}" if self.watch.problem else ""

    @property
    def gallery_revision(self) -> int:
        return self.watch.gallery.revision if self.watch.gallery else 0

    def identify(self, frames: Sequence[FrameFaces]) -> list[list[Identity]]:
        self._refresh_gallery()
        for frame in frames:
            for track_id in frame.track_ids:
                track = self.tracks.setdefault(track_id, _Track())
                track.last_seen_ts = frame.capture_ts_lsl
        if self.matcher.names:
            self._embed_due(frames)
        self._one_face_per_name(frames)
        self._forget_gone(frames)
        return [[self._identity(track_id) for track_id in frame.track_ids] for frame in frames]

    def _identity(self, track_id: int) -> Identity:
        track = self.tracks[track_id]
        if not track.name:
            return UNKNOWN
        return Identity(track.name, self.matcher.confidence(track.name, track.distance))

    def _embed_due(self, frames: Sequence[FrameFaces]) -> None:
        due = [(self.tracks[track_id].next_embed_ts, frame_index, face_index)
               for frame_index, frame in enumerate(frames)
               for face_index, track_id in enumerate(frame.track_ids)
               if self.tracks[track_id].next_embed_ts <= frame.capture_ts_lsl]
        due = sorted(due)[:MAX_EMBEDDINGS_PER_STEP]
        if not due:
            return
        import torch

        from facecast.models.roi import FrameBatch

        used = sorted({frame_index for _, frame_index, _ in due})
        position = {frame_index: k for k, frame_index in enumerate(used)}
        batch = FrameBatch([frames[k].tensor for k in used], self.embedder.device)
        frame_index = torch.tensor([position[f] for _, f, _ in due], dtype=torch.long)
        landmarks = torch.as_tensor(np.stack([frames[f].landmarks_px[i] for _, f, i in due]))
        vectors = self.embedder.embed_landmarks(batch, frame_index.to(batch.device),
                                                landmarks.to(batch.device)).float().cpu().numpy()
        self.embeddings_computed += len(due)
        for (_, f, i), (name, distance) in zip(due, self.matcher.match(vectors)):
            self._learn(frames[f].track_ids[i], frames[f].capture_ts_lsl, name, distance)

    def _learn(self, track_id: int, capture_ts_lsl: float, name: str, distance: float) -> None:
        track = self.tracks[track_id]
        interval_s = self.config.embed_interval_s
        if not track.embedded or name == track.name or not track.name:
            track.embedded = True
            track.name, track.distance = name, distance
            track.candidate, track.candidate_count = None, 0
            track.next_embed_ts = capture_ts_lsl + interval_s
            return
        if track.candidate == name:
            track.candidate_count += 1
        else:
            track.candidate, track.candidate_count = name, 1
        if track.candidate_count >= CONFIRMATIONS:
            log.info("participants: track %d is now %s (was %s)", track_id, name or "unknown",
                     track.name or "unknown")
            track.name, track.distance = name, distance
            track.candidate, track.candidate_count = None, 0
            track.next_embed_ts = capture_ts_lsl + interval_s
        else:
            track.next_embed_ts = capture_ts_lsl + CONFIRM_AFTER_S

    def _one_face_per_name(self, frames: Sequence[FrameFaces]) -> None:
        now_ts = max(frame.capture_ts_lsl for frame in frames) if frames else 0.0
        wearers: dict[str, list[int]] = {}
        for track_id, track in self.tracks.items():
            if track.name and now_ts - track.last_seen_ts <= RECENT_S:
                wearers.setdefault(track.name, []).append(track_id)
        for name, track_ids in wearers.items():
            if len(track_ids) < 2:
                continue
            keeper = min(track_ids, key=lambda t: self.tracks[t].distance)
            for track_id in track_ids:
                if track_id != keeper:
                    track = self.tracks[track_id]
                    track.name, track.distance = "", float("inf")
                    track.next_embed_ts = track.last_seen_ts + CONFIRM_AFTER_S

    def _forget_gone(self, frames: Sequence[FrameFaces]) -> None:
        if not frames:
            return
        now_ts = max(frame.capture_ts_lsl for frame in frames)
        for track_id in [t for t, track in self.tracks.items()
                         if now_ts - track.last_seen_ts > FORGET_AFTER_S]:
            del self.tracks[track_id]


def identities_for(config: ParticipantsConfig, device: torch.device,
                   model_dir: str | None) -> Identities:
    """The worker's identities for its config; a missing embedding network names nobody (the
    reason is the worker's `trouble`), it does not keep the worker from measuring faces."""
    if not config.enabled:
        return NoIdentities("")
    if config.identify == "seats":
        return SeatIdentities(config)
    from facecast.models import assets
    from facecast.models.face_embedding import FaceEmbedder

    try:
        embedder = FaceEmbedder.from_model_dir(model_dir, device)
    except assets.ModelError as exc:
        return NoIdentities(f"participants cannot be named: {exc}")
    return EmbeddingIdentities(config, embedder)
