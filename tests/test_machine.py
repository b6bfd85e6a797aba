"""`vitkit.speed.machine`: the facts about this machine that choose code paths (read once),
`retain_freed_memory`, which keeps glibc's malloc from handing each step's memory back to the system, and
`ThreadWatch`, which keeps a run's threads to the cores it gets."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import SRC
from vitkit.speed import machine


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


def test_a_record_names_the_instruction_set_limits_it_ran_under(monkeypatch):
    for name in machine.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert "isa_limits" not in machine.describe()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "")
    assert machine.describe()["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


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
from vitkit.speed import machine
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


class SharedCores:
    """A machine for `ThreadWatch`: its clock, and this process's and the idle cores' CPU seconds, moved on by
    `window` as given."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.idle = 0.0

    def usage(self) -> tuple[float, float]:
        return self.cpu, self.idle

    def window(self, watch: machine.ThreadWatch, got: float, idle: float) -> int:
        """One window of steps in which this run got `got` cores and `idle` cores lay idle; the threads after it."""
        step = watch.WINDOW_S / 4  # a window of four steps
        for _ in range(4):
            self.wall, self.cpu, self.idle = self.wall + step, self.cpu + got * step, self.idle + idle * step
            watch.after_step()
        return torch.get_num_threads()


@pytest.fixture
def four_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(threads)


def watch_on(cores: SharedCores, said: list[str], threads: int = 0, device: str = "cpu") -> machine.ThreadWatch:
    """A `ThreadWatch` on `cores` for a run given `--threads threads` on `device`, saying its lines into `said`."""
    return machine.ThreadWatch(
        threads, torch.device(device), say=said.append, clock=lambda: cores.wall, usage=cores.usage
    )


def test_thread_watch_lowers_the_threads_to_the_cores_the_run_gets_while_other_work_keeps_them_busy(four_threads):
    cores, said = SharedCores(), []
    watch = watch_on(cores, said)
    assert cores.window(watch, got=3.9, idle=0.0) == 4  # alone on 4 cores: every thread busy
    assert cores.window(watch, got=1.9, idle=0.1) == 4  # starved once: a burst of other work, no change yet
    assert cores.window(watch, got=1.9, idle=0.1) == 2  # starved twice in a row: the 1.9 cores it got
    assert len(said) == 1 and "this run's 4 threads got 1.9 of them" in said[0] and "--threads N" in said[0]
    assert cores.window(watch, got=0.5, idle=0.0) == 2
    assert cores.window(watch, got=0.5, idle=0.0) == 1  # never below one thread
    assert len(said) == 1  # the one line says that it follows the cores from then on


def test_thread_watch_goes_back_up_to_its_first_count_when_cores_are_idle_again(four_threads):
    cores, said = SharedCores(), []
    watch = watch_on(cores, said)
    for _ in range(2):
        cores.window(watch, got=1.0, idle=0.0)
    assert torch.get_num_threads() == 1
    assert cores.window(watch, got=1.0, idle=3.0) == 1
    assert cores.window(watch, got=1.0, idle=3.0) == 4  # the other work has stopped: all its threads again
    assert cores.window(watch, got=3.9, idle=0.1) == 4 and cores.window(watch, got=3.9, idle=0.1) == 4
    assert len(said) == 1


def test_thread_watch_keeps_threads_that_wait_while_the_cores_lie_idle(four_threads):
    cores, said = SharedCores(), []
    watch = watch_on(cores, said)
    for _ in range(5):  # threads idle on their own (reading data, writing a checkpoint): not other work's doing
        assert cores.window(watch, got=1.0, idle=3.0) == 4
    assert said == []


@pytest.mark.parametrize("threads, device", [(4, "cpu"), (0, "cuda")])
def test_thread_watch_changes_nothing_where_threads_were_chosen_or_the_run_is_on_a_gpu(four_threads, threads, device):
    cores, said = SharedCores(), []
    watch = watch_on(cores, said, threads=threads, device=device)
    for _ in range(4):
        assert cores.window(watch, got=1.0, idle=0.0) == 4
    assert said == []


def test_thread_watch_leaves_threads_chosen_by_omp_num_threads_alone(four_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    cores, said = SharedCores(), []
    watch = watch_on(cores, said)
    for _ in range(4):
        assert cores.window(watch, got=1.0, idle=0.0) == 4
    assert said == []


def test_cpu_seconds_reads_this_process_and_the_idle_cores():
    first = machine.cpu_seconds()
    if first is None:
        pytest.skip("needs Linux's /proc/stat")
    sum(i * i for i in range(200_000))
    second = machine.cpu_seconds()
    assert second is not None and second[0] > first[0] and second[1] >= first[1] > 0
