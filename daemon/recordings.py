"""The supervisor's side of recording: which cameras are being recorded, where, by which
recorder workers, and what `facecast status` keeps showing once a recording has ended.

Runs in the supervisor only; the recorders themselves are facecast.workers.recorder.worker.

Note [Recording]
    `facecast record start` (a RecordRequest) starts a recorder worker per device of the
    cameras asked for (layout.recorder_plan, Note [One recorder per device]); its Assignment's
    config carries the recording's directory as record.dir, and record.overlays on when `record
    start --overlays` asked for them (`config_for_recorder`). The recorder
    records from its boot until SIGTERM: `record stop` is a stop of those workers, whose close()
    finishes the files and sends record_stop. A recorder that dies is restarted like any worker
    and records into new files (record_start again). A stopped recorder leaves the table (a
    daemon that records nothing shows no recorder); its last camera reports stay for `facecast
    status`. A reload leaves a running recording alone (recorders are not in layout.plan): a
    changed [record] applies to the next one.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec

from facecast.daemon import layout
from facecast.daemon.process import WorkerState
from facecast.daemon.worker_table import WorkerTable
from facecast.shared.config import Config
from facecast.shared.transport.messages import CameraReport, Event, RecordReply, RecordRequest
from facecast.shared.recording import recording_dir, writable_dir_problem

log = logging.getLogger(__name__)

ROLE = "recorder"


class Recordings:
    """Note [Recording]."""

    def __init__(self, workers: WorkerTable, gpu_count: int) -> None:
        self.workers = workers
        self.gpu_count = gpu_count
        self.current: tuple[list[str], str] | None = None  # camera ids, directory
        self.overlays = False  # the current recording's `--overlays`
        self._last_reports: dict[str, CameraReport] = {}  # camera id → its recording's end

    def request(self, request: RecordRequest, config: Config, *, stopping: bool) -> RecordReply:
        """Start, stop or check a recording (`facecast record`); a refusal says why."""
        if stopping:
            return self._refuse(request, "the daemon is stopping")
        if request.action == "stop":
            return self._stop(request, config)
        if self.current is not None:
            camera_ids, directory = self.current
            return self._refuse(request, f"already recording {', '.join(camera_ids)} into "
                                         f"{directory}: `facecast record stop` first")
        known = [camera.id for camera in config.cameras]
        unknown = [c for c in request.camera_ids if c not in known]
        if unknown:
            return self._refuse(request, f"no camera {', '.join(map(repr, unknown))} in this "
                                         f"daemon's config (cameras: {', '.join(known)})")
        if request.dir and not request.dir.startswith("/"):
            return self._refuse(request, f"--dir must be an absolute path, got {request.dir!r}")
        if any(w.spec.role == ROLE and w.state is WorkerState.STOPPING for w in self.workers):
            return self._refuse(request, "the previous recording is still finishing its files; "
                                         "try again in a moment")
        directory = recording_dir(request.dir, config.record.dir)
        problem = writable_dir_problem(directory)
        if problem:
            return self._refuse(request, problem)
        camera_ids = [c for c in known if not request.camera_ids or c in request.camera_ids]
        reply = RecordReply(reply_to=request.id, camera_ids=camera_ids, dir=str(directory),
                            host=config.host())
        if request.action == "check":
            return reply
        self.current = (camera_ids, str(directory))
        self.overlays = request.overlays
        for spec in layout.recorder_plan(config, self.gpu_count, camera_ids):
            self.workers.remove(spec.name)  # a stopped or given-up one of an earlier recording
            self.workers.start(spec)
        log.info("recording %s into %s", ", ".join(camera_ids), directory)
        return reply

    def _stop(self, request: RecordRequest, config: Config) -> RecordReply:
        if self.current is None:
            return self._refuse(request, "not recording")
        camera_ids, directory = self.current
        self.current = None
        recorders = [w for w in self.workers if w.spec.role == ROLE]
        self.workers.begin_stop(recorders, time.monotonic() + config.daemon.stop_timeout_s)
        log.info("recording stopped: %s", ", ".join(camera_ids))
        return RecordReply(reply_to=request.id, camera_ids=camera_ids, dir=directory)

    @staticmethod
    def _refuse(request: RecordRequest, error: str) -> RecordReply:
        return RecordReply(reply_to=request.id, ok=False, error=error)

    def config_for_recorder(self, config: Config) -> Config:
        """The config a recorder's Assignment carries: record.dir is the recording's, and
        record.overlays is on when the config or `record start --overlays` says so."""
        if self.current is None:
            return config
        return msgspec.structs.replace(config, record=msgspec.structs.replace(
            config.record, dir=self.current[1],
            overlays=config.record.overlays or self.overlays))

    def on_event(self, event: Event) -> None:
        """A camera's recording ended (record_stop, record_error): what status keeps showing
        once its recorder is gone (its last heartbeat is older than the final count)."""
        if event.kind not in ("record_stop", "record_error"):
            return
        camera_id = str(event.fields.get("camera", ""))
        names = str(event.fields.get("files", event.fields.get("file", ""))).split(",")
        last_file = os.path.join(str(event.fields.get("dir", "")), names[-1]) if names[-1] else ""
        state = (f"stopped: {event.fields.get('reason', '')}" if event.kind == "record_error"
                 else str(event.fields.get("state", "stopped")))
        self._last_reports[camera_id] = CameraReport(
            camera_id=camera_id, recording=state, recording_file=last_file,
            recorded_frames=int(event.fields.get("frames", 0)),
            recording_drops=int(event.fields.get("dropped", 0)))

    def forget_stopped_recorders(self) -> None:
        """A stopped recorder leaves the table; its reports stay (`add_ended`)."""
        for worker in self.workers:
            if worker.spec.role == ROLE and worker.state is WorkerState.STOPPED:
                self.workers.remove(worker.name)

    def add_ended(self, cameras: dict[str, list[CameraReport]]) -> None:
        """Add to a status's camera reports the end of each camera's last recording, where no
        recorder reports on that camera now."""
        recording_now = {r.camera_id for w in self.workers if w.spec.role == ROLE
                         for r in w.reports}
        for camera_id, report in self._last_reports.items():
            if camera_id in cameras and camera_id not in recording_now:
                cameras[camera_id].append(report)
