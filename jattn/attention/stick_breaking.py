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
  carried across them), with a custom VJP that runs the same reverse scan
  (`_tiled_bwd`); memory linear in the length, forward and backward, and
  the backward keeps no tile of the forward.

The registered scheme `position="stick_breaking"` (`jattn.models.data_schemes.StickBreaking`)
calls it in each causal self-attention layer (docs/schemes.md, "The reverse scan").
"""

from __future__ import annotations

import functools
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
    q = query.astype(compute).reshape(b, t, k, g, -1)
    out = _tiled(q, key.astype(compute), value.astype(compute), pos_seg, scale, block_q, block_k)
    return out.reshape(b, t, n, -1).astype(query.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled(q, kk, vv, pos_seg, scale, block_q, block_k):
    """`[B,T,K,G,Hv]` from `q [B,T,K,G,H]`, keys and values in the compute dtype."""
    return _tiled_fwd(q, kk, vv, pos_seg, scale, block_q, block_k)[0]


def _tiled_fwd(q, kk, vv, pos_seg, scale, block_q, block_k):
    """The forward reverse scan; residuals: the inputs and the output."""
    shape, ev = q.shape[2:4], vv.shape[-1]

    def init(q):
        bt = q.shape[:2]
        return jnp.zeros((*bt, *shape), q.dtype), jnp.zeros((*bt, *shape, ev), q.dtype)

    def step(carry, q, col, vis):
        behind, out = carry  # [B,t,K,G], [B,t,K,G,E]
        kt, vt = col
        s = scale * jnp.einsum("BtKGH,BsKH->BKGts", q, kt)
        w, total = _weights(s, vis[:, None, None], behind.transpose(0, 2, 3, 1))
        out = out + jnp.einsum("BKGts,BsKE->BtKGE", w, vt)
        return behind + total.transpose(0, 3, 1, 2), out

    out = reverse_scan.scan(
        step, init, lambda c, q: c[1], q, (kk, vv), pos_seg, block_q=block_q, block_k=block_k
    )
    return out, (q, kk, vv, pos_seg, out)


def _tiled_bwd(scale, block_q, block_k, res, d_out):
    """The same reverse scan, recomputing each tile's weights. With `g_ij =
    w_ij (dO_i . v_j)`, the logit's gradient is `g_ij sigmoid(-s_ij) -
    sigmoid(s_ij) sum_{j' < j} g_ij'`, and the sum over the keys before `j`
    is `dO_i . out_i` (the sum over all of them) less the suffix sum the
    scan carries: the softmax backward's `D_i`, no second pass."""
    q, kk, vv, pos_seg, out = res
    d_out = d_out.astype(out.dtype)
    rows = (q, d_out, jnp.sum(d_out * out, axis=-1))  # D: [B,T,K,G]

    def init(row):
        zeros = jnp.zeros(row[2].shape, q.dtype)
        return zeros, zeros, jnp.zeros(row[0].shape, q.dtype)

    def step(carry, row, col, vis):
        behind, after, dq = carry  # softplus and g sums to the right [B,t,K,G]; [B,t,K,G,H]
        qt, dot, total_g = row
        kt, vt = col
        vis = vis[:, None, None]
        s = scale * jnp.einsum("BtKGH,BsKH->BKGts", qt, kt)
        w, total_sp = _weights(s, vis, behind.transpose(0, 2, 3, 1))
        g = w * jnp.einsum("BtKGE,BsKE->BKGts", dot, vt)
        suffix = jax.lax.cumsum(g, axis=4, reverse=True) + after.transpose(0, 2, 3, 1)[..., None]
        before = total_g.transpose(0, 2, 3, 1)[..., None] - suffix
        ds = jnp.where(vis, g * jax.nn.sigmoid(-s) - jax.nn.sigmoid(s) * before, 0.0)
        dq = dq + scale * jnp.einsum("BKGts,BsKH->BtKGH", ds, kt)
        dk = scale * jnp.einsum("BKGts,BtKGH->BsKH", ds, qt)
        dv = jnp.einsum("BKGts,BtKGE->BsKE", w, dot)
        carry = (
            behind + total_sp.transpose(0, 3, 1, 2),
            after + jnp.sum(g, axis=-1).transpose(0, 3, 1, 2),
        )
        return (*carry, dq), (dk, dv)

    def key_zeros(col):
        return jax.tree.map(jnp.zeros_like, col)

    dq, (dk, dv) = reverse_scan.scan_with_key_sums(
        step, init, lambda c, r: c[2], key_zeros, rows, (kk, vv), pos_seg,
        block_q=block_q, block_k=block_k,
    )  # fmt: skip
    return dq, dk, dv, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
