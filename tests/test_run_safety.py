"""Checkpoints written: every file atomically (temporary file in the same directory, fsync, rename, fsync of the
directory); a full disk leaves the previous file intact and says so; a killed run's files can be resumed."""

import errno
import os
from pathlib import Path

import pytest
import torch

from helpers import SMALL_ENCODER as TINY
from helpers import shapes_config
from vitkit.cli.parser import main
from vitkit.files import atomic_write
from vitkit.formats.checkpoints import load_checkpoint
from vitkit.training.loop import train
from vitkit.training.runs import read_checkpoint, read_metrics


def test_atomic_write_fsyncs_the_file_renames_then_fsyncs_the_directory(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        assert Path(src).parent == Path(dst).parent  # the temporary file sits beside the target
        events.append(("rename", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(tmp_path / "out.bin", lambda tmp: Path(tmp).write_bytes(b"new"))
    assert [e[0] for e in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith(".out.bin.") and events[0][1].endswith(".tmp")
    assert events[1][1] == "out.bin" and events[2][1] == tmp_path.name
    assert (tmp_path / "out.bin").read_bytes() == b"new"


def test_disk_full_while_writing_leaves_the_previous_file_intact_and_says_so(tmp_path):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"previous")

    def fill_the_disk(tmp):
        Path(tmp).write_bytes(b"half of the new")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(
        OSError,
        match=r"checkpoint\.pt: writing failed \(No space left on device\); the previous "
        r"checkpoint\.pt is intact",
    ) as caught:
        atomic_write(target, fill_the_disk)
    assert caught.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left


def test_metrics_line_cut_short_by_a_kill_is_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]


@pytest.mark.slow
def test_disk_full_during_a_training_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    stopped = train(shapes_config(tmp_path / "run", steps=8), stop_after=3)
    assert stopped.interrupted and read_checkpoint(tmp_path / "run")["step"] == 3
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith(".tmp") and ".checkpoint.pt." in str(f):
            with open(f, "wb") as out:
                out.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    assert main(["train", "--resume", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vitkit train: error: ") and "No space left on device" in err[-1]
    assert "the previous checkpoint.pt is intact" in err[-1]
    assert read_checkpoint(tmp_path / "run")["step"] == 3


KILL_RUN = dict(
    data="shapes",
    data_args={"size": 48, "image_size": 16},
    model="ViT-Ti/8",
    model_args={"hidden_size": 16, "num_layers": 2, "mlp_dim": 32, "num_heads": 2, "drop_path_rate": 0.1},
    batch_size=8,
    steps=240,
    eval_every=0.34,
    log_every=1,
    crop_scale=(0.3, 1.0),
    threads=1,
)  # 6 steps per epoch: an evaluation and a checkpoint every 2 steps


def _train_in_child(config, resume) -> None:
    """A forked training process (vitkit already imported: a kill cycle costs a second, not an interpreter start)."""
    import threading

    from tqdm import tqdm

    # tqdm's default write lock holds a multiprocessing lock that forked processes share: a child killed while it
    # holds it (creating or writing a progress bar) would leave the next child, and the parent's bars, waiting for
    # ever (a CI run hung so). Each child takes a lock of its own.
    tqdm.set_lock(threading.RLock())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    train(config) if resume is None else train(resume=resume)


@pytest.mark.slow
def test_sigkill_at_random_moments_always_leaves_a_loadable_checkpoint_and_resume_reaches_the_same_weights(tmp_path):
    import multiprocessing
    import random
    import signal
    import time

    from safetensors.torch import load_file

    from vitkit.training.recipes import TrainConfig

    fork = multiprocessing.get_context("fork")
    run_dir = tmp_path / "killed"
    config = TrainConfig(**KILL_RUN, out_dir=str(run_dir))
    train(config.replace(out_dir=str(tmp_path / "warm"), steps=2))  # what a run imports, the children inherit
    checkpoint = run_dir / "checkpoint.pt"
    rng, steps, mid_write, began = random.Random(0), [], 0, time.perf_counter()
    while len(steps) < 20:
        written = checkpoint.stat().st_mtime_ns if checkpoint.exists() else 0
        child = fork.Process(target=_train_in_child, args=(config if not steps else None, run_dir if steps else None))
        child.start()
        # Kill at a random moment after this session has saved a checkpoint of its own (so every session makes
        # progress), counted in steps so that it does not depend on the machine's speed: right after that
        # checkpoint, or after the next step, or (every third time) as soon as the next checkpoint's temporary
        # file appears, in the middle of writing it.
        while child.is_alive() and not (checkpoint.exists() and checkpoint.stat().st_mtime_ns != written):
            time.sleep(0.001)
        assert child.is_alive(), "the run finished before 20 kills: give it more steps"
        if len(steps) % 3 == 2:
            deadline = time.perf_counter() + 5.0
            while not list(run_dir.glob(".checkpoint.pt.*.tmp")) and time.perf_counter() < deadline:
                time.sleep(0.0002)
            mid_write += bool(list(run_dir.glob(".checkpoint.pt.*.tmp")))
        elif rng.random() < 0.5:
            target = read_checkpoint(run_dir)["step"] + 1
            while child.is_alive() and not any(r["step"] >= target for r in read_metrics(run_dir)):
                time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.005))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        steps.append(read_checkpoint(run_dir)["step"])  # loadable, after every kill
    killed_seconds = time.perf_counter() - began
    child = fork.Process(target=_train_in_child, args=(config, run_dir))
    child.start()
    child.join()
    assert child.exitcode == 0
    assert steps == sorted(steps) and steps[-1] < KILL_RUN["steps"]
    assert not list(run_dir.glob(".*.tmp"))  # temporary files of killed writes are cleared when the run resumes

    train(config.replace(out_dir=str(tmp_path / "whole")))
    killed, whole = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("killed", "whole"))
    assert killed.keys() == whole.keys() and all(torch.equal(killed[k], whole[k]) for k in killed)
    train_steps = [r["step"] for r in read_metrics(run_dir) if r["split"] == "train"]
    assert train_steps == list(range(1, KILL_RUN["steps"] + 1))  # every step logged once, none twice
    print(f"20 SIGKILLs ({mid_write} while a checkpoint was being written) at steps {steps} in {killed_seconds:.1f} s")


# --- run directories, numerics, determinism ------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_directory_holding_a_run_is_never_overwritten(tmp_path, capsys):
    stopped = train(shapes_config(tmp_path / "run", steps=6), stop_after=2)
    assert stopped.interrupted
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    with pytest.raises(
        FileExistsError,
        match=r"run already holds a run \(step 2 of 6 saved\): continue it with "
        r"`vitkit train --resume .*run`, or pass --overwrite",
    ):
        train(shapes_config(tmp_path / "run", steps=6))
    status = main(["train", "--data", "shapes", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "--resume" in err
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before  # untouched

    again = train(shapes_config(tmp_path / "run", steps=3, overwrite=True))
    assert again.step == 3 and not again.interrupted
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"] == [1, 2, 3]  # only the new
    with pytest.raises(FileExistsError, match=r"already holds a finished run"):
        train(shapes_config(tmp_path / "run", steps=3))


HOLD_RUN_LOCK = """
import os, sys, time
from vitkit.training.runs import RunLock

with RunLock(sys.argv[1]):
    worker = os.fork()  # a child that outlives its killed parent for a while, as a DataLoader worker does
    if worker == 0:
        time.sleep(60)
        os._exit(0)
    print(worker, flush=True)
    time.sleep(60)
"""


@pytest.mark.slow
def test_a_run_folder_held_by_a_live_run_refuses_a_new_resumed_or_overwriting_run_until_the_holder_is_killed(
    tmp_path, capsys
):
    import contextlib
    import signal
    import subprocess
    import sys

    from helpers import subprocess_env

    run = tmp_path / "run"
    argv = [sys.executable, "-c", HOLD_RUN_LOCK, str(run)]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert holder.stdout is not None
    worker = int(holder.stdout.readline())
    try:
        (run / "checkpoint.pt").write_bytes(b"the holder's")
        in_use = f"vitkit train: error: {run} is in use by another run (process {holder.pid}): wait for it to end"
        assert main(train_args(tmp_path, steps=1)) == 2
        assert capsys.readouterr().err == f"{in_use}, or choose another --out-dir.\n"
        assert main([*train_args(tmp_path, steps=1), "--overwrite"]) == 2
        assert capsys.readouterr().err == f"{in_use}, or choose another --out-dir.\n"
        assert main(["train", "--resume", str(run)]) == 2
        assert capsys.readouterr().err == f"{in_use}.\n"
        assert (run / "checkpoint.pt").read_bytes() == b"the holder's"  # --overwrite cleared nothing

        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(worker, 0)  # the forked child still lives, and does not keep the folder locked
        assert main([*train_args(tmp_path, steps=1), "--overwrite"]) == 0
        assert read_metrics(run)[-1]["step"] == 1
    finally:
        holder.kill()
        holder.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("made, code, reason", [(False, errno.EROFS, "read-only file system"),
                                                (True, errno.EACCES, "permission denied")])  # fmt: skip
def test_an_unwritable_out_dir_is_one_line_naming_it_with_exit_status_2(tmp_path, capsys, monkeypatch, made, code,
                                                                        reason):  # fmt: skip
    # A read-only mount, simulated: the tests run as root, whom chmod does not stop.
    mount, write = tmp_path / "mount", os.O_WRONLY | os.O_RDWR | os.O_CREAT
    run = mount / "run"
    mount.mkdir()
    if made:
        run.mkdir()
    real_mkdir, real_open = os.mkdir, os.open

    def mkdir(path, *args, **kwargs):
        if Path(path).is_relative_to(mount) and not Path(path).exists():
            raise OSError(code, os.strerror(code), str(path))
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if Path(path).is_relative_to(mount) and flags & write:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    assert main(train_args(mount, steps=1)) == 2
    err = capsys.readouterr().err
    assert err == f"vitkit train: error: cannot write the run directory {run}: {reason}; choose a writable --out-dir.\n"
    assert list(mount.iterdir()) == ([run] if made else []) and not (run / ".lock").exists()


@pytest.fixture
def nan_at_step_5(monkeypatch):
    """The input of step 5 becomes NaN (so its loss and gradients are)."""
    from vitkit.training import loop as training

    real, calls = training.train_batch, {"n": 0}

    def poisoned(*args, **kwargs):
        x, targets = real(*args, **kwargs)
        calls["n"] += 1
        return (torch.full_like(x, float("nan")) if calls["n"] == 5 else x), targets

    monkeypatch.setattr(training, "train_batch", poisoned)


def test_a_nan_loss_stops_the_run_at_its_step_and_the_last_good_checkpoint_stays_newest(tmp_path, nan_at_step_5):
    from vitkit.errors import NonFiniteError

    config = shapes_config(tmp_path / "run", steps=8, eval_every=0.34)  # 6 steps per epoch: a checkpoint every 2
    with pytest.raises(
        NonFiniteError,
        match=r"step 5: non-finite loss \(loss nan, .*newest checkpoint, step 4, is "
        r"the last good state: continue with `vitkit train --resume",
    ):
        train(config)
    state = read_checkpoint(tmp_path / "run")
    assert state["step"] == 4 and all(torch.isfinite(t).all() for t in state["model"].values())
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_the_nonfinite_error_says_what_was_met_and_how_to_go_on_with_or_without_a_checkpoint():
    from types import SimpleNamespace

    from vitkit.training.loop import nonfinite_error

    state = SimpleNamespace(step=3, saved_step=None, run=SimpleNamespace(path=Path("runs/x")))
    message = str(nonfinite_error(state, torch.tensor(1.5), torch.tensor(float("inf"))))
    assert message.startswith("step 3: non-finite gradient (loss 1.5, gradient norm inf); the run stopped")
    assert "No checkpoint was saved yet: start again with a lower --lr, or pass --nonfinite skip" in message
    state.saved_step = 2
    message = str(nonfinite_error(state, torch.tensor(float("nan")), torch.tensor(float("nan"))))
    assert "non-finite loss (loss nan" in message
    assert "step 2, is the last good state: continue with `vitkit train --resume runs/x` with a lower --lr" in message


@pytest.mark.slow
def test_nonfinite_skip_skips_the_step_and_counts_it(tmp_path, nan_at_step_5):
    import json

    result = train(shapes_config(tmp_path / "run", steps=8, nonfinite="skip"))
    assert result.step == 8 and result.skipped_steps == 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_steps"] == 1
    model = load_checkpoint(tmp_path / "run" / "model.safetensors")  # finite, or load_checkpoint would refuse it
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.fixture
def poisoned_step_5(request, monkeypatch):
    """Step 5 goes wrong as `request.param` says. "inf loss": its loss is multiplied by infinity (an Inf, not a NaN).
    "inf gradient": its loss stays finite, but one weight's gradient (one value of blocks.0.mlp.fc1.weight) is
    made infinite on the way back, as an overflow in one layer's backward pass would make it."""
    from vitkit.models.vit import VisionTransformer

    calls = {"n": 0}
    if request.param == "inf loss":
        real = torch.nn.functional.cross_entropy

        def cross_entropy(*args, **kwargs):
            loss = real(*args, **kwargs)
            calls["n"] += torch.is_grad_enabled()  # training steps only, not evaluations
            return loss * float("inf") if calls["n"] == 5 and torch.is_grad_enabled() else loss

        monkeypatch.setattr(torch.nn.functional, "cross_entropy", cross_entropy)
        yield
        return

    def infinite_value(grad):
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    def on_forward(module, inputs, output):
        if isinstance(module, VisionTransformer) and module.training and torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 5:
                hooks.append(module.blocks[0].mlp.fc1.weight.register_hook(infinite_value))
            elif len(hooks) > 1:  # step 6 on: gradients are as computed again
                hooks.pop().remove()

    hooks = [torch.nn.modules.module.register_module_forward_hook(on_forward)]
    yield
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize(
    "poisoned_step_5, message",
    [
        ("inf loss", r"non-finite loss \(loss inf,"),
        ("inf gradient", r"non-finite gradient \(loss \d[\d.]*, gradient norm inf\)"),
    ],
    indirect=["poisoned_step_5"],
)
def test_an_inf_loss_or_an_inf_gradient_of_a_finite_loss_stops_the_run_at_its_step(tmp_path, poisoned_step_5, message):
    from vitkit.errors import NonFiniteError

    config = shapes_config(tmp_path / "run", steps=8, eval_every=0.34)  # 6 steps per epoch: a checkpoint every 2
    with pytest.raises(NonFiniteError, match=rf"step 5: {message}.*newest checkpoint, step 4, is the last good"):
        train(config)
    state = read_checkpoint(tmp_path / "run")
    assert state["step"] == 4 and all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.slow
@pytest.mark.parametrize("poisoned_step_5", ["inf gradient"], indirect=True)
def test_nonfinite_skip_skips_a_step_whose_gradient_alone_is_infinite_and_counts_it(tmp_path, poisoned_step_5):
    result = train(shapes_config(tmp_path / "run", steps=8, nonfinite="skip"))
    assert result.step == 8 and result.skipped_steps == 1
    model = load_checkpoint(tmp_path / "run" / "model.safetensors")  # finite: the infinite update was not applied
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_same_seed_and_config_on_cpu_give_the_same_metrics_byte_for_byte_apart_from_timing(tmp_path):
    import re

    for name in ("a", "b"):
        train(shapes_config(tmp_path / name, steps=6, eval_every=0.34, model_args={**TINY, "drop_path_rate": 0.1}))
    timing = re.compile(r', "images_per_s": [0-9.e+-]+')  # the one timing field of metrics.jsonl
    a, b = ((tmp_path / name / "metrics.jsonl").read_text() for name in ("a", "b"))
    assert timing.sub("", a) == timing.sub("", b) and len(a.splitlines()) == 6 + 3 + 1  # 3 val, 1 test
    assert "images_per_s" in a and timing.sub("", a) != a


# --- a long run ---------------------------------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def children() -> list[int]:
    """Live processes whose parent is this one."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                out.append(int(entry))
    return out


@pytest.mark.slow
def test_soak_many_short_epochs_keep_memory_flat_and_leave_nothing_behind(tmp_path):
    import threading
    import time

    spec = dict(steps=None, epochs=16, eval_every=1, workers=2, log_every=3)  # evaluation + checkpoint every epoch
    train(shapes_config(tmp_path / "warm", **{**spec, "epochs": 1}))  # thread pools, lazy imports
    fds, threads = len(os.listdir("/proc/self/fd")), set(threading.enumerate())
    samples, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(rss_mb())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    result = train(shapes_config(tmp_path / "soak", **spec))
    done.set()
    sampler.join()
    assert result.step == 16 * 6 and len(read_metrics(tmp_path / "soak")) == 16 * 2 + 16 + 1  # + the one test
    quarter = len(samples) // 4
    early, late = sorted(samples[quarter : 2 * quarter]), sorted(samples[3 * quarter :])
    growth = late[len(late) // 2] - early[len(early) // 2]
    print(
        f"soak: {len(samples)} RSS samples, median {early[len(early) // 2]:.0f} MB in the 2nd quarter, "
        f"{late[len(late) // 2]:.0f} MB in the 4th: growth {growth:+.1f} MB"
    )
    assert growth < 20
    assert len(os.listdir("/proc/self/fd")) <= fds  # no file left open
    # No thread left running: compared as sets, since a thread of an earlier test (tqdm's monitor, a server)
    # may end during the soak, which a count would read as a leak.
    assert set(threading.enumerate()) <= threads
    assert children() == []  # no DataLoader worker left behind


# --- signals sent to a real `vitkit train` process --------------------------------------------------------------

# `vitkit train` (cli.main) in a child process that prints a marker as it enters each phase a signal is sent in, and
# pauses there for half a second, so that signals land inside the phase: start-up, data loading, and each step
# (with --compile true, step 1 compiles the model).
SIGNALLED_TRAIN = """
import sys, time
from vitkit.cli import parser as cli
from vitkit.training import loop as training

def marked(name, function):
    def wrapper(*args, **kwargs):
        print(name, flush=True)
        time.sleep(0.5)
        return function(*args, **kwargs)
    return wrapper

training.init_world = marked("start-up", training.init_world)
training.load_datasets = marked("data", training.load_datasets)
step = training.train_step
training.train_step = lambda state, batches: marked(f"step {state.step + 1}", step)(state, batches)
sys.exit(cli.main(sys.argv[1:]))
"""


def signalled_train(tmp_path, phase: str, signals: list, compile=False, steps=200, delay=0.2, workers=0):
    """Run a tiny `vitkit train` into tmp_path/run, send `signals` (0.1 s apart) to its process group (as a terminal
    sends Ctrl-C) `delay` seconds after it prints `phase`; returns (exit status, stderr, seconds from the first
    signal to its acknowledgement on stderr, or None)."""
    import subprocess
    import sys
    import time

    from helpers import subprocess_env

    argv = [sys.executable, "-c", SIGNALLED_TRAIN, *train_args(tmp_path, compile, steps), "--workers", str(workers)]
    err_path = tmp_path / f"stderr-{phase.replace(' ', '')}-{len(signals)}.txt"
    with open(err_path, "w") as err:
        # A cache of its own: compiled from a warm cache, the first step can be over before the signals arrive.
        env = {**subprocess_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                 start_new_session=True)  # fmt: skip
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == phase:
                break
        else:
            raise AssertionError(f"the run ended before {phase!r}: {err_path.read_text()[-2000:]}")
        time.sleep(delay)
        noticed = None
        for n, sig in enumerate(signals):
            os.killpg(child.pid, sig)
            sent = time.perf_counter()
            while n == 0 and time.perf_counter() - sent < 2 and child.poll() is None:
                if "vitkit: stopping" in err_path.read_text():
                    noticed = time.perf_counter() - sent
                    break
                time.sleep(0.01)
            time.sleep(0.1)
        child.stdout.read()
        status = child.wait(timeout=300)
    return status, err_path.read_text(), noticed


def train_args(tmp_path, compile: bool = False, steps: int = 200) -> list[str]:
    return ["train", "--data", "shapes", "--data-args", '{"size": 48, "image_size": 16}', "--model", "ViT-Ti/8",
            "--model-args", '{"hidden_size": 16, "num_layers": 2, "mlp_dim": 32, "num_heads": 2}', "--batch-size",
            "8", "--steps", str(steps), "--eval-every", "0", "--threads", "1", "--precision", "fp32", "--compile",
            str(compile).lower(), "--out-dir", str(tmp_path / "run")]  # fmt: skip


def assert_clean_stop(status: int, err: str) -> None:
    import re

    assert status == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    torch_log = re.compile(r"[WI]\d{4} ")  # a warning torch logs itself (while compiling)
    assert all(line.startswith("vitkit") or torch_log.match(line) for line in err.splitlines() if line), err


def assert_reused_without_overwrite(tmp_path) -> None:
    """The folder left is recognised as never started: the same command (shortened) runs in it to the end."""
    assert main(train_args(tmp_path, steps=2)) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("phase, sig", [("start-up", "SIGINT"), ("start-up", "SIGTERM"), ("data", "SIGINT"),
                                        ("data", "SIGTERM")])  # fmt: skip
def test_a_signal_before_the_first_step_stops_at_once_leaving_a_folder_the_same_command_reuses(tmp_path, phase, sig):
    import signal

    status, err, _ = signalled_train(tmp_path, phase, [getattr(signal, sig)])
    assert_clean_stop(status, err)
    assert "stopped before the run started; nothing was written" in err or "the same command starts the run" in err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    assert_reused_without_overwrite(tmp_path)


@pytest.mark.slow
def test_ctrl_c_during_the_steps_stops_after_the_step_with_a_checkpoint_and_twice_stops_at_once(tmp_path):
    import signal

    status, err, noticed = signalled_train(tmp_path, "step 5", [signal.SIGINT], workers=2)
    assert_clean_stop(status, err)
    assert noticed is not None and noticed < 1.0, err
    # Once: the DataLoader workers, forked with the handler, leave the signal to the run's own process.
    assert err.count("vitkit: stopping after the current step, with a checkpoint; press Ctrl-C again to stop") == 1
    step = read_checkpoint(tmp_path / "run")["step"]
    assert step >= 5
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", str(step + 2)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"][-1] == step + 2

    other = tmp_path / "twice"
    other.mkdir()
    status, err, _ = signalled_train(other, "step 5", [signal.SIGINT, signal.SIGINT])  # both within step 5
    assert_clean_stop(status, err)
    assert "stopped at once, before the first checkpoint: nothing to resume" in err, err
    assert not (other / "run" / "checkpoint.pt").exists()
    assert_reused_without_overwrite(other)


@pytest.mark.slow
def test_ctrl_c_during_compilation_is_acknowledged_at_once_and_twice_stops_it_leaving_a_reusable_folder(tmp_path):
    import signal

    from vitkit.speed.machine import compiler_present

    if not compiler_present(torch.device("cpu")):
        pytest.skip("torch.compile on a CPU needs a C++ compiler and Python's C headers (python3-dev)")
    # 2 s into step 1: inside the compilation, which takes longer than that even from a warm cache
    status, err, noticed = signalled_train(tmp_path, "step 1", [signal.SIGINT, signal.SIGINT], compile=True, delay=2)
    assert_clean_stop(status, err)
    assert noticed is not None and noticed < 1.0, err
    assert "stopping after step 1, once the model has compiled" in err
    assert "stopped at once, before the first checkpoint" in err
    assert_reused_without_overwrite(tmp_path)
    once = tmp_path / "once"
    once.mkdir()
    status, err, noticed = signalled_train(once, "step 1", [signal.SIGINT], compile=True, delay=2)
    assert_clean_stop(status, err)
    assert read_checkpoint(once / "run")["step"] == 1  # the compile finished, step 1 ran and was saved


def test_a_ctrl_c_that_python_drops_inside_a_finalizer_still_stops_the_run(capsys):
    """A signal's handler runs wherever the main thread is; in a finalizer or a weakref callback (torch.compile runs
    many), Python prints the KeyboardInterrupt it raises and drops it. The run still stops, and prints nothing."""
    import sys
    import time

    from vitkit.training.runs import StopRequest

    class Finalized:
        def __del__(self):
            raise KeyboardInterrupt  # what the handler raises for a second Ctrl-C that lands here

    stopped = False
    with StopRequest() as stop:
        stop.stepping = stop.requested = True  # a first Ctrl-C came during the steps
        try:
            Finalized()  # finalized at once; Python drops what it raised
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the signal, delivered again, lands here
                time.sleep(0.001)
        except KeyboardInterrupt:
            stopped = True
    assert stopped
    assert capsys.readouterr().err == ""
    assert sys.unraisablehook != stop._unraisable  # Python's hook again after the run


def test_a_ctrl_c_that_an_import_wrapped_on_its_way_up_is_still_one_line(monkeypatch, capsys):
    """Python 3.11 wraps what a class body's `__set_name__` raises in a RuntimeError; torch imports its compiler
    lazily in such a body, so a Ctrl-C then can reach the command as a RuntimeError from a KeyboardInterrupt."""
    from vitkit.cli import commands

    def interrupted_import(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from e

    monkeypatch.setattr(commands, "cmd_models", interrupted_import)
    assert main(["models"]) == 130
    assert capsys.readouterr().err == "vitkit models: stopped (Ctrl-C)\n"

    def interrupted(args):  # a plain Ctrl-C, which carries no message of its own
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_models", interrupted)
    assert main(["models"]) == 130
    assert capsys.readouterr().err == "vitkit models: stopped (Ctrl-C)\n"

    def failing(args):
        raise RuntimeError("a failure of its own")

    monkeypatch.setattr(commands, "cmd_models", failing)
    with pytest.raises(RuntimeError, match="a failure of its own"):  # other RuntimeErrors are not Ctrl-C
        main(["models"])


CTRL_C_AS_IN_A_TERMINAL = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
print("ready", file=sys.stderr, flush=True)
sys.argv = ["vitkit", *sys.argv[1:]]
runpy.run_module("vitkit", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.1, 1.0])
def test_ctrl_c_while_the_command_loads_its_modules_is_one_line_without_a_traceback(delay):
    import signal
    import subprocess
    import sys
    import time

    from helpers import subprocess_env

    # `python -m vitkit models` with Ctrl-C raising KeyboardInterrupt, as in a terminal, also where this test runs
    # as a background job (whose children start with SIGINT ignored, which Python then leaves as it is).
    argv = [sys.executable, "-c", CTRL_C_AS_IN_A_TERMINAL, "models"]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                             start_new_session=True)  # fmt: skip
    assert child.stderr is not None
    assert child.stderr.readline() == "ready\n"  # the interpreter has started: how long that takes varies
    time.sleep(delay)  # torch takes seconds to import
    os.killpg(child.pid, signal.SIGINT)
    err = child.stderr.read()
    status = child.wait(timeout=60)
    assert status in (130, -signal.SIGINT), err  # exited with 130, or by the signal after its line
    assert err.count("\n") == 1 and err.startswith("vitkit"), err
