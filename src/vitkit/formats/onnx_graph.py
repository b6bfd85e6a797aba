"""An ONNX file as data: its tensors read safely (shapes checked against the bytes held, external data only from
the model's own directory), who produces and consumes each tensor, and the values a graph computes from its
constants and static shapes (`Graph.value`). `onnx_parse` follows a ViT's structure over it.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitkit.errors import CheckpointError


def _squeeze(node, x, axes=None):
    axes = _attr(node, "axes") if axes is None else axes
    return np.squeeze(x, tuple(int(a) for a in np.ravel(axes))) if axes is not None else np.squeeze(x)


def _unsqueeze(node, x, axes=None):
    axes = _attr(node, "axes") if axes is None else axes
    return np.expand_dims(x, tuple(int(a) for a in np.ravel(axes)))


def _slice(node, x, starts, ends, axes=None, steps=None):
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * x.ndim
    for a, start, end, step in zip(axes, starts, ends, steps, strict=True):
        index[int(a)] = slice(int(start), int(end), int(step))
    return x[tuple(index)]


def _cast(node, x):
    from onnx import helper

    return x.astype(helper.tensor_dtype_to_np_dtype(_attr(node, "to")))


# The operators `Graph.value` computes, on numpy arrays (inputs in the node's order; a missing one is None).
FOLDABLE: dict[str, Callable[..., Any]] = {
    "Identity": lambda node, x: x,
    "Cast": _cast,
    "Sqrt": lambda node, x: np.sqrt(x) if np.all(x >= 0) else None,
    "Reciprocal": lambda node, x: 1 / x,
    "Mul": lambda node, x, y: x * y,
    "Div": lambda node, x, y: x / y,
    "Pow": lambda node, x, y: np.power(x, y),
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Slice": _slice,
    "Gather": lambda node, x, i: np.take(x, i, axis=_attr(node, "axis", 0)),
    "Where": lambda node, c, x, y: np.where(c, x, y),
    # Broadcast to a shape the batch leaves open: the values, unbroadcast, are all any use here reads.
    "Expand": lambda node, x, shape: x,
    "Concat": lambda node, *xs: np.concatenate([np.ravel(x) for x in xs]) if _attr(node, "axis", 0) == 0 else None,
}


class Graph:
    """Initializers, constants, and who produces and consumes each tensor."""

    def __init__(self, model: Any, path: str | os.PathLike) -> None:
        from onnx import numpy_helper

        graph = model.graph
        self.model, self.path = model, path
        self._shapes: dict[str, list[int]] | None = None
        self.params: dict[Any, np.ndarray] = {}  # names as onnx gives them (untyped)
        for t in graph.initializer:
            if t.name in self.params:  # later ones would silently replace earlier ones, as in a JSON header
                raise CheckpointError(path, "the graph holds two initializers of this name.", t.name)
            self.params[t.name] = initializer_array(t, path)
        self.consts: dict[str, np.ndarray] = {}
        self.producer, self.consumers = {}, defaultdict(list)
        self.origin: dict[str, str] = {}  # Identity copies of an initializer (exporters share equal tensors so)
        for node in graph.node:
            if node.op_type == "Identity" and node.input[0] in self.params:
                self.origin[node.output[0]] = self.origin.get(node.input[0], node.input[0])
                self.params[node.output[0]] = self.params[node.input[0]]
            if node.op_type == "Constant":
                self.consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            for name in node.output:
                self.producer[name] = node
            for name in node.input:
                self.consumers[name].append(node)
        inputs = [i for i in graph.input if i.name not in self.params]
        if not inputs:
            raise ValueError("the graph has no input that is not a weight, so no image input")
        self.input = inputs[0]
        self.taken: set[str] = set()

    def param(self, name: str | None) -> torch.Tensor:
        if name is None:
            raise ValueError("a node expected to read a weight reads none")
        origin = self.origin.get(name, name)
        self.taken.add(origin)
        array = self.params[name]
        if array.dtype.kind != "f":  # an integer or bool tensor would be converted silently into nonsense weights
            raise CheckpointError(
                self.path, f"weights of dtype {array.dtype}; a ViT's weights are floating point.", origin
            )
        return torch.from_numpy(np.array(array, dtype=np.float32))

    def constant(self, name: str) -> np.ndarray | None:
        return self.consts.get(name, self.params.get(name))

    def value(self, name: str, depth: int = 0) -> np.ndarray | None:
        """Tensor `name`'s value where it is a constant, or computed from constants and static shapes by the few
        operators below (the legacy exporter writes the attention scale as 1/sqrt of the query's last dimension,
        read off its `Shape`); None where it depends on the data. A dimension the graph leaves open (the batch)
        reads -1, as in a `Reshape`'s shape."""
        known = self.constant(name)
        if name in self.params:  # read as an operator's constant (a scale, a mask): used, not left out
            self.taken.add(self.origin.get(name, name))
        node = self.producer.get(name)
        if known is not None or node is None or depth > 16:
            return known
        if node.op_type == "Shape":
            dims = self.static_shape(node.input[0])
            return None if dims is None else np.array(dims[_attr(node, "start", 0) : _attr(node, "end")], np.int64)
        if node.op_type not in FOLDABLE:
            return None
        args = []
        for i in node.input:  # an optional input left out is "", and None to the operator
            args.append(self.value(i, depth + 1) if i else None)
            if i and args[-1] is None:
                return None
        try:
            return FOLDABLE[node.op_type](node, *args)
        except (TypeError, ValueError, IndexError):  # an input left open (None), or shapes that do not fit
            return None

    def static_shape(self, name: str) -> list[int] | None:
        """Tensor `name`'s shape by ONNX shape inference; an open dimension (the batch) is -1."""
        if self._shapes is None:
            from onnx import shape_inference

            try:
                inferred = shape_inference.infer_shapes(self.model, data_prop=True).graph
            except Exception:  # noqa: BLE001 - a graph onnx cannot infer shapes for leaves every shape open
                inferred = None
            infos = [] if inferred is None else [*inferred.value_info, *inferred.input, *inferred.output]
            self._shapes = {
                i.name: [d.dim_value if d.HasField("dim_value") else -1 for d in i.type.tensor_type.shape.dim]
                for i in infos
                if i.type.tensor_type.HasField("shape")
            }
        return self._shapes.get(name)

    def users(self, name: str, op: str) -> list:
        return [n for n in self.consumers[name] if n.op_type == op]

    def param_input(self, node) -> str | None:
        """The node's initializer input, if it has exactly one."""
        found = [i for i in node.input if i in self.params]
        return found[0] if len(found) == 1 else None


# Bytes per element of the numeric tensor types (onnx.TensorProto.DataType): what a shape claims is checked
# against the bytes the file holds before anything is read or allocated.
ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}


def _claimed_bytes(t, path) -> int:
    """The bytes tensor `t`'s shape and type claim; a CheckpointError for a negative dimension or, where its data
    is stored raw, an unknown type."""
    if any(d < 0 for d in t.dims):
        raise CheckpointError(path, f"the shape {list(t.dims)} has a negative dimension.", t.name)
    if t.data_type not in ITEM_BYTES:
        raise CheckpointError(
            path, f"tensor type {t.data_type} stored as raw bytes is not a numeric type vitkit reads.", t.name
        )
    return math.prod(t.dims) * ITEM_BYTES[t.data_type]


def initializer_array(t, path) -> np.ndarray:
    """Initializer `t` as an array; a CheckpointError naming it if its shape claims other than the data it holds."""
    from onnx import numpy_helper

    if t.HasField("raw_data") or t.data_location == t.EXTERNAL:
        claimed = _claimed_bytes(t, path)
        if claimed != len(t.raw_data):
            raise CheckpointError(
                path, f"the shape {list(t.dims)} claims {claimed:,} bytes; the file holds {len(t.raw_data):,}.", t.name
            )
    try:
        return numpy_helper.to_array(t)
    except Exception as e:  # noqa: BLE001 - onnx and numpy fail in their own ways on a malformed tensor
        raise CheckpointError(path, f"unreadable initializer ({type(e).__name__}: {str(e)[:200]}).", t.name) from e


def load_external_data(model, path) -> None:
    """Read the initializers stored in other files, after checking each reference: a file of the model's own
    directory (never a path leading out of it), and an offset and length within that file that match the
    tensor's shape, so nothing is read from elsewhere and nothing of a claimed size is allocated. (onnx checks
    some of this itself since 1.23; vitkit supports onnx>=1.16, so it checks everything here.)"""
    directory = Path(path).resolve().parent
    for t in _tensors(model.graph):
        if t.data_location != t.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        file = (directory / location).resolve()
        if not location or os.path.isabs(location) or not file.is_relative_to(directory) or not file.is_file():
            raise CheckpointError(
                path, f"its external data {location!r} must be a file in the model's own directory {directory}.", t.name
            )
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
        except ValueError as e:
            raise CheckpointError(path, f"external data offset or length is not a number ({e}).", t.name) from e
        size, claimed = file.stat().st_size, _claimed_bytes(t, path)
        length = size - offset if length == -1 else length
        if offset < 0 or length != claimed or offset + length > size:
            raise CheckpointError(
                path,
                f"external data {location!r}: {length:,} bytes from offset {offset:,} in a "
                f"file of {size:,} bytes, for a shape {list(t.dims)} of {claimed:,} bytes.",
                t.name,
            )
        with open(file, "rb") as f:
            f.seek(offset)
            t.raw_data = f.read(length)
        t.data_location = t.DEFAULT
        del t.external_data[:]


def _tensors(graph) -> list:
    """The initializers and the tensors of node attributes (a `Constant`'s value) of the graph: all that may keep
    its data in another file. (Subgraphs are not followed, so their tensors are never read.)"""
    found = list(graph.initializer)
    for node in graph.node:
        for a in node.attribute:
            found += ([a.t] if a.HasField("t") else []) + list(a.tensors)
    return found


def _attr(node, name: str, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default
