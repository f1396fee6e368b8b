"""`facecast run` at a terminal (Note [A terminal is not a log], issue 21): a real daemon on a
real pseudo-terminal shows warnings, errors, when it is ready and the cameras' status lines, not
the workers' INFO lines, which go with every other line to facecast.log in the runtime
directory, named on the first line."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.daemon


def test_a_terminal_shows_status_and_milestones_and_the_log_file_has_the_rest(
        installed_models, tmp_path):
    runtime_dir = tmp_path / "run"
    config = tmp_path / "facecast.toml"
    config.write_text(
        f'[daemon]\nhost_name = "tty{uuid.uuid4().hex[:8]}"\nruntime_dir = "{runtime_dir}"\n'
        'warm_standby = "off"\n[web]\nenabled = false\n[output]\nmax_faces = 1\n'
        '[[cameras]]\nid = "synth0"\nsource = "synthetic-replay"\nwidth = 320\nheight = 240\n'
        "fps = 10\n")
    primary, secondary = pty.openpty()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "facecast.daemon.cli", "run", "--config", str(config)],
        stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "INVOCATION_ID")})
    os.close(secondary)
    screen = b""

    def read_until(pattern: bytes, timeout_s: float) -> None:
        nonlocal screen
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, screen):
            assert time.monotonic() < deadline, screen.decode(errors="replace")
            ready, _, _ = select.select([primary], [], [], 0.5)
            if ready:
                try:
                    screen += os.read(primary, 65536)
                except OSError:  # the daemon closed the terminal
                    break

    try:
        read_until(rb"ready in [\d.]+ s", 120)
        read_until(rb"ready in [\s\S]*\nsynth0: [\d.]+/[\d.]+ fps", 30)  # a status line after
    finally:
        daemon.send_signal(signal.SIGTERM)
        read_until(rb"stopped in [\d.]+ s", 30)
        daemon.wait(30)
        os.close(primary)
    lines = screen.decode(errors="replace").replace("\r", "").splitlines()
    log_path = runtime_dir / "facecast.log"
    assert lines[0] == (f"facecast: the full log is in {log_path}; here: warnings, errors, when "
                        "it is ready and each camera's status every 2 s (`--log-level info` "
                        "shows every line here)"), lines
    info = [line for line in lines if " INFO " in line]
    # Only the milestones: ready, SIGTERM: stopping, stopped in.
    assert len(info) == 3 and all(re.search(r"facecast\.daemon\.\w+: (ready in|SIGTERM: "
                                            r"stopping|stopped in)", line) for line in info), info
    assert sum(line.startswith("synth0: ") for line in lines) >= 1
    log = log_path.read_text()
    assert oct(log_path.stat().st_mode & 0o777) == "0o600"
    # Everything at the configured level is in the file: the supervisor's and the workers'.
    for expected in ("INFO facecast.daemon.process: started capture:synth0",
                     "INFO capture:synth0[", "INFO output[", "ready in", "stopped in"):
        assert expected in log, (expected, log)
