"""Training-step images/s of one model, eager against `torch.compile`, measured side by side in one process.

    python benchmarks/train_step.py                      # the main job's model, bf16 and fp32, 2 threads
    python benchmarks/train_step.py --model-args num_heads=2 --precisions bf16

Five ways to run the same step (forward, cross-entropy, backward, gradient clipping, AdamW), each but the first with
vitkit's kernels installed (`kernels.install`, as `vitkit train` does):
- "eager, stock layers": the plain model (`nn.Linear`, SDPA, the patch embedding's convolution), fused AdamW;
- "eager, Adam loop": the model as it runs without `--compile`, with AdamW's per-tensor loop;
- "eager, fused Adam": the same with AdamW's fused kernel (what `vitkit train` uses);
- "compiled, SDPA": `torch.compile` with attention left to `vitkit.speed.kernels.attend_sdpa`, the SDPA kernel (in fp32
  when the step is bf16, as eager training on a CPU does);
- "compiled, written out": `torch.compile` with `vitkit.speed.kernels.attend_explicit`, what `vitkit train --compile`
  runs on a CPU;
- "compiled, every patch": the same without patch dropout (`patch_dropout=0`), every patch token in every step; its
  ratio is to the first, which drops patches where the model does, so it measures what patch dropout saves (with
  `--model-args patch_dropout=0` every variant sees every patch, and the ratios compare compiled with eager).
Interleaved rounds, medians, ratios to the first; the CPU and its bf16 support are printed with them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vitkit.cli.parser import _mapping
from vitkit.models.architectures import new_model
from vitkit.speed import kernels
from vitkit.speed.benchmark import record_header, write_record
from vitkit.speed.machine import bf16_is_native
from vitkit.training.evaluation import autocast
from vitkit.training.fitted import fit_patch
from vitkit.training.recipes import MAIN_JOB_MODEL_ARGS

WRITTEN_OUT = kernels.attend_explicit


def sdpa(q, k, v, bias, dropout_p):
    """`kernels.attend_sdpa` in `attend_explicit`'s place (which returns the probabilities too)."""
    return kernels.attend_sdpa(q, k, v, bias, dropout_p), None


def step_runner(args, precision: str, compiled: bool, fused: bool, attention, installed: bool = True, **changes):
    model = new_model(args.model, **{**MAIN_JOB_MODEL_ARGS, "num_classes": 10, "in_chans": 1, "image_size": 28,
                                     **args.model_args, **changes})  # fmt: skip
    if installed:
        kernels.install(model)
    net = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=fused or None)
    x = torch.randn(args.batch, model.config.in_chans, *model.config.image_size)
    labels = torch.randint(0, model.config.num_classes, (args.batch,))

    def run():
        kernels.attend_explicit = (
            attention  # read when the compiler traces `attend`; the guards keep each variant's graph
        )
        with autocast(torch.device("cpu"), precision):
            logits = net(x)
        F.cross_entropy(logits.float(), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The main job's: `vitkit train` picks ViT-Ti with the patch fitted to its 28 px images (TrainConfig.model is None).
    p.add_argument("--model", default=f"ViT-Ti/{fit_patch(28)}")
    p.add_argument("--model-args", type=_mapping, default={}, help="ViTConfig overrides of the main job's model")
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-seconds", type=float, default=1.5)
    p.add_argument(
        "--out", type=Path, help="write a JSON record of the results (benchmarks/results/train-step-MACHINE.json)"
    )
    args = p.parse_args()
    rows = []
    torch.set_num_threads(args.threads)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, bf16 native: {bf16_is_native('cpu')}, "
          f"{args.threads} threads, torch {torch.__version__}; {args.model} {args.model_args or ''} "
          f"batch {args.batch}; "
          f"training-step images/s, median of {args.rounds} interleaved rounds of >= {args.min_seconds} s")  # fmt: skip
    for precision in args.precisions:
        runs = {
            "eager, stock layers": step_runner(args, precision, False, True, WRITTEN_OUT, installed=False),
            "eager, Adam loop": step_runner(args, precision, False, False, WRITTEN_OUT),
            "eager, fused Adam": step_runner(args, precision, False, True, WRITTEN_OUT),
            "compiled, SDPA": step_runner(args, precision, True, True, sdpa),
            "compiled, written out": step_runner(args, precision, True, True, WRITTEN_OUT),
            "compiled, every patch": step_runner(args, precision, True, True, WRITTEN_OUT, patch_dropout=0.0),
        }
        for name, run in runs.items():
            started = time.perf_counter()
            for _ in range(3):
                run()
            print(f"  {precision} {name}: warm-up (compiling) {time.perf_counter() - started:.1f} s", flush=True)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                started, n = time.perf_counter(), 0
                while n == 0 or time.perf_counter() - started < args.min_seconds:  # one step at least
                    run()
                    n += 1
                rates[name].append(args.batch * n / (time.perf_counter() - started))
        first = statistics.median(next(iter(rates.values())))
        for name, values in rates.items():
            rate = statistics.median(values)
            print(f"{precision:5s} {name:24s} {rate:7.0f} images/s  {rate / first:.2f}x")
            rows.append(
                {"precision": precision, "variant": name, "images_per_s": rate, "ratio": rate / first, "rounds": values}
            )
    kernels.attend_explicit = WRITTEN_OUT
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        write_record(args.out, {**record_header("train-step"), "settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
