"""The OpenVINO backend of `vitkit.optimize`: the model converted by OpenVINO's PyTorch frontend and compiled by its
CPU plugin (`OpenVINOModel`), in fp32 or bf16 (`to_openvino`), or int8 as NNCF, OpenVINO's quantizer, quantized it
(`quantize_int8_openvino`); its logits are checked against the model's own before it is returned.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import math
import typing
import warnings

import numpy as np
import torch

from vitkit.models.efficiency import flops
from vitkit.models.vit import VisionTransformer

from . import kernels, machine
from .copies import InferenceCopy, InferenceModel, Options, calibration_batches, warn_without_fast_int8

NAME = "openvino"
PRECISIONS = ("fp32", "bf16", "int8")


def make(model: VisionTransformer, precision: str, options: Options) -> OpenVINOModel:
    """`to_openvino` (fp32, bf16) or `quantize_int8_openvino` (int8) of `model`; refused (ValueError), naming the
    fix, where OpenVINO cannot run it here or torch's options (`pack`, `compile`) were asked for."""
    device = next(model.parameters()).device
    if options.pack or options.compile:
        raise ValueError("runtime='openvino' with pack=True or compile=True: those are torch's; choose one.")
    if precision == "int8":
        return quantize_int8_openvino(model, options.calibration, device)
    if device.type != "cpu":
        raise ValueError(
            f"runtime='openvino' runs on the CPU, and the model is on {device}: move it with "
            "model.cpu(), or use runtime='torch'."
        )
    if not openvino_available():
        raise ValueError(
            "runtime='openvino' needs OpenVINO: pip install openvino (or vitkit[openvino]); "
            "runtime='torch' runs without it."
        )
    if precision == "bf16" and not machine.bf16_is_native("cpu"):
        raise ValueError("runtime='openvino' in bf16 needs a CPU with native bf16; use precision='fp32'.")
    return to_openvino(model, precision)


def openvino_available() -> bool:
    """Whether OpenVINO is installed (the optional extra `vitkit[openvino]`)."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def nncf_available() -> bool:
    """Whether NNCF, OpenVINO's quantizer, is installed (with torchao, the optional extra `vitkit[int8]`)."""
    try:
        import nncf  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def openvino_core() -> typing.Any:
    """The one `openvino.Core` that vitkit compiles with, kept for the life of the process. OpenVINO's CPU plugin
    (one per Core) gives the thread that makes it an alternate signal stack of its own, and on its destruction unmaps
    it and puts back the one it found, but only where its own is still the thread's: two Cores destroyed in the order
    they were made leave the thread on the unmapped stack of the first (OpenVINO 2026.4). The next signal handler to
    run on that thread (Python's own for Ctrl-C, torch's SIGCHLD one of DataLoader workers) then ends the process
    with a segmentation fault; one Core that is never destroyed early never hands the thread such a stack."""
    import openvino

    return openvino.Core()


def openvino_pays(precision: str, device: torch.device) -> bool:
    """Whether `optimize` runs the model in OpenVINO by default: on an x86 CPU where OpenVINO is installed, in fp32
    and in bf16 where bf16 is native. Its CPU plugin fuses each attention into one kernel and picks its GEMM per
    layer: on the x86 CPUs measured it ran ViTs faster than vitkit's own kernels in most cells and within a few
    percent in the others (docs/PERFORMANCE.md)."""
    native = precision == "fp32" or (precision == "bf16" and machine.bf16_is_native("cpu"))
    return device.type == "cpu" and machine.x86() and native and openvino_available()


# The largest difference of the OpenVINO copy's logits from the model's own, relative to their largest magnitude,
# that `optimize` accepts: fp32 is the same arithmetic in another order; bf16 rounds every product's inputs.
OPENVINO_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


class OpenVINOModel(InferenceCopy):
    """The copy `optimize` makes with runtime="openvino": the model as OpenVINO's CPU plugin runs it, with the
    model's inference interface (`InferenceCopy`): images in (a float tensor on the CPU), fp32 logits out.

    It holds the model compiled twice: for one image, with every thread on it (OpenVINO's latency hint, the shape
    fixed at one image for a plain ViT); for a batch, with the threads shared out among OpenVINO's throughput
    streams (`streams`), each of which runs one part of the batch at the same time (less waiting between threads
    than all of them on every product; figures in docs/PERFORMANCE.md). A batch too small to split (under
    `split_from` images, each part under `STREAM_MIN_FLOPS`) runs whole with every thread on it, on a third
    compilation (`small`, with the latency hint and a variable batch) where the model is that small, else on the
    single-image one. One call at a time. `single_images`, where `optimize` sets it, is a copy with vitkit's own
    kernels that runs single images instead (where those ran faster: `inference.torch_pays_for_single_images`)."""

    runtime = "openvino"
    what = "the OpenVINO copy"

    def __init__(
        self,
        single: typing.Any,
        batched: typing.Any,
        model: VisionTransformer,
        precision: str,
        small: typing.Any,
        split_from: int,
    ):
        import openvino

        super().__init__(model)
        self.single, self.request = single, single.create_infer_request()
        self.batched = batched
        self.streams = int(batched.get_property("NUM_STREAMS"))
        self.requests = [batched.create_infer_request() for _ in range(self.streams)]
        self.small, self.small_request = small, small.create_infer_request()
        self.split_from = split_from
        self.precision = precision
        self.single_images: InferenceModel | None = None
        self.tensor = openvino.Tensor

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise ValueError(f"the OpenVINO copy runs on the CPU; the images are on {x.device}: pass them with .cpu().")
        if len(x) == 1 and self.single_images is not None:
            return self.single_images(x).float()
        array = x.detach().to(torch.float32).contiguous().numpy()
        # The requests' own tensors, set and read directly: `infer([array])` converts its inputs and outputs in
        # Python, which costs as much as a small model's whole forward pass.
        if len(array) == 1:  # the single-image copy, whose shape may be fixed at one image
            return self.whole(self.request, array)
        if len(array) < self.split_from:
            return self.whole(self.small_request, array)
        return self.split(array)

    def whole(self, request: typing.Any, array: np.ndarray) -> torch.Tensor:
        """The logits of `array` (a contiguous float32 batch) run by one infer request."""
        request.set_input_tensor(self.tensor(array, shared_memory=True))
        request.infer()
        return torch.from_numpy(request.get_output_tensor().data.copy())

    def split(self, array: np.ndarray) -> torch.Tensor:
        """The logits of `array` (two images or more), one part in each stream at the same time."""
        parts = np.array_split(array, min(len(array), self.streams))  # rows of a contiguous array: contiguous
        for request, part in zip(self.requests, parts):
            request.set_input_tensor(self.tensor(part, shared_memory=True))
            request.start_async()
        for request in self.requests[: len(parts)]:
            request.wait()
        outputs = [request.get_output_tensor().data.copy() for request in self.requests[: len(parts)]]
        return torch.from_numpy(np.concatenate(outputs))

    def extra_repr(self) -> str:
        threads = self.single.get_property("INFERENCE_NUM_THREADS")
        small = f" from {self.split_from} images" if self.split_from > 2 else ""
        single = ", single images with vitkit's kernels" if self.single_images is not None else ""
        return (
            f"OpenVINO {self.precision} on the CPU, {threads} threads, batches in {self.streams} streams{small}{single}"
        )


def to_openvino(model: VisionTransformer, precision: str) -> OpenVINOModel:
    """The model converted by OpenVINO's PyTorch frontend (`openvino.convert_model`, with a variable batch axis) and
    compiled for the CPU in `precision` ("fp32" or "bf16") with torch's number of threads; refused (ValueError)
    unless its logits on two random images match the model's own within `OPENVINO_TOLERANCE`."""
    plain, example = _plain_copy(model)
    fast = _compiled_in_openvino(_openvino_graph(plain, example), model, precision)
    with torch.inference_mode():
        reference = plain(example)
    # Each compilation: single images, a batch of two (the small-batch one where the model is that small), and the
    # streams, which larger batches take.
    got = torch.cat([fast(example[:1]), fast(example[1:]), fast(example), fast.split(example.numpy())])
    error = float((got - reference.repeat(3, 1)).abs().max() / reference.abs().max().clamp_min(1e-12))
    if not error <= OPENVINO_TOLERANCE[precision]:
        raise ValueError(
            f"OpenVINO's {precision} logits differ from the model's by {error:.1e} (relative; the limit is "
            f"{OPENVINO_TOLERANCE[precision]:.0e})."
        )
    return fast


def _plain_copy(model: VisionTransformer) -> tuple[VisionTransformer, torch.Tensor]:
    """An fp32 copy of `model` for OpenVINO's frontend to trace, and two random images to trace it with. Its kernels
    are installed: traced, their attention is written out, which OpenVINO fuses into its own attention kernel, and
    the patch embedding is a linear layer, which NNCF quantizes with the others."""
    plain = kernels.install(copy.deepcopy(model).eval().requires_grad_(False).float())
    c = plain.config
    return plain, torch.randn(2, c.in_chans, *c.image_size, generator=torch.Generator().manual_seed(0))


def _openvino_graph(plain: VisionTransformer, example: torch.Tensor) -> typing.Any:
    """`plain` converted by OpenVINO's PyTorch frontend (a trace of `example`), with a variable batch axis."""
    import openvino

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on the model's shape checks
            return openvino.convert_model(
                plain, example_input=example, input=[openvino.PartialShape([-1, *example.shape[1:]])]
            )
    except Exception as e:  # the frontend raises its own types for an operator it cannot convert
        raise ValueError(f"OpenVINO could not convert this model ({type(e).__name__}: {str(e)[:200]}).") from e


def _compiled_in_openvino(graph: typing.Any, model: VisionTransformer, precision: str) -> OpenVINOModel:
    """`graph` compiled for the CPU with torch's number of threads, two or three times (`OpenVINOModel`): its layers
    outside the int8 ones, if any, in `precision` (int8: bf16 where it is native, else fp32)."""
    if precision == "int8":
        hint = "bf16" if machine.bf16_is_native("cpu") else "f32"
    else:
        hint = {"fp32": "f32", "bf16": "bf16"}[precision]
    settings = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": hint}
    core = openvino_core()
    batched = core.compile_model(graph, "CPU", {**settings, "PERFORMANCE_HINT": "THROUGHPUT"})
    streams = int(batched.get_property("NUM_STREAMS"))
    # The smallest batch whose parts, one a stream, each hold STREAM_MIN_FLOPS (a model with more in one image splits
    # any batch: each part holds one image at least).
    image = flops(model.config)
    split_from = max(2, math.ceil(STREAM_MIN_FLOPS * streams / image)) if image < STREAM_MIN_FLOPS else 2
    # Single images with the shape fixed at one image, which the plugin plans for; not the hybrid (or any CNN stem),
    # whose graph OpenVINO's CPU plugin (2026.4) crashes on compiling with a fixed shape.
    fixed = isinstance(model, VisionTransformer) and model.config.hybrid is None
    # Batches too small to split among the streams run whole with every thread: on a compilation of their own
    # where the single-image one is fixed at one image, else on that one.
    needed = fixed and split_from > 2
    small = core.compile_model(graph, "CPU", {**settings, "PERFORMANCE_HINT": "LATENCY"}) if needed else None
    if fixed:
        graph.reshape([1, model.config.in_chans, *model.config.image_size])
    single = core.compile_model(graph, "CPU", {**settings, "PERFORMANCE_HINT": "LATENCY"})
    return OpenVINOModel(single, batched, model, precision, small if small is not None else single, split_from)


# The least work (FLOPs, a multiply-add as 2) in each stream's part of a batch for OpenVINOModel to split the batch
# among its streams: below it, starting the streams and waiting for them cost more than running the parts at once
# saves, and the batch runs whole with every thread on it (docs/PERFORMANCE.md).
STREAM_MIN_FLOPS = 0.5e9


NNCF_CALIBRATION_BATCH = 8  # images per pass of NNCF's statistics model (docs/PERFORMANCE.md)


def quantize_int8_openvino(
    model: VisionTransformer, calibration: torch.Tensor | typing.Iterable | None, device: torch.device
) -> OpenVINOModel:
    """An int8 copy of `model` run by OpenVINO: the model converted as for `to_openvino`, quantized by NNCF
    (OpenVINO's quantizer, with its transformer preset but no SmoothQuant, and attention left as it is: every linear
    layer's weight int8 per output channel, its input 8-bit per tensor, with scales observed on `calibration`,
    batches as for `quantize_int8`), and compiled by OpenVINO's CPU plugin, which runs each such layer as an int8
    GEMM (VNNI or AMX) and attention in bf16 where it is native, else fp32. Refused (ValueError) unless every
    linear layer of the compiled graph (the patch embedding's too) runs in int8. Warns where the CPU has no fast
    int8 path."""
    if device.type != "cpu" or not machine.x86():
        raise ValueError(
            f"precision='int8' in OpenVINO runs on x86 CPUs only; the model is on {device}: move it with .cpu(), or "
            "use runtime='torch'."
        )
    if not (openvino_available() and nncf_available()):
        raise ValueError(
            "precision='int8' with runtime='openvino' needs OpenVINO and NNCF: pip install openvino nncf (or "
            "vitkit[openvino,int8]); runtime='torch' quantizes with PT2E instead."
        )
    machine.compile_quietly_on(device)  # NNCF imports torch's C++ extension builder, which logs the CUDA note
    batches = calibration_batches(calibration, model)
    warn_without_fast_int8()
    plain, example = _plain_copy(model)
    quantized = _nncf_quantized(_openvino_graph(plain, example), batches)
    fast = _compiled_in_openvino(quantized, model, "int8")
    ops = fast.single.get_runtime_model().get_ordered_ops()
    linears = [op.get_rt_info()["runtimePrecision"].astype(str) for op in ops if layer_type(op) == "FullyConnected"]
    done = sum(p in ("u8", "i8") for p in linears)
    if done < len(linears):
        raise ValueError(
            f"precision='int8': NNCF quantized {done} of the compiled graph's {len(linears)} linear layers (the "
            "patch embedding's among them), so the copy would not be int8."
        )
    return fast


def _nncf_quantized(graph: typing.Any, batches: list[torch.Tensor]) -> typing.Any:
    """`graph` quantized by NNCF with scales observed on `batches`: linear layers only, without SmoothQuant."""
    import nncf

    # NNCF's statistics model returns the input of every layer it quantizes, for a whole batch at once, so memory
    # grows with the batch: the images go through it a few at a time, whatever batches they came in.
    images = torch.cat([batch.to(dtype=torch.float32, device="cpu") for batch in batches])
    chunks = [chunk.numpy() for chunk in images.split(NNCF_CALIBRATION_BATCH)]
    # Without SmoothQuant, which moves activation range into the weights: on a trained ViT with a GAP head it took
    # held-out top-1 from 84% to 23% (without it: 84%), and it did not help a class-token model.
    advanced = nncf.AdvancedQuantizationParameters(smooth_quant_alphas=nncf.AdvancedSmoothQuantParameters(matmul=-1))
    # Attention as the frontend fuses it (one op), not quantized: the transformer preset quantizes its queries and
    # keys, whose conversions to and from int8 cost more than the int8 products save (on AMX they took the int8 copy
    # behind the bf16 one; docs/PERFORMANCE.md), and the scope is the linear layers', as in `quantize_int8`.
    attention = nncf.IgnoredScope(types=["ScaledDotProductAttention"], validate=False)
    # NNCF's progress bars and notes (its logger's INFO lines, written to the stdout it found at import) are its
    # own output, not the caller's.
    log = logging.getLogger("nncf")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return nncf.quantize(
                graph,
                nncf.Dataset(chunks),
                model_type=nncf.ModelType.TRANSFORMER,
                subset_size=len(chunks),
                ignored_scope=attention,
                advanced_parameters=advanced,
            )
    finally:
        log.setLevel(level)


def layer_type(op: typing.Any) -> str:
    """The kind of a layer of a graph OpenVINO compiled (FullyConnected, Transpose, ...)."""
    return str(op.get_rt_info()["layerType"].astype(str))
