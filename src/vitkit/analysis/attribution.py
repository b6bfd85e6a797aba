"""Attribution faithfulness: deletion and insertion curves that score saliency maps against random patch orderings.

An attention map shows one layer's and one head's mixing weights, not a region's contribution to the class; these
metrics say which map ranks the patches the prediction depends on. Patches are ranked by the map summed per patch
(the model's patch grid, or `patch` pixels); **deletion** replaces them with the removal baseline most important
first, and the target class's probability should fall fast (low area under the curve); **insertion** reveals them
on the baseline image in the same order, and it should rise fast (high area). The floor is the mean of a few
seeded random orderings. The score depends on the baseline, which every result states: "blur" (a Gaussian blur,
sigma half a patch: the patch's detail gone, its mean colour kept), "mean" (the image's mean colour, as
`analysis.occlusion_sensitivity` fills), "zero" (0 in model input: mid-grey for [-1, 1] inputs, the dataset's mean
colour for normalised ones).

The maps are `saliency`'s (`METHODS`: attention, rollout, occlusion, integrated gradients, gradient x input, attention
x gradient); a map of one's own, any (B, H, W) pixel map or (B, gh, gw) per-patch map such as `Rollout.grid` or
`Occlusion.drop` stacked, is scored by `perturbation_curves`.

The curves are written here, not taken from Quantus 0.6.0: its nearest metrics (`RegionPerturbation`,
`PixelFlipping`) are deletion only, with no insertion curve, and installing it pulls in opencv-python; the two
curves are a few lines over batched forward passes.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vitkit.errors import did_you_mean
from vitkit.models.vit import VisionTransformer

from . import figures as vi
from .saliency import (
    GRADIENT_METHODS,
    METHODS,
    applicable,
    evaluating,
    patch_grid,
    patch_index,
    patch_maps,
    patch_pixels,
    patch_scores,
    spatial_size,
)

LABELS = {
    "attention": "last-layer attention",
    "rollout": "attention rollout",
    "occlusion": "occlusion",
    "integrated_gradients": "integrated gradients",
    "gradient_x_input": "gradient x input",
    "attention_x_gradient": "attention x gradient",
    "random": "random ordering",
}
BASELINES = ("blur", "mean", "zero")
BASELINE_DESCRIPTIONS = {
    "blur": "a Gaussian blur of the image (sigma half a patch): each patch's detail gone, its mean colour kept",
    "mean": "the image's mean colour",
    "zero": "0 in model input (mid-grey for [-1, 1] inputs, the dataset's mean colour for normalised ones)",
}
RANDOM = "random"


@dataclass(frozen=True)
class Curves:
    """The target class's probability as patches are removed (`deletion`) or revealed (`insertion`), (B, steps+1),
    at `fraction` (steps+1,) of the patches; the areas under them are `deletion_auc` and `insertion_auc` (B,)."""

    deletion: torch.Tensor
    insertion: torch.Tensor
    fraction: torch.Tensor

    @property
    def deletion_auc(self) -> torch.Tensor:
        return torch.trapezoid(self.deletion, self.fraction, dim=-1)

    @property
    def insertion_auc(self) -> torch.Tensor:
        return torch.trapezoid(self.insertion, self.fraction, dim=-1)


@dataclass(frozen=True)
class Faithfulness:
    """Deletion and insertion AUC per method and per image (`deletion[method][i]`; lower deletion, higher
    insertion is more faithful), with `"random"` the floor: the mean over `random_deletion` / `random_insertion`
    (orderings x images). `maps` are the per-patch maps ranked (B, gh, gw); `skipped` says why a method was not
    measured. `targets` are the classes explained, `probability` their unperturbed probabilities."""

    baseline: str
    steps: int
    grid: tuple[int, int]
    targets: tuple[int, ...]
    probability: tuple[float, ...]
    deletion: dict[str, tuple[float, ...]]
    insertion: dict[str, tuple[float, ...]]
    random_deletion: tuple[tuple[float, ...], ...]
    random_insertion: tuple[tuple[float, ...], ...]
    maps: dict[str, torch.Tensor]
    skipped: dict[str, str]

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods measured, in `METHODS` order (the random floor not among them)."""
        return tuple(m for m in self.deletion if m != RANDOM)

    def mean(self, method: str, curve: str) -> float:
        """The mean over images of `method`'s (or "random"'s) `curve` ("deletion" or "insertion") AUC."""
        values = getattr(self, curve)[method]
        return sum(values) / len(values)


def removal_baseline(images: torch.Tensor, baseline: str, patch: int) -> torch.Tensor:
    """What a removed patch is replaced with, (B, C, H, W): see the module docstring for each `baseline`."""
    if baseline == "blur":
        return gaussian_blur(images, sigma=patch / 2)
    if baseline == "mean":
        return images.mean(dim=(-2, -1), keepdim=True).expand_as(images).clone()
    if baseline == "zero":
        return torch.zeros_like(images)
    raise ValueError(f"baseline={baseline!r}: choose one of {', '.join(BASELINES)}{did_you_mean(baseline, BASELINES)}.")


def gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Images (B, C, H, W) blurred by torchvision's Gaussian of `sigma` pixels, cut at 2 sigma (and inside the image,
    whose edges its padding reflects)."""
    from torchvision.transforms.functional import gaussian_blur as blur  # here: torchvision is slow to import

    radius = min(math.ceil(2 * sigma), min(images.shape[-2:]) - 1)
    return blur(images, [2 * radius + 1] * 2, [sigma, sigma])


# ----------------------------------------------------------------------------------------------------------
# The curves.
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def _probabilities(
    model: nn.Module, x: torch.Tensor, targets: torch.Tensor, batch_size: int, on_batch: Callable[[int], None] | None
) -> torch.Tensor:
    """softmax(model(x))[target] for each image, `batch_size` images per forward pass."""
    out = []
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start : start + batch_size]).float()
        out.append(logits.softmax(dim=-1).gather(1, targets[start : start + batch_size, None])[:, 0])
        if on_batch is not None:
            on_batch(logits.shape[0])
    return torch.cat(out)


def _curves_of_orders(
    model: nn.Module,
    images: torch.Tensor,
    baselines: torch.Tensor,
    orders: torch.Tensor,
    targets: torch.Tensor,
    steps: int,
    index: torch.Tensor,
    batch_size: int,
    on_batch: Callable[[int], None] | None,
) -> Curves:
    """Deletion and insertion curves of every ordering in `orders` (M, B, P) of the P patches, most important
    first: (M, B, steps+1) each. Images are perturbed a few orderings at a time, so memory stays at about
    `batch_size` images whatever M and B are."""
    m, b, p = orders.shape
    removed = torch.tensor([k * p // steps for k in range(steps + 1)], device=images.device)  # patches out at step k
    ranks = orders.argsort(dim=-1)  # (M, B, P): the position of each patch in its ordering
    jobs = [(i, j) for i in range(m) for j in range(b)]
    per_chunk = max(1, batch_size // (2 * (steps + 1)))
    probs = torch.empty(m, b, 2, steps + 1, device=images.device)
    for start in range(0, len(jobs), per_chunk):
        chunk = jobs[start : start + per_chunk]
        out = []  # (2 * (steps+1), C, H, W) per job: the deletion images, then the insertion images
        for i, j in chunk:
            gone = (ranks[i, j][None, :] < removed[:, None])[:, index]  # (steps+1, H, W)
            gone = gone[:, None]
            out += [torch.where(gone, baselines[j], images[j]), torch.where(gone, images[j], baselines[j])]
        target = torch.stack([targets[j] for _, j in chunk]).repeat_interleave(2 * (steps + 1))
        p_chunk = _probabilities(model, torch.cat(out), target, batch_size, on_batch)
        for n, (i, j) in enumerate(chunk):
            probs[i, j] = p_chunk[n * 2 * (steps + 1) : (n + 1) * 2 * (steps + 1)].reshape(2, steps + 1)
    probs = probs.float().cpu()
    return Curves(probs[:, :, 0], probs[:, :, 1], removed.float().cpu() / p)


def perturbation_curves(
    model: nn.Module,
    images: torch.Tensor,
    maps: torch.Tensor,
    targets: Sequence[int] | torch.Tensor | None = None,
    baseline: str = "blur",
    steps: int | None = None,
    patch: int | None = None,
    batch_size: int = 256,
) -> Curves:
    """Deletion and insertion curves of saliency `maps` (B, H, W) pixels or (B, gh, gw) patches, e.g. a stack of
    `analysis.attention_rollout(...).grid` or `analysis.occlusion_sensitivity(...).drop`, for model input `images`
    (B, C, H, W) and the `targets` classes (default: the predicted ones). `steps` points after the unperturbed one
    (default: one per patch)."""
    images = vi._as_batch(images)
    if maps.shape[0] != images.shape[0]:
        raise ValueError(f"{maps.shape[0]} maps for {images.shape[0]} images: give one map per image.")
    size = spatial_size(images)
    grid = patch_grid(model, size, patch)
    steps = _check_steps(steps, grid)
    explained = _targets(model, images, targets)[0]
    orders = patch_scores(maps.to(images.device), grid, size).flatten(1).argsort(dim=-1, descending=True, stable=True)
    baselines = removal_baseline(images, baseline, patch_pixels(model, patch))
    index = patch_index(grid, size, images.device)
    with evaluating(model):
        curves = _curves_of_orders(model, images, baselines, orders[None], explained, steps, index, batch_size, None)
    return Curves(curves.deletion[0], curves.insertion[0], curves.fraction)


def _check_steps(steps: int | None, grid: tuple[int, int]) -> int:
    patches = grid[0] * grid[1]
    if steps is None:
        return patches
    if not 1 <= steps <= patches:
        raise ValueError(
            f"steps={steps}: the curve has at most one point per patch; use 1 to {patches} (None: one per patch)."
        )
    return steps


@torch.no_grad()
def _targets(
    model: nn.Module, images: torch.Tensor, labels: Sequence[int] | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The classes explained (`labels`, or the predicted ones) and their unperturbed probabilities, (B,) each."""
    if vi.has_no_head(model):
        raise ValueError(
            "the model has no head (num_classes=0): deletion and insertion follow a class probability; give a "
            "classifier (a fine-tuned model, or reset_head(n) and train it)."
        )
    with evaluating(model):
        probs = model(images).float().softmax(dim=-1)
    if labels is None:
        targets = probs.argmax(dim=-1)
    else:
        targets = torch.as_tensor(labels, device=images.device).long().flatten()
        if targets.shape[0] != images.shape[0]:
            raise ValueError(f"{targets.shape[0]} labels for {images.shape[0]} images: give one label per image.")
        bad = [int(t) for t in targets if not 0 <= int(t) < probs.shape[-1]]
        if bad:
            raise ValueError(f"labels {bad} are not classes of this model: use 0..{probs.shape[-1] - 1}.")
    return targets, probs.gather(1, targets[:, None])[:, 0]


# ----------------------------------------------------------------------------------------------------------
# Everything together.
# ----------------------------------------------------------------------------------------------------------


def faithfulness(
    model: nn.Module,
    images: torch.Tensor,
    labels: Sequence[int] | torch.Tensor | None = None,
    methods: Sequence[str] = METHODS,
    baseline: str = "blur",
    steps: int | None = None,
    seed: int = 0,
    orderings: int = 3,
    patch: int | None = None,
    ig_steps: int = 16,
    batch_size: int = 256,
    on_batch: Callable[[int], None] | None = None,
) -> Faithfulness:
    """Deletion and insertion AUC of each method's map on model input `images` (B, C, H, W), against the mean of
    `orderings` random orderings drawn with `seed`, with removed patches replaced by `baseline`.

    `labels`: the classes explained (default: the predicted ones). `steps`: points of each curve after the
    unperturbed one (default: one per patch). `patch`: the square patch in pixels (default: a ViT's own grid; needed
    for other models). `ig_steps`: integrated gradients' points on the path from the baseline. Forward passes
    (`forward_passes` counts them) run `batch_size` images at a time; `on_batch(n)` after each batch of `n` curve
    and occlusion passes."""
    images = vi._as_batch(images)
    if baseline not in BASELINES:
        removal_baseline(images, baseline, 1)  # the error naming the choices
    if orderings < 1:
        raise ValueError(f"orderings={orderings}: the random floor needs at least one random ordering.")
    chosen, skipped = applicable(model, methods)
    size = spatial_size(images)
    grid = patch_grid(model, size, patch)
    steps = _check_steps(steps, grid)
    targets, probability = _targets(model, images, labels)
    baselines = removal_baseline(images, baseline, patch_pixels(model, patch))
    maps = patch_maps(model, images, targets, baselines, chosen, patch, ig_steps, batch_size, on_batch)
    with evaluating(model):
        ranked = [maps[m].flatten(1).argsort(dim=-1, descending=True, stable=True) for m in chosen]
        random = _random_orders(orderings, images.shape[0], grid[0] * grid[1], seed).to(images.device)
        orders = torch.cat([torch.stack(ranked), random]) if ranked else random  # (methods + orderings, B, P)
        index = patch_index(grid, size, images.device)
        curves = _curves_of_orders(model, images, baselines, orders, targets, steps, index, batch_size, on_batch)
    k, deletion, insertion = len(chosen), curves.deletion_auc, curves.insertion_auc  # (methods + orderings, B)
    return Faithfulness(
        baseline=baseline,
        steps=steps,
        grid=grid,
        targets=tuple(int(t) for t in targets),
        probability=_floats(probability),
        deletion=_by_method(deletion, chosen),
        insertion=_by_method(insertion, chosen),
        random_deletion=tuple(_floats(row) for row in deletion[k:]),
        random_insertion=tuple(_floats(row) for row in insertion[k:]),
        maps={m: maps[m].detach().cpu() for m in chosen},
        skipped=skipped,
    )


def _by_method(auc: torch.Tensor, chosen: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """AUCs (methods + orderings, B) per method, the random orderings' mean as `RANDOM`."""
    return {**{m: _floats(auc[i]) for i, m in enumerate(chosen)}, RANDOM: _floats(auc[len(chosen) :].mean(0))}


def _random_orders(orderings: int, images: int, patches: int, seed: int) -> torch.Tensor:
    """(orderings, images, patches): a random permutation of the patches for each, the same for a seed."""
    generator = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(patches, generator=generator) for _ in range(orderings * images)]
    return torch.stack(perms).reshape(orderings, images, patches)


def _floats(values: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def forward_passes(
    model: nn.Module,
    images: int,
    methods: Sequence[str] = METHODS,
    steps: int | None = None,
    orderings: int = 3,
    patch: int | None = None,
    ig_steps: int = 16,
) -> dict[str, int]:
    """What `faithfulness` will cost, before it runs: forward passes of the curves and of the maps, and backward
    passes (each about twice a forward pass), for `images` images."""
    chosen, _ = applicable(model, methods)
    size = typing.cast(VisionTransformer, model).config.image_size
    grid = patch_grid(model, size, patch)
    steps = _check_steps(steps, grid)
    pixels = patch_pixels(model, patch)
    per_image = {
        "attention": 1,
        "rollout": 1,
        "occlusion": 1 + len(vi.occlusion_windows(size, pixels, pixels)),
        "integrated_gradients": ig_steps,
        "gradient_x_input": 1,
        "attention_x_gradient": 1,
    }
    backward = sum(per_image[m] for m in chosen if m in GRADIENT_METHODS)
    return {
        "curves": images * (len(chosen) + orderings) * 2 * (steps + 1),
        "maps": images * (1 + sum(per_image[m] for m in chosen)) + (1 if backward else 0),
        "backward": images * backward + (1 if backward else 0),
    }


def advantage(result: Faithfulness, method: str, curve: str) -> tuple[float, float]:
    """How much better than the random floor `method` ranks on `curve` ("deletion": random's AUC minus its own;
    "insertion": its own minus random's), averaged over the images, and the noise of that mean: the standard error
    over the images, or for one image the spread of the random orderings on it."""
    if method not in result.deletion or method == RANDOM:
        measured = ", ".join(result.methods) or "none"
        raise ValueError(f"method {method!r} was not measured in this result: it has {measured}.")
    sign = {"deletion": -1.0, "insertion": 1.0}[curve]
    ours, floor = getattr(result, curve)[method], getattr(result, curve)[RANDOM]
    gains = [sign * (a - r) for a, r in zip(ours, floor)]
    n, mean = len(gains), sum(gains) / len(gains)
    if n > 1:
        return mean, math.sqrt(sum((g - mean) ** 2 for g in gains) / (n - 1) / n)
    runs = [run[0] for run in getattr(result, f"random_{curve}")]  # one image: its random orderings' spread
    centre = sum(runs) / len(runs)
    return mean, math.sqrt(sum((v - centre) ** 2 for v in runs) / max(len(runs) - 1, 1))


def reading(result: Faithfulness, method: str) -> str:
    """One line on `method` from the numbers: whether it ranks the patches better than the random floor on each
    curve by more than twice the noise of `advantage`, with the AUCs and the baseline."""
    verdicts = []
    for curve in ("deletion", "insertion"):
        gain, noise = advantage(result, method, curve)
        verdicts.append("better" if gain > 2 * noise else "worse" if gain < -2 * noise else "level")
    d, i = result.mean(method, "deletion"), result.mean(method, "insertion")
    rd, ri = result.mean(RANDOM, "deletion"), result.mean(RANDOM, "insertion")
    numbers = f"deletion AUC {d:.3f} against {rd:.3f} random, insertion {i:.3f} against {ri:.3f}"
    words = {"better": "better than random", "level": "no better than random", "worse": "worse than random"}
    if verdicts[0] == verdicts[1]:
        summary = f"ranks patches {words[verdicts[0]]}"
    else:
        summary = f"ranks patches {words[verdicts[0]]} on deletion, {words[verdicts[1]]} on insertion"
    return f"{LABELS[method]} {summary} on this model ({numbers}; {result.baseline} baseline)"
