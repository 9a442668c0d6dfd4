"""What the subcommands of `jattn` share: errors, ``--config`` handling, the XLA cache.

Every subcommand is a function ``argv -> exit status``. Bad input is a
`UsageError` or a `jattn.train.ConfigError`, reported by `fail` in one line
(``jattn train: error: ...``) with exit status 2. Heavy imports (jax, flax,
the training code) happen inside the functions that need them, so that
``jattn --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_CACHE",
    "UsageError",
    "cache_argument",
    "checkout_root",
    "config_arguments",
    "enable_compilation_cache",
    "fail",
    "load_config_from_args",
    "normalize_flags",
    "parse_with_overrides",
]

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jattn", "xla")


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit status 2."""


def fail(prog: str, message: str, status: int = 2) -> int:
    """Prints ``{prog}: error: {message}`` to stderr and returns `status`."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


def checkout_root() -> Path:
    """The directory above the `jattn` package: a checkout's root when installed editable."""
    return Path(__file__).resolve().parents[2]


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config FILE[:arg]`` (overrides ``--config.key=value`` are split off first)."""
    parser.add_argument(
        "--config",
        required=True,
        metavar="FILE[:ARG]",
        help="python file with get_config(arg); e.g. configs/base.py:shaw",
    )


def normalize_flags(argv: Sequence[str]) -> list[str]:
    """The one flag style of `jattn`: ``--head_dim`` is read as ``--head-dim``.

    Flags are spelled with dashes; the underscore spellings of earlier
    versions (``--compilation_cache_dir``, ``--num_processes``) keep working
    as hidden aliases. ``--config.key=value`` overrides, values and everything
    after ``--`` are left alone.
    """
    out, argv = [], list(argv)
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--") and not arg.startswith("--config."):
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def cache_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--compilation-cache-dir`` (default: $JATTN_COMPILATION_CACHE or `DEFAULT_CACHE`)."""
    parser.add_argument(
        "--compilation-cache-dir",
        default=os.environ.get("JATTN_COMPILATION_CACHE", DEFAULT_CACHE),
        help="persistent XLA compilation cache ('' disables; default %(default)s)",
    )


def parse_with_overrides(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    """Parses `argv`, returning the namespace and the ``--config.key`` overrides.

    Flags may use the old underscore spellings (`normalize_flags`).

    Raises:
      ConfigError: an override without a value or with an empty key.
    """
    from jattn.train.config import split_overrides  # noqa: PLC0415

    overrides, rest = split_overrides(argv)
    return parser.parse_args(normalize_flags(rest)), overrides


def load_config_from_args(config_spec: str, overrides: Sequence[tuple[str, str]]):
    """`load_config(config_spec)` with `overrides` applied (raises ConfigError)."""
    from jattn.train.config import apply_overrides, load_config  # noqa: PLC0415

    return apply_overrides(load_config(config_spec), overrides)


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
