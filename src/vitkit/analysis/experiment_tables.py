"""An experiment's results as a table and a plot: one row per point of the experiment (`table_rows`: each metric's
mean and spread over seeds, with the model's size), the Markdown table of docs/EXPERIMENTS.md, and the figure beside
it (bars, lines over a scanned value, or one panel per depth).
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

from vitkit.files import atomic_write

from .experiments import Experiment


def _metric_names(exp: Experiment, records: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for want in exp.metrics:
        for r in records:
            for m in r["metrics"]:
                if (m.partition("@")[0] == want or m.startswith(want + "_")) and m not in names:
                    names.append(m)
    return names


def table_rows(exp: Experiment, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point of the experiment (its labels without the seed): each metric's mean, spread (sample
    standard deviation over seeds) and seed count, with the model's parameters and GFLOPs."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(json.dumps({k: v for k, v in r["labels"].items() if k != "seed"}), []).append(r)
    rows = []
    for point, members in groups.items():
        row: dict[str, Any] = {
            "labels": json.loads(point),
            "seeds": len(members),
            "model": members[0]["model"],
            "params": members[0]["params"],
            "gflops": members[0]["gflops"],
            "trainable_params": members[0].get("trainable_params"),
            "metrics": {},
        }
        for m in _metric_names(exp, members):
            values = [r["metrics"][m] for r in members if m in r["metrics"]]
            if m == "attention_distance":  # per layer: the heads of every seed together
                layers = len(values[0])
                row["metrics"][m] = [[h for v in values for h in v[i]] for i in range(layers)]
                continue
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
            row["metrics"][m] = {"mean": mean, "std": std, "n": len(values)}
        rows.append(row)
    return rows


def markdown_table(exp: Experiment, rows: list[dict[str, Any]], preset: str, seeds: int) -> str:
    """The table of docs/EXPERIMENTS.md: accuracies in percent, mean +- std over seeds."""
    label_keys = [k for k in rows[0]["labels"]] if rows else []
    metrics = [m for m in _metric_names(exp, [{"metrics": r["metrics"]} for r in rows])]
    head = [*label_keys, "architecture", "params", "GFLOPs"]
    if any(r["trainable_params"] is not None for r in rows) and exp.name == "partial-finetuning":
        head.append("trainable params")
    lines = [f"### {exp.title}", "", f"`vitkit experiment {exp.name} --preset {preset} --seeds {seeds}`", ""]
    metric_head = [
        m.replace("accuracy", "top-1 %").replace("fewshot_", "few-shot %, k=").replace("_auc", " AUC") for m in metrics
    ]
    lines.append("| " + " | ".join(head + metric_head) + " |")
    lines.append("|" + "---|" * (len(head) + len(metric_head)))
    for r in rows:
        cells = ["-" if r["labels"][k] is None else str(r["labels"][k]) for k in label_keys]  # None: not applicable
        cells += [r["model"], f"{r['params']:,}", f"{r['gflops']:.4f}"]
        if "trainable params" in head:
            cells.append(f"{r['trainable_params']:,}")
        for m in metrics:
            value = r["metrics"].get(m)
            if value is None:
                cells.append("")
            elif m == "attention_distance":
                cells.append(" / ".join(f"{sum(layer) / len(layer):.1f}" for layer in value) + " px by layer")
            else:
                cells.append(_mean_std(value, *_scale(m)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _scale(metric: str) -> tuple[float, int]:
    """How `markdown_table` and `plot` show a metric, (scale, digits): fractions in percent, areas under curves
    (`deletion_auc`, `insertion_auc`) as they are."""
    return (1, 3) if metric.endswith("_auc") else (100, 2)


def _mean_std(value: dict[str, Any], scale: float = 100, digits: int = 2) -> str:
    """A table row's metric as "mean +- std (n=seeds)", scaled (percent by default)."""
    spread = f" +- {scale * value['std']:.{digits}f}" if value["std"] is not None else ""
    return f"{scale * value['mean']:.{digits}f}{spread} (n={value['n']})"


# Metrics measured at points (`Experiment.points`): caption, and the scale and digits of their numbers.
POINT_METRICS = {
    "accuracy": ("top-1 %", 100, 2),
    "agreement": ("agreement with the unshifted image's prediction, %", 100, 2),
    "equivariance": ("equivariance: mean cosine similarity of the feature maps, on whole feature cells", 1, 3),
}


def _points(rows: list[dict[str, Any]], metric: str) -> list[str]:
    """The points at which `metric` was measured (the part of its names after "@"), in numeric order."""
    names = (m.partition("@") for r in rows for m in r["metrics"])
    return sorted({point for name, at, point in names if name == metric and at}, key=float)


def markdown_by_point(exp: Experiment, rows: list[dict[str, Any]], preset: str, seeds: int) -> str:
    """The tables of an experiment measured at points: one per metric, a row per run, a column per point ("-":
    not measured there); the first also gives the architecture and the metric without a point (whole test split)."""
    label_keys = [k for k in rows[0]["labels"]] if rows else []
    lines = [f"### {exp.title}", "", f"`vitkit experiment {exp.name} --preset {preset} --seeds {seeds}`"]
    for i, metric in enumerate(exp.metrics):
        caption, scale, digits = POINT_METRICS.get(metric, (metric, 1, 3))
        points, plain = _points(rows, metric), i == 0 and any(metric in r["metrics"] for r in rows)
        head = [*label_keys, *(["architecture", "params", "GFLOPs"] if i == 0 else [])]
        head += [*(["whole test split"] if plain else []), *points]
        lines += ["", f"**{caption}**, by {exp.points}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = ["-" if r["labels"][k] is None else str(r["labels"][k]) for k in label_keys]
            if i == 0:
                cells += [r["model"], f"{r['params']:,}", f"{r['gflops']:.4f}"]
            for m in [metric] * plain + [f"{metric}@{p}" for p in points]:
                value = r["metrics"].get(m)
                cells.append("-" if value is None else _mean_std(value, scale, digits))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_by_point(exp: Experiment, rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per metric of an experiment measured at points: a line over the points per series, error bars std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(exp.metrics), figsize=(4.2 * len(exp.metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], exp.metrics):
        caption, scale, _ = POINT_METRICS.get(metric, (metric, 1, 3))
        for i, r in enumerate(rows):
            pts = [(float(p), r["metrics"][f"{metric}@{p}"]) for p in _points([r], metric)]
            ax.errorbar(
                [x for x, _ in pts],
                [scale * v["mean"] for _, v in pts],
                yerr=[scale * (v["std"] or 0) for _, v in pts],
                marker="o",
                color=f"C{i}",
                label=str(r["labels"][exp.series]),
                capsize=3,
            )
        ax.set_xticks([float(p) for p in _points(rows, metric)])
        ax.set_xlabel(str(exp.points))
        ax.set_ylabel(textwrap.fill(caption, 40), fontsize=8)
        ax.set_title(metric)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(exp.title, int(fig.get_figwidth() * 13)), fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def plot(exp: Experiment, rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per metric: lines over the x label (or bars), one colour per series, error bars = std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _metric_names(exp, [{"metrics": r["metrics"]} for r in rows])
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(4.2 * max(len(metrics), 1), 3.4), squeeze=False)
    series = list(dict.fromkeys(str(r["labels"][exp.series]) for r in rows))
    for ax, m in zip(axes[0], metrics):
        if m == "attention_distance":
            _depth_panel(ax, exp, rows, m, series)
        elif exp.x is not None:
            _line_panel(ax, exp, rows, m, series)
        elif len(_groups(exp, rows)) > 1:
            _grouped_bars(ax, exp, rows, m, series)
        else:
            _bar_panel(ax, exp, rows, m, series)
        if m != "attention_distance":
            ylabel = m.replace("accuracy", "test top-1 (%)").replace("fewshot_", "few-shot (%), k=")
            ax.set_ylabel(ylabel.replace("_auc", " AUC"))
        ax.set_title(m.replace("_", " "))
        if exp.x is not None or m == "attention_distance":
            ax.legend(fontsize=7)
        elif len(_groups(exp, rows)) > 1 and m == metrics[-1]:  # the series' colours once, beside the last panel
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    width = int(fig.get_figwidth() * 13)  # characters of 9-point text across the figure
    fig.suptitle(textwrap.fill(exp.title, width), fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def _depth_panel(ax, exp: Experiment, rows: list[dict[str, Any]], m: str, series: list[str]) -> None:
    """Metric `m` per head (dots) against depth, one colour per series."""
    for i, s in enumerate(series):
        for r in rows:
            if str(r["labels"][exp.series]) == s:
                for depth, heads in enumerate(r["metrics"][m]):
                    ax.scatter([depth + 1] * len(heads), heads, color=f"C{i}", s=12, label=s if depth == 0 else None)
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (px)")


def _line_panel(ax, exp: Experiment, rows: list[dict[str, Any]], m: str, series: list[str]) -> None:
    """Metric `m` (%) against the x label, a line per series with std error bars."""
    for i, s in enumerate(series):
        mine = [r for r in rows if str(r["labels"][exp.series]) == s and m in r["metrics"]]
        pts = sorted((r["labels"][exp.x], r["metrics"][m]) for r in mine if r["labels"][exp.x] is not None)
        if pts:
            ax.errorbar(
                [x for x, _ in pts],
                [100 * v["mean"] for _, v in pts],
                yerr=[100 * (v["std"] or 0) for _, v in pts],
                marker="o",
                color=f"C{i}",
                label=s,
                capsize=3,
            )
        for r in mine:  # a run not placed on the x axis (e.g. the frozen model): a level across it
            if r["labels"][exp.x] is None:
                ax.axhline(100 * r["metrics"][m]["mean"], color=f"C{i}", linestyle="--", label=s)
    if exp.log_x:
        ax.set_xscale("log")
    ax.set_xlabel(exp.x)


def _bar_panel(ax, exp: Experiment, rows: list[dict[str, Any]], m: str, series: list[str]) -> None:
    """Metric `m` (%) as one bar per series, std error bars."""
    bars = [(str(r["labels"][exp.series]), r["metrics"][m]) for r in rows if m in r["metrics"]]
    ax.bar(
        [b for b, _ in bars],
        [100 * v["mean"] for _, v in bars],
        yerr=[100 * (v["std"] or 0) for _, v in bars],
        color=[f"C{series.index(b)}" for b, _ in bars],
        capsize=3,
    )


def _groups(exp: Experiment, rows: list[dict[str, Any]]) -> list[str]:
    """The rows' labels other than the series and the seed (e.g. the model an attribution method is measured on),
    each distinct set once: bars are grouped by them when there are several."""
    return list(dict.fromkeys(_group_key(exp, r) for r in rows))


def _group_key(exp: Experiment, row: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in row["labels"].items() if k not in (exp.series, "seed")})


def _grouped_bars(ax, exp: Experiment, rows: list[dict[str, Any]], metric: str, series: list[str]) -> None:
    """Bars of `metric`, a group per `_groups` value, a colour per series within it, error bars = std."""
    groups, scale, width = _groups(exp, rows), _scale(metric)[0], 0.8 / len(series)
    drawn: set[str] = set()
    for r in rows:
        if metric not in r["metrics"]:
            continue
        s, v = str(r["labels"][exp.series]), r["metrics"][metric]
        i = series.index(s)
        x = groups.index(_group_key(exp, r)) + (i - (len(series) - 1) / 2) * width
        label = None if s in drawn else s
        ax.bar(x, scale * v["mean"], width, yerr=scale * (v["std"] or 0), color=f"C{i}", label=label, capsize=2)
        drawn.add(s)
    ax.set_xticks(range(len(groups)), [", ".join(str(x) for x in json.loads(g).values()) for g in groups], fontsize=7)
