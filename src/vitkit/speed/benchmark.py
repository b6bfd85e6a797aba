"""`vitkit.bench`: the paper's Fig. 12 for any variant on the machine at hand.

Inference images/s against resolution and batch size, the peak memory of each, the largest batch that fits a
memory budget, and training-step images/s (forward, backward, AdamW), in fp32 and bf16, for the plain model
and the copy `vitkit.optimize` makes with vitkit's own kernels (`runtime="torch"`; `vitkit.speed.runtimes` times
OpenVINO's). Beside every model figure the same rounds time the model's own largest
matrix multiply (the first MLP layer, B*N x D times D x mlp_dim) in the same precision, and each model's
FLOP/s is reported as a fraction of that rate: how close the model runs to what this machine's GEMM reaches.

Every cell is timed in interleaved rounds (all cells of one resolution and batch size, then again), and the
median is kept, so that noise from other work on the machine hits all of them alike.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vitkit.models.config import ViTConfig, decode_variant
from vitkit.models.efficiency import flops
from vitkit.models.vit import VisionTransformer

from . import machine
from .optimize import optimize
from .torch_copy import PackedLinear, packing_available

MODES = ("plain", "optimized")
BENCH_PRECISIONS = ("fp32", "bf16", "int8")  # int8: the optimized copy only, for inference
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def commit() -> str | None:
    """The git commit of the checkout vitkit runs from, with "+dirty" when tracked files differ from it."""
    git = ["git", "-C", str(Path(__file__).parent)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:  # an installed package, not a checkout
        return None
    return head.stdout.strip() + ("+dirty" if changed.stdout.strip() else "")


def record_header(benchmark: str) -> dict[str, Any]:
    """What every measurement record starts with: which benchmark, the machine, when, at which commit, the command."""
    program, args = Path(sys.argv[0]), shlex.join(sys.argv[1:])
    if program.name == "__main__.py":
        command = f"python -m vitkit {args}"
    elif program.suffix == ".py":
        command = f"python {program.parent.name}/{program.name} {args}"
    else:
        command = f"{program.name} {args}"
    return {
        "benchmark": benchmark,
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "commit": commit(),
        "command": command.strip(),
    }


def write_record(path: str | Path, record: dict[str, Any]) -> Path:
    """Write a measurement record as JSON, atomically (values JSON does not know, such as paths, as strings)."""
    from vitkit.files import atomic_write

    path = Path(path)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1, default=str) + "\n"))
    return path


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensors created while it is active (outputs of every op, views counted once), on
    any device; `peak` is read after the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], list[int]] = {}  # storage -> [bytes, live tensors using it]
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: tuple[str, int]) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[key]


def _state_bytes(*objects) -> int:
    """Bytes held by the parameters and buffers of modules (with the packed weights of `optimize`'s copies) and
    the state of optimisers."""
    seen, total = set(), 0
    for obj in objects:
        tensors = []
        if isinstance(obj, torch.nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
            # Packed weights (`PackedLinear.packings`, not parameters or buffers) are opaque oneDNN/MKL tensors without
            # a storage to read: each is counted at the size of the weight it packs (a process's resident memory grew
            # by that much per packing).
            for m in obj.modules():
                if isinstance(m, PackedLinear):
                    total += len(m.packings) * m.weight.numel() * m.weight.element_size()
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = [v for s in obj.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


@dataclass
class _Cell:
    """One thing to time: a callable doing `images` images' worth of work per call."""

    kind: str  # inference | train | matmul
    precision: str
    mode: str
    run: Any
    images: int
    flops: float  # per call
    state: tuple = ()  # what the cell holds between calls: its model (and optimiser), counted in its memory
    memory: float | None = None  # peak bytes, measured once
    rates: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(cell: _Cell, device: torch.device, min_seconds: float) -> float:
    """Seconds per call, over as many calls as fill `min_seconds` (at least one)."""
    calls, start = 0, time.perf_counter()
    while True:
        cell.run()
        calls += 1
        _sync(device)
        spent = time.perf_counter() - start
        if spent >= min_seconds:
            return spent / calls


def _inference_cell(model, precision: str, mode: str, x: torch.Tensor, config: ViTConfig) -> _Cell:
    if mode == "optimized":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # emulated bf16 (slow int8) is measured all the same; `machine` says it is
            # int8 calibrates on the images it times: only its speed is measured here
            calibration = x if precision == "int8" else None
            net = optimize(model, precision, runtime="torch", calibration=calibration)  # its memory is torch's

        def run():
            with torch.inference_mode():
                net(x)

        held = net
    else:
        dtype = DTYPES[precision]

        def run():
            with torch.inference_mode(), torch.autocast(x.device.type, dtype=dtype, enabled=precision == "bf16"):
                model(x)

        held = model
    images = x.shape[0]
    return _Cell("inference", precision, mode, run, images, images * flops(config, pooled_only=True), state=(held,))


def _train_cell(config: ViTConfig, precision: str, x: torch.Tensor, compile: bool = False) -> _Cell:
    model = VisionTransformer(config).to(x.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if compile:
        machine.compile_quietly_on(x.device)
    net = torch.compile(model) if compile else model
    labels = torch.randint(0, max(config.num_classes, 1), (x.shape[0],), device=x.device)

    def run():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = net(x)
        F.cross_entropy(logits.float(), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    mode = "compiled" if compile else "plain"
    work = 3 * x.shape[0] * flops(config, pooled_only=True)  # backward: 2x forward
    return _Cell("train", precision, mode, run, x.shape[0], work, state=(model, optimizer))


def _cells_of(
    precision: str, device: torch.device, modes: tuple[str, ...], train: bool, compile: bool
) -> list[tuple[str, str]]:
    """(kind, mode) of each cell timed for `precision`: int8 is the optimized copy's inference alone (no plain
    int8 model, no int8 training, no int8 GEMM of torch's to set beside it)."""
    if precision == "int8":
        return [("inference", "optimized")] if "optimized" in modes else []
    cells = [("matmul", m) for m in _matmul_modes(precision, device)] + [("inference", m) for m in modes]
    return cells + [("train", "plain"), ("train", "compiled")][: (1 + compile) * train]


def _matmul_modes(precision: str, device: torch.device) -> tuple[str, ...]:
    """torch.mm, and on a CPU that packs `precision` also the packed GEMM `optimize` uses (MKL or oneDNN)."""
    return ("torch.mm", "packed") if device.type == "cpu" and packing_available(precision) else ("torch.mm",)


def _matmul_cell(config: ViTConfig, precision: str, batch: int, device: torch.device, mode: str) -> _Cell:
    """The model's largest matrix multiply: tokens (B*N, D) times the first MLP weight (D, mlp_dim), by torch.mm
    or by the packed GEMM of `optimize`'s linears; the machine's rate is the faster of the two."""
    rows, d, m = batch * config.num_tokens, config.hidden_size, config.mlp_dim
    a = torch.randn(rows, d, device=device, dtype=DTYPES[precision])
    if mode == "packed":
        packed = PackedLinear(nn.Linear(d, m, bias=False, device=device, dtype=DTYPES[precision]))

        def run():
            packed(a)

    else:
        b = torch.randn(d, m, device=device, dtype=DTYPES[precision])
        out = torch.empty(rows, m, device=device, dtype=DTYPES[precision])

        def run():
            torch.mm(a, b, out=out)

    return _Cell("matmul", precision, mode, run, 0, 2.0 * rows * d * m)


def _measure_memory(cell: _Cell, static: int) -> float:
    with PeakMemory() as tracker:
        cell.run()
    return static + tracker.peak


def interleaved(runs: dict[str, Any], rounds: int, min_seconds: float) -> dict[str, list[float]]:
    """Seconds per call of each callable in each of `rounds` rounds, after one warm-up call each; each round
    starts with another one, so that none always runs first and noise from other work hits all of them alike."""
    for run in runs.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            calls, start = 0, time.perf_counter()
            while True:
                runs[name]()
                calls += 1
                spent = time.perf_counter() - start
                if spent >= min_seconds:
                    break
            seconds[name].append(spent / calls)
    return seconds


def ratios_to_fastest(rates: dict[str, list[float]]) -> dict[str, float]:
    """Each contender's images/s over the fastest one's (the highest median): the median of the two's ratios
    within each round, which cancels the machine's drift between rounds (the fastest: 1.0)."""
    medians = {name: statistics.median(r) for name, r in rates.items()}
    fastest = max(medians, key=medians.__getitem__)
    return {name: statistics.median(a / b for a, b in zip(r, rates[fastest])) for name, r in rates.items()}


def bench(
    model: str | ViTConfig = "ViT-B/16",
    *,
    image_sizes: tuple[int, ...] = (224,),
    batch_sizes: tuple[int, ...] = (1, 8),
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    modes: tuple[str, ...] = MODES,
    train: bool = True,
    compile: bool = False,
    rounds: int = 3,
    min_seconds: float = 0.2,
    memory_budget_gb: float | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    **model_args: Any,
) -> dict[str, Any]:
    """Measure `model` (a variant name or a ViTConfig) on this machine; returns a JSON-able dict with
    `machine`, `rows` (one per resolution, batch, precision, kind and mode: images/s, GFLOP/s, fraction of the
    matmul rate, peak memory) and `largest_batch` (per resolution and precision, for `memory_budget_gb`).

    `compile=True` adds `torch.compile`d training steps. `min_seconds`: each timing repeats calls until it
    lasts that long; `rounds`: interleaved repetitions, the median kept.
    """
    _check_bench_arguments(precisions, modes, rounds, image_sizes, batch_sizes)
    device = torch.device(device)
    base = model if isinstance(model, ViTConfig) else decode_variant(model, **model_args)
    result = _bench_record(model, base, device, rounds, min_seconds, memory_budget_gb)
    per_group = sum(len(_cells_of(p, device, modes, train, compile)) for p in precisions)
    bar = _progress_bar(len(image_sizes) * len(batch_sizes) * per_group * (rounds + 1), progress)
    for size in image_sizes:
        config = base.replace(image_size=size)
        net = VisionTransformer(config).to(device).eval()
        for batch in batch_sizes:
            cells = _group_cells(config, net, batch, precisions, device, modes, train, compile)
            _measure(cells, device, rounds, min_seconds, bar)
            result["rows"] += _rows(cells, size, batch)
    bar.close()
    result["largest_batch"] = largest_batches(result["rows"], memory_budget_gb)
    return result


def _check_bench_arguments(
    precisions: tuple[str, ...],
    modes: tuple[str, ...],
    rounds: int,
    image_sizes: tuple[int, ...],
    batch_sizes: tuple[int, ...],
) -> None:
    for name, values, allowed in (("precisions", precisions, BENCH_PRECISIONS), ("modes", modes, MODES)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(f"{name}={values!r}: choose from {', '.join(allowed)}.")
    if rounds < 1 or not image_sizes or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"rounds={rounds}, batch_sizes={batch_sizes}: need at least one round, batch and size.")


def _bench_record(
    model: str | ViTConfig,
    base: ViTConfig,
    device: torch.device,
    rounds: int,
    min_seconds: float,
    memory_budget_gb: float | None,
) -> dict[str, Any]:
    """The record `bench` fills: its header, the model and the settings, with no rows yet."""
    header = record_header("bench")
    return {
        **header,
        "model": model if isinstance(model, str) else "custom",
        "config": base.to_dict(),
        "machine": {**header["machine"], "device": str(device)},
        "settings": {"rounds": rounds, "min_seconds": min_seconds, "memory_budget_gb": memory_budget_gb},
        "rows": [],
        "largest_batch": [],
    }


def _progress_bar(total: int, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="vitkit bench", disable=None if progress else True, unit="cell")


def _group_cells(
    config: ViTConfig,
    net: VisionTransformer,
    batch: int,
    precisions: tuple[str, ...],
    device: torch.device,
    modes: tuple[str, ...],
    train: bool,
    compile: bool,
) -> list[_Cell]:
    """The cells of one resolution and batch size, every precision's, all on the same random images."""
    x = torch.randn(batch, config.in_chans, *config.image_size, device=device)
    cells: list[_Cell] = []
    for precision in precisions:
        for kind, mode in _cells_of(precision, device, modes, train, compile):
            if kind == "matmul":
                cells.append(_matmul_cell(config, precision, batch, device, mode))
            elif kind == "inference":
                cells.append(_inference_cell(net, precision, mode, x, config))
            else:
                cells.append(_train_cell(config, precision, x, compile=mode == "compiled"))
    return cells


def _measure(cells: list[_Cell], device: torch.device, rounds: int, min_seconds: float, bar: Any) -> None:
    """Each cell's warm-up (and compilation) and peak memory, then its seconds per call in each of `rounds`
    interleaved rounds (`cell.rates`)."""
    for cell in cells:
        cell.run()
        _sync(device)
        static = _state_bytes(*cell.state)  # after the first call: the packings it made are there
        if cell.kind != "matmul" and cell.mode != "compiled" and cell.precision != "int8":  # int8 is compiled
            cell.memory = _measure_memory(cell, static)
        cell.rates = []
        bar.update(1)
    for _ in range(rounds):
        for cell in cells:
            cell.rates.append(_time(cell, device, min_seconds))
            bar.update(1)


def _rows(cells: list[_Cell], size: int, batch: int) -> list[dict[str, Any]]:
    """The record's rows of one resolution and batch size, each model's FLOP/s beside the machine's matmul rate."""
    peak: dict[str, float] = {}  # the machine's matmul rate: its faster GEMM
    for c in cells:
        if c.kind == "matmul":
            peak[c.precision] = max(peak.get(c.precision, 0.0), c.flops / statistics.median(c.rates))
    return [_row(cell, size, batch, peak) for cell in cells]


def _row(cell: _Cell, size: int, batch: int, peak: dict[str, float]) -> dict[str, Any]:
    seconds = statistics.median(cell.rates)
    row: dict[str, Any] = {
        "image_size": size,
        "batch": batch,
        "precision": cell.precision,
        "kind": cell.kind,
        "mode": cell.mode,
        "gflops_per_s": cell.flops / seconds / 1e9,
        "rounds_s": cell.rates,  # seconds per call, each round
    }
    # int8 has no GEMM of its own timed beside it
    row["fraction_of_matmul"] = cell.flops / seconds / peak[cell.precision] if cell.precision in peak else None
    if cell.kind != "matmul":
        row["images_per_s"] = cell.images / seconds
        row["peak_memory_mb"] = None if cell.memory is None else cell.memory / 2**20
    return row


def largest_batches(rows: list[dict], budget_gb: float | None) -> list[dict]:
    """Largest batch within `budget_gb`, per resolution, precision, kind and mode, from a straight line through
    the peak memory measured at each batch size (memory = fixed + per_image * batch)."""
    if budget_gb is None:
        return []
    out = []
    keys = {(r["image_size"], r["precision"], r["kind"], r["mode"]) for r in rows if r.get("peak_memory_mb")}
    for key in sorted(keys):
        same = [r for r in rows if (r["image_size"], r["precision"], r["kind"], r["mode"]) == key]
        points = sorted((r["batch"], r["peak_memory_mb"]) for r in same if r.get("peak_memory_mb"))
        if len(points) < 2 or points[-1][0] == points[0][0]:
            continue
        (b0, m0), (b1, m1) = points[0], points[-1]
        per_image = max((m1 - m0) / (b1 - b0), 1e-9)
        fixed = m0 - per_image * b0
        largest = int((budget_gb * 1024 - fixed) // per_image)
        out.append(
            {
                "image_size": key[0],
                "precision": key[1],
                "kind": key[2],
                "mode": key[3],
                "largest_batch": max(largest, 0),
                "per_image_mb": per_image,
                "fixed_mb": fixed,
            }
        )
    return out


def format_bench(result: dict) -> str:
    """A table of the rows, with the machine in the header."""
    m = result["machine"]
    lines = [
        f"{result['model']} on {m['cpu']} ({m['cpu_capability']}, bf16 native: {m['bf16_native_cpu']}), "
        f"{m['threads']} threads, torch {m['torch']}, device {m['device']}; median of "
        f"{result['settings']['rounds']} interleaved rounds",
        f"{'px':>5}{'batch':>6} {'prec':<5}{'kind':<10}{'mode':<10}{'images/s':>10}{'GFLOP/s':>9}{'of matmul':>10}"
        f"{'peak MB':>9}",
    ]
    for r in result["rows"]:
        if r["kind"] == "matmul":
            lines.append(
                f"{r['image_size']:>5}{r['batch']:>6} {r['precision']:<5}{'matmul':<10}{r['mode']:<10}"
                f"{'':>10}{r['gflops_per_s']:>9.1f}{r['fraction_of_matmul']:>10.2f}"
            )
            continue
        mem = "" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        fraction = "" if r["fraction_of_matmul"] is None else f"{r['fraction_of_matmul']:.2f}"
        lines.append(
            f"{r['image_size']:>5}{r['batch']:>6} {r['precision']:<5}{r['kind']:<10}{r['mode']:<10}"
            f"{r['images_per_s']:>10.2f}{r['gflops_per_s']:>9.1f}{fraction:>10}{mem:>9}"
        )
    if any(r["precision"] == "int8" for r in result["rows"]):
        lines.append(
            "int8: vitkit.optimize's copy with vitkit's own kernels (PT2E), calibrated on the random images it times "
            "(its speed only)"
        )
    for r in result["largest_batch"]:
        lines.append(
            f"largest batch in {result['settings']['memory_budget_gb']} GB at {r['image_size']} px, "
            f"{r['precision']} {r['kind']} ({r['mode']}): {r['largest_batch']}"
        )
    return "\n".join(lines)


def bench_files(path: str | Path, overwrite: bool = False) -> tuple[Path, Path]:
    """The JSON file `path` and the plot beside it (same name, .png); a FileExistsError if either exists, unless
    `overwrite`."""
    from vitkit.files import refuse_overwrite

    path = Path(path)
    for file in (path, path.with_suffix(".png")):
        refuse_overwrite(file, overwrite)
    return path, path.with_suffix(".png")


def write_bench(result: dict, path: str | Path, overwrite: bool = False) -> tuple[Path, Path]:
    """The JSON at `path` and the Fig. 12-style plot beside it (same name, .png); existing files are refused
    unless `overwrite`."""
    from vitkit.files import atomic_write

    path, png = bench_files(path, overwrite)
    write_record(path, result)
    atomic_write(png, lambda tmp: plot_bench(result, tmp))
    return path, png


def plot_bench(result: dict, path: str | Path) -> None:
    """Fig. 12: inference images/s against resolution (a line per batch, precision and mode), and, given a memory
    budget, the largest batch in it against resolution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = result["settings"]["memory_budget_gb"]
    fig, panels = plt.subplots(1, 2 if budget else 1, figsize=(10 if budget else 5.5, 4), squeeze=False)
    axes = panels[0]
    lines: dict[tuple, list] = {}
    for r in result["rows"]:
        if r["kind"] == "inference":
            lines.setdefault((r["batch"], r["precision"], r["mode"]), []).append((r["image_size"], r["images_per_s"]))
    for (batch, precision, mode), pts in sorted(lines.items()):
        pts.sort()
        axes[0].plot(*zip(*pts), marker="o", label=f"batch {batch} {precision} {mode}")
    axes[0].set(xlabel="input size (px)", ylabel="images/s", yscale="log", title="inference throughput")
    axes[0].legend(fontsize=7)
    if budget:
        sizes: dict[tuple, list] = {}
        for r in result["largest_batch"]:
            sizes.setdefault((r["precision"], r["kind"], r["mode"]), []).append((r["image_size"], r["largest_batch"]))
        for (precision, kind, mode), pts in sorted(sizes.items()):
            pts.sort()
            axes[1].plot(*zip(*pts), marker="o", label=f"{kind} {precision} {mode}")
        axes[1].set(
            xlabel="input size (px)", ylabel="largest batch", yscale="log", title=f"largest batch in {budget} GB"
        )
        if sizes:
            axes[1].legend(fontsize=7)
    fig.suptitle(f"{result['model']} on {result['machine']['cpu_capability']}, {result['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
