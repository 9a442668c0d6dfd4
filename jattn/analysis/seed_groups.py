"""The seed axis of a grid as one program: which runs of an ablation train together.

Runs that differ only by their seed and by the optimiser values a program can
sweep (`jattn.train.optim.SWEEPABLE`: the learning rate and warmup) are one
program's members (`jattn.train.members`): `jattn ablate` trains the
unfinished ones in one program (`jattn.train.run.train_and_evaluate` with
`members`), whose member workdirs are the grid's own run workdirs
(``DIR/runs/<name>/``, each with its own checkpoints), so the report reads
them as it reads single runs. So a grid's seed axis is one program per group,
and a learning-rate axis joins its groups into one program too; a run that
trains alone is a program of one member.

A program falls back to one run per member, and the log says why, when

- the experiment has no ``seed`` axis and no axis on a sweepable key, or only
  one of its runs is left to train;
- its runs differ in more than those (an axis whose key varies inside the
  program without being one of them);
- the config cannot vmap (`jattn.train.members.vmap_blockers`: custom attention
  kernels, Weights & Biases);
- the config already sets `seeds` or a sweep, or one program per group was
  turned off (``jattn ablate --one-run-per-seed``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import ml_collections

from jattn.train.config import config_to_dict

__all__ = ["Job", "check_layout", "plan", "program_members", "train_job"]

MEMBER_KEYS = ("seed", "learning_rate", "warmup_steps")  # what members of a program may vary


@dataclasses.dataclass(frozen=True)
class Job:
    """Runs trained together (one program) or one run alone.

    Attributes:
      runs: indices into the grid's runs (all of one program when `program`).
      program: True: one program for these runs (its members).
      note: why a group trains one run per seed ("" when nothing to say).
      name: the program's name: the grid's other axes (`Run.group` without the
        swept ones); "" for a single run.
    """

    runs: tuple[int, ...]
    program: bool
    note: str = ""
    name: str = ""


def _member_axes(exp: ml_collections.ConfigDict) -> set[str]:
    """The grid's axes whose key a program's members may vary (seed, learning rate, warmup)."""
    return {a for a in exp.grid.keys() if exp.grid[a].get("key") in MEMBER_KEYS}


def _program_name(run, member_axes: set[str]) -> str:
    """`Run.group` (no axis named seed) without the member axes either."""
    skip = member_axes | {"seed"}
    return ",".join(f"{k}={v}" for k, v in run.axes.items() if k not in skip) or "all"


def _shared(config: ml_collections.ConfigDict) -> dict[str, Any]:
    flat = config_to_dict(config)
    for key in MEMBER_KEYS:
        flat.pop(key)
    return flat


def _blockers(exp, configs, indices: Sequence[int]) -> list[str]:
    from jattn.train.members import vmap_blockers  # noqa: PLC0415

    why = []
    if not _member_axes(exp):
        why.append("the grid has no `seed` axis (nor one on learning_rate or warmup_steps)")
    first = configs[indices[0]]
    if any(_shared(configs[i]) != _shared(first) for i in indices[1:]):
        why.append("its runs differ in more than the seed and the swept optimiser values")
    if first.seeds or first.sweep_learning_rate or first.sweep_warmup_steps:
        why.append("the config already sets seeds or a sweep")
    return why + vmap_blockers(first)


def program_members(configs: Sequence[ml_collections.ConfigDict], indices: Sequence[int]):
    """The members (`jattn.train.members.Member`) the runs `indices` are, in order: their
    seeds, and the learning rate and warmup where those vary between them."""
    from jattn.train.members import Member  # noqa: PLC0415

    varying = [k for k in MEMBER_KEYS[1:] if len({configs[i][k] for i in indices}) > 1]
    return [
        Member(int(configs[i].seed), tuple((k, configs[i][k]) for k in varying)) for i in indices
    ]


def plan(
    exp: ml_collections.ConfigDict,
    runs: Sequence[Any],
    configs: Sequence[ml_collections.ConfigDict],
    todo: Sequence[int],
    *,
    one_program: bool = True,
) -> list[Job]:
    """The jobs that train the runs `todo`, in grid order of their programs' first run."""
    member_axes = _member_axes(exp)
    programs: dict[str, list[int]] = {}
    for i in todo:
        programs.setdefault(_program_name(runs[i], member_axes), []).append(i)
    jobs = []
    for name, indices in programs.items():
        if len(indices) == 1:
            jobs.append(Job((indices[0],), False))
            continue
        why = (
            ["one program per group was turned off (--one-run-per-seed)"]
            if not one_program
            else _blockers(exp, configs, indices)
        )
        if why:
            note = "; ".join(why)
            jobs += [Job((i,), False, note) for i in indices]
        else:
            jobs.append(Job(tuple(indices), True, name=name))
    return jobs


def check_layout(workdir: str, todo: Sequence[int]) -> None:
    """Refuses (one line) a grid with runs left to train whose seed programs an
    earlier jattn kept in ``DIR/groups/<program>/`` as stacked checkpoints: each
    member's workdir is now its only checkpoint layout, so they would not resume.

    Raises:
      ConfigError: ``DIR/groups/`` exists and `todo` is not empty.
    """
    from jattn.train.config import ConfigError  # noqa: PLC0415
    from jattn.train.run import OLD_LAYOUT  # noqa: PLC0415

    groups = os.path.join(workdir, "groups")
    if todo and os.path.isdir(groups) and os.listdir(groups):
        raise ConfigError(
            f"{groups} holds the stacked checkpoints of seed programs of an earlier jattn, "
            f"which this one does not resume: {OLD_LAYOUT}"
        )


def train_job(job: Job, runs, configs, workdir: str) -> dict[str, str]:
    """Trains one job (one program; a run alone is a program of one member); returns
    each of its runs' status ("finished", "preempted" or "diverged: ...") as
    `jattn.analysis.runner` records it."""
    from jattn.train.loop import TrainingDivergedError  # noqa: PLC0415
    from jattn.train.run import train_and_evaluate  # noqa: PLC0415 -- only when a job runs

    members = [
        dataclasses.replace(m, workdir=runs[i].workdir)
        for i, m in zip(job.runs, program_members(configs, job.runs), strict=True)
    ]
    try:
        result = train_and_evaluate(
            configs[job.runs[0]], os.path.join(workdir, "runs"), members=members
        )
        diverged, preempted = result["diverged"], result["preempted"]
    except TrainingDivergedError as e:
        diverged, preempted = e.diverged or {members[0].key: str(e)}, False
    status = {}
    for i, member in zip(job.runs, members, strict=True):
        if member.key in diverged:
            status[runs[i].name] = f"diverged: {diverged[member.key]}"
        else:
            status[runs[i].name] = "preempted" if preempted else "finished"
    return status
