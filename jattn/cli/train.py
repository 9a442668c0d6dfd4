"""`jattn train --config FILE[:arg] --workdir DIR [--config.key=value ...]`.

Trains (or resumes) one run; see `jattn.train.train_and_evaluate`. Exit
status (docs/reliability.md):

- 0: done, or preempted by SIGTERM and checkpointed, or SIGTERM before the
  first step or after the last save (nothing to save; a rerun resumes);
- 1: the loss diverged (NaN/Inf); the last sane checkpoint is named;
- 2: bad input (config, flags, mesh, data set, damaged prepared data,
  workdir of another run), reported in one line before anything compiles;
- 3: the workdir is in use by another trainer (its lock is held);
- 4: the workdir or a checkpoint cannot be written (disk full, read-only),
  at start or at the first failed save;
- 143: a second SIGTERM while the first one's save was under way, or a
  SIGTERM that no training step saw within a minute (blocked in data
  loading); nothing is saved, a rerun resumes from the last checkpoint.
  (A SIGTERM before `jattn.cli.main` runs at all, while Python itself starts,
  is also 143: `main` installs the handler before anything else, and
  nothing it imports before that reads more than the standard library:
  `jattn.cli.signals`.)

Every error is one line on stderr: ``jattn train: error: ...``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from jattn.cli.common import (
    cache_argument,
    config_arguments,
    enable_compilation_cache,
    fail,
    load_config_from_args,
    parse_with_overrides,
)
from jattn.cli.signals import PROG, install_sigterm_handler

__all__ = ["train_command"]


def make_parser() -> argparse.ArgumentParser:
    """The command's argument parser (the tests read every flag and its help)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train (or resume) one run. Any config key can be set with "
        "--config.KEY=VALUE, e.g. --config.model.d_model=128.",
    )
    config_arguments(parser)
    parser.add_argument("--workdir", required=True, help="run directory (resumed if it exists)")
    group = parser.add_argument_group(
        "several processes (not needed under SLURM or on Cloud TPU, where JAX detects them)"
    )
    group.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    group.add_argument(
        "--num-processes", type=int, default=None, help="how many processes take part"
    )
    group.add_argument(
        "--process-id", type=int, default=None, help="this process's index, 0 ... N-1"
    )
    cache_argument(parser)
    return parser


def _summary(final: dict) -> str:
    state = "preempted" if final.get("preempted") else "done"
    shown = {k: v for k, v in final.items() if k.startswith("eval/") or k == "train/loss"}
    return f"{state} at step {final['step']}: " + ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(shown.items())
    )


EXIT_LOCKED = 3
EXIT_IO = 4
EXIT_TERMINATED = 128 + 15  # a second SIGTERM: what the signal itself would give


def terminated_status(e, workdir: str) -> int:
    """Exit status and one line for a SIGTERM the loop could not turn into a save."""
    if e.stage == "blocked":
        print(
            f"{PROG}: stopped by SIGTERM: no training step finished within a minute of it "
            f"(blocked in data loading or a step), so nothing was saved; rerun to resume from "
            f"the last checkpoint in {workdir}",
            file=sys.stderr,
        )
        return EXIT_TERMINATED
    if e.stage == "training":
        print(
            f"{PROG}: stopped by a second SIGTERM before the first one's checkpoint was "
            f"complete; rerun to resume from the last checkpoint in {workdir}",
            file=sys.stderr,
        )
        return EXIT_TERMINATED
    what = "before the first step" if e.stage == "start-up" else "after the last checkpoint"
    print(
        f"{PROG}: stopped by SIGTERM {what}; nothing was lost (rerun the same command to "
        f"resume {workdir})",
        file=sys.stderr,
    )
    return 0


def train_command(argv: Sequence[str]) -> int:
    """`jattn train`: returns the exit status."""
    install_sigterm_handler()  # the loop installs its own
    from jattn.train.config import ConfigError  # noqa: PLC0415

    try:
        args, overrides = parse_with_overrides(make_parser(), argv)
        config = load_config_from_args(args.config, overrides)
    except ConfigError as e:
        return fail(PROG, str(e))

    from jattn.train import distributed  # noqa: PLC0415

    try:
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as e:
        return fail(PROG, str(e))
    enable_compilation_cache(args.compilation_cache_dir)
    if not os.environ.get("JATTN_ORBAX_LOGS"):
        # Orbax logs a failed background save as pages of tracebacks from each of its
        # threads; the loop reports it in one line (JATTN_ORBAX_LOGS=1 shows them).
        logging.getLogger("absl").setLevel(logging.CRITICAL)

    import jax  # noqa: PLC0415

    from jattn.attention.rule import show_choices  # noqa: PLC0415

    show_choices()  # the run says once which attention path implementation=None took
    from jattn.data.integrity import DataIntegrityError  # noqa: PLC0415
    from jattn.train.distributed import Terminated  # noqa: PLC0415
    from jattn.train.filesystem import WorkdirIOError  # noqa: PLC0415
    from jattn.train.loop import TrainingDivergedError  # noqa: PLC0415
    from jattn.train.run import train_and_evaluate  # noqa: PLC0415
    from jattn.train.workdir import WorkdirLockedError  # noqa: PLC0415

    try:
        final = train_and_evaluate(config, args.workdir)
    except ConfigError as e:
        return fail(PROG, str(e))
    except TrainingDivergedError as e:
        return fail(PROG, str(e), status=1)
    except WorkdirLockedError as e:
        return fail(PROG, str(e), status=EXIT_LOCKED)
    except WorkdirIOError as e:
        status = fail(PROG, str(e), status=EXIT_IO)
        if e.save_failed:  # orbax's threads of the failed save would print at exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    except DataIntegrityError as e:  # found while reading, after the start-up checks
        return fail(PROG, str(e))
    except Terminated as e:
        status = terminated_status(e, args.workdir)
        if jax.process_count() == 1:
            # Stopped mid start-up, a compile's or the data's threads may still run in C++;
            # the interpreter's teardown under them once ended in SIGSEGV after this line.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    if jax.process_index() == 0:
        print(_summary(final))
    return 0
