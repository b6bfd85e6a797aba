"""Inference-ready models: `optimize(model, precision)` returns a frozen copy that computes the same logits
faster on the machine at hand.

What it does (each step kept where it paid; figures in docs/PERFORMANCE.md):
- a copy in eval mode with every parameter frozen, so no autograd state is kept;
- bf16: the weights cast to bfloat16 once (instead of an autocast cast of every weight at every call); the
  model casts its input to its own dtype, the logits come back in bf16;
- on CPUs, every linear layer's weight packed where that pays (`packing_pays`): fp32 on AVX-512 CPUs, for MKL's GEMM
  on Intel's (`torch.ops.mkl._mkl_linear`, the kernel `torch.compile(freezing)` emits) and for oneDNN's on others
  (`fp32_library`), one packing per number of rows up to `PACKED_MAX_ROWS`; bf16 (where native) for oneDNN's linear
  (`torch.ops.mkldnn._linear_pointwise`, inductor's bf16 kernel), with the MLP's GELU fused in (so in oneDNN's fp32
  too), packed for the number of rows up to `PACKED_MAX_ROWS` too, and above it with the packing for 1 row;
- `compile=True`: `torch.compile` with freezing instead of the packing (minutes to compile on a small CPU);
- OpenVINO (`runtime="openvino"`, and by default where `copies.openvino_pays`): the model converted and compiled by
  OpenVINO, behind the same interface (`copies.OpenVINOModel`); by default its single images run with vitkit's own
  kernels where `torch_pays_for_single_images`;
- int8 (asked for by name only, since it changes the results): NNCF's quantization run by OpenVINO where OpenVINO
  runs the model and NNCF is installed, else PyTorch's PT2E quantization compiled by inductor (`copies`).

bf16 is only fast where the hardware has it: CUDA GPUs with bf16 units, and CPUs with AVX-512 BF16 or AMX.
Elsewhere oneDNN emulates it and it is several times slower than fp32: `precision="auto"` then picks fp32,
and an explicit `"bf16"` warns.
"""

from __future__ import annotations

import copy
import typing
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import copies, kernels, machine
from .kernels import LIBRARIES, Linear, fp32_library, library_available
from .model import MlpBlock, VisionTransformer

OPTIMIZE_PRECISIONS = (*machine.PRECISIONS, "int8")  # int8 for inference only, never chosen by "auto"
OPTIMIZE_RUNTIMES = ("auto", "torch", "openvino")  # what runs the optimized copy: see `optimize`


# fp32: MKL's packed GEMM is packed for one number of rows (`_mkl_linear` falls back to `F.linear` for any other), so
# each row count gets its own packing, made at its first call. It pays up to a few thousand rows (batch 8 of a
# 224 px model), not at batch 64; above `PACKED_MAX_ROWS` the layer calls `F.linear`.
# bf16: oneDNN's packing takes a hint of the number of rows, which sets the blocking of its kernel; any packing
# serves every size. Packing for the row count beats a hint of 1 up to `PACKED_MAX_ROWS`; above it the hint stays 1.
# Figures in docs/PERFORMANCE.md.
PACKED_MAX_ROWS = 2048
MAX_PACKINGS = 8  # row counts kept per layer (each one a copy of the weight); the oldest is dropped first


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight packed for the CPU's GEMM library, optionally followed by a GELU; the same
    result as `F.linear` (and `F.gelu`).

    `library` "mkl" (fp32 only): MKL's packed GEMM (`torch.ops.mkl._mkl_linear`, what `torch.compile(freezing)`
    emits), packed for each row count up to `PACKED_MAX_ROWS` at its first call; above it `F.linear`, then the GELU.
    "onednn": oneDNN's packed linear (`torch.ops.mkldnn._linear_pointwise`, inductor's bf16 kernel), packed for each
    row count up to `PACKED_MAX_ROWS` the same way, and above it with the packing for 1 row (oneDNN's runs any size):
    it skips the weight's reorder at each call, and computes the GELU on the fp32 accumulator as a post-op (in bf16,
    before rounding: one pass over the output fewer). Default: oneDNN for bf16 weights, `fp32_library()` for fp32.
    `gelu`: None, or nn.GELU's `approximate` ("none", "tanh")."""

    def __init__(self, linear: nn.Linear, gelu: str | None = None, library: str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.gelu = linear.in_features, linear.out_features, gelu
        # Still parameters (frozen), so that parameter counts and state dicts read as the model's own.
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        if library is None:
            library = "onednn" if self.weight.dtype == torch.bfloat16 else fp32_library()
        if library not in LIBRARIES or (library == "mkl" and self.weight.dtype != torch.float32):
            raise ValueError(f"library={library!r}: choose 'onednn', or 'mkl' for fp32 weights only.")
        self.library = library
        self.packings: dict[int, torch.Tensor] = {}  # rows -> the weight packed for that many rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed_here = x.dtype == self.weight.dtype and x.device.type == "cpu"
        rows = x.numel() // self.in_features
        if packed_here and self.library == "onednn":  # the GELU runs inside oneDNN's kernel
            attr, algorithm = ("none", "") if self.gelu is None else ("gelu", self.gelu)
            weight = self.packing(rows if rows <= PACKED_MAX_ROWS else 1)
            return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, attr, [], algorithm)
        if packed_here and rows <= PACKED_MAX_ROWS:
            y = torch.ops.mkl._mkl_linear(x, self.packing(rows), self.weight, self.bias, rows)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.gelu is None else F.gelu(y, approximate=self.gelu)

    def packing(self, rows: int) -> torch.Tensor:
        """The weight packed for `rows` rows (for MKL's or oneDNN's GEMM), made at its first call with that many."""
        if rows not in self.packings:
            if len(self.packings) >= MAX_PACKINGS:
                del self.packings[next(iter(self.packings))]
            if self.library == "onednn":
                self.packings[rows] = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)
            else:
                self.packings[rows] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
        return self.packings[rows]

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        """A copy packed afresh: packed weights are opaque (mkldnn) tensors, which cannot be copied."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(copy.deepcopy(self.weight.detach(), memo), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(copy.deepcopy(self.bias.detach(), memo), requires_grad=False)
        return PackedLinear(linear, self.gelu, self.library)

    def extra_repr(self) -> str:
        library = {"onednn": "oneDNN", "mkl": "MKL"}[self.library]
        gelu = "" if self.gelu is None else f", then GELU (approximate={self.gelu!r})"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {library}{gelu}"


def packing_available(precision: str) -> bool:
    """Whether this CPU's torch can pack linear weights for `precision` ("fp32": with `fp32_library()`; "bf16":
    oneDNN, and only where bf16 is native)."""
    if precision == "bf16":
        return library_available("onednn") and machine.bf16_is_native("cpu")
    return library_available(fp32_library())


def packing_pays(precision: str) -> bool:
    """Whether `optimize` packs by default. fp32: where the CPU has AVX-512, up to `PACKED_MAX_ROWS` rows; not with
    AVX2 only, where it does not pay. bf16: wherever bf16 is native, for the number of rows up to `PACKED_MAX_ROWS`
    and above it with the packing for 1 row."""
    return packing_available(precision) and (precision == "bf16" or machine.avx512())


# The width from which vitkit's packed bf16 kernels ran single images faster than OpenVINO on a CPU with native bf16
# but no AMX (ViT-B/16 and ViT-L/16 did, ViT-Ti/16 and ViT-S/16 did not; docs/PERFORMANCE.md).
SINGLE_IMAGES_TORCH_MIN_WIDTH = 768


def torch_pays_for_single_images(config: typing.Any, precision: str) -> bool:
    """Whether `optimize`'s OpenVINO copy runs single images with vitkit's own kernels instead: bf16 on a CPU with
    native bf16 but no AMX (AVX-512 BF16), for models `SINGLE_IMAGES_TORCH_MIN_WIDTH` wide or wider. With AMX,
    OpenVINO ran single images of ViT-S/16 and ViT-B/16 faster (1.5-1.8x), so OpenVINO keeps them."""
    wide = getattr(config, "hidden_size", 0) >= SINGLE_IMAGES_TORCH_MIN_WIDTH
    return precision == "bf16" and machine.bf16_is_native("cpu") and not machine.amx() and wide


def optimize(
    model: VisionTransformer,
    precision: str = "auto",
    *,
    runtime: str = "auto",
    pack: bool | None = None,
    compile: bool = False,
    calibration: torch.Tensor | typing.Iterable | None = None,
) -> VisionTransformer:
    """A frozen, inference-ready copy of `model` with the same outputs (fp32: to float rounding; bf16: to bf16
    rounding; int8: to int8 quantization), on the model's device.

    `precision`: "fp32", "bf16" (weights cast once), "auto" (bf16 where the hardware has it, else fp32), or
    "int8" (CPU only; see `copies.quantize_int8_openvino` and `copies.quantize_int8`; "auto" never picks it, since
    it changes the results).
    `calibration`: for int8 only, images to calibrate the activations' scales on (see `copies.quantize_int8`).
    `pack`: pack linear weights for MKL (fp32) or oneDNN (bf16) (default: where it pays, `packing_pays`). Each
    packing is a copy of the linear weights, made at the first call with a batch size of up to `PACKED_MAX_ROWS`
    rows, at most `MAX_PACKINGS` of them (ViT-B/16: 340 MB each in fp32, 170 MB in bf16; bf16 runs larger batches
    with the packing for 1 row).
    `compile`: torch.compile the result (slow to start; for long runs).
    `runtime`: "torch" (vitkit's own kernels, as above; int8: PT2E), "openvino" (a `copies.OpenVINOModel`: the
    model converted and compiled by OpenVINO, CPU only; int8: quantized by NNCF) or "auto": OpenVINO where
    `copies.openvino_pays` (int8: and NNCF is installed), unless `pack` or `compile` is given, with single images
    run by vitkit's own kernels where `torch_pays_for_single_images`; if the conversion fails or its logits differ,
    with a warning, vitkit's own kernels.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"optimize() takes a model (nn.Module), got {type(model).__name__}.")
    if precision == "int8":
        if pack or compile:
            raise ValueError(
                "precision='int8' with pack=True or compile=True: int8 is always compiled (freezing "
                "packs its weights); leave both at their defaults."
            )
        if runtime not in OPTIMIZE_RUNTIMES:
            raise ValueError(f"runtime={runtime!r}: choose from {', '.join(OPTIMIZE_RUNTIMES)}.")
        device = next(model.parameters()).device
        batches = copies.calibration_batches(calibration, model)
        nncf_pays = copies.openvino_pays("fp32", device) and copies.nncf_available()
        if runtime == "openvino" or (runtime == "auto" and nncf_pays):
            try:  # an OpenVINOModel or an Int8Model: a VisionTransformer's inference interface
                return typing.cast(VisionTransformer, copies.quantize_int8_openvino(model, batches, device))
            except (ValueError, RuntimeError) as e:
                if runtime == "openvino":
                    raise
                warnings.warn(f"{e} PT2E quantizes it instead.", stacklevel=2)
        return typing.cast(VisionTransformer, copies.quantize_int8(model, batches))
    if calibration is not None:
        raise ValueError(
            f"calibration= with precision={precision!r}: only int8 is calibrated; pass "
            "precision='int8', or leave calibration out."
        )
    if runtime not in OPTIMIZE_RUNTIMES:
        raise ValueError(f"runtime={runtime!r}: choose from {', '.join(OPTIMIZE_RUNTIMES)}.")
    device = next(model.parameters()).device
    precision = machine.resolve_precision(precision, device)
    torch_asked = pack is not None or compile  # options of vitkit's own kernels
    if runtime == "openvino" or (runtime == "auto" and not torch_asked and copies.openvino_pays(precision, device)):
        in_openvino = _in_openvino(model, precision, device, runtime == "openvino", pack, compile)
        if runtime == "auto" and isinstance(in_openvino, copies.OpenVINOModel):
            if torch_pays_for_single_images(in_openvino.config, precision):
                in_openvino.single_images = optimize(model, precision, runtime="torch")
        return typing.cast(VisionTransformer, in_openvino)
    if precision == "bf16" and not machine.bf16_is_native(device):
        warnings.warn(
            f"bf16 is emulated on this {device.type} (no native bf16 instructions): it runs slower than fp32 here. "
            'Use precision="fp32" (or "auto") for speed.',
            stacklevel=2,
        )
    fast = kernels.install(copy.deepcopy(model).eval().requires_grad_(False))
    if precision == "bf16":
        fast = fast.to(torch.bfloat16)
    if pack and compile:
        raise ValueError("pack=True and compile=True: choose one; the compiler packs the weights itself (freezing).")
    if pack is None:
        pack = device.type == "cpu" and not compile and packing_pays(precision)
    elif pack and not (device.type == "cpu" and packing_available(precision)):
        raise ValueError(
            f"pack=True: this {device.type} cannot pack {precision} linear weights (MKL for fp32; oneDNN "
            "with native bf16 for bf16); leave pack=None to pack where it can."
        )
    if pack:
        _replace_linears(fast)
    if compile:  # freezing: weights become constants the compiler can pack and fold
        machine.compile_quietly_on(device)
        # An OptimizedModule: it forwards attribute access (config, class_names) to the model it wraps.
        fast = typing.cast(VisionTransformer, torch.compile(fast, dynamic=False, options={"freezing": True}))
    return fast


def _in_openvino(
    model: VisionTransformer, precision: str, device: torch.device, asked: bool, pack: bool | None, compile: bool
) -> VisionTransformer | copies.OpenVINOModel:
    """`optimize`'s OpenVINO copy; where OpenVINO was not `asked` for by name, any failure (with a warning) gives
    vitkit's own copy instead."""
    if asked:
        if pack or compile:
            raise ValueError("runtime='openvino' with pack=True or compile=True: those are torch's; choose one.")
        if device.type != "cpu":
            raise ValueError(
                f"runtime='openvino' runs on the CPU, and the model is on {device}: move it with "
                "model.cpu(), or use runtime='torch'."
            )
        if not copies.openvino_available():
            raise ValueError(
                "runtime='openvino' needs OpenVINO: pip install openvino (or vitkit[openvino]); "
                "runtime='torch' runs without it."
            )
        if precision == "bf16" and not machine.bf16_is_native("cpu"):
            raise ValueError("runtime='openvino' in bf16 needs a CPU with native bf16; use precision='fp32'.")
        return copies.to_openvino(model, precision)
    try:
        return copies.to_openvino(model, precision)
    except (ValueError, RuntimeError) as e:
        warnings.warn(f"{e} vitkit's own kernels run it instead.", stacklevel=3)
        return optimize(model, precision, runtime="torch")


def _plain_linear(module: nn.Module) -> typing.TypeGuard[nn.Linear]:
    """nn.Linear or the model's `kernels.Linear`, not another subclass (whose forward may do more)."""
    return type(module) in (nn.Linear, Linear)


def _replace_linears(module: nn.Module) -> None:
    """Every nn.Linear -> PackedLinear; an MLP's GELU moves into its first layer (fused there in bf16)."""
    for name, child in module.named_children():
        if type(child) is MlpBlock and type(child.act) is nn.GELU and _plain_linear(child.fc1):
            child.register_module("fc1", PackedLinear(child.fc1, gelu=child.act.approximate))
            child.register_module("act", nn.Identity())
        if _plain_linear(child):
            setattr(module, name, PackedLinear(child))
        else:
            _replace_linears(child)
