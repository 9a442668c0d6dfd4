"""`jattn.flax_attention_fn`: jattn behind flax's `attention_fn` signature.

    layer = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=jattn.flax_attention_fn("chunked"))
    layer = nnx.MultiHeadAttention(
        num_heads=8, in_features=64, attention_fn=jattn.flax_attention_fn(), rngs=rngs)

The returned function takes what `flax.linen.dot_product_attention` and
`flax.nnx.dot_product_attention` take and means the same by it:

- query `[batch..., T, N, H]`, key and value `[batch..., S, K, H|Hv]` with any
  number of leading batch dimensions (none included); they are flattened to
  jattn's one batch axis `B` and restored afterwards. bias and mask broadcast
  to `[batch..., N, T, S]`.
- masks may be boolean or float (flax's `make_causal_mask`,
  `make_attention_mask` and `combine_masks` give float 0/1): nonzero means
  "may attend".
- dropout is on iff `dropout_rate > 0 and not deterministic`, and then needs
  `dropout_rng`. `broadcast_dropout=True` means one keep mask shared by every
  batch row *and every head*, as flax's (`[1, ..., 1, T, S]`): the adapter
  folds the heads into the batch axis and uses jattn's
  `dropout_broadcast_batch`. The keep decisions are jattn's hash (the same in
  every implementation), not flax's `jax.random.bernoulli` draws.
- `dtype` promotes query, key and value (to their common type when None) and
  is the dtype returned. jattn computes logits and softmax in float32 at
  least, so `force_fp32_for_softmax=True` changes nothing in the output; it
  only makes the recorded weights float32, as flax's do.
- `module`: flax passes the layer when asked to record the weights
  (`sow_weights=True`); the adapter records `jattn.attention_weights` (before
  dropout, as flax) under `attention_weights`, in the `'intermediates'`
  collection for linen and as `nnx.Intermediate` for nnx.
- `precision`: a non-default precision is applied to every matmul of the
  "xla" implementation (forward and backward); `implementation=None` then
  resolves to "xla". The tiled paths cannot honour it and raise ValueError.
  Custom einsums (`einsum_dot_general`, `qk_attn_weights_einsum`,
  `attn_weights_value_einsum`) cannot be honoured by any implementation and
  raise ValueError.

Differences that remain (see docs/reuse.md): a query row with no visible key
returns 0 (flax: the mean of all values); complex inputs are not supported.

Flax is imported lazily (only to tell an nnx module from a linen one when
recording weights), so `import jattn` still needs no flax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.attention import IMPLEMENTATIONS, attention_weights, dot_product_attention
from jattn.visibility import Visibility, split_keywords

Array = jax.Array

__all__ = ["FORWARDED_OPTIONS", "flax_attention_fn"]

# jattn keywords `flax_attention_fn(**options)` forwards to every call: they
# do not depend on the batch, so one value is right for every call of a layer.
FORWARDED_OPTIONS = ("scale", "is_causal", "local_window_size", "relative")

# Why the other jattn keywords are refused as options.
_REFUSED = {
    "dropout_rate": "flax passes it (the layer's dropout_rate)",
    "dropout_rng": "flax passes it (the layer's 'dropout' rng stream)",
    "dropout_broadcast_batch": "flax passes it as broadcast_dropout",
    "return_residual": "flax's attention_fn returns the output only",
    "q_segment_ids": "it is per call and per batch row; pass a mask instead",
    "kv_segment_ids": "it is per call and per batch row; pass a mask instead",
    "q_positions": "it is per call and per batch row",
    "kv_positions": "it is per call and per batch row",
    "query_seq_lengths": "it is per call and per batch row; pass a mask instead",
    "key_value_seq_lengths": "it is per call and per batch row; pass a mask instead",
}

_PRECISION_NAMES = {"HIGH": "high", "HIGHEST": "highest"}


def _precision_name(precision: Any) -> str | None:
    """The `jax.default_matmul_precision` name of a non-default precision, or None."""
    if precision is None:
        return None
    items = precision if isinstance(precision, tuple | list) else (precision,)
    parsed = {jax.lax.Precision(p) if isinstance(p, str) else p for p in items}
    if len(parsed) != 1 or not isinstance(next(iter(parsed)), jax.lax.Precision):
        raise ValueError(
            f"flax_attention_fn: precision={precision!r} is not supported; give None or one "
            "jax.lax.Precision (the same for both operands)"
        )
    (p,) = parsed
    return _PRECISION_NAMES.get(p.name)


def _check_overrides(einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum):
    for name, given in (
        ("einsum_dot_general", einsum_dot_general),
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
        if given is not None:
            raise ValueError(
                f"flax_attention_fn: {name} is not supported: jattn's implementations do "
                "their own matmuls (fused or tiled) and cannot call a custom einsum; use "
                "flax's dot_product_attention for quantised (AQT) einsums"
            )


def _promote(query, key, value, dtype, promote_dtype: Callable | None):
    """Promote q, k, v as flax does: to `dtype`, or to their common inexact type."""
    if promote_dtype is not None:  # nnx's convention: a tuple in, a tuple out
        return tuple(promote_dtype((query, key, value), dtype=dtype))
    arrays = tuple(jnp.asarray(a) for a in (query, key, value))
    if dtype is None:
        dtype = jnp.result_type(*arrays)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.promote_types(jnp.float32, dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"flax_attention_fn: complex inputs ({dtype}) are not supported by jattn; "
            "use flax's dot_product_attention"
        )
    return tuple(a.astype(dtype) for a in arrays)


def _flatten_pairwise(x, batch: tuple[int, ...], name: str) -> Array | None:
    """`x` broadcastable to `[batch..., N, T, S]` as a rank-4 `[B|1, N|1, T|1, S|1]`."""
    if x is None:
        return None
    x = jnp.asarray(x)
    nb = len(batch)
    if x.ndim > nb + 3:
        raise ValueError(
            f"flax_attention_fn: {name} of shape {list(x.shape)} has more dimensions than "
            f"[batch..., N, T, S] with batch {list(batch)}"
        )
    x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
    lead, rest = x.shape[:nb], x.shape[nb:]
    if all(d == 1 for d in lead):
        return x.reshape((1, *rest))
    if lead != batch:
        try:
            x = jnp.broadcast_to(x, batch + rest)
        except ValueError as e:
            raise ValueError(
                f"flax_attention_fn: {name} of shape {list(x.shape)} does not broadcast "
                f"to the batch dimensions {list(batch)}"
            ) from e
    return x.reshape((math.prod(batch), *rest))


def _fold_heads(query, key, value, bias, mask, relative):
    """Move the heads into the batch axis: `[B, T, N, H]` -> `[B*N, T, 1, H]`.

    With `dropout_broadcast_batch` every folded row then shares one keep mask,
    which is flax's `broadcast_dropout` (shared over batch and heads).
    """
    b, t, n, _ = query.shape
    k = key.shape[2]
    if relative is not None and any(
        tab is not None and np.ndim(tab) == 3 for tab in (relative.key, relative.value)
    ):
        raise ValueError(
            "flax_attention_fn: per-head ShawRelative tables [N, 2k+1, H] cannot be used "
            "with broadcast_dropout=True (the adapter folds heads into the batch); use "
            "shared tables [2k+1, H] or broadcast_dropout=False"
        )

    def rows(x):  # [B, L, N, D] -> [B*N, L, 1, D]
        return x.transpose(0, 2, 1, 3).reshape(b * n, x.shape[1], 1, x.shape[3])

    if k != n:  # GQA/MQA: query head i reads kv head i // (N/K)
        key, value = (jnp.repeat(a, n // k, axis=2) for a in (key, value))

    def pairwise(x):  # [B|1, N|1, T, S] -> [B*N|1, 1, T, S]
        if x is None or x.shape[:2] == (1, 1):
            return x
        x = jnp.broadcast_to(x, (b, n, *x.shape[2:]))
        return x.reshape(b * n, 1, *x.shape[2:])

    return rows(query), rows(key), rows(value), pairwise(bias), pairwise(mask), (b, t, n)


def _sow(module, weights: Array) -> None:
    """Record the weights the way the module's flax API does."""
    from flax import nnx  # lazy: only when flax asked for the weights

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def flax_attention_fn(implementation: str | None = None, **options) -> Callable[..., Array]:
    """An `attention_fn` for flax's attention layers that runs jattn.

    Usable as `flax.linen.MultiHeadDotProductAttention(attention_fn=...)`
    and `flax.nnx.MultiHeadAttention(attention_fn=...)`, or called directly
    like `flax.linen.dot_product_attention` / `flax.nnx.dot_product_attention`.

    Args:
      implementation: jattn's implementation for every call: None (the
        rule's choice for the call and the backend, `jattn.attention.rule`;
        "xla" when a non-default `precision` is given), "xla", "chunked",
        "pallas" or "cudnn".
      **options: jattn keywords forwarded to every call, from
        `FORWARDED_OPTIONS`: `scale` (default 1/sqrt(H), as flax),
        `is_causal` (or'ed with nnx's per-call `is_causal`),
        `local_window_size`, `relative` (a `jattn.ShawRelative`). They use
        query index i and key index j as positions, which a cached decoding
        step (one query against the whole cache) does not satisfy: use them
        for full-sequence calls. Batch-dependent keywords (segment ids,
        positions, sequence lengths) and the ones flax itself passes
        (dropout, residual) are refused with a ValueError saying why.

    Returns:
      `attention_fn(query, key, value, bias=None, mask=None,
      broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
      deterministic=False, dtype=None, precision=None, module=None, *,
      force_fp32_for_softmax=False, einsum_dot_general=None,
      qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
      promote_dtype=None, is_causal=False)` returning
      `[batch..., T, N, Hv]` in the promoted dtype.

    Raises:
      ValueError: an unknown implementation, or a jattn keyword that cannot
        be an option (the message says why).
      TypeError: an option that is no jattn keyword.
    """
    if implementation is not None and implementation not in (*IMPLEMENTATIONS, "cudnn"):
        raise ValueError(
            f"flax_attention_fn: unknown implementation {implementation!r}; choose one of "
            f"{sorted((*IMPLEMENTATIONS, 'cudnn'))} or None"
        )
    for name in options:
        if name in _REFUSED:
            raise ValueError(f"flax_attention_fn: {name} cannot be an option: {_REFUSED[name]}")
        if name not in FORWARDED_OPTIONS:
            raise TypeError(
                f"flax_attention_fn: unknown option {name!r}; the options forwarded to "
                f"every call are {list(FORWARDED_OPTIONS)}"
            )
    # The options' rules as one value, built (and checked) once for every call.
    base, rest = split_keywords(options)
    scale, relative = rest.get("scale"), rest.get("relative")

    def attention_fn(
        query: Array,
        key: Array,
        value: Array,
        bias: Array | None = None,
        mask: Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: Any = None,
        *,
        force_fp32_for_softmax: bool = False,
        einsum_dot_general: Callable | None = None,
        qk_attn_weights_einsum: Callable | None = None,
        attn_weights_value_einsum: Callable | None = None,
        promote_dtype: Callable | None = None,
        is_causal: bool = False,
    ) -> Array:
        """flax's `dot_product_attention`, computed by `jattn.dot_product_attention`."""
        _check_overrides(einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum)
        matmul_precision = _precision_name(precision)
        impl = implementation
        if matmul_precision is not None:
            if impl is None:
                impl = "xla"
            elif impl != "xla":
                raise ValueError(
                    f"flax_attention_fn: precision={precision!r} can only be honoured by "
                    f'implementation="xla", not {impl!r}; drop precision or use "xla"'
                )
        query, key, value = _promote(query, key, value, dtype, promote_dtype)
        out_dtype = query.dtype
        if not query.ndim == key.ndim == value.ndim or query.ndim < 3:
            raise ValueError(
                "flax_attention_fn: query, key and value must have the same rank >= 3 "
                f"([batch..., length, heads, head_dim]), got {list(query.shape)}, "
                f"{list(key.shape)}, {list(value.shape)}"
            )
        batch = tuple(query.shape[:-3])
        if key.shape[:-3] != batch or value.shape[:-3] != batch:
            raise ValueError(
                "flax_attention_fn: batch dims must match: query "
                f"{list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
            )
        b = math.prod(batch)
        t, n, _ = query.shape[-3:]
        q4, k4, v4 = (a.reshape((b, *a.shape[-3:])) for a in (query, key, value))  # [B,L,N,D]
        bias4 = _flatten_pairwise(bias, batch, "bias")
        if bias4 is not None and not jnp.issubdtype(bias4.dtype, jnp.floating):
            bias4 = bias4.astype(jnp.float32)
        mask4 = _flatten_pairwise(mask, batch, "mask")
        if mask4 is not None and mask4.dtype != jnp.bool_:
            mask4 = mask4 != 0  # flax's float masks: nonzero = may attend
        dropout_on = dropout_rate > 0.0 and not deterministic
        if dropout_on and dropout_rng is None:
            raise ValueError(
                f"flax_attention_fn: dropout_rate={dropout_rate} with deterministic=False "
                "needs a dropout_rng"
            )
        rules = base if not is_causal else base & Visibility(is_causal=True)  # nnx's per call
        common = dict(scale=scale, relative=relative, visibility=rules)

        def compute() -> Array:
            if not dropout_on:
                return dot_product_attention(
                    q4, k4, v4, bias4, mask4, implementation=impl, **common
                )
            if not broadcast_dropout:
                return dot_product_attention(
                    q4, k4, v4, bias4, mask4, implementation=impl,
                    dropout_rate=dropout_rate, dropout_rng=dropout_rng, **common,
                )  # fmt: skip
            fq, fk, fv, fbias, fmask, (bb, tt, nn) = _fold_heads(q4, k4, v4, bias4, mask4, relative)
            out = dot_product_attention(
                fq, fk, fv, fbias, fmask, implementation=impl, dropout_rate=dropout_rate,
                dropout_rng=dropout_rng, dropout_broadcast_batch=True, **common,
            )  # fmt: skip  # [B*N, T, 1, Hv]
            return out.reshape(bb, nn, tt, -1).transpose(0, 2, 1, 3)  # [B, T, N, Hv]

        def weights() -> Array:
            w = attention_weights(q4, k4, bias4, mask4, **common)  # [B, N, T, S] f32
            w_dtype = jnp.float32 if force_fp32_for_softmax else out_dtype
            return w.reshape(batch + w.shape[1:]).astype(w_dtype)

        if matmul_precision is None:
            out = compute()
            if module is not None:
                _sow(module, weights())
        else:
            with jax.default_matmul_precision(matmul_precision):
                out = compute()
                if module is not None:
                    _sow(module, weights())
        return out.reshape(batch + (t, n, out.shape[-1])).astype(out_dtype)

    attention_fn.__qualname__ = attention_fn.__name__ = (
        f"jattn_attention_fn[{implementation or 'auto'}]"
    )
    return attention_fn
