"""benchmarks/tables.py: the docs' generated tables are what the records in benchmarks/results/ give."""

import subprocess
import sys

from helpers import SRC

TABLES = SRC.parent / "benchmarks" / "tables.py"


def run_tables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TABLES), *args], capture_output=True, text=True, timeout=60)


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
