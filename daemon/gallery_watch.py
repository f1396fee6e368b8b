"""The supervisor's watch on the participants' gallery: its status line for `facecast status`,
and a log line and a Markers event when it turns unusable or usable again (Note [Gallery
validation]): a bad gallery costs the names, never the daemon.

Runs in the supervisor only; the workers that name faces read the gallery themselves
(facecast.workers.inference.identity).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from facecast.shared import gallery
from facecast.shared.config import ParticipantsConfig

log = logging.getLogger(__name__)

GALLERY_CHECK_S = 2.0  # as the workers' (Note [Gallery reload])


class GalleryWatch:
    """`event` puts one of the supervisor's own events on the Markers stream."""

    def __init__(self, event: Callable[..., None]) -> None:
        self._event = event
        self._seen = ""  # the gallery's last status line
        self._next_check_monotonic = 0.0

    def line(self, participants: ParticipantsConfig) -> str:
        """The gallery's status line; when it turns unusable (or usable again), the log and the
        Markers stream say so, once per change."""
        line = gallery.status_line(participants.gallery)
        if line != self._seen:
            if line.startswith(gallery.UNUSABLE):
                log.error("participants: %s; faces go unnamed by it until it is fixed", line)
                self._event("gallery_unusable", reason=line.removeprefix(gallery.UNUSABLE))
            elif self._seen.startswith(gallery.UNUSABLE):
                log.info("participants: %s", line)
                self._event("gallery_usable", detail=line)
            self._seen = line
        return line

    def check(self, participants: ParticipantsConfig) -> None:
        """Where faces are named by the gallery, its changes are noticed without a status
        request too (a stat every GALLERY_CHECK_S; the file is read only when it changed)."""
        now = time.monotonic()
        if (not participants.enabled or participants.identify != "embeddings"
                or now < self._next_check_monotonic):
            return
        self._next_check_monotonic = now + GALLERY_CHECK_S
        self.line(participants)
