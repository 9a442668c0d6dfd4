"""Distance-table score mods in the Pallas kernels: one Toeplitz tile per tile diagonal.

A mod built by `jattn.ScoreMod.from_distance` adds `term(head, kv - q)`. With
default positions (`arange` queries and keys) tile `(i, j)` of a `bq x bk`
tiling holds the distances `d0 + c - a` (a the query row, c the key column,
`d0 = j*bk - i*bq`), so every tile with the same `d0` gets the same term.
With `g = gcd(bq, bk)` the `d0` are multiples of g from `-(Tp - bq)` to
`Sp - bk`: `nd = (Tp - bq + Sp - bk) / g + 1` diagonals, tile `(i, j)` on
diagonal `idx = (j*bk - i*bq + Tp - bq) / g`.

Why: the per-logit form costs the term's arithmetic on every logit, in the
forward and twice in the backward (Sandwich: 64 cosines per logit), and its
float32 GPU kernels spill. Here the term is tabulated once per call in XLA
(`build`, from `jattn.score_mod.distance_table`, as the xla and chunked
paths do) into `tiles [N, nd*bq, bk]` float32 (natural units: the kernels
add it where the per-logit mod would apply, before their base-2 scaling),
O(N (Tp + Sp) / g * bq * bk) = O(L * block) memory. The kernels add the
tile of their diagonal (one `[bq, bk]` read). The table is built by
differentiable XLA ops from the mod's params, so the kernels only return
`d tiles` and JAX's autodiff of `build` carries it to the params. The
mod's per-logit `fn` is never called in a kernel, so a mod whose `fn`
would not lower in-kernel runs too.

Both kernel families: the Triton kernels load the tile with `pl.ds` (`adder`),
the Mosaic kernels get it as a `[bq, bk]` block whose index map computes the
diagonal (`mosaic_forward.tiles_spec`); their gradient kernels are
`triton_distance_grad` and `mosaic_distance_grad`. Any other call (given
positions) keeps the per-logit path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jattn.attention.distance_table import toeplitz
from jattn.score_mod import ScoreMod, distance_table

Array = jax.Array

__all__ = ["adder", "applies", "build", "diagonal", "num_diagonals"]


def applies(nf, backend: str) -> bool:
    """Whether a call's score mod runs from distance tiles: a distance mod and
    default positions (either kernel family; `backend` kept for the callers)."""
    mod = nf.score_mod
    return mod is not None and mod.distance is not None and nf.visibility.default_positions


def num_diagonals(padded_t: int, padded_s: int, bq: int, bk: int) -> int:
    """nd: the number of distinct tile offsets `d0 = j*bk - i*bq`."""
    return (padded_t - bq + padded_s - bk) // math.gcd(bq, bk) + 1


def diagonal(i, j, padded_t: int, bq: int, bk: int):
    """The diagonal index of tile `(i, j)` (traced or static ints; the
    numerator is >= 0, so a truncating `lax.div` suffices in-kernel)."""
    num = j * bk - i * bq + padded_t - bq
    g = math.gcd(bq, bk)
    return lax.div(num, g) if isinstance(num, jax.Array) else num // g


def build(mod: ScoreMod, num_heads: int, padded_t: int, padded_s: int, bq: int, bk: int):
    """The distance tiles of one tiling: float32 `[N, nd*bq, bk]`.

    `out[h, idx*bq + a, c] = term(h, d0(idx) + c - a)`, `d0(idx) = idx*g -
    (Tp - bq)`: the table at distances `[-(Tp-1), Sp-1]` (`distance_table`),
    one window of `bq + bk - 1` entries per diagonal, expanded by
    `toeplitz`. Differentiable in `mod.params`."""
    g = math.gcd(bq, bk)
    nd = num_diagonals(padded_t, padded_s, bq, bk)
    lo = jnp.full((1,), -(padded_t - 1), jnp.int32)
    table = distance_table(mod, num_heads, lo, padded_t + padded_s - 1)[0]  # [N, D]
    # The window of diagonal idx starts at distance d0 - (bq - 1), table index idx*g.
    cols = (np.arange(nd) * g)[:, None] + np.arange(bq + bk - 1)[None, :]  # [nd, W]
    tiles = toeplitz(table[:, cols], bq, bk)  # [N, nd, bq, bk]
    return tiles.reshape(num_heads, nd * bq, bk)


def adder(ref, head, i, j, padded_t: int, bq: int, bk: int, transposed: bool = False):
    """`s -> s + tile`: tile `(i, j)`'s term for `head`, read from the
    `[N, nd*bq, bk]` tiles ref (one `[bq, bk]` load), natural units;
    `transposed`: added to an `Sᵀ` tile `[bk, bq]` (the dk/dv kernel's)."""
    start = pl.multiple_of(diagonal(i, j, padded_t, bq, bk) * bq, bq)
    tile = ref[head, pl.ds(start, bq), :].astype(jnp.float32)
    if transposed:
        tile = tile.T
    return lambda s: s + tile


def whole_spec(shape: tuple[int, ...]):
    """The tiles as one whole block in every program (any grid)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
