import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from helpers import SMALL_ENCODER, assert_same_weights, fingerprint, run_weights, write_image_folder
from vitkit.data.datasets import get_dataset
from vitkit.data.image_folder import ImageFolder, pack_image_folder
from vitkit.data.shards import ShardedDataset, check_data_order
from vitkit.training import loop as training
from vitkit.training.distributed import World
from vitkit.training.loop import train
from vitkit.training.recipes import TrainConfig
from vitkit.training.runs import read_checkpoint


@pytest.fixture
def packed(tmp_path):
    root = write_image_folder(tmp_path / "photos")
    index = pack_image_folder(root, tmp_path / "packed", samples_per_shard=4, val_fraction=0.25)
    return root, tmp_path / "packed", index


def test_pack_writes_balanced_parquet_shards_with_the_original_bytes(packed):
    root, out, index = packed
    assert index["classes"] == ["cat", "dog", "owl"]
    counts = [s["count"] for s in index["splits"]["train"]]
    assert sum(counts) == 27 and max(counts) - min(counts) <= 1 and len(counts) == 7  # 3 x 9 train images
    assert sum(s["count"] for s in index["splits"]["val"]) == 9 and "test" not in index["splits"]  # no test/
    assert json.loads((out / "index.json").read_text()) == index
    table = pq.read_table(out / index["splits"]["train"][0]["file"])  # any Parquet reader reads a shard
    assert table.column_names == ["key", "image", "label"] and table.num_rows == counts[0]
    originals = {p.read_bytes(): p.parent.name for p in root.rglob("*.*")}
    for data, label in zip(table.column("image").to_pylist(), table.column("label").to_pylist()):
        assert index["classes"][label] == originals[data]  # stored as the original file, not re-encoded


def test_packed_split_holds_the_image_folder_split_pixel_for_pixel(packed):
    root, out, _ = packed
    for split in ("train", "val", "test"):  # a folder without test/ answers test with val, packed or not
        folder = ImageFolder(split, root, val_fraction=0.25)
        sharded = get_dataset("shards", split, data_dir=out)
        assert sharded.classes == folder.classes and len(sharded) == len(folder)
        assert Counter(fingerprint(*sharded[i]) for i in range(len(sharded))) == Counter(
            fingerprint(*folder[i]) for i in range(len(folder))
        )


def epoch_samples(dataset, epoch, world_size, workers, micro, start=0, stop=None):
    """Every process's micro-batches of an epoch, decoded by real DataLoader workers."""
    stop = stop or dataset.micro_batches_per_epoch(micro, world_size, workers)
    out = []
    for rank in range(world_size):
        stream = dataset.stream(
            epoch=epoch, seed=3, rank=rank, world_size=world_size, workers=workers, micro=micro, start=start, stop=stop
        )
        out.append([[fingerprint(im, y) for im, y in zip(images, labels)] for images, labels in stream])
    return out


@pytest.mark.slow
def test_streamed_epoch_covers_the_images_once_over_processes_and_workers(tmp_path):
    root = write_image_folder(tmp_path / "photos", per_class=8)
    pack_image_folder(root, tmp_path / "packed", samples_per_shard=3, val_fraction=0.25)  # 18 train: 6 shards of 3
    dataset = ShardedDataset("train", tmp_path / "packed")
    folder = Counter(fingerprint(*ImageFolder("train", root, val_fraction=0.25)[i]) for i in range(18))
    # 3 processes x 2 workers: one shard per role, each process 2 micro-batches of 3 samples.
    assert dataset.micro_batches_per_epoch(3, 3, 2) == 2
    ranks = epoch_samples(dataset, epoch=0, world_size=3, workers=2, micro=3)
    seen = [s for rank in ranks for batch in rank for s in batch]
    assert Counter(seen) == folder  # every image once: no duplicate across processes or workers
    assert all(len(batch) == 3 for rank in ranks for batch in rank)
    assert epoch_samples(dataset, epoch=0, world_size=3, workers=2, micro=3) == ranks  # a function of the epoch
    assert epoch_samples(dataset, epoch=1, world_size=3, workers=2, micro=3) != ranks  # reshuffled per epoch


@pytest.mark.slow
def test_a_resumed_stream_continues_exactly(packed):
    _, out, _ = packed
    dataset = ShardedDataset("train", out)  # 7 shards of 3-4 samples
    micro, workers = 2, 2
    total = dataset.micro_batches_per_epoch(micro, 1, workers)
    assert total == (3 + 3 + 4) // micro * workers  # a role gets 3 of the 7 shards at least: the 3 smallest
    whole = epoch_samples(dataset, 5, 1, workers, micro)[0]
    assert len(whole) == total and len({s for b in whole for s in b}) == total * micro
    for start in (1, 3, total - 1):
        assert epoch_samples(dataset, 5, 1, workers, micro, start=start)[0] == whole[start:]


def test_too_few_shards_for_the_processes_is_a_clear_error(packed):
    dataset = ShardedDataset("test", packed[1])  # 3 shards
    with pytest.raises(ValueError, match="3 shards cannot feed 2 processes x 2 workers"):
        dataset.micro_batches_per_epoch(1, 2, 2)
    with pytest.raises(FileNotFoundError, match="vitkit data pack"):
        get_dataset("shards", "train", data_dir=packed[0])


def small_run(out_dir, **overrides) -> TrainConfig:
    spec = dict(
        model="ViT-Ti/8",
        model_args=dict(SMALL_ENCODER),
        image_size=16,
        batch_size=3,
        epochs=1,
        eval_every=0,
        threads=1,
        workers=2,
        out_dir=str(out_dir),
    )
    return TrainConfig(**{**spec, **overrides})


@pytest.mark.slow
def test_a_training_epoch_on_packed_shards_sees_exactly_the_image_folder_images(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "photos", per_class=8)
    pack_image_folder(root, tmp_path / "packed", samples_per_shard=3, val_fraction=0.25)  # 18 train images
    seen: list[tuple] = []
    augment = training.train_batch

    def recording_train_batch(images, labels, *args, **kwargs):
        seen.extend(fingerprint(image, label) for image, label in zip(images, labels))
        return augment(images, labels, *args, **kwargs)

    monkeypatch.setattr(training, "train_batch", recording_train_batch)
    data_args = {"val_fraction": 0.25}
    train(small_run(tmp_path / "folder", data="imagefolder", data_dir=str(root), data_args=data_args))
    from_folder, seen[:] = Counter(seen), []
    train(small_run(tmp_path / "shards", data="shards", data_dir=str(tmp_path / "packed"), data_args={}))
    assert len(seen) == 18 and Counter(seen) == from_folder  # each image once, the same pixels and labels


@pytest.mark.slow
def test_a_run_on_packed_shards_stopped_and_resumed_is_bit_identical(tmp_path):
    root = write_image_folder(tmp_path / "photos", per_class=8)
    pack_image_folder(root, tmp_path / "packed", samples_per_shard=3, val_fraction=0.25)
    spec = dict(data="shards", data_dir=str(tmp_path / "packed"), data_args={}, epochs=2)  # 12 steps
    train(small_run(tmp_path / "whole", **spec))
    stopped = train(small_run(tmp_path / "split", **spec), stop_after=4)  # inside the first epoch
    assert stopped.interrupted and stopped.step == 4
    # Another worker count would stream another order: refused, naming both counts, the run left as it was.
    with pytest.raises(
        ValueError,
        match=r"saved with 1 process\(es\) and --workers 2, and would now run with 1 "
        r"and --workers 3.*Resume it with 1 process\(es\).*--workers 2",
    ):
        train(resume=tmp_path / "split", changes={"workers": 3})
    assert read_checkpoint(tmp_path / "split")["workers"] == 2
    assert train(resume=tmp_path / "split").step == 12
    assert_same_weights(run_weights(tmp_path / "whole"), run_weights(tmp_path / "split"))


def test_a_packed_shard_run_refuses_to_resume_with_another_process_count(packed):
    saved = {"world_size": 2, "workers": 1, "rng": [], "config": "{}"}
    dataset = ShardedDataset("train", packed[1])
    with pytest.raises(ValueError, match=r"saved with 2 process\(es\) and --workers 1, and would now run with 1 "):
        check_data_order(saved, small_run("run", workers=1), World(0, 1, torch.device("cpu")), dataset, Path("run"))
    # No workers reads the one role in the main process, in the order one worker reads it: allowed.
    check_data_order(saved, small_run("run", workers=0), World(1, 2, torch.device("cpu")), dataset, Path("run"))
    # A checkpoint from before the counts were recorded: one RNG state per process, the workers in its config.
    old = {"rng": [None, None], "config": json.dumps({"workers": 2})}
    with pytest.raises(ValueError, match=r"saved with 2 process\(es\) and --workers 2"):
        check_data_order(old, small_run("run", workers=2), World(0, 1, torch.device("cpu")), dataset, Path("run"))
    # Image folders give the same global batches for any count: no refusal.
    folder = ImageFolder("train", packed[0], val_fraction=0.25)
    check_data_order(saved, small_run("run"), World(0, 1, torch.device("cpu")), folder, Path("run"))


def test_a_dead_worker_of_a_packed_stream_is_reported_not_waited_on(packed, monkeypatch):
    import os
    import signal

    from vitkit.data import shards
    from vitkit.errors import WorkerError

    _, out, _ = packed
    dataset = ShardedDataset("train", out)
    monkeypatch.setattr(shards, "read_image", lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))  # in the worker
    stream = dataset.stream(epoch=0, seed=0, rank=0, world_size=1, workers=1, micro=2, start=0, stop=1)
    with pytest.raises(WorkerError, match=r"a data-loading worker process died .*--workers"):
        list(stream)
