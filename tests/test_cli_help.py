"""`facecast --help` is written for a lab's user (issue 21): what facecast does and where to
start, from the real command, not the module docstring meant for the code's reader."""

from __future__ import annotations

import subprocess
import sys


def test_help_says_what_facecast_does_and_where_to_start():
    result = subprocess.run([sys.executable, "-m", "facecast.daemon.cli", "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    text = " ".join(result.stdout.split())
    assert "publishes the measurements as Lab Streaming Layer streams" in text, result.stdout
    assert "facecast run --config config/default.toml" in text
    assert "facecast status" in text and "Every command has its own --help" in text
    # Nothing for the code's reader: which side of a process boundary, what the module does.
    assert "CLI side" not in text and "delegates" not in text
    assert max(len(line) for line in result.stdout.splitlines()) <= 100, result.stdout
