"""The `jattn` command.

    jattn train --config configs/numbers.py --workdir runs/numbers [--config.key=value ...]
    jattn bench NAME [args ...]          # runs experiments/bench_NAME.py from the checkout

Subcommands are picked by name from `COMMANDS` ("module:function" strings,
imported only when used); each function takes the remaining arguments and
returns an exit status. Another subcommand (`ablate`, `probe`) is one more
entry; `config_arguments` / `load_config_from_args` give it the same
``--config FILE[:arg] --config.key=value`` handling as `train`.

Exit status: 0 done (or preempted and checkpointed), 1 the loss diverged,
2 bad input (config, flags, mesh, data set, workdir), reported in one line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["COMMANDS", "config_arguments", "load_config_from_args", "main"]

# name -> ("module:function", one-line help). The function takes argv (after the name).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("jattn.cli:train_command", "train (or resume) one run from a config"),
    "bench": ("jattn.cli:bench_command", "run experiments/bench_NAME.py with the given args"),
    "ablate": ("jattn.ablation.command:ablate_command", "run, emit or report an ablation grid"),
    "probe": ("jattn.probe_command:probe_command", "interventions on a trained run"),
}

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jattn", "xla")


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit status 2."""


def _fail(prog: str, message: str, status: int = 2) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


# -- shared by subcommands that take a config -------------------------------------------


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config FILE[:arg]`` (overrides ``--config.key=value`` are split off first)."""
    parser.add_argument(
        "--config",
        required=True,
        metavar="FILE[:ARG]",
        help="python file with get_config(arg); e.g. configs/base.py:shaw",
    )


def load_config_from_args(config_spec: str, overrides: Sequence[tuple[str, str]]):
    """`load_config(config_spec)` with `overrides` applied (raises ConfigError)."""
    from jattn.train.config import apply_overrides, load_config  # noqa: PLC0415

    return apply_overrides(load_config(config_spec), overrides)


def parse_with_overrides(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    """Parses `argv`, returning the namespace and the ``--config.key`` overrides."""
    from jattn.train.config import split_overrides  # noqa: PLC0415

    overrides, rest = split_overrides(argv)
    return parser.parse_args(rest), overrides


def enable_compilation_cache(path: str) -> None:
    """Persistent XLA compilation cache in `path` ("" leaves it off).

    Runs of the same shapes (seeds of an ablation, a resumed run) then skip
    compilation.
    """
    if not path:
        return
    import jax  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# -- jattn train ------------------------------------------------------------------------


def train_command(argv: Sequence[str]) -> int:
    """`jattn train --config FILE[:arg] --workdir DIR [--config.key=value ...]`."""
    prog = "jattn train"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train (or resume) one run. Any config key can be set with "
        "--config.KEY=VALUE, e.g. --config.model.d_model=128.",
    )
    config_arguments(parser)
    parser.add_argument("--workdir", required=True, help="run directory (resumed if it exists)")
    group = parser.add_argument_group(
        "several processes (not needed under SLURM or on Cloud TPU, where JAX detects them)"
    )
    group.add_argument("--coordinator_address", default=None, help="host:port of process 0")
    group.add_argument("--num_processes", type=int, default=None)
    group.add_argument("--process_id", type=int, default=None)
    parser.add_argument(
        "--compilation_cache_dir",
        default=os.environ.get("JATTN_COMPILATION_CACHE", DEFAULT_CACHE),
        help="persistent XLA compilation cache ('' disables; default %(default)s)",
    )
    from jattn.train.config import ConfigError  # noqa: PLC0415

    try:
        args, overrides = parse_with_overrides(parser, argv)
        config = load_config_from_args(args.config, overrides)
    except ConfigError as e:
        return _fail(prog, str(e))

    from jattn.train import distributed  # noqa: PLC0415

    try:
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as e:
        return _fail(prog, str(e))
    enable_compilation_cache(args.compilation_cache_dir)

    from jattn.train.loop import TrainingDivergedError, train_and_evaluate  # noqa: PLC0415

    try:
        final = train_and_evaluate(config, args.workdir)
    except ConfigError as e:
        return _fail(prog, str(e))
    except TrainingDivergedError as e:
        return _fail(prog, str(e), status=1)
    import jax  # noqa: PLC0415

    if jax.process_index() == 0:
        state = "preempted" if final.get("preempted") else "done"
        shown = {k: v for k, v in final.items() if k.startswith("eval/") or k == "train/loss"}
        print(
            f"{state} at step {final['step']}: "
            + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in sorted(shown.items())
            )
        )
    return 0


# -- jattn bench ------------------------------------------------------------------------


def _experiment_dirs() -> list[Path]:
    """Where `experiments/` may be: the current directory, then the jattn checkout."""
    here = Path.cwd() / "experiments"
    checkout = Path(__file__).resolve().parents[1] / "experiments"
    return list(dict.fromkeys([here, checkout]))


def available_benches() -> list[str]:
    """Names NAME of the experiments/bench_NAME.py scripts that can be found."""
    dirs = [d for d in _experiment_dirs() if d.is_dir()]
    return sorted({p.stem.removeprefix("bench_") for d in dirs for p in d.glob("bench_*.py")})


def find_bench(name: str) -> Path:
    """The path of `experiments/bench_<name>.py`.

    Raises:
      UsageError: no such script, listing the ones found.
    """
    dirs = _experiment_dirs()
    for d in dirs:
        path = d / f"bench_{name}.py"
        if path.is_file():
            return path
    found = available_benches()
    if not found:
        where = ", ".join(str(d) for d in dirs)
        raise UsageError(
            f"no experiments folder with bench_{name}.py (looked in {where}); "
            "run from a checkout of the jattn repository"
        )
    raise UsageError(f"unknown benchmark {name!r}; available: {', '.join(found)}")


def bench_command(argv: Sequence[str]) -> int:
    """`jattn bench NAME [args ...]`: runs experiments/bench_NAME.py as __main__."""
    prog = "jattn bench"
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} NAME [args ...]   (runs experiments/bench_NAME.py)")
        print("available: " + (", ".join(available_benches()) or "none found"))
        return 0 if argv else 2
    try:
        path = find_bench(argv[0])
    except UsageError as e:
        return _fail(prog, str(e))
    saved = sys.argv
    sys.argv = [str(path), *argv[1:]]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


# -- entry point ------------------------------------------------------------------------


def _usage() -> str:
    lines = ["usage: jattn COMMAND [args ...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`jattn COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def _resolve(target: str) -> Callable[[Sequence[str]], int]:
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches `jattn COMMAND ...`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(_usage(), file=sys.stderr)
        return _fail("jattn", f"unknown command {name!r}; choose one of {', '.join(COMMANDS)}")
    return _resolve(COMMANDS[name][0])(rest)


if __name__ == "__main__":
    sys.exit(main())
