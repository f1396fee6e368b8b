"""bench/spare_wakeups.py's counting (no GPU here: a process of our own stands in for the driver's
thread, by its name)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import spare_wakeups  # noqa: E402 (bench/ is not a package)


def test_a_named_threads_wakeups_and_the_process_cores_are_counted():
    # A shell that sleeps a tenth of a second at a time wakes about ten times a second, on almost
    # no CPU; its only thread is named after it.
    sleeper = subprocess.Popen(["bash", "-c", "echo ready; while :; do sleep 0.1; done"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline() == "ready\n"  # bash runs (the fork had python's name)
        assert list(spare_wakeups.thread_switches(sleeper.pid, "bash")) == [sleeper.pid]
        assert spare_wakeups.thread_switches(sleeper.pid, spare_wakeups.DRIVER_THREAD) == {}
        counted = spare_wakeups.count(sleeper.pid, 1.0, "bash")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert counted["threads"] == 1
    assert 5 <= counted["wakeups_per_s"] <= 25, counted
    assert 0 <= counted["cores"] < 0.5, counted


def test_the_table_has_a_row_a_phase():
    rows = [{"phase": "none", "busy": [], "idle": {"wakeups_per_s": 10.0, "cores": 0.0013},
             "busy_processes": []},
            {"phase": "two_busy", "busy": ["compute", "compute"],
             "idle": {"wakeups_per_s": 720.0, "cores": 0.018},
             "busy_processes": [{"wakeups_per_s": 240.0}, {"wakeups_per_s": 250.5}]},
            # The watched process stopped while counted, then continued and checked.
            {"phase": "facecast_ring_stopped", "busy": ["ring_producer"],
             "idle": {"wakeups_per_s": 0.0, "cores": 0.0},
             "busy_processes": [{"wakeups_per_s": 700.0}],
             "resumed": {"replay_ms": 42.205, "correct": True}}]
    lines = spare_wakeups.table_lines(rows)
    assert lines[2] == "| none | none | 10, 0.0013 | - | - |"
    assert lines[3] == "| two_busy | compute, compute | 720, 0.0180 | 240, 250.5 | - |"
    assert lines[4] == "| facecast_ring_stopped | ring_producer | 0, 0.0000 | 700 | 42.205, True |"
    assert set(spare_wakeups.STOPPED) <= set(spare_wakeups.PHASES)
