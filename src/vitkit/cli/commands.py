"""What each `vitkit` command does: one `cmd_*` function per sub-command, given the parsed options, and the helpers
they share (placing a model on --device, the optimized or int8 copy, the training config from the options)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

from vitkit import formats
from vitkit.formats.checkpoints import export, load_checkpoint
from vitkit.models import config as cfg
from vitkit.models.efficiency import count_params, flops
from vitkit.models.vit import VisionTransformer
from vitkit.speed.machine import resolve_precision
from vitkit.speed.optimize import optimize
from vitkit.training.recipes import FINETUNE_DEFAULTS, TrainConfig, counting, field_types


def cmd_models(args: argparse.Namespace) -> int:
    """Print the paper's Table 1 for every named variant, with parameters and GFLOPs at a resolution; a variant
    whose patch stride does not divide it is listed with the nearest resolutions that it does."""
    header = f"{'model':<16}{'layers':>7}{'hidden':>8}{'MLP':>7}{'heads':>7}{'params':>14}{'GFLOPs':>9}"
    print(f"Variants at {args.image_size} px, {args.num_classes} classes (GFLOPs: multiply-add = 2)")
    print(header)
    print("-" * len(header))
    unfit = 0
    for name in cfg.list_models():
        c = cfg.decode_variant(name, num_classes=args.num_classes)
        row = f"{name:<16}{c.num_layers:>7}{c.hidden_size:>8}{c.mlp_dim:>7}{c.num_heads:>7}"
        stride = c.patch_stride[0]
        if args.image_size % stride:
            unfit += 1
            below = max(args.image_size // stride, 1) * stride
            print(f"{row}   * not at {args.image_size} px (patch stride {stride}): nearest {below} or {below + stride}")
            continue
        c = c.replace(image_size=args.image_size)
        print(f"{row}{count_params(c):>14,}{flops(c) / 1e9:>9.1f}")
    if unfit:
        print(f"* {unfit} variant(s) need a resolution that is a multiple of their patch stride.")
    return 0


def cmd_pretrained(args: argparse.Namespace) -> int:
    """The table of released weights by name; with --download, fetch names into the cache for offline use."""
    from vitkit.formats import pretrained

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
    model = load_checkpoint(args.src, format=args.format, allow_nonfinite=args.allow_nonfinite)
    to = formats.export_format(args.dst) if args.to == "auto" else args.to
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export(model, args.dst, format=to, overwrite=args.overwrite)
    for warning in caught:
        print(f"vitkit convert: warning: {warning.message}", file=sys.stderr)
    c = model.config
    if isinstance(c, cfg.ViTConfig):
        shape = f"{c.num_layers} layers, D={c.hidden_size}, {c.num_heads} heads, patch {c.patch_size}"
        shape += f", {c.image_size} px"
    else:
        shape = f"{c.name}, {c.image_size} px"
    print(f"{args.src} -> {args.dst} ({to}): {shape}, {c.num_classes} classes")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Write the paper's analysis figures for a checkpoint, as PNGs and one self-contained report.html."""
    from vitkit.analysis.report import dataset_samples, faithfulness_plan, load_images, occlusion_plan, write_report
    from vitkit.training.evaluation import image_files

    loaded = _placed(load_checkpoint(args.checkpoint, allow_nonfinite=args.allow_nonfinite), args)
    model = _for_inference(loaded, args)  # the gradient attributions differentiate `loaded`: `optimize` cannot
    if not isinstance(model, VisionTransformer):
        raise ValueError(f"{args.checkpoint} holds a {type(model).__name__}: the analysis figures are a ViT's.")
    if args.image:
        samples = load_images(image_files(args.image), model, strict=args.strict)
    else:
        samples = dataset_samples(args.data, args.samples, model, split=args.split)
    samples = dataclasses.replace(samples, images=samples.images.to(next(model.parameters()).device))
    print(occlusion_plan(model, samples.images.shape[0], args.stride), flush=True)
    print(faithfulness_plan(model, samples.images.shape[0]), flush=True)
    path = write_report(
        model,
        samples,
        args.out,
        title=f"vitkit inspect: {args.checkpoint}",
        stride=args.stride,
        progress=True,
        overwrite=args.overwrite,
        gradient_model=loaded,
    )
    print(f"wrote {path} ({samples.images.shape[0]} image(s))")
    return 0


def cmd_data_pack(args: argparse.Namespace) -> int:
    """Pack an image folder into Parquet shards for streaming (datasets larger than memory)."""
    from vitkit.data.image_folder import pack_image_folder

    index = pack_image_folder(
        args.root,
        args.out,
        samples_per_shard=args.samples_per_shard,
        val_fraction=args.val_fraction,
        seed=args.seed,
        progress=True,
        overwrite=args.overwrite,
    )
    for split, shards in index["splits"].items():
        print(f"{split}: {sum(s['count'] for s in shards)} images in {len(shards)} shards")
    print(f"wrote {args.out}/index.json ({len(index['classes'])} classes); use: --data shards --data-dir {args.out}")
    return 0


def _for_inference(model, args: argparse.Namespace):
    """The model as `vitkit.optimize` makes it with vitkit's own kernels (fp32, or bf16 where native), unless
    --no-optimize: the analysis reads the model's intermediates, which a runtime's copy does not expose."""
    return optimize(model, runtime="torch") if args.optimize else model


def _int8(model, args: argparse.Namespace, calibration, source: str):
    """The int8 copy of `model`, calibrated on `calibration` (images from `source`, which is printed)."""
    if not args.optimize:
        raise ValueError(
            "--precision int8 with --no-optimize: int8 is the copy vitkit.optimize makes; drop --no-optimize."
        )
    count = sum(len(x) for x in calibration) if isinstance(calibration, list) else len(calibration)
    fast = optimize(model, "int8", calibration=calibration, runtime=args.runtime)
    images = f"{count} image{'s' * (count != 1)}"
    if getattr(fast, "runtime", None) == "openvino":
        print(f"int8 (OpenVINO): activations calibrated on {images} ({source})")
    else:
        print(f"int8: activations calibrated on {images} ({source}); the first batch of each size compiles")
    return fast


# `--runtime auto` hands the model to OpenVINO only for work that pays back converting it (seconds, most of them
# whatever the model): from this many FLOPs (images times the model's FLOPs per image), about 300 ViT-S/16 images.
# Figures in docs/PERFORMANCE.md.
OPENVINO_MIN_FLOP = 3e12


def _runtime(args: argparse.Namespace, model, images: int) -> str:
    """--runtime as given; "auto" stays "auto" (OpenVINO where it pays) for `images` images only when they are
    `OPENVINO_MIN_FLOP` of work, else "torch"."""
    if args.runtime != "auto" or images * flops(model.config) >= OPENVINO_MIN_FLOP:
        return args.runtime
    return "torch"


def _runtime_needs_optimize(args: argparse.Namespace) -> None:
    if args.runtime != "auto" and not args.optimize:
        raise ValueError(
            f"--runtime {args.runtime} with --no-optimize: the runtime runs the optimized copy; drop one of them."
        )


def cmd_bench(args: argparse.Namespace) -> int:
    """The paper's Fig. 12 for a variant on this machine: a table, and with --out a JSON file and a plot."""
    import torch

    from vitkit.speed.benchmark import bench, bench_files, format_bench, write_bench
    from vitkit.training.distributed import resolve_device

    if args.out:
        bench_files(args.out, args.overwrite)  # refused now, not after the measurements
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: give a number of threads, or 0 for torch's default.")
    if args.threads:
        torch.set_num_threads(args.threads)
    subject, args.image_size = _bench_subject(args)
    if args.compare:
        return _bench_compare(args, subject)
    result = bench(
        subject.config if isinstance(subject, VisionTransformer) else subject,
        image_sizes=tuple(args.image_size),
        batch_sizes=tuple(args.batch_size),
        precisions=tuple(args.precision),
        modes=tuple(args.mode),
        train=args.train,
        compile=args.compile,
        rounds=args.rounds,
        min_seconds=args.min_seconds,
        memory_budget_gb=args.memory_budget_gb,
        device=resolve_device(args.device),
        **({} if isinstance(subject, VisionTransformer) else args.model_args),
    )
    if isinstance(subject, VisionTransformer):
        result["model"] = args.checkpoint or args.model
    print(format_bench(result))
    if args.out:
        json_path, png_path = write_bench(result, args.out, args.overwrite)
        print(f"wrote {json_path} and {png_path}")
    return 0


def _bench_subject(args: argparse.Namespace) -> tuple[str | VisionTransformer, list[int]]:
    """What `vitkit bench` times: a variant name, or the model of --checkpoint (or of a --model that names a file);
    and the resolutions, by default the checkpoint's own."""
    import os

    path = args.checkpoint or (args.model if args.model and os.path.exists(args.model) else None)
    if path is None:
        return args.model or "ViT-B/16", args.image_size or [224]
    model = load_checkpoint(path, image_size=args.image_size[0] if args.image_size else None, **args.model_args)
    if not isinstance(model, VisionTransformer):
        raise ValueError(f"{path} holds a {type(model).__name__}: vitkit bench times Vision Transformers.")
    height, width = model.config.image_size
    if args.image_size is None and height != width:
        raise ValueError(f"{path} is a {height}x{width} model: give one square resolution with --image-size.")
    return model, args.image_size or [height]


def _bench_compare(args: argparse.Namespace, subject: str | VisionTransformer) -> int:
    """`vitkit bench --compare`: vitkit.optimize against ONNX Runtime and OpenVINO, side by side."""
    from vitkit.speed.benchmark import write_record
    from vitkit.speed.runtimes import compare_runtimes, format_compare

    if len(args.image_size) > 1:
        raise ValueError(f"--image-size {' '.join(map(str, args.image_size))} with --compare: give one resolution.")
    model_args = {} if isinstance(subject, VisionTransformer) else {"image_size": args.image_size[0], **args.model_args}
    result = compare_runtimes(
        subject,
        batch_sizes=tuple(args.batch_size),
        precisions=tuple(args.precision),
        rounds=args.rounds,
        min_seconds=args.min_seconds,
        **model_args,
    )
    if isinstance(subject, VisionTransformer):
        result["model"] = args.checkpoint or args.model
    print(format_compare(result))
    if args.out:
        print(f"wrote {write_record(args.out, result)}")
    return 0


def _config_and_given(args: argparse.Namespace, preset: dict) -> tuple[TrainConfig, frozenset[str]]:
    """The config (defaults or a preset < the --config file < the options on the command line), and the fields the
    user set in the file or on the command line, whatever their values: the recipe a small image folder starts from
    leaves them as they are."""
    in_file = TrainConfig.fields_in_file(args.config) if args.config else {}
    typed = {name: getattr(args, name) for name in field_types() if hasattr(args, name)}
    values = {**preset, **counting(in_file), **counting(typed)}
    return TrainConfig.from_dict(values), frozenset(in_file) | frozenset(typed)


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or with --resume continue) a run; exit status 130 when interrupted after saving a checkpoint."""
    from vitkit.training.loop import train

    if args.resume:
        changes = {name: getattr(args, name) for name in field_types() if hasattr(args, name)}
        if args.config:
            raise ValueError(f"--config {args.config} with --resume: a resumed run keeps its saved config.")
        result = train(resume=args.resume, changes=changes)
    else:
        config, given = _config_and_given(args, FINETUNE_DEFAULTS if args.command == "finetune" else {})
        if args.command == "finetune" and config.checkpoint is None:
            raise ValueError(
                "finetune needs --checkpoint MODEL, the pre-trained weights to start from; to train from random "
                "weights use `vitkit train` (add --optimizer sgd --lr 0.01 for the fine-tuning recipe)."
            )
        result = train(config, given=given)
    return 130 if result.interrupted else 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Top-1, top-5 and per-class accuracy of a checkpoint on a dataset's split; with --fewshot, the paper's
    few-shot linear accuracy of its frozen features instead."""
    from vitkit.data.datasets import get_dataset
    from vitkit.training.evaluation import calibration_from_dataset, evaluate, fewshot, format_eval

    model = _placed(load_checkpoint(args.checkpoint, allow_nonfinite=args.allow_nonfinite), args)
    kwargs = {"data_dir": args.data_dir} if args.data_dir else {}
    dataset = get_dataset(args.data, args.split, strict=args.strict, **kwargs)
    if args.fewshot:
        shots = _shots(args.fewshot)
        train_set = get_dataset(args.data, "train", **kwargs)
        few = fewshot(model, train_set, dataset, shots, args.draws, args.l2, args.seed, progress=True)
        print(f"{args.checkpoint} on {args.data} ({args.split}): few-shot linear accuracy, {args.draws} draws")
        for k, acc in few.accuracy.items():
            spread = _std(few.per_draw[k])
            print(f"  {k:>3}-shot  {100 * acc:6.2f}%  (+- {100 * spread:.2f} over draws)")
        return 0
    if len(dataset.classes) != model.config.num_classes:
        raise ValueError(
            f"{args.checkpoint} has {model.config.num_classes} classes but {args.data} has {len(dataset.classes)}: "
            "evaluate on the dataset it was trained on, or fine-tune it first (vitkit finetune)."
        )
    read = dataset  # its log of skipped files, if any, is printed at the end
    _runtime_needs_optimize(args)
    if args.precision == "int8":
        calibration = calibration_from_dataset(
            model, get_dataset(args.data, "train", **kwargs), args.calibration_images
        )
        model, precision = _int8(model, args, calibration, f"{args.data}'s train split, --calibration-images"), "fp32"
    else:
        precision = resolve_precision(args.precision, next(model.parameters()).device)
        if args.optimize:
            runtime = _runtime(args, model, len(dataset))
            model, precision = optimize(model, precision, runtime=runtime), "fp32"  # a bf16 copy: no autocast
    result = evaluate(model, dataset, batch_size=args.batch_size, precision=precision, progress=True)
    if result.classes_matched == "by name":
        print(f"{args.data}'s classes matched to {args.checkpoint}'s by name (they are in another order)")
    print(f"{args.checkpoint} on {args.data} ({args.split}), {model.config.image_size[0]} px")
    print(format_eval(result, model.class_names or dataset.classes))
    skipped = getattr(read, "skipped", None)
    if skipped:
        print(skipped.summary())
    return 0


def _shots(text: str) -> tuple[int, ...]:
    try:
        shots = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(
            f"--fewshot {text!r}: give shots per class as integers separated by commas, e.g. 1,5,10."
        ) from None
    return shots


def _std(values: list[float]) -> float:
    """Standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5


def cmd_predict(args: argparse.Namespace) -> int:
    """Top-k classes with their probabilities for each image file."""
    from vitkit.data.images import read_image
    from vitkit.training.evaluation import calibration_from_files, check_has_classes, image_files, input_notes, predict

    model = _placed(load_checkpoint(args.checkpoint, allow_nonfinite=args.allow_nonfinite), args)
    check_has_classes(model)  # before optimizing or calibrating a copy that could not be used
    files = image_files(args.images)
    _runtime_needs_optimize(args)
    if args.precision == "int8":
        calibration = calibration_from_files(model, files, args.calibration_images)
        model = _int8(model, args, calibration, "drawn from the images being predicted, --calibration-images")
    elif args.optimize:
        model = optimize(model, args.precision, runtime=_runtime(args, model, len(files)))
    elif args.precision != "auto":
        raise ValueError(
            f"--precision {args.precision} with --no-optimize: the precision is the optimized copy's; "
            "drop --no-optimize."
        )
    results = predict(model, files, args.top_k, progress=True, strict=args.strict)
    for path, top in zip(files, results):
        if top is None:  # unreadable: warned about, counted below
            continue
        print(f"{path}: " + ", ".join(f"{name} {100 * p:.1f}%" for name, p in top))
        for note in input_notes(model, read_image(path)):
            print(f"  note: {note}")
    skipped = [str(path) for path, top in zip(files, results) if top is None]
    if skipped and len(skipped) == len(files):
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        raise ValueError(f"nothing predicted: none of the {len(files)} file(s) is a readable image ({shown}).")
    if skipped:
        print(f"{len(skipped)} unreadable image file(s) skipped")
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    """Run one of the paper's experiments (resumable) and write its results JSON, table and plot."""
    from vitkit.analysis.experiment_runs import experiment

    try:
        result = experiment(
            args.name,
            preset=args.preset,
            seeds=args.seeds,
            out=args.out,
            checkpoint=args.checkpoint,
            threads=args.threads,
            overwrite=args.overwrite,
        )
    except KeyboardInterrupt as e:
        print(f"vitkit experiment: interrupted ({e or 'Ctrl-C'}); finished runs are kept.", file=sys.stderr)
        return 130
    print(result.files["table"].read_text())
    print(
        f"{result.trained} training run(s) and {result.measured} measurement(s) done in {result.seconds / 60:.1f} "
        f"min; wrote {', '.join(str(p) for p in result.files.values())}"
    )
    return 0


def _placed(model, args: argparse.Namespace):
    """The model on --device, with torch on --threads CPU threads."""
    import torch

    from vitkit.training.distributed import resolve_device

    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: give a number of threads, or 0 for torch's default.")
    if args.threads:
        torch.set_num_threads(args.threads)
    return model.to(resolve_device(args.device))
