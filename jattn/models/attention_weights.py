"""A layer's attention weights `[B, N, T, S]`, materialised for the probe's capture pass.

`TransformerConfig.capture_attention` makes every `Attention` layer sow its
weights into "intermediates" (`jattn.analysis.probe` reads them): the
softmax of the logits with the layer's scheme terms (score mod, forget
gates' row and column terms, Shaw tables) as full `[B, N, T, S]` arrays,
which the implementations never build. Inspection only: the layer's output
is `jattn.dot_product_attention`'s, computed beside it.

Shapes: B batch, T queries, S keys, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn.attention import attention_weights
from jattn.positions import ShawRelative
from jattn.score_mod import ScoreMod, apply_score_mod
from jattn.visibility import Visibility

Array = jax.Array

__all__ = ["materialised_weights"]


def materialised_weights(
    q: Array,
    key: Array,
    mod: ScoreMod | None,
    shaw: ShawRelative | None,
    row_col: tuple[Array, Array] | None,
    mask: Array | None,
    vis: Visibility,
) -> Array:
    """The weights `[B, N, T, S]` of queries `q` `[B, T, N, H]` over keys `key`
    `[B, S, K, H]` under the score mod `mod`, the forget gates' `row_col`
    terms `([B, N, T], [B, N, S])`, Shaw's tables `shaw`, `mask` and `vis`
    (what the layer hands `jattn.dot_product_attention`)."""
    bias = None if mod is None else _materialise(mod, q.shape, key.shape, vis)
    if row_col is not None:  # the forget gates, materialised as the probe's weights are
        a, c = row_col
        terms = a[:, :, :, None] + c[:, :, None, :]  # [B, N, T, S]
        bias = terms if bias is None else bias + terms
    return attention_weights(q, key, bias, mask, visibility=vis, relative=shaw)  # [B, N, T, S]


def _materialise(mod: ScoreMod, q_shape, k_shape, vis: Visibility) -> Array:
    """The additive term `[B, N, T, S]` of a positional score mod, for the
    materialising probe pass only (`capture_attention`): the mod applied to
    zero logits, which is the term itself for every additive mod."""
    b, t, n, _ = q_shape
    s = k_shape[1]
    vis = vis.normalised(b, t, s)  # positions int32 [B, T], [B, S] (arange if none)
    q_pos, kv_pos = vis.q_positions, vis.kv_positions
    return apply_score_mod(
        mod,
        jnp.zeros((b, n, t, s), jnp.float32),
        jnp.arange(b)[:, None, None, None],
        jnp.arange(n)[None, :, None, None],
        q_pos[:, None, :, None],
        kv_pos[:, None, None, :],
    )  # [B, N, T, S]
