"""Deletion and insertion scores: the known attribution of a model built to read one patch scores best, random
does not; every method runs on class-token and GAP ViTs and on the ResNet where it applies; bad input is named."""

import dataclasses

import pytest
import torch
from torch import nn

import vitkit
from helpers import tiny
from vitkit.analysis import attribution as at
from vitkit.analysis.saliency import ATTENTION_METHODS
from vitkit.models.architectures import new_model

PATCH, GRID = 4, (4, 4)  # the one-patch model's 16 px images: a 4x4 grid of 4 px patches
READ = (1, 2)  # the patch it reads


class OnePatch(nn.Module):
    """Logits (8 x mean of one patch, 0): the probability of class 0 depends on that patch alone, so the exact
    attribution is known by construction."""

    def __init__(self, row: int = READ[0], column: int = READ[1]):
        super().__init__()
        self.row, self.column = row, column
        self.weight = nn.Parameter(torch.tensor(8.0))  # a parameter, as a model has: the gradient path goes through

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, c = self.row * PATCH, self.column * PATCH
        s = self.weight * x[:, :, r : r + PATCH, c : c + PATCH].mean(dim=(1, 2, 3))
        return torch.stack([s, torch.zeros_like(s)], dim=-1)


def one_patch_images(n: int = 3) -> torch.Tensor:
    """Dim textured images whose read patch is bright: hiding it (zero, mean or blur) lowers class 0."""
    x = 0.2 + 0.2 * torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    r, c = READ[0] * PATCH, READ[1] * PATCH
    x[:, :, r : r + PATCH, c : c + PATCH] = 1.0
    return x


def one_hot_maps(n: int, row: int, column: int) -> torch.Tensor:
    maps = torch.zeros(n, *GRID)
    maps[:, row, column] = 1.0
    return maps


# ----------------------------------------------------------------------------------------------------------
# The metric, on a model whose attribution is known.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("baseline", at.BASELINES)
def test_the_patch_the_model_reads_scores_best_on_deletion_and_insertion(baseline):
    model, images = OnePatch(), one_patch_images()
    exact = at.perturbation_curves(model, images, one_hot_maps(3, *READ), baseline=baseline, patch=PATCH)
    for wrong in [one_hot_maps(3, 0, 0), one_hot_maps(3, 3, 3), torch.rand(3, *GRID)]:
        other = at.perturbation_curves(model, images, wrong, baseline=baseline, patch=PATCH)
        assert (exact.deletion_auc < other.deletion_auc).all(), baseline
        assert (exact.insertion_auc > other.insertion_auc).all(), baseline
    # the read patch out first: class 0's probability falls to the baseline's level after one step and stays there
    torch.testing.assert_close(exact.deletion[:, 1], exact.deletion[:, -1])


def test_curves_run_from_the_image_to_the_baseline_and_back():
    model, images = OnePatch(), one_patch_images(2)
    curves = at.perturbation_curves(model, images, torch.rand(2, *GRID), targets=[0, 0], baseline="zero", patch=PATCH)
    p_image = model(images).softmax(-1)[:, 0]
    p_zero = model(torch.zeros_like(images)).softmax(-1)[:, 0]
    torch.testing.assert_close(curves.deletion[:, 0], p_image)
    torch.testing.assert_close(curves.deletion[:, -1], p_zero)
    torch.testing.assert_close(curves.insertion[:, 0], p_zero)
    torch.testing.assert_close(curves.insertion[:, -1], p_image)
    assert curves.fraction[0] == 0 and curves.fraction[-1] == 1 and curves.deletion.shape == (2, 17)


def test_gradient_methods_and_occlusion_find_the_patch_and_beat_the_random_floor():
    model, images = OnePatch(), one_patch_images()
    methods = ("occlusion", "integrated_gradients", "gradient_x_input")
    result = at.faithfulness(model, images, methods=methods, baseline="zero", patch=PATCH, orderings=4)
    exact = at.perturbation_curves(model, images, one_hot_maps(3, *READ), baseline="zero", patch=PATCH)
    assert result.methods == methods and set(result.skipped) == set()  # no attention method asked for
    for method in methods:
        assert (result.maps[method].flatten(1).argmax(dim=1) == READ[0] * GRID[1] + READ[1]).all(), method
        torch.testing.assert_close(torch.tensor(result.deletion[method]), exact.deletion_auc)
        assert result.mean(method, "deletion") < result.mean(at.RANDOM, "deletion") - 0.1, method
        assert result.mean(method, "insertion") > result.mean(at.RANDOM, "insertion") + 0.1, method
        assert "ranks patches better than random" in at.reading(result, method)
    assert result.targets == (0, 0, 0) and len(result.random_deletion) == 4
    floor = torch.tensor(result.random_deletion).mean(dim=0)
    torch.testing.assert_close(torch.tensor(result.deletion[at.RANDOM]), floor)


def test_a_map_no_better_than_random_is_read_so():
    model, images = OnePatch(), one_patch_images(6)
    result = at.faithfulness(model, images, methods=("occlusion",), baseline="zero", patch=PATCH, orderings=8)
    level = dataclasses.replace(result, deletion={**result.deletion, "occlusion": result.deletion[at.RANDOM]})
    level = dataclasses.replace(level, insertion={**level.insertion, "occlusion": level.insertion[at.RANDOM]})
    assert "ranks patches no better than random" in at.reading(level, "occlusion")
    worse = dataclasses.replace(  # a map whose curves never move: worse than random on both
        result,
        deletion={"occlusion": result.probability, at.RANDOM: result.deletion[at.RANDOM]},  # never falls
        insertion={"occlusion": (0.0,) * 6, at.RANDOM: result.insertion[at.RANDOM]},  # never rises
    )
    assert "ranks patches worse than random" in at.reading(worse, "occlusion")


def test_the_random_floor_is_fixed_by_the_seed():
    model, images = OnePatch(), one_patch_images(4)
    run = lambda seed: at.faithfulness(model, images, methods=(), seed=seed, patch=PATCH, steps=4)  # noqa: E731
    assert run(0).random_deletion == run(0).random_deletion
    assert run(0).random_deletion != run(1).random_deletion


def test_the_blur_baseline_is_torchvisions_gaussian_blur_of_half_a_patch():
    from torchvision.transforms.functional import gaussian_blur

    x = torch.rand(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(at.removal_baseline(x, "blur", 4), gaussian_blur(x, [9, 9], [2.0, 2.0]))
    mean = at.removal_baseline(x, "mean", 4)
    assert torch.equal(mean[:, :, 5, 7], x.mean(dim=(-2, -1))) and not at.removal_baseline(x, "zero", 4).any()


# ----------------------------------------------------------------------------------------------------------
# Every method on the models vitkit has.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_every_method_runs_on_a_vit_with_a_class_token_or_gap(classifier):
    torch.manual_seed(0)
    model = tiny(classifier=classifier)
    with torch.no_grad():
        model.head.weight.normal_()  # a zero head would give every class the same probability: flat curves
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    result = at.faithfulness(model, images, steps=4, ig_steps=4)
    assert result.methods == at.METHODS and result.skipped == {} and result.grid == (4, 4) and result.steps == 4
    for method in at.METHODS:
        assert result.maps[method].shape == (2, 4, 4) and torch.isfinite(result.maps[method]).all(), method
        assert all(0.0 <= v <= 1.0 for v in result.deletion[method] + result.insertion[method]), method
    predicted = model(images).argmax(dim=-1).tolist()
    assert list(result.targets) == predicted


def test_forward_passes_counts_every_pass_faithfulness_makes():
    model = tiny()
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    rows = []
    hook = model.embedding.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        at.faithfulness(model, images, steps=4, ig_steps=4, orderings=2)
    finally:
        hook.remove()
    counts = at.forward_passes(model, 2, steps=4, ig_steps=4, orderings=2)
    assert sum(rows) == counts["curves"] + counts["maps"]
    assert counts["curves"] == 2 * (len(at.METHODS) + 2) * 2 * 5


def test_the_resnet_is_scored_by_the_methods_that_apply_and_says_why_not_the_others():
    torch.manual_seed(0)
    resnet = new_model("BiT-R26", image_size=16, num_classes=3, units=[1]).eval()
    with torch.no_grad():
        resnet.head.weight.normal_()
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    with pytest.raises(ValueError, match="pass patch=<pixels>"):
        at.faithfulness(resnet, images)
    result = at.faithfulness(resnet, images, patch=4, steps=4, ig_steps=4)
    assert result.methods == ("occlusion", "integrated_gradients", "gradient_x_input")
    assert set(result.skipped) == set(ATTENTION_METHODS)
    assert all("no attention layers" in why for why in result.skipped.values())


# ----------------------------------------------------------------------------------------------------------
# Errors.
# ----------------------------------------------------------------------------------------------------------


def test_unknown_method_and_baseline_are_named_with_the_choices():
    model, images = OnePatch(), one_patch_images(1)
    with pytest.raises(ValueError, match=r"unknown method 'rolout'.*did you mean 'rollout'"):
        at.faithfulness(model, images, methods=("rolout",), patch=PATCH)
    with pytest.raises(ValueError, match=r"baseline='blurr': choose one of blur, mean, zero \(did you mean 'blur'"):
        at.faithfulness(model, images, methods=(), baseline="blurr", patch=PATCH)


def test_bad_steps_labels_and_orderings_are_refused_with_the_fix():
    model, images = OnePatch(), one_patch_images(2)
    with pytest.raises(ValueError, match="steps=17: .* use 1 to 16"):
        at.faithfulness(model, images, methods=(), steps=17, patch=PATCH)
    with pytest.raises(ValueError, match="3 labels for 2 images"):
        at.faithfulness(model, images, labels=[0, 1, 0], methods=(), patch=PATCH)
    with pytest.raises(ValueError, match=r"labels \[5\] are not classes of this model: use 0..1"):
        at.faithfulness(model, images, labels=[0, 5], methods=(), patch=PATCH)
    with pytest.raises(ValueError, match="orderings=0"):
        at.faithfulness(model, images, methods=(), orderings=0, patch=PATCH)
    with pytest.raises(ValueError, match="3 maps for 2 images"):
        at.perturbation_curves(model, images, torch.rand(3, *GRID), patch=PATCH)


def test_a_model_without_a_head_or_without_input_gradients_is_refused():
    with pytest.raises(ValueError, match="no head"):
        at.faithfulness(tiny(num_classes=0), torch.zeros(1, 3, 32, 32), methods=("occlusion",))

    class Detached(OnePatch):  # as an optimize()d copy: the same logits, no gradient to the input
        def forward(self, x):
            return super().forward(x.detach())

    with pytest.raises(ValueError, match="passes no gradient to its input"):
        at.faithfulness(Detached(), one_patch_images(1), methods=("gradient_x_input",), patch=PATCH)


def test_a_missing_captum_is_named_with_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "captum", None)  # `import captum` now raises ImportError
    with pytest.raises(ImportError, match="pip install captum"):
        at.faithfulness(OnePatch(), one_patch_images(1), methods=("integrated_gradients",), patch=PATCH)


def test_vitkit_exposes_the_module():
    assert vitkit.analysis.attribution.faithfulness is at.faithfulness
