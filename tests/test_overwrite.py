"""Nothing is overwritten unasked: every writer (export and convert, train, inspect, bench, experiment, data pack)
refuses an existing file, a non-empty directory or a run directory with one line naming it and the fix, and
replaces it with --overwrite (overwrite=True)."""

import json
from pathlib import Path

import pytest

import vitkit
from vitkit.cli.parser import main
from vitkit.files import refuse_overwrite
from vitkit.training.runs import claim_run_dir


def run_cli(argv, capsys) -> tuple[int, str]:
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err


def one_line_refusal(err: str, path) -> bool:
    return err.count("\n") == 1 and f"{path} already exists" in err and "pass --overwrite to replace it" in err


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model = vitkit.create_model("ViT-Ti/4", image_size=16, hidden_size=8, num_layers=1, mlp_dim=8, num_heads=2,
                                num_classes=2)  # fmt: skip
    vitkit.export(model, tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors"


@pytest.fixture
def other_run(tmp_path) -> Path:
    """A finished training run's directory, its files standing for the real ones."""
    run = tmp_path / "other-run"
    run.mkdir()
    for name in ("config.json", "metrics.jsonl", "model.safetensors"):
        (run / name).write_text(f"{name} of another run\n")
    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_refuse_overwrite_passes_new_paths_and_empty_folders_and_names_what_exists(tmp_path):
    refuse_overwrite(tmp_path / "new.safetensors")
    (tmp_path / "empty").mkdir()
    refuse_overwrite(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(FileExistsError, match=r"file.txt already exists \(a file\): pass overwrite=True to replace"):
        refuse_overwrite(tmp_path / "file.txt")
    (tmp_path / "empty" / "x").write_text("x")
    with pytest.raises(FileExistsError, match=r"empty already exists \(a non-empty directory\)"):
        refuse_overwrite(tmp_path / "empty")
    refuse_overwrite(tmp_path / "file.txt", overwrite=True)


@pytest.mark.filterwarnings("ignore:npz export")
@pytest.mark.parametrize("to", ["vitkit", "hf", "timm", "npz"])
def test_export_refuses_an_existing_path_unless_overwrite(tmp_path, checkpoint, to):
    model = vitkit.load_checkpoint(checkpoint)
    dst = tmp_path / ("out" if to == "hf" else f"out.{ {'vitkit': 'safetensors', 'timm': 'safetensors'}.get(to, to) }")
    vitkit.export(model, dst, format=to)
    before = snapshot(dst) if dst.is_dir() else dst.read_bytes()
    with pytest.raises(FileExistsError, match="already exists .*pass overwrite=True to replace it"):
        vitkit.export(model, dst, format=to)
    assert (snapshot(dst) if dst.is_dir() else dst.read_bytes()) == before
    vitkit.export(model, dst, format=to, overwrite=True)


@pytest.mark.parametrize("to", ["hf", "timm"])
def test_convert_into_another_runs_directory_is_refused_and_leaves_it_untouched(capsys, checkpoint, other_run, to):
    before = snapshot(other_run)
    status, err = run_cli(["convert", checkpoint, other_run, "--to", to], capsys)
    assert status == 2 and one_line_refusal(err, other_run), err
    assert "(a training run's directory)" in err
    assert snapshot(other_run) == before
    status, err = run_cli(["convert", checkpoint, other_run, "--to", to, "--overwrite"], capsys)
    assert status == 0, err
    assert "config.json" in snapshot(other_run) and snapshot(other_run) != before


def test_convert_onto_an_existing_file_is_refused_unless_overwrite(tmp_path, capsys, checkpoint):
    dst = tmp_path / "kept.npz"
    dst.write_bytes(b"precious")
    status, err = run_cli(["convert", checkpoint, dst, "--to", "npz"], capsys)
    assert status == 2 and one_line_refusal(err, dst) and "(a file)" in err and dst.read_bytes() == b"precious"
    assert run_cli(["convert", checkpoint, dst, "--to", "npz", "--overwrite"], capsys)[0] == 0
    assert dst.read_bytes() != b"precious"


def test_train_into_a_folder_of_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.png").write_bytes(b"not ours")
    status, err = run_cli(["train", "--data", "shapes", "--out-dir", tmp_path / "photos"], capsys)
    assert status == 2 and one_line_refusal(err, tmp_path / "photos"), err
    assert [p.name for p in (tmp_path / "photos").iterdir()] == ["cat.png"]


def test_a_run_folder_that_never_reached_its_first_checkpoint_is_reused_without_overwrite(tmp_path):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "config.json").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    claim_run_dir(run, overwrite=False)
    assert list(run.iterdir()) == []  # the leftovers are cleared for the new run
    (run / "config.json").write_text("{}\n")
    (run / "checkpoint.pt").write_bytes(b"resumable")
    with pytest.raises(FileExistsError, match="already holds a run: continue it with `vitkit train --resume"):
        claim_run_dir(run, overwrite=False)


def test_inspect_into_a_non_empty_folder_is_refused(tmp_path, capsys, checkpoint):
    out = tmp_path / "report"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    status, err = run_cli(["inspect", "--checkpoint", checkpoint, "--samples", "1", "--out", out], capsys)
    assert status == 2 and one_line_refusal(err, out), err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_inspect_with_overwrite_writes_into_a_non_empty_folder(tmp_path, capsys, checkpoint):
    out = tmp_path / "report"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    argv = ["inspect", "--checkpoint", checkpoint, "--samples", "1", "--out", out, "--overwrite"]
    assert run_cli(argv, capsys)[0] == 0
    assert (out / "report.html").is_file() and (out / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("existing", ["bench.json", "bench.png"])
def test_bench_refuses_an_existing_json_or_plot_before_measuring(tmp_path, capsys, existing):
    (tmp_path / existing).write_text("earlier\n")
    argv = [
        "bench",
        "--model",
        "ViT-Ti/16",
        "--image-size",
        "32",
        "--batch-size",
        "1",
        "--out",
        tmp_path / "bench.json",
    ]
    status, err = run_cli(argv, capsys)
    assert status == 2 and one_line_refusal(err, tmp_path / existing), err
    assert (tmp_path / existing).read_text() == "earlier\n"


def test_data_pack_into_a_non_empty_folder_is_refused(tmp_path, capsys):
    from test_shards import write_image_folder

    root, out = write_image_folder(tmp_path / "photos", per_class=2), tmp_path / "packed"
    out.mkdir()
    (out / "index.json").write_text("{}\n")
    status, err = run_cli(["data", "pack", root, out], capsys)
    assert status == 2 and one_line_refusal(err, out), err
    assert (out / "index.json").read_text() == "{}\n"


def test_experiment_results_of_another_setting_are_refused_unless_overwrite(tmp_path, capsys):
    results = tmp_path / "data-scaling" / "results.json"
    results.parent.mkdir()
    earlier = {"preset": "small", "seeds": 3, "checkpoint": "x", "command": "vitkit experiment data-scaling --seeds 3"}
    results.write_text(json.dumps(earlier))
    status, err = run_cli(["experiment", "data-scaling", "--preset", "tiny", "--out", tmp_path], capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert "holds the results of `vitkit experiment data-scaling --seeds 3`" in err and "pass --overwrite" in err
    assert json.loads(results.read_text()) == earlier
