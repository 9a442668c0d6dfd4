"""Contracts of `jattn.dot_product_attention`, each test shaped like the
contract it guards, for every pure-JAX implementation (the Pallas kernel has
its own file, tests/test_pallas.py, which runs the same oracle comparisons in
interpret mode)."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import (
    call,
    make_problem,
    packed_ids,
    packed_positions,
    run_with_grads,
    shaw,
)
from oracle import attention_and_grads

import jattn

# The chunked path with tiny tiles so that every test crosses tile borders,
# including lengths that are not a multiple of the tile.
IMPLS = {
    "xla": ("xla", None),
    "chunked": ("chunked", {"block_q": 4, "block_k": 5}),
    "chunked_sq": ("chunked", {"block_q": 8, "block_k": 8}),
}
FP32_TOL = dict(rtol=2e-5, atol=2e-5)
# Most contracts run on one tiling; the square-tile variant joins the tests
# where tile geometry matters most.
MAIN = ["xla", "chunked"]


def assert_matches_oracle(impl_key, q, k, v, tol=FP32_TOL, **kw):
    impl, options = IMPLS[impl_key]
    ct = np.random.default_rng(3).normal(size=q.shape[:3] + (v.shape[-1],))
    out, grads = run_with_grads(impl, q, k, v, options=options, ct=ct, **kw)
    ref, ref_grads = attention_and_grads(q, k, v, cotangent=ct, **kw)
    np.testing.assert_allclose(out, ref, **tol, err_msg="forward")
    for name, g in ref_grads.items():
        if g is None:
            assert grads[name] is None, name
            continue
        np.testing.assert_allclose(grads[name], g, **tol, err_msg=f"d{name}")
    return out, grads


# --- the worked example from the article ------------------------------------


@pytest.mark.parametrize("impl", ["xla", "chunked", "pallas"])
def test_three_key_worked_example(impl):
    """query [1,0]; keys [1,0],[0,1],[-1,0]; values 10,20,40 -> about 17.04."""
    q = np.array([1.0, 0.0], np.float32).reshape(1, 1, 1, 2)
    k = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], np.float32).reshape(1, 3, 1, 2)
    v = np.array([10.0, 20.0, 40.0], np.float32).reshape(1, 3, 1, 1)
    out = jattn.dot_product_attention(q, k, v, implementation=impl)
    # By hand: scores .707, 0, -.707 -> weights .576, .284, .140.
    w = np.exp(np.array([1, 0, -1]) / np.sqrt(2))
    w /= w.sum()
    np.testing.assert_allclose(w, [0.576, 0.284, 0.140], atol=1e-3)
    assert round(float(out.squeeze()), 2) == 17.04
    np.testing.assert_allclose(float(out.squeeze()), float(w @ [10, 20, 40]), rtol=1e-6)


# --- every implementation against the float64 oracle, forward and backward ----

B, T, S, H = 2, 13, 17, 8
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("heads", list(HEADS))
def test_plain_and_cross_attention(impl, heads):
    n, kh = HEADS[heads]
    q, k, v = make_problem(0, B, T, S, n, kh, H, hv=6)
    assert_matches_oracle(impl, q, k, v)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_causal_self_attention(impl):
    q, k, v = make_problem(1, B, T, T, 4, 2, H)
    assert_matches_oracle(impl, q, k, v, is_causal=True)


@pytest.mark.parametrize("impl", MAIN)
def test_mask_and_bias(impl):
    q, k, v = make_problem(2, B, T, S, 4, 2, H)
    rng = np.random.default_rng(2)
    mask = rng.random((B, 1, T, S)) > 0.4
    bias = rng.normal(size=(4, 1, S)).astype(np.float32)  # broadcast over B and T
    _, grads = assert_matches_oracle(impl, q, k, v, mask=mask, bias=bias)
    assert grads["bias"].shape == bias.shape


@pytest.mark.parametrize("impl", MAIN)
def test_full_bias_per_head(impl):
    q, k, v = make_problem(3, B, T, S, 4, 4, H)
    bias = np.random.default_rng(3).normal(size=(B, 4, T, S)).astype(np.float32)
    assert_matches_oracle(impl, q, k, v, bias=bias, is_causal=True, scale=0.3)


@pytest.mark.parametrize("impl", MAIN)
def test_segments_and_positions(impl):
    q, k, v = make_problem(4, B, T, T, 4, 2, H)
    seg = np.stack([packed_ids([5, 6], T), packed_ids([13], T)])
    pos = np.stack([packed_positions(seg[0]), packed_positions(seg[1])])
    assert_matches_oracle(
        impl,
        q,
        k,
        v,
        is_causal=True,
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=pos,
        kv_positions=pos,
    )


@pytest.mark.parametrize("impl", MAIN)
@pytest.mark.parametrize(
    "variant",
    ["shared_both", "per_head_both", "key_only", "value_only"],
)
def test_shaw_relative(impl, variant):
    n, kh = 4, 2
    q, k, v = make_problem(5, B, T, S, n, kh, H, hv=6)
    rel = shaw(
        5,
        n,
        H,
        6,
        3,
        per_head_key=variant == "per_head_both",
        per_head_value=variant == "per_head_both",
        key=variant != "value_only",
        value=variant != "key_only",
    )
    assert_matches_oracle(impl, q, k, v, relative=rel)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_shaw_with_packing_causal_and_bias(impl):
    """Everything at once, the way a packed decoder layer calls it."""
    q, k, v = make_problem(6, B, T, T, 4, 1, H)
    seg = np.stack([packed_ids([4, 7], T), packed_ids([9], T)])
    pos = np.stack([packed_positions(seg[0]), packed_positions(seg[1])])
    bias = np.random.default_rng(6).normal(size=(1, 4, T, T)).astype(np.float32)
    rel = shaw(6, 4, H, H, 2, per_head_key=True)
    assert_matches_oracle(
        impl,
        q,
        k,
        v,
        is_causal=True,
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=pos,
        kv_positions=pos,
        bias=bias,
        relative=rel,
    )


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


@pytest.mark.parametrize("impl", MAIN)
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_fully_masked_rows_are_zero_with_zero_gradient(impl, dtype):
    import jax.numpy as jnp

    q, k, v = make_problem(8, 1, 6, 7, 2, 2, 4)
    q, k, v = (jnp.asarray(a, dtype) for a in (q, k, v))
    mask = np.ones((1, 1, 6, 7), bool)
    mask[:, :, 2] = False  # query row 2 sees nothing
    rel = shaw(8, 2, 4, 4, 2)
    out, grads = run_with_grads(
        IMPLS[impl][0],
        q,
        k,
        v,
        options=IMPLS[impl][1],
        mask=mask,
        relative=rel,
        ct=np.ones((1, 6, 2, 4)),
    )
    out = np.asarray(out, np.float32)
    assert np.all(out[:, 2] == 0.0)
    assert np.all(np.abs(out[:, [0, 1, 3, 4, 5]]).sum(-1) > 0)
    for name, g in grads.items():
        if g is not None:
            assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert np.all(np.asarray(grads["query"], np.float32)[:, 2] == 0.0)


@pytest.mark.parametrize("impl", MAIN)
def test_padding_query_rows_via_segments_are_finite(impl):
    """Segment id 0 (padding) attending only padding stays finite; a query
    whose segment has no key at all (a cross-attention corner) returns 0."""
    q, k, v = make_problem(9, 1, 5, 4, 2, 2, 4)
    qseg = np.array([[1, 1, 2, 0, 3]])
    kvseg = np.array([[1, 2, 2, 0]])
    out = call(
        IMPLS[impl][0], q, k, v, options=IMPLS[impl][1], q_segment_ids=qseg, kv_segment_ids=kvseg
    )
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    assert np.all(out[0, 4] == 0.0)  # segment 3 has no keys


# --- causal future cannot leak -------------------------------------------------


@pytest.mark.parametrize("impl", MAIN)
def test_causal_future_does_not_leak(impl):
    q, k, v = make_problem(10, 1, 12, 12, 2, 2, 4)
    rel = shaw(10, 2, 4, 4, 2)
    base = np.asarray(
        call(IMPLS[impl][0], q, k, v, options=IMPLS[impl][1], is_causal=True, relative=rel)
    )
    k2, v2 = k.copy(), v.copy()
    k2[:, 7:] = 100.0 * np.random.default_rng(1).normal(size=k2[:, 7:].shape)
    v2[:, 7:] = -50.0
    changed = np.asarray(
        call(IMPLS[impl][0], q, k2, v2, options=IMPLS[impl][1], is_causal=True, relative=rel)
    )
    np.testing.assert_array_equal(changed[:, :7], base[:, :7])
    assert not np.allclose(changed[:, 7:], base[:, 7:])


# --- packed neighbours cannot influence each other -----------------------------


@pytest.mark.parametrize("impl", MAIN)
def test_packed_sequences_are_isolated_forward_and_backward(impl):
    t = 14
    seg = packed_ids([5, 6], t)[None]  # segments 1, 2, then padding 0
    pos = packed_positions(seg[0])[None]
    q, k, v = make_problem(11, 1, t, t, 2, 1, 4)
    rel = shaw(11, 2, 4, 4, 2)
    kw = dict(
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=pos,
        kv_positions=pos,
        relative=rel,
        is_causal=True,
    )
    ct = np.random.default_rng(2).normal(size=(1, t, 2, 4))
    ct[:, 5:] = 0.0  # the loss reads only sequence 1
    out, grads = run_with_grads(IMPLS[impl][0], q, k, v, options=IMPLS[impl][1], ct=ct, **kw)
    # Change everything about sequence 2 (distinctive, large values).
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    for a in (q2, k2, v2):
        a[:, 5:11] = 37.0 * np.sign(a[:, 5:11]) + 3.0
    out2, grads2 = run_with_grads(IMPLS[impl][0], q2, k2, v2, options=IMPLS[impl][1], ct=ct, **kw)
    np.testing.assert_array_equal(out2[:, :5], out[:, :5])
    for name in ("query", "key", "value"):
        np.testing.assert_array_equal(grads2[name][:, :5], grads[name][:, :5], err_msg=name)
        # sequence 1's loss sends no gradient into sequence 2
        assert np.all(grads[name][:, 5:] == 0.0), name
    assert not np.allclose(out2[:, 5:11], out[:, 5:11])


# --- extreme magnitudes ----------------------------------------------------------


@pytest.mark.parametrize("impl", MAIN)
@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_extreme_logits_are_finite_and_exact(impl, magnitude):
    """Logits of order 1e5 and 1e9: subtracting the max keeps the softmax
    finite and exact (the distribution is unchanged, it just saturates)."""
    q, k, v = make_problem(12, 1, 9, 11, 2, 2, 4)
    q = q * magnitude
    k = k * magnitude
    out = np.asarray(call(IMPLS[impl][0], q, k, v, options=IMPLS[impl][1], is_causal=True))
    assert np.all(np.isfinite(out))
    ref, _ = attention_and_grads(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


# --- bf16 --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", MAIN)
def test_bfloat16_accuracy(impl):
    import jax.numpy as jnp

    q, k, v = make_problem(13, B, T, S, 4, 2, H)
    qb, kb, vb = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    out = call(
        IMPLS[impl][0],
        qb,
        kb,
        vb,
        options=IMPLS[impl][1],
        is_causal=False,
        relative=shaw(13, 4, H, H, 2),
    )
    assert out.dtype == jnp.bfloat16
    # Oracle on the bf16-rounded inputs: the remaining error is the output rounding.
    ref, _ = attention_and_grads(
        np.asarray(qb, np.float32),
        np.asarray(kb, np.float32),
        np.asarray(vb, np.float32),
        relative=shaw(13, 4, H, H, 2),
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)


# --- relative schemes: shift invariance, order sensitivity ----------------------


@pytest.mark.parametrize("impl", MAIN)
def test_shaw_is_shift_invariant_and_order_sensitive(impl):
    q, k, v = make_problem(14, 1, 8, 8, 2, 2, 4)
    rel = shaw(14, 2, 4, 4, 3)
    pos = np.arange(8)[None]

    def run(q, k, v, p):
        return np.asarray(
            call(
                IMPLS[impl][0],
                q,
                k,
                v,
                options=IMPLS[impl][1],
                relative=rel,
                q_positions=p,
                kv_positions=p,
            )
        )

    base = run(q, k, v, pos)
    np.testing.assert_allclose(run(q, k, v, pos + 1000), base, rtol=1e-6, atol=1e-6)
    # Swap tokens 2 and 5: without positions attention would be permutation
    # equivariant; with relative positions the other rows must change.
    perm = np.array([0, 1, 5, 3, 4, 2, 6, 7])
    swapped = run(q[:, perm], k[:, perm], v[:, perm], pos)
    assert not np.allclose(swapped[:, [0, 1, 3, 4, 6, 7]], base[:, [0, 1, 3, 4, 6, 7]], atol=1e-4)
    plain = np.asarray(call("xla", q, k, v))
    plain_swapped = np.asarray(call("xla", q[:, perm], k[:, perm], v[:, perm]))
    np.testing.assert_allclose(plain_swapped, plain[:, perm], rtol=1e-5, atol=1e-6)


def test_default_implementation_choice():
    assert jattn.default_implementation(128, 128, backend="cpu") == "xla"
    assert jattn.default_implementation(4096, 4096, backend="cpu") == "chunked"
    assert jattn.default_implementation(128, 128, backend="gpu") == "pallas"
    assert jattn.default_implementation(128, 128, backend="tpu") == "xla"
    assert jattn.default_implementation(4096, 4096, backend="tpu") == "chunked"


def test_attention_weights_are_what_the_output_mixes():
    """`jattn.attention_weights` rows sum to 1 over visible keys, are 0 on
    hidden ones, and reproduce the output when multiplied with the values."""
    q, k, v = make_problem(15, 1, 6, 6, 4, 2, 4)
    seg = np.array([[1, 1, 1, 2, 2, 2]])
    mask = np.ones((1, 1, 6, 6), bool)
    mask[..., 2, :] = False  # one fully hidden row
    rel = shaw(15, 4, 4, 4, 2, value=False)
    kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg, mask=mask, relative=rel)
    w = np.asarray(jattn.attention_weights(q, k, **kw))
    assert w.shape == (1, 4, 6, 6)
    sums = w.sum(-1)
    np.testing.assert_allclose(np.delete(sums, 2, axis=-1), 1.0, rtol=1e-6)
    assert np.all(w[..., 2, :] == 0.0)
    assert np.all(w[..., 3:, :3] == 0.0) and np.all(np.triu(w[0, 0], 1) == 0.0)
    out = np.asarray(jattn.dot_product_attention(q, k, v, **kw))
    v_rep = np.repeat(v, 2, axis=2)  # GQA: query head n reads kv head n // 2
    np.testing.assert_allclose(out, np.einsum("bnts,bsnh->btnh", w, v_rep), rtol=1e-5, atol=1e-6)
