"""The tiled problem of the chunked implementation, shared by its forward
(`jattn.attention.chunked`) and its backward (`jattn.attention.chunked_backward`).

Both passes see the same things: padded, tiled views of the normal form's
arrays (`TiledProblem`), one plan of which (query tile, key tile) pairs to
compute and how (`TilePlan`, built with `jattn.attention.tiles.classify`), the logits of
one tile (`tile_logits`) and the dropout factor of one tile
(`dropout_factor`, recomputed in the backward, never stored). Each pass then
loops, per query tile (forward) or per key tile (backward), only over the
tiles `TilePlan.rows` / `TilePlan.cols` bound: for a sliding window of width
w that is O(L·w) work, not O(L²).

Shapes: the letters of `jattn.attention.legend` (t / s tile lengths, nq / nk
tile counts; Hv, the value head dim, is `E` in einsum strings).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jattn import dropout
from jattn.attention import distance_table, scores, tiles
from jattn.attention.normal_form import NormalForm
from jattn.attention.tiles import pad_axis
from jattn.positions import relative_ids

Array = jax.Array

__all__ = [
    "BODIES",
    "Residuals",
    "TileBody",
    "TilePlan",
    "TiledProblem",
    "dropout_factor",
    "plan_tiles",
    "qr_tables",
    "rel_mass",
    "rel_pick",
    "split_tiles",
    "tile_logits",
    "untile_kv",
    "untile_q",
]


def split_tiles(x: Array, axis: int, n: int, size: int) -> Array:
    """Split `axis` (length `n * size`) into `n` tiles of `size`; the tile
    index becomes the leading axis."""
    shape = x.shape[:axis] + (n, size) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


# --- the plan ------------------------------------------------------------------


class TileBody(NamedTuple):
    """How a computed tile is evaluated (static: one traced branch each).

    Attributes:
      full: every element visible; no per-element visibility test.
      const_rel: every Shaw relative id of the tile is `TilePlan.rel_id`
        (0 or 2k), so the key term is one broadcast column and the value
        term one row sum; no per-element relative ids.
    """

    full: bool
    const_rel: bool


# Branch `TilePlan.branch` selects, in order: SKIP (None), PARTIAL,
# FULL_LEFT / FULL_RIGHT, and PARTIAL with the documented `const_rel` flag
# (visibility per element, one constant relative id; Shaw terms only).
BODIES = (None, TileBody(False, False), TileBody(True, True), TileBody(False, True))


class TilePlan(NamedTuple):
    """What to compute, for all batch rows and heads at once.

    Attributes:
      cls: int32 `[nq, nk]`, `jattn.attention.tiles` classes: SKIP where every batch row
        and head is SKIP, FULL_LEFT / FULL_RIGHT where all are (with Shaw
        terms the relative ids are then all 0 / all 2k), PARTIAL otherwise.
      const_rel: bool `[nq, nk]`: a PARTIAL tile whose relative ids are all
        `rel_id` (far from the diagonal, but e.g. a segment border inside).
      rel_id: int32 `[nq, nk]`: the constant relative id of FULL_* tiles and
        of `const_rel` tiles.
      branch: int32 `[nq, nk]`: index into `BODIES`.
      rows: int32 `[nq, 2]`: key tiles `[lo, hi)` query tile i visits.
      cols: int32 `[nk, 2]`: query tiles `[lo, hi)` key tile j visits.
    """

    cls: Array
    const_rel: Array
    rel_id: Array
    branch: Array
    rows: Array
    cols: Array


def _mask_any_all(mask: Array, bq: int, bk: int, tp: int, sp: int) -> tuple[Array, Array]:
    """Per-tile any / all of a bool mask `[B|1, N|1, T|1, S|1]` over its real
    entries: `[B|1, N|1, nq|1, nk|1]` each."""

    def reduce(fill: bool, op) -> Array:
        m = mask
        b, n, t, s = m.shape
        if t > 1:
            m = jnp.pad(m, ((0, 0), (0, 0), (0, tp - t), (0, 0)), constant_values=fill)
        if s > 1:
            m = jnp.pad(m, ((0, 0), (0, 0), (0, 0), (0, sp - s)), constant_values=fill)
        nt, tq = (tp // bq, bq) if t > 1 else (1, 1)
        ns, tk = (sp // bk, bk) if s > 1 else (1, 1)
        return op(m.reshape(b, n, nt, tq, ns, tk), axis=(3, 5))

    return reduce(False, jnp.any), reduce(True, jnp.all)


def plan_tiles(nf: NormalForm, bq: int, bk: int) -> TilePlan:
    """The `TilePlan` of a normal form tiled by `bq x bk` (O(nq·nk) work from
    per-tile min/max of positions and ids; never a `[T, S]` array)."""
    b, t = nf.query.shape[:2]
    s = nf.key.shape[1]
    nq, nk = math.ceil(t / bq), math.ceil(s / bk)
    tp, sp = nq * bq, nk * bk

    def summary(x, block, padded):
        return None if x is None else tiles.tile_min_max(x, block, padded)

    v = nf.visibility
    qp, kp = summary(v.q_positions, bq, tp), summary(v.kv_positions, bk, sp)
    vis = tiles.classify(
        (b, nq, nk),
        q_pos=qp,
        kv_pos=kp,
        q_seg=summary(v.q_segment_ids, bq, tp),
        kv_seg=summary(v.kv_segment_ids, bk, sp),
        mask_any_all=None if nf.mask is None else _mask_any_all(nf.mask, bq, bk, tp, sp),
        is_causal=v.is_causal,
        window=v.local_window_size,
        kv_ragged=sp > s,
    )  # [B, N|1, nq, nk]: SKIP, PARTIAL or FULL_LEFT (no Shaw distinction)
    skip = jnp.all(vis == tiles.SKIP, axis=(0, 1))  # [nq, nk]
    full = jnp.all(vis == tiles.FULL_LEFT, axis=(0, 1))
    cls = jnp.where(skip, tiles.SKIP, jnp.where(full, tiles.FULL_LEFT, tiles.PARTIAL))
    const_rel = jnp.zeros((nq, nk), bool)
    rel_id = jnp.zeros((nq, nk), jnp.int32)
    if nf.shaw:
        k = nf.max_distance
        rel = tiles.classify((b, nq, nk), q_pos=qp, kv_pos=kp, max_distance=k)
        left = jnp.all(rel == tiles.FULL_LEFT, axis=(0, 1))
        right = jnp.all(rel == tiles.FULL_RIGHT, axis=(0, 1))
        rel_id = jnp.where(right, 2 * k, 0).astype(jnp.int32)
        dense = jnp.where(right, tiles.FULL_RIGHT, tiles.FULL_LEFT)
        cls = jnp.where(full & ~(left | right), tiles.PARTIAL, jnp.where(full, dense, cls))
        const_rel = (cls == tiles.PARTIAL) & (left | right)
    cls = cls.astype(jnp.int32)
    branch = jnp.where(
        cls == tiles.SKIP, 0, jnp.where(cls >= tiles.FULL_LEFT, 2, jnp.where(const_rel, 3, 1))
    ).astype(jnp.int32)
    rows = tiles.run_bounds(cls)[:, jnp.array([0, 3])]  # [nq, 2]
    cols = tiles.run_bounds(cls.T)[:, jnp.array([0, 3])]  # [nk, 2]
    return TilePlan(cls, const_rel, rel_id, branch, rows, cols)


# --- the tiled problem ---------------------------------------------------------------


class TiledProblem:
    """Padded, tiled views of a normal form and its `TilePlan`.

    Attributes (beyond the sizes b, t, s, n, kh, g, h, hv, bq, bk, nq, nk,
    tp, sp and `num_rel` = R):
      nf: the normal form.
      q: `[nq, B, K, G, t, H]`; k: `[nk, B, K, s, H]`; v: `[nk, B, K, s, Hv]`
        (input dtypes; non-finite entries zeroed, see `scores.finite_keys`).
      poison: float32 `[nk, B, K, s, 1]`, NaN at keys that had a non-finite
        entry (added to their logits before the visibility rule), else 0.
      qpos, qseg: int32 `[nq, B, t]`; kvpos, kvseg: int32 `[nk, B, s]`
        (padding repeats the last entry, so relative ids stay in range).
      kv_valid: bool `[nk, 1, s]` (False on padded keys) or None.
      bias, mask: grouped `[B|1, K|1, G|1, Tp|1, Sp|1]` or None.
      row: `[nq, B, K, G, t, 1]` and col: `[nk, B, K, G, 1, s]`, the row and
        column terms (`nf.row_bias`, `nf.col_bias`, zero-padded) in the
        compute dtype, or None.
      plan: the `TilePlan`.
    """

    def __init__(self, nf: NormalForm, block_q: int, block_k: int):
        self.nf = nf
        b, t, n, h = nf.query.shape
        _, s, kh, hv = nf.value.shape
        self.b, self.t, self.s, self.n, self.kh, self.h, self.hv = b, t, s, n, kh, h, hv
        self.g = n // kh
        self.num_rel = 2 * nf.max_distance + 1
        # float32 for float32 / bf16 / f16 inputs, float64 for float64 ones.
        self.dtype = jnp.promote_types(nf.query.dtype, jnp.float32)
        self.bq, self.bk = min(block_q, t), min(block_k, s)
        self.nq, self.nk = math.ceil(t / self.bq), math.ceil(s / self.bk)
        self.tp, self.sp = self.nq * self.bq, self.nk * self.bk
        self.q = self.tile_q(nf.query)
        key, value, poison = scores.finite_keys(nf.key, nf.value, nf.assume_finite)  # [B, S, K]
        self.k = self._tile_kv(key)
        self.v = self._tile_kv(value)
        self.poison = self._tile_kv(poison[..., None])
        vis = nf.visibility
        self.qpos = split_tiles(pad_axis(vis.q_positions, 1, self.tp, "edge"), 1, self.nq, self.bq)
        self.kvpos = split_tiles(
            pad_axis(vis.kv_positions, 1, self.sp, "edge"), 1, self.nk, self.bk
        )
        self.qseg = self.kvseg = None
        if vis.segments:
            qseg = pad_axis(vis.q_segment_ids, 1, self.tp, "edge")
            kvseg = pad_axis(vis.kv_segment_ids, 1, self.sp, "edge")
            self.qseg = split_tiles(qseg, 1, self.nq, self.bq)
            self.kvseg = split_tiles(kvseg, 1, self.nk, self.bk)
        self.kv_valid = None
        if self.sp != s:
            valid = (jnp.arange(self.sp) < s)[None]  # [1, Sp]
            self.kv_valid = split_tiles(valid, 1, self.nk, self.bk)
        self.bias = None if nf.bias is None else self._pad_ts(scores.group_heads(nf.bias, kh))
        self.mask = None if nf.mask is None else self._pad_ts(scores.group_heads(nf.mask, kh))
        self.row = self.col = None
        if nf.row_bias is not None:
            shape = (b, kh, self.g)
            row = pad_axis(nf.row_bias.astype(self.dtype), 2, self.tp).reshape(shape + (self.tp,))
            col = pad_axis(nf.col_bias.astype(self.dtype), 2, self.sp).reshape(shape + (self.sp,))
            self.row = split_tiles(row[..., None], 3, self.nq, self.bq)  # [nq,B,K,G,t,1]
            self.col = split_tiles(col[..., None, :], 4, self.nk, self.bk)  # [nk,B,K,G,1,s]
        self.plan = plan_tiles(nf, self.bq, self.bk)

    def tile_q(self, x: Array) -> Array:
        """A query-shaped `[B, T, N, X]` array as `[nq, B, K, G, t, X]` tiles
        (queries and, in the backward pass, output cotangents)."""
        b, _, _, d = x.shape
        xg = pad_axis(x, 1, self.tp).reshape(b, self.tp, self.kh, self.g, d)
        return split_tiles(xg.transpose(0, 2, 3, 1, 4), 3, self.nq, self.bq)

    def _tile_kv(self, x: Array) -> Array:
        """`[B, S, K, X]` as `[nk, B, K, s, X]` tiles."""
        return split_tiles(pad_axis(x, 1, self.sp).transpose(0, 2, 1, 3), 2, self.nk, self.bk)

    def _pad_ts(self, x: Array) -> Array:
        if x.shape[3] > 1:
            x = pad_axis(x, 3, self.tp)
        if x.shape[4] > 1:
            x = pad_axis(x, 4, self.sp)
        return x

    def tile_shape(self, x: Array) -> tuple[int, ...]:
        """Shape of one tile of a grouped `[B|1, K|1, G|1, Tp|1, Sp|1]` array."""
        sh = x.shape
        return sh[:3] + (self.bq if sh[3] > 1 else 1, self.bk if sh[4] > 1 else 1)

    def tile_start(self, x: Array, i, j) -> tuple:
        """Start indices of tile (i, j) in a grouped `[B|1, K|1, G|1, Tp|1, Sp|1]` array."""
        zero = jnp.int32(0)
        return (
            zero,
            zero,
            zero,
            jnp.int32(i * self.bq) if x.shape[3] > 1 else zero,
            jnp.int32(j * self.bk) if x.shape[4] > 1 else zero,
        )

    def slice_ts(self, x: Array, i, j) -> Array:
        """Tile (i, j) of a grouped `[B|1, K|1, G|1, Tp|1, Sp|1]` array."""
        return jax.lax.dynamic_slice(x, self.tile_start(x, i, j), self.tile_shape(x))

    def visibility(self, i, j) -> Array | None:
        """Per-element visibility of tile (i, j), bool broadcastable to
        `[B, K, G, t, s]` (the normal form's `Visibility` cut to the tile, and
        the user mask), or None."""
        tile = self.nf.visibility.replace(
            q_positions=self.qpos[i],
            kv_positions=self.kvpos[j],
            q_segment_ids=None if self.qseg is None else self.qseg[i],
            kv_segment_ids=None if self.kvseg is None else self.kvseg[j],
        )
        return scores.visibility(
            tile,
            kv_valid=None if self.kv_valid is None else self.kv_valid[j],
            mask=None if self.mask is None else self.slice_ts(self.mask, i, j),
        )


# --- one tile --------------------------------------------------------------------------


def qr_tables(pb: TiledProblem) -> Array | None:
    """The Shaw key term table `q · key_relᵀ`, `[nq, B, K, G, t, R]` (compute dtype),
    or None without a Shaw key table."""
    rel_key = pb.nf.rel_key
    if rel_key is None:
        return None
    tab = rel_key.astype(pb.dtype).reshape(pb.kh, pb.g, pb.num_rel, pb.h)
    return jnp.einsum("nBKGtH,KGRH->nBKGtR", pb.q.astype(pb.dtype), tab)


def tile_logits(
    pb: TiledProblem, i, j, q: Array, qr: Array | None, body: TileBody, *, mod_vjp: bool = False
):
    """Masked logits `[B, K, G, t, s]` of tile (i, j) in the compute dtype
    `pb.dtype` (float32, or float64 for float64 inputs).

    Args:
      pb: the tiled problem.
      i, j: query and key tile indices (traced).
      q: `[B, K, G, t, H]` query tile in `pb.dtype`.
      qr: `[B, K, G, t, R]` Shaw key term table of the query tile, or None.
      body: how to evaluate the tile (see `TileBody`).
      mod_vjp: also return the score mod's pullback (the backward pass).

    Returns:
      `(sv, r)`: logits with invisible entries at the finite sentinel
      `scores.NEG` (never -inf), and the int32 `[B, t, s]` relative ids (None
      without Shaw terms or when they are constant, `pb.plan.rel_id[i, j]`).
      With `mod_vjp`, `(sv, r, pullback)`: `pullback(ds)` maps the cotangent
      of the modified logits to `(d params, d logits before the mod)`, or is
      None without a score mod.
    """
    nf = pb.nf
    kk = pb.k[j].astype(pb.dtype)  # [B,K,s,H]
    bias = None if pb.bias is None else pb.slice_ts(pb.bias, i, j)
    r = None
    if nf.shaw and not body.const_rel:
        r = relative_ids(pb.qpos[i], pb.kvpos[j], nf.max_distance)  # [B,t,s]
        s = scores.tile_logits(q, kk, scale=nf.scale, bias=bias, qr=qr, r=r)
    else:
        s = scores.tile_logits(q, kk, scale=nf.scale, bias=bias)
    s = s.astype(pb.dtype)
    if pb.row is not None:  # the row and column terms, with the bias (before the mod)
        s = s + pb.row[i] + pb.col[j]
    if r is None and qr is not None:  # the constant relative id's key term: one column
        c = pb.plan.rel_id[i, j]
        s = s + nf.scale * jax.lax.dynamic_index_in_dim(qr, c, axis=-1, keepdims=True)
    pullback = None
    if nf.score_mod is not None:
        # The mod changes values, not visibility: it runs on every computed
        # tile (FULL ones too) and the plan is the same as without it.
        batch = jnp.arange(pb.b, dtype=jnp.int32)
        where = (batch, 0, pb.qpos[i], pb.kvpos[j])
        apply = scores.apply_grouped_score_mod
        if distance_table.is_arange(nf.score_mod):  # a window of the table, no gather
            apply = distance_table.tile_applier(i * pb.bq, j * pb.bk)
        if mod_vjp:
            s, pullback = scores.grouped_score_mod_vjp(nf.score_mod, s, *where, apply=apply)
        else:
            s = apply(nf.score_mod, s, *where)
        s = s.astype(pb.dtype)
    # NaN at keys that are not finite, then selected away where invisible.
    s = s + pb.poison[j][:, :, None, None, :, 0].astype(s.dtype)
    if not body.full:
        vis = pb.visibility(i, j)
        if vis is not None:
            s = jnp.where(vis, s, jnp.asarray(scores.NEG, s.dtype))
    if mod_vjp:
        return s, r, pullback
    return s, r


def rel_mass(pb: TiledProblem, i, j, p: Array, r: Array | None) -> Array:
    """Weight mass per relative id of a tile: `[B, K, G, t, R]` from `p
    [B, K, G, t, s]` (a row sum into one id when the ids are constant)."""
    if r is not None:
        return scores.rel_scatter(p, r, pb.num_rel)
    ids = jnp.arange(pb.num_rel, dtype=jnp.int32).reshape(1, 1, 1, 1, pb.num_rel)
    one_hot = (ids == pb.plan.rel_id[i, j]).astype(p.dtype)
    return one_hot * jnp.sum(p, axis=-1, keepdims=True)


def rel_pick(pb: TiledProblem, i, j, table: Array, r: Array | None) -> Array:
    """`table[..., t, r[t, s]]` for a `[B, K, G, t, R]` table: `[B, K, G, t, s]`
    (one broadcast column when the tile's ids are constant)."""
    if r is not None:
        return scores.rel_gather(table, r)
    return jax.lax.dynamic_index_in_dim(table, pb.plan.rel_id[i, j], axis=-1, keepdims=True)


def dropout_factor(pb: TiledProblem, i, j) -> Array | None:
    """Dropout factor of tile (i, j): `keep * 1/(1-rate)` in `pb.dtype`,
    `[B|1, K, G, t, s]` (`jattn.dropout.keep` on the unpadded global indices
    b, n = kv_head*G + g, t, s), or None without dropout."""
    nf = pb.nf
    if not nf.dropout:
        return None
    nb = 1 if nf.dropout_broadcast_batch else pb.b
    bi = jnp.arange(nb, dtype=jnp.int32).reshape(nb, 1, 1, 1, 1)
    head = jnp.arange(pb.kh * pb.g, dtype=jnp.int32).reshape(1, pb.kh, pb.g, 1, 1)
    ti = (i * pb.bq + jnp.arange(pb.bq, dtype=jnp.int32)).reshape(1, 1, 1, pb.bq, 1)
    si = (j * pb.bk + jnp.arange(pb.bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, pb.bk)
    keep = dropout.keep(nf.dropout_seed, nf.dropout_rate, bi, head, ti, si)
    mult = jnp.asarray(dropout.multiplier(nf.dropout_rate), pb.dtype)
    return jnp.where(keep, mult, jnp.zeros((), pb.dtype))


# --- leaving the tiles ------------------------------------------------------------------


def untile_q(x: Array, pb: TiledProblem) -> Array:
    """`[nq, B, K, G, t, X] -> [B, T, N, X]` (drops padding)."""
    nq, b, kh, g, t, d = x.shape
    x = jnp.moveaxis(x, 0, 3).reshape(b, kh, g, nq * t, d)[:, :, :, : pb.t]
    return x.transpose(0, 3, 1, 2, 4).reshape(b, pb.t, kh * g, d)


def untile_kv(x: Array, pb: TiledProblem) -> Array:
    """`[nk, B, K, s, X] -> [B, S, K, X]` (drops padding)."""
    nk, b, kh, s, d = x.shape
    x = jnp.moveaxis(x, 0, 2).reshape(b, kh, nk * s, d)[:, :, : pb.s]
    return x.transpose(0, 2, 1, 3)


class Residuals(NamedTuple):
    """What the forward pass saves for the backward pass (arrays in the
    compute dtype, float32 or float64).

    Attributes:
      nf: the normal form (inputs; the dropout seed rides along as a leaf).
      out: `[nq, B, K, G, t, Hv]` normalised output (dropout and the
        Shaw value term included).
      lse: `[nq, B, K, G, t, 1]` log-sum-exp (0 for a row with
        nothing visible, so `exp(NEG - lse)` stays exactly 0).
      pr: `[nq, B, K, G, t, R]` normalised (dropped) weight mass per
        relative id, or None without a Shaw value table.
    """

    nf: NormalForm
    out: Array
    lse: Array
    pr: Array | None
