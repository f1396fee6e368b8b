"""Note [Boot order]: on a GPU a device's capture workers start at once but are held (they
prepare, then wait) until its inference workers are up; on the CPU everything starts at once. The
supervisor's own start and release decisions, with the process spawning and the messages recorded
instead of done; and a real capture worker process held and released."""

from __future__ import annotations

import msgspec

from facecast.daemon import control
from facecast.daemon.process import WorkerProcess, WorkerState
from facecast.daemon.sd_notify import Notifier
from facecast.daemon.supervisor import Supervisor
from facecast.shared import config as config_mod
from facecast.shared.transport import messages
from facecast.shared.transport.messages import Assignment, Heartbeat, Hello, Release


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


def test_on_a_gpu_capture_is_held_until_the_inference_workers_are_up(runtime_dir, monkeypatch):
    supervisor, started = _supervisor(runtime_dir, 1, monkeypatch)
    sent: list[tuple[str, messages.Message]] = []
    monkeypatch.setattr(supervisor.control, "send_to",
                        lambda name, message: sent.append((name, message)) or True)
    supervisor._start_workers()
    assert started == ["output", "roi_landmark:cuda:0:0", "detection:cuda:0", "capture:cam0",
                       "capture:cam1"]
    # Their Hellos: held. (cam1's Hello comes late, after the release: not held.)
    cam0 = control.assignment(supervisor, supervisor.workers.get("capture:cam0").spec)
    assert cam0.hold
    assert not control.assignment(supervisor, supervisor.workers.get("output").spec).hold
    supervisor.boot_order.release_captures_when_inference_is_up()
    assert sent == []  # both inference workers still booting
    supervisor.workers.get("detection:cuda:0").state = WorkerState.RUNNING
    supervisor.boot_order.release_captures_when_inference_is_up()
    assert sent == []  # roi_landmark still booting
    # One given up on (it could not boot) does not hold the cameras back.
    supervisor.workers.get("roi_landmark:cuda:0:0").state = WorkerState.FAILED
    supervisor.boot_order.release_captures_when_inference_is_up()
    assert sent == [("capture:cam0", Release(worker="capture:cam0", id=sent[0][1].id))]
    assert not control.assignment(supervisor, supervisor.workers.get("capture:cam1").spec).hold
    supervisor.boot_order.release_captures_when_inference_is_up()
    assert len(sent) == 1 and len(started) == 5  # each started and released once


def test_a_held_worker_waiting_for_its_release_is_judged_by_its_heartbeats(runtime_dir,
                                                                            monkeypatch):
    """Held past daemon.boot_timeout_s (inference slow to boot) is not hung while it heartbeats;
    silent, or still preparing past the boot timeout, it is."""
    import time

    from facecast.daemon.layout import WorkerSpec

    supervisor, _ = _supervisor(runtime_dir, 1, monkeypatch)
    daemon = supervisor.config.daemon
    aborted: list[str] = []
    now = time.monotonic()

    def held_worker(name: str, heartbeat_ago_s: float | None) -> WorkerProcess:
        worker = WorkerProcess(WorkerSpec(name, "capture", ("cam0",), "cuda:0"))
        worker.state, worker.held = WorkerState.BOOTING, True
        worker.started_monotonic = now - daemon.boot_timeout_s - 5
        worker.last_heartbeat_monotonic = (worker.started_monotonic if heartbeat_ago_s is None
                                           else now - heartbeat_ago_s)
        monkeypatch.setattr(worker, "alive", lambda: True, raising=False)
        monkeypatch.setattr(worker, "signal", lambda signum, w=worker: aborted.append(w.name),
                            raising=False)
        supervisor.workers._workers[name] = worker
        return worker

    held_worker("capture:waiting", heartbeat_ago_s=0.5)
    held_worker("capture:silent", heartbeat_ago_s=daemon.heartbeat_timeout_s + 1)
    held_worker("capture:preparing", heartbeat_ago_s=None)  # no heartbeat since it started
    supervisor.workers.check_liveness(daemon)
    assert sorted(aborted) == ["capture:preparing", "capture:silent"]
    assert "did not start within" in supervisor.workers.get("capture:preparing").detail
    assert "no heartbeat for" in supervisor.workers.get("capture:silent").detail


def test_on_the_cpu_everything_starts_at_once(runtime_dir, monkeypatch):
    supervisor, started = _supervisor(runtime_dir, 0, monkeypatch)
    supervisor._start_workers()
    assert started == ["output", "roi_landmark:cpu:0", "detection:cpu", "capture:cam0",
                       "capture:cam1"]


def test_a_held_capture_worker_boots_only_when_released(runtime_dir, tmp_path):
    """A real capture worker process: Assignment(hold=True) → heartbeats "booting" and no
    camera opened, however long it waits, its replayed camera's loop rendered meanwhile (Note
    [Loops made while held]); Release → it boots and runs its camera on that loop."""
    import subprocess
    import sys

    import zmq

    endpoint = f"ipc://{runtime_dir}/control"
    config = config_mod.loads(f'[daemon]\nruntime_dir = "{runtime_dir}"\ntransport = "shm"\n'
                              '[[cameras]]\nid = "cam0"\nsource = "synthetic-replay"\nfps = 5\n'
                              "width = 320\nheight = 180\n")
    with zmq.Context() as context, open(tmp_path / "stderr.txt", "w") as stderr:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        worker = subprocess.Popen([sys.executable, "-m", "facecast.workers", "capture",
                                   "capture:cam0", endpoint], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            def receive():
                assert router.poll(60_000), "the worker said nothing"
                identity, payload = router.recv_multipart()
                return identity, messages.decode(payload)

            identity, hello = receive()
            assert isinstance(hello, Hello)
            router.send_multipart([identity, messages.encode(Assignment(
                worker="capture:cam0", config=msgspec.json.encode(config), camera_ids=["cam0"],
                hold=True))])
            held = 0
            while held < 4:  # four heartbeats (2 s) held: prepared, and waiting
                message = receive()[1]
                if isinstance(message, Heartbeat):
                    assert message.state == "booting" and message.cameras == [], message
                    held += 1
            log = (tmp_path / "stderr.txt").read_text()
            assert "held until the supervisor releases it" in log
            assert "made the loops of 1 replayed camera(s)" in log
            router.send_multipart([identity, messages.encode(Release(worker="capture:cam0"))])
            while True:
                message = receive()[1]
                if isinstance(message, Heartbeat) and message.state == "running":
                    break
            while not (isinstance(message, Heartbeat) and message.cameras
                       and message.cameras[0].frames > 0):
                message = receive()[1]
            assert message.cameras[0].camera_id == "cam0"
            assert ("replays a 30-frame loop back and forth (5 MB, rendered while its capture "
                    "worker was held)") in (tmp_path / "stderr.txt").read_text()
        finally:
            worker.kill()
            worker.wait(timeout=30)
            router.close()


def test_assignments_say_the_largest_share_their_models_are_warmed_for(runtime_dir, monkeypatch):
    """Note [Warmed for the largest share]: a worker's and its spare's Assignment carry the
    most cameras one worker of their role has on their device."""
    from facecast.daemon.layout import WorkerSpec

    supervisor, _ = _supervisor(runtime_dir, 1, monkeypatch)
    supervisor._start_workers()
    assert control.assignment(supervisor, supervisor.workers.get("roi_landmark:cuda:0:0").spec).most_cameras == 2
    spare = WorkerSpec("standby:roi_landmark:cuda:0", "roi_landmark", (), "cuda:0", standby=True)
    assert control.assignment(supervisor, spare).most_cameras == 2
    assert control.assignment(supervisor, supervisor.workers.get("detection:cuda:0").spec).most_cameras == 2
