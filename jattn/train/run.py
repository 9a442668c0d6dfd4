"""`train_and_evaluate(config, workdir)`: one run, one seed, one process.

Every run does seven stages, the first five here, the loop in
`jattn.train.loop`:

1. check the config and read it, once, into the pieces each part of the run
   takes (`jattn.train.config.read_parts`: the model's, the optimiser's, the
   data's, the checkpoints', ...; no module below reads the config itself);
   check against the workdir's checkpoint (if any) what needs no data; build
   the mesh, load the data, build the model (`jattn.train.load`:
   `Environment` and `Model`);
2. open the workdir and its checkpoints, refuse an incompatible one (or a
   workdir an earlier jattn laid out for several seeds), return the saved
   result of a finished run;
3. derive the state's shardings from the model's logical axis names;
4. initialise the state, or restore the newest step that restores and
   verifies (`jattn.train.recovery.restore_newest`) with its data iterator;
5. jit the train step, eval and decode (`jattn.train.steps.jit_steps`);
6. loop: step, log, evaluate, checkpoint, watch for SIGTERM (`jattn.train.loop`);
7. the final evaluation and `final_metrics.json` (`Run.finish`).

Several seeds are several runs, each its own process: a grid with a seed
axis (`jattn ablate --jobs N`, `jattn.analysis.runner`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import time
from typing import Any

import jax
import ml_collections
from flax import linen as nn

from jattn.data import producibility
from jattn.data.tokenizers import check_saved, vocab_hash
from jattn.train import checkpoints as ckpt
from jattn.train import checks, evaluation, filesystem, load, recovery
from jattn.train import mesh as mesh_lib
from jattn.train import workdir as workdir_lib
from jattn.train.config import ConfigError, check_config, read_parts
from jattn.train.distributed import PreemptionWatch, warn
from jattn.train.load import Environment, Model, build_model, environment, import_wandb
from jattn.train.loop import TrainingDivergedError, drive
from jattn.train.metrics import (
    MetricsWriter,
    Progress,
    TrainMetrics,
    flat_hparams,
    last_logged_loss,
    logged_losses,
    strict_json_value,
    write_final_metrics,
)
from jattn.train.parts import Parts
from jattn.train.sanity import SANE_STEP_METRIC, LossSanity, insane_warning
from jattn.train.steps import jit_steps, make_init
from jattn.train.workdir import WorkdirLock

__all__ = ["SEED_PROGRAM_RELEASE", "Run", "TrainingDivergedError", "train_and_evaluate"]

# Where a workdir of several seeds trained in one program is finished: the last
# jattn that had them (`jattn.train.members`, removed after it).
SEED_PROGRAM_RELEASE = (
    "finish it with the jattn release that started it (the last commit with "
    "jattn/train/members.py: git checkout $(git log -1 --format=%h --diff-filter=D -- "
    "jattn/train/members.py)~1), or train each seed as its own run into a new --workdir"
)

# A member's workdir inside a seed program's: ``seed-0``, ``learning_rate-0.001_seed-0``.
_MEMBER_DIR = re.compile(r"^(.+_)?seed-\d+$")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) one run and returns its final metrics.

    Args:
      config: a full config (`jattn.train.config.default_config`).
      workdir: the run directory: holds `checkpoints/`, `metrics.jsonl`, `tb/`,
        `config.json`, `model_config.json`, the tokenizer, `decodes/` and, once
        done, `final_metrics.json` (`jattn.train.workdir`).

    Returns:
      ``{"step", "preempted", "train/loss", "eval/<split>/<metric>", ...,
      "num_params", "train/steps_per_sec"}``, as written to `final_metrics.json`
      (strict JSON); ``train/loss`` is the last logging interval's mean. A
      finished run returns its saved final metrics without training again.

    Raises:
      ConfigError: bad config, mesh, batch size, data set (damaged data included),
        workdir, or a workdir of several seeds in one program (an earlier jattn's).
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
        check_config(config)
        parts = read_parts(config)  # the one reading of the config
        stack.enter_context(parts.devices.precision())  # the steps are traced under it
        run = _open(parts, os.path.abspath(workdir), stack)
        return run if isinstance(run, dict) else drive(run, watch)


# -- 1.-2. config, data, model, workdir and checkpoints ----------------------------------


def refuse_seed_program(workdir: str) -> None:
    """A workdir in which an earlier jattn trained several seeds in one program
    (``WORKDIR/seed-0/``, ...) is refused in one line naming the release that
    finishes it.

    Raises:
      ConfigError: `workdir` holds a member's run directory (its config or its
        checkpoints; the older stacked layout kept the checkpoints in `workdir`).
    """
    if not os.path.isdir(workdir):
        return
    found = sorted(
        name
        for name in os.listdir(workdir)
        if _MEMBER_DIR.match(name)
        and any(
            os.path.exists(os.path.join(workdir, name, part))
            for part in (workdir_lib.CONFIG, ckpt.CHECKPOINT_DIR)
        )
    )
    if found:
        raise ConfigError(
            f"{workdir} holds several seeds trained in one program by an earlier jattn "
            f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): "
            f"{SEED_PROGRAM_RELEASE}"
        )


def open_workdir(stack, workdir: str) -> None:
    """Process 0's protections at start: the workdir and its checkpoints writable,
    locked (held by `stack`), damaged checkpoint steps set aside before orbax opens them."""
    if jax.process_index() != 0:
        return
    checkpoints = os.path.join(workdir, ckpt.CHECKPOINT_DIR)
    filesystem.check_writable(workdir, checkpoints)
    lock = stack.enter_context(WorkdirLock(workdir))
    if lock.previous:
        pid = lock.previous.get("pid")
        warn(f"warning: took over the lock of {workdir} left by pid {pid}, which died")
    recovery.set_aside_incomplete(checkpoints, warn)


def _open_checkpoints(env, workdir: str, parts: Parts, vocab) -> tuple[Any, int | None]:
    """The run's checkpoint manager and latest step, compatible with its config."""
    mngr = ckpt.make_manager(workdir, parts.checkpoints)
    latest = ckpt.check_compatible(mngr, workdir, parts.checkpoints, vocab)
    checks.check_row_lengths(parts.data, env.task, warn)  # a resume's diffs say more
    if latest is not None:
        try:
            check_saved(workdir, env.task.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return mngr, latest


def _open(parts: Parts, workdir: str, stack) -> Run | dict[str, Any]:
    """Stages 1-5: a `Run` ready for `drive`, or the saved result of a finished one."""
    wandb = import_wandb(parts.loop)
    # What needs no data is refused before the data set is prepared (minutes for a large one).
    refuse_seed_program(workdir)
    ckpt.check_saved_config(workdir, parts.checkpoints)
    env = environment(parts)
    data_check = producibility.check(env.task, env.eval_splits)
    model = build_model(parts, env.task)

    open_workdir(stack, workdir)
    vocab = vocab_hash(env.task.tokenizer)
    mngr, latest = _open_checkpoints(env, workdir, parts, vocab)
    steps = parts.loop.num_train_steps
    done = workdir_lib.finished_metrics(workdir, steps)
    if latest == steps and done is not None:
        mngr.close()
        return done
    if env.is_main:
        tokenizer = env.task.tokenizer
        workdir_lib.write_run_files(workdir, parts.record, model.config, tokenizer, data_check)
    run = Run(parts, workdir, env, model, mngr)
    run.vocab, run.data_check = vocab, data_check
    run.init_or_restore()
    run.compile()
    run.open_metrics(wandb)
    return run


# -- 3.-7. the run -----------------------------------------------------------------------


class Run:
    """The state of one run, its jitted steps and bookkeeping, stepped by
    `jattn.train.loop.drive`.

    Attributes read by the loop: `loop` (the config's `LoopPart`: how long, how
    often), `workdir` (named in a failed write's error), `mesh`, `rules`, `mngr`
    (the run's checkpoint manager), `progress`, `start` (0, or the restored step).
    """

    def __init__(self, parts: Parts, workdir: str, env: Environment, model: Model, mngr):
        self.parts, self.workdir, self.env, self.model = parts, workdir, env, model
        self.loop = parts.loop
        self.mesh, self.rules = env.mesh, env.rules
        self.mngr = mngr
        self.vocab, self.data_check = None, {}
        self.eval_metrics: dict[str, float] = {}
        # 3. The abstract state and its shardings, from the logical axis names.
        rows = env.mesh.shape["data"] * env.mesh.shape["fsdp"]
        self.init_boxed = make_init(model.module, model.tx, parts.data, rows=rows)
        self.root = jax.random.key_data(jax.random.key(parts.seed))  # uint32 [2]
        self.abstract, self.shardings = mesh_lib.abstract_state(
            self.init_boxed, self.root, env.mesh, env.rules
        )
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract.params))
        self.save_bytes = ckpt.save_bytes(self.abstract)

    def init_or_restore(self) -> None:
        """4. The newest step that restores, or a new state; the data iterator."""
        from jattn import data as data_lib  # noqa: PLC0415

        env, mngr, parts = self.env, self.mngr, self.parts
        self.eval_sets = evaluation.load_eval_sets(
            env.task, data_lib.make_loader, parts.evaluation, env.eval_splits
        )

        def restore(step: int):
            it = iter(load.train_loader(env.task, parts.data))
            return ckpt.restore(mngr, step, self.abstract, it), it

        with jax.set_mesh(env.mesh), nn.logical_axis_rules(env.rules):
            step, restored = recovery.restore_newest(mngr, restore, warn)
            if step is not None:
                self.state, self.iterator = restored
            else:
                if env.is_main:
                    recovery.archive_metrics(self.workdir, warn)
                init = jax.jit(
                    lambda r: nn.meta.unbox(self.init_boxed(r)), out_shardings=self.shardings
                )
                self.state = init(self.root)
                self.iterator = iter(load.train_loader(env.task, parts.data))
        self.start = step or 0

    def compile(self) -> None:
        """5. The jitted train step, eval and decode (`jattn.train.steps.jit_steps`)."""
        model, parts = self.model, self.parts
        self.step_fn, self.eval_step, self.decode = jit_steps(
            model.module, model.tx, model.schedule, parts.step, parts.evaluation, self.mesh,
            self.shardings,
        )  # fmt: skip
        self.batch_sharding = mesh_lib.batch_sharding(self.mesh)
        self.to_global = lambda b: mesh_lib.make_global_batch(
            b, self.batch_sharding, replicated_input=True
        )

    def open_metrics(self, wandb) -> None:
        """The writer, the step metrics, the loss sanity, the bar, the start-up summary."""
        loop, is_main = self.loop, self.env.is_main
        self.progress = Progress(
            loop.num_train_steps,
            self.start,
            enabled=is_main and loop.progress_bar,
            is_main=is_main,
        )
        self.writer = MetricsWriter(self.workdir, enabled=is_main, resume_step=self.start)
        self.writer.hparams(
            flat_hparams(self.parts.record), evaluation.metric_names(self.eval_sets)
        )
        self.tracker = TrainMetrics(self.writer, self.progress)
        self.sanity = LossSanity(logged_losses(self.workdir))
        self.last_sane = True  # whether the last logged loss was sane
        if wandb is not None and is_main:
            run = wandb.init(
                project=loop.wandb_project,
                name=os.path.basename(self.workdir),
                dir=self.workdir,
                config=copy.deepcopy(self.parts.record),
            )
            self.writer.log_to_wandb(run)
        summary = load.startup_summary(
            self.workdir, self.parts, self.model, self.mesh, self.env.task, self.eval_sets,
            self.start, self.data_check,
        )  # fmt: skip
        self.progress.write(summary)

    # -- what the loop calls ---------------------------------------------------------

    def train_step(self, step: int) -> None:
        """Trains step `step` (the state holds `step - 1` steps) and hands its metrics on."""
        t0 = time.perf_counter()
        batch = mesh_lib.make_global_batch(next(self.iterator), self.batch_sharding)
        self.tracker.waited(time.perf_counter() - t0)
        self.state, metrics = self.step_fn(self.state, batch)
        self.tracker.push(step, metrics)  # fetches the previous step's

    def log(self, step: int) -> None:
        """Writes the interval's training row and checks the loss's sanity."""
        self.tracker.log(step)
        self.last_sane = self.sanity.observe(self.tracker.logged_loss)

    def evaluate(self, step: int) -> list[str]:
        """The evaluation of every split, written to the workdir; returns the log line."""
        metrics, decodes = evaluation.evaluate(
            self.state.params, self.eval_sets, eval_step=self.eval_step, decode=self.decode,
            to_global=self.to_global, tokenizer=self.env.task.tokenizer,
            num_decode=self.parts.evaluation.decode_examples,
        )  # fmt: skip
        if self.env.is_main:
            evaluation.write_decodes(self.workdir, step, decodes)
        self.writer.write(step, metrics)
        self.eval_metrics = metrics
        return [evaluation.format_eval(step, metrics)]

    def save(self, step: int, evaluated: bool) -> None:
        """Starts the save of `step` (with the evaluation just done when `evaluated`),
        checked first (`filesystem.checked_save`)."""
        saved = {
            **(self.eval_metrics if evaluated else {}),
            SANE_STEP_METRIC: step if self.last_sane else -1,
        }
        with filesystem.checked_save(self.mngr, step, self.save_bytes):
            ckpt.save(
                self.mngr, step, self.state, self.iterator, self.parts.checkpoints, saved,
                self.vocab,
            )  # fmt: skip

    @property
    def sane(self) -> bool:
        """Whether the last logged loss was sane (`jattn.train.sanity`)."""
        return self.last_sane

    def insane_warnings(self, step: int, last_sane: int | None) -> list[str]:
        """Why the checkpoint of `step` is not sane (empty when it is)."""
        if self.last_sane:
            return []
        return [insane_warning(step, self.tracker.logged_loss, self.sanity, last_sane, "")]

    def end_interval(self) -> None:
        """After an evaluation or a save: flush, and leave its time out of the rates."""
        self.writer.flush()
        self.tracker.restart_clock()

    def drain(self) -> None:
        """Fetches the metrics of the step still in flight."""
        self.tracker.fetch()

    def close(self) -> None:
        """Closes the metrics writer (the manager is closed by the loop)."""
        with contextlib.suppress(OSError):
            self.writer.close()

    def finish(self, step: int, preempted: bool) -> dict[str, Any]:
        """7. ``final_metrics.json`` (not when preempted) and the result."""
        loss = self.tracker.logged_loss
        result = {
            "step": step,
            "preempted": preempted,
            # train/loss: the last logging interval's mean, as metrics.jsonl, TensorBoard
            # and the progress bar show it (NaN when no step ran here).
            "train/loss": loss if math.isfinite(loss) else last_logged_loss(self.workdir),
            "train/steps_per_sec": self.tracker.steady_steps_per_sec,
            "num_params": int(self.num_params),
            **self.eval_metrics,
            **producibility.metrics(self.data_check),
        }
        if self.env.is_main and not preempted:
            path = os.path.join(self.workdir, workdir_lib.FINAL_METRICS)
            return write_final_metrics(path, result)
        return {k: strict_json_value(v) for k, v in result.items()}
