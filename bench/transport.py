"""Frame transport benchmark: latency, where the time goes, and one consumer of many cameras.

    python bench/transport.py                            # the full run (GPU machine, < 4 min)
    python bench/transport.py --docs docs/benchmarks.md  # ... and rewrite its Transport section
    python bench/transport.py --small --out /tmp/t.json  # CPU smoke run: shm, pickle, small frames

On the offline GPU host: `. bench/gpu_host_env.sh && python3 bench/transport.py --docs
docs/benchmarks.md`. Cases run in order of importance and --budget-s (225 s) skips those that
would end later, saying so; a case that fails is reported and the run goes on.

Cases (each in fresh processes: its consumers and one producer, started together):
- cuda_ipc: CUDA ring (pinned staging, async H2D, IPC event), consumers copy the slot on the GPU (device to device) and check the copy;
- shm: shared-memory ring, consumers copy the slot to their GPU (or CPU where there is none);
- pickle: the naive baseline, the frame pickled through a ZeroMQ PUB socket, then to the device.
The ring transports run in two producer modes: "copy" (`publish(frame)`: the frame is copied
into the ring, what a capture source that returns arrays costs) and "staged" (`staging_view()` +
`publish_staged()`: the source made the frame in the ring's staging memory, Note [Staged writes];
the bench's stand-in for the decoder fills it before the clock starts).

Latency is from just before the producer hands the frame over to the moment the consumer's data
is ready on its device (stream synchronised), on CLOCK_MONOTONIC, which all processes share. The
host-to-device copy of one frame, timed alone in the same run, is the reference that the ring
transports' overhead is stated against. Every process also times each stage of the library's
path (Note [Stage methods]) by wrapping those methods on the instance, so the
library carries no timing code. The many-camera scenario runs N producer processes at 30 fps
into one consumer, in windows with different `checksum_every` values, after a warm-up; frames
are counted by their capture timestamp, so "expected" is exactly what the producers stamped in
the window. Prints tables; writes JSON and, with --docs, the Transport section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import pickle
import platform
import shlex
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
from docs_section import replace_section  # bench/docs_section.py (this folder is on sys.path)

RESOLUTIONS = {"small": (240, 320, 3), "720p": (720, 1280, 3), "1080p": (1080, 1920, 3),
               "4K": (2160, 3840, 3)}
DECK_SIZE = 5
WARMUP_FRAMES = 30  # per latency case, not counted: the ring is created and attached meanwhile
LATENCY_CHECKSUM_EVERY = 30  # config/default.toml's daemon.checksum_every

PRODUCER_STAGES = {  # method on the ring producer -> stage name (Note [Stage methods])
    "_claim": "claim slot",
    "_fill": "copy frame in",
    "_upload": "H2D issue (own device copy)",
    "_to_slot": "checksum + copy to slot + sync (GPU)",
    "_replay_frame_graph": "H2D + copy to slot + checksum as one graph + sync (GPU)",
    "_checksum": "checksum (host)",
}
HEADER_STAGES = {"begin_write": "generation odd", "end_write": "generation even"}
CONSUMER_STAGES = {
    "_precheck": "verdict (generation before)",
    "_wait_for_slot": "event wait",
    "_slot_tensor": "tensor (a copy of the slot)",
    "generation_unchanged": "generation after",
}
STAGE_ORDER = ["publish (total)", "claim slot", "copy frame in", "generation odd",
               "H2D issue (own device copy)", "checksum + copy to slot + sync (GPU)",
               "H2D + copy to slot + checksum as one graph + sync (GPU)",
               "checksum (host)", "generation even", "encode + send",
               "receive + decode", "verdict (generation before)",
               "event wait", "tensor (view or copy)", "checksum (queue on GPU / host)",
               "settle (one host sync per batch)", "generation after", "read batch"]


# ================================================================================================
# Stage timing: wrappers put on library methods, only in benchmark processes
# ================================================================================================


class StageClock:
    """Durations of named stages, in ns, recorded while `enabled` (inside a measuring window)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[int]] = collections.defaultdict(list)
        self.enabled = False

    def wrap(self, owner, attribute: str, stage: str) -> None:
        original = getattr(owner, attribute, None)
        if original is None or getattr(original, "_bench_stage", None):
            return
        samples = self.samples[stage]
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            started = clock()
            try:
                return original(*args, **kwargs)
            finally:
                samples.append(clock() - started)

        timed._bench_stage = stage
        setattr(owner, attribute, timed)

    def wrap_all(self, owner, stages: dict[str, str]) -> None:
        if owner is None or owner.__dict__.get("_bench_timed"):
            return
        for attribute, stage in stages.items():
            self.wrap(owner, attribute, stage)
        owner._bench_timed = True

    def add(self, stage: str, duration_ns: int) -> None:
        if self.enabled:
            self.samples[stage].append(duration_ns)

    def summary(self) -> dict:
        result = {}
        for stage, values in self.samples.items():
            if values:
                us = np.asarray(values, dtype=np.float64) / 1000.0
                result[stage] = {"p50_us": float(np.percentile(us, 50)),
                                 "p99_us": float(np.percentile(us, 99)), "n": len(values)}
        return result


def in_windows(stamp: float, windows: list) -> int | None:
    for index, window in enumerate(windows):
        if window[0] <= stamp < window[1]:
            return index
    return None


def read_start(stream) -> dict:
    line = stream.readline()
    if not line:
        raise SystemExit("no start message: the bench went away")
    return json.loads(line)


# ================================================================================================
# Producer process
# ================================================================================================


def producer(args) -> None:
    import zmq

    shape = tuple(args.shape)
    rng = np.random.default_rng(args.seed)
    deck = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(DECK_SIZE)]
    context = zmq.Context()
    clock = StageClock()
    publisher = socket = None
    if args.transport == "pickle":
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.SNDHWM, 8)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(f"ipc://{args.runtime_dir}/pickle-{args.camera}")
    else:
        from facecast.shared.transport.publisher import FramePublisher

        publisher = FramePublisher(context, args.runtime_dir, args.camera, transport=args.transport)
        clock.wrap_all(publisher, {"_send": "encode + send"})
    print(json.dumps({"ready": True}), flush=True)
    start = read_start(sys.stdin)
    windows = start["windows"]
    period_s = 1.0 / start["fps"]
    first_monotonic = start["start_at"] + start.get("phase", 0.0) * period_s
    published = [0] * len(windows)
    staged = args.mode == "staged"
    for index in range(start["frames"]):
        due = first_monotonic + index * period_s
        while (pause := due - time.monotonic()) > 0:
            if publisher is not None:
                publisher.serve_control()
            time.sleep(min(pause, 0.001))
        frame = deck[index % DECK_SIZE]
        if staged:
            # The stand-in for a decoder that writes into the ring's staging memory: not timed.
            np.copyto(publisher.staging_view(shape), frame)
        stamp = time.monotonic()
        window = in_windows(stamp, windows)
        clock.enabled = window is not None
        started = time.perf_counter_ns()
        if socket is not None:
            socket.send(pickle.dumps((index, stamp, frame), protocol=5))
        elif staged:
            publisher.publish_staged(stamp)
        else:
            publisher.publish(frame, stamp)
        clock.add("publish (total)", time.perf_counter_ns() - started)
        if window is not None:
            published[window] += 1
        if publisher is not None and publisher.producer is not None:
            clock.wrap_all(publisher.producer, PRODUCER_STAGES)
            clock.wrap_all(publisher.producer.header, HEADER_STAGES)
    clock.enabled = False
    linger_until = time.monotonic() + 1.0
    while time.monotonic() < linger_until:  # consumers may still ask for descriptions
        if publisher is not None:
            publisher.serve_control()
        time.sleep(0.01)
    transport = publisher.status.transport if publisher else "pickle"
    if publisher:
        publisher.close()
    print(json.dumps({"transport": transport, "published": published,
                      "stages": clock.summary()}), flush=True)


# ================================================================================================
# Consumer process
# ================================================================================================


def consumer(args) -> None:
    import torch
    import zmq

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        from facecast.shared.transport.cuda_driver import wait_by_blocking

        wait_by_blocking(0)  # as a daemon worker waits (workers/inference/pipelines.py), pickle
        included
    context = zmq.Context()
    cameras = args.cameras.split(",")
    clock = StageClock()
    start: dict = {}

    def wait_for_start() -> None:
        start.update(read_start(sys.stdin))

    threading.Thread(target=wait_for_start, daemon=True).start()
    subscriber = socket = None
    if args.transport == "pickle":
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.RCVHWM, 8)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"ipc://{args.runtime_dir}/pickle-{cameras[0]}")
        socket.setsockopt(zmq.SUBSCRIBE, b"")
    else:
        from facecast.shared.transport import rings
        from facecast.shared.transport.subscriber import FrameSubscriber

        subscriber = FrameSubscriber(context, args.runtime_dir, cameras, device=device,
                                     checksum_every=args.checksum_every)
        clock.wrap_all(subscriber, {"_drain": "receive + decode", "_read_all": "read batch"})
        clock.wrap(rings, "settle", "settle (one host sync per batch)")
        # A batch's checksums, together where its frames allow (Note [Frames of a batch
        # checksummed together]).
        clock.wrap(rings, "start_checksums", "checksum (queue on GPU / host)")
    print(json.dumps({"ready": True}), flush=True)

    latencies_us: list[list[float]] = []
    received: list[int] = []
    arrival: list[list[float]] = []
    snapshots: list[dict] = []
    boundary = 0  # index into the windows' start/end times, in order
    give_up = time.monotonic() + args.timeout_s
    while time.monotonic() < give_up:
        if start and not latencies_us:
            windows = start["windows"]
            latencies_us = [[] for _ in windows]
            received = [0] * len(windows)
            arrival = [[] for _ in windows]
            times = [t for window in windows for t in window[:2]]
        if socket is not None:
            items = []
            if socket.poll(100):
                index, stamp, frame = pickle.loads(socket.recv())
                torch.from_numpy(frame).to(device)
                items = [stamp]
        else:
            frames = subscriber.receive(timeout_ms=100)
            items = [frame.message.capture_ts_lsl for frame in frames]
            for reader in subscriber.readers.values():
                # shm readers have no event to wait for: leave that row empty for them
                clock.wrap_all(reader, CONSUMER_STAGES if reader.description.transport == "cuda_ipc" else {
                    k: v for k, v in CONSUMER_STAGES.items() if k != "_wait_for_slot"})
        if items:
            sync()
        now = time.monotonic()
        if not latencies_us:
            continue
        for stamp in items:
            window = in_windows(stamp, windows)
            if window is not None:
                latencies_us[window].append((now - stamp) * 1e6)
                received[window] += 1
                arrival[window].append(now)
        # Window boundaries, by this process's clock: stage timing on/off, checksum rate,
        # verdict counts (a snapshot at each start and end).
        while boundary < len(times) and now >= times[boundary]:
            window_index, edge = divmod(boundary, 2)
            is_start = edge == 0
            if subscriber is not None:
                snapshots.append(_total_counts(subscriber))
                if is_start:
                    every = windows[window_index][2]
                    subscriber.checksum_every = every
                    for reader in subscriber.readers.values():
                        reader.checksum_every = every
            clock.enabled = is_start
            boundary += 1
        if boundary == len(times) and now >= times[-1] + args.drain_s:
            break
    results = []
    for index in range(len(latencies_us)):
        lat = np.asarray(latencies_us[index] or [math.nan])
        span = (arrival[index][-1] - arrival[index][0]) if len(arrival[index]) > 1 else math.nan
        counts = {}
        if len(snapshots) >= 2 * index + 2:
            before, after = snapshots[2 * index], snapshots[2 * index + 1]
            counts = {k: after.get(k, 0) - before.get(k, 0) for k in after
                      if after.get(k, 0) - before.get(k, 0)}
        results.append({"received": received[index],
                        "p50_us": float(np.percentile(lat, 50)),
                        "p99_us": float(np.percentile(lat, 99)),
                        "fps": (received[index] - 1) / span if span and span > 0 else 0.0,
                        "counts": counts})
    total = _total_counts(subscriber) if subscriber is not None else {}
    if subscriber is not None:
        subscriber.close()
    print(json.dumps({"windows": results, "counts_total": total, "stages": clock.summary(),
                      "device": str(device)}), flush=True)


def _total_counts(subscriber) -> dict:
    counts: dict[str, int] = {}
    for status in subscriber.status.values():
        for key, value in status.counts.items():
            counts[key] = counts.get(key, 0) + value
    return counts


# ================================================================================================
# The bench: spawns the processes above
# ================================================================================================


def h2d_reference_us(shape) -> dict:
    """One frame pinned→device and pageable→device copy, timed alone (median of 50)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    host = torch.empty(int(np.prod(shape)), dtype=torch.uint8).pin_memory()
    pageable = torch.empty(int(np.prod(shape)), dtype=torch.uint8)
    device = torch.empty_like(host, device="cuda")
    result = {}
    for name, source in (("pinned", host), ("pageable", pageable)):
        times = []
        for _ in range(50):
            torch.cuda.synchronize()
            start = time.perf_counter()
            device.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result[name] = float(np.median(times) * 1e6)
    return result


_spawned: list[subprocess.Popen] = []


def spawn(role: str, **options) -> subprocess.Popen:
    argv = [sys.executable, __file__, role]
    for key, value in options.items():
        values = value if isinstance(value, (tuple, list)) else [value]
        argv += ["--" + key.replace("_", "-")] + [str(v) for v in values]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _spawned.append(proc)
    return proc


def kill_leftovers() -> None:
    """After a case that failed: its other processes would wait for a start or a peer forever."""
    while _spawned:
        proc = _spawned.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def wait_ready(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        line = proc.stdout.readline()
        if json.loads(line or "{}").get("ready") is not True:
            raise RuntimeError(f"a bench process did not start (exit {proc.poll()}): {line!r}")


def send_start(procs: list[subprocess.Popen], message: dict, **extra) -> None:
    for proc in procs:
        proc.stdin.write(json.dumps({**message, **extra}) + "\n")
        proc.stdin.flush()  # communicate() closes it later


def last_json(proc: subprocess.Popen, timeout_s: float = 300) -> dict:
    out, _ = proc.communicate(timeout=timeout_s)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"a bench process failed (exit {proc.returncode}): {out[-2000:]}")
    return json.loads(lines[-1])


def run_case(transport, mode, shape, consumers, frames, fps) -> dict:
    with tempfile.TemporaryDirectory(prefix="fcb-") as runtime_dir:
        readers = [spawn("consumer", runtime_dir=runtime_dir, transport=transport, cameras="cam",
                         checksum_every=LATENCY_CHECKSUM_EVERY) for _ in range(consumers)]
        writer = spawn("producer", runtime_dir=runtime_dir, transport=transport, mode=mode,
                       camera="cam", shape=shape)
        wait_ready(readers + [writer])
        start_at = time.monotonic() + 0.3
        window = [start_at + (WARMUP_FRAMES - 0.5) / fps,
                  start_at + (WARMUP_FRAMES + frames + 30) / fps, LATENCY_CHECKSUM_EVERY]
        message = {"start_at": start_at, "fps": fps, "windows": [window]}
        send_start(readers, message)
        send_start([writer], message, frames=WARMUP_FRAMES + frames)
        produced = last_json(writer)
        results = [last_json(reader) for reader in readers]
    seen = [r["windows"][0] for r in results]
    return {"transport": produced["transport"], "mode": mode, "consumers": consumers,
            "frames": produced["published"][0],
            "p50_us": float(np.median([s["p50_us"] for s in seen])),
            "p99_us": max(s["p99_us"] for s in seen),
            "fps_min": min(s["fps"] for s in seen),
            "received_min": min(s["received"] for s in seen),
            "mismatches": sum(r["counts_total"].get("checksum_mismatch", 0) for r in results),
            "producer_stages": produced["stages"], "consumer_stages": results[0]["stages"],
            "consumer_device": results[0]["device"]}


def run_many_cameras(cameras, shape, fps, window_s, checksum_rates, mode, transport) -> dict:
    names = [f"cam{i}" for i in range(cameras)]
    with tempfile.TemporaryDirectory(prefix="fcb-") as runtime_dir:
        reader = spawn("consumer", runtime_dir=runtime_dir, transport=transport,
                       cameras=",".join(names), checksum_every=checksum_rates[0], timeout_s=600)
        writers = [spawn("producer", runtime_dir=runtime_dir, transport=transport, mode=mode,
                         camera=name, shape=shape) for name in names]
        started = time.monotonic()
        wait_ready([reader] + writers)
        startup_s = time.monotonic() - started
        start_at = time.monotonic() + 0.5
        warmup_s, gap_s = 3.0, 0.5
        windows = []
        for index, rate in enumerate(checksum_rates):
            begin = start_at + warmup_s + index * (window_s + gap_s)
            windows.append([begin, begin + window_s, rate])
        frames = int(math.ceil((windows[-1][1] - start_at) * fps)) + 1
        message = {"start_at": start_at, "fps": fps, "windows": windows}
        send_start([reader], message)
        for index, writer in enumerate(writers):
            send_start([writer], message, frames=frames, phase=index / cameras)
        produced = [last_json(writer) for writer in writers]
        seen = last_json(reader)
    rows = []
    for index, rate in enumerate(checksum_rates):
        expected = sum(p["published"][index] for p in produced)
        window = seen["windows"][index]
        rows.append({"checksum_every": rate, "expected": expected, "received": window["received"],
                     "p50_us": window["p50_us"], "p99_us": window["p99_us"],
                     "counts": window["counts"]})
    return {"cameras": cameras, "shape": list(shape), "fps": fps, "window_s": window_s,
            "mode": mode, "transports": sorted({p["transport"] for p in produced}),
            "startup_s": startup_s, "windows": rows, "counts_total": seen["counts_total"],
            "consumer_stages": seen["stages"],
            "producer_stages_cam0": produced[0]["stages"]}


# ================================================================================================
# Reporting
# ================================================================================================


def machine() -> dict:
    import torch

    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "cuda_runtime": torch.version.cuda or "",
            "gpu": "none", "driver": ""}
    try:
        import zmq

        info["pyzmq"] = zmq.__version__
    except ImportError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            try:
                import pynvml

                pynvml.nvmlInit()
                info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            except Exception:
                pass
    return info


def _fmt(value, digits=0) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def latency_table(rows: list[dict]) -> list[str]:
    pickle_p99 = {(r["resolution"], r["consumers"]): r["p99_us"] for r in rows
                  if r["requested"] == "pickle"}
    lines = ["| frame | transport (used) | producer | consumers | p50 µs | p99 µs | p99 − H2D µs "
             "| vs pickle p99 | min fps | mismatches |", "|" + "---|" * 10]
    for row in rows:
        h2d = row.get("h2d_pinned_us")
        over = row["p99_us"] - h2d if h2d else None
        base = pickle_p99.get((row["resolution"], row["consumers"]))
        ratio = f"{base / row['p99_us']:.1f}×" if base and row["p99_us"] > 0 else "–"
        producer_mode = "–" if row["requested"] == "pickle" else row["mode"]
        lines.append(f"| {row['resolution']} | {row['requested']} ({row['transport']}) | "
                     f"{producer_mode} | {row['consumers']} | {_fmt(row['p50_us'])} | "
                     f"{_fmt(row['p99_us'])} | {_fmt(over)} | {ratio} | {_fmt(row['fps_min'], 1)} "
                     f"| {row['mismatches']} |")
    return lines


def stage_table(rows: list[dict], resolution: str) -> list[str]:
    cases = [r for r in rows if r["resolution"] == resolution and r["consumers"] == 1
             and r["requested"] != "pickle"]
    if not cases:
        return []
    header = "| stage (per frame unless said) | " + " | ".join(
        f"{r['requested']} {r['mode']}" for r in cases) + " |"
    lines = [header, "|" + "---|" * (len(cases) + 1)]
    for stage in STAGE_ORDER:
        cells = []
        for row in cases:
            stats = row["producer_stages"].get(stage) or row["consumer_stages"].get(stage)
            cells.append(f"{stats['p50_us']:.1f} / {stats['p99_us']:.1f}" if stats else "–")
        if any(cell != "–" for cell in cells):
            side = "producer" if STAGE_ORDER.index(stage) < STAGE_ORDER.index(
                "receive + decode") else "consumer"
            lines.append(f"| {side}: {stage} | " + " | ".join(cells) + " |")
    return lines


def many_table(many: dict) -> list[str]:
    lines = ["| checksum every | expected | received | share | skipped | overwritten | "
             "awaiting ring | mismatches | p50 µs | p99 µs |", "|" + "---|" * 10]
    for row in many["windows"]:
        counts = row["counts"]
        share = row["received"] / row["expected"] if row["expected"] else math.nan
        lines.append(f"| {row['checksum_every']} | {row['expected']} | {row['received']} | "
                     f"{share:.1%} | {counts.get('skipped', 0)} | {counts.get('overwritten', 0)} "
                     f"| {counts.get('awaiting_ring', 0)} | {counts.get('checksum_mismatch', 0)} | "
                     f"{_fmt(row['p50_us'])} | {_fmt(row['p99_us'])} |")
    return lines


def goals(rows: list[dict], many: dict | None) -> list[str]:
    lines = []
    for mode in ("staged", "copy"):
        row = next((r for r in rows if r["resolution"] == "1080p" and r["requested"] == "cuda_ipc"
                    and r["transport"] == "cuda_ipc" and r["mode"] == mode
                    and r["consumers"] == 1), None)
        if row and row.get("h2d_pinned_us"):
            over = row["p99_us"] - row["h2d_pinned_us"]
            lines.append(f"- (a) cuda_ipc, producer {mode}, 1080p, one consumer: p99 − H2D = "
                         f"{over:.0f} µs against a goal of ≤ 100 µs: "
                         f"**{'met' if over <= 100 else 'not met'}**.")
    if many:
        for row in many["windows"]:
            missed = row["expected"] - row["received"]
            mismatches = row["counts"].get("checksum_mismatch", 0)
            kept_up = row["expected"] > 0 and missed <= 0.001 * row["expected"]
            lines.append(
                f"- (b) {many['cameras']} cameras × {many['shape'][1]}x{many['shape'][0]} × "
                f"{many['fps']:.0f} fps into one consumer, checksum on 1 frame in "
                f"{row['checksum_every']}: {row['received']} of {row['expected']} frames "
                f"({row['received'] / max(1, row['expected']):.1%}), {mismatches} mismatches: "
                f"**{'met' if kept_up and mismatches == 0 else 'not met'}** (kept up = at most "
                "0.1% of the window's frames not received).")
    return lines


def markdown(result: dict, command: str, raw_path: str) -> str:
    meta, rows, many = result["meta"], result["rows"], result.get("many_cameras")
    h2d = {r["resolution"]: r.get("h2d_pinned_us") for r in rows}
    h2d_text = ", ".join(f"{name} {value:.0f} µs" for name, value in h2d.items() if value)
    pageable = ", ".join(f"{name} {value:.0f} µs" for name, value in
                         result.get("h2d_pageable_us", {}).items() if value)
    out = ["## Frame transport (`bench/transport.py`)", "",
           f"Run {meta['date']} on `{meta['host']}`: {meta['gpu']} (driver {meta['driver'] or '?'}, "
           f"CUDA runtime {meta['cuda_runtime'] or '–'}), {meta.get('cpu', 'CPU ?')}, "
           f"{meta['cpu_count']} CPU cores; Python {meta['python']}, torch {meta['torch']}, "
           f"numpy {meta['numpy']}, pyzmq {meta.get('pyzmq', '?')}. Command: `{command}` "
           f"({meta['elapsed_s']:.0f} s). Raw figures: `{raw_path}`.", "",
           f"Latency: from just before the producer hands the frame over to the consumer's data "
           f"ready on its device (stream synchronised), CLOCK_MONOTONIC across processes; "
           f"{meta['frames_per_case']} random frames per case at {meta['fps']:.0f} fps after "
           f"{WARMUP_FRAMES} warm-up frames; consumers check 1 frame in "
           f"{LATENCY_CHECKSUM_EVERY} (the default). Producer \"copy\": `publish(frame)` copies a "
           "finished frame into the ring; \"staged\": the frame was made in the ring's staging "
           "memory (`staging_view()` + `publish_staged()`), the clock starts after it is there. "
           f"\"p99 − H2D\" subtracts one pinned host→device copy of the frame timed alone in the "
           f"same run ({h2d_text or 'no GPU'}; pageable: {pageable or '–'}). Ratio: the pickle "
           "baseline's p99 (frame pickled through ZeroMQ, then copied to the device), same frame "
           "size and consumer count, measured in this run, divided by this row's p99.", ""]
    out += latency_table(rows)
    for resolution in dict.fromkeys(r["resolution"] for r in rows):
        table = stage_table(rows, resolution)
        if table:
            out += ["", f"Where the time goes, {resolution}, one consumer: p50 / p99 in µs of each "
                    "stage (Note [Stage methods]), timed in the processes "
                    "themselves. \"claim slot\" includes \"generation odd\" on shm; "
                    "\"receive + decode\", \"read batch\" (all of a batch's reading, the stages "
                    "under it included), \"checksum\" and \"settle\" are per `receive()` call, "
                    "which with one camera is one frame.", ""]
            out += table
    if many:
        out += ["", f"{many['cameras']} cameras × {many['shape'][1]}x{many['shape'][0]} × "
                f"{many['fps']:.0f} fps into one consumer (producers: {many['mode']}, transports "
                f"{', '.join(many['transports'])}), {many['window_s']:.0f} s per checksum rate "
                f"after a 3 s warm-up; processes started in {many['startup_s']:.0f} s. Expected = "
                "frames the producers stamped inside the window; received = frames the consumer "
                "accepted (checks passed) with a capture stamp inside it; verdict counts are by "
                "arrival time.", ""]
        out += many_table(many)
    if meta.get("skipped_cases"):
        out += ["", f"Not measured (to stay within {meta['budget_s']:.0f} s, or failed): "
                + "; ".join(meta["skipped_cases"]) + "."]
    out += ["", "Goals of issue 2:", ""] + (goals(rows, many) or ["- not measured in this run"])
    out += ["", "The figures before staged writes, batched reads and the stage timing (same "
            "machine, 2026-11-21): `git show 24bb11d:docs/benchmarks.md`."]
    return "\n".join(_wrap(line) for line in out) + "\n"


def _wrap(line: str) -> str:
    """Prose at the width of the hand-written docs; tables and headings as they are."""
    if line.startswith(("|", "#")) or len(line) <= 100:
        return line
    indent = "  " if line.startswith("- ") else ""
    return textwrap.fill(line, width=100, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)


def parse_list(text: str, kind=str) -> list:
    return [kind(item) for item in text.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="bench", choices=["bench", "producer", "consumer"])
    # processes
    parser.add_argument("--runtime-dir", default="")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--mode", default="copy", choices=["copy", "staged"])
    parser.add_argument("--camera", default="cam")
    parser.add_argument("--cameras", default="cam")
    parser.add_argument("--shape", type=int, nargs=3, default=(1080, 1920, 3))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=180)
    parser.add_argument("--drain-s", type=float, default=1.0)
    parser.add_argument("--checksum-every", type=int, default=LATENCY_CHECKSUM_EVERY)
    # the bench
    parser.add_argument("--small", action="store_true",
                        help="CPU smoke run: small frames, shm and pickle, 4 cameras")
    parser.add_argument("--resolutions", default="1080p,4K")
    parser.add_argument("--transports", default="cuda_ipc,shm,pickle")
    parser.add_argument("--modes", default="copy,staged")
    parser.add_argument("--consumers-list", default="1,4", help="consumer counts (1080p; 1 above)")
    parser.add_argument("--frames", type=int, default=180)
    parser.add_argument("--fps", type=float, default=60)
    parser.add_argument("--many-cameras", type=int, default=32, help="0: skip the scenario")
    parser.add_argument("--many-resolution", default="1080p")
    parser.add_argument("--many-fps", type=float, default=30)
    parser.add_argument("--many-window-s", type=float, default=10)
    parser.add_argument("--many-checksum", default="1,30")
    parser.add_argument("--many-mode", default="copy", choices=["copy", "staged"])
    parser.add_argument("--out", default="docs/benchmarks-transport.json")
    parser.add_argument("--docs", default="", help="rewrite this file's Transport section")
    parser.add_argument("--budget-s", type=float, default=225,
                        help="skip the least important cases that would end the run later")
    parser.add_argument("--from-json", default="",
                        help="measure nothing: rewrite --docs from this earlier run's JSON")
    if "--small" in sys.argv[1:]:  # its values are defaults: other flags still win
        parser.set_defaults(resolutions="small", transports="shm,pickle", consumers_list="1,2",
                            frames=120, many_cameras=4, many_resolution="small", many_window_s=3)
    args = parser.parse_args()
    if args.role == "producer":
        return producer(args)
    if args.role == "consumer":
        return consumer(args)

    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        text = markdown(result, result["meta"]["command"], args.from_json)
        print(text)
        if args.docs:
            replace_section(Path(args.docs), "## Frame transport", text)
        return

    import torch

    started = time.monotonic()
    gpu = torch.cuda.is_available()
    transports = [t for t in parse_list(args.transports) if gpu or t != "cuda_ipc"]
    modes = parse_list(args.modes)
    resolutions = parse_list(args.resolutions)
    consumer_counts = parse_list(args.consumers_list, int)
    meta = {**machine(), "frames_per_case": args.frames, "fps": args.fps,
            "budget_s": args.budget_s}
    references = {name: h2d_reference_us(RESOLUTIONS[name]) for name in resolutions}
    # In order of importance, so that a run cut short by --budget-s keeps what matters most:
    # the first resolution with one consumer, the many-camera scenario, more consumers, the rest.
    plan = [("case", resolutions[0], consumer_counts[0])]
    if args.many_cameras:
        plan.append(("many", None, None))
    plan += [("case", resolutions[0], n) for n in consumer_counts[1:]]
    plan += [("case", name, consumer_counts[0]) for name in resolutions[1:]]
    rows, skipped, many = [], [], None
    case_s = 12.0  # a first guess at one case's wall time; then the longest seen
    for kind, resolution, consumers in plan:
        if kind == "many":
            checksum_rates = parse_list(args.many_checksum, int)
            estimate = 30 + 4 + len(checksum_rates) * (args.many_window_s + 0.5) + 3
            if time.monotonic() - started + estimate > args.budget_s:
                skipped.append(f"{args.many_cameras} cameras")
                continue
            try:
                many = run_many_cameras(args.many_cameras, RESOLUTIONS[args.many_resolution],
                                        args.many_fps, args.many_window_s, checksum_rates,
                                        args.many_mode, "auto" if gpu else "shm")
            except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
                skipped.append(f"{args.many_cameras} cameras (failed: {str(exc)[:300]})")
                print(f"many cameras failed: {exc}", file=sys.stderr, flush=True)
                continue
            finally:
                kill_leftovers()
            print(json.dumps({k: v for k, v in many.items() if "stages" not in k}), flush=True)
            continue
        for transport in transports:
            for mode in (["copy"] if transport == "pickle" else modes):
                name = f"{resolution} {transport} {mode} x{consumers}"
                if time.monotonic() - started + case_s > args.budget_s:
                    skipped.append(name)
                    continue
                case_started = time.monotonic()
                try:
                    row = run_case(transport, mode, RESOLUTIONS[resolution], consumers,
                                   args.frames, args.fps)
                except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
                    skipped.append(f"{name} (failed: {str(exc)[:300]})")
                    print(f"case {name} failed: {exc}", file=sys.stderr, flush=True)
                    continue
                finally:
                    kill_leftovers()
                case_s = max(case_s if rows else 0.0, time.monotonic() - case_started)
                row.update(resolution=resolution, requested=transport,
                           h2d_pinned_us=references[resolution].get("pinned"))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if "stages" not in k}), flush=True)
    order = {name: index for index, name in enumerate(resolutions)}
    rows.sort(key=lambda r: (order[r["resolution"]], r["consumers"]))  # stable: keeps transports
    pageable = {name: ref.get("pageable") for name, ref in references.items()}
    meta["skipped_cases"] = skipped
    meta["elapsed_s"] = time.monotonic() - started
    meta["command"] = ("python3 bench/transport.py "
                       + " ".join(shlex.quote(a) for a in sys.argv[1:])).strip()
    result = {"meta": meta, "rows": rows, "h2d_pageable_us": pageable, "many_cameras": many}
    text = markdown(result, meta["command"], args.out)
    print()
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.docs:
        replace_section(Path(args.docs), "## Frame transport", text)


if __name__ == "__main__":
    main()
