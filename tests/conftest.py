"""Fixtures shared by the tests; the plain helpers are in helpers.py (`from helpers import tiny, ...`)."""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

# Two cores: keep torch from oversubscribing them, and make every test deterministic.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# torch starts autograd's threads at the first backward pass of a process, one per device it counts then; when a
# dynamo export (an ONNX export) ran before it, devices are counted and torch refuses backward in every process
# forked later. The fork-based kill test of test_run_safety.py needs children that can train whatever ran before
# it, so the first backward pass of the session is this one.
torch.ones(1, requires_grad=True).sum().backward()

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "official_jax"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# A freed signal stack is reported once, at the test after which it was found, not again at every later one.
_signal_stack_freed: list[bool] = []


@pytest.fixture(autouse=True)
def _signal_stack_stays_mapped():
    yield
    from helpers import signal_stack_is_mapped

    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread() or _signal_stack_freed:
        return
    if not signal_stack_is_mapped():
        _signal_stack_freed.append(True)
        pytest.fail(
            "the main thread's alternate signal stack was freed (by this test or an earlier one that made an "
            "openvino.Core of its own): the next signal would crash the test process; compile with "
            "vitkit.speed.openvino_copy.openvino_core()"
        )


@pytest.fixture
def fixtures_dir() -> Path:
    """The official JAX reference outputs committed in tests/fixtures/official_jax (see its README)."""
    assert FIXTURES.is_dir(), f"official fixtures missing at {FIXTURES}: they are part of the repository"
    return FIXTURES
