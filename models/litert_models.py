"""MediaPipe's models run by LiteRT on the CPU (XNNPACK), called as converted models are.

On a GPU every model is a converted torch module (:mod:`facecast.models.tflite_convert`); on
the CPU the models whose graphs LiteRT runs as they are (builtin operators, the input size of
the file) run in LiteRT instead (Note [LiteRT on the CPU]). :class:`LiteRTModel` takes and
returns what :class:`~facecast.models.tflite_convert.TFLiteModule` does: float32 tensors in the
model's own layout with any batch size in, the model's outputs with the batch dimension N out,
so the stages that call a model do not know which runtime they hold.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

# Note [LiteRT on the CPU]
#     A converted model runs its graph as a few hundred small torch operators (the v2
#     landmarker 220, the blendshape model 133), and on the CPU at a face or two per call a
#     fixed cost per operator is about half of its time: the torch build on these machines has
#     no XNNPACK, and torch.jit, torch.compile and oneDNN for every convolution did not help
#     (docs/benchmarks.md, `facecast analyze`). XNNPACK, LiteRT's CPU delegate and MediaPipe's
#     own runtime, runs the whole graph in one call. On the 2-core machine, one thread, a face
#     (2026-11-27): the v2 landmarker 2.9 ms against 6.7-9.2 in torch, the blendshape model
#     0.33 against 1.3-2.2, the short-range detector 0.64 ms a frame. So on the CPU the
#     FaceLandmarker models and the short-range detector run in LiteRT, one invoke per input (a
#     batch of 4 faces took 3.1 ms a face: batching buys nothing there), on as many threads as
#     torch has (Note [One thread on the CPU] for `facecast analyze`). Not in LiteRT: the attention
#     mesh (MediaPipe's custom operators, which LiteRT lacks), the full-range detector (it
#     takes whole frames of any size, Note [The full-range detector over the whole frame], and
#     XNNPACK fails to prepare its graph at 512x288) and the body pose models (their own
#     pipeline); they stay converted torch modules, as everything on a GPU is. The numbers are
#     the same models' to float rounding: tests/models hold each converted model to LiteRT's
#     outputs. Where ai-edge-litert is missing or a model does not load in it, the converted
#     model runs, and FacePipeline.cpu_runtime_problem says why.


class LiteRTUnavailable(Exception):
    """A model cannot run in LiteRT here: the message says why (the converted model runs)."""


class LiteRTModel(torch.nn.Module):
    """A ``.tflite`` model run by a LiteRT interpreter (XNNPACK) on ``threads`` CPU threads.

    ``model(*inputs)`` takes float32 CPU tensors (N, *the model's input shape without its batch
    of 1) in the model's layout and returns a tuple of float32 tensors (N, *each output's shape
    without its batch of 1), in the model's output order: as TFLiteModule.forward. The module
    holds no weights torch sees (``.to()``, ``.float()`` and ``.eval()`` leave it as it is); it
    runs on the CPU only.
    """

    def __init__(self, path: str | Path, name: str | None = None, *, threads: int = 1):
        super().__init__()
        path = Path(path)
        self.name = name or path.stem
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as exc:
            raise LiteRTUnavailable(f"ai-edge-litert is not installed ({exc})") from None
        try:
            self._interpreter = Interpreter(model_path=str(path), num_threads=max(1, int(threads)))
            self._interpreter.allocate_tensors()
        except (RuntimeError, ValueError) as exc:
            raise LiteRTUnavailable(f"{self.name} does not load in LiteRT: {exc}") from None
        self.threads = max(1, int(threads))
        inputs, outputs = self._interpreter.get_input_details(), self._interpreter.get_output_details()
        self._input_indices = [detail["index"] for detail in inputs]
        self._input_full_shapes = [tuple(int(side) for side in detail["shape"]) for detail in inputs]
        self._output_indices = [detail["index"] for detail in outputs]
        self.input_names = [detail["name"] for detail in inputs]
        self.input_shapes = [_per_sample(detail["shape"]) for detail in inputs]
        self._output_shapes = [_per_sample(detail["shape"]) for detail in outputs]
        for detail in inputs:
            if detail["dtype"] != np.float32:
                raise LiteRTUnavailable(f"{self.name}: input {detail['name']!r} is {detail['dtype']}, "
                                        "not float32")

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self._input_indices):
            raise ValueError(f"{self.name} takes {len(self._input_indices)} input(s) "
                             f"{self.input_names}, got {len(inputs)}")
        batch = inputs[0].shape[0] if inputs else 1
        arrays = []
        for name, shape, x in zip(self.input_names, self.input_shapes, inputs):
            if x.device.type != "cpu":
                raise ValueError(f"{self.name} runs in LiteRT on the CPU; input {name!r} is on {x.device}")
            if tuple(x.shape[1:]) != shape or x.shape[0] != batch:
                raise ValueError(f"{self.name}: input {name!r} must be ({batch}, "
                                 f"{', '.join(map(str, shape))}), got {tuple(x.shape)}")
            arrays.append(np.ascontiguousarray(x.detach().numpy(), dtype=np.float32))
        results = [np.empty((batch, *shape), np.float32) for shape in self._output_shapes]
        interpreter = self._interpreter
        for sample in range(batch):
            for index, full_shape, array in zip(self._input_indices, self._input_full_shapes, arrays):
                interpreter.set_tensor(index, array[sample].reshape(full_shape))
            interpreter.invoke()
            for index, result in zip(self._output_indices, results):
                result[sample] = interpreter.get_tensor(index).reshape(result.shape[1:])
        return tuple(torch.from_numpy(result) for result in results)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, inputs={self.input_shapes}, threads={self.threads}"


def _per_sample(shape) -> tuple[int, ...]:
    """A LiteRT tensor's shape without its batch of 1 (a shape without one is kept whole, as
    TFLiteModule keeps it)."""
    shape = tuple(int(side) for side in shape)
    return shape[1:] if shape and shape[0] == 1 else shape
