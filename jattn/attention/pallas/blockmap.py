"""The block map of the flash kernels: which (query tile, key tile) pairs to
compute, and how.

Built in XLA before the kernels from per-tile min/max of positions and segment
ids (and per-tile any/all of a user mask), so it costs O((T/bq)·(S/bk)), never
a `[T, S]` array. Both kernel families read it: the Triton kernels as loop
bounds and per-tile classes in their inner loops, the Mosaic kernels as
scalar-prefetched classes and DMA clamps (`jattn.attention.tiles` names the classes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn.attention import tiles
from jattn.attention.pallas.config import TileMaps
from jattn.visibility import Visibility

Array = jax.Array

__all__ = ["block_map", "run_bounds", "static_maps", "static_tiling", "tiling"]


def _mask_tiles(
    mask: Array, block_q: int, block_k: int, padded_q: int, padded_k: int
) -> tuple[Array, Array]:
    """Per-tile any/all of a bool mask `[B|1, N|1, T|1, S|1]` (real entries only)."""

    def reduce(fill: bool, op):
        m = mask
        b, n, t, s = m.shape
        if t > 1:
            m = jnp.pad(m, ((0, 0), (0, 0), (0, padded_q - t), (0, 0)), constant_values=fill)
        if s > 1:
            m = jnp.pad(m, ((0, 0), (0, 0), (0, 0), (0, padded_k - s)), constant_values=fill)
        nt, tq = (padded_q // block_q, block_q) if t > 1 else (1, 1)
        ns, tk = (padded_k // block_k, block_k) if s > 1 else (1, 1)
        return op(m.reshape(b, n, nt, tq, ns, tk), axis=(3, 5))  # [B|1, N|1, nT|1, nS|1]

    return reduce(False, jnp.any), reduce(True, jnp.all)


def block_map(
    *,
    vis: Visibility,
    mask: Array | None,
    max_distance: int | None,
    seq_k: int,
    block_q: int,
    block_k: int,
    padded_q: int,
    padded_k: int,
    batch: int,
) -> Array:
    """Class of every (query tile, key tile) pair: int32 `[B, N|1, nT, nS]`
    (`jattn.attention.tiles.classify` on this tiling's per-tile summaries of
    the normalised `vis`'s positions and segment ids; positions may be None
    where no rule reads them)."""
    nt, ns = padded_q // block_q, padded_k // block_k
    summary = lambda x, block, padded: None if x is None else tiles.tile_min_max(x, block, padded)
    window = vis.local_window_size
    need_pos = vis.is_causal or window is not None or max_distance is not None
    return tiles.classify(
        (batch, nt, ns),
        q_pos=summary(vis.q_positions, block_q, padded_q) if need_pos else None,
        kv_pos=summary(vis.kv_positions, block_k, padded_k) if need_pos else None,
        q_seg=summary(vis.q_segment_ids, block_q, padded_q),
        kv_seg=summary(vis.kv_segment_ids, block_k, padded_k),
        mask_any_all=None
        if mask is None
        else _mask_tiles(mask, block_q, block_k, padded_q, padded_k),
        is_causal=vis.is_causal,
        window=window,
        max_distance=max_distance,
        kv_ragged=seq_k < padded_k,
    )


run_bounds = tiles.run_bounds


def tiling(meta: dict, block_q: int, block_k: int, padded_q: int, padded_k: int) -> TileMaps:
    """Block map `[B, N|1, nT, nS]` with its row bounds `[B, N|1, 4, nT]` and
    column bounds `[B, N|1, 4, nS]` (see `run_bounds`) for one tiling;
    `meta` holds the other arguments of `block_map`."""
    classes = block_map(
        block_q=block_q, block_k=block_k, padded_q=padded_q, padded_k=padded_k, **meta
    )
    rows = jnp.swapaxes(run_bounds(classes), -1, -2)  # [B, N|1, 4, nT]
    cols = jnp.swapaxes(run_bounds(jnp.swapaxes(classes, -1, -2)), -1, -2)  # [B, N|1, 4, nS]
    return TileMaps(classes=classes, row_bounds=rows, col_bounds=cols)


@functools.lru_cache(maxsize=256)
def static_maps(
    causal: bool,
    window: tuple[int, int] | None,
    max_distance: int | None,
    seq_q: int,
    seq_k: int,
    block_q: int,
    block_k: int,
    padded_q: int,
    padded_k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`tiling` of one batch row with positions `arange` and nothing else
    data-dependent, evaluated once (numpy results, `[1, 1, ...]`; cached, so
    the same arguments return the same arrays)."""
    with jax.ensure_compile_time_eval():
        vis = Visibility(is_causal=causal, local_window_size=window).normalised(1, seq_q, seq_k)
        meta = dict(
            vis=vis,
            mask=None,
            max_distance=max_distance,
            seq_k=seq_k,
            batch=1,
        )
        maps = tiling(meta, block_q, block_k, padded_q, padded_k)
    return tuple(np.asarray(x) for x in maps)


def static_tiling(
    *,
    batch: int,
    causal: bool,
    window: tuple[int, int] | None,
    max_distance: int | None,
    seq_q: int,
    seq_k: int,
    block_q: int,
    block_k: int,
    padded_q: int,
    padded_k: int,
) -> TileMaps:
    """`tiling` for calls whose visibility depends on the shapes alone
    (positions `arange(T)` / `arange(S)`, no segment ids, no mask): built
    once per shape in numpy (cached) and embedded as constants, so a jitted
    step runs no block-map computation at all. Same result as `tiling`."""
    maps = static_maps(
        causal, window, max_distance, seq_q, seq_k, block_q, block_k, padded_q, padded_k
    )
    return TileMaps(*(jnp.asarray(np.broadcast_to(x, (batch, *x.shape[1:]))) for x in maps))
