"""Soak test with injected faults (issue 5, part 2; DESIGN §1, §2, §5): the real daemon, three
cameras, at least $FACECAST_SOAK_S seconds of faults, and what a lab user would see in a recording.

The daemon (`facecast run`, tests/daemon_harness.py) runs the two synthetic cameras of
config/default.toml and a third camera whose source is a real RTSP peer on loopback
(tests/rtsp_peer.py), with every frame checksummed (`checksum_every = 1`) and fault injection
allowed (Note [Fault injection]). Real pylsl inlets record every Face
stream and the Markers stream while the test injects, one at a time:

- sigkill: a random worker of any role, SIGKILLed once the cycle of the other faults below has
  run and then every 20-40 s (seeded: $FACECAST_SOAK_SEED,
  else a fresh seed, printed in the report), chosen among the workers up for RestartPolicy's
  stable uptime (30 s): a worker killed again sooner is a crash loop, restarted after a growing
  backoff on purpose, which is not what this run measures;
- source_outage: the RTSP peer killed for ~5 s and started again (camera_lost, camera_back);
- corrupt_frame: a camera's ring slot overwritten after it was committed (InjectFault), so that
  only the consumers' checksums can catch it;
- malformed: garbage, truncated msgpack, another protocol version and a wrong-typed message on
  every socket a stranger can reach (the supervisor's control socket, each camera's ring control,
  the detection requests, the results), plus bytes that are not ZMTP at all;
- bad_reload: the config file replaced by an invalid one and `facecast reload`, then restored.

Faults do not overlap: a kill is never closer than a few seconds to another fault, so every gap in
a stream belongs to one fault. The tests below share that one run (the `soak` fixture) and check
what it recorded; the last ones stop the daemon with SIGTERM and look for leftovers. Without
GStreamer's RTSP server there is no third camera and no source outage (that test skips with the
reason); the other faults still run.

The tables docs/reliability.md is made from are printed at the end of the session (and written
to $FACECAST_SOAK_REPORT when set).

Short form (CI, any machine): python -m pytest -q -m soak tests/soak  (~1.3 min; Note [The
short soak])
Long form (GPU machine): FACECAST_SOAK_S=600 FACECAST_SOAK_TRANSPORT=cuda_ipc, same command.
"""

from __future__ import annotations

import collections
import datetime
import gc
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pylsl
import pytest
import zmq

import rtsp_peer
from daemon_harness import Daemon, Recorder, StreamRecord, shm_entries_of
from facecast.daemon.cli.control_client import request
from facecast.daemon.process import RestartPolicy
from facecast.shared import config as config_mod
from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import (
    DescribeRing,
    DetectionWanted,
    FaceResults,
    InjectFault,
    StatusRequest,
)
from facecast.workers.capture.sources import SyntheticScene

# Note [The short soak]
#     The default run (CI's, part of README's test command) is as short as a run can be that
#     still injects every kind of fault: SOAK_S is a minimum, and the schedule goes on past it
#     until a SIGKILL and every item of CYCLE (an RTSP outage, a corrupted frame on each camera,
#     malformed messages, a broken reload) have each happened at least once, and one corrupted
#     frame was caught by a consumer's checksum (one more corruption at a time until one is: `owes_a_fault`);
#     ~33 s of faults here: the cycle's budgets add up to ~40 s (~28 s as measured), and the
#     first kill comes once the cycle has run (BEFORE_KILL_S after its last fault), the next
#     ones 20-40 s apart. (The first kill used to come 20-40 s in as well: drawn past the
#     cycle's end, the run idled until it, 9 s of a 40 s run measured; drawn before, its 5 s of
#     quiet fell inside the cycle. 40 s -> 33 s of faults beside a busy process.) The faults
#     begin at READY: the warm spares boot (at nice +10, 25-35 s beside a busy process) while
#     the cycle runs, and the first kill waits until every spare is booted, the steady state of
#     the 2 s promise. OVERTIME_S bounds the wait for what is owed;
#     a check then fails. Every check below runs on that recording as on a long one. The long
#     form (FACECAST_SOAK_S=600) repeats them all, kills every 20-40 s, and is where rarer
#     interleavings show up.
SOAK_S = float(os.environ.get("FACECAST_SOAK_S", "30"))
OVERTIME_S = 120.0  # past SOAK_S, the most the schedule waits for a fault still owed
TRANSPORT = os.environ.get("FACECAST_SOAK_TRANSPORT", "auto")
SEED = int(os.environ.get("FACECAST_SOAK_SEED") or random.SystemRandom().randrange(2**32))

pytestmark = [pytest.mark.soak, pytest.mark.daemon, pytest.mark.timeout(SOAK_S + 600)]

SYNTHETIC = ("synth0", "synth1")
RTSP = "rtsp0"
CAMERAS = (*SYNTHETIC, RTSP)
MAX_FACES = 2
CONSUMER_ROLES = ("detection", "roi_landmark")

RESUME_LIMIT_S = 2.0  # every Face stream resumes this soon after any fault but the outage
# ...except the streams of a network camera whose capture worker was killed: the RTSP session
# dies with the process, and setting it up again (DESCRIBE/SETUP/PLAY, then the first frame
# through FFmpeg's probing) takes ~2.3 s of the ~2.6 s measured here. Reported separately.
RECONNECT_LIMIT_S = 5.0
KILL_EVERY_S = (20.0, 40.0)
AFTER_KILL_S = 5.0  # quiet time after a kill, so that its gap is its own
BEFORE_KILL_S = 2.0  # a fault ends at least this long before the next kill
OUTAGE_S = 5.0
OUTAGE_RESUME_LIMIT_S = 30.0  # reopen backoff 0.5, 1, 2, 4 s: back ~7.5 s after the loss
CORRUPT_SETTLE_S = 2.0  # heartbeats (0.5 s) carry the consumers' verdicts to the status
MARKER_WAIT_S = 10.0
# A published box further than this (in face sizes) from every true face is a jump: garbage
# from a frame that should have been refused. The e2e test holds 95% of frames to 0.10.
JUMP_TOLERANCE = 0.5
GPU_MEMORY_TOLERANCE_MIB = 128.0
# Scheduling estimates (s) of the non-kill faults, and the order they cycle in.
BUDGET_S = {"source_outage": 16.0, "corrupt_frame": 4.0, "malformed": 5.0, "bad_reload": 6.0}
CYCLE = (("source_outage", RTSP), ("corrupt_frame", "synth0"), ("malformed", ""),
         ("corrupt_frame", "synth1"), ("bad_reload", ""), ("corrupt_frame", RTSP))


def soak_config(rtsp_url: str | None) -> str:
    synthetic = "".join(
        f'\n[[cameras]]\nid = "{camera}"\nsource = "synthetic"\nwidth = 640\nheight = 360\n'
        "fps = 15\n" for camera in SYNTHETIC)
    rtsp = (f'\n[[cameras]]\nid = "{RTSP}"\nsource = "{rtsp_url}"\nwidth = 320\nheight = 240\n'
            "fps = 15\n") if rtsp_url else ""
    return (
        "[daemon]\n"
        f'transport = "{TRANSPORT}"\n'
        "ring_slots = 8\n"
        "checksum_every = 1  # every frame checked: a corrupted slot must never pass\n"
        # Killed inference workers are replaced by booted spares, on the CPU too (Note [Warm
        # standby]); tests/test_daemon_e2e.py covers the cold restarts of the default config.
        'warm_standby = "on"\n'
        "\n[output]\nmax_faces = 2\n"
        + synthetic + rtsp
    )


# ================================================================================================
# What the run records
# ================================================================================================


@dataclass
class Fault:
    kind: str  # sigkill, source_outage, corrupt_frame, malformed, bad_reload
    target: str  # a worker, a camera, "" (every socket, the config file)
    at_lsl: float  # when it was injected (pylsl.local_clock)
    end_lsl: float = 0.0  # when a lasting fault ended (the RTSP peer is back), else 0
    detail: str = ""
    recovered: bool = False
    problems: list[str] = field(default_factory=list)  # what went wrong, checked by the tests
    resume_s: dict[str, float] = field(default_factory=dict)  # stream → fault to next sample


@dataclass
class Corruption:
    camera: str
    frame_seq: int = -1
    capture_ts_lsl: float = math.nan
    transport: str = ""
    caught: int | None = None  # checksum_mismatch verdicts it caused (None: not measurable)


@dataclass
class Malformed:
    socket: str
    worker: str  # whose count shows it ("" : the supervisor's)
    sent: int
    counted: int | None = None  # None: the worker restarted meanwhile
    raw_counted: int | None = None  # messages libzmq made of the raw bytes, refused


def _rejected_between(before, after, worker: str) -> int | None:
    """Malformed messages the supervisor ("") or a worker refused between two statuses."""
    if not worker:
        return after.rejected_messages - before.rejected_messages
    was = next(w for w in before.workers if w.name == worker)
    now = next(w for w in after.workers if w.name == worker)
    return now.rejected_messages - was.rejected_messages if now.pid == was.pid else None


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _gpu_memory() -> tuple[dict[int, float], dict[int, set[int]], str]:
    """(MiB used per GPU, pids holding memory per GPU, "" or why there is no answer)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no driver, no library: no GPU to check  # noqa: BLE001
        return {}, {}, f"NVML unavailable: {exc}"
    try:
        used, holders = {}, {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            used[index] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            holders[index] = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return used, holders, "" if used else "NVML sees no GPU"
    finally:
        pynvml.nvmlShutdown()


def marker_events(record: StreamRecord, since: int = 0) -> list[tuple[float, dict]]:
    return [(stamp, json.loads(sample[0] if not isinstance(sample, str) else sample))
            for stamp, sample in zip(record.timestamps[since:], record.samples[since:])]


def malformed_payloads(valid: messages.Message) -> list[bytes]:
    """What a confused or hostile peer sends: each must be refused, counted, and survived."""
    encoded = messages.encode(valid)
    fields = msgspec.to_builtins(valid)
    return [
        b"\xc1" + bytes(range(64)),  # 0xc1 is never msgpack
        encoded[: len(encoded) // 2],  # truncated
        msgspec.msgpack.encode({**fields, "v": messages.PROTOCOL_VERSION + 1}),  # another version
        msgspec.msgpack.encode({**fields, "id": 12345}),  # right version, wrong field type
    ]


def _raw_bytes(endpoint: str) -> None:
    """Not ZMTP at all (a port scanner, a confused HTTP client): libzmq must drop it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(2.0)
        try:
            raw.connect(str(endpoints.socket_path(endpoint)))
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 16)
        except OSError:
            pass  # refused or cut off: that is libzmq doing its job


# ================================================================================================
# The run
# ================================================================================================


class Soak:
    def __init__(self, tmp: Path, python: str | None) -> None:
        self.rng = random.Random(SEED)
        self.tmp = tmp
        self.faults: list[Fault] = []
        self.corruptions: list[Corruption] = []
        self.malformed: list[Malformed] = []
        self.unexplained_mismatches: collections.Counter = collections.Counter()
        self.our_pids: set[int] = set()
        # Without GStreamer's RTSP server there is no third camera and no source outage; every
        # other fault still runs (the GPU machine may lack it), and the outage test says why.
        self.peer = rtsp_peer.RtspPeer(python, width=320, height=240, fps=15) if python else None
        self.cameras = CAMERAS if python else SYNTHETIC
        self.cycle = [item for item in CYCLE if item[1] in ("", *self.cameras)]
        self.daemon: Daemon | None = None
        self.face_records: list[StreamRecord] = []
        self.marker_record: StreamRecord | None = None
        self._recorders: list[Recorder] = []
        self._mismatch_state: dict[str, tuple[frozenset, int] | None] = {}
        self.started_lsl = 0.0
        self.run_s = math.nan  # how long the faults went on (Note [The short soak])
        self.sigterm_returncode: int | None = None

    # -- setup and teardown --------------------------------------------------------------------

    def start(self) -> None:
        if self.peer is not None:
            self.peer.start()
        self.daemon = Daemon(self.tmp, config_text=soak_config(self.peer and self.peer.url),
                             env={"FACECAST_ALLOW_FAULT_INJECTION": "1"})
        assert self.daemon.notify.wait_for("READY=1", timeout_s=180), self.daemon.log_tail()
        # The warm spares boot while the first faults run; the first kill waits for them.
        self.supervisor_pid = self.daemon.status().pid
        self.our_pids.add(self.supervisor_pid)
        self.face_records = self.daemon.resolve("Face", count=len(self.cameras) * MAX_FACES)
        assert len(self.face_records) == len(self.cameras) * MAX_FACES, self.face_records
        markers = self.daemon.resolve("Markers", count=1)
        assert markers, "no Markers stream"
        self.marker_record = markers[0]
        self._recorders = [Recorder(self.face_records), Recorder([self.marker_record])]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(r.timestamps for r in self.face_records):
            time.sleep(0.2)
        assert all(r.timestamps for r in self.face_records), [
            (r.name, len(r.timestamps)) for r in self.face_records]
        self.settle(3.0)

    def close(self) -> None:
        """Everything this process opened: recorders, inlets, the daemon, the peer."""
        for recorder in self._recorders:
            recorder.stop()
        self._recorders = []
        for record in [*self.face_records, *([self.marker_record] if self.marker_record else [])]:
            if record.inlet is not None:
                record.inlet.close_stream()
                record.inlet = None
        if self.daemon is not None:
            self.daemon.close()
        if self.peer is not None:
            self.peer.kill()
        gc.collect()

    # -- observing -----------------------------------------------------------------------------

    def status(self):
        status = self.daemon.status()
        self.our_pids.update(w.pid for w in status.workers if w.pid)
        return status

    def observe(self, corruption: Corruption | None = None):
        """A status snapshot; checksum_mismatch verdicts since the last one go to `corruption`
        when they are of its camera, else they are unexplained (a frame refused for nothing, or
        a corruption counted twice). Only comparable while the same consumers run."""
        status = self.status()
        consumers = [w for w in status.workers if w.role in CONSUMER_ROLES and not w.standby]
        pids = frozenset(w.pid for w in consumers)
        comparable = all(w.state == "running" for w in consumers)
        for camera in self.cameras:
            total = sum(r.checksum_mismatches for r in status.cameras.get(camera, []))
            previous = self._mismatch_state.get(camera)
            if comparable and previous is not None and previous[0] == pids:
                delta = total - previous[1]
                if corruption is not None and corruption.camera == camera:
                    corruption.caught = delta
                else:
                    self.unexplained_mismatches[camera] += delta
            self._mismatch_state[camera] = (pids, total) if comparable else None
        return status

    def settle(self, duration_s: float) -> None:
        deadline = time.monotonic() + duration_s
        while (left_s := deadline - time.monotonic()) > 0:
            self.observe()
            time.sleep(min(1.0, max(0.0, left_s)))

    def wait_marker(self, predicate, since: int, timeout_s: float = MARKER_WAIT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for stamp, event in marker_events(self.marker_record, since):
                if predicate(event):
                    return stamp, event
            time.sleep(0.1)
        return None

    def wait_for_sample(self, camera: str, after_lsl: float, timeout_s: float) -> bool:
        records = [r for r in self.face_records if f"-{camera}-face" in r.source_id]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(r.timestamps and r.timestamps[-1] > after_lsl for r in records):
                return True
            time.sleep(0.05)
        return False

    # -- the schedule ---------------------------------------------------------------------------

    def run(self) -> None:
        """Faults until SOAK_S seconds are over and each kind has happened: a kill and every item
        of the cycle at least once (Note [The short soak])."""
        self.started_lsl = pylsl.local_clock()
        start = time.monotonic()
        end = start + SOAK_S
        next_kill = start + self.rng.uniform(*KILL_EVERY_S)  # set below; drawn as before, so
        # that a seed's later draws stay what they were
        queue = collections.deque(self.cycle)
        untried = set(self.cycle)  # the queue rotates: untried items stay at its front
        killed = False
        fault_ended = start
        while (now := time.monotonic()) < end or (
                self.owes_a_fault(untried, killed) and now < end + OVERTIME_S):
            if not killed:  # the first kill once the cycle has run (Note [The short soak])
                next_kill = max(now, fault_ended + BEFORE_KILL_S) if not untried else math.inf
            if now >= next_kill:
                if not killed:  # the 2 s promise's steady state (Note [Warm standby])
                    self.daemon.wait_for_spares()
                killed_at = time.monotonic()
                self.inject_sigkill()
                killed = True
                next_kill = killed_at + self.rng.uniform(*KILL_EVERY_S)
                self.settle(AFTER_KILL_S if untried else
                            min(AFTER_KILL_S, max(0.0, end - time.monotonic())))
                continue
            # Past SOAK_S, only what has not happened yet is still due.
            fits = [item for item in queue if now + BUDGET_S[item[0]] + BEFORE_KILL_S <= next_kill
                    and (now + BUDGET_S[item[0]] <= end or item in untried)]
            if not fits:
                done = not self.owes_a_fault(untried, killed)
                self.settle((min(next_kill, end) if done else next_kill) - now)
                continue
            kind, target = fits[0]
            queue.remove(fits[0])
            queue.append((kind, target))
            untried.discard((kind, target))
            getattr(self, f"inject_{kind}")(target)
            fault_ended = time.monotonic()
            self.settle(1.0)
        self.settle(3.0)
        self.run_s = time.monotonic() - start

    def owes_a_fault(self, untried: set, killed: bool) -> bool:
        """Whether the schedule has not yet done what every check needs (Note [The short soak]):
        a kill, each item of the cycle, and a corrupted frame that a consumer caught (a consumer
        that is behind reads only the newest frame, so on a busy machine it may pass over every
        corrupted one; then corruptions go on, as tests/test_fault_injection.py's do)."""
        if not untried and not any(c.caught for c in self.corruptions):
            untried.add(next(item for item in self.cycle if item[0] == "corrupt_frame"))
        return bool(untried) or not killed

    # -- the faults -----------------------------------------------------------------------------

    def begin(self, kind: str, target: str) -> Fault:
        fault = Fault(kind, target, pylsl.local_clock())
        self.faults.append(fault)
        print(f"soak +{fault.at_lsl - self.started_lsl:6.1f} s: {kind} {target}", file=sys.stderr)
        return fault

    def inject_sigkill(self) -> None:
        status = self.status()
        running = sorted(w.name for w in status.workers if w.state == "running")
        # A worker killed again before RestartPolicy's stable uptime is a crash loop, restarted
        # after a growing backoff on purpose: pick among those up long enough for a first
        # failure (restarted at once), as isolated faults in a lab are.
        settled = [w.name for w in status.workers
                   if w.state == "running" and w.uptime_s >= RestartPolicy().stable_uptime_s]
        name = self.rng.choice(sorted(settled) or running)
        before = next(w for w in status.workers if w.name == name)
        fault = self.begin("sigkill", name)
        fault.detail = f"pid {before.pid}"
        killed_monotonic = time.monotonic()
        os.kill(before.pid, signal.SIGKILL)
        deadline = killed_monotonic + 30
        while time.monotonic() < deadline:
            now = next(w for w in self.status().workers if w.name == name)
            if now.pid not in (0, before.pid) and now.state == "running":
                fault.recovered = now.restarts == before.restarts + 1
                fault.detail += (f" → {now.pid}, running after "
                                 f"{time.monotonic() - killed_monotonic:.1f} s")
                if not fault.recovered:
                    fault.problems.append(f"restarts {before.restarts} → {now.restarts}")
                return
            time.sleep(0.1)
        fault.problems.append(f"{name} not running again 30 s after SIGKILL: {now}")

    def inject_source_outage(self, camera: str) -> None:
        since = len(self.marker_record.samples)
        fault = self.begin("source_outage", camera)
        self.peer.kill()
        self.settle(OUTAGE_S)
        self.peer.start()
        peer_back_lsl = pylsl.local_clock()
        back = self.wait_marker(lambda e: e["event"] == "camera_back" and e.get("camera") == camera,
                                since, OUTAGE_RESUME_LIMIT_S)
        resumed = self.wait_for_sample(camera, peer_back_lsl, OUTAGE_RESUME_LIMIT_S)
        events = [e for _, e in marker_events(self.marker_record, since)
                  if e.get("camera") == camera and e["event"] in ("camera_lost", "camera_back")]
        kinds = [e["event"] for e in events]
        fault.recovered = bool(back) and resumed and kinds[:1] == ["camera_lost"]
        if not fault.recovered:
            fault.problems.append(f"markers {kinds}, stream resumed: {resumed}")
        reason = next((e.get("reason", "") for e in events if e["event"] == "camera_lost"), "")
        fault.end_lsl = peer_back_lsl
        fault.detail = (f"peer down {peer_back_lsl - fault.at_lsl:.1f} s; camera_back "
                        f"{back[0] - peer_back_lsl:+.1f} s after it returned; lost: {reason}"
                        if back else f"no camera_back; markers {kinds}")

    def inject_corrupt_frame(self, camera: str) -> None:
        status = self.observe()
        capture = next((r for r in status.cameras.get(camera, []) if r.source), None)
        since = len(self.marker_record.samples)
        fault = self.begin("corrupt_frame", camera)
        corruption = Corruption(camera, transport=capture.transport if capture else "?")
        reply = request(self.daemon.runtime_dir, InjectFault(kind="corrupt_next_frame",
                                                             camera_id=camera))
        if not reply.ok:
            fault.problems.append(f"refused: {reply.error}")
            return
        found = self.wait_marker(
            lambda e: e["event"] == "fault_injected" and e.get("camera") == camera, since)
        if found is None:
            fault.problems.append("no fault_injected marker")
            return
        event = found[1]
        corruption.frame_seq, corruption.capture_ts_lsl = event["frame_seq"], event["capture_ts_lsl"]
        corruption.transport = event.get("transport", corruption.transport)
        self.corruptions.append(corruption)
        time.sleep(CORRUPT_SETTLE_S)
        self.observe(corruption)
        fault.recovered = True
        fault.detail = (f"frame {corruption.frame_seq} ({corruption.transport}): "
                        f"{corruption.caught} checksum_mismatch verdict(s)")

    def inject_malformed(self, _target: str) -> None:
        fault = self.begin("malformed", "every socket")
        runtime_dir = self.daemon.runtime_dir
        before = self.status()
        targets = [("control", "", endpoints.control(runtime_dir), zmq.DEALER, StatusRequest())]
        for camera in self.cameras:
            targets.append((f"ring-{camera}", f"capture:{camera}",
                            endpoints.ring_control(runtime_dir, camera), zmq.DEALER,
                            DescribeRing(camera_id=camera)))
        for worker in before.workers:
            # One per device (detection:cpu, detection:cuda:0); a spare binds nothing yet.
            if worker.role == "detection" and not worker.standby:
                endpoint = endpoints.detection_requests(runtime_dir, worker.name.split(":", 1)[1])
                targets.append((Path(endpoint).name, worker.name, endpoint, zmq.PUSH,
                                DetectionWanted(camera_ids=list(self.cameras))))
        targets.append(("results", "output", endpoints.results(runtime_dir), zmq.PUB,
                        FaceResults(camera_id="synth0", frame_seq=0, capture_ts_lsl=1.0,
                                    faces=[])))
        entries = [Malformed(name, worker, len(malformed_payloads(valid)))
                   for name, worker, _, _, valid in targets]
        with zmq.Context() as context:
            for _, _, endpoint, kind, valid in targets:
                with context.socket(kind) as stranger:
                    stranger.setsockopt(zmq.LINGER, 2000)  # delivered before close
                    stranger.connect(endpoint)
                    if kind == zmq.PUB:
                        time.sleep(1.0)  # a PUB drops what it sends before the SUB subscribed
                    for payload in malformed_payloads(valid):
                        stranger.send(payload)
        time.sleep(CORRUPT_SETTLE_S)
        after = self.status()
        # Then bytes that are not ZMTP/3 at all. libzmq takes a peer without the 0xFF signature
        # for a ZMTP/1.0 one and delivers its "frames" as messages: more garbage for the gates,
        # in a number only libzmq knows.
        for _, _, endpoint, _, _ in targets:
            _raw_bytes(endpoint)
        time.sleep(CORRUPT_SETTLE_S)
        final = self.status()
        for entry in entries:
            entry.counted = _rejected_between(before, after, entry.worker)
            entry.raw_counted = _rejected_between(after, final, entry.worker)
        self.malformed.extend(entries)
        workers_before = {w.name: w for w in before.workers}
        lost = [w.name for w in final.workers if (w.pid, w.restarts) != (
            workers_before[w.name].pid, workers_before[w.name].restarts)]
        if lost:
            fault.problems.append(f"workers restarted: {lost}")
        wrong = [f"{m.socket}: {m.counted}/{m.sent}" for m in entries if m.counted != m.sent]
        if wrong:
            fault.problems.append(f"miscounted: {wrong}")
        fault.recovered = not lost and not wrong
        fault.detail = (f"{sum(m.sent for m in entries)} messages on {len(targets)} sockets, "
                        f"then raw bytes on each ({sum(m.raw_counted or 0 for m in entries)} "
                        "more refused)")

    def inject_bad_reload(self, _target: str) -> None:
        good_text = self.daemon.config_path.read_text()
        pids = {w.name: w.pid for w in self.status().workers}
        fault = self.begin("bad_reload", "config file")
        self.daemon.config_path.write_text(good_text.replace("fps = 15", "fps = -3", 1))
        command = [sys.executable, "-m", "facecast.daemon.cli", "reload", "--runtime-dir",
                   str(self.daemon.runtime_dir)]
        refused = subprocess.run(command, capture_output=True, text=True, timeout=30)
        pids_after = {w.name: w.pid for w in self.status().workers}
        self.daemon.config_path.write_text(good_text)
        restored = subprocess.run(command, capture_output=True, text=True, timeout=30)
        pids_restored = {w.name: w.pid for w in self.status().workers}
        reason = refused.stderr.strip().split(".toml: ", 1)[-1]  # the key path and what is wrong
        fault.detail = (f"exit {refused.returncode}: {reason[:90]}; restored file: exit "
                        f"{restored.returncode}; worker pids unchanged: "
                        f"{pids == pids_after == pids_restored}")
        if refused.returncode != 2 or "cameras[0].fps" not in refused.stderr:
            fault.problems.append(f"refusal: {refused}")
        if restored.returncode != 0:
            fault.problems.append(f"reload of the restored file: {restored}")
        if not pids == pids_after == pids_restored:
            fault.problems.append(f"pids changed: {pids} → {pids_after} → {pids_restored}")
        fault.recovered = not fault.problems

    # -- what the recording says -----------------------------------------------------------------

    def timestamps(self, record: StreamRecord) -> np.ndarray:
        return np.sort(np.asarray(record.timestamps, dtype=np.float64))

    def measure_resumes(self) -> None:
        """Per fault and stream: from the fault to the first sample captured after it (for the
        camera of a source outage, after the peer is back: frames still buffered in the RTSP
        socket when it died do not count)."""
        stamps = {r.name: self.timestamps(r) for r in self.face_records}
        for fault in self.faults:
            for name, ts in stamps.items():
                after_lsl = max(fault.at_lsl, fault.end_lsl) if self.reconnects(fault, name) else (
                    fault.at_lsl)
                index = int(np.searchsorted(ts, after_lsl, side="right"))
                fault.resume_s[name] = float(ts[index] - fault.at_lsl) if index < len(ts) else math.inf

    def reconnects(self, fault: Fault, name: str) -> bool:
        """Whether this fault is a reconnect of this stream's network camera (its own limit)."""
        return f" {RTSP} " in f" {name} " and (
            fault.kind == "source_outage" or (fault.kind, fault.target) == ("sigkill",
                                                                          f"capture:{RTSP}"))

    def longest_gaps(self) -> dict[str, tuple[float, float]]:
        """Per stream: (longest gap between consecutive samples, outside the reconnects of its
        camera; the capture time it started at)."""
        gaps = {}
        for record in self.face_records:
            ts = self.timestamps(record)
            ts = ts[ts >= self.started_lsl]
            diffs = np.diff(ts)
            for fault in self.faults:
                if self.reconnects(fault, record.name):
                    back_lsl = fault.at_lsl + fault.resume_s.get(record.name, math.inf)
                    diffs[(ts[1:] >= fault.at_lsl) & (ts[:-1] <= back_lsl)] = 0.0
            k = int(np.argmax(diffs)) if len(diffs) else 0
            gaps[record.name] = ((float(diffs[k]), float(ts[k] - self.started_lsl))
                                 if len(diffs) else (math.inf, 0.0))
        return gaps

    def box_errors(self) -> np.ndarray:
        """Per published synthetic-camera box: distance to the nearest true face, in face sizes."""
        scenes = {camera: SyntheticScene.for_camera(config_mod.CameraConfig(
            id=camera, source="synthetic", width=640, height=360, fps=15)) for camera in SYNTHETIC}
        errors = []
        for record in self.face_records:
            camera = next((c for c in SYNTHETIC if f"-{c}-face" in record.source_id), None)
            if camera is None:
                continue
            for stamp, sample in zip(record.timestamps, record.samples):
                x1, y1, x2, y2 = (float(v) for v in sample[2:6])
                if math.isnan(x1):
                    continue
                best = math.inf
                for face in scenes[camera].faces_at(stamp):
                    tx1, ty1, tx2, ty2 = face.box_px
                    size = tx2 - tx1
                    best = min(best, max(abs((x1 + x2 - tx1 - tx2) / 2), abs((y1 + y2 - ty1 - ty2) / 2),
                                         abs((x2 - x1) - size)) / size)
                errors.append(best)
        return np.asarray(errors)

    def published_at(self, capture_ts_lsl: float) -> list[str]:
        return [r.name for r in self.face_records
                if np.any(np.abs(np.asarray(r.timestamps) - capture_ts_lsl) < 1e-6)]


# ================================================================================================
# The fixture: one run for the whole module
# ================================================================================================


@pytest.fixture(scope="module")
def soak(installed_models, tmp_path_factory, soak_report):
    python = rtsp_peer.gst_python()
    gc.collect()
    print(f"soak: {SOAK_S:g} s, transport {TRANSPORT}, seed {SEED} (FACECAST_SOAK_SEED)",
          file=sys.stderr)
    run = Soak(tmp_path_factory.mktemp("soak"), python)
    run.gpu_before = _gpu_memory()
    # After NVML's first use: libraries it loads keep descriptors of their own for the life of
    # the process (the GPU long form counted 6 such pipes/eventfds as a leak).
    run.fds_before = sorted(os.listdir("/proc/self/fd"))
    try:
        run.start()
        run.run()
        run.measure_resumes()
        yield run
    finally:
        run.close()
        try:
            soak_report.extend(report(run))
        except Exception as exc:  # noqa: BLE001 (a broken report must not hide the run's error)
            soak_report.append(f"soak report failed: {exc!r}")


def worst(fault: Fault, camera: str | None = None) -> tuple[float, str]:
    items = [(gap, name) for name, gap in fault.resume_s.items()
             if camera is None or f" {camera} " in f" {name} "]
    return max(items, default=(math.nan, ""))


# ================================================================================================
# The verdicts
# ================================================================================================


def test_the_daemon_lives_through_every_kind_of_fault(soak):
    assert soak.daemon.process.poll() is None, soak.daemon.log_tail()
    status = soak.status()
    assert status.pid == soak.supervisor_pid
    kinds = collections.Counter(f.kind for f in soak.faults)
    assert set(kinds) == {"sigkill", *(kind for kind, _ in soak.cycle)}, kinds
    problems = [(f.kind, f.target, f.problems) for f in soak.faults if f.problems]
    assert not problems, problems
    assert all(f.recovered for f in soak.faults)
    # Every restart is one of our kills: malformed messages, corruptions, a lost source and a
    # refused reload cost no worker anything.
    kills = collections.Counter(f.target for f in soak.faults if f.kind == "sigkill")
    workers = {w.name: w for w in status.workers}
    assert {name: w.restarts for name, w in workers.items() if w.restarts} == dict(kills)
    # Warm spares (Note [Warm standby]) wait; one started after the last kill may still boot.
    assert all(w.state == "running" or (w.standby and w.state in ("standby", "booting", "pending"))
               for w in workers.values()), status.workers
    log = soak.daemon.log_path.read_text()
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000):][:6000]


def test_every_face_stream_resumes_within_2_s_after_each_fault(soak):
    slow, slow_reconnects = [], []
    for fault in soak.faults:
        for name, resume_s in fault.resume_s.items():
            if fault.kind == "source_outage" and RTSP in name:
                continue  # its own camera is away on purpose (next test)
            if soak.reconnects(fault, name):
                if resume_s > RECONNECT_LIMIT_S:
                    slow_reconnects.append((fault.target, name, round(resume_s, 2)))
            elif resume_s > RESUME_LIMIT_S:
                slow.append((fault.kind, fault.target, name, round(resume_s, 2)))
    assert not slow, f"streams resumed later than {RESUME_LIMIT_S} s after a fault: {slow}"
    assert not slow_reconnects, (
        f"the RTSP camera took longer than {RECONNECT_LIMIT_S} s to reconnect: {slow_reconnects}")
    longest = soak.longest_gaps()
    # Between consecutive samples: the resume time plus at most a frame and the pipeline latency.
    too_long = {name: gap for name, (gap, _) in longest.items() if gap > RESUME_LIMIT_S + 0.5}
    assert not too_long, too_long


def test_the_lost_camera_is_reported_lost_and_back_and_its_streams_resume(soak):
    if soak.peer is None:
        pytest.skip(rtsp_peer.MISSING_REASON)
    outages = [f for f in soak.faults if f.kind == "source_outage"]
    assert outages
    for fault in outages:
        assert fault.recovered, fault
        gap_s, name = worst(fault, RTSP)
        assert gap_s < OUTAGE_S + OUTAGE_RESUME_LIMIT_S, (name, gap_s)
        # Nothing while the peer was away (beyond frames already in the socket when it died).
        for record in soak.face_records:
            if f"-{RTSP}-face" in record.source_id:
                ts = np.asarray(record.timestamps)
                during = ts[(ts > fault.at_lsl + 1.0) & (ts < fault.end_lsl)]
                assert len(during) == 0, f"{record.name} published while its camera was away"


def test_no_corrupted_frame_is_counted_valid(soak):
    assert soak.corruptions, "no frame was corrupted"
    for corruption in soak.corruptions:
        # Refused by every consumer that read it: no sample of that frame in any stream...
        assert soak.published_at(corruption.capture_ts_lsl) == [], corruption
        # ...while the camera's streams were live around it.
        around = [r for r in soak.face_records if f"-{corruption.camera}-face" in r.source_id
                  and np.any(np.abs(np.asarray(r.timestamps) - corruption.capture_ts_lsl) < 0.5)]
        assert around, f"no samples near the corrupted frame {corruption}"
        # One checksum_mismatch verdict per consumer that read it, at most. A consumer that is
        # behind reads only a camera's newest frame (DESIGN §1), so on a loaded machine a
        # corrupted frame may be passed over by all of them (caught 0: seen on 2 busy cores);
        # never published either way, as asserted above.
        assert corruption.caught is not None and corruption.caught <= len(CONSUMER_ROLES), (
            corruption)
    # The checksums did catch corruptions (tests/test_frames.py holds every single one to it,
    # with a consumer that reads every frame).
    assert any(corruption.caught for corruption in soak.corruptions), soak.corruptions
    # A checksum_mismatch verdict always has a corruption behind it.
    assert sum(soak.unexplained_mismatches.values()) == 0, soak.unexplained_mismatches
    if TRANSPORT == "cuda_ipc":
        # The first corruption on a CUDA ring is a transport fault: that camera goes to shm.
        fallbacks = {e.get("camera") for _, e in marker_events(soak.marker_record)
                     if e["event"] == "transport_fallback" and "checksum" in e.get("reason", "")}
        cuda = {c.camera for c in soak.corruptions if c.transport == "cuda_ipc"}
        assert cuda <= fallbacks, (cuda, fallbacks)
    errors = soak.box_errors()
    assert len(errors) > 0
    assert errors.max() <= JUMP_TOLERANCE, (
        f"{np.sum(errors > JUMP_TOLERANCE)} of {len(errors)} boxes off their face by more than "
        f"{JUMP_TOLERANCE} face sizes (worst {errors.max():.2f})")


def test_malformed_messages_are_counted_and_cost_no_worker(soak):
    assert soak.malformed
    wrong = [m for m in soak.malformed if m.counted != m.sent]
    assert not wrong, wrong
    log = soak.daemon.log_path.read_text()
    for source in ["control socket", "detection requests", "results",
                   *(f"ring control of {c}" for c in soak.cameras)]:
        assert f"dropped a message from {source}: " in log, source


def test_an_invalid_config_is_refused_and_the_running_config_stays(soak):
    reloads = [f for f in soak.faults if f.kind == "bad_reload"]
    assert reloads and all(f.recovered for f in reloads), reloads
    events = [e["event"] for _, e in marker_events(soak.marker_record)]
    assert events.count("reload_refused") == len(reloads)


def test_sigterm_exits_0_and_leaves_nothing_behind(soak):
    started = time.monotonic()
    soak.daemon.process.send_signal(signal.SIGTERM)
    soak.sigterm_returncode = soak.daemon.process.wait(timeout=15)
    assert soak.sigterm_returncode == 0, soak.daemon.log_tail()
    assert time.monotonic() - started < 10
    soak.close()
    time.sleep(0.5)
    leftover_pids = sorted(pid for pid in soak.our_pids if _pid_alive(pid))
    assert not leftover_pids, leftover_pids
    fds = sorted(os.listdir("/proc/self/fd"))
    assert len(fds) <= len(soak.fds_before), (
        {fd: _fd_target(fd) for fd in set(fds) - set(soak.fds_before)})
    # This daemon's segments and CUDA IPC files only, whoever else uses /dev/shm (Note [A test's
    # own shared memory]): its log's every worker start, and status's pids.
    assert shm_entries_of(soak.daemon.own_pids() | soak.our_pids) == []


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def test_gpu_memory_returns_to_its_baseline(soak):
    used_before, _, reason = soak.gpu_before
    if reason:
        pytest.skip(f"no GPU memory to check on this machine ({reason})")
    assert soak.sigterm_returncode == 0, "the daemon was not stopped"
    used_after, holders, reason = _gpu_memory()
    assert not reason, reason
    for index, before_mib in used_before.items():
        assert not holders[index] & soak.our_pids, (index, holders[index] & soak.our_pids)
        assert used_after[index] <= before_mib + GPU_MEMORY_TOLERANCE_MIB, (
            index, before_mib, used_after[index])


# ================================================================================================
# The report
# ================================================================================================


def _machine() -> str:
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    import torch

    gpu = "no GPU"
    used, _, reason = _gpu_memory()
    if not reason:
        import pynvml

        pynvml.nvmlInit()
        try:
            gpu = ", ".join(str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                            for i in used)
        finally:
            pynvml.nvmlShutdown()
    return (f"{platform.node()}: {cpu or platform.machine()}, {os.cpu_count()} cores, {gpu}; "
            f"Linux {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def report(soak: Soak) -> list[str]:
    if not soak.faults:
        return [f"soak run did not get to its faults (seed {SEED}); see the test's error"]
    if not any(f.resume_s for f in soak.faults):
        soak.measure_resumes()
    form = (f"{'short' if SOAK_S < 600 else 'long'} form on "
            f"{'the CPU' if soak.gpu_before[2] else 'a GPU'}")
    transport = sorted({c.transport for c in soak.corruptions}) or ["?"]
    lines = [
        f"facecast soak, {form}: {soak.run_s:.0f} s of faults (FACECAST_SOAK_S={SOAK_S:g}), "
        f"transport {TRANSPORT} "
        f"(frames on {'/'.join(transport)}), seed {SEED}",
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {_machine()}",
        f"daemon exit after SIGTERM: {soak.sigterm_returncode}",
        "",
        "| fault | injected | recovered | longest resume (s) | stream | limit (s) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    rows: dict[str, list] = {}  # row → [faults, (resume, stream), limit]
    for fault in soak.faults:
        for name, resume_s in fault.resume_s.items():
            if fault.kind == "source_outage":
                key, limit = (("source_outage: its own camera (away on purpose)",
                               OUTAGE_S + OUTAGE_RESUME_LIMIT_S) if soak.reconnects(fault, name)
                              else ("source_outage: the other cameras", RESUME_LIMIT_S))
            elif soak.reconnects(fault, name):
                key, limit = (f"sigkill of capture:{RTSP}: its own camera (RTSP reconnect)",
                              RECONNECT_LIMIT_S)
            else:
                key, limit = fault.kind, RESUME_LIMIT_S
            row = rows.setdefault(key, [set(), (-math.inf, ""), limit])
            row[0].add(id(fault))
            row[1] = max(row[1], (resume_s, name))
    recovered = {id(f) for f in soak.faults if f.recovered}
    for key, (faults, (resume_s, name), limit) in rows.items():
        lines.append(f"| {key} | {len(faults)} | {len(faults & recovered)} | {resume_s:.2f} | "
                     f"{name} | {limit:g} |")
    lines += ["", "| stream | samples | longest gap between samples (s) | at (s into the run) |",
              "|---|---:|---:|---:|"]
    for name, (gap_s, at_s) in soak.longest_gaps().items():
        record = next(r for r in soak.face_records if r.name == name)
        note = " (outside its reconnects)" if RTSP in name else ""
        lines.append(f"| {name} | {len(record.timestamps)} | {gap_s:.2f}{note} | {at_s:.0f} |")
    lines += ["", "Every fault: resume = from the fault to the first sample captured after it, per "
              "camera (the slower of its face streams), in s.", "",
              f"| t (s) | fault | target | recovered | {' | '.join(soak.cameras)} | detail |",
              f"|---:|---|---|---|{'---:|' * len(soak.cameras)}---|"]
    for fault in soak.faults:
        resumes = " | ".join(f"{worst(fault, camera)[0]:.2f}" for camera in soak.cameras)
        problems = f"; PROBLEMS: {fault.problems}" if fault.problems else ""
        lines.append(f"| {fault.at_lsl - soak.started_lsl:.0f} | {fault.kind} | {fault.target} | "
                     f"{'yes' if fault.recovered else 'NO'} | {resumes} | "
                     f"{fault.detail}{problems} |")
    if soak.malformed:
        lines += ["", "| socket | malformed messages sent | refused and counted | refused "
                  "messages libzmq made of raw non-ZMTP bytes |", "|---|---:|---:|---:|"]
        totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        for entry in soak.malformed:
            totals[entry.socket][0] += entry.sent
            totals[entry.socket][1] += entry.counted or 0
            totals[entry.socket][2] += entry.raw_counted or 0
        lines += [f"| {name} | {sent} | {counted} | {raw} |"
                  for name, (sent, counted, raw) in totals.items()]
    if soak.corruptions:
        lines += ["", "| corrupted frame | transport | checksum_mismatch verdicts | in a stream |",
                  "|---|---|---:|---|"]
        for c in soak.corruptions:
            published = soak.published_at(c.capture_ts_lsl)
            lines.append(f"| {c.camera} #{c.frame_seq} | {c.transport} | {c.caught} | "
                         f"{', '.join(published) or 'no'} |")
        lines += ["", f"unexplained checksum_mismatch verdicts: "
                  f"{sum(soak.unexplained_mismatches.values())}"]
    errors = soak.box_errors() if soak.face_records else np.asarray([])
    if len(errors):
        lines += ["", f"published synthetic-camera boxes: {len(errors)}, within 0.10 face sizes "
                  f"of a true face: {np.mean(errors <= 0.10):.1%}, worst {errors.max():.2f}"]
    return lines
