"""The reverse scan: key tiles visited from the diagonal backwards, per query tile.

Stick-breaking attention and CoPE (`jattn.attention.stick_breaking`,
`jattn.attention.cope`) need, at logit `(i, j)`, a sum over the keys between
`j` and `i`: the softplus of the logits for stick-breaking, the gates for
CoPE. A tile only holds its own keys, so the sum over the keys to its right is
carried from tile to tile: each query tile scans its key tiles last to first,
and the carry holds, per query row, the running sum over the keys already
visited (those to the right). Inside a tile, the sum over the tile's own keys
to the right of `j` is a reversed cumulative sum (`lax.cumsum(reverse=True)`,
no subtraction, so a huge term never cancels a small one).

Memory: the query tiles run one after another (`lax.map`) and each one is a
`jax.checkpoint`, so plain autodiff through `scan` (CoPE's gradient)
recomputes a query tile's scan instead of keeping it: the backward of one
query tile keeps that tile's residuals, O(t·S) per head, and the carry
across query tiles is the inputs only, so memory is linear in the length for
fixed tiles, never `[T, S]`. `scan_with_key_sums` is the same scan for a
hand-written backward (stick-breaking's custom VJP): it sums per-key terms
(the keys' and values' gradients) over the query tiles, and keeps one tile's
arrays at a time. Key tiles with nothing visible (above the diagonal,
another segment, padding) are skipped with `lax.cond`.

Keys are taken in their index order: key `k` lies "between" `j` and `i` when
`j < k` in the key axis and `k` is visible to `i` (causal by position and in
`i`'s segment). With the default positions (`arange`) and segments that are
contiguous runs, that is the papers' definition.

Shapes: the letters of `jattn.attention.legend`; per-query inputs are
`[B, T, ...]`, per-key inputs `[B, S, ...]`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn import masks

Array = jax.Array


def inputs(query: Array, key: Array, value: Array, name: str) -> tuple[int, int, int]:
    """Checks `[B,T,N,H]` / `[B,S,K,H]` / `[B,S,K,Hv]` (K divides N) with one-line
    errors naming `name`; returns `(B, K, G)`."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"{name}: query, key and value must be rank 4 ([B,T,N,H], [B,S,K,H], "
            f"[B,S,K,Hv]); got shapes {query.shape}, {key.shape}, {value.shape}"
        )
    b, _, n, h = query.shape
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[3] != h:
        raise ValueError(
            f"{name}: key {key.shape} and value {value.shape} do not match query {query.shape}"
        )
    k = key.shape[2]
    if n % k:
        raise ValueError(f"{name}: key heads K={k} must divide query heads N={n}")
    return b, k, n // k


def ids(x: Array | None, b: int, length: int, fill: int | None, name: str) -> Array:
    """Positions or segment ids as int32 `[B, L]`: `arange(L)` (fill None) or
    `fill` everywhere when `x` is None."""
    if x is None:
        if fill is None:
            return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        return jnp.full((b, length), fill, jnp.int32)
    x = jnp.asarray(x)
    if x.shape != (b, length) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be int [B, L] = {(b, length)}; got {x.dtype}{x.shape}")
    return x.astype(jnp.int32)


def visibility(q_pos: Array, kv_pos: Array, q_seg: Array, kv_seg: Array) -> Array:
    """bool `[B, T, S]`: causal by position and in the query's segment (id 0 is
    padding, which sees nothing and is seen by nothing)."""
    return masks.causal(q_pos, kv_pos) & masks.segment(q_seg, kv_seg)


def exclusive_suffix_sum(x: Array) -> Array:
    """`y[..., j] = sum_{k > j} x[..., k]` over the last axis, by a reversed
    cumulative sum shifted by one (no subtraction)."""
    incl = jax.lax.cumsum(x, axis=x.ndim - 1, reverse=True)
    return jnp.concatenate([incl[..., 1:], jnp.zeros_like(incl[..., :1])], axis=-1)


def _tiles(x: Array, block: int, padded: int) -> Array:
    """`[B, L, ...]` -> `[n, B, block, ...]`, zero-padded to `padded` (segment
    id 0 is padding, so padded rows and keys are invisible)."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, padded - x.shape[1])
    x = jnp.pad(x, pad)
    x = x.reshape(x.shape[0], padded // block, block, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def scan(
    step: Callable,
    init: Callable,
    finish: Callable,
    rows,
    cols,
    pos_seg: tuple[Array, Array, Array, Array],
    *,
    block_q: int,
    block_k: int,
):
    """Runs the reverse scan and returns `finish`'s pytree of `[B, T, ...]`.

    Args:
      step: `(carry, row_tile, col_tile, vis [B, t, s]) -> carry`, one key tile.
      init: `row_tile -> carry`, before the query tile's first (rightmost) key tile.
      finish: `(carry, row_tile) -> pytree of [B, t, ...]`.
      rows: pytree of per-query arrays `[B, T, ...]`.
      cols: pytree of per-key arrays `[B, S, ...]`.
      pos_seg: `(q_pos [B,T], kv_pos [B,S], q_seg [B,T], kv_seg [B,S])`, int32.
      block_q, block_k: the tile lengths `t` and `s`.
    """
    q_pos, kv_pos, q_seg, kv_seg = pos_seg
    t, s = q_pos.shape[1], kv_pos.shape[1]
    block_q, block_k = min(block_q, t), min(block_k, s)
    tp = -(-t // block_q) * block_q
    sp = -(-s // block_k) * block_k
    row_tiles = jax.tree.map(lambda x: _tiles(x, block_q, tp), (rows, q_pos, q_seg))
    col_tiles = jax.tree.map(lambda x: _tiles(x, block_k, sp), (cols, kv_pos, kv_seg))
    col_tiles = jax.tree.map(lambda x: x[::-1], col_tiles)  # last key tile first

    @jax.checkpoint
    def query_tile(row_tile):
        row, qp, qs = row_tile

        def body(carry, col_tile):
            col, kp, ks = col_tile
            vis = visibility(qp, kp, qs, ks)
            carry = jax.lax.cond(jnp.any(vis), lambda c: step(c, row, col, vis), lambda c: c, carry)
            return carry, None

        carry, _ = jax.lax.scan(body, init(row), col_tiles)
        return finish(carry, row)

    out = jax.lax.map(query_tile, row_tiles)  # [nq, B, t, ...]

    def untile(x):
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], tp, *x.shape[3:])[:, :t]

    return jax.tree.map(untile, out)


def scan_with_key_sums(
    step: Callable,
    init: Callable,
    finish: Callable,
    key_zeros: Callable,
    rows,
    cols,
    pos_seg: tuple[Array, Array, Array, Array],
    *,
    block_q: int,
    block_k: int,
):
    """`scan` for a backward pass: `step` also returns per-key terms, summed
    over the query tiles (the keys' and values' gradients).

    Args:
      step: `(carry, row_tile, col_tile, vis) -> (carry, pytree of [B, s, ...])`.
      init, finish, rows, cols, pos_seg, block_q, block_k: as `scan`.
      key_zeros: `col_tile -> pytree of zeros [B, s, ...]`, the terms of a
        skipped key tile.

    Returns:
      `(finish's pytree of [B, T, ...], the summed terms, a pytree of [B, S, ...])`.
      Not differentiable (it is the backward); memory is the inputs, the
      per-key sums and one tile's arrays.
    """
    q_pos, kv_pos, q_seg, kv_seg = pos_seg
    t, s = q_pos.shape[1], kv_pos.shape[1]
    block_q, block_k = min(block_q, t), min(block_k, s)
    tp = -(-t // block_q) * block_q
    sp = -(-s // block_k) * block_k
    row_tiles = jax.tree.map(lambda x: _tiles(x, block_q, tp), (rows, q_pos, q_seg))
    col_tiles = jax.tree.map(lambda x: _tiles(x, block_k, sp), (cols, kv_pos, kv_seg))
    col_tiles = jax.tree.map(lambda x: x[::-1], col_tiles)  # last key tile first
    sums0 = jax.vmap(key_zeros)(col_tiles[0])  # [nk, B, s, ...], reversed like col_tiles

    def query_tile(sums, row_tile):
        row, qp, qs = row_tile

        def body(carry, col_tile):
            col, kp, ks = col_tile
            vis = visibility(qp, kp, qs, ks)
            return jax.lax.cond(
                jnp.any(vis),
                lambda c: step(c, row, col, vis),
                lambda c: (c, key_zeros(col)),
                carry,
            )

        carry, terms = jax.lax.scan(body, init(row), col_tiles)
        return jax.tree.map(jnp.add, sums, terms), finish(carry, row)

    sums, out = jax.lax.scan(query_tile, sums0, row_tiles)

    def untile(x, length, padded):
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], padded, *x.shape[3:])[:, :length]

    sums = jax.tree.map(lambda x: untile(x[::-1], s, sp), sums)
    return jax.tree.map(lambda x: untile(x, t, tp), out), sums
