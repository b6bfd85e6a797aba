"""Hugging Face ViT directories: random HF models saved natively load with identical outputs and labels."""

import json

import pytest
import torch
from transformers import ViTConfig as HFConfig
from transformers import ViTForImageClassification, ViTModel

import vitkit
from helpers import perturbed, tiny
from vitkit import VisionTransformer, ViTConfig

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    image_size=32,
    patch_size=8,
    num_labels=4,
)
CASES = {
    "token_labels": dict(id2label={0: "ant", 1: "bee", 2: "cat", 3: "dog"}, label2id={}),
    "wider_tanh_gelu": dict(hidden_size=48, num_attention_heads=3, hidden_act="gelu_pytorch_tanh"),
    "non_square_no_qkv_bias": dict(image_size=(32, 48), qkv_bias=False, layer_norm_eps=1e-6),
    "no_labels": dict(num_labels=0),
}


def image(config) -> torch.Tensor:
    h, w = config.image_size
    return torch.randn(2, config.in_chans, h, w)


def assert_loads_with_their_logits(directory, theirs: torch.nn.Module) -> None:
    """vitkit.load_checkpoint(directory) gives the HF model's logits to 1e-5."""
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            vitkit.load_checkpoint(directory)(x), theirs(pixel_values=x).logits, atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("case", CASES)
def test_random_hf_model_loads_with_the_same_outputs(tmp_path, case):
    hf_config = HFConfig(**TINY | CASES[case])
    theirs = perturbed(ViTForImageClassification(hf_config))
    theirs.save_pretrained(tmp_path)
    ours = vitkit.load_checkpoint(tmp_path)
    x = image(ours.config)
    with torch.no_grad():
        out = theirs(pixel_values=x, output_hidden_states=True)
        torch.testing.assert_close(ours(x), out.logits, atol=1e-5, rtol=0)
        encoded = theirs.vit.layernorm(out.hidden_states[-1])
        torch.testing.assert_close(ours.forward_features(x), encoded, atol=1e-5, rtol=0)
    assert ours.config.layer_norm_eps == hf_config.layer_norm_eps and ours.config.qkv_bias == hf_config.qkv_bias
    assert ours.class_names == (["ant", "bee", "cat", "dog"] if case == "token_labels" else None)


def test_hf_pytorch_model_bin_directory_loads(tmp_path):
    theirs = perturbed(ViTForImageClassification(HFConfig(**TINY)))
    theirs.save_pretrained(tmp_path)  # the on-disk names, which transformers 5 renames in memory
    weights = vitkit.files.read_safetensors(tmp_path / "model.safetensors")[0]
    (tmp_path / "model.safetensors").unlink()
    torch.save(weights, tmp_path / "pytorch_model.bin")
    assert_loads_with_their_logits(tmp_path, theirs)


def test_hf_sharded_safetensors_directory_loads(tmp_path):
    theirs = perturbed(ViTForImageClassification(HFConfig(**TINY)))
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_loads_with_their_logits(tmp_path, theirs)


def test_hf_vit_model_pooler_is_the_pre_logits_layer(tmp_path):
    theirs = perturbed(ViTModel(HFConfig(**TINY)))
    theirs.save_pretrained(tmp_path)
    ours = vitkit.load_checkpoint(tmp_path)
    assert ours.config.num_classes == 0 and ours.config.representation_size == 32
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(pixel_values=x).pooler_output, atol=1e-5, rtol=0)


def test_hf_export_loads_in_transformers_with_the_same_outputs_and_labels(tmp_path):
    config = ViTConfig(
        image_size=(32, 48),
        patch_size=8,
        hidden_size=48,
        num_layers=2,
        num_heads=3,
        mlp_dim=96,
        num_classes=3,
        act="gelu_tanh",
        layer_norm_eps=1e-12,
        qkv_bias=False,
    )
    ours = perturbed(VisionTransformer(config))
    ours.class_names = ["ant", "bee", "cat"]
    vitkit.export(ours, tmp_path / "hf", format="hf")
    theirs, info = ViTForImageClassification.from_pretrained(
        tmp_path / "hf", local_files_only=True, output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    theirs.eval()
    x = image(config)
    with torch.no_grad():
        torch.testing.assert_close(theirs(pixel_values=x).logits, ours(x), atol=1e-5, rtol=0)
    assert theirs.config.id2label == {0: "ant", 1: "bee", 2: "cat"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["ViTForImageClassification"]


@pytest.mark.parametrize("headless", [False, True])
def test_vitkit_to_hf_to_vitkit_is_bit_exact(tmp_path, headless):
    changes = dict(num_classes=0, representation_size=32) if headless else dict(num_classes=3, dropout_rate=0.1)
    model = perturbed(tiny(num_heads=2, **changes))
    model.class_names = None if headless else ["ant", "bee", "cat"]
    vitkit.export(model, tmp_path / "hf", format="hf")
    loaded = vitkit.load_checkpoint(tmp_path / "hf")
    assert loaded.config == model.config and loaded.class_names == model.class_names
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_hf_export_refuses_what_hf_vit_cannot_hold(tmp_path):
    for changes, message in [
        (dict(classifier="gap"), "class token"),
        (dict(representation_size=16), "no pre-logits layer"),
        (dict(posemb="sincos2d"), "posemb='sincos2d'"),
    ]:
        with pytest.raises(ValueError, match=message):
            vitkit.export(tiny(num_layers=1, **changes), tmp_path / "hf", format="hf")


@pytest.mark.slow
def test_hf_export_works_in_the_image_classification_pipeline_with_vitkits_scores(tmp_path):
    """`pipeline("image-classification")` on an exported directory: its preprocessor_config.json reproduces
    vitkit's preprocessing (bilinear resize, [-1, 1]), so the scores on a photograph match `vitkit.predict`
    to 1e-2: transformers resizes the 8-bit image with PIL and rounds it to 8 bits, vitkit resizes in float, so
    their inputs differ by under one grey level (checked), which this random model amplifies to ~3e-3."""
    from PIL import Image
    from skimage.data import chelsea
    from transformers import AutoImageProcessor, pipeline

    from vitkit.data.datasets import to_input
    from vitkit.data.images import read_image

    torch.manual_seed(0)
    model = vitkit.create_model(
        "ViT-Ti/8", image_size=32, num_classes=5, hidden_size=32, num_layers=2, mlp_dim=64, num_heads=2
    )
    torch.nn.init.normal_(model.head.weight, std=0.3)
    model.class_names = ["cat", "dog", "fox", "owl", "yak"]
    vitkit.export(model, tmp_path / "hf", format="hf")
    Image.fromarray(chelsea()).save(tmp_path / "cat.png")
    # An RGBA image whose transparent half hides colour: dropping the alpha channel and compositing over white
    # give inputs far apart, and the pipeline's loader and vitkit agree on the one rule, stated in the config.
    rgba = Image.fromarray(chelsea()).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    rgba.save(tmp_path / "cut-out.png")
    written = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert written["alpha"] == "drop" and written["do_convert_rgb"] is False

    processor = AutoImageProcessor.from_pretrained(tmp_path / "hf")
    pixels = processor(Image.open(tmp_path / "cat.png"), return_tensors="pt")["pixel_values"]
    expected = to_input(read_image(tmp_path / "cat.png"), (32, 32))
    assert pixels.shape == expected.shape and (pixels - expected).abs().max() < 1 / 127.5
    theirs = pipeline("image-classification", model=str(tmp_path / "hf"))(str(tmp_path / "cat.png"), top_k=5)
    ours = dict(vitkit.predict(model, [tmp_path / "cat.png"], k=5)[0])
    assert {r["label"] for r in theirs} == set(model.class_names)
    assert max(ours.values()) - min(ours.values()) > 0.05  # the classes are told apart, so the check means something
    for r in theirs:
        assert r["score"] == pytest.approx(ours[r["label"]], abs=1e-2), r
    theirs = pipeline("image-classification", model=str(tmp_path / "hf"))(str(tmp_path / "cut-out.png"), top_k=5)
    ours = dict(vitkit.predict(model, [tmp_path / "cut-out.png"], k=5)[0])
    for r in theirs:
        assert r["score"] == pytest.approx(ours[r["label"]], abs=1e-2), r


IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def test_an_image_processors_normalization_is_the_models_for_predict_and_export(tmp_path):
    """A classifier saved by transformers with an image processor that normalises with ImageNet's mean and std:
    vitkit reads them, `vitkit.predict` matches `pipeline("image-classification")` on a photograph at the model's
    size to 1e-5, and an export to Hugging Face writes them again."""
    from PIL import Image
    from skimage.data import chelsea
    from transformers import ViTImageProcessor, pipeline

    config = HFConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, num_labels=3, id2label={0: "cat", 1: "dog", 2: "emu"})  # fmt: skip
    theirs = perturbed(ViTForImageClassification(config))
    theirs.save_pretrained(tmp_path / "hf")
    processor = ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=IMAGENET["mean"],
                                  image_std=IMAGENET["std"])  # fmt: skip
    processor.save_pretrained(tmp_path / "hf")
    ours = vitkit.load_checkpoint(tmp_path / "hf")
    assert ours.normalization == IMAGENET
    photo = tmp_path / "cat.png"
    Image.fromarray(chelsea()).resize((32, 32), Image.BILINEAR).save(photo)
    expected = {r["label"]: r["score"] for r in pipeline("image-classification", model=str(tmp_path / "hf"))(
        str(photo), top_k=3)}  # fmt: skip
    scores = dict(vitkit.predict(ours, [photo], k=3)[0])
    assert max(scores.values()) - min(scores.values()) > 0.01  # the classes are told apart
    for name, p in expected.items():
        assert scores[name] == pytest.approx(p, abs=1e-5), name
    vitkit.export(ours, tmp_path / "back", format="hf")
    written = json.loads((tmp_path / "back" / "preprocessor_config.json").read_text())
    assert (written["image_mean"], written["image_std"]) == (IMAGENET["mean"], IMAGENET["std"])


def test_an_image_processor_with_a_zero_std_is_refused_naming_it(tmp_path):
    perturbed(ViTModel(HFConfig(**TINY))).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.5] * 3, "image_std": [0] * 3})
    )
    with pytest.raises(vitkit.CheckpointError, match="preprocessor_config.json.*std .* must be finite and positive"):
        vitkit.load_checkpoint(tmp_path / "hf")
