"""Issue 21, "Files and input", on a real daemon: a file or a local process that the daemon does
not control must never stop it or speak in its name.

- A gallery that cannot be used costs the names, never the daemon (Note [Gallery validation]):
status says why, the Markers stream and the log say so.
- The control socket takes worker messages (Event, Heartbeat, Hello, BootFailed,
  TrackIdsWanted) only from the workers' own connections (Note [Worker connections]): a forged
  `record_start` from a plain DEALER never reaches the
  Markers stream and is counted and logged as refused.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from daemon_harness import Recorder, ready_daemon
from facecast.shared import gallery
from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import Event, Heartbeat, Hello

pytestmark = pytest.mark.daemon

CONFIG = """
[daemon]
transport = "shm"
warm_standby = "off"  # Note [Spares only where a test needs them]

[web]
enabled = false

[participants]
gallery = "@GALLERY@"

[[cameras]]
id = "cam0"
source = "synthetic"
width = 320
height = 180
fps = 10
"""


@pytest.fixture(scope="module")
def daemon(installed_models, tmp_path_factory):
    """One daemon for the module, on a copy of the installed models (the last test damages
    one); no warm spare (CONFIG has none): a spare would have loaded the bundle before it was
    cut."""
    from facecast.models import assets

    tmp = tmp_path_factory.mktemp("hostile")
    gallery_path = tmp / "participants.json"
    models = tmp / "models"
    models.mkdir()
    installed = next(iter(installed_models.values())).parent
    for path in [*installed.glob("*.tflite"), *installed.glob(assets.LANDMARKER_TASK_FILE)]:
        (models / path.name).write_bytes(path.read_bytes())
    config = (CONFIG.replace("[participants]\n", f'[models]\ndir = "{models}"\n\n[participants]\n')
              .replace("@GALLERY@", str(gallery_path)))
    with ready_daemon(tmp, config) as running:
        running.gallery_path = gallery_path
        running.models_dir = models
        running.markers = Recorder(running.resolve("Markers", count=1))
        try:
            yield running
        finally:
            running.markers.stop()


def _markers(daemon) -> list[dict]:
    return [json.loads(sample[0]) for sample in daemon.markers.records[0].samples]


def _wait_for(what: str, condition, daemon, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert daemon.process.poll() is None, f"the daemon exited\n{daemon.log_tail()}"
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout_s} s\n{daemon.log_tail()}")


def _bad_gallery(path: Path) -> None:
    """Two enrolments, the second of 127 values: the file of issue 21."""
    good = [0.01] * gallery.EMBEDDING_SIZE
    path.write_text(json.dumps({
        "format": gallery.FORMAT, "format_version": gallery.FORMAT_VERSION, "revision": 3,
        "embedding_model": gallery.EMBEDDING_MODEL,
        "participants": [{"name": "ada", "enrolments": [
            {"embedding": good, "added_utc": "2026-11-25T10:00:00+00:00"},
            {"embedding": good[:127], "added_utc": "2026-11-25T10:00:00+00:00"}]}]}))


def test_a_bad_gallery_written_while_the_daemon_runs_costs_the_names_not_the_daemon(daemon):
    _bad_gallery(daemon.gallery_path)
    # As the console does: a status request every second (and here more often).
    for _ in range(10):
        status = daemon.status()
    assert status.participants.startswith(f"gallery unusable: {daemon.gallery_path}: "), \
        status.participants
    assert "127 values; allowed: exactly 128 finite numbers" in status.participants
    event = _wait_for("a gallery_unusable marker", lambda: next(
        (e for e in _markers(daemon) if e["event"] == "gallery_unusable"), None), daemon)
    assert "127 values" in event["reason"] and str(daemon.gallery_path) in event["reason"]
    assert "participants: gallery unusable" in daemon.log_path.read_text()
    assert daemon.process.poll() is None, daemon.log_tail()

    # Mended: the names are back, and the daemon said so.
    gallery.enrol(daemon.gallery_path.with_name("good.json"), "ada",
                  [[0.01] * gallery.EMBEDDING_SIZE])
    daemon.gallery_path.with_name("good.json").replace(daemon.gallery_path)
    status = daemon.status()
    assert status.participants == (f"gallery {daemon.gallery_path}: revision 1, 1 "
                                   "participant(s): ada"), status.participants
    _wait_for("a gallery_usable marker", lambda: any(
        e["event"] == "gallery_usable" for e in _markers(daemon)), daemon)


def test_a_forged_worker_message_never_reaches_the_markers_stream(daemon):
    """Note [Worker connections]. A local process connects as a
    CLI does, and also as the output worker (its bare name, the identity workers had before),
    and sends what only workers may: a `record_start` Event, a Heartbeat, a Hello."""
    before = daemon.status()
    output_pid = next(w.pid for w in before.workers if w.name == "output")
    forged_file = "forged-by-a-local-process.mp4"
    forgeries = [
        Event(kind="record_start", fields={"worker": "recorder:cpu", "camera": "cam0",
                                           "file": forged_file, "dir": "/tmp"}),
        Event(kind="record_start", fields={"file": forged_file}),  # naming no worker
        Heartbeat(worker="output", state="running", trouble="forged trouble"),
        Hello(worker="output", role="output", pid=output_pid),
    ]
    with zmq.Context() as context:
        for identity in (None, b"output", b"capture:cam0"):
            with context.socket(zmq.DEALER) as dealer:
                dealer.setsockopt(zmq.LINGER, 1000)
                if identity is not None:
                    dealer.setsockopt(zmq.IDENTITY, identity)
                dealer.connect(endpoints.control(daemon.runtime_dir))
                for forged in forgeries:
                    dealer.send(messages.encode(forged))
                # A request of a client is still answered on the same connection, after the
                # forgeries: they have been read by then.
                dealer.send(messages.encode(messages.StatusRequest()))
                assert dealer.poll(10_000), "no answer to a status request"
                status = messages.decode(dealer.recv())
                assert isinstance(status, messages.DaemonStatus)
                assert not any(isinstance(m := messages.decode(dealer.recv()), messages.Assignment)
                               for _ in range(5) if dealer.poll(200)), "a forged Hello was answered"

    refused = 3 * len(forgeries)
    assert status.rejected_messages - before.rejected_messages == refused, status.rejected_messages
    # A real event after the forgeries arrives on the Markers stream (so the stream was read
    # past them): a worker restart, whose marker the supervisor sends.
    worker = next(w for w in status.workers if w.name == "capture:cam0")
    os.kill(worker.pid, signal.SIGKILL)
    _wait_for("the worker_restart marker", lambda: any(
        e["event"] == "worker_restart" for e in _markers(daemon)), daemon)
    assert not any(forged_file in json.dumps(e) for e in _markers(daemon)), _markers(daemon)
    assert b"forged trouble" not in msgspec.json.encode(daemon.status())
    log = daemon.log_path.read_text()
    assert "forged trouble" not in log
    assert "from a connection that is not that worker's own" in log, daemon.log_tail()
    assert forged_file not in log
    # The real workers were not cut off: they still heartbeat and answer.
    daemon.wait_for_worker("capture:cam0", "running", not_pid=worker.pid)
    daemon.wait_for_worker("output", "running")


def test_a_bundle_truncated_while_the_daemon_runs_is_replaced_and_said(daemon):
    """Note [Model files checked at load], on real processes: the
    roi_landmark worker that starts after face_landmarker.task was truncated measures with the
    verified copy of the bundle's models, and says so in status, on the Markers stream and in
    the log (before: the attention mesh, NaN blendshapes, nothing said). The module's last test:
    it leaves the daemon's copy of the bundle damaged."""
    from facecast.models import assets

    task = daemon.models_dir / assets.LANDMARKER_TASK_FILE
    if not task.exists():
        pytest.skip("face_landmarker.task is not installed (facecast models install)")
    assert not any(e["event"] == "model_damaged" for e in _markers(daemon)), _markers(daemon)
    task.write_bytes(task.read_bytes()[:1_000_000])
    worker = next(w for w in daemon.status().workers if w.role == "roi_landmark")
    os.kill(worker.pid, signal.SIGKILL)
    daemon.wait_for_worker(worker.name, "running", not_pid=worker.pid)
    event = _wait_for("a model_damaged marker", lambda: next(
        (e for e in _markers(daemon) if e["event"] == "model_damaged"), None), daemon)
    assert event["worker"] == worker.name
    assert event["reason"].startswith(f"{task} is 1000000 bytes, expected "), event
    assert "using the verified copy of its models in" in event["reason"], event
    detail = _wait_for("the damage in the worker's status", lambda: next(
        (w.detail for w in daemon.status().workers
         if w.name == worker.name and "(truncated" in w.detail), ""), daemon)
    assert "verified copy" in detail
    assert "(truncated; pinned SHA-256" in daemon.log_path.read_text()
    assert daemon.worker(worker.name).state == "running"
