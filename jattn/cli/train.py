"""`jattn train --config FILE[:arg] --workdir DIR [--config.key=value ...]`.

Trains (or resumes) one run; see `jattn.train.train_and_evaluate`. Exit
status: 0 done (or preempted and checkpointed), 1 the loss diverged, 2 bad
input (config, flags, mesh, data set, workdir), reported in one line before
anything compiles.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jattn.cli.common import (
    cache_argument,
    config_arguments,
    enable_compilation_cache,
    fail,
    load_config_from_args,
    parse_with_overrides,
)

__all__ = ["train_command"]

PROG = "jattn train"


def _parser() -> argparse.ArgumentParser:
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
    if "seeds" in final:  # several seeds in one program (config.seeds)
        return "\n".join(
            f"seed {seed}: " + _summary(result) for seed, result in sorted(final["seeds"].items())
        )
    state = "preempted" if final.get("preempted") else "done"
    shown = {k: v for k, v in final.items() if k.startswith("eval/") or k == "train/loss"}
    return f"{state} at step {final['step']}: " + ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(shown.items())
    )


def train_command(argv: Sequence[str]) -> int:
    """`jattn train`: returns the exit status."""
    from jattn.train.config import ConfigError  # noqa: PLC0415

    try:
        args, overrides = parse_with_overrides(_parser(), argv)
        config = load_config_from_args(args.config, overrides)
    except ConfigError as e:
        return fail(PROG, str(e))

    from jattn.train import distributed  # noqa: PLC0415

    try:
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as e:
        return fail(PROG, str(e))
    enable_compilation_cache(args.compilation_cache_dir)

    import jax  # noqa: PLC0415

    from jattn.train.loop import TrainingDivergedError, train_and_evaluate  # noqa: PLC0415

    try:
        final = train_and_evaluate(config, args.workdir)
    except ConfigError as e:
        return fail(PROG, str(e))
    except TrainingDivergedError as e:
        return fail(PROG, str(e), status=1)
    if jax.process_index() == 0:
        print(_summary(final))
    return 0
