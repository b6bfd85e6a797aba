"""Reading image files safely: every file PIL can decode becomes a uint8 tensor (C, H, W); every other file is an
`ImageError` naming it, and a folder of mixed files is used with the bad ones skipped (one warning each).

Conversions (decided here, once): palette, grayscale, CMYK and other modes become RGB (or L); the alpha channel is
dropped (`ALPHA`); 16-bit images are scaled to 8 bits (not clipped); the EXIF orientation is applied, so a
photo is upright as a viewer shows it. Refused: empty files, files PIL does not recognise, truncated files, and
images of more than `MAX_PIXELS` pixels, which are refused from their header, before anything is decoded.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from vitkit.errors import ImageError

MAX_PIXELS = 89_478_485  # PIL's own decompression-bomb threshold: about 0.25 GB as RGB
# Transparency: "drop" keeps the colour stored under each pixel and drops the alpha channel (PIL's convert("RGB"),
# as torchvision's, timm's and Hugging Face's pipeline loaders read images); "white" composites over white.
ALPHA = "drop"
MIN_SIDE = 2  # an image one pixel wide or high is a line or a dot, not a picture to learn from
SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def hidden(path: Path) -> bool:
    """Left out of every folder listing: names that start with a dot (Jupyter's .ipynb_checkpoints, the ._ copies
    macOS writes beside files) and the __MACOSX folder of zip archives made on a Mac."""
    return path.name.startswith(".") or path.name == "__MACOSX"


def subfolders(folder: Path) -> list[Path]:
    """The visible folders in `folder`, sorted by name."""
    return sorted((p for p in folder.iterdir() if p.is_dir() and not hidden(p)), key=lambda p: p.name)


def image_paths(folder: Path, others: list[Path] | None = None) -> list[Path]:
    """The image files (by suffix) in `folder` and its visible subfolders, sorted; the other visible files are
    appended to `others` where it is given."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not hidden(Path(d))]  # not descended into
        visible = [Path(root, f) for f in files if not hidden(Path(f))]
        found += [f for f in visible if f.suffix.lower() in SUFFIXES]
        if others is not None:
            others += [f for f in visible if f.suffix.lower() not in SUFFIXES]
    return sorted(found)


def not_images(files: list[Path]) -> str:
    """One line counting the files of a folder that are not images, by suffix: "3 files that are not images
    (.svg 2, .txt 1)"; "" for none."""
    if not files:
        return ""
    counts: dict[str, int] = {}
    for f in files:
        counts[f.suffix.lower() or f.name] = counts.get(f.suffix.lower() or f.name, 0) + 1
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    many = len(files) > 1
    return f"{len(files)} file{'s' if many else ''} that {'are not images' if many else 'is not an image'} ({kinds})"


def _open(path: str | os.PathLike, max_pixels: int, data: bytes | None = None):
    """The opened (not yet decoded) PIL image, after the checks its header allows; from `data` when given (the
    file's bytes, kept elsewhere: `path` then only names them)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if data is None and path.is_dir():
        raise IsADirectoryError(
            f"{path}: a folder, not an image file; `vitkit.training.evaluation.image_files` lists its images."
        )
    if data is None and not path.is_file():
        raise FileNotFoundError(f"{path}: no such image file.")
    if (path.stat().st_size if data is None else len(data)) == 0:
        raise ImageError(path, "an empty file (0 bytes).")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(path if data is None else io.BytesIO(data))
        except Image.DecompressionBombError as e:  # PIL's own refusal, at twice its threshold
            raise ImageError(path, f"{e}: refused without decoding, more than the limit of {max_pixels:,}.") from e
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise ImageError(path, f"not an image PIL can read ({e}). Use a PNG or JPEG file.") from e
    width, height = im.size
    if width * height > max_pixels:
        im.close()
        raise ImageError(
            path,
            f"{width} x {height} = {width * height:,} pixels, more than the limit of {max_pixels:,}: refused "
            "without decoding (a decompression bomb?). Resize it, or raise "
            "vitkit.data.images.MAX_PIXELS if you trust it.",
        )
    if width < MIN_SIDE or height < MIN_SIDE:
        im.close()
        raise ImageError(path, f"an image of {width} x {height} pixels, too small to use (under {MIN_SIDE} px a side).")
    return im


def check_image(path: str | os.PathLike, max_pixels: int | None = None) -> None:
    """The cheap checks of `read_image` (the file's header only): an ImageError if the file is surely unusable."""
    _open(path, MAX_PIXELS if max_pixels is None else max_pixels).close()


def read_image(
    path: str | os.PathLike, mode: str = "RGB", max_pixels: int | None = None, data: bytes | None = None
) -> torch.Tensor:
    """An image file -> uint8 tensor (C, H, W) in `mode` ("RGB", C = 3; or "L", grayscale, C = 1), converted as
    the module docstring says; an ImageError naming the file if it cannot be used. `data`: the file's bytes when
    they are kept elsewhere (a packed shard); `path` then only names them in errors."""
    from PIL import Image, ImageOps

    if mode not in ("RGB", "L"):
        raise ValueError(f"mode={mode!r} is unknown: use 'RGB' or 'L'.")
    with _open(path, MAX_PIXELS if max_pixels is None else max_pixels, data) as im:
        try:
            im.load()
            im = ImageOps.exif_transpose(im)
            if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
                im = Image.fromarray(_to_8_bits(np.asarray(im), im.mode), "L")
            if ALPHA == "white" and ("A" in im.getbands() or "transparency" in im.info):
                rgba = im.convert("RGBA")
                im = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
            elif im.mode == "P" and "transparency" in im.info:
                # the same colours as straight to RGB or L, without PIL's warning for a palette's transparency bytes,
                # which every such file of a folder would repeat
                im = im.convert("RGBA")
            array = np.asarray(im.convert(mode), dtype=np.uint8)
        except (OSError, ValueError, SyntaxError) as e:  # truncated data, unsupported modes or codecs
            raise ImageError(path, f"cannot be decoded ({e}).") from e
    array = array[..., None] if array.ndim == 2 else array
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def _to_8_bits(array: np.ndarray, mode: str) -> np.ndarray:
    """16- or 32-bit integer gray (scaled from 0..65535) or float gray (0..1 if it fits, else 0..255) -> uint8."""
    values = array.astype(np.float64)
    if mode == "F":
        scale = 255.0 if np.nanmax(values, initial=0.0) <= 1.0 else 1.0
    else:
        scale = 255.0 / 65535.0
    return np.clip(np.nan_to_num(values * scale), 0, 255).round().astype(np.uint8)


class SkipLog:
    """The image files left out of one dataset or command: one warning per file, a count for the summary."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}

    def add(self, error: ImageError) -> None:
        if error.path not in self.files:
            self.files[error.path] = str(error)
            warnings.warn(f"skipped {error}", SkippedImageWarning, stacklevel=2)

    def __len__(self) -> int:
        return len(self.files)

    def summary(self) -> str:
        return f"{len(self)} unreadable image file(s) skipped" if self.files else ""


class SkippedImageWarning(UserWarning):
    """An image file was left out (non-strict mode); the message names it and why."""
