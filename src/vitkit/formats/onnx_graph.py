"""Reading an ONNX file's tensors safely, and the ViT backbone of a graph from elsewhere by its structure (`parse`).

Exporters name initializers as they please (`onnx::MatMul_1966`) and may store q, k and v in any order, so
nothing here trusts a name: the graph is followed from its image input. The patch-embedding `Conv`, then the
class token `Concat` and the posemb `Add`; then, block by block along the residual stream, the LayerNorm (a
`LayerNormalization` node or its decomposed `ReduceMean`/`Sub`/`Pow`/`Sqrt`/`Div` form), the three projections
that read it (which is the query, the key and the value is read off the attention `MatMul`s they feed: query on
the left of the score product, key on its right, value after the softmax), the output projection, LayerScale
`Mul`s, the residual `Add`s and the MLP (exact GELU via `Erf`, or tanh). The scale of the scores is checked to
be 1/sqrt(head_dim). The final LayerNorm ends the backbone; every initializer not taken (a decoder, a head) is
named in a warning. A posemb the graph resamples with a `Resize` is resampled the same way to `image_size`.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from .common import Tensors, _listing

PASS_THROUGH = {"Reshape", "Transpose", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Mul", "Div"}


class Graph:
    """Initializers, constants, and who produces and consumes each tensor."""

    def __init__(self, model: Any, path: str | os.PathLike) -> None:
        from onnx import numpy_helper

        graph = model.graph
        self.path = path
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


def _fail(path, what: str) -> ValueError:
    return ValueError(f"{path}: not a ViT backbone graph vitkit can read ({what}).")


def _attr(node, name: str, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


@dataclass
class Linear:
    weight: torch.Tensor  # (out, in), as nn.Linear holds it
    bias: torch.Tensor  # zeros where the graph adds none
    out: str


@dataclass
class Parsed:
    """What the graph holds, in our terms, and the name of the backbone's output tensor."""

    tensors: Tensors = field(default_factory=dict)
    heads: int = 0
    layers: int = 0
    act: str = "gelu"
    eps: float = 1e-6
    layer_scale: bool = False
    patch: tuple[int, int] = (16, 16)
    image_size: tuple[int, int] | None = None
    resize: dict | None = None  # the posemb's Resize, if the graph resamples it
    output: str = ""


def _linear(g: Graph, matmul, path) -> Linear:
    """A `MatMul` with an initializer weight (in, out), and the `Add` of a bias after it, if any."""
    weight_name = g.param_input(matmul)
    weight = g.param(weight_name)
    if matmul.input[0] == weight_name:
        raise _fail(path, f"weight on the left of {matmul.name}")
    out, bias = matmul.output[0], torch.zeros(weight.shape[1])
    adds = [n for n in g.users(out, "Add") if g.param_input(n) and g.params[g.param_input(n)].ndim == 1]
    if len(adds) == 1 and len(g.consumers[out]) == 1:
        bias, out = g.param(g.param_input(adds[0])), adds[0].output[0]
    return Linear(weight.T.contiguous(), bias, out)


def _projections(g: Graph, x: str) -> list:
    return [n for n in g.users(x, "MatMul") if g.param_input(n) and g.params[g.param_input(n)].ndim == 2]


def _layer_norm(g: Graph, x: str, path) -> tuple[torch.Tensor, torch.Tensor, float, str]:
    """The LayerNorm applied to `x`: (weight, bias, eps, output name)."""
    fused = g.users(x, "LayerNormalization")
    if fused:
        node = fused[0]
        return g.param(node.input[1]), g.param(node.input[2]), float(_attr(node, "epsilon", 1e-5)), node.output[0]
    subs = [n for n in g.users(x, "Sub") if n.input[0] == x and g.producer.get(n.input[1], None) is not None]
    subs = [n for n in subs if g.producer[n.input[1]].op_type == "ReduceMean"]
    if len(subs) != 1:
        raise _fail(path, f"no LayerNorm reads {x}")
    centred = subs[0].output[0]
    div = g.users(centred, "Div")
    if len(div) != 1:
        raise _fail(path, f"LayerNorm after {x} has no normalising Div")
    sqrt = g.producer[div[0].input[1]]
    add_eps = g.producer[sqrt.input[0]]
    eps = next((float(c) for c in map(g.constant, add_eps.input) if c is not None), None)
    if eps is None:  # (a StopIteration here would escape every caller's error handling)
        raise _fail(path, f"LayerNorm after {x} adds no constant epsilon")
    mul = g.users(div[0].output[0], "Mul")[0]
    add = g.users(mul.output[0], "Add")[0]
    return g.param(g.param_input(mul)), g.param(g.param_input(add)), float(eps), add.output[0]


def _follow(g: Graph, name: str, stop: set[str]) -> tuple[Any, int, float]:
    """From tensor `name` through reshapes, transposes and scalings to the first node of a `stop` kind: that node,
    the input slot it is reached at, and the product of the scalar factors on the way."""
    scale = 1.0
    for _ in range(16):
        nodes = [n for n in g.consumers[name] if n.op_type not in ("Shape",)]
        hit = [n for n in nodes if n.op_type in stop]
        if hit:
            return hit[0], list(hit[0].input).index(name), scale
        moves = [n for n in nodes if n.op_type in PASS_THROUGH]
        if len(moves) != 1:
            break
        node = moves[0]
        if node.op_type in ("Mul", "Div"):
            other = next((i for i in node.input if i != name), None)
            factor = None if other is None else g.constant(other)
            if factor is None or np.size(factor) != 1:
                break
            scale *= float(factor) if node.op_type == "Mul" else 1.0 / float(factor)
        name = node.output[0]
    return None, -1, scale


def _heads(g: Graph, name: str, hidden: int) -> int | None:
    """The number of heads from the Reshape that splits a projection into (..., heads, head_dim)."""
    for _ in range(4):
        reshape = g.users(name, "Reshape")
        if reshape:
            shape_node = g.producer.get(reshape[0].input[1])
            if shape_node is not None and shape_node.op_type == "Concat":
                parts = [g.constant(i) for i in shape_node.input[-2:]]
                if any(part is None for part in parts):
                    return None
                dims = [int(np.ravel(part)[0]) for part in parts if part is not None]
            else:
                shape = g.constant(reshape[0].input[1])
                if shape is None:
                    return None
                dims = [int(d) for d in shape[-2:]]
            if dims.count(-1) > 1:
                return None
            heads, width = dims
            heads = hidden // width if heads == -1 else heads  # (..., -1, head_dim) as Hugging Face writes it
            width = hidden // heads if width == -1 else width
            return heads if heads * width == hidden else None
        nodes = [n for n in g.consumers[name] if n.op_type in PASS_THROUGH]
        if len(nodes) != 1:
            return None
        name = nodes[0].output[0]
    return None


def _residual_add(g: Graph, branch: str, x: str, path) -> str:
    adds = [n for n in g.users(branch, "Add") if x in n.input]
    if len(adds) != 1:
        raise _fail(path, f"no residual Add of {branch} and {x}")
    return adds[0].output[0]


def _layer_scale(g: Graph, name: str) -> tuple[torch.Tensor | None, str]:
    muls = [n for n in g.users(name, "Mul") if g.param_input(n) and g.params[g.param_input(n)].ndim == 1]
    if len(muls) == 1:
        return g.param(g.param_input(muls[0])), muls[0].output[0]
    return None, name


def _block(g: Graph, p: Parsed, i: int, x: str, ln: tuple, path) -> str:
    """Block i reading the residual stream `x` (its first LayerNorm `ln` found already); returns its output."""
    ours = f"blocks.{i}"
    t = p.tensors
    t[f"{ours}.norm1.weight"], t[f"{ours}.norm1.bias"], p.eps, h = ln
    projs = [_linear(g, m, path) for m in _projections(g, h)]
    if len(projs) != 3:
        raise _fail(path, f"block {i}: {len(projs)} projections read the LayerNorm, expected separate q, k, v")
    role: dict[str, tuple[Linear, float]] = {}
    for proj in projs:
        node, slot, scale = _follow(g, proj.out, {"MatMul"})
        if node is None:
            raise _fail(path, f"block {i}: a projection does not reach an attention product")
        softmax, _, _ = _follow(g, node.output[0], {"Softmax"})
        kind = ("q" if slot == 0 else "k") if softmax is not None else "v"
        if kind in role:
            raise _fail(path, f"block {i}: two projections act as {kind}")
        role[kind] = (proj, scale)
    if set(role) != {"q", "k", "v"}:
        raise _fail(path, f"block {i}: found {sorted(role)} among the attention inputs")
    hidden = role["q"][0].weight.shape[0]
    p.heads = _heads(g, role["q"][0].out, hidden) or p.heads
    if not p.heads:
        raise _fail(path, f"block {i}: cannot read the number of heads from the query's Reshape")
    scores, _, _ = _follow(g, role["q"][0].out, {"MatMul"})
    _, _, score_scale = _follow(g, scores.output[0], {"Softmax"})
    scale = role["q"][1] * role["k"][1] * score_scale
    if not math.isclose(scale, (hidden // p.heads) ** -0.5, rel_tol=1e-4):
        raise _fail(path, f"block {i}: attention scores scaled by {scale:.6g}, not 1/sqrt(head_dim)")
    q, k, v = (role[r][0] for r in "qkv")
    t[f"{ours}.attn.qkv.weight"] = torch.cat([q.weight, k.weight, v.weight])
    t[f"{ours}.attn.qkv.bias"] = torch.cat([q.bias, k.bias, v.bias])
    softmax, _, _ = _follow(g, scores.output[0], {"Softmax"})
    mix, _, _ = _follow(g, softmax.output[0], {"MatMul"})
    proj_node, _, _ = _follow(g, mix.output[0], {"MatMul"})
    if proj_node is None or not g.param_input(proj_node):
        raise _fail(path, f"block {i}: no output projection after the attention")
    out = _linear(g, proj_node, path)
    t[f"{ours}.attn.proj.weight"], t[f"{ours}.attn.proj.bias"] = out.weight, out.bias
    gamma1, branch = _layer_scale(g, out.out)
    x = _residual_add(g, branch, x, path)
    t[f"{ours}.norm2.weight"], t[f"{ours}.norm2.bias"], _, h = _layer_norm(g, x, path)
    fc1_nodes = _projections(g, h)
    if len(fc1_nodes) != 1:
        raise _fail(path, f"block {i}: expected one MLP input layer after the second LayerNorm")
    fc1 = _linear(g, fc1_nodes[0], path)
    fc2_node, _, _ = _follow_any(g, fc1.out, p, i, path)
    fc2 = _linear(g, fc2_node, path)
    t[f"{ours}.mlp.fc1.weight"], t[f"{ours}.mlp.fc1.bias"] = fc1.weight, fc1.bias
    t[f"{ours}.mlp.fc2.weight"], t[f"{ours}.mlp.fc2.bias"] = fc2.weight, fc2.bias
    gamma2, branch = _layer_scale(g, fc2.out)
    if (gamma1 is None) != (gamma2 is None):
        raise _fail(path, f"block {i}: LayerScale on one residual branch only")
    if gamma1 is not None and gamma2 is not None:
        p.layer_scale = True
        t[f"{ours}.ls1.gamma"], t[f"{ours}.ls2.gamma"] = gamma1, gamma2
    return _residual_add(g, branch, x, path)


def _follow_any(g: Graph, name: str, p: Parsed, i: int, path):
    """Through the activation (any ops) to the next MatMul with a weight; the ops seen decide the GELU kind."""
    seen: set[str] = set()
    frontier = [name]
    for _ in range(32):
        nodes = [n for f in frontier for n in g.consumers[f]]
        for n in nodes:
            if n.op_type == "MatMul" and g.param_input(n):
                p.act = "gelu" if "Erf" in seen else "gelu_tanh" if "Tanh" in seen else ""
                if not p.act:
                    raise _fail(path, f"block {i}: MLP activation made of {sorted(seen)} is not a GELU")
                return n, 0, 1.0
        seen |= {n.op_type for n in nodes}
        frontier = [n.output[0] for n in nodes]
    raise _fail(path, f"block {i}: no second MLP layer")


def _embedding(g: Graph, p: Parsed, path) -> str:
    """Patch embedding, class token and posemb; returns the name of z_0."""
    name = g.input.name
    conv = None
    for _ in range(4):
        convs = g.users(name, "Conv")
        if convs:
            conv = convs[0]
            break
        casts = [n for n in g.consumers[name] if n.op_type in ("Cast", "Identity")]
        if not casts:
            break
        name = casts[0].output[0]
    if conv is None:
        raise _fail(path, "no patch-embedding Conv reads the image")
    kernel, strides = tuple(_attr(conv, "kernel_shape")), tuple(_attr(conv, "strides", [1, 1]))
    if kernel != strides or any(_attr(conv, "pads", [0, 0, 0, 0])):
        raise _fail(path, f"patch Conv with kernel {kernel}, strides {strides}: patches must not overlap")
    p.patch = kernel
    p.tensors["embedding.weight"] = g.param(conv.input[1])
    p.tensors["embedding.bias"] = g.param(conv.input[2]) if len(conv.input) > 2 else torch.zeros(kernel[0])
    concat, _, _ = _follow(g, conv.output[0], {"Concat"})
    if concat is None:
        raise _fail(path, "no class token is concatenated before the patch tokens")
    p.tensors["cls_token"] = g.param(_root_param(g, concat.input[0], path))
    adds = g.users(concat.output[0], "Add")
    if len(adds) != 1:
        raise _fail(path, "no position embedding is added to the tokens")
    posemb = next((i for i in adds[0].input if i != concat.output[0]), None)
    if posemb is None:
        raise _fail(path, "the tokens are added to themselves, not to a position embedding")
    if posemb in g.params:
        p.tensors["posemb.weight"] = g.param(posemb)
    else:
        pieces = g.producer[posemb]
        if pieces.op_type != "Concat" or len(pieces.input) != 2:
            raise _fail(path, "the position embedding is neither one table nor class row + patch grid")
        cls_row = g.param(_root_param(g, pieces.input[0], path))
        grid = g.param(_root_param(g, pieces.input[1], path))
        p.resize = _find_resize(g, pieces.input[1])
        p.tensors["posemb.weight"] = torch.cat([cls_row.reshape(1, 1, -1), grid.reshape(1, -1, cls_row.shape[-1])], 1)
    shape = [d.dim_value for d in g.input.type.tensor_type.shape.dim][2:]
    if len(shape) == 2 and all(shape):
        p.image_size = (shape[0], shape[1])
    return adds[0].output[0]


def _root_param(g: Graph, name: str, path) -> str:
    """The one initializer a tensor is computed from (through Expand, Reshape, Resize, ...)."""
    frontier, found = [name], []
    for _ in range(32):
        if not frontier:
            break
        nxt = []
        for f in frontier:
            if f in g.params and g.params[f].ndim >= 2:
                found.append(f)
            elif f in g.producer:  # data flows through input 0 (the rest are shapes, sizes...), except in Concat
                node = g.producer[f]
                nxt += [i for i in (node.input if node.op_type == "Concat" else node.input[:1]) if i]
        frontier = nxt
    if len(set(found)) != 1:
        raise _fail(path, f"{name} is not computed from exactly one weight tensor ({sorted(set(found))})")
    return found[0]


def _find_resize(g: Graph, name: str) -> dict | None:
    frontier = [name]
    for _ in range(16):
        nodes = [g.producer[f] for f in frontier if f in g.producer]
        for n in nodes:
            if n.op_type == "Resize":
                return {
                    "mode": _attr(n, "mode", "nearest"),
                    "coordinates": _attr(n, "coordinate_transformation_mode", "half_pixel"),
                    "cubic_coeff_a": _attr(n, "cubic_coeff_a", -0.75),
                    "antialias": bool(_attr(n, "antialias", 0)),
                }
        frontier = [i for n in nodes for i in n.input if i]
    return None


def parse(model, path) -> Parsed:
    """Follow the graph `model` (an `onnx.ModelProto`) from the image to the backbone's final LayerNorm."""
    g = Graph(model, path)
    p = Parsed()
    x = _embedding(g, p, path)
    ln = _layer_norm(g, x, path)
    while len(_projections(g, ln[3])) == 3:
        x = _block(g, p, p.layers, x, ln, path)
        p.layers += 1
        ln = _layer_norm(g, x, path)
    if not p.layers:
        raise _fail(path, "no Transformer block found after the embedding")
    p.tensors["encoder_norm.weight"], p.tensors["encoder_norm.bias"], _, p.output = ln
    p.eps = float(f"{p.eps:.6g}")  # the float32 constant of the graph, e.g. 9.99999997e-07 -> 1e-06
    left = sorted(set(g.params) - set(g.origin) - g.taken)
    if left:
        users = sorted({n.name or n.op_type for name in left for n in g.consumers[name]})
        warnings.warn(
            f"{path}: loaded the ViT backbone only; left out {len(left)} initializers after its final LayerNorm "
            f"({_listing(left, 8)}), read by {_listing(users, 4)}.",
            stacklevel=3,
        )
    return p
