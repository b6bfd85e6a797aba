"""Which CPU library runs a linear layer's fp32 GEMM, and `linear`, the model's linear layer that uses it.

PyTorch runs fp32 matrix products on x86 CPUs with MKL, whose fast code paths are for Intel's CPUs: on AMD's it
takes a generic AVX2 one. oneDNN (also inside PyTorch) runs AVX-512 on both. Measured as single GEMMs at ViT-S/16's
shapes (docs/PERFORMANCE.md): on an AMD EPYC Zen 5 oneDNN's forward and input gradient ran 2.0-2.3x MKL's and the
weight gradient 1.6-1.9x; on a Zen 4 the forward 1.27-1.50x and the input gradient 0.96-1.19x; on an Intel Xeon
0.97x. So on CPUs with AVX-512 that are not Intel's, `linear` computes fp32 layers with oneDNN, in training too
(whole fp32 training steps on the Zen 5: ViT-S/16 1.58x, ViT-B/16 1.75x; compiled 1.45x), and everywhere else it is
`F.linear`.
"""

from __future__ import annotations

import ctypes
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


def avx512() -> bool:
    """Whether ATen runs this CPU's AVX-512 kernels (the fp32 speed-ups measured on AVX-512 CPUs need it)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def onednn_fp32() -> bool:
    """Whether `linear` should run fp32 layers with oneDNN here: on x86 CPUs with AVX-512 whose fp32 library is
    oneDNN's. With AVX2 only, oneDNN's GEMMs are no faster than MKL's: on the Zen 5 with both limited to AVX2 the
    forward ran 1.0-1.1x, the weight gradient 0.85x, whole training steps 0.87-1.05x; on an AVX2-only AMD EPYC Zen 3,
    at the main job's shapes, the forward 0.85-1.1x and the weight gradient 0.3-0.6x."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and avx512() and fp32_library() == "onednn" and library_available("onednn")


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
# Under `torch.compile` a layer runs by oneDNN only when it has at least this many inputs and outputs: the compiled
# fp32 training step of ViT-S/16 (384 wide) ran 1.45x with oneDNN's layers, the main job's (96 wide) 0.92-1.06x, where
# the GEMMs are too small to pay for an opaque call in place of the compiler's own.
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


# glibc's malloc hands freed memory back to the system: a block above M_MMAP_THRESHOLD (128 KiB at first) is unmapped
# when freed, and the top of the heap is cut back once more than M_TRIM_THRESHOLD lies free there. A training step
# frees all its activations at its end, so the next step maps them again and takes a page fault on every 4 KiB page
# it touches: 2,100 faults a step in the main job (`vitkit train`), 3,600-8,500 in a bare loop of its step. Kept
# (these thresholds), they fell to under 50, and on a 2-core AMD EPYC Zen 3 (AVX2, under KVM) the bare compiled step
# ran 1.2-1.5x and the main job's training 1.06x (docs/PERFORMANCE.md).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 256 << 20  # blocks up to this size come from the heap (glibc's dynamic threshold stops at 32 MiB)
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before it is returned


def glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc (whose malloc `retain_freed_memory` sets), else None."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # only glibc has it


def retain_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for the next allocation instead of returning it to the system (and
    faulting it in again): for a process that runs the same steps over and over, as `vitkit` commands do (the CLI
    calls it). Process-wide and for good: a script that trains calls it once at its start. Returns False where the C
    library is not glibc (nothing changes there)."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
