"""Backward pass of the chunked implementation (see `jattn.attention.chunked`).

Recomputes each tile's weights from the saved log-sum-exp, `p = exp(s - lse)`,
and its dropout factor `z` (keep / (1 - rate), never stored), and accumulates
in FlashAttention-2 order (key tiles outside; inside, only the query tiles
that can see the key tile, `TilePlan.cols`):

  dv_j += (p z)ᵀ do             dp = z ∘ (do vᵀ + do·value_rel[r])
  ds    = p (dp - D),  D = rowsum(do ∘ out)   (out with dropout and Shaw term)
  dq_i += scale ds k            dk_j += scale dsᵀ q
  dqr_i += scale Σ_s ds [r = R]  (Shaw key term; dq and d key_rel from it)
  dbias += ds, reduced to the bias's broadcast shape
  drow_i += Σ_s ds              dcol_j += Σ_t ds   (row and column terms)

With a score mod `s' = fn(params, s, ...)` the tile's `ds'` (of the modified
logits) is pulled back through `fn` on the tile (`jax.vjp`, recomputed, never
stored): `d params += vjp_params(ds')`, summed over tiles in the loop carry,
and `ds = vjp_s(ds')` feeds everything above.

The Shaw value table's gradient needs no loop: `d value_rel = Σ_t prᵀ do`
with `pr`, the normalised (dropped) weight mass per relative id, saved by the
forward. Memory: O(T + S) per head plus a `[T, 2k+1]` buffer for Shaw; never
`[T, S]`. Intermediates stay finite (`scores.NEG` sentinels, `lse` 0 on
empty rows), so `jax.debug_nans` / `jax.debug_infs` stay quiet.

Shapes: as in `jattn.attention.chunked_problem`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn.attention.chunked_problem import (
    BODIES,
    Residuals,
    TileBody,
    TiledProblem,
    dropout_factor,
    qr_tables,
    rel_mass,
    rel_pick,
    tile_logits,
    untile_kv,
    untile_q,
)

Array = jax.Array

__all__ = ["Gradients", "backward"]


class Gradients(NamedTuple):
    """Cotangents of the differentiable inputs (None where absent), in the
    inputs' shapes and dtypes (`score_mod`: the cotangent of the score mod's
    params, a pytree like them with None for integer leaves; `row_bias`,
    `col_bias`: of the row and column terms), and `trips`:
    int32 `[nk]`, the query tiles each key tile's loop visited."""

    query: Array
    key: Array
    value: Array
    bias: Array | None
    rel_key: Array | None
    rel_value: Array | None
    score_mod: object
    row_bias: Array | None
    col_bias: Array | None
    trips: Array


class _Cotangent(NamedTuple):
    """The output side of the backward in tile layout: `do [nq,B,K,G,t,Hv]`,
    `big_d = rowsum(do ∘ out) [nq,B,K,G,t,1]`, Shaw tables `qr`
    `[nq,B,K,G,t,R]` and `dor = do · value_relᵀ` `[nq,B,K,G,t,R]` (or None)."""

    do: Array
    big_d: Array
    qr: Array | None
    dor: Array | None


def _accumulator_dtype(x) -> jnp.dtype:
    return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _mod_cotangent_zeros(params):
    """Zero cotangents of a score mod's params (float0 for integer leaves, as `jax.vjp`)."""
    return jax.tree.map(
        lambda x: (
            jnp.zeros(jnp.shape(x), _accumulator_dtype(x))
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
            else np.zeros(jnp.shape(x), jax.dtypes.float0)
        ),
        params,
    )


def _mod_cotangent_sum(ct):
    """A tile's params cotangent as loop-carry leaves: float ones widened to
    at least float32 (summing many tiles in bf16 would lose the small ones),
    integer (float0) ones as a scalar 0 placeholder."""
    return jax.tree.map(
        lambda x: (
            jnp.zeros((), jnp.float32)
            if x.dtype == jax.dtypes.float0
            else x.astype(_accumulator_dtype(x))
        ),
        ct,
    )


def _mod_cotangent_finish(acc, params):
    """The summed cotangent in the params' dtypes (None for integer leaves)."""

    def finish(a, x):
        dtype = jnp.result_type(x)
        return a.astype(dtype) if jnp.issubdtype(dtype, jnp.inexact) else None

    return jax.tree.map(finish, acc, params)


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
    """Sum `x` over the axes where `shape` has 1 (broadcast reduction)."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 and n > 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _tile_grads(pb: TiledProblem, res: Residuals, ct: _Cotangent, i, j, body: TileBody, inner):
    """Gradient contributions of tile (i, j). Returns the updated key-tile
    accumulators `(dk_j [B,K,s,H], dv_j [B,K,s,Hv], dcol_j [B,K,G,1,s] or None)`
    and this tile's `(dq_i, dqr_i, dbias_ij, dmod_ij, drow_i)` (`dmod_ij`: the
    score mod params' cotangent from this tile, float32 leaves, or None;
    `drow_i` `[B,K,G,t,1]` or None); the caller adds those into the big buffers
    outside the branch, so no conditional carries (and copies) a `[T, ...]`
    buffer."""
    dt = pb.dtype  # float32, or float64 for float64 inputs
    scale = pb.nf.scale
    dk_j, dv_j, dcol_j = inner
    qi = pb.q[i].astype(dt)  # [B,K,G,t,H]
    kk = pb.k[j].astype(dt)  # [B,K,s,H]
    vv = pb.v[j].astype(dt)  # [B,K,s,Hv]
    do_i = ct.do[i]  # [B,K,G,t,Hv]
    qr_i = None if ct.qr is None else ct.qr[i]
    sv, r, pullback = tile_logits(pb, i, j, qi, qr_i, body, mod_vjp=True)
    # [B,K,G,t,s]; exactly 0 where sv = NEG. The exponent is clamped at 0, where a
    # softmax weight's is: a no-op where the forward's logits are these (the CPU), it
    # keeps P <= 1 where another program's matmul rounds them apart (a GPU's TF32 dots
    # under other shapes or algorithms; at logits of 1e8, 2^-24 apart is an exponent of 6).
    p = jnp.exp(jnp.minimum(sv - res.lse[i], 0.0))
    z = dropout_factor(pb, i, j)  # [B|1,K,G,t,s] or None
    pd = p if z is None else p * z
    dv_j = dv_j + jnp.einsum("BKGts,BKGtE->BKsE", pd, do_i)
    dp = jnp.einsum("BKGtE,BKsE->BKGts", do_i, vv)
    if ct.dor is not None:
        dp = dp + rel_pick(pb, i, j, ct.dor[i], r)
    if z is not None:
        dp = dp * z
    # Selected, not multiplied: a hidden key's dO·v may overflow (0 · Inf = NaN).
    ds = jnp.where(p > 0, p * (dp - ct.big_d[i]), 0.0)  # [B,K,G,t,s], after the score mod
    dmod_ij = None
    if pullback is not None:  # through the mod: to its params, and to the logits before it
        dmod_ij, ds = pullback(ds)
        dmod_ij = _mod_cotangent_sum(dmod_ij)
        ds = ds.astype(dt)
    dbias_ij = None if pb.bias is None else _reduce_to(ds, pb.tile_shape(pb.bias))
    drow_i = None
    if pb.row is not None:  # padded rows and columns have ds = 0 (p = 0 there)
        drow_i = jnp.sum(ds, axis=-1, keepdims=True)
        dcol_j = dcol_j + jnp.sum(ds, axis=-2, keepdims=True)
    dsl = ds * scale
    dq_i = jnp.einsum("BKGts,BKsH->BKGtH", dsl, kk)
    dk_j = dk_j + jnp.einsum("BKGts,BKGtH->BKsH", dsl, qi)
    dqr_i = None if pb.nf.rel_key is None else rel_mass(pb, i, j, dsl, r)
    return (dk_j, dv_j, dcol_j), (dq_i, dqr_i, dbias_ij, dmod_ij, drow_i)


def _key_tile(pb: TiledProblem, res: Residuals, ct: _Cotangent, carry, j):
    """Backward of key tile j over the query tiles its plan column bounds:
    returns the updated `(dq, dqr, dbias, dmod, drow)` buffers and
    `(dk_j, dv_j, dcol_j, trips)`."""
    dt = pb.dtype  # float32, or float64 for float64 inputs
    bodies = BODIES if pb.nf.shaw else BODIES[:3]

    def skip(inner):
        zeros = (
            jnp.zeros(pb.q.shape[1:], dt),
            None if carry[1] is None else jnp.zeros(carry[1].shape[1:], dt),
            None if pb.bias is None else jnp.zeros(pb.tile_shape(pb.bias), dt),
            None if carry[3] is None else jax.tree.map(jnp.zeros_like, carry[3]),
            None if carry[4] is None else jnp.zeros(carry[4].shape[1:], dt),
        )
        return inner, zeros

    def branch(body, i):
        if body is None:
            return skip
        return functools.partial(_tile_grads, pb, res, ct, i, j, body)

    def loop_body(i, state):
        inner, (dq, dqr, dbias, dmod, drow), trips = state
        fns = [branch(body, i) for body in bodies]
        inner, (dq_i, dqr_i, dbias_ij, dmod_ij, drow_i) = jax.lax.switch(
            pb.plan.branch[i, j], fns, inner
        )
        dq = dq.at[i].add(dq_i)
        if dqr is not None:
            dqr = dqr.at[i].add(dqr_i)
        if dbias is not None:
            cur = pb.slice_ts(dbias, i, j)
            dbias = jax.lax.dynamic_update_slice(dbias, cur + dbias_ij, pb.tile_start(dbias, i, j))
        if dmod is not None:
            dmod = jax.tree.map(jnp.add, dmod, dmod_ij)
        if drow is not None:
            drow = drow.at[i].add(drow_i)
        return inner, (dq, dqr, dbias, dmod, drow), trips + 1

    inner = (
        jnp.zeros((pb.b, pb.kh, pb.bk, pb.h), dt),
        jnp.zeros((pb.b, pb.kh, pb.bk, pb.hv), dt),
        None if pb.col is None else jnp.zeros(pb.col.shape[1:], dt),
    )
    lo, hi = pb.plan.cols[j, 0], pb.plan.cols[j, 1]
    (dk_j, dv_j, dcol_j), carry, trips = jax.lax.fori_loop(
        lo, hi, loop_body, (inner, carry, jnp.int32(0))
    )
    return carry, (dk_j, dv_j, dcol_j, trips)


def _cotangent(pb: TiledProblem, res: Residuals, dout: Array) -> _Cotangent:
    dt = pb.dtype  # float32, or float64 for float64 inputs
    do = pb.tile_q(dout.astype(dt))  # [nq,B,K,G,t,Hv], the layout of res.out
    big_d = jnp.sum(do * res.out, axis=-1, keepdims=True)  # [nq,B,K,G,t,1]
    dor = None
    if pb.nf.rel_value is not None:
        vtab = pb.nf.rel_value.astype(dt).reshape(pb.kh, pb.g, pb.num_rel, pb.hv)
        dor = jnp.einsum("nBKGtE,KGRE->nBKGtR", do, vtab)
    return _Cotangent(do, big_d, qr_tables(pb), dor)


def backward(res: Residuals, dout: Array, *, block_q: int, block_k: int) -> Gradients:
    """Cotangents of the chunked forward's differentiable inputs.

    Args:
      res: what the forward saved.
      dout: `[B, T, N, Hv]` output cotangent.
      block_q, block_k: the forward's tile sizes.
    """
    nf = res.nf
    pb = TiledProblem(nf, block_q, block_k)
    dt = pb.dtype  # float32, or float64 for float64 inputs
    ct = _cotangent(pb, res, dout)
    dq0 = jnp.zeros(pb.q.shape, dt)
    dqr0 = None if nf.rel_key is None else jnp.zeros(pb.q.shape[:-1] + (pb.num_rel,), dt)
    dbias0 = None if pb.bias is None else jnp.zeros(pb.bias.shape, dt)
    mod = nf.score_mod
    dmod0 = None if mod is None else _mod_cotangent_sum(_mod_cotangent_zeros(mod.params))
    drow0 = None if pb.row is None else jnp.zeros(pb.row.shape, dt)
    step = functools.partial(_key_tile, pb, res, ct)
    (dq, dqr, dbias, dmod, drow), (dk, dv, dcol, trips) = jax.lax.scan(
        step, (dq0, dqr0, dbias0, dmod0, drow0), jnp.arange(pb.nk, dtype=jnp.int32)
    )
    d_row = d_col = None
    if drow is not None:  # [nq,B,K,G,t,1] -> [B,N,T]; [nk,B,K,G,1,s] -> [B,N,S]
        d_row = jnp.moveaxis(drow[..., 0], 0, 3).reshape(pb.b, pb.n, pb.tp)[:, :, : pb.t]
        d_col = jnp.moveaxis(dcol[..., 0, :], 0, 3).reshape(pb.b, pb.n, pb.sp)[:, :, : pb.s]
        d_row = d_row.astype(nf.row_bias.dtype)
        d_col = d_col.astype(nf.col_bias.dtype)

    d_rel_key = d_rel_value = None
    if nf.rel_key is not None:
        ktab = nf.rel_key.astype(dt).reshape(pb.kh, pb.g, pb.num_rel, pb.h)
        dq = dq + jnp.einsum("nBKGtR,KGRH->nBKGtH", dqr, ktab)
        d_rel_key = jnp.einsum("nBKGtR,nBKGtH->KGRH", dqr, pb.q.astype(dt))
        d_rel_key = d_rel_key.reshape(nf.rel_key.shape).astype(nf.rel_key.dtype)
    if nf.rel_value is not None:
        d_rel_value = jnp.einsum("nBKGtR,nBKGtE->KGRE", res.pr, ct.do)
        d_rel_value = d_rel_value.reshape(nf.rel_value.shape).astype(nf.rel_value.dtype)
    d_bias = None
    if dbias is not None:
        t_keep = pb.t if dbias.shape[3] > 1 else 1
        s_keep = pb.s if dbias.shape[4] > 1 else 1
        d_bias = dbias[:, :, :, :t_keep, :s_keep].reshape(nf.bias.shape).astype(nf.bias.dtype)
    return Gradients(
        query=untile_q(dq, pb).astype(nf.query.dtype),
        key=untile_kv(dk, pb).astype(nf.key.dtype),
        value=untile_kv(dv, pb).astype(nf.value.dtype),
        bias=d_bias,
        rel_key=d_rel_key,
        rel_value=d_rel_value,
        score_mod=None if mod is None else _mod_cotangent_finish(dmod, mod.params),
        row_bias=d_row,
        col_bias=d_col,
        trips=trips,
    )
