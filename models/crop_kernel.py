"""The crops of :func:`facecast.models.roi.crop_rois` on a GPU in one kernel (Triton).

Note [One kernel for a batch of crops]
    On a GPU crop_rois was PyTorch's kernels in two parts (Note [Crop taps made once]): about 40
    small kernels for where each output pixel samples, then a dozen full-size passes over the
    (N, H, W, 3) floats to gather the four taps and blend them. For a batch of 64 faces that
    was 1.0 ms of the FaceLandmarker stack's 6.7 ms of kernel time (H100, 2026-11-26,
    bench/model_stages.py), and about 50 launches queued from Python, under the GIL, ahead of
    the measuring stage's CUDA graph. Here one Triton kernel does all of it for every output
    pixel: the rect's sample point (Note [ROI crop convention]), the clamp to its own frame,
    the black border's inside test, the four taps read as bytes where the frames lie (Note
    [Sampling the frames where they lie]), the blend, the channel swap, the value range, and
    one store in the output's dtype. The arithmetic is crop_taps' in the same order, in float32
    throughout: for a float16 output crop_taps blends in float16, so there this is the more
    exact of the two; for float32 the two agree to float rounding (the same operations, each
    rounded on its own: the kernel is compiled without fused multiply-adds; the rotation's
    cosine and sine may differ in their last bit). tests/models/test_crop_kernel.py holds them
    to each other on the CPU (Triton's interpreter) and on the GPU.
    Triton compiles the kernel at its first call in a process and keeps it in its cache on
    disk (TRITON_CACHE_DIR; by default here $XDG_CACHE_HOME/facecast/triton, the daemon's
    cache directory under systemd, since the service user has no home): a second process
    loads it in milliseconds. `prepare` compiles it at warm-up, so that no batch waits for a
    compilation and none happens while a CUDA graph is captured. Its integer arguments and
    pointers are not specialised on (`do_not_specialize`): another crop size or a frame at
    another address never needs another compilation. Where Triton is missing, cannot compile
    (it builds its launcher with the machine's C compiler) or cannot launch, crop_rois keeps
    PyTorch's kernels and the reason is logged once (`unavailable_reason`).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Output pixels per program: a crop of S x S is ceil(S² / BLOCK) programs along the grid's x,
# the crops along its y.
BLOCK = 256
# The output dtypes the kernel stores (the models' inputs).
OUTPUT_DTYPES = (torch.float32, torch.float16)

_failed: str | None = None  # why the kernel is not used, once it failed


def unavailable_reason(device: torch.device) -> str | None:
    """Why crop_rois cannot use the kernel on ``device`` (None: it can)."""
    if device.type != "cuda" and not _interpreted():
        return "the kernel is for CUDA devices"
    if _failed is not None:
        return _failed
    try:
        _kernel(_interpreted())
    except Exception as exc:  # noqa: BLE001 - any reason Triton cannot be had is a reason to say
        _give_up(exc)
        return _failed
    return None


def crop(frames, frame_index: torch.Tensor, rects, out_hw: tuple[int, int], border: str,
         dtype: torch.dtype, value_range: tuple[float, float]) -> torch.Tensor | None:
    """:func:`roi.crop_rois` (its arguments, checked there) in one kernel: (N, H, W, 3) of
    ``dtype``; None where the kernel cannot serve (then PyTorch's kernels crop)."""
    if dtype not in OUTPUT_DTYPES or unavailable_reason(frames.pixels.device) is not None:
        return None
    out_h, out_w = out_hw
    count = len(rects)
    out = torch.empty(count, out_h, out_w, 3, dtype=dtype, device=frames.pixels.device)
    if count == 0:
        return out
    pixels = frames.pixels
    if pixels.stride(2) != 1 or pixels.stride(1) != 3:
        pixels = pixels.contiguous()
    low, high = value_range
    # The rects' three tables as float32 rows (no-ops for the rects crop_rois is given).
    centre = rects.center_xy_px.to(device=pixels.device, dtype=torch.float32).contiguous()
    size = rects.size_wh_px.to(device=pixels.device, dtype=torch.float32).contiguous()
    rotation = rects.rotation_rad.to(device=pixels.device, dtype=torch.float32).contiguous()
    index = frame_index.to(device=pixels.device, dtype=torch.int64).contiguous()
    try:
        _kernel(_interpreted())[(-(-out_h * out_w // BLOCK), count)](
            pixels, pixels.stride(0), frames.frame_table, index, centre, size, rotation, out,
            out_h, out_w, (high - low) / 255.0, low,
            ZERO_BORDER=border == "zero", BGR=bool(frames.bgr), BLOCK=BLOCK,
            enable_fp_fusion=False)  # each multiply and add rounded, as PyTorch's kernels round them
    except Exception as exc:  # noqa: BLE001 - a compiler or launcher failure: PyTorch's kernels
        _give_up(exc)
        return None
    return out


def prepare(device: torch.device, variants) -> str | None:
    """Compile the kernel now for each (dtype, border) of ``variants`` (warm-up: Note [One
    kernel for a batch of crops]); the reason it cannot be used, or None."""
    from facecast.models.roi import FrameBatch, RotatedRects

    if unavailable_reason(device) is not None:
        return _failed
    frames = FrameBatch(torch.zeros(1, 4, 4, 3, dtype=torch.uint8, device=device), device)
    rects = RotatedRects(torch.full((1, 2), 2.0, device=device), torch.full((1, 2), 4.0, device=device),
                         torch.zeros(1, device=device))
    index = torch.zeros(1, dtype=torch.long, device=device)
    for dtype, border in dict.fromkeys(variants):
        if crop(frames, index, rects, (2, 2), border, dtype, (0.0, 1.0)) is None:
            return _failed
    return None


def _interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernel on the CPU: the tests'."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _give_up(exc: Exception) -> None:
    global _failed
    if _failed is None:
        _failed = f"{type(exc).__name__}: {exc}".strip()
        log.warning("crops: the one-kernel crop (Triton) cannot be used (%s); PyTorch's "
                    "kernels crop from now on", _failed)


@functools.lru_cache(maxsize=2)
def _kernel(interpreted: bool):
    """The Triton kernel, defined once per process (compiled at its first launch); Triton
    decides at the definition whether it is interpreted, hence one for each."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(_cache_home() / "facecast" / "triton"))
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["pixels", "row_bytes", "frame_table", "frame_index", "centre",
                                   "size", "rotation", "out", "out_h", "out_w", "scale", "low"])
    def crop_kernel(pixels, row_bytes, frame_table, frame_index, centre, size, rotation, out,
                    out_h, out_w, scale, low,
                    ZERO_BORDER: tl.constexpr, BGR: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(1)
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_crop = p < out_h * out_w
        i = p // out_w
        j = p - i * out_w
        # The rect and its frame (FrameBatch.frame_table: row offset, height, width).
        k = tl.load(frame_index + n)
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

    return crop_kernel


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
