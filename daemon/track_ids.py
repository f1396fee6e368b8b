"""Track ids for the whole daemon: the supervisor grants roi_landmark workers blocks of them.

Runs in the supervisor only. Pure bookkeeping: no sockets, no clock but the log's rate limit.

Note [Track id blocks]
    A track id names one person on one camera for as long as facecast follows them, and a
    recording (an XDF file, an analysis script) keys everything on it: it must never name two
    people. The roi_landmark worker that hands ids out is restarted during the daemon's life (a
    crash, a hang, a warm standby promoted, a reload), and it used to count from 1 in every
    process: after a SIGKILL, one recording had id 1 for two different people.

    So ids come from the one process that lives as long as the daemon, the supervisor.
    `TrackIdAllocator` hands out blocks of `block_size` consecutive ids, in increasing order,
    never overlapping, never twice. A roi_landmark worker gets a first block with its
    `Assignment` and asks for the next one (`TrackIdsWanted` → `TrackIdGrant`) as soon as half
    of what it holds is used (facecast.workers.inference.tracking.TrackIdSource). The other half is the
    reserve that covers the round trip, so the worker never waits for a grant. Should it run dry
    all the same, a face that needs a new id is not published (counted, logged as an error, a
    `track_ids_dry` marker, and the heartbeat's `trouble`): no id is ever made up or reused.
    Faces it already follows keep their ids. Ids of a dead worker's unused blocks are never
    used: a restart costs at most two blocks. Ids are unique across the daemon's cameras too.

    The space. Ids travel in a float32 LSL channel, which holds every integer exactly up to
    2**24, so ids are 1 .. 2**24 - 1 (16,777,215; TRACK_ID_LIMIT). At one new track a second
    that lasts 194 days; at 100 a second (many cameras, faces lost and found again all the
    time) 46 hours. When it is used up the allocator refuses: an error in the supervisor's log
    (rate-limited), the grant says why, and the workers publish the faces they follow and no
    newcomer, until the daemon is restarted (`systemctl restart facecast`), which starts a new
    space at 1 with a `start` marker. Wrapping around to 1 instead would keep faces on the
    streams, but it is exactly the reuse this note exists to prevent, inside any recording
    that spans the wrap, with nothing in the data to tell the two people apart. A warning goes
    to the log when 90% of the space is granted, long before that.

    Ids are unique for the daemon's life, not across daemon restarts: a recording that spans a
    restart of the whole daemon sees its `stop` and `start` markers, and ids from 1 again.
"""

from __future__ import annotations

import logging
import time

from facecast.shared.transport.messages import (
    TRACK_ID_LIMIT,
    TrackIdBlock,
    TrackIdGrant,
    TrackIdsWanted,
)

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 1024  # one request per ~500 new tracks; a restart wastes at most 2 blocks
NEARLY_USED_UP_FRACTION = 0.9
REFUSAL_LOG_INTERVAL_S = 60.0


class TrackIdAllocator:
    """Note [Track id blocks]: the daemon-wide source of track id blocks. One per supervisor,
    for its whole life (a reload keeps it)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, first_id: int = 1,
                 limit: int = TRACK_ID_LIMIT) -> None:
        if not 1 <= first_id < limit <= TRACK_ID_LIMIT:
            raise ValueError(f"track ids must satisfy 1 <= first_id ({first_id}) < limit "
                             f"({limit}) <= {TRACK_ID_LIMIT} (float32-exact)")
        if block_size < 2:
            raise ValueError(f"block_size must be at least 2 (a worker asks for more at half), "
                             f"got {block_size}")
        self.block_size = block_size
        self.first_id = first_id
        self.limit = limit
        self.granted_by_worker: dict[str, int] = {}  # worker name → ids granted to it, in total
        self.refusals = 0
        self._next_id = first_id
        self._warned_nearly_used_up = False
        self._next_refusal_log_monotonic = 0.0

    @property
    def remaining(self) -> int:
        """Ids never granted."""
        return self.limit - self._next_id

    @property
    def exhausted_reason(self) -> str:
        return (f"the daemon's track ids are used up (all of {self.first_id}..{self.limit - 1} "
                "granted); new faces are not published until the daemon is restarted "
                "(Note [Track id blocks])")

    def grant(self, worker: str) -> TrackIdBlock | None:
        """The next block for `worker`, or None when the space is used up (logged as an error)."""
        if self._next_id >= self.limit:
            self._refuse(worker)
            return None
        block = TrackIdBlock(start=self._next_id, count=min(self.block_size, self.remaining))
        self._next_id = block.end
        self.granted_by_worker[worker] = self.granted_by_worker.get(worker, 0) + block.count
        log.debug("track ids %d..%d to %s", block.start, block.end - 1, worker)
        used = (self._next_id - self.first_id) / (self.limit - self.first_id)
        if used >= NEARLY_USED_UP_FRACTION and not self._warned_nearly_used_up:
            self._warned_nearly_used_up = True
            log.warning("%.0f%% of the daemon's track ids are granted (%d left): when none is "
                        "left new faces are not published until a restart (Note [Track id "
                        "blocks])", 100 * used, self.remaining)
        return block

    def answer(self, request: TrackIdsWanted) -> TrackIdGrant:
        """The reply to a worker's request: a block, or none and why."""
        block = self.grant(request.worker)
        if block is None:
            return TrackIdGrant(reply_to=request.id, error=self.exhausted_reason)
        return TrackIdGrant(reply_to=request.id, block=block)

    def _refuse(self, worker: str) -> None:
        self.refusals += 1
        now = time.monotonic()
        if now >= self._next_refusal_log_monotonic:
            self._next_refusal_log_monotonic = now + REFUSAL_LOG_INTERVAL_S
            log.error("no track ids for %s: %s (%d refusal(s) so far)", worker,
                      self.exhausted_reason, self.refusals)
