"""What calibrating `vitkit.optimize(model, "int8")` in OpenVINO costs, by how many images each pass of NNCF's
statistics model takes (`openvino_copy.NNCF_CALIBRATION_BATCH`): seconds and peak memory of the whole call, each
run in a fresh process, the pass sizes interleaved round by round, written as a JSON record (machine, versions,
date, commit, command, every round).

    python benchmarks/calibration.py [--model ViT-S/16] [--model-args JSON] [--images 512] [--passes 64 8]
        [--rounds 3] [--out FILE]

Memory is the process's peak resident size during the call less its size before it (the model and the
calibration images already loaded).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from vitkit.speed.benchmark import record_header, write_record
from vitkit.speed.runtimes import runtime_versions


def resident_bytes() -> int:
    """This process's resident size now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark needs Linux")


def one_call(model_name: str, model_args: dict, images: int, per_pass: int, threads: int) -> dict:
    """Calibrate once, in this process, with `per_pass` images a pass: seconds and peak memory added."""
    import torch

    import vitkit
    from vitkit.speed import openvino_copy

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = vitkit.create_model(model_name, **model_args).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)
    calibration = torch.randn(
        images, model.config.in_chans, *model.config.image_size, generator=torch.Generator().manual_seed(0)
    )
    openvino_copy.NNCF_CALIBRATION_BATCH = per_pass
    before = resident_bytes()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = vitkit.optimize(model, "int8", calibration=calibration, runtime="openvino")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert getattr(fast, "runtime", None) == "openvino", type(fast)
    return {"seconds": seconds, "peak_added_bytes": peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-S/16")
    parser.add_argument("--model-args", default="{}", help="ViTConfig overrides as JSON, e.g. '{\"num_layers\": 2}'")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--passes", type=int, nargs="+", default=[64, 8], help="images per pass to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one call, as JSON
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_call(args.model, json.loads(args.model_args), args.images, args.one, args.threads)))
        return
    result = {
        **record_header("calibration"),
        "model": args.model,
        "versions": runtime_versions(),
        "settings": {
            "model_args": json.loads(args.model_args),
            "images": args.images,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "cells": {str(p): [] for p in args.passes},
    }
    for i in range(args.rounds):
        for per_pass in args.passes[i % len(args.passes) :] + args.passes[: i % len(args.passes)]:
            child = [sys.executable, __file__, "--model", args.model, "--model-args", args.model_args]
            child += ["--images", str(args.images)]
            out = subprocess.run(
                [*child, "--threads", str(args.threads), "--one", str(per_pass)],
                capture_output=True,
                text=True,
                check=True,
            )
            cell = json.loads(out.stdout.strip().splitlines()[-1])
            result["cells"][str(per_pass)].append(cell)
            print(f"{per_pass:>3} images a pass: {cell['seconds']:.1f} s, +{cell['peak_added_bytes'] / 2**30:.2f} GiB")
    for per_pass, cells in result["cells"].items():
        seconds = statistics.median(c["seconds"] for c in cells)
        memory = statistics.median(c["peak_added_bytes"] for c in cells) / 2**30
        print(f"median, {per_pass:>3} images a pass: {seconds:.1f} s, +{memory:.2f} GiB")
    if args.out:
        print(f"wrote {write_record(args.out, result)}")


if __name__ == "__main__":
    main()
