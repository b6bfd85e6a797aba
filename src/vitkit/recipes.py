"""The paper's training recipes as data: `TrainConfig`, the optimiser with its weight-decay groups, the
learning-rate schedule, and which parameters learn when fine-tuning partially.

Pre-training (Sec. 4.1): Adam (0.9, 0.999) with decoupled weight decay on the weight matrices only, linear
warmup then cosine or linear decay, global gradient-norm clipping at 1. Fine-tuning (official code): SGD with
momentum 0.9, no weight decay, warmup + cosine, clipping at 1, a new zero-initialised head, often at a higher
resolution than pre-training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import check_fields

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear")
PRECISIONS = ("fp32", "bf16")
TRAINABLE = ("full", "head", "attention", "mlp")

# The main job's model: ViT-Ti/4 made much narrower and shallower for 28x28 images (7x7 = 49 patches + class token).
SMALL_MODEL_ARGS = {"hidden_size": 64, "num_layers": 4, "mlp_dim": 128, "num_heads": 4}

# `vitkit finetune`: the official fine-tuning recipe, applied before the user's own overrides.
FINETUNE_DEFAULTS = {
    "optimizer": "sgd",
    "lr": 0.01,
    "weight_decay": 0.0,
    "momentum": 0.9,
    "schedule": "cosine",
    "warmup_fraction": 0.05,
    "grad_clip": 1.0,
    "epochs": 3.0,
    "batch_size": 128,
    "model_args": {},
}


@dataclass(frozen=True)
class TrainConfig:
    """One training or fine-tuning run. Every field is a `vitkit train --<field-with-dashes>` option.

    The defaults are the main job: a small ViT on Fashion-MNIST, Adam(W) with warmup and cosine decay.
    """

    # data
    data: str = "fashion-mnist"
    data_dir: str | None = None
    data_args: dict = field(default_factory=dict)  # extra dataset arguments, e.g. {"val_fraction": 0.2}
    image_size: int | None = None  # model resolution; None: the dataset's own (or the checkpoint's) size
    crop_scale: tuple[float, float] | None = None  # inception-crop area range; None: the dataset's default
    flip: bool | None = None  # random horizontal flip; None: the dataset's default (off for digits)
    randaugment: tuple[int, int] | None = None  # (ops, magnitude), e.g. (2, 15)
    mixup: float = 0.0  # Beta(alpha, alpha); 0 = off
    workers: int = 0  # DataLoader worker processes for datasets decoded on the fly (image folders)
    # model
    model: str = "ViT-Ti/4"
    model_args: dict = field(default_factory=lambda: dict(SMALL_MODEL_ARGS))  # ViTConfig overrides
    checkpoint: str | None = None  # fine-tune from this model file (any format load_checkpoint reads)
    trainable: str = "full"  # which parameters learn: full | head (linear probe) | attention | mlp
    # optimisation
    optimizer: str = "adamw"
    lr: float = 2e-3
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9
    batch_size: int = 128  # global: split over processes and accumulation steps
    accumulation_steps: int = 1
    epochs: float = 6.0
    steps: int | None = None  # total optimiser steps; overrides epochs
    warmup_fraction: float = 0.05
    schedule: str = "cosine"
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    # execution
    precision: str = "fp32"
    device: str = "auto"
    threads: int = 0  # CPU threads for torch; 0: torch's default (one per core)
    seed: int = 0
    eval_every: float = 1.0  # epochs between evaluations on the test split (0: only at the end)
    eval_batch_size: int = 1000
    log_every: int = 20  # steps between lines of metrics.jsonl
    out_dir: str | None = None  # run directory; None: runs/<data>-<time>

    def __post_init__(self) -> None:
        for name, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown: choose one of {', '.join(allowed)}.")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable={self.trainable!r} is unknown: choose one of {', '.join(TRAINABLE)}.")
        for name in ("crop_scale", "betas", "randaugment"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.batch_size < 1 or self.accumulation_steps < 1 or self.batch_size % self.accumulation_steps:
            raise ValueError(
                f"batch_size={self.batch_size} must be a positive multiple of accumulation_steps="
                f"{self.accumulation_steps}: each step averages that many equal micro-batches."
            )
        if self.lr <= 0 or self.weight_decay < 0 or not 0 <= self.warmup_fraction < 1:
            raise ValueError(
                f"lr={self.lr} must be > 0, weight_decay={self.weight_decay} >= 0, "
                f"warmup_fraction={self.warmup_fraction} in [0, 1)."
            )
        if (self.steps is not None and self.steps < 1) or self.epochs <= 0:
            raise ValueError(f"steps={self.steps}, epochs={self.epochs}: train for at least one step.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 1).")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be >= 0 (0 disables clipping).")

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        check_fields(TrainConfig, changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if "train" in data:  # the name of `trainable` in runs and files of vitkit 0.1
            data = {("trainable" if k == "train" else k): v for k, v in data.items()}
        check_fields(cls, data)
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        """Read a YAML (.yaml, .yml) or JSON file of TrainConfig fields."""
        text = Path(path).read_text()
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as e:
                raise ValueError(f"{path}: reading YAML needs pyyaml (pip install pyyaml), or use JSON.") from e
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of TrainConfig fields, got {type(data).__name__}.")
        return cls.from_dict(data)


def field_types() -> dict[str, Any]:
    """TrainConfig field name -> its annotated type (for building command-line options)."""
    return typing.get_type_hints(TrainConfig)


# ------------------------------------------------------------------------------------------------------------
# Which parameters learn, and which are decayed.
# ------------------------------------------------------------------------------------------------------------


def is_trainable(name: str, mode: str) -> bool:
    """Partial fine-tuning: `head` trains the head only (a linear probe); `attention` adds every attention
    projection (qkv, proj), `mlp` every MLP (fc1, fc2); `full` trains everything."""
    if mode == "full":
        return True
    if name.startswith("head."):
        return True
    return (mode == "attention" and ".attn." in name) or (mode == "mlp" and ".mlp." in name)


def set_trainable(model: nn.Module, mode: str) -> list[str]:
    """Set `requires_grad` for a `trainable` mode (see `is_trainable`); returns the names of the parameters that
    learn."""
    if mode not in TRAINABLE:
        raise ValueError(f"trainable={mode!r} is unknown: choose one of {', '.join(TRAINABLE)}.")
    learning = []
    for name, p in model.named_parameters():
        p.requires_grad_(is_trainable(name, mode))
        if p.requires_grad:
            learning.append(name)
    return learning


def is_decayed(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to weight matrices and kernels only: not to biases, norms, posemb or class token."""
    return param.ndim >= 2 and not name.startswith(("posemb.", "cls_token"))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimiser groups of the learning parameters: decayed and not decayed."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if is_decayed(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not is_decayed(n, p)], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """Adam(W) with decoupled weight decay (p -= lr * wd * p, as flax's Adam in the official code) or SGD with
    momentum; the learning rate is set at every step by `learning_rate`."""
    groups = param_groups(model, config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)


def learning_rate(step: int, total_steps: int, base_lr: float, warmup_steps: int, schedule: str) -> float:
    """The official schedule for update `step` (1-based): linear warmup to `base_lr` over `warmup_steps`, then
    cosine (or linear) decay to 0 at `total_steps`."""
    lr = base_lr * min(1.0, step / warmup_steps) if warmup_steps else base_lr
    progress = min(max((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0), 1.0)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (1.0 - progress)
