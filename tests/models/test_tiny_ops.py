"""Operators the blendshape MLP-Mixer needs but no shipped model uses, in tiny models built here,
torch against LiteRT. Each model runs in torch as one batch of three and in LiteRT one sample at
a time, so the batch handling of batch-folding operators (FULLY_CONNECTED, RESHAPE to rank 2,
BATCH_MATMUL, TRANSPOSE) is checked too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from facecast.models.tflite_convert import convert

from litert_reference import PARITY_TABLE, relative_error, run_litert
from tiny_tflite import TinyModel, options

TOLERANCE = 1e-4
rng = np.random.default_rng(7)


def _weights(*shape, scale=0.3):
    return (rng.normal(size=shape) * scale).astype(np.float32)


def _check(tmp_path, name: str, model: TinyModel, outputs, input_shapes, low=-2.0, high=2.0):
    path = tmp_path / f"{name}.tflite"
    path.write_bytes(model.build(outputs))
    module = convert(path, name=name)
    samples = [[rng.uniform(low, high, size=shape).astype(np.float32) for shape in input_shapes]
               for _ in range(3)]
    batched_inputs = [torch.from_numpy(np.concatenate(
        [s[k] if shape[0] == 1 else s[k][None] for s in samples]))
        for k, shape in enumerate(input_shapes)]
    with torch.no_grad():
        got = module(*batched_inputs)
    worst = 0.0
    for index, sample in enumerate(samples):
        expected = run_litert(path.read_bytes(), sample)
        for position, value in enumerate(expected):
            actual = got[position][index]
            if value.ndim == actual.ndim + 1:  # a batch-1 output: drop LiteRT's size-1 batch dim
                value = value[0]
            worst = max(worst, relative_error(actual.numpy(), value))
    PARITY_TABLE[("tiny", name)] = (worst, TOLERANCE)
    assert worst <= TOLERANCE, f"{name}: {worst:.2e}"


@pytest.mark.parametrize("keep_num_dims", [False, True])
def test_fully_connected_folds_the_batch(tmp_path, keep_num_dims):
    model = TinyModel()
    x = model.input([1, 146, 2])
    weight = model.op("DEQUANTIZE", [model.const(_weights(64, 2), np.float16)], [64, 2])
    out_shape = [1, 146, 64] if keep_num_dims else [146, 64]
    y = model.op("FULLY_CONNECTED", [x, weight, model.const(_weights(64))], out_shape,
                 options("FullyConnectedOptions", keepNumDims=keep_num_dims,
                         fusedActivationFunction=1))
    _check(tmp_path, f"fc_keep{int(keep_num_dims)}", model, [y], [[1, 146, 2]])


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu(tmp_path, approximate):
    model = TinyModel()
    x = model.input([1, 8, 16])
    y = model.op("GELU", [x], [1, 8, 16], options("GeluOptions", approximate=approximate))
    _check(tmp_path, f"gelu_{'tanh' if approximate else 'erf'}", model, [y], [[1, 8, 16]], -4, 4)


@pytest.mark.parametrize("op", ["ADD", "SUB", "MUL", "DIV", "SQUARED_DIFFERENCE", "MAXIMUM",
                                "MINIMUM"])
def test_binary_with_scalar_vector_and_activation_operands(tmp_path, op):
    model = TinyModel()
    x = model.input([1, 6, 5])
    z = model.input([1, 6, 5])
    opts = options(f"{op.title().replace('_', '')}Options") if op in ("ADD", "SUB", "MUL",
                                                                     "DIV") else None
    scalar = model.const(np.float32(1.7))
    vector = model.const(_weights(5) + 2.5)  # positive: a safe divisor
    y = model.op(op, [x, scalar], [1, 6, 5], opts)
    y = model.op(op, [vector, y], [1, 6, 5], opts)
    y = model.op(op, [y, z], [1, 6, 5], opts)
    _check(tmp_path, f"binary_{op.lower()}", model, [y], [[1, 6, 5], [1, 6, 5]], 0.5, 2.0)


def test_unary_chain(tmp_path):
    model = TinyModel()
    x = model.input([1, 4, 9])
    y = model.op("SQRT", [x], [1, 4, 9])
    y = model.op("RSQRT", [y], [1, 4, 9])
    y = model.op("NEG", [y], [1, 4, 9])
    y = model.op("TANH", [y], [1, 4, 9])
    y = model.op("LOGISTIC", [y], [1, 4, 9])
    _check(tmp_path, "unary_chain", model, [y], [[1, 4, 9]], 0.1, 3.0)


def test_layer_norm_and_softmax(tmp_path):
    """The layer norm that TFLite decomposes: MEAN, SQUARED_DIFFERENCE, RSQRT, SUB, MUL, ADD."""
    model = TinyModel()
    x = model.input([1, 10, 16])
    axis = model.const(np.array([2], np.int32), np.int32)
    mean = model.op("MEAN", [x, axis], [1, 10, 1], options("ReducerOptions", keepDims=True))
    spread = model.op("SQUARED_DIFFERENCE", [x, mean], [1, 10, 16])
    variance = model.op("MEAN", [spread, axis], [1, 10, 1], options("ReducerOptions", keepDims=True))
    variance = model.op("ADD", [variance, model.const(np.float32(1e-6))], [1, 10, 1],
                        options("AddOptions"))
    inverse = model.op("RSQRT", [variance], [1, 10, 1])
    centred = model.op("SUB", [x, mean], [1, 10, 16], options("SubOptions"))
    y = model.op("MUL", [centred, inverse], [1, 10, 16], options("MulOptions"))
    y = model.op("MUL", [y, model.const(_weights(16))], [1, 10, 16], options("MulOptions"))
    y = model.op("ADD", [y, model.const(_weights(16))], [1, 10, 16], options("AddOptions"))
    y = model.op("SOFTMAX", [y], [1, 10, 16], options("SoftmaxOptions", beta=1.3))
    total = model.op("SUM", [y, model.const(np.array([1], np.int32), np.int32)], [1, 16],
                     options("ReducerOptions", keepDims=False))
    _check(tmp_path, "layer_norm_softmax", model, [y, total], [[1, 10, 16]])


def test_mlp_mixer_block(tmp_path):
    """A miniature MLP-Mixer: token mixing through TRANSPOSE + FULLY_CONNECTED, channel mixing,
    a BATCH_MATMUL against a constant and against an activation, STRIDED_SLICE and
    CONCATENATION, and a final output without batch dimension ([52])."""
    model = TinyModel()
    tokens, channels = 146, 8
    x = model.input([1, tokens, 2])
    h = model.op("FULLY_CONNECTED", [x, model.const(_weights(channels, 2)),
                                     model.const(_weights(channels))], [1, tokens, channels],
                 options("FullyConnectedOptions", keepNumDims=True))
    t = model.op("TRANSPOSE", [h, model.const(np.array([0, 2, 1], np.int32), np.int32)],
                 [1, channels, tokens])
    t = model.op("FULLY_CONNECTED", [t, model.const(_weights(32, tokens, scale=0.1))],
                 [channels, 32], options("FullyConnectedOptions"))  # folds the batch: [8, 32]
    t = model.op("GELU", [t], [channels, 32], options("GeluOptions"))
    t = model.op("RESHAPE", [t, model.const(np.array([1, channels, 32], np.int32), np.int32)],
                 [1, channels, 32], options("ReshapeOptions", newShape=[1, channels, 32]))
    m = model.op("BATCH_MATMUL", [t, model.const(_weights(32, 12))], [1, channels, 12],
                 options("BatchMatMulOptions"))
    g = model.op("BATCH_MATMUL", [m, m], [1, channels, channels],
                 options("BatchMatMulOptions", adjY=True))
    s = model.op("STRIDED_SLICE", [g, model.const(np.array([0, 1, 0], np.int32), np.int32),
                                   model.const(np.array([1, 7, 8], np.int32), np.int32),
                                   model.const(np.array([1, 2, 1], np.int32), np.int32)],
                 [1, 3, channels], options("StridedSliceOptions", beginMask=1, endMask=1))
    c = model.op("CONCATENATION", [s, s], [1, 6, channels],
                 options("ConcatenationOptions", axis=1))
    flat = model.op("RESHAPE", [c, model.const(np.array([48], np.int32), np.int32)], [48],
                    options("ReshapeOptions", newShape=[48]))
    padded = model.op("PAD", [flat, model.const(np.array([[2, 2]], np.int32), np.int32)], [52])
    out = model.op("LOGISTIC", [padded], [52])
    _check(tmp_path, "mlp_mixer_block", model, [out], [[1, tokens, 2]], 0.0, 1.0)


def test_average_pool_same_padding_excludes_the_padding(tmp_path):
    model = TinyModel()
    x = model.input([1, 7, 6, 3])
    y = model.op("AVERAGE_POOL_2D", [x], [1, 4, 3, 3],
                 options("Pool2DOptions", padding=0, strideW=2, strideH=2, filterWidth=3,
                         filterHeight=3))
    _check(tmp_path, "avg_pool_same", model, [y], [[1, 7, 6, 3]])


@pytest.mark.parametrize("align_corners,half_pixel", [(False, False), (True, False),
                                                       (False, True)])
def test_resize_bilinear_conventions(tmp_path, align_corners, half_pixel):
    model = TinyModel()
    x = model.input([1, 5, 7, 2])
    y = model.op("RESIZE_BILINEAR", [x, model.const(np.array([9, 16], np.int32), np.int32)],
                 [1, 9, 16, 2], options("ResizeBilinearOptions", alignCorners=align_corners,
                                        halfPixelCenters=half_pixel))
    _check(tmp_path, f"resize_ac{int(align_corners)}_hp{int(half_pixel)}", model, [y],
           [[1, 5, 7, 2]])


def test_depth_to_space_then_strided_conv(tmp_path):
    model = TinyModel()
    x = model.input([1, 4, 4, 8])
    y = model.op("DEPTH_TO_SPACE", [x], [1, 8, 8, 2], options("DepthToSpaceOptions", blockSize=2))
    y = model.op("CONV_2D", [y, model.const(_weights(3, 3, 3, 2)), model.const(_weights(3))],
                 [1, 4, 4, 3], options("Conv2DOptions", padding=0, strideW=2, strideH=2,
                                       fusedActivationFunction=3))
    _check(tmp_path, "depth_to_space_conv", model, [y], [[1, 4, 4, 8]])
