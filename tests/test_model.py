import os

import numpy as np
import pytest
import torch
from scipy.ndimage import zoom

import vitkit
from helpers import perturbed, tiny
from vitkit.models.config import POSEMBS, decode_variant
from vitkit.models.vit import RelativePosemb, VisionTransformer

# Even on the meta device a ResNet stem or a ViT-H takes seconds.
VARIANTS = [pytest.param(n, marks=pytest.mark.slow) if "+" in n or "-H/" in n else n for n in vitkit.list_models()]


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_builds_and_runs_forward_shapes(name):
    config = decode_variant(name, num_classes=10)
    small = config.replace(image_size=config.patch_stride[0] * 2)
    with torch.device("meta"):
        model = VisionTransformer(small)
        out = model.forward_intermediates(torch.empty(2, 3, *small.image_size), attention=True)
    assert out["logits"].shape == (2, 10)
    assert len(out["tokens"]) == len(out["attention"]) == config.num_layers
    assert out["attention"][0].shape == (2, config.num_heads, small.num_tokens, small.num_tokens)


@pytest.mark.parametrize("name", ["ViT-Ti/16", "ViT-S/32", "ViT-B/16", "R50+ViT-B/16"])
@pytest.mark.slow
def test_real_variants_give_finite_logits(name):
    model = vitkit.create_model(name, image_size=32 if "R50" not in name else 64, num_classes=10).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, 3, *model.config.image_size))
    assert logits.shape == (2, 10) and torch.isfinite(logits).all()


@pytest.mark.parametrize("classifier", ["token", "gap"])
@pytest.mark.parametrize("posemb", POSEMBS)
def test_every_classifier_and_posemb_trains_one_step(classifier, posemb):
    model = tiny(classifier=classifier, posemb=posemb, init="trunc_normal").train()
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()), "a parameter got no gradient"
    opt.step()
    assert all(not torch.equal(before[k], v) for k, v in model.named_parameters())
    assert (model.cls_token is not None) == (classifier == "token")


@pytest.mark.parametrize("posemb", ["learn", "relative"])
def test_sdpa_and_explicit_attention_agree(posemb):
    model = tiny(posemb=posemb, init="trunc_normal").eval()
    torch.nn.init.normal_(next(p for n, p in model.named_parameters() if n.startswith("posemb")), std=0.5)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        fast = model(x)
        out = model.forward_intermediates(x, attention=True)
    torch.testing.assert_close(out["logits"], fast, atol=1e-6, rtol=0)
    probs = out["attention"][0]
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("classifier,posemb", [("token", "learn"), ("token", "relative"), ("gap", "learn")])
def test_forward_computes_the_last_layer_for_the_class_token_alone_with_the_same_logits_and_gradients(
    classifier, posemb
):
    """eq. (4) reads z_L^0 only: `model(x)` computes the last layer's class-token row alone (its MLP sees one row an
    image), `forward_intermediates` every row (17: 16 patches and the class token); logits and every gradient agree.
    With GAP every row reaches the head, so both compute all of them."""
    model = perturbed(tiny(classifier=classifier, posemb=posemb)).train()
    x, weights = torch.randn(3, 3, 32, 32), torch.randn(3, 5)
    rows: list[int] = []
    model.blocks[-1].mlp.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[1]))
    results = []
    for forward in (model, lambda x: model.forward_intermediates(x)["logits"]):
        model.zero_grad()
        logits = forward(x)
        (logits * weights).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    n = model.config.num_tokens
    assert rows == ([1, n] if classifier == "token" else [n, n])
    (fast, fast_grads), (full, full_grads) = results
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), fast_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_patch_dropout_trains_on_a_random_share_of_each_images_patches_and_evaluates_on_all(classifier):
    """In training each image keeps int(16 * 0.75) = 12 of its 16 patch tokens, a different set per image, each kept
    token exactly as z_0 has it (position embedding added) and the class token first; in evaluation the model is the
    one without patch dropout."""
    model = perturbed(tiny(classifier=classifier, patch_dropout=0.25))
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        full = model.embed(x)  # eval mode: every token
        dropped = model.train().embed(x)
    prefix = int(classifier == "token")
    assert full.shape[1] == 16 + prefix and dropped.shape[1] == 12 + prefix
    kept = []
    for image in range(4):
        rows = [int((full[image] == row).all(-1).nonzero()) for row in dropped[image]]  # where each kept token was
        assert rows[:prefix] == [0] * prefix and len(set(rows)) == len(rows)
        kept.append(frozenset(rows[prefix:]))
    assert len(set(kept)) > 1, "every image kept the same patches"
    plain = tiny(classifier=classifier)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model.eval()(x), plain(x))
    loss = torch.nn.functional.cross_entropy(model.train()(x), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_patch_dropout_is_refused_with_relative_posemb():
    with pytest.raises(ValueError, match="patch_dropout.*relative.*added position embedding"):
        tiny(posemb="relative", patch_dropout=0.5)
    with pytest.raises(ValueError, match=r"patch_dropout=1.0 must be in \[0, 1\)"):
        tiny(patch_dropout=1.0)


def test_forward_intermediates_names_and_shapes():
    model = tiny().eval()
    x = torch.randn(2, 3, 32, 32)
    out = model.forward_intermediates(x)
    assert out["embedding"].shape == (2, 4, 4, 32)
    assert [t.shape for t in out["tokens"]] == [(2, 17, 32)] * 2 and out["attention"] == []
    assert torch.equal(out["encoded"], model.forward_features(x))
    assert out["pre_logits"].shape == (2, 32) and out["logits"].shape == (2, 5)


def test_set_image_size_resamples_learned_posemb_like_scipy_zoom():
    model = tiny(image_size=(32, 48))  # grid (4, 6) -> (7, 5), non-square both ways
    old = model.posemb.weight.detach().numpy()[0]
    model.set_image_size((56, 40))
    new = model.posemb.weight.detach().numpy()[0]
    grid = old[1:].reshape(4, 6, -1)
    expected = zoom(grid, (7 / 4, 5 / 6, 1), order=1).reshape(35, -1)
    np.testing.assert_allclose(new[1:], expected, atol=1e-6)
    np.testing.assert_array_equal(new[0], old[0])  # class-token row kept aside
    assert model(torch.randn(1, 3, 56, 40)).shape == (1, 5)


@pytest.mark.parametrize("posemb", ["learn2d", "relative", "sincos2d", "none"])
def test_set_image_size_works_for_every_posemb(posemb):
    model = tiny(posemb=posemb)
    model.set_image_size(48)
    assert model.config.grid_size == (6, 6)
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 5)


def test_relative_bias_depends_only_on_offset():
    model = tiny(posemb="relative")
    torch.nn.init.normal_(model.posemb.table)
    bias = model.posemb.attention_bias()[0, 0, 1:, 1:]  # patches of a 4x4 grid, row-major
    assert bias[0, 1] == bias[5, 6] and bias[0, 5] == bias[10, 15]  # same (dy, dx)
    assert bias[0, 1] != bias[1, 0]


def test_wrong_input_size_says_how_to_fix():
    with pytest.raises(ValueError, match="set_image_size"):
        tiny()(torch.randn(1, 3, 64, 64))


def test_images_of_the_wrong_kind_are_refused_naming_the_fix():
    """Grayscale images for an RGB model (and back) and one image without its batch axis are refused with what to
    do, not an error from deep inside a kernel."""
    with pytest.raises(ValueError, match=r"has 1 channel, and the model takes RGB images: expected \(B, 3, 32, 32\)"):
        tiny()(torch.randn(2, 1, 32, 32))
    with pytest.raises(ValueError, match=r"takes grayscale images.*convert\('L'\)"):
        tiny(in_chans=1)(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match=r"not a batch of images.*add the batch axis, x\[None\]"):
        tiny()(torch.randn(3, 32, 32))


@pytest.mark.parametrize("changes", [{}, {"classifier": "gap"}, {"posemb": "relative"}])
def test_an_empty_batch_gives_empty_logits_as_timms_model_does(changes):
    model = tiny(**changes).eval()
    assert model(torch.randn(0, 3, 32, 32)).shape == (0, model.config.num_classes)


def test_reset_head_is_zero_initialised_and_drops_pre_logits():
    model = tiny(representation_size=16, init="trunc_normal")
    model.reset_head(7)
    assert model.config.num_classes == 7 and model.config.representation_size is None
    assert torch.count_nonzero(model.head.weight) == 0 and model.head.in_features == 32
    assert torch.equal(model(torch.randn(2, 3, 32, 32)), torch.zeros(2, 7))


def test_jax_init_follows_official_scheme():
    model = tiny()
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.cls_token) == 0
    assert 0 < model.blocks[0].mlp.fc1.bias.abs().max() < 1e-4
    assert abs(model.posemb.weight.std().item() - 0.02) < 0.005


def test_gradient_checkpointing_gives_same_gradients():
    model = tiny(init="trunc_normal").train()
    x = torch.randn(2, 3, 32, 32)
    grads, block_calls, calls = [], [], []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    for enabled in (False, True):
        model.zero_grad()
        model.set_grad_checkpointing(enabled)
        calls.clear()
        model(x).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        block_calls.append(len(calls))
    assert block_calls == [1, 2]  # with checkpointing, the backward pass runs the block again
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = tiny(posemb="relative", classifier="gap", representation_size=8, init="trunc_normal").eval()
    model.class_names = ["a", "b", "c", "d", "e"]
    vitkit.export(model, tmp_path / "m.safetensors")
    loaded = vitkit.load_checkpoint(tmp_path / "m.safetensors")
    assert loaded.config == model.config and loaded.class_names == model.class_names
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model(x), loaded(x))
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary left behind


def test_saved_files_get_the_usual_permissions_not_private_ones(tmp_path):
    umask = os.umask(0o022)
    try:
        vitkit.export(tiny(), tmp_path / "m.safetensors")
    finally:
        os.umask(umask)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_hybrid_save_load_round_trip(tmp_path):
    model = vitkit.create_model("R50+ViT-B/16", image_size=32, num_layers=1, num_classes=3).eval()
    vitkit.export(model, tmp_path / "h.safetensors")
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(vitkit.load_checkpoint(tmp_path / "h.safetensors")(x), model(x))


def test_load_rejects_non_vitkit_files(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="junk.safetensors"):
        vitkit.load_checkpoint(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        vitkit.load_checkpoint(tmp_path / "missing.safetensors")


def test_relative_posemb_module_type():
    assert isinstance(tiny(posemb="relative").posemb, RelativePosemb)


def test_load_checkpoint_adapts_resolution_and_head(tmp_path):
    model = tiny(representation_size=16)
    vitkit.export(model, tmp_path / "m.safetensors")
    tuned = vitkit.load_checkpoint(tmp_path / "m.safetensors", image_size=48, num_classes=3, drop_path_rate=0.1)
    assert tuned.config.image_size == (48, 48) and tuned.config.num_classes == 3
    assert tuned.config.representation_size is None and tuned.config.drop_path_rate == 0.1
    assert torch.count_nonzero(tuned.head.weight) == 0
    assert torch.equal(tuned.blocks[1].mlp.fc2.weight, model.blocks[1].mlp.fc2.weight)


def test_a_checkpoints_patch_dropout_is_recorded_and_fine_tuning_starts_without_it(tmp_path):
    from vitkit.formats.checkpoints import load_for_finetuning

    path = str(tmp_path / "m.safetensors")
    vitkit.export(tiny(patch_dropout=0.5), path)
    assert vitkit.load_checkpoint(path).config.patch_dropout == 0.5  # as it was trained
    tuned = load_for_finetuning(path, {})
    assert tuned.config.patch_dropout == 0.0
    with torch.no_grad():  # the config the forward reads: a training step keeps every patch
        assert tuned.train().embed(torch.randn(2, 3, 32, 32)).shape[1] == 17
    assert load_for_finetuning(path, {"patch_dropout": 0.25}).config.patch_dropout == 0.25
