"""Two training runs started at once on one machine's cores, by how their threads are set, and one run alone: the
wall seconds of each `vitkit train` process and of its steps, the settings interleaved round by round, written as a
JSON record (machine, date, commit, command, every run, the load average around each setting).

    python benchmarks/threads_under_load.py [--steps 300] [--rounds 2] [--data fashion-mnist] \\
        --out benchmarks/results/threads-under-load-<cpu>.json

The settings: `chosen`, both runs on torch's default count chosen outright (OMP_NUM_THREADS: `ThreadWatch` stays
off, as vitkit ran before it); `watched`, both left to vitkit (`ThreadWatch` follows the cores they get); `one`,
both on --threads 1; `alone`, one run left to vitkit. Each run trains --steps steps with --eval-every 0 (evaluated
once, at the end). --tiny: 2 steps of a one-layer model on the synthetic shapes, one round, for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vitkit.speed.benchmark import record_header, write_record

SETTINGS = ("chosen", "watched", "one", "alone")
TINY = ["--data", "shapes", "--model-args", "hidden_size=32,num_layers=1,num_heads=2,mlp_dim=64"]
SAID = "shared with other work"  # in ThreadWatch's line


def load_average() -> float | None:
    """The machine's load average over the last minute (None where there is no /proc/loadavg)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def launch(setting: str, run_dir: Path, train: list[str], threads: int) -> subprocess.Popen:
    """One `vitkit train` process for `setting` with the options `train`, its output into run_dir's .log."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if setting == "chosen":
        env["OMP_NUM_THREADS"] = str(threads)
    command = [sys.executable, "-m", "vitkit", "train", *train, "--out-dir", str(run_dir), "--overwrite"]
    command += ["--threads", "1"] if setting == "one" else []
    log = run_dir.with_suffix(".log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def one_setting(setting: str, scratch: Path, train: list[str], threads: int) -> dict:
    """The runs of `setting` started at once: each one's wall and step seconds, and ThreadWatch's line if it said
    one; the load average before and after."""
    load = [load_average()]
    dirs = [scratch / f"{setting}-{i}" for i in range(1 if setting == "alone" else 2)]
    start = time.perf_counter()
    processes = [launch(setting, run_dir, train, threads) for run_dir in dirs]
    walls: list[float | None] = [None] * len(processes)
    while None in walls:
        for i, process in enumerate(processes):
            if walls[i] is None and process.poll() is not None:
                walls[i] = time.perf_counter() - start
        time.sleep(0.02)
    runs = []
    for run_dir, process, wall in zip(dirs, processes, walls, strict=True):
        log = run_dir.with_suffix(".log").read_text()
        if process.returncode != 0:
            raise RuntimeError(f"vitkit train ({setting}) failed with status {process.returncode}:\n{log[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        said = next((line for line in log.splitlines() if SAID in line), None)
        runs.append({"wall_s": round(wall or 0.0, 2), "train_s": round(summary["train_seconds"], 2), "said": said})
    load.append(load_average())
    return {"runs": runs, "load_average": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", default="fashion-mnist")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--tiny", action="store_true", help="2 steps of a tiny model on shapes, one round (tests)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    train = ["--steps", str(args.steps), "--eval-every", "0", "--data", args.data]
    if args.tiny:
        args.rounds, train = 1, ["--steps", "2", "--eval-every", "0", *TINY]
    threads = torch.get_num_threads()  # torch's default: one per core
    result = {
        **record_header("threads-under-load"),
        "settings": {"train": train, "rounds": args.rounds, "default_threads": threads},
        "cells": {setting: [] for setting in args.settings},
    }
    with tempfile.TemporaryDirectory(prefix="threads-under-load-") as scratch:
        for i in range(args.rounds):
            for setting in args.settings[i % len(args.settings) :] + args.settings[: i % len(args.settings)]:
                cell = one_setting(setting, Path(scratch), train, threads)
                result["cells"][setting].append(cell)
                walls = ", ".join(f"{run['wall_s']:.1f}" for run in cell["runs"])
                print(f"round {i + 1} {setting:>7}: {walls} s wall (load average {cell['load_average'][0]})")
    for setting, cells in result["cells"].items():
        median = statistics.median(run["wall_s"] for cell in cells for run in cell["runs"])
        print(f"median {setting:>7}: {median:.1f} s wall a run")
    if args.out:
        print(f"wrote {write_record(args.out, result)}")


if __name__ == "__main__":
    main()
