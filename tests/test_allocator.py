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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_allocator_bench_measures_both_settings_in_their_own_process():
    """`benchmarks/train.py --allocator` on the smoke config: one row a setting, each child
    reporting the allocator it ran with (no timing is asserted)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(repo, "benchmarks", "train.py")
    config = os.path.join(repo, "configs", "smoke.py")
    out = subprocess.run(
        [
            sys.executable,
            script,
            "--allocator",
            "--config",
            config,
            "--steps",
            "2",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    ).stdout
    assert "glibc defaults: {'allocator': 'host allocator: glibc defaults (JATTN" in out
    assert "tuned (jattn): {'allocator': 'host allocator: tuned'" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| glibc defaults", "| tuned (jattn)"], out
