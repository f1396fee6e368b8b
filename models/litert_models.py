"""MediaPipe's models run by LiteRT on the CPU (XNNPACK), called as converted models are.

On a GPU every model is a converted torch module (:mod:`facecast.models.tflite_convert`); on
the CPU the face detectors and the FaceLandmarker models, whose graphs are LiteRT's builtin
operators, run in LiteRT instead (Note [LiteRT on the CPU]). :class:`LiteRTModel` takes and
returns what :class:`~facecast.models.tflite_convert.TFLiteModule` does: float32 tensors in the
model's own layout with any batch size in, the model's outputs with the batch dimension N out,
so the stages that call a model do not know which runtime they hold.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
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
#     own runtime, runs the whole graph in one call. On the 2-core machine, one thread
#     (2026-11-27): the v2 landmarker 2.9 ms a face against 6.7-9.2 in torch, the blendshape
#     model 0.33 against 1.3-2.2, the full-range detector over a whole frame (512x288) 7.1 ms
#     against 21. So on the CPU the FaceLandmarker models and both face detectors run in
#     LiteRT, one invoke per input (a batch of 4 faces took 3.1 ms a face: batching buys
#     nothing there), the landmark model and the full-range detector on FacePipeline's
#     cpu_threads, the small models on one (Note [Threads of the models]); the full-range
#     detector at the whole frame's input size (Note [Whole frames in LiteRT]). Not in LiteRT: the attention mesh (MediaPipe's custom operators,
#     which LiteRT lacks), the body pose models (their own pipeline) and dlib's embedding
#     network (not a .tflite); they stay torch modules, as everything on a GPU is. The numbers
#     are the same models' to float rounding: tests/models hold each converted model to
#     LiteRT's outputs. Where ai-edge-litert is missing or a model does not load in it, the
#     converted model runs, and FacePipeline.cpu_runtime_problem says why.


class LiteRTUnavailable(Exception):
    """A model cannot run in LiteRT here: the message says why (the converted model runs)."""


class LiteRTModel(torch.nn.Module):
    """A ``.tflite`` model run by a LiteRT interpreter (XNNPACK) on ``threads`` CPU threads.

    ``model(*inputs)`` takes float32 CPU tensors (N, *the model's input shape without its batch
    of 1) in the model's layout and returns a tuple of float32 tensors (N, *each output's shape
    without its batch of 1), in the model's output order: as TFLiteModule.forward. The module
    holds no weights torch sees (``.to()``, ``.float()`` and ``.eval()`` leave it as it is); it
    runs on the CPU only.

    ``image_sizes_hw``: for a fully convolutional model of one image input, the other (height,
    width) it also takes (Note [Whole frames in LiteRT]; :meth:`takes` says which).
    """

    def __init__(self, path: str | Path, name: str | None = None, *, threads: int = 1,
                 image_sizes_hw: Sequence[tuple[int, int]] = ()):
        super().__init__()
        path = Path(path)
        self.name = name or path.stem
        self.threads = max(1, int(threads))
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as exc:
            raise LiteRTUnavailable(f"ai-edge-litert is not installed ({exc})") from None
        raw = path.read_bytes()
        built = _Invoker(Interpreter, raw, self.name, self.threads)
        self.input_names = built.input_names
        self.input_shapes = built.input_shapes
        self._invokers = {built.input_shapes[0]: built}
        for height, width in image_sizes_hw:
            if len(built.input_shapes) != 1 or len(built.input_shapes[0]) != 3:
                raise LiteRTUnavailable(f"{self.name} has no single image input to take other sizes")
            shape = (int(height), int(width), built.input_shapes[0][2])
            self._invokers[shape] = _Invoker(Interpreter, _at_image_size(raw, self.name, built, shape),
                                             self.name, self.threads, shape)

    def takes(self, *input_shapes: tuple[int, ...]) -> bool:
        """Whether the model takes a first input of each of these per-sample shapes."""
        return all(tuple(shape) in self._invokers for shape in input_shapes)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"{self.name} takes {len(self.input_names)} input(s) "
                             f"{self.input_names}, got {len(inputs)}")
        batch = inputs[0].shape[0]
        # The interpreter of the first input's size; the file's own where it takes no other (a
        # wrong size is then refused below, naming the sizes it takes).
        invoker = self._invokers.get(tuple(inputs[0].shape[1:]), self._invokers[self.input_shapes[0]])
        arrays = []
        for name, shape, x in zip(self.input_names, invoker.input_shapes, inputs):
            if x.device.type != "cpu":
                raise ValueError(f"{self.name} runs in LiteRT on the CPU; input {name!r} is on {x.device}")
            if tuple(x.shape[1:]) != shape or x.shape[0] != batch:
                sizes = " or ".join(f"({batch}, {', '.join(map(str, s))})" for s in self._invokers)
                raise ValueError(f"{self.name}: input {name!r} must be {sizes}, got {tuple(x.shape)}")
            arrays.append(np.ascontiguousarray(x.detach().numpy(), dtype=np.float32))
        return invoker.run(arrays, batch)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, inputs={list(self._invokers)}, threads={self.threads}"


class _Invoker:
    """One interpreter of a model at one input size, and its tensors' indices and shapes."""

    def __init__(self, interpreter_class, raw: bytes, name: str, threads: int,
                 image_shape: tuple[int, ...] | None = None):
        try:
            with _without_the_delegates_info_line():
                self.interpreter = interpreter_class(model_content=raw, num_threads=threads)
                if image_shape is not None:
                    index = self.interpreter.get_input_details()[0]["index"]
                    self.interpreter.resize_tensor_input(index, [1, *image_shape])
                self.interpreter.allocate_tensors()
        except (RuntimeError, ValueError) as exc:
            at = f" at {image_shape[0]}x{image_shape[1]}" if image_shape else ""
            raise LiteRTUnavailable(f"{name} does not load in LiteRT{at}: {exc}") from None
        inputs, outputs = self.interpreter.get_input_details(), self.interpreter.get_output_details()
        for detail in inputs:
            if detail["dtype"] != np.float32:
                raise LiteRTUnavailable(f"{name}: input {detail['name']!r} is {detail['dtype']}, not float32")
        self.input_names = [detail["name"] for detail in inputs]
        self.input_indices = [detail["index"] for detail in inputs]
        self.input_full_shapes = [tuple(int(side) for side in detail["shape"]) for detail in inputs]
        self.input_shapes = [_per_sample(detail["shape"]) for detail in inputs]
        self.output_indices = [detail["index"] for detail in outputs]
        self.output_shapes = [_per_sample(detail["shape"]) for detail in outputs]

    def run(self, arrays: list[np.ndarray], batch: int) -> tuple[torch.Tensor, ...]:
        """One invoke per sample (Note [LiteRT on the CPU]), the outputs stacked."""
        interpreter = self.interpreter
        if batch == 1:  # get_tensor's copies are the outputs: no stacking, no second copy
            for index, full_shape, array in zip(self.input_indices, self.input_full_shapes, arrays):
                interpreter.set_tensor(index, array.reshape(full_shape))
            interpreter.invoke()
            return tuple(torch.from_numpy(interpreter.get_tensor(index).astype(np.float32, copy=False)
                                          .reshape(1, *shape))
                         for index, shape in zip(self.output_indices, self.output_shapes))
        results = [np.empty((batch, *shape), np.float32) for shape in self.output_shapes]
        for sample in range(batch):
            for index, full_shape, array in zip(self.input_indices, self.input_full_shapes, arrays):
                interpreter.set_tensor(index, array[sample].reshape(full_shape))
            interpreter.invoke()
            for index, result in zip(self.output_indices, results):
                result[sample] = interpreter.get_tensor(index).reshape(result.shape[1:])
        return tuple(torch.from_numpy(result) for result in results)


# LiteRT's native logger prints this line to the process's stderr when a process makes its first
# XNNPACK interpreter, and it has no setting or variable to turn its INFO lines off: a user of
# `facecast analyze --quiet` would see it on the terminal. So what the interpreter's creation
# writes to file descriptor 2 is caught and written back without it (any other line, and
# whatever another thread wrote meanwhile, comes out unchanged, a few milliseconds late).
_DELEGATES_INFO_LINE = b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU."


@contextlib.contextmanager
def _without_the_delegates_info_line():
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught.read().splitlines(keepends=True)
                            if not line.startswith(_DELEGATES_INFO_LINE))
            if kept:
                os.write(2, kept)


# Note [Whole frames in LiteRT]
#     The full-range detector takes whole frames (Note [The full-range detector over the whole
#     frame]): a 512x288 input where the file's is 192x192. Its graph is convolutions, paddings
#     and elementwise operators, which LiteRT sizes from the input, two RESHAPEs to rows of
#     anchors whose shapes are (1, -1, k) already, and three RESIZE_BILINEARs to a size stored as
#     a constant (12x12, 24x24, 48x48 at 192): resized to another input, the upsampled maps no
#     longer match the maps they are added to and LiteRT refuses the graph. So the model is
#     given each other input size as a copy of its file with those constants scaled with the
#     input (18x32, 36x64, 72x128 at 288x512), the rest as it was, and the interpreter is
#     resized to it; what else would depend on the size LiteRT refuses when it prepares the
#     graph (LiteRTUnavailable: the converted model runs). Against the converted model at
#     512x288 (allow_any_input_size, its own rules for the same operators): the same outputs
#     within 1.3e-4 of values up to 168, and 7.1 ms an input against 21 ms in torch (the 2-core
#     machine, one thread, 2026-11-27).
def _at_image_size(raw: bytes, name: str, built: _Invoker, image_shape: tuple[int, int, int]) -> bytes:
    """The model's bytes with each RESIZE_BILINEAR's constant size scaled from the built
    input's height and width to ``image_shape``'s (Note [Whole frames in LiteRT])."""
    import tflite

    built_h, built_w = built.input_shapes[0][:2]
    height, width = image_shape[:2]
    data = bytearray(raw)
    model = tflite.Model.GetRootAs(data, 0)
    graph = model.Subgraphs(0)
    resize = tflite.BuiltinOperator.RESIZE_BILINEAR
    for op_index in range(graph.OperatorsLength()):
        operator = graph.Operators(op_index)
        code = model.OperatorCodes(operator.OpcodeIndex())
        if max(code.BuiltinCode(), code.DeprecatedBuiltinCode()) != resize:
            continue
        tensor = graph.Tensors(operator.Inputs(1))
        buffer = model.Buffers(tensor.Buffer())
        if buffer is not None and buffer.Offset() > 1:  # a large model's buffer after the flatbuffer
            size = np.frombuffer(data, np.int32, count=2, offset=buffer.Offset())
        elif buffer is not None and buffer.DataLength() == 8:
            size = buffer.DataAsNumpy().view(np.int32)
        else:
            raise LiteRTUnavailable(f"{name}: RESIZE_BILINEAR {op_index} computes its size; it cannot "
                                    "be given another input size")
        # `size` is a view into `data`: written in place.
        scaled = (int(size[0]) * height / built_h, int(size[1]) * width / built_w)
        if any(side != int(side) for side in scaled):
            raise LiteRTUnavailable(f"{name}: {height}x{width} is not a multiple of its upsamplings "
                                    f"({int(size[0])}x{int(size[1])} at {built_h}x{built_w})")
        size[:] = [int(scaled[0]), int(scaled[1])]
    return bytes(data)


def _per_sample(shape) -> tuple[int, ...]:
    """A LiteRT tensor's shape without its batch of 1 (a shape without one is kept whole, as
    TFLiteModule keeps it)."""
    shape = tuple(int(side) for side in shape)
    return shape[1:] if shape and shape[0] == 1 else shape
