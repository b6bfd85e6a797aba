"""vitkit: the Vision Transformer of Dosovitskiy et al. (ICLR 2021) in PyTorch.

Every public name is imported the first time it is used (`vitkit.create_model`, `from vitkit import train`), so
`import vitkit` costs nothing and the `vitkit` command can answer a Ctrl-C while torch is still loading.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers and readers
    from .benchmark import bench
    from .checkpoints import create_model, export, load_checkpoint, load_pretrained
    from .config import ResNetConfig, ViTConfig, decode_variant, list_models
    from .efficiency import count_params, flops
    from .errors import CheckpointError, ImageError
    from .evaluation import evaluate, fewshot, predict
    from .experiment_runs import experiment
    from .inference import optimize
    from .model import VisionTransformer
    from .pretrained import list_pretrained
    from .recipes import TrainConfig
    from .training import train

__version__ = "0.2.0"

# Public names: name -> the module that defines it, loaded on first use.
_LAZY = {
    "create_model": "checkpoints",
    "export": "checkpoints",
    "load_checkpoint": "checkpoints",
    "load_pretrained": "checkpoints",
    "ResNetConfig": "config",
    "ViTConfig": "config",
    "decode_variant": "config",
    "list_models": "config",
    "count_params": "efficiency",
    "flops": "efficiency",
    "CheckpointError": "errors",
    "ImageError": "errors",
    "optimize": "inference",
    "VisionTransformer": "model",
    "list_pretrained": "pretrained",
    "TrainConfig": "recipes",
    "train": "training",
    "evaluate": "evaluation",
    "predict": "evaluation",
    "fewshot": "evaluation",
    "experiment": "experiment_runs",
    "bench": "benchmark",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule: vitkit.files, vitkit.analysis, ...
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
