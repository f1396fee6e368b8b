"""Small running statistics that workers report in their heartbeats: latency percentiles over a
recent window, and frame rates. Monotonic clock only (STYLE.md §6)."""

from __future__ import annotations

import collections
import time

import numpy as np

from facecast.shared.transport.messages import StageTiming


class LatencyWindow:
    """The last `size` durations of a stage, in milliseconds; p50/p99 on demand."""

    def __init__(self, size: int = 512) -> None:
        self._values_ms: collections.deque[float] = collections.deque(maxlen=size)
        self.count = 0

    def add_ms(self, value_ms: float) -> None:
        self._values_ms.append(value_ms)
        self.count += 1

    def timing(self) -> StageTiming | None:
        if not self._values_ms:
            return None
        p50, p99 = np.percentile(np.fromiter(self._values_ms, float), [50, 99])
        return StageTiming(p50_ms=round(float(p50), 3), p99_ms=round(float(p99), 3),
                           count=self.count)


class StageTimer:
    """Named LatencyWindows: `with timer.stage("mesh"): ...`."""

    def __init__(self) -> None:
        self.windows: dict[str, LatencyWindow] = {}

    def add_ms(self, name: str, value_ms: float) -> None:
        self.windows.setdefault(name, LatencyWindow()).add_ms(value_ms)

    def stage(self, name: str) -> _Timed:
        return _Timed(self, name)

    def timings(self) -> dict[str, StageTiming]:
        out = {}
        for name, window in self.windows.items():
            timing = window.timing()
            if timing is not None:
                out[name] = timing
        return out


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
