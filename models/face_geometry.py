"""MediaPipe's facial transformation matrix: head rotation and translation (centimeters) from the
478 landmarks, as MediaPipe's face_geometry calculators compute it (DESIGN §3).

Inputs: the bundle's ``geometry_pipeline_metadata_landmarks.binarypb`` (MediaPipe's canonical
face model, 468 vertices in centimeters, and the weights of the landmarks that the fit uses) and
each face's landmarks in frame pixels with the frame's size. Output: per face the 4x4 matrix that
maps the canonical face model into camera space (centimeters; OpenGL axes: x right, y up, z toward
the viewer, so a face in front of the camera has a negative z translation), which MediaPipe's
``FaceLandmarker`` returns as ``facial_transformation_matrixes``.

Note [Face geometry as MediaPipe computes it]
    MediaPipe's geometry pipeline (face_geometry/libs/geometry_pipeline.cc, Apache-2.0; read, not
    copied) assumes a perspective camera with a 63° vertical field of view, near plane 1, and the
    image origin at the top-left corner. Per face:

    1. Normalised landmarks (x/width, y/height, z/width) of the 468 mesh points are put on the
       near plane: y flipped, x and y scaled to the near plane's extent, z scaled like x.
    2. Their depth is relative (MediaPipe's z is centred on the face), so the scale is found in
       two passes: a weighted Procrustes fit of the canonical model to the points as they are
       (z negated: right-handed) gives a first scale; the points are then moved to depth
       ``(z - mean z + near) / scale``, unprojected (x, y multiplied by depth / near) and fitted
       again; the product of the two scales places the face at its metric distance.
    3. The points, unprojected with that total scale, are fitted once more: the transform of
       that fit (scale · rotation, translation) is the facial transformation matrix.

    The fit is the closed-form weighted orthogonal Procrustes problem with scale (Umeyama):
    rotation from the SVD of the weighted cross-covariance with the reflection removed, scale
    from the rotated source's projection on the target, translation from the weighted centres.
    MediaPipe's solver writes it with square-root weights; it is the same optimum.

    It runs batched in torch, float64, on the landmarks' device, before the batch's one transfer
    to the host (issue 24: per face on the host it cost ~4.4 ms a batch of 64 on the H100's host,
    more than the models' own work): float64 because the second pass divides by a scale found
    on the first and the depths are differences of nearly equal numbers; a batch is a few
    hundred flops per face, nothing for a GPU's float64 units. The only solver is
    ``torch.linalg.svd`` of (N, 3, 3) matrices; determinants are written out (a cross product)
    rather than asked of a solver. On CUDA ``torch.linalg.svd`` reads its convergence flags back
    to the host (ATen's ``_linalg_check_errors``), a wait for the device that a CUDA graph cannot
    capture: so this stage runs eagerly after the mesh's graph, not inside it. (A solver without
    that read, e.g. a fixed number of Jacobi sweeps, is what would put it inside.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

NUM_CANONICAL_VERTICES = 468
VERTICAL_FOV_DEG = 63.0  # MediaPipe FaceLandmarker's environment (face_landmarker_graph.cc)
NEAR_PLANE = 1.0


# ---------------------------------------------------------------------------------------------
# Reading geometry_pipeline_metadata_landmarks.binarypb
#
# Its schema (MediaPipe's face_geometry/proto/geometry_pipeline_metadata.proto and mesh_3d.proto)
# ships only inside the mediapipe package, which is not a facecast dependency, and no maintained
# package publishes it: so this is a minimal reader of protobuf's wire format for exactly these
# fields (tests/models/test_face_geometry.py checks it against the protobuf package's own parser
# given the same schema):
#
#   GeometryPipelineMetadata: 1 canonical_mesh (Mesh3d), 2 procrustes_landmark_basis (repeated
#       WeightedLandmarkRef), 3 input_source (enum)
#   Mesh3d: 1 vertex_type (enum, 0 = VERTEX_PT: x, y, z, u, v per vertex), 2 primitive_type,
#       3 vertex_buffer (repeated float), 4 index_buffer (repeated uint32)
#   WeightedLandmarkRef: 1 landmark_id (uint32), 2 weight (float)
# ---------------------------------------------------------------------------------------------

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class GeometryMetadataError(ValueError):
    """The binarypb is not MediaPipe's face geometry pipeline metadata."""


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(data):
            raise GeometryMetadataError("truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of each field: value is an int or the raw bytes."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, position = _varint(data, position)
        elif wire == _FIXED32:
            value, position = data[position:position + 4], position + 4
        elif wire == _FIXED64:
            value, position = data[position:position + 8], position + 8
        elif wire == _LENGTH:
            length, position = _varint(data, position)
            value, position = data[position:position + length], position + length
        else:
            raise GeometryMetadataError(f"unsupported wire type {wire} (field {number})")
        if position > len(data):
            raise GeometryMetadataError(f"truncated field {number}")
        yield number, wire, value


def _floats(wire: int, value) -> list[float]:
    # Repeated floats arrive packed (one LENGTH field) or one FIXED32 field each.
    if wire not in (_LENGTH, _FIXED32):
        return []
    if len(value) % 4:
        raise GeometryMetadataError(f"a float buffer of {len(value)} bytes (not a multiple of 4)")
    return list(np.frombuffer(value, "<f4"))


@dataclass(frozen=True)
class GeometryMetadata:
    canonical_vertices_cm: np.ndarray  # (468, 3) float64: MediaPipe's canonical face model
    landmark_weights: np.ndarray  # (468,) float64: the Procrustes weight of each landmark

    @classmethod
    def read(cls, path: str | Path) -> "GeometryMetadata":
        return cls.parse(Path(path).read_bytes())

    @classmethod
    def parse(cls, data: bytes) -> "GeometryMetadata":
        vertex_buffer: list[float] = []
        vertex_type = 0
        basis: list[tuple[int, float]] = []
        for number, wire, value in _fields(data):
            if number == 1 and wire == _LENGTH:  # canonical_mesh
                for mesh_number, mesh_wire, mesh_value in _fields(value):
                    if mesh_number == 1 and mesh_wire == _VARINT:
                        vertex_type = mesh_value
                    elif mesh_number == 3:
                        vertex_buffer += _floats(mesh_wire, mesh_value)
            elif number == 2 and wire == _LENGTH:  # procrustes_landmark_basis
                landmark_id, weight = None, 0.0
                for ref_number, ref_wire, ref_value in _fields(value):
                    if ref_number == 1 and ref_wire == _VARINT:
                        landmark_id = ref_value
                    elif ref_number == 2 and ref_wire == _FIXED32:
                        weight = float(np.frombuffer(ref_value, "<f4")[0])
                if landmark_id is None:
                    raise GeometryMetadataError("a procrustes_landmark_basis entry has no landmark_id")
                basis.append((landmark_id, weight))
        if vertex_type != 0:
            raise GeometryMetadataError(f"canonical mesh vertex type {vertex_type}, expected 0 (VERTEX_PT)")
        if len(vertex_buffer) != NUM_CANONICAL_VERTICES * 5:
            raise GeometryMetadataError(
                f"canonical mesh has {len(vertex_buffer)} vertex values, expected "
                f"{NUM_CANONICAL_VERTICES} vertices x 5 (x, y, z, u, v)")
        if not basis:
            raise GeometryMetadataError("no procrustes_landmark_basis: nothing to fit")
        vertices = np.asarray(vertex_buffer, np.float64).reshape(NUM_CANONICAL_VERTICES, 5)[:, :3]
        weights = np.zeros(NUM_CANONICAL_VERTICES)
        for landmark_id, weight in basis:
            if not 0 <= landmark_id < NUM_CANONICAL_VERTICES:
                raise GeometryMetadataError(f"procrustes landmark id {landmark_id} out of range")
            weights[landmark_id] = weight
        return cls(vertices, weights)


# ---------------------------------------------------------------------------------------------
# The pipeline (Note [Face geometry as MediaPipe computes it])
# ---------------------------------------------------------------------------------------------


def determinant_3x3(matrices: torch.Tensor) -> torch.Tensor:
    """Determinants of (..., 3, 3) matrices, written out: (row 0 × row 1) · row 2. (No solver:
    nothing to launch per matrix, nothing that waits for the device.)"""
    return (torch.linalg.cross(matrices[..., 0, :], matrices[..., 1, :]) * matrices[..., 2, :]).sum(-1)


def weighted_procrustes(source: torch.Tensor, target: torch.Tensor, weights: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale s (N,), rotation R (N, 3, 3), translation t (N, 3) minimising
    Σ w_i |s R source_i + t - target_i|² for each of N targets, batched (Umeyama's closed form:
    Note [Face geometry as MediaPipe computes it]).

    source (K, 3); target (N, K, 3); weights (K,) ≥ 0, not all zero; one dtype and device.
    """
    w = weights / weights.sum()
    source_centre = w @ source  # (3,)
    target_centre = torch.einsum("k,nkc->nc", w, target)  # (N, 3)
    centred_source = source - source_centre
    # Σ_k w_k (target_k - target centre) ⊗ (source_k - source centre), one batched matmul.
    covariance = (target - target_centre[:, None]).transpose(1, 2) @ (w[:, None] * centred_source)
    u, singular, vt = torch.linalg.svd(covariance)
    # A reflection (det U · det Vᵀ < 0) is undone on the weakest axis: the best proper rotation.
    reflected = determinant_3x3(u) * determinant_3x3(vt) < 0
    last = torch.where(reflected, -1.0, 1.0).to(singular.dtype)
    correction = torch.cat([torch.ones_like(singular[:, :2]), last[:, None]], dim=1)
    rotation = (u * correction[:, None, :]) @ vt
    scale = (singular * correction).sum(-1) / (w @ (centred_source ** 2).sum(-1))
    translation = target_centre - scale[:, None] * (rotation @ source_centre)
    return scale, rotation, translation


class FaceGeometry:
    """Facial transformation matrices of batches of faces (one metadata, any frame sizes)."""

    def __init__(self, metadata: GeometryMetadata, vertical_fov_deg: float = VERTICAL_FOV_DEG,
                 near: float = NEAR_PLANE):
        self.metadata = metadata
        self.near = near
        self.near_height = 2.0 * near * math.tan(math.radians(vertical_fov_deg) / 2.0)
        self._used = np.flatnonzero(metadata.landmark_weights > 0)
        self._model_by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def read(cls, path: str | Path) -> "FaceGeometry":
        return cls(GeometryMetadata.read(path))

    def _model_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(landmark indices the fit uses, their canonical vertices, their weights) on the device,
        made once per device: a table copied per call is a host-to-device copy each time. (Normal
        tensors even when first asked for under inference mode, so that they may be used
        anywhere.)"""
        if device not in self._model_by_device:
            with torch.inference_mode(False):
                self._model_by_device[device] = (
                    torch.as_tensor(self._used, device=device),
                    torch.as_tensor(self.metadata.canonical_vertices_cm[self._used], device=device),
                    torch.as_tensor(self.metadata.landmark_weights[self._used], device=device))
        return self._model_by_device[device]

    def matrices(self, landmarks_px: torch.Tensor, frame_wh_px: torch.Tensor) -> torch.Tensor:
        """(N, 4, 4) float64 facial transformation matrices, on the landmarks' device.

        landmarks_px: (N, ≥468, 3) x, y in frame pixels, z in pixels on x's scale (facecast's
        landmarks); frame_wh_px: (N, 2) width, height of each face's frame.
        """
        count = landmarks_px.shape[0]
        device = landmarks_px.device
        used, source, weights = self._model_on(device)
        size = frame_wh_px.to(device=device, dtype=torch.float64).reshape(count, 1, 2)
        width, height = size[..., 0], size[..., 1]
        near_width = self.near_height * width / height  # (N, 1)
        mesh = landmarks_px[:, :NUM_CANONICAL_VERTICES]
        # Normalise (x/W, y/H, z/W), flip y (top-left origin), scale onto the near plane; only
        # the points the fit weighs are needed, and the mean depth of all 468.
        points = mesh[:, used].double()
        screen_x = points[..., 0] / width * near_width - near_width / 2
        screen_y = (1.0 - points[..., 1] / height) * self.near_height - self.near_height / 2
        screen_z = points[..., 2] / width * near_width
        depth_offset = (mesh[..., 2].double() / width * near_width).mean(dim=1, keepdim=True)

        def fit(target):
            return weighted_procrustes(source, target, weights)

        def unproject(scale):
            depth = (screen_z - depth_offset + self.near) / scale[:, None]
            return torch.stack([screen_x * depth / self.near, screen_y * depth / self.near, -depth], dim=-1)

        first_scale = fit(torch.stack([screen_x, screen_y, -screen_z], dim=-1))[0]
        second_scale = fit(unproject(first_scale))[0]
        scale, rotation, translation = fit(unproject(first_scale * second_scale))
        top = torch.cat([scale[:, None, None] * rotation, translation[:, :, None]], dim=2)  # (N, 3, 4)
        bottom = torch.zeros_like(top[:, :1])
        bottom[..., 3] = 1.0
        return torch.cat([top, bottom], dim=1)


def rotation_and_translation(matrices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, 3, 3) rotations (the matrices' scale removed) and (N, 3) translations in cm."""
    linear = matrices[:, :3, :3]
    scale = np.cbrt(np.linalg.det(linear))
    return linear / scale[:, None, None], matrices[:, :3, 3].copy()


# OpenGL camera axes (x right, y up, z toward the viewer; the matrix's) to facecast's head-pose
# camera axes (x right, y down, z away from the viewer; models/head_pose.py), and the canonical
# model's axes (x toward the subject's left, y up, z out of the face) to head_pose's face axes
# (x toward the subject's left, y down the face, z into the face): both flip y and z.
_FLIP_YZ = np.diag([1.0, -1.0, -1.0])


def head_pose_from_matrices(matrices: torch.Tensor) -> torch.Tensor:
    """(N, 3) yaw, pitch, roll in degrees (float64) of facial transformation matrices
    (N, 4, 4), in models/head_pose.py's convention (``R = Rz(roll)·Ry(yaw)·Rx(pitch)``, same
    signs); batched on the matrices' device."""
    from facecast.models.head_pose import euler_from_rotation

    linear = matrices[:, :3, :3].double()
    determinant = determinant_3x3(linear)
    scale = determinant.sign() * determinant.abs().pow(1.0 / 3.0)  # the real cube root
    rotations = linear / scale[:, None, None]
    return euler_from_rotation(rotations * _flip_yz_signs(rotations.device))


@functools.lru_cache(maxsize=8)
def _flip_yz_signs(device: torch.device) -> torch.Tensor:
    """(3, 3) float64 signs s with _FLIP_YZ @ R @ _FLIP_YZ = R * s (elementwise), on the device,
    made once (as FaceGeometry._model_on's tables)."""
    flip = np.diag(_FLIP_YZ)
    with torch.inference_mode(False):
        return torch.as_tensor(np.outer(flip, flip), device=device)
