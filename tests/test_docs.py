"""The README and docs/: every relative link and image points to a file, and every #anchor to a heading."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def links(doc: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold commands, not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto:


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file_and_every_anchor_to_a_heading(doc):
    broken = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"


def test_the_link_and_anchor_rules_find_what_the_readme_holds():
    doc = ROOT / "README.md"
    assert "results-at-a-glance" in anchors(doc) and "quick-start" in anchors(doc)
    assert "docs/PERFORMANCE.md" in links(doc) and "docs/report-screenshot.png" in links(doc)
    assert "https://download.pytorch.org/whl/cpu" not in links(doc)
