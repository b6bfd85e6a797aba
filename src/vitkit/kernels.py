"""Which CPU library runs a linear layer's fp32 GEMM, and `linear`, the model's linear layer that uses it.

PyTorch runs fp32 matrix products on x86 CPUs with MKL, whose fast code paths are for Intel's CPUs: on others it
takes a generic one. oneDNN (also inside PyTorch) runs AVX-512 on every vendor's CPUs. So on CPUs with AVX-512 that
are not Intel's, `linear` computes fp32 layers with oneDNN, in training too, and everywhere else it is `F.linear`
(figures in docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import machine

LIBRARIES = ("mkl", "onednn")


def library_available(library: str) -> bool:
    """Whether this torch build has the packed linear of `library` ("mkl" or "onednn")."""
    if library == "mkl":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def fp32_library() -> str:
    """The library that runs fp32 linears fastest here: MKL's packed GEMM on Intel CPUs, oneDNN's elsewhere."""
    return (
        "mkl" if library_available("mkl") and (machine.cpu_is_intel() or not library_available("onednn")) else "onednn"
    )


def onednn_fp32() -> bool:
    """Whether `linear` should run fp32 layers with oneDNN here: on x86 CPUs with AVX-512 whose fp32 library is
    oneDNN's. With AVX2 only, oneDNN's GEMMs are no faster than MKL's (its weight gradient is slower)."""
    return machine.x86() and machine.avx512() and fp32_library() == "onednn" and library_available("onednn")


# Decided once, at import: a constant, which `torch.compile` reads without tracing the probes (a graph break).
ONEDNN_FP32 = onednn_fp32()


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) by oneDNN, for x of any leading shape; `weight` may be a transposed view."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], weight.shape[0])


# An operator of its own, so that `torch.compile` keeps it as one opaque call (inductor's lowering of oneDNN's op
# needs a constant weight), with its gradients by oneDNN too.
@torch.library.custom_op("vitkit::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear by oneDNN (the weight unpacked: it changes at every step); its forward and both gradients agree
    with F.linear's to fp32 rounding (tests/test_kernels.py)."""
    return _onednn(x, weight, bias)


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _save(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _gradients(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    grad = grad.reshape(-1, weight.shape[0])  # (rows, out)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = onednn_linear(grad, weight.t(), None).reshape(x.shape)  # grad @ weight
    if ctx.needs_input_grad[1]:
        grad_w = onednn_linear(grad.t(), x.reshape(-1, x.shape[-1]).t(), None)  # grad^T @ x
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = grad.sum(0)
    return grad_x, grad_w, grad_b


onednn_linear.register_autograd(_gradients, setup_context=_save)

_PLAIN = (torch.Tensor, nn.Parameter)
# Under `torch.compile` a layer runs by oneDNN only when it has at least this many inputs and outputs: smaller GEMMs
# do not pay for an opaque call in place of the compiler's own.
COMPILED_MIN_FEATURES = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed by oneDNN where that is faster (`ONEDNN_FP32`): fp32 tensors on the CPU, outside autocast
    (which computes in bf16), export and tracing (whose graphs should hold standard operators) and tensor subclasses
    (sharded, fake); under `torch.compile` for layers of `COMPILED_MIN_FEATURES` or more."""
    if (
        ONEDNN_FP32  # first: where it is False (Intel, AVX2), the layer is F.linear after one test
        and type(x) in _PLAIN
        and type(weight) in _PLAIN
        and (bias is None or type(bias) in _PLAIN)
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_exporting()
        and not torch.jit.is_tracing()
        and (not torch.compiler.is_compiling() or min(weight.shape) >= COMPILED_MIN_FEATURES)
    ):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state dict) whose product is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
