"""`train_and_evaluate(config, workdir)` and `train_seeds`: build a program, drive it.

A run is a program of the one loop driver (`jattn.train.driver.drive`): a
single run (`jattn.train.program`) or every seed (and swept value) of a
config stacked into one jitted program (`jattn.train.seed_program`). Each
program does the seven stages of a run:

1. check the config, build the mesh, load the data, build the model;
2. open the workdir's checkpoints and refuse an incompatible one;
3. derive the state's shardings from the model's logical axis names;
4. initialise the state, or restore it and the data iterator;
5. jit the train step (explicit shardings, donated state), eval and decode;
6. loop: step, log, evaluate, checkpoint, watch for SIGTERM (the driver);
7. final evaluation, `final_metrics.json`.

Helpers live beside this file by concern: `config` (keys, defaults, loading,
checks), `setup` (what both programs build from), `workdir` (the run's file
names), `mesh` (shardings), `optim`, `steps` (loss and step functions),
`checkpoints`, `recovery`, `restore` (the data set of a config),
`evaluation`, `metrics` (step bookkeeping and output), `distributed`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import ml_collections

from jattn.train import members as members_lib
from jattn.train.config import build_model_config
from jattn.train.distributed import PreemptionWatch
from jattn.train.driver import TrainingDivergedError, drive
from jattn.train.program import single_run
from jattn.train.seed_program import seed_program
from jattn.train.workdir import FINAL_METRICS

__all__ = [
    "FINAL_METRICS",
    "TrainingDivergedError",
    "build_model_config",
    "train_and_evaluate",
    "train_seeds",
]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) the run in `workdir` and returns its final metrics.

    A config with `seeds` (or a swept learning rate or warmup) trains every
    member in one program (`train_seeds`).

    Args:
      config: a full config (see `jattn.train.config.default_config`).
      workdir: the run directory; holds `checkpoints/`, `metrics.jsonl`,
        `tb/`, `config.json`, `model_config.json`, the tokenizer
        (`tokenizer.json` and its vocabulary file), `decodes/` and, once done,
        `final_metrics.json` (`jattn.train.workdir`). An existing checkpoint
        is resumed.

    Returns:
      ``{"step", "preempted", "train/loss", "eval/<split>/<metric>", ...,
      "num_params", "train/steps_per_sec"}``, as written to
      `final_metrics.json` (strict JSON: None where unknown). ``train/loss``
      is the mean over the last logging interval, the number metrics.jsonl,
      TensorBoard and the progress bar show. A finished workdir returns its
      saved final metrics without training again.

    Raises:
      ConfigError: bad config, mesh, batch size, data set (damaged data included) or
        workdir (before compiling).
      TrainingDivergedError: a non-finite loss (nothing is saved for that step).
      WorkdirLockedError: another trainer holds the workdir.
      WorkdirIOError: the workdir or a checkpoint cannot be written (disk full,
        read-only); raised at start or at the first failed save.
      Terminated: SIGTERM before the first step or after the last save, or a
        second SIGTERM (the first one saves and returns normally).
    """
    watch = PreemptionWatch(stage="start-up")  # SIGTERM from here on ends the run
    with contextlib.ExitStack() as stack:
        stack.callback(watch.close)
        if members_lib.is_program(config):  # every seed (and swept value) in one program
            return train_seeds(config, workdir, watch=watch)  # it takes the workdir's lock
        program = single_run(config, workdir, stack)
        return program if isinstance(program, dict) else drive(program, watch)


def train_seeds(
    config: ml_collections.ConfigDict,
    workdir: str,
    seed_dirs: list[str] | None = None,
    *,
    members: Sequence[members_lib.Member] | None = None,
    raise_on_divergence: bool = True,
    watch: PreemptionWatch | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) every seed of `config.seeds` in one program.

    It has a single run's protections (docs/reliability.md, "Seeds in one
    program"): the workdir, `checkpoints/` and every seed workdir are probed
    for writing at start; the workdir is locked; damaged stacked checkpoints
    are set aside and the newest one that restores and verifies is resumed;
    the data checks run; each save checks the previous one and the free
    space; and retention keeps the last sane checkpoint, where a stacked
    checkpoint is sane when every seed's last logged loss is sane: a live
    seed's at that step, a seed that went NaN the last one it logged (its
    state is frozen there; `jattn.train.seed_metrics`).

    Args:
      config: a full config with `seeds` set.
      workdir: the group's directory: holds the stacked ``checkpoints/``.
      seed_dirs: each member's run directory (default ``workdir/<member name>``:
        ``seed-<s>``, or e.g. ``learning_rate-0.001_seed-<s>`` with a sweep),
        laid out as a single run's.
      members: the program's members (`jattn.train.members`); default: every
        seed and swept value of `config` (`members.members(config)`).
      raise_on_divergence: raise `TrainingDivergedError` at the end (after the
        other seeds finished) when a seed diverged; False returns it in
        ``"diverged"``.
      watch: the caller's `PreemptionWatch` (`train_and_evaluate`'s); None
        installs one for this call.

    Returns:
      ``{"step", "preempted", "seeds": {key: final metrics}, "diverged":
      {key: message}}``, keyed by seed (or by member name when a learning
      rate or warmup is swept: `Member.key`); each member's final metrics as
      its ``final_metrics.json`` holds them.

    Raises:
      ConfigError: as `train_and_evaluate`, or a config that cannot vmap.
      TrainingDivergedError: a seed diverged (`raise_on_divergence`).
      WorkdirLockedError, WorkdirIOError, Terminated: as `train_and_evaluate`.
    """
    with contextlib.ExitStack() as stack:
        if watch is None:
            watch = PreemptionWatch(stage="start-up")
            stack.callback(watch.close)
        program = seed_program(config, workdir, seed_dirs, members, raise_on_divergence, stack)
        return program if isinstance(program, dict) else drive(program, watch)
