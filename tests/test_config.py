import pytest

import vitkit
from vitkit.models.config import ResNetConfig, ViTConfig, decode_variant

# Typed in, as timm reports them; test_efficiency.py also counts timm's and Hugging Face's models on the spot.
EXPECTED_PARAMS = {
    "ViT-Ti/16": 5_717_416,
    "ViT-S/16": 22_050_664,
    "ViT-B/16": 86_567_656,
    "ViT-B/32": 88_224_232,
    "ViT-L/16": 304_326_632,
    "ViT-H/14": 632_045_800,
    "R50+ViT-B/16": 98_659_112,
}


@pytest.mark.parametrize("name,expected", EXPECTED_PARAMS.items())
def test_param_counts_equal_reference_implementations(name, expected):
    assert vitkit.count_params(decode_variant(name, num_classes=1000, image_size=224)) == expected


def test_names_are_case_insensitive_and_any_patch_works():
    c = decode_variant("vit-s/4", image_size=28, num_classes=10)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.mlp_dim, c.patch_size) == (384, 12, 6, 1536, (4, 4))
    assert c.grid_size == (7, 7) and c.num_tokens == 50


def test_hybrid_name_decodes_to_official_stem():
    c = decode_variant("R50+ViT-B/16")
    assert c.hybrid == ResNetConfig(units=(3, 4, 9)) and c.patch_size == (1, 1)
    assert c.patch_stride == (16, 16) and c.grid_size == (14, 14)


def test_unknown_name_suggests_closest():
    with pytest.raises(ValueError, match="Did you mean 'ViT-B/16'"):
        decode_variant("ViT-Bb/16")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(image_size=30, patch_size=16), "not divisible by the patch stride 16"),
        (dict(hidden_size=100, num_heads=3), "hidden_size=100 is not divisible by num_heads=3"),
        (dict(classifier="cls"), "classifier='cls' is unknown"),
        (dict(posemb="2d"), "posemb='2d' is unknown"),
        (dict(act="relu"), "act='relu' is unknown"),
        (dict(init="xavier"), "init='xavier' is unknown"),
        (dict(dropout_rate=1.5), r"dropout_rate=1.5 must be in \[0, 1\)"),
        (dict(image_size=(32, 32, 3)), "image_size=.* is invalid"),
        (dict(posemb="learn2d", hidden_size=65, num_heads=5), "divisible by 2"),
        (dict(posemb="sincos2d", hidden_size=66, num_heads=2), "divisible by 4"),
    ],
)
def test_bad_configs_raise_value_error_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ViTConfig(**kwargs)


def test_unknown_override_is_rejected_with_the_valid_fields():
    with pytest.raises(ValueError, match="unknown ViTConfig field"):
        decode_variant("ViT-Ti/16", hidden=3)


def test_config_dict_round_trip_keeps_hybrid():
    c = decode_variant("R50+ViT-B/16", image_size=(64, 96), num_classes=3)
    assert ViTConfig.from_dict(c.to_dict()) == c


def test_list_models_covers_table_1_and_hybrid():
    names = vitkit.list_models()
    assert {"ViT-Ti/16", "ViT-S/32", "ViT-B/8", "ViT-L/16", "ViT-H/14", "R50+ViT-B/16"} <= set(names)
    widths = {"Ti": 192, "S": 384, "B": 768, "L": 1024, "H": 1280}
    for name in names:  # each name decodes to the width and patch it spells
        config = decode_variant(name)
        size, patch = name.split("ViT-")[1].split("/")
        assert config.hidden_size == widths[size] and config.patch_stride == (int(patch),) * 2, name
        assert (config.hybrid is not None) == ("+" in name), name
