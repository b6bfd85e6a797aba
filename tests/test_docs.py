"""The README and docs/: every relative link and image points to a file, every #anchor to a heading, the
snippets of the deploying section run and give vitkit's logits, and the tutorial runs as written."""

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import signal_stack_is_mapped

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


def python_blocks(doc: Path, heading: str) -> list[str]:
    """The ```python blocks of one section (from `heading` to the next heading of its level) of a markdown file."""
    text = doc.read_text()
    level = heading.split(" ")[0]
    section = text.split(f"\n{heading}\n", 1)[1].split(f"\n{level} ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.slow
@pytest.mark.parametrize("in_chans", [3, 1], ids=["rgb", "grayscale"])
def test_the_deploying_snippets_reproduce_vitkits_logits_on_photographs(in_chans, tmp_path, monkeypatch, capsys):
    pytest.importorskip("onnxscript", reason="ONNX export needs the optional onnx and onnxscript (dev extra)")
    pytest.importorskip("onnxruntime", reason="the snippet runs the optional onnxruntime (dev extra)")
    openvino = pytest.importorskip("openvino", reason="the snippet runs the optional openvino (dev extra)")
    import torch
    from PIL import Image
    from skimage import data

    import vitkit
    from vitkit.data.augment import eval_batch
    from vitkit.data.images import read_image
    from vitkit.speed.openvino_copy import openvino_core

    export, onnxruntime_block, openvino_block = python_blocks(ROOT / "docs/USAGE.md", "## Deploying")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = vitkit.create_model("ViT-Ti/16", num_classes=3, image_size=(48, 64), in_chans=in_chans).eval()
    torch.nn.init.normal_(model.head.weight)  # the head starts at zero, as the paper's: logits all 0
    model.class_names = ["cat", "cup", "other"]
    vitkit.export(model, "model.safetensors")
    Image.fromarray(data.chelsea()).save("cat.jpg")  # 451x300, shrunk to 64x48
    Image.fromarray(data.coffee()[::8, ::8]).save("coffee.jpg")  # 75x50, enlarged
    with torch.no_grad():
        reference = model(torch.cat([eval_batch(read_image(p), (48, 64), in_chans) for p in ("cat.jpg", "coffee.jpg")]))

    def relative(logits) -> float:
        return float((torch.from_numpy(logits) - reference).abs().max() / reference.abs().max())

    namespace: dict = {}
    exec(export, namespace)
    exec(onnxruntime_block, namespace)
    assert relative(namespace["logits"]) <= 1e-5
    assert capsys.readouterr().out.strip() == str([model.class_names[i] for i in reference.argmax(1)])
    # Run twice, as by a script that runs it in one process (or the two parametrizations here), with the runs' objects
    # freed in the order they were made: its `openvino.Core()` is the process's one Core, which USAGE.md tells a
    # script to share; a Core of its own per run would leave the thread on a freed signal stack (see `openvino_core`).
    core = openvino_core()
    monkeypatch.setattr(openvino, "Core", lambda: core)
    runs = [dict(namespace), dict(namespace)]
    for run in runs:
        exec(openvino_block, run)
        assert relative(run["logits"]) <= 1e-4
    del runs, run
    gc.collect()
    assert signal_stack_is_mapped()


@pytest.mark.slow
def test_the_tutorial_runs_as_written_and_shows_what_it_says(tmp_path):
    pytest.importorskip("sklearn", reason="the tutorial's images are scikit-learn's digits (dev extra)")
    pytest.importorskip("onnxscript", reason="the tutorial's last step exports ONNX (onnx extra)")
    doc = (ROOT / "docs/TUTORIAL.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", doc, flags=re.S)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # `vitkit`
    shown = [text.strip() for kind, text in blocks if not kind]  # output the tutorial shows
    printed = ""
    for kind, text in blocks:
        if kind == "python":
            done = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True)
        elif kind == "bash":
            done = subprocess.run(["bash", "-e", "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True)
        else:
            continue
        assert done.returncode == 0, f"{text}\n{done.stderr[-2000:]}"
        printed += done.stdout
    assert all(line in printed for line in shown), shown
    top1 = float(re.search(r"^val +top-1 ([\d.]+)%", printed, flags=re.M).group(1))
    assert top1 >= 98, top1  # "about 99%": 180 val images, so one is 0.56 points; CPUs round differently
    assert len(list((tmp_path / "new").glob("*.png"))) == 10 and printed.count("new/") >= 10  # predict saw them
    assert (tmp_path / "runs/digits/inspect/report.html").is_file() and (tmp_path / "digits.onnx").is_file()
