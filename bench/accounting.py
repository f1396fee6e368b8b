"""What the whole-daemon bench counts, and how: one set of definitions for both sides.

bench/pipeline.py (facecast: the real daemon, read by real pylsl inlets) and
bench/mediapipe_baseline.py (MediaPipe's face mesh, one CPU process per camera) both import
this module, so that a column of the table means the same thing on both sides
(Note [One definition for both sides]). Nothing here imports torch or mediapipe: it also runs
inside the baseline's camera processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Note [One definition for both sides]
#     Before, facecast's "dropped" was frames captured minus frames published, clamped at 0,
#     while MediaPipe's was frames its source skipped: at 32 cameras facecast's sources made
#     862 of the 960 frames/s asked for, so by MediaPipe's definition facecast dropped ~9% of
#     what the table showed as 0. Faces per frame came from two status samples on one side and
#     every frame on the other. Now both sides count against what was *due*, from every frame:
#
#     - the window is a span of time, [start_ts_lsl, start_ts_lsl + N / fps), N whole frame
#       periods, the same for every camera; whatever its phase, a camera paced at fps has
#       exactly N frames due in it. A frame counts in the window by when it was due (Note [Due,
#       not stamped]);
#     - published = frames captured in the window that produced a result: for facecast a sample
#       read by a real pylsl inlet (a frame counts once whatever the number of face slots; an
#       all-NaN sample, "no face in this frame", is a result); for MediaPipe `FaceMesh.process`
#       returning on the frame;
#     - dropped = due - published, a count and a share of due, never clamped (a negative value
#       would be a counting error on display, not hidden);
#     - faces: every published frame against the synthetic scene's ground truth (its capture
#       timestamp gives the faces' boxes, workers/capture/sources.py SyntheticScene.faces_at);
#     - latency: capture timestamp → result available in the process that produced it (facecast:
#       the output worker, right after the LSL push; MediaPipe: `FaceMesh.process` returned),
#       p50 and p99 per camera, the worst camera's reported.

# Note [Due, not stamped]
#     A frame's capture timestamp is when its camera's read returned: the instant it was due
#     plus the wake-up's lateness. Counted by their stamps, the window's edges moved frames in
#     and out (a frame due just before the start but stamped after it counted, one due just
#     before the end but stamped after it did not), so `dropped` was exact only to one frame a
#     camera (5 of 34,560 at 64 cameras on 2026-11-28, none of them missing between two
#     published frames). A replayed camera (and its encoded loops) captures in the middle of
#     the ticks of its own phase (Note [Capture phases], workers/capture/sources.py), so when
#     each frame was due is known exactly (`SyntheticReplay.due_ts_lsl`), on both sides: the
#     window holds N due frames a camera and a published frame is counted by when it was due,
#     once however many times it was shown. The live synthetic camera's pacer has no fixed
#     grid: there the stamp stands for when it was due, as before.

MIN_IOU = 0.5  # a result's box matches a true face when their IoU is at least this
NEWCOMER_GOAL_MS = 100.0  # a face that appears is published within this (issue 24 item 5)
# Face widths (the detector-style box of SyntheticScene's ground truth) are counted in these bins.
SIZE_BINS_PX = ((0, 150, "<150 px"), (150, 300, "150-300 px"), (300, math.inf, ">=300 px"))

DEFINITIONS = {
    "window": "a span of time of N whole frame periods (N = round(measure_s x fps)), the same "
              "for every camera of a run; a frame is in it when it was due in it (a replayed "
              "camera's frame: the middle of its capture tick, which its capture timestamp "
              "follows by a wake-up's lateness; the live synthetic camera's: its capture "
              "timestamp)",
    "frames_due": "cameras x N: the frames the cameras were asked to capture in the window",
    "frames_published": "frames due in the window that produced a result, each once however "
                        "often it was shown: facecast, a sample read by a real pylsl inlet (any "
                        "face slot; an all-NaN 'no face' sample counts); MediaPipe, "
                        "FaceMesh.process returned",
    "dropped": "frames_due - frames_published, and as % of frames_due; never clamped (skipped "
               "by the source, by a worker that fell behind, or lost)",
    "lost_between": "frames missing between two published frames of a camera, summed over "
                    "cameras: each gap in its published frames' due times longer than 1.5 "
                    "periods counts round(gap x fps) - 1 (dropped - lost_between: frames lost "
                    "at the window's ends)",
    "published_fps": "frames_published / window length",
    "latency_ms": "capture timestamp -> result available in the producing process (facecast: "
                  "the output worker right after its LSL push, its last 512 frames per camera "
                  "read after the window; MediaPipe: FaceMesh.process returned, every frame of "
                  "the window); p50 and p99 per camera, the worst camera's",
    "latency_p99_by_camera": "facecast only: the cameras' p99s of latency_ms beside their "
                             "maximum: their median, 90th percentile and the three worst "
                             "cameras with theirs",
    "frame_hops": "facecast only: the same grab-to-push span split at the stamps each process "
                  "takes as a frame passes (shared/stats.py, Note [Latency accounted]): grab, "
                  "published by capture, picked up and read by roi_landmark, measured, sent, "
                  "received and pushed by output; mean and p99 per hop over the output "
                  "worker's last 16384 frames of all cameras, read after the window; the means "
                  "add up to the total's",
    "faces": f"every published frame against the synthetic scene's ground truth: a result "
             f"counts as a found face when its detector-style box has IoU >= {MIN_IOU} with a "
             f"true face's box (each used once); found/true by face width; extra = results "
             f"matching no true face; faces_per_frame = found / frames_published",
    "newcomers": f"with --newcomers, each camera's scene is staged (a person appears every "
                 f"cycle while another stays): per appearance, the first frame showing the "
                 f"newcomer (ground truth) to the arrival at an inlet of the first published "
                 f"frame with a box matching them (IoU >= {MIN_IOU}); p50/p90/max over every "
                 f"appearance inside the window, frames late, missed, and the share within "
                 f"{NEWCOMER_GOAL_MS:g} ms (Note [A newcomer's delay])",
    "cpu_cores_busy": "user+system CPU seconds of the side's processes per second of the window "
                      "(facecast: the daemon's process tree, not the bench's inlets; MediaPipe: "
                      "its camera processes); both include rendering the synthetic frames",
}


# ---------------------------------------------------------------------------------------------
# The window and the frame counts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """A span of capture time (`pylsl.local_clock()`), a whole number of frame periods long."""

    start_ts_lsl: float
    frames_per_camera: int
    fps: float

    @classmethod
    def starting_at(cls, start_ts_lsl: float, measure_s: float, fps: float) -> Window:
        frames = round(measure_s * fps)
        if frames < 1:
            raise ValueError(f"a window of {measure_s} s holds no frame at {fps} fps")
        return cls(start_ts_lsl, frames, fps)

    @property
    def length_s(self) -> float:
        return self.frames_per_camera / self.fps

    @property
    def end_ts_lsl(self) -> float:
        return self.start_ts_lsl + self.length_s

    def holds(self, due_ts_lsl: np.ndarray) -> np.ndarray:
        """Whether each of an array of times lies in the window."""
        return (due_ts_lsl >= self.start_ts_lsl) & (due_ts_lsl < self.end_ts_lsl)

    def contains(self, due_ts_lsl: float) -> bool:
        return bool(self.holds(due_ts_lsl))


def due_ts_lsl(truth, capture_ts_lsl):
    """When frames captured at `capture_ts_lsl` (a number or an array) were due (Note [Due, not
    stamped]): a replayed camera's truth (SyntheticReplay) knows; else the stamps themselves."""
    due = getattr(truth, "due_ts_lsl", None)
    return due(capture_ts_lsl) if due is not None else np.asarray(capture_ts_lsl, np.float64)


def frame_counts(cameras: int, window: Window, published: int,
                 lost_between: int | None = None) -> dict:
    """frames_due, frames_published, dropped (count and % of due, never clamped), published_fps,
    and lost_between (frames_lost_between's sum over cameras) when given."""
    due = cameras * window.frames_per_camera
    dropped = due - published
    return {
        "window_s": round(window.length_s, 3),
        "frames_due": due,
        "frames_published": published,
        "dropped": dropped,
        "dropped_pct": round(100.0 * dropped / due, 2),
        **({} if lost_between is None else {"lost_between": lost_between}),
        "published_fps": round(published / window.length_s, 1),
    }


def frames_lost_between(due_ts_lsl: Sequence[float], fps: float) -> int:
    """The frames missing between one camera's published frames (when they were due, or their
    capture timestamps, in any order): each gap longer than 1.5 periods counts round(gap x fps)
    - 1. A frame stamped up to a quarter period late or early counts nothing; nor do frames
    lost at the window's ends."""
    stamps = np.sort(np.asarray(due_ts_lsl, dtype=np.float64))
    periods = np.diff(stamps) * fps
    return int(np.sum(np.rint(periods[periods > 1.5]) - 1))


def worst_camera_latency(per_camera_ms: Iterable[tuple[float, float]]) -> dict:
    """(p50, p99) of each camera → the worst camera's p50 and p99 (each the max over cameras)."""
    pairs = [(p50, p99) for p50, p99 in per_camera_ms if p50 is not None and p99 is not None]
    if not pairs:
        return {"latency_p50_ms": None, "latency_p99_ms": None}
    return {"latency_p50_ms": round(max(p for p, _ in pairs), 1),
            "latency_p99_ms": round(max(p for _, p in pairs), 1)}


def camera_p99_spread(p99_by_camera: dict[str, float | None], worst: int = 3) -> dict | None:
    """How the cameras' p99 latencies spread (the row's latency_p99_ms is only their maximum,
    which grows with the camera count by itself): their median and 90th percentile, and the
    `worst` cameras with theirs, worst first; None without any."""
    known = {camera: p99 for camera, p99 in p99_by_camera.items() if p99 is not None}
    if not known:
        return None
    values = np.fromiter(known.values(), np.float64)
    ranked = sorted(known.items(), key=lambda item: (-item[1], item[0]))[:worst]
    return {"cameras": len(known), "median_ms": round(float(np.median(values)), 1),
            "p90_ms": round(float(np.percentile(values, 90)), 1),
            "worst": [[camera, round(p99, 1)] for camera, p99 in ranked]}


# ---------------------------------------------------------------------------------------------
# Faces against the ground truth
# ---------------------------------------------------------------------------------------------

Box = Sequence[float]  # x1, y1, x2, y2 in frame pixels

# Note [Box of a tracked face]: how facecast turns a face's mesh into the
# box MediaPipe's detector would draw. The baseline's results are meshes only, so their boxes are
# made the same way, with facecast's constants (tests/test_bench_accounting.py checks that they and
# mesh_box_px agree with models/face_mesh.py, which cannot be imported here: it needs torch).
TRACKED_BOX_CENTER_OFFSET = (0.016, 0.059)
TRACKED_BOX_SIDE = 0.924
NUM_MESH_POINTS = 468


def mesh_box_px(landmarks_px: np.ndarray) -> tuple[float, float, float, float]:
    """The detector-style box (x1, y1, x2, y2), in pixels, of one face's landmarks (≥468, 2+)."""
    mesh = np.asarray(landmarks_px, dtype=np.float64)[:NUM_MESH_POINTS, :2]
    low, high = mesh.min(axis=0), mesh.max(axis=0)
    side = float((high - low).max())
    centre = (low + high) / 2 + side * np.asarray(TRACKED_BOX_CENTER_OFFSET)
    half = side * TRACKED_BOX_SIDE / 2
    return (float(centre[0] - half), float(centre[1] - half),
            float(centre[0] + half), float(centre[1] + half))


def box_iou(a: Box, b: Box) -> float:
    inter_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    intersection = inter_w * inter_h
    union = ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - intersection)
    return intersection / union if union > 0 else 0.0


def match(truth_boxes: Sequence[Box], result_boxes: Sequence[Box]) -> list[tuple[int, int]]:
    """(truth index, result index) pairs with IoU >= MIN_IOU, best IoU first, each used once."""
    candidates = sorted(((box_iou(t, r), ti, ri) for ti, t in enumerate(truth_boxes)
                         for ri, r in enumerate(result_boxes)), reverse=True)
    pairs, used_truths, used_results = [], set(), set()
    for iou, ti, ri in candidates:
        if iou < MIN_IOU:
            break
        if ti not in used_truths and ri not in used_results:
            pairs.append((ti, ri))
            used_truths.add(ti)
            used_results.add(ri)
    return pairs


def width_bin(size_px: float) -> str:
    return next(label for low, high, label in SIZE_BINS_PX if low <= size_px < high)


@dataclass
class FaceTally:
    """True faces and the found ones, by face width, over published frames (Note [One
    definition for both sides]). `add` once per published frame; `merge` sums another's dict."""

    true: dict[str, int] = field(default_factory=dict)
    found: dict[str, int] = field(default_factory=dict)
    results: int = 0  # all result boxes, matched or not
    extra: int = 0  # result boxes that matched no true face
    frames: int = 0
    iou_sum: float = 0.0  # of the matched pairs: how close the found boxes are
    iou_min: float = 1.0

    def add(self, truths, result_boxes: Sequence[Box]) -> None:
        """truths: FaceTruth (box_px, size_px) of the frame; result_boxes: x1, y1, x2, y2."""
        pairs = match([t.box_px for t in truths], result_boxes)
        self.frames += 1
        self.results += len(result_boxes)
        self.extra += len(result_boxes) - len(pairs)
        for truth in truths:
            label = width_bin(truth.size_px)
            self.true[label] = self.true.get(label, 0) + 1
        for ti, ri in pairs:
            label = width_bin(truths[ti].size_px)
            self.found[label] = self.found.get(label, 0) + 1
            iou = box_iou(truths[ti].box_px, result_boxes[ri])
            self.iou_sum += iou
            self.iou_min = min(self.iou_min, iou)

    def as_dict(self) -> dict:
        return {"true": dict(self.true), "found": dict(self.found), "results": self.results,
                "extra": self.extra, "frames": self.frames, "iou_sum": self.iou_sum,
                "iou_min": self.iou_min}

    def merge(self, other: dict) -> None:
        for key in ("true", "found"):
            mine = getattr(self, key)
            for label, count in other[key].items():
                mine[label] = mine.get(label, 0) + count
        for key in ("results", "extra", "frames", "iou_sum"):
            setattr(self, key, getattr(self, key) + other[key])
        self.iou_min = min(self.iou_min, other["iou_min"])

    def summary(self) -> dict:
        """JSON: the counts, found/true overall and per width bin, faces per published frame."""
        true, found = sum(self.true.values()), sum(self.found.values())
        counts = self.as_dict()
        del counts["iou_sum"], counts["iou_min"]
        return {
            **counts,
            "matched_iou_mean": round(self.iou_sum / found, 3) if found else None,
            "matched_iou_min": round(self.iou_min, 3) if found else None,
            "found_of_true": f"{found}/{true}",
            "found_pct": round(100.0 * found / true, 1) if true else None,
            "found_pct_by_width": {label: round(100.0 * self.found.get(label, 0) / n, 1)
                                   for label, n in self.true.items()},
            "faces_per_frame": round(found / self.frames, 3) if self.frames else None,
            "true_faces_per_frame": round(true / self.frames, 3) if self.frames else None,
        }


# ---------------------------------------------------------------------------------------------
# Faces that appear (issue 24 item 5)
# ---------------------------------------------------------------------------------------------

# Note [A newcomer's delay]
#     A person who walks into view must be published within NEWCOMER_GOAL_MS of the first
#     frame that shows them. With a staged scene (Note [Staged scenes]) the ground truth says
#     which frame that is: the camera's capture clock's ticks (floor(t x fps - phase), Note
#     [Capture phases]; the synthetic sources capture half a period into each) are walked
#     through the window, and an appearance is a
#     tick whose frame shows the person where the tick before did not. Its delay is from that
#     first frame's capture time (the published frame's own where that frame was published, else
#     the middle of its tick) to the arrival of the first published frame, in that appearance,
#     whose results hold a box matching the person's (IoU >= MIN_IOU); frames late counts the
#     ticks between. An appearance whose person left again before any such frame is missed.
#     Only appearances that begin and end inside the window count, so that a late drain cannot
#     count one as missed.


@dataclass
class NewcomerTally:
    """Appearances of one person (`name`) and how late each was first published."""

    name: str
    delays_ms: list[float] = field(default_factory=list)
    frames_late: list[int] = field(default_factory=list)
    missed: int = 0

    def add_camera(self, truth, fps: float, window: Window, frame_ts: np.ndarray,
                   frame_boxes: Sequence[np.ndarray], first_arrival: np.ndarray) -> None:
        """One camera's published frames (capture timestamps in order, each frame's result boxes
        (n, 4), when each first reached an inlet) against `truth.faces_at`."""
        # The camera's own ticks (Note [Capture phases]; the live scene's phase is 0).
        phase = getattr(truth, "phase", 0.0)
        first_tick = math.ceil(window.start_ts_lsl * fps - phase)
        last_tick = math.floor(window.end_ts_lsl * fps - phase) - 1
        shown = [self._box(truth.faces_at((tick + 0.5 + phase) / fps))
                 for tick in range(first_tick - 1, last_tick + 1)]
        frame_ticks = np.floor(frame_ts * fps - phase).astype(np.int64)
        tick = first_tick
        while tick <= last_tick:
            index = tick - first_tick + 1
            if shown[index] is None or shown[index - 1] is not None:
                tick += 1
                continue
            leaves = next((t for t in range(tick + 1, last_tick + 1)
                           if shown[t - first_tick + 1] is None), None)
            if leaves is None:
                break  # still in view at the window's end: not counted
            frames = np.flatnonzero((frame_ticks >= tick) & (frame_ticks < leaves))
            own = frames[frame_ticks[frames] == tick]
            first_ts = frame_ts[own[0]] if len(own) else (tick + 0.5 + phase) / fps
            for frame in frames:
                person = self._box(truth.faces_at(frame_ts[frame]))
                if person is not None and match([person], frame_boxes[frame]):
                    self.delays_ms.append(float(first_arrival[frame] - first_ts) * 1e3)
                    self.frames_late.append(int(frame_ticks[frame] - tick))
                    break
            else:
                self.missed += 1
            tick = leaves

    def _box(self, truths) -> tuple[float, float, float, float] | None:
        return next((t.box_px for t in truths if t.name == self.name), None)

    def summary(self) -> dict:
        delays = np.asarray(self.delays_ms)
        found = len(delays)
        return {
            "person": self.name, "appearances": found + self.missed, "missed": self.missed,
            "delay_p50_ms": round(float(np.percentile(delays, 50)), 1) if found else None,
            "delay_p90_ms": round(float(np.percentile(delays, 90)), 1) if found else None,
            "delay_max_ms": round(float(delays.max()), 1) if found else None,
            "frames_late_p50": float(np.percentile(self.frames_late, 50)) if found else None,
            "frames_late_max": int(max(self.frames_late)) if found else None,
            "within_goal_pct": (round(100.0 * float((delays <= NEWCOMER_GOAL_MS).sum())
                                      / (found + self.missed), 1)
                                if found + self.missed else None),
        }
