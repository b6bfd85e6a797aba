"""Training-step MFU of vitkit against timm on one GPU (bf16 autocast, flash SDPA, torch.compile), side by side.

MFU = model FLOPs per second (3x the forward FLOPs of `vitkit.flops`, multiply-add = 2; for vitkit those its
forward computes, whose last layer makes the class-token row alone: 6% fewer for ViT-B/16) over the GPU's dense
bf16 peak (`--peak-tflops`, 989 for an H100/H200 SXM). Both libraries run the same architecture, batch and
AdamW (fused), in interleaved rounds; medians. Usage (see benchmarks/gpu.sh):
`python benchmarks/gpu_train.py --model ViT-B/16 --batch 128 --device cuda`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from compare import build_timm

import vitkit
from vitkit.speed.benchmark import record_header, write_record


def step_fn(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, compile: bool):
    model.train()
    fused = x.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    net = torch.compile(model) if compile else model

    def run():
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            logits = net(x)
        F.cross_entropy(logits.float(), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-B/16")
    parser.add_argument("--model-args", type=json.loads, default={}, help="ViTConfig overrides as JSON")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    parser.add_argument(
        "--out", type=Path, help="write a JSON record of the results (benchmarks/results/gpu-train-MACHINE.json)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    config = vitkit.decode_variant(args.model, image_size=args.image_size, **args.model_args)
    x = torch.randn(args.batch, 3, *config.image_size, device=device)
    labels = torch.randint(0, config.num_classes, (args.batch,), device=device)
    runs = {
        "vitkit": step_fn(vitkit.VisionTransformer(config).to(device), x, labels, args.compile),
        "timm": step_fn(build_timm(config).to(device), x, labels, args.compile),
    }
    for run in runs.values():  # compile and warm up
        for _ in range(3):
            run()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                run()
            sync()
            times[name].append((time.perf_counter() - start) / args.steps)
    # The FLOPs each computes: vitkit's forward makes the last layer's class-token row alone (vitkit.flops docstring).
    train_flops = {k: 3 * vitkit.flops(config, pooled_only=k == "vitkit") * args.batch for k in runs}
    rate = {k: statistics.median(v) for k, v in times.items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} @ {args.image_size}px, batch {args.batch}, bf16, compile={args.compile}, {name}")
    for k, seconds in rate.items():
        mfu = train_flops[k] / seconds / (args.peak_tflops * 1e12)
        print(f"  {k:<7} {args.batch / seconds:9.1f} images/s   MFU {100 * mfu:5.1f}%   "
              f"vitkit/{k} = {rate[k] / rate['vitkit']:.3f}")  # fmt: skip
    if device.type == "cuda":
        print(f"  peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB (both models)")
    if args.out:
        rows = [
            {
                "library": k,
                "images_per_s": args.batch / seconds,
                "mfu": train_flops[k] / seconds / (args.peak_tflops * 1e12),
                "rounds_s": times[k],
            }
            for k, seconds in rate.items()
        ]
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        header = record_header("gpu-train")
        header["machine"]["device"] = device.type  # the tables name a GPU record by its GPU
        write_record(args.out, {**header, "device": name, "settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
