"""Bounded batch shapes on a GPU: power-of-two batch buckets, and the CUDA graphs of the face
pipeline's fixed-shape stages (Note [CUDA graphs of the pipeline], Note [Warm shapes]).

Shared by :mod:`facecast.models.pipeline` (whose detection and mesh stages replay graphs, one
per bucket) and :mod:`facecast.models.pose` (whose models pad their batches to a bucket).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from facecast.models import triton_kernels

log = logging.getLogger(__name__)

# Note [CUDA graphs of the pipeline]
#     With ``cuda_graphs=True`` the two fixed-shape stages are captured once per shape and then
#     replayed, which removes the launch of each of their ~1,000 (detection) and ~400 (mesh)
#     kernels from the host:
#     - detection (crops, both detectors, decode, NMS, merge) for B frames of one size, B rounded
#       up to a power of two (at most MAX_GRAPH_FRAMES per graph, models/face_detection.py; more
#       frames are split); its input is a static uint8 frame buffer that the call's frames are
#       copied into;
#     - the measuring stage (mesh model, refinement, projection, blendshapes, boxes, the
#       duplicate filter, head pose, the transformation matrix: everything a Face holds, as one
#       table; Note [Measuring on the device]) for N faces rounded up to a
#       power of two (at most MAX_GRAPH_FACES per graph, more split between whole frames); its
#       inputs are the crops, rects, the detections' boxes and scores and one small table of the
#       ROIs' frames.
#     Padding rows hold stale data and their results are dropped. Outputs are copied out of the
#     graph's static tensors before anything else replays, which is what lets all graphs of a
#     pipeline share one memory pool (replays never overlap: one stream, one caller). A stage
#     whose capture fails (an operation in it copies from host memory or waits for the device)
#     runs eagerly from then on; the reason is logged and kept in ``graph_fallbacks``. Frames of
#     different sizes in one call run eagerly too. Only the crops (which read the frames where
#     they lie) run before the measuring graph, and only the Face objects after it.
#
# Note [Warm shapes]
#     On the H200 (torch 2.11, CUDA 13) the first detection pass over a new number of frames took
#     3.7-4.2 s, the first mesh pass over a new number of faces ~1.5 s (the GPU libraries preparing
#     that shape; the same with or without channels_last weights); later passes ~10 ms. In the
#     daemon the batch sizes change all the time (cameras due for detection, faces in view), so
#     eager passes kept stalling for seconds. The graphs' power-of-two buckets bound the shapes,
#     and ``warm_up`` runs every bucket a worker can meet once, at boot (or in a warm standby),
#     before any camera waits on it. The pose models pad their batches the same way
#     (BatchBuckets below, and PosePipeline.warm_up in models/pose.py).
#
#     The stall belongs to the *models'* input shapes (cuDNN preparing its kernels for a new
#     batch size), not to the frames' sizes, and it was what lost faces on real footage (issue
#     24): a file camera configured at the default 1280x720 delivered 640x360 frames, the
#     full-range detector met 1 input per frame instead of the warmed 4, and the detection
#     worker's first pass stalled for 4-9 s on the H100, with no face published meanwhile; with
#     graphs off nothing was warmed at all. So on a GPU every model's batch goes through
#     ``forward_in_buckets``, eager and inside graphs alike, and ``warm_up`` runs each model's
#     buckets themselves, for as many inputs as the cameras can give (frame sizes the config did
#     not name included); a frame size met later then only costs its own graph's capture. Each
#     bucket costs its preparation at boot (about 3 s a detector batch shape on the H100: cuDNN
#     prepares every layer's kernels anew), so the detectors' smallest bucket is 16 inputs:
#     up to 16 frames' letterboxes, or 1 to 16 inputs of whatever frame size, are one shape,
#     and running 16 small inputs where 1 would do costs the GPU next to nothing. Since the
#     full-range detector takes each frame whole (Note [The full-range detector over the whole
#     frame]), a frame is one input of it, of one shape whatever the frame's size (512x288; a
#     portrait frame 288x512): 16 to 64 frames are three shapes to prepare where 9 inputs a
#     1080p frame had made five, and READY at 64 cameras came 10 s sooner (docs/benchmarks.md).
#
#     A large batch is not padded to the next power of two but run in power-of-two pieces
#     (``batch_pieces``): 32 1080p frames give the full-range detector 288 inputs, which ran as
#     512 (19-24 ms of an H100/H200 where 256 take 10-13 ms) and needed a 512 shape prepared at
#     boot; as 256 + 32 they run in about 60 % of the time and the largest shape is 256. Pieces
#     are split off only above SPLIT_ABOVE inputs: below it a model's forward costs about the
#     same at any batch (the launches, not the arithmetic), so one padded forward is cheaper.
#     No piece is larger than LARGEST_PIECE (256): 64 cameras' 576 inputs run as 256 + 256 +
#     64, not 512 + 64. A 512 piece took about twice a 256 one (19-24 against 10-13 ms), so it
#     bought nothing, and its shape cost one more preparation at boot, in the detection worker
#     and again in its spare, of the 3-4 s each shape costs.

#
# Note [One side stream]
#     A graph is captured on a side stream after two eager runs there (Captured), and each
#     stream a process runs cuBLAS on gets its own cuBLAS workspace from the caching allocator
#     (PyTorch keys them by handle and stream; 32 MiB each on Hopper), kept for the life of the
#     process: a graph captured with it reads it by address, so nothing may free it while graphs
#     live. A new torch.cuda.Stream per capture (one of a pool of 32, round robin) meant a new
#     workspace per graph: a warm spare's models and tables are tens of MB, yet it held 305-337
#     MiB of live tensors after dropping its graphs (H100, 2026-11-26, bench/worker_memory.py),
#     and each promotion's captures took further streams. So a GraphCache makes one side stream
#     at its first capture and captures every graph on it, also after release(): its graphs
#     replay one after another on the caller's stream, never at once, as they share one pool.
#     Measured at 64 cameras on the H100 (2026-11-27, with Note [Static frames shared by a
#     stage's graphs]): live tensors of the spares 337 -> 106 (detection) and 305 -> 74 MiB
#     (roi_landmark), their processes 1,336 -> 964 and 1,266 -> 892 MiB; promoted, 2,842 ->
#     1,776 and 2,028 -> 1,280 MiB; the daemon's processes 17,600 -> 15,500 MiB.
#
# Note [Static frames shared by a stage's graphs]
#     The detection graph of B frames reads them from a static frame buffer of B frames, into
#     which each call's frames are copied. One buffer per graph made the detection worker of a
#     1080p GPU hold 1 + 2 + ... + 32 = 63 frames of them (390 MB) for the 32 its largest graph
#     reads. Graphs of one frame size share one buffer instead (GraphCache.shared_static), each
#     reading its first B frames, for the reason they share a pool: replays never overlap, and
#     a replay copies its frames in right before. warm_up captures the largest graph first, so
#     the smaller ones find the buffer made; a larger one met later makes a larger buffer (the
#     older graphs keep the one they were captured with).

def bucket(count: int, largest: int | None = None) -> int:
    """The power of two a batch of ``count`` (1..largest) is padded to (Note [Warm shapes])."""
    padded = 1 << max(0, count - 1).bit_length()
    return padded if largest is None else min(largest, padded)


def buckets_up_to(count: int, largest: int | None = None) -> list[int]:
    """Every bucket a batch of 1..count can be padded to."""
    return sorted({bucket(n, largest) for n in range(1, count + 1)})


# A batch of more inputs than this runs in power-of-two pieces (Note [Warm shapes]).
SPLIT_ABOVE = 64
# ... none of them larger than this.
LARGEST_PIECE = 256


def batch_pieces(count: int, smallest: int = 1) -> list[int]:
    """The batch shapes ``count`` inputs run as (Note [Warm shapes]): while more than
    SPLIT_ABOVE are left, the largest power of two that fits (at most LARGEST_PIECE) is split
    off; the rest is padded to its bucket, at least ``smallest``. 288 -> [256, 32],
    300 -> [256, 64], 40 -> [64], 576 -> [256, 256, 64]."""
    pieces = []
    rest = count
    while rest > SPLIT_ABOVE:
        piece = min(LARGEST_PIECE, 1 << (rest.bit_length() - 1))
        pieces.append(piece)
        rest -= piece
    if rest:
        pieces.append(max(smallest, bucket(rest)))
    return pieces


def shapes_up_to(count: int, smallest: int = 1) -> list[int]:
    """Every batch shape a batch of 1..count inputs can run as (what ``warm_up`` prepares)."""
    return sorted({piece for n in range(1, count + 1) for piece in batch_pieces(n, smallest)})


def forward_in_buckets(model: torch.nn.Module, batch: torch.Tensor, smallest: int = 1):
    """``model(batch)`` run as ``batch_pieces``, each padded with zeros, and the outputs cut
    back: a GPU then meets a handful of batch shapes, each prepared once (Note [Warm shapes]),
    instead of a new one, and a stall of seconds, per new count of frames or faces."""
    count = batch.shape[0]
    parts = []
    start = 0
    for piece in batch_pieces(count, smallest):
        part = batch[start:start + piece]
        real = part.shape[0]
        if real != piece:
            part = torch.cat([part, part.new_zeros((piece - real, *part.shape[1:]))])
        outputs = model(part)
        parts.append(outputs[:real] if isinstance(outputs, torch.Tensor)
                     else type(outputs)(output[:real] for output in outputs))
        start += piece
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return type(parts[0])(torch.cat(outputs) for outputs in zip(*parts))


class BatchBuckets(torch.nn.Module):
    """A model whose batches go through :func:`forward_in_buckets`."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: torch.Tensor):
        return forward_in_buckets(self.inner, batch)


class Captured:
    """One CUDA graph: ``fn`` (no arguments: it reads the static tensors ``statics``, which the
    caller fills before each replay) captured after two warm-up runs on
    ``side``, the GraphCache's side stream."""

    def __init__(self, fn: Callable[[], object], statics: dict, device: torch.device, pool,
                 side: torch.cuda.Stream):
        self.statics = statics
        # The graph reads every tensor it was captured with by address, also those only ``fn``'s
        # closure holds (a static batch's offset tables, the frame index): they must live as long
        # as the graph. Dropping ``fn`` freed them, the allocator handed their memory out again,
        # and replays indexed with whatever was there (a device-side "index out of bounds" on the
        # H200, for the first detection graph of a pipeline).
        self.fn = fn
        previous = torch.cuda.current_stream(device)
        side.wait_stream(previous)  # the cache's one side stream (Note [One side stream])
        with triton_kernels.graph_work():  # the kernels for graphs only (Note [PReLUs in one kernel])
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisation (cuDNN plans, cached index tensors) stays out of the graph
                    fn()
            previous.wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph, pool=pool):
                    self.outputs = fn()
            finally:
                torch.cuda.set_stream(previous)

    def replay(self):
        self.graph.replay()
        return self.outputs


class GraphCache:
    """The CUDA graphs of one pipeline's stages, one per stage and shape, in one memory pool
    (Note [CUDA graphs of the pipeline]); empty and unused unless ``enabled``."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled
        self.captured: dict[tuple, Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if enabled else None
        # Every graph's capture stream, made at the first capture (Note [One side stream]).
        self.side: torch.cuda.Stream | None = None
        # Note [Static frames shared by a stage's graphs]: name -> the largest buffer made so far.
        self.shared_statics: dict[tuple, torch.Tensor] = {}
        self.capture: Callable[..., Captured] = Captured  # tests replace it to run the graph logic on the CPU
        self.fallbacks: dict[str, str] = {}  # stage → why it runs eagerly

    def release(self) -> bool:
        """Drop every graph (their static tensors and their pool's memory go back to the
        allocator once nothing else holds them); later ones are captured into a new pool, since
        a pool whose graphs are gone cannot take new ones. Returns whether any was dropped."""
        dropped = bool(self.captured)
        self.captured.clear()
        self.shared_statics.clear()
        if self.enabled and dropped:
            self.pool = torch.cuda.graph_pool_handle()
        return dropped

    def shared_static(self, name: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A static input of ``shape`` for a graph about to be captured, as the first
        ``shape[0]`` rows of a buffer that the graphs named ``name`` share (Note [Static frames
        shared by a stage's graphs]); a new buffer when the largest so far is too small."""
        buffer = self.shared_statics.get(name)
        if (buffer is None or buffer.shape[0] < shape[0] or buffer.shape[1:] != shape[1:]
                or buffer.dtype != dtype):
            buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            self.shared_statics[name] = buffer  # graphs that hold a smaller one keep it alive
        return buffer[:shape[0]]

    def replays(self, stage: str) -> bool:
        """Whether the stage is to be replayed from graphs (enabled, and not fallen back)."""
        return self.enabled and stage not in self.fallbacks

    def get(self, stage: str, key: tuple, build) -> Captured | None:
        """The CUDA graph of a stage for one shape, captured on first use; None when the stage
        runs eagerly (Note [CUDA graphs of the pipeline])."""
        if stage in self.fallbacks:
            return None
        captured = self.captured.get((stage, key))
        if captured is None:
            try:
                fn, statics = build()
                if self.side is None and self.device.type == "cuda":
                    self.side = torch.cuda.Stream(self.device)
                captured = self.capture(fn, statics, self.device, self.pool, self.side)
            except RuntimeError as error:
                lines = str(error).strip().splitlines()
                self.fallbacks[stage] = lines[0] if lines else type(error).__name__
                log.warning("the %s stage cannot be captured in a CUDA graph (%s); it runs eagerly",
                            stage, self.fallbacks[stage])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return None
            self.captured[(stage, key)] = captured
        return captured
