"""Preprocessing as in the official ViT input pipeline, applied to whole batches in the main process.

Training: inception crop (a random box of 5%-100% of the image area, aspect ratio 3/4-4/3, resized to the
model resolution) and a random horizontal flip; evaluation: the whole image resized to the model resolution.
Both then map pixels to [-1, 1]. Optional RandAugment (per image) and Mixup (per batch) from torchvision.

All randomness comes from `random_draws`, taken from a generator the caller seeds, so that a run is
reproducible and each sample of a global batch is augmented the same whatever the number of processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .datasets import to_input


@dataclass(frozen=True)
class AugmentConfig:
    """Training augmentation. `crop_scale` is the inception crop's area range (official: (0.05, 1.0)); (1, 1)
    with `crop_ratio` (1, 1) means no crop. `randaugment` is (number of ops, magnitude) or None; `mixup` is
    the Beta(alpha, alpha) parameter, 0 for none."""

    crop_scale: tuple[float, float] = (0.05, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    randaugment: tuple[int, int] | None = None
    mixup: float = 0.0

    def __post_init__(self) -> None:
        lo, hi = self.crop_scale
        if not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"crop_scale={self.crop_scale}: need 0 < low <= high <= 1 (fractions of the image area).")
        if not 0.0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio={self.crop_ratio}: need 0 < low <= high (width / height).")
        if self.mixup < 0:
            raise ValueError(f"mixup={self.mixup}: the Beta parameter alpha must be >= 0 (0 disables mixup).")


# Uniform draws per sample, taken for a whole global batch from one seeded generator, so that each image is
# augmented the same however the batch is split between processes and accumulation steps.
TRIES = 10  # inception-crop attempts, as torchvision's RandomResizedCrop
DRAWS = 2 * TRIES + 5  # per sample: areas, ratios, x offset, y offset, flip, RandAugment seed, Mixup seed


def random_draws(n: int, generator: torch.Generator) -> torch.Tensor:
    """(n, DRAWS) uniform [0, 1) numbers: all the randomness of augmenting n images."""
    return torch.rand(n, DRAWS, generator=generator, dtype=torch.float64)


def crop_boxes(
    height: int, width: int, draws: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float]
) -> torch.Tensor:
    """Inception-crop boxes (n, 4) as integer (x0, y0, x1, y1), x1 and y1 exclusive.

    Like `tf.image.sample_distorted_bounding_box` in the official pipeline: the area is uniform in `scale`
    times the image area, the aspect ratio log-uniform in `ratio`; of 10 tries the first that fits is used,
    and the whole image if none does.
    """
    area = height * width * (scale[0] + (scale[1] - scale[0]) * draws[:, :TRIES])
    log_ratio = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * draws[:, TRIES : 2 * TRIES]
    w = torch.sqrt(area * log_ratio.exp()).round().long()
    h = torch.sqrt(area / log_ratio.exp()).round().long()
    fits = (w >= 1) & (h >= 1) & (w <= width) & (h <= height)
    first = torch.where(fits.any(1), fits.float().argmax(1), -1)  # index of the first try that fits, or -1
    pick = first.clamp(min=0)[:, None]
    w = torch.where(first >= 0, w.gather(1, pick)[:, 0], width)
    h = torch.where(first >= 0, h.gather(1, pick)[:, 0], height)
    x0 = (draws[:, 2 * TRIES] * (width - w + 1)).floor().long()
    y0 = (draws[:, 2 * TRIES + 1] * (height - h + 1)).floor().long()
    return torch.stack([x0, y0, x0 + w, y0 + h], dim=1)


def crop_and_resize(images: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 (B, C, H, W) and boxes (B, 4) -> uint8 (B, C, *size): each box resized bilinearly, averaging
    several samples per output pixel when shrinking (so it does not alias)."""
    from torchvision.ops import roi_align  # imported here: torchvision adds seconds to every `vitkit` start

    rois = torch.cat([torch.arange(len(boxes))[:, None], boxes], dim=1).float()
    out = roi_align(images.float(), rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _as_batches(images: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """Group a list of images of possibly different sizes into batches of equal size (one when all agree)."""
    if isinstance(images, torch.Tensor):
        return [images]
    if all(im.shape == images[0].shape for im in images):
        return [torch.stack(images)]
    return [im[None] for im in images]


def _seed(draw: torch.Tensor) -> int:
    return int(draw * 2**53)


def train_batch(
    images: torch.Tensor | list[torch.Tensor],
    labels: torch.Tensor,
    draws: torch.Tensor,
    image_size: tuple[int, int],
    config: AugmentConfig,
    num_classes: int,
    in_chans: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (a batch, or a list of any sizes) and their `random_draws` -> (model input (B, C, *image_size)
    in [-1, 1], targets): the integer labels, or with mixup the mixed one-hot distributions (B, num_classes)."""
    crops, start = [], 0
    for part in _as_batches(images):
        d = draws[start : start + len(part)]
        height, width = part.shape[-2:]
        boxes = crop_boxes(height, width, d, config.crop_scale, config.crop_ratio)
        whole = (height, width) == tuple(image_size) and bool((boxes == boxes.new_tensor([0, 0, width, height])).all())
        crops.append(part if whole else crop_and_resize(part, boxes, image_size))  # no crop: resizing is the identity
        start += len(part)
    x = torch.cat(crops)  # (B, C, h, w) uint8
    if config.randaugment is not None:
        x = _randaugment(x, config.randaugment, draws[:, 2 * TRIES + 3])
    if config.flip:
        flip = draws[:, 2 * TRIES + 2] < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    x = to_input(x, in_chans=in_chans)
    if config.mixup > 0:
        return _mixup(x, labels, config.mixup, num_classes, _seed(draws[0, 2 * TRIES + 4]))
    return x, labels


def eval_batch(
    images: torch.Tensor | list[torch.Tensor],
    image_size: tuple[int, int],
    in_chans: int = 3,
    normalization: dict | None = None,
) -> torch.Tensor:
    """Official evaluation: resize the whole image to the model resolution, then to [-1, 1] (or with a
    checkpoint's own `normalization`, `data.to_input`)."""
    return torch.cat([to_input(p, image_size, in_chans, normalization) for p in _as_batches(images)])


def model_input(images: torch.Tensor | list[torch.Tensor], model) -> torch.Tensor:
    """`eval_batch` at the model's resolution and channels, normalised as the model's checkpoint says."""
    c = model.config
    return eval_batch(images, c.image_size, c.in_chans, getattr(model, "normalization", None))


def _randaugment(x: torch.Tensor, ops_magnitude: tuple[int, int], seeds: torch.Tensor) -> torch.Tensor:
    """torchvision's RandAugment on each image separately, its global-RNG draws seeded per image."""
    from torchvision.transforms import v2

    augment = v2.RandAugment(num_ops=ops_magnitude[0], magnitude=ops_magnitude[1])
    out = []
    with torch.random.fork_rng(devices=[]):
        for image, seed in zip(x, seeds):
            torch.manual_seed(_seed(seed))
            out.append(augment(image))
    return torch.stack(out)


def _mixup(
    x: torch.Tensor, labels: torch.Tensor, alpha: float, num_classes: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's MixUp: the batch mixed with itself rolled by one, weight ~ Beta(alpha, alpha)."""
    from torchvision.transforms import v2

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return v2.MixUp(alpha=alpha, num_classes=num_classes)(x, labels)
