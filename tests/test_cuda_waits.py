"""Note [Blocking waits] (shared/transport/cuda_driver.py): a facecast process's primary context
is made with
CU_CTX_SCHED_BLOCKING_SYNC, so that waiting for the GPU sleeps instead of spinning a core."""

from __future__ import annotations

import subprocess
import sys

import pytest

from facecast.shared.transport.cuda_driver import cuda_unavailable_reason

pytestmark = pytest.mark.gpu

_CHILD = """
import ctypes, time, torch
from facecast.shared.transport.cuda_driver import wait_by_blocking
if {block}:
    wait_by_blocking(0)
x = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
libcuda = ctypes.CDLL("libcuda.so.1")
device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
libcuda.cuDeviceGet(ctypes.byref(device), 0)
libcuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
# CPU time while the host waits for ~0.5 s of GPU work.
start_wall, start_cpu = time.monotonic(), time.process_time()
for _ in range(200):
    y = x @ x
torch.cuda.synchronize()
print(flags.value & 7, active.value, time.process_time() - start_cpu, time.monotonic() - start_wall)
"""


def _run(block: bool) -> tuple[int, int, float, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD.format(block=block)], check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return int(out[0]), int(out[1]), float(out[2]), float(out[3])


def test_primary_context_blocks_instead_of_spinning():
    reason = cuda_unavailable_reason()
    if reason:
        pytest.skip(f"needs CUDA: {reason}")
    flags, active, cpu_s, wall_s = _run(block=True)
    assert active == 1 and flags == 0x04, (flags, active)  # CU_CTX_SCHED_BLOCKING_SYNC
    spin_flags, _, spin_cpu_s, spin_wall_s = _run(block=False)
    print(f"host CPU while waiting for the GPU: {cpu_s:.3f} s of {wall_s:.3f} s blocking, "
          f"{spin_cpu_s:.3f} s of {spin_wall_s:.3f} s with the default flags ({spin_flags})")
    # The default spins for the whole wait: that is what the flag removes.
    assert cpu_s < 0.5 * spin_cpu_s, (cpu_s, spin_cpu_s)
