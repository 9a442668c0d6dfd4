"""An ablation's report: its runs aggregated into results.csv, results.md and PNG plots.

Everything is read back from the runs' workdirs (``final_metrics.json``,
``metrics.jsonl``, ``decodes/<split>.jsonl``, ``data_check.json``), so
``jattn ablate --report-only`` rebuilds it. Every number is a run's
evaluation at its final step (``num_train_steps``; `collect` drops any
other): no checkpoint is selected, so no test split chooses what is reported.

- ``results.csv``: one row per run: axes, status, every final metric.
- ``results.md``:
  - the data check, per eval split: the share of targets that can be
    produced from what training shows, and the share longer than training;
  - one row per group (the runs that differ only by seed): the mean and 95%
    Student t interval over seeds of the experiment's metrics that the runs
    have (a character-level task reports no BLEU), the seed count, and
    whether the group differs from a reference group beyond noise
    (`jattn.analysis.stats.compare`, its p adjusted for the number of
    comparisons by Holm's method; "differs" only after the adjustment): the
    experiment's ``reference``, taken on the group's own task (an axis over
    ``dataset``) and on the axes ``reference_within`` names
    (`jattn.analysis.references`). The exact match of a split whose
    targets cannot all be produced reads "unproducible", never a 0;
  - "Comparisons with the reference" (`jattn.analysis.comparisons`): each
    comparison's test, raw and Holm p, a seed-and-example bootstrap p
    beside, the difference its seeds could detect at 80% power, both sides'
    fit per seed, and the machine that wrote the report;
  - whether each group fitted inside the training lengths (`jattn.analysis.fit`:
    validation exact match ≥ ``fit_threshold``, 0.99, in every seed);
  - one row per run and eval split: exact match as k of N decoded, 95%
    Wilson interval (0/N shows its upper bound).
- ``loss_curves.png``: training loss against step, one colour per group
  (thin lines: seeds; thick: their mean), validation loss dashed where the
  runs logged it; titled with the grid's keys.
- ``accuracy_by_length.png``: exact match against input length per group,
  pooled over seeds and eval splits, with its Wilson interval as a band and
  the training lengths shaded.
- ``exact_match.png``: each group's exact match per eval split, the mean
  over seeds with its 95% t interval.
- ``results.md`` also has "As the anchors report" (`jattn.analysis.anchors`):
  the best seed, teacher-forced accuracy beyond the training lengths, and
  exact match by ``length_bucket`` (default 5 lengths).
- ``results.md`` ends with ``report_appendix.md`` from the grid's directory,
  verbatim, where there is one (`appendix`): sections a lab keeps about its
  grids that are not the library's to compute (this repository's
  ``lab/grid.py`` writes each grid's sessions, wall time and machine load
  there), kept through every rebuild of the report.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import math
import os
from typing import Any

from jattn.analysis import anchors, fit, plots, reevaluation, stats
from jattn.analysis import comparisons as comparisons_lib
from jattn.analysis.data_check_table import data_check_section, fmt_share
from jattn.analysis.references import (  # noqa: F401 -- the runner and tests call them here
    check_reference,
    choose_reference,
    match_group,
    reference_of,
    reference_within,
)
from jattn.analysis.runs import (  # noqa: F401 -- collect & co. stay report's API
    DATA_CHECK,
    TF_SEQUENCE,
    accuracy_by_length,
    collect,
    exact_match_split,
    is_number,
    loss_curves,
    reported_metrics,
    unproducible_share,
)


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


# -- numbers as text -----------------------------------------------------------------------


def _range(metric: str) -> tuple[float, float]:
    """Where a metric can lie: intervals are clipped to it."""
    name = metric.rsplit("/", 1)[-1]
    if name in ("exact_match", "accuracy", "length_match", TF_SEQUENCE):
        return 0.0, 1.0
    if name in ("chrf", "bleu"):
        return 0.0, 100.0
    if name in ("loss", "steps_per_sec", "num_params"):  # non-negative
        return 0.0, math.inf
    return -math.inf, math.inf


def _num(x: float, scale: float) -> str:
    if abs(scale) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(scale) >= 10 else f"{x:.3f}"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def fmt_mean_ci(values: list[float], metric: str) -> str:
    """``0.953 [0.910, 0.990]``: the mean over seeds and its 95% Student t
    interval, clipped to the metric's range; ``(1 seed)`` instead of an
    interval for one seed; a count that is the same on every seed
    (``num_params``) alone."""
    if not values:
        return "-"
    mean, low, high = stats.t_interval(values)
    if len(set(values)) == 1 and float(values[0]).is_integer() and abs(mean) >= 1000:
        return _num(mean, mean)
    if len(values) < 2:
        return f"{_num(mean, mean)} (1 seed)"
    lo, hi = _range(metric)
    return f"{_num(mean, mean)} [{_num(max(low, lo), mean)}, {_num(min(high, hi), mean)}]"


def fmt_wilson(k: int, n: int) -> str:
    """The 95% Wilson interval of k/n: ``≤ 0.37%`` at 0/n, ``≥ 99.63%`` at n/n."""
    low, high = stats.wilson_interval(k, n)
    if k == 0:
        return f"≤ {_pct(high)}"
    if k == n:
        return f"≥ {_pct(low)}"
    return f"[{_pct(low)}, {_pct(high)}]"


def _unproducible(share: float) -> str:
    return f"unproducible ({fmt_share(share)} of targets)"


# -- groups and their tables -------------------------------------------------------------


@dataclasses.dataclass
class Group:
    """The finished runs of one group (they differ only by seed).

    Attributes:
      name: the group name (``position=shaw``).
      seeds: how many of its runs finished.
      values: metric -> one value per finished seed that has it.
      counts: eval split -> exact match (k, N) per finished seed that has it.
      check: the data check of its first run that has one (None: not checked).
    """

    name: str
    seeds: int = 0
    values: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    counts: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    check: dict[str, Any] | None = None

    def pooled(self, split: str) -> tuple[int, int] | None:
        """Exact match of `split` as (k, N) summed over all its seeds; None when
        a seed lacks the counts."""
        per_seed = self.counts.get(split, [])
        if not per_seed or len(per_seed) != self.seeds:
            return None
        return sum(k for k, _ in per_seed), sum(n for _, n in per_seed)

    def unproducible(self, metric: str) -> float | None:
        """For an exact-match metric of a split with unproducible targets, their share."""
        split = exact_match_split(metric)
        return unproducible_share(self.check, split) if split else None


def groups_of(rows, metrics: list[str]) -> dict[str, Group]:
    """The rows folded into groups, in grid order."""
    groups: dict[str, Group] = collections.OrderedDict()
    for r in rows:
        g = groups.setdefault(r["run"].group, Group(r["run"].group))
        if g.check is None:
            g.check = r.get("check")
        if not r["final"]:
            continue
        g.seeds += 1
        for m in metrics:
            if is_number(r["final"].get(m)):
                g.values.setdefault(m, []).append(float(r["final"][m]))
        for split, kn in r.get("counts", {}).items():
            g.counts.setdefault(split, []).append(kn)
    return groups


def comparison(ref: Group, g: Group, metric: str) -> stats.Comparison | str:
    """`g` against the reference group on `metric` (see `stats.compare`), or the
    cell's text where no test applies (the reference itself, unproducible)."""
    if g.name == ref.name:
        return "reference"
    share = g.unproducible(metric)
    if share is not None:
        return _unproducible(share)
    if ref.unproducible(metric) is not None:
        return "- (the reference is unproducible)"
    if not g.values.get(metric) or not ref.values.get(metric):
        return "-"
    split = exact_match_split(metric)
    counts = (ref.pooled(split), g.pooled(split)) if split else (None, None)
    return stats.compare(ref.values[metric], g.values[metric], *counts)


def comparisons(
    groups: dict[str, Group], metric: str, reference: str, within: tuple[str, ...] = ()
) -> dict[str, tuple[str | None, stats.Comparison | str, float | None]]:
    """Every group against its reference (`reference_of`) on `metric`:
    group -> (its reference group or None, the comparison or the cell's text,
    its Holm-adjusted p among all the tested comparisons of the grid or None).
    """
    found: dict[str, tuple[str | None, stats.Comparison | str]] = {}
    for g in groups.values():
        ref = reference_of(g.name, reference, within, groups)
        if ref is None:
            found[g.name] = (None, f"- (no reference group with its {', '.join(within)})")
        else:
            found[g.name] = (ref, comparison(groups[ref], g, metric))
    tested = [
        n for n, (_, c) in found.items() if isinstance(c, stats.Comparison) and c.p is not None
    ]
    adjusted = dict(zip(tested, stats.holm([found[n][1].p for n in tested]), strict=True))
    return {n: (ref, c, adjusted.get(n)) for n, (ref, c) in found.items()}


def comparison_cell(c: stats.Comparison | str, adjusted: float | None) -> str:
    """The last column's text: "differs" or "within noise" after Holm's adjustment."""
    return c if isinstance(c, str) else c.verdict(adjusted=adjusted)


def group_table(
    groups: dict[str, Group],
    metrics: list[str],
    reference: str | None,
    within: tuple[str, ...] = (),
) -> tuple[str, list[str]]:
    """The markdown table of groups and the lines that explain it.

    With `within` (axis names), each group is compared with the reference
    group that shares its values on those axes (`reference_of`). The
    comparisons' p-values are adjusted for their number (`stats.holm`), and a
    cell says "differs" only where the adjusted p is below alpha.

    Returns:
      (table, notes): the notes say what the cells are, the comparison rule
      and which cells are unproducible.
    """
    compare_on = metrics[0] if metrics and reference else None
    head = "| group | seeds | " + " | ".join(metrics)
    sep = "|---|---:|" + "---:|" * len(metrics)
    found = comparisons(groups, compare_on, reference, within) if compare_on else {}
    if compare_on:
        same = f", same {', '.join(within)}" if within else ""
        head += f" | vs {reference}{same} ({compare_on})"
        sep += "---|"
    lines, unproducible = [head + " |", sep], {}
    for g in groups.values():
        cells = []
        for m in metrics:
            share = g.unproducible(m)
            if share is not None and g.values.get(m):
                unproducible[exact_match_split(m)] = share
                cells.append(_unproducible(share))
            else:
                cells.append(fmt_mean_ci(g.values.get(m, []), m))
        if compare_on:
            _, c, adjusted = found[g.name]
            cells.append(comparison_cell(c, adjusted))
        lines.append(f"| {g.name} | {g.seeds} | " + " | ".join(cells) + " |")
    notes = [
        "Cells: mean over seeds [95% Student t interval, n − 1 degrees of freedom, clipped "
        "to the metric's range]; one seed has no interval."
    ]
    if compare_on:
        tested = sum(adjusted is not None for _, _, adjusted in found.values())
        notes.append(
            f"Last column: {compare_on} against {reference}"
            + (f" with the group's own {', '.join(within)}" if within else "")
            + ", Welch's t-test over seeds; where both groups have zero variance over seeds, "
            "a pooled two-proportion z-test on the exact-match counts k/N summed over seeds "
            f"(marked 'counts'). Its raw p and its p adjusted by Holm's method for the {tested} "
            f'comparisons made; "differs" only where the adjusted p is below {stats.ALPHA}.'
        )
    for split, share in unproducible.items():
        notes.append(
            f"{split}: {fmt_share(share)} of its targets cannot be produced from what training "
            "shows (see the data check), so its exact match is not a length-generalisation "
            "score and is not shown as a number."
        )
    return "\n".join(lines), notes


def _kn_cells(kn: tuple[int, int] | None, share: float | None, value: Any) -> list[str]:
    """A k/N cell and its Wilson interval's (unproducible, or N unknown, said so)."""
    if share is not None:
        return [_unproducible(share), "-"]
    if kn is None:
        return [f"{value:.3f} (N unknown)" if is_number(value) else "-", "-"]
    k, n = kn
    return [f"{k}/{n} ({_pct(k / n)})", fmt_wilson(k, n)]


def run_table(rows) -> str:
    """Per finished run and eval split: exact match as k/N and its Wilson interval,
    and where the runs have it the teacher-forced sequence accuracy the same way."""
    forced = any(r.get("tf_counts") for r in rows if r["final"])
    lines = [
        "| run | split | exact match k/N | 95% Wilson interval |"
        + (" teacher-forced sequence k/N | 95% Wilson interval |" if forced else ""),
        "|---|---|---:|---:|" + ("---:|---:|" if forced else ""),
    ]
    for r in rows:
        if not r["final"]:
            continue
        splits = [s for k in r["final"] if (s := exact_match_split(k)) and is_number(r["final"][k])]
        for split in splits:
            share = unproducible_share(r.get("check"), split)
            value = r["final"][f"eval/{split}/exact_match"]
            cells = _kn_cells(r.get("counts", {}).get(split), share, value)
            if forced:
                value = r["final"].get(f"eval/{split}/{TF_SEQUENCE}")
                cells += _kn_cells(r.get("tf_counts", {}).get(split), share, value)
            lines.append(f"| {r['run'].name} | {split} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def group_keys(rows) -> list[str]:
    """The grid axes that tell groups apart (every axis but the seed)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r["run"].axes if k != "seed" and k not in keys]
    return keys


def exact_match_series(
    groups: dict[str, Group], metrics: list[str]
) -> dict[str, dict[str, list[float] | None]]:
    """eval split -> {group: exact match per seed, None where unproducible} for the
    exact-match metrics among `metrics` (`plots.plot_exact_match` draws it)."""
    return {
        split: {n: None if g.unproducible(m) else g.values.get(m, []) for n, g in groups.items()}
        for m in metrics
        if (split := exact_match_split(m))
    }


APPENDIX_FILE = "report_appendix.md"


def appendix(workdir: str) -> list[str]:
    """The lines of ``workdir``'s `APPENDIX_FILE`, for the end of ``results.md``
    (before the figures); [] without one."""
    path = os.path.join(workdir, APPENDIX_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read().strip("\n")
    return [*text.split("\n"), ""] if text else []


def write_report(exp, runs, configs, workdir: str, *, status) -> dict[str, Any]:
    """Writes results.csv, results.md and the plots; returns a summary dict
    with the markdown, the paths written and the groups."""
    rows = collect(runs, configs, exp)
    metrics = reported_metrics(rows, list(exp.metrics))
    absent = [m for m in exp.metrics if m not in metrics]
    write_csv(rows, os.path.join(workdir, "results.csv"), status)
    groups = groups_of(rows, metrics)
    first = metrics[0] if metrics else ""
    reference, why = choose_reference(groups, first, exp.get("reference") or None)
    table, notes = group_table(groups, metrics, reference, reference_within(exp))
    finished = [r for r in rows if r["final"]]
    steps = sorted({r["final"]["step"] for r in finished})
    eval_splits = list(dict.fromkeys(m.split("/")[1] for m in metrics if m.startswith("eval/")))
    md = [
        f"# Ablation results ({len(finished)}/{len(rows)} runs finished)",
        "",
        f"Grid {', '.join(exp.grid.keys())}; base `{exp.base}`. Every metric is each run's "
        f"evaluation at its final step (num_train_steps = {', '.join(map(str, steps)) or '-'}), "
        "with no checkpoint selection.",
        "",
        "## Data check",
        "",
        *data_check_section(rows, eval_splits),
        "",
        "## Groups",
        "",
        table,
        "",
        *[f"{n}  " for n in notes],
    ]
    if reference:
        md.append(f"Reference: {reference} ({why}).")
    elif metrics:
        md.append(f"No comparison column: {why}.")
    md.append("")
    if absent:
        md += [f"Not reported by these runs (not a metric of their task): {', '.join(absent)}.", ""]
    threshold = exp.get("fit_threshold", fit.DEFAULT_THRESHOLD)
    if reference:
        found = comparisons(groups, first, reference, reference_within(exp))
        md += comparisons_lib.section(groups, first, found, threshold, comparisons_lib.machine())
    md += fit.section(rows, threshold)
    runs_md = run_table(rows)
    if runs_md:
        md += ["## Exact match per run", "", runs_md, "",
               "k of N decoded examples correct; 95% Wilson score interval (an upper bound "
               "at 0/N, a lower bound at N/N). Teacher-forced sequence (where the runs have "
               "it): k of N evaluated examples whose every target token is the argmax under "
               "the gold prefix.", ""]  # fmt: skip
    md += anchors.section(rows, width=exp.get("length_bucket", anchors.DEFAULT_WIDTH))
    md += reevaluation.section(workdir)
    md += appendix(workdir)
    figures = {
        "loss_curves.png": plots.plot_loss_curves(
            loss_curves(rows), group_keys(rows), os.path.join(workdir, "loss_curves.png")
        ),
        "accuracy_by_length.png": plots.plot_accuracy_by_length(
            *accuracy_by_length(rows), os.path.join(workdir, "accuracy_by_length.png")
        ),
        "exact_match.png": plots.plot_exact_match(
            exact_match_series(groups, metrics), os.path.join(workdir, "exact_match.png")
        ),
    }
    written = [name for name, drawn in figures.items() if drawn]
    md += [f"![{name.removesuffix('.png').replace('_', ' ')}]({name})" for name in written]
    markdown = "\n".join(md) + "\n"
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(markdown)
    return dict(
        markdown=markdown,
        plots=written,
        groups=groups,
        reference=reference,
        finished=len(finished),
        total=len(rows),
    )
