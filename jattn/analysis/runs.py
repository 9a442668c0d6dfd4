"""Reading an ablation's runs back from their workdirs, for the report.

Every number of `jattn.analysis.report` comes from here: a run's
``final_metrics.json`` (only if it reached ``num_train_steps``: the final
step's evaluation, no checkpoint selected), its exact match as k of N
decoded, its ``data_check.json`` (`jattn.data.producibility`), its
``metrics.jsonl`` curves and its final decodes by input length. Nothing here
formats or draws.
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any

import numpy as np

from jattn.analysis import grid as grid_lib
from jattn.train import workdir as workdir_lib
from jattn.train.evaluation import TF_SEQUENCE

__all__ = [
    "TF_SEQUENCE",
    "accuracy_by_length",
    "collect",
    "data_check",
    "exact_match_counts",
    "exact_match_split",
    "is_number",
    "loss_curves",
    "reported_metrics",
    "tf_sequence_counts",
    "unproducible_share",
]

DATA_CHECK = workdir_lib.DATA_CHECK


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): a value the report can average."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def exact_match_split(metric: str) -> str | None:
    """``"eval/test_longer/exact_match"`` -> ``"test_longer"``; None for other metrics."""
    parts = metric.split("/")
    if len(parts) == 3 and parts[0] == "eval" and parts[2] == "exact_match":
        return parts[1]
    return None


def exact_match_counts(workdir: str, final: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per eval split, the final exact match as (k correct, N decoded).

    N is ``eval/<split>/num_decoded``; a run from before that metric falls
    back to its ``decodes/<split>.jsonl`` when that is the final step's.
    """
    counts = {}
    for key, em in final.items():
        split = exact_match_split(key)
        if split is None or not is_number(em):
            continue
        n = final.get(f"eval/{split}/num_decoded")
        if is_number(n) and n > 0:
            counts[split] = (round(em * n), int(n))
            continue
        decoded = workdir_lib.read_jsonl(workdir_lib.decodes_path(workdir, split))
        if decoded and all(e.get("step") == final.get("step") for e in decoded):
            counts[split] = (sum(bool(e["correct"]) for e in decoded), len(decoded))
    return counts


def tf_sequence_counts(final: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per eval split, the final teacher-forced sequence accuracy as (k right, N
    evaluated), from ``eval/<split>/tf_sequence_accuracy`` and ``.../num_evaluated``."""
    counts = {}
    for key, value in final.items():
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != "eval" or parts[2] != TF_SEQUENCE:
            continue
        n = final.get(f"eval/{parts[1]}/num_evaluated")
        if is_number(value) and is_number(n) and n > 0:
            counts[parts[1]] = (round(value * n), int(n))
    return counts


def data_check(workdir: str, final: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's data check: its ``data_check.json`` (``{split: {"examples",
    "producible", "longer_than_train"}, "train": {...}}``), else its final
    metrics ``data/<split>/<name>``; None for a run that has neither."""
    check = workdir_lib.read_json(os.path.join(workdir, workdir_lib.DATA_CHECK))
    if check is not None:
        return check
    out: dict[str, Any] = {}
    for key, v in (final or {}).items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "data" and is_number(v):
            out.setdefault(parts[1], {})[parts[2]] = float(v)
    return out or None


def unproducible_share(check: dict[str, Any] | None, split: str) -> float | None:
    """The share of `split`'s targets that cannot be produced from what training
    shows, when it is above 0; None when all can be (or the run was not checked)."""
    producible = ((check or {}).get(split) or {}).get("producible")
    if is_number(producible) and producible < 1.0:
        return 1.0 - float(producible)
    return None


def collect(runs: list[grid_lib.Run], configs, exp) -> list[dict[str, Any]]:
    """Per run: run, config, typed axes, final metrics (None unless the run
    reached ``num_train_steps``), exact-match counts, teacher-forced sequence
    counts (``tf_counts``) and data check."""
    out = []
    for run, config in zip(runs, configs, strict=True):
        final = workdir_lib.finished_metrics(run.workdir, config.num_train_steps)
        out.append(
            dict(
                run=run,
                config=config,
                axes=grid_lib.typed_axes(run, config, exp),
                final=final,
                counts=exact_match_counts(run.workdir, final) if final else {},
                tf_counts=tf_sequence_counts(final) if final else {},
                check=data_check(run.workdir, final),
            )
        )
    return out


def _curve(workdir: str, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
    pts = [
        (m["step"], m[metric])
        for m in workdir_lib.read_jsonl(os.path.join(workdir, workdir_lib.METRICS))
        if metric in m and isinstance(m[metric], int | float)
    ]
    if not pts:
        return None
    steps, vals = zip(*sorted(dict(pts).items()), strict=True)
    return np.array(steps), np.array(vals, np.float64)


def loss_curves(
    rows, metric: str = "train/loss", val_metric: str = "eval/validation/loss"
) -> dict[str, dict[str, list[tuple[np.ndarray, np.ndarray]]]]:
    """group -> {metric, val_metric: one (steps, values) per run that logged it},
    from the runs' metrics.jsonl (`plots.plot_loss_curves` draws it)."""
    by_group: dict[str, dict[str, list]] = collections.OrderedDict()
    for r in rows:
        for name in (metric, val_metric):
            curve = _curve(r["run"].workdir, name) if name else None
            if curve is not None:
                g = by_group.setdefault(r["run"].group, {metric: [], val_metric: []})
                g[name].append(curve)
    return by_group


def reported_metrics(rows, metrics: list[str]) -> list[str]:
    """The experiment's `metrics` that some finished run has (a character-level
    task has no BLEU, for instance); all of them while no run has finished."""
    finals = [r["final"] for r in rows if r["final"]]
    if not finals:
        return list(metrics)
    return [m for m in metrics if any(m in f for f in finals)]


def accuracy_by_length(rows):
    """Exact match by input length, pooled over seeds and eval splits.

    Only finished runs, only their final step's decodes, and no split with
    unproducible targets (its zeros would read as a length effect).

    Returns:
      (group -> {input_tokens: [k correct, N decoded]}, the training input
      lengths as (shortest, longest) or None, the splits left out).
    """
    table: dict[str, dict[int, list[int]]] = collections.OrderedDict()
    validation_lengths: set[int] = set()
    train_longest, left_out = None, set()
    for r in rows:
        g = table.setdefault(r["run"].group, collections.defaultdict(lambda: [0, 0]))
        check = r.get("check") or {}
        if is_number((check.get("train") or {}).get("max_input_tokens")):
            train_longest = int(check["train"]["max_input_tokens"])
        if not r["final"]:
            continue
        folder = os.path.join(r["run"].workdir, workdir_lib.DECODES)
        names = os.listdir(folder) if os.path.isdir(folder) else []
        for split in sorted(f.removesuffix(".jsonl") for f in names if f.endswith(".jsonl")):
            if unproducible_share(check, split) is not None:
                left_out.add(split)
                continue
            for e in workdir_lib.read_jsonl(workdir_lib.decodes_path(r["run"].workdir, split)):
                if e.get("step") != r["final"].get("step"):
                    continue
                n = int(e["input_tokens"])
                g[n][0] += bool(e["correct"])
                g[n][1] += 1
                if split == "validation":
                    validation_lengths.add(n)
    if train_longest is not None:
        train = (1, train_longest)
    else:
        train = (min(validation_lengths), max(validation_lengths)) if validation_lengths else None
    return table, train, sorted(left_out)
