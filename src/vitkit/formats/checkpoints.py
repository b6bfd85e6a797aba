"""The facade over `vitkit.formats`: `load_checkpoint` reads any format (or a pretrained name, with
`load_pretrained`) into a ready model, adapted to a new task the way the paper fine-tunes (`adapt`), and `export`
writes one."""

from __future__ import annotations

import dataclasses
import os
import warnings
from functools import partial
from pathlib import Path

from vitkit import formats
from vitkit.errors import CheckpointError, spelled
from vitkit.files import refuse_overwrite
from vitkit.models.architectures import Model, new_model
from vitkit.models.config import ViTConfig, check_fields
from vitkit.models.vit import VisionTransformer

from . import pretrained


def check_finite(model: VisionTransformer, path: str | os.PathLike, allow_nonfinite: bool = False) -> None:
    """Name the tensors holding NaN or infinity: a CheckpointError, or with `allow_nonfinite` a warning."""
    bad = [(name, int((~t.isfinite()).sum())) for name, t in model.state_dict().items() if not t.isfinite().all()]
    if not bad:
        return
    names = ", ".join(f"{name} ({n:,} values)" for name, n in bad[:12])
    names += f", ... ({len(bad)} tensors in all)" if len(bad) > 12 else ""
    message = f"non-finite weights (NaN or infinity) in {names}: the model would predict NaN."
    if not allow_nonfinite:
        fix = spelled("allow_nonfinite=True", "--allow-nonfinite")
        raise CheckpointError(path, f"{message} Pass {fix} to load it anyway.", key=bad[0][0])
    warnings.warn(f"{path}: {message}", stacklevel=3)


def adapt(
    model: Model,
    image_size: int | tuple[int, int] | None = None,
    num_classes: int | None = None,
    keep_pre_logits: bool = False,
) -> Model:
    """Prepare a loaded model for a new task as the paper does: resample the posemb to `image_size` (bilinear,
    aligned corners) and, when `num_classes` differs, a new zero-initialised head (pre-logits dropped)."""
    if image_size is not None:
        model.set_image_size(image_size)
    if num_classes is not None and num_classes != model.config.num_classes:
        model.reset_head(num_classes, keep_pre_logits=keep_pre_logits)
    return model


# What `vitkit train` leaves in a run directory, beside metrics.jsonl: the final model, and the best evaluated so far.
RUN_MODELS = ("model.safetensors", "best.safetensors")


def run_model(path: Path) -> Path:
    """The model file of a `vitkit train` run directory: model.safetensors, else best.safetensors (a run that has
    not finished, with a warning); any other path as it is."""
    if not path.is_dir():
        return path
    final, best = (path / name for name in RUN_MODELS)
    if formats.FORMATS["vitkit"].detect(final):
        return final
    if formats.FORMATS["vitkit"].detect(best):
        warnings.warn(
            f"{path}: the run has not finished (no model.safetensors): loaded best.safetensors, its best "
            "evaluation so far.",
            stacklevel=3,
        )
        return best
    if (path / "metrics.jsonl").is_file() and (path / "config.json").is_file():
        raise CheckpointError(
            path,
            "a vitkit run that has saved no model yet (it stopped before its first evaluation): resume it with "
            f"`vitkit train --resume {path}`.",
        )
    return path


def load_checkpoint(
    path: str | os.PathLike,
    *,
    format: str = "auto",
    image_size: int | tuple[int, int] | None = None,
    num_classes: int | None = None,
    allow_nonfinite: bool = False,
    **overrides,
) -> Model:
    """Load a checkpoint of any supported format into a ready model (eval mode), adapted to `image_size` /
    `num_classes`.

    Formats: "vitkit", "npz" (official ViT and big_vision), "timm", "hf" (a Hugging Face directory), "dinov2"
    (a Hugging Face Dinov2Model directory), "onnx" (a ViT graph); "auto" tells them apart
    (`vitkit.formats.detect_format`). `path` may also be a pretrained name (`vitkit pretrained` lists them), or
    a `vitkit train` run directory (its model, `run_model`).
    The config is inferred from the file. `overrides` set config fields the file does not record (e.g.
    `drop_path_rate` for fine-tuning, `num_heads` for timm).
    A file that cannot be read as a model raises `vitkit.CheckpointError` naming the file and the key; so do
    NaN or infinite weights, unless `allow_nonfinite` (then a warning names them).
    """
    if not os.path.exists(path) and pretrained.is_pretrained_name(str(path)):
        return load_pretrained(
            str(path), image_size=image_size, num_classes=num_classes, allow_nonfinite=allow_nonfinite, **overrides
        )
    if format in ("auto", "vitkit"):
        path = run_model(Path(path))
    name = formats.detect_format(path) if format == "auto" else format
    reader = partial(formats.get_format(name).load, image_size=image_size, **overrides)
    check_fields(ViTConfig, overrides)
    try:
        model = reader(path)
    except (CheckpointError, FileNotFoundError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
        # Whatever a reader trips over in a malformed file is the file's fault: say so, with vitkit's error type.
        message = str(e).removeprefix(f"{path}: ") or type(e).__name__
        raise CheckpointError(path, message) from e
    check_finite(model, path, allow_nonfinite)
    names = model.class_names
    if names is not None and not (
        isinstance(names, list) and len(names) == model.config.num_classes and all(isinstance(n, str) for n in names)
    ):
        raise CheckpointError(path, f"class names must be {model.config.num_classes} strings.", key="class_names")
    return adapt(model, image_size, num_classes)


# ViTConfig fields the weights decide: a fine-tuning run's model_args may not ask for other values of them.
ARCHITECTURE_FIELDS = {
    "hidden_size",
    "num_layers",
    "mlp_dim",
    "num_heads",
    "patch_size",
    "classifier",
    "posemb",
    "in_chans",
    "hybrid",
    "representation_size",
    "qkv_bias",
    "layer_scale_init",
}


def load_for_finetuning(path: str, model_args: dict, image_size: int | None = None) -> Model:
    """The checkpoint to fine-tune at `image_size` (None: its own), with the `model_args` its file does not record
    (e.g. drop_path_rate); refused where `model_args` ask for another architecture than its weights have."""
    structural = {k: v for k, v in model_args.items() if k in ARCHITECTURE_FIELDS}
    others = {k: v for k, v in model_args.items() if k not in ARCHITECTURE_FIELDS}
    model = load_checkpoint(path, image_size=image_size, **others)
    # A checkpoint's patch dropout was its own training's (the main job's is 0.5): fine-tuning starts without it, as
    # the paper's fine-tuning has no dropout and timm's patch_drop_rate is an argument, not part of the weights.
    if getattr(model.config, "patch_dropout", 0.0) and "patch_dropout" not in others:
        model.config = model.config.replace(patch_dropout=0.0)
    # The checkpoint's weights decide its architecture; asking for another one is named field by field (the
    # same values as the checkpoint's are harmless). Compared after replace(), so that 16 and (16, 16) agree.
    asked = dataclasses.replace(model.config, **structural)
    differ = [
        f"{k} {getattr(model.config, k)!r} != {getattr(asked, k)!r}"
        for k in sorted(structural)
        if getattr(model.config, k) != getattr(asked, k)
    ]
    if differ:
        raise ValueError(
            f"checkpoint {path} is another architecture than model_args ask for: {', '.join(differ)} "
            "(checkpoint != asked). With a checkpoint give only overrides without weights (e.g. "
            "drop_path_rate), or leave --model-args out: the checkpoint's weights decide its architecture."
        )
    return model


def load_pretrained(
    name: str,
    *,
    image_size: int | tuple[int, int] | None = None,
    num_classes: int | None = None,
    download: bool = True,
    **overrides,
) -> Model:
    """The model of a pretrained name (`vitkit pretrained` lists them), fetched once into the cache (never, with
    `download=False`), adapted to `image_size` / `num_classes` as `load_checkpoint` does."""
    path, arguments = pretrained.fetch(name, download=download)
    with warnings.catch_warnings():  # a named entry is a backbone by its table's word: its left-out parts are no news
        warnings.filterwarnings("ignore", message=".*loaded the ViT backbone only")
        model = load_checkpoint(path, image_size=image_size, num_classes=num_classes, **{**arguments, **overrides})
    if model.normalization is None:  # what the file does not record, the table knows
        model.normalization = pretrained.lookup(name).normalization
    return model


def create_model(name: str, pretrained: str | None = None, **overrides) -> Model:
    """Build a variant by its paper name, e.g. `create_model("ViT-B/16", num_classes=10, image_size=384)` or the
    baseline `create_model("BiT-R26", num_classes=10, image_size=28)`; with `pretrained="imagenet21k"` (a tag of
    `vitkit pretrained`) its released weights, adapted to the overrides."""
    if pretrained is not None:
        return load_pretrained(f"{name}:{pretrained}", **overrides)
    return new_model(name, **overrides)


def export(model: Model, path: str | os.PathLike, format: str = "auto", *, overwrite: bool = False) -> None:
    """Write `model` in `format` (atomically): "vitkit" (a file), "hf" (a directory), "timm" (a safetensors
    state dict; a path without a suffix: timm's hub directory), "npz" (the official layout) or "onnx" (a graph for
    ONNX Runtime, OpenVINO and the like, dynamic in the batch, preprocessing in its metadata); "auto": the format
    the path's suffix names (.onnx, .npz), else "vitkit". Class names travel in vitkit, timm and ONNX metadata and
    in Hugging Face's id2label. A BiT ResNet baseline is written in vitkit's format only. An existing file or
    non-empty directory at `path` is a FileExistsError unless `overwrite`."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the model it compiles holds the weights
    if not isinstance(model, Model):  # an optimize() copy that another engine runs holds none of the model's
        raise ValueError(
            f"export() writes a model's weights, and {type(model).__name__} is not a vitkit model (a copy that "
            "vitkit.optimize made?): export the model it was made from."
        )
    if format == "auto":
        format = formats.export_format(path)
    if not isinstance(model, VisionTransformer) and format != "vitkit":
        raise ValueError(
            f"format={format!r} holds Vision Transformers only: export a {type(model).__name__} with format='vitkit'."
        )
    module = formats.get_format(format)
    path = Path(path)
    directory = format == "hf" or (format == "timm" and not path.suffix)  # the layouts that are a directory
    if directory and path.exists() and not path.is_dir():
        layout = "the Hugging Face format" if format == "hf" else "timm's hub layout (a path without a suffix)"
        raise FileExistsError(f"{path} is a file, and {layout} is a directory: give a new path.")
    if not directory and path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, and the {format} format is one file: give a file path.")
    refuse_overwrite(path, overwrite)
    module.export(model, path)
