"""Visibility masks as booleans: True means "may attend".

Visibility is part of the algorithm, not formatting: a wrong mask lets a model
read what it will never see at inference time, or lets one packed example read
its neighbour. Each function here builds one rule from positions or ids, so the
rules compose by logical AND (`combine`) and every implementation of attention
can rebuild the same rule per tile without materialising `[T, S]` in memory.

Shapes: B batch, T query length, S key length. Results broadcast against
`[B, N, T, S]` logits once a head axis is inserted (`as_logits_mask`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = [
    "as_logits_mask",
    "causal",
    "combine",
    "padding",
    "padding_from_lengths",
    "segment",
]


def causal(q_positions: Array, kv_positions: Array) -> Array:
    """Key visible iff `kv_position <= q_position`.

    Args:
      q_positions: int `[..., T]`.
      kv_positions: int `[..., S]`.

    Returns:
      bool `[..., T, S]`.
    """
    return kv_positions[..., None, :] <= q_positions[..., :, None]


def segment(q_segment_ids: Array, kv_segment_ids: Array) -> Array:
    """Attend iff the query's and key's segment ids are equal (packed rows).

    Args:
      q_segment_ids: int `[..., T]`.
      kv_segment_ids: int `[..., S]`.

    Returns:
      bool `[..., T, S]`.
    """
    return q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]


def padding(q_valid: Array, kv_valid: Array) -> Array:
    """Attend iff both the query and the key are real tokens.

    Args:
      q_valid: bool `[..., T]`.
      kv_valid: bool `[..., S]`.

    Returns:
      bool `[..., T, S]`.
    """
    return jnp.logical_and(q_valid[..., :, None], kv_valid[..., None, :])


def padding_from_lengths(lengths: Array, max_len: int) -> Array:
    """Validity of each position given per-row lengths.

    Args:
      lengths: int `[B]`.
      max_len: L.

    Returns:
      bool `[B, L]`, True for the first `lengths[b]` positions.
    """
    return jnp.arange(max_len)[None, :] < jnp.asarray(lengths)[:, None]


def combine(*masks: Array | None) -> Array | None:
    """Logical AND of broadcastable boolean masks; `None` entries are skipped.

    Returns None when every entry is None ("everything visible").
    """
    out = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else jnp.logical_and(out, m)
    return out


def as_logits_mask(mask_bts: Array) -> Array:
    """Insert the head axis: `[B, T, S] -> [B, 1, T, S]`."""
    return mask_bts[:, None, :, :]
