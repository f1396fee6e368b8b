"""Where one GPU's time goes across the daemon's processes (Note [Where the GPU's time goes],
workers/gpu_trace.py): the Chrome traces each worker wrote for the same window, on one time line.

    python3 bench/gpu_trace.py DIR --start-unix-s T --seconds S   # a folder of traces, printed

`bench/pipeline.py --gpu-trace-s S` asks the daemon's workers for the traces and puts
`summarize`'s result in its row ("gpu_trace") and a table under the run's.

What is counted, in the window only (an interval is cut at its edges):
- per process (its worker name): the time its kernels ran on the GPU (the union of its kernels'
  intervals: two of its streams at once count once), its copies and fills (copy engines run
  beside kernels, so they are apart), its kernel count, their median span and the share under
  10 us, its graph launches and the kernels it launched one by one (the host's calls), and its
  largest kernels by time;
- the device: the time any kernel ran (the union over every process), and the sum of the
  processes' own times. Kernels of different processes run side by side only under MPS; without
  it the GPU gives each CUDA context time slices, and a kernel's recorded span includes the
  time its context was switched out, so the sum exceeds the union (3,079 against 2,173 ms in
  3 s at 64 cameras, H100, 2026-11-27) and only the union is the device's busy time;
- the turns: how often the next kernel to start on the GPU belongs to another process than the
  last one, and the gap between them (the end of one process's kernel to the start of the
  other's), against the gaps between two kernels of one process. A gap at a turn that is larger
  than within a process is what a change of context costs the GPU.

What it cannot say: how the daemon runs without the profiler. Recording every kernel, and
writing the traces, cost the workers far more than the window's 3 s: at 64 replayed cameras
on an H100 (2026-11-27 23:17-23:22) the bench's 15 s window published 27 % of the frames due
with traces (60 % with one measuring worker, 26 % under MPS), where the same code without them
published 99.6 % on the next loan. The counts, the kernels' names and the launches a batch are
the daemon's; the shares, the idle time and the turns are those of a daemon slowed by its
profiler.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from facecast.workers.gpu_trace import window_path

KERNEL_CATEGORIES = {"kernel"}
COPY_CATEGORIES = {"gpu_memcpy", "gpu_memset"}
TOP_KERNELS = 5
# A worker's trace file: "<worker name>-<pid>.json" (workers/gpu_trace.py).
TRACE_NAME = re.compile(r"^(?P<worker>.+)-(?P<pid>\d+)\.json$")


# The host's calls that start GPU work: a CUDA graph, or one kernel (runtime or driver API).
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}
KERNEL_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
SMALL_KERNEL_US = 10.0


@dataclass
class ProcessActivity:
    """One process's GPU intervals, in microseconds of the host's clock, and its launches (the
    host's calls, by when they were made)."""

    worker: str
    kernels: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, name)
    copies: list[tuple[float, float]] = field(default_factory=list)
    graph_launches_us: list[float] = field(default_factory=list)
    kernel_launches_us: list[float] = field(default_factory=list)  # one by one, outside graphs
    recorded_unix_s: tuple[float, float] | None = None  # what the worker really recorded

    def within(self, start_us: float, end_us: float) -> ProcessActivity:
        """The same activity cut to the window (an interval at its edge is cut there)."""
        kernels = [(max(begin, start_us), min(end, end_us), name) for begin, end, name in self.kernels]
        copies = [(max(begin, start_us), min(end, end_us)) for begin, end in self.copies]
        return ProcessActivity(
            self.worker,
            [kernel for kernel in kernels if kernel[1] > kernel[0]],
            [copy for copy in copies if copy[1] > copy[0]],
            [at for at in self.graph_launches_us if start_us <= at < end_us],
            [at for at in self.kernel_launches_us if start_us <= at < end_us],
            self.recorded_unix_s)


def load_trace(path: Path) -> ProcessActivity:
    """A worker's Chrome trace (torch.profiler's export), with the window it recorded (the file
    beside it, workers/gpu_trace.py's `window_path`). Its timestamps are `ts` microseconds after
    `baseTimeNanoseconds` (the host's clock)."""
    match = TRACE_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path}: not a worker's trace (<worker>-<pid>.json)")
    trace = json.loads(path.read_text())
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000.0
    window = window_path(path)
    recorded = json.loads(window.read_text()) if window.exists() else None
    activity = ProcessActivity(match["worker"], recorded_unix_s=tuple(recorded) if recorded else None)
    for event in trace.get("traceEvents", []):
        category = event.get("cat")
        if event.get("ph") != "X":
            continue
        begin = base_us + float(event["ts"])
        if category == "cuda_runtime":
            name = event.get("name")
            if name in GRAPH_LAUNCHES:
                activity.graph_launches_us.append(begin)
            elif name in KERNEL_LAUNCHES:
                activity.kernel_launches_us.append(begin)
        elif category in KERNEL_CATEGORIES:
            activity.kernels.append((begin, begin + float(event.get("dur", 0.0)),
                                     str(event.get("name", "?"))))
        elif category in COPY_CATEGORIES:
            activity.copies.append((begin, begin + float(event.get("dur", 0.0))))
    return activity


def union_us(intervals) -> float:
    """The time covered by (start, end, ...) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for begin, end, *_ in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(begin, reach)
        reach = end
    return total


def turns(processes: list[ProcessActivity]) -> dict:
    """The kernels of every process in order of start: how often the GPU went on with another
    process's kernel, and the gaps (ms) before a kernel, at a turn and within one process."""
    timeline = sorted((begin, end, index) for index, process in enumerate(processes)
                      for begin, end, _ in process.kernels)
    at_turn, within = [], []
    reach, last = None, None
    for begin, end, index in timeline:
        if reach is not None and begin >= reach:  # an idle gap before this kernel
            (within if index == last else at_turn).append(begin - reach)
        elif reach is not None and index != last:
            at_turn.append(0.0)  # overlapping another process's kernel (MPS), no gap
        if reach is None or end > reach:
            reach, last = end, index
    return {"turns": len(at_turn),
            "gap_at_turn_mean_us": round(_mean(at_turn), 1),
            "gap_within_process_mean_us": round(_mean(within), 1),
            "idle_at_turns_ms": round(sum(at_turn) / 1000.0, 2),
            "idle_within_processes_ms": round(sum(within) / 1000.0, 2)}


def recorded_window_s(processes: list[ProcessActivity], start_unix_s: float, seconds: float
                      ) -> tuple[float, float]:
    """The time every worker recorded, within the requested window: (start, seconds)."""
    begin, end = start_unix_s, start_unix_s + seconds
    for process in processes:
        if process.recorded_unix_s:
            begin, end = max(begin, process.recorded_unix_s[0]), min(end, process.recorded_unix_s[1])
    return begin, max(0.0, end - begin)


def summarize(trace_dir: Path, start_unix_s: float, seconds: float) -> dict:
    """The window's GPU time by process and for the device (module docstring): the requested
    window, cut to the time every worker recorded. Each trace is read once (a measuring
    worker's is ~130 MB at 64 cameras)."""
    loaded = [load_trace(path) for path in sorted(trace_dir.glob("*.json"))]
    requested_start_unix_s, requested_s = start_unix_s, seconds
    start_unix_s, seconds = recorded_window_s(loaded, start_unix_s, seconds)
    if seconds <= 0:  # a worker started late or stopped early: no time every worker recorded
        spans = [f"{process.worker} {process.recorded_unix_s[0] - requested_start_unix_s:+.3f}"
                 f"..{process.recorded_unix_s[1] - requested_start_unix_s:+.3f} s"
                 for process in loaded if process.recorded_unix_s]
        return {"error": f"no time that every worker recorded in the {requested_s:g} s asked "
                         f"(each one's recording from the window's start: {', '.join(spans)})"}
    start_us, end_us = start_unix_s * 1e6, (start_unix_s + seconds) * 1e6
    processes = [process.within(start_us, end_us) for process in loaded]
    window_ms = seconds * 1000.0
    by_process = {}
    for process in processes:
        names: dict[str, float] = {}
        for begin, end, name in process.kernels:
            names[name] = names.get(name, 0.0) + (end - begin)
        top = sorted(names.items(), key=lambda item: -item[1])[:TOP_KERNELS]
        spans = sorted(end - begin for begin, end, _ in process.kernels)
        by_process[process.worker] = {
            "kernel_ms": round(union_us(process.kernels) / 1000.0, 2),
            "kernel_share": round(union_us(process.kernels) / 1000.0 / window_ms, 4),
            "kernels": len(process.kernels),
            "median_kernel_us": round(spans[len(spans) // 2], 2) if spans else 0.0,
            "small_kernels_share": (round(sum(span < SMALL_KERNEL_US for span in spans) / len(spans), 3)
                                    if spans else 0.0),
            "graph_launches": len(process.graph_launches_us),
            "kernel_launches": len(process.kernel_launches_us),
            "copy_ms": round(union_us(process.copies) / 1000.0, 2),
            "top_kernels_ms": [[name[:80], round(us / 1000.0, 2)] for name, us in top],
        }
    every_kernel = [interval for process in processes for interval in process.kernels]
    busy_ms = union_us(every_kernel) / 1000.0
    return {
        "window_s": round(seconds, 3),
        "requested_window_s": requested_s,
        "processes_traced": len(processes),
        "kernel_busy_ms": round(busy_ms, 2),
        "kernel_busy_share": round(busy_ms / window_ms, 4) if window_ms else 0.0,
        "sum_of_processes_kernel_ms": round(sum(p["kernel_ms"] for p in by_process.values()), 2),
        **turns(processes),
        "by_process": by_process,
    }


def table_lines(summary: dict) -> list[str]:
    """The summary as the bench prints it."""
    lines = [f"GPU time in a {summary['window_s']:.1f} s window ({summary['processes_traced']} "
             f"processes traced): kernels ran {100 * summary['kernel_busy_share']:.1f} % of it "
             f"(sum of the processes' own: {summary['sum_of_processes_kernel_ms']:.1f} ms of "
             f"{summary['kernel_busy_ms']:.1f}); {summary['turns']} turns between processes, "
             f"gap {summary['gap_at_turn_mean_us']:.1f} us at a turn against "
             f"{summary['gap_within_process_mean_us']:.1f} us within one",
             "| process | kernels ms (share) | kernels (median us, under 10 us) | graph launches, "
             "single kernels | copies ms | largest kernels (ms) |",
             "|---|---|---|---|---|---|"]
    for worker, row in sorted(summary["by_process"].items(), key=lambda item: -item[1]["kernel_ms"]):
        top = "; ".join(f"{name} {ms}" for name, ms in row["top_kernels_ms"][:3])
        lines.append(f"| {worker} | {row['kernel_ms']} ({100 * row['kernel_share']:.1f} %) | "
                     f"{row['kernels']} ({row['median_kernel_us']}, "
                     f"{100 * row['small_kernels_share']:.0f} %) | {row['graph_launches']}, "
                     f"{row['kernel_launches']} | {row['copy_ms']} | {top} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--start-unix-s", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    print("\n".join(table_lines(summarize(args.trace_dir, args.start_unix_s, args.seconds))))
    return 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


if __name__ == "__main__":
    sys.exit(main())
