"""The everyday command line: help from TrainConfig's field docs, --version, models, refusals (issue 13)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vitkit
from vitkit.cli import main
from vitkit.data import DATASETS
from vitkit.recipes import OPTIMIZERS, PRECISIONS, SCHEDULES, TRAIN_MODES, TrainConfig, field_help

SRC = Path(__file__).resolve().parents[1] / "src"


def run_vitkit(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """The real `python -m vitkit` in a subprocess, on this worktree's sources."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vitkit", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip


def help_text(command: str, capsys) -> str:
    """`vitkit COMMAND --help` as one line (argparse wraps at the terminal width: words split at hyphens)."""
    os.environ["COLUMNS"] = "10000"
    try:
        with pytest.raises(SystemExit):
            main([command, "--help"])
    finally:
        del os.environ["COLUMNS"]
    return " ".join(capsys.readouterr().out.split())


def test_version_option_prints_the_package_version():
    done = run_vitkit("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"vitkit {vitkit.__version__}"


def test_every_train_option_has_its_field_description_and_the_registries_choices(capsys):
    text = help_text("train", capsys)
    for name in ("data", "lr", "model_args", "warmup_fraction", "eval_every"):
        assert field_help(name)[0] in text, name
    for registry in (sorted(DATASETS), OPTIMIZERS, SCHEDULES, PRECISIONS, TRAIN_MODES):
        assert "|".join(registry) in text
    assert "default adamw" in text and "default 0.002" in text and "default 6" in text


def test_finetune_help_shows_the_finetuning_recipe_defaults_not_trains(capsys):
    text = help_text("finetune", capsys)
    assert "default sgd" in text and "default 0.01" in text and "(fractions allowed); default 3 " in text
    assert "default adamw" not in text and "default 0.002" not in text


def test_an_option_outside_its_registry_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--optimizer", "lion"])
    assert e.value.code == 2 and "invalid choice: 'lion'" in capsys.readouterr().err


def test_models_lists_every_variant_and_marks_those_a_resolution_does_not_fit():
    done = run_vitkit("models", "--image-size", "384")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[3:] if line.startswith(("ViT", "R"))}
    assert set(rows) == set(vitkit.list_models())
    assert "nearest 378 or 392" in rows["ViT-B/14"] and "86,859,496" in rows["ViT-B/16"]


def test_finetune_without_a_checkpoint_is_refused(capsys, tmp_path):
    assert main(["finetune", "--data", "shapes", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "finetune needs --checkpoint" in err and "vitkit train" in err
    assert not (tmp_path / "run").exists()


def test_resume_refuses_by_name_the_options_that_would_change_the_run():
    saved = TrainConfig()
    with pytest.raises(ValueError, match=r"lr, optimizer cannot change"):
        from vitkit.recipes import resume_changes

        resume_changes(saved, {"epochs": 3, "lr": 5.0, "optimizer": "sgd"})
