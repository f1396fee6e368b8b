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
    the best proper rotation for the weighted cross-covariance, scale from the rotated source's
    projection on the target, translation from the weighted centres. MediaPipe's solver writes
    it with square-root weights and an SVD; it is the same optimum (Note [Procrustes without a
    solver] says how the rotation is found here).

    It runs batched in torch, float64, on the landmarks' device, inside the measuring stage's
    CUDA graph (issue 24: per face on the host it cost ~4.4 ms a batch of 64 on the H100's
    host, more than the models' own work): float64 because the second pass divides by a scale
    found on the first and the depths are differences of nearly equal numbers; a batch is a few
    thousand flops per face, nothing for a GPU's float64 units.

Note [Procrustes without a solver]
    ``torch.linalg.svd`` and ``torch.linalg.eigh`` on CUDA synchronise the device with the host
    (their documentation says so; ATen reads the solver's convergence flags back), which a CUDA
    graph cannot capture and which stalls the host once per fit. So the rotation comes from
    Horn's quaternion method instead (Horn 1987, "Closed-form solution of absolute orientation
    using unit quaternions"): the best proper rotation is the unit quaternion that is the
    eigenvector of the largest eigenvalue of a symmetric 4x4 matrix N made linearly of the 3x3
    cross-covariance, reflections excluded by construction (the quaternion's rotation is always
    proper, which is what Umeyama's sign correction of the SVD achieves). That eigenvector is
    found by repeated squaring of N shifted to be positive semi-definite (N + σI, σ ≥ the
    largest |eigenvalue| of N, which is at most s1 + s2 + s3 ≤ √3‖S‖_F for the covariance's
    singular values s): after k squarings the other eigenvalues' weights shrink as
    r^(2^k), r = (λ2 + σ) / (λ1 + σ), and any column of the result is the eigenvector scaled
    (the one on the largest diagonal entry is the best conditioned). The canonical face turned
    every way, scaled 0.2-5x, with up to 0.9 cm of noise per point, gave r ≤ 0.63, and its
    mirror images (the hardest case: the fit must undo a reflection) r ≤ 0.89; with
    PROCRUSTES_SQUARINGS = 12 (r^4096) a fit is exact to float64 rounding (~1e-15, against
    LAPACK's SVD in tests/models/test_batched_geometry.py) for any r ≤ 0.99, and where r is
    closer to 1 the two best rotations fit the points almost equally well. Every step is a fixed batched
    operation on (N, 4, 4) tensors: no solver, no wait, the same kernels for every batch. A
    fit with no spread at all (a zero covariance: padding rows, a degenerate face) gives the
    identity rotation and scale 0, not an error. The CPU stack (FacePipeline's cpu_runtime
    "litert"), which nothing captures and where each small operator costs microseconds of the
    host, takes LAPACK's eigenvector instead (``eigh``, one call for the batch, where the
    squarings are ~40 operators: 0.19 against 0.32 ms for a face's three fits, the 2-core
    machine, 2026-11-27); tests/models/test_batched_geometry.py holds both to the SVD.

Note [Face geometry on the CPU in numpy]
    With the faces on the CPU and LAPACK's eigenvector (the CPU stack: FaceGeometry.on_host),
    the matrices and the head pose are computed in numpy (`FaceGeometry.matrices_on_host`,
    `_HostProcrustes`, `head_pose_on_host`; FaceMeasurer.results_core takes them so),
    the same formulas in the same order, in float64 as the tensors' path. A frame's three fits
    and the pose were ~180 torch calls (counted in `facecast analyze`, one face, 2026-11-27),
    each 5-10 us of dispatch on the 2-core machine (more in `facecast analyze`, where the
    landmark model's invoke leaves the caches cold), where a numpy call costs 1-2 us. The results agree with the tensors' to float64
    rounding (tests/models/test_batched_geometry.py holds both to the SVD; numpy's eigh and
    torch's call the same LAPACK routine, and a quaternion's sign does not change its rotation).
    A GPU's path, the squarings captured in graphs or its fused kernel, is untouched.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from facecast.models import triton_kernels

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


# How many times the shifted Horn matrix is squared (Note [Procrustes without a solver]), and
# how often it is brought back to trace 1 (float64 keeps 2^(4·4·2) between renormalisations:
# the largest eigenvalue of a trace-1 PSD 4x4 matrix is at least 1/4).
PROCRUSTES_SQUARINGS = 12
_SQUARINGS_PER_NORMALISATION = 4
PROCRUSTES_METHODS = ("squaring", "eigh")


def _index_table(entries: dict[tuple[int, int], tuple[tuple[int, int, float], ...]], rows: int, columns: int
                 ) -> np.ndarray:
    """A (rows, columns) float64 matrix of the linear map that ``entries`` describes: output
    (i, j) of a square output of side √columns is the sum of coefficient · input (a, b), inputs
    flattened row-major with side √rows."""
    side_in, side_out = math.isqrt(rows), math.isqrt(columns)
    table = np.zeros((rows, columns))
    for (i, j), terms in entries.items():
        for a, b, coefficient in terms:
            table[a * side_in + b, i * side_out + j] += coefficient
    return table


_X, _Y, _Z = 0, 1, 2
# Horn's N from S = Σ w (source)(target)ᵀ (3x3, row-major), symmetric: the upper triangle.
_HORN_UPPER = {
    (0, 0): ((_X, _X, 1), (_Y, _Y, 1), (_Z, _Z, 1)),
    (0, 1): ((_Y, _Z, 1), (_Z, _Y, -1)), (0, 2): ((_Z, _X, 1), (_X, _Z, -1)), (0, 3): ((_X, _Y, 1), (_Y, _X, -1)),
    (1, 1): ((_X, _X, 1), (_Y, _Y, -1), (_Z, _Z, -1)), (1, 2): ((_X, _Y, 1), (_Y, _X, 1)),
    (1, 3): ((_Z, _X, 1), (_X, _Z, 1)),
    (2, 2): ((_X, _X, -1), (_Y, _Y, 1), (_Z, _Z, -1)), (2, 3): ((_Y, _Z, 1), (_Z, _Y, 1)),
    (3, 3): ((_X, _X, -1), (_Y, _Y, -1), (_Z, _Z, 1)),
}
HORN_MATRIX = _index_table({**_HORN_UPPER, **{(j, i): terms for (i, j), terms in _HORN_UPPER.items()}}, 9, 16)
# The rotation of a unit quaternion (w, x, y, z) from its outer product q qᵀ (4x4, row-major).
_QW, _QX, _QY, _QZ = 0, 1, 2, 3
QUATERNION_ROTATION = _index_table({
    (0, 0): ((_QW, _QW, 1), (_QX, _QX, 1), (_QY, _QY, -1), (_QZ, _QZ, -1)),
    (0, 1): ((_QX, _QY, 2), (_QW, _QZ, -2)), (0, 2): ((_QX, _QZ, 2), (_QW, _QY, 2)),
    (1, 0): ((_QX, _QY, 2), (_QW, _QZ, 2)),
    (1, 1): ((_QW, _QW, 1), (_QX, _QX, -1), (_QY, _QY, 1), (_QZ, _QZ, -1)),
    (1, 2): ((_QY, _QZ, 2), (_QW, _QX, -2)),
    (2, 0): ((_QX, _QZ, 2), (_QW, _QY, -2)), (2, 1): ((_QY, _QZ, 2), (_QW, _QX, 2)),
    (2, 2): ((_QW, _QW, 1), (_QX, _QX, -1), (_QY, _QY, -1), (_QZ, _QZ, 1)),
}, 16, 9)


@functools.lru_cache(maxsize=8)
def _horn_tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HORN_MATRIX, QUATERNION_ROTATION and the 4x4 identity on the device, made once (a table
    copied per call is a host-to-device copy, which a CUDA graph cannot capture; normal tensors
    even when first asked for under inference mode)."""
    with torch.inference_mode(False):
        return (torch.as_tensor(HORN_MATRIX, device=device, dtype=dtype),
                torch.as_tensor(QUATERNION_ROTATION, device=device, dtype=dtype),
                torch.eye(4, device=device, dtype=dtype))


def best_rotation(covariance: torch.Tensor, method: str = "squaring") -> torch.Tensor:
    """The proper rotations R (N, 3, 3) maximising trace(Rᵀ C) for cross-covariances C (N, 3, 3)
    (C = Σ w target ⊗ source, centred), by Horn's quaternion (Note [Procrustes without a
    solver]): ``method`` "squaring" (a fixed sequence of batched operations, no solver: what a
    CUDA graph captures) or "eigh" (LAPACK's solver, one call: the CPU stack's)."""
    if method not in PROCRUSTES_METHODS:
        raise ValueError(f"method must be one of {PROCRUSTES_METHODS}, got {method!r}")
    count = covariance.shape[0]
    horn, quaternion_rotation, identity = _horn_tables(covariance.device, covariance.dtype)
    source_by_target = covariance.transpose(1, 2).reshape(count, 9)
    horn_n = (source_by_target @ horn).reshape(count, 4, 4)
    if method == "eigh":
        quaternion = torch.linalg.eigh(horn_n).eigenvectors[..., -1]  # the largest eigenvalue's
        spread = source_by_target.abs().amax(dim=1, keepdim=True) > 0
        unit = torch.where(spread, quaternion, identity[0])  # no spread: the identity, as squared
    else:
        unit = _unit_quaternion_by_squaring(horn_n, source_by_target, identity)
    return ((unit[:, :, None] * unit[:, None, :]).reshape(count, 16) @ quaternion_rotation).reshape(count, 3, 3)


def _unit_quaternion_by_squaring(horn_n: torch.Tensor, source_by_target: torch.Tensor,
                                 identity: torch.Tensor) -> torch.Tensor:
    """The unit eigenvector (N, 4) of the largest eigenvalue of Horn's matrices (N, 4, 4), by
    repeated squaring (Note [Procrustes without a solver]); the identity quaternion where a
    covariance is zero."""
    count = horn_n.shape[0]
    shift = math.sqrt(3.0) * source_by_target.norm(dim=1)
    powered = horn_n + shift[:, None, None] * identity  # N + σI
    for step in range(PROCRUSTES_SQUARINGS):
        if step % _SQUARINGS_PER_NORMALISATION == 0:  # trace 1 again (a zero matrix stays zero)
            trace = powered.diagonal(dim1=1, dim2=2).sum(-1)
            powered = powered / trace.clamp_min(torch.finfo(powered.dtype).tiny)[:, None, None]
        powered = powered @ powered
    column = powered.diagonal(dim1=1, dim2=2).argmax(dim=1)  # zero matrix: column 0, the identity below
    quaternion = powered.gather(2, column[:, None, None].expand(count, 4, 1))[..., 0]
    norm = quaternion.norm(dim=1, keepdim=True)
    return torch.where(norm > 0, quaternion / norm.clamp_min(torch.finfo(norm.dtype).tiny), identity[0])


@dataclass(frozen=True)
class ProcrustesSource:
    """The source's side of a weighted Procrustes fit, the same for every target (for the facial
    transformation matrix: MediaPipe's canonical face), made once."""

    weights: torch.Tensor  # (K,) normalised to sum 1
    centre: torch.Tensor  # (3,)
    weighted_centred: torch.Tensor  # (K, 3): w_k (source_k - centre)
    variance: torch.Tensor  # (): Σ w_k |source_k - centre|²

    @classmethod
    def of(cls, source: torch.Tensor, weights: torch.Tensor) -> "ProcrustesSource":
        w = weights / weights.sum()
        centre = w @ source
        centred = source - centre
        return cls(w, centre, w[:, None] * centred, w @ (centred ** 2).sum(-1))

    def fit(self, target: torch.Tensor, method: str = "squaring"
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scale (N,), rotation (N, 3, 3), translation (N, 3) of :func:`weighted_procrustes`
        for targets (N, K, 3)."""
        target_centre = self.weights @ target  # (N, 3): Σ_k w_k target_k
        # Σ_k w_k (target_k - target centre) ⊗ (source_k - source centre), one batched matmul;
        # the target centre's share is Σ_k w_k (source_k - centre) = 0, so it needs no subtracting.
        covariance = target.transpose(1, 2) @ self.weighted_centred
        rotation = best_rotation(covariance, method)
        # Umeyama's scale: trace(Rᵀ C) (the sign-corrected singular values' sum) over the
        # source's weighted variance.
        scale = (rotation * covariance).sum(dim=(1, 2)) / self.variance
        translation = target_centre - scale[:, None] * (rotation @ self.centre)
        return scale, rotation, translation


@dataclass(frozen=True)
class _HostProcrustes:
    """:class:`ProcrustesSource` as numpy arrays, and its fit with LAPACK's eigenvector (Note
    [Face geometry on the CPU in numpy])."""

    weights: np.ndarray  # (K,) float64
    centre: np.ndarray  # (3,)
    weighted_centred: np.ndarray  # (K, 3)
    variance: float

    @classmethod
    def of(cls, source: ProcrustesSource) -> "_HostProcrustes":
        return cls(source.weights.numpy(), source.centre.numpy(), source.weighted_centred.numpy(),
                   float(source.variance))

    def fit(self, target: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`ProcrustesSource.fit` with method "eigh", for targets (N, K, 3) float64."""
        count = target.shape[0]
        target_centre = self.weights @ target  # (N, 3)
        covariance = target.transpose(0, 2, 1) @ self.weighted_centred  # (N, 3, 3)
        source_by_target = covariance.transpose(0, 2, 1).reshape(count, 9)
        horn_n = (source_by_target @ HORN_MATRIX).reshape(count, 4, 4)
        quaternion = np.linalg.eigh(horn_n)[1][..., -1]  # the largest eigenvalue's
        spread = np.abs(source_by_target).max(axis=1, keepdims=True) > 0
        unit = np.where(spread, quaternion, _IDENTITY_QUATERNION)  # no spread: the identity
        rotation = ((unit[:, :, None] * unit[:, None, :]).reshape(count, 16) @ QUATERNION_ROTATION
                    ).reshape(count, 3, 3)
        scale = (rotation * covariance).sum(axis=(1, 2)) / self.variance
        translation = target_centre - scale[:, None] * (rotation @ self.centre)
        return scale, rotation, translation


_IDENTITY_QUATERNION = np.array([1.0, 0.0, 0.0, 0.0])


def weighted_procrustes(source: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                        method: str = "squaring") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale s (N,), rotation R (N, 3, 3), translation t (N, 3) minimising
    Σ w_i |s R source_i + t - target_i|² for each of N targets, batched (Umeyama's optimum:
    Note [Face geometry as MediaPipe computes it]; the rotation by :func:`best_rotation`).

    source (K, 3); target (N, K, 3); weights (K,) ≥ 0, not all zero; one dtype and device;
    ``method`` as :func:`best_rotation`'s.
    """
    return ProcrustesSource.of(source, weights).fit(target, method)


class FaceGeometry:
    """Facial transformation matrices of batches of faces (one metadata, any frame sizes).
    ``procrustes_method``: :func:`best_rotation`'s (Note [Procrustes without a solver])."""

    def __init__(self, metadata: GeometryMetadata, vertical_fov_deg: float = VERTICAL_FOV_DEG,
                 near: float = NEAR_PLANE, procrustes_method: str = "squaring"):
        if procrustes_method not in PROCRUSTES_METHODS:
            raise ValueError(f"procrustes_method must be one of {PROCRUSTES_METHODS}, got {procrustes_method!r}")
        self.procrustes_method = procrustes_method
        self.metadata = metadata
        self.near = near
        self.near_height = 2.0 * near * math.tan(math.radians(vertical_fov_deg) / 2.0)
        self._used = np.flatnonzero(metadata.landmark_weights > 0)
        self._model_by_device: dict[torch.device, tuple[torch.Tensor, ProcrustesSource]] = {}
        self._host_model: _HostProcrustes | None = None  # Note [Face geometry on the CPU in numpy]
        self._host_mappings: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def read(cls, path: str | Path, procrustes_method: str = "squaring") -> "FaceGeometry":
        return cls(GeometryMetadata.read(path), procrustes_method=procrustes_method)

    def _model_on(self, device: torch.device) -> tuple[torch.Tensor, ProcrustesSource]:
        """(landmark indices the fit uses, the canonical model's side of the fit) on the device,
        made once per device: a table copied per call is a host-to-device copy each time. (Normal
        tensors even when first asked for under inference mode, so that they may be used
        anywhere.)"""
        if device not in self._model_by_device:
            with torch.inference_mode(False):
                self._model_by_device[device] = (
                    torch.as_tensor(self._used, device=device),
                    ProcrustesSource.of(
                        torch.as_tensor(self.metadata.canonical_vertices_cm[self._used], device=device),
                        torch.as_tensor(self.metadata.landmark_weights[self._used], device=device)))
        return self._model_by_device[device]

    def matrices(self, landmarks_px: torch.Tensor, frame_wh_px: torch.Tensor) -> torch.Tensor:
        """(N, 4, 4) float64 facial transformation matrices, on the landmarks' device.

        landmarks_px: (N, ≥468, 3) x, y in frame pixels, z in pixels on x's scale (facecast's
        landmarks); frame_wh_px: (N, 2) width, height of each face's frame.
        """
        if self.on_host(landmarks_px.device):
            return torch.from_numpy(self.matrices_on_host(landmarks_px.numpy(), frame_wh_px.cpu().numpy()))
        return self._matrices_as_tensors(landmarks_px, frame_wh_px)

    def on_host(self, device: torch.device) -> bool:
        """Whether faces on ``device`` take the numpy path (Note [Face geometry on the CPU in
        numpy]): on the CPU with LAPACK's eigenvector, the CPU stack's choice, which nothing
        captures or traces (the squarings' CPU path is what the graph tests trace)."""
        return device.type == "cpu" and self.procrustes_method == "eigh"

    def _matrices_as_tensors(self, landmarks_px: torch.Tensor, frame_wh_px: torch.Tensor) -> torch.Tensor:
        """:meth:`matrices` as tensor operations on the landmarks' device (on a GPU captured in
        graphs, or one fused kernel)."""
        used, canonical = self._model_on(landmarks_px.device)
        if landmarks_px.is_cuda and self.procrustes_method == "squaring":  # Note [The transformation matrix in one kernel]
            fused = triton_kernels.face_matrices(landmarks_px, frame_wh_px, used, canonical, self.near,
                                                 self.near_height, NUM_CANONICAL_VERTICES, PROCRUSTES_SQUARINGS,
                                                 _SQUARINGS_PER_NORMALISATION)
            if fused is not None:
                return fused
        size = frame_wh_px.to(device=landmarks_px.device, dtype=torch.float64)
        # Normalise (x/W, y/H, z/W), flip y (top-left origin), scale onto the near plane: per
        # face one factor and one offset per axis, (N, 1, 3) each; only the points the fit
        # weighs are needed, and the mean depth of all 468.
        near_width = self.near_height * size[:, 0] / size[:, 1]
        per_x = near_width / size[:, 0]
        factor = torch.stack([per_x, -self.near_height / size[:, 1], per_x], dim=-1)[:, None]
        offset = torch.stack([-near_width / 2, torch.full_like(near_width, self.near_height / 2),
                              torch.zeros_like(near_width)], dim=-1)[:, None]
        mesh = landmarks_px[:, :NUM_CANONICAL_VERTICES]
        screen = torch.addcmul(offset, mesh[:, used].double(), factor)  # (N, K, 3)
        depth_offset = mesh[..., 2].double().mean(dim=1, keepdim=True) * per_x[:, None]  # (N, 1)

        def unproject(scale):
            depth = (screen[..., 2] - depth_offset + self.near) / scale[:, None]
            return torch.cat([screen[..., :2] * (depth / self.near)[..., None], -depth[..., None]], dim=-1)

        method = self.procrustes_method
        first_scale = canonical.fit(screen * _constant_z_flip(screen.device), method)[0]
        second_scale = canonical.fit(unproject(first_scale), method)[0]
        scale, rotation, translation = canonical.fit(unproject(first_scale * second_scale), method)
        top = torch.cat([scale[:, None, None] * rotation, translation[:, :, None]], dim=2)  # (N, 3, 4)
        bottom = torch.zeros_like(top[:, :1])
        bottom[..., 3].fill_(1.0)  # (an assigned Python number is a tensor made from host data)
        return torch.cat([top, bottom], dim=1)

    def _screen_mapping_on_host(self, frame_wh_px: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(per_x (N,), factor (N, 1, 3), offset (N, 1, 3)) of :meth:`matrices_on_host` for
        faces in frames of these sizes: the same for every frame of a file, so kept for the
        last few tables of sizes (a dozen numpy calls a frame fewer; the values are these
        operations' on the same sizes)."""
        key = (frame_wh_px.dtype.str, frame_wh_px.shape, frame_wh_px.tobytes())
        mapping = self._host_mappings.get(key)
        if mapping is None:
            size = frame_wh_px.astype(np.float64)
            near_width = self.near_height * size[:, 0] / size[:, 1]
            per_x = near_width / size[:, 0]
            factor = np.stack([per_x, -self.near_height / size[:, 1], per_x], axis=-1)[:, None]
            offset = np.stack([-near_width / 2, np.full_like(near_width, self.near_height / 2),
                               np.zeros_like(near_width)], axis=-1)[:, None]
            mapping = (per_x, factor, offset)
            for array in mapping:
                array.flags.writeable = False  # shared by the frames that use it
            if len(self._host_mappings) >= 8:
                self._host_mappings.pop(next(iter(self._host_mappings)))
            self._host_mappings[key] = mapping
        return mapping

    def matrices_on_host(self, landmarks_px: np.ndarray, frame_wh_px: np.ndarray) -> np.ndarray:
        """:meth:`matrices` in numpy, the fits by LAPACK's eigenvector (Note [Face geometry on
        the CPU in numpy]): the tensors' path step for step."""
        if self._host_model is None:
            self._host_model = _HostProcrustes.of(self._model_on(torch.device("cpu"))[1])
        canonical = self._host_model
        count = frame_wh_px.shape[0]
        per_x, factor, offset = self._screen_mapping_on_host(frame_wh_px)
        mesh = landmarks_px[:, :NUM_CANONICAL_VERTICES]
        screen = offset + mesh[:, self._used].astype(np.float64) * factor  # (N, K, 3)
        depth_offset = mesh[..., 2].astype(np.float64).mean(axis=1, keepdims=True) * per_x[:, None]

        def unproject(scale):
            depth = (screen[..., 2] - depth_offset + self.near) / scale[:, None]
            return np.concatenate([screen[..., :2] * (depth / self.near)[..., None], -depth[..., None]], axis=-1)

        first_scale = canonical.fit(screen * _Z_FLIP)[0]
        second_scale = canonical.fit(unproject(first_scale))[0]
        scale, rotation, translation = canonical.fit(unproject(first_scale * second_scale))
        matrices = np.zeros((count, 4, 4))
        matrices[:, :3, :3] = scale[:, None, None] * rotation
        matrices[:, :3, 3] = translation
        matrices[:, 3, 3] = 1.0
        return matrices


_Z_FLIP = np.array([1.0, 1.0, -1.0])


@functools.lru_cache(maxsize=8)
def _constant_z_flip(device: torch.device) -> torch.Tensor:
    """(1, 1, 3) float64 (1, 1, -1): the first fit sees the points with z negated (right-handed);
    made once per device (as :func:`_horn_tables`)."""
    with torch.inference_mode(False):
        return torch.tensor([[[1.0, 1.0, -1.0]]], dtype=torch.float64, device=device)


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


def head_pose_on_host(matrices: np.ndarray) -> np.ndarray:
    """:func:`head_pose_from_matrices` in numpy (Note [Face geometry on the CPU in numpy]): the
    determinant written out as :func:`determinant_3x3`, the real cube root, head_pose's
    ``euler_from_rotation``."""
    linear = matrices[:, :3, :3].astype(np.float64)
    row0, row1, row2 = linear[:, 0], linear[:, 1], linear[:, 2]
    determinant = ((row0[:, 1] * row1[:, 2] - row0[:, 2] * row1[:, 1]) * row2[:, 0]
                   + (row0[:, 2] * row1[:, 0] - row0[:, 0] * row1[:, 2]) * row2[:, 1]
                   + (row0[:, 0] * row1[:, 1] - row0[:, 1] * row1[:, 0]) * row2[:, 2])
    scale = np.sign(determinant) * np.abs(determinant) ** (1.0 / 3.0)  # the real cube root
    rotations = linear / scale[:, None, None] * _FLIP_YZ_SIGNS
    yaw = np.arcsin(np.clip(-rotations[:, 2, 0], -1.0, 1.0))
    pitch = np.arctan2(rotations[:, 2, 1], rotations[:, 2, 2])
    roll = np.arctan2(rotations[:, 1, 0], rotations[:, 0, 0])
    return np.stack([yaw, pitch, roll], axis=-1) * (180.0 / math.pi)


_FLIP_YZ_SIGNS = np.outer(np.diag(_FLIP_YZ), np.diag(_FLIP_YZ))


@functools.lru_cache(maxsize=8)
def _flip_yz_signs(device: torch.device) -> torch.Tensor:
    """(3, 3) float64 signs s with _FLIP_YZ @ R @ _FLIP_YZ = R * s (elementwise), on the device,
    made once (as FaceGeometry._model_on's tables)."""
    flip = np.diag(_FLIP_YZ)
    with torch.inference_mode(False):
        return torch.as_tensor(np.outer(flip, flip), device=device)
