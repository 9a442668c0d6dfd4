"""jattn as a drop-in for `jax.nn.dot_product_attention`.

Every case here calls jattn exactly the way code written for jax.nn calls
jax.nn (bias and mask positional, rank 3 or 4, `jax.vmap` over the batch,
sequence lengths, local windows, `return_residual` with a cotangent on the
lse) and compares output and gradients with jax.nn's own answer, at the
tolerances jax's own tests use, for every implementation: xla, chunked and
pallas (interpret mode on the CPU). The shapes are smaller than jax's (T=S=64
instead of 128) to keep interpret mode fast; the cases are the same kinds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

IMPLS = ("xla", "chunked", "pallas")
B, T, S, N, H = 2, 64, 64, 4, 16


def _close(got, want, tol):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def _inputs(dtype, groups, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, N // groups, H), dtype)
    v = jax.random.normal(keys[2], (B, S, N // groups, H), dtype)
    ct = jax.random.normal(keys[3], (B, T, N, H), dtype)
    lse_ct = jax.random.normal(keys[4], (B, T, N), dtype)
    return q, k, v, ct, lse_ct


@functools.cache
def _vjp_fn(impl: str | None, vmap: bool, residual: bool):
    """Jitted `(out, grads)` of attention called as jax.nn code calls it."""
    if impl is None:
        fn = functools.partial(
            jax.nn.dot_product_attention, implementation=None, return_residual=residual
        )
    else:
        fn = functools.partial(
            jattn.dot_product_attention, implementation=impl, return_residual=residual
        )
    if vmap:
        fn = jax.vmap(fn, in_axes=(0, 0, 0, None, None), out_axes=0)

    def f(q, k, v, ct):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, None), q, k, v)
        return out, vjp(ct)

    return jax.jit(f)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gqa_groups_dtypes_and_residual(impl, groups, dtype):
    # jax's testDotProductAttention: the reference is jax.nn without GQA
    # (keys and values repeated), the answer uses the grouped keys.
    q, k, v, ct, lse_ct = _inputs(dtype, groups)
    k_ref, v_ref = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    if dtype == jnp.float16:
        # jax.nn's float16 dot (F16_F16_F32) does not run on the CPU: its
        # answer for the same float16 values, computed in float32.
        up = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
        q_ref, k_ref, v_ref, ct_ref, lse_ct_ref = up(q, k_ref, v_ref, ct, lse_ct)
    else:
        q_ref, ct_ref, lse_ct_ref = q, ct, lse_ct
    want, (dq_w, dk_w, dv_w) = _vjp_fn(None, False, False)(q_ref, k_ref, v_ref, ct_ref)
    got, (dq, dk, dv) = _vjp_fn(impl, False, False)(q, k, v, ct)
    fold = lambda g: g.reshape(B, S, N // groups, groups, H).sum(axis=3)  # noqa: E731
    _close(got, want, 0.01)
    _close(dq, dq_w, 0.01)
    _close(dk, fold(dk_w), 0.01)
    _close(dv, fold(dv_w), 0.01)
    # return_residual: (out, lse) with lse [B, T, N]; a cotangent on the lse
    # is accepted and, as in jax.nn, contributes nothing.
    (want, lse_w), (dq_w, dk_w, dv_w) = _vjp_fn(None, False, True)(
        q_ref, k_ref, v_ref, (ct_ref, lse_ct_ref)
    )
    (got, lse), (dq, dk, dv) = _vjp_fn(impl, False, True)(q, k, v, (ct, lse_ct))
    assert lse.shape == (B, T, N) and lse.dtype == dtype
    _close(got, want, 0.01)
    _close(lse, lse_w, 0.01)
    _close(dq, dq_w, 0.01)
    _close(dk, fold(dk_w), 0.01)
    _close(dv, fold(dv_w), 0.01)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [1, 4])
def test_vmap_over_rank3_calls(impl, groups):
    # jax.vmap over the batch: every call inside sees rank-3 inputs [T, N, H].
    q, k, v, ct, _ = _inputs(jnp.bfloat16, groups, seed=1)
    k_ref, v_ref = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    want, (dq_w, dk_w, dv_w) = _vjp_fn(None, False, False)(q, k_ref, v_ref, ct)
    got, (dq, dk, dv) = _vjp_fn(impl, True, False)(q, k, v, ct)
    fold = lambda g: g.reshape(B, S, N // groups, groups, H).sum(axis=3)  # noqa: E731
    _close(got, want, 0.01)
    _close(dq, dq_w, 0.01)
    _close(dk, fold(dk_w), 0.01)
    _close(dv, fold(dv_w), 0.01)


def test_float64_runs_in_float64():
    q, k, v, ct, _ = _inputs(jnp.float32, 2, seed=2)
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v))
        want = jax.nn.dot_product_attention(q64, jnp.repeat(k64, 2, 2), jnp.repeat(v64, 2, 2))
        for impl in IMPLS:
            got = jattn.dot_product_attention(q64, k64, v64, implementation=impl)
            assert got.dtype == jnp.float64, impl
            # xla and chunked compute in float64, the kernel in float32.
            tol = 1e-5 if impl == "pallas" else 1e-6  # jax.nn takes its softmax in float32
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)


MASK_MODES = [
    ("bias",),
    ("causal",),
    ("padding",),
    ("custom",),
    ("causal", "padding"),
    ("custom", "padding"),
    ("bias", "causal"),
    ("causal", "sliding_window"),
    ("sliding_window",),
]


@functools.cache
def _mask_vjp(impl, is_causal, window):
    def f(q, k, v, bias, mask, q_len, kv_len, ct):
        def g(q, k, v, bias):
            fn = jax.nn.dot_product_attention if impl is None else jattn.dot_product_attention
            return fn(
                q,
                k,
                v,
                bias,
                mask,
                is_causal=is_causal,
                query_seq_lengths=q_len,
                key_value_seq_lengths=kv_len,
                local_window_size=window,
                implementation=impl,
            )

        out, vjp = jax.vjp(g, q, k, v, bias)
        return out, vjp(ct)

    return jax.jit(f)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MASK_MODES, ids="+".join)
def test_masks_lengths_windows_and_bias_gradient(impl, mode):
    # jax's testDotProductAttentionMask, bf16, bias and mask positional.
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    dt = jnp.bfloat16
    q = jax.random.normal(keys[0], (B, T, N, H), dt)
    k = jax.random.normal(keys[1], (B, S, N, H), dt)
    v = jax.random.normal(keys[2], (B, S, N, H), dt)
    ct = jax.random.normal(keys[3], (B, T, N, H), dt)
    bias = mask = q_len = kv_len = window = None
    is_causal = "causal" in mode
    if "padding" in mode:
        q_len = jnp.array([T // 2, T // 4], jnp.int32)
        kv_len = jnp.array([S // 4, S // 2], jnp.int32)
    if "custom" in mode:
        mask = jnp.tril(jnp.ones((T, S), bool))[None, None]
    if "bias" in mode:
        bias = jax.random.normal(keys[4], (1, N, T, S), dt)
    else:
        bias = jnp.zeros((1, N, T, S), dt)  # a zero bias, so its gradient is compared too
    if "sliding_window" in mode:
        window = (3, 2) if is_causal else (3, 0)
    want, grads_w = _mask_vjp(None, is_causal, window)(q, k, v, bias, mask, q_len, kv_len, ct)
    got, grads = _mask_vjp(impl, is_causal, window)(q, k, v, bias, mask, q_len, kv_len, ct)
    _close(got, want, 0.01)
    tols = (0.02, 0.02, 0.01, 0.02)
    for name, g, w, tol in zip(("q", "k", "v", "bias"), grads, grads_w, tols, strict=True):
        try:
            _close(g, w, tol)
        except AssertionError as e:
            raise AssertionError(f"d{name} differs from jax.nn") from e


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_mask_under_debug_infs(impl):
    # jax's regression test for jax-ml/jax#37422: rank-3 float64 inputs, a
    # rank-1 mask, eager, with jax.debug_infs on.
    with jax.enable_x64(True), jax.debug_infs(True):
        t, s, kh, n, h = 5, 7, 3, 6, 11
        mask = jnp.arange(s) <= s // 2
        out = jattn.dot_product_attention(
            jnp.zeros((t, n, h), jnp.float64),
            jnp.zeros((s, kh, h), jnp.float64),
            jnp.zeros((s, kh, h), jnp.float64),
            mask=mask,
            implementation=impl,
        )
        out.block_until_ready()
        assert out.shape == (t, n, h) and out.dtype == jnp.float64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("vmap", [False, True])
def test_bias_gradient(impl, batch, vmap):
    # jax's testDotProductAttentionBiasGradient: self-attention with a full
    # bias and a rank-3 mask, optionally vmapped over the batch.
    keys = jax.random.split(jax.random.PRNGKey(4), 2)
    x = jax.random.normal(keys[0], (batch, S, N, H), jnp.bfloat16)
    bias = jax.random.normal(keys[1], (batch, N, S, S), jnp.bfloat16)
    mask = jnp.ones((1, 1, S), jnp.bool_)

    def attention(x, bias, mask, fn, **kw):
        return fn(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False, **kw)

    ref = functools.partial(attention, fn=jax.nn.dot_product_attention)
    ans = functools.partial(attention, fn=jattn.dot_product_attention, implementation=impl)
    if vmap:
        ref, ans = jax.vmap(ref, in_axes=(0, 0, None)), jax.vmap(ans, in_axes=(0, 0, None))
    _close(jax.jit(ans)(x, bias, mask), jax.jit(ref)(x, bias, mask), 0.01)
    loss = lambda f: lambda x, b, m: jnp.mean(f(x, b, m).astype(jnp.float32) ** 2)  # noqa: E731
    gx, gb = jax.jit(jax.grad(loss(ans), argnums=(0, 1)))(x, bias, mask)
    gx_w, gb_w = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(x, bias, mask)
    _close(gx, gx_w, 0.01)
    _close(gb, gb_w, 0.01)


@pytest.mark.parametrize("impl", IMPLS)
def test_local_window_without_mask_changes_the_output(impl):
    q, k, v, _, _ = _inputs(jnp.float32, 1, seed=5)
    wide = jattn.dot_product_attention(
        q, k, v, None, None, local_window_size=(32, 32), implementation=impl
    )
    narrow = jattn.dot_product_attention(
        q, k, v, None, None, local_window_size=(1, 1), implementation=impl
    )
    assert not np.allclose(np.asarray(wide), np.asarray(narrow))
    want = jax.nn.dot_product_attention(q, k, v, local_window_size=(1, 1))
    _close(narrow, want, 1e-5)


def test_cudnn_names_what_it_cannot_take():
    q, k, v, _, _ = _inputs(jnp.bfloat16, 1)
    seg = jnp.ones((B, T), jnp.int32)
    cases = [
        (dict(q_segment_ids=seg, kv_segment_ids=seg), "segment ids"),
        (dict(q_positions=seg), "positions"),
        (dict(relative=jattn.ShawRelative(key=jnp.zeros((3, H)), max_distance=1)), "relative"),
        (dict(dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0)), "dropout"),
    ]
    for kw, what in cases:
        with pytest.raises(ValueError, match=f"cudnn.*cannot take {what}"):
            jattn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
    if jax.default_backend() == "cpu":
        # jax.nn's own cuDNN path refuses a CPU: the call reaches it.
        with pytest.raises(Exception):  # noqa: B017
            jattn.dot_product_attention(q, k, v, implementation="cudnn")
