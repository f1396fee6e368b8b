"""The runtime directory after a supervisor was SIGKILLed (issue 11: cleanup), and a worker's
leftovers swept as soon as the supervisor reaps it: real processes, killed for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from facecast.daemon import runtime_dir
from facecast.daemon.cli.control_client import NotRunning, request
from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import RestartPolicy, WorkerState
from facecast.daemon.worker_table import WorkerTable
from facecast.shared.transport import endpoints, shm
from facecast.shared.transport.messages import StatusRequest

# A process that does what a supervisor does to its runtime dir (lock, control socket) and what
# a worker does to /dev/shm (a segment named after its pid), then waits to be killed.
_HOLDER = textwrap.dedent("""
    import os, socket, sys, time
    from facecast.daemon.runtime_dir import RuntimeDir
    from facecast.shared.transport import endpoints, shm
    holder = RuntimeDir(sys.argv[1])
    holder.take_lock()
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.bind(str(endpoints.socket_path(endpoints.control(holder.path))))
    segment = shm.SharedSegment.create(shm.segment_name("camX", 0xabc, "slots"), 4096)
    print(segment.name, flush=True)
    time.sleep(600)
""")


def _start_holder(path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE,
                               text=True)
    segment = process.stdout.readline().strip()
    assert segment.startswith(shm.PREFIX), segment
    return process, segment


def test_a_killed_supervisor_is_reported_at_once_and_cleaned_up_by_the_next(tmp_path):
    process, segment = _start_holder(tmp_path)
    try:
        assert runtime_dir.lock_owner(tmp_path) == (True, process.pid)
        with pytest.raises(runtime_dir.AlreadyRunning):
            runtime_dir.RuntimeDir(str(tmp_path)).take_lock()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert runtime_dir.lock_owner(tmp_path) == (False, process.pid)

    started = time.monotonic()
    with pytest.raises(NotRunning, match=f"not running.*stale control socket of supervisor pid "
                                         f"{process.pid}"):
        request(tmp_path, StatusRequest(), timeout_s=5.0)
    assert time.monotonic() - started < 1.0  # no waiting for an answer that cannot come

    successor = runtime_dir.RuntimeDir(str(tmp_path))
    leftovers = successor.take_lock()
    try:
        assert leftovers.previous_pid == process.pid
        assert leftovers.sockets == ["control"]
        assert segment in leftovers.segments
        assert f"supervisor pid {process.pid}, which did not stop cleanly" in leftovers.describe()
        assert not endpoints.socket_path(endpoints.control(tmp_path)).exists()
        assert segment not in shm.list_segments()
        assert runtime_dir.lock_owner(tmp_path) == (True, os.getpid())
    finally:
        successor.release()
    assert runtime_dir.lock_owner(tmp_path) == (False, 0)  # a clean stop leaves no lock file


def test_a_clean_directory_reports_nothing_to_clean(tmp_path):
    fresh = runtime_dir.RuntimeDir(str(tmp_path / "run"))
    leftovers = fresh.take_lock()
    fresh.release()
    assert leftovers.previous_pid == 0 and not leftovers.sockets


def test_the_cli_finds_the_configured_directory_before_the_usual_places(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert runtime_dir.for_cli(str(tmp_path / "conf")) == tmp_path / "conf"
    assert runtime_dir.for_cli("", str(tmp_path / "given")) == tmp_path / "given"
    assert runtime_dir.for_cli("") == tmp_path / "xdg" / "facecast"  # none has a socket yet
    assert runtime_dir.for_daemon("") == tmp_path / "xdg" / "facecast"
    assert (tmp_path / "xdg" / "facecast").is_dir()


def test_a_reaped_worker_leaves_nothing_in_dev_shm(tmp_path):
    events = []
    table = WorkerTable("ipc:///nonexistent/control", RestartPolicy(),
                        send=lambda name, message: False,
                        event=lambda kind, **fields: events.append(kind))
    worker = table.start(WorkerSpec("capture:camX", "capture", ("camX",), "cpu"))
    # Not a facecast worker: replace its process with one that owns a segment, then kill it.
    worker.popen.kill()
    worker.popen.wait()
    process, segment = _start_holder(tmp_path)
    worker.popen = process
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert segment in shm.list_segments()
    table.reap()
    assert segment not in shm.list_segments()  # at once, not at the daemon's stop
    assert worker.state is WorkerState.BACKOFF


def test_a_stopping_worker_found_ended_by_the_stop_is_logged_and_swept_as_reap_would(
        tmp_path, caplog):
    """A stopping worker's process that ends after `reap` looked is found ended by
    `advance_stops`: the same "ended ... after its SIGTERM" line and the same sweep of /dev/shm
    (a loaded 2-core run lost the line, 2026-11-28)."""
    table = WorkerTable("ipc:///nonexistent/control", RestartPolicy(),
                        send=lambda name, message: False, event=lambda kind, **fields: None)
    worker = table.start(WorkerSpec("capture:camY", "capture", ("camY",), "cpu"))
    worker.popen.kill()
    worker.popen.wait()
    process, segment = _start_holder(tmp_path)
    worker.popen = process
    table.begin_stop([worker], time.monotonic() + 30)
    process.wait()  # its SIGTERM ended it, and reap has not looked since
    with caplog.at_level("INFO", logger="facecast.daemon.worker_table"):
        table.advance_stops()
    assert worker.state is WorkerState.STOPPED
    assert segment not in shm.list_segments()
    ended = [r.getMessage() for r in caplog.records if "after its SIGTERM" in r.getMessage()]
    assert len(ended) == 1, ended
    assert ended[0].startswith(f"capture:camY (pid {process.pid}) ended "), ended
