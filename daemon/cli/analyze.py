"""`facecast analyze VIDEO... [--out DIR]` (CLI side): recorded video through the live face
stack, every frame, into a table per video (README "Analysing recorded video").

This module parses the command, builds the analyzer (facecast.daemon.cli.video_analysis, which does
the work in this same process) and shows progress: tqdm bars per file and overall, nothing with
`--quiet`, one JSON object per line with `--json`. Runs alone or beside a running daemon (its
own process and models).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path

import cv2

log = logging.getLogger(__name__)

JSON_PROGRESS_EVERY_S = 1.0


def add_arguments(parser) -> None:
    parser.add_argument("videos", nargs="+", metavar="VIDEO",
                        help="video files (MKV, MP4, anything FFmpeg decodes); facecast's own "
                        "recordings also get each frame's capture time from their sidecar")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where the tables go (default: next to each video): "
                        "<name>.faces.csv, <name>.faces.parquet (see --format), "
                        "<name>.faces.json (the summary) and <name>.faces.progress.json (what a "
                        "re-run resumes from, or skips)")
    parser.add_argument("--format", choices=("auto", "csv", "both"), default="auto",
                        help="the tables written: the CSV always (it is what a re-run resumes); "
                        "'both' adds <name>.faces.parquet, made from the CSV when the file is "
                        "finished, and needs pyarrow (pip install 'facecast[analyze]'); 'auto' "
                        "(default) adds it when pyarrow is installed; 'csv': the CSV only")
    parser.add_argument("--config", default=None,
                        help="the daemon's config file, for its models (face_landmarker.task), "
                        "output.max_faces and daemon.detect_interval_s (default: "
                        "$FACECAST_CONFIG, else /etc/facecast/facecast.toml if it exists, else "
                        "the defaults)")
    parser.add_argument("--landmarks", action="store_true",
                        help="add the 478 landmarks (1,434 columns, as the Face streams with "
                        "output.landmarks)")
    parser.add_argument("--pose", action="store_true",
                        help="body pose too: <name>.pose.csv, one row per frame with the most "
                        "present body's 33 markers (world landmarks in meters, visibility), the "
                        "MoCap stream's channels")
    parser.add_argument("--participants", action="store_true",
                        help="name the faces as live, by face embeddings matched to the gallery "
                        "(`facecast enroll`; the config's participants.gallery, match_distance "
                        "and embed_interval_s): columns participant and identity_confidence")
    parser.add_argument("--device", default="auto",
                        help="where the face stack runs: auto (default: the first CUDA GPU torch "
                        "sees, else the CPU), cpu, cuda or cuda:N")
    parser.add_argument("--decode", choices=("auto", "gpu", "cpu"), default="auto",
                        help="who decodes the files: auto (default) and gpu: NVDEC on the stack's "
                        "GPU for H.264/H.265 (frames stay on the GPU), PyAV on the CPU where "
                        "NVDEC cannot (no GPU stack, pynvvideocodec missing, another codec, a "
                        "failure mid-file: the rest of that file), the reason said once; cpu: "
                        "PyAV always")
    parser.add_argument("--jobs", default="auto", metavar="N",
                        help="analysing processes, each with its own models and a share of the "
                        "files (Note [Jobs]): auto (default) is one per 8 files, at most 4, with "
                        "the stack on a GPU, and one on the CPU; a number to choose")
    parser.add_argument("--threads", default="auto", metavar="N",
                        help="threads of each job's models with the stack on the CPU (Note "
                        "[Threads of the models]): auto (default) deals the cores this process "
                        "may run on among the jobs, at most 8 a job; a number to choose (1 on "
                        "a machine that other work keeps busy); no effect on a GPU")
    parser.add_argument("--restart", action="store_true",
                        help="analyse every file from its start, even where an earlier run "
                        "finished or stopped part-way (default: resume it, or skip a finished one)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--quiet", action="store_true",
                       help="no progress and no summary on the terminal (errors still show)")
    shown.add_argument("--json", action="store_true",
                       help="progress and summaries as JSON, one object per line, on stdout: "
                       "{\"type\": \"start\"} per file as its work starts (frame: where, "
                       "complete: nothing left to do), \"progress\" as it goes, \"summary\" "
                       "at the end")


def main(args) -> int:
    from facecast.daemon.cli.run import config_path
    from facecast.shared import config as config_mod
    from facecast.daemon.cli import video_analysis
    from facecast.workers.base import BootError

    path = config_path(args.config)
    try:
        # Cameras are the daemon's: a file of the analysis' tables alone will do.
        loaded = config_mod.load(path, cameras_required=False) if path is not None else None
    except config_mod.ConfigError as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        return 2
    # Without a config file, the defaults.
    config = video_analysis.StackConfig.of(loaded)
    parquet = _parquet_wanted(args.format, quiet=args.quiet)
    if parquet is None:
        return 2
    settings = video_analysis.Settings(landmarks=args.landmarks,
                                       detect_interval_s=config.daemon.detect_interval_s,
                                       parquet=parquet, pose=args.pose,
                                       participants=args.participants, decode=args.decode)
    import torch

    # Note [One thread on the CPU]
    #     Measured on the 2-core machine while other work kept it busy (load average 7-8),
    #     640x360, two faces: 16 frames/s (47 ms of CPU a frame) with one torch thread, 1.2
    #     frames/s (450 ms) with two: the threads wait on each other at every small kernel.
    #     FFmpeg decodes on its own threads; a second file's process is the better use of
    #     another core.
    # Note [Threads of the models]
    #     The models on the CPU are LiteRT's (Note [LiteRT on the CPU]), whose XNNPACK splits
    #     each convolution among its threads without torch's wait at every small kernel. So a
    #     job's models get the cores left to it (`--threads auto`: the cores this process may
    #     run on, dealt among the jobs) while torch keeps its one thread. Measured on the
    #     2-core machine (2026-11-27, 720p H.264 of 120 frames, one face, decoded ahead on its
    #     own thread; a process of each taking turns three times, four runs each): one thread
    #     110-142 frames/s (median 128), two 136-156 (151, +18 %); with one busy process beside
    #     them 110-132 against 94-130, with two 61-77 against 67-95: no worse than one thread
    #     within the noise, where torch's second thread had cut the rate to a tenth.
    torch.set_num_threads(1)
    # Note [One thread for OpenCV]
    #     OpenCV splits a warp or a colour conversion among its own threads, one per core by
    #     default: on the CPU stack the crops of Note [Crops on the CPU] and the detectors'
    #     inputs. With the models' XNNPACK threads and the decoding thread already on every
    #     core, each crop then waited for threads that were not running. Measured on the
    #     2-core machine (2026-11-27, H.264 of 120 frames decoded ahead, a process taking turns
    #     between one OpenCV thread and two, four runs each, two processes): one face at 720p
    #     144.6-145.5 -> 163.2-163.4 frames/s (median; 11.1 -> 9.7 ms of CPU a frame), at
    #     1080p 135.5 -> 149.3 (12.0 -> 11.1 ms); four faces at 720p 70.7 -> 69.9 (the same
    #     within the noise).
    cv2.setNumThreads(1)
    try:
        if args.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(args.device)
    except RuntimeError:
        print(f"facecast: --device {args.device}: not a device (allowed: auto, cpu, cuda, "
              "cuda:N)", file=sys.stderr)
        return 2
    if device.type not in ("cpu", "cuda") or (device.type == "cuda"
                                              and not torch.cuda.is_available()):
        print(f"facecast: --device {args.device}: "
              + ("torch sees no CUDA device" if device.type == "cuda" else "not cpu or cuda"),
              file=sys.stderr)
        return 2
    from facecast.daemon.cli import analysis_jobs

    videos = [Path(video) for video in args.videos]
    try:
        jobs = analysis_jobs.job_count(analysis_jobs.parse_jobs(args.jobs),
                                       on_gpu=device.type == "cuda", files=len(videos))
        threads = analysis_jobs.model_threads(analysis_jobs.parse_threads(args.threads), jobs)
    except ValueError as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        return 2
    if jobs > 1:
        return analysis_jobs.run(args, videos, jobs, parquet, threads)
    try:
        analyzer = video_analysis.build_analyzer(
            config, device, settings, cpu_threads=threads if device.type == "cpu" else None)
    except BootError as exc:
        print(f"facecast: cannot load the models: {exc}", file=sys.stderr)
        return 2
    except video_analysis.SetupError as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else None
    files = analyzer.open(videos, out_dir, restart=args.restart)
    for item in files:
        if item.problem:
            print(f"facecast: {item.problem}", file=sys.stderr)
        elif args.json:
            print(json.dumps({"type": "start", "video": str(item.video),
                              "table": str(item.table_path), "frame": item.next_frame,
                              "frames_total": item.total_frames or None,
                              "complete": item.already_complete}), flush=True)
        elif item.already_complete and not args.quiet and not args.json:
            print(f"{item.video}: already analysed ({item.table_path}); --restart to do it again")
        elif item.resumed_from_frame and not args.quiet and not args.json:
            print(f"{item.video}: resuming at frame {item.resumed_from_frame}")
    working = any(not item.problem and not item.done for item in files)
    decoders = _DecoderNotices(analyzer, args.decode, quiet=args.quiet)
    decoders.say_run()
    shown = _JsonProgress(files) if args.json else (
        None if args.quiet or not working else _Bars(files))

    def on_progress(item) -> None:
        decoders(item)
        if shown is not None:
            shown(item)

    # A SIGTERM is an interrupt too, as in a command of several jobs (analysis_jobs.run): it
    # is how that command passes an interrupt on to this process as its job.
    previous_term = signal.signal(signal.SIGTERM, analysis_jobs.raise_interrupt)
    try:
        analyzer.run(files, on_progress=on_progress)
    except KeyboardInterrupt:
        if shown is not None:
            shown.close()
        print("facecast: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if shown is not None:
        shown.close()
    bad = 0
    for item in files:
        summary = analyzer.summary(item)
        bad += not summary["ok"]
        if args.json:
            print(json.dumps({"type": "summary", **summary}), flush=True)
        elif not args.quiet and not item.problem:
            print(_summary_line(summary))
    return 1 if bad else 0


def _parquet_wanted(table_format: str, quiet: bool) -> bool | None:
    """Whether to write Parquet tables too; None (said on stderr) when --format both cannot be
    done here."""
    if table_format == "csv":
        return False
    from facecast.daemon.cli.analysis_parquet import pyarrow_problem

    problem = pyarrow_problem()
    if problem and table_format == "both":
        print(f"facecast: --format both: {problem}", file=sys.stderr)
        return None
    if problem and not quiet:
        print(f"facecast: writing CSV tables only: {problem} (--format csv: without this notice)",
              file=sys.stderr)
    return not problem


def _summary_line(summary: dict) -> str:
    rate = summary["frames_per_s"]
    line = (f"{summary['video']}: {summary['frames']} frames, {summary['frames_measured']} "
            f"measured, {summary['faces']} faces in {summary['frames_with_faces']} frames; "
            f"{summary['seconds']:.1f} s" + (f" ({rate:.1f} frames/s)" if rate else "")
            + f" -> {summary['table']}"
            + (f" and {Path(summary['parquet']).name}" if summary.get("parquet") else "")
            + (f", {Path(summary['pose_table']).name}" if summary.get("pose_table") else ""))
    if summary.get("parquet_problem"):
        line += f"\n  no Parquet table: {summary['parquet_problem']}"
    if summary["frames_unreadable"]:
        line += (f"\n  {summary['frames_unreadable']} frame(s) unreadable or missing (rows with "
                 f"the reason in `problem`), first: {summary['problems'][0]}")
    if summary["frames_concealed"]:
        line += (f"\n  {summary['frames_concealed']} frame(s) decoded with errors concealed "
                 "(measured; `problem` says so)")
    return line


class _DecoderNotices:
    """Note [Analysis on NVDEC]: why files are decoded on the CPU, on stderr, once: the run's
    reason (the GPU asked for and not usable here) before the work, a file's when it is seen
    (its codec at open, a failure mid-file when it happens). Said where the GPU decoder could
    have been expected: `--decode gpu`, or auto with the stack on a GPU."""

    def __init__(self, analyzer, requested: str, quiet: bool) -> None:
        import torch

        self.analyzer = analyzer
        self.quiet = quiet
        on_gpu = torch.device(analyzer.pipeline.device).type == "cuda"
        self.wanted = requested == "gpu" or (requested == "auto" and on_gpu)
        self._said: dict[int, int] = {}

    def say_run(self) -> None:
        problem = self.analyzer.gpu_decode_problem
        if self.wanted and problem and not self.quiet:
            print(f"facecast: decoding on the CPU (PyAV): --decode {self.analyzer.settings.decode}"
                  f", but {problem}", file=sys.stderr, flush=True)

    def __call__(self, item) -> None:
        events = getattr(item.decoder, "events", None)
        if not events:
            return
        said = self._said.get(id(item), 0)
        if said == 0:
            said = 1  # the first: said here only when the GPU was tried and refused the file
            first = events[0]
            if (self.wanted and self.analyzer.gpu_decode_problem is None
                    and first.decoder.startswith("PyAV") and not self.quiet):
                print(f"facecast: {item.video}: decoding on the CPU (PyAV): {first.reason}",
                      file=sys.stderr, flush=True)
        for event in events[said:]:
            if not self.quiet:
                print(f"facecast: {item.video}: {event.decoder} decodes from frame "
                      f"{event.at_frame} on: {event.reason}", file=sys.stderr, flush=True)
            said += 1
        self._said[id(item)] = said


class _Bars:
    """tqdm bars: the whole job, then one per file (frames/s and time left in each). Fed by
    this process's files (`__call__`) or by the JSON progress of jobs (`start`, `report`: Note
    [Jobs])."""

    def __init__(self, files) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._done: dict = {}
        self.bars: dict = {}
        self.overall = None  # with the first file that has work left
        for item in files:
            if not item.problem and not item.done:
                self.start(id(item), item.video.name, item.total_frames, item.next_frame)

    def start(self, key, name: str, total_frames: int, from_frame: int) -> None:
        """A file's bar, from where its work starts (a resume point)."""
        if self.overall is None:
            self.overall = self._tqdm(total=None, unit="frame", desc="all files", position=0,
                                      dynamic_ncols=True)
        self._done[key] = from_frame
        self.bars[key] = self._tqdm(total=total_frames or None, unit="frame", desc=name,
                                    position=len(self.bars) + 1, leave=True, initial=from_frame,
                                    dynamic_ncols=True)
        if total_frames:
            self.overall.total = (self.overall.total or 0) + total_frames
        # Frames done before this run: in the count, not in the rate.
        self.overall.n += from_frame
        self.overall.last_print_n += from_frame
        self.overall.refresh()

    def __call__(self, item) -> None:
        self._advance(id(item), item.next_frame)

    def report(self, message: dict) -> None:
        """A job's `{"type": "start" | "progress", ...}` line."""
        if message["type"] == "start":
            if message["complete"]:
                self.write(f"{message['video']}: already analysed ({message['table']}); "
                           "--restart to do it again")
                return
            if message["frame"]:
                self.write(f"{message['video']}: resuming at frame {message['frame']}")
            self.start(message["video"], Path(message["video"]).name,
                       message["frames_total"] or 0, message["frame"])
        elif message["type"] == "progress" and message["video"] in self.bars:
            self._advance(message["video"], message["frame"])

    def _advance(self, key, frame: int) -> None:
        step = frame - self._done[key]
        self._done[key] = frame
        if step:
            self.bars[key].update(step)
            self.overall.update(step)

    def write(self, text: str) -> None:
        self._tqdm.write(text)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        if self.overall is not None:
            self.overall.close()


class _JsonProgress:
    """`{"type": "progress", ...}` per file at most every JSON_PROGRESS_EVERY_S, and when it
    ends."""

    def __init__(self, files) -> None:
        self._said_monotonic: dict[int, float] = {}
        self._first = {id(item): (item.next_frame, time.monotonic()) for item in files}

    def __call__(self, item) -> None:
        now = time.monotonic()
        if not item.done and now - self._said_monotonic.get(id(item), 0.0) < JSON_PROGRESS_EVERY_S:
            return
        self._said_monotonic[id(item)] = now
        first_frame, first_monotonic = self._first[id(item)]
        elapsed = now - first_monotonic
        rate = (item.next_frame - first_frame) / elapsed if elapsed > 0 else 0.0
        left = max(0, item.total_frames - item.next_frame) if item.total_frames else None
        print(json.dumps({
            "type": "progress", "video": str(item.video), "frame": item.next_frame,
            "frames_total": item.total_frames or None, "faces": item.counts.faces,
            "frames_per_s": round(rate, 2),
            "seconds_left": round(left / rate, 1) if left is not None and rate > 0 else None,
            "done": item.done}), flush=True)

    def close(self) -> None:
        pass
