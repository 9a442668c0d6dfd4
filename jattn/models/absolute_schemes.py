"""The absolute schemes, one component each: a vector per position added to the embeddings.

"sinusoidal" (Vaswani et al.'s fixed sinusoids) and "learned" (a table of
`max_len` rows) act through the `embed` hook only; "sinusoidal+shaw"
(`jattn.models.shaw_schemes`) reuses the sinusoids. Registered in
`jattn.models.schemes`. Shapes: B batch, T positions, D width.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jattn import positions as pos_lib
from jattn.models.axes import param
from jattn.models.scheme import Scheme

__all__ = ["Learned", "Sinusoidal"]


@dataclasses.dataclass(frozen=True)
class Sinusoidal(Scheme):
    """Vaswani et al.'s sinusoids added to the embeddings."""

    absolute: bool = True

    def check(self, cfg):
        if cfg.d_model % 2:
            raise ValueError(
                f"TransformerConfig.d_model={cfg.d_model} must be even for sinusoidal positions"
            )

    def embed(self, module, cfg, positions):
        return pos_lib.sinusoidal(positions, cfg.d_model)  # [B, T, D]


@dataclasses.dataclass(frozen=True)
class Learned(Scheme):
    """A learned vector per position, `max_len` rows (positions beyond are clipped)."""

    absolute: bool = True

    def max_position(self, cfg):
        return cfg.max_len

    def embed(self, module, cfg, positions):
        table = param(
            module,
            "table",
            nn.initializers.normal(stddev=cfg.d_model**-0.5),
            (cfg.max_len, cfg.d_model),
            ("length", "embed"),
            cfg.params_dtype,
        )  # [max_len, D]
        return jnp.take(table, positions, axis=0, mode="clip")  # [B, T, D]
