"""Shared by the score mods of `jattn.positions`: reading a per-head table
at computed indices in the form every implementation runs, and laying a
tile's cotangent out per head for the custom backwards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = ["as_f32", "heads_and_positions", "select_table"]


def as_f32(x) -> Array:
    """`x` as a float32 array (score-mod parameters)."""
    return jnp.asarray(x, jnp.float32)


def select_table(table: Array, head: Array, index: Array) -> Array:
    """`table[head, index]` for a table `[N, R]`, exactly (one value is
    selected, nothing summed), in the form each implementation can run.

    A scalar `head` (a Pallas program: one head per program) reads the table
    as a chain of compare-and-selects over its static axis, `where(index ==
    b, table[head, b], acc)`, which Triton and Mosaic lower (no gather with
    a tile of indices). An index array `head` (the xla and chunked paths,
    all heads of a tile at once) uses XLA's gather: the same values, and on
    the CPU the chain's autodiff would carry R tile-sized masked copies of
    the cotangent (measured: 2x the time and 4x the temporaries of the
    gather at L = 1024, `benchmarks/score_mod.py`).
    """
    if jnp.ndim(head) == 0:
        out = table[head, 0]
        for b in range(1, table.shape[1]):
            out = jnp.where(index == b, table[head, b], out)
        return out
    return _gather_table(table, head, index)


@jax.custom_vjp
def _gather_table(table: Array, head: Array, index: Array) -> Array:
    """`table[head, index]` by gather, for index arrays `head` and `index`
    that broadcast together (xla, chunked), with a backward that scatters
    rows (`_gather_table_bwd`)."""
    return table[head, index]


def _gather_table_fwd(table, head, index):
    return _gather_table(table, head, index), (table, head, index)


def _gather_table_bwd(res, ct):
    """The table's gradient as one scatter-add of rows: the cotangent laid out
    as `[X, heads]` (X: the entries `index` varies over) added into a
    `[R, heads]` buffer at `index`, one update of all heads per entry. The
    autodiff of the gather scatters every element on its own (2-index
    scatter, one update per head and entry), which on the CPU was most of
    the T5 score mod's time: 52 ms against ~9 ms for this form on a 512 x
    512 tile of 8 heads (`benchmarks/score_mod.py`, docs/benchmarks.md)."""
    table, head, index = res
    laid = heads_and_positions(ct, head, index, heads_first=False)
    if laid is None:  # no [X, heads] layout
        _, pull = jax.vjp(lambda tb: tb[head, index], table)
        return pull(ct)[0], None, None
    ctm, heads, at = laid  # [X, heads], [heads], [X]
    rows = jnp.zeros((table.shape[1], ctm.shape[1]), ct.dtype).at[at].add(ctm)  # [R, heads]
    d_table = jnp.zeros(table.shape, ct.dtype).at[heads].add(rows.T)  # [N, R]
    return d_table.astype(table.dtype), None, None


def heads_and_positions(ct: Array, head: Array, position: Array, *, heads_first: bool):
    """A score mod tile's cotangent `ct` as a `[heads, X]` (or `[X, heads]`)
    matrix, with the head index of each row and the position argument of
    each column, for the custom backwards of the table read and FIRE.

    `head` and `position` broadcast against `ct` along their own axes; None
    when they share an axis or `ct` varies along another (no such layout:
    the caller falls back to autodiff)."""
    nd = ct.ndim
    hr = jnp.reshape(head, (1,) * (nd - jnp.ndim(head)) + jnp.shape(head))
    xr = jnp.reshape(position, (1,) * (nd - jnp.ndim(position)) + jnp.shape(position))
    hv = [a for a in range(nd) if hr.shape[a] > 1]
    xv = [a for a in range(nd) if xr.shape[a] > 1]
    rest = [a for a in range(nd) if a not in hv and a not in xv]
    if set(hv) & set(xv) or any(ct.shape[a] > 1 for a in rest):
        return None
    order = (hv + xv if heads_first else xv + hv) + rest
    nh = int(np.prod([ct.shape[a] for a in hv], dtype=np.int64))

    def lay_out(v, varying):  # broadcast over its varying axes, in `order`, flattened
        full = [ct.shape[a] if a in varying else 1 for a in range(nd)]
        return jnp.transpose(jnp.broadcast_to(v, full), order).reshape(-1)

    ctm = jnp.transpose(ct, order).reshape((nh, -1) if heads_first else (-1, nh))
    return ctm, lay_out(hr, hv), lay_out(xr, xv)


_gather_table.defvjp(_gather_table_fwd, _gather_table_bwd)
