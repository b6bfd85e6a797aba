"""The fast kernels of the model's layers, and `install`, which swaps them in: `linear` (which CPU library runs a
linear layer's fp32 GEMM), `attend` (which attention kernel runs softmax(q k^T / sqrt(d) + bias) v) and the patch
embedding as one GEMM. `vitkit.models.vit` stays stock PyTorch; `install(model)` replaces its layers in place by
subclasses with no state of their own, so the parameters, the state dict and any optimizer over them are unchanged.

PyTorch runs fp32 matrix products on x86 CPUs with MKL, whose fast code paths are for Intel's CPUs: on others it
takes a generic one. oneDNN (also inside PyTorch) runs AVX-512 on every vendor's CPUs. So on CPUs with AVX-512 that
are not Intel's, `linear` computes fp32 layers with oneDNN, in training too, and everywhere else it is `F.linear`
(figures in docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.models.vit import Attention, EncoderBlock, VisionTransformer, attend_explicit, head_scale

from . import machine

M = TypeVar("M", bound=nn.Module)
LIBRARIES = ("mkl", "onednn")


def library_available(library: str) -> bool:
    """Whether this torch build has the packed linear of `library` ("mkl" or "onednn")."""
    if library == "mkl":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def fp32_library() -> str:
    """The library that runs fp32 linears fastest here: MKL's packed GEMM on Intel CPUs, oneDNN's elsewhere."""
    mkl = library_available("mkl") and (machine.cpu_is_intel() or not library_available("onednn"))
    return "mkl" if mkl else "onednn"


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


# Attention. SDPA everywhere, except on a CPU: training under `torch.compile` takes the written-out attention (the
# compiler fuses its scale, softmax and casts around the two matmuls), and bf16 inference on a CPU with AVX-512 BF16
# but no AMX takes the same two matmuls a few images at a time (SDPA's bf16 kernel is slow there; with AMX it is
# fast). A TorchScript trace, which is how OpenVINO's PyTorch frontend converts a model for `optimize`, also takes
# the written-out attention: OpenVINO fuses it into its own attention kernel with one transpose and one reorder
# fewer per layer than its conversion of SDPA gives. Figures in docs/PERFORMANCE.md.


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v over (B, H, N, d): `attend_sdpa`; `attend_explicit` when a CPU trains
    under `torch.compile`, and in a TorchScript trace; `attend_bf16_cpu` for bf16 inference on a CPU with AVX-512
    BF16 but no AMX."""
    if torch.jit.is_tracing() or (torch.compiler.is_compiling() and _cpu_training(q)):
        return attend_explicit(q, k, v, bias, dropout_p)[0]
    inference = not dropout_p and not _cpu_training(q) and not torch.compiler.is_compiling()
    if inference and q.dtype == torch.bfloat16 and q.device.type == "cpu" and _cpu_bf16_without_amx():
        return attend_bf16_cpu(q, k, v, bias)
    return attend_sdpa(q, k, v, bias, dropout_p)


def _cpu_training(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.requires_grad and torch.is_grad_enabled()


def _cpu_bf16_without_amx() -> bool:
    """AVX-512 BF16 but no AMX. (Where bf16 is emulated, SDPA's kernel, which computes in fp32, stays.)"""
    return machine.avx512_bf16() and not machine.amx()


def attend_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """`attend` by `F.scaled_dot_product_attention`. Training in bf16 on a CPU, it runs in fp32 and rounds the
    result to bf16: PyTorch's bf16 attention backward on CPUs is slower than fp32's, casts included."""
    if q.dtype == torch.bfloat16 and _cpu_training(q):
        with torch.autocast("cpu", enabled=False):  # autocast would cast the fp32 inputs back to bf16
            mask = None if bias is None else bias.float()
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p)
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)


# attend_bf16_cpu works through the batch in pieces of at most this many attention logits (B*H*N*N), which keep
# the (N, N) logits in cache.
BF16_CPU_LOGITS = 2**22


def attend_bf16_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`attend` in bf16 on a CPU with AVX-512 BF16 but no AMX: two batched bf16 matmuls (fp32 accumulation) and a
    bf16 softmax (computed in fp32 inside the kernel), a few images at a time. Its logits stay as close to fp32
    attention's as SDPA's do."""
    b, h, n, _ = q.shape
    step = max(1, BF16_CPU_LOGITS // (h * n * k.shape[-2]))
    q = q * head_scale(q)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    for i in range(0, b, step):
        logits = q[i : i + step] @ k[i : i + step].transpose(-2, -1)  # (b, H, N, N)
        if bias is not None:  # shared by the batch, or one per image
            logits = logits + (bias[i : i + step] if bias.dim() == 4 and bias.shape[0] > 1 else bias)
        torch.matmul(logits.softmax(dim=-1), v[i : i + step], out=out[i : i + step])
    return out


# ----------------------------------------------------------------------------------------------------------
# The layers that run these kernels, and `install`.
# ----------------------------------------------------------------------------------------------------------


class CpuAttention(Attention):
    """The model's attention whose kernel is `attend`: the same arithmetic, by the faster kernel on a CPU."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float
    ) -> torch.Tensor:
        return attend(q, k, v, bias, dropout_p)


class PatchGemm(nn.Conv2d):
    """The patch embedding's convolution (stride = kernel size, no padding) written as the matrix product it is:
    each patch flattened in the order the Conv2d weight is stored in (channel, row, column) and multiplied by it.
    Its backward is one GEMM, cheaper than the convolution's on a CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (b, c, h, w), (ph, pw) = x.shape, self.stride
        gh, gw = h // ph, w // pw  # not reshape(b, -1, ...): an empty batch leaves -1 undefined
        patches = x.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * ph * pw)
        y = linear(patches, self.weight.flatten(1), self.bias)  # (B, gh*gw, D)
        return y.transpose(1, 2).unflatten(2, (gh, gw))  # (B, D, gh, gw), the convolution's layout (a view)


class ContiguousResidualBlock(EncoderBlock):
    """The encoder block with the residual's rows copied into a tensor of their own when only some queries are
    computed: inductor's int8 linear (the PT2E int8 copy), fused with the residual add, misreads a strided addend
    (B, queries, D) cut from (B, N, D). The copy is B x D numbers."""

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, need_weights: bool = False, queries: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        y, probs = self.attn(self.norm1(x), bias, need_weights, queries)
        x = x[:, :queries].contiguous() + self.drop_path1(self.ls1(self.drop(y)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x, probs


def _is_patch_convolution(m: nn.Module) -> bool:
    return (
        type(m) is nn.Conv2d
        and m.kernel_size == m.stride
        and m.padding == (0, 0)
        and m.dilation == (1, 1)
        and m.groups == 1
    )


def install(model: M) -> M:
    """Swap the fast kernels into `model` (in place; returned): on a CPU the attention by `attend` and the patch
    embedding as a GEMM, and the linear layers by oneDNN where `ONEDNN_FP32`. Elsewhere (GPUs) the stock layers
    are the fast ones and nothing changes. The choices that depend on the machine are made here, once; those that
    depend on the call (autocast, tracing, compiling, gradients) stay inside the kernels."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    for m in model.modules():
        if type(m) is nn.Linear and ONEDNN_FP32 and on_cpu:
            m.__class__ = Linear
        elif type(m) is Attention and on_cpu:
            m.__class__ = CpuAttention
        elif isinstance(m, VisionTransformer) and on_cpu and _is_patch_convolution(m.embedding):
            m.embedding.__class__ = PatchGemm
    return model


PLAIN: dict[type, type] = {
    Linear: nn.Linear,
    CpuAttention: Attention,
    PatchGemm: nn.Conv2d,
    ContiguousResidualBlock: EncoderBlock,
}


def uninstall(model: M, kinds: tuple[type, ...] = tuple(PLAIN)) -> M:
    """Undo `install` (in place; returned): every layer of `kinds` back to the stock layer it extends."""
    for m in model.modules():
        if type(m) in kinds:
            m.__class__ = PLAIN[type(m)]
    return model
