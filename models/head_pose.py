"""Head pose (yaw, pitch, roll in degrees) from the 3D face mesh.

Method: a face-fixed orthonormal frame measured on the landmarks
-----------------------------------------------------------------
The mesh's points are in image pixels with z on the same scale as x (``FacePipeline`` output),
so, under the weak-perspective model MediaPipe's mesh is trained with, they are a scaled rigid
copy of the face. From them:

- ``x̂`` (the face's "right-to-left" axis) is the mean of the vectors from the subject's right to
  the subject's left across four symmetric pairs (outer eye corners 33/263, inner eye corners
  133/362, mouth corners 61/291, cheek contour 234/454), normalized. For a frontal upright face
  it points to +x in the image.
- ``ŷ`` (down the face) is the vector from the forehead (10) to the chin (152), with its
  component along ``x̂`` removed (Gram-Schmidt), normalized. Frontal upright: +y (image down).
- ``ẑ = x̂ × ŷ`` points away from the camera for a frontal face (+z, into the image), completing a
  right-handed frame like the camera's (x right, y down, z forward).

``R = [x̂ ŷ ẑ]`` (columns) maps face axes to camera axes and is decomposed as
``R = Rz(roll) · Ry(yaw) · Rx(pitch)``:

- ``yaw   = asin(−R[2,0])``: rotation about the face's vertical axis; positive when the subject's
  left cheek comes toward the camera, i.e. they turn toward their own right (image-left).
- ``pitch = atan2(R[2,1], R[2,2])``: about the face's left-right axis; positive when the forehead
  comes toward the camera and the chin goes away (looking down).
- ``roll  = atan2(R[1,0], R[0,0])``: about the camera's optical axis, applied last; positive
  clockwise on screen (the subject's left eye, on image-right, lower than the right eye).

Because roll is the outermost rotation, rotating the photo in-plane by θ (clockwise) adds exactly
θ to roll and leaves yaw and pitch unchanged; the landmarks' own noise is the only error.

Zero pose is "eye/mouth line parallel to the image plane and forehead-chin line perpendicular to
the optical axis". It is a measured frame, not a fit to a canonical model: a person whose chin
juts out reads a few degrees of pitch when looking straight at the camera. (MediaPipe's facial
transformation matrix, which fits its canonical model, needs the geometry metadata in
face_landmarker.task; see FacePipeline.)
"""

from __future__ import annotations

import functools
import math

import torch

# (subject's right, subject's left) landmark pairs of the 468-point mesh.
SYMMETRIC_PAIRS = ((33, 263), (133, 362), (61, 291), (234, 454))
FOREHEAD_INDEX = 10
CHIN_INDEX = 152


@functools.lru_cache(maxsize=8)
def _frame_points(device: torch.device) -> torch.Tensor:
    """The indices of the pairs' right points, their left points, forehead and chin, on the
    device, made once: a Python list as an index is a host-to-device copy per call (issue 24's
    profile: ~5.6 ms a batch on the H100's host). (A normal tensor even when first asked for
    under inference mode, so that it may index anywhere.)"""
    order = [r for r, _ in SYMMETRIC_PAIRS] + [l for _, l in SYMMETRIC_PAIRS] + [FOREHEAD_INDEX, CHIN_INDEX]
    with torch.inference_mode(False):
        return torch.tensor(order, device=device)


def face_frame(landmarks: torch.Tensor) -> torch.Tensor:
    """Rotation matrices ``(N, 3, 3)`` whose columns are the face's x̂, ŷ, ẑ in camera axes.

    landmarks: ``(N, ≥468, 3)`` x, y, z on one scale (pixels).
    """
    if landmarks.dim() != 3 or landmarks.shape[1] < 468 or landmarks.shape[2] != 3:
        raise ValueError(f"landmarks must be (faces, 468 or 478, 3), got {tuple(landmarks.shape)}")
    # The ten points the frame is made of, gathered once and then in float64 (not the mesh).
    points = landmarks.index_select(1, _frame_points(landmarks.device)).double()
    pairs = len(SYMMETRIC_PAIRS)
    right, left = points[:, :pairs], points[:, pairs:2 * pairs]
    forehead, chin = points[:, 2 * pairs], points[:, 2 * pairs + 1]
    x_axis = torch.nn.functional.normalize((left - right).mean(dim=1), dim=-1)
    down = chin - forehead
    down = down - (down * x_axis).sum(-1, keepdim=True) * x_axis
    y_axis = torch.nn.functional.normalize(down, dim=-1)
    z_axis = torch.linalg.cross(x_axis, y_axis)
    return torch.stack([x_axis, y_axis, z_axis], dim=-1)


def euler_from_rotation(rotation: torch.Tensor) -> torch.Tensor:
    """(N, 3, 3) → (N, 3) yaw, pitch, roll in degrees for ``R = Rz(roll)·Ry(yaw)·Rx(pitch)``."""
    yaw = torch.asin((-rotation[:, 2, 0]).clamp(-1.0, 1.0))
    pitch = torch.atan2(rotation[:, 2, 1], rotation[:, 2, 2])
    roll = torch.atan2(rotation[:, 1, 0], rotation[:, 0, 0])
    return torch.stack([yaw, pitch, roll], dim=-1) * (180.0 / math.pi)


def rotation_from_euler(yaw_pitch_roll_deg: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`euler_from_rotation` (for tests and synthetic data)."""
    yaw, pitch, roll = (yaw_pitch_roll_deg.double() * (math.pi / 180.0)).unbind(-1)
    one, zero = torch.ones_like(yaw), torch.zeros_like(yaw)

    def stack(rows):
        return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)

    rz = stack([[torch.cos(roll), -torch.sin(roll), zero], [torch.sin(roll), torch.cos(roll), zero], [zero, zero, one]])
    ry = stack([[torch.cos(yaw), zero, torch.sin(yaw)], [zero, one, zero], [-torch.sin(yaw), zero, torch.cos(yaw)]])
    rx = stack([[one, zero, zero], [zero, torch.cos(pitch), -torch.sin(pitch)], [zero, torch.sin(pitch), torch.cos(pitch)]])
    return rz @ ry @ rx


def head_pose_deg(landmarks: torch.Tensor) -> torch.Tensor:
    """(N, ≥468, 3) landmarks (x, y, z on one scale) → (N, 3) yaw, pitch, roll in degrees."""
    return euler_from_rotation(face_frame(landmarks)).to(landmarks.dtype)
