"""Inputs for facecast's Triton kernels and their PyTorch chains (models/triton_kernels.py),
shared by tests/models/triton_interpreter_checks.py, tests/models/test_triton_kernels.py and
bench/kernels.py: real photos, rects over the frames' edges and beyond them, candidates and
faces with ties, degenerate boxes and empty rows."""

from __future__ import annotations

import math

import numpy as np
import skimage.data
import torch

from facecast.models import roi


def two_photos(bgr: bool) -> list[np.ndarray]:
    frames = [skimage.data.astronaut(), skimage.data.coffee()]  # 512x512 and 400x600: padded rows
    return [np.ascontiguousarray(frame[..., ::-1]) for frame in frames] if bgr else frames


# frame, centre, width and height, rotation
SPECS = [
    (0, (225.3, 130.7), (150.0, 150.0), math.radians(20)),
    (1, (300.0, 200.0), (260.0, 200.0), math.radians(-35)),
    (0, (480.0, 500.0), (120.0, 120.0), 0.3),  # over the bottom-right corner
    (1, (20.0, 390.0), (100.0, 100.0), 0.0),  # over the bottom-left corner of the shorter frame
    (1, (900.0, -300.0), (80.0, 80.0), 1.0),  # wholly beyond the frame
    (1, (599.0, 399.0), (3.0, 5.0), 0.0),  # on the last pixel: the right and lower taps stay in
]


def crop_rects(device="cpu") -> tuple[roi.RotatedRects, torch.Tensor]:
    rects = roi.RotatedRects(torch.tensor([s[1] for s in SPECS]), torch.tensor([s[2] for s in SPECS]),
                             torch.tensor([s[3] for s in SPECS]))
    return rects.to(device), torch.tensor([s[0] for s in SPECS], device=device)


def nms_candidates(rows: int, count: int, seed: int, device="cpu"):
    """Sorted candidates as nms._candidates makes them: boxes around a few faces a row (many
    overlapping, some degenerate, equal scores among them), invalid ones last with score 0."""
    gen = torch.Generator().manual_seed(seed)
    faces = torch.rand(rows, 3, 2, generator=gen) * 400
    which = torch.randint(0, 3, (rows, count), generator=gen)
    centres = faces.gather(1, which[..., None].expand(-1, -1, 2)) + torch.randn(rows, count, 2, generator=gen) * 6
    sizes = 40 + torch.rand(rows, count, 1, generator=gen) * 30
    boxes = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=-1)
    boxes[:, 5, 2:] = boxes[:, 5, :2]  # no area: IoU 0 with everything, its own cluster
    scores = (torch.rand(rows, count, generator=gen) * 8).round() / 8  # ties
    valid = torch.rand(rows, count, generator=gen) > 0.25
    valid[-1] = False  # a row with no detection
    keypoints = centres[..., None, :] + torch.randn(rows, count, 6, 2, generator=gen)
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    ranked, order = scores.topk(count, dim=1)
    pick = lambda field: field.gather(1, order.view(rows, count, *[1] * (field.dim() - 2)).expand_as(field))
    valid = torch.isfinite(ranked)
    return (pick(boxes).to(device), torch.where(valid, ranked, torch.zeros_like(ranked)).to(device),
            pick(keypoints).to(device), valid.to(device))


def assert_same_clusters(fused, expected):
    boxes, keypoints, scores, valid = fused
    assert torch.equal(valid, expected.valid)
    assert torch.equal(scores, expected.scores)  # the leaders' scores, no arithmetic
    assert torch.allclose(boxes, expected.boxes, rtol=1e-5, atol=1e-3)
    assert torch.allclose(keypoints, expected.keypoints, rtol=1e-5, atol=1e-3)


def faces_to_filter(count: int, seed: int, device="cpu"):
    """A batch's faces for the duplicate filter: frames of up to 8 faces, interleaved, several
    faces on one person (overlapping boxes), tied scores, some not eligible, padding rows."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, max(1, count // 5), (count,), generator=gen).float()
    groups[-3:] = -1.0  # padding rows: copies of real ones, in a group of their own
    people = torch.rand(count, 2, generator=gen) * 300
    same = torch.randint(0, count, (count,), generator=gen)
    centres = torch.where((torch.rand(count, 1, generator=gen) < 0.5), people[same], people)
    centres = centres + torch.randn(count, 2, generator=gen) * 5
    sizes = 60 + torch.rand(count, 1, generator=gen) * 40
    boxes = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=1)
    scores = (torch.rand(count, generator=gen) * 6).round() / 6
    eligible = torch.rand(count, generator=gen) > 0.2
    counts = torch.bincount((groups + 1).long())
    steps = int(counts.max())
    return [t.to(device) for t in (boxes, scores, groups, eligible)], steps


def raw_detections(spec, input_hw, rows: int, seed: int, device="cpu"):
    """A detector's raw outputs for ``rows`` inputs of ``input_hw`` and the plan that sampled
    them: axis-aligned rects (the letterbox, a whole frame) and one rotated, logits from far
    below to far above the clamp."""
    from facecast.models import anchors as anchors_mod
    from facecast.models.face_detection import DetectorPlan

    gen = torch.Generator().manual_seed(seed)
    anchors = anchors_mod.generate_anchors(spec.anchors, input_hw)
    count, coords = anchors.shape[0], 4 + 2 * spec.num_keypoints
    raw_boxes = torch.randn(rows, count, coords, generator=gen) * 20
    raw_boxes[..., 2:4] = raw_boxes[..., 2:4].abs() * 3
    raw_scores = torch.randn(rows, count, 1, generator=gen) * 6
    raw_scores[0, :4, 0] = torch.tensor([-250.0, 250.0, 0.0, 1e-3])
    rects = roi.RotatedRects(torch.tensor([[960.0, 540.0], [960.0, 120.0], [300.0, 200.0]])[:rows],
                             torch.tensor([[1920.0, 1080.0], [1920.0, 1920.0], [400.0, 300.0]])[:rows],
                             torch.tensor([0.0, 0.0, 0.4])[:rows])
    plan = DetectorPlan(rects.to(device), input_hw, anchors.to(device))
    return (raw_boxes.to(device), raw_scores.to(device)), plan


def faces_for_geometry(count: int, seed: int, device="cpu"):
    """A made-up canonical face (468 vertices, 33 of them weighted, as MediaPipe's metadata) and
    ``count`` faces of 478 landmarks in frame pixels: the canonical face turned, scaled, moved
    and perturbed, in frames of three sizes. Returns (FaceGeometry, landmarks, frames' sizes)."""
    from facecast.models import face_geometry

    gen = torch.Generator().manual_seed(seed)
    vertices = torch.randn(468, 3, generator=gen, dtype=torch.float64) * torch.tensor([6.0, 8.0, 4.0],
                                                                                        dtype=torch.float64)
    weights = torch.zeros(468, dtype=torch.float64)
    weights[torch.randperm(468, generator=gen)[:33]] = torch.rand(33, generator=gen, dtype=torch.float64) + 0.1
    geometry = face_geometry.FaceGeometry(face_geometry.GeometryMetadata(vertices.numpy(), weights.numpy()))
    sizes = torch.tensor([[1920.0, 1080.0], [1280.0, 720.0], [640.0, 480.0]])[torch.arange(count) % 3]
    angles = (torch.rand(count, 3, generator=gen) - 0.5) * 1.2
    landmarks = torch.empty(count, 478, 3)
    for n in range(count):
        a, b, c = angles[n].tolist()
        turn = torch.tensor([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1]])
        turn = turn @ torch.tensor([[1, 0, 0], [0, math.cos(b), -math.sin(b)], [0, math.sin(b), math.cos(b)]])
        turn = turn @ torch.tensor([[math.cos(c), 0, math.sin(c)], [0, 1, 0], [-math.sin(c), 0, math.cos(c)]])
        face = vertices.float() @ turn.T * (4 + 6 * torch.rand(1, generator=gen))
        face = face * torch.tensor([1.0, -1.0, 1.0]) + torch.cat([sizes[n] * (0.3 + 0.4 * torch.rand(2, generator=gen)),
                                                               torch.zeros(1)])
        landmarks[n, :468] = face + torch.randn(468, 3, generator=gen)
        landmarks[n, 468:] = face[:10]
    return geometry, landmarks.to(device), sizes.to(device)


def attention_operators():
    """The attention mesh's three custom operators with its lips' options (16x16 crops of the
    feature map, scale 1.5, 80 subset landmarks, rotation from landmarks 61 and 291)."""
    from facecast.models import custom_ops

    options = {"left_rotation_idx": 61, "right_rotation_idx": 291, "target_rotation_radians": 0.0,
               "output_width": 16, "output_height": 16, "scale_x": 1.5, "scale_y": 1.5,
               "subset_idxs": list(range(0, 160, 2))}
    return (custom_ops.Landmarks2TransformMatrix(options), custom_ops.TransformTensorBilinear(16, 16),
            custom_ops.TransformLandmarks())


def attention_crop_inputs(count: int, dtype, seed: int, device="cpu"):
    """Landmarks (N, 478, 3) spread over a channels-last feature map (N, 32, 48, 48), in its
    pixels, as the attention mesh's custom operators get them; every third face near the map's
    corner, so that its crop reaches outside (zeros there)."""
    gen = torch.Generator().manual_seed(seed)
    centre = 24 + 6 * (torch.rand(count, 1, 2, generator=gen) - 0.5)
    spread = 12 + 6 * torch.rand(count, 1, 1, generator=gen)
    xy = centre + spread * (torch.rand(count, 478, 2, generator=gen) - 0.5)
    xy[2::3] += 18
    landmarks = torch.cat([xy, torch.randn(count, 478, 1, generator=gen)], dim=-1).to(device, dtype)
    features = torch.randn(count, 32, 48, 48, generator=gen).to(device, dtype).contiguous(
        memory_format=torch.channels_last)
    return landmarks, features
