"""Training and fine-tuning: `train(TrainConfig(...))` runs one recipe of `vitkit.training.recipes` end to end.

One step = one optimiser update on a global batch of `batch_size` images, split evenly over the torchrun
processes and then over `accumulation_steps` micro-batches. The data order of an epoch is the
`DistributedSampler` permutation (seed + epoch); the augmentation of step s comes from a generator seeded by
(seed, s). Both are functions of the step, so a run resumed from its checkpoint continues exactly, and a
2-process run sees the same global batches, augmented the same way, as a 1-process run. Packed datasets
(`--data shards`) are streamed instead, in an order of their own (see `vitkit.data.shards`).

`strategy="ddp"` keeps a whole model per process (DistributedDataParallel) and saves checkpoint.pt;
`strategy="fsdp"` shards it over the processes with FSDP2 and saves the directory checkpoint/ with
torch.distributed.checkpoint, which resumes with any number of processes.
"""

from __future__ import annotations

import json
import math
import time
import typing
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from vitkit.data.augment import AugmentConfig, random_draws, train_batch
from vitkit.data.datasets import class_counts, dataset_augmentation, locate, subset, training_splits
from vitkit.data.shards import ShardedDataset, check_data_order
from vitkit.data.survey import describe
from vitkit.errors import NonFiniteError
from vitkit.models.architectures import Model, check_overrides, new_model
from vitkit.models.vit import VisionTransformer
from vitkit.speed import kernels
from vitkit.speed.machine import ThreadWatch, compile_quietly_on, resolve_precision

from .distributed import (
    World,
    any_process,
    barrier,
    close_world,
    gradient_sync,
    init_world,
    launched_rank,
    wrap_model,
)
from .evaluation import EvalResult, autocast, batches, evaluate, probe_head
from .fitted import ResolvedRun, chosen_line, resolve
from .optimization import build_optimizer, learning_rate, set_learning_rate, set_trainable
from .recipes import (
    DEFAULT_VARIANT,
    PROBE_C,
    TrainConfig,
    global_batch,
    main_job_data,
    new_model_args,
    plan_steps,
    resume_changes,
    should_compile,
)
from .run_summary import TrainResult, format_summary, summary_dict, time_left
from .runs import (
    RunDir,
    RunLock,
    StopRequest,
    claim_run_dir,
    default_run_dir,
    plot_run,
    read_checkpoint,
    stopped_at_once,
)
from .state import TrainState, restore, save_checkpoint, save_model, saved_model

MicroBatches = Iterator[tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]]  # (uint8 images, labels)


def load_datasets(config: TrainConfig):
    """The (train, val, test) splits named by the config (`data.training_splits`): the run chooses on val and
    reads test once, at its end; either may be None."""
    kwargs = dict(config.data_args)
    if config.data_dir is not None:
        kwargs["data_dir"] = config.data_dir
    train_set, val_set, test_set = training_splits(config.data, strict=config.strict, **kwargs)
    if config.train_images is not None:
        train_set = subset(train_set, config.train_images)
    return train_set, val_set, test_set


def initial_model(run: ResolvedRun, dataset, device: torch.device | None = None) -> Model:
    """The model a new run resolved by `fitted.resolve` starts from, for the dataset's classes: a new one, or the
    checkpoint read at the run's resolution (posemb resampled in 2D) with a new head, zero-initialised or, with
    `head_init="probe"`, a linear probe of the checkpoint's features of the dataset's images (computed on `device`)."""
    config, num_classes = run.config, len(dataset.classes)
    if run.base is not None:
        model = run.base
        model.reset_head(num_classes)
        if config.head_init == "probe":
            model.normalization = None  # the probe sees the input the fine-tuning will: [-1, 1]
            probe_head(model.to(device or "cpu"), dataset, PROBE_C, config.precision)
    else:
        model = new_model(str(config.model), image_size=config.image_size, num_classes=num_classes, **config.model_args)
    model.class_names = list(dataset.classes)
    model.normalization = None  # trained on the official [-1, 1] input (augment.train_batch), whatever a checkpoint's
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


def train(
    config: TrainConfig | None = None,
    *,
    resume: str | Path | None = None,
    changes: dict | None = None,
    stop_after: int | None = None,
    given: Collection[str] = (),
) -> TrainResult:
    """Run `config` (default: the main job), or continue the run saved in the directory `resume` with its own
    config, with `changes` to the fields `recipes.RESUMABLE` names (length, cadence); returns how it ended.
    `stop_after` stops after that many steps in all, as an interruption would: a checkpoint is saved. `given` names
    the fields the user set: the recipe a small image folder starts from leaves them as they are even where they
    equal TrainConfig's defaults (by default only the fields that differ from those count as set)."""
    if config is not None and resume is not None:
        raise ValueError(f"give a config or resume={str(resume)!r}, not both: a resumed run keeps its saved config.")
    if changes and resume is None:
        raise ValueError("changes= applies to a resumed run: give resume=RUN_DIR, or put them in the config.")
    config = config or TrainConfig()
    if resume is not None:
        run_path = Path(resume)
    else:
        data, data_dir = locate(config.data, config.data_dir)  # a folder -> imagefolder or shards; a bad name fails now
        name = Path(config.data).resolve().name if data != config.data else data
        config = config.replace(data=data, data_dir=data_dir)
        run_path = Path(config.out_dir) if config.out_dir else default_run_dir(name)
    with StopRequest() as stop:
        try:
            return _start(config, run_path, resume, changes, stop_after, stop, given)
        except KeyboardInterrupt:  # a signal before the steps began, or a second one
            raise KeyboardInterrupt(stopped_at_once(run_path)) from None


def _start(
    config: TrainConfig,
    run_path: Path,
    resume,
    changes: dict | None,
    stop_after: int | None,
    stop: StopRequest,
    given: Collection[str] = (),
) -> TrainResult:
    """Lock the run directory for the run's life (the main process), claim it (or read the checkpoint to resume),
    then run the session on its processes."""
    with RunLock(run_path, enabled=launched_rank() == 0, resuming=resume is not None):
        saved = None
        if resume is not None:
            saved = read_checkpoint(resume)
            config = resume_changes(TrainConfig.from_dict(json.loads(saved["config"])), changes or {})
        world = init_world(config.device)
        if saved is None:
            try:
                claim_run_dir(run_path, config.overwrite, world.is_main)
            except BaseException:
                close_world(world)
                raise
            barrier(world)  # the main process has cleared an overwritten run before anyone writes
        threads = torch.get_num_threads()
        if config.threads:
            torch.set_num_threads(config.threads)
        try:
            return _train_session(config, world, run_path, saved, stop_after, stop, given)
        finally:
            torch.set_num_threads(threads)
            close_world(world)


def _train_session(
    config: TrainConfig,
    world: World,
    run_path: Path,
    saved: dict | None,
    stop_after: int | None,
    stop: StopRequest,
    given: Collection[str] = (),
) -> TrainResult:
    """The recipe: set up, restore (or start), one `train_step` after another with metrics, evaluations and
    checkpoints at their intervals, then finish."""
    started = time.perf_counter()
    state, (train_set, val_set, test_set) = set_up(config, world, run_path, saved, given)
    state.session_start = started
    val, interrupted = run_steps(state, train_set, val_set, stop, stop_after)
    stop.notice = "finishing: the model and the plots are being written"
    if val is None and val_set is not None and not interrupted:  # resumed after the last step
        val = run_evaluation(state, val_set, "val")
    test = None if interrupted or test_set is None else run_evaluation(state, test_set, "test")  # read once
    return finish(state, (val, test), interrupted, started, (train_set, val_set, test_set))


def set_up(config: TrainConfig, world: World, run_path: Path, saved: dict | None, given: Collection[str] = ()):
    """The data, the model (new, fitted to the data, or restored), its optimiser and the run directory, as one
    `TrainState`; a new run's `config.json` records what was chosen."""
    config = config.replace(precision=resolve_precision(config.precision, world.device))  # "auto" -> fp32 or bf16
    asked = config
    if saved is None:  # the main job trains on all its training images; config.json records it
        config = main_job_data(config)
    if saved is None and config.checkpoint is None:  # a typo fails now, not after the data has loaded
        check_overrides(config.model or f"{DEFAULT_VARIANT}/16", new_model_args(config))
    torch.manual_seed(config.seed)
    train_set, val_set, test_set = load_datasets(config)
    if len(train_set.classes) < 2:
        raise ValueError(
            f"{config.data_dir or config.data} has one class ({train_set.classes[0]}): a classifier needs two or "
            "more. Put each class's images in a folder of its own, FOLDER/<class>/<image>."
        )
    if saved is None:  # what config.json records: the start, model, resolution, augmentation, batch and length
        resolved = resolve(config, train_set, world.size * config.accumulation_steps, given)
        config = resolved.config
        if world.is_main:
            whole = config.data_args != asked.data_args
            note = f"; all {len(train_set):,} training images, no val: the recipe was chosen on val" if whole else ""
            print(chosen_line(resolved) + note, flush=True)
        model = initial_model(resolved, train_set, world.device)
    else:
        model = saved_model(saved, train_set)
    model.trained_on = describe(config.data, train_set)
    learning = set_trainable(model, config.trainable, config.frozen_blocks)
    if isinstance(model, VisionTransformer):  # the ResNet baseline has no blocks to recompute
        model.set_grad_checkpointing(config.grad_checkpointing)
    kernels.install(model.to(world.device))  # the machine's fast layers, the same parameters
    net = wrap_model(model, world, config.strategy, config.precision)  # FSDP shards in place: before the optimiser
    optimizer = build_optimizer(model, config)
    torch.manual_seed(config.seed * 1000 + world.rank + 1)  # dropout / stochastic depth differ between ranks
    if saved is not None:
        check_data_order(saved, config, world, train_set, run_path)  # before the plan: it depends on the counts
    plan = plan_steps(config, images_per_epoch(train_set, config, world), world)
    config = config.replace(compile=should_compile(config, world, plan.total))  # what config.json records
    run = RunDir(run_path, enabled=world.is_main)
    state = TrainState(config, world, plan, augment_config(config, train_set), model, net, optimizer, run)
    if config.balanced:
        state.class_weights = balanced_weights(class_counts(train_set)).to(world.device)
    if saved is not None:
        restore(state, saved)  # the same weights on every process (DDP broadcast rank 0's when wrapping)
    else:
        run.write_json("config.json", run_description(state, learning, train_set))
    if config.compile:
        compile_quietly_on(world.device)
        state.net = typing.cast(torch.nn.Module, torch.compile(state.net))
    return state, (train_set, val_set, test_set)


def run_steps(state: TrainState, train_set, val_set, stop: StopRequest, stop_after: int | None):
    """`train_step` until the plan's end or a stop, logging, evaluating on val (where there is one) and saving at
    their intervals; returns the last evaluation (or None) and whether the run was interrupted (then a checkpoint
    is saved)."""
    config, plan, world = state.config, state.plan, state.world
    final: EvalResult | None = None
    bar = tqdm(
        total=plan.total, initial=state.step, disable=None if world.is_main else True, unit="step", dynamic_ncols=True
    )
    state.model.train()
    stop.stepping = True
    start, first_step = time.perf_counter(), state.step
    watch = ThreadWatch(config.threads, world.device, say=bar.write)  # fewer threads while other work has the cores
    if config.compile:
        stop.notice = f"stopping after step {state.step + 1}, once the model has compiled (a while), with a checkpoint"
    try:
        micro_batches = None
        while state.step < plan.total:
            if micro_batches is None or state.step % plan.steps_per_epoch == 0:  # started, resumed or a new epoch
                micro_batches = epoch_micro_batches(train_set, state)
            lr = train_step(state, micro_batches)
            watch.after_step()
            stop.notice = "stopping after the current step, with a checkpoint"
            bar.update(1)
            if state.step % config.log_every == 0 or state.step == plan.total:
                record = state.window.flush(state.step, state.step / plan.steps_per_epoch, lr, plan.batch)
                state.run.log(record)
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}", acc=f"{record['top1']:.3f}", img_s=f"{record['images_per_s']:.0f}"
                )
            if state.step % plan.eval_interval == 0 or state.step == plan.total:
                if val_set is not None:
                    final = run_evaluation(state, val_set, "val")
                if world.is_main:
                    left = time_left(time.perf_counter() - start, state.step - first_step, plan.total - state.step)
                    scores = (
                        "" if final is None else f"  val top-1 {100 * final.top1:.2f}%  top-5 {100 * final.top5:.2f}%"
                    )
                    bar.write(f"step {state.step}/{plan.total}{scores}" + (f"  about {left} left" if left else ""))
                save_checkpoint(state)
            if any_process(stop.requested or (stop_after is not None and state.step >= stop_after), world):
                break
        interrupted = state.step < plan.total
        if interrupted:
            save_checkpoint(state)
    finally:
        bar.close()
    return final, interrupted


def images_per_epoch(dataset, config: TrainConfig, world: World) -> int:
    """The training images one epoch uses: all of them, or of streamed shards, what every process reads alike."""
    if not isinstance(dataset, ShardedDataset):
        return len(dataset)
    batch = global_batch(config)
    micro = max(batch // (world.size * config.accumulation_steps), 1)
    micro_batches = dataset.micro_batches_per_epoch(micro, world.size, config.workers)
    return micro_batches // config.accumulation_steps * batch


def balanced_weights(counts: torch.Tensor) -> torch.Tensor:
    """Each class's loss weight, the inverse of its share of the images (scikit-learn's "balanced":
    images / (classes x its images)), so that every class weighs as much in the loss as a class of the mean size."""
    return counts.sum() / (len(counts) * counts.clamp(min=1).float())


def run_description(state: TrainState, learning: list[str], data) -> dict:
    """config.json of a new run: the resolved configs, the classes, where the training `data` was read from,
    and how the steps are planned."""
    return {
        "train": state.config.to_dict(),
        "model": state.model.config.to_dict(),
        "classes": state.model.class_names,
        "data_source": str(getattr(data, "source", None) or "") or None,  # where the files were found, if any
        "augment": state.augment.__dict__,
        "world_size": state.world.size,
        "total_steps": state.plan.total,
        "steps_per_epoch": state.plan.steps_per_epoch,
        "learning_parameters": learning,
    }


def epoch_micro_batches(dataset, state: TrainState) -> MicroBatches:
    """(images, labels) of this process's micro-batches for the rest of the current epoch: the epoch's
    `DistributedSampler` permutation (seed + epoch) cut into global batches, this process's share of each,
    cut into `accumulation_steps` micro-batches. Packed shards are streamed in their own order instead."""
    config, plan, world = state.config, state.plan, state.world
    epoch, start = divmod(state.step, plan.steps_per_epoch)
    if isinstance(dataset, ShardedDataset):
        accumulation = config.accumulation_steps
        return dataset.stream(
            epoch=epoch,
            seed=config.seed,
            rank=world.rank,
            world_size=world.size,
            workers=config.workers,
            micro=plan.micro,
            start=start * accumulation,
            stop=plan.steps_per_epoch * accumulation,
        )
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world.size, rank=world.rank, shuffle=True, seed=config.seed, drop_last=True
    )
    sampler.set_epoch(epoch)
    order = list(sampler)
    shares = [order[i * plan.per_rank : (i + 1) * plan.per_rank] for i in range(start, plan.steps_per_epoch)]
    micro = plan.micro
    micro_batches = [s[m * micro : (m + 1) * micro] for s in shares for m in range(config.accumulation_steps)]
    return batches(dataset, micro_batches, config.workers)


def train_step(state: TrainState, micro_batches: MicroBatches) -> float:
    """One optimiser update on one global batch: the next `accumulation_steps` micro-batches, augmented with the
    step's own draws, their gradients averaged (across processes at the last one only), clipped and applied.
    The window collects the loss and accuracy; returns the step's learning rate."""
    config, world, model, micro = state.config, state.world, state.model, state.plan.micro
    tick = time.perf_counter()
    state.step += 1
    generator = torch.Generator().manual_seed(step_seed(config.seed, state.step))
    draws = random_draws(state.plan.batch, generator)[world.rank :: world.size]  # this process's samples
    lr = learning_rate(state.step, state.plan.total, config.lr, state.plan.warmup, config.schedule)
    set_learning_rate(state.optimizer, lr)
    finite = True
    for m in range(config.accumulation_steps):
        images, labels = next(micro_batches)
        if not len(labels):  # every image file of the micro-batch was unreadable (skipped, and counted)
            continue
        x, targets = train_batch(
            images,
            labels,
            draws[m * micro : m * micro + len(labels)],
            model.config.image_size,
            state.augment,
            model.config.num_classes,
            model.config.in_chans,
        )
        x, targets, labels = x.to(world.device), targets.to(world.device), labels.to(world.device)
        # DDP and FSDP reduce the gradients over processes on the last micro-batch of the step only.
        with gradient_sync(state.net, m == config.accumulation_steps - 1):
            with autocast(world.device, config.precision):
                logits = state.net(x)
            loss = F.cross_entropy(
                logits.float(), targets, weight=state.class_weights, label_smoothing=config.label_smoothing
            )
            (loss / config.accumulation_steps).backward()
        finite = finite and bool(torch.isfinite(loss))
        state.window.add(loss, logits, labels)
    # The total gradient norm (clipped to grad_clip when > 0; an infinite bound leaves the gradients as they are),
    # over all shards when FSDP shards the gradients (DTensors).
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip > 0 else math.inf)
    finite = finite and bool(torch.isfinite(norm))
    if any_process(not finite, world):
        state.optimizer.zero_grad(set_to_none=True)
        if config.nonfinite == "stop":
            raise nonfinite_error(state, loss, norm)
        state.skipped_steps += 1
    else:
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    spent = time.perf_counter() - tick
    state.elapsed += spent
    state.window.add_step(spent)
    return lr


def nonfinite_error(state: TrainState, loss: torch.Tensor, norm: torch.Tensor) -> NonFiniteError:
    """The error that stops a run at a step with a non-finite loss or gradient: what was met, and how to go on."""
    what = "loss" if not torch.isfinite(loss) else "gradient"
    if state.saved_step is not None:
        restart = (
            f"The newest checkpoint, step {state.saved_step}, is the last good state: continue with "
            f"`vitkit train --resume {state.run.path}` "
        )
    else:
        restart = "No checkpoint was saved yet: start again "
    return NonFiniteError(
        f"step {state.step}: non-finite {what} (loss {float(loss.detach()):g}, gradient norm {float(norm):g}); "
        f"the run stopped without applying it. {restart}with a lower --lr, or pass --nonfinite skip to skip such steps."
    )


def run_evaluation(state: TrainState, dataset, split: str) -> EvalResult:
    """Evaluate on `dataset`, the run's `split`, and log it; on val, keep the model as best.safetensors when its
    top-1 is the best so far."""
    config = state.config
    result = evaluate(
        state.model,
        dataset,
        batch_size=config.eval_batch_size,
        precision=config.precision,
        world=state.world,
        workers=config.workers,
    )
    state.run.log(
        {
            "split": split,
            "step": state.step,
            "epoch": state.step / state.plan.steps_per_epoch,
            "loss": result.loss,
            "top1": result.top1,
            "top5": result.top5,
        }
    )
    if split == "val" and result.top1 > state.best_top1:  # the same on every process: the counts are summed
        state.best_top1 = result.top1
        save_model(state, "best.safetensors")
    return result


def finish(
    state: TrainState,
    evaluations: tuple[EvalResult | None, EvalResult | None],
    interrupted: bool,
    started: float,
    datasets: tuple = (),
) -> TrainResult:
    """A finished run keeps model.safetensors and its plots; every run writes summary.json and prints it.
    `evaluations`: the last (val, test) ones; `started`: `time.perf_counter()` when the session began."""
    val, test = evaluations
    if not interrupted:
        save_model(state, "model.safetensors")
    last = test or val
    if not interrupted and state.world.is_main:
        plot_run(state.run.path, last.confusion if last else None, state.model.class_names or [])
    result = TrainResult(
        state.run.path,
        state.step,
        state.plan.total,
        interrupted,
        val,
        test,
        state.best_top1,
        state.elapsed,
        state.wall_before + time.perf_counter() - started,
        state.skipped_steps,
        sum(len(getattr(d, "skipped", ())) for d in datasets),
    )
    if state.world.is_main:
        state.run.write_json("summary.json", summary_dict(result, state.config, state.model))
        print(format_summary(result, state.config, state.model), flush=True)
    barrier(state.world)
    state.run.close()
    return result
