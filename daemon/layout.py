"""Which workers a config asks for on this machine, and what a reload must do about them.

Pure functions of the config and the number of GPUs (the supervisor counts them): tested
without starting anything.

- one capture worker per camera (`capture:<camera>`), on its camera's device;
- per device: one detection worker (`detection:<device>`) and `daemon.roi_landmark_workers`
  roi_landmark workers (`roi_landmark:<device>:<k>`; auto: one per 32 of a GPU's cameras),
  the device's cameras dealt out in config order;
- one output worker (`output`) for all cameras;
- with `web.enabled`, one web console (`console`) for all cameras, started at READY (Note
  [Console after READY]);
- warm standbys (`standby:<role>:<device>`, `standby:output`, `standby_plan`): per device, one
  booted spare of each role whose boot is slow there, and one of the output worker (Note [Warm
  standby]).

Cameras go to GPUs as `cameras[].gpu` says, `-1` round-robin; with no GPU, or with
`models.device = "cpu"`, everything runs on the CPU. CUDA IPC never crosses GPUs (DESIGN §8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from facecast.shared.config import Config

# The console goes first: a viewer that outlived the cameras would only show them vanish.
# A recorder stops before capture: its files end cleanly on frames that were still coming.
# Capture and inference stop together (Note [Capture and inference stop together]); output last.
STOP_STAGES = (("console",), ("recorder",), ("capture", "detection", "roi_landmark"), ("output",))
# Note [Capture and inference stop together]
#     Nothing at a stop needs the inference workers to outlive capture or the other way round:
#     frames still in a ring are not measured anyway, and a ring's GPU memory lives on while any
#     process holds it. Stopping them one role after another made the stop the sum of their
#     exits, and a capture process's exit is slow at scale (each camera's decoder and ring freed
#     on its own thread, then the CUDA context): with 128 NVDEC cameras on two GPUs (16 a capture
#     process, H100 x2, 2026-11-26) capture alone used up its share of daemon.stop_timeout_s,
#     and detection, roi_landmark and output were SIGKILLed behind it. Together, their exits
#     overlap and share the time until output's turn.
# Note [Console after READY]
#     The web console (`web.enabled`) measures nothing: READY=1 means the streams carry
#     measurements, and the console's boot (Python, torch for the ring readers, aiohttp: about
#     2 s of CPU) would only compete with the workers that READY waits for, on a 2-core machine
#     the e2e tests' daemons included. So the supervisor starts it once the daemon is READY, with
#     the warm standbys. It has no spare: a console restart costs a browser a few seconds of
#     previews, never a stream sample (tests/test_console.py measures it).
ROLES_STARTED_AT_READY = ("console",)
# Note [Capture groups]
#     One capture process per camera isolates a hung driver or a dead stream in the kernel's
#     way: the other cameras cannot even see it. On a GPU it also costs a CUDA context per
#     camera, and contexts are what the driver serialises: measured on the H200 (16 cores,
#     driver 580, 64 synthetic cameras, cuda_ipc), capture processes took 37-40 s to reach their
#     first frame and 64 processes took 67-93 s to READY, with detection's CUDA graphs taking
#     45 s to prepare among 67 contexts time-slicing the GPU; at SIGTERM the processes ending
#     together needed SIGKILL, 31 of them still there 2 s after it. So on a GPU a capture worker
#     serves a group of cameras, one thread each (Note [Camera threads] in
#     facecast.workers.capture.worker), sharing one context: `daemon.cameras_per_capture_worker`,
#     "auto" keeping at most MAX_CAPTURE_WORKERS_PER_GPU capture processes per GPU (so a lab with
#     up to 4 cameras keeps one process per camera) and one per camera on the CPU. A camera
#     whose source fails is retried by its thread while the others go on; a group's process that
#     dies comes back with all its cameras through its warm spare. A group of one camera is
#     named `capture:<camera>`, a larger one `capture:<device>:<k>`.
#     Why 4 and not 8 (H100, 2026-11-26, 64 replayed 1080p cameras, cuda_ipc, one run each):
#     each capture process holds ~0.7 GB of the GPU besides its rings (its context, torch's
#     kernels); 8 processes of 8 cameras held 9.5 GB, 4 of 16 held 6.8 GB, with 2.4 % of frames
#     dropped against 2.7 % and 5.9 capture cores against 6.2 (one run each: the same within
#     the spread of runs). Issue 24's budget for the whole daemon at 64 cameras is 16 GiB.
MAX_CAPTURE_WORKERS_PER_GPU = 4


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str
    camera_ids: tuple[str, ...]
    device: str  # "cpu" or "cuda:<index>"
    standby: bool = False  # a spare that takes over the next dead worker of its role and device


def camera_devices(config: Config, gpu_count: int) -> dict[str, str]:
    if config.models.device == "cpu" or (gpu_count == 0 and config.models.device == "auto"):
        return {camera.id: "cpu" for camera in config.cameras}
    devices, next_gpu = {}, 0
    for camera in config.cameras:
        if camera.gpu >= 0:
            devices[camera.id] = f"cuda:{camera.gpu}"
        else:
            devices[camera.id] = f"cuda:{next_gpu % max(gpu_count, 1)}"
            next_gpu += 1
    return devices


def plan(config: Config, gpu_count: int) -> list[WorkerSpec]:
    """The workers of this config, in start order (output first, capture last)."""
    devices = camera_devices(config, gpu_count)
    by_device: dict[str, list[str]] = {}
    for camera in config.cameras:
        by_device.setdefault(devices[camera.id], []).append(camera.id)
    specs = [WorkerSpec("output", "output", tuple(c.id for c in config.cameras), "cpu")]
    if config.web.enabled:  # Note [Console after READY]: the supervisor holds it back until READY
        specs.append(WorkerSpec("console", "console", tuple(c.id for c in config.cameras), "cpu"))
    for device, camera_ids in by_device.items():
        count = roi_landmark_count(config, device, camera_ids)
        for k in range(count):
            share = tuple(camera_ids[k::count])
            specs.append(WorkerSpec(f"roi_landmark:{device}:{k}", "roi_landmark", share, device))
    for device, camera_ids in by_device.items():
        specs.append(WorkerSpec(f"detection:{device}", "detection", tuple(camera_ids), device))
    for device, camera_ids in by_device.items():
        groups = capture_groups(config, device, camera_ids)
        for k, group in enumerate(groups):
            name = f"capture:{group[0]}" if len(group) == 1 else f"capture:{device}:{k}"
            specs.append(WorkerSpec(name, "capture", group, device))
    return specs


# Note [Measuring workers per GPU]
#     One roi_landmark worker measures its cameras' newest frames one batch after the other, so
#     a frame waits for the batch before its own. At 64 replayed 1080p cameras on one H200
#     (bench/pipeline.py, 2026-11-26, one call) one worker could not keep up: 12.3 % of frames
#     dropped, p99 94 ms, its batches 28.6 ms on average; two workers, each with half of the
#     cameras, on the same GPU: 1.1 % dropped, p99 72 ms, batches 19.1 ms, GPU busy 71 -> 93 %,
#     2.4 GB more GPU memory. At 32 cameras one worker drops nothing. Measured again on the
#     H100 (2026-11-27, every batch's stage on the device, one machine): one worker for 64
#     cameras 2.34 % dropped, p99 98 ms; two 0 dropped, p99 67 ms, for 690 MiB more (one
#     worker's batches, twice as large, hold as much memory as two workers' do). So "auto"
#     gives a GPU one worker per CAMERAS_PER_MEASURING_WORKER cameras; on the CPU, whose cores
#     the models already use, one.
CAMERAS_PER_MEASURING_WORKER = 32


# Note [Warmed for the largest share]
#     An inference worker prepares the CUDA graphs of every batch it can meet (Note [Warm
#     shapes]), and a graph's memory pool is as large as its largest batch's work. Each one
#     prepared for all of the config's cameras: at 64 cameras a roi_landmark worker of 32
#     warmed its measuring stage for 128 faces, the largest batch of the whole daemon, not of
#     its share. So the Assignment says how many cameras the largest share of its role on its
#     device has (`most_cameras`, the same for that device's spare, which may take over any of
#     them), and the worker warms for that; a batch larger than what was warmed (more ROIs than
#     the share's faces, while tracks and new detections overlap) runs as several replays of the
#     warmed graphs (FaceMeasurer's `warmed_faces`), never as a new shape to prepare.


def most_cameras(config: Config, gpu_count: int, role: str, device: str) -> int:
    """The most cameras one worker of `role` on `device` has (Note [Warmed for the largest
    share]); 0 where the plan has none."""
    shares = [len(spec.camera_ids) for spec in plan(config, gpu_count)
              if spec.role == role and spec.device == device]
    return max(shares, default=0)


def roi_landmark_count(config: Config, device: str, camera_ids: list[str]) -> int:
    """How many roi_landmark workers a device gets (Note [Measuring workers per GPU])."""
    count = config.daemon.roi_landmark_workers
    if count == "auto":
        count = (math.ceil(len(camera_ids) / CAMERAS_PER_MEASURING_WORKER)
                 if device != "cpu" else 1)
    return max(1, min(count, len(camera_ids)))


def capture_groups(config: Config, device: str, camera_ids: list[str]) -> list[tuple[str, ...]]:
    """Note [Capture groups]: the device's cameras, in config order, dealt into capture workers."""
    per_worker = config.daemon.cameras_per_capture_worker
    if per_worker == "auto":
        on_gpu = device != "cpu"
        per_worker = (math.ceil(len(camera_ids) / MAX_CAPTURE_WORKERS_PER_GPU) if on_gpu else 1)
    per_worker = max(1, per_worker)
    return [tuple(camera_ids[i:i + per_worker]) for i in range(0, len(camera_ids), per_worker)]


def capture_worker_of(specs: list[WorkerSpec], camera_id: str) -> str:
    """The name of the capture worker of a camera in a plan."""
    return next(s.name for s in specs if s.role == "capture" and camera_id in s.camera_ids)


def recorder_plan(config: Config, gpu_count: int, camera_ids: list[str]) -> list[WorkerSpec]:
    """Note [One recorder per device]: the recorders of a recording of these cameras."""
    devices = camera_devices(config, gpu_count)
    by_device: dict[str, list[str]] = {}
    for camera in config.cameras:
        if camera.id in camera_ids:
            by_device.setdefault(devices[camera.id], []).append(camera.id)
    return [WorkerSpec(f"recorder:{device}", "recorder", tuple(ids), device)
            for device, ids in by_device.items()]


# Note [One recorder per device]
#     Recorders (facecast.workers.recorder.worker) are not part of `plan`: they run only while a
#     recording does (`facecast record start` to `record stop`, or from the start with
#     `record.start`), so that a daemon that records nothing pays nothing for them, and a reload
#     never starts or stops one (the supervisor owns them: Note [Recording] in
#     facecast.daemon.recordings). One per device, not one per capture group: a recorder runs an encoder thread per camera (libx264
#     releases the GIL, so its cameras spread over the cores), and on the CPU one process per
#     camera would add a Python with PyAV (0.3-1.0 s of boot, 90 MB) per camera for no
#     isolation that matters: an encoder that fails stops its camera's recording, not the
#     others', and a recorder that dies is restarted into new files while capture and the
#     streams go on. Per device is also where an NVENC encoder would sit (one CUDA context per
#     GPU). No warm spare: a recorder boots in 0.3-1.0 s on the busy 2-core CI machine (no
#     torch: it reads through a host-only FrameSubscriber) and records START_MARGIN_S (0.5 s) later,
#     inside the 2 s promise; the frames of that gap are in no file, which the frame-index stream
#     and the new record_start marker show, and nothing else waits for it.


def standby_plan(config: Config, gpu_count: int) -> list[WorkerSpec]:
    """The warm standbys of this config (Note [Warm standby]):
    per device a spare capture worker (on a GPU its CUDA context is what makes its boot slow;
    on a busy 2-core CPU its cold start took 2.02 s), detection and roi_landmark worker (models
    loaded and run once), and one spare output worker (its Python, pylsl and numpy imported:
    about 1.8 s of boot). `daemon.warm_standby`: "auto" and "on" keep them on every device, the
    CPU included ("on" is the older name), "off" none."""
    mode = config.daemon.warm_standby
    if mode == "off":
        return []
    devices = camera_devices(config, gpu_count)
    specs = []
    for device in dict.fromkeys(devices.values()):
        for role in ("capture", "detection", "roi_landmark"):
            specs.append(WorkerSpec(f"standby:{role}:{device}", role, (), device, standby=True))
    specs.append(WorkerSpec("standby:output", "output", (), "cpu", standby=True))
    return specs


@dataclass
class ReloadPlan:
    start: list[WorkerSpec]
    stop: list[WorkerSpec]
    restart: list[WorkerSpec]  # the new spec of a worker that must start afresh
    reassign: list[WorkerSpec]  # running workers that get a new Assignment
    unchanged: list[str]


class ReloadRefused(ValueError):
    """This change cannot be applied to a running daemon; the message says why."""


def reload_plan(old: Config, new: Config, gpu_count: int) -> ReloadPlan:
    if old.daemon.runtime_dir != new.daemon.runtime_dir:
        raise ReloadRefused("daemon.runtime_dir cannot change while running; restart facecast")
    old_specs = {s.name: s for s in plan(old, gpu_count)}
    new_specs = {s.name: s for s in plan(new, gpu_count)}
    result = ReloadPlan([], [], [], [], [])
    for name, spec in new_specs.items():
        before = old_specs.get(name)
        if before is None:
            result.start.append(spec)
        elif before.device != spec.device or _needs_restart(before, spec, old, new):
            result.restart.append(spec)
        elif before.camera_ids != spec.camera_ids or _config_for(spec, old) != _config_for(spec, new):
            result.reassign.append(spec)
        else:
            result.unchanged.append(name)
    result.stop = [spec for name, spec in old_specs.items() if name not in new_specs]
    return result


def _needs_restart(before: WorkerSpec, spec: WorkerSpec, old: Config, new: Config) -> bool:
    if spec.role == "capture":
        # A capture worker's cameras are fixed for its life (their threads and rings).
        return (before.camera_ids != spec.camera_ids
                or any(old.camera(c) != new.camera(c)
                       or old.transport_for(old.camera(c)) != new.transport_for(new.camera(c))
                       for c in spec.camera_ids)
                or old.daemon.ring_slots != new.daemon.ring_slots
                # The producer decides what its frames' checksum covers (RingDescription).
                or old.daemon.checksum != new.daemon.checksum)
    if spec.role in ("detection", "roi_landmark"):
        return old.models != new.models or old.output != new.output
    if spec.role == "console":  # its socket, token, previews; the Markers stream it reads
        return old.web != new.web or old.host() != new.host()
    # The output worker: its channels, host name, and whether blendshapes can be filled (the
    # models section names the face_landmarker bundle).
    return old.output != new.output or old.host() != new.host() or old.models != new.models


def _config_for(spec: WorkerSpec, config: Config) -> object:
    """What a running worker of this role reads from the config (beyond what restarts it)."""
    cameras = tuple(config.camera(c) for c in spec.camera_ids)
    # [participants] is read by the roi_landmark workers (who is who) and the output worker
    # (participant streams; with [synchrony], the Synchrony stream).
    participants = ((config.participants, config.synchrony)
                    if spec.role in ("roi_landmark", "output") else None)
    return (cameras, config.daemon.checksum_every, config.daemon.detect_interval_s, participants)
