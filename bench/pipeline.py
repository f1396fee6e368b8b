"""Whole-daemon benchmark: N synthetic 1080p30 cameras (two faces each) through `facecast run`.

    python bench/pipeline.py [--cameras 1 4 8 16 32] [--transports cuda_ipc shm]
                             [--warmup-s 15] [--measure-s 20] [--out docs/benchmarks-pipeline.json]
                             [--mediapipe-baseline [--mediapipe-path /tmp/mp] [--mediapipe-python PY]]
    python bench/pipeline.py --cameras 32,64 --transports cuda_ipc --boot-stop-only [--hold-s 5]

For every camera count and transport, in the same run, it starts the real daemon (supervisor and
workers) with its own runtime directory and notify socket, and measures (the definitions, the
same for facecast and the MediaPipe baseline, are bench/accounting.py's DEFINITIONS and
BOOT_STOP_DEFINITIONS below; the JSON carries them, the table's legend repeats them):

- boot: `facecast run` → READY=1 on a real NOTIFY_SOCKET socket, and workers killed as hung while
  booting; stop: SIGTERM → the supervisor's exit, and workers it had to SIGKILL (from its log);
- after a warm-up, a window of time read by real pylsl inlets on every Face stream: frames
  due, frames published (a sample an inlet read; frames by when they were due), dropped = due
  − published, never clamped, and lost between published frames; faces of every published
  frame against the synthetic scene's ground truth;
- capture → result latency p50/p99 (the output worker, right after its LSL push; the worst
  camera's), and capture → bench inlet for reference; per-stage latency p50/p99, and each
  hop of a frame from grab to LSL push, waits included (Note [Latency accounted]);
- CPU time of the daemon's process tree per second of the window (cores busy), by process role;
- GPU utilisation and memory from NVML (through the supervisor's status); with `--gpu-trace-s`,
  the GPU's own time by process (every worker's kernels and copies through S seconds of the
  window, bench/gpu_trace.py: Note [Where the GPU's time goes]).

The replayed cameras (`--source synthetic-replay` and its encoded loops) capture at phases of
their own, taken from their ids, as free-running cameras do; `--genlocked` puts every camera
(and the baseline's) at phase 0, capturing at one instant as hardware-triggered cameras do
(Note [Capture phases]; the rows say which, under "phases"). Runs before 2026-11-27 were
genlocked.

`--boot-stop-only` measures boot and stop only (boot, READY=1, hold `--hold-s`, stop): the mode
for 32 and 64 cameras, where the question is whether the daemon starts and stops cleanly.

With `--mediapipe-baseline`, the baseline issue 5 asks for runs after the daemon at every camera
count, on the same machine: MediaPipe's face mesh on the CPU, one process per camera, on the
same synthetic frames (bench/mediapipe_baseline.py; its processes run under
`--mediapipe-python` with `--mediapipe-path` put before $PYTHONPATH, where mediapipe 0.10.21
and protobuf 4.25 are installed). Each daemon row then gets ratios against it: CPU cores busy
(and CPU per frame published), p99 latency, faces per frame. The daemon's scene has ~420 px
faces, which MediaPipe finds too; so a second scene with faces of `--small-face-px` (100 and 250
px wide) is run once, by MediaPipe (one camera, real time) and by facecast's FacePipeline (the
daemon's models and tracking, in this process, on the GPU when there is one), counting the faces
each finds by width. Without the option the JSON says that the baseline was not measured.
Prints a table; writes JSON; `--plot` turns a JSON into a PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import inspect
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

import accounting  # bench/accounting.py: this script's folder is first on sys.path
import gpu_trace  # bench/gpu_trace.py
from facecast.shared.camera_sources import SYNTHETIC_SOURCES  # light: no OpenCV, no pylsl
from facecast.workers.gpu_trace import REQUEST_ENV as GPU_TRACE_REQUEST_ENV

REPO = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT, FPS = 1920, 1080, 30
MAX_FACES = 2


def _output_latency_frames() -> int:
    """How many frames per camera the output worker's latency percentiles cover."""
    from facecast.shared.stats import LatencyWindow

    return inspect.signature(LatencyWindow).parameters["size"].default


OUTPUT_LATENCY_FRAMES = _output_latency_frames()


def config_text(cameras: int, transport: str, runtime_dir: Path, roi_workers: int | str,
                cuda_graphs: bool, half: bool, host: str, source: str,
                detection_share: float | None = None, decode: str = "auto",
                newcomers: bool = False, cameras_per_capture_worker: int | str = "auto",
                genlocked: bool = False, heartbeat_timeout_s: float | None = None) -> str:
    # log_level "info": the supervisor's log then shows each worker's start and boot time too.
    lines = [
        "[daemon]", f'runtime_dir = "{runtime_dir}"', f'transport = "{transport}"',
        f'host_name = "{host}"', "checksum_every = 30",
        f"roi_landmark_workers = {json.dumps(roi_workers)}",  # TOML: 2 or "auto"
        f"cameras_per_capture_worker = {json.dumps(cameras_per_capture_worker)}",
        'log_level = "info"',
        *([f"detection_share = {detection_share}"] if detection_share is not None else []),
        f'decode = "{decode}"',  # where the encoded sources' video is decoded (Note [Decoder choice])
        *([f"heartbeat_timeout_s = {heartbeat_timeout_s}"] if heartbeat_timeout_s is not None else []),
        "", "[models]", f"cuda_graphs = {str(cuda_graphs).lower()}",
        f"half = {str(half).lower()}", "", "[output]", f"max_faces = {MAX_FACES}", "",
    ]
    for k in range(cameras):
        lines += ["[[cameras]]", f'id = "cam{k:02d}"', f'source = "{source}"',
                  f"width = {WIDTH}", f"height = {HEIGHT}", f"fps = {FPS}",
                  *(["phase = 0.0"] if genlocked else []), ""]  # Note [Capture phases]
        if newcomers:
            lines += staging_toml(NEWCOMER_STAGING)
    return "\n".join(lines)


# --newcomers (Note [A newcomer's delay]): grace_hopper stays in seat 1, tracked; astronaut walks
# into seat 0 halfway through every cycle of scene time. A replayed loop (1 s of scene time each
# way) shows the arrival once a round trip (about every 2 s), the live scene once a second.
NEWCOMER = "astronaut"
NEWCOMER_STAGING = {"cycle_s": 1.0, "appearances": [
    {"photo": "grace_hopper", "seat": 1, "from_s": 0.0, "until_s": 1.0},
    {"photo": NEWCOMER, "seat": 0, "from_s": 0.5, "until_s": 1.0},
]}


def staging_toml(staging: dict) -> list[str]:
    """The last [[cameras]] table's staging, as TOML lines."""
    lines = ["[cameras.staging]", f"cycle_s = {staging['cycle_s']}", ""]
    for shown in staging["appearances"]:
        lines += ["[[cameras.staging.appearances]]",
                  *(f"{key} = {json.dumps(value)}" for key, value in shown.items()), ""]
    return lines


def process_cpu_s(pid: int) -> float | None:
    """User+system CPU seconds of one process (all its threads), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def role_cpu_s(status) -> dict[int, tuple[str, float]]:
    """pid → (role, CPU seconds) of every worker and of the supervisor."""
    found = {}
    for pid, role in [(status.pid, "supervisor"),
                      *((w.pid, "standby" if w.standby else w.role) for w in status.workers)]:
        cpu_s = process_cpu_s(pid) if pid else None
        if cpu_s is not None:
            found[pid] = (role, cpu_s)
    return found


def thread_cpu_s(pid: int) -> dict[str, float]:
    """User+system CPU seconds of each thread of a process, by thread name (the threads of one
    name summed); {} when it is gone."""
    by_name: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return by_name
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf(
            "SC_CLK_TCK")
    return by_name


def spare_threads_cpu_s(status) -> dict[int, tuple[str, float, dict[str, float]]]:
    """pid → (name, CPU seconds, CPU seconds by thread name) of every warm spare (issue 24 item
    4: a spare that waits should cost nothing; its threads say what does)."""
    found = {}
    for worker in status.workers:
        cpu_s = process_cpu_s(worker.pid) if worker.standby and worker.pid else None
        if cpu_s is not None:
            found[worker.pid] = (worker.name, cpu_s, thread_cpu_s(worker.pid))
    return found


def spare_cores(first: dict, last: dict, window_s: float) -> dict:
    """Cores of each warm spare over the window (a spare at both ends: the process's own
    figure, threads that ended included), and of the spares' living threads by name, summed
    over the spares."""
    per_spare: dict[str, float] = {}
    by_thread: dict[str, float] = {}
    for pid, (name, cpu_s, threads) in last.items():
        if pid not in first or first[pid][0] != name:
            continue
        _, cpu_s_before, threads_before = first[pid]
        per_spare[name] = (cpu_s - cpu_s_before) / window_s
        for thread, thread_s in threads.items():
            by_thread[thread] = (by_thread.get(thread, 0.0)
                                 + (thread_s - threads_before.get(thread, 0.0)) / window_s)
    return {"per_spare": {name: round(cores, 4) for name, cores in sorted(per_spare.items())},
            "by_thread": {thread: round(cores, 4) for thread, cores in
                          sorted(by_thread.items(), key=lambda item: -item[1]) if cores > 0}}


def memory_role(worker) -> str:
    """The column a worker's memory is summed under: its role, warm spares apart."""
    return f"{worker.role} (spares)" if worker.standby else worker.role


def gpu_memory_by_role(status) -> dict[str, float]:
    """MiB of device memory held by each role's processes (warm spares apart), as NVML counts
    them per process (`WorkerStatus.gpu_memory_mib`)."""
    by_role: dict[str, float] = {}
    for worker in status.workers:
        if worker.gpu_memory_mib is not None:
            role = memory_role(worker)
            by_role[role] = round(by_role.get(role, 0.0) + worker.gpu_memory_mib, 1)
    return by_role


TORCH_MEMORY_FIGURES = ("allocated_mib", "reserved_mib", "peak_allocated_mib")


def torch_memory_by_role(status) -> dict[str, dict[str, float]]:
    """MiB that torch's caching allocator reports for each role's processes (warm spares apart,
    as gpu_memory_by_role), summed: in live tensors, held from the driver, and the peak in live
    tensors (`WorkerStatus.torch_memory`, from their heartbeats). NVML's figure minus the held
    is the CUDA context, cuBLAS/cuDNN and what torch does not allocate (the rings)."""
    by_role: dict[str, dict[str, float]] = {}
    for worker in status.workers:
        if worker.torch_memory is not None:
            sums = by_role.setdefault(memory_role(worker), dict.fromkeys(TORCH_MEMORY_FIGURES, 0.0))
            for figure in TORCH_MEMORY_FIGURES:
                sums[figure] = round(sums[figure] + getattr(worker.torch_memory, figure), 1)
    return by_role


def cores_by_role(first: dict, last: dict, window_s: float) -> dict[str, float]:
    """Cores busy per worker role over the window (processes alive at both ends)."""
    busy: dict[str, float] = {}
    for pid, (role, cpu_s) in last.items():
        if pid in first:
            busy[role] = busy.get(role, 0.0) + (cpu_s - first[pid][1]) / window_s
    return {role: round(cores, 2) for role, cores in sorted(busy.items())}


def tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process and its children (alive ones, by /proc)."""
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    return sum(cpu_s for cpu_s in map(process_cpu_s, pids) if cpu_s is not None)


class NotifySocket:
    """systemd's side of sd_notify: a bound AF_UNIX datagram socket (the daemon's real
    $NOTIFY_SOCKET), read all the time by a thread as systemd does (a listener that stops
    reading fills its queue and loses datagrams), each line kept with its arrival time on the
    monotonic clock."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.1)
        self.lines: list[tuple[float, str]] = []  # (arrival monotonic, KEY=VALUE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notify-socket", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            arrived_monotonic = time.monotonic()
            self.lines += [(arrived_monotonic, text) for text in data.decode().splitlines()]

    def arrival(self, line: str) -> float | None:
        """When `line` (e.g. "READY=1") first arrived, None if it has not."""
        return next((t for t, text in list(self.lines) if text == line), None)

    def wait_for(self, line: str, deadline_monotonic: float, alive) -> float | None:
        """Arrival time of `line`, waiting until the deadline or until `alive()` is False."""
        while (arrived := self.arrival(line)) is None:
            if time.monotonic() > deadline_monotonic or not alive():
                return self.arrival(line)
            time.sleep(0.02)
        return arrived

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def output_reports(status) -> list:
    """The output worker's report of each camera (the one that carries latency)."""
    return [report for reports in status.cameras.values() for report in reports
            if report.latency_ms is not None]


def _is_hop(stage_name: str) -> bool:
    """The output worker's hops of a frame ("output/hop 3: picked up → read"), not a stage."""
    return stage_name.split("/", 1)[-1].startswith("hop ")


def captured_total(status) -> int:
    """Frames the capture workers report, all cameras (their counters, sent with heartbeats)."""
    return sum(report.frames for reports in status.cameras.values() for report in reports
               if report.source)


# ---------------------------------------------------------------------------------------------
# The daemon: boot to READY=1, stop, and what its log says about both
# ---------------------------------------------------------------------------------------------

# Note [Boot and stop, measured]
#     Boot: from starting `facecast run` (the Popen) to READY=1 arriving on a real NOTIFY_SOCKET
#     datagram socket, which the supervisor sends once every worker of the config has booted and
#     every camera has a frame (daemon/supervisor.py `_tick_systemd`). Stop: from SIGTERM to the
#     supervisor's exit (waitpid). The supervisor logs each worker it has to kill; those lines are
#     counted from its log: "did not stop in time; killing it" and "did not end after closing in
#     time; killing it" (SIGKILL at stop: Note [A closed worker is not killed]), "stuck even after
#     SIGKILL", and "did not start within" (killed as hung while booting; before the "ready:" line
#     at boot, after it when a restarted worker hung).
LOG_SIGKILLED_AT_STOP = "did not stop in time; killing it"
LOG_SIGKILLED_AFTER_CLOSING = "did not end after closing in time; killing it"
LOG_STUCK_AFTER_SIGKILL = "stuck even after SIGKILL"
LOG_HUNG_BOOTING = "did not start within"
LOG_READY = re.compile(r"facecast\.daemon\.supervisor: ready\b")  # "ready in 9.6 s: ..."

BOOT_STOP_DEFINITIONS = {
    "boot_to_ready_s": "from starting `facecast run` to READY=1 arriving on the bench's "
                       "NOTIFY_SOCKET datagram socket",
    "spares_standing_by_after_ready_s": "from READY=1 until every warm spare has booted (state "
                                        "standby in the status); the warm-up and the window "
                                        "start after it",
    "workers_hung_at_boot": f"supervisor log lines '{LOG_HUNG_BOOTING}' before its 'ready:' "
                            "line (a worker killed as hung while booting); "
                            "workers_hung_booting_later: the same after it",
    "stop_s": "from SIGTERM to the supervisor's exit (stopping_sent_after_s: to STOPPING=1 "
              "arriving on the notify socket)",
    "workers_sigkilled_at_stop": f"supervisor log lines '{LOG_SIGKILLED_AT_STOP}' and "
                                 f"'{LOG_SIGKILLED_AFTER_CLOSING}'",
    "workers_stuck_after_sigkill": f"supervisor log lines '{LOG_STUCK_AFTER_SIGKILL}'",
    "supervisor_killed_by_bench": "the supervisor had not exited --stop-timeout-s after SIGTERM "
                                  "and the bench SIGKILLed it",
}


class DaemonUnderTest:
    """`facecast run` with its own runtime directory and notify socket, timed (Note [Boot and
    stop, measured])."""

    def __init__(self, tmp: Path, config: str, log_path: Path) -> None:
        self.runtime_dir = tmp / "run"
        self.log_path = log_path
        config_path = tmp / "bench.toml"
        config_path.write_text(config)
        self.notify = NotifySocket(tmp / "notify")
        env = dict(os.environ, NOTIFY_SOCKET=self.notify.path)
        env.pop("WATCHDOG_USEC", None)
        self._log = open(log_path, "w")
        self.started_monotonic = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "facecast.daemon.cli", "run", "--config", str(config_path)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.boot: dict = {}
        self.stop_result: dict = {}

    def wait_ready(self, timeout_s: float) -> bool:
        ready_monotonic = self.notify.wait_for("READY=1", self.started_monotonic + timeout_s,
                                               lambda: self.process.poll() is None)
        self.boot = {"boot_to_ready_s": None if ready_monotonic is None
                     else round(ready_monotonic - self.started_monotonic, 2)}
        return ready_monotonic is not None

    def status(self, timeout_s: float = 30.0):
        from facecast.daemon.cli.control_client import request
        from facecast.shared.transport.messages import StatusRequest

        return request(self.runtime_dir, StatusRequest(), timeout_s)

    def seconds_until_spares_stand_by(self, timeout_s: float) -> float | None:
        """Wait for every warm spare to have booted (they start at READY, Note [Warm standby]):
        the daemon's steady state. Seconds waited, None past `timeout_s`."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if all(w.state == "standby" for w in self.status().workers if w.standby):
                return round(time.monotonic() - started, 2)
            time.sleep(0.2)
        return None

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float) -> dict:
        """SIGTERM, wait for the supervisor's exit (SIGKILL after `timeout_s`), count the log's
        kills. Idempotent."""
        if self.stop_result:
            return self.stop_result
        killed_by_bench = False
        sigterm_monotonic = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                killed_by_bench = True
                self.process.kill()
                self.process.wait()
        stop_s = time.monotonic() - sigterm_monotonic
        stopping_monotonic = self.notify.arrival("STOPPING=1")
        self._log.close()
        self.notify.close()
        counts = kills_in_log(self.log_path.read_text(errors="replace"))
        self.stop_result = {
            "stop_s": round(stop_s, 2),
            "stopping_sent_after_s": None if stopping_monotonic is None
            else round(stopping_monotonic - sigterm_monotonic, 3),
            "exit_code": self.process.returncode,
            "workers_sigkilled_at_stop": counts["workers_sigkilled_at_stop"],
            "workers_stuck_after_sigkill": counts["workers_stuck_after_sigkill"],
            "supervisor_killed_by_bench": killed_by_bench,
        }
        self.boot.update({key: counts[key] for key in ("workers_hung_at_boot",
                                                       "workers_hung_booting_later")})
        return self.stop_result


def kills_in_log(text: str) -> dict[str, int]:
    """The supervisor's kills, counted from its log (Note [Boot and stop, measured])."""
    ready = LOG_READY.search(text)
    booting, later = (text, "") if ready is None else (text[:ready.start()], text[ready.start():])
    return {"workers_hung_at_boot": booting.count(LOG_HUNG_BOOTING),
            "workers_hung_booting_later": later.count(LOG_HUNG_BOOTING),
            "workers_sigkilled_at_stop": (text.count(LOG_SIGKILLED_AT_STOP)
                                          + text.count(LOG_SIGKILLED_AFTER_CLOSING)),
            "workers_stuck_after_sigkill": text.count(LOG_STUCK_AFTER_SIGKILL)}


# ---------------------------------------------------------------------------------------------
# facecast's published frames, as a consumer sees them: real pylsl inlets on every Face stream
# ---------------------------------------------------------------------------------------------


class FaceStreamReader:
    """Every sample of every Face stream of one daemon (one per camera and face slot), pulled
    from real pylsl inlets by a thread, with its arrival time; only the box channels are kept."""

    def __init__(self, host: str, streams: int, timeout_s: float) -> None:
        import pylsl

        from facecast.workers.output.outlets import face_channels

        labels = [label for label, _, _ in face_channels(landmarks=False)]
        self.box_channels = [labels.index(n) for n in ("box_x1", "box_y1", "box_x2", "box_y2")]
        prefix = f"facecast-{host}-"
        infos = pylsl.resolve_bypred(f"type='Face' and starts-with(source_id,'{prefix}')",
                                     minimum=streams, timeout=timeout_s)
        if len(infos) < streams:
            raise RuntimeError(f"{len(infos)} of {streams} Face streams of {host} resolved in "
                               f"{timeout_s:g} s")
        # source id facecast-<host>-<camera>-face<slot>: the camera is what is between.
        self.camera_of = [info.source_id()[len(prefix):].rsplit("-", 1)[0] for info in infos]
        self.inlets = [pylsl.StreamInlet(info, max_buflen=120) for info in infos]
        for inlet in self.inlets:
            inlet.open_stream(timeout=timeout_s)
        self._chunks: list[list[tuple[np.ndarray, np.ndarray, float]]] = [[] for _ in infos]
        self._newest_ts_lsl = [-math.inf] * len(infos)
        self._local_clock = pylsl.local_clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="face-stream-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for index, inlet in enumerate(self.inlets):
                samples, stamps = inlet.pull_chunk(timeout=0.0, max_samples=4096, as_numpy=True)
                if len(stamps):
                    arrival_ts_lsl = self._local_clock()
                    self._chunks[index].append((np.asarray(stamps, np.float64),
                                                samples[:, self.box_channels].astype(np.float64),
                                                arrival_ts_lsl))
                    self._newest_ts_lsl[index] = float(stamps[-1])
            time.sleep(0.005)

    def every_stream_has_data(self) -> bool:
        return all(ts > -math.inf for ts in self._newest_ts_lsl)

    def newest_ts_lsl_by_camera(self) -> dict[str, float]:
        newest: dict[str, float] = {}
        for camera, ts in zip(self.camera_of, self._newest_ts_lsl):
            newest[camera] = max(newest.get(camera, -math.inf), ts)
        return newest

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for inlet in self.inlets:
            inlet.close_stream()

    def by_camera(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """camera → (capture timestamps, boxes (n, 4), arrival times) of its slots' samples."""
        parts: dict[str, list] = {}
        for camera, chunks in zip(self.camera_of, self._chunks):
            for stamps, boxes, arrival_ts_lsl in chunks:
                parts.setdefault(camera, []).append((stamps, boxes,
                                                     np.full(len(stamps), arrival_ts_lsl)))
        return {camera: tuple(np.concatenate([part[k] for part in chunks]) for k in range(3))
                for camera, chunks in parts.items()}


def _dropped_cell(row: dict) -> str:
    """dropped (% of due), and the frames lost between published ones where counted (rows
    before 2026-11-28 have no lost_between)."""
    between = f", {row['lost_between']} between" if "lost_between" in row else ""
    return f"{row['dropped']} ({row['dropped_pct']}%{between})"


def published_frames(samples, window: accounting.Window, camera_ids: list[str],
                     source: str = "synthetic", newcomers: bool = False,
                    genlocked: bool = False) -> dict:
    """Frames published in the window, faces against the ground truth and capture → inlet
    latency, from every sample the inlets got (Note [One definition for both sides]); with
    `newcomers`, how late each appearance of NEWCOMER was published (Note [A newcomer's
    delay])."""
    import msgspec

    from facecast.shared.config import CameraConfig, StagingConfig
    from facecast.workers.capture.sources import synthetic_truth

    staging = msgspec.convert(NEWCOMER_STAGING, StagingConfig) if newcomers else None
    faces = accounting.FaceTally()
    arrivals_tally = accounting.NewcomerTally(NEWCOMER)
    published = lost_between = 0
    per_camera_inlet: list[tuple[float, float]] = []
    for camera in camera_ids:
        if camera not in samples:
            continue  # nothing published: all its frames are due and dropped
        stamps, boxes, arrivals = samples[camera]
        truth = synthetic_truth(CameraConfig(id=camera, source=source, width=WIDTH,
                                             height=HEIGHT, fps=FPS, staging=staging,
                                             phase=0.0 if genlocked else None))
        due = accounting.due_ts_lsl(truth, stamps)  # Note [Due, not stamped]
        inside = window.holds(due)
        stamps, boxes, arrivals, due = stamps[inside], boxes[inside], arrivals[inside], due[inside]
        # One frame, one capture timestamp, on every face slot's stream; and a frame due once
        # counts once, however often it was shown.
        frame_ts, frame_of_sample = np.unique(stamps, return_inverse=True)
        due_frames = np.unique(due)
        published += len(due_frames)
        lost_between += accounting.frames_lost_between(due_frames, FPS)
        if not len(frame_ts):
            continue
        # Each frame's faces: its samples' boxes that are not NaN (an empty slot is all NaN).
        order = np.argsort(frame_of_sample, kind="stable")
        boxes_by_frame = np.split(boxes[order], np.cumsum(np.bincount(frame_of_sample))[:-1])
        found_boxes = [[tuple(b) for b in frame_boxes[np.isfinite(frame_boxes).all(axis=1)]]
                       for frame_boxes in boxes_by_frame]
        for capture_ts_lsl, frame_boxes in zip(frame_ts, found_boxes):
            faces.add(truth.faces_at(capture_ts_lsl), frame_boxes)
        # The frame's first sample to arrive, on any slot: when a consumer could have had it.
        first_arrival = np.full(len(frame_ts), np.inf)
        np.minimum.at(first_arrival, frame_of_sample, arrivals)
        per_camera_inlet.append(tuple(np.percentile((first_arrival - frame_ts) * 1e3, [50, 99])))
        if newcomers:
            arrivals_tally.add_camera(truth, FPS, window, frame_ts, found_boxes, first_arrival)
    return {"published": published, "lost_between": lost_between, "faces": faces,
            "inlet_latency": accounting.worst_camera_latency(per_camera_inlet),
            "newcomers": arrivals_tally.summary() if newcomers else None}


def run_one(cameras: int, transport: str, args) -> dict:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.log_dir / f"daemon-{cameras}-{transport}-{args.source}.log"
    host = f"bench{uuid.uuid4().hex[:8]}"  # stream ids of this run only
    result = {"cameras": cameras, "transport": transport, "side": "facecast",
              "source": args.source,
              "models": "fp16" if args.half else "fp32", "cuda_graphs": args.cuda_graphs,
              "roi_workers": args.roi_workers,
              "cameras_per_capture_worker": args.cameras_per_capture_worker,
              "detection_share": args.detection_share or "auto",
              "decode": args.decode,
              "phases": "genlocked" if args.genlocked else "free-running",
              "log": str(log_path)}
    with tempfile.TemporaryDirectory(prefix="fcb-") as tmp:
        tmp = Path(tmp)
        config = config_text(cameras, transport, tmp / "run", args.roi_workers, args.cuda_graphs,
                             args.half, host, args.source, args.detection_share, args.decode,
                             args.newcomers, args.cameras_per_capture_worker, args.genlocked,
                             GpuTraces.HEARTBEAT_TIMEOUT_S if args.gpu_trace_s > 0 else None)
        # Note [Where the GPU's time goes]: every worker looks for the request file (absent
        # until measure() writes it) through the environment it inherits.
        gpu_trace_request = tmp / "gpu-trace-request.json"
        os.environ.pop(GPU_TRACE_REQUEST_ENV, None)
        if args.gpu_trace_s > 0:
            os.environ[GPU_TRACE_REQUEST_ENV] = str(gpu_trace_request)
        daemon = DaemonUnderTest(tmp, config, log_path)
        os.environ.pop(GPU_TRACE_REQUEST_ENV, None)
        try:
            if not daemon.wait_ready(args.boot_timeout_s):
                result["error"] = "daemon did not become ready: " + daemon.log_tail()
                return result
            at_ready = daemon.status()
            result["workers_at_ready"] = len([w for w in at_ready.workers if not w.standby])
            result["standbys_at_ready"] = len([w for w in at_ready.workers if w.standby])
            if args.boot_stop_only:
                time.sleep(args.hold_s)
                held = daemon.status()
                result["not_running_after_hold"] = [f"{w.name}:{w.state}" for w in held.workers
                                                    if w.state not in ("running", "standby")]
                return result
            # The window is of the steady state: spares booting (a core each, and the GPU, for
            # tens of seconds after READY) are boot's cost, reported here, not the pipeline's.
            result["spares_standing_by_after_ready_s"] = daemon.seconds_until_spares_stand_by(
                args.spares_timeout_s)
            measure(daemon, host, cameras, args, result, gpu_trace_request=gpu_trace_request)
            return result
        except (OSError, RuntimeError, TimeoutError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc} | {daemon.log_tail(8)}"
            return result
        finally:
            result["stop"] = daemon.stop(args.stop_timeout_s)
            result["boot"] = daemon.boot  # with the log's hung-at-boot counts, known after stop


def measure(daemon: DaemonUnderTest, host: str, cameras: int, args, result: dict,
            gpu_trace_request: Path | None = None) -> None:
    """Warm up, read every Face stream through a window of capture time, fill `result`."""
    import pylsl

    camera_ids = [f"cam{k:02d}" for k in range(cameras)]
    warmup_s, traces = args.warmup_s, None
    if args.gpu_trace_s > 0 and gpu_trace_request is not None:
        # Preparing the profiler stalls each worker for seconds (Note [Where the GPU's time
        # goes]): asked for now, it stalls them in the warm-up, and the traces' window lies in
        # the bench's.
        warmup_s = max(warmup_s, GpuTraces.PREPARE_S)
        traces = GpuTraces.request(
            gpu_trace_request, args.gpu_trace_s,
            args.log_dir / f"gpu-trace-{cameras}-{result['transport']}",
            start_unix_s=time.time() + warmup_s + GpuTraces.INTO_WINDOW_S)
    time.sleep(warmup_s)
    reader = FaceStreamReader(host, cameras * MAX_FACES, timeout_s=60.0)
    try:
        deadline_monotonic = time.monotonic() + 30.0
        while not reader.every_stream_has_data():
            if time.monotonic() > deadline_monotonic:
                raise RuntimeError("some Face streams sent nothing for 30 s after the warm-up")
            time.sleep(0.05)
        # Every inlet is connected and receiving: every sample captured from now on reaches it.
        window = accounting.Window.starting_at(pylsl.local_clock(), args.measure_s, FPS)
        first = daemon.status()
        cpu_first = tree_cpu_s(daemon.process.pid)
        roles_first = role_cpu_s(first)
        spares_first = spare_threads_cpu_s(first)
        profiles = Profiles.start(first, args.profile_roles, window.length_s,
                                  args.log_dir / f"profile-{cameras}-{result['transport']}")
        time.sleep(max(0.0, window.end_ts_lsl - pylsl.local_clock()))
        last = daemon.status()
        cpu_last = tree_cpu_s(daemon.process.pid)
        roles_last = role_cpu_s(last)
        spares_last = spare_threads_cpu_s(last)
        # Drain: frames due before the window's end may still be in the pipeline, stamped up
        # to half a period after it (Note [Due, not stamped]).
        drain_deadline_monotonic = time.monotonic() + args.drain_s
        while (min(reader.newest_ts_lsl_by_camera().values()) < window.end_ts_lsl + 1.0 / FPS
               and time.monotonic() < drain_deadline_monotonic):
            time.sleep(0.05)
        drained = daemon.status()
        result["profiles"] = profiles.finish()
        if traces is not None:
            result["gpu_trace"] = traces.finish()
    finally:
        reader.close()
    counted = published_frames(reader.by_camera(), window, camera_ids, args.source,
                               args.newcomers, args.genlocked)
    reports = output_reports(drained)
    transports = sorted({r.transport for reports_ in last.cameras.values() for r in reports_
                         if r.transport})
    reasons = sorted({r.fallback_reason for reports_ in last.cameras.values() for r in reports_
                      if r.fallback_reason})
    status_window_s = window.length_s  # the status reads bracket the window
    result.update({
        "window_start_ts_lsl": window.start_ts_lsl,
        **accounting.frame_counts(cameras, window, counted["published"], counted["lost_between"]),
        # For reference, not part of "dropped": the capture workers' own counters (sent with
        # heartbeats, so exact to about one heartbeat per camera).
        "captured_fps": round((captured_total(last) - captured_total(first)) / status_window_s, 1),
        **accounting.worst_camera_latency((r.latency_ms.p50_ms, r.latency_ms.p99_ms)
                                          for r in reports),
        # The cameras' p99s beside their maximum: one slow camera, or all of them?
        "latency_p99_by_camera": accounting.camera_p99_spread({
            camera_id: report.latency_ms.p99_ms for camera_id, reports_ in drained.cameras.items()
            for report in reports_ if report.latency_ms is not None}),
        # The output worker's latency covers its last OUTPUT_LATENCY_FRAMES frames per camera:
        # how many of those were captured before the window (0 when the window is long enough).
        "latency_frames_before_window": max(0, OUTPUT_LATENCY_FRAMES - window.frames_per_camera),
        "latency_to_inlet": counted["inlet_latency"],
        "faces": counted["faces"].summary(),
        **({"newcomers": counted["newcomers"]} if args.newcomers else {}),
        # Each worker's own stages, and the output worker's hops of every frame (Note [Latency
        # accounted]): their means add up to the mean latency, waits between processes included.
        "stages": {name: {"p50_ms": t.p50_ms, "p99_ms": t.p99_ms}
                   for name, t in drained.stages.items() if not _is_hop(name)},
        "frame_hops": {name.split("/", 1)[1]: {"mean_ms": t.mean_ms, "p50_ms": t.p50_ms,
                                               "p99_ms": t.p99_ms, "frames": t.count}
                       for name, t in drained.stages.items() if _is_hop(name)},
        "cpu_cores_busy": round((cpu_last - cpu_first) / window.length_s, 2),
        # Where the CPU goes: capture renders (synthetic) or decodes, the rest is our cost.
        "cpu_cores_by_role": cores_by_role(roles_first, roles_last, window.length_s),
        # Each warm spare while it waits, and its threads by name (the CUDA driver's among them).
        "spare_cores": spare_cores(spares_first, spares_last, window.length_s),
        "gpus": [{"name": g.name, "utilization_pct": g.utilization_pct,
                  "memory_used_mib": g.memory_used_mib} for g in last.gpus],
        # Where the GPU memory goes (NVML, per worker process, at the window's end).
        "gpu_memory_mib_by_role": gpu_memory_by_role(last),
        # And torch's share of it (each worker's caching allocator, from its last heartbeat).
        "torch_memory_mib_by_role": torch_memory_by_role(last),
        "transports_seen": transports, "fallback_reasons": reasons,
        "workers": [f"{w.name}:{w.state}:{w.restarts}" for w in drained.workers],
    })


class GpuTraces:
    """Note [Where the GPU's time goes] (workers/gpu_trace.py): asks every worker for the same
    window of its GPU activity, then adds the traces up (bench/gpu_trace.py)."""

    # Workers look for the request at their heartbeats (0.5 s), then prepare the profiler, which
    # stalls each of them: 5.6-6.8 s at 64 cameras on the H100, over 10 s on another loan and
    # under MPS (2026-11-27 23:02-23:08, when the supervisor killed them as hung, spares in
    # turn, and no window was left that every worker recorded). So the warm-up is at least
    # PREPARE_S, and the daemon of a traced run waits HEARTBEAT_TIMEOUT_S (its default 10) before
    # it calls a silent worker hung.
    PREPARE_S = 25.0
    HEARTBEAT_TIMEOUT_S = 60.0
    INTO_WINDOW_S = 2.0  # the traces start this long after the warm-up, inside the window
    SETTLE_S = 3.0  # no new trace file for this long after the window: every worker has written

    def __init__(self, out_dir: Path, start_unix_s: float, seconds: float) -> None:
        self.out_dir, self.start_unix_s, self.seconds = out_dir, start_unix_s, seconds

    @classmethod
    def request(cls, request_path: Path, seconds: float, out_dir: Path,
                start_unix_s: float) -> GpuTraces:
        shutil.rmtree(out_dir, ignore_errors=True)
        request_path.write_text(json.dumps({"start_unix_s": start_unix_s, "seconds": seconds,
                                            "out_dir": str(out_dir)}))
        return cls(out_dir, start_unix_s, seconds)

    def finish(self, timeout_s: float = 30.0) -> dict:
        deadline = time.time() + timeout_s
        seen, settled_at = -1, time.time()
        while time.time() < deadline:
            count = len(list(self.out_dir.glob("*.json"))) if self.out_dir.is_dir() else 0
            if count != seen:
                seen, settled_at = count, time.time()
            elif (time.time() > self.start_unix_s + self.seconds
                  and time.time() - settled_at > self.SETTLE_S):
                break
            time.sleep(0.2)
        if seen <= 0:
            return {"error": f"no worker wrote a GPU trace into {self.out_dir} (no CUPTI?)"}
        return {"dir": str(self.out_dir), "start_unix_s": self.start_unix_s,
                **gpu_trace.summarize(self.out_dir, self.start_unix_s, self.seconds)}


class Profiles:
    """Where the CPU of one worker of each asked role goes during the window: py-spy samples it
    (`record --nonblocking`: the process is not paused; idle threads are not counted), and the
    functions that were on CPU most, their own time and with their callees, are kept."""

    TOP = 12

    def __init__(self, runs: dict[str, tuple[subprocess.Popen, Path]], missing: str) -> None:
        self.runs, self.missing = runs, missing

    @classmethod
    def start(cls, status, roles: list[str], seconds: float, prefix: Path) -> Profiles:
        if not roles:
            return cls({}, "")
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            return cls({}, "py-spy is not installed (pip install py-spy)")
        runs = {}
        for role in roles:
            worker = next((w for w in status.workers if w.role == role and not w.standby
                           and w.pid > 0), None)
            if worker is None:
                continue
            path = Path(f"{prefix}-{worker.name.replace(':', '_')}.txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            runs[worker.name] = (subprocess.Popen(
                [py_spy, "record", "--pid", str(worker.pid), "--duration", str(int(seconds)),
                 "--rate", "200", "--nonblocking", "--format", "raw", "--output", str(path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), path)
        return cls(runs, "")

    def finish(self) -> dict:
        if self.missing:
            return {"error": self.missing}
        found = {}
        for name, (process, path) in self.runs.items():
            try:
                _, error = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                # Still sampling after its window (the output worker's py-spy at 64 cameras, in
                # every run of 2026-11-28): Ctrl-C makes py-spy write the samples it has.
                process.send_signal(signal.SIGINT)
                try:
                    _, error = process.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()
                    error = "py-spy did not finish"
            found[name] = (self.summary(path.read_text()) if path.exists()
                           else {"error": (error or "no output").strip()[-300:]})
        return found

    @classmethod
    def summary(cls, collapsed: str) -> dict:
        """py-spy's raw output (`frame;frame;...;leaf count` per line, outermost first) as the
        top functions by own samples and by inclusive samples, in % of all samples."""
        own: dict[str, int] = {}
        inclusive: dict[str, int] = {}
        total = 0
        for line in collapsed.splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            samples = int(count)
            frames = [frame for frame in stack.split(";") if frame]
            total += samples
            if frames:
                own[frames[-1]] = own.get(frames[-1], 0) + samples
            for frame in set(frames):
                inclusive[frame] = inclusive.get(frame, 0) + samples

        def top(counts: dict[str, int]) -> list[tuple[str, float]]:
            ranked = sorted(counts.items(), key=lambda item: -item[1])[:cls.TOP]
            return [(frame, round(100.0 * n / total, 1)) for frame, n in ranked]

        return {"samples": total, "own_pct": top(own), "inclusive_pct": top(inclusive)}


def versus(row: dict, baseline: dict | None) -> dict | None:
    """A daemon row against MediaPipe's run at the same camera count: facecast / MediaPipe."""
    if baseline is None or "error" in baseline or "error" in row:
        return None

    def ratio(a, b):
        return round(a / b, 2) if a is not None and b else None

    published_fps = row["published_fps"]
    cpu_ms_per_frame = 1e3 * row["cpu_cores_busy"] / published_fps if published_fps else None
    # The capture workers render the same synthetic frames as MediaPipe's processes; their cost
    # is estimated from what rendering cost there, per frame captured.
    render_cores = baseline["render_cpu_ms_per_frame"] * row["captured_fps"] / 1e3
    return {
        "cpu_ratio": ratio(row["cpu_cores_busy"], baseline["cpu_cores_busy"]),
        "cpu_per_frame_ratio": ratio(cpu_ms_per_frame, baseline["cpu_ms_per_frame"]),
        "cpu_ratio_without_rendering_estimate": ratio(
            row["cpu_cores_busy"] - render_cores,
            baseline["cpu_cores_busy"] - baseline["render_cores_busy"]),
        "p99_ratio": ratio(row["latency_p99_ms"], baseline["latency_p99_ms"]),
        "faces_per_frame": row["faces"]["faces_per_frame"],
        "mediapipe_faces_per_frame": baseline["faces"]["faces_per_frame"],
    }


def facecast_small_faces(face_px: list[float], seconds: float) -> dict:
    """Faces found by facecast's FacePipeline (the daemon's models, detection and tracking) on
    frames of the small-face scene, one after another, by face width (counted as MediaPipe's
    are: bench/accounting.py)."""
    import torch

    from facecast.models.pipeline import FacePipeline
    from mediapipe_baseline import FixedSizeScene

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipeline = FacePipeline(device=device, max_faces=MAX_FACES)
    scene = FixedSizeScene(WIDTH, HEIGHT, "cam00", face_px)
    faces = accounting.FaceTally()
    for k in range(max(1, round(seconds * FPS))):
        t_s = k / FPS
        found = pipeline.track([scene.render(t_s)], ["cam00"])[0]
        faces.add(scene.faces_at(t_s), [face.box for face in found])
    return {"what": f"facecast FacePipeline(max_faces={MAX_FACES}) on {device}, in the bench "
                    "process", "faces": faces.summary()}


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _faces_cell(faces: dict | None) -> str:
    if not faces or not faces.get("frames"):
        return "-"
    return f"{faces['found_of_true']} ({faces['found_pct']}%), {faces['extra']} extra"


def _boot_stop_cells(r: dict) -> list[str]:
    boot, stop = r.get("boot", {}), r.get("stop", {})
    hung = boot.get("workers_hung_at_boot", "-")
    spares = ""
    if "spares_standing_by_after_ready_s" in r:
        waited = r["spares_standing_by_after_ready_s"]
        spares = f", spares +{waited}" if waited is not None else ", spares not booted"
    return [f"{boot.get('boot_to_ready_s', '-')} ({hung}){spares}",
            f"{stop.get('stop_s', '-')} ({stop.get('workers_sigkilled_at_stop', '-')} / "
            f"{stop.get('workers_stuck_after_sigkill', '-')})"
            + (" supervisor SIGKILLed" if stop.get("supervisor_killed_by_bench") else "")]


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def print_table(rows: list[dict], small_faces: dict | None = None,
                boot_stop_only: bool = False) -> str:
    if boot_stop_only:
        header = ["cameras", "transport", "workers (+ standbys)",
                  "boot → READY=1 s (hung at boot)", "stop s (SIGKILLed / stuck after SIGKILL)",
                  "exit code",
                  "not running after the hold"]
        lines = [_row(header), "|" + "---|" * len(header)]
        for r in rows:
            if "error" in r:
                lines.append(_row([r["cameras"], r["transport"], f"failed: {r['error'][:160]}",
                                   *_boot_stop_cells(r), r.get("stop", {}).get("exit_code"), ""]))
                continue
            lines.append(_row([r["cameras"], r["transport"],
                               f"{r['workers_at_ready']} (+ {r['standbys_at_ready']})",
                               *_boot_stop_cells(r), r["stop"]["exit_code"],
                               ", ".join(r["not_running_after_hold"]) or "none"]))
        lines += ["", *legend(BOOT_STOP_DEFINITIONS)]
        text = "\n".join(lines)
        print(text)
        return text
    header = ["cameras", "transport (used)", "frames due", "published fps",
              "dropped = due − published (lost between)", "capture→result p50 / p99 ms", "faces found/true", "slowest stage p99 ms",
              "CPU cores busy", "GPU util / mem", "boot s (hung), spares booted after", "stop s (SIGKILLed / stuck)"]
    with_baseline = any("mediapipe" in r for r in rows)
    if with_baseline:
        header += ["MediaPipe published fps", "MediaPipe dropped", "MediaPipe p50 / p99 ms",
                   "MediaPipe faces found/true", "MediaPipe CPU cores",
                   "CPU ratio fc/mp (per frame)", "p99 ratio fc/mp"]
    lines = [_row(header), "|" + "---|" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(_row([r["cameras"], r["transport"], f"failed: {r['error'][:160]}"]
                              + [""] * (len(header) - 3)))
            continue
        stage = max(r["stages"].items(), key=lambda kv: kv[1]["p99_ms"], default=("-", {"p99_ms": 0}))
        gpus = " + ".join(f"{g['utilization_pct']:.0f}% / {g['memory_used_mib']:.0f} MiB"
                          for g in r["gpus"]) or "-"  # each GPU's, in index order
        source = "" if r.get("source", "synthetic") == "synthetic" else f", {r['source']}"
        if r.get("source", "").startswith("synthetic-") and r["source"] != "synthetic-replay":
            source += f" (decode {r.get('decode', 'auto')})"
        cells = [r["cameras"], f"{r['transport']} ({'/'.join(r['transports_seen'])}){source}",
                 r["frames_due"], r["published_fps"], _dropped_cell(r),
                 f"{r['latency_p50_ms']} / {r['latency_p99_ms']}", _faces_cell(r["faces"]),
                 f"{stage[0]} {stage[1]['p99_ms']:.0f}", r["cpu_cores_busy"],
                 gpus,
                 *_boot_stop_cells(r)]
        if with_baseline:
            v, b = r.get("vs_mediapipe"), r.get("mediapipe")
            if b is None:
                cells += ["-"] * 7
            elif v is None:
                cells += [f"failed: {b.get('error', '')[:160]}"] + [""] * 6
            else:
                cells += [b["published_fps"], _dropped_cell(b),
                          f"{b['latency_p50_ms']} / {b['latency_p99_ms']}", _faces_cell(b["faces"]),
                          b["cpu_cores_busy"], f"{v['cpu_ratio']} ({v['cpu_per_frame_ratio']})",
                          v["p99_ratio"]]
        lines.append(_row(cells))
    lines += by_role_table(rows, "cpu_cores_by_role", "CPU cores busy by process role (capture "
                           "includes rendering the synthetic frames):")
    lines += spares_lines(rows)
    lines += by_role_table(rows, "gpu_memory_mib_by_role", "GPU memory by process role, MiB "
                           "(NVML, each worker process's own, at the window's end):")
    lines += by_role_table(rows, "torch_memory_mib_by_role", "torch's share of it by process "
                           "role, MiB in live tensors / held by its allocator (CUDA graph pools "
                           "included) / peak in live tensors; NVML's minus the held is the CUDA "
                           "context, cuBLAS/cuDNN and the rings:", cell=_torch_memory_cell)
    if any(r.get("frame_hops") for r in rows):
        lines += ["", *hops_table(rows)]
    if small_faces:
        lines += ["", *small_faces_table(small_faces)]
    if any(r.get("newcomers") for r in rows):
        lines += ["", *newcomers_table(rows)]
    if any(r.get("profiles") for r in rows):
        lines += ["", *profiles_lines(rows)]
    for row in rows:
        if row.get("gpu_trace") and "error" not in row["gpu_trace"]:
            lines += ["", f"{row['cameras']} cameras, {row['transport']}:",
                      *gpu_trace.table_lines(row["gpu_trace"])]
    lines += ["", *legend({**accounting.DEFINITIONS, **BOOT_STOP_DEFINITIONS})]
    text = "\n".join(lines)
    print(text)
    return text


def spares_lines(rows: list[dict]) -> list[str]:
    """Each warm spare's cores while it waits (issue 24: under 0.02 each), and the threads
    that spent them."""
    lines = []
    for r in rows:
        spares = r.get("spare_cores") or {}
        if spares.get("per_spare"):
            each = ", ".join(f"{name} {cores:.3f}" for name, cores in spares["per_spare"].items())
            threads = ", ".join(f"{name} {cores:.3f}" for name, cores
                                in list(spares["by_thread"].items())[:4]) or "none"
            lines.append(f"- {r['cameras']} cameras, {r['transport']}: {each}; by thread, all "
                         f"spares together: {threads}")
    return (["", "Warm spares while they wait, cores each over the window (by /proc, every "
             "thread of the process):", "", *lines] if lines else [])


def legend(definitions: dict[str, str]) -> list[str]:
    return ["Definitions (the same for facecast and MediaPipe; JSON: \"definitions\"):", ""] + [
        f"- {name}: {text}" for name, text in definitions.items()]


def _torch_memory_cell(figures: dict[str, float]) -> str:
    return " / ".join(f"{figures[figure]:.0f}" for figure in TORCH_MEMORY_FIGURES)


def by_role_table(rows: list[dict], key: str, title: str, cell=lambda value: value) -> list[str]:
    """A row per run of its `key` figures (a dict by process role), a column per role, each
    role's value written by `cell`."""
    roles = sorted({role for r in rows for role in r.get(key, {})})
    if not roles:
        return []
    lines = ["", title, "", _row(["cameras", "transport", *roles]),
             "|" + "---|" * (2 + len(roles))]
    for r in rows:
        by_role = r.get(key, {})
        if by_role:
            lines.append(_row([r["cameras"], r["transport"],
                               *(cell(by_role[role]) if role in by_role else "-"
                                 for role in roles)]))
    return lines


def hops_table(rows: list[dict]) -> list[str]:
    """Where a frame's latency goes (Note [Latency accounted]): mean and p99 of each hop, over
    the output worker's last frames of every camera; the means add up to the total's."""
    names = [name for name in next(r["frame_hops"] for r in rows if r.get("frame_hops"))]
    lines = ["Where a frame's latency goes, capture to LSL push, ms mean (p99), the same frames "
             "in every hop (the means add up to the total):", "",
             _row(["cameras", "transport", *(name.split(": ", 1)[1] for name in names)]),
             "|" + "---|" * (2 + len(names))]
    for r in rows:
        hops = r.get("frame_hops")
        if hops:
            lines.append(_row([r["cameras"], r["transport"], *(
                f"{hops[name]['mean_ms']:.1f} ({hops[name]['p99_ms']:.1f})" if name in hops
                else "-" for name in names)]))
    return lines


def profiles_lines(rows: list[dict]) -> list[str]:
    """Profiles.summary of each profiled worker: its functions most on CPU."""
    lines = ["Where a worker's CPU goes (py-spy through the window, % of its samples on CPU; own "
             "time, then with callees):"]
    for r in rows:
        for worker, found in (r.get("profiles") or {}).items():
            if worker == "error" or "error" in found:
                lines += ["", f"- {r['cameras']} cameras, {worker}: "
                              f"{found if worker == 'error' else found['error']}"]
                continue
            lines += ["", f"- {r['cameras']} cameras, {worker} ({found['samples']} samples):",
                      *(f"  - own {pct}%: {frame}" for frame, pct in found["own_pct"][:8]),
                      *(f"  - with callees {pct}%: {frame}"
                        for frame, pct in found["inclusive_pct"][:8])]
    return lines


def newcomers_table(rows: list[dict]) -> list[str]:
    """How late a person who walks in is published (Note [A newcomer's delay])."""
    lines = [f"Faces that appear: from the first frame showing {NEWCOMER} to the first "
             f"published frame with their face, at an inlet (goal: within "
             f"{accounting.NEWCOMER_GOAL_MS:g} ms):", "",
             _row(["cameras", "transport", "appearances", "missed", "delay p50 / p90 / max ms",
                   "frames late p50 / max", f"within {accounting.NEWCOMER_GOAL_MS:g} ms"]),
             "|" + "---|" * 7]
    for r in rows:
        n = r.get("newcomers")
        if n:
            lines.append(_row([r["cameras"], r["transport"], n["appearances"], n["missed"],
                               f"{n['delay_p50_ms']} / {n['delay_p90_ms']} / {n['delay_max_ms']}",
                               f"{n['frames_late_p50']} / {n['frames_late_max']}",
                               f"{n['within_goal_pct']}%"]))
    return lines


def small_faces_table(small_faces: dict) -> list[str]:
    lines = [f"Faces found, 1920x1080, two faces of {small_faces['face_px']} px "
             f"(box IoU >= {accounting.MIN_IOU} with the true face):", "",
             "| face width | true (fc / mp) | facecast found | MediaPipe found |",
             "|---|---|---|---|"]
    fc, mp = small_faces["facecast"]["faces"], small_faces["mediapipe"]
    if "error" in mp:
        return lines + [f"| MediaPipe failed: {mp['error'][:160]} | | | |"]
    mp = mp["faces"]
    for _, _, label in accounting.SIZE_BINS_PX:
        if label in fc["true"] or label in mp["true"]:
            lines.append(f"| {label} | {fc['true'].get(label, 0)} / {mp['true'].get(label, 0)} | "
                         f"{fc['found'].get(label, 0)} ({fc['found_pct_by_width'].get(label)}%) | "
                         f"{mp['found'].get(label, 0)} ({mp['found_pct_by_width'].get(label)}%) |")
    return lines


def machine() -> dict:
    info = {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        info["gpu"] = name.decode() if isinstance(name, bytes) else name
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no GPU: say so
        info["gpu"] = f"none ({exc})"
    return info


def plot(json_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(json_path.read_text())
    if data.get("definitions_version") != DEFINITIONS_VERSION:
        raise SystemExit(f"{json_path} was written with other definitions (definitions_version "
                         f"{data.get('definitions_version')}, this bench writes "
                         f"{DEFINITIONS_VERSION})")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for transport in sorted({r["transport"] for r in data["rows"]}):
        rows = [r for r in data["rows"] if r["transport"] == transport and "error" not in r]
        cams = [r["cameras"] for r in rows]
        left.plot(cams, [r["latency_p99_ms"] for r in rows], "o-", label=f"{transport} p99")
        left.plot(cams, [r["latency_p50_ms"] for r in rows], "o--", label=f"{transport} p50")
        right.plot(cams, [r["dropped_pct"] for r in rows], "o-", label=transport)
    baseline = {r["cameras"]: r["mediapipe"] for r in data["rows"]
                if r.get("mediapipe") and "error" not in r["mediapipe"]}
    if baseline:  # --mediapipe-baseline: the same cameras through MediaPipe on the CPU
        cams = sorted(baseline)
        left.plot(cams, [baseline[c]["latency_p99_ms"] for c in cams], "s:", color="gray",
                  label="MediaPipe CPU p99")
        right.plot(cams, [baseline[c]["dropped_pct"] for c in cams], "s:", color="gray",
                   label="MediaPipe CPU")
    left.set(xlabel="1080p30 cameras", ylabel="capture → result latency (ms)", xscale="log",
             yscale="log")
    right.set(xlabel="1080p30 cameras", ylabel="dropped: (due − published) / due (%)",
              xscale="log")
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
        axis.legend()
    m = data["machine"]
    fig.suptitle(f"facecast daemon, synthetic 1080p30 cameras, 2 faces each — {m.get('gpu')}, "
                 f"driver {m.get('driver', '-')}, {m['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


# The meaning of the JSON's columns: 3 = bench/accounting.py's, frames counted by when they
# were due (Note [Due, not stamped]; 2: by their capture timestamps, `git show 540cc19:bench/
# accounting.py`; 1: dropped = captured − published clamped at 0, faces per frame sampled from
# status, `git show 1cc25b8:bench/pipeline.py`).
DEFINITIONS_VERSION = 3


def use_loopback_lsl() -> None:
    """Keep this bench's LSL streams on this machine and out of any other LSL session: the bench
    and the daemon it starts (which inherits $LSLAPICFG) resolve each other through 127.0.0.1
    only, as tests/conftest.py arranges for the tests. Call before anything loads pylsl; a
    $LSLAPICFG already set wins."""
    if "LSLAPICFG" in os.environ:
        return
    config_dir = Path(tempfile.mkdtemp(prefix="facecast-bench-lsl-"))
    atexit.register(shutil.rmtree, config_dir, ignore_errors=True)
    path = config_dir / "lsl_api.cfg"
    # PortRange: resolving through KnownPeers asks each port of the range, and liblsl gives an
    # outlet a port of it while there is one (32 by default), else a random one nobody asks. At
    # 32 cameras (64 Face streams) the H200 run of 2026-11-23 resolved exactly 32 of them.
    path.write_text("[ports]\nIPv6 = disable\nPortRange = 1024\n[multicast]\n"
                    "ResolveScope = machine\n[lab]\nKnownPeers = {127.0.0.1}\n"
                    f"SessionID = facecast-bench-{uuid.uuid4().hex}\n")
    os.environ["LSLAPICFG"] = str(path)


def camera_counts(values: list[str]) -> list[int]:
    """`--cameras 1 4 8` or `--cameras 32,64`: positive camera counts."""
    counts = []
    for value in values:
        for part in filter(None, value.split(",")):
            try:
                count = int(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"--cameras: {part!r} is not a whole number") from None
            if count < 1:
                raise argparse.ArgumentTypeError(f"--cameras: {count} is not a positive count")
            counts.append(count)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cameras", nargs="+", default=["1", "4", "8", "16", "32"],
                        help="camera counts, space- or comma-separated (1 4 8, or 32,64)")
    parser.add_argument("--transports", nargs="+", default=["cuda_ipc", "shm"])
    parser.add_argument("--source", choices=SYNTHETIC_SOURCES, default="synthetic",
                        help="the cameras' source (and the MediaPipe baseline's): rendered live "
                             "(costs a core per 1080p30 camera), a loop rendered once "
                             "(Note [Synthetic replay]), or that loop "
                             "encoded once and decoded every frame where --decode says (Note "
                             "[Encoded synthetic loop])")
    parser.add_argument("--genlocked", action="store_true",
                        help="every replayed camera (and the baseline's) at phase 0: all capture "
                             "at one instant, as hardware-triggered cameras do; default: each at "
                             "a phase of its own, as free-running cameras (Note [Capture phases])")
    parser.add_argument("--roi-workers", type=lambda text: text if text == "auto" else int(text),
                        default="auto", help="daemon.roi_landmark_workers (default: auto)")
    parser.add_argument("--cameras-per-capture-worker",
                        type=lambda text: text if text == "auto" else int(text), default="auto",
                        help="daemon.cameras_per_capture_worker (default: auto, Note [Capture "
                        "groups])")
    parser.add_argument("--decode", choices=("auto", "gpu", "cpu"), default="auto",
                        help="daemon.decode: where synthetic-h264/-mjpeg cameras' video is decoded "
                             "(gpu: NVDEC for H.264, nvJPEG for MJPEG; the camera's reason in "
                             "status where it cannot)")
    parser.add_argument("--detection-share", type=float, default=None,
                        help="daemon.detection_share (default: the config's auto)")
    parser.add_argument("--newcomers", action="store_true",
                        help="stage every camera's scene so that a person walks in once a cycle "
                             "while another stays, and report how late each arrival was "
                             "published (Note [A newcomer's delay]; synthetic sources only)")
    parser.add_argument("--profile-roles", nargs="*", default=[], metavar="ROLE",
                        help="py-spy one worker of each of these roles (e.g. capture "
                             "roi_landmark detection) through the window; the top functions go "
                             "into the JSON and the table (needs py-spy)")
    parser.add_argument("--gpu-trace-s", type=float, default=0.0, metavar="S",
                        help="every worker with CUDA records S seconds of its GPU activity "
                             "(torch.profiler's CUDA activity, CUPTI) inside the window; the "
                             "JSON and the table get the GPU's time by process (Note [Where the "
                             "GPU's time goes], bench/gpu_trace.py); the warm-up is then at least "
                             f"{GpuTraces.PREPARE_S:g} s, while the workers prepare their profilers")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="models.cuda_graphs = false (eager kernels)")
    parser.add_argument("--half", action="store_true", help="models.half = true (float16)")
    parser.add_argument("--warmup-s", type=float, default=15.0,
                        help="after every warm spare has booted (at most --spares-timeout-s)")
    parser.add_argument("--spares-timeout-s", type=float, default=180.0)
    parser.add_argument("--measure-s", type=float, default=20.0,
                        help=f"the window, rounded to whole frames; at least "
                             f"{OUTPUT_LATENCY_FRAMES / FPS:.1f} s for the output worker's "
                             f"latency ({OUTPUT_LATENCY_FRAMES} frames) to lie inside it")
    parser.add_argument("--drain-s", type=float, default=10.0,
                        help="after the window, how long to wait for frames captured in it")
    parser.add_argument("--boot-timeout-s", type=float, default=240.0)
    parser.add_argument("--stop-timeout-s", type=float, default=60.0,
                        help="after SIGTERM, how long before the bench SIGKILLs the supervisor")
    parser.add_argument("--boot-stop-only", action="store_true",
                        help="only boot to READY=1, hold --hold-s, stop: boot and stop figures")
    parser.add_argument("--hold-s", type=float, default=5.0, help="with --boot-stop-only")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-pipeline.json",
                        help="JSON results")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "facecast-bench",
                        help="each run's daemon log")
    parser.add_argument("--append", action="store_true",
                        help="add this run's rows to the JSON at --out (same definitions and mode)")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="only plot the JSON given by --out into this PNG")
    baseline = parser.add_argument_group("MediaPipe CPU baseline (bench/mediapipe_baseline.py)")
    baseline.add_argument("--mediapipe-baseline", action="store_true",
                          help="also run MediaPipe's face mesh, one CPU process per camera, at every "
                               "camera count, and a small-face scene once")
    baseline.add_argument("--mediapipe-python", default=sys.executable,
                          help="the Python of the baseline's processes (default: this one)")
    baseline.add_argument("--mediapipe-path", nargs="+", default=[], metavar="DIR",
                          help="put before $PYTHONPATH for the baseline's processes (where mediapipe "
                               "0.10.21 and protobuf 4.25 are installed)")
    baseline.add_argument("--baseline-warmup-s", type=float, default=3.0)
    baseline.add_argument("--baseline-measure-s", type=float, default=10.0)
    baseline.add_argument("--small-face-px", type=float, nargs=2, default=[100.0, 250.0])
    baseline.add_argument("--small-face-s", type=float, default=3.0,
                          help="seconds of frames of the small-face scene (30 per second); 0: "
                               "do not run it")
    args = parser.parse_args()
    # SIGTERM (a killed benchmark, gpu_check's machine given back) must stop the daemon under
    # test, not leave it running on the GPU beside the next measurement (seen 2026-11-26: a
    # 64-camera daemon outlived its killed bench and ran beside the next run): raise SystemExit,
    # so that every `finally` stops its daemon.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        args.cameras = camera_counts(args.cameras)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.genlocked and args.source == "synthetic":
        parser.error("--genlocked: the live synthetic source has no phase (it renders when "
                     "it captures); use a replayed source (synthetic-replay, -h264, -mjpeg)")
    if args.gpu_trace_s > 0 and args.measure_s < GpuTraces.INTO_WINDOW_S + args.gpu_trace_s + 1:
        parser.error(f"--gpu-trace-s {args.gpu_trace_s}: the traces start "
                     f"{GpuTraces.INTO_WINDOW_S} s into the window and must end a second before "
                     f"it: --measure-s {GpuTraces.INTO_WINDOW_S + args.gpu_trace_s + 1:g} or more")
    if args.newcomers and args.mediapipe_baseline:
        parser.error("--newcomers stages facecast's cameras only: run the baseline without it")
    if args.boot_stop_only and args.mediapipe_baseline:
        parser.error("--boot-stop-only measures the daemon's boot and stop: no baseline with it")
    if args.plot:
        plot(args.out, args.plot)
        return 0
    use_loopback_lsl()
    mode = "boot_stop_only" if args.boot_stop_only else "full"
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    results = {"machine": machine(), "roi_workers": args.roi_workers,
               "definitions_version": DEFINITIONS_VERSION,
               "definitions": ({} if args.boot_stop_only else accounting.DEFINITIONS)
               | BOOT_STOP_DEFINITIONS,
               "mode": mode, "commands": [command],
               "baseline": "MediaPipe CPU face landmarker: not measured (run with --mediapipe-baseline)",
               "rows": []}
    if args.append and args.out.exists():
        # One sweep split over several invocations (each under a machine's time limit per
        # command): only results counted the same way may share a file.
        previous = json.loads(args.out.read_text())
        held = (previous.get("definitions_version"), previous.get("mode"))
        if held != (DEFINITIONS_VERSION, mode):
            parser.error(f"--append: {args.out} holds {held[1]} results of definitions version "
                         f"{held[0]}; this run writes {mode} results of version "
                         f"{DEFINITIONS_VERSION}")
        results["commands"] = previous["commands"] + [command]
        results["rows"] = previous["rows"]
        results["baseline"] = previous["baseline"]
    rows: list[dict] = results["rows"]
    if args.mediapipe_baseline:
        import mediapipe_baseline  # bench/ is this script's folder, first on sys.path

        if not isinstance(results["baseline"], dict):
            results["baseline"] = {
                "description": mediapipe_baseline.DESCRIPTION, "python": args.mediapipe_python,
                "path": args.mediapipe_path, "warmup_s": args.baseline_warmup_s,
                "measure_s": args.baseline_measure_s,
                "rows": []}  # in full, per camera too; the daemon rows get summaries

        def run_baseline(cameras: int, face_px=None, measure_s=args.baseline_measure_s) -> dict:
            return mediapipe_baseline.run(
                cameras, face_px=face_px, source="synthetic" if face_px else args.source,
                warmup_s=args.baseline_warmup_s, measure_s=measure_s,
                boot_timeout_s=args.boot_timeout_s, log_dir=args.log_dir,
                python=args.mediapipe_python, pythonpath=args.mediapipe_path,
                genlocked=args.genlocked and not face_px)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    for cameras in args.cameras:
        done = []
        for transport in args.transports:
            print(f"running {cameras} camera(s) over {transport} ...", file=sys.stderr, flush=True)
            done.append(run_one(cameras, transport, args))
            rows.append(done[-1])
            args.out.write_text(json.dumps(results, indent=1))
        if args.mediapipe_baseline:
            print(f"running the MediaPipe baseline with {cameras} camera(s) ...", file=sys.stderr,
                  flush=True)
            base = run_baseline(cameras)
            results["baseline"]["rows"].append(base)
            for row in done:
                row["mediapipe"] = {k: v for k, v in base.items() if k != "per_camera"}
                row["vs_mediapipe"] = versus(row, base)
            args.out.write_text(json.dumps(results, indent=1))
    if args.mediapipe_baseline and args.small_face_s > 0:
        print("running the small-face scene ...", file=sys.stderr, flush=True)
        small_faces = {"face_px": args.small_face_px,
                       "mediapipe": run_baseline(1, args.small_face_px, args.small_face_s),
                       "facecast": facecast_small_faces(args.small_face_px, args.small_face_s)}
        small_faces["mediapipe"].pop("per_camera", None)
        results["baseline"]["small_faces"] = small_faces
        args.out.write_text(json.dumps(results, indent=1))
    baseline_results = results["baseline"]
    small_faces = baseline_results.get("small_faces") if isinstance(baseline_results, dict) else None
    print_table(rows, small_faces, boot_stop_only=args.boot_stop_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
