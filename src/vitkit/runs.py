"""A run directory: what one training run leaves behind, and how it is resumed.

config.json          the resolved TrainConfig, model config, dataset and world size
metrics.jsonl        one JSON object per line: training (loss, lr, top-1/top-5, images/s) and evaluation
checkpoint.pt        resumable state (model, optimiser, step, data order, RNG), written atomically,
                     read back with `torch.load(weights_only=True)`: tensors and plain containers only
model.safetensors    the final model (vitkit format, with class names); best.safetensors: best evaluation
curves.png, confusion.png, summary.json, tensorboard/ (when tensorboard is installed)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from .files import atomic_write

CHECKPOINT = "checkpoint.pt"


class RunDir:
    """The files of one run. Only the main process writes (`enabled=False` elsewhere)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._tensorboard = None
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(self.path / "tensorboard"))
            except ImportError:
                self._tensorboard = None

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if self.enabled:
            text = json.dumps(data, indent=2, default=str) + "\n"
            atomic_write(self.path / name, lambda tmp: Path(tmp).write_text(text))

    def log(self, record: dict[str, Any]) -> None:
        """Append one metrics record (and mirror its numbers to TensorBoard)."""
        if not self.enabled:
            return
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            prefix = record.get("split", "train")
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self._tensorboard.add_scalar(f"{prefix}/{key}", value, record["step"])

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        if self.enabled:
            atomic_write(self.path / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_checkpoint(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The resumable state of a run directory, loaded without unpickling arbitrary objects."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no resumable checkpoint. --resume takes a run directory written by `vitkit train`."
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def truncate_metrics(run_dir: str | os.PathLike, step: int) -> None:
    """Drop records written after `step` (logged after the last checkpoint by a run that was then killed)."""
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        kept = [json.dumps(r) for r in read_metrics(run_dir) if r["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def default_run_dir(data: str) -> Path:
    return Path("runs") / f"{data}-{time.strftime('%Y%m%d-%H%M%S')}"


def plot_run(run_dir: str | os.PathLike, confusion: torch.Tensor | None, classes: list[str]) -> None:
    """curves.png (loss, learning rate, accuracy against steps) and confusion.png, with matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "test"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    axes[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="test")
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train])
    axes[2].plot([r["step"] for r in train], [r["top1"] for r in train], label="train top-1")
    axes[2].plot([r["step"] for r in evals], [r["top1"] for r in evals], "o-", label="test top-1")
    for ax, title in zip(axes, ("loss", "learning rate", "accuracy")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(Path(run_dir) / "curves.png", dpi=100)
    plt.close(fig)
    if confusion is None:
        return
    k = len(classes)
    fig, ax = plt.subplots(figsize=(min(2 + 0.5 * k, 20), min(2 + 0.5 * k, 20)))
    rates = confusion.float() / confusion.sum(1, keepdim=True).clamp(min=1)
    ax.imshow(rates.numpy(), cmap="Blues", vmin=0, vmax=1)
    if k <= 30:
        ax.set_xticks(range(k), classes, rotation=90)
        ax.set_yticks(range(k), classes)
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(j, i, str(int(confusion[i, j])), ha="center", va="center", fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion matrix (test)")
    fig.tight_layout()
    fig.savefig(Path(run_dir) / "confusion.png", dpi=100)
    plt.close(fig)
