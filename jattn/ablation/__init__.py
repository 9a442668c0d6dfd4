"""Ablation grids: expand an experiment config into runs, train them, report.

jattn ablate --config experiments/positional.py --workdir runs/positional
"""

from jattn.ablation.grid import Run, expand, training_config
from jattn.ablation.runner import emit, main_ablate, run_grid

__all__ = ["Run", "emit", "expand", "main_ablate", "run_grid", "training_config"]
