"""TFLite builtin operators as torch modules, one builder per operator type.

Each builder takes an :class:`OpSpec` (what the flatbuffer says about one operator) and returns a
module whose ``forward`` takes the operator's *activation* inputs, in the operator's input order,
and returns its output(s). Constant inputs (weights, shapes, axes) are baked into the module at
conversion time, as buffers, so that ``.to(device)`` and ``.half()`` move them with the module.

Note [Batch and layout]
~~~~~~~~~~~~~~~~~~~~~~~
MediaPipe exports its models with batch 1, and some operators (RESHAPE, FULLY_CONNECTED) fold
that batch dimension into others. The converted module must accept any batch N, so it computes
what the tflite model would compute for each sample separately: a tflite tensor of static shape
``S`` is held in torch as ``[N, *S]`` ("full form"), with two zero-copy conventions on top:

* when ``S[0] == 1`` (the model's batch dimension) that size-1 dimension is replaced by N, i.e.
  torch holds ``[N, *S[1:]]``;
* a 4-D image tensor ``[1, H, W, C]`` is held as the NCHW view ``[N, C, H, W]`` so that torch's
  convolutions run without copies (of a contiguous NHWC tensor this view is exactly torch's
  ``channels_last`` memory format).

Every operator whose semantics depend on axes converts to the full form (a view), applies the
operator with axes shifted by one, and converts back; element-wise operators and convolutions
work on the held form directly. :func:`to_full` and :func:`from_full` are the only two places
that know the convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from facecast.models import triton_kernels


class UnsupportedOp(ValueError):
    """The model uses an operator (or an operator variant) that the converter does not implement."""


@dataclass
class TensorSpec:
    """One tensor of the flatbuffer: static shape (batch 1), dtype and, for constants, its value."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype | None
    data: np.ndarray | None = None
    sparsity: dict | None = None
    quant_scale: np.ndarray | None = None
    quant_zero_point: np.ndarray | None = None
    quant_axis: int = 0

    @property
    def is_constant(self) -> bool:
        return self.data is not None


@dataclass
class OpSpec:
    """One operator of the flatbuffer, with its options already decoded."""

    index: int
    type: str
    version: int
    custom: bool
    options: Any
    inputs: list[TensorSpec | None]
    outputs: list[TensorSpec]
    model: str
    extra: dict = field(default_factory=dict)

    def where(self) -> str:
        return (f"model {self.model!r}, operator #{self.index} {self.type} "
                f"(output {self.outputs[0].name!r})")

    def unsupported(self, why: str) -> UnsupportedOp:
        return UnsupportedOp(f"{self.where()}: {why}")

    def constant(self, position: int) -> np.ndarray:
        tensor = self.inputs[position]
        if tensor is None or tensor.data is None:
            raise self.unsupported(f"input {position} must be a constant")
        return tensor.data


# ---------------------------------------------------------------------------------------------
# Layout helpers — see Note [Batch and layout]


def is_batched(shape: tuple[int, ...]) -> bool:
    """True when the tflite tensor's first dimension is the model's batch dimension (size 1)."""
    return len(shape) >= 1 and shape[0] == 1


def is_image(shape: tuple[int, ...]) -> bool:
    """True for [1, H, W, C] tensors, which torch holds as NCHW."""
    return len(shape) == 4 and shape[0] == 1


def per_sample_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape after N, in tflite dimension order."""
    return tuple(shape[1:]) if is_batched(shape) else tuple(shape)


def tfl_order_to_torch(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[N, *per_sample_shape] in tflite order → the held form."""
    return x.permute(0, 3, 1, 2) if is_image(shape) else x


def torch_to_tfl_order(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The held form → [N, *per_sample_shape] in tflite order."""
    return x.permute(0, 2, 3, 1) if is_image(shape) else x


def to_full(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The held form → [N, *shape] (a view)."""
    y = torch_to_tfl_order(x, shape)
    return y.unsqueeze(1) if is_batched(shape) else y


def from_full(y: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[N, *shape] → the held form (a view)."""
    if is_batched(shape):
        y = y.squeeze(1)
    return tfl_order_to_torch(y, shape)


def _full_rank(x: torch.Tensor, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Full form, with size-1 dimensions inserted after N up to ``rank`` tflite dimensions."""
    y = to_full(x, shape)
    return y.reshape(y.shape[0], *([1] * (rank - len(shape))), *shape)


def _held_constant(value: np.ndarray, out_shape: tuple[int, ...]) -> torch.Tensor:
    """A constant in the held form of a batched tensor of rank len(out_shape), for broadcasting."""
    rank = len(out_shape)
    padded = value.reshape((1,) * (rank - value.ndim) + value.shape)
    if rank == 4:
        padded = padded.transpose(0, 3, 1, 2)
    return _float_buffer(padded)


def _full_constant(value: np.ndarray, rank: int) -> torch.Tensor:
    """A constant as a full-form tensor [1, 1..., *value.shape] of rank+1 dims."""
    padded = value.reshape((1,) * (rank - value.ndim + 1) + value.shape)
    return _float_buffer(padded)


def _float_buffer(value: np.ndarray) -> torch.Tensor:
    # A copy: constants may be read-only views of the flatbuffer's bytes.
    return torch.from_numpy(np.array(value, dtype=np.float32, order="C", copy=True))


# ---------------------------------------------------------------------------------------------
# Fused activations (ActivationFunctionType)

_NO_ACTIVATION = 0


def _apply_activation(x: torch.Tensor, code: int) -> torch.Tensor:
    """The fused activation, in place: every caller passes the fresh output of its own operator
    (no other reference to it exists), so no second activation-sized tensor is allocated."""
    if code == 0:
        return x
    if code == 1:
        return torch.relu_(x)
    if code == 2:
        return x.clamp_(-1.0, 1.0)
    if code == 3:
        return x.clamp_(0.0, 6.0)
    if code == 4:
        return torch.tanh_(x)
    raise AssertionError(f"activation {code} was accepted at build time")


def _activation_code(op: OpSpec) -> int:
    code = op.options.FusedActivationFunction() if op.options is not None else 0
    if code not in (0, 1, 2, 3, 4):
        raise op.unsupported(f"fused activation {code} (SIGN_BIT) is not implemented")
    return code


def _same_padding(size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's SAME padding (before, after); the extra pixel goes after, not before."""
    out = -(-size // stride)
    effective_kernel = (kernel - 1) * dilation + 1
    total = max((out - 1) * stride + effective_kernel - size, 0)
    return total // 2, total - total // 2


def _padding_ltrb(op: OpSpec, height: int, width: int, kernel_h: int, kernel_w: int,
                  stride_h: int, stride_w: int, dilation_h: int = 1, dilation_w: int = 1):
    if op.options.Padding() == 1:  # VALID
        return (0, 0, 0, 0)
    top, bottom = _same_padding(height, kernel_h, stride_h, dilation_h)
    left, right = _same_padding(width, kernel_w, stride_w, dilation_w)
    return (left, right, top, bottom)  # F.pad order: last dim first


def _require_image(op: OpSpec, tensor: TensorSpec):
    if not is_image(tensor.shape):
        raise op.unsupported(f"input {tensor.name!r} must be a [1, H, W, C] image, got {tensor.shape}")


# ---------------------------------------------------------------------------------------------
# Convolutions and pooling


# Note [Convolutions on the GPU]
#     F.conv2d on CUDA runs cuDNN and then adds the bias in a pass of its own over the output
#     (a broadcast, so PyTorch's slower non-vectorised elementwise kernel), and the activation in
#     another. At the daemon's batches on the H100 (channels_last, each convolution 20
#     times in a CUDA graph, bench/conv_kernels.py, 2026-11-26) those passes were most of the time:
#     the full-range detector's convolutions at 288 inputs took 6.9 ms in float16 (9.8 in
#     float32), 3.2 (5.4) of them without their biases. So, on a GPU:
#       - a 1x1 convolution (`is_pointwise`) is the matrix product of the NHWC rows
#         (`pointwise_rows`): cuBLASLt adds the bias, and a ReLU, in the product's epilogue.
#         Float16: full-range detector 3.5 -> 1.5 ms for its 48 such convolutions, the
#         attention mesh 0.53 -> 0.38, the v2 landmarker 1.13 -> 0.63. In float32, cuDNN's
#         fused convolution, bias and ReLU (below) is faster for those with a ReLU (the
#         detector's 30: 2.8 ms as before, 2.0 as rows, 1.2 fused), rows for the rest (its 18:
#         2.4 -> 1.3);
#       - in float32, a depthwise convolution's bias moves into the 1x1 convolution that reads
#         it (tflite_convert.fold_depthwise_bias, FacePipeline._prepare): the detector's
#         depthwise convolutions 3.8 -> 2.0 ms without their biases (40 of its 42 qualify).
#         Not in float16: there the moved bias, rounded to float16 as the 1x1 convolution's,
#         moved one box of tests/models/test_speed_paths.py's 32-camera scene (min IoU against
#         float32 without TF32: 0.9988 without the fold, 0.933 with it; H100);
#       - any other convolution with a ReLU and a bias is cuDNN's fused convolution, bias and
#         ReLU (torch.cudnn_convolution_relu): the detector's first, 0.54 -> 0.19 ms (float16);
#       - in float32, a 1x1 convolution of an image held as NCHW (the blendshape model's token
#         mixing, after a transpose) is one batched matrix product of its columns
#         (`pointwise_columns`): cuDNN wrapped each of those in two or three layout changes
#         (NCHW to NHWC and back), and the rows of such a tensor are no view (`pointwise_rows`
#         copied them first). In float32 only, where it was measured (the blendshape model
#         always runs in float32): on the one GPU run with it in float16 too, the pose
#         landmarker's float16 parity moved past its bound (tests/models/test_convert_parity.py,
#         0.037 against 0.03, H100, 2026-11-27), though on the CPU none of that model's
#         convolutions reads an image held as NCHW; the cause is not known yet.
#     cuDNN's fused convolution + add + ReLU (for a residual add) was slower than all three
#     passes (25 ms for the same depthwise convolutions), and PyTorch's own depthwise kernel
#     slower than cuDNN's at these batches but for a few float16 shapes (Note [Float16
#     depthwise convolutions]). The sums are the same up to float rounding (fp16: the outputs
#     of a 1x1 convolution within 1 unit in the last place).

# Note [Float16 depthwise convolutions]
#     cuDNN's float16 depthwise convolutions over channels_last activations are its fastest for
#     most of the models' shapes, but for two kinds of the landmark models' it is several times
#     slower than the alternatives (H100, cuDNN 9.19, 64 faces, each convolution in a CUDA
#     graph with its bias, bench/conv_kernels.py, 2026-11-27):
#       - few channels over many pixels: the v2 landmarker's four 8-channel 128x128
#         convolutions took 180 us each, 94 as cuDNN's float32 convolution with the casts to
#         and from float32 (103 in PyTorch's own kernel). The full-range detector's 8-channel
#         96x96 ones at 288 inputs are fast (105 us; 248 in float32), so the rule is both:
#         at most FLOAT32_DEPTHWISE_MAX_CHANNELS channels over at least
#         FLOAT32_DEPTHWISE_MIN_PIXELS pixels;
#       - 2x2 images: the v2 landmarker's five 64-channel ones 35 us each, the attention mesh's
#         five 32-channel ones 20, PyTorch's own kernel 4.7 and 4.5 (its 128-channel ones 2.5
#         either way): at most NATIVE_DEPTHWISE_MAX_PIXELS pixels.
#     The others stay cuDNN's (within 1 us of the best, or the best). In float32 cuDNN was the
#     fastest for every shape. The same sums: the float32 convolution rounds once to float16
#     where cuDNN's float16 one rounds the sum and then the sum plus the bias (its outputs are
#     the more exact), PyTorch's kernel accumulates in float32 as cuDNN's does. The landmark
#     model's forward at 64 faces in float16, in a CUDA graph: 2.85 ms -> 2.67 with every
#     depthwise convolution in float32, and with this choice: docs/benchmarks.md.
#     Since 2026-11-27 (afternoon), in a CUDA graph's work, one kernel of ours
#     (triton_kernels.depthwise_conv: float32 sums, the bias and the activation in the same
#     pass) takes the few-channel ones (30 us each against 94 in float32) and those with at most
#     TRITON_DEPTHWISE_MAX_OUTPUTS output values over a power-of-two number of channels, where
#     cuDNN's fixed cost and its bias pass weigh most: the v2 landmarker's 64-channel 16x16 to
#     2x2 ones 8.4 / 6.9 / 4.1 / 4.7 us -> 6.8 / 3.6 / 2.7 / 2.5, the attention mesh's 128-channel
#     6x6 and 3x3 5.2 / 3.9 -> 4.2 / 3.1. Larger ones stay cuDNN's, faster there (the full-range
#     detector's at 288 inputs 10-45 % faster; 96 channels at 6x6: 6.4 against 8.6, hence the
#     power of two); H100, 64 faces, bench/conv_kernels.py's "Triton dw" column, 14:02 UTC.
FLOAT32_DEPTHWISE_MAX_CHANNELS = 8
FLOAT32_DEPTHWISE_MIN_PIXELS = 128 * 128
NATIVE_DEPTHWISE_MAX_PIXELS = 2 * 2
TRITON_DEPTHWISE_MAX_OUTPUTS = 1 << 20

# Note [Convolutions on the CPU]
#     On a GPU: Note [Convolutions on the GPU]. On the CPU, F.conv2d picks its kernel by a
#     heuristic made for NCHW and several threads: with one thread (facecast's CPU stack) and a
#     batch under 16 it sends every 1x1 convolution to its im2col+GEMM kernel ("thnn") and the
#     rest to oneDNN with the weights reordered on every call. Measured on the 2-core AMD EPYC
#     (AVX-512, torch 2.13, one thread), per call on the channels_last activations these models
#     hold (Note [Batch and layout]):
#       - the v2 landmarker's last convolution, a 2x2 kernel over its whole 2x2 input (a fully
#         connected layer, 512 -> 1434): 494 us in thnn, ~50 us as F.linear on the NHWC rows;
#       - a 1x1 convolution that narrows many pixels (16 -> 8 channels at 128x128): 348 us in
#         thnn, 126 us in oneDNN; widening ones (8 -> 16) the same in both;
#       - depthwise, strided and the first 3x3/5x5 convolutions: 10-20% less in oneDNN with the
#         weights reordered once (mkldnn._reorder_convolution_weight) than with F.conv2d's
#         per-call reorder; 2x2/stride-2 ones up to 40% less;
#       - 1x1 convolutions of few pixels (16x16 and less): thnn 8-50 us, oneDNN 27-65 us (its
#         fixed cost per call).
#     use_cpu_kernels() (FacePipeline._prepare, CPU devices only) gives each Conv2d its kernel
#     by those rules: "linear" for a kernel that covers its whole unpadded input, "thnn"
#     (F.conv2d) for 1x1 stride-1 convolutions that keep or widen their channels or have at most
#     THNN_MAX_PIXELS pixels a sample, oneDNN with weights packed once for the rest. The sums
#     are the same products in another order: outputs move by float rounding (the v2
#     landmarker's points by ~3e-4 px of 256; against LiteRT every model stays within 3e-5
#     relative, the "cpu_kernels" cases of tests/models/test_convert_parity.py and
#     test_face_landmarker_parity.py). A module moved to a GPU or to another dtype afterwards
#     runs F.conv2d again (the packed weights are a float32 CPU copy, not a buffer). With the
#     kernels, the v2 landmarker took 8.8 ms a face instead of 10.3 at batch 1, the full-range
#     detector 7.4 ms an input instead of 8.2 at batch 9 (same machine, alternating).
THNN_MAX_PIXELS = 16 * 16


def _mkldnn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_convolution_weight"))


class Conv2d(torch.nn.Module):
    """CONV_2D and DEPTHWISE_CONV_2D: explicit TF padding, then a torch convolution (NCHW);
    on the CPU, the kernel of Note [Convolutions on the CPU] once :meth:`use_cpu_kernel`
    chose it."""

    def __init__(self, weight_oihw: np.ndarray, bias: np.ndarray | None, stride, dilation,
                 groups: int, padding_ltrb, activation: int, in_hw: tuple[int, int] | None = None):
        super().__init__()
        self.in_hw = tuple(in_hw) if in_hw is not None else None  # the input's H, W before padding
        self.cpu_kernel = "conv2d"
        self._linear_weight = None  # "linear": (O, KH*KW*I), the NHWC rows' order
        self._packed_weight = None  # "onednn": the weight in oneDNN's own layout
        self.register_buffer("weight", _float_buffer(weight_oihw))
        self.register_buffer("bias", _float_buffer(bias) if bias is not None else None)
        self.stride = tuple(stride)
        self.dilation = tuple(dilation)
        self.groups = groups
        left, right, top, bottom = padding_ltrb
        # Symmetric padding goes into the convolution itself; TF's SAME padding is asymmetric
        # whenever the total is odd (the extra pixel after), which needs an explicit pad.
        if left == right and top == bottom:
            self.conv_padding = (top, left)
            self.explicit_padding = None
        else:
            self.conv_padding = (0, 0)
            self.explicit_padding = tuple(padding_ltrb)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return self._forward_gpu(x)
        kernel = self.cpu_kernel
        if kernel != "conv2d" and x.dtype != torch.float32:  # chosen for float32 weights
            kernel = "conv2d"
        if kernel == "linear":
            rows = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)
            y = F.linear(rows, self._linear_weight, self.bias)[:, :, None, None]
            return _apply_activation(y, self.activation)
        if self.explicit_padding is not None:
            x = F.pad(x, self.explicit_padding)
        if kernel == "onednn":
            y = torch.ops.mkldnn._convolution_pointwise(
                x, self._packed_weight, self.bias, self.conv_padding, self.stride, self.dilation,
                self.groups, "none", [], None)
        else:
            y = F.conv2d(x, self.weight, self.bias, self.stride, self.conv_padding, self.dilation,
                         self.groups)
        return _apply_activation(y, self.activation)

    def _forward_gpu(self, x: torch.Tensor) -> torch.Tensor:
        """Note [Convolutions on the GPU]; compiled, the plain convolution, whose bias and
        activation inductor fuses itself (Note [Compiled models])."""
        if torch.compiler.is_compiling():
            if self.explicit_padding is not None:
                x = F.pad(x, self.explicit_padding)
            y = F.conv2d(x, self.weight, self.bias, self.stride, self.conv_padding, self.dilation,
                         self.groups)
            return _apply_activation(y, self.activation)
        fused_relu = self.activation == 1 and self.bias is not None
        if self.is_pointwise() and x.dtype == torch.float32 and held_as_nchw(x):
            return pointwise_columns(x, self.weight, self.bias, self.activation)
        if self.is_pointwise() and not (fused_relu and x.dtype == torch.float32):
            return pointwise_rows(x, self.weight, self.bias, self.activation)
        if self.explicit_padding is not None:
            x = F.pad(x, self.explicit_padding)
        if fused_relu:
            return torch.cudnn_convolution_relu(x, self.weight, self.bias, self.stride,
                                                self.conv_padding, self.dilation, self.groups)
        if self.groups > 1 and x.dtype == torch.float16:
            return self._float16_depthwise(x)
        return self._convolve_then_bias(x)

    def _float16_depthwise(self, x: torch.Tensor) -> torch.Tensor:
        """A float16 depthwise convolution on a GPU (padded already): cuDNN's, its bias added by
        one kernel of ours (Note [A convolution's bias in one kernel]), or where it is measured
        slow, ours in float32 (in a graph's work), cuDNN's float32 one or PyTorch's own (Note
        [Float16 depthwise convolutions])."""
        channels, pixels = x.shape[1], x.shape[2] * x.shape[3]
        geometry = (self.stride, self.conv_padding, self.dilation, self.groups)
        few_channels = channels <= FLOAT32_DEPTHWISE_MAX_CHANNELS and pixels >= FLOAT32_DEPTHWISE_MIN_PIXELS
        if (few_channels or self._small_output(x)) and self.dilation == (1, 1):
            y = triton_kernels.depthwise_conv(x, self.weight, self.bias, self.stride, self.conv_padding,
                                              self.activation)
            if y is not None:  # in a graph's work: one kernel of ours
                return y
        if few_channels:
            bias = self.bias.float() if self.bias is not None else None
            y = F.conv2d(x.float(), self.weight.float(), bias, *geometry)
            return _apply_activation(y, self.activation).half()
        if pixels <= NATIVE_DEPTHWISE_MAX_PIXELS:
            with torch.backends.cudnn.flags(enabled=False):
                return _apply_activation(F.conv2d(x, self.weight, self.bias, *geometry), self.activation)
        return self._convolve_then_bias(x)

    def _small_output(self, x: torch.Tensor) -> bool:
        """At most TRITON_DEPTHWISE_MAX_OUTPUTS output values, over a power-of-two number of
        channels (Note [Float16 depthwise convolutions])."""
        batch, channels, height, width = x.shape
        (kernel_h, kernel_w), (stride_h, stride_w) = self.weight.shape[2:], self.stride
        out_h = (height + 2 * self.conv_padding[0] - kernel_h) // stride_h + 1
        out_w = (width + 2 * self.conv_padding[1] - kernel_w) // stride_w + 1
        return channels & (channels - 1) == 0 and batch * channels * out_h * out_w <= TRITON_DEPTHWISE_MAX_OUTPUTS

    def _convolve_then_bias(self, x: torch.Tensor) -> torch.Tensor:
        """cuDNN's convolution (padded already), then its bias added in place by one kernel of
        ours in a graph's work (Note [A convolution's bias in one kernel]), else by PyTorch's
        own pass, as F.conv2d adds it; then the activation."""
        y = F.conv2d(x, self.weight, None, self.stride, self.conv_padding, self.dilation, self.groups)
        if self.bias is not None and triton_kernels.add_channel_bias(y, self.bias) is None:
            y.add_(self.bias.reshape(1, -1, 1, 1))
        return _apply_activation(y, self.activation)

    def is_pointwise(self) -> bool:
        """A 1x1, stride-1, unpadded, ungrouped convolution: a matrix product of the NHWC rows."""
        return (self.groups == 1 and tuple(self.weight.shape[2:]) == (1, 1)
                and tuple(self.stride) == (1, 1) and tuple(self.dilation) == (1, 1)
                and self.explicit_padding is None and tuple(self.conv_padding) == (0, 0))

    def covers_whole_input(self) -> bool:
        """True when the kernel spans the whole unpadded input (one output pixel: a fully
        connected layer over the NHWC rows)."""
        return (self.in_hw is not None and self.groups == 1 and self.explicit_padding is None
                and tuple(self.conv_padding) == (0, 0) and tuple(self.dilation) == (1, 1)
                and tuple(self.weight.shape[2:]) == self.in_hw)

    def use_cpu_kernel(self) -> str:
        """Choose this convolution's CPU kernel (Note [Convolutions on the CPU]) for its
        weights as they are now (device and dtype); returns the choice."""
        self._linear_weight = self._packed_weight = None
        self.cpu_kernel = "conv2d"
        out_channels, in_per_group, kernel_h, kernel_w = self.weight.shape
        if self.weight.device.type != "cpu":
            return self.cpu_kernel
        if self.covers_whole_input():
            self._linear_weight = self.weight.permute(0, 2, 3, 1).reshape(out_channels, -1).contiguous()
            self.cpu_kernel = "linear"
            return self.cpu_kernel
        pointwise = (kernel_h, kernel_w) == (1, 1) and tuple(self.stride) == (1, 1) and self.groups == 1
        few_pixels = self.in_hw is None or self.in_hw[0] * self.in_hw[1] <= THNN_MAX_PIXELS
        if (pointwise and (out_channels >= in_per_group or few_pixels)) or not _mkldnn_available() \
                or self.weight.dtype != torch.float32:
            return self.cpu_kernel
        height, width = self.in_hw
        if self.explicit_padding is not None:
            left, right, top, bottom = self.explicit_padding
            height, width = height + top + bottom, width + left + right
        try:
            self._packed_weight = torch.ops.mkldnn._reorder_convolution_weight(
                self.weight, list(self.conv_padding), list(self.stride), list(self.dilation),
                self.groups, [1, in_per_group * self.groups, height, width])
        except RuntimeError:  # a CPU or build oneDNN does not serve: F.conv2d, as before
            return self.cpu_kernel
        self.cpu_kernel = "onednn"
        return self.cpu_kernel


def pointwise_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   activation: int) -> torch.Tensor:
    """A 1x1 convolution (`Conv2d.is_pointwise`) of an NCHW tensor as the matrix product of its
    NHWC rows, with the bias (and a ReLU) in the product's epilogue (Note [Convolutions on the
    GPU]). Returns NCHW with channels_last strides, as cuDNN does for channels_last input."""
    batch, channels, height, width = x.shape
    rows = x.permute(0, 2, 3, 1).reshape(-1, channels)  # a view when x is channels_last
    matrix = weight[:, :, 0, 0]
    if activation == 1 and bias is not None:
        y = torch._addmm_activation(bias, rows, matrix.t())
    else:
        y = _apply_activation(F.linear(rows, matrix, bias), activation)
    return y.view(batch, height, width, -1).permute(0, 3, 1, 2)


def held_as_nchw(x: torch.Tensor) -> bool:
    """Whether an image (N, C, H, W) lies in memory as NCHW (its NHWC rows are no view): the
    blendshape model's token-mixing convolutions read a transposed tensor so."""
    return x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)


def pointwise_columns(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      activation: int) -> torch.Tensor:
    """A 1x1 convolution (`Conv2d.is_pointwise`) of an image held as NCHW (`held_as_nchw`) as
    one batched matrix product, (O, C) by each image's (C, H·W) columns, then the bias and the
    activation in place: NCHW out, as in. cuDNN changed such a tensor to NHWC and its output
    back, three passes around each of the blendshape model's 9 (Note [Convolutions on the
    GPU])."""
    batch, channels, height, width = x.shape
    y = torch.matmul(weight.reshape(weight.shape[0], channels), x.view(batch, channels, height * width))
    if bias is not None:
        y.add_(bias.view(1, -1, 1))
    return _apply_activation(y.view(batch, -1, height, width), activation)


def _conv_bias(op: OpSpec) -> np.ndarray | None:
    if len(op.inputs) > 2 and op.inputs[2] is not None:
        return op.constant(2)
    return None


def build_conv_2d(op: OpSpec) -> torch.nn.Module:
    x = op.inputs[0]
    _require_image(op, x)
    weight = op.constant(1)  # [O, KH, KW, I]
    channels = x.shape[3]
    if channels % weight.shape[3]:
        raise op.unsupported(f"{channels} input channels is not a multiple of the filter's "
                             f"{weight.shape[3]}")
    o = op.options
    padding = _padding_ltrb(op, x.shape[1], x.shape[2], weight.shape[1], weight.shape[2],
                            o.StrideH(), o.StrideW(), o.DilationHFactor(), o.DilationWFactor())
    return Conv2d(weight.transpose(0, 3, 1, 2), _conv_bias(op), (o.StrideH(), o.StrideW()),
                  (o.DilationHFactor(), o.DilationWFactor()), channels // weight.shape[3],
                  padding, _activation_code(op), in_hw=x.shape[1:3])


def build_depthwise_conv_2d(op: OpSpec) -> torch.nn.Module:
    x = op.inputs[0]
    _require_image(op, x)
    weight = op.constant(1)  # [1, KH, KW, C * multiplier]; output channel c*M + m reads input c
    channels = x.shape[3]
    o = op.options
    padding = _padding_ltrb(op, x.shape[1], x.shape[2], weight.shape[1], weight.shape[2],
                            o.StrideH(), o.StrideW(), o.DilationHFactor(), o.DilationWFactor())
    return Conv2d(weight.transpose(3, 0, 1, 2), _conv_bias(op), (o.StrideH(), o.StrideW()),
                  (o.DilationHFactor(), o.DilationWFactor()), channels, padding,
                  _activation_code(op), in_hw=x.shape[1:3])


class MaxPool2d(torch.nn.Module):
    def __init__(self, kernel, stride, padding_ltrb, activation: int):
        super().__init__()
        self.kernel, self.stride = tuple(kernel), tuple(stride)
        self.padding = tuple(padding_ltrb) if any(padding_ltrb) else None
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding is not None:  # padded cells never win the max
            x = F.pad(x, self.padding, value=float("-inf"))
        return _apply_activation(F.max_pool2d(x, self.kernel, self.stride), self.activation)


class AvgPool2d(torch.nn.Module):
    """AVERAGE_POOL_2D: TFLite divides by the number of *valid* cells under the window."""

    def __init__(self, kernel, stride, padding_ltrb, valid_counts: np.ndarray, activation: int):
        super().__init__()
        self.kernel, self.stride = tuple(kernel), tuple(stride)
        self.padding = tuple(padding_ltrb) if any(padding_ltrb) else None
        self.register_buffer("valid_counts", _float_buffer(valid_counts))
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding is not None:
            x = F.pad(x, self.padding)
        window_sums = F.avg_pool2d(x, self.kernel, self.stride, divisor_override=1)
        return _apply_activation(window_sums / self.valid_counts, self.activation)


def _valid_cells(size: int, kernel: int, stride: int, before: int, out: int) -> np.ndarray:
    starts = np.arange(out) * stride - before
    return np.clip(starts + kernel, 0, size) - np.clip(starts, 0, size)


def build_pool(op: OpSpec) -> torch.nn.Module:
    x = op.inputs[0]
    _require_image(op, x)
    o = op.options
    kernel = (o.FilterHeight(), o.FilterWidth())
    stride = (o.StrideH(), o.StrideW())
    padding = _padding_ltrb(op, x.shape[1], x.shape[2], *kernel, *stride)
    if op.type == "MAX_POOL_2D":
        return MaxPool2d(kernel, stride, padding, _activation_code(op))
    out_h, out_w = op.outputs[0].shape[1:3]
    rows = _valid_cells(x.shape[1], kernel[0], stride[0], padding[2], out_h)
    cols = _valid_cells(x.shape[2], kernel[1], stride[1], padding[0], out_w)
    counts = (rows[:, None] * cols[None, :]).astype(np.float32)[None, None]
    return AvgPool2d(kernel, stride, padding, counts, _activation_code(op))


# ---------------------------------------------------------------------------------------------
# Element-wise operators


def _prelu(x, alpha):
    return torch.where(x >= 0, x, x * alpha)


_BINARY_FUNCTIONS: dict[str, Callable] = {
    "ADD": torch.add,
    "SUB": torch.sub,
    "MUL": torch.mul,
    "DIV": torch.div,
    "SQUARED_DIFFERENCE": lambda a, b: torch.square(a - b),
    "MAXIMUM": torch.maximum,
    "MINIMUM": torch.minimum,
    "POW": torch.pow,
    "PRELU": _prelu,
}
_FUSED_ACTIVATION_OPS = {"ADD", "SUB", "MUL", "DIV"}


class Binary(torch.nn.Module):
    """A broadcasting binary operator whose operands are activations or baked constants.

    When the output is batched and every activation operand has the output's rank, all operands
    share the held layout and broadcast directly; otherwise the operator runs on full forms.
    """

    def __init__(self, op_type: str, operand_shapes, constants, out_shape, direct: bool,
                 activation: int):
        super().__init__()
        self.op_type = op_type
        self.function = _BINARY_FUNCTIONS[op_type]
        self.operand_shapes = operand_shapes  # None for a constant operand
        self.out_shape = tuple(out_shape)
        self.direct = direct
        self.activation = activation
        for position, constant in enumerate(constants):
            if constant is not None:
                self.register_buffer(f"constant{position}", constant)

    def forward(self, *activations: torch.Tensor) -> torch.Tensor:
        rank = len(self.out_shape)
        remaining = iter(activations)
        operands = []
        for position, shape in enumerate(self.operand_shapes):
            if shape is None:
                operands.append(getattr(self, f"constant{position}"))
            elif self.direct:
                operands.append(next(remaining))
            else:
                operands.append(_full_rank(next(remaining), shape, rank))
        y = self.function(operands[0], operands[1])
        if not self.direct:
            y = from_full(y, self.out_shape)
        return _apply_activation(y, self.activation)


def build_binary(op: OpSpec) -> torch.nn.Module:
    out_shape = op.outputs[0].shape
    rank = len(out_shape)
    operands = op.inputs[:2]
    activations = [t for t in operands if t.data is None]
    if not activations:
        raise op.unsupported("both operands are constants")
    direct = is_batched(out_shape) and all(len(t.shape) == rank for t in activations) \
        and all(t.data.ndim <= rank for t in operands if t.data is not None)
    shapes, constants = [], []
    for t in operands:
        if t.data is None:
            shapes.append(tuple(t.shape))
            constants.append(None)
        else:
            shapes.append(None)
            value = t.data.reshape(t.shape) if t.shape else t.data.reshape(())
            constants.append(_held_constant(value, out_shape) if direct
                             else _full_constant(value, rank))
    activation = _activation_code(op) if op.type in _FUSED_ACTIVATION_OPS else _NO_ACTIVATION
    if (op.type == "PRELU" and direct and is_image(out_shape) and shapes[0] is not None and shapes[1] is None
            and constants[1].shape == (1, out_shape[3], 1, 1)):
        return ChannelPRelu(constants[1])
    return Binary(op.type, shapes, constants, out_shape, direct, activation)


class ChannelPRelu(torch.nn.Module):
    """PRELU of an image with one slope per channel: ``F.prelu``, one kernel where the generic
    :class:`Binary` form (``where(x >= 0, x, x * alpha)``) takes three and writes three tensors.
    Same values (a slope times a negative input, the input otherwise)."""

    def __init__(self, alpha_held: torch.Tensor):
        super().__init__()
        self.register_buffer("alpha", alpha_held.reshape(-1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not torch.compiler.is_compiling():  # compiled: inductor fuses it itself
            fused = triton_kernels.prelu(x, self.alpha)  # Note [PReLUs in one kernel]
            if fused is not None:
                return fused
        return F.prelu(x, self.alpha)


class ResidualPRelu(ChannelPRelu):
    """An ADD of two images and the PRELU that is its only reader, in one step
    (tflite_convert.fuse_residual_prelus): on a GPU one kernel (Note [PReLUs in one kernel]),
    elsewhere the two operators. Same values."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not torch.compiler.is_compiling():
            fused = triton_kernels.prelu(x, self.alpha, residual)
            if fused is not None:
                return fused
        return F.prelu(x + residual, self.alpha)


class PooledResidualPRelu(ChannelPRelu):
    """A residual block's shortcut with what reads it, in one step (tflite_convert.
    fuse_pooled_residuals): the 2x2 stride-2 MAX_POOL_2D of the block's input, the PAD that
    zero-extends its channels (where there is one), the ADD of the block's output and the
    PRELU that is its only reader. On a GPU one kernel (Note [Residual shortcuts in one kernel],
    models/triton_kernels.py); elsewhere the operators themselves, in their order. Same values.
    Takes the ADD's operands in their order, the shortcut's (now the pool's input) at
    ``shortcut_position``."""

    def __init__(self, alpha: torch.Tensor, pool: MaxPool2d, pad: Pad | None, shortcut_position: int):
        super().__init__(alpha)
        self.pool, self.pad, self.shortcut_position = pool, pad, shortcut_position

    def forward(self, *operands: torch.Tensor) -> torch.Tensor:
        source, x = operands[self.shortcut_position], operands[1 - self.shortcut_position]
        if x.is_cuda and not torch.compiler.is_compiling():
            fused = triton_kernels.pooled_residual_prelu(x, self.alpha, source)
            if fused is not None:
                return fused
        shortcut = self.pool(source)
        if self.pad is not None:
            shortcut = self.pad(shortcut)
        return F.prelu(x + shortcut, self.alpha)  # float addition commutes: the ADD's value


class LayerNormOverChannels(torch.nn.Module):
    """A layer norm over an image's channels as TFLite stores one, ten operators (see
    tflite_convert.fuse_layer_norms), in one step: on a GPU one kernel (Note [Layer norms in one
    kernel], models/triton_kernels.py), elsewhere (or where the kernel cannot serve) the ten
    operators themselves, in their order."""

    # The chain's operators, by the names of their outputs: (name, operator's position, inputs).
    WIRING = (("mean", 0, ("x",)), ("negated_mean", 1, ("mean",)), ("squares", 2, ("x", "mean")),
              ("variance", 3, ("squares",)), ("variance_eps", 4, ("variance",)),
              ("scale", 5, ("variance_eps",)), ("scaled_gamma", 6, ("scale",)),
              ("x_scaled", 7, ("x", "scaled_gamma")), ("mean_scaled", 8, ("negated_mean", "scaled_gamma")),
              ("out", 9, ("x_scaled", "mean_scaled")))

    def __init__(self, chain: list[torch.nn.Module], eps: float):
        super().__init__()
        self.chain = torch.nn.ModuleList(chain)
        self.eps = eps  # a Python number: reading the buffer on a GPU would wait for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            fused = triton_kernels.layer_norm_over_channels(x, self.chain[6].constant1.reshape(-1), self.eps)
            if fused is not None:
                return fused
        values = {"x": x}
        for name, position, inputs in self.WIRING:
            values[name] = self.chain[position](*(values[i] for i in inputs))
        return values["out"]


class Unary(torch.nn.Module):
    def __init__(self, function: Callable, name: str):
        super().__init__()
        self.function = function
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)

    def extra_repr(self) -> str:
        return self.name


def build_unary(op: OpSpec) -> torch.nn.Module:
    t = op.type
    if t == "GELU":
        approximate = "tanh" if (op.options is not None and op.options.Approximate()) else "none"
        return Unary(lambda x: F.gelu(x, approximate=approximate), f"GELU({approximate})")
    if t == "LEAKY_RELU":
        alpha = op.options.Alpha()
        return Unary(lambda x: F.leaky_relu(x, alpha), f"LEAKY_RELU({alpha})")
    return Unary(_UNARY_FUNCTIONS[t], t)


_UNARY_FUNCTIONS: dict[str, Callable] = {
    "RELU": torch.relu,
    "RELU6": lambda x: x.clamp(0.0, 6.0),
    "RELU_N1_TO_1": lambda x: x.clamp(-1.0, 1.0),
    "RELU_0_TO_1": lambda x: x.clamp(0.0, 1.0),
    "LOGISTIC": torch.sigmoid,
    "TANH": torch.tanh,
    "HARD_SWISH": F.hardswish,
    "ELU": F.elu,
    "EXP": torch.exp,
    "LOG": torch.log,
    "SQRT": torch.sqrt,
    "RSQRT": torch.rsqrt,
    "SQUARE": torch.square,
    "ABS": torch.abs,
    "NEG": torch.neg,
    "SIN": torch.sin,
    "COS": torch.cos,
    "FLOOR": torch.floor,
    "CEIL": torch.ceil,
}


# ---------------------------------------------------------------------------------------------
# Shape and indexing operators (full form)


class Reshape(torch.nn.Module):
    """RESHAPE, SQUEEZE, EXPAND_DIMS: reshape each sample to the output's static shape."""

    def __init__(self, in_shape, out_shape):
        super().__init__()
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.out_per_sample = per_sample_shape(self.out_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch_to_tfl_order(x, self.in_shape).reshape(x.shape[0], *self.out_per_sample)
        return tfl_order_to_torch(y, self.out_shape)


def build_reshape(op: OpSpec) -> torch.nn.Module:
    x = op.inputs[0]
    if math.prod(x.shape) != math.prod(op.outputs[0].shape):
        raise op.unsupported(f"cannot reshape {x.shape} to {op.outputs[0].shape}")
    return Reshape(x.shape, op.outputs[0].shape)


class FullForm(torch.nn.Module):
    """An operator written against the full form [N, *shape]: to_full → function → from_full."""

    def __init__(self, function: Callable, in_shape, out_shape, name: str):
        super().__init__()
        self.function = function
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return from_full(self.function(to_full(x, self.in_shape)), self.out_shape)

    def extra_repr(self) -> str:
        return self.name


def _check_static_shape(op: OpSpec, function: Callable, in_shape) -> None:
    """Run ``function`` on a tiny dummy full-form tensor and compare with the output's shape."""
    probe = torch.zeros((1, *in_shape))
    got = tuple(function(probe).shape[1:])
    if got != tuple(op.outputs[0].shape):
        raise op.unsupported(f"computed output shape {got} but the model says "
                             f"{tuple(op.outputs[0].shape)}")


def build_transpose(op: OpSpec) -> torch.nn.Module:
    perm = [int(p) % len(op.inputs[0].shape) for p in op.constant(1).reshape(-1)]
    dims = [0] + [p + 1 for p in perm]
    function = lambda y: y.permute(dims)  # noqa: E731 - a one-line closure over dims
    _check_static_shape(op, function, op.inputs[0].shape)
    return FullForm(function, op.inputs[0].shape, op.outputs[0].shape, f"TRANSPOSE{perm}")


def build_strided_slice(op: OpSpec) -> torch.nn.Module:
    shape = op.inputs[0].shape
    begin, end, strides = (op.constant(i).reshape(-1).tolist() for i in (1, 2, 3))
    o = op.options
    if o.EllipsisMask() or o.NewAxisMask():
        raise op.unsupported("ellipsis_mask and new_axis_mask are not implemented")
    offset = bool(o.Offset()) if hasattr(o, "Offset") else False
    index: list[Any] = [slice(None)]
    for dim in range(len(begin)):
        if strides[dim] <= 0:
            raise op.unsupported("non-positive strides are not implemented")
        start = None if o.BeginMask() >> dim & 1 else begin[dim]
        stop = None if o.EndMask() >> dim & 1 else end[dim]
        if offset and stop is not None:
            stop = begin[dim] + stop
        if o.ShrinkAxisMask() >> dim & 1:
            index.append(begin[dim] % shape[dim])
        else:
            index.append(slice(start, stop, strides[dim]))
    index = tuple(index)
    function = lambda y: y[index]  # noqa: E731
    _check_static_shape(op, function, shape)
    return FullForm(function, shape, op.outputs[0].shape, f"STRIDED_SLICE{index[1:]}")


def build_slice(op: OpSpec) -> torch.nn.Module:
    shape = op.inputs[0].shape
    begin, size = op.constant(1).reshape(-1).tolist(), op.constant(2).reshape(-1).tolist()
    index = (slice(None),) + tuple(
        slice(b, shape[d] if s == -1 else b + s) for d, (b, s) in enumerate(zip(begin, size)))
    function = lambda y: y[index]  # noqa: E731
    _check_static_shape(op, function, shape)
    return FullForm(function, shape, op.outputs[0].shape, f"SLICE{index[1:]}")


_REDUCERS = {
    "MEAN": lambda y, dims, keep: y.mean(dim=dims, keepdim=keep),
    "SUM": lambda y, dims, keep: y.sum(dim=dims, keepdim=keep),
    "REDUCE_MAX": lambda y, dims, keep: y.amax(dim=dims, keepdim=keep),
    "REDUCE_MIN": lambda y, dims, keep: y.amin(dim=dims, keepdim=keep),
}


def build_reduce(op: OpSpec) -> torch.nn.Module:
    shape = op.inputs[0].shape
    axes = sorted({int(a) % len(shape) for a in op.constant(1).reshape(-1)})
    keep = bool(op.options.KeepDims()) if op.options is not None else False
    dims = tuple(a + 1 for a in axes)
    reducer = _REDUCERS[op.type]
    function = lambda y: reducer(y, dims, keep)  # noqa: E731
    _check_static_shape(op, function, shape)
    return FullForm(function, shape, op.outputs[0].shape, f"{op.type}{axes}, keep_dims={keep}")


def build_softmax(op: OpSpec) -> torch.nn.Module:
    beta = op.options.Beta() if op.options is not None else 1.0
    function = lambda y: torch.softmax(y * beta if beta != 1.0 else y, dim=-1)  # noqa: E731
    return FullForm(function, op.inputs[0].shape, op.outputs[0].shape, f"SOFTMAX(beta={beta})")


def build_gather(op: OpSpec) -> torch.nn.Module:
    shape = op.inputs[0].shape
    indices = op.constant(1).astype(np.int64)
    if op.options is not None and op.options.BatchDims():
        raise op.unsupported("batch_dims is not implemented")
    axis = (op.options.Axis() if op.options is not None else 0) % len(shape)
    out_shape = op.outputs[0].shape
    return Gather(shape, out_shape, axis, indices)


class Gather(torch.nn.Module):
    def __init__(self, in_shape, out_shape, axis: int, indices: np.ndarray):
        super().__init__()
        self.in_shape, self.out_shape, self.axis = tuple(in_shape), tuple(out_shape), axis
        self.register_buffer("indices", torch.from_numpy(indices.reshape(-1) % in_shape[axis]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = to_full(x, self.in_shape).index_select(self.axis + 1, self.indices)
        return from_full(y.reshape(y.shape[0], *self.out_shape), self.out_shape)


class Concatenate(torch.nn.Module):
    """CONCATENATION and PACK on full forms; constant operands are expanded to the batch."""

    def __init__(self, operand_shapes, constants, out_shape, axis: int, stack: bool,
                 activation: int):
        super().__init__()
        self.operand_shapes, self.out_shape = operand_shapes, tuple(out_shape)
        self.axis, self.stack, self.activation = axis, stack, activation
        for position, constant in enumerate(constants):
            if constant is not None:
                self.register_buffer(f"constant{position}", constant)

    def forward(self, *activations: torch.Tensor) -> torch.Tensor:
        batch = activations[0].shape[0]
        remaining = iter(activations)
        parts = []
        for position, shape in enumerate(self.operand_shapes):
            if shape is None:
                part = getattr(self, f"constant{position}")
                part = part.expand(batch, *part.shape[1:])
            else:
                part = to_full(next(remaining), shape)
            parts.append(part.unsqueeze(self.axis + 1) if self.stack else part)
        y = torch.cat(parts, dim=self.axis + 1)
        return _apply_activation(from_full(y, self.out_shape), self.activation)


def build_concatenation(op: OpSpec) -> torch.nn.Module:
    stack = op.type == "PACK"
    in_rank = len(op.inputs[0].shape)
    axis = op.options.Axis() % (in_rank + 1 if stack else in_rank)
    shapes, constants = [], []
    for t in op.inputs:
        if t.data is None:
            shapes.append(tuple(t.shape))
            constants.append(None)
        else:
            shapes.append(None)
            constants.append(_float_buffer(t.data.reshape((1, *t.shape))))
    if all(s is None for s in shapes):
        raise op.unsupported("all operands are constants")
    activation = _activation_code(op) if op.type == "CONCATENATION" else _NO_ACTIVATION
    return Concatenate(shapes, constants, op.outputs[0].shape, axis, stack, activation)


class Split(torch.nn.Module):
    def __init__(self, in_shape, out_shapes, axis: int):
        super().__init__()
        self.in_shape, self.out_shapes, self.axis = tuple(in_shape), out_shapes, axis
        self.sizes = [s[axis] for s in out_shapes]

    def forward(self, x: torch.Tensor):
        parts = torch.split(to_full(x, self.in_shape), self.sizes, dim=self.axis + 1)
        return tuple(from_full(p, s) for p, s in zip(parts, self.out_shapes))


def build_split(op: OpSpec) -> torch.nn.Module:
    if op.type == "SPLIT":
        axis_value, data = op.constant(0), op.inputs[1]
    else:  # SPLIT_V: value, size_splits, axis
        axis_value, data = op.constant(2), op.inputs[0]
    axis = int(axis_value.reshape(-1)[0]) % len(data.shape)
    return Split(data.shape, [tuple(t.shape) for t in op.outputs], axis)


class FullyConnected(torch.nn.Module):
    """FULLY_CONNECTED: TFLite flattens each sample to rows of ``in_features`` values."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, in_shape, out_shape,
                 activation: int):
        super().__init__()
        self.register_buffer("weight", _float_buffer(weight))
        self.register_buffer("bias", _float_buffer(bias) if bias is not None else None)
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.out_per_sample = per_sample_shape(self.out_shape)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = to_full(x, self.in_shape).reshape(x.shape[0], -1, self.weight.shape[1])
        y = _apply_activation(F.linear(rows, self.weight, self.bias), self.activation)
        return tfl_order_to_torch(y.reshape(x.shape[0], *self.out_per_sample), self.out_shape)


def build_fully_connected(op: OpSpec) -> torch.nn.Module:
    x = op.inputs[0]
    if op.inputs[1].data is None:
        raise op.unsupported("weights computed at run time are not implemented")
    weight = op.constant(1)
    bias = op.constant(2) if len(op.inputs) > 2 and op.inputs[2] is not None else None
    if op.options is not None and op.options.WeightsFormat() != 0:
        raise op.unsupported("shuffled weights formats are not implemented")
    return FullyConnected(weight, bias, x.shape, op.outputs[0].shape, _activation_code(op))


class BatchMatMul(torch.nn.Module):
    def __init__(self, operand_shapes, constants, out_shape, adjoint):
        super().__init__()
        self.operand_shapes, self.out_shape, self.adjoint = operand_shapes, tuple(out_shape), adjoint
        for position, constant in enumerate(constants):
            if constant is not None:
                self.register_buffer(f"constant{position}", constant)

    def forward(self, *activations: torch.Tensor) -> torch.Tensor:
        rank = len(self.out_shape)
        remaining = iter(activations)
        operands = []
        for position, shape in enumerate(self.operand_shapes):
            value = (getattr(self, f"constant{position}") if shape is None
                     else _full_rank(next(remaining), shape, rank))
            operands.append(value.transpose(-1, -2) if self.adjoint[position] else value)
        return from_full(torch.matmul(operands[0], operands[1]), self.out_shape)


def build_batch_matmul(op: OpSpec) -> torch.nn.Module:
    out_shape = op.outputs[0].shape
    shapes, constants = [], []
    for t in op.inputs[:2]:
        if t.data is None:
            shapes.append(tuple(t.shape))
            constants.append(None)
        else:
            shapes.append(None)
            constants.append(_full_constant(t.data.reshape(t.shape), len(out_shape)))
    o = op.options
    adjoint = (bool(o.AdjX()), bool(o.AdjY())) if o is not None else (False, False)
    return BatchMatMul(shapes, constants, out_shape, adjoint)


class Pad(torch.nn.Module):
    def __init__(self, in_shape, out_shape, torch_pads, full: bool, value: float):
        super().__init__()
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.torch_pads, self.full, self.value = tuple(torch_pads), full, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.full:
            return from_full(F.pad(to_full(x, self.in_shape), self.torch_pads, value=self.value),
                             self.out_shape)
        return F.pad(x, self.torch_pads, value=self.value)


def build_pad(op: OpSpec) -> torch.nn.Module:
    shape = op.inputs[0].shape
    paddings = op.constant(1).reshape(len(shape), 2).tolist()
    value = float(op.constant(2).reshape(-1)[0]) if len(op.inputs) > 2 and op.inputs[2] else 0.0
    if is_batched(shape) and paddings[0] == [0, 0]:
        # Pad the held form directly; its dimensions after N are, in order, these tflite dims.
        held_dims = [3, 1, 2] if is_image(shape) else list(range(1, len(shape)))
        torch_pads = [p for dim in reversed(held_dims) for p in paddings[dim]]
        return Pad(shape, op.outputs[0].shape, torch_pads, full=False, value=value)
    torch_pads = [p for dim in reversed(range(len(shape))) for p in paddings[dim]]
    return Pad(shape, op.outputs[0].shape, torch_pads, full=True, value=value)


# ---------------------------------------------------------------------------------------------
# Resampling


class ResizeBilinear(torch.nn.Module):
    """RESIZE_BILINEAR in its three TFLite coordinate conventions.

    ``half_pixel_centers`` and ``align_corners`` are torch's ``align_corners=False`` and ``True``;
    the legacy convention (neither flag: source = destination * in/out, no half-pixel offset) has
    no torch equivalent and is computed by gathering rows and columns.
    """

    def __init__(self, out_hw, align_corners: bool, half_pixel: bool, in_hw):
        super().__init__()
        self.out_hw = tuple(out_hw)
        self.align_corners = align_corners
        self.legacy = not align_corners and not half_pixel
        if self.legacy:
            for axis, (size_in, size_out) in zip("yx", zip(in_hw, out_hw)):
                source = np.arange(size_out, dtype=np.float32) * np.float32(size_in / size_out)
                low = np.minimum(np.floor(source), size_in - 1).astype(np.int64)
                high = np.minimum(low + 1, size_in - 1)
                self.register_buffer(f"{axis}_low", torch.from_numpy(low))
                self.register_buffer(f"{axis}_high", torch.from_numpy(high))
                self.register_buffer(f"{axis}_frac", torch.from_numpy(source - low))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.legacy:
            return F.interpolate(x, size=self.out_hw, mode="bilinear",
                                 align_corners=self.align_corners)
        frac_y = self.y_frac.to(x.dtype)[:, None]
        x = x[:, :, self.y_low] * (1 - frac_y) + x[:, :, self.y_high] * frac_y
        frac_x = self.x_frac.to(x.dtype)
        return x[:, :, :, self.x_low] * (1 - frac_x) + x[:, :, :, self.x_high] * frac_x


class Upsample2x(torch.nn.Module):
    """RESIZE_BILINEAR to twice the input's height and width, for an input of any size
    (:func:`~facecast.models.tflite_convert.allow_any_input_size`): torch's interpolation to the
    doubled size, the values :class:`ResizeBilinear` gives at its one built size. Half-pixel and
    align-corners conventions only: the legacy one has no torch equivalent (ResizeBilinear
    gathers by a table made for its size)."""

    def __init__(self, align_corners: bool):
        super().__init__()
        self.align_corners = align_corners

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[2:]
        return F.interpolate(x, size=(2 * height, 2 * width), mode="bilinear", align_corners=self.align_corners)


class FlattenImage(torch.nn.Module):
    """RESHAPE of an image (N, H, W, C) into (N, H * W, C), row-major, for an input of any size
    (:func:`~facecast.models.tflite_convert.allow_any_input_size`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, channels = x.shape[:2]
        return x.permute(0, 2, 3, 1).reshape(n, -1, channels)


def build_resize_bilinear(op: OpSpec) -> torch.nn.Module:
    x = op.inputs[0]
    _require_image(op, x)
    o = op.options
    return ResizeBilinear(op.outputs[0].shape[1:3], bool(o.AlignCorners()),
                          bool(o.HalfPixelCenters()), x.shape[1:3])


class ResizeNearest(torch.nn.Module):
    def __init__(self, out_hw, half_pixel: bool):
        super().__init__()
        self.out_hw = tuple(out_hw)
        self.mode = "nearest-exact" if half_pixel else "nearest"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, size=self.out_hw, mode=self.mode)


def build_resize_nearest(op: OpSpec) -> torch.nn.Module:
    _require_image(op, op.inputs[0])
    if op.options.AlignCorners():
        raise op.unsupported("align_corners=True is not implemented")
    return ResizeNearest(op.outputs[0].shape[1:3], bool(op.options.HalfPixelCenters()))


class DepthToSpace(torch.nn.Module):
    """TF's DepthToSpace (DCR order): out[h*b+i, w*b+j, c] = in[h, w, (i*b+j)*C + c].

    torch's pixel_shuffle uses the other channel order (c*b*b + i*b + j), hence the explicit
    view and permute.
    """

    def __init__(self, block: int):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, channels, height, width = x.shape
        b = self.block
        y = x.reshape(n, b, b, channels // (b * b), height, width)
        return y.permute(0, 3, 4, 1, 5, 2).reshape(n, channels // (b * b), height * b, width * b)


class SpaceToDepth(torch.nn.Module):
    """The inverse of :class:`DepthToSpace`."""

    def __init__(self, block: int):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, channels, height, width = x.shape
        b = self.block
        y = x.reshape(n, channels, height // b, b, width // b, b)
        return y.permute(0, 3, 5, 1, 2, 4).reshape(n, b * b * channels, height // b, width // b)


def build_depth_to_space(op: OpSpec) -> torch.nn.Module:
    _require_image(op, op.inputs[0])
    return DepthToSpace(op.options.BlockSize())


def build_space_to_depth(op: OpSpec) -> torch.nn.Module:
    _require_image(op, op.inputs[0])
    return SpaceToDepth(op.options.BlockSize())


def build_dequantize(op: OpSpec) -> torch.nn.Module:
    # Constant DEQUANTIZE is folded by the converter; a run-time one would turn a float16
    # activation into float32, which contradicts running the whole module in one dtype.
    raise op.unsupported("DEQUANTIZE of a run-time tensor is not implemented")


BUILDERS: dict[str, Callable[[OpSpec], torch.nn.Module]] = {
    "CONV_2D": build_conv_2d,
    "DEPTHWISE_CONV_2D": build_depthwise_conv_2d,
    "MAX_POOL_2D": build_pool,
    "AVERAGE_POOL_2D": build_pool,
    **{name: build_binary for name in _BINARY_FUNCTIONS},
    **{name: build_unary for name in (*_UNARY_FUNCTIONS, "GELU", "LEAKY_RELU")},
    "RESHAPE": build_reshape,
    "SQUEEZE": build_reshape,
    "EXPAND_DIMS": build_reshape,
    "TRANSPOSE": build_transpose,
    "STRIDED_SLICE": build_strided_slice,
    "SLICE": build_slice,
    **{name: build_reduce for name in _REDUCERS},
    "SOFTMAX": build_softmax,
    "GATHER": build_gather,
    "CONCATENATION": build_concatenation,
    "PACK": build_concatenation,
    "SPLIT": build_split,
    "SPLIT_V": build_split,
    "FULLY_CONNECTED": build_fully_connected,
    "BATCH_MATMUL": build_batch_matmul,
    "PAD": build_pad,
    "PADV2": build_pad,
    "RESIZE_BILINEAR": build_resize_bilinear,
    "RESIZE_NEAREST_NEIGHBOR": build_resize_nearest,
    "DEPTH_TO_SPACE": build_depth_to_space,
    "SPACE_TO_DEPTH": build_space_to_depth,
    "DEQUANTIZE": build_dequantize,
}
