"""vitkit.optimize (fp32, bf16, int8) beside ONNX Runtime and OpenVINO on the same weights, side by side in
interleaved rounds, written as JSON with the machine, torch's version, the date, the commit and every round.

    python benchmarks/deploy.py [--model ViT-S/16] [--batch 1 8] [--rounds 5] [--threads 2] [--out FILE]

The runtimes read the model as `torch.onnx.export` writes it (a dynamic batch axis). Each copy's logits are checked
against the fp32 model's before timing: fp32 copies to 1e-4 of the logits' scale, the others reported. int8 is
calibrated on 64 random images (speed only: the accuracy of int8 is measured on a trained model, see the tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

import vitkit
from vitkit.benchmark import machine


def onnx_file(model: torch.nn.Module, x: torch.Tensor, folder: Path) -> Path:
    path = folder / "model.onnx"
    batch = torch.export.Dim("batch", min=1)
    torch.onnx.export(model, (x,), path, dynamo=True, dynamic_shapes=({0: batch},), external_data=False)
    return path


def runtimes(path: Path, threads: int) -> dict:
    """name -> a callable on a numpy batch, for each runtime that is installed."""
    found = {}
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        found["onnxruntime fp32"] = lambda x: session.run(None, {name: x})[0]
    except ImportError:
        pass
    try:
        import openvino as ov

        core = ov.Core()
        for label, hint in (("openvino fp32", "f32"), ("openvino bf16", "bf16")):
            compiled = core.compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": hint,
                                                            "INFERENCE_NUM_THREADS": threads})  # fmt: skip
            request = compiled.create_infer_request()
            found[label] = lambda x, request=request: request.infer([x])[0]
    except ImportError:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-S/16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = vitkit.create_model(args.model).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a new model's head is zero: its logits would all be 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copies = {
            "vitkit fp32": vitkit.optimize(model, "fp32"),
            "vitkit bf16": vitkit.optimize(model, "bf16"),
            "vitkit int8": vitkit.optimize(model, "int8", calibration=torch.randn(64, 3, *model.config.image_size)),
        }
    folder = Path(tempfile.mkdtemp())
    path = onnx_file(model, torch.randn(2, 3, *model.config.image_size), folder)
    others = runtimes(path, args.threads)
    result = {
        "model": args.model,
        "machine": machine(),
        "cpu_flags": sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True),
        "versions": {"torch": torch.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "settings": {"rounds": args.rounds, "threads": args.threads, "min_seconds": args.min_seconds},
        "load_average_before": os.getloadavg(),  # other work on the machine: the rounds are interleaved against it
        "cells": [],
    }
    for module in ("onnxruntime", "openvino", "torchao"):
        try:
            result["versions"][module] = __import__(module).__version__
        except ImportError:
            pass
    for batch in args.batch:
        x = torch.randn(batch, 3, *model.config.image_size)
        with torch.no_grad():
            reference = model(x)
        array = x.numpy()
        calls = {name: (lambda m=m, x=x: m(x)) for name, m in copies.items()}
        calls |= {name: (lambda f=f, a=array: torch.as_tensor(f(a))) for name, f in others.items()}
        errors = {}
        with torch.no_grad():
            for name, call in calls.items():  # warm-up (compiles int8 for this batch size), then the error
                call()
                errors[name] = ((call().float() - reference).abs().max() / reference.abs().max()).item()
            rates: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    n, start = 0, time.perf_counter()
                    while (spent := time.perf_counter() - start) < args.min_seconds or n == 0:
                        call()
                        n += 1
                    rates[name].append(n * batch / spent)
        for name in calls:
            cell = {"batch": batch, "copy": name, "images_per_s": statistics.median(rates[name]),
                    "rounds": rates[name], "max_error_relative": errors[name]}  # fmt: skip
            result["cells"].append(cell)
            print(f"batch {batch:>3}  {name:<18} {cell['images_per_s']:8.1f} img/s  rounds "
                  f"{', '.join(f'{r:.1f}' for r in rates[name])}  error {errors[name]:.1e}", flush=True)  # fmt: skip
    result["load_average_after"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
