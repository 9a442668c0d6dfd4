"""Memory accounting: the closed-form counts against XLA's compiled figure
and against the cache the model really allocates."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import pytest

from jattn.attention import memory

ROOT = pathlib.Path(__file__).resolve().parent.parent


def xla_live_logit_arrays(is_causal: bool) -> int | None:
    """How many `[B, N, T, S]` float32 arrays XLA:CPU keeps live in the xla
    path's forward, by jaxlib version (see `jattn.attention.memory`): the
    scores and the weights (2), except that jaxlib >= 0.12 may write an
    unmasked softmax over the scores' buffer (1 or 2: CI's machine kept two
    at T = 512 where this one kept one, so it is not a fixed count; None)."""
    jaxlib_version = tuple(int(x) for x in jax.lib.__version__.split(".")[:2])
    return None if jaxlib_version >= (0, 12) and not is_causal else 2


@pytest.mark.parametrize("length", [512, 1024])
@pytest.mark.parametrize("causal", [False, True])
def test_xla_logits_formula_matches_xla(length, causal):
    """The compiled figure is the predicted count of live arrays, within 10%
    for two arrays; where XLA may reuse the scores' buffer, at least one
    array and at most the formula's two (query-sized arrays and row
    statistics, `B·N·T·(2H+1)` floats, are 26% of one array at T = 512)."""
    predicted = memory.attention_logits_bytes(1, 8, length, length, implementation="xla")
    compiled = memory.xla_attention_temp_bytes(1, 8, length, length, 64, is_causal=causal)
    if xla_live_logit_arrays(causal) == 2:
        assert abs(predicted.total - compiled) <= 0.10 * compiled, (predicted.total, compiled)
    else:
        assert predicted.per_array <= compiled, (predicted.per_array, compiled)
    # Never more than the formula's upper bound (two arrays) by over 10%.
    assert compiled <= 1.10 * predicted.total


def test_chunked_keeps_tiles_not_the_matrix():
    """At L=2048 the chunked path's compiled memory is tile-sized: far below
    the xla path's and close to the tile formula, not to T·S."""
    xla = memory.xla_attention_temp_bytes(1, 8, 2048, 2048, 64, is_causal=True)
    chunked = memory.xla_attention_temp_bytes(
        1, 8, 2048, 2048, 64, is_causal=True, implementation="chunked"
    )
    full = memory.attention_logits_bytes(1, 8, 2048, 2048, implementation="xla").per_array
    tile = memory.attention_logits_bytes(1, 8, 2048, 2048, implementation="chunked")
    assert chunked < xla / 4
    assert chunked < full  # less than a single [B, N, T, S] float32 array
    assert tile.total <= chunked


def test_kv_cache_formula_equals_the_models_cache():
    """Every cached key and value (self-attention over the context,
    cross-attention over the source), byte for byte, for MHA/GQA/MQA."""
    from jattn.models import Transformer, TransformerConfig, decoding

    base = TransformerConfig(
        vocab_size=50,
        d_model=32,
        num_heads=4,
        num_kv_heads=4,
        num_layers=3,
        d_ff=64,
        dropout_rate=0.0,
        max_len=64,
    )

    def cache_bytes(shapes, part=""):
        leaves = jax.tree_util.tree_leaves_with_path(shapes)
        return sum(
            x.size * x.dtype.itemsize
            for p, x in leaves
            if x.ndim and part in jax.tree_util.keystr(p)  # x.ndim: not the index
        )

    for kv in (4, 2, 1):  # MHA, GQA, MQA
        cfg = dataclasses.replace(base, num_kv_heads=kv)
        for source in (40, 17, None):  # None: init_cache's default, the context
            shapes = jax.eval_shape(
                lambda cfg=cfg, s=source: decoding.init_cache(Transformer(cfg), 2, 40, s)
            )
            sizes = dict(num_layers=3, num_kv_heads=kv, context=40, head_dim=8, batch=2)
            want = memory.kv_cache_bytes(**sizes, source_length=source)
            assert cache_bytes(shapes) == want, (kv, source, cache_bytes(shapes), want)
            self_only = memory.kv_cache_bytes(**sizes, source_length=0)
            assert cache_bytes(shapes, "self_attention") == self_only
            assert cache_bytes(shapes, "cross_attention") == want - self_only
            assert cache_bytes(shapes, "cached_") == want  # what benchmarks/memory.py counts
    # MQA's cache is the MHA cache divided by the head count.
    sizes = dict(num_layers=6, context=100, head_dim=64, source_length=30)
    assert memory.kv_cache_bytes(num_kv_heads=8, **sizes) == 8 * memory.kv_cache_bytes(
        num_kv_heads=1, **sizes
    )


def test_unknown_implementation_is_an_error():
    with pytest.raises(ValueError, match="unknown implementation 'cudnn'"):
        memory.attention_logits_bytes(1, 1, 4, 4, implementation="cudnn")


def test_bench_memory_script_runs(tmp_path):
    import runpy
    import sys

    out = tmp_path / "memory.md"
    argv = sys.argv
    sys.argv = ["memory.py", "--config", "numbers", "--lengths", "64", "--out", str(out)]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(ROOT / "benchmarks" / "memory.py"), run_name="__main__")
        assert e.value.code == 0
    finally:
        sys.argv = argv
    text = out.read_text()
    assert "| 64 | encoder self |" in text and "MQA (kv heads 1)" in text
