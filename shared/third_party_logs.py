"""The log lines of the libraries facecast drives: liblsl's, OpenCV's and FFmpeg's (through OpenCV).

Left alone, they clutter every command: liblsl prints colour-coded INFO lines when it starts,
OpenCV a `[ WARN:0@...]` line and FFmpeg a `[tcp @ 0x...] Connection ... refused` line on every
reconnect try of a camera that is down, which facecast already reports in its own words (the
reason in the log, in `facecast status` and on the Markers stream). `quiet()` keeps only their
errors; `--verbose` leaves them as the libraries have them.

Runs on the CLI side, before the command touches LSL or OpenCV. Everything goes through the
environment, which the supervisor hands to every worker it spawns, so the workers need no call of
their own:

- OpenCV: `OPENCV_LOG_LEVEL=ERROR` (read when cv2 loads; `cv2.utils.logging.setLogLevel` for a
  cv2 that this process already loaded).
- FFmpeg inside OpenCV: `OPENCV_FFMPEG_LOGLEVEL` (OpenCV's FFmpeg backend passes it to
  `av_log_set_level`), set to AV_LOG_FATAL.
- liblsl: its log level is the `level` key of the `[log]` section of `lsl_api.cfg` (-3 fatal ...
  0 info ... 9), read once per process at first use. See Note [liblsl's log level].

A variable the user set already wins, and so does a `[log] level` in the user's own lsl_api.cfg.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

OPENCV_QUIET_LEVEL = "ERROR"
FFMPEG_QUIET_LEVEL = "8"  # AV_LOG_FATAL: FFmpeg's error lines repeat what facecast says
LSL_QUIET_LEVEL = -2  # loguru's ERROR: liblsl's errors still show, its INFO and WARNING lines not

# Where liblsl looks for its configuration when $LSLAPICFG is unset or unreadable, in its order
# (liblsl src/api_config.cpp); the first readable file wins, else built-in defaults.
LSL_CONFIG_SEARCH_PATH = ("lsl_api.cfg", "~/lsl_api/lsl_api.cfg", "/etc/lsl_api/lsl_api.cfg")

# The first line of a configuration that quiet() wrote; what follows it names the original.
GENERATED_MARKER = "; facecast: "

# Note [liblsl's log level]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# liblsl takes its log level only from lsl_api.cfg, and it reads exactly one file: $LSLAPICFG
# when readable, else the first of LSL_CONFIG_SEARCH_PATH. A lab's file there carries settings
# that matter (KnownPeers, ResolveScope, SessionID), so facecast never edits it and never points
# liblsl past it: it writes a copy with `[log] level` added into the runtime directory and points
# $LSLAPICFG at that copy. Without any file, the copy holds only the [log] section (liblsl's
# defaults for the rest). A file that already sets `[log] level` is used as it is. The copy is
# named by its content's hash, so commands running at once write the same bytes to the same
# name, and a daemon reading it never sees it half-written (written aside, then renamed).
# pylsl's set_config_content() would avoid the file, but it replaces every file (so the copy is
# needed anyway) and exists only from liblsl 1.17.7 on.


def lsl_config_file() -> tuple[Path | None, str | None]:
    """(the lsl_api.cfg liblsl will read in a fresh process of this environment, or None; a
    problem with $LSLAPICFG, or None)."""
    problem = None
    env_path = os.environ.get("LSLAPICFG")
    if env_path:
        if os.access(env_path, os.R_OK) and Path(env_path).is_file():
            return Path(env_path), None
        problem = f"$LSLAPICFG={env_path} is not a readable file, so liblsl ignores it"
    for candidate in LSL_CONFIG_SEARCH_PATH:
        path = Path(candidate).expanduser()
        if path.is_file() and os.access(path, os.R_OK):
            return path.resolve(), problem
    return None, problem


def generated_from(path: Path) -> str | None:
    """What a configuration that quiet() wrote was made from (None: not one of ours)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            first_line = file.readline().rstrip("\n")
    except OSError:
        return None
    return first_line[len(GENERATED_MARKER):] if first_line.startswith(GENERATED_MARKER) else None


def _sets_log_level(text: str) -> bool:
    """Whether liblsl would find `[log] level` in this lsl_api.cfg text.

    Read the way liblsl's own reader reads it (src/inireader.cpp), not with configparser, which
    disagrees on what liblsl accepts: `;` starts a comment only in the first column, `#` never
    does, and keys before any section belong to no section.
    """
    section = ""
    for line in text.splitlines():
        if not line.strip() or line.startswith(";"):
            continue
        if line.startswith("["):
            section = line[1:line.find("]")] if "]" in line else section
            continue
        if section == "log" and line.partition("=")[0].strip() == "level":
            return True
    return False


def quiet_lsl(runtime_dir: Path) -> Path | None:
    """Point $LSLAPICFG at a copy of liblsl's configuration with `[log] level` set to ERROR
    (Note [liblsl's log level]); returns the copy, or None when the user's file sets the level."""
    original, _ = lsl_config_file()
    text = original.read_text(encoding="utf-8", errors="replace") if original else ""
    if _sets_log_level(text):
        return None
    described = f"copy of {original}" if original else "liblsl's defaults"
    generated = (f"{GENERATED_MARKER}{described}, with [log] level = {LSL_QUIET_LEVEL} added "
                 "(facecast --verbose shows liblsl's own lines)\n"
                 f"{text.rstrip()}\n\n[log]\nlevel = {LSL_QUIET_LEVEL}\n")
    digest = hashlib.sha256(generated.encode()).hexdigest()[:16]
    path = Path(runtime_dir) / f"lsl_api-{digest}.cfg"
    if not path.is_file():
        aside = path.with_name(f".{path.name}.{os.getpid()}")
        aside.write_text(generated, encoding="utf-8")
        os.replace(aside, path)
    os.environ["LSLAPICFG"] = str(path)
    return path


def quiet_opencv() -> None:
    """OpenCV's and FFmpeg's own lines: errors only, unless the user chose a level."""
    opencv_chosen = "OPENCV_LOG_LEVEL" in os.environ
    os.environ.setdefault("OPENCV_LOG_LEVEL", OPENCV_QUIET_LEVEL)
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", FFMPEG_QUIET_LEVEL)
    cv2 = sys.modules.get("cv2")  # already loaded: it read the variable before we set it
    if cv2 is not None and not opencv_chosen:
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)


def quiet(runtime_dir: Path, *, verbose: bool = False) -> None:
    """Only facecast's lines on the terminal (and in the journal), unless `verbose`."""
    if verbose:
        return
    quiet_opencv()
    try:
        quiet_lsl(runtime_dir)
    except OSError as exc:  # an unwritable runtime dir costs liblsl's INFO lines, nothing more
        log.warning("cannot write liblsl's configuration copy in %s (%s); its INFO lines will "
                    "show", runtime_dir, exc)
