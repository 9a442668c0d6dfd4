"""Whether each group learnt its task inside the training lengths: the report's fit section.

A length-generalisation grid reads a scheme off the split longer than
training. That reading holds only for a model that has learnt the task where
it was trained: a run at validation exact match 0.3 scores badly on longer
inputs because it is under-trained, whatever its positions. So the report
says, per group, how many seeds *fitted* (validation exact match at or above
a threshold, 0.99 unless the experiment's ``fit_threshold`` says otherwise)
and names the groups whose longer-than-training numbers are therefore no
verdict on their scheme. "Validation" is the in-distribution split of every
task here (the training lengths, other examples).
"""

from __future__ import annotations

import collections
from typing import Any

from jattn.analysis.runs import is_number, unproducible_share

METRIC = "eval/validation/exact_match"
DEFAULT_THRESHOLD = 0.99


def per_group(rows, metric: str = METRIC) -> dict[str, list[float]]:
    """group -> the finished runs' values of `metric`, in grid order (groups with
    no finished run holding it are left out)."""
    out: dict[str, list[float]] = collections.OrderedDict()
    for r in rows:
        final = r["final"]
        if final and is_number(final.get(metric)):
            out.setdefault(r["run"].group, []).append(float(final[metric]))
    return out


def fitted(values: list[float], threshold: float) -> int:
    """How many of one group's seeds reached `threshold`."""
    return sum(v >= threshold for v in values)


def verdict(values: list[float], threshold: float) -> str:
    """One group's fit: "fitted (n of n)", "not fitted (0 of n)" or "partly fitted (k of n)"."""
    k, n = fitted(values, threshold), len(values)
    word = "fitted" if k == n else "not fitted" if k == 0 else "partly fitted"
    return f"{word} ({k} of {n})"


def section(rows, threshold: float = DEFAULT_THRESHOLD, metric: str = METRIC) -> list[str]:
    """The report's section "Fit inside the training lengths" (markdown lines), or []
    when no finished run has `metric`.

    Raises:
      ValueError: `threshold` outside (0, 1].
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"fit_threshold must be in (0, 1], got {threshold}")
    groups = per_group(rows, metric)
    if not groups:
        return []
    split = metric.split("/")[1]
    checks: dict[str, Any] = {}
    for r in rows:
        checks.setdefault(r["run"].group, r.get("check"))
    lines = [
        "## Fit inside the training lengths",
        "",
        f"A seed has fitted when its `{metric}` is at least {threshold:g}. A group whose "
        "seeds have not all fitted has not learnt the task where it was trained, so its "
        "numbers past the training lengths measure under-training as much as "
        "extrapolation: they are no verdict on its scheme.",
        "",
        f"| group | seeds | {split} exact match per seed | lowest | fit |",
        "|---|---:|---|---:|---|",
    ]
    short, unchecked = [], []
    for group, values in groups.items():
        share = unproducible_share(checks.get(group), split)
        if share is not None:  # a data defect, not the model's: see the data check
            lines.append(f"| {group} | {len(values)} | unproducible ({100 * share:.1f}% of "
                         "targets) | - | not checked |")  # fmt: skip
            unchecked.append(group)
            continue
        per_seed = ", ".join(f"{v:.3f}" for v in values)
        lines.append(
            f"| {group} | {len(values)} | {per_seed} | {min(values):.3f} "
            f"| {verdict(values, threshold)} |"
        )
        if (k := fitted(values, threshold)) < len(values):
            short.append(f"{group}, {k} of {len(values)} seed{'s' * (len(values) > 1)}")
    lines.append("")
    checked = len(groups) - len(unchecked)
    if short:
        lines.append(f"Groups not fitted in every seed: {'; '.join(short)}.")
    elif checked:
        lines.append(f"Every checked group fitted ({checked} of {checked}).")
    if unchecked:
        lines.append(
            f"Not checked ({split} targets unproducible from training, see the data "
            f"check): {', '.join(unchecked)}."
        )
    return [*lines, ""]
