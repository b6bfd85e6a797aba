"""benchmarks/tables.py: the docs' generated tables are what the records in benchmarks/results/ give."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import SRC

TABLES = SRC.parent / "benchmarks" / "tables.py"


def run_tables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TABLES), *args], capture_output=True, text=True, timeout=60)


def render(tmp_path: Path, records: dict[str, dict], tables: tuple[str, ...]) -> str:
    """`tables` generated from `records` (file stem: record) into a fresh document: its text."""
    results = tmp_path / "results"
    results.mkdir(parents=True)
    for name, record in records.items():
        (results / f"{name}.json").write_text(json.dumps(record))
    doc = tmp_path / "doc.md"
    doc.write_text("".join(f"<!-- tables.py: {t} -->\n<!-- /tables.py -->\n" for t in tables))
    assert run_tables("--results", str(results), str(doc)).returncode == 0
    return doc.read_text()


def test_every_generated_table_in_the_docs_matches_the_data():
    done = run_tables("--check")
    assert done.returncode == 0, done.stderr


def test_a_hand_edited_table_is_caught_and_named_then_rewritten(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# A page\n\n<!-- tables.py: training -->\n<!-- /tables.py -->\n\nprose stays\n")
    assert run_tables("--check", str(doc)).returncode == 1  # an empty table differs from the data
    assert run_tables(str(doc)).returncode == 0
    generated = doc.read_text()
    assert "| model | batch | precision |" in generated and generated.endswith("\n\nprose stays\n")
    assert run_tables("--check", str(doc)).returncode == 0
    row = next(line for line in generated.splitlines() if line.startswith("| ViT-B/16 | 8 | fp32 |"))
    edited = row.replace("x |", "1x |", 1)  # one ratio edited by hand: 1.02x -> 1.021x
    assert edited != row
    doc.write_text(generated.replace(row, edited))
    done = run_tables("--check", str(doc))
    assert done.returncode == 1 and "doc.md: training" in done.stderr
    assert doc.read_text() != generated  # --check changes nothing


def test_an_unknown_table_name_is_refused_with_the_choices(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- tables.py: speed -->\n<!-- /tables.py -->\n")
    done = run_tables("--check", str(doc))
    assert done.returncode != 0 and "unknown table 'speed'" in done.stderr and "inference" in done.stderr


def test_a_gpu_machines_records_are_named_by_its_gpu_or_as_its_host_and_unquantized_int8_is_not_shown(tmp_path):
    """A record that ran on the GPU goes by the GPU's name; one that ran on such a machine's CPU by the CPU's, marked
    as the GPU's host (another machine than the CPU-only ones). An int8 copy whose logits match fp32's was not
    quantized, and its speed is not shown as int8's."""
    host = {"cpu": "Intel(R) Xeon(R) Processor (family 6, model 207)", "family": 6, "model": 207,
            "flags": ["avx512f", "amx_tile"], "threads": 2, "gpu": "NVIDIA H200"}  # fmt: skip
    train = {"benchmark": "gpu-train", "machine": {**host, "device": "cuda"}, "date": "2026-01-01T00:00Z",
             "settings": {"model": "ViT-B/16", "image_size": 224, "batch": 256, "compile": True},
             "rows": [{"library": "vitkit", "images_per_s": 4000.0, "mfu": 0.4},
                      {"library": "timm", "images_per_s": 3200.0, "mfu": 0.36}]}  # fmt: skip
    copies = {"vitkit bf16": (50.0, 1e-2), "openvino bf16": (50.0, 1e-2), "vitkit int8": (20.0, 1e-6)}
    cells = [{"batch": 1, "copy": name, "images_per_s": rate, "rounds": [rate] * 3, "max_error_relative": error}
             for name, (rate, error) in copies.items()]  # fmt: skip
    deploy = {"benchmark": "deploy", "machine": host, "date": "2026-01-01T00:00Z", "model": "ViT-S/16", "cells": cells}
    text = render(tmp_path, {"train": train, "deploy": deploy}, ("gpu-train", "deploy"))
    assert "| H200 | ViT-B/16 | 224 | 256 | bf16, compiled | 4,000 | 3,200 | 1.25x | 40.0% | 36.0% |" in text
    deploy_row = next(line for line in text.splitlines() if line.startswith("| Emerald Rapids (H200 host) |"))
    assert deploy_row.endswith("| 50.0 (1.00x) |  | 50.0 | not quantized |  |") and "20.0" not in deploy_row


def test_int8_against_onnx_runtimes_own_comes_from_the_latest_record_that_ran_each_batch(tmp_path):
    """Each int8 copy's speed and logit error, and vitkit's over ONNX Runtime's as the median of the rounds' ratios
    (not the ratio of the medians); a later record without ONNX Runtime's int8 does not hide the one with it, nor
    one of another batch size."""
    machine = {"cpu": "AMD EPYC (family 25, model 17)", "family": 25, "model": 17, "flags": ["avx512_bf16"]}
    rounds = {"vitkit int8": [60.0, 30.0, 50.0], "onnxruntime int8": [30.0, 30.0, 10.0]}  # ratios 2, 1, 5
    cells = [{"batch": 8, "copy": name, "images_per_s": sorted(r)[1], "rounds": r, "max_error_relative": 0.04}
             for name, r in rounds.items()]  # fmt: skip
    older = {"benchmark": "deploy", "machine": machine, "date": "2026-01-01T00:00Z", "model": "ViT-S/16"}
    older["cells"] = cells
    newer = {**older, "date": "2026-02-01T00:00Z", "cells": cells[:1]}
    other_batch = {**older, "date": "2026-03-01T00:00Z", "cells": [{**c, "batch": 64} for c in cells]}
    text = render(tmp_path, {"older": older, "newer": newer, "other_batch": other_batch}, ("deploy-int8",))
    assert "| Zen 4 | ViT-S/16 | 8 | 50.0 (0.040) |  | 30.0 (0.040) | 2.00x |" in text
    assert "| Zen 4 | ViT-S/16 | 64 | 50.0 (0.040) |  | 30.0 (0.040) | 2.00x |" in text


def test_tried_not_kept_rows_are_the_records_rows_and_the_machines_table_leaves_that_record_out(tmp_path):
    """tried-not-kept.json is one record of many machines: each row names its own machines and the record files that
    hold its rounds ("-" where none was kept), and the machines table counts only the records of one machine."""
    machine = {"cpu": "AMD EPYC (family 25, model 1)", "family": 25, "model": 1, "flags": ["avx2"], "threads": 2}
    options = {"benchmark": "options", "machine": machine, "date": "2026-01-01", "rows": []}
    rows = [{"what": "a change", "machines": ["Zen 3", "Zen 5"], "measured": "0.80x", "why": "slower",
             "records": ["options-zen3.json"]},
            {"what": "another", "machines": [], "measured": "1.007x", "why": "within the noise",
             "records": []}]  # fmt: skip
    tried = {"benchmark": "tried-not-kept", "rows": rows}
    text = render(tmp_path, {"options-zen3": options, "tried-not-kept": tried}, ("tried-not-kept", "machines"))
    assert "| a change | Zen 3, Zen 5 | 0.80x | slower | `options-zen3.json` |" in text
    assert "| another | - | 1.007x | within the noise | - |" in text
    assert "| Zen 3 | AMD EPYC (family 25, model 1) | AVX2 | emulated | 2 | 1 |" in text


def test_a_main_job_run_in_another_precision_or_instruction_set_is_the_recipe_and_says_where_it_ran(tmp_path):
    """`--precision` picks the recipe's arithmetic, not a change to it: such a record joins the main-job table with
    its precision; a record made with narrower instructions than its CPU has is named as run with those, and counts
    as its own machine in the machines table; any other option is a change to the recipe and stays out."""
    machine = {"cpu": "AMD EPYC (family 25, model 17)", "family": 25, "model": 17, "flags": ["avx512_bf16"],
               "bf16_native_cpu": True, "threads": 2}  # fmt: skip
    row = {"seed": 0, "precision": "fp32", "schedule": "linear", "cache": "cold", "top1": 90.31, "val_images": None,
           "steps": 14040, "epochs": 30.0, "patch_dropout": 0.5, "wall_s": 500.0}  # fmt: skip
    limited = {"benchmark": "main-job", "date": "2026-01-02T00:00Z", "options": ["--precision", "fp32"],
               "machine": {**machine, "isa_limits": {"ATEN_CPU_CAPABILITY": "avx2"}}, "rows": [row]}  # fmt: skip
    change = {**limited, "machine": machine, "options": ["--precision", "fp32", "--batch-size", "64"],
              "rows": [{**row, "top1": 12.34}]}  # fmt: skip
    text = render(tmp_path, {"limited": limited, "change": change}, ("main-job", "machines"))
    expected = "| Zen 4 run as AVX2 | fp32 | 30 epochs, patch dropout 0.5 | linear | none | 1 | 90.31% | 8 min 20 s |"
    assert expected in text
    assert "12.34" not in text
    assert "| Zen 4 | AMD EPYC (family 25, model 17) | AVX-512 BF16 | native | 2 | 2 |" in text


def test_the_readmes_main_job_table_shows_only_the_recipe_of_the_newest_run_on_all_training_images(tmp_path):
    machine = {"cpu": "AMD EPYC (family 25, model 17)", "family": 25, "model": 17, "flags": ["avx512_bf16"]}
    row = {"seed": 0, "precision": "bf16", "schedule": "linear", "cache": "cold", "top1": 90.31, "val_images": None,
           "steps": 14040, "epochs": 30.0, "patch_dropout": 0.5, "wall_s": 400.0}  # fmt: skip
    now = {"benchmark": "main-job", "machine": machine, "date": "2026-01-02T00:00Z", "options": [], "rows": [row]}
    on_val = {**now, "date": "2026-01-03T00:00Z", "rows": [{**row, "val_images": 6000, "top1": 77.77}]}
    old_row = {**row, "epochs": 20.0, "patch_dropout": 0.0, "top1": 88.88}
    before = {**now, "date": "2026-01-01T00:00Z", "rows": [old_row]}
    records = {"now": now, "on_val": on_val, "before": before}
    every = render(tmp_path / "every", records, ("main-job",))
    assert all(figure in every for figure in ("90.31%", "77.77%", "88.88%"))
    text = render(tmp_path / "now", records, ("main-job-now",))
    assert "| Zen 4 | bf16 | 1 | 90.31% | 6 min 40 s |" in text and "77.77" not in text and "88.88" not in text
