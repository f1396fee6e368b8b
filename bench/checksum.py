"""What a frame's checksum costs (Note [Frame checksum]), per frame, in one run.

    python bench/checksum.py                          # measure here; print the tables
    python bench/checksum.py --json docs/benchmarks-checksum.json --docs docs/benchmarks.md
    python bench/checksum.py --no-run --merge RUN.json --json docs/benchmarks-checksum.json \\
        --docs docs/benchmarks.md                     # add a run made elsewhere (the GPU host)

On the offline GPU host: `. bench/gpu_host_env.sh && python3 bench/checksum.py --json
$OUT/checksum-gpu.json`.

For 1080p and 4K BGR frames, on the host (numpy: the shm producer, the CUDA producer from its
staged bytes, CPU consumers) and, where there is a GPU, on it (torch: CUDA ring consumers and shm
consumers that copied the frame to their GPU), three settings: none (no check: 0 by definition),
sampled (the old default: 4096 sampled bytes on 1 frame in 30, shown per checked frame and per
frame) and full (every byte of every frame, the default). Host figures are CPU time of the
calling thread (time.thread_time), so a busy machine's preemption does not count; "hot" is the
same frame again and again (a producer checksums bytes it has just written), "cycling" goes
through 8 frames (6 MB each at 1080p, so not all cached at 4K). The host table also shows the
formulations of the full checksum that were tried (the chosen one is marked). GPU figures: GPU
time per frame from CUDA events around 200 checksums queued back to back, the host CPU time to
queue one, and the latency of one frame's value (queue + the one sync of `settle_checksums`);
then what a CUDA producer would pay to checksum the slot instead of its staged bytes (Note
[Producer checksum]), and what a consumer's batch of 32 frames in one buffer costs checksummed
one by one and together (Note [Frames of a batch checksummed together]). Writes JSON (runs by machine, merged) and, with
--docs, the "Frame checksum" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from facecast.shared.transport import frames
from docs_section import replace_section  # bench/docs_section.py (this folder is on sys.path)

RESOLUTIONS = {"1080p": (1080, 1920, 3), "4K": (2160, 3840, 3)}
CYCLE_FRAMES = 8
SAMPLED_EVERY = 30  # config/default.toml's daemon.checksum_every
SECTION = "## Frame checksum (`bench/checksum.py`)"


# ================================================================================================
# Host (numpy)
# ================================================================================================


def cpu_us(function, frames_: list[np.ndarray], repeats: int) -> dict:
    """Median and min CPU time of one call, in microseconds, cycling through `frames_`."""
    function(frames_[0])  # plans, caches
    times = []
    for index in range(repeats):
        frame = frames_[index % len(frames_)]
        started = time.thread_time()
        function(frame)
        times.append((time.thread_time() - started) * 1e6)
    return {"median_us": statistics.median(times), "min_us": min(times)}


def _words(frame: np.ndarray) -> np.ndarray:
    return frame.reshape(-1)[: frame.nbytes // 8 * 8].view(np.uint64)


def formulations(nbytes: int) -> dict:
    """The full checksum's candidate forms on the host (only the chosen one is exact for every
    frame size here; the others are timed on whole rows, which is their best case)."""
    plan = frames.checksum_plan(nbytes)
    rows = plan.full_rows
    per_word = (plan.row_weights[:rows, None] * plan.column_weights[None, :]).reshape(-1)
    column = plan.column_weights
    scratch = np.empty(rows * frames.WORDS_PER_ROW, np.uint64)

    def word_table(frame):  # a weight per word read from memory: twice the traffic
        words = _words(frame)[: scratch.size]
        np.multiply(words, per_word, out=scratch)
        return scratch.sum()

    def column_sums(frame):  # one add per word, weights per column: blind to swapped rows
        words = _words(frame)[: scratch.size].reshape(rows, frames.WORDS_PER_ROW)
        return np.einsum("j,j->", words.sum(axis=0), column)

    def int32_lanes(frame):  # 4-byte words: stronger on high bytes, 3x the time
        lanes = frame.reshape(-1)[: nbytes // 4 * 4].view(np.int32)
        usable = lanes.size // frames.WORDS_PER_ROW * frames.WORDS_PER_ROW
        return np.einsum("ij,j->i", lanes[:usable].reshape(-1, frames.WORDS_PER_ROW),
                         column.view(np.int64), dtype=np.int64).sum()

    return {
        "sum of the words (one pass, no weights: the floor)": lambda f: _words(f).sum(),
        "column sums, then a weight per column": column_sums,
        "a weight per word from a table (multiply, sum)": word_table,
        "rows (einsum) over 32-bit words": int32_lanes,
        "rows (einsum ij,j->i) then row weights [chosen]": frames.full_checksum,
    }


def host_run(repeats: int) -> dict:
    rng = np.random.default_rng(0)
    results = {}
    for name, shape in RESOLUTIONS.items():
        deck = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(CYCLE_FRAMES)]
        hot = deck[:1]
        sampled = cpu_us(frames.sparse_checksum, hot, repeats)
        full_hot = cpu_us(frames.full_checksum, hot, repeats)
        full_cycling = cpu_us(frames.full_checksum, deck, repeats)
        copy = cpu_us(np.copy, hot, repeats)
        forms = {label: cpu_us(function, hot, max(10, repeats // 2))
                 for label, function in formulations(int(np.prod(shape))).items()}
        results[name] = {
            "shape": list(shape),
            "none_us": 0.0,
            "sampled_per_checked_frame": sampled,
            "sampled_per_frame_us": sampled["median_us"] / SAMPLED_EVERY,
            "full_hot": full_hot,
            "full_cycling": full_cycling,
            "frame_copy_reference": copy,
            "formulations": forms,
        }
        print(f"host {name}: sampled {sampled['median_us']:.1f} us per checked frame, full "
              f"{full_hot['median_us']:.0f} us hot / {full_cycling['median_us']:.0f} us cycling "
              f"(a copy of the frame: {copy['median_us']:.0f} us)", flush=True)
    return results


# ================================================================================================
# GPU (torch)
# ================================================================================================


def gpu_run(repeats: int) -> dict:
    import torch

    device = torch.device("cuda")
    results = {}
    rng = np.random.default_rng(1)
    for name, shape in RESOLUTIONS.items():
        host_deck = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(CYCLE_FRAMES)]
        deck = [torch.from_numpy(frame).to(device) for frame in host_deck]
        for kind in frames.CHECKSUM_KINDS:  # the identity this run is also for
            for host, on_gpu in zip(host_deck, deck):
                assert frames.checksum_tensor(on_gpu, kind) == frames.checksum(host, kind), kind
        entry = {"shape": list(shape), "gpu_equals_host": True, "none_us": 0.0}
        for kind in frames.CHECKSUM_KINDS:
            frames.settle_checksums([frames.checksum_start(deck[0], kind)])  # warm
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # The GPU sleeps while the host queues: the events then time the kernels back to
            # back, not the gaps of the host's launch rate.
            torch.cuda._sleep(200_000_000)
            start.record()
            launched = time.thread_time()
            pending = [frames.checksum_start(deck[i % CYCLE_FRAMES], kind) for i in range(repeats)]
            launch_cpu_us = (time.thread_time() - launched) * 1e6 / repeats
            end.record()
            frames.settle_checksums(pending)
            gpu_us = start.elapsed_time(end) * 1000 / repeats
            latencies = []
            for index in range(max(20, repeats // 4)):
                began = time.perf_counter()
                frames.settle_checksums([frames.checksum_start(deck[index % CYCLE_FRAMES], kind)])
                latencies.append((time.perf_counter() - began) * 1e6)
            entry[kind] = {"gpu_us_per_frame": gpu_us, "queue_cpu_us": launch_cpu_us,
                           "one_frame_latency_us": statistics.median(latencies)}
        entry["sampled"]["gpu_us_per_frame_at_1_in_30"] = (
            entry["sampled"]["gpu_us_per_frame"] / SAMPLED_EVERY)
        entry["producer_on_slot"] = producer_on_slot(host_deck, deck, repeats)
        entry["consumer_batch"] = consumer_batch(host_deck, repeats)
        results[name] = entry
        print(f"gpu {name}: full {entry['full']['gpu_us_per_frame']:.1f} us GPU, "
              f"{entry['full']['queue_cpu_us']:.1f} us CPU to queue, one frame's value in "
              f"{entry['full']['one_frame_latency_us']:.0f} us; sampled "
              f"{entry['sampled']['gpu_us_per_frame']:.1f} us GPU", flush=True)
    return results


BATCH_FRAMES = 32  # a roi_landmark worker's batch at 64 cameras


def consumer_batch(host_deck: list[np.ndarray], repeats: int) -> dict:
    """A consumer's batch of frames lying back to back in one buffer (Note [A batch's frames in
    one buffer]): their full checksums queued one by one (`checksum_start` each) and together
    (`full_checksums_start`), each then settled with one sync. Per batch: the host's CPU time
    to queue and to settle (thread time; the settle's wait for the GPU sleeps), the GPU's time
    (events around batches queued back to back); the values must agree."""
    import torch

    shape = host_deck[0].shape
    nbytes = host_deck[0].nbytes
    buffer = torch.empty((BATCH_FRAMES, nbytes), dtype=torch.uint8, device="cuda")
    for row in range(BATCH_FRAMES):
        buffer[row].copy_(torch.from_numpy(host_deck[row % CYCLE_FRAMES].reshape(-1)))
    views = [buffer[row].view(shape) for row in range(BATCH_FRAMES)]
    ways = {"one_by_one": lambda: [frames.checksum_start(view) for view in views],
            "together": lambda: frames.full_checksums_start(buffer)}
    expected = [frames.checksum(host_deck[row % CYCLE_FRAMES]) for row in range(BATCH_FRAMES)]
    batches = max(10, repeats // 10)
    result = {"frames": BATCH_FRAMES}
    for name, queue in ways.items():
        assert frames.settle_checksums(queue()) == expected, name  # and warm
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # the GPU waits while the host queues (as gpu_run)
        start.record()
        queued = [queue() for _ in range(batches)]
        end.record()
        torch.cuda.synchronize()
        queue_cpu, settle_cpu = [], []
        for _ in range(batches):
            began = time.thread_time()
            pending = queue()
            queue_cpu.append((time.thread_time() - began) * 1e6)
            torch.cuda.synchronize()  # the settle's own host work, not its wait
            began = time.thread_time()
            frames.settle_checksums(pending)
            settle_cpu.append((time.thread_time() - began) * 1e6)
        del queued
        result[name] = {"queue_cpu_us": statistics.median(queue_cpu),
                        "settle_cpu_us": statistics.median(settle_cpu),
                        "gpu_us": start.elapsed_time(end) * 1000 / batches}
    return result


def producer_on_slot(host_deck: list[np.ndarray], deck, repeats: int) -> dict:
    """A CUDA producer's two ways to the checksum of a frame it uploads (Note [Producer
    checksum]): from its staged host bytes while the DMA runs, or from the slot after it."""
    import torch

    stream = torch.cuda.Stream()
    pinned = [torch.from_numpy(frame).pin_memory() for frame in host_deck]
    slot = torch.empty_like(deck[0])

    def upload(index: int) -> None:
        with torch.cuda.stream(stream):
            slot.copy_(pinned[index % CYCLE_FRAMES], non_blocking=True)

    upload_only, on_slot, staged_cpu = [], [], []
    for index in range(max(20, repeats // 4)):
        began = time.perf_counter()
        upload(index)
        stream.synchronize()
        upload_only.append((time.perf_counter() - began) * 1e6)
        began = time.perf_counter()
        upload(index)
        with torch.cuda.stream(stream):  # settled on the upload's stream too: ordered after it
            frames.settle_checksums([frames.checksum_start(slot)])
        on_slot.append((time.perf_counter() - began) * 1e6)
        upload(index)
        started = time.thread_time()
        frames.full_checksum(pinned[index % CYCLE_FRAMES].numpy())  # overlaps the DMA
        staged_cpu.append((time.thread_time() - started) * 1e6)
        stream.synchronize()
    return {"upload_and_sync_us": statistics.median(upload_only),
            "upload_checksum_slot_and_sync_us": statistics.median(on_slot),
            "host_checksum_of_staged_bytes_cpu_us": statistics.median(staged_cpu)}


# ================================================================================================
# Report
# ================================================================================================


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    info = {"host": socket.gethostname(), "cpu": cpu, "cpu_cores": __import__("os").cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "gpu": ""}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["load_average"] = list(__import__("os").getloadavg())
    except OSError:
        pass
    return info


def run_key(run: dict) -> str:
    return f"{run['machine']['cpu']} | {run['machine']['gpu'] or 'no GPU'}"


def host_table(run: dict) -> list[str]:
    lines = ["| frame | none | sampled, per checked frame | sampled at 1 in 30, per frame | "
             "full, hot | full, cycling 8 frames | (a copy of the frame) |",
             "|---|---|---|---|---|---|---|"]
    for name, entry in run["host"].items():
        lines.append(
            f"| {name} | 0 | {entry['sampled_per_checked_frame']['median_us']:.1f} µs | "
            f"{entry['sampled_per_frame_us']:.2f} µs | {entry['full_hot']['median_us']:.0f} µs "
            f"(min {entry['full_hot']['min_us']:.0f}) | "
            f"{entry['full_cycling']['median_us']:.0f} µs | "
            f"{entry['frame_copy_reference']['median_us']:.0f} µs |")
    lines += ["", "| full checksum formulation (host, hot frame) | " +
              " | ".join(run["host"]) + " |", "|---|" + "---|" * len(run["host"])]
    labels = next(iter(run["host"].values()))["formulations"]
    for label in labels:
        cells = " | ".join(f"{entry['formulations'][label]['median_us']:.0f} µs"
                           for entry in run["host"].values())
        lines.append(f"| {label} | {cells} |")
    return lines


def gpu_table(run: dict) -> list[str]:
    lines = ["| frame | none | sampled: GPU per checked frame (per frame at 1 in 30) | full: GPU "
             "per frame | full: CPU to queue | full: one frame's value incl. sync | GPU = host |",
             "|---|---|---|---|---|---|---|"]
    for name, entry in run["gpu"].items():
        sampled, full = entry["sampled"], entry["full"]
        lines.append(
            f"| {name} | 0 | {sampled['gpu_us_per_frame']:.1f} µs "
            f"({sampled['gpu_us_per_frame_at_1_in_30']:.2f} µs) | "
            f"{full['gpu_us_per_frame']:.1f} µs"
            f" | {full['queue_cpu_us']:.1f} µs | {full['one_frame_latency_us']:.0f} µs | "
            f"{'yes' if entry['gpu_equals_host'] else 'NO'} |")
    lines += ["", "| producer on a CUDA ring | " + " | ".join(run["gpu"]) + " |",
              "|---|" + "---|" * len(run["gpu"])]
    rows = [("upload to the slot + sync (no checksum)", "upload_and_sync_us"),
            ("upload + full checksum of the slot on the GPU + sync (the slot form)",
             "upload_checksum_slot_and_sync_us"),
            ("full checksum of the staged bytes on the host, overlapping the upload (CPU time; "
             "chosen)", "host_checksum_of_staged_bytes_cpu_us")]
    for label, key in rows:
        cells = " | ".join("not valid (see below)" if entry["producer_on_slot"][key] is None
                           else f"{entry['producer_on_slot'][key]:.0f} µs"
                           for entry in run["gpu"].values())
        lines.append(f"| {label} | {cells} |")
    batched = {name: entry["consumer_batch"] for name, entry in run["gpu"].items()
               if "consumer_batch" in entry}
    if batched:
        count = next(iter(batched.values()))["frames"]
        lines += ["", f"| a consumer's batch of {count} frames in one buffer, per batch: "
                  "one by one → together | " + " | ".join(batched) + " |",
                  "|---|" + "---|" * len(batched)]
        for label, key in (("CPU to queue", "queue_cpu_us"), ("CPU to settle (its sync's "
                           "wait excluded)", "settle_cpu_us"), ("GPU", "gpu_us")):
            cells = " | ".join(f"{b['one_by_one'][key]:.0f} → {b['together'][key]:.0f} µs "
                               f"({b['one_by_one'][key] / b['together'][key]:.1f}×)"
                               for b in batched.values())
            lines.append(f"| {label} | {cells} |")
    return lines


def section(runs: list[dict]) -> str:
    lines = [SECTION, "",
             "Cost per frame of proving that a frame is the camera's (Note [Frame checksum]): "
             "none, the old sampled check (4096 bytes, 1 frame in 30) and the "
             "full check of every byte of every frame (the default since issue 11). How it is "
             "measured: the docstring of `bench/checksum.py`. Raw figures: "
             "[benchmarks-checksum.json](benchmarks-checksum.json).", ""]
    for run in runs:
        info = run["machine"]
        lines += [f"### {info['cpu']} ({info['cpu_cores']} cores), "
                  f"{info['gpu'] or 'no GPU'}: run {info['date_utc']} UTC", "",
                  f"Host `{info['host']}`; Python {info['python']}, numpy {info['numpy']}, torch "
                  f"{info['torch']}; load average at the start "
                  f"{', '.join(f'{x:.2f}' for x in info.get('load_average', []))}. Command: "
                  f"`{run['command']}`.", "", "Host (numpy), CPU time per frame, median:", ""]
        lines += host_table(run) + [""]
        if run.get("gpu"):
            lines += ["GPU (torch), per frame:", ""] + gpu_table(run) + [""]
        if run.get("note"):
            lines += [run["note"], ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--no-run", action="store_true", help="measure nothing (merge, render)")
    parser.add_argument("--merge", action="append", default=[], help="add the runs of this JSON")
    parser.add_argument("--json", default="", help="runs by machine: read, update, write")
    parser.add_argument("--docs", default="", help="rewrite this file's Frame checksum section")
    parser.add_argument("--note", default="", help="a sentence shown under this run's tables")
    args = parser.parse_args()

    runs: dict[str, dict] = {}
    for source in ([args.json] if args.json and Path(args.json).exists() else []) + args.merge:
        for run in json.loads(Path(source).read_text())["runs"]:
            runs[run_key(run)] = run
    if not args.no_run:
        import torch

        run = {"machine": machine(), "command": "python3 " + shlex.join(sys.argv),
               "host": host_run(args.repeats), "note": args.note}
        if torch.cuda.is_available():
            run["gpu"] = gpu_run(args.repeats)
        runs[run_key(run)] = run
    ordered = sorted(runs.values(), key=lambda r: (not r.get("gpu"), r["machine"]["date_utc"]))
    text = section(ordered)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": ordered}, indent=1) + "\n")
    if args.docs:
        replace_section(Path(args.docs), SECTION, text)


if __name__ == "__main__":
    main()
