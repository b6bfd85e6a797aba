"""Fixtures shared by the tests; the plain helpers are in helpers.py (`from helpers import tiny, ...`)."""

import os
from pathlib import Path

import pytest
import torch

# Two cores: keep torch from oversubscribing them, and make every test deterministic.
torch.set_num_threads(min(2, os.cpu_count() or 1))

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "official_jax"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fixtures_dir() -> Path:
    """The official JAX reference outputs committed in tests/fixtures/official_jax (see its README)."""
    assert FIXTURES.is_dir(), f"official fixtures missing at {FIXTURES}: they are part of the repository"
    return FIXTURES
