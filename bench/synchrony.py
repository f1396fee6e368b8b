"""What live synchrony costs (facecast.workers.output.synchrony; docs/synchrony.md), per update.

    python3 bench/synchrony.py                                   # measure here; print the table
    python3 bench/synchrony.py --json docs/benchmarks-synchrony.json

For 2, 4 and 8 participants (1, 6 and 28 pairs) and 3, 7 (the default signals) and 20 signals,
under the default settings (window 5 s, lags +-2 s, 10 Hz: 50 pairs x 41 lags per correlation)
and the largest the config allows (window 10 s, lags +-5 s, 30 Hz: 300 x 301). Every person is
a 30 fps camera whose frames are pushed as they would arrive between two updates (at the
default 4 Hz), then `update()` runs: resampling, every pair x signal x lag correlation, peaks,
aggregate, the sample. Times are CPU time of the calling thread (time.thread_time: a busy
machine's preemption does not count) and wall time, median and p95 over the repeats; "share of
a core" is the median CPU time x update_hz. The output worker does this in its own loop, so its
share of a core is what synchrony costs the daemon.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from facecast.workers.output.synchrony import SynchronyConfig, SynchronyEngine, allowed_signals

PEOPLE = (2, 4, 8)
SIGNAL_COUNTS = (3, 7, 20)
CAMERA_FPS = 30.0
SETTINGS = {
    "default (5 s, +-2 s, 10 Hz)": {},
    "largest (10 s, +-5 s, 30 Hz)": {"window_s": 10.0, "max_lag_s": 5.0, "rate_hz": 30.0},
}
T0_LSL = 10_000.0


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def measure(settings: dict, people: int, signal_count: int, repeats: int) -> dict:
    signals = list(allowed_signals()[:signal_count])
    config = SynchronyConfig(signals=signals, **settings)
    names = [f"p{index}" for index in range(people)]
    engine = SynchronyEngine(config, names)
    rng = np.random.default_rng(0)
    frame_s = 1.0 / CAMERA_FPS
    update_s = 1.0 / config.update_hz
    # Fill the block first, so that every timed update works on a full one.
    warm_s = config.block_samples / config.rate_hz + 1.0
    frames = np.arange(0.0, warm_s, frame_s)
    for name in names:
        engine.push(name, T0_LSL + frames, rng.normal(size=(frames.size, signal_count)))
    now = warm_s
    engine.update(T0_LSL + now)
    update_cpu, update_wall, push_cpu = [], [], []
    for _ in range(repeats):
        frames = np.arange(now, now + update_s, frame_s)
        chunks = [rng.normal(size=(frames.size, signal_count)) for _ in names]
        began = time.thread_time()
        for name, chunk in zip(names, chunks):
            for row in range(frames.size):  # one push per frame, as the output worker does
                engine.push(name, T0_LSL + frames[row:row + 1], chunk[row:row + 1])
        push_cpu.append((time.thread_time() - began) * 1e3)
        now += update_s
        began_cpu, began_wall = time.thread_time(), time.perf_counter()
        update = engine.update(T0_LSL + now)
        update_cpu.append((time.thread_time() - began_cpu) * 1e3)
        update_wall.append((time.perf_counter() - began_wall) * 1e3)
        assert all(row.present for row in update.rows)
    return {
        "people": people,
        "pairs": len(engine.pairs),
        "signals": signal_count,
        "window_samples": config.window_samples,
        "lags": 2 * config.lag_samples + 1,
        "channels": engine.channel_count,
        "update_hz": config.update_hz,
        "update_cpu_ms": {"median": statistics.median(update_cpu),
                          "p95": percentile(update_cpu, 0.95)},
        "update_wall_ms": {"median": statistics.median(update_wall),
                           "p95": percentile(update_wall, 0.95)},
        "push_cpu_ms_per_update": statistics.median(push_cpu),
        "share_of_a_core": (statistics.median(update_cpu) + statistics.median(push_cpu))
        * config.update_hz / 1000.0,
    }


def machine() -> dict:
    return {
        "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "load_average": list(os.getloadavg()),
    }


def table(results: dict) -> str:
    lines = []
    for setting, rows in results.items():
        lines.append(f"\n{setting}\n")
        lines.append("| people (pairs) | signals | channels | update CPU p50 / p95 | update wall "
                     "p50 / p95 | pushes per update (CPU) | share of a core at 4 Hz |")
        lines.append("|---|---|---|---|---|---|---|")
        for row in rows:
            lines.append(
                f"| {row['people']} ({row['pairs']}) | {row['signals']} | {row['channels']} | "
                f"{row['update_cpu_ms']['median']:.2f} / {row['update_cpu_ms']['p95']:.2f} ms | "
                f"{row['update_wall_ms']['median']:.2f} / {row['update_wall_ms']['p95']:.2f} ms | "
                f"{row['push_cpu_ms_per_update']:.2f} ms | {100 * row['share_of_a_core']:.1f}% |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=60, help="timed updates per row")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = {}
    for setting, fields in SETTINGS.items():
        rows = []
        for people in PEOPLE:
            for signal_count in SIGNAL_COUNTS:
                row = measure(fields, people, signal_count, args.repeats)
                rows.append(row)
                print(f"{setting}: {people} people, {signal_count} signals: update "
                      f"{row['update_cpu_ms']['median']:.2f} ms CPU", flush=True)
        results[setting] = rows
    print(table(results))
    if args.json:
        run = {"machine": machine(),
               "command": shlex.join(["python3", *sys.argv]),
               "camera_fps": CAMERA_FPS,
               "results": results}
        args.json.write_text(json.dumps({"runs": [run]}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
