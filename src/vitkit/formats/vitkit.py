"""vitkit's own format: a safetensors file of our state dict, with the config and class names in its metadata.

Nothing is inferred and nothing is pickled: the metadata says exactly which model the tensors belong to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from ..config import ViTConfig
from ..files import atomic_write, read_safetensors, safetensors_metadata
from ..model import VisionTransformer

NAME = "vitkit"


def detect(path: Path) -> bool:
    """A safetensors file whose metadata says it was written by vitkit."""
    if not path.is_file() or path.suffix.lower() != ".safetensors":
        return False
    return (safetensors_metadata(path) or {}).get("format") == NAME


def load(path: str | os.PathLike, image_size=None, **overrides) -> VisionTransformer:
    """The model written by `export`, in eval mode; `overrides` change config fields that hold no weights
    (e.g. `drop_path_rate`). `image_size` is recorded in the file: resampling is `checkpoints.adapt`'s job."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file.")
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != NAME or "config" not in metadata:
        raise ValueError(
            f"{path}: a safetensors file without vitkit metadata. For timm weights use "
            "vitkit.load_checkpoint(path, format='timm')."
        )
    config = ViTConfig.from_dict(json.loads(metadata["config"]))
    model = VisionTransformer(config.replace(**overrides) if overrides else config)
    model.load_state_dict(tensors, strict=True)
    if "class_names" in metadata:
        model.class_names = json.loads(metadata["class_names"])
    return model.eval()


def export(model: VisionTransformer, path: str | os.PathLike) -> None:
    """Write `model` to a vitkit safetensors file (atomically), config and class names in the metadata."""
    metadata = {"format": NAME, "config": json.dumps(model.config.to_dict())}
    if model.class_names is not None:
        metadata["class_names"] = json.dumps(list(model.class_names))
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
