"""The Triton forward kernel of flash attention, and the helpers every Triton kernel shares.

The helpers (`View`, `kernel_call`, the BlockSpecs, `tile_loop`,
`dropout_tile`, the score mod's leaves, and `q_tile_scorer`, the logits of
a kernel that owns a query tile, as the forward and the dq kernel compute
them) are read by `triton_backward` (the dq and dk/dv kernels),
`fused_backward` and `triton_distance_grad` too.

Each Triton kernel (this forward, `triton_backward`'s dq and dk/dv) owns
one output tile and loops over the tiles of the other sequence inside the
kernel, GPU style: the forward and dq kernels run on a grid `(query tiles,
B, N)` and loop over key tiles; the dk/dv kernel runs on `(key tiles, B, K)`
and loops over the G query heads of its kv head and their query tiles, so
GQA/MQA gradients are summed in registers, never through an `[B, S, N, H]`
intermediate. Keys and values are indexed by kv head
`h // G` in the BlockSpec index maps: nothing is repeated in memory.

Which tiles a loop visits comes from the block map (`blockmap.tiling`): per
row, `[lo, hi)` bounds the tiles that may be visible (causal, local window,
segments, mask); inside it, the first run of FULL tiles `[flo, fhi)` runs a
branch-free body (no mask, one relative id), and the rest dispatch per tile
on its class (SKIP / PARTIAL / FULL_LEFT / FULL_RIGHT, see `jattn.attention.tiles`).

Attention-weight dropout happens in-kernel: each tile's keep mask is the
hash of `jattn.dropout` at the tile's global indices (`dropout_tile`), from
an int32 `[2]` seed input; it is rebuilt, never stored, by the backward.

Inputs arrive padded (lengths to the tile sizes, head dims to powers of two on
the GPU) in the layout of `jax.nn.dot_product_attention`, `[B, L, heads, H]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.attention.pallas import distance_tiles, score_mod_tiles, tile_dot, tile_math
from jattn.attention.pallas.config import (
    COL_DIMS,
    ROW_DIMS,
    SQ,
    KernelConfig,
    KernelInputs,
    only_specified,
    triton_params,
)

Array = jax.Array

# The type of `pl.ds(...)` (`pl.Slice`; looked up from an instance in case a
# jax version stops exporting the name).
_SLICE = getattr(pl, "Slice", None) or type(pl.ds(0, 1))


class View:
    """A ref seen through a fixed leading index, so that code written for
    one block shape reads (and writes) the same data inside a larger block:
    `View(ref, (pl.ds(i * bq, bq), g))[...]` is `ref[pl.ds(i * bq, bq), g, :]`.

    Composes into a single indexer (the Triton lowering takes one indexer
    per load or store, not `ref.at[...]` chains): scalars drop an axis,
    `pl.ds` / `slice(None)` keep one, and a later index on a kept `pl.ds`
    axis is offset by its start.
    """

    def __init__(self, ref, prefix: tuple):
        self.ref, self.prefix = ref, tuple(prefix)

    def _kept(self) -> list[int]:
        """The ref axes this view still has, in order."""
        kept = [a for a, x in enumerate(self.prefix) if isinstance(x, (slice, _SLICE))]
        return kept + list(range(len(self.prefix), len(self.ref.shape)))

    @property
    def dtype(self):
        return self.ref.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        full = list(self.prefix) + [slice(None)] * (len(self.ref.shape) - len(self.prefix))
        return tuple(
            full[a].size if isinstance(full[a], _SLICE) else self.ref.shape[a] for a in self._kept()
        )

    def _index(self, idx) -> tuple:
        idx = idx if isinstance(idx, tuple) else (idx,)
        kept = self._kept()
        at = next((n for n, x in enumerate(idx) if x is Ellipsis), None)  # never `==` on tracers
        if at is not None:
            fill = (slice(None),) * (len(kept) - len(idx) + 1)
            idx = idx[:at] + fill + idx[at + 1 :]
        idx = idx + (slice(None),) * (len(kept) - len(idx))
        full = list(self.prefix) + [slice(None)] * (len(self.ref.shape) - len(self.prefix))
        for axis, u in zip(kept, idx, strict=True):
            base = full[axis]
            if isinstance(base, _SLICE):
                if isinstance(u, _SLICE):
                    u = pl.ds(base.start + u.start, u.size)
                elif isinstance(u, slice):
                    if u != slice(None):
                        raise ValueError(f"View: only pl.ds or ':' on a pl.ds axis, got {u}")
                    u = base
                else:
                    u = base.start + u
            full[axis] = u
        return tuple(full)

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def __setitem__(self, idx, value):
        self.ref[self._index(idx)] = value


def kernel_call(kernel, cfg: KernelConfig, name: str, **kwargs):
    return pl.pallas_call(
        kernel,
        interpret=cfg.backend == "interpret",
        compiler_params=triton_params(cfg),
        name=name,
        **kwargs,
    )


# --------------------------------------------------------------------------------------
# BlockSpecs. Grid of the forward and dq kernels: (i, b, h); of dk/dv: (j, b, kh).


def row_spec(block: int, width: int):
    """`[B, L, heads, width]` tiled along L, one head: grid (i, b, h)."""
    return pl.BlockSpec((SQ, block, SQ, width), lambda i, b, h: (b, i, h, 0))


def bias_spec_q(dims, bq: int, padded_s: int):
    """bias/mask `[B|1, N|1, Tp|1, Sp|1]` for a query tile: all keys, grid (i, b, h)."""
    fb, fn, ft_, fs = dims
    return pl.BlockSpec(
        (SQ, SQ, bq if ft_ else 1, padded_s if fs else 1),
        lambda i, b, h: (b if fb else 0, h if fn else 0, i if ft_ else 0, 0),
    )


def bias_spec_kv(dims, g: int, padded_t: int, bk: int):
    """bias/mask for a key tile: the G heads of one kv head, grid (j, b, kh)."""
    fb, fn, ft_, fs = dims
    return pl.BlockSpec(
        (SQ, g if fn else 1, padded_t if ft_ else 1, bk if fs else 1),
        lambda j, b, kh: (b if fb else 0, kh if fn else 0, 0, j if fs else 0),
    )


def load_bias_q(ref, dims, j, bk):
    """The `[bq|1, bk|1]` tile of key tile j from a query-tile bias/mask block."""
    if ref is None:
        return None
    x = ref[:, pl.ds(j * bk, bk)] if dims[3] else ref[...]
    return x if x.dtype != jnp.int8 else x != 0


def load_bias_kv(ref, dims, g, i, bq):
    """The `[bq|1, bk|1]` tile of query tile i, group member g, from a key-tile block."""
    if ref is None:
        return None
    gi = g if dims[1] else 0
    x = ref[gi, pl.ds(i * bq, bq), :] if dims[2] else ref[gi, :, :]
    return x if x.dtype != jnp.int8 else x != 0


def tile_loop(bounds, class_at, step, carry):
    """Run `step(t, partial, far_id_is_right, carry)` over one row of tiles.

    `bounds = (lo, flo, fhi, hi)`: the run `[flo, fhi)` of FULL tiles goes
    through a branch-free loop; the other tiles of `[lo, hi)` go through one
    loop that dispatches on their class, SKIP returning the carry untouched.
    (One dispatch loop over both sides of the run keeps the code to one copy
    of each step kind plus the full-tile loop.) Tiles outside `[lo, hi)`,
    e.g. outside a local window, are never visited.
    """
    lo, flo, fhi, hi = bounds
    run = fhi - flo

    def dispatch(u, c):
        t = lo + u
        t = jnp.where(t >= flo, t + run, t)  # jump over the FULL run
        tile_class = class_at(t)
        branches = [
            lambda c: c,  # SKIP
            lambda c: step(t, True, False, c),  # PARTIAL
            lambda c: step(t, False, tile_class == tile_math.FULL_RIGHT, c),  # FULL_*
        ]
        return lax.switch(jnp.minimum(tile_class, tile_math.FULL_LEFT), branches, c)

    def full(t, c):
        return step(t, False, class_at(t) == tile_math.FULL_RIGHT, c)

    carry = lax.fori_loop(flo, fhi, full, carry)
    return lax.fori_loop(0, hi - lo - run, dispatch, carry)


def kv_valid_mask(cfg: KernelConfig, j, bk: int, padded_k: int):
    if cfg.seq_k == padded_k:
        return None
    return j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0) < cfg.seq_k


def dropout_tile(cfg: KernelConfig, seed_ref, batch, head, q_start, kv_start, transposed=False):
    """Dropout multipliers `[bq, bk]` (`[bk, bq]` when `transposed`) of the
    tile whose first query / key have global indices `q_start` / `kv_start`,
    or None without dropout."""
    if not cfg.use_dropout:
        return None
    q_index = q_start + lax.broadcasted_iota(jnp.int32, (cfg.block_q,), 0)
    kv_index = kv_start + lax.broadcasted_iota(jnp.int32, (cfg.block_k,), 0)
    batch = 0 if cfg.dropout_broadcast_batch else batch
    seed = (seed_ref[0], seed_ref[1])
    return tile_math.dropout_scale(
        seed, cfg.dropout_rate, batch, head, q_index, kv_index, transposed
    )


def whole_specs(cfg: KernelConfig):
    """BlockSpecs of the score mod's leaves: each one whole, in every program."""
    if cfg.score_mod is None:
        return None

    def whole(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    return tuple(whole(shape) for shape in cfg.score_mod.kernel_shapes)


def mod_leaves(cfg: KernelConfig, r: KernelInputs):
    """The score mod's leaves read from their refs (once per program), or None."""
    if cfg.score_mod is None:
        return None
    return tuple(ref[...] for ref in r.mod_params)


def tile_mod(cfg: KernelConfig, leaves, batch, head, q_pos, kv_pos):
    """The score mod bound to one tile (`score_mod_tiles.bind`), or None."""
    if cfg.score_mod is None:
        return None
    return score_mod_tiles.bind(
        cfg.score_mod, leaves, batch, head, tile_math.as_col(q_pos), tile_math.as_row(kv_pos)
    )


def col_reader(ref, *lead):
    """`c -> ref[*lead, c]` as a `[bq]` float32 column, or None."""
    if ref is None:
        return None
    return lambda c: ref[(*lead, c)].astype(jnp.float32)


# --------------------------------------------------------------------------------------
# Forward.


def q_tile_scorer(cfg: KernelConfig, r: KernelInputs, ids=None):
    """Scores of a kernel that owns one query tile and loops over key tiles
    (forward, dq): `score(j, partial, right, need_rel=False) -> (s, dpr_tile,
    rel, k, v, z, sm)` for key tile j (see `tile_math.tile_scores`; z the
    dropout multipliers or None; sm `(mod, raw logits)` with a score mod, else
    None). The query tile's inputs, and the Shaw columns that
    FULL tiles use (ids 0 and 2k), are read once per program, not once per
    key tile. `ids = (query tile, batch row, head)`, by default the program
    ids of the grid `(i, b, h)`; `r` holds refs (or `View`s) shaped like
    this grid's blocks."""
    bk = cfg.block_k
    padded_s = r.key.shape[0]
    q = r.query[...]  # [bq, H]
    q_pos = r.q_positions[...] if cfg.use_pos else None  # [bq]
    q_seg = r.q_segments[...] if cfg.use_seg else None
    qr_col = col_reader(r.key_term, slice(None))
    dpr_col = col_reader(r.d_value_mass, slice(None))
    ends = lambda col: None if col is None else (col(0), col(cfg.far_right))
    qr_ends, dpr_ends = ends(qr_col), ends(dpr_col)

    def far(cols, partial, right):
        if partial or cols is None:
            return None
        return jnp.where(right, cols[1], cols[0])

    i, batch, head = (pl.program_id(a) for a in range(3)) if ids is None else ids
    leaves = mod_leaves(cfg, r)
    with_mod = cfg.score_mod is not None
    row = load_bias_q(r.row_bias, ROW_DIMS, 0, bk)  # [bq, 1]: the row term, or None

    def score(j, partial, right, need_rel=False):
        kv = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k = r.key[kv, :]  # [bk, H]
        v = r.value[kv, :]  # [bk, Hv]
        kv_pos = r.kv_positions[kv] if cfg.use_pos and (partial or with_mod) else None
        mod = tile_mod(cfg, leaves, batch, head, q_pos, kv_pos)
        if cfg.distance_tiles:  # additive: dS needs no pull-back, so no `(mod, raw)`
            add = distance_tiles.adder(
                r.distance_tiles, head, i, j, cfg.distance_tiles, cfg.block_q, bk
            )
        vis = None
        if partial:
            kv_seg = r.kv_segments[kv] if cfg.use_seg else None
            vis = cfg.tile_visibility(q_pos, kv_pos, q_seg, kv_seg)
        s, dpr_tile, rel, raw = tile_math.tile_scores(
            q,
            k,
            scale=cfg.qk_scale,
            vis=vis,
            kv_valid=kv_valid_mask(cfg, j, bk, padded_s) if partial else None,
            bias=(
                load_bias_q(r.bias, cfg.bias_dims, j, bk),
                row,
                load_bias_q(r.col_bias, COL_DIMS, j, bk),  # [1, bk]
            ),
            mask=load_bias_q(r.mask, cfg.mask_dims, j, bk) if partial else None,
            shaw=tile_math.ShawColumns(
                max_distance=cfg.max_distance,
                qr_col=qr_col,
                dpr_col=dpr_col,
                far_id=jnp.where(right, cfg.far_right, 0),
                qr_far=far(qr_ends, partial, right),
                dpr_far=far(dpr_ends, partial, right),
                need_rel=need_rel,
            ),
            score_mod=add if cfg.distance_tiles else mod,
            precision=cfg.precision,
        )
        z = dropout_tile(cfg, r.dropout_seed, batch, head, i * cfg.block_q, j * bk)
        return s, dpr_tile, rel, k, v, z, None if mod is None else (mod, raw)

    return score


def _fwd_kernel(r, o_ref, lse_ref, *pr_ref, cfg: KernelConfig):
    bq = cfg.block_q
    i = pl.program_id(0)
    score = q_tile_scorer(cfg, r)
    num_rel = cfg.num_rel

    def step(j, partial, right, carry):
        m, l, acc, *prs = carry
        s, _, rel, _, v, z, _ = score(j, partial, right, need_rel=cfg.use_pr)
        p, m_new, l_new, corr, row_sum = tile_math.online_softmax_step(s, m, l)
        if z is not None:  # dropout: l sums the weights before it, the values after
            p = p * z
            row_sum = jnp.sum(p, axis=1)
        pv = tile_dot.dot(p.astype(v.dtype), v, (1, 0), cfg.precision)  # [bq, Hv]
        acc = acc * corr[:, None] + pv
        if not cfg.use_pr:
            return m_new, l_new, acc
        w_left, w_right, acc_r, m_r = prs
        w_left, w_right = w_left * corr, w_right * corr
        if partial:
            # Lazy rescale: acc_r is relative to m_r, only touched on PARTIAL tiles.
            acc_r = acc_r * jnp.exp2(m_r - tile_math.safe_max(m_new))[:, None]
            acc_r = tile_math.near_scatter(*rel, p, acc_r)
            m_r = m_new
        else:
            w_left = w_left + jnp.where(right, 0.0, row_sum)
            w_right = w_right + jnp.where(right, row_sum, 0.0)
        return m_new, l_new, acc, w_left, w_right, acc_r, m_r

    zeros = jnp.zeros((bq,), jnp.float32)
    carry = (
        jnp.full((bq,), tile_math.NEG_INF),
        zeros,
        jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
    )
    if cfg.use_pr:
        carry += (
            zeros,
            zeros,
            jnp.zeros((bq, num_rel), jnp.float32),
            jnp.full((bq,), tile_math.NEG_INF),
        )
    bounds = tuple(r.row_bounds[c, i] for c in range(4))
    carry = tile_loop(bounds, lambda j: r.tile_classes[i, j], step, carry)

    m, l, acc = carry[:3]
    shift = tile_math.safe_max(m)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    # A huge finite lse for a row with nothing visible: exp(s - lse) is then 0.
    lse_ref[...] = jnp.where(empty, tile_math.EMPTY_LSE, shift + jnp.log2(l_safe))
    if cfg.use_pr:
        w_left, w_right, acc_r, m_r = carry[3:]
        acc_r = acc_r * jnp.exp2(m_r - shift)[:, None]
        acc_r = tile_math.add_far_columns(acc_r, w_left, w_right, cfg.far_right)
        pr_ref[0][...] = acc_r / l_safe[:, None]


def q_tile_specs(cfg: KernelConfig, ins: KernelInputs, n_kv_tiles: int):
    """Specs of the inputs shared by the forward and dq kernels (grid (i, b, h))."""
    bq = cfg.block_q
    _, padded_t, n, h = ins.query.shape
    padded_s, hv = ins.key.shape[1], ins.value.shape[-1]
    g = cfg.groups
    map_head = (lambda h_: h_) if cfg.map_per_head else (lambda h_: 0)
    kv_spec = lambda w: pl.BlockSpec((SQ, padded_s, SQ, w), lambda i, b, h_: (b, 0, h_ // g, 0))
    n_q_tiles = padded_t // bq
    return KernelInputs(
        query=row_spec(bq, h),
        key=kv_spec(h),
        value=kv_spec(hv),
        q_positions=pl.BlockSpec((SQ, bq), lambda i, b, h_: (b, i)) if cfg.use_pos else None,
        kv_positions=pl.BlockSpec((SQ, padded_s), lambda i, b, h_: (b, 0)) if cfg.use_pos else None,
        q_segments=pl.BlockSpec((SQ, bq), lambda i, b, h_: (b, i)) if cfg.use_seg else None,
        kv_segments=pl.BlockSpec((SQ, padded_s), lambda i, b, h_: (b, 0)) if cfg.use_seg else None,
        bias=bias_spec_q(cfg.bias_dims, bq, padded_s) if cfg.bias_dims else None,
        row_bias=bias_spec_q(ROW_DIMS, bq, padded_s) if cfg.row_col else None,
        col_bias=bias_spec_q(COL_DIMS, bq, padded_s) if cfg.row_col else None,
        mask=bias_spec_q(cfg.mask_dims, bq, padded_s) if cfg.mask_dims else None,
        key_term=row_spec(bq, cfg.num_rel) if cfg.use_qr else None,
        tile_classes=pl.BlockSpec(
            (SQ, SQ, n_q_tiles, n_kv_tiles), lambda i, b, h_: (b, map_head(h_), 0, 0)
        ),
        row_bounds=pl.BlockSpec((SQ, SQ, 4, n_q_tiles), lambda i, b, h_: (b, map_head(h_), 0, 0)),
        dropout_seed=pl.BlockSpec((2,), lambda i, b, h_: (0,)) if cfg.use_dropout else None,
        mod_params=whole_specs(cfg),
        distance_tiles=tiles_spec(cfg, ins),
    )


def tiles_spec(cfg: KernelConfig, ins: KernelInputs):
    """The distance tiles, whole, in every program (any grid), or None."""
    if not cfg.distance_tiles:
        return None
    return distance_tiles.whole_spec(ins.distance_tiles.shape)


def flash_forward(cfg: KernelConfig, ins: KernelInputs) -> tuple[Array, Array, Array | None]:
    """Forward kernel.

    Args:
      cfg: static configuration.
      ins: padded inputs: q `[B, Tp, N, H]`, k `[B, Sp, K, H]`, v `[B, Sp, K, Hv]`,
        qpos/qseg `[B, Tp]`, kvpos/kvseg `[B, Sp]`, bias/mask
        `[B|1, N|1, Tp|1, Sp|1]` (mask int8), the row and column terms
        `[B, N, Tp, 1]` and `[B, N, 1, Sp]` float32, qr `[B, Tp, N, Rp]` float32,
        bmap `[B, N|1, nT, nS]`, bounds (row) `[B, N|1, 4, nT]`; absent = None.

    Returns:
      `o [B, Tp, N, Hv]` (float32 when `use_pr`, else the query dtype),
      `lse [B, N, Tp]` float32, `pr [B, Tp, N, Rp]` float32 or None.
    """
    b, padded_t, n, _ = ins.query.shape
    hv = ins.value.shape[-1]
    n_kv_tiles = ins.tile_classes.shape[-1]
    specs = q_tile_specs(cfg, ins, n_kv_tiles)
    ins = only_specified(ins, specs)
    o_dtype = jnp.float32 if cfg.use_pr else ins.query.dtype
    out_shape = [
        jax.ShapeDtypeStruct((b, padded_t, n, hv), o_dtype),
        jax.ShapeDtypeStruct((b, n, padded_t), jnp.float32),
    ]
    out_specs = [
        row_spec(cfg.block_q, hv),
        pl.BlockSpec((SQ, SQ, cfg.block_q), lambda i, b_, h: (b_, h, i)),
    ]
    if cfg.use_pr:
        out_shape.append(jax.ShapeDtypeStruct((b, padded_t, n, cfg.num_rel), jnp.float32))
        out_specs.append(row_spec(cfg.block_q, cfg.num_rel))
    outs = kernel_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        cfg,
        "jattn_flash_fwd",
        grid=(padded_t // cfg.block_q, b, n),
        in_specs=[specs],
        out_specs=out_specs,
        out_shape=out_shape,
    )(ins)
    return outs[0], outs[1], outs[2] if cfg.use_pr else None
