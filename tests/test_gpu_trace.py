"""Note [Where the GPU's time goes]: a worker's window of GPU activity (workers/gpu_trace.py) and
the bench's sum of the windows on one time line (bench/gpu_trace.py). No GPU here: the traces
are written as torch.profiler writes them, and the worker's side records the host's operators."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu_trace  # noqa: E402 (bench/ is not a package)

from facecast.workers.gpu_trace import GpuTraceWindow, window_path  # noqa: E402

BASE_NS = 1_790_000_000_000_000_000  # a trace's baseTimeNanoseconds
BASE_US = BASE_NS / 1000


def _write_trace(folder: Path, name: str, kernels, copies=(), other=()) -> None:
    """A Chrome trace as torch.profiler exports it: `ts`/`dur` in us after baseTimeNanoseconds;
    kernels and copies given as (start, end) in us of the window."""
    events = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": begin, "dur": end - begin}
              for i, (begin, end) in enumerate(kernels)]
    events += [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": b, "dur": e - b}
               for b, e in copies]
    events += [{"ph": "X", "cat": "cuda_runtime", "name": name, "ts": b, "dur": e - b}
               for name, (b, e) in other]
    (folder / name).write_text(json.dumps({"baseTimeNanoseconds": BASE_NS, "traceEvents": events}))


def _write_windows(folder: Path, windows: dict[str, tuple[float, float]]) -> None:
    """The window each worker recorded, (start, end) in us of the window, beside its trace."""
    for name, (begin, end) in windows.items():
        window_path(folder / name).write_text(
            json.dumps([(BASE_US + begin) / 1e6, (BASE_US + end) / 1e6]))


def test_the_gpus_time_is_added_up_by_process_with_the_turns_between_them(tmp_path):
    # A 10 ms window from 0: detection's kernels 0-3 and 5-6 ms (one overlapping its own at
    # 2-2.5), roi_landmark's 3.5-4.5 and 6.2-7 ms, and a kernel before the window that ends in it.
    _write_trace(tmp_path, "detection:cuda:0-11.json",
                 kernels=[(0, 3000), (2000, 2500), (5000, 6000), (-500, 200)],
                 copies=[(0, 9000)],
                 other=[("cudaGraphLaunch", (100, 110)), ("cudaLaunchKernel", (200, 205)),
                        ("cuLaunchKernel", (300, 305)), ("cudaStreamSynchronize", (400, 900)),
                        ("cudaGraphLaunch", (20_000, 20_010))])  # the last after the window
    _write_trace(tmp_path, "roi_landmark:cuda:0:0-12.json", kernels=[(3500, 4500), (6200, 7000)])
    _write_trace(tmp_path, "capture:cuda:0:0-13.json", kernels=[(20_000, 21_000)])  # after it

    summary = gpu_trace.summarize(tmp_path, BASE_US / 1e6, 0.010)

    detection = summary["by_process"]["detection:cuda:0"]
    assert detection["kernel_ms"] == 4.0  # 0-3 and 5-6; the early kernel's 0-0.2 inside 0-3
    assert detection["kernels"] == 4 and detection["copy_ms"] == 9.0
    assert detection["graph_launches"] == 1 and detection["kernel_launches"] == 2
    # Spans in the window 200, 500, 1000 and 3000 us: the median the upper middle one.
    assert detection["median_kernel_us"] == 1000.0 and detection["small_kernels_share"] == 0.0
    assert summary["by_process"]["roi_landmark:cuda:0:0"]["kernel_ms"] == 1.8
    assert summary["by_process"]["capture:cuda:0:0"]["kernel_ms"] == 0.0
    assert summary["kernel_busy_ms"] == 5.8 and summary["kernel_busy_share"] == 0.58
    assert summary["sum_of_processes_kernel_ms"] == 5.8  # time slices: nothing side by side
    # Turns: detection -> roi at 3.5 (gap 0.5 ms), roi -> detection at 5 (0.5), detection ->
    # roi at 6.2 (0.2); no idle gap within one process.
    assert summary["turns"] == 3
    assert summary["gap_at_turn_mean_us"] == pytest.approx(400.0)
    assert summary["idle_at_turns_ms"] == 1.2 and summary["idle_within_processes_ms"] == 0.0
    assert "detection:cuda:0" in "\n".join(gpu_trace.table_lines(summary))


def test_only_the_time_every_worker_recorded_is_counted(tmp_path):
    # Asked for 0-10 ms; one worker recorded 2-10 ms, the other 0-8 ms: 2-8 ms is counted.
    _write_trace(tmp_path, "detection:cuda:0-11.json", kernels=[(0, 3000), (7000, 9000)])
    _write_trace(tmp_path, "roi_landmark:cuda:0:0-12.json", kernels=[(4000, 5000)])
    _write_windows(tmp_path, {"detection:cuda:0-11.json": (2000, 10_000),
                              "roi_landmark:cuda:0:0-12.json": (0, 8000)})

    summary = gpu_trace.summarize(tmp_path, BASE_US / 1e6, 0.010)

    assert summary["window_s"] == pytest.approx(0.006) and summary["requested_window_s"] == 0.010
    assert summary["by_process"]["detection:cuda:0"]["kernel_ms"] == pytest.approx(2.0)  # 2-3, 7-8
    assert summary["kernel_busy_ms"] == pytest.approx(3.0)


def test_workers_that_recorded_no_common_time_give_an_error_not_a_table(tmp_path):
    # One worker recorded 0-4 ms of the 10 asked, the other (killed, restarted, late) 6-10 ms.
    _write_trace(tmp_path, "detection:cuda:0-11.json", kernels=[(0, 3000)])
    _write_trace(tmp_path, "roi_landmark:cuda:0:0-12.json", kernels=[(7000, 8000)])
    _write_windows(tmp_path, {"detection:cuda:0-11.json": (0, 4000),
                              "roi_landmark:cuda:0:0-12.json": (6000, 10_000)})

    summary = gpu_trace.summarize(tmp_path, BASE_US / 1e6, 0.010)

    assert set(summary) == {"error"}
    assert "no time that every worker recorded" in summary["error"]
    assert "roi_landmark:cuda:0:0 +0.006..+0.010 s" in summary["error"]


def test_a_file_that_is_not_a_workers_trace_is_refused(tmp_path):
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(ValueError, match="not a worker's trace"):
        gpu_trace.summarize(tmp_path, 0.0, 1.0)


def test_a_worker_records_its_window_once_when_the_request_comes(tmp_path):
    torch = pytest.importorskip("torch")
    request = tmp_path / "request.json"
    window = GpuTraceWindow(request, host_activity=True)
    window.tick("roi_landmark:cuda:0:0")  # no request yet: nothing happens, nothing is done
    assert not window.done and window._profiler is None

    start = time.time() + 0.2
    request.write_text(json.dumps({"start_unix_s": start, "seconds": 0.3,
                                   "out_dir": str(tmp_path / "traces")}))
    window._next_check_monotonic = 0.0  # its next heartbeat's look
    while not window.done:
        window.tick("roi_landmark:cuda:0:0")
        torch.ones(64).sum()  # something for the profiler to see
        time.sleep(0.01)
    written = list((tmp_path / "traces").glob("*.json"))
    assert [path.name.rsplit("-", 1)[0] for path in written] == ["roi_landmark:cuda:0:0"]
    trace = json.loads(written[0].read_text())
    assert any(event.get("ph") == "X" for event in trace["traceEvents"])
    started, stopped = json.loads(window_path(written[0]).read_text())  # what it recorded
    assert start <= started < stopped and stopped - start >= 0.3
    assert not list((tmp_path / "traces").glob("*.part"))  # exported whole, then named
    window.tick("roi_landmark:cuda:0:0")  # once only
    assert len(list((tmp_path / "traces").glob("*.json"))) == 1


def test_a_bad_request_ends_the_workers_window_without_a_trace(tmp_path, caplog):
    request = tmp_path / "request.json"
    request.write_text("{not json")
    window = GpuTraceWindow(request)
    window.tick("detection:cuda:0")
    assert window.done and "unreadable" in caplog.text


def test_a_process_without_cuda_records_nothing(tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"start_unix_s": 0.0, "seconds": 1.0, "out_dir": str(tmp_path / "t")}))
    window = GpuTraceWindow(request)  # CUDA activity: this machine has no GPU
    for _ in range(2):
        window.tick("output")
    assert window.done and not (tmp_path / "t").exists()


def test_small_kernels_are_counted_as_such(tmp_path):
    # Three kernels of 2, 4 and 40 us: two of three under 10 us, median 4.
    _write_trace(tmp_path, "roi_landmark:cuda:0:0-12.json", kernels=[(0, 2), (10, 14), (20, 60)])
    row = gpu_trace.summarize(tmp_path, BASE_US / 1e6, 0.001)["by_process"]["roi_landmark:cuda:0:0"]
    assert row["median_kernel_us"] == 4.0 and row["small_kernels_share"] == 0.667
