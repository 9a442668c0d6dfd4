"""`train_and_evaluate(config, workdir, members=None)`: one program of N >= 1 members.

A plain config is one member, the run in `workdir`; `config.seeds` (and the
sweep keys) or `members` make several, each in its own workdir laid out as
a single run's (`jattn.train.members`). Every run does seven stages:

1. check the config, and against each member's checkpoint (if any) what
   needs no data; build the mesh, load the data, build the model;
2. open every member's workdir and checkpoints, refuse an incompatible one,
   leave out the members already finished;
3. derive the state's shardings from the model's logical axis names;
4. initialise the state, or restore the newest step every live member has
   (`jattn.train.recovery.restore_members`) with each member's data iterator;
5. compile the train step (N = 1: the single run's unmapped step; N > 1:
   that step over a member axis), eval and decode;
6. loop: step, log, evaluate, checkpoint, watch for SIGTERM (`jattn.train.loop`);
7. each member's final evaluation and `final_metrics.json`.

Each member saves its own checkpoints in its own workdir (no stacked state on
disk), so any member resumes as a single run, and `best_metric` keeps each
member's best step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.data import producibility
from jattn.data.tokenizers import check_saved, vocab_hash
from jattn.train import checkpoints as ckpt
from jattn.train import data_checks, evaluation, filesystem, load, recovery
from jattn.train import members as members_lib
from jattn.train import mesh as mesh_lib
from jattn.train import workdir as files
from jattn.train.config import ConfigError, check_config, config_to_dict, matmul_precision
from jattn.train.distributed import PreemptionWatch, warn
from jattn.train.load import Environment, Model, build_model, environment, import_wandb
from jattn.train.loop import TrainingDivergedError, drive
from jattn.train.metrics import (
    MemberMetrics,
    Progress,
    last_logged_loss,
    strict_json_value,
    write_final_metrics,
)
from jattn.train.sanity import SANE_STEP_METRIC
from jattn.train.steps import make_init
from jattn.train.workdir import WorkdirLock

__all__ = ["OLD_LAYOUT", "Program", "TrainingDivergedError", "train_and_evaluate"]

OLD_LAYOUT = (
    "finish it with the jattn release that started it (the last commit with "
    "jattn/train/seed_program.py: git checkout $(git log -1 --format=%h --diff-filter=D -- "
    "jattn/train/seed_program.py)~1), or train into a new --workdir"
)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    members: Sequence[members_lib.Member] | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) one program and returns its final metrics.

    Args:
      config: a full config (`jattn.train.config.default_config`).
      workdir: the run directory: holds `checkpoints/`, `metrics.jsonl`, `tb/`,
        `config.json`, `model_config.json`, the tokenizer, `decodes/` and, once
        done, `final_metrics.json` (`jattn.train.workdir`). With seeds or a
        sweep, each member's run directory ``workdir/<member name>`` holds them.
      members: the program's members (`jattn.train.members.Member`, each with
        its workdir, or ``workdir/<name>`` when it has none); default: every
        seed and swept value of `config` (`members.members`).

    Returns:
      A plain run (no seeds, sweeps or `members`): ``{"step", "preempted",
      "train/loss", "eval/<split>/<metric>", ..., "num_params",
      "train/steps_per_sec"}``, as written to `final_metrics.json` (strict JSON);
      ``train/loss`` is the last logging interval's mean. Otherwise ``{"step",
      "preempted", "members": {Member.key: final metrics}, "diverged": {key:
      message}}``. A finished member returns its saved final metrics without
      training again.

    Raises:
      ConfigError: bad config, mesh, batch size, data set (damaged data included),
        workdir, or a workdir of the old stacked layout (before compiling).
      TrainingDivergedError: a non-finite loss (a one-member program: nothing is
        saved for that step); with several members, after the others finished.
      WorkdirLockedError: another trainer holds a workdir.
      WorkdirIOError: a workdir or a checkpoint cannot be written (disk full,
        read-only); raised at start or at the first failed save.
      Terminated: SIGTERM before the first step or after the last save, or a
        second SIGTERM (the first one saves and returns normally).
    """
    lone = members is None and not members_lib.grouped(config)
    watch = PreemptionWatch(stage="start-up")  # SIGTERM from here on ends the run
    with contextlib.ExitStack() as stack:
        stack.enter_context(matmul_precision(config))  # the steps are traced under it
        stack.callback(watch.close)
        program = _open(config, workdir, members, stack)
        result = program if isinstance(program, dict) else drive(program, watch)
    return next(iter(result["members"].values())) if lone else result


# -- 1. config, mesh, data, model --------------------------------------------------------


def _roster(config, workdir: str, members) -> list[members_lib.Member]:
    """The program's members, each with its absolute workdir."""
    if members is None:
        return members_lib.members(config, workdir)
    return [
        dataclasses.replace(m, workdir=os.path.abspath(m.workdir or os.path.join(workdir, m.name)))
        for m in members
    ]


# -- 2. workdirs and checkpoints ---------------------------------------------------------


def open_workdirs(stack, dirs: Sequence[str]) -> None:
    """Process 0's protections at start: every workdir and its checkpoints writable,
    locked (held by `stack`), damaged checkpoint steps set aside before orbax opens them."""
    if jax.process_index() != 0:
        return
    for d in dirs:
        checkpoints = os.path.join(d, ckpt.CHECKPOINT_DIR)
        filesystem.check_writable(d, checkpoints)
        lock = stack.enter_context(WorkdirLock(d))
        if lock.previous:
            pid = lock.previous.get("pid")
            warn(f"warning: took over the lock of {d} left by pid {pid}, which died")
        recovery.set_aside_incomplete(checkpoints, warn)


def _refuse_stacked_layout(workdir: str, team, configs) -> None:
    """A seed program of an earlier jattn kept one stacked checkpoint of every member
    in ``workdir/checkpoints``: refused (one line) while a member is unfinished."""
    folder = os.path.join(workdir, ckpt.CHECKPOINT_DIR)
    if any(m.workdir == workdir for m in team) or not os.path.isdir(folder):
        return
    if not any(name.isdigit() for name in os.listdir(folder)):
        return
    if all(
        files.finished_metrics(m.workdir, c.num_train_steps)
        for m, c in zip(team, configs, strict=True)
    ):
        return
    raise ConfigError(
        f"{folder} holds the stacked checkpoints of a seed program of an earlier jattn, "
        f"which this one does not resume: {OLD_LAYOUT}"
    )


def _open_checkpoints(env, team, configs, vocab) -> tuple[list[Any], list[int | None]]:
    """Every member's manager and latest step, compatible with its config."""
    mngrs, latest = [], []
    for m, c in zip(team, configs, strict=True):
        mngrs.append(ckpt.make_manager(m.workdir, c))
        latest.append(ckpt.check_compatible(mngrs[-1], m.workdir, c, vocab))
    data_checks.check_row_lengths(configs[0], env.task, warn)  # a resume's diffs say more
    for m, step in zip(team, latest, strict=True):
        if step is not None:
            try:
                check_saved(m.workdir, env.task.tokenizer)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    return mngrs, latest


def _open(config, workdir: str, members, stack) -> Program | dict[str, Any]:
    """Stages 1-5: a `Program` ready for `drive`, or the result of one with nothing left."""
    check_config(config)
    wandb = import_wandb(config)
    workdir = os.path.abspath(workdir)
    team = _roster(config, workdir, members)
    blockers = members_lib.vmap_blockers(config) if len(team) > 1 else []
    if blockers:
        raise ConfigError(
            "config.seeds: these seeds cannot train in one program: " + "; ".join(blockers)
        )
    configs = [members_lib.member_config(config, m) for m in team]
    # What needs no data is refused before the data set is prepared (minutes for a large one).
    _refuse_stacked_layout(workdir, team, configs)
    for m, c in zip(team, configs, strict=True):
        ckpt.check_saved_config(m.workdir, c)
    env = environment(config)
    data_check = producibility.check(env.task, env.eval_splits)
    model = build_model(config, env.task)

    open_workdirs(stack, [m.workdir for m in team])
    vocab = vocab_hash(env.task.tokenizer)
    mngrs, latest = _open_checkpoints(env, team, configs, vocab)
    finals = {}  # key -> final metrics of the members already finished (left out)
    for i, (m, c) in enumerate(zip(team, configs, strict=True)):
        done = files.finished_metrics(m.workdir, c.num_train_steps)
        if latest[i] == c.num_train_steps and done is not None:
            finals[m.key] = done
            mngrs[i].close()
    todo = [i for i, m in enumerate(team) if m.key not in finals]
    if not todo:
        return {"step": config.num_train_steps, "preempted": False, "members": finals,
                "diverged": {}}  # fmt: skip
    if env.is_main:
        for i in todo:
            files.write_run_files(
                team[i].workdir, configs[i], model.config, env.task.tokenizer, data_check
            )
    pick = lambda xs: [xs[i] for i in todo]  # noqa: E731
    program = Program(config, workdir, env, model, pick(team), pick(configs), pick(mngrs))
    program.vocab, program.data_check, program.finals = vocab, data_check, finals
    program.init_or_restore()
    program.compile()
    program.open_metrics(wandb)
    return program


# -- 3.-7. the program --------------------------------------------------------------------


class Program:
    """The state of N >= 1 members (`[N, ...]` leaves when N > 1), their compiled steps
    and bookkeeping, stepped by `jattn.train.loop.drive`.

    Attributes read by the loop: `config`, `workdir` (named in a failed write's
    error), `mesh`, `rules`, `mngrs` (every member's checkpoint manager),
    `progress`, `start` (0, or the restored step).
    """

    def __init__(self, config, workdir: str, env: Environment, model: Model, team, configs, mngrs):
        self.config, self.workdir, self.env, self.model = config, workdir, env, model
        self.mesh, self.rules = env.mesh, env.rules
        self.team, self.configs, self.mngrs = list(team), list(configs), list(mngrs)
        self.vocab, self.data_check, self.finals = None, {}, {}
        self.gone: dict[Any, str] = {}  # key -> message: diverged before this start
        self.eval_metrics: dict[int, dict[str, float]] = {}
        # 3. One member's abstract state and shardings, from the logical axis names.
        rows = env.mesh.shape["data"] * env.mesh.shape["fsdp"]
        self.init_boxed = make_init(model.module, model.tx, config, rows=rows)
        root = jax.random.key_data(jax.random.key(self.team[0].seed))  # uint32 [2]
        self.abstract_one, self.shardings_one = mesh_lib.abstract_state(
            self.init_boxed, root, env.mesh, env.rules
        )
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_one.params))
        self.save_bytes = ckpt.save_bytes(self.abstract_one)

    @property
    def num(self) -> int:
        return len(self.team)

    def init_or_restore(self) -> None:
        """4. The newest step every live member restores (members that diverged before
        it are left out), or a new state; each member's data iterator."""
        from jattn import data as data_lib  # noqa: PLC0415

        env = self.env
        self.eval_sets = evaluation.load_eval_sets(
            env.task, data_lib.make_loader, self.config, env.eval_splits
        )

        def restore(i: int, step: int):
            it = iter(load.train_loader(env.task, self.configs[i]))
            return ckpt.restore(self.mngrs[i], step, self.abstract_one, it), it

        keys = [str(m.key) for m in self.team]
        with jax.set_mesh(env.mesh), nn.logical_axis_rules(env.rules):
            step, restored, diverged = recovery.restore_members(self.mngrs, keys, restore, warn)
            if step is not None:
                self.gone = {
                    m.key: diverged[k]
                    for m, k in zip(self.team, keys, strict=True)
                    if k in diverged
                }
                keep = sorted(restored)
                for i in set(range(self.num)) - set(keep):
                    self.mngrs[i].close()
                self.team, self.configs, self.mngrs = (
                    [xs[i] for i in keep] for xs in (self.team, self.configs, self.mngrs)
                )
                self._place([restored[i][0] for i in keep])
                self.iterators = [restored[i][1] for i in keep]
            else:
                if env.is_main:
                    for m in self.team:
                        recovery.archive_metrics(m.workdir, warn)
                self._place(None)
                self.iterators = [iter(load.train_loader(env.task, c)) for c in self.configs]
        self.start = step or 0

    def _place(self, states: list[Any] | None) -> None:
        """The program's state on device: one member's as it is, N members' stacked
        (restored `states`, or initialised from each member's seed when None)."""
        if self.num == 1:
            self.abstract, self.shardings, self.alive = self.abstract_one, self.shardings_one, None
            init = jax.jit(
                lambda r: nn.meta.unbox(self.init_boxed(r)), out_shardings=self.shardings
            )
            root = jax.random.key_data(jax.random.key(self.team[0].seed))
            self.state = states[0] if states else init(root)
            return
        axis = self.config.seed_mesh_axis or None
        self.abstract, self.shardings = members_lib.stacked_abstract(
            self.abstract_one, self.shardings_one, self.num, axis
        )
        member_sharding = NamedSharding(self.mesh, P(axis))
        self.alive = jax.device_put(np.ones(self.num, bool), member_sharding)
        if states:
            stack = lambda *xs: jax.tree.map(lambda *ls: jnp.stack(ls), *xs)  # noqa: E731
            self.state = jax.jit(stack, out_shardings=self.shardings)(*states)
            return
        roots = np.stack([jax.random.key_data(jax.random.key(m.seed)) for m in self.team])
        init = jax.jit(
            jax.vmap(lambda r: nn.meta.unbox(self.init_boxed(r))), out_shardings=self.shardings
        )
        self.state = init(jax.device_put(roots, member_sharding))  # [N, 2] keys

    def compile(self) -> None:
        """5. The train step (`members.compile_steps`), eval and decode."""
        config = self.configs[0] if self.num == 1 else self.config
        model = self.model
        if self.num == 1:  # the member's own optimiser (its learning rate, its warmup)
            from jattn.train.optim import make_optimizer  # noqa: PLC0415

            tx, schedule = make_optimizer(config)
            model = dataclasses.replace(model, tx=tx, schedule=schedule)
        self.step_fn, self.eval_step, self.decode, batch_sharding = members_lib.compile_steps(
            model, config, self.mesh, self.rules, self.team, self.abstract, self.shardings
        )
        self.streams = members_lib.Streams(self.iterators, batch_sharding)
        eval_sharding = mesh_lib.batch_sharding(self.mesh)
        self.to_global = lambda b: mesh_lib.make_global_batch(
            b, eval_sharding, replicated_input=True
        )

    def open_metrics(self, wandb) -> None:
        """Every member's writer and loss sanity, one progress bar (whose tokens a
        second are every member's), the start-up summary."""
        config, is_main = self.config, self.env.is_main
        self.progress = Progress(
            config.num_train_steps,
            self.start,
            enabled=is_main and config.progress_bar,
            is_main=is_main,
            tokens_label="tok_s" if self.num == 1 else f"tok_s({self.num} seeds)",
        )
        labels = [m.label if members_lib.grouped(config) or self.num > 1 else "" for m in self.team]
        self.book = MemberMetrics(
            labels,
            [m.workdir for m in self.team],
            self.configs,
            start=self.start,
            metric_names=evaluation.metric_names(self.eval_sets),
            progress=self.progress,
            is_main=is_main,
        )
        if wandb is not None and is_main:
            run = wandb.init(
                project=config.wandb_project,
                name=os.path.basename(self.team[0].workdir),
                dir=self.team[0].workdir,
                config=config_to_dict(self.configs[0]),
            )
            self.book.writers[0].log_to_wandb(run)
        self.progress.write(self._summary())
        for key, msg in self.gone.items():
            self.progress.write(f"{key} diverged before this restart: {msg}")

    def _summary(self) -> str:
        where = self.team[0].workdir if self.num == 1 else self.workdir  # the run, or all
        summary = load.startup_summary(
            where, self.config, self.mesh, self.env.task, self.eval_sets, self.start,
            self.data_check,
        )  # fmt: skip
        if self.num == 1:
            return summary
        kind = members_lib.program_kind(self.config)
        return (
            summary
            + f"\n{members_lib.describe(self.team)} in one program ({kind}) -> "
            + ", ".join(os.path.relpath(m.workdir, self.workdir) for m in self.team)
            + "\n"
            + members_lib.memory_line(self.step_fn, self.abstract_one, self.num, kind)
        )

    # -- what the loop calls ---------------------------------------------------------

    def train_step(self, step: int) -> None:
        """Trains step `step` (the state holds `step - 1` steps) and hands its metrics on."""
        self.state, metrics, self.alive = self.step_fn(self.state, next(self.streams), self.alive)
        self.book.push(step, metrics, self.alive)  # fetches the previous step's

    def log(self, step: int) -> None:
        """Writes the interval's training rows and checks the losses' sanity."""
        self.book.log(step)

    def evaluate(self, step: int) -> list[str]:
        """Every live member's evaluation (one stacked eval and decode a batch when
        N > 1), written to its workdir; returns the log lines."""
        cache: dict[Any, Any] = {}

        def stacked(kind, array_or_batch):  # [N, ...] outputs of one batch, fetched once
            first = array_or_batch[0] if isinstance(array_or_batch, tuple) else array_or_batch
            key = (kind, id(first))  # a decode's (inputs, targets): keyed by the inputs
            if key not in cache:
                params = self.state.params
                if kind == "eval":
                    out = self.eval_step(params, self.to_global(array_or_batch))
                else:
                    inputs, targets = array_or_batch
                    batch = self.to_global({"inputs": inputs, "targets": targets})
                    out = self.decode(params, batch["inputs"], batch["targets"])
                cache[key] = jax.device_get(out)
            return cache[key]

        results = {}
        for i in self.book.live():
            if self.num == 1:
                params, eval_step, decode, to_global = (
                    self.state.params, self.eval_step, self.decode, self.to_global
                )  # fmt: skip
            else:
                params, to_global = None, lambda b: b
                eval_step = lambda _, b, i=i: members_lib.take(stacked("eval", b), i)  # noqa: E731
                decode = self.decode and (
                    lambda _, x, t, i=i: np.asarray(stacked("decode", (x, t))[i])
                )
            metrics, decodes = evaluation.evaluate(
                params, self.eval_sets, eval_step=eval_step, decode=decode, to_global=to_global,
                tokenizer=self.env.task.tokenizer, num_decode=self.config.eval_decode_examples,
            )  # fmt: skip
            if self.env.is_main:
                evaluation.write_decodes(self.team[i].workdir, step, decodes)
            self.book.writers[i].write(step, metrics)
            results[i] = metrics
        self.eval_metrics = results
        label = lambda i: f"{self.book.labels[i]}: " if self.book.labels[i] else ""  # noqa: E731
        return [label(i) + evaluation.format_eval(step, m) for i, m in results.items()]

    def save(self, step: int, evaluated: bool) -> None:
        """Starts every live member's save of `step` into its own workdir (with the
        evaluation just done when `evaluated`), each checked first
        (`filesystem.checked_save`)."""
        diverged = {str(self.team[i].key): msg for i, msg in self.book.diverged.items()}
        diverged |= {str(k): msg for k, msg in self.gone.items()}
        for i in self.book.live():
            saved = {
                **(self.eval_metrics.get(i, {}) if evaluated else {}),
                SANE_STEP_METRIC: step if self.book.sane(i) else -1,
            }
            state = self.state if self.num == 1 else members_lib.take(self.state, i)
            with filesystem.checked_save(self.mngrs[i], step, self.save_bytes):
                ckpt.save(
                    self.mngrs[i], step, state, self.streams.iterators[i], self.configs[i],
                    saved, self.vocab, diverged=diverged,
                )  # fmt: skip

    @property
    def sane(self) -> bool:
        """Whether every member's last logged loss was sane (`jattn.train.sanity`)."""
        return all(self.book.sane(i) for i in range(self.num))

    def insane_warnings(self, step: int, last_sane: int | None) -> list[str]:
        """Why the checkpoint of `step` is not sane (empty when it is)."""
        return self.book.insane_warnings(step, last_sane)

    def end_interval(self) -> None:
        """After an evaluation or a save: flush the metrics, restart the clocks."""
        self.book.end_interval()

    def drain(self) -> None:
        """Fetches the metrics of the step still in flight."""
        self.book.drain()

    def close(self) -> None:
        """Closes the metrics writers (the managers are closed by the loop)."""
        self.book.close()

    def finish(self, step: int, preempted: bool) -> dict[str, Any]:
        """7. Each live member's ``final_metrics.json`` (not when preempted) and the
        result; a diverged member raises `TrainingDivergedError` once the others are done."""
        finals = dict(self.finals)
        for i in self.book.live():
            finals[self.team[i].key] = self._finish_member(i, step, preempted)
        named = {self.team[i].key: msg for i, msg in self.book.diverged.items()} | self.gone
        if named and not preempted:
            raise TrainingDivergedError(
                "; ".join(named[k] for k in sorted(named, key=str))
                + ". The other seeds finished in "
                + ", ".join(self.team[i].workdir for i in self.book.live()),
                diverged=named,
            )
        return {"step": step, "preempted": preempted, "members": finals, "diverged": named}

    def _finish_member(self, i: int, step: int, preempted: bool) -> dict[str, Any]:
        """Member `i`'s ``final_metrics.json`` (not when preempted)."""
        workdir, loss = self.team[i].workdir, self.book.trackers[i].logged_loss
        result = {
            "step": step,
            "preempted": preempted,
            # train/loss: the last logging interval's mean, as metrics.jsonl, TensorBoard
            # and the progress bar show it (NaN when no step ran here).
            "train/loss": loss if math.isfinite(loss) else last_logged_loss(workdir),
            "train/steps_per_sec": self.book.trackers[i].steady_steps_per_sec,
            "num_params": int(self.num_params),
            **self.eval_metrics.get(i, {}),
            **producibility.metrics(self.data_check),
        }
        if workdir != self.workdir:  # a member of a program, not a plain run
            result["train/seeds_in_program"] = self.num
        if self.env.is_main and not preempted:
            return write_final_metrics(os.path.join(workdir, files.FINAL_METRICS), result)
        return {k: strict_json_value(v) for k, v in result.items()}
