"""The CUDA driver, reached through PyCUDA, imported lazily and only on the CUDA path.

PyCUDA links libcuda.so.1 at import, so on a machine without the NVIDIA driver the import itself
fails: every entry point here turns that, and every other reason CUDA IPC cannot be used, into a
`TransportUnavailable` whose text is the reason that status and the log show.

Note [Driver access]
    PyCUDA is the project's named way to the driver: IPC memory handles, the ring's own
    allocation and its address range, the primary context, the driver version. Two calls it
    does not offer go to libcuda.so.1 directly through ctypes (`_libcuda`), in this module and
    nowhere else:
    - cuDevicePrimaryCtxSetFlags (Note [Blocking waits]): PyCUDA 2026.1 has no binding for it
      (its _driver module references no such symbol), and it must run before PyCUDA or torch
      creates the primary context.
    - cuMemHostRegister / cuMemHostUnregister of a shm ring's mapping (Note [Pinned shm
      mappings]): PyCUDA's register_host_memory refused a numpy view of shared
      memory on the H200 host ("returned a result with an exception set"). This used to go
      through torch's cudart binding (cudaHostRegister, which calls cuMemHostRegister in the
      same primary context); one raw binding for both calls is one fewer way in.
    Each ctypes call's CUresult is checked and turned into an error that names the call.

Note [One context]
    Every facecast process uses the device's *primary* context, the one the CUDA runtime (and so
    PyTorch) uses: PyCUDA retains it and pushes it on the thread that uses it. A pointer that
    cuIpcOpenMemHandle returns is only valid in the context that opened it, so opening in a
    context made with `make_context()` hands PyTorch an address its context has never mapped
    (DESIGN.md §2 rule 5). `require_primary_context()` refuses any other current context; guarded
    by tests/test_cuda_rules.py::test_rule5_*.

Note [Blocking waits]
    By default (CU_CTX_SCHED_AUTO with fewer contexts than cores) a thread that waits for the GPU
    (a copy back to the host, a stream synchronisation) spins on a core until the GPU is done.
    Every facecast worker waits for its results once per frame, so each spun a core for the
    length of its GPU work, and the CPU is what a lab machine needs for decoding cameras. The
    primary context is therefore made with CU_CTX_SCHED_BLOCKING_SYNC (`wait_by_blocking`,
    before torch or PyCUDA create it): a wait sleeps on an OS primitive and costs a wake-up of
    tens of microseconds instead of a core.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import threading
from typing import Any

import torch

from facecast.shared.transport.ring_errors import TransportUnavailable

_pushed = threading.local()
log = logging.getLogger(__name__)
# Held by a thread that captures a CUDA graph, and by one that does CUDA work which a capture
# in another thread of the process must not overlap: a ring's creation (a device-wide
# synchronisation) and a decoder's. Such work during a capture fails ("operation not permitted
# when stream is capturing") and invalidates the capture (Note [A frame's GPU work in one
# graph], facecast.shared.transport.cuda_ring).
CAPTURE_LOCK = threading.Lock()
_CU_CTX_SCHED_BLOCKING_SYNC = 0x04
_blocking_devices: set[int] = set()


def wait_by_blocking(device_index: int) -> None:
    """Note [Blocking waits]: call before anything in this process uses CUDA on the device.
    Best effort: a driver that refuses leaves the default, and says so in the log."""
    if device_index in _blocking_devices:
        return
    _blocking_devices.add(device_index)
    libcuda = _libcuda()
    if libcuda is None:
        return  # no driver: nothing will wait for a GPU here
    device = ctypes.c_int()
    set_flags = getattr(libcuda, "cuDevicePrimaryCtxSetFlags_v2", None) or getattr(
        libcuda, "cuDevicePrimaryCtxSetFlags")
    for step, result in (("cuInit", lambda: libcuda.cuInit(0)),
                         ("cuDeviceGet", lambda: libcuda.cuDeviceGet(ctypes.byref(device),
                                                                     device_index)),
                         ("cuDevicePrimaryCtxSetFlags",
                          lambda: set_flags(device, _CU_CTX_SCHED_BLOCKING_SYNC))):
        code = result()
        if code != 0:
            log.info("GPU %d: %s returned CUDA error %d; waits for the GPU will spin",
                     device_index, step, code)
            return


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL | None:
    """libcuda.so.1 for the calls PyCUDA lacks (Note [Driver access]); None without a driver."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def register_host_range(device_index: int, pointer: int, nbytes: int) -> None:
    """Page-lock host memory that PyTorch did not allocate (a shm mapping), in the device's
    primary context, so that copies from it are asynchronous DMAs (Note [Pinned shm mappings]).
    Raises TransportUnavailable or RuntimeError with the reason."""
    driver(device_index)  # the primary context, current on this thread (Note [One context])
    libcuda = _libcuda()
    register = getattr(libcuda, "cuMemHostRegister_v2", None) or libcuda.cuMemHostRegister
    code = register(ctypes.c_void_p(pointer), ctypes.c_size_t(nbytes), ctypes.c_uint(0))
    if code != 0:
        raise RuntimeError(f"cuMemHostRegister of {nbytes} bytes returned CUDA error {code}")


def unregister_host_range(device_index: int, pointer: int) -> None:
    """Undo `register_host_range` (before the memory is unmapped)."""
    driver(device_index)
    code = _libcuda().cuMemHostUnregister(ctypes.c_void_p(pointer))
    if code != 0:
        raise RuntimeError(f"cuMemHostUnregister returned CUDA error {code}")


def cuda_unavailable_reason() -> str | None:
    """Why CUDA IPC cannot work in this process, or None if it may (validation still decides)."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to PyTorch (no GPU or no NVIDIA driver)"
    try:
        import pycuda.driver  # noqa: F401
    except ImportError as exc:
        return f"pycuda cannot be imported ({exc}); install facecast[gpu]"
    return None


def driver(device_index: int) -> Any:
    """pycuda.driver, with this thread on the device's primary context (Note [One context])."""
    reason = cuda_unavailable_reason()
    if reason:
        raise TransportUnavailable(reason)
    import pycuda.driver as cuda

    if device_index >= torch.cuda.device_count():
        raise TransportUnavailable(
            f"GPU {device_index} does not exist here ({torch.cuda.device_count()} visible)"
        )
    wait_by_blocking(device_index)
    cuda.init()
    torch.cuda.init()
    torch.zeros(1, device=f"cuda:{device_index}")  # makes the runtime create the primary context
    pushed = getattr(_pushed, "devices", None)
    if pushed is None:
        pushed = _pushed.devices = {}
    if device_index not in pushed:
        context = cuda.Device(device_index).retain_primary_context()
        context.push()
        pushed[device_index] = context
        atexit.register(_pop_quietly, context)
    return cuda


def release_thread() -> None:
    """Pop the primary contexts `driver` pushed on this thread. A thread that ends with contexts
    on PyCUDA's (thread-local) stack makes PyCUDA abort the whole process ("The context stack
    was not empty upon module cleanup"): a capture worker's camera thread calls this last."""
    pushed = getattr(_pushed, "devices", None)
    if not pushed:
        return
    import pycuda.driver as cuda

    for _ in range(len(pushed)):
        try:
            cuda.Context.pop()
        except Exception:  # noqa: BLE001 - nothing current any more: nothing to pop
            break
    pushed.clear()


def _pop_quietly(context) -> None:
    try:
        context.pop()
    except Exception:  # interpreter teardown: the context may already be gone
        pass


def require_primary_context(device_index: int) -> None:
    """Refuse to map IPC memory in anything but the primary context (Note [One context])."""
    cuda = driver(device_index)
    current = cuda.Context.get_current()
    primary = _pushed.devices[device_index]
    if current is None or current.handle != primary.handle:
        raise TransportUnavailable(
            "the current CUDA context is not the device's primary context (one made with "
            "make_context()?); memory opened there would not be valid for PyTorch"
        )


def device_identity(device_index: int) -> tuple[str, int]:
    """(GPU UUID, driver version) that producer and consumer must share (DESIGN.md §2 rule 7)."""
    cuda = driver(device_index)
    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    return uuid, int(cuda.get_driver_version())


def local_device_index(uuid: str) -> int | None:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


class _DeviceMemory:
    """A raw device pointer presented to PyTorch through the CUDA Array Interface (no copy)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
            "stream": None,  # ordering is ours to manage (Note [Events order slots])
        }


def tensor_at(pointer: int, nbytes: int, device_index: int) -> torch.Tensor:
    """A uint8 tensor over device memory that PyTorch did not allocate (and will not free)."""
    return torch.as_tensor(_DeviceMemory(pointer, nbytes), device=f"cuda:{device_index}")
