"""ONNX export: the graph computes vitkit's logits in ONNX Runtime (to 1e-5 relative) and OpenVINO (1e-4, fp32) at
a batch size other than the traced one, carries the config, class names and preprocessing in its metadata, loads
back to the same model, and what cannot be exported is refused before anything is written."""

import json

import numpy as np
import pytest
import torch

import vitkit
from helpers import perturbed, tiny
from vitkit.cli.parser import main
from vitkit.formats import onnx as onnx_format
from vitkit.speed.openvino_copy import openvino_core

onnx = pytest.importorskip("onnx", reason="ONNX export needs the optional dependency onnx (dev extra)")
pytest.importorskip("onnxscript", reason="ONNX export needs the optional dependency onnxscript (dev extra)")
ort = pytest.importorskip("onnxruntime", reason="the export is checked with the optional onnxruntime (dev extra)")

BATCH = 3  # the exporter traces at batch 2: every check runs another size


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def onnxruntime_logits(path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": x.numpy()})[0]


def openvino_logits(path, x: torch.Tensor) -> np.ndarray:
    pytest.importorskip("openvino", reason="the OpenVINO check needs the optional openvino (dev extra)")
    compiled = openvino_core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled(x.numpy())[0]


def assert_runtimes_match(model: vitkit.VisionTransformer, path) -> None:
    x = torch.randn(BATCH, model.config.in_chans, *model.config.image_size)
    with torch.no_grad():
        logits = model(x).numpy()
    assert relative_error(onnxruntime_logits(path, x), logits) <= 1e-5
    assert relative_error(openvino_logits(path, x), logits) <= 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny perturbed model with class names, exported with the format inferred from the suffix."""
    torch.manual_seed(1)
    model = perturbed(tiny())
    model.class_names = ["cat", "dog", "fish", "bird", "frog"]
    model.trained_on = {"data": "shapes", "image_size": [32, 32]}
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    vitkit.export(model, path)
    return model, path


@pytest.mark.slow
def test_export_inferred_from_suffix_matches_both_runtimes_at_another_batch(exported):
    model, path = exported
    assert vitkit.formats.detect_format(path) == "onnx"
    assert_runtimes_match(model, path)
    x = torch.randn(1, 3, 32, 32)  # and at batch 1
    with torch.no_grad():
        assert relative_error(onnxruntime_logits(path, x), model(x).numpy()) <= 1e-5


@pytest.mark.slow
def test_metadata_holds_config_class_names_and_preprocessing(exported):
    model, path = exported
    graph = onnx.load(str(path))
    metadata = {p.key: p.value for p in graph.metadata_props}
    assert set(metadata) == set(onnx_format.METADATA)
    assert vitkit.ViTConfig.from_dict(json.loads(metadata["vitkit_config"])) == model.config
    assert json.loads(metadata["class_names"]) == model.class_names
    assert json.loads(metadata["image_size"]) == [32, 32]
    assert (json.loads(metadata["mean"]), json.loads(metadata["std"])) == ([0.5] * 3, [0.5] * 3)
    assert metadata["color_mode"] == "RGB" and metadata["resize"].startswith("bilinear")
    assert metadata["alpha"] == "drop"  # the docs' snippet: Image.open(path).convert(color_mode), as vitkit reads
    # The recorded preprocessing turns pixels into the model's input exactly as vitkit's own does.
    pixels = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    mean, std = torch.tensor(json.loads(metadata["mean"])), torch.tensor(json.loads(metadata["std"]))
    recorded = (pixels.float() * float(metadata["rescale_factor"]) - mean[:, None, None]) / std[:, None, None]
    torch.testing.assert_close(recorded, vitkit.data.datasets.to_input(pixels), rtol=0, atol=1e-6)
    dims = graph.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, 32, 32]  # the batch axis is symbolic
    assert [o.name for o in graph.graph.output] == ["logits"]
    # onnxruntime users read the same metadata
    custom = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    assert json.loads(custom["class_names"]) == model.class_names


@pytest.mark.slow
def test_round_trip_loads_the_same_model(exported):
    model, path = exported
    back = vitkit.load_checkpoint(path)
    assert back.config == model.config
    assert (back.class_names, back.trained_on) == (model.class_names, model.trained_on)
    x = torch.randn(BATCH, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [dict(posemb="learn2d"), dict(posemb="relative"), dict(posemb="sincos2d"), dict(posemb="none"),
     dict(classifier="gap"), dict(representation_size=16, act="gelu_tanh", layer_scale_init=0.5)],
    ids=["learn2d", "relative", "sincos2d", "none", "gap", "pre-logits-tanh-layerscale"],
)  # fmt: skip
def test_every_posemb_and_gap_export_with_parity_and_round_trip(tmp_path, changes):
    model = perturbed(tiny(**changes))
    vitkit.export(model, tmp_path / "m.onnx", format="onnx")
    assert_runtimes_match(model, tmp_path / "m.onnx")
    x = torch.randn(BATCH, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vitkit.load_checkpoint(tmp_path / "m.onnx")(x), model(x))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ViT-Ti/16", "ViT-S/16", "ViT-B/16", "R50+ViT-B/16"])
def test_paper_variants_export_with_parity(tmp_path, name):
    model = perturbed(vitkit.create_model(name, image_size=64, num_classes=10))
    with torch.no_grad():  # perturbed's 0.1 would saturate a 12-layer model: keep it in its working range
        for p, fresh in zip(model.parameters(), vitkit.create_model(name, image_size=64, num_classes=10).parameters()):
            p.copy_(fresh + 0.2 * (p - fresh))
    vitkit.export(model, tmp_path / "m.onnx")
    assert_runtimes_match(model, tmp_path / "m.onnx")


@pytest.mark.slow
def test_headless_model_exports_features(tmp_path):
    model = perturbed(tiny(num_classes=0))
    vitkit.export(model, tmp_path / "m.onnx")
    assert [o.name for o in onnx.load(str(tmp_path / "m.onnx")).graph.output] == ["features"]
    assert_runtimes_match(model, tmp_path / "m.onnx")


class Doubled(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def test_what_cannot_be_exported_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError, match="torch.bfloat16 weights: export it in fp32"):
        vitkit.export(tiny().to(torch.bfloat16), tmp_path / "m.onnx")
    changed = tiny()
    changed.head = Doubled(changed.head)
    with pytest.raises(ValueError, match="Doubled modules.*vitkit.optimize copy"):
        vitkit.export(changed, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="m.safetensors: ONNX export writes one .onnx file"):
        vitkit.export(tiny(), tmp_path / "m.safetensors", format="onnx")
    with pytest.raises(ValueError, match="Vision Transformers only"):
        vitkit.export(vitkit.create_model("BiT-R26", num_classes=10, image_size=32), tmp_path / "m.onnx")
    assert not list(tmp_path.iterdir())


def test_a_model_too_large_for_one_onnx_file_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(onnx_format, "MAX_BYTES", 1000)
    with pytest.raises(ValueError, match="more than the 2 GiB one ONNX file can hold"):
        vitkit.export(tiny(), tmp_path / "m.onnx")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_convert_cli_writes_onnx(tmp_path, capsys):
    model = perturbed(tiny())
    vitkit.export(model, tmp_path / "m.safetensors")
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m.onnx"), "--to", "onnx"]) == 0
    assert "(onnx)" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "by-suffix.onnx")]) == 0
    assert "(onnx)" in capsys.readouterr().out  # --to left out: the suffix names the format
    x = torch.randn(BATCH, 3, 32, 32)
    with torch.no_grad():
        for name in ("m.onnx", "by-suffix.onnx"):
            assert relative_error(onnxruntime_logits(tmp_path / name, x), model(x).numpy()) <= 1e-5


@pytest.mark.slow
def test_metadata_that_does_not_match_the_graph_is_refused_naming_the_file(exported, tmp_path):
    _, path = exported
    for key, value, message in [
        ("vitkit_config", "{not json", "not valid JSON"),
        ("vitkit_config", json.dumps({**tiny().config.to_dict(), "mlp_dim": 60}), "blocks.0.mlp.fc1"),
    ]:
        graph = onnx.load(str(path))
        next(p for p in graph.metadata_props if p.key == key).value = value
        onnx.save(graph, tmp_path / "lying.onnx")
        with pytest.raises(vitkit.CheckpointError, match=message) as error:
            vitkit.load_checkpoint(tmp_path / "lying.onnx")
        assert "lying.onnx" in str(error.value)
