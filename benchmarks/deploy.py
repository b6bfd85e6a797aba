"""vitkit.optimize (fp32, bf16, int8) beside ONNX Runtime and OpenVINO on the same weights, side by side in
interleaved rounds, written as a JSON record (machine, versions, date, commit, command, every round).
Where `optimize` runs the model in OpenVINO (its default on x86 CPUs where OpenVINO is installed; int8: where NNCF is
too), its copy with vitkit's own kernels (`runtime="torch"`; int8: PT2E) is timed beside it as "vitkit torch fp32",
"vitkit torch bf16" and "vitkit torch int8".

    python benchmarks/deploy.py [--model ViT-S/16] [--model-args JSON] [--batch 1 8] [--rounds 5] [--threads 2]
        [--out FILE]

The runtimes read the graph `vitkit.export` writes (a dynamic batch axis; `vitkit.speed.runtimes.runtime_runners`: fp32
in both, OpenVINO's bf16 where its default precision is bf16). "onnxruntime int8" is that graph quantized by ONNX
Runtime's own static quantizer as its documentation advises for x86 CPUs (the graph pre-processed, QDQ, uint8
activations per tensor, int8 weights per output channel, MinMax calibration), in every linear layer, as vitkit's
int8 copies are (`ONNXRUNTIME_INT8`). Each copy's logits are compared with the fp32 model's before
timing and the largest difference recorded. int8 is calibrated on the same 64 random images in every copy (speed
only: vitkit's int8 accuracy is measured on a trained model, see the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import warnings
from pathlib import Path

import torch

import vitkit
from vitkit.speed.benchmark import interleaved, record_header, write_record
from vitkit.speed.runtimes import onnxruntime_session, own_kernels_copy, runtime_runners, runtime_versions

ONNXRUNTIME_INT8 = {
    "format": "QDQ",
    "activations": "uint8, per tensor",
    "weights": "int8, per output channel",
    # The linear layers, as vitkit's int8 copies quantize: not attention's products of two activations.
    "ops": "MatMul and Gemm nodes whose weight is an initializer",
    "calibration": "MinMax",
    # Its graph optimisation and ONNX shape inference first, as ONNX Runtime advises (its fusions speed the int8 graph
    # up); its symbolic shape inference fails on the exporter's Constant nodes (onnxruntime 1.32) and is skipped.
    "pre_processing": "quant_pre_process(skip_symbolic_shape=True)",
}


def onnxruntime_int8(path: Path, calibration: torch.Tensor, threads: int):
    """A runner of the graph at `path` quantized by ONNX Runtime's static quantizer (`ONNXRUNTIME_INT8`), or None
    where ONNX Runtime is not installed."""
    try:
        import onnx
        from onnxruntime import quantization as q
    except ImportError:
        return None

    class Batches(q.CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter({"images": images.numpy()} for images in calibration.split(8))

        def get_next(self) -> dict | None:
            return next(self.batches, None)

    prepared, quantized = path.with_name("model-prepared.onnx"), path.with_name("model-int8.onnx")
    q.quant_pre_process(path, prepared, skip_symbolic_shape=True)
    graph = onnx.load(str(prepared)).graph
    weights = {t.name for t in graph.initializer}
    linears = [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    q.quantize_static(
        prepared,
        quantized,
        Batches(),
        quant_format=q.QuantFormat.QDQ,
        per_channel=True,
        op_types_to_quantize=["MatMul", "Gemm"],
        nodes_to_quantize=linears,
        activation_type=q.QuantType.QUInt8,
        weight_type=q.QuantType.QInt8,
        calibrate_method=q.CalibrationMethod.MinMax,
    )
    session = onnxruntime_session(quantized, threads)
    return lambda x: session.run(None, {"images": x})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-S/16")
    parser.add_argument("--model-args", default="{}", help="ViTConfig overrides as JSON, e.g. '{\"num_layers\": 2}'")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--skip", nargs="+", default=[], help="copies to leave out, e.g. 'vitkit int8'")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = vitkit.create_model(args.model, **json.loads(args.model_args)).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a new model's head is zero: its logits would all be 0
    size = model.config.image_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        def make_calibration() -> torch.Tensor:
            return torch.randn(64, 3, *size, generator=torch.Generator().manual_seed(0))

        make = {
            "vitkit fp32": lambda: vitkit.optimize(model, "fp32"),
            "vitkit bf16": lambda: vitkit.optimize(model, "bf16"),
            "vitkit int8": lambda: vitkit.optimize(model, "int8", calibration=make_calibration()),
        }
        copies = {name: build() for name, build in make.items() if name not in args.skip}
        for precision in ("fp32", "bf16", "int8"):  # where `optimize` chose OpenVINO, its torch copy beside it
            if getattr(copies.get(f"vitkit {precision}"), "runtime", None) == "openvino":
                calibration = make_calibration() if precision == "int8" else None
                copies[f"vitkit torch {precision}"] = own_kernels_copy(
                    copies[f"vitkit {precision}"], model, precision, calibration
                )
    result = {
        **record_header("deploy"),
        "model": args.model,
        "versions": runtime_versions(),
        "settings": {
            "model_args": json.loads(args.model_args),
            "rounds": args.rounds,
            "threads": args.threads,
            "min_seconds": args.min_seconds,
            "skip": args.skip,
            "onnxruntime_int8": ONNXRUNTIME_INT8,
        },
        "load_average_before": os.getloadavg(),  # other work on the machine: the rounds are interleaved against it
        "cells": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's own notes
            vitkit.export(model, path)
        others = {}
        for precision in ("fp32", "bf16"):
            runners, _ = runtime_runners(path, precision, args.threads)
            others |= {f"{name} {precision}": run for name, run in runners.items()}
        if "onnxruntime int8" not in args.skip:
            run = onnxruntime_int8(path, make_calibration(), args.threads)
            if run is not None:
                others["onnxruntime int8"] = run
        for batch in args.batch:
            x = torch.randn(batch, 3, *size)
            with torch.no_grad():
                reference = model(x)
                array = x.numpy()
                calls = {name: (lambda m=m, x=x: m(x)) for name, m in copies.items()}
                calls |= {name: (lambda f=f, a=array: torch.as_tensor(f(a))) for name, f in others.items()}
                errors = {name: (call().float() - reference).abs().max().item() for name, call in calls.items()}
                seconds = interleaved(calls, args.rounds, args.min_seconds)
            for name, times in seconds.items():
                rates = [batch / t for t in times]
                cell = {"batch": batch, "copy": name, "images_per_s": statistics.median(rates), "rounds": rates}
                cell["max_error_relative"] = errors[name] / reference.abs().max().item()
                result["cells"].append(cell)
                print(f"batch {batch:>3}  {name:<18} {cell['images_per_s']:8.1f} img/s", flush=True)
    result["load_average_after"] = os.getloadavg()
    if args.out:
        print(f"wrote {write_record(args.out, result)}")


if __name__ == "__main__":
    main()
