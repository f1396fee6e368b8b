"""GPU utilisation and memory for `facecast status`, through NVML. Runs in the supervisor only."""

from __future__ import annotations

from facecast.shared.transport.messages import GpuStatus


class GpuMonitor:
    """NVML, initialised once for the supervisor's life (an init can take seconds where the
    driver's persistence mode is off, far too slow for every `facecast status`). No CUDA
    context here: the supervisor stays light."""

    def __init__(self) -> None:
        self.note = ""
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # no driver, no library: the CPU it is  # noqa: BLE001
            self.note = f"NVML unavailable: {exc}"

    def count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount()) if self._nvml is not None else 0

    def status(self) -> list[GpuStatus]:
        if self._nvml is None:
            return []
        nvml, gpus = self._nvml, []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
                gpus.append(GpuStatus(
                    index=index, name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_used_mib=round(memory.used / 2**20, 1),
                    memory_total_mib=round(memory.total / 2**20, 1),
                    utilization_pct=float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                ))
        except Exception as exc:  # noqa: BLE001 - a GPU fell off the bus: report, don't die
            self.note = f"NVML query failed: {exc}"
        return gpus

    def memory_by_pid(self) -> dict[int, float]:
        """Device memory (MiB) each process holds, all GPUs together, as NVML sees it: where
        the daemon's GPU memory goes, worker by worker (`facecast status`). Empty without NVML;
        a process NVML cannot account (usedGpuMemory unavailable) is left out."""
        if self._nvml is None:
            return {}
        nvml, used = self._nvml, {}
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.usedGpuMemory is not None:
                        used[process.pid] = used.get(process.pid, 0.0) + process.usedGpuMemory / 2**20
        except Exception as exc:  # noqa: BLE001 - a GPU fell off the bus: report, don't die
            self.note = f"NVML query failed: {exc}"
        return {pid: round(mib, 1) for pid, mib in used.items()}

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None
