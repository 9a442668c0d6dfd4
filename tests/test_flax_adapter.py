"""flax's attention layers through `jattn.flax_attention_fn`.

Shaped like flax's own tests (tests/linen/linen_attention_test.py and
tests/nnx/nn/attention_test.py): the same layer with flax's default
`attention_fn` and with the adapter, the same parameters, the same inputs,
and the outputs compared. Dropout cannot match flax's draws (jattn's keep
mask is a hash of `(rng, b, n, t, s)`), so dropout is checked for its
meaning instead: statistics, sharing across batch and heads, determinism,
and the same output from every implementation.
"""

from __future__ import annotations

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import jax_utils, nnx

import jattn

IMPLS = sorted(jattn.IMPLEMENTATIONS)  # xla, chunked, pallas (interpret mode on the CPU)
TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)  # flax computes in bf16, jattn in float32


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# --------------------------------------------------------------------- linen


def _linen(attention_fn=nn.dot_product_attention, **kwargs):
    kwargs = dict(num_heads=2, qkv_features=8, deterministic=True) | kwargs
    return nn.MultiHeadDotProductAttention(attention_fn=attention_fn, **kwargs)


def _linen_pair(x, impl=None, *, mha=None, **call):
    """Outputs of flax's default attention and of the adapter, same params."""
    mha = mha or {}
    ref = _linen(**mha)
    with _flax_reference():
        variables = ref.init(jax.random.key(1), x, **call)
        want = ref.apply(variables, x, **call)
    got = _linen(jattn.flax_attention_fn(impl), **mha).apply(variables, x, **call)
    return got, want


def _flax_reference():
    """flax's own attention broadcasts a lower-rank mask or bias by implicit
    rank promotion, which this suite turns into an error for jattn: the
    reference alone runs with it allowed."""
    return jax.numpy_rank_promotion("allow")


@pytest.mark.parametrize("impl", IMPLS)
def test_linen_no_mask(impl):
    x = _normal(0, (2, 6, 5))
    got, want = _linen_pair(x, impl)
    assert got.shape == want.shape == (2, 6, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_linen_causal_float_mask(impl):
    x = _normal(0, (2, 7, 5))
    mask = nn.make_causal_mask(jnp.ones((2, 7)))
    assert mask.dtype == jnp.float32  # flax's masks are float 0/1
    got, want = _linen_pair(x, impl, mask=mask)
    np.testing.assert_allclose(got, want, **TOL)


def test_linen_boolean_mask_equals_float_mask():
    x = _normal(0, (2, 7, 5))
    mask = nn.make_causal_mask(jnp.ones((2, 7)))
    layer = _linen(jattn.flax_attention_fn())
    variables = layer.init(jax.random.key(1), x)
    np.testing.assert_array_equal(
        layer.apply(variables, x, mask=mask), layer.apply(variables, x, mask=mask > 0)
    )


def _padding(lengths, length):
    tokens = (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    return jnp.asarray(tokens)  # [B, L], 1 real, 0 padding


@pytest.mark.parametrize("impl", IMPLS)
def test_linen_padding_mask(impl):
    # Padded query rows see no key: flax returns the mean of all values there,
    # jattn returns 0 (the documented difference); real rows must agree.
    tokens = _padding([6, 4], 6)
    x = _normal(0, (2, 6, 5))
    mask = nn.make_attention_mask(tokens > 0, tokens > 0)  # [2, 1, 6, 6] float
    got, want = _linen_pair(x, impl, mask=mask)
    real = np.asarray(tokens, bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_linen_combined_causal_and_padding(impl):
    # Key padding only, so that every query row keeps a visible key.
    tokens = _padding([7, 5], 7)
    x = _normal(0, (2, 7, 5))
    mask = nn.combine_masks(
        nn.make_causal_mask(tokens),
        nn.make_attention_mask(jnp.ones_like(tokens), tokens > 0),
    )
    got, want = _linen_pair(x, impl, mask=mask)
    np.testing.assert_allclose(got, want, **TOL)


def test_linen_cross_attention_with_bias_shapes():
    q = _normal(0, (2, 3, 5))
    kv = _normal(1, (2, 9, 5))
    mask = nn.make_attention_mask(jnp.ones((2, 3)), _padding([9, 6], 9) > 0)
    ref = _linen()
    variables = ref.init(jax.random.key(1), q, kv)
    want = ref.apply(variables, q, kv, mask=mask)
    got = _linen(jattn.flax_attention_fn()).apply(variables, q, kv, mask=mask)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_linen_extra_batch_dims(impl):
    x = _normal(0, (2, 3, 6, 5))  # batch dims (2, 3)
    mask = nn.make_causal_mask(jnp.ones((2, 3, 6)))  # [2, 3, 1, 6, 6]
    got, want = _linen_pair(x, impl, mask=mask)
    assert got.shape == (2, 3, 6, 5)
    np.testing.assert_allclose(got, want, **TOL)


def test_linen_batch_broadcast_mask():
    # A mask shared by one batch dim and not the other: [1, 3, 1, 6, 6].
    x = _normal(0, (2, 3, 6, 5))
    mask = nn.make_causal_mask(jnp.ones((1, 3, 6))) * (jnp.arange(3) > 0)[None, :, None, None, None]
    mask = mask + jnp.eye(6)[None, None, None]  # every row keeps itself
    got, want = _linen_pair(x, mask=mask)
    np.testing.assert_allclose(got, want, **TOL)


def test_linen_no_batch_dim():
    q = _normal(0, (3, 5))  # [T, F]: no batch dim at all
    kv = _normal(1, (9, 5))
    ref = _linen()
    variables = ref.init(jax.random.key(1), q, kv)
    got = _linen(jattn.flax_attention_fn()).apply(variables, q, kv)
    np.testing.assert_allclose(got, ref.apply(variables, q, kv), **TOL)
    assert got.shape == (3, 5)


@pytest.mark.parametrize(("spatial_shape", "attn_dims"), [((5,), (1,)), ((3, 5), (2,))])
def test_linen_decoding_equals_full_causal(spatial_shape, attn_dims):
    # flax's test_decoding through the adapter: feeding one position at a time
    # through the cache gives the full causal computation.
    bs, heads, feats = 2, 3, 4
    inputs = _normal(0, (bs, *spatial_shape, heads * feats))
    fn = jattn.flax_attention_fn()
    module = _linen(
        fn, num_heads=heads, qkv_features=heads * feats, precision=jax.lax.Precision.HIGHEST
    )
    decode_module = module.clone(decode=True)
    initial = decode_module.init(jax.random.key(2), inputs)
    params = initial["params"]
    state = {k: v for k, v in initial.items() if k != "params"}
    causal = nn.make_causal_mask(jnp.ones((bs, *spatial_shape)))
    y_full = jax.jit(lambda x, m: module.apply(initial, x, mask=m))(inputs, causal)
    y_flax = _linen(
        num_heads=heads, qkv_features=heads * feats, precision=jax.lax.Precision.HIGHEST
    ).apply(initial, inputs, mask=causal)
    np.testing.assert_allclose(y_full, y_flax, **TOL)

    def body(state, x):
        y, state = decode_module.apply({"params": params, **state}, x, mutable=["cache"])
        return state, y

    _, y = jax_utils.scan_in_dim(body, state, inputs, axis=attn_dims, keepdims=True)
    np.testing.assert_allclose(y, y_full, **TOL)


def test_linen_autoregressive_receptive_field():
    # flax's test_autoregressive_receptive_field_1d: gradients of position i
    # reach positions <= i and none after.
    length = 8
    inputs = _normal(0, (1, length, 2))
    module = _linen(jattn.flax_attention_fn(), num_heads=1, qkv_features=2)
    variables = module.init(jax.random.key(1), inputs)
    causal = nn.make_causal_mask(jnp.ones((1, length)))

    grad = jax.jit(
        jax.grad(lambda x, i: module.apply(variables, x, mask=causal)[0, i].sum()),
        static_argnums=1,
    )
    for i in range(length):
        deps = np.any(np.abs(np.asarray(grad(inputs, i))[0]) > 1e-6, axis=-1)
        assert deps[: i + 1].all() and not deps[i + 1 :].any(), (i, deps)


def _enable_x64():
    try:
        from jax.experimental import enable_x64
    except ImportError:  # newer jax
        enable_x64 = jax.enable_x64
    return enable_x64()


def test_autoregressive_decode_with_x64():
    # flax's test_autoregressive_decode_with_x64, linen and nnx, through the adapter.
    with _enable_x64():
        x = jnp.ones((1, 4, 4))
        layer = _linen(jattn.flax_attention_fn(), qkv_features=4, decode=True)
        variables = layer.init(jax.random.PRNGKey(0), x)
        params, cache = variables["params"], variables["cache"]
        y1, updates = layer.apply({"params": params, "cache": cache}, x[:, :1], mutable=["cache"])
        y2, _ = layer.apply({"params": params, **updates}, x[:, 1:2], mutable=["cache"])
        assert y1.shape == y2.shape == (1, 1, 4)
        assert y1.dtype == jnp.float64
        module = _nnx(jattn.flax_attention_fn(), in_features=4, qkv_features=4, decode=True)
        module.init_cache(x.shape, dtype=x.dtype)
        assert module(x[:, :1]).shape == module(x[:, 1:2]).shape == (1, 1, 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linen_dtype(dtype):
    x = _normal(0, (2, 6, 5))
    mask = nn.make_causal_mask(jnp.ones((2, 6)))
    got, want = _linen_pair(x, mha=dict(dtype=dtype), mask=mask)
    assert got.dtype == want.dtype == dtype
    tol = TOL if dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(np.float32(got), np.float32(want), **tol)


def test_linen_dtype_of_direct_call_promotes():
    q = _normal(0, (2, 4, 2, 3), jnp.bfloat16)
    k = _normal(1, (2, 4, 2, 3))
    fn = jattn.flax_attention_fn()
    assert fn(q, k, k).dtype == nn.dot_product_attention(q, k, k).dtype == jnp.float32
    assert fn(q, k, k, dtype=jnp.bfloat16).dtype == jnp.bfloat16


class _SowModel(nn.Module):
    fn: object

    @nn.compact
    def __call__(self, x, sow_weights=False):
        kw = dict(num_heads=8, qkv_features=16, deterministic=True, attention_fn=self.fn)
        x = nn.MultiHeadDotProductAttention(**kw)(x, sow_weights=sow_weights)
        x = nn.MultiHeadDotProductAttention(**kw)(x)
        return nn.MultiHeadDotProductAttention(**kw)(x, sow_weights=sow_weights)


def test_linen_sow_weights():
    x = _normal(0, (4, 6, 5))
    ref = _SowModel(nn.dot_product_attention)
    variables = ref.init(jax.random.key(1), x)
    out_want, want = ref.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    model = _SowModel(jattn.flax_attention_fn())
    out, got = model.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    np.testing.assert_allclose(out, out_want, **TOL)
    got, want = got["intermediates"], want["intermediates"]
    assert (
        sorted(got)
        == sorted(want)
        == [
            "MultiHeadDotProductAttention_0",
            "MultiHeadDotProductAttention_2",
        ]
    )
    for name in got:
        (w,) = got[name]["attention_weights"]
        assert w.shape == (4, 8, 6, 6)
        np.testing.assert_allclose(w, want[name]["attention_weights"][0], **TOL)
    _, nothing = model.apply(variables, x, sow_weights=False, mutable=["intermediates"])
    assert "intermediates" not in nothing


@pytest.mark.parametrize(
    ("force_fp32", "weights_dtype"), [(True, jnp.float32), (False, jnp.bfloat16)]
)
def test_linen_mixed_precision_sow_dtype(force_fp32, weights_dtype):
    # flax's test_mixed_precision_multihead_attention through the adapter.
    x = jax.random.uniform(jax.random.key(0), (2, 4))
    kw = dict(force_fp32_for_softmax=force_fp32, dtype=jnp.bfloat16)
    ref = _linen(**kw)
    variables = ref.init(jax.random.key(1), x)
    _, want = ref.apply(variables, x, mutable=["intermediates"], sow_weights=True)
    layer = _linen(jattn.flax_attention_fn(), **kw)
    _, got = layer.apply(variables, x, mutable=["intermediates"], sow_weights=True)
    (w,) = got["intermediates"]["attention_weights"]
    (w_want,) = want["intermediates"]["attention_weights"]
    assert w.dtype == w_want.dtype == weights_dtype
    np.testing.assert_allclose(np.float32(w), np.float32(w_want), **BF16_TOL)


def test_linen_deterministic_means_no_dropout():
    # flax's test_multihead_self_attention_w_dropout_disabled, through the adapter.
    x = _normal(0, (4, 3, 5))
    fn = jattn.flax_attention_fn()
    plain = _linen(fn)
    variables = plain.init(jax.random.key(1), x)
    want = plain.apply(variables, x)
    dropping = _linen(fn, dropout_rate=0.5, deterministic=None)
    for seed in (2, 3):
        got = dropping.apply(
            variables, x, deterministic=True, rngs={"dropout": jax.random.key(seed)}
        )
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(
        dropping.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(2)}),
        want,
    )


def test_linen_explicit_dropout_rng():
    # flax's test_multihead_self_attention_explicit_dropout, through the adapter:
    # the same key gives the same drop, another key another one.
    fn = jattn.flax_attention_fn()

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x, dropout_rng=None):
            kw = dict(num_heads=4, qkv_features=8, dropout_rate=0.5, deterministic=False)
            kw |= dict(kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros)
            a = nn.MultiHeadDotProductAttention(attention_fn=fn, **kw)(x, dropout_rng=dropout_rng)
            b = nn.MultiHeadDotProductAttention(attention_fn=fn, **kw)(x, dropout_rng=dropout_rng)
            return a, b

    x = _normal(0, (4, 3, 5))
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    v = Foo().init({"params": k1, "dropout": k2}, x)
    a, b = Foo().apply(v, x, rngs={"dropout": k2})
    c, d = Foo().apply(v, x, rngs={"dropout": k2})
    e, f = Foo().apply(v, x, rngs={"dropout": k3})
    assert not (a == b).all()
    assert (a == c).all() and (b == d).all()
    assert not (a == e).all() and not (b == f).all()
    a, b = Foo().apply(v, x, rngs={"dropout": k2}, dropout_rng=k4)
    assert (a == b).all()  # the explicit rng wins: both layers drop the same weights
    assert a.shape == x.shape


# ----------------------------------------------------------------------- nnx


def _nnx(attention_fn=nnx.dot_product_attention, seed=0, **kwargs):
    kwargs = dict(num_heads=2, in_features=5, qkv_features=8, decode=False) | kwargs
    return nnx.MultiHeadAttention(attention_fn=attention_fn, rngs=nnx.Rngs(seed), **kwargs)


def _nnx_pair(x, impl=None, *, mha=None, **call):
    mha = mha or {}
    want = _nnx(**mha)(x, **call)
    got = _nnx(jattn.flax_attention_fn(impl), **mha)(x, **call)
    return got, want


@pytest.mark.parametrize("impl", IMPLS)
def test_nnx_no_mask_and_causal(impl):
    x = _normal(0, (2, 7, 5))
    got, want = _nnx_pair(x, impl)
    np.testing.assert_allclose(got, want, **TOL)
    mask = nn.make_causal_mask(jnp.ones((2, 7)))
    got, want = _nnx_pair(x, impl, mask=mask)
    np.testing.assert_allclose(got, want, **TOL)
    got_flag, _ = _nnx_pair(x, impl, is_causal=True)  # nnx's per-call is_causal
    np.testing.assert_allclose(got_flag, want, **TOL)


def test_nnx_padding_and_combined_masks():
    tokens = _padding([7, 5], 7)
    x = _normal(0, (2, 7, 5))
    pad = nn.make_attention_mask(jnp.ones_like(tokens), tokens > 0)
    got, want = _nnx_pair(x, mask=nnx.combine_masks(nnx.make_causal_mask(tokens), pad))
    np.testing.assert_allclose(got, want, **TOL)
    got, want = _nnx_pair(x, mask=pad, is_causal=True)
    np.testing.assert_allclose(got, want, **TOL)


def test_nnx_extra_batch_dims_and_gqa():
    x = _normal(0, (2, 3, 6, 8))
    mask = nn.make_causal_mask(jnp.ones((2, 3, 6)))
    mha = dict(num_heads=4, num_kv_heads=2, in_features=8, qkv_features=16)
    got, want = _nnx_pair(x, mha=mha, mask=mask)
    assert got.shape == (2, 3, 6, 8)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nnx_dtype(dtype):
    x = _normal(0, (2, 6, 5))
    got, want = _nnx_pair(x, mha=dict(dtype=dtype), is_causal=True)
    assert got.dtype == want.dtype == dtype
    tol = TOL if dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(np.float32(got), np.float32(want), **tol)


def test_nnx_decode_equals_full_causal():
    x = _normal(0, (2, 6, 5))
    full = _nnx(jattn.flax_attention_fn())(x, is_causal=True)
    step = _nnx(jattn.flax_attention_fn(), decode=True)
    step.init_cache(x.shape, dtype=x.dtype)
    ys = [step(x[:, i : i + 1]) for i in range(x.shape[1])]
    np.testing.assert_allclose(jnp.concatenate(ys, axis=1), full, **TOL)
    np.testing.assert_allclose(full, _nnx()(x, is_causal=True), **TOL)


def test_nnx_sow_weights():
    x = _normal(0, (4, 6, 8))

    class Model(nnx.Module):
        def __init__(self, fn):
            kw = dict(num_heads=8, in_features=8, decode=False, attention_fn=fn)
            self.layers = nnx.data(
                [nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0)) for _ in range(3)]
            )

        def __call__(self, x, sow_weights=False):
            x = self.layers[0](x, sow_weights=sow_weights)
            x = self.layers[1](x)
            return self.layers[2](x, sow_weights=sow_weights)

    out_want, want = nnx.capture(Model(nnx.dot_product_attention), nnx.Intermediate)(x, True)
    out, got = nnx.capture(Model(jattn.flax_attention_fn()), nnx.Intermediate)(x, True)
    np.testing.assert_allclose(out, out_want, **TOL)
    assert 1 not in got["layers"]
    for i in (0, 2):
        (w,) = got["layers"][i]["attention_weights"]
        assert w.shape == (4, 8, 6, 6)
        np.testing.assert_allclose(w, want["layers"][i]["attention_weights"][0], **TOL)
    _, nothing = nnx.capture(Model(jattn.flax_attention_fn()), nnx.Intermediate)(x)
    assert not nothing


def test_nnx_dropout_deterministic_and_rngs():
    x = _normal(0, (2, 5, 5))
    plain = _nnx(jattn.flax_attention_fn())(x)
    layer = _nnx(jattn.flax_attention_fn(), dropout_rate=0.5)
    np.testing.assert_array_equal(layer(x, deterministic=True), plain)
    a = layer(x, deterministic=False, rngs=nnx.Rngs(dropout=1))
    b = layer(x, deterministic=False, rngs=nnx.Rngs(dropout=1))
    c = layer(x, deterministic=False, rngs=nnx.Rngs(dropout=2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, plain)


# ------------------------------------------------- the function, called directly


@pytest.mark.parametrize(("use_padding", "cross"), [(a, b) for a in (0, 1) for b in (0, 1)])
def test_causal_mask_equivalence_5d(use_padding, cross):
    # flax nnx's test_causal_mask_equivalence: a padding mask with
    # is_causal=True equals the precombined mask; batch dims (1, 1).
    q_len, kv_len = 2, 4 if cross else 2
    q = _normal(0, (1, 1, q_len, 2, 4))
    k, v = _normal(1, (1, 1, kv_len, 2, 4)), _normal(2, (1, 1, kv_len, 2, 4))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((q_len, kv_len), bool)), (1, 1, 2, q_len, kv_len))
    padding = None
    if use_padding:
        padding = jnp.ones((1, 1, 1, q_len, kv_len), bool).at[..., -1:].set(False)
    fn = jattn.flax_attention_fn()
    want = nnx.dot_product_attention(
        q, k, v, mask=nnx.combine_masks(padding, causal, dtype=q.dtype)
    )
    got = fn(q, k, v, mask=padding, is_causal=True, deterministic=True)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(fn(q, k, v, mask=nn.combine_masks(padding, causal)), want, **TOL)


def test_bias_broadcast_over_batch_dims():
    q = _normal(0, (2, 3, 4, 2, 8))
    k = _normal(1, (2, 3, 5, 2, 8))
    bias = _normal(2, (3, 2, 4, 5))  # [batch[1:], N, T, S]
    got = jattn.flax_attention_fn()(q, k, k, bias)
    with _flax_reference():
        want = nn.dot_product_attention(q, k, k, bias)
    np.testing.assert_allclose(got, want, **TOL)


def test_gqa_parity_with_jax_nn():
    q = _normal(0, (2, 8, 4, 16))
    k, v = _normal(1, (2, 8, 2, 16)), _normal(2, (2, 8, 2, 16))
    np.testing.assert_allclose(
        jattn.flax_attention_fn()(q, k, v), jax.nn.dot_product_attention(q, k, v), **TOL
    )


@pytest.mark.parametrize(
    ("q_shape", "k_shape"),
    [((2, 16, 4, 8), (16, 4, 8)), ((2, 16, 4, 8), (3, 16, 4, 8))],
)
def test_invalid_shapes(q_shape, k_shape):
    with pytest.raises(ValueError, match="rank|batch"):
        jattn.flax_attention_fn()(jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(k_shape))


@pytest.mark.parametrize(
    "override",
    [
        dict(einsum_dot_general=jax.lax.dot_general),
        dict(qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum),
    ],
)
def test_einsum_overrides_are_refused(override):
    x = jnp.ones((1, 4, 2, 2))
    with pytest.raises(ValueError, match=next(iter(override))):
        jattn.flax_attention_fn()(x, x, x, **override)


def test_linen_einsum_cls_refused_by_name():
    x = jnp.ones((1, 4, 4))
    layer = _linen(
        jattn.flax_attention_fn(),
        qk_attn_weights_einsum_cls=lambda: jnp.einsum,
        attn_weights_value_einsum_cls=lambda: jnp.einsum,
    )
    with pytest.raises(ValueError, match="qk_attn_weights_einsum"):
        layer.init(jax.random.key(0), x)


def test_precision_applies_to_xla_and_is_refused_by_tiled_paths():
    q = _normal(0, (1, 4, 2, 8))
    fn = jattn.flax_attention_fn()
    jaxpr = str(jax.make_jaxpr(lambda a: fn(a, a, a, precision=jax.lax.Precision.HIGHEST))(q))
    assert "Precision.HIGHEST" in jaxpr
    grad = jax.make_jaxpr(jax.grad(lambda a: fn(a, a, a, precision="highest").sum()))(q)
    assert "Precision.DEFAULT" not in str(grad) and "Precision.HIGHEST" in str(grad)
    np.testing.assert_allclose(
        fn(q, q, q, precision=jax.lax.Precision.HIGHEST),
        nn.dot_product_attention(q, q, q, precision=jax.lax.Precision.HIGHEST),
        **TOL,
    )
    fn(q, q, q, precision=jax.lax.Precision.DEFAULT)  # default precision: any implementation
    for impl in ("chunked", "pallas"):
        with pytest.raises(ValueError, match="precision"):
            jattn.flax_attention_fn(impl)(q, q, q, precision=jax.lax.Precision.HIGHEST)


def test_force_fp32_for_softmax_is_a_no_op_on_the_output():
    q = _normal(0, (1, 4, 2, 8), jnp.bfloat16)
    fn = jattn.flax_attention_fn()
    np.testing.assert_array_equal(fn(q, q, q, force_fp32_for_softmax=True), fn(q, q, q))


def test_complex_inputs_are_refused():
    x = jnp.ones((1, 4, 2, 2), jnp.complex64)
    with pytest.raises(TypeError, match="complex"):
        jattn.flax_attention_fn()(x, x, x)


def test_options():
    q = _normal(0, (2, 6, 2, 4))
    causal = jattn.flax_attention_fn(is_causal=True)(q, q, q)
    np.testing.assert_allclose(causal, jattn.dot_product_attention(q, q, q, is_causal=True), **TOL)
    windowed = jattn.flax_attention_fn(local_window_size=(1, 0), scale=0.5)(q, q, q)
    np.testing.assert_allclose(
        windowed,
        jattn.dot_product_attention(q, q, q, local_window_size=(1, 0), scale=0.5),
        **TOL,
    )
    with pytest.raises(ValueError, match="q_positions"):
        jattn.flax_attention_fn(q_positions=jnp.arange(6))
    with pytest.raises(ValueError, match="dropout_rate"):
        jattn.flax_attention_fn(dropout_rate=0.1)
    with pytest.raises(TypeError, match="unknown option"):
        jattn.flax_attention_fn(causal=True)
    with pytest.raises(ValueError, match="unknown implementation"):
        jattn.flax_attention_fn("flash")


def test_dropout_needs_rng():
    q = _normal(0, (1, 4, 2, 8))
    fn = jattn.flax_attention_fn()
    with pytest.raises(ValueError, match="dropout_rng"):
        fn(q, q, q, dropout_rate=0.1)
    fn(q, q, q, dropout_rate=0.1, deterministic=True)  # off: no rng needed


# ------------------------------------------------------------------- dropout


def _dropped_weights(fn, b, n, t, s, rate, broadcast, seed=0, mask=None):
    """The post-dropout weights `[b, n, t, s]`, read off the output with
    one-hot values (`v_s = e_s`, so `out_t = Σ_s w'[t, s] e_s = w'[t]`),
    and the weights before dropout."""
    q = _normal(10, (b, t, n, 8))
    k = _normal(11, (b, s, n, 8))
    v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (b, s, n, s))
    kw = dict(dropout_rate=rate, dropout_rng=jax.random.key(seed), broadcast_dropout=broadcast)
    out = fn(q, k, v, None, mask, **kw)  # [b, t, n, s]
    weights = jattn.attention_weights(q, k, None, mask)  # [b, n, t, s]
    return np.asarray(out.transpose(0, 2, 1, 3)), np.asarray(weights)


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_statistics_and_sharing(rate, broadcast):
    b, n, t, s = 3, 4, 32, 32
    dropped, weights = _dropped_weights(jattn.flax_attention_fn("xla"), b, n, t, s, rate, broadcast)
    keep = dropped != 0
    # kept weights are scaled by 1 / (1 - rate), dropped ones are 0
    np.testing.assert_allclose(
        dropped, np.where(keep, weights / (1 - rate), 0.0), rtol=1e-5, atol=1e-7
    )
    kept = keep.mean()
    sigma = np.sqrt(rate * (1 - rate) / (t * s if broadcast else keep.size))
    assert abs(kept - (1 - rate)) < 5 * sigma, (kept, 1 - rate)
    same_everywhere = (keep == keep[:1, :1]).all()
    assert same_everywhere == broadcast  # flax: broadcast over batch and heads


def test_dropout_keep_mask_is_jattn_hash():
    b, n, t, s, rate = 2, 3, 8, 8, 0.3
    dropped, _ = _dropped_weights(jattn.flax_attention_fn(), b, n, t, s, rate, False, seed=4)
    seed = jattn.dropout.seed_words(jax.random.key(4))
    idx = np.ix_(np.arange(b), np.arange(n), np.arange(t), np.arange(s))
    want = jattn.dropout.keep(seed, rate, *(jnp.asarray(i) for i in idx))
    np.testing.assert_array_equal(dropped != 0, want)


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_with_gqa_equals_repeated_kv_heads(broadcast):
    # GQA: query head i reads kv head i // 2 and keeps its own (or the shared) mask.
    q = _normal(0, (2, 5, 4, 8))
    k, v = _normal(1, (2, 6, 2, 8)), _normal(2, (2, 6, 2, 8))
    fn = jattn.flax_attention_fn()
    kw = dict(dropout_rate=0.5, dropout_rng=jax.random.key(3), broadcast_dropout=broadcast)
    full_k, full_v = (jnp.repeat(a, 2, axis=2) for a in (k, v))
    np.testing.assert_allclose(fn(q, k, v, **kw), fn(q, full_k, full_v, **kw), **TOL)


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_same_output_in_every_implementation(impl, broadcast):
    # The keep mask is shared, so every implementation drops the same weights.
    x = _normal(0, (2, 3, 7, 5))  # batch dims (2, 3)
    mask = nn.make_causal_mask(jnp.ones((2, 3, 7)))
    kw = dict(num_heads=4, qkv_features=8, dropout_rate=0.4, broadcast_dropout=broadcast)
    kw |= dict(deterministic=None)
    ref = _linen(jattn.flax_attention_fn("xla"), **kw)
    variables = ref.init(jax.random.key(1), x, deterministic=True)
    call = dict(mask=mask, deterministic=False, rngs={"dropout": jax.random.key(5)})
    want = ref.apply(variables, x, **call)
    got = _linen(jattn.flax_attention_fn(impl), **kw).apply(variables, x, **call)
    np.testing.assert_allclose(got, want, **TOL)
    no_drop = ref.apply(variables, x, mask=mask, deterministic=True)
    assert not np.allclose(want, no_drop)


def test_import_jattn_needs_no_flax():
    code = (
        "import sys, jattn\n"
        "assert callable(jattn.flax_attention_fn)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'flax')\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
