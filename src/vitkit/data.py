"""Datasets. Every sample is `(image, label)` with the image a uint8 tensor (C, H, W)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond")


class ShapesDataset(Dataset):
    """Synthetic, deterministic: one coloured shape on a textured background, with its bounding box.

    Always available (nothing to download), any resolution; sample `i` of a split is the same on every
    machine. `box(i)` gives the object's (x0, y0, x1, y1) in pixels, exclusive of x1, y1, for checking
    where a model looks.
    """

    classes = list(SHAPES)

    def __init__(self, size: int = 2000, image_size: int = 64, split: str = "train", seed: int = 0):
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r} is unknown: use 'train' or 'test'.")
        if image_size < 16:
            raise ValueError(f"image_size={image_size} is too small to draw shapes on: use 16 or more.")
        self.size, self.image_size = size, image_size
        self.seed = seed * 2 + (split == "test")

    def __len__(self) -> int:
        return self.size

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, index])

    def _layout(self, index: int) -> tuple[np.random.Generator, int, tuple[int, int, int, int]]:
        rng = self._rng(index)
        label = int(rng.integers(len(SHAPES)))
        s = self.image_size
        side = int(rng.integers(int(0.3 * s), int(0.5 * s) + 1))
        x0, y0 = (int(v) for v in rng.integers(0, s - side + 1, size=2))
        return rng, label, (x0, y0, x0 + side, y0 + side)

    def box(self, index: int) -> tuple[int, int, int, int]:
        return self._layout(index)[2]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        rng, label, (x0, y0, x1, y1) = self._layout(index)
        s = self.image_size
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float32)
        # Background: two random colours mixed by oriented stripes and noise, so that texture is not a cue.
        c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        angle, freq = rng.uniform(0, math.pi), rng.uniform(0.1, 0.5)
        stripes = 0.5 + 0.5 * np.sin(freq * (xx * math.cos(angle) + yy * math.sin(angle)))
        mix = np.clip(stripes + rng.normal(0, 0.15, (s, s)), 0, 1)[..., None]
        image = c0 * (1 - mix) + c1 * mix
        # Foreground: the shape, in a colour far from the background's mean.
        mask = _shape_mask(SHAPES[label], xx, yy, (x0, y0, x1, y1))
        colour = 255 - image.mean(axis=(0, 1)) + rng.uniform(-30, 30, 3)
        image[mask] = np.clip(colour, 0, 255)
        return torch.from_numpy(image.round().astype(np.uint8)).permute(2, 0, 1).contiguous(), label


def _shape_mask(shape: str, xx: np.ndarray, yy: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    x0, y0, x1, y1 = box
    cx, cy, r = (x0 + x1 - 1) / 2, (y0 + y1 - 1) / 2, (x1 - x0) / 2
    dx, dy = (xx - cx) / r, (yy - cy) / r  # in [-1, 1] inside the box
    if shape == "circle":
        return dx**2 + dy**2 <= 1
    if shape == "square":
        return (abs(dx) <= 0.9) & (abs(dy) <= 0.9)
    if shape == "triangle":
        return (dy <= 1) & (dy >= -1) & (abs(dx) <= (dy + 1) / 2)
    if shape == "cross":
        return ((abs(dx) <= 0.3) & (abs(dy) <= 1)) | ((abs(dy) <= 0.3) & (abs(dx) <= 1))
    if shape == "ring":
        return (dx**2 + dy**2 <= 1) & (dx**2 + dy**2 >= 0.4)
    return abs(dx) + abs(dy) <= 1  # diamond


def to_input(images: torch.Tensor, image_size: int | tuple[int, int] | None = None, in_chans: int = 3) -> torch.Tensor:
    """uint8 images (B, C, H, W) or (C, H, W) -> float model input in [-1, 1], as the official code feeds it.

    Grayscale is replicated to `in_chans` channels; with `image_size` the images are resized to it (bilinear,
    the official evaluation transform).
    """
    if images.dtype != torch.uint8:
        raise ValueError(f"expected uint8 images with values 0..255, got {images.dtype}.")
    x = images.unsqueeze(0) if images.ndim == 3 else images
    if x.ndim != 4:
        raise ValueError(f"expected images of shape (B, C, H, W) or (C, H, W), got {tuple(images.shape)}.")
    if x.shape[1] == 1 and in_chans != 1:
        x = x.expand(-1, in_chans, -1, -1)
    x = x.float() / 127.5 - 1.0
    if image_size is not None:
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if tuple(x.shape[-2:]) != size:
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return x


DATASETS = {"shapes": ShapesDataset}


def get_dataset(name: str, split: str = "train", **kwargs) -> Dataset:
    """A named dataset's split; samples are (uint8 image (C, H, W), label) and `.classes` names the labels."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(sorted(DATASETS))}.")
    return DATASETS[name](split=split, **kwargs)
