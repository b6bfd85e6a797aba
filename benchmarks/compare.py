"""vitkit against timm, Hugging Face, ONNX Runtime and OpenVINO on the same ViT, measured side by side.

For each model, batch size, precision and kind (inference, or a training step: forward, backward, AdamW), every
contender runs in interleaved rounds in this one process (each round led by another one) and the median is kept,
so that noise from other work on the machine hits all of them alike; the ratios are what to read (vitkit over the
best peer: the median of the two's ratios within each round, which cancels the machine's drift between rounds).
Contenders:

- vitkit: the plain `model(x)` (bf16: autocast) and `vitkit.optimize(model, precision)` (which runs the model in
  OpenVINO where `openvino_copy.openvino_pays`, else with vitkit's own kernels, bf16 weights cast once); where it
  chose OpenVINO, also `optimize(..., runtime="torch")` ("vitkit torch kernels"), so that both paths are on record;
- timm: eager (bf16: autocast), and its best CPU option, `torch.utils.mkldnn.to_mkldnn` or `torch.compile`
  (both measured, the faster one kept per cell);
- Hugging Face `ViTForImageClassification` (SDPA attention; bf16: autocast);
- ONNX Runtime and OpenVINO on the graph `vitkit.export` writes of the same weights (fp32; bf16: OpenVINO's default
  precision hint where the CPU has AVX-512 BF16 or AMX; ONNX Runtime has no bf16 path on CPUs),
  `vitkit.speed.runtimes.runtime_runners`.

Training steps: vitkit, timm and Hugging Face eager (bf16: autocast), the same AdamW.

The process keeps freed memory for the next allocation (`vitkit.speed.machine.retain_freed_memory`, as the `vitkit`
command does), which speeds every contender alike.

Usage: `python benchmarks/compare.py` (the full table: ViT-S/16 and ViT-B/16 at 224, batch 1, 8 and 64, fp32
and bf16, inference and training; long on a small CPU) or a part of it, e.g.
`python benchmarks/compare.py --models ViT-S/16 --batches 1 8 --precisions fp32 --no-compile`.
Every run writes its record (machine, CPU flags, versions, date, commit, command and every round's images/s) as
JSON under benchmarks/results/ (`--out PATH`: elsewhere), from which `python benchmarks/tables.py` makes the tables
of docs/PERFORMANCE.md and the README. `--rounds-large N`: fewer rounds at batch 64 and above, whose calls are
long. On a machine whose speed changes from second to second, `--min-seconds 0 --rounds 30` times one call per
contender and round: paired single calls, the order rotated each round.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.mkldnn

import vitkit
from vitkit.speed import machine
from vitkit.speed.benchmark import interleaved, ratios_to_fastest, record_header, write_record
from vitkit.speed.runtimes import own_kernels_copy, runtime_runners, runtime_versions

RESULTS = Path(__file__).resolve().parent / "results"
RUNTIMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}  # the runtimes' names in the table


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


def exported(config: vitkit.ViTConfig, name: str, directory: Path) -> Path:
    """The ONNX graph of a randomly initialised model `name` of `config` (written once into `directory`)."""
    path = directory / (re.sub(r"\W", "_", name) + ".onnx")
    if not path.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            vitkit.export(vitkit.VisionTransformer(config), path)
    return path


def contenders(
    config: vitkit.ViTConfig, name: str, batch: int, precision: str, kind: str, compile: bool, graphs: Path | None
) -> tuple[dict, str | None]:
    """name -> a callable doing one batch of model `name` (of `config`), and what runs `vitkit.optimize`'s copy
    ("openvino" or "torch"; None for training); options that do not run here are left out with a note. `graphs`:
    the directory of the exported ONNX graphs (None: no runtimes)."""
    x = torch.randn(batch, 3, *config.image_size)
    bf16 = precision == "bf16"
    vit, timm, hf = vitkit.VisionTransformer(config), build_timm(config), build_hf(config)
    if kind == "train":
        return {"vitkit": train_runner(vit, x, bf16), "timm": train_runner(timm, x, bf16),
                "HF": train_runner(hf, x, bf16)}, None  # fmt: skip
    for m in (vit, timm, hf):
        m.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated bf16 is measured all the same; the header says it is
        fast = vitkit.optimize(vit, precision)
        own = own_kernels_copy(fast, vit, precision)
    runs = {
        "vitkit": inference_runner(vit, x, bf16),
        "vitkit optimized": inference_runner(fast, x, False),
        **({"vitkit torch kernels": inference_runner(own, x, False)} if own is not fast else {}),
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
    if graphs is not None:
        runners, notes = runtime_runners(exported(config, name, graphs), precision, torch.get_num_threads())
        array = x.numpy()
        runs |= {RUNTIMES[n]: (lambda run=run: run(array)) for n, run in runners.items()}
        for note in notes:
            print(f"  {note}", file=sys.stderr)
    single_in_torch = len(x) == 1 and getattr(fast, "single_images", None) is not None  # see optimize's rule
    # The copy that ran: "auto" falls back to torch on failure, and may run single images with vitkit's kernels.
    return runs, "torch" if single_in_torch else getattr(fast, "runtime", "torch")


def measure(runs: dict, rounds: int, min_seconds: float, batch: int) -> dict[str, list[float]]:
    """images/s per contender in each of the interleaved rounds (`vitkit.speed.benchmark.interleaved`)."""
    seconds = interleaved(runs, rounds, min_seconds)
    return {name: [batch / t for t in ts] for name, ts in seconds.items()}


def summarise(cell: dict) -> dict:
    """A cell's medians, each contender's ratio to the fastest, and vitkit's ratio over the best peer (the peer of
    the highest median): the median of the two's ratios round by round, so that the machine's drift between rounds
    cancels. Inference: the optimized copy."""
    rounds = cell["rounds"]
    medians = {k: statistics.median(v) for k, v in rounds.items()}
    peers = {k: v for k, v in medians.items() if not k.startswith("vitkit")}
    ours = "vitkit optimized" if "vitkit optimized" in medians else "vitkit"
    best_peer = max(peers, key=peers.__getitem__)
    ratio = statistics.median(a / b for a, b in zip(rounds[ours], rounds[best_peer], strict=True))
    return {
        **cell,
        "images_per_s": medians,
        "ratio_to_fastest": ratios_to_fastest(rounds),
        "ratio": ratio,
        "best_peer": best_peer,
    }


def table(rows: list[dict]) -> str:
    """Markdown: median images/s of each contender with its ratio to the fastest one of the row, and vitkit's best
    over the best peer."""
    columns = [
        "vitkit",
        "vitkit optimized",
        "vitkit torch kernels",
        "timm",
        "timm best CPU option",
        "HF",
        *RUNTIMES.values(),
    ]
    lines = [
        "| model | batch | precision | kind | " + " | ".join(columns) + " | vitkit / best peer |",
        "|" + "---|" * (len(columns) + 5),
    ]
    for r in rows:
        rates, to_fastest = r["images_per_s"], r["ratio_to_fastest"]
        timm_best = max((k for k in rates if k.startswith("timm ")), key=rates.__getitem__, default=None)

        def cell(key, rates=rates, to_fastest=to_fastest):
            return f"{rates[key]:.2f} ({to_fastest[key]:.2f}x)" if key in rates else "-"

        best = f"{cell(timm_best)} {timm_best.split(' ', 1)[1]}" if timm_best else "-"
        cells = [cell(c) if c != "timm best CPU option" else best for c in columns]
        row = f"| {r['model']} | {r['batch']} | {r['precision']} | {r['kind']} | " + " | ".join(cells)
        lines.append(row + f" | **{r['ratio']:.2f}x** ({r['best_peer']}) |")
    return "\n".join(lines)


def record(args: argparse.Namespace) -> dict:
    """The JSON record of this run, without its rows."""
    import timm
    import transformers

    return {
        **record_header("compare"),
        "versions": {**runtime_versions(), "timm": timm.__version__, "transformers": transformers.__version__},
        "settings": {
            "rounds": args.rounds,
            "rounds_large": args.rounds_large,
            "min_seconds": args.min_seconds,
            "model_args": json.loads(args.model_args),
            "retain_freed_memory": args.retained,
            "compile": args.compile,
            "skip": args.skip,
        },
        "source": "run",
        "rows": [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["ViT-S/16", "ViT-B/16"])
    parser.add_argument("--model-args", default="{}", help="ViTConfig overrides as JSON, e.g. '{\"num_layers\": 2}'")
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
    parser.add_argument("--rounds-large", type=int, help="rounds at batch 64 and above (default: --rounds)")
    parser.add_argument("--skip", nargs="+", default=[], help="contenders to leave out, e.g. 'timm to_mkldnn'")
    parser.add_argument(
        "--no-runtimes",
        dest="runtimes",
        action="store_false",
        help="leave out ONNX Runtime and OpenVINO (which need the exporter's onnx and onnxscript)",
    )
    parser.add_argument("--out", type=Path, help="the JSON record (default: benchmarks/results/compare-CPU-DATE.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.retained = machine.retain_freed_memory()  # as the `vitkit` command does: for every contender alike
    args.rounds_large = args.rounds_large or args.rounds
    result = record(args)  # the machine and the commit as they are at the start
    m = result["machine"]
    print(
        f"{m['cpu']}, CPU capability {m['cpu_capability']}, bf16 native: {m['bf16_native_cpu']}, {m['threads']} "
        "threads; images/s, median of interleaved rounds; the ratio is the median of the rounds' ratios",
        flush=True,
    )
    cpu = re.sub(r"[^a-z0-9]+", "-", m["cpu"].lower()).strip("-")
    out = args.out or RESULTS / f"compare-{cpu}-{time.strftime('%Y%m%d-%H%M', time.gmtime())}.json"
    with tempfile.TemporaryDirectory() as graphs:
        for name in args.models:
            config = vitkit.decode_variant(name, **json.loads(args.model_args))
            for kind in args.kinds:
                for precision in args.precisions:
                    for batch in (args.train_batches or args.batches) if kind == "train" else args.batches:
                        inference = kind == "inference"
                        runtimes = Path(graphs) if args.runtimes and inference else None
                        runs, optimized_runtime = contenders(
                            config, name, batch, precision, kind, args.compile and inference, runtimes
                        )
                        runs = {k: v for k, v in runs.items() if k not in args.skip}
                        rounds = args.rounds_large if batch >= 64 else args.rounds
                        cell = {"model": name, "batch": batch, "precision": precision, "kind": kind}
                        if optimized_runtime:  # what ran `vitkit.optimize`'s copy (its default, runtime="auto")
                            cell["optimized_runtime"] = optimized_runtime
                        result["rows"].append(
                            summarise({**cell, "rounds": measure(runs, rounds, args.min_seconds, batch)})
                        )
                        print(table(result["rows"][-1:]).splitlines()[-1], flush=True)
                        write_record(out, result)  # after every cell: a run cut short still leaves what it measured
    print(table(result["rows"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
