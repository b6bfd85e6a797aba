"""The figures of the inspection report, drawn with matplotlib on a `Figure` (no display needed): patch-embedding
filters, position-embedding similarity, mean attention distance, attention maps, saliency (rollout and occlusion) and
attribution faithfulness, each from the values `vitkit.analysis` computes; `png_bytes` renders one.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from . import attribution as at
from . import figures as vi

DPI = 100
PER_ROW = 6  # images per row of the saliency figure
FAITHFULNESS_SHOWN = 8  # images whose maps the faithfulness figure draws; its table has every image


@dataclass(frozen=True)
class Samples:
    """Model input `images` (B, C, H, W) in [-1, 1] (or normalised with the model's own `normalization`), with a
    `title` per image and, when known, the true `labels` and the object `boxes` (x0, y0, x1, y1) in model pixels."""

    images: torch.Tensor
    titles: list[str]
    labels: list[int] | None = None
    boxes: list[tuple[int, int, int, int]] | None = None
    normalization: dict | None = None


def _display(image: torch.Tensor, normalization: dict | None = None) -> np.ndarray:
    """Model input (C, H, W) in [-1, 1] (or normalised so) -> (H, W, 3) or (H, W) in [0, 1] for imshow."""
    x = image.detach().float().cpu()
    if normalization is None:
        x = (x + 1) / 2
    else:
        x = x * torch.tensor(normalization["std"])[:, None, None] + torch.tensor(normalization["mean"])[:, None, None]
    x = x.clamp(0, 1)
    return x.permute(1, 2, 0).numpy() if x.shape[0] == 3 else x.mean(dim=0).numpy()


def _off(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def mosaic(tiles: np.ndarray, columns: int, pad: int = 1, background: float = 1.0) -> np.ndarray:
    """Tiles (n, h, w, c) laid out row by row, `columns` per row, `pad` pixels of `background` between them."""
    n, h, w, c = tiles.shape
    rows = -(-n // columns)
    out = np.full((rows * (h + pad) - pad, columns * (w + pad) - pad, c), background, dtype=np.float32)
    for i, tile in enumerate(tiles):
        r, col = divmod(i, columns)
        out[r * (h + pad) : r * (h + pad) + h, col * (w + pad) : col * (w + pad) + w] = tile
    return out


def _mosaic_figure(
    image: np.ndarray,
    title: str,
    inches: float,
    labels: tuple[str, str] | None = None,
    tiles: tuple[int, int] = (1, 1),
    colorbar: str | None = None,
    **imshow,
) -> Figure:
    """A figure showing one mosaic `inches` wide; with `labels` (rows, columns) the (rows, columns) `tiles` are
    numbered; with `colorbar` a colour bar of that name stands on the right."""
    left, right, top, bottom = 0.55, 1.1, 0.85 if labels else 0.45, 0.15  # inches
    height = inches * image.shape[0] / image.shape[1]
    width_in, height_in = inches + left + right, height + top + bottom
    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    ax = fig.add_axes((left / width_in, bottom / height_in, inches / width_in, height / height_in))
    shown = ax.imshow(image, interpolation="nearest", **imshow)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    if colorbar:
        bar = fig.add_axes(((inches + left + 0.15) / width_in, bottom / height_in, 0.18 / width_in, height / height_in))
        fig.colorbar(shown, cax=bar, label=colorbar)
    if labels is not None:
        rows, columns = tiles
        ax.set_yticks((np.arange(rows) + 0.5) * image.shape[0] / rows, [str(i + 1) for i in range(rows)], fontsize=7)
        ax.set_xticks(
            (np.arange(columns) + 0.5) * image.shape[1] / columns, [str(i + 1) for i in range(columns)], fontsize=7
        )
        ax.tick_params(length=0, labeltop=True, labelbottom=False)
        ax.set_ylabel(labels[0], fontsize=8)
        ax.set_title(labels[1], fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


def plot_embedding_filters(filters: vi.EmbeddingFilters, columns: int = 7) -> Figure:
    """The principal components as small image patches, strongest first, each rescaled to [0, 1]."""
    c = filters.components
    lo, hi = c.amin(dim=(1, 2, 3), keepdim=True), c.amax(dim=(1, 2, 3), keepdim=True)
    tiles = ((c - lo) / (hi - lo).clamp(min=1e-12)).permute(0, 2, 3, 1).numpy()  # (k, ph, pw, C)
    if tiles.shape[-1] != 3:
        tiles = tiles.mean(axis=-1, keepdims=True).repeat(3, axis=-1)
    pad = max(tiles.shape[1] // 8, 1)
    return _mosaic_figure(mosaic(tiles, min(columns, len(tiles)), pad), "Embedding filters (principal components)", 5)


def plot_posemb_similarity(similarity: torch.Tensor) -> Figure:
    """One small map per patch (at the patch's place): its posemb's cosine similarity with every patch's."""
    gh, gw = similarity.shape[:2]
    tiles = similarity.reshape(gh * gw, gh, gw, 1).numpy()
    image = mosaic(tiles, gw, pad=max(gh // 8, 1), background=np.nan)[..., 0]
    labels = ("input patch row", "input patch column")
    title = "Position embedding similarity"
    return _mosaic_figure(image, title, 5, labels, (gh, gw), "cosine similarity", cmap="viridis", vmin=-1, vmax=1)


def plot_attention_distance(distance: torch.Tensor, uniform: float) -> Figure:
    """Mean attention distance of each head (dots) against depth, with uniform attention as a reference."""
    layers, heads = distance.shape
    fig = Figure(figsize=(5.5, 3.6), dpi=DPI)
    ax = fig.add_subplot()
    for h in range(heads):
        ax.scatter(
            np.arange(1, layers + 1), distance[:, h].numpy(), s=14, label=f"head {h + 1}" if heads <= 8 else None
        )
    ax.axhline(uniform, color="grey", linestyle="--", linewidth=1, label="uniform attention")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(np.arange(1, layers + 1))
    ax.set_ylim(0, 1.15 * max(float(distance.max()), uniform))
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.set_title("Mean attention distance per head", fontsize=10)
    fig.tight_layout()
    return fig


def _overlay(image: np.ndarray, heat: np.ndarray, cmap: str = "inferno", alpha: float = 0.6) -> np.ndarray:
    """Blend a (gh, gw) heat map, scaled to its own maximum and enlarged by pixel repetition, over an image."""
    h, w = image.shape[:2]
    heat = heat / max(float(heat.max()), 1e-12)
    heat = heat.repeat(h // heat.shape[0], axis=0).repeat(w // heat.shape[1], axis=1)
    rgb = image if image.ndim == 3 else image[..., None].repeat(3, axis=-1)
    return (1 - alpha) * rgb + alpha * colormaps[cmap](heat)[..., :3]


def plot_attention_maps(maps: vi.AttentionMaps, image: torch.Tensor, normalization: dict | None = None) -> Figure:
    """Rows are layers, columns heads: each head's attention to the patches over the image (normalised as
    `normalization` says), each map scaled to its own maximum."""
    layers, heads = maps.maps.shape[:2]
    shown = _display(image, normalization)
    tiles = np.stack([_overlay(shown, m.numpy()) for m in maps.maps.reshape(layers * heads, *maps.maps.shape[2:])])
    pad = max(shown.shape[0] // 16, 1)
    title = "Attention of each head at each layer"
    return _mosaic_figure(mosaic(tiles, heads, pad), title, min(1.1 * heads, 9), ("layer", "head"), (layers, heads))


def plot_saliency(
    samples: Samples, rollouts: list[vi.Rollout], occlusions: list[vi.Occlusion], class_names: list[str] | None
) -> Figure:
    """For each image: the input, its attention rollout and its occlusion map; object boxes in green."""
    n = samples.images.shape[0]
    blocks, per_row = -(-n // PER_ROW), min(n, PER_ROW)
    fig = Figure(figsize=(1.9 * per_row + 0.9, 6.4 * blocks), dpi=DPI)
    kinds = ("input", "rollout", "occlusion")
    for i in range(n):
        block, column = divmod(i, PER_ROW)
        shown = _display(samples.images[i], samples.normalization)
        h, w = shown.shape[:2]
        occ = occlusions[i]
        panels = (None, rollouts[i].upsampled, occ.drop)
        for r, (kind, saliency) in enumerate(zip(kinds, panels)):
            ax = fig.add_subplot(3 * blocks, per_row, (3 * block + r) * per_row + column + 1)
            ax.imshow(shown, cmap="gray", extent=(0, w, h, 0))
            if saliency is not None:
                limit = float(saliency.abs().max()) or 1.0
                cmap, lo = ("inferno", 0.0) if kind == "rollout" else ("RdBu_r", -limit)
                ax.imshow(saliency.numpy(), cmap=cmap, vmin=lo, vmax=limit, alpha=0.6, extent=(0, w, h, 0))
            if samples.boxes is not None:
                x0, y0, x1, y1 = samples.boxes[i]
                ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor="lime", linewidth=1.2))
            _off(ax)
            if r == 0:
                ax.set_title(f"{samples.titles[i]}\n{_prediction(occ, class_names)}", fontsize=8)
            if column == 0:
                ax.set_ylabel(kind, fontsize=9)
    fig.tight_layout()
    return fig


def plot_faithfulness(samples: Samples, result: at.Faithfulness) -> Figure:
    """Rows: the input, then each method's per-patch map over it (bright: ranked first), titled with its deletion
    and insertion AUC; one column per image (the first `FAITHFULNESS_SHOWN`)."""
    n, rows = min(samples.images.shape[0], FAITHFULNESS_SHOWN), (None, *result.methods)
    fig = Figure(figsize=(1.45 * n + 1.2, 1.5 * len(rows)), dpi=DPI)
    for column in range(n):
        shown = _display(samples.images[column], samples.normalization)
        for r, method in enumerate(rows):
            ax = fig.add_subplot(len(rows), n, r * n + column + 1)
            if method is None:
                ax.imshow(shown, cmap="gray")
                ax.set_title(samples.titles[column], fontsize=7)
            else:
                heat = result.maps[method][column].numpy()
                ax.imshow(_overlay(shown, heat - heat.min()))
                d, i = result.deletion[method][column], result.insertion[method][column]
                ax.set_title(f"del {d:.2f}  ins {i:.2f}", fontsize=6)
            _off(ax)
            if column == 0:
                ax.set_ylabel("input" if method is None else at.LABELS[method], fontsize=7)
    fig.tight_layout()
    return fig


def _prediction(occ: vi.Occlusion, class_names: list[str] | None) -> str:
    """What the occlusion map is measured against: the predicted class, or for a headless model its features."""
    if occ.target is None:
        return "no head: features"
    predicted = class_names[occ.target] if class_names else str(occ.target)
    return f"pred {predicted} ({occ.probability:.0%})"


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()
