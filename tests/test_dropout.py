"""Attention-weight dropout: the keep mask as a function of (rng, b, n, t, s).

The hash is checked against an independent uint32 numpy version, its keep
rate and independence statistically, and the xla path's dropout against a
float64 computation that applies that numpy mask to the oracle's weights,
forward and backward. (The chunked path and the kernels are compared with
the xla path, mask for mask, in their own test files.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import dropout


def _np_mix(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def np_keep(seed, rate, b, n, t, s):
    """The documented hash in unsigned 32-bit numpy arithmetic."""
    u = lambda x: np.asarray(x).astype(np.int64).astype(np.uint32)  # noqa: E731
    s0, s1 = (np.asarray(seed).astype(np.int32).view(np.uint32)).tolist()
    with np.errstate(over="ignore"):
        row = _np_mix(np.uint32(s0) + u(b) * np.uint32(0x9E3779B1) + u(n) * np.uint32(0x85EBCA77))
        row = _np_mix(row ^ (u(t) * np.uint32(0xC2B2AE3D)))
        h = _np_mix(_np_mix(row + u(s) * np.uint32(0x27D4EB2F)) ^ np.uint32(s1))
    return (h >> np.uint32(8)) >= round(rate * (1 << 24))


def _grid(b, n, t, s):
    return np.meshgrid(np.arange(b), np.arange(n), np.arange(t), np.arange(s), indexing="ij")


def test_hash_matches_unsigned_reference():
    seed = dropout.seed_words(jax.random.PRNGKey(11))
    idx = _grid(2, 3, 17, 19)
    got = np.asarray(dropout.keep(seed, 0.3, *(jnp.asarray(i) for i in idx)))
    np.testing.assert_array_equal(got, np_keep(np.asarray(seed), 0.3, *idx))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bounds(rate):
    seed = dropout.seed_words(jax.random.PRNGKey(3))
    idx = [jnp.asarray(i) for i in _grid(2, 4, 64, 64)]
    kept = np.asarray(dropout.keep(seed, rate, *idx))
    n = kept.size
    sd = np.sqrt(n * rate * (1 - rate))
    assert abs(kept.sum() - n * (1 - rate)) < 5 * sd, (kept.mean(), 1 - rate)
    # No structure along any axis: every query row and key column keeps
    # about the same share (5-sigma bounds per row of 64).
    rows = kept.reshape(-1, 64).mean(-1)
    cols = kept.transpose(0, 1, 3, 2).reshape(-1, 64).mean(-1)
    bound = 5 * np.sqrt(rate * (1 - rate) / 64)
    assert np.all(np.abs(rows - (1 - rate)) < bound)
    assert np.all(np.abs(cols - (1 - rate)) < bound)
    # Neighbouring weights are uncorrelated.
    a, b = kept[..., :-1].ravel().astype(float), kept[..., 1:].ravel().astype(float)
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(a.size)


def test_different_keys_give_different_masks():
    idx = [jnp.asarray(i) for i in _grid(1, 2, 32, 32)]
    masks = [
        np.asarray(dropout.keep(dropout.seed_words(jax.random.PRNGKey(s)), 0.5, *idx))
        for s in range(4)
    ]
    for i in range(4):
        for j in range(i + 1, 4):
            agree = (masks[i] == masks[j]).mean()
            assert 0.4 < agree < 0.6, (i, j, agree)  # independent masks agree half the time


def _dropout_reference(q, k, v, rng, rate, *, broadcast_batch=False, is_causal=False):
    """Float64: softmax weights, the numpy keep mask, then mix."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    with jax.enable_x64(True), jax.debug_nans(False), jax.debug_infs(False):
        q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
        rep = n // kh
        logits = jnp.einsum("btnh,bsnh->bnts", q64, jnp.repeat(k64, rep, 2)) / np.sqrt(h)
        if is_causal:
            logits = jnp.where(np.tril(np.ones((t, s), bool)), logits, -jnp.inf)
        w = jax.nn.softmax(logits, axis=-1)
        bi, ni, ti, si = _grid(1 if broadcast_batch else b, n, t, s)
        keep = np_keep(np.asarray(dropout.seed_words(rng)), rate, bi, ni, ti, si)
        w = w * jnp.asarray(keep) / (1 - rate)
        return np.asarray(jnp.einsum("bnts,bsnv->btnv", w, jnp.repeat(v64, rep, 2)))


@pytest.mark.parametrize("broadcast_batch", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_xla_dropout_equals_float64_reference(broadcast_batch, kv_heads):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 12, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, 10, kv_heads, 8)).astype(np.float32)
    v = rng.normal(size=(2, 10, kv_heads, 8)).astype(np.float32)
    key = jax.random.PRNGKey(5)
    got = jattn.dot_product_attention(
        q,
        k,
        v,
        implementation="xla",
        dropout_rate=0.3,
        dropout_rng=key,
        dropout_broadcast_batch=broadcast_batch,
    )
    want = _dropout_reference(q, k, v, key, 0.3, broadcast_batch=broadcast_batch)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_xla_dropout_gradients_equal_float64_reference():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 9, 2, 4)).astype(np.float32)
    k = rng.normal(size=(1, 9, 2, 4)).astype(np.float32)
    v = rng.normal(size=(1, 9, 2, 4)).astype(np.float32)
    ct = rng.normal(size=(1, 9, 2, 4))
    key = jax.random.PRNGKey(9)

    def f(q, k, v):
        out = jattn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla", dropout_rate=0.4, dropout_rng=key
        )
        return jnp.sum(out * ct)

    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    with jax.enable_x64(True):
        ref = lambda *a: jnp.sum(  # noqa: E731
            _dropout_reference_jnp(*a, key=key, rate=0.4) * jnp.asarray(ct)
        )
        want = jax.grad(ref, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def _dropout_reference_jnp(q, k, v, *, key, rate):
    """Causal, MHA, differentiable float64 version of `_dropout_reference`."""
    b, t, n, h = q.shape
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    logits = jnp.where(np.tril(np.ones((t, t), bool)), logits, -1e300)
    w = jax.nn.softmax(logits, axis=-1)
    keep = np_keep(np.asarray(dropout.seed_words(key)), rate, *_grid(b, n, t, t))
    return jnp.einsum("bnts,bsnv->btnv", w * jnp.asarray(keep) / (1 - rate), v)


def test_dropout_needs_a_key_and_a_rate_below_one():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="needs a dropout_rng"):
        jattn.dot_product_attention(q, q, q, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        jattn.dot_product_attention(q, q, q, dropout_rate=1.0, dropout_rng=jax.random.PRNGKey(0))
    # Rate 0 is off whatever the key: bit-identical to no dropout.
    a = jattn.dot_product_attention(
        q + 1, q, q, dropout_rate=0.0, dropout_rng=jax.random.PRNGKey(0)
    )
    np.testing.assert_array_equal(
        np.asarray(a), np.asarray(jattn.dot_product_attention(q + 1, q, q))
    )
