"""Fixtures and small helpers shared by the tests. Test files import the plain helpers with
`from conftest import tiny, ...` (pytest puts tests/ on sys.path)."""

import os
from pathlib import Path

import pytest
import torch

import vitkit

# Two cores: keep torch from oversubscribing them, and make every test deterministic.
torch.set_num_threads(min(2, os.cpu_count() or 1))

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "official_jax"

# The small ViT most tests use: 32 px images cut into a 4x4 grid of 8 px patches, width 32, 2 layers, 4 heads,
# 5 classes, the paper's defaults otherwise. Instant to build and to run on one core.
TINY = dict(image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, num_classes=5)


# The training tests' model: ViT-Ti/8 with this encoder (model_args), on 16 px images; a few seconds per run.
SMALL_ENCODER = {"hidden_size": 16, "num_layers": 2, "mlp_dim": 32, "num_heads": 2}
SRC = Path(__file__).resolve().parents[1] / "src"  # PYTHONPATH for the subprocesses (CLI, torchrun) of the tests


def subprocess_env(*paths: Path) -> dict[str, str]:
    """The environment of a test's subprocess (the CLI, torchrun, a benchmark script): this worktree's sources on
    the path (then `paths`), and one OpenMP thread a process."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (SRC, *paths)), "OMP_NUM_THREADS": "1"}


def run_weights(run_dir) -> dict[str, torch.Tensor]:
    """The final weights of a training run (its model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    """Equal tensor for tensor (atol=0: bit for bit)."""
    assert a.keys() == b.keys()
    for k in a:
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            assert torch.allclose(a[k], b[k], rtol=0, atol=atol), (k, (a[k] - b[k]).abs().max())


def tiny_config(**changes) -> vitkit.ViTConfig:
    """TINY with `changes` applied."""
    return vitkit.ViTConfig(**TINY | changes)


def tiny(**changes) -> vitkit.VisionTransformer:
    """A freshly initialised tiny_config(**changes) model in eval mode (call .train() to train it)."""
    return vitkit.VisionTransformer(tiny_config(**changes)).eval()


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Move every parameter off its initial value, so a skipped or mis-mapped tensor changes the output
    (zero-initialised heads and biases, unit LayerNorm scales would hide it). Returns the model in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fixtures_dir() -> Path:
    """The official JAX reference outputs committed in tests/fixtures/official_jax (see its README)."""
    assert FIXTURES.is_dir(), f"official fixtures missing at {FIXTURES}: they are part of the repository"
    return FIXTURES
