"""`--platform NAME` for the benchmark scripts.

A benchmark runs where it is started: on the platform `JAX_PLATFORMS` names,
or jax's own choice (a GPU where there is one). `--platform cpu` (or cuda,
tpu) picks one; it is read from the command line before jax is imported,
since jax reads `JAX_PLATFORMS` once, when its backend starts.
"""

from __future__ import annotations

import os
import sys

__all__ = ["HELP", "select_platform"]

HELP = (
    "jax platform to run on (cpu, cuda, rocm, tpu); default: where it is started "
    "(JAX_PLATFORMS, else jax's choice)"
)


def select_platform(argv: list[str] | None = None) -> str | None:
    """Sets `JAX_PLATFORMS` from ``--platform NAME`` (or ``--platform=NAME``) in
    `argv` (default `sys.argv`); returns the name, or None when not given."""
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        if arg == "--platform" and i + 1 < len(argv):
            name = argv[i + 1]
        elif arg.startswith("--platform="):
            name = arg.split("=", 1)[1]
        else:
            continue
        os.environ["JAX_PLATFORMS"] = name
        return name
    return None
