import os
from pathlib import Path

import pytest
import torch

# Two cores: keep torch from oversubscribing them, and make every test deterministic.
torch.set_num_threads(min(2, os.cpu_count() or 1))

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "official_jax"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fixtures_dir() -> Path:
    """The official JAX reference outputs in ../shared/fixtures (see its README)."""
    if not FIXTURES.is_dir():
        pytest.fail(f"official fixtures not found at {FIXTURES}: the shared/ folder must sit beside the checkout")
    return FIXTURES
