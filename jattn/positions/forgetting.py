"""The Forgetting Transformer's forget gate (Lin, Nikishin, He, Courville,
ICLR 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate").

Per token t and head n a gate `f_t = σ(w·x_t + b)` from the layer's input
`x_t`; logit (i, j) of a causal layer gains `Σ_{l=j+1..i} log f_l = c_i −
c_j`, with `c` the cumulative sum of `log f`. That is a row term plus a
column term, which attention reads per tile in O(T + S) memory
(`jattn.dot_product_attention(row_col_bias=(c, −c))`); the `[T, S]` decay
matrix is never built.

Packed rows: `c` is summed per segment (`segment_cumsum`) over that
segment's tokens alone, padding adding nothing, so `c_i − c_j` counts the
gates of the tokens of one example between j and i even where the row
interleaves examples (a decoder-only stream: inputs, then targets); the
values, and their float32 rounding, stay as small as the segment's. Pure functions; the component
that declares the parameters is `jattn.models.data_schemes.Forgetting`.

Shapes: B batch, T tokens, N heads, D the layer's width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = [
    "FORGET_BIAS_INIT",
    "forget_gate_param_specs",
    "forget_row_col",
    "log_forget_gates",
    "segment_cumsum",
]

# The gate bias's initial value: σ(b) = 1 - 1/e^b; b = 5 starts every gate
# at f ≈ 0.9933 (a decay per token of e^-0.0067: nearly no forgetting, the
# Transformer the paper starts from). An option of the scheme.
FORGET_BIAS_INIT = 5.0


def forget_gate_param_specs(d_model: int, num_heads: int, bias_init: float = FORGET_BIAS_INIT):
    """`(name, init, shape, logical axes)` of the gate: `w [D, N]`, `b [N]`.

    `w` starts small (normal, std `1/sqrt(D)` times 0.1) so the gates start
    near `σ(bias_init)` for every token and learn to depend on it.
    """
    init = jax.nn.initializers
    return (
        ("w", init.normal(0.1 / math.sqrt(d_model)), (d_model, num_heads), ("embed", "heads")),
        ("b", init.constant(bias_init), (num_heads,), ("heads",)),
    )


def log_forget_gates(params, x: Array) -> Array:
    """`log f = log σ(x·w + b)` `[B, T, N]` of `x [B, T, D]`, in float32 (float64
    for float64 inputs; `log_sigmoid`: finite and accurate where f is near 1)."""
    dt = jnp.promote_types(x.dtype, jnp.float32)
    w, b = params["w"].astype(dt), params["b"].astype(dt)
    logits = jnp.einsum("BTD,DN->BTN", x.astype(dt), w) + b[None, None]
    return jax.nn.log_sigmoid(logits)


def segment_cumsum(x: Array, segment_ids: Array | None) -> Array:
    """The cumulative sum of `x [B, T, N]` along T within each segment:
    `c_i = Σ x_l` over the tokens `l ≤ i` of token i's segment (`[B, T]`
    ids; None: one segment a row). Padding (segment 0) adds nothing.

    A segment need not be contiguous: a decoder-only stream holds every
    example's inputs, then every example's targets, so an example's
    targets follow the other examples' inputs (jattn.models.decoder_only).
    The sum is therefore taken in segment order: a stable sort by segment
    id makes each segment one run, the scan restarts where the id changes,
    and the inverse permutation puts the sums back, O(T) memory.
    """
    if segment_ids is None:
        return jnp.cumsum(x, axis=1)
    x = jnp.where((segment_ids != 0)[..., None], x, jnp.zeros_like(x))
    order = jnp.argsort(segment_ids, axis=1, stable=True)  # [B, T]
    ids = jnp.take_along_axis(segment_ids, order, axis=1)
    runs = jnp.take_along_axis(x, order[..., None], axis=1)  # [B, T, N], segment by segment
    start = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)[
        ..., None
    ]  # [B, T, 1]

    def combine(left, right):
        (a, ra), (b, rb) = left, right
        return jnp.where(rb, b, a + b), ra | rb

    sums = jax.lax.associative_scan(combine, (runs, jnp.broadcast_to(start, x.shape)), axis=1)[0]
    return jnp.take_along_axis(sums, jnp.argsort(order, axis=1)[..., None], axis=1)


def forget_row_col(c_q: Array, c_kv: Array) -> tuple[Array, Array]:
    """`row_col_bias` of the gate: `(c_q, −c_kv)` as `[B, N, T]`, `[B, N, S]`
    from the cumulative sums `[B, T, N]` of the queries' and keys' tokens."""
    return c_q.transpose(0, 2, 1), -c_kv.transpose(0, 2, 1)
