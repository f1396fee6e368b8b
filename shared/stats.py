"""Small running statistics that workers report in their heartbeats: latency percentiles over a
recent window, and frame rates. Monotonic clock only (STYLE.md §6)."""

from __future__ import annotations

import collections
import time

import numpy as np

from facecast.shared.transport.messages import StageTiming


class LatencyWindow:
    """The last `size` durations of a stage, in milliseconds; p50/p99 on demand.

    The values live in a ring of floats (not a deque), so that a heartbeat's percentiles read
    them where they are, and `window_timings` takes many windows' in one numpy call: the output
    worker reports one window per camera every heartbeat (HEARTBEAT_INTERVAL_S), besides its
    FrameHops, and the 11 ms that its windows took at 64 cameras (2-core VM) held up the
    results behind it (the "sent → received" hop's tail, Note [Latency accounted])."""

    def __init__(self, size: int = 512) -> None:
        self._values_ms = np.empty(size, float)
        self._next = 0
        self.count = 0

    def add_ms(self, value_ms: float) -> None:
        self._values_ms[self._next] = value_ms
        self._next = (self._next + 1) % self._values_ms.shape[0]
        self.count += 1

    def values_ms(self) -> np.ndarray:
        """The window's values, in no particular order (a view: read it before the next add)."""
        return self._values_ms[:min(self.count, self._values_ms.shape[0])]

    def timing(self) -> StageTiming | None:
        return window_timings([self])[0]


def window_timings(windows: list[LatencyWindow | None]) -> list[StageTiming | None]:
    """Each window's timing (None for an empty or absent one), the windows holding as many
    values taken together: one percentile call for a group rather than one per window."""
    out: list[StageTiming | None] = [None] * len(windows)
    by_length: dict[int, list[int]] = collections.defaultdict(list)
    for index, window in enumerate(windows):
        if window is not None and window.count:
            by_length[window.values_ms().shape[0]].append(index)
    for indices in by_length.values():
        timings = rows_timings(np.stack([windows[i].values_ms() for i in indices]),
                               [windows[i].count for i in indices])
        for i, timing in zip(indices, timings):
            out[i] = timing
    return out


def rows_timings(values_ms: np.ndarray, counts: list[int]) -> list[StageTiming]:
    """Each row's p50, p99 and mean (ms, as a heartbeat reports them), in one numpy call;
    `counts`: how many values each row's stage has seen in all."""
    p50, p99 = np.percentile(values_ms, [50, 99], axis=1)
    means = values_ms.mean(axis=1)
    return [StageTiming(p50_ms=round(float(p50[row]), 3), p99_ms=round(float(p99[row]), 3),
                        count=count, mean_ms=round(float(means[row]), 3))
            for row, count in enumerate(counts)]


class FrameHops:
    """Where each frame's latency went, hop by hop, over every camera's recent frames.

    Note [Latency accounted]
        A frame's latency, from its grab to its samples pushed to LSL, is the sum of hops, each
        between two stamps of ``pylsl.local_clock()`` (one clock for every process of the
        machine, the clock of the capture timestamp itself) taken where the frame passes:

            grab            the source's capture timestamp (FrameReady.capture_ts_lsl)
            published       capture sent the FrameReady (copy into the ring, checksum, upload)
            picked up       the measuring worker took it off the frame bus (queueing: its
                            previous batch, ZeroMQ)
            read            its checked copy was ready (the batch's copies, checksums, one sync)
            measured        the batch's models, tracking and identities were done
            sent            its FaceResults was built, to be encoded and sent (after the
                            batch's earlier frames' results)
            received        the output worker took it off the results socket (encoding,
                            ZeroMQ, queueing behind other cameras' results)
            pushed          its samples were pushed to LSL (Face, participants, pose)

        The output worker keeps every hop of the same frames (`add`), so the hops' means add up
        to the mean latency exactly, waits included; percentiles of hops do not add up and are
        there to show which hop has the tail. A frame from a sender that does not stamp (0) is
        left out. The stamps are in the messages (FrameReady.published_ts_lsl, FaceResults'
        *_ts_lsl) rather than in each process's own stage timer, which could only time its work
        and not the waits between processes.
    """

    HOPS = ("grab → published", "published → picked up", "picked up → read", "read → measured",
            "measured → sent", "sent → received", "received → pushed")
    TOTAL = "grab → pushed"
    # Frames of every camera together: 16 s of 32 cameras at 30 fps.
    WINDOW_FRAMES = 16384

    def __init__(self, size: int = WINDOW_FRAMES) -> None:
        # The stamps themselves, one row a frame, in a ring: a frame costs one row's write (the
        # output worker adds ~2,000 a second at 64 cameras); the hops are their differences,
        # taken when a heartbeat asks (`timings`).
        self._stamps = np.empty((size, len(self.HOPS) + 1), float)
        self._next = 0
        self.count = 0

    def add(self, stamps_ts_lsl: tuple[float, ...]) -> bool:
        """One frame's stamps, grab to pushed (len(HOPS) + 1 of them); False (and nothing kept)
        when one is missing (0)."""
        if len(stamps_ts_lsl) != len(self.HOPS) + 1:
            raise ValueError(f"{len(self.HOPS) + 1} stamps make a frame's hops, got "
                             f"{len(stamps_ts_lsl)}")
        if min(stamps_ts_lsl) <= 0:
            return False
        self._stamps[self._next] = stamps_ts_lsl
        self._next = (self._next + 1) % self._stamps.shape[0]
        self.count += 1
        return True

    def timings(self) -> dict[str, StageTiming]:
        """Each hop and the total, in the frame's order (names "hop N: a → b")."""
        if not self.count:
            return {}
        stamps = self._stamps[:min(self.count, self._stamps.shape[0])]
        hops_ms = np.empty((len(self.HOPS) + 1, stamps.shape[0]))
        hops_ms[:-1] = np.diff(stamps, axis=1).T * 1e3
        hops_ms[-1] = (stamps[:, -1] - stamps[:, 0]) * 1e3
        names = (*self.HOPS, self.TOTAL)
        return {f"hop {'total' if name == self.TOTAL else number}: {name}": timing
                for number, (name, timing) in enumerate(
                    zip(names, rows_timings(hops_ms, [self.count] * len(names))), start=1)}


class StageTimer:
    """Named LatencyWindows: `with timer.stage("mesh"): ...`."""

    def __init__(self) -> None:
        self.windows: dict[str, LatencyWindow] = {}

    def add_ms(self, name: str, value_ms: float) -> None:
        self.windows.setdefault(name, LatencyWindow()).add_ms(value_ms)

    def stage(self, name: str) -> _Timed:
        return _Timed(self, name)

    def timings(self) -> dict[str, StageTiming]:
        return {name: timing for name, timing
                in zip(self.windows, window_timings(list(self.windows.values())))
                if timing is not None}


class _Timed:
    def __init__(self, timer: StageTimer, name: str) -> None:
        self._timer, self._name = timer, name

    def __enter__(self) -> None:
        self._start_monotonic = time.monotonic()

    def __exit__(self, *exc_info: object) -> None:
        self._timer.add_ms(self._name, (time.monotonic() - self._start_monotonic) * 1e3)


class RateMeter:
    """Events per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self._stamps: collections.deque[float] = collections.deque()
        self.total = 0

    def tick(self, now_monotonic: float | None = None) -> None:
        now = time.monotonic() if now_monotonic is None else now_monotonic
        self._stamps.append(now)
        self.total += 1
        self._trim(now)

    def rate(self, now_monotonic: float | None = None) -> float:
        now = time.monotonic() if now_monotonic is None else now_monotonic
        self._trim(now)
        if len(self._stamps) < 2:
            return 0.0
        span_s = max(now - self._stamps[0], self._stamps[-1] - self._stamps[0])
        return (len(self._stamps) - 1) / span_s if span_s > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._stamps and now - self._stamps[0] > self.window_s:
            self._stamps.popleft()
