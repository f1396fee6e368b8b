"""`facecast analyze` throughput (issue 23 item 5): frames/s end to end, decoding included, of
H.264 files made from the synthetic scene, against LiteRT running MediaPipe's FaceLandmarker
models on the same decoded frames, in the same run.

    python3 bench/analyze.py                       # CPU: 720p and 1080p, one and four faces
    python3 bench/analyze.py --device cuda         # the GPU machine (the stack on the GPU)
    python3 bench/analyze.py --frames 60 --repeats 1 --docs ''   # a quick look, docs untouched

What is measured
----------------
*Footage*: per size (1280x720, 1920x1080) and face count (1, 4) an H.264 file of `--frames`
frames at 30 fps, encoded as facecast's encoded synthetic source encodes (Note [Encoded
synthetic loop]: `EncodedSyntheticLoop`, libx264 superfast CRF 20, no B-frames, an IDR frame a
second; MP4) from `SyntheticScene`, whose ground truth gives every frame's faces. The scene has
two seats: one face is a staged scene with one person; four faces are two scenes of half the
width side by side (about 240 px faces at 1080p, 160 px at 720p; one face: 420 / 280 px).
The files are made once in `--work` and reused.

*facecast*: `facecast analyze`'s work in this process: `video_analysis.Analyzer` (decoding as
*Decoder* says, the daemon's FacePipeline with face_landmarker.task: detection on the live schedule,
tracking, the 478-point mesh, blendshapes, head pose and translation, track ids, the CSV table),
`output.max_faces` = the file's face count (the baseline's `num_faces`: like with like, see
*LiteRT*), one torch thread on the CPU and one OpenCV thread as the command sets
them (Note [One thread for OpenCV]: the baseline keeps OpenCV's default; Note [One thread on
the CPU]) and the LiteRT models on `--model-threads` (default: the command's `--threads auto` for
one job, the cores this process may run on, at most 8: Note [Threads of the models]). Timed from opening the file to its summary; model loading is not included (once per
command). frames/s = frames / wall seconds; CPU ms/frame = process CPU time (every thread:
FFmpeg's too) / frames.

*LiteRT* (`ai-edge-litert`, XNNPACK, `--litert-threads`): MediaPipe's FaceLandmarker as its
graph runs in VIDEO mode, on the frames of the same file decoded by the same decoder class
(PyAvDecoder, BGR): RGB conversion; the bundle's face detector (BlazeFace short range, 128x128
letterbox, anchors decoded and NMS in numpy) only while fewer faces are tracked than there are
(MediaPipe's gate, with `num_faces` = the file's face count, the setting that favours it most;
facecast gets the same limit, and skips its searches for newcomers while every slot is followed
as this gate does: Note [No search where no face could go], models/face_tracking.py);
per face a 256x256 crop of the rotated ROI (`cv2.warpAffine`, MediaPipe's ImageToTensor), the
landmarks detector, landmarks projected to the frame, the blendshape model on 146 of them, and
the next frame's ROI from the landmarks (bounding box, eye-corner rotation, square, x1.5). No
head pose, no table: less work than facecast does per face. A face the short-range detector
misses (it letterboxes the whole frame to 128x128, where small faces are lost) would be started
from the ground truth box instead, so that both sides measure every face; the JSON counts those
(`seeded_from_truth`: none in the run of docs/benchmarks.md, where one detector call per file
found every face).

*Decoder*: `--decode` as the command's (Note [Analysis on NVDEC]): with `--device cuda` and
the default `auto`, NVDEC decodes the files and its frames stay on the GPU; on the CPU, PyAV.
The table names the decoder facecast's runs got (`decoder`: a fallback to PyAV, with its
reason, shows there and in the JSON's `decoder_changes`). LiteRT's frames are PyAV's always
(numpy arrays on the CPU).

*The command, `--jobs N`* (`--jobs`): `facecast analyze --jobs N --json --format csv` run as a
process over the same `--files-at-once` copies (Note [Jobs]: N processes, each with its own
models and a share of the files). `frames_per_s` = all frames / the command's wall time, its
start-up included (imports, models, the first batches' CUDA graphs and cuDNN choices, in every
job); `steady_frames_per_s` = the frames the files advanced, by their JSON progress, between the
moment every file had reported progress and the moment the first file was done, over that
time: the rate once every job is working, the in-process row's definition (warm, no model
loading). Each N is run once per repeat, with the same check of the faces against the truth.

*Decode only*: facecast's decoder with nothing else, for reference (NVDEC's frames converted
to BGR on the GPU, waited for at the end).

Every file is run `--repeats` times, facecast and LiteRT alternating, and the table gives the
median of the repeats (the JSON keeps every sample): the 2-core machine is shared with other
work, so single runs vary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from docs_section import replace_section  # bench/docs_section.py (this folder is on sys.path)

REPO = Path(__file__).resolve().parent.parent
SECTION_TITLE = "## `facecast analyze` (`bench/analyze.py`)"
FPS = 30.0
FOOTAGE = ((1280, 720, 1), (1280, 720, 4), (1920, 1080, 1), (1920, 1080, 4))
GPU_GOAL_FRAMES_PER_S = 1000.0  # one H100/H200, 1080p H.264, one face (issue 23)


# -- footage -------------------------------------------------------------------------------------


class SideBySide:
    """Two synthetic scenes of half the width side by side: four faces (the scene has two
    seats). Duck-types what SyntheticReplay and EncodedSyntheticLoop use of a SyntheticScene."""

    def __init__(self, width: int, height: int, seed: str) -> None:
        from facecast.workers.capture.sources import SyntheticScene

        self.width, self.height = width, height
        self.halves = (SyntheticScene(width // 2, height, seed=f"{seed}-left"),
                       SyntheticScene(width - width // 2, height, seed=f"{seed}-right"))

    def render(self, t_s: float) -> np.ndarray:
        return np.ascontiguousarray(np.hstack([half.render(t_s) for half in self.halves]))

    def faces_at(self, t_s: float):
        from facecast.workers.capture.sources import FaceTruth

        left, right = self.halves
        shift_px = left.width
        return left.faces_at(t_s) + [
            FaceTruth(f.name + "-right", (f.box_px[0] + shift_px, f.box_px[1],
                                          f.box_px[2] + shift_px, f.box_px[3]))
            for f in right.faces_at(t_s)]


def make_scene(width: int, height: int, faces: int):
    from facecast.shared.config import StagedAppearance, StagingConfig
    from facecast.workers.capture.sources import SyntheticScene

    if faces == 1:
        staging = StagingConfig(cycle_s=86400.0, appearances=[
            StagedAppearance(photo="astronaut", seat=0, from_s=0.0, until_s=86400.0)])
        return SyntheticScene(width, height, seed="bench-analyze", staging=staging)
    if faces == 2:
        return SyntheticScene(width, height, seed="bench-analyze")
    if faces == 4:
        return SideBySide(width, height, seed="bench-analyze")
    raise ValueError(f"footage with {faces} faces: the scene makes 1, 2 or 4")


@dataclass
class Footage:
    path: Path
    width: int
    height: int
    faces: int
    frames: int
    truth: list  # per file frame: the FaceTruth list

    @property
    def name(self) -> str:
        return f"{self.height}p, {self.faces} face{'s' if self.faces > 1 else ''}"


def make_footage(work: Path, width: int, height: int, faces: int, frames: int) -> Footage:
    """An H.264 MP4 of `frames` frames (a round trip of the replayed loop, Note [Encoded
    synthetic loop]), made once, and every frame's truth."""
    from facecast.workers.capture.sources import EncodedSyntheticLoop, SyntheticReplay

    if frames < 4 or frames % 2:
        raise ValueError(f"--frames must be even and at least 4 (a round trip), got {frames}")
    replay = SyntheticReplay(make_scene(width, height, faces), FPS, loop_frames=frames // 2 + 1)
    path = work / f"synthetic_{width}x{height}_{faces}face_{frames}f.mp4"
    if not path.is_file():
        work.mkdir(parents=True, exist_ok=True)
        with EncodedSyntheticLoop(replay, "h264", name=path.stem) as loop:
            partial = path.with_suffix(".part")
            shutil.copyfile(loop.path, partial)
            partial.rename(path)
    truth = [replay.scene.faces_at(replay.loop_index_of_position(p) / FPS)
             for p in range(replay.cycle_frames)]
    return Footage(path, width, height, faces, replay.cycle_frames, truth)


# -- the two sides ---------------------------------------------------------------------------------


def cpu_s() -> float:
    return time.process_time()


def decode_only(footage: Footage, analyzer) -> dict:
    """The file through the decoder `analyzer` gives it (NVDEC or PyAV), nothing else."""
    import torch

    from facecast.daemon.cli import analysis_decoding

    device = torch.device(analyzer.pipeline.device)
    wall0, cpu0 = time.perf_counter(), cpu_s()
    decoder = analysis_decoding.open_decoder(footage.path, analyzer.settings.decode,
                                             analyzer.gpu_decode_problem, device)
    count = sum(1 for frame in decoder.frames() if frame.image is not None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    decoder.close()
    return {**_rates(count, time.perf_counter() - wall0, cpu_s() - cpu0),
            "decoder": decoder.describe(),
            "decoder_changes": [vars(event) for event in decoder.events]}


def _rates(frames: int, wall_s: float, cpu_used_s: float) -> dict:
    return {"frames": frames, "wall_s": round(wall_s, 3), "cpu_s": round(cpu_used_s, 3),
            "frames_per_s": round(frames / wall_s, 2),
            "cpu_ms_per_frame": round(1e3 * cpu_used_s / frames, 2)}


def copies(footage: Footage, count: int) -> list[Path]:
    """The file, and count - 1 links to it under other names (each file gets its own table)."""
    paths = [footage.path]
    for index in range(1, count):
        link = footage.path.with_name(f"{footage.path.stem}_copy{index}{footage.path.suffix}")
        if not link.exists():
            os.link(footage.path, link)
        paths.append(link)
    return paths


def run_facecast(analyzer, footage: Footage, out_dir: Path, files_at_once: int = 1) -> dict:
    """The file (`files_at_once` copies of it, batched as the command batches files) through
    `facecast analyze`'s Analyzer, from its start; the faces checked against the truth. With one
    OpenCV thread, as the command sets it (Note [One thread for OpenCV], daemon/cli/analyze.py);
    the LiteRT baseline keeps OpenCV's default, as before."""
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        return _run_facecast(analyzer, footage, out_dir, files_at_once)
    finally:
        cv2.setNumThreads(threads)


def _run_facecast(analyzer, footage: Footage, out_dir: Path, files_at_once: int) -> dict:
    paths = copies(footage, files_at_once)
    wall0, cpu0 = time.perf_counter(), cpu_s()
    files = analyzer.open(paths, out_dir, restart=True)
    for item in files:
        if item.problem:
            raise RuntimeError(item.problem)
    analyzer.run(files)
    wall_s, cpu_used_s = time.perf_counter() - wall0, cpu_s() - cpu0
    faces = 0
    decoders, changes = [], []
    for item in files:
        summary = analyzer.summary(item)
        decoders.append(summary["decoder"])
        changes.append(summary["decoder_changes"])
        if summary["frames_measured"] != footage.frames:
            raise RuntimeError(f"{item.video}: {summary['frames_measured']} frames measured of "
                               f"{footage.frames}: {summary['problems'][:3]}")
        faces += summary["faces"]
    return {**_rates(footage.frames * len(files), wall_s, cpu_used_s), "files": len(files),
            "faces": faces, "faces_on_truth": _faces_on_truth([f.table_path for f in files], footage),
            "faces_true": sum(map(len, footage.truth)) * len(files),
            "decoder": " / ".join(sorted(set(decoders))), "decoder_changes": changes}


def _faces_on_truth(tables: list[Path], footage: Footage) -> int:
    """Measured faces on the ground truth's, over every table (a run that measured nothing
    would be fast for nothing)."""
    import csv

    found = 0
    for table in tables:
        faces_by_frame: dict[int, list] = {}
        with open(table, newline="") as handle:
            for row in csv.DictReader(handle):
                if row["track_id"]:
                    faces_by_frame.setdefault(int(row["frame"]), []).append(
                        tuple(float(row[k]) for k in ("box_x1", "box_y1", "box_x2", "box_y2")))
        found += sum(_matched(faces_by_frame.get(i, []), truth)
                     for i, truth in enumerate(footage.truth))
    return found


def run_command(args, footage: Footage, out_dir: Path, jobs: int) -> dict:
    """`facecast analyze --jobs N` as a process over the `--files-at-once` copies: end to end
    and steady rates (the module's docstring)."""
    import subprocess

    paths = copies(footage, args.files_at_once)
    config = out_dir / f"max_faces_{footage.faces}.toml"  # the in-process runs' limit
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f"[output]\nmax_faces = {footage.faces}\n")
    command = [sys.executable, "-m", "facecast.daemon.cli", "analyze", "--json", "--format",
               "csv", "--restart", "--jobs", str(jobs), "--device", args.device, "--decode",
               args.decode, "--config", str(config), "--out", str(out_dir), *map(str, paths)]
    wall0 = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    frame_of: dict[str, int] = {}
    steady_from = steady_until = None
    summaries = []
    for line in process.stdout:
        message = json.loads(line)
        now = time.perf_counter()
        if message["type"] == "progress":
            frame_of[message["video"]] = message["frame"]
            if steady_from is None and len(frame_of) == len(paths):
                steady_from = (now, sum(frame_of.values()))
            if message["done"] and steady_until is None and steady_from is not None:
                steady_until = (now, sum(frame_of.values()))
        elif message["type"] == "summary":
            summaries.append(message)
    process.wait()
    wall_s = time.perf_counter() - wall0
    if process.returncode != 0 or len(summaries) != len(paths):
        raise RuntimeError(f"{shlex.join(command)}: exit {process.returncode}, "
                           f"{len(summaries)} summaries of {len(paths)}")
    for summary in summaries:
        if summary["frames_measured"] != footage.frames:
            raise RuntimeError(f"{summary['video']}: {summary['frames_measured']} frames "
                               f"measured of {footage.frames}: {summary['problems'][:3]}")
    steady = None
    if steady_from and steady_until and steady_until[0] > steady_from[0]:
        steady = round((steady_until[1] - steady_from[1]) / (steady_until[0] - steady_from[0]), 2)
    frames = footage.frames * len(paths)
    return {"jobs": jobs, "files": len(paths), "frames": frames, "wall_s": round(wall_s, 3),
            "frames_per_s": round(frames / wall_s, 2), "steady_frames_per_s": steady,
            "faces": sum(s["faces"] for s in summaries),
            "faces_on_truth": _faces_on_truth([Path(s["table"]) for s in summaries], footage),
            "faces_true": sum(map(len, footage.truth)) * len(paths),
            "decoder": " / ".join(sorted({s["decoder"] for s in summaries}))}


def _iou(a, b) -> float:
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _matched(boxes, truth, min_iou: float = 0.3) -> int:
    """How many true faces have a measured box overlapping them (the faces' own boxes differ
    by model: the detector's, the mesh's, the truth's)."""
    return sum(any(_iou(box, face.box_px) >= min_iou for box in boxes) for face in truth)


class LiteRTFaceLandmarker:
    """MediaPipe FaceLandmarker's models as its graph runs them in VIDEO mode, in LiteRT (the
    module docstring says what is and is not done)."""

    def __init__(self, bundle, threads: int, num_faces: int) -> None:
        from ai_edge_litert.interpreter import Interpreter

        from facecast.models.anchors import FACE_SHORT_RANGE, generate_anchors
        from facecast.models.blendshapes import LANDMARK_SUBSET

        def load(path):
            interpreter = Interpreter(model_path=str(path), num_threads=threads)
            interpreter.allocate_tensors()
            return (interpreter, interpreter.get_input_details()[0]["index"],
                    [d["index"] for d in interpreter.get_output_details()])

        self.detector = load(bundle.face_detector)
        self.landmarker = load(bundle.face_landmarks_detector)
        self.blendshapes = load(bundle.face_blendshapes)
        self.anchors = generate_anchors(FACE_SHORT_RANGE.anchors).numpy()
        self.subset = np.array(LANDMARK_SUBSET)
        self.num_faces = num_faces
        self.rects: list[tuple[float, float, float, float]] = []  # cx, cy, side, rotation
        self.detector_calls = 0
        self.seeded_from_truth = 0

    @staticmethod
    def _invoke(model, x: np.ndarray) -> list[np.ndarray]:
        interpreter, input_index, outputs = model
        interpreter.set_tensor(input_index, x)
        interpreter.invoke()
        return [interpreter.get_tensor(index) for index in outputs]

    def _detect(self, rgb: np.ndarray) -> list[tuple[float, float, float, float]]:
        """The short-range detector on the frame letterboxed to 128x128: ROIs (centre, side,
        rotation by the eyes), MediaPipe's face_detection_to_roi (x1.5, square)."""
        self.detector_calls += 1
        height, width = rgb.shape[:2]
        scale = 128.0 / max(width, height)
        w_px, h_px = round(width * scale), round(height * scale)
        canvas = np.zeros((128, 128, 3), np.float32)
        left, top = (128 - w_px) // 2, (128 - h_px) // 2
        canvas[top:top + h_px, left:left + w_px] = cv2.resize(
            rgb, (w_px, h_px), interpolation=cv2.INTER_AREA).astype(np.float32) / 127.5 - 1.0
        raw_boxes, raw_scores = self._invoke(self.detector, canvas[None])
        scores = 1.0 / (1.0 + np.exp(-np.clip(raw_scores[0, :, 0].astype(np.float64), -100, 100)))
        keep = np.flatnonzero(scores >= 0.5)
        found = []
        for index in keep[np.argsort(-scores[keep])]:
            raw = raw_boxes[0, index]
            cx, cy = raw[0] / 128 + self.anchors[index, 0], raw[1] / 128 + self.anchors[index, 1]
            w, h = raw[2] / 128, raw[3] / 128
            eyes = raw[4:8].reshape(2, 2) / 128 + self.anchors[index]
            # letterbox -> frame pixels
            to_px = lambda x, y: ((x * 128 - left) / scale, (y * 128 - top) / scale)  # noqa: E731
            box = (*to_px(cx - w / 2, cy - h / 2), *to_px(cx + w / 2, cy + h / 2))
            if any(_iou(box, other[0]) > 0.3 for other in found):
                continue  # NMS
            (ex1, ey1), (ex2, ey2) = to_px(*eyes[0]), to_px(*eyes[1])
            found.append((box, math.atan2(ey2 - ey1, ex2 - ex1)))
        return [((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, 1.5 * max(b[2] - b[0], b[3] - b[1]), rot)
                for b, rot in found[:self.num_faces]]

    def frame(self, bgr: np.ndarray, truth) -> list[tuple[np.ndarray, np.ndarray]]:
        """(landmarks (478, 3) px, blendshapes (52,)) per face of one frame."""
        rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        if len(self.rects) < self.num_faces:  # MediaPipe runs its detector only then
            rects = self._detect(rgb)
            for face in truth:  # the faces it missed, from the truth (module docstring)
                x1, y1, x2, y2 = face.box_px
                if not any(abs(r[0] - (x1 + x2) / 2) < (x2 - x1) / 2
                           and abs(r[1] - (y1 + y2) / 2) < (y2 - y1) / 2 for r in rects):
                    rects.append(((x1 + x2) / 2, (y1 + y2) / 2, 1.5 * max(x2 - x1, y2 - y1), 0.0))
                    self.seeded_from_truth += 1
            self.rects = rects[:self.num_faces]
        faces, next_rects = [], []
        for cx, cy, side, rotation in self.rects:
            cos, sin = math.cos(rotation), math.sin(rotation)
            unit = side / 256.0
            # output (u, v) -> image: centre + R * ((u/256 - 1/2) side, (v/256 - 1/2) side)
            to_image = np.array([[cos * unit, -sin * unit, cx - (cos - sin) * side / 2],
                                 [sin * unit, cos * unit, cy - (sin + cos) * side / 2]])
            crop = cv2.warpAffine(rgb, to_image, (256, 256),
                                  flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                                  borderMode=cv2.BORDER_REPLICATE)
            mesh, presence, _ = self._invoke(self.landmarker,
                                             (crop.astype(np.float32) / 255.0)[None])
            if 1.0 / (1.0 + math.exp(-float(presence.reshape(-1)[0]))) < 0.5:
                continue  # lost: the detector runs on the next frame
            points = mesh.reshape(478, 3)
            xy = points[:, :2] @ to_image[:, :2].T + to_image[:, 2]
            landmarks = np.column_stack([xy, points[:, 2] * unit])
            blend = self._invoke(self.blendshapes,
                                 landmarks[self.subset, :2].astype(np.float32)[None])[0]
            faces.append((landmarks, blend))
            lo, hi = xy.min(axis=0), xy.max(axis=0)
            (sx, sy), (ex, ey) = xy[33], xy[263]
            next_rects.append(((lo[0] + hi[0]) / 2, (lo[1] + hi[1]) / 2,
                               1.5 * max(hi - lo), math.atan2(ey - sy, ex - sx)))
        self.rects = next_rects
        return faces


def run_litert(bundle, threads: int, footage: Footage) -> dict:
    from facecast.daemon.cli.video_analysis import PyAvDecoder

    landmarker = LiteRTFaceLandmarker(bundle, threads, num_faces=footage.faces)
    found = faces = 0
    wall0, cpu0 = time.perf_counter(), cpu_s()
    decoder = PyAvDecoder(footage.path)
    count = 0
    for frame in decoder.frames():
        if frame.image is None:
            raise RuntimeError(f"{footage.path}: frame {frame.index}: {frame.problem}")
        measured = landmarker.frame(frame.image, footage.truth[frame.index])
        faces += len(measured)
        boxes = [(*lm[:, :2].min(axis=0), *lm[:, :2].max(axis=0)) for lm, _ in measured]
        found += _matched(boxes, footage.truth[frame.index])
        count += 1
    decoder.close()
    # (The matching above is inside the timed loop: microseconds a frame.)
    return {**_rates(count, time.perf_counter() - wall0, cpu_s() - cpu0), "faces": faces,
            "faces_on_truth": found, "faces_true": sum(map(len, footage.truth)),
            "detector_calls": landmarker.detector_calls,
            "seeded_from_truth": landmarker.seeded_from_truth}


# -- where the time goes ---------------------------------------------------------------------------


def _cpu_ms(call, repeats: int = 15) -> float:
    """Median process CPU time of one call, after two warm-up calls."""
    call()
    call()
    samples = []
    for _ in range(repeats):
        start = cpu_s()
        call()
        samples.append((cpu_s() - start) * 1e3)
    return round(statistics.median(samples), 2)


def components(analyzer, bundle, footages: list[Footage], litert_threads: int) -> dict:
    """CPU ms of the parts of a frame's work, each alone (CPU device only): the models per face
    in facecast's runtime (`model_runtimes`: LiteRT for these where it is installed, Note
    [LiteRT on the CPU]) and in the baseline's LiteRT, a detection pass per frame size
    (facecast's: short range, full range over the whole frame; MediaPipe's: one short-range
    invoke)."""
    import torch

    from facecast.models.roi import FrameBatch

    pipeline = analyzer.pipeline
    crop = torch.rand(1, 256, 256, 3)
    points = torch.rand(1, 146, 2) * 500
    litert = LiteRTFaceLandmarker(bundle, litert_threads, num_faces=1)
    crop_np, points_np = crop.numpy(), points.numpy()
    with torch.inference_mode():
        parts = {
            "facecast_landmarks_model_ms_per_face": _cpu_ms(lambda: pipeline.measurer.mesh(crop)),
            "facecast_blendshapes_model_ms_per_face": _cpu_ms(
                lambda: pipeline.measurer.blendshapes(points)),
            "litert_landmarks_model_ms_per_face": _cpu_ms(
                lambda: litert._invoke(litert.landmarker, crop_np)),
            "litert_blendshapes_model_ms_per_face": _cpu_ms(
                lambda: litert._invoke(litert.blendshapes, points_np)),
        }
        for height in sorted({f.height for f in footages}):
            footage = next(f for f in footages if f.height == height)
            from facecast.daemon.cli.video_analysis import PyAvDecoder

            decoder = PyAvDecoder(footage.path)
            image = next(iter(decoder.frames())).image
            decoder.close()
            rgb = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
            parts[f"facecast_detection_pass_ms_{height}p"] = _cpu_ms(
                lambda: pipeline.detect(FrameBatch([image], pipeline.device)), repeats=7)
            parts[f"litert_detector_ms_{height}p"] = _cpu_ms(lambda: litert._detect(rgb))
    parts["facecast_model_runtimes"] = dict(pipeline.model_runtimes)
    return parts


# -- machine and report ----------------------------------------------------------------------------


def machine_info(device) -> dict:
    sys.path.insert(0, str(REPO / "bench"))
    from models import machine_info as models_machine_info  # bench/models.py's

    info = models_machine_info(device)
    import av

    info["pyav"] = av.__version__
    try:
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def _median(samples: list[dict], key: str) -> float:
    return statistics.median(sample[key] for sample in samples)


def report(data: dict) -> str:
    m = data["machine"]
    settings = data["settings"]
    where = (f"{m['gpu']}, driver {m.get('driver', '-')}, CUDA {m.get('cuda')}"
             if m.get("gpu", "none") != "none" else "no GPU (the CPU stack)")
    threads = settings["litert_threads"]
    inline = any(row["facecast_inline"] for row in data["rows"])
    at_once = settings.get("files_at_once", 1)
    lines = [SECTION_TITLE, "",
             f"Run {m['date'][:10]} on {m['host']}: {where}; CPU {m['cpu']} ({m['cpu_count']} cores, "
             f"load average {m.get('load_average_at_start', '-')} at the start: "
             + ("the machine is shared" if m["cpu_count"] <= 4 else "1, 5, 15 min")
             + f"); Python {m['python']}, torch {m['torch']}, PyAV {m.get('pyav')}, "
             f"LiteRT {m.get('litert')}. Command: `{data['command']}`. Raw figures: "
             "[benchmarks-analyze.json](benchmarks-analyze.json); what is measured: the docstring "
             "of `bench/analyze.py`.", "",
             f"H.264 files of {settings['frames']} frames (30 fps) made from the synthetic scene"
             + (f", {at_once} copies of each analysed at once (batched as files are)" if at_once > 1
                else "")
             + "; frames/s end to end, decoding included (the decoder: its column), median of "
             f"{settings['repeats']} runs; CPU ms = process CPU time per frame, every thread. "
             f"facecast = `facecast analyze`'s Analyzer, the stack on {data['device']} (detection on "
             "the live schedule, tracking, mesh, blendshapes, head pose, track ids, the CSV), "
             "each file decoded on its own thread (Note [Decoding ahead])"
             + ("; inline = the same with each frame decoded when the models want it, the per-frame "
                "baseline" if inline else "")
             + ". LiteRT = MediaPipe's FaceLandmarker models (detector while faces are missing, "
             "landmarks, blendshapes) in VIDEO mode on the same decoder's frames, decoding inline; "
             "× = facecast's frames/s over LiteRT's. Faces on truth: measured faces on the "
             "ground truth's, over all frames.", "",
             "| footage | decoder | faces on truth: facecast / LiteRT | decode only frames/s | "
             + ("facecast inline frames/s (CPU ms) | " if inline else "")
             + "facecast frames/s (CPU ms) | "
             + " | ".join(f"LiteRT {t}t frames/s (CPU ms) | × LiteRT {t}t | × by CPU time"
                          for t in threads) + " |",
             "|---|---|---|---|" + ("---|" if inline else "") + "---|" + "---|---|---|" * len(threads)]
    for row in data["rows"]:
        face_rate = _median(row["facecast"], "frames_per_s")
        first = row["facecast"][0]
        cells = [row["footage"], first.get("decoder", "PyAV (CPU)"),
                 f"{first['faces_on_truth']}/{first['faces_true']} / "
                 + " / ".join(f"{row['litert'][str(t)][0]['faces_on_truth']}" for t in threads),
                 f"{_median(row['decode'], 'frames_per_s'):.0f}"]
        if inline:
            cells.append(f"{_median(row['facecast_inline'], 'frames_per_s'):.1f} "
                         f"({_median(row['facecast_inline'], 'cpu_ms_per_frame'):.0f})")
        cells.append(f"**{face_rate:.1f}** ({_median(row['facecast'], 'cpu_ms_per_frame'):.0f})")
        face_cpu_ms = _median(row["facecast"], "cpu_ms_per_frame")
        for t in threads:
            samples = row["litert"][str(t)]
            rate = _median(samples, "frames_per_s")
            cpu_ms = _median(samples, "cpu_ms_per_frame")
            cells += [f"{rate:.1f} ({cpu_ms:.0f})", f"{face_rate / rate:.2f}×",
                      f"{cpu_ms / face_cpu_ms:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", goal_text(data)]
    if any(row.get("command") for row in data["rows"]):
        lines += ["", command_text(data)]
    if data.get("components"):
        lines += ["", components_text(data)]
    for note in data.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def command_text(data: dict) -> str:
    """The command's rows (`--jobs`): end to end and steady, per number of jobs."""
    at_once = data["settings"].get("files_at_once", 1)
    lines = [f"The command, `facecast analyze --jobs N` over the same {at_once} files (Note "
             "[Jobs]); end to end = all frames / the command's wall time, start-up included; "
             "steady = once every file had reported progress, until the first was done "
             "(median of the repeats):", "",
             "| footage | jobs | faces on truth | end to end frames/s | steady frames/s |",
             "|---|---|---|---|---|"]
    for row in data["rows"]:
        for jobs, samples in row.get("command", {}).items():
            if not samples:
                continue
            steady = [s["steady_frames_per_s"] for s in samples if s["steady_frames_per_s"]]
            lines.append(f"| {row['footage']} | {jobs} | {samples[0]['faces_on_truth']}/"
                         f"{samples[0]['faces_true']} | "
                         f"{_median(samples, 'frames_per_s'):.1f} | "
                         + (f"**{statistics.median(steady):.1f}**" if steady else "-") + " |")
    return "\n".join(lines)


def components_text(data: dict) -> str:
    """Where a frame's CPU time goes (the CPU run's `components`)."""
    parts = dict(data["components"])
    for model in ("landmarks", "blendshapes"):  # runs before 2026-11-27 named them by torch
        parts.setdefault(f"facecast_{model}_model_ms_per_face", parts.get(f"torch_{model}_model_ms_per_face"))
    heights = sorted(int(k.split("_")[-1][:-1]) for k in parts if k.startswith("facecast_detection"))
    detection = ", ".join(
        f"{h}p {parts[f'facecast_detection_pass_ms_{h}p']:.0f} ms (MediaPipe's one short-range "
        f"invoke {parts[f'litert_detector_ms_{h}p']:.1f} ms)" for h in heights)
    runtimes = parts.get("facecast_model_runtimes", {})
    landmarks_runtime = runtimes.get("face_landmarks_detector", "torch")
    return (
        "Where the CPU time goes (each part alone, CPU ms, median; facecast's models on its "
        "threads (Note [Threads of the models]), the baseline's on "
        f"{data['settings'].get('model_threads') or 1}; `components` in the JSON): "
        f"the face landmarks model {parts['facecast_landmarks_model_ms_per_face']:.1f} ms a face in "
        f"facecast ({landmarks_runtime}: Note [LiteRT on the CPU]) against "
        f"{parts['litert_landmarks_model_ms_per_face']:.1f} ms in the baseline's LiteRT (XNNPACK), "
        f"the blendshape model {parts['facecast_blendshapes_model_ms_per_face']:.1f} against "
        f"{parts['litert_blendshapes_model_ms_per_face']:.1f} ms; a detection pass, which the "
        "live schedule runs when a face is lost and, while fewer faces are followed than "
        "`output.max_faces` (here each file's face count, as the baseline's `num_faces`), every "
        f"`daemon.detect_interval_s` (0.5 s: every 15th frame): {detection}. MediaPipe in VIDEO "
        "mode runs its detector only while it tracks fewer faces than asked for (facecast's "
        "searches for newcomers too: Note [No search where no face could go]), and computes no "
        "head pose; facecast's "
        "stack adds the crops, projection, face geometry and head pose, the duplicate filter "
        "and the table (decoding: the decode-only column). facecast's models by runtime: "
        f"{runtimes or 'not recorded'}.")


def goal_text(data: dict) -> str:
    threads = data["settings"]["litert_threads"]
    verdicts, met = [], True
    for row in data["rows"]:
        # LiteRT at its best thread count for this file: the rate to reach.
        best_t = max(threads, key=lambda t: _median(row["litert"][str(t)], "frames_per_s"))
        best = row["litert"][str(best_t)]
        rate = _median(row["facecast"], "frames_per_s")
        ratio = rate / _median(best, "frames_per_s")
        by_cpu = _median(best, "cpu_ms_per_frame") / _median(row["facecast"], "cpu_ms_per_frame")
        verdicts.append(f"{row['footage']} {ratio:.2f}× LiteRT {best_t}t ({by_cpu:.2f}× by CPU time)")
        met = met and ratio >= 1.0
    model_threads = data["settings"].get("model_threads")
    text = ("Goal of issue 23 on this machine, at least LiteRT's rate on the same frames (LiteRT at "
            "its fastest of " + ", ".join(f"{t}" for t in threads) + " threads"
            + (f"; facecast's models on {model_threads}" if model_threads else "") + "): "
            + ("**met**" if met else "**not met**") + " (" + ", ".join(verdicts) + ").")
    if data["device"].startswith("cuda"):
        one = [r for r in data["rows"] if r["faces"] == 1 and r["height"] == 1080]
        if one:
            rate = _median(one[0]["facecast"], "frames_per_s")
            text += (f" GPU goal, ≥ {GPU_GOAL_FRAMES_PER_S:,.0f} frames/s of 1080p H.264 with one face: "
                     f"{rate:,.0f}, {'**met**' if rate >= GPU_GOAL_FRAMES_PER_S else '**not met**'}.")
    return text


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu",
                        help="where facecast's stack runs: cpu (default) or cuda")
    parser.add_argument("--decode", choices=("auto", "gpu", "cpu"), default="auto",
                        help="facecast's decoder, as the command's --decode (default auto: NVDEC "
                        "with --device cuda where it can, else PyAV); the table names it")
    parser.add_argument("--frames", type=int, default=120, help="frames per file (even)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--footage", nargs="+", default=[f"{w}x{h}x{n}" for w, h, n in FOOTAGE],
                        help="WIDTHxHEIGHTxFACES (faces: 1, 2 or 4); default: "
                        + " ".join(f"{w}x{h}x{n}" for w, h, n in FOOTAGE))
    parser.add_argument("--litert-threads", type=int, nargs="+", default=None,
                        help="the baseline's LiteRT threads, a run for each (default: 1, and "
                        "facecast's model threads on the CPU where more)")
    parser.add_argument("--model-threads", default="auto",
                        help="facecast's LiteRT threads on the CPU, as the command's --threads "
                        "(default auto: the cores this process may run on, at most 8)")
    parser.add_argument("--files-at-once", type=int, default=1,
                        help="facecast analyses this many copies of each file in one run, "
                        "batched as the command batches files (for a GPU; default 1); "
                        "frames/s counts every copy's frames")
    parser.add_argument("--jobs", type=int, nargs="*", default=[], metavar="N",
                        help="also run the command, `facecast analyze --jobs N`, over the same "
                        "copies, for each N (Note [Jobs])")
    parser.add_argument("--skip-inline", action="store_true",
                        help="leave out the per-frame baseline (decoding inline)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads on the CPU (default 1, as `facecast analyze` sets)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "facecast-bench-analyze",
                        help="where the footage is made (and kept for the next run) and the tables go")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-analyze.json")
    parser.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"),
                        help="rewrite this file's analyze section ('' to leave it)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="no run: print (and write to --docs) the section of this result file")
    parser.add_argument("--note", action="append", default=[],
                        help="a line added under the table (what else was going on, say)")
    args = parser.parse_args()
    if args.from_json is not None:
        text = report(json.loads(args.from_json.read_text()))
        print(text)
        if args.docs:
            replace_section(Path(args.docs), SECTION_TITLE, text)
        return 0
    footage_specs = []
    for spec in args.footage:
        try:
            width, height, faces = (int(part) for part in spec.lower().split("x"))
        except ValueError:
            parser.error(f"--footage {spec!r}: expected WIDTHxHEIGHTxFACES, e.g. 1920x1080x1")
        if faces not in (1, 2, 4) or width % 4 or height % 2:
            parser.error(f"--footage {spec!r}: faces must be 1, 2 or 4, the width a multiple of 4 "
                         "and the height even (H.264 4:2:0, two halves for four faces)")
        footage_specs.append((width, height, faces))
    if args.files_at_once < 1:
        parser.error(f"--files-at-once must be at least 1, got {args.files_at_once}")
    if args.frames < 4 or args.frames % 2:
        parser.error(f"--frames must be even and at least 4, got {args.frames}")

    import torch

    from facecast.daemon.cli import video_analysis as va
    from facecast.models import assets
    from facecast.shared import config as config_mod

    from facecast.daemon.cli import analysis_jobs

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    try:
        model_threads = analysis_jobs.model_threads(analysis_jobs.parse_threads(args.model_threads), 1)
    except ValueError as exc:
        parser.error(str(exc).replace("--threads", "--model-threads"))
    if args.litert_threads is None:
        args.litert_threads = [1] + ([model_threads] if device.type == "cpu" and model_threads > 1 else [])
    if device.type == "cpu":
        torch.set_num_threads(args.torch_threads)
    analyzers, inline_analyzers = {}, {}  # by output.max_faces: each file's face count

    def analyzer_for(faces: int):
        """`facecast analyze`'s Analyzer with `output.max_faces = faces` (the baseline's
        num_faces), and the per-frame baseline: the same stack, each frame decoded when the
        models want it."""
        if faces not in analyzers:
            config = va.StackConfig(output=config_mod.OutputConfig(max_faces=faces))
            analyzers[faces] = va.build_analyzer(
                config, device, va.Settings(decode=args.decode),
                cpu_threads=model_threads if device.type == "cpu" else None)
            inline_analyzers[faces] = va.Analyzer(
                analyzers[faces].pipeline, va.Settings(decode_ahead=False, decode=args.decode),
                landmarker_problem=analyzers[faces].landmarker_problem)
        return analyzers[faces]

    analyzer = analyzer_for(footage_specs[0][2])
    if analyzer.gpu_decode_problem and (args.decode == "gpu" or device.type == "cuda"):
        print(f"bench/analyze.py: decoding with PyAV on the CPU: {analyzer.gpu_decode_problem}",
              file=sys.stderr)
    if analyzer.pipeline.landmarker != "face_landmarker":
        print(f"bench/analyze.py: no face_landmarker.task ({analyzer.landmarker_problem}): "
              "`facecast models install` first", file=sys.stderr)
        return 2
    bundle = assets.blendshape_model(assets.landmarker_bundle(None).path)
    print(f"making footage in {args.work} ...", file=sys.stderr, flush=True)
    footages = [make_footage(args.work, w, h, n, args.frames) for w, h, n in footage_specs]
    data = {"machine": machine_info(device), "device": str(device),
            "command": shlex.join(["python3", "bench/analyze.py", *sys.argv[1:]]),
            "settings": {"frames": args.frames, "repeats": args.repeats, "fps": FPS,
                         "decode": args.decode, "gpu_decode_problem": analyzer.gpu_decode_problem,
                         "files_at_once": args.files_at_once, "jobs": args.jobs,
                         "max_faces": "each file's face count, on both sides",
                         "litert_threads": args.litert_threads,
                         "torch_threads": torch.get_num_threads(),
                         "model_threads": model_threads if device.type == "cpu" else None},
            "rows": [], "notes": args.note}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1, default=str) + "\n")

    if device.type == "cpu":
        # The baseline's models on facecast's threads: the same models, like with like.
        data["components"] = components(analyzer, bundle, footages, model_threads)
        print(f"components (CPU ms): {data['components']}", file=sys.stderr, flush=True)
        save()
    if device.type == "cuda":
        # The first batches of each shape prepare cuDNN and capture CUDA graphs (per frame size
        # and per count of faces): a cost of the run's start, not of the file's frames. Every
        # footage once: warming with the first alone left the 1080p files' first run with
        # their own captures (H100, 2026-11-26: 1080p one face 188 frames/s in its first run,
        # 486 in its second).
        for footage in footages:
            run_facecast(analyzer_for(footage.faces), footage, args.work / "warmup",
                         args.files_at_once)
    for footage in footages:
        row = {"footage": footage.name, "width": footage.width, "height": footage.height,
               "faces": footage.faces, "file": footage.path.name,
               "file_bytes": footage.path.stat().st_size,
               "decode": [], "facecast_inline": [], "facecast": [],
               "command": {str(n): [] for n in args.jobs},
               "litert": {str(t): [] for t in args.litert_threads}}
        data["rows"].append(row)
        analyzer, inline = analyzer_for(footage.faces), inline_analyzers[footage.faces]
        for repeat in range(args.repeats):
            row["decode"].append(decode_only(footage, analyzer))
            if not args.skip_inline:
                row["facecast_inline"].append(run_facecast(inline, footage, args.work / "tables",
                                                           args.files_at_once))
            row["facecast"].append(run_facecast(analyzer, footage, args.work / "tables",
                                                args.files_at_once))
            for jobs in args.jobs:
                row["command"][str(jobs)].append(run_command(args, footage, args.work / "command",
                                                             jobs))
                print(f"{footage.name} #{repeat + 1}: the command with --jobs {jobs}: "
                      f"{row['command'][str(jobs)][-1]}", file=sys.stderr, flush=True)
                save()
            for threads in args.litert_threads:
                row["litert"][str(threads)].append(run_litert(bundle, threads, footage))
            inline_text = (f"inline {row['facecast_inline'][-1]['frames_per_s']:.1f}, "
                           if row["facecast_inline"] else "")
            print(f"{footage.name} #{repeat + 1} ({row['facecast'][-1]['decoder']}): decode "
                  f"{row['decode'][-1]['frames_per_s']:.1f}, "
                  f"facecast {inline_text}ahead {row['facecast'][-1]['frames_per_s']:.1f}, "
                  + ", ".join(
                      f"LiteRT {t}t {row['litert'][str(t)][-1]['frames_per_s']:.1f}"
                      for t in args.litert_threads) + " frames/s", file=sys.stderr, flush=True)
            save()
    text = report(data)
    print(text)
    if args.docs:
        replace_section(Path(args.docs), SECTION_TITLE, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
