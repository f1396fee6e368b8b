"""Model throughput: the face stack (faces/s) and face detection (frames/s), torch on this machine
against LiteRT on its CPU, the same .tflite files, in the same run.

    python bench/models.py                  # the full run: on an H200 about 2-3 minutes
    python bench/models.py --quick          # CPU check: batch 1 and 4, 1 and 2 cameras, fp32
    python bench/models.py --docs ''        # ... without rewriting docs/benchmarks.md

On the offline GPU host (bench/gpu_host_env.sh sets $FACECAST_MODEL_DIR and $FACECAST_TEST_PHOTOS):

    . bench/gpu_host_env.sh && timeout 290 python3 bench/models.py

What is measured
----------------
*Face stack*, per batch of B faces (B = 1 … 256) of 1080p frames (real photos pasted at three
scales; the ROIs are the float32 pipeline's detections, repeated up to B):
- "stack": ``FaceMeasurer.measure_on_device``: crop every ROI (one gather from the uint8 frames
  on the device), the attention mesh with its lips/eye/iris refinement (478 landmarks, irises
  included), projection to frame pixels, head pose, the duplicate filter, the results' table
  (one CUDA graph with graphs on: Note [Measuring on the device]); device
  synchronised;
- "results": the same through ``FaceMeasurer.measure``, i.e. until the Face objects are built on
  the host (one transfer), what the roi_landmark worker waits for; "host" is its share after the
  one transfer (``FaceMeasurer.last_host_work_s``: slicing the table and making the Face objects,
  Note [Measuring on the device]), median over the same timed calls.
*Detection*, per call over C = 1 … 32 1080p frames held as one uint8 (C, 1080, 1920, 3) tensor on
the device (as the daemon's rings give them): ``FacePipeline.detect``, short-range letterbox plus
the full-range detector over the whole frame (512x288 since 2026-11-26; a letterbox and 8 tiles
before), decode, weighted NMS, merge; ends with the per-frame
results on the host. For the eager variants the same pass is also run with a synchronising stage
clock: preprocess (letterbox and whole-frame crops), forward (both detectors), decode + NMS (+ merge).
Variants (CUDA): fp32, fp16 (``half=True``), fp32+graphs and fp16+graphs (``cuda_graphs=True``);
on the CPU: fp32. Each is checked against fp32 eager on the same inputs (landmark error as a
fraction of the face's box width; detection counts and box IoU). Every figure is the median (and
90th percentile) of timed iterations after warm-up; graph capture happens during warm-up.

*Face embeddings* (issue 15), per batch of B faces of the same frames: dlib's face chips cut by
the mesh and dlib's face ResNet (``models/face_embedding.py``), and the network alone; fp32.

*LiteRT baseline* (``ai-edge-litert``, XNNPACK on the CPU, the thread counts listed), one invoke
per face or per model input, as MediaPipe runs them, model time only (set input, invoke, read
outputs; no crops): face_landmark_with_attention cannot run whole in LiteRT (MediaPipe's custom
operators have no LiteRT kernels), so the baseline runs it cut before them (mesh, face flag and
the tensors the custom operators read: a lower bound of its cost, which makes the ratios
conservative); for reference also MediaPipe's legacy route, face_landmark + iris_landmark per
eye. Detection: one short-range invoke per 1080p frame on the input the torch pipeline gets, and
the full-range detector on the same input pixels as torch's whole-frame input (512x288: Note
[The full-range detector over the whole frame]), which LiteRT's model (fixed at 192x192) takes as
147456 / 192² = 4 invokes of 192x192 pieces of it. Ratios in the tables are torch's rate over
LiteRT's, same machine, same run.

What changed to make it fast, and why (issue 3)
-----------------------------------------------
The CPU profile (torch.profiler and a dispatch counter, 1080p frames) showed that detection did
per-frame and per-tile Python work that turns into kernel launches and host waits on a GPU:
per frame 11 boolean-mask selections that each wait for the device (``Detections.select`` and
the merge of the two detectors), a Python loop over tiles for the tile-border test (~8 kernels
per tile), per-frame list indexing (a host-to-device copy each) for pooling; the measurement
waited for the device once per face (``box.tolist()``, ``float(score)``), used a
``repeat_interleave`` that waits, built per-track ROIs and per-detection overlap tests with a
wait each, and re-uploaded every tracked face's landmarks; and every batch converted whole
frames to float (6.2 M values per 1080p frame, for crops that read 0.35 M samples). Aten
operations per detection call grew by ~190 per frame (1,445 at 1 frame, 4,234 at 16).
Changes (results unchanged to float rounding: < 3e-3 px on the photos):
- detection plans (inputs, owners, tile borders, pooling) made once per frame-size list on the
  host; the pass is a fixed sequence of batched operations with one wait at the end (Note
  [Detection without per-frame work]); the same for measuring and tracking;
- crops sample the frames' uint8 pixels with one gather, no float copy of the frames (Note
  [Sampling the frames where they lie]);
- the converter's models: PRELU of an image as one ``F.prelu`` kernel (was three, writing three
  tensors); fused activations applied in place; the full-range detector's 43 zero PADs folded
  into their convolutions (outputs bitwise equal on the CPU); on CUDA the convolution weights are
  channels_last like the activations (no per-call weight reorder);
- ``FacePipeline(half=True)`` (float16 models) and ``FacePipeline(cuda_graphs=True)`` (detection
  and mesh stages replayed from CUDA graphs with bucketed batch sizes, Note [CUDA graphs of the
  pipeline]). torch.compile was not used then (its compile time for these op-by-op graphs);
  since 2026-11-26 the "+compile" variants compile the measuring stage's models (Note [Compiled
  models]: faster stacks, half a minute or more of compiling per pipeline).
CPU time on the 2-core development machine (1 thread, process time, same frames, old → new):
detect over 1 / 4 / 8 1080p frames 99 / 652 / 1,444 ms → 65 / 281 / 611 ms, with host waits per
call 11 / 44 / 88 → 1 (aten operations 1,445 / 1,990 / 2,738 → 1,407 / 1,415 / 1,447); a tracked
step of 4 cameras 127 → 42 ms; letterbox and tile crops of a 1080p frame 26 → 9 ms; the
full-range detector on 9 inputs 55 → 43 ms; the attention mesh at batch 8 46 → 22 ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from docs_section import replace_section  # bench/docs_section.py (this folder is on sys.path)

REPO = Path(__file__).resolve().parent.parent
FRAME_HW = (1080, 1920)
SECTION_TITLE = "## Models (`bench/models.py`)"
FACE_GOAL = (64, 30000.0)  # batch, faces/s: the attention-mesh stack (issue 24)
FACE_LANDMARKER_GOAL = 20000.0  # faces/s at FACE_GOAL's batch: FaceLandmarker's stack (issue 24)
DETECTION_GOAL = (32, 5.0)  # cameras, ms


# -- inputs ------------------------------------------------------------------------------------


def load_photos(npz: str | None) -> dict[str, np.ndarray]:
    """The astronaut and grace_hopper photos, RGB (as tests/models/conftest.py finds them)."""
    if npz:
        with np.load(npz) as saved:
            return {name: saved[name] for name in ("astronaut", "grace_hopper")}
    import cv2
    import matplotlib.cbook
    import skimage.data

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as stream:
        encoded = np.frombuffer(stream.read(), np.uint8)
    grace_hopper = cv2.cvtColor(cv2.imdecode(encoded, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    return {"astronaut": skimage.data.astronaut(), "grace_hopper": grace_hopper}


def make_scene(photos: dict[str, np.ndarray], shift_px: int) -> np.ndarray:
    """A 1080p BGR frame with three faces (about 200, 100 and 70 px), moved by ``shift_px``."""
    import cv2

    canvas = np.full(FRAME_HW + (3,), 110, np.uint8)
    for source, scale, x_px, y_px in (("grace_hopper", 0.8, 150 + shift_px % 400, 200),
                                      ("astronaut", 1.0, 900, 300 + shift_px % 200),
                                      ("astronaut", 0.75, 1500, 650 - shift_px % 300)):
        small = cv2.resize(photos[source], None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
        h, w = small.shape[:2]
        canvas[y_px:y_px + h, x_px:x_px + w] = small
    return np.ascontiguousarray(canvas[..., ::-1])


# -- machine -----------------------------------------------------------------------------------


def machine_info(device) -> dict:
    import importlib.metadata

    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                           if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    try:
        info["litert"] = importlib.metadata.version("ai-edge-litert")
    except importlib.metadata.PackageNotFoundError:
        info["litert"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cudnn"] = torch.backends.cudnn.version()
        info["tf32_conv"] = torch.backends.cudnn.allow_tf32
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - no NVML bindings: the kernel module says it too
            try:
                version = Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
                info["driver"] = version.strip()
            except (OSError, IndexError):
                info["driver"] = "unknown"
    else:
        info["gpu"] = "none"
    return info


# -- timing ------------------------------------------------------------------------------------


class Budget:
    """Skips what would not finish in time, so that one run always ends with its results."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def timed(fn, device, warmup: int, iters: int) -> dict:
    """Median and 90th percentile of ``iters`` calls after ``warmup``, device synchronised."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    samples = np.array(samples)
    return {"p50_ms": float(np.median(samples)), "p90_ms": float(np.percentile(samples, 90)), "iters": iters}


def host_share(measurer, results, device, warmup: int, iters: int) -> tuple[dict, dict]:
    """``timed(results)`` and, over the same timed calls, the median and 90th percentile of the
    measurer's host work after its one transfer (``FaceMeasurer.last_host_work_s``)."""
    host_ms = []

    def call():
        out = results()
        host_ms.append(measurer.last_host_work_s * 1e3)
        return out

    timing = timed(call, device, warmup, iters)
    samples = np.array(host_ms[warmup:])
    return timing, {"p50_ms": float(np.median(samples)), "p90_ms": float(np.percentile(samples, 90))}


def stage_times(run, device, warmup: int, iters: int, stages: tuple[str, ...]) -> dict:
    """Per-stage medians of ``run(on_stage)``, the clock synchronised at each stage's end."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    per_stage = {name: [] for name in stages}
    for k in range(warmup + iters):
        marks = []

        def on_stage(name):
            sync()
            marks.append((name, time.perf_counter()))

        sync()
        start = time.perf_counter()
        run(on_stage)
        if k >= warmup:
            previous = start
            for name, stamp in marks:
                per_stage[name].append((stamp - previous) * 1e3)
                previous = stamp
    return {name: float(np.median(values)) for name, values in per_stage.items() if values}


# -- torch -------------------------------------------------------------------------------------


VARIANTS = {"fp32": {}, "fp16": {"half": True}, "fp32+graphs": {"cuda_graphs": True},
            "fp16+graphs": {"half": True, "cuda_graphs": True},
            "fp32+graphs+compile": {"cuda_graphs": True, "compile_models": True},
            "fp16+graphs+compile": {"half": True, "cuda_graphs": True, "compile_models": True}}


def build_pipelines(device, names, task):
    from facecast.models.pipeline import FacePipeline

    return {name: FacePipeline(device, max_faces=4, face_landmarker_task=task, **VARIANTS[name]) for name in names}


def face_pool(reference, batch):
    """Every face the float32 pipeline finds in the frames: (owner frame, box, keypoints, score)."""
    import torch

    found = reference.detect(batch)  # on the host
    owners = [i for i, (boxes, _, _) in enumerate(found) for _ in range(boxes.shape[0])]
    boxes = torch.cat([d[0] for d in found]).to(batch.device)
    keypoints = torch.cat([d[1] for d in found]).to(batch.device)
    scores = torch.cat([d[2] for d in found]).to(batch.device)
    return owners, boxes, keypoints, scores


def face_batch(pool, size: int):
    """A batch of ``size`` ROIs from the pool, its faces repeated in order: (owners, rects,
    boxes, scores, box widths on the host)."""
    import torch

    from facecast.models import roi

    owners_all, boxes_all, keypoints_all, scores_all = pool
    pick = [k % len(owners_all) for k in range(size)]
    index = torch.tensor(pick, device=boxes_all.device)
    boxes, scores = boxes_all[index], scores_all[index]
    rects = roi.rects_from_detections(boxes, keypoints_all[index])
    widths = (boxes[:, 2] - boxes[:, 0]).cpu().numpy()
    return [owners_all[k] for k in pick], rects, boxes, scores, widths


def bench_faces(pipelines, batch, pool, batch_sizes, args, budget) -> list[dict]:
    import torch

    device = batch.device
    rows = []
    reference_landmarks = {}
    for size in batch_sizes:
        owners, rects, boxes, scores, widths = face_batch(pool, size)
        for name, pipe in pipelines.items():
            row = {"batch": size, "variant": name}
            rows.append(row)
            if budget.left_s() < 10:
                row["error"] = "skipped: time budget"
                continue
            try:
                def stack():
                    with torch.inference_mode():
                        table = pipe.measurer.measure_on_device(batch, owners, rects, boxes, scores, [False] * size)
                        return table[:, pipe.measurer.layout.landmarks].reshape(size, -1, 3)

                def results():
                    with torch.inference_mode():
                        return pipe.measurer.measure(batch, owners, rects, boxes, scores, [False] * size)

                row["stack"] = timed(stack, device, args.warmup, args.iters)
                row["results"], row["host"] = host_share(pipe.measurer, results, device, args.warmup, args.iters)
                row["stack_faces_per_s"] = size / row["stack"]["p50_ms"] * 1e3
                row["results_faces_per_s"] = size / row["results"]["p50_ms"] * 1e3
                landmarks = stack().float().cpu().numpy()
                if name == "fp32":
                    reference_landmarks[size] = landmarks
                elif size in reference_landmarks:
                    error = (np.linalg.norm(landmarks[..., :2] - reference_landmarks[size][..., :2], axis=-1)
                             / widths[:, None])
                    row["parity"] = {"landmark_median_pct": float(100 * np.median(error)),
                                     "landmark_p99_pct": float(100 * np.percentile(error, 99)),
                                     "landmark_max_pct": float(100 * error.max())}
                if pipe.graph_fallbacks:
                    row["graph_fallbacks"] = dict(pipe.graph_fallbacks)
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"faces   batch {size:4d} {name:12s} " + (row.get("error") or
                  f"stack {row['stack_faces_per_s']:9.0f} faces/s, results {row['results_faces_per_s']:9.0f} faces/s, "
                  f"host {row['host']['p50_ms']:.2f} ms"),
                  file=sys.stderr, flush=True)
    return rows


def bench_face_landmarker(device, variants, task, batch, pool, size, args, budget) -> list[dict]:
    """MediaPipe FaceLandmarker's stack (issue 13) at one batch size: crop to 256x256, its v2
    landmarker, projection, blendshapes, head pose, the facial transformation matrix (Note [Face
    geometry as MediaPipe computes it]) and the duplicate filter on the device, then the Face
    objects on the host (whose share is reported apart): what a
    roi_landmark worker waits for with face_landmarker.task. Parity against fp32 eager: landmark
    median (% of face width) and max |blendshape difference|."""
    import torch

    owners, rects, boxes, scores, widths = face_batch(pool, size)
    rows, reference = [], None
    for name in variants:
        row = {"batch": size, "variant": name}
        rows.append(row)
        if budget.left_s() < 15:
            row["error"] = "skipped: time budget"
            continue
        try:
            pipe = build_pipelines(device, [name], task)[name]
            if pipe.measurer.blendshapes is None or pipe.measurer.geometry is None:
                raise RuntimeError(f"no FaceLandmarker stack: {pipe.blendshapes_unavailable_reason}")
            pipe.warm_up([], max_faces=size)

            def results():
                with torch.inference_mode():
                    return pipe.measurer.measure(batch, owners, rects, boxes, scores, [False] * size)

            row["results"], row["host"] = host_share(pipe.measurer, results, device, args.warmup, args.iters)
            row["faces_per_s"] = size / row["results"]["p50_ms"] * 1e3
            faces = [face for frame in results().faces for face in frame]
            landmarks = np.stack([f.landmarks for f in faces])
            blend = np.stack([f.blendshapes for f in faces])
            if reference is None:
                reference = (landmarks, blend)
            elif landmarks.shape == reference[0].shape:
                error = np.linalg.norm(landmarks[..., :2] - reference[0][..., :2], axis=-1) / widths[:len(faces), None]
                row["parity"] = {"landmark_median_pct": float(100 * np.median(error)),
                                 "blendshape_max_abs": float(np.abs(blend - reference[1]).max())}
            if pipe.graph_fallbacks:
                row["graph_fallbacks"] = dict(pipe.graph_fallbacks)
            del pipe
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"FaceLandmarker batch {size:4d} {name:12s} "
              + (row.get("error") or f"{row['faces_per_s']:9.0f} faces/s, host {row['host']['p50_ms']:.2f} ms"),
              file=sys.stderr, flush=True)
    return rows


def bench_embeddings(device, batch, measured, batch_sizes, args, budget) -> list[dict]:
    """Face embeddings (models/face_embedding.py, dlib's ResNet; issue 15) at batch sizes B:
    "chips + network" = dlib's face chips cut from the frames by the mesh (5 points, similarity
    fit, 4x4-sample gather) and the 128-D network, device synchronised; "network" = the network
    alone on ready chips. faces/s = B / p50. fp32 only."""
    import torch

    from facecast.models import face_embedding

    rows = []
    try:
        embedder = face_embedding.FaceEmbedder.from_model_dir(device=device)
    except Exception as exc:  # noqa: BLE001 - a missing model must not end the run
        return [{"batch": 0, "error": f"{type(exc).__name__}: {exc}"}]
    owners = [index for index, frame in zip(range(len(measured.rows)), measured.rows) for _ in frame]
    landmarks = torch.from_numpy(measured.landmarks_host_px[[row for frame in measured.rows
                                                             for row in frame]]).to(device)
    for size in batch_sizes:
        row = {"batch": size}
        rows.append(row)
        if budget.left_s() < 10:
            row["error"] = "skipped: time budget"
            continue
        pick = [k % len(owners) for k in range(size)]
        frame_index = torch.tensor([owners[k] for k in pick], device=device)
        face_landmarks = landmarks[torch.tensor(pick, device=device)]
        with torch.inference_mode():
            chips = face_embedding.extract_chips(batch, frame_index, face_embedding.mesh_chip_points(face_landmarks))
        row["chips_and_network"] = timed(lambda: embedder.embed_landmarks(batch, frame_index, face_landmarks),
                                         device, args.warmup, args.iters)
        row["network"] = timed(lambda: embedder.embed_chips(chips), device, args.warmup, args.iters)
        row["faces_per_s"] = size / row["chips_and_network"]["p50_ms"] * 1e3
        row["network_faces_per_s"] = size / row["network"]["p50_ms"] * 1e3
        print(f"embeddings batch {size:4d} {row['faces_per_s']:9.0f} faces/s", file=sys.stderr, flush=True)
    return rows


def bench_detection(pipelines, scenes, cameras_list, args, budget) -> list[dict]:
    import torch

    from facecast.models import roi
    from facecast.models.nms import box_iou

    device = next(iter(pipelines.values())).device
    rows = []
    for cameras in cameras_list:
        frames = torch.from_numpy(np.stack([scenes[k % len(scenes)] for k in range(cameras)])).to(device)
        reference = None
        for name, pipe in pipelines.items():
            row = {"cameras": cameras, "variant": name}
            rows.append(row)
            if budget.left_s() < 10:
                row["error"] = "skipped: time budget"
                continue
            try:
                def detect():
                    return pipe.detect(roi.FrameBatch(frames, device))

                row["detect"] = timed(detect, device, args.warmup, args.iters)
                row["frames_per_s"] = cameras / row["detect"]["p50_ms"] * 1e3
                if not pipe.cuda_graphs:
                    def run(on_stage):
                        with torch.inference_mode():
                            batch = roi.FrameBatch(frames, device)
                            index = torch.arange(cameras, device=device)
                            found = pipe.detector.core(batch, index, pipe.detector.plans_for(tuple(batch.sizes_hw)),
                                                       on_stage)
                            found.valid.sum(dim=1).tolist()

                    row["stages_ms"] = stage_times(run, device, max(1, args.warmup // 2), args.iters,
                                                   ("preprocess", "forward", "decode_nms"))
                found = detect()
                if name == "fp32":
                    reference = found
                elif reference is not None:
                    same = all(a[0].shape == b[0].shape for a, b in zip(reference, found))
                    ious = [box_iou(a[0], b[0]).max(dim=1).values.min().item() for a, b in zip(reference, found)
                            if a[0].shape == b[0].shape and a[0].shape[0]]
                    row["parity"] = {"same_counts": same, "min_box_iou": min(ious) if ious else None}
                row["faces_found"] = sum(int(f[0].shape[0]) for f in found)
                if pipe.graph_fallbacks:
                    row["graph_fallbacks"] = dict(pipe.graph_fallbacks)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"detect  cameras {cameras:3d} {name:12s} " + (row.get("error") or
                  f"{row['detect']['p50_ms']:8.2f} ms p50, {row['frames_per_s']:8.0f} frames/s"),
                  file=sys.stderr, flush=True)
        del frames
    return rows


# -- LiteRT --------------------------------------------------------------------------------------


def _cut_before_custom_ops(path: Path) -> bytes:
    """face_landmark_with_attention without MediaPipe's custom operators: the mesh, the face flag
    and the tensors the custom operators read (as tests/models/test_convert_parity.py cuts it)."""
    sys.path.insert(0, str(REPO / "tests" / "models"))
    from litert_reference import cut_model

    from facecast.models.tflite_convert import read_graph

    graph = read_graph(path)
    custom_inputs = sorted({op.inputs[0].name for op in graph.operators
                            if op.type in ("Landmarks2TransformMatrix", "TransformTensorBilinear")})
    return cut_model(path, ["output_mesh_identity", "conv_faceflag", *custom_inputs])


class LiteRTModel:
    def __init__(self, model: Path | bytes, threads: int):
        from ai_edge_litert.interpreter import Interpreter

        kwargs = {"model_content": model} if isinstance(model, bytes) else {"model_path": str(model)}
        self.interpreter = Interpreter(num_threads=threads, **kwargs)
        self.interpreter.allocate_tensors()
        self.input = self.interpreter.get_input_details()[0]
        self.outputs = [d["index"] for d in self.interpreter.get_output_details()]

    def __call__(self, x: np.ndarray) -> None:
        value = np.ascontiguousarray(x.reshape(self.input["shape"]), np.float32)
        self.interpreter.set_tensor(self.input["index"], value)
        self.interpreter.invoke()
        for index in self.outputs:
            self.interpreter.get_tensor(index)


def per_call_ms(model: LiteRTModel, inputs: list[np.ndarray], repeats: int) -> float:
    """Median time of one invoke over the inputs (after one warm-up pass)."""
    for x in inputs[:2]:
        model(x)
    samples = []
    for k in range(repeats):
        x = inputs[k % len(inputs)]
        start = time.perf_counter()
        model(x)
        samples.append((time.perf_counter() - start) * 1e3)
    return float(np.median(samples))


def bench_litert(face_crops, eye_crops, detector_inputs, blend_inputs, task_reason, threads_list,
                 repeats, landmarker_inputs=None) -> list[dict]:
    from facecast.models import assets

    rows = []
    try:
        attention_cut = _cut_before_custom_ops(assets.model_path("face_landmark_with_attention"))
    except Exception as exc:  # noqa: BLE001 - reported in the table instead
        attention_cut = exc
    for threads in threads_list:
        row = {"threads": threads}
        rows.append(row)
        try:
            if isinstance(attention_cut, Exception):
                raise attention_cut
            row["attention_backbone_ms"] = per_call_ms(LiteRTModel(attention_cut, threads), face_crops, repeats)
        except Exception as exc:  # noqa: BLE001
            row["attention_backbone_error"] = f"{type(exc).__name__}: {exc}"
        try:
            mesh = LiteRTModel(assets.model_path("face_landmark"), threads)
            iris = LiteRTModel(assets.model_path("iris_landmark"), threads)
            row["legacy_mesh_ms"] = per_call_ms(mesh, face_crops, repeats)
            row["legacy_iris_ms"] = per_call_ms(iris, eye_crops, repeats)
        except Exception as exc:  # noqa: BLE001
            row["legacy_error"] = f"{type(exc).__name__}: {exc}"
        if blend_inputs is not None:
            blend = LiteRTModel(blend_inputs[0], threads)
            row["blendshapes_ms"] = per_call_ms(blend, blend_inputs[1], repeats)
        else:
            row["blendshapes"] = f"absent: {task_reason}"
        short_inputs, full_inputs, full_range_invokes = detector_inputs
        try:
            short = LiteRTModel(assets.model_path("face_detection_short_range"), threads)
            full = LiteRTModel(assets.model_path("face_detection_full_range"), threads)
            row["short_range_ms"] = per_call_ms(short, short_inputs, repeats)
            row["full_range_ms"] = per_call_ms(full, full_inputs, repeats)
            row["full_range_inputs_per_frame"] = full_range_invokes
            row["detection_frame_ms"] = (row["short_range_ms"]
                                         + row["full_range_inputs_per_frame"] * row["full_range_ms"])
            row["detection_frames_per_s"] = 1e3 / row["detection_frame_ms"]
        except Exception as exc:  # noqa: BLE001
            row["detection_error"] = f"{type(exc).__name__}: {exc}"
        face_ms = row.get("attention_backbone_ms")
        if face_ms is not None:
            row["faces_per_s"] = 1e3 / (face_ms + row.get("blendshapes_ms", 0.0))
        if "legacy_mesh_ms" in row:
            row["legacy_faces_per_s"] = 1e3 / (row["legacy_mesh_ms"] + 2 * row["legacy_iris_ms"])
        if landmarker_inputs is not None:  # MediaPipe FaceLandmarker's models, one face per invoke
            try:
                bundle, crops256, subsets = landmarker_inputs
                row["v2_landmarker_ms"] = per_call_ms(LiteRTModel(bundle.face_landmarks_detector, threads),
                                                      crops256, repeats)
                row["v2_blendshapes_ms"] = per_call_ms(LiteRTModel(bundle.face_blendshapes, threads),
                                                       subsets, repeats)
                row["face_landmarker_faces_per_s"] = 1e3 / (row["v2_landmarker_ms"] + row["v2_blendshapes_ms"])
            except Exception as exc:  # noqa: BLE001
                row["face_landmarker_error"] = f"{type(exc).__name__}: {exc}"
        print(f"litert  {threads:2d} thread(s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_ms") or k.endswith("_per_s")),
            file=sys.stderr, flush=True)
    return rows


# -- report --------------------------------------------------------------------------------------


def _ratio(value, base) -> str:
    return f"{value / base:.1f}×" if value and base else "-"


def report(data: dict) -> str:
    m = data["machine"]
    litert = data["litert"]
    base = {r["threads"]: r for r in litert}
    threads = sorted(base)
    where = (f"{m['gpu']}, driver {m.get('driver', '-')}, CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}"
             if m["gpu"] != "none" else "no GPU (CPU run)")
    lines = [SECTION_TITLE, "",
             f"Run {m['date'][:10]} on {m['host']}: {where}; CPU {m['cpu']} ({m['cpu_count']} cores); "
             f"Python {m['python']}, torch {m['torch']}, LiteRT {m.get('litert')}. Command: `{data['command']}`. "
             "Raw figures: [benchmarks-models.json](benchmarks-models.json). How it is measured, what changed "
             "and why: the docstring of `bench/models.py`.", ""]
    if m["gpu"] == "none":
        lines += ["**A CPU check run**, small sizes: it shows that the benchmark works, not what the GPU does.", ""]
    nan = float("nan")
    lines += ["LiteRT baseline (XNNPACK, CPU, one invoke per face or model input, model time only): "
              + "; ".join(
                  f"{t} thread(s): attention mesh (cut before its custom operators) "
                  f"{base[t].get('attention_backbone_ms', nan):.2f} ms/face = {base[t].get('faces_per_s', nan):.0f} "
                  f"faces/s, legacy face_landmark + 2 iris {base[t].get('legacy_faces_per_s', nan):.0f} faces/s, "
                  f"detection {base[t].get('detection_frame_ms', nan):.1f} ms per 1080p frame (1 short-range + "
                  f"{base[t].get('full_range_inputs_per_frame', nan):g} full-range invokes of 192x192) = "
                  f"{base[t].get('detection_frames_per_s', nan):.1f} frames/s" for t in threads)
              + f". Blendshapes: {base[threads[0]].get('blendshapes', 'measured')}."
              + "".join(f" Errors ({t} threads): {v}." for t in threads
                        for k, v in base[t].items() if k.endswith("error")),
              ""]

    stack = ("the FaceLandmarker stack (crop, its v2 landmarker, projection, blendshapes, head pose, "
             "transformation matrix), --face-landmarker-task" if data.get("face_stack") == "face_landmarker"
             else "the attention mesh (crop, attention mesh with irises, projection, head pose)")
    lines += [f"Face stack: {stack}. "
              "faces/s = batch / p50; \"results\" runs until the Face objects exist on the host. "
              + " ".join(f"× LiteRT {t}t = results faces/s over LiteRT's with {t} thread(s)." for t in threads), "",
              "| batch | variant | stack p50 ms | stack faces/s | results p50 / p90 ms | results faces/s | "
              + " | ".join(f"× LiteRT {t}t" for t in threads)
              + " | vs fp32: landmark median / p99 / max (% of face width) |",
              "|" + "---|" * (7 + len(threads))]
    for r in data["faces"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['variant']} | {r['error']} |" + " |" * (5 + len(threads)))
            continue
        parity = r.get("parity")
        parity_text = (f"{parity['landmark_median_pct']:.3f} / {parity['landmark_p99_pct']:.3f} / "
                       f"{parity['landmark_max_pct']:.3f}" if parity else "reference")
        note = f" (graphs fell back: {', '.join(r['graph_fallbacks'])})" if r.get("graph_fallbacks") else ""
        lines.append(
            f"| {r['batch']} | {r['variant']}{note} | {r['stack']['p50_ms']:.2f} | {r['stack_faces_per_s']:.0f} | "
            f"{r['results']['p50_ms']:.2f} / {r['results']['p90_ms']:.2f} | {r['results_faces_per_s']:.0f} | "
            + " | ".join(_ratio(r["results_faces_per_s"], base[t].get("faces_per_s")) for t in threads)
            + f" | {parity_text} |")
    if data.get("face_landmarker"):
        lines += ["", f"MediaPipe FaceLandmarker's stack (face_landmarker.task: {data.get('face_landmarker_task')}): "
                  "crop 256x256, v2 landmarker, projection, blendshapes, head pose, facial transformation matrix "
                  "and duplicate filter on the device, Face objects on the host (host = the p50 of that share, "
                  "after the one transfer). faces/s = batch / p50. Baseline: the same two models in LiteRT "
                  "(XNNPACK, one invoke per face, model time only) "
                  + "; ".join(f"{t} thread(s) {base[t].get('face_landmarker_faces_per_s', nan):.0f} faces/s"
                              for t in threads) + ".", "",
                  "| batch | variant | p50 / p90 ms | host ms | faces/s | vs fp32: landmark median (% of face "
                  "width), max blendshape difference |", "|---|---|---|---|---|---|"]
        for r in data["face_landmarker"]:
            if "error" in r:
                lines.append(f"| {r['batch']} | {r['variant']} | {r['error']} | | | |")
                continue
            parity = r.get("parity")
            parity_text = (f"{parity['landmark_median_pct']:.3f}, {parity['blendshape_max_abs']:.4f}"
                           if parity else "reference")
            host = f"{r['host']['p50_ms']:.2f}" if "host" in r else "-"  # JSON of runs before it was measured
            lines.append(f"| {r['batch']} | {r['variant']} | {r['results']['p50_ms']:.2f} / "
                         f"{r['results']['p90_ms']:.2f} | {host} | {r['faces_per_s']:.0f} | {parity_text} |")
    if data.get("embeddings"):
        lines += ["", "Face embeddings (dlib's face ResNet, 128-D, fp32; `models/face_embedding.py`): \"chips + "
                  "network\" cuts each face's 150x150 chip from the frames by its mesh and runs the network; "
                  "\"network\" runs it on ready chips. faces/s = batch / p50.", "",
                  "| batch | chips + network p50 / p90 ms | faces/s | network p50 ms | network faces/s |",
                  "|---|---|---|---|---|"]
        for r in data["embeddings"]:
            if "error" in r:
                lines.append(f"| {r['batch']} | {r['error']} | | | |")
                continue
            lines.append(f"| {r['batch']} | {r['chips_and_network']['p50_ms']:.2f} / "
                         f"{r['chips_and_network']['p90_ms']:.2f} | {r['faces_per_s']:.0f} | "
                         f"{r['network']['p50_ms']:.2f} | {r['network_faces_per_s']:.0f} |")
    lines += ["", "Detection over C cameras: one `detect` call on a (C, 1080, 1920, 3) uint8 tensor on the device, "
              "to per-frame results on the host. Stages (eager variants, synchronised stage clock): preprocess = "
              "letterbox and whole-frame crops, forward = both detectors, decode+NMS = decode, weighted NMS, "
              "merge.", "",
              "| cameras | variant | p50 / p90 ms | frames/s | " + " | ".join(f"× LiteRT {t}t" for t in threads)
              + " | preprocess / forward / decode+NMS ms | vs fp32: same counts, min box IoU |",
              "|" + "---|" * (6 + len(threads))]
    for r in data["detection"]:
        if "error" in r:
            lines.append(f"| {r['cameras']} | {r['variant']} | {r['error']} |" + " |" * (3 + len(threads)))
            continue
        stages = r.get("stages_ms")
        stage_text = (f"{stages['preprocess']:.2f} / {stages['forward']:.2f} / {stages['decode_nms']:.2f}"
                      if stages else "one graph")
        parity = r.get("parity")
        parity_text = (f"{'yes' if parity['same_counts'] else 'NO'}, "
                       + (f"{parity['min_box_iou']:.4f}" if parity["min_box_iou"] is not None else "-")
                       if parity else "reference")
        note = f" (graphs fell back: {', '.join(r['graph_fallbacks'])})" if r.get("graph_fallbacks") else ""
        lines.append(f"| {r['cameras']} | {r['variant']}{note} | "
                     f"{r['detect']['p50_ms']:.2f} / {r['detect']['p90_ms']:.2f} | "
                     f"{r['frames_per_s']:.0f} | "
                     + " | ".join(_ratio(r["frames_per_s"], base[t].get("detection_frames_per_s")) for t in threads)
                     + f" | {stage_text} | {parity_text} |")
    lines += ["", goals_text(data)]
    fallbacks = {reason for r in data["faces"] + data["detection"] for reason in r.get("graph_fallbacks", {}).items()}
    if fallbacks:
        lines += ["", "Stages that ran eagerly in a graph variant: " + "; ".join(
            f"{stage}: {reason}" for stage, reason in sorted(fallbacks)) + "."]
    return "\n".join(lines) + "\n"


def goals_text(data: dict) -> str:
    batch, faces_goal = FACE_GOAL
    cameras, ms_goal = DETECTION_GOAL
    face_rows = [r for r in data["faces"] if r["batch"] == batch and "error" not in r]
    landmarker_rows = [r for r in data.get("face_landmarker", []) if r["batch"] == batch and "error" not in r]
    det_rows = [r for r in data["detection"] if r["cameras"] == cameras and "error" not in r]
    parts = []
    main_stack = data.get("face_stack", "attention_mesh")
    for label, rows, key, goal in (("attention-mesh stack", face_rows, "results_faces_per_s", faces_goal),
                                   ("FaceLandmarker stack", landmarker_rows, "faces_per_s", FACE_LANDMARKER_GOAL)):
        if rows is face_rows and main_stack != "attention_mesh":
            # --face-landmarker-task: the main table measured the FaceLandmarker stack.
            parts.append(f"{label} at batch {batch}: not measured in this run (the main face table "
                         f"measured the FaceLandmarker stack: --face-landmarker-task)")
        elif rows:
            best = max(rows, key=lambda r: r[key])
            parts.append(f"{label} at batch {batch}: best {best[key]:.0f} faces/s ({best['variant']}, results on "
                         f"the host) against ≥ {goal:.0f}: " + ("**met**" if best[key] >= goal else "**not met**"))
        else:
            parts.append(f"{label} at batch {batch}: not measured in this run")
    if det_rows:
        best = min(det_rows, key=lambda r: r["detect"]["p50_ms"])
        parts.append(f"detection over {cameras} 1080p frames: best {best['detect']['p50_ms']:.2f} ms p50 "
                     f"({best['variant']}) against ≤ {ms_goal:.0f} ms: "
                     + ("**met**" if best["detect"]["p50_ms"] <= ms_goal else "**not met**"))
    else:
        parts.append(f"detection over {cameras} cameras: not measured in this run")
    return "Goals of issue 24: " + "; ".join(parts) + "."


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a check on the CPU")
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--cameras", type=int, nargs="+")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS))
    parser.add_argument("--iters", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--embedding-batch-sizes", type=int, nargs="+",
                        help="face embedding batch sizes (default: 1 8 32 64 128; --quick: 1 4)")
    parser.add_argument("--litert-threads", type=int, nargs="+")
    parser.add_argument("--litert-repeats", type=int)
    parser.add_argument("--face-landmarker-task", default=os.environ.get("FACECAST_FACE_LANDMARKER_TASK") or None,
                        help="bundle for the main face stack table, which then measures the "
                             "FaceLandmarker stack instead of the attention mesh (default: none, the "
                             "attention mesh: issue 24's attention-mesh goal is measured only then)")
    parser.add_argument("--landmarker-task", default=None,
                        help="bundle for the FaceLandmarker stack table (default: the installed one; "
                             "'' skips that table)")
    parser.add_argument("--photos", default=os.environ.get("FACECAST_TEST_PHOTOS") or None,
                        help=".npz of the astronaut and grace_hopper photos (default: scikit-image/matplotlib)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="skip what would not finish within this many seconds of starting")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-models.json")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="no run: rewrite the docs' Models section from this result file")
    parser.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"),
                        help="rewrite this file's Models section ('' to leave it)")
    args = parser.parse_args()
    if args.from_json is not None:
        text = report(json.loads(args.from_json.read_text()))
        print(text)
        if args.docs:
            replace_section(Path(args.docs), SECTION_TITLE, text)
        return 0
    budget = Budget(args.budget_s)

    import torch

    from facecast.models import assets, roi

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    args.batch_sizes = args.batch_sizes or ([1, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256])
    args.cameras = args.cameras or ([1, 2] if args.quick else [1, 2, 4, 8, 16, 32])
    args.variants = args.variants or (list(VARIANTS) if cuda else ["fp32"])
    if not cuda and set(args.variants) - {"fp32"}:
        parser.error("fp16 and graph variants need a CUDA device")
    args.variants = ["fp32"] + [v for v in args.variants if v != "fp32"]  # first: the parity reference
    args.iters = args.iters or (3 if args.quick else 30 if cuda else 5)
    args.warmup = args.warmup or (1 if args.quick else 5 if cuda else 2)
    cpus = os.cpu_count() or 1
    args.embedding_batch_sizes = args.embedding_batch_sizes or ([1, 4] if args.quick else [1, 8, 32, 64, 128])
    args.litert_threads = args.litert_threads or ([1] if args.quick else sorted({1, min(8, cpus)}))
    args.litert_repeats = args.litert_repeats or (10 if args.quick else 60)

    photos = load_photos(args.photos)
    scenes = [make_scene(photos, 37 * k) for k in range(max(args.cameras + [8]))]
    print(f"device {device}; building pipelines {args.variants}", file=sys.stderr, flush=True)
    pipelines = build_pipelines(device, args.variants, args.face_landmarker_task)
    reference = pipelines["fp32"]
    task_reason = reference.blendshapes_unavailable_reason
    data = {"machine": machine_info(device), "command": shlex.join(["python3", "bench/models.py", *sys.argv[1:]]),
            "blendshapes": "measured" if reference.measurer.blendshapes is not None else f"absent: {task_reason}",
            "face_stack": reference.landmarker,  # the main face table's: attention_mesh or face_landmarker
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "docs")},
            "litert": [], "faces": [], "detection": [], "embeddings": []}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1, default=str))

    # Inputs shared by the torch and LiteRT runs.
    with torch.inference_mode():
        frames8 = torch.from_numpy(np.stack(scenes[:8])).to(device)
        batch8 = roi.FrameBatch(frames8, device)
        pool = face_pool(reference, batch8)
        owners, boxes, keypoints, _ = pool
        rects = roi.rects_from_detections(boxes, keypoints)
        crops = roi.crop_rois(batch8, torch.tensor(owners, device=device), rects, 192).cpu().numpy()
        plans = reference.detector.plans_for((FRAME_HW,) * 2)
        short_taps, whole_taps = reference.detector.crop_taps(batch8, torch.arange(2, device=device), plans)
        short_inputs = short_taps.crop(batch8).float().cpu().numpy()
        whole = whole_taps.crop(batch8).float().cpu().numpy()
        side = _spec("full").anchors.input_size_px
        # LiteRT's full-range model takes 192x192: pieces of the whole-frame input, and as many
        # invokes a frame as cover its pixels (full_range_inputs_per_frame below).
        full_inputs = [frame[y:y + side, x:x + side] for frame in whole
                       for y in (0, whole.shape[1] - side) for x in (0, whole.shape[2] - side)]
        full_range_invokes = whole.shape[1] * whole.shape[2] / side ** 2
    print(f"{len(owners)} faces in 8 frames; LiteRT baseline ...", file=sys.stderr, flush=True)
    face_crops = list(crops)
    eye_crops = [c[60:124, 30:94] for c in crops]  # 64x64 around an eye: input only matters for timing
    blend_inputs = None
    if reference.measurer.blendshapes is not None:
        bundle = assets.blendshape_model(args.face_landmarker_task)
        with torch.inference_mode():
            measured = reference.measurer.measure(batch8, owners, rects, boxes, pool[3], [False] * len(owners))
        subset = [np.asarray(f.landmarks)[list(_blendshape_subset()), :2] for frame in measured.faces for f in frame]
        blend_inputs = (bundle.face_blendshapes, subset)
    landmarker_task = (args.landmarker_task if args.landmarker_task is not None
                       else assets.landmarker_bundle(None).path)
    landmarker_inputs = None
    if landmarker_task:
        bundle = assets.blendshape_model(landmarker_task)
        with torch.inference_mode():
            crops256 = roi.crop_rois(batch8, torch.tensor(owners, device=device), rects, 256).cpu().numpy()
            measured = reference.measurer.measure(batch8, owners, rects, boxes, pool[3], [False] * len(owners))
        # Real faces' landmarks (the reference stack's), as the blendshape model's input.
        subsets = [np.asarray(f.landmarks)[list(_blendshape_subset()), :2][None]
                   for frame in measured.faces for f in frame]
        landmarker_inputs = (bundle, list(crops256), subsets)
    data["litert"] = bench_litert(face_crops, eye_crops, (list(short_inputs), full_inputs, full_range_invokes), blend_inputs,
                                  task_reason, args.litert_threads, args.litert_repeats, landmarker_inputs)
    save()
    # The goals' sizes first, so that a run cut short by its time budget still has them.
    goal_cameras = [c for c in args.cameras if c == DETECTION_GOAL[0]]
    goal_batch = [b for b in args.batch_sizes if b == FACE_GOAL[0]]
    data["detection"] = bench_detection(pipelines, scenes, goal_cameras, args, budget)
    data["faces"] = bench_faces(pipelines, batch8, pool, goal_batch, args, budget)
    save()
    if landmarker_task:
        data["face_landmarker_task"] = str(landmarker_task)
        data["face_landmarker"] = bench_face_landmarker(device, args.variants, landmarker_task, batch8, pool,
                                                        FACE_GOAL[0], args, budget)
        save()
    with torch.inference_mode():
        measured = reference.measurer.measure(batch8, owners, rects, boxes, pool[3], [False] * len(owners))
    data["embeddings"] = bench_embeddings(device, batch8, measured, args.embedding_batch_sizes, args, budget)
    save()
    data["detection"] += bench_detection(pipelines, scenes, [c for c in args.cameras if c not in goal_cameras],
                                         args, budget)
    save()
    data["faces"] += bench_faces(pipelines, batch8, pool, [b for b in args.batch_sizes if b not in goal_batch],
                                 args, budget)
    order = {name: k for k, name in enumerate(args.variants)}
    data["detection"].sort(key=lambda r: (r["cameras"], order[r["variant"]]))
    data["faces"].sort(key=lambda r: (r["batch"], order[r["variant"]]))
    save()
    text = report(data)
    print(text)
    if args.docs:
        replace_section(Path(args.docs), SECTION_TITLE, text)
    return 0


def _spec(which: str):
    from facecast.models import anchors

    return anchors.FACE_SHORT_RANGE if which == "short" else anchors.FACE_FULL_RANGE


def _blendshape_subset():
    from facecast.models.blendshapes import LANDMARK_SUBSET

    return LANDMARK_SUBSET


if __name__ == "__main__":
    sys.exit(main())
