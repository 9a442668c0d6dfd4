"""A model's memory with each positional scheme: no `[T, S]` array.

DESIGN.md: a model's positional bias goes through score mods, applied per
tile, so "no scheme materialises `[B, N, T, S]`". Read at the model level:
XLA's compiled temporaries of the whole encoder-decoder's forward and
backward through `attention_impl="chunked"` grow at most linearly in L for
every scheme. Linear growth `a + b L` doubles its increment when L doubles;
a `[T, S]` array quadruples it. The measure is `model_temp_bytes` of
benchmarks/model_memory.py (what `jattn bench model_memory` prints), on a
tiny model at L = 1024, 2048, 4096 (above the 512-row tiles, so the tiles
themselves are a constant), compiled and never run.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import pytest

from jattn.models import SCHEMES

ROOT = pathlib.Path(__file__).resolve().parent.parent
LENGTHS = (1024, 2048, 4096)
SIZES = dict(vocab_size=32, d_model=16, num_heads=2, num_layers=1, d_ff=32)
MIB = 2**20


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_model_memory", ROOT / "benchmarks" / "model_memory.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


@functools.cache
def temp_bytes(position: str, length: int) -> int:
    return BENCH.model_temp_bytes(BENCH.model_config(position, length, **SIZES), length)


def increments(position: str) -> tuple[int, int]:
    """Growth of the compiled temporaries from L to 2L and from 2L to 4L."""
    a, b, c = (temp_bytes(position, n) for n in LENGTHS)
    return b - a, c - b


def grows_linearly(d1: int, d2: int) -> bool:
    """The second doubling's increment at most 3x the first (linear: 2x;
    quadratic: 4x), plus 1 MiB for XLA's buffer packing."""
    return d2 <= 3 * d1 + MIB


_SLOW = pytest.mark.slow
SCHEMES_UNDER_TEST = [
    "alibi",
    "t5",
    "fire",
    pytest.param("none", marks=_SLOW),
    pytest.param("rope", marks=_SLOW),
    pytest.param("shaw", marks=_SLOW),
    pytest.param("kerple", marks=_SLOW),
    pytest.param("xpos", marks=_SLOW),
]


@pytest.mark.parametrize("position", SCHEMES_UNDER_TEST)
def test_model_temporaries_grow_at_most_linearly_in_length(position):
    d1, d2 = increments(position)
    assert grows_linearly(d1, d2), (
        f"position={position!r}: compiled temporaries grew by {d1 / MIB:.1f} MiB "
        f"from L={LENGTHS[0]} to {LENGTHS[1]} and {d2 / MIB:.1f} MiB from "
        f"{LENGTHS[1]} to {LENGTHS[2]}: a [T, S]-sized buffer"
    )


def test_the_measure_sees_a_materialised_bias(monkeypatch):
    """The same check on T5 with its bias built as `[N, L, L]` (the models
    before score mods) fails: the measure sees a `[T, S]` array."""
    name = BENCH.MATERIALISED
    monkeypatch.setitem(SCHEMES, name, BENCH.MaterialisedT5(name))
    d1, d2 = increments(name)
    assert not grows_linearly(d1, d2), (d1, d2)
    one_bias = 4 * SIZES["num_heads"] * (LENGTHS[2] ** 2 - LENGTHS[1] ** 2)  # float32 [N, L, L]
    assert d2 >= one_bias, (d2, one_bias)
