"""Translation invariance and equivariance: exact on models that have them by construction, lower on ones that
do not; the shift's padding; the `translation` experiment end to end; errors that name the bad value."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import vitkit
from helpers import perturbed, tiny
from vitkit.analysis.experiment_runs import experiment, run_key
from vitkit.analysis.experiments import EXPERIMENTS, PRESETS, Setting
from vitkit.analysis.translation import (
    CIRCULAR,
    ZERO,
    equivariance,
    feature_map,
    shift_images,
    translation,
)


class PerPixel(nn.Module):
    """Logits: the global average of a per-pixel function. Invariant under a circular shift by construction, and its
    feature map (the per-pixel values, stride 1) moves exactly with the image."""

    def __init__(self, size: int = 8, classes: int = 3):
        super().__init__()
        self.config = SimpleNamespace(image_size=(size, size), in_chans=1)
        self.weight = nn.Parameter(torch.randn(classes, 1, 1))
        self.bias = nn.Parameter(torch.randn(classes, 1, 1))

    def forward_features(self, x):  # (B, 1, H, W) -> (B, classes, H, W)
        return torch.tanh(self.weight * x + self.bias)

    def forward_head(self, features):
        return features.mean(dim=(2, 3))


class Constant(PerPixel):
    """The same features and logits for every image: invariant and equivariant under any shift."""

    def forward_features(self, x):
        return (self.weight + self.bias).expand(len(x), -1, *x.shape[-2:])


class FixedPixel(PerPixel):
    """Reads the centre pixel only, and its feature map is tied to absolute positions: neither invariant nor
    equivariant."""

    def __init__(self, size: int = 8, classes: int = 3):
        super().__init__(size, classes)
        self.position = nn.Parameter(torch.randn(classes, size, size))

    def forward_features(self, x):
        return x * self.position

    def forward_head(self, features):
        h, w = features.shape[-2:]
        return features[:, :, h // 2, w // 2]


def random_images(n: int = 64, size: int = 8, channels: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=g)
    return images, torch.randint(0, 3, (n,), generator=g)


# --- shift_images -------------------------------------------------------------------------------------------


def test_zero_padding_fills_the_uncovered_pixels_with_zero_and_moves_the_rest():
    image = torch.arange(1, 17, dtype=torch.uint8).view(1, 4, 4)
    down = shift_images(image, 1, 0, ZERO)
    assert down[0, 0].tolist() == [0, 0, 0, 0]
    assert torch.equal(down[0, 1:], image[0, :3])
    left = shift_images(image, 0, -2, ZERO)
    assert torch.equal(left[0, :, :2], image[0, :, 2:]) and left[0, :, 2:].eq(0).all()
    assert torch.equal(shift_images(image, 0, 0, ZERO), image)


def test_circular_padding_brings_back_what_leaves_the_frame():
    image = torch.arange(1, 17, dtype=torch.uint8).view(1, 4, 4)
    right = shift_images(image, 0, 1, CIRCULAR)
    assert right[0, :, 0].tolist() == [4, 8, 12, 16] and torch.equal(right[0, :, 1:], image[0, :, :3])
    assert torch.equal(shift_images(right, 0, -1, CIRCULAR), image)


# --- models invariant by construction, and not -------------------------------------------------------------


def test_a_per_pixel_model_is_invariant_and_equivariant_under_circular_shifts():
    torch.manual_seed(0)
    images, labels = random_images()
    result = translation(PerPixel(), images, labels, shifts=(0, 1, 3), padding=CIRCULAR)
    assert result.stride == (1, 1) and result.images == 64 and result.padding == CIRCULAR
    base = result.scores[0]
    assert base.pixels == 0 and base.agreement == 1.0 and base.equivariance is None  # 0 px: nothing to compare
    for score in result.scores[1:]:
        assert score.agreement == 1.0 and score.accuracy == base.accuracy
        assert score.equivariance == pytest.approx(1.0, abs=1e-9)


def test_a_constant_model_is_invariant_and_equivariant_under_zero_padded_shifts():
    torch.manual_seed(0)
    images, labels = random_images()
    for score in translation(Constant(), images, labels, shifts=(2, 5), padding=ZERO).scores:
        assert score.agreement == 1.0 and score.equivariance == pytest.approx(1.0)


def test_a_model_that_reads_one_fixed_pixel_is_neither():
    torch.manual_seed(0)
    images, labels = random_images()
    invariant = translation(PerPixel(), images, labels, shifts=(1, 2), padding=CIRCULAR).scores
    for padding in (ZERO, CIRCULAR):
        fixed = translation(FixedPixel(), images, labels, shifts=(1, 2), padding=padding).scores
        for score, reference in zip(fixed, invariant):
            assert score.agreement < 0.9 < reference.agreement
            assert score.equivariance is not None and score.equivariance < 0.9 < reference.equivariance


def test_a_vit_without_posemb_is_exactly_invariant_to_circular_whole_patch_shifts_and_a_learned_one_is_not():
    # Without a position embedding the encoder is equivariant to any permutation of the patches, and a circular
    # shift by whole patches is one: the token grid rolls with the image, the class token stays the same.
    torch.manual_seed(0)
    images, labels = random_images(n=16, size=32, channels=3)
    plain = perturbed(tiny(posemb="none"))
    scores = translation(plain, images, labels, shifts=(8, 16, 4), padding=CIRCULAR).scores
    for score in scores[:2]:
        assert score.agreement == 1.0 and score.equivariance == pytest.approx(1.0, abs=1e-5)
    assert scores[2].equivariance is None  # half a patch: not a whole cell of the token grid
    learned = perturbed(tiny(posemb="learn"))
    moved = translation(learned, images, labels, shifts=(8,), padding=CIRCULAR).scores[0]
    assert moved.equivariance is not None and moved.equivariance < 0.99


def test_feature_maps_of_a_vit_and_a_resnet_and_their_strides():
    vit = tiny()  # 32 px, patches of 8: a 4x4 token grid
    out = feature_map(vit, torch.randn(2, 3, 32, 32))
    assert out is not None and out.features.shape == (2, 32, 4, 4) and out.stride == (8, 8)
    assert out.logits.shape == (2, 5)
    resnet = vitkit.create_model("BiT-R26", num_classes=3, image_size=28, units=[1, 1]).eval()
    out = feature_map(resnet, torch.randn(2, 3, 28, 28))  # root conv /2, max-pool /2, second stage /2
    assert out is not None and out.stride == (8, 8) and out.features.shape[-2:] == (4, 4)


def test_equivariance_compares_the_overlap_of_the_moved_maps():
    original = torch.randn(2, 5, 3, 4)
    moved = torch.randn(2, 5, 3, 4)
    moved[..., :, 1:] = original[..., :, :3]  # the map moved one cell right; its first column is new
    assert equivariance(original, moved, 0, 1) == pytest.approx(1.0)
    assert equivariance(original, moved, 0, -1) < 0.9
    assert equivariance(original, moved, 0, 4) is None  # nothing left in common


# --- errors ---------------------------------------------------------------------------------------------------


def test_bad_inputs_are_errors_that_name_the_value():
    images, labels = random_images()
    model = PerPixel()
    with pytest.raises(ValueError, match="padding='reflect'"):
        shift_images(images, 1, 0, "reflect")
    with pytest.raises(ValueError, match=r"\(8, 0\).*8x8"):
        shift_images(images, 8, 0)
    with pytest.raises(ValueError, match="uint8"):
        translation(model, images.float(), labels)
    with pytest.raises(ValueError, match="16x16 px, the model takes 8x8"):
        translation(model, random_images(size=16)[0], labels)
    with pytest.raises(ValueError, match="one label per image"):
        translation(model, images, labels[:3])
    with pytest.raises(ValueError, match=r"shifts=\(1, 1\)"):
        translation(model, images, labels, shifts=(1, 1))
    with pytest.raises(ValueError, match=r"shifts=\(-1,\)"):
        translation(model, images, labels, shifts=(-1,))
    with pytest.raises(ValueError, match="padding='wrap'"):
        translation(model, images, labels, padding="wrap")
    with pytest.raises(ValueError, match="config.image_size"):
        translation(nn.Linear(2, 2), images, labels)
    with pytest.raises(ValueError, match=r"\(2, 5, 3, 4\), \(2, 5, 3, 3\)"):
        equivariance(torch.zeros(2, 5, 3, 4), torch.zeros(2, 5, 3, 3), 0, 1)


# --- the experiment -----------------------------------------------------------------------------------------


def test_the_experiment_shares_its_trainings_with_posemb_and_the_resnet_of_hybrid():
    setting = Setting(PRESETS["small"], 1, "unused")
    keys = {
        n: {json.dumps(r.labels): run_key(r) for r in EXPERIMENTS[n].runs(setting)}
        for n in ("translation", "posemb", "hybrid")
    }
    mine = keys["translation"]
    assert mine[json.dumps({"model": "ViT 1D", "seed": 0})] == keys["posemb"][json.dumps({"posemb": "1D", "seed": 0})]
    assert (
        mine[json.dumps({"model": "ViT none", "seed": 0})] == keys["posemb"][json.dumps({"posemb": "none", "seed": 0})]
    )
    assert (
        mine[json.dumps({"model": "ResNet", "seed": 0})] == keys["hybrid"][json.dumps({"model": "ResNet", "seed": 0})]
    )
    assert len(set(mine.values())) == 6  # five position embeddings and the ResNet


@pytest.mark.slow  # six 4-step trainings and their shifted test sets: seconds
def test_the_tiny_experiment_writes_a_table_per_metric_with_equivariance_at_whole_cells(tmp_path):
    result = experiment("translation", preset="tiny", out=tmp_path, threads=1, progress=False)
    data = json.loads(result.files["results"].read_text())
    shifts = PRESETS["tiny"].shifts
    assert [r["labels"]["model"] for r in data["records"]] == [
        "ViT none", "ViT 1D", "ViT 2D", "ViT relative", "ViT sincos", "ResNet"
    ]  # fmt: skip
    for record in data["records"]:
        metrics, stride = record["metrics"], record["translation"]["feature_stride"][0]
        assert record["translation"]["padding"] == "zero" and stride == 4  # ViT-Ti/4; a one-stage ResNet: 4
        assert metrics["agreement@0"] == 1.0 and metrics["accuracy@0"] == pytest.approx(metrics["accuracy"])
        assert all(0.0 <= metrics[f"{m}@{s}"] <= 1.0 for m in ("accuracy", "agreement") for s in shifts)
        assert sorted(int(m.partition("@")[2]) for m in metrics if m.startswith("equivariance@")) == [4, 8]
    table = result.files["table"].read_text()
    assert table.count("**") == 2 * 3  # a caption per metric
    assert table.count("\n|") == 3 * (len(data["table"]) + 2)
    assert "| model | 4 | 8 |" in table  # equivariance only at whole cells of both maps
    assert result.files["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
