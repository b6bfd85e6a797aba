"""`kernels.linear`: fp32 linear layers by oneDNN on AVX-512 CPUs that are not Intel's, the same values and gradients as
F.linear's. Each test forces the oneDNN path (`ONEDNN_FP32`), so that it is checked on Intel machines too."""

import pytest
import torch
import torch.nn.functional as F

from vitkit import kernels, machine
from vitkit.architectures import new_model

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
    model = new_model("ViT-Ti/4", hidden_size=32, num_layers=2, num_heads=2, mlp_dim=64, image_size=16,
                      num_classes=5, representation_size=16)  # fmt: skip
    x, labels = torch.randn(3, 3, 16, 16), torch.tensor([0, 3, 4])
    grads = {}
    for forced in (False, True):
        monkeypatch.setattr(kernels, "ONEDNN_FP32", forced)
        model.zero_grad()
        F.cross_entropy(model(x), labels).backward()
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
