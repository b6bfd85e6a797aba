"""Saliency maps per patch: which patches each attribution method says the prediction depends on.

Every method gives one map per image on the patch grid the curves of `attribution` rank, (B, gh, gw): the model's
token grid, or square patches of `patch` pixels for other models.

Methods (`METHODS`): last-layer [CLS] attention (heads averaged) and attention rollout (`vitkit.analysis`), occlusion
with patch-sized windows one patch apart (`analysis.occlusion_sensitivity`, its own mean-colour fill), integrated
gradients from the removal baseline and gradient x input (Captum, imported when used: `pip install captum`), and
attention x gradient (Chefer et al. 2021, "Generic Attention-model Explainability": per layer the heads' mean of
the positive part of grad(A) * A, accumulated as R <- R + A_bar R from R = I; the query's row of R). The attention
methods need a ViT's attention and are left out, with the reason, for other models (the BiT ResNet).
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.errors import did_you_mean
from vitkit.models.vit import VisionTransformer

from . import figures as vi

METHODS = (
    "attention",
    "rollout",
    "occlusion",
    "integrated_gradients",
    "gradient_x_input",
    "attention_x_gradient",
)
ATTENTION_METHODS = ("attention", "rollout", "attention_x_gradient")  # need a ViT's attention probabilities
GRADIENT_METHODS = ("integrated_gradients", "gradient_x_input", "attention_x_gradient")
CAPTUM_METHODS = ("integrated_gradients", "gradient_x_input")


# ----------------------------------------------------------------------------------------------------------
# Patches: the grid the maps are on.
# ----------------------------------------------------------------------------------------------------------


def patch_grid(model: nn.Module, image_size: tuple[int, int], patch: int | None = None) -> tuple[int, int]:
    """The (gh, gw) grid of patches: `patch` pixels square, or by default a ViT's own token grid."""
    if patch is None:
        if not isinstance(model, VisionTransformer):
            raise ValueError(
                f"a {type(model).__name__} has no patch grid of its own: pass patch=<pixels> (e.g. the patch size "
                "of the ViT it is compared with)."
            )
        return model.config.grid_size
    h, w = image_size
    if not 0 < patch <= min(h, w):
        raise ValueError(f"patch={patch}: need 0 < patch <= {min(h, w)}, the image's shorter side.")
    return (h // patch, w // patch)


def patch_index(grid: tuple[int, int], image_size: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(H, W): the row-major index of the patch each pixel belongs to (nearest, so a grid that does not divide the
    image evenly still covers every pixel)."""
    ids = torch.arange(grid[0] * grid[1], device=device, dtype=torch.float32).reshape(1, 1, *grid)
    return F.interpolate(ids, size=image_size, mode="nearest")[0, 0].long()


def patch_scores(maps: torch.Tensor, grid: tuple[int, int], image_size: tuple[int, int]) -> torch.Tensor:
    """Any maps (B, h, w) -> per-patch scores (B, gh, gw): already on the grid, kept; otherwise brought to the
    image's pixels (nearest) and summed over each patch."""
    if maps.ndim != 3:
        raise ValueError(f"expected maps of shape (B, H, W) or (B, gh, gw), got {tuple(maps.shape)}.")
    if tuple(maps.shape[-2:]) == tuple(grid):
        return maps.float()
    pixels = F.interpolate(maps[:, None].float(), size=image_size, mode="nearest")[:, 0]  # (B, H, W)
    index = patch_index(grid, image_size, maps.device).flatten()
    sums = torch.zeros(maps.shape[0], grid[0] * grid[1], device=maps.device)
    sums.index_add_(1, index, pixels.flatten(1))
    return sums.reshape(-1, *grid)


def patch_pixels(model: nn.Module, patch: int | None) -> int:
    """The side of a patch in pixels: `patch`, or by default a ViT's patch stride."""
    return patch if patch is not None else int(_vit(model).config.patch_stride[0])


def spatial_size(images: torch.Tensor) -> tuple[int, int]:
    """(H, W) of images (..., H, W)."""
    return int(images.shape[-2]), int(images.shape[-1])


def _vit(model: nn.Module) -> VisionTransformer:
    """`model` as the ViT the caller has checked it is (or whose config has what a ViT's has)."""
    return typing.cast(VisionTransformer, model)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode for the block, its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------------------
# The maps of each method, per patch: (B, gh, gw).
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Inputs:
    model: nn.Module
    images: torch.Tensor  # (B, C, H, W)
    targets: torch.Tensor  # (B,)
    baselines: torch.Tensor  # (B, C, H, W)
    grid: tuple[int, int]
    patch: int  # pixels
    ig_steps: int
    batch_size: int
    on_batch: Callable[[int], None] | None


def _parts(inp: _Inputs, size: int) -> list[_Inputs]:
    """`inp` cut into consecutive groups of at most `size` images: the maps of a group at a time bound the memory
    of the gradient methods."""
    return [
        dataclasses.replace(
            inp,
            images=inp.images[i : i + size],
            targets=inp.targets[i : i + size],
            baselines=inp.baselines[i : i + size],
        )
        for i in range(0, inp.images.shape[0], size)
    ]


def _to_grid(inp: _Inputs, maps: torch.Tensor) -> torch.Tensor:
    return patch_scores(maps, inp.grid, spatial_size(inp.images))


@torch.no_grad()
def _last_layer_attention(inp: _Inputs) -> torch.Tensor:
    model = _vit(inp.model)
    last = model.forward_intermediates(inp.images, attention=True)["attention"][-1]  # (B, heads, N, N)
    row, _ = vi._query_row(model, last.float().mean(dim=1))  # (B, P)
    return _to_grid(inp, row.reshape(-1, *model.config.grid_size))


def _rollout(inp: _Inputs) -> torch.Tensor:
    grids = [vi.attention_rollout(_vit(inp.model), image).grid for image in inp.images]
    return _to_grid(inp, torch.stack(grids).to(inp.images.device))


def _occlusion(inp: _Inputs) -> torch.Tensor:
    drops = [
        vi.occlusion_sensitivity(
            inp.model, image, target=int(t), patch=inp.patch, stride=inp.patch, on_batch=inp.on_batch
        ).drop
        for image, t in zip(inp.images, inp.targets)
    ]
    return _to_grid(inp, torch.stack(drops).to(inp.images.device))


def _captum(name: str):
    try:
        from captum import attr
    except ImportError as e:
        raise ImportError(
            f"method {name!r} uses Captum, which is not installed: pip install captum (or leave {name!r} out of "
            "methods=)."
        ) from e
    return attr


def _integrated_gradients(inp: _Inputs) -> torch.Tensor:
    ig = _captum("integrated_gradients").IntegratedGradients(inp.model)
    pixels = ig.attribute(
        inp.images,
        baselines=inp.baselines,
        target=inp.targets,
        n_steps=inp.ig_steps,
        internal_batch_size=inp.batch_size,
    )
    return _to_grid(inp, pixels.detach().sum(dim=1))  # signed: evidence for the class ranks first


def _gradient_x_input(inp: _Inputs) -> torch.Tensor:
    x = inp.images.detach().clone().requires_grad_(True)
    pixels = _captum("gradient_x_input").InputXGradient(inp.model).attribute(x, target=inp.targets)
    return _to_grid(inp, pixels.detach().sum(dim=1))


def _attention_x_gradient(inp: _Inputs) -> torch.Tensor:
    model = _vit(inp.model)
    x = inp.images.detach().clone().requires_grad_(True)  # the graph reaches the attention even with frozen weights
    with torch.enable_grad():
        out = model.forward_intermediates(x, attention=True)
        score = out["logits"].float().gather(1, inp.targets[:, None]).sum()
        grads = torch.autograd.grad(score, out["attention"])
    n = out["attention"][0].shape[-1]
    relevance = torch.eye(n, device=x.device).expand(x.shape[0], n, n)
    for a, g in zip(out["attention"], grads):
        a_bar = (g * a).detach().float().clamp(min=0).mean(dim=1)  # (B, N, N): heads averaged
        relevance = relevance + a_bar @ relevance
    row, _ = vi._query_row(model, relevance)
    return _to_grid(inp, row.reshape(-1, *model.config.grid_size))


MAP_FUNCTIONS: dict[str, Callable[[_Inputs], torch.Tensor]] = {
    "attention": _last_layer_attention,
    "rollout": _rollout,
    "occlusion": _occlusion,
    "integrated_gradients": _integrated_gradients,
    "gradient_x_input": _gradient_x_input,
    "attention_x_gradient": _attention_x_gradient,
}


def applicable(model: nn.Module, methods: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The `methods` that apply to `model`, and for the others why not. Unknown names are a ValueError."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}: choose from {', '.join(METHODS)}{did_you_mean(m, METHODS)}.")
    if isinstance(model, VisionTransformer):
        return list(methods), {}
    reason = f"a {type(model).__name__} has no attention layers to read"
    return [m for m in methods if m not in ATTENTION_METHODS], {m: reason for m in methods if m in ATTENTION_METHODS}


def _check_gradients(model: nn.Module, image: torch.Tensor) -> None:
    """Refuse a model that passes no gradient to its input, as an `optimize`d copy (packed kernels) does."""
    x = image[None].detach().clone().requires_grad_(True)
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the packed kernels' "no autograd kernel" warning: the error below says it
        logits = model(x).float()
        (grad,) = torch.autograd.grad(logits[0].max(), x, allow_unused=True)
    if grad is None:  # a zero gradient is a gradient: a fresh model's zero head gives one
        raise ValueError(
            "the model passes no gradient to its input (a copy made by vitkit.optimize computes without autograd): "
            "give the gradient methods the model as loaded, or leave them out of methods=."
        )


# ----------------------------------------------------------------------------------------------------------
# Every method's maps.
# ----------------------------------------------------------------------------------------------------------


def patch_maps(
    model: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    baselines: torch.Tensor,
    methods: Sequence[str],
    patch: int | None = None,
    ig_steps: int = 16,
    batch_size: int = 256,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Each of `methods`' patch map (B, gh, gw) of model input `images` (B, C, H, W) for the `targets` classes (B,):
    integrated gradients start from `baselines` (B, C, H, W) and take `ig_steps` points; `patch` as `patch_grid`.
    The maps are computed an eighth of `batch_size` images at a time; `on_batch(n)` after each batch of `n`
    occlusion passes. `methods` must apply to the model (`applicable`)."""
    grid = patch_grid(model, spatial_size(images), patch)
    inp = _Inputs(model, images, targets, baselines, grid, patch_pixels(model, patch), ig_steps, batch_size, on_batch)
    with evaluating(model):
        if any(m in GRADIENT_METHODS for m in methods):
            _check_gradients(model, images[0])
        parts = _parts(inp, max(batch_size // 8, 1))
        return {m: torch.cat([MAP_FUNCTIONS[m](part).float() for part in parts]) for m in methods}
