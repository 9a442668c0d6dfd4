"""The host allocator, set for XLA's CPU runtime: `tune_host_allocator()`.

Why. XLA:CPU allocates the temporaries of every execution of a compiled
program (a train step) as large blocks and frees them when it returns. glibc's
malloc serves any block above its mmap threshold (128 KiB, raised on the fly
up to 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` on free,
so every step maps fresh pages, takes a page fault to zero each one it touches
and unmaps them again. On this project's 2-core CPU machine, a train step of
the positional grid's model (`configs/reverse_digits.py`, 16 rows of 64
tokens) spent two thirds of a core in the kernel doing that and took 26 ms.

Serving those blocks from the heap (`M_MMAP_THRESHOLD` 1 GiB) and keeping what
is freed there for the next step (`M_TOP_PAD` 256 MiB, `M_TRIM_THRESHOLD`
1 GiB) takes the same step to 17 ms, with the kernel's share under 5% (the
measurement is in docs/benchmarks.md, "The host allocator"). The price is
memory the process keeps after freeing it (up to about the trim threshold
above its peak), which a training process would reuse anyway.

`jattn`'s command line calls this once at start (`jattn.cli.main`), and so
does the test suite; code that calls `train_and_evaluate` from its own process
can call it too. It does nothing when `JATTN_HOST_ALLOCATOR=default` is set,
or where the C library is not glibc (macOS, musl): there it says so and
returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["ALLOCATOR_ENV", "SETTINGS", "describe", "tune_host_allocator"]

ALLOCATOR_ENV = "JATTN_HOST_ALLOCATOR"

# glibc's mallopt parameters (malloc.h) and the values set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS: dict[str, tuple[int, int]] = {
    "M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, 1 << 30),
    "M_TOP_PAD": (_M_TOP_PAD, 256 << 20),
    "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, 1 << 30),
}

_state: dict[str, str] = {}


def tune_host_allocator() -> bool:
    """Sets glibc's malloc up for XLA:CPU's per-step temporaries (see the module doc).

    Idempotent and process-wide; affects allocations made after it. Returns
    True when the settings are in force, False when left alone (opted out
    with ``JATTN_HOST_ALLOCATOR=default``, or not glibc); `describe()` says
    which.
    """
    if "result" in _state:
        return _state["result"] == "tuned"
    if os.environ.get(ALLOCATOR_ENV, "") == "default":
        _state["result"] = f"glibc defaults ({ALLOCATOR_ENV}=default)"
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        _state["result"] = "left alone (not glibc)"
        return False
    refused = [name for name, (param, value) in SETTINGS.items() if mallopt(param, value) != 1]
    _state["result"] = "tuned" if not refused else f"glibc refused {', '.join(refused)}"
    return not refused


def describe() -> str:
    """One line for a run's log: what `tune_host_allocator` did (or that it was not called)."""
    return "host allocator: " + _state.get("result", "glibc defaults (not tuned)")


def _glibc_mallopt():
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it; musl has a different mallopt
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt
