"""vitkit's own checkpoint format (safetensors, config and class names in the metadata; no pickle), and the
entry points for every format: `load_checkpoint` (with `adapt`) and `export`, which dispatch to `vitkit.formats`."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ViTConfig, config_difference, field_names
from .errors import CheckpointError
from .model import VisionTransformer

FORMAT = "vitkit"


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call `write(tmp_path)` and move the result into place, so no half-written file is ever left at `path`.

    The temporary file sits in the same directory (so the rename is atomic), is fsync'ed before the rename, and
    the directory is fsync'ed after it: after a crash or power loss `path` holds the old file or the new one.
    If writing fails (a full disk, say) the temporary file is removed and the previous `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it the usual permissions
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
            raise OSError(e.errno, f"{path}: writing failed ({e.strerror or e}); {kept}") from e
        raise
    _fsync(path.parent)


def _fsync(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; the rename is still atomic there
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


def save(model: VisionTransformer, path: str | os.PathLike) -> None:
    """Write `model` to a vitkit safetensors file (atomically)."""
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict())}
    if model.class_names is not None:
        metadata["class_names"] = json.dumps(list(model.class_names))
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the metadata of a safetensors file; a CheckpointError if it is not a sound one (the
    safetensors reader checks the header against the file's size before reading any tensor)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file.")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # SafetensorError, or torch refusing a dtype: every failure to parse is a refusal
        raise CheckpointError(
            path, f"not a readable safetensors file ({type(e).__name__}: {str(e)[:300]}). "
            "Is it truncated or of another format?",
        ) from e  # fmt: skip


def check_plausible(config: ViTConfig, tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Refuse a recorded config that claims far more than the file holds, before any model is built from it.

    The bound is a lower one on the parameters (qkv, proj, MLP per layer; a learned posemb), so a real file
    always passes, and a file of a few bytes cannot make vitkit allocate a model of billions of parameters."""
    held = sum(t.numel() for t in tensors.values())
    d, layers, mlp = config.hidden_size, config.num_layers, config.mlp_dim
    claimed = layers * (4 * d * d + 2 * d * mlp) + (config.num_patches * d if config.posemb.startswith("learn") else 0)
    if claimed > held:
        raise CheckpointError(
            path, f"the config claims at least {claimed:,} weights (num_layers={layers}, hidden_size={d}, "
            f"mlp_dim={mlp}, image_size={config.image_size}); the file holds {held:,} values.",
        )  # fmt: skip
    if config.num_tokens * d > max(held, 2**26):
        raise CheckpointError(path, f"image_size={config.image_size} gives {config.num_tokens:,} tokens: refused.")


def check_finite(model: VisionTransformer, path: str | os.PathLike, allow_nonfinite: bool = False) -> None:
    """Name the tensors holding NaN or infinity: a CheckpointError, or with `allow_nonfinite` a warning."""
    bad = [(name, int((~t.isfinite()).sum())) for name, t in model.state_dict().items() if not t.isfinite().all()]
    if not bad:
        return
    names = ", ".join(f"{name} ({n:,} values)" for name, n in bad[:12])
    names += f", ... ({len(bad)} tensors in all)" if len(bad) > 12 else ""
    message = f"non-finite weights (NaN or infinity) in {names}: the model would predict NaN."
    if not allow_nonfinite:
        raise CheckpointError(path, message + " Pass allow_nonfinite=True (--allow-nonfinite) to load it anyway.",
                              key=bad[0][0])  # fmt: skip
    warnings.warn(f"{path}: {message}", stacklevel=3)


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> VisionTransformer:
    """Read a file written by `vitkit.save` and return the model, in eval mode."""
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise CheckpointError(
            path, "a safetensors file without vitkit metadata. For timm or Hugging Face weights use "
            "vitkit.load_checkpoint(path).",
        )  # fmt: skip
    try:
        recorded = json.loads(metadata["config"])
        config = ViTConfig.from_dict(recorded)
        class_names = json.loads(metadata["class_names"]) if "class_names" in metadata else None
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(path, f"the recorded config or class names are invalid ({e}).", key="config") from e
    check_plausible(config, tensors, path)
    with torch.device("meta"):
        expected = VisionTransformer(config).state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = [k for k in expected if k in tensors and tensors[k].shape != expected[k].shape]
    wrong += [k for k in expected if k in tensors and not tensors[k].is_floating_point()]
    if missing or unexpected or wrong:
        first = (missing or unexpected or wrong)[0]
        detail = tensors[first].dtype if first in wrong and not tensors[first].is_floating_point() else ""
        raise CheckpointError(
            path, f"does not match its recorded config: missing {missing[:6]}, unexpected {unexpected[:6]}, "
            f"wrong shape or dtype {[f'{k} {tuple(tensors[k].shape)} {tensors[k].dtype}' for k in wrong[:6]]} {detail}",
            key=first,
        )  # fmt: skip
    if class_names is not None and (
        not isinstance(class_names, list) or len(class_names) != config.num_classes
        or not all(isinstance(n, str) for n in class_names)
    ):  # fmt: skip
        raise CheckpointError(path, f"class_names must be {config.num_classes} strings.", key="class_names")
    model = VisionTransformer(config)
    model.load_state_dict(tensors, strict=True)
    model.class_names = class_names
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
    allow_nonfinite: bool = False,
    **overrides,
) -> VisionTransformer:
    """Load a checkpoint of any supported format into a ready model, adapted to `image_size` / `num_classes`.

    Formats: "vitkit", "npz" (official ViT and big_vision), "timm", "hf" (a Hugging Face directory); "auto"
    tells them apart (see `vitkit.formats.detect_format`). The config is inferred from the file. `overrides`
    set config fields the file does not record (e.g. `drop_path_rate` for fine-tuning, `num_heads` for timm).
    A file that cannot be read as a model raises `vitkit.CheckpointError` naming the file and the key; so do
    NaN or infinite weights, unless `allow_nonfinite` (then a warning names them).
    """
    from . import formats  # the foreign formats build on this module's file helpers

    if format not in ("auto", *formats.FORMATS):
        raise ValueError(f"format={format!r} is unknown: use 'auto' or one of {', '.join(formats.FORMATS)}.")
    format = formats.detect_format(path) if format == "auto" else format
    unknown = sorted(set(overrides) - set(field_names()))
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}; valid ViTConfig fields: {field_names()}.")
    reader = load if format == FORMAT else partial(formats.MODULES[format].load, image_size=image_size, **overrides)
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
    if format != FORMAT:
        return adapt(model, image_size, num_classes)
    if overrides:
        config = model.config.replace(**overrides)
        with torch.device("meta"):
            wanted = {k: v.shape for k, v in VisionTransformer(config).state_dict().items()}
        if wanted != {k: v.shape for k, v in model.state_dict().items()}:
            raise ValueError(
                f"{path}: the overrides change the architecture of the checkpoint "
                f"({config_difference(model.config, config)}, as saved != as asked): pass only fields "
                "without weights (dropout, drop_path_rate, ...), or use adapt() for image_size and num_classes."
            )
        tuned = VisionTransformer(config)
        tuned.load_state_dict(model.state_dict(), strict=True)
        tuned.class_names = model.class_names
        model = tuned.eval()
    return adapt(model, image_size, num_classes)


def export(model: VisionTransformer, path: str | os.PathLike, format: str = FORMAT) -> None:
    """Write `model` in `format`: "vitkit" (a file), "hf" (a directory), "timm" (a safetensors state dict) or
    "npz" (the official layout). Class names travel in vitkit and timm metadata and in Hugging Face's id2label."""
    from . import formats

    path = Path(path)
    if format == "hf" and path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, and the Hugging Face format is a directory: give a new path.")
    if format != "hf" and path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, and the {format} format is one file: give a file path.")
    if format == FORMAT:
        save(model, path)
    elif format in formats.MODULES:
        formats.MODULES[format].export(model, path)
    else:
        raise ValueError(f"format={format!r} is unknown: use one of {', '.join(formats.FORMATS)}.")
