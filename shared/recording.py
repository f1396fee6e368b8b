"""Where recordings go and how their files are named: one place for the supervisor (which checks
the directory before it starts a recording), the recorder worker, the frame-index stream's
metadata and the tests (README "Recording"). Every directory made here is 0700, whatever the
umask; its files are made 0600 by their writers (Note [Private files]).
"""

from __future__ import annotations

import os
from pathlib import Path

from facecast.shared import private_files


def default_dir() -> Path:
    """record.dir when the config leaves it empty: $XDG_DATA_HOME/facecast/recordings."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "facecast" / "recordings"


def recording_dir(requested: str, configured: str) -> Path:
    """`record start --dir` (absolute, from the CLI), else record.dir, else default_dir()."""
    return Path(requested or configured) if (requested or configured) else default_dir()


def segment_path(directory: Path, camera_id: str, stamp: str, segment: int, container: str) -> Path:
    """`<dir>/<camera>_<UTC start YYYYmmdd-HHMMSS.mmmZ>_<segment, 3 digits>.<mkv|mp4>`; its
    sidecar is the same path with `.csv`."""
    return directory / f"{camera_id}_{stamp}_{segment:03d}.{container}"


def writable_dir_problem(directory: Path) -> str:
    """Why recordings cannot go into `directory` ("" when they can); creates it if missing, 0700
    with any parents it makes (Note [Private files]). The default directory is facecast's own:
    brought to 0700 if an earlier version left it open; a directory the user made keeps the mode
    they chose (the files in it are 0600 all the same)."""
    try:
        private_files.make_dirs(directory)
        if directory == default_dir():
            for own in (directory, directory.parent):  # .../facecast/recordings
                if own.stat().st_uid == os.geteuid():
                    os.chmod(own, private_files.DIR_MODE)
    except OSError as exc:
        return f"cannot create {directory}: {exc.strerror}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable by this user (uid {os.getuid()})"
    return ""
