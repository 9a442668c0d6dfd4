"""Relative positions read as tables inside attention: Shaw et al.'s
clipped distance ids and key / value tables, and Transformer-XL's relative
attention rewritten as Shaw's key table plus a bias table.

Shapes: T query length, S key length, N heads, H head dim, D model width,
R = 2k + 1 clipped distances.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn.positions.absolute import sinusoidal
from jattn.positions.tables import as_f32

Array = jax.Array

__all__ = ["ShawRelative", "relative_ids", "transformer_xl_tables"]


def relative_ids(q_positions: Array, kv_positions: Array, max_distance: int) -> Array:
    """Clipped relative distance ids of Shaw et al.: `clip(kv - q, -k, k) + k`.

    Args:
      q_positions: int `[..., T]`.
      kv_positions: int `[..., S]`.
      max_distance: the clip distance k >= 0.

    Returns:
      int32 `[..., T, S]` with values in `[0, 2k]`.
    """
    if max_distance < 0:
        raise ValueError(f"relative_ids: max_distance must be >= 0, got {max_distance}")
    q = jnp.asarray(q_positions, jnp.int32)
    kv = jnp.asarray(kv_positions, jnp.int32)
    d = kv[..., None, :] - q[..., :, None]  # [..., T, S]
    return jnp.clip(d, -max_distance, max_distance) + max_distance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShawRelative:
    """Shaw et al. (2018) relative position tables for one attention call.

    With `r = clip(kv_pos - q_pos, -k, k) + k`, attention computes
    `logit[t,s] = scale * (q_t·k_s + q_t·key[r]) + bias[t,s]` and
    `out_t = Σ_s w[t,s] * (v_s + value[r])`.

    Attributes:
      key: `[2k+1, H]` (shared by all heads, as in the paper) or
        `[N, 2k+1, H]` (per head), or None for no key term.
      value: `[2k+1, Hv]` or `[N, 2k+1, Hv]`, or None for no value term.
      max_distance: the clip distance k (static).
    """

    key: Array | None = None
    value: Array | None = None
    max_distance: int = dataclasses.field(default=16, metadata=dict(static=True))

    @property
    def num_relative(self) -> int:
        return 2 * self.max_distance + 1


def transformer_xl_tables(
    w_r: Array, u: Array, v: Array, max_distance: int, scale: float
) -> tuple[Array, Array]:
    """Dai et al.'s (Transformer-XL) relative attention as Shaw's per-head key
    table plus a per-head distance bias.

    Their logit of query i and key j is `(q_i + u)·k_j + (q_i + v)·W_R R(i - j)`
    (times `scale`), with R the sinusoidal embedding of the distance and
    per-head u, v `[N, H]`, W_R `[D, N, H]`. Splitting
    `(q + v)·W_R R = (q + u)·W_R R + (v - u)·W_R R`, attention over the
    queries `q + u` with Shaw's key table `W_R R(i - j)` `[N, 2k+1, H]`
    gives the first two terms, and the last, a function of (head, distance)
    alone, is a Shaw bias table `[N, 2k+1]` (already scaled, as score mods
    act on scaled logits). The tables are O(k); attention's Shaw term then
    costs O(T·k) a head, linear in L for a fixed clip k (with k ~ L, as the
    scheme's default clip, it is O(L^2) like the logits themselves).

    Distances are clipped at k (Shaw's id `r = clip(j - i, -k, k) + k`, so
    `i - j = k - r`).

    Args:
      w_r: `[D, N, H]`, the projection of the relative embedding.
      u, v: `[N, H]`, the content and position biases.
      max_distance: the clip distance k.
      scale: the logits' scale (`1/sqrt(H)`).

    Returns:
      float32 `(key_table [N, 2k+1, H], bias_table [N, 2k+1])`.
    """
    k = int(max_distance)
    d = w_r.shape[0]
    w_r, u, v = as_f32(w_r), as_f32(u), as_f32(v)
    distances = k - jnp.arange(2 * k + 1)  # [R]: i - j of relative id r
    rel = sinusoidal(distances, d)  # [R, D]
    key_table = jnp.einsum("RD,DNH->NRH", rel, w_r)  # [N, R, H]
    bias = scale * jnp.einsum("NH,NRH->NR", v - u, key_table)  # [N, R]
    return key_table, bias
