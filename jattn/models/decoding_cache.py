"""The decoding cache's building blocks: the empty cache, its prefill, one cached step.

`init_cache` sizes the "cache" collection (layout: `jattn.models.decoding`'s
docstring); `prefill` projects an encoder output into every decoder layer's
cross-attention keys/values, once per decode call; `prefill_prompt` writes a
decoder-only prompt into the first slots of the self-attention cache;
`decode_step` runs one token through `Transformer.step`. `prepare_decoding`
is what a search (`jattn.models.decoding_search`) starts from: the cache
before the first step and what every step is given, tiled over the beams.

Shapes: the letters of `jattn.attention.legend` (W beams, L = max_length,
S source length, V vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.transformer import Transformer

Array = jax.Array

__all__ = [
    "decode_step",
    "init_cache",
    "prefill",
    "prefill_prompt",
    "prepare_decoding",
    "unbox_params",
]


def unbox_params(params: Any) -> Any:
    """Accept the "params" collection or a variables dict `{"params": ...}`."""
    if isinstance(params, Mapping) and set(params) == {"params"}:
        params = params["params"]
    return nn.unbox(params)


def init_cache(
    model: Transformer, batch_size: int, max_length: int, source_length: int | None = None
) -> Any:
    """An empty "cache" collection (zeros, index 0) for `max_length` decoder
    steps over a source of `source_length` tokens (default `max_length`).

    Shapes (see the module docstring) come from `jax.eval_shape` of `init`,
    so nothing but the cache is built. This is the cache's size and
    structure (`jattn.attention.memory.kv_cache_bytes` counts it, with the same default
    source length); to decode, start from `prefill`, which fills the
    cross-attention entries (here zeros, which a step would attend to
    silently). The self-attention entries fill up one step at a time.
    """
    s = max_length if source_length is None else source_length
    cached = model.clone(use_cache=True)
    inputs = jnp.ones((batch_size, s), jnp.int32)
    targets = jnp.ones((batch_size, max_length), jnp.int32)
    shapes = jax.eval_shape(lambda: cached.init(jax.random.key(0), inputs, targets))["cache"]
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)


def prefill(model: Transformer, params: Any, encoded: Array, max_length: int) -> Any:
    """The cache for decoding `max_length` steps over `encoded` `[B, S, D]`.

    Every decoder layer's cross-attention keys/values `[B, S, K, H]` are the
    projections of `encoded` (computed here, once); the self-attention
    entries are zeros and the index is 0.
    """
    b, s = encoded.shape[:2]
    cache = init_cache(model, b, max_length, source_length=s)
    _, variables = model.clone(use_cache=True).apply(
        {"params": unbox_params(params), "cache": cache},
        encoded,
        mutable=["cache"],
        method="prefill",
    )
    return variables["cache"]


def prefill_prompt(
    model: Transformer,
    params: Any,
    inputs: Array,
    max_length: int,
    *,
    positions: tuple[Array, Array] | None = None,
) -> Any:
    """Decoder-only: the cache for decoding `max_length` steps after the prompt
    `inputs` `[B, S]` (unpacked, 0 = padding): one pass of the stack writes
    the prompt's keys/values into slots 0..S-1; the index is S.

    `positions`: None (the prompt at `arange(S)`, the separator one past its
    last real token), or `(prompt [B, S], after [B, max_length])` from
    `decoding_positions`, stored as the slots' positions."""
    b, s = inputs.shape
    cache = init_cache(model, b, max_length, source_length=s)
    prompt, after = (None, None) if positions is None else positions
    _, variables = model.clone(use_cache=True).apply(
        {"params": unbox_params(params), "cache": cache},
        inputs,
        mutable=["cache"],
        method="prefill_prompt",
        inputs_positions=prompt,
        targets_positions=after,
    )
    return variables["cache"]


def prepare_decoding(
    model, params, inputs, max_length: int, cross_cache: bool, beams: int, positions
):
    """The cache before the first step and what every step is given:
    `(cache, step inputs [B*W, S], decode_step's keyword arguments)`, W =
    `beams`. `positions` (`decoding_positions`'s, or None) are drawn per
    source row and tiled over its beams, which so share them."""
    inputs_w = jnp.repeat(inputs, beams, axis=0)  # [B*W, S], row b*W + j
    tiled = None if positions is None else tuple(jnp.repeat(p, beams, axis=0) for p in positions)
    if model.architecture.joined:  # one stream: prefill the prompt, no encoder
        cache = prefill_prompt(model, params, inputs_w, max_length, positions=tiled)
        return cache, inputs_w, {}  # the positions are in the cache
    source = None if positions is None else positions[0]
    encoded = model.apply(
        {"params": params}, inputs, method="encode", inputs_positions=source
    )  # [B, S, D]
    enc_w = jnp.repeat(encoded, beams, axis=0)  # [B*W, S, D]
    cache = _start_cache(model, params, enc_w, max_length, cross_cache)
    step = {"encoded": None if cross_cache else enc_w}
    if tiled is not None:
        step.update(inputs_positions=tiled[0], targets_positions=tiled[1])
    return cache, inputs_w, step


def decode_step(
    model: Transformer,
    params: Any,
    cache: Any,
    inputs: Array,
    tokens: Array,
    *,
    encoded: Array | None = None,
    inputs_positions: Array | None = None,
    targets_positions: Array | None = None,
) -> tuple[Array, Any]:
    """One cached decoder step.

    Args:
      model: the Transformer (cloned with `use_cache=True` here).
      params: its "params" collection.
      cache: from `prefill` or the previous step.
      inputs: int `[B, S]` source tokens (their zeros mask cross-attention).
      tokens: int `[B, 1]`, the previous token (0 at the first step).
      encoded: None (cross-attention reads the prefilled keys/values), or the
        encoder outputs `[B, S, D]` to project them again at this step (the
        uncached path, for comparisons; the cross-attention cache is then
        neither read nor written).
      inputs_positions, targets_positions: encoder–decoder only, int
        `[B, S]` and `[B, L]`: the positions the source was encoded with and
        those of the L target slots (`decoding_positions`: randomised
        positions); None: `arange`. A decoder-only model's are in its cache.

    Returns:
      float32 logits `[B, V]` for the next token, and the updated cache.
    """
    logits, variables = model.clone(use_cache=True).apply(
        {"params": unbox_params(params), "cache": cache},
        inputs,
        tokens,
        encoded=encoded,
        mutable=["cache"],
        method="step",
        inputs_positions=inputs_positions,
        targets_positions=targets_positions,
    )
    return logits[:, 0].astype(jnp.float32), variables["cache"]


def _start_cache(model, params, encoded, max_length: int, cross_cache: bool) -> Any:
    """`prefill`, or for the uncached path an empty cache (cross entries unused)."""
    if cross_cache:
        return prefill(model, params, encoded, max_length)
    return init_cache(model, encoded.shape[0], max_length, source_length=encoded.shape[1])
