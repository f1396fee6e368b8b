"""Recording benchmark (issue 17): how many 1080p30 cameras one CPU core encodes, and what
recording costs the running daemon.

    python bench/recording.py [--presets ultrafast superfast veryfast] [--frames 150]
                              [--cameras 2] [--width 640 --height 360 --fps 15]
                              [--measure-s 40] [--out docs/benchmarks-recording.json]

Part 1, encoder (facecast.workers.recorder.video_encoder.PyAvEncoder, exactly what the recorder
runs, one
thread per camera): this process pinned to one core (sched_setaffinity), libx264 with one thread,
`--frames` 1920x1080 frames of the synthetic scene (two real faces moving on their path,
rendered beforehand at 30 fps capture times: rendering is not timed), written to an MKV file in
a temporary directory. Counted: encoded frames per second of wall time and of the process's
CPU time (every thread), per-frame p50/p99, bytes per second of video; cameras per core =
CPU-time fps / 30.

Part 2, the daemon (same run, same machine): `facecast run` with `--cameras` synthetic cameras,
read by real pylsl inlets, for `--measure-s` with recording off, then `facecast record start`,
2 s to settle, and `--measure-s` with recording on (then `record stop`). For each window:
captured frames (frame-index samples: one per captured frame), frames missing from the
frame-index stream (gaps in frame_seq), Face samples published (frames the face pipeline
measured), capture → result latency p50/p99 (the output worker's own window, from `status`, the
worst camera), capture → bench inlet p50/p99, and with recording on the recorder's drops (sidecar
rows not "written") and frames written.

Prints a table; writes JSON (with the definitions, the machine, and its load average: the
development machine's 2 cores are shared with other work, so absolute figures are pessimistic).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the tests' daemon harness: a real `facecast run`

DEFINITIONS = {
    "encode_fps_cpu": "frames encoded per second of the process's CPU time (every thread, "
                      "pinned to one core)",
    "encode_fps_wall": "frames encoded per second of wall time, pinned to one core",
    "cameras_per_core": "encode_fps_cpu / 30: 1080p30 cameras one core keeps up with",
    "captured": "frame-index samples in the window: one per captured frame",
    "index_missing": "frame_seq values missing between frame-index samples (never published)",
    "face_published": "Face-stream samples (slot 0) in the window: frames the pipeline measured",
    "result_latency_ms": "capture -> result (output worker, after its LSL push), its last 512 "
                         "results per camera (all inside the window), worst camera: p50/p99",
    "inlet_latency_ms": "capture -> the bench's inlet pulled the Face sample: p50/p99",
    "recorder_drops": "frames captured while recording that are not in the video (sidecars)",
    "recorder_cores": "CPU time of the recorder process (every thread) per second of the window",
}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# --- part 1: the encoder on one core --------------------------------------------------------------


def bench_encoder(presets: list[str], frame_count: int) -> list[dict]:
    from facecast.workers.capture.sources import SyntheticScene
    from facecast.workers.recorder.video_encoder import PyAvEncoder

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    scene = SyntheticScene(1920, 1080, seed="bench")
    distinct = min(frame_count, 60)
    frames = [scene.render(k / 30) for k in range(distinct)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            path = Path(tmp) / f"{preset}.mkv"
            encoder = PyAvEncoder(path, 1920, 1080, 30.0, preset=preset, threads=1)
            per_frame_ms = []
            # Process CPU time, every thread's (the process is pinned to one core: a thread
            # FFmpeg or x264 starts of its own runs on the same core and is counted).
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            for k in range(frame_count):
                # Past the rendered ones the path goes back and forth: still moving content.
                index = k % (2 * distinct - 2) if distinct > 1 else 0
                index = index if index < distinct else 2 * distinct - 2 - index
                t0 = time.perf_counter()
                encoder.write(frames[index], 1000.0 + k / 30)
                per_frame_ms.append((time.perf_counter() - t0) * 1e3)
            encoder.close()
            wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
            rows.append({
                "preset": preset, "frames": frame_count,
                "encode_fps_wall": round(frame_count / wall_s, 1),
                "encode_fps_cpu": round(frame_count / cpu_s, 1),
                "cameras_per_core": round(frame_count / cpu_s / 30, 2),
                "frame_ms_p50": round(float(np.percentile(per_frame_ms, 50)), 1),
                "frame_ms_p99": round(float(np.percentile(per_frame_ms, 99)), 1),
                "video_kbytes_per_s": round(path.stat().st_size / 1024 / (frame_count / 30), 1),
            })
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return rows


# --- part 2: the daemon with recording off, then on -----------------------------------------------


def _percentiles(values: list[float]) -> list[float]:
    if not values:
        return [float("nan"), float("nan")]
    return [round(float(np.percentile(values, 50)), 1), round(float(np.percentile(values, 99)), 1)]


def _window(index_records, face_records, start_lsl: float, end_lsl: float) -> dict:
    captured = missing = 0
    for record in index_records:
        seqs = [int(s[0]) for t, s in zip(list(record.timestamps), list(record.samples))
                if start_lsl <= t < end_lsl]
        captured += len(seqs)
        missing += sum(max(0, b - a - 1) for a, b in zip(seqs, seqs[1:]))
    published, inlet_ms = 0, []
    for record in face_records:
        for t, arrival in zip(list(record.timestamps), list(record.arrivals)):
            if start_lsl <= t < end_lsl:
                published += 1
                inlet_ms.append((arrival - t) * 1e3)
    return {"captured": captured, "index_missing": missing, "face_published": published,
            "inlet_latency_ms": _percentiles(inlet_ms)}


def _result_latency(status) -> list[float]:
    worst = [0.0, 0.0]
    for reports in status.cameras.values():
        for report in reports:
            if report.latency_ms is not None:
                worst = [max(worst[0], report.latency_ms.p50_ms),
                         max(worst[1], report.latency_ms.p99_ms)]
    return [round(v, 1) for v in worst]


def bench_daemon(cameras: int, width: int, height: int, fps: float, measure_s: float) -> dict:
    import pylsl

    from daemon_harness import Daemon, Recorder

    camera_ids = [f"benchrec{k}" for k in range(cameras)]
    config = '[daemon]\nwarm_standby = "off"\n\n[output]\nmax_faces = 1\n' + "".join(
        f'\n[[cameras]]\nid = "{c}"\nsource = "synthetic"\nwidth = {width}\nheight = {height}\n'
        f"fps = {fps}\n" for c in camera_ids)
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp), config_text=config)
        try:
            if not daemon.notify.wait_for("READY=1", timeout_s=180):
                raise SystemExit(f"the daemon did not get ready:\n{daemon.log_tail()}")
            index_records = daemon.resolve("VideoExternal", count=cameras)
            face_records = daemon.resolve("Face", count=cameras)
            recorder = Recorder(index_records + face_records)
            time.sleep(3.0)  # inlets connected, pipeline steady
            off_start = pylsl.local_clock()
            time.sleep(measure_s)
            off_end = pylsl.local_clock()
            off_latency = _result_latency(daemon.status())
            record_dir = Path(tmp) / "videos"
            subprocess.run([sys.executable, "-m", "facecast.daemon.cli", "record", "start",
                            "--dir", str(record_dir), "--runtime-dir", str(daemon.runtime_dir)],
                           check=True, capture_output=True)
            time.sleep(2.0)
            recorder_pid = next(w.pid for w in daemon.status().workers if w.role == "recorder")
            on_start, recorder_cpu_start = pylsl.local_clock(), _cpu_s(recorder_pid)
            time.sleep(measure_s)
            on_end, recorder_cpu_s = pylsl.local_clock(), _cpu_s(recorder_pid) - recorder_cpu_start
            on_latency = _result_latency(daemon.status())
            subprocess.run([sys.executable, "-m", "facecast.daemon.cli", "record", "stop",
                            "--runtime-dir", str(daemon.runtime_dir)], check=True,
                           capture_output=True)
            time.sleep(4.0)  # files closed, the last samples in
            recorder.stop()
            off = _window(index_records, face_records, off_start, off_end)
            on = _window(index_records, face_records, on_start, on_end)
            off["result_latency_ms"], on["result_latency_ms"] = off_latency, on_latency
            drops = written = 0
            for sidecar in record_dir.glob("*.csv"):
                lines = sidecar.read_text().splitlines()[1:]
                written += sum(line.endswith(",written") for line in lines)
                drops += sum(not line.endswith(",written") for line in lines)
            on["recorder_drops"], on["recorder_written"] = drops, written
            on["recorder_cores"] = round(recorder_cpu_s / (on_end - on_start), 3)
        finally:
            daemon.close()
    return {"cameras": cameras, "width": width, "height": height, "fps": fps,
            "measure_s": measure_s, "recording_off": off, "recording_on": on}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["ultrafast", "superfast", "veryfast"])
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--fps", type=float, default=15.0)
    # > 512 frames per camera: status's latency window (the last 512 results) then holds only
    # the window's own frames.
    parser.add_argument("--measure-s", type=float, default=40.0)
    parser.add_argument("--skip-daemon", action="store_true")
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks-recording.json"))
    args = parser.parse_args(argv)
    import av

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average":
                    [round(v, 2) for v in os.getloadavg()], "pyav": av.__version__,
                    "ffmpeg": ".".join(map(str, av.library_versions["libavcodec"]))},
        "definitions": DEFINITIONS,
    }
    result["encoder"] = bench_encoder(args.presets, args.frames)
    print(f"1080p encoding on one core ({result['machine']['cpu']}, load "
          f"{result['machine']['load_average']}):")
    print(f"{'preset':<10} {'fps cpu':>8} {'fps wall':>8} {'cams@30':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'KiB/s':>7}")
    for row in result["encoder"]:
        print(f"{row['preset']:<10} {row['encode_fps_cpu']:>8} {row['encode_fps_wall']:>8} "
              f"{row['cameras_per_core']:>8} {row['frame_ms_p50']:>7} {row['frame_ms_p99']:>7} "
              f"{row['video_kbytes_per_s']:>7}")
    if not args.skip_daemon:
        result["daemon"] = bench_daemon(args.cameras, args.width, args.height, args.fps,
                                        args.measure_s)
        d = result["daemon"]
        print(f"\ndaemon, {d['cameras']} cameras {d['width']}x{d['height']} at {d['fps']:g} fps, "
              f"{d['measure_s']:g} s each:")
        print(f"{'recording':<10} {'captured':>8} {'missing':>7} {'faces':>6} "
              f"{'result p50/p99 ms':>18} {'inlet p50/p99 ms':>17} {'rec drops':>9} "
              f"{'recorder cores':>14}")
        for name in ("recording_off", "recording_on"):
            w = d[name]
            print(f"{name.split('_')[1]:<10} {w['captured']:>8} {w['index_missing']:>7} "
                  f"{w['face_published']:>6} {'/'.join(map(str, w['result_latency_ms'])):>18} "
                  f"{'/'.join(map(str, w['inlet_latency_ms'])):>17} "
                  f"{w.get('recorder_drops', '-'):>9} {w.get('recorder_cores', '-'):>14}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
