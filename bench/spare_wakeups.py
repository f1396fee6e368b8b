"""What wakes an idle CUDA context's driver thread: an idle process beside GPU work of several
kinds, each kind in a phase of its own (issue 24 item 4: a warm spare uses < 0.02 cores while
it waits).

    python bench/spare_wakeups.py --out wakeups.json     # on a GPU

On the offline GPU host: `bash bench/gpu_check.sh start spare_wakeups`.

Every process holding a CUDA context has the driver's `cuda-EvtHandlr` thread, which sleeps in
`poll`. Beside the daemon, in every spare and in a bare process that holds nothing but a
context, it woke ~720 times a second and cost 0.016-0.022 cores; away from the daemon, 10 times
(docs/benchmarks.md, 2026-11-27). Interprocess events were ruled out (a probe of 23:08), as
were one other process's blocking waits, expandable segments, PyCUDA's context, graphs and the
allocator's counters (19:38). What the daemon does besides, each a phase here: several
processes busy on the GPU at once (their contexts take turns), a kernel reading memory another
process shares by CUDA IPC (the rings), and uploads from pinned host memory (capture).
On 2026-11-28 (H100) none of those, nor downloads into pinned memory, a table pinned anew for
each copy, device memory freed and taken again, 16 threads with a stream each, or ten contexts,
woke the idle context more than its 10 times a second (docs/benchmarks.md). What they all
lacked is the daemon's blocking waits (Note [Blocking waits]): the `blocking_*` phases. They
woke it (2026-11-28, H100): two or more processes' blocking waits wake every context's driver
thread, 190-930 times a second. The `*_stopped` phases stop the watched (warm) process while it
is counted, as the supervisor stops a spare (Note [Spares paused while they stand by]), then
continue it and check that its graph still replays right.

In each phase a watched process holds an idle context (a one-element tensor, then nothing) and
`PHASE_S` seconds are counted after the busy processes are working: its driver thread's
voluntary context switches a second (its wake-ups: each wake ends in another sleep) and its
cores (user + system CPU a second). The busy processes' own wake-ups are reported too. Each
busy process paces itself at `RATE_HZ` steps a second (a frame rate of a worker's order).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

PHASE_S = 6.0
RATE_HZ = 240.0  # 8 cameras at 30 fps, where the spares woke 720 times a second
DRIVER_THREAD = "cuda-EvtHandlr"
PHASES = {  # phase: what its busy processes do
    "none": [],
    "one_busy": ["compute"],
    "two_busy": ["compute", "compute"],
    "four_busy": ["compute"] * 4,
    "ipc_read": ["ipc_owner", "ipc_reader"],
    "pinned_upload": ["upload"],
    # What the daemon does besides, the next suspects (2026-11-28: the phases above left the idle
    # context at its 10 wake-ups a second).
    "pinned_download": ["download"],
    "pin_each_step": ["pin_each"],
    "device_alloc_free": ["alloc_free"],
    "streams_in_threads": ["threads"],
    "many_contexts": ["idle"] * 8 + ["compute"] * 2,  # the daemon's count of contexts at 64
    # The daemon's workers and spares make their contexts with CU_CTX_SCHED_BLOCKING_SYNC (Note
    # [Blocking waits]): a wait sleeps until the driver is told the GPU is done, which none of
    # the phases above did. Next suspect (2026-11-28): that notice reaches every context.
    "blocking_one": ["compute_blocking"],
    "blocking_four": ["compute_blocking"] * 4,
    "blocking_upload": ["upload_blocking"],
    "blocking_both": ["compute_blocking"] * 2,  # the watched context blocking too, as a spare's
    # CUDA graphs replayed (each worker's batches, capture's frame: an upload from pinned memory
    # and kernels in one graph, Note [A frame's GPU work in one graph]), which no phase above ran.
    "graph_replays": ["graph"],
    "graph_uploads": ["graph_upload"],
    "blocking_graph_uploads": ["graph_upload_blocking"] * 2,
    # facecast's own CUDA ring (shared/transport): a capture's producer publishing 1080p frames
    # and a consumer reading them on its GPU, checksums and events included, both with the
    # daemon's blocking waits: the daemon's frame path without its models.
    "facecast_ring": ["ring_producer", "ring_consumer_blocking"],
    # The watched context warm (a CUDA graph captured, as a spare's) and stopped (SIGSTOP) while
    # it is counted, then continued and asked to replay its graph: whether a stopped spare costs
    # nothing beside the daemon's blocking waits, and comes back working (2026-11-28: the phases
    # above showed two or more processes' blocking waits waking every idle context's driver
    # thread, 190-930 times a second).
    "facecast_ring_stopped": ["ring_producer", "ring_consumer_blocking"],
    "blocking_graph_uploads_stopped": ["graph_upload_blocking"] * 2,
}
RING_DIR_ENV = "FACECAST_SPARE_WAKEUPS_RING_DIR"  # the ring phase's runtime dir, for its processes
WATCHED = {"blocking_both": "idle_blocking",  # the watched process's kind, where not "idle"
           "facecast_ring_stopped": "warm_blocking",
           "blocking_graph_uploads_stopped": "warm_blocking"}
STOPPED = {name for name, kind in WATCHED.items() if kind == "warm_blocking"}  # stopped while counted


def thread_switches(pid: int, name: str) -> dict[int, int]:
    """Voluntary context switches of each thread of `pid` whose name (comm) contains `name`."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        if name in comm:
            found[int(tid)] = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def count(pid: int, seconds: float, thread_name: str = DRIVER_THREAD) -> dict:
    """The wake-ups a second of `pid`'s threads named `thread_name` (the driver's, by default),
    and the process's cores, over `seconds`."""
    before, cpu_before = thread_switches(pid, thread_name), cpu_seconds(pid)
    time.sleep(seconds)
    after, cpu_after = thread_switches(pid, thread_name), cpu_seconds(pid)
    wakeups = sum(after[tid] - before[tid] for tid in after if tid in before)
    return {"threads": len(after), "wakeups_per_s": round(wakeups / seconds, 1),
            "cores": round((cpu_after - cpu_before) / seconds, 4)}


def _paced(stop, step) -> None:
    period, due = 1.0 / RATE_HZ, time.monotonic()
    while not stop.is_set():
        step()
        due += period
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            due = time.monotonic()


def run_process(kind: str, ready, stop, queue) -> None:
    """One process of a phase: idle, or busy in one of PHASES' ways (STEP_MAKERS), paced."""
    if kind.endswith("_blocking"):  # as every facecast worker makes its context
        from facecast.shared.transport.cuda_driver import wait_by_blocking

        wait_by_blocking(0)
        kind = kind.removesuffix("_blocking")
    import torch

    device = torch.device("cuda")
    if kind == "idle":
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
        ready.set()
        stop.wait()
        return
    if kind == "warm":
        _warm_until_asked(torch, device, ready, queue)
        return
    if kind not in STEP_MAKERS:
        raise ValueError(f"unknown process kind {kind!r}")
    step = STEP_MAKERS[kind](torch, device, queue)
    step()
    ready.set()
    _paced(stop, step)


def _warm_until_asked(torch, device, ready, asked) -> None:
    """A spare's state: a CUDA graph captured and replayed once; then, when the bench says so
    (`asked`: an event and a queue; after it has stopped and continued this process), one
    replay more, checked, and its time (ms) on the queue."""
    go, replies = asked
    x = torch.arange(1 << 20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.mul(x, 2, out=y)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(x, 2, out=y)
    graph.replay()
    torch.cuda.synchronize()
    ready.set()
    go.wait()
    start = time.perf_counter()
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    correct = bool(torch.equal(y, x * 2))
    replies.put({"replay_ms": round((time.perf_counter() - start) * 1000, 3), "correct": correct})


# Each busy kind's step (made in its process, after torch's import): what it does at RATE_HZ.

def _compute(torch, device, queue):
    """A small batch's work and a blocking wait for it, as a worker's."""
    x = torch.randn(64, 1024, device=device)
    product = torch.empty_like(x)
    weight = torch.randn(1024, 1024, device=device) / 32  # values neither grow nor vanish

    def step():
        for _ in range(8):  # no allocation: torch.relu has no out=, clamp has
            torch.mm(x, weight, out=product)
            torch.clamp(product, min=0, out=x)
        torch.cuda.synchronize()
    return step


def _ipc_owner(torch, device, queue):
    """A ring's slot: written here, read by the reader's kernels."""
    frame = torch.zeros(1080, 1920, 3, dtype=torch.uint8, device=device)
    queue.put(frame)  # torch sends a CUDA tensor by its IPC handle

    def step():
        frame.add_(1)
        torch.cuda.synchronize()
    return step


def _ipc_reader(torch, device, queue):
    frame = queue.get()
    return lambda: frame.float().mean().item()


def _upload(torch, device, queue):
    """A 1080p frame from pinned host memory, as capture uploads."""
    host = torch.empty(1080 * 1920 * 3, dtype=torch.uint8).pin_memory()
    slot = torch.empty_like(host, device=device)

    def step():
        slot.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    return step


def _download(torch, device, queue):
    """Results to pinned host memory, waited for on an event."""
    result = torch.randn(64, 1434, device=device)
    host = torch.empty(result.shape).pin_memory()
    done = torch.cuda.Event()

    def step():
        host.copy_(result, non_blocking=True)
        done.record()
        done.synchronize()
    return step


def _pin_each(torch, device, queue):
    """A small table pinned anew for each copy, as models/roi.py's."""
    slot = torch.empty(64, 8, device=device)

    def step():
        slot.copy_(torch.randn(64, 8).pin_memory(), non_blocking=True)
        torch.cuda.synchronize()
    return step


def _alloc_free(torch, device, queue):
    """Device memory given back to the driver and taken again."""
    def step():
        torch.empty(8 << 20, dtype=torch.uint8, device=device).fill_(1)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # cudaFree, so that the next step's is a cudaMalloc
    return step


def _threads(torch, device, queue):
    """16 threads with a stream each, as a capture group's cameras."""
    import threading

    streams = [torch.cuda.Stream() for _ in range(16)]
    frames = [torch.zeros(1080 * 1920 * 3 // 4, dtype=torch.int32, device=device) for _ in streams]

    def on_stream(stream, frame):
        with torch.cuda.stream(stream):
            frame.add_(1)
        stream.synchronize()

    def step():
        workers = [threading.Thread(target=on_stream, args=pair) for pair in zip(streams, frames)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    return step


def _ring_producer(torch, device, queue):
    """facecast's CUDA ring, written as a capture worker writes it (its own blocking waits)."""
    import numpy as np
    import zmq

    from facecast.shared.transport.publisher import FramePublisher

    publisher = FramePublisher(zmq.Context(), os.environ[RING_DIR_ENV], "cam0", transport="cuda_ipc")
    frames = [np.random.default_rng(k).integers(0, 256, (1080, 1920, 3), np.uint8) for k in range(4)]
    published = [0]

    def step():
        publisher.serve_control()
        publisher.publish(frames[published[0] % len(frames)], time.monotonic())
        published[0] += 1
    return step


def _ring_consumer(torch, device, queue):
    """facecast's CUDA ring, read as an inference worker reads it."""
    import zmq

    from facecast.shared.transport.subscriber import FrameSubscriber

    subscriber = FrameSubscriber(zmq.Context(), os.environ[RING_DIR_ENV], ["cam0"], device=device)

    def step():
        if subscriber.receive(timeout_ms=10):
            torch.cuda.synchronize()
    return step


def _graph(torch, device, queue, upload: bool = False):
    """A CUDA graph replayed: kernels, and with `upload` a copy from pinned memory first, as
    capture's frame graph."""
    host = torch.empty(1080 * 1920 * 3, dtype=torch.uint8).pin_memory()
    frame = torch.zeros(1080 * 1920 * 3, dtype=torch.uint8, device=device)
    total = torch.zeros(1, dtype=torch.int64, device=device)
    stream = torch.cuda.Stream()

    def work():
        if upload:
            frame.copy_(host, non_blocking=True)
        frame.add_(1)
        total.copy_(frame[:4096].sum())

    with torch.cuda.stream(stream):  # warmed on the side stream, as torch asks
        work()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()

    def step():
        graph.replay()
        torch.cuda.current_stream().synchronize()
    return step


STEP_MAKERS = {
    "compute": _compute, "ipc_owner": _ipc_owner, "ipc_reader": _ipc_reader, "upload": _upload,
    "download": _download, "pin_each": _pin_each, "alloc_free": _alloc_free,
    "threads": _threads, "ring_producer": _ring_producer, "ring_consumer": _ring_consumer,
    "graph": _graph, "graph_upload": lambda torch, device, queue: _graph(torch, device, queue, upload=True),
}


def measure_phase(name: str, kinds: list[str], seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="fc-wakeups-") as ring_dir:
        os.environ[RING_DIR_ENV] = ring_dir  # the spawned processes inherit it
        return _measure_phase(name, kinds, seconds)


def _measure_phase(name: str, kinds: list[str], seconds: float) -> dict:
    context = mp.get_context("spawn")
    stop, queue = context.Event(), context.Queue()
    go, replies = context.Event(), context.Queue()  # the stopped phases' watched process
    started = []
    for index, kind in enumerate([WATCHED.get(name, "idle"), *kinds]):
        ready = context.Event()
        process = context.Process(target=run_process, daemon=True,
                                  args=(kind, ready, stop, (go, replies) if index == 0 else queue))
        process.start()
        started.append((kind, process, ready))
    try:
        deadline = time.monotonic() + 120.0
        for kind, process, ready in started:
            while not ready.wait(0.5):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"phase {name}: the {kind} process did not start "
                                       f"(exit code {process.exitcode})")
        time.sleep(1.0)  # past every process's first steps
        watched = started[0][1]
        if name in STOPPED:
            os.kill(watched.pid, signal.SIGSTOP)
        row = {"phase": name, "busy": kinds, "idle": count(watched.pid, seconds)}
        row["busy_processes"] = [count(process.pid, 1.0) for _, process, _ in started[1:]]
        if name in STOPPED:
            os.kill(watched.pid, signal.SIGCONT)
            go.set()
            row["resumed"] = replies.get(timeout=60)
        return row
    finally:
        stop.set()
        for _, process, _ in started:
            process.join(20)
            if process.is_alive():
                process.kill()


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| phase | busy processes | idle context: wake-ups/s, cores | busy ones: wake-ups/s "
             "| stopped, then: first replay ms, correct |", "|---|---|---|---|---|"]
    for row in rows:
        busy = ", ".join(f"{p['wakeups_per_s']:g}" for p in row["busy_processes"]) or "-"
        lines.append(f"| {row['phase']} | {', '.join(row['busy']) or 'none'} | "
                     f"{row['idle']['wakeups_per_s']:g}, {row['idle']['cores']:.4f} | {busy} | "
                     + (f"{row['resumed']['replay_ms']:g}, {row['resumed']['correct']} |"
                        if "resumed" in row else "- |"))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", nargs="*", default=list(PHASES), choices=list(PHASES))
    parser.add_argument("--seconds", type=float, default=PHASE_S)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the driver's thread is what it counts)")
    rows = []
    for name in args.phases:
        rows.append(measure_phase(name, PHASES[name], args.seconds))
        print(json.dumps(rows[-1]), flush=True)
    print("\n".join(table_lines(rows)))
    if args.out:
        args.out.write_text(json.dumps({"rate_hz": RATE_HZ, "seconds": args.seconds,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
