"""A real `facecast run` for the end-to-end tests: the daemon as a subprocess, a real
NOTIFY_SOCKET datagram socket, the control socket, and real pylsl inlets recording its streams.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pylsl

from facecast.daemon.cli.control_client import request
from facecast.shared.transport import shm
from facecast.shared.transport.messages import StatusRequest

REPO = Path(__file__).resolve().parent.parent

# Note [A test's own shared memory]
#     Other daemons and other test runs use /dev/shm at the same time as a test (CI runs test
#     files in parallel; a developer's daemon may be up), so a test that diffs the whole of
#     /dev/shm, or every facecast-* segment, fails for what it does not own. A daemon's own
#     entries are named after the processes that made them: facecast-<pid>-<epoch>-<camera>-<part>
#     (shared/transport/shm.py) and the CUDA driver's cuda.shm.<n>.<pid in hex>.<n>. Its processes
# are the
#     supervisor and every worker it ever started: the supervisor logs each start ("started
#     <name> (pid <pid>)", daemon/process.py, at the default log level "info"), and `status`
#     reports the live ones; `Daemon.own_pids()` is the union of both, and refuses to answer when
#     a worker that status reported is missing from the log (the log's wording changed: the check
#     would otherwise silently look at too few processes). A leak check then compares only those
#     entries, and still fails when its own daemon leaks one.
_STARTED_LINE = re.compile(r"\bstarted (?P<name>\S+) \(pid (?P<pid>\d+)\)")
_CUDA_IPC_FILE = re.compile(r"cuda\.shm\.\d+\.(?P<pid>[0-9a-f]+)\.\d+")


def shm_entries_of(pids: set[int]) -> list[str]:
    """Names in /dev/shm made by these processes: facecast segments and CUDA IPC files."""
    names = []
    for path in shm.SHM_DIR.iterdir():
        name = path.name
        if name.startswith(shm.PREFIX):
            owner = name[len(shm.PREFIX):].split("-", 1)[0]
            if owner.isdigit() and int(owner) in pids:
                names.append(name)
        elif (match := _CUDA_IPC_FILE.fullmatch(name)) and int(match["pid"], 16) in pids:
            names.append(name)
    return sorted(names)


WAIT_S = 20.0  # for a signal's effect on a process: at once, unless the machine is very busy


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command's name (its state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (R, S, T for stopped, Z...), "" once it is gone."""
    try:
        return _stat_fields(pid)[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_state(pid: int, wanted: set[str]) -> str:
    """`pid`'s state once it is one of `wanted`, or whatever it is after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    state = process_state(pid)
    while state not in wanted and time.monotonic() < deadline:
        time.sleep(0.01)
        state = process_state(pid)
    return state


class NotifyListener:
    """systemd's side of sd_notify: a bound AF_UNIX datagram socket, every message kept."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.messages: list[tuple[float, str]] = []  # (monotonic time, datagram text)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def assignments(self) -> list[str]:
        """Every KEY=VALUE line, in arrival order."""
        return [line for _, text in self.messages for line in text.splitlines()]

    def wait_for(self, line: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if line in self.assignments():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


@dataclass
class StreamRecord:
    name: str
    source_id: str
    inlet: pylsl.StreamInlet
    timestamps: list[float] = field(default_factory=list)
    samples: list[np.ndarray] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # local_clock() when pulled


class Recorder:
    """Pulls every sample of the given inlets from a thread, with the arrival time."""

    def __init__(self, records: list[StreamRecord]) -> None:
        self.records = records
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for record in self.records:
                chunk, stamps = record.inlet.pull_chunk(timeout=0.0)
                if stamps:
                    now = pylsl.local_clock()
                    record.timestamps.extend(stamps)
                    record.samples.extend(np.asarray(s) if not isinstance(s, str) else s
                                          for s in chunk)
                    record.arrivals.extend([now] * len(stamps))
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# --- face boxes against a synthetic camera's ground truth ----------------------------------------

BOX_TOLERANCE = 0.10  # of the true face's size


def frames_of(slots: list[StreamRecord]) -> tuple[dict[float, list[np.ndarray]], np.ndarray]:
    """One camera's Face streams (one per face slot) as frames: every sample by its capture
    timestamp, and the sorted timestamps of the span over which every slot's inlet recorded."""
    frames: dict[float, list[np.ndarray]] = {}
    for record in slots:
        for stamp, sample in zip(record.timestamps, record.samples):
            frames.setdefault(stamp, []).append(sample)
    first = max(record.timestamps[0] for record in slots)
    last = min(record.timestamps[-1] for record in slots)
    return frames, np.asarray(sorted(stamp for stamp in frames if first <= stamp <= last))


@dataclass
class TruthScore:
    frames: int
    good: int  # as many boxes as true faces, and every true face has a box close to it
    wrong_count: int  # frames with more or fewer boxes than true faces
    misplaced: list  # the first five frames where a true face has no box close to it

    def describe(self) -> str:
        return (f"{self.good} of {self.frames} frames right; {self.wrong_count} with a wrong "
                f"number of faces; first misplaced: {self.misplaced}")


def score_against_truth(frames: dict[float, list[np.ndarray]], stamps: np.ndarray,
                        faces_at: Callable[[float], list], tolerance: float = BOX_TOLERANCE,
                        ) -> TruthScore:
    """Face-stream samples (box_x1..box_y2 in channels 2..5; NaN: the slot has no face) of
    the frames at `stamps` against `faces_at(capture_ts_lsl)`, a synthetic camera's ground truth
    (facecast.workers.capture.sources.synthetic_truth)."""
    good, wrong_count, misplaced = 0, 0, []
    for stamp in stamps:
        truth = faces_at(stamp)
        boxes = [s[2:6] for s in frames[stamp] if not math.isnan(s[2])]
        close = all(box_close(face.box_px, boxes, tolerance) for face in truth)
        good += len(boxes) == len(truth) and close
        wrong_count += len(boxes) != len(truth)
        if not close and len(misplaced) < 5:
            misplaced.append((stamp, [face.box_px for face in truth], boxes))
    return TruthScore(len(stamps), good, wrong_count, misplaced)


# A detection frame's box is the detector's own (models/face_mesh.py), whose width on the
# synthetic scenes' faces varies about the truth's: facecast's detector over the 640x360 scenes of
# eight cameras, 160 faces, 0.96-1.09 of the true width (5th-95th percentile), up to 1.14, its
# centre within 0.074 of the width (2026-11-28). A frame of another time or camera, or a torn
# one, moves the centre.
DETECTOR_SIZE_TOLERANCE = 0.20


def box_close(truth_box, boxes, tolerance: float = BOX_TOLERANCE,
              size_tolerance: float | None = None) -> bool:
    """Whether one of `boxes` has the true box's centre within `tolerance` of its size, and its
    size within `size_tolerance` (default: `tolerance`)."""
    tx1, ty1, tx2, ty2 = truth_box
    size = tx2 - tx1
    size_tolerance = tolerance if size_tolerance is None else size_tolerance
    for x1, y1, x2, y2 in boxes:
        if (abs((x1 + x2) / 2 - (tx1 + tx2) / 2) <= tolerance * size
                and abs((y1 + y2) / 2 - (ty1 + ty2) / 2) <= tolerance * size
                and abs((x2 - x1) - size) <= size_tolerance * size):
            return True
    return False


SPARE_TEST_FPS = 3  # Note [Spares only where a test needs them]


def default_config_at(fps: int) -> str:
    """config/default.toml with its cameras at `fps` frames per second."""
    text = (REPO / "config/default.toml").read_text()
    assert text.count("fps = 15\n") == text.count("[[cameras]]") > 0, "default.toml's cameras"
    return text.replace("fps = 15\n", f"fps = {fps}\n")


class Daemon:
    """`facecast run` with its own runtime directory, host name and notify socket."""

    def __init__(self, tmp: Path, config_text: str | None = None, watchdog_usec: int = 1_000_000,
                 env: dict[str, str] | None = None):
        self.tmp = tmp
        self.host = f"e2e{uuid.uuid4().hex[:8]}"
        self._records: list[StreamRecord] = []  # the inlets `resolve` opened
        self.runtime_dir = tmp / "run"
        self.config_path = tmp / "facecast.toml"
        text = config_text if config_text is not None else (REPO / "config/default.toml").read_text()
        # Many daemons run at once (CI, other test files): each web console on a free port of its
        # own (its web-console.json in the runtime dir says which); a [web] table must then
        # leave `port` to this.
        self.config_path.write_text(text.replace(
            "[daemon]\n", f'[daemon]\nhost_name = "{self.host}"\nruntime_dir = "{self.runtime_dir}"\n'
        ).replace("[web]\n", "[web]\nport = 0\n"))
        self.notify = NotifyListener(tmp / "notify.sock")
        self.log_path = tmp / "daemon.log"
        environment = dict(os.environ, NOTIFY_SOCKET=self.notify.path,
                           WATCHDOG_USEC=str(watchdog_usec), **(env or {}))
        environment.pop("WATCHDOG_PID", None)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "facecast.daemon.cli", "run", "--config", str(self.config_path)],
            env=environment, stdout=self._log, stderr=subprocess.STDOUT, cwd=tmp,
        )
        # Every worker pid that status reported (Note [A test's own shared memory]).
        self.status_pids: set[int] = set()

    def status(self, timeout_s: float = 5.0):
        status = request(self.runtime_dir, StatusRequest(), timeout_s)
        self.status_pids.update(w.pid for w in status.workers if w.pid)
        self.status_pids.add(status.pid)
        return status

    def own_pids(self) -> set[int]:
        """The supervisor and every worker it started (Note [A test's own shared memory])."""
        if not self._log.closed:
            self._log.flush()
        logged = {int(m["pid"]) for m in _STARTED_LINE.finditer(self.log_path.read_text())}
        missing = self.status_pids - logged - {self.process.pid}
        if missing:
            raise AssertionError(
                f"workers {sorted(missing)} reported by status have no 'started <name> (pid "
                f"<pid>)' line in {self.log_path}: a log level above info, or the line's wording "
                "changed (daemon/process.py); the shared-memory check cannot know this daemon's "
                "processes")
        return {self.process.pid} | logged | self.status_pids

    def own_shm(self) -> list[str]:
        """This daemon's entries in /dev/shm, whoever else uses it (Note [A test's own shared
        memory])."""
        return shm_entries_of(self.own_pids())

    def worker(self, name: str):
        return next(w for w in self.status().workers if w.name == name)

    def wait_for_worker(self, name: str, state: str, timeout_s: float = 60.0, not_pid: int = 0):
        """The worker `name` once it is in `state` with a process (other than `not_pid`: the
        one just killed); its WorkerStatus."""
        deadline = time.monotonic() + timeout_s
        while True:
            worker = self.worker(name)
            if worker.state == state and worker.pid not in (0, not_pid):
                return worker
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not {state} within {timeout_s} s: {worker}\n"
                                     f"{self.log_tail()}")
            time.sleep(0.1)

    # Note [Spares only where a test needs them]
    #     A daemon's warm spares (Note [Warm standby]) boot after READY at nice +10 (Note [Spares
    #     at a lower priority]), beside the daemon's own pipeline, which takes about a core on
    #     the CPU. On an idle 2-core machine they are booted 4-5 s after READY; with one busy
    #     process beside the tests (CI), 40 s (measured, config/default.toml), and every test
    #     daemon waits for them (`ready_daemon`: the steady state). So a test daemon has spares
    #     only where its tests are about them: a killed worker replaced by its spare, the 2 s
    #     restart promise, the spares' priority, track ids across a takeover (tests/
    #     test_daemon_e2e.py, test_warm_standby.py, test_spare_priority.py,
    #     test_track_ids_daemon.py, the soak). The others say `warm_standby = "off"`: what they
    #     check (streams, the console, recordings, models, sources) does not depend on a spare
    #     waiting, and a worker they kill restarts cold, which is slower, not easier. Their
    #     daemon is ready sooner, before its pipeline has found the faces: a test that scores
    #     every frame it records against the truth waits for that first (`wait_for_faces`), as
    #     the spares' boot used to make it wait. The tests of spares (but the end-to-end test
    #     of config/default.toml, test_daemon_e2e.py, with its 2 s restart promise) run that
    #     config's cameras at SPARE_TEST_FPS (`default_config_at`): the pipeline then takes
    #     half a core instead of one, and the spares boot 7.5 s after READY instead of 23 s
    #     beside one busy process (measured, at 5 fps); what they check (which process takes
    #     over, its priority, its track ids, that a fresh spare follows) does not depend on the
    #     rate. 3 fps since a camera that slow publishes faces at all (MAX_DETECTION_AGE_S in
    #     workers/inference/roi_landmark.py): those three files 45-47 s -> 43.3-43.7 s.
    def wait_for_spares(self, timeout_s: float = 90.0) -> None:
        """The warm spares start at READY (Note [Warm standby]); the daemon's steady state, with
        its 2 s restart promise, begins once each has booted (Note [Spares only where a test
        needs them])."""
        deadline = time.monotonic() + timeout_s
        while True:
            spares = [w for w in self.status().workers if w.standby]
            if all(w.state == "standby" for w in spares):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"spares not booted within {timeout_s} s: {spares}\n"
                                     f"{self.log_tail()}")
            time.sleep(0.1)

    def wait_for_faces(self, cameras, timeout_s: float = 90.0) -> None:
        """Until the output worker has published a face in the newest frame of each camera: the
        pipeline's warm-up (its first passes, the first detection) is over. A test that scores
        every frame it records against the truth resolves its streams after this, so that its
        recording starts in the steady state (Note [Spares only where a test needs them]).
        The output worker's report is the one with a latency (CameraReport.latency_ms); the
        detection worker's face count alone said faces where none was published yet (a camera
        at 3 fps never published one and passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            reports = self.status().cameras
            if all(any(report.faces > 0 and report.latency_ms is not None
                       for report in reports.get(camera, ()))
                   for camera in cameras):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"no face on every camera of {cameras} within {timeout_s} s:"
                                     f" {reports}\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def resolve(self, stream_type: str, count: int, timeout_s: float = 30.0) -> list[StreamRecord]:
        # Only this daemon's streams count towards `minimum` (other daemons of the same test
        # session may have streams of the type too).
        predicate = f"type='{stream_type}' and starts-with(source_id, 'facecast-{self.host}-')"
        deadline = time.monotonic() + timeout_s
        found: dict[str, pylsl.StreamInfo] = {}
        while time.monotonic() < deadline and len(found) < count:
            for info in pylsl.resolve_bypred(predicate, minimum=count, timeout=2.0):
                found[info.source_id()] = info
        records = []
        for source_id, info in sorted(found.items()):
            inlet = pylsl.StreamInlet(info, max_buflen=60, recover=True)
            inlet.open_stream(timeout=10)
            records.append(StreamRecord(info.name(), source_id, inlet))
        self._records.extend(records)
        return records

    def close_inlets(self) -> None:
        """An inlet with `recover` whose outlet is gone keeps resolving it in the background,
        for as long as it exists: left open, the inlets of a session's earlier daemons flooded
        the machine with queries, and later tests' streams were not found within 30 s."""
        for record in self._records:
            if record.inlet is not None:  # a test may have closed it already
                record.inlet.close_stream()
        self._records.clear()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def close(self) -> None:
        self.close_inlets()
        self.stop()
        self.notify.close()
        self._log.close()


@contextlib.contextmanager
def ready_daemon(tmp: Path, config_text: str | None = None, ready_timeout_s: float = 120.0,
                 **options) -> Iterator[Daemon]:
    """A `Daemon` (options as its) that has sent READY=1, closed on the way out; a daemon that
    does not get ready in time fails the test with its log."""
    daemon = Daemon(tmp, config_text=config_text, **options)
    try:
        assert daemon.notify.wait_for("READY=1", timeout_s=ready_timeout_s), daemon.log_tail()
        daemon.wait_for_spares()  # steady state (Note [Warm standby])
        yield daemon
    finally:
        daemon.close()
