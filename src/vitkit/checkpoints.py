"""The facade over `vitkit.formats`: `load_checkpoint` reads any format into a ready model, adapted to a new
task the way the paper fine-tunes (`adapt`), and `export` writes one."""

from __future__ import annotations

import os

from . import formats
from .model import VisionTransformer


def adapt(
    model: VisionTransformer,
    image_size: int | tuple[int, int] | None = None,
    num_classes: int | None = None,
    keep_pre_logits: bool = False,
) -> VisionTransformer:
    """Prepare a loaded model for a new task as the paper does: resample the posemb to `image_size` (bilinear,
    aligned corners) and, when `num_classes` differs, a new zero-initialised head (pre-logits dropped)."""
    if image_size is not None:
        model.set_image_size(image_size)
    if num_classes is not None and num_classes != model.config.num_classes:
        model.reset_head(num_classes, keep_pre_logits=keep_pre_logits)
    return model


def load_checkpoint(
    path: str | os.PathLike,
    *,
    format: str = "auto",
    image_size: int | tuple[int, int] | None = None,
    num_classes: int | None = None,
    **overrides,
) -> VisionTransformer:
    """Load a checkpoint of any supported format into a ready model (eval mode), adapted to `image_size` /
    `num_classes`.

    Formats: "vitkit", "npz" (official ViT and big_vision), "timm", "hf" (a Hugging Face directory); "auto"
    tells them apart (`vitkit.formats.detect_format`). The config is inferred from the file. `overrides`
    set config fields the file does not record (e.g. `drop_path_rate` for fine-tuning, `num_heads` for timm).
    """
    name = formats.detect_format(path) if format == "auto" else format
    model = formats.get_format(name).load(path, image_size=image_size, **overrides)
    return adapt(model, image_size, num_classes)


def export(model: VisionTransformer, path: str | os.PathLike, format: str = "vitkit") -> None:
    """Write `model` in `format` (atomically): "vitkit" (a file), "hf" (a directory), "timm" (a safetensors
    state dict) or "npz" (the official layout). Class names travel in vitkit and timm metadata and in Hugging
    Face's id2label."""
    formats.get_format(format).export(model, path)
