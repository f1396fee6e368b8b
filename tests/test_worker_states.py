"""The worker state machine (Note [Worker states]): every change the
supervisor may make, and every one it may not, enumerated."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time

import pytest

from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import (
    TRANSITIONS,
    IllegalTransition,
    RestartPolicy,
    WorkerProcess,
    WorkerState,
)
from facecast.shared.exit_codes import EXIT_BOOT_ERROR

S = WorkerState


def _worker(state: WorkerState) -> WorkerProcess:
    worker = WorkerProcess(WorkerSpec("detection:cpu", "detection", ("cam0",), "cpu"))
    worker.state = state
    return worker


def test_every_state_has_its_transitions_listed():
    assert set(TRANSITIONS) == set(WorkerState)
    assert all(targets <= set(WorkerState) for targets in TRANSITIONS.values())


@pytest.mark.parametrize("before, after", list(itertools.product(WorkerState, WorkerState)))
def test_move_to_allows_exactly_the_listed_transitions(before, after):
    worker = _worker(before)
    if after in TRANSITIONS[before]:
        worker.move_to(after)
        assert worker.state is after
    else:
        with pytest.raises(IllegalTransition, match=f"{before} -> {after}"):
            worker.move_to(after)
        assert worker.state is before


def test_given_up_workers_never_come_back_by_themselves():
    for given_up in (S.FAILED, S.FLAPPING):
        assert TRANSITIONS[given_up] == {S.STOPPED}


def test_every_state_is_reachable_from_a_fresh_record():
    reached, frontier = {S.STOPPED}, [S.STOPPED]
    while frontier:
        for state in TRANSITIONS[frontier.pop()] - reached:
            reached.add(state)
            frontier.append(state)
    assert reached == set(WorkerState)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_exit_codes_lead_to_backoff_failed_and_flapping():
    policy = RestartPolicy(flap_restarts=3, flap_window_s=60)
    worker = WorkerProcess(WorkerSpec("capture:cam0", "capture", ("cam0",), "cpu"), policy)
    for expected in (S.BACKOFF, S.BACKOFF, S.FLAPPING):
        worker.adopt(_done_process(1))
        assert worker.on_exit(1) is expected
        if expected is S.BACKOFF:
            assert worker.next_start_monotonic >= time.monotonic() - 1
    assert "3 exits within 60 s" in worker.exit_reason
    booted_badly = WorkerProcess(WorkerSpec("detection:cpu", "detection", (), "cpu"))
    booted_badly.adopt(_done_process(EXIT_BOOT_ERROR))
    booted_badly.boot_error = "no model file"
    assert booted_badly.on_exit(EXIT_BOOT_ERROR) is S.FAILED
    assert booted_badly.exit_reason == "no model file"


def _done_process(code: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    process.wait()
    return process


def _ignoring_sigterm() -> subprocess.Popen:
    """A process that ignores SIGTERM, as a worker stuck in a driver call (or one the driver is
    still ending) would; returns once its handler is in place."""
    process = subprocess.Popen([sys.executable, "-c",
                                "import signal, sys, time; "
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                "print('ready', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_a_stop_terms_then_kills_at_the_deadline_without_blocking():
    worker = WorkerProcess(WorkerSpec("capture:cam0", "capture", ("cam0",), "cpu"))
    worker.adopt(_ignoring_sigterm())
    worker.begin_stop(deadline_monotonic=time.monotonic() + 0.2)
    assert worker.state is S.STOPPING
    started = time.monotonic()
    assert worker.advance_stop(time.monotonic()) is False  # returns at once: nothing waits
    assert time.monotonic() - started < 0.1
    while not worker.advance_stop(time.monotonic()):
        assert time.monotonic() - started < 10, "never stopped"
        time.sleep(0.02)
    assert worker.state is S.STOPPED and worker.kill_sent_monotonic is not None
    assert worker.popen is None


def test_a_worker_that_closed_is_left_to_end_past_its_deadline_then_killed():
    """Note [A closed worker is not killed]: its Closed buys CLOSED_END_S past the deadline."""
    from facecast.daemon import process

    worker = WorkerProcess(WorkerSpec("roi_landmark:cuda:0:0", "roi_landmark", ("cam0",), "cuda:0"))
    worker.adopt(_ignoring_sigterm())  # its end takes long: the driver's, say
    worker.begin_stop(deadline_monotonic=time.monotonic() - 1.0)  # past already
    assert not worker.done_with_its_work()
    worker.on_closed()  # its process ending (in the driver's hands, say)
    assert worker.done_with_its_work()
    assert worker.advance_stop(time.monotonic()) is False
    assert worker.kill_sent_monotonic is None and worker.alive()
    later = worker.stop_deadline_monotonic + process.CLOSED_END_S
    worker.advance_stop(later)  # still not ended after all that: killed
    assert worker.kill_sent_monotonic is not None
    while not worker.advance_stop(time.monotonic()):
        time.sleep(0.02)
    assert worker.state is S.STOPPED


def test_a_spare_handed_over_leaves_a_pending_record_and_the_successor_booting():
    spare = WorkerProcess(WorkerSpec("standby:output", "output", (), "cpu", standby=True))
    spare.adopt(_sleeper())
    spare.move_to(S.STANDBY)
    dead = _worker(S.BACKOFF)
    pid = spare.pid
    try:
        spare.hand_over(dead, respawn_delay_s=1.0)
        assert dead.state is S.BOOTING and dead.pid == pid and spare.state is S.PENDING
        with pytest.raises(IllegalTransition):  # a pending spare cannot be handed over again
            spare.hand_over(_worker(S.BACKOFF), respawn_delay_s=1.0)
    finally:
        dead.signal(signal.SIGKILL)
        dead.popen.wait()
