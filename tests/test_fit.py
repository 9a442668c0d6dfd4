"""Fit inside the training lengths: the report's section that says which groups
learnt their task where they were trained (`jattn.analysis.fit`).

Contracts, on hand-written runs: a seed fits at validation exact match >= the
threshold (at the threshold itself too, 1013/1024 below 0.99 not); a group is
"fitted", "partly fitted" or "not fitted" by its count of fitted seeds, in
that row the seeds' values in grid order and their minimum; the closing line
names exactly the groups short of every seed; an unproducible validation
split is a data defect, reported as such and not held against the model; a
grid with no validation exact match gets no section; the threshold is the
experiment's and must be a share.
"""

from __future__ import annotations

import pytest

from jattn.analysis import fit, grid

VAL = fit.METRIC


def _rows(values: dict[str, list[float | None]], check=None):
    """Rows as `jattn.analysis.runs.collect` returns them: one per (group, seed); a
    None value is a run that has not finished."""
    rows = []
    for group, per_seed in values.items():
        for seed, v in enumerate(per_seed):
            name = f"{group},seed={seed}"
            axes = dict(kv.split("=") for kv in name.split(","))
            run = grid.Run(name, axes, (), f"/nonexistent/{name}")
            final = None if v is None else {"step": 10, VAL: v}
            rows.append({"run": run, "final": final, "check": check})
    return rows


def test_groups_fitted_partly_and_not_with_their_seeds_and_lowest():
    rows = _rows(
        {
            "position=t5": [1.0, 0.99, 1023 / 1024],
            "position=alibi": [1.0, 1013 / 1024, 0.5],
            "position=none": [0.004, 0.005],
        }
    )
    lines = fit.section(rows)
    assert lines[0] == "## Fit inside the training lengths"
    assert "| position=t5 | 3 | 1.000, 0.990, 0.999 | 0.990 | fitted (3 of 3) |" in lines
    # 1013/1024 = 0.98926 is below 0.99: one seed of three fitted.
    assert "| position=alibi | 3 | 1.000, 0.989, 0.500 | 0.500 | partly fitted (1 of 3) |" in lines
    assert "| position=none | 2 | 0.004, 0.005 | 0.004 | not fitted (0 of 2) |" in lines
    closing = [line for line in lines if line.startswith("Groups not fitted")]
    assert closing == [
        "Groups not fitted in every seed: position=alibi, 1 of 3 seeds; "
        "position=none, 0 of 2 seeds."
    ]


def test_unfinished_runs_are_left_out_and_all_fitted_says_so():
    rows = _rows({"position=rope": [1.0, None], "position=shaw": [0.995]})
    lines = fit.section(rows)
    assert "| position=rope | 1 | 1.000 | 1.000 | fitted (1 of 1) |" in lines
    assert "Every checked group fitted (2 of 2)." in lines
    assert not any(line.startswith("Groups not fitted") for line in lines)


def test_the_threshold_is_the_experiments():
    rows = _rows({"position=t5": [0.96, 0.94]})
    assert "| position=t5 | 2 | 0.960, 0.940 | 0.940 | fitted (2 of 2) |" in fit.section(rows, 0.9)
    assert "partly fitted (1 of 2)" in fit.section(rows, 0.95)[-4]
    assert "at least 0.95." in " ".join(fit.section(rows, 0.95))
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="fit_threshold must be in"):
            fit.section(rows, bad)


def test_an_unproducible_validation_split_is_not_held_against_the_model():
    check = {"validation": {"examples": 100, "producible": 0.8, "longer_than_train": 0.0}}
    lines = fit.section(_rows({"position=t5": [0.7]}, check=check))
    assert "| position=t5 | 1 | unproducible (20.0% of targets) | - | not checked |" in lines
    assert "fitted (" not in " ".join(lines)
    assert lines[-2] == (
        "Not checked (validation targets unproducible from training, see the data check): "
        "position=t5."
    )
    assert not any(line.startswith("Groups not fitted") for line in lines)


def test_no_validation_exact_match_means_no_section():
    rows = _rows({"position=t5": [1.0]})
    for r in rows:
        r["final"] = {"step": 10, "eval/test_longer/exact_match": 0.3}
    assert fit.section(rows) == []
    assert fit.section(_rows({"position=t5": [None]})) == []
