"""vitkit: the Vision Transformer of Dosovitskiy et al. (ICLR 2021) in PyTorch."""

from . import inspect
from .checkpoints import export, load, load_checkpoint, save
from .config import ResNetConfig, ViTConfig, decode_variant, list_models
from .efficiency import count_params, flops
from .evaluate import evaluate, predict
from .model import VisionTransformer
from .pretrained import list_pretrained, load_pretrained
from .recipes import TrainConfig
from .train import train

__version__ = "0.1.0"


def create_model(name: str, pretrained: str | None = None, **overrides) -> VisionTransformer:
    """Build a variant by its paper name, e.g. `create_model("ViT-B/16", num_classes=10, image_size=384)`; with
    `pretrained="imagenet21k"` (a tag of `vitkit pretrained`) its released weights, adapted to the overrides."""
    if pretrained is not None:
        return load_pretrained(f"{name}:{pretrained}", **overrides)
    return VisionTransformer(decode_variant(name, **overrides))


__all__ = [
    "ResNetConfig",
    "TrainConfig",
    "ViTConfig",
    "VisionTransformer",
    "count_params",
    "create_model",
    "decode_variant",
    "export",
    "evaluate",
    "flops",
    "inspect",
    "list_models",
    "list_pretrained",
    "load",
    "load_checkpoint",
    "load_pretrained",
    "predict",
    "save",
    "train",
]
