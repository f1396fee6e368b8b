"""The 20 s after READY: what the running workers keep while the warm spares boot (Note [Spares at
a lower priority]).

Starts `facecast run` on `config/default.toml` (two synthetic 640x360 cameras at 15 fps, the web
console on, warm spares on: what a new user runs), waits for READY=1 on a notify socket of its
own, then reads every Face stream with real pylsl inlets for `--seconds` (20): per camera the
frames published per second (distinct capture timestamps of its face0 stream) and the latency
capture -> sample in this process (p50, p99), pulled every 5 ms. Modes:

- `lowered`: the daemon as it is; spares at nice +10 where the way back is allowed;
- `normal`: the same daemon where the way back is not allowed, so spares run at the workers'
  priority (what every daemon did before): started under `setpriv` without CAP_SYS_NICE, with
  RLIMIT_NICE 0 (needs root and util-linux's setpriv);
- `off`: `daemon.warm_standby = "off"`, no spares at all: what the workers get undisturbed.

Runs alternate between the modes. Prints a table and writes JSON (`--json`). On a machine that
other work shares, `--nice -10` (root) runs the whole daemon above it, spares +10 from there.

    python3 bench/after_ready.py --runs 2 --json docs/benchmarks-after-ready.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
import pylsl

REPO = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_seconds(root_pid: int) -> tuple[float, float]:
    """CPU seconds used so far by the daemon's workers and by its spares (process title
    `facecast.standby:...`), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    workers = spares = 0.0
    try:
        children = Path(f"/proc/{root_pid}/task/{root_pid}/children").read_text().split()
    except OSError:
        return 0.0, 0.0
    for child in children:
        try:
            stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            title = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        used = (int(stat[11]) + int(stat[12])) / ticks
        if title.startswith("facecast.standby:"):
            spares += used
        else:
            workers += used
    return workers, spares


def _daemon_pid(popen: subprocess.Popen) -> int:
    """The supervisor's pid: the Popen's, or its child's when wrappers (nice, setpriv,
    prlimit) exec'd one into another (they exec, so it is the same pid)."""
    return popen.pid


def one_run(mode: str, seconds: float, workdir: Path, nice: int = 0) -> dict:
    host = f"ar{uuid.uuid4().hex[:8]}"
    text = (REPO / "config/default.toml").read_text()
    extra = f'host_name = "{host}"\nruntime_dir = "{workdir / "run"}"\n'
    if mode == "off":
        extra += 'warm_standby = "off"\n'
    config = workdir / "facecast.toml"
    config.write_text(text.replace("[daemon]\n", "[daemon]\n" + extra)
                      .replace("[web]\n", "[web]\nport = 0\n"))
    notify_path = workdir / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(0.5)
    command = [sys.executable, "-m", "facecast.daemon.cli", "run", "--config", str(config)]
    if mode == "normal":
        command = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice",
                   "prlimit", "--nice=0"] + command
    if nice:  # the whole daemon above (or below) whatever else the machine runs
        command = ["nice", "-n", str(nice)] + command
    log = open(workdir / "daemon.log", "w")
    daemon = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, NOTIFY_SOCKET=str(notify_path)))
    try:
        started = time.monotonic()
        while True:
            try:
                if b"READY=1" in notify.recv(65536):
                    break
            except socket.timeout:
                pass
            if daemon.poll() is not None or time.monotonic() - started > 180:
                raise RuntimeError(f"no READY: see {workdir / 'daemon.log'}")
        ready_s = time.monotonic() - started
        # The streams exist since before READY: resolving does not delay the window much.
        predicate = f"type='Face' and starts-with(source_id, 'facecast-{host}-')"
        infos = pylsl.resolve_bypred(predicate, minimum=4, timeout=10.0)
        inlets = {}
        for info in infos:
            if info.name().endswith("face0"):
                inlet = pylsl.StreamInlet(info, max_buflen=60)
                inlet.open_stream(timeout=5)
                inlets[info.name().split()[1]] = inlet
        cpu_before = _cpu_seconds(_daemon_pid(daemon))
        window_start = pylsl.local_clock()
        stamps = {camera: [] for camera in inlets}
        latencies = {camera: [] for camera in inlets}
        while pylsl.local_clock() < window_start + seconds:
            for camera, inlet in inlets.items():
                _, got = inlet.pull_chunk(timeout=0.0)
                now = pylsl.local_clock()
                for stamp in got:
                    if stamp >= window_start:
                        stamps[camera].append(stamp)
                        latencies[camera].append((now - stamp) * 1000)
            time.sleep(0.005)
        cpu_after = _cpu_seconds(_daemon_pid(daemon))
        result = {"mode": mode, "ready_s": round(ready_s, 1), "cameras": {},
                  "workers_cpu_s": round(cpu_after[0] - cpu_before[0], 1),
                  "spares_cpu_s": round(cpu_after[1] - cpu_before[1], 1),
                  "load_average_1min": round(os.getloadavg()[0], 1)}
        for camera in inlets:
            lat = np.asarray(latencies[camera])
            result["cameras"][camera] = {
                "fps": round(len(set(stamps[camera])) / seconds, 2),
                "latency_p50_ms": round(float(np.percentile(lat, 50)), 1) if lat.size else None,
                "latency_p99_ms": round(float(np.percentile(lat, 99)), 1) if lat.size else None,
            }
        for inlet in inlets.values():
            inlet.close_stream()
        return result
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        notify.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--modes", nargs="+", default=["normal", "lowered", "off"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--nice", type=int, default=0,
                        help="run the daemon at this nice (root: e.g. -10, so that other work "
                             "on a shared machine counts little against it)")
    args = parser.parse_args()
    results = []
    for run in range(args.runs):
        for mode in args.modes:
            with tempfile.TemporaryDirectory(prefix="facecast-after-ready-") as tmp:
                result = one_run(mode, args.seconds, Path(tmp), args.nice)
            result["run"] = run
            results.append(result)
            worst_p99 = max(c["latency_p99_ms"] or 0 for c in result["cameras"].values())
            fps = " ".join(f"{c}: {v['fps']:.1f}" for c, v in result["cameras"].items())
            print(f"run {run} {mode:<8} READY {result['ready_s']:5.1f} s; fps {fps}; "
                  f"p50 {max(c['latency_p50_ms'] or 0 for c in result['cameras'].values()):.0f}"
                  f" ms, p99 {worst_p99:.0f} ms (worst camera); CPU s workers {result['workers_cpu_s']}, "
                  f"spares {result['spares_cpu_s']}; load {result['load_average_1min']}",
                  flush=True)
    summary = {"machine": f"{cpu_name()} ({os.cpu_count()} cores)",
               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "seconds_after_ready": args.seconds, "daemon_nice": args.nice, "runs": results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
