"""vitkit: the Vision Transformer of Dosovitskiy et al. (ICLR 2021) in PyTorch.

`import vitkit` loads the model, its configs and checkpoints; the training, evaluation and analysis stacks
(torchvision, tqdm, matplotlib) are imported the first time one of their names is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .checkpoints import create_model, export, load_checkpoint, load_pretrained
from .config import ResNetConfig, ViTConfig, decode_variant, list_models
from .efficiency import count_params, flops
from .errors import CheckpointError, ImageError
from .inference import optimize
from .model import VisionTransformer
from .pretrained import list_pretrained
from .recipes import TrainConfig

__version__ = "0.2.0.dev0"

# Public names whose modules load on first use: name -> module.
_LAZY = {
    "train": "training",
    "evaluate": "evaluation",
    "predict": "evaluation",
    "fewshot": "evaluation",
    "experiment": "experiments",
    "bench": "benchmark",
}
_SUBMODULES = ("analysis", "benchmark", "data", "experiments", "formats", "inference", "report", "training",
               "evaluation")  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'vitkit' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "ImageError",
    "ResNetConfig",
    "TrainConfig",
    "ViTConfig",
    "VisionTransformer",
    "bench",
    "count_params",
    "create_model",
    "decode_variant",
    "evaluate",
    "experiment",
    "export",
    "fewshot",
    "flops",
    "list_models",
    "list_pretrained",
    "load_checkpoint",
    "load_pretrained",
    "optimize",
    "predict",
    "train",
]
