"""Figures for docs/SCALING.md: training throughput and memory per variant here, and the paper's runs on paper.

`python benchmarks/scaling.py measure [--variants ViT-Ti/16 ViT-S/16 ViT-B/16] [--batch 4] [--steps 3]`
    trains each variant for a few steps (fp32, AdamW, 224 px, this process's threads), each in its own
    subprocess so that its peak resident memory is its own; prints images/s of the training step (the best
    step) and the peak resident memory above that of the process before the model was built.
`python benchmarks/scaling.py plan [--mfu 0.4] [--peak-tflops 989] [--gpus 8 64 256]`
    the arithmetic for ViT-L/16 and ViT-H/14 on JFT-300M and ImageNet-21k: FLOPs per image (`vitkit.flops`),
    GPU-days at the stated utilisation, and memory per GPU under DDP and FSDP at a global batch of 4096.
Activation memory per image is measured on the meta device (no memory allocated): the bytes of the tensors
autograd saves for backward in one training forward at batch 1, with and without gradient checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from vitkit.models.config import decode_variant
from vitkit.models.efficiency import count_params, flops
from vitkit.models.vit import VisionTransformer
from vitkit.speed.benchmark import record_header, write_record

GIB = 2**30
STATE_BYTES = 16  # per parameter in training: fp32 weight 4 + fp32 gradient 4 + Adam's two fp32 moments 8
# The paper's pre-training runs (Table 6 and section 4.1): images per epoch, epochs, TPUv3-core-days (Table 2).
RUNS = [
    ("ViT-L/16", "JFT-300M", 303e6, 7, 680),
    ("ViT-H/14", "JFT-300M", 303e6, 14, 2500),
    ("ViT-L/16", "ImageNet-21k", 14.2e6, 90, 230),
    ("ViT-H/14", "ImageNet-21k", 14.2e6, 90, None),
]


def activation_bytes(name: str, image_size: int = 224, checkpointing: bool = False) -> int:
    """Bytes autograd keeps for backward after a training forward of one image (parameters not counted)."""
    with torch.device("meta"):
        model = VisionTransformer(decode_variant(name, image_size=image_size, num_classes=1000))
    model.set_grad_checkpointing(checkpointing)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.zeros(1, 3, image_size, image_size, device="meta"))
    return sum(saved.values())


def measure_one(name: str, batch: int, steps: int) -> dict:
    """Run in a subprocess: a few AdamW steps at 224 px, the last `steps` timed."""
    torch.manual_seed(0)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch and vitkit loaded, no model
    model = VisionTransformer(decode_variant(name, image_size=224, num_classes=1000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
    times = []
    for _ in range(steps + 1):  # the first step allocates the optimiser state
        tick = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - tick)
    seconds = min(times[1:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "model": name,
        "batch": batch,
        "images_per_s": batch / seconds,
        "peak_rss": peak - baseline,
        "rounds_s": times[1:],
    }


def cmd_measure(args: argparse.Namespace) -> None:
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} thread(s), fp32, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"{'model':<10}{'params':>9}{'batch':>6}{'img/s':>8}{'+peak RSS':>10}{'state 16B/p':>12}"
          f"{'act/img':>9}{'ckpt act/img':>13}")  # fmt: skip
    rows = []
    for name in args.variants:
        call = f"measure_one({name!r}, {args.batch}, {args.steps})"
        code = f"import json, benchmarks.scaling as s; print(json.dumps(s.{call}))"
        root = Path(__file__).resolve().parents[1]  # where `benchmarks.scaling` imports from, wherever this runs
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
        r = json.loads(out.strip().splitlines()[-1])
        params = count_params(decode_variant(name, image_size=224, num_classes=1000))
        print(f"{name:<10}{params / 1e6:>8.1f}M{r['batch']:>6}{r['images_per_s']:>8.2f}{r['peak_rss'] / GIB:>9.2f}G"
              f"{params * STATE_BYTES / GIB:>11.2f}G{activation_bytes(name) / 2**20:>8.0f}M"
              f"{activation_bytes(name, checkpointing=True) / 2**20:>12.0f}M")  # fmt: skip
        rows.append(
            {
                **r,
                "params": params,
                "state_bytes": params * STATE_BYTES,
                "activation_bytes": activation_bytes(name),
                "checkpointed_activation_bytes": activation_bytes(name, checkpointing=True),
            }
        )
    if args.out:
        settings = {"batch": args.batch, "steps": args.steps, "load_average": os.getloadavg()[0]}
        write_record(args.out, {**record_header("scaling"), "settings": settings, "rows": rows})


def cmd_plan(args: argparse.Namespace) -> None:
    rate = args.mfu * args.peak_tflops * 1e12
    print(f"Training FLOPs = 3 x forward (backward = 2 x forward); {args.mfu:.0%} MFU of {args.peak_tflops:g} TFLOP/s "
          f"= {rate / 1e12:.0f} TFLOP/s per GPU; global batch {args.batch}")  # fmt: skip
    print(f"{'run':<24}{'GFLOP/img':>10}{'images':>9}{'total FLOP':>12}{'GPU-days':>10}{'paper TPUv3-core-days':>23}")
    for name, data, images, epochs, paper in RUNS:
        forward = flops(decode_variant(name, image_size=224, num_classes=1000))
        seen = images * epochs
        total = 3 * forward * seen
        print(f"{name + ' ' + data:<24}{forward / 1e9:>10.1f}{seen / 1e9:>8.2f}B{total:>12.2e}"
              f"{total / rate / 86400:>10.0f}{paper if paper else '-':>23}")  # fmt: skip
    print()
    print("Memory per GPU at global batch 4096, bf16 autocast, gradient checkpointing (activations: fp32 bytes / 2)")
    print(f"{'model':<10}{'GPUs':>6}{'img/GPU':>8}{'DDP state':>10}{'FSDP state':>11}{'act (ckpt)':>11}")
    for name in ("ViT-L/16", "ViT-H/14"):
        config = decode_variant(name, image_size=224, num_classes=1000)
        params = count_params(config)
        per_block = params / config.num_layers
        act = activation_bytes(name, checkpointing=True) / 2
        block_act = (activation_bytes(name) - activation_bytes(name, checkpointing=True)) / config.num_layers / 2
        for gpus in args.gpus:
            per_gpu = args.batch // gpus
            ddp = params * STATE_BYTES
            fsdp = params * STATE_BYTES / gpus + 2 * per_block * 2  # + two gathered bf16 blocks (one prefetched)
            print(f"{name:<10}{gpus:>6}{per_gpu:>8}{ddp / GIB:>9.1f}G{fsdp / GIB:>10.2f}G"
                  f"{(act + block_act) * per_gpu / GIB:>10.1f}G")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("measure")
    p.add_argument("--variants", nargs="+", default=["ViT-Ti/16", "ViT-S/16", "ViT-B/16"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--out", type=Path, help="write a JSON record of the results (benchmarks/results/scaling-MACHINE.json)"
    )
    p.set_defaults(func=cmd_measure)
    p = sub.add_parser("plan")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM)")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--batch", type=int, default=4096)
    p.set_defaults(func=cmd_plan)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
