"""Analysis: ablation grids (expand, train, report) and probes of trained runs.

    jattn ablate --config experiments/positional.py --workdir runs/positional
    jattn probe --workdir runs/positional/runs/position-shaw_seed-0 --out probe/

`grid` expands an experiment config into runs, `runner` trains them (or
prints them for a cluster), `report` writes tables and plots (`refresh`
rebuilds a kept report from its results.csv; `reevaluation` evaluates
finished runs again from their checkpoints), `verdicts` holds a grid
against a paper by the rule of docs/results.md, `probe` intervenes on a
trained model (import these as `jattn.analysis.<module>`).
"""

from jattn.analysis.grid import Run, apply_experiment_overrides, expand, training_config
from jattn.analysis.runner import emit, main_ablate, run_grid

__all__ = [
    "Run",
    "apply_experiment_overrides",
    "emit",
    "expand",
    "main_ablate",
    "run_grid",
    "training_config",
]
