"""The backward flash kernels for TPU (Pallas Mosaic): dq and dk/dv.

The TPU-style counterparts of `triton_backward` (same recomputation from the
forward's log-sum-exp, same outputs and layouts), built from the layout and
tile helpers of `mosaic_forward`: the other sequence's tiles are the innermost
grid axis, accumulators live in VMEM scratch, and the scalar-prefetched block
map picks each tile's body and clamps the DMAs of skipped tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jattn.attention.pallas import score_mod_tiles, tile_dot, tile_math
from jattn.attention.pallas.config import (
    COL_DIMS,
    ROW_DIMS,
    SQ,
    KernelConfig,
    KernelInputs,
    col_sums,
    dbias_kind,
    mod_grad_shapes,
    row_sums,
)
from jattn.attention.pallas.mosaic_forward import (
    Maps,
    add_column,
    bias_spec,
    dropout_tile,
    heads_major,
    mod_specs,
    mosaic_call,
    q_row_spec,
    q_tile_specs,
    ref_scores,
    tile_adder,
    tile_mod,
    tiles_spec,
    tpu_inputs,
    when_visible,
)

Array = jax.Array


# --------------------------------------------------------------------------------------
# dq: grid (B, N, nT, nS), as the forward.


def _dq_kernel(classes_ref, bounds_ref, seed_ref, r, *refs, cfg: KernelConfig, maps: Maps):
    kind = dbias_kind(cfg)
    rows = row_sums(cfg)
    refs = list(refs)
    dq_ref = refs.pop(0)
    dqr_ref = refs.pop(0) if cfg.use_qr else None
    db_ref = refs.pop(0) if kind == "full" else None
    rows_ref = refs.pop(0) if rows else None
    n_mod = len(mod_grad_shapes(cfg))
    dmod_refs = [refs.pop(0) for _ in range(n_mod)]
    dq_sc = refs.pop(0)
    dqr_sc = refs.pop(0) if cfg.use_qr else None
    rows_sc = refs.pop(0) if rows else None
    dmod_sc = refs[:n_mod]
    b, h, i, j = (pl.program_id(a) for a in range(4))

    @pl.when(j == 0)
    def _init():
        for sc in (dq_sc, dqr_sc, rows_sc, *dmod_sc):
            if sc is not None:
                sc[...] = jnp.zeros(sc.shape, jnp.float32)

    def body(partial, right):
        k = r.key[...]
        v = r.value[...]
        do = r.d_out[...]
        mod = tile_adder(cfg, r) or tile_mod(cfg, r, b, h)
        s, dpr_t, rel, raw = ref_scores(
            cfg, r, maps, j, partial, right, need_rel=cfg.use_qr, mod=mod
        )
        p = tile_math.recomputed_probs(s, r.lse[...])  # [bq, bk]; EMPTY_LSE rows: p = 0
        z = dropout_tile(cfg, seed_ref, b, h, i, j)
        ds = tile_math.score_grads(p, do, v, dpr_t, z, r.delta[...])  # [bq, bk]
        if cfg.score_mod is not None:  # through the score mod: to the raw logits and params
            ds, d_leaves = score_mod_tiles.tile_backward(cfg.score_mod, mod, raw, ds, cfg.mod_grad)
            if n_mod:
                new = [d for d in d_leaves if d is not None]
                for sc, d in zip(dmod_sc, new, strict=True):
                    sc[...] += d
        dq_sc[...] += tile_dot.dot(ds.astype(k.dtype), k, (1, 0))
        if cfg.use_qr:
            if partial:
                dqr_sc[...] = tile_math.near_scatter(*rel, ds, dqr_sc[...])
            else:
                far = cfg.far_right if right else 0
                dqr_sc[...] = add_column(dqr_sc[...], far, jnp.sum(ds, axis=1, keepdims=True))
        if kind == "full":
            db_ref[...] = ds
        if rows:
            rows_sc[...] += jnp.sum(ds, axis=1, keepdims=True)

    tile_class = maps.tile_class(classes_ref, b, h, i, j)
    when_visible(tile_class, body)
    if kind == "full":  # every (i, j) block of the gradient is written once

        @pl.when(tile_class == tile_math.SKIP)
        def _zero():
            db_ref[...] = jnp.zeros(db_ref.shape, db_ref.dtype)

    @pl.when(j == maps.kv_tiles - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * cfg.scale).astype(dq_ref.dtype)
        if cfg.use_qr:
            dqr_ref[...] = dqr_sc[...]
        if rows:
            rows_ref[...] = rows_sc[...]
        for ref, sc in zip(dmod_refs, dmod_sc, strict=True):
            ref[...] = sc[...]


def flash_dq(cfg: KernelConfig, ins: KernelInputs):
    """dq kernel; arguments and results as `triton_backward.flash_dq` (the
    row sums as `[B, N, Tp]`, the params partial sums as `[nT, B, N, *leaf]`
    too)."""
    x = tpu_inputs(ins)
    b, n, padded_t, hdim = x.query.shape
    hv = x.value.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    maps = Maps(cfg, ins.tile_classes, ins.row_bounds, ins.dropout_seed)
    specs = q_tile_specs(cfg, x, maps)
    specs = specs._replace(
        d_out=q_row_spec(bq, hv),
        lse=q_row_spec(bq, 1),
        delta=q_row_spec(bq, 1),
        d_value_mass=q_row_spec(bq, cfg.num_rel) if cfg.use_pr else None,
    )
    out_shape = [jax.ShapeDtypeStruct((b, n, padded_t, hdim), x.query.dtype)]
    out_specs = [q_row_spec(bq, hdim)]
    scratch = [pltpu.VMEM((bq, hdim), jnp.float32)]
    if cfg.use_qr:
        out_shape.append(jax.ShapeDtypeStruct((b, n, padded_t, cfg.num_rel), jnp.float32))
        out_specs.append(q_row_spec(bq, cfg.num_rel))
        scratch.append(pltpu.VMEM((bq, cfg.num_rel), jnp.float32))
    kind = dbias_kind(cfg)
    if kind == "full":
        padded_s = maps.kv_tiles * bk
        out_shape.append(jax.ShapeDtypeStruct((b, n, padded_t, padded_s), jnp.float32))
        out_specs.append(pl.BlockSpec((SQ, SQ, bq, bk), lambda b_, h, i, j, *_: (b_, h, i, j)))
    if row_sums(cfg):
        out_shape.append(jax.ShapeDtypeStruct((b, n, padded_t, 1), jnp.float32))
        out_specs.append(q_row_spec(bq, 1))
        scratch.append(pltpu.VMEM((bq, 1), jnp.float32))
    grad_shapes = mod_grad_shapes(cfg)
    for shape in grad_shapes:  # per-program partial sums, reduced by the caller
        out_shape.append(jax.ShapeDtypeStruct((b, n, padded_t // bq, *shape), jnp.float32))
        out_specs.append(
            pl.BlockSpec(
                (SQ, SQ, SQ, *shape),
                lambda b_, h, i, j, *_, rank=len(shape): (b_, h, i) + (0,) * rank,
            )
        )
    scratch += [pltpu.VMEM(shape, jnp.float32) for shape in grad_shapes]
    outs = list(
        mosaic_call(
            _dq_kernel,
            cfg,
            "jattn_flash_dq_tpu",
            maps=maps,
            grid=(b, n, padded_t // bq, maps.kv_tiles),
            in_specs=specs,
            inputs=x,
            out_specs=out_specs,
            out_shape=out_shape,
            scratch=scratch,
            semantics=("parallel", "parallel", "parallel", "arbitrary"),
        )
    )
    dq = heads_major(outs.pop(0))
    dqr = heads_major(outs.pop(0)) if cfg.use_qr else None
    dbias = outs.pop(0) if kind == "full" else None
    rows = outs.pop(0)[..., 0] if row_sums(cfg) else None
    d_mod = tuple(jnp.moveaxis(x, 2, 0) for x in outs)  # [nT, B, N, *leaf]
    return dq, dqr, dbias, rows, d_mod


# --------------------------------------------------------------------------------------
# dk/dv: grid (B, K, nS, G, nT); the G query heads of a kv head and their query
# tiles are the two inner ("arbitrary") axes, so GQA/MQA gradients are summed in
# VMEM scratch, never through an `[B, S, N, H]` intermediate.


def _dkv_kernel(classes_ref, bounds_ref, seed_ref, r, dk_ref, dv_ref, *refs, cfg: KernelConfig,
                maps: Maps):  # fmt: skip
    cols = col_sums(cfg)
    refs = list(refs)
    db_ref = refs.pop(0) if cols else None
    dk_sc, dv_sc = refs.pop(0), refs.pop(0)
    db_sc = refs.pop(0) if cols else None
    b, kh, j, g, i = (pl.program_id(a) for a in range(5))
    h = kh * cfg.groups + g
    last_q_tile = maps.q_tiles - 1

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    if cols:

        @pl.when(i == 0)
        def _init_db():
            db_sc[...] = jnp.zeros(db_sc.shape, jnp.float32)

    def body(partial, right):
        q = r.query[...]
        v = r.value[...]
        do = r.d_out[...]
        mod = tile_adder(cfg, r) or tile_mod(cfg, r, b, h)
        s, dpr_t, _, raw = ref_scores(cfg, r, maps, j, partial, right, mod=mod)
        p = tile_math.recomputed_probs(s, r.lse[...])  # [bq, bk]
        z = dropout_tile(cfg, seed_ref, b, h, i, j)
        p_kept = p if z is None else p * z
        dv_sc[...] += tile_dot.dot(p_kept.astype(do.dtype), do, (0, 0))  # [bk, Hv]
        ds = tile_math.score_grads(p, do, v, dpr_t, z, r.delta[...])  # [bq, bk]
        if cfg.score_mod is not None:  # to the raw logits through the score mod
            ds, _ = score_mod_tiles.tile_backward(cfg.score_mod, mod, raw, ds, with_params=False)
        dk_sc[...] += tile_dot.dot(ds.astype(q.dtype), q, (0, 0))  # [bk, H]
        if cols:
            db_sc[...] += jnp.sum(ds, axis=0, keepdims=True)

    when_visible(maps.tile_class(classes_ref, b, h, i, j), body)

    if cols:

        @pl.when(i == last_q_tile)
        def _finish_db():
            db_ref[...] = db_sc[...]

    @pl.when((g == cfg.groups - 1) & (i == last_q_tile))
    def _finish():
        dk_ref[...] = (dk_sc[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def backward_input_specs(cfg: KernelConfig, dims, rows, bias, **more) -> KernelInputs:
    """The input blocks of a backward kernel, given how it maps to its grid
    `rows` = (a query row `q_row(width)`, the key rows `kv_rows(width)`, a
    query column, a key row) and a bias, mask or row or column term (`bias(dims)`): what the
    dk/dv and the distance-tiles kernels share (`more`: the inputs only one
    of them reads). `dims`: the head dims (query/key, value)."""
    hdim, hv = dims
    q_row, kv_rows, q_col, kv_row = rows
    return KernelInputs(
        query=q_row(hdim),
        key=kv_rows(hdim),
        value=kv_rows(hv),
        d_out=q_row(hv),
        lse=q_row(1),
        delta=q_row(1),
        q_positions=q_col if cfg.use_pos else None,
        kv_positions=kv_row if cfg.use_pos else None,
        q_segments=q_col if cfg.use_seg else None,
        kv_segments=kv_row if cfg.use_seg else None,
        bias=bias(cfg.bias_dims) if cfg.bias_dims else None,
        row_bias=bias(ROW_DIMS) if cfg.row_col else None,
        col_bias=bias(COL_DIMS) if cfg.row_col else None,
        mask=bias(cfg.mask_dims) if cfg.mask_dims else None,
        key_term=q_row(cfg.num_rel) if cfg.use_qr else None,
        d_value_mass=q_row(cfg.num_rel) if cfg.use_pr else None,
        **more,
    )


def flash_dkv(cfg: KernelConfig, ins: KernelInputs) -> tuple[Array, Array, Array | None]:
    """dk/dv kernel; arguments and results as `triton_backward.flash_dkv`."""
    x = tpu_inputs(ins)
    b, n, padded_t, hdim = x.query.shape
    _, kh, padded_s, hv = x.value.shape
    bq, bk, grp = cfg.block_q, cfg.block_k, cfg.groups
    maps = Maps(cfg, ins.tile_classes, ins.col_bounds, ins.dropout_seed)

    def head(b_, k_, j, g, i, *_):
        return k_ * grp + g

    def q_tile(b_, k_, j, g, i, classes, bounds, seed):
        return maps.clamp(bounds, b_, k_ * grp + g, j, i)

    def k_tile(b_, k_, j, g, i, *_):
        return j

    def q_row(w):
        return pl.BlockSpec((SQ, SQ, bq, w), lambda *a: (a[0], head(*a), q_tile(*a), 0))

    def kv_rows(w):
        return pl.BlockSpec((SQ, SQ, bk, w), lambda b_, k_, j, *_: (b_, k_, j, 0))

    q_col = pl.BlockSpec((SQ, bq, 1), lambda *a: (a[0], q_tile(*a), 0))
    kv_row = pl.BlockSpec((SQ, 1, bk), lambda b_, k_, j, *_: (b_, 0, j))
    specs = backward_input_specs(
        cfg,
        (hdim, hv),
        (q_row, kv_rows, q_col, kv_row),
        lambda dims: bias_spec(dims, bq, bk, head, q_tile, k_tile),
        mod_params=mod_specs(cfg),
        distance_tiles=tiles_spec(cfg, head, q_tile, k_tile),
    )
    out_shape = [
        jax.ShapeDtypeStruct((b, kh, padded_s, hdim), x.key.dtype),
        jax.ShapeDtypeStruct((b, kh, padded_s, hv), x.value.dtype),
    ]
    out_specs = [kv_rows(hdim), kv_rows(hv)]
    scratch = [pltpu.VMEM((bk, hdim), jnp.float32), pltpu.VMEM((bk, hv), jnp.float32)]
    cols = col_sums(cfg)
    if cols:
        out_shape.append(jax.ShapeDtypeStruct((b, n, 1, padded_s), jnp.float32))
        out_specs.append(pl.BlockSpec((SQ, SQ, 1, bk), lambda *a: (a[0], head(*a), 0, a[2])))
        scratch.append(pltpu.VMEM((1, bk), jnp.float32))
    outs = mosaic_call(
        _dkv_kernel,
        cfg,
        "jattn_flash_dkv_tpu",
        maps=maps,
        grid=(b, kh, maps.kv_tiles, grp, padded_t // bq),
        in_specs=specs,
        inputs=x,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch=scratch,
        semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
    )
    dk, dv = heads_major(outs[0]), heads_major(outs[1])
    return dk, dv, outs[2][:, :, 0, :] if cols else None
