"""torch's own view of each worker's GPU memory (messages.TorchMemory): what its caching allocator
gives live tensors, holds from the driver, and the peak, summed over the GPUs the process used
(facecast.workers.base.torch_memory), read only where torch is already there with CUDA; carried by
heartbeats to the supervisor, by the status reply to `facecast status` (a column next to NVML's
GPU MiB) and summed by role in bench/pipeline.py. No GPU here: torch is played by a stand-in with
its API's shape, and the real (CPU) torch shows that nothing is read or made without CUDA."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import zmq

from facecast.daemon import control
from facecast.daemon.cli.status import TORCH_HEADING, render
from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import WorkerProcess, WorkerState
from facecast.daemon.sd_notify import Notifier
from facecast.daemon.supervisor import Supervisor
from facecast.shared import config as config_mod
from facecast.shared.transport import messages
from facecast.shared.transport.messages import DaemonStatus, Heartbeat, TorchMemory, WorkerStatus
from facecast.workers import base

MIB = 2**20


def _stats(allocated_mib: float, reserved_mib: float, peak_mib: float) -> dict[str, int]:
    """The keys of torch.cuda.memory_stats that matter, among others that do not."""
    return {"allocated_bytes.all.current": int(allocated_mib * MIB),
            "allocated_bytes.all.peak": int(peak_mib * MIB),
            "reserved_bytes.all.current": int(reserved_mib * MIB),
            "reserved_bytes.all.peak": 99 * MIB, "num_alloc_retries": 3}


def test_the_figures_are_summed_over_the_devices_in_mib():
    memory = base.torch_memory_from_stats([_stats(812.25, 1024, 900.5), _stats(100, 200, 150)])
    assert memory == TorchMemory(allocated_mib=912.2, reserved_mib=1224.0,
                                 peak_allocated_mib=1050.5)
    # A device the process never used has no counters (or zeros): it adds nothing.
    assert base.torch_memory_from_stats([_stats(10, 20, 30), {}]) == TorchMemory(
        allocated_mib=10.0, reserved_mib=20.0, peak_allocated_mib=30.0)
    assert base.torch_memory_from_stats([]) == TorchMemory(
        allocated_mib=0.0, reserved_mib=0.0, peak_allocated_mib=0.0)


class FakeCuda:
    """torch.cuda's calls that torch_memory makes; memory_stats refuses to be called without
    CUDA, as reading it then would be a bug."""

    def __init__(self, stats_by_device: list[dict[str, int]] | None) -> None:
        self.stats_by_device = stats_by_device  # None: CUDA not initialized
        self.asked: list[int] = []

    def is_initialized(self) -> bool:
        return self.stats_by_device is not None

    def device_count(self) -> int:
        return len(self.stats_by_device)

    def memory_stats(self, device: int) -> dict[str, int]:
        assert self.stats_by_device is not None, "memory_stats read without CUDA"
        self.asked.append(device)
        return self.stats_by_device[device]


def _fake_torch(monkeypatch, stats_by_device, initializing: bool = False) -> FakeCuda:
    torch = types.ModuleType("torch")
    torch.cuda = FakeCuda(stats_by_device)
    if initializing:  # as importlib marks a module whose import is under way
        torch.__spec__ = types.SimpleNamespace(_initializing=True)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch.cuda


def test_torchs_memory_is_read_only_where_torch_has_cuda(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert base.torch_memory() is None  # torch not imported (output, console, recorder)
    cuda = _fake_torch(monkeypatch, None)
    assert base.torch_memory() is None  # imported, models on the CPU: no CUDA
    cuda = _fake_torch(monkeypatch, [_stats(1, 2, 3)], initializing=True)
    assert base.torch_memory() is None and cuda.asked == []  # a camera thread importing it
    cuda = _fake_torch(monkeypatch, [_stats(812, 1024, 900), _stats(0, 0, 0)])
    assert base.torch_memory() == TorchMemory(allocated_mib=812.0, reserved_mib=1024.0,
                                              peak_allocated_mib=900.0)
    assert cuda.asked == [0, 1]


def test_the_real_cpu_torch_is_neither_imported_nor_given_cuda():
    """In a fresh process: no torch imported for it; torch on the CPU reports nothing and has
    still no CUDA after being asked."""
    script = textwrap.dedent("""
        import sys
        from facecast.workers.base import torch_memory
        assert torch_memory() is None
        assert "torch" not in sys.modules, "torch_memory imported torch"
        import torch
        torch.zeros(4) + 1
        assert torch_memory() is None
        assert not torch.cuda.is_initialized(), "torch_memory initialized CUDA"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_every_heartbeat_carries_it_booting_or_not(runtime_dir, monkeypatch):
    _fake_torch(monkeypatch, [_stats(812, 1024, 900)])
    endpoint = f"ipc://{runtime_dir}/control"
    with zmq.Context() as context:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        worker = base.Worker("roi_landmark:cuda:0:0", endpoint, context)
        try:
            assert worker.state == "booting"
            worker.heartbeat_if_due()
            assert router.poll(10_000), "no heartbeat"
            heartbeat = messages.decode(router.recv_multipart()[-1])
        finally:
            worker.control.close(linger=0)
            router.close()
    assert isinstance(heartbeat, Heartbeat) and heartbeat.cameras == []
    assert heartbeat.torch_memory == TorchMemory(allocated_mib=812.0, reserved_mib=1024.0,
                                                 peak_allocated_mib=900.0)


def test_the_supervisor_keeps_each_workers_last_figures_for_status(runtime_dir, monkeypatch):
    config = config_mod.loads(f'[daemon]\nruntime_dir = "{runtime_dir}"\n'
                              '[[cameras]]\nid = "cam0"\nsource = "synthetic"\n')
    supervisor = Supervisor(config, "facecast.toml", gpus=1, notifier=Notifier({}))
    alive = {"roi_landmark:cuda:0:0": True, "output": True}

    def worker(name: str, role: str, pid: int) -> WorkerProcess:
        """A running record whose process is a stand-in (alive while `alive` says so)."""
        record = WorkerProcess(WorkerSpec(name, role, ("cam0",), "cuda:0"))
        record.state = WorkerState.RUNNING
        record.popen = types.SimpleNamespace(pid=pid, poll=lambda: None if alive[name] else 0)
        supervisor.workers._workers[name] = record
        return record

    roi = worker("roi_landmark:cuda:0:0", "roi_landmark", 11)
    output = worker("output", "output", 12)
    monkeypatch.setattr(supervisor.gpu_monitor, "memory_by_pid", lambda: {11: 1536.0})
    first = TorchMemory(allocated_mib=700.0, reserved_mib=1000.0, peak_allocated_mib=800.0)
    latest = TorchMemory(allocated_mib=812.0, reserved_mib=1024.0, peak_allocated_mib=900.0)
    for memory in (first, latest):
        control._on_heartbeat(supervisor, b"", roi, Heartbeat(worker=roi.name, state="running",
                                                               torch_memory=memory))
    control._on_heartbeat(supervisor, b"", output, Heartbeat(worker="output", state="running"))
    status = messages.decode(messages.encode(control.daemon_status(supervisor, "x")))
    by_name = {w.name: w for w in status.workers}
    assert by_name["roi_landmark:cuda:0:0"].torch_memory == latest
    assert by_name["roi_landmark:cuda:0:0"].gpu_memory_mib == 1536.0
    assert by_name["output"].torch_memory is None
    roi_line = next(line for line in render(status).splitlines()
                    if line.startswith("roi_landmark:cuda:0:0"))
    assert roi_line.split()[5:7] == ["1536.0", "812/1024"]
    # Its process gone, its memory is no one's: not shown from its last heartbeat.
    alive["roi_landmark:cuda:0:0"] = False
    gone = control.daemon_status(supervisor, "y")
    assert all(w.torch_memory is None for w in gone.workers)


def _status(workers: list[WorkerStatus]) -> DaemonStatus:
    return DaemonStatus(reply_to="x", pid=1, uptime_s=5.0, config_path="/etc/facecast.toml",
                        ready=True, workers=workers, cameras={}, stages={})


def _worker(name: str, role: str, gpu_mib: float | None = None,
            torch_memory: TorchMemory | None = None, standby: bool = False) -> WorkerStatus:
    return WorkerStatus(name=name, role=role, pid=11, state="running", restarts=0, uptime_s=3.0,
                        gpu_memory_mib=gpu_mib, torch_memory=torch_memory, standby=standby)


def test_status_shows_torchs_used_and_held_next_to_nvmls_only_when_some_worker_has_it():
    memory = TorchMemory(allocated_mib=812.4, reserved_mib=1023.6, peak_allocated_mib=900.0)
    lines = render(_status([_worker("roi_landmark:cuda:0:0", "roi_landmark", 2048.5, memory),
                            _worker("capture:cam0", "capture", 300.0),
                            _worker("output", "output")])).splitlines()
    heading = lines[2]
    assert heading.index("GPU MiB") < heading.index(TORCH_HEADING) < heading.index("detail")
    cells = {line.split()[0]: line.split()[5:7] for line in lines[3:6]}
    assert cells == {"roi_landmark:cuda:0:0": ["2048.5", "812/1024"],
                     "capture:cam0": ["300.0", "-"], "output": ["-", "-"]}
    # The column ends where its heading does, on every line.
    end = heading.index(TORCH_HEADING) + len(TORCH_HEADING)
    assert all(line[end - 1] != " " and line[end] == " " for line in lines[3:6])
    # No worker with torch's figures (the CPU, or workers that predate them): no column.
    without = render(_status([_worker("capture:cam0", "capture", 300.0),
                              _worker("output", "output")]))
    assert "GPU MiB" in without and TORCH_HEADING not in without


@pytest.fixture
def pipeline():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    try:
        import pipeline
        yield pipeline
    finally:
        sys.path.remove(str(Path(__file__).resolve().parent.parent / "bench"))


def test_the_bench_sums_torchs_figures_by_role_spares_apart(pipeline):
    def memory(allocated, reserved, peak):
        return TorchMemory(allocated_mib=allocated, reserved_mib=reserved,
                           peak_allocated_mib=peak)

    status = _status([
        _worker("roi_landmark:cuda:0:0", "roi_landmark", 2000.0, memory(800.25, 1000.0, 900.0)),
        _worker("roi_landmark:cuda:0:1", "roi_landmark", 2100.0, memory(700.0, 1100.3, 750.0)),
        _worker("standby:roi_landmark:cuda:0", "roi_landmark", 900.0, memory(300.0, 400.0, 310.0),
                standby=True),
        _worker("capture:cam0", "capture", 300.0), _worker("output", "output")])
    by_role = pipeline.torch_memory_by_role(status)
    assert by_role == {
        "roi_landmark": {"allocated_mib": 1500.2, "reserved_mib": 2100.3,
                         "peak_allocated_mib": 1650.0},
        "roi_landmark (spares)": {"allocated_mib": 300.0, "reserved_mib": 400.0,
                                  "peak_allocated_mib": 310.0}}
    # The NVML figures' key is as it was.
    assert pipeline.gpu_memory_by_role(status) == {"roi_landmark": 4100.0,
                                                   "roi_landmark (spares)": 900.0,
                                                   "capture": 300.0}
    rows = [{"cameras": 64, "transport": "cuda_ipc", "torch_memory_mib_by_role": by_role},
            {"cameras": 8, "transport": "shm"}]  # a row of a bench that predates the key
    table = pipeline.by_role_table(rows, "torch_memory_mib_by_role", "torch:",
                                   cell=pipeline._torch_memory_cell)
    assert table[3] == "| cameras | transport | roi_landmark | roi_landmark (spares) |"
    assert table[5] == "| 64 | cuda_ipc | 1500 / 2100 / 1650 | 300 / 400 / 310 |"
    assert len(table) == 6
    assert pipeline.by_role_table([rows[1]], "torch_memory_mib_by_role", "torch:") == []
