"""The Transformer's layers: an encoder layer and a decoder layer, each a
stack of residual blocks around `jattn.models.layers`' attention and MLP.

A decoder layer names its mode (`DECODER_MODES`): teacher forcing over a
whole target, one cached step, a step recomputing cross-attention, or the
prefill of the cross-attention cache. The positional scheme's per-stack
parameters (`Scheme.stack_state`) arrive as `scheme_state` and go to every
attention layer unchanged.

Shapes: B batch, S input length, T target length, D model width.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.axes import constrain
from jattn.models.config import TransformerConfig
from jattn.models.layers import MLP, Attention, layer_norm

Array = jax.Array

__all__ = ["DECODER_MODES", "DecoderLayer", "EncoderLayer", "sublayer", "vocab_logits"]


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


class EncoderLayer(nn.Module):
    """Self-attention then MLP, each in a residual block."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        x: Array,
        *,
        segment_ids: Array,
        positions: Array,
        scheme_state: Any,
        train: bool,
    ) -> Array:
        """One encoder layer.

        Args:
          x: `[B, S, D]`.
          segment_ids: int `[B, S]` (0 = padding).
          positions: int `[B, S]`.
          scheme_state: the scheme's parameters shared by the stack, or None.
          train: dropout, attention dropout included (needs a "dropout" rng).

        Returns:
          `[B, S, D]`.
        """
        cfg = self.config
        attn = Attention(cfg, name="self_attention")
        x = sublayer(
            cfg,
            x,
            lambda h: attn(
                h,
                h,
                q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids,
                q_positions=positions,
                kv_positions=positions,
                scheme_state=scheme_state,
                train=train,
            ),
            layer_norm(cfg, "self_attention_norm"),
            train,
        )
        return sublayer(cfg, x, MLP(cfg, name="mlp"), layer_norm(cfg, "mlp_norm"), train)


# Decoder mode -> (self-attention mode, cross-attention mode) in every layer
# (`Attention` has the modes "full", "step" and "prefill").
DECODER_MODES: dict[str, tuple[str | None, str]] = {
    "full": ("full", "full"),  # teacher forcing over targets [B, T]
    "step": ("step", "step"),  # one token; cross-attention reads the prefilled cache
    "recompute": ("step", "full"),  # one token; cross-attention projects `encoded` again
    "prefill": (None, "prefill"),  # cross-attention caches `encoded`; nothing else runs
}


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention, MLP, each in a residual block.

    Attributes:
      config: the model config.
      decode: both attentions keep a "cache" (see `Attention`), for the
        modes "step", "recompute" and "prefill" of `DECODER_MODES`.
    """

    config: TransformerConfig
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        x: Array | None,
        encoded: Array | None,
        *,
        mode: str = "full",
        segment_ids: Array | None = None,
        positions: Array | None = None,
        encoded_segment_ids: Array | None = None,
        encoded_positions: Array | None = None,
        scheme_state: Any = None,
        cache_index: Array | None = None,
        train: bool = False,
        cache_positions: Array | None = None,
    ) -> Array | None:
        """One decoder layer in one of `DECODER_MODES`.

        Args:
          x: `[B, T, D]` (T = 1 in "step" and "recompute"); None for "prefill",
            where the encoder output enters only through cross-attention's
            keys/values.
          encoded: the encoder output `[B, S, D]`; None for "step".
          mode: "full", "step", "recompute" or "prefill".
          segment_ids: int `[B, T]`, or None while decoding (the query then
            belongs to the row's only segment).
          positions: int `[B, T]`.
          encoded_segment_ids: int `[B, S]` (0 = padding).
          encoded_positions: int `[B, S]`.
          scheme_state: the scheme's parameters shared by the stack, or None.
          cache_index: int scalar, the slot a step writes.
          train: dropout, attention dropout included (needs a "dropout" rng).
          cache_positions: int `[B, L]`, the positions of a step's L
            self-attention cache slots (randomised positions at decoding);
            None: the slots are at `arange(L)`. With them `segment_ids`
            must be given (the query's, ones).

        Returns:
          `[B, T, D]`; None for "prefill".
        """
        cfg = self.config
        self_mode, cross_mode = DECODER_MODES[mode]
        self_attn = Attention(cfg, causal=True, decode=self.decode, name="self_attention")
        cross_attn = Attention(cfg, cross=True, decode=self.decode, name="cross_attention")
        if mode == "prefill":
            return cross_attn(None, encoded, mode="prefill")
        self_cache = {}  # today's call unchanged where the slots are at arange(L)
        if cache_positions is not None:
            slot_segments = jnp.ones(cache_positions.shape, jnp.int32)  # [B, L], every slot real
            self_cache = dict(cache_positions=cache_positions, cache_segment_ids=slot_segments)
        x = sublayer(
            cfg,
            x,
            lambda h: self_attn(
                h,
                h,
                mode=self_mode,
                q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids,
                q_positions=positions,
                kv_positions=positions,
                scheme_state=scheme_state,
                cache_index=cache_index,
                train=train,
                **self_cache,
            ),
            layer_norm(cfg, "self_attention_norm"),
            train,
        )
        # While decoding one token there are no target segment ids: the query
        # belongs to the row's only segment, and the encoder's real tokens are 1.
        cross_q_segments = jnp.ones(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids
        x = sublayer(
            cfg,
            x,
            lambda h: cross_attn(
                h,
                encoded,
                mode=cross_mode,
                q_segment_ids=cross_q_segments,
                kv_segment_ids=encoded_segment_ids,
                q_positions=positions,
                kv_positions=encoded_positions,
                train=train,
            ),
            layer_norm(cfg, "cross_attention_norm"),
            train,
        )
        return sublayer(cfg, x, MLP(cfg, name="mlp"), layer_norm(cfg, "mlp_norm"), train)
