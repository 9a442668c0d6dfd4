"""The `jattn` command: one module per subcommand, this one dispatches.

    jattn train --config configs/numbers.py --workdir runs/numbers [--config.key=value ...]
    jattn ablate --config experiments/positional.py --workdir runs/positional
    jattn probe --workdir runs/positional/runs/position-shaw_seed-0 --out probe/
    jattn configs                        # configs, variants, data sets, experiments

Each subcommand is a function ``argv -> exit status`` in its own module
(`jattn.cli.train`, `.ablate`, `.probe`, `.configs`); what they share (errors,
``--config`` handling, the compilation cache, the one flag style: dashes,
with the old underscore spellings accepted) is in `jattn.cli.common`.

Exit status: 0 done (or preempted and checkpointed), 1 the loss diverged,
2 bad input (config, flags, mesh, data set, workdir), reported in one line.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from jattn.cli.signals import install_sigterm_handler
from jattn.cli.stderr import install as install_stderr_filter

__all__ = ["COMMANDS", "config_arguments", "load_config_from_args", "main"]

# name -> (module and function of argv after the name, one-line help). The
# modules are imported on dispatch: before that this package and `jattn`
# import only the standard library, so `main` installs its SIGTERM handler
# within milliseconds of the process's start (`jattn.cli.signals`).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("jattn.cli.train:train_command", "train (or resume) one run from a config"),
    "ablate": ("jattn.cli.ablate:ablate_command", "run, emit or report an ablation grid"),
    "probe": ("jattn.cli.probe:probe_command", "interventions on a trained run"),
    "configs": (
        "jattn.cli.configs:configs_command",
        "list configs, variants, data sets and experiment files",
    ),
    "decode": (
        "jattn.cli.decode:decode_command",
        "decode text with a trained run (its tokenizer and settings)",
    ),
}


def command(name: str) -> Callable[[Sequence[str]], int]:
    """The function of command `name` (imports its module)."""
    module, func = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module), func)


def __getattr__(name: str):
    """`config_arguments` and `load_config_from_args` of `jattn.cli.common`, on first use."""
    if name in ("config_arguments", "load_config_from_args"):
        return getattr(importlib.import_module("jattn.cli.common"), name)
    raise AttributeError(f"module 'jattn.cli' has no attribute {name!r}")


def _usage() -> str:
    lines = ["usage: jattn COMMAND [args ...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`jattn COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches `jattn COMMAND ...`; returns the exit status."""
    argv_given = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["train"], ["ablate"]):  # first: a SIGTERM from now on is one line, exit 0
        install_sigterm_handler(f"jattn {argv[0]}")
    if not argv_given:  # this process's own command line: `jattn ...` owns its stderr
        install_stderr_filter()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    from jattn.train.allocator import tune_host_allocator  # noqa: PLC0415 -- imports jattn.train

    tune_host_allocator()  # XLA:CPU's per-step temporaries off mmap: see its docstring
    if name not in COMMANDS:
        from jattn.cli.common import fail  # noqa: PLC0415

        if name == "bench":  # the benchmarks are scripts of the checkout (docs/benchmarks.md)
            return fail("jattn", "`jattn bench` was removed: run `python benchmarks/NAME.py`")

        print(_usage(), file=sys.stderr)
        return fail("jattn", f"unknown command {name!r}; choose one of {', '.join(COMMANDS)}")
    return command(name)(rest)
