"""`vitkit bench` and vitkit.speed.benchmark; the scripts of benchmarks/ run in tests/test_benchmark_scripts.py."""

import json

import pytest
import torch

import vitkit
from helpers import perturbed, tiny
from vitkit.cli.parser import main
from vitkit.speed import optimize, torch_copy
from vitkit.speed.benchmark import PeakMemory, _state_bytes, largest_batches, ratios_to_fastest
from vitkit.speed.openvino_copy import openvino_pays

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
    assert result["benchmark"] == "bench" and result["date"] and result["command"]  # the process's command line
    rows = result["rows"]
    # 2 sizes x 2 batches x 2 precisions x (matmul by torch.mm, and packed where this CPU packs; plain,
    # optimized, train)
    matmuls = {
        p: ("torch.mm", "packed") if torch_copy.packing_available(p) else ("torch.mm",) for p in ("fp32", "bf16")
    }
    assert len(rows) == 2 * 2 * sum(len(modes) + 3 for modes in matmuls.values())
    for size, batch, precision in [(s, b, p) for s in (16, 32) for b in (1, 2) for p in ("fp32", "bf16")]:
        same = [
            r
            for r in rows
            if (r["image_size"], r["batch"], r["precision"], r["kind"]) == (size, batch, precision, "matmul")
        ]
        assert tuple(r["mode"] for r in same) == matmuls[precision]
        # the machine's rate is its faster GEMM: that one reads 1.00, the other below
        assert max(r["fraction_of_matmul"] for r in same) == pytest.approx(1.0)
        assert all(0 < r["fraction_of_matmul"] <= 1.0 + 1e-12 for r in same)
    cells = {(r["image_size"], r["batch"], r["precision"], r["kind"], r["mode"]) for r in rows}
    assert (32, 2, "bf16", "inference", "optimized") in cells and (16, 1, "fp32", "train", "plain") in cells
    for r in rows:
        assert r["gflops_per_s"] > 0 and len(r["rounds_s"]) == 2  # the seconds of each round, beside the median
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


def test_bench_times_a_checkpoints_own_architecture_at_its_own_resolution(tmp_path, capsys):
    model = tiny(image_size=24, in_chans=1)  # neither bench's default resolution nor its default channels
    vitkit.export(model, tmp_path / "m.safetensors")
    out = tmp_path / "bench.json"
    args = ["bench", "--checkpoint", str(tmp_path / "m.safetensors"), "--batch-size", "2", "--precision", "fp32",
            "--mode", "plain", "--no-train", "--rounds", "1", "--min-seconds", "0", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["model"] == str(tmp_path / "m.safetensors")
    assert vitkit.ViTConfig.from_dict(result["config"]) == model.config
    assert {r["image_size"] for r in result["rows"]} == {24}
    args = ["bench", "--checkpoint", str(tmp_path / "m.safetensors"), "--model", "ViT-Ti/16"]
    with pytest.raises(SystemExit):  # one or the other
        main(args)
    assert "not allowed with argument" in capsys.readouterr().err


def test_bench_rejects_an_unknown_precision_with_the_choices():
    with pytest.raises(ValueError, match="choose from fp32, bf16"):
        vitkit.bench("ViT-Ti/8", precisions=("fp16",), progress=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_memory_of_an_optimized_copy_counts_its_own_weights_and_packings(precision):
    if not torch_copy.packing_available(precision):
        pytest.skip(f"this CPU or torch build cannot pack {precision} weights (MKL; oneDNN with native bf16)")
    model = vitkit.create_model("ViT-Ti/16", image_size=32, num_layers=2, num_classes=2).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert _state_bytes(model) == weights
    fast = optimize.optimize(model, precision, pack=True)  # also where packing does not pay by default (fp32, AVX2)
    own = weights // 2 if precision == "bf16" else weights  # bf16: the weights cast once
    linears = [m for m in fast.modules() if isinstance(m, torch_copy.PackedLinear)]
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
    rows = [
        {
            "image_size": 224,
            "precision": "fp32",
            "kind": "inference",
            "mode": "plain",
            "batch": b,
            "peak_memory_mb": 100 + 10 * b,
        }
        for b in (1, 8)
    ]
    (fit,) = largest_batches(rows, budget_gb=1)
    assert fit["largest_batch"] == (1024 - 100) // 10 and fit["per_image_mb"] == pytest.approx(10)


def runtimes_installed() -> None:
    for name in ("onnx", "onnxscript", "onnxruntime", "openvino"):
        pytest.importorskip(name, reason=f"the runtimes' comparison needs the optional {name} (dev extra)")


def test_bench_plot_has_a_memory_panel_only_with_a_memory_budget(tmp_path):
    from PIL import Image

    from vitkit.speed.benchmark import plot_bench

    rows = [{"kind": "inference", "batch": 1, "precision": "fp32", "mode": "plain", "image_size": s,
             "images_per_s": 100.0 / s} for s in (16, 32)]  # fmt: skip
    result = {"rows": rows, "largest_batch": [], "model": "ViT-Ti/8", "settings": {"memory_budget_gb": None},
              "machine": {"cpu_capability": "AVX512", "device": "cpu"}}  # fmt: skip
    plot_bench(result, tmp_path / "alone.png")
    budget = [{"precision": "fp32", "kind": "inference", "mode": "plain", "image_size": 16, "largest_batch": 64}]
    plot_bench({**result, "largest_batch": budget, "settings": {"memory_budget_gb": 1.0}}, tmp_path / "both.png")
    alone, both = (Image.open(tmp_path / name).size for name in ("alone.png", "both.png"))
    assert alone[1] == both[1] and both[0] > 1.6 * alone[0]  # one panel, not two of which one empty


def test_ratios_to_the_fastest_are_the_median_of_each_rounds_ratio():
    rates = {"a": [10.0, 20.0, 30.0], "b": [20.0, 20.0, 20.0]}  # medians 20 and 20: the first of them is fastest
    assert ratios_to_fastest(rates) == {"a": 1.0, "b": 1.0}
    rates = {"a": [10.0, 30.0, 40.0], "b": [20.0, 20.0, 20.0]}  # a is fastest; b's round ratios 2, 2/3, 1/2
    assert ratios_to_fastest(rates) == {"a": 1.0, "b": pytest.approx(2 / 3)}


@pytest.mark.slow
def test_bench_compare_runs_a_checkpoint_in_both_runtimes_beside_optimize(tmp_path, capsys):
    runtimes_installed()
    model = perturbed(tiny())
    vitkit.export(model, tmp_path / "m.safetensors")
    out = tmp_path / "compare.json"
    args = ["bench", "--compare", "--checkpoint", str(tmp_path / "m.safetensors"), "--batch-size",
            "1", "3", "--precision", "fp32", "bf16", "--rounds", "2", "--min-seconds", "0",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["model"] == str(tmp_path / "m.safetensors")
    assert vitkit.ViTConfig.from_dict(data["config"]) == model.config
    fp32 = [r for r in data["rows"] if r["precision"] == "fp32"]
    # where optimize runs the model in OpenVINO, its copy with vitkit's own kernels is timed beside it
    ours = ("vitkit.optimize", "vitkit torch") if openvino_pays("fp32", torch.device("cpu")) else ("vitkit.optimize",)
    assert [(r["batch"], r["contender"]) for r in fp32] == [
        (b, c) for b in (1, 3) for c in (*ours, "onnxruntime", "openvino")
    ]
    assert any("runs the model in openvino" in note for note in data["notes"]) == (len(ours) == 2)
    for r in fp32:
        assert len(r["rounds"]) == 2 and r["max_relative_difference"] <= 1e-4
        assert f"{r['batch']:>5} fp32 {r['contender']:<17}{r['images_per_s']:>10.2f}" in printed
    for batch in (1, 3):
        cell = [r["ratio_to_fastest"] for r in data["rows"] if r["batch"] == batch and r["precision"] == "bf16"]
        assert 1.0 in cell  # the fastest's; another's median of round ratios can pass 1 where two rounds disagree
    assert not any(r["contender"] == "onnxruntime" for r in data["rows"] if r["precision"] == "bf16")
    assert any("onnxruntime: no bf16 path" in note for note in data["notes"])


def test_bench_compare_takes_one_resolution(capsys):
    assert main(["bench", "--compare", "--model", "ViT-Ti/16", "--image-size", "32", "64"]) == 2
    assert "--image-size 32 64 with --compare: give one resolution" in capsys.readouterr().err
