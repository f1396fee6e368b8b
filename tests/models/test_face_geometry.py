"""MediaPipe's facial transformation matrix (models/face_geometry.py): the metadata reader
against the protobuf package's own parser, the Procrustes fit against a known transform, and
the whole geometry pipeline against MediaPipe 0.10.21's matrices for MediaPipe's own landmarks
(fixtures of scripts/make_face_landmarker_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from facecast.models.face_geometry import (
    FaceGeometry,
    GeometryMetadata,
    GeometryMetadataError,
    determinant_3x3,
    rotation_and_translation,
    weighted_procrustes,
)
from facecast.models.head_pose import rotation_from_euler

FIXTURES = Path(__file__).parent / "fixtures"


def _protobuf_metadata_class():
    """MediaPipe's schema (geometry_pipeline_metadata.proto, mesh_3d.proto), declared through the
    protobuf package (a dependency of ai-edge-litert, a test dependency): the independent reader
    the minimal one is checked against."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="facecast_test_geometry.proto", package="t",
                                             syntax="proto2")
    f = descriptor_pb2.FieldDescriptorProto
    mesh = fdp.message_type.add(name="Mesh3d")
    mesh.field.add(name="vertex_type", number=1, type=f.TYPE_INT32, label=f.LABEL_OPTIONAL)
    mesh.field.add(name="primitive_type", number=2, type=f.TYPE_INT32, label=f.LABEL_OPTIONAL)
    mesh.field.add(name="vertex_buffer", number=3, type=f.TYPE_FLOAT, label=f.LABEL_REPEATED)
    mesh.field.add(name="index_buffer", number=4, type=f.TYPE_UINT32, label=f.LABEL_REPEATED)
    ref = fdp.message_type.add(name="WeightedLandmarkRef")
    ref.field.add(name="landmark_id", number=1, type=f.TYPE_UINT32, label=f.LABEL_OPTIONAL)
    ref.field.add(name="weight", number=2, type=f.TYPE_FLOAT, label=f.LABEL_OPTIONAL)
    meta = fdp.message_type.add(name="GeometryPipelineMetadata")
    meta.field.add(name="input_source", number=3, type=f.TYPE_INT32, label=f.LABEL_OPTIONAL)
    meta.field.add(name="canonical_mesh", number=1, type=f.TYPE_MESSAGE, type_name=".t.Mesh3d",
                   label=f.LABEL_OPTIONAL)
    meta.field.add(name="procrustes_landmark_basis", number=2, type=f.TYPE_MESSAGE,
                   type_name=".t.WeightedLandmarkRef", label=f.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.GeometryPipelineMetadata"))


def test_metadata_reader_agrees_with_protobuf(landmarker_bundle):
    data = landmarker_bundle.geometry_metadata.read_bytes()
    ours = GeometryMetadata.parse(data)
    message = _protobuf_metadata_class().FromString(data)
    vertices = np.asarray(message.canonical_mesh.vertex_buffer, np.float64).reshape(-1, 5)[:, :3]
    np.testing.assert_array_equal(ours.canonical_vertices_cm, vertices)
    weights = np.zeros(468)
    for ref in message.procrustes_landmark_basis:
        weights[ref.landmark_id] = ref.weight
    np.testing.assert_array_equal(ours.landmark_weights, weights)
    assert np.count_nonzero(weights) > 20
    # The canonical face is about 15 cm wide, in centimeters.
    assert 10 < np.ptp(ours.canonical_vertices_cm[:, 0]) < 20


def test_metadata_reader_rejects_what_is_not_the_metadata(tmp_path):
    with pytest.raises(GeometryMetadataError, match="vertex values"):
        GeometryMetadata.parse(b"")
    with pytest.raises(GeometryMetadataError):
        GeometryMetadata.parse(b"\x0a\x05\x1a\x03abc")  # a mesh with a truncated float buffer


def test_weighted_procrustes_recovers_a_known_similarity():
    rng = np.random.default_rng(3)
    source = torch.from_numpy(rng.normal(size=(40, 3)) * 5)
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, size=40))
    rotation = rotation_from_euler(torch.tensor([[20.0, -10.0, 35.0]]))[0]
    target = (2.5 * source @ rotation.T + torch.tensor([1.0, -2.0, -50.0], dtype=torch.float64))[None]
    scale, fitted, translation = weighted_procrustes(source, target, weights)
    assert scale[0].item() == pytest.approx(2.5, rel=1e-12)
    np.testing.assert_allclose(fitted[0], rotation, atol=1e-12)
    np.testing.assert_allclose(translation[0], [1.0, -2.0, -50.0], atol=1e-10)
    # A mirror image is fitted with a rotation, never a reflection.
    mirror = torch.tensor([-1.0, 1.0, 1.0], dtype=torch.float64)
    _, mirrored, _ = weighted_procrustes(source, target * mirror, weights)
    assert determinant_3x3(mirrored)[0].item() == pytest.approx(1.0)
    np.testing.assert_allclose(determinant_3x3(mirrored), np.linalg.det(mirrored.numpy()), atol=1e-12)


def test_matrices_match_mediapipe_for_mediapipe_landmarks(landmarker_bundle):
    """Given MediaPipe's own landmarks, the pipeline reproduces MediaPipe's matrices up to the
    float32 rounding of the fixture (MediaPipe computes in float32)."""
    geometry = FaceGeometry.read(landmarker_bundle.geometry_metadata)
    meta = json.loads((FIXTURES / "mediapipe_face_landmarker.json").read_text())
    arrays = np.load(FIXTURES / "mediapipe_face_landmarker.npz")
    worst = 0.0
    for case in meta["cases"]:
        landmarks = arrays[f"{case['name']}/landmarks_px"]
        expected = arrays[f"{case['name']}/matrices"]
        sizes = np.tile([case["width_px"], case["height_px"]], (len(landmarks), 1))
        got = geometry.matrices(torch.from_numpy(landmarks), torch.from_numpy(sizes)).numpy()
        worst = max(worst, float(np.abs(got - expected).max()))
        rotations, translations = rotation_and_translation(got)
        np.testing.assert_allclose(np.linalg.det(rotations), 1.0, atol=1e-9)
        assert (translations[:, 2] < -20).all(), "a face in front of the camera has z < 0 (cm)"
    assert worst < 1e-3, f"max |matrix difference| {worst:.2e}"
