"""The visibility value: the rules of one attention call as one frozen pytree.

`Visibility` holds causal, the local window, sequence lengths, segment ids and
positions, the arguments `jax.nn.dot_product_attention` and jattn spell as
keywords, under the same names. The public entry points build it once
(`jattn.dot_product_attention`, `jattn.flax_attention_fn`, the models'
stacks); the normal form, every implementation and the models' layers pass it
on whole instead of re-declaring its keywords. Its rule is
`jattn.masks.visible`; values combine with `&` (both rule sets hold), and
`Visibility.mask` materialises one for inspection. Built and checked once
(chex, `jattn.checks`), normalised once per call (`Visibility.normalised`:
the form every implementation reads).

Shapes: B batch, T query length, S key length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn import checks
from jattn.masks import PAD_KV, PAD_Q, mark_padding, visible, window_pair

Array = jax.Array

__all__ = ["KEYWORDS", "Visibility", "split_keywords"]


# The value's array fields (pytree children) and its static ones (aux data).
_ARRAYS = (
    "query_seq_lengths",
    "key_value_seq_lengths",
    "q_segment_ids",
    "kv_segment_ids",
    "q_positions",
    "kv_positions",
)
_STATIC = ("is_causal", "local_window_size", "default_positions")


def _fits_int32(x, name: str) -> None:
    """Refuses concrete 64-bit ids outside int32: converting them would wrap
    silently (2**31 becomes -2**31). Traced values cannot be checked here."""
    if isinstance(x, jax.core.Tracer):
        return
    dtype = getattr(x, "dtype", None)
    if dtype is None or not np.issubdtype(dtype, np.integer) or np.dtype(dtype).itemsize <= 4:
        return
    arr = np.asarray(x)
    info = np.iinfo(np.int32)
    if arr.size and (arr.min() < info.min or arr.max() > info.max):
        raise ValueError(
            f"dot_product_attention: {name} holds values in [{arr.min()}, {arr.max()}], "
            f"outside int32 [{info.min}, {info.max}] that attention computes in"
        )


def _batch_rows(x, name: str, batch: int, length: int, what: str) -> Array:
    """Ids or positions as int32 `[B, L]` (a `[L]` vector is every row's)."""
    x = jnp.asarray(x)
    if x.ndim == 1:
        x = jnp.broadcast_to(x[None], (batch, x.shape[0]))
    checks.shape(
        x,
        (batch, length),
        f"dot_product_attention: {name} must have shape [B, {what}]=[{batch}, {length}], "
        f"got {list(x.shape)}",
    )
    return x.astype(jnp.int32)


def _lengths(x, name: str, batch: int) -> Array:
    x = jnp.asarray(x)
    checks.shape(
        x,
        (batch,),
        f"dot_product_attention: {name} must have shape [B]=[{batch}], got {list(x.shape)}",
    )
    return x.astype(jnp.int32)


def _fold_lengths(seg, lengths, length: int, batch: int, pad: int) -> Array | None:
    """Segment ids with positions at or past `lengths` replaced by `pad`."""
    if lengths is None:
        return seg
    valid = jnp.arange(length, dtype=jnp.int32)[None, :] < lengths[:, None]  # [B, L]
    base = jnp.ones((batch, length), jnp.int32) if seg is None else seg
    return jnp.where(valid, base, jnp.int32(pad))


def _one_side(a, b, name: str):
    """The one of `a`, `b` that is given (both the same object counts as one)."""
    if a is not None and b is not None and a is not b:
        raise ValueError(
            f"Visibility: both values give {name}; two sets of {name} cannot combine "
            "into one (combine a value that has them with values that have none)"
        )
    return a if a is not None else b


@dataclasses.dataclass(frozen=True, eq=False)
class Visibility:
    """Which keys each query may see: the rules of one attention call as one value.

    The fields are `jax.nn.dot_product_attention`'s visibility keywords and
    jattn's, by the same names. A key is visible to a query iff every rule
    given holds (`visible`): causal, the window, both tokens within their
    row's length, equal segment ids. Built and checked once (chex, one-line
    errors naming the field); a pytree whose arrays are its leaves and whose
    rules (`is_causal`, `local_window_size`, `default_positions`) are static,
    so it passes through `jit`, `custom_vjp` and `shard_map` as one argument.
    `a & b` holds both values' rules (`__and__`).

    Attributes:
      is_causal: visible iff `kv_position <= q_position`.
      local_window_size: `(left, right)` (an int `w` is `(w, w)`): visible iff
        `q_position - left <= kv_position <= q_position + right`; or None.
      query_seq_lengths: int `[B]`: a query at or past its row's length sees
        nothing (and returns 0).
      key_value_seq_lengths: int `[B]`: a key at or past it is seen by nothing.
      q_segment_ids, kv_segment_ids: int `[B, T]`, `[B, S]` (a vector `[T]`,
        `[S]` is every row's), both or neither: visible iff equal and not 0
        (id 0 is padding, which sees nothing and is seen by nothing).
      q_positions, kv_positions: int `[B, T]`, `[B, S]` (or vectors); None:
        `arange(T)`, `arange(S)`. What causal and the window compare, and
        what relative positional terms read.
      default_positions: the positions are `arange(T)` / `arange(S)` (set by
        `normalised` when none were given): what is visible then depends on
        the shapes alone, so kernels build their block maps once per shape.
        `replace` with new positions clears it.
    """

    is_causal: bool = False
    local_window_size: int | tuple[int, int] | None = None
    query_seq_lengths: Array | None = None
    key_value_seq_lengths: Array | None = None
    q_segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    q_positions: Array | None = None
    kv_positions: Array | None = None
    default_positions: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("is_causal", bool(self.is_causal))
        set_("local_window_size", window_pair(self.local_window_size))
        for name in _ARRAYS:
            x = getattr(self, name)
            if x is None:
                continue
            if not (hasattr(x, "dtype") and hasattr(x, "shape")):
                x = np.asarray(x)
                set_(name, x)
            _fits_int32(x, name)
            checks.dtype_kind(
                x, "integer", f"visibility: {name} must be an integer array, got dtype {x.dtype}"
            )
            lengths = name.endswith("lengths")
            checks.rank(
                x,
                1 if lengths else {1, 2},
                f"visibility: {name} must be "
                + ("[B]" if lengths else "[B, T|S] or one row [T|S]")
                + f", got shape {list(x.shape)}",
            )
        if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
            missing = "kv_segment_ids" if self.kv_segment_ids is None else "q_segment_ids"
            raise ValueError(f"visibility: segment ids come in pairs; {missing} is missing")

    @classmethod
    def of_sequence(cls, segment_ids=None, positions=None) -> Visibility:
        """Self-attention over one sequence: the same segment ids and positions
        on the query and the key side (combine rules with `&`)."""
        return cls(
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            q_positions=positions,
            kv_positions=positions,
        )

    def replace(self, **changes) -> Visibility:
        """A copy with `changes` (checked as at construction); new positions
        clear `default_positions` unless it is given."""
        if any(changes.get(k) is not None for k in ("q_positions", "kv_positions")):
            changes.setdefault("default_positions", False)
        return dataclasses.replace(self, **changes)

    def __and__(self, other: Visibility) -> Visibility:
        """Both values' rules: causal if either is, the windows' intersection,
        the shorter of two lengths; segment ids and positions from the value
        that gives them (a ValueError if both do)."""
        if not isinstance(other, Visibility):
            return NotImplemented
        windows = [w for w in (self.local_window_size, other.local_window_size) if w is not None]
        window = None
        if windows:
            window = (min(w[0] for w in windows), min(w[1] for w in windows))

        def shorter(a, b):
            return a if b is None else b if a is None else jnp.minimum(a, b)

        q_pos = _one_side(self.q_positions, other.q_positions, "q_positions")
        kv_pos = _one_side(self.kv_positions, other.kv_positions, "kv_positions")
        given = [
            v for v in (self, other) if v.q_positions is not None or v.kv_positions is not None
        ]
        return Visibility(
            is_causal=self.is_causal or other.is_causal,
            local_window_size=window,
            query_seq_lengths=shorter(self.query_seq_lengths, other.query_seq_lengths),
            key_value_seq_lengths=shorter(self.key_value_seq_lengths, other.key_value_seq_lengths),
            q_segment_ids=_one_side(self.q_segment_ids, other.q_segment_ids, "segment ids"),
            kv_segment_ids=_one_side(self.kv_segment_ids, other.kv_segment_ids, "segment ids"),
            q_positions=q_pos,
            kv_positions=kv_pos,
            default_positions=all(v.default_positions for v in given) if given else False,
        )

    @property
    def segments(self) -> bool:
        """Whether segment ids are given."""
        return self.q_segment_ids is not None

    @property
    def positions(self) -> bool:
        """Whether either side's positions are given."""
        return self.q_positions is not None or self.kv_positions is not None

    @property
    def lengths(self) -> bool:
        """Whether either sequence length is given."""
        return self.query_seq_lengths is not None or self.key_value_seq_lengths is not None

    def normalised(self, batch: int, t: int, s: int) -> Visibility:
        """The value as every implementation reads it (`NormalForm.visibility`).

        Segment ids and positions int32 `[B, T]` / `[B, S]`, checked against
        the call's sizes; padding marked so that it equals nothing
        (`mark_padding`): id 0, a query past its length (`PAD_Q`) and a key
        past its length (`PAD_KV`) alike, so lengths are folded into the
        segment ids (and are None here) and padding is one more case of
        "different segments" everywhere, tile skipping included; positions
        always present (`arange` where none were given, `default_positions`
        then set). Normalising a normalised value changes nothing.
        """
        q_seg = kv_seg = None
        if self.segments:
            q_seg = _batch_rows(self.q_segment_ids, "q_segment_ids", batch, t, "T")
            kv_seg = _batch_rows(self.kv_segment_ids, "kv_segment_ids", batch, s, "S")
            q_seg, kv_seg = mark_padding(q_seg, PAD_Q), mark_padding(kv_seg, PAD_KV)
        if self.lengths:
            q_len = kv_len = None
            if self.query_seq_lengths is not None:
                q_len = _lengths(self.query_seq_lengths, "query_seq_lengths", batch)
            if self.key_value_seq_lengths is not None:
                kv_len = _lengths(self.key_value_seq_lengths, "key_value_seq_lengths", batch)
            q_seg = _fold_lengths(q_seg, q_len, t, batch, PAD_Q)
            kv_seg = _fold_lengths(kv_seg, kv_len, s, batch, PAD_KV)
            q_seg = jnp.ones((batch, t), jnp.int32) if q_seg is None else q_seg
            kv_seg = jnp.ones((batch, s), jnp.int32) if kv_seg is None else kv_seg

        def positions(x, name: str, length: int, what: str) -> Array:
            if x is None:
                return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
            return _batch_rows(x, name, batch, length, what)

        return Visibility(
            is_causal=self.is_causal,
            local_window_size=self.local_window_size,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            q_positions=positions(self.q_positions, "q_positions", t, "T"),
            kv_positions=positions(self.kv_positions, "kv_positions", s, "S"),
            default_positions=self.default_positions or not self.positions,
        )

    def rule(self, col: Callable[[Array], Array], row: Callable[[Array], Array]) -> Array | None:
        """`visible` on this value's positions and segment ids: query-side
        arrays laid out by `col`, key-side ones by `row` (for `[B, T]` ids and
        `[B, T, S]` logits: `x[:, :, None]` and `x[:, None, :]`).

        For a normalised value (padding marked, lengths folded) or a tile cut
        from one; the lengths are not read. None when no rule applies."""
        lay = lambda f, x: None if x is None else f(x)  # noqa: E731
        return visible(
            lay(col, self.q_positions),
            lay(row, self.kv_positions),
            is_causal=self.is_causal,
            window=self.local_window_size,
            q_seg=lay(col, self.q_segment_ids),
            kv_seg=lay(row, self.kv_segment_ids),
        )

    def mask(self, batch: int, t: int, s: int) -> Array:
        """The value as a boolean mask `[B, T, S]`, True = may attend (for
        inspection and tests: the implementations never build it)."""
        rule = self.normalised(batch, t, s).rule(lambda x: x[:, :, None], lambda x: x[:, None, :])
        return jnp.broadcast_to(True if rule is None else rule, (batch, t, s))


# `dot_product_attention`'s keywords that are `Visibility`'s fields, by the same names.
KEYWORDS = tuple(f.name for f in dataclasses.fields(Visibility) if f.name != "default_positions")


def split_keywords(options: dict) -> tuple[Visibility, dict]:
    """`dot_product_attention`'s keywords split into the `Visibility` of those
    that are its fields (`KEYWORDS`) and a dict of the others: for callers
    that take the drop-in keywords as a dict (`default_implementation`,
    `flax_attention_fn`'s options)."""
    vis = Visibility(**{k: v for k, v in options.items() if k in KEYWORDS})
    return vis, {k: v for k, v in options.items() if k not in KEYWORDS}


def _flatten_with_keys(v: Visibility):
    children = tuple((jax.tree_util.GetAttrKey(n), getattr(v, n)) for n in _ARRAYS)
    return children, tuple(getattr(v, n) for n in _STATIC)


def _unflatten(static, arrays) -> Visibility:
    # Not through __init__: a pytree is rebuilt with whatever leaves a
    # transformation carries (tracers, None, placeholders), which the checks
    # are not for; they ran when the value was built.
    v = object.__new__(Visibility)
    for name, x in zip(_ARRAYS + _STATIC, (*arrays, *static), strict=True):
        object.__setattr__(v, name, x)
    return v


jax.tree_util.register_pytree_with_keys(
    Visibility,
    _flatten_with_keys,
    _unflatten,
    flatten_func=lambda v: (
        tuple(getattr(v, n) for n in _ARRAYS),
        tuple(getattr(v, n) for n in _STATIC),
    ),
)
