"""vitkit beside the ONNX runtimes (`vitkit bench --compare`): the same weights exported with `vitkit.export`, run by
ONNX Runtime and OpenVINO beside `vitkit.optimize`'s copy, in interleaved rounds; and the runners of an exported
graph that benchmarks/compare.py times too."""

from __future__ import annotations

import statistics
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitkit.models.config import ViTConfig, decode_variant
from vitkit.models.vit import VisionTransformer

from .benchmark import BENCH_PRECISIONS, interleaved, ratios_to_fastest, record_header
from .copies import InferenceModel
from .openvino_copy import openvino_core
from .optimize import optimize

RUNTIMES = ("onnxruntime", "openvino")


def runtime_versions() -> dict[str, str]:
    """The versions of the runtimes installed (and torch's), for the record."""
    import importlib

    versions: dict[str, str] = {"torch": torch.__version__}
    for name in RUNTIMES:
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return versions


def onnxruntime_session(path: str | Path, threads: int) -> Any:
    """An ONNX Runtime CPU session of the graph at `path` on `threads` threads, set up to be timed beside others."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    # Its threads would otherwise spin after each run, taking the cores from the contender timed next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def own_kernels_copy(
    fast: InferenceModel, model: VisionTransformer, precision: str, calibration: Any = None
) -> InferenceModel:
    """The copy of `model` with vitkit's own kernels (`optimize(..., runtime="torch")`) to time beside `fast`, what
    `optimize(model, precision)` returned: `fast` itself where it is one, the copy an OpenVINO copy already holds for
    single images (the same call), else a new one."""
    if isinstance(fast, VisionTransformer):
        return fast
    held = getattr(fast, "single_images", None)
    return held if held is not None else optimize(model, precision, runtime="torch", calibration=calibration)


def runtime_runners(path: str | Path, precision: str, threads: int) -> tuple[dict[str, Any], list[str]]:
    """name -> a callable mapping images (a float32 numpy array) to logits, for each ONNX runtime that runs the
    graph at `path` in `precision` on this CPU with `threads` threads; and a note for each one left out.

    fp32: both. bf16: OpenVINO with its default precision hint, which is bf16 where the CPU has AVX-512 BF16 or
    AMX; ONNX Runtime's CPU kernels have no bf16 path for a ViT's matrix products, so it is left out."""
    runners: dict[str, Any] = {}
    notes = []
    try:
        import onnxruntime  # noqa: F401 - whether it is installed; `onnxruntime_session` uses it

        if precision == "fp32":
            session = onnxruntime_session(path, threads)
            name = session.get_inputs()[0].name
            runners["onnxruntime"] = lambda x: session.run(None, {name: x})[0]
        else:
            notes.append("onnxruntime: no bf16 path for a ViT's matrix products on CPUs; left out of bf16")
    except ImportError:
        notes.append("onnxruntime: not installed (pip install onnxruntime)")
    try:
        import openvino

        settings: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
        if precision == "fp32":
            settings["INFERENCE_PRECISION_HINT"] = "f32"
        compiled = openvino_core().compile_model(str(path), "CPU", settings)  # one Core a process: see `openvino_core`
        chosen = compiled.get_property("INFERENCE_PRECISION_HINT")
        if precision == "bf16" and chosen != openvino.Type.bf16:
            notes.append(f"openvino: its default precision here is {chosen}, not bf16; left out of bf16")
        else:
            runners["openvino"] = lambda x: compiled(x)[0]
    except ImportError:
        notes.append("openvino: not installed (pip install openvino)")
    return runners, notes


def compare_runtimes(
    model: str | ViTConfig | VisionTransformer = "ViT-S/16",
    *,
    batch_sizes: tuple[int, ...] = (1, 8, 64),
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    rounds: int = 5,
    min_seconds: float = 0.5,
    progress: bool = True,
    **model_args: Any,
) -> dict[str, Any]:
    """`vitkit.optimize(model, precision)` against ONNX Runtime and OpenVINO on the same weights (exported with
    `vitkit.export`), with torch's number of threads. `model`: a loaded model, or a variant name or config (random
    weights); returns a JSON-able dict: `machine`, `versions`, `notes` (the
    runtimes left out, and why) and `rows` (per batch, precision and contender: the images/s of every round, their
    median, the ratio to the fastest contender, and the largest difference of its logits from vitkit's plain
    model, relative to their largest magnitude)."""
    import tempfile

    from vitkit.formats.checkpoints import export

    _check_compare_arguments(precisions, rounds, batch_sizes)
    net, config = _model_to_compare(model, model_args)
    threads = torch.get_num_threads()
    result: dict[str, Any] = {
        **record_header("bench-compare"),
        "model": model if isinstance(model, str) else "custom",
        "config": config.to_dict(),
        "versions": runtime_versions(),
        "settings": {"rounds": rounds, "min_seconds": min_seconds, "threads": threads},
        "notes": [],
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "model.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's own progress and deprecation notes
            export(net, path, format="onnx")
        for precision in precisions:
            runners, notes = runtime_runners(path, precision, threads)
            copies, own_notes = _vitkit_copies(net, precision)
            result["notes"] += [f"{precision}: {n}" for n in notes + own_notes]
            for batch in batch_sizes:
                rows = _compare_batch(net, copies, runners, batch, precision, rounds, min_seconds)
                result["rows"] += rows
                if progress:
                    print(format_compare({**result, "rows": rows}, header=False), file=sys.stderr, flush=True)
    return result


def _check_compare_arguments(precisions: tuple[str, ...], rounds: int, batch_sizes: tuple[int, ...]) -> None:
    for p in precisions:
        if p not in BENCH_PRECISIONS:
            raise ValueError(f"precisions={precisions!r}: choose from {', '.join(BENCH_PRECISIONS)}.")
    if rounds < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"rounds={rounds}, batch_sizes={batch_sizes}: need at least one round and batch.")


def _model_to_compare(
    model: str | ViTConfig | VisionTransformer, model_args: dict[str, Any]
) -> tuple[VisionTransformer, ViTConfig]:
    """The model in eval mode and its config: `model` itself, or one of random weights for a variant or config."""
    if isinstance(model, VisionTransformer):
        return model.eval(), model.config
    config = model if isinstance(model, ViTConfig) else decode_variant(model, **model_args)
    net = VisionTransformer(config).eval()
    if isinstance(net.head, nn.Linear):  # the official init zeroes the head: logits of 0 would hide differences
        nn.init.trunc_normal_(net.head.weight, std=0.02)
    return net, config


def _vitkit_copies(net: VisionTransformer, precision: str) -> tuple[dict[str, InferenceModel], list[str]]:
    """name -> vitkit's copy of `net` to time: `optimize`'s, and beside a runtime's copy the one with vitkit's own
    kernels (`runtime="torch"`); and a note saying which is which where there are two."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated bf16 is measured all the same; `machine` says it is
        fast = optimize(net, precision)
        if isinstance(fast, VisionTransformer):
            return {"vitkit.optimize": fast}, []
        own = own_kernels_copy(fast, net, precision)  # a runtime's copy: vitkit's own kernels beside it
    engine = getattr(fast, "runtime", "OpenVINO")
    single = " (single images: vitkit's own kernels)" if getattr(fast, "single_images", None) is not None else ""
    note = (
        f"vitkit.optimize runs the model in {engine}{single} here (runtime='auto'); "
        "'vitkit torch' is its copy with vitkit's own kernels (runtime='torch')"
    )
    return {"vitkit.optimize": fast, "vitkit torch": own}, [note]


def _compare_batch(
    net: VisionTransformer,
    copies: dict[str, InferenceModel],
    runners: dict[str, Any],
    batch: int,
    precision: str,
    rounds: int,
    min_seconds: float,
) -> list[dict[str, Any]]:
    """The rows of one batch size and precision: every contender timed in interleaved rounds on the same random
    images, and its logits set beside those of vitkit's plain model."""
    import numpy as np

    config = net.config
    x = torch.randn(batch, config.in_chans, *config.image_size)
    array = x.numpy()  # what the ONNX runtimes read
    reference, outputs = _logits(net, copies, runners, x, array)
    runs = {name: partial(copy, x) for name, copy in copies.items()}
    runs |= {name: partial(run, array) for name, run in runners.items()}
    with torch.inference_mode():
        seconds = interleaved(runs, rounds, min_seconds)
    rates = {name: [batch / s for s in ss] for name, ss in seconds.items()}
    ratios = ratios_to_fastest(rates)
    scale = max(float(np.abs(reference).max()), 1e-12)
    return [
        {
            "image_size": list(config.image_size),
            "batch": batch,
            "precision": precision,
            "contender": name,
            "images_per_s": statistics.median(r),
            "rounds": r,
            "ratio_to_fastest": ratios[name],
            "max_relative_difference": float(np.abs(outputs[name] - reference).max()) / scale,
        }
        for name, r in rates.items()
    ]


def _logits(
    net: VisionTransformer, copies: dict[str, InferenceModel], runners: dict[str, Any], x: torch.Tensor, array: Any
) -> tuple[Any, dict[str, Any]]:
    """The plain model's logits for images `x` and each contender's (the runtimes' for `array`, `x` in numpy), as
    float32 numpy arrays."""
    import numpy as np

    with torch.inference_mode():
        reference = net(x).float().numpy()
        outputs = {name: copy(x).float().numpy() for name, copy in copies.items()}
    outputs |= {name: np.asarray(run(array), dtype=np.float32) for name, run in runners.items()}
    return reference, outputs


def format_compare(result: dict, header: bool = True) -> str:
    """A table of `compare_runtimes`'s rows: images/s and the ratio to the fastest contender, cell by cell."""
    lines = []
    if header:
        m = result["machine"]
        versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        lines.append(
            f"{result['model']} on {m['cpu']} ({m['cpu_capability']}), {result['settings']['threads']} "
            f"threads, {versions}; median of {result['settings']['rounds']} interleaved rounds"
        )
        lines += [f"note: {n}" for n in result["notes"]]
        lines.append(f"{'batch':>5} {'prec':<5}{'contender':<17}{'images/s':>10}{'vs fastest':>11}{'max rel diff':>13}")
    for r in result["rows"]:
        lines.append(
            f"{r['batch']:>5} {r['precision']:<5}{r['contender']:<17}{r['images_per_s']:>10.2f}"
            f"{r['ratio_to_fastest']:>10.2f}x{r['max_relative_difference']:>13.1e}"
        )
    return "\n".join(lines)
