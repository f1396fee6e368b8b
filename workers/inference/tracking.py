"""Track ids: which face in this frame is the same person as which face in earlier frames.

The landmark tracker in FacePipeline already follows each face from frame to frame; what it does
not keep is a name for it. `TrackIds` gives every face of one camera an integer id that stays the
same while the face stays, and after a short occlusion (the face hidden for up to `hold_s` of
capture time, e.g. a hand passing in front of it, or the detector needing a frame to find it
again).

Matching is by geometry: the box overlap (IoU) with the face's box in the last frame it was seen;
a face that was not seen in the previous frame (occluded, or lost and re-detected) may also be
matched by its centre lying within `max_shift_fraction` of its size from where it was. Greedy,
best match first.

Ids are unique for the daemon's life, across its cameras and its workers' restarts: they come
from blocks the supervisor grants (`TrackIdSource`, one per worker, shared by its cameras; Note
[Track id blocks]), never from a counter of this process.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence


from facecast.models.nms import box_pair_iou
from facecast.shared.transport.messages import TRACK_ID_LIMIT

Box = tuple[float, float, float, float]


@dataclass
class _Known:
    track_id: int
    box_px: Box
    last_seen_ts_lsl: float
    seen_in_last_frame: bool = True


class TrackIdSource:
    """The track ids one worker may hand out: the blocks the supervisor granted it, used in
    order (Note [Track id blocks]). It never waits and never makes
    an id up: `take` says None when it is dry, and `wants_more` says when to ask for the next
    block, early enough (half of the newest block left) that the answer comes before that."""

    def __init__(self, limit: int = TRACK_ID_LIMIT) -> None:
        self.limit = limit  # ids are below this (float32-exact)
        self.blocks_granted = 0
        self._blocks: deque[list[int]] = deque()  # [next id, end] per block, oldest first
        self._reserve = 0  # ask for more when this many ids or fewer are left
        self._granted_end = 1  # one past the highest id granted so far

    def add(self, start: int, count: int) -> None:
        """Ids start .. start + count - 1 are this worker's. ValueError (nothing added) for a
        block that is empty, out of range, or overlaps ids granted before: a supervisor bug
        that would repeat ids."""
        end = start + count
        if count < 1 or start < 1 or end > self.limit:
            raise ValueError(f"track id block {start}+{count} is not within 1 .. {self.limit - 1}")
        if start < self._granted_end:
            raise ValueError(f"track id block {start}..{end - 1} overlaps ids granted before "
                             f"(up to {self._granted_end - 1}): refused, ids must never repeat")
        self._blocks.append([start, end])
        self._granted_end = end
        self._reserve = count // 2
        self.blocks_granted += 1

    @property
    def remaining(self) -> int:
        return sum(end - next_id for next_id, end in self._blocks)

    def wants_more(self) -> bool:
        """Half of the newest block is used (or nothing was granted yet): time to ask."""
        return self.remaining <= self._reserve

    def take(self) -> int | None:
        """The next unused id, or None when every granted id is used."""
        while self._blocks:
            block = self._blocks[0]
            if block[0] < block[1]:
                block[0] += 1
                return block[0] - 1
            self._blocks.popleft()
        return None


class TrackIds:
    """Stable ids for the faces of one camera, taken from the worker's `TrackIdSource`."""

    def __init__(self, ids: TrackIdSource, hold_s: float = 1.0, min_iou: float = 0.2,
                 max_shift_fraction: float = 0.75) -> None:
        self.ids = ids
        self.hold_s = hold_s
        self.min_iou = min_iou
        self.max_shift_fraction = max_shift_fraction
        self._known: list[_Known] = []

    def assign(self, boxes_px: Sequence[Box], capture_ts_lsl: float) -> list[int | None]:
        """The id of each box of this frame, in order. None for a new face when the source is
        dry: the face has no name (yet) and must not be published; the next frame tries again."""
        self._known = [k for k in self._known if capture_ts_lsl - k.last_seen_ts_lsl <= self.hold_s]
        # Plain floats: a frame has a handful of faces, and this runs for every frame of every
        # camera; per pair, array calls cost ten times the arithmetic (bench/pipeline.py's
        # profile of roi_landmark at 64 cameras: 28 % of its samples were here).
        boxes = [tuple(map(float, box)) for box in boxes_px]
        candidates = []  # (overlapping?, similarity, face index, known index): overlaps first
        for i, box in enumerate(boxes):
            for j, known in enumerate(self._known):
                iou = box_pair_iou(box, known.box_px)
                if iou >= self.min_iou:
                    candidates.append((True, iou, i, j))
                elif not known.seen_in_last_frame:
                    closeness = self._closeness(box, known.box_px)
                    if closeness > 0:
                        candidates.append((False, closeness, i, j))
        ids: list[int | None] = [None] * len(boxes)
        matched_known: set[int] = set()
        for _, _, i, j in sorted(candidates, reverse=True):
            if ids[i] is None and j not in matched_known:
                ids[i] = self._known[j].track_id
                matched_known.add(j)
        for j, known in enumerate(self._known):
            known.seen_in_last_frame = j in matched_known
        for i, box in enumerate(boxes):
            if ids[i] is None:
                ids[i] = self.ids.take()
                if ids[i] is not None:
                    self._known.append(_Known(ids[i], box, capture_ts_lsl))
            else:
                known = next(k for k in self._known if k.track_id == ids[i])
                known.box_px, known.last_seen_ts_lsl = box, capture_ts_lsl
                known.seen_in_last_frame = True
        return [None if track_id is None else int(track_id) for track_id in ids]

    def _closeness(self, box: Box, old_box: Box) -> float:
        """In (0, 1] for a face whose centre is near where an occluded one was, else 0."""
        size = max(old_box[2] - old_box[0], old_box[3] - old_box[1], 1.0)
        shift = math.hypot((box[0] + box[2] - old_box[0] - old_box[2]) / 2,
                         (box[1] + box[3] - old_box[1] - old_box[3]) / 2)
        return max(0.0, 1.0 - shift / (self.max_shift_fraction * size))

    def clear(self) -> None:
        self._known.clear()
