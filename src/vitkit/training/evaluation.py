"""Evaluation (top-1, top-5, per-class accuracy, confusion matrix) and prediction on image files."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from vitkit.data.augment import model_input
from vitkit.data.datasets import ImageArrayDataset, LabelledDataset, in_class_order
from vitkit.data.image_folder import IMAGE_SUFFIXES
from vitkit.data.images import SkipLog, image_paths, read_image
from vitkit.errors import ImageError, reporting_dead_workers
from vitkit.models.architectures import Model
from vitkit.speed.copies import CALIBRATION_IMAGES

from .distributed import World, all_reduce_sum, is_sharded


@dataclass(frozen=True)
class EvalResult:
    """Counts over a whole split; `confusion[i, j]` = images of class i predicted as j."""

    confusion: torch.Tensor  # (K, K) int64
    top5_correct: int
    loss_sum: float
    classes_matched: str = "same"  # how the dataset's classes met the model's: `in_models_classes`

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

    @property
    def balanced(self) -> float:
        """Balanced accuracy: the mean of the per-class accuracies over the classes present (scikit-learn's
        `balanced_accuracy_score`), which a majority class cannot carry as it carries top-1."""
        present = self.confusion.sum(1) > 0
        return float(torch.tensor(self.per_class)[present].mean()) if present.any() else 0.0


def device_of(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: its parameters' device; the CPU for a copy held by a runtime (no parameters)."""
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CPU or GPU, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batches(dataset: LabelledDataset, index_batches: list[list[int]], workers: int = 0):
    """Yield (uint8 images, labels) for each list of indices. In-memory splits are sliced directly; others are
    decoded by a DataLoader (with `workers` processes), images of different sizes then come as a list. Samples
    whose file failed to decode are dropped from their batch and logged in `dataset.skipped` (one warning each);
    a worker that dies is reported as an error, never waited on."""
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
    skipped = getattr(dataset, "skipped", None)
    if skipped is None:
        skipped = SkipLog()
    for images, labels, failed in reporting_dead_workers(loader):
        for error in failed:
            skipped.add(error)
        yield images, labels


def _collate(samples: list[tuple[torch.Tensor | ImageError, int]]):
    images = [s[0] for s in samples if isinstance(s[0], torch.Tensor)]
    labels = torch.tensor([s[1] for s in samples if isinstance(s[0], torch.Tensor)], dtype=torch.long)
    same = bool(images) and all(im.shape == images[0].shape for im in images)
    failed = [s[0] for s in samples if isinstance(s[0], ImageError)]
    return (torch.stack(images) if same else images), labels, failed


@torch.no_grad()
def evaluate(
    model: Model,
    dataset: LabelledDataset,
    *,
    batch_size: int = 1000,
    precision: str = "fp32",
    world: World | None = None,
    workers: int = 0,
    progress: bool = False,
) -> EvalResult:
    """Official evaluation (whole image resized to the model resolution) over a split, shared between the
    processes of `world` (each takes every world.size-th image; the counts are summed). `progress` shows a
    bar on a terminal (none in a log)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: evaluate at least one image per batch (e.g. 1000).")
    dataset, matched = in_models_classes(dataset, model)
    device = device_of(model)
    rank, size = (world.rank, world.size) if world else (0, 1)
    indices = list(range(rank, len(dataset), size))
    k = model.config.num_classes
    confusion = torch.zeros(k, k, dtype=torch.long, device=device)
    top5 = torch.zeros((), dtype=torch.long, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    chunks = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    bar = tqdm(total=len(indices), desc="evaluating", unit="img", disable=None if progress else True)
    for images, labels in batches(dataset, chunks, workers):
        bar.update(len(labels))
        if not len(labels):  # every file of the batch was skipped
            continue
        x = model_input(images, model).to(device)
        labels = labels.to(device)
        with autocast(device, precision):
            logits = model(x).float()
        loss += F.cross_entropy(logits, labels, reduction="sum").double()
        confusion += torch.bincount(labels * k + logits.argmax(1), minlength=k * k).reshape(k, k)
        top5 += (logits.topk(min(5, k), dim=1).indices == labels[:, None]).any(1).sum()
    if world is not None and is_sharded(model):
        # FSDP gathers the weights in every forward: each process must run as many as the one with most images.
        dummy = torch.zeros(1, model.config.in_chans, *model.config.image_size, device=device)
        for _ in range(math.ceil(math.ceil(len(dataset) / size) / batch_size) - len(chunks)):
            model(dummy)
    bar.close()
    model.train(was_training)
    if world is not None:
        for t in (confusion, top5, loss):
            all_reduce_sum(t, world)
    return EvalResult(confusion.cpu(), int(top5), float(loss), matched)


def in_models_classes(dataset: LabelledDataset, model: Model) -> tuple[LabelledDataset, str]:
    """`dataset` with its labels in the order of the model's classes, and how they were matched: "same" (the same
    names in the same order, or one side names none), "by name" (the same names in another order, as a folder sorts
    them and a built-in dataset may not: relabelled), or "by position" (other names, as after renaming a folder:
    the dataset's first class is compared with the model's first, with a warning)."""
    names, classes = getattr(model, "class_names", None), getattr(dataset, "classes", None)
    if not names or not classes or list(names) == list(classes):
        return dataset, "same"
    if sorted(names) == sorted(classes):
        return in_class_order(dataset, list(names)), "by name"

    def some(values) -> str:
        return ", ".join(values[:4]) + (", ..." if len(values) > 4 else "")

    warnings.warn(
        f"the dataset's classes ({some(list(classes))}) are not the model's ({some(list(names))}): labels are "
        "compared by position, the dataset's first class as the model's first.",
        stacklevel=3,
    )
    return dataset, "by position"


def _calibration_draw(count: int, images: int, seed: int) -> list[int]:
    """`images` of the indices 0..count-1 drawn at random (`seed`; all of them, shuffled, if fewer)."""
    if images < 1:
        raise ValueError(f"images={images}: calibrate on at least one image (a few hundred is typical).")
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:images].tolist()


def calibration_from_dataset(
    model: Model, dataset: LabelledDataset, images: int = CALIBRATION_IMAGES, batch_size: int = 128, seed: int = 0
) -> list[torch.Tensor]:
    """`images` images drawn at random (`seed`) from `dataset`, preprocessed as `evaluate` does, in batches: the
    calibration data of `vitkit.optimize(model, "int8", calibration=...)` (pass the training split)."""
    order = _calibration_draw(len(dataset), images, seed)
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [model_input(x, model) for x, labels in batches(dataset, chunks) if len(labels)]


def calibration_from_files(
    model: Model, paths: Sequence[str | os.PathLike], images: int = CALIBRATION_IMAGES, seed: int = 0
) -> torch.Tensor:
    """The readable images among `images` of `paths` drawn at random (`seed`; all of them if fewer), preprocessed
    as `predict` does, as one (B, C, H, W) batch: the calibration data `vitkit predict --precision int8` uses."""
    pixels = []
    for i in sorted(_calibration_draw(len(paths), images, seed)):
        with contextlib.suppress(ImageError):  # `predict` reports it, once
            pixels.append(model_input(read_image(paths[i]), model))
    if not pixels:
        raise ValueError("no readable image to calibrate int8 on: give image files that open.")
    return torch.cat(pixels)


def format_eval(result: EvalResult, classes: list[str] | None) -> str:
    """Top-1, top-5 and balanced accuracy (`format_scores`), then a per-class accuracy table (`format_per_class`)."""
    return f"{format_scores(result)}\n{format_per_class(result, classes)}"


def format_scores(result: EvalResult) -> str:
    """One line: top-1, top-5, balanced accuracy and the number of images."""
    return (
        f"top-1 {100 * result.top1:.2f}%   top-5 {100 * result.top5:.2f}%   balanced {100 * result.balanced:.2f}%"
        f"   ({result.count} images)"
    )


def format_per_class(result: EvalResult, classes: list[str] | None) -> str:
    """Each class's accuracy and its number of images, a line each."""
    classes = classes or [str(i) for i in range(len(result.per_class))]
    width = max(len(c) for c in classes)
    counts = result.confusion.sum(1).tolist()
    return "\n".join(
        f"  {name:<{width}}  {100 * acc:6.2f}%  of {n}" for name, acc, n in zip(classes, result.per_class, counts)
    )


def image_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The image files named, a directory standing for the images in it and its subfolders (sorted; hidden files
    and folders left out, `images.image_paths`), so a folder of class folders can be given whole."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = image_paths(path)
            if not found:
                raise FileNotFoundError(f"{path}: a directory with no images ({', '.join(IMAGE_SUFFIXES)}).")
            files += found
        else:
            files.append(path)
    return files


def input_notes(model: Model, image: torch.Tensor) -> list[str]:
    """Ways an image (uint8 (C, H, W), as read) differs clearly from what the model was trained on, judged by
    what its checkpoint records (`trained_on`, else the model's channels and resolution): colour given to a
    model of grayscale images, or a size far (over 4x) from the training images'."""
    seen = getattr(model, "trained_on", None) or {}
    notes = []
    grayscale = seen.get("grayscale", model.config.in_chans == 1)
    colour = image.shape[0] >= 3 and float((image[:3].float() - image[:3].float().mean(0)).abs().mean()) > 4.0
    if grayscale and colour:
        where = f" ({seen['data']})" if "data" in seen else ""
        notes.append(f"a colour image, but the model was trained on grayscale images{where}: read it with care")
    th, tw = seen.get("image_size") or model.config.image_size
    h, w = image.shape[-2:]
    if max(h / th, w / tw, th / h, tw / w) > 4:
        notes.append(
            f"{w}x{h} px, far from the {tw}x{th} px images it was trained on (resized to "
            f"{model.config.image_size[1]}x{model.config.image_size[0]}): detail is lost or invented"
        )
    return notes


def check_has_classes(model: Model) -> None:
    """Refuse (ValueError) a model without a classification head: it gives features, not classes to predict."""
    if model.config.num_classes == 0:
        raise ValueError(
            "this model has no classification head (num_classes=0): it gives features, not classes. Fine-tune it "
            "on labelled images first (vitkit finetune), or measure its features with vitkit eval --fewshot."
        )


@torch.no_grad()
def predict(
    model: Model,
    paths: Sequence[str | os.PathLike],
    k: int = 5,
    progress: bool = False,
    strict: bool = False,
) -> list[list[tuple[str, float]] | None]:
    """Top-k (class name, probability) for each image file, evaluated as in `evaluate`. A file that cannot be
    read gives None in its place (with a warning naming it), or with `strict` an ImageError."""
    if k < 1:
        raise ValueError(f"k={k}: ask for at least the top class (k >= 1).")
    check_has_classes(model)
    model.eval()
    device = device_of(model)
    names = model.class_names or [str(i) for i in range(model.config.num_classes)]
    skipped = SkipLog()
    out: list[list[tuple[str, float]] | None] = []
    for path in tqdm(paths, desc="predicting", unit="img", disable=None if progress else True):
        try:
            image = read_image(path)
        except ImageError as e:
            if strict:
                raise
            skipped.add(e)
            out.append(None)
            continue
        x = model_input(image, model).to(device)
        probs = model(x).float().softmax(-1)[0]
        top = probs.topk(min(k, len(probs)))
        out.append([(names[i], float(p)) for p, i in zip(top.values.tolist(), top.indices.tolist())])
    return out


# ----------------------------------------------------------------------------------------------------------
# Few-shot linear evaluation (paper Sec. 4.1 "Metrics"): frozen features, regularised least squares.
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FewShotResult:
    """Test accuracy of the least-squares classifier for each number of shots per class, one per draw."""

    per_draw: dict[int, list[float]]

    @property
    def accuracy(self) -> dict[int, float]:
        """Mean over draws, by shots."""
        return {k: sum(v) / len(v) for k, v in self.per_draw.items()}


@torch.no_grad()
def features(
    model: Model,
    dataset: LabelledDataset,
    indices: list[int],
    batch_size: int = 500,
    *,
    progress: bool = False,
    desc: str = "features",
) -> torch.Tensor:
    """The frozen representation the head sees (the ViT's pre-logits, the ResNet's pooled features), (n, D).
    `progress` shows a bar named `desc` on a terminal (none in a log)."""
    bar = tqdm(total=len(indices), desc=desc, unit="img", disable=None if progress else True)
    out = [x for x, _ in _representations(model, dataset, indices, batch_size, bar)]
    bar.close()
    return torch.cat(out) if out else torch.zeros(0, 0, dtype=torch.float64)


@torch.no_grad()
def _representations(model: Model, dataset: LabelledDataset, indices: list[int], batch_size: int, bar=None):
    """(representation in float64 on the CPU, labels) of each batch of the `indices` images, the model in eval mode;
    an image whose file failed to decode is left out of both (`batches` logs it)."""
    device = device_of(model)
    was_training = model.training
    model.eval()
    chunks = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    try:
        for chunk, (images, labels) in zip(chunks, batches(dataset, chunks)):
            x = model_input(images, model).to(device)
            yield model.forward_head(model.forward_features(x), pre_logits=True).double().cpu(), labels
            if bar is not None:
                bar.update(len(chunk))
    finally:
        model.train(was_training)


def probe_head(model: Model, dataset: LabelledDataset, c: float, precision: str = "fp32") -> float:
    """Set `model`'s (new) head to a linear probe of the `dataset` images: multinomial logistic regression on the
    frozen representation the head sees (`features`), with scikit-learn's L2 penalty ||W||^2 / 2C over the summed
    loss, fitted by L-BFGS in float64. The first stage of LP-FT (linear probe, then fine-tune: Kumar et al. 2022),
    where fine-tuning from a zero head first distorts the features it then has to fit. Returns the probe's training
    top-1."""
    device = device_of(model)
    with autocast(device, precision):
        pairs = list(_representations(model, dataset, list(range(len(dataset))), 500))
    x = torch.cat([x for x, _ in pairs]).to(device)
    y = torch.cat([torch.as_tensor(labels, dtype=torch.long) for _, labels in pairs]).to(device)
    head = model.head
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"probe_head fits a linear head; this model's is a {type(head).__name__}: reset_head first.")
    w = torch.zeros(x.shape[1], head.out_features, dtype=x.dtype, device=device, requires_grad=True)
    b = torch.zeros(head.out_features, dtype=x.dtype, device=device, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = F.cross_entropy(x @ w + b, y, reduction="sum") + (w * w).sum() / (2 * c)
        value.backward()
        return value

    optimizer.step(loss)
    with torch.no_grad():
        head.weight.copy_(w.T)
        head.bias.copy_(b)
        return float(((x @ w + b).argmax(1) == y).double().mean())


def least_squares_fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float) -> torch.Tensor:
    """W minimising ||[x, 1] W - T||^2 + l2 ||W||^2, with T the {-1, 1} one-hot targets: (D+1, K), in float64."""
    x1 = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    targets = 2.0 * F.one_hot(y, num_classes).to(x.dtype) - 1.0
    gram = x1.T @ x1 + l2 * torch.eye(x1.shape[1], dtype=x.dtype)
    return torch.linalg.solve(gram, x1.T @ targets)


def least_squares_predict(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1) @ w).argmax(1)


def fewshot(
    model: Model,
    train_set: LabelledDataset,
    test_set: LabelledDataset,
    shots: tuple[int, ...] = (1, 5, 10),
    draws: int = 5,
    l2: float = 1.0,
    seed: int = 0,
    max_test: int | None = None,
    progress: bool = False,
) -> FewShotResult:
    """Few-shot linear evaluation as in the paper: for each `shots` and each of `draws` random draws of that many
    training images per class, fit a closed-form regularised least-squares map from the frozen features onto
    {-1, 1} targets, and measure its accuracy on the test split (its first `max_test` images when given).
    Deterministic for a seed. `progress` shows bars of the feature extraction (the slow part) on a terminal."""
    labels = _labels(train_set)
    num_classes = len(train_set.classes)
    by_class = [torch.nonzero(labels == c).flatten().tolist() for c in range(num_classes)]
    fewest = min(len(members) for members in by_class)
    if not shots or min(shots) < 1 or max(shots) > fewest or draws < 1:
        raise ValueError(
            f"shots={tuple(shots)}, draws={draws}: need 1 <= shots <= {fewest} (the rarest class's training images) "
            "and draws >= 1."
        )
    generator = torch.Generator().manual_seed(seed)
    chosen: dict[tuple[int, int], list[int]] = {}
    for k in shots:
        for d in range(draws):
            chosen[k, d] = [m[i] for m in by_class for i in torch.randperm(len(m), generator=generator)[:k].tolist()]
    needed = sorted({i for idx in chosen.values() for i in idx})
    train_x = dict(zip(needed, features(model, train_set, needed, progress=progress, desc="few-shot train features")))
    test_idx = list(range(len(test_set) if max_test is None else min(max_test, len(test_set))))
    test_x = features(model, test_set, test_idx, progress=progress, desc="few-shot test features")
    test_y = _labels(test_set)[test_idx]
    per_draw: dict[int, list[float]] = {k: [] for k in shots}
    for (k, _), idx in chosen.items():
        w = least_squares_fit(torch.stack([train_x[i] for i in idx]), labels[idx], num_classes, l2)
        per_draw[k].append(float((least_squares_predict(w, test_x) == test_y).double().mean()))
    return FewShotResult(per_draw)


def _labels(dataset: LabelledDataset) -> torch.Tensor:
    if isinstance(dataset, ImageArrayDataset):
        return dataset.labels
    return torch.tensor([dataset[i][1] for i in range(len(dataset))], dtype=torch.long)
