"""What a positional scheme is: the component `Scheme`, its options
`SchemeOptions`, where a hook is called (`Site`), and the registry `SCHEMES`.

A scheme is everything a positional encoding does to a Transformer, in one
place: its options (a frozen dataclass of its own, `Scheme.Options`, with
their defaults and checks), its absolute vector added to the embeddings, its
rotation of queries and keys, its learned shift of the queries, its score
mod on the logits, its Shaw tables, its forget gates, the parameters it shares across a
stack's layers, its config checks, the longest position it supports, and
what it declares about itself (shift invariant or not, causal-only or not).
The layers call these hooks and never compare a scheme's name;
`TransformerConfig.position` picks one by name, and
`TransformerConfig.position_options` (a `PositionOptions`) holds every
registered scheme's options by its `options_key` (configs spell them
`model.position_options.rope.scaling`).

The built-in schemes are in `jattn.models.schemes`, which registers them
(each defined in the module of its kind, `jattn.models.rotary_schemes`, ...);
docs/schemes.md says how to add one. Shapes: B batch, T queries, S keys, N
query heads, K kv heads, H head dim, D width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.axes import param
from jattn.positions import ShawRelative
from jattn.score_mod import ScoreMod

if TYPE_CHECKING:
    from jattn.models.config import TransformerConfig

Array = jax.Array

__all__ = [
    "SCHEMES",
    "PositionOptions",
    "Scheme",
    "SchemeOptions",
    "SchemeParams",
    "Site",
    "default_position_options",
    "get_scheme",
    "int_at_least_0",
    "layer_params",
    "option_groups",
    "positive_int",
    "register",
]


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


def positive_int(name: str, value: Any) -> None:
    """Raise a one-line ValueError unless `value` is an int > 0 (an option check)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def int_at_least_0(name: str, value: Any) -> None:
    """Raise a one-line ValueError unless `value` is an int >= 0 (an option check)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SchemeOptions:
    """Base of a scheme's options: a frozen dataclass whose field defaults are
    the scheme's defaults (written there only), checked by `check`.

    `TransformerConfig` holds one of these per options key of the registry
    (`PositionOptions`), so a grid over `position` carries every scheme's
    options at once and a config's override of an unused scheme's option is
    still checked. A field may itself be a frozen dataclass (RoPE's `yarn`),
    spelled as a nested group in configs.
    """

    def check(self) -> None:
        """Raise ValueError (one line, naming the option) on a value the scheme
        cannot use; checks that need the rest of the config are `Scheme.check`."""


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
        information there: "none", and the data-dependent schemes, which act
        in causal layers only).
      causal_only: defined for causal attention only (a bidirectional layer
        with it is a config error).
      data_dependent: its terms are functions of the tokens, not of their
        positions (the forget gate): `relative` for its hooks to run, yet
        drawing or shifting positions changes nothing.

    Class attributes:
      Options: the scheme's `SchemeOptions` class (None: it has none).
      options_key: where its options sit in `TransformerConfig.position_options`
        and configs (`model.position_options.<key>.<option>`); schemes that
        share options share a key ("shaw" and "sinusoidal+shaw").
    """

    Options: ClassVar[type[SchemeOptions] | None] = None
    options_key: ClassVar[str | None] = None

    name: str
    absolute: bool = False
    relative: bool = False
    shift_invariant: bool = False
    order_blind: bool = False
    causal_only: bool = False
    data_dependent: bool = False

    def options(self, cfg: TransformerConfig) -> Any:
        """This scheme's options in `cfg` (an instance of `Options`)."""
        return cfg.position_options[self.options_key]

    def check(self, cfg: TransformerConfig) -> None:
        """Raise ValueError (one line, naming the field) on a config this scheme
        cannot run (what needs more than its options: `Options.check` has those)."""

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

    def forget_gates(
        self, module: nn.Module, cfg: TransformerConfig, site: Site, x: Array
    ) -> Array | None:
        """Log forget gates `log f` float32 `[B, T, N]` of a causal
        self-attention layer's input `x` `[B, T, D]` (parameters declared on
        `module`), or None. The layer adds `c_i − c_j` to logit (i, j), `c`
        the cumulative sum of `log f` (per segment; in decoding carried in
        the cache), as row and column terms (the Forgetting Transformer)."""
        return None

    def attention_form(
        self, module: nn.Module, cfg: TransformerConfig, site: Site
    ) -> Callable[..., Array] | None:
        """The attention function that replaces softmax attention in this
        layer (parameters declared on `module`), or None for softmax
        attention: `form(q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], *,
        q_positions, kv_positions, q_segment_ids, kv_segment_ids)` ->
        `[B, T, N, Hv]`, causal in the positions (CoPE, stick-breaking)."""
        return None


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


def layer_params(module: nn.Module, *names: str) -> list[Array]:
    """Parameters a scheme declared on `module` in an earlier hook of the same
    call (a parameter is declared once), unboxed."""
    return [nn.unbox(module.get_variable("params", name)) for name in names]


SCHEMES: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
    """Add `scheme` to `SCHEMES` under its name (a name taken is an error, and
    so is an options key another scheme uses for other options)."""
    if scheme.name in SCHEMES:
        raise ValueError(f"positional scheme {scheme.name!r} is already registered")
    if scheme.Options is not None:
        key = scheme.options_key
        if not (isinstance(key, str) and key.isidentifier()):
            raise ValueError(
                f"positional scheme {scheme.name!r} has Options but its options_key {key!r} "
                "is not an identifier"
            )
        taken = option_groups().get(key, scheme.Options)
        if taken is not scheme.Options:
            raise ValueError(
                f"positional scheme {scheme.name!r}: options_key {key!r} holds "
                f"{taken.__name__}, not {scheme.Options.__name__}"
            )
    SCHEMES[scheme.name] = scheme
    return scheme


def option_groups() -> dict[str, type[SchemeOptions]]:
    """The options class of every options key of the registered schemes."""
    return {s.options_key: s.Options for s in SCHEMES.values() if s.Options is not None}


def _build(cls: type, value: Any, where: str) -> Any:
    """An instance of the frozen dataclass `cls` from `value`: None (the
    defaults), an instance, or a mapping of some of its fields (nested
    dataclass fields from nested mappings)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping or {cls.__name__}, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown options {unknown}; valid are {sorted(fields)}")
    kw = {}
    for name, item in value.items():
        default = fields[name].default_factory
        nested = default() if default is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested):
            item = _build(type(nested), item, f"{where}.{name}")
        kw[name] = item
    try:
        return cls(**kw)
    except ValueError as e:  # a class that checks itself (`YarnOptions`: "yarn: ...")
        message = str(e).removeprefix(where.rsplit(".", 1)[-1] + ": ")
        raise ValueError(f"{where}: {message}") from None


def _as_dict(options: Any) -> dict[str, Any]:
    return {
        f.name: _as_dict(v) if dataclasses.is_dataclass(v := getattr(options, f.name)) else v
        for f in dataclasses.fields(options)
    }


class PositionOptions(Mapping):
    """Every registered scheme's options, by options key: frozen and hashable
    (a field of `TransformerConfig`, a static argument of `jax.jit`).

    Built from a mapping of some keys, each an options instance or a mapping
    of some of its fields (`{"t5": {"num_buckets": 8}}`); every other key and
    field keeps its default. Each group's `check` runs here, so a bad value is
    one line naming `position_options.<key>`.
    """

    def __init__(self, given: Mapping[str, Any] | None = None):
        groups = option_groups()
        given = dict(given or {})
        unknown = sorted(set(given) - set(groups))
        if unknown:
            raise ValueError(
                f"TransformerConfig.position_options: unknown keys {unknown}; the schemes' "
                f"options keys are {sorted(groups)}"
            )
        items = []
        for key in sorted(groups):
            where = f"TransformerConfig.position_options.{key}"
            options = _build(groups[key], given.get(key), where)
            try:
                options.check()
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            items.append((key, options))
        self._items = tuple(items)

    def __getitem__(self, key: str) -> Any:
        for name, options in self._items:
            if name == key:
                return options
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PositionOptions):
            return self._items == other._items
        return NotImplemented

    def __repr__(self) -> str:
        return f"PositionOptions({dict(self._items)!r})"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dicts, as configs and `model_config.json` spell them."""
        return {name: _as_dict(options) for name, options in self._items}

    def merged(self, changes: Mapping[str, Any]) -> PositionOptions:
        """These options with `changes` (same form as the constructor's) applied
        on top, field by field: what is not named keeps its value here."""

        def deep(base: dict, new: Mapping) -> dict:
            out = dict(base)
            for k, v in new.items():
                v = _as_dict(v) if dataclasses.is_dataclass(v) else v
                out[k] = deep(out[k], v) if isinstance(v, Mapping) and isinstance(
                    out.get(k), dict) else v  # fmt: skip
            return out

        return PositionOptions(deep(self.to_dict(), changes))


def default_position_options() -> dict[str, dict[str, Any]]:
    """Every options key's defaults as plain dicts (`TransformerConfig`'s
    default, and so the keys `model.position_options.*` of a run's config)."""
    return PositionOptions().to_dict()


def get_scheme(name: str) -> Scheme:
    """`SCHEMES[name]`, or a one-line error listing the registered names."""
    if name not in SCHEMES:
        raise ValueError(
            f"TransformerConfig.position={name!r} is not a positional scheme; "
            f"choose one of {sorted(SCHEMES)}"
        )
    return SCHEMES[name]
