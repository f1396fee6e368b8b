"""Where each model stack's device time goes, step by step: the face stacks (attention mesh, MediaPipe
FaceLandmarker) at one batch of faces and the detection pass over C 1080p frames.

    python bench/model_stages.py                     # on a GPU: fp16 and fp32, batch 64, 32 cameras
    python bench/model_stages.py --quick             # CPU check: batch 4, 2 cameras, fp32

On the offline GPU host: `bash bench/gpu_check.sh start stages` (bench/gpu_host_env.sh first).

What is measured
----------------
Each stack runs eagerly under torch.profiler with a ``record_function`` scope around each of its
steps (the crops, the landmark model, the blendshape model, the duplicate filter, the facial
transformation matrix, head pose, decoding, projection, weighted NMS, the merge: see STEPS). Every
operator's own kernel time (its ``self_device_time_total``) is given to the innermost step around
it, so a step's figure is the device's busy time for it, without the launch gaps an eager run has
between kernels; "kernels" is how many it launched. facecast's Triton kernels belong to no
operator: each is given to its step by its name (TRITON_STEPS; the decoding kernel also does the
projection, under "anchor decoding"). (Until 2026-11-27 11:00 the script skipped them: its run
of 10:13 that day had no row for them; its run of 11:51 added every device event of the profile
a second time, the steps' GPU ranges too, as "other (no operator)", 92-94 % of its totals.)
The same stack is then timed replayed from its
CUDA graphs (``cuda_graphs=True``), wall milliseconds with the device synchronised, as the daemon
runs it (`stack`: results on the device, calls queued back to back; `results`: Face objects on
the host, each call waiting for its own), and a `results` call split in two, each begun with the
device idle (`results queue`: the host's work until everything is queued; `results wait`: the
wait for the device and the Face objects), and the kernels the graphed stack runs (a profile of
10 replayed calls: kernels a call, their device time, the span from the first's start to the
last's end, the kernels that take the most; `graph_kernels`). On the CPU the
figures are each operator's own CPU time instead (a check that the script runs, not a figure to
report). The inputs are bench/models.py's: faces of real photos pasted into 1080p frames, the
ROIs from the float32 pipeline's detections, repeated up to the batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

import models as models_bench  # bench/models.py (this folder is on sys.path)

REPO = Path(__file__).resolve().parent.parent

# (module, attribute, step name): the functions whose calls are scoped. The landmark model's own
# forward is scoped per pipeline (`_scope_mesh`).
STEPS = (
    ("roi", "crop_rois", "crops"),
    ("roi", "project_points", "projection"),
    ("roi", "project_boxes", "projection"),
    ("face_mesh", "refine_attention_mesh", "mesh decoding"),
    ("face_landmarker", "decode", "mesh decoding"),
    ("blendshapes", "blendshapes", "blendshape model"),
    ("face_mesh", "boxes_from_landmarks", "boxes"),
    ("face_mesh", "landmark_bounds", "duplicate filter"),
    ("face_mesh", "drop_overlapping_batched", "duplicate filter"),
    ("face_geometry.FaceGeometry", "matrices", "transformation matrix"),
    ("face_mesh", "head_pose_from_matrices", "head pose"),
    ("face_mesh", "head_pose_deg", "head pose"),
    ("face_detection.anchors_mod", "decode", "anchor decoding"),
    ("face_detection", "weighted_nms_of_parts", "weighted NMS"),
    ("face_detection.FaceDetector", "merge", "merge"),
)
SCOPE = "step:"
# facecast's Triton kernels (models/triton_kernel_code.py) are launched by Triton, not by a
# PyTorch operator: the profile has them as kernels of no operator, given to their steps by name.
TRITON_STEPS = {"facecast_crop": "crops", "facecast_decode": "anchor decoding",
                "facecast_nms_clusters": "weighted NMS", "facecast_duplicates": "duplicate filter",
                "facecast_face_matrices": "transformation matrix", "facecast_layer_norm": "blendshape model"}


def install_scopes() -> None:
    """Wrap every STEPS function in a record_function scope named after its step."""
    import importlib

    from torch.profiler import record_function

    for where, attribute, step in STEPS:
        module_name, _, class_name = where.partition(".")
        owner = importlib.import_module(f"facecast.models.{module_name}")
        for part in filter(None, class_name.split(".")):
            owner = getattr(owner, part)
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def scoped(*args, _original=original, _name=SCOPE + step, **kwargs):
            with record_function(_name):
                return _original(*args, **kwargs)

        setattr(owner, attribute, scoped)
    # The detector's two forwards, told apart by their argument.
    from facecast.models.face_detection import FaceDetector

    outputs = FaceDetector.outputs

    def scoped_outputs(self, full_range, crops):
        with record_function(SCOPE + ("full-range detector" if full_range else "short-range detector")):
            return outputs(self, full_range, crops)

    FaceDetector.outputs = scoped_outputs


def _scope_mesh(pipeline, name: str) -> None:
    from torch.profiler import record_function

    mesh = pipeline.measurer.mesh
    forward = mesh.forward

    def scoped(*args, **kwargs):
        with record_function(SCOPE + name):
            return forward(*args, **kwargs)

    mesh.forward = scoped


def steps_of(run, device) -> dict:
    """{step: [kernels, µs]} of one eager call of ``run`` (see the module's docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(2):  # cuDNN's choices and the caches made before the profiled call
        run()
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(device)
    found: dict[str, list] = {}
    for event in prof.events():
        if event.device_type.name != "CPU":
            if not cuda:
                continue
            # The device's own events: every kernel (those of an operator are counted with it,
            # below) and the scopes' ranges; facecast's Triton kernels, of no operator, by name.
            step = TRITON_STEPS.get(event.name)
            if step is None:
                continue
            spent_us = event.time_range.elapsed_us()
        else:
            if event.name.startswith(SCOPE):
                continue
            spent_us = event.self_device_time_total if cuda else event.self_cpu_time_total
            if spent_us <= 0:
                continue
            parent, step = event.cpu_parent, "other"
            while parent is not None:
                if parent.name.startswith(SCOPE):
                    step = parent.name[len(SCOPE):]
                    break
                parent = parent.cpu_parent
        row = found.setdefault(step, [0, 0.0])
        row[0] += 1
        row[1] += spent_us
    return {step: [count, round(us, 1)] for step, (count, us) in
            sorted(found.items(), key=lambda item: -item[1][1])}


def graph_kernels(run, device, calls: int = 10, top: int = 12) -> dict:
    """The kernels one graphed call of ``run`` runs (a CUDA graph's nodes, as CUPTI sees them
    replayed): per call, their count, their summed device time and the span from the first's
    start to the last's end (the summed time plus the gaps between nodes, less any overlap),
    and the ``top`` kernels by time (name, count and µs per call)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize(device)
    by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    starts, ends = [], []
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        row = by_name[event.name[:100]]
        row[0] += 1
        row[1] += event.time_range.elapsed_us()
        starts.append(event.time_range.start)
        ends.append(event.time_range.end)
    if not starts:
        return {}
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"kernels_per_call": sum(count for count, _ in by_name.values()) / calls,
            "kernel_us_per_call": sum(us for _, us in by_name.values()) / calls,
            "span_us_per_call": (max(ends) - min(starts)) / calls,
            "top": [[name, count / calls, round(us / calls, 1)] for name, (count, us) in ranked]}


def wall_ms(run, device, iters: int) -> float:
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        run()
    sync()
    started = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - started) / iters * 1e3


def results_split_ms(measurer, call: tuple, device, iters: int, prefix: str) -> dict:
    """A `results` call in its two parts, each call begun with the device idle: `queue`, the
    host's work until the device's work and the copy back are queued (measure_start), and
    `wait`, the rest (measure_finish: the wait for the device, then the Face objects); medians.
    Their sum against `stack` (calls queued back to back) says how much of a serial call is
    host work the device waits for."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        measurer.measure(*call)
    queue, wait = [], []
    for _ in range(iters):
        sync()
        started = time.perf_counter()
        pending = measurer.measure_start(*call)
        queued = time.perf_counter()
        measurer.measure_finish(pending)
        queue.append(queued - started)
        wait.append(time.perf_counter() - queued)
    return {f"{prefix}_results_queue_ms": float(np.median(queue)) * 1e3,
            f"{prefix}_results_wait_ms": float(np.median(wait)) * 1e3}


def measure(row: dict, graphs: bool, device, iters: int, runs: dict) -> None:
    """Into ``row``: eager, the steps of the first of ``runs`` and its wall time; with graphs, the
    wall time of each of them."""
    if graphs:
        for name, run in runs.items():
            row[f"graphs_{name}_ms"] = wall_ms(run, device, iters)
    else:
        name, run = next(iter(runs.items()))
        row["steps"] = steps_of(run, device)
        row[f"eager_{name}_ms"] = wall_ms(run, device, iters)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    parser.add_argument("--quick", action="store_true", help="batch 4, 2 cameras, fp32: a check on the CPU")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cameras", type=int, default=32)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--face-landmarker-task", default=str(REPO / ".models" / "face_landmarker.task"))
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-model-stages.json")
    args = parser.parse_args()

    import torch

    from facecast.models import roi
    from facecast.models.pipeline import FacePipeline

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if args.quick:
        args.batch, args.cameras, args.iters = 4, 2, 1
    task = args.face_landmarker_task if Path(args.face_landmarker_task).exists() else None
    install_scopes()
    photos = models_bench.load_photos(None)
    scenes = [models_bench.make_scene(photos, 37 * k) for k in range(max(args.cameras, 8))]
    data = {"machine": models_bench.machine_info(device), "command": " ".join(["python3"] + sys.argv),
            "batch": args.batch, "cameras": args.cameras, "figures": "device µs" if cuda else "CPU µs",
            "rows": []}
    with torch.inference_mode():
        batch8 = roi.FrameBatch(torch.from_numpy(np.stack(scenes[:8])).to(device), device)
        pool = models_bench.face_pool(FacePipeline(device, max_faces=4), batch8)
        owners, rects, boxes, scores, _ = models_bench.face_batch(pool, args.batch)
        frames = torch.from_numpy(np.stack(scenes[:args.cameras])).to(device)
        tracked = [False] * args.batch
        for half in ((True, False) if cuda else (False,)):
            precision = "fp16" if half else "fp32"
            stacks = [("attention mesh", None)] + ([("FaceLandmarker", task)] if task else [])
            for name, bundle in stacks:
                row = {"what": f"{name}, batch {args.batch}", "precision": precision}
                for graphs in ((False, True) if cuda else (False,)):
                    pipe = FacePipeline(device, max_faces=4, face_landmarker_task=bundle, half=half,
                                        cuda_graphs=graphs)
                    _scope_mesh(pipe, "landmark model")
                    pipe.warm_up([], max_faces=args.batch)

                    def stack(pipe=pipe):
                        return pipe.measurer.measure_on_device(batch8, owners, rects, boxes, scores, tracked)

                    def results(pipe=pipe):
                        return pipe.measurer.measure(batch8, owners, rects, boxes, scores, tracked)

                    measure(row, graphs, device, args.iters, {"stack": stack, "results": results})
                    if graphs:  # what the measuring graph runs, kernel by kernel
                        row["graph_kernels"] = graph_kernels(stack, device)
                    row.update(results_split_ms(pipe.measurer, (batch8, owners, rects, boxes, scores, tracked),
                                                device, args.iters, "graphs" if graphs else "eager"))
                    del pipe
                data["rows"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            row = {"what": f"detection, {args.cameras} x 1080p", "precision": precision}
            for graphs in ((False, True) if cuda else (False,)):
                pipe = FacePipeline(device, max_faces=4, half=half, cuda_graphs=graphs)

                def detect(pipe=pipe):
                    return pipe.detect(roi.FrameBatch(frames, device))

                measure(row, graphs, device, args.iters, {"pass": detect})
                del pipe
            data["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(report(data))
    return 0


def report(data: dict) -> str:
    """One table per row of the run: each step's share of the kernel time."""
    unit = data["figures"]
    launched = "kernels" if unit.startswith("device") else "operators"
    lines = [f"{data['machine'].get('gpu', 'cpu')}, {data['machine']['date']}; {unit} per call, "
             "each operator's own, under the innermost step (bench/model_stages.py)", ""]
    for row in data["rows"]:
        total = sum(us for _, us in row["steps"].values())
        lines += [f"{row['what']}, {row['precision']}: {total:,.0f} {unit} in "
                  f"{sum(count for count, _ in row['steps'].values())} {launched}", "",
                  f"| step | {launched} | {unit} | share |", "|---|---|---|---|"]
        lines += [f"| {step} | {count} | {us:,.1f} | {100 * us / total:.0f} % |"
                  for step, (count, us) in row["steps"].items()]
        timed = {key: value for key, value in row.items() if key.endswith("_ms")}
        lines += ["", "wall: " + ", ".join(f"{key[:-3].replace('_', ' ')} {value:.2f} ms"
                                           for key, value in timed.items()), ""]
        graphed = row.get("graph_kernels")
        if graphed:
            lines += [f"graphed stack: {graphed['kernels_per_call']:.0f} kernels a call, "
                      f"{graphed['kernel_us_per_call']:,.0f} µs of kernel time, a span of "
                      f"{graphed['span_us_per_call']:,.0f} µs; the most time: "
                      + "; ".join(f"{name} ({count:g}×, {us:.1f} µs)" for name, count, us in graphed["top"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
