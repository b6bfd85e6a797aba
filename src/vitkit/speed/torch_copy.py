"""The torch backend of `vitkit.optimize`: a frozen copy with vitkit's own kernels installed, bf16 weights cast once,
and every linear layer's weight packed for the CPU's GEMM library where that pays (`PackedLinear`), or compiled by
`torch.compile` with freezing.
"""

from __future__ import annotations

import copy
import typing
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.models.vit import MlpBlock, VisionTransformer

from . import kernels, machine
from .copies import InferenceModel, Options
from .kernels import LIBRARIES, Linear, fp32_library, library_available

NAME = "torch"
PRECISIONS = ("fp32", "bf16")


def make(model: VisionTransformer, precision: str, options: Options) -> InferenceModel:
    """A frozen copy of `model` in `precision` with vitkit's kernels installed (`kernels.install`), bf16 weights
    cast once, then its linear weights packed (`options.pack`; None: where `packing_pays`), or compiled by
    `torch.compile` with freezing (`options.compile`; slow to start, for long runs)."""
    device = next(model.parameters()).device
    if precision == "bf16" and not machine.bf16_is_native(device):
        warnings.warn(
            f"bf16 is emulated on this {device.type} (no native bf16 instructions): it runs slower than fp32 here. "
            'Use precision="fp32" (or "auto") for speed.',
            stacklevel=4,
        )
    fast = kernels.install(copy.deepcopy(model).eval().requires_grad_(False))
    if precision == "bf16":
        fast = fast.to(torch.bfloat16)
    if _packs(options, device, precision):
        _replace_linears(fast)
    if options.compile:  # freezing: weights become constants the compiler can pack and fold
        machine.compile_quietly_on(device)
        # An OptimizedModule, an InferenceModel too: it forwards attribute access (config, class_names) to the model.
        compiled: typing.Any = torch.compile(fast, dynamic=False, options={"freezing": True})
        return compiled
    return fast


def _packs(options: Options, device: torch.device, precision: str) -> bool:
    """Whether `make` packs the linear weights: as asked, else where it pays; refused where it cannot."""
    if options.pack and options.compile:
        raise ValueError("pack=True and compile=True: choose one; the compiler packs the weights itself (freezing).")
    if options.pack is None:
        return device.type == "cpu" and not options.compile and packing_pays(precision)
    if options.pack and not (device.type == "cpu" and packing_available(precision)):
        raise ValueError(
            f"pack=True: this {device.type} cannot pack {precision} linear weights (MKL for fp32; oneDNN "
            "with native bf16 for bf16); leave pack=None to pack where it can."
        )
    return options.pack


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
