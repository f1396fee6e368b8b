"""The e2e harness's shared-memory check sees its own daemon's entries only (Note [A test's own
shared memory]): other processes' segments are not its business, its own
are, and it refuses to guess when the daemon's log does not name the processes status reports."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from daemon_harness import Daemon, shm_entries_of
from facecast.shared.transport import shm


@pytest.fixture
def other_process():
    """A live process that is not this one (its pid owns the 'other' entries)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_only_the_given_processes_entries_are_listed(other_process):
    mine, theirs = os.getpid(), other_process.pid
    names = [f"facecast-{mine}-1f-harnesstest-slots", f"cuda.shm.0.{mine:x}.7",
             f"facecast-{theirs}-1f-harnesstest-slots", f"cuda.shm.0.{theirs:x}.7"]
    try:
        for name in names:
            (shm.SHM_DIR / name).write_bytes(b"x")
        assert shm_entries_of({mine}) == sorted(names[:2])
        assert shm_entries_of({theirs}) == sorted(names[2:])
        assert shm_entries_of(set()) == []
    finally:
        for name in names:
            (shm.SHM_DIR / name).unlink(missing_ok=True)


def _daemon_with_log(tmp_path, log_text: str, status_pids: set[int]) -> Daemon:
    """The pid bookkeeping of a Daemon, without starting one."""
    daemon = Daemon.__new__(Daemon)
    daemon.log_path = tmp_path / "daemon.log"
    daemon.log_path.write_text(log_text)
    daemon._log = open(daemon.log_path, "a")
    daemon.process = SimpleNamespace(pid=100)
    daemon.status_pids = status_pids
    return daemon


def test_own_pids_are_the_supervisor_and_every_worker_it_started(tmp_path):
    log = ("20:25:42,686 INFO facecast.daemon.process: started capture:synth0 (pid 101)\n"
           "20:25:43,001 INFO facecast.daemon.process: started output (pid 102)\n"
           "20:25:50,001 INFO facecast.daemon.process: started output (pid 103)\n")
    daemon = _daemon_with_log(tmp_path, log, status_pids={100, 101, 103})
    try:
        # 102 died before any status call saw it: the log still names it.
        assert daemon.own_pids() == {100, 101, 102, 103}
    finally:
        daemon._log.close()


def test_own_pids_refuse_a_log_that_does_not_name_the_workers(tmp_path):
    daemon = _daemon_with_log(tmp_path, "a log without start lines\n", status_pids={100, 104})
    try:
        with pytest.raises(AssertionError, match="104"):
            daemon.own_pids()
    finally:
        daemon._log.close()
