"""vitkit: the Vision Transformer of Dosovitskiy et al. (ICLR 2021) in PyTorch.

Every public name is imported the first time it is used (`vitkit.create_model`, `from vitkit import train`), so
`import vitkit` costs nothing and the `vitkit` command can answer a Ctrl-C while torch is still loading.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers and readers
    from vitkit.analysis.experiment_runs import experiment
    from vitkit.errors import CheckpointError, ImageError
    from vitkit.formats.checkpoints import create_model, export, load_checkpoint, load_pretrained
    from vitkit.formats.pretrained import list_pretrained
    from vitkit.models.config import ResNetConfig, ViTConfig, decode_variant, list_models
    from vitkit.models.efficiency import count_params, flops
    from vitkit.models.vit import VisionTransformer
    from vitkit.speed.benchmark import bench
    from vitkit.speed.optimize import optimize
    from vitkit.training.evaluation import evaluate, fewshot, predict
    from vitkit.training.loop import train
    from vitkit.training.recipes import TrainConfig

__version__ = "0.2.0"

# Public names: name -> the module that defines it, loaded on first use.
_LAZY = {
    "create_model": "formats.checkpoints",
    "export": "formats.checkpoints",
    "load_checkpoint": "formats.checkpoints",
    "load_pretrained": "formats.checkpoints",
    "ResNetConfig": "models.config",
    "ViTConfig": "models.config",
    "decode_variant": "models.config",
    "list_models": "models.config",
    "count_params": "models.efficiency",
    "flops": "models.efficiency",
    "CheckpointError": "errors",
    "ImageError": "errors",
    "optimize": "speed.optimize",
    "VisionTransformer": "models.vit",
    "list_pretrained": "formats.pretrained",
    "TrainConfig": "training.recipes",
    "train": "training.loop",
    "evaluate": "training.evaluation",
    "predict": "training.evaluation",
    "fewshot": "training.evaluation",
    "experiment": "analysis.experiment_runs",
    "bench": "speed.benchmark",
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
