"""`jattn ablate`: run (or print, or report) an ablation grid.

    jattn ablate --config experiments/positional.py[:arg] --workdir DIR [--config.key=value ...]
    jattn ablate ... --emit slurm      # a SLURM array script, one task per run
    jattn ablate ... --emit slurm --slurm-gpus-per-node 1 --slurm-partition gpu
    jattn ablate ... --emit commands   # one `jattn train` line per run
    jattn ablate ... --report-only     # rebuild results from finished runs
    jattn ablate ... --reevaluate      # evaluate finished runs again from their checkpoints
    jattn ablate ... --jobs 2          # two runs at once, each on its own CPUs

Overrides address the experiment config, e.g. ``--config.grid.seed.values=0,1,2``;
``--config.train.KEY=VALUE`` sets any key of the training config for every
run, e.g. ``--config.train.num_train_steps=200`` or
``--config.train.model.d_model=32``. Every run of the grid is checked (as
`jattn train` checks one) before anything trains or is printed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from jattn.cli.common import (
    UsageError,
    cache_argument,
    checkout_root,
    config_arguments,
    enable_compilation_cache,
    fail,
    parse_with_overrides,
)
from jattn.cli.slurm import DEFAULTS as SLURM_DEFAULTS
from jattn.cli.slurm import resources, slurm_arguments, slurm_script

__all__ = ["ablate_command"]

PROG = "jattn ablate"


def _repo_root() -> str:
    """Where relative base-config paths resolve: the current directory when it
    has them (a checkout), else the checkout jattn was installed from."""
    if Path("configs").is_dir():
        return os.getcwd()
    return str(checkout_root())


def make_parser() -> argparse.ArgumentParser:
    """The command's argument parser (the tests read every flag and its help)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    config_arguments(parser)
    parser.add_argument("--workdir", required=True, help="ablation directory (resumed)")
    parser.add_argument(
        "--emit",
        choices=["commands", "slurm"],
        default=None,
        help="print the grid for a cluster instead of running it",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="only aggregate the runs already in --workdir"
    )
    parser.add_argument(
        "--reevaluate",
        action="store_true",
        help="evaluate every finished run again from its final checkpoint (verified as "
        "`jattn decode` loads it), rewrite its final metrics and decodes, then the report; "
        "nothing trains. Each run's reevaluation.json says which recorded metrics changed",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="train this many runs (every seed its own) at once, each in its own process "
        "pinned to its share of the CPUs, its output in DIR/logs/ (default 1: one after "
        "another). On a 2-core machine 2 jobs trained the encoder-decoder and decoder-only "
        "grids 1.4-1.5x faster than one at a time (jattn.analysis.parallel); time a few "
        "first. On a GPU the jobs share it, each capped at 0.9/N of its memory "
        "(XLA_PYTHON_CLIENT_MEM_FRACTION, unless you set how to share it yourself)",
    )
    slurm_arguments(parser)
    cache_argument(parser)
    return parser


def _emit_slurm(args, overrides, repo_root: str) -> int:
    """`--emit slurm`: checks the grid and the resources, then prints the script."""
    from jattn.analysis.grid import apply_experiment_overrides  # noqa: PLC0415
    from jattn.train.config import load_config  # noqa: PLC0415

    exp = apply_experiment_overrides(load_config(args.config), overrides, repo_root)
    workdir = os.path.abspath(args.workdir)
    script = slurm_script(
        exp, workdir, repo_root=repo_root, config_spec=args.config, slurm=resources(exp, args)
    )
    print(script, end="")
    return 0


def ablate_command(argv: Sequence[str]) -> int:
    """`jattn ablate`: returns the exit status."""
    from jattn.analysis.parallel import JobFailed, cpu_slots  # noqa: PLC0415
    from jattn.analysis.runner import main_ablate  # noqa: PLC0415
    from jattn.cli.train import EXIT_LOCKED  # noqa: PLC0415
    from jattn.train.config import ConfigError  # noqa: PLC0415
    from jattn.train.workdir import WorkdirLockedError  # noqa: PLC0415

    try:
        args, overrides = parse_with_overrides(make_parser(), argv)
        given = [k for k in SLURM_DEFAULTS if getattr(args, "slurm_" + k) is not None]
        if given and args.emit != "slurm":
            flags = ", ".join("--slurm-" + k.replace("_", "-") for k in given)
            raise UsageError(f"{flags}: only with --emit slurm")
        if args.jobs != 1 and (args.emit or args.report_only or args.reevaluate):
            raise UsageError(
                "--jobs: only when training (not with --emit, --report-only or --reevaluate)"
            )
        if args.reevaluate and (args.emit or args.report_only):
            raise UsageError("--reevaluate: not with --emit or --report-only")
        try:
            cpu_slots(args.jobs)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.emit == "slurm":
            return _emit_slurm(args, overrides, _repo_root())
        if not args.emit:
            enable_compilation_cache(args.compilation_cache_dir)
            from jattn.attention.rule import show_choices  # noqa: PLC0415

            show_choices()  # runs trained here say which attention path they took
        return main_ablate(
            args.config,
            args.workdir,
            overrides,
            emit_fmt=args.emit,
            report_only=args.report_only,
            repo_root=_repo_root(),
            parallel_jobs=args.jobs,
            reevaluate=args.reevaluate,
        )
    except (ConfigError, UsageError) as e:
        return fail(PROG, str(e))
    except JobFailed as e:
        return fail(PROG, str(e), status=1)
    except WorkdirLockedError as e:
        return fail(PROG, str(e), status=EXIT_LOCKED)
