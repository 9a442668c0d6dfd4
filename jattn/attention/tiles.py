"""Tile classes: which (query tile, key tile) pairs a tiled implementation
computes, and how. One vocabulary and one rule for the chunked path and the
kernels.

A tiled implementation never builds `[T, S]`; it decides per tile, from the
tile's min/max of positions and segment ids (and any/all of a user mask),
which of four classes the tile is in:

- ``SKIP``: provably nothing visible (causal: every key after every query;
  window: every key outside every query's window; segments: the id ranges
  do not overlap, or either tile is all padding; mask: all False). Not
  computed.
- ``PARTIAL``: anything else that is not provably FULL: per-element
  visibility and per-element Shaw relative ids.
- ``FULL_LEFT``: provably everything visible and, with Shaw terms, every
  relative id 0 (every key at least k before every query); without Shaw
  terms every FULL tile is FULL_LEFT. No visibility test, and the Shaw key
  term is one broadcast column, the value term one row sum.
- ``FULL_RIGHT``: everything visible, every relative id 2k.

`classify` is O(nT·nS) from per-tile summaries (`tile_min_max`), so a
windowed or packed call costs work only where tiles are not SKIP; the loop
bounds of a row of tiles come from `run_bounds`.

Shapes: B batch, nT / nS query / key tile counts, bq / bk tile lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn.masks import PAD_KV, PAD_Q

Array = jax.Array

__all__ = [
    "FULL_LEFT",
    "FULL_RIGHT",
    "PARTIAL",
    "SKIP",
    "classify",
    "pad_axis",
    "run_bounds",
    "tile_min_max",
]

SKIP, PARTIAL, FULL_LEFT, FULL_RIGHT = 0, 1, 2, 3

_INT_MAX = np.iinfo(np.int32).max
_INT_MIN = np.iinfo(np.int32).min


def pad_axis(x: Array | None, axis: int, size: int, mode: str = "constant") -> Array | None:
    """`x` padded at the end of `axis` to length `size` (a `jnp.pad` mode:
    "constant" zeros, or "edge", which keeps tile min/max of positions and
    segment ids tight); None stays None."""
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


def tile_min_max(x: Array, block: int, padded: int) -> tuple[Array, Array]:
    """Per-tile min and max of `x [B, L]` over its real entries (padding to
    `padded` is ignored): `[B, padded / block]` each."""
    b, n = x.shape[0], padded // block
    pad = ((0, 0), (0, padded - x.shape[1]))
    lo = jnp.pad(x, pad, constant_values=_INT_MAX).reshape(b, n, block).min(-1)
    hi = jnp.pad(x, pad, constant_values=_INT_MIN).reshape(b, n, block).max(-1)
    return lo, hi


def classify(
    shape: tuple[int, int, int],
    *,
    q_pos: tuple[Array, Array] | None,
    kv_pos: tuple[Array, Array] | None,
    q_seg: tuple[Array, Array] | None = None,
    kv_seg: tuple[Array, Array] | None = None,
    mask_any_all: tuple[Array, Array] | None = None,
    is_causal: bool = False,
    window: tuple[int, int] | None = None,
    max_distance: int | None = None,
    kv_ragged: bool = False,
) -> Array:
    """Class of every (query tile, key tile) pair: int32 `[B, N|1, nT, nS]`.

    Args:
      shape: `(B, nT, nS)`.
      q_pos, kv_pos: per-tile `(min, max)` of positions, `[B, nT]` / `[B, nS]`
        each (needed with `is_causal`, `window` or `max_distance`).
      q_seg, kv_seg: per-tile `(min, max)` of segment ids, or None.
      mask_any_all: per-tile `(any, all)` of the user mask,
        `[B|1, N|1, nT, nS]` each, or None.
      is_causal, window: the rules of `jattn.masks.visible`.
      max_distance: the Shaw clip distance k, or None without Shaw terms.
      kv_ragged: the last key tile holds padding (never FULL).

    Returns:
      `SKIP`, `PARTIAL`, `FULL_LEFT` or `FULL_RIGHT` per tile pair.
    """
    col = lambda x: x[:, None, :, None]  # noqa: E731  [B, nT] -> [B, 1, nT, 1]
    row = lambda x: x[:, None, None, :]  # noqa: E731  [B, nS] -> [B, 1, 1, nS]
    b, nt, ns = shape
    skip = jnp.zeros((b, 1, nt, ns), bool)
    full = jnp.ones((b, 1, nt, ns), bool)
    right = jnp.zeros((b, 1, nt, ns), bool)
    if is_causal:
        skip |= row(kv_pos[0]) > col(q_pos[1])
        full &= row(kv_pos[1]) <= col(q_pos[0])
    if window is not None:
        left_w, right_w = window
        skip |= row(kv_pos[0]) > col(q_pos[1]) + right_w
        skip |= row(kv_pos[1]) < col(q_pos[0]) - left_w
        full &= row(kv_pos[1]) <= col(q_pos[0]) + right_w
        full &= row(kv_pos[0]) >= col(q_pos[1]) - left_w
    if q_seg is not None:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg, kv_seg
        skip |= (row(ks_hi) < col(qs_lo)) | (row(ks_lo) > col(qs_hi))
        # Padding ids are the smallest ints: a tile whose largest id is one
        # holds only padding, which sees nothing and is seen by nothing.
        skip |= (col(qs_hi) <= PAD_Q) | (row(ks_hi) <= PAD_KV)
        same = (qs_lo == qs_hi)[:, None, :, None] & (ks_lo == ks_hi)[:, None, None, :]
        full &= same & (col(qs_lo) == row(ks_lo))
    if kv_ragged:
        full &= (jnp.arange(ns) < ns - 1)[None, None, None, :]
    if mask_any_all is not None:
        m_any, m_all = mask_any_all
        skip = skip | ~m_any
        full = full & m_all
    if max_distance is not None:
        k = max_distance
        left = row(kv_pos[1]) - col(q_pos[0]) <= -k
        right = (row(kv_pos[0]) - col(q_pos[1]) >= k) & ~left
        if k == 0:
            left, right = jnp.ones_like(left), jnp.zeros_like(right)
        full &= left | right
    dense = jnp.where(right, FULL_RIGHT, FULL_LEFT)
    cls = jnp.where(skip, SKIP, jnp.where(full, dense, PARTIAL))
    return jnp.broadcast_to(cls, (b, cls.shape[1], nt, ns)).astype(jnp.int32)


def run_bounds(cls: Array) -> Array:
    """Loop bounds along the last axis of a class map `[..., n]`: `[..., 4]`
    with `lo` (first non-SKIP), `flo` / `fhi` (the first run of FULL tiles;
    both `hi` if none) and `hi` (one past the last non-SKIP)."""
    n = cls.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), cls.shape)
    nz, fast = cls != SKIP, cls >= FULL_LEFT
    hi = jnp.max(jnp.where(nz, idx + 1, 0), axis=-1)
    lo = jnp.minimum(jnp.min(jnp.where(nz, idx, n), axis=-1), hi)
    flo = jnp.minimum(jnp.min(jnp.where(fast, idx, n), axis=-1), hi)
    after = (~fast) & (idx >= flo[..., None])  # [..., n]
    fhi = jnp.minimum(jnp.min(jnp.where(after, idx, n), axis=-1), hi)
    return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)
