"""Note [Boot order]: on a GPU a device's capture workers start
once its inference workers are up; on the CPU everything starts at once. The supervisor's own
start decisions, with the process spawning recorded instead of done."""

from __future__ import annotations

from facecast.daemon.process import WorkerProcess, WorkerState
from facecast.daemon.sd_notify import Notifier
from facecast.daemon.supervisor import Supervisor
from facecast.shared import config as config_mod


def _supervisor(runtime_dir, gpus: int, monkeypatch) -> tuple[Supervisor, list[str]]:
    config = config_mod.loads(
        f'[daemon]\nruntime_dir = "{runtime_dir}"\n'
        + "".join(f'[[cameras]]\nid = "cam{k}"\nsource = "synthetic"\n' for k in range(2)))
    supervisor = Supervisor(config, "facecast.toml", gpus=gpus, notifier=Notifier({}))
    started: list[str] = []

    def start(spec):  # a record in "booting", as a real start leaves it; no process
        worker = WorkerProcess(spec)
        worker.state = WorkerState.BOOTING
        supervisor.workers._workers[spec.name] = worker
        started.append(spec.name)
        return worker

    monkeypatch.setattr(supervisor.workers, "start", start)
    monkeypatch.setattr(supervisor, "event", lambda kind, **fields: None)
    return supervisor, started


def test_on_a_gpu_capture_waits_for_the_inference_workers(runtime_dir, monkeypatch):
    supervisor, started = _supervisor(runtime_dir, 1, monkeypatch)
    supervisor._start_workers()
    assert started == ["output", "roi_landmark:cuda:0:0", "detection:cuda:0"]
    supervisor._start_captures_when_inference_is_up()
    assert len(started) == 3  # both still booting
    supervisor.workers.get("detection:cuda:0").state = WorkerState.RUNNING
    supervisor._start_captures_when_inference_is_up()
    assert len(started) == 3  # roi_landmark still booting
    # One given up on (it could not boot) does not hold the cameras back.
    supervisor.workers.get("roi_landmark:cuda:0:0").state = WorkerState.FAILED
    supervisor._start_captures_when_inference_is_up()
    assert started[3:] == ["capture:cam0", "capture:cam1"]
    supervisor._start_captures_when_inference_is_up()
    assert len(started) == 5  # each started once


def test_on_the_cpu_everything_starts_at_once(runtime_dir, monkeypatch):
    supervisor, started = _supervisor(runtime_dir, 0, monkeypatch)
    supervisor._start_workers()
    assert started == ["output", "roi_landmark:cpu:0", "detection:cpu", "capture:cam0",
                       "capture:cam1"]
