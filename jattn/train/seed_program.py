"""Every seed of `config.seeds` as one jitted program of the loop driver.

With `config.sweep_learning_rate` / `sweep_warmup_steps` the program's members
are every (swept values, seed) combination (`jattn.train.members`), each the
single run with those values; "seed" below reads "member" then.

`seed_program(...)` does a single run's stages 1-5 (`jattn.train.program`)
with a seed axis `S` in front of every array, and returns a `SeedProgram` for
`jattn.train.driver.drive`:

1. check the config, build the mesh, load the data, build the model once;
2. every seed's workdir (``WORKDIR/seed-<s>/`` by default) gets what a single
   run's gets: `config.json` (with ``seed=s``), `model_config.json`, the
   tokenizer, `data_check.json`, then `metrics.jsonl`, `tb/`, `decodes/`,
   `final_metrics.json` and, at the end, its own checkpoint;
3. the stacked state `[S, ...]` is initialised by vmapping a single run's
   init over the seeds' root keys, or restored with every seed's data iterator
   from ``WORKDIR/checkpoints/`` (`jattn.train.seeds.save_stacked`): the
   newest step that restores and verifies, damaged ones set aside
   (`jattn.train.recovery`);
4. the train step is the single run's step over the seed axis: `jax.vmap`
   (batched; fills an accelerator) or `lax.map` (each seed's own computation
   inside the one program; bit for bit a single run's numbers), chosen by
   `config.seed_program` (`jattn.train.seeds.program_kind`: "auto" is map on
   the CPU); a seed whose loss turns NaN or Inf keeps its last good state (a
   select on device) and stops being logged, and the others go on;
5. evaluation and decoding go over the seed axis the same way, and each
   seed's metrics and decodes are written to its own workdir
   (`jattn.train.seed_metrics`).

The single run's protections apply (docs/reliability.md, "Seeds in one
program"): the write checks, the workdir lock, the data checks, the checks
around each save, sane-loss retention and SIGTERM at every stage.

A seed of this program sees exactly the batches and random numbers of the
single run with that seed: under map its losses are the single run's; under
vmap they agree up to the rounding of batched matmuls, which training
amplifies over hundreds of steps (see `tests/test_train_seeds.py`).
"""

from __future__ import annotations

import dataclasses
import functools
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
from jattn.data.tokenizers import vocab_hash
from jattn.train import checkpoints as ckpt
from jattn.train import data_checks, evaluation, filesystem, recovery, setup, steps
from jattn.train import members as members_lib
from jattn.train import mesh as mesh_lib
from jattn.train import seeds as seeds_lib
from jattn.train import workdir as files
from jattn.train.config import ConfigError, check_config
from jattn.train.driver import TrainingDivergedError
from jattn.train.metrics import Progress, strict_json_value, write_final_metrics
from jattn.train.sanity import SANE_STEP_METRIC
from jattn.train.seed_metrics import SeedMetrics, finished_members

__all__ = ["SeedProgram", "seed_program"]


@dataclasses.dataclass
class Roster:
    """The program's members, in order, and what belongs to each.

    Attributes:
      members: the `jattn.train.members.Member` of each position.
      dirs: each member's run directory.
      configs: each member's single-run config (`members.member_config`).
    """

    members: list[members_lib.Member]
    dirs: list[str]
    configs: list[ml_collections.ConfigDict]

    @property
    def keys(self) -> list[Any]:
        """How results and the stacked checkpoint name the members (`Member.key`)."""
        return [m.key for m in self.members]

    def only(self, positions: Sequence[int]) -> Roster:
        """The members at `positions`."""
        pick = list(positions)
        return Roster(
            [self.members[i] for i in pick],
            [self.dirs[i] for i in pick],
            [self.configs[i] for i in pick],
        )


def roster(config, workdir: str, seed_dirs, members) -> Roster:
    """The members `train_seeds` was asked for, their directories and configs."""
    program = list(members) if members is not None else members_lib.members(config)
    dirs = seed_dirs or members_lib.member_workdirs(workdir, program)
    dirs = [os.path.abspath(d) for d in dirs]
    if len(dirs) != len(program):
        raise ConfigError(f"{len(program)} members but {len(dirs)} workdirs")
    return Roster(program, dirs, [members_lib.member_config(config, m) for m in program])


def seed_program(
    config: ml_collections.ConfigDict,
    workdir: str,
    seed_dirs: list[str] | None,
    members: Sequence[members_lib.Member] | None,
    raise_on_divergence: bool,
    stack,
) -> SeedProgram | dict[str, Any]:
    """Stages 1-5 of a seed program: a `SeedProgram` ready for `drive`, or the result
    of a program that already finished (`train_seeds`'s arguments; `stack` holds the
    workdir's lock)."""
    # 1. Config, mesh, data, model. ----------------------------------------------------
    check_config(config)
    config = config.copy_and_resolve_references()  # `seeds` may shrink below; not the caller's
    blockers = seeds_lib.vmap_blockers(config)
    if blockers:
        raise ConfigError(
            "config.seeds: these seeds cannot train in one program: " + "; ".join(blockers)
        )
    workdir = os.path.abspath(workdir)
    everyone = roster(config, workdir, seed_dirs, members)
    env = setup.environment(config)

    # 2. Checkpoints: writable, one writer, damaged steps set aside before orbax opens
    # them; seeds already finished (e.g. by single runs) are left out of the program.
    setup.open_workdir(stack, workdir, os.path.join(workdir, ckpt.CHECKPOINT_DIR), *everyone.dirs)
    resumed = _resume(config, workdir, everyone)
    if isinstance(resumed, dict):
        return resumed
    mngr, latest, meta, todo, done_finals = resumed
    if meta is not None:
        seeds_lib.check_stacked_compatible(meta, config, todo.keys, f"workdir {workdir!r}")
    data_checks.check_row_lengths(config, env.task, setup.warn)  # a resume's diffs say more

    data_check = producibility.check(env.task, env.eval_splits)
    vocab = vocab_hash(env.task.tokenizer)  # recorded in each member's own checkpoint
    model = setup.build_model(config, env.task)
    if env.is_main:
        for d, c in zip(todo.dirs, todo.configs, strict=True):
            files.write_run_files(d, c, model.config, env.task.tokenizer, data_check)
    program = SeedProgram(config, workdir, env, model, todo, mngr, vocab, data_check)
    program.raise_on_divergence, program.done_finals = raise_on_divergence, done_finals
    program.init_or_restore(latest)
    program.compile()
    program.open_metrics()
    return program


def _resume(config, workdir: str, everyone: Roster):
    """The group's manager and what is left to train, or the finished program's result.

    Returns:
      ``(mngr, latest step, its meta, the members to train, finals by key of those
      already finished)``, or the result dict of a program with nothing left.
    """
    done = finished_members(everyone.dirs, everyone.configs)
    keys = everyone.keys
    done_finals = {keys[i]: f for i, f in done.items()}  # by key: positions shift below
    group_config = config.copy_and_resolve_references()
    with group_config.unlocked():
        group_config.best_metric = ""  # the best step of one seed is not the group's
    mngr = ckpt.make_manager(workdir, group_config)
    latest = mngr.latest_step()
    meta = ckpt.saved_meta(mngr, latest) if latest is not None else None
    saved_keys = (meta or {}).get("signature", {}).get("seeds", [])
    gone = {saved_keys[int(k)]: v for k, v in (meta or {}).get("diverged", {}).items()}
    finished = {"step": config.num_train_steps, "preempted": False, "seeds": done_finals}
    # Finished: the last step saved and every member's final_metrics.json written (or
    # the member diverged). A stop while the members' final files were being written
    # resumes at the last step: no training, the final evaluation and files again.
    if (
        meta is not None
        and meta.get("step") == config.num_train_steps
        and all(i in done or k in gone for i, k in enumerate(keys))
    ):
        mngr.close()  # the program finished: what each seed wrote is its result
        seeds_lib.check_stacked_compatible(meta, config, saved_keys, f"workdir {workdir!r}")
        return {**finished, "diverged": gone}
    todo = [i for i in range(len(keys)) if i not in done]
    if not todo:
        mngr.close()
        return {**finished, "diverged": {}}
    if len(todo) < len(keys) and latest is None:
        return mngr, latest, meta, everyone.only(todo), done_finals
    return mngr, latest, meta, everyone, done_finals


class SeedProgram:
    """The stacked state of every member, its compiled steps and `SeedMetrics`,
    stepped by `driver.drive`."""

    def __init__(
        self, config, workdir, env: setup.Environment, model, todo: Roster, mngr, vocab, check
    ):
        self.config, self.workdir, self.env, self.model = config, workdir, env, model
        self.mesh, self.rules, self.mngr = env.mesh, env.rules, mngr
        self.roster, self.vocab, self.data_check = todo, vocab, check
        self.keys, self.dirs = todo.keys, todo.dirs
        self.labels = [m.label for m in todo.members]
        self.num = len(todo.members)
        self.axis = config.seed_mesh_axis or None
        self.eval_metrics: dict[int, dict[str, float]] = {}
        self.raise_on_divergence, self.done_finals = True, {}
        # 3. The stacked state's shapes and shardings: one run's, with a seed axis in front.
        rows = env.mesh.shape["data"] * env.mesh.shape["fsdp"]
        self.init_boxed = setup.make_init(model.module, model.tx, config, rows=rows)
        seeds = [m.seed for m in todo.members]
        self.roots = np.stack([jax.random.key_data(jax.random.key(s)) for s in seeds])  # [S, 2]
        self.abstract_one, shardings_one = setup.abstract_state(
            self.init_boxed, self.roots[0], env.mesh, env.rules
        )
        self.abstract, self.shardings = seeds_lib.stacked_abstract(
            self.abstract_one, shardings_one, self.num, self.axis
        )
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_one.params))
        self.seed_sharding = NamedSharding(env.mesh, P(self.axis))
        self.save_bytes = setup.save_bytes(self.abstract)

    def _new_streams(self) -> seeds_lib.SeedStreams:
        task = self.env.task
        return seeds_lib.SeedStreams(
            [iter(setup.train_loader(task, c)) for c in self.roster.configs]
        )

    def init_or_restore(self, latest: int | None) -> None:
        """4. Data streams; the newest step that restores and verifies, or a new state."""
        from jattn import data as data_lib  # noqa: PLC0415

        env, mngr = self.env, self.mngr
        self.eval_sets = evaluation.load_eval_sets(
            env.task, data_lib.make_loader, self.config, env.eval_splits
        )
        self.diverged: dict[int, str] = {}
        restored, streams = None, None
        with jax.set_mesh(env.mesh), nn.logical_axis_rules(env.rules):
            if latest is not None:
                target = {
                    "state": self.abstract,
                    "alive": jax.ShapeDtypeStruct(
                        (self.num,), jnp.bool_, sharding=self.seed_sharding
                    ),
                }
                restored, streams, latest = recovery.restore_newest(
                    mngr,
                    lambda step, s: seeds_lib.restore_stacked(mngr, step, target, s),
                    self._new_streams,
                    setup.warn,
                    # (state, alive, meta): every seed still training at the step, all finite
                    verify=lambda r, step: recovery.verify_state(r[0], step, live=r[1]),
                )
            if restored is not None:
                self.state, self.alive, saved = restored
                self.diverged = {int(k): v for k, v in saved.get("diverged", {}).items()}
                self.start = int(saved["step"])
            else:
                if env.is_main:
                    for d in self.dirs:
                        recovery.archive_metrics(d, setup.warn)
                streams = streams or self._new_streams()
                init = jax.jit(
                    jax.vmap(lambda r: nn.meta.unbox(self.init_boxed(r))),
                    out_shardings=self.shardings,
                )
                self.state = init(jax.device_put(self.roots, self.seed_sharding))
                self.alive = jax.device_put(np.ones(self.num, bool), self.seed_sharding)
                self.start = 0
        self.streams = streams

    def compile(self) -> None:
        """5. The train step over the seed axis (compiled ahead), eval and decode."""
        config, mesh, model = self.config, self.mesh, self.model
        replicated = NamedSharding(mesh, P())
        self.batch_sharding = seeds_lib.seed_batch_sharding(mesh, self.axis)
        rows_spec = P(None, tuple(a for a in ("data", "fsdp") if a != self.axis), None)
        self.kind = kind = seeds_lib.program_kind(config)
        step_fn = seeds_lib.seed_train_step(
            model.module,
            model.tx,
            model.schedule,
            config,
            mesh,
            [m.seed for m in self.roster.members],
            rows_spec,
            kind,
            hparams=members_lib.hparam_arrays(self.roster.members),
        )
        abstract_batch = {
            k: jax.ShapeDtypeStruct(
                (self.num, config.batch_size, n), jnp.int32, sharding=self.batch_sharding
            )
            for k, n in seeds_lib.batch_lengths(config).items()
        }
        with jax.set_mesh(mesh), nn.logical_axis_rules(self.rules):
            self.step_fn = (
                jax.jit(
                    step_fn,
                    in_shardings=(self.shardings, self.batch_sharding, self.seed_sharding),
                    out_shardings=(self.shardings, replicated, self.seed_sharding),
                    donate_argnums=(0,),
                )
                .lower(self.abstract, abstract_batch, jax.ShapeDtypeStruct((self.num,), jnp.bool_))
                .compile()
            )
        eval_batch_sharding = mesh_lib.batch_sharding(mesh)
        self.eval_step = jax.jit(
            seeds_lib.over_seeds(steps.make_eval_step(model.module), kind, num_shared=1),
            in_shardings=(self.shardings.params, eval_batch_sharding),
            out_shardings=replicated,
        )
        decode_one = setup.decode_fn(model.module, config)
        self.decode = decode_one and jax.jit(
            seeds_lib.over_seeds(decode_one, kind, num_shared=1),
            in_shardings=(self.shardings.params, eval_batch_sharding),
            out_shardings=replicated,
        )
        self.to_global = functools.partial(
            mesh_lib.make_global_batch, sharding=eval_batch_sharding, replicated_input=True
        )

    def open_metrics(self) -> None:
        """Per-seed writers and loss sanity; one progress bar for the program, whose
        tokens a second are every seed's; the start-up summary."""
        config, is_main, workdir = self.config, self.env.is_main, self.workdir
        self.progress = Progress(
            config.num_train_steps,
            self.start,
            enabled=is_main and config.progress_bar,
            is_main=is_main,
            tokens_label=f"tok_s({self.num} seeds)",
        )
        self.book = SeedMetrics(
            self.labels,
            self.dirs,
            self.roster.configs,
            start=self.start,
            metric_names=setup.metric_names(self.eval_sets),
            progress=self.progress,
            diverged=self.diverged,
            is_main=is_main,
        )
        summary = setup.startup_summary(
            workdir,
            config,
            self.mesh,
            self.num_params,
            self.env.task,
            self.eval_sets,
            self.start,
            self.data_check,
        )
        self.progress.write(
            summary
            + f"\n{members_lib.describe(self.roster.members)} in one program ({self.kind}) -> "
            + ", ".join(os.path.relpath(d, workdir) for d in self.dirs)
            + "\n"
            + seeds_lib.memory_line(self.step_fn, self.abstract_one, self.num, self.kind)
        )
        for i, msg in self.diverged.items():
            self.progress.write(f"{self.labels[i]} diverged before this restart: {msg}")

    # -- the driver's protocol (`jattn.train.driver.Program`) --------------------------

    def train_step(self, step: int) -> None:
        batch = {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in next(self.streams).items()
        }
        self.state, device_metrics, self.alive = self.step_fn(self.state, batch, self.alive)
        self.book.push(step, device_metrics, self.alive)  # fetches the previous step's

    def log(self, step: int) -> None:
        self.book.log(step)

    def evaluate(self, step: int) -> list[str]:
        """Every live seed's evaluation, from one stacked eval (and decode) a batch."""
        params, cache = self.state.params, {}

        def stacked(kind, array_or_batch):
            key = (kind, id(array_or_batch))
            if key not in cache:
                if kind == "eval":
                    out = self.eval_step(params, self.to_global(array_or_batch))
                else:
                    out = self.decode(params, self.to_global({"inputs": array_or_batch})["inputs"])
                cache[key] = jax.device_get(out)
            return cache[key]

        results = {}
        for i in self.book.live():
            metrics, decodes = evaluation.evaluate(
                None,
                self.eval_sets,
                eval_step=lambda _, b, i=i: seeds_lib.take(stacked("eval", b), i),
                decode=self.decode and (lambda _, x, i=i: np.asarray(stacked("decode", x)[i])),
                to_global=lambda b: b,
                tokenizer=self.env.task.tokenizer,
                num_decode=self.config.eval_decode_examples,
            )
            if self.env.is_main:
                evaluation.write_decodes(self.dirs[i], step, decodes)
            self.book.writers[i].write(step, metrics)
            results[i] = metrics
        self.eval_metrics = results
        return [f"{self.labels[i]}: " + setup.format_eval(step, m) for i, m in results.items()]

    def save(self, step: int, evaluated: bool) -> None:
        seeds_lib.save_stacked(
            self.mngr,
            step,
            self.state,
            self.alive,
            self.streams,
            self.config,
            self.keys,
            self.book.named_diverged(),
            {SANE_STEP_METRIC: step if self.book.sane else -1},
        )

    @property
    def sane(self) -> bool:
        return self.book.sane

    def insane_warnings(self, step: int, last_sane: int | None) -> list[str]:
        return self.book.insane_warnings(step, last_sane)

    def end_interval(self) -> None:
        self.book.end_interval()

    def drain(self) -> None:
        self.book.drain()

    def close(self) -> None:
        self.book.close()

    def finish(self, step: int, preempted: bool) -> dict[str, Any]:
        """7. Each finished seed: its own checkpoint and final_metrics.json, as a single
        run; a diverged seed raises `TrainingDivergedError` (`raise_on_divergence`)."""
        finals: dict[Any, dict[str, Any]] = dict(self.done_finals)
        for i in self.book.live():
            if self.keys[i] in self.done_finals:  # finished before this rerun
                continue
            finals[self.keys[i]] = self._finish_member(i, step, preempted)
        named = {self.keys[i]: msg for i, msg in self.book.diverged.items()}
        if named and self.raise_on_divergence and not preempted:
            raise TrainingDivergedError(
                "; ".join(named[s] for s in sorted(named))
                + ". The other seeds finished in "
                + ", ".join(self.dirs[i] for i in self.book.live())
            )
        return {"step": step, "preempted": preempted, "seeds": finals, "diverged": named}

    def _finish_member(self, i: int, step: int, preempted: bool) -> dict[str, Any]:
        """Member `i`'s checkpoint and ``final_metrics.json`` (not when preempted)."""
        tracker, eval_metrics = self.book.trackers[i], self.eval_metrics.get(i, {})
        loss = tracker.logged_loss
        result = {
            "step": step,
            "preempted": preempted,
            "train/loss": loss if math.isfinite(loss) else setup.last_logged_loss(self.dirs[i]),
            "train/steps_per_sec": tracker.steady_steps_per_sec,
            "train/seeds_in_program": self.num,
            "num_params": int(self.num_params),
            **eval_metrics,
            **producibility.metrics(self.data_check),
        }
        if not self.env.is_main or preempted:
            return {k: strict_json_value(v) for k, v in result.items()}
        config = self.roster.configs[i]
        seed_mngr = ckpt.make_manager(self.dirs[i], config)
        sane = i not in self.book.insane
        saved = {**eval_metrics, SANE_STEP_METRIC: step if sane else -1}
        with filesystem.checked_save(seed_mngr, step, setup.save_bytes(self.abstract_one)):
            one = seeds_lib.take(self.state, i)
            it = self.streams.iterators[i]
            ckpt.save(seed_mngr, step, one, it, config, saved, self.vocab)
        filesystem.wait_for_saves(seed_mngr)
        seed_mngr.close()
        return write_final_metrics(os.path.join(self.dirs[i], files.FINAL_METRICS), result)
