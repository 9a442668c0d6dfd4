"""The one training loop: step, log, evaluate, save, SIGTERM, final evaluation, errors.

`drive(run, watch)` runs a `jattn.train.run.Run` (built, initialised or
restored and jitted before it gets here) from its start step to
``num_train_steps``, reading the config's `LoopPart` (`run.loop`):

    while step < num_train_steps:
        train one step; check the background saves
        log (every log_every_steps, and before an evaluation or a save)
        evaluate (every eval_every_steps, and at the last step)
        save (every checkpoint_every_steps, after an evaluation, on SIGTERM)
        on SIGTERM: wait for the saves, stop
    final evaluation, unless the last step's was done or the run was preempted
    the run's final files (`Run.finish`)

and it maps failures to the errors the command line turns into exit codes
(docs/reliability.md): a non-finite loss becomes
`TrainingDivergedError` naming the last good checkpoint, a failed write (disk
full, read-only) `WorkdirIOError`; the manager and the metrics are closed
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
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""


def drive(run, watch: PreemptionWatch) -> dict[str, Any]:
    """Trains `run` to ``run.loop.num_train_steps`` (or to a SIGTERM) and finishes it.

    Returns:
      What `run.finish` returns.

    Raises:
      TrainingDivergedError: a non-finite loss (nothing is saved for that step).
      WorkdirIOError: a checkpoint or the metrics cannot be written.
      Terminated: a second SIGTERM, or one after the last save (`watch`); or a first
        one during the last step's log, evaluation or save, once the run is
        finished (its files written).
    """
    loop, progress = run.loop, run.progress
    step, eval_step_done, preempted = run.start, -1, False
    last_sane, save_failed = (run.start or None), False
    watch.stage = "training"
    try:
        with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
            while step < loop.num_train_steps:
                run.train_step(step + 1)
                step += 1
                filesystem.check_saves(run.mngr)  # a background save that failed stops the run
                do_eval = step % loop.eval_every_steps == 0 or step == loop.num_train_steps
                do_save = step % loop.checkpoint_every_steps == 0 or do_eval
                do_log = step % loop.log_every_steps == 0 or do_save
                preempted = watch.reached(step)
                if do_log or preempted:
                    run.log(step)
                if do_eval:
                    for line in run.evaluate(step):
                        progress.write(line)
                    eval_step_done = step
                if do_save or preempted:
                    run.save(step, evaluated=do_eval)  # `filesystem.checked_save`s
                    for line in run.insane_warnings(step, last_sane):
                        progress.write(line)
                    last_sane = step if run.sane else last_sane
                if do_eval or do_save:
                    run.end_interval()
                if preempted:
                    filesystem.wait_for_saves(run.mngr)
                    progress.write(f"preempted: saved step {step} in {run.mngr.directory}; exiting")
                    break
            watch.stage = "finishing"
            run.drain()
            filesystem.wait_for_saves(run.mngr)  # the last save's failure is an error too
            # The final evaluation (if the last step's is missing, e.g. a restart at the end).
            if not preempted and eval_step_done != step:
                run.evaluate(step)
    except NonFiniteLossError as e:
        raise _diverged(e, run.mngr, last_sane) from None
    except (filesystem.WorkdirIOError, OSError) as e:
        error = filesystem.write_error(e, run.workdir, step)
        save_failed = error.save_failed  # orbax would wait 300 s for a failed save: do not
        raise error from None
    finally:
        watch.stage = "finishing"
        progress.close()
        filesystem.close_manager(run.mngr, save_failed=save_failed)
        with contextlib.suppress(OSError):
            run.close()
    result = run.finish(step, preempted)
    if not preempted and watch.requested:  # during the last step's log, evaluation or save
        raise Terminated("finishing")  # saved and finished: the caller stops (an ablation too)
    return result


def _diverged(e: NonFiniteLossError, mngr, last_sane: int | None) -> TrainingDivergedError:
    """The error of a non-finite loss, naming the last good checkpoint."""
    mngr.wait_until_finished()
    latest_saved = mngr.latest_step()
    newer = f" (latest: step {latest_saved})" if latest_saved != last_sane else ""
    good = "none" if last_sane is None else f"step {last_sane}{newer} in {mngr.directory}"
    return TrainingDivergedError(
        f"{e}; stopped without saving it. Last good (sane-loss) checkpoint: {good}"
    )
