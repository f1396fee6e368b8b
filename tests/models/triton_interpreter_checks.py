"""Each Triton kernel (models/triton_kernels.py) against its PyTorch chain through Triton's
interpreter, on the CPU: run by tests/models/test_triton_kernels.py in a process of its own with
TRITON_INTERPRET=1, since Triton decides at its import whether its own library (tl.sum...) is
interpreted, and any other test of the run may have imported it before (Note [Kernels of our
own]). Not collected by pytest otherwise (the name does not start with test_)."""

from __future__ import annotations

import numpy as np
import pytest
import skimage.data
import torch
import torch.nn.functional as F

from facecast.models import nms, roi, triton_kernels
from triton_inputs import (SPECS, assert_same_clusters, attention_crop_inputs, attention_operators, crop_rects,
                           faces_for_geometry, faces_to_filter, nms_candidates, raw_detections, two_photos)


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter: the kernels on CPU tensors (numpy), the arithmetic a GPU runs."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    assert triton_kernels._interpreted(), "run with TRITON_INTERPRET=1 (test_triton_kernels.py does)"
    assert isinstance(triton.language.sum, InterpretedFunction), "Triton was imported before the variable"
    monkeypatch.setattr(triton_kernels, "_unavailable", None)
    monkeypatch.setattr(triton_kernels, "_failed", {})


@pytest.mark.parametrize("bgr, out_hw, value_range, border", [
    (True, (96, 96), (0.0, 1.0), "replicate"), (False, (64, 112), (-1.0, 1.0), "replicate"),
    (True, (64, 112), (-1.0, 1.0), "zero"), (False, (96, 96), (0.0, 255.0), "zero")])
def test_the_kernel_crops_as_the_gathers(interpreted, bgr, out_hw, value_range, border):
    """float32: the gathers' values to float rounding (< 0.01 of a grey level); float16: the
    float32 values rounded once (the gathers blend in float16, a little further off)."""
    batch = roi.FrameBatch(two_photos(bgr), "cpu", bgr=bgr)
    rects, index = crop_rects()
    gathered = roi.crop_taps(batch, index, rects, out_hw, border=border, value_range=value_range).crop(batch)
    grey = (value_range[1] - value_range[0]) / 255.0
    fused = triton_kernels.crop(batch, index, rects, out_hw, border, torch.float32, value_range)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert fused.shape == gathered.shape == (len(SPECS), *out_hw, 3) and fused.dtype == torch.float32
    assert (fused - gathered).abs().max().item() < 0.01 * grey
    half = triton_kernels.crop(batch, index, rects, out_hw, border, torch.float16, value_range)
    assert half.dtype == torch.float16
    # Rounded to float16 once: half a unit in the last place of the largest magnitude.
    bound = max(abs(value_range[0]), abs(value_range[1])) * 2.0 ** -11 + 0.01 * grey
    assert (half.float() - gathered).abs().max().item() <= bound
    if border == "zero":  # black beyond the frame
        assert (fused[4] == value_range[0]).all()


def test_the_kernel_crops_by_a_float_index_column_into_a_given_output(interpreted):
    """The measuring stage's call (FaceMeasurer._table_graphed_from_frames): the frames' indices
    read from the first column of its float32 ROI table (a strided view), the crops written into
    the graph's static; the same crops as by an integer index into a new tensor."""
    batch = roi.FrameBatch(two_photos(True), "cpu")
    rects, index = crop_rects()
    table = torch.full((len(index) + 3, 4), -1.0)
    table[:len(index), 0] = index.float()
    static = torch.zeros(len(index) + 3, 32, 32, 3)
    into = triton_kernels.crop(batch, table[:len(index), 0], rects, (32, 32), "replicate", torch.float32,
                               (0.0, 1.0), static[:len(index)])
    assert into is not None and into.data_ptr() == static.data_ptr()
    assert torch.equal(static[:len(index)], triton_kernels.crop(batch, index, rects, (32, 32), "replicate",
                                                                torch.float32, (0.0, 1.0)))
    assert (static[len(index):] == 0).all()  # the rows past the call's are left as they were


def test_the_kernel_reads_frames_where_they_lie(interpreted):
    """Frames in rows of one buffer with a gap (FrameBatch.in_place: row offsets) crop as the
    same frames stacked."""
    astronaut = np.ascontiguousarray(skimage.data.astronaut()[:300, :400, ::-1])
    coffee = np.ascontiguousarray(skimage.data.coffee()[:200, :400, ::-1])
    buffer = torch.zeros(astronaut.nbytes + 4 * 400 * 3 + coffee.nbytes, dtype=torch.uint8)
    first = buffer[:astronaut.nbytes].view(astronaut.shape)
    second = buffer[-coffee.nbytes:].view(coffee.shape)
    first.copy_(torch.from_numpy(astronaut))
    second.copy_(torch.from_numpy(coffee))
    in_place = roi.FrameBatch.in_place([first, second], "cpu")
    assert in_place.row_offsets_px == [0, 304]
    stacked = roi.FrameBatch([astronaut, coffee], "cpu")
    rects = roi.RotatedRects(torch.tensor([[200.0, 130.0], [200.0, 190.0], [390.0, 10.0]]),
                             torch.tensor([[150.0, 150.0], [180.0, 120.0], [60.0, 60.0]]),
                             torch.tensor([0.35, -0.5, 0.0]))
    index = torch.tensor([0, 1, 1])
    where_they_lie = triton_kernels.crop(in_place, index, rects, (64, 64), "replicate", torch.float32, (0.0, 1.0))
    assert torch.equal(where_they_lie,
                       triton_kernels.crop(stacked, index, rects, (64, 64), "replicate", torch.float32, (0.0, 1.0)))
    assert torch.equal(triton_kernels.crop(stacked, index[:0], rects[:0], (64, 64), "replicate", torch.float32,
                                        (0.0, 1.0)), torch.zeros(0, 64, 64, 3))


@pytest.mark.parametrize("count, slots", [(128, 8), (37, 4), (16, 8)])
def test_the_kernel_clusters_as_the_weighted_nms(interpreted, count, slots):
    """The same clusters (memberships, leaders' scores) and the same blends to float rounding
    as nms._clusters, with a candidate count that is not a power of two, more slots than
    clusters, degenerate boxes, tied scores and a row without a detection."""
    candidates = nms_candidates(rows=6, count=count, seed=count)
    expected = nms._clusters(*candidates, 0.3, slots)
    assert expected.valid.any(dim=1)[:-1].all() and not expected.valid[-1].any()
    fused = triton_kernels.nms_clusters(*candidates, 0.3, slots)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert_same_clusters(fused, expected)
    assert triton_kernels.nms_clusters(*(c[:0] for c in candidates), 0.3, slots)[3].shape == (0, slots)


@pytest.mark.parametrize("count, max_kept", [(64, 4), (45, 2), (7, 8)])
def test_the_kernel_filters_duplicates_as_the_tensors(interpreted, count, max_kept):
    """The same kept faces and ranks as nms.drop_overlapping_batched's tensors."""
    (boxes, scores, groups, eligible), steps = faces_to_filter(count, seed=count)
    expected = nms.drop_overlapping_batched(boxes, scores, groups, eligible, 0.5, max_kept, steps)
    assert 0 < int(expected[0].sum()) < int(eligible.sum())  # something was dropped
    fused = triton_kernels.drop_overlapping(boxes, scores, groups, eligible, 0.5, max_kept, steps)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])


@pytest.mark.parametrize("detector, input_hw", [("short", (128, 128)), ("full", (288, 512))])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100): inf, 0 after
def test_the_kernel_decodes_detections_as_the_chains(interpreted, detector, input_hw):
    """anchors.decode and the projection (FaceDetector.decode on the CPU): the same boxes,
    keypoints and scores to float rounding, the same valid anchors."""
    from facecast.models import anchors as anchors_mod
    from facecast.models.face_detection import FaceDetector

    spec = anchors_mod.FACE_SHORT_RANGE if detector == "short" else anchors_mod.FACE_FULL_RANGE
    raw, plan = raw_detections(spec, input_hw, rows=3, seed=len(detector))
    boxes, scores, keypoints, valid = FaceDetector.decode(None, raw, plan, spec)
    fused = triton_kernels.decode_detections(*raw, plan.anchors, plan.rects, plan.input_hw, spec.coord_scale_px,
                                             spec.anchors.input_size_px, spec.min_score)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert torch.allclose(fused[0], boxes, rtol=1e-6, atol=1e-3)
    assert torch.allclose(fused[1], scores, rtol=1e-5, atol=1e-7)
    assert torch.allclose(fused[2], keypoints, rtol=1e-6, atol=1e-3)
    assert torch.equal(fused[3], valid) and 0 < int(valid.sum()) < valid.numel()
    assert fused[1][0, 0] == 0.0 and fused[1][0, 1] == 1.0  # the clamped logits


def test_the_kernel_makes_the_transformation_matrices_as_the_chain(interpreted):
    """FaceGeometry.matrices by squaring (the GPU's chain, here on the CPU): the same matrices
    to float64 rounding, for faces turned, scaled and moved in frames of three sizes."""
    from facecast.models import face_geometry

    geometry, landmarks, sizes = faces_for_geometry(7, seed=3)
    expected = geometry.matrices(landmarks, sizes)
    used, canonical = geometry._model_on(landmarks.device)
    fused = triton_kernels.face_matrices(landmarks, sizes, used, canonical, geometry.near, geometry.near_height,
                                         face_geometry.NUM_CANONICAL_VERTICES, face_geometry.PROCRUSTES_SQUARINGS,
                                         face_geometry._SQUARINGS_PER_NORMALISATION)
    assert fused is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert fused.dtype == torch.float64 and fused.shape == (7, 4, 4)
    assert torch.allclose(fused, expected, rtol=1e-9, atol=1e-9), (fused - expected).abs().max()
    assert not torch.allclose(expected[0], expected[1])  # the faces differ


@pytest.mark.parametrize("layout", ["contiguous", "channels last"])
def test_the_kernel_normalises_layers_as_the_chain(interpreted, layout):
    """tflite_ops.LayerNormOverChannels' ten operators (written out here) against the kernel,
    for the blendshape model's (N, 64, 1, 97) activations in either memory layout."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, 1, 97, generator=gen) * 4 + 2
    if layout == "channels last":
        x = x.contiguous(memory_format=torch.channels_last)
    gamma = torch.rand(64, generator=gen) + 0.5
    eps = 1.0133e-06
    mean = x.mean(dim=1, keepdim=True)
    scaled = torch.rsqrt(torch.square(x - mean).mean(dim=1, keepdim=True) + eps) * gamma[None, :, None, None]
    expected = x * scaled + (-mean) * scaled
    got = triton_kernels.layer_norm_over_channels(x, gamma, eps)
    assert got is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert got.stride() == x.stride()
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True], ids=["prelu", "add+prelu"])
def test_the_kernel_applies_prelus_as_pytorch(interpreted, dtype, residual):
    """tflite_ops.ChannelPRelu's F.prelu (and ResidualPRelu's of a sum) against the kernel, bit for
    bit, over a channels-last image of 24 channels whose size is no multiple of the kernel's
    block, in a CUDA graph's work only; an image held otherwise, or a residual held otherwise
    than x, is left to PyTorch."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 24, 13, 17, generator=gen) * 3).to(dtype).contiguous(memory_format=torch.channels_last)
    other = (torch.randn(3, 24, 13, 17, generator=gen) * 3).to(dtype).contiguous(memory_format=torch.channels_last)
    alpha = (torch.rand(24, generator=gen) - 0.3).to(dtype)
    expected = F.prelu(x + other if residual else x, alpha)
    assert triton_kernels.prelu(x, alpha, other if residual else None) is None  # outside a graph's work
    with triton_kernels.graph_work():
        got = triton_kernels.prelu(x, alpha, other if residual else None)
        assert got is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
        assert got.dtype == dtype and got.stride() == x.stride()
        assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()
        assert (expected < 0).any() and (expected > 0).any()  # both sides of the PRELU were taken
        assert triton_kernels.prelu(x.contiguous(), alpha) is None
        if residual:
            assert triton_kernels.prelu(x, alpha, other.contiguous()) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("source_hw, source_channels", [((13, 17), 16), ((14, 18), 24)],
                         ids=["odd-size-fewer-channels", "even-size-same-channels"])
def test_the_kernel_applies_a_pooled_shortcut_as_the_operators(interpreted, dtype, source_hw, source_channels):
    """tflite_ops.PooledResidualPRelu's operators (the 2x2 stride-2 max pool, TF's SAME padding
    on an odd size, the PAD of zero channels, the ADD and the PRELU) against the kernel, bit
    for bit, in a CUDA graph's work only; a source held otherwise is left to PyTorch."""
    from facecast.models import tflite_ops

    gen = torch.Generator().manual_seed(17)
    x = (torch.randn(2, 24, 7, 9, generator=gen) * 3).to(dtype).contiguous(memory_format=torch.channels_last)
    source = (torch.randn(2, source_channels, *source_hw, generator=gen) * 3).to(dtype).contiguous(
        memory_format=torch.channels_last)
    alpha = (torch.rand(24, generator=gen) - 0.3).to(dtype)
    odd = source_hw[0] % 2
    pool = tflite_ops.MaxPool2d((2, 2), (2, 2), (0, odd, 0, odd), activation=0)
    pad = tflite_ops.Pad((1, *source_hw, source_channels), (1, 7, 9, 24), (0, 0, 0, 0, 0, 24 - source_channels),
                         full=False, value=0.0) if source_channels < 24 else None
    shortcut = pool(source) if pad is None else pad(pool(source))
    expected = F.prelu(x + shortcut, alpha)
    assert triton_kernels.pooled_residual_prelu(x, alpha, source) is None  # outside a graph's work
    with triton_kernels.graph_work():
        got = triton_kernels.pooled_residual_prelu(x, alpha, source)
        assert got is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
        assert got.dtype == dtype and got.stride() == x.stride()
        assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()
        assert (expected < 0).any() and (expected > 0).any()
        assert triton_kernels.pooled_residual_prelu(x, alpha, source.contiguous()) is None
        module = tflite_ops.PooledResidualPRelu(alpha, pool, pad, shortcut_position=1)
        assert torch.equal(module(x, source), expected)  # the step, with the kernel
    assert torch.equal(module(x, source), expected)  # and without it: the operators


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_adds_a_convolutions_bias_as_pytorch(interpreted, dtype):
    """A depthwise convolution's bias (tflite_ops.Conv2d._float16_depthwise) added in place by
    the kernel: PyTorch's add's values, bit for bit, in a CUDA graph's work only; elsewhere
    (and for an image held otherwise) None, the output untouched."""
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(2, 40, 9, 11, generator=gen) * 3).to(dtype).contiguous(memory_format=torch.channels_last)
    bias = (torch.randn(40, generator=gen) * 2).to(dtype)
    expected = x + bias.reshape(1, -1, 1, 1)
    kept = x.clone()
    assert triton_kernels.add_channel_bias(x, bias) is None and torch.equal(x, kept)
    with triton_kernels.graph_work():
        assert triton_kernels.add_channel_bias(x.contiguous(), bias) is None
        got = triton_kernels.add_channel_bias(x, bias)
    assert got is x, triton_kernels.unavailable_reason(torch.device("cpu"))
    assert torch.equal(x, expected), (x.float() - expected.float()).abs().max()


@pytest.mark.parametrize("channels, kernel, stride, padding, activation, with_bias", [
    (8, 3, 1, 1, 0, True), (8, 5, 2, 0, 1, False), (24, 3, 2, 1, 3, True), (3, 3, 1, 0, 0, True)])
def test_the_kernel_convolves_depthwise_as_pytorch_in_float32(interpreted, channels, kernel, stride, padding,
                                                               activation, with_bias):
    """A float16 depthwise convolution (tflite_ops.Conv2d._float16_depthwise) in one kernel:
    PyTorch's float32 convolution of the same float16 values, its bias and activation, rounded
    once to float16 (the sums' order may differ: at most one float16 step apart); channel counts
    under, at and over the kernel's block, strides, padding, every activation it takes. In a
    CUDA graph's work only; an image held otherwise, a dilation or another activation is left
    to PyTorch."""
    gen = torch.Generator().manual_seed(17)
    x = (torch.randn(2, channels, 13, 11, generator=gen) * 2).half().contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(channels, 1, kernel, kernel, generator=gen) / kernel).half()
    bias = (torch.randn(channels, generator=gen)).half() if with_bias else None
    expected = F.conv2d(x.float(), weight.float(), bias.float() if with_bias else None, stride, padding,
                        groups=channels)
    expected = {0: expected, 1: expected.relu(), 3: expected.clamp(0, 6)}[activation].half()
    geometry = ((stride, stride), (padding, padding), activation)
    assert triton_kernels.depthwise_conv(x, weight, bias, *geometry) is None  # outside a graph's work
    with triton_kernels.graph_work():
        got = triton_kernels.depthwise_conv(x, weight, bias, *geometry)
        assert got is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
        assert triton_kernels.depthwise_conv(x.contiguous(), weight, bias, *geometry) is None
        assert triton_kernels.depthwise_conv(x, weight, bias, (stride, stride), (padding, padding), 4) is None
    assert got.shape == expected.shape and got.is_contiguous(memory_format=torch.channels_last)
    steps = (got.float() - expected.float()).abs() / expected.float().abs().clamp_min(2 ** -14)
    assert (steps <= 2 ** -10).all(), steps.max()  # one float16 step (10 bits of mantissa)
    assert (got == expected).float().mean() > 0.9  # mostly the same bits
    if activation:
        assert (expected == 0).any() and (expected > 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernels_run_the_attention_meshs_custom_operators_as_pytorch(interpreted, dtype):
    """custom_ops' three operators (the lips' options of the attention mesh) against their
    PyTorch modules: the transform matrix to float32 rounding (its angle is computed without
    atan2); the sampled feature map (grid_sample's positions round-trip through [-1, 1]: 1e-4)
    and the mapped landmarks to float32 rounding in float32 and,
    in float16, within float16 rounding of PyTorch's float32 values (the kernels compute in
    float32 and round once). In a CUDA graph's work only."""
    to_matrix, sample, mapping = attention_operators()
    landmarks, features = attention_crop_inputs(3, dtype, seed=23)
    subset = to_matrix.subset
    arguments = (subset, 61, 291, 0.0, (16, 16), (1.5, 1.5))
    assert triton_kernels.landmarks_to_matrix(landmarks, *arguments) is None  # outside a graph's work
    expected_matrix = to_matrix(landmarks.float())
    with triton_kernels.graph_work():
        matrix = triton_kernels.landmarks_to_matrix(landmarks, *arguments)
        assert matrix is not None, triton_kernels.unavailable_reason(torch.device("cpu"))
        assert torch.allclose(matrix, expected_matrix, rtol=1e-5, atol=1e-4), (matrix - expected_matrix).abs().max()
        matrix = matrix.to(dtype)  # as the operator hands it on
        sampled = triton_kernels.transform_bilinear(features, matrix, (16, 16))
        sampled_nchw = triton_kernels.transform_bilinear(features.contiguous(), matrix, (16, 16))
        mapped = triton_kernels.transform_landmarks(landmarks[:, :80], matrix)
        mapped_2d = triton_kernels.transform_landmarks(landmarks[:, :5, :2].contiguous(), matrix)
    expected_sampled = sample(features.float(), matrix.float())
    expected_mapped = mapping(landmarks[:, :80].float(), matrix.float())
    assert sampled.dtype == dtype and sampled.shape == expected_sampled.shape
    # held as the features are: the refinement branches then run channels-last (Note [Batch and layout])
    assert sampled.is_contiguous(memory_format=torch.channels_last) and not sampled.is_contiguous()
    assert sampled_nchw.is_contiguous() and torch.equal(sampled_nchw, sampled)
    assert mapped.dtype == dtype and mapped.shape == expected_mapped.shape
    assert (expected_sampled != 0).float().mean() > 0.5 and (expected_sampled == 0).any()  # inside and out
    if dtype == torch.float32:
        # grid_sample's positions go to [-1, 1] and back: ~1e-6 px apart from the kernel's
        assert torch.allclose(sampled, expected_sampled, rtol=1e-5, atol=1e-4)
        assert torch.allclose(mapped, expected_mapped, rtol=1e-5, atol=1e-4)
    else:
        assert torch.allclose(sampled.float(), expected_sampled, rtol=2 ** -10, atol=2 ** -14)
        assert torch.allclose(mapped.float(), expected_mapped, rtol=2 ** -10, atol=2 ** -14)
    assert torch.allclose(mapped_2d.float(), expected_mapped[:, :5, :2], rtol=2 ** -10, atol=1e-4)


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("full_range", [False, True])
def test_the_nv12_kernel_writes_the_torch_forms_bytes_into_the_given_memory(interpreted, matrix,
                                                                             full_range):
    """Note [NV12 to BGR into memory of the process's own]: the kernel's bytes in the given
    tensor are PyTorch's form's (the same terms in the same order, no fused multiply-adds), but
    for a grey level at float32's ties."""
    from facecast.workers.capture import nvdec

    colour = nvdec.YuvToBgr(matrix, full_range)
    height, width = 36, 50  # a last program only partly inside the frame
    nv12 = torch.randint(0, 256, (height * 3 // 2, width), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(13))
    out = torch.full((height, width, 3), 7, dtype=torch.uint8)
    assert triton_kernels.nv12_to_bgr(nv12, out, nvdec._terms(colour)) is out, (
        triton_kernels.unavailable_reason(torch.device("cpu")))
    by_torch = nvdec.converted_by_torch(nv12, height, width, colour)
    difference = (out.int() - by_torch.int()).abs()
    assert difference.max() <= 1 and (difference > 0).sum() <= 3, int((difference > 0).sum())


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("size", [(36, 48), (24, 1400)])
def test_the_nv12_slot_kernel_writes_the_frame_and_sums_the_checksum_of_what_it_wrote(
        interpreted, matrix, size):
    """Note [NV12 into the slot]: the slot gets the NV12 kernel's bytes to the bit, the partial
    sums add up to Note [Frame checksum] of those bytes, and a checksum taken of other bytes (one
    byte off) is not that sum. (24 x 1400: a last program only partly inside the frame.)"""
    from facecast.shared.transport import frames
    from facecast.workers.capture import nvdec

    colour = nvdec.YuvToBgr(matrix, False)
    height, width = size
    nv12 = torch.randint(0, 256, (height * 3 // 2 * width,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(17))
    nbytes = height * width * 3
    slot = torch.full((nbytes + 64,), 7, dtype=torch.uint8)  # a slot's padding after the frame
    weights, _ = frames.frame_word_weights(nbytes, slot.device)
    partials = torch.empty(triton_kernels.nv12_slot_partial_count(nbytes), dtype=torch.int64)
    assert triton_kernels.nv12_to_slot(nv12, slot[:nbytes], height, width, nvdec._terms(colour),
                                       weights, partials) is partials, (
        triton_kernels.unavailable_reason(torch.device("cpu")))
    expected = torch.zeros((height, width, 3), dtype=torch.uint8)
    assert triton_kernels.nv12_to_bgr(nv12, expected, nvdec._terms(colour)) is expected
    assert torch.equal(slot[:nbytes], expected.view(-1))
    assert (slot[nbytes:] == 7).all()  # nothing written past the frame
    checksum = frames.checksum(expected.numpy())
    assert frames.sum_of_partials(partials) == checksum
    other = expected.clone()
    other.view(-1)[nbytes // 2] ^= 1
    assert frames.checksum(other.numpy()) != checksum
