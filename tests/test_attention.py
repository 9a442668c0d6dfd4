"""What `jattn.dot_product_attention` adds around its implementations: the
`jattn.attention_weights`, and the
chunked path's constant-relative-id tiles. The contracts every implementation
meets (float64 oracle forward and backward, causal, packing, dead rows,
padding, GQA/MQA, extreme magnitudes, bf16, shift invariance) are the test
base tests/attention_contract.py, run once per implementation in
tests/test_attention_contract.py; the choice of `implementation=None` is
tests/test_attention_rule.py."""

from __future__ import annotations

import numpy as np
from attention_cases import make_problem, run_with_grads, shaw
from oracle import attention_and_grads

import jattn

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
