"""FIRE (Li et al. 2023) as a score mod: a per-head MLP of the normalised
distance, with hand-written backwards for the xla / chunked paths (matmuls)
and for the Pallas kernels (unit by unit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn.positions.tables import heads_and_positions
from jattn.score_mod import ScoreMod, TileParts, with_tile_parts

Array = jax.Array

__all__ = ["FIRE_HIDDEN", "fire_param_specs", "fire_score_mod", "init_fire_params"]

# Hidden units of FIRE's MLP (Li et al. use 32).
FIRE_HIDDEN = 32


def _inv_softplus(y: float) -> float:
    return float(np.log(np.expm1(y)))


def fire_param_specs(num_heads: int, hidden: int = FIRE_HIDDEN) -> tuple:
    """FIRE's parameters as `(name, initializer, shape, logical axis names)`.

    The one place their initial values are written: `init_fire_params` draws
    them, and the models' "fire" scheme declares them on each layer. `w1, b1
    [hidden]` (the MLP's input layer, shared by the heads), `w2 [N, hidden]`,
    `b2 [N]` (one output per head), and the unconstrained `c` and `L`
    scalars (`softplus(c) = 1`, `softplus(L) = 512` at init).
    """
    init = jax.nn.initializers
    return (
        ("w1", init.normal(1.0), (hidden,), (None,)),
        ("b1", init.zeros, (hidden,), (None,)),
        ("w2", init.normal(hidden**-0.5), (num_heads, hidden), ("heads", None)),
        ("b2", init.zeros, (num_heads,), ("heads",)),
        ("c", init.constant(_inv_softplus(1.0)), (), ()),
        ("L", init.constant(_inv_softplus(512.0)), (), ()),
    )


def init_fire_params(key: Array, num_heads: int, hidden: int = FIRE_HIDDEN) -> dict:
    """Initial FIRE parameters (see `fire_score_mod`), drawn as
    `fire_param_specs` says, one key a parameter."""
    specs = fire_param_specs(num_heads, hidden)
    keys = jax.random.split(key, len(specs))
    return {
        name: fn(k, shape, jnp.float32) for k, (name, fn, shape, _) in zip(keys, specs, strict=True)
    }


def _fire_units(w1, b1, w2, b2, x, head):
    """FIRE's MLP, one hidden unit at a time: `b2[head] + sum_h w2[head, h]
    relu(x w1[h] + b1[h])` (static indices and `head` only: lowerable in the
    kernels; no hidden axis is added to the tile)."""
    out = b2[head]
    for h in range(w1.shape[0]):
        out = out + w2[head, h] * jax.nn.relu(x * w1[h] + b1[h])
    return out


@jax.custom_vjp
def _fire_tile(w1, b1, w2, b2, x, head):
    """`_fire_units` for an index-array `head` (xla, chunked), with a matmul backward."""
    return _fire_units(w1, b1, w2, b2, x, head)


def _fire_tile_fwd(w1, b1, w2, b2, x, head):
    return _fire_tile(w1, b1, w2, b2, x, head), (w1, b1, w2, b2, x, head)


def _fire_tile_bwd(res, ct):
    """The MLP's backward as matmuls over the hidden axis: the cotangent laid
    out as `[heads, X]` (X: the position pairs), the units as `[X, hidden]`.
    Autodiff of the unit loop costs 64 tile-sized reductions instead (8x the
    time and 5x the temporaries on a 512 x 512 tile of 8 heads, CPU)."""
    w1, b1, w2, b2, x, head = res
    laid = heads_and_positions(ct, head, x, heads_first=True)
    if laid is None:  # no [heads, X] layout
        _, pull = jax.vjp(_fire_units, w1, b1, w2, b2, x, head)
        return pull(ct)[:5] + (None,)
    ctm, idx, xs = laid  # [heads, X], [heads], [X]
    hp = jax.lax.Precision.HIGHEST
    a = xs[:, None] * w1[None, :] + b1[None, :]  # [X, hidden]
    d_w2 = jnp.zeros_like(w2).at[idx].add(jnp.dot(ctm, jax.nn.relu(a), precision=hp))
    d_b2 = jnp.zeros_like(b2).at[idx].add(jnp.sum(ctm, axis=1))
    da = jnp.where(a > 0, jnp.dot(ctm.T, w2[idx], precision=hp), 0.0)  # [X, hidden]
    d_w1 = jnp.sum(da * xs[:, None], axis=0)
    d_b1 = jnp.sum(da, axis=0)
    dx = jnp.dot(da, w1, precision=hp).reshape(jnp.shape(x))
    return d_w1, d_b1, d_w2, d_b2, dx, None


_fire_tile.defvjp(_fire_tile_fwd, _fire_tile_bwd)


def _fire_input(params, i, j):
    """FIRE's MLP input `ψ(|i - j|) / ψ(max(L, i))`, `ψ(x) = log(c x + 1)`."""
    c = jax.nn.softplus(params["c"])
    thr = jax.nn.softplus(params["L"])
    d = jnp.abs(i - j).astype(jnp.float32)
    return jnp.log(c * d + 1.0) / jnp.log(c * jnp.maximum(thr, i.astype(jnp.float32)) + 1.0)


def _fire(params, score, batch, head, i, j):
    x = _fire_input(params, i, j)
    mlp = _fire_units if jnp.ndim(head) == 0 else _fire_tile  # a Pallas program, or all heads
    return score + mlp(params["w1"], params["b1"], params["w2"], params["b2"], x, head)


def _fire_views(params, batch, head, i, j):
    """What FIRE's MLP reads on one Pallas tile: `w1`, `b1`, the head's row
    `w2[head]`, `b2[head]` and the normalised distance `x` `[bq, bk]`."""
    x = _fire_input(params, i, j)
    return params["w1"], params["b1"], params["w2"][head], params["b2"][head], x


def _pick(v: Array, units: Array, h) -> Array:
    """`v[h]` of a vector without slicing (Triton-safe): a one-hot sum."""
    return jnp.sum(jnp.where(units == h, v, 0.0))


def _fire_core(views):
    """FIRE's MLP on a tile as a loop over the hidden units (`_fire_units`'s
    sum, in the same order), for the kernels: one unit's pre-activation is
    live at a time, and the kernel holds one loop body, not 32 copies."""
    w1, b1, w2h, b2h, x = views
    units = jax.lax.broadcasted_iota(jnp.int32, w1.shape, 0)

    def unit(h, out):
        a = x * _pick(w1, units, h) + _pick(b1, units, h)
        return out + _pick(w2h, units, h) * jnp.maximum(a, 0.0)

    return jax.lax.fori_loop(0, w1.shape[0], unit, jnp.zeros_like(x) + b2h)


def _fire_core_vjp(views, ct):
    """`_fire_core`'s backward, unit by unit, recomputing each pre-activation
    (relu's derivative 0 at 0, as jax.nn.relu's): `d w2[head, h] = sum(ct
    relu(a_h))`, `d a_h = ct w2[head, h] [a_h > 0]`, `d w1[h] = sum(d a_h x)`,
    `d b1[h] = sum(d a_h)`, `d x = sum_h d a_h w1[h]`, `d b2[head] = sum(ct)`."""
    w1, b1, w2h, b2h, x = views
    units = jax.lax.broadcasted_iota(jnp.int32, w1.shape, 0)

    def unit(h, carry):
        dx, dw1, db1, dw2 = carry
        w1h = _pick(w1, units, h)
        a = x * w1h + _pick(b1, units, h)
        da = jnp.where(a > 0, ct * _pick(w2h, units, h), 0.0)
        hit = units == h
        dw2 = dw2 + jnp.where(hit, jnp.sum(ct * jnp.maximum(a, 0.0)), 0.0)
        dw1 = dw1 + jnp.where(hit, jnp.sum(da * x), 0.0)
        db1 = db1 + jnp.where(hit, jnp.sum(da), 0.0)
        return dx + da * w1h, dw1, db1, dw2

    zeros = jnp.zeros_like(w1)
    init = (jnp.zeros_like(x), zeros, zeros, jnp.zeros_like(w2h))
    dx, dw1, db1, dw2 = jax.lax.fori_loop(0, w1.shape[0], unit, init)
    return dw1, db1, dw2, jnp.sum(ct).astype(jnp.result_type(b2h)), dx


with_tile_parts(_fire, TileParts(_fire_views, _fire_core, _fire_core_vjp))


def fire_score_mod(params: dict):
    """FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions
    Improves Long Context Transformers") as a score mod:

        score + f(ψ(|i - j|) / ψ(max(L, i))),   ψ(x) = log(c·x + 1),

    `f` a one-hidden-layer ReLU MLP from the scalar input to one value per
    head, with learned `c = softplus(params["c"]) > 0` and threshold `L =
    softplus(params["L"]) > 0` (positive by construction, so ψ stays finite).
    The paper writes `i - j` for causal attention; `|i - j|` equals it
    there and keeps the term finite for bidirectional attention.

    Triton-safe: the MLP runs unit by unit over the static hidden size with
    static indices (`w1[h]`) and `head` (`w2[head, h]`); no hidden axis is
    added to the tile. With an index-array `head` (xla, chunked) the same
    forward has a hand-written backward made of matmuls over the hidden axis
    (`_fire_tile_bwd`). The Pallas kernels run its `TileParts` instead
    (`_fire_core`: the units as a loop, with a hand-written backward that
    recomputes each unit), which keeps the dq kernels' registers from
    spilling and their compile short (`python benchmarks/aot.py`, docs/gpu.md).

    Args:
      params: from `init_fire_params` (or trained).

    Returns:
      a `jattn.ScoreMod` with params `params`.
    """

    return ScoreMod(_fire, params, "fire")
