"""Which group each group of a report is compared with.

A grid's report compares every group with a reference group on the first
metric: the experiment's ``reference`` (checked before training, so a typo
costs nothing) or else the best group, taken on the group's own task (every
axis over ``dataset``) and on the axes ``reference_within`` names, since a
comparison across tasks says nothing about a scheme. Group names are
``axis=value`` parts in any order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jattn.analysis import grid as grid_lib

__all__ = [
    "check_reference",
    "choose_reference",
    "match_group",
    "reference_of",
    "reference_within",
]


def choose_reference(
    groups: Mapping[str, Any], metric: str, requested: str | None
) -> tuple[str | None, str]:
    """The reference group of the comparison column, and why it is the one.

    `requested` (the experiment's ``reference``) when it names a group; else
    the group with the best mean of `metric` (lowest for a loss, highest
    otherwise) among those whose `metric` is a number (not unproducible).
    """
    why = ""
    if requested:
        found = match_group(requested, groups)
        if found is not None:
            return found, "set by the experiment's `reference`"
        why = f"`reference` {requested!r} is not a group of this grid, so: "
    means = {
        name: float(np.mean(g.values[metric]))
        for name, g in groups.items()
        if g.values.get(metric) and g.unproducible(metric) is None
    }
    if not means:
        return None, why + f"no group has {metric} as a number (missing or unproducible)"
    pick = min if "loss" in metric.rsplit("/", 1)[-1] else max
    best = pick(means, key=means.__getitem__)
    return best, why + f"the best mean {metric}"


def _parts(name: str) -> dict[str, str]:
    """``"task=copy,position=rope"`` -> ``{"task": "copy", "position": "rope"}``."""
    return dict(part.strip().partition("=")[::2] for part in name.split(","))


def match_group(requested: str, names) -> str | None:
    """The group of `names` that `requested` names, whatever the order of its
    ``axis=value`` parts ("task=copy,position=rope" names the group
    "position=rope,task=copy"), or None."""
    if requested in names:
        return requested
    wanted = _parts(requested)
    for name in names:
        if _parts(name) == wanted:
            return name
    return None


def reference_within(exp) -> tuple[str, ...]:
    """The axes along which each group is compared with its own reference: every
    axis over `dataset` (a comparison across tasks says nothing about a scheme)
    and those the experiment's ``reference_within`` names ("task,size")."""
    axes = [name for name, axis in exp.grid.items() if axis.key == "dataset"]
    axes += [a.strip() for a in str(exp.get("reference_within") or "").split(",") if a.strip()]
    return tuple(dict.fromkeys(axes))


def reference_of(name: str, reference: str, within: tuple[str, ...], names) -> str | None:
    """The group that group `name` is compared with: `reference` with the axes of
    `within` set to `name`'s own values (the reference scheme on the same task),
    or None when the grid has no such group."""
    if not within:
        return reference
    wanted, own = _parts(reference), _parts(name)
    for axis in within:
        if axis in own:
            wanted[axis] = own[axis]
    return match_group(",".join(f"{k}={v}" for k, v in wanted.items()), names)


def check_reference(exp, runs: list[grid_lib.Run]) -> None:
    """Raises ConfigError when the experiment's ``reference`` names no group
    of `runs` (call it before training, so a typo costs nothing)."""
    from jattn.train.config import ConfigError  # noqa: PLC0415

    requested = exp.get("reference") or None
    names = list(dict.fromkeys(r.group for r in runs))
    if requested and match_group(requested, names) is None:
        raise ConfigError(f"reference {requested!r} is not a group of the grid: {names}")
