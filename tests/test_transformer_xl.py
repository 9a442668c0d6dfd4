"""Transformer-XL relative attention (`position="transformer_xl"`, Dai et al.
2019) against its formula, materialised in float64:

    logit[n, i, j] = scale * ((q_i + u_n)·k_j + (q_i + v_n)·W_R[n] R(clip(i - j)))

with R the sinusoidal embedding of the distance; forward and backward
(queries' inputs and every parameter, u, v and W_R included) through the
xla, chunked and Pallas (interpret) implementations, in a bidirectional and
a causal layer, with the clip both binding and not. Then the scheme has no
absolute term (the model's outputs do not move when every position shifts)
and its parameters are u, v, W_R per layer.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import positions as pos_lib
from jattn.models import Transformer, TransformerConfig
from jattn.models.layers import Attention

B, T, D, N = 2, 7, 16, 4


def _config(impl: str, clip: int) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=11,
        d_model=D,
        num_heads=N,
        num_kv_heads=2,  # GQA: each kv head serves two query heads
        num_layers=1,
        d_ff=32,
        max_len=16,
        position="transformer_xl",
        position_options={"transformer_xl": {"max_distance": clip}},
        attention_impl=impl,
    )


def _formula(params, x, *, causal: bool, clip: int):
    """The materialised float64 formula `[B, T, D]` (GQA by repeating kv heads)."""
    p = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
    x = jnp.asarray(x, jnp.float64)
    q = jnp.einsum("BTD,DNH->BTNH", x, p["q"])
    k = jnp.repeat(jnp.einsum("BSD,DKH->BSKH", x, p["k"]), N // 2, axis=2)
    v = jnp.repeat(jnp.einsum("BSD,DKH->BSKH", x, p["v"]), N // 2, axis=2)
    i = jnp.arange(T)
    dist = jnp.clip(i[:, None] - i[None, :], -clip, clip)  # [T, S], i - j
    rel = pos_lib.sinusoidal(dist, D).astype(jnp.float64)  # [T, S, D], the O(L^2 D) form
    proj = jnp.einsum("TSD,DNH->NTSH", rel, p["xl_r"])  # [N, T, S, H]
    content = jnp.einsum("BTNH,BSNH->BNTS", q + p["xl_u"][None, None], k)
    position = jnp.einsum("BTNH,NTSH->BNTS", q + p["xl_v"][None, None], proj)
    logits = (content + position) * (D // N) ** -0.5
    if causal:
        logits = jnp.where(i[None, None, :, None] >= i[None, None, None, :], logits, -1e30)
    w = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("BNTS,BSNH->BTNH", w, v)
    return jnp.einsum("BTNH,NHD->BTD", out, p["o"])


@pytest.mark.parametrize("impl", ["xla", "chunked", "pallas"])
@pytest.mark.parametrize("causal,clip", [(False, 3), (True, 0)])
def test_layer_equals_the_float64_formula_forward_and_backward(impl, causal, clip):
    cfg = _config(impl, clip)
    k = cfg.position_options["transformer_xl"].max_distance or cfg.max_len - 1
    layer = Attention(cfg, causal=causal)
    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
    params = layer.init(jax.random.key(0), x, x)["params"]
    params = dict(nn.unbox(params))
    rng = np.random.default_rng(0)  # u, v initialise at 0: give them values
    params = {
        **params,
        "xl_u": jnp.asarray(rng.normal(size=(N, D // N)), jnp.float32),
        "xl_v": jnp.asarray(rng.normal(size=(N, D // N)), jnp.float32),
    }
    assert sorted(params) == ["k", "o", "q", "v", "xl_r", "xl_u", "xl_v"]

    def loss(p, xs, f):
        return jnp.sum(jnp.sin(f(p, xs)))  # a cotangent that differs per element

    got_f = lambda p, xs: layer.apply({"params": p}, xs, xs)
    got_out = got_f(params, x)
    g_p, g_x = jax.grad(loss, argnums=(0, 1))(params, x, got_f)
    with jax.enable_x64(True):
        want_f = lambda p, xs: _formula(p, xs, causal=causal, clip=k)
        want_out = want_f(params, x)
        w_p, w_x = jax.grad(loss, argnums=(0, 1))(
            jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params),
            jnp.asarray(x, jnp.float64),
            want_f,
        )
        np.testing.assert_allclose(got_out, want_out, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(g_x, w_x, rtol=1e-4, atol=1e-4)
        for name in params:
            np.testing.assert_allclose(g_p[name], w_p[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_no_absolute_term_shifted_positions_give_the_same_outputs():
    cfg = _config("xla", 0).replace(max_len=32, dropout_rate=0.0)
    model = Transformer(cfg)
    x = jnp.array([[3, 4, 5, 6, 1, 0]])
    y = jnp.array([[7, 8, 9, 1]])
    params = model.init(jax.random.key(0), x, y)["params"]
    seg = dict(inputs_segment_ids=(x != 0).astype(jnp.int32), targets_segment_ids=jnp.ones_like(y))
    base = model.apply({"params": params}, x, y, **seg)
    shifted = model.apply(
        {"params": params},
        x,
        y,
        **seg,
        inputs_positions=jnp.arange(6)[None] + 9,
        targets_positions=jnp.arange(4)[None] + 9,
    )
    np.testing.assert_allclose(base, shifted, rtol=1e-5, atol=1e-5)
    swapped = model.apply({"params": params}, x[:, [1, 0, 2, 3, 4, 5]], y, **seg)
    assert not np.allclose(base, swapped, atol=1e-4)  # order is seen
    assert "positions" not in params["encoder"]  # no absolute vectors
    attn = params["encoder"]["layer_0"]["self_attention"]
    assert {"xl_u", "xl_v", "xl_r"} <= set(attn)


def test_bad_clip_is_a_one_line_error():
    with pytest.raises(ValueError, match="transformer_xl: max_distance must be an int >= 0"):
        _config("xla", -1)
