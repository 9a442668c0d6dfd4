"""The score-mod schemes, one component each: a learned or fixed term of the logits.

"alibi", "kerple", "sandwich", "fire" and "t5" act through the `score_mod`
hook alone (T5 also through `stack_state`, its table shared by a stack's
layers): each returns a `jattn.ScoreMod` built by its formula in
`jattn.positions`, which every implementation of `jattn.dot_product_attention`
applies per tile. FIRE is docs/schemes.md's worked example. Registered in
`jattn.models.schemes`. Shapes: N query heads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn import positions as pos_lib
from jattn.models.axes import param
from jattn.models.scheme import Scheme, SchemeOptions, SchemeParams, positive_int

Array = jax.Array

__all__ = [
    "Alibi",
    "AlibiOptions",
    "Fire",
    "FireOptions",
    "Kerple",
    "Sandwich",
    "T5",
    "T5Options",
    "T5RelativeBias",
]


def _constant(value: float):
    """An initialiser filling with `value`."""
    return lambda key, shape, dtype=jnp.float32: jnp.full(shape, value, dtype)


def _inv_softplus(y: float) -> float:
    return math.log(math.expm1(y))


@dataclasses.dataclass(frozen=True)
class AlibiOptions(SchemeOptions):
    """Options of "alibi".

    Attributes:
      mode: ALiBi in bidirectional layers (the encoder; cross-attention with
        `relative_cross`): "symmetric" (`-m|i - j|`, blind to the order of
        its inputs) or "offset" (the order-aware form: keys after the query
        pay a per-head offset of one slope, so left and right differ).
        Causal layers use the paper's `-m (i - j)`.
    """

    mode: str = "symmetric"

    def check(self):
        if self.mode not in ("symmetric", "offset"):
            raise ValueError(f"mode={self.mode!r}; choose 'symmetric' or 'offset'")


@dataclasses.dataclass(frozen=True)
class Alibi(Scheme):
    """Press et al.'s linear biases, fixed geometric slopes per head. Causal
    layers use the paper's `-m (i - j)`; bidirectional ones its `mode`:
    "symmetric" (`-m |i - j|`, blind to input order) or "offset" (keys after
    the query are further by a per-head offset `m`, which tells left from
    right; `jattn.positions.alibi_score_mod`)."""

    Options = AlibiOptions
    options_key = "alibi"

    relative: bool = True
    shift_invariant: bool = True

    def score_mod(self, module, cfg, site, state):
        mode = "causal" if site.causal else self.options(cfg).mode
        return pos_lib.alibi_score_mod(pos_lib.alibi_slopes(cfg.num_heads), mode=mode)


@dataclasses.dataclass(frozen=True)
class Kerple(Scheme):
    """Chi et al.'s KERPLE, logarithmic: `-r1 log(1 + r2 |i - j|)` per head and
    layer, `r1 = softplus(kerple/r1)`, `r2 = softplus(kerple/r2)` (positive by
    construction where the paper clamps; both 1 at init)."""

    relative: bool = True
    shift_invariant: bool = True

    def score_mod(self, module, cfg, site, state):
        n, one = cfg.num_heads, _constant(_inv_softplus(1.0))
        raw = SchemeParams(
            (("r1", one, (n,), ("heads",)), ("r2", one, (n,), ("heads",))),
            cfg.params_dtype,
            name="kerple",
        )()
        r1, r2 = (jax.nn.softplus(raw[k].astype(jnp.float32)) for k in ("r1", "r2"))
        return pos_lib.kerple_score_mod(r1, r2)


@dataclasses.dataclass(frozen=True)
class Sandwich(Scheme):
    """Chi et al.'s (2023) Sandwich: the inner product of the sinusoidal
    embeddings of the two positions, a function of `i - j` alone, scaled per
    head by ALiBi's `N / (8h)`; parameter-free, a distance-table score mod
    (`jattn.positions.sandwich_score_mod`). Even in `i - j`, so a
    bidirectional layer cannot tell left from right by it."""

    relative: bool = True
    shift_invariant: bool = True

    def score_mod(self, module, cfg, site, state):
        return pos_lib.sandwich_score_mod(cfg.num_heads)


@dataclasses.dataclass(frozen=True)
class FireOptions(SchemeOptions):
    """Options of "fire".

    Attributes:
      hidden: hidden units of FIRE's MLP (Li et al. use 32).
    """

    hidden: int = pos_lib.FIRE_HIDDEN

    def check(self):
        positive_int("hidden", self.hidden)


@dataclasses.dataclass(frozen=True)
class Fire(Scheme):
    """Li et al.'s FIRE: a per-layer MLP (`hidden` units) over
    `log(c|i - j| + 1) / log(c max(L, i) + 1)` with learned c and L
    (`jattn.positions.fire_score_mod`). It reads the query's own position
    (the normaliser), so it is not shift invariant."""

    Options = FireOptions
    options_key = "fire"

    relative: bool = True

    def score_mod(self, module, cfg, site, state):
        specs = pos_lib.fire_param_specs(cfg.num_heads, self.options(cfg).hidden)
        params = SchemeParams(specs, cfg.params_dtype, name="fire")()
        return pos_lib.fire_score_mod(jax.tree.map(lambda x: x.astype(jnp.float32), params))


@dataclasses.dataclass(frozen=True)
class T5Options(SchemeOptions):
    """Options of "t5".

    Attributes:
      num_buckets: relative buckets (even, >= 4).
      max_distance: the distance at which the buckets saturate (> num_buckets / 2).
      per_layer: a bias table per layer instead of one per stack.
    """

    num_buckets: int = 32
    max_distance: int = 128
    per_layer: bool = False

    def check(self):
        positive_int("num_buckets", self.num_buckets)
        if self.num_buckets < 4 or self.num_buckets % 2:
            raise ValueError(f"num_buckets must be even and >= 4, got {self.num_buckets}")
        if self.max_distance <= self.num_buckets // 2:
            raise ValueError(
                f"max_distance={self.max_distance} must exceed "
                f"num_buckets/2={self.num_buckets // 2}"
            )


class T5RelativeBias(nn.Module):
    """The learned T5 bias table `[num_buckets, N]` (one per stack or per layer)."""

    config: Any
    num_buckets: int

    @nn.compact
    def __call__(self) -> Array:
        """The table `[num_buckets, N]` in the params dtype."""
        cfg = self.config
        return param(
            self,
            "table",
            nn.initializers.normal(stddev=0.5),
            (self.num_buckets, cfg.num_heads),
            (None, "heads"),
            cfg.params_dtype,
        )


@dataclasses.dataclass(frozen=True)
class T5(Scheme):
    """Raffel et al.'s log-bucketed learned bias: a table per stack (shared by
    its layers; `per_layer`: one per layer), and one per cross-attention
    layer with `relative_cross`."""

    Options = T5Options
    options_key = "t5"

    relative: bool = True
    shift_invariant: bool = True

    def stack_state(self, module, cfg, *, causal):
        opts = self.options(cfg)
        if opts.per_layer:
            return None
        return T5RelativeBias(cfg, opts.num_buckets, name="t5_bias")()  # [buckets, N]

    def score_mod(self, module, cfg, site, state):
        opts, table = self.options(cfg), state
        if opts.per_layer or site.cross:  # the stacks' tables are for self-attention
            table = T5RelativeBias(cfg, opts.num_buckets, name="t5_bias")()
        return pos_lib.t5_score_mod(
            table.astype(jnp.float32).T,  # [N, buckets]
            max_distance=opts.max_distance,
            bidirectional=not site.causal,
        )
