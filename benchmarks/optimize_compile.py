"""`vitkit.optimize(model, "fp32", compile=True)` with the model's oneDNN layers (`kernels.linear`, where the CPU
takes them) against the same compile with the layers as `F.linear` (inductor's freezing then packs the GEMMs
itself), and the packed eager copy (`optimize`'s default), side by side in interleaved rounds.

    python benchmarks/optimize_compile.py [--model ViT-S/16] [--model-args JSON] [--batch 8] [--rounds 7]

`kernels.ONEDNN_FP32` is a module constant that `torch.compile` guards on; each copy is compiled, and called, with
the value it is measured under. On CPUs where it is False (Intel, AVX2 only) both compiled copies are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import vitkit
from vitkit.speed import kernels, machine
from vitkit.speed.benchmark import record_header, write_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-S/16")
    parser.add_argument("--model-args", default="{}", help="ViTConfig overrides as JSON, e.g. '{\"num_layers\": 2}'")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--out", type=Path, help="write a JSON record of the results (benchmarks/results/optimize-compile-MACHINE.json)"
    )
    args = parser.parse_args()
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, Intel {machine.cpu_is_intel()}, "
          f"oneDNN layers here {kernels.ONEDNN_FP32}, torch {torch.__version__}")  # fmt: skip

    torch.manual_seed(0)
    model = vitkit.create_model(args.model, **json.loads(args.model_args)).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a new model's head is zero: its logits would all be 0
    x = torch.randn(args.batch, model.config.in_chans, *model.config.image_size)
    with torch.no_grad():
        reference = model(x)

    native = kernels.ONEDNN_FP32  # this CPU's choice, put back after each phase
    copies = {}  # name: (module, the ONEDNN_FP32 it runs under)
    for name, onednn in (("compiled, oneDNN layers", True), ("compiled, F.linear layers", False)):
        kernels.ONEDNN_FP32 = onednn
        start = time.perf_counter()
        fast = vitkit.optimize(model, "fp32", compile=True)
        with torch.no_grad():
            out = fast(x)
        diff = (out - reference).abs().max().item()
        print(f"{name}: compiled in {time.perf_counter() - start:.0f} s, max |diff| {diff:.1e}", flush=True)
        copies[name] = (fast, onednn)
    kernels.ONEDNN_FP32 = native
    copies["packed eager (the default)"] = (vitkit.optimize(model, "fp32"), native)

    def call(module: torch.nn.Module, onednn: bool) -> float:
        kernels.ONEDNN_FP32 = onednn
        with torch.no_grad():
            start = time.perf_counter()
            module(x)
            return time.perf_counter() - start

    for module, onednn in copies.values():
        call(module, onednn)  # warm
    times: dict[str, list[float]] = {name: [] for name in copies}
    for _ in range(args.rounds):
        for name, (module, onednn) in copies.items():
            times[name].append(call(module, onednn))
    kernels.ONEDNN_FP32 = native
    median = {name: statistics.median(t) for name, t in times.items()}
    first = median["compiled, oneDNN layers"]
    for name, t in median.items():
        print(f"{name:28s} {args.batch / t:7.1f} images/s   {first / t:5.2f}x of compiled with oneDNN layers")
    if args.out:
        rows = [
            {"variant": name, "images_per_s": args.batch / t, "ratio": first / t, "rounds_s": times[name]}
            for name, t in median.items()
        ]
        settings = {
            "model": args.model,
            "model_args": json.loads(args.model_args),
            "batch": args.batch,
            "rounds": args.rounds,
        }
        write_record(args.out, {**record_header("optimize-compile"), "settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
