"""jattn: a functional JAX research codebase for attention.

The core (this package's top level) depends only on jax, numpy and chex:

    import jattn
    out = jattn.dot_product_attention(q, k, v, is_causal=True)

Models, data and training live in subpackages that import flax, optax, orbax,
tfds and grain on demand.
"""

from jattn import dropout, masks, positions
from jattn.attention import (
    IMPLEMENTATIONS,
    attention_weights,
    default_implementation,
    dot_product_attention,
)
from jattn.attention.normal_form import NormalForm, normalise
from jattn.flax_attention import flax_attention_fn
from jattn.positions import ShawRelative
from jattn.score_mod import ScoreMod

__all__ = [
    "IMPLEMENTATIONS",
    "NormalForm",
    "ScoreMod",
    "ShawRelative",
    "attention_weights",
    "default_implementation",
    "dot_product_attention",
    "dropout",
    "flax_attention_fn",
    "masks",
    "normalise",
    "positions",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    """`jattn.decoding` is `jattn.models.decoding`, imported on first use.

    Decoding needs flax, so it is not imported with `jattn`; this keeps the
    public name `jattn.decoding` (and `from jattn import decoding`) working.
    """
    if name == "decoding":
        import importlib  # noqa: PLC0415

        return importlib.import_module("jattn.models.decoding")
    raise AttributeError(f"module 'jattn' has no attribute {name!r}")
