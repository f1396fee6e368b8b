"""What makes a frame provably the camera's frame: a sparse checksum and a known test pattern.

Both are computed the same way on the host (numpy, by the producer) and on a consumer's device
(torch, on the GPU for CUDA rings), so a consumer can check what it reads in place without copying
the frame back.

Note [Sparse checksum]
    The checksum samples a fixed set of byte positions spread over the whole frame (first and last
    byte included) and sums ``(byte + 1) * weight[i]`` with fixed pseudo-random weights. Because
    every sample is weighted by its position, a frame read at the wrong offset (rule 1), an old
    frame (rules 3 and 4) or an unwritten slot gives a different sum; the +1 makes all-zero memory
    count. The sum of 4096 products of a byte and a 31-bit weight stays below 2**51, so it is exact
    in int64 on every device. It is a guard against wrong memory, not a cryptographic hash.
"""

from __future__ import annotations

import functools

import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: a capture worker never needs it
    import torch

SAMPLE_COUNT = 4096
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant


@functools.lru_cache(maxsize=32)
def _sample_plan(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    if nbytes <= 0:
        raise ValueError(f"cannot checksum an empty frame ({nbytes} bytes)")
    count = min(SAMPLE_COUNT, nbytes)
    positions = np.linspace(0, nbytes - 1, count).astype(np.int64)
    weights = ((np.arange(count, dtype=np.int64) * _GOLDEN + 12345) % (2**31 - 1)) | 1
    positions.setflags(write=False)
    weights.setflags(write=False)
    return positions, weights


@functools.lru_cache(maxsize=32)
def _sample_plan_on(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    positions, weights = _sample_plan(nbytes)
    return torch.tensor(positions, device=device), torch.tensor(weights, device=device)


def sparse_checksum(frame: np.ndarray) -> int:
    """Checksum of a host frame's bytes (Note [Sparse checksum])."""
    flat = np.ascontiguousarray(frame).reshape(-1).view(np.uint8)
    positions, weights = _sample_plan(flat.size)
    return int(((flat[positions].astype(np.int64) + 1) * weights).sum())


def sparse_checksum_tensor(frame: torch.Tensor) -> int:
    """The same checksum computed where the tensor lives (a GPU view of a ring slot, say)."""
    import torch

    flat = frame.reshape(-1).view(torch.uint8)
    positions, weights = _sample_plan_on(flat.numel(), flat.device)
    return int(((flat[positions].to(torch.int64) + 1) * weights).sum().item())


def test_pattern(nbytes: int, ring_epoch: int) -> np.ndarray:
    """Known bytes that a producer writes into a ring's probe slot for the handshake.

    They depend on the epoch, so a mapping left over from an earlier epoch cannot pass.
    """
    index = np.arange(nbytes, dtype=np.int64)
    return (((index * _GOLDEN + (ring_epoch & 0xFFFFFFFF) * 40503) >> 13) & 0xFF).astype(np.uint8)


def test_pattern_tensor(nbytes: int, ring_epoch: int, device: torch.device) -> torch.Tensor:
    import torch

    index = torch.arange(nbytes, dtype=torch.int64, device=device)
    return (((index * _GOLDEN + (ring_epoch & 0xFFFFFFFF) * 40503) >> 13) & 0xFF).to(torch.uint8)
