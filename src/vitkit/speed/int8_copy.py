"""The int8 backend of `vitkit.optimize` in PyTorch: the model quantized by PT2E with the x86 inductor quantizer
(torchao's), then compiled by `torch.compile` with freezing, which lowers each linear layer to oneDNN's int8 linear
(`quantize_int8`, `Int8Model`). Every linear layer's weight int8 per output channel, its input 8-bit per tensor, with
scales calibrated on a few batches the caller passes; refused unless every linear layer runs in int8.
"""

from __future__ import annotations

import copy
import typing
import warnings

import torch
from torch import nn

from vitkit.models.vit import EncoderBlock, VisionTransformer

from . import kernels, machine
from .copies import InferenceCopy, Options, calibration_batches, warn_without_fast_int8

NAME = "int8"
PRECISIONS = ("int8",)


def make(model: VisionTransformer, precision: str, options: Options) -> Int8Model:
    """`quantize_int8` of `model` on `options.calibration`."""
    return quantize_int8(model, options.calibration)


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
    warn_without_fast_int8()
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


def _for_pt2e(model: VisionTransformer) -> VisionTransformer:
    """`model` (in place) as PT2E quantizes it: the patch embedding a linear layer (quantized with the others), the
    linear layers stock `nn.Linear` (the quantizer finds them by module type), and each encoder block's residual
    contiguous (`kernels.ContiguousResidualBlock`)."""
    kernels.uninstall(kernels.install(model), (kernels.Linear,))
    for m in model.modules():
        if type(m) is EncoderBlock:
            m.__class__ = kernels.ContiguousResidualBlock
    return model
