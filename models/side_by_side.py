"""A converted model's independent branches on CUDA streams of their own, inside CUDA graphs'
work (Note [Branches side by side]).

Note [Branches side by side]
    The attention mesh refines the lips, the left eye and the right eye in three branches: 43,
    67 and 67 of its 250 operators once the converter has fused what it fuses, each reading the
    backbone's features through a crop of its own (custom_ops.TransformTensorBilinear) and
    nothing of the other branches until their landmarks are put together. At 64 faces their
    operators are small (16x16 maps of 32-128 channels): run one after the other, each leaves
    most of the GPU idle, and a graph's nodes cost their launch latency each. In a CUDA graph's
    work (triton_kernels.graph_work: the warm-up runs and the capture) the operator loop puts
    each branch's operators on a stream of its own, forked from the current stream where the
    branch first reads what that stream made, and joins every stream back into the current
    one before the forward returns: the graph then holds the branches as parallel paths, which
    the GPU runs side by side. An operator waits for another stream only where it reads a tensor
    that stream made, and that tensor is recorded on the reading stream (`record_stream`), so
    that the caching allocator never hands its memory out while it is still to be read (during
    a capture, PyTorch then keeps such blocks until the capture ends). The values are the same:
    every operator computes what it did, from the same inputs. Elsewhere (on the CPU, in eager
    runs on a GPU, under torch.compile, and in `TFLiteModule.trace`) the loop runs the operators
    in their order on the current stream, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from . import custom_ops


def branch_lanes(steps: Sequence) -> list[int]:
    """Per step (tflite_convert._Step, in order): 0 for the trunk, k for the k-th branch, a
    branch being what depends on exactly one TransformTensorBilinear crop (counted from 1, in
    the steps' order) and on no other: what depends on none (the backbone) or on several (where
    branches are put together) is the trunk. A model without such crops is all trunk."""
    made_by: dict[int, int] = {}
    crops_above: list[frozenset[int]] = []
    crops = 0
    for position, step in enumerate(steps):
        above = frozenset().union(*(crops_above[made_by[slot]] for slot in step.input_slots if slot in made_by))
        if isinstance(step.compute, custom_ops.TransformTensorBilinear):
            crops += 1
            above = above | {crops}
        crops_above.append(above)
        for slot in step.output_slots:
            made_by[slot] = position
    return [next(iter(above)) if len(above) == 1 else 0 for above in crops_above]


class CudaLanes:
    """The streams of a model's lanes on one device: lane 0 is the current stream at the
    forward's start, the others are made once per device and kept."""

    def __init__(self, device: torch.device, count: int, kept: dict):
        streams = kept.setdefault(device, [])
        while len(streams) < count - 1:
            streams.append(torch.cuda.Stream(device))
        self.streams = [torch.cuda.current_stream(device)] + streams[:count - 1]

    def wait(self, consumer: int, producer: int) -> None:
        self.streams[consumer].wait_stream(self.streams[producer])

    def record(self, tensor: torch.Tensor, lane: int) -> None:
        tensor.record_stream(self.streams[lane])

    @contextlib.contextmanager
    def use(self, lane: int) -> Iterator[None]:
        if lane == 0:
            yield
            return
        with torch.cuda.stream(self.streams[lane]):
            yield


def run(plan: Sequence[tuple], lanes: Sequence[int], values: dict[int, torch.Tensor],
        output_slots: Sequence[int], streams) -> dict[int, torch.Tensor]:
    """The operator loop of TFLiteModule._run (``plan``: (compute, input slots, output slots,
    slots dead after it)) with each step on the stream of its lane (``streams``: CudaLanes, or a
    test's stand-in with its wait, record and use), ``values`` holding the model's inputs (made
    on lane 0 before the call); every lane joined back into lane 0 at the end (Note [Branches
    side by side]). Returns ``values`` with the model's outputs."""
    issued = [1] + [0] * (max(lanes) if lanes else 0)  # lane 0's 1: what was queued before the call
    made_on = {slot: (0, 1) for slot in values}  # slot -> (lane, that lane's count once it was made)
    waited = [[0] * len(issued) for _ in issued]  # waited[c][p]: p's count that lane c waited for
    for (compute, input_slots, step_outputs, dead), lane in zip(plan, lanes):
        for slot in input_slots:
            maker, count = made_on[slot]
            if maker == lane:
                continue
            if waited[lane][maker] < count:
                streams.wait(lane, maker)
                waited[lane][maker] = issued[maker]
            streams.record(values[slot], lane)
        with streams.use(lane):
            results = compute.forward(*[values[slot] for slot in input_slots])
        if isinstance(results, torch.Tensor):
            results = (results,)
        issued[lane] += 1
        for slot, result in zip(step_outputs, results):
            values[slot] = result
            made_on[slot] = (lane, issued[lane])
        for slot in dead:
            values.pop(slot, None)
    for lane in range(1, len(issued)):
        if issued[lane]:
            streams.wait(0, lane)
    for slot in output_slots:
        if slot in values and made_on[slot][0] != 0:
            streams.record(values[slot], 0)
    return values
