"""`optimize(model, precision)`: a frozen copy that computes the same logits faster on the machine at hand, made by
one of three backends, each a module with the same small interface (`NAME`, `PRECISIONS`, `make(model, precision,
options)`), chosen by `choose`, a rule that reads like the measured table (docs/PERFORMANCE.md):

- `torch_copy`: vitkit's own kernels installed, bf16 weights cast once, linear weights packed where that pays, or
  `torch.compile` with freezing;
- `openvino_copy`: OpenVINO's CPU plugin runs the model, by default where `openvino_copy.openvino_pays` (it ran ViTs
  faster than vitkit's own kernels in most cells), and int8 by NNCF there;
- `int8_copy`: PyTorch's PT2E int8, compiled by inductor.

bf16 is only fast where the hardware has it: CUDA GPUs with bf16 units, and CPUs with AVX-512 BF16 or AMX.
Elsewhere oneDNN emulates it and it is several times slower than fp32: `precision="auto"` then picks fp32,
and an explicit `"bf16"` warns.
"""

from __future__ import annotations

import typing
import warnings

import torch
from torch import nn

from vitkit.models.vit import VisionTransformer

from . import int8_copy, machine, openvino_copy, torch_copy
from .copies import InferenceModel, Options, calibration_batches

OPTIMIZE_PRECISIONS = (*machine.PRECISIONS, "int8")  # int8 for inference only, never chosen by "auto"
OPTIMIZE_RUNTIMES = ("auto", "torch", "openvino")  # what runs the optimized copy: see `optimize`
BACKENDS = {backend.NAME: backend for backend in (torch_copy, openvino_copy, int8_copy)}


def optimize(
    model: VisionTransformer,
    precision: str = "auto",
    *,
    runtime: str = "auto",
    pack: bool | None = None,
    compile: bool = False,
    calibration: torch.Tensor | typing.Iterable | None = None,
) -> InferenceModel:
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
    _check_arguments(model, precision, runtime, pack, compile, calibration)
    device = next(model.parameters()).device
    if precision == "int8":
        calibration = calibration_batches(calibration, model)
    else:
        precision = machine.resolve_precision(precision, device)
    options = Options(pack=pack, compile=compile, calibration=calibration)
    name = choose(precision, runtime, device, torch_asked=pack is not None or compile)
    if runtime != "auto":
        return BACKENDS[name].make(model, precision, options)
    return _made_or_fallen_back(model, name, precision, options)


def choose(precision: str, runtime: str, device: torch.device, torch_asked: bool) -> str:
    """The backend: the runtime asked for by name; else OpenVINO where it pays (int8: where NNCF is installed too;
    fp32 and bf16: unless torch's own options, `pack` or `compile`, were asked for); else torch's (PT2E for int8)."""
    in_torch = "int8" if precision == "int8" else "torch"
    if runtime != "auto":
        return "openvino" if runtime == "openvino" else in_torch
    if precision == "int8":
        pays = openvino_copy.openvino_pays("fp32", device) and openvino_copy.nncf_available()
    else:
        pays = not torch_asked and openvino_copy.openvino_pays(precision, device)
    return "openvino" if pays else in_torch


# What runs a copy where the OpenVINO one that "auto" chose could not be made, and the warning's last words.
FALLBACK = {"int8": "PT2E quantizes it instead.", "torch": "vitkit's own kernels run it instead."}


def _made_or_fallen_back(model: VisionTransformer, name: str, precision: str, options: Options) -> InferenceModel:
    """The copy `name` makes, for `runtime="auto"`: where OpenVINO fails (with a warning) torch's instead; where
    `torch_pays_for_single_images`, OpenVINO's copy hands single images to torch's."""
    try:
        made = BACKENDS[name].make(model, precision, options)
    except (ValueError, RuntimeError) as e:
        if name != "openvino":
            raise
        fallback = "int8" if precision == "int8" else "torch"
        warnings.warn(f"{e} {FALLBACK[fallback]}", stacklevel=3)
        return BACKENDS[fallback].make(model, precision, options)
    if isinstance(made, openvino_copy.OpenVINOModel) and torch_pays_for_single_images(made.config, precision):
        made.single_images = torch_copy.make(model, precision, options)
    return made


def _check_arguments(
    model: nn.Module, precision: str, runtime: str, pack: bool | None, compile: bool, calibration: typing.Any
) -> None:
    """Refuse (ValueError) what no backend takes, naming the fix."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"optimize() takes a model (nn.Module), got {type(model).__name__}.")
    if precision == "int8" and (pack or compile):
        raise ValueError(
            "precision='int8' with pack=True or compile=True: int8 is always compiled (freezing "
            "packs its weights); leave both at their defaults."
        )
    if precision != "int8" and calibration is not None:
        raise ValueError(
            f"calibration= with precision={precision!r}: only int8 is calibrated; pass "
            "precision='int8', or leave calibration out."
        )
    if runtime not in OPTIMIZE_RUNTIMES:
        raise ValueError(f"runtime={runtime!r}: choose from {', '.join(OPTIMIZE_RUNTIMES)}.")


# The width from which vitkit's packed bf16 kernels ran single images faster than OpenVINO on a CPU with native bf16
# but no AMX (ViT-B/16 and ViT-L/16 did, ViT-Ti/16 and ViT-S/16 did not; docs/PERFORMANCE.md).
SINGLE_IMAGES_TORCH_MIN_WIDTH = 768


def torch_pays_for_single_images(config: typing.Any, precision: str) -> bool:
    """Whether `optimize`'s OpenVINO copy runs single images with vitkit's own kernels instead: bf16 on a CPU with
    native bf16 but no AMX (AVX-512 BF16), for models `SINGLE_IMAGES_TORCH_MIN_WIDTH` wide or wider. With AMX,
    OpenVINO ran single images of ViT-S/16 and ViT-B/16 faster (1.5-1.8x), so OpenVINO keeps them."""
    wide = getattr(config, "hidden_size", 0) >= SINGLE_IMAGES_TORCH_MIN_WIDTH
    return precision == "bf16" and machine.bf16_is_native("cpu") and not machine.amx() and wide
