"""The Mosaic GPU flash-attention backward kernels: dq, and dk/dv with the GQA heads inside.

The plain case of `mosaic_gpu_forward` (same inputs, same causal rule),
from the forward's base-2 log-sum-exp `lse` and `delta = rowsum(dO * O)`
(both `[B, N, T]` float32, computed in XLA), recomputing the probabilities
tile by tile as the Triton kernels do:

- `flash_dq`: a block owns `compute_wgs` query tiles of 64 rows of one head
  and streams the kv head's key and value tiles (`block_k` rows) through the
  ring (`mosaic_gpu_stream`): `S = q·kᵀ`, `P = exp2(S·c - lse)`, `dP =
  dO·vᵀ`, `dS = P·(dP - delta)`, `dq += dS·k`.
- `flash_dkv`: a block owns `compute_wgs` key tiles of 64 rows of one kv
  head and streams the query-side tiles (q, dO, lse, delta; `block_q` rows)
  of every query head of its group, so dk and dv come out per kv head with
  no sum in XLA: `Sᵀ = k·qᵀ`, `Pᵀ`, `dv += Pᵀ·dO`, `dPᵀ = v·dOᵀ`, `dSᵀ`,
  `dk += dSᵀ·q` (the transposed tiles, as the Triton dk/dv kernel: no dot
  needs a transposed register operand).

Causal: the dq blocks stream the key tiles up to their last row, the dk/dv
blocks the query tiles from their first key on (per head of the group);
each warpgroup masks only its diagonal tiles and passes the tiles outside
its own range. The scale is applied once to dq and dk at the end.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.attention.pallas.mosaic_gpu_forward import (
    LOG2E,
    accumulate,
    in_layout,
    product,
    smem_operand,
    visible,
)
from jattn.attention.pallas.mosaic_gpu_stream import (
    MEMORY_REGISTERS,
    Ring,
    compute_registers,
    feed,
    feed_keys_values,
    release,
    skip,
    specialise,
    take,
)

__all__ = ["ROWS", "flash_dkv", "flash_dq"]

ROWS = 64  # a compute warpgroup's rows: one wgmma M tile
_WGMMA = plgpu.Layout.WGMMA


def _vector(ref, layout, interpret) -> jax.Array:
    """A `[rows]` float32 vector from shared memory in register layout
    `layout` (`plgpu.load`; a plain read under interpret mode, whose jax
    0.10.2 rules lack `plgpu.load`)."""
    if interpret is not None:
        return ref[...]
    # jax 0.10 takes an index (`load(ref, (), layout=)`), 0.12 none (`load(ref, layout=)`).
    index = ((),) if "idx" in inspect.signature(plgpu.load).parameters else ()
    return plgpu.load(ref, *index, layout=layout)


def _own_tiles(ref_pairs, barriers, wg) -> None:
    """A compute warpgroup copies its own tiles (`(gmem, smem)` pairs, one
    barrier array each, indexed by warpgroup) and waits for them."""
    for (src, dst), bar in zip(ref_pairs, barriers, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
    for bar in barriers:
        plgpu.barrier_wait(bar.at[wg])


def _kernel(body, out_type, scratch, grid, grid_names, tiles):
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=tiles.compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=tiles.interpret,
    )


def flash_dq(q, k, v, do, lse, delta, *, causal: bool, scale: float, tiles) -> jax.Array:
    """dq `[B, T, N, H]` in q's dtype. `q`, `do` `[B, T, N, H]`, `k`, `v`
    `[B, S, K, H]`, `lse` (base 2) and `delta` `[B, N, T]` float32."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    group, dtype, interp = n // kv_heads, q.dtype, tiles.interpret
    bq, bk, wgs, stages = ROWS, tiles.dq_block_k, tiles.compute_wgs, tiles.stages
    c = scale * LOG2E
    rows_layout = _WGMMA.reduce(1)

    def jattn_mgpu_dq(
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, own, ring_smem, bars
    ):
        q_smem, do_smem, lse_smem, delta_smem = own
        own_bars, (k_ready, v_ready, consumed) = bars
        ring = Ring(ring_smem, (k_ready, v_ready), consumed, stages)
        batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        block_row0 = lax.axis_index("q_tiles") * (wgs * bq)
        count = pl.cdiv(block_row0 + wgs * bq, bk) if causal else s // bk

        def _compute():
            plgpu.set_max_registers(compute_registers(wgs), action="increase")
            row0 = block_row0 + wg * bq
            rows = pl.ds(row0, bq)
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            pairs = [
                (q_ref.at[batch, rows, head], my_q),
                (do_ref.at[batch, rows, head], my_do),
                (lse_ref.at[batch, head, rows], lse_smem.at[wg]),
                (delta_ref.at[batch, head, rows], delta_smem.at[wg]),
            ]
            _own_tiles(pairs, own_bars, wg)
            lse_rows = _vector(lse_smem.at[wg], rows_layout, interp)
            delta_rows = _vector(delta_smem.at[wg], rows_layout, interp)

            def step(j, dq, masked: bool):
                k_tile, v_tile = take(ring, j)
                logits = product((bq, bk), my_q, k_tile, interp, transpose_b=True) * c
                p = jnp.exp2(logits - lax.broadcast_in_dim(lse_rows, (bq, bk), [0]))
                if masked:
                    p = jnp.where(visible((bq, bk), row0, j * bk, interp), p, 0.0)
                dp = product((bq, bk), my_do, v_tile, interp, transpose_b=True)
                ds = p * (dp - lax.broadcast_in_dim(delta_rows, (bq, bk), [0]))
                dq = accumulate(dq, ds.astype(dtype), k_tile, interp)
                release(ring, j)
                return dq

            dq = in_layout(jnp.zeros((bq, h), jnp.float32), _WGMMA, interp)
            if causal:
                full = lax.div(row0 + 1, jnp.int32(bk))
                mine = pl.cdiv(row0 + bq, bk)
                dq = lax.fori_loop(0, full, lambda j, x: step(j, x, False), dq)
                dq = lax.fori_loop(full, mine, lambda j, x: step(j, x, True), dq)
                skip(ring, mine, count)
            else:
                dq = lax.fori_loop(0, count, lambda j, x: step(j, x, False), dq)
            my_q[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, dq_ref.at[batch, rows, head])
            plgpu.wait_smem_to_gmem(0)

        def _memory():
            feed_keys_values(ring, count, k_ref, v_ref, batch, head, group, bk)

        specialise(wg, wgs, _compute, _memory)

    scratch = [
        (
            smem_operand((wgs, bq, h), dtype),  # q, then dq
            smem_operand((wgs, bq, h), dtype),  # dO
            plgpu.SMEM((wgs, bq), jnp.float32),  # lse
            plgpu.SMEM((wgs, bq), jnp.float32),  # delta
        ),
        (smem_operand((stages, bk, h), dtype), smem_operand((stages, bk, h), dtype)),
        (
            tuple(plgpu.Barrier(num_barriers=wgs) for _ in range(4)),
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            ),
        ),
    ]
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    grid = (n, t // (wgs * bq), b)
    call = _kernel(jattn_mgpu_dq, out_type, scratch, grid, ("heads", "q_tiles", "batch"), tiles)
    return call(q, k, v, do, lse, delta)


def flash_dkv(q, k, v, do, lse, delta, *, causal: bool, scale: float, tiles):
    """`(dk, dv)` `[B, S, K, H]` in k's dtype, summed over each kv head's
    query heads in the kernel (inputs as `flash_dq`)."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    group, dtype, interp = n // kv_heads, q.dtype, tiles.interpret
    bq, bk, wgs, stages = tiles.dkv_block_q, ROWS, tiles.compute_wgs, tiles.stages
    num_q, c = t // bq, scale * LOG2E
    cols_layout = _WGMMA.reduce(0)

    def jattn_mgpu_dkv(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, own,
                       ring_smem, bars):  # fmt: skip
        k_smem, v_smem = own
        own_bars, (q_ready, do_ready, lse_ready, delta_ready, consumed) = bars
        ready = (q_ready, do_ready, lse_ready, delta_ready)
        ring = Ring(ring_smem, ready, consumed, stages)
        batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        block_key0 = lax.axis_index("k_tiles") * (wgs * bk)

        def head_tiles():
            """`(first, count)`: the query tiles a head's steps cover, from the
            block's first key on when causal. Each role computes them after
            its `set_max_registers`, so that they are not live across it."""
            first = lax.div(block_key0, jnp.int32(bq)) if causal else jnp.int32(0)
            return first, num_q - first

        def _compute():
            plgpu.set_max_registers(compute_registers(wgs), action="increase")
            first, per_head = head_tiles()
            key0 = block_key0 + wg * bk
            keys = pl.ds(key0, bk)
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]
            pairs = [(k_ref.at[batch, keys, kv_head], my_k), (v_ref.at[batch, keys, kv_head], my_v)]
            _own_tiles(pairs, own_bars, wg)

            def step(j, i, carry, masked: bool):  # ring step j: query tile i of its head
                dk, dv = carry
                q_tile, do_tile, lse_tile, delta_tile = take(ring, j)
                logits_t = product((bk, bq), my_k, q_tile, interp, transpose_b=True) * c
                lse_cols = _vector(lse_tile, cols_layout, interp)
                p_t = jnp.exp2(logits_t - lax.broadcast_in_dim(lse_cols, (bk, bq), [1]))
                if masked:
                    p_t = jnp.where(visible((bk, bq), key0, i * bq, interp, True), p_t, 0.0)
                dv = accumulate(dv, p_t.astype(dtype), do_tile, interp)
                dp_t = product((bk, bq), my_v, do_tile, interp, transpose_b=True)
                delta_cols = _vector(delta_tile, cols_layout, interp)
                ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta_cols, (bk, bq), [1]))
                dk = accumulate(dk, ds_t.astype(dtype), q_tile, interp)
                release(ring, j)
                return dk, dv

            def passed(j, carry):  # a tile above this warpgroup's keys: the other's
                take(ring, j)
                release(ring, j)
                return carry

            # One loop over the ring's steps (every head of the group), each
            # step's case picked by `lax.cond`: with a head loop around loops
            # over the passed, diagonal and full tiles, their bounds stayed
            # live through the tile code and ptxas spilled them at head dim
            # 128 (docs/gpu.md, "The Mosaic GPU variant").
            mine = lax.div(key0, jnp.int32(bq))  # the first query tile seeing a key
            full = jnp.minimum(pl.cdiv(key0 + bk - 1, bq), num_q)  # unmasked from here

            def ring_step(j, carry):
                if not causal:
                    return step(j, 0, carry, False)
                r = lax.rem(j, per_head)  # the tile's place in its head's steps
                seen = lambda x: lax.cond(
                    r < full - first,
                    lambda y: step(j, first + r, y, True),
                    lambda y: step(j, 0, y, False),
                    x,
                )
                return lax.cond(r < mine - first, lambda x: passed(j, x), seen, carry)

            zeros = in_layout(jnp.zeros((bk, h), jnp.float32), _WGMMA, interp)
            dk, dv = lax.fori_loop(0, group * per_head, ring_step, (zeros, zeros))
            my_k[...] = (dk * scale).astype(dtype)
            my_v[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[batch, keys, kv_head])
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[batch, keys, kv_head])
            plgpu.wait_smem_to_gmem(0)

        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            first, per_head = head_tiles()

            def sources(j):
                g, i = lax.div(j, per_head), first + lax.rem(j, per_head)
                head, rows = kv_head * group + g, pl.ds(i * bq, bq)
                return (
                    q_ref.at[batch, rows, head],
                    do_ref.at[batch, rows, head],
                    lse_ref.at[batch, head, rows],
                    delta_ref.at[batch, head, rows],
                )

            feed(ring, group * per_head, sources)

        specialise(wg, wgs, _compute, _memory)

    scratch = [
        (smem_operand((wgs, bk, h), dtype), smem_operand((wgs, bk, h), dtype)),  # k, v; dk, dv
        (
            smem_operand((stages, bq, h), dtype),  # q
            smem_operand((stages, bq, h), dtype),  # dO
            plgpu.SMEM((stages, bq), jnp.float32),  # lse
            plgpu.SMEM((stages, bq), jnp.float32),  # delta
        ),
        (
            (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs)),
            (
                *(plgpu.Barrier(num_barriers=stages) for _ in range(4)),
                plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            ),
        ),
    ]
    out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
    grid = (kv_heads, s // (wgs * bk), b)
    call = _kernel(jattn_mgpu_dkv, out_type, scratch, grid, ("heads", "k_tiles", "batch"), tiles)
    return call(q, k, v, do, lse, delta)
