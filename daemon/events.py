"""The daemon's events on their way to the Markers stream (DESIGN §4): start/stop, camera lost
and back, transport fallback, worker restarts, reloads, models missing.

Events come from the supervisor itself and from workers (`Event` messages on the control
socket). They are kept, bounded, until the output worker, which owns the Markers outlet, is up,
then sent to it in order; it holds them until its (re)created outlet has a reader (Note [Markers
wait for a reader], workers/output/outlets.py). The last few are also kept for `facecast status`.

Runs in the supervisor only.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

import msgspec

from facecast.shared.transport.messages import Event

log = logging.getLogger(__name__)

RECENT_EVENTS = 50
PENDING_EVENTS_MAX = 1000


class MarkerEvents:
    def __init__(self) -> None:
        self._pending: collections.deque[Event] = collections.deque(maxlen=PENDING_EVENTS_MAX)
        self._recent: collections.deque[str] = collections.deque(maxlen=RECENT_EVENTS)

    def add(self, event: Event) -> None:
        self._recent.append(f"{event.kind} {msgspec.json.encode(event.fields).decode()}")
        self._pending.append(event)

    def new(self, kind: str, **fields: str | int | float | bool) -> None:
        """An event of the supervisor's own, stamped now on the LSL clock."""
        import pylsl

        self.add(Event(kind=kind, fields=fields, event_ts_lsl=pylsl.local_clock()))

    def recent(self, count: int) -> list[str]:
        return list(self._recent)[-count:]

    def flush(self, send: Callable[[Event], bool], output_up: bool) -> None:
        """Send what is pending through `send` (False: not delivered, try next tick) while the
        output worker is up."""
        if not output_up:
            return  # kept (bounded) until the output worker is up again
        while self._pending:
            if not send(self._pending[0]):
                return
            self._pending.popleft()

    def __len__(self) -> int:
        return len(self._pending)
