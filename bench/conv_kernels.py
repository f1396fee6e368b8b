"""Where the models' convolution time goes on a GPU, and what Note [Convolutions on the GPU]
(models/tflite_ops.py) chose: each convolution of each model, at the daemon's batches, timed in
a CUDA graph (20 calls per replay, 3 replays) under every kernel that could serve it.

Variants, per convolution, with the model's own weights and the input it gets on a real forward:
  F.conv2d         what facecast ran before: cuDNN, then the bias and the activation as passes
  no bias          F.conv2d without the bias (a reference for the bias passes' cost, not a result:
                   the outputs are wrong)
  fused ReLU       torch.cudnn_convolution_relu (convolutions with a ReLU)
  fused add+ReLU   torch.cudnn_convolution_add_relu with a zero residual (convolutions without)
  PyTorch dw       F.conv2d with cuDNN disabled (depthwise convolutions)
  rows             a 1x1 convolution as the NHWC rows' matrix product, bias (and ReLU) in the
                   epilogue (tflite_ops.pointwise_rows)
  facecast         the convolution as FacePipeline prepares it now (in float32, depthwise
                   biases moved into their 1x1 readers; then Conv2d.forward's choice)
  NCHW             float16 depthwise convolutions only: cuDNN on the input and weight made
                   contiguous (NCHW) once, outside the timing (the convolution alone)
  NCHW+layout      the same with both layout changes timed: the input to NCHW, the output back
                   to channels_last (what the model would run)
  in float32       float16 depthwise convolutions only: the input cast to float32, cuDNN's
                   float32 convolution with the bias, cast back (in CUDA graphs on an H100,
                   2026-11-27, cuDNN's float16 depthwise convolutions over channels_last took 3.8
                   times its float32 ones: docs/benchmarks.md)
  Triton dw        float16 depthwise convolutions only: facecast's kernel (triton_kernels.
                   depthwise_conv: float32 sums, the bias and activation in the same pass)
Every variant pads as the model needs (an explicit F.pad for TF's asymmetric SAME padding).
The table sums each variant over the convolutions it applies to, by kind; "F.conv2d" and
"facecast" apply to all, so their totals compare the models' whole convolution time.

    python3 bench/conv_kernels.py --out /tmp/conv-kernels.json [--dtype fp16 fp32]

Needs CUDA and the models (.models/ or `facecast models install`; the v2 landmarker from
--face-landmarker-task).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from facecast.models import anchors, assets, tflite_convert, tflite_ops, triton_kernels
from facecast.models.pipeline import FacePipeline

REPS, REPLAYS = 20, 3


def graph_us(fn) -> float:
    """GPU time of one call of `fn`, from CUDA graph replays of REPS calls; its warm-up and capture
    are a graph's work, as the models' (triton_kernels.graph_work: "facecast" with its kernels)."""
    with triton_kernels.graph_work():
        return _graph_us(fn)


def _graph_us(fn) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * REPS)


def convolution_inputs(model, shape, dtype) -> dict:
    """Each Conv2d of `model` -> the input it gets on a forward of a random batch."""
    seen = {}
    original = tflite_ops.Conv2d.forward

    def recording(conv, x):
        seen.setdefault(conv, x.detach().clone())
        return original(conv, x)

    tflite_ops.Conv2d.forward = recording
    try:
        with torch.inference_mode():
            model(torch.rand(*shape, device="cuda", dtype=dtype) * 2 - 1)
    finally:
        tflite_ops.Conv2d.forward = original
    return seen


def kind_of(conv: tflite_ops.Conv2d) -> str:
    shape = "depthwise" if conv.groups > 1 else "1x1" if conv.is_pointwise() else "kxk"
    activation = {0: "", 1: "+ReLU"}.get(conv.activation, f"+act{conv.activation}")
    return f"{shape} s{conv.stride[0]}{activation}"


def variants(before: tflite_ops.Conv2d, now: tflite_ops.Conv2d, x: torch.Tensor) -> dict:
    def padded():  # TF's asymmetric SAME padding, a pass of its own in every variant
        return F.pad(x, before.explicit_padding) if before.explicit_padding is not None else x

    w, b, act = before.weight, before.bias, before.activation
    geometry = (before.stride, before.conv_padding, before.dilation, before.groups)
    out = {
        "F.conv2d": lambda: tflite_ops._apply_activation(F.conv2d(padded(), w, b, *geometry), act),
        "no bias": lambda: tflite_ops._apply_activation(F.conv2d(padded(), w, None, *geometry), act),
        "facecast": lambda: now(x),
    }
    if b is not None and act == 1:
        out["fused ReLU"] = lambda: torch.cudnn_convolution_relu(padded(), w, b, *geometry)
    if b is not None and act == 0:
        zero = torch.zeros_like(F.conv2d(padded(), w, None, *geometry))
        out["fused add+ReLU"] = lambda: torch.cudnn_convolution_add_relu(
            padded(), w, zero, 1.0, b, *geometry)
    if before.groups > 1:
        def pytorch_depthwise():
            with torch.backends.cudnn.flags(enabled=False):
                return tflite_ops._apply_activation(F.conv2d(padded(), w, b, *geometry), act)
        out["PyTorch dw"] = pytorch_depthwise
    if before.is_pointwise():
        out["rows"] = lambda: tflite_ops.pointwise_rows(x, w, b, act)
    if before.groups > 1 and x.dtype == torch.float16:
        x_nchw, w_nchw = padded().contiguous(), w.contiguous()
        out["NCHW"] = lambda: tflite_ops._apply_activation(F.conv2d(x_nchw, w_nchw, b, *geometry), act)
        out["NCHW+layout"] = lambda: tflite_ops._apply_activation(
            F.conv2d(padded().contiguous(), w_nchw, b, *geometry), act).contiguous(memory_format=torch.channels_last)
        w32, b32 = w.float(), (b.float() if b is not None else None)
        out["in float32"] = lambda: tflite_ops._apply_activation(
            F.conv2d(padded().float(), w32, b32, *geometry), act).half()
        if before.dilation == (1, 1) and act in triton_kernels.DEPTHWISE_ACTIVATIONS:
            out["Triton dw"] = lambda: triton_kernels.depthwise_conv(padded(), w, b, before.stride,
                                                                     before.conv_padding, act)
    return out


COLUMNS = ["F.conv2d", "no bias", "fused ReLU", "fused add+ReLU", "PyTorch dw", "rows", "facecast", "NCHW",
           "NCHW+layout", "in float32", "Triton dw"]


def measure(name, before, now, shape, dtype) -> dict:
    convs_before = [m for m in before.modules() if isinstance(m, tflite_ops.Conv2d)]
    convs_now = [m for m in now.modules() if isinstance(m, tflite_ops.Conv2d)]
    inputs = convolution_inputs(now, shape, dtype)
    layers = []
    with torch.inference_mode():
        for index, (old, new) in enumerate(zip(convs_before, convs_now)):
            if new not in inputs:
                continue
            x = inputs[new]
            row = {"index": index, "kind": kind_of(old), "input": list(x.shape),
                   "weight": list(old.weight.shape), "us": {}}
            reference = None
            for label, fn in variants(old, new, x).items():
                try:
                    row["us"][label] = round(graph_us(fn), 2)
                except RuntimeError as exc:  # a kernel this GPU or build does not have
                    row["us"][label] = f"{type(exc).__name__}: {str(exc)[:100]}"
                    continue
                if label == "F.conv2d":
                    reference = fn().float()
                elif label in ("facecast", "rows", "fused ReLU", "NCHW", "NCHW+layout", "in float32"):
                    row.setdefault("max_abs_diff", {})[label] = float(
                        (fn().float() - reference).abs().max())
            layers.append(row)
    return {"model": name, "batch": shape[0], "dtype": str(dtype).replace("torch.", ""),
            "layers": layers}


def table(result) -> str:
    kinds = {}
    for layer in result["layers"]:
        sums = kinds.setdefault(layer["kind"], {"n": 0})
        sums["n"] += 1
        for label, us in layer["us"].items():
            if isinstance(us, float):
                sums[label] = sums.get(label, 0.0) + us
    total = {"n": sum(k["n"] for k in kinds.values())}
    for sums in kinds.values():
        for label in ("F.conv2d", "facecast"):
            total[label] = total.get(label, 0.0) + sums.get(label, 0.0)
    lines = [f"{result['model']}, batch {result['batch']}, {result['dtype']} (µs per batch):", "",
             "| convolutions | n | " + " | ".join(COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for kind, sums in sorted(kinds.items()) + [("all", total)]:
        cells = [f"{sums[c]:.0f}" if c in sums else "–" for c in COLUMNS]
        lines.append(f"| {kind} | {sums['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", nargs="+", default=["fp16", "fp32"], choices=["fp16", "fp32"])
    parser.add_argument("--face-landmarker-task", default=".models/face_landmarker.task")
    parser.add_argument("--detector-inputs", type=int, default=288,
                        help="full-range detector batch (32 1080p cameras: 9 inputs each)")
    parser.add_argument("--faces", type=int, default=64, help="landmarker batch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("conv_kernels: needs CUDA", file=sys.stderr)
        return 2
    results = []
    for dtype_name in args.dtype:
        dtype = torch.float16 if dtype_name == "fp16" else torch.float32
        pipeline = FacePipeline("cuda", half=dtype == torch.float16)
        bundle = assets.blendshape_model(args.face_landmarker_task)

        def before_of(module):  # prepared as before: zero PADs folded, biases where they were
            tflite_convert.fuse_zero_padding(module)
            module = module.to("cuda", dtype=dtype).eval()
            for conv in module.modules():
                if isinstance(conv, tflite_ops.Conv2d):
                    conv.weight = conv.weight.contiguous(memory_format=torch.channels_last)
            return module

        def both(path):
            return before_of(tflite_convert.convert(path)), pipeline._prepare(tflite_convert.convert(path))

        models = {
            "full-range detector": (*both(assets.model_path(anchors.FACE_FULL_RANGE.name)),
                                    (args.detector_inputs, 192, 192, 3)),
            "attention mesh": (*both(assets.model_path("face_landmark_with_attention")),
                               (args.faces, 192, 192, 3)),
            "v2 landmarker": (*both(bundle.face_landmarks_detector), (args.faces, 256, 256, 3)),
        }
        for name, (before, now, shape) in models.items():
            result = measure(name, before, now, shape, dtype)
            results.append(result)
            print(table(result), flush=True)
    args.out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(), "host": platform.node(),
        "reps_per_replay": REPS, "replays": REPLAYS, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
