"""Every positional scheme of the models as one component, and the registry `SCHEMES`.

A scheme is everything a positional encoding does to a Transformer, in one
place: its absolute vector added to the embeddings, its rotation of queries
and keys, its score mod on the logits, its Shaw tables, the parameters it
shares across a stack's layers, its config checks, the longest position it
supports, and what it declares about itself (shift invariant or not,
causal-only or not). The layers call these hooks and never compare a
scheme's name; `TransformerConfig.position` picks one by name:

    SCHEMES["alibi"].score_mod(layer, config, site, state)  # a jattn.ScoreMod

Hooks that own parameters receive the flax module to declare them on
(`axes.param(module, ...)`), so a scheme's tables keep the checkpoint names
they had before the registry (`rel_key`, `rel_bias`, `t5_bias/table`,
`positions/table`). The arithmetic is in `jattn.positions`; a hook reads the
config, declares the parameters and calls it.

The relative hooks (`rotate`, `score_mod`, `shaw`) act in self-attention and,
with `TransformerConfig.relative_cross`, in decoder-to-encoder attention
(`Site.cross`); `Site.causal` tells a causal (decoder) layer from a
bidirectional one.

Adding a scheme: docs/schemes.md (FIRE is the worked example). Shapes: B
batch, T queries, S keys, N query heads, K kv heads, H head dim, D width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn import positions as pos_lib
from jattn.models.axes import param
from jattn.positions import ShawRelative
from jattn.score_mod import ScoreMod

if TYPE_CHECKING:
    from jattn.models.config import TransformerConfig

Array = jax.Array

__all__ = ["SCHEMES", "Scheme", "Site", "get_scheme", "register"]

_xavier = jax.nn.initializers.xavier_uniform


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a relative hook is called.

    Attributes:
      causal: a causal (decoder self-attention) layer; else bidirectional.
      cross: decoder-to-encoder attention (only with `relative_cross`).
      train: a training call (dropout on); RoPE scalings act when False.
      cache_positions: a causal decoding step's: int `[B, L]`, the positions
        of every slot of the row's KV cache (the keys earlier steps cached
        and those later steps will), so a scheme that measures a row's
        positions from a reference (xPos) picks the one of the whole decode;
        None in every other call (then the call's own positions are the row's).
    """

    causal: bool = False
    cross: bool = False
    train: bool = False
    cache_positions: Array | None = dataclasses.field(default=None, compare=False)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A positional scheme; the defaults are "no term of this kind".

    Attributes:
      name: the `TransformerConfig.position` that picks it.
      absolute: adds a vector to the embeddings (`embed`).
      relative: acts inside attention (`rotate`, `score_mod` or `shaw`);
        `relative_cross` needs one.
      shift_invariant: outputs unchanged when every position moves by a
        constant (the tests hold a scheme to it when it declares it).
      order_blind: the encoder is permutation-equivariant (no positional
        information at all; only "none").
      causal_only: defined for causal attention only (a bidirectional layer
        with it is a config error).
    """

    name: str
    absolute: bool = False
    relative: bool = False
    shift_invariant: bool = False
    order_blind: bool = False
    causal_only: bool = False

    def check(self, cfg: TransformerConfig) -> None:
        """Raise ValueError (one line, naming the field) on a config this scheme cannot run."""

    def max_position(self, cfg: TransformerConfig) -> int | None:
        """The longest sequence the scheme supports (None: any length)."""
        return None

    def embed(self, module: nn.Module, cfg: TransformerConfig, positions: Array) -> Array:
        """The absolute vectors `[B, T, D]` of int `positions` `[B, T]` (`absolute` only)."""
        raise NotImplementedError(f"scheme {self.name!r} has no absolute embedding")

    def stack_state(self, module: nn.Module, cfg: TransformerConfig, *, causal: bool) -> Any:
        """Parameters shared by every layer of a stack (a pytree or None),
        declared on the stack `module`; handed to `score_mod` as `state`."""
        return None

    def rotate(
        self, cfg: TransformerConfig, q: Array, k: Array, q_pos: Array, kv_pos: Array, site: Site
    ) -> tuple[Array, Array]:
        """Queries `[B, T, N, H]` and keys `[B, S, K, H]` after a rotation (RoPE, xPos)."""
        return q, k

    def shift_queries(
        self, module: nn.Module, cfg: TransformerConfig, site: Site, q: Array
    ) -> Array:
        """Queries `[B, T, N, H]` after a learned shift (Transformer-XL's u),
        its parameters declared on `module`; called once per attention layer
        before `score_mod` and `shaw`, so a scheme may declare there the
        parameters those two read back (`layer_params`)."""
        return q

    def score_mod(
        self, module: nn.Module, cfg: TransformerConfig, site: Site, state: Any
    ) -> ScoreMod | None:
        """The score mod of one attention layer (its parameters declared on `module`)."""
        return None

    def shaw(self, module: nn.Module, cfg: TransformerConfig) -> ShawRelative | None:
        """Shaw's key/value tables of one attention layer, declared on `module`."""
        return None


SCHEMES: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
    """Add `scheme` to `SCHEMES` under its name (a name taken is an error)."""
    if scheme.name in SCHEMES:
        raise ValueError(f"positional scheme {scheme.name!r} is already registered")
    SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> Scheme:
    """`SCHEMES[name]`, or a one-line error listing the registered names."""
    if name not in SCHEMES:
        raise ValueError(
            f"TransformerConfig.position={name!r} is not a positional scheme; "
            f"choose one of {sorted(SCHEMES)}"
        )
    return SCHEMES[name]


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


@dataclasses.dataclass(frozen=True)
class Shaw(Scheme):
    """Shaw et al.'s relative terms, those of `shaw_terms`: key and value tables
    `[2k+1, H]` shared by the heads, and a per-head scalar bias `[N, 2k+1]`."""

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        _positive_int("max_relative_distance", cfg.max_relative_distance)

    def score_mod(self, module, cfg, site, state):
        if "bias" not in cfg.shaw:
            return None
        table = param(
            module,
            "rel_bias",
            nn.initializers.zeros,
            (cfg.num_heads, 2 * cfg.max_relative_distance + 1),
            ("heads", None),
            cfg.params_dtype,
        )  # [N, R]
        return pos_lib.shaw_bias_score_mod(table.astype(jnp.float32), cfg.max_relative_distance)

    def shaw(self, module, cfg):
        terms = cfg.shaw & {"key", "value"}
        if not terms:
            return None
        r, h, c = 2 * cfg.max_relative_distance + 1, cfg.head_dim, cfg.compute_dtype
        tables = {
            term: param(module, f"rel_{term}", _xavier(), (r, h), (None, "kv"), cfg.params_dtype)
            for term in ("key", "value")  # this order fixes the initial values
            if term in terms
        }
        return ShawRelative(
            key=tables["key"].astype(c) if "key" in tables else None,
            value=tables["value"].astype(c) if "value" in tables else None,
            max_distance=cfg.max_relative_distance,
        )


@dataclasses.dataclass(frozen=True)
class SinusoidalShaw(Shaw):
    """Shaw et al.'s combination: sinusoids on the embeddings and relative terms."""

    absolute: bool = True
    shift_invariant: bool = False

    embed = Sinusoidal.embed

    def check(self, cfg):
        Sinusoidal.check(self, cfg)
        Shaw.check(self, cfg)


# -- rotations ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rope(Scheme):
    """Su et al.'s rotary embedding; `rope_scaling` extends it at evaluation."""

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        if cfg.head_dim < 2:
            raise ValueError(
                f"TransformerConfig: {self.name} needs head_dim >= 2, got d_model/num_heads="
                f"{cfg.head_dim}"
            )

    def rotate(self, cfg, q, k, q_pos, kv_pos, site):
        scaling = dict(max_timescale=cfg.rope_max_timescale)
        if not site.train and cfg.rope_scaling != "none":
            scaling.update(
                scaling=cfg.rope_scaling,
                scaling_factor=cfg.rope_scaling_factor,
                original_length=cfg.rope_original_length or cfg.max_len,
                yarn=pos_lib.YarnOptions(
                    convention=cfg.rope_yarn_convention,
                    beta_fast=cfg.rope_yarn_beta_fast,
                    beta_slow=cfg.rope_yarn_beta_slow,
                    mscale=cfg.rope_yarn_mscale,
                    mscale_all_dim=cfg.rope_yarn_mscale_all_dim,
                ),
            )
        return pos_lib.rope(q, q_pos, **scaling), pos_lib.rope(k, kv_pos, **scaling)


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

    def check(self, cfg):
        super().check(cfg)
        limit = pos_lib.xpos_max_span(float(cfg.xpos_scale_base))
        span = max(cfg.max_len, cfg.random_positions)  # the widest row the config allows
        if span > limit:
            raise ValueError(
                f"TransformerConfig: xpos keeps rows of at most {limit} positions finite in "
                f"float32 at xpos_scale_base={cfg.xpos_scale_base}, got "
                f"max(max_len, random_positions)={span}; raise xpos_scale_base"
            )

    def rotate(self, cfg, q, k, q_pos, kv_pos, site):
        row = (q_pos, kv_pos) if site.cache_positions is None else (site.cache_positions,)
        base = dict(
            max_timescale=cfg.rope_max_timescale,
            scale_base=cfg.xpos_scale_base,
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
class TransformerXL(Scheme):
    """Dai et al. 2019's relative attention, as Csordás et al. 2021 use it:
    `(q + u)·k + (q + v)·W_R R(i - j)` with R the sinusoidal embedding of the
    distance (width D), learned per-layer u, v `[N, H]` and W_R `[D, N, H]`,
    no absolute positions. Distances are clipped at `xl_max_distance` (0:
    the longest row the config allows, so unclipped there).

    Built from jattn's pieces (`jattn.positions.transformer_xl_tables`): the
    queries shifted by u, Shaw's per-head key table `W_R R` and a Shaw bias
    table `(v - u)·W_R R`; memory is O(T·k) a head, linear in L for a fixed
    clip (set `xl_max_distance`; the default clip ~ L is O(L^2)).
    """

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        if isinstance(cfg.xl_max_distance, bool) or not isinstance(cfg.xl_max_distance, int):
            raise ValueError(
                f"TransformerConfig.xl_max_distance must be an int >= 0, got "
                f"{cfg.xl_max_distance!r}"
            )
        if cfg.xl_max_distance < 0:
            raise ValueError(
                f"TransformerConfig.xl_max_distance must be >= 0, got {cfg.xl_max_distance}"
            )
        if cfg.d_model % 2:
            raise ValueError(
                f"TransformerConfig: transformer_xl's sinusoidal R needs an even d_model, "
                f"got {cfg.d_model}"
            )

    @staticmethod
    def clip(cfg) -> int:
        """The clip distance k: `xl_max_distance`, or the widest row's span."""
        return cfg.xl_max_distance or max(cfg.max_len, cfg.random_positions) - 1

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


class SchemeParams(nn.Module):
    """A scheme's own parameters in one sub-module: `specs` is a tuple of
    `(name, init, shape, logical axis names)`; returns `{name: array}`."""

    specs: tuple
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> dict[str, Array]:
        return {
            name: param(self, name, init, shape, names, self.dtype)
            for name, init, shape, names in self.specs
        }


def _constant(value: float):
    """An initialiser filling with `value`."""
    return lambda key, shape, dtype=jnp.float32: jnp.full(shape, value, dtype)


def _inv_softplus(y: float) -> float:
    return math.log(math.expm1(y))


@dataclasses.dataclass(frozen=True)
class Alibi(Scheme):
    """Press et al.'s linear biases, fixed geometric slopes per head. Causal
    layers use the paper's `-m (i - j)`; bidirectional ones `alibi_mode`:
    "symmetric" (`-m |i - j|`, blind to input order) or "offset" (keys after
    the query are further by a per-head offset `m`, which tells left from
    right; `jattn.positions.alibi_score_mod`)."""

    relative: bool = True
    shift_invariant: bool = True

    def score_mod(self, module, cfg, site, state):
        mode = "causal" if site.causal else cfg.alibi_mode
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
class Fire(Scheme):
    """Li et al.'s FIRE: a per-layer MLP (`fire_hidden` units) over
    `log(c|i - j| + 1) / log(c max(L, i) + 1)` with learned c and L
    (`jattn.positions.fire_score_mod`). It reads the query's own position
    (the normaliser), so it is not shift invariant."""

    relative: bool = True

    def check(self, cfg):
        _positive_int("fire_hidden", cfg.fire_hidden)

    def score_mod(self, module, cfg, site, state):
        n, h = cfg.num_heads, cfg.fire_hidden
        zeros, normal = nn.initializers.zeros, nn.initializers.normal
        specs = (  # the initial values of jattn.positions.init_fire_params
            ("w1", normal(1.0), (h,), (None,)),
            ("b1", zeros, (h,), (None,)),
            ("w2", normal(h**-0.5), (n, h), ("heads", None)),
            ("b2", zeros, (n,), ("heads",)),
            ("c", _constant(_inv_softplus(1.0)), (), ()),
            ("L", _constant(_inv_softplus(512.0)), (), ()),
        )
        params = SchemeParams(specs, cfg.params_dtype, name="fire")()
        return pos_lib.fire_score_mod(jax.tree.map(lambda x: x.astype(jnp.float32), params))


class T5RelativeBias(nn.Module):
    """The learned T5 bias table `[num_buckets, N]` (one per stack or per layer)."""

    config: Any

    @nn.compact
    def __call__(self) -> Array:
        """The table `[num_buckets, N]` in the params dtype."""
        cfg = self.config
        return param(
            self,
            "table",
            nn.initializers.normal(stddev=0.5),
            (cfg.t5_num_buckets, cfg.num_heads),
            (None, "heads"),
            cfg.params_dtype,
        )


@dataclasses.dataclass(frozen=True)
class T5(Scheme):
    """Raffel et al.'s log-bucketed learned bias: a table per stack (shared by
    its layers; `t5_per_layer`: one per layer), and one per cross-attention
    layer with `relative_cross`."""

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        _positive_int("t5_num_buckets", cfg.t5_num_buckets)
        if cfg.t5_num_buckets < 4 or cfg.t5_num_buckets % 2:
            raise ValueError(
                f"TransformerConfig.t5_num_buckets must be even and >= 4, got {cfg.t5_num_buckets}"
            )
        if cfg.t5_max_distance <= cfg.t5_num_buckets // 2:
            raise ValueError(
                f"TransformerConfig.t5_max_distance={cfg.t5_max_distance} must exceed "
                f"t5_num_buckets/2={cfg.t5_num_buckets // 2}"
            )

    def stack_state(self, module, cfg, *, causal):
        if cfg.t5_per_layer:
            return None
        return T5RelativeBias(cfg, name="t5_bias")()  # [buckets, N]

    def score_mod(self, module, cfg, site, state):
        table = state
        if cfg.t5_per_layer or site.cross:  # the stacks' tables are for self-attention
            table = T5RelativeBias(cfg, name="t5_bias")()
        return pos_lib.t5_score_mod(
            table.astype(jnp.float32).T,  # [N, buckets]
            max_distance=cfg.t5_max_distance,
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
):
    register(_scheme)
