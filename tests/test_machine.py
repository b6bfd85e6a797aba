"""`vitkit.machine`: the facts about this machine that choose code paths (read once), and
`retain_freed_memory`, which keeps glibc's malloc from handing each step's memory back to the system."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import SRC
from vitkit import machine


def test_the_machine_names_the_cpus_family_and_model_where_proc_cpuinfo_has_them():
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        pytest.skip("needs Linux's /proc/cpuinfo")
    if "cpu family" not in first:
        pytest.skip("needs an x86 /proc/cpuinfo (cpu family, model)")
    fields = {line.split(":")[0].strip(): line.split(":")[-1].strip() for line in first.splitlines()}
    info = machine.describe()
    assert info["cpu"] == f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"
    assert (info["family"], info["model"]) == (int(fields["cpu family"]), int(fields["model"]))
    assert info["flags"] == [f for f in machine.CPU_FLAGS if f in fields["flags"].split()]


def test_auto_precision_picks_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(machine, "bf16_is_native", lambda device="cpu": False)
    assert machine.resolve_precision("auto") == "fp32"
    monkeypatch.setattr(machine, "bf16_is_native", lambda device="cpu": True)
    assert machine.resolve_precision("auto") == "bf16"
    assert machine.resolve_precision("fp32") == "fp32"


def test_compiler_present_is_false_without_a_cxx_compiler_or_pythons_headers(monkeypatch, tmp_path):
    import sysconfig

    import torch._inductor.config as inductor

    cpu = torch.device("cpu")
    if not machine.compiler_present(cpu):
        pytest.skip("needs a C++ compiler and Python's headers (python3-dev), so that removing one is seen")
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # torch's own override: monkeypatch's undo would delete it
        assert machine.compiler_present(cpu) is False
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path) if name == "include" else real(name))
    assert machine.compiler_present(cpu) is False


# A child process, so that the setting (process-wide, for good) is tried from glibc's defaults: it allocates 20
# blocks of 4 MiB, writes them and frees them all, five times over, and counts the page faults of the last four.
FAULTS = """
import resource, sys, torch
from vitkit import machine
def faults():
    for i in range(5):
        if i == 1:
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(1 << 20) for _ in range(20)]
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
before = faults()
assert machine.retain_freed_memory()
print(before, faults())
"""


@pytest.mark.skipif(machine.glibc() is None, reason="needs glibc's malloc")
def test_retained_freed_memory_is_not_faulted_in_again_at_every_step():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    pages = 4 * 20 * (4 << 20) // 4096  # the pages the last four rounds write (by default glibc faults them in
    assert before > pages / 8 and after < pages / 20, (before, after, pages)  # again in one round to all four)


def test_importing_torchao_quietly_drops_only_torchs_enum_registration_note():
    import logging

    logger = logging.getLogger("torch.utils._pytree")
    note = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque"

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)

    machine.import_torchao_quietly()
    machine.import_torchao_quietly()
    try:
        assert logger.filters.count(machine.ENUM_NOTE_FILTER) == 1
        assert not logger.filter(record(note))
        assert logger.filter(record("some other pytree warning"))
    finally:
        logger.removeFilter(machine.ENUM_NOTE_FILTER)
