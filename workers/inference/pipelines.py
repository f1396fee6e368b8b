"""What the detection and roi_landmark workers share: building the FacePipeline for this
worker's device from the config, with errors a user can act on."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import msgspec
import torch

from facecast.models import assets
from facecast.models.pipeline import FacePipeline
from facecast.models.pose import PosePipeline
from facecast.shared.config import Config
from facecast.shared.transport.messages import CameraReport
from facecast.shared.stats import RateMeter
from facecast.shared.transport.subscriber import FrameSubscriber
from facecast.workers.base import BootError

log = logging.getLogger(__name__)


def torch_device(device: str) -> torch.device:
    """The worker's device; "cuda:<n>" must exist here, else the worker cannot boot."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BootError(f"device {device} was assigned but torch sees no CUDA device")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise BootError(f"device {device} does not exist ({torch.cuda.device_count()} GPUs)")
        from facecast.shared.transport.cuda_driver import wait_by_blocking

        wait_by_blocking(index)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    # Several inference workers share the CPU: one thread each for up to half the cores keeps
    # them from fighting over every core (and leaves cores to capture's decoding).
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    return torch.device("cpu")


def build_pipeline(config: Config, device: torch.device, *, blendshapes: bool,
                   cpu_threads: int | None = None) -> tuple[FacePipeline, str]:
    """The face pipeline, and what was wrong with a model file it loaded ("": nothing); a file
    it cannot load nor replace is a BootError (Note [Model files checked at load]).
    ``cpu_threads``: FacePipeline's (the LiteRT models' threads on the CPU)."""
    model_dir = config.models.dir or None

    def load(name: str) -> torch.nn.Module:
        from facecast.models import tflite_convert

        return tflite_convert.convert(assets.model_path(name, model_dir))  # size and SHA-256

    try:
        # The configured face_landmarker.task, else the installed one (`facecast models
        # install`), checked now: it may have changed since `facecast run` looked at it.
        checked = (assets.bundle_for_worker(config.models.face_landmarker_task or None, model_dir)
                   if blendshapes else assets.CheckedBundle(None))
        on_gpu = device.type == "cuda"  # both options are GPU-only; on the CPU they do nothing
        face = FacePipeline(
            device=device, max_faces=config.output.max_faces, load_model=load,
            face_landmarker_task=checked.bundle,
            half=config.models.half and on_gpu, cuda_graphs=config.models.cuda_graphs and on_gpu,
            cpu_threads=cpu_threads,
        )
    except assets.ModelError as exc:
        raise BootError(str(exc)) from None
    if device.type == "cpu":  # Note [LiteRT on the CPU]
        log.info("models on the CPU: %s", ", ".join(
            f"{name} in {runtime}" for name, runtime in face.model_runtimes.items()))
    problem = checked.problem
    if checked.bundle is not None and face.landmarker != "face_landmarker":
        # The bundle unpacked but did not convert: a user's bundle that does not parse.
        problem = (f"{checked.bundle.task_path} does not parse as a face_landmarker.task, so no "
                   f"blendshapes or head translation: {face.blendshapes_unavailable_reason}")
    if problem:
        log.error("%s", problem)
    return face, problem


def build_pose_pipeline(config: Config, device: torch.device) -> PosePipeline | None:
    """The body-pose pipeline when `output.pose` asks for it, else None."""
    if not config.output.pose:
        return None
    try:
        return PosePipeline(device, model_dir=config.models.dir or None)
    except assets.ModelError as exc:
        raise BootError(str(exc)) from None


@dataclasses.dataclass
class Pipelines:
    face: FacePipeline
    pose: PosePipeline | None  # None unless the worker measures body pose
    # What was wrong with a model file they loaded, "" if nothing: the worker says it in the
    # log, on the Markers stream and in status (Note [Model files checked at load]).
    model_problem: str = ""

    def report(self, worker) -> None:
        """Once, when the worker boots with these pipelines: the marker (the log line was
        written when the file was found wanting)."""
        if self.model_problem:
            worker.event("model_damaged", reason=self.model_problem)


# Note [Spares without graphs]
#     A warm spare prepares every batch shape its role can meet (Note [Warm shapes]) and then
#     waits, maybe for weeks. What makes a first batch of a shape slow is the GPU libraries'
#     preparation (cuDNN's choice of kernels, seconds a shape); the CUDA graph captured after
#     it is quick to capture again, but its memory pool is as large as the largest batch's
#     work. At 64 cameras on the H100 (2026-11-26) the detection spare held 2,312 MiB and the
#     roi_landmark spare 2,006, for batches a spare never runs. So a spare drops its graphs
#     once warmed (FacePipeline.release_graphs) and keeps the rest: the models, the libraries'
#     preparations, the CUDA context. Promoted, it captures them again (`pipelines_for` runs
#     warm_up once more) before its first batch. Measured on the H100 (2026-11-26, 64
#     cameras): the spares hold 1,336 and 1,266 MiB, and a promotion captures 6-7 graphs in
#     0.32-0.37 s (bench/worker_memory.py); with every graph captured on one side stream
#     (Note [One side stream], 2026-11-27) 964 and 892 MiB, and 0.33-0.44 s.


def prepare_pipelines(config: Config, device: torch.device, *, blendshapes: bool, pose: bool,
                      most_cameras: int = 0) -> tuple[bytes, Pipelines]:
    """A warm standby's pipelines (Note [Warm standby]): built, then run once on a synthetic
    frame with two faces so that every model's first-call costs (CUDA kernels, cuDNN's choices,
    allocator pools) are paid before a camera waits on them, then without their CUDA graphs
    (Note [Spares without graphs]). Returned with the key of what they were built for:
    `pipelines_for` uses them only if the promoted worker's config still matches.
    `most_cameras`: the most cameras a worker of this role on this device has, what the models
    are warmed for (Note [Warmed for the largest share]); 0: all of the config's."""
    from facecast.workers.capture.sources import SyntheticScene

    started_monotonic = time.monotonic()
    pipelines = _build(config, device, blendshapes=blendshapes, pose=pose, most_cameras=most_cameras)
    frame = SyntheticScene(640, 360, seed="warm-up").render(0.0)
    faces = pipelines.face.track([frame], ["warm-up"])[0]
    pipelines.face.reset("warm-up")
    if pipelines.pose is not None:
        pipelines.pose.track([frame], ["warm-up"])
        pipelines.pose.reset("warm-up")
    if pipelines.face.release_graphs():  # Note [Spares without graphs]
        torch.cuda.empty_cache()
    log.info("models ready on %s in %.1f s (%d face(s) in the warm-up frame)", device,
             time.monotonic() - started_monotonic, len(faces))
    return _pipelines_key(config, device, blendshapes, pose, most_cameras), pipelines


def pipelines_for(prepared: tuple[bytes, Pipelines] | None, config: Config,
                  device: torch.device, *, blendshapes: bool, pose: bool,
                  most_cameras: int = 0) -> Pipelines:
    """The pipelines a booting worker uses: its standby's, when they were built for this config
    and device; else new ones."""
    if prepared is not None:
        key, pipelines = prepared
        if key == _pipelines_key(config, device, blendshapes, pose, most_cameras):
            if pipelines.face.cuda_graphs:  # Note [Spares without graphs]: captured again
                started_monotonic = time.monotonic()
                _warm_up(pipelines.face, config, blendshapes=blendshapes, most_cameras=most_cameras)
                torch.cuda.empty_cache()  # as after the first warm-up (_build)
                log.info("CUDA graphs of every batch size captured again in %.2f s",
                         time.monotonic() - started_monotonic)
            return pipelines
        log.info("the standby's models were loaded for another config; loading them again")
    return _build(config, device, blendshapes=blendshapes, pose=pose, most_cameras=most_cameras)


def _build(config: Config, device: torch.device, *, blendshapes: bool, pose: bool,
           most_cameras: int = 0) -> Pipelines:
    started_monotonic = time.monotonic()
    face, model_problem = build_pipeline(config, device, blendshapes=blendshapes)
    cameras = _warm_up(face, config, blendshapes=blendshapes, most_cameras=most_cameras)
    if face.cuda_graphs:
        log.info("CUDA graphs of every batch size ready in %.1f s",
                 time.monotonic() - started_monotonic)
    body = build_pose_pipeline(config, device) if pose else None
    if body is not None:
        body.warm_up(max_frames=cameras)
    if device.type == "cuda":
        # The eager runs before each graph's capture left their memory cached outside the
        # graphs' pool: 180 MiB of a detection worker's 1.6 GiB at 64 cameras (H100,
        # 2026-11-26). The graphs' own pool is not released while they live.
        torch.cuda.empty_cache()
    return Pipelines(face=face, pose=body, model_problem=model_problem)


def _warm_up(face: FacePipeline, config: Config, *, blendshapes: bool, most_cameras: int) -> int:
    """Note [Warm shapes]. The detection worker (no blendshapes) meets batches of frames, a
    roi_landmark worker batches of faces, of up to its role's largest share of cameras (Note
    [Warmed for the largest share]); frames of any camera's size. Returns that share."""
    cameras = most_cameras or len(config.cameras)
    sizes = [(camera.height, camera.width) for camera in config.cameras]
    if blendshapes:
        face.warm_up(sizes, max_faces=cameras * config.output.max_faces)
    else:
        face.warm_up(sizes, max_frames=cameras)
    return cameras


def _pipelines_key(config: Config, device: torch.device, blendshapes: bool, pose: bool,
                   most_cameras: int) -> bytes:
    return msgspec.json.encode([config.models, config.output, str(device), blendshapes, pose,
                                most_cameras])


def consumer_reports(camera_ids, subscriber, rates: dict[str, RateMeter],
                     faces: dict[str, int]) -> list[CameraReport]:
    """Heartbeat reports of a frame-consuming worker: its rate and what its rings did."""
    reports = []
    for camera_id in camera_ids:
        status = subscriber.status.get(camera_id) if subscriber is not None else None
        rate = rates.get(camera_id)
        reports.append(CameraReport(
            camera_id=camera_id, frames=rate.total if rate else 0,
            fps=round(rate.rate(), 2) if rate else 0.0, faces=faces.get(camera_id, 0),
            skipped=status.counts["skipped"] if status else 0,
            transport=status.transport if status else "",
            ring_epoch=status.ring_epoch if status else 0,
            fallback_reason=status.fallback_reason if status else "",
            checksum_mismatches=status.counts["checksum_mismatch"] if status else 0,
        ))
    return reports


def close_frames(worker) -> None:
    """A consuming worker's FrameSubscriber closed on its way out: at its stop the ring
    mappings are left to the process's end (Note [Mappings left to the process's end])."""
    if getattr(worker, "subscriber", None) is not None:
        worker.subscriber.close(at_exit=worker.stopping)
        worker.subscriber = None


def open_frames(worker, previous: FrameSubscriber | None) -> FrameSubscriber:
    """A consuming worker's FrameSubscriber for its current cameras: a fresh one after each
    reassignment (closing the previous one and its ring mappings)."""
    if previous is not None:
        previous.close()
    return FrameSubscriber(worker.context, worker.runtime_dir, worker.camera_ids,
                           device=worker.torch_device,
                           checksum_every=worker.config.daemon.checksum_every,
                           on_event=worker.event)
