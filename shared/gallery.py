"""The participants' gallery: who facecast can name, as face embeddings in one file on disk.

Read by the CLI (`facecast enroll`, `facecast participants`, `status`, `doctor`) and by the
workers that match faces to names; written only by the CLI. What it holds is biometric data,
so it holds as little as will do (Note [What the gallery keeps]).

Note [What the gallery keeps]
    Per participant: the name, one 128-D embedding per enrolment photo (dlib's face descriptor,
    facecast.models.face_embedding) and when each was added; never a photo, a crop, a file
    name or a path. An embedding cannot be turned back into the face, but it does identify the
    person to anyone with the same network, so the file is created mode 0600 in the state
    directory (`gallery_path`) and `facecast participants remove NAME` deletes a person's
    vectors for good (the file is rewritten, not appended to). Deleting the file deletes all.

Note [Gallery file]
    One JSON document, `{"format": "facecast-gallery", "format_version": 1, "revision": R,
    "embedding_model": ..., "participants": [...]}`. `format_version` is the layout: a reader
    refuses a version it does not know with a reason and ignores fields it does not know
    (STYLE §4). `revision` counts the changes (every enrol or removal adds one): the
    participant streams' metadata names it, so a recording says which gallery named its
    people. Writes are atomic: a temporary file in the same directory, fsync, rename over the
    old one, fsync of the directory; a reader sees the old or the new gallery, never half of
    one. Changes hold an exclusive `flock` on `<gallery>.lock` from read to rename, so that two
    `facecast enroll` at once do not lose one of the two.

Note [Gallery validation]
    Anyone who can write the file can put anything in it, and the supervisor reads it for every
    status request (the console asks once a second), the workers when it changes. So `load`
    checks every field (a name as `check_name` allows it and once, at least one enrolment, each
    embedding exactly EMBEDDING_SIZE finite numbers, `added_utc` ISO 8601, a revision of 0 or
    more; a regular file of at most MAX_FILE_BYTES) and turns whatever else goes wrong into a
    GalleryError naming the file. A bad gallery costs the names, never the daemon: status says
    why (`status_line`), the supervisor puts a `gallery_unusable` marker on the Markers stream
    and a line in the log, the workers keep the gallery they had (Note [Gallery reload]), and
    `facecast participants`/`enroll` print the reason (issue 21:
    an embedding of 127 values stopped the supervisor).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import math
import os
import re
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import numpy as np

from facecast.shared import private_files

FORMAT = "facecast-gallery"
FORMAT_VERSION = 1
EMBEDDING_MODEL = "dlib_face_recognition_resnet_model_v1"
EMBEDDING_SIZE = 128
FILE_NAME = "participants.json"
# Participant names go into stream names and source ids (facecast-<host>-participant-<name>).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
MAX_FILE_BYTES = 64 * 1024 * 1024  # thousands of people; the supervisor reads it for status


class GalleryError(ValueError):
    """A gallery that cannot be used, or a change that cannot be made; the text says why."""


class _Enrolment(msgspec.Struct, frozen=True):
    embedding: list[float]  # EMBEDDING_SIZE values
    added_utc: str  # ISO 8601


class _Participant(msgspec.Struct, frozen=True):
    name: str
    enrolments: list[_Enrolment]


class _File(msgspec.Struct, frozen=True):
    """Note [Gallery file]; unknown fields are ignored (a newer facecast may add some)."""

    format: str
    format_version: int
    revision: int
    embedding_model: str
    participants: list[_Participant]


def gallery_path(configured: str = "") -> Path:
    """Where the gallery lives: configured (`participants.gallery`), else the state directory:
    $STATE_DIRECTORY (systemd's StateDirectory=facecast: /var/lib/facecast), else
    $XDG_STATE_HOME/facecast, else ~/.local/state/facecast."""
    if configured:
        return Path(configured)
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0]) / FILE_NAME
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "facecast" / FILE_NAME


def check_name(name: str) -> str:
    """`name`, or a GalleryError saying what a participant name may be."""
    if not NAME_PATTERN.match(name):
        raise GalleryError(f"participant name {name!r}: 1-32 of A-Z a-z 0-9 _ - allowed (it "
                           "becomes part of stream names and source ids)")
    return name


@dataclass(frozen=True)
class Gallery:
    """One revision of the gallery, read-only: `embeddings[name]` is (K, 128) float32, one row
    per enrolment."""

    path: Path
    revision: int
    embeddings: dict[str, np.ndarray]

    @property
    def names(self) -> list[str]:
        return sorted(self.embeddings)

    def describe(self) -> str:
        """One line for `status` and `doctor`."""
        if not self.embeddings:
            return f"gallery {self.path}: no participants enrolled"
        return (f"gallery {self.path}: revision {self.revision}, {len(self.embeddings)} "
                f"participant(s): {', '.join(self.names)}")


def load(path: str | os.PathLike) -> Gallery:
    """The gallery at `path`; an empty one (revision 0) when there is no file yet. Whatever the
    file holds, a gallery that cannot be used is a GalleryError naming the file, what is wrong
    and what is allowed, never another exception (Note [Gallery validation])."""
    path = Path(path)
    data = _read(path)
    return Gallery(path, 0, {}) if data is None else _checked(path, data)[1]


def _read(path: Path) -> bytes | None:
    """The file's bytes; None when there is none."""
    try:
        # O_NONBLOCK: a FIFO put where the gallery was must not hang the supervisor's loop.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise GalleryError(f"{path}: cannot read the gallery: {exc.strerror}") from None
    try:
        info = os.fstat(descriptor)
        if not stat_mod.S_ISREG(info.st_mode):
            raise GalleryError(f"{path}: not a regular file (the gallery is one JSON file)")
        if info.st_size > MAX_FILE_BYTES:
            raise GalleryError(f"{path}: {info.st_size} bytes; a gallery is at most "
                               f"{MAX_FILE_BYTES} bytes")
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            return file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise GalleryError(f"{path}: cannot read the gallery: {exc.strerror}") from None
    finally:
        os.close(descriptor)


def _checked(path: Path, data: bytes) -> tuple[_File, Gallery]:
    """The document and its gallery, every field checked; anything else that goes wrong is a
    GalleryError too (Note [Gallery validation])."""
    try:
        document = _decode(path, data)
        return document, _parse(path, document)
    except GalleryError:
        raise
    except Exception as exc:  # noqa: BLE001 - Note [Gallery validation]: never more than this
        raise GalleryError(f"{path}: damaged gallery: {type(exc).__name__}: {exc}") from None


def _decode(path: Path, data: bytes) -> _File:
    try:
        header = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise GalleryError(f"{path}: not a facecast gallery (not JSON: {exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise GalleryError(f"{path}: not a facecast gallery (no \"format\": \"{FORMAT}\")")
    if header.get("format_version") != FORMAT_VERSION:
        raise GalleryError(f"{path}: gallery format_version {header.get('format_version')!r} is "
                           f"not one this facecast reads (allowed: {FORMAT_VERSION}); a newer "
                           "facecast wrote it")
    try:
        return msgspec.json.decode(data, type=_File)
    except msgspec.ValidationError as exc:
        raise GalleryError(f"{path}: damaged gallery: {exc}") from None


def _parse(path: Path, document: _File) -> Gallery:
    """Every field checked (Note [Gallery validation])."""
    if document.embedding_model != EMBEDDING_MODEL:
        raise GalleryError(f"{path}: embeddings of {document.embedding_model!r}, but facecast "
                           f"matches with {EMBEDDING_MODEL!r}: enrol the participants again")
    if document.revision < 0:
        raise GalleryError(f"{path}: revision {document.revision}: a revision is 0 or more")
    embeddings = {}
    for index, participant in enumerate(document.participants):
        where = f"{path}: participants[{index}]"
        if not NAME_PATTERN.match(participant.name):
            raise GalleryError(f"{where}: name {participant.name!r}: 1-32 of A-Z a-z 0-9 _ - "
                               "allowed (it becomes part of stream names and source ids)")
        if participant.name in embeddings:
            raise GalleryError(f"{where}: participant {participant.name!r} appears twice; each "
                               "name once")
        if not participant.enrolments:
            raise GalleryError(f"{where}: participant {participant.name!r} has no enrolment "
                               "(at least one embedding each)")
        for number, enrolment in enumerate(participant.enrolments):
            what = f"{where} ({participant.name!r}): enrolments[{number}]"
            if len(enrolment.embedding) != EMBEDDING_SIZE:
                raise GalleryError(f"{what}: embedding of {len(enrolment.embedding)} values; "
                                   f"allowed: exactly {EMBEDDING_SIZE} finite numbers")
            if not all(math.isfinite(value) for value in enrolment.embedding):
                raise GalleryError(f"{what}: embedding holds a value that is not finite; "
                                   f"allowed: exactly {EMBEDDING_SIZE} finite numbers")
            try:
                datetime.datetime.fromisoformat(enrolment.added_utc)
            except ValueError:
                raise GalleryError(f"{what}: added_utc {enrolment.added_utc!r} is not an ISO "
                                   "8601 date and time") from None
        embeddings[participant.name] = np.array(
            [e.embedding for e in participant.enrolments], np.float32)
    return Gallery(path, document.revision, embeddings)


def enrol(path: str | os.PathLike, name: str, vectors: np.ndarray, *,
          replace: bool = False) -> Gallery:
    """Add `vectors` ((K, 128): one per photo) to participant `name` (created if new; with
    `replace`, instead of what they had). Returns the new revision."""
    check_name(name)
    vectors = np.asarray(vectors, np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != EMBEDDING_SIZE or not len(vectors):
        raise GalleryError(f"enrol {name!r}: expected (K, {EMBEDDING_SIZE}) embeddings, got "
                           f"shape {vectors.shape}")
    if not np.all(np.isfinite(vectors)):
        raise GalleryError(f"enrol {name!r}: an embedding is not finite")
    added_utc = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    new = [_Enrolment([float(v) for v in row], added_utc) for row in vectors]
    with _changing(Path(path)) as (document, write):
        people = {p.name: p for p in document.participants}
        kept = [] if replace or name not in people else list(people[name].enrolments)
        people[name] = _Participant(name, kept + new)
        return write(list(people.values()))


def remove(path: str | os.PathLike, name: str) -> Gallery:
    """Delete participant `name` and all their embeddings; GalleryError if not enrolled."""
    with _changing(Path(path)) as (document, write):
        kept = [p for p in document.participants if p.name != name]
        if len(kept) == len(document.participants):
            known = ", ".join(sorted(p.name for p in document.participants)) or "none"
            raise GalleryError(f"no participant {name!r} in {path} (enrolled: {known})")
        return write(kept)


@contextlib.contextmanager
def _changing(path: Path) -> Iterator[tuple[_File, Callable[[list[_Participant]], Gallery]]]:
    """Read-modify-write under the gallery's lock (Note [Gallery file])."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_path = path.with_name(path.name + ".lock")
    with open(os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600), "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read(path)
        if data is None:
            document = _File(FORMAT, FORMAT_VERSION, 0, EMBEDDING_MODEL, [])
        else:  # refuse to build on a gallery we could not read
            document = _checked(path, data)[0]

        def write(participants: list[_Participant]) -> Gallery:
            updated = _File(FORMAT, FORMAT_VERSION, document.revision + 1, EMBEDDING_MODEL,
                            sorted(participants, key=lambda p: p.name))
            private_files.write_atomically(path, msgspec.json.format(msgspec.json.encode(updated)))
            return _parse(path, updated)

        yield document, write


UNUSABLE = "gallery unusable: "  # how status_line begins for a gallery that cannot be used
_status_lines: dict[Path, tuple[tuple, str]] = {}  # path → (what stat said, the line)


def status_line(configured: str = "") -> str:
    """The gallery's line in `facecast status` (the daemon's view: its environment decides the
    state directory); a gallery it cannot read says why instead. The supervisor asks on every
    status request: the file is read again only when stat says it changed."""
    path = gallery_path(configured)
    try:
        stat = os.stat(path)
        seen: tuple = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    except OSError as exc:
        seen = (type(exc).__name__,)
    cached = _status_lines.get(path)
    if cached is not None and cached[0] == seen:
        return cached[1]
    try:
        line = load(path).describe()
    except GalleryError as exc:
        line = f"{UNUSABLE}{exc}"
    except Exception as exc:  # noqa: BLE001 - Note [Gallery validation]: status never fails for it
        line = f"{UNUSABLE}{path}: {type(exc).__name__}: {exc}"
    _status_lines[path] = (seen, line)
    return line
