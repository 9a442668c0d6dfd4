"""Positional schemes: hand-computed values, and the relational properties
each scheme promises (shift invariance where it is relative)."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from attention_cases import make_problem
from hypothesis import given

import jattn
from jattn import positions


def test_sinusoidal_is_the_papers_interleaved_formula():
    pe = np.asarray(positions.sinusoidal(jnp.arange(4), 6))
    assert pe.shape == (4, 6)
    # By hand, p = 3: i = 0 -> angle 3; i = 1 -> 3 / 10000^(2/6); i = 2 -> 3 / 10000^(4/6).
    for i, angle in enumerate([3.0, 3.0 / 10000 ** (2 / 6), 3.0 / 10000 ** (4 / 6)]):
        assert pe[3, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
        assert pe[3, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)
    np.testing.assert_allclose(pe[0], [0, 1, 0, 1, 0, 1], atol=1e-7)


def test_sinusoidal_batched_and_odd_dim_error():
    pe = positions.sinusoidal(jnp.array([[0, 1], [5, 6]]), 8)
    assert pe.shape == (2, 2, 8)
    with pytest.raises(ValueError, match="even"):
        positions.sinusoidal(jnp.arange(3), 5)


@given(
    q=st.lists(st.integers(-50, 50), min_size=1, max_size=6),
    kv=st.lists(st.integers(-50, 50), min_size=1, max_size=6),
    k=st.integers(0, 8),
)
def test_relative_ids_are_clipped_offsets(q, kv, k):
    r = np.asarray(positions.relative_ids(jnp.array(q), jnp.array(kv), k))
    assert r.shape == (len(q), len(kv))
    assert r.min() >= 0 and r.max() <= 2 * k
    for t, qp in enumerate(q):
        for s, kp in enumerate(kv):
            assert r[t, s] == min(max(kp - qp, -k), k) + k


@given(shift=st.integers(-1000, 1000))
def test_relative_ids_shift_invariant(shift):
    q, kv = jnp.arange(5), jnp.arange(7)
    np.testing.assert_array_equal(
        positions.relative_ids(q, kv, 3), positions.relative_ids(q + shift, kv + shift, 3)
    )


def test_rope_logits_depend_only_on_offset():
    q, k, _ = make_problem(0, 1, 6, 6, 2, 2, 8)
    pos = jnp.arange(6)[None]

    def logits(p):
        qr = positions.rope(jnp.asarray(q), p)
        kr = positions.rope(jnp.asarray(k), p)
        return np.asarray(jnp.einsum("BTNH,BSNH->BNTS", qr, kr))

    np.testing.assert_allclose(logits(pos + 123), logits(pos), rtol=1e-4, atol=1e-4)
    # It is a rotation: norms are preserved, and position 0 is the identity.
    qr = positions.rope(jnp.asarray(q), pos)
    np.testing.assert_allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(qr)[:, 0], q[:, 0], atol=1e-6)


def test_rope_partial_fraction_passes_the_rest_through():
    q, _, _ = make_problem(1, 1, 4, 4, 1, 1, 8)
    out = np.asarray(positions.rope(jnp.asarray(q), jnp.arange(4)[None] + 7, fraction=0.5))
    np.testing.assert_array_equal(out[..., 4:], q[..., 4:])
    assert not np.allclose(out[..., :4], q[..., :4])


def test_alibi_slopes_match_the_paper():
    np.testing.assert_allclose(positions.alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    # Not a power of two: slopes of 4 heads, then every other slope of 8.
    s6 = np.asarray(positions.alibi_slopes(6))
    np.testing.assert_allclose(s6[:4], [2.0 ** (-2 * (i + 1)) for i in range(4)])
    np.testing.assert_allclose(s6[4:], [2.0**-1, 2.0**-3])


def test_alibi_bias_values_and_shift_invariance():
    slopes = positions.alibi_slopes(2)
    qp, kp = jnp.array([[0, 3]]), jnp.array([[0, 1, 5]])
    bias = np.asarray(oracle.alibi_bias(slopes, qp, kp))
    assert bias.shape == (1, 2, 2, 3)
    np.testing.assert_allclose(bias[0, 0, 1], [-3 / 16, -2 / 16, -2 / 16])
    np.testing.assert_allclose(oracle.alibi_bias(slopes, qp + 9, kp + 9), bias)


def test_t5_buckets_hand_values():
    q = jnp.zeros((1, 1), jnp.int32)
    kv = jnp.array([[-200, -20, -3, 0, 3, 20, 200]])
    b = np.asarray(oracle.t5_buckets(q, kv, num_buckets=32, max_distance=128))[0, 0]
    # bidirectional: 16 buckets per side, exact below 8.
    assert b[3] == 0 and b[2] == 3 and b[4] == 16 + 3
    assert b[0] == 15 and b[6] == 31  # saturate at max_distance
    assert 8 <= b[1] < 15 and 24 <= b[5] < 31
    # monotone in distance on each side
    d = np.arange(0, 300)
    one_side = np.asarray(oracle.t5_buckets(q, jnp.asarray(-d)[None], 32, 128))[0, 0]
    assert np.all(np.diff(one_side) >= 0)
    shifted = oracle.t5_buckets(q + 50, kv + 50)
    np.testing.assert_array_equal(shifted, oracle.t5_buckets(q, kv))


def test_t5_bias_lookup_layout():
    table = jnp.arange(32 * 3, dtype=jnp.float32).reshape(32, 3)
    buckets = jnp.array([[[0, 5], [31, 2]]])  # [B=1, T=2, S=2]
    bias = np.asarray(oracle.t5_bias(table, buckets))
    assert bias.shape == (1, 3, 2, 2)
    assert bias[0, 2, 1, 0] == table[31, 2]


def test_shaw_relative_is_a_pytree():
    import jax

    rel = jattn.ShawRelative(key=jnp.ones((5, 4)), value=None, max_distance=2)
    leaves, treedef = jax.tree_util.tree_flatten(rel)
    assert len(leaves) == 1
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.max_distance == 2 and back.num_relative == 5
