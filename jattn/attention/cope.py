"""Contextual Position Encoding (Golovneva, Wang, Weston, Sukhbaatar 2024,
"Contextual Position Encoding: Learning to Count What's Important"): positions
counted by gates that read the tokens.

Query `i` gates each visible key, `g_ij = sigmoid(s_ij)` with `s_ij` the
scaled logit `scale * q_i . k_j`, and the position of key `j` is the count of
open gates between it and the query,

    p_ij = sum_{j <= k <= i, k visible} g_ik,

clipped to `npos_max - 1`. The logit gains `q_i . e[p_ij]`, interpolated
between the embeddings of `floor(p)` and `ceil(p)` (`e` is the learned table
`[npos_max, H]`, or `[N, npos_max, H]` per head; `q . e` unscaled, as in the
paper's code), then softmax over the visible keys as usual. Causal (keys at
positions `<= i`), with packed segments and padding as in `jattn.masks`; a
query with no visible key returns 0.

`q_i . e[n]` is computed once per query for every `n < npos_max`, `[B, T, N,
npos_max]`, and each logit reads its two entries, so no `[T, S, H]` array of
embeddings is built.

Two implementations, equal in float64 (tests/test_cope.py):

- `cope_attention_xla`: the materialised reference, `[B, N, T, S]`.
- `cope_attention`: tiled by `jattn.attention.reverse_scan` (key tiles from
  the diagonal backwards, the running gate sum per query row carried across
  them, with an online softmax); memory O(L·(tile + npos_max)) per head,
  forward and backward (plain autodiff through the checkpointed scan; the
  table's gradient included).

Both read the two entries from one flat vector, with a hand-written backward
(`lookup`: one scatter-add for both entries), tested against two
`take_along_axis` and their autodiff (`lookup_by_gathers`), which build index
arrays of every batch coordinate and were most of CoPE's backward on a CPU
(docs/schemes.md, "The reverse scan").

The registered scheme `position="cope"` (`jattn.models.data_schemes.Cope`) calls it
in each causal self-attention layer (docs/schemes.md, "The reverse scan").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jattn.attention import reverse_scan

Array = jax.Array

__all__ = ["cope_attention", "cope_attention_xla"]


def _prepare(query, key, value, table, scale, positions_segments):
    """Grouped sizes, scale, compute dtype, int32 ids and `q . e` `[B,T,N,P]`."""
    b, k, g = reverse_scan.inputs(query, key, value, "CoPE attention")
    t, s, n, h = query.shape[1], key.shape[1], query.shape[2], query.shape[3]
    if table.ndim not in (2, 3) or table.shape[-1] != h or table.ndim == 3 and table.shape[0] != n:
        raise ValueError(
            f"CoPE attention: the embedding table must be [npos_max, H] or [N, npos_max, H] "
            f"with H={h}, N={n}; got {table.shape}"
        )
    q_pos, kv_pos, q_seg, kv_seg = positions_segments
    ids = (
        reverse_scan.ids(q_pos, b, t, None, "q_positions"),
        reverse_scan.ids(kv_pos, b, s, None, "kv_positions"),
        reverse_scan.ids(q_seg, b, t, 1, "q_segment_ids"),
        reverse_scan.ids(kv_seg, b, s, 1, "kv_segment_ids"),
    )
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    compute = jnp.promote_types(query.dtype, jnp.float32)
    table = jnp.broadcast_to(table.astype(compute), (n, *table.shape[-2:]))
    qe = jnp.einsum("BTNH,NPH->BTNP", query.astype(compute), table)
    return (b, k, g), scale, compute, ids, qe


def lookup_by_gathers(qe: Array, p: Array) -> Array:
    """`q . e[p]` interpolated: `qe [..., t, P]` read at `p [..., t, s]` in `[0, P - 1]`,
    `(1 - frac) * qe[floor(p)] + frac * qe[ceil(p)]`, by two gathers (autodiff
    transposes each into a scatter-add): what `lookup` is tested against."""
    lo = jnp.floor(p)
    frac = p - lo
    at_lo = jnp.take_along_axis(qe, lo.astype(jnp.int32), axis=-1)
    at_hi = jnp.take_along_axis(qe, jnp.ceil(p).astype(jnp.int32), axis=-1)
    return (1.0 - frac) * at_lo + frac * at_hi


def lookup(qe: Array, p: Array) -> Array:
    """`lookup_by_gathers`'s value and gradients, faster: what both forms call.

    `take_along_axis` indexes every element by all of its batch coordinates, so
    each gather and each of their scatter-adds builds and checks an index array
    of `[..., t, s, rank]`; here `qe` is one flat vector (a padding column per
    row, so that `floor(p) + 1` is in range) indexed by `row * (P + 1) +
    floor(p)`, and the backward is one scatter-add of both neighbours' weights.
    The derivative in `p` is `lookup_by_gathers`'s also at an integer `p`, where
    `ceil(p) == floor(p)` makes it 0 (a kink: either side's slope is as right).
    """
    npos = qe.shape[-1]
    flat = jnp.concatenate([qe, qe[..., -1:]], axis=-1).reshape(-1)
    rows = jnp.arange(flat.shape[0] // (npos + 1), dtype=jnp.int32) * (npos + 1)
    lo = jnp.floor(p)
    idx = rows.reshape(*qe.shape[:-1], 1) + lo.astype(jnp.int32)
    return _interpolate(flat, idx, p - lo)


@jax.custom_vjp
def _interpolate(flat: Array, idx: Array, frac: Array) -> Array:
    """`(1 - frac) * flat[idx] + frac * flat[idx + 1]`. The indices are in range by
    construction, except from a NaN count: clamped ("clip"), so that a NaN stays
    in its own row instead of reading or writing out of bounds."""
    return _interpolate_fwd(flat, idx, frac)[0]


def _interpolate_fwd(flat, idx, frac):
    at_lo = flat.at[idx].get(mode="clip")
    at_hi = flat.at[idx + 1].get(mode="clip")
    slope = jnp.where(frac > 0, at_hi - at_lo, 0.0)  # as ceil(p) == floor(p) at frac 0
    return (1.0 - frac) * at_lo + frac * at_hi, (flat.shape[0], idx, frac, slope)


def _interpolate_bwd(res, ct):
    size, idx, frac, slope = res
    where = jnp.concatenate([idx.reshape(-1), idx.reshape(-1) + 1])
    weights = jnp.concatenate([((1.0 - frac) * ct).reshape(-1), (frac * ct).reshape(-1)])
    d_flat = jnp.zeros((size,), ct.dtype).at[where].add(weights, mode="clip")
    return d_flat, None, ct * slope


_interpolate.defvjp(_interpolate_fwd, _interpolate_bwd)


def _logits(s: Array, vis: Array, qe: Array, carried: Array | float = 0.0) -> tuple[Array, Array]:
    """CoPE logits of a block `s [..., t, s]`, with `qe [..., t, P]` (`q . e`),
    and the block's gate row sum; `carried [..., t]` is the gate sum over the
    visible keys to the block's right. (`lookup` is read when called: the
    tests and benchmarks/attention.py swap in `lookup_by_gathers`.)"""
    gates = jnp.where(vis, jax.nn.sigmoid(s), 0.0)
    p = jax.lax.cumsum(gates, axis=gates.ndim - 1, reverse=True)  # k = j .. the block's end
    if not isinstance(carried, float):
        p = p + carried[..., None]
    p = jnp.minimum(p, qe.shape[-1] - 1)
    return s + lookup(qe, p), jnp.sum(gates, axis=-1)


def _masked_max(z: Array, vis: Array) -> Array:
    """Row max over visible entries, `[..., t]`; very negative where none (no gradient)."""
    neg = jnp.finfo(z.dtype).min / 2
    return jax.lax.stop_gradient(jnp.max(jnp.where(vis, z, neg), axis=-1))


def cope_attention_xla(
    query: Array,
    key: Array,
    value: Array,
    table: Array,
    *,
    scale: float | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
) -> Array:
    """CoPE attention, materialised: the reference.

    Args:
      query: `[B, T, N, H]`.
      key: `[B, S, K, H]`, K dividing N (MHA, GQA, MQA).
      value: `[B, S, K, Hv]`.
      table: the position embeddings `e`, `[npos_max, H]` (shared by the heads)
        or `[N, npos_max, H]`; `npos_max` is its length, and counts clip at
        `npos_max - 1`.
      scale: the logits' scale, `s_ij = scale * q_i . k_j`; default `H ** -0.5`.
      q_positions, kv_positions: int `[B, T]` / `[B, S]`; default `arange`.
        Key `j` is visible to query `i` when `kv_positions[j] <= q_positions[i]`.
      q_segment_ids, kv_segment_ids: int `[B, T]` / `[B, S]`; default all 1.
        Equal ids attend; id 0 is padding.

    Returns:
      `[B, T, N, Hv]` in the query's dtype (computed in at least float32).
    """
    (b, k, g), scale, compute, (q_pos, kv_pos, q_seg, kv_seg), qe = _prepare(
        query, key, value, table, scale, (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    )
    t, n = query.shape[1], query.shape[2]
    q = query.astype(compute).reshape(b, t, k, g, -1)
    s = scale * jnp.einsum("BTKGH,BSKH->BKGTS", q, key.astype(compute))
    vis = reverse_scan.visibility(q_pos, kv_pos, q_seg, kv_seg)[:, None, None]  # [B,1,1,T,S]
    qe = qe.reshape(b, t, k, g, -1).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,P]
    z, _ = _logits(s, vis, qe)
    neg = jnp.finfo(z.dtype).min / 2
    p = jnp.exp(jnp.where(vis, z - _masked_max(z, vis)[..., None], neg))  # 0 where hidden
    total = jnp.sum(p, axis=-1, keepdims=True)
    w = p / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", w, value.astype(compute))
    return out.reshape(b, t, n, -1).astype(query.dtype)


def cope_attention(
    query: Array,
    key: Array,
    value: Array,
    table: Array,
    *,
    scale: float | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> Array:
    """CoPE attention, tiled: `cope_attention_xla`'s arguments and result,
    without the `[T, S]` matrix.

    Each query tile visits its key tiles from the last backwards, carrying per
    query row the gate sum over the visible keys already visited (the count
    seen from the tile's right edge) and an online softmax's max, sum and
    output. `block_q` / `block_k` are the tile lengths (clipped to T / S).
    """
    (b, k, g), scale, compute, pos_seg, qe = _prepare(
        query, key, value, table, scale, (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    )
    t, n = query.shape[1], query.shape[2]
    ev = value.shape[-1]
    rows = (query.astype(compute).reshape(b, t, k, g, -1), qe.reshape(b, t, k, g, -1))
    cols = (key.astype(compute), value.astype(compute))
    neg = jnp.finfo(compute).min / 2

    def init(row):
        bt = row[0].shape[:2]
        zeros = jnp.zeros((*bt, k, g), compute)
        return zeros, jnp.full_like(zeros, neg), zeros, jnp.zeros((*bt, k, g, ev), compute)

    def step(carry, row, col, vis):
        count, m, total, out = carry  # [B,t,K,G] x 3, [B,t,K,G,E]
        q, qe_t = row
        kk, vv = col
        vis = vis[:, None, None]  # [B,1,1,t,s]
        s = scale * jnp.einsum("BtKGH,BsKH->BKGts", q, kk)
        z, gates = _logits(s, vis, qe_t.transpose(0, 2, 3, 1, 4), count.transpose(0, 2, 3, 1))
        m_new = jnp.maximum(m, _masked_max(z, vis).transpose(0, 3, 1, 2))
        p = jnp.exp(jnp.where(vis, z - m_new.transpose(0, 2, 3, 1)[..., None], neg))
        alpha = jnp.exp(m - m_new)
        total = alpha * total + jnp.sum(p, axis=-1).transpose(0, 3, 1, 2)
        out = alpha[..., None] * out + jnp.einsum("BKGts,BsKE->BtKGE", p, vv)
        return count + gates.transpose(0, 3, 1, 2), m_new, total, out

    def finish(carry, row):
        _, _, total, out = carry
        out = out / jnp.where(total > 0, total, 1.0)[..., None]
        return out.reshape(out.shape[0], out.shape[1], n, ev)

    out = reverse_scan.scan(
        step, init, finish, rows, cols, pos_seg, block_q=block_q, block_k=block_k
    )
    return out.astype(query.dtype)
