"""What every copy `vitkit.optimize` makes shares: `InferenceModel`, the interface it returns (a protocol: a
`VisionTransformer` has it, and so does each copy another engine runs), `InferenceCopy`, the base of those copies,
and the calibration images of the int8 copies.
"""

from __future__ import annotations

import typing
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from vitkit.models.config import ViTConfig
from vitkit.models.vit import VisionTransformer, check_images

from . import machine


@dataclass(frozen=True)
class Options:
    """What `optimize` was asked for besides the precision, handed to the backend that makes the copy."""

    pack: bool | None = None  # torch: pack linear weights (None: where it pays)
    compile: bool = False  # torch: torch.compile with freezing
    calibration: typing.Any = None  # int8: the calibration batches (`calibration_batches`)


@typing.runtime_checkable
class InferenceModel(typing.Protocol):
    """What `optimize` returns: images (B, C, H, W) in, logits (B, classes) out, with the model's `config`,
    `class_names`, `trained_on` and `normalization`; `eval()` returns it. A `VisionTransformer` is one, and so is
    each `InferenceCopy`."""

    config: ViTConfig
    class_names: list[str] | None
    trained_on: dict | None
    normalization: dict | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def eval(self) -> typing.Any: ...


class InferenceCopy(nn.Module):
    """A copy of a model that another engine runs (an int8 graph, OpenVINO), with the model's inference interface:
    images in, logits out, and the model's `config`, `class_names` and `trained_on`; images the model would refuse
    are refused with its message, and an empty batch gives empty logits. Inference only."""

    what = "this copy"

    def __init__(self, model: VisionTransformer):
        super().__init__()
        self.config = model.config
        self.class_names = getattr(model, "class_names", None)
        self.trained_on = getattr(model, "trained_on", None)
        self.normalization = getattr(model, "normalization", None)
        self.training = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_images(x, self.config)
        if len(x) == 0:  # a runtime's graph takes one image at least: the width of one image's logits, no rows
            return self.run(x.new_zeros(1, *x.shape[1:]))[:0]
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of a batch of one image or more, checked against the model's input."""
        raise NotImplementedError

    def __repr__(self) -> str:
        # One line: what runs the copy. The modules inside (a compiled graph, a copy for single images) are the
        # engine's, and nn.Module's repr would list them by the dozen.
        return f"{type(self).__name__}({self.extra_repr()})"

    def train(self, mode: bool = True) -> InferenceCopy:
        """eval() (a no-op: the copy was made for inference, and a runtime's graph has no training mode); train()
        is refused."""
        if mode:
            raise ValueError(f"{self.what} is for inference only: train the model, then optimize it again.")
        self.training = False
        return self


CALIBRATION_BATCH = 64  # images per forward pass when `calibration` is one tensor


CALIBRATION_IMAGES = 512  # where calibration stops reading an iterable, and what the CLI calibrates on by default


def calibration_batches(calibration: torch.Tensor | typing.Iterable | None, model: nn.Module) -> list[torch.Tensor]:
    """The calibration images as a list of (B, C, H, W) batches: every image of a tensor or a list of batches, and
    of any other iterable (a DataLoader; it may yield (images, labels) pairs) the batches until they hold
    `CALIBRATION_IMAGES` images, so that a DataLoader over a whole training set is neither read to its end nor held
    in memory: the scales settle within a few hundred images. Each batch must be what `model` takes."""
    if calibration is None:
        raise ValueError(
            "precision='int8' needs calibration=: a few batches of typical input images (a (B, C, "
            "H, W) tensor, or an iterable of them such as a DataLoader), to set the activations' "
            "scales."
        )
    if isinstance(calibration, torch.Tensor):
        calibration = calibration.split(CALIBRATION_BATCH) if calibration.dim() == 4 else [calibration]
    batches: list[torch.Tensor] = []
    for item in calibration:
        images = item[0] if isinstance(item, (tuple, list)) else item
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            got = f"shape {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"calibration: got {got}; give image batches (B, C, H, W), as the model takes them.")
        if isinstance(model, VisionTransformer):
            try:
                check_images(images, model.config)
            except ValueError as e:
                raise ValueError(f"calibration: {e}") from None
        if len(images):
            batches.append(images)
        if not isinstance(calibration, (list, tuple)) and sum(map(len, batches)) >= CALIBRATION_IMAGES:
            break
    if not batches:
        raise ValueError("calibration= is empty: give at least one batch of images (a few hundred images is typical).")
    return batches


def warn_without_fast_int8() -> None:
    """Warn, at the caller of `optimize`, where the CPU has no int8 dot-product instructions."""
    missing = machine.int8_fast_path_missing()
    if missing:
        warnings.warn(
            f"this CPU has no {missing}, the fast int8 path: int8 may run no faster than fp32 here. "
            "precision='auto' gives the fastest copy with the model's own results.",
            stacklevel=4,
        )
