import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import vitkit
from helpers import tiny
from shapes_vit import held_out_shapes, trained_shapes_vit
from vitkit.analysis import figures as vi
from vitkit.models.vit import VisionTransformer


def fixed_attention(model: VisionTransformer, self_logit: float) -> VisionTransformer:
    """Zero q and k, so every attention logit is the relative-posemb bias: 0 everywhere gives uniform attention,
    a large value at offset (0, 0) gives the identity."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * model.config.hidden_size].zero_()
            block.attn.qkv.bias[: 2 * model.config.hidden_size].zero_()
        model.posemb.table.zero_()
        gh, gw = model.config.grid_size
        model.posemb.table[:, :, gh - 1, gw - 1] = self_logit
    return model


def analytic_mean_patch_distance(grid: tuple[int, int], stride: int) -> float:
    cells = list(itertools.product(range(grid[0]), range(grid[1])))
    pairs = [math.dist(a, b) * stride for a in cells for b in cells]
    return sum(pairs) / len(pairs)


# --- properties ---------------------------------------------------------------------------------------------


@settings(max_examples=5, deadline=None)
@given(classifier=st.sampled_from(["token", "gap"]), layers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_rollout_rows_sum_to_one(classifier, layers, seed):
    torch.manual_seed(seed)
    model = tiny(classifier=classifier, num_layers=layers, init="trunc_normal")
    rollout = vi.attention_rollout(model, torch.randn(3, 32, 32))
    n = model.config.num_tokens
    assert rollout.joint.shape == (n, n)
    torch.testing.assert_close(rollout.joint.sum(dim=-1), torch.ones(n), atol=1e-5, rtol=0)
    assert (rollout.joint >= 0).all()
    assert rollout.upsampled.shape == (32, 32) and rollout.grid.shape == (4, 4)
    assert rollout.query == (vi.CLS_QUERY if classifier == "token" else vi.GAP_QUERY)


def test_mean_attention_distance_is_zero_for_identity_attention():
    model = fixed_attention(tiny(classifier="gap", posemb="relative", num_layers=3), self_logit=1e4)
    distance = vi.mean_attention_distance(model, torch.randn(2, 3, 32, 32))
    assert distance.shape == (3, 4)
    assert distance.abs().max() < 1e-6


@settings(max_examples=6, deadline=None)
@given(classifier=st.sampled_from(["token", "gap"]), grid=st.sampled_from([(2, 2), (3, 5), (4, 4)]))
def test_mean_attention_distance_equals_analytic_mean_patch_distance_for_uniform_attention(classifier, grid):
    model = tiny(classifier=classifier, posemb="relative", image_size=(8 * grid[0], 8 * grid[1]))
    model = fixed_attention(model, self_logit=0.0)
    distance = vi.mean_attention_distance(model, torch.randn(2, 3, 8 * grid[0], 8 * grid[1]))
    expected = analytic_mean_patch_distance(grid, stride=8)
    torch.testing.assert_close(distance, torch.full((2, 4), expected), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("posemb", ["learn", "learn2d", "sincos2d"])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_posemb_similarity_is_symmetric_with_ones_on_the_diagonal(posemb, classifier):
    model = tiny(posemb=posemb, classifier=classifier, image_size=(24, 40))
    sim = vi.posemb_similarity(model)
    assert sim.shape == (3, 5, 3, 5)
    flat = sim.reshape(15, 15)
    torch.testing.assert_close(flat.diagonal(), torch.ones(15))
    torch.testing.assert_close(flat, flat.T)
    assert flat.max() <= 1 + 1e-6 and flat.min() >= -1 - 1e-6


def test_sincos2d_similarity_makes_each_patch_most_similar_to_a_grid_neighbour():
    sim = vi.posemb_similarity(tiny(posemb="sincos2d", hidden_size=64, image_size=64)).reshape(64, 64).clone()
    sim.fill_diagonal_(-2.0)
    nearest = sim.argmax(dim=1)
    steps = [abs(i // 8 - j // 8) + abs(i % 8 - j % 8) for i, j in enumerate(nearest.tolist())]
    assert steps == [1] * 64


@pytest.mark.parametrize("posemb", ["relative", "none"])
def test_posemb_similarity_explains_kinds_without_an_embedding(posemb):
    with pytest.raises(ValueError, match=f"posemb='{posemb}'.*'learn', 'learn2d' and 'sincos2d'"):
        vi.posemb_similarity(tiny(posemb=posemb))


@settings(max_examples=6, deadline=None)
@given(k=st.integers(1, 40), patch=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_filter_pca_gives_unit_norm_orthogonal_components_in_decreasing_variance(k, patch, seed):
    torch.manual_seed(seed)
    model = tiny(patch_size=patch)
    filters = vi.embedding_filters(model, k=k)
    dims = min(32, 3 * patch * patch)  # at most D filters, at most C*p*p directions
    kept = min(k, dims)
    assert filters.image_like
    assert filters.components.shape == (kept, 3, patch, patch)
    flat = filters.components.reshape(kept, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(kept), atol=1e-4, rtol=0)
    assert (filters.variance[:-1] >= filters.variance[1:]).all()


def test_filter_pca_variance_is_the_variance_of_the_filters_along_each_component():
    model = tiny()
    filters = vi.embedding_filters(model, k=3)
    flat = model.embedding.weight.detach().reshape(32, -1)
    projected = (flat - flat.mean(0)) @ filters.components.reshape(3, -1).T  # (D, 3)
    torch.testing.assert_close(projected.var(dim=0), filters.variance, rtol=1e-4, atol=1e-7)


def test_filter_pca_reports_the_hybrid_embedding_is_not_image_like():
    stem = vitkit.ResNetConfig(units=(1, 1))  # stride 8, 512 channels
    model = VisionTransformer(vitkit.ViTConfig(image_size=32, patch_size=1, hybrid=stem, hidden_size=32, num_heads=2))
    filters = vi.embedding_filters(model, k=5)
    assert not filters.image_like
    assert "not image patches" in filters.note and "1x1" in filters.note
    assert filters.components.shape == (5, model.embedding.in_channels, 1, 1)


class LooksAtOneRegion(nn.Module):
    """A classifier whose logits depend only on the mean of rows 8..15, columns 16..23 of channel 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        evidence = x[:, 0, 8:16, 16:24].mean(dim=(-2, -1))
        return torch.stack([4 * evidence, -4 * evidence], dim=-1)


def test_occlusion_lights_up_the_only_region_the_model_looks_at():
    image = torch.full((3, 32, 32), -0.5)
    image[0, 8:16, 16:24] = 1.0
    occ = vi.occlusion_sensitivity(LooksAtOneRegion(), image, patch=8, stride=4)
    assert occ.target == 0 and occ.probability > 0.99
    inside = torch.zeros(32, 32, dtype=torch.bool)
    inside[8:16, 16:24] = True
    # Windows that reach the region hurt the prediction; pixels no such window covers stay exactly at zero.
    assert occ.drop[inside].min() > 0.1
    reach = torch.zeros(32, 32, dtype=torch.bool)
    reach[4:20, 12:28] = True
    assert (occ.drop[~reach] == 0).all()
    assert occ.drop.flatten().argmax() in inside.flatten().nonzero()


def test_occlusion_needs_a_patch_size_for_a_model_without_config():
    with pytest.raises(ValueError, match="pass patch="):
        vi.occlusion_sensitivity(LooksAtOneRegion(), torch.zeros(3, 32, 32))
    with pytest.raises(ValueError, match="stride=12 is wider than the 8 px window.*at most 8"):
        vi.occlusion_sensitivity(LooksAtOneRegion(), torch.zeros(3, 32, 32), patch=8, stride=12)  # NaN maps before


class FeaturesOfOneRegion(nn.Module):
    """A backbone (no head: `head` is nn.Identity) whose features are (mean of rows 8..15, columns 16..23 of
    channel 0, 1): hiding that region turns them, hiding the rest leaves them be."""

    head = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        evidence = x[:, 0, 8:16, 16:24].mean(dim=(-2, -1))
        return torch.stack([evidence, torch.ones_like(evidence)], dim=-1)


def test_occlusion_of_a_headless_model_measures_the_change_of_its_features():
    image = torch.full((3, 32, 32), -0.5)
    image[0, 8:16, 16:24] = 1.0
    occ = vi.occlusion_sensitivity(FeaturesOfOneRegion(), image, patch=8, stride=4)
    assert occ.measure == vi.FEATURES and occ.target is None and occ.probability == 1.0
    inside = torch.zeros(32, 32, dtype=torch.bool)
    inside[8:16, 16:24] = True
    reach = torch.zeros(32, 32, dtype=torch.bool)
    reach[4:20, 12:28] = True
    # The features' direction turns only where a window reaches the region: there 1 - cos is well above zero.
    assert occ.drop[inside].min() > 0.01 and occ.drop.max() <= 2
    assert occ.drop[~reach].abs().max() < 1e-6
    assert occ.drop.flatten().argmax() in inside.flatten().nonzero()
    with pytest.raises(ValueError, match="target=0: the model has no head"):
        vi.occlusion_sensitivity(FeaturesOfOneRegion(), image, target=0, patch=8)


def test_headless_vit_occlusion_is_one_minus_the_cosine_of_its_features_and_a_classifier_keeps_probability():
    backbone = tiny(num_classes=0)
    image = torch.randn(3, 32, 32)
    occ = vi.occlusion_sensitivity(backbone, image)  # 8 px windows, stride 4
    assert vi.has_no_head(backbone) and occ.measure == vi.FEATURES and occ.target is None
    # Pixel (0, 0) is covered by the first window only: its drop is that window's 1 - cos, computed here by hand.
    occluded = image.clone()
    occluded[:, :8, :8] = image.mean(dim=(-2, -1))[:, None, None]
    with torch.no_grad():
        cos = torch.nn.functional.cosine_similarity(backbone(occluded[None]), backbone(image[None]), dim=-1)
    torch.testing.assert_close(occ.drop[0, 0], 1 - cos[0], atol=1e-6, rtol=0)
    classifier = vi.occlusion_sensitivity(tiny(), image)
    assert classifier.measure == vi.PROBABILITY and classifier.target is not None and classifier.probability < 1


def test_attention_maps_are_the_class_token_rows_or_the_mean_over_queries():
    for classifier, query in (("token", vi.CLS_QUERY), ("gap", vi.GAP_QUERY)):
        model = tiny(classifier=classifier, init="trunc_normal")
        image = torch.randn(3, 32, 32)
        maps = vi.attention_maps(model, image)
        attention = model.forward_intermediates(image[None], attention=True)["attention"]
        expected = attention[1][0, 2, 0, 1:] if classifier == "token" else attention[1][0, 2].mean(dim=0)
        assert maps.maps.shape == (2, 4, 4, 4) and maps.query == query
        torch.testing.assert_close(maps.maps[1, 2].flatten(), expected)


def test_localisation_scores_a_map_peaked_in_the_box_against_the_box_area():
    maps = torch.zeros(2, 10, 10)
    maps[0, 2, 3] = 1.0  # inside box 0
    maps[1, 9, 9] = 1.0  # outside box 1
    loc = vi.localisation(maps, [(2, 1, 6, 5), (0, 0, 5, 5)])
    assert loc.hit_rate == 0.5 and loc.mass_inside == 0.5
    assert loc.chance == pytest.approx((16 / 100 + 25 / 100) / 2)


# --- end to end: a ViT trained on shapes looks at the shape --------------------------------------------------


@pytest.fixture(scope="module")
def shapes_maps():
    model = trained_shapes_vit()
    samples = held_out_shapes(model, count=40)
    rollout = torch.stack([vi.attention_rollout(model, x).upsampled for x in samples.images])
    occlusion = torch.stack([vi.occlusion_sensitivity(model, x).drop for x in samples.images])
    return vi.localisation(rollout, samples.boxes), vi.localisation(occlusion, samples.boxes)


@pytest.mark.slow
def test_trained_vit_rollout_peaks_inside_the_object_box_far_above_chance(shapes_maps):
    rollout, _ = shapes_maps
    # Measured: peak inside the box for 0.82 of 40 test images, positive mass 0.33; chance (box area) 0.16.
    assert rollout.chance < 0.2
    assert rollout.hit_rate > 3 * rollout.chance
    assert rollout.mass_inside > 1.5 * rollout.chance


@pytest.mark.slow
def test_trained_vit_occlusion_peaks_inside_the_object_box_above_chance(shapes_maps):
    _, occlusion = shapes_maps
    # Measured: peak inside the box for 0.85 of 40 test images, positive mass 0.60; chance (box area) 0.16.
    assert occlusion.hit_rate > 3 * occlusion.chance
    assert occlusion.mass_inside > 2 * occlusion.chance
