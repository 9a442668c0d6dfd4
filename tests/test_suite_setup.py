"""The test harness's own switches: the XLA flags the suite compiles with
(tests/compile_flags.py), `--param-sample`, the second jax's selection
(tests/conftest.py, scripts/test.sh), and the compilation cache of the
session that `jattn` child processes use (tests/conftest.py)."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from compile_flags import suite_xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
O0 = "--xla_backend_optimization_level=0"
OLD = "--xla_cpu_use_fusion_emitters=false"


def test_older_fusion_emitters_only_where_jaxlib_has_them():
    assert suite_xla_flags("", (0, 10)).split() == [O0, OLD]
    # jaxlib 0.12 aborts on a flag it does not know: never passed from 0.11 on.
    assert suite_xla_flags("", (0, 11)).split() == [O0]
    assert suite_xla_flags("", (0, 12)).split() == [O0]
    assert suite_xla_flags("", (1, 0)).split() == [O0]


def test_flags_the_caller_set_are_kept_as_given():
    given = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=2"
    assert suite_xla_flags(given, (0, 10)).split() == given.split() + [OLD]
    given = "--xla_cpu_use_fusion_emitters=true"
    assert suite_xla_flags(given, (0, 10)).split() == [given, O0]


def test_this_process_compiles_with_the_suite_flags():
    # conftest.py set them before jax was imported.
    import jax

    assert O0 in os.environ["XLA_FLAGS"]
    jaxlib = tuple(int(x) for x in jax.__version__.split(".")[:2])  # jax and jaxlib pair up
    assert (OLD in os.environ["XLA_FLAGS"]) == (jaxlib < (0, 11))


def _collected(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=os.path.dirname(HERE),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


# Files with several parametrized functions and unparametrized ones, cheap to collect.
FILES = ("tests/test_stats.py", "tests/test_masks.py", "tests/test_dropout.py")


def test_param_sample_keeps_one_case_of_each_function_alternating_first_and_last():
    every = _collected(*FILES)
    sample = _collected("--param-sample", *FILES)
    by_function: dict[str, list[str]] = {}
    for nodeid in every:
        by_function.setdefault(nodeid.split("[")[0], []).append(nodeid)
    parametrized = [cases for cases in by_function.values() if len(cases) > 1]
    assert len(parametrized) >= 3  # enough functions to see both ends taken
    kept = {cases[0] for cases in by_function.values() if len(cases) == 1}
    kept |= {cases[0] if k % 2 == 0 else cases[-1] for k, cases in enumerate(parametrized)}
    assert sample == [n for n in every if n in kept]  # in collection order
    assert {n.split("[")[0] for n in sample} == set(by_function)  # every function runs
    assert len(sample) == len(by_function)  # on one case each


def test_jattn_children_compile_into_the_sessions_cache(
    tmp_path_factory, session_compilation_cache
):
    # conftest.py's session fixture: a `jattn` command started without
    # --compilation-cache-dir reads its default from the environment the
    # tests' children inherit, and finds a folder of this session, not ~/.cache.
    from jattn.cli.common import DEFAULT_CACHE, cache_argument

    parser = argparse.ArgumentParser()
    cache_argument(parser)
    path = parser.parse_args([]).compilation_cache_dir
    assert path == session_compilation_cache != DEFAULT_CACHE
    assert pathlib.Path(path).is_relative_to(tmp_path_factory.getbasetemp())
