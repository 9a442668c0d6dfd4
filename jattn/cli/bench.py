"""`jattn bench NAME [args ...]`: runs ``experiments/bench_NAME.py`` as ``__main__``.

The scripts live in the repository, not in the package: they are looked up
in ``./experiments`` and then in the checkout jattn was installed from.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from jattn.cli.common import UsageError, checkout_root, fail

__all__ = ["available_benches", "bench_command", "find_bench"]

PROG = "jattn bench"


def _experiment_dirs() -> list[Path]:
    """Where `experiments/` may be: the current directory, then the jattn checkout."""
    return list(dict.fromkeys([Path.cwd() / "experiments", checkout_root() / "experiments"]))


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
    """`jattn bench`: the script's exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} NAME [args ...]   (runs experiments/bench_NAME.py)")
        print("available: " + (", ".join(available_benches()) or "none found"))
        return 0 if argv else 2
    try:
        path = find_bench(argv[0])
    except UsageError as e:
        return fail(PROG, str(e))
    saved = sys.argv
    sys.argv = [str(path), *argv[1:]]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
