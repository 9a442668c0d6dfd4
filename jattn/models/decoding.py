"""Greedy and beam-search decoding over the decoder's KV cache.

Both run as one jitted `lax.while_loop`. Before the loop the source is
encoded once and `prefill` projects the encoder output into every decoder
layer's cross-attention keys/values, once per decode call: they depend on
the source only, so recomputing them at each step would repeat the same
`2 · B·S·D·K·H` multiply-adds a layer `max_length` times. Each step then
feeds the previous token `[B, 1]` (0, the start symbol, at step 0) to
`Transformer.step` on a clone with `use_cache=True`, without the encoder
output (the decoder's "step" mode): cross-attention reads the cached keys/values and the step never
touches the cross-attention "k"/"v" weights. The query's position is the
cache index, so every positional scheme (absolute vectors, Shaw, RoPE,
ALiBi, T5) sees the same positions as in a full forward pass, and causal
masking over the cache positions hides slots not yet written.

The "cache" collection (`init_cache`), per decoder layer `i`:

    decoder/index                                   int32 []   next position
    decoder/layer_i/self_attention/cached_{key,value}   [B, L, K, H]
    decoder/layer_i/cross_attention/cached_{key,value}  [B, S, K, H]
    decoder/layer_i/self_attention/cached_gate          [B, L, N]  float32, forget
                                                    gates' running sums (`position="forgetting"`)

Beam search keeps B·W rows of both: the encoder output is tiled over the
beams before the prefill, so row `b·W + j` is beam `j` of source `b`. That
stores W equal copies of each row's cross-attention keys/values (W times
the memory of computing them once per row and broadcasting over beams),
and buys simplicity: every cache leaf keeps the leading axis B·W that the
decoder's queries have, so the decoder knows nothing of beams. Reordering
beams only ever moves a row to another beam of the same source, whose
cross-attention keys/values are the same, so the cross entries are left
out of the reorder (the self-attention entries follow it).

An encoder-only model (`architecture="encoder_only"`, not autoregressive)
has no loop: `greedy` and `beam_search` read a tape of `max_length` cells
(or `tape_lengths`) in one call and take each cell's argmax.

A decoder-only model (`TransformerConfig.architecture="decoder_only"`) runs
the same loops: instead of encoding and prefilling the cross-attention, one
pass over the prompt (`prefill_prompt`) writes the inputs' keys/values into
the first S slots of every layer's self-attention cache (L = S + max_length
slots), and step k feeds the previous token (the separator 0 first) at slot
S + k; beam search tiles the prompt over the beams before the prefill.

Randomised positions (Ruoss et al. 2023; `random_positions` = M with
`random_positions_eval=True`, or `random_positions=True` here) are drawn
once per call, before the loop (`decoding_positions`, from the caller's
`rng`): so every step's position is known before its token is decoded. The
encoder–decoder's steps are given all L slots' positions (the causal rule
over these sorted positions hides the slots not yet written); the
decoder-only prefill stores them as the cache's `slot_positions`. Beam
search tiles a row's draw over its beams, which so share it. Evaluation
(`jattn train`'s exact-match metrics, `jattn decode`) passes no rng and gets
the fixed key 0, the key of the teacher-forced metrics' random positions:
every evaluation of a run sees the same draw, and a change across steps is
the model's.

Token 0 is padding and the start symbol; token 1 (`EOS`) ends a sequence.
Outputs are int32 `[B, max_length]`, with EOS kept and 0 after it.

Shapes: the letters of `jattn.attention.legend` (W beams, L = max_length,
S source length, V vocabulary).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jattn.models.inputs import decoding_positions
from jattn.models.transformer import Transformer

Array = jax.Array

__all__ = [
    "EOS",
    "NEG",
    "beam_search",
    "beam_search_with_scores",
    "decode_step",
    "decoding_positions",
    "gather_beams",
    "greedy",
    "greedy_search",
    "init_cache",
    "prefill",
    "prefill_prompt",
    "reorder_cache",
]

EOS = 1
# The log-probability of an empty beam and of no finished hypothesis yet: a
# "minus infinity" that stays finite through sums and divisions.
NEG = -1.0e9


# -- building blocks -----------------------------------------------------------


def _unwrap(params: Any) -> Any:
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
        {"params": _unwrap(params), "cache": cache}, encoded, mutable=["cache"], method="prefill"
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
        {"params": _unwrap(params), "cache": cache},
        inputs,
        mutable=["cache"],
        method="prefill_prompt",
        inputs_positions=prompt,
        targets_positions=after,
    )
    return variables["cache"]


def _decode_positions(model, inputs, max_length: int, rng, random_positions):
    """The positions a decode call uses: None (plain), or `decoding_positions`
    where `random_positions` (None: the config's `random_positions_eval`,
    which acts only with `random_positions` = M > 0, as in teacher forcing)."""
    cfg = model.config
    if random_positions is None:
        random_positions = bool(cfg.random_positions and cfg.random_positions_eval)
    if not random_positions:
        return None
    return decoding_positions(cfg, jax.random.key(0) if rng is None else rng, inputs, max_length)


def _start(model, params, inputs, max_length: int, cross_cache: bool, beams: int, positions):
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
        {"params": _unwrap(params), "cache": cache},
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


def _check(model, inputs, max_length: int) -> Array:
    if not isinstance(model, Transformer):
        raise TypeError(f"decoding: model must be a jattn.models.Transformer, got {type(model)}")
    inputs = jnp.asarray(inputs)
    if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
        raise ValueError(
            f"decoding: inputs must be integer token ids [B, S], got {inputs.dtype} "
            f"{list(inputs.shape)}"
        )
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"decoding: max_length must be a positive int, got {max_length!r}")
    cfg = model.config
    joined = model.architecture.joined  # a row is the prompt and its outputs
    longest = max_length + (inputs.shape[1] if joined else 0)
    if cfg.max_position is not None and longest > cfg.max_position:
        raise ValueError(
            f"decoding: max_length={max_length}"
            + (f" + {inputs.shape[1]} input tokens" if joined else "")
            + f" exceeds max_len={cfg.max_position} of the {cfg.position!r} positions"
        )
    return inputs.astype(jnp.int32)


# -- an output tape (not autoregressive) ------------------------------------------


def _tape_lengths(tape_lengths, batch: int, max_length: int) -> Array | None:
    """Checked `tape_lengths` (int `[B]`, each in [1, max_length]) or None."""
    if tape_lengths is None:
        return None
    lengths = jnp.asarray(tape_lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"decoding: tape_lengths must be int [{batch}], got {lengths.dtype} "
            f"{list(lengths.shape)}"
        )
    return lengths.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "max_length"))
def _tape(model, params, inputs: Array, max_length: int, lengths, rng) -> Array:
    """An encoder-only model's outputs: one call over a tape of `lengths`
    cells a row (None: `max_length`), the argmax of each cell, 0 after the
    first EOS and past the tape. int32 `[B, max_length]`."""
    b = inputs.shape[0]
    lengths = jnp.full((b,), max_length, jnp.int32) if lengths is None else lengths
    cells = (jnp.arange(max_length)[None, :] < lengths[:, None]).astype(jnp.int32)  # [B, L]
    rngs = {} if rng is None else {"dropout": rng}  # only random positions read it
    logits = model.apply({"params": params}, inputs, cells, rngs=rngs)  # [B, L, V]
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32) * cells  # [B, L]
    eos = (tokens == EOS).astype(jnp.int32)
    after_eos = (jnp.cumsum(eos, axis=1) - eos) > 0  # [B, L], past the first EOS
    return jnp.where(after_eos, 0, tokens)


# -- greedy --------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("model", "max_length", "cross_cache"))
def _greedy(
    model: Transformer,
    params,
    inputs: Array,
    max_length: int,
    cross_cache: bool = True,
    positions: tuple[Array, Array] | None = None,
) -> tuple[Array, Array]:
    """Greedy tokens `[B, L]` and the number of steps run.

    `cross_cache=False` projects the cross-attention keys/values at every step
    (the path before the cache; same tokens, kept for benchmarks and tests).
    `positions`: `decoding_positions`'s draw, or None (plain positions).
    """
    b = inputs.shape[0]
    cache, inputs, step = _start(model, params, inputs, max_length, cross_cache, 1, positions)

    def cond(state):
        i, _, _, done, _ = state
        return (i < max_length) & ~jnp.all(done)

    def body(state):
        i, tokens, last, done, cache = state
        logits, cache = decode_step(model, params, cache, inputs, last[:, None], **step)  # [B, V]
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        nxt = jnp.where(done, 0, nxt)
        tokens = lax.dynamic_update_slice(tokens, nxt[:, None], (0, i))
        return i + 1, tokens, nxt, done | (nxt == EOS), cache

    state = (
        jnp.zeros((), jnp.int32),
        jnp.zeros((b, max_length), jnp.int32),
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b,), bool),
        cache,
    )
    steps, tokens, _, _, _ = lax.while_loop(cond, body, state)
    return tokens, steps


def greedy(
    model: Transformer,
    params: Any,
    inputs: Array,
    *,
    max_length: int,
    rng: Array | None = None,
    random_positions: bool | None = None,
    tape_lengths: Array | None = None,
) -> Array:
    """Greedy decoding with the KV cache, stopping once every row has emitted EOS.

    Args:
      model: a `jattn.models.Transformer`.
      params: its "params" collection (or `{"params": ...}`).
      inputs: int `[B, S]` source tokens, 0 = padding (unpacked rows).
      max_length: number of target tokens to produce at most.
      rng: the key of the random positions (`decoding_positions`); None: the
        fixed key 0 (what evaluation uses). Unused with plain positions.
      random_positions: None: the config's choice (`random_positions_eval`,
        acting where `random_positions` = M > 0); True: Ruoss et al.'s
        random positions (an error without M); False: plain positions.
      tape_lengths: encoder-only models (`Architecture.autoregressive`
        False): int `[B]`, each row's tape cells, the output length it is
        told (Delétang et al.); None: `max_length` cells. The tape is read
        in one call (no steps); its random positions are the model's own
        draw (the teacher-forced one), from `rng` where given. Autoregressive
        models ignore it.

    Returns:
      int32 `[B, max_length]`: argmax tokens, EOS included, 0 after EOS.
    """
    inputs = _check(model, inputs, max_length)
    if not model.architecture.autoregressive:
        lengths = _tape_lengths(tape_lengths, inputs.shape[0], max_length)
        return _tape(model, _unwrap(params), inputs, max_length, lengths, rng)
    positions = _decode_positions(model, inputs, max_length, rng, random_positions)
    return _greedy(model, _unwrap(params), inputs, max_length, True, positions)[0]


# -- beam search ---------------------------------------------------------------


def length_penalty(length: Array, alpha: Array) -> Array:
    """GNMT length penalty `((5 + length) / 6) ** alpha` (Wu et al., 2016)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def gather_beams(x: Array, idx: Array) -> Array:
    """`x[b, idx[b, j]]` for `x` `[B, W', ...]`, `idx` int `[B, W]` -> `[B, W, ...]`."""
    return jax.vmap(lambda row, i: row[i])(x, idx)


def _is_cross(path) -> bool:
    """Whether a cache leaf belongs to a cross-attention layer."""
    return any(getattr(k, "key", None) == "cross_attention" for k in path)


def reorder_cache(cache: Any, origin: Array) -> Any:
    """Reorder every `[B*W, ...]` cache leaf by `origin` `[B, W]`.

    Scalars (the index) are kept, and so are the cross-attention keys/values:
    `origin` only picks beams of the same source row, which share them.
    """
    b, w = origin.shape

    def one(path, x):
        if x.ndim == 0 or _is_cross(path):
            return x
        y = x.reshape(b, w, *x.shape[1:])
        return gather_beams(y, origin).reshape(x.shape)

    return jax.tree_util.tree_map_with_path(one, cache)


@functools.partial(jax.jit, static_argnames=("model", "max_length", "beam_size", "cross_cache"))
def _beam_search(
    model,
    params,
    inputs,
    alpha,
    max_length: int,
    beam_size: int,
    cross_cache: bool = True,
    positions: tuple[Array, Array] | None = None,
):
    """Best sequences `[B, L]`, their scores `[B]` and the number of steps run.

    The cross-attention keys/values are projected once from the encoder
    output tiled over the beams (`[B*W, S, K, H]` a layer): W copies a row,
    which keeps every cache leaf's leading axis B*W and the decoder unaware
    of beams. `cross_cache=False` projects them at every step instead.
    `positions` (`decoding_positions`'s draw per source row, or None) are
    tiled over the beams like the encoder output.
    """
    b, w, big_l = inputs.shape[0], beam_size, max_length
    cache, inputs_w, step = _start(model, params, inputs, max_length, cross_cache, w, positions)
    max_penalty = length_penalty(big_l, alpha)

    def cond(state):
        i, _, live_logp, _, _, fin_scores, fin_flags, _ = state
        # A live beam's log-prob only falls, and the penalty grows with length
        # (alpha >= 0), so its best reachable score is logp / penalty(L).
        best_live = jnp.max(live_logp, axis=1) / max_penalty  # [B]
        worst_fin = jnp.where(jnp.all(fin_flags, axis=1), jnp.min(fin_scores, axis=1), NEG)
        return (i < big_l) & ~jnp.all(best_live < worst_fin)

    def body(state):
        i, live_seqs, live_logp, last, fin_seqs, fin_scores, fin_flags, cache = state
        logits, cache = decode_step(
            model, params, cache, inputs_w, last.reshape(b * w, 1), **step
        )  # [B*W, V]
        v = logits.shape[-1]
        logp = jax.nn.log_softmax(logits).reshape(b, w, v)  # [B, W, V]
        cand = (live_logp[:, :, None] + logp).reshape(b, w * v)  # [B, W*V]
        top_logp, top_idx = lax.top_k(cand, 2 * w)  # [B, 2W]
        top_beam, top_tok = top_idx // v, (top_idx % v).astype(jnp.int32)
        top_seqs = gather_beams(live_seqs, top_beam)  # [B, 2W, L]
        top_seqs = lax.dynamic_update_slice(top_seqs, top_tok[:, :, None], (0, 0, i))
        real = top_logp > NEG / 2  # not descended from an empty beam
        ended = (top_tok == EOS) & real  # [B, 2W]

        # Live: the best W continuations that did not end.
        live_logp, pos = lax.top_k(jnp.where(ended, NEG, top_logp), w)  # [B, W]
        live_seqs = gather_beams(top_seqs, pos)
        last = gather_beams(top_tok, pos)
        cache = reorder_cache(cache, gather_beams(top_beam, pos))

        # Finished: merge the new endings (length i+1 with EOS) into the best W.
        new_scores = jnp.where(ended, top_logp / length_penalty(i + 1, alpha), NEG)
        all_scores = jnp.concatenate([fin_scores, new_scores], axis=1)  # [B, 3W]
        fin_scores, pos = lax.top_k(all_scores, w)
        fin_seqs = gather_beams(jnp.concatenate([fin_seqs, top_seqs], axis=1), pos)
        fin_flags = gather_beams(jnp.concatenate([fin_flags, ended], axis=1), pos)
        return i + 1, live_seqs, live_logp, last, fin_seqs, fin_scores, fin_flags, cache

    live_logp = jnp.tile(jnp.array([0.0] + [NEG] * (w - 1), jnp.float32), (b, 1))  # [B, W]
    state = (
        jnp.zeros((), jnp.int32),
        jnp.zeros((b, w, big_l), jnp.int32),
        live_logp,
        jnp.zeros((b, w), jnp.int32),
        jnp.zeros((b, w, big_l), jnp.int32),
        jnp.full((b, w), NEG, jnp.float32),
        jnp.zeros((b, w), bool),
        cache,
    )
    steps, live_seqs, live_logp, _, fin_seqs, fin_scores, fin_flags, _ = lax.while_loop(
        cond, body, state
    )
    # A row with no finished sequence returns its best live one (no EOS).
    any_fin = jnp.any(fin_flags, axis=1)  # [B]
    seqs = jnp.where(any_fin[:, None], fin_seqs[:, 0], live_seqs[:, 0])
    scores = jnp.where(any_fin, fin_scores[:, 0], live_logp[:, 0] / max_penalty)
    return seqs, scores, steps


def beam_search(
    model: Transformer,
    params: Any,
    inputs: Array,
    *,
    max_length: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    rng: Array | None = None,
    random_positions: bool | None = None,
    tape_lengths: Array | None = None,
) -> Array:
    """Beam search with the KV cache and the GNMT length penalty.

    A hypothesis ending in EOS at length `n` (EOS counted) scores
    `log p / ((5 + n) / 6) ** alpha`. The search stops once no live beam can
    beat the worst of the `beam_size` finished hypotheses of any row.

    Args:
      model: a `jattn.models.Transformer`.
      params: its "params" collection (or `{"params": ...}`).
      inputs: int `[B, S]` source tokens, 0 = padding.
      max_length: most target tokens per hypothesis.
      beam_size: beams per row W.
      alpha: length-penalty exponent (>= 0; 0 = plain log-probability).
      rng, random_positions: the random positions, as for `greedy`; a row's
        draw is shared by its beams.
      tape_lengths: as for `greedy`: an encoder-only model's cells are
        predicted independently, so its beam search is `greedy`'s argmax.

    Returns:
      int32 `[B, max_length]`, the best finished hypothesis of each row (the
      best live one where none finished), 0 after EOS.

    The cross-attention keys/values are projected once, for the encoder
    output tiled over the beams (see the module docstring).
    """
    inputs = _check(model, inputs, max_length)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_search: beam_size must be a positive int, got {beam_size!r}")
    if not alpha >= 0:
        raise ValueError(f"beam_search: alpha must be >= 0, got {alpha!r}")
    if not model.architecture.autoregressive:
        lengths = _tape_lengths(tape_lengths, inputs.shape[0], max_length)
        return _tape(model, _unwrap(params), inputs, max_length, lengths, rng)
    positions = _decode_positions(model, inputs, max_length, rng, random_positions)
    seqs, _, _ = _beam_search(
        model, _unwrap(params), inputs, jnp.float32(alpha), max_length, beam_size, True, positions
    )
    return seqs


# The searches behind `greedy` and `beam_search`, for benchmarks and tests: they
# take unchecked, unboxed params and `max_length` (and `alpha`, `beam_size`)
# positionally, and `cross_cache` (False projects the cross-attention keys and
# values at every step, the path before the cache: same outputs) and `positions`
# (`decoding_positions`'s draw, or None: plain); they also return the number of
# steps run (and the beams' scores).
greedy_search = _greedy
beam_search_with_scores = _beam_search
