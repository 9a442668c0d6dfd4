"""The decoder-only Transformer: one causal stack over inputs, a separator, then targets.

`TransformerConfig.architecture = "decoder_only"` keeps every signature of
the encoder–decoder (`Transformer.__call__(inputs, targets, ...)`,
`jattn.decoding.greedy` and `beam_search`), so training, evaluation,
decoding and probes serve both. The row the stack reads is the
concatenation

    stream = [inputs (S tokens) | shift_right(targets) (T tokens)]   # [B, S+T]

where the first token of each example's shifted targets is the start symbol
0: that token is the separator. Its output predicts the first target token,
and the logits returned are those of the T target-side positions `[B, T, V]`,
exactly the positions the encoder–decoder's decoder predicts from.

Positions run on across the separator, per example: an example with n input
tokens has them at 0..n-1, the separator at n and its j-th target token (the
one the output at position n+j predicts is target j) at n+j. In packed rows
the inputs keep their positions (restarting per segment) and a segment's
target-side positions are offset by one past its last input position; a
packed example is one segment of the stream (its inputs and targets share
the segment id), so the shift right and the positions restart per example
and no example sees another. With `random_positions` each example's n + m
positions are one sorted random sample, as Ruoss et al. draw them per sequence.

Attention is causal in these positions: a token sees the tokens of its
example at positions up to its own. With `prefix_lm` an input token also
sees the later input tokens of its example (never the separator or a target
token), the positional terms take their bidirectional form (T5's
bidirectional buckets, ALiBi's `position_options.alibi.mode`), and the separator and targets
stay causal.

Parameters: one token embedding (also the output projection when
`share_embeddings`, else a separate output layer "decoder/logits") and
`2 * num_layers` layers of self-attention and MLP, as many as encoder plus
decoder; the encoder–decoder's extra parameters are the cross-attention
projections (`jattn.models.summary.architecture_counts` counts both).

KV cache (`DecoderOnly` with `decode=True`), under "decoder": `index`,
`slot_positions` and `slot_segments` int `[B, L]` (L = S + max_length), and
per layer `layer_i/self_attention/cached_{key,value}` `[B, L, K, H]`.
"prefill" runs the stack once over the prompt (the inputs) and writes slots
0..S-1 (padding slots carry segment 0, so nothing attends to them); each
"step" then feeds one token (the separator first, as the encoder–decoder's
first step feeds the start symbol) at slot S + k and position n + k. With
randomised positions at decoding (`jattn.models.decoding.decoding_positions`)
the prefill is given every slot's position up front instead: one sorted
sample per example for its n prompt tokens, the separator and the decoded
tokens, so each step's position is known before its token is decoded.

Shapes: B batch, S input length, T target length, L stream / cache length,
D model width, V vocabulary.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.architectures import register
from jattn.models.axes import constrain
from jattn.models.blocks import stack_blocks, stack_inputs, vocab_logits
from jattn.models.config import TransformerConfig
from jattn.models.inputs import (
    check_ids,
    check_position_length,
    check_tokens,
    random_positions,
    segments_and_positions,
    shift_right,
)
from jattn.models.layer_call import LayerCall
from jattn.models.layers import Embed, layer_norm
from jattn.models.transformer import Transformer
from jattn.visibility import Visibility

Array = jax.Array

__all__ = [
    "DECODER_ONLY_MODES",
    "DecoderOnly",
    "DecoderOnlyStack",
    "prefix_visibility",
    "prompt_offsets",
    "stream_layout",
    "stream_random_positions",
    "stream_sides",
    "target_offsets",
]

# "full": teacher forcing over inputs and targets; "prefill": write the prompt
# into the cache; "step": one token over the cache.
DECODER_ONLY_MODES = ("full", "prefill", "step")


# -- the stream (pure) ----------------------------------------------------------------


def target_offsets(
    inputs_segment_ids: Array, inputs_positions: Array, targets_segment_ids: Array
) -> Array:
    """Where each target-side token's positions start: one past the last input
    position of its segment (0 for a segment without inputs).

    Args:
      inputs_segment_ids, inputs_positions: int `[B, S]`.
      targets_segment_ids: int `[B, T]`.

    Returns:
      int32 `[B, T]`.
    """
    same = (targets_segment_ids[:, :, None] == inputs_segment_ids[:, None, :]) & (
        inputs_segment_ids[:, None, :] > 0
    )  # [B, T, S]
    ends = jnp.where(same, inputs_positions[:, None, :] + 1, 0)  # [B, T, S]
    return jnp.max(ends, axis=-1).astype(jnp.int32)  # [B, T]


def prompt_offsets(inputs: Array) -> Array:
    """`target_offsets` of unpacked rows (`inputs != 0`, positions `arange(S)`):
    the separator's position, int32 `[B]`."""
    s = inputs.shape[1]
    return jnp.max(jnp.where(inputs != 0, jnp.arange(1, s + 1), 0), axis=1).astype(jnp.int32)


def stream_sides(cfg: TransformerConfig, inputs, targets, segment_ids, positions):
    """Each side's segment ids and positions of a joined stream `[inputs |
    target side]` (`segments_and_positions`: defaults from the tokens), once
    the batch sizes agree and the config's positions cover `S + T`.

    Args:
      cfg: the model config.
      inputs, targets: int `[B, S]`, `[B, T]`.
      segment_ids, positions: `(inputs', targets')` pairs, each None or int.

    Returns:
      `((in_seg, tg_seg), (in_pos, tg_pos))`, int `[B, S]` and `[B, T]`.
    """
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"Transformer: batch mismatch: inputs {list(inputs.shape)}, targets "
            f"{list(targets.shape)}"
        )
    check_position_length(cfg, inputs.shape[1] + targets.shape[1], "inputs + targets")
    in_seg, in_pos = segments_and_positions(inputs, segment_ids[0], positions[0], "inputs")
    tg_seg, tg_pos = segments_and_positions(targets, segment_ids[1], positions[1], "targets")
    return (in_seg, tg_seg), (in_pos, tg_pos)


def stream_layout(
    inputs: Array,
    targets: Array,
    inputs_segment_ids: Array,
    targets_segment_ids: Array,
    inputs_positions: Array,
    targets_positions: Array,
) -> tuple[Array, Array, Array]:
    """The stack's row: tokens, segment ids and positions, each int `[B, S+T]`.

    Tokens are the inputs then the targets shifted right per segment (the
    start symbol 0 at each example's first target-side slot is the
    separator); target-side positions are offset per segment by
    `target_offsets`.
    """
    shifted = shift_right(targets, targets_segment_ids)  # [B, T]
    offsets = target_offsets(inputs_segment_ids, inputs_positions, targets_segment_ids)
    tokens = jnp.concatenate([inputs, shifted], axis=1).astype(jnp.int32)  # [B, S+T]
    segments = jnp.concatenate([inputs_segment_ids, targets_segment_ids], axis=1)
    positions = jnp.concatenate([inputs_positions, targets_positions + offsets], axis=1)
    return tokens, segments.astype(jnp.int32), positions.astype(jnp.int32)


def stream_random_positions(rng: Array, segment_ids: Array, max_position: int) -> Array:
    """Ruoss et al.'s randomised positions for the stream's examples, each of
    which is two runs of one segment id (its inputs, its targets): a stable
    sort by segment id makes each example one run for
    `jattn.models.inputs.random_positions`, whose positions are put back in
    stream order. Int32 `[B, L]`; padding gets 0."""
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(segment_ids > 0, segment_ids, big), axis=1, stable=True)
    grouped = jnp.take_along_axis(segment_ids, order, axis=1)  # [B, L], one run an example
    drawn = random_positions(rng, grouped, max_position)  # [B, L] in grouped order
    return jnp.take_along_axis(drawn, jnp.argsort(order, axis=1), axis=1)


def prefix_visibility(positions: Array, is_input: Array) -> Array:
    """A prefix LM's rule: key s visible to query t iff `pos[s] <= pos[t]` or s
    is an input token (segment ids then keep examples apart).

    Args:
      positions: int `[B, L]`.
      is_input: bool `[B, L]`.

    Returns:
      bool `[B, 1, L, L]`.
    """
    causal = positions[:, None, None, :] <= positions[:, None, :, None]  # [B, 1, L, L]
    return causal | is_input[:, None, None, :]


# -- modules --------------------------------------------------------------------------


class DecoderOnlyStack(nn.Module):
    """Embeddings + positions, `2 * num_layers` causal blocks, logits of the target side.

    Attributes:
      config: the model config (`architecture="decoder_only"`).
      embed: the token embedding (also the output projection when shared).
      decode: keep the KV cache (see the module docstring); the "full" call
        at `init` creates it, sized by its inputs and targets.

    Modes (`DECODER_ONLY_MODES`): "full" (teacher forcing: logits `[B, T, V]`),
    "prefill" (`inputs` into the cache; returns None) and "step" (`targets` is
    the previous token `[B, 1]`, not shifted; logits `[B, 1, V]`).
    """

    config: TransformerConfig
    embed: nn.Module
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        inputs: Array,
        targets: Array | None,
        *,
        mode: str = "full",
        segment_ids: tuple[Array | None, Array | None] = (None, None),
        positions: tuple[Array | None, Array | None] = (None, None),
        train: bool = False,
    ) -> Array | None:
        """Run the stack in one of `DECODER_ONLY_MODES`.

        Args:
          inputs: int `[B, S]` (unpacked for "prefill" and "step").
          targets: int `[B, T]` ("full"), the previous token `[B, 1]`
            ("step"), None ("prefill").
          mode: "full", "prefill" or "step".
          segment_ids, positions: `(inputs', targets')`, as
            `Transformer.__call__` ("full"); for "prefill" the positions
            only, both or neither: the prompt's `[B, S]` and those of the
            slots after it `[B, L - S]` (drawn before decoding: randomised
            positions).
          train: dropout (needs a "dropout" rng).

        Returns:
          float32 logits `[B, T, V]` (`[B, 1, V]` for a step); None for "prefill".
        """
        if mode not in DECODER_ONLY_MODES:
            raise ValueError(f"DecoderOnly: mode must be one of {DECODER_ONLY_MODES}, got {mode!r}")
        if mode != "full" and not self.decode:
            raise ValueError(f"DecoderOnly: mode={mode!r} needs decode=True and a cache")
        inputs = check_tokens("inputs", inputs)
        if mode == "full":
            return self._full(
                inputs, check_tokens("targets", targets), segment_ids, positions, train
            )
        if not self.has_variable("cache", "index"):
            raise ValueError(
                f"DecoderOnly: mode={mode!r} needs an initialised cache "
                "(jattn.models.decoding.init_cache)"
            )
        if mode == "prefill":
            return self._prefill(inputs, *positions)
        return self._step(check_tokens("tokens", targets))

    # -- modes ---------------------------------------------------------------

    def _full(self, inputs, targets, segment_ids, positions, train: bool) -> Array:
        """Teacher forcing: logits `[B, T, V]` of the target side of the stream."""
        cfg = self.config
        s, t = inputs.shape[1], targets.shape[1]
        (in_seg, tg_seg), (in_pos, tg_pos) = stream_sides(
            cfg, inputs, targets, segment_ids, positions
        )
        tokens, seg, pos = stream_layout(inputs, targets, in_seg, tg_seg, in_pos, tg_pos)
        if cfg.random_positions and (train or cfg.random_positions_eval):
            rng = self.make_rng("dropout") if self.has_rng("dropout") else jax.random.key(0)
            pos = stream_random_positions(rng, seg, cfg.random_positions)
        if self.decode and self.is_initializing():
            b, length = tokens.shape
            self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            self.variable("cache", "slot_positions", jnp.zeros, (b, length), jnp.int32)
            self.variable("cache", "slot_segments", jnp.zeros, (b, length), jnp.int32)
        visible = None
        if cfg.prefix_lm:
            is_input = jnp.broadcast_to(jnp.arange(s + t) < s, tokens.shape)  # [B, L]
            visible = prefix_visibility(pos, is_input)
        x = self._layers(tokens, seg, pos, LayerCall(train=train, visible=visible))  # [B, L, D]
        return self._logits(x[:, s:])

    def _prefill(self, inputs: Array, prompt_pos=None, after_pos=None) -> None:
        """The prompt's keys/values into slots 0..S-1; the slots' positions and
        segments for every later step; index S.

        The slots' positions are `prompt_pos` `[B, S]` then `after_pos`
        `[B, L - S]` where given, else the prompt's `arange(S)` and, after
        it, one a slot from one past the last real prompt token."""
        slot_pos = self.variable("cache", "slot_positions")
        slot_seg = self.variable("cache", "slot_segments")
        b, s = inputs.shape
        length = slot_pos.value.shape[1]
        if slot_pos.value.shape[0] != b or length < s:
            raise ValueError(
                f"DecoderOnly: prompt {list(inputs.shape)} does not fit the cache "
                f"{list(slot_pos.value.shape)}: init_cache for the inputs' batch and length"
            )
        slots = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, L]
        offsets = prompt_offsets(inputs)[:, None]  # [B, 1]
        real = jnp.pad((inputs != 0).astype(jnp.int32), ((0, 0), (0, length - s)))
        slot_seg.value = jnp.where(slots < s, real, 1).astype(jnp.int32)  # [B, L]
        seg = (inputs != 0).astype(jnp.int32)  # [B, S]
        if (prompt_pos is None) != (after_pos is None):
            raise ValueError(
                "DecoderOnly: prefill takes both positions (the prompt's, after it) or neither"
            )
        if prompt_pos is None:
            slot_pos.value = jnp.where(slots < s, slots, offsets + slots - s).astype(jnp.int32)
            pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        else:
            pos = check_ids("inputs_positions", prompt_pos, (b, s))  # [B, S]
            after = check_ids("targets_positions", after_pos, (b, length - s))  # [B, L - S]
            slot_pos.value = jnp.concatenate([pos, after], axis=1)  # [B, L]
        visible = (slots < s)[:, None, None, :] if self.config.prefix_lm else None
        self._layers(inputs, seg, pos, LayerCall(mode="step", cache_index=0, visible=visible))
        self.variable("cache", "index").value = jnp.asarray(s, jnp.int32)
        return None

    def _step(self, tokens: Array) -> Array:
        """One token `[B, 1]` at the cache index: logits `[B, 1, V]`; advances it."""
        index = self.variable("cache", "index")
        current = index.value
        index.value = current + 1
        slot_pos = self.get_variable("cache", "slot_positions")  # [B, L]
        pos = jax.lax.dynamic_slice_in_dim(slot_pos, current, 1, axis=1)  # [B, 1]
        seg = jnp.ones_like(tokens, jnp.int32)
        x = self._layers(tokens, seg, pos, LayerCall(mode="step", cache_index=current))
        return self._logits(x)

    # -- pieces --------------------------------------------------------------

    def _layers(self, tokens, seg, pos, call: LayerCall) -> Array:
        """Embeddings (+ the scheme's absolute vectors) through every layer in
        `call` (its mode "full" or "step"), `[B, L, D]`."""
        cfg = self.config
        x, state = stack_inputs(
            self, self.embed, tokens, pos, train=call.train, causal=not cfg.prefix_lm
        )
        vis = Visibility.of_sequence(seg, pos)
        if call.mode == "step":  # the keys are the cache's slots
            vis = vis.replace(
                kv_positions=self.get_variable("cache", "slot_positions"),
                kv_segment_ids=self.get_variable("cache", "slot_segments"),
            )
        call = call.replace(scheme_state=state)
        for block, slot in stack_blocks(cfg, cfg.stack_layers, causal=True, decode=self.decode):
            x = block(x, call=call.replace(cache_slot=slot), visibility=vis)
        if cfg.pre_norm:
            x = layer_norm(cfg, "final_norm")(x)
        return constrain(x, ("batch", "length", "embed"))

    def _logits(self, x: Array) -> Array:
        """`[B, T, D]` -> float32 logits `[B, T, V]`."""
        return vocab_logits(self.config, self.embed, x)


@register("decoder_only")
class DecoderOnly(Transformer):
    """One causal stack over `[inputs | shift_right(targets)]`: `Transformer(config)`
    with `architecture="decoder_only"` (see the module docstring).

    Parameters: "embed" (the token embedding, also the output projection when
    `share_embeddings`) and the stack "decoder" (`DecoderOnlyStack`).
    Decoding: `prefill_prompt` writes the prompt into the cache, then
    `step` feeds one token at a time (the separator first).
    """

    def setup(self):
        self._check_config()
        self.embed = Embed(self.config)
        self.decoder = DecoderOnlyStack(self.config, embed=self.embed, decode=self.use_cache)

    def forward(self, inputs: Array, targets: Array, *, segment_ids, positions, train: bool):
        """Next-token logits `[B, T, V]` (float32) of the target side of the
        stream (`Transformer.__call__`)."""
        return self.decoder(
            inputs, targets, mode="full", segment_ids=segment_ids, positions=positions, train=train
        )

    def step(
        self,
        inputs: Array,
        tokens: Array,
        *,
        encoded: Array | None = None,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
    ) -> Array:
        """One cached step: logits `[B, 1, V]` for the token after `tokens` `[B, 1]`.

        The prompt and every slot's position are in the cache
        (`prefill_prompt`); `encoded` and the positions must be None.
        """
        if not self.use_cache:
            raise ValueError("Transformer.step needs use_cache=True")
        if encoded is not None or inputs_positions is not None or targets_positions is not None:
            raise ValueError(
                "Transformer.step: a decoder_only model has no encoder and keeps its positions "
                "in its cache; give them to prefill_prompt"
            )
        return self.decoder(inputs, tokens, mode="step")

    def prefill_prompt(
        self,
        inputs: Array,
        *,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
    ) -> None:
        """Run the stack over the prompt `inputs` `[B, S]` (unpacked, 0 = padding)
        once and write its keys/values into cache slots 0..S-1; the steps that
        follow start with the separator (token 0). Needs `use_cache=True`, a
        cache from `jattn.models.decoding.init_cache` and `mutable=["cache"]`.

        `inputs_positions` `[B, S]` and `targets_positions` `[B, L]` (both or
        neither) are the positions of the prompt's slots and of the L slots
        after it (the separator, then each decoded token), drawn before
        decoding (randomised positions); by default the prompt is at
        `arange(S)` and the separator at one past its last real token."""
        if not self.use_cache:
            raise ValueError("Transformer.prefill_prompt needs use_cache=True")
        self.decoder(inputs, None, mode="prefill", positions=(inputs_positions, targets_positions))
