"""The benchmark scripts run on the platform they are started on: none sets
`JAX_PLATFORMS=cpu` by default, and `--platform NAME` picks one, read before
jax starts (benchmarks/_harness.py)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import select_platform  # noqa: E402

# Scripts that pin the CPU on purpose: compiling ahead of time for a device this
# machine lacks (aot) and gpu.py's --cpu-smoke dry run.
PINNED_ON_PURPOSE = {"aot.py", "gpu.py"}
DEFAULT_CPU = re.compile(r"setdefault\(\s*\"JAX_PLATFORMS\",\s*\"cpu\"\s*\)")


def test_no_benchmark_defaults_to_the_cpu():
    pinned = {
        path.name
        for path in (ROOT / "benchmarks").glob("*.py")
        if DEFAULT_CPU.search(path.read_text())
    }
    assert pinned <= PINNED_ON_PURPOSE, pinned


@pytest.mark.parametrize(
    ("argv", "expect"),
    [(["--steps", "3"], None), (["--platform", "cpu", "--x"], "cpu"), (["--platform=tpu"], "tpu")],
)
def test_select_platform_reads_the_flag(monkeypatch, argv, expect):
    monkeypatch.setenv("JAX_PLATFORMS", "before")
    assert select_platform(argv) == expect
    assert os.environ["JAX_PLATFORMS"] == (expect or "before")


@pytest.mark.parametrize(
    "script", ["attention.py", "decode.py", "memory.py", "score_mod.py", "train.py"]
)
def test_each_benchmark_takes_platform(script):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--platform", "cpu", "--help"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--platform" in proc.stdout


def test_score_mod_refuses_a_cell_it_does_not_have():
    """`--only` with a mistyped cell name would time nothing and print an empty table."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "score_mod.py"), "--platform", "cpu",
         "--only", "xla plain", "chunked + alibi", "--length", "64"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--only: no cell ['chunked + alibi']" in proc.stderr, proc.stderr[-2000:]
    assert "'chunked + alibi score mod'" in proc.stderr  # the names it has
