"""The supervisor's NVML monitor: which GPUs the daemon gets (those CUDA_VISIBLE_DEVICES leaves
the workers, Note [Visible GPUs]) and where the daemon's GPU memory goes, worker by worker (each
process's device memory summed over the GPUs, `GpuMonitor.memory_by_pid`), which `facecast
status` shows per worker. NVML is played here by a stand-in with its API's shape (no GPU on this
machine); the `gpu` run of bench/pipeline.py reads the real one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from facecast.daemon.cli.status import render
from facecast.daemon.gpu_monitor import GpuMonitor
from facecast.shared.transport.messages import DaemonStatus, WorkerStatus

MIB = 2**20


class FakeNvml:
    """pynvml's calls that GpuMonitor makes, over one GPU per list of processes."""

    def __init__(self, processes_by_gpu):
        self.processes_by_gpu = processes_by_gpu

    def nvmlDeviceGetCount(self):
        return len(self.processes_by_gpu)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle}{handle}{handle}-uuid".encode()  # bytes, as older pynvml gives

    def nvmlDeviceGetName(self, handle):
        return f"NVIDIA H{handle}00"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=(handle + 1) * 1024 * MIB, total=80 * 1024 * MIB)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=10.0 * (handle + 1))

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self.processes_by_gpu[handle]]


def _monitor(nvml) -> GpuMonitor:
    monitor = GpuMonitor.__new__(GpuMonitor)  # no real NVML init
    monitor.note, monitor._nvml = "", nvml
    return monitor


@pytest.mark.parametrize("listed, visible", [
    (None, [0, 1, 2]),  # unset: every GPU
    ("1", [1]),
    ("2,0", [2, 0]),  # CUDA's order is the list's
    ("GPU-111-uuid", [1]),
    ("GPU-222", [2]),  # a unique UUID prefix
    ("0,7,1", [0]),  # CUDA stops at the first entry that names no device
    ("1,1", [1]),  # and at one that names a device again
    ("", []),
    ("-1", []),
    ("MIG-abc", [None]),  # a MIG instance: a GPU NVML cannot tell about here
])
def test_the_daemon_gets_the_gpus_cuda_shows_its_workers(monkeypatch, listed, visible):
    if listed is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    monitor = _monitor(FakeNvml([[], [], []]))
    assert monitor.visible() == visible
    assert monitor.count() == len(visible)


def test_status_names_each_gpu_as_the_workers_do(monkeypatch):
    """With CUDA_VISIBLE_DEVICES=2,0, status's GPU 0 is NVML's third (the workers' cuda:0)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    monitor = _monitor(FakeNvml([[(100, 512 * MIB)], [(101, 256 * MIB)], [(102, 128 * MIB)]]))
    gpus = monitor.status()
    assert [(g.index, g.name, g.memory_used_mib, g.utilization_pct) for g in gpus] == [
        (0, "NVIDIA H200", 3072.0, 30.0), (1, "NVIDIA H000", 1024.0, 10.0)]
    assert monitor.memory_by_pid() == {102: 128.0, 100: 512.0}  # 101 is on a hidden GPU


def test_memory_is_summed_per_process_over_the_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = _monitor(FakeNvml([
        [(100, 512 * MIB), (101, 2048 * MIB), (102, None)],  # 102: NVML cannot account it
        [(100, 256 * MIB)],
    ]))
    assert monitor.memory_by_pid() == {100: 768.0, 101: 2048.0}


def test_no_nvml_no_memory_and_a_failing_query_is_said(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _monitor(None).memory_by_pid() == {}

    class Broken(FakeNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, handle):
            raise RuntimeError("GPU is lost")

    monitor = _monitor(Broken([[]]))
    assert monitor.memory_by_pid() == {}
    assert monitor.note == "NVML query failed: GPU is lost"


def _status(workers) -> DaemonStatus:
    return DaemonStatus(reply_to="x", pid=1, uptime_s=5.0, config_path="/etc/facecast.toml",
                        ready=True, workers=workers, cameras={}, stages={})


def test_status_shows_each_workers_gpu_memory_where_known():
    workers = [WorkerStatus(name="roi_landmark:cuda:0:0", role="roi_landmark", pid=11,
                            state="running", restarts=0, uptime_s=3.0, gpu_memory_mib=2048.5),
               WorkerStatus(name="output", role="output", pid=12, state="running", restarts=0,
                            uptime_s=3.0)]
    lines = render(_status(workers)).splitlines()
    assert "GPU MiB" in lines[2]
    roi = next(line for line in lines if line.startswith("roi_landmark:cuda:0:0"))
    output = next(line for line in lines if line.startswith("output"))
    assert roi.split()[5] == "2048.5" and output.split()[5] == "-"
    # On a machine without a GPU the column is not there at all.
    cpu_only = [WorkerStatus(name="output", role="output", pid=12, state="running", restarts=0,
                             uptime_s=3.0)]
    assert "GPU MiB" not in render(_status(cpu_only))


def test_the_bench_sums_gpu_memory_by_role_spares_apart():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import pipeline

    def worker(name, role, mib, standby=False):
        return WorkerStatus(name=name, role=role, pid=1, state="running", restarts=0,
                            uptime_s=1.0, gpu_memory_mib=mib, standby=standby)

    status = _status([worker("capture:cuda:0:0", "capture", 600.0),
                      worker("capture:cuda:0:1", "capture", 650.5),
                      worker("standby:capture:cuda:0", "capture", 500.0, standby=True),
                      worker("output", "output", None)])
    assert pipeline.gpu_memory_by_role(status) == {"capture": 1250.5, "capture (spares)": 500.0}
