"""The readable reference implementation: materialise the logits, softmax, mix.

Computes in float32 whatever the input dtype (bf16 inputs are upcast), which
makes it the baseline the tiled implementations are compared with, next to the
float64 oracle in the tests. Memory is O(B·N·T·S).

Shapes: the letters of `jattn.attention.legend` (N query heads split as K kv
heads x G per group; Hv, the value head dim, is `E` in einsum strings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import dropout
from jattn.attention import distance_table, scores
from jattn.attention.normal_form import EMPTY_ROW_LSE, NormalForm
from jattn.positions import relative_ids

Array = jax.Array


def _grouped_weights(nf: NormalForm, q: Array, kk: Array, poison: Array):
    """Unnormalised weights `[B,K,G,T,S]`, their row max and sums `[B,K,G,T,1]`
    and the relative ids `[B,T,S]` (or None). `q` is `[B,K,G,T,H]` and `kk`
    `[B,K,S,H]`, both in the compute dtype; `poison` `[B,K,S]` is NaN at keys
    with a non-finite entry (`scores.finite_keys`)."""
    _, k, g, _, h = q.shape
    num_rel = 2 * nf.max_distance + 1
    vis = nf.visibility
    r = qr = None
    if nf.shaw:
        r = relative_ids(vis.q_positions, vis.kv_positions, nf.max_distance)  # [B,T,S]
    if nf.rel_key is not None:
        tab = nf.rel_key.astype(q.dtype).reshape(k, g, num_rel, h)
        qr = jnp.einsum("BKGTH,KGRH->BKGTR", q, tab)  # [B,K,G,T,R]
    grouped_bias = None if nf.bias is None else scores.group_heads(nf.bias, k)
    logits = scores.tile_logits(q, kk, scale=nf.scale, bias=grouped_bias, qr=qr, r=r)
    if nf.row_bias is not None:  # a[i] + c[j], broadcast: only the logits are [T, S]
        b, t, s = nf.row_bias.shape[0], nf.row_bias.shape[2], nf.col_bias.shape[2]
        row = nf.row_bias.astype(logits.dtype).reshape(b, k, g, t, 1)
        logits = logits + row + nf.col_bias.astype(logits.dtype).reshape(b, k, g, 1, s)
    if nf.score_mod is not None:
        apply = scores.apply_grouped_score_mod
        if distance_table.is_arange(nf.score_mod):  # the table is the whole problem's window
            apply = distance_table.tile_applier(0, 0)
        logits = apply(
            nf.score_mod,
            logits,
            jnp.arange(nf.query.shape[0]),
            0,
            vis.q_positions,
            vis.kv_positions,
        )
    logits = logits.astype(q.dtype) + poison[:, :, None, None, :].astype(q.dtype)  # [B,K,G,T,S]
    visible = scores.visibility(
        vis, kv_valid=None, mask=None if nf.mask is None else scores.group_heads(nf.mask, k)
    )
    m, p = scores.masked_softmax_parts(logits, visible)  # [B,K,G,T,1], [B,K,G,T,S]
    return p, m, jnp.sum(p, axis=-1, keepdims=True), r


def _grouped_inputs(nf: NormalForm):
    """`q [B,K,G,T,H]`, keys `[B,K,S,H]` and values `[B,K,S,Hv]` in the
    compute dtype, non-finite entries zeroed, the keys' `poison [B,K,S]`
    (see `scores.finite_keys`) and the compute dtype."""
    b, t, n, h = nf.query.shape
    k = nf.key.shape[2]
    compute = jnp.promote_types(nf.query.dtype, jnp.float32)
    q = nf.query.astype(compute).reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    kk = nf.key.astype(compute).transpose(0, 2, 1, 3)  # [B,K,S,H]
    vv = nf.value.astype(compute).transpose(0, 2, 1, 3)  # [B,K,S,Hv]
    kk, vv, poison = scores.finite_keys(kk, vv, nf.assume_finite)
    return q, kk, vv, poison, compute


def dropout_keep(nf: NormalForm, k: int, g: int, t: int, s: int) -> Array:
    """The keep mask `[B|1, K, G, T, S]` of the whole problem (grouped heads)."""
    b = 1 if nf.dropout_broadcast_batch else nf.query.shape[0]
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None, None]
    head = jnp.arange(k * g, dtype=jnp.int32).reshape(1, k, g, 1, 1)
    ti = jnp.arange(t, dtype=jnp.int32)[None, None, None, :, None]
    si = jnp.arange(s, dtype=jnp.int32)[None, None, None, None, :]
    return dropout.keep(nf.dropout_seed, nf.dropout_rate, bi, head, ti, si)


def attention_xla(nf: NormalForm) -> tuple[Array, Array]:
    """Attention over the whole `[T, S]` problem at once.

    A distance-table score mod (`jattn.ScoreMod.from_distance`) is read from
    its table, evaluated once per call (`jattn.attention.distance_table`).

    Returns:
      `out [B, T, N, Hv]` in the dtype of `query` and `lse [B, T, N]` float32
      (`EMPTY_ROW_LSE` for a row with nothing visible).
    """
    t, s = nf.query.shape[1], nf.key.shape[1]
    return distance_table.with_table(nf, _attention_xla, t, s)


def _attention_xla(nf: NormalForm) -> tuple[Array, Array]:
    b, t, n, _ = nf.query.shape
    _, s, k, hv = nf.value.shape
    g = n // k
    q, kk, vv, poison, compute = _grouped_inputs(nf)
    p, m, denom, r = _grouped_weights(nf, q, kk, poison)
    safe = jnp.where(denom == 0, 1.0, denom)
    lse = jnp.where(denom == 0, EMPTY_ROW_LSE, m + jnp.log(safe))[..., 0]  # [B,K,G,T]
    if nf.dropout:
        keep = dropout_keep(nf, k, g, t, s)
        p = jnp.where(keep, p * dropout.multiplier(nf.dropout_rate), 0.0)
    out = jnp.einsum("BKGTS,BKSE->BKGTE", p, vv)  # [B,K,G,T,Hv]
    if nf.rel_value is not None:
        num_rel = 2 * nf.max_distance + 1
        pr = scores.rel_scatter(p, r, num_rel)  # [B,K,G,T,R]
        vtab = nf.rel_value.astype(compute).reshape(k, g, num_rel, hv)
        out = out + jnp.einsum("BKGTR,KGRE->BKGTE", pr, vtab)
    out = out / safe
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv).astype(nf.query.dtype)
    lse = lse.transpose(0, 3, 1, 2).reshape(b, t, n).astype(jnp.float32)
    return out, lse


def attention_weights_xla(nf: NormalForm) -> Array:
    """The softmax weights `[B, N, T, S]` (float32, before dropout) the xla
    path mixes values with; rows with no visible key are all zeros."""
    b, t, n, _ = nf.query.shape
    q, kk, _, poison, _ = _grouped_inputs(nf)
    p, _, denom, _ = _grouped_weights(nf, q, kk, poison)
    p = p / jnp.where(denom == 0, 1.0, denom)  # [B,K,G,T,S]
    return p.reshape(b, n, t, p.shape[-1])
