"""POSIX shared-memory segments with explicit ownership, and the sweep that reclaims dead owners'.

On Linux `shm_open(name)` is `open("/dev/shm/<name>")`; facecast opens the file directly rather
than through `multiprocessing.shared_memory`, whose resource tracker (before Python 3.13) unlinks a
segment when any *attaching* process exits, which would pull a ring out from under its producer.

Ownership is in the name: ``facecast-<pid>-<epoch>-<camera>-<part>``. The creating process
unlinks its segments when it closes them; when it dies without closing (SIGKILL), the supervisor
calls `sweep_process(pid)` as soon as it has reaped it, which unlinks that pid's segments (and
`sweep_dead_owners()` at start and stop catches any other ownerless one). Consumers that still
have a segment mapped keep their mapping until they close it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "facecast-"
_OWNED_NAME = re.compile(r"^facecast-(?P<pid>\d+)-(?P<epoch>[0-9a-f]+)-(?P<camera>[A-Za-z0-9_-]+)-(?P<part>[a-z]+)$")


def segment_name(camera_id: str, ring_epoch: int, part: str) -> str:
    return f"{PREFIX}{os.getpid()}-{ring_epoch:x}-{camera_id}-{part}"


class SharedSegment:
    """One mapped segment. `create` owns it (and unlinks on close); `attach` only maps it."""

    def __init__(self, name: str, size_bytes: int, owner: bool, fd: int) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.owner = owner
        try:
            self._mmap = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self.buffer = memoryview(self._mmap)

    @classmethod
    def create(cls, name: str, size_bytes: int) -> SharedSegment:
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(name, size_bytes, owner=True, fd=fd)

    @classmethod
    def attach(cls, name: str, expected_bytes: int) -> SharedSegment:
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        actual_bytes = os.fstat(fd).st_size
        if actual_bytes < expected_bytes:
            os.close(fd)
            raise ValueError(
                f"shared memory {name!r} holds {actual_bytes} bytes, {expected_bytes} expected"
            )
        return cls(name, expected_bytes, owner=False, fd=fd)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Safe to call twice."""
        if self._mmap is None:
            return
        self.buffer.release()
        try:
            self._mmap.close()
        except BufferError:
            # A numpy/torch view still exports the buffer; the mapping goes when the view does.
            log.debug("segment %s still has live views; leaving the unmap to the GC", self.name)
        self._mmap = None
        if self.owner:
            unlink(self.name)


def unlink(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    # A zombie child still answers kill(0); it owns nothing any more.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().split(b")")[-1].split()[0] != b"Z"
    except OSError:
        return False


def sweep_dead_owners(camera_id: str | None = None, owner_pid: int | None = None) -> list[str]:
    """Unlink facecast segments whose creating process is gone (only `owner_pid`'s, when
    given); returns the names removed."""
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        match = _OWNED_NAME.match(path.name)
        if not match or (camera_id is not None and match["camera"] != camera_id):
            continue
        pid = int(match["pid"])
        if (owner_pid is None or pid == owner_pid) and not _pid_alive(pid):
            unlink(path.name)
            removed.append(path.name)
    if removed:
        log.info("removed %d shared-memory segment(s) of processes that are gone", len(removed))
    return removed


# The CUDA driver backs interprocess events with /dev/shm/cuda.shm.<n>.<pid, hex>.<n> files. It
# leaves them behind when the process ends, whether it was SIGKILLed or exited normally (seen on
# the H200 with driver 580: every CUDA process of the daemon left one). The supervisor removes a
# worker's as soon as it has reaped it, and the rest at start and stop.
_CUDA_IPC_NAME = re.compile(r"cuda\.shm\.\d+\.(?P<pid>[0-9a-f]+)\.\d+")


def sweep_dead_cuda_ipc_files(owner_pid: int | None = None) -> list[str]:
    """Unlink this user's CUDA IPC files whose process is gone (only `owner_pid`'s, when given);
    returns the names removed."""
    removed = []
    uid = os.getuid()
    for path in SHM_DIR.glob("cuda.shm.*"):
        match = _CUDA_IPC_NAME.fullmatch(path.name)
        try:
            if not match or path.stat().st_uid != uid:
                continue
            pid = int(match["pid"], 16)
            if (owner_pid is not None and pid != owner_pid) or _pid_alive(pid):
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return removed


def sweep_all_dead() -> tuple[list[str], list[str]]:
    """(segments, CUDA IPC files) of every process that is gone: at a supervisor's start and
    stop."""
    return sweep_dead_owners(), sweep_dead_cuda_ipc_files()


def sweep_process(pid: int) -> list[str]:
    """Everything a reaped process left in /dev/shm: its segments and its CUDA IPC files."""
    return sweep_dead_owners(owner_pid=pid) + sweep_dead_cuda_ipc_files(owner_pid=pid)


def list_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(PREFIX + "*"))
