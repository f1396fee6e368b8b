"""A window of this worker's GPU activity, for `bench/pipeline.py --gpu-trace-s` (Note [Where
the GPU's time goes]).

Note [Where the GPU's time goes]
    At 64 cameras on one H100 the GPU is busy 98-100 % of the time, and the detection pass took
    29.9 ms in the daemon against 4.2 ms for the same 32 frames alone (2026-11-27). Whether
    that is the work itself or the processes taking turns on one GPU (every CUDA context gets
    time slices; a context switch costs GPU time and delays a queued batch), no per-process
    figure says: nvidia-smi's utilisation is the share of time *any* kernel ran. So the bench
    can ask every worker with CUDA for the same window of its GPU activity: each kernel and
    copy with its start and end on the GPU, from the profiler's CUDA activity records (CUPTI),
    one Chrome trace a process; bench/gpu_trace.py then adds them up on one time line (the
    traces' timestamps are the host's clock, the same in every process).

    The bench arms it by an environment variable naming a request file, which every worker of
    the daemon inherits; nothing happens while the file is absent. The file says when the window
    starts (a Unix time seconds ahead, so that every worker, checking it at its heartbeats,
    starts at the same moment) and how long it lasts. A worker prepares the profiler as soon
    as it reads the request: the first run (H100, 2026-11-27) prepared and started it at the
    window's start, and the workers' loops stood 5.6-6.8 s in that call (CUPTI taking on a
    process whose kernels are loaded), so each recorded only the last ~50 ms. The times a
    worker's recording really started and stopped go into a file beside its trace
    (`window_path`), and the bench adds up only the time every worker recorded. Only
    CUDA activity is recorded (no operator events on the host: a capture worker's sixteen
    camera threads would pay for those), and each process writes one trace, once. The bench
    asks at the start of its warm-up (at least 25 s then), so that the stall falls before its
    window, and gives the workers 60 s without a heartbeat: on another loan the stall passed
    10 s, the daemon's default, and the supervisor killed the workers as hung, their spares
    in turn (2026-11-27 23:02). Recording kernels still costs the GPU's and the host's time
    while it lasts, and much more than that: the traced daemon is a slower one
    (bench/gpu_trace.py says what the traces can and cannot tell).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

REQUEST_ENV = "FACECAST_GPU_TRACE_REQUEST"  # the request file's path (the bench sets it)
CHECK_INTERVAL_S = 0.5  # how often an armed worker looks for the request


def window_path(trace_path: Path) -> Path:
    """Where a worker writes the window its trace at `trace_path` really recorded: [start,
    stop], Unix seconds."""
    return trace_path.with_name(trace_path.name + ".window")


class GpuTraceWindow:
    """One worker process's part of Note [Where the GPU's time goes]: `tick` from its loop."""

    def __init__(self, request_path: Path, *, host_activity: bool = False) -> None:
        self.request_path = request_path
        self.host_activity = host_activity  # the host's operators instead (tests: no GPU there)
        self._next_check_monotonic = 0.0
        self._start_unix: float | None = None
        self._seconds = 0.0
        self._out_dir: Path | None = None
        self._profiler = None
        self._started_unix: float | None = None
        self.done = False

    @classmethod
    def from_environment(cls) -> GpuTraceWindow | None:
        path = os.environ.get(REQUEST_ENV)
        return cls(Path(path)) if path else None

    def tick(self, worker_name: str) -> None:
        """Prepare, start, stop and write the window as the request says; cheap when there is
        nothing to do."""
        if self.done:
            return
        now = time.time()
        if self._started_unix is not None:
            if now >= self._start_unix + self._seconds:
                self._finish(worker_name)
            return
        if self._start_unix is None:
            if time.monotonic() < self._next_check_monotonic:
                return
            self._next_check_monotonic = time.monotonic() + CHECK_INTERVAL_S
            if self._read_request():
                self._prepare(worker_name)
            return
        if now >= self._start_unix:
            try:
                self._profiler.start_trace()
            except Exception as exc:  # noqa: BLE001 - the worker goes on without its trace
                log.warning("%s: the GPU trace could not start (%s)", worker_name, exc)
                self._profiler, self.done = None, True
                return
            self._started_unix = time.time()

    def _read_request(self) -> bool:
        try:
            request = json.loads(self.request_path.read_text())
            self._start_unix = float(request["start_unix_s"])
            self._seconds = float(request["seconds"])
            self._out_dir = Path(request["out_dir"])
            return True
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("GPU trace request %s unreadable (%s); no trace", self.request_path, exc)
            self.done = True
            return False

    def _prepare(self, worker_name: str) -> None:
        torch = sys.modules.get("torch")
        if torch is None or not (self.host_activity or torch.cuda.is_initialized()):
            self.done = True  # no CUDA in this process (output, console): nothing to trace
            return
        from torch.profiler import ProfilerActivity, profile

        try:
            self._profiler = profile(activities=[ProfilerActivity.CPU if self.host_activity
                                                 else ProfilerActivity.CUDA])
            self._profiler.prepare_trace()
        except Exception as exc:  # noqa: BLE001 - no CUPTI here: the bench says so
            log.warning("%s: no GPU trace (%s)", worker_name, exc)
            self._profiler, self.done = None, True

    def _finish(self, worker_name: str) -> None:
        profiler, self._profiler, self.done = self._profiler, None, True
        try:
            profiler.stop_trace()
            stopped_unix = time.time()
            self._out_dir.mkdir(parents=True, exist_ok=True)
            path = self._out_dir / f"{worker_name}-{os.getpid()}.json"
            # What this worker really recorded, in a file beside the trace: not read back and
            # written again with it, which is seconds of the worker's time for a measuring
            # worker's ~130 MB trace at 64 cameras.
            window_path(path).write_text(json.dumps([self._started_unix, stopped_unix]))
            partial = path.with_name(path.name + ".part")
            profiler.export_chrome_trace(str(partial))
            partial.rename(path)  # whole once the bench sees it
        except Exception as exc:  # noqa: BLE001 - the worker goes on whatever the profiler did
            log.warning("%s: the GPU trace could not be written (%s)", worker_name, exc)
