"""Which CPU library runs a linear layer's fp32 GEMM, and `linear`, the model's linear layer that uses it.

PyTorch runs fp32 matrix products on x86 CPUs with MKL, whose fast code paths are for Intel's CPUs: on AMD's it
takes a generic AVX2 one. oneDNN (also inside PyTorch) runs AVX-512 on both. Measured side by side
(docs/PERFORMANCE.md): at ViT-S/16's shapes oneDNN's fp32 GEMM ran 1.3-1.5x MKL's on an AMD EPYC Zen 4 and 2.0-2.3x
on a Zen 5 (forward and input gradient; the weight gradient 1.6-1.9x), and 0.97x on an Intel Xeon. So on CPUs that
are not Intel's, `linear` computes fp32 layers with oneDNN, in training too (a whole ViT-S/16 fp32 training step
1.64x on the Zen 5), and everywhere else it is `F.linear`.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

LIBRARIES = ("mkl", "onednn")


@functools.cache
def cpu_is_intel() -> bool:
    """Whether this CPU is Intel's (MKL's fast code paths are for Intel CPUs; on others it takes generic ones)."""
    name = torch.cpu.get_capabilities().get("cpu_name", "") if hasattr(torch.cpu, "get_capabilities") else ""
    if not name:
        try:
            name = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return True  # unknown: keep the default of torch's own fp32 GEMM (MKL)
    return "intel" in name.lower()


def library_available(library: str) -> bool:
    """Whether this torch build has the packed linear of `library` ("mkl" or "onednn")."""
    if library == "mkl":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def fp32_library() -> str:
    """The library that runs fp32 linears fastest here: MKL's packed GEMM on Intel CPUs (1.09-1.32x over the plain
    model on the Xeons), oneDNN's elsewhere (AMD EPYC Zen 4: single GEMMs 1.4x over torch's MKL; see
    docs/PERFORMANCE.md)."""
    return "mkl" if library_available("mkl") and (cpu_is_intel() or not library_available("onednn")) else "onednn"


@functools.cache
def onednn_fp32() -> bool:
    """Whether `linear` runs fp32 layers with oneDNN here: on x86 CPUs whose fp32 library is oneDNN's."""
    return platform.machine().lower() in ("x86_64", "amd64") and fp32_library() == "onednn"


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) by oneDNN, for x of any leading shape; `weight` may be a transposed view."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(torch.autograd.Function):
    """F.linear with its forward and both gradients computed by oneDNN (the weight unpacked: it changes at every
    step). Gradients agree with F.linear's to fp32 rounding (tests/test_model.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.reshape(-1, weight.shape[0])  # (rows, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None).reshape(x.shape)  # grad @ weight
        if ctx.needs_input_grad[1]:
            grad_w = _onednn(grad.t(), x.reshape(-1, x.shape[-1]).t(), None)  # grad^T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed by oneDNN where that is faster (`onednn_fp32`): fp32 tensors on the CPU, outside autocast
    (which computes in bf16), `torch.compile` (which needs a constant weight for oneDNN's op), tracing and tensor
    subclasses (sharded, fake)."""
    plain = type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter)
    if (
        plain
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel()
        and (bias is None or type(bias) in (torch.Tensor, nn.Parameter))
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and onednn_fp32()
    ):
        learning = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        if learning and torch.is_grad_enabled():
            return OneDNNLinear.apply(x, weight, bias)
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state dict) whose product is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
