"""Aggregate an ablation into results.csv, results.md and PNG plots.

Everything is read back from the runs' workdirs (``final_metrics.json``,
``metrics.jsonl``, ``decodes/<split>.jsonl``), so the report can be rebuilt at
any time, also for a grid that a cluster ran (``jattn ablate --report-only``).

- ``results.csv``: one row per run: axes, status, every final metric.
- ``results.md``: one row per group (the runs that differ only by seed):
  mean ± std over seeds of the experiment's metrics that the runs have (a
  character-level task reports no BLEU), and the seed count.
- ``loss_curves.png``: training loss against step, one colour per group
  (thin lines: seeds; thick: their mean), validation loss dashed where the
  runs logged it; titled with the grid's keys.
- ``accuracy_by_length.png``: exact match against input length per group,
  pooled over seeds and eval splits, with the training lengths shaded.
"""

from __future__ import annotations

import collections
import csv
import json
import math
import os
from typing import Any

import numpy as np

from jattn.analysis import grid as grid_lib


def _load_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn last line
    return rows


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def _fmt_ms(values: list[float]) -> str:
    if not values:
        return "-"
    m, s = mean_std(values)
    if all(float(v).is_integer() for v in values) and abs(m) >= 1000:
        return f"{m:,.0f}" if s == 0 else f"{m:,.0f} ± {s:,.0f}"
    return f"{m:.3f} ± {s:.3f}" if abs(m) < 10 else f"{m:.1f} ± {s:.1f}"


def collect(runs: list[grid_lib.Run], configs, exp) -> list[dict[str, Any]]:
    """Per run: name, group, typed axes, final metrics (or None)."""
    from jattn.train.loop import FINAL_METRICS  # noqa: PLC0415

    out = []
    for run, config in zip(runs, configs, strict=True):
        final = _load_json(os.path.join(run.workdir, FINAL_METRICS))
        if final is not None and final.get("step") != config.num_train_steps:
            final = None
        out.append(
            dict(run=run, config=config, axes=grid_lib.typed_axes(run, config, exp), final=final)
        )
    return out


def write_csv(rows, path: str, status: dict[str, str] | None) -> None:
    metric_keys = sorted(
        {
            k
            for r in rows
            if r["final"]
            for k, v in r["final"].items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
    )
    axis_keys = list(rows[0]["axes"]) if rows else []
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "group", *axis_keys, "status", *metric_keys])
        for r in rows:
            st = (status or {}).get(r["run"].name) or ("finished" if r["final"] else "missing")
            w.writerow(
                [
                    r["run"].name,
                    r["run"].group,
                    *[r["axes"][a] for a in axis_keys],
                    st,
                    *[(r["final"] or {}).get(k, "") for k in metric_keys],
                ]
            )


def group_table(rows, metrics: list[str]) -> tuple[str, dict[str, dict[str, list[float]]]]:
    groups: dict[str, dict[str, list[float]]] = collections.OrderedDict()
    counts: dict[str, int] = collections.Counter()
    for r in rows:
        g = groups.setdefault(r["run"].group, collections.defaultdict(list))
        if not r["final"]:
            continue
        counts[r["run"].group] += 1
        for m in metrics:
            v = r["final"].get(m)
            if isinstance(v, int | float) and math.isfinite(v):
                g[m].append(float(v))
    head = "| group | seeds | " + " | ".join(metrics) + " |"
    sep = "|---|---:|" + "---:|" * len(metrics)
    lines = [head, sep]
    for name, g in groups.items():
        cells = [_fmt_ms(g.get(m, [])) for m in metrics]
        lines.append(f"| {name} | {counts[name]} | " + " | ".join(cells) + " |")
    return "\n".join(lines), groups


def group_keys(rows) -> list[str]:
    """The grid axes that tell groups apart (every axis but the seed)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r["run"].axes if k != "seed" and k not in keys]
    return keys


def loss_curves_title(keys: list[str], *, validation: bool) -> str:
    """The title of loss_curves.png, from the grid's keys (bar the seed)."""
    what = "Training and validation loss" if validation else "Training loss"
    per = f" per {', '.join(keys)}" if keys else " (one group)"
    legend = "thin: seeds, thick: mean over seeds"
    if validation:
        legend += "; solid: training, dashed: validation"
    return f"{what}{per}\n({legend})"


def _curve(workdir: str, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
    pts = [
        (m["step"], m[metric])
        for m in _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        if metric in m and isinstance(m[metric], int | float)
    ]
    if not pts:
        return None
    steps, vals = zip(*sorted(dict(pts).items()), strict=True)
    return np.array(steps), np.array(vals, np.float64)


def plot_loss_curves(
    rows, path: str, metric: str = "train/loss", val_metric: str = "eval/validation/loss"
) -> bool:
    """Loss against step, one colour per group: seeds as thin lines, their
    mean thick; `val_metric` dashed where the runs' metrics.jsonl has it."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    by_group: dict[str, dict[str, list]] = collections.OrderedDict()
    for r in rows:
        for name in (metric, val_metric):
            curve = _curve(r["run"].workdir, name) if name else None
            if curve is not None:
                g = by_group.setdefault(r["run"].group, {metric: [], val_metric: []})
                g[name].append(curve)
    if not any(g[metric] for g in by_group.values()):
        return False
    has_val = any(g[val_metric] for g in by_group.values())
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab10")
    for gi, (group, curves_by) in enumerate(by_group.items()):
        c = colours(gi % 10)
        for name, style in ((metric, "-"), (val_metric, "--")):
            curves = curves_by[name]
            if not curves:
                continue
            for steps, vals in curves:
                ax.plot(steps, vals, color=c, alpha=0.45, linewidth=1.0, linestyle=style)
            common = curves[0][0]
            for steps, _ in curves[1:]:
                common = np.intersect1d(common, steps)
            if len(common):
                mean = np.mean([np.interp(common, s, v) for s, v in curves], axis=0)
                label = group if name == metric else f"{group} (validation)"
                ax.plot(common, mean, color=c, linewidth=2.5, linestyle=style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{metric}, {val_metric} (dashed)" if has_val else metric)
    ax.set_yscale("log")
    ax.set_title(loss_curves_title(group_keys(rows), validation=has_val), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def reported_metrics(rows, metrics: list[str]) -> list[str]:
    """The experiment's `metrics` that some finished run has (a character-level
    task has no BLEU, for instance); all of them while no run has finished."""
    finals = [r["final"] for r in rows if r["final"]]
    if not finals:
        return list(metrics)
    return [m for m in metrics if any(m in f for f in finals)]


def accuracy_by_length(rows, splits=("validation", "test_longer")):
    """group -> {input_tokens: [correct, ...]} pooled over seeds and splits,
    plus the input lengths seen in the validation split (= training lengths)."""
    table: dict[str, dict[int, list[bool]]] = collections.OrderedDict()
    train_lengths: set[int] = set()
    for r in rows:
        g = table.setdefault(r["run"].group, collections.defaultdict(list))
        for split in splits:
            for e in _read_jsonl(os.path.join(r["run"].workdir, "decodes", f"{split}.jsonl")):
                g[int(e["input_tokens"])].append(bool(e["correct"]))
                if split == "validation":
                    train_lengths.add(int(e["input_tokens"]))
    return table, train_lengths


def plot_accuracy_by_length(rows, path: str) -> bool:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    table, train_lengths = accuracy_by_length(rows)
    if not any(table.values()):
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    if train_lengths:
        ax.axvspan(
            min(train_lengths) - 0.5,
            max(train_lengths) + 0.5,
            color="0.9",
            label="lengths seen in training",
        )
    colours = plt.get_cmap("tab10")
    for gi, (group, by_len) in enumerate(table.items()):
        if not by_len:
            continue
        lengths = sorted(by_len)
        acc = [float(np.mean(by_len[n])) for n in lengths]
        ax.plot(lengths, acc, marker="o", color=colours(gi % 10), label=group)
    ax.set_xlabel("input length (tokens, incl. EOS)")
    ax.set_ylabel("exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Exact match against input length (validation + test_longer, seeds pooled)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(exp, runs, configs, workdir: str, *, status) -> dict[str, Any]:
    """Writes results.csv, results.md and the plots; returns a summary dict
    with the markdown table and the paths written."""
    rows = collect(runs, configs, exp)
    metrics = reported_metrics(rows, list(exp.metrics))
    absent = [m for m in exp.metrics if m not in metrics]
    write_csv(rows, os.path.join(workdir, "results.csv"), status)
    table, groups = group_table(rows, metrics)
    finished = sum(1 for r in rows if r["final"])
    md = [
        f"# Ablation results ({finished}/{len(rows)} runs finished)",
        "",
        f"Mean ± std over seeds; grid {', '.join(exp.grid.keys())}; base `{exp.base}`.",
        "",
        table,
        "",
    ]
    if absent:
        md += [f"Not reported by these runs (not a metric of their task): {', '.join(absent)}.", ""]
    plots = []
    if plot_loss_curves(rows, os.path.join(workdir, "loss_curves.png")):
        plots.append("loss_curves.png")
        md.append("![loss curves](loss_curves.png)")
    if plot_accuracy_by_length(rows, os.path.join(workdir, "accuracy_by_length.png")):
        plots.append("accuracy_by_length.png")
        md.append("![accuracy by length](accuracy_by_length.png)")
    markdown = "\n".join(md) + "\n"
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(markdown)
    return dict(markdown=markdown, plots=plots, groups=groups, finished=finished, total=len(rows))
