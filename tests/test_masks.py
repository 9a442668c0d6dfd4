"""Mask composition as properties (hypothesis), and agreement between the
standalone masks and what attention does with the same arguments."""

from __future__ import annotations

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from attention_cases import call, make_problem
from hypothesis import given

from jattn import masks

ids = st.lists(st.integers(0, 3), min_size=1, max_size=8)
pos = st.lists(st.integers(-5, 20), min_size=1, max_size=8)


@given(q=pos, kv=pos)
def test_causal_mask_definition(q, kv):
    m = np.asarray(masks.causal(jnp.array(q), jnp.array(kv)))
    assert m.shape == (len(q), len(kv)) and m.dtype == bool
    assert all(m[t, s] == (kv[s] <= q[t]) for t in range(len(q)) for s in range(len(kv)))


@given(q=ids, kv=ids)
def test_segment_mask_is_symmetric_equality(q, kv):
    m = np.asarray(masks.segment(jnp.array(q), jnp.array(kv)))
    mt = np.asarray(masks.segment(jnp.array(kv), jnp.array(q)))
    np.testing.assert_array_equal(m, mt.T)
    # id 0 is padding: it sees nothing and is seen by nothing
    assert all(m[t, s] == (q[t] == kv[s] != 0) for t in range(len(q)) for s in range(len(kv)))


@given(seg=ids, data=st.data())
def test_combine_is_logical_and_and_skips_none(seg, data):
    n = len(seg)
    p = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    valid = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    a = masks.causal(jnp.array(p), jnp.array(p))
    b = masks.segment(jnp.array(seg), jnp.array(seg))
    c = masks.padding(jnp.array(valid), jnp.array(valid))
    got = np.asarray(masks.combine(a, None, b, c))
    np.testing.assert_array_equal(got, np.asarray(a) & np.asarray(b) & np.asarray(c))
    # order does not matter, and combining with itself changes nothing
    np.testing.assert_array_equal(np.asarray(masks.combine(c, b, a)), got)
    np.testing.assert_array_equal(np.asarray(masks.combine(got, got)), got)
    assert masks.combine(None, None) is None


@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4))
def test_padding_from_lengths(lengths):
    v = np.asarray(masks.padding_from_lengths(jnp.array(lengths), 6))
    assert v.shape == (len(lengths), 6)
    np.testing.assert_array_equal(v.sum(-1), lengths)
    assert all(v[i, :n].all() and not v[i, n:].any() for i, n in enumerate(lengths))


def test_dense_mask_equals_builtin_causal_and_segments():
    """Passing the composed boolean mask gives exactly what the built-in
    causal + segment arguments give."""
    q, k, v = make_problem(0, 2, 6, 6, 2, 2, 4)
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    p = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    dense = masks.as_logits_mask(masks.combine(masks.causal(p, p), masks.segment(seg, seg)))
    assert dense.shape == (2, 1, 6, 6)
    for impl in ("xla", "chunked"):
        a = call(impl, q, k, v, mask=dense)
        b = call(
            impl,
            q,
            k,
            v,
            is_causal=True,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            q_positions=p,
            kv_positions=p,
        )
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
