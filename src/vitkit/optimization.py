"""Inference-ready models: `optimize(model, precision)` returns a frozen copy that computes the same logits
faster on the machine at hand.

What it does (each step measured on the machine it was written on; figures in docs/PERFORMANCE.md):
- a copy in eval mode with every parameter frozen, so no autograd state is kept;
- bf16: the weights cast to bfloat16 once (instead of an autocast cast of every weight at every call); the
  model casts its input to its own dtype, the logits come back in bf16;
- fp32 on CPUs with MKL: every linear layer's weight packed once for MKL's GEMM (`torch.ops.mkl._mkl_linear`,
  the kernel `torch.compile(freezing)` emits), used for small batches where repacking at every call costs;
- `compile=True`: `torch.compile` with freezing instead of the packing (minutes to compile on a small CPU).

bf16 is only fast where the hardware has it: CUDA GPUs from Ampere on, and CPUs with AVX-512 BF16 or AMX.
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


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """ "auto" -> "bf16" where it is native on `device`, else "fp32"; "fp32" and "bf16" stay as they are."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown: choose one of {', '.join(PRECISIONS)}.")
    if precision == "auto":
        return "bf16" if bf16_is_native(device) else "fp32"
    return precision


# Packing pays where the weight's repacking is a large share of the work: for ViT-S/16's MLP at batch 1
# (197 rows) the packed GEMM ran 1.29x faster, at batch 8 (1,576 rows) 0.97-1.05x (docs/PERFORMANCE.md).
PACKED_MAX_ROWS = 1024


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight packed once for MKL's GEMM; the same result as `F.linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Still parameters (frozen), so that parameter counts and state dicts read as the model's own.
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        # The packing takes a batch size hint; the packed layout serves every batch size.
        self.register_buffer("packed", torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or rows > PACKED_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for MKL"


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def optimize(
    model: VisionTransformer, precision: str = "auto", *, pack: bool | None = None, compile: bool = False
) -> VisionTransformer:
    """A frozen, inference-ready copy of `model` with the same outputs (fp32: to float rounding; bf16: to bf16
    rounding), on the model's device.

    `precision`: "fp32", "bf16" (weights cast once), or "auto" (bf16 where the hardware has it, else fp32).
    `pack`: pack linear weights for MKL (default: on CPU in fp32 when MKL is there). `compile`: torch.compile
    the result (slow to start; for long runs).
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
        pack = device.type == "cpu" and precision == "fp32" and not compile and mkl_packing_available()
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
