"""A model's memory with each positional scheme: no `[T, S]` array.

docs/design.md: a model's positional bias goes through score mods, applied per
tile, so "no scheme materialises `[B, N, T, S]`". Read at the model level:
XLA's compiled temporaries of the whole encoder-decoder's forward and
backward through `attention_impl="chunked"` grow at most linearly in L for
every scheme: from L = 2048 to 4096 they grow by less than half of what one
float32 `[T, S]` array would (24 MiB; the bias and its gradient as `[N, T, S]`
would add 8 times that). The model is tiny (d_model 16, 2 heads), so what
grows linearly (6.3 MiB for `none` here, about 800 floats a token) stays
well below a `[T, S]` row's 4096 floats a token; both lengths are above the
512-row tiles, so the tiles themselves are a constant. The measure is `model_temp_bytes` of
benchmarks/memory.py (what its `--schemes` mode prints),
compiled and never run.

Every built-in scheme that acts inside attention (`Scheme.relative`) is
measured, at the first of its settings in tests/registry_mods.py (Shaw with
its bias term too), so a new one is covered with no edit here.

(A check on the ratio of successive increments, linear 2x against quadratic
4x, was tried first and dropped: XLA's buffer packing moves small
increments by a few MiB, enough to make linear T5 look 4x.)
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import pytest
import registry_mods

from jattn.models import SCHEMES

ROOT = pathlib.Path(__file__).resolve().parent.parent
LENGTHS = (2048, 4096)
SIZES = dict(vocab_size=32, d_model=16, num_heads=2, num_layers=1, d_ff=32)
MIB = 2**20


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


@functools.cache
def temp_bytes(position: str, length: int) -> int:
    setting = registry_mods.settings_of(position)[0]
    cfg = BENCH.model_config(
        position, length, **SIZES, **registry_mods.setting_fields(position, setting)
    )
    return BENCH.model_temp_bytes(cfg, length)


def growth(position: str) -> int:
    """Growth of the compiled temporaries from L = 2048 to 4096 (bytes)."""
    small, large = (temp_bytes(position, n) for n in LENGTHS)
    return large - small


# The growth of one float32 [T, S] array from L = 2048 to 4096, and the limit: half of it.
TS_GROWTH = 4 * (LENGTHS[1] ** 2 - LENGTHS[0] ** 2)
LIMIT = TS_GROWTH // 2


def _schemes_under_test() -> list:
    """Every built-in scheme acting inside attention; those with a score mod
    run by default, the rest (rotations, Shaw's tables alone) are marked slow."""
    with_mod = {built.scheme for built in registry_mods.small_mods().values()}
    return [
        pytest.param(name, marks=() if name in with_mod else pytest.mark.slow)
        for name, scheme in sorted(SCHEMES.items())
        if scheme.relative and type(scheme).__module__.startswith("jattn.")
    ]


SCHEMES_UNDER_TEST = _schemes_under_test()


@pytest.mark.parametrize("position", SCHEMES_UNDER_TEST)
def test_model_temporaries_grow_at_most_linearly_in_length(position):
    d = growth(position)
    assert d < LIMIT, (
        f"position={position!r}: compiled temporaries grew by {d / MIB:.1f} MiB from "
        f"L={LENGTHS[0]} to {LENGTHS[1]}, at least half a float32 [T, S] array's "
        f"{TS_GROWTH / MIB:.0f} MiB"
    )


def test_the_measure_sees_a_materialised_bias(monkeypatch):
    """The same check on T5 with its bias built as `[N, L, L]` (the models
    before score mods) fails: the measure sees the `[T, S]` arrays, at least
    the bias's own growth."""
    name = BENCH.MATERIALISED
    monkeypatch.setitem(SCHEMES, name, BENCH.MaterialisedT5(name))
    d = growth(name)
    assert d >= SIZES["num_heads"] * TS_GROWTH, (d, TS_GROWTH)
