import collections
import contextlib
import copy
import re
import subprocess
import sys
import warnings

import pytest
import torch

import vitkit
from helpers import subprocess_env
from vitkit.speed import copies, int8_copy, machine, openvino_copy, torch_copy
from vitkit.speed import optimize as rule
from vitkit.speed.optimize import optimize
from vitkit.speed.runtimes import own_kernels_copy
from vitkit.speed.torch_copy import PackedLinear

SMALL = {"hidden_size": 32, "num_layers": 2, "mlp_dim": 64, "num_heads": 4, "num_classes": 10, "image_size": 32}


def small_model(**overrides) -> vitkit.VisionTransformer:
    model = vitkit.create_model("ViT-Ti/8", **{**SMALL, "init": "trunc_normal", **overrides})
    with torch.no_grad():  # a non-zero head, so the logits are not all equal
        model.head.weight.normal_(std=0.5)
    return model.eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"classifier": "gap"},
        {"posemb": "relative"},
        {"posemb": "sincos2d"},
        {"representation_size": 16},
        {"act": "gelu_tanh"},
    ],
    ids=["token", "gap", "relative", "sincos2d", "pre_logits", "gelu_tanh"],
)
def test_fp32_fast_path_gives_the_plain_models_logits(overrides):
    model = small_model(**overrides)
    x = torch.randn(3, 3, 32, 32)
    fast = optimize(model, "fp32", runtime="torch")
    assert any(isinstance(m, PackedLinear) for m in fast.modules()) == torch_copy.packing_pays("fp32")
    # The packed copy whether or not this CPU packs by default, so both paths are checked on every machine.
    copies = [fast, optimize(model, "fp32", pack=True)] if torch_copy.packing_available("fp32") else [fast]
    with torch.no_grad():
        for fast in copies:
            torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)
            # batch sizes other than the packing hint, and the explicit-softmax path of the report
            torch.testing.assert_close(fast(x[:1]), model(x[:1]), rtol=0, atol=1e-4)
            got, want = fast.forward_intermediates(x, attention=True), model.forward_intermediates(x, attention=True)
            torch.testing.assert_close(got["attention"][-1], want["attention"][-1], rtol=0, atol=1e-5)


def test_fp32_packs_by_default_only_on_cpus_with_avx512_and_bf16_wherever_it_can(monkeypatch):
    for avx512 in (True, False):
        monkeypatch.setattr(machine, "avx512", lambda avx512=avx512: avx512)
        assert torch_copy.packing_pays("fp32") == (avx512 and torch_copy.packing_available("fp32"))
        assert torch_copy.packing_pays("bf16") == torch_copy.packing_available("bf16")


def test_packed_linear_equals_f_linear_for_any_leading_shape():
    if not torch_copy.packing_available("fp32"):
        pytest.skip("this torch build has no MKL (torch.ops.mkl._mkl_linear)")
    linear = torch.nn.Linear(24, 40)
    packed = PackedLinear(linear)
    for shape in [(5, 24), (2, 7, 24), (1, 1, 24), (torch_copy.PACKED_MAX_ROWS + 1, 24)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), linear(x).detach(), rtol=0, atol=1e-5)


def test_bf16_packed_linear_equals_f_linear_in_bf16_for_any_leading_shape():
    if not torch_copy.packing_available("bf16"):
        pytest.skip("no native bf16 on this CPU (AVX-512 BF16 / AMX) or no oneDNN: bf16 weights are not packed")
    linear = torch.nn.Linear(24, 40).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert "oneDNN" in repr(packed)
    for shape in [(5, 24), (2, 7, 24), (1, 1, 24), (torch_copy.PACKED_MAX_ROWS + 1, 24)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x), linear(x).detach())  # bf16's own tolerance (rtol 1.6e-2)


def test_bf16_fast_path_is_within_bf16_rounding_of_the_plain_model():
    model = small_model()
    x = torch.randn(4, 3, 32, 32)
    with pytest.warns(UserWarning, match="emulated") if not machine.bf16_is_native() else contextlib.nullcontext():
        fast = optimize(model, "bf16", runtime="torch")
    assert all(p.dtype == torch.bfloat16 for p in fast.parameters())
    assert any(isinstance(m, PackedLinear) for m in fast.modules()) == torch_copy.packing_pays("bf16")
    with torch.no_grad():
        want = model(x)
        got = fast(x)  # fp32 images in, bf16 logits out
        assert got.dtype == torch.bfloat16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # emulated bf16, where it is: the same warning as above
            unpacked = optimize(model, "bf16", pack=False)(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(x).float()
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%); through two layers the error stays within a
    # few percent of the logits' scale, and no worse than bf16 autocast's own error by more than a factor of 2.
    # The packed copy rounds the MLP's hidden layer once (GELU fused into the GEMM) where the unpacked copy
    # rounds it twice, so the two differ by bf16 rounding and each is held to the bounds.
    scale = want.abs().max()
    for logits in (got, unpacked):
        error = (logits.float() - want).abs().max()
        assert error <= 0.03 * scale, (error, scale)
        assert error <= 2 * (autocast - want).abs().max() + 0.01 * scale
        assert (logits.float().argmax(1) == want.argmax(1)).float().mean() >= 0.75


def test_optimize_leaves_the_original_model_untouched():
    model = small_model().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = optimize(model, "fp32", runtime="torch")
    assert model.training and all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not fast.training and not any(p.requires_grad for p in fast.parameters())
    assert sum(p.numel() for p in fast.parameters()) == sum(p.numel() for p in model.parameters())
    assert fast.state_dict().keys() == model.state_dict().keys()


LIBRARY_CASES = [("fp32", "mkl"), ("fp32", "onednn"), ("bf16", "onednn")]


def skip_unless_packable(precision: str, library: str) -> None:
    if not torch_copy.library_available(library):
        pytest.skip(f"this torch build has no {library} (torch.ops.mkl._mkl_linear / mkldnn._linear_pointwise)")
    if precision == "bf16" and not torch_copy.packing_available("bf16"):
        pytest.skip("no native bf16 on this CPU (AVX-512 BF16 / AMX): bf16 weights are not packed")


@pytest.mark.parametrize(("precision", "library"), LIBRARY_CASES, ids=["fp32-mkl", "fp32-onednn", "bf16-onednn"])
def test_packed_linear_runs_the_gemm_packed_for_each_row_count(precision, library):
    skip_unless_packable(precision, library)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    linear = torch.nn.Linear(24, 40).to(dtype)
    packed = PackedLinear(linear, library=library)
    pack = torch.ops.mkldnn._reorder_linear_weight if library == "onednn" else torch.ops.mkl._mkl_reorder_linear_weight
    with torch.no_grad():
        packed(torch.randn(2, 7, 24, dtype=dtype))
        assert list(packed.packings) == [14]
        # MKL's packed GEMM runs only for the row count it was packed for (else it falls back to F.linear); oneDNN's
        # runs any, packed for the row count or not. Swap in the packing of a zero weight: the bias alone comes out,
        # so the packing for 14 rows is what ran.
        packed.packings[14] = pack(torch.zeros(40, 24, dtype=dtype), 14)
        torch.testing.assert_close(packed(torch.randn(14, 24, dtype=dtype)), linear.bias.expand(14, 40), rtol=0, atol=0)
        # above the limit: MKL F.linear, nothing packed; oneDNN the packing for 1 row
        torch.testing.assert_close(
            packed(torch.ones(torch_copy.PACKED_MAX_ROWS + 1, 24, dtype=dtype)),
            linear(torch.ones(torch_copy.PACKED_MAX_ROWS + 1, 24, dtype=dtype)),
        )
        assert list(packed.packings) == ([14] if library == "mkl" else [14, 1])
        for rows in range(1, torch_copy.MAX_PACKINGS + 2):
            packed(torch.randn(rows, 24, dtype=dtype))
        assert list(packed.packings) == list(range(2, torch_copy.MAX_PACKINGS + 2))  # the oldest dropped first


@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_fp32_copies_packed_for_either_library_give_the_plain_models_logits(library, monkeypatch):
    """Whichever library this CPU packs fp32 for by default (`fp32_library`), both are checked on every machine."""
    skip_unless_packable("fp32", library)
    monkeypatch.setattr(torch_copy, "fp32_library", lambda: library)
    model = small_model()
    fast = optimize(model, "fp32", pack=True)
    assert {m.library for m in fast.modules() if isinstance(m, PackedLinear)} == {library}
    assert f"packed for {'MKL' if library == 'mkl' else 'oneDNN'}, then GELU" in repr(fast.blocks[0].mlp.fc1)
    with torch.no_grad():
        for batch in (3, 1, 3):  # the second 3 runs on the packing made by the first
            x = torch.randn(batch, 3, 32, 32)
            torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)


def test_fp32_library_is_mkl_on_intel_cpus_and_onednn_elsewhere(monkeypatch):
    both = torch_copy.library_available("mkl") and torch_copy.library_available("onednn")
    if not both:
        pytest.skip("this torch build lacks MKL or oneDNN, so there is no choice to make")
    for intel, library in ((True, "mkl"), (False, "onednn")):
        monkeypatch.setattr(machine, "cpu_is_intel", lambda intel=intel: intel)
        assert torch_copy.fp32_library() == library
        assert PackedLinear(torch.nn.Linear(4, 4)).library == library
    assert PackedLinear(torch.nn.Linear(4, 4).to(torch.bfloat16)).library == "onednn"
    with pytest.raises(ValueError, match="'mkl' for fp32 weights only"):
        PackedLinear(torch.nn.Linear(4, 4).to(torch.bfloat16), library="mkl")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_mlps_gelu_moves_into_the_packed_first_layer_and_copies_repack(precision):
    if not torch_copy.packing_available(precision):
        pytest.skip(f"this CPU or torch build cannot pack {precision} weights (MKL; oneDNN with native bf16)")
    model = small_model(act="gelu_tanh")
    fast = optimize(model, precision, pack=True)  # also where packing does not pay by default (fp32, AVX2)
    mlp = fast.blocks[0].mlp
    assert isinstance(mlp.fc1, PackedLinear) and mlp.fc1.gelu == "tanh" and isinstance(mlp.act, torch.nn.Identity)
    assert isinstance(mlp.fc2, PackedLinear) and mlp.fc2.gelu is None
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        y = fast(x)
        if precision == "fp32":
            torch.testing.assert_close(y, model(x), rtol=0, atol=1e-4)
        twin = copy.deepcopy(fast)  # packed weights are opaque tensors: the copy packs its own
        assert twin.blocks[0].mlp.fc1.gelu == "tanh"
        torch.testing.assert_close(twin(x), y, rtol=0, atol=0)


def test_emulated_bf16_warns_and_unknown_precision_says_what_to_use(monkeypatch):
    monkeypatch.setattr(machine, "bf16_is_native", lambda device="cpu": False)
    with pytest.warns(UserWarning, match="slower than fp32"):
        optimize(small_model(), "bf16")
    with pytest.raises(ValueError, match="'fp16' is unknown: choose one of auto, fp32, bf16"):
        optimize(small_model(), "fp16")


@pytest.mark.slow
def test_compiled_fast_path_gives_the_plain_models_logits():
    model = small_model(num_layers=1)
    x = torch.randn(2, 3, 32, 32)
    fast = optimize(model, "fp32", compile=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_predict_and_eval_give_the_same_answers_with_and_without_optimize(tmp_path, capsys):
    from PIL import Image

    from vitkit.cli.parser import main

    model = small_model(num_classes=6)  # shapes has 6 classes
    model.class_names = [f"class{i}" for i in range(6)]
    path = tmp_path / "model.safetensors"
    vitkit.export(model, path)
    image = tmp_path / "image.png"
    Image.fromarray((torch.rand(32, 32, 3) * 255).byte().numpy()).save(image)
    answers = []
    for flags in ([], ["--no-optimize"]):
        assert main(["predict", "--checkpoint", str(path), str(image), *flags]) == 0
        assert main(["eval", "--checkpoint", str(path), "--data", "shapes", "--batch-size", "50", *flags]) == 0
        answers.append(capsys.readouterr().out)
    assert "class" in answers[0] and "top-1" in answers[0]
    if machine.resolve_precision("auto") == "fp32":  # the optimized copy computes the same float32 logits
        assert answers[0] == answers[1]
    else:  # bf16 is native here, so the default path runs in bf16: the same answers to bf16 rounding
        optimized, plain = (percentages(a) for a in answers)
        assert optimized.keys() == plain.keys() and max(optimized, key=optimized.get) == max(plain, key=plain.get)
        assert all(abs(optimized[k] - plain[k]) <= 1.5 for k in plain), (optimized, plain)


def percentages(output: str) -> dict[tuple[int, str], float]:
    """(line, label) -> the percentage printed beside it, e.g. (0, "class5") -> 59.4, (2, "top-1") -> 16.5."""
    return {
        (i, label): float(value)
        for i, line in enumerate(output.splitlines())
        for label, value in re.findall(r"([\w-]+)\s+([0-9.]+)%", line)
    }


def test_compiling_on_a_cpu_silences_torchs_no_cuda_runtime_warning_and_nothing_else(caplog):
    import logging

    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.removeFilter(machine.CUDA_NOTE_FILTER)
    try:
        machine.compile_quietly_on(torch.device("cuda"))  # a GPU run: the warning would be news, it stays
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
        assert "No CUDA runtime is found" in caplog.text
        caplog.clear()
        machine.compile_quietly_on(torch.device("cpu"))
        machine.compile_quietly_on(torch.device("cpu"))
        assert logger.filters.count(machine.CUDA_NOTE_FILTER) == 1
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
            logger.warning("another warning of the extension builder")
        assert "No CUDA runtime" not in caplog.text and "another warning of the extension builder" in caplog.text
    finally:
        logger.removeFilter(machine.CUDA_NOTE_FILTER)


# --- OpenVINO -------------------------------------------------------------------------------------------------


def needs_openvino() -> None:
    pytest.importorskip("openvino", reason="the OpenVINO copy needs the optional openvino (vitkit[openvino])")


@pytest.mark.parametrize(
    "overrides",
    [{}, {"classifier": "gap"}, {"posemb": "relative"}, {"posemb": "sincos2d"}, {"representation_size": 16}],
    ids=["token", "gap", "relative", "sincos2d", "pre_logits"],
)
def test_openvino_copy_gives_the_models_logits_at_any_batch_size(overrides):
    """fp32: the model's logits to 1e-5 of their scale (the same arithmetic in another order), at batch sizes other
    than the two images the conversion traced."""
    needs_openvino()
    model = small_model(**overrides)
    fast = optimize(model, "fp32", runtime="openvino")
    assert (
        isinstance(fast, openvino_copy.OpenVINOModel) and fast.config == model.config and "OpenVINO fp32" in repr(fast)
    )
    with torch.no_grad():
        for batch in (1, 5):
            x = torch.randn(batch, 3, 32, 32)
            want = model(x)
            got = fast(x)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_openvino_copy_made_with_one_thread_runs_batches():
    """One torch thread (OMP_NUM_THREADS=1) gives one throughput stream: batches still go to the batch copy, not
    to the single-image one, whose shape is fixed at one image."""
    needs_openvino()
    model = small_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fast = optimize(model, "fp32", runtime="openvino")
    finally:
        torch.set_num_threads(threads)
    assert fast.streams == 1
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        assert (fast(x) - want).abs().max() <= 1e-5 * want.abs().max()


def test_openvino_copy_runs_a_small_models_small_batches_whole_and_larger_ones_in_its_streams(monkeypatch):
    """Where a stream's part of a batch would hold under `STREAM_MIN_FLOPS`, the batch runs whole on one request
    with every thread (starting the streams cost more than they saved), else split among the streams; every path
    gives the model's logits, and none hands out a buffer that the next call overwrites."""
    needs_openvino()
    model = small_model()
    image = vitkit.flops(model.config)
    assert image * 2 < openvino_copy.STREAM_MIN_FLOPS  # small enough that a batch of two is not split
    fast = optimize(model, "fp32", runtime="openvino")
    assert fast.split_from > 2 and fast.small is not fast.single and f"from {fast.split_from} images" in repr(fast)
    assert (fast.split_from - 1) * image < openvino_copy.STREAM_MIN_FLOPS * fast.streams <= fast.split_from * image
    split = []
    monkeypatch.setattr(
        fast, "split", lambda array: split.append(len(array)) or openvino_copy.OpenVINOModel.split(fast, array)
    )
    with torch.no_grad():
        outputs = []
        for batch in (1, 2, fast.split_from - 1, fast.split_from, 1):
            x = torch.randn(batch, 3, 32, 32)
            want = model(x)
            got = fast(x)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), batch
            outputs.append((got, got.clone()))
    assert split == [fast.split_from]
    assert all(torch.equal(got, kept) for got, kept in outputs)  # later calls left earlier logits alone


def test_openvino_copy_splits_every_batch_of_a_model_with_enough_work_in_one_image():
    needs_openvino()
    model = small_model(hidden_size=256, mlp_dim=1024, image_size=64, patch_size=4)  # 256 patches: 1.1 GFLOP
    assert vitkit.flops(model.config) >= openvino_copy.STREAM_MIN_FLOPS
    fast = optimize(model, "fp32", runtime="openvino")
    assert fast.split_from == 2 and fast.small is fast.single and "from" not in repr(fast)
    with torch.no_grad():
        x = torch.randn(2, 3, 64, 64)
        want = model(x)
        assert (fast(x) - want).abs().max() <= 1e-5 * want.abs().max()


def test_openvino_copy_compiles_attention_as_openvino_does_the_exported_graph(tmp_path):
    """The copy's graph (OpenVINO's trace of the model, in which attention is written out) compiles to no more
    transposes and reorders than OpenVINO makes of the ONNX graph `vitkit.export` writes; converted from SDPA, each
    layer's attention had one transpose more."""
    needs_openvino()
    pytest.importorskip("onnxscript", reason="vitkit.export writes ONNX with the optional onnxscript (vitkit[onnx])")
    model = small_model()

    def layers(compiled) -> collections.Counter:
        ops = compiled.get_runtime_model().get_ordered_ops()
        return collections.Counter(openvino_copy.layer_type(op) for op in ops)

    ours = layers(optimize(model, "fp32", runtime="openvino").single)
    vitkit.export(model, tmp_path / "model.onnx")
    exported = openvino_copy.openvino_core().compile_model(
        str(tmp_path / "model.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    theirs = layers(exported)
    assert ours["Transpose"] <= theirs["Transpose"] and ours["Reorder"] <= theirs["Reorder"], (ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ViT-B/16", "R50+ViT-B/16"])
def test_openvino_copy_of_the_paper_variants_and_the_hybrid_gives_their_logits(name):
    needs_openvino()
    model = vitkit.create_model(name, image_size=64, num_classes=10).eval()
    torch.nn.init.trunc_normal_(model.head.weight, std=0.02)  # the official init zeroes the head
    fast = optimize(model, "fp32", runtime="openvino")
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
    assert (fast(x) - want).abs().max() <= 1e-5 * want.abs().max()


def test_openvino_bf16_copy_is_within_bf16_rounding_of_the_model():
    needs_openvino()
    if not machine.bf16_is_native():
        with pytest.raises(ValueError, match="native bf16"):
            optimize(small_model(), "bf16", runtime="openvino")
        return
    model = small_model()
    x = torch.randn(4, 3, 32, 32)
    fast = optimize(model, "bf16", runtime="openvino")
    with torch.no_grad():
        want = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(x).float()
    error = (fast(x) - want).abs().max()
    assert 0 < error <= 0.03 * want.abs().max()  # rounded (so bf16 really ran), within a few percent of the scale
    assert error <= 2 * (autocast - want).abs().max() + 0.01 * want.abs().max()


def run_in_a_fresh_process(code: str) -> subprocess.CompletedProcess:
    """`code` run by a new Python on this worktree's sources, its output captured."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())


# A child process, since what it checks is the process's: its main thread's alternate signal stack, which OpenVINO's
# CPU plugin swaps (see `openvino_core`). Two OpenVINO copies are freed in the order they were made, then Python signal
# handlers run on that thread: a SIGCHLD one, as torch's DataLoader installs, as a child exits; then Ctrl-C's.
SIGNALS_AFTER_OPENVINO = """
import gc, os, signal, subprocess, time, vitkit
model = vitkit.create_model("ViT-Ti/8", hidden_size=32, num_layers=1, mlp_dim=64, num_heads=4, image_size=32).eval()
first = vitkit.optimize(model, "fp32", runtime="openvino")
second = vitkit.optimize(model, "fp32", runtime="openvino")
del first; gc.collect()
del second; gc.collect()
signal.signal(signal.SIGCHLD, lambda *_: None)
subprocess.run(["true"], check=True)
signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, even where the parent's shell ignored SIGINT
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
"""


@pytest.mark.slow
def test_signals_are_handled_after_openvino_copies_are_freed_in_the_order_they_were_made():
    needs_openvino()
    out = run_in_a_fresh_process(SIGNALS_AFTER_OPENVINO)
    assert out.returncode == 0 and out.stdout.split() == ["KeyboardInterrupt"], (out.returncode, out.stderr[-2000:])
    assert openvino_copy.openvino_core() is openvino_copy.openvino_core()


def test_auto_runs_openvino_exactly_where_it_pays_and_never_with_torchs_options(monkeypatch):
    needs_openvino()
    model = small_model()
    for pays in (True, False):
        monkeypatch.setattr(openvino_copy, "openvino_pays", lambda precision, device, pays=pays: pays)
        assert isinstance(optimize(model, "fp32"), openvino_copy.OpenVINOModel) == pays
    monkeypatch.setattr(openvino_copy, "openvino_pays", lambda precision, device: True)
    assert isinstance(optimize(model, "fp32", pack=False), vitkit.VisionTransformer)
    assert isinstance(optimize(model, "fp32", runtime="torch"), vitkit.VisionTransformer)


def test_single_images_run_with_vitkits_kernels_only_in_bf16_on_wide_models_without_amx(monkeypatch):
    wide, narrow = vitkit.ViTConfig(hidden_size=768), vitkit.ViTConfig(hidden_size=384)
    for native, amx, expected in [(True, False, True), (True, True, False), (False, False, False)]:
        monkeypatch.setattr(machine, "bf16_is_native", lambda device="cpu", native=native: native)
        monkeypatch.setattr(machine, "amx", lambda amx=amx: amx)
        assert rule.torch_pays_for_single_images(wide, "bf16") == expected
        assert not rule.torch_pays_for_single_images(narrow, "bf16")
        assert not rule.torch_pays_for_single_images(wide, "fp32")


def test_where_vitkits_kernels_pay_for_single_images_auto_hands_them_only_single_images(monkeypatch):
    """With runtime "auto", the OpenVINO copy gets vitkit's own copy for single images where the rule says so;
    batches still run in OpenVINO, both with the model's logits; runtime="openvino" keeps OpenVINO for everything."""
    needs_openvino()
    model = small_model()
    monkeypatch.setattr(rule, "torch_pays_for_single_images", lambda config, precision: True)
    fast = optimize(model, "fp32")
    assert isinstance(fast, openvino_copy.OpenVINOModel) and isinstance(fast.single_images, vitkit.VisionTransformer)
    assert "single images with vitkit's kernels" in repr(fast) and "\n" not in repr(fast)  # not the copy's layers
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(fast(x[:1]), fast.single_images(x[:1]))
        for got in (fast(x[:1]), fast(x)):
            assert (got - want[: len(got)]).abs().max() <= 1e-5 * want.abs().max()
    assert optimize(model, "fp32", runtime="openvino").single_images is None
    # What the benchmarks time beside such a copy as vitkit's own kernels: the copy it holds, not a second one.
    assert own_kernels_copy(fast, model, "fp32") is fast.single_images
    in_openvino = optimize(model, "fp32", runtime="openvino")
    assert isinstance(own_kernels_copy(in_openvino, model, "fp32"), vitkit.VisionTransformer)
    in_torch = optimize(model, "fp32", runtime="torch")
    assert own_kernels_copy(in_torch, model, "fp32") is in_torch


def test_openvino_pays_on_x86_cpus_where_it_is_installed_in_native_precisions(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(openvino_copy, "openvino_available", lambda: True)
    monkeypatch.setattr(machine, "x86", lambda: True)
    for native in (True, False):
        monkeypatch.setattr(machine, "bf16_is_native", lambda device="cpu", native=native: native)
        assert openvino_copy.openvino_pays("fp32", cpu) and openvino_copy.openvino_pays("bf16", cpu) == native
    assert not openvino_copy.openvino_pays("fp32", torch.device("cuda"))
    monkeypatch.setattr(machine, "x86", lambda: False)
    assert not openvino_copy.openvino_pays("fp32", cpu)
    monkeypatch.setattr(machine, "x86", lambda: True)
    monkeypatch.setattr(openvino_copy, "openvino_available", lambda: False)
    assert not openvino_copy.openvino_pays("fp32", cpu)


def test_auto_falls_back_to_vitkits_kernels_with_a_warning_when_openvino_fails(monkeypatch):
    needs_openvino()
    monkeypatch.setattr(openvino_copy, "openvino_pays", lambda precision, device: True)
    monkeypatch.setattr(openvino_copy, "OPENVINO_TOLERANCE", {"fp32": -1.0, "bf16": -1.0})  # no logits can pass
    with pytest.warns(UserWarning, match="logits differ from the model's .* vitkit's own kernels run it instead"):
        fast = optimize(small_model(), "fp32")
    assert isinstance(fast, vitkit.VisionTransformer)
    with pytest.raises(ValueError, match="logits differ from the model's"):  # asked for by name: refused
        optimize(small_model(), "fp32", runtime="openvino")


def test_openvino_refusals_name_the_fix(monkeypatch):
    model = small_model()
    with pytest.raises(ValueError, match="runtime='onnx': choose from auto, torch, openvino"):
        optimize(model, runtime="onnx")
    with pytest.raises(ValueError, match="runtime='onnx': choose from auto, torch, openvino"):
        optimize(model, "int8", runtime="onnx", calibration=torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match="those are torch's"):
        optimize(model, "fp32", runtime="openvino", pack=True)
    monkeypatch.setattr(openvino_copy, "openvino_available", lambda: False)
    with pytest.raises(ValueError, match="pip install openvino"):
        optimize(model, "fp32", runtime="openvino")
    with pytest.raises(ValueError, match="needs OpenVINO and NNCF: pip install openvino nncf"):
        optimize(model, "int8", runtime="openvino", calibration=torch.randn(2, 3, 32, 32))


def test_openvino_copy_keeps_what_the_checkpoint_records_and_is_for_inference_on_the_cpu_only(tmp_path):
    needs_openvino()
    model = small_model()
    model.class_names, model.trained_on = [f"c{i}" for i in range(10)], {"data": "shapes", "grayscale": False}
    fast = optimize(model, "fp32", runtime="openvino")
    assert (fast.class_names, fast.trained_on) == (model.class_names, model.trained_on)
    assert fast.eval() is fast and not fast.training
    with pytest.raises(ValueError, match="inference only"):
        fast.train()
    with pytest.raises(ValueError, match="on the CPU"):
        fast(torch.randn(1, 3, 32, 32, device="meta"))
    check_copy_like_the_model(fast, model, tmp_path)


def check_copy_like_the_model(fast: torch.nn.Module, model: torch.nn.Module, tmp_path) -> None:
    """A copy another engine runs takes what the model takes: images the model refuses are refused with its
    message, an empty batch gives empty logits, and export names the model to write instead of writing nothing."""
    c, (h, w) = model.config.in_chans, model.config.image_size
    for images in [torch.randn(2, c + 2, h, w), torch.randn(c, h, w), torch.randn(1, c, h // 2, w)]:
        with pytest.raises(ValueError) as by_model:
            model(images)
        with pytest.raises(ValueError, match=re.escape(str(by_model.value))):
            fast(images)
    assert fast(torch.randn(0, c, h, w)).shape == (0, model.config.num_classes)
    with pytest.raises(ValueError, match=f"{type(fast).__name__} is not a vitkit model.*export the model it was"):
        vitkit.export(fast, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


# --- int8 -----------------------------------------------------------------------------------------------------


def needs_torchao() -> None:
    pytest.importorskip("torchao", reason="int8 needs the optional torchao (PT2E quantization)")


def test_auto_never_chooses_int8_even_where_int8_is_fast(monkeypatch):
    monkeypatch.setattr(machine, "int8_fast_path_missing", lambda: None)
    for native in (True, False):
        monkeypatch.setattr(machine, "bf16_is_native", lambda device="cpu", native=native: native)
        assert machine.resolve_precision("auto") == ("bf16" if native else "fp32")
    fast = optimize(small_model())
    assert not isinstance(fast, int8_copy.Int8Model) and all(p.is_floating_point() for p in fast.parameters())


@pytest.mark.parametrize(
    ("capabilities", "missing"),
    [
        ({"avx2": True, "avx512_f": True}, True),
        ({"avx512_vnni": True}, False),
        ({"avx_vnni": True}, False),
        ({"amx_int8": True}, False),
    ],  # fmt: skip
    ids=["avx512-only", "avx512-vnni", "avx-vnni", "amx"],
)
def test_int8_fast_path_is_missing_only_without_vnni_or_amx(monkeypatch, capabilities, missing):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    message = machine.int8_fast_path_missing()
    assert (message is not None) == missing
    if missing:
        assert "VNNI" in message and "AMX" in message


def test_int8_refuses_missing_or_malformed_calibration_by_name():
    needs_torchao()
    model = small_model()
    with pytest.raises(ValueError, match="needs calibration="):
        optimize(model, "int8")
    with pytest.raises(ValueError, match=re.escape("got shape (3, 32, 32)")):
        optimize(model, "int8", calibration=torch.randn(3, 32, 32))
    with pytest.raises(ValueError, match="empty"):
        optimize(model, "int8", calibration=[])
    with pytest.raises(ValueError, match="only int8 is calibrated"):
        optimize(model, "fp32", calibration=torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match="compile=True"):
        optimize(model, "int8", compile=True, calibration=torch.randn(2, 3, 32, 32))


@pytest.mark.parametrize("runtime", ["torch", "openvino"])
def test_int8_refuses_calibration_images_the_model_does_not_take_with_the_models_message(runtime):
    """Before either quantizer sees them (OpenVINO's own exception; PT2E's guard on a later batch's size)."""
    needs_torchao()
    if runtime == "openvino":
        needs_nncf()
    model = small_model()
    size = re.escape("calibration: input of shape (2, 3, 16, 16) does not match the model: expected (B, 3, 32, 32)")
    with pytest.raises(ValueError, match=size):
        optimize(model, "int8", calibration=torch.randn(2, 3, 16, 16), runtime=runtime)
    with pytest.raises(ValueError, match=re.escape("calibration: input of shape (2, 1, 32, 32) has 1 channel")):
        optimize(model, "int8", calibration=[torch.randn(2, 3, 32, 32), torch.randn(2, 1, 32, 32)], runtime=runtime)


def test_calibration_reads_an_iterable_only_until_it_has_enough_images_and_uses_tensors_and_lists_whole():
    """A DataLoader over a whole training set is read for `CALIBRATION_IMAGES` images, not to its end (which could
    take hours and more memory than the machine has); what the caller holds already is used whole."""
    model = small_model()
    read = []

    def loader(batches: int):  # (images, labels) pairs, as a DataLoader yields them
        for _ in range(batches):
            read.append(100)
            yield torch.randn(100, 3, 32, 32), torch.zeros(100, dtype=torch.long)

    enough = -(-copies.CALIBRATION_IMAGES // 100)  # batches of 100 that hold CALIBRATION_IMAGES
    batches = copies.calibration_batches(loader(enough + 10), model)
    assert len(batches) == len(read) == enough and all(b.shape == (100, 3, 32, 32) for b in batches)
    assert len(copies.calibration_batches(loader(2), model)) == 2  # fewer: all of them
    held = torch.randn(copies.CALIBRATION_IMAGES + 100, 3, 32, 32)
    assert sum(map(len, copies.calibration_batches(held, model))) == len(held)
    assert sum(map(len, copies.calibration_batches(list(held.split(100)), model))) == len(held)
    assert len(copies.calibration_batches([torch.randn(0, 3, 32, 32), held[:2]], model)) == 1  # an empty batch: none


def test_int8_in_openvino_calibrates_a_few_images_a_pass_whatever_the_batches(monkeypatch):
    """NNCF's statistics model holds the input of every quantized layer for a whole pass: the images reach it
    `NNCF_CALIBRATION_BATCH` at a time, all of them, however the caller batched them."""
    needs_nncf()
    import nncf

    passes: list[int] = []
    quantize = nncf.quantize

    def counting(graph, dataset, *args, **kwargs):
        passes.extend(len(images) for images in dataset.get_inference_data())
        return quantize(graph, dataset, *args, **kwargs)

    monkeypatch.setattr(nncf, "quantize", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the missing-fast-path warning, on CPUs without VNNI: tested above
        optimize(small_model(), "int8", calibration=[torch.randn(20, 3, 32, 32), torch.randn(3, 3, 32, 32)])
    assert sum(passes) == 23 and max(passes) == openvino_copy.NNCF_CALIBRATION_BATCH, passes


def test_int8_refuses_a_copy_whose_linear_layers_the_quantizer_left_in_fp32(monkeypatch):
    """Where torch and torchao do not work together the quantizer annotates nothing (torch 2.11 with torchao 0.18),
    and the copy would run fp32 arithmetic under the name int8: refused, naming both versions."""
    needs_torchao()
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    monkeypatch.setattr(x86.X86InductorQuantizer, "annotate", lambda self, model: model)
    model = small_model(num_layers=1)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())  # qkv, proj, fc1, fc2, head
    with pytest.raises(
        ValueError, match=rf"quantized 0 of the model's {linears} linear layers, .*precision='bf16'"
    ) as e:
        optimize(model, "int8", calibration=torch.randn(2, 3, 32, 32), runtime="torch")
    assert f"torch {torch.__version__}" in str(e.value) and "torchao" in str(e.value)


@pytest.mark.slow
def test_int8_warns_where_the_cpu_has_no_fast_int8_path(monkeypatch):
    needs_torchao()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    with pytest.warns(UserWarning, match="no int8 dot-product instructions"):
        optimize(small_model(), "int8", calibration=torch.randn(4, 3, 32, 32))


def trained_digits_model(
    classifier: str = "token",
) -> tuple[vitkit.VisionTransformer, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A small ViT trained for a few seconds on scikit-learn's 8x8 digits (1,400 train, 397 test images)."""
    datasets = pytest.importorskip("sklearn.datasets", reason="the digits data set comes with scikit-learn")
    digits = datasets.load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 8 - 1  # (1797, 1, 8, 8) in [-1, 1]
    labels = torch.tensor(digits.target)
    model = vitkit.create_model("ViT-Ti/2", hidden_size=32, num_layers=2, mlp_dim=64, num_heads=2, num_classes=10,
                                image_size=8, in_chans=1, classifier=classifier)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        batch = torch.randint(0, 1400, (128,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), images[:1400], labels[:1400], images[1400:], labels[1400:]


def needs_nncf() -> None:
    needs_openvino()
    pytest.importorskip("nncf", reason="int8 in OpenVINO needs the optional nncf, its quantizer (vitkit[int8])")


@pytest.mark.slow
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_openvino_int8_is_what_auto_picks_and_keeps_a_trained_models_accuracy_at_any_batch_size(
    classifier, capsys, tmp_path
):
    """Where OpenVINO and NNCF are installed, "auto" quantizes with NNCF and runs the copy in OpenVINO: top-1 on
    held-out digits within 1 point of fp32 (4 of 397 images), with a class token and with GAP (which NNCF's
    SmoothQuant took to 23%), one image at a time (the single-image copy) as in one batch (the batch copy) to a
    quantization step, and NNCF's own progress output kept off the caller's."""
    needs_nncf()
    model, train_images, _, test_images, test_labels = trained_digits_model(classifier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the missing-fast-path warning, on CPUs without VNNI: tested above
        quantized = optimize(model, "int8", calibration=train_images[:256])
    assert isinstance(quantized, openvino_copy.OpenVINOModel) and "OpenVINO int8" in repr(quantized)
    assert quantized.config == model.config and capsys.readouterr().out == ""
    with torch.no_grad():
        fp32_top1 = (model(test_images).argmax(1) == test_labels).float().mean().item()
        logits = quantized(test_images)
        int8_top1 = (logits.argmax(1) == test_labels).float().mean().item()
        assert fp32_top1 >= 0.8, fp32_top1  # a trained model (chance: 0.1), so the bound below means something
        assert int8_top1 >= fp32_top1 - 0.01, (int8_top1, fp32_top1)
        single = torch.cat([quantized(test_images[i : i + 1]) for i in range(8)])
        assert (single - logits[:8]).abs().max() <= 0.05 * logits.abs().max()
    check_copy_like_the_model(quantized, model, tmp_path)


def test_int8_in_openvino_quantizes_the_linear_layers_and_leaves_attention_as_it_is(monkeypatch):
    """NNCF's graph: every linear layer's input comes through a FakeQuantize (the patch embedding's and the head's
    too); attention's inputs (queries, keys, values) do not, so attention runs in bf16 or fp32, as in the PT2E copy
    and the ONNX Runtime int8 the benchmark compares with."""
    needs_nncf()
    import nncf

    made = []
    quantize = nncf.quantize
    monkeypatch.setattr(nncf, "quantize", lambda *args, **kwargs: made.append(quantize(*args, **kwargs)) or made[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the missing-fast-path warning, on CPUs without VNNI: tested above
        optimize(small_model(), "int8", calibration=torch.randn(4, 3, 32, 32), runtime="openvino")
    ops = made[0].get_ordered_ops()

    def quantized(op) -> list[bool]:
        """Whether each input of `op` comes from a FakeQuantize, through layers that only move values."""
        found = []
        for i in op.inputs():
            source = i.get_source_output().get_node()
            while source.get_type_name() in ("Reshape", "Transpose", "Squeeze", "Split", "Gather"):
                source = source.input(0).get_source_output().get_node()
            found.append(source.get_type_name() == "FakeQuantize")
        return found

    linears = [op for op in ops if op.get_type_name() == "MatMul"]  # attention is one op of its own
    attention = [op for op in ops if op.get_type_name() == "ScaledDotProductAttention"]
    assert len(attention) == small_model().config.num_layers, [op.get_type_name() for op in ops]
    assert len(linears) == 4 * len(attention) + 2 and all(quantized(op)[0] for op in linears)
    assert not any(any(quantized(op)) for op in attention), [quantized(op) for op in attention]


# A child process, so that NNCF is imported afresh: importing it imports torch's C++ extension builder, whose
# "No CUDA runtime is found" note (logged wherever a CUDA toolkit is installed without a GPU) is not for the caller.
INT8_IN_A_FRESH_PROCESS = """
import warnings, torch, vitkit
warnings.simplefilter("ignore")  # the missing-fast-path warning, on CPUs without VNNI: tested above
model = vitkit.create_model("ViT-Ti/8", hidden_size=32, num_layers=1, mlp_dim=64, num_heads=4, image_size=32).eval()
print(type(vitkit.optimize(model, "int8", calibration=torch.randn(4, 3, 32, 32), runtime="openvino")).__name__)
"""


@pytest.mark.slow
def test_int8_in_openvino_says_nothing_of_cuda_on_a_cpu():
    needs_nncf()
    out = run_in_a_fresh_process(INT8_IN_A_FRESH_PROCESS)
    assert out.returncode == 0 and out.stdout.split() == ["OpenVINOModel"], (out.returncode, out.stderr[-2000:])
    assert "CUDA" not in out.stderr, out.stderr[-2000:]


def test_int8_runtime_choice_needs_nncf_for_openvino_and_falls_back_to_pt2e_where_nncf_fails(monkeypatch):
    """runtime="openvino" without NNCF is refused by name; "auto" without it quantizes with PT2E; where NNCF leaves
    the linear layers in fp32, runtime="openvino" is refused and "auto" warns and falls back to PT2E."""
    needs_nncf()
    needs_torchao()
    import nncf

    model, images = small_model(), torch.randn(4, 3, 32, 32)
    monkeypatch.setattr(openvino_copy, "nncf_available", lambda: False)
    with pytest.raises(ValueError, match="needs OpenVINO and NNCF: pip install openvino nncf"):
        optimize(model, "int8", calibration=images, runtime="openvino")
    pt2e = optimize(model, "int8", calibration=images)
    assert (
        isinstance(pt2e, int8_copy.Int8Model)
        and repr(pt2e).startswith("Int8Model(PT2E int8")
        and "\n" not in repr(pt2e)
    )
    monkeypatch.undo()
    monkeypatch.setattr(nncf, "quantize", lambda graph, *args, **kwargs: graph)  # quantizes nothing
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules()) + 1  # and the patch embedding's
    with pytest.raises(ValueError, match=f"NNCF quantized 0 of the compiled graph's {linears} linear layers"):
        optimize(model, "int8", calibration=images, runtime="openvino")
    with pytest.warns(UserWarning, match="PT2E quantizes it instead"):
        assert isinstance(optimize(model, "int8", calibration=images), int8_copy.Int8Model)


@pytest.mark.slow
def test_int8_keeps_a_trained_models_accuracy_and_matches_the_quantized_reference(tmp_path, monkeypatch):
    """Top-1 on held-out digits within 1 point of fp32 (4 of 397 images); the compiled int8 copy (oneDNN's int8
    linears) gives the logits of the quantized graph it was compiled from, which runs each layer as fp32 arithmetic
    on dequantized int8 values (the independent reference of the kernels), at batch sizes other than the
    calibration's. The layers between the int8 ones in fp32 (on any CPU), so that the comparison is exact."""
    needs_torchao()
    from torch._dynamo.utils import counters

    monkeypatch.setattr(int8_copy, "int8_mixes_bf16", lambda: False)

    model, train_images, _, test_images, test_labels = trained_digits_model()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the missing-fast-path warning, on CPUs without VNNI: tested above
        quantized = optimize(model, "int8", calibration=train_images[:256], runtime="torch")
    assert isinstance(quantized, int8_copy.Int8Model) and quantized.config == model.config
    with torch.no_grad():
        fp32_top1 = (model(test_images).argmax(1) == test_labels).float().mean().item()
        logits = quantized(test_images)
        int8_top1 = (logits.argmax(1) == test_labels).float().mean().item()
        assert counters["inductor"]["qlinear_weight_prepack_matcher_count"] > 0  # int8 kernels, not fake quant
        assert fp32_top1 >= 0.8, fp32_top1  # a trained model (chance: 0.1), so the bound below means something
        assert int8_top1 >= fp32_top1 - 0.01, (int8_top1, fp32_top1)
        reference = quantized.program._orig_mod
        # The kernels quantize with their own float arithmetic (fused into the layer before), so a value that falls
        # on a rounding boundary may take the neighbouring int8 level: a few rows move by about a quantization step
        # (at most 2% of the logits' scale; 1-3% of the rows with oneDNN's AVX2 kernels, 7-bit activations); all
        # others agree to float rounding.
        for x in (test_images, test_images[:1], test_images[:5]):
            want, got = reference(x), quantized(x)
            scale = want.abs().max()
            assert (got - want).abs().max() <= 0.02 * scale
            assert ((got - want).abs() <= 1e-4 * scale).float().mean() >= 0.95
    assert quantized.eval() is quantized and not quantized.training  # as `evaluate` calls it
    with pytest.raises(ValueError, match="inference only"):
        quantized.train()
    check_copy_like_the_model(quantized, model, tmp_path)


@pytest.mark.slow
def test_int8_without_int8_dot_products_quantizes_activations_to_7_bits(monkeypatch):
    """Where the CPU has no VNNI or AMX, PT2E's copy quantizes activations to 7 bits (0..127), the quantizer's remedy
    for oneDNN's uint8 x int8 pairs that saturate int16 there (with oneDNN held to AVX2, 8 bits cost a trained
    digits model 1-3 points of top-1); with them, 8 bits (0..255). Weights stay 8-bit either way."""
    needs_torchao()

    def ranges(copy) -> set[tuple[str, int]]:
        """(operator, quant_max) of each (de)quantize node: per tensor (activations) and per channel (weights)."""
        found = set()
        for n in copy.program._orig_mod.graph.nodes:
            if "quantize_per_" in str(n.target):
                name = n.target.__name__.split(".")[0]
                found.add((name, n.args[5] if name.endswith("per_channel") else n.args[4]))
        return found

    model, images = small_model(), torch.randn(8, 3, 32, 32)
    monkeypatch.setattr(machine, "int8_fast_path_missing", lambda: None)
    eight = ranges(optimize(model, "int8", calibration=images, runtime="torch"))
    monkeypatch.setattr(machine, "int8_fast_path_missing", lambda: "int8 dot-product instructions")
    with pytest.warns(UserWarning, match="int8 dot-product instructions"):
        seven = ranges(optimize(model, "int8", calibration=images, runtime="torch"))
    assert ("quantize_per_tensor", 255) in eight and ("quantize_per_tensor", 127) not in eight, eight
    assert ("quantize_per_tensor", 127) in seven and ("quantize_per_tensor", 255) not in seven, seven
    assert ("dequantize_per_channel", 127) in seven and ("dequantize_per_channel", 127) in eight  # int8 weights


@pytest.mark.slow
def test_int8_with_the_layers_between_in_bf16_keeps_a_trained_models_accuracy(monkeypatch):
    """PT2E's copy with attention, LayerNorm and GELU in bf16 (what `int8_mixes_bf16` picks with AMX): top-1 on
    held-out digits within 1 point of fp32, logits within bf16's and int8's rounding of the all-fp32 int8 copy's
    and not equal to them (the bf16 layers ran), one image as in a batch."""
    needs_torchao()
    model, train_images, _, test_images, test_labels = trained_digits_model()
    copies_of = {}
    for mix in (False, True):
        monkeypatch.setattr(int8_copy, "int8_mixes_bf16", lambda mix=mix: mix)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the missing-fast-path warning, on CPUs without VNNI: tested above
            copies_of[mix] = optimize(model, "int8", calibration=train_images[:256], runtime="torch")
    mixed = copies_of[True]
    assert mixed.bf16 and "other layers in bf16" in repr(mixed) and "other layers in fp32" in repr(copies_of[False])
    with torch.no_grad():
        fp32_top1 = (model(test_images).argmax(1) == test_labels).float().mean().item()
        logits, fp32_layers = mixed(test_images), copies_of[False](test_images)
        assert logits.dtype == torch.float32
        assert fp32_top1 >= 0.8 and (logits.argmax(1) == test_labels).float().mean().item() >= fp32_top1 - 0.01
        scale = fp32_layers.abs().max()
        assert 0 < (logits - fp32_layers).abs().max() <= 0.15 * scale
        assert (logits - fp32_layers).abs().mean() <= 0.02 * scale
        assert (mixed(test_images[:1]) - logits[:1]).abs().max() <= 0.05 * scale
