"""The value a stack hands each layer it calls: the mode, training, stack state, cache slot.

A stack (`Encoder`, `Decoder`, `DecoderOnlyStack`) runs every layer of one
call the same way: in one mode, with or without dropout, at one cache index,
with the positional scheme's per-stack parameters and, in a prefix LM, the
caller's visibility rule; only the cache slot changes with the depth (a
shared block keeps one cache per depth). `LayerCall` carries these as one
frozen value from the stack through `Block` to each `Attention`, as
`jattn.visibility.Visibility` carries the attention's rules beside it: one
value passed whole, not six keywords re-declared and re-forwarded at every
level (issue 51).

Shapes: B batch, T queries, S keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

Array = jax.Array

__all__ = ["LayerCall"]


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """How a layer runs in this call.

    Attributes:
      mode: the layer's mode: a `Block`'s, one of `blocks.DECODER_MODES`
        ("full", "step", "recompute", "prefill"), which the block turns into
        each attention's, one of `attention_layer.MODES` ("full", "step",
        "prefill").
      train: dropout, attention dropout included (needs a "dropout" rng).
      scheme_state: the positional scheme's parameters shared by the stack
        (`Scheme.stack_state`), or None; self-attention's.
      cache_index: int scalar, the slot a causal "step" writes.
      visible: bool broadcastable to `[B, 1, T, S]`, replacing a causal
        layer's causal rule (a prefix LM's, `jattn.models.decoder_only`), or
        None; self-attention's.
      cache_slot: suffix of this call's cache entries ("cached_key" + suffix):
        a block shared by every depth (`shared_layers`) keeps one cache per
        depth.
    """

    mode: str = "full"
    train: bool = False
    scheme_state: Any = None
    cache_index: Array | None = None
    visible: Array | None = None
    cache_slot: str = ""

    def replace(self, **changes: Any) -> LayerCall:
        """A copy with `changes` (field name -> value)."""
        return dataclasses.replace(self, **changes)

    def for_cross(self, mode: str) -> LayerCall:
        """A cross-attention layer's call in `mode`: the same training and
        cache slot, and nothing of what self-attention alone reads (the
        scheme's stack state, the cache index, the caller's rule)."""
        return LayerCall(mode=mode, train=self.train, cache_slot=self.cache_slot)
