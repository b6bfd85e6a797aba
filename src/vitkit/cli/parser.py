"""The `vitkit` command line: the parser of every sub-command and its options, and `main`, which runs the command
(its body is in commands.py) and turns its errors into one line and an exit status."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import sys
import warnings
from typing import Any

from vitkit import __version__, formats
from vitkit.errors import NonFiniteError, WorkerError, from_command, is_ctrl_c
from vitkit.speed.benchmark import BENCH_PRECISIONS
from vitkit.speed.benchmark import MODES as BENCH_MODES
from vitkit.speed.copies import CALIBRATION_IMAGES
from vitkit.speed.machine import retain_freed_memory
from vitkit.speed.optimize import OPTIMIZE_PRECISIONS, OPTIMIZE_RUNTIMES
from vitkit.training.recipes import FINETUNE_DEFAULTS, RESUMABLE, TrainConfig, as_pairs, field_help, field_types

from . import commands


def _add_optimize_option(p: argparse.ArgumentParser, runtime: bool = False) -> None:
    p.add_argument(
        "--no-optimize",
        dest="optimize",
        action="store_false",
        help="run the model as loaded, not the copy vitkit.optimize makes",
    )
    if runtime:
        p.add_argument(
            "--runtime",
            default="auto",
            choices=OPTIMIZE_RUNTIMES,
            help="what runs the optimized copy: torch (vitkit's own kernels), openvino (CPU; pip install openvino), "
            "or auto: OpenVINO where it is installed on an x86 CPU and the images are work enough to pay back "
            "converting the model (about 300 ViT-S/16 images), else torch; int8 with auto: OpenVINO's quantizer "
            "(NNCF) where OpenVINO and NNCF are installed, else PT2E (default auto)",
        )


def _add_execution_options(p: argparse.ArgumentParser) -> None:
    """--device and --threads, described as TrainConfig describes them."""
    p.add_argument("--device", default="auto", help=field_help("device")[0] + "; default auto")
    p.add_argument("--threads", type=int, default=0, help=field_help("threads")[0] + "; default 0")


# Other spellings of TrainConfig options, kept working for existing command lines.
OPTION_ALIASES = {"trainable": ["--train"]}


def _choices(name: str) -> tuple[str, ...] | None:
    """A TrainConfig field's valid values, from its registry: `field_help`'s, and for `data` the dataset registry
    (data.py sits below recipes.py, which therefore cannot name them)."""
    if name == "data":
        from vitkit.data.datasets import DATASETS

        return tuple(sorted(DATASETS))
    return field_help(name)[1]


def _add_train_options(p: argparse.ArgumentParser, preset: dict) -> None:
    """One --option per TrainConfig field (dashes for underscores), described by the field's own help and
    choices, with this command's defaults (TrainConfig's, with `preset` on top); unset options keep the value."""
    p.add_argument("--config", help="YAML or JSON file of TrainConfig fields (options given here override it)")
    safe = ", ".join("--" + n.replace("_", "-") for n in RESUMABLE)
    text = f"continue the run saved in RUN_DIR exactly; with it only {safe} may be given"
    p.add_argument("--resume", metavar="RUN_DIR", help=text)
    defaults = TrainConfig(**preset)
    for name, kind in field_types().items():
        flags, default = ["--" + name.replace("_", "-"), *OPTION_ALIASES.get(name, [])], getattr(defaults, name)
        text, choices = field_help(name)[0], _choices(name)
        if choices:
            text += f" ({'|'.join(choices)})"
        if default is not None:
            shown = " ".join(map(str, default)) if isinstance(default, tuple) else _shown(default)
            text += f"; default {shown}"
        common: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        if kind in (dict, dict | None):
            p.add_argument(*flags, type=_mapping, metavar="K=V,...", **common)
        elif kind in (bool, bool | None):
            p.add_argument(*flags, type=_boolean, nargs="?", const=True, metavar="true|false", **common)
        elif kind in (tuple[float, float], tuple[float, float] | None, tuple[int, int] | None):
            number = int if kind == tuple[int, int] | None else float
            p.add_argument(*flags, type=number, nargs=2, metavar=("A", "B"), **common)
        else:
            item = next(t for t in (int, float, str) if t == kind or kind == t | None)
            allowed = None if name == "data" else choices  # --data also takes a folder: `data.locate` checks it
            p.add_argument(*flags, type=item, choices=allowed, metavar=name.upper(), **common)


def _shown(value) -> str:
    """A default as the user would type it: model_args as K=V pairs, numbers without needless digits."""
    if isinstance(value, dict):
        return as_pairs(value) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _top_level(text: str) -> list[str]:
    """`text` split at its commas outside brackets: 'units=[1,1],act=gelu' -> ['units=[1,1]', 'act=gelu']."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "[{") - (char in "]}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def _mapping(text: str) -> dict:
    """'{"hidden_size": 64}' or 'hidden_size=64,num_layers=4' (values read as JSON where they parse, lists too:
    'units=[1,1]')."""
    if text.strip().startswith("{"):
        return json.loads(text)
    out = {}
    for item in filter(None, _top_level(text)):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: write key=value pairs separated by commas, or JSON.")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"{text!r}: use true or false.")
    return text.lower() in ("true", "1", "yes")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one `--help` away), exit status 2."""

    def error(self, message: str):
        choice = re.search(r"invalid choice: '?([^']*?)'? \(choose from (.*)\)", message)
        if choice:  # argparse lists the allowed values; add the closest one
            allowed = [c.strip().strip("'") for c in choice.group(2).split(",")]
            close = difflib.get_close_matches(choice.group(1), allowed, n=1, cutoff=0.5)
            message += f"; did you mean {close[0]!r}?" if close else ""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_overwrite_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what} if it exists (default: refuse)")


def _add_reading_options(p: argparse.ArgumentParser, images: bool = True) -> None:
    p.add_argument("--allow-nonfinite", action="store_true", help="load a checkpoint with NaN/Inf weights (warns)")
    if images:
        p.add_argument("--strict", action="store_true", help="stop at the first unreadable image (default: skip it)")


def _add_models_command(sub) -> None:
    """`vitkit models`."""
    p = sub.add_parser("models", help="table of the model variants (paper Table 1) with params and GFLOPs")
    p.add_argument("--image-size", type=int, default=224, help="resolution for the GFLOPs column (default 224)")
    p.add_argument("--num-classes", type=int, default=1000, help="size of the head (default 1000)")
    p.set_defaults(func=commands.cmd_models)


def _add_pretrained_command(sub) -> None:
    """`vitkit pretrained`."""
    p = sub.add_parser("pretrained", help="table of released weights by name (use a name as --checkpoint)")
    p.add_argument("--download", nargs="+", metavar="NAME", help="fetch these names into the cache for offline use")
    p.set_defaults(func=commands.cmd_pretrained)


def _add_convert_command(sub) -> None:
    """`vitkit convert`."""
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint between vitkit, official .npz, timm and Hugging Face, or export it to ONNX",
    )
    p.add_argument("src", help="checkpoint file, Hugging Face model directory, or pretrained name")
    p.add_argument(
        "dst",
        help="output file; a directory for --to hf, and for --to timm when DST has no suffix "
        "(timm's hub layout: model.safetensors + config.json)",
    )
    p.add_argument(
        "--to",
        default="auto",
        choices=("auto", *formats.WRITABLE),
        help="output format (onnx: a graph for ONNX Runtime, OpenVINO, ...; needs onnxscript); auto: the one DST's "
        "suffix names (.onnx, .npz), else vitkit (default auto)",
    )
    p.add_argument("--format", default="auto", choices=("auto", *formats.FORMATS), help="input format")
    _add_overwrite_option(p, "DST")
    _add_reading_options(p, images=False)
    p.set_defaults(func=commands.cmd_convert)


def _add_inspect_command(sub) -> None:
    """`vitkit inspect`."""
    p = sub.add_parser("inspect", help="the paper's analysis figures for a checkpoint, with an HTML report")
    p.add_argument("--checkpoint", required=True, help="model file (any load_checkpoint format) or pretrained name")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--image",
        nargs="+",
        metavar="PATH",
        help="image files, or directories of them (resized to the model's resolution)",
    )
    datasets = _choices("data") or ()
    source.add_argument(
        "--data",
        default="shapes",
        metavar="DATA",
        help=f"dataset to take images from ({'|'.join(datasets)}), or a folder of images or shards; default shapes",
    )
    p.add_argument("--samples", type=int, default=8, help="images from --data (default 8)")
    p.add_argument("--split", default="test", choices=("train", "test"), help="split of --data (default test)")
    p.add_argument("--out", required=True, help="folder for the PNGs and report.html")
    _add_overwrite_option(p, "the files in --out")
    p.add_argument(
        "--stride",
        type=int,
        help="pixels between occlusion windows (default half a patch); doubling it quarters "
        "the forward passes, which the command counts before it starts",
    )
    _add_execution_options(p)
    _add_reading_options(p)
    _add_optimize_option(p)
    p.set_defaults(func=commands.cmd_inspect)


def _add_train_command(sub) -> None:
    """`vitkit train`."""
    p = sub.add_parser("train", help="train a ViT (default: a small ViT on Fashion-MNIST, the main job)")
    _add_train_options(p, {})
    p.set_defaults(func=commands.cmd_train)


def _add_finetune_command(sub) -> None:
    """`vitkit finetune`."""
    p = sub.add_parser(
        "finetune",
        help="fine-tune --checkpoint with the official recipe (SGD, new head)",
        description="Fine-tune --checkpoint with the official recipe (SGD, a new head), by default for "
        f"{FINETUNE_DEFAULTS['steps']} steps: the paper's length for its smallest datasets, which converges on a "
        "few thousand images (a few epochs stop far short); --epochs counts epochs instead.",
    )
    _add_train_options(p, FINETUNE_DEFAULTS)
    p.set_defaults(func=commands.cmd_train)


def _add_eval_command(sub) -> None:
    """`vitkit eval`."""
    datasets = _choices("data") or ()
    p = sub.add_parser("eval", help="top-1/top-5 and per-class accuracy of a checkpoint on a dataset")
    p.add_argument("--checkpoint", required=True, help="model file (any load_checkpoint format) or pretrained name")
    p.add_argument(
        "--data",
        default="fashion-mnist",
        metavar="DATA",
        help=f"dataset to evaluate on ({'|'.join(datasets)}), or a folder of images or shards; default fashion-mnist",
    )
    p.add_argument("--data-dir", help=field_help("data_dir")[0])
    p.add_argument("--split", default="test", choices=("train", "test"), help="split to evaluate (default test)")
    p.add_argument("--batch-size", type=int, default=1000, help="images per forward pass (default 1000)")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=OPTIMIZE_PRECISIONS,
        help="arithmetic of the forward passes: bf16 autocasts matrix products, auto is bf16 where the hardware has "
        "it, int8 quantizes (CPU; calibrated on --calibration-images of the train split) (default fp32)",
    )
    _add_calibration_option(p, "the train split")
    _add_execution_options(p)
    p.add_argument("--fewshot", metavar="K,K,...", help="few-shot linear accuracy with K images per class, e.g. 1,5,10")
    p.add_argument("--draws", type=int, default=5, help="random draws of the shots to average (default 5)")
    p.add_argument("--l2", type=float, default=1.0, help="ridge regularisation of the few-shot fit (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the few-shot draws (default 0)")
    _add_reading_options(p)
    _add_optimize_option(p, runtime=True)
    p.set_defaults(func=commands.cmd_eval)


def _add_experiment_command(sub) -> None:
    """`vitkit experiment`."""
    from vitkit.analysis.experiments import EXPERIMENTS, PRESETS, PRETRAINED

    p = sub.add_parser("experiment", help="re-run one of the paper's findings (docs/EXPERIMENTS.md)")
    p.add_argument("name", choices=list(EXPERIMENTS), help="the experiment")
    p.add_argument("--preset", default="small", choices=list(PRESETS), help="scale (default small; tiny: seconds)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per run (default 1)")
    p.add_argument(
        "--out", default="experiments", help="results folder, shared between experiments (default ./experiments)"
    )
    p.add_argument("--checkpoint", help=f"pre-trained model (default {PRETRAINED}; tiny: a random stand-in)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's choice)")
    _add_overwrite_option(p, "the experiment's results of another --preset, --seeds or --checkpoint")
    p.set_defaults(func=commands.cmd_experiment)


def _add_data_command(sub) -> None:
    """`vitkit data`."""
    p = sub.add_parser("data", help="prepare datasets: `vitkit data pack ROOT OUT` writes Parquet shards")
    data = p.add_subparsers(dest="data_command", required=True)
    p = data.add_parser("pack", help="write an image folder's train and test splits as Parquet shards")
    p.add_argument("root", help="image folder: ROOT/<class>/<image>, or ROOT/train and ROOT/val (or test)")
    p.add_argument("out", help="output directory (then: vitkit train --data shards --data-dir OUT)")
    p.add_argument(
        "--samples-per-shard", type=int, default=1000, help="about this many images per shard (default 1000)"
    )
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out for test without ROOT/val (0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the order the samples are written in (default 0)")
    _add_overwrite_option(p, "the files in OUT")
    p.set_defaults(func=commands.cmd_data_pack)


def _add_calibration_option(p, source: str) -> None:
    """--calibration-images: how many images, drawn at random from `source`, calibrate --precision int8."""
    p.add_argument(
        "--calibration-images",
        type=int,
        default=CALIBRATION_IMAGES,
        help=f"for --precision int8: images of {source} to calibrate on, at random (default {CALIBRATION_IMAGES})",
    )


def _add_predict_command(sub) -> None:
    """`vitkit predict`."""
    p = sub.add_parser("predict", help="top-k classes of image files")
    p.add_argument(
        "--checkpoint", required=True, help="model file with class names (as `vitkit train` saves), or pretrained name"
    )
    p.add_argument("--top-k", type=int, default=5, help="classes shown per image (default 5)")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files, or folders of them (subfolders too)")
    p.add_argument(
        "--precision",
        default="auto",
        choices=OPTIMIZE_PRECISIONS,
        help="of the optimized copy: auto is bf16 where the hardware has it, else fp32; int8 quantizes "
        "(CPU), calibrated on the images being predicted (default auto)",
    )
    _add_calibration_option(p, "the images being predicted")
    _add_execution_options(p)
    _add_reading_options(p)
    _add_optimize_option(p, runtime=True)
    p.set_defaults(func=commands.cmd_predict)


def _add_bench_command(sub) -> None:
    """`vitkit bench`."""
    p = sub.add_parser("bench", help="images/s, FLOP/s against the machine's matmul rate, memory (paper Fig. 12)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="variant name (default ViT-B/16)")
    which.add_argument(
        "--checkpoint",
        help="instead: a model file (any load_checkpoint format) or pretrained name; its architecture is timed, at "
        "its own resolution unless --image-size (with --compare, its weights too)",
    )
    p.add_argument("--model-args", type=_mapping, default={}, metavar="JSON|K=V,...", help="ViTConfig overrides")
    p.add_argument(
        "--image-size", type=int, nargs="+", help="resolutions (default 224, or the checkpoint's resolution)"
    )
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    p.add_argument(
        "--precision",
        nargs="+",
        default=["fp32", "bf16"],
        choices=BENCH_PRECISIONS,
        help="arithmetic to time (default fp32 bf16; bf16 is slow where the CPU emulates it; int8 times the "
        "optimized copy with vitkit's own kernels (PT2E), calibrated on the random images it times)",
    )
    p.add_argument(
        "--mode",
        nargs="+",
        default=list(BENCH_MODES),
        choices=BENCH_MODES,
        help="plain model(x) and/or the vitkit.optimize copy with vitkit's own kernels (default both; --compare "
        "times OpenVINO's)",
    )
    p.add_argument("--no-train", dest="train", action="store_false", help="leave out the training step")
    p.add_argument("--compile", action="store_true", help="also time a torch.compile'd training step")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, the median kept (default 3)")
    p.add_argument("--min-seconds", type=float, default=0.2, help="shortest timing per cell and round (default 0.2)")
    p.add_argument("--memory-budget-gb", type=float, help="report the largest batch that fits this memory")
    p.add_argument(
        "--compare",
        action="store_true",
        help="instead: vitkit.optimize against ONNX Runtime and OpenVINO on the same weights, side by side",
    )
    _add_execution_options(p)
    p.add_argument("--out", help="JSON file to write; the plot goes beside it as .png")
    _add_overwrite_option(p, "--out and its plot")
    p.set_defaults(func=commands.cmd_bench)


# The commands in the order `vitkit --help` lists them.
COMMANDS = (
    _add_models_command,
    _add_pretrained_command,
    _add_convert_command,
    _add_inspect_command,
    _add_train_command,
    _add_finetune_command,
    _add_eval_command,
    _add_experiment_command,
    _add_data_command,
    _add_predict_command,
    _add_bench_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vitkit", description="Vision Transformer (Dosovitskiy et al., 2021).")
    parser.add_argument("--version", action="version", version=f"vitkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Bad input (a value, a file): one line and exit status 2; a failure of the machine (a full disk, a dead
    data worker): one line and exit status 1. Warnings (a skipped image, say) are one line each."""
    args = build_parser().parse_args(argv)
    retain_freed_memory()  # each command runs the same steps over and over: keep their memory between them
    formatwarning = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *rest: f"vitkit {args.command}: warning: {message}\n"
    try:
        with from_command(args.command):
            status = args.func(args)
            sys.stdout.flush()  # a closed pipe shows here, where it is handled, not in the interpreter's exit
            return status
    except (KeyboardInterrupt, RuntimeError) as e:  # Ctrl-C (a second one, in training: what was left), one line
        if not is_ctrl_c(e):
            raise
        said = str(e) if isinstance(e, KeyboardInterrupt) else ""
        print(f"vitkit {args.command}: {said or 'stopped (Ctrl-C)'}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`vitkit predict ... | head`): end quietly, as Python's docs do
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor needs nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the last flush at exit would fail again
        return 1
    except (
        ValueError,
        ImportError,  # an optional dependency the command needs; its message names the package to install
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,  # a path the user gave that cannot be written (or read): a read-only --out-dir, say
        ConnectionError,
    ) as e:
        print(f"vitkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, WorkerError, NonFiniteError) as e:
        print(f"vitkit {args.command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = formatwarning
