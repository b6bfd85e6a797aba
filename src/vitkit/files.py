"""Reading and writing the files behind every checkpoint format: atomic writes, and readers of safetensors,
`.npz` and weights-only torch files that refuse pickles, check every header against the bytes the file holds
before allocating, and raise `CheckpointError` naming the file (and key) when it is unreadable."""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from vitkit.errors import CheckpointError, spelled

Tensors = dict[str, torch.Tensor]


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
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
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
            raise OSError(e.errno, f"{path}: writing failed ({e.strerror or e}); {kept}") from e
        raise
    fsync(path.parent)


def refuse_overwrite(path: str | os.PathLike, overwrite: bool = False) -> None:
    """A FileExistsError when `path` is an existing file or a non-empty directory, unless `overwrite`: no writer
    replaces what is there without being asked. Every writer calls it before it writes anything."""
    path = Path(path)
    if overwrite or not (path.exists() or path.is_symlink()):
        return
    if path.is_dir():
        if not any(path.iterdir()):
            return
        run = any((path / name).exists() for name in ("metrics.jsonl", "checkpoint.pt", "checkpoint"))
        kind = "a training run's directory" if run else "a non-empty directory"
    else:
        kind = "a file"
    raise FileExistsError(f"{path} already exists ({kind}): pass {spelled('overwrite=True', '--overwrite')} to "
                          "replace it.")  # fmt: skip


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; the rename is still atomic there
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


def read_safetensors(path: str | os.PathLike) -> tuple[Tensors, dict[str, str]]:
    """All tensors and the metadata of a safetensors file; a CheckpointError if it is not a sound one (the
    safetensors reader checks the header against the file's size before reading any tensor)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file.")
    _refuse_duplicate_names(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # SafetensorError, or torch refusing a dtype: every failure to parse is a refusal
        raise CheckpointError(
            path,
            f"not a readable safetensors file ({type(e).__name__}: {str(e)[:300]}). "
            "Is it truncated or of another format?",
        ) from e


SAFETENSORS_MAX_HEADER = 100 * 2**20  # the safetensors reader's own limit


def _refuse_duplicate_names(path: str | os.PathLike) -> None:
    """A CheckpointError naming a tensor the header lists twice: JSON readers keep the last silently, so two
    writers' tensors could hide behind one name. Headers the safetensors reader refuses are left to it."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) < 8 or not 2 <= (n := struct.unpack("<Q", size)[0]) <= SAFETENSORS_MAX_HEADER:
            return
        header = f.read(n)

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [k for k, _ in items]
        for name in names:
            if names.count(name) > 1:
                raise CheckpointError(path, "the safetensors header names this tensor twice.", name)
        return dict(items)

    try:
        json.loads(header, object_pairs_hook=pairs)
    except CheckpointError:
        raise
    except ValueError:  # not JSON: the safetensors reader names the problem
        return


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str] | None:
    """The metadata of a safetensors file without reading its tensors; None if it is not readable as one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return None


def read_npz(path: str | os.PathLike) -> Tensors:
    """Every array of an `.npz` file as a tensor. Each `.npy` header is checked against the bytes the archive
    holds before anything is allocated; object arrays (pickles), duplicate names and zip bombs are refused."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file.")
    try:
        with zipfile.ZipFile(path) as archive:
            return _npz_arrays(archive, path)
    except CheckpointError:
        raise
    except Exception as e:  # zipfile and numpy's header parser fail in many ways on a hostile file; all refusals
        raise CheckpointError(path, f"not a readable .npz file ({type(e).__name__}: {str(e)[:300]}).") from e


def _npz_arrays(archive: zipfile.ZipFile, path: str | os.PathLike) -> Tensors:
    out: Tensors = {}
    for info in archive.infolist():
        key = info.filename.removesuffix(".npy")
        if key in out:
            raise CheckpointError(path, "the archive holds this array twice.", key)
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > 100 * info.compress_size + 2**20:
            raise CheckpointError(
                path,
                f"claims {info.file_size:,} bytes from {info.compress_size:,} compressed: refused as a zip bomb.",
                key,
            )
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            if dtype.hasobject:
                raise CheckpointError(
                    path,
                    "holds object arrays (pickled Python objects), which vitkit never loads because unpickling "
                    "runs code; a ViT checkpoint has numeric arrays only. Re-save it from its own trusted code without "
                    "them.",
                    key,
                )
            size = math.prod(shape) * dtype.itemsize
            held = info.file_size - f.tell()
            if size != held:
                raise CheckpointError(
                    path, f"the header claims shape {shape} of {dtype} ({size:,} bytes); the file holds {held:,}.", key
                )
            data = f.read(size)
        if len(data) != size:
            raise CheckpointError(path, f"truncated: {len(data):,} of {size:,} bytes.", key)
        array = np.frombuffer(bytearray(data), dtype=dtype).reshape(shape, order="F" if fortran else "C")
        try:
            out[key] = torch.from_numpy(np.ascontiguousarray(array))
        except TypeError as e:
            raise CheckpointError(path, f"arrays of dtype {dtype} cannot be weights ({e}).", key) from e
    return out


def read_torch(path: str | os.PathLike) -> Tensors:
    """A `.pth` / `.bin` state dict through `torch.load(weights_only=True)`: plain tensors only, no code runs."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the weights-only unpickler of a hostile file can fail in many ways; all are refusals
        raise CheckpointError(
            path,
            f"refused or unreadable as a weights-only torch file ({type(e).__name__}: {str(e)[:300]}). "
            "vitkit never unpickles arbitrary objects; convert the file to safetensors with its own trusted code.",
        ) from e
    if isinstance(data, dict) and "optimizer" in data:
        raise CheckpointError(
            path,
            "a training checkpoint (weights with an optimiser's state, as `vitkit train` writes for --resume), not "
            "a model file: load the model saved beside it (a vitkit run: its model.safetensors or best.safetensors, "
            "or the run directory itself).",
        )
    if not isinstance(data, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in data.items()):
        raise CheckpointError(path, f"expected a flat state dict of named tensors, got a {type(data).__name__}.")
    return dict(data)
