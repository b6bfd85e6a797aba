"""timm VisionTransformer state dicts: random timm models saved natively load with identical outputs."""

import json
from functools import partial

import pytest
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

import vitkit
from helpers import perturbed
from vitkit import VisionTransformer, ViTConfig

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=1, mlp_ratio=2.0, num_classes=5)
CASES = {  # name: (timm arguments, file suffix, vitkit load arguments)
    "token": ({}, ".safetensors", {}),
    "wider_pth": (dict(embed_dim=128, num_heads=2), ".pth", {}),
    "heads_override": (dict(embed_dim=48, num_heads=3), ".safetensors", dict(num_heads=3)),
    "non_square_bin": (dict(img_size=(32, 48)), ".bin", dict(image_size=(32, 48))),
    "gap_no_qkv_bias": (dict(class_token=False, global_pool="avg", fc_norm=False, qkv_bias=False), ".safetensors", {}),
    "layer_scale": (dict(init_values=0.1), ".safetensors", {}),
}


def save_native(model: nn.Module, path):
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, path) if path.suffix == ".safetensors" else torch.save(state, path)


@pytest.mark.parametrize("case", CASES)
def test_random_timm_model_loads_with_the_same_outputs(tmp_path, case):
    args, suffix, load_args = CASES[case]
    theirs = perturbed(TimmViT(**TINY | args))
    save_native(theirs, tmp_path / f"timm{suffix}")
    ours = vitkit.load_checkpoint(tmp_path / f"timm{suffix}", **load_args)
    h, w = (args.get("img_size", 32),) * 2 if isinstance(args.get("img_size", 32), int) else args["img_size"]
    x = torch.randn(2, 3, h, w)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    assert ours.config.act == "gelu" and ours.config.layer_norm_eps == 1e-6


def test_timm_fc_norm_layout_is_refused_with_the_reason(tmp_path):
    save_native(TimmViT(**TINY | dict(class_token=False, global_pool="avg")), tmp_path / "fc_norm.safetensors")
    with pytest.raises(ValueError, match=r"fc_norm.safetensors.*fc_norm, global_pool='avg'"):
        vitkit.load_checkpoint(tmp_path / "fc_norm.safetensors")


def test_timm_width_off_the_64_grid_needs_num_heads(tmp_path):
    save_native(TimmViT(**TINY | dict(embed_dim=48, num_heads=3)), tmp_path / "w48.safetensors")
    with pytest.raises(ValueError, match="hidden_size=48 .*pass num_heads="):
        vitkit.load_checkpoint(tmp_path / "w48.safetensors")


EXPORTS = {  # vitkit config changes: matching timm arguments
    "token": ({}, {}),
    "gap_tanh_gelu": (
        dict(classifier="gap", act="gelu_tanh", qkv_bias=False),
        dict(
            class_token=False,
            global_pool="avg",
            fc_norm=False,
            qkv_bias=False,
            act_layer=partial(nn.GELU, approximate="tanh"),
        ),
    ),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_timm_export_loads_strictly_into_timm_with_the_same_outputs(tmp_path, case):
    changes, timm_args = EXPORTS[case]
    base = dict(image_size=32, patch_size=8, hidden_size=64, num_layers=2, num_heads=2, mlp_dim=128, num_classes=5)
    ours = perturbed(VisionTransformer(ViTConfig(**base | changes)))
    vitkit.export(ours, tmp_path / "t.safetensors", format="timm")
    theirs = TimmViT(**TINY | dict(num_heads=2) | timm_args).eval()
    theirs.load_state_dict(vitkit.files.read_safetensors(tmp_path / "t.safetensors")[0], strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


def test_vitkit_to_timm_to_vitkit_is_bit_exact_with_class_names(tmp_path):
    config = ViTConfig(
        image_size=(32, 48),
        patch_size=8,
        hidden_size=48,
        num_layers=2,
        num_heads=3,
        mlp_dim=96,
        num_classes=3,
        layer_scale_init=0.5,
    )
    model = perturbed(VisionTransformer(config))
    model.class_names = ["cat", "dog", "emu"]
    vitkit.export(model, tmp_path / "t.safetensors", format="timm")
    loaded = vitkit.load_checkpoint(tmp_path / "t.safetensors")
    assert loaded.config == model.config and loaded.class_names == model.class_names
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("case", EXPORTS)
def test_timm_hub_directory_export_builds_in_timm_from_its_config_alone(tmp_path, case):
    """A suffix-less export path is timm's hub layout: timm reads `config.json` (architecture, model_args,
    pretrained_cfg) and builds and loads the model with no hand-typed arguments; vitkit reads it back."""
    import timm

    changes, _ = EXPORTS[case]
    base = dict(image_size=(32, 48), patch_size=8, hidden_size=64, num_layers=2, num_heads=2, mlp_dim=96, num_classes=3)
    ours = perturbed(VisionTransformer(ViTConfig(**base | changes)))
    ours.class_names = ["cat", "dog", "emu"]
    vitkit.export(ours, tmp_path / "hub", format="timm")
    hub = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert {"architecture", "num_classes", "pretrained_cfg", "model_args"} <= hub.keys()
    assert hub["alpha"] == "drop"  # stated beside pretrained_cfg, which timm reads into a closed dataclass
    theirs = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True).eval()
    assert theirs.pretrained_cfg["label_names"] == ours.class_names
    assert tuple(theirs.pretrained_cfg["input_size"]) == (3, 32, 48) and theirs.pretrained_cfg["mean"] == [0.5] * 3
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-5, rtol=0)
    back = vitkit.load_checkpoint(tmp_path / "hub")
    assert back.config == ours.config and back.class_names == ours.class_names


@pytest.mark.slow
def test_timm_transform_from_the_export_the_hf_pipeline_and_vitkit_agree_on_a_non_square_photo(tmp_path):
    """The exported `pretrained_cfg` states vitkit's preprocessing (the whole image resized, bilinear, to [-1, 1]):
    timm's transform built from it alone gives vitkit's input pixels to within one grey level (PIL rounds its
    resize to 8 bits) on a 451x300 photo, and timm, the Hugging Face pipeline and `vitkit.predict` agree on the
    top class and to 1e-2 in every probability."""
    import timm
    from PIL import Image
    from skimage.data import chelsea
    from timm.data import create_transform, resolve_data_config
    from transformers import pipeline

    from vitkit.data.datasets import to_input
    from vitkit.data.images import read_image

    torch.manual_seed(0)
    model = vitkit.create_model("ViT-Ti/8", image_size=32, num_classes=5, hidden_size=32, num_layers=2, mlp_dim=64,
                                num_heads=2)  # fmt: skip
    torch.nn.init.normal_(model.head.weight, std=0.3)
    model.class_names = ["cat", "dog", "fox", "owl", "yak"]
    vitkit.export(model, tmp_path / "timm", format="timm")
    vitkit.export(model, tmp_path / "hf", format="hf")
    photo = tmp_path / "cat.png"
    Image.fromarray(chelsea()).save(photo)  # 451 x 300: a center crop would cut a third of it away

    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    transform = create_transform(**resolve_data_config({}, model=theirs))
    pixels = transform(Image.open(photo).convert("RGB")).unsqueeze(0)
    expected = to_input(read_image(photo), (32, 32))
    assert pixels.shape == expected.shape and (pixels - expected).abs().max() < 1 / 127.5
    with torch.no_grad():
        timm_probs = theirs(pixels).softmax(-1)[0]
    timm_scores = {name: float(p) for name, p in zip(model.class_names, timm_probs)}
    hf_scores = {r["label"]: r["score"] for r in pipeline("image-classification", model=str(tmp_path / "hf"))(
        str(photo), top_k=5)}  # fmt: skip
    ours = dict(vitkit.predict(model, [photo], k=5)[0])
    assert max(ours.values()) - min(ours.values()) > 0.05  # the classes are told apart, so the check means something
    top = max(ours, key=ours.get)
    assert max(timm_scores, key=timm_scores.get) == max(hf_scores, key=hf_scores.get) == top
    for name in model.class_names:
        assert timm_scores[name] == pytest.approx(ours[name], abs=1e-2), name
        assert hf_scores[name] == pytest.approx(ours[name], abs=1e-2), name


def test_a_hub_directory_timm_wrote_keeps_its_normalization_for_predict(tmp_path):
    """A hub directory written by timm itself for DeiT's layout, whose pretrained_cfg says ImageNet's mean and std:
    vitkit reads them, and `vitkit.predict` on a photograph at the model's size gives the probabilities timm's model
    gives on the same pixels normalised as its pretrained_cfg says (vitkit's [-1, 1] would not: checked)."""
    import numpy as np
    import timm
    from PIL import Image
    from skimage.data import chelsea
    from timm.models import save_for_hf

    from vitkit.data.datasets import to_input
    from vitkit.data.images import read_image

    theirs = perturbed(timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5))
    save_for_hf(theirs, tmp_path / "deit")
    ours = vitkit.load_checkpoint(tmp_path / "deit")
    mean, std = theirs.pretrained_cfg["mean"], theirs.pretrained_cfg["std"]
    assert ours.normalization == {"mean": list(mean), "std": list(std)} and mean != (0.5, 0.5, 0.5)
    photo = tmp_path / "cat.png"
    Image.fromarray(chelsea()).resize((32, 32), Image.BILINEAR).save(photo)
    pixels = torch.from_numpy(np.array(Image.open(photo))).permute(2, 0, 1).float() / 255
    x = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    with torch.no_grad():
        expected = theirs(x[None]).softmax(-1)[0]
        official = theirs(to_input(read_image(photo))).softmax(-1)[0]
    assert (official - expected).abs().max() > 1e-3  # the normalization matters to this model
    scores = dict(vitkit.predict(ours, [photo], k=5)[0])
    for i, p in enumerate(expected.tolist()):
        assert scores[str(i)] == pytest.approx(p, abs=1e-5), i
