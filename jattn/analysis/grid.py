"""Ablation grids as data: expand an experiment config into named runs.

An experiment config (``experiments/X.py`` with ``get_config(arg)``) holds

- ``base``: the training config spec, e.g. ``"configs/numbers.py"`` (a path
  relative to the repository root, or absolute); ``{axis}`` in it is each
  run's value of that axis (`run_base`), so an axis can pick a task's own
  config, row lengths and all (``"configs/chomsky.py:{task}"``), where an
  override of one key (``dataset``) would keep the lengths of one base,
- ``train``: overrides for every run, nested like the training config
  (``train.num_train_steps = 800``, ``train.model.d_model = 64``); on the
  command line ``--config.train.KEY=VALUE`` may set any training key, also
  one the experiment leaves alone (`apply_experiment_overrides`),
- ``grid``: one entry per axis, ``grid.<axis>.key`` (a dotted key of the
  training config) and ``grid.<axis>.values`` (comma-separated, or a tuple,
  parsed with the type of that key), so ``--config.grid.seed.values=0,1,2`` works on
  the command line,
- ``group_by``: the axis the tables and plots compare (the others, bar
  ``seed``, are folded into the group name),
- ``metrics``: the final metrics reported as mean ± std over seeds,
- optionally ``fit_threshold`` (default 0.99): the validation exact match a
  seed must reach to count as fitted inside the training lengths
  (`jattn.analysis.fit`, a section of the report).

Runs are the cartesian product of the axes, in config order, each with a
stable name (``position=shaw,seed=1``) and its own workdir under
``DIR/runs/``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Sequence
from typing import Any

import ml_collections

from jattn.train.config import ConfigError, apply_overrides, check_config, load_config

__all__ = [
    "Run",
    "apply_experiment_overrides",
    "checked_configs",
    "expand",
    "resolve_base",
    "run_base",
    "training_config",
    "typed_axes",
]


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
    """The override string that parses back to `value` (`jattn.train.apply_overrides`)."""
    if isinstance(value, tuple | list):
        if all(isinstance(v, int | float) for v in value):
            return ",".join(str(v) for v in value)
        return repr(tuple(value))  # strings: ('validation', 'test')
    return str(value)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", name).replace("=", "-").replace(",", "_")


def resolve_base(spec: str, repo_root: str) -> str:
    """A base config spec with its path made absolute (``path[:arg]``)."""
    path, sep, arg = spec.partition(":")
    if not os.path.isabs(path):
        path = os.path.join(repo_root, path)
    return path + sep + arg


def _fill(spec: str, axes: dict[str, Any]) -> str:
    """`spec` with each ``{axis}`` replaced by that axis's value in `axes`."""
    try:
        return spec.format_map(axes)
    except KeyError as e:
        raise ConfigError(
            f"base {spec!r} names {{{e.args[0]}}}, which is not an axis of the grid "
            f"(axes: {', '.join(axes) or 'none'})"
        ) from None
    except (ValueError, IndexError) as e:
        raise ConfigError(f"base {spec!r} is not a spec with {{axis}} fields: {e}") from None


def run_base(exp: ml_collections.ConfigDict, run: Run) -> str:
    """The base config spec of one run: ``exp.base`` with its ``{axis}`` fields
    filled by the run's values (a base without fields is every run's).

    Raises:
      ConfigError: the base names a field that is not an axis of the grid.
    """
    return _fill(exp.base, run.axes)


def _lookup(config: ml_collections.ConfigDict, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _assign(config: ml_collections.ConfigDict, dotted: str, value: Any) -> None:
    """Sets `config.<dotted>` on a locked config, adding the key (and groups) if missing."""
    *groups, leaf = dotted.split(".")
    node = config
    for group in groups:
        if group not in node:
            with node.unlocked():
                node[group] = ml_collections.ConfigDict()
        node = node[group]
    with node.unlocked():
        node[leaf] = value


def apply_experiment_overrides(
    exp: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str]], repo_root: str
) -> ml_collections.ConfigDict:
    """Applies command-line overrides to an experiment config, in place.

    ``train.KEY`` may be any key of the base training config, whether the
    experiment's ``train`` section sets it or not: it is checked and typed
    against the base config, then added to ``exp.train``, so that every run
    (and `emit`) gets it. Other keys (``grid.seed.values``, ``base``, ...)
    must exist in the experiment config; they are applied first, so that a
    new ``base`` is the one ``train.*`` keys are checked against (a base with
    ``{axis}`` fields: the first run's).

    Raises:
      ConfigError: an unknown key or a value of the wrong type, in one line.
    """
    train = [(k.removeprefix("train."), v) for k, v in overrides if k.startswith("train.")]
    apply_overrides(exp, [(k, v) for k, v in overrides if not k.startswith("train.")])
    if train:
        first = {axis: values[0] for axis, _, values in _axes(exp)}
        base = load_config(resolve_base(_fill(exp.base, first), repo_root))
        apply_overrides(base, train, prefix="train.")
        for key, _ in train:
            _assign(exp.train, key, _lookup(base, key))
    return exp


def _axes(exp: ml_collections.ConfigDict) -> list[tuple[str, str, list[str]]]:
    """``(axis, config key, raw values)`` of every axis of the grid, in config order.

    Raises:
      ConfigError: an axis without key/values, or with no values.
    """
    axes = []
    for axis in exp.grid.keys():
        spec = exp.grid[axis]
        if "key" not in spec or "values" not in spec:
            raise ConfigError(f"grid.{axis} needs 'key' and 'values'")
        raw = spec["values"]  # "a,b,c", or a tuple or list of values
        items = raw if isinstance(raw, tuple | list) else str(raw).split(",")
        values = [str(v).strip() for v in items if str(v).strip()]
        if not values:
            raise ConfigError(f"grid.{axis}.values is empty: the grid would have no runs")
        axes.append((axis, spec["key"], values))
    return axes


def expand(exp: ml_collections.ConfigDict, workdir: str) -> list[Run]:
    """All runs of the grid, with overrides checked against the base config.

    Raises:
      ConfigError: an axis without key/values, or a key the training config
        does not have (found before anything trains).
    """
    common = [(k, _raw(v)) for k, v in _flatten(exp.train)]
    axes = _axes(exp)
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
    """The full training config of one run (its base config plus overrides)."""
    config = load_config(resolve_base(run_base(exp, run), repo_root))
    return apply_overrides(config, list(run.overrides))


def checked_configs(
    exp: ml_collections.ConfigDict, runs: Sequence[Run], repo_root: str
) -> list[ml_collections.ConfigDict]:
    """The training config of every run, each checked by `check_config` as `jattn train` does.

    Every run is checked before any is returned, so one bad value of an axis
    (``--config.grid.position.values=rope,rotary``) stops the whole grid before
    anything trains or is emitted, and the error names every bad run.

    Raises:
      ConfigError: the base config does not load, or one line listing each bad
        run as ``run N (axis=value,...): problem`` (N counts from 1).
    """
    if runs:  # a bad base is one error, not one per run
        load_config(resolve_base(run_base(exp, runs[0]), repo_root))
    configs, bad = [], []
    for number, run in enumerate(runs, start=1):
        try:
            config = training_config(exp, run, repo_root)
            check_config(config)
        except ConfigError as e:
            bad.append(f"run {number} ({run.name}): {e}")
            continue
        configs.append(config)
    if bad:
        raise ConfigError(
            f"{len(bad)} of {len(runs)} runs of the grid are invalid (nothing was run): "
            + "; ".join(bad)
        )
    return configs


def typed_axes(run: Run, config: ml_collections.ConfigDict, exp) -> dict[str, Any]:
    """Axis values with the types of the training config (for tables and plots)."""
    return {axis: _lookup(config, exp.grid[axis]["key"]) for axis in exp.grid.keys()}
