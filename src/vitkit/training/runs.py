"""A run directory: what one training run leaves behind, and how it is resumed.

config.json          the resolved TrainConfig, model config, dataset and world size
metrics.jsonl        one JSON object per line: training (loss, lr, top-1/top-5, images/s) and evaluation
.lock                held (flock) by the run writing here, for its life: a second run is refused meanwhile
checkpoint.pt        resumable state (model, optimiser, step, data order, RNG), written atomically,
                     read back with `torch.load(weights_only=True)`: tensors and plain containers only
checkpoint/          instead, for FSDP runs: torch.distributed.checkpoint shards of the model and optimiser
                     (tensors only) + state.json (the rest); replaced as a whole, resumable with any number of
                     processes
model.safetensors    the final model (vitkit format, with class names); best.safetensors: best evaluation
curves.png, confusion.png, summary.json, tensorboard/ (when tensorboard is installed)

Also the two pieces of a run's bookkeeping the loop holds: `MetricsWindow` (the training lines of
metrics.jsonl) and `StopRequest` (Ctrl-C / SIGTERM end the run after the current step, with a checkpoint).
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import json
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitkit.errors import spelled
from vitkit.files import atomic_write, refuse_overwrite

from .distributed import read_sharded_state

CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint"
LOCK = ".lock"


class RunDir:
    """The files of one run. Only the main process writes (`enabled=False` elsewhere)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._tensorboard = None
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)
            for stale in self.path.glob(".*.tmp"):  # left by a write of a process that was killed
                stale.unlink(missing_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(self.path / "tensorboard"))
            except ImportError:
                self._tensorboard = None

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if self.enabled:
            text = json.dumps(data, indent=2, default=str) + "\n"
            atomic_write(self.path / name, lambda tmp: Path(tmp).write_text(text))

    def log(self, record: dict[str, Any]) -> None:
        """Append one metrics record (and mirror its numbers to TensorBoard)."""
        if not self.enabled:
            return
        with open(self.path / "metrics.jsonl", "a") as f:  # an append-only log: see truncate_metrics
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tensorboard is not None:
            prefix = record.get("split", "train")
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self._tensorboard.add_scalar(f"{prefix}/{key}", value, record["step"])

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        if self.enabled:
            atomic_write(self.path / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    CHECKPOINT,
    SHARDED_CHECKPOINT,
    "model.safetensors",
    "best.safetensors",
    "summary.json",
    "curves.png",
    "confusion.png",
)
RUN_FOLDERS = ("tensorboard", f".{SHARDED_CHECKPOINT}.old", f".{SHARDED_CHECKPOINT}.tmp")
# What a run writes before its first checkpoint: a folder holding only these never started, and is reused.
NEVER_STARTED = ("config.json", "metrics.jsonl", "tensorboard")


def claim_run_dir(path: str | os.PathLike, overwrite: bool, is_main: bool = True) -> None:
    """Make sure a new run does not write over anything in `path`: a run that saved a checkpoint or finished is
    refused, pointing to --resume; other files are refused as `files.refuse_overwrite` refuses them. With
    `overwrite`, or when the run there never reached its first checkpoint (interrupted while starting), the old
    run's files are removed first (by the main process)."""
    path = Path(path)
    _refuse_a_file(path)
    found = [name for name in (*RUN_FILES, *RUN_FOLDERS) if (path / name).exists()]
    started = [name for name in found if name not in NEVER_STARTED]
    if started and not overwrite:
        where = "a finished run" if "model.safetensors" in found else "a run"
        if CHECKPOINT in found:
            try:
                state = torch.load(path / CHECKPOINT, map_location="cpu", weights_only=True)
                where = f"{where} (step {state['step']} of {state['total_steps']} saved)"
            except Exception:  # an unreadable checkpoint: the refusal stands, without the step
                pass
        raise FileExistsError(
            f"{path} already holds {where}: continue it with `vitkit train --resume {path}`, or pass --overwrite "
            "to replace it, or choose another --out-dir."
        )
    ours = (*found, LOCK)  # and beside a run's files, the .tmp files of its killed writes
    entries = list(path.iterdir()) if path.is_dir() else []
    if [p for p in entries if p.name not in ours and not (found and p.name.endswith(".tmp"))]:
        refuse_overwrite(path, overwrite)
    if is_main:
        for name in found:
            if (path / name).is_dir():  # tensorboard/, an FSDP run's checkpoint/
                shutil.rmtree(path / name)
            else:
                (path / name).unlink()


def _refuse_a_file(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file: a run directory is a folder; choose another --out-dir.")


_HELD_LOCKS: set[int] = set()  # the file descriptors of the RunLocks this process holds


def _close_inherited_locks() -> None:
    # In a forked child (a DataLoader worker): the lock is the run's, and must end with its process, not live on
    # in a child until the child notices that its parent was killed.
    for fd in _HELD_LOCKS:
        os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class RunLock:
    """`with RunLock(path):` one run at a time in a run directory. An advisory lock (`flock`) on PATH/.lock, taken
    before anything there is read or written and held until the run ends; a second run meanwhile is refused
    (FileExistsError). The kernel releases the lock when the process ends, however it ends: a killed run leaves
    nothing stuck. A run that wrote nothing (refused, or stopped while starting) leaves no lock file behind, nor a
    folder made for it. Only the main process of a torchrun world locks (`enabled=False` elsewhere); a resumed run
    locks an existing folder."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True, resuming: bool = False):
        self.path, self.enabled, self.resuming = Path(path), enabled, resuming
        self._fd: int | None = None
        self._made_folders: list[Path] = []  # PATH and its parents that were made for the lock, deepest first
        self._made_lock = False  # PATH/.lock was not there before
        self._entries: list[str] = []  # what PATH held when locked

    def __enter__(self) -> RunLock:
        if not self.enabled or (self.resuming and not self.path.is_dir()):  # read_checkpoint says what is missing
            return self
        while self._fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 20, 0).decode(errors="replace").strip()
                os.close(fd)
                raise FileExistsError(self._in_use(holder)) from None
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(self.path / LOCK))
            except FileNotFoundError:
                current = False
            if current:
                self._fd = fd
            else:  # the run that held it removed the file on leaving (`__exit__`): lock the one there now
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())  # for the message of a run refused meanwhile
        _HELD_LOCKS.add(self._fd)
        self._entries = sorted(os.listdir(self.path))
        return self

    def _open(self) -> int:
        """A descriptor of PATH/.lock, made (with its folder) where missing."""
        _refuse_a_file(self.path)
        missing = [folder for folder in (self.path, *self.path.parents) if not folder.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._made_lock = not (self.path / LOCK).exists()
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            reason, out_dir = os.strerror(e.errno).lower(), spelled("out_dir", "--out-dir")
            fix = "make it writable to resume the run" if self.resuming else f"choose a writable {out_dir}"
            raise PermissionError(f"cannot write the run directory {self.path}: {reason}; {fix}.") from None
        self._made_folders = self._made_folders or missing
        return fd

    def _in_use(self, holder: str) -> str:
        by = f" (process {holder})" if holder.isdigit() else ""
        other = "" if self.resuming else f", or choose another {spelled('out_dir', '--out-dir')}"
        return f"{self.path} is in use by another run{by}: wait for it to end{other}."

    def __exit__(self, *exc) -> None:
        if self._fd not in _HELD_LOCKS:  # not locked, or inherited by a forked child
            return
        try:
            if self._made_lock and sorted(os.listdir(self.path)) == self._entries:  # the run wrote nothing
                (self.path / LOCK).unlink()  # while still locked: a run about to lock this file locks a new one
                for folder in self._made_folders:
                    folder.rmdir()
        except OSError:  # a folder someone else has written in meanwhile stays
            pass
        finally:
            _HELD_LOCKS.discard(self._fd)
            os.close(self._fd)  # releases the lock
            self._fd = None


def read_checkpoint(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The resumable state of a run directory, loaded without unpickling arbitrary objects. For a sharded
    checkpoint: its JSON state, with "sharded" = the directory that `distributed.load_sharded` reads."""
    # .checkpoint.old: the previous one, when a save was interrupted between its two renames
    for sharded in (Path(run_dir) / SHARDED_CHECKPOINT, Path(run_dir) / f".{SHARDED_CHECKPOINT}.old"):
        if (sharded / "state.json").is_file():
            return {**read_sharded_state(sharded), "sharded": str(sharded)}
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no resumable checkpoint. --resume takes a run directory written by `vitkit train`."
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def stopped_at_once(run_dir: str | os.PathLike) -> str:
    """What a run stopped at once (a second Ctrl-C) leaves in `run_dir`, and how to go on from it."""
    try:
        step = read_checkpoint(run_dir)["step"]
    except Exception:  # none, or unreadable: nothing to resume either way
        step = None
    if step is not None:
        resume = f"`vitkit train --resume {run_dir}`"
        return f"stopped at once; {run_dir} keeps the checkpoint of step {step}: continue with {resume}"
    if Path(run_dir).is_dir():
        again = f"the same command starts the run afresh in {run_dir}"
        return f"stopped at once, before the first checkpoint: nothing to resume; {again}"
    return "stopped before the run started; nothing was written"


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; a last line cut short by a killed process is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    lines = [line for line in text.split("\n") if line.strip()]
    if lines and not text.endswith("\n"):
        lines.pop()  # written in part: its record is after the last checkpoint anyway
    return [json.loads(line) for line in lines]


def truncate_metrics(run_dir: str | os.PathLike, step: int) -> None:
    """Drop records written after `step` (logged after the last checkpoint by a run that was then killed)."""
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        kept = "".join(json.dumps(r) + "\n" for r in read_metrics(run_dir) if r["step"] <= step)
        atomic_write(path, lambda tmp: Path(tmp).write_text(kept))


def default_run_dir(data: str) -> Path:
    return Path("runs") / f"{data}-{time.strftime('%Y%m%d-%H%M%S')}"


def plot_run(run_dir: str | os.PathLike, confusion: torch.Tensor | None, classes: list[str]) -> None:
    """curves.png (loss, learning rate, accuracy against steps) and confusion.png, with matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("split") == "train"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train])
    axes[2].plot([r["step"] for r in train], [r["top1"] for r in train], label="train top-1")
    for split, style in (("val", "o-"), ("test", "*")):  # val as the run went, test once at its end
        evals = [r for r in records if r.get("split") == split]
        axes[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], style, label=split, markersize=9)
        axes[2].plot([r["step"] for r in evals], [r["top1"] for r in evals], style, label=f"{split} top-1")
    for ax, title in zip(axes, ("loss", "learning rate", "accuracy")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    axes[2].legend()
    fig.tight_layout()
    atomic_write(Path(run_dir) / "curves.png", lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    if confusion is None:
        return
    k = len(classes)
    fig, ax = plt.subplots(figsize=(min(2 + 0.5 * k, 20), min(2 + 0.5 * k, 20)))
    rates = confusion.float() / confusion.sum(1, keepdim=True).clamp(min=1)
    ax.imshow(rates.numpy(), cmap="Blues", vmin=0, vmax=1)
    if k <= 30:
        ax.set_xticks(range(k), classes, rotation=90)
        ax.set_yticks(range(k), classes)
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(j, i, str(int(confusion[i, j])), ha="center", va="center", fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion matrix (test)")
    fig.tight_layout()
    atomic_write(Path(run_dir) / "confusion.png", lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)


@dataclass
class MetricsWindow:
    """Training loss and accuracy summed since the last metrics record, and the seconds spent in those steps."""

    loss: float = 0.0  # summed over images
    top1: int = 0
    top5: int = 0
    count: int = 0  # images
    steps: int = 0
    seconds: float = 0.0

    @torch.no_grad()
    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One micro-batch: its mean loss and its logits (B, K) against the true labels (B,)."""
        self.loss += float(loss) * len(labels)
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        self.top1 += int((top5[:, 0] == labels).sum())
        self.top5 += int((top5 == labels[:, None]).any(1).sum())
        self.count += len(labels)

    def add_step(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds

    def flush(self, step: int, epoch: float, lr: float, batch_size: int) -> dict:
        """The metrics.jsonl record of the window (on this process's images); the window starts again empty."""
        n = max(self.count, 1)
        record = {
            "split": "train",
            "step": step,
            "epoch": epoch,
            "lr": lr,
            "loss": self.loss / n,
            "top1": self.top1 / n,
            "top5": self.top5 / n,
            "images_per_s": self.steps * batch_size / max(self.seconds, 1e-9),
        }
        self.loss, self.top1, self.top5, self.count, self.steps, self.seconds = 0.0, 0, 0, 0, 0, 0.0
        return record


def _deliver_sigint_again() -> None:
    time.sleep(0.01)
    _thread.interrupt_main(signal.SIGINT)


class StopRequest:
    """Ctrl-C / SIGTERM during a run. Before its steps begin (start-up, data loading) the run stops at once, having
    saved nothing; once they run, it stops after the current step, with a checkpoint (`requested`); a second
    signal stops it at once. Each signal is acknowledged on stderr as it arrives, with `notice` saying when the
    run will stop (the loop keeps it current: the first step compiles the model, which can take a while)."""

    def __init__(self) -> None:
        self.requested = False
        self.stepping = False  # the training steps have begun: a first signal waits for the current one
        self.notice = "stopping after the current step, with a checkpoint"
        self._previous: dict[int, Any] = {}
        self._previous_hook: Any = None
        self._pid = os.getpid()

    def __enter__(self) -> StopRequest:
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: the run's own process decides, and stops it
            return
        if self.requested or not self.stepping:
            # Interrupted while torch.compile traces the backward pass (the first step), the autograd engine warns
            # with the traced forward's stack ("Error detected in ...Backward"): the tracer's bookkeeping, not news.
            warnings.filterwarnings("ignore", message="Error detected in ")
            raise KeyboardInterrupt
        self.requested = True
        again = "press Ctrl-C again" if signum == signal.SIGINT else "signal again"
        # os.write, not print: the handler may run inside a print to the same stream.
        os.write(2, f"\nvitkit: {self.notice}; {again} to stop at once, without saving\n".encode())

    def _unraisable(self, unraisable: Any) -> None:
        # A KeyboardInterrupt that the handler raises inside a finalizer or a weakref callback (torch.compile runs
        # many) is printed and dropped by Python: the signal is delivered again, a moment later and from another
        # thread, so that it lands in the main thread's next instructions rather than in this hook.
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and os.getpid() == self._pid:
            _thread.start_new_thread(_deliver_sigint_again, ())  # not threading.Thread: its start() waits
            return
        self._previous_hook(unraisable)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous_hook is not None:
            sys.unraisablehook, self._previous_hook = self._previous_hook, None
