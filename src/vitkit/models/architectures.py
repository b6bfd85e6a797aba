"""Every architecture vitkit builds, by name or from a saved config: the Vision Transformer (`model.py`) and
the BiT-style ResNet baseline the paper compares it with (`resnet.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import ViTConfig, check_fields, check_type, decode_variant
from .resnet import ARCHITECTURE, BiTConfig, ResNetClassifier, decode_bit, is_bit_name
from .vit import VisionTransformer

Model = VisionTransformer | ResNetClassifier
ModelConfig = ViTConfig | BiTConfig


def new_model(name: str, **overrides: Any) -> Model:
    """A freshly initialised variant by its paper name, e.g. `new_model("ViT-B/16", num_classes=10, image_size=384)`
    or the baseline `new_model("BiT-R26", num_classes=10, image_size=28)`. (`vitkit.create_model` adds released
    weights by name on top of this.)"""
    if is_bit_name(name):
        return ResNetClassifier(decode_bit(name, **overrides))
    return VisionTransformer(decode_variant(name, **overrides))


def check_overrides(name: str, overrides: dict[str, Any]) -> None:
    """The ValueError `new_model(name, **overrides)` would raise for an unknown name or field or a value of the
    wrong type, found without building a model (so that a run fails before it loads its data)."""
    (decode_bit if is_bit_name(name) else decode_variant)(name)  # a misspelt name, with the closest ones
    cls = BiTConfig if is_bit_name(name) else ViTConfig
    check_fields(cls, overrides)
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in overrides.items():
        check_type(key, value, types[key])


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """The config a model's `config.to_dict()` wrote."""
    if data.get("architecture") == ARCHITECTURE:
        return BiTConfig.from_dict(data)
    return ViTConfig.from_dict(data)


def model_from_config(config: ModelConfig) -> Model:
    """A new model of `config` (freshly initialised)."""
    return ResNetClassifier(config) if isinstance(config, BiTConfig) else VisionTransformer(config)
