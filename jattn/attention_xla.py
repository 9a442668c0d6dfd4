"""The readable reference implementation: materialise the logits, softmax, mix.

Computes in float32 whatever the input dtype (bf16 inputs are upcast), which
makes it the baseline the tiled implementations are compared with, next to the
float64 oracle in the tests. Memory is O(B·N·T·S).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import scores
from jattn.positions import relative_ids

Array = jax.Array


def _grouped_weights(
    q,
    kk,
    *,
    bias,
    mask,
    is_causal,
    q_segment_ids,
    kv_segment_ids,
    q_positions,
    kv_positions,
    rel_key,
    max_distance,
    scale,
    num_kv_heads,
    need_relative_ids,
):
    """Unnormalised weights `[B,K,G,T,S]`, their row sums `[B,K,G,T,1]` and the
    relative ids (or None). `q` is `[B,K,G,T,H]`, `kk` is `[B,K,S,H]`."""
    k = num_kv_heads
    g, h = q.shape[2], q.shape[-1]
    num_rel = 2 * max_distance + 1
    r = qr = None
    if rel_key is not None or need_relative_ids:
        r = relative_ids(q_positions, kv_positions, max_distance)  # [B,T,S]
    if rel_key is not None:
        tab = rel_key.astype(q.dtype).reshape(k, g, num_rel, h)
        qr = jnp.einsum("BKGTH,KGRH->BKGTR", q, tab)  # [B,K,G,T,R]
    grouped_bias = None if bias is None else scores.group_heads(bias, k)
    logits = scores.tile_logits(q, kk, scale=scale, bias=grouped_bias, qr=qr, r=r)
    logits = logits.astype(q.dtype)  # [B,K,G,T,S]
    vis = scores.visibility(
        q_pos=q_positions,
        kv_pos=kv_positions,
        is_causal=is_causal,
        q_seg=q_segment_ids,
        kv_seg=kv_segment_ids,
        kv_valid=None,
        mask=None if mask is None else scores.group_heads(mask, k),
    )
    _, p = scores.masked_softmax_parts(logits, vis)  # [B,K,G,T,S]
    return p, jnp.sum(p, axis=-1, keepdims=True), r


def attention_xla(
    query: Array,
    key: Array,
    value: Array,
    *,
    bias: Array | None,
    mask: Array | None,
    is_causal: bool,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    q_positions: Array,
    kv_positions: Array,
    rel_key: Array | None,
    rel_value: Array | None,
    max_distance: int,
    scale: float,
) -> Array:
    """Attention over the whole `[T, S]` problem at once (normal-form inputs,
    see `jattn.attention`). Returns `[B, T, N, Hv]` in the dtype of `query`."""
    b, t, n, h = query.shape
    _, s, k, hv = value.shape
    g = n // k
    compute = jnp.promote_types(query.dtype, jnp.float32)
    q = query.astype(compute).reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,H]
    kk = key.astype(compute).transpose(0, 2, 1, 3)  # [B,K,S,H]
    vv = value.astype(compute).transpose(0, 2, 1, 3)  # [B,K,S,Hv]
    num_rel = 2 * max_distance + 1
    p, denom, r = _grouped_weights(
        q,
        kk,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
        rel_key=rel_key,
        max_distance=max_distance,
        scale=scale,
        num_kv_heads=k,
        need_relative_ids=rel_value is not None,
    )
    out = jnp.einsum("BKGTS,BKSV->BKGTV", p, vv)  # [B,K,G,T,Hv]
    if rel_value is not None:
        pr = scores.rel_scatter(p, r, num_rel)  # [B,K,G,T,R]
        vtab = rel_value.astype(compute).reshape(k, g, num_rel, hv)
        out = out + jnp.einsum("BKGTR,KGRV->BKGTV", pr, vtab)
    out = out / jnp.where(denom == 0, 1.0, denom)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv).astype(query.dtype)


def attention_weights_xla(
    query: Array,
    key: Array,
    *,
    bias: Array | None,
    mask: Array | None,
    is_causal: bool,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    q_positions: Array,
    kv_positions: Array,
    rel_key: Array | None,
    max_distance: int,
    scale: float,
) -> Array:
    """The softmax weights `[B, N, T, S]` (float32) the xla path mixes values
    with; rows with no visible key are all zeros."""
    b, t, n, h = query.shape
    k = key.shape[2]
    compute = jnp.promote_types(query.dtype, jnp.float32)
    q = query.astype(compute).reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    kk = key.astype(compute).transpose(0, 2, 1, 3)
    p, denom, _ = _grouped_weights(
        q,
        kk,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
        rel_key=rel_key,
        max_distance=max_distance,
        scale=scale,
        num_kv_heads=k,
        need_relative_ids=False,
    )
    p = p / jnp.where(denom == 0, 1.0, denom)  # [B,K,G,T,S]
    return p.reshape(b, n, t, p.shape[-1])
