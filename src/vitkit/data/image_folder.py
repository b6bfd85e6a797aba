"""Image folders: `root/<class>/<image>` files decoded on demand (`ImageFolder`), their train, val and test splits,
and their packing into Parquet shards (`pack_image_folder`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from vitkit.errors import ImageError

from .images import SUFFIXES, SkipLog, SkippedImageWarning, check_image, image_paths, not_images, read_image, subfolders
from .shards import pack_splits

IMAGE_SUFFIXES = SUFFIXES
SPLITS = ("train", "val", "test")
# The share of each class's training images held out for validation where a dataset has no val split of its own:
# what a run chooses (its best checkpoint) is chosen on those, never on the test split.
VAL_FRACTION = 0.1


def held_out(count: int, fraction: float, seed: int) -> set[int]:
    """Which of `count` images of one class (seeded by `seed`, its label) are held out for validation: a fixed
    `fraction`, at least one where there are two or more, and never all of them."""
    if count < 2 or fraction <= 0:
        return set()
    order = np.random.default_rng(seed).permutation(count)
    return set(order[: min(max(int(round(fraction * count)), 1), count - 1)].tolist())


class ImageFolder(Dataset):
    """`root/<class>/<image>` files, decoded on demand, in three splits:

    - `train`: `root/train` when it is there beside `root/val` or `root/test`, otherwise `root` itself; less a
      deterministic `val_fraction` of each class held out for `val` where there is no `root/val`.
    - `val`: `root/val`, or that held-out part of the training images (at least one image of every class with
      two or more, so that 5 images a class and the default 10% still give a val split).
    - `test`: `root/test`; a folder without one answers with its val split, the held-out images a model is
      evaluated on (`has_test` tells which).

    A training run chooses on val and reads test once, at its end (`training_splits`)."""

    crop_scale, flip = (0.05, 1.0), True

    def __init__(
        self,
        split: str = "train",
        data_dir: str | os.PathLike | None = None,
        val_fraction: float = VAL_FRACTION,
        strict: bool = False,
    ):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is unknown: use one of {', '.join(map(repr, SPLITS))}.")
        self.strict, self.skipped = strict, SkipLog()
        if data_dir is None or not Path(data_dir).is_dir():
            raise FileNotFoundError(f"imagefolder: data_dir={data_dir!r} is not a directory: pass --data-dir ROOT.")
        root = self.source = Path(data_dir)
        found = {n for n in SPLITS if (root / n).is_dir()}
        split_dirs = "train" in found and len(found) > 1
        self.has_val, self.has_test = (split_dirs and name in found for name in ("val", "test"))
        if split == "test" and not self.has_test:
            split = "val"
        # root/train, root/val or root/test as it is: all but a train/ that gives up images to val
        whole = split_dirs and split in found and (split != "train" or "val" in found)
        base = root / split if whole else root / "train" if split_dirs else root
        self.classes = [d.name for d in subfolders(base)]
        if not self.classes:
            raise FileNotFoundError(f"imagefolder: no class folders in {base}: expected {base}/<class>/<image>.")
        if not whole and not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
        if split == "val" and not whole and val_fraction == 0:
            raise ValueError(f"imagefolder: {root} has no val/ folder and val_fraction=0 holds none out: no val split.")
        self.samples: list[tuple[Path, int]] = []
        others: list[Path] = []
        for label, name in enumerate(self.classes):
            files = image_paths(base / name, others)
            if not whole and val_fraction > 0:
                held = held_out(len(files), val_fraction, label)
                files = [f for i, f in enumerate(files) if (i in held) == (split == "val")]
            self.samples += [(f, label) for f in files if self._usable(f)]
        if not self.samples:
            raise FileNotFoundError(f"imagefolder: no images with suffixes {IMAGE_SUFFIXES} under {base} ({split}).")
        if others and (split == "train" or whole):  # counted once per folder of files
            warnings.warn(f"{base}: left out {not_images(others)}", SkippedImageWarning, stacklevel=2)

    def __len__(self) -> int:
        return len(self.samples)

    def _usable(self, path: Path) -> bool:
        """The header checks of every file, at once: empty, non-image and oversized files are left out (or, when
        strict, the first one is an error)."""
        try:
            check_image(path)
        except ImageError as e:
            if self.strict:
                raise
            self.skipped.add(e)
            return False
        return True

    def __getitem__(self, index: int) -> tuple[Any, int]:
        """The image and its label; a file that fails to decode (truncated, say) gives its ImageError instead of
        the image (hence `Any`), which the batching drops and logs (`evaluation.batches`), or raises when
        strict."""
        path, label = self.samples[index]
        try:
            return read_image(path), label
        except ImageError as e:
            if self.strict:
                raise
            return e, label


def pack_image_folder(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int = 1000,
    val_fraction: float = VAL_FRACTION,
    seed: int = 0,
    progress: bool = False,
    overwrite: bool = False,
) -> dict:
    """Write the train, val and (where it has one) test splits of the image folder `root` (as `imagefolder` splits
    it) as Parquet shards of about `samples_per_shard` samples in `out_dir` (`shards.pack_splits`); returns the index
    it writes.
    `progress` shows a bar per split on a terminal (none in a log); a non-empty `out_dir` is refused unless
    `overwrite`."""
    if not Path(root).is_dir():
        raise FileNotFoundError(f"{root}: not a directory; pack an image folder ROOT/<class>/<image>.")
    train = ImageFolder("train", root, val_fraction=val_fraction)
    held = SPLITS[1:] if train.has_test else SPLITS[1:2]
    splits = {"train": train, **{split: ImageFolder(split, root, val_fraction=val_fraction) for split in held}}
    return pack_splits(
        splits,
        out_dir,
        samples_per_shard=samples_per_shard,
        seed=seed,
        source=str(root),
        progress=progress,
        overwrite=overwrite,
    )
