"""Weighted non-maximum suppression (MediaPipe's ``WEIGHTED`` algorithm), batched, plain torch.

MediaPipe's ``NonMaxSuppressionCalculator`` with ``algorithm: WEIGHTED`` works greedily on the
detections sorted by score: the best remaining detection leads a cluster made of every remaining
detection whose IoU with it is above the threshold (the leader included); the cluster is replaced
by one detection whose box corners and keypoints are the score-weighted means of the cluster's,
and whose score is the leader's; the cluster leaves the pool; repeat. Blending, rather than
keeping the leader's box, is what makes BlazeFace's boxes steady from frame to frame.

Here every image of the batch runs the same greedy loop at once: step t picks, per image, the
best detection not yet in a cluster (Note [Weighted NMS in few steps]). There are at most
``max_detections`` steps, each a handful of ``(B, N)`` tensor ops, and no host synchronisation,
so the whole thing can run on the GPU (and be captured in a CUDA graph) for any number of frames.

IoU is invariant under scaling each axis, so boxes may be in pixels or in normalized units.
:func:`box_iou` is facecast's one IoU (the detectors, the trackers, the duplicate filters of
:func:`drop_overlapping` and :func:`drop_overlapping_batched`, and workers/inference/tracking.py's track
ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import numpy as np
import torch

from facecast.models import triton_kernels

T = TypeVar("T")


@dataclass
class Detections:
    """Suppressed detections of a batch, padded to a fixed count per image.

    Slots are sorted by score, best first; ``valid`` says which slots hold a detection (invalid
    slots are zero).
    """

    boxes: torch.Tensor  # (B, M, 4) x1, y1, x2, y2
    keypoints: torch.Tensor  # (B, M, K, 2)
    scores: torch.Tensor  # (B, M)
    valid: torch.Tensor  # (B, M) bool

    def select(self, batch_index: int) -> "Detections":
        """The valid detections of one image, as a batch of one."""
        keep = self.valid[batch_index]
        return Detections(
            self.boxes[batch_index, keep][None],
            self.keypoints[batch_index, keep][None],
            self.scores[batch_index, keep][None],
            self.valid[batch_index, keep][None],
        )


def box_iou(boxes_a, boxes_b):
    """Pairwise IoU of x1,y1,x2,y2 boxes: ``(..., N, 4) x (..., M, 4) -> (..., N, M)``, torch
    tensors (on any device, inside a CUDA graph too) or numpy arrays (the same operations, for
    code on the host); both arguments of one kind.

    Boxes without area or without overlap give 0 (never NaN), as in MediaPipe's
    ``OverlapSimilarity``.
    """
    xp = torch if isinstance(boxes_a, torch.Tensor) else np
    a = boxes_a[..., :, None, :]
    b = boxes_b[..., None, :, :]
    inter_w = xp.clip(xp.minimum(a[..., 2], b[..., 2]) - xp.maximum(a[..., 0], b[..., 0]), 0, None)
    inter_h = xp.clip(xp.minimum(a[..., 3], b[..., 3]) - xp.maximum(a[..., 1], b[..., 1]), 0, None)
    intersection = inter_w * inter_h
    area_a = xp.clip(a[..., 2] - a[..., 0], 0, None) * xp.clip(a[..., 3] - a[..., 1], 0, None)
    area_b = xp.clip(b[..., 2] - b[..., 0], 0, None) * xp.clip(b[..., 3] - b[..., 1], 0, None)
    union = area_a + area_b - intersection
    return xp.where(union > 0, intersection / xp.clip(union, 1e-12, None), xp.zeros_like(union))


def box_pair_iou(box_a, box_b) -> float:
    """IoU of two single x1,y1,x2,y2 boxes (sequences of numbers): :func:`box_iou`'s arithmetic
    in plain floats, for code that compares a few boxes at a time (array calls would cost ten
    times the arithmetic there)."""
    ax1, ay1, ax2, ay2 = map(float, box_a)
    bx1, by1, bx2, by2 = map(float, box_b)
    intersection = max(min(ax2, bx2) - max(ax1, bx1), 0.0) * max(min(ay2, by2) - max(ay1, by1), 0.0)
    union = (max(ax2 - ax1, 0.0) * max(ay2 - ay1, 0.0) + max(bx2 - bx1, 0.0) * max(by2 - by1, 0.0)
             - intersection)
    return intersection / max(union, 1e-12) if union > 0 else 0.0


def drop_overlapping(items: Iterable[T], box_of: Callable[[T], object], score_of: Callable[[T], float],
                     max_iou: float) -> list[T]:
    """Greedy suppression of whole objects: the items best first by ``score_of``, each kept
    unless its box (``box_of``: x1,y1,x2,y2, a numpy array or a tensor, one kind per call)
    overlaps a kept one's by an IoU above ``max_iou``. Two ROIs that converged on one face or
    person (a track and a detection, or two tracks) → the more present one stays."""
    kept: list[T] = []
    kept_boxes: list = []
    for item in sorted(items, key=score_of, reverse=True):
        box = box_of(item)
        if any(box_iou(box[None], other[None])[0, 0] > max_iou for other in kept_boxes):
            continue
        kept.append(item)
        kept_boxes.append(box)
    return kept


def drop_overlapping_batched(boxes: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor,
                             eligible: torch.Tensor, max_iou: float, max_kept: int, max_group_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`drop_overlapping` for every group (a frame's faces) of a batch at once, as tensor
    operations on the boxes' device, with the same result: per group, the ``eligible`` items
    best first by ``scores`` (ties: the lower index first, as a stable sort leaves them), each
    kept unless its box overlaps a kept one's by an IoU above ``max_iou``; then the first
    ``max_kept`` of those kept.

    boxes (N, 4) x1, y1, x2, y2; scores (N,); groups (N,) integers; eligible (N,) bool;
    ``max_group_size``: at least the largest group's size (the host knows it; it sets the
    number of steps, so nothing here waits for the device). Returns (kept (N,) bool, rank (N,)
    long: a kept item's place in its group's list, best first).

    Note [The duplicate filter as tensors]
        The greedy filter is sequential within a group (whether an item is kept depends on the
        items kept before it) but a group is a frame's few faces. So: every pair's IoU at once,
        masked to pairs of one group where the first comes before the second; each item's place
        in its group's order; then one step per place, in which the items of that place in every
        group decide at once against the items kept so far (all of earlier places). The IoU is
        :func:`box_iou`'s arithmetic on the same float32 boxes, so the kept set is the one the
        per-item loop keeps, not merely a close one.
    """
    if boxes.is_cuda:  # Note [The duplicate filter in one kernel]
        fused = triton_kernels.drop_overlapping(boxes, scores, groups, eligible, max_iou, max_kept,
                                                max_group_size)
        if fused is not None:
            return fused
    count = boxes.shape[0]
    if max_group_size == 1:  # every item alone in its group: kept where eligible, first
        return eligible & (max_kept > 0), torch.zeros(count, dtype=torch.long, device=boxes.device)
    index = torch.arange(count, device=boxes.device)
    better = (scores[:, None] > scores[None, :]) | ((scores[:, None] == scores[None, :])
                                                    & (index[:, None] < index[None, :]))
    # before[j, i]: j is eligible and comes before i in i's group.
    before = (groups[:, None] == groups[None, :]) & eligible[:, None] & better
    place = before.sum(dim=0)
    blocks = before & (box_iou(boxes, boxes) > max_iou)
    kept = torch.zeros(count, dtype=torch.bool, device=boxes.device)
    for step in range(max_group_size):
        blocked = (blocks & kept[:, None]).any(dim=0)
        kept = kept | (eligible & (place == step) & ~blocked)
    rank = (before & kept[:, None]).sum(dim=0)
    return kept & (rank < max_kept), rank


def drop_overlapping_on_host(boxes: np.ndarray, scores: np.ndarray, groups: np.ndarray, eligible: np.ndarray,
                             max_iou: float, max_kept: int, max_group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`drop_overlapping_batched` in numpy, step for step (the same IoU arithmetic: the
    same kept set and ranks; Note [The CPU stack's results in numpy], models/face_mesh.py): a
    frame of four faces took ~100 torch calls there, ~25 numpy calls here. Returns (kept (N,)
    bool, rank (N,) int64)."""
    count = boxes.shape[0]
    if max_group_size == 1:  # every item alone in its group: kept where eligible, first
        return eligible & (max_kept > 0), np.zeros(count, np.int64)
    index = np.arange(count)
    better = (scores[:, None] > scores[None, :]) | ((scores[:, None] == scores[None, :])
                                                    & (index[:, None] < index[None, :]))
    before = (groups[:, None] == groups[None, :]) & eligible[:, None] & better
    place = before.sum(axis=0)
    blocks = before & (box_iou(boxes, boxes) > max_iou)
    kept = np.zeros(count, bool)
    for step in range(max_group_size):
        blocked = (blocks & kept[:, None]).any(axis=0)
        kept = kept | (eligible & (place == step) & ~blocked)
    rank = (before & kept[:, None]).sum(axis=0)
    return kept & (rank < max_kept), rank


def weighted_nms(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    keypoints: torch.Tensor,
    valid: torch.Tensor,
    iou_threshold: float,
    max_detections: int,
    max_candidates: int = 512,
) -> Detections:
    """Weighted NMS of a batch.

    boxes ``(B, A, 4)``, scores ``(B, A)``, keypoints ``(B, A, K, 2)`` (K may be 0), valid
    ``(B, A)`` bool (typically ``scores >= min_score``). A detection joins a cluster when its IoU
    with the leader is strictly above ``iou_threshold``.

    Only the ``max_candidates`` best valid detections of each image take part: a detector's
    anchors above threshold number a few per object, so the limit only matters for a frame with
    more than ~50 faces; raise it there.
    """
    return weighted_nms_of_parts([(boxes, scores, keypoints, valid)], iou_threshold, max_detections,
                                 max_candidates)[0]


def weighted_nms_of_parts(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    iou_threshold: float,
    max_detections: int,
    max_candidates: int = 512,
) -> list[Detections]:
    """:func:`weighted_nms` of several batches at once (Note [One NMS for both detectors]), each
    part (boxes, scores, keypoints, valid) as :func:`weighted_nms` takes them: the parts may
    have different anchor and batch counts but one keypoint count. The same results as one
    :func:`weighted_nms` call per part, in the parts' order.

    Note [One NMS for both detectors]
        The clustering loop is one step per output slot whatever the batch, each a handful of
        small kernels, and the detection pass ran it once per detector (the short-range one and
        the full-range one per input shape) with the same threshold: 204 kernels, 1.4 ms of a
        7.6 ms pass over 32 1080p frames on an H100 (2026-11-26), hardly any of it arithmetic.
        Each part's candidates are chosen on its own (its best ``max_candidates``), padded to
        one count with invalid candidates (which never lead and never join), and the rows of all
        parts are clustered in one loop: a row's clusters depend on that row alone, so the
        results are those of the separate calls.
    """
    if not parts:
        return []
    if max_detections < 1:
        raise ValueError(f"max_detections must be at least 1, got {max_detections}")
    candidates = [_candidates(*part, max_candidates) for part in parts]
    num_kept = max(c[0].shape[1] for c in candidates)
    if len({c[2].shape[2] for c in candidates}) > 1:
        raise ValueError("the parts must have one keypoint count, got "
                         f"{sorted({c[2].shape[2] for c in candidates})}")
    rows = [len(c[0]) for c in candidates]
    cand_boxes, cand_scores, cand_keypoints, cand_valid = (
        torch.cat([_pad_candidates(c[field], num_kept) for c in candidates])
        for field in range(4))
    found = _clusters(cand_boxes, cand_scores, cand_keypoints, cand_valid, iou_threshold, max_detections)
    return [Detections(*fields) for fields in zip(*(torch.split(field, rows) for field in (
        found.boxes, found.keypoints, found.scores, found.valid)))]


def _candidates(boxes: torch.Tensor, scores: torch.Tensor, keypoints: torch.Tensor, valid: torch.Tensor,
                max_candidates: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each image's best ``max_candidates`` valid detections, best first: (boxes, scores,
    keypoints, valid) of (B, C) candidates; invalid ones score 0 and sort last."""
    if boxes.dim() != 3 or boxes.shape[-1] != 4:
        raise ValueError(f"boxes must be (batch, anchors, 4), got {tuple(boxes.shape)}")
    batch, num_anchors = boxes.shape[:2]
    if scores.shape != (batch, num_anchors) or valid.shape != (batch, num_anchors):
        raise ValueError(
            f"scores and valid must be {(batch, num_anchors)}, got {tuple(scores.shape)} and {tuple(valid.shape)}"
        )
    if keypoints.shape[:2] != (batch, num_anchors):
        raise ValueError(f"keypoints must be ({batch}, {num_anchors}, K, 2), got {tuple(keypoints.shape)}")
    num_keypoints = keypoints.shape[2]
    # Sort valid detections first, by score; invalid ones get -inf so that they sort last and
    # can never lead a cluster.
    masked_scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    num_kept = min(max_candidates, num_anchors)
    top_scores, order = masked_scores.topk(num_kept, dim=1, sorted=True)
    cand_boxes = boxes.gather(1, order[..., None].expand(-1, -1, 4))
    cand_keypoints = keypoints.gather(1, order[..., None, None].expand(-1, -1, num_keypoints, 2))
    cand_valid = torch.isfinite(top_scores)
    cand_scores = torch.where(cand_valid, top_scores, torch.zeros_like(top_scores))
    return cand_boxes, cand_scores, cand_keypoints, cand_valid


def _pad_candidates(field: torch.Tensor, count: int) -> torch.Tensor:
    """A candidate field (B, C, ...) padded with zeros (invalid, score 0) to (B, count, ...)."""
    missing = count - field.shape[1]
    if missing == 0:
        return field
    return torch.cat([field, field.new_zeros((field.shape[0], missing, *field.shape[2:]))], dim=1)


def _clusters(cand_boxes: torch.Tensor, cand_scores: torch.Tensor, cand_keypoints: torch.Tensor,
              cand_valid: torch.Tensor, iou_threshold: float, max_detections: int) -> Detections:
    """The greedy clustering of sorted candidates and each cluster's blend (on a GPU in one
    kernel: Note [Weighted NMS in one kernel])."""
    if cand_boxes.is_cuda:
        fused = triton_kernels.nms_clusters(cand_boxes, cand_scores, cand_keypoints, cand_valid,
                                            iou_threshold, max_detections)
        if fused is not None:
            boxes, keypoints, scores, valid = fused
            return Detections(boxes=boxes, keypoints=keypoints, scores=scores, valid=valid)
    num_kept = cand_boxes.shape[1]
    # same_face[b, i, j]: j joins a cluster that i leads. A leader always belongs to its own
    # cluster, even a degenerate one with zero area (whose IoU with itself is 0).
    same_face = (box_iou(cand_boxes, cand_boxes) > iou_threshold) | torch.eye(
        num_kept, dtype=torch.bool, device=cand_boxes.device)
    # Note [Weighted NMS in few steps]
    #     The greedy part is only the choice of leaders: one step per output slot, in which each
    #     image's best detection not yet in a cluster (candidates are sorted, and argmax returns
    #     the first maximum, which keeps ties in MediaPipe's order) leads, and its cluster is
    #     every unclustered detection whose IoU with it is above the threshold: a gather of its
    #     row and an AND. The blending needs no step of its own: after the loop every cluster's
    #     weighted means are taken at once over the (B, slots, N) membership; a cluster's score
    #     is its leader's, which is its best member's. A slot with no detection left gets an
    #     empty cluster. (One step cost 22 operations before issue 24, now 6: a detection pass
    #     over both detectors ran ~440 operations in its NMS, a CUDA graph launching each.)
    unclustered = cand_valid.clone()
    clusters = []
    for _ in range(max_detections):  # fixed count: shapes never depend on the data
        leader = unclustered.to(torch.uint8).argmax(dim=1)
        members = same_face.gather(1, leader[:, None, None].expand(-1, 1, num_kept))[:, 0] & unclustered
        clusters.append(members)
        unclustered &= ~members
    members = torch.stack(clusters, dim=1)  # (B, slots, N)
    weights = cand_scores[:, None, :] * members  # 0 outside the cluster (and for an empty slot)
    total = weights.sum(dim=2).clamp(min=1e-12)[..., None]
    return Detections(
        boxes=(weights[..., None] * cand_boxes[:, None]).sum(dim=2) / total,
        keypoints=(weights[..., None, None] * cand_keypoints[:, None]).sum(dim=2) / total[..., None],
        scores=weights.amax(dim=2),  # the leader's: its cluster's best (scores are probabilities)
        valid=members.any(dim=2),
    )
