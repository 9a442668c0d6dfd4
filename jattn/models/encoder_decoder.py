"""The encoder–decoder Transformer (Vaswani et al.) with switchable positions.

`Transformer(config)` with `architecture="encoder_decoder"` (the default)
builds `EncoderDecoder`: `model(inputs, targets)` returns next-token logits
for `targets` shifted right inside the decoder. Packed rows carry segment ids
(>= 1 for real tokens, 0 for padding) and positions that restart at each
segment; the shift right restarts too, so the first token of a packed
sequence sees the start symbol, never its neighbour's last token.

Decoding (`jattn.models.decoding`) runs the same modules with `decode=True`
(Flax WMT's flag: `use_cache=True`) and names each call's mode:
`EncoderDecoder.prefill` caches the encoder's keys/values once, `.step`
decodes one token over the KV cache (`DECODER_MODES`, and `Attention`'s modes).

Shapes: the letters of `jattn.attention.legend` (S input length, T target
length, L decoded length, D model width, V vocabulary).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.architectures import register
from jattn.models.blocks import DECODER_MODES, Encoder, stack_blocks, stack_inputs, vocab_logits
from jattn.models.config import TransformerConfig
from jattn.models.inputs import (
    check_ids,
    check_packing,
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

__all__ = ["Decoder", "EncoderDecoder"]


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
          positions: int `[B, T]` ("full"). In a step: None (the L cache
            slots are at `arange(L)`, the query at the cache index), or int
            `[B, L]`, every slot's position, drawn before decoding
            (randomised positions); the query's is the one at the index, and
            the causal rule over these sorted positions hides later slots.
          train: dropout (needs a "dropout" rng).

        Returns:
          float32 logits `[B, T, V]` (`[B, 1, V]` for a step); None for "prefill".
        """
        cfg = self.config
        self._check_mode(mode)
        if mode == "prefill":
            for block, slot in stack_blocks(cfg, cfg.num_layers, **self._kinds()):
                block(None, encoded, call=LayerCall(mode="prefill", cache_slot=slot))
            return None
        cache_index = None
        if mode == "full":
            y = shift_right(targets, segment_ids)  # [B, T]
            if self.decode and self.is_initializing():
                self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            vis = Visibility.of_sequence(segment_ids, positions)
        else:
            y, cache_index = targets, self._next_index()
            vis = self._step_visibility(cache_index, targets.shape[0], positions)
            positions, segment_ids = vis.q_positions, vis.q_segment_ids
            encoded_segment_ids = (encoded_segment_ids != 0).astype(jnp.int32)
        # While decoding one token there are no target segment ids: the query
        # belongs to the row's only segment, and the encoder's real tokens are 1.
        cross = Visibility(
            q_segment_ids=jnp.ones(y.shape, jnp.int32) if segment_ids is None else segment_ids,
            kv_segment_ids=encoded_segment_ids,
            q_positions=positions,
            kv_positions=encoded_positions,
        )
        x, state = stack_inputs(self, self.embed, y, positions, train=train, causal=True)
        call = LayerCall(mode=mode, train=train, scheme_state=state, cache_index=cache_index)
        for block, slot in stack_blocks(cfg, cfg.num_layers, **self._kinds()):
            x = block(
                x,
                encoded,
                call=call.replace(cache_slot=slot),
                visibility=vis,
                cross_visibility=cross,
            )
        return self._logits(x)

    @staticmethod
    def _step_visibility(index: Array, batch: int, slots: Array | None) -> Visibility:
        """A step's self-attention: the query at `index`; the L cache slots at
        `arange(L)` (the query's position is the index), or at their drawn
        positions `slots` `[B, L]` (randomised positions: the query's is the
        one at the index), every slot real."""
        if slots is None:
            return Visibility(q_positions=jnp.full((batch, 1), index, jnp.int32))
        slots = slots.astype(jnp.int32)
        position = jax.lax.dynamic_slice_in_dim(slots, index, 1, axis=1)  # [B, 1]
        return Visibility(
            q_positions=position,
            q_segment_ids=jnp.ones_like(position),
            kv_positions=slots,
            kv_segment_ids=jnp.ones_like(slots),
        )

    def _kinds(self) -> dict[str, bool]:
        """The decoder's blocks: causal, with cross-attention, cached when decoding."""
        return dict(cross=True, causal=True, decode=self.decode)

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
        return vocab_logits(cfg, self.embed, x)


@register("encoder_decoder")
class EncoderDecoder(Transformer):
    """Vaswani et al.'s encoder–decoder: `Transformer(config)` with
    `architecture="encoder_decoder"` (the default).

    Attributes:
      config: hyperparameters.
      use_cache: build the decoder with `decode=True` (KV cache) for `step`
        and `prefill`; `jattn.models.decoding` clones the model with
        `use_cache=True`.
    """

    def setup(self):
        cfg = self.config
        self._check_config()
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
        check_position_length(self.config, inputs.shape[1], "inputs")
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
        check_packing(inputs_segment_ids, targets_segment_ids)
        self._check_encoded(encoded, inputs, targets)
        check_position_length(self.config, targets.shape[1], "targets")
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

    def step(
        self,
        inputs: Array,
        tokens: Array,
        *,
        encoded: Array | None = None,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
    ) -> Array:
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
          inputs_positions: int `[B, S]`, the source positions the encoder
            was run with (default `arange(S)`); cross-attention reads them
            with `relative_cross`.
          targets_positions: int `[B, L]`, the position of every one of the L
            target slots, drawn before decoding (randomised positions,
            `jattn.models.decoding.decoding_positions`); this step's token
            takes the one at the cache index. Default: slot i at position i.
            A decoder-only model keeps its positions in the cache
            (`prefill_prompt`) and takes neither.

        Returns:
          float32 `[B, 1, V]`.
        """
        if not self.use_cache:
            raise ValueError("Transformer.step needs use_cache=True")
        inputs = check_tokens("inputs", inputs)
        tokens = check_tokens("tokens", tokens)
        self._check_encoded(encoded, inputs, tokens)
        enc_seg, enc_pos = segments_and_positions(inputs, None, inputs_positions, "inputs")
        if targets_positions is not None:  # [B, L]: every target slot's
            shape = (tokens.shape[0], jnp.shape(targets_positions)[-1])
            targets_positions = check_ids("targets_positions", targets_positions, shape)
        return self.decoder(
            encoded,
            tokens,
            mode="step" if encoded is None else "recompute",
            encoded_segment_ids=enc_seg,
            encoded_positions=enc_pos,
            positions=targets_positions,
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

    def _random_positions(self, tokens: Array, segment_ids: Array | None, name: str):
        """Segment ids (as `__call__` derives them) and Ruoss et al.'s random
        positions `[B, L]` for them; the rng is the "dropout" stream in
        training, a fixed key in evaluation."""
        tokens = check_tokens(name, tokens)
        seg, _ = segments_and_positions(tokens, segment_ids, None, name)
        rng = self.make_rng("dropout") if self.has_rng("dropout") else jax.random.key(0)
        rng = jax.random.fold_in(rng, 0 if name == "inputs" else 1)
        return seg, random_positions(rng, seg, self.config.random_positions)

    def _check_encoded(self, encoded: Array | None, inputs: Array, targets: Array) -> None:
        """Batch and length agreement of `inputs` `[B, S]`, `targets` `[B, T]`
        and `encoded` `[B, S, D]` (when given)."""
        enc_shape = inputs.shape if encoded is None else encoded.shape[:2]
        if inputs.shape[0] != targets.shape[0] or enc_shape != inputs.shape:
            raise ValueError(
                f"Transformer: batch/length mismatch: inputs {list(inputs.shape)}, "
                f"targets {list(targets.shape)}, encoded {list(enc_shape)}"
            )

    def forward(self, inputs: Array, targets: Array, *, segment_ids, positions, train: bool):
        """Next-token logits `[B, T, V]` (float32) for `targets` shifted right
        (`Transformer.__call__`): the encoder over the inputs, the decoder
        over the targets, each side with its segment ids and positions."""
        (in_seg, tg_seg), (in_pos, tg_pos) = segment_ids, positions
        if self.config.random_positions and (train or self.config.random_positions_eval):
            in_seg, in_pos = self._random_positions(inputs, in_seg, "inputs")
            tg_seg, tg_pos = self._random_positions(targets, tg_seg, "targets")
        encoded = self.encode(
            inputs, inputs_segment_ids=in_seg, inputs_positions=in_pos, train=train
        )
        return self.decode(
            encoded,
            inputs,
            targets,
            inputs_segment_ids=in_seg,
            inputs_positions=in_pos,
            targets_segment_ids=tg_seg,
            targets_positions=tg_pos,
            train=train,
        )
