"""A reader of dlib's binary serialization, enough for the DNNs dlib publishes (``*.dat``).

dlib writes a network with its own ``serialize()`` overloads (``dlib/serialize.h``,
``dlib/dnn/core.h``, ``layers.h``, ``input.h``, ``loss.h``); nothing in the file names the layer
types or the graph, so a reader needs the network's type, the C++ template that was serialized
(:class:`Spec` lists, outermost layer first, built by the caller: see
``models/face_embedding.py``). This module knows the encodings and the per-layer records; it never
runs dlib. See Note [dlib's serialization].

Note [dlib's serialization]
    Primitives (``serialize.h``):
    - an integer is a control byte and then its magnitude's bytes, little-endian: the low 4 bits
      of the control byte are the byte count (1..8; zero is written as one 0 byte), bit 0x80 is
      the sign (signed types only). A count of 0 or more than the type's width is corrupt data;
    - a floating-point number (``float``, ``double``) is ``float_details``: a signed 64-bit
      mantissa then a signed 16-bit exponent, both integers as above, value ``mantissa·2^exponent``;
      exponents 32000/32001/32002 mean +inf/-inf/NaN. (An older ASCII form exists; its control
      byte has bits 0x70 set, and the published models do not use it.)
    - a ``bool`` is the byte ``'1'`` or ``'0'``; a ``std::string`` an unsigned length, then bytes;
    - a ``tensor``: the integer version 2, then num_samples, k, nr, nc, then that many 4-byte
      little-endian IEEE floats (``dlib/cuda/tensor.h``); an ``alias_tensor`` (a view into a
      layer's parameter tensor): version 1 and its four dimensions, no data.
    Network (``core.h``): a layer writes its own header, then its whole subnetwork, then its own
    trailer. So a file reads outermost layer first for headers and innermost first for the layer
    records that follow them:
    - ``add_loss_layer``: version 1, the loss record, the subnetwork;
    - ``add_layer`` over a layer: version 1 or 2, the subnetwork, then the layer record, three
      bools (setup called, gradient stale, output disabled), the tensors x_grad and
      cached_output, and (version 2) params_grad;
    - ``add_layer`` directly over the input layer: version 2 or 3, the input layer's record,
      the layer record, the three bools, x_grad, cached_output, grad_final, and (version 3)
      the sample expansion factor (an integer);
    - ``add_tag_layer`` and ``add_skip_layer`` (tag ids are in the type, not the file): version 1
      and the subnetwork.
    Each layer record starts with a version string (``"con_4"``, ``"affine_"``, ``"relu_"`` …)
    that names the layer type and the record's layout; the reader checks it against the type it
    expects at that position, which is what catches a file of another network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# float_details' special exponents (dlib/float_details.h).
_EXPONENT_INF, _EXPONENT_NINF, _EXPONENT_NAN = 32000, 32001, 32002


class DlibFormatError(ValueError):
    """The bytes are not what dlib would have written here; ``offset_bytes`` says where."""

    def __init__(self, message: str, offset_bytes: int):
        super().__init__(f"at byte {offset_bytes}: {message}")
        self.offset_bytes = offset_bytes


class DlibReader:
    """dlib's primitive encodings over an in-memory buffer (see Note [dlib's serialization])."""

    def __init__(self, data: bytes | memoryview):
        self.data = memoryview(data)
        self.offset_bytes = 0

    def _take(self, count: int, what: str) -> memoryview:
        end = self.offset_bytes + count
        if end > len(self.data):
            raise DlibFormatError(f"the data ends while reading {what} ({count} bytes needed, "
                                  f"{len(self.data) - self.offset_bytes} left): truncated file",
                                  self.offset_bytes)
        chunk = self.data[self.offset_bytes:end]
        self.offset_bytes = end
        return chunk

    def integer(self, what: str = "an integer", signed: bool = True, width_bytes: int = 8) -> int:
        start = self.offset_bytes
        control = self._take(1, what)[0]
        count = control & 0x0F
        if control & 0x70 or count == 0 or count > width_bytes or (control & 0x80 and not signed):
            raise DlibFormatError(f"byte 0x{control:02x} does not start {what} (dlib's integer "
                                  f"control byte: 1..{width_bytes} bytes, sign bit only if signed)",
                                  start)
        value = int.from_bytes(self._take(count, what), "little")
        return -value if control & 0x80 else value

    def count(self, what: str) -> int:
        """An unsigned size (``unsigned long``, ``size_t``)."""
        return self.integer(what, signed=False)

    def real(self, what: str = "a floating-point number") -> float:
        start = self.offset_bytes
        if len(self.data) > start and self.data[start] & 0x70:
            raise DlibFormatError(f"{what} is in dlib's old ASCII float format, which this reader "
                                  "does not read", start)
        mantissa = self.integer(f"the mantissa of {what}")
        exponent = self.integer(f"the exponent of {what}", width_bytes=2)
        if exponent == _EXPONENT_INF:
            return math.inf
        if exponent == _EXPONENT_NINF:
            return -math.inf
        if exponent == _EXPONENT_NAN:
            return math.nan
        return math.ldexp(mantissa, exponent)

    def boolean(self, what: str = "a bool") -> bool:
        start = self.offset_bytes
        byte = self._take(1, what)[0]
        if byte not in (ord("0"), ord("1")):
            raise DlibFormatError(f"byte 0x{byte:02x} is not a bool ('0' or '1') for {what}", start)
        return byte == ord("1")

    def string(self, what: str = "a string") -> str:
        length = self.count(f"the length of {what}")
        start = self.offset_bytes
        try:
            return bytes(self._take(length, what)).decode("ascii")
        except UnicodeDecodeError:
            raise DlibFormatError(f"{what} is not ASCII", start) from None

    def version(self, allowed: tuple[int, ...], what: str) -> int:
        start = self.offset_bytes
        version = self.integer(f"the version of {what}")
        if version not in allowed:
            raise DlibFormatError(f"{what} has version {version}, expected "
                                  f"{' or '.join(map(str, allowed))}", start)
        return version

    def tag(self, allowed: tuple[str, ...], what: str) -> str:
        """A layer record's leading version string, one of ``allowed``."""
        start = self.offset_bytes
        name = self.string(f"the record name of {what}")
        if name not in allowed:
            raise DlibFormatError(f"found the record {name!r} where {what} ({' or '.join(map(repr, allowed))}) "
                                  "belongs: not the network this reader expects", start)
        return name

    def tensor(self, what: str = "a tensor") -> np.ndarray:
        """A ``resizable_tensor``: float32 (num_samples, k, nr, nc), read-only, no copy."""
        self.version((2,), what)
        shape = tuple(self.integer(f"a dimension of {what}") for _ in range(4))
        if any(size < 0 for size in shape):
            raise DlibFormatError(f"{what} has negative dimensions {shape}", self.offset_bytes)
        values = int(np.prod(shape, dtype=np.int64))
        data = self._take(4 * values, f"the {values} floats of {what} {shape}")
        return np.frombuffer(data, dtype="<f4").reshape(shape)

    def alias_tensor(self, what: str = "an alias tensor") -> tuple[int, int, int, int]:
        self.version((1,), what)
        return tuple(self.integer(f"a dimension of {what}") for _ in range(4))

    def at_end(self) -> bool:
        return self.offset_bytes == len(self.data)


# ---------------------------------------------------------------------------------------------
# Layer records. Each reader returns a Layer whose ``kind`` is the spec's kind.


@dataclass
class Spec:
    """One wrapper of the serialized C++ type, as the template nests them (outermost first).

    ``kind``: "loss_metric", "fc", "con", "affine", "relu", "max_pool", "avg_pool",
    "add_prev", "tag", "skip" or "input_rgb_image_sized"; ``args``: what the type fixes (e.g.
    the filter count, kernel and stride of a ``con``, the tag id of a tag/skip/add_prev),
    checked against the file where the file records it."""

    kind: str
    args: dict = field(default_factory=dict)


@dataclass
class Layer:
    """A layer as read: its spec and the record's fields (tensors as float32 numpy arrays)."""

    spec: Spec
    fields: dict
    offset_bytes: int  # where its record starts in the file

    @property
    def kind(self) -> str:
        return self.spec.kind


def _expect(condition: bool, message: str, offset_bytes: int) -> None:
    if not condition:
        raise DlibFormatError(message, offset_bytes)


def _read_con(reader: DlibReader, spec: Spec) -> dict:
    record = reader.offset_bytes
    version = reader.tag(("con_4", "con_5", "con_6"), "a con layer")
    params = reader.tensor("con's parameters")
    num_filters = reader.integer("con's filter count")
    nr, nc = reader.integer("con's kernel rows"), reader.integer("con's kernel columns")
    stride_y, stride_x = reader.integer("con's row stride"), reader.integer("con's column stride")
    padding_y, padding_x = reader.integer("con's row padding"), reader.integer("con's column padding")
    filters = reader.alias_tensor("con's filters")
    biases = reader.alias_tensor("con's biases")
    for what in ("learning rate", "weight decay", "bias learning rate", "bias weight decay"):
        reader.real(f"con's {what} multiplier")
    use_bias = True
    if version in ("con_5", "con_6"):
        use_bias = reader.boolean("con's use_bias")
    if version == "con_6":
        reader.boolean("con's use_relu")
    expected = (spec.args["filters"], spec.args["kernel"], spec.args["kernel"],
                spec.args["stride"], spec.args["stride"])
    _expect((num_filters, nr, nc, stride_y, stride_x) == expected,
            f"con has filters, kernel and strides {(num_filters, nr, nc, stride_y, stride_x)}, "
            f"the network defines {expected}", record)
    weight_count = int(np.prod(filters))
    bias_count = int(np.prod(biases)) if use_bias else 0
    _expect(filters[0] == num_filters and filters[2:] == (nr, nc) and params.size == weight_count + bias_count,
            f"con's parameter tensor holds {params.size} floats, its filters {filters} and biases "
            f"{biases} need {weight_count + bias_count}", record)
    flat = params.reshape(-1)
    return {"weight": flat[:weight_count].reshape(filters),
            "bias": flat[weight_count:weight_count + bias_count] if use_bias else None,
            "stride": stride_y, "padding": (padding_y, padding_x)}


def _read_affine(reader: DlibReader, spec: Spec) -> dict:
    record = reader.offset_bytes
    name = reader.string("the record name of an affine layer")
    if name.startswith("bn_"):
        raise DlibFormatError(f"found a batch-norm record ({name!r}) where the inference network has "
                              "an affine layer: a training-time network, not the published model", record)
    _expect(name in ("affine_", "affine_2"), f"found the record {name!r} where an affine layer belongs",
            record)
    params = reader.tensor("affine's parameters")
    gamma = reader.alias_tensor("affine's gamma")
    beta = reader.alias_tensor("affine's beta")
    mode = reader.integer("affine's mode")
    disabled = reader.boolean("affine's disabled flag") if name == "affine_2" else False
    count = int(np.prod(gamma))
    _expect(mode == 0, f"affine layer in mode {mode}; the network's affine layers are per channel "
                       "(CONV_MODE, 0)", record)
    _expect(gamma == beta and params.size == 2 * count,
            f"affine's parameter tensor holds {params.size} floats for gamma {gamma} and beta {beta}", record)
    flat = params.reshape(-1)
    return {"gamma": flat[:count], "beta": flat[count:], "disabled": disabled}


def _read_relu(reader: DlibReader, spec: Spec) -> dict:
    name = reader.tag(("relu_", "relu_2"), "a relu layer")
    disabled = reader.boolean("relu's disabled flag") if name == "relu_2" else False
    return {"disabled": disabled}


def _read_pool(reader: DlibReader, spec: Spec) -> dict:
    record = reader.offset_bytes
    reader.tag((f"{spec.kind}_2",), f"a {spec.kind} layer")
    nr, nc = reader.integer("the pool's rows"), reader.integer("the pool's columns")
    stride_y, stride_x = reader.integer("the pool's row stride"), reader.integer("the pool's column stride")
    padding_y, padding_x = reader.integer("the pool's row padding"), reader.integer("the pool's column padding")
    expected = (spec.args["window"], spec.args["window"], spec.args["stride"], spec.args["stride"])
    _expect((nr, nc, stride_y, stride_x) == expected,
            f"{spec.kind} has window and strides {(nr, nc, stride_y, stride_x)}, the network defines "
            f"{expected}", record)
    return {"window": nr, "stride": stride_y, "padding": (padding_y, padding_x)}


def _read_add_prev(reader: DlibReader, spec: Spec) -> dict:
    reader.tag(("add_prev_",), "an add_prev layer")
    return {}


def _read_fc(reader: DlibReader, spec: Spec) -> dict:
    record = reader.offset_bytes
    name = reader.tag(("fc_2", "fc_3"), "an fc layer")
    num_outputs = reader.count("fc's output count")
    num_inputs = reader.count("fc's input count")
    params = reader.tensor("fc's parameters")
    weights = reader.alias_tensor("fc's weights")
    reader.alias_tensor("fc's biases")  # its size follows from the weights
    bias_mode = reader.integer("fc's bias mode")
    for what in ("learning rate", "weight decay", "bias learning rate", "bias weight decay"):
        reader.real(f"fc's {what} multiplier")
    use_bias = reader.boolean("fc's use_bias") if name == "fc_3" else True
    has_bias = bias_mode == 0 and use_bias  # FC_HAS_BIAS = 0, FC_NO_BIAS = 1
    _expect(num_outputs == spec.args["outputs"] and bias_mode == (0 if spec.args["bias"] else 1),
            f"fc has {num_outputs} outputs and bias mode {bias_mode}, the network defines "
            f"{spec.args['outputs']} outputs {'with' if spec.args['bias'] else 'without'} bias", record)
    weight_count = num_inputs * num_outputs
    _expect(weights[:2] == (num_inputs, num_outputs) and params.size == weight_count + (num_outputs if has_bias else 0),
            f"fc's parameter tensor holds {params.size} floats for weights {weights}", record)
    flat = params.reshape(-1)
    # dlib computes output = input · W with W (num_inputs, num_outputs), row-major.
    return {"weight": flat[:weight_count].reshape(num_inputs, num_outputs),
            "bias": flat[weight_count:] if has_bias else None}


def _read_input_rgb_image_sized(reader: DlibReader, spec: Spec) -> dict:
    record = reader.offset_bytes
    reader.tag(("input_rgb_image_sized",), "the input layer")
    means = tuple(reader.real(f"the input's mean {colour}") for colour in ("red", "green", "blue"))
    nr, nc = reader.count("the input's rows"), reader.count("the input's columns")
    _expect((nr, nc) == (spec.args["size"], spec.args["size"]),
            f"the input layer takes {nr}x{nc} images, the network defines {spec.args['size']}", record)
    return {"mean_rgb": means, "size": nr}


def _read_loss_metric(reader: DlibReader, spec: Spec) -> dict:
    name = reader.tag(("loss_metric_", "loss_metric_2"), "the loss layer")
    if name == "loss_metric_":
        return {"margin": 0.1, "distance_threshold": 0.75}  # hard-coded in that version
    return {"margin": reader.real("the loss's margin"),
            "distance_threshold": reader.real("the loss's distance threshold")}


_RECORD_READERS = {
    "con": _read_con, "affine": _read_affine, "relu": _read_relu, "max_pool": _read_pool,
    "avg_pool": _read_pool, "add_prev": _read_add_prev, "fc": _read_fc,
}


def read_network(data: bytes | memoryview, specs: list[Spec]) -> list[Layer]:
    """Read a network serialized by dlib whose type is ``specs`` (outermost first: the loss, …,
    the input layer last). Returns its layers input first, the loss last, tags and skips
    included (they carry no data: their ids are the specs'). Raises :class:`DlibFormatError`
    naming the byte offset and what was expected there; trailing bytes are an error too."""
    _expect(bool(specs) and specs[0].kind == "loss_metric" and specs[-1].kind == "input_rgb_image_sized",
            "the spec must run from a loss_metric to an input_rgb_image_sized", 0)
    reader = DlibReader(data)
    layers: list[Layer] = []
    reader.version((1,), "the loss layer (add_loss_layer)")
    loss = Layer(specs[0], {}, reader.offset_bytes)
    loss.fields = _read_loss_metric(reader, specs[0])
    # Headers outermost first; what each layer writes after its subnetwork is read afterwards,
    # innermost first (see Note [dlib's serialization]).
    pending: list[tuple[Spec, int]] = []  # (spec, add_layer version) awaiting their trailer
    body = specs[1:-1]
    for position, spec in enumerate(body):
        if spec.kind in ("tag", "skip"):
            reader.version((1,), f"a {spec.kind}{spec.args.get('id', '')} layer")
            if position == len(body) - 1:
                raise DlibFormatError("a tag or skip directly over the input layer is not supported",
                                      reader.offset_bytes)
            pending.append((spec, 0))
            continue
        if spec.kind not in _RECORD_READERS:
            raise ValueError(f"unknown layer kind {spec.kind!r} in the network spec")
        over_input = position == len(body) - 1
        pending.append((spec, reader.version((2, 3) if over_input else (1, 2),
                                             f"the {spec.kind} layer's add_layer")))
    input_layer = Layer(specs[-1], {}, reader.offset_bytes)
    input_layer.fields = _read_input_rgb_image_sized(reader, specs[-1])
    layers.append(input_layer)
    for index, (spec, wrapper_version) in enumerate(reversed(pending)):
        if spec.kind in ("tag", "skip"):
            layers.append(Layer(spec, {}, reader.offset_bytes))
            continue
        layer = Layer(spec, {}, reader.offset_bytes)
        layer.fields = _RECORD_READERS[spec.kind](reader, spec)
        for what in ("setup flag", "gradient flag", "output flag"):
            reader.boolean(f"the {spec.kind} layer's {what}")
        reader.tensor(f"the {spec.kind} layer's x_grad")
        reader.tensor(f"the {spec.kind} layer's cached output")
        if index == 0:  # the add_layer over the input layer
            reader.tensor(f"the {spec.kind} layer's grad_final")
            if wrapper_version >= 3:
                reader.integer(f"the {spec.kind} layer's sample expansion factor")
        elif wrapper_version == 2:
            reader.tensor(f"the {spec.kind} layer's params_grad")
        layers.append(layer)
    layers.append(loss)
    if not reader.at_end():
        raise DlibFormatError(f"{len(reader.data) - reader.offset_bytes} bytes follow the network: "
                              "not a file of this network alone", reader.offset_bytes)
    return layers
