"""`facecast analyze --jobs N`: the files dealt into N analysing processes (Note [Jobs]).

Each job is `facecast analyze --json --jobs 1` on its share of the files, with its own models;
this process starts them, shows their progress and summaries as one run would (the same bars,
the same JSON lines, the same summary lines, in the order the files were given), and passes an
interrupt on so that each saves its resume point.

Note [Jobs]
    One analysing process is held by its own Python, not by the GPU: the thread that drives the
    models and writes the tables takes the interpreter lock in turn with the files' decoding
    threads. Measured on an H100 (2026-11-26, 1080p H.264 with one face, files of 600 frames,
    eight files a process, NVDEC): one process 530-546 frames/s; two at once 480 each (960);
    four at once 302-323 each (1,240), the GPU then 99 % busy, each process holding 3.0 GB of
    it; and the command on 32 such files, once working: 988 frames/s with one job, 1,266 with
    four (docs/benchmarks.md, `facecast analyze`). So on a GPU the files are dealt into up to
    MAX_GPU_JOBS processes of FILES_PER_GPU_JOB files each (`--jobs auto`), so that each
    process batches as many files as the measured one did; on the CPU one process (Note [One
    thread on the CPU]: `--jobs 2` is the way to use a second free core). A job is a whole
    `facecast analyze` on its own files: the same frames through the same stack in the same
    order, so a table is the one run's within float tolerance (which files share a batch moves
    the last digits, as it does in one process), and resuming, summaries and errors stay the
    single process's; the files whose tables would collide go to one job, which refuses them
    as one run would.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from facecast.daemon.cli.video_analysis import output_paths

MAX_GPU_JOBS = 4
FILES_PER_GPU_JOB = 8
# Note [Threads of the models] (facecast.daemon.cli.analyze): `--threads auto` gives a job at
# most this many; 8 is the most measured (LiteRT on the GPU machine's CPU, docs/benchmarks.md).
MAX_MODEL_THREADS = 8
STOP_TIMEOUT_S = 60.0  # a job saves its resume point at the end of its batch


def _auto_or_count(text: str, option: str, things: str) -> int | str:
    """An option's "auto" or a count of `things`, 1 or more."""
    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{option} {text}: a number of {things} (1 or more) or auto")
    return count


def parse_jobs(text: str) -> int | str:
    """`--jobs`: "auto" or a count of processes, 1 or more."""
    return _auto_or_count(text, "--jobs", "processes")


def parse_threads(text: str) -> int | str:
    """`--threads`: "auto" or a count of threads, 1 or more."""
    return _auto_or_count(text, "--threads", "threads")


def model_threads(requested: int | str, jobs: int) -> int:
    """Note [Threads of the models]: each job's threads for the models on the CPU; "auto" deals
    the cores this process may run on among the jobs (at most MAX_MODEL_THREADS a job)."""
    if requested != "auto":
        return requested
    return max(1, min(MAX_MODEL_THREADS, len(os.sched_getaffinity(0)) // jobs))


def job_count(requested: int | str, on_gpu: bool, files: int) -> int:
    """Note [Jobs]: how many processes analyse `files` files."""
    if requested == "auto":
        requested = min(MAX_GPU_JOBS, math.ceil(files / FILES_PER_GPU_JOB)) if on_gpu else 1
    return max(1, min(requested, files))


def deal(videos: list[Path], out_dir: Path | None, jobs: int) -> list[list[Path]]:
    """The videos in `jobs` shares of about equal bytes, largest first; videos whose tables
    would be the same file stay together (their job refuses all but the first, as one run
    does). Each share keeps the given order."""
    units: dict[Path, list[int]] = {}
    for index, video in enumerate(videos):
        table = output_paths(video, out_dir)[0].resolve()
        units.setdefault(table, []).append(index)

    def size(index: int) -> int:
        try:
            return videos[index].stat().st_size
        except OSError:
            return 0  # missing: its job says so

    shares: list[list[int]] = [[] for _ in range(jobs)]
    loads = [0] * jobs
    for unit in sorted(units.values(), key=lambda unit: -sum(map(size, unit))):
        lightest = loads.index(min(loads))
        shares[lightest] += unit
        loads[lightest] += sum(map(size, unit))
    return [[videos[i] for i in sorted(share)] for share in shares if share]


def job_command(args, share: list[Path], parquet: bool, threads: int) -> list[str]:
    """`facecast analyze` on one share, as this run was asked, with JSON progress for this
    process to show (and the table format this process already settled: no notice per job) and
    its share of the cores (`threads`: model_threads)."""
    command = [sys.executable, "-m", "facecast.daemon.cli", "analyze", "--json", "--jobs", "1",
               "--threads", str(threads), "--format", "both" if parquet else "csv",
               "--device", args.device, "--decode", args.decode]
    for flag in ("out", "config"):
        if getattr(args, flag) is not None:
            command += [f"--{flag}", str(getattr(args, flag))]
    for flag in ("landmarks", "pose", "participants", "restart"):
        if getattr(args, flag):
            command.append(f"--{flag}")
    return command + ["--", *map(str, share)]


class _Job:
    """One job's process and the threads reading its output into the run's queue."""

    def __init__(self, index: int, command: list[str], lines: queue.Queue,
                 said: set[str], said_lock: threading.Lock) -> None:
        self.index = index
        # A session of its own: a Ctrl-C at the terminal reaches this process alone, which
        # passes it on once (twice, a job would be interrupted again while saving).
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                        start_new_session=True)
        self._said, self._said_lock = said, said_lock
        self._readers = [
            threading.Thread(target=self._read_stdout, args=(lines,), daemon=True,
                             name=f"facecast-job{index}-out"),
            threading.Thread(target=self._relay_stderr, daemon=True,
                             name=f"facecast-job{index}-err")]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self, lines: queue.Queue) -> None:
        for line in self.process.stdout:
            lines.put((self.index, line))
        lines.put((self.index, None))

    def _relay_stderr(self) -> None:
        """Its errors and notices on this process's stderr; a `facecast: ...` line that another
        job said already (the run's decoder notice, say) once."""
        for line in self.process.stderr:
            if line.startswith("facecast: "):
                with self._said_lock:
                    if line in self._said:
                        continue
                    self._said.add(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def interrupt(self) -> None:
        # SIGTERM, which a job takes as an interrupt whatever it inherited: a command started
        # with SIGINT ignored (a script's `facecast analyze ... &`) hands that on to its jobs,
        # and Python then gives them no KeyboardInterrupt for a SIGINT.
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        """Its exit status, once its output is all read (a job that does not stop within
        STOP_TIMEOUT_S is killed)."""
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for reader in self._readers:
            reader.join()
        return self.process.returncode


def run(args, videos: list[Path], jobs: int, parquet: bool, threads: int) -> int:
    """The files through `jobs` processes of `threads` model threads each; the exit status one
    run would have (130 when interrupted, 2 when a job could not start its models, 1 when a
    file had a problem)."""
    from facecast.daemon.cli.analyze import _Bars, _summary_line

    out_dir = Path(args.out) if args.out else None
    shares = deal(videos, out_dir, jobs)
    lines: queue.Queue = queue.Queue()
    said: set[str] = set()
    said_lock = threading.Lock()
    summaries: dict[str, list[dict]] = {}  # a video given twice: two, in the order given
    bars = None if args.quiet or args.json else _Bars([])
    running: list[_Job] = []
    interrupted = False
    # A SIGTERM is an interrupt too: each job saves its resume point.
    previous_term = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        running = [_Job(index, job_command(args, share, parquet, threads), lines, said, said_lock)
                   for index, share in enumerate(shares)]
        open_jobs = len(running)
        while open_jobs:
            index, line = lines.get()
            if line is None:
                open_jobs -= 1
                continue
            try:
                message = json.loads(line)
            except ValueError:  # not ours (a library printing to stdout): passed on
                sys.stdout.write(line)
                continue
            if message.get("type") == "summary":
                summaries.setdefault(message["video"], []).append(message)
            elif args.json:
                print(json.dumps(message), flush=True)
            elif bars is not None and message.get("type") in ("start", "progress"):
                bars.report(message)
    except KeyboardInterrupt:
        interrupted = True
        for job in running:
            job.interrupt()
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        codes = _wait_for(running)
        if bars is not None:
            bars.close()
    if interrupted or 130 in codes:
        said_by_jobs = "facecast: interrupted; run the same command again to resume\n"
        if said_by_jobs not in said:
            sys.stderr.write(said_by_jobs)
        return 130
    status_of = {video: code for share, code in zip(shares, codes) for video in share}
    bad = 0
    for video in videos:
        told = summaries.get(str(video))
        if told:
            summary = told.pop(0)
        else:  # its job ended without its summary: it could not start, or it died
            summary = {"type": "summary", "video": str(video), "ok": False,
                       "error": (f"{video}: not analysed: its job ended with exit status "
                                 f"{status_of[video]} (its errors above); run the same command "
                                 "again to resume")}
            print(f"facecast: {summary['error']}", file=sys.stderr)
        bad += not summary["ok"]
        if args.json:
            print(json.dumps(summary), flush=True)
        elif not args.quiet and "error" not in summary:
            print(_summary_line(summary))
    if 2 in codes:
        return 2
    return 1 if bad or any(code not in (0, 1) for code in codes) else 0


def _wait_for(jobs: list[_Job]) -> list[int]:
    """Their exit statuses; a second interrupt while they save their resume points stops them
    at once (SIGKILL: each file then resumes from its resume point before)."""
    try:
        return [job.wait() for job in jobs]
    except KeyboardInterrupt:
        for job in jobs:
            if job.process.poll() is None:
                job.process.kill()
        return [job.wait() for job in jobs]


def raise_interrupt(signum, frame) -> None:
    """A SIGTERM handler: the signal is an interrupt (each file saves its resume point)."""
    raise KeyboardInterrupt
