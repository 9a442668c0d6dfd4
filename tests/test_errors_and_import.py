"""Clear errors at the public boundary, and a core that imports with only
jax, numpy and chex."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jattn

q = jnp.zeros((2, 5, 4, 8))
k = jnp.zeros((2, 7, 2, 8))
v = jnp.zeros((2, 7, 2, 6))


@pytest.mark.parametrize(
    "kwargs, args, error, match",
    [
        ({}, (jnp.zeros((5, 4, 8)), k, v), ValueError, r"all have rank 4.*\[5, 4, 8\]"),
        (
            {},
            (q, jnp.zeros((2, 7, 3, 8)), jnp.zeros((2, 7, 3, 6))),
            ValueError,
            r"K=3 must divide query heads N=4",
        ),
        ({}, (q, jnp.zeros((2, 7, 2, 5)), v), ValueError, r"query head dim 8 != key head dim 5"),
        ({}, (q, k, jnp.zeros((2, 6, 2, 6))), ValueError, r"must match key .* in S and K"),
        ({}, (q, jnp.zeros((3, 7, 2, 8)), v), ValueError, r"batch sizes differ"),
        (
            {"q_segment_ids": jnp.ones((2, 5), jnp.int32)},
            (q, k, v),
            ValueError,
            r"kv_segment_ids is missing",
        ),
        (
            {
                "q_segment_ids": jnp.ones((2, 5), jnp.int32),
                "kv_segment_ids": jnp.ones((2, 6), jnp.int32),
            },
            (q, k, v),
            ValueError,
            r"kv_segment_ids must have shape \[B, S\]=\[2, 7\], got \[2, 6\]",
        ),
        (
            {"q_positions": jnp.zeros((2, 5), jnp.float32)},
            (q, k, v),
            TypeError,
            r"q_positions must be an integer array",
        ),
        (
            {"mask": jnp.ones((2, 4, 5, 7), jnp.float32)},
            (q, k, v),
            TypeError,
            r"mask must be boolean",
        ),
        (
            {"bias": jnp.zeros((2, 3, 5, 7))},
            (q, k, v),
            ValueError,
            r"bias of shape \[2, 3, 5, 7\] does not broadcast to \[B, N, T, S\]=\[2, 4, 5, 7\]",
        ),
        (
            {"relative": jattn.ShawRelative(key=jnp.zeros((4, 8)), max_distance=2)},
            (q, k, v),
            ValueError,
            r"ShawRelative.key must be \[2k\+1, H\]=\[5, 8\]",
        ),
        (
            {"relative": jattn.ShawRelative(value=jnp.zeros((3, 5, 6)), max_distance=2)},
            (q, k, v),
            ValueError,
            r"ShawRelative.value .* got \[3, 5, 6\]",
        ),
        ({"relative": "shaw"}, (q, k, v), TypeError, r"relative must be a jattn.ShawRelative"),
        ({"implementation": "cuda"}, (q, k, v), ValueError, r"unknown implementation 'cuda'"),
    ],
)
def test_bad_input_names_the_argument_and_shapes(kwargs, args, error, match):
    with pytest.raises(error, match=match):
        jattn.dot_product_attention(*args, **kwargs)


def test_one_dimensional_positions_broadcast_over_batch():
    out = jattn.dot_product_attention(
        q, k, v, q_positions=jnp.arange(5), kv_positions=jnp.arange(7), is_causal=True
    )
    ref = jattn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_core_imports_with_only_jax_numpy_chex():
    """Block every training-side package; `import jattn` and a call must work."""
    code = (
        "import sys\n"
        "for m in ['flax','optax','orbax','tensorflow_datasets','grain','ml_collections',"
        "'tensorflow','matplotlib','sentencepiece']:\n"
        "    sys.modules[m] = None\n"
        "import jax.numpy as jnp, jattn\n"
        "x = jnp.ones((1, 3, 2, 4))\n"
        "for impl in ('xla', 'chunked'):\n"
        "    out = jattn.dot_product_attention(x, x, x, is_causal=True, implementation=impl)\n"
        "    assert out.shape == (1, 3, 2, 4)\n"
        "print('core-ok')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert "core-ok" in res.stdout
