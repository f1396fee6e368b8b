"""Entry point of a worker process: ``python -m facecast.workers <role> <name> <control>``.

Only the supervisor starts workers this way (facecast.daemon.supervisor); see
facecast.workers.base for what a worker does with its life.

Note [Quick exit]
    Once `run` returns, the worker has closed everything it owns: rings unlinked, GPU memory
    freed, sockets closed with their linger, outlets gone. What Python's interpreter teardown
    would still do (destroy torch's and the CUDA caching allocator's state module by module,
    run every finaliser) saves nothing the kernel and the driver don't reclaim at process exit,
    and with 32 CUDA processes ending at once it took seconds, past the daemon's stop deadline,
    so that the supervisor had to SIGKILL them. So the process ends with `os._exit` after the
    logs and stdio are flushed.

Note [Expandable segments]
    torch's caching allocator keeps the blocks it carved for one batch's shapes and carves new
    ones when the next batch is larger; a worker whose batches vary (faces per frame, cameras
    per batch) ends up holding far more than it uses. With `expandable_segments` it grows and
    reuses one mapped range instead. Measured (H100, 2026-11-26, 64 replayed 1080p cameras,
    cuda_ipc, CUDA graphs, one run each): the daemon's GPU memory 27.5 -> 24.2 GB, of which the
    two roi_landmark workers 8.2 -> 6.0 GB and the detection worker 3.6 -> 3.2 GB; dropped
    frames and latencies within the spread of runs. So a worker starts with it, unless whoever
    started the daemon chose the allocator's settings themselves.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


ALLOCATOR_SETTINGS_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def use_expandable_segments(environ=os.environ) -> None:
    """Note [Expandable segments]; before torch's first CUDA allocation reads the setting."""
    if not any(name in environ for name in ALLOCATOR_SETTINGS_ENV):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def _worker_class(role: str):
    # Imported by role: a capture worker never loads the models, an output worker never torch's
    # inference stack beyond what the transport needs.
    if role == "capture":
        from facecast.workers.capture.worker import CaptureWorker
        return CaptureWorker
    if role == "detection":
        from facecast.workers.inference.detection import DetectionWorker
        return DetectionWorker
    if role == "roi_landmark":
        from facecast.workers.inference.roi_landmark import RoiLandmarkWorker
        return RoiLandmarkWorker
    if role == "output":
        from facecast.workers.output.worker import OutputWorker
        return OutputWorker
    if role == "console":
        from facecast.workers.console.worker import ConsoleWorker
        return ConsoleWorker
    if role == "recorder":
        from facecast.workers.recorder.worker import RecorderWorker
        return RecorderWorker
    raise SystemExit(f"unknown worker role {role!r} (capture, detection, roi_landmark, output, "
                     "console, recorder)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m facecast.workers")
    parser.add_argument("role")
    parser.add_argument("name")
    parser.add_argument("control", help="the supervisor's control endpoint (ipc://...)")
    args = parser.parse_args(argv)
    # A spare is lower from its first import on (Note [Spares at a lower priority]).
    from facecast.shared import cpu_priority

    cpu_priority.lower_this_process(int(os.environ.pop(cpu_priority.SPARE_NICE_ENV, "0") or 0))
    use_expandable_segments()
    from facecast.workers.base import (
        enable_stack_dumps,
        run,
        set_log_format,
        set_process_name,
    )

    # Before the role's imports (torch, a driver), which can be slow or hang themselves: a
    # SIGABRT from the supervisor shows where (Note [Stack dumps of a hung worker]), and `ps`
    # names the process meanwhile.
    enable_stack_dumps()
    set_process_name(args.name)
    from facecast.shared import terminal_log

    terminal_log.configure_worker(os.environ.get("FACECAST_LOG_LEVEL", "INFO"))
    set_log_format(args.name)
    return run(_worker_class(args.role), args.name, args.control, _connection_secret())


def _connection_secret() -> str:
    """The secret the supervisor wrote to this process's stdin at spawn (Note [Worker
    connections]); "" when started otherwise (stdin a terminal
    or /dev/null: a test's own ROUTER, which knows no secrets)."""
    if sys.stdin is None or sys.stdin.isatty():
        return ""
    secret = sys.stdin.readline().strip()
    sys.stdin.close()
    return secret


def exit_now(code: int) -> None:
    """Note [Quick exit]: everything the worker owns is closed by now (`run`'s finally)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
