"""`jattn.ScoreMod`: a term of the attention logits written as a function.

A score mod is FlexAttention's `score_mod` for JAX: a function of one logit
and where it sits,

    fn(params, score, batch, head, q_position, kv_position) -> score

written as for scalars with jnp ops and indexing into `params` (ALiBi is
`score - slopes[head] * abs(q_position - kv_position)`). Every
implementation calls it where its logits are: the xla path on the whole
`[B, N, T, S]` matrix, the chunked path and the Pallas kernels on each tile,
forward and again in the backward, so no `[T, S]` array of the term is ever
built. Gradients reach query and key through `score` and the parameters
through `fn`.

It lives at the package root, beside `positions` and `masks`, because both
the attention implementations and `jattn.positions` (whose ALiBi, T5, Shaw
bias, FIRE and KERPLE are score mods) build on it.

Shapes: B batch, N query heads, T queries, S keys.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = [
    "ScoreMod",
    "TileParts",
    "apply_score_mod",
    "tile_parts",
    "with_settings",
    "with_tile_parts",
]


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """A function of the scaled logits and the parameters it reads.

    A pytree: `params` are its leaves (so they are traced, differentiated
    and sharded like any argument), `fn` is static (part of the jit cache
    key: pass the same function object to reuse a compilation).

    Attributes:
      fn: `fn(params, score, batch, head, q_position, kv_position) -> score`.
        Called with a float32 `score` and int32 `batch`, `head` (the query
        head, in `[0, N)`), `q_position` and `kv_position` (the positions
        given to attention, not indices) that broadcast together; returns an
        array of `score`'s shape. Applied to the scaled logits (after Shaw's
        key term and `bias`), before visibility and softmax.
      params: any pytree of arrays `fn` indexes into (None for none).
      name: shown in error messages and kernel reports (default `fn`'s name).
    """

    fn: Callable[..., Array]
    params: Any = None
    name: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"ScoreMod: fn must be callable, got {type(self.fn).__name__}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", "score_mod"))


jax.tree_util.register_dataclass(ScoreMod, data_fields=["params"], meta_fields=["fn", "name"])


def apply_score_mod(
    mod: ScoreMod, score: Array, batch: Array, head: Array, q_position: Array, kv_position: Array
) -> Array:
    """`mod.fn` on float32 logits and int32 indices, checked to keep `score`'s shape.

    Args:
      mod: the score mod.
      score: float logits of any shape the index arrays broadcast to.
      batch, head, q_position, kv_position: integer arrays broadcastable to
        `score` (e.g. `[B,1,1,1]`, `[1,N,1,1]`, `[B,1,T,1]`, `[B,1,1,S]`).

    Returns:
      float32 array of `score`'s shape.
    """
    score = score.astype(jnp.float32)
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
    out = mod.fn(mod.params, score, i32(batch), i32(head), i32(q_position), i32(kv_position))
    out = jnp.asarray(out)
    if out.shape != score.shape:
        raise ValueError(
            f"ScoreMod {mod.name!r}: fn must return an array of score's shape "
            f"{list(score.shape)}, got {list(out.shape)}"
        )
    return out.astype(jnp.float32)


_WITH_SETTINGS: dict = {}


def with_settings(fn: Callable[..., Array], **settings) -> Callable[..., Array]:
    """`fn` with keyword `settings` fixed, one function object per `(fn, settings)`.

    Why: `ScoreMod.fn` is static, part of the jit cache key, so a mod's
    settings that are not parameters (T5's bucket count and direction, a
    clip distance) must come with the same function object whenever they
    are equal, or each new `ScoreMod` compiles again. Write the term once,
    at module level, with its settings as keyword arguments, and fix them
    here:

        def _clipped(table, score, batch, head, i, j, *, k):
            return score + table[head, jnp.clip(j - i, -k, k) + k]

        mod = ScoreMod(with_settings(_clipped, k=4), table)  # same fn for k=4

    Args:
      fn: `fn(params, score, batch, head, q_position, kv_position, **settings)`.
      **settings: hashable values (ints, floats, bools, strings, tuples).

    Returns:
      a callable of the `ScoreMod.fn` signature, named `fn`'s name followed
      by the settings (shown in errors and kernel reports).
    """
    key = (fn, tuple(sorted(settings.items())))
    if key not in _WITH_SETTINGS:
        fixed = functools.partial(fn, **settings)
        name = getattr(fn, "__name__", "score_mod").lstrip("_")
        fixed.__name__ = "_".join([name, *(f"{k}={v}" for k, v in key[1])])
        _WITH_SETTINGS[key] = fixed
    return _WITH_SETTINGS[key]


@dataclasses.dataclass(frozen=True)
class TileParts:
    """An optional second form of an additive score mod, for the Pallas kernels.

    `fn(params, score, batch, head, q, kv) == score + core(views(params,
    batch, head, q, kv))`, where `views` picks what the term reads (written
    as `fn` is: indexing params, elementwise in the positions; the kernels
    rewrite and differentiate it like `fn`), and `core` computes the term
    from those views with its backward `core_vjp` written by hand. The
    kernels then run `core` and `core_vjp` as written, loops included, so
    they must be lowerable without the rewrite (no slicing of values: read
    element `h` of a vector as `sum(where(iota == h, v, 0))`).

    Why: autodiff of a term with many intermediates per logit (FIRE's MLP,
    one `[bq, bk]` pre-activation per hidden unit) keeps every intermediate
    of the tile live until the backward reaches it, which spills registers
    in the dq kernels; a hand-written backward that loops over the units and
    recomputes each one holds a few tiles only. The xla and chunked paths
    always call `fn`.

    Attributes:
      views: `(params, batch, head, q_position, kv_position) -> tuple` of arrays.
      core: `(views) -> term`, an array of the tile's shape.
      core_vjp: `(views, ct) -> d_views`, a tuple like `views` (the
        gradient of `sum(ct * core(views))` with respect to each view).
    """

    views: Callable[..., tuple]
    core: Callable[[tuple], Array]
    core_vjp: Callable[[tuple, Array], tuple]


def with_tile_parts(fn: Callable[..., Array], parts: TileParts) -> Callable[..., Array]:
    """Attach `parts` to `fn` (returned) for the Pallas kernels; `fn` must
    equal `score + parts.core(parts.views(...))`, which the tests of the
    mod should check against autodiff."""
    fn.tile_parts = parts
    return fn


def tile_parts(fn: Callable[..., Array]) -> TileParts | None:
    """The `TileParts` attached to `fn` by `with_tile_parts`, or None."""
    parts = getattr(fn, "tile_parts", None)
    return parts if isinstance(parts, TileParts) else None
