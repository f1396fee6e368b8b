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
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import numpy as np

FORMAT = "facecast-gallery"
FORMAT_VERSION = 1
EMBEDDING_MODEL = "dlib_face_recognition_resnet_model_v1"
EMBEDDING_SIZE = 128
FILE_NAME = "participants.json"
# Participant names go into stream names and source ids (facecast-<host>-participant-<name>).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


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
    """The gallery at `path`; an empty one (revision 0) when there is no file yet."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Gallery(path, 0, {})
    except OSError as exc:
        raise GalleryError(f"{path}: cannot read the gallery: {exc.strerror}") from None
    return _parse(path, _decode(path, data))


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
    if document.embedding_model != EMBEDDING_MODEL:
        raise GalleryError(f"{path}: embeddings of {document.embedding_model!r}, but facecast "
                           f"matches with {EMBEDDING_MODEL!r}: enrol the participants again")
    embeddings = {}
    for participant in document.participants:
        vectors = np.array([e.embedding for e in participant.enrolments], np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != EMBEDDING_SIZE or not len(vectors):
            raise GalleryError(f"{path}: participant {participant.name!r} has no usable "
                               f"embedding (expected {EMBEDDING_SIZE} values each)")
        embeddings[participant.name] = vectors
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
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            document = _File(FORMAT, FORMAT_VERSION, 0, EMBEDDING_MODEL, [])
        else:
            document = _decode(path, data)
            _parse(path, document)  # refuse to build on a gallery we could not read

        def write(participants: list[_Participant]) -> Gallery:
            updated = _File(FORMAT, FORMAT_VERSION, document.revision + 1, EMBEDDING_MODEL,
                            sorted(participants, key=lambda p: p.name))
            _write_atomically(path, msgspec.json.format(msgspec.json.encode(updated)))
            return _parse(path, updated)

        yield document, write


def _write_atomically(path: Path, data: bytes) -> None:
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:  # mkstemp's files are mode 0600
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)



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
        line = f"gallery unusable: {exc}"
    _status_lines[path] = (seen, line)
    return line
