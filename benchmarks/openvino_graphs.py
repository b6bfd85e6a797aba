"""The graph `vitkit.optimize` hands OpenVINO against the exported ONNX graph its peer runs, at batch 1, side by side.

Variants of one model's graph, each compiled by OpenVINO's CPU plugin with the latency hint, `--threads` threads
and the precision hint (`--precisions`: fp32, and bf16 where it is native), and called in interleaved, rotated
rounds of single images: the model traced by OpenVINO's PyTorch frontend with attention written out (what
`optimize` converts) and with SDPA, and the graph `vitkit.export` writes, each with the batch fixed at one image and
variable. Then each variant's own per-layer profile (`PERF_COUNT`) summed by layer type and kernel, and the number
of each layer type in the compiled graph: where one graph is faster, which kernels differ.

    python benchmarks/openvino_graphs.py [--model ViT-S/16] [--model-args JSON] [--rounds 20] [--threads 2]
        [--precisions fp32 bf16] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import vitkit
from vitkit.speed import kernels, machine
from vitkit.speed.benchmark import record_header, write_record
from vitkit.speed.openvino_copy import layer_type, openvino_core
from vitkit.speed.runtimes import runtime_versions

PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16"}


def main() -> None:
    import openvino

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-S/16")
    parser.add_argument("--model-args", default="{}", help="ViTConfig overrides as JSON, e.g. '{\"num_layers\": 2}'")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=3, help="single-image calls per variant and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISION_HINTS),
                        help="default: fp32, and bf16 where the CPU has native bf16")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = vitkit.create_model(args.model, **json.loads(args.model_args)).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a new model's head is zero
    shape = [1, model.config.in_chans, *model.config.image_size]
    example = torch.randn(2, *shape[1:])
    core = openvino_core()
    folder = tempfile.TemporaryDirectory()  # removed when this process ends
    onnx = Path(folder.name) / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vitkit.export(model, onnx)

    def traced(attention, fixed: bool):
        def make():
            with mock.patch.object(kernels, "attend", attention), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                installed = kernels.install(copy.deepcopy(model))  # its attention is `kernels.attend`
                dynamic = [openvino.PartialShape([-1, *shape[1:]])]
                graph = openvino.convert_model(installed, example_input=example, input=dynamic)
            if fixed:
                graph.reshape(shape)
            return graph

        return make

    def exported(fixed: bool):
        def make():
            graph = core.read_model(str(onnx))
            if fixed:
                graph.reshape(shape)
            return graph

        return make

    written_out = kernels.attend  # in a trace, the written-out attention
    variants = {
        "written out, fixed (optimize)": traced(written_out, True),
        "written out, variable": traced(written_out, False),
        "SDPA, fixed": traced(kernels.attend_sdpa, True),
        "ONNX, variable (the peer)": exported(False),
        "ONNX, fixed": exported(True),
    }
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    precisions = args.precisions or (["fp32", "bf16"] if machine.bf16_is_native("cpu") else ["fp32"])
    result = {
        **record_header("openvino-graphs"),
        "model": args.model,
        "versions": runtime_versions(),
        "settings": {
            "model_args": json.loads(args.model_args),
            "rounds": args.rounds,
            "calls": args.calls,
            "threads": args.threads,
        },
        "cells": [],
    }
    for precision in precisions:
        settings = {
            "INFERENCE_NUM_THREADS": args.threads,
            "INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],
            "PERFORMANCE_HINT": "LATENCY",
        }
        timed, profiled, layers = {}, {}, {}
        for name, make in variants.items():
            graph = make()  # compiling reads the graph, changes nothing in it
            compiled = core.compile_model(graph, "CPU", settings)
            timed[name] = compiled.create_infer_request()
            profiled[name] = core.compile_model(graph, "CPU", {**settings, "PERF_COUNT": True}).create_infer_request()
            ops = compiled.get_runtime_model().get_ordered_ops()
            layers[name] = collections.Counter(layer_type(op) for op in ops)
        for request in timed.values():
            for _ in range(3):
                request.infer([x], share_inputs=True)
        names = list(timed)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.rounds):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                for _ in range(args.calls):
                    timed[name].infer([x], share_inputs=True)
                seconds[name].append((time.perf_counter() - start) / args.calls)
        ours = names[0]
        for name in names:
            kernels_ms: collections.Counter = collections.Counter()
            calls = 10
            for _ in range(calls + 3):
                profiled[name].infer([x], share_inputs=True)
            for _ in range(calls):
                profiled[name].infer([x], share_inputs=True)
                for layer in profiled[name].get_profiling_info():
                    kernels_ms[f"{layer.node_type} | {layer.exec_type}"] += (
                        layer.real_time.total_seconds() * 1e3 / calls
                    )
            cell = {
                "precision": precision,
                "graph": name,
                "ms": 1e3 * statistics.median(seconds[name]),
                "rounds_ms": [1e3 * s for s in seconds[name]],
                # the median of the rounds' ratios: above 1, this graph is faster than optimize's
                "speed_over_optimize": statistics.median(o / s for o, s in zip(seconds[ours], seconds[name])),
                "profile_ms": dict(kernels_ms.most_common(12)),
                "layers": dict(layers[name].most_common()),
            }
            result["cells"].append(cell)
            print(
                f"{precision} {name:<30} {cell['ms']:7.2f} ms  {cell['speed_over_optimize']:.3f}x optimize's speed; "
                f"Transpose layers {layers[name]['Transpose']}, Reorder {layers[name]['Reorder']}",
                flush=True,
            )
    if args.out:
        print(f"wrote {write_record(args.out, result)}")


if __name__ == "__main__":
    main()
