"""The `jattn` command: one module per subcommand, this one dispatches.

    jattn train --config configs/numbers.py --workdir runs/numbers [--config.key=value ...]
    jattn ablate --config experiments/positional.py --workdir runs/positional
    jattn probe --workdir runs/positional/runs/position-shaw_seed-0 --out probe/
    jattn bench NAME [args ...]          # runs benchmarks/NAME.py from the checkout
    jattn configs                        # configs, variants, data sets, experiments

Each subcommand is a function ``argv -> exit status`` in its own module
(`jattn.cli.train`, `.ablate`, `.probe`, `.bench`, `.configs`); what they share (errors,
``--config`` handling, the compilation cache, the one flag style: dashes,
with the old underscore spellings accepted) is in `jattn.cli.common`.

Exit status: 0 done (or preempted and checkpointed), 1 the loss diverged,
2 bad input (config, flags, mesh, data set, workdir), reported in one line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from jattn.cli.ablate import ablate_command
from jattn.cli.bench import bench_command
from jattn.cli.common import config_arguments, fail, load_config_from_args
from jattn.cli.configs import configs_command
from jattn.cli.decode import decode_command
from jattn.cli.probe import probe_command
from jattn.cli.stderr import install as install_stderr_filter
from jattn.cli.train import install_sigterm_handler, train_command

__all__ = ["COMMANDS", "config_arguments", "load_config_from_args", "main"]

# name -> (function of argv after the name, one-line help).
COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (train_command, "train (or resume) one run from a config"),
    "bench": (bench_command, "run benchmarks/NAME.py with the given args"),
    "ablate": (ablate_command, "run, emit or report an ablation grid"),
    "probe": (probe_command, "interventions on a trained run"),
    "configs": (configs_command, "list configs, variants, data sets and experiment files"),
    "decode": (decode_command, "decode text with a trained run (its tokenizer and settings)"),
}


def _usage() -> str:
    lines = ["usage: jattn COMMAND [args ...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`jattn COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches `jattn COMMAND ...`; returns the exit status."""
    if argv is None:  # this process's own command line: `jattn ...` owns its stderr
        install_stderr_filter()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "train":  # before the training code's seconds of imports: see its docstring
        install_sigterm_handler()
    from jattn.train.allocator import tune_host_allocator  # noqa: PLC0415 -- imports jattn.train

    tune_host_allocator()  # XLA:CPU's per-step temporaries off mmap: see its docstring
    if name not in COMMANDS:
        print(_usage(), file=sys.stderr)
        return fail("jattn", f"unknown command {name!r}; choose one of {', '.join(COMMANDS)}")
    command, _ = COMMANDS[name]
    return command(rest)
