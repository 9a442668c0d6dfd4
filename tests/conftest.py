"""Test setup: CPU only, oracle importable, hypothesis profile for CI, strict
numerics for the whole suite, and the shared data directory.

Every test runs with `jax_numpy_rank_promotion="raise"` (jax's own test
default: no implicit rank promotion anywhere in jattn) and with
`jax.debug_nans` / `jax.debug_infs` on (no primitive jattn runs may produce a
NaN or an Inf, not even in a masked-out entry). The checks see eager calls
and `jax.jit` outputs; the training loop's ahead-of-time compiled step is not
checked (its divergence tests produce a NaN on purpose).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("jattn", deadline=None, max_examples=40, print_blob=True)
settings.load_profile("jattn")

from jattn.train.allocator import tune_host_allocator  # noqa: E402

tune_host_allocator()  # as `jattn` does: XLA:CPU's step temporaries off mmap (1.5x faster steps)

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
