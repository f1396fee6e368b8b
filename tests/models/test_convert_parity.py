"""The converter against an independent runtime: every shipped model, torch vs LiteRT.

Inputs: one random tensor and two real photos (astronaut, grace_hopper) resized to the model's
input, run through torch as ONE batch of three (so batching is checked too) and through LiteRT
one at a time. Error measure: ``litert_reference.relative_error``; the table of maxima is printed
at the end of the session.
"""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch

from facecast.models.tflite_convert import (
    UnsupportedOp,
    convert,
    fold_depthwise_bias,
    fuse_zero_padding,
    read_graph,
    use_cpu_kernels,
)

# tests/models is on sys.path (pytest's default "prepend" import mode): plain imports.
from litert_reference import PARITY_TABLE, cut_model, relative_error, run_litert
from tiny_tflite import TinyModel, options

TOLERANCE = 1e-4

# Input value range each model was trained on (MediaPipe's ImageToTensor settings).
INPUT_RANGES = {
    "face_detection_short_range": (-1.0, 1.0),
    "face_detection_full_range": (-1.0, 1.0),
    "face_landmark": (0.0, 1.0),
    "iris_landmark": (0.0, 1.0),
    "pose_detection": (-1.0, 1.0),
    "pose_landmark_full": (0.0, 1.0),
    "face_landmark_with_attention": (0.0, 1.0),
}
LITERT_MODELS = [name for name in INPUT_RANGES if name != "face_landmark_with_attention"]

# pose_landmark_full's segmentation logits (output 2, magnitudes up to ~1500 on noise) amplify
# float rounding through a deep decoder: LiteRT's own XNNPACK and reference kernels disagree by
# ~1.5e-3 there on random input, and a float64 run of the torch module is closer to torch's
# float32 result than to either LiteRT backend. Its bound is therefore 3x LiteRT's own spread.
NOISY_OUTPUTS = {("pose_landmark_full", 2)}

# Face crops (centre x, centre y, side) of the photos, for the landmark models' real-face checks.
FACE_CROPS = {"astronaut": (235, 120, 180), "grace_hopper": (260, 230, 300)}


def _to_model_input(image_rgb: np.ndarray, shape, value_range) -> np.ndarray:
    height, width = shape[1:3]
    resized = cv2.resize(image_rgb, (width, height), interpolation=cv2.INTER_AREA)
    low, high = value_range
    return (resized.astype(np.float32) / 255.0 * (high - low) + low)[None]


def _face_crop(image_rgb: np.ndarray, name: str) -> np.ndarray:
    centre_x, centre_y, side = FACE_CROPS[name]
    x0, y0 = centre_x - side // 2, centre_y - side // 2
    return image_rgb[y0:y0 + side, x0:x0 + side]


def _inputs(name: str, shape, photos) -> list[np.ndarray]:
    value_range = INPUT_RANGES[name]
    low, high = value_range
    rng = np.random.default_rng(0)
    samples = [rng.uniform(low, high, size=shape).astype(np.float32)]
    landmark_model = "landmark" in name
    for photo_name, photo in photos.items():
        image = _face_crop(photo, photo_name) if landmark_model else photo
        samples.append(_to_model_input(image, shape, value_range))
    return samples


def convert_as_prepared(path, name: str, cpu_kernels: bool):
    """The converted module; with ``cpu_kernels`` as FacePipeline prepares it on the CPU (zero
    PADs folded, depthwise biases moved (Note [Convolutions on the GPU]), Note [Convolutions on
    the CPU]: oneDNN with packed weights, F.linear)."""
    module = convert(path, name=name).eval()
    if cpu_kernels:
        fuse_zero_padding(module)
        fold_depthwise_bias(module)
        assert use_cpu_kernels(module).get("conv2d", 0) < sum(
            1 for step in module.steps if step.op_type in ("CONV_2D", "DEPTHWISE_CONV_2D"))
    return module


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["conv2d", "cpu_kernels"])
@pytest.mark.parametrize("name", LITERT_MODELS)
def test_model_matches_litert(name, cpu_kernels, installed_models, photos):
    path = installed_models[name]
    module = convert_as_prepared(path, name, cpu_kernels)
    samples = _inputs(name, module.input_shapes[0], photos)
    with torch.no_grad():
        batched = module(torch.from_numpy(np.concatenate(samples)))
    failures = []
    for position, output_name in enumerate(module.output_names):
        errors = []
        tolerance = TOLERANCE
        for sample_index, sample in enumerate(samples):
            expected = run_litert(path, [sample])[position]
            errors.append(relative_error(batched[position][sample_index:sample_index + 1].numpy(),
                                         expected))
            if (name, position) in NOISY_OUTPUTS:
                own_spread = relative_error(run_litert(path, [sample], reference_kernels=True)
                                            [position], expected)
                tolerance = max(tolerance, 3 * own_spread)
        label = f"{name} cpu kernels" if cpu_kernels else name
        PARITY_TABLE[(label, f"{position}:{output_name}")] = (max(errors), tolerance)
        if max(errors) > tolerance:
            failures.append(f"output {position} {output_name!r}: errors {errors} > {tolerance:.1e}")
    assert not failures, f"{name}: " + "; ".join(failures)


def test_every_operator_of_a_model_matches_litert_on_litert_inputs(installed_models):
    """Per-operator parity: feed each torch operator LiteRT's own inputs to it, so that errors
    do not accumulate and a wrong operator cannot hide behind a tolerant end-to-end check."""
    from ai_edge_litert.interpreter import Interpreter

    from facecast.models.tflite_ops import tfl_order_to_torch, torch_to_tfl_order

    worst = {}
    for name in ("face_detection_full_range", "pose_detection", "pose_landmark_full"):
        path = installed_models[name]
        module = convert(path, name=name)
        interpreter = Interpreter(model_path=str(path), experimental_preserve_all_tensors=True)
        interpreter.allocate_tensors()
        detail = interpreter.get_input_details()[0]
        rng = np.random.default_rng(1)
        interpreter.set_tensor(detail["index"],
                               rng.uniform(-1, 1, size=detail["shape"]).astype(np.float32))
        interpreter.invoke()
        shapes = module._tensor_shapes
        for step in module.steps:
            arguments = [tfl_order_to_torch(torch.from_numpy(interpreter.get_tensor(slot)),
                                            shapes[slot]) for slot in step.input_slots]
            with torch.no_grad():
                results = step.compute(*arguments)
            results = (results,) if isinstance(results, torch.Tensor) else results
            for slot, result in zip(step.output_slots, results):
                expected = interpreter.get_tensor(slot)
                actual = torch_to_tfl_order(result, shapes[slot]).numpy().reshape(expected.shape)
                error = relative_error(actual, expected)
                if error >= worst.get(step.op_type, (-1.0, None))[0]:
                    worst[step.op_type] = (error, f"{name} #{step.op_index}")
    assert {"CONV_2D", "DEPTHWISE_CONV_2D", "ADD", "PAD", "RESIZE_BILINEAR",
            "DEPTH_TO_SPACE", "RESHAPE", "MAX_POOL_2D", "LOGISTIC"} <= set(worst)
    too_large = {op: found for op, found in worst.items() if found[0] > 2e-5}
    assert not too_large, f"operators differ from LiteRT: {too_large}"


# ---------------------------------------------------------------------------------------------
# The attention mesh: LiteRT has no kernels for MediaPipe's custom operators, so LiteRT runs a
# copy of the model cut before them; the custom part is checked on real faces and by properties.


def test_attention_mesh_backbone_matches_litert(installed_models, photos):
    name = "face_landmark_with_attention"
    path = installed_models[name]
    module = convert(path, name=name).eval()
    graph = read_graph(path)
    # The mesh and face flag outputs, and what the custom operators read from the backbone: the
    # landmarks that place the crops and the feature map that is cropped.
    custom_inputs = sorted({op.inputs[0].name for op in graph.operators
                            if op.type in ("Landmarks2TransformMatrix", "TransformTensorBilinear")})
    keep = ["output_mesh_identity", "conv_faceflag", *custom_inputs]
    cut = cut_model(path, keep)
    samples = _inputs(name, module.input_shapes[0], photos)
    with torch.no_grad():
        traced = module.trace(torch.from_numpy(np.concatenate(samples)))
    for tensor_name in keep:
        errors = []
        for sample_index, sample in enumerate(samples):
            expected = run_litert(cut, [sample])[keep.index(tensor_name)]
            actual = traced[tensor_name][sample_index:sample_index + 1].numpy()
            errors.append(relative_error(actual.reshape(expected.shape), expected))
        PARITY_TABLE[(name, tensor_name)] = (max(errors), TOLERANCE)
        assert max(errors) <= TOLERANCE, f"{tensor_name}: {errors}"


def test_attention_mesh_refinements_land_on_the_face(installed_models, photos):
    """The custom operators crop the feature map around lips and eyes and map the refined points
    back: on real faces the refined points must lie on the coarse mesh's matching points (a
    wrong crop transform or a wrong inverse mapping moves them by tens of pixels)."""
    path = installed_models["face_landmark_with_attention"]
    module = convert(path).eval()
    graph = read_graph(path)
    subsets = [np.asarray(op.options["subset_idxs"]) for op in graph.operators
               if op.type == "Landmarks2TransformMatrix"]
    faces = [_to_model_input(_face_crop(photo, photo_name), module.input_shapes[0], (0.0, 1.0))
             for photo_name, photo in photos.items()]
    with torch.no_grad():
        outputs = module(torch.from_numpy(np.concatenate(faces)))
    names = module.output_names
    for face in range(len(faces)):
        assert outputs[names.index("conv_faceflag")][face].item() > 5.0  # a face (logit)
        mesh = outputs[names.index("output_mesh_identity")][face].reshape(468, 3)[:, :2].numpy()
        for region in ("output_lips", "output_left_eye", "output_right_eye"):
            points = outputs[names.index(region)][face].reshape(-1, 2).numpy()
            distances = [np.median(np.linalg.norm(points - mesh[s], axis=1))
                         for s in subsets if len(s) == len(points)]
            assert min(distances) < 2.5, f"face {face} {region}: median distance {distances} px"
        for iris, eye in (("output_left_iris", "output_left_eye"),
                          ("output_right_iris", "output_right_eye")):
            centre = outputs[names.index(iris)][face].reshape(5, 2)[0].numpy()
            eye_points = outputs[names.index(eye)][face].reshape(-1, 2).numpy()
            assert np.linalg.norm(centre - eye_points.mean(axis=0)) < 6.0


def test_attention_mesh_batch_equals_one_at_a_time(installed_models, photos):
    module = convert(installed_models["face_landmark_with_attention"]).eval()
    faces = torch.from_numpy(np.concatenate(
        [_to_model_input(_face_crop(photo, name), module.input_shapes[0], (0.0, 1.0))
         for name, photo in photos.items()] + [np.random.default_rng(2).uniform(
             0, 1, size=(1, 192, 192, 3)).astype(np.float32)]))
    with torch.no_grad():
        batched = module(faces)
        single = [module(faces[i:i + 1]) for i in range(len(faces))]
    for position in range(len(batched)):
        for i in range(len(faces)):
            assert relative_error(batched[position][i:i + 1].numpy(),
                                  single[i][position].numpy()) < 1e-5


# ---------------------------------------------------------------------------------------------
# Custom operators against straightforward per-pixel transcriptions of MediaPipe's CPU kernels


def _transform_tensor_bilinear_loop(features_hwc, matrix, out_h, out_w):
    height, width, _ = features_hwc.shape
    m = matrix.astype(np.float64)
    out = np.zeros((out_h, out_w, features_hwc.shape[2]), np.float64)
    for oy in range(out_h):
        for ox in range(out_w):
            x = m[0, 0] * (ox + 0.5) + m[0, 1] * (oy + 0.5) + m[0, 3] - 0.5
            y = m[1, 0] * (ox + 0.5) + m[1, 1] * (oy + 0.5) + m[1, 3] - 0.5
            if x < 0 or y < 0 or x > width - 1 or y > height - 1:
                continue
            x0, y0 = int(np.floor(x)), int(np.floor(y))
            fx, fy = x - x0, y - y0

            def read(row, col):
                inside = 0 <= row < height and 0 <= col < width
                return features_hwc[row, col] if inside else 0.0
            top = (1 - fx) * read(y0, x0) + fx * read(y0, x0 + 1)
            bottom = (1 - fx) * read(y0 + 1, x0) + fx * read(y0 + 1, x0 + 1)
            out[oy, ox] = (1 - fy) * top + fy * bottom
    return out


def test_transform_tensor_bilinear_matches_the_kernel_semantics():
    from facecast.models.custom_ops import TransformTensorBilinear

    rng = np.random.default_rng(3)
    features = rng.normal(size=(2, 12, 10, 3)).astype(np.float32)  # NHWC
    angle = 0.4
    matrices = np.zeros((2, 4, 4), np.float32)
    # Sample 1: rotated and scaled, partly outside the map; sample 2: an integer shift.
    matrices[0, :2, :2] = 0.7 * np.array([[np.cos(angle), -np.sin(angle)],
                                          [np.sin(angle), np.cos(angle)]])
    matrices[0, :2, 3] = (3.3, -1.2)
    matrices[1, :2, :2] = np.eye(2)
    matrices[1, :2, 3] = (2.0, 1.0)
    matrices[:, 2, 2] = matrices[:, 3, 3] = 1.0
    op = TransformTensorBilinear(8, 9)
    with torch.no_grad():
        out = op(torch.from_numpy(features).permute(0, 3, 1, 2), torch.from_numpy(matrices))
    out = out.permute(0, 2, 3, 1).numpy()
    for i in range(2):
        expected = _transform_tensor_bilinear_loop(features[i], matrices[i], 8, 9)
        assert np.abs(out[i] - expected).max() < 1e-5
    # An integer shift copies pixels; the last column falls past the map's right edge: zero.
    np.testing.assert_allclose(out[1][:, :8], features[1, 1:9, 2:10], atol=1e-6)
    assert (out[1][:, 8] == 0).all()
    assert (out[0] == 0).any()  # some samples fell outside the map and are zero


def test_landmarks_to_transform_matrix_frames_the_subset():
    from facecast.models.custom_ops import Landmarks2TransformMatrix

    # Points on a rectangle (width 20, height 10) centred at (40, 30), rotated by 0.3 rad, with
    # the rotation landmarks at the ends of its long axis.
    angle, centre = 0.3, np.array([40.0, 30.0])
    corners = np.array([[-10, -5], [10, -5], [10, 5], [-10, 5], [-10, 0], [10, 0]], np.float64)
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    points = corners @ rotation.T + centre
    landmarks = np.zeros((1, 6, 3), np.float32)
    landmarks[0, :, :2] = points
    op = Landmarks2TransformMatrix({"left_rotation_idx": 4, "right_rotation_idx": 5,
                                    "output_width": 16, "output_height": 8, "scale_x": 1.5,
                                    "scale_y": 2.0, "subset_idxs": [0, 1, 2, 3],
                                    "target_rotation_radians": 0.0})
    matrix = op(torch.from_numpy(landmarks))[0].double().numpy()
    crop_centre = matrix[:2, :2] @ np.array([8.0, 4.0]) + matrix[:2, 3]
    np.testing.assert_allclose(crop_centre, centre, atol=1e-4)
    # The crop's x axis runs along the face's left→right line, scaled by 1.5 * 20 / 16 per pixel.
    np.testing.assert_allclose(matrix[:2, 0], 1.5 * 20 / 16 * rotation[:, 0], atol=1e-5)
    np.testing.assert_allclose(matrix[:2, 1], 2.0 * 10 / 8 * rotation[:, 1], atol=1e-5)
    np.testing.assert_allclose(matrix[2:], [[0, 0, 1, 0], [0, 0, 0, 1]])


def test_transform_landmarks_maps_xy_and_keeps_z():
    from facecast.models.custom_ops import TransformLandmarks

    matrix = torch.tensor([[[2.0, 0.5, 0.0, 3.0], [-0.5, 1.0, 0.0, -1.0],
                            [0, 0, 1, 0], [0, 0, 0, 1]]])
    landmarks = torch.tensor([[[1.0, 2.0, 7.0], [0.0, -1.0, -3.0]]])
    out = TransformLandmarks()(landmarks, matrix)
    expected = torch.tensor([[[2 + 1 + 3, -0.5 + 2 - 1, 7.0], [-0.5 + 3, -1 - 1, -3.0]]])
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------------------------------------
# Errors


def test_unsupported_operator_names_the_operator_and_the_model(tmp_path):
    model = TinyModel()
    x = model.input([1, 4])
    y = model.op("CUMSUM", [x, model.const(np.int32(1), np.int32)], [1, 4],
                 options("CumsumOptions"))
    path = tmp_path / "tiny_cumsum.tflite"
    path.write_bytes(model.build([y]))
    with pytest.raises(UnsupportedOp, match=r"'tiny_cumsum'.*CUMSUM"):
        convert(path)


def test_wrong_input_shape_is_a_clear_error(installed_models):
    module = convert(installed_models["face_detection_short_range"])
    with pytest.raises(ValueError, match=r"\(N, 128, 128, 3\)"):
        module(torch.zeros(1, 3, 128, 128))


def test_not_a_tflite_file(tmp_path):
    path = tmp_path / "model.tflite"
    path.write_bytes(b"PK\x03\x04 not a flatbuffer")
    with pytest.raises(ValueError, match="not a TFLite flatbuffer"):
        convert(path)


# ---------------------------------------------------------------------------------------------
# GPU


# float16 (relative to max(1, output scale)): float16 keeps ~3 significant digits. Measured with
# torch's CPU float16 on the photos: backbones <= 5e-3, the attention mesh's refined lips/eyes/
# irises up to 3.5e-2 (their crop placement follows float16 landmarks), and pose segmentation
# logits 0.36 (reported, not asserted, as for LiteRT). CUDA accumulates in float32, so these
# bounds are expected to hold with margin; tighten them from the table of a GPU run.
FP16_TOLERANCE = 1e-2
FP16_REFINED_TOLERANCE = 5e-2
# The body-pose models measured 1.0e-2 and 2.2e-2 in float16 on an H200 (float32: 2e-7): their
# activations span a wider range. Face models stay at 1e-2.
FP16_POSE_TOLERANCE = 3e-2
REFINED_OUTPUTS = {"output_lips", "output_left_eye", "output_right_eye", "output_left_iris",
                   "output_right_iris"}


@pytest.fixture
def no_tf32():
    """Parity is about the converter, not the GPU's fast math: Ampere and later GPUs run float32
    convolutions and matmuls in TF32 (10-bit mantissa) by default in PyTorch, which alone moves
    outputs by ~1e-3. Production keeps TF32 (it is a speed choice); this test measures without."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(INPUT_RANGES))
def test_cuda_module_matches_cpu_module(name, installed_models, photos, no_tf32):
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False: no CUDA GPU on this machine")
    module = convert(installed_models[name], name=name).eval()
    inputs = torch.from_numpy(np.concatenate(_inputs(name, module.input_shapes[0], photos)))
    with torch.no_grad():
        expected = module(inputs)
        on_gpu = module.to("cuda")
        got32 = on_gpu(inputs.cuda())
        # float16 on the photos only: on uniform noise, activations leave float16's useful range.
        got16 = on_gpu.half()(inputs[1:].cuda().half())
    for position, output_name in enumerate(module.output_names):
        error32 = relative_error(got32[position].cpu().numpy(), expected[position].numpy())
        error16 = relative_error(got16[position].float().cpu().numpy(),
                                 expected[position][1:].numpy())
        tolerance16 = (FP16_REFINED_TOLERANCE if output_name in REFINED_OUTPUTS
                       else FP16_POSE_TOLERANCE if name.startswith("pose_") else FP16_TOLERANCE)
        PARITY_TABLE[(f"{name} cuda fp32", output_name)] = (error32, TOLERANCE)
        # A noisy output is not held in float16 (NOISY_OUTPUTS): its row says so, with no bound.
        noisy = (name, position) in NOISY_OUTPUTS
        PARITY_TABLE[(f"{name} cuda fp16", output_name)] = (error16, math.inf if noisy else tolerance16)
        assert error32 <= TOLERANCE, f"{name} {output_name} fp32 on CUDA: {error32:.2e}"
        if not noisy:
            assert error16 <= tolerance16, f"{name} {output_name} fp16 on CUDA: {error16:.2e}"
