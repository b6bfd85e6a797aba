"""The generated tables of README.md and docs/*.md, made from the measurement records in benchmarks/results/.

    python benchmarks/tables.py            # rewrite every generated table from the data
    python benchmarks/tables.py --check    # exit 1, naming each table that differs from what the data gives

A generated table sits between `<!-- tables.py: NAME -->` and `<!-- /tables.py -->`, NAME one of `TABLES`.
Each record (one JSON file) names its machine (CPU, family and model, instruction flags, threads), its date,
commit and command, and its rows; a new machine's results are a new file, and its column appears in the tables.
Where a machine has several records of the same cell, the latest one is shown. `tried-not-kept.json` is the one record
of many machines: each of its rows names its own.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- tables\.py: ([\w-]+) -->\n)(.*?)(<!-- /tables\.py -->)", re.S)

# Microarchitectures by vendor, CPU family and model as /proc/cpuinfo gives them; other CPUs are named by
# vendor and instruction set.
MICROARCHITECTURES = {
    ("AMD", 25, 1): "Zen 3",
    ("AMD", 25, 17): "Zen 4",
    ("AMD", 26, 2): "Zen 5",
    ("Intel", 6, 143): "Sapphire Rapids",
    ("Intel", 6, 207): "Emerald Rapids",
}


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load(results: Path = RESULTS) -> list[dict]:
    """Every record of the folder."""
    return [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]


def instructions(machine: dict) -> str:
    flags = set(machine.get("flags") or ())
    if {"amx_tile", "amx_bf16"} & flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else machine.get("cpu_capability", "?")


def label(machine: dict) -> str:
    """The machine's name in the tables (`hardware`), marked "run as" the instruction set a record was limited to
    (the path of another machine than this one's)."""
    name = hardware(machine)
    limits = machine.get("isa_limits") or {}  # in machine.describe()'s order: ATen's capability first
    isa = next(iter(limits.values()), None)
    return f"{name} run as {isa.upper()}" if isa and machine.get("device") != "cuda" else name


def hardware(machine: dict) -> str:
    """The machine itself: its GPU where the record ran on one; else its CPU's microarchitecture (or vendor and
    instructions), marked as a GPU machine's host where it has a GPU (another machine than a CPU one)."""
    if machine.get("device") == "cuda":
        return machine["gpu"].removeprefix("NVIDIA ")
    return cpu_label(machine) + (f" ({machine['gpu'].removeprefix('NVIDIA ')} host)" if machine.get("gpu") else "")


def cpu_label(machine: dict) -> str:
    cpu, family, model = machine["cpu"], machine.get("family"), machine.get("model")
    vendor = "AMD" if "AMD" in cpu else "Intel" if "Intel" in cpu else cpu.split()[0]
    if (vendor, family, model) in MICROARCHITECTURES:
        return MICROARCHITECTURES[vendor, family, model]
    short = "EPYC" if "EPYC" in cpu else "Xeon" if "Xeon" in cpu else vendor
    where = f" {family}/{model}" if family is not None else ""
    return f"{short} {instructions(machine)}{where}"


def markdown(head: list[str], rows: list[list[str]], right: int = 0) -> str:
    """A markdown table; the last `right` columns aligned right."""
    align = ["---"] * (len(head) - right) + ["---:"] * right
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def machines_in(records: list[dict], name_of: Callable[[dict], str] = label) -> list[str]:
    """Machine labels (or other names, `name_of`), the machine of the newest record first (records without a date
    count as oldest)."""
    newest: dict[str, str] = {}
    for r in records:
        if "machine" not in r:  # tried-not-kept.json: of many machines, each of its rows names its own
            continue
        name = name_of(r["machine"])
        newest[name] = max(newest.get(name, ""), r.get("date") or "")
    return sorted(newest, key=lambda name: newest[name], reverse=True)


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """One contender over another: the median of their ratios round by round, so the machine's drift cancels."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def latest_per_machine(records: list[dict], benchmark: str) -> dict[str, dict]:
    """Machine label -> that machine's latest record of `benchmark` (records without a date count as oldest)."""
    latest: dict[str, dict] = {}
    for record in sorted((r for r in records if r.get("benchmark") == benchmark), key=lambda r: r.get("date") or ""):
        latest[label(record["machine"])] = record
    return latest


def latest_cells(records: list[dict], kind: str) -> dict[tuple, dict[str, dict]]:
    """(model, batch, precision) -> machine -> the row of that machine's latest compare record for it."""
    cells: dict[tuple, dict[str, dict]] = {}
    for record in sorted(records, key=lambda r: r.get("date") or ""):
        if record.get("benchmark") != "compare":
            continue
        for row in record["rows"]:
            if row["kind"] == kind:
                key = (row["model"], row["batch"], row["precision"])
                cells.setdefault(key, {})[label(record["machine"])] = row
    return cells


def cell_order(key: tuple) -> tuple:
    model, batch, precision = key
    return (model, precision, batch)


def comparison(records: list[dict], kind: str) -> str:
    cells = latest_cells(records, kind)
    columns = [m for m in machines_in(records) if any(m in per for per in cells.values())]
    rows = []
    for key in sorted(cells, key=cell_order):
        per = cells[key]
        rows.append([key[0], str(key[1]), key[2]] + [f"{per[m]['ratio']:.2f}x" if m in per else "" for m in columns])
    return markdown(["model", "batch", "precision", *columns], rows, right=len(columns))


def inference(records: list[dict]) -> str:
    """vitkit.optimize's copy over the fastest peer (timm, its best CPU option, Hugging Face), per machine."""
    return comparison(records, "inference")


def training(records: list[dict]) -> str:
    """The plain model's training step over the fastest peer's, per machine."""
    return comparison(records, "train")


def ratio_range(rows: list[dict]) -> str:
    if not rows:
        return "-"
    low, high = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
    span = f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"
    return f"{span} ({len(rows)} cells)"


def summary(records: list[dict]) -> str:
    """Per machine: the range of the inference and training ratios over the fastest peer."""
    cells = {kind: latest_cells(records, kind) for kind in ("inference", "train")}
    rows = []
    for m in machines_in([r for r in records if r.get("benchmark") == "compare"]):
        inf = [per[m] for per in cells["inference"].values() if m in per]
        train = [per[m] for per in cells["train"].values() if m in per]
        rows.append([m, ratio_range(inf), ratio_range(train)])
    return markdown(["machine", "inference: optimized copy / fastest peer", "training step / fastest peer"], rows, 2)


def bench(records: list[dict]) -> str:
    """`vitkit bench`: inference FLOP/s as a fraction of the machine's own matmul rate, plain / optimized."""
    records = [r for r in records if r.get("benchmark") == "bench" and r["machine"].get("device") != "cuda"]
    cells: dict[tuple, dict[str, dict[str, float]]] = {}
    for record in sorted(records, key=lambda r: r.get("date") or ""):
        for row in record["rows"]:
            if row["kind"] == "inference":
                key = (record["model"], row["image_size"], row["batch"], row["precision"])
                cells.setdefault(key, {}).setdefault(label(record["machine"]), {})[row["mode"]] = row[
                    "fraction_of_matmul"
                ]
    columns = machines_in(records)
    rows = []
    for key in sorted(cells, key=lambda k: (k[0], k[3], k[1], k[2])):
        per = cells[key]

        def cell(m: str, per=per) -> str:
            modes = per.get(m, {})
            return " / ".join(f"{modes[mode]:.2f}" if mode in modes else "-" for mode in ("plain", "optimized"))

        rows.append([key[0], str(key[1]), str(key[2]), key[3]] + [cell(m) if m in per else "" for m in columns])
    return markdown(["model", "px", "batch", "precision", *columns], rows, right=len(columns))


def ratio_text(ratio) -> str:
    return f"{ratio[0]:.2f}-{ratio[1]:.2f}x" if isinstance(ratio, list) else f"{ratio:.2f}x"


def options(records: list[dict]) -> str:
    """What each of vitkit's speed rules gains, side by side against the same without it."""
    rows = []
    for record in sorted(records, key=lambda r: r.get("date") or ""):
        if record.get("benchmark") == "options":
            for row in record["rows"]:
                rows.append(
                    [row["option"], row["cell"], row["against"], label(record["machine"]), ratio_text(row["ratio"])]
                )
    return markdown(["rule", "measured on", "against", "machine", "ratio"], rows, right=1)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def length(row: dict) -> str:
    """A main-job run's epochs (or steps, where it was given them), and its patch dropout where it had one; runs
    recorded without either had 20 epochs and none."""
    dropout = row.get("patch_dropout") or 0.0
    given_steps = "epochs" in row and row["epochs"] is None
    epochs = f"{row['steps']:,} steps" if given_steps else f"{row.get('epochs', 20):g} epochs"
    return epochs + (f", patch dropout {dropout:g}" if dropout else "")


def recipe_change(record: dict) -> list[str]:
    """A main-job record's options that change the recipe: all but `--precision`, which picks the arithmetic the
    recipe runs in (its own column) and leaves the recipe as it is."""
    options = list(record.get("options") or [])
    while "--precision" in options:
        at = options.index("--precision")
        del options[at : at + 2]
    return options


def main_job(records: list[dict], now: bool = False) -> str:
    """`vitkit train` with no arguments: test top-1 and wall time (from a cold compile cache) per machine, and the
    val split it held out of the training images (none before runs chose on val). `now`: only the recipe of the
    newest record that held no val out, and only such runs."""
    groups: dict[tuple, list[dict]] = {}
    newest = None
    for record in sorted(records, key=lambda r: r.get("date") or "", reverse=True):
        if record.get("benchmark") == "main-job" and not recipe_change(record):  # a change: its own table
            for row in record["rows"]:
                val = f"{row['val_images']:,} images" if row.get("val_images") else "none"
                if newest is None and val == "none":  # records newest first: the recipe as it is
                    newest = (length(row), row["schedule"])
                key = (label(record["machine"]), row["precision"], length(row), row["schedule"], val)
                groups.setdefault(key, []).append(row)
    rows = []
    for (machine, precision, run_length, schedule, val), runs in groups.items():
        if now and ((run_length, schedule) != newest or val != "none"):
            continue
        top1 = sorted({r["top1"] for r in runs})
        accuracy = f"{top1[0]:.2f}%" if len(top1) == 1 else f"{top1[0]:.2f}-{top1[-1]:.2f}%"
        cold = sorted(r["wall_s"] for r in runs if r["wall_s"] is not None and r["cache"] == "cold")
        time = "-" if not cold else minutes(cold[0]) + ("" if len(cold) == 1 else f" to {minutes(cold[-1])}")
        seeds = len({r["seed"] for r in runs})
        count = f"{len(runs)}" + (f" ({seeds} seeds)" if seeds > 1 else "")
        rows.append([machine, precision, run_length, schedule, val, count, accuracy, time])
    header = ["machine", "precision", "length", "decay", "val split", "runs", "test top-1", "wall time, cold cache"]
    if now:  # one recipe, all on the training images: the columns that would repeat it go
        keep = [i for i, name in enumerate(header) if name not in ("length", "decay", "val split")]
        header, rows = [header[i] for i in keep], [[row[i] for i in keep] for row in rows]
    return markdown(header, rows, right=3)


def recipe(records: list[dict]) -> str:
    """The main job with one change to its recipe: test top-1, per machine."""
    rows = []
    for record in sorted(records, key=lambda r: r.get("date") or "", reverse=True):
        if record.get("benchmark") == "recipe":
            for row in record["rows"]:
                time = "-" if row["wall_s"] is None else minutes(row["wall_s"])
                machine = label(record["machine"]) + (", 1 thread" if row["threads"] == 1 else "")
                rows.append([row["variant"], row["schedule"], machine, f"{row['top1']:.2f}%", time])
    return markdown(["change", "decay", "machine", "test top-1", "wall time"], rows, right=2)


def recipe_on_val(records: list[dict]) -> str:
    """`benchmarks/main_job.py --val-fraction`: the main job with val held out of its training images, as it is and
    with one change to the recipe (`--options`), over seeds: val top-1 (where a change is chosen), test top-1, time,
    and a change's mean val and test top-1 less the recipe's on the same machine and seeds. A record's `note` names
    what its options do not: the recipe that the changes were measured against, and a change the recipe took up."""

    def span(values: list[float]) -> str:
        low, high = min(values), max(values)
        return f"{low:.2f}%" if low == high else f"{low:.2f}-{high:.2f}%"

    def gain(record: dict, base: dict) -> str:  # mean val and test less the recipe's, over the seeds both ran
        seeds = {row["seed"] for row in record["rows"]} & {row["seed"] for row in base["rows"]}
        if not seeds:
            return "-"

        def mean(of: dict, key: str) -> float:
            return sum(row[key] for row in of["rows"] if row["seed"] in seeds) / len(seeds)

        val, test = (round(mean(record, key) - mean(base, key), 2) + 0.0 for key in ("val_top1", "top1"))
        return f"{val:+.2f} / {test:+.2f}"

    def order(record: dict) -> tuple:  # by machine, the recipe first, then each change as it was measured
        return (label(record["machine"]), bool(record.get("options")), record.get("date") or "")

    rows = []
    measured = [r for r in records if r.get("benchmark") == "main-job" and (r.get("rows") or [{}])[0].get("val_images")]
    recipes = {label(r["machine"]): r for r in measured if not r.get("options")}
    for record in sorted(measured, key=order):
        runs = record["rows"]
        change = f"`{' '.join(record['options'])}`" if record.get("options") else "none: the recipe"
        if record.get("note"):  # what the run is, where its options do not say it: "the recipe since ..."
            change = f"{change} ({record['note']})" if record.get("options") else record["note"]
        wall = sorted(row["wall_s"] for row in runs)
        base = recipes.get(label(record["machine"]))
        against = gain(record, base) if record.get("options") and base else "-"
        rows.append([
            change, label(record["machine"]), str(len(runs)),
            span([row["val_top1"] for row in runs]), span([row["top1"] for row in runs]), against,
            minutes(wall[0]) + ("" if len(wall) == 1 else f" to {minutes(wall[-1])}"),
        ])  # fmt: skip
    header = ["change", "machine", "seeds", "val top-1", "test top-1", "mean val / test less the recipe's", "wall time"]
    return markdown(header, rows, right=4)


def transfer(records: list[dict]) -> str:
    """benchmarks/transfer.py: the pre-trained ViT-S/14 against the same network from scratch."""
    rows = []
    for record in records:
        if record.get("benchmark") == "transfer" and not record.get("settings", {}).get("normalization"):
            for row in record["rows"]:
                probe = "-" if row["linear_probe"] is None else f"{row['linear_probe']:.1f}%"
                rows.append([row["data"], row["model"], probe, f"{row['fine_tune']:.1f}%", str(row["steps"])])
    return markdown(["data", "model", "linear probe", "full fine-tune", "fine-tune steps"], rows, right=3)


def spread(top1: list[float]) -> str:
    """The suffix "; N seeds LOW-HIGH" for a run with several seeds, else nothing."""
    return f"; {len(top1)} seeds {min(top1):.1%}-{max(top1):.1%}" if len(top1) > 1 else ""


def folder_runs(records: list[dict]) -> str:
    """benchmarks/folder_runs.py: `vitkit train` with its defaults against the best run by hand and the pixel
    baselines, per folder of real images (the latest record of each folder and machine; test top-1, balanced
    accuracy in brackets; a run's range over seeds where several ran)."""
    latest: dict[tuple[str, str], dict] = {}
    for record in sorted(records, key=lambda r: r.get("date") or ""):
        if record.get("benchmark") == "folder-runs":
            latest[(record["folder"], label(record["machine"]))] = record

    def score(run: dict) -> str:
        return f"{run['test_top1']:.1%} ({run['test_balanced_accuracy']:.1%})"

    rows = []
    for (folder, machine), record in latest.items():
        runs, hand = record["runs"], record["best_by_hand"]
        baseline = record["best_baseline"]
        defaults = runs["defaults"]
        images = sum(record["train_per_class"].values())
        seeds: dict[str, list[float]] = {}  # test top-1 of each run over its seeds
        shown: dict[str, str] = {}  # a run kept from an earlier commit's defaults names that commit
        for name, run in runs.items():
            base = name.split(", seed ")[0]
            seeds.setdefault(base, []).append(run["test_top1"])
            named = run.get("measured_as") and not base.startswith("the defaults of")
            shown.setdefault(base, base + (f" = the defaults of {run['commit'][:7]}" if named else ""))  # seed 0's
        rows.append([
            f"{folder} ({record['kind']}; {images:,} training images)", machine,
            f"{baseline['accuracy']:.1%} {baseline['model']}", f"{record['target']:.1%}",
            f"**{score(defaults)}**, {minutes(defaults['wall_seconds'])}{spread(seeds['defaults'])}",
            f"{score(runs[hand])}, {minutes(runs[hand]['wall_seconds'])} ({shown[hand]}{spread(seeds[hand])})",
            ", ".join(f"{shown[name]} {top1[0]:.1%}" if len(top1) == 1 else
                      f"{shown[name]} {min(top1):.1%}-{max(top1):.1%}"
                      for name, top1 in seeds.items() if name not in ("defaults", hand)),
        ])  # fmt: skip
    head = ["folder", "machine", "best baseline", "target", "defaults", "best by hand (on val)", "other runs"]
    return markdown(head, rows)


def transfer_normalization(records: list[dict]) -> str:
    """benchmarks/transfer.py --normalization official checkpoint: the same protocols on vitkit's [-1, 1] inputs
    and on the checkpoint's own mean and std, side by side in one run."""
    rows = []
    for record in records:
        if record.get("benchmark") == "transfer" and record.get("settings", {}).get("normalization"):
            for row in record["rows"]:
                inputs = "[-1, 1]" if row["normalization"] == "official" else "its own mean and std"
                probe = "-" if row["linear_probe"] is None else f"{row['linear_probe']:.1f}%"
                rows.append([row["data"], row["model"], label(record["machine"]), inputs, probe,
                             f"{row['fine_tune']:.1f}%", str(row["steps"])])  # fmt: skip
    head = ["data", "model", "machine", "inputs", "linear probe", "full fine-tune", "fine-tune steps"]
    return markdown(head, rows, right=3)


def machines(records: list[dict]) -> str:
    """The machines the records come from, as /proc/cpuinfo names them (one run with narrower instructions than it
    has counted as itself)."""
    records = [r for r in records if "machine" in r]
    seen: dict[str, tuple[dict, set, int]] = {}
    for record in records:
        m = record["machine"]
        entry = seen.setdefault(name := hardware(m), (m, set(), 0))
        entry[1].add(m.get("threads"))
        seen[name] = (entry[0], entry[1], entry[2] + 1)
    rows = []
    for name in machines_in(records, hardware):
        m, threads, count = seen[name]
        on_gpu = m.get("device") == "cuda"
        bf16 = "native" if m.get("bf16_native_gpu" if on_gpu else "bf16_native_cpu") else "emulated"
        what = f"{m['gpu']} (host: {m['cpu']})" if on_gpu else m["cpu"]
        rows.append([name, what, "CUDA" if on_gpu else instructions(m), bf16,
                     ", ".join(str(t) for t in sorted(threads)), str(count)])  # fmt: skip
    return markdown(["machine", "CPU", "instructions", "bf16", "threads", "records"], rows, right=1)


def shard_formats(records: list[dict]) -> str:
    """benchmarks/shard_formats.py: tar (the WebDataset layout) against Parquet shards of the same JPEGs."""
    rows = []
    for record in records:
        if record.get("benchmark") == "shard-formats":
            for row in record["rows"]:
                rates = (row["write_images_per_s"], row["bytes_per_image"], row["stream_images_per_s"],
                         row["decode_images_per_s"])  # fmt: skip
                rows.append([row["format"], label(record["machine"])] + [f"{v:,.0f}" for v in rates])
    head = ["format", "machine", "write img/s", "bytes / image", "stream img/s", "stream + decode img/s"]
    return markdown(head, rows, right=4)


def scaling(records: list[dict]) -> str:
    """benchmarks/scaling.py measure: a training step at 224 px in fp32, and its memory."""
    rows = []
    for record in records:
        if record.get("benchmark") == "scaling":
            for row in record["rows"]:
                rows.append([row["model"], f"{row['params'] / 1e6:.1f}M", label(record["machine"]), str(row["batch"]),
                             f"{row['images_per_s']:.2f}", f"{row['peak_rss'] / 2**30:.2f} GiB",
                             f"{row['state_bytes'] / 2**30:.2f} GiB", f"{row['activation_bytes'] / 2**20:.0f} MiB",
                             f"{row['checkpointed_activation_bytes'] / 2**20:.0f} MiB"])  # fmt: skip
    head = ["model", "parameters", "machine", "batch", "images/s", "+peak RSS", "training state (16 B/param)",
            "activations / image", "with checkpointing"]  # fmt: skip
    return markdown(head, rows, right=6)


def latest_deploy_cells(records: list[dict], with_copy: str | None = None) -> list[tuple[str, str, int, list[dict]]]:
    """(machine, model, batch, the cells of that batch) from the latest deploy record of each (only records whose batch
    ran `with_copy`, where given), the machine of the newest record first, then by model and batch."""
    latest: dict[tuple[str, str, int], tuple[dict, list[dict]]] = {}
    for record in sorted((r for r in records if r.get("benchmark") == "deploy"), key=lambda r: r.get("date") or ""):
        for batch in {c["batch"] for c in record["cells"]}:
            cells = [c for c in record["cells"] if c["batch"] == batch]
            if with_copy is None or any(c["copy"] == with_copy for c in cells):
                latest[(label(record["machine"]), record["model"], batch)] = (record, cells)
    order = machines_in([record for record, _ in latest.values()])
    keys = sorted(latest, key=lambda key: (order.index(key[0]), key[1], key[2]))
    return [(*key, latest[key][1]) for key in keys]


def deploy(records: list[dict]) -> str:
    """benchmarks/deploy.py: vitkit.optimize in fp32, bf16 and int8 beside ONNX Runtime and OpenVINO, images/s with
    the ratio to the fastest runtime of the same precision (vitkit) or int8 (either copy) over vitkit's bf16 copy."""
    copies = ["vitkit fp32", "vitkit torch fp32", "onnxruntime fp32", "openvino fp32", "vitkit bf16",
              "vitkit torch bf16", "openvino bf16", "vitkit int8", "vitkit torch int8"]  # fmt: skip
    rows = []
    for name, model, batch, batch_cells in latest_deploy_cells(records):
        rates = {c["copy"]: c["rounds"] for c in batch_cells}
        medians = {k: statistics.median(v) for k, v in rates.items()}

        def over(ours: str, theirs: list[str], rates=rates, medians=medians) -> str:
            present = [t for t in theirs if t in medians]
            if ours not in medians or not present:
                return ""
            best = max(present, key=medians.__getitem__)
            ratio = paired_ratio(rates[ours], rates[best])
            return f" ({ratio:.2f}x)"

        fp32, bf16 = ["onnxruntime fp32", "openvino fp32"], ["onnxruntime fp32", "openvino fp32", "openvino bf16"]
        notes = {
            "vitkit fp32": over("vitkit fp32", fp32),
            "vitkit torch fp32": over("vitkit torch fp32", fp32),
            "vitkit bf16": over("vitkit bf16", bf16),
            "vitkit torch bf16": over("vitkit torch bf16", bf16),
            "vitkit int8": over("vitkit int8", ["vitkit bf16"]),
            "vitkit torch int8": over("vitkit torch int8", ["vitkit bf16"]),
        }
        cells = [f"{medians[c]:.1f}{notes.get(c, '')}" if c in medians else "" for c in copies]
        errors = {c["copy"]: c["max_error_relative"] for c in batch_cells}
        if errors.get("vitkit int8", 1.0) < 1e-4:  # logits of fp32 arithmetic: the quantizer quantized nothing
            cells[copies.index("vitkit int8")] = "not quantized"
        rows.append([name, model, str(batch), *cells])
    return markdown(["machine", "model", "batch", *copies], rows, right=len(copies))


def deploy_int8(records: list[dict]) -> str:
    """benchmarks/deploy.py, where it ran ONNX Runtime's own int8: each int8 copy's images/s and the largest
    difference of its logits from fp32's (relative to their largest magnitude), and vitkit's int8 copy over ONNX
    Runtime's (the median of the rounds' ratios)."""
    copies = ["vitkit int8", "vitkit torch int8", "onnxruntime int8"]
    rows = []
    for name, model, batch, batch_cells in latest_deploy_cells(records, with_copy="onnxruntime int8"):
        cells = {c["copy"]: c for c in batch_cells if c["copy"] in copies}
        shown = [f"{cells[c]['images_per_s']:.1f} ({cells[c]['max_error_relative']:.3f})" if c in cells else ""
                 for c in copies]  # fmt: skip
        ours, theirs = cells.get("vitkit int8"), cells["onnxruntime int8"]
        ratio = paired_ratio(ours["rounds"], theirs["rounds"]) if ours else None
        rows.append([name, model, str(batch), *shown, f"{ratio:.2f}x" if ratio else "-"])
    head = ["machine", "model", "batch", *(f"{c} img/s (logit error)" for c in copies), "vitkit / onnxruntime int8"]
    return markdown(head, rows, right=len(copies) + 1)


RUNTIME_PEERS = ("ONNX Runtime", "OpenVINO")


def runtimes(records: list[dict]) -> str:
    """benchmarks/compare.py, inference cells with the runtimes: images/s of `vitkit.optimize`'s copy (with the runtime
    that ran it), of its copy with vitkit's own kernels, and of ONNX Runtime and OpenVINO; each vitkit copy over the
    fastest runtime (the median of the rounds' ratios), per machine's latest record of the cell."""
    rows = []
    for key, per in sorted(latest_cells(records, "inference").items(), key=lambda kv: cell_order(kv[0])):
        for machine, row in per.items():
            rounds = row.get("rounds") or {}  # summaries of old runs kept no rounds
            peers = [p for p in RUNTIME_PEERS if p in rounds]
            if not peers or "optimized_runtime" not in row:
                continue
            medians = {k: statistics.median(v) for k, v in rounds.items()}
            fastest = max(peers, key=medians.__getitem__)

            def over(ours: str, rounds=rounds, fastest=fastest) -> str:
                if ours not in rounds:
                    return ""
                return f"{paired_ratio(rounds[ours], rounds[fastest]):.2f}x"

            own = "vitkit torch kernels" if "vitkit torch kernels" in rounds else "vitkit optimized"
            cells = [f"{medians[k]:.1f}" if k in medians else "-" for k in ("vitkit optimized", own, *RUNTIME_PEERS)]
            ratios = [over("vitkit optimized"), over(own)]
            rows.append([machine, key[0], str(key[1]), key[2], row["optimized_runtime"], *cells, *ratios])
    head = ["machine", "model", "batch", "precision", "optimize ran in", "optimize img/s", "torch kernels img/s",
            "ONNX Runtime", "OpenVINO", "optimize / fastest runtime", "torch kernels / fastest runtime"]  # fmt: skip
    return markdown(head, rows, right=6)


def bench_compare(records: list[dict]) -> str:
    """`vitkit bench --compare` on one model: images/s of `vitkit.optimize`'s copy, ONNX Runtime and OpenVINO, and
    the copy over the fastest runtime (the median of the rounds' ratios), from the latest record of each machine and
    model."""
    latest: dict[tuple[str, str], dict] = {}
    for record in sorted((r for r in records if r.get("benchmark") == "bench-compare"), key=lambda r: r["date"]):
        latest[(label(record["machine"]), record.get("model_name", record["model"]))] = record
    rows = []
    for (machine, model), record in latest.items():
        cells: dict[tuple[str, int], dict[str, list[float]]] = {}
        for row in record["rows"]:
            cells.setdefault((row["precision"], row["batch"]), {})[row["contender"]] = row["rounds"]
        for (precision, batch), rounds in sorted(cells.items()):
            medians = {k: statistics.median(v) for k, v in rounds.items()}
            fastest = max((p for p in ("onnxruntime", "openvino") if p in rounds), key=medians.__getitem__)
            contenders = ("vitkit.optimize", "onnxruntime", "openvino")
            rates = [f"{medians[k]:.0f}" if k in medians else "-" for k in contenders]
            ratio = paired_ratio(rounds["vitkit.optimize"], rounds[fastest])
            rows.append([machine, model, str(batch), precision, *rates, f"{ratio:.2f}x"])
    head = ["machine", "model", "batch", "precision", "optimize img/s", "ONNX Runtime", "OpenVINO",
            "optimize / fastest runtime"]  # fmt: skip
    return markdown(head, rows, right=4)


def own_images(dataset: str) -> Callable[[list[dict]], str]:
    """benchmarks/own_images.py on one dataset: the defaults against hand-tuned options, each setting from the
    latest record that ran it."""

    def table(records: list[dict]) -> str:
        runs: dict[str, dict] = {}
        for record in sorted(records, key=lambda r: str(r.get("date"))):
            if record.get("benchmark") == "own-images" and record.get("dataset", "digits") == dataset:
                for name, result in record["results"].items():
                    runs[name] = result["runs"][0]
        rows = []
        for name in sorted(runs, key=lambda n: n != "defaults"):  # the defaults first, then in the records' order
            run = runs[name]
            given = run["args"][run["args"].index("--threads") + 2 :]  # after the options common to every run
            chosen = run["chosen"].split(" -> ", 1)[1].rsplit(":", 1)[0] if run["chosen"] else ""
            options = f"`vitkit train --data {dataset}/` ({chosen})" if name == "defaults" else f"`{' '.join(given)}`"
            top1 = f"{100 * run['test_top1']:.2f}%"
            kind, top1 = ("**defaults**", f"**{top1}**") if name == "defaults" else ("hand-tuned", top1)
            rows.append([kind, options, top1, f"{run['seconds']:.0f} s"])
        return markdown(["run", "options", "test top-1", "wall time"], rows, right=2)

    return table


def own_images_batch(records: list[dict]) -> str:
    """benchmarks/own_images.py --train-images: test top-1 (the mean over seeds) against the batch on small
    training splits, from the latest record; the batch the defaults pick in bold."""
    latest = [r for r in records if r.get("benchmark") == "own-images-batch"]
    if not latest:
        return ""
    record = max(latest, key=lambda r: str(r.get("date")))
    batches = sorted({int(b) for split in record["splits"].values() for b in split["batches"]})
    rows = []
    for n, split in sorted(record["splits"].items(), key=lambda item: int(item[0])):
        cells = []
        for batch in batches:
            result = split["batches"].get(str(batch))
            cell = "-" if result is None else f"{100 * result['mean_test_top1']:.1f}%"
            cells.append(f"**{cell}**" if batch == split["default_batch"] else cell)
        steps = int(n) // split["default_batch"]
        rows.append([n, *cells, f"{split['default_batch']} ({steps} steps an epoch)"])
    head = ["training images", *(f"batch {b}" for b in batches), "the defaults' batch"]
    return markdown(head, rows, right=len(batches) + 1)


def own_images_finetune(records: list[dict]) -> str:
    """benchmarks/own_images.py --finetune: a checkpoint fine-tuned on small images at several resolutions, each
    run the same steps; per dataset and resolution every seed's latest run: the mean test top-1 (the range over
    seeds), the median wall time and the largest peak memory. The defaults of the newest records in bold; a run with
    the defaults of a record from before them is marked so."""
    finetune = sorted((r for r in records if r.get("benchmark") == "own-images-finetune"), key=lambda r: str(r["date"]))
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in finetune):
        ours = [r for r in finetune if r["dataset"] == dataset]
        newest = next(r for r in reversed(ours) if "defaults" in r["runs"])["runs"]["defaults"]["chosen"]
        groups: dict[tuple[str, str], dict[int, dict]] = {}
        for record in ours:
            for name, run in record["runs"].items():
                size = run.get("image_size", [None])[0]
                if size is None and "--image-size" in run["args"]:
                    size = int(run["args"][run["args"].index("--image-size") + 1])
                resolution = "the checkpoint's own" if size is None else f"{size} px"
                if name != "defaults":
                    options = f"`--image-size {size}`"
                else:
                    options = "defaults" if run["chosen"] == newest else "the defaults of an earlier version"
                groups.setdefault((resolution, options), {})[record.get("seed", 0)] = run
        for (resolution, options), seeds in groups.items():
            top1 = [100 * run["test_top1"] for run in seeds.values()]
            accuracy = f"{statistics.mean(top1):.2f}%"
            if len(top1) > 1:
                accuracy += f" ({min(top1):.1f}-{max(top1):.1f})"
            if options == "defaults":
                options, accuracy = "**defaults**", f"**{accuracy}**"
            seconds = statistics.median(run["seconds"] for run in seeds.values())
            memory = max(run.get("peak_rss_gib", 0.0) for run in seeds.values())
            rows.append([dataset, resolution, options, accuracy, str(len(seeds)), f"{seconds:.0f} s",
                         f"{memory:.1f} GiB" if memory else "-"])  # fmt: skip
    rows.sort(key=lambda row: (row[0], int(row[1].split()[0]) if row[1][0].isdigit() else 10**6))
    head = ["data", "resolution", "options", "test top-1", "seeds", "wall time", "peak memory"]
    return markdown(head, rows, right=4)


PEER_GRAPH = "ONNX, variable (the peer)"


def openvino_graphs(records: list[dict]) -> str:
    """benchmarks/openvino_graphs.py: one image through each graph OpenVINO can be given of the same model, ms per
    image and speed over the graph its peer runs (the median of the rounds' ratios), with the compiled graph's
    Transpose and Reorder layers where the record counted them; per machine, its latest record."""
    latest = latest_per_machine(records, "openvino-graphs")
    rows = []
    for name in machines_in(list(latest.values())):
        record = latest[name]
        for cell in record["cells"]:
            peer = next(c for c in record["cells"] if c["precision"] == cell["precision"] and c["graph"] == PEER_GRAPH)
            speed = statistics.median(p / c for p, c in zip(peer["rounds_ms"], cell["rounds_ms"]))
            layers = cell.get("layers")
            counts = f"{layers.get('Transpose', 0)} / {layers.get('Reorder', 0)}" if layers else "-"
            rows.append([name, record["model"], cell["precision"], cell["graph"], f"{cell['ms']:.2f}", f"{speed:.3f}x",
                         counts])  # fmt: skip
    head = ["machine", "model", "precision", "graph", "ms / image", "speed over the peer's graph",
            "Transpose / Reorder layers"]  # fmt: skip
    return markdown(head, rows, right=3)


def gpu_records(records: list[dict], benchmark: str) -> list[dict]:
    """The records of `benchmark` that ran on a GPU, oldest first."""
    runs = [r for r in records if r.get("benchmark") == benchmark and r["machine"].get("device") == "cuda"]
    return sorted(runs, key=lambda r: r.get("date") or "")


def gpu_train(records: list[dict]) -> str:
    """benchmarks/gpu_train.py: the training step of vitkit and timm on one GPU, images/s and MFU."""
    rows = []
    for record in gpu_records(records, "gpu-train"):
        s, rate = record["settings"], {r["library"]: r for r in record["rows"]}
        ours, timm = rate["vitkit"], rate["timm"]
        rows.append([label(record["machine"]), s["model"], str(s["image_size"]), str(s["batch"]),
                     "bf16, compiled" if s["compile"] else "bf16", f"{ours['images_per_s']:,.0f}",
                     f"{timm['images_per_s']:,.0f}", f"{ours['images_per_s'] / timm['images_per_s']:.2f}x",
                     f"{100 * ours['mfu']:.1f}%", f"{100 * timm['mfu']:.1f}%"])  # fmt: skip
    head = ["GPU", "model", "px", "batch", "precision", "vitkit img/s", "timm img/s", "vitkit / timm", "vitkit MFU",
            "timm MFU"]  # fmt: skip
    return markdown(head, rows, right=5)


def gpu_inference(records: list[dict]) -> str:
    """`vitkit bench` on a GPU: images/s of `optimize`'s copy and of the plain model, each one's FLOP/s over the
    GPU's own matmul rate in the same rounds, and peak memory."""
    rows = []
    for record in gpu_records(records, "bench"):
        cells: dict[tuple, dict[str, dict]] = {}
        for r in record["rows"]:
            if r["kind"] == "inference":
                cells.setdefault((r["image_size"], r["batch"], r["precision"]), {})[r["mode"]] = r
        for (px, batch, precision), per in sorted(cells.items()):
            fast, plain = per["optimized"], per["plain"]
            rows.append([label(record["machine"]), record["model"], str(px), str(batch), precision,
                         f"{fast['images_per_s']:,.0f}", f"{plain['images_per_s']:,.0f}",
                         f"{fast['images_per_s'] / plain['images_per_s']:.2f}x",
                         f"{fast['fraction_of_matmul']:.2f} / {plain['fraction_of_matmul']:.2f}",
                         f"{fast['peak_memory_mb']:,.0f} / {plain['peak_memory_mb']:,.0f}"])  # fmt: skip
    head = ["GPU", "model", "px", "batch", "precision", "optimized img/s", "plain img/s", "optimized / plain",
            "of matmul rate (optimized / plain)", "peak MB (optimized / plain)"]  # fmt: skip
    return markdown(head, rows, right=5)


def tried_not_kept(records: list[dict]) -> str:
    """What was measured side by side against what vitkit does and not kept: the figures, and why not."""
    rows = []
    for record in records:
        if record.get("benchmark") == "tried-not-kept":
            for row in record["rows"]:
                rows.append([row["what"], ", ".join(row["machines"]) or "-", row["measured"], row["why"],
                             ", ".join(f"`{name}`" for name in row["records"]) or "-"])  # fmt: skip
    return markdown(["tried", "machine", "measured", "why not kept", "record"], rows)


TABLES: dict[str, Callable[[list[dict]], str]] = {
    "gpu-train": gpu_train,
    "gpu-inference": gpu_inference,
    "own-images-digits": own_images("digits"),
    "own-images-batch": own_images_batch,
    "own-images-animal-mnist": own_images("animal-mnist"),
    "own-images-finetune": own_images_finetune,
    "folder-runs": folder_runs,
    "deploy": deploy,
    "deploy-int8": deploy_int8,
    "runtimes": runtimes,
    "bench-compare": bench_compare,
    "openvino-graphs": openvino_graphs,
    "inference": inference,
    "training": training,
    "summary": summary,
    "bench": bench,
    "options": options,
    "main-job": main_job,
    "main-job-now": lambda records: main_job(records, now=True),
    "recipe": recipe,
    "recipe-on-val": recipe_on_val,
    "transfer": transfer,
    "transfer-normalization": transfer_normalization,
    "shard-formats": shard_formats,
    "scaling": scaling,
    "machines": machines,
    "tried-not-kept": tried_not_kept,
}


def render(doc: str, records: list[dict]) -> tuple[str, list[str]]:
    """The document with each generated table made from the data, and the names of those that changed."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}: choose from {', '.join(TABLES)}")
        table = TABLES[name](records) + "\n"
        if match.group(3) != table:
            changed.append(name)
        return match.group(1) + table + match.group(4)

    return BLOCK.sub(replace, doc), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("documents", nargs="*", type=Path, help="default: README.md and docs/*.md")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of JSON records")
    args = parser.parse_args(argv)
    records = load(args.results)
    stale = []
    for path in args.documents or documents():
        text, changed = render(path.read_text(), records)
        stale += [f"{path.name}: {name}" for name in changed]
        if changed and not args.check:
            path.write_text(text)
    if args.check and stale:
        print("tables that differ from benchmarks/results (run python benchmarks/tables.py):", file=sys.stderr)
        print("\n".join(f"  {s}" for s in stale), file=sys.stderr)
        return 1
    for s in stale:
        print(f"rewrote {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
