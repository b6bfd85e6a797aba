"""Model configuration: one frozen dataclass with the paper's names, and the variants of Table 1 as data."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vitkit.errors import did_you_mean, spelled

CLASSIFIERS = ("token", "gap")
POSEMBS = ("learn", "learn2d", "relative", "sincos2d", "none")
ACTS = ("gelu", "gelu_tanh")
INITS = ("jax", "trunc_normal")

# Table 1 of the paper: (layers, hidden size D, MLP size, heads).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "Ti": (12, 192, 768, 3),
    "S": (12, 384, 1536, 6),
    "B": (12, 768, 3072, 12),
    "L": (24, 1024, 4096, 16),
    "H": (32, 1280, 5120, 16),
}
PATCHES = (8, 14, 16, 32)
# Hybrid ResNet stems as in the official code: (stem name, total stride) -> units per stage.
HYBRID_STAGES: dict[tuple[str, int], tuple[int, ...]] = {
    ("R50", 16): (3, 4, 9),
    ("R50", 32): (3, 4, 6, 3),
    ("R26", 32): (2, 2, 2, 2),
}


def _pair(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise ValueError(f"{name}={value!r} is invalid: give a positive int or an (height, width) pair of them.")
    return pair[0], pair[1]


def check_fields(cls: type, names: Iterable[str]) -> None:
    """Raise ValueError naming each of `names` that is not a field of the dataclass `cls`, with the closest."""
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(names) - set(valid))
    if unknown:
        named = [repr(name) + did_you_mean(name, valid) for name in unknown]
        raise ValueError(f"unknown {cls.__name__} field(s) {', '.join(named)}; valid fields: {', '.join(valid)}.")


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,)}


def check_type(name: str, value: Any, annotation: object) -> None:
    """A field's value against its annotation ("int", "float | None", ...): a ValueError naming both if it does not
    fit, so that `hidden_size='abc'` is reported as such, not as a failed comparison deep inside."""
    kinds = [k.strip() for k in str(annotation).split("|")]
    if value is None and "None" in kinds:
        return
    if not all(k in _TYPES or k == "None" for k in kinds):  # pairs, nested configs: checked by their own validation
        return
    wanted = tuple(t for k in kinds if k in _TYPES for t in _TYPES[k])
    if isinstance(value, bool) and bool not in wanted or not isinstance(value, wanted):
        raise ValueError(f"{name}={value!r} (a {type(value).__name__}) must be of type {annotation}.")


def _choice(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is unknown: choose one of {', '.join(map(repr, allowed))}.")


@dataclass(frozen=True)
class ResNetConfig:
    """The hybrid's ResNet stem: units per stage (the official R50 hybrid uses (3, 4, 9)) and a width factor."""

    units: tuple[int, ...] = (3, 4, 9)  # bottleneck units per stage (big_vision calls it `num_layers`)
    width_factor: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        if not all(isinstance(n, int) and n > 0 for n in self.units):
            raise ValueError(f"ResNetConfig.units={self.units!r}: every stage needs >= 1 unit.")
        if self.width_factor < 1:
            raise ValueError(f"ResNetConfig.width_factor={self.width_factor}: must be >= 1.")

    @property
    def stride(self) -> int:
        """Pixels per feature-map cell: 4 from the root conv and max-pool, x2 for every stage after the first."""
        return 4 * 2 ** max(len(self.units) - 1, 0)

    @property
    def out_channels(self) -> int:
        width = 64 * self.width_factor
        return width if not self.units else 4 * width * 2 ** (len(self.units) - 1)


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a Vision Transformer, in the paper's terms.

    `patch_size` is in pixels for a plain ViT and in feature-map cells for a hybrid (the official R50+ViT-B/16
    uses 1x1 patches on the stride-16 ResNet feature map).
    """

    image_size: tuple[int, int] = (224, 224)  # an int n is taken as (n, n)
    patch_size: tuple[int, int] = (16, 16)  # likewise
    in_chans: int = 3
    num_classes: int = 1000
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    classifier: str = "token"
    representation_size: int | None = None
    posemb: str = "learn"
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    patch_dropout: float = 0.0  # in training, the share of each image's patch tokens left out (timm: patch_drop_rate)
    layer_scale_init: float | None = None
    act: str = "gelu"
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    hybrid: ResNetConfig | None = None
    init: str = "jax"

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_size", _pair(self.image_size, "image_size"))
        object.__setattr__(self, "patch_size", _pair(self.patch_size, "patch_size"))
        if isinstance(self.hybrid, dict):
            stem = dict(self.hybrid)
            if "num_layers" in stem:  # the name of `units` in files written by vitkit 0.1
                stem["units"] = stem.pop("num_layers")
            check_fields(ResNetConfig, stem)
            object.__setattr__(self, "hybrid", ResNetConfig(**stem))
        for f in dataclasses.fields(self):
            check_type(f.name, getattr(self, f.name), f.type)
        _choice(self.classifier, CLASSIFIERS, "classifier")
        _choice(self.posemb, POSEMBS, "posemb")
        _choice(self.act, ACTS, "act")
        _choice(self.init, INITS, "init")
        for name in ("in_chans", "hidden_size", "num_layers", "num_heads", "mlp_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer.")
        if self.num_classes < 0:
            raise ValueError(f"num_classes={self.num_classes} must be >= 0 (0 means no head: features only).")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}: "
                f"choose num_heads among {[h for h in range(1, 33) if self.hidden_size % h == 0]}."
            )
        if self.posemb in ("learn2d", "sincos2d") and self.hidden_size % (2 if self.posemb == "learn2d" else 4):
            raise ValueError(
                f"posemb={self.posemb!r} splits hidden_size={self.hidden_size} between rows and columns: "
                f"use a hidden_size divisible by {2 if self.posemb == 'learn2d' else 4}."
            )
        for rate in ("dropout_rate", "attention_dropout_rate", "drop_path_rate", "patch_dropout"):
            if not 0.0 <= getattr(self, rate) < 1.0:
                raise ValueError(f"{rate}={getattr(self, rate)} must be in [0, 1).")
        if self.patch_dropout and self.posemb == "relative":
            raise ValueError(
                "patch_dropout leaves tokens out, and posemb='relative' biases attention between every pair of grid "
                "positions: use patch_dropout=0 with it, or an added position embedding (learn, learn2d, sincos2d)."
            )
        if self.representation_size is not None and self.representation_size < 1:
            raise ValueError(f"representation_size={self.representation_size}: use None (no pre-logits) or >= 1.")
        stride = self.patch_stride
        for side, size, step in zip(("height", "width"), self.image_size, stride):
            if size % step:
                valid = sorted({max(step, size // step * step), size // step * step + step})
                raise ValueError(
                    f"image {side} {size} is not divisible by the patch stride {step} px: "
                    f"use a multiple of {step}, e.g. {' or '.join(map(str, valid))}."
                )

    @property
    def patch_stride(self) -> tuple[int, int]:
        """Pixels between neighbouring tokens (patch size times the hybrid stem's stride)."""
        scale = self.hybrid.stride if self.hybrid else 1
        return (self.patch_size[0] * scale, self.patch_size[1] * scale)

    @property
    def grid_size(self) -> tuple[int, int]:
        """(gh, gw): tokens per column and per row."""
        return (self.image_size[0] // self.patch_stride[0], self.image_size[1] // self.patch_stride[1])

    @property
    def num_patches(self) -> int:
        return self.grid_size[0] * self.grid_size[1]

    @property
    def num_tokens(self) -> int:
        """Sequence length N (+1 for the class token)."""
        return self.num_patches + (self.classifier == "token")

    def replace(self, **changes: Any) -> ViTConfig:
        """A copy with some fields changed (validated again)."""
        check_fields(ViTConfig, changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        check_fields(cls, data)
        return cls(**data)


def config_difference(ours: ViTConfig, theirs: ViTConfig) -> str:
    """The fields in which two configs differ, as 'name ours != theirs' (empty when they agree)."""
    return ", ".join(
        f"{f.name} {getattr(ours, f.name)!r} != {getattr(theirs, f.name)!r}"
        for f in dataclasses.fields(ViTConfig)
        if getattr(ours, f.name) != getattr(theirs, f.name)
    )


_NAME = re.compile(r"^(?:(R\d+)\+)?ViT-(Ti|S|B|L|H)/(\d+)$", re.IGNORECASE)


def list_models() -> list[str]:
    """The named variants: Table 1 sizes with the paper's patch sizes, and the official hybrids.

    Any size with any patch ("ViT-S/4") is also accepted by `decode_variant`.
    """
    plain = [f"ViT-{size}/{patch}" for size in SIZES for patch in PATCHES]
    hybrids = [f"{stem}+ViT-{size}/{stride}" for (stem, stride) in HYBRID_STAGES for size in ("B", "L")]
    return plain + hybrids


def decode_variant(name: str, **overrides: Any) -> ViTConfig:
    """`decode_variant("ViT-B/16", num_classes=10)` -> ViTConfig; names are case-insensitive."""
    match = _NAME.match(name.strip())
    if not match:
        close = difflib.get_close_matches(name, list_models(), n=3, cutoff=0.4)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"unknown model name {name!r}: use 'ViT-<Ti|S|B|L|H>/<patch>' or 'R50+ViT-B/16'.{hint} "
            f"See {spelled('vitkit.list_models()', '`vitkit models`')}."
        )
    stem, size, patch = match.group(1), match.group(2), int(match.group(3))
    size = {s.lower(): s for s in SIZES}[size.lower()]
    layers, hidden, mlp, heads = SIZES[size]
    spec: dict[str, Any] = dict(hidden_size=hidden, num_layers=layers, mlp_dim=mlp, num_heads=heads)
    if stem:
        key = (stem.upper(), patch)
        if key not in HYBRID_STAGES:
            known = ", ".join(f"{s}+ViT-*/{p}" for s, p in HYBRID_STAGES)
            raise ValueError(f"unknown hybrid {name!r}: the known ResNet stems are {known}.")
        spec.update(patch_size=1, hybrid=ResNetConfig(units=HYBRID_STAGES[key]))
    else:
        spec.update(patch_size=patch)
    check_fields(ViTConfig, overrides)
    spec.update(overrides)
    return ViTConfig(**spec)
