"""Saliency maps per patch: a pixel map is summed over each patch, every method gives a ViT one map per image on its
token grid, and the model is left in the mode it was given in."""

import pytest
import torch

from helpers import tiny
from vitkit.analysis import saliency
from vitkit.models.architectures import new_model

GRID = (4, 4)


def test_patch_scores_sum_a_pixel_map_over_each_patch_and_keep_a_patch_map():
    pixels = torch.arange(16 * 16, dtype=torch.float32).reshape(1, 16, 16)
    scores = saliency.patch_scores(pixels, GRID, (16, 16))
    assert scores.shape == (1, *GRID)
    assert scores[0, 1, 2] == pixels[0, 4:8, 8:12].sum()
    grid_map = torch.rand(2, *GRID)
    assert torch.equal(saliency.patch_scores(grid_map, GRID, (16, 16)), grid_map)


def test_patch_maps_give_every_method_a_map_on_the_token_grid_and_restore_training_mode():
    torch.manual_seed(0)
    model = tiny().train()
    with torch.no_grad():
        model.head.weight.normal_()  # a zero head has a zero gradient: the gradient maps would be all zero
    images = torch.rand(3, 3, 32, 32) * 2 - 1
    targets = torch.tensor([0, 1, 2])
    maps = saliency.patch_maps(model, images, targets, torch.zeros_like(images), saliency.METHODS, ig_steps=4)
    assert list(maps) == list(saliency.METHODS) and model.training
    for method, patch_map in maps.items():
        assert patch_map.shape == (3, *model.config.grid_size), method
        assert torch.isfinite(patch_map).all() and patch_map.abs().sum() > 0, method


def test_a_model_without_attention_gets_the_methods_that_apply_and_the_reason_for_the_others():
    resnet = new_model("BiT-R26", image_size=16, num_classes=3, units=[1])
    chosen, skipped = saliency.applicable(resnet, saliency.METHODS)
    assert chosen == [m for m in saliency.METHODS if m not in saliency.ATTENTION_METHODS]
    assert set(skipped) == set(saliency.ATTENTION_METHODS) and "no attention layers" in skipped["rollout"]
    with pytest.raises(ValueError, match="pass patch=<pixels>"):
        saliency.patch_grid(resnet, (16, 16))
    assert saliency.patch_grid(resnet, (16, 16), patch=4) == GRID
