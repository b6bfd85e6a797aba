"""What a training run reports: the time its remaining steps take, as it goes (`time_left`), and how it ended
(`TrainResult`), written to the run's summary.json (`summary_dict`) and printed (`format_summary`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vitkit.models.architectures import Model
from vitkit.models.config import ViTConfig
from vitkit.models.efficiency import count_params

from .evaluation import EvalResult, format_per_class, format_scores
from .recipes import TrainConfig


@dataclass(frozen=True)
class TrainResult:
    """How a run ended: `step` of `total_steps` done (fewer when interrupted), its last evaluation on val and its one
    evaluation on test (None where the data has no such split, or the run was interrupted)."""

    run_dir: Path
    step: int
    total_steps: int
    interrupted: bool
    val: EvalResult | None
    test: EvalResult | None
    best_top1: float  # the best val top-1 of the run's evaluations (best.safetensors)
    seconds: float  # in training steps, over all sessions of the run
    wall_seconds: float  # over all sessions of the run, data loading and evaluation included
    skipped_steps: int = 0  # non-finite steps not applied (nonfinite="skip")
    skipped_images: int = 0  # unreadable image files left out (this session)

    @property
    def final(self) -> EvalResult | None:
        """The run's result: its test evaluation, or without a test split, its last val evaluation."""
        return self.test or self.val


def time_left(seconds: float, done: int, left: int) -> str:
    """The time the `left` steps take at the pace of the `done` ones (which took `seconds`, evaluations included):
    "40 s", "13 min", "3.1 h"; "" when nothing is left or nothing is done yet."""
    if left <= 0 or done <= 0:
        return ""
    eta = seconds / done * left
    return f"{eta:.0f} s" if eta < 90 else f"{eta / 60:.0f} min" if eta < 90 * 60 else f"{eta / 3600:.1f} h"


def summary_dict(result: TrainResult, config: TrainConfig, model: Model) -> dict:
    """summary.json: val and test apart, each with top-1, top-5, balanced accuracy and per-class accuracy."""
    classes = model.class_names or []

    def scores(split: str, e: EvalResult | None) -> dict:
        keys = ("top1", "top5", "balanced_accuracy", "per_class", "images")
        values = (e.top1, e.top5, e.balanced, dict(zip(classes, e.per_class)), e.count) if e else (None,) * 5
        return {f"{split}_{k}": v for k, v in zip(keys, values)}

    return {
        "run_dir": str(result.run_dir),
        "data": config.data,
        "step": result.step,
        "total_steps": result.total_steps,
        "interrupted": result.interrupted,
        "train_seconds": result.seconds,
        "wall_seconds": result.wall_seconds,
        **scores("val", result.val),
        "best_val_top1": result.best_top1 if result.best_top1 >= 0 else None,
        **scores("test", result.test),
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
    if result.val is not None:
        lines.append(
            f"val        {format_scores(result.val)}; best top-1 {100 * result.best_top1:.2f}% (best.safetensors)"
        )
    if result.test is not None:
        lines.append(f"test       {format_scores(result.test)}")
    if result.final is not None:  # the classes of the run's result: test's, else val's
        lines.append(format_per_class(result.final, model.class_names))
    files = sorted(f"{p.name}/" if p.is_dir() else p.name for p in Path(result.run_dir).iterdir() if p.name[0] != ".")
    lines += [f"files      {', '.join(files)}", "=" * 72]
    return "\n".join(lines)
