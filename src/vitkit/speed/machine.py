"""What this machine has, read once: the CPU (name, vendor, family and model), the instruction sets ATen runs,
native bf16, a compiler for `torch.compile`, and glibc's malloc, which `retain_freed_memory` tunes; and, while a run
trains, whether other work shares its cores (`ThreadWatch`).

Every "does this machine have X" question is asked here, so that the modules that choose a code path (`kernels`,
`inference`, `recipes`) and the benchmarks that record where they ran read the same facts.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PRECISIONS = ("auto", "fp32", "bf16")


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("model name", "cpu family", "model", "flags", ...); empty
    where there is no such file (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").split("\n\n")[0].splitlines()
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, sep, value in (line.partition(":") for line in lines) if sep}


@functools.cache
def cpu_name() -> str:
    """The CPU's name with its family and model where /proc/cpuinfo has them ("AMD EPYC" alone names several
    generations); else what `platform` knows."""
    fields = cpuinfo()
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    known = "cpu family" in fields and "model" in fields
    return fields["model name"] + (f" (family {fields['cpu family']}, model {fields['model']})" if known else "")


@functools.cache
def cpu_is_intel() -> bool:
    """Whether this CPU is Intel's (MKL's fast code paths are for Intel CPUs; on others it takes generic ones)."""
    name = torch.cpu.get_capabilities().get("cpu_name", "") if hasattr(torch.cpu, "get_capabilities") else ""
    if not name:
        if not cpuinfo():
            return True  # unknown: keep the default of torch's own fp32 GEMM (MKL)
        name = " ".join(cpuinfo().get(key, "") for key in ("vendor_id", "model name"))
    return "intel" in name.lower()


def x86() -> bool:
    """Whether this is an x86-64 CPU."""
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_capability() -> str:
    """The widest instruction set ATen runs its CPU kernels with here: "AVX512", "AVX2", "DEFAULT", ..."""
    return torch.backends.cpu.get_cpu_capability()


def avx512() -> bool:
    """Whether ATen runs this CPU's AVX-512 kernels."""
    return cpu_capability().startswith("AVX512")


@functools.cache
def avx512_bf16() -> bool:
    """Whether the CPU has AVX-512 BF16 (bf16 dot products in hardware)."""
    return bool(torch.cpu._is_avx512_bf16_supported())


@functools.cache
def amx() -> bool:
    """Whether the CPU has AMX tiles (bf16 matrix products in hardware)."""
    return bool(torch.cpu._is_amx_tile_supported())


def bf16_is_native(device: torch.device | str = "cpu") -> bool:
    """Whether `device` has bfloat16 arithmetic in hardware (not emulated in fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return avx512_bf16() or amx()
    return False


def int8_fast_path_missing() -> str | None:
    """What this CPU lacks for fast int8 matrix products, or None where it has them: oneDNN's int8 GEMMs multiply
    with VNNI (AVX-512 VNNI, AVX-VNNI) or AMX dot-product instructions; without them int8 has no fast path."""
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if any(capabilities.get(name) for name in ("avx512_vnni", "avx_vnni", "amx_int8")):
        return None
    return "int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX)"


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """ "auto" -> "bf16" where it is native on `device`, else "fp32"; "fp32" and "bf16" stay as they are."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown: choose one of {', '.join(PRECISIONS)}.")
    if precision == "auto":
        return "bf16" if bf16_is_native(device) else "fp32"
    return precision


def compiler_present(device: torch.device) -> bool:
    """Whether torch.compile's default backend can build code here: Triton for CUDA; for a CPU a C++ compiler
    and Python's C headers (inductor's CPU kernels are Python extensions; Debian ships them in python3-dev).
    Asked afresh each time: a compiler may be installed while the process runs."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    if not (Path(sysconfig.get_path("include")) / "Python.h").is_file():
        return False
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()  # runs `g++ --version` (or $CXX's), raising when there is none
    except Exception:
        return False
    return True


# The /proc/cpuinfo flags that decide which kernels run: AVX-512 for oneDNN's fp32 layers, bf16 and AMX for bf16.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
# Environment variables with which ATen (and inductor), oneDNN and MKL run narrower instruction sets than the CPU has:
# a figure measured under one of them is a figure of that instruction set, so a record names those that were set.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def describe() -> dict[str, Any]:
    """What figures measured here were measured on: the CPU, its flags that matter, native bf16, threads, versions."""
    fields = cpuinfo()
    family, model = fields.get("cpu family"), fields.get("model")
    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "family": int(family) if family and family.isdigit() else None,
        "model": int(model) if model and model.isdigit() else None,
        "flags": [flag for flag in CPU_FLAGS if flag in fields.get("flags", "").split()],
        "cores": os.cpu_count(),
        "cpu_capability": cpu_capability(),
        "bf16_native_cpu": bf16_is_native("cpu"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    limits = {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}
    if limits:
        info["isa_limits"] = limits
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["bf16_native_gpu"] = bf16_is_native("cuda")
    return info


class _NoCudaRuntimeNote(logging.Filter):
    """Drops torch's "No CUDA runtime is found" warning, which it logs on compiling wherever a CUDA toolkit is
    installed without a GPU: code compiled for the CPU needs no CUDA runtime. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


CUDA_NOTE_FILTER = _NoCudaRuntimeNote()


def compile_quietly_on(device: torch.device) -> None:
    """Before torch.compile for `device`: on a CPU, silence that one warning of torch's C++ extension builder
    (once per process: adding the same filter again changes nothing)."""
    if device.type == "cpu":
        logging.getLogger("torch.utils.cpp_extension").addFilter(CUDA_NOTE_FILTER)


class _EnumConstantNote(logging.Filter):
    """Drops torch's warning that registering an Enum as a pytree constant is deprecated, which it logs when torchao
    (the int8 path's quantizer) is imported: a note to torchao's authors, not to vitkit's users."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


ENUM_NOTE_FILTER = _EnumConstantNote()


def import_torchao_quietly() -> None:
    """Before importing torchao: silence torch's deprecation note about how torchao registers its Enums."""
    logging.getLogger("torch.utils._pytree").addFilter(ENUM_NOTE_FILTER)


# glibc's malloc hands freed memory back to the system: a block above M_MMAP_THRESHOLD (128 KiB at first) is unmapped
# when freed, and the top of the heap is cut back once more than M_TRIM_THRESHOLD lies free there. A training step
# frees all its activations at its end, so the next step would map them again and take a page fault on every 4 KiB
# page it touches. Raising both thresholds keeps that memory in the process (figures in docs/PERFORMANCE.md).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 256 << 20  # blocks up to this size come from the heap (glibc's dynamic threshold stops at 32 MiB)
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before it is returned


def glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc (whose malloc `retain_freed_memory` sets), else None."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # only glibc has it


def retain_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for the next allocation instead of returning it to the system (and
    faulting it in again): for a process that runs the same steps over and over, as `vitkit` commands do (the CLI
    calls it). Process-wide and for good: a script that trains calls it once at its start. Returns False where the C
    library is not glibc (nothing changes there)."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def cpu_seconds() -> tuple[float, float] | None:
    """(the CPU seconds this process has used, all its threads together; the seconds the cores it may run on have
    spent idle, /proc/stat's idle and iowait), both since they started; None where there is no /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    cores = {f"cpu{i}" for i in os.sched_getaffinity(0)}  # a cpuset or taskset leaves the machine's others out
    ticks = (line.split() for line in lines if line.startswith("cpu"))  # cpuN user nice system idle iowait ...
    idle = sum(int(fields[4]) + int(fields[5]) for fields in ticks if fields[0] in cores)
    return time.process_time(), idle / os.sysconf("SC_CLK_TCK")


class ThreadWatch:
    """Keeps a training run's torch CPU threads to the cores it gets. Oversubscribed threads wait for each other at
    every parallel region: two main-job runs of 2 threads each on 2 cores took 6-10x as long as two of 1 thread.

    Measured over windows of at least `WINDOW_S` seconds of steps: while the threads get less than `STARVED` of a
    core each and fewer than `BUSY` cores lie idle (other work has them: alone, threads that wait leave the cores
    idle), `PATIENCE` windows in a row, the run goes on with as many threads as the cores it got (at least one);
    while `FREE` cores lie idle, it goes back up towards the count it started with. One line says so, the first time.
    Threads only change the speed, and the last bits of a sum split between them (see docs/PERFORMANCE.md).

    Active only on the CPU and where the threads were not chosen (`--threads 0`, no OMP_NUM_THREADS). `clock` and
    `usage` (`cpu_seconds`' reading) are for tests."""

    WINDOW_S = 1.0
    STARVED = 0.6
    BUSY = 0.5
    FREE = 0.75
    PATIENCE = 2

    def __init__(
        self,
        threads: int,
        device: torch.device,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.perf_counter,
        usage: Callable[[], tuple[float, float] | None] = cpu_seconds,
    ) -> None:
        self.say, self.clock, self.usage = say, clock, usage
        self.threads = torch.get_num_threads()  # the count it started with, the most it goes back up to
        first = usage()
        chosen = threads != 0 or "OMP_NUM_THREADS" in os.environ
        self.active = not chosen and device.type == "cpu" and first is not None
        self.last = (clock(), *(first or (0.0, 0.0)))  # (wall, process CPU, machine idle) seconds
        self.starved = self.free = 0  # windows in a row
        self.told = False

    def after_step(self) -> None:
        """After each training step: at the end of a window, fewer threads while starved, more while cores are free."""
        wall_now = self.clock()
        if not self.active or wall_now - self.last[0] < self.WINDOW_S:
            return
        now = (wall_now, *(self.usage() or (0.0, 0.0)))
        wall, cpu, idle = (b - a for a, b in zip(self.last, now, strict=True))
        self.last = now
        threads, share, idle_cores = torch.get_num_threads(), cpu / wall, idle / wall  # share: the cores it got
        starved = threads > 1 and share / threads < self.STARVED and idle_cores < self.BUSY
        self.starved = self.starved + 1 if starved else 0
        self.free = self.free + 1 if threads < self.threads and idle_cores >= self.FREE else 0
        if self.starved >= self.PATIENCE:
            fewer = max(1, min(threads - 1, round(share)))
            torch.set_num_threads(fewer)
            self.starved = 0
            if not self.told:
                self.told = True
                cores = len(os.sched_getaffinity(0))
                self.say(
                    f"the {cores} cores are shared with other work (this run's {threads} threads got {share:.1f} of "
                    f"them): training on {fewer} thread{'s' * (fewer > 1)} while they are, more when they are free "
                    "again; --threads N to choose"
                )
        elif self.free >= self.PATIENCE:
            torch.set_num_threads(min(self.threads, threads + max(1, round(idle_cores))))
            self.free = 0
