"""MediaPipe's custom TFLite operators of the attention face mesh, batched, in torch.

``face_landmark_with_attention.tflite`` refines the lips, eyes and irises by cropping its own
feature map around each region: ``Landmarks2TransformMatrix`` turns the coarse mesh into one
crop transform per region, ``TransformTensorBilinear`` samples the feature map through it, and
``TransformLandmarks`` maps the region's refined points back. The semantics here follow
MediaPipe's CPU kernels (``mediapipe/util/tflite/operations/*.cc``, version 2 of each operator,
the version that model uses); they are written for a batch of N crops instead of one.

Shapes follow Note [Batch and layout] in :mod:`facecast.models.tflite_ops`: the [1, 468, 3]
landmarks arrive as [N, 468, 3], the [1, 4, 4] matrices as [N, 4, 4], feature maps as NCHW.
The geometry is computed in float32 whatever the module's dtype, because the crop transform
amplifies rounding errors of the landmarks (it divides by their spread). In a CUDA graph's work
each operator is one Triton kernel (Note [The attention mesh's custom operators in kernels],
models/triton_kernels.py); elsewhere, and where a kernel cannot serve, the PyTorch below.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import triton_kernels
from .tflite_ops import OpSpec, is_image


def _require_version(op: OpSpec, version: int) -> None:
    if op.version != version:
        raise op.unsupported(f"version {op.version} of the custom operator is not implemented "
                             f"(only version {version}, the one MediaPipe's attention mesh uses)")


class Landmarks2TransformMatrix(torch.nn.Module):
    """Landmarks → the 4×4 matrix that maps a crop's pixel (x, y, 0, 1) to landmark coordinates.

    The crop is the bounding box of the subset landmarks in a frame rotated so that the line from
    the left to the right rotation landmark is at ``target_rotation_radians``, scaled by
    (scale_x, scale_y) and sampled on an output_width × output_height grid centred on the box:
    ``T = shift(centre) · rotate(-rotation) · scale(sx·w/ow, sy·h/oh) · shift(-ow/2, -oh/2)``.
    """

    def __init__(self, options: dict):
        super().__init__()
        self.left_index = int(options["left_rotation_idx"])
        self.right_index = int(options["right_rotation_idx"])
        self.target_rotation_radians = float(options.get("target_rotation_radians", 0.0))
        self.output_width = int(options["output_width"])
        self.output_height = int(options["output_height"])
        self.scale_x = float(options["scale_x"])
        self.scale_y = float(options["scale_y"])
        # subset_idxs is a flat list of index pairs; the box uses every index of every pair.
        self.register_buffer("subset", torch.tensor([int(i) for i in options["subset_idxs"]]),
                             persistent=False)

    def forward(self, landmarks: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # in a graph's work: one kernel (its Note)
            matrix = triton_kernels.landmarks_to_matrix(
                landmarks, self.subset, self.left_index, self.right_index, self.target_rotation_radians,
                (self.output_width, self.output_height), (self.scale_x, self.scale_y))
            if matrix is not None:
                return matrix.to(landmarks.dtype)
        xy = landmarks[..., :2].float()
        delta = xy[:, self.right_index] - xy[:, self.left_index]
        rotation = self.target_rotation_radians - torch.atan2(delta[:, 1], delta[:, 0])  # [N]
        cos, sin = torch.cos(rotation)[:, None], torch.sin(rotation)[:, None]
        points = xy[:, self.subset]  # [N, K, 2]
        rotated_x = cos * points[..., 0] - sin * points[..., 1]
        rotated_y = sin * points[..., 0] + cos * points[..., 1]
        max_x, min_x = rotated_x.amax(dim=1), rotated_x.amin(dim=1)
        max_y, min_y = rotated_y.amax(dim=1), rotated_y.amin(dim=1)
        crop_width, crop_height = max_x - min_x, max_y - min_y
        middle_x, middle_y = (max_x + min_x) / 2, (max_y + min_y) / 2
        cos, sin = cos[:, 0], sin[:, 0]
        # Back to landmark coordinates: rotate the rotated-frame centre by -rotation.
        centre_x = cos * middle_x + sin * middle_y
        centre_y = -sin * middle_x + cos * middle_y
        scale_x = self.scale_x * crop_width / self.output_width
        scale_y = self.scale_y * crop_height / self.output_height
        # rotate(-rotation) · scale, then the translation that puts the crop centre at `centre`.
        m00, m01 = cos * scale_x, sin * scale_y
        m10, m11 = -sin * scale_x, cos * scale_y
        half_w, half_h = self.output_width / 2.0, self.output_height / 2.0
        m03 = centre_x - (m00 * half_w + m01 * half_h)
        m13 = centre_y - (m10 * half_w + m11 * half_h)
        zeros, ones = torch.zeros_like(m00), torch.ones_like(m00)
        matrix = torch.stack([
            m00, m01, zeros, m03,
            m10, m11, zeros, m13,
            zeros, zeros, ones, zeros,
            zeros, zeros, zeros, ones,
        ], dim=1).reshape(-1, 4, 4)
        return matrix.to(landmarks.dtype)


class TransformTensorBilinear(torch.nn.Module):
    """Sample an NCHW feature map through a crop matrix (bilinear, zero outside the map).

    Version 2 treats pixels as centres: output pixel (x, y) samples the matrix image of
    (x + 0.5, y + 0.5) minus 0.5. A sample whose source point lies outside [0, W-1] × [0, H-1]
    is 0 in every channel (not clamped, not partially blended).
    """

    def __init__(self, output_height: int, output_width: int):
        super().__init__()
        self.output_height, self.output_width = output_height, output_width
        ys, xs = torch.meshgrid(torch.arange(output_height, dtype=torch.float32) + 0.5,
                                torch.arange(output_width, dtype=torch.float32) + 0.5,
                                indexing="ij")
        self.register_buffer("pixel_centres", torch.stack([xs, ys, torch.ones_like(xs)], dim=-1),
                             persistent=False)  # [oh, ow, 3]

    def forward(self, features: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # in a graph's work: one kernel (its Note)
            sampled = triton_kernels.transform_bilinear(features, matrix, (self.output_height, self.output_width))
            if sampled is not None:
                return sampled
        height, width = features.shape[-2:]
        # [N, 2, 3]: columns x, y and translation (the z column multiplies 0). Slices, not a list
        # index: indexing with a Python list copies it to the device on every call, which a
        # CUDA graph cannot capture.
        affine = torch.cat([matrix[:, :2, :2], matrix[:, :2, 3:]], dim=-1).float()
        # Pixel centres (k + 0.5) are exact in float16 too, so .half() does not move the grid.
        source = torch.einsum("hwk,nrk->nhwr", self.pixel_centres.float(), affine) - 0.5
        x, y = source[..., 0], source[..., 1]
        inside = (x >= 0) & (x <= width - 1) & (y >= 0) & (y <= height - 1)
        grid = torch.stack([x * (2.0 / (width - 1)) - 1.0, y * (2.0 / (height - 1)) - 1.0], dim=-1)
        if torch.compiler.is_compiling():
            # F.grid_sample may pick cuDNN's sampler (the same bilinear, zero-padded sums),
            # which has no kernel for the tracer's fake tensors (Note [Compiled models]).
            sampled = torch.grid_sampler_2d(features, grid.to(features.dtype), 0, 0, True)
        else:
            sampled = F.grid_sample(features, grid.to(features.dtype), mode="bilinear",
                                    padding_mode="zeros", align_corners=True)
        return sampled * inside[:, None].to(features.dtype)


class TransformLandmarks(torch.nn.Module):
    """Map [N, L, D] landmarks (D = 2 or 3) through a crop matrix; z, when present, is kept."""

    def forward(self, landmarks: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # in a graph's work: one kernel (its Note)
            mapped = triton_kernels.transform_landmarks(landmarks, matrix)
            if mapped is not None:
                return mapped
        matrix = matrix.to(landmarks.dtype)
        xy = landmarks[..., :2]
        mapped = torch.einsum("nlk,nrk->nlr", xy, matrix[:, :2, :2]) + matrix[:, None, :2, 3]
        return torch.cat([mapped, landmarks[..., 2:]], dim=-1)


def build_landmarks_to_transform_matrix(op: OpSpec) -> torch.nn.Module:
    _require_version(op, 2)
    if len(op.inputs[0].shape) != 3 or op.inputs[0].shape[-1] < 2:
        raise op.unsupported(f"landmarks must be [1, L, D], got {op.inputs[0].shape}")
    return Landmarks2TransformMatrix(op.options)


def build_transform_tensor_bilinear(op: OpSpec) -> torch.nn.Module:
    _require_version(op, 2)
    if not is_image(op.inputs[0].shape):
        raise op.unsupported(f"features must be [1, H, W, C], got {op.inputs[0].shape}")
    _, height, width, _ = op.outputs[0].shape
    return TransformTensorBilinear(height, width)


def build_transform_landmarks(op: OpSpec) -> torch.nn.Module:
    _require_version(op, 2)
    shape = op.inputs[0].shape
    if len(shape) != 3 or shape[-1] not in (2, 3):
        raise op.unsupported(f"landmarks must be [1, L, 2 or 3], got {shape}")
    return TransformLandmarks()


BUILDERS: dict[str, Callable[[OpSpec], torch.nn.Module]] = {
    "Landmarks2TransformMatrix": build_landmarks_to_transform_matrix,
    "TransformTensorBilinear": build_transform_tensor_bilinear,
    "TransformLandmarks": build_transform_landmarks,
}
