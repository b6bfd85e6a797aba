"""The everyday command line: help from TrainConfig's field docs, --version, models, refusals (issue 13)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vitkit
from helpers import subprocess_env
from vitkit.cli.parser import main
from vitkit.data.datasets import DATASETS
from vitkit.training.optimization import OPTIMIZERS, SCHEDULES, TRAINABLE
from vitkit.training.recipes import PRECISIONS, TrainConfig, field_help


@pytest.fixture(autouse=True)
def _threads_restored():
    """`--threads` sets torch's thread count for the rest of the process: give the next test its own back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_vitkit(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """The real `python -m vitkit` in a subprocess, on this worktree's sources."""
    env = subprocess_env()
    return subprocess.run(
        [sys.executable, "-m", "vitkit", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def help_text(command: str, capsys) -> str:
    """`vitkit COMMAND --help` as one line (argparse wraps at the terminal width: words split at hyphens)."""
    os.environ["COLUMNS"] = "10000"
    try:
        with pytest.raises(SystemExit):
            main([command, "--help"])
    finally:
        del os.environ["COLUMNS"]
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_version_option_prints_the_package_version():
    done = run_vitkit("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"vitkit {vitkit.__version__}"


def test_every_train_option_has_its_field_description_and_the_registries_choices(capsys):
    text = help_text("train", capsys)
    for name in ("data", "lr", "model_args", "warmup_fraction", "eval_every"):
        assert field_help(name)[0] in text, name
    for registry in (sorted(DATASETS), tuple(OPTIMIZERS), tuple(SCHEDULES), PRECISIONS, TRAINABLE):
        assert "|".join(registry) in text
    defaults = TrainConfig()  # the main job's: each option shows its field's default
    assert f"default {defaults.optimizer}" in text and f"default {defaults.lr:g}" in text
    assert f"default {defaults.epochs:g}" in text and "default 0.9 0.98" in text


def test_model_args_take_key_value_pairs_with_lists_or_json():
    from vitkit.cli.parser import build_parser

    def parsed(text: str) -> dict:
        return build_parser().parse_args(["train", "--model-args", text]).model_args

    assert parsed("units=[1,1],hidden_size=64,act=gelu") == {"units": [1, 1], "hidden_size": 64, "act": "gelu"}
    assert parsed('{"units": [1, 1]}') == {"units": [1, 1]} and parsed("patch_size=[7,7]") == {"patch_size": [7, 7]}


def test_finetune_help_shows_the_finetuning_recipe_defaults_not_trains(capsys):
    text = help_text("finetune", capsys)
    assert "default sgd" in text and "default 0.01" in text and "overrides --epochs; default 500" in text
    assert "default adamw" not in text and "default 0.002" not in text


def test_an_option_outside_its_registry_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--optimizer", "lion"])
    assert e.value.code == 2 and "invalid choice: 'lion'" in capsys.readouterr().err


@pytest.mark.slow
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
    from vitkit.training.recipes import resume_changes

    saved = TrainConfig(steps=10)
    with pytest.raises(ValueError, match=r"lr, optimizer cannot change"):
        resume_changes(saved, {"epochs": 3, "lr": 5.0, "optimizer": "sgd"})
    same = resume_changes(saved, {"lr": saved.lr, "log_every": 5})  # repeating a saved value is no change
    assert same.log_every == 5 and same.steps == 10
    longer = resume_changes(saved, {"epochs": 3})  # a run that counted steps now counts epochs
    assert longer.epochs == 3 and longer.steps is None


# --- eval, predict, inspect ----------------------------------------------------------------------------------


@pytest.fixture
def gray_model(tmp_path) -> Path:
    """A tiny untrained 16 px model saved as if trained on grayscale 16 px images of six classes."""
    model = vitkit.create_model(
        "ViT-Ti/8", image_size=16, num_classes=6, hidden_size=16, num_layers=1, mlp_dim=32, num_heads=2
    )
    model.class_names = [f"class{i}" for i in range(6)]
    model.trained_on = {"data": "fashion-mnist", "grayscale": True, "image_size": [16, 16]}
    vitkit.export(model, tmp_path / "gray.safetensors")
    return tmp_path / "gray.safetensors"


def save_png(path: Path, array) -> Path:
    from PIL import Image

    Image.fromarray(array).save(path)
    return path


def test_predict_notes_colour_and_far_off_sizes_from_what_the_checkpoint_records(gray_model, tmp_path, capsys):
    import numpy as np
    from skimage.data import chelsea  # a 451x300 colour photograph of a cat

    photos = tmp_path / "photos"
    photos.mkdir()
    save_png(photos / "cat.png", chelsea())
    save_png(photos / "gray16.png", np.full((16, 16), 120, np.uint8))
    assert vitkit.load_checkpoint(gray_model).trained_on["grayscale"] is True  # recorded in the file
    assert main(["predict", "--checkpoint", str(gray_model), "--top-k", "2", "--threads", "1", str(photos)]) == 0
    out = capsys.readouterr().out
    cat, gray = out.split(str(photos / "gray16.png"))  # the directory's images, sorted
    assert str(photos / "cat.png") in cat and cat.count("%") == 2
    assert "colour image, but the model was trained on grayscale images (fashion-mnist)" in cat
    assert "451x300 px, far from the 16x16 px images" in cat
    assert "note:" not in gray


def test_predict_top_k_zero_and_an_empty_directory_are_clear_errors(gray_model, tmp_path, capsys):
    import numpy as np

    image = save_png(tmp_path / "a.png", np.zeros((16, 16), "uint8"))
    assert main(["predict", "--checkpoint", str(gray_model), "--top-k", "0", str(image)]) == 2
    assert "k=0: ask for at least the top class" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["predict", "--checkpoint", str(gray_model), str(tmp_path / "empty")]) == 2
    assert "a directory with no images" in capsys.readouterr().err


def test_predict_with_a_backbone_says_it_has_no_classes_to_predict(tmp_path, capsys):
    """A model without a head (a pre-trained backbone, num_classes=0) gives features: predict says so and what to do
    instead, in the library and the command, rather than failing on a class index."""
    import numpy as np

    from vitkit.training.evaluation import predict

    backbone = vitkit.create_model("ViT-Ti/16", image_size=32, num_layers=1, num_classes=0)
    vitkit.export(backbone, tmp_path / "backbone.safetensors")
    image = save_png(tmp_path / "a.png", np.zeros((16, 16, 3), "uint8"))
    with pytest.raises(ValueError, match="no classification head"):
        predict(backbone, [image])
    assert main(["predict", "--checkpoint", str(tmp_path / "backbone.safetensors"), str(image)]) == 2
    err = capsys.readouterr().err
    assert "no classification head (num_classes=0)" in err and "vitkit finetune" in err and "Traceback" not in err


def test_predict_runs_the_model_without_autograd(tmp_path):
    import numpy as np
    import torch

    from vitkit.training.evaluation import predict

    model = vitkit.create_model("ViT-Ti/16", image_size=32, num_layers=1, num_classes=3)
    seen = []
    model.register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    image = save_png(tmp_path / "a.png", np.zeros((16, 16, 3), "uint8"))
    assert len(predict(model, [image, image])[0]) == 3 and seen == [False, False]


def test_eval_batch_size_zero_is_a_clear_error(gray_model, capsys):
    assert main(["eval", "--checkpoint", str(gray_model), "--data", "shapes", "--batch-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "batch_size=0: evaluate at least one image per batch" in err and "range()" not in err


def test_eval_matches_a_folders_classes_to_the_models_by_name_and_warns_where_they_differ(tmp_path, capsys):
    import numpy as np

    model = vitkit.create_model("ViT-Ti/8", image_size=16, num_classes=3, hidden_size=16, num_layers=1, mlp_dim=32,
                                num_heads=2)  # fmt: skip
    model.class_names = ["coat", "bag", "shirt"]  # a built-in dataset's order, not sorted
    vitkit.export(model, tmp_path / "m.safetensors")
    for name, count in (("bag", 1), ("coat", 2), ("shirt", 3)):  # sorted, as a folder's classes are
        for split in ("train", "val"):
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(count):
                save_png(tmp_path / split / name / f"{i}.png", np.full((16, 16), 40 * i, np.uint8))
    args = ["eval", "--checkpoint", str(tmp_path / "m.safetensors"), "--data", str(tmp_path), "--threads", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "classes matched to" in out and "by name (they are in another order)" in out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.strip().endswith(("1", "2", "3"))}
    assert (rows["coat"], rows["bag"], rows["shirt"]) == ("2", "1", "3")  # each class counts its own images
    (tmp_path / "val" / "shirt").rename(tmp_path / "val" / "shirts")
    (tmp_path / "train" / "shirt").rename(tmp_path / "train" / "shirts")
    with pytest.warns(UserWarning, match=r"classes \(bag, coat, shirts\) are not .*'s \(coat, bag, shirt\): labels"):
        assert main(args) == 0


@pytest.mark.slow
def test_inspect_counts_the_occlusion_passes_before_it_starts_and_stride_cuts_them(gray_model, tmp_path, capsys):
    from vitkit.analysis.figures import occlusion_windows

    assert main(["inspect", "--checkpoint", str(gray_model), "--samples", "2", "--out", str(tmp_path / "r"),
                 "--threads", "1"]) == 0  # fmt: skip
    first = capsys.readouterr().out.splitlines()[0]
    # 16 px image, 8 px window, default stride 4: 3 x 3 windows; stride 8: 2 x 2.
    assert len(occlusion_windows((16, 16), 8, 4)) == 9 and len(occlusion_windows((16, 16), 8, 8)) == 4
    assert first == (
        "occlusion: 2 image(s) x 9 windows = 18 forward passes (8 px window, --stride 4); --stride 8 takes 8"
    )
    assert main(["inspect", "--checkpoint", str(gray_model), "--samples", "1", "--out", str(tmp_path / "s"),
                 "--stride", "8"]) == 0  # fmt: skip
    assert capsys.readouterr().out.startswith("occlusion: 1 image(s) x 4 windows = 4 forward passes")
    page = (tmp_path / "s" / "report.html").read_text()
    assert "trained on grayscale images</b> (given as three equal channels), so the colours of these filters" in page


def on_a_terminal(*args: str) -> bytes:
    """What the real `python -m vitkit ARGS` writes under a pseudo-terminal 100 columns wide, as a user sees it."""
    import fcntl
    import pty
    import struct
    import termios

    # The child is started by subprocess (no Python code runs between fork and exec), not pty.fork: a fork of this
    # process, whose libraries run threads of their own, must exec at once.
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    child = subprocess.Popen(
        [sys.executable, "-m", "vitkit", *args], stdin=terminal, stdout=terminal, stderr=terminal, env=subprocess_env()
    )
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the terminal is closed: the child has exited
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert child.wait() == 0, seen.decode(errors="replace")[-2000:]
    return seen


@pytest.mark.slow
def test_progress_bars_show_on_a_terminal_and_stay_out_of_logs(gray_model, tmp_path):
    """`eval`, `eval --fewshot` and `data pack` run for real: through a pipe (a log) no bar; under a
    pseudo-terminal a bar saying what it does."""
    from helpers import write_image_folder

    args = ["eval", "--checkpoint", str(gray_model), "--data", "shapes", "--batch-size", "100"]
    logged = run_vitkit(*args)
    assert logged.returncode == 0, logged.stderr
    assert "evaluating" not in logged.stderr and "top-1" in logged.stdout
    seen = on_a_terminal(*args)
    assert b"evaluating: 100%" in seen and b"img" in seen

    fewshot = [*args, "--fewshot", "1", "--draws", "1"]
    logged = run_vitkit(*fewshot)
    assert logged.returncode == 0, logged.stderr
    assert "features" not in logged.stderr and "1-shot" in logged.stdout
    seen = on_a_terminal(*fewshot)
    assert b"few-shot train features: 100%" in seen and b"few-shot test features: 100%" in seen

    root = write_image_folder(tmp_path / "photos", per_class=4)
    logged = run_vitkit("data", "pack", str(root), str(tmp_path / "logged"), "--samples-per-shard", "3")
    assert logged.returncode == 0, logged.stderr
    assert "packing" not in logged.stderr and "train: 9 images in 3 shards" in logged.stdout
    seen = on_a_terminal("data", "pack", str(root), str(tmp_path / "seen"), "--samples-per-shard", "3")
    assert b"packing train: 100%" in seen and b"packing val: 100%" in seen


# --- data pack -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_data_pack_writes_shards_that_read_back_train_and_evaluate(tmp_path, capsys):
    """`vitkit data pack` run for real on a small image folder; the shards hold the folder's split pixel for pixel,
    and `train` (one step) and `eval` run on them; a resume with other workers is refused on the command line."""
    from collections import Counter

    from helpers import fingerprint, write_image_folder
    from vitkit.data.image_folder import ImageFolder
    from vitkit.data.shards import ShardedDataset

    root, out, run = write_image_folder(tmp_path / "photos", per_class=4), tmp_path / "packed", tmp_path / "run"
    done = run_vitkit("data", "pack", str(root), str(out), "--samples-per-shard", "3")
    assert done.returncode == 0, done.stderr
    assert "train: 9 images in 3 shards" in done.stdout and "val: 3 images in 1 shards" in done.stdout
    assert f"--data shards --data-dir {out}" in done.stdout
    for split in ("train", "test"):
        packed, folder = ShardedDataset(split, out), ImageFolder(split, root, val_fraction=0.1)
        assert packed.classes == folder.classes == ["cat", "dog", "owl"]
        assert Counter(fingerprint(*packed[i]) for i in range(len(packed))) == Counter(
            fingerprint(*folder[i]) for i in range(len(folder))
        )
    data = ["--data", "shards", "--data-dir", str(out)]
    model = [
        "--model",
        "ViT-Ti/8",
        "--model-args",
        '{"hidden_size": 16, "num_layers": 1, "mlp_dim": 32, "num_heads": 2}',
    ]
    train_args = [*data, *model, "--image-size", "16", "--batch-size", "3", "--steps", "1", "--threads", "1"]
    assert main(["train", *train_args, "--eval-every", "0", "--out-dir", str(run)]) == 0
    assert main(["eval", "--checkpoint", str(run / "model.safetensors"), *data]) == 0
    assert "(3 images)" in capsys.readouterr().out
    assert main(["train", "--resume", str(run), "--steps", "2", "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "saved with 1 process(es) and --workers 0" in err and "Resume it with 1 process(es)" in err


@pytest.mark.slow
def test_eval_and_predict_precision_int8_say_what_they_calibrated_on(gray_model, tmp_path, capsys):
    pytest.importorskip("torchao", reason="int8 needs the optional torchao (PT2E quantization)")
    import numpy as np

    args = ["eval", "--checkpoint", str(gray_model), "--data", "shapes", "--batch-size", "100", "--threads", "1"]
    import torch

    from vitkit.speed import openvino_copy

    in_openvino = openvino_copy.openvino_pays("fp32", torch.device("cpu")) and openvino_copy.nncf_available()
    what = "int8 (OpenVINO)" if in_openvino else "int8"  # which quantizer "auto" picks here
    assert main([*args, "--precision", "int8", "--calibration-images", "32"]) == 0
    out = capsys.readouterr().out
    assert f"{what}: activations calibrated on 32 images (shapes's train split" in out and "top-1" in out
    assert main([*args, "--precision", "int8", "--calibration-images", "32", "--runtime", "torch"]) == 0
    assert "int8: activations calibrated on 32 images" in capsys.readouterr().out  # PT2E, asked for by name
    image = save_png(tmp_path / "gray16.png", np.full((16, 16), 120, np.uint8))
    assert main(["predict", "--checkpoint", str(gray_model), "--precision", "int8", "--threads", "1", str(image)]) == 0
    out = capsys.readouterr().out
    assert "calibrated on 1 image (drawn from the images being predicted" in out and out.count("%") == 5
    (tmp_path / "more").mkdir()
    for n in range(4):
        save_png(tmp_path / "more" / f"{n}.png", np.full((16, 16), 40 * n, np.uint8))
    predict = ["predict", "--checkpoint", str(gray_model), "--precision", "int8", "--threads", "1", "--top-k", "1"]
    assert main([*predict, "--calibration-images", "2", str(tmp_path / "more")]) == 0
    out = capsys.readouterr().out  # a sample calibrates; every image is predicted
    assert "calibrated on 2 images (drawn from the images being predicted" in out and out.count("%") == 4
    assert main(["predict", "--checkpoint", str(gray_model), "--precision", "int8", "--no-optimize", str(image)]) == 2
    assert "drop --no-optimize" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_runtime_openvino_gives_the_torch_copys_fp32_accuracy_and_needs_the_optimized_copy(tmp_path, capsys):
    pytest.importorskip("openvino", reason="the OpenVINO copy needs the optional openvino (vitkit[openvino])")
    import re

    from helpers import perturbed

    model = perturbed(vitkit.create_model("ViT-Ti/8", image_size=16, num_classes=6, hidden_size=16, num_layers=1,
                                          mlp_dim=32, num_heads=2))  # fmt: skip
    vitkit.export(model, tmp_path / "m.safetensors")
    args = ["eval", "--checkpoint", str(tmp_path / "m.safetensors"), "--data", "shapes", "--batch-size", "100"]
    accuracy = []
    for runtime in ("torch", "openvino"):
        assert main([*args, "--runtime", runtime]) == 0
        accuracy.append([float(a) for a in re.findall(r"top-[15] +([0-9.]+)%", capsys.readouterr().out)])
    # fp32 logits to 1e-5 of their scale: the same answers, but for a near tie or two
    assert len(accuracy[0]) == 2 and accuracy[0] == pytest.approx(accuracy[1], abs=1.0)
    assert main([*args, "--runtime", "openvino", "--no-optimize"]) == 2
    assert "--runtime openvino with --no-optimize" in capsys.readouterr().err


def test_runtime_auto_hands_over_to_openvino_only_for_work_that_pays_back_the_conversion():
    import argparse

    from vitkit.cli.commands import OPENVINO_MIN_FLOP, _runtime

    model = vitkit.create_model("ViT-S/16")
    enough = int(OPENVINO_MIN_FLOP // vitkit.flops(model.config)) + 1  # about 300 images of 224 px
    assert 200 < enough < 500
    auto = argparse.Namespace(runtime="auto")
    assert _runtime(auto, model, 1) == "torch" and _runtime(auto, model, enough) == "auto"
    assert _runtime(argparse.Namespace(runtime="openvino"), model, 1) == "openvino"  # asked for by name: kept
    assert _runtime(auto, vitkit.create_model("ViT-Ti/7", image_size=28, num_classes=10), 10_000) == "torch"
