"""A training run's state between steps (`TrainState`), and its checkpoint: what `save_checkpoint` writes and
`restore` puts back, so that a resumed run continues exactly; `save_model` writes the model file itself.

A whole model (one process, or DDP) is saved as checkpoint.pt, its RNG states as tensors; a sharded one (FSDP) as the
directory checkpoint/ with torch.distributed.checkpoint, its RNG states as hex text in state.json.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vitkit.data.augment import AugmentConfig
from vitkit.formats.checkpoints import export
from vitkit.models.architectures import Model, config_from_dict, model_from_config

from .distributed import World, all_gather_tensors, full_state_dict, is_sharded, load_sharded, save_sharded
from .recipes import StepPlan, TrainConfig
from .runs import SHARDED_CHECKPOINT, MetricsWindow, RunDir, truncate_metrics

CHECKPOINT_FORMAT = "vitkit-train/1"


@dataclass
class TrainState:
    """What the steps of a run share: the fixed set-up, then what changes from step to step. `checkpoint_state`
    saves the changing part with the RNG states, `restore` puts it back."""

    config: TrainConfig
    world: World
    plan: StepPlan
    augment: AugmentConfig
    model: Model
    net: torch.nn.Module  # what a step calls: the model (FSDP-sharded or not), or its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    run: RunDir
    step: int = 0  # optimiser updates done
    skipped_steps: int = 0  # steps with a non-finite loss or gradient, not applied (nonfinite="skip")
    saved_step: int | None = None  # the step of the newest checkpoint
    best_top1: float = -1.0
    elapsed: float = 0.0  # seconds in training steps, over all sessions of the run
    wall_before: float = 0.0  # wall-clock seconds of the earlier sessions of the run
    session_start: float = 0.0  # time.perf_counter() when this session began
    window: MetricsWindow = field(default_factory=MetricsWindow)
    class_weights: torch.Tensor | None = None  # the loss's weight of each class (`balanced`), or None: all alike


def saved_model(saved: dict, dataset) -> Model:
    """The architecture of a saved run, named with the dataset's classes; `restore` loads its weights."""
    model = model_from_config(config_from_dict(json.loads(saved["model_config"])))
    model.class_names = list(dataset.classes)
    return model


def restore(state: TrainState, saved: dict) -> None:
    """Continue from a checkpoint: weights, optimiser, step, best top-1, training seconds, and each process's RNG
    (when the number of processes is unchanged); metrics logged after the checkpoint are dropped. A sharded
    checkpoint is resharded over however many processes there are now."""
    if saved.get("sharded"):
        load_sharded(saved["sharded"], state.model, state.optimizer)
        rng, cuda_rng = ([bytes_tensor(h) for h in saved[key]] for key in ("rng", "cuda_rng"))
    else:
        state.model.load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])
        rng, cuda_rng = saved["rng"], saved.get("cuda_rng") or []
    state.step, state.best_top1, state.elapsed = int(saved["step"]), float(saved["best_top1"]), float(saved["elapsed"])
    state.skipped_steps, state.saved_step = int(saved.get("skipped_steps", 0)), state.step
    state.wall_before = float(saved.get("wall_elapsed", 0.0))
    world = state.world
    if len(rng) == world.size:
        torch.set_rng_state(rng[world.rank])
        if world.device.type == "cuda" and cuda_rng:
            torch.cuda.set_rng_state(cuda_rng[world.rank], world.device)
    if world.is_main:
        truncate_metrics(state.run.path, state.step)


def save_model(state: TrainState, name: str) -> None:
    """The model as a vitkit file in the run directory, written by the main process. Every process calls this:
    a sharded model is gathered first."""
    if not is_sharded(state.model):
        if state.world.is_main:
            export(state.model, state.run.path / name, overwrite=True)  # best.safetensors: the newest best
        return
    weights = full_state_dict(state.model)
    if weights is not None:  # the main process
        whole = model_from_config(state.model.config)
        whole.load_state_dict(weights)
        whole.class_names, whole.trained_on = state.model.class_names, state.model.trained_on
        export(whole, state.run.path / name, overwrite=True)


def bytes_tensor(text: str) -> torch.Tensor:
    """A uint8 tensor (an RNG state) from its hex text in a JSON checkpoint."""
    return torch.from_numpy(np.frombuffer(bytes.fromhex(text), dtype=np.uint8).copy())


def checkpoint_state(state: TrainState) -> dict:
    """Everything `restore` needs but the weights and the optimiser, every process's RNG state included (a
    collective call: all processes)."""
    world, plan = state.world, state.plan
    rng = all_gather_tensors(torch.get_rng_state(), world)
    cuda_rng = all_gather_tensors(torch.cuda.get_rng_state(world.device), world) if world.device.type == "cuda" else []
    return {
        "format": CHECKPOINT_FORMAT,
        "config": json.dumps(state.config.to_dict()),
        "model_config": json.dumps(state.model.config.to_dict()),
        "step": state.step,
        "epoch": state.step // plan.steps_per_epoch,
        "batch_in_epoch": state.step % plan.steps_per_epoch,
        "sampler_seed": state.config.seed,
        "total_steps": plan.total,
        "best_top1": state.best_top1,
        "elapsed": state.elapsed,
        "skipped_steps": state.skipped_steps,
        "wall_elapsed": state.wall_before + time.perf_counter() - state.session_start,
        "world_size": world.size,  # with the workers, they set a packed-shard run's data order (check_data_order)
        "workers": state.config.workers,
        "rng": [t.cpu() for t in rng],
        "cuda_rng": [t.cpu() for t in cuda_rng],
    }


def save_checkpoint(state: TrainState) -> None:
    """checkpoint.pt in the run directory, written atomically by the main process; for a sharded model the
    directory checkpoint/, written by all processes with torch.distributed.checkpoint (tensors only) and
    state.json (the rest, RNG states as hex), swapped in atomically."""
    progress = checkpoint_state(state)
    if is_sharded(state.model):
        for key in ("rng", "cuda_rng"):
            progress[key] = [t.numpy().tobytes().hex() for t in progress[key]]
        save_sharded(state.run.path / SHARDED_CHECKPOINT, state.model, state.optimizer, progress)
    else:
        weights = {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}
        state.run.save_checkpoint({**progress, **weights})
    state.saved_step = state.step
