"""Flax layers of the Transformer: embeddings, absolute positions, MLP, layer norm.

Each module owns parameters and calls core functions; the arithmetic lives
there. Absolute positional vectors are the scheme's (`jattn.models.schemes`):
`AbsolutePositions` calls its `embed` hook and never looks at its name.
Parameters and activations carry logical axis names (`jattn.models.axes`).
The attention layer is `jattn.models.attention_layer.Attention`, imported
here too, where the layers have always been imported from.

Shapes: the letters of `jattn.attention.legend` (D model width, F MLP width,
V vocabulary).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.attention_layer import MODES, Attention
from jattn.models.axes import constrain, param
from jattn.models.config import TransformerConfig

Array = jax.Array

__all__ = [
    "MODES",
    "MLP",
    "AbsolutePositions",
    "Attention",
    "Embed",
    "constrain",
    "layer_norm",
]

_xavier = jax.nn.initializers.xavier_uniform


def layer_norm(config: TransformerConfig, name: str) -> nn.LayerNorm:
    """A LayerNorm whose scale and bias are named ("embed",)."""
    return nn.LayerNorm(
        epsilon=config.layer_norm_epsilon,
        dtype=config.compute_dtype,
        param_dtype=config.params_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name=name,
    )


class Embed(nn.Module):
    """Token embedding `[V, D]`, optionally reused as the output projection."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.embedding = param(
            self,
            "embedding",
            nn.initializers.normal(stddev=cfg.d_model**-0.5),
            (cfg.vocab_size, cfg.d_model),
            ("vocab", "embed"),
            cfg.params_dtype,
        )

    def __call__(self, tokens: Array) -> Array:
        """Embed token ids.

        Args:
          tokens: int `[B, T]`.

        Returns:
          `[B, T, D]` in the compute dtype, scaled by sqrt(D) when configured.
        """
        cfg = self.config
        x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.compute_dtype)  # [B, T, D]
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.d_model), cfg.compute_dtype)
        return constrain(x, ("batch", "length", "embed"))

    def attend(self, x: Array) -> Array:
        """Output logits through the embedding.

        Args:
          x: `[B, T, D]`.

        Returns:
          `[B, T, V]` in the compute dtype.
        """
        emb = self.embedding.astype(self.config.compute_dtype)
        return jnp.einsum("BTD,VD->BTV", x, emb)


class AbsolutePositions(nn.Module):
    """Adds the scheme's absolute vector (sinusoidal, learned, ...) to every embedding."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array) -> Array:
        """Add each position's vector to the embeddings.

        Args:
          x: embeddings `[B, T, D]`.
          positions: int `[B, T]`.

        Returns:
          `[B, T, D]`, dtype of `x`.
        """
        cfg = self.config
        pe = cfg.scheme.embed(self, cfg, positions)  # [B, T, D]
        return x + pe.astype(x.dtype)


class MLP(nn.Module):
    """Position-wise feed-forward: `relu(x W1 + b1) W2 + b2`."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """Apply the MLP at every position.

        Args:
          x: `[B, T, D]`.

        Returns:
          `[B, T, D]` in the compute dtype (hidden activations `[B, T, F]`).
        """
        cfg = self.config
        d, f, dt = cfg.d_model, cfg.d_ff, cfg.params_dtype
        w1 = param(self, "wi", _xavier(), (d, f), ("embed", "mlp"), dt)
        b1 = param(self, "bi", nn.initializers.zeros, (f,), ("mlp",), dt)
        w2 = param(self, "wo", _xavier(), (f, d), ("mlp", "embed"), dt)
        b2 = param(self, "bo", nn.initializers.zeros, (d,), ("embed",), dt)
        c = cfg.compute_dtype
        h = jnp.einsum("BTD,DF->BTF", x, w1.astype(c)) + b1.astype(c)[None, None]  # [B, T, F]
        h = constrain(jax.nn.relu(h), ("batch", "length", "mlp"))
        y = jnp.einsum("BTF,FD->BTD", h, w2.astype(c)) + b2.astype(c)[None, None]  # [B, T, D]
        return constrain(y, ("batch", "length", "embed"))
