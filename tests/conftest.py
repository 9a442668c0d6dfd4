"""Test setup: CPU only, oracle importable, hypothesis profile for CI, and
strict numerics for the whole suite.

Every test runs with `jax_numpy_rank_promotion="raise"` (jax's own test
default: no implicit rank promotion anywhere in jattn) and with
`jax.debug_nans` / `jax.debug_infs` on (no primitive jattn runs may produce a
NaN or an Inf, not even in a masked-out entry). A test that produces a NaN on
purpose (divergence handling) says so with `@pytest.mark.nonfinite`, which
turns the two debug checks off for it alone.
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

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_debug_nans", True)
jax.config.update("jax_debug_infs", True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "nonfinite: produces NaN/Inf on purpose; debug_nans/debug_infs off"
    )


@pytest.fixture(autouse=True)
def _strict_numerics(request):
    if request.node.get_closest_marker("nonfinite") is None:
        yield
        return
    with jax.debug_nans(False), jax.debug_infs(False):
        yield
