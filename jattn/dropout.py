"""Attention-weight dropout as a pure function of `(rng, b, n, t, s)`.

Dropout on the attention weights must be the same in every implementation,
or the implementations could never be compared with dropout on. A stored
`[B, N, T, S]` keep mask would defeat the point of the tiled paths, and
`jax.random.bernoulli` draws depend on the shape they are drawn in. So the
keep decision of weight `(b, n, t, s)` is a counter-based hash of the
dropout key and those four indices, computed where it is used: in the xla
path on the whole problem, in the chunked path per tile, in the kernels per
tile, and again in each backward pass (never stored).

The hash is 32-bit integer arithmetic only (multiply, xor, logical shift on
int32, wrapping), which lowers everywhere: XLA, Triton and Mosaic. Indices
are those of the (unpadded) problem: `b` the batch row (0 for every row with
`broadcast_batch`, flax's `broadcast_dropout`), `n` the query head, `t` the
query index, `s` the key index.

A weight is kept iff the top 24 bits of its hash are >= `round(rate * 2^24)`,
so the keep probability is `1 - rate` to within 2^-24; kept weights are
scaled by `1 / (1 - rate)`. Rows are normalised before dropout (the
log-sum-exp does not depend on it), as in flax and FlashAttention.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = ["Dropout", "keep", "multiplier", "seed_words", "threshold"]


class Dropout(NamedTuple):
    """Attention-weight dropout as one argument (`jattn.normalise`'s).

    Attributes:
      rate: in [0, 1); 0 is off.
      rng: a jax.random key, needed when `rate > 0`; its `seed_words` seed the hash.
      broadcast_batch: one keep mask for every batch row (flax's
        `broadcast_dropout`): the hash sees batch row 0 everywhere.
    """

    rate: float = 0.0
    rng: Array | None = None
    broadcast_batch: bool = False


def _i32(x: int) -> np.int32:
    """A 32-bit constant as int32 (two's complement), for wrapping arithmetic."""
    return np.array(x & 0xFFFFFFFF, np.uint32).view(np.int32)[()]


_M1, _M2 = _i32(0x7FEB352D), _i32(0x846CA68B)  # lowbias32 multipliers
_PB, _PN, _PT, _PS = _i32(0x9E3779B1), _i32(0x85EBCA77), _i32(0xC2B2AE3D), _i32(0x27D4EB2F)


def _srl(x: Array, n: int) -> Array:
    return jax.lax.shift_right_logical(x, jnp.full_like(x, n))


def _mix(h: Array) -> Array:
    """A bijective 32-bit finaliser (lowbias32) on int32 with wrapping."""
    h = h ^ _srl(h, 16)
    h = h * _M1
    h = h ^ _srl(h, 15)
    h = h * _M2
    return h ^ _srl(h, 16)


def seed_words(rng: Array) -> Array:
    """Two int32 words from a PRNG key (typed or raw), the hash's seed."""
    bits = jax.random.bits(rng, (2,), jnp.uint32)
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def threshold(rate: float) -> int:
    """The 24-bit threshold below which a weight is dropped."""
    return int(round(float(rate) * (1 << 24)))


def multiplier(rate: float) -> float:
    """The scale of kept weights, `1 / (1 - rate)`."""
    return 1.0 / (1.0 - float(rate))


def keep(seed: Array, rate: float, b, n, t, s) -> Array:
    """Keep decision of weights `(b, n, t, s)`: bool of their broadcast shape.

    Args:
      seed: int32 `[2]` from `seed_words`.
      rate: static dropout rate in [0, 1).
      b, n, t, s: int32 batch, query-head, query and key indices, any
        broadcastable shapes (e.g. `t` a column `[bq, 1]`, `s` a row `[1, bk]`).
    """
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    row = _mix(seed[0] + i32(b) * _PB + i32(n) * _PN)
    row = _mix(row ^ (i32(t) * _PT))
    h = _mix(_mix(row + i32(s) * _PS) ^ seed[1])
    return _srl(h, 8) >= threshold(rate)
