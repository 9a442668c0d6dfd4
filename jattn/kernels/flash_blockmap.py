"""The block map of the flash kernels: which (query tile, key tile) pairs to
compute, and how.

Built in XLA before the kernels from per-tile min/max of positions and segment
ids (and per-tile any/all of a user mask), so it costs O((T/bq)·(S/bk)), never
a `[T, S]` array. Both kernel families read it: the Triton kernels as loop
bounds and per-tile classes in their inner loops, the Mosaic kernels as
scalar-prefetched classes and DMA clamps (`flash_tiles` names the classes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn.kernels import flash_tiles as ft

Array = jax.Array

__all__ = ["block_map", "run_bounds", "tiling"]

_INT_MAX = np.iinfo(np.int32).max
_INT_MIN = np.iinfo(np.int32).min


def _tile_min_max(x: Array, block: int, padded: int) -> tuple[Array, Array]:
    """Per-tile min and max of `x [B, L]` over its real entries: `[B, L_p/block]` each."""
    b, n = x.shape[0], padded // block
    pad = ((0, 0), (0, padded - x.shape[1]))
    lo = jnp.pad(x, pad, constant_values=_INT_MAX).reshape(b, n, block).min(-1)
    hi = jnp.pad(x, pad, constant_values=_INT_MIN).reshape(b, n, block).max(-1)
    return lo, hi


def _mask_tiles(mask: Array, bq: int, bk: int, tp: int, sp: int) -> tuple[Array, Array]:
    """Per-tile any/all of a bool mask `[B|1, N|1, T|1, S|1]` (real entries only)."""

    def reduce(fill: bool, op):
        m = mask
        b, n, t, s = m.shape
        if t > 1:
            m = jnp.pad(m, ((0, 0), (0, 0), (0, tp - t), (0, 0)), constant_values=fill)
        if s > 1:
            m = jnp.pad(m, ((0, 0), (0, 0), (0, 0), (0, sp - s)), constant_values=fill)
        nt, tq = (tp // bq, bq) if t > 1 else (1, 1)
        ns, tk = (sp // bk, bk) if s > 1 else (1, 1)
        return op(m.reshape(b, n, nt, tq, ns, tk), axis=(3, 5))  # [B|1, N|1, nT|1, nS|1]

    return reduce(False, jnp.any), reduce(True, jnp.all)


def block_map(
    *,
    q_pos: Array | None,
    kv_pos: Array | None,
    q_seg: Array | None,
    kv_seg: Array | None,
    mask: Array | None,
    causal: bool,
    max_distance: int | None,
    seq_k: int,
    block_q: int,
    block_k: int,
    padded_q: int,
    padded_k: int,
    batch: int,
) -> Array:
    """Class of every (query tile, key tile) pair: int32 `[B, N|1, nT, nS]`.

    SKIP when provably nothing is visible (causal: the earliest key is after
    the latest query; segments: the id ranges do not overlap; mask: all
    False); FAST_LEFT / FAST_RIGHT when provably everything is visible and
    (with Shaw, `max_distance` not None) the relative id is constant, 0 or
    2k; GENERAL otherwise. Built from per-tile min/max only: O(nT·nS).
    """
    nt, ns = padded_q // block_q, padded_k // block_k
    skip = jnp.zeros((batch, 1, nt, ns), bool)
    full = jnp.ones((batch, 1, nt, ns), bool)
    right = jnp.zeros((batch, 1, nt, ns), bool)
    col = lambda x: x[:, None, :, None]  # noqa: E731  [B, nT] -> [B, 1, nT, 1]
    row = lambda x: x[:, None, None, :]  # noqa: E731  [B, nS] -> [B, 1, 1, nS]
    if causal or max_distance is not None:
        qp_lo, qp_hi = _tile_min_max(q_pos, block_q, padded_q)
        kp_lo, kp_hi = _tile_min_max(kv_pos, block_k, padded_k)
    if causal:
        skip |= row(kp_lo) > col(qp_hi)
        full &= row(kp_hi) <= col(qp_lo)
    if q_seg is not None:
        qs_lo, qs_hi = _tile_min_max(q_seg, block_q, padded_q)
        ks_lo, ks_hi = _tile_min_max(kv_seg, block_k, padded_k)
        skip |= (row(ks_hi) < col(qs_lo)) | (row(ks_lo) > col(qs_hi))
        same = (qs_lo == qs_hi)[:, None, :, None] & (ks_lo == ks_hi)[:, None, None, :]
        full &= same & (col(qs_lo) == row(ks_lo))
    if seq_k < padded_k:
        full &= (jnp.arange(ns) < ns - 1)[None, None, None, :]
    if mask is not None:
        m_any, m_all = _mask_tiles(mask, block_q, block_k, padded_q, padded_k)
        skip = skip | ~m_any
        full = full & m_all
    if max_distance is not None:
        k = max_distance
        left = row(kp_hi) - col(qp_lo) <= -k
        right = (row(kp_lo) - col(qp_hi) >= k) & ~left
        if k == 0:
            left, right = jnp.ones_like(left), jnp.zeros_like(right)
        full &= left | right
    fast = jnp.where(right, ft.FAST_RIGHT, ft.FAST_LEFT)
    cls = jnp.where(skip, ft.SKIP, jnp.where(full, fast, ft.GENERAL))
    n = cls.shape[1]
    return jnp.broadcast_to(cls, (batch, n, nt, ns)).astype(jnp.int32)


def run_bounds(cls: Array) -> Array:
    """Loop bounds along the last axis of a class map `[..., n]`: `[..., 4]` with
    `lo` (first non-SKIP), `flo` / `fhi` (the first run of FAST tiles; both
    `hi` if none) and `hi` (one past the last non-SKIP)."""
    n = cls.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    nz, fast = cls != ft.SKIP, cls >= ft.FAST_LEFT
    hi = jnp.max(jnp.where(nz, idx + 1, 0), axis=-1)
    lo = jnp.minimum(jnp.min(jnp.where(nz, idx, n), axis=-1), hi)
    flo = jnp.minimum(jnp.min(jnp.where(fast, idx, n), axis=-1), hi)
    after = (~fast) & (idx >= flo[..., None])
    fhi = jnp.minimum(jnp.min(jnp.where(after, idx, n), axis=-1), hi)
    return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)


def tiling(meta: dict, bq: int, bk: int, tp: int, sp: int) -> dict:
    """Block map `[B, N|1, nT, nS]` with its row bounds `[B, N|1, 4, nT]` and
    column bounds `[B, N|1, 4, nS]` (see `run_bounds`) for one tiling."""
    cls = block_map(block_q=bq, block_k=bk, padded_q=tp, padded_k=sp, **meta)
    rows = jnp.swapaxes(run_bounds(cls), -1, -2)  # [B, N|1, 4, nT]
    cols = jnp.swapaxes(run_bounds(jnp.swapaxes(cls, -1, -2)), -1, -2)  # [B, N|1, 4, nS]
    return {"bmap": cls, "bounds": rows, "cbounds": cols}
