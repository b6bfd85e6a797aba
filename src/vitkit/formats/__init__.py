"""The checkpoint formats of the ViT ecosystem as one registry.

Every format is a module with the same interface: `NAME`; `detect(path) -> bool`, which recognises its files
from their kind, name and headers; `load(path, image_size=None, **overrides) -> VisionTransformer`; and
`export(model, path)`. They are vitkit's own safetensors files (`vitkit`), official and big_vision `.npz`
(`npz`), Hugging Face directories (`hf`), timm state dicts (`timm`), ONNX graphs (`onnx`: vitkit writes them for
ONNX runtimes and reads back its own, and other ViT graphs by their structure), and one load-only format: Hugging
Face Dinov2Model directories (`dinov2`). `onnx_graph` and `onnx_parse` are not formats: they read the tensors of
an ONNX file and follow a foreign ViT graph for `onnx`. `vitkit.formats.checkpoints` is the facade.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from types import ModuleType

from vitkit.errors import running_command

from . import dinov2, hf, npz, onnx, timm, vitkit

# In the order `detect_format` asks them: vitkit before timm, since both are safetensors files.
FORMATS: dict[str, ModuleType] = {m.NAME: m for m in (vitkit, npz, hf, dinov2, timm, onnx)}
# The formats vitkit writes: all but those whose module sets `WRITES = False` (read-only: their `export` refuses).
WRITABLE: tuple[str, ...] = tuple(name for name, module in FORMATS.items() if getattr(module, "WRITES", True))


def get_format(name: str) -> ModuleType:
    """The module of the format called `name`; an error lists the known ones."""
    if name not in FORMATS:
        close = difflib.get_close_matches(name, FORMATS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"format={name!r} is unknown: use one of {', '.join(FORMATS)}.{hint}")
    return FORMATS[name]


# The formats an export path names by its suffix; any other path is written in vitkit's own format.
EXPORT_SUFFIXES = {".onnx": "onnx", ".npz": "npz"}


def export_format(path: str | os.PathLike) -> str:
    """The format `export(model, path)` writes when none is given: the one its suffix names, else "vitkit"."""
    return EXPORT_SUFFIXES.get(Path(path).suffix.lower(), "vitkit")


def detect_format(path: str | os.PathLike) -> str:
    """The name of the format of a checkpoint: the first whose `detect` recognises it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory.")
    for name, module in FORMATS.items():
        if module.detect(path):
            return name
    known = ", ".join(FORMATS)
    command = running_command()
    if command is None:
        fix = f"pass format= one of {known}"
    elif command == "convert":
        fix = f"pass --format, one of {known}"
    else:  # only `vitkit convert` takes --format
        fix = f"convert it first with `vitkit convert {path} OUT.safetensors --format FORMAT --to vitkit` ({known})"
    raise ValueError(
        f"{path}: cannot tell its checkpoint format from its kind and name ({path.suffix or 'no suffix'!r}); {fix}."
    )
