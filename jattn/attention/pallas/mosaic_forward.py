"""The flash kernels for TPU (Pallas Mosaic): layout, tile helpers, forward.

Same contract, same tile math (`tile_math`) and same block map as the
Triton kernels of `triton_forward` / `triton_backward`, in the TPU's style:

- the loop over the other sequence's tiles is the innermost grid axis
  (`"arbitrary"`), with the running statistics and accumulators in VMEM
  scratch, instead of a `fori_loop` inside one program;
- the block map, its loop bounds and the dropout seed are scalar-prefetched
  into SMEM: a tile's class picks its body (`pl.when`), and the BlockSpec
  index maps clamp the other sequence's tile index into the row's `[lo, hi)`,
  so skipped tiles (outside a local window, another segment, ...) repeat the
  previous block index and cost no DMA; a tile's dropout keep mask is the
  `jattn.dropout` hash at its global indices (`dropout_tile`);
- every value stays 2-D (per-query vectors as `[bq, 1]` columns, per-key ones
  as `[1, bk]` rows) and every block's last two dims are whole or tile
  aligned, which is what Mosaic lowers. Inputs therefore go head-major,
  `[B, heads, L, H]` (one XLA transpose each way around the kernels);
- a Shaw table column is read by a lane-masked row sum and a near-diagonal
  tile visits every relative id `0..2k` (no dynamic lane index, no
  vector-to-scalar reduction for the id range).

The backward kernels (dq, dk/dv) are in `mosaic_backward`. The wrappers take
and return the Triton kernels' layout (see
`triton_forward.flash_forward`, `triton_backward.flash_dq` / `flash_dkv`), so the
custom VJP in `flash_attention` is shared by both. Lengths must be padded to
the blocks; `block_k` must be a multiple of 128 (a lane tile) unless one key
tile covers all keys, `block_q` a multiple of 8 (an int8 mask would need 32,
so `prepare` hands TPU kernels an int32 mask).

Limits: the block map sits whole in SMEM, `B·Nm·nT·nS` int32 values (Nm = N
with a per-head mask, else 1): B = 8 at L = 8k with 128-tiles is 128 KiB;
longer sequences or per-head masks need larger blocks or smaller batches per
call. Status: tested in interpret mode on the CPU, and compiled by libtpu for
compile-only TPU v5e and v6e (`python benchmarks/aot.py --target tpu`, docs/tpu.md;
CI compiles a subset); never run nor timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jattn.attention.pallas import distance_tiles, score_mod_tiles, tile_dot, tile_math
from jattn.attention.pallas.config import (
    COL_DIMS,
    ROW_DIMS,
    SQ,
    KernelConfig,
    KernelInputs,
    mosaic_params,
    only_specified,
)

Array = jax.Array


# --------------------------------------------------------------------------------------
# Layout: head-major values, 2-D positions, flat block map and bounds.


def heads_major(x: Array | None) -> Array | None:
    """`[B, L, heads, W]` -> `[B, heads, L, W]`."""
    return None if x is None else jnp.swapaxes(x, 1, 2)


def tpu_inputs(ins: KernelInputs) -> KernelInputs:
    """The Triton layout of `ins` turned into the Mosaic one."""
    col = lambda x: None if x is None else x[:, :, None]
    row = lambda x: None if x is None else x[:, None, :]
    last = lambda x: None if x is None else x[..., None]
    return ins._replace(
        query=heads_major(ins.query),
        key=heads_major(ins.key),
        value=heads_major(ins.value),
        key_term=heads_major(ins.key_term),
        d_out=heads_major(ins.d_out),
        d_value_mass=heads_major(ins.d_value_mass),
        q_positions=col(ins.q_positions),
        q_segments=col(ins.q_segments),
        kv_positions=row(ins.kv_positions),
        kv_segments=row(ins.kv_segments),
        lse=last(ins.lse),
        delta=last(ins.delta),
    )


class Maps:
    """Index arithmetic over the flat, scalar-prefetched block map
    `[B, Nm, nT, nS]` (Nm = `map_heads`, N or 1; nT = `q_tiles`, nS =
    `kv_tiles`) and bounds `[B, Nm, 4, n]`, and the
    dropout seed (int32 `[2]`, zeros without dropout), the third scalar
    prefetched."""

    def __init__(self, cfg: KernelConfig, classes: Array, bounds: Array, seed: Array | None):
        _, self.map_heads, self.q_tiles, self.kv_tiles = classes.shape
        self.n_bounds = bounds.shape[-1]
        self.per_head = cfg.map_per_head
        self.classes_flat, self.bounds_flat = classes.reshape(-1), bounds.reshape(-1)
        self.seed = jnp.zeros((2,), jnp.int32) if seed is None else seed

    def map_head(self, h):
        """The head index into the map: h with a per-head map, else 0."""
        return h if self.per_head else 0

    def tile_class(self, classes_ref, b, h, i, j):
        """The class of tile (i, j) of batch row b, head h."""
        row = (b * self.map_heads + self.map_head(h)) * self.q_tiles + i
        return classes_ref[row * self.kv_tiles + j]

    def clamp(self, bounds_ref, b, h, x, t):
        """Tile `t` of the run of row/column `x`, clamped into `[lo, hi)`:
        outside it the previous block index repeats and nothing is copied."""
        base = ((b * self.map_heads + self.map_head(h)) * 4) * self.n_bounds + x
        lo = bounds_ref[base]
        hi = bounds_ref[base + 3 * self.n_bounds]
        return jnp.minimum(jnp.maximum(t, lo), jnp.maximum(hi - 1, lo))


def mosaic_call(kernel, cfg: KernelConfig, name: str, *, maps: Maps, grid,
                in_specs: KernelInputs, inputs: KernelInputs, out_specs, out_shape, scratch,
                semantics):  # fmt: skip
    """Run `kernel(classes_ref, bounds_ref, seed_ref, refs, *outs, *scratch,
    cfg=, maps=)` over `grid`, the block map, bounds and dropout seed
    scalar-prefetched into SMEM (index maps get them as three extra
    arguments).
    `in_specs` and `inputs` are `KernelInputs` (None = absent; inputs
    without a spec, such as the prefetched maps, are not passed again)."""
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=grid,
        in_specs=[in_specs],
        out_specs=out_specs,
        scratch_shapes=scratch,
    )
    call = pl.pallas_call(
        functools.partial(kernel, cfg=cfg, maps=maps),
        grid_spec=grid_spec,
        out_shape=out_shape,
        interpret=cfg.backend == "tpu_interpret",
        compiler_params=mosaic_params(cfg, semantics),
        name=name,
    )
    return call(maps.classes_flat, maps.bounds_flat, maps.seed, only_specified(inputs, in_specs))


def bias_spec(dims, bq: int, bk: int, head, q_tile, k_tile):
    """bias/mask `[B|1, N|1, Tp|1, Sp|1]` -> a `[bq|1, bk|1]` block."""
    fb, fn, ft_, fs = dims
    return pl.BlockSpec(
        (SQ, SQ, bq if ft_ else 1, bk if fs else 1),
        lambda *a: (
            a[0] if fb else 0,
            head(*a) if fn else 0,
            q_tile(*a) if ft_ else 0,
            k_tile(*a) if fs else 0,
        ),
    )


def column_reader(tile: Array | None):
    """`c -> tile[:, c]` as `[bq, 1]` by a lane-masked sum (c may be traced)."""
    if tile is None:
        return None
    lanes = lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    return lambda c: jnp.sum(jnp.where(lanes == c, tile, 0.0), axis=1, keepdims=True)


def add_column(acc: Array, c: int, col: Array) -> Array:
    """`acc[:, c] += col` for a static column c (`acc [bq, R]`, `col [bq, 1]`)."""
    lanes = lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    return acc + jnp.where(lanes == c, col, 0.0)


def kv_valid_row(cfg: KernelConfig, j, bk: int, padded_k: int):
    if cfg.seq_k == padded_k:
        return None
    return j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1) < cfg.seq_k


def when_visible(tile_class, body):
    """Run `body(partial, right_id)` for the class of the current tile
    (nothing for SKIP)."""
    pl.when(tile_class == tile_math.PARTIAL)(lambda: body(True, False))
    pl.when(tile_class == tile_math.FULL_LEFT)(lambda: body(False, False))
    pl.when(tile_class == tile_math.FULL_RIGHT)(lambda: body(False, True))


def dropout_tile(cfg: KernelConfig, seed_ref, batch, head, q_tile, kv_tile):
    """Dropout multipliers `[bq, bk]` of query tile `q_tile` and key tile
    `kv_tile` (global indices), or None without dropout."""
    if not cfg.use_dropout:
        return None
    bq, bk = cfg.block_q, cfg.block_k
    q_index = q_tile * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    kv_index = kv_tile * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    batch = 0 if cfg.dropout_broadcast_batch else batch
    seed = (seed_ref[0], seed_ref[1])
    return tile_math.dropout_scale(seed, cfg.dropout_rate, batch, head, q_index, kv_index)


def tile_mod(cfg: KernelConfig, r: KernelInputs, batch, head):
    """The score mod bound to the current block (`score_mod_tiles.bind`:
    leaves and positions read from the refs), or None."""
    if cfg.score_mod is None:
        return None
    leaves = tuple(ref[...] for ref in r.mod_params)
    return score_mod_tiles.bind(
        cfg.score_mod, leaves, batch, head, load(r.q_positions), load(r.kv_positions)
    )


def tile_adder(cfg: KernelConfig, r: KernelInputs):
    """`s -> s + tile`, the block's distance tile (its BlockSpec picks the
    tile diagonal, `tiles_spec`), or None without distance tiles."""
    if not cfg.distance_tiles:
        return None
    tile = r.distance_tiles[...].astype(jnp.float32)  # [bq, bk]
    return lambda s: s + tile


def tiles_spec(cfg: KernelConfig, head, q_tile, kv_tile):
    """The `[bq, bk]` block of the distance tiles `[N, nd*bq, bk]` on the
    diagonal of (q_tile, kv_tile) (index-map functions of the grid), or None."""
    if not cfg.distance_tiles:
        return None

    bq, bk = cfg.block_q, cfg.block_k

    def index(*a):
        return (
            head(*a),
            distance_tiles.diagonal(q_tile(*a), kv_tile(*a), cfg.distance_tiles, bq, bk),
            0,
        )

    return pl.BlockSpec((SQ, bq, bk), index)


def mod_specs(cfg: KernelConfig):
    """Whole-array BlockSpecs of the score mod's leaves (any grid, with the
    scalar-prefetch arguments), or None."""
    if cfg.score_mod is None:
        return None

    def whole(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    return tuple(whole(shape) for shape in cfg.score_mod.kernel_shapes)


def ref_scores(cfg: KernelConfig, r: KernelInputs, maps: Maps, j, partial: bool, right: bool,
               *, need_rel: bool = False, mod=None):  # fmt: skip
    """`tile_math.tile_scores` of the current (query tile, key tile) block,
    every input read from the kernel's refs `r`, with the Mosaic conventions
    (static relative-id range, static far id); `mod` the block's score mod."""
    bk = cfg.block_k
    vis = None
    if partial:  # read only where the tile is tested per element
        refs = (r.q_positions, r.kv_positions, r.q_segments, r.kv_segments)
        vis = cfg.tile_visibility(*(load(ref) for ref in refs))
    return tile_math.tile_scores(
        r.query[...],
        r.key[...],
        scale=cfg.scale,
        vis=vis,
        kv_valid=kv_valid_row(cfg, j, bk, maps.kv_tiles * bk) if partial else None,
        bias=(load(r.bias), load(r.row_bias), load(r.col_bias)),  # the row, column terms
        mask=load_mask(r.mask) if partial else None,
        shaw=tile_math.ShawColumns(
            max_distance=cfg.max_distance,
            qr_col=column_reader(load(r.key_term)),
            dpr_col=column_reader(load(r.d_value_mass)),
            far_id=cfg.far_right if right else 0,
            need_rel=need_rel,
            num_rel=2 * cfg.max_distance + 1,
        ),
        score_mod=mod,
    )


def load(ref):
    return None if ref is None else ref[...]


def load_mask(ref):
    return None if ref is None else ref[...] != 0


# --------------------------------------------------------------------------------------
# Forward: grid (B, N, nT, nS).


def _fwd_kernel(classes_ref, bounds_ref, seed_ref, r, o_ref, lse_ref, *rest, cfg: KernelConfig,
                maps: Maps):  # fmt: skip
    pr_ref = rest[0] if cfg.use_pr else None
    m_sc, l_sc, acc_sc, *accr_sc = rest[1:] if cfg.use_pr else rest
    b, h, i, j = (pl.program_id(a) for a in range(4))

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, tile_math.NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        if cfg.use_pr:
            accr_sc[0][...] = jnp.zeros(accr_sc[0].shape, jnp.float32)

    def body(partial, right):
        mod = tile_adder(cfg, r) or tile_mod(cfg, r, b, h)
        s, _, rel, _ = ref_scores(cfg, r, maps, j, partial, right, need_rel=cfg.use_pr, mod=mod)
        p, m_new, l_new, corr, row_sum = tile_math.online_softmax_step(s, m_sc[...], l_sc[...])
        z = dropout_tile(cfg, seed_ref, b, h, i, j)
        if z is not None:  # dropout: l sums the weights before it, the values after
            p = p * z
            row_sum = jnp.sum(p, axis=1, keepdims=True)
        v = r.value[...]
        pv = tile_dot.dot(p.astype(v.dtype), v, (1, 0))  # [bq, Hv]
        m_sc[...], l_sc[...] = m_new, l_new
        acc_sc[...] = acc_sc[...] * corr + pv
        if cfg.use_pr:
            accr = accr_sc[0][...] * corr  # [bq, R] weight mass per relative id
            if partial:
                accr = tile_math.near_scatter(*rel, p, accr)
            else:
                accr = add_column(accr, cfg.far_right if right else 0, row_sum)
            accr_sc[0][...] = accr

    when_visible(maps.tile_class(classes_ref, b, h, i, j), body)

    @pl.when(j == maps.kv_tiles - 1)
    def _finish():
        m, l = m_sc[...], l_sc[...]  # [bq, 1]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(
            empty, tile_math.EMPTY_LSE, tile_math.safe_max(m) + jnp.log2(l_safe)
        )
        if cfg.use_pr:
            pr_ref[...] = accr_sc[0][...] / l_safe


def q_tile_specs(cfg: KernelConfig, x: KernelInputs, maps: Maps) -> KernelInputs:
    """Specs of the inputs of the forward and dq kernels, grid (b, h, i, j)."""
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.groups
    hdim, hv = x.query.shape[-1], x.value.shape[-1]

    def kv_tile(b, h, i, j, classes, bounds, seed):
        return maps.clamp(bounds, b, h, i, j)

    def q_row(w):
        return pl.BlockSpec((SQ, SQ, bq, w), lambda b, h, i, j, *_: (b, h, i, 0))

    def kv_rows(w):
        return pl.BlockSpec(
            (SQ, SQ, bk, w),
            lambda b, h, i, j, *p: (b, lax.div(h, g), kv_tile(b, h, i, j, *p), 0),
        )

    q_col = pl.BlockSpec((SQ, bq, 1), lambda b, h, i, j, *_: (b, i, 0))
    kv_row = pl.BlockSpec((SQ, 1, bk), lambda b, h, i, j, *p: (b, 0, kv_tile(b, h, i, j, *p)))
    head = lambda b, h, i, j, *_: h
    q_tile = lambda b, h, i, j, *_: i
    return KernelInputs(
        query=q_row(hdim),
        key=kv_rows(hdim),
        value=kv_rows(hv),
        q_positions=q_col if cfg.use_pos else None,
        kv_positions=kv_row if cfg.use_pos else None,
        q_segments=q_col if cfg.use_seg else None,
        kv_segments=kv_row if cfg.use_seg else None,
        bias=bias_spec(cfg.bias_dims, bq, bk, head, q_tile, kv_tile) if cfg.bias_dims else None,
        row_bias=bias_spec(ROW_DIMS, bq, bk, head, q_tile, kv_tile) if cfg.row_col else None,
        col_bias=bias_spec(COL_DIMS, bq, bk, head, q_tile, kv_tile) if cfg.row_col else None,
        mask=bias_spec(cfg.mask_dims, bq, bk, head, q_tile, kv_tile) if cfg.mask_dims else None,
        key_term=q_row(cfg.num_rel) if cfg.use_qr else None,
        mod_params=mod_specs(cfg),
        distance_tiles=tiles_spec(cfg, head, q_tile, kv_tile),
    )


def q_row_spec(bq: int, w: int):
    return pl.BlockSpec((SQ, SQ, bq, w), lambda b, h, i, j, *_: (b, h, i, 0))


def flash_forward(cfg: KernelConfig, ins: KernelInputs) -> tuple[Array, Array, Array | None]:
    """Forward kernel; arguments and results as `triton_forward.flash_forward`."""
    x = tpu_inputs(ins)
    b, n, padded_t, _ = x.query.shape
    hv = x.value.shape[-1]
    bq = cfg.block_q
    maps = Maps(cfg, ins.tile_classes, ins.row_bounds, ins.dropout_seed)
    specs = q_tile_specs(cfg, x, maps)
    o_dtype = jnp.float32 if cfg.use_pr else x.query.dtype
    out_shape = [
        jax.ShapeDtypeStruct((b, n, padded_t, hv), o_dtype),
        jax.ShapeDtypeStruct((b, n, padded_t, 1), jnp.float32),
    ]
    out_specs = [q_row_spec(bq, hv), q_row_spec(bq, 1)]
    scratch = [
        pltpu.VMEM((bq, 1), jnp.float32),  # running max
        pltpu.VMEM((bq, 1), jnp.float32),  # running sum
        pltpu.VMEM((bq, hv), jnp.float32),  # output accumulator
    ]
    if cfg.use_pr:
        out_shape.append(jax.ShapeDtypeStruct((b, n, padded_t, cfg.num_rel), jnp.float32))
        out_specs.append(q_row_spec(bq, cfg.num_rel))
        scratch.append(pltpu.VMEM((bq, cfg.num_rel), jnp.float32))
    outs = mosaic_call(
        _fwd_kernel,
        cfg,
        "jattn_flash_fwd_tpu",
        maps=maps,
        grid=(b, n, padded_t // bq, maps.kv_tiles),
        in_specs=specs,
        inputs=x,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch=scratch,
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
    )
    o = heads_major(outs[0])
    pr = heads_major(outs[2]) if cfg.use_pr else None
    return o, outs[1][..., 0], pr
