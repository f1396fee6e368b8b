"""Frame transport benchmark: producer→consumer latency and throughput per transport.

    python bench/transport.py [--quick] [--out docs/benchmarks-transport.json]

For 1080p and 4K frames and 1, 2 and 4 consumer processes, measures
- cuda_ipc: CUDA ring (pinned staging, async H2D, IPC event), consumer reads the slot in place;
- shm: shared-memory ring, consumer copies the slot to its GPU (or CPU where there is none);
- pickle: the naive baseline, the frame pickled through a ZeroMQ PUB socket, then to the device.
Latency is from just before the producer touches the frame to the moment the consumer's data is
ready on its device (stream synchronised), on CLOCK_MONOTONIC, which all processes share. The
host-to-device copy of one frame, timed alone in the same run, is the reference that cuda_ipc's
overhead is stated against. A second scenario runs 32 producer processes at 30 fps 1080p into one
consumer that checks every frame's checksum. Prints a table; writes JSON (and the markdown table
to stdout for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESOLUTIONS = {"1080p": (1080, 1920, 3), "4K": (2160, 3840, 3)}


def producer(args) -> None:
    import zmq

    from facecast.shared.transport import FramePublisher

    shape = tuple(args.shape)
    rng = np.random.default_rng(args.seed)
    deck = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(5)]
    context = zmq.Context()
    if args.transport == "pickle":
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.SNDHWM, 8)
        socket.bind(f"ipc://{args.runtime_dir}/pickle-{args.camera}")
        publisher = None
    else:
        publisher = FramePublisher(context, args.runtime_dir, args.camera, transport=args.transport)
    time.sleep(args.start_delay_s)
    period_s = 1.0 / args.fps if args.fps > 0 else 0.0
    next_monotonic = time.monotonic()
    for index in range(args.frames):
        stamp = time.monotonic()
        if publisher is None:
            socket.send(pickle.dumps((index, stamp, deck[index % 5]), protocol=5))
        else:
            publisher.publish(deck[index % 5], stamp)
        if period_s:
            next_monotonic += period_s
            while (pause := next_monotonic - time.monotonic()) > 0:
                if publisher is not None:
                    publisher.serve_control()
                time.sleep(min(pause, 0.001))
    time.sleep(0.5)
    transport = publisher.status.transport if publisher else "pickle"
    if publisher:
        publisher.close()
    print(json.dumps({"transport": transport}), flush=True)


def consumer(args) -> None:
    import torch
    import zmq

    from facecast.shared.transport import FrameSubscriber

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    context = zmq.Context()
    latencies_s: list[float] = []
    cameras = [f"{args.camera}{i}" for i in range(args.cameras)] if args.cameras else [args.camera]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    received = 0
    first_monotonic = last_monotonic = None
    deadline = time.monotonic() + args.timeout_s
    if args.transport == "pickle":
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.RCVHWM, 8)
        socket.connect(f"ipc://{args.runtime_dir}/pickle-{args.camera}")
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        print(json.dumps({"ready": True}), flush=True)
        while time.monotonic() < deadline:
            if not socket.poll(200):
                if received:
                    break
                continue
            index, stamp, frame = pickle.loads(socket.recv())
            tensor = torch.from_numpy(frame).to(device)
            sync()
            now = time.monotonic()
            latencies_s.append(now - stamp)
            received += 1
            first_monotonic = first_monotonic or now
            last_monotonic = now
        counts = {}
    else:
        subscriber = FrameSubscriber(context, args.runtime_dir, cameras, device=device,
                                     checksum_every=args.checksum_every)
        print(json.dumps({"ready": True}), flush=True)
        idle_since = None
        while time.monotonic() < deadline:
            frames = subscriber.receive(timeout_ms=200)
            if not frames:
                if received and idle_since and time.monotonic() - idle_since > 1.0:
                    break
                idle_since = idle_since or time.monotonic()
                continue
            idle_since = None
            sync()
            now = time.monotonic()
            for frame in frames:
                latencies_s.append(now - frame.message.capture_ts_lsl)
                received += 1
            first_monotonic = first_monotonic or now
            last_monotonic = now
        counts = {}
        for status in subscriber.status.values():
            for key, value in status.counts.items():
                counts[key] = counts.get(key, 0) + value
        subscriber.close()
    duration_s = (last_monotonic - first_monotonic) if received > 1 else float("nan")
    lat_us = np.array(latencies_s[5:] or [float("nan")]) * 1e6  # skip warm-up (first map)
    print(json.dumps({
        "received": received, "p50_us": float(np.percentile(lat_us, 50)),
        "p99_us": float(np.percentile(lat_us, 99)),
        "fps": (received - 1) / duration_s if received > 1 else 0.0, "counts": counts,
    }), flush=True)


def h2d_reference_us(shape) -> dict:
    """One frame pinned→device copy and pageable→device copy, timed alone (median of 50)."""
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


def spawn(role: str, **options) -> subprocess.Popen:
    argv = [sys.executable, __file__, role]
    for key, value in options.items():
        argv += ["--" + key.replace("_", "-")] + ([str(v) for v in value] if isinstance(value, (tuple, list)) else [str(value)])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def last_json(proc: subprocess.Popen, timeout_s: float = 300) -> dict:
    out, _ = proc.communicate(timeout=timeout_s)
    return json.loads(out.strip().splitlines()[-1])


def run_case(transport, shape, consumers, frames, fps) -> dict:
    with tempfile.TemporaryDirectory(prefix="fcb-") as runtime_dir:
        readers = [spawn("consumer", runtime_dir=runtime_dir, transport=transport, timeout_s=120,
                         checksum_every=30) for _ in range(consumers)]
        for reader in readers:
            reader.stdout.readline()
        writer = spawn("producer", runtime_dir=runtime_dir, transport=transport, shape=shape,
                       frames=frames, fps=fps)
        produced = last_json(writer)
        results = [last_json(reader) for reader in readers]
    worst = max(results, key=lambda r: r["p99_us"])
    return {"transport": produced["transport"], "consumers": consumers,
            "p50_us": float(np.median([r["p50_us"] for r in results])), "p99_us": worst["p99_us"],
            "fps_min": min(r["fps"] for r in results),
            "received_min": min(r["received"] for r in results), "frames": frames,
            "mismatches": sum(r["counts"].get("checksum_mismatch", 0) for r in results)}


def run_many_cameras(cameras: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="fcb-") as runtime_dir:
        reader = spawn("consumer", runtime_dir=runtime_dir, transport="auto", camera="cam",
                       cameras=cameras, checksum_every=1, timeout_s=seconds + 60)
        reader.stdout.readline()
        writers = [spawn("producer", runtime_dir=runtime_dir, transport="auto", camera=f"cam{i}",
                         shape=RESOLUTIONS["1080p"], frames=int(seconds * 30), fps=30,
                         start_delay_s=2.0) for i in range(cameras)]
        transports = {last_json(w)["transport"] for w in writers}
        result = last_json(reader)
    expected = cameras * int(seconds * 30)
    return {"cameras": cameras, "expected": expected, "received": result["received"],
            "p50_us": result["p50_us"], "p99_us": result["p99_us"], "transports": sorted(transports),
            "counts": result["counts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="bench", choices=["bench", "producer", "consumer"])
    parser.add_argument("--runtime-dir", default="")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--camera", default="cam")
    parser.add_argument("--cameras", type=int, default=0)
    parser.add_argument("--shape", type=int, nargs=3, default=(1080, 1920, 3))
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--fps", type=float, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-delay-s", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument("--checksum-every", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="fewer frames (a smoke run)")
    parser.add_argument("--out", default="docs/benchmarks-transport.json")
    args = parser.parse_args()
    if args.role == "producer":
        return producer(args)
    if args.role == "consumer":
        return consumer(args)

    import torch

    frames = 60 if args.quick else 240
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    meta = {"date": datetime.date.today().isoformat(), "host": platform.node(),
            "cpu_count": __import__("os").cpu_count(), "gpu": gpu, "torch": torch.__version__,
            "frames_per_case": frames, "fps": 60}
    rows = []
    for resolution, shape in RESOLUTIONS.items():
        reference = h2d_reference_us(shape)
        for transport in ("cuda_ipc", "shm", "pickle"):
            for consumers in (1, 2, 4):
                row = run_case(transport, shape, consumers, frames, fps=60)
                row.update(resolution=resolution, requested=transport,
                           h2d_pinned_us=reference.get("pinned"))
                rows.append(row)
                print(json.dumps(row), flush=True)
    many = run_many_cameras(4 if args.quick else 32, 5 if args.quick else 20)
    print(json.dumps(many), flush=True)
    header = ("| frame | transport (used) | consumers | p50 µs | p99 µs | p99 − H2D µs | "
              "vs pickle p99 | min fps | mismatches |")
    print(header)
    print("|" + "---|" * 9)
    pickle_p99 = {(r["resolution"], r["consumers"]): r["p99_us"] for r in rows if r["requested"] == "pickle"}
    for row in rows:
        over = row["p99_us"] - row["h2d_pinned_us"] if row["h2d_pinned_us"] else float("nan")
        ratio = pickle_p99[(row["resolution"], row["consumers"])] / row["p99_us"]
        print(f"| {row['resolution']} | {row['requested']} ({row['transport']}) | "
              f"{row['consumers']} | {row['p50_us']:.0f} | {row['p99_us']:.0f} | {over:.0f} | "
              f"{ratio:.1f}× | {row['fps_min']:.1f} | {row['mismatches']} |")
    print(f"\n{many['cameras']} cameras × 1080p × 30 fps into one consumer (checksum on every "
          f"frame): received {many['received']}/{many['expected']}, p50 {many['p50_us']:.0f} µs, "
          f"p99 {many['p99_us']:.0f} µs, transports {many['transports']}, counts {many['counts']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "many_cameras": many}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
