"""`record start --xdf` reads LabRecorderCLI's log to know when it records every stream it found
(Note [LabRecorderCLI alongside], Note [LabRecorderCLI's log is read by phrase]). A stand-in
LabRecorderCLI prints what the real one printed on 2 busy cores: its streams' threads' lines
run into each other. The real one, with a daemon's streams, is tests/test_recording.py's."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from facecast.daemon.cli import labrecorder

HOST = "testhost"
STREAMS = ("facecast rec0 face0", "facecast rec1 frames", "facecast markers")


def stand_in(tmp_path: Path, started: tuple[str, ...]) -> Path:
    """An executable that prints LabRecorderCLI's lines for STREAMS, `started` among them in
    threads' pieces that run into each other, then waits for Enter on its stdin, as the real one
    does (`record stop` writes it)."""
    found = "".join(f"Found {name}@{HOST} matching 'pred'\\n" for name in STREAMS)
    # The first two threads' pieces run into each other; the rest are lines of their own.
    pieces = [labrecorder.STARTED_PHRASE] * min(2, len(started))
    pieces += [f"{name}.\n" for name in started[:2]]
    pieces += [f"{labrecorder.STARTED_PHRASE}{name}.\n" for name in started[2:]]
    script = tmp_path / "LabRecorderCLI"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import sys
        sys.stdout.write("{found}Starting the recording\\n")
        for name in {list(STREAMS)!r}:
            sys.stdout.write(f"Opened the stream {{name}}.\\n")
            sys.stdout.write(f"Received header for stream {{name}}.\\n")
        sys.stdout.write("".join({pieces!r}))
        sys.stdout.flush()
        sys.stdin.readline()  # Enter: the recording ends
        """))
    script.chmod(0o700)
    return script


def test_streams_whose_started_lines_run_into_each_other_are_all_counted(tmp_path):
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    cli = stand_in(tmp_path, started=STREAMS)
    started_monotonic = time.monotonic()
    state = labrecorder.start(cli, runtime_dir, tmp_path / "x" / "session.xdf", HOST)
    assert time.monotonic() - started_monotonic < labrecorder.START_TIMEOUT_S
    log = Path(state["log"]).read_text()
    assert f"{labrecorder.STARTED_PHRASE}{labrecorder.STARTED_PHRASE}" in log  # as on 2 busy cores
    assert state["streams"] == len(STREAMS)
    assert labrecorder.running(runtime_dir) == state
    labrecorder.stop(runtime_dir, state)
    assert labrecorder.running(runtime_dir) is None


def test_a_found_stream_that_never_starts_is_still_waited_for_and_reported(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(labrecorder, "START_TIMEOUT_S", 1.0)
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    cli = stand_in(tmp_path, started=STREAMS[:2])
    with pytest.raises(labrecorder.LabRecorderError, match="did not start recording"):
        labrecorder.start(cli, runtime_dir, tmp_path / "session.xdf", HOST)
    assert labrecorder.running(runtime_dir) is None
    assert not (runtime_dir / labrecorder.FIFO_NAME).exists()
