"""Spares paused while they stand by (Note [Spares paused while they stand by]): the
supervisor's side on real processes, stopped and continued for real, and a paused spare's end
when its supervisor is SIGKILLed. The daemon's own spares: tests/test_warm_standby.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from daemon_harness import WAIT_S, process_state, wait_for_state
from facecast.daemon import control
from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import RestartPolicy, WorkerState
from facecast.daemon.worker_table import WorkerTable
from facecast.shared.config import DaemonConfig
from facecast.shared.transport.messages import Heartbeat, Promote


class _Table:
    """A WorkerTable with one spare whose process is a plain Python that sleeps (no facecast
    worker: what is tested is what the supervisor does to a process)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.reachable = True  # whether a message to the spare is delivered
        self.table = WorkerTable("ipc:///nonexistent/control", RestartPolicy(), send=self._send,
                                 event=lambda kind, **fields: None)
        self.spare = self.table.start(WorkerSpec("standby:detection:cpu", "detection", (), "cpu",
                                                 standby=True))
        self.spare.popen.kill()  # the real worker it started: replaced by a sleeper
        self.spare.popen.wait()
        self.spare.popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def _send(self, name: str, message: object) -> bool:
        self.sent.append((name, message))
        return self.reachable

    def heartbeat(self) -> None:
        """What the supervisor does with a "standby" heartbeat from the spare (its first one
        moves it from booting to standby)."""
        control._on_heartbeat(None, b"", self.spare,
                              Heartbeat(worker=self.spare.name, state="standby"))

    def close(self) -> None:
        """Every process the table holds, killed (a promoted sleeper too)."""
        for worker in self.table:
            if worker.popen is not None and worker.popen.poll() is None:
                worker.popen.send_signal(signal.SIGCONT)
                worker.popen.kill()
                worker.popen.wait()


@pytest.fixture
def table():
    made = _Table()
    yield made
    made.close()


def test_a_spare_is_paused_once_it_says_it_stands_by(table):
    assert table.spare.state is WorkerState.BOOTING and not table.spare.paused
    table.heartbeat()
    assert table.spare.state is WorkerState.STANDBY and table.spare.paused
    assert wait_for_state(table.spare.pid, {"T"}) == "T"
    assert table.spare.status().detail == "paused until promoted"
    assert table.spare.status().state == "standby"


def test_a_paused_spare_is_not_judged_hung_for_its_missing_heartbeats(table):
    table.heartbeat()
    table.spare.last_heartbeat_monotonic = time.monotonic() - 3600.0  # an hour of silence
    table.table.check_liveness(DaemonConfig())
    assert table.spare.abort_sent_monotonic is None and table.spare.kill_sent_monotonic is None
    assert wait_for_state(table.spare.pid, {"T"}) == "T"
    # Continued by someone else, it is judged again (and paused again when it heartbeats).
    table.spare.resume()
    table.table.check_liveness(DaemonConfig())
    assert table.spare.abort_sent_monotonic is not None  # SIGABRT: the hour of silence counts
    assert "hung: no heartbeat" in table.spare.detail


def test_a_spare_whose_promotion_could_not_be_sent_is_paused_again(table):
    table.heartbeat()
    table.reachable = False
    dead = table.table.start(WorkerSpec("detection:cpu", "detection", ("cam0",), "cpu"))
    dead.popen.kill()
    dead.popen.wait()
    table.table.reap()
    table.table.start_due()  # continued for Promote, which could not go: a cold start instead
    assert dead.pid != table.spare.pid and table.spare.state is WorkerState.STANDBY
    assert not table.spare.paused
    assert wait_for_state(table.spare.pid, {"R", "S"}) in {"R", "S"}
    table.heartbeat()  # running, it heartbeats
    assert table.spare.paused and wait_for_state(table.spare.pid, {"T"}) == "T"


def test_a_paused_spare_acts_on_sigterm_at_a_stop(table):
    table.heartbeat()
    assert wait_for_state(table.spare.pid, {"T"}) == "T"
    table.table.begin_stop([table.spare], time.monotonic() + 30.0)
    # Stopped, it would keep SIGTERM pending for ever; continued after it, it ends by it.
    assert table.spare.popen.wait(timeout=WAIT_S) == -signal.SIGTERM
    table.table.advance_stops()
    assert table.spare.state is WorkerState.STOPPED


def test_a_paused_spare_is_continued_before_it_is_sent_promote(table):
    table.heartbeat()
    assert wait_for_state(table.spare.pid, {"T"}) == "T"
    pid = table.spare.pid
    dead = table.table.start(WorkerSpec("detection:cpu", "detection", ("cam0",), "cpu"))
    dead.popen.kill()
    dead.popen.wait()
    table.table.reap()  # -> backoff, restart due at once (the first restart is immediate)
    table.table.start_due()
    assert [(name, type(message), message.worker) for name, message in table.sent] == [
        ("standby:detection:cpu", Promote, "detection:cpu")]
    assert dead.pid == pid and dead.state is WorkerState.BOOTING and not dead.paused
    assert wait_for_state(pid, {"R", "S"}) in {"R", "S"}  # running again, to read its Promote
    assert table.spare.state is WorkerState.PENDING  # a fresh spare follows


def test_a_heartbeat_from_a_paused_spare_pauses_it_again(table):
    # Its last heartbeat before the pause arrives after it, or someone else continued it:
    # either way it is stopped once the heartbeat is handled.
    table.heartbeat()
    assert wait_for_state(table.spare.pid, {"T"}) == "T"
    os.kill(table.spare.pid, signal.SIGCONT)
    assert wait_for_state(table.spare.pid, {"R", "S"}) in {"R", "S"}
    table.heartbeat()
    assert table.spare.paused
    assert wait_for_state(table.spare.pid, {"T"}) == "T"


# A paused spare's supervisor SIGKILLed: the spare must not outlive it, stopped for ever with
# its GPU memory. The parent stands in for the supervisor; its child arms its parent-death
# signal as a standing-by spare does (workers.base.stand_by), and is stopped as the supervisor
# stops it.
_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(600)
""")
_SPARE = textwrap.dedent("""
    import signal, time
    from facecast.workers.base import _die_with_parent
    _die_with_parent(signal.SIGKILL)
    print("armed", flush=True)
    time.sleep(600)
""")


def test_a_paused_spare_dies_with_its_supervisor():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _SPARE], stdout=subprocess.PIPE,
                              text=True)
    spare_pid = 0
    try:
        spare_pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "armed"  # the child's line, same pipe
        os.kill(spare_pid, signal.SIGSTOP)
        assert wait_for_state(spare_pid, {"T"}) == "T"
        parent.kill()
        parent.wait()
        # Gone (or a zombie until whoever adopted it reaps it), not stopped.
        assert wait_for_state(spare_pid, {"", "Z"}) in {"", "Z"}
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if spare_pid and process_state(spare_pid) not in ("", "Z"):
            os.kill(spare_pid, signal.SIGKILL)
