"""CoPE: the materialised form against the paper's formula written as loops in
numpy (float64), the tiled form against the materialised one forward and
backward (the embedding table's gradient included), segments, clipping, empty
rows, and memory linear in L."""

from __future__ import annotations

import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.attention import cope

COPE = cope.cope_attention
COPE_XLA = cope.cope_attention_xla


def loop_oracle(q, k, v, table, q_seg, kv_seg):
    """The paper's definition, one logit at a time (default positions)."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    table = np.broadcast_to(table, (n, *table.shape[-2:]))
    npos = table.shape[1]
    out = np.zeros((b, t, n, v.shape[-1]))
    for bi in range(b):
        for hi in range(n):
            kh = hi // g
            for i in range(t):
                seen = [
                    j for j in range(min(i + 1, k.shape[1])) if q_seg[bi, i] == kv_seg[bi, j] != 0
                ]
                if not seen:
                    continue
                s = {j: q[bi, i, hi] @ k[bi, j, kh] / math.sqrt(h) for j in seen}
                z = []
                for j in seen:
                    p = min(sum(1 / (1 + math.exp(-s[c])) for c in seen if c >= j), npos - 1)
                    lo, hi_ = math.floor(p), math.ceil(p)
                    e = (1 - (p - lo)) * table[hi, lo] + (p - lo) * table[hi, hi_]
                    z.append(s[j] + q[bi, i, hi] @ e)
                w = np.exp(np.array(z) - max(z))
                w /= w.sum()
                out[bi, i, hi] = sum(wj * v[bi, j, kh] for wj, j in zip(w, seen, strict=True))
    return out


def inputs(seed, b=2, t=13, s=13, n=4, kv=2, h=8, ev=6, npos=5, per_head=False):
    r = np.random.default_rng(seed)
    q = r.normal(size=(b, t, n, h))
    k = r.normal(size=(b, s, kv, h))
    v = r.normal(size=(b, s, kv, ev))
    e = r.normal(size=(n, npos, h) if per_head else (npos, h))
    return q, k, v, e


def packed(b, length):
    """Two packed segments, then padding (id 0) at the end of row 0."""
    seg = np.ones((b, length), np.int32)
    seg[:, length // 2 :] = 2
    seg[0, -3:] = 0
    return seg


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("npos", [3, 20])  # 3: counts clip; 20: they never do
def test_materialised_equals_the_papers_formula(segments, npos):
    q, k, v, e = inputs(0, npos=npos)
    seg = packed(2, 13) if segments else np.ones((2, 13), np.int32)
    with jax.enable_x64(True):
        got = COPE_XLA(q, k, v, e, q_segment_ids=seg, kv_segment_ids=seg)
    np.testing.assert_allclose(got, loop_oracle(q, k, v, e, seg, seg), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("blocks", [(4, 4), (5, 3), (16, 16)])
@pytest.mark.parametrize("per_head", [False, True])
def test_tiled_equals_materialised_forward_and_backward(segments, blocks, per_head):
    """The reference reads `q . e` with two `take_along_axis` and their autodiff
    (`lookup_by_gathers`), so the hand-written lookup's backward is checked whole."""
    q, k, v, e = inputs(1, npos=6, per_head=per_head)
    seg = packed(2, 13) if segments else None
    ct = np.random.default_rng(2).normal(size=(2, 13, 4, 6))
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg)
    with jax.enable_x64(True), mock.patch.object(cope, "lookup", cope.lookup_by_gathers):
        want, want_vjp = jax.vjp(lambda *a: COPE_XLA(*a, **kw), q, k, v, e)
    with jax.enable_x64(True):
        got, got_vjp = jax.vjp(
            lambda *a: COPE(*a, **kw, block_q=blocks[0], block_k=blocks[1]), q, k, v, e
        )
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
        for name, g, w in zip(["q", "k", "v", "table"], got_vjp(ct), want_vjp(ct), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-11, err_msg=f"d{name}")
            assert np.abs(np.asarray(w)).max() > 1e-3, name  # every input is reached


def test_the_gradient_to_the_table_is_the_finite_difference():
    """The interpolation's gradient, checked against numbers, not another autodiff."""
    q, k, v, e = inputs(3, t=7, s=7, npos=4)
    ct = np.random.default_rng(4).normal(size=(2, 7, 4, 6))
    with jax.enable_x64(True):
        loss = lambda e: jnp.sum(COPE(q, k, v, e, block_q=3, block_k=2) * ct)  # noqa: E731
        grad = np.asarray(jax.grad(loss)(e))
        eps = 1e-6
        for idx in [(0, 0), (1, 3), (2, 5), (3, 7)]:
            d = np.zeros_like(e)
            d[idx] = eps
            fd = (loss(e + d) - loss(e - d)) / (2 * eps)
            np.testing.assert_allclose(grad[idx], fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_flat_lookup_is_the_gathers_value_and_gradients(dtype):
    """Both forms' `lookup` (a flat gather, a hand-written scatter-add)
    against the reference's two `take_along_axis`: values and both gradients,
    at counts between integers, at exact integers (the kink, where both give
    the slope 0) and at the clip, `P - 1`."""
    r = np.random.default_rng(11)
    npos = 5
    qe = r.normal(size=(2, 3, 4, npos)).astype(dtype)
    p = r.uniform(0, npos - 1, size=(2, 3, 4, 6)).astype(dtype)
    p[..., 0], p[..., 1], p[0, 0, 0, 2] = 0.0, npos - 1, 2.0
    ct = r.normal(size=p.shape).astype(dtype)

    def value_and_grads(f):
        return [f(qe, p), *jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1))(qe, p)]

    with jax.enable_x64(dtype == np.float64):
        got, want = value_and_grads(cope.lookup), value_and_grads(cope.lookup_by_gathers)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == np.float64 else dict(rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype
        np.testing.assert_allclose(g, w, **tol)
    assert np.all(np.asarray(got[2])[..., :2] == 0) and np.abs(np.asarray(got[2])).max() > 0


@pytest.mark.parametrize("fn", [COPE, COPE_XLA])
def test_a_nan_query_stays_in_its_row(fn):
    """A NaN count indexes the table at an undefined integer; the lookup clamps
    it, so the NaN reaches that query's row only, forward and backward."""
    q, k, v, e = (np.asarray(a, np.float32) for a in inputs(8))
    q[0, 5, 1, 3] = np.nan
    nan = np.zeros((2, 13, 4, 6), bool)
    nan[0, 5, 1] = True
    with jax.debug_nans(False):  # tests/conftest.py turns them into errors
        out = np.asarray(fn(q, k, v, e))
        dq = np.asarray(jax.grad(lambda q: jnp.sum(jnp.where(nan, 0.0, fn(q, k, v, e))))(q))
    assert np.isnan(out[nan]).all() and np.isfinite(out[~nan]).all()
    assert np.isfinite(np.delete(dq, 5, axis=1)).all()


def test_positions_decide_what_is_visible():
    q, k, v, e = inputs(5, t=5, s=11)
    qp = np.broadcast_to(np.arange(6, 11, dtype=np.int32), (2, 5))
    with jax.enable_x64(True):
        want = COPE_XLA(q, k, v, e, q_positions=qp)
        got = COPE(q, k, v, e, q_positions=qp, block_q=2, block_k=4)
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("fn", [COPE, COPE_XLA])
def test_empty_rows_are_zero_with_finite_gradients(fn):
    q, k, v, e = inputs(6)
    q_seg = np.ones((2, 13), np.int32)
    q_seg[:, :4] = 3  # no key has segment 3
    kv_seg = np.ones((2, 13), np.int32)
    with jax.enable_x64(True):
        run = lambda *a: fn(*a, q_segment_ids=q_seg, kv_segment_ids=kv_seg)  # noqa: E731
        out = run(q, k, v, e)
        grads = jax.grad(lambda *a: jnp.sum(run(*a) ** 2), argnums=(0, 1, 2, 3))(q, k, v, e)
    assert np.all(np.asarray(out)[:, :4] == 0) and np.abs(np.asarray(out)[:, 4:]).max() > 0
    assert all(np.isfinite(g).all() for g in grads)


def test_bad_table_is_a_one_line_error():
    q, k, v, _ = inputs(7)
    with pytest.raises(ValueError, match=r"must be \[npos_max, H\] or \[N, npos_max, H\]"):
        COPE(q, k, v, np.zeros((5, 3)))


def compiled_temp_bytes(fn, length, grad, npos=64):
    q = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.float32)
    e = jax.ShapeDtypeStruct((npos, 64), jnp.float32)
    f = (lambda *a: jax.grad(lambda *b: jnp.sum(fn(*b)), argnums=(0, 1, 2, 3))(*a)) if grad else fn
    return jax.jit(f).lower(q, kv, kv, e).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("grad", [False, True])
def test_memory_is_linear_in_length(grad):
    """XLA's compiled temporary memory, as tests/test_memory.py reads it: the
    tiled form at L = 4096 about twice its L = 2048 figure and well below one
    `[B, N, L, L]` float32 array, which the materialised form exceeds."""
    tiled = {n: compiled_temp_bytes(COPE, n, grad) for n in (2048, 4096)}
    one_matrix = 4 * 4096 * 4096 * 4
    assert tiled[4096] < 2.5 * tiled[2048], tiled
    # The backward keeps one query tile's residuals, O(block_q * L) per head.
    assert tiled[4096] < one_matrix / (2 if grad else 8), (tiled, one_matrix)
    if not grad:
        assert compiled_temp_bytes(COPE_XLA, 4096, False) > one_matrix
