"""Visibility masks as booleans: True means "may attend".

Visibility is part of the algorithm, not formatting: a wrong mask lets a model
read what it will never see at inference time, or lets one packed example read
its neighbour. Each function here builds one rule from positions or ids, so the
rules compose by logical AND (`combine`) and every implementation of attention
can rebuild the same rule per tile without materialising `[T, S]` in memory.

Segment id 0 is padding (docs/design.md): a padding token is no segment, so it
sees no key and no key sees it. `mark_padding` gives padding an id that
equals nothing (`PAD_Q` on the query side, `PAD_KV` on the key side, and
sequence lengths fold into the same ids), so the rule stays one equality
and padding is one more case of "different segments" in every
implementation, tile skipping included.

The rules of one attention call travel as one value,
`jattn.visibility.Visibility`, whose `rule` is `visible` here.

Shapes: B batch, T query length, S key length. Results broadcast against
`[B, N, T, S]` logits once a head axis is inserted (`as_logits_mask`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = [
    "PAD_KV",
    "PAD_Q",
    "as_logits_mask",
    "causal",
    "combine",
    "mark_padding",
    "padding",
    "padding_from_lengths",
    "segment",
    "visible",
    "window_pair",
]


# Segment ids of padding (id 0, or past a sequence length) once marked:
# equal to no real id and not to each other, at the bottom of the int32
# range so per-tile min/max of real ids stay tight and a tile whose largest
# id is one of these holds nothing but padding.
PAD_Q = int(np.iinfo(np.int32).min) + 1
PAD_KV = int(np.iinfo(np.int32).min)


def mark_padding(ids: Array, pad: int) -> Array:
    """Segment ids with padding (id 0) replaced by `pad` (`PAD_Q` for query
    ids, `PAD_KV` for key ids), which `visible`'s equality never matches.

    Args:
      ids: int `[..., L]` segment ids, >= 1 for real tokens, 0 for padding.
      pad: `PAD_Q` or `PAD_KV`.

    Returns:
      int32 `[..., L]`.
    """
    ids = jnp.asarray(ids, jnp.int32)
    return jnp.where(ids == 0, jnp.int32(pad), ids)


def window_pair(local_window_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """`local_window_size` as jax.nn takes it (an int or `(left, right)`) as a
    checked `(left, right)` pair of non-negative ints, or None."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, int | np.integer):
        pair = (int(local_window_size), int(local_window_size))
    else:
        try:
            left, right = local_window_size
            pair = (int(left), int(right))
        except (TypeError, ValueError):
            raise ValueError(
                "local_window_size must be an int or a (left, right) pair of ints, "
                f"got {local_window_size!r}"
            ) from None
    if pair[0] < 0 or pair[1] < 0:
        raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
    return pair


def visible(
    q_pos: Array | None,
    kv_pos: Array | None,
    *,
    is_causal: bool = False,
    window: tuple[int, int] | None = None,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
) -> Array | None:
    """The one visibility rule every implementation of attention applies.

    Operands arrive already laid out for broadcasting: query-side vectors as
    columns (`[..., T, 1]`), key-side vectors as rows (`[..., 1, S]`), so the
    same function serves the xla path on `[B, T, S]`, the chunked path on a
    tile, the kernels on `[bq, 1]` x `[1, bk]` values and the standalone masks
    below. A key is visible iff all the rules given hold:

    - causal: `kv_pos <= q_pos`;
    - window `(left, right)`: `q_pos - left <= kv_pos <= q_pos + right`
      (jax.nn's `local_window_size`, on positions, so packed rows get a
      window per segment);
    - segments: `q_seg == kv_seg`, on ids whose padding is marked
      (`mark_padding`), so a padding token sees nothing and is seen by
      nothing.

    Returns:
      bool of the broadcast shape, or None when no rule applies ("all visible").
    """
    vis = None

    def add(m):
        nonlocal vis
        vis = m if vis is None else jnp.logical_and(vis, m)

    if is_causal:
        add(kv_pos <= q_pos)
    if window is not None:
        left, right = window
        add(jnp.logical_and(kv_pos >= q_pos - left, kv_pos <= q_pos + right))
    if q_seg is not None:
        add(q_seg == kv_seg)
    return vis


def causal(q_positions: Array, kv_positions: Array) -> Array:
    """Key visible iff `kv_position <= q_position`.

    Args:
      q_positions: int `[..., T]`.
      kv_positions: int `[..., S]`.

    Returns:
      bool `[..., T, S]`.
    """
    return visible(q_positions[..., :, None], kv_positions[..., None, :], is_causal=True)


def segment(q_segment_ids: Array, kv_segment_ids: Array) -> Array:
    """Attend iff the query's and key's segment ids are equal and not 0
    (packed rows; id 0 is padding, which attends to nothing).

    Args:
      q_segment_ids: int `[..., T]`.
      kv_segment_ids: int `[..., S]`.

    Returns:
      bool `[..., T, S]`.
    """
    q_seg = mark_padding(q_segment_ids, PAD_Q)[..., :, None]
    kv_seg = mark_padding(kv_segment_ids, PAD_KV)[..., None, :]
    return visible(None, None, q_seg=q_seg, kv_seg=kv_seg)


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
