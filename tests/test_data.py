import pytest
import torch

from vitkit.data import ShapesDataset


def test_shapes_are_deterministic_and_splits_differ():
    a, b = ShapesDataset(8, 48), ShapesDataset(8, 48)
    assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(8))
    test = ShapesDataset(8, 48, split="test")
    assert not torch.equal(a[0][0], test[0][0])


def test_shapes_object_lies_inside_its_box():
    ds = ShapesDataset(40, 64)
    checked = 0
    for i in range(40):
        image, label = ds[i]
        assert image.shape == (3, 64, 64) and image.dtype == torch.uint8 and 0 <= label < len(ds.classes)
        x0, y0, x1, y1 = ds.box(i)
        assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
        if ds.classes[label] == "ring":  # the only shape with a hollow centre
            continue
        colour = image[:, (y0 + y1 - 1) // 2, (x0 + x1 - 1) // 2]
        is_fg = (image == colour[:, None, None]).all(dim=0)
        inside = is_fg[y0:y1, x0:x1].sum().item()
        assert inside >= 0.2 * (x1 - x0) * (y1 - y0) and is_fg.sum().item() == inside
        checked += 1
    assert checked > 20


def test_shapes_reject_bad_arguments():
    with pytest.raises(ValueError, match="split='val'"):
        ShapesDataset(split="val")
    with pytest.raises(ValueError, match="image_size=8"):
        ShapesDataset(image_size=8)


def test_to_input_scales_to_minus_one_one_and_replicates_gray():
    from vitkit.data import to_input

    gray = torch.tensor([[[0, 255], [255, 0]]], dtype=torch.uint8)  # (1, 2, 2)
    x = to_input(gray)
    assert x.shape == (1, 3, 2, 2) and x.min() == -1 and x.max() == 1
    assert to_input(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), 16).shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="uint8"):
        to_input(torch.zeros(3, 8, 8))
