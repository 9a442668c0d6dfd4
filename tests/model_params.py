"""Random model parameters drawn on the host, for the model and decoding tests.

Compiling `model.init` costs seconds per scheme on the CPU (threefry for
every parameter); these tests need generic weights of the right structure,
so they fill the abstract parameter tree (`jattn.models.abstract_params`)
with numpy draws. `tests/test_models.py::test_real_init_matches_structure`
checks the real initialiser against the same structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn.models import TransformerConfig, abstract_params


def fill_params(config: TransformerConfig, seed: int, *, scale: float = 0.5, length: int = 8):
    """Parameters of `config`'s model: layer-norm gains `1 + 0.1 N(0, 1)`, every
    other leaf `scale * N(0, 1)` (0.5: logits far from ties, so greedy and
    beam choices are stable); `length` the positions a learned table holds."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        x = rng.normal(size=leaf.shape)
        if path[-1].key == "scale":
            return jnp.asarray(1.0 + 0.1 * x, leaf.dtype)
        return jnp.asarray(scale * x, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(config, length=length))
