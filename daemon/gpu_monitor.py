"""GPU utilisation and memory for `facecast status`, and how many GPUs the daemon gets, through
NVML. Runs in the supervisor only.

Note [Visible GPUs]
    The workers reach GPUs through CUDA, which shows a process only the devices
    `CUDA_VISIBLE_DEVICES` names (indices or UUIDs, in that order, up to the first that names
    none), renumbered from 0; NVML, which the supervisor uses to stay free of a CUDA context,
    sees every GPU of the machine. So the supervisor counts what CUDA will show its workers,
    and reports GPU k of `status` as CUDA's device k (`cuda:k`, the workers' name for it),
    whatever NVML's index of it: with CUDA_VISIBLE_DEVICES=1 on a two-GPU machine the daemon
    has one GPU, `cuda:0`, NVML's second. A MIG instance (MIG-...) cannot be matched to an
    NVML device here: it counts as a GPU, without utilisation or memory in `status`.
"""

from __future__ import annotations

import os

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
        """The GPUs the workers will see (Note [Visible GPUs])."""
        if self._nvml is None:
            return 0
        try:
            return len(self.visible())
        except Exception as exc:  # noqa: BLE001 - NVML half-working: every GPU, and say so
            self.note = f"NVML could not list the GPUs CUDA_VISIBLE_DEVICES names: {exc}"
            return int(self._nvml.nvmlDeviceGetCount())

    def visible(self) -> list[int | None]:
        """NVML's index of each GPU CUDA shows the workers, in CUDA's order (None: a MIG
        instance, which NVML's device list does not hold); Note [Visible GPUs]."""
        nvml = self._nvml
        indices = list(range(nvml.nvmlDeviceGetCount()))
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        if listed is None:
            return indices
        uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in indices]
        visible: list[int | None] = []
        for entry in (part.strip() for part in listed.split(",")):
            if entry.startswith("MIG-"):
                found = None
            elif entry.isdigit():
                found = int(entry) if int(entry) in indices else -1
            else:  # a UUID or a unique prefix of one, "GPU-" optional
                matches = [i for i, uuid in enumerate(uuids)
                           if entry and (uuid.startswith(entry) or uuid.startswith("GPU-" + entry))]
                found = matches[0] if len(matches) == 1 else -1
            if found == -1 or (found is not None and found in visible):
                break  # CUDA stops at the first entry that names no (new) device
            visible.append(found)
        return visible

    def status(self) -> list[GpuStatus]:
        if self._nvml is None:
            return []
        nvml, gpus = self._nvml, []
        try:
            for index, nvml_index in enumerate(self.visible()):
                if nvml_index is None:
                    continue  # a MIG instance: nothing NVML can say here
                handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
                gpus.append(GpuStatus(
                    index=index, name=_text(name),
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
            for nvml_index in self.visible():
                if nvml_index is None:
                    continue
                handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
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


def _text(value) -> str:
    """NVML's strings are bytes in older pynvml releases."""
    return value.decode() if isinstance(value, bytes) else str(value)
