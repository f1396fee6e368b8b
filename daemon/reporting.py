"""What the supervisor says about the cameras: the one-line summary (systemd's STATUS=, the
log), the live line per camera of an interactive `facecast run`, from the workers' heartbeats.

Runs in the supervisor only.
"""

from __future__ import annotations

from typing import Iterable

from facecast.daemon.process import WorkerProcess, WorkerState
from facecast.shared.config import Config
from facecast.shared.transport.messages import CameraReport

S = WorkerState
_HEALTHY = (S.RUNNING, S.BOOTING, S.STANDBY, S.PENDING)


def summary(config: Config, workers) -> str:
    """One line for STATUS= and the log."""
    cameras = camera_views(config, workers)
    fps = sum(v["fps"] for v in cameras.values())
    faces = sum(v["faces"] for v in cameras.values())
    unhealthy = [w.name for w in workers if w.state not in _HEALTHY]
    state = "workers ok" if not unhealthy else "not running: " + ", ".join(unhealthy)
    return f"{len(cameras)} camera(s), {fps:.1f} fps out, {faces} face(s); {state}"


def camera_lines(config: Config, workers) -> list[str]:
    """A line per camera: published/captured fps, faces, transport, latency, source trouble."""
    lines = []
    for camera_id, view in camera_views(config, workers).items():
        latency = view["latency"]
        latency_text = (f"latency p50 {latency.p50_ms:.0f} ms p99 {latency.p99_ms:.0f} ms"
                        if latency else "latency -")
        source = "" if view["source"] in ("ok", "") else f", {view['source']}"
        decoder = (f", decoded on the {view['decoder'].upper()}"
                   if view["decoder"] in ("gpu", "cpu") else "")
        lines.append(f"{camera_id}: {view['fps']:.1f}/{view['capture_fps']:.1f} fps, "
                     f"{view['faces']} face(s), {view['transport'] or '-'}{decoder}, "
                     f"{latency_text}{source}")
    return lines


def camera_views(config: Config, workers) -> dict[str, dict]:
    views = {}
    for camera in config.cameras:
        capture = _report(workers.capture_of(camera.id), camera.id)
        output = _report(workers.get("output"), camera.id)
        views[camera.id] = {
            "fps": output.fps if output else 0.0,
            "capture_fps": capture.fps if capture else 0.0,
            "faces": output.faces if output else 0,
            "transport": capture.transport if capture else "",
            "source": capture.source if capture else "",
            "reason": capture.fallback_reason if capture else "",
            # Note [Decoder choice], where the capture worker's report carries it.
            "decoder": capture.decoder if capture else "",
            "latency": output.latency_ms if output else None,
        }
    return views


def _report(worker: WorkerProcess | None, camera_id: str) -> CameraReport | None:
    if worker is None:
        return None
    return next((r for r in worker.reports if r.camera_id == camera_id), None)


def reports_by_camera(config: Config, workers: Iterable[WorkerProcess]) -> dict[str, list[CameraReport]]:
    cameras: dict[str, list[CameraReport]] = {c.id: [] for c in config.cameras}
    for worker in workers:
        for report in worker.reports:
            cameras.setdefault(report.camera_id, []).append(report)
    return cameras


def face_models_line(config: Config) -> str:
    """Which face stack the workers load for this config, and where its bundle came from (issue
    13: `status` says it as `doctor` does). Read at start and at each reload: the bundle is
    checked when a worker loads it, so a bundle replaced on disk shows at the next reload."""
    from facecast.models import assets

    choice = assets.landmarker_bundle(config.models.face_landmarker_task or None,
                                      config.models.dir or None)
    if choice.available:
        return f"MediaPipe FaceLandmarker (blendshapes, head translation); bundle: {choice.detail}"
    return f"attention mesh, no blendshapes or head translation: {choice.detail}"
