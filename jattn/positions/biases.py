"""Relative terms as score mods (`jattn.ScoreMod`): ALiBi, T5 buckets,
Shaw's bias term, KERPLE, Sandwich and logit soft-capping. Each is a
function of one logit and its (query, key) positions, applied inside the
tiles of every implementation, so no `[B, N, T, S]` bias is ever built
(FIRE, an MLP per logit, is `jattn.positions.fire`).

Each `fn` is written for the Pallas kernels too: it indexes its parameters
only with `head` (a scalar per program in the kernels) or with small static
indices, reads a table at a computed bucket / distance (with a scalar
`head`) as a chain of compare-and-selects over the table's static axis
(`where(bucket == b, table[head, b], acc)`, never a gather with a tile of
indices; see `jattn.positions.tables.select_table`), and is otherwise
elementwise jnp math. In every fn below `i` is the query position and `j`
the key position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jattn.positions.tables import as_f32, select_table
from jattn.score_mod import ScoreMod, with_settings

Array = jax.Array

__all__ = [
    "ALIBI_MODES",
    "SANDWICH_DIM",
    "alibi_score_mod",
    "alibi_slopes",
    "kerple_score_mod",
    "sandwich_bias",
    "sandwich_score_mod",
    "shaw_bias_score_mod",
    "softcap_score_mod",
    "t5_relative_bucket",
    "t5_score_mod",
]


def alibi_slopes(num_heads: int) -> Array:
    """ALiBi head slopes (Press et al.): a geometric sequence from 2^(-8/n).

    For a head count that is not a power of two, the paper's recipe: the
    slopes of the closest lower power of two, then every other slope of the
    next power of two.

    Returns:
      float32 `[N]`.
    """

    def pow2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads <= 0:
        raise ValueError(f"alibi_slopes: num_heads must be positive, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = pow2(closest)
    if closest < num_heads:
        slopes += pow2(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


ALIBI_MODES = ("causal", "symmetric", "offset", "asymmetric")


# The distance-table mods below (`ScoreMod.from_distance`: T5, Shaw's bias,
# KERPLE, Sandwich) are functions of `(params, head, d)` with `d = j - i`
# (key minus query position): the xla and chunked paths read them from a
# table evaluated once per call, the Pallas kernels call them per logit
# (`jattn.attention.distance_table`). ALiBi stays per logit: one multiply
# per logit beat reading its table (fwd+bwd at L = 4096 on the CPU, 624 ms
# per logit against 837 ms from the table; docs/benchmarks.md).


def _alibi_causal(slopes, score, batch, head, i, j):
    return score - slopes[head] * (i - j).astype(jnp.float32)


def _alibi_symmetric(slopes, score, batch, head, i, j):
    return score - slopes[head] * jnp.abs(i - j).astype(jnp.float32)


def _alibi_offset(params, score, batch, head, i, j):
    d = jnp.abs(i - j).astype(jnp.float32)
    right = (j > i).astype(jnp.float32)
    return score - params["slopes"][head] * d - params["offset"][head] * right


def _alibi_asymmetric(params, score, batch, head, i, j):
    d = (i - j).astype(jnp.float32)
    left = params["left"][head] * jnp.maximum(d, 0.0)
    right = params["right"][head] * jnp.maximum(-d, 0.0)
    return score - left - right


def alibi_score_mod(slopes: Array, *, mode: str, offset=None, right_slopes=None):
    """ALiBi (Press et al. 2022, "Train Short, Test Long") as a score mod.

    With `i` the query and `j` the key position, `m = slopes[head]`:

    - `"causal"`: `score - m * (i - j)`, the paper's decoder form (keys after
      the query are hidden by the causal mask).
    - `"symmetric"`: `score - m * |i - j|`, jattn's encoder ALiBi so far.
      It cannot tell a key `d` to the left from one
      `d` to the right, so an encoder using it is blind to input order.
    - `"offset"`: `score - m * |i - j| - offset[head] * [j > i]`: the
      symmetric form plus a constant penalty on one triangle (keys after the
      query), which breaks the symmetry; the default `offset = slopes` makes
      a key to the right look one position further away than the same key to
      the left.
    - `"asymmetric"`: `score - m * max(i - j, 0) - right_slopes[head] *
      max(j - i, 0)`: separate slopes per direction.

    Triton-safe: parameters are indexed with `head` only; the rest is
    elementwise. Per logit, not a distance-table mod: one multiply per
    logit is cheaper than reading a table (docs/benchmarks.md).

    Args:
      slopes: float `[N]`, e.g. `alibi_slopes(N)`.
      mode: one of `ALIBI_MODES`.
      offset: float `[N]` for `"offset"` (default `slopes`).
      right_slopes: float `[N]` for `"asymmetric"` (required).

    Returns:
      a `jattn.ScoreMod`; its params are `slopes` (causal, symmetric),
      `{"slopes", "offset"}` or `{"left", "right"}`.
    """

    slopes = as_f32(slopes)
    if mode == "causal":
        return ScoreMod(_alibi_causal, slopes, "alibi_causal")
    if mode == "symmetric":
        return ScoreMod(_alibi_symmetric, slopes, "alibi_symmetric")
    if mode == "offset":
        offset = slopes if offset is None else as_f32(offset)
        return ScoreMod(_alibi_offset, {"slopes": slopes, "offset": offset}, "alibi_offset")
    if mode == "asymmetric":
        if right_slopes is None:
            raise ValueError("alibi_score_mod: mode 'asymmetric' needs right_slopes [N]")
        params = {"left": slopes, "right": as_f32(right_slopes)}
        return ScoreMod(_alibi_asymmetric, params, "alibi_asymmetric")
    raise ValueError(f"alibi_score_mod: mode must be one of {ALIBI_MODES}, got {mode!r}")


def t5_relative_bucket(
    relative: Array, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> Array:
    """T5's log bucket (Raffel et al.) of `relative = kv_pos - q_pos`.

    Half the buckets (per direction when bidirectional) hold exact small
    distances; the rest grow logarithmically up to `max_distance`, beyond
    which everything shares the last bucket. Elementwise on any integer
    array, so it runs inside a tile.

    Returns:
      int32 array of `relative`'s shape in `[0, num_buckets)`.
    """
    rel = jnp.asarray(relative).astype(jnp.int32)
    n = num_buckets
    ret = jnp.zeros_like(rel)
    if bidirectional:
        n //= 2
        ret = ret + (rel > 0).astype(jnp.int32) * n
        dist = jnp.abs(rel)
    else:
        dist = jnp.maximum(-rel, 0)
    max_exact = n // 2
    is_small = dist < max_exact
    safe = jnp.maximum(dist, 1).astype(jnp.float32)
    large = max_exact + (
        jnp.log(safe / max_exact) / math.log(max_distance / max_exact) * (n - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, n - 1)
    return ret + jnp.where(is_small, dist, large)


def t5_score_mod(table: Array, *, max_distance: int = 128, bidirectional: bool = True):
    """T5's bucketed relative bias (Raffel et al. 2020) as a score mod.

    `score + table[head, bucket(j - i)]` with `bucket = t5_relative_bucket`
    (log-spaced buckets, `num_buckets = table.shape[1]`).

    Triton-safe: with a scalar `head` (the kernels) the table is read as a
    compare-and-select chain over its static bucket axis, indexed by `head`
    and static bucket numbers; with an array `head` (xla, chunked) as a
    gather of the same values. A distance-table mod clipped at
    `max_distance` (`ScoreMod.from_distance`).

    Args:
      table: float `[N, num_buckets]` (heads first).
      max_distance: distance at which buckets saturate.
      bidirectional: separate buckets for keys after the query (encoders);
        False for causal self-attention.

    Returns:
      a `jattn.ScoreMod` with params `table`.
    """

    settings = dict(
        num_buckets=int(jnp.shape(table)[1]),
        max_distance=int(max_distance),
        bidirectional=bool(bidirectional),
    )
    fn = with_settings(_t5, **settings)
    return ScoreMod.from_distance(fn, table, name="t5", max_distance=settings["max_distance"])


def _t5(tab, head, d, *, num_buckets, max_distance, bidirectional):
    # Buckets saturate at max_distance on both sides: the table clips there.
    return select_table(tab, head, t5_relative_bucket(d, num_buckets, max_distance, bidirectional))


def shaw_bias_score_mod(table: Array, max_distance: int):
    """Shaw's bias term ("rel-b", Shaw et al. 2018; Ontañón et al. 2022) as a
    score mod: `score + table[head, clip(j - i, -k, k) + k]`, the learned
    scalar per head and clipped distance (equal to adding `table[:, r]`).

    Triton-safe: with a scalar `head`, a compare-and-select chain over the
    `2k + 1` static ids (a gather of the same values for an array `head`).
    A distance-table mod clipped at k (`ScoreMod.from_distance`).

    Args:
      table: float `[N, 2k+1]`.
      max_distance: the clip distance k.

    Returns:
      a `jattn.ScoreMod` with params `table`.
    """

    k = int(max_distance)
    if jnp.shape(table)[-1] != 2 * k + 1:
        raise ValueError(
            f"shaw_bias_score_mod: table must be [N, 2k+1] = [N, {2 * k + 1}], "
            f"got {list(jnp.shape(table))}"
        )

    return ScoreMod.from_distance(
        with_settings(_shaw_bias, k=k), table, name="shaw_bias", max_distance=k
    )


def _shaw_bias(tab, head, d, *, k):
    return select_table(tab, head, jnp.clip(d, -k, k) + k)


def kerple_score_mod(r1: Array, r2: Array):
    """KERPLE, logarithmic variant (Chi et al. 2022, "KERPLE: Kernelized
    Relative Positional Embedding for Length Extrapolation"):
    `score - r1[head] * log(1 + r2[head] * |i - j|)`, with `r1, r2 > 0`.

    The paper keeps r1, r2 positive by clamping after each optimiser step;
    this function uses them as given (pass positive values).

    Triton-safe: indexed with `head` only, elementwise log. A distance-table
    mod (`ScoreMod.from_distance`).

    Args:
      r1, r2: float `[N]`, positive.

    Returns:
      a `jattn.ScoreMod` with params `{"r1": r1, "r2": r2}`.
    """

    params = {"r1": as_f32(r1), "r2": as_f32(r2)}
    return ScoreMod.from_distance(_kerple, params, name="kerple_log")


def _kerple(params, head, d):
    x = jnp.abs(d).astype(jnp.float32)
    return -params["r1"][head] * jnp.log1p(params["r2"][head] * x)


SANDWICH_DIM = 128


def sandwich_bias(distance: Array, num_heads: int, dim: int = SANDWICH_DIM) -> Array:
    """Sandwich's bias (Chi et al. 2023, "Dissecting Transformer Length
    Extrapolation via the Lens of Receptive Field Analysis") at int
    `distance` (`i - j` or `j - i`: it is even), per head: `[N, *distance.shape]`.

    The inner product of the sinusoidal embeddings (`sinusoidal`, dim `d`)
    of the two positions, `PE(i)·PE(j) = Σ_{k<d/2} cos((i - j) /
    10000^(2k/d))`, a function of `i - j` alone (parameter-free), shifted by
    `-d/2` (0 at distance 0, negative elsewhere; a constant, which softmax
    ignores) and divided per head by ALiBi's ratio `8h/N`, h = 1..N, so each
    head sees a differently compressed copy (the paper's head-specific
    scaling, as ALiBi's slopes `2^(-8h/N)`).
    """
    x = jnp.asarray(distance).astype(jnp.float32)
    inv = _sandwich_scales(num_heads).reshape((num_heads,) + (1,) * x.ndim)
    return _sandwich_sum(x, dim)[None] * inv


def _sandwich_scales(num_heads: int) -> Array:
    """The per-head scales `N / (8h)`, h = 1..N: float32 `[N]`."""
    return jnp.asarray(num_heads / (8.0 * np.arange(1, num_heads + 1)), jnp.float32)


def _sandwich_sum(x: Array, dim: int) -> Array:
    """`Σ_{k<d/2} cos(x / 10000^(2k/d)) - d/2` of float32 distances `x`."""
    acc = jnp.zeros_like(x)
    for k in range(dim // 2):  # d/2 cosines; constants, so the kernels lower it
        acc = acc + jnp.cos(x * float(10_000.0 ** (-2.0 * k / dim)))
    return acc - dim / 2


def _sandwich(inv_scale, head, d, *, dim):
    return _sandwich_sum(d.astype(jnp.float32), dim) * inv_scale[head]


def sandwich_score_mod(num_heads: int, dim: int = SANDWICH_DIM):
    """Sandwich (Chi et al. 2023) as a distance-table score mod:
    `score + sandwich_bias(j - i)[head]`.

    Its `dim / 2` cosines per logit are why it is a distance-table mod: the
    xla and chunked paths evaluate them once per call on the `T + S - 1`
    distances (an `[N, T + S - 1]` table) instead of on every logit.

    Args:
      num_heads: N (the per-head scales `N / (8h)`, h = 1..N).
      dim: the sinusoid's dimension d (d / 2 frequencies; the paper's 128).

    Returns:
      a `jattn.ScoreMod` with params the float32 per-head scales `[N]`
      (constants of the scheme, not learned).
    """
    dim = int(dim)
    if dim < 2 or dim % 2:
        raise ValueError(f"sandwich_score_mod: dim must be even and >= 2, got {dim}")
    return ScoreMod.from_distance(
        with_settings(_sandwich, dim=dim), _sandwich_scales(num_heads), name="sandwich"
    )


def _softcap(cap, score, batch, head, i, j):
    return jnp.tanh(score / cap) * cap


def softcap_score_mod(cap: float):
    """Logit soft-capping (Gemma 2, Team Gemma 2024): `tanh(score / cap) * cap`,
    which bounds the logits to `(-cap, cap)` smoothly. Triton-safe (elementwise).

    Args:
      cap: positive float (Gemma 2 uses 50 for attention logits); a param
        leaf, so it is traced (pass `jax.lax.stop_gradient` to freeze it).

    Returns:
      a `jattn.ScoreMod` with params the float32 scalar `cap`.
    """

    return ScoreMod(_softcap, as_f32(cap), "softcap")
