"""The ViT in an ONNX graph from elsewhere, found by its structure (`parse`).

Exporters name initializers as they please (`onnx::MatMul_1966`), store q, k and v in any order and write the
same layer in several ways, so nothing here trusts a name: the graph is followed from its image input. The
patch-embedding `Conv`, then the class token `Concat` (or none: the tokens are averaged) and the posemb `Add`;
then, block by block along the residual stream, the LayerNorm (a `LayerNormalization` node or its decomposed
`ReduceMean`/`Sub`/`Pow`/`Sqrt`/`Div` form), the projections that read it (three, or one of width 3D reshaped
and split in three, as timm writes it; which is the query, the key and the value is read off the attention
`MatMul`s they feed: query on the left of the score product, key on its right, value after the softmax), the
output projection, LayerScale `Mul`s, the residual `Add`s and the MLP (GELU: `Erf`, tanh or ONNX's `Gelu`).
The scale of the scores, a constant or computed from the query's shape, is checked to be 1/sqrt(head_dim); an
attention mask of zeros and a NaN guard after the softmax are passed through. The final LayerNorm ends the
backbone; the classifier after it is read where there is one (token 0 or the mean of the tokens, a pre-logits
layer with tanh, a linear head), and every initializer not taken (a decoder) is named in a warning. A posemb the
graph resamples with a `Resize` is resampled the same way to `image_size`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .common import Tensors, _listing
from .onnx_graph import Graph, _attr

PASS_THROUGH = {"Reshape", "Transpose", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Mul", "Div", "Add"}


def _fail(path, what: str) -> ValueError:
    return ValueError(f"{path}: not a ViT graph vitkit can read ({what}).")


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
    classifier: str = "token"  # or "gap": no class token, the mean of the tokens
    num_classes: int = 0  # 0: no head found, a backbone
    representation_size: int | None = None


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
        nodes = [n for n in g.consumers[name] if n.op_type != "Shape" and not _nan_check(g, n, name)]
        hit = [n for n in nodes if n.op_type in stop]
        if hit:
            return hit[0], list(hit[0].input).index(name), scale
        moves = [n for n in nodes if n.op_type in PASS_THROUGH or _nan_guard(g, n, name)]
        if len(moves) != 1:
            break
        node = moves[0]
        if node.op_type in ("Mul", "Div", "Add"):
            other = next((i for i in node.input if i != name), None)
            factor = None if other is None else g.value(other)
            if node.op_type == "Add":  # an attention mask of zeros, as the dynamo exporter writes SDPA's
                if factor is None or np.any(factor != 0):
                    break
            elif factor is None or np.size(factor) != 1 or (node.op_type == "Div" and node.input[0] != name):
                break
            else:
                scale *= float(np.ravel(factor)[0]) ** (1 if node.op_type == "Mul" else -1)
        name = node.output[0]
    return None, -1, scale


def _nan_check(g: Graph, node, name: str) -> bool:
    """An `IsNaN` of `name` whose only use is a `_nan_guard` of it."""
    users = g.consumers[node.output[0]]
    return node.op_type == "IsNaN" and bool(users) and all(_nan_guard(g, u, name) for u in users)


def _nan_guard(g: Graph, node, name: str) -> bool:
    """`Where(IsNaN(x), constant, x)`: the dynamo exporter's guard after a softmax, the identity for finite x."""
    if node.op_type != "Where" or node.input[2] != name:
        return False
    check = g.producer.get(node.input[0])
    return check is not None and check.op_type == "IsNaN" and check.input[0] == name


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


def _qkv_split(g: Graph, qkv: str) -> tuple[list[tuple[str, int]], int] | None:
    """Where tensor `qkv` (B, N, 3D) is reshaped to (B, N, 3, heads, head_dim) and split in three along the
    axis of 3 (after a transpose, if any): each piece's tensor and its chunk of the 3D features (0, 1, 2), and
    the number of heads. None for any other use of `qkv`."""
    reshape = g.users(qkv, "Reshape")
    shape = None if len(reshape) != 1 else g.value(reshape[0].input[1])
    if shape is None or len(shape) < 3 or shape[-3] != 3:
        return None
    heads, axis, name = int(shape[-2]), len(shape) - 3, reshape[0].output[0]
    transpose = g.users(name, "Transpose")
    if transpose:
        perm = list(_attr(transpose[0], "perm", []))
        if axis not in perm:
            return None
        axis, name = perm.index(axis), transpose[0].output[0]
    pieces = []
    for node in g.consumers[name]:
        if node.op_type == "Split" and len(node.output) == 3 and _attr(node, "axis", 0) in (axis, axis - len(shape)):
            pieces += [(out, k) for k, out in enumerate(node.output)]
        elif node.op_type in ("Gather", "Slice"):  # one index, or a slice k:k+1, along the axis of 3
            index = g.value(node.input[1])
            on = _attr(node, "axis", 0)
            if node.op_type == "Slice":
                axes, ends = (g.value(node.input[j]) if len(node.input) > j else None for j in (3, 2))
                single = index is not None and ends is not None and np.ravel(ends)[0] == np.ravel(index)[0] + 1
                on = int(np.ravel(axes)[0]) if single and axes is not None and np.size(axes) == 1 else None
            if index is not None and np.size(index) == 1 and on in (axis, axis - len(shape)):
                pieces.append((node.output[0], int(np.ravel(index)[0])))
        elif node.op_type != "Shape":
            return None
    return (pieces, heads) if sorted(k for _, k in pieces) == [0, 1, 2] else None


def _chunk(linear: Linear, k: int, n: int, out: str) -> Linear:
    """Chunk k of n of a projection's output features, as a projection producing tensor `out`."""
    rows = linear.weight.shape[0] // n
    return Linear(linear.weight[k * rows : (k + 1) * rows], linear.bias[k * rows : (k + 1) * rows], out)


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
    gamma1, branch = _layer_scale(g, _attention(g, p, i, h, path).out)
    x = _residual_add(g, branch, x, path)
    t[f"{ours}.norm2.weight"], t[f"{ours}.norm2.bias"], _, h = _layer_norm(g, x, path)
    gamma2, branch = _layer_scale(g, _mlp(g, p, i, h, path).out)
    if (gamma1 is None) != (gamma2 is None):
        raise _fail(path, f"block {i}: LayerScale on one residual branch only")
    if gamma1 is not None and gamma2 is not None:
        p.layer_scale = True
        t[f"{ours}.ls1.gamma"], t[f"{ours}.ls2.gamma"] = gamma1, gamma2
    return _residual_add(g, branch, x, path)


def _attention(g: Graph, p: Parsed, i: int, h: str, path) -> Linear:
    """Block i's attention reading LayerNorm output `h`: q, k and v (as our fused qkv), the number of heads, the
    scale of the scores checked, and the output projection, which it returns."""
    ours = f"blocks.{i}.attn"
    projs, fused = _qkv_projections(g, p, i, h, path)
    role = _roles(g, projs, i, path)
    hidden = role["q"][0].weight.shape[0]
    p.heads = (fused and p.heads) or _heads(g, role["q"][0].out, hidden) or p.heads
    if not p.heads:
        raise _fail(path, f"block {i}: cannot read the number of heads from the query's Reshape")
    scores, _, _ = _follow(g, role["q"][0].out, {"MatMul"})
    _, _, score_scale = _follow(g, scores.output[0], {"Softmax"})
    scale = role["q"][1] * role["k"][1] * score_scale
    if not math.isclose(scale, (hidden // p.heads) ** -0.5, rel_tol=1e-4):
        raise _fail(path, f"block {i}: attention scores scaled by {scale:.6g}, not 1/sqrt(head_dim)")
    q, k, v = (role[r][0] for r in "qkv")
    p.tensors[f"{ours}.qkv.weight"] = torch.cat([q.weight, k.weight, v.weight])
    p.tensors[f"{ours}.qkv.bias"] = torch.cat([q.bias, k.bias, v.bias])
    softmax, _, _ = _follow(g, scores.output[0], {"Softmax"})
    mix, _, _ = _follow(g, softmax.output[0], {"MatMul"})
    proj_node, _, _ = _follow(g, mix.output[0], {"MatMul"})
    if proj_node is None or not g.param_input(proj_node):
        raise _fail(path, f"block {i}: no output projection after the attention")
    out = _linear(g, proj_node, path)
    p.tensors[f"{ours}.proj.weight"], p.tensors[f"{ours}.proj.bias"] = out.weight, out.bias
    return out


def _qkv_projections(g: Graph, p: Parsed, i: int, h: str, path) -> tuple[list[Linear], bool]:
    """The three projections reading LayerNorm output `h`, and whether they are one of width 3D split in three
    (timm's and vitkit's own layout), whose split sets `p.heads`."""
    projs = [_linear(g, m, path) for m in _projections(g, h)]
    fused = _qkv_split(g, projs[0].out) if len(projs) == 1 else None
    if fused is not None:
        pieces, p.heads = fused
        projs = [_chunk(projs[0], k, 3, out) for out, k in pieces]
    if len(projs) != 3:
        raise _fail(path, f"block {i}: {len(projs)} projections read the LayerNorm, expected q, k and v")
    return projs, fused is not None


def _roles(g: Graph, projs: list[Linear], i: int, path) -> dict[str, tuple[Linear, float]]:
    """Each projection by its role, with the scale on its way to the attention: the query ("q") on the left of the
    score product, the key ("k") on its right, the value ("v") after the softmax."""
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
    return role


def _mlp(g: Graph, p: Parsed, i: int, h: str, path) -> Linear:
    """Block i's MLP reading LayerNorm output `h` (its activation read into `p.act`); returns its second layer."""
    ours = f"blocks.{i}.mlp"
    fc1_nodes = _projections(g, h)
    if len(fc1_nodes) != 1:
        raise _fail(path, f"block {i}: expected one MLP input layer after the second LayerNorm")
    fc1 = _linear(g, fc1_nodes[0], path)
    fc2_node, _, _ = _follow_any(g, fc1.out, p, i, path)
    fc2 = _linear(g, fc2_node, path)
    p.tensors[f"{ours}.fc1.weight"], p.tensors[f"{ours}.fc1.bias"] = fc1.weight, fc1.bias
    p.tensors[f"{ours}.fc2.weight"], p.tensors[f"{ours}.fc2.bias"] = fc2.weight, fc2.bias
    return fc2


def _follow_any(g: Graph, name: str, p: Parsed, i: int, path):
    """Through the activation (any ops) to the next MatMul with a weight; the ops between the two decide the
    GELU kind (every op on every path: the tanh form's shortest path, 0.5 x times the rest, has no Tanh)."""
    frontier, inside, fc2 = [name], set(), None  # inside: the tensors computed from `name` before the MatMul
    for _ in range(32):
        nodes = [n for f in frontier for n in g.consumers[f]]
        fc2 = fc2 or next((n for n in nodes if n.op_type == "MatMul" and g.param_input(n)), None)
        frontier = [n.output[0] for n in nodes if not (n.op_type == "MatMul" and g.param_input(n))]
        frontier = [f for f in frontier if f not in inside]
        inside.update(frontier)
    if fc2 is None:
        raise _fail(path, f"block {i}: no second MLP layer")
    seen, stack = set(), [fc2.input[0]]
    while stack:  # back from the MatMul's input, within what `name` computes
        tensor = stack.pop()
        if tensor in inside:
            inside.discard(tensor)
            node = g.producer[tensor]
            seen.add(_gelu_form(node) if node.op_type == "Gelu" else node.op_type)  # opset 20's own Gelu
            stack += list(node.input)
    p.act = "gelu" if "Erf" in seen else "gelu_tanh" if "Tanh" in seen else ""
    if not p.act:
        raise _fail(path, f"block {i}: MLP activation made of {sorted(seen)} is not a GELU")
    return fc2, 0, 1.0


def _gelu_form(node) -> str:
    return "Tanh" if _attr(node, "approximate", "none") == "tanh" else "Erf"


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
        raise _fail(path, "no patch-embedding Conv reads the image; a hybrid's ResNet stem is not read from ONNX")
    kernel, strides = tuple(_attr(conv, "kernel_shape")), tuple(_attr(conv, "strides", [1, 1]))
    if kernel != strides or any(_attr(conv, "pads", [0, 0, 0, 0])):
        raise _fail(path, f"patch Conv with kernel {kernel}, strides {strides}: patches must not overlap")
    p.patch = kernel
    p.tensors["embedding.weight"] = g.param(conv.input[1])
    width = p.tensors["embedding.weight"].shape[0]
    p.tensors["embedding.bias"] = g.param(conv.input[2]) if len(conv.input) > 2 else torch.zeros(width)
    tokens, slot, _ = _follow(g, conv.output[0], {"Concat", "Add"})
    if tokens is None:
        raise _fail(path, "neither a class token nor a position embedding follows the patch embedding")
    if tokens.op_type == "Concat" and len(tokens.input) != 2:
        raise _fail(path, "more than a class token is put before the patches (a distillation token, registers?); "
                          "vitkit's encoder holds one class token")  # fmt: skip
    if tokens.op_type == "Concat":
        cls = g.param(_root_param(g, tokens.input[0], path))
        if cls.ndim == 3 and len(cls) > 1 and torch.equal(cls, cls[:1].expand_as(cls)):
            cls = cls[:1]  # expanded to a batch size the graph was exported with
        p.tensors["cls_token"] = cls
        stream, adds = tokens.output[0], g.users(tokens.output[0], "Add")
        if len(adds) != 1:
            raise _fail(path, "no position embedding is added to the tokens")
        tokens = adds[0]
    else:
        p.classifier = "gap"  # no class token: the head can only read the mean of the tokens
        stream = tokens.input[slot]
    posemb = next((i for i in tokens.input if i != stream), None)
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
    return tokens.output[0]


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


def _is_block(g: Graph, h: str) -> bool:
    """Whether LayerNorm output `h` feeds an attention: three projections, or one that is split into three."""
    found = _projections(g, h)
    if len(found) != 1:
        return len(found) == 3
    out = found[0].output[0]
    adds = g.users(out, "Add")
    return any(_qkv_split(g, name) is not None for name in [out, *(a.output[0] for a in adds)])


def parse(model, path) -> Parsed:
    """Follow the graph `model` (an `onnx.ModelProto`) from the image to the backbone's final LayerNorm."""
    g = Graph(model, path)
    p = Parsed()
    x = _embedding(g, p, path)
    if g.users(x, "Concat"):
        raise _fail(path, "tokens are added after the position embedding (registers?); vitkit's encoder holds one "
                          "class token")  # fmt: skip
    ln = _layer_norm(g, x, path)
    while _is_block(g, ln[3]):
        x = _block(g, p, p.layers, x, ln, path)
        p.layers += 1
        ln = _layer_norm(g, x, path)
    if not p.layers:
        raise _fail(path, "no Transformer block found after the embedding")
    p.tensors["encoder_norm.weight"], p.tensors["encoder_norm.bias"], _, p.output = ln
    p.eps = float(f"{p.eps:.6g}")  # the float32 constant of the graph, e.g. 9.99999997e-07 -> 1e-06
    _head(g, p, p.output)
    # Weights are floating-point tensors of at least one dimension: integer initializers are shapes and indices,
    # 0-d ones the constants of an operator (a NaN guard's fill value).
    left = sorted(
        n for n in set(g.params) - set(g.origin) - g.taken if g.params[n].dtype.kind == "f" and g.params[n].ndim > 0
    )
    if left:
        users = sorted({n.name or n.op_type for name in left for n in g.consumers[name]})
        loaded = "the ViT and its head" if p.num_classes else "the ViT backbone only"
        warnings.warn(
            f"{path}: loaded {loaded}; left out {len(left)} initializers after its final LayerNorm "
            f"({_listing(left, 8)}), read by {_listing(users, 4)}.",
            stacklevel=3,
        )
    return p


def _head(g: Graph, p: Parsed, x: str) -> None:
    """The classifier reading the final LayerNorm's tokens `x`, where the graph has one: the class token (token 0,
    by `Gather` or `Slice`) or, without one, the mean of the tokens (`ReduceMean`); then a linear layer, or a
    pre-logits layer with tanh and a linear layer. Where the graph does anything else with the tokens (ends there,
    a decoder), nothing is set: the model is the backbone."""
    pooled = None
    for node in g.consumers[x]:
        if p.classifier == "token" and node.op_type in ("Gather", "Slice") and _takes_first_token(g, node):
            pooled = node.output[0]
        elif p.classifier == "gap" and node.op_type == "ReduceMean":
            axes = _attr(node, "axes") if len(node.input) < 2 else g.value(node.input[1])
            pooled = node.output[0] if axes is not None and list(np.ravel(axes)) in ([1], [-2]) else None
    first = pooled and _dense_after(g, pooled)
    if first is None:
        return
    tanh = g.users(first[1], "Tanh")
    if len(tanh) == 1 and len(g.consumers[first[1]]) == 1:  # a pre-logits layer, as the official checkpoints have
        pre = _dense(g, first[0])
        p.tensors["pre_logits.0.weight"], p.tensors["pre_logits.0.bias"] = pre.weight, pre.bias
        p.representation_size = pre.weight.shape[0]
        first = _dense_after(g, tanh[0].output[0])
        if first is None:  # Hugging Face's ViTModel pooler alone: the pre-logits layer of a headless model
            return
    head = _dense(g, first[0])
    p.tensors["head.weight"], p.tensors["head.bias"] = head.weight, head.bias
    p.num_classes = head.weight.shape[0]


def _takes_first_token(g: Graph, node) -> bool:
    """A `Gather` of index 0 on the token axis, or a `Slice` 0:1 of it followed by a squeeze of that axis."""
    index = g.value(node.input[1])
    if node.op_type == "Gather":
        return _attr(node, "axis", 0) == 1 and index is not None and np.ndim(index) == 0 and int(index) == 0
    ends, axes = (g.value(node.input[j]) if len(node.input) > j else None for j in (2, 3))
    if index is None or ends is None or axes is None or list(np.ravel(axes)) != [1]:
        return False
    squeeze = [n for n in g.consumers[node.output[0]] if n.op_type in ("Squeeze", "Reshape", "Flatten")]
    return int(np.ravel(index)[0]) == 0 and int(np.ravel(ends)[0]) == 1 and len(squeeze) == 1


def _dense_after(g: Graph, name: str) -> tuple[Any, str] | None:
    """The linear layer (a `MatMul` with a weight, its bias `Add`; or a `Gemm`) reading `name`, through squeezes
    and casts: its node and the name of its output."""
    node, slot, scale = _follow(g, name, {"MatMul", "Gemm"})
    if node is None or scale != 1.0 or slot != 0 or node.input[1] not in g.params:
        return None
    if node.op_type == "Gemm":
        if _attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0 or _attr(node, "beta", 1.0) != 1.0:
            return None
        return node, node.output[0]
    out = node.output[0]
    adds = [n for n in g.users(out, "Add") if g.param_input(n) and g.params[g.param_input(n)].ndim == 1]
    return node, (adds[0].output[0] if len(adds) == 1 and len(g.consumers[out]) == 1 else out)


def _dense(g: Graph, node) -> Linear:
    if node.op_type == "MatMul":
        return _linear(g, node, g.path)
    weight = g.param(node.input[1])
    weight = weight if _attr(node, "transB", 0) else weight.T.contiguous()
    bias = g.param(node.input[2]) if len(node.input) > 2 and node.input[2] else torch.zeros(weight.shape[0])
    return Linear(weight, bias, node.output[0])
