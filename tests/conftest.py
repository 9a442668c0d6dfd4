"""Test setup: CPU only, oracle importable, hypothesis profile for CI, strict
numerics for the whole suite, and the shared data directory.

Every test runs with `jax_numpy_rank_promotion="raise"` (jax's own test
default: no implicit rank promotion anywhere in jattn) and with
`jax.debug_nans` / `jax.debug_infs` on (no primitive jattn runs may produce a
NaN or an Inf, not even in a masked-out entry). The checks see eager calls
and `jax.jit` outputs; the training loop's ahead-of-time compiled step is not
checked (its divergence tests produce a NaN on purpose).

XLA:CPU's LLVM backend runs at optimisation level 0 in the tests (and in
the `jattn` commands they start, which inherit the environment): the suite
is bound by compile time on tiny shapes, and level 0 compiles about 30%
faster. XLA's own (HLO) passes, buffer assignment and so the memory counts
are unchanged, and results match float64 to the same tolerances. An
`--xla_backend_optimization_level` already in XLA_FLAGS is kept.
"""

import gc
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("jattn", deadline=None, max_examples=40, print_blob=True)
settings.load_profile("jattn")

from jattn.train.allocator import tune_host_allocator  # noqa: E402

tune_host_allocator()  # as `jattn` does: XLA:CPU's step temporaries off mmap (1.5x faster steps)

# No persistent compilation cache in the test processes, ever: jax decides once
# per process whether to use it, so turning its directory off again after a
# test set it is not enough, and XLA:CPU serialising Pallas interpret-mode
# executables crashed a worker (the guard fixture below names such a test).
jax.config.update("jax_enable_compilation_cache", False)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_debug_nans", True)
jax.config.update("jax_debug_infs", True)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    """One private tfds directory for the session: each builder the data tests load is
    prepared there once, never in the shared ~/tensorflow_datasets. (The fault suite
    overrides it with a copy a test may damage: tests/faults/conftest.py.)"""
    return str(tmp_path_factory.mktemp("tfds"))


import pytest  # noqa: E402

_CACHE_DIR = jax.config.jax_compilation_cache_dir


@pytest.fixture(autouse=True)
def _compilation_cache_stays_off():
    """A test that runs `jattn train`/`ablate` in this process without
    ``--compilation_cache_dir=`` turns jax's persistent cache on for every later
    test of the worker; XLA:CPU then serialises Pallas interpret-mode executables
    and can crash the worker (a segfault in a later kernel test). Fail at the
    test that does it instead."""
    yield
    now = jax.config.jax_compilation_cache_dir
    if now != _CACHE_DIR:
        jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
        pytest.fail(
            f"this test turned on jax's persistent compilation cache ({now!r}); "
            "pass --compilation_cache_dir= to in-process jattn commands"
        )


@pytest.fixture(scope="module", autouse=True)
def _compiled_functions_freed_per_file():
    """Frees every compiled function (jax's caches) after each test file.

    Functions are shared within a file (module-level jits, module fixtures);
    across files they are not. Each XLA:CPU executable holds about six memory
    maps until it is freed, and an xdist worker that kept every executable of
    the files it ran reached 41,851 maps (and 6 GiB) by two thirds of the
    suite: past Linux's `vm.max_map_count` of 65,530 the next mmap fails, and
    the kernel tests' largest interpret-mode compile then aborted or
    segfaulted the worker (in three full-suite runs)."""
    yield
    jax.clear_caches()
    gc.collect()
