"""The encoder–decoder Transformer (Vaswani et al.) with switchable positions.

`Transformer(config)(inputs, targets)` returns next-token logits for `targets`
shifted right inside the decoder. Token 0 is padding and the decoder's start
symbol, token 1 is end of sequence. Packed rows carry segment ids (>= 1 for
real tokens, 0 for padding) and positions that restart at each segment; the
shift right restarts too, so the first token of a packed sequence sees the
start symbol, never its neighbour's last token.

Decoding (`jattn.models.decoding`) runs the same modules with `decode=True`
(Flax WMT's flag: `Transformer(use_cache=True)`) and names each call's mode:
`Transformer.prefill` caches the encoder's keys/values once, `Transformer.step`
decodes one token over the KV cache (`DECODER_MODES`, and `Attention`'s modes).

Shapes: B batch, S input length, T target length, L decoded length, D model
width, K key/value heads, H head dim, V vocabulary.
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
    "DECODER_MODES",
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
    def __call__(
        self,
        x: Array,
        *,
        segment_ids: Array,
        positions: Array,
        t5_table: Array | None,
        train: bool,
    ) -> Array:
        """One encoder layer.

        Args:
          x: `[B, S, D]`.
          segment_ids: int `[B, S]` (0 = padding).
          positions: int `[B, S]`.
          t5_table: the stack's T5 table `[buckets, N]` (T5 per stack), else None.
          train: dropout, attention dropout included (needs a "dropout" rng).

        Returns:
          `[B, S, D]`.
        """
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
                train=train,
            ),
            layer_norm(cfg, "self_attention_norm"),
            train,
        )
        return _sublayer(cfg, x, MLP(cfg, name="mlp"), layer_norm(cfg, "mlp_norm"), train)


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
        t5_table: Array | None = None,
        cache_index: Array | None = None,
        train: bool = False,
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
          t5_table: the stack's T5 table `[buckets, N]` (T5 per stack), else None.
          cache_index: int scalar, the slot a step writes.
          train: dropout, attention dropout included (needs a "dropout" rng).

        Returns:
          `[B, T, D]`; None for "prefill".
        """
        cfg = self.config
        self_mode, cross_mode = DECODER_MODES[mode]
        self_attn = Attention(cfg, causal=True, decode=self.decode, name="self_attention")
        cross_attn = Attention(cfg, cross=True, decode=self.decode, name="cross_attention")
        if mode == "prefill":
            return cross_attn(None, encoded, mode="prefill")
        x = _sublayer(
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
                t5_table=t5_table,
                cache_index=cache_index,
                train=train,
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
    def __call__(
        self, inputs: Array, *, segment_ids: Array, positions: Array, train: bool = False
    ) -> Array:
        """Encode source tokens.

        Args:
          inputs: int `[B, S]`.
          segment_ids: int `[B, S]` (0 = padding).
          positions: int `[B, S]`.
          train: dropout (needs a "dropout" rng).

        Returns:
          `[B, S, D]`.
        """
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

    Attributes:
      config: the model config.
      embed: the target embedding (also the output projection when shared).
      decode: keep a "cache" collection (Flax WMT's flag): an `index` (the
        next position), each self-attention layer's keys and values
        `[B, L, K, H]` and each cross-attention layer's keys and values of
        the encoder output `[B, S, K, H]`. The "full" call at `init` creates
        it (zeros), sized by its targets and encoder output.

    Each call names its mode (`DECODER_MODES`):

    - "full": teacher forcing: logits `[B, T, V]` for targets `[B, T]`,
      shifted right inside; a cache is neither read nor written.
    - "prefill" (decode=True): every layer projects `encoded` into its
      cross-attention cache, once per decode call; returns None.
    - "step" (decode=True, initialised cache): `targets` is the previous token
      `[B, 1]` (no shift), at position `index`, which the call advances;
      returns the logits `[B, 1, V]` for the next one. Cross-attention reads
      its cached keys/values (`encoded` is None).
    - "recompute": a step whose cross-attention projects `encoded` again (the
      path before the cross-attention cache, kept for comparison), leaving
      the cross-attention cache untouched.
    """

    config: TransformerConfig
    embed: nn.Module
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        encoded: Array | None,
        targets: Array | None,
        *,
        mode: str = "full",
        encoded_segment_ids: Array | None = None,
        encoded_positions: Array | None = None,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        train: bool = False,
    ) -> Array | None:
        """Decode in one of `DECODER_MODES`.

        Args:
          encoded: the encoder output `[B, S, D]`; None for "step".
          targets: int `[B, T]` ("full"), the previous token `[B, 1]` ("step",
            "recompute"), None ("prefill").
          mode: "full", "prefill", "step" or "recompute".
          encoded_segment_ids: int `[B, S]` (0 = padding).
          encoded_positions: int `[B, S]`.
          segment_ids: int `[B, T]` ("full").
          positions: int `[B, T]` ("full"; a step's is the cache index).
          train: dropout (needs a "dropout" rng).

        Returns:
          float32 logits `[B, T, V]` (`[B, 1, V]` for a step); None for "prefill".
        """
        cfg = self.config
        self._check_mode(mode)
        if mode == "prefill":
            for i in range(cfg.num_layers):
                DecoderLayer(cfg, decode=True, name=f"layer_{i}")(None, encoded, mode="prefill")
            return None
        cache_index = None
        if mode == "full":
            y = shift_right(targets, segment_ids)  # [B, T]
            if self.decode and self.is_initializing():
                self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        else:
            y, cache_index = targets, self._next_index()
            positions = jnp.full((targets.shape[0], 1), cache_index, jnp.int32)  # the query's
            segment_ids = None
            encoded_segment_ids = (encoded_segment_ids != 0).astype(jnp.int32)
        x = _embed_and_position(cfg, self.embed, y, positions, train)
        t5_table = None
        if cfg.relative_position == "t5" and not cfg.t5_per_layer:
            t5_table = T5RelativeBias(cfg, name="t5_bias")()
        for i in range(cfg.num_layers):
            x = DecoderLayer(cfg, decode=self.decode, name=f"layer_{i}")(
                x,
                encoded,
                mode=mode,
                segment_ids=segment_ids,
                positions=positions,
                encoded_segment_ids=encoded_segment_ids,
                encoded_positions=encoded_positions,
                t5_table=t5_table,
                cache_index=cache_index,
                train=train,
            )
        return self._logits(x)

    def _check_mode(self, mode: str) -> None:
        """Fail clearly on an unknown mode, or a cached one without a cache."""
        if mode not in DECODER_MODES:
            raise ValueError(f"Decoder: mode must be one of {sorted(DECODER_MODES)}, got {mode!r}")
        if mode != "full" and not self.decode:
            raise ValueError(f"Decoder: mode={mode!r} needs decode=True and an initialised cache")
        if mode in ("step", "recompute") and not self.has_variable("cache", "index"):
            raise ValueError(
                f"Decoder: mode={mode!r} needs decode=True and an initialised cache "
                "(jattn.models.decoding.init_cache, or prefill)"
            )

    def _next_index(self) -> Array:
        """The cache index of this step (int32 scalar); advances the stored one."""
        index = self.variable("cache", "index")
        current = index.value
        index.value = current + 1
        return current

    def _logits(self, x: Array) -> Array:
        """`[B, T, D]` -> float32 logits `[B, T, V]` (final norm if pre-norm)."""
        cfg = self.config
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
      use_cache: build the decoder with `decode=True` (KV cache) for `step`
        and `prefill`; `jattn.models.decoding` clones the model with
        `use_cache=True`.
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
        encoded: Array,
        inputs: Array,
        targets: Array,
        *,
        inputs_segment_ids: Array | None = None,
        inputs_positions: Array | None = None,
        targets_segment_ids: Array | None = None,
        targets_positions: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Teacher-forced logits `[B, T, V]` for `targets` `[B, T]` given `encoded`.

        Args:
          encoded: encoder outputs `[B, S, D]`.
          inputs: int `[B, S]` source tokens; with `inputs_segment_ids` they
            tell cross-attention which encoder positions are real.
          targets: int `[B, T]`, shifted right inside.
          inputs_segment_ids, inputs_positions: int `[B, S]`, as in `__call__`.
          targets_segment_ids, targets_positions: int `[B, T]`, as in `__call__`.
          train: enables dropout (needs a "dropout" rng).

        Returns:
          float32 `[B, T, V]`.
        """
        inputs = check_tokens("inputs", inputs)
        targets = check_tokens("targets", targets)
        if (inputs_segment_ids is None) != (targets_segment_ids is None):
            raise ValueError(
                "Transformer: packed rows need both inputs_segment_ids and "
                "targets_segment_ids (or neither)"
            )
        self._check_encoded(encoded, inputs, targets)
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
            mode="full",
            encoded_segment_ids=enc_seg,
            encoded_positions=enc_pos,
            segment_ids=seg,
            positions=pos,
            train=train,
        )

    def step(self, inputs: Array, tokens: Array, *, encoded: Array | None = None) -> Array:
        """One cached decoder step: logits `[B, 1, V]` for the token after `tokens`.

        Needs `use_cache=True` and a "cache" collection from `prefill` (or a
        previous step), passed with `mutable=["cache"]`; the step writes its
        self-attention keys/values and advances the index.

        Args:
          inputs: int `[B, S]` source tokens, unpacked (their zeros mask
            cross-attention).
          tokens: int `[B, 1]`, the previous token (0 at the first step), not
            shifted.
          encoded: None: cross-attention reads the prefilled keys/values
            (Decoder mode "step"). Given (`[B, S, D]`): it projects them again
            (mode "recompute", the uncached path, for comparisons).

        Returns:
          float32 `[B, 1, V]`.
        """
        if not self.use_cache:
            raise ValueError("Transformer.step needs use_cache=True")
        inputs = check_tokens("inputs", inputs)
        tokens = check_tokens("tokens", tokens)
        self._check_encoded(encoded, inputs, tokens)
        enc_seg, enc_pos = segments_and_positions(inputs, None, None, "inputs")
        return self.decoder(
            encoded,
            tokens,
            mode="step" if encoded is None else "recompute",
            encoded_segment_ids=enc_seg,
            encoded_positions=enc_pos,
        )

    def prefill(self, encoded: Array) -> None:
        """Store every decoder layer's cross-attention keys/values of `encoded`.

        Needs `use_cache=True`, a "cache" collection from
        `jattn.models.decoding.init_cache` sized for `encoded` `[B, S, D]` and
        `mutable=["cache"]`; writes `[B, S, K, H]` keys and values per layer,
        which later steps (`step` without `encoded`) read instead of
        projecting the encoder output again.
        """
        if not self.use_cache:
            raise ValueError("Transformer.prefill needs use_cache=True")
        if encoded.ndim != 3 or encoded.shape[-1] != self.config.d_model:
            raise ValueError(
                f"Transformer.prefill: encoded must be [B, S, {self.config.d_model}], "
                f"got {list(encoded.shape)}"
            )
        self.decoder(encoded, None, mode="prefill")

    def _check_encoded(self, encoded: Array | None, inputs: Array, targets: Array) -> None:
        """Batch and length agreement of `inputs` `[B, S]`, `targets` `[B, T]`
        and `encoded` `[B, S, D]` (when given)."""
        enc_shape = inputs.shape if encoded is None else encoded.shape[:2]
        if inputs.shape[0] != targets.shape[0] or enc_shape != inputs.shape:
            raise ValueError(
                f"Transformer: batch/length mismatch: inputs {list(inputs.shape)}, "
                f"targets {list(targets.shape)}, encoded {list(enc_shape)}"
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
