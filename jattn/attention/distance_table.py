"""Distance-table score mods in the xla and chunked implementations.

A mod built by `jattn.ScoreMod.from_distance` is `score + term(head, kv -
q)`. Such a term takes at most one value per (head, distance), so before
the implementation runs, `with_table` evaluates it once per call on the
distances the call can see, a table `[B', N, D]` (`jattn.score_mod.distance_table`),
and hands the implementation an ordinary score mod that reads the table
(`lookup`): the tiles gather from it, forward and backward. The table is
built outside the implementation's custom VJP, so the params' gradient
flows as docs/design.md says of every score mod: the implementation's backward
scatter-adds each tile's score cotangent into `d table` (the vjp of the
read), and JAX's autodiff of `distance_table` takes it to the params.

Which distances a call sees, and so the table (D static, `lo` traced):

- default positions (`arange`): distances `[-(T-1), S-1]`, one table for
  every batch row, `lo = -(T-1)`, `D = T + S - 1` (T, S padded to whole
  tiles in the chunked path). A tile's distances are then a window of the
  table, expanded into the tile by slicing and reshaping (`toeplitz`), no
  gather at all (`lookup_arange` marks such a table).
- a mod with `max_distance = k` and given positions: distances clip to
  `[-k, k]`: `lo = -k`, `D = 2k + 1`, always enough.
- otherwise, given positions: per batch row b, `lo_b = min kv_b - max q_b`
  and `D = T + S - 1`. That covers every distance of row b iff
  `(max kv_b - min kv_b) + (max q_b - min q_b) <= T + S - 2`, true for
  contiguous, shifted and packed (restarting) positions; a row with gaps
  (randomised positions spread over M > T) may see more, and then the call
  runs the per-logit form instead (`lax.cond` on that check: both are
  compiled, one runs).

The Pallas kernels: with default positions both kernel families read the
table as one Toeplitz tile per tile diagonal, built from it in XLA
(`jattn.attention.pallas.distance_tiles`, which uses `toeplitz`); a call
with given positions runs the per-logit form
(`ScoreMod.fn`): neither family lowers a gather from a tile of indices, and
a one-hot read of a window of the table costs O(window) per logit, no less
than evaluating the term (docs/score_mods.md).

Shapes: B batch, B' 1 or B, N query heads (K kv heads x G per group), T
queries, S keys, D table length, t / s tile lengths.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn.score_mod import ScoreMod, distance_table

Array = jax.Array

__all__ = ["is_arange", "lookup", "lookup_arange", "tabulate", "tile_applier", "with_table"]


def lookup(params, score, batch, head, q_position, kv_position):
    """`score + table[b, head, kv - q - lo[b]]` (index clipped into the table).

    params: `{"table": [B', N, D], "lo": int32 [B']}`; with B' = 1 every
    batch row reads row 0. The clip is exact where the table covers the
    call's distances (and is the distance clip of a `max_distance` mod,
    whose table is `[-k, k]`)."""
    table, lo = params["table"], params["lo"]
    b = batch if table.shape[0] > 1 else jnp.zeros_like(batch)
    idx = jnp.clip(kv_position - q_position - lo[b], 0, table.shape[-1] - 1)
    return score + table[b, head, idx]


def lookup_arange(params, score, batch, head, q_position, kv_position):
    """`lookup` of a table built for `arange` positions (one row, `lo = -(T-1)`
    over the padded T): the same values; the xla and chunked paths read
    its windows by slicing (`tile_applier`) instead of a gather."""
    return lookup(params, score, batch, head, q_position, kv_position)


def is_arange(mod: ScoreMod | None) -> bool:
    """Whether `mod` reads a table built for `arange` positions."""
    return mod is not None and mod.fn is lookup_arange


def tabulate(nf, t_len: int, s_len: int) -> tuple[ScoreMod, Array | None]:
    """The table-reading mod of a call's distance mod, and whether it covers the call.

    Args:
      nf: the call's normal form; `nf.score_mod.distance` is set.
      t_len, s_len: T and S as the implementation tiles them (padded up to
        whole tiles in the chunked path, whose padded rows read the table too).

    Returns:
      `(mod, fits)`: `fits` is None when the table covers every distance by
      construction, else a traced bool scalar (see the module docstring).
    """
    mod = nf.score_mod
    n = nf.query.shape[2]
    k = mod.distance.max_distance
    fits = None
    if nf.visibility.default_positions:
        fn, lo, size = lookup_arange, jnp.full((1,), -(t_len - 1), jnp.int32), t_len + s_len - 1
    elif k is not None:
        fn, lo, size = lookup, jnp.full((1,), -k, jnp.int32), 2 * k + 1
    else:
        q, kv = nf.visibility.q_positions, nf.visibility.kv_positions  # [B, T], [B, S]
        size = q.shape[1] + kv.shape[1] - 1
        lo = jnp.min(kv, axis=1) - jnp.max(q, axis=1)  # [B]
        hi = jnp.max(kv, axis=1) - jnp.min(q, axis=1)
        fn, fits = lookup, jnp.all(hi - lo < size)
    table = distance_table(mod, n, lo, size)  # [B', N, D]
    name = f"{mod.name}_table"
    return ScoreMod(fn, {"table": table, "lo": lo.astype(jnp.int32)}, name), fits


def with_table(nf, run: Callable, t_len: int, s_len: int):
    """`run(nf)` with a distance mod read from its table (or `run(nf)` as is).

    Args:
      nf: the normal form.
      run: the implementation, `run(nf) -> (out, lse)`.
      t_len, s_len: as `tabulate`.
    """
    mod = nf.score_mod
    if mod is None or mod.distance is None:
        return run(nf)
    table_mod, fits = tabulate(nf, t_len, s_len)
    with_tab = nf.replace(score_mod=table_mod)
    if fits is None:
        return run(with_tab)
    return jax.lax.cond(fits, lambda: run(with_tab), lambda: run(nf))


def toeplitz(v: Array, t: int, s: int) -> Array:
    """`out[..., a, c] = v[..., c - a + t - 1]` for `v [..., t + s - 1]`: `[..., t, s]`.

    By slicing and reshaping alone: `v` repeated t times and read with a row
    stride of `t + s - 2` puts `v[c - a + t - 1]` at `(a, c)`. Its transpose
    (the backward) is a pad and a sum, no scatter."""
    w = t + s - 1
    if v.shape[-1] != w:
        raise ValueError(f"toeplitz: window of {v.shape[-1]} entries for a {t} x {s} tile")
    if t == 1:
        return v[..., None, :]
    lead = v.shape[:-1]
    flat = jnp.broadcast_to(v[..., None, :], (*lead, t, w)).reshape(*lead, t * w)
    flat = flat[..., t - 1 : t - 1 + t * (w - 1)]
    return flat.reshape(*lead, t, w - 1)[..., :s]


def tile_applier(q0, k0) -> Callable:
    """`apply(mod, s, batch, head0, q_pos, kv_pos)` for a tile of `lookup_arange`
    whose first query and key positions are `q0`, `k0` (traced ints), the
    positions being `q0 + arange(t)`, `k0 + arange(s)`: `s + window`, the
    table's window of the tile's distances expanded by `toeplitz`.

    The signature is `jattn.attention.scores.apply_grouped_score_mod`'s, whose
    `[B, K, G, t, s]` logits it takes (head0 is 0: every head)."""

    def apply(mod, s, batch, head0, q_pos, kv_pos):
        _, kh, g, t, sk = s.shape
        table, lo = mod.params["table"], mod.params["lo"]  # [1, N, D], [1]
        start = k0 - q0 - (t - 1) - lo[0]
        window = jax.lax.dynamic_slice_in_dim(table, start, t + sk - 1, axis=2)  # [1, N, W]
        term = toeplitz(window, t, sk).reshape(1, kh, g, t, sk)
        return s.astype(jnp.float32) + term

    return apply
