"""Track ids: which face in this frame is the same person as which face in earlier frames.

The landmark tracker in FacePipeline already follows each face from frame to frame; what it does
not keep is a name for it. `TrackIds` gives every face of one camera an integer id that stays the
same while the face stays, and after a short occlusion (the face hidden for up to `hold_s` of
capture time, e.g. a hand passing in front of it, or the detector needing a frame to find it
again).

Matching is by geometry: the box overlap (IoU) with the face's box in the last frame it was seen;
a face that was not seen in the previous frame (occluded, or lost and re-detected) may also be
matched by its centre lying within `max_shift_fraction` of its size from where it was. Greedy,
best match first. Ids start at 1 per camera and are unique for the life of the worker process;
they travel in a float32 LSL channel, exact up to 2**24.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

Box = tuple[float, float, float, float]


@dataclass
class _Known:
    track_id: int
    box_px: np.ndarray
    last_seen_ts_lsl: float
    seen_in_last_frame: bool = True


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


class TrackIds:
    """Stable ids for the faces of one camera."""

    def __init__(self, hold_s: float = 1.0, min_iou: float = 0.2,
                 max_shift_fraction: float = 0.75) -> None:
        self.hold_s = hold_s
        self.min_iou = min_iou
        self.max_shift_fraction = max_shift_fraction
        self._known: list[_Known] = []
        self._next_id = 1

    def assign(self, boxes_px: Sequence[Box], capture_ts_lsl: float) -> list[int]:
        """The id of each box of this frame, in order."""
        self._known = [k for k in self._known if capture_ts_lsl - k.last_seen_ts_lsl <= self.hold_s]
        boxes = [np.asarray(box, dtype=np.float64) for box in boxes_px]
        candidates = []  # (overlapping?, similarity, face index, known index): overlaps first
        for i, box in enumerate(boxes):
            for j, known in enumerate(self._known):
                iou = box_iou(box, known.box_px)
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
                ids[i] = self._next_id
                self._next_id += 1
                self._known.append(_Known(ids[i], box, capture_ts_lsl))
            else:
                known = next(k for k in self._known if k.track_id == ids[i])
                known.box_px, known.last_seen_ts_lsl = box, capture_ts_lsl
                known.seen_in_last_frame = True
        return [int(track_id) for track_id in ids]

    def _closeness(self, box: np.ndarray, old_box: np.ndarray) -> float:
        """In (0, 1] for a face whose centre is near where an occluded one was, else 0."""
        size = max(old_box[2] - old_box[0], old_box[3] - old_box[1], 1.0)
        shift = np.hypot((box[0] + box[2] - old_box[0] - old_box[2]) / 2,
                         (box[1] + box[3] - old_box[1] - old_box[3]) / 2)
        return max(0.0, 1.0 - shift / (self.max_shift_fraction * size))

    def clear(self) -> None:
        self._known.clear()
