"""`tune_host_allocator`: glibc's malloc settings for XLA:CPU, and its opt-out.

Each case runs in a fresh interpreter: the settings are process-wide and the
function remembers what it did.
"""

import os
import subprocess
import sys

import pytest

CHECK = """
from jattn.train import allocator
print(allocator.tune_host_allocator(), allocator.describe())
"""


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if k != "JATTN_HOST_ALLOCATOR"}
    env.update(JAX_PLATFORMS="cpu", **env_extra)
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_on_glibc_and_said_so():
    assert _run({}) == "True host allocator: tuned"


def test_the_opt_out_leaves_glibc_alone():
    assert _run({"JATTN_HOST_ALLOCATOR": "default"}) == (
        "False host allocator: glibc defaults (JATTN_HOST_ALLOCATOR=default)"
    )


def test_describe_before_any_call_says_not_tuned():
    out = subprocess.run(
        [sys.executable, "-c", "from jattn.train import allocator; print(allocator.describe())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "host allocator: glibc defaults (not tuned)"
