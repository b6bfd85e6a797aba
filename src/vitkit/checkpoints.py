"""vitkit's own checkpoint format (safetensors, config and class names in the metadata; no pickle), and the
entry points for every format: `load_checkpoint` (with `adapt`) and `export`, which dispatch to `vitkit.formats`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ViTConfig
from .model import VisionTransformer

FORMAT = "vitkit"


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call `write(tmp_path)` and move the result into place, so no half-written file is ever left at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(model: VisionTransformer, path: str | os.PathLike) -> None:
    """Write `model` to a vitkit safetensors file (atomically)."""
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict())}
    if model.class_names is not None:
        metadata["class_names"] = json.dumps(list(model.class_names))
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the metadata of a safetensors file; a clear error if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}). Is it truncated or of another format?") from e


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> VisionTransformer:
    """Read a file written by `vitkit.save` and return the model, in eval mode."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file.")
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise ValueError(
            f"{path}: a safetensors file without vitkit metadata. For timm or Hugging Face weights use "
            "vitkit.load_checkpoint(path)."
        )
    model = VisionTransformer(ViTConfig.from_dict(json.loads(metadata["config"])))
    model.load_state_dict(tensors, strict=True)
    if "class_names" in metadata:
        model.class_names = json.loads(metadata["class_names"])
    return model.to(map_location).eval()


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
    """Load a checkpoint of any supported format into a ready model, adapted to `image_size` / `num_classes`.

    Formats: "vitkit", "npz" (official ViT and big_vision), "timm", "hf" (a Hugging Face directory), "dinov2"
    (a Hugging Face Dinov2Model directory), "onnx" (a ViT backbone graph); "auto" tells them apart (see
    `vitkit.formats.detect_format`). `path` may also be a pretrained name (`vitkit pretrained` lists them).
    The config is inferred from the file. `overrides`
    set config fields the file does not record (e.g. `drop_path_rate` for fine-tuning, `num_heads` for timm).
    """
    from . import formats, pretrained  # both build on this module

    if not Path(path).exists() and pretrained.is_pretrained_name(str(path)):
        return pretrained.load_pretrained(str(path), image_size=image_size, num_classes=num_classes, **overrides)
    if format not in ("auto", *formats.FORMATS):
        raise ValueError(f"format={format!r} is unknown: use 'auto' or one of {', '.join(formats.FORMATS)}.")
    format = formats.detect_format(path) if format == "auto" else format
    if format != FORMAT:
        return adapt(formats.MODULES[format].load(path, image_size=image_size, **overrides), image_size, num_classes)
    model = load(path)
    if overrides:
        tuned = VisionTransformer(model.config.replace(**overrides))
        tuned.load_state_dict(model.state_dict(), strict=True)
        tuned.class_names = model.class_names
        model = tuned.eval()
    return adapt(model, image_size, num_classes)


def export(model: VisionTransformer, path: str | os.PathLike, format: str = FORMAT) -> None:
    """Write `model` in `format`: "vitkit" (a file), "hf" (a directory), "timm" (a safetensors state dict) or
    "npz" (the official layout). Class names travel in vitkit and timm metadata and in Hugging Face's id2label."""
    from . import formats

    if format == FORMAT:
        save(model, path)
    elif format in formats.MODULES:
        formats.MODULES[format].export(model, path)
    else:
        raise ValueError(f"format={format!r} is unknown: use one of {', '.join(formats.FORMATS)}.")
