"""The Mosaic GPU flash-attention forward kernel (Hopper: wgmma, TMA, warpgroups).

Plain attention only (`mosaic_gpu_attention` refuses the rest): 16-bit `q
[B, T, N, H]`, `k`, `v` `[B, S, K, H]` (K divides N), causal or not, no
bias, mask, segments, window, dropout, Shaw terms or score mod. A block
owns `compute_wgs` query tiles of `block_q` (64: one wgmma M tile a
warpgroup) rows of one head; its memory warpgroup streams the kv head's key
and value tiles (`block_k` rows) through a ring of `stages` slots
(`mosaic_gpu_stream`), and each compute warpgroup runs the online softmax
over them: `S = q·kᵀ` and `O += P·v` as wgmma from shared memory (P from
registers), float32 accumulators, base 2 (`scale·log2(e)` folded into one
multiply of S, as the Triton kernels do).

Causal (query i sees key j <= i, the normal form's default positions): a
block streams key tiles up to its last row; each warpgroup runs the tiles
left of its own diagonal without a mask, the diagonal ones with it, and
passes the rest (`mosaic_gpu_stream.skip`). Every row sees key 0, so no row
is empty and the running max is finite from the first tile on.

Returns the output in the input dtype and the log-sum-exp in base 2,
`[B, N, T]` float32 (what the backward reads).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.attention.pallas.mosaic_gpu_stream import (
    Ring,
    compute_registers,
    feed_keys_values,
    release,
    skip,
    specialise,
    take,
)

__all__ = [
    "LOG2E",
    "accumulate",
    "flash_forward",
    "in_layout",
    "product",
    "smem_operand",
    "visible",
]

LOG2E = math.log2(math.e)
_WGMMA = plgpu.Layout.WGMMA


def smem_operand(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """Shared memory for a 16-bit wgmma operand `[..., rows, H]`: (8, 64)
    tiles, 128-byte swizzle (64 bf16 columns a row of a tile)."""
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def in_layout(x: jax.Array, layout, interpret) -> jax.Array:
    """`x` in register layout `layout` (`plgpu.layout_cast`); as it is under
    interpret mode, whose jax 0.10.2 rules lack `layout_cast`."""
    return x if interpret is not None else plgpu.layout_cast(x, layout)


def visible(shape, row0, col0, interpret, transposed: bool = False) -> jax.Array:
    """The causal mask of a `[rows, cols]` tile in the wgmma layout: query >=
    key, rows starting at `row0` and columns at `col0` (rows are keys and
    columns queries when `transposed`)."""
    if interpret is None:
        iota = lambda d: plgpu.broadcasted_iota(jnp.int32, shape, d, layout=_WGMMA)
    else:
        iota = lambda d: lax.broadcasted_iota(jnp.int32, shape, d)
    rows, cols = iota(0) + row0, iota(1) + col0
    return rows <= cols if transposed else rows >= cols


def accumulate(acc: jax.Array, a, b, interpret, transpose_b: bool = False) -> jax.Array:
    """`acc + a·b` (`a·bᵀ` with `transpose_b`) by wgmma, float32 in the wgmma
    layout; `a` from registers or shared memory, `b` a shared-memory tile;
    waits for the wgmma. The wgmma accumulates into `acc` itself
    (`pl.run_state` over `plgpu.ACC.init(acc)`).

    Under Pallas's Mosaic GPU interpret mode (`interpret` not None) the
    product is a `jnp.dot` of the loaded tiles added to `acc`: jax 0.10.2's
    interpreter has no rule for `run_state`, for storing into an
    accumulator, nor for a transposed wgmma operand. Interpret mode thus
    checks everything around the dots (the ring, the tile ranges, the
    softmax, the masks, the GQA steps), the dots being jnp's."""
    if interpret is not None:
        return acc + product(acc.shape, a, b, interpret, transpose_b)
    b = b.transpose((1, 0)) if transpose_b else b

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(body)(plgpu.ACC.init(acc))


def product(shape, a, b, interpret, transpose_b: bool = False) -> jax.Array:
    """`a·b` (`a·bᵀ` with `transpose_b`) `[M, N]` float32, by wgmma into a
    fresh accumulator (wgmma layout); `jnp.dot` under interpret mode (see
    `accumulate`)."""
    if interpret is not None:
        a = a if isinstance(a, jax.Array) else a[...]
        b = b[...].T if transpose_b else b[...]
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    b = b.transpose((1, 0)) if transpose_b else b

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def flash_forward(q, k, v, *, causal: bool, scale: float, tiles) -> tuple[jax.Array, jax.Array]:
    """`(o [B, T, N, H] q.dtype, lse [B, N, T] float32, base 2)`; `tiles` a
    `mosaic_gpu_attention.Tiles` (its forward fields)."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    group, dtype = n // kv_heads, q.dtype
    bq, bk, wgs, stages = tiles.block_q, tiles.block_k, tiles.compute_wgs, tiles.stages
    num_k = s // bk
    c = scale * LOG2E

    # Named so: ptxas reports the kernel as `jattn_mgpu_fwd_mosaic_gpu_kernel`.
    def jattn_mgpu_fwd(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, lse_smem, k_smem, v_smem, bars):
        q_bar, k_ready, v_ready, consumed = bars
        ring = Ring((k_smem, v_smem), (k_ready, v_ready), consumed, stages)
        batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        block_row0 = lax.axis_index("q_tiles") * (wgs * bq)
        # Key tiles the block streams: up to its last row when causal.
        count = pl.cdiv(block_row0 + wgs * bq, bk) if causal else num_k

        def _compute():
            plgpu.set_max_registers(compute_registers(wgs), action="increase")
            row0 = block_row0 + wg * bq
            rows = pl.ds(row0, bq)
            my_q = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], my_q, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

            def step(j, carry, masked: bool):
                acc, m, l = carry
                k_tile, v_tile = take(ring, j)

                logits = product((bq, bk), my_q, k_tile, tiles.interpret, transpose_b=True) * c
                if masked:
                    logits = jnp.where(
                        visible((bq, bk), row0, j * bk, tiles.interpret), logits, -jnp.inf
                    )
                m_new = jnp.maximum(m, logits.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, (bq, bk), [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, (bq, h), [0])

                acc = accumulate(acc, p.astype(dtype), v_tile, tiles.interpret)
                release(ring, j)
                return acc, m_new, l

            acc = in_layout(jnp.zeros((bq, h), jnp.float32), _WGMMA, tiles.interpret)
            rows_layout = _WGMMA.reduce(1)
            m = in_layout(jnp.full((bq,), -jnp.inf, jnp.float32), rows_layout, tiles.interpret)
            l = in_layout(jnp.zeros((bq,), jnp.float32), rows_layout, tiles.interpret)
            carry = (acc, m, l)
            if causal:
                full = lax.div(row0 + 1, jnp.int32(bk))  # tiles left of the diagonal
                mine = pl.cdiv(row0 + bq, bk)  # the last tile with a key <= a row's
                carry = lax.fori_loop(0, full, lambda j, x: step(j, x, False), carry)
                carry = lax.fori_loop(full, mine, lambda j, x: step(j, x, True), carry)
                skip(ring, mine, count)
            else:
                carry = lax.fori_loop(0, count, lambda j, x: step(j, x, False), carry)
            acc, m, l = carry
            out = acc / lax.broadcast_in_dim(l, (bq, h), [0])
            my_q[...] = out.astype(dtype)
            lse_smem.at[wg][...] = m + jnp.log2(l)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, o_ref.at[batch, rows, head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, rows])
            plgpu.wait_smem_to_gmem(0)

        def _memory():
            feed_keys_values(ring, count, k_ref, v_ref, batch, head, group, bk)

        specialise(wg, wgs, _compute, _memory)

    scratch = [
        smem_operand((wgs, bq, h), dtype),  # q, then the output
        plgpu.SMEM((wgs, bq), jnp.float32),  # lse
        smem_operand((stages, bk, h), dtype),
        smem_operand((stages, bk, h), dtype),
        (
            plgpu.Barrier(num_barriers=wgs),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        ),
    ]
    out_type = (
        jax.ShapeDtypeStruct((b, t, n, h), dtype),
        jax.ShapeDtypeStruct((b, n, t), jnp.float32),
    )
    return plgpu.kernel(
        jattn_mgpu_fwd,
        out_type=out_type,
        scratch_types=scratch,
        grid=(n, t // (wgs * bq), b),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=tiles.interpret,
    )(q, k, v)
