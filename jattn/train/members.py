"""The members of one program: its seeds, and optimiser values swept along the same axis.

`jattn train --config.seeds=0,1,2` trains three seeds in one program
(`jattn.train.seed_program`). The sweep keys add values of a numeric optimiser
hyperparameter along the same axis (`jattn.train.optim.SWEEPABLE`):

    --config.seeds=0,1 --config.sweep_learning_rate=1e-3,3e-4

trains four members, every (learning rate, seed) pair, in one program. A
member is exactly the single run with its seed and values
(`member_config`): same initialisation, dropout keys and batches, and its
learning rate and warmup enter the program as numbers instead of constants
(`jattn.train.optim.swept_schedule`). Its workdir is ``WORKDIR/<name>/`` with
names such as ``seed-0`` (no sweep) or ``learning_rate-0.001_seed-0``, and
its `config.json` is the single run's, so `load_run` and the ablation report
read it as one. Seeds vary fastest.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence

import ml_collections
import numpy as np

__all__ = [
    "SWEEPS",
    "Member",
    "describe",
    "hparam_arrays",
    "is_program",
    "member_config",
    "member_workdirs",
    "members",
    "seed_config",
    "seed_list",
]

# config key of the swept values -> the key each member sets.
SWEEPS = {"sweep_learning_rate": "learning_rate", "sweep_warmup_steps": "warmup_steps"}


@dataclasses.dataclass(frozen=True)
class Member:
    """One model of a program: its seed, and the optimiser values it sweeps.

    Attributes:
      seed: the single run's `config.seed`.
      hparams: ``((key, value), ...)`` in `SWEEPS` order; () without a sweep.
    """

    seed: int
    hparams: tuple[tuple[str, float | int], ...] = ()

    @property
    def name(self) -> str:
        """``seed-0``, or ``learning_rate-0.001_seed-0`` with a sweep: its workdir's name."""
        return "_".join([f"{k}-{v:g}" for k, v in self.hparams] + [f"seed-{self.seed}"])

    @property
    def label(self) -> str:
        """How log lines name it: ``seed 0``, or its `name` with a sweep."""
        return self.name if self.hparams else f"seed {self.seed}"

    @property
    def key(self) -> int | str:
        """How results are keyed: the seed without a sweep (as before sweeps), else `name`."""
        return self.name if self.hparams else self.seed


def seed_list(config: ml_collections.ConfigDict) -> list[int]:
    """`config.seeds` as a list, or ``[config.seed]`` when it is empty."""
    return [int(s) for s in config.seeds] or [int(config.seed)]


def seed_config(config: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    """The config a single run of `seed` would have (``seed=s``, ``seeds=()``, locked).

    Its `config.json` is the one `jattn train --config.seed=s` writes, so a
    seed's workdir reads back (`load_run`) like a single run's.
    """
    out = config.copy_and_resolve_references()
    with out.unlocked():
        out.seed = int(seed)
        out.seeds = ()
        out.sweep_learning_rate = ()  # a member's values are set by `members.member_config`
        out.sweep_warmup_steps = ()
        out.seed_mesh_axis = ""
        out.seed_program = "auto"
        out.debug_nan_at_step = (
            config.debug_nan_at_step if config.debug_nan_seed in (-1, seed) else 0
        )
        out.debug_nan_seed = -1
    out.lock()
    return out


def is_program(config: ml_collections.ConfigDict) -> bool:
    """Whether `config` trains several members in one program (seeds or a sweep)."""
    return bool(config.get("seeds")) or any(config.get(sweep) for sweep in SWEEPS)


def members(config: ml_collections.ConfigDict) -> list[Member]:
    """Every (swept values, seed) combination of `config`, seeds fastest."""
    seeds = seed_list(config)
    axes = [
        [(key, v) for v in config.get(sweep, ())]
        for sweep, key in SWEEPS.items()
        if config.get(sweep, ())
    ]
    return [Member(s, tuple(combo)) for combo in itertools.product(*axes) for s in seeds]


def member_config(config: ml_collections.ConfigDict, member: Member) -> ml_collections.ConfigDict:
    """The config of the single run `member` is (locked; no seeds, no sweeps)."""
    out = seed_config(config, member.seed)
    with out.unlocked():
        for key, value in member.hparams:
            out[key] = value
    return out


def member_workdirs(workdir: str, program: Sequence[Member]) -> list[str]:
    """``WORKDIR/<member name>`` for every member."""
    return [os.path.join(workdir, m.name) for m in program]


def hparam_arrays(program: Sequence[Member]) -> dict[str, np.ndarray]:
    """The swept values as float32 arrays ``[S]`` by key (`swept_schedule`'s input);
    empty without a sweep."""
    if not program or not program[0].hparams:
        return {}
    keys = [k for k, _ in program[0].hparams]
    return {k: np.asarray([dict(m.hparams)[k] for m in program], np.float32) for k in keys}


def describe(program: Sequence[Member]) -> str:
    """``seeds [0, 1, 2]``, or ``4 members (seeds [0, 1] x learning_rate (0.001, 0.0003))``."""
    seeds = sorted({m.seed for m in program})
    if not program[0].hparams:
        return f"seeds {seeds}"
    swept = [
        f"{k} ({', '.join(f'{v:g}' for v in dict.fromkeys(dict(m.hparams)[k] for m in program))})"
        for k, _ in program[0].hparams
    ]
    return f"{len(program)} members (seeds {seeds} x {' x '.join(swept)})"
