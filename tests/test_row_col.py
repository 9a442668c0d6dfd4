"""Row and column terms (`row_col_bias=(a, c)`, docs/score_mods.md): logit
(b, n, i, j) gains `a[b, n, i] + c[b, n, j]`, read per tile in O(T + S).

Every check is float64 against the independent oracle (tests/oracle.py) fed
the materialised bias `a[:, :, :, None] + c[:, :, None, :]`: the output and
the gradients to q, k, v and to a and c (the oracle's dbias summed over keys
and over queries), through xla and chunked (tiles smaller than the problem and
not dividing it, so padding and skipped tiles are exercised), causal, packed
and cross-attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from attention_cases import normal_form

import jattn
from jattn.attention.chunked import attention_chunked
from jattn.attention.xla import attention_xla

B, T, S, N, K, H = 2, 19, 19, 4, 2, 8


def _packed():
    ids = np.array([[1] * 7 + [2] * 9 + [0] * 3, [1] * 12 + [2] * 7], np.int32)
    pos = np.zeros_like(ids)
    for r in range(ids.shape[0]):
        for i in range(1, ids.shape[1]):
            pos[r, i] = pos[r, i - 1] + 1 if ids[r, i] == ids[r, i - 1] else 0
    return dict(q_segment_ids=ids, kv_segment_ids=ids, q_positions=pos, kv_positions=pos)


LAYOUTS = {
    "causal": lambda: dict(is_causal=True),
    "packed": _packed,
    "packed_causal": lambda: dict(_packed(), is_causal=True),
    "cross": lambda: {},
}


def _problem(seed, t=T, s=S):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, N, H))
    k = rng.normal(size=(B, s, K, H))
    v = rng.normal(size=(B, s, K, H))
    a = rng.normal(size=(B, N, t))
    c = rng.normal(size=(B, N, s))
    ct = rng.normal(size=(B, t, N, H))
    return q, k, v, a, c, ct


IMPLS = {
    "xla": attention_xla,
    # tiles that do not divide 19 and differ by axis: padding, skipped tiles
    "chunked": lambda nf: attention_chunked(nf, block_q=5, block_k=4),
}


def _run(impl, q, k, v, a, c, ct, **kw):
    """Output and gradients (q, k, v, a, c) of one implementation, float64."""

    def f(q, k, v, a, c):
        nf = normal_form(q, k, v, row_col_bias=(a, c), **kw)
        return IMPLS[impl](nf)[0]

    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, a, c)]
        out, vjp = jax.vjp(f, *args)
        grads = vjp(jnp.asarray(ct, jnp.float64))
        return np.asarray(out), [np.asarray(g) for g in grads]


def _reference(q, k, v, a, c, ct, **kw):
    """The oracle on the materialised bias; d a and d c are its dbias's row and column sums."""
    bias = a[:, :, :, None] + c[:, :, None, :]
    out, ref = oracle.attention_and_grads(q, k, v, bias=bias, cotangent=ct, **kw)
    return out, [ref["query"], ref["key"], ref["value"], ref["bias"].sum(-1), ref["bias"].sum(-2)]


def _close(got, want, what, rtol=1e-6):
    """Float64 agreement up to the ~1e-7 that jattn's float64 path and the oracle
    differ by without any row or column term (a few orders below float32's)."""
    atol = rtol * max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def _assert_matches(got, want):
    _close(got[0], want[0], "out")
    for name, g, r in zip(("dq", "dk", "dv", "da", "dc"), got[1], want[1], strict=True):
        _close(g, r, name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_the_materialised_bias_in_float64(impl, layout):
    t, s = (T, 11) if layout == "cross" else (T, S)
    q, k, v, a, c, ct = _problem(0, t, s)
    kw = LAYOUTS[layout]()
    _assert_matches(_run(impl, q, k, v, a, c, ct, **kw), _reference(q, k, v, a, c, ct, **kw))


def test_the_column_term_acts_and_the_row_term_cancels():
    """The check above could pass with terms never added: c changes the output
    and has a gradient; a row term shifts a whole softmax row, so it leaves
    the output unchanged and its gradient (a row sum of dS) is zero, as the
    oracle's is."""
    q, k, v, a, c, ct = _problem(1)
    kw = LAYOUTS["causal"]()
    with_terms = _run("chunked", q, k, v, a, c, ct, **kw)
    row_only = _run("chunked", q, k, v, a, 0 * c, ct, **kw)
    without = _run("chunked", q, k, v, 0 * a, 0 * c, ct, **kw)
    assert np.max(np.abs(with_terms[0] - without[0])) > 1e-2
    assert np.max(np.abs(with_terms[1][4])) > 1e-2
    _close(row_only[0], without[0], "out with a row term alone")
    _close(with_terms[1][3], np.zeros_like(a), "da")


def test_public_entry_point_and_its_errors():
    q, k, v, a, c, _ = _problem(2)
    q, k, v, a, c = (jnp.asarray(x, jnp.float32) for x in (q, k, v, a, c))
    bias = a[:, :, :, None] + c[:, :, None, :]
    want = jattn.dot_product_attention(q, k, v, bias, is_causal=True, implementation="xla")
    for impl in (None, "xla", "chunked"):
        got = jattn.dot_product_attention(
            q, k, v, is_causal=True, row_col_bias=(a, c), implementation=impl
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(impl))
    with pytest.raises(ValueError, match="row_col_bias's column term must have shape"):
        jattn.dot_product_attention(q, k, v, row_col_bias=(a, c[:, :, :3]))
    with pytest.raises(TypeError, match="row_col_bias must be a pair"):
        jattn.dot_product_attention(q, k, v, row_col_bias=a)
    with pytest.raises(ValueError, match="row_col_bias .* is not in the Pallas kernels"):
        jattn.dot_product_attention(q, k, v, row_col_bias=(a, c), implementation="pallas")
    with pytest.raises(ValueError, match="cannot take row_col_bias"):
        jattn.dot_product_attention(q, k, v, row_col_bias=(a, c), implementation="cudnn")
