"""Note [Kernels of our own]: each Triton kernel gives its PyTorch chain's results (the crops:
CropTaps.crop's bilinear gathers; the detections' decoding; the weighted NMS's clustering:
nms._clusters; the duplicate filter), on the CPU through Triton's interpreter
(triton_interpreter_checks.py, in a process of its own) and on the GPU compiled; where the
kernels cannot serve, the chains run and the reason is said once."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from facecast.models import nms, roi, triton_kernels
from triton_inputs import (assert_same_clusters, crop_rects, faces_for_geometry, faces_to_filter, nms_candidates,
                           raw_detections, two_photos)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")


REPO = Path(__file__).resolve().parents[2]


def test_each_kernel_gives_its_chains_results_in_tritons_interpreter():
    """tests/models/triton_interpreter_checks.py in a fresh process with TRITON_INTERPRET=1
    (Triton decides at its import whether its library is interpreted): every check passes,
    none skipped."""
    pytest.importorskip("triton", reason="Triton is not installed (the `test` extra has it)")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:xdist", "-p", "no:cacheprovider",
         str(REPO / "tests" / "models" / "triton_interpreter_checks.py")],
        cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.fullmatch(r"=* ?\d+ passed(, \d+ warnings?)? in .*", summary), summary


def test_where_the_kernel_cannot_serve_it_says_why_once(monkeypatch, caplog):
    """Not for CPU tensors (OpenCV crops there); not for other dtypes; a failing compiler or
    launcher is logged once, and from then on crop_rois keeps PyTorch's kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels, "_unavailable", None)
    monkeypatch.setattr(triton_kernels, "_failed", {})
    assert triton_kernels.unavailable_reason(torch.device("cpu")) == "the kernels are for CUDA devices"
    batch = roi.FrameBatch(two_photos(True), "cpu")
    rects, index = crop_rects()
    assert triton_kernels.crop(batch, index, rects, (8, 8), "zero", torch.float32, (0.0, 1.0)) is None

    def no_compiler():  # Triton's import or the kernels' module failing
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(triton_kernels, "_kernels", no_compiler)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as for a GPU: the kernel is asked for
    with caplog.at_level(logging.WARNING, logger="facecast.models.triton_kernels"):
        for _ in range(3):
            assert triton_kernels.crop(batch, index, rects, (8, 8), "zero", torch.float32, (0.0, 1.0)) is None
        assert triton_kernels.prepare(torch.device("cpu"), [(torch.float32, "zero")]).startswith(
            "RuntimeError: Failed to find C compiler")
    warnings = [r.getMessage() for r in caplog.records if "Triton's kernels" in r.getMessage()]
    assert len(warnings) == 1 and "C compiler" in warnings[0] and "PyTorch's kernels" in warnings[0]
    assert triton_kernels.crop(batch, index, rects, (8, 8), "zero", torch.bfloat16, (0.0, 1.0)) is None


def test_a_kernel_that_fails_leaves_the_others_in_use(monkeypatch, caplog):
    """A kernel whose compilation or launch fails is given up alone, said once with its name;
    the other kernels are still asked for."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as for a GPU: the kernels are asked for
    monkeypatch.setattr(triton_kernels, "_unavailable", None)
    monkeypatch.setattr(triton_kernels, "_failed", {})
    launched = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **constants):
                if self.name == "facecast_crop":
                    raise RuntimeError("PTX .version 9.0 does not support .target sm_120")
                launched.append(self.name)
            return launch

    class Kernels:
        def __getattr__(self, name):
            return Kernel(name)

    monkeypatch.setattr(triton_kernels, "_kernels", Kernels)
    batch = roi.FrameBatch(two_photos(True), "cpu")
    rects, index = crop_rects()
    device = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="facecast.models.triton_kernels"):
        for _ in range(2):
            assert triton_kernels.crop(batch, index, rects, (8, 8), "zero", torch.float32, (0.0, 1.0)) is None
        (boxes, scores, groups, eligible), steps = faces_to_filter(8, seed=1)
        assert triton_kernels.drop_overlapping(boxes, scores, groups, eligible, 0.5, 4, steps) is not None
    assert launched == ["facecast_duplicates"]
    assert triton_kernels.unavailable_reason(device, "facecast_crop").startswith("RuntimeError: PTX")
    assert triton_kernels.unavailable_reason(device, "facecast_duplicates") is None
    assert triton_kernels.unavailable_reason(device) is None
    warnings = [r.getMessage() for r in caplog.records if "Triton's kernel" in r.getMessage()]
    assert len(warnings) == 1 and "facecast_crop" in warnings[0] and "sm_120" in warnings[0]


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_crop_rois_is_one_kernel_with_the_gathers_values():
    """On the GPU machine the kernel compiles and serves crop_rois (a promise of the speed
    path), with the gathers' values, at the measuring stage's and the detectors' shapes."""
    device = torch.device("cuda")
    assert triton_kernels.prepare(device, [(torch.float16, "replicate"), (torch.float32, "zero")]) is None
    for bgr in (True, False):
        batch = roi.FrameBatch(two_photos(bgr), device, bgr=bgr)
        rects, index = crop_rects(device)
        for border, value_range in (("replicate", (0.0, 1.0)), ("zero", (-1.0, 1.0))):
            gathered = roi.crop_taps(batch, index, rects, (256, 256), border=border,
                                     value_range=value_range).crop(batch)
            grey = (value_range[1] - value_range[0]) / 255.0
            fused = roi.crop_rois(batch, index, rects, 256, border=border, value_range=value_range)
            assert (fused - gathered).abs().max().item() < 0.01 * grey
            half = roi.crop_rois(batch, index, rects, 256, border=border, dtype=torch.float16,
                                 value_range=value_range)
            assert (half.float() - gathered).abs().max().item() <= 2.0 ** -11 + 0.01 * grey
    assert triton_kernels.unavailable_reason(device) is None  # nothing fell back on the way


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_weighted_nms_clusters_in_one_kernel():
    """On the GPU machine nms._clusters runs the kernel, with the PyTorch chain's clusters."""
    device = torch.device("cuda")
    candidates = nms_candidates(rows=64, count=128, seed=3, device=device)
    fused = triton_kernels.nms_clusters(*candidates, 0.3, 8)
    assert fused is not None, triton_kernels.unavailable_reason(device)
    expected = nms._clusters(*(c.cpu() for c in candidates), 0.3, 8)  # PyTorch's chain, on the CPU
    assert_same_clusters(tuple(t.cpu() for t in fused), expected)
    found = nms.weighted_nms(candidates[0], candidates[1], candidates[2], candidates[3], 0.3, 8)
    assert torch.equal(found.valid.cpu(), expected.valid)


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_duplicate_filter_is_one_kernel():
    """On the GPU machine drop_overlapping_batched runs the kernel, with the tensors' result."""
    (boxes, scores, groups, eligible), steps = faces_to_filter(256, seed=5, device="cuda")
    fused = triton_kernels.drop_overlapping(boxes, scores, groups, eligible, 0.5, 4, steps)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cuda"))
    expected = nms.drop_overlapping_batched(boxes.cpu(), scores.cpu(), groups.cpu(), eligible.cpu(), 0.5, 4,
                                            steps)
    assert torch.equal(fused[0].cpu(), expected[0]) and torch.equal(fused[1].cpu(), expected[1])


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_detections_are_decoded_in_one_kernel():
    """On the GPU machine FaceDetector.decode runs the kernel, with the chains' results."""
    from facecast.models import anchors as anchors_mod
    from facecast.models.face_detection import FaceDetector

    spec = anchors_mod.FACE_FULL_RANGE
    raw, plan = raw_detections(spec, (288, 512), rows=3, seed=7, device="cuda")
    fused = triton_kernels.decode_detections(*raw, plan.anchors, plan.rects, plan.input_hw, spec.coord_scale_px,
                                             spec.anchors.input_size_px, spec.min_score)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cuda"))
    cpu_raw, cpu_plan = raw_detections(spec, (288, 512), rows=3, seed=7)
    boxes, scores, keypoints, valid = FaceDetector.decode(None, cpu_raw, cpu_plan, spec)  # the chains
    assert torch.allclose(fused[0].cpu(), boxes, rtol=1e-6, atol=1e-3)
    assert torch.allclose(fused[1].cpu(), scores, rtol=1e-5, atol=1e-6)
    assert torch.allclose(fused[2].cpu(), keypoints, rtol=1e-6, atol=1e-3)
    assert (fused[3].cpu() != valid).sum() <= 2  # an anchor on the minimum score may tip


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_transformation_matrices_are_one_kernel():
    """On the GPU machine FaceGeometry.matrices runs the kernel, with the chain's matrices (the
    same squaring on the CPU)."""
    geometry, landmarks, sizes = faces_for_geometry(64, seed=4)
    expected = geometry.matrices(landmarks, sizes)  # the chain, on the CPU
    used, canonical = geometry._model_on(torch.device("cuda"))
    from facecast.models import face_geometry

    fused = triton_kernels.face_matrices(landmarks.cuda(), sizes.cuda(), used, canonical, geometry.near,
                                         geometry.near_height, face_geometry.NUM_CANONICAL_VERTICES,
                                         face_geometry.PROCRUSTES_SQUARINGS,
                                         face_geometry._SQUARINGS_PER_NORMALISATION)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cuda"))
    assert torch.allclose(fused.cpu(), expected, rtol=1e-9, atol=1e-9)
    assert torch.allclose(geometry.matrices(landmarks.cuda(), sizes.cuda()).cpu(), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_blendshape_models_layer_norms_are_one_kernel_each(landmarker_bundle, monkeypatch,
                                                                          without_tf32):
    """On the GPU machine the fused model (a kernel per layer norm) gives the unfused model's
    scores, both on the GPU, in float32 without TF32 (which rounds the 19 convolutions' inputs
    to 10 bits: with it the scores were further apart than 1e-5 on the H100)."""
    from facecast.models import tflite_convert, tflite_ops

    path = landmarker_bundle.face_blendshapes
    plain = tflite_convert.convert(path).eval().cuda()
    fused = tflite_convert.convert(path)
    assert tflite_convert.fuse_layer_norms(fused) == 8
    fused = fused.eval().cuda()
    step = next(s.compute for s in fused.steps if isinstance(s.compute, tflite_ops.LayerNormOverChannels))
    x = torch.randn(2, 64, 1, 97, device="cuda")
    one = triton_kernels.layer_norm_over_channels(x, step.chain[6].constant1.reshape(-1), step.eps)
    assert one is not None
    with torch.inference_mode(), monkeypatch.context() as without:
        without.setattr(triton_kernels, "_unavailable", "left out for the comparison")
        assert torch.allclose(one, step(x), rtol=1e-5, atol=1e-6)  # one layer norm: its chain's
    points = torch.rand(64, 146, 2, generator=torch.Generator().manual_seed(5)).cuda() * 1000
    with torch.inference_mode():
        assert torch.allclose(plain(points)[0], fused(points)[0], atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_on_the_gpu_the_landmarkers_prelus_are_one_kernel_each_with_pytorchs_values(landmarker_bundle, half,
                                                                                   monkeypatch):
    """Note [PReLUs in one kernel]: on the GPU machine a PRELU, a residual ADD+PRELU and a pooled
    shortcut's (Note [Residual shortcuts in one kernel]) are one kernel in a graph's work with
    PyTorch's values to the bit, and so is the v2 landmarker prepared as the face stack prepares
    it (its 34 residual pairs fused): in a graph's work with the kernels, eagerly without them."""
    import torch.nn.functional as F

    from facecast.models import tflite_convert, tflite_ops
    from facecast.models.pipeline import FacePipeline

    dtype = torch.float16 if half else torch.float32
    gen = torch.Generator().manual_seed(4)
    x, other = ((torch.randn(64, 16, 128, 128, generator=gen) * 3).to("cuda", dtype)
                .contiguous(memory_format=torch.channels_last) for _ in range(2))
    alpha = (torch.rand(16, generator=gen) - 0.3).to("cuda", dtype)
    with triton_kernels.graph_work():
        assert torch.equal(triton_kernels.prelu(x, alpha), F.prelu(x, alpha))
        assert torch.equal(triton_kernels.prelu(x, alpha, other), F.prelu(x + other, alpha))
    pipeline = FacePipeline("cuda", half=half)
    model = pipeline._prepare(tflite_convert.convert(landmarker_bundle.face_landmarks_detector))
    # Of its 34 residual pairs, the 6 of the blocks that halve the image take their shortcut's
    # max pool (and PAD) too (Note [Residual shortcuts in one kernel]).
    assert sum(type(step.compute) is tflite_ops.ResidualPRelu for step in model.steps) == 28
    assert sum(type(step.compute) is tflite_ops.PooledResidualPRelu for step in model.steps) == 6
    source = (torch.randn(64, 8, 255, 255, generator=gen) * 3).to("cuda", dtype).contiguous(
        memory_format=torch.channels_last)
    shortcut = F.pad(F.max_pool2d(F.pad(source, (0, 1, 0, 1), value=float("-inf")), 2, 2), (0, 0, 0, 0, 0, 8))
    with triton_kernels.graph_work():
        assert torch.equal(triton_kernels.pooled_residual_prelu(x, alpha, source), F.prelu(x + shortcut, alpha))
    crops = (torch.rand(64, 256, 256, 3, generator=gen) * 2 - 1).to("cuda", dtype)
    with torch.inference_mode(), monkeypatch.context() as patch:
        # The depthwise kernel sums in its own order (tests/models/triton_interpreter_checks.py)
        patch.setitem(triton_kernels._failed, "facecast_depthwise", "left out: its sums' order is its own")
        with triton_kernels.graph_work():
            fused = model(crops)
        plain = model(crops)  # eagerly: PyTorch's kernels
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_landmarkers_few_channel_and_small_depthwise_convolutions_are_our_kernel(landmarker_bundle):
    """Note [Float16 depthwise convolutions]: in float16, in a graph's work, the v2 landmarker's
    four 8-channel 128x128 depthwise convolutions and its twenty 64-channel ones of 16x16 down to
    2x2 are one kernel of ours each, within one float16 step of PyTorch's float32 convolution.
    (The faces with them as without them, on real photos: the face stack's test below.)"""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from facecast.models import tflite_convert
    from facecast.models.pipeline import FacePipeline

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 8, 129, 129, generator=gen) * 2).to("cuda", torch.float16).contiguous(
        memory_format=torch.channels_last)
    weight = (torch.randn(8, 1, 3, 3, generator=gen) / 3).to("cuda", torch.float16)
    bias = torch.randn(8, generator=gen).to("cuda", torch.float16)
    expected = F.conv2d(x.float(), weight.float(), bias.float(), (2, 2), (0, 0), groups=8).half()
    with triton_kernels.graph_work():
        got = triton_kernels.depthwise_conv(x, weight, bias, (2, 2), (0, 0), 0)
    steps = (got.float() - expected.float()).abs() / expected.float().abs().clamp_min(2 ** -14)
    assert steps.max() <= 2 ** -10 and (got == expected).float().mean() > 0.9
    model = FacePipeline("cuda", half=True)._prepare(tflite_convert.convert(landmarker_bundle.face_landmarks_detector))
    crops = (torch.rand(64, 256, 256, 3, generator=gen) * 2 - 1).to("cuda", torch.float16)
    with torch.inference_mode(), triton_kernels.graph_work(), profile(activities=[ProfilerActivity.CUDA]) as profiled:
        model(crops)
        torch.cuda.synchronize()
    assert sum(event.name == "facecast_depthwise" for event in profiled.events()) == 4 + 20


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("stack", ["face_landmarker", "attention_mesh"])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_on_the_gpu_the_face_stack_gives_the_same_faces_with_and_without_the_kernels(
        landmarker_bundle, photos, monkeypatch, without_tf32, half, stack):
    """FaceLandmarker's stack, and the attention mesh's (Note [The attention mesh's custom
    operators in kernels]), with CUDA graphs, on real photos, tracked over frames: with every
    kernel, and with none (PyTorch's chains), the same faces: boxes, landmarks, presence,
    blendshapes, head pose and transformation matrix, to float rounding (float32 without TF32:
    with it the blendshapes came 0.0028 apart on the H100)."""
    import numpy as np

    from facecast.models.pipeline import FacePipeline
    from test_speed_paths import scene_1080p

    frames = [[scene_1080p(photos, 4 * step), scene_1080p(photos, 60 - 4 * step)] for step in range(4)]

    def faces_of(pipeline):
        return [pipeline.track(pair, ["a", "b"]) for pair in frames]

    task = landmarker_bundle.task_path if stack == "face_landmarker" else None
    with monkeypatch.context() as without:
        without.setattr(triton_kernels, "_unavailable", "left out for the comparison")
        chains = faces_of(FacePipeline("cuda", max_faces=4, face_landmarker_task=task, half=half, cuda_graphs=True))
    assert triton_kernels.unavailable_reason(torch.device("cuda")) is None
    kernels = faces_of(FacePipeline("cuda", max_faces=4, face_landmarker_task=task, half=half, cuda_graphs=True))
    assert [[len(f) for f in step] for step in chains] == [[len(f) for f in step] for step in kernels]
    assert sum(len(f) for step in chains for f in step) >= 20
    # Bounds of float rounding's size: in float16 the crops' last bits move the landmark model's
    # outputs as far as its own rounding does (docs/benchmarks.md: fp16 against fp32, the
    # landmark median 0.027 % of the face width and blendshapes within 0.02).
    width_share, presence, blendshape, degrees, matrix = ((0.01, 0.01, 0.03, 0.5, 0.5) if half
                                                          else (0.002, 1e-3, 2e-3, 0.1, 0.05))
    for step_chains, step_kernels in zip(chains, kernels):
        for frame_chains, frame_kernels in zip(step_chains, step_kernels):
            for ref, got in zip(sorted(frame_chains, key=lambda f: f.box), sorted(frame_kernels, key=lambda f: f.box)):
                bound = width_share * (ref.box[2] - ref.box[0])
                assert np.abs(np.subtract(ref.box, got.box)).max() <= bound
                assert np.abs(ref.landmarks[:, :2] - got.landmarks[:, :2]).max() <= bound
                assert abs(ref.presence - got.presence) <= presence
                assert np.abs(np.subtract(ref.head_pose, got.head_pose)).max() <= degrees
                if stack == "face_landmarker":
                    assert np.abs(ref.blendshapes - got.blendshapes).max() <= blendshape
                    assert np.abs(ref.transform_matrix - got.transform_matrix).max() <= matrix
