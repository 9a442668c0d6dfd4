"""The fused backward of the Triton flash kernels: dq, dk and dv in one launch.

`backward="fused"` in `flash_attention`. The split backward
(`triton_backward`) launches a dq kernel over `(query tiles, B, N)` and a
dk/dv kernel over `(key tiles, B, K)`; both recompute the probabilities of
every visible tile. jax's reference kernel (`pallas/ops/gpu/attention.py`,
`backward_pass_impl="triton"`) instead runs one kernel whose programs first
accumulate dk/dv for a key tile and then dq for a query tile. This kernel
does the same with jattn's tile math: one grid `(nS + nT, B, K)` whose first
nS programs (along axis 0) are the dk/dv programs of `triton_backward` and
whose last nT programs compute dq for one query tile of each of the G query
heads of kv head `K`. One launch instead of two, inputs prepared once; the
probabilities are still recomputed on both sides (no atomics, so results
stay deterministic). Which is faster is the GPU's to say:
`benchmarks/gpu.py` times both.

Both halves run the split kernels' own tile code (`triton_backward.dq_tile`
and `dkv_tile`) on `View`s of this kernel's larger blocks (all keys and all
queries of one kv head's group), so the math exists once.

Output blocks: each program writes only its own tiles; the other half's
output index maps are clamped to a valid block that it leaves untouched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.attention.pallas.config import (
    COL_DIMS,
    ROW_DIMS,
    SQ,
    KernelConfig,
    KernelInputs,
    col_sums,
    dbias_kind,
    halve_kv,
    mod_grad_shapes,
    only_specified,
    row_sums,
    with_triton_x3,
)
from jattn.attention.pallas.triton_backward import dkv_tile, dq_tile, query_bias_grad_outputs
from jattn.attention.pallas.triton_forward import View, kernel_call, tiles_spec, whole_specs

Array = jax.Array

__all__ = ["flash_dq_dkv"]


def _maybe(ref, prefix):
    return None if ref is None else View(ref, prefix)


def _pairwise(r: KernelInputs, cfg: KernelConfig, view) -> dict:
    """The bias, the mask and the row and column terms of `r`, each seen
    through `view(ref, dims)` (dims: which of `(B, N, T, S)` it has in full;
    see `config.ROW_DIMS`), None where absent."""
    pairs = (
        ("bias", cfg.bias_dims),
        ("mask", cfg.mask_dims),
        ("row_bias", ROW_DIMS),
        ("col_bias", COL_DIMS),
    )
    out = {}
    for name, dims in pairs:
        ref = getattr(r, name)
        out[name] = None if ref is None else view(ref, dims)
    return out


def _kernel(r: KernelInputs, *refs, cfg: KernelConfig, n_kv_tiles: int):
    kind = dbias_kind(cfg)
    refs = list(refs)
    if kind == "full":
        refs.pop(0)  # the aliased zeros input; written through the output ref
    dq_ref = refs.pop(0)  # [bq, G, H]
    dqr_ref = refs.pop(0) if cfg.use_qr else None  # [bq, G, Rp]
    db_q_ref = refs.pop(0) if kind == "full" else None  # [G, bq, Sp]
    rows_ref = refs.pop(0) if row_sums(cfg) else None  # [G, bq]
    dk_ref, dv_ref = refs.pop(0), refs.pop(0)  # [bk, H], [bk, Hv]
    db_kv_ref = refs.pop(0) if col_sums(cfg) else None  # [G, bk]
    dmod_refs = tuple(refs)  # [G, *leaf] per differentiable score-mod leaf
    bq, bk, groups = cfg.block_q, cfg.block_k, cfg.groups
    program, batch, kv_head = (pl.program_id(a) for a in range(3))

    @pl.when(program < n_kv_tiles)
    def _dkv():
        j = program
        kv = pl.ds(pl.multiple_of(j * bk, bk), bk)
        every = slice(None)
        rk = r._replace(
            key=View(r.key, (kv,)),  # [bk, H]
            value=View(r.value, (kv,)),
            kv_positions=_maybe(r.kv_positions, (kv,)),  # [bk]
            kv_segments=_maybe(r.kv_segments, (kv,)),
            # bias, mask, row and column terms: [G|1, Tp|1, bk|1]
            **_pairwise(r, cfg, lambda ref, d: View(ref, (every, every, kv if d[3] else every))),
        )
        dkv_tile(cfg, rk, (j, batch, kv_head), dk_ref, dv_ref, db_kv_ref)

    @pl.when(program >= n_kv_tiles)
    def _dq():
        i = program - n_kv_tiles
        qs = pl.ds(pl.multiple_of(i * bq, bq), bq)

        def head_body(g, carry):
            map_index = g if cfg.map_per_head else 0
            rq = r._replace(
                query=View(r.query, (qs, g)),  # [bq, H]
                d_out=View(r.d_out, (qs, g)),
                lse=View(r.lse, (g, qs)),  # [bq]
                delta=View(r.delta, (g, qs)),
                q_positions=_maybe(r.q_positions, (qs,)),
                q_segments=_maybe(r.q_segments, (qs,)),
                key_term=_maybe(r.key_term, (qs, g)),  # [bq, Rp]
                d_value_mass=_maybe(r.d_value_mass, (qs, g)),
                # bias, mask, row and column terms: [bq|1, Sp|1]
                **_pairwise(
                    r,
                    cfg,
                    lambda ref, d: View(ref, (g if d[1] else 0, qs if d[2] else slice(None))),
                ),
                tile_classes=View(r.tile_classes, (map_index,)),  # [nT, nS]
                row_bounds=View(r.row_bounds, (map_index,)),  # [4, nT]
            )
            dq_tile(
                with_triton_x3(cfg),
                rq,
                (i, batch, kv_head * groups + g),
                View(dq_ref, (slice(None), g)),
                _maybe(dqr_ref, (slice(None), g)),
                (_maybe(db_q_ref, (g,)), _maybe(rows_ref, (g,))),
                tuple(View(ref, (g,)) for ref in dmod_refs) if dmod_refs else None,
            )
            return carry

        lax.fori_loop(0, groups, head_body, 0)


def flash_dq_dkv(cfg: KernelConfig, ins: KernelInputs):
    """dq, dk and dv in one kernel (grid `(nS + nT, B, K)`).

    Args:
      cfg: the backward configuration (its tiling's block map in `ins`).
      ins: as for `triton_backward.flash_dq` / `flash_dkv`.

    Returns:
      `(dq, dqr, db_q, rows, dk, dv, cols, d_mod)`: the outputs of
      `flash_dq` (its score-mod partial sums last, as `d_mod`) and of
      `flash_dkv`, in the same shapes and dtypes.
    """
    # Both halves read the halved keys and values: the dq half's dots are
    # Triton's TF32x3 (`with_triton_x3`), the dk/dv half's take the 2 back
    # as the dq half does (`KernelConfig.qk_scale`, `kv_unscale`).
    cfg, ins = halve_kv(cfg, ins)
    b, padded_t, n, h = ins.query.shape
    _, padded_s, kh, hv = ins.value.shape
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.groups
    n_q_tiles, n_kv_tiles = ins.tile_classes.shape[-2:]
    map_heads = g if cfg.map_per_head else 1
    map_head = (lambda k_: k_) if cfg.map_per_head else (lambda k_: 0)
    kv_tile = lambda p: jnp.minimum(p, n_kv_tiles - 1)  # noqa: E731
    q_tile = lambda p: jnp.maximum(p - n_kv_tiles, 0)  # noqa: E731

    grp = lambda w: pl.BlockSpec((SQ, padded_t, g, w), lambda p, b_, k_: (b_, 0, k_, 0))  # noqa: E731
    keys = lambda w: pl.BlockSpec((SQ, padded_s, SQ, w), lambda p, b_, k_: (b_, 0, k_, 0))  # noqa: E731
    vec_g = pl.BlockSpec((SQ, g, padded_t), lambda p, b_, k_: (b_, k_, 0))
    per_row = lambda length: pl.BlockSpec((SQ, length), lambda p, b_, k_: (b_, 0))  # noqa: E731

    def full_block(dims):  # bias / mask [B|1, N|1, Tp|1, Sp|1]: one group's heads
        fb, fn, ft_, fs = dims
        return pl.BlockSpec(
            (SQ, g if fn else 1, padded_t if ft_ else 1, padded_s if fs else 1),
            lambda p, b_, k_: (b_ if fb else 0, k_ if fn else 0, 0, 0),
        )

    specs = KernelInputs(
        query=grp(h),
        key=keys(h),
        value=keys(hv),
        d_out=grp(hv),
        lse=vec_g,
        delta=vec_g,
        q_positions=per_row(padded_t) if cfg.use_pos else None,
        kv_positions=per_row(padded_s) if cfg.use_pos else None,
        q_segments=per_row(padded_t) if cfg.use_seg else None,
        kv_segments=per_row(padded_s) if cfg.use_seg else None,
        bias=full_block(cfg.bias_dims) if cfg.bias_dims else None,
        row_bias=full_block(ROW_DIMS) if cfg.row_col else None,
        col_bias=full_block(COL_DIMS) if cfg.row_col else None,
        mask=full_block(cfg.mask_dims) if cfg.mask_dims else None,
        key_term=grp(cfg.num_rel) if cfg.use_qr else None,
        d_value_mass=grp(cfg.num_rel) if cfg.use_pr else None,
        tile_classes=pl.BlockSpec(
            (SQ, map_heads, n_q_tiles, n_kv_tiles), lambda p, b_, k_: (b_, map_head(k_), 0, 0)
        ),
        row_bounds=pl.BlockSpec(
            (SQ, map_heads, 4, n_q_tiles), lambda p, b_, k_: (b_, map_head(k_), 0, 0)
        ),
        col_bounds=pl.BlockSpec(
            (SQ, map_heads, 4, n_kv_tiles), lambda p, b_, k_: (b_, map_head(k_), 0, 0)
        ),
        dropout_seed=pl.BlockSpec((2,), lambda p, b_, k_: (0,)) if cfg.use_dropout else None,
        mod_params=whole_specs(cfg),
        distance_tiles=tiles_spec(cfg, ins),
    )
    args = [only_specified(ins, specs)]
    in_specs = [specs]
    q_rows = lambda w: pl.BlockSpec((SQ, bq, g, w), lambda p, b_, k_: (b_, q_tile(p), k_, 0))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((b, padded_t, n, h), ins.query.dtype)]
    out_specs = [q_rows(h)]
    if cfg.use_qr:
        out_shape.append(jax.ShapeDtypeStruct((b, padded_t, n, cfg.num_rel), jnp.float32))
        out_specs.append(q_rows(cfg.num_rel))
    kind = dbias_kind(cfg)
    aliases = query_bias_grad_outputs(
        cfg, (b, n, padded_t, padded_s), lambda p, b_, k_: (b_, k_, q_tile(p)), g, args,
        in_specs, out_shape, out_specs,
    )  # fmt: skip
    n_dq_outs = len(out_shape)
    kv_rows = lambda w: pl.BlockSpec((SQ, bk, SQ, w), lambda p, b_, k_: (b_, kv_tile(p), k_, 0))  # noqa: E731
    out_shape += [
        jax.ShapeDtypeStruct((b, padded_s, kh, h), ins.key.dtype),
        jax.ShapeDtypeStruct((b, padded_s, kh, hv), ins.value.dtype),
    ]
    out_specs += [kv_rows(h), kv_rows(hv)]
    if col_sums(cfg):
        out_shape.append(jax.ShapeDtypeStruct((b, n, padded_s), jnp.float32))
        out_specs.append(pl.BlockSpec((SQ, g, bk), lambda p, b_, k_: (b_, k_, kv_tile(p))))
    n_kv_outs = len(out_shape) - n_dq_outs
    for shape in mod_grad_shapes(cfg):  # per-program partial sums [nT, B, N, *leaf]
        out_shape.append(jax.ShapeDtypeStruct((n_q_tiles, b, n, *shape), jnp.float32))
        out_specs.append(
            pl.BlockSpec(
                (SQ, SQ, g, *shape),
                lambda p, b_, k_, rank=len(shape): (q_tile(p), b_, k_) + (0,) * rank,
            )
        )
    outs = list(
        kernel_call(
            functools.partial(_kernel, cfg=cfg, n_kv_tiles=n_kv_tiles),
            cfg,
            "jattn_flash_bwd_fused",
            grid=(n_kv_tiles + n_q_tiles, b, kh),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            input_output_aliases=aliases,
        )(*args)
    )
    dq_outs, kv_outs = outs[:n_dq_outs], outs[n_dq_outs : n_dq_outs + n_kv_outs]
    d_mod = tuple(outs[n_dq_outs + n_kv_outs :])
    dq = dq_outs.pop(0)
    dqr = dq_outs.pop(0) if cfg.use_qr else None
    db_q = dq_outs.pop(0) if kind == "full" else None
    rows = dq_outs.pop(0) if row_sums(cfg) else None
    dk, dv = kv_outs[0], kv_outs[1]
    cols = kv_outs[2] if col_sums(cfg) else None
    return dq, dqr, db_q, rows, dk, dv, cols, d_mod
