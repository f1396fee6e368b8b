"""Build small ``.tflite`` models in tests, with the flatbuffer object API that LiteRT ships.

For operators that MediaPipe's shipped models do not use (the blendshape MLP-Mixer's), the tests
build one- or few-operator models here and run them in LiteRT and in the converter.
"""

from __future__ import annotations

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

_TENSOR_TYPES = {np.dtype(np.float32): schema.TensorType.FLOAT32,
                 np.dtype(np.float16): schema.TensorType.FLOAT16,
                 np.dtype(np.int32): schema.TensorType.INT32}


class TinyModel:
    """A one-subgraph model under construction: ``input``, ``const`` and ``op`` return tensor ids."""

    def __init__(self):
        self.tensors: list = []
        self.buffers = [schema.BufferT()]  # buffer 0: the conventional empty buffer
        self.operators: list = []
        self.opcodes: list = []
        self.inputs: list[int] = []

    def _tensor(self, shape, dtype, buffer: int, name: str) -> int:
        tensor = schema.TensorT()
        tensor.shape = list(shape)
        tensor.type = _TENSOR_TYPES[np.dtype(dtype)]
        tensor.buffer = buffer
        tensor.name = f"{name}_{len(self.tensors)}"
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def input(self, shape, name: str = "input") -> int:
        index = self._tensor(shape, np.float32, 0, name)
        self.inputs.append(index)
        return index

    def const(self, value, dtype=np.float32, name: str = "const") -> int:
        value = np.asarray(value, dtype=dtype)
        buffer = schema.BufferT()
        buffer.data = np.frombuffer(value.tobytes(), np.uint8).tolist()
        self.buffers.append(buffer)
        return self._tensor(value.shape, dtype, len(self.buffers) - 1, name)

    def op(self, name: str, inputs, out_shape, options=None, out_dtype=np.float32) -> int:
        code = getattr(schema.BuiltinOperator, name)
        if code not in self.opcodes:
            self.opcodes.append(code)
        operator = schema.OperatorT()
        operator.opcodeIndex = self.opcodes.index(code)
        operator.inputs = list(inputs)
        output = self._tensor(out_shape, out_dtype, 0, name.lower())
        operator.outputs = [output]
        if options is not None:
            operator.builtinOptionsType = getattr(schema.BuiltinOptions,
                                                  type(options).__name__[:-1])
            operator.builtinOptions = options
        self.operators.append(operator)
        return output

    def build(self, outputs) -> bytes:
        subgraph = schema.SubGraphT()
        subgraph.tensors = self.tensors
        subgraph.inputs = self.inputs
        subgraph.outputs = list(outputs)
        subgraph.operators = self.operators
        model = schema.ModelT()
        model.version = 3
        model.subgraphs = [subgraph]
        model.buffers = self.buffers
        model.operatorCodes = []
        for code in self.opcodes:
            opcode = schema.OperatorCodeT()
            opcode.builtinCode = code
            opcode.deprecatedBuiltinCode = min(code, 127)  # 127: "look at builtin_code"
            opcode.version = 1
            model.operatorCodes.append(opcode)
        builder = flatbuffers.Builder(1024)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())


def options(kind: str, **fields):
    """An options object, e.g. ``options("FullyConnectedOptions", keepNumDims=True)``."""
    value = getattr(schema, kind + "T")()
    for key, field_value in fields.items():
        if not hasattr(value, key):
            raise AttributeError(f"{kind} has no field {key!r}")
        setattr(value, key, field_value)
    return value
