"""Config and CLI: every invalid option value is one line on stderr naming the option and what is allowed, with
exit status 2, never a traceback; names suggest the closest; sizes suggest valid ones."""

import sys

import pytest
import torch

import vitkit
from vitkit.cli.parser import main


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own errors
        status = e.code
    err = capsys.readouterr().err
    return status, err


# One invalid value per kind of option, with what the one-line error must say.
TRAIN_CASES = [
    (["--model-args", "hidden_size=abc"], "hidden_size='abc' (a str) must be of type int"),
    (["--model-args", "num_layers=2.5"], "num_layers=2.5 (a float) must be of type int"),
    (["--threads", "-3"], "threads=-3 is invalid: allowed values are >= 0"),
    (["--workers", "-1"], "workers=-1 is invalid: allowed values are >= 0"),
    (["--log-every", "0"], "log_every=0 is invalid: allowed values are >= 1"),
    (["--eval-batch-size", "0"], "eval_batch_size=0 is invalid: allowed values are >= 1"),
    (
        ["--optimizer", "adam"],
        "argument --optimizer: invalid choice: 'adam' (choose from 'adamw', 'sgd'); did you mean 'adamw'?",
    ),
    (["--schedule", "step"], "argument --schedule: invalid choice: 'step' (choose from 'cosine', 'linear')"),
    (["--precision", "fp16"], "argument --precision: invalid choice: 'fp16' (choose from 'auto', 'fp32', 'bf16')"),
    (["--device", "tpu"], "device='tpu' is unknown: choose one of auto, cpu, cuda, cuda:N"),
    (["--nonfinite", "ignore"], "argument --nonfinite: invalid choice: 'ignore' (choose from 'stop', 'skip')"),
    (["--batch-size", "0"], "batch_size=0 must be a positive multiple of accumulation_steps=1"),
    (["--lr", "-1"], "lr=-1.0 must be > 0"),
    (["--label-smoothing", "1"], "label_smoothing=1.0 must be in [0, 1)"),
    (["--crop-scale", "0.5", "2"], "crop_scale=(0.5, 2.0) is invalid: two area fractions 0 < min <= max <= 1"),
    (["--betas", "0.9", "1.5"], "betas=(0.9, 1.5) is invalid: two values in [0, 1)"),
    (["--epochs", "many"], "argument --epochs: invalid float value: 'many'"),
    (["--flip", "maybe"], "argument --flip: 'maybe': use true or false"),
    (["--model", "ViT-B/1G"], "unknown model name 'ViT-B/1G'"),
    (["--model", "ViT-Bx/16"], "Did you mean 'ViT-B/16'"),
    (["--data", "fashion-mnits"], "unknown dataset 'fashion-mnits': Did you mean 'fashion-mnist'?"),
    (["--data", "fashion-mnits"], "or give the path of a folder of images (FOLDER/<class>/<image>"),
    (["--data", "./no-such-folder"], "data='./no-such-folder': no such folder. Give the path of a folder of images"),
    (
        ["--data", "shapes", "--model", "ViT-Ti/7", "--image-size", "30"],
        "image height 30 is not divisible by the patch stride 7 px: use a multiple of 7, e.g. 28 or 35",
    ),
]


@pytest.mark.parametrize("args, message", TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_invalid_train_option_is_one_line_naming_it_with_exit_status_2(tmp_path, capsys, args, message):
    status, err = run_cli(["train", "--out-dir", str(tmp_path / "run"), *args], capsys)
    assert status == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("model, closest", [("ViT-Ti/8x", "'ViT-Ti/8'"), ("ViT-Q/16", "'ViT-S/16'")])
def test_a_misspelt_train_model_is_refused_before_anything_is_printed_naming_the_closest(tmp_path, capsys, model,
                                                                                         closest):  # fmt: skip
    status = main(["train", "--data", "shapes", "--model", model, "--steps", "1", "--out-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert status == 2 and out == "", out  # not even the line of the defaults chosen for the data
    assert err.count("\n") == 1 and f"unknown model name {model!r}" in err and f"Did you mean {closest}" in err, err
    assert not (tmp_path / "run").exists()


@pytest.fixture
def checkpoint(tmp_path):
    model = vitkit.create_model(
        "ViT-Ti/4", image_size=16, hidden_size=8, num_layers=1, mlp_dim=8, num_heads=2, num_classes=2
    )
    vitkit.export(model, tmp_path / "m.safetensors")
    return str(tmp_path / "m.safetensors")


def test_convert_to_hf_onto_an_existing_file_and_inspect_out_onto_a_file_are_errors(tmp_path, capsys, checkpoint):
    existing = tmp_path / "existing.txt"
    existing.write_text("keep me\n")
    status, err = run_cli(["convert", checkpoint, str(existing), "--to", "hf"], capsys)
    assert (
        status == 2 and err.count("\n") == 1 and "existing.txt is a file, and the Hugging Face format is a dir" in err
    )
    (tmp_path / "dir.safetensors").mkdir()
    status, err = run_cli(["convert", checkpoint, str(tmp_path / "dir.safetensors"), "--to", "timm"], capsys)
    assert status == 2 and "is a directory, and the timm format is one file" in err
    status, err = run_cli(["convert", checkpoint, str(tmp_path / "model.pth"), "--to", "timm"], capsys)
    assert status == 2 and "timm export writes safetensors" in err and not (tmp_path / "model.pth").exists()
    # timm's hub layout (no suffix) is a directory, written again onto itself only with --overwrite
    assert run_cli(["convert", checkpoint, str(tmp_path / "hub"), "--to", "timm"], capsys)[0] == 0
    assert run_cli(["convert", checkpoint, str(tmp_path / "hub"), "--to", "timm"], capsys)[0] == 2
    assert run_cli(["convert", checkpoint, str(tmp_path / "hub"), "--to", "timm", "--overwrite"], capsys)[0] == 0
    assert {p.name for p in (tmp_path / "hub").iterdir()} == {"model.safetensors", "config.json"}
    status, err = run_cli(["inspect", "--checkpoint", checkpoint, "--out", str(existing)], capsys)
    assert status == 2 and err.count("\n") == 1 and "existing.txt is a file: the report is a folder" in err
    assert existing.read_text() == "keep me\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["convert", "CKPT", "out", "--to", "onnx2"], "argument --to: invalid choice: 'onnx2' (choose from"),
        (["eval", "--checkpoint", "CKPT", "--split", "val"], "argument --split: invalid choice: 'val' (choose from"),
        (["eval", "--checkpoint", "CKPT", "--data", "shape"], "unknown dataset 'shape': Did you mean 'shapes'?"),
        (["models", "--image-size", "0"], "image_size=0 is invalid: give a positive int"),
        (["predict", "--checkpoint", "CKPT", "no-such.png"], "no-such.png: no such image file"),
        (["eval", "--checkpoint", "missing.safetensors"], "missing.safetensors: no such checkpoint file"),
    ],
)
def test_invalid_values_of_other_commands_are_one_line_errors(capsys, checkpoint, argv, message):
    status, err = run_cli([checkpoint if a == "CKPT" else a for a in argv], capsys)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


@pytest.mark.parametrize("missing", ["onnx", "onnxscript"])
def test_a_missing_optional_package_is_one_line_naming_its_install(tmp_path, capsys, checkpoint, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # `import` of it then raises ImportError, installed or not
    status, err = run_cli(["convert", checkpoint, str(tmp_path / "m.onnx"), "--to", "onnx"], capsys)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "vitkit convert: error: ONNX export needs the onnx and onnxscript packages" in err
    assert "vitkit[onnx]" in err and not (tmp_path / "m.onnx").exists()


def test_overrides_that_change_a_checkpoints_architecture_name_the_fields(checkpoint):
    with pytest.raises(ValueError, match=r"change the architecture .*hidden_size 8 != 16, num_heads 2 != 4"):
        vitkit.load_checkpoint(checkpoint, hidden_size=16, num_heads=4)
    assert vitkit.load_checkpoint(checkpoint, drop_path_rate=0.1).config.drop_path_rate == 0.1


def test_errors_from_the_command_line_name_its_options_and_from_python_the_arguments(tmp_path, capsys, checkpoint):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    image = tmp_path / "a.png"
    image.write_bytes(b"")
    status, err = run_cli(["predict", "--checkpoint", str(notes), str(image)], capsys)
    assert status == 2 and err.count("\n") == 1 and "format=" not in err, err
    assert f"convert it first with `vitkit convert {notes} OUT.safetensors --format FORMAT --to vitkit`" in err
    status, err = run_cli(["convert", str(notes), str(tmp_path / "out.safetensors"), "--to", "vitkit"], capsys)
    assert status == 2 and "pass --format, one of vitkit, npz" in err, err
    with pytest.raises(ValueError, match="pass format= one of vitkit, npz"):
        vitkit.load_checkpoint(notes)

    status, err = run_cli(["train", "--model", "ViT-Bx/16", "--out-dir", str(tmp_path / "run")], capsys)
    assert status == 2 and err.rstrip().endswith("See `vitkit models`."), err
    with pytest.raises(ValueError, match=r"See vitkit\.list_models\(\)\.$"):
        vitkit.decode_variant("ViT-Bx/16")
    broken = vitkit.load_checkpoint(checkpoint)
    torch.nn.init.constant_(broken.head.bias, float("nan"))
    vitkit.export(broken, tmp_path / "nan.safetensors")
    status, err = run_cli(["predict", "--checkpoint", str(tmp_path / "nan.safetensors"), str(image)], capsys)
    assert status == 2 and "Pass --allow-nonfinite to load it anyway" in err, err
    assert run_cli(["convert", checkpoint, str(tmp_path / "kept"), "--to", "hf"], capsys)[0] == 0
    status, err = run_cli(["convert", checkpoint, str(tmp_path / "kept"), "--to", "hf"], capsys)
    assert status == 2 and "pass --overwrite to replace it" in err and "overwrite=True" not in err


def test_predict_with_no_readable_image_fails_naming_the_files(tmp_path, capsys, checkpoint):
    for name in ("a.png", "b.jpg"):
        (tmp_path / name).write_text("not an image\n")
    status, err = run_cli(["predict", "--checkpoint", checkpoint, str(tmp_path / "a.png"), str(tmp_path / "b.jpg")],
                          capsys)  # fmt: skip
    assert status == 2, err
    assert f"nothing predicted: none of the 2 file(s) is a readable image ({tmp_path / 'a.png'}, " in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_predict_into_a_closed_pipe_ends_quietly(tmp_path, checkpoint):
    import subprocess
    import sys

    import numpy as np
    from PIL import Image

    from helpers import subprocess_env

    for i in range(3):
        Image.fromarray(np.full((16, 16, 3), 60 * i, np.uint8)).save(tmp_path / f"{i}.png")
    child = subprocess.Popen([sys.executable, "-m", "vitkit", "predict", "--checkpoint", checkpoint, str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # as `| head -0` would: every line printed meets a closed pipe
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 1
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
def test_inspect_image_takes_a_folder_like_predict(tmp_path, capsys, checkpoint):
    import numpy as np
    from PIL import Image

    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(2):
        Image.fromarray(np.full((20, 24, 3), 90 * i, np.uint8)).save(folder / f"{i}.png")
    status, err = run_cli(["inspect", "--checkpoint", checkpoint, "--image", str(folder), "--out", str(tmp_path / "r")],
                          capsys)  # fmt: skip
    assert status == 0, err
    html = (tmp_path / "r" / "report.html").read_text()
    assert "0.png" in html and "1.png" in html
