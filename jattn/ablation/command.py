"""`jattn ablate`: run (or print, or report) an ablation grid.

    jattn ablate --config experiments/positional.py[:arg] --workdir DIR [--config.key=value ...]
    jattn ablate ... --emit slurm      # a SLURM array script, one task per run
    jattn ablate ... --emit commands   # one `jattn train` line per run
    jattn ablate ... --report-only     # rebuild results from finished runs

Overrides address the experiment config, e.g. ``--config.grid.seed.values=0,1,2``
or ``--config.train.num_train_steps=200``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path


def _repo_root(experiment_spec: str) -> str:
    """Where relative base-config paths resolve: the current directory when it
    has them (a checkout), else the checkout jattn was installed from."""
    if Path("configs").is_dir():
        return os.getcwd()
    return str(Path(__file__).resolve().parents[2])


def ablate_command(argv: Sequence[str]) -> int:
    from jattn.cli import (  # noqa: PLC0415
        DEFAULT_CACHE,
        _fail,
        config_arguments,
        enable_compilation_cache,
        parse_with_overrides,
    )
    from jattn.train.config import ConfigError  # noqa: PLC0415

    prog = "jattn ablate"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
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
        "--compilation_cache_dir",
        default=os.environ.get("JATTN_COMPILATION_CACHE", DEFAULT_CACHE),
        help="persistent XLA compilation cache ('' disables; default %(default)s)",
    )
    from jattn.ablation.runner import main_ablate  # noqa: PLC0415

    try:
        args, overrides = parse_with_overrides(parser, argv)
        if not args.emit:
            enable_compilation_cache(args.compilation_cache_dir)
        return main_ablate(
            args.config,
            args.workdir,
            overrides,
            emit_fmt=args.emit,
            report_only=args.report_only,
            repo_root=_repo_root(args.config),
        )
    except ConfigError as e:
        return _fail(prog, str(e))
