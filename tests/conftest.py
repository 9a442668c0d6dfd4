"""Test setup: CPU only, oracle importable, hypothesis profile for CI."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings  # noqa: E402

settings.register_profile("jattn", deadline=None, max_examples=40, print_blob=True)
settings.load_profile("jattn")
