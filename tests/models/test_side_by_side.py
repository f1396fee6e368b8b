"""Note [Branches side by side] (models/side_by_side.py): which operators of a converted model
are a branch, and the operator loop that runs each branch on a stream of its own: on the CPU
with a stand-in for the streams that logs what the loop asks of them (every read of another
lane's tensor must come after a wait for that lane that covers the tensor's making, and every
lane is joined back), and on the GPU machine the attention mesh in a CUDA graph with its
branches side by side against the same graph without them."""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest
import torch

from facecast.models import side_by_side, tflite_convert, triton_kernels

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")


def _prepared(path):
    """The model with the converter's fusions the face stack applies (FacePipeline._prepare)."""
    model = tflite_convert.convert(path).eval()
    tflite_convert.fuse_zero_padding(model)
    tflite_convert.fuse_layer_norms(model)
    tflite_convert.fuse_residual_prelus(model)
    tflite_convert.fuse_pooled_residuals(model)
    return model


def _crops(model, count: int, seed: int) -> torch.Tensor:
    size = model.input_shapes[0][1]
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(count, size, size, 3, generator=gen) * 2 - 1


def test_the_attention_meshs_three_refinements_are_its_branches(installed_models, landmarker_bundle):
    """The lips (43 operators), the left eye and the right eye (67 each) are branches, the rest
    (backbone, crops' matrices, the landmarks put together) the trunk; a model without crops
    (the v2 landmarker, a detector) is all trunk."""
    model = _prepared(installed_models["face_landmark_with_attention"])
    model._run_plan()
    assert Counter(model._lanes) == {0: 73, 1: 43, 2: 67, 3: 67}
    assert sorted(model._lanes[:65]) == [0] * 65  # the backbone
    for path in (landmarker_bundle.face_landmarks_detector, installed_models["face_detection_short_range"]):
        plain = _prepared(path)
        plain._run_plan()
        assert set(plain._lanes) == {0}


class LoggedLanes:
    """A stand-in for side_by_side.CudaLanes on the CPU: the loop's requests, in order."""

    def __init__(self):
        self.log: list[tuple] = []
        self.lane_now = 0

    def wait(self, consumer: int, producer: int) -> None:
        self.log.append(("wait", consumer, producer))

    def record(self, tensor: torch.Tensor, lane: int) -> None:
        self.log.append(("record", lane, tensor.data_ptr()))

    @contextlib.contextmanager
    def use(self, lane: int):
        self.log.append(("step", lane))
        yield


def test_each_branch_waits_for_what_it_reads_and_every_lane_is_joined(installed_models, monkeypatch):
    """The loop with its lanes gives the model's outputs (on the CPU each step still runs at
    once); and in its log, every step that reads a tensor another lane made comes after a wait
    of its lane for that lane issued once the tensor's step was (the stream order a GPU needs),
    with the tensor recorded on the reading lane; lane 0 waits for every branch at the end."""
    path = installed_models["face_landmark_with_attention"]
    model = _prepared(path)
    crops = _crops(model, 2, seed=3)
    with torch.inference_mode():
        expected = model(crops)
        lanes = LoggedLanes()
        monkeypatch.setattr(tflite_convert.TFLiteModule, "_side_by_side", lambda self, values: True)
        monkeypatch.setattr(side_by_side, "CudaLanes", lambda device, count, kept: lanes)
        got = model(crops)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    # Replay the log: which steps each lane has issued, and what each wait covered.
    plan, lane_of = model._run_plan(), model._lanes
    issued = {lane: 0 for lane in set(lane_of)}
    covered = {}  # (consumer, producer) -> producer's steps issued when the consumer waited
    made = {slot: (0, 0) for slot in model.input_slots}  # slot -> (lane, its count when made)
    step_index = 0
    for entry in lanes.log:
        if entry[0] == "wait":
            _, consumer, producer = entry
            covered[(consumer, producer)] = issued[producer]
        elif entry[0] == "step":
            lane = entry[1]
            assert lane == lane_of[step_index]
            _, input_slots, output_slots, _ = plan[step_index]
            for slot in input_slots:
                maker, count = made[slot]
                if maker != lane:
                    assert covered.get((lane, maker), -1) >= count, (step_index, slot, maker)
            issued[lane] += 1
            for slot in output_slots:
                made[slot] = (lane, issued[lane])
            step_index += 1
    assert step_index == len(plan)
    assert all(covered.get((0, lane)) == issued[lane] for lane in (1, 2, 3))  # the joins, at the end
    steps_at = [k for k, entry in enumerate(lanes.log) if entry[0] == "step"]
    assert all(entry[0] == "wait" or entry[0] == "record" for entry in lanes.log[steps_at[-1] + 1:])
    assert sum(entry[0] == "record" for entry in lanes.log) >= 3 * 2  # each branch's features and matrix


def test_branches_run_in_order_outside_a_graphs_work(installed_models, monkeypatch):
    """On the CPU, and on a GPU outside a graph's work, the loop never asks for lanes."""
    model = _prepared(installed_models["face_landmark_with_attention"])
    crops = _crops(model, 1, seed=4)
    monkeypatch.setattr(side_by_side, "run", lambda *args: pytest.fail("lanes used outside a graph's work"))
    with torch.inference_mode():
        model(crops)
        with triton_kernels.graph_work():
            model(crops)  # a graph's work, but on the CPU


def test_a_compiled_model_is_traced_whole_in_a_graphs_work(installed_models):
    """Under torch.compile (Note [Compiled models]: fullgraph) the loop asks nothing dynamo
    cannot trace, in a graph's work too: the lanes' check reads the graph-work flag only when
    not compiling (on the GPU machine, `fp16+graphs+compile` failed on it, 2026-11-27 16:08)."""
    model = _prepared(installed_models["face_landmark_with_attention"])
    crops = _crops(model, 1, seed=7)
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    with torch.inference_mode():
        expected = model(crops)
        with triton_kernels.graph_work():
            got = compiled(crops)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_on_the_gpu_the_branches_side_by_side_give_the_same_outputs_in_a_graph(installed_models, half):
    """The attention mesh prepared as the face stack prepares it, captured in a CUDA graph with
    its branches side by side (the graph's work) and replayed on new crops, against the same
    model run eagerly in a graph's work with the branches in order: the same outputs, bit for
    bit (each operator runs the same kernel on the same inputs)."""
    from facecast.models import cuda_graphs
    from facecast.models.pipeline import FacePipeline

    pipeline = FacePipeline("cuda", half=half)
    model = pipeline._prepare(tflite_convert.convert(installed_models["face_landmark_with_attention"]))
    dtype = torch.float16 if half else torch.float32
    static = _crops(model, 64, seed=5).to("cuda", dtype)
    with torch.inference_mode():
        graphs = cuda_graphs.GraphCache(torch.device("cuda"), enabled=True)
        captured = graphs.get("mesh", (64,), lambda: ((lambda: model(static)), {"crops": static}))
        assert captured is not None, graphs.fallbacks
        fresh = _crops(model, 64, seed=6).to("cuda", dtype)
        static.copy_(fresh)
        got = [t.clone() for t in captured.replay()]
        with triton_kernels.graph_work(), pytest.MonkeyPatch.context() as patch:
            patch.setattr(tflite_convert.TFLiteModule, "_side_by_side", lambda self, values: False)
            expected = model(fresh)
        torch.cuda.synchronize()
    assert max(model._lanes) == 3 and [len(streams) for streams in model._lane_streams.values()] == [3]
    for a, b in zip(expected, got):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    assert np.isfinite(got[0].float().cpu().numpy()).all()
