"""The backward Pallas kernels of flash attention: dq and dk/dv.

Both recompute the probabilities of a tile from the forward's log-sum-exp,
`P = exp(s - lse)`, and form `dS = P * (dP - delta)` with
`dP = (dO·v + dpr[t, r]) * Z` (the second term only with a Shaw value table;
Z the dropout multipliers of the tile, rebuilt from the seed, 1 without
dropout) and `delta = Σ_s P dP = dO·o + pr·dpr`, computed outside from the
forward's (dropped) outputs; dv sums `(P * Z)ᵀ dO`. The dq kernel
also returns the gradient of the key-term table `qr` (dS summed per relative
id), of a bias with a key axis and dS summed over keys (the gradient of the
row term, and of a bias per query row); the dk/dv kernel returns dS summed
over queries (the column term's and a per-key bias's) and loops over the G
query heads of its kv head, so GQA/MQA gradients never pass through an
`[B, S, N, H]` intermediate. Layout and BlockSpecs as in `triton_forward`.

The dk/dv kernel works on transposed tiles, `Sᵀ = k·qᵀ` `[bk, bq]` (as the
Triton tutorial's and tokamax's backward do): then `dV += Pᵀ·dO`,
`dPᵀ = v·dOᵀ` and `dK += dSᵀ·q` are dots of operands in the layout they
are loaded in (no transposed operand for the compiler to shuffle through
shared memory). What is indexed `[q, k]` (bias, mask and distance tiles,
read as `[bq, bk]`) is transposed once per tile, and the positions,
segments, dropout indices and Shaw columns are laid out the other way
round (`tile_math.tile_scores(transposed=True)`). The dq kernel keeps
`S = q·kᵀ`: its `dQ += dS·k` is the untransposed dot. `dkv_tile` also
hands each tile's dSᵀ to an optional sink (`KeyTileGrad`): the atomic
backward (`atomic_backward`) adds dq from it instead of running the dq kernel.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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
    col_sums,
    dbias_kind,
    halve_kv,
    mod_grad_shapes,
    only_specified,
    row_sums,
    with_triton_x3,
)
from jattn.attention.pallas.triton_forward import (
    bias_spec_kv,
    col_reader,
    dropout_tile,
    kernel_call,
    kv_valid_mask,
    load_bias_kv,
    mod_leaves,
    q_tile_scorer,
    q_tile_specs,
    row_spec,
    tile_loop,
    tile_mod,
    tiles_spec,
    whole_specs,
)

Array = jax.Array


def _dq_kernel(r, *refs, cfg: KernelConfig):
    kind = dbias_kind(cfg)
    refs = list(refs)
    if kind == "full":
        refs.pop(0)  # the aliased zeros input; written through the output ref
    dq_ref = refs.pop(0)
    dqr_ref = refs.pop(0) if cfg.use_qr else None
    db_refs = (
        refs.pop(0) if kind == "full" else None,
        refs.pop(0) if row_sums(cfg) else None,
    )
    dmod_refs = tuple(refs) if cfg.mod_grad else None
    ids = tuple(pl.program_id(a) for a in range(3))
    dq_tile(cfg, r, ids, dq_ref, dqr_ref, db_refs, dmod_refs)


def dq_tile(
    cfg: KernelConfig, r: KernelInputs, ids, dq_ref, dqr_ref, db_refs, dmod_refs=None
) -> None:
    """dq (and dqr, the dS tiles of a bias of kind "full", dS summed over keys
    (`row_sums`), and this program's partial sum of the score mod's params
    gradient) of one query tile of one head, `ids = (query tile, batch row,
    head)`; `db_refs = (full, rows)`, each None where not computed. `r` and
    the output refs are shaped like the dq kernel's blocks (refs, or `View`s
    of larger blocks in the fused kernel)."""
    kind = dbias_kind(cfg)
    db_ref, rows_ref = db_refs
    rows = row_sums(cfg)
    bq = cfg.block_q
    i = ids[0]
    do = r.d_out[...]  # [bq, Hv]
    lse, delta = r.lse[...], r.delta[...]  # [bq]
    score = q_tile_scorer(cfg, r, ids)
    grad_shapes = mod_grad_shapes(cfg)
    n_mod = len(grad_shapes)

    def step(j, partial, right, carry):
        if n_mod:
            carry, dmods = carry[:-n_mod], carry[-n_mod:]
        dq_acc, *rest = carry
        s, dpr_t, rel, k, v, z, mod_raw = score(j, partial, right)
        p = tile_math.recomputed_probs(s, lse[:, None])  # [bq, bk]; base-2 logits and lse
        ds = tile_math.score_grads(
            p, do, v, dpr_t, z, delta[:, None], cfg.precision, unscale=cfg.kv_unscale
        )  # [bq, bk]
        if mod_raw is not None:  # through the score mod: to the raw logits and params
            ds, d_leaves = score_mod_tiles.tile_backward(cfg.score_mod, *mod_raw, ds, cfg.mod_grad)
            if n_mod:
                new = [d for d in d_leaves if d is not None]
                dmods = tuple(a + d for a, d in zip(dmods, new, strict=True))
        dq_acc = dq_acc + tile_dot.dot(ds.astype(k.dtype), k, (1, 0), cfg.precision)
        out = [dq_acc]
        if cfg.use_qr:
            acc_r, w_left, w_right = rest[:3]
            rest = rest[3:]
            if partial:
                acc_r = tile_math.near_scatter(*rel, ds, acc_r)
            else:
                ds_sum = jnp.sum(ds, axis=1)
                w_left = w_left + jnp.where(right, 0.0, ds_sum)
                w_right = w_right + jnp.where(right, ds_sum, 0.0)
            out += [acc_r, w_left, w_right]
        if kind == "full":
            db_ref[:, pl.ds(pl.multiple_of(j * cfg.block_k, cfg.block_k), cfg.block_k)] = ds
        if rows:
            out.append(rest[0] + jnp.sum(ds, axis=1))
        return tuple(out) + (dmods if n_mod else ())

    zeros = jnp.zeros((bq,), jnp.float32)
    carry = (jnp.zeros((bq, dq_ref.shape[-1]), jnp.float32),)
    if cfg.use_qr:
        carry += (jnp.zeros((bq, cfg.num_rel), jnp.float32), zeros, zeros)
    if rows:
        carry += (zeros,)
    carry += tuple(jnp.zeros(shape, jnp.float32) for shape in grad_shapes)
    bounds = tuple(r.row_bounds[c, i] for c in range(4))
    carry = tile_loop(bounds, lambda j: r.tile_classes[i, j], step, carry)
    if n_mod:
        for ref, acc in zip(dmod_refs, carry[-n_mod:], strict=True):
            ref[...] = acc
        carry = carry[:-n_mod]
    dq_ref[...] = (carry[0] * cfg.qk_scale).astype(dq_ref.dtype)  # keys halved: x2 (halve_kv)
    if cfg.use_qr:
        acc_r, w_left, w_right = carry[1:4]
        dqr_ref[...] = tile_math.add_far_columns(acc_r, w_left, w_right, cfg.far_right)
    if rows:
        rows_ref[...] = carry[-1]


def query_bias_grad_outputs(
    cfg: KernelConfig, shape, tile, heads, args, in_specs, out_shape, out_specs
) -> dict[int, int]:
    """Appends the outputs of the gradients taken by query tile (a bias of
    kind "full" of `dbias_kind`, dS summed over keys, `row_sums`) to a dq
    kernel's call, in place; returns its input-output aliases.

    Args:
      cfg: the backward's config.
      shape: `(B, N, Tp, Sp)`, the full gradient's shape.
      tile: `index_map(*program) -> (b, head block, query tile)` of the kernel's grid.
      heads: the head block's size (`pl.Squeezed()` for one head, G for a kv head's group).
      args, in_specs, out_shape, out_specs: the call's lists so far.

    "full" is `[B, N, Tp, Sp]`, written tile by tile into zeros passed in and
    aliased to it (tiles the kernel never visits stay 0); the row sums (the
    gradient of the row term and of a bias broadcast over keys) are
    `[B, N, Tp]`, after it.
    """
    bq = cfg.block_q
    aliases = {}
    if dbias_kind(cfg) == "full":
        spec = pl.BlockSpec((SQ, heads, bq, shape[3]), lambda *p: (*tile(*p), 0))
        zeros = jnp.zeros(shape, jnp.float32)
        aliases = {len(jax.tree_util.tree_leaves(args[0])): len(out_shape)}
        args.append(zeros)
        in_specs.append(spec)
        out_shape.append(jax.ShapeDtypeStruct(zeros.shape, jnp.float32))
        out_specs.append(spec)
    if row_sums(cfg):
        out_shape.append(jax.ShapeDtypeStruct(shape[:3], jnp.float32))
        out_specs.append(pl.BlockSpec((SQ, heads, bq), tile))
    return aliases


def flash_dq(cfg: KernelConfig, ins: KernelInputs):
    """dq kernel (grid over query tiles).

    Args:
      ins: the forward inputs (bwd tiling's bmap/bounds) plus do `[B, Tp, N, Hv]`
        (query dtype), lse and delta `[B, N, Tp]` float32, dpr `[B, Tp, N, Rp]`
        float32 or None.

    Returns:
      dq `[B, Tp, N, H]` (query dtype), dqr `[B, Tp, N, Rp]` float32 or None,
      the dS tiles of a bias of kind "full", `[B, N, Tp, Sp]` float32 or
      None, dS summed over keys (`row_sums`), `[B, N, Tp]` float32 or None,
      and a tuple of the score mod's params gradient partial sums, float32
      `[nT, B, N, *leaf]` per differentiable leaf (empty without
      `cfg.mod_grad`).
    """
    cfg, ins = halve_kv(cfg, ins)  # no TF32 head of a finite float32 key overflows
    cfg = with_triton_x3(cfg)  # spill-free at float32, head dim 128 (docs/gpu.md)
    b, padded_t, n, h = ins.query.shape
    hv, padded_s = ins.value.shape[-1], ins.key.shape[1]
    bq = cfg.block_q
    specs = q_tile_specs(cfg, ins, ins.tile_classes.shape[-1])
    per_query = pl.BlockSpec((SQ, SQ, bq), lambda i, b_, h_: (b_, h_, i))
    specs = specs._replace(
        d_out=row_spec(bq, hv),
        lse=per_query,
        delta=per_query,
        d_value_mass=row_spec(bq, cfg.num_rel) if cfg.use_pr else None,
        mod_params=whole_specs(cfg),
    )
    args = [only_specified(ins, specs)]
    in_specs = [specs]
    out_shape = [jax.ShapeDtypeStruct((b, padded_t, n, h), ins.query.dtype)]
    out_specs = [row_spec(bq, h)]
    if cfg.use_qr:
        out_shape.append(jax.ShapeDtypeStruct((b, padded_t, n, cfg.num_rel), jnp.float32))
        out_specs.append(row_spec(bq, cfg.num_rel))
    kind = dbias_kind(cfg)
    aliases = query_bias_grad_outputs(
        cfg, (b, n, padded_t, padded_s), lambda i, b_, h_: (b_, h_, i), SQ, args, in_specs,
        out_shape, out_specs,
    )  # fmt: skip
    for shape in mod_grad_shapes(cfg):  # per-program partial sums, reduced by the caller
        out_shape.append(jax.ShapeDtypeStruct((padded_t // bq, b, n, *shape), jnp.float32))
        out_specs.append(mod_partial_spec(shape))
    outs = list(
        kernel_call(
            functools.partial(_dq_kernel, cfg=cfg),
            cfg,
            "jattn_flash_dq",
            grid=(padded_t // bq, b, n),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            input_output_aliases=aliases,
        )(*args)
    )
    dq = outs.pop(0)
    dqr = outs.pop(0) if cfg.use_qr else None
    dbias = outs.pop(0) if kind == "full" else None
    rows = outs.pop(0) if row_sums(cfg) else None
    return dq, dqr, dbias, rows, tuple(outs)


def mod_partial_spec(shape: tuple[int, ...]):
    """One program's block `[*shape]` of a params partial sum `[nT, B, N, *shape]`."""
    return pl.BlockSpec((SQ, SQ, SQ, *shape), lambda i, b_, h_: (i, b_, h_) + (0,) * len(shape))


def _dkv_kernel(r, dk_ref, dv_ref, *db_ref, cfg: KernelConfig):
    ids = tuple(pl.program_id(a) for a in range(3))
    dkv_tile(cfg, r, ids, dk_ref, dv_ref, db_ref[0] if db_ref else None)


class KeyTileGrad(NamedTuple):
    """What the dk/dv tile code hands a `dkv_tile` sink for each visited
    tile: the gradient of its logits, transposed, and what pulls it back to
    the query side (`atomic_backward` adds dq from it)."""

    g: Array  # int32 scalar: the query head within the kv head's group
    q_rows: Any  # `pl.ds` of the tile's query rows in the padded query axis
    partial: bool  # a PARTIAL tile (else FULL_*, one relative id)
    right: Array  # bool scalar: a FULL tile's relative id is the far right one
    ds: Array  # float32 dSᵀ [bk, bq], w.r.t. the raw logits (score mod pulled back)
    ds_low: Array  # dSᵀ in the key dtype (the dots' operand)
    key: Array  # [bk, H]
    rel: tuple | None  # a PARTIAL tile's `(rtᵀ [bk, bq], lo, hi)` relative ids (Shaw), or None
    d_leaves: tuple | None  # the score mod's params gradient of the tile, or None


def _transposed(x):
    """`[bq|1, bk|1]` -> `[bk|1, bq|1]`, or None."""
    return None if x is None else x.T


def dkv_tile(cfg: KernelConfig, r: KernelInputs, ids, dk_ref, dv_ref, db_ref, sink=None) -> None:
    """dk and dv (and dS summed over queries, `col_sums`, into `db_ref`) of
    one key tile of one kv head, summed over its G query heads; `ids = (key
    tile, batch row, kv head)`; `r` and the output refs shaped like the dk/dv
    kernel's blocks. Every tile is transposed, `[bk, bq]` (module docstring).

    `sink`: None, or what also takes each visited tile's dS to the query
    side (`atomic_backward`): `sink.init()` gives a carry per query head,
    `sink.step(KeyTileGrad, carry)` returns it updated, `sink.finish(g,
    carry)` ends head g. With a sink the score mod's params gradient of
    each tile is computed for it (`KeyTileGrad.d_leaves`)."""
    cols = col_sums(cfg)
    bq, bk = cfg.block_q, cfg.block_k
    j, batch, kv_head = ids
    k = r.key[...]  # [bk, H]
    v = r.value[...]  # [bk, Hv]
    kv_pos = r.kv_positions[...] if cfg.use_pos else None  # [bk]
    kv_pos_col = None if kv_pos is None else kv_pos[:, None]  # [bk, 1]
    kv_seg = r.kv_segments[...] if cfg.use_seg else None
    kv_valid = kv_valid_mask(cfg, j, bk, r.tile_classes.shape[-1] * bk)
    leaves = mod_leaves(cfg, r)
    with_mod = cfg.score_mod is not None
    with_params = sink is not None and cfg.mod_grad

    def group_body(g, carry):
        map_index = g if cfg.map_per_head else 0  # g's head in the block map
        head = kv_head * cfg.groups + g
        col = _transposed(load_bias_kv(r.col_bias, COL_DIMS, g, 0, bq))  # [bk, 1] or None

        def step(i, partial, right, c):
            dk_acc, dv_acc, db, extra = c
            qs = pl.ds(pl.multiple_of(i * bq, bq), bq)
            q = r.query[qs, g, :]  # [bq, H]
            do = r.d_out[qs, g, :]  # [bq, Hv]
            lse, delta = r.lse[g, qs], r.delta[g, qs]  # [bq]
            qr_col = col_reader(r.key_term, qs, g)
            dpr_col = col_reader(r.d_value_mass, qs, g)
            q_pos = r.q_positions[qs] if cfg.use_pos and (partial or with_mod) else None
            q_pos_row = None if q_pos is None else q_pos[None, :]  # [1, bq]
            mod = tile_mod(cfg, leaves, batch, head, q_pos_row, kv_pos_col)  # on [bk, bq]
            if cfg.distance_tiles:  # additive: dS passes through unchanged
                mod = distance_tiles.adder(
                    r.distance_tiles, head, i, j, cfg.distance_tiles, bq, bk, transposed=True
                )
            vis = None
            if partial:
                q_seg = r.q_segments[qs] if cfg.use_seg else None
                vis = cfg.tile_visibility(q_pos, kv_pos, q_seg, kv_seg)
            s, dpr_t, rel, raw = tile_math.tile_scores(
                q,
                k,
                scale=cfg.qk_scale,
                vis=vis,
                kv_valid=kv_valid if partial else None,
                bias=(
                    _transposed(load_bias_kv(r.bias, cfg.bias_dims, g, i, bq)),
                    _transposed(load_bias_kv(r.row_bias, ROW_DIMS, g, i, bq)),  # [1, bq]
                    col,
                ),
                mask=_transposed(load_bias_kv(r.mask, cfg.mask_dims, g, i, bq))
                if partial
                else None,
                shaw=tile_math.ShawColumns(
                    max_distance=cfg.max_distance,
                    qr_col=qr_col,
                    dpr_col=dpr_col,
                    far_id=jnp.where(right, cfg.far_right, 0),
                ),
                score_mod=mod,
                precision=cfg.precision,
                transposed=True,
            )  # Sᵀ [bk, bq]
            p = tile_math.recomputed_probs(s, lse[None, :])  # Pᵀ [bk, bq]
            z = dropout_tile(cfg, r.dropout_seed, batch, head, i * bq, j * bk, transposed=True)
            p_kept = p if z is None else p * z
            dv_acc = dv_acc + tile_dot.dot(p_kept.astype(do.dtype), do, (1, 0), cfg.precision)
            ds = tile_math.score_grads(  # transposed, unscaled (halve_kv)
                p, do, v, dpr_t, z, delta[None, :], cfg.precision, True, cfg.kv_unscale
            )  # dSᵀ [bk, bq]
            d_leaves = None
            if cfg.score_mod is not None:  # to the raw logits through the score mod
                ds, d_leaves = score_mod_tiles.tile_backward(
                    cfg.score_mod, mod, raw, ds, with_params=with_params
                )
            ds_low = ds.astype(q.dtype)
            dk_acc = dk_acc + tile_dot.dot(ds_low, q, (1, 0), cfg.precision)  # [bk, H]
            if cols:
                db = db + jnp.sum(ds, axis=1)
            if sink is not None:
                tile = KeyTileGrad(g, qs, partial, right, ds, ds_low, k, rel, d_leaves)
                extra = sink.step(tile, extra)
            return dk_acc, dv_acc, db, extra

        bounds = tuple(r.col_bounds[map_index, c, j] for c in range(4))
        dk_acc, dv_acc = carry
        dk_acc, dv_acc, db, extra = tile_loop(
            bounds,
            lambda i: r.tile_classes[map_index, i, j],
            step,
            (dk_acc, dv_acc, jnp.zeros((bk,), jnp.float32), () if sink is None else sink.init()),
        )
        if cols:
            db_ref[g, :] = db
        if sink is not None:
            sink.finish(g, extra)
        return dk_acc, dv_acc

    init = (
        jnp.zeros((bk, dk_ref.shape[-1]), jnp.float32),
        jnp.zeros((bk, dv_ref.shape[-1]), jnp.float32),
    )
    dk_acc, dv_acc = lax.fori_loop(0, cfg.groups, group_body, init)
    dk_ref[...] = (dk_acc * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc.astype(dv_ref.dtype)


def dkv_specs(cfg: KernelConfig, ins: KernelInputs) -> KernelInputs:
    """The dk/dv kernel's input BlockSpecs (grid `(key tiles, B, K)`): a key
    tile of one kv head, and every query of its G query heads."""
    padded_t, h = ins.query.shape[1], ins.query.shape[-1]
    hv = ins.value.shape[-1]
    bk, g = cfg.block_k, cfg.groups
    n_q_tiles, n_kv_tiles = ins.tile_classes.shape[-2:]
    map_heads = g if cfg.map_per_head else 1
    grp = lambda w: pl.BlockSpec((SQ, padded_t, g, w), lambda j, b_, k_: (b_, 0, k_, 0))
    map_head = (lambda k_: k_) if cfg.map_per_head else (lambda k_: 0)
    all_queries = pl.BlockSpec((SQ, padded_t), lambda j, b_, k_: (b_, 0))
    vec_g = pl.BlockSpec((SQ, g, padded_t), lambda j, b_, k_: (b_, k_, 0))
    return KernelInputs(
        query=grp(h),
        key=key_tile_spec(bk, h),
        value=key_tile_spec(bk, hv),
        d_out=grp(hv),
        lse=vec_g,
        delta=vec_g,
        q_positions=all_queries if cfg.use_pos else None,
        kv_positions=pl.BlockSpec((SQ, bk), lambda j, b_, k_: (b_, j)) if cfg.use_pos else None,
        q_segments=all_queries if cfg.use_seg else None,
        kv_segments=pl.BlockSpec((SQ, bk), lambda j, b_, k_: (b_, j)) if cfg.use_seg else None,
        bias=bias_spec_kv(cfg.bias_dims, g, padded_t, bk) if cfg.bias_dims else None,
        row_bias=bias_spec_kv(ROW_DIMS, g, padded_t, bk) if cfg.row_col else None,
        col_bias=bias_spec_kv(COL_DIMS, g, padded_t, bk) if cfg.row_col else None,
        mask=bias_spec_kv(cfg.mask_dims, g, padded_t, bk) if cfg.mask_dims else None,
        key_term=grp(cfg.num_rel) if cfg.use_qr else None,
        d_value_mass=grp(cfg.num_rel) if cfg.use_pr else None,
        tile_classes=pl.BlockSpec(
            (SQ, map_heads, n_q_tiles, n_kv_tiles), lambda j, b_, k_: (b_, map_head(k_), 0, 0)
        ),
        col_bounds=pl.BlockSpec(
            (SQ, map_heads, 4, n_kv_tiles), lambda j, b_, k_: (b_, map_head(k_), 0, 0)
        ),
        dropout_seed=pl.BlockSpec((2,), lambda j, b_, k_: (0,)) if cfg.use_dropout else None,
        mod_params=whole_specs(cfg),
        distance_tiles=tiles_spec(cfg, ins),
    )


def key_tile_spec(bk: int, width: int):
    """`[B, Sp, K, width]` tiled along Sp, one kv head: grid (j, b, kh)."""
    return pl.BlockSpec((SQ, bk, SQ, width), lambda j, b_, k_: (b_, j, k_, 0))


def dkv_outputs(cfg: KernelConfig, ins: KernelInputs) -> tuple[list, list]:
    """`(out_shape, out_specs)` of the dk/dv kernel: dk, dv and, with
    `col_sums`, dS summed over queries (see `flash_dkv`)."""
    b, _, n, h = ins.query.shape
    _, padded_s, kh, hv = ins.value.shape
    bk, g = cfg.block_k, cfg.groups
    out_shape = [
        jax.ShapeDtypeStruct((b, padded_s, kh, h), ins.key.dtype),
        jax.ShapeDtypeStruct((b, padded_s, kh, hv), ins.value.dtype),
    ]
    out_specs = [key_tile_spec(bk, h), key_tile_spec(bk, hv)]
    if col_sums(cfg):
        out_shape.append(jax.ShapeDtypeStruct((b, n, padded_s), jnp.float32))
        out_specs.append(pl.BlockSpec((SQ, g, bk), lambda j, b_, k_: (b_, k_, j)))
    return out_shape, out_specs


def flash_dkv(cfg: KernelConfig, ins: KernelInputs) -> tuple[Array, Array, Array | None]:
    """dk/dv kernel (grid over key tiles and kv heads; loops over the G query
    heads of the kv head and over query tiles, using the column bounds).

    Returns:
      dk `[B, Sp, K, H]`, dv `[B, Sp, K, Hv]` (key / value dtype) and dS
      summed over queries (`col_sums`: the gradient of the column term and
      of a bias without a query axis), `[B, N, Sp]` float32, or None.
    """
    b, padded_s, kh = ins.value.shape[:3]
    specs = dkv_specs(cfg, ins)
    out_shape, out_specs = dkv_outputs(cfg, ins)
    outs = kernel_call(
        functools.partial(_dkv_kernel, cfg=cfg),
        cfg,
        "jattn_flash_dkv",
        grid=(padded_s // cfg.block_k, b, kh),
        in_specs=[specs],
        out_specs=out_specs,
        out_shape=out_shape,
    )(only_specified(ins, specs))
    return outs[0], outs[1], outs[2] if len(outs) > 2 else None
