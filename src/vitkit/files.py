"""Reading and writing the files behind every checkpoint format: atomic writes, and readers of safetensors,
`.npz` and weights-only torch files that refuse pickles and name the file when it is unreadable."""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

Tensors = dict[str, torch.Tensor]


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
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


def read_safetensors(path: str | os.PathLike) -> tuple[Tensors, dict[str, str]]:
    """All tensors and the metadata of a safetensors file; a clear error if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}). Is it truncated or of another format?") from e


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str] | None:
    """The metadata of a safetensors file without reading its tensors; None if it is not readable as one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return None


def read_npz(path: str | os.PathLike) -> Tensors:
    """Every array of an `.npz` file as a tensor; object arrays (pickles) are refused."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: torch.from_numpy(np.ascontiguousarray(data[k])) for k in data.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, zlib.error) as e:
        raise ValueError(f"{path}: not a readable .npz file ({e}). Is it truncated or of another format?") from e


def read_torch(path: str | os.PathLike) -> Tensors:
    """A `.pth` / `.bin` state dict through `torch.load(weights_only=True)`: plain tensors only, no code runs."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(
            f"{path}: refused or unreadable as a weights-only torch file ({type(e).__name__}: {str(e)[:300]}). "
            "vitkit never unpickles arbitrary objects; convert the file to safetensors with its own trusted code."
        ) from e
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ValueError(f"{path}: expected a flat state dict of tensors, got {type(data).__name__} of other things.")
    return dict(data)
