"""What a dataset's images are like, read off a sample of them: their typical size and colour (`describe`, which a
trained model keeps as `trained_on`, for `predict` to notice inputs unlike it), whether the dataset makes them at one
size of its own, the augmentation it asks for, and whether mirroring keeps their class (`survey`, what
`fitted.fit_to_data` chooses the defaults from)."""

from __future__ import annotations

import torch

from .datasets import ImageArrayDataset, LabelledDataset, dataset_augmentation, own_size, spread_indices, to_input

SMALL_IMAGES = 64  # image files whose longer side is below this are small: trained near their size, not cropped


def describe(name: str, dataset: LabelledDataset, probe: int = 16) -> dict:
    """What a model trained on `dataset` has seen, for `predict` to notice inputs unlike it: the dataset's
    `name`, whether its images are `grayscale` (one channel, or three equal ones) and their typical
    `image_size` [H, W] (the median of `probe` images spread over the dataset, for datasets decoded from files)."""
    images: list[torch.Tensor] | torch.Tensor
    if isinstance(dataset, ImageArrayDataset):
        images = dataset.images[:probe]
    else:
        probed = [dataset[i][0] for i in spread_indices(len(dataset), probe)]
        images = [im for im in probed if isinstance(im, torch.Tensor)]  # not the files that failed to decode
    if not len(images):
        return {"data": name, "grayscale": False, "image_size": None}
    gray = all(im.shape[0] == 1 or bool((im == im[:1]).all()) for im in images)
    sizes = sorted(tuple(im.shape[-2:]) for im in images)
    return {"data": name, "grayscale": gray, "image_size": list(sizes[len(sizes) // 2])}


def survey(name: str, dataset: LabelledDataset, mirror: bool = True) -> dict:
    """What `fitted.fit_to_data` needs to know of the images: `describe`'s (typical size, grayscale), how many
    `images` there are, whether the size is the dataset's `own_size` (else: image files), the augmentation it asks
    for, and with `mirror`, for small image files, whether mirroring keeps their class (`mirror_agreement`; None
    otherwise). The mirror test reads a thousand images: ask for it only where the flip is left to the defaults."""
    crop_scale, flip = dataset_augmentation(dataset)
    seen = describe(name, dataset)
    files = own_size(dataset) is None
    small = files and seen["image_size"] is not None and max(seen["image_size"]) < SMALL_IMAGES
    agreement = mirror_agreement(dataset, seen["image_size"]) if small and mirror else None
    return {
        **seen,
        "images": len(dataset),
        "own_size": not files,
        "crop_scale": crop_scale,
        "flip": flip,
        "mirror": agreement,
    }


MIRROR_PROBE = 1000  # images `mirror_agreement` reads: about a second of decoding for small files


def mirror_agreement(dataset: LabelledDataset, image_size: list[int], probe: int = MIRROR_PROBE) -> float | None:
    """How much of a nearest-class-mean classifier's accuracy survives mirroring the images left to right: its
    accuracy on mirrored held-out images over that on the images as they are, from `probe` images drawn with a
    fixed seed (half for the class means, half held out). About 1 where the classes look the same mirrored
    (silhouettes, clothes, photographs); well below where mirroring changes or breaks the class (digits, letters).
    None where the classifier is too weak to tell (held-out accuracy under 1.5x chance)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:probe].tolist()
    read = {i: dataset[i] for i in sorted(order)}  # in file order: packed shards decode each row group once
    samples = [read[i] for i in order]
    samples = [(im, label) for im, label in samples if isinstance(im, torch.Tensor)]  # not the files that failed
    if len(samples) < 4:
        return None
    size = (image_size[0], image_size[1])
    x = torch.cat([to_input(im, size, 3) for im, _ in samples])  # (N, 3, H, W), in [-1, 1]
    y = torch.tensor([label for _, label in samples])
    half = len(y) // 2
    classes = y[:half].unique()
    means = torch.stack([x[:half][y[:half] == c].mean(0) for c in classes])  # (K, 3, H, W)

    def accuracy(images: torch.Tensor) -> float:
        nearest = torch.cdist(images.flatten(1), means.flatten(1)).argmin(1)
        return float((classes[nearest] == y[half:]).float().mean())

    plain = accuracy(x[half:])
    if plain < 1.5 / len(classes):
        return None
    return accuracy(x[half:].flip(-1)) / plain
