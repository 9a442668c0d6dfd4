"""The built-in positional schemes, each one component, registered in `SCHEMES`.

Each class here is a `jattn.models.scheme.Scheme` (what a component is, its
hooks and the registry are there): its options (`Options`, a frozen dataclass
of its own with its defaults and checks), and the hooks it overrides. The
arithmetic is in `jattn.positions`; a hook reads the config and its options,
declares the parameters and calls it:

    SCHEMES["alibi"].score_mod(layer, config, site, state)  # a jattn.ScoreMod

Hooks that own parameters receive the flax module to declare them on
(`axes.param(module, ...)`), so a scheme's tables keep the checkpoint names
they had before the registry (`rel_key`, `rel_bias`, `t5_bias/table`,
`positions/table`). The relative hooks (`rotate`, `score_mod`, `shaw`) act in
self-attention and, with `TransformerConfig.relative_cross`, in
decoder-to-encoder attention (`Site.cross`); `Site.causal` tells a causal
(decoder) layer from a bidirectional one.

Adding a scheme: docs/schemes.md (FIRE is the worked example). One file over
500 lines on purpose: the 13 components (about 45 lines each, options
included) read side by side, the registry at the end. Shapes: B batch, T
queries, S keys, N query heads, K kv heads, H head dim, D width.
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
from jattn.models.data_schemes import Cope, Forgetting, StickBreaking
from jattn.models.scheme import (
    SCHEMES,
    PositionOptions,
    Scheme,
    SchemeOptions,
    SchemeParams,
    Site,
    default_position_options,
    get_scheme,
    int_at_least_0,
    option_groups,
    positive_int,
    register,
)
from jattn.positions import ShawRelative

Array = jax.Array

__all__ = [
    "SCHEMES",
    "SHAW_TERMS",
    "PositionOptions",
    "Scheme",
    "SchemeOptions",
    "Site",
    "default_position_options",
    "get_scheme",
    "option_groups",
    "register",
]

_xavier = jax.nn.initializers.xavier_uniform


# -- absolute ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sinusoidal(Scheme):
    """Vaswani et al.'s sinusoids added to the embeddings."""

    absolute: bool = True

    def check(self, cfg):
        if cfg.d_model % 2:
            raise ValueError(
                f"TransformerConfig.d_model={cfg.d_model} must be even for sinusoidal positions"
            )

    def embed(self, module, cfg, positions):
        return pos_lib.sinusoidal(positions, cfg.d_model)  # [B, T, D]


@dataclasses.dataclass(frozen=True)
class Learned(Scheme):
    """A learned vector per position, `max_len` rows (positions beyond are clipped)."""

    absolute: bool = True

    def max_position(self, cfg):
        return cfg.max_len

    def embed(self, module, cfg, positions):
        table = param(
            module,
            "table",
            nn.initializers.normal(stddev=cfg.d_model**-0.5),
            (cfg.max_len, cfg.d_model),
            ("length", "embed"),
            cfg.params_dtype,
        )  # [max_len, D]
        return jnp.take(table, positions, axis=0, mode="clip")  # [B, T, D]


# -- Shaw et al. ------------------------------------------------------------------------


# The terms of Shaw's relative attention a model can have (`ShawOptions.terms`, "+"-joined):
# "key": a^K, a learned vector per clipped distance added to the keys (Shaw et al.);
# "value": a^V, the same for the values (Shaw et al.);
# "bias": a learned scalar per clipped distance and head added to the logits
#   (Ontañón et al. 2022's "rel-b"; with "key" their "rel-eb").
SHAW_TERMS = ("key", "value", "bias")


@dataclasses.dataclass(frozen=True)
class ShawOptions(SchemeOptions):
    """Options of "shaw" and "sinusoidal+shaw".

    Attributes:
      max_distance: Shaw's clip distance k.
      terms: which of Shaw's terms the model has, "+"-joined from
        `SHAW_TERMS`: "key+value" (Shaw et al.), "key" (Ontañón et al.'s
        rel-e), "bias" (rel-b), "key+bias" (rel-eb), ...
    """

    max_distance: int = 16
    terms: str = "key+value"

    def check(self):
        positive_int("max_distance", self.max_distance)
        terms = str(self.terms).split("+")
        if len(set(terms)) != len(terms) or not set(terms) <= set(SHAW_TERMS):
            raise ValueError(
                f"terms={self.terms!r} must join distinct terms of {SHAW_TERMS} with '+', "
                "e.g. 'key+value', 'key', 'bias', 'key+bias'"
            )

    @property
    def term_set(self) -> frozenset[str]:
        """The terms of `terms`, e.g. {"key", "value"}."""
        return frozenset(self.terms.split("+"))


@dataclasses.dataclass(frozen=True)
class Shaw(Scheme):
    """Shaw et al.'s relative terms, those of `ShawOptions.terms`: key and
    value tables `[2k+1, H]` shared by the heads, and a per-head scalar bias
    `[N, 2k+1]`."""

    Options = ShawOptions
    options_key = "shaw"

    relative: bool = True
    shift_invariant: bool = True

    def score_mod(self, module, cfg, site, state):
        opts = self.options(cfg)
        if "bias" not in opts.term_set:
            return None
        table = param(
            module,
            "rel_bias",
            nn.initializers.zeros,
            (cfg.num_heads, 2 * opts.max_distance + 1),
            ("heads", None),
            cfg.params_dtype,
        )  # [N, R]
        return pos_lib.shaw_bias_score_mod(table.astype(jnp.float32), opts.max_distance)

    def shaw(self, module, cfg):
        opts = self.options(cfg)
        terms = opts.term_set & {"key", "value"}
        if not terms:
            return None
        r, h, c = 2 * opts.max_distance + 1, cfg.head_dim, cfg.compute_dtype
        tables = {
            term: param(module, f"rel_{term}", _xavier(), (r, h), (None, "kv"), cfg.params_dtype)
            for term in ("key", "value")  # this order fixes the initial values
            if term in terms
        }
        return ShawRelative(
            key=tables["key"].astype(c) if "key" in tables else None,
            value=tables["value"].astype(c) if "value" in tables else None,
            max_distance=opts.max_distance,
        )


@dataclasses.dataclass(frozen=True)
class SinusoidalShaw(Shaw):
    """Shaw et al.'s combination: sinusoids on the embeddings and relative terms."""

    absolute: bool = True
    shift_invariant: bool = False

    embed = Sinusoidal.embed

    check = Sinusoidal.check


# -- rotations ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeOptions(SchemeOptions):
    """Options of "rope".

    Attributes:
      max_timescale: RoPE's base wavelength.
      scaling: RoPE's extension to longer inputs, one of
        `jattn.positions.ROPE_SCALINGS` ("none", "pi", "ntk", "yarn"); it acts
        at evaluation and decoding only (`train=False`), so a run trained
        without it is evaluated with it by setting it (training ignores it).
      scaling_factor: the extension factor s >= 1 of `scaling`.
      original_length: the training length YaRN keeps the short wavelengths
        of (0: `max_len`).
      yarn: YaRN's convention ("paper", the default, or "hf"), its band
        `beta_fast` / `beta_slow` and HF's `mscale` / `mscale_all_dim`
        (`jattn.positions.YarnOptions`, which checks them; docs/schemes.md).
    """

    max_timescale: float = 10_000.0
    scaling: str = "none"
    scaling_factor: float = 1.0
    original_length: int = 0
    yarn: pos_lib.YarnOptions = dataclasses.field(default_factory=pos_lib.YarnOptions)

    def check(self):
        if self.scaling not in pos_lib.ROPE_SCALINGS:
            raise ValueError(f"scaling={self.scaling!r}; choose one of {pos_lib.ROPE_SCALINGS}")
        if not float(self.scaling_factor) >= 1.0:
            raise ValueError(f"scaling_factor must be >= 1, got {self.scaling_factor!r}")
        int_at_least_0("original_length", self.original_length)
        if not float(self.max_timescale) > 1.0:
            raise ValueError(f"max_timescale must be > 1, got {self.max_timescale!r}")


@dataclasses.dataclass(frozen=True)
class Rope(Scheme):
    """Su et al.'s rotary embedding; `RopeOptions.scaling` extends it at evaluation."""

    Options = RopeOptions
    options_key = "rope"

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        if cfg.head_dim < 2:
            raise ValueError(
                f"TransformerConfig: {self.name} needs head_dim >= 2, got d_model/num_heads="
                f"{cfg.head_dim}"
            )

    def rotate(self, cfg, q, k, q_pos, kv_pos, site):
        opts = self.options(cfg)
        scaling = dict(max_timescale=opts.max_timescale)
        if not site.train and opts.scaling != "none":
            scaling.update(
                scaling=opts.scaling,
                scaling_factor=opts.scaling_factor,
                original_length=opts.original_length or cfg.max_len,
                yarn=opts.yarn,
            )
        return pos_lib.rope(q, q_pos, **scaling), pos_lib.rope(k, kv_pos, **scaling)


@dataclasses.dataclass(frozen=True)
class XPosOptions(SchemeOptions):
    """Options of "xpos".

    Attributes:
      max_timescale: the base wavelength of its rotation (RoPE's default).
      scale_base: the decay length scale γ (Sun et al.'s 512).
    """

    max_timescale: float = RopeOptions.max_timescale
    scale_base: float = 512.0

    def check(self):
        if not float(self.scale_base) > 0:
            raise ValueError(f"scale_base must be > 0, got {self.scale_base!r}")
        if not float(self.max_timescale) > 1.0:
            raise ValueError(f"max_timescale must be > 1, got {self.max_timescale!r}")


@dataclasses.dataclass(frozen=True)
class XPos(Rope):
    """Sun et al.'s xPos: RoPE with a per-frequency exponential decay.

    Queries and keys are measured from a per-row reference, the centre of the
    row's positions (`jattn.positions.xpos_reference`), which cancels in
    `q·k` and keeps the decay factors finite at any absolute position. In a
    causal decoding step the row is the cache's slots (`Site.cache_positions`),
    so every step and the keys earlier steps cached share one reference; a
    full pass takes its own queries' and keys' positions. The two references
    differ, the logits do not (to float32 rounding). `check` refuses a config
    whose rows can span more than `jattn.positions.xpos_max_span`.
    """

    Options = XPosOptions
    options_key = "xpos"

    def check(self, cfg):
        super().check(cfg)
        scale_base = self.options(cfg).scale_base
        limit = pos_lib.xpos_max_span(float(scale_base))
        span = max(cfg.max_len, cfg.random_positions)  # the widest row the config allows
        if span > limit:
            raise ValueError(
                f"TransformerConfig: xpos keeps rows of at most {limit} positions finite in "
                f"float32 at position_options.xpos.scale_base={scale_base}, got "
                f"max(max_len, random_positions)={span}; raise position_options.xpos.scale_base"
            )

    def rotate(self, cfg, q, k, q_pos, kv_pos, site):
        opts = self.options(cfg)
        row = (q_pos, kv_pos) if site.cache_positions is None else (site.cache_positions,)
        base = dict(
            max_timescale=opts.max_timescale,
            scale_base=opts.scale_base,
            reference=pos_lib.xpos_reference(*row),  # [B, 1]
        )
        return (
            pos_lib.xpos(q, q_pos, key=False, **base),
            pos_lib.xpos(k, kv_pos, key=True, **base),
        )


def layer_params(module: nn.Module, *names: str) -> list[Array]:
    """Parameters a scheme declared on `module` in an earlier hook of the same
    call (a parameter is declared once), unboxed."""
    return [nn.unbox(module.get_variable("params", name)) for name in names]


@dataclasses.dataclass(frozen=True)
class TransformerXLOptions(SchemeOptions):
    """Options of "transformer_xl".

    Attributes:
      max_distance: the clip distance of `i - j` (0: the longest row the
        config allows, `max(max_len, random_positions) - 1`, so unclipped there).
    """

    max_distance: int = 0

    def check(self):
        int_at_least_0("max_distance", self.max_distance)


@dataclasses.dataclass(frozen=True)
class TransformerXL(Scheme):
    """Dai et al. 2019's relative attention, as Csordás et al. 2021 use it:
    `(q + u)·k + (q + v)·W_R R(i - j)` with R the sinusoidal embedding of the
    distance (width D), learned per-layer u, v `[N, H]` and W_R `[D, N, H]`,
    no absolute positions. Distances are clipped at its `max_distance` (0:
    the longest row the config allows, so unclipped there).

    Built from jattn's pieces (`jattn.positions.transformer_xl_tables`): the
    queries shifted by u, Shaw's per-head key table `W_R R` and a Shaw bias
    table `(v - u)·W_R R`; memory is O(T·k) a head, linear in L for a fixed
    clip (set `max_distance`; the default clip ~ L is O(L^2)).
    """

    Options = TransformerXLOptions
    options_key = "transformer_xl"

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        if cfg.d_model % 2:
            raise ValueError(
                f"TransformerConfig: transformer_xl's sinusoidal R needs an even d_model, "
                f"got {cfg.d_model}"
            )

    def clip(self, cfg) -> int:
        """The clip distance k: its `max_distance`, or the widest row's span."""
        return self.options(cfg).max_distance or max(cfg.max_len, cfg.random_positions) - 1

    def shift_queries(self, module, cfg, site, q):
        n, h, d = cfg.num_heads, cfg.head_dim, cfg.d_model
        zeros, pdt = nn.initializers.zeros, cfg.params_dtype
        u = param(module, "xl_u", zeros, (n, h), ("heads", "kv"), pdt)  # [N, H]
        param(module, "xl_v", zeros, (n, h), ("heads", "kv"), pdt)
        param(module, "xl_r", _xavier(in_axis=0, out_axis=(1, 2)), (d, n, h),
              ("embed", "heads", "kv"), pdt)  # fmt: skip
        return q + u.astype(q.dtype)[None, None]  # [B, T, N, H]

    def _tables(self, module, cfg):
        w_r, u, v = layer_params(module, "xl_r", "xl_u", "xl_v")
        return pos_lib.transformer_xl_tables(w_r, u, v, self.clip(cfg), cfg.head_dim**-0.5)

    def score_mod(self, module, cfg, site, state):
        _, bias = self._tables(module, cfg)  # [N, 2k+1]
        return pos_lib.shaw_bias_score_mod(bias, self.clip(cfg))

    def shaw(self, module, cfg):
        key_table, _ = self._tables(module, cfg)  # [N, 2k+1, H]
        return ShawRelative(
            key=key_table.astype(cfg.compute_dtype), value=None, max_distance=self.clip(cfg)
        )


# -- score mods ----------------------------------------------------------------------


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


# -- the registry ------------------------------------------------------------------------

for _scheme in (
    Scheme("none", shift_invariant=True, order_blind=True),
    Sinusoidal("sinusoidal"),
    Learned("learned"),
    Shaw("shaw"),
    SinusoidalShaw("sinusoidal+shaw"),
    Rope("rope"),
    Alibi("alibi"),
    T5("t5"),
    XPos("xpos"),
    Fire("fire"),
    Kerple("kerple"),
    TransformerXL("transformer_xl"),
    Sandwich("sandwich"),
    Forgetting("forgetting"),
    Cope("cope"),
    StickBreaking("stick_breaking"),
):
    register(_scheme)
