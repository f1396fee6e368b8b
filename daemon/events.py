"""The daemon's events on their way to the Markers stream (DESIGN §4): start/stop, camera lost
and back, transport fallback, worker restarts, reloads, models missing.

Events come from the supervisor itself and from workers (`Event` messages on the control
socket). They are kept, bounded, until the output worker, which owns the Markers outlet, is up
and has had MARKERS_SETTLE_S for inlets to find its (re)created outlet, then sent to it in order.
The last few are also kept for `facecast status`.

Runs in the supervisor only.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import msgspec

from facecast.shared.transport.messages import Event

log = logging.getLogger(__name__)

RECENT_EVENTS = 50
PENDING_EVENTS_MAX = 1000
# pylsl inlets (LabRecorder's too) take a moment to find a re-created outlet; markers pushed
# before that are lost to them. Events wait this long after the output worker (re)starts.
MARKERS_SETTLE_S = 2.0


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

    def flush(self, send: Callable[[Event], bool], output_up_since_monotonic: float | None,
              settled: bool = False) -> None:
        """Send what is pending through `send` (False: not delivered, try next tick) once the
        output worker is up (`output_up_since_monotonic` is None while it is not) and settled."""
        if output_up_since_monotonic is None:
            return  # kept (bounded) until the output worker is up again
        if not settled and time.monotonic() - output_up_since_monotonic < MARKERS_SETTLE_S:
            return  # let inlets find the (re)created Markers outlet first, or they miss these
        while self._pending:
            if not send(self._pending[0]):
                return
            self._pending.popleft()

    def __len__(self) -> int:
        return len(self._pending)
