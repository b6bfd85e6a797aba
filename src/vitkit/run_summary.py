"""What a training run reports: the time its remaining steps take, as it goes (`time_left`), and how it ended
(`TrainResult`), written to the run's summary.json (`summary_dict`) and printed (`format_summary`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .architectures import Model
from .config import ViTConfig
from .efficiency import count_params
from .evaluation import EvalResult, format_eval
from .recipes import TrainConfig


@dataclass(frozen=True)
class TrainResult:
    """How a run ended: `step` of `total_steps` done (fewer when interrupted), the last evaluation."""

    run_dir: Path
    step: int
    total_steps: int
    interrupted: bool
    final: EvalResult | None
    best_top1: float
    seconds: float  # in training steps, over all sessions of the run
    wall_seconds: float  # over all sessions of the run, data loading and evaluation included
    skipped_steps: int = 0  # non-finite steps not applied (nonfinite="skip")
    skipped_images: int = 0  # unreadable image files left out (this session)


def time_left(seconds: float, done: int, left: int) -> str:
    """The time the `left` steps take at the pace of the `done` ones (which took `seconds`, evaluations included):
    "40 s", "13 min", "3.1 h"; "" when nothing is left or nothing is done yet."""
    if left <= 0 or done <= 0:
        return ""
    eta = seconds / done * left
    return f"{eta:.0f} s" if eta < 90 else f"{eta / 60:.0f} min" if eta < 90 * 60 else f"{eta / 3600:.1f} h"


def summary_dict(result: TrainResult, config: TrainConfig, model: Model) -> dict:
    return {
        "run_dir": str(result.run_dir),
        "data": config.data,
        "step": result.step,
        "total_steps": result.total_steps,
        "interrupted": result.interrupted,
        "train_seconds": result.seconds,
        "wall_seconds": result.wall_seconds,
        "test_top1": result.final.top1 if result.final else None,
        "test_top5": result.final.top5 if result.final else None,
        "best_test_top1": result.best_top1,
        "per_class": dict(zip(model.class_names or [], result.final.per_class)) if result.final else None,
        "parameters": count_params(model.config),
        "skipped_steps": result.skipped_steps,
        "skipped_images": result.skipped_images,
    }


def format_summary(result: TrainResult, config: TrainConfig, model: Model) -> str:
    """The one-screen summary printed at the end of a run."""
    c = model.config
    shape = f"patch {c.patch_size[0]}, D={c.hidden_size}, L={c.num_layers}" if isinstance(c, ViTConfig) else c.name
    lines = [
        "=" * 72,
        f"run        {result.run_dir}",
        f"data       {config.data}   model {config.checkpoint or config.model} {c.image_size[0]}x{c.image_size[1]}, "
        f"{shape}, {count_params(c):,} params",
        f"recipe     {config.optimizer} lr {config.lr:g}, wd {config.weight_decay:g}, batch {config.batch_size}, "
        f"{config.schedule}, warmup {config.warmup_fraction:g}, trainable={config.trainable}, {config.precision}",
        f"steps      {result.step}/{result.total_steps} in {result.seconds / 60:.1f} min of training, "
        f"{result.wall_seconds / 60:.1f} min wall (data and evaluation included)",
    ]
    if result.interrupted:
        lines.append(f"stopped    checkpoint saved; continue with: vitkit train --resume {result.run_dir}")
    if result.skipped_steps or result.skipped_images:
        lines.append(
            f"skipped    {result.skipped_steps} non-finite step(s), {result.skipped_images} unreadable image(s)"
        )
    if result.final is not None:
        lines.append(f"test       {format_eval(result.final, model.class_names)}")
        lines.append(f"best       top-1 {100 * result.best_top1:.2f}%")
    files = sorted(f"{p.name}/" if p.is_dir() else p.name for p in Path(result.run_dir).iterdir() if p.name[0] != ".")
    lines += [f"files      {', '.join(files)}", "=" * 72]
    return "\n".join(lines)
