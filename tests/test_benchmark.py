import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitkit
from conftest import SRC, subprocess_env
from vitkit import inference as opt
from vitkit.benchmark import PeakMemory, _state_bytes, largest_batches, machine
from vitkit.cli import main

BENCHMARKS = SRC.parent / "benchmarks"

TINY = "hidden_size=16,num_layers=1,mlp_dim=32,num_heads=2,num_classes=4"


@pytest.mark.slow
def test_bench_cli_on_a_tiny_model_writes_every_cell_json_and_plot(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "ViT-Ti/8", "--model-args", TINY, "--image-size", "16", "32", "--batch-size", "1",
            "2", "--rounds", "2", "--min-seconds", "0.001", "--memory-budget-gb", "1", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert result["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    rows = result["rows"]
    # 2 sizes x 2 batches x 2 precisions x (matmul by torch.mm, and packed where this CPU packs; plain,
    # optimized, train)
    matmuls = {p: ("torch.mm", "packed") if opt.packing_available(p) else ("torch.mm",) for p in ("fp32", "bf16")}
    assert len(rows) == 2 * 2 * sum(len(modes) + 3 for modes in matmuls.values())
    for size, batch, precision in [(s, b, p) for s in (16, 32) for b in (1, 2) for p in ("fp32", "bf16")]:
        same = [r for r in rows if (r["image_size"], r["batch"], r["precision"], r["kind"]) == (size, batch, precision,
                                                                                               "matmul")]  # fmt: skip
        assert tuple(r["mode"] for r in same) == matmuls[precision]
        # the machine's rate is its faster GEMM: that one reads 1.00, the other below
        assert max(r["fraction_of_matmul"] for r in same) == pytest.approx(1.0)
        assert all(0 < r["fraction_of_matmul"] <= 1.0 + 1e-12 for r in same)
    cells = {(r["image_size"], r["batch"], r["precision"], r["kind"], r["mode"]) for r in rows}
    assert (32, 2, "bf16", "inference", "optimized") in cells and (16, 1, "fp32", "train", "plain") in cells
    for r in rows:
        assert r["gflops_per_s"] > 0
        if r["kind"] != "matmul":
            assert r["images_per_s"] > 0 and r["fraction_of_matmul"] > 0 and r["peak_memory_mb"] > 0
    fitted = {(r["image_size"], r["kind"]) for r in result["largest_batch"]}
    assert fitted == {(s, k) for s in (16, 32) for k in ("inference", "train")}


@pytest.mark.slow
def test_bench_int8_times_the_optimized_copy_alone_and_says_what_it_calibrated_on(capsys):
    pytest.importorskip("torchao", reason="int8 needs the optional torchao (PT2E quantization)")
    args = ["bench", "--model", "ViT-Ti/8", "--model-args", TINY, "--image-size", "16", "--batch-size", "2",
            "--precision", "int8", "--no-train", "--rounds", "1", "--min-seconds", "0.001"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "calibrated on the random images it times" in out
    (row,) = [line for line in out.splitlines() if " int8 " in line]  # no plain, matmul or training int8 cell
    assert "inference" in row and "optimized" in row and float(row.split()[5]) > 0  # images/s


def test_bench_rejects_an_unknown_precision_with_the_choices():
    with pytest.raises(ValueError, match="choose from fp32, bf16"):
        vitkit.bench("ViT-Ti/8", precisions=("fp16",), progress=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_memory_of_an_optimized_copy_counts_its_own_weights_and_packings(precision):
    if not opt.packing_available(precision):
        pytest.skip(f"this CPU or torch build cannot pack {precision} weights (MKL; oneDNN with native bf16)")
    model = vitkit.create_model("ViT-Ti/16", image_size=32, num_layers=2, num_classes=2).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert _state_bytes(model) == weights
    fast = opt.optimize(model, precision, pack=True)  # also where packing does not pay by default (fp32, AVX2)
    own = weights // 2 if precision == "bf16" else weights  # bf16: the weights cast once
    linears = [m for m in fast.modules() if isinstance(m, opt.PackedLinear)]
    packed = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert _state_bytes(fast) == own  # nothing packed before the first call
    with torch.inference_mode():
        fast(torch.randn(2, 3, 32, 32))
        fast(torch.randn(3, 3, 32, 32))
    assert all(len(m.packings) == 2 for m in linears)
    assert _state_bytes(fast) == own + 2 * packed  # one packed copy of each linear weight per batch size


def test_peak_memory_counts_the_activations_a_training_step_keeps():
    model = vitkit.create_model("ViT-Ti/16", image_size=32, num_layers=2, num_classes=2)
    peaks = []
    for batch in (2, 8):
        with PeakMemory() as tracker:
            model(torch.randn(batch, 3, 32, 32)).sum().backward()
        peaks.append(tracker.peak)
    # at least the patch tokens saved by each of the 2 layers' norms, 6 more images' worth
    tokens = 5 * 192 * 4  # (N, D) fp32 per image
    assert peaks[1] - peaks[0] >= 6 * 2 * tokens


def test_largest_batch_follows_the_line_through_the_measured_peaks():
    rows = [{"image_size": 224, "precision": "fp32", "kind": "inference", "mode": "plain", "batch": b,
             "peak_memory_mb": 100 + 10 * b} for b in (1, 8)]  # fmt: skip
    (fit,) = largest_batches(rows, budget_gb=1)
    assert fit["largest_batch"] == (1024 - 100) // 10 and fit["per_image_mb"] == pytest.approx(10)


def test_the_machine_names_the_cpus_family_and_model_where_proc_cpuinfo_has_them():
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        pytest.skip("needs Linux's /proc/cpuinfo")
    if "cpu family" not in first:
        pytest.skip("needs an x86 /proc/cpuinfo (cpu family, model)")
    fields = {line.split(":")[0].strip(): line.split(":")[-1].strip() for line in first.splitlines()}
    assert machine()["cpu"] == f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """A script of benchmarks/ as a user runs it, on this worktree's sources, one thread."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          env=subprocess_env(BENCHMARKS), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_the_gpu_training_script_runs_here_on_the_cpu_and_its_mfu_is_the_model_flops_over_the_peak():
    # gpu.sh's first part, small enough for a CPU: a broken script costs a lent GPU's minutes, this a test's seconds
    done = run_script("gpu_train.py", "--model", "ViT-Ti/16", "--image-size", "32", "--batch", "2", "--steps", "2",
                      "--rounds", "1", "--no-compile", "--device", "cpu", "--peak-tflops", "0.001")  # fmt: skip
    found = re.findall(r"^  (vitkit|timm) +([\d.]+) images/s +MFU +([\d.]+)% +vitkit/\1 = ([\d.]+)$", done.stdout, re.M)
    assert [name for name, *_ in found] == ["vitkit", "timm"], done.stdout
    config = vitkit.decode_variant("ViT-Ti/16", image_size=32)
    for name, images_per_s, mfu, _ in found:
        # 3x the forward FLOPs (vitkit's forward makes the last layer's class-token row alone) at 1 GFLOP/s peak
        flops = 3 * vitkit.flops(config, pooled_only=name == "vitkit")
        assert float(mfu) / 100 == pytest.approx(float(images_per_s) * flops / 1e9, rel=0.02)
    (vitkit_rate, timm_rate) = (float(r) for *_, r in found)
    assert vitkit_rate == 1.0 and timm_rate > 0


@pytest.mark.slow
def test_the_comparison_script_writes_its_table_into_the_named_block_and_a_second_run_replaces_it(tmp_path):
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text("# Performance\n\nwritten by hand\n")
    args = ("--models", "ViT-Ti/16", "--batches", "1", "--precisions", "fp32", "--rounds", "1", "--min-seconds",
            "0", "--no-compile", "--write", str(doc), "--block", "smoke")  # fmt: skip
    for _ in range(2):
        run_script("compare.py", *args)
    text = doc.read_text()
    assert text.startswith("# Performance\n\nwritten by hand\n\n<!-- compare.py smoke: begin -->")
    assert text.count("<!-- compare.py smoke: begin -->") == 1 and text.rstrip().endswith("smoke: end -->")
    assert f"CPU capability `{torch.backends.cpu.get_cpu_capability()}`" in text
    assert "Command: `python benchmarks/compare.py --models ViT-Ti/16" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ViT-Ti/16 |")]
    assert [row[3] for row in rows] == ["inference", "train"]
    for row in rows:
        cells = {"vitkit": row[4], "vitkit optimized": row[5], "timm": row[6], "HF": row[8]}
        rates = {k: float(v) for k, v in cells.items() if v != "-"}
        if row[7] != "-":  # timm's best CPU option: "12.34 (to_mkldnn)"
            rate, option = re.fullmatch(r"([\d.]+) \((.+)\)", row[7]).groups()
            rates[f"timm {option}"] = float(rate)
        ratio, best_peer = re.fullmatch(r"\*\*([\d.]+)x\*\* \((.+)\) \|", row[9]).groups()
        peers = {k: v for k, v in rates.items() if not k.startswith("vitkit")}
        assert peers[best_peer] == max(peers.values())  # the peer of the highest median (ties print alike)
        ours = rates["vitkit optimized" if row[3] == "inference" else "vitkit"]
        # one round: the ratio of the round is the ratio of the printed rates (rounded to 2 decimals)
        assert float(ratio) == pytest.approx(ours / peers[best_peer], abs=0.011, rel=0.01)
