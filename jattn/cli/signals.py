"""SIGTERM before training starts: one line and exit 0, from the command's first instant.

Python's default ends the process with status 143 and no word. `jattn
train` spends its first seconds importing jax, the training code, orbax
and tfds; `jattn.cli.main` installs this handler before any of them (this
module and the packages above it import only the standard library: `jattn`
and `jattn.cli` load their contents on first use), and the training loop
replaces it with its own, which saves a checkpoint. `jattn ablate` has it
too, until the grid's own handler (`jattn.analysis.runner`) takes over.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["PROG", "install_sigterm_handler"]

PROG = "jattn train"


_prog = [PROG]  # the command whose line the handler writes


def _sigterm_outside_training(signum, frame) -> None:  # noqa: ARG001
    """SIGTERM before the loop starts (imports, config) or after it returned: nothing
    of the run is open, so the process ends here, with status 0.

    It does not raise SystemExit: Python runs a handler in whatever frame the
    main thread is in, and in a garbage collector callback (jax's, while jax
    imports) the exception is printed as "Exception ignored" and dropped, and
    the run trained to its last step after this line (issue 54). The line is
    written straight to the file descriptor (the handler may interrupt a write
    to `sys.stderr`), and what the streams hold is flushed where it can be.
    """
    os.write(2, f"{_prog[0]}: stopped by SIGTERM outside training; nothing was lost\n".encode())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 -- interrupted mid-write: nothing to add
            pass
    os._exit(0)


def install_sigterm_handler(prog: str = PROG) -> None:
    """SIGTERM from now until the loop (or the grid) installs its own: one line naming
    `prog`, exit 0."""
    _prog[0] = prog
    signal.signal(signal.SIGTERM, _sigterm_outside_training)
