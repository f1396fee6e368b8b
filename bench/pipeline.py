"""Whole-daemon benchmark: N synthetic 1080p30 cameras (two faces each) through `facecast run`.

    python bench/pipeline.py [--cameras 1 4 8 16 32] [--transports cuda_ipc shm]
                             [--warmup-s 15] [--measure-s 20] [--out docs/benchmarks-pipeline.json]

For every camera count and transport, in the same run, it starts the real daemon (supervisor and
workers) with its own runtime directory, waits for READY=1 and a warm-up, then reads the
supervisor's status (the control socket `facecast status` uses) at the start and the end of a
measurement window and reports, per configuration:

- frames captured and published per second (all cameras), frames dropped (captured but never
  published: skipped by a worker that fell behind, or lost), as a count and a percentage;
- capture → LSL push latency p50/p99 (the output worker measures it against the capture
  timestamp of each frame; the worst camera's p99 is reported);
- per-stage latency p50/p99 (detection forward pass, ROI/mesh batch);
- CPU time of the whole process tree per second of wall time (cores busy), from /proc;
- GPU utilisation and memory from NVML (through the supervisor's status).

MediaPipe's CPU face landmarker is the baseline issue 5 asks for; it needs the mediapipe package,
which the offline GPU machine does not have: the JSON says so instead of inventing a figure.
Prints a table; writes JSON; `--plot` turns a JSON into a PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT, FPS = 1920, 1080, 30


def config_text(cameras: int, transport: str, runtime_dir: Path, roi_workers: int) -> str:
    lines = [
        "[daemon]", f'runtime_dir = "{runtime_dir}"', f'transport = "{transport}"',
        'host_name = "bench"', "checksum_every = 30", f"roi_landmark_workers = {roi_workers}",
        'log_level = "warning"', "", "[output]", "max_faces = 2", "",
    ]
    for k in range(cameras):
        lines += ["[[cameras]]", f'id = "cam{k:02d}"', 'source = "synthetic"',
                  f"width = {WIDTH}", f"height = {HEIGHT}", f"fps = {FPS}", ""]
    return "\n".join(lines)


def tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process and its children (alive ones, by /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, IndexError, ValueError):
            pass
    return total


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.lines: list[str] = []

    def ready(self) -> bool:
        while True:
            try:
                self.lines += self.sock.recv(65536).decode().splitlines()
            except BlockingIOError:
                break
        return "READY=1" in self.lines


def totals(status) -> dict:
    captured = published = 0
    for reports in status.cameras.values():
        for report in reports:
            if report.source:  # the capture worker's report
                captured += report.frames
            elif report.latency_ms is not None:  # the output worker's
                published += report.frames
    return {"captured": captured, "published": published}


def run_one(cameras: int, transport: str, args) -> dict:
    from facecast.daemon.control_client import request
    from facecast.shared.messages import StatusRequest

    with tempfile.TemporaryDirectory(prefix="fcb-") as tmp:
        tmp = Path(tmp)
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = args.log_dir / f"daemon-{cameras}-{transport}.log"
        runtime_dir = tmp / "run"
        config = tmp / "bench.toml"
        config.write_text(config_text(cameras, transport, runtime_dir, args.roi_workers))
        notify = NotifySocket(tmp / "notify")
        env = dict(os.environ, NOTIFY_SOCKET=notify.path)
        log = open(log_path, "w")
        daemon = subprocess.Popen([sys.executable, "-m", "facecast.daemon.cli", "run", "--config",
                                   str(config)], env=env, stdout=log, stderr=subprocess.STDOUT)
        result = {"cameras": cameras, "transport": transport}
        try:
            deadline = time.monotonic() + args.boot_timeout_s
            while not notify.ready():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    tail = log_path.read_text().splitlines()[-20:]
                    result["error"] = "daemon did not become ready: " + " | ".join(tail)
                    return result
                time.sleep(0.2)
            time.sleep(args.warmup_s)
            first = request(runtime_dir, StatusRequest(), 30)
            cpu_first, wall_first = tree_cpu_s(daemon.pid), time.monotonic()
            time.sleep(args.measure_s)
            last = request(runtime_dir, StatusRequest(), 30)
            cpu_last, wall_last = tree_cpu_s(daemon.pid), time.monotonic()
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
            log.close()
        window_s = wall_last - wall_first
        a, b = totals(first), totals(last)
        captured = b["captured"] - a["captured"]
        published = b["published"] - a["published"]
        p99s = [r.latency_ms.p99_ms for reports in last.cameras.values() for r in reports
                if r.latency_ms is not None]
        p50s = [r.latency_ms.p50_ms for reports in last.cameras.values() for r in reports
                if r.latency_ms is not None]
        transports = sorted({r.transport for reports in last.cameras.values() for r in reports
                             if r.transport})
        reasons = sorted({r.fallback_reason for reports in last.cameras.values() for r in reports
                          if r.fallback_reason})
        result.update({
            "window_s": round(window_s, 1),
            "captured_fps": round(captured / window_s, 1),
            "published_fps": round(published / window_s, 1),
            "dropped": max(0, captured - published),
            "dropped_pct": round(100.0 * max(0, captured - published) / max(captured, 1), 1),
            "latency_p50_ms": round(max(p50s), 1) if p50s else None,
            "latency_p99_ms": round(max(p99s), 1) if p99s else None,
            "stages": {name: {"p50_ms": t.p50_ms, "p99_ms": t.p99_ms}
                       for name, t in last.stages.items()},
            "cpu_cores_busy": round((cpu_last - cpu_first) / window_s, 2),
            "gpus": [{"name": g.name, "utilization_pct": g.utilization_pct,
                      "memory_used_mib": g.memory_used_mib} for g in last.gpus],
            "transports_seen": transports, "fallback_reasons": reasons,
            "workers": [f"{w.name}:{w.state}:{w.restarts}" for w in last.workers],
        })
        return result


def print_table(rows: list[dict]) -> str:
    header = ("| cameras | transport | captured fps | published fps | dropped | latency p50 / p99 "
              "(ms) | slowest stage p99 (ms) | CPU cores busy | GPU util / mem |")
    lines = [header, "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cameras']} | {r['transport']} | failed: {r['error'][:120]} |"
                         + " |" * 6)
            continue
        stage = max(r["stages"].items(), key=lambda kv: kv[1]["p99_ms"], default=("-", {"p99_ms": 0}))
        gpu = r["gpus"][0] if r["gpus"] else None
        lines.append(
            f"| {r['cameras']} | {r['transport']} ({'/'.join(r['transports_seen'])}) | "
            f"{r['captured_fps']} | {r['published_fps']} | {r['dropped']} ({r['dropped_pct']}%) | "
            f"{r['latency_p50_ms']} / {r['latency_p99_ms']} | {stage[0]} {stage[1]['p99_ms']:.0f} | "
            f"{r['cpu_cores_busy']} | "
            + (f"{gpu['utilization_pct']:.0f}% / {gpu['memory_used_mib']:.0f} MiB |" if gpu else "- |"))
    text = "\n".join(lines)
    print(text)
    return text


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
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for transport in sorted({r["transport"] for r in data["rows"]}):
        rows = [r for r in data["rows"] if r["transport"] == transport and "error" not in r]
        cams = [r["cameras"] for r in rows]
        left.plot(cams, [r["latency_p99_ms"] for r in rows], "o-", label=f"{transport} p99")
        left.plot(cams, [r["latency_p50_ms"] for r in rows], "o--", label=f"{transport} p50")
        right.plot(cams, [r["dropped_pct"] for r in rows], "o-", label=transport)
    left.set(xlabel="1080p30 cameras", ylabel="capture → LSL latency (ms)", xscale="log", yscale="log")
    right.set(xlabel="1080p30 cameras", ylabel="frames dropped (%)", xscale="log")
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
        axis.legend()
    m = data["machine"]
    fig.suptitle(f"facecast daemon, synthetic 1080p30 cameras, 2 faces each — {m.get('gpu')}, "
                 f"driver {m.get('driver', '-')}, {m['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cameras", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--transports", nargs="+", default=["cuda_ipc", "shm"])
    parser.add_argument("--roi-workers", type=int, default=1)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--measure-s", type=float, default=20.0)
    parser.add_argument("--boot-timeout-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-pipeline.json",
                        help="JSON results")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "facecast-bench",
                        help="each run's daemon log")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="only plot the JSON given by --out into this PNG")
    args = parser.parse_args()
    if args.plot:
        plot(args.out, args.plot)
        return 0
    rows = []
    for cameras in args.cameras:
        for transport in args.transports:
            print(f"running {cameras} camera(s) over {transport} ...", file=sys.stderr, flush=True)
            rows.append(run_one(cameras, transport, args))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({
                "machine": machine(), "roi_workers": args.roi_workers,
                "baseline": "MediaPipe CPU face landmarker: not measured (mediapipe is not "
                            "installable on the offline GPU machine)",
                "rows": rows}, indent=1))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
