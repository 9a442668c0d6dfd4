"""`jattn.dot_product_attention`: one entry point, several implementations.

The public function checks its inputs once, puts them in one normal form and
hands them to an implementation picked by name:

- ``"xla"``: the readable reference. Materialises the `[B, N, T, S]` logits.
- ``"chunked"``: pure JAX, tiled over queries and keys with an online softmax
  and a custom VJP that recomputes weights from the saved log-sum-exp, so
  forward and backward need O(T + S) memory per head, not O(T·S).
- ``"pallas"``: the tiled Pallas kernel: Triton on GPUs, Mosaic on TPU,
  interpret mode on the CPU.

Every implementation receives the same normal form (see `_normalise`):
query `[B, T, N, H]`, key `[B, S, K, H]`, value `[B, S, K, Hv]`; bias and mask
rank 4 with each axis 1 or full; positions always present as int32 `[B, T]`
and `[B, S]`; segment ids both present or both None; Shaw tables per head,
`[N, R, H]` and `[N, R, Hv]`, or None.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn.positions import ShawRelative

Array = jax.Array

__all__ = [
    "IMPLEMENTATIONS",
    "attention_weights",
    "default_implementation",
    "dot_product_attention",
]

# name -> "module:function"; imported lazily so `import jattn` stays cheap and a
# missing optional backend only fails when asked for.
IMPLEMENTATIONS: dict[str, str] = {
    "xla": "jattn.attention_xla:attention_xla",
    "chunked": "jattn.attention_chunked:attention_chunked",
    "pallas": "jattn.kernels.flash_attention:flash_attention",
}

# Above this many logits per (batch, head) the chunked path beats
# materialising them on the CPU (see docs/benchmarks.md).
_CHUNKED_MIN_LOGITS = 1024 * 1024


def default_implementation(t: int, s: int, backend: str | None = None) -> str:
    """The implementation `implementation=None` resolves to.

    On NVIDIA/AMD GPUs the Pallas kernel (Triton); on the CPU and on TPU the
    xla path for small problems (fewer dispatch overheads) and the chunked
    path once the logits would be large. The kernel's Mosaic (TPU) variant is
    reached with `implementation="pallas"`; it is lowered and checked in
    interpret mode, but has never been compiled or timed on a TPU, so it is
    not the default there.
    """
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "pallas"
    return "chunked" if t * s >= _CHUNKED_MIN_LOGITS else "xla"


def _resolve(name: str) -> Callable[..., Array]:
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"dot_product_attention: unknown implementation {name!r}; "
            f"choose one of {sorted(IMPLEMENTATIONS)} or None"
        )
    module, fn = IMPLEMENTATIONS[name].split(":")
    return getattr(importlib.import_module(module), fn)


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _as_rank4(x: Array, name: str, full: tuple[int, int, int, int]) -> Array:
    """Left-pad `x` to rank 4 and check each axis is 1 or the full size."""
    x = jnp.asarray(x)
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


def _int_ids(x, name: str, batch: int, length: int, what: str) -> Array:
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


def _table(x, name: str, n: int, r: int, h: int, h_name: str) -> Array:
    x = jnp.asarray(x)
    if x.ndim == 2:
        if x.shape != (r, h):
            raise ValueError(
                f"ShawRelative.{name} must be [2k+1, {h_name}]=[{r}, {h}] or "
                f"[N, 2k+1, {h_name}]=[{n}, {r}, {h}], got {list(x.shape)}"
            )
        return jnp.broadcast_to(x[None], (n, r, h))
    if x.shape != (n, r, h):
        raise ValueError(
            f"ShawRelative.{name} must be [2k+1, {h_name}]=[{r}, {h}] or "
            f"[N, 2k+1, {h_name}]=[{n}, {r}, {h}], got {list(x.shape)}"
        )
    return x


def _normalise(
    query,
    key,
    value,
    *,
    bias,
    mask,
    is_causal,
    q_segment_ids,
    kv_segment_ids,
    q_positions,
    kv_positions,
    relative,
    scale,
) -> tuple[tuple[Array, Array, Array], dict]:
    """Check every argument and return `(q, k, v), kwargs` in normal form."""
    query, key, value = (jnp.asarray(a) for a in (query, key, value))
    for name, a in (("query", query), ("key", key), ("value", value)):
        if a.ndim != 4:
            raise ValueError(
                f"dot_product_attention: {name} must have rank 4 ([B, T|S, heads, head_dim]), "
                f"got shape {list(a.shape)}"
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
        q_segment_ids = _int_ids(q_segment_ids, "q_segment_ids", b, t, "T")
        kv_segment_ids = _int_ids(kv_segment_ids, "kv_segment_ids", b, s, "S")
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
    if scale is None:
        scale = 1.0 / float(np.sqrt(h))
    kwargs = dict(
        bias=bias,
        mask=mask,
        is_causal=bool(is_causal),
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_pos,
        kv_positions=kv_pos,
        rel_key=rel_key,
        rel_value=rel_value,
        max_distance=max_distance,
        scale=float(scale),
    )
    return (query, key, value), kwargs


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    bias: Array | None = None,
    mask: Array | None = None,
    is_causal: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    relative: ShawRelative | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> Array:
    """Scaled dot-product attention with masks, packing and relative positions.

    `softmax(scale * (q·k + q·key_rel[r]) + bias, masked) @ (v + value_rel[r])`
    per head, in the layout of `jax.nn.dot_product_attention`.

    Args:
      query: `[B, T, N, H]`.
      key: `[B, S, K, H]`; K divides N (MHA K=N, GQA 1<K<N, MQA K=1).
      value: `[B, S, K, Hv]`.
      bias: float, broadcastable to `[B, N, T, S]`; added to the scaled logits.
      mask: bool, broadcastable to `[B, N, T, S]`; True = may attend.
      is_causal: a key is visible iff `kv_position <= q_position`.
      q_segment_ids: int `[B, T]`; attend iff q and kv segment ids are equal.
      kv_segment_ids: int `[B, S]`; required with `q_segment_ids`.
      q_positions: int `[B, T]`; default `arange(T)`; used by causal and
        relative terms (packed rows restart them per segment; decoding offsets
        them into the cache).
      kv_positions: int `[B, S]`; default `arange(S)`.
      relative: `jattn.ShawRelative` tables, or None.
      scale: logit scale, default `1/sqrt(H)`.
      implementation: None (best for the backend and shapes), "xla",
        "chunked" or "pallas".

    Returns:
      `[B, T, N, Hv]` in the dtype of `query`. A query row with no visible key
      returns exactly 0 and passes no gradient.
    """
    (q, k, v), kwargs = _normalise(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
        relative=relative,
        scale=scale,
    )
    name = implementation or default_implementation(q.shape[1], k.shape[1])
    return _resolve(name)(q, k, v, **kwargs)


def attention_weights(
    query: Array,
    key: Array,
    *,
    bias: Array | None = None,
    mask: Array | None = None,
    is_causal: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    relative: ShawRelative | None = None,
    scale: float | None = None,
) -> Array:
    """The weights `dot_product_attention` mixes values with, for probing.

    Same arguments and visibility rules as `dot_product_attention` (the Shaw
    value table plays no part in the weights). Materialises `[B, N, T, S]`
    by design: for inspecting small inputs, never for training.

    Returns:
      float32 `[B, N, T, S]`; each row sums to 1 over its visible keys, and a
      row with no visible key is all zeros.
    """
    from jattn.attention_xla import attention_weights_xla

    (q, k, _), kw = _normalise(
        query,
        key,
        key,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
        relative=relative,
        scale=scale,
    )
    kw.pop("rel_value")
    return attention_weights_xla(q, k, **kw)
