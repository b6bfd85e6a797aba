"""Checkpoints written: every file atomically (temporary file in the same directory, fsync, rename, fsync of the
directory); a full disk leaves the previous file intact and says so; a killed run's files can be resumed."""

import errno
import os
from pathlib import Path

import pytest
import torch

from test_training import shapes_config
from vitkit.cli import main
from vitkit.files import atomic_write
from vitkit.runs import read_checkpoint, read_metrics
from vitkit.training import train


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

    with pytest.raises(OSError, match=r"checkpoint\.pt: writing failed \(No space left on device\); the previous "
                       r"checkpoint\.pt is intact") as caught:  # fmt: skip
        atomic_write(target, fill_the_disk)
    assert caught.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left


def test_metrics_line_cut_short_by_a_kill_is_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]


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
)  # fmt: skip  (6 steps per epoch: an evaluation and a checkpoint every 2 steps)


def _train_in_child(config, resume) -> None:
    """A forked training process (vitkit already imported: a kill cycle costs a second, not an interpreter start)."""
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

    from vitkit.recipes import TrainConfig

    fork = multiprocessing.get_context("fork")
    run_dir = tmp_path / "killed"
    config = TrainConfig(**KILL_RUN, out_dir=str(run_dir))
    checkpoint = run_dir / "checkpoint.pt"
    rng, steps, began = random.Random(0), [], time.perf_counter()
    while len(steps) < 20:
        written = checkpoint.stat().st_mtime_ns if checkpoint.exists() else 0
        child = fork.Process(target=_train_in_child, args=(config if not steps else None, run_dir if steps else None))
        child.start()
        # Kill at a random moment after this session has saved a checkpoint of its own (so every session makes
        # progress): within the next two steps, often while the next checkpoint is being written.
        while child.is_alive() and not (checkpoint.exists() and checkpoint.stat().st_mtime_ns != written):
            time.sleep(0.002)
        assert child.is_alive(), "the run finished before 20 kills: give it more steps"
        time.sleep(rng.uniform(0.0, 0.1))
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
    print(f"20 SIGKILLs at steps {steps} in {killed_seconds:.1f} s")
