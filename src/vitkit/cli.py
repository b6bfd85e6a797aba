"""The `vitkit` command: a thin layer over the library API, one sub-command per task."""

from __future__ import annotations

import argparse
import sys

from . import config as cfg
from .checkpoints import export, load_checkpoint
from .efficiency import count_params, flops


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitkit", description="Vision Transformer (Dosovitskiy et al., 2021).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="table of the model variants (paper Table 1) with params and GFLOPs")
    p.add_argument("--image-size", type=int, default=224, help="resolution for the GFLOPs column (default 224)")
    p.add_argument("--num-classes", type=int, default=1000, help="size of the head (default 1000)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("convert", help="convert a checkpoint between vitkit, official .npz, timm and Hugging Face")
    p.add_argument("src", help="checkpoint file, or a Hugging Face model directory")
    p.add_argument("dst", help="output file (a directory for --to hf)")
    p.add_argument("--to", required=True, choices=("vitkit", "hf", "timm", "npz"), help="output format")
    p.add_argument("--format", default="auto", choices=("auto", "vitkit", "npz", "timm", "hf"), help="input format")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="the paper's analysis figures for a checkpoint, with an HTML report")
    p.add_argument("--checkpoint", required=True, help="model file (any format vitkit.load_checkpoint reads)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--image", nargs="+", metavar="PATH", help="image files (resized to the model's resolution)")
    source.add_argument("--data", default="shapes", help="dataset to take images from (default shapes)")
    p.add_argument("--samples", type=int, default=8, help="images from --data (default 8)")
    p.add_argument("--split", default="test", help="split of --data (default test)")
    p.add_argument("--out", required=True, help="folder for the PNGs and report.html")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"vitkit {args.command}: error: {e}", file=sys.stderr)
        return 2
