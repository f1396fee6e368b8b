"""`facecast check-config FILE`: the config validated (exit 2 with every error), then each
camera's source looked at on this machine (exit 1 when one can never work here)."""

from __future__ import annotations

import sys

from facecast.shared import config


def main(args) -> int:
    try:
        loaded = config.load(args.config)
    except config.ConfigError as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        return 2
    # The source may hold an RTSP password: shown masked, as in the log and `facecast status`.
    cameras = ", ".join(f"{c.id} ({config.redact_url(str(c.source))}, {loaded.transport_for(c)})"
                        for c in loaded.cameras)
    problems = [f"cameras.{c.id}.source: {problem}" for c in loaded.cameras
                if (problem := source_problem(c.source))]
    if problems:
        for problem in problems:
            print(f"facecast: {args.config}: {problem}", file=sys.stderr)
        print(f"{args.config}: valid, but {len(problems)} camera source(s) cannot work on this "
              f"machine; cameras: {cameras}")
        return 1
    print(f"{args.config}: ok; cameras: {cameras}")
    return 0


def source_problem(source: str | int) -> str:
    """Why a camera's source can never work on this machine ("" when it may): a V4L2 device or
    a video file that is not there. Looked at by `check-config` only, never while a config is
    validated (STYLE §10: no probing in validation); streams are not probed (`facecast cameras
    --probe URL` does that)."""
    import os
    import stat

    from facecast.shared.camera_sources import SourceConfigError, source_kind

    try:
        kind = source_kind(source)
    except SourceConfigError as exc:  # what the config's shape check lets through (synthetic-h265)
        return str(exc)
    if kind == "v4l2":
        path = source if isinstance(source, str) and source.startswith("/dev/") \
            else f"/dev/video{int(source)}"
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            return (f"{path}: {exc.strerror.lower()} (allowed: a V4L2 device of this machine; "
                    "`facecast cameras` lists them)")
        if not stat.S_ISCHR(mode):
            return f"{path}: not a device (allowed: a V4L2 device such as /dev/video0)"
        return "" if os.access(path, os.R_OK | os.W_OK) else (
            f"{path}: no permission to open it (the daemon's user needs the video group)")
    if kind == "file":
        path = source.removeprefix("file://")
        if not os.path.isfile(path):
            return (f"{config.redact_url(path)}: no such video file" if not os.path.exists(path)
                    else f"{config.redact_url(path)}: not a regular file (allowed: a video file)")
        if not os.access(path, os.R_OK):
            return f"{config.redact_url(path)}: not readable by this user"
    return ""
