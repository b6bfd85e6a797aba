"""Official ViT (`vit_jax`) and big_vision `.npz` checkpoints: one array per '/'-joined Flax parameter path.

Accepted: the released layout (`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`), the newer Flax
names (`MultiHeadDotProductAttention_0`, `LayerNorm_1`, `MlpBlock_0`), big_vision files (everything under
`params/`, `pos_embedding` without a class-token row, blocks possibly stacked with a leading depth axis), and
hybrids (the ResNet stem's `conv_root`, `gn_root`, `block{s}/unit{u}/...`). Flax kernels are (in, out) and
HWIO convolutions; ours are (out, in) and OIHW. Official models use tanh-GELU and LayerNorm eps 1e-6.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from vitkit.files import atomic_write, read_npz
from vitkit.models.config import ResNetConfig, ViTConfig
from vitkit.models.vit import VisionTransformer

from .common import (
    Rule,
    Tensors,
    export_tensors,
    fused_qkv,
    infer_grid,
    make_config,
    model_from_rules,
    rename,
    require,
    require_learned_posemb,
    shaped,
)

NAME = "npz"
# Sub-module names inside an encoder block: (pre-attention LN, attention, pre-MLP LN, MLP).
RELEASED_NAMES = ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
FLAX_NAMES = ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")
POSEMB = "Transformer/posembed_input/pos_embedding"  # (1, N, D), class-token row included
BIG_VISION_POSEMB = "pos_embedding"  # (1, h*w, D): big_vision adds no posemb to the class token
_BLOCK = re.compile(r"^Transformer/encoderblock_(\d+)/")
_UNIT = re.compile(r"^block(\d+)/unit(\d+)/conv1/kernel$")


def dense(ours: str, theirs: str, bias: bool = True) -> list[Rule]:
    """Flax Dense kernel (in, out) + bias <-> torch Linear weight (out, in) + bias."""
    rules = [Rule(f"{ours}.weight", (f"{theirs}/kernel",), lambda k: k.T, lambda w: (w.T,))]
    return rules + ([rename(f"{ours}.bias", f"{theirs}/bias")] if bias else [])


def norm(ours: str, theirs: str, shape: tuple[int, ...] = (-1,)) -> list[Rule]:
    """LayerNorm / GroupNorm scale + bias; GroupNorm's are stored (1, 1, 1, C) in released files, (C,) in newer."""
    return [
        Rule(f"{ours}.{p}", (f"{theirs}/{q}",), lambda t: t.reshape(-1), lambda t: (t.reshape(shape),))
        for p, q in (("weight", "scale"), ("bias", "bias"))
    ]


def conv(ours: str, theirs: str) -> Rule:
    """Convolution kernel HWIO <-> OIHW."""
    return Rule(
        f"{ours}.weight", (f"{theirs}/kernel",), lambda k: k.permute(3, 2, 0, 1), lambda w: (w.permute(2, 3, 1, 0),)
    )


def attention(ours: str, theirs: str, config: ViTConfig) -> list[Rule]:
    """q/k/v kernels (D, heads, D/heads), biases (heads, D/heads) <-> fused qkv; out kernel (heads, D/heads, D).

    The file's head count is checked against the config's, which would otherwise pass unnoticed (same sizes)."""
    d, h = config.hidden_size, config.num_heads
    kernel, bias = (d, h, d // h), (h, d // h)
    q, k, v = (f"{theirs}/{n}" for n in ("query", "key", "value"))
    rules = [
        fused_qkv(
            f"{ours}.qkv.weight", f"{q}/kernel", f"{k}/kernel", f"{v}/kernel",
            merge=lambda t: shaped(t, kernel).reshape(d, d).T, split=lambda w: w.T.reshape(kernel),
        ),
        Rule(
            f"{ours}.proj.weight", (f"{theirs}/out/kernel",),
            lambda t: shaped(t, (h, d // h, d)).reshape(d, d).T, lambda w: (w.T.reshape(h, d // h, d),),
        ),
        rename(f"{ours}.proj.bias", f"{theirs}/out/bias"),
    ]  # fmt: skip
    if config.qkv_bias:
        rules.append(
            fused_qkv(
                f"{ours}.qkv.bias", f"{q}/bias", f"{k}/bias", f"{v}/bias",
                merge=lambda t: shaped(t, bias).reshape(d), split=lambda b: b.reshape(bias),
            )
        )  # fmt: skip
    return rules


def class_row_added(posemb: torch.Tensor) -> torch.Tensor:
    """big_vision's (1, h*w, D) posemb -> ours (1, 1 + h*w, D): a zero row for the class token, which is exact."""
    return torch.cat([torch.zeros_like(posemb[:, :1]), posemb], dim=1)


def resnet_rules(config: ResNetConfig) -> list[Rule]:
    """The hybrid stem: root conv + GroupNorm, then `block{s}/unit{u}` bottlenecks (projection in each first unit)."""
    gn_shape = (1, 1, 1, -1)
    rules = [conv("stem.conv_root", "conv_root"), *norm("stem.gn_root", "gn_root", gn_shape)]
    for s, units in enumerate(config.units):
        for u in range(units):
            ours, theirs = f"stem.stages.{s}.{u}", f"block{s + 1}/unit{u + 1}"
            for i in ("1", "2", "3") + (("_proj",) if u == 0 else ()):
                rules += [
                    conv(f"{ours}.conv{i}", f"{theirs}/conv{i}"),
                    *norm(f"{ours}.gn{i}", f"{theirs}/gn{i}", gn_shape),
                ]
    return rules


def rules_for(config: ViTConfig, names: tuple[str, ...] = RELEASED_NAMES, big_vision: bool = False) -> list[Rule]:
    """Every tensor of the model in the official layout (or big_vision's posemb without the class-token row)."""
    ln0, attn, ln1, mlp = names
    rules = [conv("embedding", "embedding"), rename("embedding.bias", "embedding/bias")]
    if config.classifier == "token":
        rules.append(rename("cls_token", "cls"))
    if big_vision and config.classifier == "token":
        rules.append(Rule("posemb.weight", (BIG_VISION_POSEMB,), class_row_added, lambda w: (w[:, 1:],)))
    else:
        rules.append(rename("posemb.weight", BIG_VISION_POSEMB if big_vision else POSEMB))
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}", f"Transformer/encoderblock_{i}"
        rules += norm(f"{ours}.norm1", f"{theirs}/{ln0}") + attention(f"{ours}.attn", f"{theirs}/{attn}", config)
        rules += norm(f"{ours}.norm2", f"{theirs}/{ln1}")
        rules += dense(f"{ours}.mlp.fc1", f"{theirs}/{mlp}/Dense_0")
        rules += dense(f"{ours}.mlp.fc2", f"{theirs}/{mlp}/Dense_1")
    rules += norm("encoder_norm", "Transformer/encoder_norm")
    if config.representation_size:
        rules += dense("pre_logits.0", "pre_logits")
    if config.num_classes:
        rules += dense("head", "head")
    if config.hybrid:
        rules += resnet_rules(config.hybrid)
    return rules


def normalise(tensors: Tensors) -> Tensors:
    """big_vision -> official paths: drop the `params/` prefix and unstack `Transformer/encoderblock/` (depth, ...)."""
    if tensors and all(k.startswith("params/") for k in tensors):
        tensors = {k.removeprefix("params/"): v for k, v in tensors.items()}
    out: Tensors = {}
    for k, v in tensors.items():
        if k.startswith("Transformer/encoderblock/"):
            rest = k.removeprefix("Transformer/encoderblock/")
            out.update({f"Transformer/encoderblock_{i}/{rest}": layer for i, layer in enumerate(v)})
        else:
            out[k] = v
    return out


def infer_config(tensors: Tensors, path: str | os.PathLike, image_size, overrides: dict) -> tuple[ViTConfig, dict]:
    """The whole config from the array shapes; returns it with the layout options for `rules_for`."""
    kernel = require(tensors, "embedding/kernel", path, NAME)  # (ph, pw, Cin, D)
    names = RELEASED_NAMES if f"Transformer/encoderblock_0/{RELEASED_NAMES[1]}/query/kernel" in tensors else FLAX_NAMES
    block0 = f"Transformer/encoderblock_0/{names[1]}"
    query = require(tensors, f"{block0}/query/kernel", path, NAME)  # (D, heads, D/heads)
    mlp = require(tensors, f"Transformer/encoderblock_0/{names[3]}/Dense_0/kernel", path, NAME)  # (D, mlp_dim)
    big_vision = POSEMB not in tensors
    posemb = require(tensors, BIG_VISION_POSEMB if big_vision else POSEMB, path, NAME)  # (1, N, D)
    token = "cls" in tensors
    hybrid = None
    in_chans = kernel.shape[2]
    if "conv_root/kernel" in tensors:
        units = sorted((int(m[1]), int(m[2])) for k in tensors if (m := _UNIT.match(k)))
        stages = max(s for s, _ in units)
        hybrid = ResNetConfig(
            units=tuple(max(u for s, u in units if s == stage) for stage in range(1, stages + 1)),
            width_factor=tensors["conv_root/kernel"].shape[3] // 64,
        )
        in_chans = tensors["conv_root/kernel"].shape[2]
    patch = (kernel.shape[0], kernel.shape[1])
    scale = hybrid.stride if hybrid else 1
    positions = posemb.shape[1] - (token and not big_vision)
    grid = infer_grid(positions, image_size, (patch[0] * scale, patch[1] * scale), path)
    inferred = dict(
        image_size=(grid[0] * patch[0] * scale, grid[1] * patch[1] * scale),
        patch_size=patch,
        in_chans=in_chans,
        num_classes=tensors["head/kernel"].shape[1] if "head/kernel" in tensors else 0,
        hidden_size=kernel.shape[3],
        num_layers=len({m[1] for k in tensors if (m := _BLOCK.match(k))}),
        num_heads=query.shape[1],
        mlp_dim=mlp.shape[1],
        classifier="token" if token else "gap",
        representation_size=tensors["pre_logits/kernel"].shape[1] if "pre_logits/kernel" in tensors else None,
        act="gelu_tanh",
        layer_norm_eps=1e-6,
        qkv_bias=f"{block0}/query/bias" in tensors,
        hybrid=hybrid,
    )
    return make_config(inferred, overrides, path, tensors), dict(names=names, big_vision=big_vision)


def detect(path: Path) -> bool:
    """An `.npz` file: official, newer Flax or big_vision names are told apart when loading."""
    return path.is_file() and path.suffix.lower() == ".npz"


def load(path: str | os.PathLike, image_size=None, **overrides) -> VisionTransformer:
    """An official or big_vision `.npz` as a model, config inferred from the arrays."""
    tensors = normalise(read_npz(path))
    config, layout = infer_config(tensors, path, image_size, overrides)
    return model_from_rules(config, rules_for(config, **layout), tensors, path, NAME)


def not_recorded(model: VisionTransformer) -> list[str]:
    """What of `model` an `.npz` cannot hold, so that it comes back different: the file is arrays only, and its
    readers (`vit_jax`, `load`) assume the official tanh-GELU and LayerNorm eps 1e-6."""
    c, lost = model.config, []
    if c.act != "gelu_tanh":
        lost.append(
            f"act={c.act!r}: the file reads back with the official tanh-GELU, which moves the logits (by 1.2e-3 on "
            "the main job's model)"
        )
    if c.layer_norm_eps != 1e-6:
        lost.append(f"layer_norm_eps={c.layer_norm_eps:g}: the file reads back with the official 1e-6")
    if model.class_names is not None:
        lost.append(f"the {len(model.class_names)} class names: the file reads back with class indices")
    if getattr(model, "normalization", None):
        lost.append("its input mean and std: the file reads back fed the official [-1, 1]")
    return lost


def export(model: VisionTransformer, path: str | os.PathLike) -> None:
    """Write the released official layout (float32), which `vit_jax` and `load` read; a warning names what the
    format cannot hold (`not_recorded`): the weights are exact, the activation and class names are not kept."""
    require_learned_posemb(model.config, NAME)
    arrays = {k: v.float().numpy() for k, v in export_tensors(model, rules_for(model.config), NAME).items()}
    for lost in not_recorded(model):
        warnings.warn(f"npz export of {path} does not record {lost}; keep the 'vitkit' file too.", stacklevel=3)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as its options

    atomic_write(path, write)
