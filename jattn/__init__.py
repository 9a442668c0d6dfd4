"""jattn: a functional JAX research codebase for attention.

The core (this package's top level) depends only on jax, numpy and chex:

    import jattn
    out = jattn.dot_product_attention(q, k, v, is_causal=True)

Models, data and training live in subpackages that import flax, optax, orbax,
tfds and grain on demand.

The names below are loaded on first use (PEP 562): `import jattn` itself
reads only the standard library, so the `jattn` command can install its
SIGTERM handler before jax is imported (`jattn.cli.signals`). Every name
behaves as an ordinary attribute: `jattn.masks`, `from jattn import
dot_product_attention`, `dir(jattn)`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names are, for readers and type checkers
    from jattn import dropout, masks, positions, visibility
    from jattn.attention import (
        IMPLEMENTATIONS,
        attention_weights,
        default_implementation,
        dot_product_attention,
    )
    from jattn.attention.cope import cope_attention
    from jattn.attention.normal_form import NormalForm, normalise
    from jattn.attention.stick_breaking import stick_breaking_attention
    from jattn.flax_attention import flax_attention_fn
    from jattn.positions import ShawRelative
    from jattn.score_mod import ScoreMod
    from jattn.visibility import Visibility

# name -> the module that defines it ("" after the module: the name is that module).
_LAZY = {
    "IMPLEMENTATIONS": "jattn.attention",
    "NormalForm": "jattn.attention.normal_form",
    "ScoreMod": "jattn.score_mod",
    "ShawRelative": "jattn.positions",
    "Visibility": "jattn.visibility",
    "attention_weights": "jattn.attention",
    "cope_attention": "jattn.attention.cope",
    "default_implementation": "jattn.attention",
    "dot_product_attention": "jattn.attention",
    "dropout": "",
    "flax_attention_fn": "jattn.flax_attention",
    "masks": "",
    "normalise": "jattn.attention.normal_form",
    "positions": "",
    "stick_breaking_attention": "jattn.attention.stick_breaking",
    "visibility": "",
}
# Modules reachable as attributes, as when this file imported them: the core's
# subpackages, and `jattn.decoding` = `jattn.models.decoding` (it needs flax, so
# it is not part of the core).
_MODULES = {
    "attention": "jattn.attention",
    "decoding": "jattn.models.decoding",
    "flax_attention": "jattn.flax_attention",
    "score_mod": "jattn.score_mod",
}

__all__ = [
    "IMPLEMENTATIONS",
    "NormalForm",
    "ScoreMod",
    "ShawRelative",
    "Visibility",
    "attention_weights",
    "cope_attention",
    "default_implementation",
    "dot_product_attention",
    "dropout",
    "flax_attention_fn",
    "masks",
    "normalise",
    "positions",
    "stick_breaking_attention",
    "visibility",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    """Imports a public name on first use and keeps it (see the module docstring)."""
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _LAZY:
        module = _LAZY[name]
        value = (
            importlib.import_module(f"jattn.{name}")
            if not module
            else getattr(importlib.import_module(module), name)
        )
    else:
        raise AttributeError(f"module 'jattn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))
