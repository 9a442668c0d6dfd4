"""`Transformer(config)`: the public constructor of every architecture's model.

`jattn.models.Transformer(config)` returns the model that
`config.architecture` names in `jattn.models.ARCHITECTURES` (an
`EncoderDecoder`, a `DecoderOnly` or an `EncoderOnly`), each a subclass of
`Transformer`, so `isinstance(model, Transformer)` holds for all of them and
the code above the models (training, evaluation, decoding, probes) never asks
which one it has: it asks the registered `Architecture`'s properties
(`model.architecture`).

Every model keeps one signature, written once (`Transformer.__call__`):

    model(inputs, targets, *, inputs_segment_ids=None, targets_segment_ids=None,
          inputs_positions=None, targets_positions=None, train=False)
        -> float32 logits [B, T, V] for the target positions

and an architecture defines `forward(inputs, targets, *, segment_ids,
positions, train)`, which takes each side's segment ids and positions as an
`(inputs', targets')` pair.

Token 0 is padding and the decoder's start symbol, token 1 is end of
sequence. Packed rows carry segment ids (>= 1 for real tokens, 0 for padding)
and positions that restart at each segment. The methods an architecture
has besides (`encode`, `decode`, `prefill`, `step`, `prefill_prompt`) are
its own; asking a model for one it lacks is a one-line error naming the
architecture.

Shapes: the letters of `jattn.attention.legend` (S input length, T target
length, D model width, V vocabulary).
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax

from jattn.models.architectures import Architecture
from jattn.models.config import TransformerConfig
from jattn.models.inputs import check_packing, positions_from_segments, shift_right

Array = jax.Array

__all__ = ["Transformer", "positions_from_segments", "shift_right"]


class Transformer(nn.Module):
    """The model of `config.architecture`; `Transformer(config)` builds the
    registered subclass (see the module docstring).

    Attributes:
      config: hyperparameters.
      use_cache: build the attention layers with `decode=True` (KV cache) for
        cached decoding; `jattn.models.decoding` clones the model with
        `use_cache=True`.
      architecture: (class attribute) the registered `Architecture`.
    """

    config: TransformerConfig
    use_cache: bool = False

    architecture: ClassVar[Architecture]

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is Transformer:  # the public constructor: the registered model
            config = kwargs.get("config", args[0] if args else None)
            if not isinstance(config, TransformerConfig):
                raise TypeError(
                    f"Transformer: config must be a TransformerConfig, got {type(config).__name__}"
                )
            cls = config.arch.model
        return super().__new__(cls)

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
        """Logits `[B, T, V]` (float32) for the target positions: every
        architecture's one signature, written once here; the architecture's
        `forward` computes them.

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
        check_packing(inputs_segment_ids, targets_segment_ids)
        return self.forward(
            inputs,
            targets,
            segment_ids=(inputs_segment_ids, targets_segment_ids),
            positions=(inputs_positions, targets_positions),
            train=train,
        )

    def forward(self, inputs: Array, targets: Array, *, segment_ids, positions, train: bool):
        """The architecture's forward pass: `__call__` with the segment ids and
        the positions as `(inputs', targets')` pairs (each None or int)."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def _check_config(self) -> None:
        """A config of this architecture (a subclass built directly, or a clone)."""
        cfg = self.config
        if not isinstance(cfg, TransformerConfig):
            raise TypeError(
                f"Transformer: config must be a TransformerConfig, got {type(cfg).__name__}"
            )
        if cfg.architecture != self.architecture.name:
            raise ValueError(
                f"{type(self).__name__} is the {self.architecture.name!r} model; the config "
                f"says architecture={cfg.architecture!r} (build it with Transformer(config))"
            )

    def _lacks(self, method: str, instead: str) -> None:
        """A one-line error for a method this architecture does not have."""
        raise ValueError(
            f"Transformer.{method} is not a method of the {self.architecture.name} model "
            f"({instead})"
        )

    def encode(self, inputs: Array, **kwargs: Any) -> Array:
        """Encoder outputs `[B, S, D]` (encoder–decoder only)."""
        self._lacks("encode", "it has no encoder: call the model")

    def decode(self, encoded: Array, inputs: Array, targets: Array, **kwargs: Any) -> Array:
        """Teacher-forced logits from encoder outputs (encoder–decoder only)."""
        self._lacks("decode", "it has no encoder: call the model")

    def prefill(self, encoded: Array) -> None:
        """Cache cross-attention keys/values (encoder–decoder only)."""
        self._lacks("prefill", "only an encoder_decoder has cross-attention to prefill")

    def prefill_prompt(self, inputs: Array, **kwargs: Any) -> None:
        """Cache a prompt's keys/values (decoder-only only)."""
        self._lacks("prefill_prompt", "only a decoder_only model reads a prompt into its cache")

    def step(self, inputs: Array, tokens: Array, **kwargs: Any) -> Array:
        """One cached decoding step (autoregressive architectures)."""
        self._lacks("step", "it predicts every target at once: call the model")
