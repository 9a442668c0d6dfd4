"""The seed axis of a grid as one program: which runs of an ablation train together.

Runs of one group (`jattn.analysis.grid.Run.group`) differ only by their
seed, so `jattn ablate` trains the unfinished seeds of each group in one
vmapped program (`jattn.train.seed_loop.train_seeds`), whose seed workdirs are
the grid's own run workdirs (``DIR/runs/<name>/``): the report reads them as
it reads single runs. The program's stacked checkpoints live in
``DIR/groups/<group>/``.

A group falls back to one run per seed, and the log says why, when

- the experiment has no ``seed`` axis, or only one of its seeds is left to train;
- its runs differ in more than the seed (an axis whose key is not ``seed``
  but varies inside the group, which `Run.group` cannot see);
- the config cannot vmap (`jattn.train.seeds.vmap_blockers`: custom attention
  kernels, Weights & Biases);
- the config already sets `seeds`, or one program per group was turned off
  (``jattn ablate --one-run-per-seed``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import ml_collections

from jattn.train.config import config_to_dict

__all__ = ["Job", "group_workdir", "plan", "train_job"]


@dataclasses.dataclass(frozen=True)
class Job:
    """Runs trained together (one program) or one run alone.

    Attributes:
      runs: indices into the grid's runs (all of one group when `program`).
      program: True: one vmapped program for these seeds.
      note: why a group trains one run per seed ("" when nothing to say).
    """

    runs: tuple[int, ...]
    program: bool
    note: str = ""


def _without_seed(config: ml_collections.ConfigDict) -> dict[str, Any]:
    flat = config_to_dict(config)
    flat.pop("seed")
    return flat


def _blockers(exp, runs, configs, indices: Sequence[int]) -> list[str]:
    from jattn.train.seeds import vmap_blockers  # noqa: PLC0415

    why = []
    if "seed" not in exp.grid.keys() or exp.grid.seed.get("key") != "seed":
        why.append("the grid has no `seed` axis")
    first = configs[indices[0]]
    if any(_without_seed(configs[i]) != _without_seed(first) for i in indices[1:]):
        why.append("its runs differ in more than the seed")
    if first.seeds:
        why.append(f"the config already sets seeds={tuple(first.seeds)}")
    return why + vmap_blockers(first)


def plan(
    exp: ml_collections.ConfigDict,
    runs: Sequence[Any],
    configs: Sequence[ml_collections.ConfigDict],
    todo: Sequence[int],
    *,
    one_program: bool = True,
) -> list[Job]:
    """The jobs that train the runs `todo`, in grid order of their groups' first run."""
    groups: dict[str, list[int]] = {}
    for i in todo:
        groups.setdefault(runs[i].group, []).append(i)
    jobs = []
    for indices in groups.values():
        if len(indices) == 1:
            jobs.append(Job((indices[0],), False))
            continue
        why = (
            ["one program per group was turned off (--one-run-per-seed)"]
            if not one_program
            else _blockers(exp, runs, configs, indices)
        )
        if why:
            note = "; ".join(why)
            jobs += [Job((i,), False, note) for i in indices]
        else:
            jobs.append(Job(tuple(indices), True))
    return jobs


def group_workdir(workdir: str, group: str) -> str:
    """``DIR/groups/<group>``: where a group's program keeps its stacked checkpoints."""
    safe = re.sub(r"[^A-Za-z0-9_.=,+-]", "_", group).replace("=", "-").replace(",", "_")
    return os.path.join(workdir, "groups", safe)


def train_job(job: Job, runs, configs, workdir: str) -> dict[str, str]:
    """Trains one job; returns each of its runs' status ("finished", "preempted" or
    "diverged: ...") as `jattn.analysis.runner` records it."""
    from jattn.train.loop import TrainingDivergedError, train_and_evaluate  # noqa: PLC0415
    from jattn.train.seed_loop import train_seeds  # noqa: PLC0415

    if not job.program:
        run = runs[job.runs[0]]
        try:
            final = train_and_evaluate(configs[job.runs[0]], run.workdir)
        except TrainingDivergedError as e:
            return {run.name: f"diverged: {e}"}
        return {run.name: "preempted" if final.get("preempted") else "finished"}
    config = configs[job.runs[0]].copy_and_resolve_references()
    with config.unlocked():
        config.seeds = tuple(int(configs[i].seed) for i in job.runs)
    result = train_seeds(
        config,
        group_workdir(workdir, runs[job.runs[0]].group),
        [runs[i].workdir for i in job.runs],
        raise_on_divergence=False,
    )
    status = {}
    for i in job.runs:
        seed = int(configs[i].seed)
        if seed in result["diverged"]:
            status[runs[i].name] = f"diverged: {result['diverged'][seed]}"
        else:
            status[runs[i].name] = "preempted" if result["preempted"] else "finished"
    return status
