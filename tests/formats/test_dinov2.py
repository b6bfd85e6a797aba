"""Hugging Face Dinov2Model directories: a random Dinov2Model loads with its outputs to 1e-5, at its own size
and at other sizes (the posemb interpolated as Dinov2 does on every forward); register tokens are refused."""

import pytest
import torch
from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

import vitkit
from helpers import perturbed

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    mlp_ratio=4,
    image_size=32,
    patch_size=4,
    layerscale_value=0.5,
)


@pytest.fixture
def dinov2_dir(tmp_path):
    theirs = perturbed(Dinov2Model(Dinov2Config(**TINY)))
    theirs.save_pretrained(tmp_path)
    return tmp_path, theirs


@pytest.mark.parametrize("size", [32, 24, 44])
def test_dinov2_loads_with_the_same_outputs_at_its_size_and_interpolated(dinov2_dir, size):
    directory, theirs = dinov2_dir
    ours = vitkit.load_checkpoint(directory, image_size=size if size != 32 else None)
    assert ours.config.layer_scale_init == 0.5 and ours.config.num_classes == 0
    assert ours.config.image_size == (size, size)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        out = theirs(pixel_values=x)
        torch.testing.assert_close(ours.forward_features(x), out.last_hidden_state, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(x), out.pooler_output, atol=1e-5, rtol=0)


def test_mask_token_is_ignored_and_format_is_detected(dinov2_dir):
    directory, theirs = dinov2_dir
    assert "embeddings.mask_token" in theirs.state_dict()
    from vitkit.formats import detect_format

    assert detect_format(directory) == "dinov2"
    with pytest.raises(ValueError, match="load-only"):
        vitkit.export(vitkit.load_checkpoint(directory), directory / "again", format="dinov2")


def test_register_tokens_are_refused_with_the_reason(tmp_path):
    config = Dinov2WithRegistersConfig(**TINY, num_register_tokens=4)
    Dinov2WithRegistersModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="4 register tokens.*one prefix token"):
        vitkit.load_checkpoint(tmp_path)
