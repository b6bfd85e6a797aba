"""Inference throughput of vitkit, timm and Hugging Face on the same ViT, measured side by side.

The three models run in interleaved rounds in one process, so machine noise hits them alike; the ratios are
what to read. Usage: `python benchmarks/throughput.py [--model ViT-B/16] [--batch 8] [--rounds 5] [--bf16]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vitkit


def build_timm(config: vitkit.ViTConfig) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=config.image_size,
        patch_size=config.patch_size,
        embed_dim=config.hidden_size,
        depth=config.num_layers,
        num_heads=config.num_heads,
        mlp_ratio=config.mlp_dim / config.hidden_size,
        num_classes=config.num_classes,
    )


def build_hf(config: vitkit.ViTConfig) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    hf = ViTConfig(
        image_size=config.image_size[0],
        patch_size=config.patch_size[0],
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        intermediate_size=config.mlp_dim,
        num_labels=config.num_classes,
    )
    return ViTForImageClassification(hf)


def images_per_second(model: torch.nn.Module, x: torch.Tensor, bf16: bool, steps: int) -> float:
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        start = time.perf_counter()
        for _ in range(steps):
            model(x)
        return steps * x.shape[0] / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-B/16")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="forward passes per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    args = parser.parse_args()

    config = vitkit.decode_variant(args.model, image_size=args.image_size)
    models = {"vitkit": vitkit.VisionTransformer(config), "timm": build_timm(config), "hf": build_hf(config)}
    x = torch.randn(args.batch, 3, *config.image_size)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():
        model.eval()
        images_per_second(model, x, args.bf16, 1)  # warm-up
    for _ in range(args.rounds):
        for name, model in models.items():
            rates[name].append(images_per_second(model, x, args.bf16, args.steps))
    best = {name: statistics.median(r) for name, r in rates.items()}
    print(
        f"{args.model} @ {args.image_size}px, batch {args.batch}, {'bf16' if args.bf16 else 'fp32'}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds"
    )
    for name, rate in best.items():
        print(f"  {name:<7} {rate:8.2f} images/s   vitkit / {name} = {best['vitkit'] / rate:.3f}")


if __name__ == "__main__":
    main()
