"""The encoder-only Transformer with an output tape (Delétang et al. 2023).

`TransformerConfig.architecture = "encoder_only"`: one bidirectional stack
reads the inputs followed by an *output tape*, one cell per target token,
and predicts every target token at once from its cell (no autoregression,
no shift right): the model of Delétang et al. 2023 ("Neural Networks and
the Chomsky Hierarchy") and Ruoss et al. 2023 (randomised positions). The
row the stack reads is

    stream = [inputs (S tokens) | tape (T cells)]                   # [B, S+T]

The tape's first cell of each example is the separator (the start symbol 0,
as a decoder-only model's), its other cells the learned blank vector
"encoder/tape_blank"; the logits returned are the T tape cells' `[B, T, V]`,
cell j predicting target j, so a tape has exactly `len(targets)` cells (a
padded target position is a padded cell: segment 0, seen by nothing). The
model is told the output length by the tape, as in Delétang et al.

Positions and packing are those of the decoder-only stream
(`jattn.models.decoder_only.stream_layout`): an example with n input tokens
has them at 0..n-1 and its tape cells at n..n+m-1; a packed example is one
segment of the stream; with `random_positions` its n + m positions are one
sorted random sample. Attention is bidirectional within an example: the
inputs see the tape and the tape sees the inputs.

Parameters: one token embedding (also the output projection when
`share_embeddings`) and the stack "encoder" of `num_layers` blocks (the
encoder–decoder's encoder; Delétang et al.'s has 5), plus
"encoder/tape_blank" `[D]`.

Decoding (`jattn.models.decoding.greedy`, `beam_search`) is one call: the
argmax of every cell of a tape of `max_length` cells (or of each row's own
length, `tape_lengths`), zeros after the first end-of-sequence token. The
cells are predicted independently, so a beam search has nothing to search.

Shapes: B batch, S input length, T target length (tape cells), D model
width, V vocabulary.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.architectures import register
from jattn.models.blocks import Encoder, vocab_logits
from jattn.models.decoder_only import stream_layout, stream_random_positions, stream_sides
from jattn.models.inputs import (
    check_tokens,
)
from jattn.models.layers import Embed
from jattn.models.transformer import Transformer

Array = jax.Array

__all__ = ["EncoderOnly", "tape_layout"]


def tape_layout(targets_segment_ids: Array) -> tuple[Array, Array]:
    """The tape's tokens and blank cells for targets' segment ids `[B, T]`.

    Returns:
      int32 tokens `[B, T]` (0 everywhere: the separator is the start symbol
      and a blank cell's token embedding is replaced), and bool `[B, T]`,
      True at a real cell that is not its example's first (the blanks).
    """
    seg = targets_segment_ids
    prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))  # [B, T], the segment to the left
    first = (seg > 0) & (seg != prev)  # [B, T], each example's first cell: the separator
    return jnp.zeros_like(seg, jnp.int32), (seg > 0) & ~first


@register("encoder_only")
class EncoderOnly(Transformer):
    """One bidirectional stack over `[inputs | output tape]`; logits of the tape.

    `Transformer(config)` with `architecture="encoder_only"` (see the module
    docstring). `targets` give the tape's length and segments only: their
    values never enter the model, so teacher forcing and decoding are the
    same computation.
    """

    @nn.compact
    def forward(self, inputs: Array, targets: Array, *, segment_ids, positions, train: bool):
        """Logits `[B, T, V]` (float32) of the T tape cells (`Transformer.__call__`).

        `targets` give the tape: a real (nonzero) token marks a cell, whose
        value is not read (decoding passes ones for a full tape). Tape
        positions are offset by one past the example's last input position.
        """
        self._check_config()
        cfg = self.config
        embed = Embed(cfg, name="embed")
        encoder = Encoder(cfg, embed=embed, name="encoder")  # num_layers blocks
        inputs, targets = check_tokens("inputs", inputs), check_tokens("targets", targets)
        s = inputs.shape[1]
        (in_seg, tg_seg), (in_pos, tg_pos) = stream_sides(
            cfg, inputs, targets, segment_ids, positions
        )
        tape_tokens, blank = tape_layout(tg_seg)  # [B, T]
        # The decoder-only stream's layout, on the tape instead of the shifted targets.
        _, seg, pos = stream_layout(inputs, targets, in_seg, tg_seg, in_pos, tg_pos)
        tokens = jnp.concatenate([inputs.astype(jnp.int32), tape_tokens], axis=1)  # [B, S+T]
        tape = jnp.concatenate([jnp.zeros_like(inputs, bool), blank], axis=1)  # [B, S+T]
        if cfg.random_positions and (train or cfg.random_positions_eval):
            rng = self.make_rng("dropout") if self.has_rng("dropout") else jax.random.key(0)
            pos = stream_random_positions(rng, seg, cfg.random_positions)
        x = encoder(tokens, segment_ids=seg, positions=pos, train=train, tape=tape)  # [B, S+T, D]
        return vocab_logits(cfg, embed, x[:, s:])  # [B, T, V]
