"""Files and directories private to the daemon's user: made with their final mode whatever the
umask, and checked before they are trusted. For the runtime directory and the console's token
(facecast.daemon.runtime_dir, facecast.workers.console.worker) and the recordings (the recorder worker,
the supervisor's side of recording, LabRecorderCLI's XDF). Runs in whichever process makes or
reads such a path.

Note [Private files]
    What facecast makes for one user stays that user's: the runtime directory (its sockets, the
    console's token) and every directory it makes for recordings are 0700 (one the user made
    keeps the mode they gave it), the token and every recording file (video, sidecar, XDF,
    LabRecorderCLI's log) 0600. The mode is set explicitly (fchmod on the open file, chmod on
    a directory just made; LabRecorderCLI, which creates the XDF itself, runs under umask 077),
    never left to the umask, which is 022 outside systemd: a recording made 0644 in a 0755
    directory lets every local user watch the lab's participants (issue 21). A directory that exists already is trusted only if it is
    a real directory (not a symbolic link, which its owner could point elsewhere later) owned
    by this user with no access for anyone else: another local user who makes
    /tmp/facecast-<uid> first, or a configured runtime_dir, would otherwise hold the directory
    where the daemon keeps its token and sockets. Such a directory is refused with the path,
    what was found and what is required, never "fixed": a chmod cannot take back a file that
    someone else put there meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import tempfile
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def dir_problem(path: Path, *, group_may_read: bool = False) -> str:
    """Why the existing directory `path` is not private to this user ("" when it is): a
    symbolic link, not a directory, another owner, or access for others (read and search for
    the group too with `group_may_read`: systemd's RuntimeDirectoryMode=0750). Note [Private
    files]."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    uid = os.geteuid()
    allowed = DIR_MODE | (0o050 if group_may_read else 0)
    required = (f"a directory owned by {user_name(uid)} with mode "
                f"{'0750 or 0700' if group_may_read else '0700'}")
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)}); required: {required}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory; required: {required}"
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != uid:
        return (f"{path} belongs to {user_name(info.st_uid)} (mode {mode:04o}), not to "
                f"{user_name(uid)}: another user may have made it to read or plant files; "
                f"required: {required}; remove it (as its owner or root) or choose another")
    if mode & ~allowed:
        return (f"{path} has mode {mode:04o}: others may read or plant files in it; required: "
                f"{required} (`chmod 700 {path}` once you know what is in it)")
    return ""


def runtime_dir_problem(path: Path) -> str:
    """Why `path` must not be a daemon's runtime directory ("" when it may): it must be this
    user's alone, save that systemd's RuntimeDirectory of this service (in /run, where no user
    can plant one; facecast's unit makes it 0750 for group facecast) may be group-readable."""
    given = os.environ.get("RUNTIME_DIRECTORY", "")
    systemds = bool(given) and Path(given.split(":")[0]) == Path(path)
    return dir_problem(Path(path), group_may_read=systemds)


def file_problem(path: Path) -> str:
    """Why the existing file `path` is not this user's private file ("" when it is): a regular
    file (not a link) owned by this user with mode 0600."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    uid = os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        return f"{path} is {kind}; required: a file owned by {user_name(uid)} with mode 0600"
    if info.st_uid != uid or mode != FILE_MODE:
        return (f"{path} belongs to {user_name(info.st_uid)} with mode {mode:04o}; required: "
                f"owned by {user_name(uid)} with mode 0600")
    return ""


def make_dirs(path: Path) -> Path:
    """`path` and any missing parents, each made here 0700 whatever the umask (those that exist
    are left as they are: a parent such as /data is the lab's)."""
    path = Path(path)
    missing = []
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process: not ours to chmod
        os.chmod(directory, DIR_MODE)  # the umask may have taken bits away
    return path


def open_private(path: Path, *, binary: bool = True):
    """`path` opened for writing (created, or emptied), a regular file made 0600 whatever the
    umask: a recording's file, in a directory that is the user's. Unlike `write_atomically` it
    follows what is there, as any writer would (the recording tests put /dev/full in a
    segment's place); the mode of what is not a regular file of this user is left alone."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        info = os.fstat(descriptor)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            os.fchmod(descriptor, FILE_MODE)
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "wb") if binary else os.fdopen(descriptor, "w", newline="")


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, a regular file 0600 (mkstemp's mode, whatever the umask):
    a reader, or a process that starts again after a kill, sees the old file or the new one,
    never half of one, and never a link or a foreign file's target (the rename replaces the name
    itself). Synced to disk, the directory too, so a power cut keeps one of the two."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
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
