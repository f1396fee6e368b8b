"""A second daemon that would publish this daemon's stream ids is refused at start, saying
where the first runs (Note [One daemon per stream id]; issue 21).

The first daemon is stood for by its Markers outlet (the output worker's own class, with the
metadata a running daemon gives it); the second is a real `facecast run`."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from daemon_harness import REPO
from facecast.workers.output.outlets import MarkerOutlet

pytestmark = pytest.mark.daemon


def test_a_second_daemon_with_the_same_stream_ids_is_refused_naming_the_first(installed_models,
                                                                            tmp_path):
    # installed_models: `facecast run` checks its models before this question
    host = f"twice{uuid.uuid4().hex[:8]}"
    first = MarkerOutlet(host, daemon_pid=4242, runtime_dir="/run/user/1000/facecast")
    config = (REPO / "config/default.toml").read_text().replace(
        "[daemon]\n", f'[daemon]\nhost_name = "{host}"\nruntime_dir = "{tmp_path / "run"}"\n')
    config_path = tmp_path / "second.toml"
    config_path.write_text(config.replace("enabled = true", "enabled = false"))
    try:
        second = subprocess.run(
            [sys.executable, "-m", "facecast.daemon.cli", "run", "--config", str(config_path),
             "--no-install"], capture_output=True, text=True, timeout=120)
    finally:
        first.close()
    assert second.returncode == 1, second.stderr
    message = second.stderr
    assert f"another facecast daemon already publishes streams as host '{host}'" in message
    assert "pid 4242" in message and "runtime directory /run/user/1000/facecast" in message
    assert "daemon.host_name" in message  # what to do about it
    assert not (tmp_path / "run" / "control").exists()  # nothing was started
