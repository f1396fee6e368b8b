"""The pipeline's fast paths (bench/models.py measures them) give the results of the plain ones.

CPU: the batched helpers against straightforward per-frame / per-tile versions of the same rules
(the tile-border test, the detector's input plan, detection frame by frame, the crops against
``grid_sample`` over float frames), the model rewrites against the unrewritten models (folded
PADs, the one-kernel PReLU), the CUDA-graph bookkeeping (buckets, static buffers, chunks,
fallback) with the capture replaced by a plain call, and which stages a CUDA graph can capture
(no tensor made from host data, no wait for the device inside them).

GPU (marker ``gpu``): float16 and CUDA graphs against the float32 eager pipeline on real photos.
Tolerances, as fractions of the face's box width (the scale at which MediaPipe's own accuracy is
judged, 2% median in test_pipeline_accuracy.py):
- CUDA graphs, float32: median landmark difference ≤ 0.1%, 99th percentile ≤ 1%, box IoU ≥ 0.99
  (only the batch size, and so cuDNN's choice of algorithm, differs: padding to a bucket);
- float16 (with or without graphs): median ≤ 0.5%, 99th percentile ≤ 5%, box IoU ≥ 0.95,
  presence within 0.02, head pose within 1.5°. The 99th percentile is the refined lips, eyes and
  irises, whose crops follow float16 landmarks (test_convert_parity.py's FP16_REFINED_TOLERANCE
  allows them 5e-2 of the model's 192 px input). Torch's CPU float16 gave median 0.04% and
  99th percentile 3.5-6% on these photos; CUDA accumulates in float32.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from facecast.models import (anchors, cuda_graphs, face_detection, face_mesh, roi, tflite_convert, tflite_ops,
                             triton_kernels)
from facecast.models.nms import box_iou, weighted_nms
from facecast.models.pipeline import FacePipeline

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")
MODELS = ("face_detection_short_range", "face_detection_full_range", "face_landmark_with_attention")


def _require_models(installed_models):
    missing = [name for name in MODELS if name not in installed_models]
    if missing:
        pytest.skip(f"MediaPipe models not installed ({', '.join(missing)}); run `facecast models install`")


def _bgr(rgb: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rgb[..., ::-1])


def _paste(canvas: np.ndarray, rgb: np.ndarray, scale: float, x_px: int, y_px: int) -> None:
    small = cv2.resize(rgb, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
    h, w = small.shape[:2]
    canvas[y_px:y_px + h, x_px:x_px + w] = small


def scene_1080p(photos, shift_px: int = 0) -> np.ndarray:
    """A 1920x1080 BGR frame with three faces of about 200, 100 and 70 px."""
    canvas = np.full((1080, 1920, 3), 110, np.uint8)
    _paste(canvas, photos["grace_hopper"], 0.8, 150 + shift_px, 200)
    _paste(canvas, photos["astronaut"], 1.0, 900, 300 + shift_px // 2)
    _paste(canvas, photos["astronaut"], 0.75, 1500 + shift_px // 3, 650)
    return _bgr(canvas)


@pytest.fixture(scope="module")
def cpu_pipeline(installed_models):
    _require_models(installed_models)
    # One thread: on a 2-core machine with another busy process (CI), two OpenMP threads wait
    # for each other's time slices at every op (a 300-frame test ran past 300 s that way).
    torch.set_num_threads(1)
    # Every model a converted torch module, as on a GPU (not LiteRT: Note [LiteRT on the CPU]):
    # these tests hold the code that the CUDA graphs capture.
    return FacePipeline("cpu", max_faces=4, cpu_runtime="torch")


# -- batching helpers --------------------------------------------------------------------------


def test_buckets_are_powers_of_two_up_to_the_cap():
    assert [cuda_graphs.bucket(n, 32) for n in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]
    assert cuda_graphs.bucket(200, 256) == 256 and cuda_graphs.bucket(64, 256) == 64
    assert cuda_graphs.buckets_up_to(5, 4) == [1, 2, 4] and cuda_graphs.buckets_up_to(9) == [1, 2, 4, 8, 16]


def test_large_batches_run_in_power_of_two_pieces():
    pieces = cuda_graphs.batch_pieces
    # 32 1080p frames' full-range inputs: 256 + 32, not 512 (Note [Warm shapes]).
    assert pieces(288, 16) == [256, 32] and pieces(300, 16) == [256, 64]
    assert pieces(40, 16) == [64] and pieces(3, 16) == [16] and pieces(130, 16) == [128, 16]
    assert pieces(128) == [128] and pieces(65) == [64, 1]
    assert cuda_graphs.shapes_up_to(288, 16) == [16, 32, 64, 128, 256]
    # 64 cameras: no 512 piece, whose shape would cost one more preparation at boot.
    assert pieces(576, 16) == [256, 256, 64] and pieces(1000) == [256, 256, 256, 128, 64, 64]
    assert cuda_graphs.shapes_up_to(576, 16) == [16, 32, 64, 128, 256]
    for count in range(1, 600):
        assert sum(pieces(count, 16)) >= count and all(p >= 16 for p in pieces(count, 16))


@pytest.mark.parametrize("count", [1, 40, 65, 130, 288])
def test_forward_in_buckets_gives_each_input_its_own_output(count):
    weight = torch.arange(6.0).reshape(3, 2)
    model = lambda x: (x @ weight.T, x.sum(dim=1))  # noqa: E731 - a model of two outputs
    batch = torch.randn(count, 2, generator=torch.Generator().manual_seed(count))
    product, total = cuda_graphs.forward_in_buckets(model, batch, smallest=16)
    assert torch.equal(product, batch @ weight.T) and torch.equal(total, batch.sum(dim=1))


def test_detector_plans_give_each_frame_one_input_per_detector(cpu_pipeline):
    sizes = ((1080, 1920), (360, 640), (720, 1280), (1080, 1920))
    short, full = cpu_pipeline.detector.plans_for(sizes)
    # The short-range detector: each frame's letterbox, as MediaPipe crops it.
    assert short.input_hw == (128, 128) and len(short.rects) == 4
    assert short.rects.center_xy_px[1].tolist() == [320.0, 180.0] and short.rects.size_wh_px[1].tolist() == [640, 640]
    # The full-range detector: each frame whole in one 512x288 input, scaled to fit (1080p at
    # 3.75 frame pixels an input pixel, 720p at 2.5, 640x360 at 1.25), from its top-left corner.
    (positions, plan), = full.groups
    assert plan.input_hw == (288, 512) and positions.tolist() == [0, 1, 2, 3] and full.order is None
    assert plan.rects.size_wh_px.tolist() == [[1920.0, 1080.0], [640.0, 360.0], [1280.0, 720.0], [1920.0, 1080.0]]
    assert torch.equal(plan.rects.center_xy_px, plan.rects.size_wh_px / 2)
    assert plan.anchors.shape == (72 * 128, 2)
    # A portrait frame has an input of its own shape; frames are grouped by it, and their
    # detections put back in frame order.
    _, mixed = cpu_pipeline.detector.plans_for(((1080, 1920), (1920, 1080), (720, 1280)))
    assert {plan.input_hw: p.tolist() for p, plan in mixed.groups} == {(288, 512): [0, 2], (512, 288): [1]}
    assert mixed.order.tolist() == [0, 2, 1]  # rows [0, 2, 1] of the concatenation, in frame order
    assert face_detection.full_range_input(1920, 1080) == (3.75, (512, 288))  # portrait


def test_full_range_detector_takes_any_multiple_of_32_and_is_itself_at_192(installed_models, cpu_pipeline):
    original = tflite_convert.convert(installed_models["face_detection_full_range"])
    any_size = tflite_convert.convert(installed_models["face_detection_full_range"])
    assert tflite_convert.allow_any_input_size(any_size) == 32
    x = torch.rand(2, 192, 192, 3, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.inference_mode():
        assert all(torch.equal(a, b) for a, b in zip(original(x), any_size(x)))
        boxes, scores = any_size(torch.zeros(1, 288, 512, 3))
    assert boxes.shape == (1, 72 * 128, 16) and scores.shape == (1, 72 * 128, 1)
    with pytest.raises(ValueError, match="multiples of 32"):
        any_size(torch.zeros(1, 200, 512, 3))
    # As the pipeline runs it on the CPU (PADs folded, each convolution's CPU kernel chosen and
    # its weights packed for the built size: Note [Convolutions on the CPU]), at the whole-frame size.
    whole = torch.rand(2, 288, 512, 3, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.inference_mode():
        for prepared, plain in zip(cpu_pipeline.detector.full_range(whole), any_size(whole)):
            assert torch.allclose(prepared, plain, atol=1e-3, rtol=1e-5)
    mesh = tflite_convert.convert(installed_models["face_landmark_with_attention"])
    with pytest.raises(tflite_ops.UnsupportedOp, match="depends on the input size"):
        tflite_convert.allow_any_input_size(mesh)


def _grid_sample_crops(batch: roi.FrameBatch, frame_index, rects, size, border):
    """Crops as roi.crop_rois computed them with F.grid_sample over the float frames; ``size``
    S or (H, W)."""
    out_h, out_w = (size, size) if isinstance(size, int) else size
    v, u = torch.meshgrid(torch.arange(out_h, dtype=torch.float32) / out_h - 0.5,
                          torch.arange(out_w, dtype=torch.float32) / out_w - 0.5, indexing="ij")
    unit = torch.stack([u, v], dim=-1).reshape(1, -1, 2)
    points = rects.to_image(unit * rects.size_wh_px[:, None, :])
    hw = batch.frame_hw[frame_index]
    max_x, max_y = (hw[:, 1] - 1)[:, None], (hw[:, 0] - 1)[:, None]
    x, y = points[..., 0], points[..., 1]
    inside = (x >= -0.5) & (x <= max_x + 0.5) & (y >= -0.5) & (y <= max_y + 0.5)
    x = torch.minimum(x.clamp(min=0), max_x)
    y = torch.minimum(y.clamp(min=0), max_y) + batch.row_offset[frame_index][:, None]
    tall = batch.tall
    grid = torch.stack([x / (tall.shape[3] - 1) * 2 - 1, y / (tall.shape[2] - 1) * 2 - 1], dim=-1)
    sampled = F.grid_sample(tall, grid.reshape(1, -1, out_w, 2), mode="bilinear", padding_mode="border",
                            align_corners=True)
    out = sampled[0].reshape(3, len(rects), out_h, out_w).permute(1, 2, 3, 0) / 255.0
    return out * inside.reshape(-1, out_h, out_w, 1) if border == "zero" else out


@pytest.mark.parametrize("bgr", [True, False])
@pytest.mark.parametrize("border", ["replicate", "zero"])
def test_crops_agree_with_grid_sample_over_the_float_frames(photos, bgr, border):
    frames = [photos["astronaut"], np.ascontiguousarray(photos["grace_hopper"][:400, :300])]
    batch = roi.FrameBatch(frames, "cpu", bgr=bgr)
    gen = torch.Generator().manual_seed(3)
    count = 12
    rects = roi.RotatedRects(torch.rand(count, 2, generator=gen) * 500 - 20,
                             (20 + torch.rand(count, 1, generator=gen) * 400).expand(-1, 2).contiguous(),
                             torch.rand(count, generator=gen) * 6 - 3)
    index = torch.arange(count) % 2
    got = roi.crop_rois(batch, index, rects, 64, border=border)
    expected = _grid_sample_crops(batch, index, rects, 64, border)
    assert (got - expected).abs().max() < 1e-3  # of 1.0: float rounding only
    rgb = frames[0] if not bgr else frames[0][..., ::-1]
    assert torch.equal(batch.tall[0, :, :512, :512], torch.from_numpy(rgb.copy()).permute(2, 0, 1).float())


@pytest.mark.parametrize("axis_aligned", [False, True])
def test_rectangular_crops_map_the_rects_width_onto_columns_and_height_onto_rows(photos, axis_aligned):
    # The full-range detector's whole-frame inputs: (H, W) crops of unsquare rects.
    batch = roi.FrameBatch([photos["astronaut"], np.ascontiguousarray(photos["grace_hopper"][:300])], "cpu")
    sizes = torch.tensor([[640.0, 384.0], [640.0, 384.0]])
    rects = roi.RotatedRects(sizes / 2, sizes, torch.zeros(2))
    index = torch.tensor([0, 1])
    got = roi.crop_rois(batch, index, rects, (96, 160), border="zero", axis_aligned=axis_aligned)
    assert got.shape == (2, 96, 160, 3)
    assert (got - _grid_sample_crops(batch, index, rects, (96, 160), "zero")).abs().max() < 1e-3
    # Input pixel (u, v) samples frame pixel (u, v) x 4 (640 / 160, 384 / 96): on a pixel itself.
    assert torch.allclose(got[0, 10, 20] * 255, torch.from_numpy(photos["astronaut"][40, 80, ::-1].copy()).float(),
                          atol=1e-3)
    assert (got[1, 76:] == 0).all() and (got[1, :, 129:] == 0).all()  # beyond the 300x512 frame: black
    assert (got[1, :75, :128] > 0).any(dim=-1).float().mean() > 0.9
    corners = torch.tensor([[[0.0, 0.0], [160.0, 96.0]]] * 2)
    assert torch.allclose(roi.project_points(corners, rects, (96, 160)),
                          torch.stack([torch.zeros(2, 2), sizes], dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unrotated_crops_can_be_computed_per_row_and_column(photos, dtype):
    batch = roi.FrameBatch([photos["astronaut"], np.ascontiguousarray(photos["grace_hopper"][:300])], "cpu")
    rects = roi.RotatedRects(torch.tensor([[256.0, 256.0], [300.0, 150.0], [40.0, 500.0]]),
                             torch.tensor([[512.0, 512.0], [720.0, 720.0], [200.0, 200.0]]), torch.zeros(3))
    index = torch.tensor([0, 1, 0])
    general = roi.crop_rois(batch, index, rects, 96, border="zero", value_range=(-1.0, 1.0))
    aligned = roi.crop_rois(batch, index, rects, 96, border="zero", value_range=(-1.0, 1.0), axis_aligned=True,
                            dtype=dtype)
    assert aligned.dtype == dtype
    # float16: blended in float16, which keeps 0..255 to 3 significant digits.
    assert (aligned.float() - general).abs().max() <= (1e-6 if dtype == torch.float32 else 4e-3)
    plain = roi.crop_rois(batch, index, rects, 96, border="zero")
    assert torch.allclose(general, plain * 2 - 1, atol=1e-6)
    assert (general[1, :10] == -1).all()  # above the shorter frame: the black border, at the low end


def test_frame_batch_uses_a_frame_tensor_in_place_and_copies_a_list():
    frames = torch.randint(0, 255, (3, 20, 30, 3), dtype=torch.uint8)
    batch = roi.FrameBatch(frames, "cpu")
    assert batch.pixels.data_ptr() == frames.data_ptr() and batch.pixels.shape == (60, 30, 3)
    assert batch.row_offsets_px == [0, 20, 40] and batch.row_offset.tolist() == [0.0, 20.0, 40.0]
    listed = roi.FrameBatch(list(frames), "cpu")
    assert listed.pixels.data_ptr() != frames.data_ptr() and torch.equal(listed.pixels, batch.pixels)
    stacked = roi.FrameBatch.from_pixels(batch.pixels, [(20, 30)] * 3)
    assert stacked.frame_hw.tolist() == [[20.0, 30.0]] * 3
    with pytest.raises(ValueError, match="do not stack"):
        roi.FrameBatch.from_pixels(batch.pixels, [(20, 30)] * 2)


# -- model rewrites ----------------------------------------------------------------------------


def test_folding_zero_pads_into_convolutions_changes_no_output(installed_models, photos):
    _require_models(installed_models)
    path = installed_models["face_detection_full_range"]
    plain, folded = tflite_convert.convert(path).eval(), tflite_convert.convert(path).eval()
    assert tflite_convert.fuse_zero_padding(folded) == 43
    assert tflite_convert.fuse_zero_padding(folded) == 0
    assert not any(step.op_type == "PAD" for step in folded.steps)
    inputs = torch.from_numpy(np.stack([
        cv2.resize(photo, (192, 192), interpolation=cv2.INTER_AREA).astype(np.float32) / 127.5 - 1
        for photo in photos.values()]))
    with torch.no_grad():
        for expected, got in zip(plain(inputs), folded(inputs)):
            assert (expected - got).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_the_blendshape_models_layer_norms_are_one_step_each_with_the_same_outputs(landmarker_bundle):
    """Note [Layer norms in one kernel]: the eight ten-operator layer norms of the blendshape
    model become one step each (61 steps where there were 133), with the same scores to the
    bit on the CPU (the step runs the same operators there); a chain whose inner value
    something else reads is left alone."""
    path = landmarker_bundle.face_blendshapes
    plain, fused = tflite_convert.convert(path).eval(), tflite_convert.convert(path).eval()
    assert tflite_convert.fuse_layer_norms(fused) == 8
    assert tflite_convert.fuse_layer_norms(fused) == 0
    assert len(plain.steps) == 133 and len(fused.steps) == 61
    assert sum(isinstance(step.compute, tflite_ops.LayerNormOverChannels) for step in fused.steps) == 8
    points = torch.rand(6, 146, 2, generator=torch.Generator().manual_seed(5)) * torch.tensor([1920.0, 1080.0])
    with torch.inference_mode():
        assert torch.equal(plain(points)[0], fused(points)[0])
    # An inner value of the first chain (its mean) made a model output: that chain stays.
    watched = tflite_convert.convert(path).eval()
    first_mean = next(step for step in watched.steps if step.op_type == "MEAN" and step.input_slots
                      and watched._tensor_shapes[step.input_slots[0]][-1] == 64)
    watched.output_slots.append(first_mean.output_slots[0])
    assert tflite_convert.fuse_layer_norms(watched) == 7


def _assert_same_outputs_on_photos(plain, fused, photos) -> None:
    """The two forms of one model give the same outputs, to the bit, on the real photos."""
    size = plain.input_shapes[0][1]
    inputs = torch.from_numpy(np.stack([
        cv2.resize(photo, (size, size)) for photo in photos.values()]).astype(np.float32) / 127.5 - 1)
    with torch.inference_mode():
        for expected, got in zip(plain(inputs), fused(inputs)):
            assert torch.equal(expected, got)


def test_the_landmarkers_residual_adds_join_the_prelus_that_read_them_with_the_same_outputs(
        landmarker_bundle, installed_models, photos):
    """Note [PReLUs in one kernel]: each ADD of a residual block whose only reader is a PRELU
    becomes one step with it (the v2 landmarker's 34, the attention mesh's 66), with the same
    outputs to the bit on the CPU (the step runs the same two operators there), on real
    photos; an ADD whose output something else reads too is left alone."""
    _require_models(installed_models)
    for path, pairs in ((landmarker_bundle.face_landmarks_detector, 34),
                        (installed_models["face_landmark_with_attention"], 66)):
        plain, fused = tflite_convert.convert(path).eval(), tflite_convert.convert(path).eval()
        assert tflite_convert.fuse_residual_prelus(fused) == pairs
        assert tflite_convert.fuse_residual_prelus(fused) == 0
        assert len(fused.steps) == len(plain.steps) - pairs
        assert sum(isinstance(step.compute, tflite_ops.ResidualPRelu) for step in fused.steps) == pairs
        _assert_same_outputs_on_photos(plain, fused, photos)
    # The first block's sum made a model output too: that pair stays apart.
    watched = tflite_convert.convert(landmarker_bundle.face_landmarks_detector).eval()
    first_add = next(step for step in watched.steps if step.op_type == "ADD")
    watched.output_slots.append(first_add.output_slots[0])
    assert tflite_convert.fuse_residual_prelus(watched) == 33


def test_the_halving_blocks_shortcuts_join_the_steps_that_read_them_with_the_same_outputs(
        landmarker_bundle, installed_models, photos):
    """Note [Residual shortcuts in one kernel]: each 2x2 stride-2 max pool of a block's input
    (and the PAD that widens it, where there is one) read only by a fused ADD+PRELU becomes part
    of that step (the v2 landmarker's 6, 3 of them with a PAD; the attention mesh's 16, 9), with
    the same outputs to the bit on the CPU (the step runs the same operators there), on real
    photos; a pool whose output is also a model output is left alone."""
    _require_models(installed_models)
    for path, shortcuts, pads in ((landmarker_bundle.face_landmarks_detector, 6, 3),
                                  (installed_models["face_landmark_with_attention"], 16, 9)):
        plain, fused = tflite_convert.convert(path).eval(), tflite_convert.convert(path).eval()
        for model in (plain, fused):
            tflite_convert.fuse_residual_prelus(model)
        assert tflite_convert.fuse_pooled_residuals(fused) == shortcuts
        assert tflite_convert.fuse_pooled_residuals(fused) == 0
        assert len(fused.steps) == len(plain.steps) - shortcuts - pads
        assert sum(isinstance(step.compute, tflite_ops.PooledResidualPRelu) for step in fused.steps) == shortcuts
        assert not any(isinstance(step.compute, (tflite_ops.MaxPool2d, tflite_ops.Pad)) for step in fused.steps)
        _assert_same_outputs_on_photos(plain, fused, photos)
    # The first pool's output made a model output too: that shortcut stays apart.
    watched = tflite_convert.convert(landmarker_bundle.face_landmarks_detector).eval()
    tflite_convert.fuse_residual_prelus(watched)
    first_pool = next(step for step in watched.steps if isinstance(step.compute, tflite_ops.MaxPool2d))
    watched.output_slots.append(first_pool.output_slots[0])
    assert tflite_convert.fuse_pooled_residuals(watched) == 5


@pytest.mark.parametrize("name, moved", [("face_detection_full_range", 40),
                                         ("face_landmark_with_attention", 66)])
def test_moving_depthwise_biases_into_their_readers_changes_no_output(installed_models, photos,
                                                                      name, moved):
    """Note [Convolutions on the GPU]: W (x + b) + c = W x + (W b + c), on real photos."""
    _require_models(installed_models)
    path = installed_models[name]
    plain, folded = tflite_convert.convert(path).eval(), tflite_convert.convert(path).eval()
    # Biases made large, so that a bias moved wrongly (or dropped) cannot pass unseen.
    generator = torch.Generator().manual_seed(3)
    for a, b in zip(plain.modules(), folded.modules()):
        if isinstance(a, tflite_ops.Conv2d) and a.bias is not None:
            a.bias = b.bias = torch.randn(a.bias.shape, generator=generator)
    tflite_convert.fuse_zero_padding(plain)
    tflite_convert.fuse_zero_padding(folded)
    assert tflite_convert.fold_depthwise_bias(folded) == moved
    assert tflite_convert.fold_depthwise_bias(folded) == 0
    depthwise = [c for c in folded.modules() if isinstance(c, tflite_ops.Conv2d) and c.groups > 1]
    assert sum(c.bias is None for c in depthwise) == moved
    size = plain.input_shapes[0][1]
    inputs = torch.from_numpy(np.stack([
        cv2.resize(photo, (size, size), interpolation=cv2.INTER_AREA).astype(np.float32) / 127.5 - 1
        for photo in photos.values()]))
    with torch.no_grad():
        for expected, got in zip(plain(inputs), folded(inputs)):
            assert (expected - got).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("activation", [0, 1, 3])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_a_pointwise_convolution_as_rows_is_the_convolution(activation, layout):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, 5, 7, generator=generator)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = torch.randn(24, 16, 1, 1, generator=generator), torch.randn(24, generator=generator)
    for b in (bias, None):
        expected = tflite_ops._apply_activation(F.conv2d(x, weight, b), activation)
        got = tflite_ops.pointwise_rows(x, weight, b, activation)
        assert got.shape == expected.shape and got.is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", [0, 1, 3])
def test_a_pointwise_convolution_of_an_nchw_image_as_columns_is_the_convolution(activation):
    """The blendshape model's token mixing (a 1x1 convolution of a transposed tensor, held as
    NCHW) as one batched product of its columns: the convolution, NCHW out; channels-last
    images (and one pixel, both at once) are not held as NCHW."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(3, 97, 1, 64, generator=generator)
    weight, bias = torch.randn(384, 97, 1, 1, generator=generator), torch.randn(384, generator=generator)
    assert tflite_ops.held_as_nchw(x)
    assert not tflite_ops.held_as_nchw(x.contiguous(memory_format=torch.channels_last))
    assert not tflite_ops.held_as_nchw(torch.randn(3, 97, 1, 1))
    for b in (bias, None):
        expected = tflite_ops._apply_activation(F.conv2d(x, weight, b), activation)
        got = tflite_ops.pointwise_columns(x, weight.contiguous(memory_format=torch.channels_last), b, activation)
        assert got.shape == expected.shape and got.is_contiguous()
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5)


def test_small_depthwise_outputs_over_power_of_two_channels_go_to_our_kernel():
    """Note [Float16 depthwise convolutions]: the rule's bounds, on the shapes it was measured
    on (the landmark models' small ones in; the detector's large ones, 96 channels, out)."""
    def small(batch, channels, size, stride=1):
        weight = np.zeros((channels, 1, 3, 3), np.float32)
        conv = tflite_ops.Conv2d(weight, None, (stride, stride), (1, 1), channels, (1, 1, 1, 1), 0)
        return conv._small_output(torch.empty(batch, channels, size, size))

    assert small(64, 64, 16) and small(64, 64, 2) and small(64, 128, 6) and small(288, 4, 50, stride=2)
    assert not small(64, 32, 32) and not small(64, 64, 24) and not small(288, 96, 6) and not small(288, 48, 12)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_gpu_convolution_kernel_is_the_convolution(dtype):
    """Note [Convolutions on the GPU]: rows with a bias epilogue (plain and ReLU), cuDNN's fused
    ReLU, and F.conv2d otherwise, each against F.conv2d and the activation."""
    generator = torch.Generator().manual_seed(11)
    cases = [  # weight OIHW, stride, groups, padding_ltrb, activation
        ((32, 16, 1, 1), (1, 1), 1, (0, 0, 0, 0), 0),
        ((32, 16, 1, 1), (1, 1), 1, (0, 0, 0, 0), 1),
        ((32, 16, 1, 1), (1, 1), 1, (0, 0, 0, 0), 3),
        ((32, 16, 3, 3), (2, 2), 1, (0, 1, 0, 1), 1),
        ((16, 1, 3, 3), (1, 1), 16, (1, 1, 1, 1), 0),
        ((16, 1, 5, 5), (2, 2), 16, (1, 2, 1, 2), 1),
    ]
    x = torch.randn(8, 16, 24, 20, generator=generator)
    for weight_shape, stride, groups, padding, activation in cases:
        weight = torch.randn(weight_shape, generator=generator) * 0.2
        bias = torch.randn(weight_shape[0], generator=generator)
        conv = tflite_ops.Conv2d(weight.numpy(), bias.numpy(), stride, (1, 1), groups, padding,
                                 activation)
        expected = tflite_ops._apply_activation(F.conv2d(
            F.pad(x, padding), weight, bias, stride, groups=groups), activation)
        conv = conv.to("cuda", dtype=dtype)
        conv.weight = conv.weight.contiguous(memory_format=torch.channels_last)
        got = conv(x.to("cuda", dtype=dtype).contiguous(memory_format=torch.channels_last))
        tolerance = 2e-2 if dtype == torch.float16 else 2e-3  # TF32 in cuDNN's float32
        assert got.shape == expected.shape
        assert torch.allclose(got.float().cpu(), expected, atol=tolerance, rtol=tolerance), \
            (weight_shape, stride, groups, activation)


@pytest.mark.gpu
@needs_cuda
def test_float16_depthwise_convolutions_take_the_kernel_chosen_for_their_shape(monkeypatch):
    """Note [Float16 depthwise convolutions]: 8 channels over 128x128 run cuDNN's float32
    convolution, 2x2 images PyTorch's own kernel (in a graph's work both our kernel), the rest
    cuDNN's float16 one (here 24 channels: no power of two); each is the convolution (against
    float32 on the CPU) to float16 rounding. In a graph's work the last one's bias is our
    kernel's, with F.conv2d's values to the bit."""
    generator = torch.Generator().manual_seed(12)
    seen = []
    conv2d = F.conv2d

    def watched(x, *args, **kwargs):
        seen.append((x.dtype, torch.backends.cudnn.enabled))
        return conv2d(x, *args, **kwargs)

    cases = [((2, 8, 128, 128), (torch.float32, True)), ((16, 64, 2, 2), (torch.float16, False)),
             ((4, 24, 64, 64), (torch.float16, True))]
    for shape, expected_kernel in cases:
        channels = shape[1]
        x = torch.randn(shape, generator=generator)
        weight = torch.randn(channels, 1, 3, 3, generator=generator) * 0.3
        bias = torch.randn(channels, generator=generator)
        conv = tflite_ops.Conv2d(weight.numpy(), bias.numpy(), (1, 1), (1, 1), channels, (1, 1, 1, 1), 0)
        expected = F.conv2d(F.pad(x, (1, 1, 1, 1)), weight, bias, groups=channels)
        conv = conv.to("cuda", dtype=torch.float16)
        conv.weight = conv.weight.contiguous(memory_format=torch.channels_last)
        seen.clear()
        with monkeypatch.context() as patched:
            patched.setattr(F, "conv2d", watched)
            got = conv(x.to("cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last))
        assert seen == [expected_kernel], shape
        assert got.dtype == torch.float16 and got.shape == expected.shape
        assert torch.allclose(got.float().cpu(), expected, atol=1e-2, rtol=1e-2), shape
        if expected_kernel != (torch.float16, True):  # in a graph's work: one kernel of ours
            seen.clear()
            with monkeypatch.context() as patched, triton_kernels.graph_work():
                patched.setattr(F, "conv2d", watched)
                ours = conv(x.to("cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last))
            assert seen == [] and ours.is_contiguous(memory_format=torch.channels_last)
            assert torch.allclose(ours.float().cpu(), expected, atol=1e-2, rtol=1e-2)
        if expected_kernel == (torch.float16, True):  # Note [A convolution's bias in one kernel]
            x16 = x.to("cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
            with triton_kernels.graph_work():
                fused = conv(x16)
            assert torch.equal(fused, F.conv2d(x16, conv.weight, conv.bias, 1, 1, 1, channels))


def test_channel_prelu_is_the_tflite_formula(installed_models):
    _require_models(installed_models)
    alpha = torch.tensor([0.25, -0.5, 2.0]).reshape(1, 3, 1, 1)
    x = torch.tensor([-2.0, -0.0, 0.0, 1.5, -1e-8]).reshape(1, 1, 1, 5).expand(2, 3, 4, 5).contiguous()
    assert torch.equal(tflite_ops.ChannelPRelu(alpha)(x), torch.where(x >= 0, x, x * alpha))
    mesh = tflite_convert.convert(installed_models["face_landmark_with_attention"])
    assert sum(isinstance(step.compute, tflite_ops.ChannelPRelu) for step in mesh.steps) == 73


# -- detection, batched vs frame by frame ----------------------------------------------------------


def _reference_detect(pipeline: FacePipeline, frame_bgr: np.ndarray):
    """One frame at a time, as written before batching: the short-range detector on its
    letterbox, the full-range one on the whole frame at its scale, each decoded and suppressed,
    then the merge of the two detectors."""
    height, width = frame_bgr.shape[:2]
    batch = roi.FrameBatch([frame_bgr], "cpu")
    found = []
    for spec, full_range in ((anchors.FACE_SHORT_RANGE, False), (anchors.FACE_FULL_RANGE, True)):
        size = spec.anchors.input_size_px
        if full_range:
            scale, input_hw = face_detection.full_range_input(height, width)
            side_wh = torch.tensor([[input_hw[1] * scale, input_hw[0] * scale]])
            rects = roi.RotatedRects(side_wh / 2, side_wh, torch.zeros(1))
            anchor_centres = anchors.generate_anchors(spec.anchors, input_hw)
        else:
            input_hw = (size, size)
            cx, cy, side = roi.letterbox_rect(height, width)
            rects = roi.RotatedRects(torch.tensor([[cx, cy]]), torch.tensor([[side, side]]), torch.zeros(1))
            anchor_centres = anchors.generate_anchors(spec.anchors)
        crops = roi.crop_rois(batch, torch.zeros(1), rects, input_hw, border="zero") * 2 - 1
        raw_boxes, raw_scores = pipeline.detector.outputs(full_range, crops)
        decoded = anchors.decode(raw_boxes, raw_scores, anchor_centres, spec)
        boxes = roi.project_boxes(decoded.boxes * size, rects, input_hw)
        keypoints = roi.project_points((decoded.keypoints * size).reshape(1, -1, 2), rects,
                                       input_hw).reshape(decoded.keypoints.shape)
        valid = decoded.scores >= spec.min_score
        result = weighted_nms(boxes, decoded.scores, keypoints, valid, spec.min_suppression_iou,
                              pipeline.max_faces * 2).select(0)
        found.append((result.boxes[0], result.keypoints[0], result.scores[0]))
    (boxes, keypoints, scores), (full_boxes, full_keypoints, full_scores) = found
    if full_boxes.shape[0]:
        overlaps = (box_iou(full_boxes, boxes).max(dim=1).values > 0.1 if boxes.shape[0]
                    else torch.zeros(full_boxes.shape[0], dtype=torch.bool))
        wide_enough = full_boxes[:, 2] - full_boxes[:, 0] >= face_detection.FULL_RANGE_ONLY_MIN_WIDTH_PX
        keep = ~overlaps & wide_enough
        boxes = torch.cat([boxes, full_boxes[keep]])
        keypoints = torch.cat([keypoints, full_keypoints[keep]])
        scores = torch.cat([scores, full_scores[keep]])
    order = scores.argsort(descending=True)[: pipeline.max_faces]
    return boxes[order], keypoints[order], scores[order]


def test_batched_detection_equals_frame_by_frame(cpu_pipeline, photos):
    # Frames of every kind of input: 1080p, a square, a portrait photo (its own 288x512 input,
    # in the middle of the batch: put back in frame order), 720p and a face-free 640x480.
    portrait = _bgr(photos["grace_hopper"])
    assert portrait.shape[0] > portrait.shape[1]
    frames = [scene_1080p(photos), _bgr(photos["astronaut"]), portrait,
              np.ascontiguousarray(scene_1080p(photos, 40)[:720, :1280]), np.full((480, 640, 3), 90, np.uint8)]
    with torch.inference_mode():
        batched = cpu_pipeline.detect(roi.FrameBatch(frames, "cpu"))
        for frame, (boxes, keypoints, scores) in zip(frames, batched):
            ref_boxes, ref_keypoints, ref_scores = _reference_detect(cpu_pipeline, frame)
            assert boxes.shape[0] == ref_boxes.shape[0]
            assert torch.allclose(boxes, ref_boxes, atol=1e-2) and torch.allclose(scores, ref_scores, atol=1e-4)
            assert torch.allclose(keypoints, ref_keypoints, atol=1e-2)
    assert [b.shape[0] for b, _, _ in batched] == [3, 1, 1, 2, 0]


def test_decoding_only_nms_candidates_on_the_cpu_gives_every_anchors_detections(cpu_pipeline, photos, monkeypatch):
    """Note [Only NMS's candidates decoded on the CPU]: the pass's detections are those of
    decoding and projecting every anchor (frames of three sizes, three faces, one, none)."""
    portrait = _bgr(photos["grace_hopper"])
    frames = [scene_1080p(photos), portrait, np.ascontiguousarray(scene_1080p(photos, 40)[:720, :1280]),
              _bgr(photos["astronaut"]), np.full((480, 640, 3), 90, np.uint8)]
    detector = cpu_pipeline.detector

    with torch.inference_mode():
        got = detector.detect(roi.FrameBatch(frames, "cpu"))
        chosen = detector._decode_candidates(detector.outputs(False, detector._crops(
            roi.FrameBatch(frames[:1], "cpu"), torch.tensor([0]), detector.plans_for(((1080, 1920),))[0])),
            detector.plans_for(((1080, 1920),))[0], anchors.FACE_SHORT_RANGE)
        monkeypatch.setattr(type(detector), "_decode_candidates", type(detector).decode)  # every anchor
        expected = detector.detect(roi.FrameBatch(frames, "cpu"))
    assert chosen[0].shape == (1, detector.nms_candidates, 4), "only the candidates"
    assert [len(scores) for _, _, scores in got] == [len(scores) for _, _, scores in expected] == [3, 1, 2, 1, 0]
    for ours, theirs in zip(got, expected):
        for field_ours, field_theirs in zip(ours, theirs):
            torch.testing.assert_close(field_ours, field_theirs, rtol=0, atol=0)


def test_tracking_with_detections_from_elsewhere_including_an_empty_frame(cpu_pipeline, photos):
    frames = [scene_1080p(photos), scene_1080p(photos, 12)]
    with torch.inference_mode():
        found = cpu_pipeline.detect(roi.FrameBatch(frames, "cpu"))
    empty = (torch.zeros(0, 4), torch.zeros(0, 0, 2), torch.zeros(0))  # as the roi_landmark worker decodes it
    cpu_pipeline.reset()
    try:
        faces = cpu_pipeline.track(frames, ["a", "b"], detections={0: found[0], 1: empty})
        assert len(faces[0]) == 3 and faces[1] == []
        assert cpu_pipeline.tracks.cameras["b"].frames_since_detection == 0
        again = cpu_pipeline.track(frames, ["a", "b"], detections={0: found[0]})  # all three already tracked
        assert len(again[0]) == 3 and all(face.tracked for face in again[0])
    finally:
        cpu_pipeline.reset()


# -- CUDA graph bookkeeping, on the CPU ------------------------------------------------------------


class _CallInsteadOfReplay:
    """Stands in for cuda_graphs.Captured: same statics/outputs contract, ``fn`` run at replay."""

    made: list = []

    def __init__(self, fn, statics, device, pool, side):
        self.fn, self.statics = fn, statics
        self.outputs = fn()
        _CallInsteadOfReplay.made.append(self)

    def replay(self):
        fresh = self.fn()
        # Mimic a graph: results land in the same static output tensors every time.
        for static, value in zip(_flat(self.outputs), _flat(fresh)):
            static.copy_(value)
        return self.outputs


def _graphs_on_the_cpu(pipeline, monkeypatch, capture) -> None:
    """The pipeline's CUDA-graph logic switched on, with ``capture`` in place of a real capture
    and no graph or fallback yet."""
    monkeypatch.setattr(pipeline.graphs, "enabled", True)
    monkeypatch.setattr(pipeline.graphs, "capture", capture)
    monkeypatch.setattr(pipeline.graphs, "captured", {})
    monkeypatch.setattr(pipeline.graphs, "fallbacks", {})
    monkeypatch.setattr(pipeline.graphs, "shared_statics", {})


def _flat(outputs):
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, tuple):
        return [t for t in outputs if t is not None]
    return [outputs.boxes, outputs.keypoints, outputs.scores, outputs.valid]


def _pairs(frame_a, frame_b):
    """The faces of one frame paired by box overlap (their order follows presence, which ties
    at ~1.0 for clear faces, so rounding may swap two)."""
    if not frame_a:
        return []
    iou = box_iou(torch.tensor([f.box for f in frame_a]), torch.tensor([f.box for f in frame_b]))
    return [(a, frame_b[int(iou[k].argmax())]) for k, a in enumerate(frame_a)]


def _same_faces(expected, got, atol_px):
    assert [len(f) for f in expected] == [len(f) for f in got]
    for frame_a, frame_b in zip(expected, got):
        for a, b in _pairs(frame_a, frame_b):
            assert np.abs(a.landmarks - b.landmarks).max() < atol_px
            assert np.allclose(a.box, b.box, atol=atol_px) and a.tracked == b.tracked


def test_graph_bookkeeping_gives_the_eager_results(cpu_pipeline, photos, monkeypatch):
    frames = [scene_1080p(photos, shift) for shift in (0, 10, 20)]
    expected = cpu_pipeline(frames)
    monkeypatch.setattr(face_detection, "MAX_GRAPH_FRAMES", 4)  # 3 frames: padded to 4
    monkeypatch.setattr(face_mesh, "MAX_GRAPH_FACES", 4)  # 9 faces: chunks of whole frames, 3 + 3 + 3
    _graphs_on_the_cpu(cpu_pipeline, monkeypatch, _CallInsteadOfReplay)
    _CallInsteadOfReplay.made = []
    _same_faces(expected, cpu_pipeline(frames), atol_px=1e-2)
    # Each chunk of 3 faces replays the 4-face graph, its duplicate filter in 4 steps (max_faces).
    assert sorted(cpu_pipeline.graphs.captured) == [("detect", (1080, 1920, 4, True)),
                                                    ("mesh", (4, torch.float32, 4))]
    # One frame: a new detection graph; its 3 faces replay the 4-face graph again, one row padded
    # with the previous call's data, which must not leak into the results.
    _same_faces(expected[2:], cpu_pipeline(frames[2:]), atol_px=1e-2)
    assert ("detect", (1080, 1920, 1, True)) in cpu_pipeline.graphs.captured and len(_CallInsteadOfReplay.made) == 3
    assert cpu_pipeline.graph_fallbacks == {}


def test_more_rois_than_a_graph_holds_split_between_frames_or_run_eagerly(cpu_pipeline, photos, monkeypatch):
    """Note [Measuring on the device]: past MAX_GRAPH_FACES the ROIs are split between whole
    frames (a frame's ROIs meet in one duplicate filter); ROIs whose frames interleave run
    eagerly, with the same faces."""
    frames = [scene_1080p(photos, shift) for shift in (0, 10)]
    batch = roi.FrameBatch(frames, "cpu")
    with torch.inference_mode():
        found = cpu_pipeline.detect(batch)
    assert [boxes.shape[0] for boxes, _, _ in found] == [3, 3]
    interleaved = [0, 3, 1, 4, 2, 5]  # rows of cat(found): frame 0, frame 1, frame 0, ...
    owners = [0, 1, 0, 1, 0, 1]
    boxes, keypoints, scores = (torch.cat([f[part] for f in found])[interleaved] for part in range(3))
    rects = roi.rects_from_detections(boxes, keypoints)
    with torch.inference_mode():
        expected = cpu_pipeline.measurer.measure(batch, owners, rects, boxes, scores, [False] * 6)
        monkeypatch.setattr(face_mesh, "MAX_GRAPH_FACES", 4)
        _graphs_on_the_cpu(cpu_pipeline, monkeypatch, _CallInsteadOfReplay)
        got = cpu_pipeline.measurer.measure(batch, owners, rects, boxes, scores, [False] * 6)
    assert cpu_pipeline.graphs.captured == {}  # 6 interleaved ROIs > 4: eagerly
    assert got.rows == expected.rows
    _same_faces(expected.faces, got.faces, atol_px=1e-4)


def test_more_rois_than_warmed_replay_the_warmed_graphs_between_whole_frames(cpu_pipeline, photos,
                                                                            monkeypatch):
    """Note [Warmed for the largest share]: warm_up for 4 faces, then 9 faces in 3 frames:
    three replays of the 4-face graph (whole frames each), no larger graph, the same faces."""
    frames = [scene_1080p(photos, shift) for shift in (0, 10, 20)]
    expected = cpu_pipeline(frames)
    _graphs_on_the_cpu(cpu_pipeline, monkeypatch, _CallInsteadOfReplay)
    monkeypatch.setattr(cpu_pipeline.measurer, "warmed_faces", None)
    with torch.inference_mode():
        cpu_pipeline.measurer.warm_up(3)
    assert cpu_pipeline.measurer.warmed_faces == 4
    warmed = {key for key in cpu_pipeline.graphs.captured if key[0] == "mesh"}
    assert max(key[1][0] for key in warmed) == 4
    _same_faces(expected, cpu_pipeline(frames), atol_px=1e-2)
    assert {key for key in cpu_pipeline.graphs.captured if key[0] == "mesh"} == warmed


def test_a_stage_that_cannot_be_captured_runs_eagerly_and_says_why(cpu_pipeline, photos, monkeypatch):
    def refuse(fn, statics, device, pool, side):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture\nmore")

    frames = [scene_1080p(photos)]
    expected = cpu_pipeline(frames)
    _graphs_on_the_cpu(cpu_pipeline, monkeypatch, refuse)
    _same_faces(expected, cpu_pipeline(frames), atol_px=1e-3)
    assert cpu_pipeline.graph_fallbacks == {
        "detect": "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        "mesh": "Cannot copy between CPU and CUDA tensors during CUDA graph capture"}


def test_options_that_need_a_gpu_are_refused_on_the_cpu(installed_models):
    _require_models(installed_models)
    with pytest.raises(ValueError, match="cuda_graphs"):
        FacePipeline("cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="half"):
        FacePipeline("cpu", half=True)
    with pytest.raises(ValueError, match="compile_models=True is for CUDA devices"):
        FacePipeline("cpu", compile_models=True)


# -- what a CUDA graph can capture -----------------------------------------------------------------


class _HostWork(TorchDispatchMode):
    """Records, by source line, what a CUDA graph cannot capture: tensors made from host data
    (a host-to-device copy on a GPU) and operations that wait for the device's results."""

    # Operations whose result's size, or whose success, only the device knows (on CUDA: a copy
    # back and a wait); and the solvers (every aten.linalg_* / aten._linalg_* but the
    # elementwise ones below), which on CUDA read their convergence flags back (their
    # documentation: "this function synchronizes that device with the CPU"; on the CPU they
    # check without a dispatched op, so they are recognised by name).
    WAITS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.item", "aten.is_nonzero",
             "aten.equal", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim", "aten.repeat_interleave"}
    NOT_SOLVERS = {"aten.linalg_cross", "aten.linalg_vector_norm", "aten.linalg_norm", "aten.linalg_matrix_norm"}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import traceback

        name = str(func.overloadpacket)
        bool_mask = name == "aten.index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None)
        solver = name.startswith(("aten.linalg_", "aten._linalg_")) and name not in self.NOT_SOLVERS
        if name in ("aten.lift_fresh", "aten.lift_fresh_copy") or name in self.WAITS or bool_mask or solver:
            frame = next(f for f in reversed(traceback.extract_stack())
                         if "/models/" in f.filename and "/tests/" not in f.filename)
            self.found.append(f"{name} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}")
        return func(*args, **(kwargs or {}))


def _warm_detection(pipeline, frames):
    batch = roi.FrameBatch(frames, "cpu")
    plans = pipeline.detector.plans_for(tuple(batch.sizes_hw))
    index = torch.arange(len(frames))
    # Caches made on first use stay out, as in the warm-up.
    pipeline.detector.core(batch, index, plans, taps=pipeline.detector.crop_taps(batch, index, plans))
    return batch, index, plans


def test_the_detection_stage_can_be_captured(cpu_pipeline, photos):
    """The stage as its graph runs it: with its taps, made once outside it (Note [Crop taps made
    once]; without them the CPU crops with OpenCV, Note [Crops on the CPU])."""
    with torch.inference_mode():
        batch, index, plans = _warm_detection(cpu_pipeline, [scene_1080p(photos)] * 2)
        taps = cpu_pipeline.detector.crop_taps(batch, index, plans)
        with _HostWork() as spy:
            cpu_pipeline.detector.core(batch, index, plans, taps=taps)
    assert spy.found == []


@pytest.fixture(scope="module")
def landmarker_pipeline(installed_models, landmarker_bundle):
    """FaceLandmarker's stack on the CPU: blendshapes and the transformation matrix."""
    _require_models(installed_models)
    torch.set_num_threads(1)
    return FacePipeline("cpu", max_faces=4, face_landmarker_task=landmarker_bundle.task_path,
                        cpu_runtime="torch")  # as cpu_pipeline


@pytest.mark.parametrize("stack", ["attention_mesh", "face_landmarker"])
def test_the_measuring_stage_can_be_captured(cpu_pipeline, landmarker_pipeline, photos, stack):
    """Note [Measuring on the device]: the whole measuring stage (models, blendshapes, head
    pose, transformation matrix, duplicate filter, the results' table) neither copies from the
    host nor waits for the device; three ROIs of two frames, two of them one face."""
    measurer = (landmarker_pipeline if stack == "face_landmarker" else cpu_pipeline).measurer
    batch = roi.FrameBatch([scene_1080p(photos)] * 2, "cpu")
    with torch.inference_mode():
        boxes, keypoints, _ = cpu_pipeline.detect(batch, [0])[0]
    rects = roi.rects_from_detections(boxes[[0, 0, 0]], keypoints[[0, 0, 0]])
    rects.center_xy_px[1] += 4.0  # the same face again, its ROI moved a little
    crops = roi.crop_rois(batch, torch.tensor([0, 0, 1]), rects, measurer.input_px)
    roi_table = torch.tensor([[0.0, 1.0, 1920.0, 1080.0], [0.0, 0.0, 1920.0, 1080.0], [1.0, 0.0, 1920.0, 1080.0]])
    inputs = (crops, rects, roi_table, torch.zeros(3, 4), torch.ones(3), 4)
    with torch.inference_mode():
        expected = measurer.results_core(*inputs)  # caches made on first use stay out, as in the warm-up
        with _HostWork() as spy:
            table = measurer.results_core(*inputs)
    assert spy.found == [], spy.found
    assert table.shape == (3, measurer.layout.columns) and torch.isfinite(table).all()
    torch.testing.assert_close(table, expected, rtol=0, atol=0)
    kept = table[:, measurer.layout.kept]
    assert kept[2] == 1 and kept[:2].sum() == 1, "the two ROIs on one face: one kept"


def test_the_measuring_stage_traces_as_one_graph(landmarker_pipeline):
    """The measuring stage has no Python branch on a tensor's value and no host round trip:
    TorchDynamo traces the whole of it, FaceLandmarker's stack with its transformation matrix,
    without a graph break (``fullgraph=True``; the "eager" backend: the trace is the test, not
    a compiler), and the traced stage gives the same table. (Under no_grad: torch 2.13's guards
    mistake inference-mode tensors made once for the device tables. equal_nan: the table's last
    columns are float64 head pose viewed as float32 pairs, and the halves of a double can read
    as a float32 NaN, in both tables alike.)"""
    measurer = landmarker_pipeline.measurer
    count = 4
    crops = torch.rand(count, measurer.input_px, measurer.input_px, 3, generator=torch.Generator().manual_seed(3))
    rects = roi.RotatedRects(torch.full((count, 2), 500.0), torch.full((count, 2), 200.0), torch.zeros(count))
    roi_table = torch.tensor([[frame // 2, 0.0, 1920.0, 1080.0] for frame in range(count)])
    inputs = (crops, rects, roi_table, torch.zeros(count, 4), torch.ones(count), 4)
    torch._dynamo.reset()
    traced = torch.compile(measurer.results_core, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(traced(*inputs), measurer.results_core(*inputs), rtol=0, atol=0,
                                   equal_nan=True)
    torch._dynamo.reset()


# -- GPU: float16 and CUDA graphs against float32 eager, on real photos ----------------------------

FAST_VARIANTS = {  # name: (FacePipeline options, median, 99th percentile, min box IoU)
    "fp32+graphs": ({"cuda_graphs": True}, 0.001, 0.01, 0.99),
    "fp16": ({"half": True}, 0.005, 0.05, 0.95),
    "fp16+graphs": ({"half": True, "cuda_graphs": True}, 0.005, 0.05, 0.95),
    # Note [Compiled models]: inductor's landmark model inside the graphs.
    "fp16+graphs+compile": ({"half": True, "cuda_graphs": True, "compile_models": True},
                            0.005, 0.05, 0.95),
}


@pytest.fixture(scope="module")
def gpu_pipelines(installed_models):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device on this machine")
    _require_models(installed_models)
    pipelines = {"fp32": FacePipeline("cuda", max_faces=4)}
    for name, (options, *_) in FAST_VARIANTS.items():
        pipelines[name] = FacePipeline("cuda", max_faces=4, **options)
    return pipelines


def _compare(reference, fast, median_max, p99_max, iou_min, label):
    assert [len(f) for f in reference] == [len(f) for f in fast], label
    worst = {"median": 0.0, "p99": 0.0, "iou": 1.0}
    for frame_ref, frame_fast in zip(reference, fast):
        for ref, got in _pairs(frame_ref, frame_fast):
            width = ref.box[2] - ref.box[0]
            error = np.linalg.norm(got.landmarks[:, :2] - ref.landmarks[:, :2], axis=1) / width
            iou = box_iou(torch.tensor([ref.box]), torch.tensor([got.box]))[0, 0].item()
            worst = {"median": max(worst["median"], float(np.median(error))),
                     "p99": max(worst["p99"], float(np.percentile(error, 99))), "iou": min(worst["iou"], iou)}
            assert abs(ref.presence - got.presence) <= 0.02, label
            assert np.abs(np.subtract(ref.head_pose, got.head_pose)).max() <= 1.5, label
            assert ref.tracked == got.tracked
    assert worst["median"] <= median_max and worst["p99"] <= p99_max and worst["iou"] >= iou_min, (label, worst)
    return worst


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", list(FAST_VARIANTS))
def test_fast_path_matches_float32_on_photos(gpu_pipelines, photos, variant):
    frames = [_bgr(photos["astronaut"]), _bgr(photos["grace_hopper"]), scene_1080p(photos), scene_1080p(photos, 30)]
    expected = gpu_pipelines["fp32"](frames)
    assert [len(f) for f in expected] == [1, 1, 3, 3]
    _, median_max, p99_max, iou_min = FAST_VARIANTS[variant]
    for _ in range(2):  # the second call replays the graphs captured by the first
        _compare(expected, gpu_pipelines[variant](frames), median_max, p99_max, iou_min, variant)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", list(FAST_VARIANTS))
def test_fast_path_tracks_like_float32(gpu_pipelines, photos, variant):
    _, median_max, p99_max, iou_min = FAST_VARIANTS[variant]
    reference, fast = gpu_pipelines["fp32"], gpu_pipelines[variant]
    reference.reset()
    fast.reset()
    try:
        for step in range(8):
            frames = [scene_1080p(photos, 4 * step), scene_1080p(photos, 60 - 4 * step)]
            _compare(reference.track(frames, ["a", "b"]), fast.track(frames, ["a", "b"]),
                     median_max, p99_max, iou_min, f"{variant} step {step}")
            assert [reference.wants_detection(c) for c in "ab"] == [fast.wants_detection(c) for c in "ab"]
    finally:
        reference.reset()
        fast.reset()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", list(FAST_VARIANTS))
def test_fast_detection_of_32_cameras_matches_float32(gpu_pipelines, photos, variant):
    frames = torch.from_numpy(np.stack([scene_1080p(photos, k) for k in range(32)])).cuda()
    _, _, _, iou_min = FAST_VARIANTS[variant]
    expected = gpu_pipelines["fp32"].detect(roi.FrameBatch(frames, "cuda"))
    for _ in range(2):
        got = gpu_pipelines[variant].detect(roi.FrameBatch(frames, "cuda"))
        assert sum(ref_boxes.shape[0] for ref_boxes, _, _ in expected) >= 90  # of 3 faces x 32 frames
        for (ref_boxes, _, ref_scores), (boxes, _, scores) in zip(expected, got):
            assert boxes.shape == ref_boxes.shape
            if ref_boxes.shape[0]:
                iou = box_iou(ref_boxes, boxes)
                match = iou.argmax(dim=1)  # scores order the boxes; near-ties may swap in float16
                assert iou.max(dim=1).values.min() >= iou_min
                assert (ref_scores - scores[match]).abs().max() <= 0.02
    if "graphs" in variant:
        assert "detect" not in gpu_pipelines[variant].graph_fallbacks


@pytest.mark.gpu
@needs_cuda
def test_cuda_convolution_weights_are_channels_last(gpu_pipelines):
    for pipe in gpu_pipelines.values():
        for model in (pipe.detector.short_range, pipe.detector.full_range, pipe.measurer.mesh):
            convs = [m for m in model.modules() if isinstance(m, tflite_ops.Conv2d)]
            assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
            assert all(c.weight.dtype == pipe.model_dtype for c in convs)


@pytest.fixture(scope="module")
def gpu_landmarker_pipelines(installed_models, landmarker_bundle):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device on this machine")
    _require_models(installed_models)
    return {name: FacePipeline("cuda", max_faces=4, face_landmarker_task=landmarker_bundle.task_path,
                               **FAST_VARIANTS.get(name, ({},))[0]) for name in ("fp32", "fp16+graphs")}


@pytest.mark.gpu
@needs_cuda
def test_the_face_stack_never_waits_for_the_gpu_until_its_one_transfer(gpu_pipelines, gpu_landmarker_pipelines,
                                                                          photos):
    """Notes [Measuring on the device] and [Tracking without per-face work]: with CUDA's sync
    debug mode set to raise, a detection pass (before its one transfer), a tracking step's ROIs
    and the measuring stage (before its one transfer) run, eager and from graphs, for both
    stacks: nothing in them waits for the GPU (a solver, a read-back, a pageable copy)."""
    frames = torch.from_numpy(np.stack([scene_1080p(photos, shift) for shift in (0, 20)])).cuda()
    pipelines = {f"attention mesh {name}": pipe for name, pipe in gpu_pipelines.items()}
    pipelines.update({f"FaceLandmarker {name}": pipe for name, pipe in gpu_landmarker_pipelines.items()})
    for label, pipe in pipelines.items():
        pipe.reset()
        with torch.inference_mode():
            batch = roi.FrameBatch(frames, "cuda")
            found = pipe.detect(batch)  # once first: graphs captured, tables made
            pipe.track(frames, ["a", "b"], detections=dict(enumerate(found)))
            pipe.track(frames, ["a", "b"], detections={0: found[0]})
            states = pipe.tracks.states(["a", "b"])
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                pipe.detector.detect_packed(batch, [0, 1])
                rois = pipe.tracks.next_rois(states, {1: found[1]})
                pipe.measurer.measure_on_device(batch, rois.owners, rois.rects, rois.boxes_px, rois.scores,
                                                rois.tracked)
            except RuntimeError as error:
                pytest.fail(f"{label}: {error}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        pipe.reset()
        assert pipe.graph_fallbacks == {}, label


def test_warm_up_prepares_every_bucket_a_worker_can_meet(cpu_pipeline, monkeypatch):
    """Note [Warm shapes]: after warm_up, no batch of 1..max frames or faces meets a new shape."""
    _graphs_on_the_cpu(cpu_pipeline, monkeypatch, _CallInsteadOfReplay)
    cpu_pipeline.warm_up([(360, 640), (360, 640)], max_frames=3, max_faces=5)
    assert sorted(cpu_pipeline.graphs.captured) == [
        ("detect", (360, 640, 1, True)), ("detect", (360, 640, 2, True)),
        ("detect", (360, 640, 4, True)),
        ("mesh", (1, torch.float32, 4)), ("mesh", (2, torch.float32, 4)), ("mesh", (4, torch.float32, 4)),
        ("mesh", (8, torch.float32, 4))]
    monkeypatch.setattr(cpu_pipeline.graphs, "enabled", False)
    cpu_pipeline.warm_up([(360, 640)], max_frames=3, max_faces=5)  # eager: nothing to prepare


def test_detection_graphs_of_one_frame_size_read_their_frames_from_one_buffer(cpu_pipeline, photos,
                                                                              monkeypatch):
    """Note [Static frames shared by a stage's graphs]: warmed largest first, the detection
    graphs of a frame size read the first frames of one buffer, the largest graph's; a smaller
    graph replayed after a larger one finds the same faces; a larger graph met later gets a
    buffer of its own, and the graphs made before keep theirs."""
    _graphs_on_the_cpu(cpu_pipeline, monkeypatch, _CallInsteadOfReplay)
    monkeypatch.setattr(face_detection, "MAX_GRAPH_FRAMES", 4)
    cpu_pipeline.warm_up([(1080, 1920)], max_frames=3)
    pixels = {key[2]: graph.statics["pixels"] for (stage, key), graph
              in cpu_pipeline.graphs.captured.items() if stage == "detect"}
    assert sorted(pixels) == [1, 2, 4]
    assert {frames.data_ptr() for frames in pixels.values()} == {pixels[4].data_ptr()}
    assert [pixels[n].shape[0] for n in (1, 2, 4)] == [1080, 2160, 4320]
    frames = [scene_1080p(photos, shift) for shift in (0, 10, 20)]

    def detect(count: int):
        with torch.inference_mode():  # as the pipeline calls it
            return cpu_pipeline.detector.detect(roi.FrameBatch(frames[:count], "cpu"))

    graphed = [detect(3), detect(1)]  # the 1-frame graph after the 4-frame one, in its buffer
    monkeypatch.setattr(cpu_pipeline.graphs, "enabled", False)
    eager = [detect(3), detect(1)]
    for got_frames, want_frames in zip(graphed, eager):
        assert len(got_frames) == len(want_frames)
        for (got_boxes, _, got_scores), (want_boxes, _, want_scores) in zip(got_frames, want_frames):
            assert len(got_scores) >= 1
            torch.testing.assert_close(got_boxes, want_boxes, atol=1e-2, rtol=0)
            torch.testing.assert_close(got_scores, want_scores, atol=1e-4, rtol=0)
    monkeypatch.setattr(cpu_pipeline.graphs, "enabled", True)
    monkeypatch.setattr(face_detection, "MAX_GRAPH_FRAMES", 8)
    frames = frames + frames[:2]
    detect(5)  # 5 frames: the 8-frame graph
    larger = cpu_pipeline.graphs.captured[("detect", (1080, 1920, 8, True))].statics["pixels"]
    assert larger.shape[0] == 8 * 1080 and larger.data_ptr() != pixels[4].data_ptr()
    assert cpu_pipeline.graphs.captured[("detect", (1080, 1920, 4, True))].statics["pixels"] is pixels[4]


def test_a_pass_of_several_replays_of_one_graph_keeps_each_replay_s_detections(cpu_pipeline, photos,
                                                                               monkeypatch):
    """Note [The graph's table read in place]: five frames with at most two a graph are three
    replays, two of them of the same graph, whose output the second rewrites: each frame gets
    its own faces, the eager pass's."""
    _graphs_on_the_cpu(cpu_pipeline, monkeypatch, _CallInsteadOfReplay)
    monkeypatch.setattr(face_detection, "MAX_GRAPH_FRAMES", 2)
    # A face in frames 0, 2 and 4 only, each elsewhere: a replay's rows in another's place show.
    faces = [scene_1080p(photos, shift) for shift in (0, 10, 20)]
    empty = np.zeros_like(faces[0])
    frames = [faces[0], empty, faces[1], empty, faces[2]]

    def detect():
        with torch.inference_mode():  # as the pipeline calls it
            return cpu_pipeline.detector.detect(roi.FrameBatch(frames, "cpu"))

    graphed = detect()
    assert sorted(key for stage, key in cpu_pipeline.graphs.captured if stage == "detect") == [
        (1080, 1920, 1, True), (1080, 1920, 2, True)]
    monkeypatch.setattr(cpu_pipeline.graphs, "enabled", False)
    eager = detect()
    assert [len(scores) for _, _, scores in graphed] == [len(scores) for _, _, scores in eager]
    assert [len(scores) > 0 for _, _, scores in eager] == [True, False, True, False, True]
    for (got_boxes, _, got_scores), (want_boxes, _, want_scores) in zip(graphed, eager):
        torch.testing.assert_close(got_boxes, want_boxes, atol=1e-2, rtol=0)
        torch.testing.assert_close(got_scores, want_scores, atol=1e-4, rtol=0)


@pytest.mark.gpu
@needs_cuda
def test_graphs_released_free_their_memory_and_are_captured_again_with_the_same_faces(
        installed_models, photos):
    """Note [Spares without graphs] (workers/inference/pipelines.py): a warmed pipeline that
    drops its graphs gives back their memory, and warmed again replays new graphs with the same
    faces as before."""
    _require_models(installed_models)
    pipeline = FacePipeline("cuda", max_faces=2, cuda_graphs=True)
    frames = [scene_1080p(photos, shift) for shift in (0, 20)]
    pipeline.warm_up([(1080, 1920)], max_frames=2, max_faces=8)
    expected = pipeline(frames)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    assert pipeline.release_graphs() and pipeline.graphs.captured == {}
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < held
    assert not pipeline.release_graphs()  # nothing left to drop
    pipeline.warm_up([(1080, 1920)], max_frames=2, max_faces=8)
    assert {key[0] for key in pipeline.graphs.captured} == {"detect", "mesh"}
    _same_faces(expected, pipeline(frames), atol_px=1e-3)
    assert pipeline.graph_fallbacks == {}


@pytest.mark.gpu
@needs_cuda
def test_graphs_captured_one_after_another_take_no_new_cublas_workspace():
    """Note [One side stream]: every graph of a cache is captured on one side stream, so a
    capture after the first adds its own tensors and no cuBLAS workspace (32 MiB on Hopper, one
    per stream a process ran cuBLAS on)."""
    cache = cuda_graphs.GraphCache(torch.device("cuda"), enabled=True)
    weights = torch.randn(256, 256, device="cuda")

    def build(offset: float):
        inputs = torch.randn(8, 256, device="cuda")
        return (lambda: inputs @ weights + offset), {"inputs": inputs}

    cache.get("stage", (0,), lambda: build(0.0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for k in range(1, 9):
        cache.get("stage", (k,), lambda k=k: build(float(k)))
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert len(cache.captured) == 9 and cache.fallbacks == {}
    assert grown < 2**20, f"8 graphs of 8x256 floats took {grown / 2**20:.1f} MiB more"
    graph = cache.captured[("stage", (3,))]
    graph.statics["inputs"].copy_(torch.ones(8, 256, device="cuda"))
    torch.testing.assert_close(graph.replay(), torch.ones(8, 256, device="cuda") @ weights + 3.0)
