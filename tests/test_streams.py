"""`facecast streams` against real outlets on loopback (tests/conftest.py sets $LSLAPICFG).

The outlets are the output worker's own classes with a host name unique to the test, so the rows
checked here are ours whatever else the session publishes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pylsl
import pytest

from facecast.daemon.cli import streams
from facecast.workers.output.outlets import FaceOutlets, MarkerOutlet

PUSH_RATE_HZ = 50.0


def _run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="facecast streams")
    streams.add_arguments(parser)
    return streams.main(parser.parse_args(argv))


def _columns_after(line: str, source_id: str) -> list[str]:
    """channels, nominal, measured, host: the cells after source_id (none of them has spaces)."""
    return line.split(source_id, 1)[1].split()


@pytest.fixture
def outlets():
    """Two facecast streams (Face at 50 Hz, Markers) and one foreign stream at 50 Hz."""
    host = f"test{uuid.uuid4().hex[:12]}"
    faces = FaceOutlets(host, "cam0", max_faces=1, fps=PUSH_RATE_HZ, landmarks=False)
    markers = MarkerOutlet(host)
    foreign_source_id = f"other-{uuid.uuid4().hex[:12]}"
    foreign = pylsl.StreamOutlet(pylsl.StreamInfo(f"not facecast {host}", "EEG", 2, PUSH_RATE_HZ,
                                                  pylsl.cf_float32, foreign_source_id))
    stop = threading.Event()

    def push() -> None:
        # Scheduled on a fixed grid so that sleep overshoot does not lower the rate.
        next_push_monotonic = time.monotonic()
        while not stop.is_set():
            faces.push_frame(pylsl.local_clock(), [])
            foreign.push_sample([1.0, 2.0])
            next_push_monotonic += 1 / PUSH_RATE_HZ
            stop.wait(max(0.0, next_push_monotonic - time.monotonic()))

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    markers.event("start")
    try:
        yield host, faces, markers, foreign_source_id
    finally:
        stop.set()
        pusher.join(timeout=5)
        faces.close()
        markers.close()
        del foreign


def test_streams_lists_facecast_streams_with_their_measured_rate(outlets, capsys):
    host, faces, markers, foreign_source_id = outlets
    assert _run_main(["--wait", "2", "--resolve-wait", "1.5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["name", "type", "source_id", "channels", "nominal", "Hz",
                                "measured", "Hz", "host"]

    face_source_id = faces.source_ids[0]
    face_line = next(line for line in lines if face_source_id in line)
    assert face_line.startswith("facecast cam0 face0")
    channels, nominal, measured, hostname = _columns_after(face_line, face_source_id)
    assert int(channels) == faces.channel_count
    assert nominal == "irregular"  # Note [Rates that survive XDF loading]
    assert 0.6 * PUSH_RATE_HZ < float(measured) < 1.4 * PUSH_RATE_HZ, face_line
    assert hostname  # the machine's name as liblsl reports it

    marker_line = next(line for line in lines if markers.source_id in line)
    assert marker_line.startswith("facecast markers")
    channels, nominal, measured, _ = _columns_after(marker_line, markers.source_id)
    assert (channels, nominal) == ("1", "irregular")
    assert float(measured) < 5  # one marker before the window opened; none during it

    assert foreign_source_id not in out
    assert f"not facecast {host}" not in out


def test_no_streams_is_one_clear_line_and_exit_1(tmp_path):
    # A process with a SessionID of its own sees none of this session's streams, whatever other
    # tests left open: the only way to be sure there are none.
    config = tmp_path / "lsl_api.cfg"
    config.write_text("[ports]\nIPv6 = disable\n[multicast]\nResolveScope = machine\n[lab]\n"
                      "KnownPeers = {127.0.0.1}\n"
                      f"SessionID = facecast-empty-{uuid.uuid4().hex}\n")
    code = textwrap.dedent("""
        import argparse, sys
        from facecast.daemon.cli import streams
        parser = argparse.ArgumentParser()
        streams.add_arguments(parser)
        sys.exit(streams.main(parser.parse_args(["--resolve-wait", "0.5", "--wait", "0.5"])))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "LSLAPICFG": str(config)})
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("no facecast streams visible from this machine after 0.5 s")
    assert f"LSL config: {config} (from $LSLAPICFG)" in result.stdout


def test_wait_must_be_positive():
    parser = argparse.ArgumentParser()
    streams.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--wait", "0"])
