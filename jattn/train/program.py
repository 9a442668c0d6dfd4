"""A single run as a program of the loop driver (`jattn.train.driver`).

`single_run(config, workdir, stack)` does stages 1-5 of a run and returns a
`SingleRun` for `drive` (stage 6, the loop), whose `finish` is stage 7:

1. check the config, build the mesh, load the data, build the model;
2. open the workdir's checkpoints and refuse an incompatible one;
3. derive the state's shardings from the model's logical axis names;
4. initialise the state, or restore it and the data iterator;
5. jit the train step (explicit shardings, donated state), eval and decode;
6. loop: step, log, evaluate, checkpoint, watch for SIGTERM (`driver.drive`);
7. final evaluation, `final_metrics.json`.

A workdir that already finished returns its saved final metrics instead.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import ml_collections
from flax import linen as nn

from jattn.data import producibility
from jattn.data.tokenizers import check_saved, vocab_hash
from jattn.train import checkpoints as ckpt
from jattn.train import data_checks, evaluation, recovery, setup
from jattn.train import mesh as mesh_lib
from jattn.train import workdir as files
from jattn.train.config import ConfigError, check_config, config_to_dict
from jattn.train.metrics import (
    MetricsWriter,
    Progress,
    TrainMetrics,
    logged_losses,
    strict_json_value,
    write_final_metrics,
)
from jattn.train.sanity import SANE_STEP_METRIC, LossSanity, insane_warning

__all__ = ["SingleRun", "single_run"]


def single_run(config: ml_collections.ConfigDict, workdir: str, stack) -> SingleRun | dict:
    """Stages 1-5 of a single run: a `SingleRun` ready for `drive`, or the saved final
    metrics of a workdir that already finished. `stack` holds the workdir's lock.

    Raises:
      ConfigError: bad config, mesh, batch size, data set or workdir (before compiling).
      WorkdirLockedError, WorkdirIOError: as `train_and_evaluate`.
    """
    # 1. Config, mesh, data, model. ----------------------------------------------------
    check_config(config)
    wandb = setup.import_wandb(config)
    workdir = os.path.abspath(workdir)
    env = setup.environment(config)
    data_check = producibility.check(env.task, env.eval_splits)
    model = setup.build_model(config, env.task)

    # 2. Checkpoints: an incompatible workdir is an error, and is left untouched. ------
    vocab = vocab_hash(env.task.tokenizer)
    setup.open_workdir(stack, workdir, os.path.join(workdir, ckpt.CHECKPOINT_DIR))
    mngr = ckpt.make_manager(workdir, config)
    latest = ckpt.check_compatible(mngr, workdir, config, vocab)
    data_checks.check_row_lengths(config, env.task, setup.warn)  # a resume's diffs say more
    if latest is not None:
        try:
            check_saved(workdir, env.task.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    done = None
    if latest == config.num_train_steps:  # every step saved: finished if its metrics are
        done = files.finished_metrics(workdir, config.num_train_steps)
    if done is not None:
        mngr.close()
        return done
    if env.is_main:
        files.write_run_files(workdir, config, model.config, env.task.tokenizer, data_check)
    run = SingleRun(config, workdir, env, model, mngr, vocab, data_check)
    run.init_or_restore(latest)
    run.compile()
    run.open_metrics(wandb)
    return run


class SingleRun:
    """One run's state, compiled steps and bookkeeping, stepped by `driver.drive`."""

    def __init__(self, config, workdir: str, env: setup.Environment, model, mngr, vocab, check):
        self.config, self.workdir, self.env, self.model = config, workdir, env, model
        self.mesh, self.rules, self.mngr = env.mesh, env.rules, mngr
        self.vocab, self.data_check = vocab, check
        self.eval_metrics: dict[str, float] = {}
        self.loss_sane = True
        # 3. Abstract state and shardings from the logical axis names. -----------------
        rows = env.mesh.shape["data"] * env.mesh.shape["fsdp"]
        self.init_boxed = setup.make_init(model.module, model.tx, config, rows=rows)
        self.root = jax.random.key_data(jax.random.key(config.seed))  # uint32 [2]
        self.abstract, self.shardings = setup.abstract_state(
            self.init_boxed, self.root, env.mesh, env.rules
        )
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract.params))
        self.save_bytes = setup.save_bytes(self.abstract)

    def init_or_restore(self, latest: int | None) -> None:
        """4. Data iterators; the newest step that restores and verifies, or a new state."""
        from jattn import data as data_lib  # noqa: PLC0415

        config, env, mngr = self.config, self.env, self.mngr
        self.train_iter = iter(setup.train_loader(env.task, config))
        self.eval_sets = evaluation.load_eval_sets(
            env.task, data_lib.make_loader, config, env.eval_splits
        )
        with jax.set_mesh(env.mesh), nn.logical_axis_rules(env.rules):
            state = None
            if latest is not None:
                state, self.train_iter, latest = recovery.restore_newest(
                    mngr,
                    lambda step, it: ckpt.restore(mngr, step, self.abstract, it),
                    lambda: iter(setup.train_loader(env.task, config)),
                    setup.warn,
                )
            if state is None:
                if env.is_main:
                    recovery.archive_metrics(self.workdir, setup.warn)
                init = jax.jit(
                    lambda r: nn.meta.unbox(self.init_boxed(r)), out_shardings=self.shardings
                )
                state = init(self.root)
        self.state = state
        self.start = int(jax.device_get(state.step))

    def compile(self) -> None:
        """5. Compiled functions: explicit shardings, the state donated."""
        m = self.model
        self.step_fn, self.eval_step, self.decode = setup.compile_steps(
            m.module, m.tx, m.schedule, self.config, self.mesh, self.shardings
        )
        self.batch_sharding = mesh_lib.batch_sharding(self.mesh)
        self.to_global = functools.partial(
            mesh_lib.make_global_batch, sharding=self.batch_sharding, replicated_input=True
        )

    def open_metrics(self, wandb) -> None:
        """The writer, the progress bar, loss sanity and the start-up summary."""
        config, workdir, is_main = self.config, self.workdir, self.env.is_main
        self.writer = MetricsWriter(workdir, enabled=is_main, resume_step=self.start)
        self.progress = Progress(
            config.num_train_steps,
            self.start,
            enabled=is_main and config.progress_bar,
            is_main=is_main,
        )
        self.train_metrics = TrainMetrics(self.writer, self.progress)
        self.writer.hparams(setup.flat_hparams(config), setup.metric_names(self.eval_sets))
        if wandb is not None and is_main:
            run = wandb.init(
                project=config.wandb_project,
                name=os.path.basename(workdir),
                dir=workdir,
                config=config_to_dict(config),
            )
            self.writer.log_to_wandb(run)
        self.progress.write(
            setup.startup_summary(
                workdir,
                config,
                self.mesh,
                self.num_params,
                self.env.task,
                self.eval_sets,
                self.start,
                self.data_check,
            )
        )
        self.sanity = LossSanity(logged_losses(workdir))

    # -- the driver's protocol (`jattn.train.driver.Program`) --------------------------

    def train_step(self, step: int) -> None:
        batch = mesh_lib.make_global_batch(next(self.train_iter), self.batch_sharding)
        self.state, device_metrics = self.step_fn(self.state, batch)
        self.train_metrics.push(step, device_metrics)  # fetches the previous step's

    def log(self, step: int) -> None:
        self.train_metrics.log(step)
        self.loss_sane = self.sanity.observe(self.train_metrics.logged_loss)

    def evaluate(self, step: int) -> list[str]:
        metrics, decodes = evaluation.evaluate(
            self.state.params,
            self.eval_sets,
            eval_step=self.eval_step,
            decode=self.decode,
            to_global=self.to_global,
            tokenizer=self.env.task.tokenizer,
            num_decode=self.config.eval_decode_examples,
        )
        if self.env.is_main:
            evaluation.write_decodes(self.workdir, step, decodes)
        self.writer.write(step, metrics)
        self.eval_metrics = metrics
        return [setup.format_eval(step, metrics)]

    def save(self, step: int, evaluated: bool) -> None:
        saved_metrics = {
            **(self.eval_metrics if evaluated else {}),
            SANE_STEP_METRIC: step if self.loss_sane else -1,
        }
        ckpt.save(
            self.mngr, step, self.state, self.train_iter, self.config, saved_metrics, self.vocab
        )

    @property
    def sane(self) -> bool:
        return self.loss_sane

    def insane_warnings(self, step: int, last_sane: int | None) -> list[str]:
        if self.loss_sane:
            return []
        return [insane_warning(step, self.train_metrics.logged_loss, self.sanity, last_sane)]

    def end_interval(self) -> None:
        self.writer.flush()
        self.train_metrics.restart_clock()

    def drain(self) -> None:
        self.train_metrics.fetch()

    def close(self) -> None:
        self.writer.close()

    def finish(self, step: int, preempted: bool) -> dict[str, Any]:
        """7. ``final_metrics.json`` (not when preempted), and the result."""
        # train/loss: the mean over the last logging interval, as metrics.jsonl,
        # TensorBoard and the progress bar show it (NaN when no step ran here).
        last_loss = self.train_metrics.logged_loss
        result = {
            "step": step,
            "preempted": preempted,
            "train/loss": (
                last_loss if math.isfinite(last_loss) else setup.last_logged_loss(self.workdir)
            ),
            "train/steps_per_sec": self.train_metrics.steady_steps_per_sec,
            "num_params": int(self.num_params),
            **self.eval_metrics,
            **producibility.metrics(self.data_check),
        }
        if self.env.is_main and not preempted:
            path = os.path.join(self.workdir, files.FINAL_METRICS)
            return write_final_metrics(path, result)
        return {k: strict_json_value(v) for k, v in result.items()}
