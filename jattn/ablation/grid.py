"""Ablation grids as data: expand an experiment config into named runs.

An experiment config (``experiments/X.py`` with ``get_config(arg)``) holds

- ``base``: the training config spec, e.g. ``"configs/numbers.py"`` (a path
  relative to the repository root, or absolute),
- ``train``: overrides for every run, nested like the training config
  (``train.num_train_steps = 800``, ``train.model.d_model = 64``),
- ``grid``: one entry per axis, ``grid.<axis>.key`` (a dotted key of the
  training config) and ``grid.<axis>.values`` (comma-separated, parsed with
  the type of that key), so ``--config.grid.seed.values=0,1,2`` works on
  the command line,
- ``group_by``: the axis the tables and plots compare (the others, bar
  ``seed``, are folded into the group name),
- ``metrics``: the final metrics reported as mean ± std over seeds.

Runs are the cartesian product of the axes, in config order, each with a
stable name (``position=shaw,seed=1``) and its own workdir under
``DIR/runs/``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import Any

import ml_collections

from jattn.train.config import ConfigError, apply_overrides, load_config


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a grid."""

    name: str  # "position=shaw,seed=1"
    axes: dict[str, Any]  # {"position": "shaw", "seed": 1}
    overrides: tuple[tuple[str, str], ...]  # dotted training-config keys -> raw values
    workdir: str

    @property
    def group(self) -> str:
        """The run's name without the seed: runs of one group differ only by seed."""
        return ",".join(f"{k}={v}" for k, v in self.axes.items() if k != "seed") or "all"


def _flatten(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key in cfg.keys():
        value = cfg[key]
        if isinstance(value, ml_collections.ConfigDict):
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _raw(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return str(value)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", name).replace("=", "-").replace(",", "_")


def resolve_base(spec: str, repo_root: str) -> str:
    """A base config spec with its path made absolute (``path[:arg]``)."""
    path, sep, arg = spec.partition(":")
    if not os.path.isabs(path):
        path = os.path.join(repo_root, path)
    return path + sep + arg


def expand(exp: ml_collections.ConfigDict, workdir: str) -> list[Run]:
    """All runs of the grid, with overrides checked against the base config.

    Raises:
      ConfigError: an axis without key/values, or a key the training config
        does not have (found before anything trains).
    """
    common = [(k, _raw(v)) for k, v in _flatten(exp.train)]
    axes: list[tuple[str, str, list[str]]] = []
    for axis in exp.grid.keys():
        spec = exp.grid[axis]
        if "key" not in spec or "values" not in spec:
            raise ConfigError(f"grid.{axis} needs 'key' and 'values'")
        values = [v.strip() for v in str(spec["values"]).split(",") if v.strip()]
        if not values:
            raise ConfigError(f"grid.{axis}.values is empty")
        axes.append((axis, spec["key"], values))
    runs = []
    for combo in itertools.product(*(vals for _, _, vals in axes)):
        named = {axis: value for (axis, _, _), value in zip(axes, combo, strict=True)}
        overrides = tuple(common) + tuple(
            (key, value) for (_, key, _), value in zip(axes, combo, strict=True)
        )
        name = ",".join(f"{a}={v}" for a, v in named.items()) or "run"
        runs.append(Run(name, named, overrides, os.path.join(workdir, "runs", _safe(name))))
    return runs


def training_config(exp: ml_collections.ConfigDict, run: Run, repo_root: str):
    """The full training config of one run (base config plus overrides)."""
    config = load_config(resolve_base(exp.base, repo_root))
    return apply_overrides(config, list(run.overrides))


def typed_axes(run: Run, config: ml_collections.ConfigDict, exp) -> dict[str, Any]:
    """Axis values with the types of the training config (for tables and plots)."""
    out = {}
    for axis in exp.grid.keys():
        key = exp.grid[axis]["key"]
        node = config
        for part in key.split("."):
            node = node[part]
        out[axis] = node
    return out
