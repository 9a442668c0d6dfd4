"""The normal form of an attention call: one typed carrier, built once.

`jattn.dot_product_attention` accepts what `jax.nn.dot_product_attention`
accepts plus jattn's own options; `normalise` checks all of it once, at the
public boundary, and returns a `NormalForm` that every implementation
(`xla`, `chunked`, `pallas`) takes as its only argument. A new option costs
one field here, not one more keyword in every signature.

What normalising does:

- inputs are rank 4, `[B, T, N, H]` / `[B, S, K, H]` / `[B, S, K, Hv]`
  (rank-3 inputs are given a batch axis of 1 by the caller);
- bias and mask are rank 4, each axis 1 or full (`[B|1, N|1, T|1, S|1]`);
  the mask is boolean;
- visibility is one `jattn.visibility.Visibility`, normalised
  (`Visibility.normalised`): positions always present, int32 `[B, T]` and
  `[B, S]`; padding given segment ids that equal nothing
  (`jattn.masks.mark_padding`): segment id 0, a query past its row's length
  (`PAD_Q`) and a key past its length (`PAD_KV`) alike, so padding is one
  more case of "different segments", lengths and segment id 0 give the
  same result, and every implementation skips padded tiles the way it
  skips other segments' tiles; segment ids both present or both None; the
  window a static `(left, right)` pair or None;
- a traced `scale` (under jit) is folded into the query (`scale * q`, the
  same logits up to rounding, with its gradient by autodiff) and the static
  scale is 1, so the kernels keep a compile-time constant;
- Shaw tables are per head, `[N, 2k+1, H]` and `[N, 2k+1, Hv]`, or None;
- dropout (a `jattn.dropout.Dropout`) is a static rate and an int32 `[2]`
  seed (None when off);
- a score mod is a `jattn.ScoreMod` (its params traced leaves) or None;
- row and column terms (`row_col_bias=(a, c)`) are float `[B, N, T]` and
  `[B, N, S]`, both or neither: logit (b, n, i, j) gains `a[b, n, i] +
  c[b, n, j]` (indices, not positions), O(T + S) memory where a bias of the
  same values would be `[B, N, T, S]`.

Shapes: the letters of `jattn.attention.legend` (K divides N; Hv, the value
head dim, is `E` in einsum strings).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jattn import checks
from jattn import dropout as dropout_lib
from jattn.dropout import Dropout
from jattn.masks import PAD_KV, PAD_Q
from jattn.positions import ShawRelative
from jattn.score_mod import ScoreMod
from jattn.visibility import Visibility

Array = jax.Array

__all__ = ["EMPTY_ROW_LSE", "PAD_KV", "PAD_Q", "NormalForm", "normalise"]

# The log-sum-exp reported for a query row with no visible key: jax.nn's value
# in float32 (a large finite negative, so `exp(lse)` is 0 and nothing is Inf).
EMPTY_ROW_LSE = float(-0.7 * np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class NormalForm:
    """A checked attention call. A pytree: arrays are leaves, options static.

    Attributes:
      query: `[B, T, N, H]`.
      key: `[B, S, K, H]`.
      value: `[B, S, K, Hv]`.
      bias: float `[B|1, N|1, T|1, S|1]` or None; added to the scaled logits.
      mask: bool `[B|1, N|1, T|1, S|1]` or None; True = may attend.
      visibility: the call's rules, normalised (`Visibility.normalised`):
        int32 segment ids `[B, T]`, `[B, S]` or None (padding, id 0 or past
        the sequence length, marked `PAD_Q` / `PAD_KV`), int32 positions
        `[B, T]`, `[B, S]`, `is_causal`, the window as a pair or None, and
        `default_positions` (the positions are `arange`: what is visible
        then depends on the shapes alone, which lets kernels build their
        block maps once per shape).
      rel_key: Shaw key table `[N, 2k+1, H]` or None.
      rel_value: Shaw value table `[N, 2k+1, Hv]` or None.
      dropout_seed: int32 `[2]` (see `jattn.dropout`) or None when off.
      score_mod: `jattn.ScoreMod` applied to the scaled logits, or None.
      row_bias: float `[B, N, T]` or None: added to every logit of query row
        i (with `bias`, before the score mod).
      col_bias: float `[B, N, S]` or None (None iff `row_bias` is): added to
        every logit of key column j.
      max_distance: Shaw clip distance k (0 without Shaw tables).
      scale: logit scale.
      dropout_rate: attention-weight dropout rate in [0, 1).
      dropout_broadcast_batch: one keep mask for every batch row (flax's
        `broadcast_dropout`).
      assume_finite: the caller vouches that key and value hold no NaN or
        Inf, so the guard that keeps a non-finite hidden key from reaching
        a query (`scores.finite_keys`) is skipped: a few small XLA ops a
        call, and for finite inputs the same arithmetic (equal to float32
        rounding where XLA fuses the smaller program otherwise).
    """

    query: Array
    key: Array
    value: Array
    bias: Array | None = None
    mask: Array | None = None
    visibility: Visibility = dataclasses.field(default_factory=Visibility)
    rel_key: Array | None = None
    rel_value: Array | None = None
    dropout_seed: Array | None = None
    score_mod: ScoreMod | None = None
    row_bias: Array | None = None
    col_bias: Array | None = None
    max_distance: int = 0
    scale: float = 1.0
    dropout_rate: float = 0.0
    dropout_broadcast_batch: bool = False
    assume_finite: bool = False

    @property
    def shaw(self) -> bool:
        """Whether any Shaw relative term is present."""
        return self.rel_key is not None or self.rel_value is not None

    @property
    def dropout(self) -> bool:
        """Whether attention-weight dropout is on."""
        return self.dropout_seed is not None

    def replace(self, **changes) -> NormalForm:
        return dataclasses.replace(self, **changes)


_META = ("max_distance", "scale", "dropout_rate", "dropout_broadcast_batch", "assume_finite")
jax.tree_util.register_dataclass(
    NormalForm,
    data_fields=[f.name for f in dataclasses.fields(NormalForm) if f.name not in _META],
    meta_fields=list(_META),
)


# Whether the ambiguous rank-3 mask or bias warning was shown (`_warn_rank3`): once.
_rank3_warned: list[bool] = []


def _warn_rank3(x, name: str, full: tuple[int, int, int, int]) -> None:
    """Warns, once a process, when a rank-3 mask or bias could mean `[B, T, S]`.

    jax.nn reads a rank-3 mask or bias as `[N, T, S]` (numpy broadcasting from
    the right), and a drop-in keeps that rule; when B == N > 1 the shape also
    fits the per-batch-row mask a caller may have meant, and nothing else
    would tell them (docs/reuse.md).
    """
    b, n = full[0], full[1]
    if x.ndim != 3 or b != n or b == 1 or x.shape[0] != n or _rank3_warned:
        return
    _rank3_warned.append(True)
    warnings.warn(
        f"dot_product_attention: a rank-3 {name} of shape {list(x.shape)} with batch B = "
        f"heads N = {n} is read as [N, T, S], one per head (jax.nn's broadcasting rule); "
        f"for one per batch row pass {name}[:, None] ([B, 1, T, S]). Shown once.",
        stacklevel=5,
    )


def _as_rank4(x, name: str, full: tuple[int, int, int, int]) -> Array:
    """Left-pad `x` to rank 4 and check each axis is 1 or the full size."""
    x = jnp.asarray(x)
    _warn_rank3(x, name, full)
    if x.ndim > 4:
        raise ValueError(
            f"dot_product_attention: {name} must broadcast to [B, N, T, S]={list(full)}, "
            f"got rank {x.ndim} shape {list(x.shape)}"
        )
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    for got, want in zip(x.shape, full, strict=True):
        if got not in (1, want):
            raise ValueError(
                f"dot_product_attention: {name} of shape {list(x.shape)} does not "
                f"broadcast to [B, N, T, S]={list(full)}"
            )
    return x


def _table(x, name: str, n: int, r: int, h: int, h_name: str) -> Array:
    x = jnp.asarray(x)
    want = f"[2k+1, {h_name}]=[{r}, {h}] or [N, 2k+1, {h_name}]=[{n}, {r}, {h}]"
    if x.ndim == 2 and x.shape == (r, h):
        return jnp.broadcast_to(x[None], (n, r, h))
    if x.shape != (n, r, h):
        raise ValueError(f"ShawRelative.{name} must be {want}, got {list(x.shape)}")
    return x


def _row_col(pair, b: int, n: int, t: int, s: int) -> tuple[Array | None, Array | None]:
    """`row_col_bias=(a, c)` checked: float `[B, N, T]` and `[B, N, S]`, or (None, None)."""
    if pair is None:
        return None, None
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise TypeError(
            "dot_product_attention: row_col_bias must be a pair (a [B, N, T], c [B, N, S]), "
            f"got {type(pair).__name__}"
        )
    out = []
    for name, x, want in (("row", pair[0], (b, n, t)), ("column", pair[1], (b, n, s))):
        x = jnp.asarray(x)
        what = f"dot_product_attention: row_col_bias's {name} term must"
        checks.dtype_kind(x, "floating", f"{what} be floating, got {x.dtype}")
        checks.shape(x, want, f"{what} have shape {list(want)}, got {list(x.shape)}")
        out.append(x)
    return out[0], out[1]


def _static_scale(query: Array, scale, head_dim: int) -> tuple[Array, float]:
    """`(query, scale)` with a Python float scale.

    A traced scale (jax.nn accepts one under jit) cannot be a static field:
    it is multiplied into the query instead, `(s·q)·k = s·(q·k)`, which also
    scales the Shaw key term `q·key_rel` as the scale must, and its gradient
    follows by autodiff outside every implementation's custom VJP.
    """
    if scale is None:
        return query, float(1.0 / np.sqrt(head_dim))
    if isinstance(scale, jax.core.Tracer):
        if np.ndim(scale) != 0:
            raise ValueError(
                f"dot_product_attention: scale must be a scalar, got shape {list(np.shape(scale))}"
            )
        compute = jnp.promote_types(query.dtype, jnp.float32)
        scaled = query.astype(compute) * jnp.asarray(scale, compute)
        return scaled.astype(query.dtype), 1.0
    return query, float(scale)


def _check_qkv(query: Array, key: Array, value: Array) -> None:
    """Ranks and dtypes of each input (chex), then how their shapes agree."""
    for name, a in (("query", query), ("key", key), ("value", value)):
        checks.rank(
            a,
            4,
            f"dot_product_attention: {name} must have rank 4 ([B, T|S, heads, head_dim]) "
            f"or 3 (no batch axis), got shape {list(a.shape)}",
        )
        checks.dtype_kind(
            a, "floating", f"dot_product_attention: {name} must be floating, got {a.dtype}"
        )
    b, _, n, h = query.shape
    bk, s, k, hk = key.shape
    shapes = f"query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
    if bk != b or value.shape[0] != b:
        raise ValueError(f"dot_product_attention: batch sizes differ: {shapes}")
    if h == 0 or value.shape[3] == 0:
        raise ValueError(
            f"dot_product_attention: head_dim must be at least 1, got {shapes} "
            "(the last axis is the head dim)"
        )
    if hk != h:
        raise ValueError(
            f"dot_product_attention: query head dim {h} != key head dim {hk} ({shapes})"
        )
    if value.shape[1] != s or value.shape[2] != k:
        raise ValueError(
            f"dot_product_attention: value [B, S, K, Hv] must match key [B, S, K, H] in S "
            f"and K: key {list(key.shape)}, value {list(value.shape)}"
        )
    if k == 0 or n % k:
        raise ValueError(
            f"dot_product_attention: key heads K={k} must divide query heads N={n} ({shapes})"
        )


def _pairwise(bias, mask, full: tuple[int, int, int, int]) -> tuple[Array | None, Array | None]:
    """bias and mask as rank 4, each axis 1 or full; bias floating, mask boolean (chex)."""
    if bias is not None:
        bias = _as_rank4(bias, "bias", full)
        checks.dtype_kind(
            bias, "floating", f"dot_product_attention: bias must be floating, got {bias.dtype}"
        )
    if mask is not None:
        mask = _as_rank4(mask, "mask", full)
        checks.dtype_kind(
            mask,
            "boolean",
            f"dot_product_attention: mask must be boolean (True = may attend), got {mask.dtype}",
        )
    return bias, mask


def _shaw_tables(relative, n: int, h: int, hv: int) -> tuple[Array | None, Array | None, int]:
    """`(rel_key [N, 2k+1, H], rel_value [N, 2k+1, Hv], k)` of a `ShawRelative` (or Nones, 0)."""
    if relative is None:
        return None, None, 0
    if not isinstance(relative, ShawRelative):
        raise TypeError(
            "dot_product_attention: relative must be a jattn.ShawRelative, "
            f"got {type(relative).__name__}"
        )
    max_distance = int(relative.max_distance)
    if max_distance < 0:
        raise ValueError(f"ShawRelative.max_distance must be >= 0, got {max_distance}")
    r = 2 * max_distance + 1
    rel_key = rel_value = None
    if relative.key is not None:
        rel_key = _table(relative.key, "key", n, r, h, "H")
    if relative.value is not None:
        rel_value = _table(relative.value, "value", n, r, hv, "Hv")
    return rel_key, rel_value, max_distance


def _dropout_seed(dropout: Dropout) -> tuple[float, Array | None]:
    """`(rate, int32 [2] seed)` of a `Dropout`, `(0.0, None)` when off."""
    rate = float(dropout.rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dot_product_attention: dropout_rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return 0.0, None
    if dropout.rng is None:
        raise ValueError(
            f"dot_product_attention: dropout_rate={rate} needs a dropout_rng (a jax.random key)"
        )
    return rate, dropout_lib.seed_words(dropout.rng)


def normalise(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    visibility: Visibility | None = None,
    scale: float | None = None,
    relative: ShawRelative | None = None,
    score_mod: ScoreMod | None = None,
    row_col_bias=None,
    dropout: Dropout | None = None,
    assume_finite: bool = False,
) -> NormalForm:
    """Check rank-4 `dot_product_attention` arguments and build their normal form.

    The arguments of `jattn.dot_product_attention` (rank-4 inputs only; the
    entry point adds the batch axis of rank-3 ones), with its visibility
    keywords as one `jattn.visibility.Visibility` (None: every key visible) and
    its dropout keywords as one `jattn.dropout.Dropout` (None: off). Shapes
    and dtypes are checked with chex; every error is one line that names
    the argument and the shapes involved.
    """
    query, key, value = (jnp.asarray(a) for a in (query, key, value))
    _check_qkv(query, key, value)
    b, t, n, h = query.shape
    s = key.shape[1]
    bias, mask = _pairwise(bias, mask, (b, n, t, s))
    if visibility is None:
        visibility = Visibility()
    elif not isinstance(visibility, Visibility):
        raise TypeError(
            "dot_product_attention: visibility must be a jattn.visibility.Visibility, "
            f"got {type(visibility).__name__}"
        )
    rel_key, rel_value, max_distance = _shaw_tables(relative, n, h, value.shape[-1])
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(
            "dot_product_attention: score_mod must be a jattn.ScoreMod(fn, params), "
            f"got {type(score_mod).__name__}"
        )
    row_bias, col_bias = _row_col(row_col_bias, b, n, t, s)
    dropout = Dropout() if dropout is None else dropout
    dropout_rate, seed = _dropout_seed(dropout)
    query, scale = _static_scale(query, scale, h)
    return NormalForm(
        query=query,
        key=key,
        value=value,
        bias=bias,
        mask=mask,
        visibility=visibility.normalised(b, t, s),
        rel_key=rel_key,
        rel_value=rel_value,
        dropout_seed=seed,
        score_mod=score_mod,
        row_bias=row_bias,
        col_bias=col_bias,
        max_distance=max_distance,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_broadcast_batch=bool(dropout.broadcast_batch),
        assume_finite=bool(assume_finite),
    )
