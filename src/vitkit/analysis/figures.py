"""Seeing inside a ViT: the paper's analysis figures (Figs. 6, 7 and 14) as pure functions over a model.

Everything here reads the model's own weights or its named intermediates (`forward_intermediates`); no hooks.

- `embedding_filters`: principal components of the patch-embedding filters (Fig. 7 left).
- `posemb_similarity`: cosine similarity between the position embeddings of all patch pairs (Fig. 7 centre).
- `mean_attention_distance`: how far each head attends, per layer (Fig. 7 right).
- `attention_maps`, `attention_rollout`: where the class token looks (Figs. 6 and 14).
- `occlusion_sensitivity`: how much the prediction drops when a region is hidden (for a backbone without a
  head: how much its feature vector changes), an attribution to set beside the attention maps, which are not one.
- `localisation`: how often such a map points inside a known object box, against chance.

`vitkit.analysis.attribution` scores such maps by what they explain: deletion and insertion against random orderings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.models.vit import Learned2dPosemb, LearnedPosemb, SinCos2dPosemb, VisionTransformer

GAP_QUERY = "the mean over all query tokens (a gap model has no class token)"
CLS_QUERY = "the class token"


@dataclass(frozen=True)
class EmbeddingFilters:
    """Principal components of the patch-embedding filters, strongest first.

    `components` (k, C, ph, pw) are unit-norm directions in filter space; `variance` (k,) is the variance of
    the D filters along each, decreasing. `image_like` is False for a hybrid, whose embedding is a 1x1
    convolution over ResNet channels rather than over pixels, so its components cannot be shown as patches.
    """

    components: torch.Tensor
    variance: torch.Tensor
    image_like: bool
    note: str


@dataclass(frozen=True)
class AttentionMaps:
    """Per-layer, per-head attention to every patch, `maps` (layers, heads, gh, gw), from `query`."""

    maps: torch.Tensor
    query: str


@dataclass(frozen=True)
class Rollout:
    """Attention rollout: `joint` (N, N), row-stochastic, the attention of each token on each input token
    through all layers; `grid` (gh, gw) the part of it that `query` puts on the patches; `upsampled` (H, W)."""

    joint: torch.Tensor
    grid: torch.Tensor
    upsampled: torch.Tensor
    query: str


PROBABILITY = "probability"
FEATURES = "features"


@dataclass(frozen=True)
class Occlusion:
    """`drop` (H, W): mean fall of the `target` class probability over the occluded windows covering each pixel
    (positive: hiding that region hurts the prediction); `probability` is the unoccluded one.

    For a model without a head (`measure == FEATURES`) there is no class: `drop` is the mean fall of the cosine
    similarity of the occluded image's features to the unoccluded ones (1 - cos, from 0 to 2), `target` is None
    and `probability` is 1.0, the similarity of the features to themselves."""

    drop: torch.Tensor
    target: int | None
    probability: float
    measure: str = PROBABILITY


@dataclass(frozen=True)
class Localisation:
    """How well saliency maps find known objects: `hit_rate`, the fraction of maps whose maximum lies in the box,
    and `mass_inside`, the mean fraction of positive mass inside it; `chance` is the mean box-area fraction,
    what both would be for maps that ignore the object."""

    hit_rate: float
    mass_inside: float
    chance: float


def _as_batch(images: torch.Tensor) -> torch.Tensor:
    if images.ndim == 3:
        images = images.unsqueeze(0)
    if images.ndim != 4:
        raise ValueError(
            f"expected model input of shape (C, H, W) or (B, C, H, W), got {tuple(images.shape)}: "
            "prepare images with vitkit.data.datasets.to_input."
        )
    return images


def _num_prefix(model: VisionTransformer) -> int:
    return int(model.config.classifier == "token")


# ----------------------------------------------------------------------------------------------------------
# Fig. 7 left: the patch-embedding filters.
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def embedding_filters(model: VisionTransformer, k: int = 28) -> EmbeddingFilters:
    """The top-`k` principal components of the D patch-embedding filters (the rows of E), as in Fig. 7 left."""
    if k < 1:
        raise ValueError(f"k={k}: ask for at least one principal component.")
    weight = model.embedding.weight.detach().float().cpu()  # (D, C, ph, pw)
    d, shape = weight.shape[0], weight.shape[1:]
    flat = weight.reshape(d, -1)
    centred = flat - flat.mean(dim=0, keepdim=True)
    # Right singular vectors of the centred filters are the principal directions, by decreasing singular value.
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    k = min(k, vh.shape[0])
    variance = s[:k] ** 2 / max(d - 1, 1)
    components = vh[:k].reshape(k, *shape)
    if model.stem is not None:
        note = (
            f"hybrid model: E is a {shape[1]}x{shape[2]} convolution over {shape[0]} ResNet channels, "
            "not over pixels, so its components are not image patches."
        )
        return EmbeddingFilters(components, variance, False, note)
    note = f"top {k} of {min(flat.shape)} principal components of the {d} filters of size {tuple(shape)}"
    return EmbeddingFilters(components, variance, True, note)


# ----------------------------------------------------------------------------------------------------------
# Fig. 7 centre: position-embedding similarity.
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def posemb_similarity(model: VisionTransformer) -> torch.Tensor:
    """Cosine similarity of every patch's position embedding with every other's, (gh, gw, gh, gw).

    `sim[i, j]` is the (gh, gw) map of how similar the patch at row i, column j is to each patch.
    """
    posemb, (gh, gw) = model.posemb, model.config.grid_size
    if isinstance(posemb, LearnedPosemb):
        table = posemb.weight[0, posemb.num_prefix :]  # (gh*gw, D), the class token's row left out
    elif isinstance(posemb, Learned2dPosemb):
        table = posemb.embedding()
    elif isinstance(posemb, SinCos2dPosemb):
        table = posemb.table
    else:
        raise ValueError(
            f"posemb={model.config.posemb!r} adds no per-patch embedding to compare: the similarity figure exists "
            "for 'learn', 'learn2d' and 'sincos2d'."
        )
    unit = F.normalize(table.detach().float().cpu(), dim=-1)
    return (unit @ unit.T).reshape(gh, gw, gh, gw)


# ----------------------------------------------------------------------------------------------------------
# Fig. 7 right: mean attention distance.
# ----------------------------------------------------------------------------------------------------------


def patch_distances(grid: tuple[int, int], stride: tuple[int, int]) -> torch.Tensor:
    """Euclidean distance in pixels between the centres of every pair of patches, (gh*gw, gh*gw), row-major."""
    ys, xs = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    centres = torch.stack([ys.flatten() * stride[0], xs.flatten() * stride[1]], dim=-1).double()
    return torch.cdist(centres, centres)


@torch.no_grad()
def mean_attention_distance(model: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """For every layer and head, the attention-weighted distance in pixels between query and key patches,
    averaged over query patches and images: (layers, heads). The analogue of a CNN's receptive field size.

    Only patch-to-patch attention counts: the class token has no place in the image, so its row and column
    are dropped and each query's weights are renormalised over the patch keys.
    """
    images = _as_batch(images)
    was_training = model.training
    model.eval()
    attention = model.forward_intermediates(images, attention=True)["attention"]
    model.train(was_training)
    prefix = _num_prefix(model)
    dist = patch_distances(model.config.grid_size, model.config.patch_stride)  # (P, P)
    per_layer = []
    for probs in attention:  # (B, heads, N, N)
        patches = probs[..., prefix:, prefix:].double()
        patches = patches / patches.sum(dim=-1, keepdim=True)
        per_layer.append((patches * dist.to(patches.device)).sum(dim=-1).mean(dim=(0, 2)))  # (heads,)
    return torch.stack(per_layer).float().cpu()


# ----------------------------------------------------------------------------------------------------------
# Figs. 6 and 14: where the class token looks.
# ----------------------------------------------------------------------------------------------------------


def _attention(model: VisionTransformer, image: torch.Tensor) -> list[torch.Tensor]:
    image = _as_batch(image)
    if image.shape[0] != 1:
        raise ValueError(f"expected one image, got a batch of {image.shape[0]}: call once per image.")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        attention = model.forward_intermediates(image, attention=True)["attention"]
    model.train(was_training)
    return [a[0].float().cpu() for a in attention]  # each (heads, N, N)


def _query_row(model: VisionTransformer, matrix: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The class token's row of an (..., N, N) attention matrix, or for a gap model the mean of all rows."""
    if _num_prefix(model):
        return matrix[..., 0, 1:], CLS_QUERY
    return matrix.mean(dim=-2), GAP_QUERY


def attention_maps(model: VisionTransformer, image: torch.Tensor) -> AttentionMaps:
    """Class-token attention to every patch, per layer and head: (layers, heads, gh, gw)."""
    rows, query = _query_row(model, torch.stack(_attention(model, image)))  # (layers, heads, P)
    return AttentionMaps(rows.reshape(*rows.shape[:2], *model.config.grid_size), query)


def attention_rollout(model: VisionTransformer, image: torch.Tensor) -> Rollout:
    """Residual-aware attention rollout (Abnar & Zuidema, 2020), as the paper's Appendix D.8 describes it.

    Heads are averaged; the identity is added for the residual connection, `0.5 * A + 0.5 * I`, rows are
    renormalised; the layers' matrices are multiplied from the first to the last. The query's row is laid on
    the patch grid and upsampled (bilinear) to the image.
    """
    joint = None
    for probs in _attention(model, image):
        a = probs.double().mean(dim=0)  # (N, N)
        a = 0.5 * a + 0.5 * torch.eye(a.shape[0], dtype=a.dtype)
        a = a / a.sum(dim=-1, keepdim=True)
        joint = a if joint is None else a @ joint
    if joint is None:
        raise ValueError("the model has no encoder layers, so there is no attention to roll out.")
    row, query = _query_row(model, joint)
    grid = row.reshape(model.config.grid_size).float()
    upsampled = F.interpolate(grid[None, None], size=model.config.image_size, mode="bilinear", align_corners=False)
    return Rollout(joint.float(), grid, upsampled[0, 0], query)


# ----------------------------------------------------------------------------------------------------------
# An attribution beside them: occlusion.
# ----------------------------------------------------------------------------------------------------------


def occlusion_windows(image_size: tuple[int, int], patch: int, stride: int) -> list[tuple[int, int]]:
    """The (top, left) corners of the occluding windows: one forward pass each. They start on a regular grid
    `stride` apart, plus a last one flush with the far edge so every pixel is covered: about
    (H / stride) x (W / stride) windows, so doubling the stride quarters the work."""
    h, w = image_size
    if not 0 < patch <= min(h, w) or stride < 1:
        raise ValueError(f"patch={patch}, stride={stride}: need 0 < patch <= {min(h, w)} and stride >= 1.")
    if stride > patch:  # gaps between the windows: pixels no window covers would get 0 / 0
        raise ValueError(
            f"stride={stride} is wider than the {patch} px window, leaving pixels no window covers: "
            f"use a stride of at most {patch}."
        )
    tops = sorted(set(range(0, h - patch + 1, stride)) | {h - patch})
    lefts = sorted(set(range(0, w - patch + 1, stride)) | {w - patch})
    return [(t, left) for t in tops for left in lefts]


@torch.no_grad()
def occlusion_sensitivity(
    model: nn.Module,
    image: torch.Tensor,
    target: int | None = None,
    patch: int | None = None,
    stride: int | None = None,
    fill: float | None = None,
    batch_size: int = 64,
    on_batch: Callable[[int], None] | None = None,
) -> Occlusion:
    """Fall of the `target` probability (default: the predicted class) when each region is masked.

    A `patch` x `patch` window (default: the model's patch stride in pixels) slides by `stride` (default:
    half the window) and is set to `fill`, by default the image's mean colour (a constant grey would itself be
    a conspicuous object on a coloured image); each pixel gets the mean drop over the windows covering it.
    Works for any classifier; give `patch` when it has no `config`. One forward pass per window (see
    `occlusion_windows`), `batch_size` at a time; `on_batch(n)` is called after each batch of `n` windows.

    A model without a head (`num_classes=0`: `head` is `nn.Identity`, as a loaded backbone has) returns features,
    whose softmax would be no class probability: for it the drop is that of the cosine similarity of the
    occluded features to the unoccluded ones (see `Occlusion`), and `target` must be left out.
    """
    image = _as_batch(image)
    if image.shape[0] != 1:
        raise ValueError(f"expected one image, got a batch of {image.shape[0]}: call once per image.")
    if patch is None:
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("the model has no config to take a patch size from: pass patch=<pixels>.")
        patch = int(config.patch_stride[0])
    stride = stride or max(patch // 2, 1)
    h, w = image.shape[-2:]
    windows = occlusion_windows((h, w), patch, stride)
    colour = image.mean(dim=(-2, -1))[0, :, None, None] if fill is None else fill  # (C, 1, 1) or a scalar
    was_training = model.training
    model.eval()
    try:
        score, target, unoccluded = _occlusion_score(model, model(image), target)
        drops = []
        for start in range(0, len(windows), batch_size):
            chunk = windows[start : start + batch_size]
            occluded = image.repeat(len(chunk), 1, 1, 1)
            for i, (t, left) in enumerate(chunk):
                occluded[i, :, t : t + patch, left : left + patch] = colour
            drops.append(unoccluded - score(model(occluded)))
            if on_batch is not None:
                on_batch(len(chunk))
    finally:
        model.train(was_training)
    total, count = torch.zeros(h, w), torch.zeros(h, w)
    for (t, left), drop in zip(windows, torch.cat(drops).float().cpu()):
        total[t : t + patch, left : left + patch] += drop
        count[t : t + patch, left : left + patch] += 1
    return Occlusion(total / count, target, float(unoccluded), PROBABILITY if target is not None else FEATURES)


def _occlusion_score(
    model: nn.Module, reference: torch.Tensor, target: int | None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], int | None, float | torch.Tensor]:
    """What occlusion measures on each occluded image's output, the class it targets (None without a head), and
    its value on the unoccluded image, whose output is `reference` (1, classes or features)."""
    if has_no_head(model):
        if target is not None:
            raise ValueError(
                f"target={target}: the model has no head (num_classes=0), so no classes to target; leave target "
                "out and the occlusion map measures the change of its features."
            )
        features = reference.float()
        return lambda out: F.cosine_similarity(out.float(), features, dim=-1), None, 1.0  # 1.0: unoccluded
    probs = reference.softmax(dim=-1)[0]
    target = int(probs.argmax()) if target is None else target
    if not 0 <= target < probs.shape[0]:
        raise ValueError(f"target={target} is not a class of this model: use 0..{probs.shape[0] - 1}.")
    return lambda out: out.softmax(dim=-1)[:, target], target, probs[target]


def has_no_head(model: nn.Module) -> bool:
    """Whether `model(x)` returns features rather than logits: a ViT with `num_classes=0`, whose head is
    `nn.Identity` (a backbone loaded from DINOv2 or ONNX, or `reset_head(0)`)."""
    return isinstance(getattr(model, "head", None), nn.Identity)


# ----------------------------------------------------------------------------------------------------------
# Do the maps find the object?
# ----------------------------------------------------------------------------------------------------------


def localisation(maps: torch.Tensor, boxes: list[tuple[int, int, int, int]]) -> Localisation:
    """Compare saliency maps (B, H, W) with object boxes (x0, y0, x1, y1), x1 and y1 exclusive."""
    if maps.ndim != 3 or maps.shape[0] != len(boxes):
        raise ValueError(f"expected maps (B, H, W) and B boxes, got maps {tuple(maps.shape)} and {len(boxes)} boxes.")
    h, w = maps.shape[-2:]
    hits, masses, areas = [], [], []
    for saliency, (x0, y0, x1, y1) in zip(maps.float(), boxes):
        inside = torch.zeros(h, w, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        hits.append(float(inside.flatten()[saliency.argmax()]))
        positive = saliency.clamp(min=0)
        masses.append(float(positive[inside].sum() / positive.sum().clamp(min=1e-12)))
        areas.append(float(inside.float().mean()))
    n = len(boxes)
    return Localisation(sum(hits) / n, sum(masses) / n, sum(areas) / n)
