"""The gradient of the distance tiles (`distance_tiles`): one Triton kernel by diagonal.

`d tiles[h, idx] = Σ_b Σ_{(i, j) on diagonal idx} dS(b, h, i, j)`, dS the
gradient of the tile's natural logits (0 where invisible). The dq and dk/dv
kernels each own one query or key tile, so the tiles of one diagonal fall
into many of their programs: summing there would race (or need atomics).
This kernel owns one diagonal instead: grid `(idx, B, N)`, a loop over the
query tiles i whose key tile `j = (d0 + i*bq) / bk` exists, recomputing s,
P and dS of tile `(i, j)` with the dq kernel's own functions
(`triton_forward.q_tile_scorer`, `tile_math.score_grads`) on `View`s of
whole-length blocks, and a `[bq, bk]` float32 sum. Its output
`[B, N, nd*bq, bk]` is summed over B in XLA. Launched only when the mod's
params need a gradient (`flash_attention._flash_core_bwd`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.attention.pallas import tile_math
from jattn.attention.pallas.config import (
    COL_DIMS,
    ROW_DIMS,
    SQ,
    KernelConfig,
    KernelInputs,
    halve_kv,
    only_specified,
    with_triton_x3,
)
from jattn.attention.pallas.triton_forward import View, kernel_call, q_tile_scorer, q_tile_specs

Array = jax.Array

__all__ = ["flash_dtiles"]


def _maybe(ref, prefix):
    return None if ref is None else View(ref, prefix)


def _kernel(r: KernelInputs, out_ref, *, cfg: KernelConfig, n_q_tiles: int, n_kv_tiles: int):
    bq, bk = cfg.block_q, cfg.block_k
    idx, batch, head = (pl.program_id(a) for a in range(3))
    d0 = idx * math.gcd(bq, bk) - (cfg.distance_tiles - bq)  # j*bk - i*bq on this diagonal
    # bias, mask, row and column terms: a query tile of those with a query axis
    pairs = (("bias", cfg.bias_dims), ("mask", cfg.mask_dims))
    pairs += (("row_bias", ROW_DIMS), ("col_bias", COL_DIMS))

    def body(i, acc):
        num = jnp.maximum(d0 + i * bq, 0)  # j * bk if tile (i, j) exists
        j = jnp.minimum(lax.div(num, bk), n_kv_tiles - 1)
        exists = (d0 + i * bq >= 0) & (lax.rem(num, bk) == 0) & (lax.div(num, bk) < n_kv_tiles)
        exists &= (j >= r.row_bounds[0, i]) & (j < r.row_bounds[3, i])  # as the dq loop visits
        tile_class = jnp.where(exists, r.tile_classes[i, j], tile_math.SKIP)
        qs = pl.ds(pl.multiple_of(i * bq, bq), bq)
        rq = r._replace(
            query=View(r.query, (qs,)),  # [bq, H]
            d_out=View(r.d_out, (qs,)),
            lse=View(r.lse, (qs,)),  # [bq]
            delta=View(r.delta, (qs,)),
            q_positions=_maybe(r.q_positions, (qs,)),
            q_segments=_maybe(r.q_segments, (qs,)),
            key_term=_maybe(r.key_term, (qs,)),  # [bq, Rp]
            d_value_mass=_maybe(r.d_value_mass, (qs,)),
            **{
                name: _maybe(getattr(r, name), (qs,)) if dims and dims[2] else getattr(r, name)
                for name, dims in pairs
            },  # [bq|1, Sp|1]
        )
        score = q_tile_scorer(cfg, rq, (i, batch, head))

        def step(partial, right, acc):
            s, dpr_t, _, _, v, z, _ = score(j, partial, right)
            p = tile_math.recomputed_probs(s, rq.lse[...][:, None])  # base-2 logits and lse
            delta = rq.delta[...][:, None]
            ds = tile_math.score_grads(
                p, rq.d_out[...], v, dpr_t, z, delta, cfg.precision, unscale=cfg.kv_unscale
            )
            return acc + ds

        branches = [
            lambda a: a,  # SKIP (or no tile of this diagonal in row i)
            lambda a: step(True, False, a),  # PARTIAL
            lambda a: step(False, tile_class == tile_math.FULL_RIGHT, a),  # FULL_*
        ]
        return lax.switch(jnp.minimum(tile_class, tile_math.FULL_LEFT), branches, acc)

    acc = lax.fori_loop(0, n_q_tiles, body, jnp.zeros((bq, bk), jnp.float32))
    out_ref[...] = acc


def flash_dtiles(cfg: KernelConfig, ins: KernelInputs) -> Array:
    """The distance tiles' gradient, float32 `[N, nd*bq, bk]`.

    Args:
      cfg: the backward's config (`cfg.distance_tiles` set).
      ins: as for `triton_backward.flash_dq` (the backward tiling's block
        map, `ins.distance_tiles` the backward tiling's tiles).
    """
    cfg, ins = halve_kv(cfg, ins)  # no TF32 head of a finite float32 key overflows
    cfg = with_triton_x3(cfg)  # spill-free at float32, head dim 128 (docs/gpu.md)
    b, padded_t, n, h = ins.query.shape
    hv, padded_s = ins.value.shape[-1], ins.key.shape[1]
    bq, bk = cfg.block_q, cfg.block_k
    n_q_tiles, n_kv_tiles = ins.tile_classes.shape[-2:]
    nd = ins.distance_tiles.shape[1] // bq
    rows = lambda w: pl.BlockSpec((SQ, padded_t, SQ, w), lambda d, b_, h_: (b_, 0, h_, 0))  # noqa: E731
    per_row = pl.BlockSpec((SQ, padded_t), lambda d, b_, h_: (b_, 0))
    per_head = pl.BlockSpec((SQ, SQ, padded_t), lambda d, b_, h_: (b_, h_, 0))

    def whole_length(dims):  # bias / mask [B|1, N|1, Tp|1, Sp|1]: one head
        fb, fn, ft_, fs = dims
        return pl.BlockSpec(
            (SQ, SQ, padded_t if ft_ else 1, padded_s if fs else 1),
            lambda d, b_, h_: (b_ if fb else 0, h_ if fn else 0, 0, 0),
        )

    specs = q_tile_specs(cfg, ins, n_kv_tiles)._replace(
        query=rows(h),
        q_positions=per_row if cfg.use_pos else None,
        q_segments=per_row if cfg.use_seg else None,
        bias=whole_length(cfg.bias_dims) if cfg.bias_dims else None,
        row_bias=whole_length(ROW_DIMS) if cfg.row_col else None,
        col_bias=whole_length(COL_DIMS) if cfg.row_col else None,
        mask=whole_length(cfg.mask_dims) if cfg.mask_dims else None,
        key_term=rows(cfg.num_rel) if cfg.use_qr else None,
        d_out=rows(hv),
        lse=per_head,
        delta=per_head,
        d_value_mass=rows(cfg.num_rel) if cfg.use_pr else None,
    )
    out = kernel_call(
        functools.partial(_kernel, cfg=cfg, n_q_tiles=n_q_tiles, n_kv_tiles=n_kv_tiles),
        cfg,
        "jattn_flash_dtiles",
        grid=(nd, b, n),
        in_specs=[specs],
        out_specs=pl.BlockSpec((SQ, SQ, bq, bk), lambda d, b_, h_: (b_, h_, d, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n, nd * bq, bk), jnp.float32),
    )(only_specified(ins, specs))
    return jnp.sum(out, axis=0)
