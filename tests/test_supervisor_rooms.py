"""The supervisor's rooms on their own, without processes: the control socket's dispatch table
(one handler per message type; Note [Worker connections]) and the ordered shutdown as a state
advanced tick by tick (Note [Supervisor loop], DESIGN §5). The daemon tests (test_daemon_e2e,
test_hostile_input_daemon, the soak) prove the same on real processes."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from facecast.daemon import control, shutdown
from facecast.daemon.layout import STOP_STAGES
from facecast.shared.transport import messages


def test_every_message_has_one_handler_and_workers_messages_are_not_clients_requests():
    workers_only = set(control.WORKER_HANDLERS)
    clients = set(control.CLIENT_HANDLERS)
    assert not workers_only & clients
    assert workers_only == {messages.Hello, messages.Heartbeat, messages.BootFailed,
                            messages.Closed, messages.Event, messages.TrackIdsWanted}
    assert clients == {messages.StatusRequest, messages.ReloadRequest, messages.StopRequest,
                       messages.RecordRequest, messages.InjectFault}
    # Each arrives as itself: a type outside messages.AnyMessage would be refused at decoding.
    for kind in workers_only | clients:
        assert kind in typing.get_args(messages.AnyMessage), kind
    closed = messages.Closed(worker="capture:cam0")
    assert messages.MessageGate("test").decode(messages.encode(closed)) == closed
    # What the supervisor only ever sends has no handler: refused when it arrives.
    assert messages.Assignment not in workers_only | clients
    assert messages.Ack not in workers_only | clients


@dataclass
class _Spec:
    role: str


@dataclass
class _Worker:
    name: str
    spec: _Spec
    stopped: bool = False
    closed: bool = False  # said Closed, or was SIGKILLed: its process not yet ended
    deadline_monotonic: float | None = None


@dataclass
class _Table:
    """What Shutdown uses of a WorkerTable; a worker stops when the test says so."""

    workers: list[_Worker]
    terms: list[str] = field(default_factory=list)  # begin_stop, in order, once per worker

    def __iter__(self):
        return iter(self.workers)

    def begin_stop(self, group, deadline_monotonic):
        for worker in group:
            if worker.name not in self.terms:
                self.terms.append(worker.name)
                worker.deadline_monotonic = deadline_monotonic

    @staticmethod
    def all_stopped(group):
        return all(w.stopped for w in group)

    @staticmethod
    def all_done_with_their_work(group):
        return all(w.stopped or w.closed for w in group)


def test_the_shutdown_stops_stage_after_stage_and_output_last_after_its_flush(monkeypatch):
    monkeypatch.setattr(shutdown.shm, "sweep_all_dead", lambda: ([], []))
    clock = [100.0]
    monkeypatch.setattr(shutdown.time, "monotonic", lambda: clock[0])
    roles = [role for stage in STOP_STAGES for role in stage]
    assert roles[0] == "console" and roles[-1] == "output" and STOP_STAGES[-1] == ("output",)
    assert {"capture", "detection", "roi_landmark"} in [set(stage) for stage in STOP_STAGES]
    table = _Table([_Worker(role, _Spec(role)) for role in reversed(roles)])
    flushed = []
    state = shutdown.Shutdown(table, lambda: flushed.append(clock[0]),
                              deadline_monotonic=clock[0] + 10.0)
    asked = 0
    for stage in STOP_STAGES[:-1]:
        state.advance()  # never waits: one stage asked to stop, the next not yet
        assert set(table.terms[asked:]) == set(stage) and not state.done
        asked = len(table.terms)
        state.advance()
        assert len(table.terms) == asked  # still stopping: the next stage waits
        for role in stage[:-1]:  # one worker of the stage still stopping holds the next back
            next(w for w in table if w.name == role).stopped = True
            state.advance()
            assert len(table.terms) == asked
        next(w for w in table if w.name == stage[-1]).stopped = True
    state.advance()
    assert flushed == [100.0] and table.terms[-1] != "output"  # its events go out first
    clock[0] += shutdown.OUTPUT_FLUSH_S
    state.advance()
    assert table.terms[-1] == "output" and sorted(table.terms) == sorted(roles)
    output = next(w for w in table if w.name == "output")
    assert output.deadline_monotonic == 110.0  # the last stage gets what is left of the deadline
    assert not state.done
    output.stopped = True
    state.advance()
    assert state.done
    # Every stage but the last kept STOP_RESERVE_PER_STAGE_S for each stage after it.
    for k, stage in enumerate(STOP_STAGES[:-1]):
        for role in stage:
            worker = next(w for w in table if w.name == role)
            assert worker.deadline_monotonic == 110.0 - shutdown.STOP_RESERVE_PER_STAGE_S * (
                len(STOP_STAGES) - 1 - k), role


def test_a_closed_stage_lets_the_next_begin_and_the_stop_ends_with_its_processes(monkeypatch):
    """Note [A closed worker is not killed]: output's turn does not wait for the processes of a
    stage that closed (or was SIGKILLed) to end; the shutdown does."""
    monkeypatch.setattr(shutdown.shm, "sweep_all_dead", lambda: ([], []))
    clock = [100.0]
    monkeypatch.setattr(shutdown.time, "monotonic", lambda: clock[0])
    roles = [role for stage in STOP_STAGES for role in stage]
    table = _Table([_Worker(role, _Spec(role)) for role in roles])
    state = shutdown.Shutdown(table, lambda: None, deadline_monotonic=clock[0] + 4.0)
    for _ in STOP_STAGES[:-2]:  # up to the stage before output's, each stopping at once
        state.advance()
        for worker in table:
            worker.stopped = worker.name in table.terms
    state.advance()
    capture = next(w for w in table if w.name == "capture")
    assert "capture" in table.terms and "output" not in table.terms
    for worker in table:
        worker.stopped = worker.name in table.terms and worker is not capture
    state.advance()
    assert "output" not in table.terms  # capture is still stopping: output waits
    capture.closed = True  # its Closed came; its process still ending
    state.advance()
    clock[0] += shutdown.OUTPUT_FLUSH_S
    state.advance()
    assert table.terms[-1] == "output"
    next(w for w in table if w.name == "output").stopped = True
    state.advance()
    assert not state.done  # the closed capture process has not ended yet
    capture.stopped = True
    state.advance()
    assert state.done
