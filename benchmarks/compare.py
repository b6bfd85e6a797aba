"""vitkit against timm and Hugging Face on the same ViT, measured side by side, written as a JSON record.

For each model, batch size, precision and kind (inference, or a training step: forward, backward, AdamW), every
contender runs in interleaved rounds in this one process (each round led by another one) and the median is kept,
so that noise from other work on the machine hits all of them alike; the ratios are what to read (vitkit over the
best peer: the median of the two's ratios within each round, which cancels the machine's drift between rounds).
Contenders:

- vitkit: the plain `model(x)` (bf16: autocast) and `vitkit.optimize(model, precision)` (bf16: weights cast once);
- timm: eager (bf16: autocast), and its best CPU option, `torch.utils.mkldnn.to_mkldnn` or `torch.compile`
  (both measured, the faster one kept per cell);
- Hugging Face `ViTForImageClassification` (SDPA attention; bf16: autocast).

Training steps: vitkit, timm and Hugging Face eager (bf16: autocast), the same AdamW.

The process keeps freed memory for the next allocation (`vitkit.machine.retain_freed_memory`, as the `vitkit`
command does), which speeds every contender alike.

Usage: `python benchmarks/compare.py` (the full table: ViT-S/16 and ViT-B/16 at 224, batch 1, 8 and 64, fp32
and bf16, inference and training; long on a small CPU) or a part of it, e.g.
`python benchmarks/compare.py --models ViT-S/16 --batches 1 8 --precisions fp32 --no-compile`.
`--out benchmarks/results/compare-MACHINE-PART.json` writes the record (machine, versions, date, commit, command,
every round), from which `python benchmarks/tables.py` makes the tables of docs/PERFORMANCE.md and the README. On a
machine whose speed changes from second to second, `--min-seconds 0 --rounds 30` times one call per contender and
round: paired single calls, the order rotated each round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.mkldnn

import vitkit
from vitkit import machine
from vitkit.benchmark import record_header, write_record


def build_timm(config: vitkit.ViTConfig) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**vitkit.formats.timm.model_args(config))  # the same arguments as vitkit's timm export


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
        attn_implementation="sdpa",
    )
    return ViTForImageClassification(hf)


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def inference_runner(model: torch.nn.Module, x: torch.Tensor, autocast: bool):
    def run():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits_of(model(x))

    return run


def train_runner(model: torch.nn.Module, x: torch.Tensor, bf16: bool):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    labels = torch.randint(0, 1000, (x.shape[0],))

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = logits_of(model(x))
        F.cross_entropy(logits.float(), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def contenders(name: str, batch: int, precision: str, kind: str, compile: bool) -> dict:
    """name -> a callable doing one batch; options that do not run here are left out with a note."""
    config = vitkit.decode_variant(name)
    x = torch.randn(batch, 3, *config.image_size)
    bf16 = precision == "bf16"
    vit, timm, hf = vitkit.VisionTransformer(config), build_timm(config), build_hf(config)
    if kind == "train":
        return {"vitkit": train_runner(vit, x, bf16), "timm": train_runner(timm, x, bf16),
                "HF": train_runner(hf, x, bf16)}  # fmt: skip
    for m in (vit, timm, hf):
        m.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated bf16 is measured all the same; the header says it is
        fast = vitkit.optimize(vit, precision)
    runs = {
        "vitkit": inference_runner(vit, x, bf16),
        "vitkit optimized": inference_runner(fast, x, False),
        "timm": inference_runner(timm, x, bf16),
        "HF": inference_runner(hf, x, bf16),
    }
    try:
        mkldnn = torch.utils.mkldnn.to_mkldnn(build_timm(config).eval(), torch.bfloat16 if bf16 else torch.float)
        runner = inference_runner(mkldnn, x, bf16)
        runner()
        runs["timm to_mkldnn"] = runner
    except (RuntimeError, TypeError) as e:
        print(f"  timm to_mkldnn does not run for {precision}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
    if compile:
        compiled = torch.compile(build_timm(config).eval())
        runs["timm compile"] = inference_runner(compiled, x, bf16)
    return runs


def seconds_per_call(run, min_seconds: float) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        run()
        calls += 1
        spent = time.perf_counter() - start
        if spent >= min_seconds:
            return spent / calls


def measure(runs: dict, rounds: int, min_seconds: float, batch: int) -> dict[str, list[float]]:
    """images/s per contender in each of the interleaved rounds, after one warm-up call each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(rounds):  # each round starts with another contender, so none always runs first
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(seconds_per_call(runs[name], min_seconds))
    return {name: [batch / t for t in ts] for name, ts in times.items()}


def summarise(cell: dict) -> dict:
    """A cell's medians and vitkit's ratio over the best peer (the peer of the highest median): the median of the two's
    ratios round by round, so that the machine's drift between rounds cancels. Inference: the optimized copy."""
    rounds = cell["rounds"]
    medians = {k: statistics.median(v) for k, v in rounds.items()}
    peers = {k: v for k, v in medians.items() if not k.startswith("vitkit")}
    ours = "vitkit optimized" if "vitkit optimized" in medians else "vitkit"
    best_peer = max(peers, key=peers.get)
    ratio = statistics.median(a / b for a, b in zip(rounds[ours], rounds[best_peer], strict=True))
    return {**cell, "images_per_s": medians, "ratio": ratio, "best_peer": best_peer}


def table(rows: list[dict]) -> str:
    """Markdown: median images/s of each contender, and vitkit over the best peer."""
    head = ("| model | batch | precision | kind | vitkit | vitkit optimized | timm | timm best CPU option | HF "
            "| vitkit / best peer |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        rates = r["images_per_s"]
        timm_best = max((k for k in rates if k.startswith("timm ")), key=rates.get, default=None)

        def cell(key, rates=rates):
            return f"{rates[key]:.2f}" if key in rates else "-"

        best = f"{cell(timm_best)} ({timm_best.split(' ', 1)[1]})" if timm_best else "-"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['precision']} | {r['kind']} | {cell('vitkit')} | "
            f"{cell('vitkit optimized')} | {cell('timm')} | {best} | {cell('HF')} | "
            f"**{r['ratio']:.2f}x** ({r['best_peer']}) |"
        )
    return "\n".join(lines)


def record(args: argparse.Namespace) -> dict:
    """The JSON record of this run, without its rows."""
    import timm
    import transformers

    return {
        **record_header("compare"),
        "versions": {"timm": timm.__version__, "transformers": transformers.__version__},
        "settings": {
            "rounds": args.rounds,
            "min_seconds": args.min_seconds,
            "retain_freed_memory": args.retained,
            "compile": args.compile,
        },
        "source": "run",
        "rows": [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["ViT-S/16", "ViT-B/16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    parser.add_argument("--kinds", nargs="+", default=["inference", "train"], choices=("inference", "train"))
    parser.add_argument(
        "--train-batches", type=int, nargs="+", help="batch sizes of the training step (default: --batches)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="shortest timing per contender and round")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="leave out timm + torch.compile")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, help="the JSON record to write (benchmarks/results/compare-MACHINE-PART.json)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.retained = machine.retain_freed_memory()  # as the `vitkit` command does: for every contender alike
    result = record(args)
    m = result["machine"]
    where = f"{m['cpu']}, CPU capability {m['cpu_capability']}, bf16 native: {m['bf16_native_cpu']}"
    print(
        f"{where}, {m['threads']} threads; images/s, median of {args.rounds} interleaved rounds; the ratio is the "
        "median of the rounds' ratios",
        flush=True,
    )
    for name in args.models:
        for kind in args.kinds:
            for precision in args.precisions:
                for batch in (args.train_batches or args.batches) if kind == "train" else args.batches:
                    runs = contenders(name, batch, precision, kind, args.compile and kind == "inference")
                    rounds = measure(runs, args.rounds, args.min_seconds, batch)
                    cell = {"model": name, "batch": batch, "precision": precision, "kind": kind, "rounds": rounds}
                    result["rows"].append(summarise(cell))
                    print(table(result["rows"][-1:]).splitlines()[-1], flush=True)
                    if args.out:  # after every cell, so a run cut short still leaves what it measured
                        write_record(args.out, result)
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
