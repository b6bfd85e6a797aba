"""The checkpoint formats of the ViT ecosystem, each a module with `load(path, image_size, **overrides)` and
`export(model, path)`: official / big_vision `.npz` (`npz`), timm state dicts (`timm`), Hugging Face
directories (`hf`), Hugging Face Dinov2Model directories (`dinov2`, load only), ONNX backbone graphs (`onnx`,
load only). vitkit's own format lives in `vitkit.checkpoints`, which dispatches here."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..checkpoints import FORMAT as VITKIT
from . import dinov2, hf, npz, onnx, timm

MODULES = {"npz": npz, "timm": timm, "hf": hf, "dinov2": dinov2, "onnx": onnx}
FORMATS = (VITKIT, *MODULES)


def detect_format(path: str | os.PathLike) -> str:
    """The format of a checkpoint from its kind and name: a directory is Hugging Face (`dinov2` if its config says
    so), `.npz` official or big_vision, a safetensors file vitkit's if its metadata says so (else timm), `.pth` /
    `.bin` timm, `.onnx` an ONNX graph."""
    path = Path(path)
    if path.is_dir():
        return "dinov2" if dinov2.detect(path) else "hf"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory.")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return "npz"
    if onnx.detect(path):
        return "onnx"
    if suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                return VITKIT if (f.metadata() or {}).get("format") == VITKIT else "timm"
        except (SafetensorError, OSError, ValueError):
            return "timm"  # unreadable: the timm reader reports it, naming the file
    if suffix in (".pth", ".pt", ".bin"):
        return "timm"
    raise ValueError(
        f"{path}: cannot tell the format from the suffix {suffix!r}; pass format= one of {', '.join(FORMATS)}."
    )
