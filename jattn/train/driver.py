"""The one training loop: step, log, evaluate, save, SIGTERM, final evaluation, errors.

`drive(program, watch)` runs a program from its start step to
``config.num_train_steps``. A program is a single run
(`jattn.train.program.SingleRun`) or every seed of a group stacked into one
jitted program (`jattn.train.seed_program.SeedProgram`); both are built,
initialised or restored and compiled before they get here, and both answer
the `Program` protocol below. The loop itself knows nothing of seeds:

    while step < num_train_steps:
        train one step; check the background saves
        log (every log_every_steps, and before an evaluation or a save)
        evaluate (every eval_every_steps, and at the last step)
        save (every checkpoint_every_steps, after an evaluation, on SIGTERM)
        on SIGTERM: wait for the save, stop
    final evaluation, unless the last step's was done or the run was preempted
    the program's final files (`Program.finish`)

and it maps failures to the errors the command line turns into exit codes
(docs/reliability.md): a non-finite loss becomes `TrainingDivergedError`
naming the last good checkpoint, a failed write (disk full, read-only)
`WorkdirIOError`; the manager and the metrics are closed whatever happens.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import jax
from flax import linen as nn

from jattn.train import filesystem
from jattn.train.distributed import PreemptionWatch
from jattn.train.metrics import NonFiniteLossError

__all__ = ["Program", "TrainingDivergedError", "drive"]


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""


class Program(Protocol):
    """What `drive` asks of a program (a single run, or a stacked program of seeds).

    Attributes:
      config: the run's config (its step, log, eval and checkpoint intervals).
      workdir: where it writes (named in a failed write's error).
      mesh, rules: the mesh and logical axis rules every step runs under.
      mngr: its checkpoint manager.
      progress: the progress bar and log lines.
      start: the step it starts at (0, or the restored checkpoint's).
      save_bytes: the free space a save needs.
    """

    config: Any
    workdir: str
    mesh: Any
    rules: Any
    mngr: Any
    progress: Any
    start: int
    save_bytes: int

    def train_step(self, step: int) -> None:
        """Trains step `step` (the state holds `step - 1` steps) and hands its metrics on."""

    def log(self, step: int) -> None:
        """Writes the interval's training row and checks the loss's sanity."""

    def evaluate(self, step: int) -> list[str]:
        """Evaluates (and decodes) at `step`, writes the metrics, returns log lines."""

    def save(self, step: int, evaluated: bool) -> None:
        """Starts the save of `step` (with the evaluation just done when `evaluated`)."""

    @property
    def sane(self) -> bool:
        """Whether a checkpoint now is sane (`jattn.train.sanity`)."""

    def insane_warnings(self, step: int, last_sane: int | None) -> list[str]:
        """Why the checkpoint of `step` is not sane (empty when it is)."""

    def end_interval(self) -> None:
        """After an evaluation or a save: flush the metrics, restart the clocks."""

    def drain(self) -> None:
        """Fetches the metrics of the step still in flight."""

    def close(self) -> None:
        """Closes the metrics writers (the manager is closed by `drive`)."""

    def finish(self, step: int, preempted: bool) -> dict[str, Any]:
        """The final files and the result `drive` returns."""


def drive(program: Program, watch: PreemptionWatch) -> dict[str, Any]:
    """Trains `program` to ``config.num_train_steps`` (or to a SIGTERM) and finishes it.

    Returns:
      What `program.finish` returns.

    Raises:
      TrainingDivergedError: a non-finite loss (nothing is saved for that step).
      WorkdirIOError: a checkpoint or the metrics cannot be written.
      Terminated: a second SIGTERM, or one after the last save (`watch`).
    """
    config, mngr, progress = program.config, program.mngr, program.progress
    step, eval_step_done, preempted = program.start, -1, False
    last_sane, save_failed = (program.start or None), False
    watch.stage = "training"
    try:
        with jax.set_mesh(program.mesh), nn.logical_axis_rules(program.rules):
            while step < config.num_train_steps:
                program.train_step(step + 1)
                step += 1
                filesystem.check_saves(mngr)  # a background save that failed stops the run
                do_eval = step % config.eval_every_steps == 0 or step == config.num_train_steps
                do_save = step % config.checkpoint_every_steps == 0 or do_eval
                do_log = step % config.log_every_steps == 0 or do_save
                preempted = watch.reached(step)
                if do_log or preempted:
                    program.log(step)
                if do_eval:
                    for line in program.evaluate(step):
                        progress.write(line)
                    eval_step_done = step
                if do_save or preempted:
                    with filesystem.checked_save(mngr, step, program.save_bytes):
                        program.save(step, evaluated=do_eval)
                    for line in program.insane_warnings(step, last_sane):
                        progress.write(line)
                    last_sane = step if program.sane else last_sane
                if do_eval or do_save:
                    program.end_interval()
                if preempted:
                    filesystem.wait_for_saves(mngr)
                    progress.write(f"preempted: saved step {step} in {mngr.directory}; exiting")
                    break
            watch.stage = "finishing"
            program.drain()
            filesystem.wait_for_saves(mngr)  # the last save's failure is an error too
            # The final evaluation (if the last step's is missing, e.g. a restart at the end).
            if not preempted and eval_step_done != step:
                program.evaluate(step)
    except NonFiniteLossError as e:
        raise _diverged(e, mngr, last_sane) from None
    except (filesystem.WorkdirIOError, OSError) as e:
        error = filesystem.write_error(e, program.workdir, step)
        save_failed = error.save_failed  # orbax would wait 300 s for a failed save: do not
        raise error from None
    finally:
        watch.stage = "finishing"
        progress.close()
        filesystem.close_manager(mngr, save_failed=save_failed)
        with contextlib.suppress(OSError):
            program.close()
    return program.finish(step, preempted)


def _diverged(e: NonFiniteLossError, mngr, last_sane: int | None) -> TrainingDivergedError:
    """The error of a non-finite loss, naming the last good checkpoint."""
    mngr.wait_until_finished()
    latest_saved = mngr.latest_step()
    newer = f" (latest: step {latest_saved})" if latest_saved != last_sane else ""
    good = "none" if last_sane is None else f"step {last_sane}{newer} in {mngr.directory}"
    return TrainingDivergedError(
        f"{e}; stopped without saving it. Last good (sane-loss) checkpoint: {good}"
    )
