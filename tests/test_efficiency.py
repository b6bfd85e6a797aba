import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from vitkit.config import decode_variant


def test_vit_b16_is_35_1_gflops():
    assert round(vitkit.flops(decode_variant("ViT-B/16")) / 1e9, 1) == 35.1


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("ViT-Ti/16", dict(image_size=64, num_layers=2)),
        ("ViT-S/8", dict(image_size=(32, 48), num_layers=1, classifier="gap", representation_size=64)),
        ("R50+ViT-B/16", dict(image_size=64, num_layers=1)),
    ],
)
def test_analytic_flops_match_torch_flop_counter(name, kwargs):
    config = decode_variant(name, num_classes=10, **kwargs)
    with torch.device("meta"):
        model = vitkit.VisionTransformer(config).eval()
        x = torch.empty(1, 3, *config.image_size)
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert vitkit.flops(config) == counter.get_total_flops()


def test_count_params_does_not_allocate_and_equals_real_model():
    config = decode_variant("ViT-S/16", image_size=32, num_classes=7, representation_size=16)
    assert vitkit.count_params(config) == sum(p.numel() for p in vitkit.VisionTransformer(config).parameters())
