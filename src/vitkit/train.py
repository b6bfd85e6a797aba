"""Training and fine-tuning: `train(TrainConfig(...))` runs one recipe of `vitkit.recipes` end to end.

One step = one optimiser update on a global batch of `batch_size` images, split evenly over the torchrun
processes and then over `accumulation_steps` micro-batches. The data order of an epoch is the
`DistributedSampler` permutation (seed + epoch); the augmentation of step s comes from a generator seeded by
(seed, s). Both are functions of the step, so a run resumed from its checkpoint continues exactly, and a
2-process run sees the same global batches, augmented the same way, as a 1-process run.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from .augment import AugmentConfig, random_draws, train_batch
from .checkpoints import load_checkpoint, save
from .config import ViTConfig, decode_variant
from .data import ImageArrayDataset, dataset_augmentation, get_dataset
from .distributed import World, all_gather_tensors, any_process, barrier, close_world, init_world
from .efficiency import count_params
from .evaluate import EvalResult, autocast, batches, evaluate, format_eval
from .model import VisionTransformer
from .recipes import TrainConfig, build_optimizer, freeze, learning_rate
from .runs import RunDir, default_run_dir, plot_run, read_checkpoint, truncate_metrics

CHECKPOINT_FORMAT = "vitkit-train/1"
ARCHITECTURE_FIELDS = {"hidden_size", "num_layers", "mlp_dim", "num_heads", "patch_size", "classifier", "posemb",
                       "in_chans", "hybrid", "representation_size", "qkv_bias", "layer_scale_init"}  # fmt: skip


@dataclass(frozen=True)
class TrainResult:
    """How a run ended: `step` of `total_steps` done (fewer when interrupted), the last evaluation."""

    run_dir: Path
    step: int
    total_steps: int
    interrupted: bool
    final: EvalResult | None
    best_top1: float
    seconds: float  # in training steps, over all sessions of the run
    wall_seconds: float  # this session, data loading and evaluation included


def load_datasets(config: TrainConfig):
    """The train and test splits named by the config."""
    kwargs = dict(config.data_args)
    if config.data_dir is not None:
        kwargs["data_dir"] = config.data_dir
    return get_dataset(config.data, "train", **kwargs), get_dataset(config.data, "test", **kwargs)


def build_model(config: TrainConfig, dataset) -> VisionTransformer:
    """A new model for the dataset, or the fine-tuning checkpoint adapted to it (posemb resampled in 2D to
    the new resolution, a new zero-initialised head)."""
    num_classes = len(dataset.classes)
    if config.checkpoint is not None:
        structural = sorted(set(config.model_args) & ARCHITECTURE_FIELDS)
        if structural:
            raise ValueError(
                f"model_args {structural} would change the architecture of checkpoint {config.checkpoint}: with a "
                "checkpoint give only overrides without weights (e.g. drop_path_rate); `vitkit finetune` clears them."
            )
        model = load_checkpoint(config.checkpoint, image_size=config.image_size, **config.model_args)
        model.reset_head(num_classes)
    else:
        # The dataset's own resolution when it has one (in-memory splits, shapes); 224 for image folders.
        native = tuple(dataset.images.shape[-2:]) if isinstance(dataset, ImageArrayDataset) else None
        size = config.image_size or native or getattr(dataset, "image_size", 224)
        model = VisionTransformer(
            decode_variant(config.model, image_size=size, num_classes=num_classes, **config.model_args)
        )
    model.class_names = list(dataset.classes)
    return model


def augment_config(config: TrainConfig, dataset) -> AugmentConfig:
    """The dataset's own training augmentation, with the config's explicit choices on top."""
    crop_scale, flip = dataset_augmentation(dataset)
    return AugmentConfig(
        crop_scale=config.crop_scale or crop_scale,
        flip=flip if config.flip is None else config.flip,
        randaugment=config.randaugment,
        mixup=config.mixup,
    )


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for the augmentation of one step."""
    return int(np.random.SeedSequence([seed, step]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class StopRequest:
    """Ctrl-C / SIGTERM ask the run to stop after the current step (a second Ctrl-C stops at once)."""

    def __init__(self):
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(
    config: TrainConfig | None = None, *, resume: str | Path | None = None, stop_after: int | None = None
) -> TrainResult:
    """Run `config` (default: the main job), or continue the run saved in the directory `resume` with its own
    config; returns how it ended. `stop_after` stops after that many steps in all, as an interruption would:
    a checkpoint is saved."""
    if config is not None and resume is not None:
        raise ValueError(f"give a config or resume={str(resume)!r}, not both: a resumed run keeps its saved config.")
    config = config or TrainConfig()
    saved = read_checkpoint(resume) if resume is not None else None
    if saved is not None:
        config = TrainConfig.from_dict(json.loads(saved["config"]))
        run_path = Path(resume)
    else:
        run_path = Path(config.out_dir) if config.out_dir else default_run_dir(config.data)
    world = init_world(config.device)
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _train(config, world, run_path, saved, stop_after)
    finally:
        torch.set_num_threads(threads)
        close_world(world)


def _train(config: TrainConfig, world: World, run_path: Path, saved: dict | None, stop_after: int | None):
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    train_set, test_set = load_datasets(config)
    if saved is not None:
        model = VisionTransformer(ViTConfig.from_dict(json.loads(saved["model_config"])))
        model.class_names = list(train_set.classes)
    else:
        model = build_model(config, train_set)
    learning = freeze(model, config.train)
    model.to(world.device)
    optimizer = build_optimizer(model, config)
    torch.manual_seed(config.seed * 1000 + world.rank + 1)  # dropout / stochastic depth differ between ranks

    if config.batch_size % (world.size * config.accumulation_steps):
        raise ValueError(
            f"batch_size={config.batch_size} is not divisible by {world.size} processes x "
            f"{config.accumulation_steps} accumulation steps: choose a multiple of "
            f"{world.size * config.accumulation_steps}."
        )
    steps_per_epoch = len(train_set) // config.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"batch_size={config.batch_size} exceeds the {len(train_set)} training images: lower it.")
    total = config.steps or math.ceil(config.epochs * steps_per_epoch)
    warmup = round(config.warmup_fraction * total)
    eval_interval = max(round(config.eval_every * steps_per_epoch), 1) if config.eval_every > 0 else total
    augment = augment_config(config, train_set)
    sampler = DistributedSampler(
        train_set, num_replicas=world.size, rank=world.rank, shuffle=True, seed=config.seed, drop_last=True
    )
    per_rank = config.batch_size // world.size
    micro = per_rank // config.accumulation_steps

    run = RunDir(run_path, enabled=world.is_main)
    step, best_top1, elapsed = 0, -1.0, 0.0
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, best_top1, elapsed = int(saved["step"]), float(saved["best_top1"]), float(saved["elapsed"])
        if len(saved["rng"]) == world.size:
            torch.set_rng_state(saved["rng"][world.rank])
            if world.device.type == "cuda" and saved.get("cuda_rng"):
                torch.cuda.set_rng_state(saved["cuda_rng"][world.rank], world.device)
        if world.is_main:
            truncate_metrics(run_path, step)
    else:
        run.write_json(
            "config.json",
            {
                "train": config.to_dict(),
                "model": model.config.to_dict(),
                "classes": model.class_names,
                "augment": augment.__dict__,
                "world_size": world.size,
                "total_steps": total,
                "steps_per_epoch": steps_per_epoch,
                "learning_parameters": learning,
            },
        )
    net = model
    if world.size > 1:
        net = DistributedDataParallel(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    if config.compile:
        net = torch.compile(net)

    def checkpoint_state() -> dict:
        rng = all_gather_tensors(torch.get_rng_state(), world)
        cuda_rng = (
            all_gather_tensors(torch.cuda.get_rng_state(world.device), world) if world.device.type == "cuda" else []
        )
        return {
            "format": CHECKPOINT_FORMAT,
            "config": json.dumps(config.to_dict()),
            "model_config": json.dumps(model.config.to_dict()),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "epoch": step // steps_per_epoch,
            "batch_in_epoch": step % steps_per_epoch,
            "sampler_seed": config.seed,
            "total_steps": total,
            "best_top1": best_top1,
            "elapsed": elapsed,
            "rng": [t.cpu() for t in rng],
            "cuda_rng": [t.cpu() for t in cuda_rng],
        }

    def run_eval() -> EvalResult:
        nonlocal best_top1
        result = evaluate(
            model, test_set, batch_size=config.eval_batch_size, precision=config.precision, world=world,
            workers=config.workers,
        )  # fmt: skip
        run.log({"split": "test", "step": step, "epoch": step / steps_per_epoch, "loss": result.loss,
                 "top1": result.top1, "top5": result.top5})  # fmt: skip
        if result.top1 > best_top1:
            best_top1 = result.top1
            if world.is_main:
                save(model, run_path / "best.safetensors")
        return result

    params = [p for p in model.parameters() if p.requires_grad]
    final: EvalResult | None = None
    interrupted = False
    window = {"loss": 0.0, "top1": 0, "top5": 0, "count": 0, "steps": 0, "time": 0.0}
    bar = tqdm(total=total, initial=step, disable=None if world.is_main else True, unit="step", dynamic_ncols=True)
    model.train()
    with StopRequest() as stop:
        while step < total and not interrupted:
            epoch, start = step // steps_per_epoch, step % steps_per_epoch
            sampler.set_epoch(epoch)
            order = list(sampler)
            # This rank's share of each remaining global batch of the epoch, cut into micro-batches.
            rank_batches = [order[i * per_rank : (i + 1) * per_rank] for i in range(start, steps_per_epoch)]
            micro_batches = [
                b[m * micro : (m + 1) * micro] for b in rank_batches for m in range(config.accumulation_steps)
            ]
            loader = batches(train_set, micro_batches, config.workers)
            for _ in range(start, steps_per_epoch):
                if step >= total:
                    break
                tick = time.perf_counter()
                step += 1
                generator = torch.Generator().manual_seed(step_seed(config.seed, step))
                draws = random_draws(config.batch_size, generator)[world.rank :: world.size]  # this rank's samples
                lr = learning_rate(step, total, config.lr, warmup, config.schedule)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for m in range(config.accumulation_steps):
                    images, labels = next(loader)
                    x, targets = train_batch(
                        images, labels, draws[m * micro : (m + 1) * micro], model.config.image_size, augment,
                        model.config.num_classes, model.config.in_chans,
                    )  # fmt: skip
                    x, targets, labels = x.to(world.device), targets.to(world.device), labels.to(world.device)
                    sync = m == config.accumulation_steps - 1 or world.size == 1
                    with net.no_sync() if not sync else contextlib.nullcontext():
                        with autocast(world.device, config.precision):
                            logits = net(x)
                        loss = F.cross_entropy(logits.float(), targets, label_smoothing=config.label_smoothing)
                        (loss / config.accumulation_steps).backward()
                    with torch.no_grad():
                        window["loss"] += float(loss) * len(labels)
                        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
                        window["top1"] += int((top5[:, 0] == labels).sum())
                        window["top5"] += int((top5 == labels[:, None]).any(1).sum())
                        window["count"] += len(labels)
                if config.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                spent = time.perf_counter() - tick
                elapsed += spent
                window["time"] += spent
                window["steps"] += 1
                bar.update(1)
                if step % config.log_every == 0 or step == total:
                    n = max(window["count"], 1)
                    record = {
                        "split": "train",
                        "step": step,
                        "epoch": step / steps_per_epoch,
                        "lr": lr,
                        "loss": window["loss"] / n,
                        "top1": window["top1"] / n,
                        "top5": window["top5"] / n,
                        "images_per_s": window["steps"] * config.batch_size / max(window["time"], 1e-9),
                    }
                    run.log(record)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['top1']:.3f}",
                                    img_s=f"{record['images_per_s']:.0f}")  # fmt: skip
                    window = dict.fromkeys(window, 0)
                if step % eval_interval == 0 or step == total:
                    final = run_eval()
                    if world.is_main:
                        bar.write(
                            f"step {step}/{total}  test top-1 {100 * final.top1:.2f}%  top-5 {100 * final.top5:.2f}%"
                        )
                    run.save_checkpoint(checkpoint_state())
                if any_process(stop.requested or (stop_after is not None and step >= stop_after), world):
                    interrupted = step < total
                    if interrupted:
                        run.save_checkpoint(checkpoint_state())
                    break
    bar.close()
    if final is None and not interrupted:  # resumed after the last step: evaluate the finished model
        final = run_eval()
    if not interrupted and world.is_main:
        save(model, run_path / "model.safetensors")
        plot_run(run_path, final.confusion if final else None, model.class_names)
    result = TrainResult(run_path, step, total, interrupted, final, best_top1, elapsed, time.perf_counter() - started)
    if world.is_main:
        run.write_json("summary.json", summary_dict(result, config, model))
        print(format_summary(result, config, model), flush=True)
    barrier(world)
    run.close()
    return result


def summary_dict(result: TrainResult, config: TrainConfig, model: VisionTransformer) -> dict:
    return {
        "run_dir": str(result.run_dir),
        "data": config.data,
        "step": result.step,
        "total_steps": result.total_steps,
        "interrupted": result.interrupted,
        "train_seconds": result.seconds,
        "wall_seconds": result.wall_seconds,
        "test_top1": result.final.top1 if result.final else None,
        "test_top5": result.final.top5 if result.final else None,
        "best_test_top1": result.best_top1,
        "per_class": dict(zip(model.class_names, result.final.per_class)) if result.final else None,
        "parameters": count_params(model.config),
    }


def format_summary(result: TrainResult, config: TrainConfig, model: VisionTransformer) -> str:
    """The one-screen summary printed at the end of a run."""
    c = model.config
    lines = [
        "=" * 72,
        f"run        {result.run_dir}",
        f"data       {config.data}   model {config.checkpoint or config.model} {c.image_size[0]}x{c.image_size[1]}, "
        f"patch {c.patch_size[0]}, D={c.hidden_size}, L={c.num_layers}, {count_params(c):,} params",
        f"recipe     {config.optimizer} lr {config.lr:g}, wd {config.weight_decay:g}, batch {config.batch_size}, "
        f"{config.schedule}, warmup {config.warmup_fraction:g}, train={config.train}, {config.precision}",
        f"steps      {result.step}/{result.total_steps} in {result.seconds / 60:.1f} min of training, "
        f"{result.wall_seconds / 60:.1f} min wall (data and evaluation included)",
    ]
    if result.interrupted:
        lines.append(f"stopped    checkpoint saved; continue with: vitkit train --resume {result.run_dir}")
    if result.final is not None:
        lines.append(f"test       {format_eval(result.final, model.class_names)}")
        lines.append(f"best       top-1 {100 * result.best_top1:.2f}%")
    files = ["config.json", "metrics.jsonl", "checkpoint.pt"]
    files += [] if result.interrupted else ["model.safetensors", "best.safetensors", "curves.png", "confusion.png"]
    lines += [f"files      {', '.join(files)}", "=" * 72]
    return "\n".join(lines)
