"""A float64 oracle for attention, written independently of jattn's code.

Deliberately naive: keys and values are repeated for GQA, the Shaw tables are
gathered into full `[B, T, S, H]` tensors, the mask is built densely. That is
the formulation jattn must never use at scale, which is exactly why it makes a
good oracle on small shapes. Runs under `jax.enable_x64` so `jax.vjp` gives
float64 gradients too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _f64(x):
    return None if x is None else jnp.asarray(np.asarray(x, dtype=np.float64))


def _attend(
    q,
    k,
    v,
    bias,
    rel_k,
    rel_v,
    mod_params=None,
    *,
    mask,
    is_causal,
    qseg,
    kvseg,
    qpos,
    kvpos,
    dist,
    scale,
    mod_fn=None,
):
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    rep = n // kh
    k = jnp.repeat(k, rep, axis=2)  # [B,S,N,H]
    v = jnp.repeat(v, rep, axis=2)  # [B,S,N,Hv]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k)
    vis = jnp.ones((b, n, t, s), bool)
    if mask is not None:
        vis = vis & jnp.broadcast_to(jnp.asarray(mask), (b, n, t, s))
    if is_causal:
        vis = vis & (kvpos[:, None, None, :] <= qpos[:, None, :, None])
    if qseg is not None:
        same = qseg[:, None, :, None] == kvseg[:, None, None, :]
        vis = vis & same & (qseg[:, None, :, None] != 0)  # id 0 is padding: no segment
    r = None
    if rel_k is not None or rel_v is not None:
        r = np.clip(kvpos[:, None, :] - qpos[:, :, None], -dist, dist) + dist  # [B,T,S]
    if rel_k is not None:
        tab = rel_k if rel_k.ndim == 3 else jnp.broadcast_to(rel_k, (n,) + rel_k.shape)
        gathered = tab[:, r]  # [N,B,T,S,H]
        logits = logits + jnp.einsum("btnh,nbtsh->bnts", q, gathered)
    logits = logits * scale
    if bias is not None:
        logits = logits + jnp.broadcast_to(bias, (b, n, t, s))
    if mod_fn is not None:  # the score mod on the whole materialised [B, N, T, S] logits
        logits = mod_fn(
            mod_params,
            logits,
            jnp.arange(b)[:, None, None, None],
            jnp.arange(n)[None, :, None, None],
            jnp.asarray(qpos)[:, None, :, None],
            jnp.asarray(kvpos)[:, None, None, :],
        )
    logits = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(vis, jnp.exp(logits - m), 0.0)
    den = w.sum(-1, keepdims=True)
    w = w / jnp.where(den == 0, 1.0, den)
    out = jnp.einsum("bnts,bsnv->btnv", w, v)
    if rel_v is not None:
        tab = rel_v if rel_v.ndim == 3 else jnp.broadcast_to(rel_v, (n,) + rel_v.shape)
        gathered = tab[:, r]  # [N,B,T,S,Hv]
        out = out + jnp.einsum("bnts,nbtsv->btnv", w, gathered)
    return out


def _prepare(query, key, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, scale):
    b, t, _, h = np.shape(query)
    s = np.shape(key)[1]
    qpos = np.broadcast_to(np.arange(t) if q_positions is None else np.asarray(q_positions), (b, t))
    kvpos = np.broadcast_to(
        np.arange(s) if kv_positions is None else np.asarray(kv_positions), (b, s)
    )
    qseg = None if q_segment_ids is None else np.broadcast_to(np.asarray(q_segment_ids), (b, t))
    kvseg = None if kv_segment_ids is None else np.broadcast_to(np.asarray(kv_segment_ids), (b, s))
    scale = 1.0 / np.sqrt(h) if scale is None else scale
    return dict(qpos=qpos, kvpos=kvpos, qseg=qseg, kvseg=kvseg, scale=scale)


def attention(
    query,
    key,
    value,
    *,
    bias=None,
    mask=None,
    is_causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_positions=None,
    kv_positions=None,
    relative=None,
    scale=None,
    score_mod=None,
):
    """Float64 attention with jattn's public semantics; returns numpy `[B,T,N,Hv]`."""
    out, _ = attention_and_grads(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
        relative=relative,
        scale=scale,
        score_mod=score_mod,
        cotangent=None,
    )
    return out


def _on_the_host(fn):
    """`fn` run with the host CPU as jax's default device."""

    @functools.wraps(fn)
    def on_host(*args, **kwargs):
        with jax.default_device(jax.devices("cpu")[0]):
            return fn(*args, **kwargs)

    return on_host


@_on_the_host
def attention_and_grads(
    query,
    key,
    value,
    *,
    bias=None,
    mask=None,
    is_causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_positions=None,
    kv_positions=None,
    relative=None,
    scale=None,
    score_mod=None,
    cotangent=None,
):
    """Float64 output and, given a cotangent, the gradients as a dict with keys
    query, key, value, bias, rel_key, rel_value (None where not applicable)
    and, with a score mod, score_mod (the params' gradient pytree, float64).
    A `score_mod` (`jattn.ScoreMod`) is called on the whole float64 logits
    `[B, N, T, S]`, its float params upcast to float64. It runs on the host
    CPU whatever the default device: a GPU's XLA may have no float64 GEMM
    (jaxlib 0.11 on an H200), and the GPU window runs these contracts there."""
    ctx = _prepare(
        query,
        key,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        scale=scale,
    )
    # The oracle masks with -inf on purpose (the naive formulation); it runs
    # with the suite's debug_nans / debug_infs checks off, jattn with them on.
    with jax.enable_x64(True), jax.debug_nans(False), jax.debug_infs(False):
        dist = 0 if relative is None else relative.max_distance
        rel_k = None if relative is None else _f64(relative.key)
        rel_v = None if relative is None else _f64(relative.value)
        mod_params = None if score_mod is None else jax.tree.map(_f64, score_mod.params)
        primals = (_f64(query), _f64(key), _f64(value), _f64(bias), rel_k, rel_v, mod_params)

        def f(q, k, v, bias, rk, rv, mp):
            return _attend(
                q,
                k,
                v,
                bias,
                rk,
                rv,
                mp,
                mod_fn=None if score_mod is None else score_mod.fn,
                mask=mask,
                is_causal=is_causal,
                qseg=ctx["qseg"],
                kvseg=ctx["kvseg"],
                qpos=ctx["qpos"],
                kvpos=ctx["kvpos"],
                dist=dist,
                scale=ctx["scale"],
            )

        out, vjp = jax.vjp(f, *primals)
        grads = None
        if cotangent is not None:
            g = vjp(_f64(cotangent))
            names = ("query", "key", "value", "bias", "rel_key", "rel_value")
            grads = {
                nm: (None if gi is None or p is None else np.asarray(gi))
                for nm, gi, p in zip(names, g[:6], primals[:6], strict=True)
            }
            if mod_params is not None:
                grads["score_mod"] = jax.tree.map(np.asarray, g[6])
        return np.asarray(out), grads


# --- positional biases materialised, as the models added them before score mods -------
#
# Dense `[B, N, T, S]` biases: the score mods of `jattn.positions` must equal
# them exactly (tests/test_score_mod.py, tests/test_schemes.py). Shapes: B batch,
# N heads, T queries, S keys.


def alibi_bias(slopes, q_positions, kv_positions):
    """ALiBi's symmetric bias `-slope_n |kv_pos - q_pos|`: float32 `[B, N, T, S]`
    from slopes `[N]` and int positions `[B, T]`, `[B, S]`."""
    q = jnp.asarray(q_positions).astype(jnp.float32)
    kv = jnp.asarray(kv_positions).astype(jnp.float32)
    d = jnp.abs(kv[:, None, :] - q[:, :, None])  # [B, T, S]
    return -jnp.asarray(slopes)[None, :, None, None] * d[:, None, :, :]


def t5_buckets(q_positions, kv_positions, num_buckets=32, max_distance=128, bidirectional=True):
    """T5's bucket of every (query, key) pair: int32 `[B, T, S]` (the elementwise
    `jattn.positions.t5_relative_bucket` of `kv_pos - q_pos`)."""
    from jattn.positions import t5_relative_bucket  # noqa: PLC0415 (jattn-free at the top)

    rel = jnp.asarray(kv_positions)[:, None, :] - jnp.asarray(q_positions)[:, :, None]
    return t5_relative_bucket(rel, num_buckets, max_distance, bidirectional)


def t5_bias(table, buckets):
    """T5's learned bias looked up densely: `[B, N, T, S]` from a table
    `[num_buckets, N]` and int buckets `[B, T, S]` (`t5_buckets`)."""
    return jnp.transpose(jnp.take(table, buckets, axis=0), (0, 3, 1, 2))
