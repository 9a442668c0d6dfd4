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
- positions are always present, int32 `[B, T]` and `[B, S]`;
- padding gets segment ids that equal nothing (`jattn.masks.mark_padding`):
  segment id 0, a query past its row's length (`PAD_Q`) and a key past its
  length (`PAD_KV`) alike, so padding is one more case of "different
  segments", lengths and segment id 0 give the same result, and every
  implementation skips padded tiles the way it skips other segments' tiles;
  segment ids are both present or both None;
- a traced `scale` (under jit) is folded into the query (`scale * q`, the
  same logits up to rounding, with its gradient by autodiff) and the static
  scale is 1, so the kernels keep a compile-time constant;
- `local_window_size` is a static `(left, right)` pair or None;
- Shaw tables are per head, `[N, 2k+1, H]` and `[N, 2k+1, Hv]`, or None;
- dropout is a static rate and an int32 `[2]` seed (None when off);
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

from jattn import dropout as dropout_lib
from jattn.masks import PAD_KV, PAD_Q, mark_padding, window_pair
from jattn.positions import ShawRelative
from jattn.score_mod import ScoreMod

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
      q_segment_ids: int32 `[B, T]` or None (padding, id 0 or past the
        sequence length, marked `PAD_Q`).
      kv_segment_ids: int32 `[B, S]` or None (None iff `q_segment_ids` is;
        padding marked `PAD_KV`).
      q_positions: int32 `[B, T]`.
      kv_positions: int32 `[B, S]`.
      rel_key: Shaw key table `[N, 2k+1, H]` or None.
      rel_value: Shaw value table `[N, 2k+1, Hv]` or None.
      dropout_seed: int32 `[2]` (see `jattn.dropout`) or None when off.
      score_mod: `jattn.ScoreMod` applied to the scaled logits, or None.
      row_bias: float `[B, N, T]` or None: added to every logit of query row
        i (with `bias`, before the score mod).
      col_bias: float `[B, N, S]` or None (None iff `row_bias` is): added to
        every logit of key column j.
      is_causal: key visible iff `kv_position <= q_position`.
      window: `(left, right)`: key visible iff
        `q_position - left <= kv_position <= q_position + right`; or None.
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
      default_positions: the positions are `arange(T)` / `arange(S)`
        (neither was given): what is visible then depends on the shapes
        alone, which lets kernels build their block maps once per shape.
        `replace` with new (not None) positions clears it.
    """

    query: Array
    key: Array
    value: Array
    bias: Array | None = None
    mask: Array | None = None
    q_segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    q_positions: Array | None = None
    kv_positions: Array | None = None
    rel_key: Array | None = None
    rel_value: Array | None = None
    dropout_seed: Array | None = None
    score_mod: ScoreMod | None = None
    row_bias: Array | None = None
    col_bias: Array | None = None
    is_causal: bool = False
    window: tuple[int, int] | None = None
    max_distance: int = 0
    scale: float = 1.0
    dropout_rate: float = 0.0
    dropout_broadcast_batch: bool = False
    assume_finite: bool = False
    default_positions: bool = False

    @property
    def shaw(self) -> bool:
        """Whether any Shaw relative term is present."""
        return self.rel_key is not None or self.rel_value is not None

    @property
    def dropout(self) -> bool:
        """Whether attention-weight dropout is on."""
        return self.dropout_seed is not None

    def replace(self, **changes) -> NormalForm:
        # New positions may break the arange assumption; None (a cotangent's
        # integer leaves) keeps the pytree structure of the primal.
        if any(changes.get(k) is not None for k in ("q_positions", "kv_positions")):
            changes.setdefault("default_positions", False)
        return dataclasses.replace(self, **changes)


_META = (
    "is_causal",
    "window",
    "max_distance",
    "scale",
    "dropout_rate",
    "dropout_broadcast_batch",
    "assume_finite",
    "default_positions",
)
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


def _fits_int32(x, name: str) -> None:
    """Refuses concrete 64-bit ids outside int32: converting them would wrap silently
    (2**31 becomes -2**31). Traced values cannot be checked here."""
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


def _int_ids(x, name: str, batch: int, length: int, what: str) -> Array:
    _fits_int32(x, name)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"dot_product_attention: {name} must be an integer array, got dtype {x.dtype}"
        )
    if x.ndim == 1:
        x = jnp.broadcast_to(x[None], (batch, x.shape[0]))
    if x.shape != (batch, length):
        raise ValueError(
            f"dot_product_attention: {name} must have shape [B, {what}]=[{batch}, {length}], "
            f"got {list(x.shape)}"
        )
    return x.astype(jnp.int32)


def _lengths(x, name: str, batch: int) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"dot_product_attention: {name} must be integer, got dtype {x.dtype}")
    if x.shape != (batch,):
        raise ValueError(
            f"dot_product_attention: {name} must have shape [B]=[{batch}], got {list(x.shape)}"
        )
    return x.astype(jnp.int32)


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
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"dot_product_attention: row_col_bias's {name} term must be floating, got {x.dtype}"
            )
        if x.shape != want:
            raise ValueError(
                f"dot_product_attention: row_col_bias's {name} term must have shape "
                f"{list(want)}, got {list(x.shape)}"
            )
        out.append(x)
    return out[0], out[1]


def _fold_lengths(seg, lengths, length: int, batch: int, pad: int) -> Array | None:
    """Segment ids with positions at or past `lengths` replaced by `pad`."""
    if lengths is None:
        return seg
    valid = jnp.arange(length, dtype=jnp.int32)[None, :] < lengths[:, None]  # [B, L]
    base = jnp.ones((batch, length), jnp.int32) if seg is None else seg
    return jnp.where(valid, base, jnp.int32(pad))


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


def normalise(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_positions=None,
    kv_positions=None,
    relative: ShawRelative | None = None,
    score_mod: ScoreMod | None = None,
    row_col_bias=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    dropout_broadcast_batch: bool = False,
    assume_finite: bool = False,
) -> NormalForm:
    """Check rank-4 `dot_product_attention` arguments and build their normal form.

    Same arguments and meaning as `jattn.dot_product_attention` (rank-4
    inputs only; the entry point adds the batch axis of rank-3 ones). Every
    error names the argument and the shapes involved.
    """
    query, key, value = (jnp.asarray(a) for a in (query, key, value))
    for name, a in (("query", query), ("key", key), ("value", value)):
        if a.ndim != 4:
            raise ValueError(
                f"dot_product_attention: {name} must have rank 4 ([B, T|S, heads, head_dim]) "
                f"or 3 (no batch axis), got shape {list(a.shape)}"
            )
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"dot_product_attention: {name} must be floating, got {a.dtype}")
    b, t, n, h = query.shape
    bk, s, k, hk = key.shape
    if bk != b or value.shape[0] != b:
        raise ValueError(
            "dot_product_attention: batch sizes differ: query "
            f"{list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
        )
    if h == 0 or value.shape[3] == 0:
        raise ValueError(
            "dot_product_attention: head_dim must be at least 1, got query "
            f"{list(query.shape)}, value {list(value.shape)} (the last axis is the head dim)"
        )
    if hk != h:
        raise ValueError(
            f"dot_product_attention: query head dim {h} != key head dim {hk} "
            f"(query {list(query.shape)}, key {list(key.shape)})"
        )
    if value.shape[1] != s or value.shape[2] != k:
        raise ValueError(
            f"dot_product_attention: value [B, S, K, Hv] must match key [B, S, K, H] in S "
            f"and K: key {list(key.shape)}, value {list(value.shape)}"
        )
    if k == 0 or n % k:
        raise ValueError(
            f"dot_product_attention: key heads K={k} must divide query heads N={n} "
            f"(query {list(query.shape)}, key {list(key.shape)})"
        )
    full = (b, n, t, s)
    if bias is not None:
        bias = _as_rank4(bias, "bias", full)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"dot_product_attention: bias must be floating, got {bias.dtype}")
    if mask is not None:
        mask = _as_rank4(mask, "mask", full)
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"dot_product_attention: mask must be boolean (True = may attend), got {mask.dtype}"
            )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        missing = "kv_segment_ids" if kv_segment_ids is None else "q_segment_ids"
        raise ValueError(f"dot_product_attention: segment ids come in pairs; {missing} is missing")
    if q_segment_ids is not None:
        q_segment_ids = mark_padding(_int_ids(q_segment_ids, "q_segment_ids", b, t, "T"), PAD_Q)
        kv_segment_ids = mark_padding(_int_ids(kv_segment_ids, "kv_segment_ids", b, s, "S"), PAD_KV)
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        q_len = None
        kv_len = None
        if query_seq_lengths is not None:
            q_len = _lengths(query_seq_lengths, "query_seq_lengths", b)
        if key_value_seq_lengths is not None:
            kv_len = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b)
        q_segment_ids = _fold_lengths(q_segment_ids, q_len, t, b, PAD_Q)
        kv_segment_ids = _fold_lengths(kv_segment_ids, kv_len, s, b, PAD_KV)
        if q_segment_ids is None:
            q_segment_ids = jnp.ones((b, t), jnp.int32)
        if kv_segment_ids is None:
            kv_segment_ids = jnp.ones((b, s), jnp.int32)
    q_pos = (
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if q_positions is None
        else _int_ids(q_positions, "q_positions", b, t, "T")
    )
    kv_pos = (
        jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if kv_positions is None
        else _int_ids(kv_positions, "kv_positions", b, s, "S")
    )
    rel_key = rel_value = None
    max_distance = 0
    if relative is not None:
        if not isinstance(relative, ShawRelative):
            raise TypeError(
                "dot_product_attention: relative must be a jattn.ShawRelative, "
                f"got {type(relative).__name__}"
            )
        max_distance = int(relative.max_distance)
        if max_distance < 0:
            raise ValueError(f"ShawRelative.max_distance must be >= 0, got {max_distance}")
        r = 2 * max_distance + 1
        if relative.key is not None:
            rel_key = _table(relative.key, "key", n, r, h, "H")
        if relative.value is not None:
            rel_value = _table(relative.value, "value", n, r, value.shape[-1], "Hv")
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(
            "dot_product_attention: score_mod must be a jattn.ScoreMod(fn, params), "
            f"got {type(score_mod).__name__}"
        )
    row_bias, col_bias = _row_col(row_col_bias, b, n, t, s)
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(
            f"dot_product_attention: dropout_rate must be in [0, 1), got {dropout_rate}"
        )
    seed = None
    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(
                f"dot_product_attention: dropout_rate={dropout_rate} needs a dropout_rng "
                "(a jax.random key)"
            )
        seed = dropout_lib.seed_words(dropout_rng)
    query, scale = _static_scale(query, scale, h)
    return NormalForm(
        query=query,
        key=key,
        value=value,
        bias=bias,
        mask=mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_pos,
        kv_positions=kv_pos,
        rel_key=rel_key,
        rel_value=rel_value,
        dropout_seed=seed,
        score_mod=score_mod,
        row_bias=row_bias,
        col_bias=col_bias,
        is_causal=bool(is_causal),
        window=window_pair(local_window_size),
        max_distance=max_distance,
        default_positions=q_positions is None and kv_positions is None,
        scale=scale,
        dropout_rate=dropout_rate if seed is not None else 0.0,
        dropout_broadcast_batch=bool(dropout_broadcast_batch),
        assume_finite=bool(assume_finite),
    )
