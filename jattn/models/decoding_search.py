"""The decoding searches: greedy and beam search as one jitted `lax.while_loop` each, and the tape.

`greedy_search` and `beam_search_with_scores` are the loops behind
`jattn.models.decoding.greedy` and `beam_search`, for benchmarks and tests:
they take unchecked, unboxed params and `max_length` (and `alpha`,
`beam_size`) positionally, and `cross_cache` (False projects the
cross-attention keys and values at every step, the path before the cache:
same outputs) and `positions` (`decoding_positions`'s draw, or None: plain);
they also return the number of steps run (and the beams' scores). `tape` is
an encoder-only model's one call. How the cache is laid out and tiled over
beams: `jattn.models.decoding`'s docstring.

Token 0 is padding and the start symbol; token 1 (`EOS`) ends a sequence.

Shapes: the letters of `jattn.attention.legend` (W beams, L = max_length,
S source length, V vocabulary).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jattn.models.decoding_cache import decode_step, prepare_decoding
from jattn.models.transformer import Transformer

Array = jax.Array

__all__ = [
    "EOS",
    "NEG",
    "beam_search_with_scores",
    "gather_beams",
    "greedy_search",
    "length_penalty",
    "reorder_cache",
    "tape",
]

EOS = 1
# The log-probability of an empty beam and of no finished hypothesis yet: a
# "minus infinity" that stays finite through sums and divisions.
NEG = -1.0e9


# -- an output tape (not autoregressive) ------------------------------------------


@functools.partial(jax.jit, static_argnames=("model", "max_length"))
def tape(model, params, inputs: Array, max_length: int, lengths, rng) -> Array:
    """An encoder-only model's outputs (no loop): one call over a tape of `lengths`
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
def greedy_search(
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
    cache, inputs, step = prepare_decoding(
        model, params, inputs, max_length, cross_cache, 1, positions
    )

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
def beam_search_with_scores(
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
    cache, inputs_w, step = prepare_decoding(
        model, params, inputs, max_length, cross_cache, w, positions
    )
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
