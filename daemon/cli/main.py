"""The `facecast` command. Runs on the CLI side: it parses, validates and delegates.

Its `--help` is for a lab's user, not for this file's reader (DESCRIPTION, EPILOG): what
facecast does and where to start; the docstring is not shown.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap


def _transport_check(args) -> int:
    from facecast.daemon.cli import transport_check

    return transport_check.main(args.transport)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show liblsl's, OpenCV's and FFmpeg's own log lines "
                        "(hidden by default: facecast reports what they are about itself)")


def _add_verb(commands, name: str, text: str, add_arguments, handler, verbose: bool = True):
    """One command: its parser, its module's arguments, `--verbose` unless it has no third-party
    logs to show, and the function that runs it."""
    parser = commands.add_parser(name, help=text)
    add_arguments(parser)
    if verbose:
        _add_verbose(parser)
    parser.set_defaults(handler=handler)


def _quiet_third_party_logs(args) -> None:
    """Before the command touches LSL or OpenCV (`run` does it itself, in its runtime
    directory, once its config is read)."""
    if getattr(args, "verbose", None) is None or args.command == "run":
        return
    from facecast.daemon import runtime_dir
    from facecast.shared import third_party_logs

    try:
        place = runtime_dir.for_daemon("")
    except runtime_dir.UnsafeRuntimeDir as exc:  # liblsl's configuration copy is not put there
        print(f"facecast: warning: {exc}; liblsl's INFO lines will show", file=sys.stderr)
        if not args.verbose:
            third_party_logs.quiet_opencv()
        return
    third_party_logs.quiet(place, verbose=args.verbose)


DESCRIPTION = (
    "facecast measures every face your cameras see (face box, 478-point mesh, head pose, 52 "
    "blendshapes, a track id per person) and publishes the measurements as Lab Streaming Layer "
    "streams, stamped with each frame's capture time, for LabRecorder and your analysis "
    "scripts. It runs as a daemon (`facecast run`, or the systemd unit); the other commands "
    "check a config or this machine, or ask the running daemon.")
EPILOG = """\
start here:
  facecast run --config config/default.toml   two synthetic cameras, no camera needed
  facecast check-config lab.toml              is my config right, and can its cameras work here?
  facecast cameras                            which cameras does this machine have?
  facecast status                             what is the running daemon doing, and why?

Every command has its own --help. More: README.md in facecast's repository.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="facecast", description=textwrap.fill(DESCRIPTION, 78),
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="default: warning; for `run`, the config's daemon.log_level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     title="commands")

    from facecast.daemon.cli import check_config, models

    check = commands.add_parser("check-config", help="validate a config file (exit 2 if invalid)")
    check.add_argument("config")
    check.set_defaults(handler=check_config.main)

    models.add_arguments(commands.add_parser("models", help="manage the model cache"))

    transport = commands.add_parser(
        "transport-check", help="prove the frame transport between two fresh processes")
    transport.add_argument("--transport", nargs="+", default=["auto", "shm"],
                           choices=["auto", "cuda_ipc", "shm"])
    transport.set_defaults(handler=_transport_check)

    from facecast.daemon.cli import cameras, doctor, run, status, streams

    _add_verb(commands, "doctor", "check this machine: GPU, NVML, CUDA IPC, LSL loopback, models",
              doctor.add_arguments, doctor.main)
    _add_verb(commands, "streams", "list facecast's LSL streams visible here, with measured rates",
              streams.add_arguments, streams.main)
    _add_verb(commands, "cameras", "list this machine's video devices and their capture modes, or "
              "--probe a stream URL or file", cameras.add_arguments, cameras.main)
    _add_verb(commands, "run", "run the daemon in the foreground", run.add_arguments, run.main)

    from facecast.daemon.cli import participants, record

    _add_verb(commands, "record", "record video of the cameras: `record start [--cameras ...] "
              "[--dir ...]`, `record stop`", record.add_arguments, record.main, verbose=False)
    _add_verb(commands, "enroll", "enrol a participant from photos or a camera: their face "
              "embeddings go into the gallery, the pictures are not kept",
              participants.add_enroll_arguments, participants.enroll_main)
    _add_verb(commands, "participants", "list the enrolled participants, or `remove NAME`",
              participants.add_participants_arguments, participants.participants_main,
              verbose=False)

    for name, handler, text in (
        ("status", status.status_main, "ask the running daemon what it is doing"),
        ("reload", status.reload_main, "make the running daemon re-read its config"),
        ("stop", status.stop_main, "stop the running daemon in order"),
    ):
        sub = commands.add_parser(name, help=text)
        status.add_arguments(sub)
        sub.set_defaults(handler=handler)

    from facecast.daemon.cli import analyze

    _add_verb(commands, "analyze", "measure faces in recorded video files, every frame, with the "
              "daemon's models: a table per video (CSV), resumable", analyze.add_arguments,
              analyze.main)

    args = parser.parse_args(argv)
    args.log_level_explicit = args.log_level
    logging.basicConfig(level=(args.log_level or "warning").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_third_party_logs(args)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
