"""The XLA flags the test processes compile with (set by tests/conftest.py
before jax is imported, and inherited by the `jattn` commands tests start).

The suite is bound by XLA:CPU's compile time on tiny shapes, not by the run
time of what it compiles, so the tests trade generated-code speed for
compile speed:

- `--xla_backend_optimization_level=0`: LLVM at -O0 (about 30% less
  compile time; XLA's own HLO passes, buffer assignment and so the memory
  counts are unchanged).
- `--xla_cpu_use_fusion_emitters=false`, on jaxlib < 0.11 only: XLA:CPU's
  older elemental fusion emitters instead of the MLIR fusion emitters.
  Measured on jaxlib 0.10.2 (2 cores, -O0 in both, each pair back to back
  while another job ran): the 55 float64-reference cases of
  tests/test_score_mod.py 135 -> 72 s of CPU, four cached-decoding cases of
  tests/test_decoder_only.py 38 -> 24 s; the whole main suite 29 min 12 s ->
  17 min 46 s on the quiet machine. jaxlib 0.12 has only the
  MLIR emitters and aborts on the flag ("Unknown flag in XLA_FLAGS"), so it
  is never passed there (0.11 is not known to have it either).

Neither flag changes what is computed: results meet the same float64
tolerances, and the tests that compare two paths bit for bit run both under
the same flags. A flag the caller already set in XLA_FLAGS is kept as given.
The `jattn` commands themselves (training, ablations) set neither: at XLA's
default -O2 the older emitters made a 200-step SCAN group 1.5x slower start
to end.
"""

from __future__ import annotations

import importlib.metadata
import re

_O0 = "--xla_backend_optimization_level=0"
_OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _jaxlib_version() -> tuple[int, int]:
    """(major, minor) of the installed jaxlib, read without importing it."""
    found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("jaxlib"))
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def suite_xla_flags(existing: str, jaxlib: tuple[int, int] | None = None) -> str:
    """`existing` XLA_FLAGS with the test flags added (those not already given)."""
    jaxlib = _jaxlib_version() if jaxlib is None else jaxlib
    flags = existing.split()
    wanted = [_O0] + ([_OLD_EMITTERS] if jaxlib < (0, 11) else [])
    for flag in wanted:
        name = flag.split("=")[0]
        if not any(f.split("=")[0] == name for f in flags):
            flags.append(flag)
    return " ".join(flags)
