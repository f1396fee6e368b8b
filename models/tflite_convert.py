"""The TFLite → PyTorch converter: read a ``.tflite`` flatbuffer, build an equivalent torch module.

``convert(path)`` returns a :class:`TFLiteModule` whose ``forward(*inputs)`` takes float tensors in
the tflite model's own layout (NHWC images) with any batch size and returns the model's outputs,
in the model's output order and with LiteRT's shapes (the batch dimension replaced by N).

This module owns the graph: reading tensors and operators, folding the constant sub-graphs that
MediaPipe's models use to store weights (float16 ``DEQUANTIZE``, sparse ``DENSIFY``), and running the
operators in order. What each operator computes lives in :mod:`facecast.models.tflite_ops` (builtin
operators) and :mod:`facecast.models.custom_ops` (MediaPipe's custom operators); see Note [Batch and
layout] there for how tflite shapes map to torch shapes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import tflite
import torch
from flatbuffers import flexbuffers

from . import custom_ops, side_by_side, tflite_ops, triton_kernels
from .tflite_ops import OpSpec, TensorSpec, UnsupportedOp, torch_to_tfl_order

log = logging.getLogger(__name__)

__all__ = ["convert", "TFLiteModule", "UnsupportedOp", "read_graph", "TFLiteGraph"]

_BUILTIN_NAMES = {code: name for name, code in vars(tflite.BuiltinOperator).items()
                  if not name.startswith("_")}

_NUMPY_DTYPES = {
    tflite.TensorType.FLOAT32: np.float32,
    tflite.TensorType.FLOAT16: np.float16,
    tflite.TensorType.FLOAT64: np.float64,
    tflite.TensorType.INT32: np.int32,
    tflite.TensorType.INT64: np.int64,
    tflite.TensorType.INT16: np.int16,
    tflite.TensorType.INT8: np.int8,
    tflite.TensorType.UINT8: np.uint8,
    tflite.TensorType.BOOL: np.bool_,
}

# The flatbuffer union that types a builtin operator's options: its type code → the option class.
_OPTION_CLASSES = {code: getattr(tflite, name) for name, code in vars(tflite.BuiltinOptions).items()
                   if not name.startswith("_") and name != "NONE" and hasattr(tflite, name)}

# Operators whose output is computed once, at conversion time, when all their inputs are constant.
# MediaPipe stores weights as float16 (DEQUANTIZE → float32) and, in the full-range face detector
# and the pose detector, as sparse float16 (DENSIFY → DEQUANTIZE).
_FOLDABLE = {"DEQUANTIZE", "DENSIFY"}


class TFLiteGraph:
    """The main subgraph of a ``.tflite`` model, read into plain Python objects."""

    def __init__(self, name: str, tensors: list[TensorSpec], operators: list[OpSpec],
                 inputs: list[int], outputs: list[int]):
        self.name = name
        self.tensors = tensors
        self.operators = operators
        self.inputs = inputs
        self.outputs = outputs


def read_graph(path: str | Path, name: str | None = None) -> TFLiteGraph:
    """Read subgraph 0 of a ``.tflite`` file: tensors (constants decoded), operators, inputs, outputs."""
    path = Path(path)
    model_name = name or path.stem
    raw = path.read_bytes()
    if len(raw) < 8 or raw[4:8] != b"TFL3":
        raise ValueError(f"{path} is not a TFLite flatbuffer (no 'TFL3' identifier)")
    model = tflite.Model.GetRootAs(raw, 0)
    if model.SubgraphsLength() != 1:
        # Control flow (WHILE/IF) would need the other subgraphs; MediaPipe's models have one.
        log.warning("%s has %d subgraphs; only the first is converted",
                    model_name, model.SubgraphsLength())
    graph = model.Subgraphs(0)

    tensors = [_read_tensor(model, graph.Tensors(i), i, raw, model_name)
               for i in range(graph.TensorsLength())]
    operators = []
    for op_index in range(graph.OperatorsLength()):
        operator = graph.Operators(op_index)
        code = model.OperatorCodes(operator.OpcodeIndex())
        builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
        op_type = _BUILTIN_NAMES.get(builtin, f"BUILTIN_{builtin}")
        if op_type == "CUSTOM":
            op_type = code.CustomCode().decode()
            options = (flexbuffers.Loads(bytes(operator.CustomOptionsAsNumpy()))
                       if operator.CustomOptionsLength() else {})
            custom = True
        else:
            options = _builtin_options(operator)
            custom = False
        operators.append(OpSpec(
            index=op_index, type=op_type, version=code.Version(), custom=custom, options=options,
            inputs=[tensors[i] if i >= 0 else None for i in operator.InputsAsNumpy()],
            outputs=[tensors[i] for i in operator.OutputsAsNumpy()],
            model=model_name))
    return TFLiteGraph(model_name, tensors, operators,
                       [int(i) for i in graph.InputsAsNumpy()],
                       [int(i) for i in graph.OutputsAsNumpy()])


def _read_tensor(model, tensor, index: int, raw: bytes, model_name: str) -> TensorSpec:
    shape = tuple(int(d) for d in tensor.ShapeAsNumpy()) if tensor.ShapeLength() else ()
    type_code = tensor.Type()
    dtype = _NUMPY_DTYPES.get(type_code)
    data = None
    buffer = model.Buffers(tensor.Buffer())
    if buffer is not None:
        if buffer.Offset() > 1:  # large models keep buffers after the flatbuffer, by offset
            payload = np.frombuffer(raw, np.uint8, count=buffer.Size(), offset=buffer.Offset())
        elif buffer.DataLength():
            payload = buffer.DataAsNumpy()
        else:
            payload = None
        if payload is not None:
            if dtype is None:
                raise UnsupportedOp(f"{model_name}: constant tensor {tensor.Name().decode()!r} has "
                                    f"tflite type {type_code}, which the converter cannot read")
            values = np.frombuffer(payload.tobytes(), dtype=dtype)
            sparsity = tensor.Sparsity()
            # A sparse tensor's buffer holds only the non-zero values; DENSIFY expands it.
            data = values if sparsity is not None else values.reshape(shape)
    quantization = tensor.Quantization()
    scale = zero_point = None
    axis = 0
    if quantization is not None and quantization.ScaleLength():
        scale = quantization.ScaleAsNumpy().astype(np.float32)
        zero_point = (quantization.ZeroPointAsNumpy().astype(np.int64)
                      if quantization.ZeroPointLength() else np.zeros_like(scale, np.int64))
        axis = quantization.QuantizedDimension()
    return TensorSpec(index=index, name=tensor.Name().decode(), shape=shape,
                      dtype=np.dtype(dtype) if dtype is not None else None, data=data,
                      sparsity=_read_sparsity(tensor.Sparsity()),
                      quant_scale=scale, quant_zero_point=zero_point, quant_axis=axis)


def _read_sparsity(sparsity) -> dict | None:
    if sparsity is None:
        return None
    levels = []
    for i in range(sparsity.DimMetadataLength()):
        meta = sparsity.DimMetadata(i)
        if meta.Format() == tflite.DimensionType.DENSE:
            levels.append(("dense", int(meta.DenseSize()), None, None))
        else:
            levels.append(("csr", 0,
                           _index_vector(meta.ArraySegmentsType(), meta.ArraySegments()),
                           _index_vector(meta.ArrayIndicesType(), meta.ArrayIndices())))
    return {
        "traversal_order": [int(d) for d in sparsity.TraversalOrderAsNumpy()],
        "block_map": [int(d) for d in sparsity.BlockMapAsNumpy()] if sparsity.BlockMapLength() else [],
        "levels": levels,
    }


def _index_vector(kind: int, table) -> np.ndarray:
    vector_class = {tflite.SparseIndexVector.Int32Vector: tflite.Int32Vector,
                    tflite.SparseIndexVector.Uint16Vector: tflite.Uint16Vector,
                    tflite.SparseIndexVector.Uint8Vector: tflite.Uint8Vector}[kind]
    vector = vector_class()
    vector.Init(table.Bytes, table.Pos)
    return vector.ValuesAsNumpy().astype(np.int64)


def _builtin_options(operator):
    option_class = _OPTION_CLASSES.get(operator.BuiltinOptionsType())
    table = operator.BuiltinOptions()
    if option_class is None or table is None:
        return None
    options = option_class()
    options.Init(table.Bytes, table.Pos)
    return options


# ---------------------------------------------------------------------------------------------
# Constant folding


def _fold_constants(graph: TFLiteGraph) -> list[OpSpec]:
    """Evaluate DEQUANTIZE/DENSIFY of constants now; return the operators left to run."""
    remaining = []
    for op in graph.operators:
        if op.type in _FOLDABLE and all(t is None or t.data is not None for t in op.inputs):
            source = op.inputs[0]
            if op.type == "DENSIFY":
                value = densify(source)
            else:
                value = _dequantize(source)
            op.outputs[0].data = value.reshape(op.outputs[0].shape)
            op.outputs[0].sparsity = None
        else:
            remaining.append(op)
    return remaining


def _dequantize(tensor: TensorSpec) -> np.ndarray:
    if tensor.sparsity is not None:
        raise UnsupportedOp(f"DEQUANTIZE of the still-sparse tensor {tensor.name!r}")
    if tensor.dtype == np.float16:
        return tensor.data.astype(np.float32)
    if tensor.quant_scale is None:
        raise UnsupportedOp(f"DEQUANTIZE of {tensor.name!r} ({tensor.dtype}) without scale")
    values = tensor.data.astype(np.float32)
    shape = [1] * values.ndim
    if values.ndim and tensor.quant_scale.size > 1:  # per-channel quantization
        shape[tensor.quant_axis] = tensor.quant_scale.size
    scale = tensor.quant_scale.reshape(shape)
    zero_point = tensor.quant_zero_point.reshape(shape).astype(np.float32)
    return (values - zero_point) * scale


def densify(tensor: TensorSpec) -> np.ndarray:
    """Expand a tflite sparse tensor (TACO-style per-dimension metadata) into a dense array.

    Each metadata level walks one dimension of the *traversal order*: a DENSE level visits every
    coordinate, a CSR level visits the coordinates ``indices[segments[p]:segments[p+1]]`` of its
    parent position ``p``. Dimensions past the tensor's rank are block dimensions; ``block_map``
    says which original dimension each one subdivides.
    """
    sparsity = tensor.sparsity
    shape = tensor.shape
    rank = len(shape)
    order = sparsity["traversal_order"]
    block_map = sparsity["block_map"]
    levels = sparsity["levels"]
    block_sizes = {}  # original dim -> block size
    for k, original_dim in enumerate(block_map):
        level_of_block = order.index(rank + k)
        block_sizes[original_dim] = levels[level_of_block][1]

    positions = np.zeros(1, np.int64)              # position in the level's storage, per path
    coordinates = np.zeros((1, len(order)), np.int64)  # per path, per traversal dim
    for level, (kind, dense_size, segments, indices) in enumerate(levels):
        dim = order[level]
        if kind == "dense":
            child = np.arange(dense_size, dtype=np.int64)
            new_positions = (positions[:, None] * dense_size + child[None, :]).reshape(-1)
            new_coords = np.repeat(coordinates, dense_size, axis=0)
            new_coords[:, dim] = np.tile(child, len(positions))
        else:
            starts, stops = segments[positions], segments[positions + 1]
            counts = stops - starts
            new_positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)]) \
                if len(positions) else np.zeros(0, np.int64)
            new_coords = np.repeat(coordinates, counts, axis=0)
            new_coords[:, dim] = indices[new_positions]
        positions, coordinates = new_positions, new_coords

    dense = np.zeros(shape, dtype=tensor.data.dtype)
    index = []
    for d in range(rank):
        coordinate = coordinates[:, d]
        if d in block_sizes:
            block_dim = rank + block_map.index(d)
            coordinate = coordinate * block_sizes[d] + coordinates[:, block_dim]
        index.append(coordinate)
    dense[tuple(index)] = tensor.data[positions]
    return dense


# ---------------------------------------------------------------------------------------------
# The module


class _Step(torch.nn.Module):
    """One operator: which graph tensors it reads and writes, and the module that computes it."""

    def __init__(self, op: OpSpec, module: torch.nn.Module):
        super().__init__()
        self.op_type = op.type
        self.op_index = op.index
        self.input_slots = [t.index for t in op.inputs if t is not None and t.data is None]
        self.output_slots = [t.index for t in op.outputs]
        self.compute = module


class TFLiteModule(torch.nn.Module):
    """A tflite model as a torch module. See the module docstring for the calling convention.

    Weights are buffers, so ``.to(device)``, ``.half()`` and ``.to(memory_format=...)`` work as
    for any module. Inputs must have the same floating dtype and device as the weights.
    """

    def __init__(self, graph: TFLiteGraph, steps: list[_Step], free_after: list[list[int]]):
        super().__init__()
        self.name = graph.name
        self.steps = torch.nn.ModuleList(steps)
        self.input_slots = list(graph.inputs)
        self.output_slots = list(graph.outputs)
        self.input_shapes = [graph.tensors[i].shape for i in graph.inputs]
        self.output_shapes = [graph.tensors[i].shape for i in graph.outputs]
        self.input_names = [graph.tensors[i].name for i in graph.inputs]
        self.output_names = [graph.tensors[i].name for i in graph.outputs]
        self._free_after = free_after
        self._plan = None  # see _run_plan
        self._lanes: list[int] = []  # per step: the trunk (0) or a branch (Note [Branches side by side])
        self._lane_streams: dict = {}  # device -> the branches' streams, made once
        self.source: Path | None = None  # the .tflite file it was converted from (convert())
        self.any_size_multiple = 0  # allow_any_input_size: inputs of any size, multiples of this
        self._tensor_names = {t.index: t.name for t in graph.tensors}
        self._tensor_shapes = {t.index: t.shape for t in graph.tensors}
        # Outputs that are constants of the graph (rare) are returned as buffers.
        self._constant_outputs = {}
        for position, slot in enumerate(graph.outputs):
            if graph.tensors[slot].data is not None:
                name = f"constant_output_{position}"
                self.register_buffer(name, torch.from_numpy(
                    np.ascontiguousarray(graph.tensors[slot].data, np.float32)))
                self._constant_outputs[slot] = name

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = self._run(inputs, keep_all=False)
        outputs = []
        batch = inputs[0].shape[0] if inputs else 1
        for slot, shape in zip(self.output_slots, self.output_shapes):
            if slot in self._constant_outputs:
                constant = getattr(self, self._constant_outputs[slot])
                outputs.append(constant.expand(batch, *constant.shape[1:]))
            else:
                outputs.append(torch_to_tfl_order(values[slot], shape).contiguous())
        return tuple(outputs)

    def trace(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor the model computes, by tflite tensor name, as [N, *per-sample shape] in
        tflite dimension order: for comparing a model operator by operator with LiteRT."""
        values = self._run(inputs, keep_all=True)
        return {self._tensor_names[slot]: torch_to_tfl_order(value, self._tensor_shapes[slot])
                for slot, value in values.items()}

    def _run(self, inputs, keep_all: bool) -> dict[int, torch.Tensor]:
        if len(inputs) != len(self.input_slots):
            raise ValueError(f"{self.name} takes {len(self.input_slots)} input(s) "
                             f"{self.input_names}, got {len(inputs)}")
        values: dict[int, torch.Tensor] = {}
        for slot, shape, x in zip(self.input_slots, self.input_shapes, inputs):
            per_sample = tuple(shape[1:]) if shape and shape[0] == 1 else tuple(shape)
            if self.any_size_multiple and x.dim() == 4:  # allow_any_input_size
                multiple = self.any_size_multiple
                height, width, channels = x.shape[1:]
                if height % multiple == 0 and width % multiple == 0 and channels == per_sample[2]:
                    per_sample = (height, width, channels)
                else:
                    raise ValueError(f"{self.name}: input {self.input_names[self.input_slots.index(slot)]!r} "
                                     f"must be (N, H, W, {per_sample[2]}) with H and W multiples of {multiple}, "
                                     f"got {tuple(x.shape)}")
            if tuple(x.shape[1:]) != per_sample:
                raise ValueError(f"{self.name}: input {self.input_names[self.input_slots.index(slot)]!r}"
                                 f" must be (N, {', '.join(map(str, per_sample))}), got "
                                 f"{tuple(x.shape)}")
            values[slot] = tflite_ops.tfl_order_to_torch(x, shape)
        plan = self._run_plan()
        if not keep_all and self._side_by_side(values):  # Note [Branches side by side]
            device = next(iter(values.values())).device
            streams = side_by_side.CudaLanes(device, max(self._lanes) + 1, self._lane_streams)
            return side_by_side.run(plan, self._lanes, values, self.output_slots, streams)
        for compute, input_slots, output_slots, dead in plan:
            results = compute.forward(*[values[i] for i in input_slots])
            if isinstance(results, torch.Tensor):
                results = (results,)
            for slot, result in zip(output_slots, results):
                values[slot] = result
            if not keep_all:
                for slot in dead:
                    values.pop(slot, None)
        return values

    # Note [The operator loop]
    #     forward() runs a few hundred small operators (the v2 landmarker 220, the blendshape
    #     model 133), and on the CPU at batch 1 the Python around each one counts: nn.Module's
    #     __call__ (hooks, tracing state) and its attribute lookups through _modules cost
    #     ~5 us an operator. The loop therefore calls each operator's forward() directly from a
    #     plan of plain tuples made once (no module hooks run on the steps; nothing in facecast
    #     sets any). Measured on the 2-core EPYC, one thread, batch 1 (same values): the v2
    #     landmarker 10.5 -> 10.0 ms a face and the blendshape model 2.2 -> 1.85 ms (processes
    #     alternating), 10.5 -> 9.4 and 2.27 -> 1.9 ms (one process, loops alternating). The plan is made again when
    #     the steps change (fuse_zero_padding).
    def _run_plan(self):
        if self._plan is None:
            self._plan = [(step.compute, tuple(step.input_slots), tuple(step.output_slots), tuple(dead))
                          for step, dead in zip(self.steps, self._free_after)]
            self._lanes = side_by_side.branch_lanes(self.steps)
        return self._plan

    def _side_by_side(self, values: dict) -> bool:
        """Whether this run puts the model's branches on streams of their own (Note [Branches
        side by side]): a model with branches, on a GPU, in a CUDA graph's work, not compiled."""
        # torch.compile first: dynamo cannot trace the graph-work flag (a ContextVar), and a
        # compiled model runs in order anyway.
        return (not torch.compiler.is_compiling() and max(self._lanes, default=0) > 0
                and triton_kernels.in_graph_work() and next(iter(values.values())).is_cuda)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, inputs={self.input_shapes}, outputs={self.output_shapes}, "
                f"operators={len(self.steps)}")


def convert(path: str | Path, name: str | None = None) -> TFLiteModule:
    """Convert the ``.tflite`` model at ``path`` into a :class:`TFLiteModule` (float32, CPU).

    ``name`` (default: the file's stem) appears in error messages and in the module's repr.
    Raises :class:`UnsupportedOp` naming the operator and the model when the model uses an
    operator the converter does not implement.
    """
    graph = read_graph(path, name)
    operators = _fold_constants(graph)

    unsupported = sorted({op.type for op in operators
                          if op.type not in tflite_ops.BUILDERS
                          and op.type not in custom_ops.BUILDERS})
    if unsupported:
        raise UnsupportedOp(f"model {graph.name!r} uses operator(s) {', '.join(unsupported)} that "
                            f"facecast's TFLite converter does not implement")

    steps = []
    for op in operators:
        builder = custom_ops.BUILDERS.get(op.type) if op.custom else tflite_ops.BUILDERS[op.type]
        if builder is None:
            raise UnsupportedOp(f"model {graph.name!r}: custom operator {op.type!r} is not implemented")
        steps.append(_Step(op, builder(op)))

    module = TFLiteModule(graph, steps, _free_after(steps, graph.outputs))
    module.source = Path(path)  # the file, for a runtime that reads it itself (Note [LiteRT on the CPU])
    return module


def _free_after(steps, graph_outputs) -> list[list[int]]:
    """Per step, the activations to drop once it ran: those it was the last reader of, so that
    large batches do not keep every intermediate alive until the end of forward()."""
    last_reader = {}
    for position, step in enumerate(steps):
        for slot in step.input_slots:
            last_reader[slot] = position
    keep = set(graph_outputs)
    free_after = [[] for _ in steps]
    for slot, position in last_reader.items():
        if slot not in keep:
            free_after[position].append(slot)
    return free_after


def use_cpu_kernels(module: torch.nn.Module) -> dict[str, int]:
    """Give every convolution of the module its CPU kernel (Note [Convolutions on the CPU]),
    for its weights as they are now: call it after the
    module is on the CPU in its dtype (and after :func:`fuse_zero_padding`). Returns how many
    convolutions got each kernel."""
    counts: dict[str, int] = {}
    for conv in module.modules():
        if isinstance(conv, tflite_ops.Conv2d):
            kernel = conv.use_cpu_kernel()
            counts[kernel] = counts.get(kernel, 0) + 1
    return counts


def fuse_layer_norms(module: TFLiteModule) -> int:
    """Put one step (:class:`~facecast.models.tflite_ops.LayerNormOverChannels`) in place of
    each layer norm over an image's channels that TFLite stores as ten operators: MEAN over
    the channels, NEG, SQUARED_DIFFERENCE, MEAN, ADD of epsilon, RSQRT, MUL by gamma, the
    input and the negated mean each times that, ADD (the blendshape model has eight: Note [Layer
    norms in one kernel]). A chain is fused only when it is wired so, one operator after the
    other, and nothing outside it reads what it computes on the way. The values are the chain's
    (it runs the same operators where the kernel does not). Returns how many were fused;
    applying it twice fuses nothing more."""
    readers = _readers(module)
    steps, kept, fused = list(module.steps), [], 0
    position = 0
    while position < len(steps):
        chain = steps[position:position + len(tflite_ops.LayerNormOverChannels.WIRING)]
        eps = _layer_norm_eps(module, chain, readers)
        if eps is None:
            kept.append(steps[position])
            position += 1
            continue
        last = chain[-1]
        last.compute = tflite_ops.LayerNormOverChannels([step.compute for step in chain], eps)
        last.input_slots = list(chain[0].input_slots)
        last.op_type = "LAYER_NORM (fused)"
        kept.append(last)
        position += len(chain)
        fused += 1
    if fused:
        _replace_steps(module, kept)
    return fused


def _layer_norm_eps(module: TFLiteModule, chain: list, readers: dict) -> float | None:
    """The epsilon of the ten steps ``chain`` when they are a layer norm over an image's channels
    as fuse_layer_norms describes it; else None."""
    wiring = tflite_ops.LayerNormOverChannels.WIRING
    types = ("MEAN", "NEG", "SQUARED_DIFFERENCE", "MEAN", "ADD", "RSQRT", "MUL", "MUL", "MUL", "ADD")
    if len(chain) != len(wiring) or tuple(step.op_type for step in chain) != types:
        return None
    if any(len(step.output_slots) != 1 for step in chain):
        return None
    x = chain[0].input_slots
    if len(x) != 1 or not tflite_ops.is_image(module._tensor_shapes[x[0]]):
        return None
    slot = {"x": x[0], **{name: chain[position].output_slots[0] for name, position, _ in wiring}}
    for name, position, inputs in wiring:
        if chain[position].input_slots != [slot[i] for i in inputs]:
            return None
    channels = module._tensor_shapes[x[0]][3]
    for mean in (chain[0].compute, chain[3].compute):
        if getattr(mean, "name", "") != "MEAN[3], keep_dims=True":
            return None
    binaries = [chain[i].compute for i in (2, 4, 6, 7, 8, 9)]
    if not all(isinstance(b, tflite_ops.Binary) and b.direct and b.activation == 0 for b in binaries):
        return None
    add_eps, times_gamma = chain[4].compute, chain[6].compute
    eps_buffer = getattr(add_eps, "constant1", None)
    gamma = getattr(times_gamma, "constant1", None)
    if (eps_buffer is None or eps_buffer.numel() != 1 or gamma is None
            or tuple(gamma.shape) != (1, channels, 1, 1)):
        return None
    inside = {slot[name] for name, _, _ in wiring if name != "out"}  # read only within the chain
    if inside & set(module.output_slots) or any(
            reader not in chain for computed in inside for reader in readers.get(computed, [])):
        return None
    return float(eps_buffer.reshape(()))


def fuse_residual_prelus(module: TFLiteModule) -> int:
    """Put one step (:class:`~facecast.models.tflite_ops.ResidualPRelu`) in place of each ADD of
    two images of its own shape (no broadcast, no constant, no fused activation) whose output
    only a per-channel PRELU reads, and is no model output: on a GPU one kernel for both (Note
    [PReLUs in one kernel]). The values are the two operators'; the ADD's output no longer
    exists for :meth:`TFLiteModule.trace`. Returns how many pairs were fused; applying it twice
    fuses nothing more."""
    readers = _readers(module)
    fused_adds = set()
    for step in module.steps:
        add = step.compute
        if not (step.op_type == "ADD" and isinstance(add, tflite_ops.Binary) and add.direct
                and add.activation == 0 and len(step.input_slots) == 2 and len(step.output_slots) == 1
                and tflite_ops.is_image(add.out_shape)
                and all(shape == add.out_shape for shape in add.operand_shapes)
                and step.output_slots[0] not in module.output_slots):
            continue
        consumers = readers.get(step.output_slots[0], [])
        if not (len(consumers) == 1 and type(consumers[0].compute) is tflite_ops.ChannelPRelu
                and consumers[0].input_slots == step.output_slots):
            continue
        prelu = consumers[0]
        prelu.compute = tflite_ops.ResidualPRelu(prelu.compute.alpha)
        prelu.input_slots = list(step.input_slots)
        prelu.op_type = "ADD+PRELU (fused)"
        fused_adds.add(id(step))
    if fused_adds:
        _replace_steps(module, [step for step in module.steps if id(step) not in fused_adds])
    return len(fused_adds)


def fuse_pooled_residuals(module: TFLiteModule) -> int:
    """Put the shortcut of each residual block that halves its image into the step that reads
    it (:class:`~facecast.models.tflite_ops.PooledResidualPRelu`): a 2x2 stride-2 MAX_POOL_2D
    without activation (padded, if at all, by one cell at the right and bottom: TF's SAME on an
    odd size), then optionally a PAD that only appends zero channels, then a fused ADD+PRELU
    (:func:`fuse_residual_prelus`, which runs first) that reads it; the pool's and the PAD's
    outputs read by nothing else and no model output. On a GPU one kernel for all four (Note
    [Residual shortcuts in one kernel]). The values are the operators'; the pool's and the PAD's
    outputs no longer exist for :meth:`TFLiteModule.trace`. Returns how many shortcuts were
    fused; applying it twice fuses nothing more."""
    producers = {slot: step for step in module.steps for slot in step.output_slots}
    readers = _readers(module)

    def only_read_by(slot, reader) -> bool:
        return slot not in module.output_slots and readers.get(slot) == [reader]

    fused_away: set[int] = set()  # the pools' and PADs' steps
    fused = 0
    for step in module.steps:
        if type(step.compute) is not tflite_ops.ResidualPRelu:
            continue
        for position, slot in enumerate(step.input_slots):
            pad_step, reader = None, step
            producer = producers.get(slot)
            if producer is not None and _appends_zero_channels(producer.compute) and only_read_by(slot, step):
                pad_step, reader = producer, producer
                slot = producer.input_slots[0]
                producer = producers.get(slot)
            if not (producer is not None and _halves_by_max(producer.compute) and only_read_by(slot, reader)):
                continue
            step.compute = tflite_ops.PooledResidualPRelu(
                step.compute.alpha, producer.compute, pad_step.compute if pad_step else None, position)
            step.input_slots[position] = producer.input_slots[0]
            step.op_type = "MAX_POOL_2D+" + ("PAD+" if pad_step else "") + "ADD+PRELU (fused)"
            fused_away.update(id(s) for s in (producer, pad_step) if s is not None)
            fused += 1
            break
    if fused_away:
        _replace_steps(module, [step for step in module.steps if id(step) not in fused_away])
    return fused


def _halves_by_max(pool) -> bool:
    """A MAX_POOL_2D the shortcut kernel does: 2x2, stride 2, no activation, padded (TF's SAME)
    by at most one cell at the right and at the bottom."""
    if type(pool) is not tflite_ops.MaxPool2d:
        return False
    padding = pool.padding or (0, 0, 0, 0)
    return (pool.kernel == (2, 2) and pool.stride == (2, 2)
            and pool.activation == 0 and padding[0] == 0 and padding[2] == 0
            and padding[1] in (0, 1) and padding[3] in (0, 1))


def _appends_zero_channels(pad) -> bool:
    """A PAD of a held image that appends zero channels and pads nothing else."""
    return (type(pad) is tflite_ops.Pad and not pad.full and pad.value == 0.0 and len(pad.torch_pads) == 6
            and pad.torch_pads[:5] == (0, 0, 0, 0, 0))


def _readers(module: TFLiteModule) -> dict[int, list]:
    """Tensor slot -> the steps that read it."""
    readers: dict[int, list] = {}
    for step in module.steps:
        for slot in step.input_slots:
            readers.setdefault(slot, []).append(step)
    return readers


def fold_depthwise_bias(module: TFLiteModule) -> int:
    """Move the bias of each depthwise convolution without activation into the 1x1 convolution
    that is its only reader: W (x + b) + c = W x + (W b + c), so the depthwise convolution runs
    without a bias and the 1x1 one adds the combined bias it adds anyway.

    On a GPU a convolution's bias is a separate pass over its output (PyTorch adds it after
    cuDNN), and the depthwise convolutions' outputs are the detectors' largest activations: at
    the daemon's batches (H100, float32, in a CUDA graph) the full-range detector's depthwise
    convolutions took 3.8 ms with their biases, 2.0 without (Note [Convolutions on the GPU],
    which also says why FacePipeline does this in float32 only). Only 1x1,
    unpadded, stride-1 readers qualify (a padded reader would add W b at the border too), and
    only when the depthwise output is not a model output. The sums are the same up to float
    rounding (float64 here). Returns how many biases moved; applying it twice moves nothing."""
    readers = _readers(module)
    folded = 0
    for step in module.steps:
        depthwise = step.compute
        if not (isinstance(depthwise, tflite_ops.Conv2d) and depthwise.groups > 1
                and depthwise.bias is not None and depthwise.activation == 0
                and step.output_slots[0] not in module.output_slots):
            continue
        consumers = readers.get(step.output_slots[0], [])
        if len(consumers) != 1 or not isinstance(consumers[0].compute, tflite_ops.Conv2d):
            continue
        pointwise = consumers[0].compute
        if not (pointwise.is_pointwise() and consumers[0].input_slots == [step.output_slots[0]]):
            continue
        weight = pointwise.weight[:, :, 0, 0].double()
        moved = weight @ depthwise.bias.double()
        combined = moved if pointwise.bias is None else pointwise.bias.double() + moved
        pointwise.bias = combined.to(pointwise.weight.dtype)
        depthwise.bias = None
        folded += 1
    if folded:
        module._plan = None
    return folded


def allow_any_input_size(module: TFLiteModule) -> int:
    """Let a fully convolutional image model take inputs of any height and width that are
    multiples of its deepest stride, which it returns: outputs per anchor grow with the input
    (Note [The full-range detector over the whole frame]).

    A convolution, a padding of fixed amounts or an elementwise operator is the same at any
    size; what a converted model fixes at its built size is each RESIZE_BILINEAR's output
    (replaced by :class:`~facecast.models.tflite_ops.Upsample2x` where it doubles, in the
    half-pixel or align-corners convention) and each RESHAPE of an image into rows (replaced by
    :class:`~facecast.models.tflite_ops.FlattenImage`). Any other operator that depends on the
    size raises :class:`~facecast.models.tflite_ops.UnsupportedOp`, naming it. At the built size
    the outputs are the model's own."""
    if len(module.input_shapes) != 1 or not tflite_ops.is_image(module.input_shapes[0]):
        raise tflite_ops.UnsupportedOp(f"{module.name}: only a model of one image input can take any size")
    size_free = (tflite_ops.Conv2d, tflite_ops.Pad, tflite_ops.Binary, tflite_ops.DepthToSpace,
                 tflite_ops.Upsample2x, tflite_ops.FlattenImage)
    smallest = min(module._tensor_shapes[slot][1] for step in module.steps for slot in step.output_slots
                   if tflite_ops.is_image(module._tensor_shapes[slot]))  # activations, not weights
    for step in module.steps:
        compute = step.compute
        in_shape = module._tensor_shapes[step.input_slots[0]] if step.input_slots else ()
        out_shape = module._tensor_shapes[step.output_slots[0]]
        if isinstance(compute, tflite_ops.ResizeBilinear) and not compute.legacy and \
                tuple(compute.out_hw) == (2 * in_shape[1], 2 * in_shape[2]):
            step.compute = tflite_ops.Upsample2x(compute.align_corners)
        elif isinstance(compute, tflite_ops.Reshape) and tflite_ops.is_image(in_shape) and \
                tuple(out_shape) == (in_shape[0], in_shape[1] * in_shape[2], in_shape[3]):
            step.compute = tflite_ops.FlattenImage()
        elif isinstance(compute, tflite_ops.Conv2d) and compute.covers_whole_input() or \
                isinstance(compute, tflite_ops.Pad) and compute.full or \
                isinstance(compute, tflite_ops.Binary) and not compute.direct or \
                not isinstance(compute, size_free):
            raise tflite_ops.UnsupportedOp(
                f"{module.name}: operator {step.op_type} ({type(compute).__name__}) depends on the input size")
    module.any_size_multiple = module.input_shapes[0][1] // smallest
    module._plan = None
    return module.any_size_multiple


def fuse_zero_padding(module: TFLiteModule) -> int:
    """Fold each PAD that pads only height and width, with zeros, equally on both sides, into
    the VALID convolution that is its only reader (the convolution pads by itself instead).

    The full-range face detector stores its SAME padding this way: 43 PADs, each a full copy of
    its activation, before every 3x3 convolution. The sums are the same; only the copy goes. The
    folded PAD's output no longer exists for :meth:`TFLiteModule.trace`. Returns how many PADs
    were folded; applying it twice folds nothing more.
    """
    readers = _readers(module)
    kept, folded = [], 0
    for step in module.steps:
        pad = step.compute
        target = None
        if (step.op_type in ("PAD", "PADV2") and isinstance(pad, tflite_ops.Pad) and not pad.full
                and pad.value == 0.0 and len(pad.torch_pads) == 6 and tflite_ops.is_image(pad.in_shape)
                and step.output_slots[0] not in module.output_slots):
            left, right, top, bottom, channels_before, channels_after = pad.torch_pads
            consumers = readers.get(step.output_slots[0], [])
            if (left == right and top == bottom and channels_before == channels_after == 0
                    and len(consumers) == 1 and isinstance(consumers[0].compute, tflite_ops.Conv2d)):
                conv = consumers[0].compute
                if conv.explicit_padding is None and tuple(conv.conv_padding) == (0, 0):
                    target = consumers[0]
        if target is None:
            kept.append(step)
            continue
        target.compute.conv_padding = (top, left)
        target.compute.in_hw = tuple(pad.in_shape[1:3])
        target.input_slots = [step.input_slots[0] if slot == step.output_slots[0] else slot
                              for slot in target.input_slots]
        for slot in target.input_slots:  # the PAD's input is now read by the convolution
            readers.setdefault(slot, []).append(target)
        folded += 1
    if folded:
        _replace_steps(module, kept)
    return folded


def _replace_steps(module: TFLiteModule, steps: list) -> None:
    """The module runs ``steps`` from now on (what each frees, and its plan, made again)."""
    module.steps = torch.nn.ModuleList(steps)
    module._free_after = _free_after(steps, module.output_slots)
    module._plan = None
