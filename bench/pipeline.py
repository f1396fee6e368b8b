"""Whole-daemon benchmark: N synthetic 1080p30 cameras (two faces each) through `facecast run`.

    python bench/pipeline.py [--cameras 1 4 8 16 32] [--transports cuda_ipc shm]
                             [--warmup-s 15] [--measure-s 20] [--out docs/benchmarks-pipeline.json]
                             [--mediapipe-baseline [--mediapipe-path /tmp/mp] [--mediapipe-python PY]]

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

With `--mediapipe-baseline`, the baseline issue 5 asks for runs after the daemon at every camera
count, on the same machine: MediaPipe's face mesh on the CPU, one process per camera, on the
same synthetic frames (bench/mediapipe_baseline.py; its processes run under
`--mediapipe-python` with `--mediapipe-path` put before $PYTHONPATH, where mediapipe 0.10.21
and protobuf 4.25 are installed). Each daemon row then gets ratios against it: CPU cores busy
(and CPU per frame handled), p99 latency, faces per frame. The daemon's scene has ~420 px faces,
which MediaPipe finds too; so a second scene with faces of `--small-face-px` (100 and 250 px
wide) is run once, by MediaPipe (one camera, real time) and by facecast's FacePipeline (the
daemon's models and tracking, in this process, on the GPU when there is one), counting the faces
each finds by width. Without the option the JSON says that the baseline was not measured.
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


def config_text(cameras: int, transport: str, runtime_dir: Path, roi_workers: int,
                cuda_graphs: bool = True, half: bool = False) -> str:
    lines = [
        "[daemon]", f'runtime_dir = "{runtime_dir}"', f'transport = "{transport}"',
        'host_name = "bench"', "checksum_every = 30", f"roi_landmark_workers = {roi_workers}",
        'log_level = "warning"', "", "[models]", f"cuda_graphs = {str(cuda_graphs).lower()}",
        f"half = {str(half).lower()}", "", "[output]", "max_faces = 2", "",
    ]
    for k in range(cameras):
        lines += ["[[cameras]]", f'id = "cam{k:02d}"', 'source = "synthetic"',
                  f"width = {WIDTH}", f"height = {HEIGHT}", f"fps = {FPS}", ""]
    return "\n".join(lines)


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


def output_faces(status) -> list[int]:
    """Faces in each camera's newest published frame (the output workers' reports)."""
    return [report.faces for reports in status.cameras.values() for report in reports
            if report.latency_ms is not None]


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
        config.write_text(config_text(cameras, transport, runtime_dir, args.roi_workers,
                                      args.cuda_graphs, args.half))
        notify = NotifySocket(tmp / "notify")
        env = dict(os.environ, NOTIFY_SOCKET=notify.path)
        log = open(log_path, "w")
        daemon = subprocess.Popen([sys.executable, "-m", "facecast.daemon.cli", "run", "--config",
                                   str(config)], env=env, stdout=log, stderr=subprocess.STDOUT)
        result = {"cameras": cameras, "transport": transport,
                  "models": "fp16" if args.half else "fp32",
                  "cuda_graphs": args.cuda_graphs}
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
            roles_first = role_cpu_s(first)
            time.sleep(args.measure_s)
            last = request(runtime_dir, StatusRequest(), 30)
            cpu_last, wall_last = tree_cpu_s(daemon.pid), time.monotonic()
            roles_last = role_cpu_s(last)
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
        faces = output_faces(first) + output_faces(last)
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
            # Where the CPU goes: capture renders (synthetic) or decodes, the rest is our cost.
            "cpu_cores_by_role": cores_by_role(roles_first, roles_last, window_s),
            # Sampled, not counted per frame: the newest frame's faces at the window's two ends.
            "faces_per_frame": round(sum(faces) / len(faces), 2) if faces else None,
            "gpus": [{"name": g.name, "utilization_pct": g.utilization_pct,
                      "memory_used_mib": g.memory_used_mib} for g in last.gpus],
            "transports_seen": transports, "fallback_reasons": reasons,
            "workers": [f"{w.name}:{w.state}:{w.restarts}" for w in last.workers],
        })
        return result


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
        "faces_per_frame": row["faces_per_frame"],
        "mediapipe_faces_per_frame": baseline["faces"]["faces_per_frame"],
    }


def facecast_small_faces(face_px: list[float], seconds: float) -> dict:
    """Faces found by facecast's FacePipeline (the daemon's models, detection and tracking) on
    frames of the small-face scene, one after another, by face width."""
    import torch

    from facecast.models.pipeline import FacePipeline
    from mediapipe_baseline import FaceCounts, FixedSizeScene

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipeline = FacePipeline(device=device, max_faces=2)
    scene = FixedSizeScene(WIDTH, HEIGHT, "cam00", face_px)
    counts = FaceCounts()
    for k in range(max(1, round(seconds * FPS))):
        t_s = k / FPS
        faces = pipeline.track([scene.render(t_s)], ["cam00"])[0]
        counts.add(scene.faces_at(t_s), [tuple(f.landmarks[FaceCounts.NOSE_TIP, :2]) for f in faces])
    return {"what": f"facecast FacePipeline(max_faces=2) on {device}, in the bench process",
            **counts.summary()}


def print_table(rows: list[dict], small_faces: dict | None = None) -> str:
    header = ("| cameras | transport | captured fps | published fps | dropped | latency p50 / p99 "
              "(ms) | slowest stage p99 (ms) | CPU cores busy | GPU util / mem |")
    columns = 9
    with_baseline = any("mediapipe" in r for r in rows)
    if with_baseline:
        header += (" MediaPipe CPU cores busy | CPU ratio fc/mp (per frame) | MediaPipe p50 / p99 (ms)"
                   " | p99 ratio fc/mp | MediaPipe dropped | faces per frame fc / mp |")
        columns += 6
    lines = [header, "|" + "---|" * columns]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cameras']} | {r['transport']} | failed: {r['error'][:120]} |"
                         + " |" * (columns - 3))
            continue
        stage = max(r["stages"].items(), key=lambda kv: kv[1]["p99_ms"], default=("-", {"p99_ms": 0}))
        gpu = r["gpus"][0] if r["gpus"] else None
        line = (
            f"| {r['cameras']} | {r['transport']} ({'/'.join(r['transports_seen'])}) | "
            f"{r['captured_fps']} | {r['published_fps']} | {r['dropped']} ({r['dropped_pct']}%) | "
            f"{r['latency_p50_ms']} / {r['latency_p99_ms']} | {stage[0]} {stage[1]['p99_ms']:.0f} | "
            f"{r['cpu_cores_busy']} | "
            + (f"{gpu['utilization_pct']:.0f}% / {gpu['memory_used_mib']:.0f} MiB |" if gpu else "- |"))
        if with_baseline:
            v, b = r.get("vs_mediapipe"), r.get("mediapipe")
            if v is None:
                line += " - |" * 6 if b is None else f" failed: {b.get('error', '')[:120]} |" + " |" * 5
            else:
                line += (f" {b['cpu_cores_busy']} | {v['cpu_ratio']} ({v['cpu_per_frame_ratio']}) | "
                         f"{b['latency_p50_ms']} / {b['latency_p99_ms']} | {v['p99_ratio']} | "
                         f"{b['dropped']} ({b['dropped_pct']}%) | {v['faces_per_frame']} / "
                         f"{v['mediapipe_faces_per_frame']} |")
        lines.append(line)
    roles = sorted({role for r in rows for role in r.get("cpu_cores_by_role", {})})
    if roles:
        lines += ["", "CPU cores busy by process role (capture includes rendering the synthetic "
                  "frames):", "", "| cameras | transport | " + " | ".join(roles) + " |",
                  "|" + "---|" * (2 + len(roles))]
        for r in rows:
            by_role = r.get("cpu_cores_by_role", {})
            if by_role:
                lines.append(f"| {r['cameras']} | {r['transport']} | "
                             + " | ".join(str(by_role.get(role, "-")) for role in roles) + " |")
    if small_faces:
        lines += ["", *small_faces_table(small_faces)]
    text = "\n".join(lines)
    print(text)
    return text


def small_faces_table(small_faces: dict) -> list[str]:
    from mediapipe_baseline import SIZE_BINS_PX

    lines = [f"Faces found, 1920x1080, two faces of {small_faces['face_px']} px:", "",
             "| face width | present (fc / mp) | facecast found | MediaPipe found |",
             "|---|---|---|---|"]
    fc, mp = small_faces["facecast"], small_faces["mediapipe"]
    if "error" in mp:
        return lines + [f"| MediaPipe failed: {mp['error'][:160]} | | | |"]
    mp = mp["faces"]
    for _, _, label in SIZE_BINS_PX:
        if label in fc["present"] or label in mp["present"]:
            lines.append(f"| {label} | {fc['present'].get(label, 0)} / {mp['present'].get(label, 0)} | "
                         f"{fc['found_pct_by_width'].get(label)}% | "
                         f"{mp['found_pct_by_width'].get(label)}% |")
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
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for transport in sorted({r["transport"] for r in data["rows"]}):
        rows = [r for r in data["rows"] if r["transport"] == transport and "error" not in r]
        cams = [r["cameras"] for r in rows]
        left.plot(cams, [r["latency_p99_ms"] for r in rows], "o-", label=f"{transport} p99")
        left.plot(cams, [r["latency_p50_ms"] for r in rows], "o--", label=f"{transport} p50")
        right.plot(cams, [r["dropped_pct"] for r in rows], "o-", label=transport)
    baseline = {r["cameras"]: r["mediapipe"] for r in data["rows"] if r.get("mediapipe")}
    if baseline:  # --mediapipe-baseline: the same cameras through MediaPipe on the CPU
        cams = sorted(baseline)
        left.plot(cams, [baseline[c]["latency_p99_ms"] for c in cams], "s:", color="gray",
                  label="MediaPipe CPU p99")
        right.plot(cams, [baseline[c]["dropped_pct"] for c in cams], "s:", color="gray",
                   label="MediaPipe CPU")
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
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="models.cuda_graphs = false (eager kernels)")
    parser.add_argument("--half", action="store_true", help="models.half = true (float16)")
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--measure-s", type=float, default=20.0)
    parser.add_argument("--boot-timeout-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-pipeline.json",
                        help="JSON results")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "facecast-bench",
                        help="each run's daemon log")
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
                          help="seconds of frames of the small-face scene (30 per second)")
    args = parser.parse_args()
    if args.plot:
        plot(args.out, args.plot)
        return 0
    rows: list[dict] = []
    results = {"machine": machine(), "roi_workers": args.roi_workers,
               "baseline": "MediaPipe CPU face landmarker: not measured (run with --mediapipe-baseline)",
               "rows": rows}
    if args.mediapipe_baseline:
        import mediapipe_baseline  # bench/ is this script's folder, first on sys.path

        results["baseline"] = {"description": mediapipe_baseline.DESCRIPTION,
                               "python": args.mediapipe_python, "path": args.mediapipe_path,
                               "warmup_s": args.baseline_warmup_s, "measure_s": args.baseline_measure_s,
                               "rows": []}  # in full, per camera too; the daemon rows get summaries

        def run_baseline(cameras: int, face_px=None, measure_s=args.baseline_measure_s) -> dict:
            return mediapipe_baseline.run(
                cameras, face_px=face_px, warmup_s=args.baseline_warmup_s, measure_s=measure_s,
                boot_timeout_s=args.boot_timeout_s, log_dir=args.log_dir,
                python=args.mediapipe_python, pythonpath=args.mediapipe_path)

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
    if args.mediapipe_baseline:
        print("running the small-face scene ...", file=sys.stderr, flush=True)
        small_faces = {"face_px": args.small_face_px,
                       "mediapipe": run_baseline(1, args.small_face_px, args.small_face_s),
                       "facecast": facecast_small_faces(args.small_face_px, args.small_face_s)}
        small_faces["mediapipe"].pop("per_camera", None)
        results["baseline"]["small_faces"] = small_faces
        args.out.write_text(json.dumps(results, indent=1))
    print_table(rows, results["baseline"].get("small_faces") if args.mediapipe_baseline else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
