"""Every architecture vitkit builds, by name or from a saved config: the Vision Transformer (`model.py`) and
the BiT-style ResNet baseline the paper compares it with (`resnet.py`)."""

from __future__ import annotations

from typing import Any

from .config import ViTConfig, decode_variant
from .model import VisionTransformer
from .resnet import ARCHITECTURE, BiTConfig, ResNetClassifier, decode_bit, is_bit_name

Model = VisionTransformer | ResNetClassifier
ModelConfig = ViTConfig | BiTConfig


def create_model(name: str, pretrained: str | None = None, **overrides: Any) -> Model:
    """Build a variant by its paper name, e.g. `create_model("ViT-B/16", num_classes=10, image_size=384)` or the
    baseline `create_model("BiT-R26", num_classes=10, image_size=28)`; with `pretrained="imagenet21k"` (a tag of
    `vitkit pretrained`) its released weights, adapted to the overrides."""
    if pretrained is not None:
        from .checkpoints import load_pretrained  # the facade sits above this module

        return load_pretrained(f"{name}:{pretrained}", **overrides)
    if is_bit_name(name):
        return ResNetClassifier(decode_bit(name, **overrides))
    return VisionTransformer(decode_variant(name, **overrides))


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """The config a model's `config.to_dict()` wrote."""
    if data.get("architecture") == ARCHITECTURE:
        return BiTConfig.from_dict(data)
    return ViTConfig.from_dict(data)


def model_from_config(config: ModelConfig) -> Model:
    """A new model of `config` (freshly initialised)."""
    return ResNetClassifier(config) if isinstance(config, BiTConfig) else VisionTransformer(config)
