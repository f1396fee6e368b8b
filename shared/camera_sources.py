"""What a camera's `source` names (a synthetic scene, a V4L2 device, a stream URL, a video file),
read from the text alone, opening nothing: for the capture worker (facecast.workers.capture.sources),
which then opens it, and for `check-config`, which must stay light (no OpenCV, no pylsl: issue
20's import weight).
"""

from __future__ import annotations

import re

from facecast.shared.config import redact_url

_STREAM_SCHEMES = ("rtsp", "rtsps", "http", "https")
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
# The synthetic scene rendered per frame, replayed from a loop rendered once, or that loop
# encoded once and decoded per frame (Note [Encoded synthetic loop]).
SYNTHETIC_SOURCES = ("synthetic", "synthetic-replay", "synthetic-h264", "synthetic-mjpeg")
# The encoded ones: source -> codec.
ENCODED_SYNTHETIC_CODECS = {"synthetic-h264": "h264", "synthetic-mjpeg": "mjpeg"}
# What reads as a synthetic source but is none of them (a typo, a codec not offered): an error,
# not a video file of that name (write ./synthetic-x for such a file).
_SYNTHETIC_LIKE = re.compile(r"^synthetic[-_]?[A-Za-z0-9_-]*$", re.IGNORECASE)


class SourceConfigError(ValueError):
    """The camera's `source` can never work as written; retrying will not help."""


def source_kind(source: str | int) -> str:
    """One of SYNTHETIC_SOURCES, or "v4l2", "stream" or "file", for a `CameraConfig.source`."""
    if isinstance(source, bool):
        raise SourceConfigError(f"source must be a string or a V4L2 index, got {source!r}")
    if isinstance(source, int):
        if source < 0:
            raise SourceConfigError(f"a V4L2 index must be >= 0, got {source}")
        return "v4l2"
    if source in SYNTHETIC_SOURCES:
        return source
    if _SYNTHETIC_LIKE.match(source):
        raise SourceConfigError(
            f"unknown synthetic source {source!r} (allowed: "
            f"{', '.join(repr(name) for name in SYNTHETIC_SOURCES)}; a video file of that name: "
            f"'./{source}')")
    if source.isdigit() or source.startswith("/dev/"):
        return "v4l2"
    url = _URL.match(source)
    if url:
        scheme = url["scheme"].lower()
        if scheme in _STREAM_SCHEMES:
            return "stream"
        if scheme == "file":
            return "file"
        raise SourceConfigError(
            f"source {redact_url(repr(source))}: unsupported URL scheme {scheme!r} "
            f"(allowed: {', '.join(_STREAM_SCHEMES)}, file, a /dev/video path, an index, or "
            f"{', '.join(repr(name) for name in SYNTHETIC_SOURCES)})"
        )
    if not source.strip():
        raise SourceConfigError("source is empty")
    return "file"
