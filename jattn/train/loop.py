"""The one training loop: step, log, evaluate, save, SIGTERM, final evaluation, errors.

`drive(program, watch)` runs a `jattn.train.run.Program` (N >= 1 members,
built, initialised or restored and compiled before it gets here) from its
start step to ``config.num_train_steps``:

    while step < num_train_steps:
        train one step; check the background saves
        log (every log_every_steps, and before an evaluation or a save)
        evaluate (every eval_every_steps, and at the last step)
        save (every checkpoint_every_steps, after an evaluation, on SIGTERM)
        on SIGTERM: wait for the saves, stop
    final evaluation, unless the last step's was done or the run was preempted
    the program's final files (`Program.finish`)

and it maps failures to the errors the command line turns into exit codes
(docs/reliability.md): a non-finite loss of a one-member program becomes
`TrainingDivergedError` naming the last good checkpoint, a failed write (disk
full, read-only) `WorkdirIOError`; the managers and the metrics are closed
whatever happens.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from flax import linen as nn

from jattn.train import filesystem
from jattn.train.distributed import PreemptionWatch, Terminated
from jattn.train.metrics import NonFiniteLossError

__all__ = ["TrainingDivergedError", "drive"]


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint.

    Attributes:
      diverged: ``{member key: message}`` of a program's members that diverged
        (empty for a one-member program, whose message is the error's).
    """

    def __init__(self, message: str, diverged: dict[Any, str] | None = None):
        super().__init__(message)
        self.diverged = dict(diverged or {})


def drive(program, watch: PreemptionWatch) -> dict[str, Any]:
    """Trains `program` to ``config.num_train_steps`` (or to a SIGTERM) and finishes it.

    Returns:
      What `program.finish` returns.

    Raises:
      TrainingDivergedError: a non-finite loss (nothing is saved for that step).
      WorkdirIOError: a checkpoint or the metrics cannot be written.
      Terminated: a second SIGTERM, or one after the last save (`watch`); or a first
        one during the last step's log, evaluation or save, once the program is
        finished (its files written).
    """
    config, progress = program.config, program.progress
    step, eval_step_done, preempted = program.start, -1, False
    last_sane, save_failed = (program.start or None), False
    watch.stage = "training"
    try:
        with jax.set_mesh(program.mesh), nn.logical_axis_rules(program.rules):
            while step < config.num_train_steps:
                program.train_step(step + 1)
                step += 1
                for mngr in program.mngrs:  # a background save that failed stops the run
                    filesystem.check_saves(mngr)
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
                    program.save(step, evaluated=do_eval)  # `filesystem.checked_save`s
                    for line in program.insane_warnings(step, last_sane):
                        progress.write(line)
                    last_sane = step if program.sane else last_sane
                if do_eval or do_save:
                    program.end_interval()
                if preempted:
                    _wait_for_saves(program.mngrs)
                    where = ", ".join(str(m.directory) for m in program.mngrs)
                    progress.write(f"preempted: saved step {step} in {where}; exiting")
                    break
            watch.stage = "finishing"
            program.drain()
            _wait_for_saves(program.mngrs)  # the last save's failure is an error too
            # The final evaluation (if the last step's is missing, e.g. a restart at the end).
            if not preempted and eval_step_done != step:
                program.evaluate(step)
    except NonFiniteLossError as e:
        raise _diverged(e, program.mngrs[0], last_sane) from None
    except (filesystem.WorkdirIOError, OSError) as e:
        error = filesystem.write_error(e, program.workdir, step)
        save_failed = error.save_failed  # orbax would wait 300 s for a failed save: do not
        raise error from None
    finally:
        watch.stage = "finishing"
        progress.close()
        for mngr in program.mngrs:
            filesystem.close_manager(mngr, save_failed=save_failed)
        with contextlib.suppress(OSError):
            program.close()
    result = program.finish(step, preempted)
    if not preempted and watch.requested:  # during the last step's log, evaluation or save
        raise Terminated("finishing")  # saved and finished: the caller stops (an ablation too)
    return result


def _wait_for_saves(mngrs) -> None:
    for mngr in mngrs:
        filesystem.wait_for_saves(mngr)


def _diverged(e: NonFiniteLossError, mngr, last_sane: int | None) -> TrainingDivergedError:
    """The error of a non-finite loss, naming the last good checkpoint."""
    mngr.wait_until_finished()
    latest_saved = mngr.latest_step()
    newer = f" (latest: step {latest_saved})" if latest_saved != last_sane else ""
    good = "none" if last_sane is None else f"step {last_sane}{newer} in {mngr.directory}"
    return TrainingDivergedError(
        f"{e}; stopped without saving it. Last good (sane-loss) checkpoint: {good}"
    )
