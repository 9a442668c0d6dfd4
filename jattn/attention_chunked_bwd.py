"""Backward pass of the chunked implementation (see `attention_chunked`).

Recomputes each tile's weights from the saved log-sum-exp,
`p = exp(s - lse)`, and accumulates, in FlashAttention-2 order (key tiles
outside, query tiles inside):

  dv_j += pᵀ do                 dp = do vᵀ (+ do·value_rel[r])
  ds    = p (dp - D),  D = rowsum(do ∘ out)
  dq_i += scale ds k            dk_j += scale dsᵀ q
  dqr_i += scale Σ_s ds [r = R]  (Shaw key term; dq and d key_rel from it)
  dbias += ds, reduced to the bias's broadcast shape

The Shaw value table's gradient needs no loop: `d value_rel = Σ_t prᵀ do`
with `pr`, the normalised weight mass per relative id, saved by the forward.
Memory: O(T + S) per head plus a `[T, 2k+1]` buffer for Shaw; never `[T, S]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import scores

# attention_chunked imports this module lazily (inside its VJP rule), so this
# top-level import is not a cycle.
from jattn.attention_chunked import _Problem, _qr_tables, _untile_kv, _untile_q
from jattn.positions import relative_ids


def _reduce_to(x, shape):
    """Sum `x` over the axes where `shape` has 1 (broadcast reduction)."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 and n > 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _bias_tile_shape(pb):
    """Shape of one tile of the grouped bias: `[B|1, K|1, G|1, t|1, s|1]`."""
    sh = pb.bias.shape
    return sh[:3] + (pb.bq if sh[3] > 1 else 1, pb.bk if sh[4] > 1 else 1)


def backward(res, dout, *, is_causal, max_distance, scale, block_q, block_k, window):
    """Cotangents of `_chunked`'s inputs (None for the mask and the integer ids)."""
    (q, k, v, bias, mask, qpos, kvpos, qseg, kvseg, rel_key, rel_value, out_t, lse_t, pr_t) = res
    f32 = jnp.float32
    pb = _Problem(
        q,
        k,
        v,
        bias,
        mask,
        qpos,
        kvpos,
        qseg,
        kvseg,
        block_q=block_q,
        block_k=block_k,
        window=window,
    )
    relative = rel_key is not None or rel_value is not None
    num_rel = 2 * max_distance + 1

    # dout [B,T,N,V] -> [nq,B,K,G,t,V], the layout of out_t.
    b, t, n, hv = dout.shape
    do = pb.tile_q(dout.astype(f32))
    big_d = jnp.sum(do * out_t, axis=-1, keepdims=True)  # [nq,B,K,G,t,1]
    qr_all = _qr_tables(pb, rel_key, max_distance)  # [nq,B,K,G,t,R] or None
    dor_all = None
    if rel_value is not None:
        vtab = rel_value.astype(f32).reshape(pb.kh, pb.g, num_rel, hv)
        dor_all = jnp.einsum("nBKGtV,KGRV->nBKGtR", do, vtab)

    def tile(i, j, carry, c):
        """Gradient contributions of tile (i, j). Returns the updated key-tile
        accumulators and this tile's dq / dqr / dbias parts; the caller adds
        those into the big buffers outside the branch, so no conditional ever
        carries (and copies) a `[T, ...]` buffer."""
        dk_j, dv_j = carry
        const = c is not None
        qi = pb.q[i].astype(f32)  # [B,K,G,t,H]
        kk = pb.k[j].astype(f32)  # [B,K,s,H]
        vv = pb.v[j].astype(f32)  # [B,K,s,V]
        do_i = do[i]
        b_ij = None if pb.bias is None else pb.slice_ts(pb.bias, i, j)
        r = None
        if const:
            s = jnp.einsum("BKGtH,BKsH->BKGts", qi, kk)
            if qr_all is not None:
                s = s + jax.lax.dynamic_index_in_dim(qr_all[i], c, axis=-1, keepdims=True)
            s = s * scale
            if b_ij is not None:
                s = s + b_ij.astype(f32)
        else:
            r = relative_ids(pb.qpos[i], pb.kvpos[j], max_distance) if relative else None
            s = scores.tile_logits(
                qi, kk, scale=scale, bias=b_ij, qr=None if qr_all is None else qr_all[i], r=r
            )
        vis = pb.visibility(i, j, is_causal)
        p = jnp.exp(s - lse_t[i])  # [B,K,G,t,s]
        if vis is not None:
            p = jnp.where(vis, p, 0.0)
        dv_j = dv_j + jnp.einsum("BKGts,BKGtV->BKsV", p, do_i)
        dp = jnp.einsum("BKGtV,BKsV->BKGts", do_i, vv)
        if dor_all is not None:
            if const:
                dp = dp + jax.lax.dynamic_index_in_dim(dor_all[i], c, axis=-1, keepdims=True)
            else:
                dp = dp + scores.rel_gather(dor_all[i], r)
        ds = p * (dp - big_d[i])  # [B,K,G,t,s]
        dbias_ij = None if b_ij is None else _reduce_to(ds, b_ij.shape)
        dsl = ds * scale
        dq_i = jnp.einsum("BKGts,BKsH->BKGtH", dsl, kk)
        dk_j = dk_j + jnp.einsum("BKGts,BKGtH->BKsH", dsl, qi)
        dqr_i = None
        if rel_key is not None:
            if const:
                dqr_i = jax.nn.one_hot(c, num_rel, dtype=f32) * jnp.sum(dsl, -1, keepdims=True)
            else:
                dqr_i = scores.rel_scatter(dsl, r, num_rel)
        return (dk_j, dv_j), (dq_i, dqr_i, dbias_ij)

    def kv_block(carry, j):
        dq, dqr, dbias = carry

        def skip(inner):
            zeros = (
                jnp.zeros(pb.q.shape[1:], f32),
                None if dqr is None else jnp.zeros(dqr.shape[1:], f32),
                None if dbias is None else jnp.zeros(_bias_tile_shape(pb), f32),
            )
            return inner, zeros

        def body(i, state):
            inner, (dq, dqr, dbias) = state[:2], state[2:]
            mode, c = pb.mode(i, j, is_causal, max_distance, relative)
            branches = [skip, lambda cr: tile(i, j, cr, None)]
            if relative:
                branches.append(lambda cr: tile(i, j, cr, c))
            inner, (dq_i, dqr_i, dbias_ij) = jax.lax.switch(mode, branches, inner)
            dq = dq.at[i].add(dq_i)
            if dqr is not None:
                dqr = dqr.at[i].add(dqr_i)
            if dbias is not None:
                starts = (
                    0,
                    0,
                    0,
                    i * pb.bq if dbias.shape[3] > 1 else 0,
                    j * pb.bk if dbias.shape[4] > 1 else 0,
                )
                cur = pb.slice_ts(dbias, i, j)
                dbias = jax.lax.dynamic_update_slice(dbias, cur + dbias_ij, starts)
            return (*inner, dq, dqr, dbias)

        init = (
            jnp.zeros((b, pb.kh, pb.bk, pb.h), f32),
            jnp.zeros((b, pb.kh, pb.bk, hv), f32),
            dq,
            dqr,
            dbias,
        )
        dk_j, dv_j, dq, dqr, dbias = jax.lax.fori_loop(0, pb.nq, body, init)
        return (dq, dqr, dbias), (dk_j, dv_j)

    dq0 = jnp.zeros(pb.q.shape, f32)
    dqr0 = None if rel_key is None else jnp.zeros(pb.q.shape[:-1] + (num_rel,), f32)
    dbias0 = None if pb.bias is None else jnp.zeros(pb.bias.shape, f32)
    (dq, dqr, dbias), (dk, dv) = jax.lax.scan(kv_block, (dq0, dqr0, dbias0), jnp.arange(pb.nk))

    d_rel_key = d_rel_value = None
    if rel_key is not None:
        ktab = rel_key.astype(f32).reshape(pb.kh, pb.g, num_rel, pb.h)
        dq = dq + jnp.einsum("nBKGtR,KGRH->nBKGtH", dqr, ktab)
        d_rel_key = jnp.einsum("nBKGtR,nBKGtH->KGRH", dqr, pb.q.astype(f32))
        d_rel_key = d_rel_key.reshape(rel_key.shape).astype(rel_key.dtype)
    if rel_value is not None:
        d_rel_value = jnp.einsum("nBKGtR,nBKGtV->KGRV", pr_t, do)
        d_rel_value = d_rel_value.reshape(rel_value.shape).astype(rel_value.dtype)

    d_bias = None
    if dbias is not None:
        d_bias = dbias[
            :, :, :, : (t if dbias.shape[3] > 1 else 1), : (pb.s if dbias.shape[4] > 1 else 1)
        ]
        d_bias = d_bias.reshape(bias.shape).astype(bias.dtype)
    return (
        _untile_q(dq, pb).astype(q.dtype),
        _untile_kv(dk, pb).astype(k.dtype),
        _untile_kv(dv, pb).astype(v.dtype),
        d_bias,
        None,
        None,
        None,
        None,
        None,
        d_rel_key,
        d_rel_value,
    )
