"""Checkpoints written: every file atomically (temporary file in the same directory, fsync, rename, fsync of the
directory); a full disk leaves the previous file intact and says so; a killed run's files can be resumed."""

import errno
import os
from pathlib import Path

import pytest
import torch

from test_train import shapes_config
from vitkit.checkpoints import atomic_write
from vitkit.cli import main
from vitkit.runs import read_checkpoint, read_metrics
from vitkit.train import train


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
