"""vitkit's own format: a safetensors file of our state dict, with the config, class names, what the model was
trained on (`trained_on`, for `predict`'s notes) and, for a checkpoint normalised otherwise than the official
[-1, 1], its input normalization in its metadata.

Nothing is inferred and nothing is pickled: the metadata says exactly which model the tensors belong to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from vitkit.errors import CheckpointError
from vitkit.files import atomic_write, read_safetensors, safetensors_metadata
from vitkit.models.architectures import Model, config_from_dict, model_from_config
from vitkit.models.config import ViTConfig, config_difference

from .common import check_plausible, normalization

NAME = "vitkit"


def detect(path: Path) -> bool:
    """A safetensors file whose metadata says it was written by vitkit."""
    if not path.is_file() or path.suffix.lower() != ".safetensors":
        return False
    return (safetensors_metadata(path) or {}).get("format") == NAME


def load(path: str | os.PathLike, image_size=None, **overrides) -> Model:
    """The model written by `export`, in eval mode; `overrides` change config fields that hold no weights
    (e.g. `drop_path_rate`). `image_size` is recorded in the file: resampling is `checkpoints.adapt`'s job.

    The recorded config is checked against the tensors (names, shapes, dtypes) on the meta device, so a file
    that claims a huge model is refused before anything of that size is allocated."""
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != NAME or "config" not in metadata:
        raise CheckpointError(
            path,
            "a safetensors file without vitkit metadata. For timm weights use "
            "vitkit.load_checkpoint(path, format='timm').",
        )
    try:
        config = config_from_dict(json.loads(metadata["config"]))
        class_names = json.loads(metadata["class_names"]) if "class_names" in metadata else None
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(path, f"the recorded config or class names are invalid ({e}).", key="config") from e
    if isinstance(config, ViTConfig):
        check_plausible(config, tensors, path)
    with torch.device("meta"):
        expected = model_from_config(config).state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = [k for k in expected if k in tensors and tensors[k].shape != expected[k].shape]
    wrong += [k for k in expected if k in tensors and not tensors[k].is_floating_point()]
    if missing or unexpected or wrong:
        listed = [f"{k} {tuple(tensors[k].shape)} {tensors[k].dtype}" for k in wrong[:6]]
        raise CheckpointError(
            path,
            f"does not match its recorded config: missing {missing[:6]}, unexpected {unexpected[:6]}, "
            f"wrong shape or dtype {listed}.",
            key=(missing or unexpected or wrong)[0],
        )
    if overrides:
        tuned = config.replace(**overrides)
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in model_from_config(tuned).state_dict().items()}
        if shapes != {k: v.shape for k, v in expected.items()}:
            raise ValueError(
                f"{path}: the overrides change the architecture of the checkpoint "
                f"({config_difference(config, tuned)}, as saved != as asked): pass only fields without "  # type: ignore[arg-type]
                "weights (dropout, drop_path_rate, ...), or use adapt() for image_size and num_classes."
            )
        config = tuned
    model = model_from_config(config)
    model.load_state_dict(tensors, strict=True)
    model.class_names = class_names
    if "trained_on" in metadata:
        model.trained_on = json.loads(metadata["trained_on"])
    if "normalization" in metadata:
        try:
            norm = json.loads(metadata["normalization"])
            model.normalization = normalization(norm["mean"], norm["std"], config.in_chans, path, "normalization")
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(path, f"its recorded normalization is invalid ({e}).", "normalization") from e
    return model.eval()


def export(model: Model, path: str | os.PathLike) -> None:
    """Write `model` to a vitkit safetensors file (atomically), config and class names in the metadata."""
    metadata = {"format": NAME, "config": json.dumps(model.config.to_dict())}
    if model.class_names is not None:
        metadata["class_names"] = json.dumps(list(model.class_names))
    if model.trained_on:
        metadata["trained_on"] = json.dumps(model.trained_on)
    if getattr(model, "normalization", None):
        metadata["normalization"] = json.dumps(model.normalization)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
