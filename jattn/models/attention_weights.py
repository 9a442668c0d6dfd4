"""Attention weights `[B, N, T, S]` for interpretability (materialising, small shapes).

`jattn.dot_product_attention` returns only the mixed values; tiled
implementations never hold the weights. When a model is built with
`capture_attention=True`, the attention layer recomputes the weights with
this function (the xla formula: same visibility rules, same Shaw key term,
same bias) and sows them. It materialises `[B, N, T, S]` by design, so it is
for probing small inputs, never for training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import masks, positions

Array = jax.Array

__all__ = ["attention_weights"]


def attention_weights(
    query: Array,
    key: Array,
    *,
    bias: Array | None,
    is_causal: bool,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    q_positions: Array,
    kv_positions: Array,
    rel_key: Array | None,
    max_distance: int,
    scale: float,
) -> Array:
    """Softmax weights of `jattn.dot_product_attention` for the same arguments.

    Args:
      query: `[B, T, N, H]`.
      key: `[B, S, K, H]`, K divides N.
      bias: float broadcastable to `[B, N, T, S]`, or None.
      is_causal: key visible iff `kv_position <= q_position`.
      q_segment_ids, kv_segment_ids: int `[B, T]`, `[B, S]`, or both None.
      q_positions, kv_positions: int `[B, T]`, `[B, S]`.
      rel_key: Shaw key table `[2k+1, H]` (shared by heads) or None.
      max_distance: Shaw clip distance k.
      scale: logit scale.

    Returns:
      float32 `[B, N, T, S]`; each row sums to 1 over visible keys, and a row
      with no visible key is all zeros.
    """
    b, t, n, h = query.shape
    s, k = key.shape[1], key.shape[2]
    g = n // k
    q = query.astype(jnp.float32).reshape(b, t, k, g, h)  # [B, T, K, G, H]
    kk = key.astype(jnp.float32)  # [B, S, K, H]
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, kk)  # [B, K, G, T, S]
    if rel_key is not None:
        qr = jnp.einsum("BTKGH,RH->BKGTR", q, rel_key.astype(jnp.float32))  # [B, K, G, T, R]
        r = positions.relative_ids(q_positions, kv_positions, max_distance)  # [B, T, S]
        idx = jnp.broadcast_to(r[:, None, None], (b, k, g, t, s))
        logits = logits + jnp.take_along_axis(qr, idx, axis=-1)
    logits = logits.reshape(b, n, t, s) * scale  # [B, N, T, S]
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    vis = masks.combine(
        masks.causal(q_positions, kv_positions) if is_causal else None,
        None if q_segment_ids is None else masks.segment(q_segment_ids, kv_segment_ids),
    )  # [B, T, S] or None
    if vis is None:
        return jax.nn.softmax(logits, axis=-1)
    vis = masks.as_logits_mask(vis)  # [B, 1, T, S]
    logits = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(logits - m), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(den == 0, 1.0, den)
