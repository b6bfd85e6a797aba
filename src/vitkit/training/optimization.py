"""The optimiser of a run and its learning rate: Adam(W) or SGD by name, the weight-decay groups (with layer-wise
decay), the warmup and decay schedule, and which parameters learn when fine-tuning partially.

Pre-training (Sec. 4.1): Adam with decoupled weight decay on the weight matrices only, linear warmup then cosine or
linear decay. Fine-tuning (official code): SGD with momentum 0.9, no weight decay, warmup + cosine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .recipes import TrainConfig

# The optimisers and decay schedules by name: what --optimizer and --schedule accept is what they build.
OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]], TrainConfig], torch.optim.Optimizer]] = {
    "adamw": lambda groups, c: torch.optim.AdamW(groups, lr=c.lr, betas=c.betas, fused=fused_pays(groups)),
    "sgd": lambda groups, c: torch.optim.SGD(groups, lr=c.lr, momentum=c.momentum),
}


def fused_pays(groups: list[dict[str, Any]]) -> bool | None:
    """Adam's fused kernel (one pass over all parameters, where the per-tensor loop costs a call per small tensor)
    where it runs: plain CPU or CUDA tensors. None (torch's choice) for sharded (DTensor) parameters."""
    params = [p for g in groups for p in g["params"]]
    plain = all(type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
    return True if plain and params else None


SCHEDULES: dict[str, Callable[[float], float]] = {  # the factor of the peak rate at `progress` (0 to 1) of the decay
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
}
TRAINABLE = ("full", "head", "attention", "mlp")


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


def set_trainable(model: nn.Module, mode: str, frozen_blocks: int = 0) -> list[str]:
    """Set `requires_grad` for a `trainable` mode (see `is_trainable`) with what comes before the encoder and its
    first `frozen_blocks` blocks frozen (`layer_depth` at most `frozen_blocks`); returns the names of the parameters
    that learn."""
    if mode not in TRAINABLE:
        raise ValueError(f"trainable={mode!r} is unknown: choose one of {', '.join(TRAINABLE)}.")
    blocks = getattr(model, "blocks", None)  # the ResNet baseline has none
    depth = 0 if blocks is None else len(blocks)
    if frozen_blocks > depth:
        have = f"has {depth} encoder blocks" if depth else "has no encoder blocks"
        raise ValueError(f"frozen_blocks={frozen_blocks}: the model {have}; give at most that many, or 0.")
    learning = []
    for name, p in model.named_parameters():
        frozen = frozen_blocks > 0 and layer_depth(name, depth) <= frozen_blocks
        p.requires_grad_(is_trainable(name, mode) and not frozen)
        if p.requires_grad:
            learning.append(name)
    return learning


def is_decayed(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to weight matrices and kernels only: not to biases, norms, posemb or class token."""
    return param.ndim >= 2 and not name.startswith(("posemb.", "cls_token"))


def layer_depth(name: str, num_layers: int) -> int:
    """A parameter's depth for layer-wise decay: 0 for what comes before the encoder (stem, patch embedding,
    class token, position embeddings), i + 1 for encoder block i, `num_layers` + 1 for the final norm and the head.
    Wrappers' parts of the name (`_fsdp_wrapped_module`, `_orig_mod`, ...) are left out."""
    parts = [part for part in name.split(".") if not part.startswith("_")]
    if parts[0] == "blocks":
        return int(parts[1]) + 1
    if parts[0] in ("stem", "embedding", "cls_token", "posemb"):
        return 0
    return num_layers + 1


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0) -> list[dict[str, Any]]:
    """The optimiser groups of the learning parameters: decayed and not decayed, and with `layer_decay` < 1 one
    pair per depth, each with its `lr_scale` (`layer_depth`; as BEiT's and timm's layer decay)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    blocks = getattr(model, "blocks", None)
    if layer_decay == 1.0 or blocks is None:  # the ResNet baseline has no blocks to count
        depths = {n: 0 for n, _ in named}
        scales = [1.0]
    else:
        depths = {n: layer_depth(n, len(blocks)) for n, _ in named}
        scales = [layer_decay ** (len(blocks) + 1 - d) for d in range(len(blocks) + 2)]
    groups = []
    for depth, scale in enumerate(scales):
        for decayed, wd in ((True, weight_decay), (False, 0.0)):
            params = [p for n, p in named if depths[n] == depth and is_decayed(n, p) == decayed]
            if params or len(scales) == 1:
                groups.append({"params": params, "weight_decay": wd, "lr_scale": scale})
    return groups


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """Adam(W) with decoupled weight decay (p -= lr * wd * p, as flax's Adam in the official code) or SGD with
    momentum; the learning rate is set at every step by `learning_rate`."""
    layer_decay = 1.0 if config.layer_decay is None else config.layer_decay  # None: not fitted to a run, off
    return OPTIMIZERS[config.optimizer](param_groups(model, config.weight_decay, layer_decay), config)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the step's learning rate on every group, scaled by the group's `lr_scale` (layer-wise decay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def learning_rate(step: int, total_steps: int, base_lr: float, warmup_steps: int, schedule: str) -> float:
    """The official schedule for update `step` (1-based): linear warmup to `base_lr` over `warmup_steps`, then
    cosine (or linear) decay to 0 at `total_steps`."""
    lr = base_lr * min(1.0, step / warmup_steps) if warmup_steps else base_lr
    progress = min(max((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0), 1.0)
    return lr * SCHEDULES[schedule](progress)
