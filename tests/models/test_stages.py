"""Unit tests of the pure-torch stages of the face pipeline, each against an expectation that
does not come from the code under test: hand-computed anchors and boxes, a plain-Python greedy
re-implementation of MediaPipe's weighted NMS, OpenCV's warpAffine for the ROI crops, and
synthetic rotations for head pose. Needs no model files."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import skimage.data
import torch

from facecast.models import anchors, head_pose, nms, roi
from facecast.models.face_mesh import (
    LEFT_EYE_TO_MESH,
    LIPS_TO_MESH,
    RIGHT_EYE_TO_MESH,
    refine_attention_mesh,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")


# -- anchors and decoding -------------------------------------------------------------------------


def test_short_range_anchor_layout():
    a = anchors.generate_anchors(anchors.FACE_SHORT_RANGE.anchors)
    assert a.shape == (896, 2)
    # 16x16 map, 2 anchors per cell (aspect 1 + interpolated), row-major.
    assert torch.allclose(a[0], torch.tensor([0.5 / 16, 0.5 / 16]))
    assert torch.equal(a[0], a[1])
    assert torch.allclose(a[2], torch.tensor([1.5 / 16, 0.5 / 16]))
    assert torch.allclose(a[32], torch.tensor([0.5 / 16, 1.5 / 16]))
    # Then one 8x8 map carrying the three stride-16 layers: 6 anchors per cell.
    assert torch.allclose(a[512], torch.tensor([0.5 / 8, 0.5 / 8]))
    assert torch.equal(a[512:518], a[512:513].expand(6, 2))
    assert torch.allclose(a[518], torch.tensor([1.5 / 8, 0.5 / 8]))
    assert torch.allclose(a[-1], torch.tensor([7.5 / 8, 7.5 / 8]))


def test_full_range_anchor_layout():
    a = anchors.generate_anchors(anchors.FACE_FULL_RANGE.anchors)
    assert a.shape == (2304, 2)
    k = torch.arange(2304)
    expected = torch.stack([(k % 48 + 0.5) / 48, (k // 48 + 0.5) / 48], dim=1).float()
    assert torch.allclose(a, expected)


def test_pose_anchor_count():
    assert anchors.generate_anchors(anchors.POSE_DETECTION.anchors).shape == (2254, 2)


def test_decode_inverts_a_hand_encoded_box():
    spec = anchors.FACE_SHORT_RANGE
    a = anchors.generate_anchors(spec.anchors)
    raw = torch.zeros(1, 896, 16)
    index = 600
    ax, ay = a[index].tolist()
    # A box centred at (0.40, 0.55), 0.20 wide, 0.25 high; keypoint k at (0.3 + 0.01k, 0.5).
    raw[0, index, 0] = (0.40 - ax) * 128
    raw[0, index, 1] = (0.55 - ay) * 128
    raw[0, index, 2] = 0.20 * 128
    raw[0, index, 3] = 0.25 * 128
    for k in range(6):
        raw[0, index, 4 + 2 * k] = (0.3 + 0.01 * k - ax) * 128
        raw[0, index, 5 + 2 * k] = (0.5 - ay) * 128
    logits = torch.zeros(1, 896, 1)
    logits[0, index] = 2.0
    logits[0, 0] = 1e4  # clipped to 100 before the sigmoid: still a finite 1.0
    out = anchors.decode(raw, logits, a, spec)
    assert torch.allclose(out.boxes[0, index], torch.tensor([0.30, 0.425, 0.50, 0.675]), atol=1e-6)
    assert torch.allclose(out.keypoints[0, index, :, 0], 0.3 + 0.01 * torch.arange(6.0), atol=1e-6)
    assert torch.allclose(out.scores[0, index], torch.sigmoid(torch.tensor(2.0)))
    assert out.scores[0, 0] == 1.0 and out.scores[0, 5] == 0.5


def test_decode_rejects_wrong_shapes():
    spec = anchors.FACE_FULL_RANGE
    a = anchors.generate_anchors(spec.anchors)
    with pytest.raises(ValueError, match="2304"):
        anchors.decode(torch.zeros(1, 896, 16), torch.zeros(1, 896, 1), a, spec)


# -- weighted NMS ---------------------------------------------------------------------------------


def reference_weighted_nms(boxes, scores, keypoints, threshold):
    """MediaPipe's WEIGHTED algorithm written plainly, one image, Python floats."""

    def iou(a, b):
        iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        inter = iw * ih
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return inter / union if union > 0 else 0.0

    remaining = sorted(range(len(scores)), key=lambda i: -scores[i])
    out = []
    while remaining:
        leader = remaining[0]
        cluster = [i for i in remaining if iou(boxes[i], boxes[leader]) > threshold]
        remaining = [i for i in remaining if i not in cluster]
        total = sum(scores[i] for i in cluster)
        box = [sum(boxes[i][c] * scores[i] for i in cluster) / total for c in range(4)]
        kps = [[sum(keypoints[i][k][c] * scores[i] for i in cluster) / total for c in range(2)]
               for k in range(len(keypoints[leader]))]
        out.append((box, scores[leader], kps))
    return out


def test_weighted_nms_blends_a_cluster_by_score():
    boxes = torch.tensor([[[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]]])
    scores = torch.tensor([[0.9, 0.6, 0.7]])
    keypoints = torch.tensor([[[[2.0, 2.0]], [[3.0, 4.0]], [[55.0, 55.0]]]])
    out = nms.weighted_nms(boxes, scores, keypoints, torch.ones(1, 3, dtype=torch.bool), 0.3, max_detections=5)
    assert out.valid[0].tolist() == [True, True, False, False, False]
    # Hand computation: (0*0.9 + 1*0.6)/1.5 = 0.4 for x1, y1; 10.4 for x2, y2.
    assert torch.allclose(out.boxes[0, 0], torch.tensor([0.4, 0.4, 10.4, 10.4]))
    assert torch.allclose(out.keypoints[0, 0, 0], torch.tensor([2.4, 2.8]))
    assert out.scores[0, 0].item() == pytest.approx(0.9)  # the leader's score, not a blend
    assert torch.allclose(out.boxes[0, 1], boxes[0, 2]) and out.scores[0, 1].item() == pytest.approx(0.7)


def test_weighted_nms_threshold_is_strict_and_invalid_never_counts():
    # IoU of these two is exactly 1/3.
    boxes = torch.tensor([[[0.0, 0.0, 2.0, 1.0], [1.0, 0.0, 3.0, 1.0], [0.0, 0.0, 2.0, 1.0]]])
    scores = torch.tensor([[0.9, 0.8, 0.99]])
    valid = torch.tensor([[True, True, False]])
    out = nms.weighted_nms(boxes, scores, torch.zeros(1, 3, 0, 2), valid, 1 / 3, max_detections=3)
    assert out.valid[0].tolist() == [True, True, False]
    assert torch.allclose(out.boxes[0, :2], boxes[0, :2])


def test_weighted_nms_batch_matches_the_reference_per_image():
    gen = torch.Generator().manual_seed(7)
    batch, count = 3, 40
    centres = torch.rand(batch, count, 2, generator=gen) * 100
    sizes = 5 + torch.rand(batch, count, 2, generator=gen) * 30
    boxes = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=-1)
    scores = torch.rand(batch, count, generator=gen)
    keypoints = torch.rand(batch, count, 3, 2, generator=gen) * 100
    valid = scores > 0.3
    out = nms.weighted_nms(boxes, scores, keypoints, valid, 0.3, max_detections=count)
    for b in range(batch):
        keep = valid[b].nonzero().flatten().tolist()
        expected = reference_weighted_nms(
            [boxes[b, i].tolist() for i in keep], [scores[b, i].item() for i in keep],
            [keypoints[b, i].tolist() for i in keep], 0.3)
        got = out.select(b)
        assert got.boxes.shape[1] == len(expected)
        for k, (box, score, kps) in enumerate(expected):
            assert torch.allclose(got.boxes[0, k], torch.tensor(box), atol=1e-4)
            assert got.scores[0, k].item() == pytest.approx(score, abs=1e-6)
            assert torch.allclose(got.keypoints[0, k], torch.tensor(kps), atol=1e-4)


def random_detections(gen, batch, count, keypoints=6):
    centres = torch.rand(batch, count, 2, generator=gen) * 100
    sizes = 5 + torch.rand(batch, count, 2, generator=gen) * 30
    boxes = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=-1)
    scores = torch.rand(batch, count, generator=gen)
    return boxes, scores, torch.rand(batch, count, keypoints, 2, generator=gen) * 100, scores > 0.3


def test_weighted_nms_of_parts_equals_one_call_per_part():
    # Parts of other batch and anchor counts, one below max_candidates (padded) and two above
    # it (cut), as the detection pass hands them: the short-range detector and the full-range
    # one per input shape.
    gen = torch.Generator().manual_seed(11)
    parts = [random_detections(gen, 3, 40), random_detections(gen, 2, 90), random_detections(gen, 1, 70)]
    joint = nms.weighted_nms_of_parts(parts, 0.3, max_detections=8, max_candidates=64)
    assert len(joint) == 3
    for part, got in zip(parts, joint):
        alone = nms.weighted_nms(*part, 0.3, max_detections=8, max_candidates=64)
        assert got.valid.shape == (len(part[0]), 8)
        assert torch.equal(got.valid, alone.valid)
        for field in ("boxes", "keypoints", "scores"):
            assert torch.allclose(getattr(got, field), getattr(alone, field), atol=1e-5), field
        assert got.valid.any()


def test_weighted_nms_of_parts_refuses_parts_of_other_keypoint_counts():
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="one keypoint count"):
        nms.weighted_nms_of_parts([random_detections(gen, 1, 10, 6), random_detections(gen, 1, 10, 4)],
                                  0.3, max_detections=2)


def test_both_face_detectors_share_one_nms_threshold():
    # The detection pass clusters both detectors' candidates in one call (Note [One NMS for
    # both detectors]) with the short-range detector's threshold.
    assert anchors.FACE_SHORT_RANGE.min_suppression_iou == anchors.FACE_FULL_RANGE.min_suppression_iou


def test_weighted_nms_caps_the_number_of_detections():
    boxes = torch.tensor([[[i * 20.0, 0.0, i * 20.0 + 10, 10.0] for i in range(5)]])
    scores = torch.tensor([[0.1, 0.5, 0.9, 0.3, 0.7]])
    out = nms.weighted_nms(boxes, scores, torch.zeros(1, 5, 0, 2), torch.ones(1, 5, dtype=torch.bool), 0.3, 2)
    assert out.scores[0].tolist() == pytest.approx([0.9, 0.7])


def test_box_iou_degenerate_boxes_are_zero_not_nan():
    iou = nms.box_iou(torch.tensor([[0.0, 0.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0, 0.0, 0.0], [0, 0, 1, 1.0]]))
    assert iou.tolist() == [[0.0, 0.0]]
    assert nms.box_iou(np.zeros((1, 4)), np.array([[0.0, 0.0, 0.0, 0.0], [0, 0, 1, 1]])).tolist() == [[0.0, 0.0]]


def test_box_iou_on_the_host_is_the_tensor_one():
    """One IoU for tensors and numpy arrays (the trackers' and the duplicate filter's), equal to
    the areas worked out by hand and bitwise equal between the two kinds."""
    a = np.array([[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 15.0, 25.0]], np.float32)
    b = np.array([[5.0, 0.0, 15.0, 10.0], [20.0, 20.0, 30.0, 30.0], [0.0, 0.0, 10.0, 10.0]], np.float32)
    on_host = nms.box_iou(a, b)
    assert on_host.dtype == np.float32 and on_host.shape == (2, 3)
    assert on_host[0].tolist() == pytest.approx([50 / 150, 0.0, 1.0])
    assert on_host[1].tolist() == pytest.approx([50 / 250, 0.0, 25 / 275])
    assert np.array_equal(on_host, nms.box_iou(torch.from_numpy(a), torch.from_numpy(b)).numpy())
    assert nms.box_pair_iou((0, 0, 10, 10), np.array([5.0, 0.0, 15.0, 10.0])) == pytest.approx(1 / 3)


def test_box_pair_iou_in_plain_floats_is_box_iou_bit_for_bit():
    """The trackers' per-pair IoU (plain floats, for speed) is box_iou's arithmetic: equal in
    float64, overlapping, disjoint, touching, empty and inverted boxes included."""
    rng = np.random.default_rng(7)
    corners = rng.uniform(0, 100, (1000, 2))
    a = np.concatenate([corners, corners + rng.uniform(-5, 40, (1000, 2))], axis=1)  # some inverted
    b = a + rng.uniform(-30, 30, (1000, 4))  # mostly near a, some apart
    a[:50, 2:] = a[:50, :2]  # no area
    b[50:60] = a[50:60]  # the same box
    expected = nms.box_iou(a[:, None], b[:, None])[:, 0, 0]
    pairs = [nms.box_pair_iou(box_a, box_b) for box_a, box_b in zip(a, b)]
    assert np.count_nonzero(expected) > 200  # the sample has overlaps
    assert np.array_equal(np.array(pairs), expected)


def test_drop_overlapping_keeps_the_more_present_of_each_overlapping_group():
    # (name, box, presence): a and b overlap by IoU 0.6, c overlaps b alone by 1/3, d is apart.
    items = [("a", (0, 0, 10, 10), 0.7), ("b", (2.5, 0, 12.5, 10), 0.9), ("c", (7.5, 0, 17.5, 10), 0.8),
             ("d", (50, 50, 60, 60), 0.6)]

    def kept(max_iou, as_tensor):
        box_of = (lambda item: torch.tensor(item[1])) if as_tensor else (lambda item: np.array(item[1], np.float32))
        return [name for name, _, _ in nms.drop_overlapping(items, box_of, lambda item: item[2], max_iou)]

    for as_tensor in (False, True):
        assert kept(0.5, as_tensor) == ["b", "c", "d"]  # best first; a goes with b
        assert kept(0.2, as_tensor) == ["b", "d"]  # now c goes with b too
        assert kept(0.7, as_tensor) == ["b", "c", "a", "d"]  # nothing overlaps by more
    assert nms.drop_overlapping([], np.array, lambda item: 0.0, 0.5) == []


# -- ROI ------------------------------------------------------------------------------------------


def test_rect_from_detection_follows_the_eye_line():
    boxes = torch.tensor([[100.0, 100.0, 180.0, 200.0]] * 2)
    angle = math.radians(30)
    eyes = torch.tensor([
        [[120.0, 140.0], [160.0, 140.0]],
        [[120.0, 140.0], [120 + 40 * math.cos(angle), 140 + 40 * math.sin(angle)]],
    ])
    keypoints = torch.cat([eyes, torch.zeros(2, 4, 2)], dim=1)
    rects = roi.rects_from_detections(boxes, keypoints)
    assert torch.allclose(rects.center_xy_px, torch.tensor([[140.0, 150.0]] * 2))
    assert torch.allclose(rects.size_wh_px, torch.tensor([[150.0, 150.0]] * 2))  # 1.5 x long side
    assert rects.rotation_rad.tolist() == pytest.approx([0.0, angle], abs=1e-6)


def test_rect_from_landmarks_rotates_with_the_face():
    gen = torch.Generator().manual_seed(0)
    flat = torch.rand(478, 3, generator=gen) * 100
    flat[roi.MESH_ROTATION_START_INDEX, :2] = torch.tensor([20.0, 50.0])
    flat[roi.MESH_ROTATION_END_INDEX, :2] = torch.tensor([80.0, 50.0])
    theta = math.radians(-25)
    rot = torch.tensor([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    turned = flat.clone()
    turned[:, :2] = flat[:, :2] @ rot.T + 300
    rects = roi.rects_from_landmarks(torch.stack([flat, turned]))
    assert rects.rotation_rad.tolist() == pytest.approx([0.0, theta], abs=1e-5)
    span = flat[:, :2].max(0).values - flat[:, :2].min(0).values
    assert rects.size_wh_px[0, 0].item() == pytest.approx(1.5 * span.max().item(), rel=1e-5)


def _cv2_crop(image_rgb: np.ndarray, center, side, angle_rad, out_px, border=cv2.BORDER_REPLICATE):
    """MediaPipe's OpenCV path, independently: corners of the rotated rect → output corners."""
    c, s = math.cos(angle_rad), math.sin(angle_rad)
    half = side / 2

    def corner(dx, dy):
        return [center[0] + c * dx - s * dy, center[1] + s * dx + c * dy]

    src = np.float32([corner(-half, -half), corner(half, -half), corner(half, half)])
    dst = np.float32([[0, 0], [out_px, 0], [out_px, out_px]])
    matrix = cv2.getAffineTransform(src, dst)
    return cv2.warpAffine(image_rgb.astype(np.float32), matrix, (out_px, out_px), flags=cv2.INTER_LINEAR,
                          borderMode=border)


def test_crop_rois_matches_opencv_and_keeps_frames_apart():
    astronaut = skimage.data.astronaut()
    coffee = skimage.data.coffee()  # 400x600: a second frame of another size
    frames_bgr = [astronaut[..., ::-1].copy(), coffee[..., ::-1].copy()]
    batch = roi.FrameBatch(frames_bgr, "cpu")
    specs = [  # frame, centre, side, rotation
        (0, (225.0, 130.0), 150.0, math.radians(20)),
        (1, (300.0, 200.0), 260.0, math.radians(-35)),
        (0, (480.0, 500.0), 120.0, 0.3),  # over the bottom-right corner: replicated border
        (1, (20.0, 390.0), 100.0, 0.0),  # over the bottom-left corner of the shorter frame
    ]
    rects = roi.RotatedRects(
        torch.tensor([s[1] for s in specs]), torch.tensor([[s[2], s[2]] for s in specs]),
        torch.tensor([s[3] for s in specs]))
    crops = roi.crop_rois(batch, torch.tensor([s[0] for s in specs]), rects, 96) * 255
    for k, (frame, center, side, angle) in enumerate(specs):
        expected = _cv2_crop([astronaut, coffee][frame], center, side, angle, 96)
        diff = np.abs(crops[k].numpy() - expected)
        # OpenCV quantizes bilinear weights to 1/32 pixel, hence a few levels at sharp edges.
        assert diff.mean() < 0.6, (k, diff.mean())
        assert np.percentile(diff, 99) < 6, (k, np.percentile(diff, 99))


@pytest.mark.parametrize("bgr, out_size, value_range, border", [
    (True, 96, (0.0, 1.0), "replicate"), (False, (64, 112), (-1.0, 1.0), "replicate"),
    (True, (64, 112), (-1.0, 1.0), "zero"), (False, 96, (0.0, 1.0), "zero")])
def test_on_the_cpu_a_crop_is_opencvs_warp_with_the_gathers_values(bgr, out_size, value_range, border):
    """Note [Crops on the CPU]: the crops of the CPU (warpAffine over the part of the frame they
    read; with a zero border, black where a sample is more than half a pixel beyond the frame)
    are the bilinear gathers' (CropTaps.crop, what a GPU runs) to float rounding, rotated, over
    the frame's edges and wholly beyond them, frames of two sizes."""
    frames = [skimage.data.astronaut(), skimage.data.coffee()]  # 512x512 and 400x600
    if bgr:
        frames = [np.ascontiguousarray(frame[..., ::-1]) for frame in frames]
    batch = roi.FrameBatch(frames, "cpu", bgr=bgr)
    specs = [  # frame, centre, width and height, rotation
        (0, (225.3, 130.7), (150.0, 150.0), math.radians(20)),
        (1, (300.0, 200.0), (260.0, 200.0), math.radians(-35)),
        (0, (480.0, 500.0), (120.0, 120.0), 0.3),  # over the bottom-right corner
        (1, (20.0, 390.0), (100.0, 100.0), 0.0),  # over the bottom-left corner of the shorter frame
        (1, (900.0, -300.0), (80.0, 80.0), 1.0),  # wholly beyond the frame: its corner replicated
    ]
    rects = roi.RotatedRects(torch.tensor([s[1] for s in specs]), torch.tensor([s[2] for s in specs]),
                             torch.tensor([s[3] for s in specs]))
    index = torch.tensor([s[0] for s in specs])
    warped = roi.crop_rois(batch, index, rects, out_size, border=border, value_range=value_range)
    gathered = roi.crop_taps(batch, index, rects, out_size, border=border, value_range=value_range).crop(batch)
    assert warped.shape == gathered.shape and warped.dtype == gathered.dtype == torch.float32
    grey = (value_range[1] - value_range[0]) / 255.0
    assert (warped - gathered).abs().max().item() < 0.01 * grey
    if border == "replicate":
        corner = frames[1][0, -1].astype(np.float32)[::-1 if bgr else 1]  # top-right, RGB
        assert np.allclose((warped[4].numpy() - value_range[0]) / grey, corner, atol=0.01)
    else:  # black beyond the frame, and the crops over its edges partly so
        assert (warped[4] == value_range[0]).all()
        assert ((warped[2:4] == value_range[0]).all(dim=-1).float().mean(dim=(1, 2)) > 0.05).all()


@pytest.mark.parametrize("bgr, out_size, value_range, border", [
    (True, 96, (0.0, 1.0), "replicate"), (False, (64, 112), (-1.0, 1.0), "replicate"),
    (True, (64, 112), (-1.0, 1.0), "zero")])
def test_on_the_cpu_a_crop_from_bytes_is_mediapipes_uint8_warp_then_floats(bgr, out_size, value_range,
                                                                          border):
    """Note [Face crops from bytes on the CPU]: with ``from_bytes`` a CPU crop is OpenCV's warp
    of the frame's uint8 RGB (MediaPipe's ImageToTensor on the CPU) made floats after it, over
    the frame's edges and beyond them, frames of two sizes; so within half a grey level of
    the float warp's crop, and not equal to it (the rounding is there)."""
    frames = [skimage.data.astronaut(), skimage.data.coffee()]  # RGB, 512x512 and 400x600
    batch = roi.FrameBatch([np.ascontiguousarray(f[..., ::-1]) for f in frames] if bgr else frames,
                           "cpu", bgr=bgr)
    specs = [  # frame, centre, width and height, rotation
        (0, (225.3, 130.7), (150.0, 150.0), math.radians(20)),
        (1, (300.0, 200.0), (260.0, 200.0), math.radians(-35)),
        (0, (480.0, 500.0), (120.0, 120.0), 0.3),  # over the bottom-right corner
        (1, (900.0, -300.0), (80.0, 80.0), 1.0),  # wholly beyond the frame
    ]
    rects = roi.RotatedRects(torch.tensor([s[1] for s in specs]), torch.tensor([s[2] for s in specs]),
                             torch.tensor([s[3] for s in specs]))
    index = torch.tensor([s[0] for s in specs])
    from_bytes = roi.crop_rois(batch, index, rects, out_size, border=border, value_range=value_range,
                               from_bytes=True)
    from_floats = roi.crop_rois(batch, index, rects, out_size, border=border, value_range=value_range)
    out_h, out_w = (out_size, out_size) if isinstance(out_size, int) else out_size
    low, high = value_range
    grey = (high - low) / 255.0
    for n, (k, (cx, cy), (w, h), angle) in enumerate(specs):
        cos, sin = math.cos(angle), math.sin(angle)
        to_frame = np.array([[cos * w / out_w, -sin * h / out_h, cx - 0.5 * cos * w + 0.5 * sin * h],
                             [sin * w / out_w, cos * h / out_h, cy - 0.5 * sin * w - 0.5 * cos * h]])
        warped = cv2.warpAffine(frames[k], to_frame, (out_w, out_h),
                                flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                                borderMode=cv2.BORDER_REPLICATE)
        expected = warped.astype(np.float32) * np.float32(grey) + np.float32(low)
        if border == "zero":  # the gathers' black beyond half a pixel, as the float warp's
            expected[(from_floats[n] == low).all(dim=-1).numpy()] = low
        # OpenCV's warp of a view into a batch's buffer and of a frame of its own rounded one
        # sample in 20,000 a grey level apart (seen); any other difference fails.
        apart = np.abs(from_bytes[n].numpy() - expected)
        assert apart.max() <= grey + 1e-6 and (apart > 1e-6).mean() < 1e-3, (n, apart.max())
    difference = (from_bytes - from_floats).abs()
    assert difference.max().item() <= 0.5 * grey + 1e-5 and difference.mean().item() > 0.1 * grey


def test_frames_in_one_buffer_are_cropped_where_they_lie_and_others_are_stacked():
    """FrameBatch.in_place (Note [A batch's frames in one buffer]): frames in rows of one
    buffer, a gap between them included, are used without a copy and crop exactly as a stacked
    batch; frames it cannot take where they lie are stacked."""
    astronaut = np.ascontiguousarray(skimage.data.astronaut()[:300, :400, ::-1])
    coffee = np.ascontiguousarray(skimage.data.coffee()[:200, :400, ::-1])
    buffer = torch.zeros(astronaut.nbytes + 4 * 400 * 3 + coffee.nbytes, dtype=torch.uint8)
    first = buffer[:astronaut.nbytes].view(astronaut.shape)
    second = buffer[-coffee.nbytes:].view(coffee.shape)  # 4 rows of gap: a frame refused
    first.copy_(torch.from_numpy(astronaut))
    second.copy_(torch.from_numpy(coffee))

    in_place = roi.FrameBatch.in_place([first, second], "cpu")
    assert in_place.pixels.data_ptr() == buffer.data_ptr()
    assert in_place.row_offsets_px == [0, 304] and in_place.sizes_hw == [(300, 400), (200, 400)]
    stacked = roi.FrameBatch([astronaut, coffee], "cpu")
    rects = roi.RotatedRects(torch.tensor([[200.0, 130.0], [200.0, 190.0], [390.0, 10.0]]),
                             torch.tensor([[150.0, 150.0], [180.0, 120.0], [60.0, 60.0]]),
                             torch.tensor([0.35, -0.5, 0.0]))
    index = torch.tensor([0, 1, 1])
    assert torch.equal(roi.crop_rois(in_place, index, rects, 64),
                       roi.crop_rois(stacked, index, rects, 64))

    # Not where they lie: another width, another buffer, out of order, a non-uint8 frame.
    narrow = torch.from_numpy(np.ascontiguousarray(coffee[:, :300]))
    for frames in ([first, narrow], [first, torch.from_numpy(coffee.copy())], [second, first]):
        batch = roi.FrameBatch.in_place(frames, "cpu")
        assert batch.pixels.data_ptr() != buffer.data_ptr()
        assert batch.row_offsets_px == [0, frames[0].shape[0]]
    with pytest.raises(ValueError, match="uint8"):
        roi.FrameBatch.in_place([first, second.float()], "cpu")

    # One frame (`facecast analyze` of one file): itself where it is contiguous uint8, with the
    # frame table of a stacked batch (made on first use on the CPU); else stacked.
    alone = roi.FrameBatch.in_place([second], "cpu")
    assert alone.pixels.data_ptr() == second.data_ptr() and alone.pixels.shape == second.shape
    assert alone.row_offsets_px == [0] and alone.sizes_hw == [(200, 400)]
    assert torch.equal(alone.frame_table, roi.FrameBatch([coffee], "cpu").frame_table)
    assert alone.row_offset.tolist() == [0.0] and alone.frame_hw.tolist() == [[200.0, 400.0]]
    assert torch.equal(roi.crop_rois(alone, torch.tensor([0, 0]), rects[1:], 64),
                       roi.crop_rois(stacked, torch.tensor([1, 1]), rects[1:], 64))
    strided = torch.from_numpy(coffee)[:, ::2]
    copied = roi.FrameBatch.in_place([strided], "cpu")
    assert copied.pixels.data_ptr() != strided.data_ptr() and torch.equal(copied.pixels, strided)
    with pytest.raises(ValueError, match="uint8"):
        roi.FrameBatch.in_place([second.float()], "cpu")


def test_crop_rois_zero_border_is_black():
    frame = np.full((100, 200, 3), 200, np.uint8)
    batch = roi.FrameBatch([frame], "cpu")
    rect = roi.RotatedRects(torch.tensor([[100.0, 50.0]]), torch.tensor([[200.0, 200.0]]), torch.zeros(1))
    crop = roi.crop_rois(batch, torch.zeros(1), rect, 64, border="zero")[0]
    assert crop[0, 32].sum() == 0 and crop[63, 32].sum() == 0  # letterbox bands
    assert torch.allclose(crop[32, 32], torch.full((3,), 200 / 255))


def test_crops_from_a_whole_frames_floats_are_the_crops_of_their_own_parts():
    """Note [A whole frame's floats once]: within a pass (one ``float_frames`` dict) crops that
    read most of their frame, the detectors' letterbox and whole-frame inputs of frames of two
    sizes among them, take their parts from one float copy of the frame, bit for bit the crops
    each part's own conversion gives; a small crop converts its own part; the dict holds the
    last frame's floats only."""
    astronaut = np.ascontiguousarray(skimage.data.astronaut()[:300, :480, ::-1])
    coffee = np.ascontiguousarray(skimage.data.coffee()[:240, :320, ::-1])
    for bgr in (True, False):
        batch = roi.FrameBatch([astronaut, coffee], "cpu", bgr=bgr)
        index = torch.tensor([0, 1, 0, 1, 0])
        rects = roi.RotatedRects(  # letterboxes, whole frames, and a face's ROI
            torch.tensor([[240.0, 150.0], [160.0, 120.0], [240.0, 150.0], [160.0, 120.0], [200.0, 130.0]]),
            torch.tensor([[480.0, 480.0], [320.0, 320.0], [480.0, 300.0], [320.0, 240.0], [90.0, 90.0]]),
            torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3]))
        for size in (64, (48, 80)):
            float_frames = {}
            for rows in ([0, 1], [2, 3], [4], [2], [3]):
                kept = torch.tensor(rows)
                for border, value_range in (("zero", (-1.0, 1.0)), ("replicate", (0.0, 1.0))):
                    expected = roi.crop_rois(batch, index[kept], rects[kept], size, border=border,
                                             value_range=value_range)
                    got = roi.crop_rois(batch, index[kept], rects[kept], size, border=border,
                                        value_range=value_range, float_frames=float_frames)
                    assert torch.equal(got, expected), (bgr, size, rows, border)
                assert len(float_frames) == 1
            only = next(iter(float_frames.values()))
            frame = coffee[..., ::-1] if bgr else coffee
            assert only.dtype == np.float32 and np.array_equal(only, frame.astype(np.float32))


def test_project_points_inverts_the_crop_mapping():
    rects = roi.RotatedRects(torch.tensor([[300.0, 200.0]]), torch.tensor([[120.0, 120.0]]),
                             torch.tensor([math.radians(40)]))
    # The crop's centre maps to the rect's centre, its top-left corner to the rect's corner.
    pts = torch.tensor([[[96.0, 96.0, 10.0], [0.0, 0.0, 0.0]]])
    out = roi.project_points(pts, rects, 192)
    assert torch.allclose(out[0, 0], torch.tensor([300.0, 200.0, 10.0 * 120 / 192]))
    assert torch.allclose(out[0, 1, :2], rects.corners_px()[0, 0], atol=1e-4)


def test_frame_batch_rejects_bad_frames():
    with pytest.raises(ValueError, match="frame 1 must be an HxWx3 uint8"):
        roi.FrameBatch([np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4), np.uint8)], "cpu")
    with pytest.raises(ValueError, match="uint8"):
        roi.FrameBatch(torch.zeros(1, 4, 4, 3), "cpu")


# -- head pose ------------------------------------------------------------------------------------


def _frontal_face() -> torch.Tensor:
    """Random points, with the ones head_pose reads placed so that the face frame is the
    camera frame (x right, y down, z forward)."""
    gen = torch.Generator().manual_seed(3)
    points = torch.randn(478, 3, generator=gen, dtype=torch.float64) * 40
    for k, (right, left) in enumerate(head_pose.SYMMETRIC_PAIRS):
        y, z = -30.0 + 25 * k, 5.0 * k
        points[right] = torch.tensor([-50.0 - 5 * k, y, z], dtype=torch.float64)
        points[left] = torch.tensor([50.0 + 5 * k, y, z], dtype=torch.float64)
    points[head_pose.FOREHEAD_INDEX] = torch.tensor([0.0, -90.0, 10.0], dtype=torch.float64)
    points[head_pose.CHIN_INDEX] = torch.tensor([0.0, 110.0, 10.0], dtype=torch.float64)
    return points


@pytest.mark.parametrize("yaw_pitch_roll", [(0, 0, 0), (25, 0, 0), (0, -20, 0), (0, 0, 35), (-40, 15, -60),
                                            (10, 30, 170)])
def test_head_pose_recovers_synthetic_rotations(yaw_pitch_roll):
    face = _frontal_face()
    rotation = head_pose.rotation_from_euler(torch.tensor([yaw_pitch_roll], dtype=torch.float64))[0]
    rotated = (face @ rotation.T * 1.7 + torch.tensor([640.0, 360.0, 0.0], dtype=torch.float64))[None]
    got = head_pose.head_pose_deg(rotated)[0].tolist()
    assert got == pytest.approx(list(yaw_pitch_roll), abs=1e-6)


def test_head_pose_sign_conventions():
    face = _frontal_face()
    # Subject's left cheek (image right, +x) comes toward the camera (smaller z): positive yaw.
    turned = face.clone()
    turned[:, 2] -= 0.3 * turned[:, 0]
    assert head_pose.head_pose_deg(turned[None])[0, 0] > 10
    # Subject's left eye lower on screen: positive roll.
    tilted = face.clone()
    tilted[:, 1] += 0.3 * tilted[:, 0]
    assert head_pose.head_pose_deg(tilted[None])[0, 2] > 10


def test_head_pose_rejects_short_landmark_lists():
    with pytest.raises(ValueError, match="468 or 478"):
        head_pose.head_pose_deg(torch.zeros(1, 68, 3))


# -- attention mesh decoding ----------------------------------------------------------------------


def test_refine_attention_mesh_overwrites_xy_and_averages_iris_depth():
    n = 2
    mesh = torch.arange(n * 468 * 3, dtype=torch.float32).reshape(n, 1, 1, 1404)
    lips = torch.full((n, 1, 1, 160), -1.0)
    left_eye = torch.full((n, 1, 1, 142), -2.0)
    right_eye = torch.full((n, 1, 1, 142), -3.0)
    left_iris = torch.full((n, 1, 1, 10), -4.0)
    right_iris = torch.full((n, 1, 1, 10), -5.0)
    flag = torch.tensor([0.0, 10.0]).reshape(n, 1, 1, 1)
    landmarks, presence = refine_attention_mesh((mesh, lips, left_eye, right_eye, left_iris, right_iris, flag))
    base = mesh.reshape(n, 468, 3)
    assert landmarks.shape == (n, 478, 3)
    assert torch.all(landmarks[:, list(LIPS_TO_MESH), :2] == -1)
    assert torch.all(landmarks[:, list(LEFT_EYE_TO_MESH), :2] == -2)
    assert torch.all(landmarks[:, list(RIGHT_EYE_TO_MESH), :2] == -3)
    assert torch.equal(landmarks[:, :468, 2], base[..., 2])  # z of refined points stays the mesh's
    untouched = sorted(set(range(468)) - set(LIPS_TO_MESH) - set(LEFT_EYE_TO_MESH) - set(RIGHT_EYE_TO_MESH))
    assert torch.equal(landmarks[:, untouched], base[:, untouched])
    contour = list(LEFT_EYE_TO_MESH[:16])
    assert torch.allclose(landmarks[:, 468:473, 2], base[:, contour, 2].mean(1, keepdim=True).expand(n, 5))
    assert torch.all(landmarks[:, 473:478, :2] == -5)
    assert presence.tolist() == pytest.approx([0.5, torch.sigmoid(torch.tensor(10.0)).item()])
    assert len(set(LIPS_TO_MESH)) == 80 and len(set(LEFT_EYE_TO_MESH)) == 71 and len(set(RIGHT_EYE_TO_MESH)) == 71


# -- GPU parity -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_nms_and_crops_match_cpu():
    gen = torch.Generator().manual_seed(11)
    centres = torch.rand(4, 60, 2, generator=gen) * 100
    boxes = torch.cat([centres - 8, centres + 8], dim=-1)
    scores = torch.rand(4, 60, generator=gen)
    keypoints = torch.rand(4, 60, 6, 2, generator=gen)
    cpu = nms.weighted_nms(boxes, scores, keypoints, scores > 0.2, 0.3, 10)
    gpu = nms.weighted_nms(boxes.cuda(), scores.cuda(), keypoints.cuda(), (scores > 0.2).cuda(), 0.3, 10)
    assert torch.equal(cpu.valid, gpu.valid.cpu())
    assert torch.allclose(cpu.boxes, gpu.boxes.cpu(), atol=1e-4)

    frames = torch.from_numpy(np.stack([skimage.data.astronaut()] * 3))
    rects = roi.RotatedRects(torch.tensor([[200.0, 150.0]] * 3), torch.tensor([[150.0, 150.0]] * 3),
                             torch.tensor([0.0, 0.5, -1.0]))
    index = torch.arange(3)
    on_cpu = roi.crop_rois(roi.FrameBatch(frames, "cpu"), index, rects, 192)
    on_gpu = roi.crop_rois(roi.FrameBatch(frames.cuda(), "cuda"), index, rects, 192)
    assert torch.allclose(on_cpu, on_gpu.cpu(), atol=1e-4)
