"""Test setup: CPU only, oracle importable, hypothesis profile for CI, strict
numerics for the whole suite, and the shared data directory.

Every test runs with `jax_numpy_rank_promotion="raise"` (jax's own test
default: no implicit rank promotion anywhere in jattn) and with
`jax.debug_nans` / `jax.debug_infs` on (no primitive jattn runs may produce a
NaN or an Inf, not even in a masked-out entry). The checks see eager calls
and `jax.jit` outputs; the training loop's ahead-of-time compiled step is not
checked (its divergence tests produce a NaN on purpose).

XLA:CPU compiles for speed of compilation in the tests (and in the `jattn`
commands they start, which inherit the environment): LLVM at -O0 and, on
jaxlib < 0.11, the older fusion emitters (tests/compile_flags.py says why
and what each saves; a flag already in XLA_FLAGS is kept).
"""

import gc
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

from compile_flags import suite_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ.get("XLA_FLAGS", ""))

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


@pytest.fixture(scope="session", autouse=True)
def session_compilation_cache(tmp_path_factory) -> str:
    """`jattn` commands that tests start as child processes without
    ``--compilation-cache-dir`` compile into a cache of this session (one per
    xdist worker), not into `--compilation-cache-dir`'s default in the user's
    home (~/.cache/jattn/xla): a test run writes nothing there, and no run
    starts with programs an earlier run left. A test that sets
    JATTN_COMPILATION_CACHE in its children's environment keeps its own.
    Yields the folder (fixtures that build a child's environment ask for it,
    so that it is set before they copy os.environ)."""
    path = str(tmp_path_factory.mktemp("jattn_xla"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JATTN_COMPILATION_CACHE", path)
        yield path


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


def pytest_addoption(parser):
    parser.addoption(
        "--param-sample",
        action="store_true",
        help="run each parametrized test function on one case, alternately its first "
        "and its last (scripts/test.sh's second jax: every test function, fewer repetitions)",
    )


def pytest_collection_modifyitems(config, items):
    """With `--param-sample`, keep one case of each parametrized test function
    and deselect the others: the first case of the 1st, 3rd, 5th, ...
    parametrized function and the last case of the 2nd, 4th, ... (in
    collection order, so the same on every xdist worker). The second jax of
    scripts/test.sh so runs every test function of its subset, the plain and
    the fullest-featured ends of the parameter lists both among them, but not
    every combination the first jax already runs."""
    if not config.getoption("--param-sample"):
        return
    cases: dict[str, list] = {}
    for item in items:
        cases.setdefault(item.nodeid.split("[")[0], []).append(item)
    parametrized = [c for c in cases.values() if len(c) > 1]
    keep = {id(c[0]) for c in cases.values() if len(c) == 1}
    keep |= {id(c[-(k % 2)]) for k, c in enumerate(parametrized)}
    dropped = [item for item in items if id(item) not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in keep]
