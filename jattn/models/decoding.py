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

The cache's building blocks are in
`jattn.models.decoding_cache`, the loops in `jattn.models.decoding_search`;
this module holds the checked entry points and re-exports the public names
of both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jattn.models.decoding_cache import (
    decode_step,
    init_cache,
    prefill,
    prefill_prompt,
    unbox_params,
)
from jattn.models.decoding_search import (
    EOS,
    NEG,
    beam_search_with_scores,
    gather_beams,
    greedy_search,
    reorder_cache,
    tape,
)
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
        return tape(model, unbox_params(params), inputs, max_length, lengths, rng)
    positions = _decode_positions(model, inputs, max_length, rng, random_positions)
    return greedy_search(model, unbox_params(params), inputs, max_length, True, positions)[0]


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
        return tape(model, unbox_params(params), inputs, max_length, lengths, rng)
    positions = _decode_positions(model, inputs, max_length, rng, random_positions)
    seqs, _, _ = beam_search_with_scores(
        model,
        unbox_params(params),
        inputs,
        jnp.float32(alpha),
        max_length,
        beam_size,
        True,
        positions,
    )
    return seqs
