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
    in int64 and in float64 (every partial sum is an integer below 2**53, in any order) on every
    device. It is a guard against wrong memory, not a cryptographic hash.

    It is computed as ``sum(byte * weight) + sum(weight)``, with the sample positions, the weights
    and their sum worked out once per frame size (`SamplePlan`): on the host one gather and one
    dot product (about 10 µs for 1080p), on a GPU a gather, a cast and a float64 dot product whose
    result stays on the device until `settle_checksums` fetches a whole batch with one host sync
    (Note [One sync per batch] in rings.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: a capture worker never needs it
    import torch

SAMPLE_COUNT = 4096
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant


class SamplePlan(NamedTuple):
    """Where and how a frame of one size is sampled (Note [Sparse checksum])."""

    positions: np.ndarray  # intp, ascending, first and last byte included
    weights: np.ndarray  # int64, odd, below 2**31
    weight_sum: int  # sum(weights): the "+1" of every sample, added once


class PendingChecksum(NamedTuple):
    """A checksum whose dot product is still on the device (`sparse_checksum_start`)."""

    dot: torch.Tensor  # 0-d float64, exact
    weight_sum: int


@functools.lru_cache(maxsize=32)
def sample_plan(nbytes: int) -> SamplePlan:
    if nbytes <= 0:
        raise ValueError(f"cannot checksum an empty frame ({nbytes} bytes)")
    count = min(SAMPLE_COUNT, nbytes)
    positions = np.linspace(0, nbytes - 1, count).astype(np.intp)
    weights = ((np.arange(count, dtype=np.int64) * _GOLDEN + 12345) % (2**31 - 1)) | 1
    positions.setflags(write=False)
    weights.setflags(write=False)
    return SamplePlan(positions, weights, int(weights.sum()))


@functools.lru_cache(maxsize=32)
def _sample_plan_on(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    import torch

    plan = sample_plan(nbytes)
    return (torch.tensor(plan.positions, dtype=torch.int64, device=device),
            torch.tensor(plan.weights, dtype=torch.float64, device=device), plan.weight_sum)


def sparse_checksum(frame: np.ndarray) -> int:
    """Checksum of a host frame's bytes (Note [Sparse checksum])."""
    flat = (frame if frame.flags.c_contiguous else np.ascontiguousarray(frame)).reshape(-1)
    flat = flat.view(np.uint8)
    plan = sample_plan(flat.size)
    return int(np.dot(flat.take(plan.positions).astype(np.int64), plan.weights)) + plan.weight_sum


def sparse_checksum_start(frame: torch.Tensor) -> PendingChecksum:
    """Queue the checksum of a device tensor on the current stream; no host sync (see
    `settle_checksums`)."""
    import torch

    flat = frame.reshape(-1).view(torch.uint8)
    positions, weights, weight_sum = _sample_plan_on(flat.numel(), flat.device)
    return PendingChecksum(torch.dot(flat.index_select(0, positions).double(), weights), weight_sum)


def settle_checksums(pending: list[PendingChecksum]) -> list[int]:
    """The values of queued checksums: one device-to-host transfer (one sync) per device."""
    import torch

    values: list[int] = [0] * len(pending)
    by_device: dict[torch.device, list[int]] = {}
    for index, item in enumerate(pending):
        by_device.setdefault(item.dot.device, []).append(index)
    for indices in by_device.values():
        dots = torch.stack([pending[i].dot for i in indices]).tolist()
        for i, dot in zip(indices, dots):
            values[i] = int(dot) + pending[i].weight_sum
    return values


def warm_up_checksums(device: torch.device) -> None:
    """Run the device checksum once on a dummy frame. Its first run on a GPU loads kernels and
    creates the BLAS handle behind `torch.dot`; paid here, at start, that time does not fall on
    the first frames a consumer reads, while the next ones queue up behind them."""
    import torch

    if device.type != "cpu":
        sparse_checksum_tensor(torch.zeros(SAMPLE_COUNT, dtype=torch.uint8, device=device))


def sparse_checksum_tensor(frame: torch.Tensor) -> int:
    """The same checksum computed where the tensor lives (a GPU view of a ring slot, say)."""
    if frame.device.type == "cpu":
        return sparse_checksum(frame.numpy())
    return settle_checksums([sparse_checksum_start(frame)])[0]


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
