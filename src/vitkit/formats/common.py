"""Machinery shared by the foreign checkpoint formats.

A format is a list of `Rule`s, one per tensor of our model: which tensors of the file make it and how. The
conversions are transposes, reshapes and concatenations only, so they are exact in both directions. Loading
applies the rules and reports every tensor of the file that is left over, missing, or of the wrong shape.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vitkit.errors import CheckpointError
from vitkit.files import Tensors
from vitkit.models.config import ViTConfig, check_fields
from vitkit.models.vit import VisionTransformer


@dataclass(frozen=True)
class Rule:
    """Our tensor `ours` is `to_ours(*file[theirs])`; `to_theirs(ours)` gives the file's tensors back exactly."""

    ours: str
    theirs: tuple[str, ...]
    to_ours: Callable[..., torch.Tensor]
    to_theirs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def rename(ours: str, theirs: str) -> Rule:
    """The same tensor under another name."""
    return Rule(ours, (theirs,), lambda t: t, lambda t: (t,))


def fused_qkv(ours: str, q: str, k: str, v: str, split: Callable, merge: Callable) -> Rule:
    """Our fused `attn.qkv` from separate q, k, v tensors: `merge` maps one to our (D, ...) layout, `split` back."""
    return Rule(
        ours,
        (q, k, v),
        lambda *qkv: torch.cat([merge(t) for t in qkv], dim=0),
        lambda t: tuple(split(c) for c in t.chunk(3, dim=0)),
    )


def shaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` itself if it has `shape`; otherwise a RuntimeError, which `model_from_rules` reports as a shape mismatch."""
    if tuple(t.shape) != tuple(shape):
        raise RuntimeError(f"expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def model_from_rules(
    config: ViTConfig, rules: list[Rule], tensors: Tensors, path: str | os.PathLike, format: str
) -> VisionTransformer:
    """A model of `config` with its weights taken from `tensors` through `rules`, every tensor accounted for.

    Raises CheckpointError listing the file's unexpected keys, its missing keys, its shape mismatches and its
    tensors that are not floating point. The shapes are checked on the meta device, so a file claiming a huge
    model allocates nothing before it is refused.
    """
    expected = _expected_state(config, rules, path, format)
    _refuse_not_float(tensors, path)
    state, missing, mismatched = _apply_rules(rules, tensors, expected)
    unexpected = sorted(set(tensors) - {k for r in rules for k in r.theirs})
    _refuse_mismatch(config, path, format, unexpected, missing, mismatched)
    model = VisionTransformer(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _expected_state(config: ViTConfig, rules: list[Rule], path: str | os.PathLike, format: str) -> Tensors:
    """The state dict of a model of `config` on the meta device, each of its tensors given by one of `rules`."""
    try:
        with torch.device("meta"):
            expected = VisionTransformer(config).state_dict()
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(path, f"the config inferred from the file cannot build a model ({e}).") from e
    uncovered = sorted(set(expected) - {r.ours for r in rules})
    if uncovered:
        raise ValueError(f"{path}: the {format} format has no place for {_listing(uncovered)} of this config.")
    return expected


def _refuse_not_float(tensors: Tensors, path: str | os.PathLike) -> None:
    not_float = [k for k, t in tensors.items() if not t.is_floating_point()]
    if not_float:
        raise CheckpointError(
            path,
            f"tensors of dtype {tensors[not_float[0]].dtype} where weights must be floating point: "
            f"{_listing(not_float)}.",
            key=not_float[0],
        )


def _apply_rules(rules: list[Rule], tensors: Tensors, expected: Tensors) -> tuple[Tensors, list[str], list[str]]:
    """Our tensors made from the file's by `rules`; and the file's missing keys and its shape mismatches."""
    state: Tensors = {}
    missing: list[str] = []
    mismatched: list[str] = []
    for rule in rules:
        absent = [k for k in rule.theirs if k not in tensors]
        if absent:
            missing += absent
            continue
        value, mismatch = _converted(rule, [tensors[k] for k in rule.theirs], expected[rule.ours])
        if value is None:
            mismatched.append(mismatch)
            continue
        state[rule.ours] = value
    return state, missing, mismatched


def _converted(rule: Rule, sources: list[torch.Tensor], want: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """`rule` applied to the file's `sources`, in the dtype of `want`; or None and the mismatch, where it fails or
    makes another shape than `want`'s."""
    shape = tuple(want.shape)
    try:
        value, reason = rule.to_ours(*sources), ""
    except (RuntimeError, IndexError) as e:
        value, reason = None, f" ({e})"
    if value is None or tuple(value.shape) != shape:
        have = ", ".join(f"{k} {tuple(t.shape)}" for k, t in zip(rule.theirs, sources))
        return None, f"{have} -> {rule.ours} {shape}{reason}"
    return value.to(want.dtype), ""


def _refuse_mismatch(
    config: ViTConfig,
    path: str | os.PathLike,
    format: str,
    unexpected: list[str],
    missing: list[str],
    mismatched: list[str],
) -> None:
    problems = []
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if mismatched:
        problems.append(f"shape mismatches: {_listing(mismatched, 6)}")
    if problems:
        raise CheckpointError(
            path,
            f"does not match the {format} layout of the inferred model (hidden_size={config.hidden_size}, "
            f"num_layers={config.num_layers}, num_heads={config.num_heads}, classifier={config.classifier!r}); "
            + "; ".join(problems)
            + ". Check the file is a ViT checkpoint of this format, or pass the right overrides (e.g. num_heads=).",
            key=next(iter(unexpected + missing), None),
        )


def export_tensors(model: VisionTransformer, rules: list[Rule], format: str) -> Tensors:
    """The model's weights in a foreign layout; an error names the tensors the format has no place for."""
    state = model.state_dict()
    uncovered = sorted(set(state) - {r.ours for r in rules})
    if uncovered:
        raise ValueError(f"the {format} format has no place for {_listing(uncovered)}: export to 'vitkit' instead.")
    out: Tensors = {}
    for rule in rules:
        for name, value in zip(rule.theirs, rule.to_theirs(state[rule.ours].detach().cpu())):
            out[name] = value.contiguous()
    return out


def require_learned_posemb(config: ViTConfig, format: str) -> None:
    """Foreign formats hold one learned posemb table; the other kinds (some without weights) have no place there."""
    if config.posemb != "learn":
        raise ValueError(f"posemb={config.posemb!r} has no place in the {format} format: only posemb='learn'.")


def require(tensors: Tensors, key: str, path: str | os.PathLike, format: str) -> torch.Tensor:
    """The tensor `key`, needed to infer the config; its absence means the file is not of this format."""
    if key not in tensors:
        raise CheckpointError(path, f"no such tensor, so this is not a ViT checkpoint of the {format} format.", key)
    return tensors[key]


def infer_grid(
    num_positions: int, image_size: int | tuple[int, int] | None, stride: tuple[int, int], path: str | os.PathLike
) -> tuple[int, int]:
    """The (gh, gw) patch grid of a posemb with `num_positions` patch rows: square, or that of `image_size`."""
    side = math.isqrt(num_positions)
    if side * side == num_positions:
        return side, side
    if image_size is not None:
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        if (h // stride[0]) * (w // stride[1]) == num_positions:
            return h // stride[0], w // stride[1]
    raise CheckpointError(
        path,
        f"the position embedding has {num_positions} patch positions, which is not a square grid; "
        "pass image_size=(height, width), the resolution the checkpoint was trained at.",
    )


def normalization(mean: Any, std: Any, in_chans: int, path: str | os.PathLike, key: str) -> dict | None:
    """A checkpoint's input normalization (mean and std on pixels in [0, 1]; one value, or one per channel) as
    `model.normalization`; None where it is the official mean = std = 0.5, or where the file gives none. A
    CheckpointError (`key`) for values that are not that."""
    if mean is None and std is None:
        return None
    values = {}
    for name, v in (("mean", mean), ("std", std)):
        v = [v] * in_chans if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        if v is None:
            return None
        if isinstance(v, list) and len(v) != in_chans and len(set(v)) == 1:
            v = v[:1] * in_chans  # one value for every channel, as a processor's defaults give a grayscale model
        if not isinstance(v, list) or len(v) != in_chans or not all(isinstance(x, (int, float)) for x in v):
            raise CheckpointError(path, f"its {name} must be {in_chans} numbers, one per channel, not {v!r}.", key)
        if not all(math.isfinite(x) and (x > 0 or name == "mean") for x in v):
            raise CheckpointError(
                path, f"its {name} {v} must be finite{' and positive' if name == 'std' else ''}.", key
            )
        values[name] = [float(x) for x in v]
    return None if values == {"mean": [0.5] * in_chans, "std": [0.5] * in_chans} else values


def make_config(
    inferred: dict[str, Any], overrides: dict[str, Any], path: str | os.PathLike, tensors: Tensors
) -> ViTConfig:
    """The inferred config with the user's overrides on top, validated, and plausible for the file's size."""
    check_fields(ViTConfig, overrides)
    if not isinstance(inferred, dict):
        raise CheckpointError(path, f"the recorded config is a {type(inferred).__name__}, not a mapping of fields.")
    unknown = sorted(set(inferred) - {f.name for f in dataclasses.fields(ViTConfig)})
    if unknown:
        raise CheckpointError(path, f"the recorded config has unknown field(s) {unknown}.", key=unknown[0])
    try:
        config = ViTConfig(**{**inferred, **overrides})
    except (ValueError, TypeError) as e:
        raise CheckpointError(path, f"the config inferred from the checkpoint is invalid: {e}") from e
    check_plausible(config, tensors, path)
    return config


def check_plausible(config: ViTConfig, tensors: Tensors, path: str | os.PathLike) -> None:
    """Refuse a recorded config that claims far more than the file holds, before any model is built from it.

    The bound is a lower one on the parameters (qkv, proj, MLP per layer; a learned posemb), so a real file
    always passes, and a file of a few bytes cannot make vitkit allocate a model of billions of parameters."""
    held = sum(t.numel() for t in tensors.values())
    d, layers, mlp = config.hidden_size, config.num_layers, config.mlp_dim
    claimed = layers * (4 * d * d + 2 * d * mlp) + (config.num_patches * d if config.posemb.startswith("learn") else 0)
    if claimed > held:
        raise CheckpointError(
            path,
            f"the config claims at least {claimed:,} weights (num_layers={layers}, hidden_size={d}, "
            f"mlp_dim={mlp}, image_size={config.image_size}); the file holds {held:,} values.",
        )
    if config.num_tokens * d > max(held, 2**26):
        raise CheckpointError(path, f"image_size={config.image_size} gives {config.num_tokens:,} tokens: refused.")


def interpolated_posemb(
    table: torch.Tensor, num_prefix: int, grid: tuple[int, int], mode: str = "bicubic", antialias: bool = False
) -> torch.Tensor:
    """A (1, prefix + h*w, D) posemb table with its square patch grid resampled to `grid` the way DINOv2-style
    models do it on every forward pass: `F.interpolate(size=grid, align_corners=False)` in float32 ("bicubic",
    no antialiasing, in Hugging Face's Dinov2). Same-size resampling is the identity."""
    prefix, patches = table[:, :num_prefix], table[:, num_prefix:]
    side = math.isqrt(patches.shape[1])
    if side * side != patches.shape[1]:
        raise ValueError(f"the position embedding has {patches.shape[1]} patch rows, which is not a square grid.")
    if (side, side) == tuple(grid):
        return table
    x = patches.reshape(1, side, side, -1).permute(0, 3, 1, 2).float()
    x = torch.nn.functional.interpolate(x, size=tuple(grid), mode=mode, align_corners=False, antialias=antialias)
    return torch.cat([prefix, x.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1).to(table.dtype)], dim=1)
