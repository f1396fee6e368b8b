"""The independent runtime the converter is checked against (LiteRT), and the error measure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType

# (model, output) -> (max relative error, tolerance): filled by the parity tests, printed by
# conftest.pytest_terminal_summary at the end of the session.
PARITY_TABLE: dict[tuple[str, str], tuple[float, float]] = {}


def run_litert(model: str | Path | bytes, inputs: list[np.ndarray], reference_kernels: bool = False
               ) -> list[np.ndarray]:
    """Run a batch-1 model once. ``reference_kernels`` uses TFLite's builtin kernels instead of
    the default XNNPACK delegate: the spread between the two is LiteRT's own float noise."""
    kwargs = {"model_content": model} if isinstance(model, bytes) else {"model_path": str(model)}
    if reference_kernels:
        kwargs["experimental_op_resolver_type"] = OpResolverType.BUILTIN_REF
    interpreter = Interpreter(**kwargs)
    interpreter.allocate_tensors()
    for detail, value in zip(interpreter.get_input_details(), inputs):
        interpreter.set_tensor(detail["index"], np.ascontiguousarray(value, np.float32))
    interpreter.invoke()
    return [interpreter.get_tensor(d["index"]).copy() for d in interpreter.get_output_details()]


def cut_model(path: str | Path, keep_outputs: list[str]) -> bytes:
    """The model with only the operators that ``keep_outputs`` (tensor names) depend on, and those
    as its outputs: how LiteRT runs the parts of a model around operators it has no kernels for
    (MediaPipe's custom ones). Uses the flatbuffer object API that ships in every ai-edge-litert
    wheel (its ``tools`` package is missing from some, e.g. 1.4.0's)."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(bytearray(Path(path).read_bytes()), 0)
    subgraph = model.subgraphs[0]
    by_name = {tensor.name.decode() if isinstance(tensor.name, bytes) else tensor.name: index
               for index, tensor in enumerate(subgraph.tensors)}
    producers = {out: op for op in subgraph.operators for out in op.outputs}
    needed, stack = set(), [by_name[name] for name in keep_outputs]
    while stack:
        op = producers.get(stack.pop())
        if op is None or id(op) in needed:
            continue
        needed.add(id(op))
        stack.extend(i for i in op.inputs if i >= 0)
    subgraph.operators = [op for op in subgraph.operators if id(op) in needed]
    subgraph.outputs = [by_name[name] for name in keep_outputs]
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|a - b| / max(1, max|b|): relative to the output's scale, absolute below scale 1 (so
    that outputs near zero, e.g. logits of absent classes, do not inflate the measure)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} != expected {expected.shape}")
    return float(np.abs(actual - expected).max() / max(1.0, np.abs(expected).max()))
