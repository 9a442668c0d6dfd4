"""The encoder–decoder Transformer (Vaswani et al.) with switchable positions.

`Transformer(config)(inputs, targets)` returns next-token logits for `targets`
shifted right inside the decoder. Token 0 is padding and the decoder's start
symbol, token 1 is end of sequence. Packed rows carry segment ids (>= 1 for
real tokens, 0 for padding) and positions that restart at each segment; the
shift right restarts too, so the first token of a packed sequence sees the
start symbol, never its neighbour's last token.

Shapes: B batch, S input length, T target length, D model width, V vocabulary.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.config import TransformerConfig
from jattn.models.inputs import (
    check_learned_length,
    check_tokens,
    positions_from_segments,
    segments_and_positions,
    shift_right,
)
from jattn.models.layers import (
    MLP,
    AbsolutePositions,
    Attention,
    Embed,
    T5RelativeBias,
    constrain,
    layer_norm,
)

Array = jax.Array

__all__ = [
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "Transformer",
    "positions_from_segments",
    "shift_right",
]


# -- layers --------------------------------------------------------------------


def _sublayer(cfg: TransformerConfig, x: Array, f, norm: nn.Module, train: bool) -> Array:
    """`x + dropout(f(norm(x)))` (pre-norm) or `norm(x + dropout(f(x)))` (post-norm)."""
    h = f(norm(x) if cfg.pre_norm else x)
    h = nn.Dropout(cfg.dropout_rate)(h, deterministic=not train)
    y = x + h
    return y if cfg.pre_norm else norm(y)


class EncoderLayer(nn.Module):
    """Self-attention then MLP, each in a residual block."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, *, segment_ids, positions, t5_table, train: bool) -> Array:
        cfg = self.config
        attn = Attention(cfg, name="self_attention")
        x = _sublayer(
            cfg,
            x,
            lambda h: attn(
                h,
                h,
                q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids,
                q_positions=positions,
                kv_positions=positions,
                t5_table=t5_table,
            ),
            layer_norm(cfg, "self_attention_norm"),
            train,
        )
        return _sublayer(cfg, x, MLP(cfg, name="mlp"), layer_norm(cfg, "mlp_norm"), train)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention, MLP, each in a residual block.

    With `decode=True` both attentions keep a cache (see `Attention`). Two
    calls differ from the usual one: `x=None` prefills the cross-attention
    cache from `encoded` `[B, S, D]` and returns None (nothing else runs:
    the encoder output enters a layer only through cross-attention's
    keys/values, and the layer norms act on `x`); `encoded=None` is a step
    whose cross-attention reads the prefilled keys/values.
    """

    config: TransformerConfig
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        x,
        encoded,
        *,
        segment_ids,
        positions,
        encoded_segment_ids,
        encoded_positions,
        t5_table,
        cache_index,
        train: bool,
    ) -> Array | None:
        cfg = self.config
        self_attn = Attention(cfg, causal=True, decode=self.decode, name="self_attention")
        cross_attn = Attention(cfg, cross=True, decode=self.decode, name="cross_attention")
        if x is None:  # prefill
            return cross_attn(
                None,
                encoded,
                q_segment_ids=None,
                kv_segment_ids=None,
                q_positions=None,
                kv_positions=None,
            )
        x = _sublayer(
            cfg,
            x,
            lambda h: self_attn(
                h,
                h,
                q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids,
                q_positions=positions,
                kv_positions=positions,
                t5_table=t5_table,
                cache_index=cache_index,
            ),
            layer_norm(cfg, "self_attention_norm"),
            train,
        )
        # While decoding one token there are no target segment ids: the query
        # belongs to the row's only segment, and the encoder's real tokens are 1.
        cross_q_segments = jnp.ones(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids
        x = _sublayer(
            cfg,
            x,
            lambda h: cross_attn(
                h,
                encoded,
                q_segment_ids=cross_q_segments,
                kv_segment_ids=encoded_segment_ids,
                q_positions=positions,
                kv_positions=encoded_positions,
            ),
            layer_norm(cfg, "cross_attention_norm"),
            train,
        )
        return _sublayer(cfg, x, MLP(cfg, name="mlp"), layer_norm(cfg, "mlp_norm"), train)


# -- stacks --------------------------------------------------------------------


def _embed_and_position(cfg, embed, tokens, positions, train) -> Array:
    """Embeddings `[B, L, D]` plus absolute positions (if any), with dropout."""
    x = embed(tokens)  # [B, L, D]
    if cfg.absolute_position is not None:
        x = AbsolutePositions(cfg, name="positions")(x, positions)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)
    return constrain(x, ("batch", "length", "embed"))


class Encoder(nn.Module):
    """Embeddings + positions, `num_layers` encoder layers (+ final norm if pre-norm)."""

    config: TransformerConfig
    embed: nn.Module

    @nn.compact
    def __call__(self, inputs, *, segment_ids, positions, train: bool = False) -> Array:
        """int `[B, S]` with segment ids and positions `[B, S]` -> `[B, S, D]`."""
        cfg = self.config
        x = _embed_and_position(cfg, self.embed, inputs, positions, train)
        t5_table = None
        if cfg.relative_position == "t5" and not cfg.t5_per_layer:
            t5_table = T5RelativeBias(cfg, name="t5_bias")()
        for i in range(cfg.num_layers):
            x = EncoderLayer(cfg, name=f"layer_{i}")(
                x, segment_ids=segment_ids, positions=positions, t5_table=t5_table, train=train
            )
        if cfg.pre_norm:
            x = layer_norm(cfg, "final_norm")(x)
        return constrain(x, ("batch", "length", "embed"))


class Decoder(nn.Module):
    """Target embeddings, `num_layers` decoder layers, output logits.

    With `decode=True` the stack keeps a "cache" collection: an `index` (the
    next position), each self-attention layer's keys and values `[B, L, K, H]`
    and each cross-attention layer's keys and values of the encoder output
    `[B, S, K, H]`. After the cache exists:

    - `targets=None` prefills: every layer projects `encoded` into its
      cross-attention cache (once per decode call); returns None.
    - otherwise each call takes the previous token `[B, 1]` (no shift) at
      position `index` and returns the logits `[B, 1, V]` for the next one.
      With `encoded=None` cross-attention reads its cached keys/values; with
      `encoded` given it projects them again (the uncached path, for
      comparison), leaving the cross-attention cache untouched.
    """

    config: TransformerConfig
    embed: nn.Module
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        encoded,
        targets,
        *,
        encoded_segment_ids,
        encoded_positions,
        segment_ids,
        positions,
        train: bool = False,
    ) -> Array | None:
        cfg = self.config
        stepping = self.decode and self.has_variable("cache", "index")
        if (targets is None or encoded is None) and not stepping:
            raise ValueError(
                "Decoder: targets=None (prefill) and encoded=None (a step over cached "
                "cross-attention keys/values) need decode=True and an initialised cache"
            )
        if targets is None:
            for i in range(cfg.num_layers):
                DecoderLayer(cfg, decode=True, name=f"layer_{i}")(
                    None,
                    encoded,
                    segment_ids=None,
                    positions=None,
                    encoded_segment_ids=None,
                    encoded_positions=None,
                    t5_table=None,
                    cache_index=None,
                    train=False,
                )
            return None
        cache_index = None
        if self.decode:
            index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if stepping:
            cache_index = index.value
            b = targets.shape[0]
            positions = jnp.full((b, 1), cache_index, jnp.int32)  # the query's position
            segment_ids = None
            encoded_segment_ids = (encoded_segment_ids != 0).astype(jnp.int32)
            index.value = cache_index + 1
            y = targets
        else:
            y = shift_right(targets, segment_ids)  # [B, T]
        x = _embed_and_position(cfg, self.embed, y, positions, train)
        t5_table = None
        if cfg.relative_position == "t5" and not cfg.t5_per_layer:
            t5_table = T5RelativeBias(cfg, name="t5_bias")()
        for i in range(cfg.num_layers):
            x = DecoderLayer(cfg, decode=self.decode, name=f"layer_{i}")(
                x,
                encoded,
                segment_ids=segment_ids,
                positions=positions,
                encoded_segment_ids=encoded_segment_ids,
                encoded_positions=encoded_positions,
                t5_table=t5_table,
                cache_index=cache_index,
                train=train,
            )
        if cfg.pre_norm:
            x = layer_norm(cfg, "final_norm")(x)
        if cfg.share_embeddings:
            logits = self.embed.attend(x)
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


class Transformer(nn.Module):
    """The encoder–decoder model of `jattn.models.TransformerConfig`.

    Attributes:
      config: hyperparameters.
      use_cache: build the decoder in decode mode (KV cache); used by
        `jattn.decoding`, which clones the model with `use_cache=True`.
    """

    config: TransformerConfig
    use_cache: bool = False

    def setup(self):
        cfg = self.config
        if not isinstance(cfg, TransformerConfig):
            raise TypeError(
                f"Transformer: config must be a TransformerConfig, got {type(cfg).__name__}"
            )
        if cfg.share_embeddings:
            self.embed = Embed(cfg)
            source, target = self.embed, self.embed
        else:
            self.source_embed = Embed(cfg)
            self.target_embed = Embed(cfg)
            source, target = self.source_embed, self.target_embed
        self.encoder = Encoder(cfg, embed=source)
        self.decoder = Decoder(cfg, embed=target, decode=self.use_cache)

    def encode(
        self,
        inputs: Array,
        *,
        inputs_segment_ids: Array | None = None,
        inputs_positions: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Encoder outputs `[B, S, D]` for int `inputs` `[B, S]`."""
        inputs = check_tokens("inputs", inputs)
        check_learned_length(self.config, inputs.shape[1], "inputs")
        seg, pos = segments_and_positions(inputs, inputs_segment_ids, inputs_positions, "inputs")
        return self.encoder(inputs, segment_ids=seg, positions=pos, train=train)

    def decode(
        self,
        encoded: Array | None,
        inputs: Array,
        targets: Array,
        *,
        inputs_segment_ids: Array | None = None,
        inputs_positions: Array | None = None,
        targets_segment_ids: Array | None = None,
        targets_positions: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Logits `[B, T, V]` for `targets` `[B, T]` given `encoded` `[B, S, D]`.

        `inputs` (or `inputs_segment_ids`) tells cross-attention which encoder
        positions are real. With `use_cache=True` and an initialised cache,
        `targets` is the previous token `[B, 1]` and nothing is shifted, and
        `encoded` may be None: cross-attention then reads the keys/values that
        `prefill` stored (see `Decoder`).
        """
        inputs = check_tokens("inputs", inputs)
        targets = check_tokens("targets", targets)
        if (inputs_segment_ids is None) != (targets_segment_ids is None):
            raise ValueError(
                "Transformer: packed rows need both inputs_segment_ids and "
                "targets_segment_ids (or neither)"
            )
        enc_shape = inputs.shape if encoded is None else encoded.shape[:2]
        if inputs.shape[0] != targets.shape[0] or enc_shape != inputs.shape:
            raise ValueError(
                f"Transformer: batch/length mismatch: inputs {list(inputs.shape)}, "
                f"targets {list(targets.shape)}, encoded {list(enc_shape)}"
            )
        check_learned_length(self.config, targets.shape[1], "targets")
        enc_seg, enc_pos = segments_and_positions(
            inputs, inputs_segment_ids, inputs_positions, "inputs"
        )
        seg, pos = segments_and_positions(
            targets, targets_segment_ids, targets_positions, "targets"
        )
        return self.decoder(
            encoded,
            targets,
            encoded_segment_ids=enc_seg,
            encoded_positions=enc_pos,
            segment_ids=seg,
            positions=pos,
            train=train,
        )

    def prefill(self, encoded: Array) -> None:
        """Store every decoder layer's cross-attention keys/values of `encoded`.

        Needs `use_cache=True`, a "cache" collection from
        `jattn.decoding.init_cache` sized for `encoded` `[B, S, D]` and
        `mutable=["cache"]`; writes `[B, S, K, H]` keys and values per layer,
        which later steps (`decode` with `encoded=None`) read instead of
        projecting the encoder output again.
        """
        if not self.use_cache:
            raise ValueError("Transformer.prefill needs use_cache=True")
        if encoded.ndim != 3 or encoded.shape[-1] != self.config.d_model:
            raise ValueError(
                f"Transformer.prefill: encoded must be [B, S, {self.config.d_model}], "
                f"got {list(encoded.shape)}"
            )
        self.decoder(
            encoded,
            None,
            encoded_segment_ids=None,
            encoded_positions=None,
            segment_ids=None,
            positions=None,
        )

    def __call__(
        self,
        inputs: Array,
        targets: Array,
        *,
        inputs_segment_ids: Array | None = None,
        targets_segment_ids: Array | None = None,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Next-token logits `[B, T, V]` (float32) for `targets` shifted right.

        Args:
          inputs: int `[B, S]` source tokens (0 = padding).
          targets: int `[B, T]` target tokens (0 = padding, 1 = EOS).
          inputs_segment_ids: int `[B, S]` for packed rows (0 = padding);
            default `inputs != 0`. Give both segment ids or neither.
          targets_segment_ids: int `[B, T]`; default `targets != 0`.
          inputs_positions: int `[B, S]`; default restarts per given segment,
            else `arange(S)`.
          targets_positions: int `[B, T]`; likewise.
          train: enables dropout (needs a "dropout" rng).
        """
        if (inputs_segment_ids is None) != (targets_segment_ids is None):
            raise ValueError(
                "Transformer: packed rows need both inputs_segment_ids and "
                "targets_segment_ids (or neither)"
            )
        encoded = self.encode(
            inputs,
            inputs_segment_ids=inputs_segment_ids,
            inputs_positions=inputs_positions,
            train=train,
        )
        return self.decode(
            encoded,
            inputs,
            targets,
            inputs_segment_ids=inputs_segment_ids,
            inputs_positions=inputs_positions,
            targets_segment_ids=targets_segment_ids,
            targets_positions=targets_positions,
            train=train,
        )
