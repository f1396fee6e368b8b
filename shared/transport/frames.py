"""What makes a frame provably the camera's frame: a checksum of its bytes and a known test pattern.

Both are computed the same way on the host (numpy) and on a consumer's device (torch, on the GPU
for CUDA rings and for shm frames copied to a GPU), so a consumer checks what it reads where it
is, without copying the frame back. Two kinds (`daemon.checksum`): "full", every byte of every
frame (the default, Note [Frame checksum]), and "sampled", a sparse sample of 1 frame in
`daemon.checksum_every` (Note [Sparse checksum]).

Note [Frame checksum]
    The frame's bytes are read as little-endian 64-bit words W[p], p = 0 .. n-1 (n = nbytes // 8),
    laid out in rows of `WORDS_PER_ROW` words (the last row may be short), plus the 0..7 tail
    bytes T[t] that do not fill a word. The checksum is

        sum_p a[p // WORDS_PER_ROW] * b[p % WORDS_PER_ROW] * W[p] + sum_t c[t] * T[t]  mod 2**64

    with fixed odd pseudo-random 64-bit weights a (one per row), b (one per column) and c (one
    per tail byte), drawn from splitmix64 so that any frame size has them. Arithmetic mod 2**64
    is what uint64 (numpy) and int64 (torch, two's complement) arithmetic wrap to, so every
    formulation of this sum gives the same value: the host computes each row's dot product with
    b (`np.einsum('ij,j->i')`, one pass over the frame) and then the dot product of those with
    a; a GPU multiplies the words by the precomputed per-word weights a*b and sums (two kernels).

    One changed byte always changes the value. A byte at offset s (0..7) of word p changing by
    d (0 < |d| <= 255) changes W[p] by d * 2**(8s): not 0 mod 2**64, since its magnitude is
    below 2**64. The value changes by w * d * 2**(8s) with w = a*b mod 2**64, a product of odd
    numbers, so odd, so invertible mod 2**64: the change is 0 only if d * 2**(8s) is, which it is
    not. The same argument covers a tail byte (weight c[t], odd) and, more generally, any change
    confined to one 8-byte word. For a change of many words (a patch, a stale or unwritten slot, a
    read at a shifted address, swapped blocks) the value moves by sum_p w[p] * delta[p], which
    every position's distinct pseudo-random weight makes 0 only by accident: about 2**-64 when
    the change reaches the low bytes of a word. The one weak pattern is inherent to any sum mod
    2**64: a change that touches *only* the byte at offset 7 of several words is caught modulo
    2**8 only (about 1 in 256 such patterns passes), as offset 6 only is modulo 2**16; a patch,
    a shift or a stale frame changes bytes at every offset. It is a guard against wrong memory,
    not a cryptographic hash.

    Cost (bench/checksum.py; docs/benchmarks.md, "Frame checksum"), per 1080p frame: on the
    host one pass over the frame, 273-280 us of CPU on the 2-core development VM and 399 us median
    (281 min) on the H200 host's CPU, against 217-220 us for a bare `sum()` of the words (the
    floor of any exact form). The rank-one weights cost a multiply per word inside einsum's
    inner loop and need no weight table; the alternatives measured: per-position weights read
    from a table (multiply, then sum) 893-903 us, 32-bit words (stronger on high bytes)
    714-1023 us, and a plain column sum (`reshape(k, m).sum(0)`, then a weight per column)
    233-280 us but blind to two rows that swap places. On the H200 the torch form takes 13.6 us
    of GPU time per 1080p frame (31.7 us at 4K; the sampled kind's small kernels take 13.5) and
    36 us of CPU to queue. Where a CUDA producer computes it: Note [Producer checksum].

Note [Sparse checksum]
    The "sampled" kind samples a fixed set of byte positions spread over the whole frame (first
    and last byte included) and sums ``(byte + 1) * weight[i]`` with fixed pseudo-random weights.
    Because every sample is weighted by its position, a frame read at the wrong offset (rule 1),
    an old frame (rules 3 and 4) or an unwritten slot gives a different sum; the +1 makes
    all-zero memory count. The sum of 4096 products of a byte and a 31-bit weight stays below
    2**51, so it is exact in int64 on every device. It costs next to nothing, and it misses
    what falls between its samples: a third process that changed a 16x16 patch or one byte of a
    published slot went through. Hence "full" by default.

    It is computed as ``sum(byte * weight) + sum(weight)``, with the sample positions, the weights
    and their sum worked out once per frame size (`SamplePlan`).

Either kind's device computation leaves its value on the device (`PendingChecksum`) until
`settle_checksums` fetches a whole batch with one host sync (Note [One sync per batch]).

Note [Frames of a batch checksummed together]
    A consumer's batch of frames lies in one device buffer, back to back (Note [A batch's frames
    in one buffer]). Frames of one size whose size is a whole number of words are then the rows
    of one (frames, words) int64 view, and `full_checksums_start` computes the full checksum of
    all of them with one multiply and one row sum, where `full_checksum_start` costs each frame
    its own (about ten torch calls of host time each, the consumers' leading transport cost in
    their profiles at 64 cameras). Measured (H100, 2026-11-27): a batch of 32 1080p frames
    queues in 267 us of CPU instead of 877 (bench/checksum.py), and the roi_landmark workers'
    profile share of checksums halved at 64 cameras, but their cores did not move beyond one
    run's spread (0.04 cores at most to gain). The products need a temporary as large as the
    frames they cover, so the rows go in chunks of at most `CHUNK_BYTES`: a batch of 32 1080p
    frames would otherwise hold 200 MB more device memory in each consumer (the caching
    allocator keeps a peak). The value of each row is the one `full_checksum_start` gives that
    frame: the same words times the same weights, summed mod 2**64 in another order, which a
    sum mod 2**64 does not see.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: a capture worker never needs it
    import torch

ChecksumKind = Literal["full", "sampled"]
CHECKSUM_KINDS: tuple[str, ...] = ("full", "sampled")

MASK_64 = (1 << 64) - 1
WORD_BYTES = 8
WORDS_PER_ROW = 1024  # 8 KiB rows: long enough for einsum's inner loop, any frame size fits
# splitmix64 streams of Note [Frame checksum]'s weights: rows, columns, tail bytes.
_ROW_STREAM, _COLUMN_STREAM = 0x243F6A8885A308D3, 0x13198A2E03707344
_TAIL_STREAM = 0xA4093822299F31D0

SAMPLE_COUNT = 4096
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant


def check_kind(kind: str) -> ChecksumKind:
    if kind not in CHECKSUM_KINDS:
        raise ValueError(f"checksum kind {kind!r} is not one of {', '.join(CHECKSUM_KINDS)}")
    return kind  # type: ignore[return-value]


class PendingChecksum(NamedTuple):
    """A checksum still on the device (`checksum_start`): value = (device + offset) mod 2**64,
    `device` being `device_value`, or its element `row` (`full_checksums_start`'s values)."""

    device_value: torch.Tensor  # int64: 0-d, or one value per frame with `row`
    offset: int
    row: int | None = None


# ------------------------------------------------------------------------------------------------
# Full checksum (Note [Frame checksum])
# ------------------------------------------------------------------------------------------------


def _odd_weights(stream: int, count: int) -> np.ndarray:
    """`count` odd uint64 weights: splitmix64 of stream + i * golden gamma, low bit set."""
    index = np.arange(1, count + 1, dtype=np.uint64)
    z = np.uint64(stream) + index * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


class ChecksumPlan(NamedTuple):
    """The layout and weights of Note [Frame checksum] for one frame size."""

    word_count: int
    full_rows: int  # rows of WORDS_PER_ROW words; a short row of `short_row_words` may follow
    short_row_words: int
    row_weights: np.ndarray  # uint64, odd, full_rows (+ 1 with a short row)
    column_weights: np.ndarray  # uint64, odd, WORDS_PER_ROW
    tail_weights: np.ndarray  # uint64, odd, nbytes % 8


@functools.lru_cache(maxsize=32)
def checksum_plan(nbytes: int) -> ChecksumPlan:
    if nbytes <= 0:
        raise ValueError(f"cannot checksum an empty frame ({nbytes} bytes)")
    word_count = nbytes // WORD_BYTES
    full_rows, short_row_words = divmod(word_count, WORDS_PER_ROW)
    plan = ChecksumPlan(
        word_count, full_rows, short_row_words,
        _odd_weights(_ROW_STREAM, full_rows + (1 if short_row_words else 0)),
        _odd_weights(_COLUMN_STREAM, WORDS_PER_ROW),
        _odd_weights(_TAIL_STREAM, nbytes % WORD_BYTES),
    )
    for weights in plan[3:]:
        weights.setflags(write=False)
    return plan


def _flat_bytes(frame: np.ndarray) -> np.ndarray:
    return (frame if frame.flags.c_contiguous else np.ascontiguousarray(frame)).reshape(-1).view(
        np.uint8)


def full_checksum(frame: np.ndarray) -> int:
    """Note [Frame checksum], on the host: one pass over the frame's bytes."""
    flat = _flat_bytes(frame)
    plan = checksum_plan(flat.size)
    words = flat[: plan.word_count * WORD_BYTES].view("<u8")
    rows_end = plan.full_rows * WORDS_PER_ROW
    row_sums = np.einsum("ij,j->i", words[:rows_end].reshape(plan.full_rows, WORDS_PER_ROW),
                         plan.column_weights)
    total = int(np.einsum("i,i->", row_sums, plan.row_weights[: plan.full_rows]))
    # The short row and the tail are below 8 KiB: Python ints keep them exact (numpy scalars
    # would warn on the wrap that is wanted here).
    if plan.short_row_words:
        short_row = int(np.einsum("j,j->", words[rows_end:],
                                  plan.column_weights[: plan.short_row_words]))
        total += short_row * int(plan.row_weights[-1])
    if plan.tail_weights.size:
        tail = flat[plan.word_count * WORD_BYTES:].astype(np.uint64)
        total += int(np.einsum("i,i->", tail, plan.tail_weights))
    return total & MASK_64


@functools.lru_cache(maxsize=16)
def _word_weights_on(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-word weights a*b (int64, one per word) and tail weights, on the device: the GPU reads
    them with the frame, which costs it less than the launches of a row-then-column form."""
    import torch

    plan = checksum_plan(nbytes)
    per_word = np.empty(plan.word_count, np.uint64)
    rows_end = plan.full_rows * WORDS_PER_ROW
    np.multiply(plan.row_weights[: plan.full_rows, None], plan.column_weights[None, :],
                out=per_word[:rows_end].reshape(plan.full_rows, WORDS_PER_ROW))
    if plan.short_row_words:
        np.multiply(plan.row_weights[-1], plan.column_weights[: plan.short_row_words],
                    out=per_word[rows_end:])
    return (torch.from_numpy(per_word.view(np.int64)).to(device),
            torch.from_numpy(plan.tail_weights.view(np.int64).copy()).to(device))


def full_checksum_start(frame: torch.Tensor, scratch: bool = False) -> PendingChecksum:
    """Queue Note [Frame checksum] on the tensor's device (current stream); no host sync.
    `scratch`: the frame's memory may be overwritten (the weighted words are computed in place,
    sparing a temporary of the frame's size in int64 per call)."""
    import torch

    flat = frame.reshape(-1).view(torch.uint8)
    if flat.storage_offset() % WORD_BYTES:  # an int64 view needs word-aligned storage
        flat, scratch = flat.clone(), True
    nbytes = flat.numel()
    word_weights, tail_weights = _word_weights_on(nbytes, flat.device)
    words_end = word_weights.numel() * WORD_BYTES
    words = flat[:words_end].view(torch.int64)
    value = (words.mul_(word_weights) if scratch else words * word_weights).sum()
    if tail_weights.numel():
        value = value + (flat[words_end:].to(torch.int64) * tail_weights).sum()
    return PendingChecksum(value, 0)


def frame_word_weights(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Note [Frame checksum]'s weights for a frame of `nbytes` on `device`: one per 8-byte word
    (a*b, int64) and one per tail byte, made once per size and device; for a kernel that
    computes the checksum itself (Note [NV12 into the slot])."""
    return _word_weights_on(nbytes, device)


def sum_of_partials(partials: torch.Tensor) -> int:
    """The checksum whose partial sums (int64, mod 2**64) a kernel left in `partials`: one
    device-to-host transfer (one sync), summed on the host."""
    return _summed(partials.cpu())


def _summed(host_partials: torch.Tensor) -> int:
    return int(np.sum(host_partials.numpy().view(np.uint64), dtype=np.uint64)) & MASK_64


class PartialSums:
    """Where a kernel leaves the partial sums of a frame's checksum (`sums`: int64, mod 2**64),
    made once per producer and reused for every frame, and their value fetched (Note [NV12 into
    the slot]): copied into pinned host memory and waited for on an event that sleeps, with no
    host tensor made per frame. The fetch is the step after NVDEC's decode call that costs the
    capture thread most: a pageable `.cpu()` (`sum_of_partials`) 123-144 us of its CPU a frame,
    this 112-114 (one H200, 16 NVDEC cameras at 1080p30 in one process, 2026-11-28): most of
    it is the wait itself."""

    def __init__(self, count: int, device: torch.device) -> None:
        import torch

        self.sums = torch.empty(count, dtype=torch.int64, device=device)
        self._host = torch.empty(count, dtype=torch.int64, pin_memory=True)
        self._copied = torch.cuda.Event(blocking=True)

    def value(self) -> int:
        """The checksum, once the kernel queued on the current stream has written `sums`
        (the thread sleeps until then)."""
        self._host.copy_(self.sums, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return _summed(self._host)


CHUNK_BYTES = 32 << 20  # frames per multiply in full_checksums_start: at least one


def full_checksums_start(rows: torch.Tensor) -> list[PendingChecksum]:
    """Queue Note [Frame checksum] of each row of a contiguous (frames, nbytes) uint8 tensor,
    nbytes a multiple of 8 (Note [Frames of a batch checksummed together]); no host sync. The
    rows' memory is only read."""
    import torch

    count, nbytes = rows.shape
    if nbytes % WORD_BYTES or not rows.is_contiguous() or rows.storage_offset() % WORD_BYTES:
        raise ValueError(f"rows of {nbytes} bytes at offset {rows.storage_offset()}: a batch's "
                         "checksum needs contiguous whole words (full_checksum_start does not)")
    word_weights, _ = _word_weights_on(nbytes, rows.device)
    words = rows.view(torch.int64)
    per_chunk = max(1, CHUNK_BYTES // nbytes)
    sums = [(words[start:start + per_chunk] * word_weights).sum(dim=1)
            for start in range(0, count, per_chunk)]
    values = sums[0] if len(sums) == 1 else torch.cat(sums)
    return [PendingChecksum(values, 0, row) for row in range(count)]


# ------------------------------------------------------------------------------------------------
# Sampled checksum (Note [Sparse checksum])
# ------------------------------------------------------------------------------------------------


class SamplePlan(NamedTuple):
    """Where and how a frame of one size is sampled (Note [Sparse checksum])."""

    positions: np.ndarray  # intp, ascending, first and last byte included
    weights: np.ndarray  # int64, odd, below 2**31
    weight_sum: int  # sum(weights): the "+1" of every sample, added once


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
            torch.tensor(plan.weights, dtype=torch.int64, device=device), plan.weight_sum)


def sparse_checksum(frame: np.ndarray) -> int:
    """Checksum of a host frame's sampled bytes (Note [Sparse checksum])."""
    flat = _flat_bytes(frame)
    plan = sample_plan(flat.size)
    return int(np.dot(flat.take(plan.positions).astype(np.int64), plan.weights)) + plan.weight_sum


def sparse_checksum_start(frame: torch.Tensor) -> PendingChecksum:
    """Queue the sampled checksum of a device tensor on the current stream; no host sync."""
    import torch

    flat = frame.reshape(-1).view(torch.uint8)
    positions, weights, weight_sum = _sample_plan_on(flat.numel(), flat.device)
    # int64 products and sum: exact (below 2**51), and no BLAS handle to create on a GPU.
    return PendingChecksum((flat.index_select(0, positions).to(torch.int64) * weights).sum(),
                           weight_sum)


# ------------------------------------------------------------------------------------------------
# Either kind, where the frame is
# ------------------------------------------------------------------------------------------------


def checksum(frame: np.ndarray, kind: ChecksumKind = "full") -> int:
    """A host frame's checksum of this kind (numpy)."""
    return full_checksum(frame) if check_kind(kind) == "full" else sparse_checksum(frame)


def checksum_start(frame: torch.Tensor, kind: ChecksumKind = "full",
                   scratch: bool = False) -> PendingChecksum:
    """Queue a tensor's checksum of this kind on its device (torch ops, on a CPU tensor too);
    `scratch`: the frame's memory may be overwritten (full_checksum_start)."""
    if check_kind(kind) == "full":
        return full_checksum_start(frame, scratch)
    return sparse_checksum_start(frame)


def checksum_tensor(frame: torch.Tensor, kind: ChecksumKind = "full") -> int:
    """The checksum computed where the tensor lives: numpy for a CPU tensor (faster there than
    torch's ops), the device otherwise (a GPU view of a ring slot, say)."""
    if frame.device.type == "cpu":
        return checksum(frame.numpy(), kind)
    return settle_checksums([checksum_start(frame, kind)])[0]


def settle_checksums(pending: list[PendingChecksum]) -> list[int]:
    """The values of queued checksums: one device-to-host transfer (one sync) per device."""
    import torch

    values: list[int] = [0] * len(pending)
    by_device: dict[torch.device, list[int]] = {}
    for index, item in enumerate(pending):
        by_device.setdefault(item.device_value.device, []).append(index)
    for indices in by_device.values():
        # The 0-d values stacked, then each batch's vector of values once: one tensor to fetch.
        singles = [i for i in indices if pending[i].row is None]
        parts = [torch.stack([pending[i].device_value for i in singles])] if singles else []
        vector_starts: dict[int, int] = {}  # id of a batch's values -> where they start
        fetched_count = len(singles)
        for i in indices:
            vector = pending[i].device_value
            if pending[i].row is not None and id(vector) not in vector_starts:
                vector_starts[id(vector)] = fetched_count
                parts.append(vector)
                fetched_count += vector.numel()
        fetched = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        for position, i in enumerate(singles):
            values[i] = (fetched[position] + pending[i].offset) & MASK_64
        for i in indices:
            item = pending[i]
            if item.row is not None:
                values[i] = (fetched[vector_starts[id(item.device_value)] + item.row]
                             + item.offset) & MASK_64
    return values


def prepare_checksum(kind: ChecksumKind, nbytes: int, device: torch.device) -> None:
    """What a checksum of `kind` over frames of `nbytes` needs on the device, made now rather
    than at the first frame: its weights (full) or sample plan (sampled), and its kernels."""
    if check_kind(kind) == "full":
        _word_weights_on(nbytes, device)
    else:
        _sample_plan_on(nbytes, device)
    warm_up_checksums(device)


def warm_up_checksums(device: torch.device) -> None:
    """Run both kinds once on a dummy frame. Their first run on a GPU loads kernels; paid here,
    at start, that time does not fall on the first frames a consumer reads, while the next ones
    queue up behind them."""
    import torch

    if device.type != "cpu":
        dummy = torch.zeros(SAMPLE_COUNT + 3, dtype=torch.uint8, device=device)  # with a tail
        settle_checksums([checksum_start(dummy, kind) for kind in CHECKSUM_KINDS])


# ------------------------------------------------------------------------------------------------
# The probe slot's test pattern (Note [Probe slot])
# ------------------------------------------------------------------------------------------------


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
