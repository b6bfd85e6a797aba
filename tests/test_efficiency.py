import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from vitkit.models.config import decode_variant


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
    """flops(): every row of every layer (the paper's tables), as forward_intermediates computes them;
    flops(pooled_only=True): what model(x) computes, fewer with a class token (the last layer's row 0 alone)."""
    config = decode_variant(name, num_classes=10, **kwargs)
    with torch.device("meta"):
        model = vitkit.VisionTransformer(config).eval()
        x = torch.empty(1, 3, *config.image_size)
    counted = []
    for forward in (model.forward_intermediates, model):
        with FlopCounterMode(display=False) as counter:
            forward(x)
        counted.append(counter.get_total_flops())
    assert counted == [vitkit.flops(config), vitkit.flops(config, pooled_only=True)]
    assert (counted[1] < counted[0]) == (config.classifier == "token")


def test_count_params_equals_real_model():
    config = decode_variant("ViT-S/16", image_size=32, num_classes=7, representation_size=16)
    assert vitkit.count_params(config) == sum(p.numel() for p in vitkit.VisionTransformer(config).parameters())


class TensorsMade(TorchDispatchMode):
    """Records the element count of every tensor an operation returns off the meta device."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        self.sizes += [t.numel() for t in made]
        return out


def test_count_params_allocates_nothing_off_the_meta_device():
    with TensorsMade() as control:  # the recorder sees a real model's weights being made
        vitkit.VisionTransformer(decode_variant("ViT-Ti/16", image_size=32, num_layers=1))
    assert max(control.sizes) >= 192 * 768  # an MLP weight at least
    with TensorsMade() as made:
        count = vitkit.count_params(decode_variant("ViT-H/14"))  # 632M parameters: 2.5 GB if allocated
    assert count > 600e6 and max(made.sizes, default=0) < 1000


# Table 1's models (and the R50 hybrid of Table 5) at the paper's patch sizes, as timm names them. timm and
# transformers are dev dependencies: built on the meta device, their models allocate nothing.
TIMM_NAMES = {
    "ViT-Ti/16": "vit_tiny_patch16_224",
    "ViT-S/16": "vit_small_patch16_224",
    "ViT-S/32": "vit_small_patch32_224",
    "ViT-B/16": "vit_base_patch16_224",
    "ViT-B/32": "vit_base_patch32_224",
    "ViT-L/16": "vit_large_patch16_224",
    "ViT-L/32": "vit_large_patch32_224",
    "ViT-H/14": "vit_huge_patch14_224",
    "R50+ViT-B/16": "vit_base_r50_s16_224",
}
SLOW_TO_BUILD = ("ViT-L/16", "ViT-L/32", "ViT-H/14", "R50+ViT-B/16")


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TO_BUILD else n for n in TIMM_NAMES]
)
def test_param_counts_equal_timms_models_of_the_same_name(name):
    timm = pytest.importorskip("timm")
    with torch.device("meta"):
        theirs = timm.create_model(TIMM_NAMES[name], pretrained=False, num_classes=1000)
    ours = decode_variant(name, num_classes=1000, image_size=224)
    assert theirs.patch_embed.num_patches == ours.grid_size[0] * ours.grid_size[1]  # the same patch stride
    assert vitkit.count_params(ours) == numel(theirs)


@pytest.mark.parametrize(
    "name,changes",
    [
        ("ViT-B/16", {}),
        ("ViT-B/16", dict(qkv_bias=False)),
        pytest.param("ViT-L/16", {}, marks=pytest.mark.slow),
        pytest.param("ViT-H/14", {}, marks=pytest.mark.slow),
    ],
)
def test_param_counts_equal_hugging_face_vit_with_and_without_pre_logits(name, changes):
    """ViTForImageClassification: a linear head on the class token. ViTModel's pooler (dense + tanh) is the
    paper's pre-logits layer of representation size D, used in pre-training."""
    transformers = pytest.importorskip("transformers")
    ours = decode_variant(name, image_size=224, **changes)
    hf = transformers.ViTConfig(
        hidden_size=ours.hidden_size,
        num_hidden_layers=ours.num_layers,
        num_attention_heads=ours.num_heads,
        intermediate_size=ours.mlp_dim,
        image_size=224,
        patch_size=ours.patch_size[0],
        qkv_bias=ours.qkv_bias,
        num_labels=1000,
    )
    with torch.device("meta"):
        classifier, pooled = transformers.ViTForImageClassification(hf), transformers.ViTModel(hf)
    assert vitkit.count_params(ours.replace(num_classes=1000)) == numel(classifier)
    pre_logits = ours.replace(num_classes=0, representation_size=ours.hidden_size)
    assert vitkit.count_params(pre_logits) == numel(pooled)
