"""Logits and visibility of one (query tile, key tile) pair, shared by the
pure-JAX implementations.

The xla path calls these once on the whole `[T, S]` problem; the chunked path
calls them on each tile, so the two agree by construction on what is visible
and how relative terms enter. Everything works in the grouped-head layout:
query heads N are split as `K x G` (K key/value heads, G queries per group), so
GQA/MQA never repeat keys or values in memory.

Shapes: B batch, K kv heads, G = N // K query heads per kv head, t / s the
tile lengths, H head dim, R = 2k + 1 Shaw relative distances.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jattn import masks
from jattn.score_mod import ScoreMod, apply_score_mod
from jattn.visibility import Visibility

Array = jax.Array


def group_heads(x_bn: Array, num_kv_heads: int) -> Array:
    """`[B, N or 1, t, s] -> [B, K or 1, G or 1, t, s]` for grouped logits."""
    b, n, t, s = x_bn.shape
    if n == 1:
        return x_bn[:, :, None]
    return x_bn.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


@jax.custom_jvp
def rel_gather(qr: Array, r: Array) -> Array:
    """Key term `q_t·key[r[t,s]]` from `qr = q @ keyᵀ`.

    Args:
      qr: `[B, K, G, t, R]` query dotted with every relative key embedding.
      r: int `[B, t, s]` relative ids.

    Returns:
      `[B, K, G, t, s]`, without ever forming a `[t, s, H]` tensor.
    """
    # The value by `take_along_axis`, which XLA fuses into the logits; the
    # derivative by `rel_gather_rows`, whose transpose (the backward) is one
    # scatter-add of rows of K·G heads. `take_along_axis`'s own backward
    # indexes every element by all five coordinates and made the xla path's
    # Shaw forward+backward 1.4-1.5x slower on the CPU (docs/benchmarks.md,
    # "Shaw's key term"). Values and gradients are the same, bit for bit.
    return rel_gather_by_take_along(qr, r)


@rel_gather.defjvp
def _rel_gather_jvp(primals, tangents):
    qr, r = primals
    return rel_gather(qr, r), rel_gather_rows(tangents[0], r)


def rel_gather_by_take_along(qr: Array, r: Array) -> Array:
    """`rel_gather` by a broadcast `take_along_axis` over `[B, K, G, t, s]`, with
    jax's derivative: its test oracle and (as `rel_gather`) its benchmark's peer."""
    idx = jnp.broadcast_to(r[:, None, None], (*qr.shape[:-1], r.shape[-1]))
    return jnp.take_along_axis(qr, idx, axis=-1)


def rel_gather_rows(qr: Array, r: Array) -> Array:
    """`rel_gather` with the heads last: one gather of a row of K·G values per
    (b, t, s), so that its transpose is one scatter-add of rows, the layout
    `rel_scatter` writes."""
    qr_last, bi, ti = _heads_last(qr)  # [B, t, R, KG]
    return _heads_back(qr_last[bi, ti, r], qr.shape)  # from [B, t, s, KG]


def rel_scatter(p: Array, r: Array, num_relative: int) -> Array:
    """Weight mass per relative id: `out[..., t, R] = Σ_s p[..., t, s] [r[t,s] = R]`.

    The value term is then `out @ value_table`, so the `[t, s, Hv]` tensor of
    gathered value embeddings never exists.

    Args:
      p: `[B, K, G, t, s]` attention weights.
      r: int `[B, t, s]`.
      num_relative: R.

    Returns:
      `[B, K, G, t, R]`, dtype of `p`.
    """
    # A scatter-add with the heads last: one pass over the tile, no one-hot
    # [t, s, R] tensor (10x faster than the one-hot einsum on the CPU).
    p_last, bi, ti = _heads_last(p)  # [B, t, s, KG]
    b, t, _, kg = p_last.shape
    out = jnp.zeros((b, t, num_relative, kg), p.dtype).at[bi, ti, r].add(p_last)
    return _heads_back(out, p.shape)  # from [B, t, R, KG]


def _heads_last(x: Array) -> tuple[Array, Array, Array]:
    """`[B, K, G, t, n]` as `[B, t, n, K·G]`, and the batch and row indices
    (`[B, 1, 1]`, `[1, t, 1]`) that with `r` `[B, t, s]` pick rows of K·G heads:
    the layout `rel_gather_rows` reads and `rel_scatter` writes."""
    b, k, g, t, n = x.shape
    last = jnp.moveaxis(x.reshape(b, k * g, t, n), 1, -1)
    return last, jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]


def _heads_back(x: Array, like: tuple[int, ...]) -> Array:
    """`[B, t, n, K·G]` back to `[B, K, G, t, n]`, `K` and `G` those of shape `like`."""
    b, t, n, _ = x.shape
    return jnp.moveaxis(x, -1, 1).reshape(b, like[1], like[2], t, n)


def visibility(vis: Visibility, *, kv_valid: Array | None, mask: Array | None) -> Array | None:
    """Boolean visibility of a tile, broadcastable to `[B, K, G, t, s]`:
    the value's rule (`jattn.visibility.Visibility.rule`) on the tile's positions
    and ids, and the user mask.

    Args:
      vis: the normalised value, or a tile cut from it (its arrays `[B, t]`,
        `[B, s]`).
      kv_valid: bool `[B, s]` or None (False for keys padded to a tile size).
      mask: bool `[B|1, K|1, G|1, t|1, s|1]` (already grouped) or None.

    Returns:
      bool array or None when everything is visible.
    """
    col = lambda x: x[:, None, None, :, None]  # noqa: E731
    row = lambda x: x[:, None, None, None, :]  # noqa: E731
    return masks.combine(vis.rule(col, row), None if kv_valid is None else row(kv_valid), mask)


def tile_logits(
    q: Array,
    k: Array,
    *,
    scale: float,
    bias: Array | None = None,
    qr: Array | None = None,
    r: Array | None = None,
) -> Array:
    """Scaled logits of one tile in float32.

    Args:
      q: `[B, K, G, t, H]`.
      k: `[B, K, s, H]`.
      scale: multiplies `q·k` and the Shaw key term.
      bias: grouped bias broadcastable to `[B, K, G, t, s]`, or None.
      qr: `[B, K, G, t, R]` Shaw key term table for this query tile, or None.
      r: int `[B, t, s]` relative ids (with `qr`).

    Returns:
      float32 `[B, K, G, t, s]`.
    """
    s = jnp.einsum("BKGtH,BKsH->BKGts", q, k, preferred_element_type=jnp.float32)
    if qr is not None:
        s = s + rel_gather(qr, r)
    s = s * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    return s


def apply_grouped_score_mod(
    mod: ScoreMod, s: Array, batch: Array, head0, q_pos: Array, kv_pos: Array
) -> Array:
    """A score mod on one tile of grouped logits.

    Args:
      mod: the score mod.
      s: float32 `[B, K, G, t, s]` scaled logits.
      batch: int `[B]`, the batch rows of this tile.
      head0: the first query head of this tile (0 unless the tile holds a
        subset of heads); head `k * G + g + head0` is passed to `fn`.
      q_pos, kv_pos: int `[B, t]`, `[B, s]` positions of the tile.

    Returns:
      float32 `[B, K, G, t, s]`.
    """
    _, k, g, _, _ = s.shape
    head = head0 + jnp.arange(k * g, dtype=jnp.int32).reshape(1, k, g, 1, 1)
    return apply_score_mod(
        mod,
        s,
        batch[:, None, None, None, None],
        head,
        q_pos[:, None, None, :, None],
        kv_pos[:, None, None, None, :],
    )


def grouped_score_mod_vjp(
    mod: ScoreMod,
    s: Array,
    batch: Array,
    head0,
    q_pos: Array,
    kv_pos: Array,
    apply: Callable[..., Array] | None = None,
) -> tuple[Array, Callable[[Array], tuple[Any, Array]]]:
    """`apply_grouped_score_mod` and its pullback, for a hand-written backward.

    Args: as `apply_grouped_score_mod`; `apply`: a function of its signature
      computing the same values another way (a distance table's window,
      `distance_table.tile_applier`), default `apply_grouped_score_mod`.

    Returns:
      `(out, pullback)`: `out` float32 `[B, K, G, t, s]`; `pullback(ds)` takes
      the cotangent of `out` (any float dtype) and returns `(d params, d s)`:
      the cotangent of `mod.params` (a pytree like it; float0 for integer
      leaves) and of the logits before the mod (dtype of `s`).
    """

    apply = apply_grouped_score_mod if apply is None else apply

    def f(params, logits):
        return apply(ScoreMod(mod.fn, params, mod.name), logits, batch, head0, q_pos, kv_pos)

    out, vjp = jax.vjp(f, mod.params, s)
    return out, lambda ds: vjp(ds.astype(out.dtype))


# Logits of invisible entries: a large finite negative (as jax.nn), so no
# primitive ever produces an Inf (`jax.debug_infs` stays quiet) and
# `exp(NEG - m)` underflows to exactly 0 for any finite row max m.
NEG = float(-0.7 * jnp.finfo(jnp.float32).max)


def finite_keys(
    key: Array, value: Array, assume_finite: bool = False
) -> tuple[Array, Array, Array]:
    """Keys and values whose non-finite entries cannot leak through a zero weight.

    A hidden key has weight exactly 0, but `0 · NaN = NaN`, so a NaN or Inf
    in the value (or key) of a key that a query cannot see would still reach
    that query's output and gradients through the matmuls. Selecting, not
    multiplying: non-finite entries become 0 in the operands of every
    matmul, and a key that had one gets a NaN `poison` added to its logits
    before the visibility rule, so a query that *sees* it still returns NaN
    (as jax.nn would) while one that does not never meets it.

    Args:
      key: `[..., S, H]`.
      value: `[..., S, Hv]` (same leading axes).
      assume_finite: the caller vouches both are finite (`NormalForm.assume_finite`):
        they are returned as they are with a zero poison: for finite inputs
        the same values as cleaning them, without the ops that do.

    Returns:
      `(key, value, poison)`: the cleaned operands (same shapes and dtypes)
      and float32 `[..., S]`, 0 for a finite key and NaN otherwise (no
      gradient).
    """

    if assume_finite:
        return key, value, jnp.zeros(key.shape[:-1], jnp.float32)

    def clean(x):
        ok = jnp.isfinite(x)
        return jnp.where(ok, x, jnp.zeros((), x.dtype)), jnp.all(ok, axis=-1)

    key, key_ok = clean(key)
    value, value_ok = clean(value)
    poison = jnp.where(key_ok & value_ok, 0.0, jnp.nan).astype(jnp.float32)
    return key, value, jax.lax.stop_gradient(poison)


def masked_softmax_parts(s: Array, vis: Array | None) -> tuple[Array, Array]:
    """Row max and unnormalised weights of a block of logits.

    Args:
      s: float `[..., s]` logits.
      vis: bool broadcastable to `s`, or None (all visible).

    Returns:
      `m [..., 1]`, the row max over visible entries (0 for a row with
      nothing visible; no gradient), and `p = exp(s - m)`, exactly 0 where
      invisible. Subtracting the max is a stabilisation, not a change of
      distribution; a row with no visible key (every key hidden, or every
      logit -inf, e.g. from a bias) gets weights 0, so it yields output 0
      and no gradient instead of NaN.
    """
    sv = s if vis is None else jnp.where(vis, s, jnp.asarray(NEG, s.dtype))
    m = jnp.max(sv, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(m > NEG / 2, m, 0.0))
    return m, jnp.exp(sv - m)  # exactly 0 where invisible: exp(NEG - m) underflows
