"""Logical axis names of the models' parameters and activations.

Every parameter carries logical axis names and the main activations are
constrained by name, so a training loop shards them with `flax.linen`
logical axis rules:

    batch   the batch axis B
    length  sequence axes T and S (also the learned position table's rows)
    embed   the model width D
    heads   attention heads, query (N) and key/value (K) alike
    kv      the head dim H
    mlp     the MLP hidden width F
    vocab   the vocabulary V

The layers (`jattn.models.layers`) and the positional schemes
(`jattn.models.schemes`) both declare parameters through `param`, so a
scheme's tables are sharded by the same rules as the attention weights.
"""

from __future__ import annotations

import flax.linen as nn
import jax

Array = jax.Array

__all__ = ["AXIS_NAMES", "constrain", "param"]

# Every logical name a parameter axis may carry (None: never sharded).
AXIS_NAMES = frozenset({"batch", "length", "embed", "heads", "kv", "mlp", "vocab", None})


def param(module: nn.Module, name: str, init, shape, names, dtype) -> Array:
    """`module.param(name, ...)` with logical axis names, one per axis.

    Args:
      module: the flax module that owns the parameter.
      name: the parameter's name in the module (its checkpoint key).
      init: a `jax.nn.initializers` function.
      shape: the parameter's shape.
      names: one logical name (or None) per axis, from `AXIS_NAMES`.
      dtype: the parameter dtype.
    """
    if len(names) != len(shape) or not set(names) <= AXIS_NAMES:
        raise ValueError(f"param {name!r}: axis names {names} do not fit shape {shape}")
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def constrain(x: Array, names: tuple[str | None, ...]) -> Array:
    """`nn.with_logical_constraint`, a no-op outside a mesh with rules."""
    return nn.with_logical_constraint(x, names)
