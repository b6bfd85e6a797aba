"""Datasets larger than memory: Parquet shards, streamed shard by shard during training.

`image_folder.pack_image_folder(root, out)` (`vitkit data pack ROOT OUT`) writes each split of an image folder as
Parquet files (one row per image: `key`, `image` = the original file's bytes, `label`; row groups of 100 rows), in a
fixed shuffled order, balanced (shard sizes differ by at most one), each shard written atomically, then
`index.json` (classes, shard files and their sample counts), which marks a complete pack. Parquet rather than
WebDataset tar: pyarrow streams the rows much faster than Python's tarfile reads tar members, and the files are
smaller (no 512-byte header per member); see docs/SCALING.md. Any Parquet
reader (pyarrow, pandas, Hugging Face `datasets`, Spark, DuckDB) reads the shards.

Training (`--data shards --data-dir OUT`) streams them. The order of epoch e is a function of
(seed, e, number of processes, number of DataLoader workers):
- the shards are permuted with (seed, e); process r takes every R-th of them from r, and of those, worker role w
  takes every W-th from w: no shard is read twice, no sample is seen twice in an epoch;
- a role reads its shards one after the other (sequential reads: local disk, NFS, object stores), and the samples
  of a shard in the order of a permutation seeded by (seed, e, shard), so memory holds one shard's encoded bytes;
- a role's samples form consecutive micro-batches; the process's micro-batch k comes from role k mod W.
Every epoch has the same number of steps on every process, computed from the shard sizes before reading
(the smallest share any role can get), so processes never wait for one another at the end of an epoch;
samples beyond it (a few when shards do not divide evenly over processes x workers) are left out of that
epoch, different ones each epoch. Decoding happens in the DataLoader workers. A run resumed with the same
numbers of processes and workers continues exactly (`training.check_data_order` refuses other numbers):
micro-batch k is found by arithmetic, whole shards are skipped unread, and the DataLoader's workers take the
roles in the rotated order. `ShardedDataset[i]` also reads any single sample (by row group), for evaluation.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from vitkit.errors import reporting_dead_workers
from vitkit.files import atomic_write, refuse_overwrite

from .images import read_image

if TYPE_CHECKING:
    from vitkit.training.distributed import World
    from vitkit.training.recipes import TrainConfig

FORMAT = "vitkit-shards/1"
ROW_GROUP = 100
INDEX = "index.json"


class FileSplit(Protocol):
    """A split of image files, as `image_folder.ImageFolder` holds one: (file, label) samples and the class names, with
    the training augmentation its images want."""

    samples: list[tuple[Path, int]]
    classes: list[str]
    crop_scale: tuple[float, float]
    flip: bool


def pack_splits(
    splits: Mapping[str, FileSplit],
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int,
    seed: int,
    source: str,
    progress: bool = False,
    overwrite: bool = False,
) -> dict:
    """Write each of `splits` ("train", "test") as Parquet shards of about `samples_per_shard` samples in
    `out_dir`, in an order shuffled with `seed`; returns the index also written to `out_dir/index.json`.
    `progress` shows a bar of the images packed per split on a terminal (none in a log). A non-empty `out_dir`
    is a FileExistsError unless `overwrite`.
    (`image_folder.pack_image_folder` packs an image folder through this.)"""
    from tqdm import tqdm

    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard={samples_per_shard} must be at least 1.")
    out = Path(out_dir)
    refuse_overwrite(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    index_splits, classes = {}, None
    for split, folder in splits.items():
        if classes is not None and folder.classes != classes:
            raise ValueError(f"{source}: the {split} split's classes {folder.classes} differ from train's {classes}.")
        classes = folder.classes
        order = np.random.default_rng([seed, split == "test"]).permutation(len(folder.samples))
        shards = []
        bar = tqdm(total=len(order), desc=f"packing {split}", unit="img", disable=None if progress else True)
        for s, part in enumerate(np.array_split(order, math.ceil(len(order) / samples_per_shard))):
            name = f"{split}-{s:06d}.parquet"
            samples = [folder.samples[i] for i in part]
            atomic_write(out / name, functools.partial(_write_shard, samples=samples, shard=s))
            shards.append({"file": name, "count": len(part)})
            bar.update(len(part))
        bar.close()
        index_splits[split] = shards
    first = next(iter(splits.values()))
    index = {
        "format": FORMAT,
        "classes": classes,
        "splits": index_splits,
        "crop_scale": list(first.crop_scale),
        "flip": first.flip,
        "source": source,
        "seed": seed,
    }
    text = json.dumps(index, indent=1) + "\n"
    atomic_write(out / INDEX, lambda tmp: Path(tmp).write_text(text))
    return index


def _write_shard(path: str, samples: list[tuple[Path, int]], shard: int) -> None:
    """One Parquet shard: a row per sample with its key, the image file's bytes and its label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "key": [f"{shard:06d}{position:06d}{file.suffix.lower()}" for position, (file, _) in enumerate(samples)],
            "image": pa.array([file.read_bytes() for file, _ in samples], pa.binary()),
            "label": pa.array([label for _, label in samples], pa.int64()),
        }
    )
    # Images are compressed already; small row groups keep a random read (evaluation) small.
    pq.write_table(table, path, row_group_size=ROW_GROUP, compression="none")


def read_index(data_dir: str | os.PathLike | None) -> dict:
    """The index.json of a packed dataset, with a clear error when `data_dir` holds none."""
    path = Path(data_dir or ".") / INDEX
    if data_dir is None or not path.is_file():
        raise FileNotFoundError(
            f"shards: {path} not found: pass --data-dir DIR with a dataset written by `vitkit data pack`."
        )
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{path}: format {index.get('format')!r} is not {FORMAT!r}; pack it again.")
    return index


class ShardedDataset(Dataset):
    """A split of a packed dataset: streamed for training (`stream`), any sample readable by index. As an image
    folder, a packed folder without a test split answers `test` with its val split, the held-out images."""

    def __init__(self, split: str = "train", data_dir: str | os.PathLike | None = None):
        index = read_index(data_dir)
        if split == "test" and "test" not in index["splits"] and "val" in index["splits"]:
            split = "val"
        if split not in index["splits"]:
            raise ValueError(f"split={split!r} is not in {data_dir}: it holds {', '.join(index['splits'])}.")
        self.root = self.source = Path(data_dir or ".")
        self.classes = list(index["classes"])
        self.crop_scale, self.flip = tuple(index["crop_scale"]), bool(index["flip"])
        self.files = [self.root / s["file"] for s in index["splits"][split]]
        self.counts = [int(s["count"]) for s in index["splits"][split]]
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).tolist()
        self._cached: tuple[tuple[int, int] | None, Any] = (None, None)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        s = bisect.bisect_right(self.starts, index) - 1
        group, row = divmod(index - self.starts[s], ROW_GROUP)
        if self._cached[0] != (s, group):  # evaluation reads in order: one row group at a time
            self._cached = ((s, group), self._parquet(s).read_row_group(group, columns=["key", "image", "label"]))
        table = self._cached[1]
        key, data, label = (table.column(c)[row].as_py() for c in ("key", "image", "label"))
        return read_image(f"{self.files[s]}:{key}", data=data), label

    def _parquet(self, s: int):
        import pyarrow.parquet as pq

        file = pq.ParquetFile(self.files[s])
        self._check_count(s, file.metadata.num_rows)
        return file

    def _check_count(self, s: int, found: int) -> None:
        if found != self.counts[s]:
            raise ValueError(
                f"{self.files[s]}: holds {found} samples, index.json says {self.counts[s]}; pack the dataset again."
            )

    def micro_batches_per_epoch(self, micro: int, world_size: int, workers: int) -> int:
        """Micro-batches of `micro` samples that every process gets in every epoch (the same for all epochs)."""
        roles = max(workers, 1)
        per_role = len(self.files) // (world_size * roles)
        if per_role == 0:
            raise ValueError(
                f"{self.root}: {len(self.files)} shards cannot feed {world_size} processes x {roles} workers: "
                "pack it again with a smaller --samples-per-shard, or use fewer workers."
            )
        # The smallest share a role can get: its `per_role` smallest shards.
        return sum(sorted(self.counts)[:per_role]) // micro * roles

    def stream(
        self, *, epoch: int, seed: int, rank: int, world_size: int, workers: int, micro: int, start: int, stop: int
    ) -> Iterator[tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]]:
        """This process's micro-batches `start` to `stop` (exclusive) of epoch `epoch`, as (uint8 images, labels),
        decoded by `workers` DataLoader worker processes."""
        roles = max(workers, 1)
        if stop > self.micro_batches_per_epoch(micro, world_size, workers):
            raise ValueError(f"micro-batch {stop} is beyond the epoch of {self.root}.")
        shards = np.random.default_rng([seed, epoch]).permutation(len(self.files))[rank::world_size]
        stream = _RoleStream(self, [shards[w::roles].tolist() for w in range(roles)], epoch, seed, micro, start, stop)
        if workers == 0:
            yield from stream
            return
        # Its own generator: creating the loader then draws no number from the global RNG (exact resumption).
        yield from reporting_dead_workers(
            DataLoader(stream, batch_size=None, num_workers=workers, generator=torch.Generator())
        )

    def _role_samples(self, shards: list[int], epoch: int, seed: int, skip: int) -> Iterator[tuple[bytes, str, int]]:
        """(image bytes, name, label) of `shards` in order, each shard in its permuted order, from sample `skip`."""
        for s in shards:
            if skip >= self.counts[s]:
                skip -= self.counts[s]  # a shard consumed before the resume: not even opened
                continue
            table = self._parquet(s).read(columns=["key", "image", "label"])
            keys, images, labels = (table.column(c).to_pylist() for c in ("key", "image", "label"))
            for i in np.random.default_rng([seed, epoch, s]).permutation(len(keys))[skip:]:
                yield images[i], f"{self.files[s]}:{keys[i]}", labels[i]
            skip = 0


class _RoleStream(IterableDataset):
    """The micro-batches of one process, `start` to `stop`: micro-batch k is the (k // W)-th of role k mod W.
    DataLoader worker i plays role (start + i) mod W, so the in-order round robin over workers yields k in order."""

    def __init__(self, dataset, role_shards, epoch, seed, micro, start, stop):
        self.dataset, self.role_shards, self.epoch, self.seed = dataset, role_shards, epoch, seed
        self.micro, self.start, self.stop = micro, start, stop

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        roles = len(self.role_shards)
        todo = range(self.start + worker, self.stop, roles)  # the k this worker yields
        if info is None and roles > 1:
            raise RuntimeError("more than one role needs DataLoader workers")
        if not todo:
            return
        role = todo[0] % roles
        first = todo[0] // roles  # the role's micro-batches before this one were consumed earlier
        samples = self.dataset._role_samples(self.role_shards[role], self.epoch, self.seed, first * self.micro)
        for _ in todo:
            images, labels = [], []
            for data, name, label in (next(samples) for _ in range(self.micro)):
                images.append(read_image(name, data=data))
                labels.append(label)
            same = all(im.shape == images[0].shape for im in images)
            yield (torch.stack(images) if same else images), torch.tensor(labels, dtype=torch.long)


def check_data_order(saved: dict, config: TrainConfig, world: World, dataset, run_path: Path) -> None:
    """Refuse to resume a run on packed shards with another number of processes or of DataLoader workers:
    the shards' order depends on both (`vitkit.data.shards`), so the run would silently continue in another order,
    with images of the current epoch seen twice or not at all and other epoch lengths. Image folders and
    in-memory datasets give the same global batches for any count and resume with any."""
    if not isinstance(dataset, ShardedDataset):
        return
    # Checkpoints from before the counts were recorded: one RNG state per process, the workers in the config.
    saved_size = int(saved["world_size"] if "world_size" in saved else len(saved["rng"]))
    saved_workers = int(saved["workers"] if "workers" in saved else json.loads(saved["config"])["workers"])
    # Without workers the stream is read in the main process as one role, exactly as by one worker.
    if saved_size == world.size and max(saved_workers, 1) == max(config.workers, 1):
        return
    raise ValueError(
        f"--resume {run_path}: it streams packed shards in an order set by the number of processes and of "
        f"DataLoader workers; it was saved with {saved_size} process(es) and --workers {saved_workers}, and would "
        f"now run with {world.size} and --workers {config.workers}, which continues in another order, not the "
        f"saved run's. Resume it with {saved_size} process(es) (torchrun --nproc_per_node) and --workers "
        f"{saved_workers}; other counts need a new run (e.g. --checkpoint {run_path}/best.safetensors when it has one)."
    )
