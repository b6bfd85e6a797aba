"""Inference-ready models: `optimize(model, precision)` returns a frozen copy that computes the same logits
faster on the machine at hand.

What it does (each step measured on the machine it was written on; figures in docs/PERFORMANCE.md):
- a copy in eval mode with every parameter frozen, so no autograd state is kept;
- bf16: the weights cast to bfloat16 once (instead of an autocast cast of every weight at every call); the
  model casts its input to its own dtype, the logits come back in bf16;
- on CPUs, every linear layer's weight packed once where that pays (`packing_pays`): fp32 for MKL's GEMM
  (`torch.ops.mkl._mkl_linear`, the kernel `torch.compile(freezing)` emits) on CPUs without AVX-512, used for
  small batches where repacking at every call costs; bf16 (where native) for oneDNN's linear
  (`torch.ops.mkldnn._linear_pointwise`, inductor's bf16 kernel), at every size;
- `compile=True`: `torch.compile` with freezing instead of the packing (minutes to compile on a small CPU).

bf16 is only fast where the hardware has it: CUDA GPUs from Ampere on, and CPUs with AVX-512 BF16 or AMX.
Elsewhere oneDNN emulates it and it is several times slower than fp32: `precision="auto"` then picks fp32,
and an explicit `"bf16"` warns.
"""

from __future__ import annotations

import copy
import sysconfig
import typing
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .model import VisionTransformer

PRECISIONS = ("auto", "fp32", "bf16")


def bf16_is_native(device: torch.device | str = "cpu") -> bool:
    """Whether `device` has bfloat16 arithmetic in hardware (not emulated in fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def compiler_present(device: torch.device) -> bool:
    """Whether torch.compile's default backend can build code here: Triton for CUDA; for a CPU a C++ compiler
    and Python's C headers (inductor's CPU kernels are Python extensions; Debian ships them in python3-dev)."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    if not (Path(sysconfig.get_path("include")) / "Python.h").is_file():
        return False
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()  # runs `g++ --version` (or $CXX's), raising when there is none
    except Exception:
        return False
    return True


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """ "auto" -> "bf16" where it is native on `device`, else "fp32"; "fp32" and "bf16" stay as they are."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown: choose one of {', '.join(PRECISIONS)}.")
    if precision == "auto":
        return "bf16" if bf16_is_native(device) else "fp32"
    return precision


# fp32: packing pays where the weight's repacking is a large share of the work: for ViT-S/16's MLP at batch 1
# (197 rows) the packed GEMM ran 1.29x faster, at batch 8 (1,576 rows) 0.97-1.05x (docs/PERFORMANCE.md).
PACKED_MAX_ROWS = 1024


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight packed once for the CPU's GEMM library; the same result as `F.linear`.

    fp32: MKL's packed GEMM (`torch.ops.mkl._mkl_linear`, what `torch.compile(freezing)` emits), up to
    `PACKED_MAX_ROWS` rows. bf16: oneDNN's packed linear (`torch.ops.mkldnn._linear_pointwise`, inductor's bf16
    kernel), at every size: it skips the weight's reorder for AVX-512 BF16 / AMX at each call (ViT-S/16 batch 1
    ran 1.17x faster, batch 8 on par, with bit-identical outputs)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Still parameters (frozen), so that parameter counts and state dicts read as the model's own.
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        # The packing takes a batch size hint; the packed layout serves every batch size.
        if self.weight.dtype == torch.bfloat16:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
        else:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        if x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.numel() // self.in_features
        if rows > PACKED_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)

    def extra_repr(self) -> str:
        library = "oneDNN" if self.weight.dtype == torch.bfloat16 else "MKL"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {library}"


def packing_available(precision: str) -> bool:
    """Whether this CPU's torch can pack linear weights for `precision` ("fp32": MKL; "bf16": oneDNN, and only
    where bf16 is native)."""
    if precision == "bf16":
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bf16_is_native("cpu")
        )
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def packing_pays(precision: str) -> bool:
    """Whether `optimize` packs by default: bf16 wherever it can; fp32 on CPUs without AVX-512, where MKL's packed
    GEMM ran 1.29x at batch 1 (AVX2), while on AVX-512 it ran 0.90-1.0x of the plain model (docs/PERFORMANCE.md)."""
    if precision == "bf16":
        return packing_available("bf16")
    return packing_available("fp32") and torch.backends.cpu.get_cpu_capability() != "AVX512"


def optimize(
    model: VisionTransformer, precision: str = "auto", *, pack: bool | None = None, compile: bool = False
) -> VisionTransformer:
    """A frozen, inference-ready copy of `model` with the same outputs (fp32: to float rounding; bf16: to bf16
    rounding), on the model's device.

    `precision`: "fp32", "bf16" (weights cast once), or "auto" (bf16 where the hardware has it, else fp32).
    `pack`: pack linear weights for MKL (fp32) or oneDNN (bf16) (default: where it pays, `packing_pays`).
    `compile`: torch.compile the result (slow to start; for long runs).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"optimize() takes a model (nn.Module), got {type(model).__name__}.")
    device = next(model.parameters()).device
    precision = resolve_precision(precision, device)
    if precision == "bf16" and not bf16_is_native(device):
        warnings.warn(
            f"bf16 is emulated on this {device.type} (no native bf16 instructions): it runs slower than fp32 here. "
            'Use precision="fp32" (or "auto") for speed.',
            stacklevel=2,
        )
    fast = copy.deepcopy(model).eval().requires_grad_(False)
    if precision == "bf16":
        fast = fast.to(torch.bfloat16)
    if pack and compile:
        raise ValueError("pack=True and compile=True: choose one; the compiler packs the weights itself (freezing).")
    if pack is None:
        pack = device.type == "cpu" and not compile and packing_pays(precision)
    elif pack and not (device.type == "cpu" and packing_available(precision)):
        raise ValueError(f"pack=True: this {device.type} cannot pack {precision} linear weights (MKL for fp32; oneDNN "
                         "with native bf16 for bf16); leave pack=None to pack where it can.")  # fmt: skip
    if pack:
        _replace_linears(fast)
    if compile:  # freezing: weights become constants the compiler can pack and fold
        # An OptimizedModule: it forwards attribute access (config, class_names) to the model it wraps.
        fast = typing.cast(VisionTransformer, torch.compile(fast, dynamic=False, options={"freezing": True}))
    return fast


def _replace_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
        else:
            _replace_linears(child)
