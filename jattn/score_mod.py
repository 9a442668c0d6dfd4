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

A mod that depends on `(head, kv_position - q_position)` alone may say so,
`ScoreMod.from_distance(fn, params)` with `fn(params, head, distance) ->
term` (a distance-table mod): the xla and chunked paths then evaluate the
term once per call on the distances the call can see (`distance_table`, an
`[N, T + S - 1]` table; `jattn.attention.distance_table`) and the tiles read
the table; the Pallas kernels, with default positions, add Toeplitz tiles
cut from it (`jattn.attention.pallas.distance_tiles`); calls with given
positions run the per-logit `fn` derived from it.

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
    "DistanceForm",
    "ScoreMod",
    "TileParts",
    "apply_score_mod",
    "distance_table",
    "tile_parts",
    "with_settings",
    "with_tile_parts",
]


@dataclasses.dataclass(frozen=True)
class DistanceForm:
    """The second form of an additive mod that depends on `(head, distance)` alone.

    `fn(params, head, distance) -> term` with `distance = kv_position -
    q_position` (int32, clipped to `[-max_distance, max_distance]` first
    when `max_distance` is set), written as for scalars like a score mod's
    `fn`, and called with int32 arrays that broadcast together; returns a
    float array of their broadcast shape. Hashable (static).

    Why: such a term takes at most `T + S - 1` values per head, so the
    implementations evaluate it once per call on the distances the call can
    see (`distance_table`, an `[N, D]` table) and the tiles read the table,
    instead of calling it on every logit (Sandwich's 64 cosines per logit
    made it 41x plain attention).

    Attributes:
      fn: `fn(params, head, distance) -> term`.
      max_distance: the term is constant beyond this distance on either side
        (T5's buckets saturate, Shaw's ids clip): the table then has `2k + 1`
        entries whatever the positions. None: no clip.
    """

    fn: Callable[..., Array]
    max_distance: int | None = None


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
      distance: a `DistanceForm` when the mod is `score + term(head, kv -
        q)` (built by `ScoreMod.from_distance`, which derives `fn` from it):
        the xla and chunked paths then read a table of the term
        (`distance_table`), and the Pallas kernels, with default
        positions, Toeplitz tiles cut from it; None for any other mod. A mod rebuilt as
        `ScoreMod(mod.fn, params)` drops it and runs per logit, with the
        same values.
    """

    fn: Callable[..., Array]
    params: Any = None
    name: str = ""
    distance: DistanceForm | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"ScoreMod: fn must be callable, got {type(self.fn).__name__}")
        if self.distance is not None and not isinstance(self.distance, DistanceForm):
            raise TypeError(
                f"ScoreMod: distance must be a DistanceForm, got {type(self.distance).__name__}"
            )
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", "score_mod"))

    @classmethod
    def from_distance(
        cls,
        fn: Callable[..., Array],
        params: Any = None,
        *,
        name: str = "",
        max_distance: int | None = None,
    ) -> ScoreMod:
        """A mod `score + fn(params, head, kv_position - q_position)` (a distance-table mod).

        Its per-logit `fn` (what the Pallas kernels and any code that calls
        `mod.fn` run) is derived from the distance form, one function object
        per `(fn, max_distance)` so the jit cache is reused.

        Args:
          fn: `fn(params, head, distance) -> term` (see `DistanceForm`).
          params: the pytree `fn` indexes into.
          name: default `fn`'s name.
          max_distance: clip distances to `[-k, k]` before `fn` (T5, Shaw's
            bias); None for none.

        Returns:
          a `ScoreMod` with `distance` set.
        """
        if not callable(fn):
            raise TypeError(f"ScoreMod.from_distance: fn must be callable, got {type(fn).__name__}")
        if max_distance is not None:
            max_distance = int(max_distance)
            if max_distance < 0:
                raise ValueError(
                    f"ScoreMod.from_distance: max_distance must be >= 0, got {max_distance}"
                )
        form = DistanceForm(fn, max_distance)
        name = name or getattr(fn, "__name__", "score_mod").lstrip("_")
        return cls(_per_logit(form), params, name, form)


jax.tree_util.register_dataclass(
    ScoreMod, data_fields=["params"], meta_fields=["fn", "name", "distance"]
)


def _clipped_distance(form: DistanceForm, q_position: Array, kv_position: Array) -> Array:
    """`kv - q` (int32), clipped to the form's `max_distance` if it has one."""
    d = jnp.asarray(kv_position, jnp.int32) - jnp.asarray(q_position, jnp.int32)
    k = form.max_distance
    return d if k is None else jnp.clip(d, -k, k)


_PER_LOGIT: dict = {}


def _per_logit(form: DistanceForm) -> Callable[..., Array]:
    """The per-logit `fn` of a distance form, one function object per form."""
    if form not in _PER_LOGIT:

        def per_logit(params, score, batch, head, q_position, kv_position):
            term = form.fn(params, head, _clipped_distance(form, q_position, kv_position))
            return score + jnp.asarray(term).astype(score.dtype)

        name = getattr(form.fn, "__name__", "distance").lstrip("_")
        per_logit.__name__ = f"{name}_per_logit"
        _PER_LOGIT[form] = per_logit
    return _PER_LOGIT[form]


def distance_table(mod: ScoreMod, num_heads: int, lo: Array, size: int) -> Array:
    """The term of a distance mod at distances `lo + arange(size)`, per head.

    Args:
      mod: a mod with `distance` set (`ScoreMod.from_distance`).
      num_heads: N, the query heads.
      lo: int32 `[B']`: the first distance of each row's table (B' = 1 when
        every batch row shares one).
      size: D, the table length (static).

    Returns:
      float32 `[B', N, D]`: `out[b, h, c] = term(h, clip(lo[b] + c))`,
      differentiable in `mod.params` (the gradient of whatever reads the
      table reaches the params through this function's vjp).
    """
    form = mod.distance
    if form is None:
        raise ValueError(f"ScoreMod {mod.name!r} has no distance form (ScoreMod.from_distance)")
    lo = jnp.asarray(lo, jnp.int32).reshape(-1, 1, 1)
    head = jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1)
    d = lo + jnp.arange(size, dtype=jnp.int32).reshape(1, 1, size)  # [B', 1, D]
    term = form.fn(mod.params, head, _clipped_distance(form, 0, d))
    return jnp.broadcast_to(jnp.asarray(term, jnp.float32), (lo.shape[0], num_heads, size))


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
