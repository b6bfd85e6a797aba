"""`kernels.linear`: fp32 linear layers by oneDNN on AVX-512 CPUs that are not Intel's, the same values and gradients as
F.linear's. Each test forces the oneDNN path (`ONEDNN_FP32`), so that it is checked on Intel machines too. And
`kernels.attend`'s paths, each checked against SDPA in fp32."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import perturbed, tiny
from vitkit.models.architectures import new_model
from vitkit.models.vit import Attention, EncoderBlock
from vitkit.speed import kernels, machine

needs_onednn = pytest.mark.skipif(
    not kernels.library_available("onednn"), reason="this torch build has no oneDNN (torch.backends.mkldnn)"
)


@pytest.fixture
def onednn_calls(monkeypatch):
    """Force the oneDNN path and count its products."""
    if not kernels.library_available("onednn"):
        pytest.skip("this torch build has no oneDNN (torch.backends.mkldnn)")
    calls = []
    product = kernels._onednn

    def counted(x, weight, bias):
        calls.append(tuple(x.shape))
        return product(x, weight, bias)

    monkeypatch.setattr(kernels, "ONEDNN_FP32", True)
    monkeypatch.setattr(kernels, "_onednn", counted)
    return calls


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("learn_weight", [True, False])
def test_linear_by_onednn_gives_f_linears_values_and_gradients(onednn_calls, bias, learn_weight):
    torch.manual_seed(0)
    x = torch.randn(3, 40, 5, requires_grad=True).transpose(1, 2)  # (3, 5, 40), not contiguous
    weight = torch.randn(24, 40, requires_grad=learn_weight)
    b = torch.randn(24, requires_grad=True) if bias else None
    grad = torch.randn(3, 5, 24)

    y = kernels.linear(x, weight, b)
    grads = torch.autograd.grad(y, [t for t in (x, weight, b) if t is not None and t.requires_grad], grad)
    assert len(onednn_calls) == 1 + len(grads) - bias  # forward, input gradient, weight gradient (not the bias's)
    y_ref = F.linear(x, weight, b)
    ref = torch.autograd.grad(y_ref, [t for t in (x, weight, b) if t is not None and t.requires_grad], grad)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_linear_keeps_f_linear_under_autocast_and_for_other_dtypes(onednn_calls):
    x, layer = torch.randn(4, 8), kernels.Linear(8, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast's bf16 product, not an fp32 one
    assert layer.to(torch.float64)(x.double()).dtype == torch.float64
    assert onednn_calls == []
    layer.float()
    with torch.no_grad():
        assert torch.equal(layer(x), kernels._onednn(x, layer.weight, layer.bias))  # under no_grad too
    assert len(onednn_calls) == 2


@pytest.mark.slow  # compiling: seconds
def test_under_torch_compile_wide_layers_run_by_onednn_and_narrow_ones_by_f_linear(onednn_calls):
    torch.manual_seed(0)
    wide = kernels.COMPILED_MIN_FEATURES
    for features, by_onednn in ((wide, True), (wide // 2, False)):
        del onednn_calls[:]
        x, layer = torch.randn(4, features, requires_grad=True), kernels.Linear(features, features)
        y = torch.compile(layer, backend="aot_eager")(x)  # traced: an opaque call of vitkit::onednn_linear
        y.square().sum().backward()
        assert len(onednn_calls) == (3 if by_onednn else 0)  # forward, input and weight gradients
        grad_x, grad_w = x.grad, layer.weight.grad
        x.grad, layer.weight.grad = None, None
        y_ref = F.linear(x, layer.weight, layer.bias)
        y_ref.square().sum().backward()
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_x, x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_w, layer.weight.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # inductor compiles C++: seconds
def test_inductor_compiles_a_training_step_around_the_onednn_operator(onednn_calls):
    if not machine.compiler_present(torch.device("cpu")):
        pytest.skip("torch.compile needs a C++ compiler and Python's C headers (Debian: g++, python3-dev)")
    torch.manual_seed(0)
    wide = kernels.COMPILED_MIN_FEATURES
    layer = kernels.Linear(wide, wide)
    x = torch.randn(6, wide, requires_grad=True)
    y = torch.compile(lambda x: F.gelu(layer(x)))(x)  # inductor fuses the GELU around the opaque call
    y.sum().backward()
    assert len(onednn_calls) == 3
    grads = x.grad, layer.weight.grad, layer.bias.grad
    x.grad = layer.weight.grad = layer.bias.grad = None
    y_ref = F.gelu(F.linear(x, layer.weight, layer.bias))
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, (x.grad, layer.weight.grad, layer.bias.grad), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # exporting: seconds
@pytest.mark.parametrize("strict", [True, False])
def test_exported_graphs_hold_the_standard_linear(onednn_calls, strict):
    wide = kernels.COMPILED_MIN_FEATURES  # a layer that `torch.compile` would run by oneDNN
    program = torch.export.export(kernels.Linear(wide, wide), (torch.randn(4, wide),), strict=strict)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "aten.linear.default" in targets and not any("vitkit" in t for t in targets)


@needs_onednn
def test_a_vit_training_step_by_onednn_gives_the_same_gradients(monkeypatch):
    torch.manual_seed(0)
    model = new_model(
        "ViT-Ti/4",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        mlp_dim=64,
        image_size=16,
        num_classes=5,
        representation_size=16,
    )
    x, labels = torch.randn(3, 3, 16, 16), torch.tensor([0, 3, 4])
    grads = {}
    for forced in (False, True):
        monkeypatch.setattr(kernels, "ONEDNN_FP32", forced)
        model.zero_grad()
        F.cross_entropy(kernels.install(model)(x), labels).backward()
        grads[forced] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads[True]) == len(list(model.parameters()))
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-6, msg=name)


@needs_onednn
def test_onednn_is_chosen_for_fp32_on_cpus_with_avx512_that_are_not_intels(monkeypatch):
    if not kernels.library_available("mkl"):
        pytest.skip("this torch build has no MKL, so oneDNN is the only fp32 library")
    assert kernels.ONEDNN_FP32 == kernels.onednn_fp32()  # decided at import, as the probes decide now
    x86 = machine.x86()
    for intel in (True, False):
        for capability in ("AVX2", "AVX512"):
            monkeypatch.setattr(machine, "cpu_is_intel", lambda intel=intel: intel)
            monkeypatch.setattr(machine, "cpu_capability", lambda c=capability: c)
            assert kernels.onednn_fp32() == (x86 and not intel and capability == "AVX512")


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_training_attention_on_cpu_runs_in_fp32_and_matches_it(with_bias):
    # Training in bf16 on a CPU, `attend` computes in fp32 (PyTorch's bf16 attention backward is slow there):
    # its output is fp32 attention of the bf16 inputs, rounded to bf16, and its gradients are fp32's, rounded.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g).bfloat16().requires_grad_() for _ in range(3))
    bias = torch.randn(3, 10, 10, generator=g).bfloat16() if with_bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = kernels.attend(q, k, v, bias, 0.0)
    assert y.dtype == torch.bfloat16
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    mask = None if bias is None else bias.float()
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    assert torch.equal(y.float(), ref.bfloat16().float())  # computed in fp32, then rounded once
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad.bfloat16())
    ref.backward(grad.bfloat16().float())
    for t, t32 in ((q, q32), (k, k32), (v, v32)):
        assert t.grad.dtype == torch.bfloat16
        torch.testing.assert_close(t.grad.float(), t32.grad, atol=0, rtol=2**-7)  # bf16 rounding of fp32's gradient
    with torch.no_grad():  # inference keeps bf16 (fast in the forward pass)
        assert kernels.attend(q, k, v, bias, 0.0).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_attention_on_cpu_is_written_out_and_matches_sdpa(monkeypatch, dtype):
    # Under torch.compile, CPU training takes `attend_explicit` (the compiler fuses it; faster than compiled SDPA).
    # Compiling takes seconds, so the compiler's flag is set by hand: the same branch, the same arithmetic.
    explicit, calls = kernels.attend_explicit, []
    monkeypatch.setattr(kernels, "attend_explicit", lambda *args: calls.append(1) or explicit(*args))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    bias = torch.randn(3, 10, 10, generator=g).to(dtype)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    y = kernels.attend(q, k, v, bias, 0.0)
    assert calls == [1] and y.dtype == dtype
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=bias.float())
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # bf16 matmuls
    torch.testing.assert_close(y.float(), ref, **tol)
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad.to(dtype))
    ref.backward(grad.to(dtype).float())
    for t, t32 in ((q, q32), (k, k32), (v, v32)):
        torch.testing.assert_close(t.grad.float(), t32.grad, **tol)
    with torch.no_grad():  # inference keeps the SDPA kernel
        kernels.attend(q, k, v, bias, 0.0)
    assert calls == [1]


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_inference_attention_on_a_cpu_without_amx_is_written_out_piecewise_and_matches_sdpa(monkeypatch, amx):
    # With AVX-512 BF16 but no AMX, bf16 inference attention is two batched matmuls and a bf16 softmax, a few images
    # at a time (SDPA's bf16 kernel is slow there); with AMX it stays SDPA. Both checked on every machine.
    written, calls = kernels.attend_bf16_cpu, []
    monkeypatch.setattr(kernels, "attend_bf16_cpu", lambda *args: calls.append(1) or written(*args))
    monkeypatch.setattr(kernels, "_cpu_bf16_without_amx", lambda: not amx)
    monkeypatch.setattr(kernels, "BF16_CPU_LOGITS", 2 * 3 * 10 * 10)  # pieces of 2 images: 5 images in 3 pieces
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 3, 10, 8, generator=g).bfloat16() for _ in range(3))
    bias = torch.randn(3, 10, 10, generator=g).bfloat16()
    per_image = torch.randn(5, 3, 10, 10, generator=g).bfloat16()  # a mask of each image's own
    with torch.no_grad():
        for b in (None, bias, per_image):
            mask = None if b is None else b.float()
            want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
            y = kernels.attend(q, k, v, b, 0.0)
            assert y.dtype == torch.bfloat16 and y.shape == q.shape
            torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)  # bf16 matmuls and probabilities
        assert calls == ([] if amx else [1, 1, 1])
        kernels.attend(q.float(), k.float(), v.float(), None, 0.0)  # fp32 keeps SDPA
        assert len(calls) == (0 if amx else 3)
    kernels.attend(q.requires_grad_(), k, v, bias, 0.0)  # training keeps its own path
    assert len(calls) == (0 if amx else 3)


def test_a_traced_models_attention_scale_is_a_constant_not_computed_from_the_shape():
    """In a TorchScript trace (how OpenVINO's frontend converts the model for `optimize`) 1/sqrt(d) is a constant:
    computed from the traced shape, it was a few shape operations a layer on every call."""
    model = new_model("ViT-Ti/8", hidden_size=32, num_layers=2, mlp_dim=64, num_heads=4, image_size=32).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace's deprecation; the tracer's notes on the model's shape checks
        traced = torch.jit.trace(kernels.install(model), x, check_trace=False)
    powers = [node for node in traced.inlined_graph.nodes() if node.kind() == "aten::pow"]
    assert not powers, powers
    y = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(traced(y), model(y), atol=1e-6)


@pytest.mark.parametrize(
    "changes, shape", [({}, (2, 3, 32, 32)), ({"patch_size": 7, "in_chans": 1, "image_size": 28}, (3, 1, 28, 28))]
)
def test_patch_embedding_as_a_matrix_product_equals_the_strided_convolution(changes, shape):
    """`PatchGemm` flattens each patch in the Conv2d weight's (channel, row, column) order: the same as the
    convolution E is stored for, to fp32 rounding, and in the same row-major patch order; gradients agree too."""
    model = perturbed(tiny(**changes))
    x = torch.randn(*shape, requires_grad=True)
    conv = model.patch_embed(x)  # (B, gh*gw, D) by the stock convolution
    ours = kernels.install(model).patch_embed(x)
    assert type(model.embedding) is kernels.PatchGemm
    torch.testing.assert_close(ours, conv, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(conv)
    ours_grads = torch.autograd.grad(ours, [x, model.embedding.weight], g)
    conv_grads = torch.autograd.grad(conv, [x, model.embedding.weight], g)
    for a, b in zip(ours_grads, conv_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "changes",
    [{}, {"classifier": "gap", "posemb": "relative"}, {"representation_size": 16, "posemb": "learn2d"}],
)
@pytest.mark.parametrize("onednn", [False, True])
def test_install_keeps_the_parameters_and_gives_the_plain_models_logits_and_gradients(monkeypatch, changes, onednn):
    """The installed layers are the stock ones run by other kernels: the same parameter objects and state dict, the
    same logits and gradients (fp32 rounding); `uninstall` gives back the stock classes."""
    if onednn and not kernels.library_available("onednn"):
        pytest.skip("this torch build has no oneDNN (torch.backends.mkldnn)")
    monkeypatch.setattr(kernels, "ONEDNN_FP32", onednn)
    plain = perturbed(tiny(**changes))
    fast = copy.deepcopy(plain)
    parameters = list(fast.parameters())
    kernels.install(fast)
    assert list(fast.parameters()) == parameters and fast.state_dict().keys() == plain.state_dict().keys()
    kinds = {type(m) for m in fast.modules()}
    assert kernels.CpuAttention in kinds and Attention not in kinds and kernels.PatchGemm in kinds
    assert (kernels.Linear in kinds) == onednn and (torch.nn.Linear in kinds) != onednn
    x = torch.randn(3, 3, *plain.config.image_size)
    labels = torch.tensor([0, 1, 2])
    for model in (plain, fast):
        F.cross_entropy(model(x), labels).backward()
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(plain.named_parameters(), fast.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    kinds = {type(m) for m in kernels.uninstall(fast).modules()}
    assert kinds.isdisjoint(kernels.PLAIN) and Attention in kinds and EncoderBlock in kinds


def test_install_leaves_a_model_on_another_device_stock():
    """On the meta device (as on a GPU) the stock layers stay: the CPU kernels are for CPUs."""
    model = kernels.install(tiny().to("meta"))
    assert {type(m) for m in model.modules()}.isdisjoint(kernels.PLAIN)
