"""A small ViT trained on the synthetic shapes for the end-to-end inspection tests, once per test session.

A plain loop (the training module lives elsewhere): Adam with a one-cycle schedule, 500 batches of 64 from 6000
images of the `shapes` train split at 32 px; 4x4 patches of 8 px, 3 layers of width 64, global average pooling
(which localised better than a class token in a short trial). About 25 s on one core; it reaches only
about 32% test accuracy (chance 17%), yet already looks at the shape.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import vitkit
from vitkit.analysis.report import Samples, dataset_samples
from vitkit.data.datasets import ShapesDataset

IMAGE_SIZE = 32
TRAIN_IMAGES = 6000
STEPS = 500
BATCH = 64


@functools.cache
def trained_shapes_vit() -> vitkit.VisionTransformer:
    dataset = ShapesDataset(size=TRAIN_IMAGES, image_size=IMAGE_SIZE, split="train")
    images = vitkit.data.datasets.to_input(torch.stack([dataset[i][0] for i in range(len(dataset))]))
    labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    torch.manual_seed(0)
    config = vitkit.ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=8,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        mlp_dim=128,
        num_classes=6,
        classifier="gap",
    )
    model = vitkit.VisionTransformer(config)
    model.class_names = list(ShapesDataset.classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    # Matrices this small gain nothing from a second thread, and on shared cores two threads were 15x slower.
    torch.set_num_threads(1)
    try:
        for _ in range(STEPS):
            batch = torch.randint(0, len(dataset), (BATCH,), generator=generator)
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def held_out_shapes(model: vitkit.VisionTransformer, count: int) -> Samples:
    """The first `count` images of the shapes test split at the model's resolution, with their boxes."""
    return dataset_samples("shapes", count, model)
