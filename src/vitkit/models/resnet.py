"""The paper's convolutional baseline: a BiT-style ResNet classifier (Kolesnikov et al., 2020), built from the
hybrid stem's own blocks (weight-standardised convolutions, GroupNorm, bottleneck units; `vitkit.models.hybrid`),
followed by global average pooling and a linear head.

It has the interface the training, evaluation and checkpoint code uses on a ViT: `config` (with `image_size`,
`in_chans`, `num_classes`), `class_names`, `forward`, `forward_features` / `forward_head(pre_logits=True)`,
`reset_head` and `set_image_size`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import ResNetConfig, _pair, check_fields
from .hybrid import ResNetStem

ARCHITECTURE = "bit-resnet"  # how a saved config says it is this model and not a ViT
# Units per stage of the BiT ResNets by depth (3 convolutions per unit, plus the root conv and the head).
DEPTHS: dict[int, tuple[int, ...]] = {26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
_NAME = re.compile(r"^BiT-R(\d+)(?:x(\d+))?$", re.IGNORECASE)


@dataclass(frozen=True)
class BiTConfig:
    """A BiT-style ResNet: `units` bottlenecks per stage, width 64 x `width_factor`, GAP, a linear head."""

    units: tuple[int, ...] = (2, 2, 2, 2)
    width_factor: int = 1
    image_size: tuple[int, int] = (224, 224)  # an int n is taken as (n, n); any size works (no posemb)
    in_chans: int = 3
    num_classes: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_size", _pair(self.image_size, "image_size"))
        object.__setattr__(self, "units", tuple(self.units))
        ResNetConfig(self.units, self.width_factor)  # validates units and width_factor
        if self.in_chans < 1 or self.num_classes < 0:
            raise ValueError(f"in_chans={self.in_chans} must be >= 1 and num_classes={self.num_classes} >= 0.")

    @property
    def stem(self) -> ResNetConfig:
        return ResNetConfig(units=self.units, width_factor=self.width_factor)

    @property
    def name(self) -> str:
        depth = 3 * sum(self.units) + 2
        return f"BiT-R{depth}" + (f"x{self.width_factor}" if self.width_factor > 1 else "")

    def replace(self, **changes: Any) -> BiTConfig:
        check_fields(BiTConfig, changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": ARCHITECTURE, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BiTConfig:
        data = {k: v for k, v in data.items() if k != "architecture"}
        check_fields(cls, data)
        return cls(**data)


def is_bit_name(name: str) -> bool:
    return bool(_NAME.match(name.strip()))


def decode_bit(name: str, **overrides: Any) -> BiTConfig:
    """`decode_bit("BiT-R26", num_classes=10)` -> BiTConfig; "BiT-R50x2" doubles the width."""
    match = _NAME.match(name.strip())
    depth = int(match.group(1)) if match else -1
    if depth not in DEPTHS:
        known = ", ".join(f"'BiT-R{d}'" for d in DEPTHS)
        raise ValueError(f"unknown ResNet {name!r}: use one of {known}, optionally with a width 'x2'.")
    spec: dict[str, Any] = {"units": DEPTHS[depth], "width_factor": int(match.group(2) or 1)}  # type: ignore[union-attr]
    check_fields(BiTConfig, overrides)
    return BiTConfig(**{**spec, **overrides})


class ResNetClassifier(nn.Module):
    """`model(x)`: images (B, C, H, W) -> the ResNet body's feature map -> global average pool -> logits."""

    def __init__(self, config: BiTConfig):
        super().__init__()
        self.config = config
        self.class_names: list[str] | None = None
        self.normalization: dict | None = None  # vitkit trains it on the official [-1, 1] (`data.to_input`)
        self.trained_on: dict | None = None  # what it was trained on (`data.survey.describe`), saved by vitkit
        self.body = ResNetStem(config.stem, config.in_chans)
        dim = self.body.out_channels
        self.head = nn.Linear(dim, config.num_classes) if config.num_classes else nn.Identity()
        self.body.init_weights()
        if isinstance(self.head, nn.Linear):  # zero head, as the ViT's and BiT's
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's feature map (B, C, H/stride, W/stride)."""
        return self.body(x)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        y = features.mean(dim=(2, 3))  # global average pooling: (B, C)
        return y if pre_logits else self.head(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def set_image_size(self, image_size: int | tuple[int, int], mode: str = "bilinear") -> None:
        """A convolutional network takes any size: only the recorded resolution changes."""
        self.config = self.config.replace(image_size=image_size)

    def reset_head(self, num_classes: int, keep_pre_logits: bool = False) -> None:
        """A new zero-initialised head for `num_classes` (0: none); there is no pre-logits layer to keep."""
        ref = self.head.weight if isinstance(self.head, nn.Linear) else next(self.body.parameters())
        self.config = self.config.replace(num_classes=num_classes)
        self.head = nn.Identity()
        if num_classes:
            self.head = nn.Linear(self.body.out_channels, num_classes, device=ref.device, dtype=ref.dtype)
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
        self.class_names = None
