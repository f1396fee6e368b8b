"""The code of facecast's Triton kernels (Note [Kernels of our own]; triton_kernels.py launches
them): imported only where they are to run, since importing it imports Triton. Triton
resolves the functions a kernel calls among this module's globals, and decides at their
definition (this module's import) whether they are compiled or interpreted (TRITON_INTERPRET=1).
The kernels' names start with facecast_: a profile names its kernels by them
(bench/model_stages.py gives each to its step by its name)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["pixels", "row_bytes", "frame_table", "frame_index", "index_stride",
                               "centre", "size", "rotation", "out", "out_h", "out_w", "scale", "low"])
def facecast_crop(pixels, row_bytes, frame_table, frame_index, index_stride, centre, size, rotation, out,
                  out_h, out_w, scale, low,
                  ZERO_BORDER: tl.constexpr, BGR: tl.constexpr, BLOCK: tl.constexpr):
    """roi.crop_rois of BLOCK output pixels of one crop (Note [One kernel for a batch of crops]);
    the crop's frame is frame_index[n * index_stride], integers or whole floats."""
    n = tl.program_id(1)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_crop = p < out_h * out_w
    i = p // out_w
    j = p - i * out_w
    # The rect and its frame (FrameBatch.frame_table: row offset, height, width).
    k = tl.load(frame_index + n * index_stride).to(tl.int32)
    row_offset = tl.load(frame_table + k * 3)
    max_y = tl.load(frame_table + k * 3 + 1) - 1
    max_x = tl.load(frame_table + k * 3 + 2) - 1
    centre_x, centre_y = tl.load(centre + n * 2), tl.load(centre + n * 2 + 1)
    width, height = tl.load(size + n * 2), tl.load(size + n * 2 + 1)
    angle = tl.load(rotation + n)
    cos, sin = tl.cos(angle), tl.sin(angle)
    # Output pixel (j, i) samples centre + R(angle) · ((j / W − ½)·w, (i / H − ½)·h).
    along_u = (tl.math.div_rn(j.to(tl.float32), out_w.to(tl.float32)) - 0.5) * width
    along_v = (tl.math.div_rn(i.to(tl.float32), out_h.to(tl.float32)) - 0.5) * height
    x = cos * along_u - sin * along_v + centre_x
    y = sin * along_u + cos * along_v + centre_y
    if ZERO_BORDER:  # before the clamping: a sample more than half a pixel out is black
        inside_x = ((x >= -0.5) & (x <= max_x + 0.5)).to(tl.float32)
        inside_y = ((y >= -0.5) & (y <= max_y + 0.5)).to(tl.float32)
    x = tl.minimum(tl.maximum(x, 0.0), max_x)
    y = tl.minimum(tl.maximum(y, 0.0), max_y)
    x0 = tl.floor(x)
    y0 = tl.floor(y)
    weight_right = x - x0
    weight_down = y - y0
    weight_left = 1 - weight_right
    weight_up = (1 - weight_down) * scale
    weight_down = weight_down * scale
    if ZERO_BORDER:
        weight_left, weight_right = weight_left * inside_x, weight_right * inside_x
        weight_up, weight_down = weight_up * inside_y, weight_down * inside_y
    # The taps' bytes: the right and lower neighbours stay inside the frame (crop_taps).
    left = x0.to(tl.int64) * 3
    right = left + (x0 < max_x).to(tl.int64) * 3
    up = (y0 + row_offset).to(tl.int64) * row_bytes
    down = up + (y0 < max_y).to(tl.int64) * row_bytes
    base = out + (n.to(tl.int64) * out_h * out_w + p) * 3
    for channel in tl.static_range(3):
        source = 2 - channel if BGR else channel
        up_left = tl.load(pixels + up + left + source, mask=in_crop, other=0).to(tl.float32)
        up_right = tl.load(pixels + up + right + source, mask=in_crop, other=0).to(tl.float32)
        down_left = tl.load(pixels + down + left + source, mask=in_crop, other=0).to(tl.float32)
        down_right = tl.load(pixels + down + right + source, mask=in_crop, other=0).to(tl.float32)
        value = (up_left * weight_left + up_right * weight_right) * weight_up
        value += (down_left * weight_left + down_right * weight_right) * weight_down
        tl.store(base + channel, value + low, mask=in_crop)


@triton.jit
def iou_with_one(x1, y1, x2, y2, area, one):
    """IoU of the box where ``one`` is true with each box of the row: box_iou's
    arithmetic (its two areas' sum is the same in either order)."""
    one_x1 = tl.sum(tl.where(one, x1, 0.0), axis=0)
    one_y1 = tl.sum(tl.where(one, y1, 0.0), axis=0)
    one_x2 = tl.sum(tl.where(one, x2, 0.0), axis=0)
    one_y2 = tl.sum(tl.where(one, y2, 0.0), axis=0)
    one_area = tl.sum(tl.where(one, area, 0.0), axis=0)
    inter_w = tl.maximum(tl.minimum(one_x2, x2) - tl.maximum(one_x1, x1), 0.0)
    inter_h = tl.maximum(tl.minimum(one_y2, y2) - tl.maximum(one_y1, y1), 0.0)
    intersection = inter_w * inter_h
    union = one_area + area - intersection
    return tl.where(union > 0, tl.math.div_rn(intersection, tl.maximum(union, 1e-12)), 0.0)


@triton.jit(do_not_specialize=["boxes", "scores", "keypoints", "valid", "out_boxes",
                               "out_keypoints", "out_scores", "out_valid", "candidates",
                               "coords", "threshold"])
def facecast_nms_clusters(boxes, scores, keypoints, valid, out_boxes, out_keypoints, out_scores,
                          out_valid, candidates, coords, threshold,
                          SLOTS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """nms._clusters of one row of sorted candidates (Note [Weighted NMS in one kernel])."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    in_row = c < candidates
    first = row * candidates + c
    x1 = tl.load(boxes + first * 4, mask=in_row, other=0.0)
    y1 = tl.load(boxes + first * 4 + 1, mask=in_row, other=0.0)
    x2 = tl.load(boxes + first * 4 + 2, mask=in_row, other=0.0)
    y2 = tl.load(boxes + first * 4 + 3, mask=in_row, other=0.0)
    score = tl.load(scores + first, mask=in_row, other=0.0)
    unclustered = tl.load(valid + first, mask=in_row, other=0) != 0
    q = tl.arange(0, BLOCK_K)
    point_mask = in_row[:, None] & (q < coords)[None, :]
    points = tl.load(keypoints + first[:, None] * coords + q[None, :], mask=point_mask, other=0.0)
    area = tl.maximum(x2 - x1, 0.0) * tl.maximum(y2 - y1, 0.0)
    for slot in tl.static_range(SLOTS):
        # The leader: the first unclustered candidate (argmax of a 0/1 row, 0 if none).
        leader = tl.min(tl.where(unclustered, c, BLOCK_C), axis=0)
        leader = tl.where(leader == BLOCK_C, 0, leader)
        is_leader = c == leader
        iou = iou_with_one(x1, y1, x2, y2, area, is_leader)
        members = ((iou > threshold) | is_leader) & unclustered
        unclustered = unclustered & ~members
        weights = tl.where(members, score, 0.0)
        total = tl.maximum(tl.sum(weights, axis=0), 1e-12)
        slot_at = row * SLOTS + slot
        tl.store(out_boxes + slot_at * 4, tl.math.div_rn(tl.sum(weights * x1, axis=0), total))
        tl.store(out_boxes + slot_at * 4 + 1, tl.math.div_rn(tl.sum(weights * y1, axis=0), total))
        tl.store(out_boxes + slot_at * 4 + 2, tl.math.div_rn(tl.sum(weights * x2, axis=0), total))
        tl.store(out_boxes + slot_at * 4 + 3, tl.math.div_rn(tl.sum(weights * y2, axis=0), total))
        blended = tl.sum(weights[:, None] * points, axis=0)
        tl.store(out_keypoints + slot_at * coords + q, tl.math.div_rn(blended, total), mask=q < coords)
        tl.store(out_scores + slot_at, tl.max(weights, axis=0))
        tl.store(out_valid + slot_at, tl.max(members.to(tl.int32), axis=0) > 0)


@triton.jit(do_not_specialize=["boxes", "scores", "groups", "eligible", "kept", "rank",
                               "count", "max_iou", "max_kept"])
def facecast_duplicates(boxes, scores, groups, eligible, kept, rank, count, max_iou, max_kept,
                        STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """nms.drop_overlapping_batched's answer for one face: its frame decided greedily here
    (Note [The duplicate filter in one kernel])."""
    me = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    in_batch = j < count
    x1 = tl.load(boxes + j * 4, mask=in_batch, other=0.0)
    y1 = tl.load(boxes + j * 4 + 1, mask=in_batch, other=0.0)
    x2 = tl.load(boxes + j * 4 + 2, mask=in_batch, other=0.0)
    y2 = tl.load(boxes + j * 4 + 3, mask=in_batch, other=0.0)
    score = tl.load(scores + j, mask=in_batch, other=0.0)
    group = tl.load(groups + j, mask=in_batch, other=0)
    my_group = tl.load(groups + me)
    my_score = tl.load(scores + me)
    mates = in_batch & (group == my_group)
    undecided = mates & (tl.load(eligible + j, mask=in_batch, other=0) != 0)
    area = tl.maximum(x2 - x1, 0.0) * tl.maximum(y2 - y1, 0.0)
    is_kept = j < 0  # all False
    for step in tl.static_range(STEPS):
        # The best undecided face of the frame: the highest score, ties the lower index.
        best = tl.max(tl.where(undecided, score, float("-inf")), axis=0)
        first = tl.min(tl.where(undecided & (score == best), j, BLOCK_N), axis=0)
        chosen = j == first  # none once every face is decided (first == BLOCK_N)
        iou = iou_with_one(x1, y1, x2, y2, area, chosen)  # against every face kept so far
        blocked = tl.max((is_kept & (iou > max_iou)).to(tl.int32), axis=0) > 0
        is_kept = is_kept | (chosen & ~blocked)
        undecided = undecided & ~chosen
    # Its rank: the kept faces of its frame that come before it.
    before = (score > my_score) | ((score == my_score) & (j < me))
    my_rank = tl.sum((is_kept & mates & before).to(tl.int64), axis=0)
    me_kept = tl.max((is_kept & (j == me)).to(tl.int32), axis=0) > 0
    tl.store(kept + me, me_kept & (my_rank < max_kept))
    tl.store(rank + me, my_rank)


@triton.jit(do_not_specialize=["raw_boxes", "raw_scores", "anchors", "centre", "size",
                               "rotation", "boxes", "scores", "keypoints", "valid", "count",
                               "coords", "input_h", "input_w", "coord_scale", "anchor_size",
                               "min_score"])
def facecast_decode(raw_boxes, raw_scores, anchors, centre, size, rotation, boxes, scores, keypoints,
                    valid, count, coords, input_h, input_w, coord_scale, anchor_size, min_score,
                    KEYPOINTS: tl.constexpr, BLOCK: tl.constexpr):
    """FaceDetector.decode of BLOCK anchors of one input (Note [Detections decoded in one
    kernel])."""
    row = tl.program_id(1).to(tl.int64)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_row = a < count
    first = row * count + a
    raw = raw_boxes + first * coords
    anchor_x = tl.load(anchors + a * 2, mask=in_row, other=0.0)
    anchor_y = tl.load(anchors + a * 2 + 1, mask=in_row, other=0.0)
    centre_x, centre_y = tl.load(centre + row * 2), tl.load(centre + row * 2 + 1)
    width, height = tl.load(size + row * 2), tl.load(size + row * 2 + 1)
    angle = tl.load(rotation + row)
    cos, sin = tl.cos(angle), tl.sin(angle)
    # anchors.decode: centre over the scale plus the anchor, half the size over the scale.
    box_x = tl.load(raw, mask=in_row, other=0.0).to(tl.float32) / coord_scale + anchor_x
    box_y = tl.load(raw + 1, mask=in_row, other=0.0).to(tl.float32) / coord_scale + anchor_y
    half_w = tl.load(raw + 2, mask=in_row, other=0.0).to(tl.float32) / coord_scale / 2
    half_h = tl.load(raw + 3, mask=in_row, other=0.0).to(tl.float32) / coord_scale / 2
    # roi.project_points of decoded * the anchors' input size: over the input's size, less
    # a half, times the rect's size, rotated onto the frame about the rect's centre.
    for corner in tl.static_range(2):
        sign = -1.0 if corner == 0 else 1.0
        u = (box_x + sign * half_w) * anchor_size / input_w - 0.5
        v = (box_y + sign * half_h) * anchor_size / input_h - 0.5
        u, v = u * width, v * height
        tl.store(boxes + first * 4 + corner * 2, cos * u - sin * v + centre_x, mask=in_row)
        tl.store(boxes + first * 4 + corner * 2 + 1, sin * u + cos * v + centre_y, mask=in_row)
    for point in tl.static_range(KEYPOINTS):
        u = (tl.load(raw + 4 + point * 2, mask=in_row, other=0.0).to(tl.float32) / coord_scale
             + anchor_x) * anchor_size / input_w - 0.5
        v = (tl.load(raw + 5 + point * 2, mask=in_row, other=0.0).to(tl.float32) / coord_scale
             + anchor_y) * anchor_size / input_h - 0.5
        u, v = u * width, v * height
        at = keypoints + (first * KEYPOINTS + point) * 2
        tl.store(at, cos * u - sin * v + centre_x, mask=in_row)
        tl.store(at + 1, sin * u + cos * v + centre_y, mask=in_row)
    logit = tl.load(raw_scores + first, mask=in_row, other=0.0).to(tl.float32)
    score = 1.0 / (1.0 + tl.exp(-tl.minimum(tl.maximum(logit, -100.0), 100.0)))
    tl.store(scores + first, score, mask=in_row)
    tl.store(valid + first, score >= min_score, mask=in_row)


@triton.jit
def _masked_sum(values, mask):
    return tl.sum(tl.where(mask, values, 0.0), axis=0)


@triton.jit
def _fit(tx, ty, tz, weights, wc_x, wc_y, wc_z, centre_x, centre_y, centre_z, variance,
         SQUARINGS: tl.constexpr, EVERY: tl.constexpr):
    """ProcrustesSource.fit of one face's target points (tx, ty, tz over the fit's points),
    best_rotation by squaring: (scale, the rotation's nine entries row by row, translation)."""
    target_x, target_y, target_z = tl.sum(weights * tx, 0), tl.sum(weights * ty, 0), tl.sum(weights * tz, 0)
    # C[a][b] = Σ_k target_k[a] (w (source - centre))_k[b]; S = Cᵀ (Horn's S, row-major).
    c_xx, c_xy, c_xz = tl.sum(tx * wc_x, 0), tl.sum(tx * wc_y, 0), tl.sum(tx * wc_z, 0)
    c_yx, c_yy, c_yz = tl.sum(ty * wc_x, 0), tl.sum(ty * wc_y, 0), tl.sum(ty * wc_z, 0)
    c_zx, c_zy, c_zz = tl.sum(tz * wc_x, 0), tl.sum(tz * wc_y, 0), tl.sum(tz * wc_z, 0)
    s_xx, s_xy, s_xz = c_xx, c_yx, c_zx
    s_yx, s_yy, s_yz = c_xy, c_yy, c_zy
    s_zx, s_zy, s_zz = c_xz, c_yz, c_zz
    # Horn's N (face_geometry._HORN_UPPER), shifted by √3·|S| (Note [Procrustes without a solver]).
    shift = 1.7320508075688772 * tl.sqrt(s_xx * s_xx + s_xy * s_xy + s_xz * s_xz + s_yx * s_yx + s_yy * s_yy
                                         + s_yz * s_yz + s_zx * s_zx + s_zy * s_zy + s_zz * s_zz)
    r = tl.arange(0, 4)[:, None]
    c = tl.arange(0, 4)[None, :]
    n01, n02, n03 = s_yz - s_zy, s_zx - s_xz, s_xy - s_yx
    n12, n13, n23 = s_xy + s_yx, s_zx + s_xz, s_yz + s_zy
    powered = (tl.where((r == 0) & (c == 0), s_xx + s_yy + s_zz + shift, 0.0)
               + tl.where((r == 1) & (c == 1), s_xx - s_yy - s_zz + shift, 0.0)
               + tl.where((r == 2) & (c == 2), -s_xx + s_yy - s_zz + shift, 0.0)
               + tl.where((r == 3) & (c == 3), -s_xx - s_yy + s_zz + shift, 0.0)
               + tl.where(((r == 0) & (c == 1)) | ((r == 1) & (c == 0)), n01, 0.0)
               + tl.where(((r == 0) & (c == 2)) | ((r == 2) & (c == 0)), n02, 0.0)
               + tl.where(((r == 0) & (c == 3)) | ((r == 3) & (c == 0)), n03, 0.0)
               + tl.where(((r == 1) & (c == 2)) | ((r == 2) & (c == 1)), n12, 0.0)
               + tl.where(((r == 1) & (c == 3)) | ((r == 3) & (c == 1)), n13, 0.0)
               + tl.where(((r == 2) & (c == 3)) | ((r == 3) & (c == 2)), n23, 0.0))
    for step in tl.static_range(SQUARINGS):
        if step % EVERY == 0:  # trace 1 again (a zero matrix stays zero)
            trace = tl.sum(tl.sum(tl.where(r == c, powered, 0.0), axis=1), axis=0)
            powered = powered / tl.maximum(trace, 2.2250738585072014e-308)
        powered = tl.sum(powered[:, :, None] * powered[None, :, :], axis=1)
    diagonal = tl.sum(tl.where(r == c, powered, 0.0), axis=1)  # (4,) by row
    index = tl.arange(0, 4)
    column = tl.min(tl.where(diagonal == tl.max(diagonal, 0), index, 4), 0)
    quaternion = tl.sum(tl.where(c == column, powered, 0.0), axis=1)
    norm = tl.sqrt(tl.sum(quaternion * quaternion, 0))
    unit = tl.where(norm > 0, quaternion / tl.maximum(norm, 2.2250738585072014e-308),
                    tl.where(index == 0, 1.0, 0.0))
    w, x, y, z = (_masked_sum(unit, index == 0), _masked_sum(unit, index == 1),
                  _masked_sum(unit, index == 2), _masked_sum(unit, index == 3))
    # face_geometry.QUATERNION_ROTATION.
    r00, r01, r02 = w * w + x * x - y * y - z * z, 2 * x * y - 2 * w * z, 2 * x * z + 2 * w * y
    r10, r11, r12 = 2 * x * y + 2 * w * z, w * w - x * x + y * y - z * z, 2 * y * z - 2 * w * x
    r20, r21, r22 = 2 * x * z - 2 * w * y, 2 * y * z + 2 * w * x, w * w - x * x - y * y + z * z
    scale = (r00 * c_xx + r01 * c_xy + r02 * c_xz + r10 * c_yx + r11 * c_yy + r12 * c_yz
             + r20 * c_zx + r21 * c_zy + r22 * c_zz) / variance
    t_x = target_x - scale * (r00 * centre_x + r01 * centre_y + r02 * centre_z)
    t_y = target_y - scale * (r10 * centre_x + r11 * centre_y + r12 * centre_z)
    t_z = target_z - scale * (r20 * centre_x + r21 * centre_y + r22 * centre_z)
    return scale, r00, r01, r02, r10, r11, r12, r20, r21, r22, t_x, t_y, t_z


@triton.jit(do_not_specialize=["landmarks", "frame_wh", "used", "weights", "weighted_centred",
                               "source_centre", "variance", "out", "points", "used_count", "planes"])
def facecast_face_matrices(landmarks, frame_wh, used, weights, weighted_centred, source_centre,
                           variance, out, points, used_count, planes,
                           MESH: tl.constexpr, BLOCK_MESH: tl.constexpr, BLOCK_K: tl.constexpr,
                           SQUARINGS: tl.constexpr, EVERY: tl.constexpr):
    """FaceGeometry.matrices of one face (Note [Face geometry as MediaPipe computes it])."""
    face = tl.program_id(0).to(tl.int64)
    mesh = landmarks + face * points * 3
    near, near_height = tl.load(planes), tl.load(planes + 1)  # float64 (not float32 arguments)
    width = tl.load(frame_wh + face * 2)
    height = tl.load(frame_wh + face * 2 + 1)
    near_width = near_height * width / height
    per_x = near_width / width
    per_y = -near_height / height
    # The mean depth of the MESH points, on x's scale.
    m = tl.arange(0, BLOCK_MESH)
    depth_sum = tl.sum(tl.load(mesh + m * 3 + 2, mask=m < MESH, other=0.0).to(tl.float64), 0)
    depth_offset = depth_sum / MESH * per_x
    k = tl.arange(0, BLOCK_K)
    in_fit = k < used_count
    point = tl.load(used + k, mask=in_fit, other=0)
    # The fit's points on the near plane (x/W, y/H, z/W; y flipped), as FaceGeometry.matrices.
    screen_x = tl.where(in_fit, -near_width / 2 + tl.load(mesh + point * 3, mask=in_fit, other=0.0)
                        .to(tl.float64) * per_x, 0.0)
    screen_y = tl.where(in_fit, near_height / 2 + tl.load(mesh + point * 3 + 1, mask=in_fit, other=0.0)
                        .to(tl.float64) * per_y, 0.0)
    screen_z = tl.load(mesh + point * 3 + 2, mask=in_fit, other=0.0).to(tl.float64) * per_x
    wk = tl.load(weights + k, mask=in_fit, other=0.0)
    wc_x = tl.load(weighted_centred + k * 3, mask=in_fit, other=0.0)
    wc_y = tl.load(weighted_centred + k * 3 + 1, mask=in_fit, other=0.0)
    wc_z = tl.load(weighted_centred + k * 3 + 2, mask=in_fit, other=0.0)
    centre_x, centre_y, centre_z = tl.load(source_centre), tl.load(source_centre + 1), tl.load(source_centre + 2)
    spread = tl.load(variance)
    # The three fits of FaceGeometry.matrices: the screen points (z flipped), then twice the
    # points unprojected at the scale so far. Lanes past the fit's points are 0 throughout.
    first = _fit(screen_x, screen_y, -screen_z, wk, wc_x, wc_y, wc_z, centre_x, centre_y, centre_z, spread,
                 SQUARINGS, EVERY)[0]
    depth = tl.where(in_fit, (screen_z - depth_offset + near) / first, 0.0)
    second = _fit(screen_x * (depth / near), screen_y * (depth / near), -depth, wk, wc_x, wc_y, wc_z,
                  centre_x, centre_y, centre_z, spread, SQUARINGS, EVERY)[0]
    depth = tl.where(in_fit, (screen_z - depth_offset + near) / (first * second), 0.0)
    scale, r00, r01, r02, r10, r11, r12, r20, r21, r22, t_x, t_y, t_z = _fit(
        screen_x * (depth / near), screen_y * (depth / near), -depth, wk, wc_x, wc_y, wc_z,
        centre_x, centre_y, centre_z, spread, SQUARINGS, EVERY)
    at = out + face * 16
    tl.store(at + 0, scale * r00)
    tl.store(at + 1, scale * r01)
    tl.store(at + 2, scale * r02)
    tl.store(at + 3, t_x)
    tl.store(at + 4, scale * r10)
    tl.store(at + 5, scale * r11)
    tl.store(at + 6, scale * r12)
    tl.store(at + 7, t_y)
    tl.store(at + 8, scale * r20)
    tl.store(at + 9, scale * r21)
    tl.store(at + 10, scale * r22)
    tl.store(at + 11, t_z)
    tl.store(at + 12, 0.0)
    tl.store(at + 13, 0.0)
    tl.store(at + 14, 0.0)
    tl.store(at + 15, 1.0)


@triton.jit(do_not_specialize=["x", "gamma", "out", "positions", "height", "width", "stride_n",
                               "stride_c", "stride_h", "stride_w", "channels", "eps"])
def facecast_layer_norm(x, gamma, out, positions, height, width, stride_n, stride_c, stride_h, stride_w,
                        channels, eps, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """tflite_ops.LayerNormOverChannels of BLOCK_P positions: x (N, C, H, W) normalised over C,
    read and written at x's strides (``out`` has them too), in the chain's order of operations."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_C)
    in_x = p < positions
    in_c = c < channels
    n = (p // (height * width)).to(tl.int64)
    h = ((p // width) % height).to(tl.int64)
    w = (p % width).to(tl.int64)
    at = n * stride_n + h * stride_h + w * stride_w  # the position's first channel
    mask = in_x[:, None] & in_c[None, :]
    offsets = at[:, None] + c[None, :].to(tl.int64) * stride_c
    values = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(values, axis=1) / channels
    difference = tl.where(mask, values - mean[:, None], 0.0)
    variance = tl.sum(difference * difference, axis=1) / channels
    scale = 1.0 / tl.sqrt(variance + eps)
    scaled = scale[:, None] * tl.load(gamma + c, mask=in_c, other=0.0)[None, :]
    tl.store(out + offsets, values * scaled + (-mean)[:, None] * scaled, mask=mask)


@triton.jit(do_not_specialize=["channels"])
def facecast_prelu(x, residual, alpha, out, count, channels,
                   RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """tflite_ops.ChannelPRelu of BLOCK values of a channels-last image (flat position p is
    channel p % channels), or with RESIDUAL tflite_ops.ResidualPRelu's, of x + residual
    rounded to x's dtype as PyTorch's add rounds it (Note [PReLUs in one kernel])."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < count
    values = tl.load(x + p, mask=inside, other=0.0)
    if RESIDUAL:
        summed = values.to(tl.float32) + tl.load(residual + p, mask=inside, other=0.0).to(tl.float32)
        values = summed.to(values.dtype)
    values = values.to(tl.float32)
    slope = tl.load(alpha + p % channels, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + p, tl.where(values > 0, values, slope * values).to(out.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["channels", "source_channels", "source_height", "source_width", "out_height",
                               "out_width"])
def facecast_pooled_residual_prelu(x, source, alpha, out, count, channels, source_channels, source_height,
                                   source_width, out_height, out_width, BLOCK: tl.constexpr):
    """tflite_ops.PooledResidualPRelu of BLOCK values of a channels-last image x (N, C, OH, OW;
    flat position p is channel p % C): the PRELU of x plus the shortcut, the 2x2 stride-2 max of
    the channels-last ``source`` (N, Cs, H, W) in channels below Cs (cells past its last row or
    column, TF's SAME padding, never win) and zero above (the channel PAD); the sum rounded to
    x's dtype before the PRELU, as PyTorch's add rounds it (Note [Residual shortcuts in one
    kernel])."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < count
    c = p % channels
    pixel = p // channels
    column = pixel % out_width
    row = (pixel // out_width) % out_height
    image = pixel // (out_width * out_height)
    pooled = inside & (c < source_channels)
    has_right = column * 2 + 1 < source_width
    has_down = row * 2 + 1 < source_height
    at = source + ((image.to(tl.int64) * source_height + row * 2) * source_width + column * 2) * source_channels + c
    below = source_width * source_channels
    shortcut = tl.load(at, mask=pooled, other=0.0)  # the window's first cell is always inside
    shortcut = tl.maximum(shortcut, tl.load(at + source_channels, mask=pooled & has_right, other=float("-inf")))
    shortcut = tl.maximum(shortcut, tl.load(at + below, mask=pooled & has_down, other=float("-inf")))
    shortcut = tl.maximum(shortcut, tl.load(at + below + source_channels, mask=pooled & has_right & has_down,
                                            other=float("-inf")))
    values = tl.load(x + p, mask=inside, other=0.0)
    values = (values.to(tl.float32) + shortcut.to(tl.float32)).to(values.dtype).to(tl.float32)
    slope = tl.load(alpha + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + p, tl.where(values > 0, values, slope * values).to(out.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["channels"])
def facecast_channel_bias(x, bias, count, channels, BLOCK: tl.constexpr):
    """x + bias[channel] into x, of BLOCK values of a channels-last image (flat position p is
    channel p % channels), summed in float32 and rounded once to x's dtype, as PyTorch's add
    (Note [A convolution's bias in one kernel])."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < count
    values = tl.load(x + p, mask=inside, other=0.0)
    summed = values.to(tl.float32) + tl.load(bias + p % channels, mask=inside, other=0.0).to(tl.float32)
    tl.store(x + p, summed.to(values.dtype), mask=inside)


@triton.jit
def _output_tile(pixels, out_height, out_width, CHANNELS: tl.constexpr, BLOCK_P: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """A program's tile of an image output: BLOCK_P pixels (flat over N, OH, OW; ``pixels`` in
    all) along the grid's x by BLOCK_C channels along its y: (pixel, channel, pixel inside,
    channel inside, column, row, image)."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return (p, c, p < pixels, c < CHANNELS, p % out_width, (p // out_width) % out_height,
            p // (out_width * out_height))


@triton.jit(do_not_specialize=["pixels", "height", "width", "out_height", "out_width"])
def facecast_depthwise(x, weight, bias, out, pixels, height, width, out_height, out_width,
                       CHANNELS: tl.constexpr, BLOCK_C: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                       STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr,
                       PAD_W: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                       BLOCK_P: tl.constexpr):
    """A depthwise convolution of a channels-last image (N, H, W, C in memory) into ``out``
    (N, OH, OW, C): BLOCK_P output pixels (flat over N, OH, OW; ``pixels`` in all) by BLOCK_C
    channels, each tap's product and sum in float32, then the bias and the fused activation
    (TFLite's code: 0 none, 1 ReLU, 3 ReLU6), rounded once to out's dtype (Note [Float16
    depthwise convolutions]). Taps outside the image read zero (the symmetric padding)."""
    p, c, inside, channel_ok, column, row, image = _output_tile(pixels, out_height, out_width, CHANNELS, BLOCK_P,
                                                                BLOCK_C)
    summed = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for kh in tl.static_range(KH):
        source_row = row * STRIDE_H - PAD_H + kh
        row_ok = inside & (source_row >= 0) & (source_row < height)
        for kw in tl.static_range(KW):
            source_column = column * STRIDE_W - PAD_W + kw
            ok = row_ok & (source_column >= 0) & (source_column < width)
            start = ((image * height + source_row) * width + source_column) * CHANNELS
            values = tl.load(x + start[:, None] + c[None, :], mask=ok[:, None] & channel_ok[None, :], other=0.0)
            tap = tl.load(weight + c * (KH * KW) + kh * KW + kw, mask=channel_ok, other=0.0)
            summed += values.to(tl.float32) * tap.to(tl.float32)[None, :]
    if HAS_BIAS:
        summed += tl.load(bias + c, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:
        summed = tl.maximum(summed, 0.0)
    if ACTIVATION == 3:
        summed = tl.minimum(tl.maximum(summed, 0.0), 6.0)
    tl.store(out + p[:, None] * CHANNELS + c[None, :], summed.to(out.dtype.element_ty),
             mask=inside[:, None] & channel_ok[None, :])


@triton.jit(do_not_specialize=["landmarks", "subset", "out", "point_stride", "face_stride", "left", "right",
                               "subset_count", "target_cos", "target_sin", "scale_x", "scale_y",
                               "output_width", "output_height"])
def facecast_landmarks_to_matrix(landmarks, subset, out, point_stride, face_stride, left, right, subset_count,
                                 target_cos, target_sin, scale_x, scale_y, output_width, output_height,
                                 BLOCK_K: tl.constexpr):
    """custom_ops.Landmarks2TransformMatrix of one face (program n) in float32: the rotation from
    its left and right landmarks, the subset's box in the rotated frame, the 4x4 matrix into
    ``out`` (N, 4, 4) float32. cos and sin of (target − atan2(dy, dx)) from dx, dy and the
    target's cos and sin (the same angle, without atan2: Note [The attention mesh's custom
    operators in kernels])."""
    n = tl.program_id(0)
    face = landmarks + n * face_stride
    left_x = tl.load(face + left * point_stride).to(tl.float32)
    left_y = tl.load(face + left * point_stride + 1).to(tl.float32)
    dx = tl.load(face + right * point_stride).to(tl.float32) - left_x
    dy = tl.load(face + right * point_stride + 1).to(tl.float32) - left_y
    length = tl.sqrt(dx * dx + dy * dy)
    flat = length == 0.0  # atan2(0, 0) = 0
    unit_x = tl.where(flat, 1.0, dx / tl.where(flat, 1.0, length))
    unit_y = tl.where(flat, 0.0, dy / tl.where(flat, 1.0, length))
    cos = target_cos * unit_x + target_sin * unit_y
    sin = target_sin * unit_x - target_cos * unit_y
    k = tl.arange(0, BLOCK_K)
    used = k < subset_count
    index = tl.load(subset + k, mask=used, other=0)
    point_x = tl.load(face + index * point_stride, mask=used, other=0.0).to(tl.float32)
    point_y = tl.load(face + index * point_stride + 1, mask=used, other=0.0).to(tl.float32)
    rotated_x = cos * point_x - sin * point_y
    rotated_y = sin * point_x + cos * point_y
    max_x = tl.max(tl.where(used, rotated_x, float("-inf")), axis=0)
    min_x = tl.min(tl.where(used, rotated_x, float("inf")), axis=0)
    max_y = tl.max(tl.where(used, rotated_y, float("-inf")), axis=0)
    min_y = tl.min(tl.where(used, rotated_y, float("inf")), axis=0)
    middle_x = (max_x + min_x) / 2
    middle_y = (max_y + min_y) / 2
    centre_x = cos * middle_x + sin * middle_y
    centre_y = -sin * middle_x + cos * middle_y
    box_scale_x = scale_x * (max_x - min_x) / output_width
    box_scale_y = scale_y * (max_y - min_y) / output_height
    m00 = cos * box_scale_x
    m01 = sin * box_scale_y
    m10 = -sin * box_scale_x
    m11 = cos * box_scale_y
    half_w = output_width / 2.0
    half_h = output_height / 2.0
    matrix = out + n * 16
    tl.store(matrix + 0, m00)
    tl.store(matrix + 1, m01)
    tl.store(matrix + 2, 0.0)
    tl.store(matrix + 3, centre_x - (m00 * half_w + m01 * half_h))
    tl.store(matrix + 4, m10)
    tl.store(matrix + 5, m11)
    tl.store(matrix + 6, 0.0)
    tl.store(matrix + 7, centre_y - (m10 * half_w + m11 * half_h))
    tl.store(matrix + 8, 0.0)  # the third and fourth rows: (0, 0, 1, 0) and (0, 0, 0, 1)
    tl.store(matrix + 9, 0.0)
    tl.store(matrix + 10, 1.0)
    tl.store(matrix + 11, 0.0)
    tl.store(matrix + 12, 0.0)
    tl.store(matrix + 13, 0.0)
    tl.store(matrix + 14, 0.0)
    tl.store(matrix + 15, 1.0)


@triton.jit
def _float32_at(pointer, mask):
    return tl.load(pointer, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _affine_rows(matrix, face, mask):
    """The x and y rows of each face's 4x4 crop matrix (N, 4, 4), as float32: (m00, m01, m03,
    m10, m11, m13); the z column multiplies 0 in the custom operators."""
    rows = matrix + face * 16
    return (_float32_at(rows + 0, mask), _float32_at(rows + 1, mask), _float32_at(rows + 3, mask),
            _float32_at(rows + 4, mask), _float32_at(rows + 5, mask), _float32_at(rows + 7, mask))


@triton.jit(do_not_specialize=["features", "matrix", "out", "pixels", "height", "width", "out_height", "out_width",
                               "stride_n", "stride_c", "stride_h", "stride_w"])
def facecast_transform_bilinear(features, matrix, out, pixels, height, width, out_height, out_width,
                                stride_n, stride_c, stride_h, stride_w, out_stride_n, out_stride_c,
                                out_stride_h, out_stride_w,
                                CHANNELS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """custom_ops.TransformTensorBilinear: BLOCK_P output pixels (flat over N, OH, OW) by BLOCK_C
    channels of ``out`` (N, C, OH, OW, held as its strides say): output pixel (x, y) samples the
    feature map bilinearly at the matrix's image of its centre (x + ½, y + ½) less ½, zero
    where that point lies outside [0, W-1] x [0, H-1]; weights and sums in float32, rounded
    once to out's dtype."""
    p, c, inside_p, channel_ok, column, row, image = _output_tile(pixels, out_height, out_width, CHANNELS,
                                                                  BLOCK_P, BLOCK_C)
    m00, m01, m03, m10, m11, m13 = _affine_rows(matrix, image, inside_p)
    centre_x = column.to(tl.float32) + 0.5
    centre_y = row.to(tl.float32) + 0.5
    x = m00 * centre_x + m01 * centre_y + m03 - 0.5
    y = m10 * centre_x + m11 * centre_y + m13 - 0.5
    inside = inside_p & (x >= 0) & (x <= width - 1) & (y >= 0) & (y <= height - 1)
    x0 = tl.floor(x)
    y0 = tl.floor(y)
    right = x - x0
    down = y - y0
    left = 1 - right
    up = 1 - down
    column0 = x0.to(tl.int32)
    row0 = y0.to(tl.int32)
    has_right = column0 + 1 <= width - 1
    has_down = row0 + 1 <= height - 1
    base = image.to(tl.int64) * stride_n + row0.to(tl.int64) * stride_h + column0.to(tl.int64) * stride_w
    at = features + base[:, None] + c[None, :].to(tl.int64) * stride_c
    load_ok = inside[:, None] & channel_ok[None, :]
    summed = _float32_at(at, load_ok) * (left * up)[:, None]
    summed += _float32_at(at + stride_w, load_ok & has_right[:, None]) * (right * up)[:, None]
    summed += _float32_at(at + stride_h, load_ok & has_down[:, None]) * (left * down)[:, None]
    summed += _float32_at(at + stride_h + stride_w, load_ok & (has_right & has_down)[:, None]) * (right * down)[:, None]
    target = out + (image.to(tl.int64) * out_stride_n + row * out_stride_h + column * out_stride_w)[:, None] \
        + c[None, :].to(tl.int64) * out_stride_c
    tl.store(target, summed.to(out.dtype.element_ty), mask=inside_p[:, None] & channel_ok[None, :])


@triton.jit(do_not_specialize=["landmarks", "matrix", "out", "points", "count"])
def facecast_transform_landmarks(landmarks, matrix, out, points, count, DIMS: tl.constexpr, BLOCK: tl.constexpr):
    """custom_ops.TransformLandmarks of BLOCK landmarks (flat over N faces of ``points`` each,
    (N, points, DIMS) contiguous): x, y through the face's matrix in float32, rounded once to
    out's dtype; z as it is."""
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = q < count
    face = q // points
    x = tl.load(landmarks + q * DIMS, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(landmarks + q * DIMS + 1, mask=ok, other=0.0).to(tl.float32)
    m00, m01, m03, m10, m11, m13 = _affine_rows(matrix, face, ok)
    tl.store(out + q * DIMS, (m00 * x + m01 * y + m03).to(out.dtype.element_ty), mask=ok)
    tl.store(out + q * DIMS + 1, (m10 * x + m11 * y + m13).to(out.dtype.element_ty), mask=ok)
    if DIMS == 3:
        tl.store(out + q * DIMS + 2, tl.load(landmarks + q * DIMS + 2, mask=ok, other=0.0), mask=ok)


@triton.jit
def _nv12_at(nv12, pixel, inside, height, width):
    """The luma and the two chroma values (float32) of the NV12 frame's pixels at ``pixel``
    (row-major indices): the Y plane, then U and V interleaved at half resolution."""
    row = pixel // width
    column = pixel - row * width
    y = tl.load(nv12 + pixel, mask=inside, other=0).to(tl.float32)
    chroma = nv12 + height * width + (row // 2) * width + (column // 2) * 2
    u = tl.load(chroma, mask=inside, other=0).to(tl.float32)
    v = tl.load(chroma + 1, mask=inside, other=0).to(tl.float32)
    return y, u, v


@triton.jit(do_not_specialize=["nv12", "out", "height", "width"])
def facecast_nv12_to_bgr(nv12, out, height, width, y_scale, b_u, g_u, g_v, r_v, b_0, g_0, r_0,
                         BLOCK: tl.constexpr):
    """BLOCK pixels of an NV12 frame (the Y plane, then U and V interleaved at half resolution)
    as BGR bytes into ``out`` (height x width x 3): nvdec.converted_by_torch's terms in its order
    and in float32 (the chroma's terms, then the luma's), clamped and truncated (Note [NV12 to BGR
    into memory of the process's own])."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = p < height * width
    y, u, v = _nv12_at(nv12, p, inside, height, width)
    blue = (b_0 + u * b_u) + y * y_scale
    green = ((g_0 + u * g_u) + v * g_v) + y * y_scale
    red = (r_0 + v * r_v) + y * y_scale
    tl.store(out + p * 3, tl.minimum(tl.maximum(blue, 0.0), 255.99).to(tl.uint8), mask=inside)
    tl.store(out + p * 3 + 1, tl.minimum(tl.maximum(green, 0.0), 255.99).to(tl.uint8), mask=inside)
    tl.store(out + p * 3 + 2, tl.minimum(tl.maximum(red, 0.0), 255.99).to(tl.uint8), mask=inside)


@triton.jit(do_not_specialize=["nv12", "out", "weights", "partials", "height", "width", "words"])
def facecast_nv12_to_slot(nv12, out, weights, partials, height, width, words, y_scale, b_u, g_u,
                          g_v, r_v, b_0, g_0, r_0, WORDS: tl.constexpr):
    """WORDS 8-byte words of a frame's BGR bytes made from its NV12 frame, with
    facecast_nv12_to_bgr's arithmetic, stored into ``out`` (a ring slot), and their share of Note
    [Frame checksum] (the words times their ``weights``, summed mod 2**64) from the bytes made
    here, never read back from ``out``, into ``partials[program]`` (Note [NV12 into the slot])."""
    w = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
    b = w[:, None] * 8 + tl.arange(0, 8)[None, :]  # the words' bytes, little-endian
    inside = b < words * 8
    pixel = b // 3
    channel = b - pixel * 3  # 0 blue, 1 green, 2 red
    y, u, v = _nv12_at(nv12, pixel, inside, height, width)
    # One form for the three channels: a term of 0.0 adds exactly nothing (blue has no V term,
    # red no U term), so each channel's value is facecast_nv12_to_bgr's to the bit.
    blue, green = channel == 0, channel == 1
    k_0 = tl.where(blue, b_0, tl.where(green, g_0, r_0))
    k_u = tl.where(blue, b_u, tl.where(green, g_u, 0.0))
    k_v = tl.where(blue, 0.0, tl.where(green, g_v, r_v))
    value = ((k_0 + u * k_u) + v * k_v) + y * y_scale
    byte = tl.minimum(tl.maximum(value, 0.0), 255.99).to(tl.uint8)
    tl.store(out + b, byte, mask=inside)
    shift = (tl.arange(0, 8) * 8).to(tl.int64)[None, :]
    word = tl.sum(byte.to(tl.int64) << shift, axis=1)
    weight = tl.load(weights + w, mask=w < words, other=0)
    tl.store(partials + tl.program_id(0), tl.sum(word * weight, axis=0))
