"""Tile math of the flash kernel: what one (query tile, key tile) pair computes.

Pure `jnp`/`lax` on values (no refs), called from inside the Pallas kernels
(`triton_*`, `mosaic_*`), so it must stay within what the Triton and
Mosaic lowerings accept: 2-D tiles, broadcasting, reductions along one axis,
`where`, `fori_loop` with scalar bounds. Relative-position columns are read
through callables (`column(c) -> [bq]`), which the kernels implement as
strided loads from a ref: no gather is ever needed.

Shapes: bq / bk the query / key tile lengths, H head dim, R = 2k + 1 Shaw
distances (Rp >= R once padded to a power of two for the GPU).

Tile classes are those of `jattn.attention.tiles` (SKIP / PARTIAL / FULL_LEFT /
FULL_RIGHT), decided per (query tile, key tile) by the block map
(`jattn.attention.pallas.blockmap`): PARTIAL tiles apply the visibility rule of
`jattn.masks.visible` per element; FULL tiles need no test and, with Shaw
terms, have one relative id (0 for FULL_LEFT, 2k for FULL_RIGHT).

Base-2 logits: every kernel works with `s2 = log2(e) * s` (the constant
folded into the scale, and into the Shaw key term and the bias where they
are added), so the online softmax and the backward's recomputation use
`exp2`, one multiply cheaper per element than `exp` (which the GPU computes
as `exp2(x * log2 e)` anyway), as jax's reference kernels do. The stored
log-sum-exp is in base 2 too (`m2 + log2(l)`); `flash_attention` converts
it to natural units for the caller. Weights, and so every gradient, are
unchanged: `exp2(s2 - lse2) = exp(s - lse)`.

Products of two tiles go through `tile_dot.dot` (float32 accumulation, the
kernels' float32 precision).

Dropout: `dropout_scale` rebuilds a tile's keep mask from the hash of
`jattn.dropout` with global indices (never stored), as multipliers
`0` / `1 / (1 - rate)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn import dropout, masks
from jattn.attention.pallas.tile_dot import dot
from jattn.attention.tiles import FULL_LEFT, FULL_RIGHT, PARTIAL, SKIP
from jattn.visibility import Visibility

Array = jax.Array

__all__ = [
    "EMPTY_LSE",
    "FULL_LEFT",
    "FULL_RIGHT",
    "LN2",
    "LOG2E",
    "NEG_INF",
    "PARTIAL",
    "SKIP",
    "ShawColumns",
]

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)  # natural logits -> base-2 logits
LN2 = math.log(2.0)  # base-2 log-sum-exp -> natural
# The log-sum-exp a kernel stores for a row with nothing visible: finite (a
# pallas_call output must pass `jax.debug_infs`) and so large that the
# backward's recomputation `exp(s - lse)` is exactly 0 for any logit s.
EMPTY_LSE = float(np.finfo(np.float32).max)


# Per-query vectors arrive as `[bq]` (Triton kernels) or as `[bq, 1]` columns
# (Mosaic kernels, which keep every value 2-D); per-key vectors as `[bk]` or
# `[1, bk]` rows. These lift either form to the 2-D one.
def as_col(x: Array) -> Array:
    """`[bq]` or `[bq, 1]` -> `[bq, 1]`."""
    return x if x.ndim == 2 else x[:, None]


def as_row(x: Array) -> Array:
    """`[bk]` or `[1, bk]` -> `[1, bk]`."""
    return x if x.ndim == 2 else x[None, :]


def rel_ids(q_pos: Array, kv_pos: Array, max_distance: int) -> Array:
    """`clip(kv - q, -k, k) + k` of a tile: int32 `[bq, bk]`."""
    d = as_row(kv_pos) - as_col(q_pos)  # [bq, bk]
    return jnp.clip(d, -max_distance, max_distance) + max_distance


def rel_range(q_pos: Array, kv_pos: Array, max_distance: int) -> tuple[Array, Array]:
    """Smallest and largest relative id present in a tile (scalars), from the
    extreme positions: the near-diagonal loops only visit ids in this range."""
    lo = jnp.min(kv_pos) - jnp.max(q_pos)
    hi = jnp.max(kv_pos) - jnp.min(q_pos)
    k = max_distance
    return jnp.clip(lo, -k, k) + k, jnp.clip(hi, -k, k) + k


def visibility(
    vis: Visibility,
    kv_valid: Array | None,
    mask: Array | None,
    col: Callable[[Array], Array] = as_col,
    row: Callable[[Array], Array] = as_row,
) -> Array | None:
    """Boolean `[bq, bk]` (or broadcastable) visibility of a tile; None = all.

    The rule is the call's `jattn.visibility.Visibility` itself (`rule`: the
    same `jattn.masks.visible`), on a query column and a key row, and-ed
    with the keys' validity (padding to the tile) and the user mask.

    Args:
      vis: the tile's value: positions `[bq]|[bq, 1]`, `[bk]|[1, bk]` (needed
        with causal or a window) and segment ids (or None), the call's rules.
      kv_valid: bool `[bk]|[1, bk]` (False for keys padded to the tile) or None.
      mask: bool `[bq|1, bk|1]` user mask tile or None.
      col, row: lift a query-side / key-side vector to the tile's axes
        (`as_col`, `as_row`; the transposed tile of the dk/dv kernel swaps them).
    """
    return masks.combine(vis.rule(col, row), None if kv_valid is None else row(kv_valid), mask)


def dropout_scale(
    seed, rate: float, batch, head, q_index: Array, kv_index: Array, transposed: bool = False
) -> Array:
    """Dropout multipliers of a tile: float32 `[bq, bk]` (`[bk, bq]` when
    `transposed`), `1 / (1 - rate)` where `jattn.dropout.keep` keeps the
    weight and 0 where it drops it.

    Args:
      seed: the two int32 seed words (a pair of scalars or an int32 `[2]`).
      rate: the static dropout rate.
      batch, head: int32 scalars, the batch row (0 with a broadcast mask)
        and the query head.
      q_index, kv_index: int32 global (unpadded) query / key indices of the
        tile, `[bq]|[bq, 1]` and `[bk]|[1, bk]` (1-D when `transposed`).
    """
    if transposed:  # the same hash on the transposed grid of indices
        q_index, kv_index = q_index[None, :], kv_index[:, None]
    keep = dropout.keep(seed, rate, batch, head, as_col(q_index), as_row(kv_index))
    return jnp.where(keep, dropout.multiplier(rate), 0.0).astype(jnp.float32)


def near_gather(
    rt: Array,
    lo: Array,
    hi: Array,
    columns: Sequence[Callable[[Array], Array]],
) -> tuple[Array, ...]:
    """`out_i[t, s] = column_i(rt[t, s])[t]` for every relative id in `[lo, hi]`.

    The Shaw key term (`column = qr[:, c]`) and, in the backward pass, the
    value term of `dP` (`column = dpr[:, c]`) of a near-diagonal tile, one
    distance at a time; never a `[bq, bk, H]` tensor.

    Args:
      rt: int `[bq, bk]` relative ids of the tile.
      lo, hi: int scalars, the id range present in `rt`.
      columns: callables `c -> [bq]` (or `[bq, 1]`) float32.

    Returns:
      One float32 `[bq, bk]` per column callable.
    """

    def body(c, outs):
        hit = rt == c  # [bq, bk]
        pairs = zip(columns, outs, strict=True)
        return tuple(jnp.where(hit, as_col(col(c)), o) for col, o in pairs)

    init = tuple(jnp.zeros(rt.shape, jnp.float32) for _ in columns)
    return lax.fori_loop(lo, hi + 1, body, init)


def near_scatter(rt: Array, lo: Array, hi: Array, w: Array, acc: Array) -> Array:
    """`acc[t, c] += Σ_s w[t, s] [rt[t, s] = c]` for ids c in `[lo, hi]`.

    Weight mass per relative distance (the Shaw value term, and in the
    backward pass the gradient of the key term), accumulated one distance at a
    time into a `[bq, Rp]` tile.

    Args:
      rt: int `[bq, bk]` relative ids.
      lo, hi: int scalars.
      w: float32 `[bq, bk]` weights (probabilities or dS).
      acc: float32 `[bq, Rp]`.
    """
    col_ids = lax.broadcasted_iota(jnp.int32, acc.shape, 1)  # [bq, Rp]

    def body(c, acc):
        mass = jnp.sum(jnp.where(rt == c, w, 0.0), axis=1, keepdims=True)  # [bq, 1]
        return acc + jnp.where(col_ids == c, mass, 0.0)

    return lax.fori_loop(lo, hi + 1, body, acc)


def add_far_columns(acc: Array, w_left: Array, w_right: Array, right_col: int) -> Array:
    """Add per-row masses of the constant-id tiles into columns 0 and 2k of a
    `[bq, Rp]` tile (`right_col` = 2k; with k = 0 both are column 0)."""
    col_ids = lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    acc = acc + jnp.where(col_ids == 0, as_col(w_left), 0.0)
    return acc + jnp.where(col_ids == right_col, as_col(w_right), 0.0)


def safe_max(m: Array) -> Array:
    """A row max usable as an exponent shift: 0 where the row has seen
    nothing visible yet (max = -inf), so `exp(s - m)` is 0, never NaN."""
    return jnp.where(m == NEG_INF, 0.0, m)


def recomputed_probs(s: Array, lse: Array) -> Array:
    """A backward tile's probabilities `exp2(s - lse)` from the forward's
    base-2 log-sum-exp (broadcast to the tile), never above 1.

    The backward recomputes the logits in other kernels than the forward's
    (other tile shapes and summation orders, and on a GPU at float32 the dq
    tiles' Triton TF32x3 against the forward's hand split), which agree to
    ~2^-22 of a logit. Past logits of ~2^22 (a key at 1e38 seen by a 1e-3
    query) that disagreement is itself a huge exponent: an unclamped P is
    ±Inf where the true weight is 1, and dS NaN. So the exponent is clamped
    at 0, where a softmax weight's is anyway (one `min` an entry; for
    ordinary logits it changes P by at most a float32 rounding)."""
    return jnp.exp2(jnp.minimum(s - lse, 0.0))


def score_grads(
    p: Array,
    d_out: Array,
    value: Array,
    d_mass: Array | None,
    keep: Array | None,
    delta: Array,
    precision: str = "ieee",
    transposed: bool = False,
    unscale: float = 1.0,
) -> Array:
    """Gradient of a tile's scaled scores, shared by the dq and dk/dv kernels:
    `ds = p ∘ ((dO Vᵀ + dpr) ∘ z − D)`. With `transposed` (the dk/dv
    kernel's layout), every tile is `[bk, bq]`, `delta` a `[1, bq]` row and
    `dPᵀ = V dOᵀ`, so the result is `dSᵀ`.

    Args:
      p: `[bq, bk]` probabilities recomputed from the lse (before dropout).
      d_out: `[bq, Hv]` output cotangent; value: `[bk, Hv]`.
      d_mass: `[bq, bk]` the Shaw value term's cotangent per entry, or None.
      keep: `[bq, bk]` dropout factor (0 or 1/(1 - rate)), or None.
      delta: `[bq, 1]` (or broadcastable) `rowsum(dO ∘ O)`.
      precision: of the float32 dot (`PRECISIONS`).
      unscale: what `value` was divided by (2 for the halved values of
        `config.halve_kv`): dO·vᵀ is multiplied back by it, exactly.
    """
    if transposed:
        dp = dot(value, d_out, (1, 1), precision)  # [bk, bq]
    else:
        dp = dot(d_out, value, (1, 1), precision)  # [bq, bk]
    if unscale != 1.0:
        dp = dp * unscale
    if d_mass is not None:
        dp = dp + d_mass
    if keep is not None:
        dp = dp * keep
    # A key of weight exactly 0 contributes exactly nothing: selected, not
    # multiplied, since dO·v of a hidden key may overflow (0 · Inf = NaN).
    return jnp.where(p > 0, p * (dp - delta), 0.0)  # [bq, bk]


def online_softmax_step(
    s: Array, m_prev: Array, l_prev: Array
) -> tuple[Array, Array, Array, Array, Array]:
    """One step of the online softmax over a `[bq, bk]` tile of base-2
    logits (`exp2` throughout).

    Invisible entries of `s` are -inf. The row statistics `m_prev`, `l_prev`
    are `[bq]` or `[bq, 1]`; every returned statistic has the same form.
    Returns `(p, m_new, l_new, corr, row_sum)`: unnormalised weights
    `exp(s - m_new)` (0 where invisible), the running max (stays -inf for
    rows with nothing visible so far), the running sum, the factor
    `exp(m_prev - m_new)` that rescales earlier accumulators (0 while
    `m_prev` is -inf) and this tile's `Σ_s p`.
    """
    keep = m_prev.ndim == 2
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=keep))  # [bq] | [bq, 1]
    shift = safe_max(m_new)
    corr = jnp.exp2(m_prev - shift)
    p = jnp.exp2(s - as_col(shift))  # [bq, bk]
    row_sum = jnp.sum(p, axis=1, keepdims=keep)
    return p, m_new, l_prev * corr + row_sum, corr, row_sum


class ShawColumns(NamedTuple):
    """A tile's Shaw terms as `tile_scores` reads them.

    Attributes:
      max_distance: the clip distance k (relative ids in `[0, 2k]`).
      qr_col, dpr_col: `c -> [bq]` readers of the Shaw key-term table and of
        the cotangent of the value-term masses (backward only), or None.
      far_id: the constant relative id of a FULL tile.
      qr_far, dpr_far: the columns at `far_id` when the caller already has
        them (hoisted out of the loop), else they are read with the readers.
      need_rel: return the relative ids of a PARTIAL tile even without
        columns to gather (the forward's value-term scatter needs them).
      num_rel: visit every id in `[0, num_rel)` instead of the tile's own
        range. Mosaic kernels use it: the range would be a vector-to-scalar
        reduction, and a near-diagonal tile spans min(bq + bk - 1, 2k + 1)
        ids anyway, so the static loop costs at most that many extra passes
        on tiles far from the diagonal.
    """

    max_distance: int = 0
    qr_col: Callable[[Array], Array] | None = None
    dpr_col: Callable[[Array], Array] | None = None
    far_id: Array | int = 0
    qr_far: Array | None = None
    dpr_far: Array | None = None
    need_rel: bool = False
    num_rel: int | None = None


def _additive(bias) -> tuple[Array, ...]:
    """The additive tiles of `tile_scores`' `bias` argument, Nones dropped."""
    if bias is None:
        return ()
    if isinstance(bias, tuple | list):
        return tuple(x for x in bias if x is not None)
    return (bias,)


def tile_scores(
    q: Array,
    k: Array,
    *,
    scale: float,
    vis: Visibility | None,
    kv_valid: Array | None = None,
    bias: Array | Sequence[Array | None] | None,
    mask: Array | None = None,
    shaw: ShawColumns,
    score_mod: Callable[[Array], Array] | None = None,
    precision: str = "ieee",
    transposed: bool = False,
) -> tuple[Array, Array | None, tuple[Array, Array, Array] | None, Array | None]:
    """Base-2 logits of one tile, float32 `[bq, bk]`, -inf where invisible.

    `logit = log2(e) * (scale * q·k + qr[t, r] + bias)` where
    `qr = scale * q @ key_tableᵀ` (precomputed per query, so one column per
    relative id) and `bias` the sum of the additive tiles (the bias, the row
    and column terms); `log2(e) * scale` is one constant. With a score mod,
    `logit = log2(e) * mod(scale * q·k + qr[t, r] + bias)`: the mod sees
    natural logits, as everywhere else.

    Args:
      q: `[bq, H]`; k: `[bk, H]` (input dtype; the dot accumulates in float32).
      vis: a PARTIAL tile's `jattn.visibility.Visibility` (its positions and
        segment ids as tile vectors, see `visibility`): per-element
        visibility and relative ids. None for a FULL tile: nothing masked,
        one relative id `shaw.far_id` for the whole tile.
      kv_valid, mask: a PARTIAL tile's key validity and user mask, or None
        (see `visibility`).
      bias: the tile's additive terms, one `[bq|1, bk|1]` tile or a sequence
        of them (None entries skipped): the bias, and the row term `[bq, 1]`
        and column term `[1, bk]` of `row_col_bias`, each read per tile.
      shaw: the Shaw terms' readers (`ShawColumns`; no readers without Shaw tables).
      score_mod: the tile's bound score mod (`score_mod_tiles.bind`), or None.
      precision: of the float32 `q·kᵀ` (`PRECISIONS`).
      transposed: compute the tile as `Sᵀ = k·qᵀ`, `[bk, bq]` (the dk/dv
        kernel's layout: its dots `Pᵀ·dO` and `dSᵀ·q` then need no
        transposed operand). The query-side vectors (positions, segments,
        the Shaw columns) are laid out as rows and the key-side ones as
        columns here; `bias` and `mask` must come transposed, and
        `score_mod` bound to the transposed positions. Every returned tile
        is transposed too.

    Returns:
      `(s, dpr_tile, rel, raw)`: logits; `dpr[t, r[t, s]]` as `[bq, bk]` or
      `[bq, 1]` (None without `dpr_col`); `(rt, lo, hi)` relative ids and
      their range for the scatter of a PARTIAL tile (None otherwise); the
      natural logits before the score mod, unmasked (None without one; the
      backward differentiates the mod there).
    """
    partial = vis is not None
    qr_col, dpr_col = shaw.qr_col, shaw.dpr_col
    unit = LOG2E if score_mod is None else 1.0  # base 2 now, or after the mod
    q_side, kv_side = as_col, as_row  # lift query-side / key-side vectors to the tile
    if transposed:  # query-side vectors as rows [1, bq], key-side as columns [bk, 1]
        s = dot(k, q, (1, 1), precision) * (scale * unit)  # [bk, bq]
        q_side = lambda x: x if x.ndim == 2 else x[None, :]  # noqa: E731
        kv_side = lambda x: x if x.ndim == 2 else x[:, None]  # noqa: E731
        as_q = lambda col: None if col is None else (lambda c: q_side(col(c)))  # noqa: E731
        qr_col, dpr_col = as_q(qr_col), as_q(dpr_col)
    else:
        s = dot(q, k, (1, 1), precision) * (scale * unit)  # [bq, bk]
    dpr_tile = rel = None
    cols = [c for c in (qr_col, dpr_col) if c is not None]
    if partial:
        if cols or shaw.need_rel:
            q_pos, kv_pos = q_side(vis.q_positions), kv_side(vis.kv_positions)
            rt = rel_ids(q_pos, kv_pos, shaw.max_distance)  # [bq, bk]
            if shaw.num_rel is None:
                lo, hi = rel_range(q_pos, kv_pos, shaw.max_distance)
            else:
                lo, hi = 0, shaw.num_rel - 1
            rel = (rt, lo, hi)
            gathered = list(near_gather(rt, lo, hi, cols)) if cols else []
            if qr_col is not None:
                s = s + unit * gathered.pop(0)
            if dpr_col is not None:
                dpr_tile = gathered.pop(0)
    else:
        far = shaw.far_id
        if qr_col is not None:
            s = s + unit * q_side(qr_col(far) if shaw.qr_far is None else shaw.qr_far)
        if dpr_col is not None:
            dpr_tile = q_side(dpr_col(far) if shaw.dpr_far is None else shaw.dpr_far)
    for term in _additive(bias):
        s = s + unit * term.astype(jnp.float32)
    raw = None
    if score_mod is not None:
        raw = s
        s = LOG2E * score_mod(s)
    if partial:
        visible = visibility(vis, kv_valid, mask, q_side, kv_side)
        if visible is not None:
            s = jnp.where(visible, s, NEG_INF)
    return s, dpr_tile, rel, raw
