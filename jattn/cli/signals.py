"""SIGTERM before training starts: one line and exit 0, from the command's first instant.

Python's default ends the process with status 143 and no word. `jattn
train` spends its first seconds importing jax, the training code, orbax
and tfds; `jattn.cli.main` installs this handler before any of them (this
module and the packages above it import only the standard library: `jattn`
and `jattn.cli` load their contents on first use), and the training loop
replaces it with its own, which saves a checkpoint.
"""

from __future__ import annotations

import signal
import sys

__all__ = ["PROG", "install_sigterm_handler"]

PROG = "jattn train"


def _sigterm_outside_training(signum, frame) -> None:  # noqa: ARG001
    """SIGTERM before the loop starts (imports, config) or after it returned."""
    print(f"{PROG}: stopped by SIGTERM outside training; nothing was lost", file=sys.stderr)
    raise SystemExit(0)


def install_sigterm_handler() -> None:
    """SIGTERM from now until the loop installs its own: one line, exit 0."""
    signal.signal(signal.SIGTERM, _sigterm_outside_training)
