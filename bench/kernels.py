"""Each of facecast's Triton kernels against the PyTorch chain it replaces (Note [Kernels of our
own], models/triton_kernels.py): device time per call and how far the results are apart.

    python3 bench/kernels.py --out /tmp/kernels.json        # a GPU (bench/gpu_check.sh: kernels)

What is measured
----------------
*Crops*: `crop_rois` of the measuring stage (64 rotated rects of 100-400 px, 256x256, from 32
random 1080p frames on the device), in float16 and float32, replicated and black borders; the
chain is `crop_taps(...).crop(...)`, PyTorch's two parts (Note [Crop taps made once]). The
detectors' inputs for 32 1080p frames (the letterbox of 128x128 and the whole frame at 288x512,
float16, black border, -1..1): the chain both with its taps made per call and made once (as the
detection pass's CUDA graph had them). Apart: grey levels (of 0..255) between the kernel's
crops and the chain's in float32.
*Detections decoded*: FaceDetector.decode for 32 inputs of each detector (the short-range one's
128x128, the full-range one's over a 1080p frame, 288x512: tests/models/triton_inputs.py's raw
outputs), anchors.decode and the projection against the kernel; apart: the boxes' largest
difference (px), the scores', and how many anchors' validity differs.
*Weighted NMS's clustering*: 64 rows of 128 sorted candidates (boxes around three faces a row,
tied scores, a degenerate box), 8 slots: `nms._clusters`' chain against the kernel; apart:
whether the slots' validity and scores are equal, and the boxes' largest difference (px).
*Duplicate filter*: 64 and 256 faces in interleaved frames of up to 8 (tests/models/
triton_inputs.py): `nms.drop_overlapping_batched`'s tensors against the kernel;
apart: whether the kept faces and ranks are equal.
*Transformation matrices*: FaceGeometry.matrices (squaring) of 64 made-up faces of 478
landmarks (tests/models/triton_inputs.py); apart: the matrices' largest difference.
*A layer norm*: one of the blendshape model's (64 faces' 97 tokens of 64 channels), its ten
operators as PyTorch's kernels against the kernel; apart: the largest difference.
*PReLUs*: the v2 landmarker's largest activation (64 faces, 16 channels of 128x128, channels
last), float16 and float32: F.prelu, and a residual ADD with its PRELU (two kernels), against
the kernel; and a halving block's shortcut (Note [Residual shortcuts in one kernel]: a 2x2 max pool of
64 faces' 8 channels of 256x256, the PAD to 16 channels, the ADD and the PRELU, four kernels)
against the kernel; apart: the largest difference (0: the same values). A depthwise convolution's
bias (the full-range detector's largest output, 288 × 32 × 96 × 96, float16): PyTorch's add in
place against the kernel, each on a fresh copy (`clone_ms`: the copy alone).
*Depthwise convolutions*: three of the v2 landmarker's in float16 at 64 faces (8 channels of
128x128, 64 of 16x16 and of 8x8, channels last): `Conv2d` outside a graph's work (cuDNN's float32
route, cuDNN and the bias pass) against our kernel; apart: the largest difference.
*The attention mesh's custom operators* (its lips' options, 64 faces in float16, tests/models/
triton_inputs.py): the transform matrix, the feature map's crops, the landmarks mapped back, each
as its PyTorch against its kernel; apart: the largest difference (the kernels compute in
float32: Note [The attention mesh's custom operators in kernels]).
Device time: CUDA events around 50 calls queued back to back, after one call, ms per call.
Host time: the µs one call of the mesh crops takes to queue (the kernel against the chain's ~50
launches). `prepare_s`: compiling the crop kernel's four variants in this process (from
Triton's cache on disk when it has them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
import triton_inputs as inputs  # noqa: E402 - the tests' inputs, one definition

from facecast.models import nms, roi, triton_kernels  # noqa: E402

CALLS = 50


def device_ms(call) -> float:
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        call()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / CALLS, 4)


def host_us(call) -> float:
    call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(CALLS):
        call()
    spent = time.perf_counter() - started
    torch.cuda.synchronize()
    return round(spent / CALLS * 1e6, 1)


class WithoutKernel:
    """The PyTorch chain: the kernel's entry point answers None (cannot serve) meanwhile."""

    def __init__(self, name: str):
        self.name, self.kept = name, getattr(triton_kernels, name)

    def __enter__(self):
        setattr(triton_kernels, self.name, lambda *args, **kwargs: None)

    def __exit__(self, *exc):
        setattr(triton_kernels, self.name, self.kept)


def crops(device) -> dict:
    gen = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (32, 1080, 1920, 3), dtype=torch.uint8, generator=gen).to(device)
    batch = roi.FrameBatch(frames, device)
    count = 64
    index = torch.randint(0, 32, (count,), generator=gen).to(device)
    rects = roi.RotatedRects((torch.rand(count, 2, generator=gen) * torch.tensor([1920.0, 1080.0])).to(device),
                             (torch.rand(count, 2, generator=gen) * 300 + 100).to(device),
                             ((torch.rand(count, generator=gen) - 0.5) * 2).to(device))
    found = {}
    for dtype in (torch.float16, torch.float32):
        for border in ("replicate", "zero"):
            def chain():
                return roi.crop_taps(batch, index, rects, 256, border, dtype).crop(batch)

            def kernel():
                return triton_kernels.crop(batch, index, rects, (256, 256), border, dtype, (0.0, 1.0))

            truth = roi.crop_taps(batch, index, rects, 256, border, torch.float32).crop(batch)
            found[f"mesh crops, 64 x 256, {str(dtype)[6:]}, {border}"] = {
                "chain_ms": device_ms(chain), "kernel_ms": device_ms(kernel),
                "kernel_apart_levels": round(((kernel().float() - truth).abs().max() * 255).item(), 5),
                "chain_apart_levels": round(((chain().float() - truth).abs().max() * 255).item(), 5)}
    found["mesh crops, 64 x 256, float16, replicate"].update(
        chain_host_us=host_us(lambda: roi.crop_taps(batch, index, rects, 256, "replicate", torch.float16).crop(batch)),
        kernel_host_us=host_us(lambda: triton_kernels.crop(batch, index, rects, (256, 256), "replicate",
                                                           torch.float16, (0.0, 1.0))))
    every = torch.arange(32, device=device)
    sides = torch.tensor([[1920.0, 1920.0]] * 32)
    letterbox = roi.RotatedRects((sides / 2 - torch.tensor([0.0, 420.0])).to(device), sides.to(device),
                                 torch.zeros(32, device=device))
    whole = roi.RotatedRects(torch.tensor([[960.0, 540.0]] * 32, device=device),
                             torch.tensor([[1920.0, 1080.0]] * 32, device=device), torch.zeros(32, device=device))
    for name, rects_of, size in (("letterbox 128x128", letterbox, (128, 128)), ("whole frame 288x512", whole, (288, 512))):
        def taps(dtype, rr=rects_of, hw=size):
            return roi.crop_taps(batch, every, rr, hw, "zero", dtype, value_range=(-1.0, 1.0), axis_aligned=True)

        once = taps(torch.float16)
        truth = taps(torch.float32).crop(batch)
        kernel = (lambda rr=rects_of, hw=size: triton_kernels.crop(batch, every, rr, hw, "zero", torch.float16,
                                                                   (-1.0, 1.0)))
        found[f"detector inputs, 32 x {name}, float16"] = {
            "chain_ms": device_ms(lambda: taps(torch.float16).crop(batch)),
            "chain_taps_made_once_ms": device_ms(lambda: once.crop(batch)),
            "kernel_ms": device_ms(kernel),
            "kernel_apart_levels": round(((kernel().float() - truth).abs().max() * 127.5).item(), 5)}
    return found


def decoding(device) -> dict:
    from facecast.models import anchors as anchors_mod
    from facecast.models.face_detection import FaceDetector

    found = {}
    for spec, input_hw in ((anchors_mod.FACE_SHORT_RANGE, (128, 128)), (anchors_mod.FACE_FULL_RANGE, (288, 512))):
        raw, plan = inputs.raw_detections(spec, input_hw, rows=3, seed=1, device=device)
        raw = tuple(part.repeat(11, 1, 1)[:32] for part in raw)  # 32 frames
        plan = type(plan)(roi.RotatedRects.cat([plan.rects] * 11)[:32], plan.input_hw, plan.anchors)
        with WithoutKernel("decode_detections"):
            chain_ms = device_ms(lambda: FaceDetector.decode(None, raw, plan, spec))
            expected = FaceDetector.decode(None, raw, plan, spec)
        fused = FaceDetector.decode(None, raw, plan, spec)
        found[f"detections decoded, 32 x {spec.name} at {input_hw[0]}x{input_hw[1]}"] = {
            "chain_ms": chain_ms, "kernel_ms": device_ms(lambda: FaceDetector.decode(None, raw, plan, spec)),
            "boxes_apart_px": round((fused[0] - expected[0]).abs().max().item(), 6),
            "scores_apart": (fused[1] - expected[1]).abs().max().item(),
            "valid_differ": int((fused[3] != expected[3]).sum())}
    return found


def matrices(device) -> dict:
    geometry, landmarks, sizes = inputs.faces_for_geometry(64, seed=4, device=device)
    with WithoutKernel("face_matrices"):
        chain_ms = device_ms(lambda: geometry.matrices(landmarks, sizes))
        expected = geometry.matrices(landmarks, sizes)
    fused = geometry.matrices(landmarks, sizes)
    return {"transformation matrices, 64 faces": {
        "chain_ms": chain_ms, "kernel_ms": device_ms(lambda: geometry.matrices(landmarks, sizes)),
        "apart": (fused - expected).abs().max().item()}}


def layer_norms(device) -> dict:
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(64, 64, 1, 97, generator=gen) * 4 + 2).to(device)
    gamma = (torch.rand(64, generator=gen) + 0.5).to(device)

    def chain():  # LayerNormOverChannels' ten operators, as PyTorch's kernels run them
        mean = x.mean(dim=1, keepdim=True)
        negated = -mean
        scaled = torch.rsqrt(torch.square(x - mean).mean(dim=1, keepdim=True) + 1e-6) * gamma[None, :, None, None]
        return x * scaled + negated * scaled

    fused = triton_kernels.layer_norm_over_channels(x, gamma, 1e-6)
    return {"a layer norm of the blendshape model, 64 faces (64 channels x 97 tokens)": {
        "chain_ms": device_ms(chain), "kernel_ms": device_ms(lambda: triton_kernels.layer_norm_over_channels(
            x, gamma, 1e-6)), "apart": (fused - chain()).abs().max().item()}}


def channel_passes(device) -> dict:
    """The PReLUs and a depthwise convolution's bias (the kernels serve a CUDA graph's work only)."""
    with triton_kernels.graph_work():
        return _channel_passes(device)


def _channel_passes(device) -> dict:
    found = {}
    gen = torch.Generator().manual_seed(6)
    out = (torch.randn(288, 32, 96, 96, generator=gen) * 3).to(device, torch.float16).contiguous(
        memory_format=torch.channels_last)
    bias = torch.randn(32, generator=gen).to(device, torch.float16)
    summed = out.clone()
    triton_kernels.add_channel_bias(summed, bias)
    name = "a depthwise convolution's bias, the full-range detector's largest (288 x 32 x 96 x 96), float16"
    found[name] = {
        "chain_ms": device_ms(lambda: out.clone().add_(bias.reshape(1, -1, 1, 1))),
        "kernel_ms": device_ms(lambda: triton_kernels.add_channel_bias(out.clone(), bias)),
        "clone_ms": device_ms(lambda: out.clone()),
        "apart": (summed.float() - (out + bias.reshape(1, -1, 1, 1)).float()).abs().max().item()}
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float16, torch.float32):
        x, other = ((torch.randn(64, 16, 128, 128, generator=gen) * 3).to(device, dtype)
                    .contiguous(memory_format=torch.channels_last) for _ in range(2))
        alpha = (torch.rand(16, generator=gen) - 0.3).to(device, dtype)
        name = str(dtype).replace("torch.", "")
        found[f"a PRELU of the v2 landmarker, 64 faces (16 channels x 128 x 128), {name}"] = {
            "chain_ms": device_ms(lambda: F.prelu(x, alpha)),
            "kernel_ms": device_ms(lambda: triton_kernels.prelu(x, alpha)),
            "apart": (triton_kernels.prelu(x, alpha).float() - F.prelu(x, alpha).float()).abs().max().item()}
        found[f"a residual ADD and its PRELU, the same, {name}"] = {
            "chain_ms": device_ms(lambda: F.prelu(x + other, alpha)),
            "kernel_ms": device_ms(lambda: triton_kernels.prelu(x, alpha, other)),
            "apart": (triton_kernels.prelu(x, alpha, other).float() - F.prelu(x + other, alpha).float())
            .abs().max().item()}
        # The first halving block's shortcut: its input (8 channels of 256x256, before the block's
        # stride-2 convolution) pooled 2x2, widened to 16 channels, added, PRELU.
        source = (torch.randn(64, 8, 256, 256, generator=gen) * 3).to(device, dtype).contiguous(
            memory_format=torch.channels_last)

        def chain():
            return F.prelu(x + F.pad(F.max_pool2d(source, 2, 2), (0, 0, 0, 0, 0, 8)), alpha)

        found[f"a halving block's shortcut (max pool, channel PAD, ADD, PRELU), the same, {name}"] = {
            "chain_ms": device_ms(chain),
            "kernel_ms": device_ms(lambda: triton_kernels.pooled_residual_prelu(x, alpha, source)),
            "apart": (triton_kernels.pooled_residual_prelu(x, alpha, source).float() - chain().float())
            .abs().max().item()}
    return found


def convolutions(device) -> dict:
    """Float16 depthwise convolutions of the v2 landmarker at 64 faces (Note [Float16 depthwise
    convolutions]): what Conv2d runs outside a graph's work against our kernel (a graph's work)."""
    from facecast.models import tflite_ops

    found = {}
    gen = torch.Generator().manual_seed(8)
    for channels, size in ((8, 128), (64, 16), (64, 8)):
        weight = (torch.randn(channels, 1, 3, 3, generator=gen) / 3).numpy()
        conv = tflite_ops.Conv2d(weight, torch.randn(channels, generator=gen).numpy(), (1, 1), (1, 1), channels,
                                 (1, 1, 1, 1), 0).to(device, torch.float16)
        conv.weight = conv.weight.contiguous(memory_format=torch.channels_last)
        x = torch.randn(64, channels, size, size, generator=gen).to(device, torch.float16).contiguous(
            memory_format=torch.channels_last)
        chain = conv(x)
        with triton_kernels.graph_work():
            ours = conv(x)
            kernel_ms = device_ms(lambda: conv(x))
        name = f"a float16 depthwise convolution of the v2 landmarker, 64 faces ({channels} channels x {size} x {size})"
        found[name] = {
            "chain_ms": device_ms(lambda: conv(x)), "kernel_ms": kernel_ms,
            "apart": (ours.float() - chain.float()).abs().max().item()}
    return found


def custom_operators(device) -> dict:
    """The attention mesh's custom operators (its lips' options, 64 faces, float16: Note [The
    attention mesh's custom operators in kernels]): their PyTorch against our kernels (a graph's
    work)."""
    to_matrix, sample, mapping = (op.to(device) for op in inputs.attention_operators())
    landmarks, features = inputs.attention_crop_inputs(64, torch.float16, seed=23, device=device)
    matrix = to_matrix(landmarks)
    calls = {"the transform matrix (Landmarks2TransformMatrix)": lambda: to_matrix(landmarks),
             "the feature map's 16x16 crops (TransformTensorBilinear, 32 channels of 48 x 48)":
                 lambda: sample(features, matrix),
             "80 landmarks mapped back (TransformLandmarks)": lambda: mapping(landmarks[:, :80], matrix)}
    found = {}
    for name, call in calls.items():
        chain = call()
        with triton_kernels.graph_work():
            ours = call()
            kernel_ms = device_ms(call)
        found[f"{name}, 64 faces, float16"] = {"chain_ms": device_ms(call), "kernel_ms": kernel_ms,
                                               "apart": (ours.float() - chain.float()).abs().max().item()}
    return found


def clustering(device) -> dict:
    candidates = inputs.nms_candidates(rows=64, count=128, seed=3, device=device)
    with WithoutKernel("nms_clusters"):
        chain_ms = device_ms(lambda: nms._clusters(*candidates, 0.3, 8))
        expected = nms._clusters(*candidates, 0.3, 8)
    boxes, _, scores, valid = triton_kernels.nms_clusters(*candidates, 0.3, 8)
    return {"weighted NMS clustering, 64 rows x 128 candidates, 8 slots": {
        "chain_ms": chain_ms, "kernel_ms": device_ms(lambda: triton_kernels.nms_clusters(*candidates, 0.3, 8)),
        "same_valid": bool(torch.equal(valid, expected.valid)),
        "same_scores": bool(torch.equal(scores, expected.scores)),
        "boxes_apart_px": round((boxes - expected.boxes).abs().max().item(), 6)}}


def duplicates(device) -> dict:
    found = {}
    for count in (64, 256):
        (boxes, scores, groups, eligible), steps = inputs.faces_to_filter(count, seed=5, device=device)
        with WithoutKernel("drop_overlapping"):
            chain_ms = device_ms(lambda: nms.drop_overlapping_batched(boxes, scores, groups, eligible, 0.5, 4, steps))
            expected = nms.drop_overlapping_batched(boxes, scores, groups, eligible, 0.5, 4, steps)
        kept, rank = triton_kernels.drop_overlapping(boxes, scores, groups, eligible, 0.5, 4, steps)
        found[f"duplicate filter, {count} faces"] = {
            "chain_ms": chain_ms,
            "kernel_ms": device_ms(lambda: triton_kernels.drop_overlapping(boxes, scores, groups, eligible, 0.5, 4,
                                                                             steps)),
            "same_kept": bool(torch.equal(kept, expected[0])), "same_ranks": bool(torch.equal(rank, expected[1]))}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: the kernels are the GPU's")
    device = torch.device("cuda")
    import triton

    started = time.perf_counter()
    problem = triton_kernels.prepare(device, [(dtype, border) for dtype in triton_kernels.CROP_DTYPES
                                              for border in ("replicate", "zero")])
    if problem is not None:
        print(f"bench/kernels.py: Triton's kernels cannot run here: {problem}", file=sys.stderr)
        return 2
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(device), "python": platform.python_version(),
                          "torch": torch.__version__, "triton": triton.__version__},
              "prepare_s": round(time.perf_counter() - started, 2),
              "cases": {**crops(device), **decoding(device), **clustering(device),
                        **duplicates(device), **matrices(device), **layer_norms(device),
                        **channel_passes(device), **convolutions(device), **custom_operators(device)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| case | PyTorch chain ms | kernel ms | × |")
    print("|---|---|---|---|")
    for name, case in result["cases"].items():
        print(f"| {name} | {case['chain_ms']} | {case['kernel_ms']} | "
              f"{case['chain_ms'] / max(case['kernel_ms'], 1e-9):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
