"""Official ViT and big_vision `.npz` checkpoints against the official JAX outputs in tests/fixtures."""

import numpy as np
import pytest
import torch
from scipy.ndimage import zoom

import vitkit
from helpers import tiny
from vitkit import ResNetConfig, VisionTransformer, ViTConfig
from vitkit.formats import npz

FIXTURES = ("vit_tiny_token", "vit_hybrid_small")


def official(fixtures_dir, name):
    """(params file, reference outputs, input as NCHW)."""
    ref = np.load(fixtures_dir / f"{name}.npz")
    return fixtures_dir / str(ref["params_file"]), ref, torch.from_numpy(ref["input"]).permute(0, 3, 1, 2)


def max_error(ours: torch.Tensor, theirs: np.ndarray) -> float:
    return float(np.abs(ours.detach().numpy() - theirs).max())


@pytest.mark.parametrize("name", FIXTURES)
def test_official_checkpoint_reproduces_official_outputs_to_1e_5(fixtures_dir, name):
    params, ref, x = official(fixtures_dir, name)
    model = vitkit.load_checkpoint(params)
    with torch.no_grad():
        out = model.forward_intermediates(x)
    for key in ("logits", "pre_logits", "encoded", "embedding"):
        assert max_error(out[key], ref[key]) < 1e-5, key


def test_hybrid_stem_intermediates_match_official(fixtures_dir):
    params, ref, x = official(fixtures_dir, "vit_hybrid_small")
    with torch.no_grad():
        out = vitkit.load_checkpoint(params).forward_intermediates(x)
    for key in ("conv_root", "gn_root", "block1", "block2"):
        ours = out[f"stem/{key}"].permute(0, 2, 3, 1)  # NCHW -> the fixtures' NHWC
        # conv_root reaches |31|: float32 sums of 147 products differ by ~1e-5 there, so a relative term is added.
        torch.testing.assert_close(ours, torch.from_numpy(ref[f"stem_{key}"]), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("name", FIXTURES)
def test_official_config_is_inferred_from_the_arrays(fixtures_dir, name):
    params, ref, _ = official(fixtures_dir, name)
    config = vitkit.load_checkpoint(params).config
    expected = dict(hidden_size=192, num_heads=3, mlp_dim=768, num_classes=10, classifier="token")
    expected |= dict(act="gelu_tanh", layer_norm_eps=1e-6, representation_size=None)
    if name == "vit_tiny_token":
        expected |= dict(image_size=(32, 32), patch_size=(16, 16), num_layers=3, hybrid=None)
    else:
        expected |= dict(image_size=(64, 64), patch_size=(1, 1), num_layers=2, hybrid=ResNetConfig((1, 1), 1))
    assert {k: getattr(config, k) for k in expected} == expected


@pytest.mark.parametrize("name", FIXTURES)
def test_every_array_of_the_official_file_is_consumed_by_name(fixtures_dir, name):
    params, _, _ = official(fixtures_dir, name)
    model = vitkit.load_checkpoint(params)
    consumed = [k for rule in npz.rules_for(model.config) for k in rule.theirs]
    assert len(consumed) == len(set(consumed))
    assert set(consumed) == set(np.load(params).files)


def test_exact_gelu_reproduces_the_official_exact_gelu_logits_not_the_faithful_ones(fixtures_dir):
    params, ref, x = official(fixtures_dir, "vit_tiny_token")
    with torch.no_grad():
        logits = vitkit.load_checkpoint(params, act="gelu")(x)
    assert max_error(logits, ref["logits_gelu_exact"]) < 1e-5
    assert max_error(logits, ref["logits"]) > 1e-5


def test_missing_key_bias_is_reported_although_it_would_change_no_output(fixtures_dir, tmp_path):
    params, _, _ = official(fixtures_dir, "vit_tiny_token")
    arrays = dict(np.load(params))
    del arrays["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/key/bias"]
    arrays["Transformer/encoderblock_1/extra/kernel"] = np.zeros(3, np.float32)
    np.savez(tmp_path / "broken.npz", **arrays)
    with pytest.raises(ValueError, match=r"broken\.npz") as info:
        vitkit.load_checkpoint(tmp_path / "broken.npz")
    assert "missing keys: Transformer/encoderblock_1/MultiHeadDotProductAttention_1/key/bias" in str(info.value)
    assert "unexpected keys: Transformer/encoderblock_1/extra/kernel" in str(info.value)


def test_num_heads_override_contradicting_the_file_is_a_shape_mismatch(fixtures_dir):
    params, _, _ = official(fixtures_dir, "vit_tiny_token")
    with pytest.raises(ValueError, match=r"query/kernel \(192, 3, 64\).*expected shape \(192, 4, 48\)"):
        vitkit.load_checkpoint(params, num_heads=4)


def newer_flax_names(arrays: dict) -> dict:
    names = dict(zip(npz.RELEASED_NAMES, npz.FLAX_NAMES))
    return {"/".join(names.get(part, part) for part in k.split("/")): v for k, v in arrays.items()}


def big_vision_layout(arrays: dict, depth: int) -> dict:
    """big_vision: newer names under params/, blocks stacked on a depth axis, no posemb on the class token."""
    arrays = newer_flax_names(arrays)
    posemb = arrays.pop(npz.POSEMB)
    out = {"params/pos_embedding": posemb[:, 1:], "params/cls": arrays.pop("cls") + posemb[:, :1]}
    for k in [k for k in arrays if k.startswith("Transformer/encoderblock_0/")]:
        rest = k.removeprefix("Transformer/encoderblock_0/")
        out[f"params/Transformer/encoderblock/{rest}"] = np.stack(
            [arrays.pop(f"Transformer/encoderblock_{i}/{rest}") for i in range(depth)]
        )
    return out | {f"params/{k}": v for k, v in arrays.items()}


@pytest.mark.parametrize("layout", [newer_flax_names, big_vision_layout])
def test_newer_flax_and_big_vision_layouts_give_the_official_logits(fixtures_dir, tmp_path, layout):
    params, ref, x = official(fixtures_dir, "vit_tiny_token")
    arrays = dict(np.load(params))
    converted = layout(arrays) if layout is newer_flax_names else layout(arrays, depth=3)
    np.savez(tmp_path / "other.npz", **converted)
    with torch.no_grad():
        logits = vitkit.load_checkpoint(tmp_path / "other.npz")(x)
    assert max_error(logits, ref["logits"]) < 1e-5


@pytest.mark.parametrize("name", FIXTURES)
def test_export_npz_rewrites_the_released_file_exactly(fixtures_dir, tmp_path, name):
    params, _, _ = official(fixtures_dir, name)
    vitkit.export(vitkit.load_checkpoint(params), tmp_path / "out.npz", format="npz")
    original, written = np.load(params), np.load(tmp_path / "out.npz")
    assert sorted(original.files) == sorted(written.files)
    for k in original.files:
        assert original[k].shape == written[k].shape and np.array_equal(original[k], written[k]), k


@pytest.mark.parametrize("image_size", [48, (32, 80)])
def test_posemb_resize_of_official_checkpoint_is_scipy_zoom_order_1(fixtures_dir, image_size):
    params, _, _ = official(fixtures_dir, "vit_tiny_token")
    posemb = np.load(params)[npz.POSEMB][0]  # (1 + 2 * 2, D)
    model = vitkit.load_checkpoint(params, image_size=image_size)
    gh, gw = model.config.grid_size
    grid = posemb[1:].reshape(2, 2, -1)
    expected = zoom(grid, (gh / 2, gw / 2, 1), order=1).reshape(gh * gw, -1)
    resized = model.posemb.weight.detach()[0].numpy()
    assert np.array_equal(resized[0], posemb[0])  # the class-token row is kept
    np.testing.assert_allclose(resized[1:], expected, atol=1e-6)


def test_new_head_for_new_classes_is_zero_initialised(fixtures_dir):
    params, _, _ = official(fixtures_dir, "vit_tiny_token")
    model = vitkit.load_checkpoint(params, num_classes=3)
    assert model.head.weight.shape == (3, 192) and torch.count_nonzero(model.head.weight) == 0


ROUND_TRIPS = {
    "token": dict(),
    "gap_pre_logits": dict(classifier="gap", representation_size=24),
    "hybrid": dict(image_size=16, patch_size=1, hybrid=ResNetConfig(units=(1,))),
}


@pytest.mark.parametrize("kind", ROUND_TRIPS)
def test_vitkit_to_npz_to_vitkit_is_bit_exact(tmp_path, kind):
    model = tiny(act="gelu_tanh", **ROUND_TRIPS[kind])
    vitkit.export(model, tmp_path / "m.npz", format="npz")
    loaded = vitkit.load_checkpoint(tmp_path / "m.npz")
    assert loaded.config == model.config
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_npz_export_warns_of_what_it_cannot_hold_and_the_cli_says_so(tmp_path, capsys):
    """Exact GELU and class names have no place in the official layout: they come back as tanh-GELU and None,
    so the export warns (and `vitkit convert` prints the warning); a tanh-GELU model without names is silent."""
    import warnings

    from vitkit.cli.parser import main

    base = dict(image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, num_classes=2)
    model = VisionTransformer(ViTConfig(**base, act="gelu")).eval()
    model.class_names = ["cat", "dog"]
    with pytest.warns(UserWarning) as caught:
        vitkit.export(model, tmp_path / "m.npz", format="npz")
    text = " ".join(str(w.message) for w in caught)
    assert "act='gelu'" in text and "tanh-GELU" in text and "the 2 class names" in text
    back = vitkit.load_checkpoint(tmp_path / "m.npz")
    assert back.config.act == "gelu_tanh" and back.class_names is None  # what the warning said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vitkit.export(VisionTransformer(ViTConfig(**base, act="gelu_tanh")), tmp_path / "t.npz", format="npz")
    vitkit.export(model, tmp_path / "m.safetensors")
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "c.npz"), "--to", "npz"]) == 0
    err = capsys.readouterr().err
    assert "vitkit convert: warning: npz export" in err and "class names" in err
