"""Evaluation (top-1, top-5, per-class accuracy, confusion matrix) and prediction on image files."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .augment import eval_batch
from .data import ImageArrayDataset, LabelledDataset, read_image
from .distributed import World, all_reduce_sum
from .model import VisionTransformer


@dataclass(frozen=True)
class EvalResult:
    """Counts over a whole split; `confusion[i, j]` = images of class i predicted as j."""

    confusion: torch.Tensor  # (K, K) int64
    top5_correct: int
    loss_sum: float

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    @property
    def top1(self) -> float:
        return float(self.confusion.diagonal().sum()) / max(self.count, 1)

    @property
    def top5(self) -> float:
        return self.top5_correct / max(self.count, 1)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.count, 1)

    @property
    def per_class(self) -> list[float]:
        return (self.confusion.diagonal().float() / self.confusion.sum(1).clamp(min=1)).tolist()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CPU or GPU, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batches(dataset: LabelledDataset, index_batches: list[list[int]], workers: int = 0):
    """Yield (uint8 images, labels) for each list of indices. In-memory splits are sliced directly; others are
    decoded by a DataLoader (with `workers` processes), images of different sizes then come as a list."""
    if isinstance(dataset, ImageArrayDataset):
        for idx in index_batches:
            index = torch.as_tensor(idx, dtype=torch.long)
            yield dataset.images[index], dataset.labels[index]
        return
    # Its own generator: creating the loader then draws no number from the global RNG (exact resumption).
    loader: DataLoader = DataLoader(
        dataset,  # type: ignore[arg-type]  # a map-style dataset; torch types it as its own Dataset class
        batch_sampler=index_batches,
        num_workers=workers,
        collate_fn=_collate,
        generator=torch.Generator(),
    )
    yield from loader


def _collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
    images = [s[0] for s in samples]
    labels = torch.tensor([s[1] for s in samples], dtype=torch.long)
    same = all(im.shape == images[0].shape for im in images)
    return (torch.stack(images) if same else images), labels


@torch.no_grad()
def evaluate(
    model: VisionTransformer,
    dataset: LabelledDataset,
    *,
    batch_size: int = 1000,
    precision: str = "fp32",
    world: World | None = None,
    workers: int = 0,
) -> EvalResult:
    """Official evaluation (whole image resized to the model resolution) over a split, shared between the
    processes of `world` (each takes every world.size-th image; the counts are summed)."""
    device = next(model.parameters()).device
    rank, size = (world.rank, world.size) if world else (0, 1)
    indices = list(range(rank, len(dataset), size))
    k = model.config.num_classes
    confusion = torch.zeros(k, k, dtype=torch.long, device=device)
    top5 = torch.zeros((), dtype=torch.long, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    chunks = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    for images, labels in batches(dataset, chunks, workers):
        x = eval_batch(images, model.config.image_size, model.config.in_chans).to(device)
        labels = labels.to(device)
        with autocast(device, precision):
            logits = model(x).float()
        loss += F.cross_entropy(logits, labels, reduction="sum").double()
        confusion += torch.bincount(labels * k + logits.argmax(1), minlength=k * k).reshape(k, k)
        top5 += (logits.topk(min(5, k), dim=1).indices == labels[:, None]).any(1).sum()
    model.train(was_training)
    if world is not None:
        for t in (confusion, top5, loss):
            all_reduce_sum(t, world)
    return EvalResult(confusion.cpu(), int(top5), float(loss))


def format_eval(result: EvalResult, classes: list[str] | None) -> str:
    """Top-1/top-5 and a per-class accuracy table."""
    classes = classes or [str(i) for i in range(len(result.per_class))]
    lines = [f"top-1 {100 * result.top1:.2f}%   top-5 {100 * result.top5:.2f}%   ({result.count} images)"]
    width = max(len(c) for c in classes)
    for name, acc, n in zip(classes, result.per_class, result.confusion.sum(1).tolist()):
        lines.append(f"  {name:<{width}}  {100 * acc:6.2f}%  of {n}")
    return "\n".join(lines)


@torch.no_grad()
def predict(model: VisionTransformer, paths: list[str | os.PathLike], k: int = 5) -> list[list[tuple[str, float]]]:
    """Top-k (class name, probability) for each image file, evaluated as in `evaluate`."""
    model.eval()
    device = next(model.parameters()).device
    names = model.class_names or [str(i) for i in range(model.config.num_classes)]
    out = []
    for path in paths:
        x = eval_batch(read_image(path), model.config.image_size, model.config.in_chans).to(device)
        probs = model(x).float().softmax(-1)[0]
        top = probs.topk(min(k, len(probs)))
        out.append([(names[i], float(p)) for p, i in zip(top.values.tolist(), top.indices.tolist())])
    return out
