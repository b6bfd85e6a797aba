"""Translation: whether a model's prediction stays when its image moves (invariance), and whether its feature map
moves with the image (equivariance).

The paper (Sec. 3.1) credits a CNN with translation equivariance "baked into each layer" and a ViT with much less
image-specific inductive bias: its patches are cut on a fixed grid and its position embeddings are absolute. An
ideal convolution is equivariant (shift the image, its feature map shifts); global average pooling then makes the
prediction invariant. Borders, padding and strides break both in practice, which is what these functions measure:

- `shift_images`: images moved by whole pixels, the uncovered pixels filled as `padding` says.
- `feature_map`: a model's last spatial features and their stride in pixels (a ViT's final tokens on the patch
  grid, a ResNet's last stage).
- `translation`: accuracy and agreement with the unshifted prediction at each shift, and the equivariance of the
  feature map at the shifts that are whole cells of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.data.augment import model_input
from vitkit.models.resnet import ResNetClassifier
from vitkit.models.vit import VisionTransformer

ZERO, CIRCULAR = "zero", "circular"
PADDINGS = (ZERO, CIRCULAR)
PADDING_NOTE = {
    ZERO: "the uncovered pixels are 0 (black, the background of Fashion-MNIST)",
    CIRCULAR: "the pixels pushed out on one side come back on the other (a circular shift)",
}
DIRECTIONS = ((0, 1), (0, -1), (1, 0), (-1, 0))  # (down, right) steps: right, left, down, up


def _moved(d: int, n: int) -> slice:
    """Where the content of an axis of length `n` lands when it moves by `d`."""
    return slice(max(d, 0), n + min(d, 0))


def _kept(d: int, n: int) -> slice:
    """Where the content that lands in `_moved(d, n)` came from."""
    return slice(max(-d, 0), n - max(d, 0))


def shift_images(images: torch.Tensor, dy: int, dx: int, padding: str = ZERO) -> torch.Tensor:
    """Images (..., H, W) moved `dy` pixels down and `dx` pixels right (negative: up, left); `padding` says what
    fills the uncovered pixels (`PADDING_NOTE`)."""
    if padding not in PADDINGS:
        raise ValueError(f"padding={padding!r}: choose one of {', '.join(PADDINGS)}.")
    if images.ndim < 2:
        raise ValueError(f"images of shape {tuple(images.shape)}: expected (..., H, W).")
    h, w = images.shape[-2:]
    if abs(dy) >= h or abs(dx) >= w:
        raise ValueError(f"a shift of ({dy}, {dx}) pixels moves a {h}x{w} image out of its frame: shift by less.")
    if padding == CIRCULAR:
        return images.roll((dy, dx), dims=(-2, -1))
    out = torch.zeros_like(images)
    out[..., _moved(dy, h), _moved(dx, w)] = images[..., _kept(dy, h), _kept(dx, w)]
    return out


@dataclass(frozen=True)
class FeatureMap:
    """A model's last spatial features (B, C, h, w), `stride` (sy, sx) pixels apart, and its `logits` (B, K)."""

    features: torch.Tensor
    stride: tuple[int, int]
    logits: torch.Tensor


def feature_map(model: nn.Module, x: torch.Tensor) -> FeatureMap | None:
    """A ViT's final tokens (after the encoder's LayerNorm, class token dropped) on the patch grid, stride the
    patch width in pixels; a ResNet's last stage, stride 4 x 2 per stage after the first; another model's
    `forward_features` (B, C, h, w), stride H / h. None for a model with no `forward_features` and `forward_head`."""
    if isinstance(model, VisionTransformer):
        out = model.forward_intermediates(x)
        gh, gw = model.config.grid_size
        patches = out["encoded"][:, -gh * gw :]  # (B, gh*gw, D), row-major: the class token comes first
        grid = patches.transpose(1, 2).unflatten(2, (gh, gw))  # (B, D, gh, gw)
        return FeatureMap(grid, model.config.patch_stride, out["logits"])
    forward_features, forward_head = getattr(model, "forward_features", None), getattr(model, "forward_head", None)
    if forward_features is None or forward_head is None:
        return None
    features = forward_features(x)
    if isinstance(model, ResNetClassifier):
        stride = (model.config.stem.stride,) * 2
    elif features.ndim == 4 and x.shape[-2] % features.shape[-2] == 0 and x.shape[-1] % features.shape[-1] == 0:
        stride = (x.shape[-2] // features.shape[-2], x.shape[-1] // features.shape[-1])
    else:
        raise ValueError(
            f"{type(model).__name__}.forward_features gave {tuple(features.shape)} for images {tuple(x.shape)}: "
            "translation needs a feature map (B, C, h, w) whose cells tile the image."
        )
    return FeatureMap(features, stride, forward_head(features))


def equivariance(original: torch.Tensor, shifted: torch.Tensor, dy: int, dx: int) -> float | None:
    """How closely `shifted`, the feature map (B, C, h, w) of the image moved by (dy, dx) cells, matches `original`
    moved by the same cells: the cosine similarity of their C-vectors, averaged over the positions both cover and
    the images (1.0: the features move exactly with the image). None where no position is covered by both."""
    if original.shape != shifted.shape or original.ndim != 4:
        raise ValueError(
            f"feature maps of shapes {tuple(original.shape)}, {tuple(shifted.shape)}: expected two equal (B, C, h, w)."
        )
    h, w = original.shape[-2:]
    if abs(dy) >= h or abs(dx) >= w:
        return None
    moved = shifted[..., _moved(dy, h), _moved(dx, w)]
    kept = original[..., _kept(dy, h), _kept(dx, w)]
    return float(F.cosine_similarity(moved.double(), kept.double(), dim=1).mean())


@dataclass(frozen=True)
class ShiftScore:
    """What one shift of `pixels` does, over the four directions (right, left, down, up) and all the images."""

    pixels: int
    accuracy: float  # top-1 of the shifted images
    agreement: float  # how often the prediction is the one for the unshifted image
    equivariance: float | None  # `equivariance` of the feature map; None unless `pixels` is a whole number of cells


@dataclass(frozen=True)
class Translation:
    """`translation`'s result: one `ShiftScore` per shift; `stride` the pixels between feature cells (None: no map)."""

    scores: tuple[ShiftScore, ...]
    padding: str
    stride: tuple[int, int] | None
    images: int


def _check(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, shifts: Sequence[int]) -> None:
    if images.dtype != torch.uint8 or images.ndim != 4 or not len(images):
        raise ValueError(
            f"images {images.dtype} {tuple(images.shape)}: expected uint8 pixels (B, C, H, W), at least one image; "
            "they are shifted before the model's normalisation, so that the padding is a pixel value."
        )
    config = getattr(model, "config", None)
    if not hasattr(config, "image_size"):
        raise ValueError(f"{type(model).__name__} has no `config.image_size`: translation needs a vitkit model.")
    size = tuple(config.image_size)  # type: ignore[union-attr]
    if tuple(images.shape[-2:]) != size:
        raise ValueError(
            f"images of {images.shape[-2]}x{images.shape[-1]} px, the model takes {size[0]}x{size[1]}: shifts are "
            "measured at the model's resolution, so resize the images to it first."
        )
    if labels.shape != images.shape[:1]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} for {len(images)} images: give one label per image.")
    if not shifts or any(s < 0 for s in shifts) or len(set(shifts)) != len(shifts):
        raise ValueError(f"shifts={tuple(shifts)}: give distinct shifts in pixels, each >= 0.")


def _offsets(shift: int) -> list[tuple[int, int]]:
    """The (down, right) pixel offsets of one shift: the four directions, or (0, 0)."""
    return [(shift * dy, shift * dx) for dy, dx in DIRECTIONS] if shift else [(0, 0)]


def _forward(model: nn.Module, images: torch.Tensor, device: torch.device) -> FeatureMap | torch.Tensor:
    """The feature map and logits of uint8 images, or only the logits of a model without a feature map."""
    x = model_input(images, model).to(device)
    out = feature_map(model, x)
    return model(x) if out is None else out


def _logits(out: FeatureMap | torch.Tensor) -> torch.Tensor:
    return out.logits if isinstance(out, FeatureMap) else out


def _cells(reference: FeatureMap | torch.Tensor, moved: FeatureMap | torch.Tensor, dy: int, dx: int) -> float | None:
    """`equivariance` for an offset of (dy, dx) pixels; None without a map or unless it is whole cells on both axes."""
    if not (isinstance(reference, FeatureMap) and isinstance(moved, FeatureMap)) or dy == dx == 0:
        return None
    sy, sx = reference.stride
    if dy % sy or dx % sx:
        return None
    return equivariance(reference.features, moved.features, dy // sy, dx // sx)


@torch.no_grad()
def translation(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    shifts: Sequence[int] = (0, 1, 2, 4, 8),
    padding: str = ZERO,
    batch_size: int = 500,
) -> Translation:
    """Each shift's accuracy, agreement with the unshifted prediction and feature-map equivariance (`ShiftScore`),
    for uint8 `images` (B, C, H, W) at the model's resolution moved right, left, down and up (`shift_images`).
    The model is a classifier with vitkit's `config` (`image_size`, `in_chans`); equivariance needs a feature map
    (`feature_map`)."""
    _check(model, images, labels, shifts)
    shift_images(images[:1], 0, 0, padding)  # the padding's name, checked before any forward pass
    parameter = next(model.parameters(), None)
    device = torch.device("cpu") if parameter is None else parameter.device
    offsets = [o for s in sorted({0, *shifts}) for o in _offsets(s)]
    predicted: dict[tuple[int, int], list[torch.Tensor]] = {o: [] for o in offsets}
    cosine: dict[tuple[int, int], list[float | None]] = {o: [] for o in offsets}  # per batch, times its size
    was_training, stride = model.training, None
    model.eval()
    for start in range(0, len(images), batch_size):
        batch = images[start : start + batch_size]
        reference = _forward(model, batch, device)
        stride = reference.stride if isinstance(reference, FeatureMap) else None
        for dy, dx in offsets:
            out = reference if dy == dx == 0 else _forward(model, shift_images(batch, dy, dx, padding), device)
            predicted[dy, dx].append(_logits(out).argmax(-1).cpu())
            score = _cells(reference, out, dy, dx)
            cosine[dy, dx].append(None if score is None else score * len(batch))
    model.train(was_training)
    unshifted, labels = torch.cat(predicted[0, 0]), labels.cpu()
    scores = []
    for s in shifts:
        k = len(_offsets(s))
        p = torch.cat([torch.cat(predicted[o]) for o in _offsets(s)])  # (k * B,): each direction's predictions
        sums = [c for o in _offsets(s) for c in cosine[o] if c is not None]
        complete = len(sums) == sum(len(cosine[o]) for o in _offsets(s))
        scores.append(
            ShiftScore(
                s,
                float((p == labels.repeat(k)).double().mean()),
                float((p == unshifted.repeat(k)).double().mean()),
                sum(sums) / (len(images) * k) if complete else None,
            )
        )
    return Translation(tuple(scores), padding, stride, len(images))
