"""What `jattn.dot_product_attention` adds around its implementations: the
`jattn.attention_weights`, and the
chunked path's constant-relative-id tiles. The contracts every implementation
meets (float64 oracle forward and backward, causal, packing, dead rows,
padding, GQA/MQA, extreme magnitudes, bf16, shift invariance) are the test
base tests/attention_contract.py, run once per implementation in
tests/test_attention_contract.py; the choice of `implementation=None` is
tests/test_attention_rule.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_problem, run_with_grads, shaw
from oracle import attention_and_grads

import jattn
from jattn.attention import scores

FP32_TOL = dict(rtol=2e-5, atol=2e-5)


def test_chunked_long_band_uses_constant_relative_tiles():
    """Tiles far from the diagonal take the constant-relative-id branch; the
    result must still be exact (distances beyond k clip to the end ids)."""
    q, k, v = make_problem(7, 1, 40, 40, 2, 2, 4)
    rel = shaw(7, 2, 4, 4, 3)
    ct = np.random.default_rng(0).normal(size=(1, 40, 2, 4))
    out, grads = run_with_grads(
        "chunked",
        q,
        k,
        v,
        options={"block_q": 8, "block_k": 8},
        ct=ct,
        relative=rel,
        is_causal=True,
    )
    ref, ref_grads = attention_and_grads(q, k, v, cotangent=ct, relative=rel, is_causal=True)
    np.testing.assert_allclose(out, ref, **FP32_TOL)
    for name in ("query", "key", "value", "rel_key", "rel_value"):
        np.testing.assert_allclose(grads[name], ref_grads[name], **FP32_TOL, err_msg=name)


# --- fully masked rows ---------------------------------------------------------


# --- causal future cannot leak -------------------------------------------------


# --- packed neighbours cannot influence each other -----------------------------


# --- extreme magnitudes ----------------------------------------------------------


# --- bf16 --------------------------------------------------------------------------


# --- relative schemes: shift invariance, order sensitivity ----------------------


def test_attention_weights_are_what_the_output_mixes():
    """`jattn.attention_weights` rows sum to 1 over visible keys, are 0 on
    hidden ones, and reproduce the output when multiplied with the values."""
    q, k, v = make_problem(15, 1, 6, 6, 4, 2, 4)
    seg = np.array([[1, 1, 1, 2, 2, 2]])
    mask = np.ones((1, 1, 6, 6), bool)
    mask[..., 2, :] = False  # one fully hidden row
    rel = shaw(15, 4, 4, 4, 2, value=False)
    rules = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    kw = dict(rules, mask=mask, relative=rel)
    w = np.asarray(
        jattn.attention_weights(q, k, mask=mask, relative=rel, visibility=jattn.Visibility(**rules))
    )
    assert w.shape == (1, 4, 6, 6)
    sums = w.sum(-1)
    np.testing.assert_allclose(np.delete(sums, 2, axis=-1), 1.0, rtol=1e-6)
    assert np.all(w[..., 2, :] == 0.0)
    assert np.all(w[..., 3:, :3] == 0.0) and np.all(np.triu(w[0, 0], 1) == 0.0)
    out = np.asarray(jattn.dot_product_attention(q, k, v, **kw))
    v_rep = np.repeat(v, 2, axis=2)  # GQA: query head n reads kv head n // 2
    np.testing.assert_allclose(out, np.einsum("bnts,bsnh->btnh", w, v_rep), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.bfloat16])
def test_shaw_key_term_gather_matches_take_along_axis(dtype):
    """`scores.rel_gather` (values by `take_along_axis`, derivative by the
    row gather `rel_gather_rows`, whose transpose is one scatter-add of rows)
    against `rel_gather_by_take_along` with jax's own derivative: values,
    forward-mode tangents and gradients equal in float64, and bit for bit in
    float32 and bfloat16, where the main job's Shaw runs must not move. GQA
    shape (K=2, G=3), every id of R=7 used."""
    rng = np.random.default_rng(3)
    b, kh, g, t, s, rr = 2, 2, 3, 5, 9, 7
    qr_np, ct_np = rng.normal(size=(b, kh, g, t, rr)), rng.normal(size=(b, kh, g, t, s))
    dqr_np = rng.normal(size=qr_np.shape)
    r = jnp.asarray(rng.integers(0, rr, size=(b, t, s)), jnp.int32)
    assert np.isin(np.arange(rr), np.asarray(r)).all()

    with jax.enable_x64(dtype == jnp.float64):
        qr, ct, dqr = (jnp.asarray(x, dtype) for x in (qr_np, ct_np, dqr_np))

        def value_tangent_gradient(f):
            read = lambda x: f(x, r)  # noqa: E731
            return (*jax.jvp(read, (qr,), (dqr,)), jax.vjp(read, qr)[1](ct)[0])

        got = value_tangent_gradient(jax.jit(scores.rel_gather))
        want = value_tangent_gradient(scores.rel_gather_by_take_along)
        assert all(x.dtype == dtype for x in got)
        got, want = ([np.asarray(x, np.float64) for x in w] for w in (got, want))
        rows = np.asarray(scores.rel_gather_rows(qr, r), np.float64)
    for a, w in zip(got, want, strict=True):  # value, tangent, gradient
        np.testing.assert_array_equal(a, w)
    np.testing.assert_array_equal(rows, want[0])
    # The gradient is the weight mass per id, summed in float64 from the
    # cotangent as the dtype holds it.
    ct64 = ct_np
    if dtype != jnp.float64:
        ct64 = np.asarray(jnp.asarray(ct_np, dtype).astype(jnp.float32), np.float64)
    one_hot = np.asarray(r)[..., None] == np.arange(rr)  # [B, t, s, R]
    mass = np.einsum("bkgts,btsr->bkgtr", ct64, one_hot)
    tol = {jnp.float64: 1e-12, jnp.float32: 1e-5, jnp.bfloat16: 3e-2}[dtype]
    np.testing.assert_allclose(got[2], mass, rtol=tol, atol=tol)
