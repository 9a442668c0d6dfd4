"""The gradient of the distance tiles (`distance_tiles`) for the Mosaic (TPU) kernels.

`d tiles[h, idx] = Σ_b Σ_{(i, j) on diagonal idx} dS(b, h, i, j)`, as
`triton_distance_grad` computes it for the Triton kernels, in the TPU's
style: grid `(N, nd, B, nT)`, the last two axes "arbitrary", so the output
block `[bq, bk]` of `(h, idx)` is revisited and accumulates in place. Step
`(b, m)` is query tile m and, if the diagonal has one in that row, key tile
`j = (d0 + m*bq) / bk`: its BlockSpecs read that tile (clamped into range
where there is none, and the step then adds nothing), and s, P and dS are
recomputed with the dq kernel's functions (`mosaic_forward.ref_scores`,
`tile_math.score_grads`). A diagonal's tiles never meet another program's
block, so nothing races. Launched only when the mod's params need a gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.attention.pallas import tile_math
from jattn.attention.pallas.config import SQ, KernelConfig, KernelInputs
from jattn.attention.pallas.mosaic_backward import backward_input_specs
from jattn.attention.pallas.mosaic_forward import (
    Maps,
    dropout_tile,
    mosaic_call,
    ref_scores,
    tile_adder,
    tpu_inputs,
    when_visible,
)

Array = jax.Array

__all__ = ["flash_dtiles"]


def _key_tile(cfg: KernelConfig, n_kv_tiles: int, idx, m):
    """`(j, exists)`: the key tile of diagonal idx in query-tile row m, clamped
    into `[0, nS)`, and whether the row has one."""
    bq, bk = cfg.block_q, cfg.block_k
    num = idx * math.gcd(bq, bk) - (cfg.distance_tiles - bq) + m * bq  # j * bk
    pos = jnp.maximum(num, 0)
    exists = (num >= 0) & (lax.rem(pos, bk) == 0) & (lax.div(pos, bk) < n_kv_tiles)
    return jnp.minimum(lax.div(pos, bk), n_kv_tiles - 1), exists


def _kernel(classes_ref, bounds_ref, seed_ref, r, out_ref, *, cfg: KernelConfig, maps: Maps):
    h, idx, b, m = (pl.program_id(a) for a in range(4))

    @pl.when((b == 0) & (m == 0))
    def _init():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    j, exists = _key_tile(cfg, maps.kv_tiles, idx, m)

    def body(partial, right):
        s, dpr_t, _, _ = ref_scores(cfg, r, maps, j, partial, right, mod=tile_adder(cfg, r))
        p = tile_math.recomputed_probs(s, r.lse[...])  # [bq, bk]; base-2 logits and lse
        z = dropout_tile(cfg, seed_ref, b, h, m, j)
        out_ref[...] += tile_math.score_grads(p, r.d_out[...], r.value[...], dpr_t, z, r.delta[...])

    tile_class = jnp.where(exists, maps.tile_class(classes_ref, b, h, m, j), tile_math.SKIP)
    when_visible(tile_class, body)


def flash_dtiles(cfg: KernelConfig, ins: KernelInputs) -> Array:
    """The distance tiles' gradient, float32 `[N, nd*bq, bk]`; arguments as
    `triton_distance_grad.flash_dtiles`."""
    x = tpu_inputs(ins)
    b, n, padded_t, hdim = x.query.shape
    hv = x.value.shape[-1]
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.groups
    nd = ins.distance_tiles.shape[1] // bq
    maps = Maps(cfg, ins.tile_classes, ins.row_bounds, ins.dropout_seed)

    def kv_tile(h, idx, b_, m, *_):
        return _key_tile(cfg, maps.kv_tiles, idx, m)[0]

    def q_row(w):
        return pl.BlockSpec((SQ, SQ, bq, w), lambda h, idx, b_, m, *_: (b_, h, m, 0))

    def kv_rows(w):
        return pl.BlockSpec((SQ, SQ, bk, w), lambda *a: (a[2], lax.div(a[0], g), kv_tile(*a), 0))

    q_col = pl.BlockSpec((SQ, bq, 1), lambda h, idx, b_, m, *_: (b_, m, 0))
    kv_row = pl.BlockSpec((SQ, 1, bk), lambda *a: (a[2], 0, kv_tile(*a)))

    def bias(dims):  # bias/mask [B|1, N|1, Tp|1, Sp|1] -> a [bq|1, bk|1] block
        fb, fn, ft_, fs = dims
        return pl.BlockSpec(
            (SQ, SQ, bq if ft_ else 1, bk if fs else 1),
            lambda *a: (
                a[2] if fb else 0,
                a[0] if fn else 0,
                a[3] if ft_ else 0,
                kv_tile(*a) if fs else 0,
            ),
        )

    specs = backward_input_specs(
        cfg,
        (hdim, hv),
        (q_row, kv_rows, q_col, kv_row),
        bias,
        distance_tiles=pl.BlockSpec((SQ, bq, bk), lambda h, idx, *_: (h, idx, 0)),
    )
    out = mosaic_call(
        _kernel,
        cfg,
        "jattn_flash_dtiles_tpu",
        maps=maps,
        grid=(n, nd, b, padded_t // bq),
        in_specs=specs,
        inputs=x,
        out_specs=pl.BlockSpec((SQ, bq, bk), lambda h, idx, *_: (h, idx, 0)),
        out_shape=jax.ShapeDtypeStruct((n, nd * bq, bk), jnp.float32),
        scratch=[],
        semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
    )
    return out
