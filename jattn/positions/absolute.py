"""Absolute positions: vectors added to the token embeddings.

Shapes: `[...]` positions, `dim` the encoding width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = ["sinusoidal"]


def sinusoidal(positions: Array, dim: int, max_timescale: float = 10_000.0) -> Array:
    """The paper's sinusoidal encoding, interleaved sin/cos.

    `PE[p, 2i] = sin(p / max_timescale^(2i/dim))`,
    `PE[p, 2i+1] = cos(p / max_timescale^(2i/dim))` (Vaswani et al., 3.5).

    Args:
      positions: integer or float array `[...]` of positions.
      dim: encoding width; must be even.
      max_timescale: the paper's 10000.

    Returns:
      float32 array `[..., dim]`.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal: dim must be even, got {dim}")
    positions = jnp.asarray(positions, jnp.float32)
    i = np.arange(dim // 2, dtype=np.float64)
    inv_freq = jnp.asarray(max_timescale ** (-2.0 * i / dim), jnp.float32)  # [dim/2]
    angles = positions[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))  # [..., dim/2]
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., dim/2, 2]
    return pe.reshape(*positions.shape, dim)
