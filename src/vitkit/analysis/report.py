"""The inspection report: the figures of `vitkit.analysis` (drawn by `analysis.plots`) gathered into one
self-contained `report.html`, every image embedded as a data URI, each with a caption that says what it shows and
what it does not; the images it draws them for, read from files or a dataset's test split.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import os
from collections.abc import Sequence
from inspect import signature
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from vitkit.data.augment import model_input
from vitkit.data.datasets import DATASETS, get_dataset, spread_indices
from vitkit.data.images import SkipLog, read_image
from vitkit.errors import ImageError
from vitkit.files import atomic_write, refuse_overwrite
from vitkit.models.vit import VisionTransformer

from . import attribution as at
from . import figures as vi
from .plots import (
    Samples,
    plot_attention_distance,
    plot_attention_maps,
    plot_embedding_filters,
    plot_faithfulness,
    plot_posemb_similarity,
    plot_saliency,
    png_bytes,
)
from .saliency import CAPTUM_METHODS

FAITHFULNESS_STEPS = 16  # points of each deletion and insertion curve in the report (at most one per patch)
FAITHFULNESS_ORDERINGS = 3  # random orderings averaged for the floor


# ----------------------------------------------------------------------------------------------------------
# Inputs: image files or a dataset's test split, at the model's resolution.
# ----------------------------------------------------------------------------------------------------------


def load_images(paths: Sequence[str | os.PathLike], model: VisionTransformer, strict: bool = False) -> Samples:
    """Image files -> Samples: RGB (or grayscale for a 1-channel model), resized to the model's resolution
    (aspect ratio not kept), normalised as evaluation does (`augment.model_input`). Unreadable files are skipped
    with a warning naming each (with `strict`, the first is an ImageError); none readable is an error."""
    mode = "L" if model.config.in_chans == 1 else "RGB"
    images, titles, skipped = [], [], SkipLog()
    for path in paths:
        try:
            image = read_image(path, mode)
        except ImageError as e:
            if strict:
                raise
            skipped.add(e)
            continue
        images.append(model_input(image, model))
        titles.append(Path(path).name)
    if not images:
        raise ValueError(f"none of the {len(paths)} image file(s) could be read: {'; '.join(skipped.files.values())}")
    return Samples(torch.cat(images), titles, normalization=model.normalization)


def dataset_samples(name: str, count: int, model: VisionTransformer, split: str = "test") -> Samples:
    """`count` samples spread evenly over a dataset's split (a name, or a folder: `data.locate`), so that a folder
    sorted by class shows several classes, at the model's resolution, with labels and (where the dataset knows
    them, as `shapes` does) object boxes scaled to the model's pixels.

    A dataset that can render at any resolution (`shapes`) is rendered at the model's; others are resized.
    """
    if count < 1:
        raise ValueError(f"--samples {count}: ask for at least one image.")
    kwargs: dict[str, Any] = {}
    if name in DATASETS and "image_size" in signature(DATASETS[name]).parameters:
        kwargs["image_size"] = model.config.image_size[0]
    dataset = get_dataset(name, split, **kwargs)
    indices = spread_indices(len(dataset), count)
    raw = [dataset[i] for i in indices]
    skipped: SkipLog = getattr(dataset, "skipped", SkipLog())
    for image, _ in raw:
        if isinstance(image, ImageError):  # an image file that failed to decode: logged, left out
            skipped.add(image)
    raw = [sample for sample in raw if not isinstance(sample[0], ImageError)]
    images = torch.cat([model_input(img, model) for img, _ in raw])
    labels = [int(label) for _, label in raw]
    classes = getattr(dataset, "classes", None)
    titles = [f"#{i}: {classes[y] if classes else y}" for i, y in enumerate(labels)]
    boxes = None
    if hasattr(dataset, "box"):
        (h, w), (sh, sw) = model.config.image_size, raw[0][0].shape[-2:]
        boxes = []
        for i in indices:
            x0, y0, x1, y1 = dataset.box(i)
            boxes.append((round(x0 * w / sw), round(y0 * h / sh), round(x1 * w / sw), round(y1 * h / sh)))
    return Samples(images, titles, labels, boxes, model.normalization)


# ----------------------------------------------------------------------------------------------------------
# The HTML report.
# ----------------------------------------------------------------------------------------------------------

CAPTIONS = {
    "saliency": (
        "Per image: the input, the <b>attention rollout</b> (paper Figs. 6 and 14: heads averaged, the residual "
        "added as 0.5&middot;A + 0.5&middot;I, the layers multiplied; Abnar &amp; Zuidema 2020) and the "
        "<b>occlusion map</b>. Rollout shows how attention carries information from the patches to "
        "{query}; it has one value per patch, upsampled, and it is <i>not</i> an attribution: a region can "
        "receive attention and not matter for the prediction. The occlusion map is an attribution: {occlusion}"
    ),
    "attention_maps": (
        "Attention from {query} to every patch, for each layer (rows) and head (columns), on the first image. "
        "Single heads are noisy and several attend to the same few tokens; rollout combines them."
    ),
    "attention_distance": (
        "Mean attention distance (paper Fig. 7 right): for each head (dots) at each layer, the "
        "attention-weighted distance in pixels between query and key patches, averaged over the {n} images; the "
        "analogue of a CNN's receptive field size. In the paper some heads attend globally already in the "
        "lowest layers while others stay local; the distance grows with depth. Dashed: uniform attention. "
        "Attention to and from the class token is left out (it has no place in the image)."
    ),
    "posemb_similarity": (
        "Position embedding similarity (paper Fig. 7 centre): the tile at row i, column j shows the cosine "
        "similarity of that patch's position embedding with every patch's. A learned 1D embedding that has "
        "found the 2D layout shows a bright spot at the patch's own place and row and column structure; "
        "'sincos2d' has it by construction. Untrained or briefly trained embeddings look like noise."
    ),
    "faithfulness": (
        "Which map explains the decision? Each method's map per patch (bright: ranked first) over each image, "
        "titled with its <b>deletion</b> and <b>insertion</b> AUC (<code>vitkit.analysis.attribution</code>). Deletion "
        "replaces the patches, highest-ranked first, with the removal baseline and follows the probability of the "
        "predicted class, which a faithful map makes fall fast (low area); insertion reveals them in the same order "
        "on the baseline image, where it should rise fast (high area). Baseline: <b>{baseline}</b>, {description}; "
        "the scores depend on it. {steps} steps per curve; the floor is the mean of {orderings} random orderings "
        "(seed 0). Attention shows mixing weights, not a region's contribution to the class: these numbers say "
        "whether a map ranks the patches the prediction depends on, on this model and these images."
    ),
    "embedding_filters": (
        "Principal components of the patch-embedding filters E (paper Fig. 7 left), strongest first, each "
        "rescaled to the full colour range ({note}). The sign of a component is arbitrary. Trained on enough "
        "data they resemble plausible basis functions for a low-dimensional representation of a patch."
    ),
}


# What the saliency caption says the occlusion map measures, by `Occlusion.measure`.
OCCLUSION_CAPTIONS = {
    vi.PROBABILITY: (
        "red where hiding a window (the image's mean colour over a patch-sized square) lowers the predicted "
        "class's probability, blue where it raises it."
    ),
    vi.FEATURES: (
        "<b>this model has no classification head</b> (a backbone, num_classes=0), so there is no predicted "
        "class: the map shows how much hiding a window (the image's mean colour over a patch-sized square) "
        "changes the model's feature vector, the fall of the cosine similarity of the occluded image's pooled "
        "features to the unoccluded image's (1 &minus; cos; red: a large change)."
    ),
}


def _figure_html(name: str, data: bytes, heading: str, caption: str, extra: str = "") -> str:
    """A section of the page: the figure, its caption, and `extra` HTML after them."""
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return (
        f'<section id="{name}"><h2>{html.escape(heading)}</h2>'
        f'<figure><img src="{uri}" alt="{html.escape(heading)}"><figcaption>{caption}</figcaption></figure>'
        f"{extra}</section>"
    )


def _note_html(name: str, heading: str, text: str) -> str:
    return f'<section id="{name}"><h2>{html.escape(heading)}</h2><p class="note">{html.escape(text)}</p></section>'


def _config_html(model: VisionTransformer, per_row: int = 4) -> str:
    cells = [f"<th>{html.escape(k)}</th><td>{html.escape(str(v))}</td>" for k, v in model.config.to_dict().items()]
    rows = "".join(f"<tr>{''.join(cells[i : i + per_row])}</tr>" for i in range(0, len(cells), per_row))
    params = sum(p.numel() for p in model.parameters())
    classes = ", ".join(model.class_names) if model.class_names else "not recorded in the checkpoint"
    if not model.config.num_classes:
        classes = "none, no head (a backbone: num_classes=0)"
    return (
        f'<section id="model"><h2>Model</h2><p><b>{params:,}</b> parameters; {model.config.grid_size[0]}x'
        f"{model.config.grid_size[1]} patches of {model.config.patch_stride[0]} px; classes: "
        f"{html.escape(classes)}.</p><table>{rows}</table></section>"
    )


def _localisation_html(rollout: vi.Localisation, occlusion: vi.Localisation, n: int) -> str:
    def row(name: str, loc: vi.Localisation) -> str:
        cells = "".join(f"<td>{v:.0%}</td>" for v in (loc.hit_rate, loc.mass_inside, loc.chance))
        return f"<tr><th>{name}</th>{cells}</tr>"

    return (
        '<section id="localisation"><h2>Do the maps find the object?</h2>'
        "<table><tr><th></th><th>peak inside the box</th><th>positive mass inside</th><th>chance (box area)</th>"
        f"</tr>{row('attention rollout', rollout)}{row('occlusion', occlusion)}</table>"
        f"<p class='note'>Over the {n} images with a known object box. A map that ignored the object would score "
        "the box's share of the image in both columns.</p></section>"
    )


STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; }
figure { margin: 0.5em 0 1.5em; } img { max-width: 100%; height: auto; display: block; }
figcaption, .note { font-size: 0.9em; color: #444; max-width: 80ch; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 8px; text-align: left; } th { background: #f6f6f6; }
"""


def faithfulness_methods() -> tuple[list[str], str]:
    """The attribution methods the report measures, and a note on those left out (Captum not installed)."""
    if importlib.util.find_spec("captum") is None:
        kept = [m for m in at.METHODS if m not in CAPTUM_METHODS]
        return kept, "Integrated gradients and gradient x input are left out: they need Captum (pip install captum)."
    return list(at.METHODS), ""


def _faithfulness_steps(model: VisionTransformer) -> int:
    gh, gw = model.config.grid_size
    return min(gh * gw, FAITHFULNESS_STEPS)


def faithfulness_plan(model: VisionTransformer, images: int) -> str:
    """What the faithfulness section will cost, said before it is computed."""
    if vi.has_no_head(model):
        return "faithfulness: none (the model has no head, so no class probability to follow)"
    methods, _ = faithfulness_methods()
    steps = _faithfulness_steps(model)
    passes = at.forward_passes(model, images, methods, steps, FAITHFULNESS_ORDERINGS)
    return (
        f"faithfulness: {images} image(s) x ({len(methods)} maps + {FAITHFULNESS_ORDERINGS} random orderings) x 2 "
        f"curves x {steps + 1} points = {passes['curves']:,} forward passes; the maps {passes['maps']:,} more, "
        f"and {passes['backward']:,} backward passes"
    )


def occlusion_plan(model: VisionTransformer, images: int, stride: int | None = None) -> str:
    """What the occlusion maps will cost, said before they are computed: forward passes in all, and how a
    coarser `stride` would cut them."""
    patch = model.config.patch_stride[0]
    stride = stride or max(patch // 2, 1)
    windows = len(vi.occlusion_windows(model.config.image_size, patch, stride))
    text = (
        f"occlusion: {images} image(s) x {windows:,} windows = {images * windows:,} forward passes "
        f"({patch} px window, --stride {stride})"
    )
    coarser = min(2 * stride, patch)
    if coarser > stride:
        fewer = len(vi.occlusion_windows(model.config.image_size, patch, coarser))
        text += f"; --stride {coarser} takes {images * fewer:,}"
    return text


def write_report(
    model: VisionTransformer,
    samples: Samples,
    out_dir: str | os.PathLike,
    title: str = "",
    stride: int | None = None,
    progress: bool = False,
    overwrite: bool = False,
    gradient_model: VisionTransformer | None = None,
) -> Path:
    """Compute every figure of `vitkit.analysis.figures` for `model` on `samples`, and the faithfulness of its maps
    (`vitkit.analysis.attribution`), write each figure as a PNG into `out_dir` and all of them, embedded, into
    `out_dir/report.html`; returns the path of the HTML file. `stride` is the occlusion windows' (default: half a
    patch); `progress` shows bars of the forward passes on a terminal. `gradient_model`: the model as loaded, when
    `model` is a copy made by `vitkit.optimize`, which computes no gradients (the faithfulness section is measured
    on it). A non-empty `out_dir` is a FileExistsError unless `overwrite`."""
    out = _report_folder(out_dir, overwrite)
    images, n = samples.images, samples.images.shape[0]
    rollouts = [vi.attention_rollout(model, image) for image in images]
    occlusions = _occlusions(model, images, stride, progress)
    parts = [_config_html(model)]
    if samples.boxes is not None:
        rollout_loc = vi.localisation(torch.stack([r.upsampled for r in rollouts]), samples.boxes)
        occlusion_loc = vi.localisation(torch.stack([o.drop for o in occlusions]), samples.boxes)
        parts.append(_localisation_html(rollout_loc, occlusion_loc, n))
    query = html.escape(rollouts[0].query)
    fig = plot_saliency(samples, rollouts, occlusions, model.class_names)
    caption = CAPTIONS["saliency"].format(query=query, occlusion=OCCLUSION_CAPTIONS[occlusions[0].measure])
    caption += " Green boxes are the known object boxes." if samples.boxes is not None else ""
    parts.append(_figure(out, "saliency", "Where the model looks, and what it uses", fig, caption))
    parts.append(_faithfulness_part(out, gradient_model or model, samples, progress))
    fig = plot_attention_maps(vi.attention_maps(model, images[0]), images[0], samples.normalization)
    caption = CAPTIONS["attention_maps"].format(query=query)
    parts.append(_figure(out, "attention_maps", "Attention maps per layer and head", fig, caption))
    uniform = float(vi.patch_distances(model.config.grid_size, model.config.patch_stride).mean())
    fig = plot_attention_distance(vi.mean_attention_distance(model, images), uniform)
    caption = CAPTIONS["attention_distance"].format(n=n)
    parts.append(_figure(out, "attention_distance", "Mean attention distance", fig, caption))
    parts += [_posemb_part(out, model), _embedding_filters_part(out, model)]
    path = out / "report.html"
    page = _page(title, samples, parts)
    atomic_write(path, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    return path


def _report_folder(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """`out_dir`, created: a file there, or a non-empty folder without `overwrite`, is refused."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: the report is a folder (PNGs and report.html); give a new path.")
    refuse_overwrite(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _occlusions(
    model: VisionTransformer, images: torch.Tensor, stride: int | None, progress: bool
) -> list[vi.Occlusion]:
    """The occlusion map of each image, with a bar of the forward passes when `progress`."""
    from tqdm import tqdm

    patch = model.config.patch_stride[0]
    windows = len(vi.occlusion_windows(model.config.image_size, patch, stride or max(patch // 2, 1)))
    with tqdm(total=len(images) * windows, desc="occlusion", unit="pass", disable=None if progress else True) as bar:
        return [vi.occlusion_sensitivity(model, image, stride=stride, on_batch=bar.update) for image in images]


def _figure(out: Path, name: str, heading: str, fig: Figure, caption: str, extra: str = "") -> str:
    """The figure written to `out/<name>.png`, and its section of the page."""
    data = png_bytes(fig)
    atomic_write(out / f"{name}.png", lambda tmp: Path(tmp).write_bytes(data))
    return _figure_html(name, data, heading, caption, extra)


def _faithfulness_part(out: Path, model: VisionTransformer, samples: Samples, progress: bool) -> str:
    """Deletion and insertion AUC of each attribution method on the samples: the maps, a table, one reading each."""
    from tqdm import tqdm

    heading, n = "Which map explains the decision: deletion and insertion", samples.images.shape[0]
    if vi.has_no_head(model):
        text = "The model has no classification head (num_classes=0): deletion and insertion follow a class "
        return _note_html("faithfulness", heading, text + "probability, so there is none to follow.")
    methods, left_out = faithfulness_methods()
    steps, patch = _faithfulness_steps(model), model.config.patch_stride[0]
    total = at.forward_passes(model, n, methods, steps, FAITHFULNESS_ORDERINGS)["curves"]
    total += n * len(vi.occlusion_windows(model.config.image_size, patch, patch)) if "occlusion" in methods else 0
    with tqdm(total=total, desc="faithfulness", unit="pass", disable=None if progress else True) as bar:
        result = at.faithfulness(
            model, samples.images, methods=methods, steps=steps, orderings=FAITHFULNESS_ORDERINGS, on_batch=bar.update
        )
    caption = CAPTIONS["faithfulness"].format(
        baseline=result.baseline,
        description=html.escape(at.BASELINE_DESCRIPTIONS[result.baseline]),
        steps=result.steps,
        orderings=FAITHFULNESS_ORDERINGS,
    )
    extra = _faithfulness_table(result, samples.titles) + (
        f"<p class='note'>{html.escape(left_out)}</p>" * bool(left_out)
    )
    return _figure(out, "faithfulness", heading, plot_faithfulness(samples, result), caption, extra)


def _faithfulness_table(result: at.Faithfulness, titles: list[str]) -> str:
    """Mean and per-image AUCs of each method and of the random floor, then one reading per method."""

    def row(method: str) -> str:
        mean = f"<td>{result.mean(method, 'deletion'):.3f}</td><td>{result.mean(method, 'insertion'):.3f}</td>"
        pairs = zip(result.deletion[method], result.insertion[method])
        return (
            f"<tr><th>{at.LABELS[method]}</th>{mean}"
            + "".join(f"<td>{d:.2f} / {i:.2f}</td>" for d, i in pairs)
            + "</tr>"
        )

    head = "".join(f"<th>{html.escape(t)}</th>" for t in titles)
    readings = "".join(f"<li>{html.escape(at.reading(result, m))}</li>" for m in result.methods)
    skipped = "".join(f"<li>{at.LABELS[m]}: skipped, {html.escape(why)}</li>" for m, why in result.skipped.items())
    return (
        "<table><tr><th>method</th><th>deletion AUC (mean, lower: better)</th><th>insertion AUC (mean, higher: "
        f"better)</th>{head}</tr>{''.join(row(m) for m in (*result.methods, at.RANDOM))}</table>"
        "<p class='note'>Per image: deletion / insertion AUC. Readings (better or worse than random: beyond twice "
        f"the standard error over the images):</p><ul class='note'>{readings}{skipped}</ul>"
    )


def _posemb_part(out: Path, model: VisionTransformer) -> str:
    try:
        similarity = vi.posemb_similarity(model)
    except ValueError as e:
        return _note_html("posemb_similarity", "Position embedding similarity", str(e))
    fig = plot_posemb_similarity(similarity)
    return _figure(out, "posemb_similarity", "Position embedding similarity", fig, CAPTIONS["posemb_similarity"])


def _embedding_filters_part(out: Path, model: VisionTransformer) -> str:
    filters = vi.embedding_filters(model)
    if not filters.image_like:
        return _note_html("embedding_filters", "Patch-embedding filters", filters.note)
    caption = CAPTIONS["embedding_filters"].format(note=html.escape(filters.note))
    if model.config.in_chans == 3 and (getattr(model, "trained_on", None) or {}).get("grayscale"):
        caption += (
            " <b>This model was trained on grayscale images</b> (given as three equal channels), so the "
            "colours of these filters mean nothing: only their light and dark pattern does."
        )
    return _figure(out, "embedding_filters", "Patch-embedding filters", plot_embedding_filters(filters), caption)


def _page(title: str, samples: Samples, parts: list[str]) -> str:
    heading = html.escape(title or "vitkit inspect")
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{heading}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
        f"<body><h1>{heading}</h1><p class='note'>The paper's analysis figures (Dosovitskiy et al., ICLR 2021, "
        f"Figs. 6, 7, 14) for this model on {samples.images.shape[0]} image(s), made by <code>vitkit inspect</code>. "
        f"Images: {html.escape(', '.join(samples.titles))}.</p>" + "".join(parts) + "</body></html>"
    )
