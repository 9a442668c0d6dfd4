"""The figures of an ablation report, drawn from data `jattn.analysis.report` read.

Drawing only: each function takes plain data (curves, counts, values over
seeds) and a path, writes a PNG and returns whether there was anything to
draw, so that the reading of runs and the statistics stay testable without
matplotlib, and a figure can be redrawn from other data.

- `plot_loss_curves`: loss against step per group, seeds thin, mean thick.
- `plot_accuracy_by_length`: exact match against input length with its 95%
  Wilson band, the training lengths shaded.
- `plot_exact_match`: each group's exact match per eval split with the 95% t
  interval over seeds.
"""

from __future__ import annotations

import math

import numpy as np

from jattn.analysis import stats

__all__ = [
    "loss_curves_title",
    "plot_accuracy_by_length",
    "plot_exact_match",
    "plot_loss_curves",
]

Curve = tuple[np.ndarray, np.ndarray]  # steps [S], values [S]


def _pyplot():
    import matplotlib  # noqa: PLC0415 -- heavy, and only the report draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _save(fig, ax, path: str) -> None:
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def loss_curves_title(keys: list[str], *, validation: bool) -> str:
    """The title of loss_curves.png, from the grid's keys (bar the seed)."""
    what = "Training and validation loss" if validation else "Training loss"
    per = f" per {', '.join(keys)}" if keys else " (one group)"
    legend = "thin: seeds, thick: mean over seeds"
    if validation:
        legend += "; solid: training, dashed: validation"
    return f"{what}{per}\n({legend})"


def _marker(validation: bool, steps) -> dict:
    """A dot on every evaluation, and on a curve of one point (a line of one point
    draws nothing: a run that evaluated once would show no validation loss)."""
    return {"marker": "o", "markersize": 4} if validation or len(steps) == 1 else {}


def plot_loss_curves(
    curves: dict[str, dict[str, list[Curve]]],
    keys: list[str],
    path: str,
    metric: str = "train/loss",
    val_metric: str = "eval/validation/loss",
) -> bool:
    """Loss against step, one colour per group: seeds as thin lines, their
    mean thick; `val_metric` dashed where there are such curves, a dot on each
    evaluation.

    Args:
      curves: group -> {metric or val_metric: one (steps, values) per seed}.
      keys: the grid's keys bar the seed (for the title).
      path: the PNG to write.
    """
    if not any(g.get(metric) for g in curves.values()):
        return False
    plt = _pyplot()
    has_val = any(g.get(val_metric) for g in curves.values())
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab10")
    for gi, (group, curves_by) in enumerate(curves.items()):
        c = colours(gi % 10)
        for name, style in ((metric, "-"), (val_metric, "--")):
            seeds = curves_by.get(name) or []
            if not seeds:
                continue
            for steps, vals in seeds:
                marker = _marker(name == val_metric, steps)
                ax.plot(steps, vals, color=c, alpha=0.45, linewidth=1.0, linestyle=style, **marker)
            common = seeds[0][0]
            for steps, _ in seeds[1:]:
                common = np.intersect1d(common, steps)
            if len(common):
                mean = np.mean([np.interp(common, s, v) for s, v in seeds], axis=0)
                label = group if name == metric else f"{group} (validation)"
                marker = _marker(name == val_metric, common)
                ax.plot(
                    common, mean, color=c, linewidth=2.5, linestyle=style, label=label, **marker
                )
    ax.set_xlabel("step")
    ax.set_ylabel(f"{metric}, {val_metric} (dashed)" if has_val else metric)
    ax.set_yscale("log")
    ax.set_title(loss_curves_title(keys, validation=has_val), fontsize=10)
    ax.grid(alpha=0.3)
    _save(fig, ax, path)
    return True


def plot_accuracy_by_length(
    table: dict[str, dict[int, list[int]]],
    train: tuple[int, int] | None,
    left_out: list[str],
    path: str,
) -> bool:
    """Exact match against input length, one line per group with its 95% Wilson
    band, the training lengths shaded.

    Args:
      table: group -> {input tokens: [k correct, N decoded]} (pooled over seeds).
      train: the (shortest, longest) training input, or None (not shaded).
      left_out: the eval splits not in `table` (named in the title).
      path: the PNG to write.
    """
    if not any(table.values()):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    if train:
        label = f"input lengths in training ({train[0]}-{train[1]})"
        ax.axvspan(train[0] - 0.5, train[1] + 0.5, color="0.9", label=label)
    colours = plt.get_cmap("tab10")
    for gi, (group, by_len) in enumerate(table.items()):
        if not by_len:
            continue
        # Columns (length, exact match, Wilson low, high); a NaN row between lengths
        # that are not neighbours, so that no line is drawn across the gap.
        points: list[tuple[float, ...]] = []
        for n in sorted(by_len):
            if points and n > points[-1][0] + 1:
                points.append((n - 0.5, math.nan, math.nan, math.nan))
            k, total = by_len[n]
            points.append((n, k / total, *stats.wilson_interval(k, total)))
        lengths, acc, low, high = zip(*points, strict=True)
        c = colours(gi % 10)
        ax.fill_between(lengths, low, high, color=c, alpha=0.18, linewidth=0)
        ax.plot(lengths, acc, marker="o", markersize=3, color=c, label=group)
        # A length without neighbours has no band to show: an error bar instead.
        alone = [p for p in points if p[0] in by_len and {p[0] - 1, p[0] + 1}.isdisjoint(by_len)]
        if alone:
            xs, ys, lo, hi = (np.array(col) for col in zip(*alone, strict=True))
            ax.errorbar(xs, ys, yerr=[ys - lo, hi - ys], fmt="none", color=c, alpha=0.5)
    ax.set_xlabel("input length (tokens, incl. EOS)")
    ax.set_ylabel("exact match (band: 95% Wilson interval)")
    ax.set_ylim(-0.02, 1.02)
    title = "Exact match against input length (final step; seeds and eval splits pooled)"
    if left_out:
        title += f"\nleft out, targets not producible from training: {', '.join(left_out)}"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    _save(fig, ax, path)
    return True


def plot_exact_match(series: dict[str, dict[str, list[float] | None]], path: str) -> bool:
    """Each group's exact match per eval split: the mean over seeds with its 95%
    t interval as error bars (clipped to [0, 1]; none for one seed).

    Args:
      series: eval split -> {group: exact match per seed, None where the
        split's targets are unproducible (left out, and said in the legend)},
        every split with the same groups in the same order.
      path: the PNG to write.
    """
    if not any(v for by_group in series.values() for v in by_group.values()):
        return False
    plt = _pyplot()
    names = list(next(iter(series.values())))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.5))
    colours = plt.get_cmap("tab10")
    for si, (split, by_group) in enumerate(series.items()):
        xs, means, errs, hidden = [], [], [[], []], []
        for gi, name in enumerate(names):
            values = by_group.get(name, [])
            if values is None:
                hidden.append(name)
                continue
            if not values:
                continue
            mean, low, high = stats.t_interval(values)
            low, high = (mean, mean) if math.isnan(low) else (max(low, 0.0), min(high, 1.0))
            xs.append(gi + (si - (len(series) - 1) / 2) * 0.25)
            means.append(mean)
            errs[0].append(mean - low)
            errs[1].append(high - mean)
        label = split + (f" (unproducible, not shown: {', '.join(hidden)})" if hidden else "")
        ax.errorbar(xs, means, yerr=errs, fmt="o", capsize=4, color=colours(si % 10), label=label)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Exact match at the final step: mean over seeds, 95% t interval", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    _save(fig, ax, path)
    return True
