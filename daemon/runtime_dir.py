"""The runtime directory: where a running daemon keeps its lock and its `ipc://` sockets
(facecast.shared.transport.endpoints). One resolver for the daemon and the CLI, the supervisor's lock, and
what a killed supervisor left behind.

The supervisor holds an exclusive `flock` on `supervisor.lock` (holding the pid) for its whole
life. The kernel drops the lock when the process ends, however it ends, so "the lock is free"
is the truth about whether a daemon runs there, whatever files remain: the CLI uses that to say
"not running (stale socket of pid N)" at once instead of waiting for an answer that cannot come,
and the next `facecast run` removes what the dead one left and says what it removed.

The directory holds the control socket and the console's token, so it is trusted only if it is
this user's alone (Note [Private files]): made 0700 when it is
missing; an existing one owned by another user, with access for others, or a symbolic link is
refused (UnsafeRuntimeDir), by the daemon before it starts and by the CLI before it talks to
what is there. The one exception is systemd's RuntimeDirectory, which facecast's unit makes
0750 for group facecast (docs/systemd.md) in /run, where no user can plant a directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from facecast.shared import private_files
from facecast.shared.transport import endpoints, shm

log = logging.getLogger(__name__)

SYSTEM_RUNTIME_DIR = "/run/facecast"  # systemd's RuntimeDirectory=facecast
LOCK_NAME = "supervisor.lock"


class AlreadyRunning(RuntimeError):
    pass


class UnsafeRuntimeDir(RuntimeError):
    """The runtime directory is not this user's alone; the message names the path, what was
    found and what is required."""


def candidates(configured: str = "") -> list[Path]:
    """Where a daemon puts its runtime directory, in order of precedence: configured, systemd's
    RuntimeDirectory, the user's XDG_RUNTIME_DIR, /tmp; the CLI also looks at the system
    service's."""
    if configured:
        return [Path(configured)]
    paths = []
    if os.environ.get("RUNTIME_DIRECTORY"):
        paths.append(Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        paths.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "facecast")
    paths.append(Path(f"/tmp/facecast-{os.getuid()}"))
    return paths


def problem(path: Path) -> str:
    """Why the daemon must not use `path` as its runtime directory ("" when it may)."""
    return private_files.runtime_dir_problem(path)


def for_daemon(configured: str) -> Path:
    """The daemon's runtime directory: made 0700 if missing (whatever the umask), and refused
    (UnsafeRuntimeDir) unless it is this user's alone."""
    path = candidates(configured)[0]
    private_files.make_dirs(path)
    found = problem(path)
    if found:
        raise UnsafeRuntimeDir(f"refusing runtime directory {path}: {found}")
    return path


def cli_problem(path: Path) -> str:
    """Why the CLI must not talk to a daemon through `path` ("" when it may): it must be the
    user's own, as for the daemon, or the system service's (/run/facecast, made by systemd in
    /run, owned by the service's user: that it is writable by nobody else is enough)."""
    if path == Path(SYSTEM_RUNTIME_DIR):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return ""
        mode = info.st_mode & 0o7777
        if not os.path.isdir(path) or os.path.islink(path) or mode & 0o022:
            return (f"{path} (mode {mode:04o}, owner {private_files.user_name(info.st_uid)}) is "
                    "not a directory writable only by its owner")
        return ""
    return problem(path)


def for_cli(configured: str = "", explicit: str = "") -> Path:
    """The daemon the CLI talks to: given, else configured, else the first place that has a
    control socket (this user's places, then the system service's)."""
    if explicit:
        return Path(explicit)
    places = candidates(configured)
    if not configured:
        places.append(Path(SYSTEM_RUNTIME_DIR))
    for place in places:
        if endpoints.socket_path(endpoints.control(place)).exists():
            return place
    return places[0]


def lock_owner(runtime_dir: str | Path) -> tuple[bool, int]:
    """(held, pid): whether a live supervisor holds the lock, and the pid written in it (0 when
    unknown). A free lock with a pid is a supervisor that was killed."""
    path = Path(runtime_dir) / LOCK_NAME
    try:
        with open(path) as lock_file:
            text = lock_file.read().strip()
            try:
                fcntl.flock(lock_file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                held = True
            else:
                held = False
    except FileNotFoundError:
        return False, 0
    except PermissionError:  # someone else's daemon (the system service): assume it is alive
        return True, 0
    return held, int(text) if text.isdigit() else 0


@dataclass
class Leftovers:
    """What a killed supervisor (and its workers) left in the runtime dir and /dev/shm."""

    previous_pid: int = 0
    sockets: list[str] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    cuda_ipc_files: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sockets or self.segments or self.cuda_ipc_files)

    def describe(self) -> str:
        owner = (f"supervisor pid {self.previous_pid}, which did not stop cleanly"
                 if self.previous_pid else "an earlier run")
        return (f"cleaned up after {owner}: removed {len(self.sockets)} socket(s), and "
                f"{len(self.segments)} shared-memory segment(s) and {len(self.cuda_ipc_files)} "
                "CUDA IPC file(s) of processes that are gone")


class RuntimeDir:
    """The supervisor's side: take the lock, clean up after a dead predecessor, let go."""

    def __init__(self, configured: str) -> None:
        self.path = for_daemon(configured)
        self._lock_file = None

    def take_lock(self) -> Leftovers:
        """Lock the directory for this process (AlreadyRunning if a live daemon has it), then
        remove what an earlier supervisor that was killed left, and say what that was."""
        _, previous_pid = lock_owner(self.path)
        lock_file = open(self.path / LOCK_NAME, "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise AlreadyRunning(
                f"another facecast daemon is running with runtime directory {self.path}"
            ) from None
        lock_file.truncate(0)
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._lock_file = lock_file
        leftovers = Leftovers(previous_pid=previous_pid if previous_pid != os.getpid() else 0)
        leftovers.sockets = self.remove_sockets()
        # Workers die with their supervisor (PR_SET_PDEATHSIG); whatever they owned is ownerless.
        leftovers.segments, leftovers.cuda_ipc_files = shm.sweep_all_dead()
        return leftovers

    def remove_sockets(self) -> list[str]:
        """ipc:// socket files in the directory (we hold the lock: any there are ours or dead)."""
        removed = []
        for path in self.path.iterdir():
            if path.is_socket():
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    def release(self) -> None:
        if self._lock_file is not None:
            (self.path / LOCK_NAME).unlink(missing_ok=True)
            self._lock_file.close()
            self._lock_file = None
