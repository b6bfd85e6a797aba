"""The facade over `vitkit.formats`: `load_checkpoint` reads any format (or a pretrained name, with
`load_pretrained`) into a ready model, adapted to a new task the way the paper fine-tunes (`adapt`), and `export`
writes one."""

from __future__ import annotations

import os

from . import formats, pretrained
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

    Formats: "vitkit", "npz" (official ViT and big_vision), "timm", "hf" (a Hugging Face directory), "dinov2"
    (a Hugging Face Dinov2Model directory), "onnx" (a ViT backbone graph); "auto" tells them apart
    (`vitkit.formats.detect_format`). `path` may also be a pretrained name (`vitkit pretrained` lists them).
    The config is inferred from the file. `overrides` set config fields the file does not record (e.g.
    `drop_path_rate` for fine-tuning, `num_heads` for timm).
    """
    if not os.path.exists(path) and pretrained.is_pretrained_name(str(path)):
        return load_pretrained(str(path), image_size=image_size, num_classes=num_classes, **overrides)
    name = formats.detect_format(path) if format == "auto" else format
    model = formats.get_format(name).load(path, image_size=image_size, **overrides)
    return adapt(model, image_size, num_classes)


def load_pretrained(
    name: str,
    *,
    image_size: int | tuple[int, int] | None = None,
    num_classes: int | None = None,
    download: bool = True,
    **overrides,
) -> VisionTransformer:
    """The model of a pretrained name (`vitkit pretrained` lists them), fetched once into the cache (never, with
    `download=False`), adapted to `image_size` / `num_classes` as `load_checkpoint` does."""
    path, arguments = pretrained.fetch(name, download=download)
    return load_checkpoint(path, image_size=image_size, num_classes=num_classes, **{**arguments, **overrides})


def export(model: VisionTransformer, path: str | os.PathLike, format: str = "vitkit") -> None:
    """Write `model` in `format` (atomically): "vitkit" (a file), "hf" (a directory), "timm" (a safetensors
    state dict) or "npz" (the official layout). Class names travel in vitkit and timm metadata and in Hugging
    Face's id2label."""
    formats.get_format(format).export(model, path)
