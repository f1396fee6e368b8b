"""Faces on real footage: the face stack alone, and the whole daemon, against the CPU stack.

    python bench/real_footage.py VIDEO [VIDEO ...] [--daemon-s 20] [--variants ...]
                                 [--out real-footage.json]

Synthetic scenes (small photos pasted on a plain background) hid that the daemon's CUDA path lost
faces on real video (issue 24, item 0). This bench plays real video files:

1. **stack**: every frame of each file through `FacePipeline.track` (one camera, detection inside
   the pipeline, as `facecast analyze` and the tests do), on the CPU and on CUDA in every variant
   (eager and graphs, fp32 and fp16): frames with a face, and each frame's landmarks against the
   CPU's on the same frame (median and max of the per-frame median distance, in pixels).
2. **daemon**: each file as a looped file camera of the real daemon (`facecast run`), per variant
   (transport, graphs, fp16, models on the CPU), read by real pylsl inlets for `--daemon-s`
   seconds after the streams appear: share of published frames with a face, frames published per
   second against the file's rate.

Prints a table and writes JSON (machine, GPU, date, each row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

import pipeline as daemon_bench  # bench/pipeline.py: the daemon under test, Face stream reader

REPO = Path(__file__).resolve().parent.parent

STACK_VARIANTS = {  # name: (device, half, cuda_graphs)
    "cpu": ("cpu", False, False),
    "cuda-eager-fp32": ("cuda", False, False),
    "cuda-graphs-fp32": ("cuda", False, True),
    "cuda-eager-fp16": ("cuda", True, False),
    "cuda-graphs-fp16": ("cuda", True, True),
}
DAEMON_VARIANTS = {  # name: config lines of [daemon] and [models]
    "cuda_ipc-graphs": ('transport = "cuda_ipc"', "cuda_graphs = true"),
    "cuda_ipc-eager": ('transport = "cuda_ipc"', "cuda_graphs = false"),
    "shm-graphs": ('transport = "shm"', "cuda_graphs = true"),
    "shm-eager": ('transport = "shm"', "cuda_graphs = false"),
    "cuda_ipc-graphs-fp16": ('transport = "cuda_ipc"', "cuda_graphs = true\nhalf = true"),
    "cpu-models": ('transport = "shm"', 'device = "cpu"'),
}


def read_video(path: Path) -> tuple[list[np.ndarray], float]:
    import cv2

    capture = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    if not capture.isOpened():
        raise SystemExit(f"cannot open {path}")
    fps = capture.get(cv2.CAP_PROP_FPS)
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(frame)
    capture.release()
    return frames, fps


def stack_row(frames: list[np.ndarray], variant: str, reference: list | None) -> dict:
    import torch

    from facecast.models import assets, tflite_convert
    from facecast.models.pipeline import FacePipeline

    device, half, graphs = STACK_VARIANTS[variant]
    if device == "cuda" and not torch.cuda.is_available():
        return {"variant": variant, "skipped": "no CUDA device"}
    pipeline = FacePipeline(device=device, max_faces=2, half=half, cuda_graphs=graphs,
                            face_landmarker_task=assets.landmarker_bundle(None).path,
                            load_model=lambda name: tflite_convert.convert(assets.model_path(name)))
    height, width = frames[0].shape[:2]
    pipeline.warm_up([(height, width)], max_frames=1, max_faces=2)
    per_frame = []
    started = time.perf_counter()
    for frame in frames:
        faces = pipeline.track([frame], ["video"])[0]
        per_frame.append(faces[0].landmarks[:, :2].copy() if faces else None)
    elapsed_s = time.perf_counter() - started
    row = {"variant": variant, "frames": len(frames),
           "frames_with_face": sum(lm is not None for lm in per_frame),
           "fps": round(len(frames) / elapsed_s, 1)}
    if reference is not None:
        distances = [float(np.median(np.linalg.norm(lm - ref, axis=1)))
                     for lm, ref in zip(per_frame, reference) if lm is not None and ref is not None]
        both = sum(lm is not None and ref is not None for lm, ref in zip(per_frame, reference))
        row.update({"frames_with_face_on_both": both,
                    "landmark_px_median": round(float(np.median(distances)), 4) if distances else None,
                    "landmark_px_max": round(float(np.max(distances)), 4) if distances else None})
    row["_landmarks"] = per_frame
    return row


def daemon_config(video: Path, variant: str, runtime_dir: Path, host: str, cameras: int) -> str:
    daemon_line, models_line = DAEMON_VARIANTS[variant]
    lines = ["[daemon]", f'runtime_dir = "{runtime_dir}"', daemon_line, f'host_name = "{host}"',
             'log_level = "info"', "", "[models]", models_line, "", "[output]", "max_faces = 2",
             "", "[web]", "enabled = false", ""]
    for k in range(cameras):
        lines += ["[[cameras]]", f'id = "cam{k:02d}"', f'source = "{video}"', ""]
    return "\n".join(lines)


def daemon_row(video: Path, variant: str, seconds: float, cameras: int, log_dir: Path,
               file_fps: float) -> dict:
    host = f"rf{uuid.uuid4().hex[:8]}"
    log_path = log_dir / f"daemon-{video.stem}-{variant}-{cameras}.log"
    row = {"variant": variant, "video": video.name, "cameras": cameras, "log": str(log_path)}
    with tempfile.TemporaryDirectory(prefix="fcrf-") as tmp:
        tmp = Path(tmp)
        daemon = daemon_bench.DaemonUnderTest(
            tmp, daemon_config(video.resolve(), variant, tmp / "run", host, cameras), log_path)
        try:
            if not daemon.wait_ready(180):
                row["error"] = "not ready: " + daemon.log_tail()
                return row
            row["boot_to_ready_s"] = daemon.boot["boot_to_ready_s"]
            reader = daemon_bench.FaceStreamReader(host, cameras * 2, timeout_s=60.0)
            try:
                time.sleep(seconds)
            finally:
                reader.close()
            status = daemon.status()
            row["stages"] = {name: {"p50_ms": t.p50_ms, "p99_ms": t.p99_ms}
                             for name, t in status.stages.items()}
        finally:
            daemon.stop(10)
    per_camera = []
    for camera, (stamps, boxes, _) in reader.by_camera().items():
        frame_ts, inverse = np.unique(stamps, return_inverse=True)
        has_face = np.zeros(len(frame_ts), bool)
        np.logical_or.at(has_face, inverse, np.isfinite(boxes).all(axis=1))
        span_s = float(frame_ts[-1] - frame_ts[0]) if len(frame_ts) > 1 else math.nan
        per_camera.append({"camera": camera, "published": len(frame_ts),
                           "with_face_pct": round(100 * has_face.mean(), 1) if len(has_face) else None,
                           "published_fps": round((len(frame_ts) - 1) / span_s, 1) if span_s > 0 else None,
                           "file_fps": round(file_fps, 2)})
    row["per_camera"] = per_camera
    shares = [c["with_face_pct"] for c in per_camera if c["with_face_pct"] is not None]
    row["with_face_pct_min"] = min(shares) if shares else None
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("videos", nargs="+", type=Path)
    parser.add_argument("--stack-variants", nargs="*", default=list(STACK_VARIANTS))
    parser.add_argument("--daemon-variants", nargs="*", default=list(DAEMON_VARIANTS))
    parser.add_argument("--daemon-s", type=float, default=20.0)
    parser.add_argument("--cameras", type=int, nargs="*", default=[1])
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "real-footage")
    parser.add_argument("--out", type=Path, default=Path("real-footage.json"))
    args = parser.parse_args()
    daemon_bench.use_loopback_lsl()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.date.today().isoformat(), "machine": daemon_bench.machine(),
              "stack": [], "daemon": []}
    for video in args.videos:
        frames, fps = read_video(video)
        reference = None
        for variant in args.stack_variants:
            row = stack_row(frames, variant, reference)
            landmarks = row.pop("_landmarks", None)
            if variant == "cpu":
                reference = landmarks
            row["video"] = video.name
            result["stack"].append(row)
            print(json.dumps(row), flush=True)
        for variant in args.daemon_variants:
            for cameras in args.cameras:
                row = daemon_row(video, variant, args.daemon_s, cameras, args.log_dir, fps)
                result["daemon"].append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
