"""What the web console costs the pipeline: the daemon with the console off, on with no browser,
and on with N browsers, in the same run: dropped frames and capture → LSL latency.

    python bench/console.py --cameras 2 --browsers 4 [--json docs/benchmarks-console.json]

The counting is bench/pipeline.py's (`measure`), hence bench/accounting.py's definitions (Note
[One definition for both sides]): frames due in a window of capture time, frames published as
read by real pylsl inlets, dropped = due - published, the worst camera's p50/p99 latency. A
"browser" is what the console's grid page does, done by an aiohttp client in a process of its
own: one Server-Sent Events stream read to the end, and every camera's preview asked for again
as soon as the last one came and 1/preview_fps after the one before. Its counts (previews,
events) are in the JSON.

The cameras are smaller than bench/pipeline.py's (640x360 at 15 fps by default) so that a
2-core CPU machine keeps up without the console; the issue's figure, 4 browsers on 16 cameras
on the H200, is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pipeline  # bench/pipeline.py: this script's folder is first on sys.path
from accounting import DEFINITIONS

REPO = Path(__file__).resolve().parent.parent
BENCH_TOKEN = "bench-console-token-0123456789"


def _config(cameras: int, runtime_dir: Path, host: str, console: bool, source: str) -> str:
    text = pipeline.config_text(cameras, "shm", runtime_dir, 1, True, False, host, source)
    if console:
        text += ("\n[web]\nenabled = true\nport = 0\npreview_fps = 10\npreview_width = 320\n"
                 f'token = "{BENCH_TOKEN}"\n')
    return text


# --- the browsers (each in its own process) ------------------------------------------------------


def _browser(url: str, camera_ids: list[str], preview_fps: float, seconds: float, stop,
             queue) -> None:
    import aiohttp

    counts = {"previews": 0, "preview_errors": 0, "sse_events": 0, "preview_bytes": 0}

    async def previews(session: aiohttp.ClientSession, camera_id: str, end_monotonic: float):
        period_s = 1.0 / preview_fps
        while time.monotonic() < end_monotonic and not stop.is_set():
            started = time.monotonic()
            try:
                async with session.get(f"{url}api/cameras/{camera_id}/preview.jpg") as response:
                    body = await response.read()
                    if response.status == 200:
                        counts["previews"] += 1
                        counts["preview_bytes"] += len(body)
                    else:
                        counts["preview_errors"] += 1
            except aiohttp.ClientError:
                counts["preview_errors"] += 1
            await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))

    async def events(session: aiohttp.ClientSession, end_monotonic: float):
        async with session.get(f"{url}api/events") as response:
            while time.monotonic() < end_monotonic and not stop.is_set():
                try:
                    line = await asyncio.wait_for(response.content.readline(), 0.5)
                except asyncio.TimeoutError:
                    continue
                except aiohttp.ClientError:
                    counts["sse_ended_early"] = True
                    return
                if line.startswith(b"event: "):
                    counts["sse_events"] += 1

    async def main():
        end_monotonic = time.monotonic() + seconds
        # Every request needs the token (Note [Console security]).
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {BENCH_TOKEN}"}) as session:
            await session.get(url)  # the page itself
            await asyncio.gather(events(session, end_monotonic),
                                 *(previews(session, c, end_monotonic) for c in camera_ids))

    started_monotonic = time.monotonic()
    try:
        asyncio.run(main())
    finally:
        counts["seconds"] = round(time.monotonic() - started_monotonic, 1)
        queue.put(counts)


def _console_url(runtime_dir: Path, timeout_s: float = 120.0) -> str:
    from facecast.workers.console.worker import read_console_file

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        console = read_console_file(runtime_dir)
        if console is not None:
            return console["url"]
        time.sleep(0.2)
    raise RuntimeError(f"the console did not start within {timeout_s:g} s")


# --- one run ---------------------------------------------------------------------------------------


def run_one(label: str, cameras: int, console: bool, browsers: int, args) -> dict:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    host = f"benchweb{uuid.uuid4().hex[:6]}"
    result = {"run": label, "cameras": cameras, "console": console, "browsers": browsers,
              "width": pipeline.WIDTH, "height": pipeline.HEIGHT, "fps": pipeline.FPS}
    log_path = args.log_dir / f"daemon-console-{label}.log"
    with tempfile.TemporaryDirectory(prefix="fcw-") as tmp:
        tmp = Path(tmp)
        daemon = pipeline.DaemonUnderTest(
            tmp, _config(cameras, tmp / "run", host, console, args.source), log_path)
        spawn = multiprocessing.get_context("spawn")
        processes, queue, stop = [], spawn.Queue(), spawn.Event()
        try:
            if not daemon.wait_ready(args.boot_timeout_s):
                result["error"] = "daemon did not become ready: " + daemon.log_tail()
                return result
            if console:
                url = _console_url(daemon.runtime_dir)
                seconds = args.warmup_s + args.measure_s + args.drain_s + 30
                camera_ids = [f"cam{k:02d}" for k in range(cameras)]
                for _ in range(browsers):
                    process = spawn.Process(
                        target=_browser, args=(url, camera_ids, 10.0, seconds, stop, queue))
                    process.start()
                    processes.append(process)
            pipeline.measure(daemon, host, cameras, args, result)
            status = daemon.status()
            console_worker = next((w for w in status.workers if w.name == "console"), None)
            result["console_worker"] = None if console_worker is None else {
                "state": console_worker.state, "restarts": console_worker.restarts}
        except (OSError, RuntimeError, TimeoutError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc} | {daemon.log_tail(8)}"
        finally:
            stop.set()  # the browsers end (and report) while the console still answers
            result["browser_counts"] = []
            for _ in processes:
                try:
                    result["browser_counts"].append(queue.get(timeout=30))
                except Exception:  # noqa: BLE001 - a browser that never reported
                    break
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.terminate()
            result["stop"] = daemon.stop(args.stop_timeout_s)
    return result


def print_table(rows: list[dict]) -> list[str]:
    lines = ["| round | run | cameras | browsers | frames due | dropped | dropped % | latency p50 ms "
             "| latency p99 ms | cores busy | console previews/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('round')} | {r['run']} | {r['cameras']} | {r['browsers']} | error: "
                         f"{r['error'][:80]} | | | | | | |")
            continue
        counts = r.get("browser_counts", [])
        rate = (f"{sum(c['previews'] / c['seconds'] for c in counts if c['seconds']):.1f}"
                if counts else "-")
        lines.append(
            f"| {r.get('round')} | {r['run']} | {r['cameras']} | {r['browsers']} | {r['frames_due']} | "
            f"{r['dropped']} | {r['dropped_pct']} | {r['latency_p50_ms']} | "
            f"{r['latency_p99_ms']} | {r['cpu_cores_busy']} | {rate} |")
    print("\n".join(lines))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--browsers", type=int, default=4)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--fps", type=float, default=15.0)
    parser.add_argument("--source", choices=("synthetic", "synthetic-replay"),
                        default="synthetic-replay",
                        help="replay: the cameras' rendering costs next to nothing, so the "
                             "figures are the pipeline's and the console's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--measure-s", type=float, default=40.0)
    parser.add_argument("--drain-s", type=float, default=10.0)
    parser.add_argument("--boot-timeout-s", type=float, default=240.0)
    parser.add_argument("--stop-timeout-s", type=float, default=60.0)
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "fc-bench")
    parser.add_argument("--json", type=Path, help="write every row (and the machine) here")
    args = parser.parse_args()
    # bench/pipeline.py's counting reads the camera mode from its module constants.
    pipeline.WIDTH, pipeline.HEIGHT, pipeline.FPS = args.width, args.height, args.fps
    pipeline.use_loopback_lsl()
    rows = []
    # Alternated, round after round: a machine whose load changes (other jobs) shows it as a
    # spread between rounds of the same setting, rather than as a difference between settings.
    for round_index in range(args.rounds):
        for label, console, browsers in (
                ("console off", False, 0), ("console on, no browser", True, 0),
                (f"console on, {args.browsers} browsers", True, args.browsers)):
            print(f"round {round_index + 1}: {label}...", file=sys.stderr, flush=True)
            started = time.monotonic()
            row = run_one(label, args.cameras, console, browsers, args)
            row["round"] = round_index + 1
            row["run_s"] = round(time.monotonic() - started, 1)
            rows.append(row)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({
            "machine": pipeline.machine(), "definitions": DEFINITIONS, "rows": rows,
            "not_measured": "the issue's figure (4 browsers on 16 cameras on the H200, within "
                            "5% of console off) needs the GPU machine; this is a CPU run",
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
