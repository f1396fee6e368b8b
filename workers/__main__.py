"""Entry point of a worker process: ``python -m facecast.workers <role> <name> <control>``.

Only the supervisor starts workers this way (facecast.daemon.supervisor); see
facecast.workers.base for what a worker does with its life.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _worker_class(role: str):
    # Imported by role: a capture worker never loads the models, an output worker never torch's
    # inference stack beyond what the transport needs.
    if role == "capture":
        from facecast.workers.capture import CaptureWorker
        return CaptureWorker
    if role == "detection":
        from facecast.workers.detection import DetectionWorker
        return DetectionWorker
    if role == "roi_landmark":
        from facecast.workers.roi_landmark import RoiLandmarkWorker
        return RoiLandmarkWorker
    if role == "output":
        from facecast.workers.output import OutputWorker
        return OutputWorker
    raise SystemExit(f"unknown worker role {role!r} (capture, detection, roi_landmark, output)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m facecast.workers")
    parser.add_argument("role")
    parser.add_argument("name")
    parser.add_argument("control", help="the supervisor's control endpoint (ipc://...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("FACECAST_LOG_LEVEL", "INFO").upper())
    from facecast.workers.base import run, set_log_format

    set_log_format(args.name)

    return run(_worker_class(args.role), args.name, args.control)


if __name__ == "__main__":
    sys.exit(main())
