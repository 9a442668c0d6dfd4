"""The Transformer's layers and stacks: one residual `Block` for every layer
(self-attention, cross-attention when `cross`, MLP), the `Encoder` and
`Decoder` stacks of the encoder–decoder (the encoder is also the
encoder-only model's stack), and `shared_layers`.

A block's call names its mode (`DECODER_MODES`): teacher forcing over a
whole sequence, one cached step, a step recomputing cross-attention, or the
prefill of the cross-attention cache. The stack hands every block one
`LayerCall` (mode, training, the positional scheme's per-stack parameters
`Scheme.stack_state`, cache index and slot), which goes on whole to the
self-attention layer.

With `TransformerConfig.shared_layers` a stack has one block, "shared_layer",
called at every depth (Dehghani et al.'s Universal Transformer): one set of
parameters, each call its own dropout draws and, when decoding, its own KV
cache (`cache_slot`).

Shapes: B batch, S input length, T target length, D model width.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.axes import constrain, param
from jattn.models.config import TransformerConfig
from jattn.models.layer_call import LayerCall
from jattn.models.layers import MLP, AbsolutePositions, Attention, layer_norm
from jattn.visibility import Visibility

Array = jax.Array

__all__ = [
    "DECODER_MODES",
    "Block",
    "Encoder",
    "stack_blocks",
    "stack_inputs",
    "sublayer",
    "vocab_logits",
]


def vocab_logits(cfg: TransformerConfig, embed: nn.Module, x: Array) -> Array:
    """`[B, T, D]` -> float32 logits `[B, T, V]`: the shared embedding's `attend`, or
    the output projection "logits" of the calling module (call it from a
    compact method, so both architectures keep one parameter layout)."""
    if cfg.share_embeddings:
        logits = embed.attend(x)
    else:
        logits = nn.Dense(
            cfg.vocab_size,
            use_bias=False,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.params_dtype,
            kernel_init=nn.with_logical_partitioning(
                jax.nn.initializers.xavier_uniform(), ("embed", "vocab")
            ),
            name="logits",
        )(x)
    logits = logits.astype(jnp.float32)  # [B, T, V]
    return constrain(logits, ("batch", "length", "vocab"))


def sublayer(cfg: TransformerConfig, x: Array, f, norm: nn.Module, train: bool) -> Array:
    """`x + dropout(f(norm(x)))` (pre-norm) or `norm(x + dropout(f(x)))` (post-norm)."""
    h = f(norm(x) if cfg.pre_norm else x)
    h = nn.Dropout(cfg.dropout_rate)(h, deterministic=not train)
    y = x + h
    return y if cfg.pre_norm else norm(y)


# Block mode -> (self-attention mode, cross-attention mode) in every layer
# (`Attention` has the modes "full", "step" and "prefill"). A block without
# cross-attention has "full" and "step" only.
DECODER_MODES: dict[str, tuple[str | None, str]] = {
    "full": ("full", "full"),  # teacher forcing over targets [B, T]
    "step": ("step", "step"),  # one token; cross-attention reads the prefilled cache
    "recompute": ("step", "full"),  # one token; cross-attention projects `encoded` again
    "prefill": (None, "prefill"),  # cross-attention caches `encoded`; nothing else runs
}


class Block(nn.Module):
    """Self-attention, cross-attention (when `cross`), MLP, each in a residual block.

    Every layer of every architecture is one: an encoder layer (bidirectional,
    no cross), a decoder layer (`causal`, `cross`), a decoder-only layer
    (`causal`) and an encoder-only layer (as the encoder's).

    Attributes:
      config: the model config.
      cross: a cross-attention sub-layer over `encoded` after self-attention.
      causal: causal self-attention (a caller's `visible` replaces the rule).
      decode: the attentions keep a "cache" (see `Attention`), for the modes
        "step", "recompute" and "prefill" of `DECODER_MODES`.
    """

    config: TransformerConfig
    cross: bool = False
    causal: bool = False
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        x: Array | None,
        encoded: Array | None = None,
        *,
        call: LayerCall | None = None,
        visibility: Visibility | None = None,
        cross_visibility: Visibility | None = None,
    ) -> Array | None:
        """One layer in one of `DECODER_MODES`.

        Args:
          x: `[B, T, D]` (T = 1 in a decoder's "step"); None for "prefill",
            where the encoder output enters only through cross-attention's
            keys/values.
          encoded: the encoder output `[B, S, D]` (cross only); None for "step".
          call: how the layer runs (`jattn.models.layer_call.LayerCall`): its
            mode ("full", "step", "recompute" or "prefill"), dropout when
            `train`, and what the attentions read (the scheme's stack state,
            the cache index, a caller's `visible` rule replacing the causal
            one, the cache slot). None: a "full" call, no dropout.
          visibility: self-attention's segment ids and positions
            (`jattn.visibility.Visibility`, see `Attention`): `x`'s on both sides
            (`Visibility.of_sequence`), or in a step the query's and the
            cache slots' (none: slots at `arange(L)`, no segments).
          cross_visibility: cross-attention's: the targets' (query side) and
            the encoder's `[B, S]` (0 = padding; key side). Cross only.

        Returns:
          `[B, T, D]`; None for "prefill".
        """
        cfg = self.config
        call = LayerCall() if call is None else call
        mode = call.mode
        if mode not in DECODER_MODES or (not self.cross and mode in ("recompute", "prefill")):
            modes = sorted(DECODER_MODES) if self.cross else ["full", "step"]
            raise ValueError(
                f"Block(cross={self.cross}): mode must be one of {modes}, got {mode!r}"
            )
        self_mode, cross_mode = DECODER_MODES[mode]
        self_attn = Attention(cfg, causal=self.causal, decode=self.decode, name="self_attention")
        cross_attn = None
        if self.cross:
            cross_attn = Attention(cfg, cross=True, decode=self.decode, name="cross_attention")
        if mode == "prefill":
            return cross_attn(None, encoded, call=call.for_cross("prefill"))
        self_call = call.replace(mode=self_mode)
        x = sublayer(
            cfg,
            x,
            lambda h: self_attn(h, h, call=self_call, visibility=visibility),
            layer_norm(cfg, "self_attention_norm"),
            call.train,
        )
        if self.cross:
            cross_call = call.for_cross(cross_mode)
            x = sublayer(
                cfg,
                x,
                lambda h: cross_attn(h, encoded, call=cross_call, visibility=cross_visibility),
                layer_norm(cfg, "cross_attention_norm"),
                call.train,
            )
        return sublayer(cfg, x, MLP(cfg, name="mlp"), layer_norm(cfg, "mlp_norm"), call.train)


def stack_blocks(config: TransformerConfig, depth: int, **kinds) -> list[tuple[Block, str]]:
    """The `depth` blocks of a stack, each with its cache slot suffix: blocks
    "layer_0".."layer_{depth-1}", or one block "shared_layer" at every depth
    (`shared_layers`, each depth its own cache slot "_i"). Call from a compact
    method: the blocks belong to the calling stack. `kinds`: `Block`'s
    `cross`, `causal`, `decode`."""
    if config.shared_layers:
        shared = Block(config, name="shared_layer", **kinds)
        return [(shared, f"_{i}") for i in range(depth)]
    return [(Block(config, name=f"layer_{i}", **kinds), "") for i in range(depth)]


def stack_inputs(
    module: nn.Module, embed: nn.Module, tokens: Array, positions: Array, *, train: bool,
    causal: bool, tape: Array | None = None,
) -> tuple[Array, Any]:  # fmt: skip
    """What every stack starts from: embeddings `[B, L, D]` plus the scheme's
    absolute vectors (if any), with dropout, and the scheme's parameters
    shared by the stack's layers (`Scheme.stack_state`, declared on `module`).

    `tape`: bool `[B, L]`, the blank cells of an output tape (encoder-only),
    whose embedding is the learned vector "tape_blank" `[D]` of `module`
    instead of their token's.
    """
    cfg = module.config
    x = embed(tokens)  # [B, L, D]
    if tape is not None:
        init = nn.initializers.normal(stddev=cfg.d_model**-0.5)  # as a token's embedding
        blank = param(module, "tape_blank", init, (cfg.d_model,), ("embed",), cfg.params_dtype)
        x = jnp.where(tape[..., None], blank.astype(x.dtype)[None, None], x)  # [B, L, D]
    if cfg.scheme.absolute:
        x = AbsolutePositions(cfg, name="positions")(x, positions)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)
    state = cfg.scheme.stack_state(module, cfg, causal=causal)
    return constrain(x, ("batch", "length", "embed")), state


class Encoder(nn.Module):
    """Embeddings + positions, `depth` bidirectional blocks (+ final norm if pre-norm).

    The encoder–decoder's encoder (`depth` None: `num_layers`) and the
    encoder-only model's stack (with an output tape); `depth` None: `num_layers`.
    """

    config: TransformerConfig
    embed: nn.Module
    depth: int | None = None

    @nn.compact
    def __call__(
        self,
        inputs: Array,
        *,
        segment_ids: Array,
        positions: Array,
        train: bool = False,
        tape: Array | None = None,
    ) -> Array:
        """Encode tokens.

        Args:
          inputs: int `[B, S]`.
          segment_ids: int `[B, S]` (0 = padding).
          positions: int `[B, S]`.
          train: dropout (needs a "dropout" rng).
          tape: bool `[B, S]`: output tape cells (see `stack_inputs`), or None.

        Returns:
          `[B, S, D]`.
        """
        cfg = self.config
        x, state = stack_inputs(
            self, self.embed, inputs, positions, train=train, causal=False, tape=tape
        )
        vis = Visibility.of_sequence(segment_ids, positions)
        call = LayerCall(train=train, scheme_state=state)
        for block, slot in stack_blocks(cfg, self.depth or cfg.num_layers):
            x = block(x, call=call.replace(cache_slot=slot), visibility=vis)
        if cfg.pre_norm:
            x = layer_norm(cfg, "final_norm")(x)
        return constrain(x, ("batch", "length", "embed"))
