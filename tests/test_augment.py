import math

import pytest
import torch
import torch.nn.functional as F

from vitkit.data.augment import AugmentConfig, crop_and_resize, crop_boxes, eval_batch, random_draws, train_batch


def draws(n: int, seed: int = 0) -> torch.Tensor:
    return random_draws(n, torch.Generator().manual_seed(seed))


def test_inception_crop_boxes_follow_the_official_area_and_aspect_ranges():
    h, w, n = 120, 90, 4000
    boxes = crop_boxes(h, w, draws(n), scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3))
    bw, bh = (boxes[:, 2] - boxes[:, 0]).float(), (boxes[:, 3] - boxes[:, 1]).float()
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
    area = bw * bh / (h * w)
    full = (bw == w) & (bh == h)  # the fallback when no try fits
    assert area[~full].min() >= 0.04 and area.max() <= 1.0
    ratio = bw[~full] / bh[~full]
    assert ratio.min() >= 3 / 4 * 0.9 and ratio.max() <= 4 / 3 * 1.1  # up to rounding of small boxes
    assert area.min() < 0.07 and area.median() < 0.6  # the whole range is used, not only large crops
    # log-uniform aspect ratio: on a square image, about as many wide crops as tall ones
    square = crop_boxes(100, 100, draws(n, 1), scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3)).float()
    ratio = (square[:, 2] - square[:, 0]) / (square[:, 3] - square[:, 1])
    assert abs(float((ratio > 1).float().mean() - (ratio < 1).float().mean())) < 0.06


def test_crop_boxes_never_leave_a_tall_narrow_image():
    boxes = crop_boxes(200, 10, draws(500), scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3))
    assert (boxes[:, 2] <= 10).all() and (boxes[:, 3] <= 200).all() and (boxes[:, 0] >= 0).all()


def test_whole_image_crop_is_the_identity_and_train_equals_eval_without_augmentation():
    images = torch.randint(0, 256, (4, 3, 12, 10), dtype=torch.uint8)
    full = torch.tensor([[0, 0, 10, 12]] * 4)
    assert torch.equal(crop_and_resize(images, full, (12, 10)), images)
    none = AugmentConfig(crop_scale=(1.0, 1.0), crop_ratio=(10 / 12, 10 / 12), flip=False)
    x, y = train_batch(images, torch.arange(4), draws(4), (12, 10), none, num_classes=4)
    assert torch.equal(x, eval_batch(images, (12, 10))) and torch.equal(y, torch.arange(4))
    assert x.min() >= -1 and x.max() <= 1 and torch.allclose(x, images.float() / 127.5 - 1)
    # The whole image at another model resolution is still resized (only the same size skips roi_align).
    assert train_batch(images, torch.arange(4), draws(4), (24, 20), none, num_classes=4)[0].shape == (4, 3, 24, 20)


def test_eval_resizes_the_whole_image_bilinearly_to_the_model_resolution():
    images = torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)
    x = eval_batch(images, (56, 56))
    expected = F.interpolate(images.float().expand(-1, 3, -1, -1), size=(56, 56), mode="bilinear", antialias=True)
    assert x.shape == (2, 3, 56, 56) and torch.allclose(x, expected / 127.5 - 1, atol=1e-5)


def test_a_crop_is_resized_from_exactly_its_box():
    image = torch.arange(64, dtype=torch.uint8).reshape(1, 1, 8, 8)
    out = crop_and_resize(image, torch.tensor([[2, 4, 6, 8]]), (4, 4))
    assert torch.equal(out, image[:, :, 4:8, 2:6])


def test_flip_mirrors_about_half_the_images_and_is_off_for_digits():
    images = torch.randint(0, 256, (200, 1, 8, 8), dtype=torch.uint8)
    cfg = AugmentConfig(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip=True)
    x, _ = train_batch(images, torch.zeros(200, dtype=torch.long), draws(200), (8, 8), cfg, 10)
    plain = eval_batch(images, (8, 8))
    flipped = (x == plain.flip(-1)).flatten(1).all(1)
    assert ((x == plain).flatten(1).all(1) | flipped).all() and 70 < int(flipped.sum()) < 130
    from vitkit.data.datasets import get_dataset

    assert get_dataset("mnist-5k", "test").flip is False


def test_mixup_and_randaugment_are_reproducible_from_the_draws():
    images = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    cfg = AugmentConfig(crop_scale=(0.5, 1.0), randaugment=(2, 9), mixup=0.8)
    a = train_batch(images, labels, draws(6, 3), (16, 16), cfg, 3)
    b = train_batch(images, labels, draws(6, 3), (16, 16), cfg, 3)
    c = train_batch(images, labels, draws(6, 4), (16, 16), cfg, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    assert a[1].shape == (6, 3) and torch.allclose(a[1].sum(1), torch.ones(6))


def test_images_of_different_sizes_are_cropped_to_one_batch():
    images = [torch.randint(0, 256, (3, 20 + i, 30 - i), dtype=torch.uint8) for i in range(5)]
    x, _ = train_batch(images, torch.zeros(5, dtype=torch.long), draws(5), (16, 16), AugmentConfig(), 2)
    assert x.shape == (5, 3, 16, 16) and eval_batch(images, (16, 16)).shape == (5, 3, 16, 16)


def test_augment_config_rejects_bad_ranges():
    with pytest.raises(ValueError, match="crop_scale"):
        AugmentConfig(crop_scale=(0.0, 1.0))
    with pytest.raises(ValueError, match="mixup"):
        AugmentConfig(mixup=-1.0)
    assert math.isclose(AugmentConfig().crop_scale[0], 0.05)
