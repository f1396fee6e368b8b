"""Warm spares at a lower CPU priority (Note [Spares at a lower priority], issue 21 item 5): with a
real daemon, every thread of every spare runs at nice +10 while it stands by, and a spare
promoted in place of a SIGKILLed worker has every thread back at the workers' nice, where this
user may raise a priority back; where it may not, spares keep the workers' priority and status
says why. Timings are bench/after_ready.py's, not a test's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from facecast.shared import cpu_priority


def thread_nices(pid: int) -> dict[int, int]:
    """Every thread of a process and its nice (/proc/<pid>/task/<tid>/stat, field 19)."""
    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue  # the thread ended
        nices[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return nices


@pytest.mark.daemon
def test_spares_stand_by_at_a_lower_priority_and_a_promoted_one_gets_it_back(spare_daemon):
    # The daemon the tests of spares share (Note [One daemon for several test files]): a worker
    # whose spare took over before this test must have its priority back too.
    daemon = spare_daemon
    base = cpu_priority.current_nice()  # the daemon inherits this test's nice
    permitted, why_not = cpu_priority.restore_permitted()
    lowered = min(base + cpu_priority.SPARE_NICE_INCREMENT, 19) if permitted else base
    status = daemon.status()
    spares = {w.name: w for w in status.workers if w.standby}
    assert set(spares) == {"standby:capture:cpu", "standby:detection:cpu",
                           "standby:roi_landmark:cpu", "standby:output"}
    for spare in spares.values():
        assert set(thread_nices(spare.pid).values()) == {lowered}, (spare, daemon.log_tail())
        # (and paused: Note [Spares paused while they stand by])
        assert spare.detail == ("" if permitted else f"normal priority: {why_not}; ") + (
            "paused until promoted")
    for worker in status.workers:
        if not worker.standby:
            assert set(thread_nices(worker.pid).values()) == {base}, worker
    spare_pid = spares["standby:roi_landmark:cpu"].pid
    assert len(thread_nices(spare_pid)) > 1  # torch's threads too, made while low
    killed = daemon.worker("roi_landmark:cpu:0").pid
    os.kill(killed, signal.SIGKILL)
    promoted = daemon.wait_for_worker("roi_landmark:cpu:0", "running", not_pid=killed)
    assert promoted.pid == spare_pid, promoted  # the spare's process took the name
    assert set(thread_nices(promoted.pid).values()) == {base}, daemon.log_tail()
    assert promoted.detail == "", promoted


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to take CAP_SYS_NICE away from a process")
def test_without_the_way_back_the_decision_says_why_and_what_allows_it():
    # Root without CAP_SYS_NICE and with RLIMIT_NICE 0 is an ordinary user's case.
    probe = ("from facecast.shared import cpu_priority as c; ok, why = c.restore_permitted(); "
             "print(ok); print(why)")
    result = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "prlimit",
         "--nice=0", sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=60, check=True)
    permitted, why = result.stdout.splitlines()
    assert permitted == "False"
    assert "RLIMIT_NICE 0" in why and "LimitNICE=+0" in why and "ulimit -e 20" in why


def test_where_the_way_back_is_refused_spares_keep_the_workers_priority_and_say_so(
        monkeypatch, caplog):
    from facecast.daemon.layout import WorkerSpec
    from facecast.daemon.process import RestartPolicy, WorkerProcess
    from facecast.daemon.worker_table import WorkerTable

    monkeypatch.setattr(cpu_priority, "restore_permitted", lambda: (False, "RLIMIT_NICE 0"))
    environments = {}
    monkeypatch.setattr(WorkerProcess, "start",
                        lambda self, endpoint, env: environments.update({self.name: env}))
    table = WorkerTable("ipc:///nowhere", RestartPolicy(), send=lambda *a: True,
                        event=lambda *a, **k: None)
    with caplog.at_level("WARNING", logger="facecast.daemon.worker_table"):
        spares = [table.start(WorkerSpec(f"standby:{role}:cpu", role, (), "cpu", standby=True))
                  for role in ("capture", "detection")]
        worker = table.start(WorkerSpec("capture:cam0", "capture", ("cam0",), "cpu"))
    assert [environments[s.name][cpu_priority.SPARE_NICE_ENV] for s in spares] == ["0", "0"]
    assert cpu_priority.SPARE_NICE_ENV not in environments[worker.name]
    assert all(s.status().detail == "normal priority: RLIMIT_NICE 0" for s in spares)
    assert worker.status().detail == ""
    said = [r.getMessage() for r in caplog.records if "warm spares" in r.getMessage()]
    assert said == ["warm spares prepare at the workers' priority: RLIMIT_NICE 0"]  # once
