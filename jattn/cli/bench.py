"""`jattn bench NAME [args ...]`: runs ``benchmarks/NAME.py`` as ``__main__``.

The scripts live in the repository, not in the package: they are looked up
in ``./benchmarks`` and then in the checkout jattn was installed from. A file
whose name starts with ``_`` is a helper of the benchmarks, not one of them.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from jattn.cli.common import UsageError, checkout_root, fail

__all__ = ["available_benches", "bench_command", "bench_names", "find_bench"]

PROG = "jattn bench"
FOLDER = "benchmarks"


def _bench_dirs() -> list[Path]:
    """Where `benchmarks/` may be: the current directory, then the jattn checkout."""
    return list(dict.fromkeys([Path.cwd() / FOLDER, checkout_root() / FOLDER]))


def bench_names(folder: Path) -> list[str]:
    """The benchmarks in one folder: its `*.py` files not starting with `_`."""
    return sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))


def available_benches() -> list[str]:
    """Names NAME of the benchmarks/NAME.py scripts that can be found."""
    return sorted({n for d in _bench_dirs() if d.is_dir() for n in bench_names(d)})


def find_bench(name: str) -> Path:
    """The path of `benchmarks/<name>.py`.

    Raises:
      UsageError: no such script, listing the ones found.
    """
    dirs = _bench_dirs()
    if not name.startswith("_"):
        for d in dirs:
            path = d / f"{name}.py"
            if path.is_file():
                return path
    found = available_benches()
    if not found:
        where = ", ".join(str(d) for d in dirs)
        raise UsageError(
            f"no benchmarks folder with {name}.py (looked in {where}); "
            "run from a checkout of the jattn repository"
        )
    raise UsageError(f"unknown benchmark {name!r}; available: {', '.join(found)}")


def bench_command(argv: Sequence[str]) -> int:
    """`jattn bench`: the script's exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} NAME [args ...]   (runs benchmarks/NAME.py)")
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
