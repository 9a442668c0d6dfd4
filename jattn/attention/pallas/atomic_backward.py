"""The atomic backward of the Triton flash kernels: dq added by the dk/dv kernel.

`backward="atomic"` in `flash_attention`. The split backward
(`triton_backward`) runs a dq kernel that recomputes every visible tile's
probabilities and dS a second time, after the dk/dv kernel has had them.
Here the dk/dv kernel alone runs (its grid `(key tiles, B, K)`, its loop
over the G query heads of a kv head and their query tiles, the same tile
code, `triton_backward.dkv_tile`) and also pulls each tile's dS to the
query side, where many programs (one per key tile) meet at the same rows:

- dq: `dS·k · scale` of the tile, `[bq, H]`, atomically added
  (`jax.experimental.pallas.triton.atomic_add`, float32) into a float32
  buffer `[B, Tp, N, H]` that enters as zeros aliased to the output
  (`input_output_aliases`), at the rows of query head `kh·G + g`, so GQA and
  MQA add into each query head's own rows; cast to the query dtype after;
- with a Shaw key table, the key term's gradient `dqr [B, Tp, N, Rp]`, the
  tile's dS summed per relative id, added the same way;
- dS summed over keys (`config.row_sums`: the row term's and a per-query
  bias's gradient), `[B, N, Tp]`, added the same way;
- a bias with both a query and a key axis: the tile's dS written to its
  place in `[B, N, Tp, Sp]` (each tile has one owner: a plain store);
- the score mod's params gradient: per-program partial sums
  `[nS, B, N, *leaf]` (the dk/dv kernel's programs), summed by the caller
  as the dq kernel's `[nT, ...]` are.

The layout `[B, Tp, N, H]` is the query's, so the buffer's block is the
dk/dv kernel's query block (`[Tp, G, H]` of one kv head) and the cast back
to the query dtype is the only pass over it; each row's H entries are
contiguous in it as in `[B, N, T, H]`.

The cost: one more dot per tile (`dSᵀ` is `[bk, bq]`, so `dq = dSᵀᵀ·k`
contracts the rows of both operands: the one transposed operand of these
tiles) and `bq·H` float32 atomic adds per tile, against the dq kernel's
second pass over every tile (`q·kᵀ`, `exp2`, `dO·vᵀ`, the mask, the score
mod and its vjp). Which wins is the GPU's to say (`benchmarks/gpu.py`'s
`sweep/atomic*` cells, beside `sweep/dkv*`). Float additions in whatever
order the programs reach them: dq (and dqr, the row sums) are not bitwise
deterministic from run to run, unlike the split and fused backwards.

Triton kernels only (GPU and interpret mode, where the adds run in grid
order); the Mosaic (TPU) backward is split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jattn.attention.pallas import tile_dot, tile_math
from jattn.attention.pallas.config import (
    SQ,
    KernelConfig,
    KernelInputs,
    col_sums,
    dbias_kind,
    mod_grad_shapes,
    only_specified,
    row_sums,
)
from jattn.attention.pallas.triton_backward import (
    KeyTileGrad,
    dkv_outputs,
    dkv_specs,
    dkv_tile,
)
from jattn.attention.pallas.triton_forward import kernel_call

Array = jax.Array

__all__ = ["flash_dkv_dq"]


class _QuerySide:
    """The `dkv_tile` sink of the atomic backward: each visited tile's dS
    taken to the query side (the module docstring's list); its carry is the
    score mod's params gradient of the current query head."""

    def __init__(self, cfg: KernelConfig, dq, dqr, full, rows, mods):
        self.cfg, self.dq, self.dqr, self.full, self.rows, self.mods = (
            cfg, dq, dqr, full, rows, mods,
        )  # fmt: skip

    def init(self) -> tuple[Array, ...]:
        return tuple(jnp.zeros(shape, jnp.float32) for shape in mod_grad_shapes(self.cfg))

    def step(self, t: KeyTileGrad, carry: tuple[Array, ...]) -> tuple[Array, ...]:
        cfg = self.cfg
        rows = (t.q_rows, t.g, slice(None))
        dq = tile_dot.dot(t.ds_low, t.key, (0, 0), cfg.precision) * cfg.scale  # [bq, H]
        pltriton.atomic_add(self.dq, rows, dq)
        if self.dqr is not None:
            pltriton.atomic_add(self.dqr, rows, _key_term_grad(cfg, t))
        if self.full is not None:
            self.full[t.g, t.q_rows, :] = t.ds.T  # [bq, bk]
        if self.rows is not None:
            pltriton.atomic_add(self.rows, (t.g, t.q_rows), jnp.sum(t.ds, axis=0))
        if not carry:
            return carry
        new = [d for d in t.d_leaves if d is not None]
        return tuple(a + d for a, d in zip(carry, new, strict=True))

    def finish(self, g, carry: tuple[Array, ...]) -> None:
        for ref, acc in zip(self.mods, carry, strict=True):
            ref[(g,) + (slice(None),) * acc.ndim] = acc


def _key_term_grad(cfg: KernelConfig, t: KeyTileGrad) -> Array:
    """The tile's gradient of the Shaw key-term table, `[bq, Rp]`: dS summed
    per relative id (a FULL tile has one, column 0 or 2k)."""
    acc = jnp.zeros((cfg.block_q, cfg.num_rel), jnp.float32)
    if t.partial:
        rt, lo, hi = t.rel
        return tile_math.near_scatter(rt.T, lo, hi, t.ds.T, acc)
    ds_sum = jnp.sum(t.ds, axis=0)  # [bq]
    w_left, w_right = jnp.where(t.right, 0.0, ds_sum), jnp.where(t.right, ds_sum, 0.0)
    return tile_math.add_far_columns(acc, w_left, w_right, cfg.far_right)


def _kernel(r: KernelInputs, *refs, cfg: KernelConfig, n_zeroed: int):
    refs = list(refs[n_zeroed:])  # the aliased zeros inputs: written through the outputs
    dk_ref, dv_ref = refs.pop(0), refs.pop(0)
    cols_ref = refs.pop(0) if col_sums(cfg) else None
    dq_ref = refs.pop(0)  # [Tp, G, H]
    dqr_ref = refs.pop(0) if cfg.use_qr else None  # [Tp, G, Rp]
    full_ref = refs.pop(0) if dbias_kind(cfg) == "full" else None  # [G, Tp, bk]
    rows_ref = refs.pop(0) if row_sums(cfg) else None  # [G, Tp]
    sink = _QuerySide(cfg, dq_ref, dqr_ref, full_ref, rows_ref, tuple(refs))
    ids = tuple(pl.program_id(a) for a in range(3))
    dkv_tile(cfg, r, ids, dk_ref, dv_ref, cols_ref, sink)


def flash_dkv_dq(cfg: KernelConfig, ins: KernelInputs):
    """dk, dv and dq in the dk/dv kernel (grid `(nS, B, K)`), dq by atomic adds.

    Args:
      cfg: the backward configuration (its tiling's block map in `ins`).
      ins: as for `triton_backward.flash_dq` / `flash_dkv`.

    Returns:
      `(dq, dqr, db_q, rows, dk, dv, cols, d_mod)` as
      `fused_backward.flash_dq_dkv` returns them, except that the score
      mod's partial sums are `[nS, B, N, *leaf]` (one per dk/dv program).
    """
    b, padded_t, n, h = ins.query.shape
    padded_s, kh = ins.value.shape[1:3]
    bk, g = cfg.block_k, cfg.groups
    specs = dkv_specs(cfg, ins)
    out_shape, out_specs = dkv_outputs(cfg, ins)
    n_dkv = len(out_shape)
    args, in_specs, aliases = [only_specified(ins, specs)], [specs], {}
    n_leaves = len(jax.tree_util.tree_leaves(args[0]))

    def zeroed(shape, spec):  # an output that enters as zeros: added into, or written in part
        aliases[n_leaves + len(args) - 1] = len(out_shape)
        args.append(jnp.zeros(shape, jnp.float32))
        in_specs.append(spec)
        out_shape.append(jax.ShapeDtypeStruct(shape, jnp.float32))
        out_specs.append(spec)

    rows_of = lambda w: pl.BlockSpec((SQ, padded_t, g, w), lambda j, b_, k_: (b_, 0, k_, 0))  # noqa: E731
    zeroed((b, padded_t, n, h), rows_of(h))
    if cfg.use_qr:
        zeroed((b, padded_t, n, cfg.num_rel), rows_of(cfg.num_rel))
    kind = dbias_kind(cfg)
    if kind == "full":
        spec = pl.BlockSpec((SQ, g, padded_t, bk), lambda j, b_, k_: (b_, k_, 0, j))
        zeroed((b, n, padded_t, padded_s), spec)
    if row_sums(cfg):
        zeroed((b, n, padded_t), pl.BlockSpec((SQ, g, padded_t), lambda j, b_, k_: (b_, k_, 0)))
    n_zeroed = len(args) - 1
    for shape in mod_grad_shapes(cfg):  # per-program partial sums, reduced by the caller
        out_shape.append(jax.ShapeDtypeStruct((padded_s // bk, b, n, *shape), jnp.float32))
        out_specs.append(
            pl.BlockSpec(
                (SQ, SQ, g, *shape), lambda j, b_, k_, rank=len(shape): (j, b_, k_) + (0,) * rank
            )
        )
    outs = list(
        kernel_call(
            functools.partial(_kernel, cfg=cfg, n_zeroed=n_zeroed),
            cfg,
            "jattn_flash_bwd_atomic",
            grid=(padded_s // bk, b, kh),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            input_output_aliases=aliases,
        )(*args)
    )
    dk, dv = outs[0], outs[1]
    cols = outs[2] if col_sums(cfg) else None
    summed = outs[n_dkv:]
    dq = summed.pop(0).astype(ins.query.dtype)
    dqr = summed.pop(0) if cfg.use_qr else None
    db_q = summed.pop(0) if kind == "full" else None
    rows = summed.pop(0) if row_sums(cfg) else None
    return dq, dqr, db_q, rows, dk, dv, cols, tuple(summed)
