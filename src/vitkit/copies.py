"""The copies of a model that `vitkit.optimize` hands to another engine, each with the model's inference interface
(`InferenceCopy`: images in, logits out, the model's `config`, `class_names` and `trained_on`):
- `OpenVINOModel`: the model converted by OpenVINO's PyTorch frontend and compiled by its CPU plugin, in fp32 or bf16
  (`to_openvino`), or int8 as NNCF, OpenVINO's quantizer, quantized it (`quantize_int8_openvino`); its logits are
  checked against the model's own before it is returned;
- `Int8Model`: the model quantized by PyTorch's PT2E flow with the x86 inductor quantizer (torchao's), then compiled
  by `torch.compile` with freezing, which lowers each linear layer to oneDNN's int8 linear (`quantize_int8`).

int8 copies: every linear layer's weight int8 per output channel, its input 8-bit per tensor, with scales calibrated
on a few batches the caller passes; each copy is refused unless every linear layer runs in int8. Fast where the CPU
has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX).
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
from torch import nn

from . import kernels, machine
from .efficiency import flops
from .model import EncoderBlock, VisionTransformer, check_images


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


class InferenceCopy(nn.Module):
    """A copy of a model that another engine runs (an int8 graph, OpenVINO), with the model's inference interface:
    images in, logits out, and the model's `config`, `class_names` and `trained_on`; images the model would refuse
    are refused with its message, and an empty batch gives empty logits. Inference only."""

    what = "this copy"

    def __init__(self, model: VisionTransformer):
        super().__init__()
        self.config = model.config
        self.class_names = getattr(model, "class_names", None)
        self.trained_on = getattr(model, "trained_on", None)
        self.normalization = getattr(model, "normalization", None)
        self.training = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_images(x, self.config)
        if len(x) == 0:  # a runtime's graph takes one image at least: the width of one image's logits, no rows
            return self.run(x.new_zeros(1, *x.shape[1:]))[:0]
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of a batch of one image or more, checked against the model's input."""
        raise NotImplementedError

    def __repr__(self) -> str:
        # One line: what runs the copy. The modules inside (a compiled graph, a copy for single images) are the
        # engine's, and nn.Module's repr would list them by the dozen.
        return f"{type(self).__name__}({self.extra_repr()})"

    def train(self, mode: bool = True) -> InferenceCopy:
        """eval() (a no-op: the copy was made for inference, and a runtime's graph has no training mode); train()
        is refused."""
        if mode:
            raise ValueError(f"{self.what} is for inference only: train the model, then optimize it again.")
        self.training = False
        return self


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
        self.single_images: nn.Module | None = None
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


CALIBRATION_BATCH = 64  # images per forward pass when `calibration` is one tensor
NNCF_CALIBRATION_BATCH = 8  # images per pass of NNCF's statistics model (docs/PERFORMANCE.md)
CALIBRATION_IMAGES = 512  # where calibration stops reading an iterable, and what the CLI calibrates on by default


def calibration_batches(calibration: torch.Tensor | typing.Iterable | None, model: nn.Module) -> list[torch.Tensor]:
    """The calibration images as a list of (B, C, H, W) batches: every image of a tensor or a list of batches, and
    of any other iterable (a DataLoader; it may yield (images, labels) pairs) the batches until they hold
    `CALIBRATION_IMAGES` images, so that a DataLoader over a whole training set is neither read to its end nor held
    in memory: the scales settle within a few hundred images. Each batch must be what `model` takes."""
    if calibration is None:
        raise ValueError(
            "precision='int8' needs calibration=: a few batches of typical input images (a (B, C, "
            "H, W) tensor, or an iterable of them such as a DataLoader), to set the activations' "
            "scales."
        )
    if isinstance(calibration, torch.Tensor):
        calibration = calibration.split(CALIBRATION_BATCH) if calibration.dim() == 4 else [calibration]
    batches: list[torch.Tensor] = []
    for item in calibration:
        images = item[0] if isinstance(item, (tuple, list)) else item
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            got = f"shape {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"calibration: got {got}; give image batches (B, C, H, W), as the model takes them.")
        if isinstance(model, VisionTransformer):
            try:
                check_images(images, model.config)
            except ValueError as e:
                raise ValueError(f"calibration: {e}") from None
        if len(images):
            batches.append(images)
        if not isinstance(calibration, (list, tuple)) and sum(map(len, batches)) >= CALIBRATION_IMAGES:
            break
    if not batches:
        raise ValueError("calibration= is empty: give at least one batch of images (a few hundred images is typical).")
    return batches


class Int8Model(InferenceCopy):
    """The int8 copy `quantize_int8` makes, with the model's inference interface: images in, logits out (fp32),
    and the model's `config`, `class_names` and `trained_on`. Inference only: it cannot be trained. `bf16`: the
    layers between the int8 ones (attention, LayerNorm, GELU) run in bf16 under autocast, else in fp32."""

    what = "an int8 copy"

    def __init__(self, program: nn.Module, model: VisionTransformer, bf16: bool = False):
        super().__init__(model)
        self.program = program  # the quantized graph, compiled
        self.bf16 = bf16

    def run(self, x: torch.Tensor) -> torch.Tensor:
        # Freezing (weights as constants) is what lets inductor swap in oneDNN's int8 linears; it must be set in the
        # global config when a shape compiles, which `torch.compile(options=...)` does not reach for these passes.
        with (
            torch._inductor.config.patch(freezing=True),
            torch.autocast("cpu", torch.bfloat16, enabled=self.bf16),
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", message="To copy construct from a tensor")  # inductor's, compiling
            return self.program(x).float()

    def extra_repr(self) -> str:
        return f"PT2E int8, the other layers in {'bf16' if self.bf16 else 'fp32'}"


def quantize_int8(model: VisionTransformer, calibration: torch.Tensor | typing.Iterable | None) -> Int8Model:
    """An int8 copy of `model` for CPU inference, by PyTorch's PT2E flow with the x86 inductor quantizer: every
    linear layer's weight int8 per output channel (symmetric), its input 8-bit per tensor (unsigned, with a zero
    point; 7-bit on CPUs without int8 dot-product instructions), with scales observed
    on `calibration` (a (B, C, H, W) tensor, or an iterable of such batches or of (images, labels) pairs, such as
    a DataLoader; a few hundred typical images), then compiled with freezing, so that each layer runs as
    oneDNN's int8 linear, and the layers between in bf16 where `int8_mixes_bf16`. Warns where the CPU has no fast
    int8 path (`machine.int8_fast_path_missing`)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(
            f"precision='int8' runs on CPUs only; the model is on {device}: move it with .cpu(), or "
            "use precision='bf16' on this device."
        )
    if not machine.compiler_present(device):
        raise ValueError(
            "precision='int8' needs torch.compile's C++ compiler (a C++ compiler and Python's headers, "
            "python3-dev), which lowers the quantized graph to oneDNN's int8 kernels."
        )
    machine.import_torchao_quietly()
    machine.compile_quietly_on(device)
    try:
        import torchao.quantization.pt2e as pt2e
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86
    except ImportError:
        raise ValueError("precision='int8' needs torchao (pip install torchao, or vitkit[int8]).") from None
    batches = calibration_batches(calibration, model)
    _warn_without_fast_int8()
    plain = _for_pt2e(copy.deepcopy(model).eval().requires_grad_(False))
    example = batches[0][:2].to(device=device, dtype=torch.float32)
    if len(example) < 2:  # export needs two images to keep the batch axis a variable
        example = example.expand(2, *example.shape[1:])
    batch = torch.export.Dim("batch", min=1)
    graph = torch.export.export(plain, (example,), dynamic_shapes=({0: batch},)).module()
    # Without VNNI, oneDNN multiplies uint8 by int8 in pairs summed into int16, which saturates on 8-bit inputs: the
    # quantizer's documented remedy is 7-bit activations (`reduce_range`).
    config = x86.get_default_x86_inductor_quantization_config(reduce_range=machine.int8_fast_path_missing() is not None)
    quantizer = x86.X86InductorQuantizer().set_global(config)
    observed = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for images in batches:
            observed(images.to(device=device, dtype=torch.float32))
    quantized = convert_pt2e(observed)
    _check_all_linears_quantized(quantized, plain)
    pt2e.move_exported_model_to_eval(quantized)
    program = torch.compile(quantized)  # the first call of each shape compiles (twice at most: then dynamic)
    return Int8Model(typing.cast(nn.Module, program), model, bf16=int8_mixes_bf16())


def int8_mixes_bf16() -> bool:
    """Whether PT2E's int8 copy runs the layers between its int8 linears in bf16 (PyTorch's int8-mixed-bf16 recipe
    for the x86 inductor quantizer): with AMX, whose bf16 attention and element-wise layers leave fp32's far behind
    (with them in fp32 the int8 copy trailed vitkit's bf16 copy from 8 images on, in bf16 it led at every batch size;
    docs/PERFORMANCE.md). Without AMX this is not measured, so they stay in fp32."""
    return machine.amx()


def _check_all_linears_quantized(quantized: torch.fx.GraphModule, plain: nn.Module) -> None:
    """Refuse (ValueError) where the quantizer left any of the model's linear layers in fp32: some pairings of torch
    and torchao annotate nothing (torch 2.11 with torchao 0.18 quantized none), and the copy would then run fp32
    arithmetic while called int8. A quantized layer's weight reaches its linear through `dequantize_per_channel`."""
    import torchao

    linears = sum(isinstance(m, nn.Linear) for m in plain.modules())
    done = sum(
        1
        for node in quantized.graph.nodes
        if node.target == torch.ops.aten.linear.default
        and isinstance(node.args[1], torch.fx.Node)
        and "dequantize_per_channel" in str(node.args[1].target)
    )
    if done < linears:
        raise ValueError(
            f"precision='int8': PT2E quantization (torch {torch.__version__}, torchao {torchao.__version__}) "
            f"quantized {done} of the model's {linears} linear layers, so the copy would not be int8. Install a "
            "torchao and torch that quantize together (the newest of each that vitkit allows), or use "
            "precision='bf16'."
        )


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
    import nncf

    batches = calibration_batches(calibration, model)
    _warn_without_fast_int8()
    plain, example = _plain_copy(model)
    graph = _openvino_graph(plain, example)
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
            quantized = nncf.quantize(
                graph,
                nncf.Dataset(chunks),
                model_type=nncf.ModelType.TRANSFORMER,
                subset_size=len(chunks),
                ignored_scope=attention,
                advanced_parameters=advanced,
            )
    finally:
        log.setLevel(level)
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


def layer_type(op: typing.Any) -> str:
    """The kind of a layer of a graph OpenVINO compiled (FullyConnected, Transpose, ...)."""
    return str(op.get_rt_info()["layerType"].astype(str))


def _warn_without_fast_int8() -> None:
    """Warn, at the caller of `optimize`, where the CPU has no int8 dot-product instructions."""
    missing = machine.int8_fast_path_missing()
    if missing:
        warnings.warn(
            f"this CPU has no {missing}, the fast int8 path: int8 may run no faster than fp32 here. "
            "precision='auto' gives the fastest copy with the model's own results.",
            stacklevel=4,
        )


def _for_pt2e(model: VisionTransformer) -> VisionTransformer:
    """`model` (in place) as PT2E quantizes it: the patch embedding a linear layer (quantized with the others), the
    linear layers stock `nn.Linear` (the quantizer finds them by module type), and each encoder block's residual
    contiguous (`kernels.ContiguousResidualBlock`)."""
    kernels.uninstall(kernels.install(model), (kernels.Linear,))
    for m in model.modules():
        if type(m) is EncoderBlock:
            m.__class__ = kernels.ContiguousResidualBlock
    return model
