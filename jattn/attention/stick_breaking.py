"""Stick-breaking attention (Tan, Yang, Courville, Panda, Shen, ICLR 2025,
"Scaling Stick-Breaking Attention"): weights without a softmax.

Query `i` breaks a stick from its nearest visible key backwards: key `j` takes
the fraction `beta_ij = sigmoid(s_ij)` of what the keys between it and `i`
left over,

    w_ij = beta_ij * prod_{j < k <= i, k visible} (1 - beta_ik),   out_i = sum_j w_ij v_j,

so the weights sum to at most 1 and a near key that takes the stick hides the
keys behind it: order, not position, is what the weights read (the paper uses
no positional scheme). Causal by construction (keys `k <= i` by position),
with packed segments and padding as in `jattn.masks`; a query that sees no
key returns 0, as softmax's empty rows do in jattn.

Computed in log space, where it is stable for any finite logit:

    log w_ij = log sigmoid(s_ij) - sum_{j < k <= i} softplus(s_ik),

every term <= 0, so `exp` never overflows and no running max is needed.

Two implementations, equal in float64 (tests/test_stick_breaking.py):

- `stick_breaking_attention_xla`: the materialised reference, `[B, N, T, S]`.
- `stick_breaking_attention`: tiled by `jattn.attention.reverse_scan` (key
  tiles from the diagonal backwards, the running softplus sum per query row
  carried across them); memory linear in the length, forward and backward
  (plain autodiff through the checkpointed scan).

Not yet a registered scheme (docs/schemes.md, "The reverse scan").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jattn.attention import reverse_scan

Array = jax.Array

__all__ = ["stick_breaking_attention", "stick_breaking_attention_xla"]


def _prepare(query, key, value, scale, positions_segments):
    """Grouped inputs in the compute dtype, the scale and int32 ids."""
    b, k, g = reverse_scan.inputs(query, key, value, "stick-breaking attention")
    t, s = query.shape[1], key.shape[1]
    q_pos, kv_pos, q_seg, kv_seg = positions_segments
    ids = (
        reverse_scan.ids(q_pos, b, t, None, "q_positions"),
        reverse_scan.ids(kv_pos, b, s, None, "kv_positions"),
        reverse_scan.ids(q_seg, b, t, 1, "q_segment_ids"),
        reverse_scan.ids(kv_seg, b, s, 1, "kv_segment_ids"),
    )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    compute = jnp.promote_types(query.dtype, jnp.float32)
    return (b, k, g), scale, compute, ids


def _weights(s: Array, vis: Array, carried: Array | float = 0.0) -> tuple[Array, Array]:
    """Stick-breaking weights of a block of logits `s [..., t, s]` and the
    block's softplus row sum; `carried [..., t]` is the softplus sum over the
    visible keys to the block's right."""
    sp = jnp.where(vis, jax.nn.softplus(s), 0.0)
    behind = reverse_scan.exclusive_suffix_sum(sp)
    if not isinstance(carried, float):
        behind = behind + carried[..., None]
    log_w = jax.nn.log_sigmoid(s) - behind  # <= 0: exp never overflows
    return jnp.where(vis, jnp.exp(log_w), 0.0), jnp.sum(sp, axis=-1)


def stick_breaking_attention_xla(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
) -> Array:
    """Stick-breaking attention, materialised: the reference.

    Args:
      query: `[B, T, N, H]`.
      key: `[B, S, K, H]`, K dividing N (MHA, GQA, MQA).
      value: `[B, S, K, Hv]`.
      scale: the logits' scale, `s_ij = scale * q_i . k_j`; default `H ** -0.5`.
      q_positions, kv_positions: int `[B, T]` / `[B, S]`; default `arange`.
        Key `j` is visible to query `i` when `kv_positions[j] <= q_positions[i]`.
      q_segment_ids, kv_segment_ids: int `[B, T]` / `[B, S]`; default all 1.
        Equal ids attend; id 0 is padding.

    Returns:
      `[B, T, N, Hv]` in the query's dtype (computed in at least float32).
    """
    (b, k, g), scale, compute, (q_pos, kv_pos, q_seg, kv_seg) = _prepare(
        query, key, value, scale, (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    )
    t, n = query.shape[1], query.shape[2]
    q = query.astype(compute).reshape(b, t, k, g, -1)
    s = scale * jnp.einsum("BTKGH,BSKH->BKGTS", q, key.astype(compute))
    vis = reverse_scan.visibility(q_pos, kv_pos, q_seg, kv_seg)[:, None, None]  # [B,1,1,T,S]
    w, _ = _weights(s, vis)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", w, value.astype(compute))
    return out.reshape(b, t, n, -1).astype(query.dtype)


def stick_breaking_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> Array:
    """Stick-breaking attention, tiled: `stick_breaking_attention_xla`'s
    arguments and result, without the `[T, S]` matrix.

    Each query tile visits its key tiles from the last backwards, carrying per
    query row the softplus sum over the visible keys already visited, so the
    weights of a tile are `log sigmoid(s) - (carried + the tile's own sum to
    the right)`. `block_q` / `block_k` are the tile lengths (clipped to T / S).
    """
    (b, k, g), scale, compute, pos_seg = _prepare(
        query, key, value, scale, (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    )
    t, n = query.shape[1], query.shape[2]
    ev = value.shape[-1]
    rows = query.astype(compute).reshape(b, t, k, g, -1)
    cols = (key.astype(compute), value.astype(compute))

    def init(q):  # q [B,t,K,G,H]
        bt = q.shape[:2]
        return jnp.zeros((*bt, k, g), compute), jnp.zeros((*bt, k, g, ev), compute)

    def step(carry, q, col, vis):
        behind, out = carry  # [B,t,K,G], [B,t,K,G,E]
        kk, vv = col
        s = scale * jnp.einsum("BtKGH,BsKH->BKGts", q, kk)
        w, total = _weights(s, vis[:, None, None], behind.transpose(0, 2, 3, 1))
        out = out + jnp.einsum("BKGts,BsKE->BtKGE", w, vv)
        return behind + total.transpose(0, 3, 1, 2), out

    def finish(carry, q):
        return carry[1].reshape(q.shape[0], q.shape[1], n, ev)

    out = reverse_scan.scan(
        step, init, finish, rows, cols, pos_seg, block_q=block_q, block_k=block_k
    )
    return out.astype(query.dtype)
