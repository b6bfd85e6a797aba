"""The `vitkit` command: a thin layer over the library API, one sub-command per task."""

from __future__ import annotations

import argparse
import json
import sys

from . import config as cfg
from .checkpoints import export, load_checkpoint
from .efficiency import count_params, flops
from .recipes import FINETUNE_DEFAULTS, TrainConfig, field_types


def cmd_models(args: argparse.Namespace) -> int:
    """Print the paper's Table 1 for every named variant, with parameters and GFLOPs at a resolution."""
    header = f"{'model':<16}{'layers':>7}{'hidden':>8}{'MLP':>7}{'heads':>7}{'params':>14}{'GFLOPs':>9}"
    print(f"Variants at {args.image_size} px, {args.num_classes} classes (GFLOPs: multiply-add = 2)")
    print(header)
    print("-" * len(header))
    for name in cfg.list_models():
        c = cfg.decode_variant(name, image_size=args.image_size, num_classes=args.num_classes)
        print(
            f"{name:<16}{c.num_layers:>7}{c.hidden_size:>8}{c.mlp_dim:>7}{c.num_heads:>7}"
            f"{count_params(c):>14,}{flops(c) / 1e9:>9.1f}"
        )
    return 0


def cmd_pretrained(args: argparse.Namespace) -> int:
    """The table of released weights by name; with --download, fetch names into the cache for offline use."""
    from . import pretrained

    if not args.download:
        print(pretrained.format_table())
        print(f"cache: {pretrained.cache_dir()} ($VITKIT_CACHE); any Hugging Face Hub id 'org/name' works too")
        return 0
    for name in args.download:
        path, _ = pretrained.fetch(name)
        print(f"{name}: {path}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Load a checkpoint of any format and write it in another."""
    model = load_checkpoint(args.src, format=args.format)
    export(model, args.dst, format=args.to)
    c = model.config
    shape = f"{c.num_layers} layers, D={c.hidden_size}, {c.num_heads} heads, patch {c.patch_size}, {c.image_size} px"
    print(f"{args.src} -> {args.dst} ({args.to}): {shape}, {c.num_classes} classes")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Write the paper's analysis figures for a checkpoint, as PNGs and one self-contained report.html."""
    from .report import dataset_samples, load_images, write_report

    model = load_checkpoint(args.checkpoint)
    if args.image:
        samples = load_images(args.image, model)
    else:
        samples = dataset_samples(args.data, args.samples, model, split=args.split)
    path = write_report(model, samples, args.out, title=f"vitkit inspect: {args.checkpoint}")
    print(f"wrote {path} ({samples.images.shape[0]} image(s))")
    return 0


def _train_config(args: argparse.Namespace, preset: dict) -> TrainConfig:
    """Defaults (or a preset) < the --config file < the options given on the command line."""
    values = dict(preset)
    if args.config:
        values.update(TrainConfig.from_file(args.config).to_dict())
    fields = field_types()
    values.update({name: getattr(args, name) for name in fields if hasattr(args, name)})
    return TrainConfig.from_dict(values)


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or with --resume continue) a run; exit status 130 when interrupted after saving a checkpoint."""
    from .training import train

    if args.resume:
        result = train(resume=args.resume)
    else:
        result = train(_train_config(args, FINETUNE_DEFAULTS if args.command == "finetune" else {}))
    return 130 if result.interrupted else 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Top-1, top-5 and per-class accuracy of a checkpoint on a dataset's split."""
    from .data import get_dataset
    from .evaluation import evaluate, format_eval

    model = load_checkpoint(args.checkpoint)
    kwargs = {"data_dir": args.data_dir} if args.data_dir else {}
    dataset = get_dataset(args.data, args.split, **kwargs)
    if len(dataset.classes) != model.config.num_classes:
        raise ValueError(
            f"{args.checkpoint} has {model.config.num_classes} classes but {args.data} has {len(dataset.classes)}: "
            "evaluate on the dataset it was trained on, or fine-tune it first (vitkit finetune)."
        )
    result = evaluate(model, dataset, batch_size=args.batch_size, precision=args.precision)
    print(f"{args.checkpoint} on {args.data} ({args.split}), {model.config.image_size[0]} px")
    print(format_eval(result, model.class_names or dataset.classes))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """Top-k classes with their probabilities for each image file."""
    from .evaluation import predict

    model = load_checkpoint(args.checkpoint)
    for path, top in zip(args.images, predict(model, args.images, args.top_k)):
        print(f"{path}: " + ", ".join(f"{name} {100 * p:.1f}%" for name, p in top))
    return 0


# Other spellings of TrainConfig options, kept working for existing command lines.
OPTION_ALIASES = {"trainable": ["--train"]}


def _add_train_options(p: argparse.ArgumentParser) -> None:
    """One --option per TrainConfig field (dashes for underscores); unset options keep the config's value."""
    p.add_argument("--config", help="YAML or JSON file of TrainConfig fields (options given here override it)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR exactly")
    defaults = TrainConfig()
    for name, kind in field_types().items():
        flags, default = ["--" + name.replace("_", "-"), *OPTION_ALIASES.get(name, [])], getattr(defaults, name)
        text = f"(default {default!r})"
        if kind in (dict, dict | None):
            p.add_argument(*flags, dest=name, type=_mapping, default=argparse.SUPPRESS, metavar="JSON|K=V,...",
                           help=f"{text}")  # fmt: skip
        elif kind in (bool, bool | None):
            p.add_argument(*flags, dest=name, type=_boolean, default=argparse.SUPPRESS, metavar="true|false", help=text)
        elif kind in (tuple[float, float], tuple[float, float] | None, tuple[int, int] | None):
            number = int if kind == tuple[int, int] | None else float
            p.add_argument(*flags, dest=name, type=number, nargs=2, default=argparse.SUPPRESS, help=text)
        else:
            item = next(t for t in (int, float, str) if t == kind or kind == t | None)
            p.add_argument(*flags, dest=name, type=item, default=argparse.SUPPRESS, help=text)


def _mapping(text: str) -> dict:
    """'{"hidden_size": 64}' or 'hidden_size=64,num_layers=4' (values read as JSON where they parse)."""
    if text.strip().startswith("{"):
        return json.loads(text)
    out = {}
    for item in filter(None, text.split(",")):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitkit", description="Vision Transformer (Dosovitskiy et al., 2021).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="table of the model variants (paper Table 1) with params and GFLOPs")
    p.add_argument("--image-size", type=int, default=224, help="resolution for the GFLOPs column (default 224)")
    p.add_argument("--num-classes", type=int, default=1000, help="size of the head (default 1000)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("pretrained", help="table of released weights by name (use a name as --checkpoint)")
    p.add_argument("--download", nargs="+", metavar="NAME", help="fetch these names into the cache for offline use")
    p.set_defaults(func=cmd_pretrained)

    p = sub.add_parser("convert", help="convert a checkpoint between vitkit, official .npz, timm and Hugging Face")
    p.add_argument("src", help="checkpoint file, Hugging Face model directory, or pretrained name")
    p.add_argument("dst", help="output file (a directory for --to hf)")
    p.add_argument("--to", required=True, choices=("vitkit", "hf", "timm", "npz"), help="output format")
    p.add_argument("--format", default="auto", choices=("auto", "vitkit", "npz", "timm", "hf", "dinov2", "onnx"),
                   help="input format")  # fmt: skip
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="the paper's analysis figures for a checkpoint, with an HTML report")
    p.add_argument("--checkpoint", required=True, help="model file (any load_checkpoint format) or pretrained name")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--image", nargs="+", metavar="PATH", help="image files (resized to the model's resolution)")
    source.add_argument("--data", default="shapes", help="dataset to take images from (default shapes)")
    p.add_argument("--samples", type=int, default=8, help="images from --data (default 8)")
    p.add_argument("--split", default="test", help="split of --data (default test)")
    p.add_argument("--out", required=True, help="folder for the PNGs and report.html")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("train", help="train a ViT (default: a small ViT on Fashion-MNIST, the main job)")
    _add_train_options(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("finetune", help="fine-tune --checkpoint with the official recipe (SGD, new head)")
    _add_train_options(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="top-1/top-5 and per-class accuracy of a checkpoint on a dataset")
    p.add_argument("--checkpoint", required=True, help="model file (any load_checkpoint format) or pretrained name")
    p.add_argument("--data", default="fashion-mnist", help="dataset name (default fashion-mnist)")
    p.add_argument("--data-dir", help="directory holding the dataset's files")
    p.add_argument("--split", default="test", choices=("train", "test"))
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict", help="top-k classes of image files")
    p.add_argument("--checkpoint", required=True,
                   help="model file with class names (as `vitkit train` saves), or pretrained name")  # fmt: skip
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.set_defaults(func=cmd_predict)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"vitkit {args.command}: error: {e}", file=sys.stderr)
        return 2
