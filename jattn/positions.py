"""Positional schemes as pure functions.

Absolute schemes produce vectors added to embeddings (`sinusoidal`); rotary
embeddings rotate queries and keys (`rope`, its scalings `rope_frequencies`,
and the decaying `xpos`); relative schemes produce either
tables read inside attention (`ShawRelative`, `relative_ids`) or score mods (`jattn.ScoreMod`:
ALiBi, T5 buckets, Shaw's bias term, FIRE, KERPLE, Sandwich, soft-capping) applied inside
the attention tiles. Every function takes explicit
integer positions so packed rows (positions restarting at each segment) and
cached decoding (positions offset into the cache) work the same way as plain
`arange` positions.

Shapes: B batch, T query length, S key length, N query heads, H head dim,
R = 2k + 1 relative distances for Shaw with clip distance k.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jattn.score_mod import ScoreMod, TileParts, with_settings, with_tile_parts

Array = jax.Array

__all__ = [
    "transformer_xl_tables",
    "ALIBI_MODES",
    "ShawRelative",
    "alibi_score_mod",
    "alibi_slopes",
    "fire_score_mod",
    "init_fire_params",
    "kerple_score_mod",
    "relative_ids",
    "ROPE_SCALINGS",
    "sandwich_bias",
    "sandwich_score_mod",
    "YARN_CONVENTIONS",
    "YarnOptions",
    "rope",
    "rope_frequencies",
    "shaw_bias_score_mod",
    "sinusoidal",
    "softcap_score_mod",
    "t5_relative_bucket",
    "t5_score_mod",
    "xpos",
    "xpos_max_span",
    "xpos_reference",
]


def sinusoidal(positions: Array, dim: int, max_timescale: float = 10_000.0) -> Array:
    """The paper's sinusoidal encoding, interleaved sin/cos.

    `PE[p, 2i] = sin(p / max_timescale^(2i/dim))`,
    `PE[p, 2i+1] = cos(p / max_timescale^(2i/dim))` (Vaswani et al., 3.5).

    Args:
      positions: integer or float array `[...]` of positions.
      dim: encoding width; must be even.
      max_timescale: the paper's 10000.

    Returns:
      float32 array `[..., dim]`.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal: dim must be even, got {dim}")
    positions = jnp.asarray(positions, jnp.float32)
    i = np.arange(dim // 2, dtype=np.float64)
    inv_freq = jnp.asarray(max_timescale ** (-2.0 * i / dim), jnp.float32)  # [dim/2]
    angles = positions[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))  # [..., dim/2]
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., dim/2, 2]
    return pe.reshape(*positions.shape, dim)


def relative_ids(q_positions: Array, kv_positions: Array, max_distance: int) -> Array:
    """Clipped relative distance ids of Shaw et al.: `clip(kv - q, -k, k) + k`.

    Args:
      q_positions: int `[..., T]`.
      kv_positions: int `[..., S]`.
      max_distance: the clip distance k >= 0.

    Returns:
      int32 `[..., T, S]` with values in `[0, 2k]`.
    """
    if max_distance < 0:
        raise ValueError(f"relative_ids: max_distance must be >= 0, got {max_distance}")
    q = jnp.asarray(q_positions, jnp.int32)
    kv = jnp.asarray(kv_positions, jnp.int32)
    d = kv[..., None, :] - q[..., :, None]  # [..., T, S]
    return jnp.clip(d, -max_distance, max_distance) + max_distance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShawRelative:
    """Shaw et al. (2018) relative position tables for one attention call.

    With `r = clip(kv_pos - q_pos, -k, k) + k`, attention computes
    `logit[t,s] = scale * (q_t·k_s + q_t·key[r]) + bias[t,s]` and
    `out_t = Σ_s w[t,s] * (v_s + value[r])`.

    Attributes:
      key: `[2k+1, H]` (shared by all heads, as in the paper) or
        `[N, 2k+1, H]` (per head), or None for no key term.
      value: `[2k+1, Hv]` or `[N, 2k+1, Hv]`, or None for no value term.
      max_distance: the clip distance k (static).
    """

    key: Array | None = None
    value: Array | None = None
    max_distance: int = dataclasses.field(default=16, metadata=dict(static=True))

    @property
    def num_relative(self) -> int:
        return 2 * self.max_distance + 1


def rope(
    x: Array,
    positions: Array,
    max_timescale: float = 10_000.0,
    fraction: float = 1.0,
    *,
    scaling: str = "none",
    scaling_factor: float = 1.0,
    original_length: int | None = None,
    yarn: YarnOptions | None = None,
) -> Array:
    """Rotary position embedding (Su et al.), rotate-half convention.

    The first `fraction * H` features are rotated in pairs `(i, i + H'/2)` by
    angle `p * inv_freq[i]`, `inv_freq[i] = max_timescale^(-2i/H')`; the rest
    pass through. Applied to queries and keys, the logit `q_t·k_s` depends
    on positions only through `s - t`. `scaling` stretches a trained RoPE to
    longer inputs at evaluation (see `rope_frequencies`).

    Args:
      x: `[B, T, N, H]` queries or keys.
      positions: int `[B, T]`.
      max_timescale: base wavelength.
      fraction: share of the head dim that is rotated (rounded to even).
      scaling: one of `ROPE_SCALINGS` ("none" is Su et al.'s RoPE).
      scaling_factor: the context extension s >= 1 of "pi", "ntk", "yarn".
      original_length: the training length "yarn" keeps the short
        wavelengths of (required for "yarn").
      yarn: YaRN's convention and parameters (None: `YarnOptions()`, the
        paper's ramp).

    Returns:
      `[B, T, N, H]`, dtype of `x`.
    """
    h = x.shape[-1]
    rot = int(h * fraction) // 2 * 2
    if rot == 0:
        return x
    inv_freq, magnitude = rope_frequencies(
        rot,
        max_timescale,
        scaling=scaling,
        factor=scaling_factor,
        original_length=original_length,
        yarn=yarn,
    )
    return _rotate_half(x, positions, inv_freq, rot, magnitude)


def _rotate_half(x: Array, positions: Array, inv_freq, rot: int, magnitude=None) -> Array:
    """Rotate the first `rot` features of `x` `[B, T, N, H]` by `positions * inv_freq`,
    then multiply the rotated pairs by `magnitude` (None, a float, or float32
    `[B, T, rot/2]`)."""
    half = rot // 2
    positions = jnp.asarray(positions, jnp.float32)
    inv_freq = jnp.asarray(inv_freq, jnp.float32).reshape((1,) * positions.ndim + (-1,))
    angles = positions[..., None] * inv_freq  # [B, T, H'/2]
    sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, H'/2]
    cos = jnp.cos(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:rot], xf[..., rot:]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # [B, T, N, H'/2] each
    if magnitude is not None:
        m = jnp.asarray(magnitude, jnp.float32)
        m = m[:, :, None, :] if m.ndim == 3 else m  # [B, T, 1, H'/2] or scalar
        y1, y2 = y1 * m, y2 * m
    out = jnp.concatenate([y1, y2, rest], axis=-1)
    return out.astype(x.dtype)


# RoPE's extensions to longer inputs than training showed (`rope_frequencies`).
ROPE_SCALINGS = ("none", "pi", "ntk", "yarn")

# Where YaRN's ramp between kept and interpolated frequencies runs (`YarnOptions`).
YARN_CONVENTIONS = ("paper", "hf")


@dataclasses.dataclass(frozen=True)
class YarnOptions:
    """How YaRN (`rope_frequencies(scaling="yarn")`) blends each pair's kept
    frequency `θ_i` with its interpolated one `θ_i / s`.

    Both conventions measure a pair by `r_i = L θ_i / 2π`, the turns it makes
    over the training length L: pairs turning more than `beta_fast` times
    keep `θ_i`, pairs turning fewer than `beta_slow` times get `θ_i / s`, and
    a linear ramp blends the band between. They differ in what the ramp is
    linear in:

    - "paper" (Peng et al. 2023, "YaRN", eq. 17-18; the default): linear in
      `r_i` itself, `keep_i = clip((r_i - beta_slow) / (beta_fast -
      beta_slow), 0, 1)`.
    - "hf" (Hugging Face transformers' `rope_type="yarn"`, and the YaRN
      reference code it follows): linear in the pair index `i`, between the
      (fractional) indices where `r_i = beta_fast` and `r_i = beta_slow`,
      rounded outwards to whole pairs (floor, ceil). Since `r_i` falls
      exponentially in `i`, the two ramps differ inside the band (at rot 64,
      L 2048, s 4 HF's frequency is up to 1.8 times the paper's, at pair 15
      of 32: 0.60 θ against 0.33 θ); outside it they agree.

    The attention factor (both conventions): queries and keys multiplied by
    `m(s, mscale) / m(s, mscale_all_dim)` where both are nonzero (DeepSeek's
    form, as HF reads it), else by the paper's `m(s, 1) = 0.1 ln s + 1`;
    `m(s, c) = 0.1 c ln s + 1`.

    Attributes:
      convention: one of `YARN_CONVENTIONS`.
      beta_fast: turns above which a pair keeps its frequency (the paper's β, 32).
      beta_slow: turns below which a pair is interpolated (the paper's α, 1).
      mscale, mscale_all_dim: HF's attention-factor options (0: unset).
    """

    convention: str = "paper"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.convention not in YARN_CONVENTIONS:
            raise ValueError(
                f"yarn: convention={self.convention!r}; choose one of {YARN_CONVENTIONS}"
            )
        if not 0.0 < float(self.beta_slow) < float(self.beta_fast):
            raise ValueError(
                f"yarn: need 0 < beta_slow < beta_fast, got beta_slow={self.beta_slow!r}, "
                f"beta_fast={self.beta_fast!r}"
            )
        if not (float(self.mscale) >= 0.0 and float(self.mscale_all_dim) >= 0.0):
            raise ValueError(
                f"yarn: mscale and mscale_all_dim must be >= 0, got {self.mscale!r}, "
                f"{self.mscale_all_dim!r}"
            )

    def attention_factor(self, factor: float) -> float:
        """The magnitude YaRN multiplies queries and keys by at extension `factor`."""

        def m(c: float) -> float:
            return 1.0 if factor <= 1.0 else 0.1 * c * math.log(factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return m(self.mscale) / m(self.mscale_all_dim)
        return m(1.0)

    def keep(self, inv_freq: np.ndarray, rot: int, max_timescale: float, length: int):
        """`keep_i` in [0, 1] per pair `[rot/2]` (1: `θ_i` kept, 0: `θ_i / s`)."""
        lo, hi = float(self.beta_slow), float(self.beta_fast)
        if self.convention == "paper":
            turns = length * inv_freq / (2 * math.pi)  # r_i
            return np.clip((turns - lo) / (hi - lo), 0.0, 1.0)

        def index(turns: float) -> float:  # solves r_i = turns for i
            return rot * math.log(length / (2 * math.pi * turns)) / (2 * math.log(max_timescale))

        first = max(math.floor(index(hi)), 0)  # last pair kept whole
        last = min(math.ceil(index(lo)), rot - 1)  # first pair interpolated whole
        width = (last - first) or 1e-3  # HF's guard against a zero-width band
        pairs = np.arange(rot // 2, dtype=np.float64)
        return 1.0 - np.clip((pairs - first) / width, 0.0, 1.0)


def rope_frequencies(
    rot: int,
    max_timescale: float = 10_000.0,
    *,
    scaling: str = "none",
    factor: float = 1.0,
    original_length: int | None = None,
    yarn: YarnOptions | None = None,
) -> tuple[np.ndarray, float | None]:
    """RoPE's inverse frequencies `[rot/2]` and the magnitude of the rotated
    features, for a scaling that extends a trained RoPE by `factor` = s.

    - "none": `inv_freq[i] = b^(-2i/rot)` (Su et al.).
    - "pi": position interpolation (Chen et al. 2023): every frequency / s,
      i.e. positions squeezed into the trained range.
    - "ntk": NTK-aware scaling (bloc97, 2023): base `b * s^(rot/(rot-2))`, so
      the highest frequency is unchanged and the lowest is divided by s.
    - "yarn": Peng et al. 2023: per frequency, wavelengths longer than the
      training length L / beta_slow are interpolated (/ s), those shorter
      than L / beta_fast kept, a linear ramp between (in the paper's or
      Hugging Face's convention, `YarnOptions`); queries and keys are
      multiplied by the attention factor (`0.1 ln s + 1` by default).

    Returns:
      (float64 numpy `[rot/2]`, None or the float magnitude).
    """
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope: scaling={scaling!r}; choose one of {ROPE_SCALINGS}")
    if scaling != "none" and not factor >= 1.0:
        raise ValueError(f"rope: scaling_factor must be >= 1, got {factor!r}")
    half = rot // 2
    exponent = np.arange(half, dtype=np.float64) * 2.0 / rot
    if scaling == "ntk" and rot > 2:
        max_timescale = max_timescale * factor ** (rot / (rot - 2))
    inv_freq = max_timescale ** (-exponent)
    if scaling == "pi":
        return inv_freq / factor, None
    if scaling != "yarn":
        return inv_freq, None
    if not original_length or original_length < 1:
        raise ValueError(f"rope: yarn needs original_length >= 1, got {original_length!r}")
    yarn = YarnOptions() if yarn is None else yarn
    keep = yarn.keep(inv_freq, rot, max_timescale, original_length)  # [rot/2], 1: unchanged
    inv_freq = (1.0 - keep) * inv_freq / factor + keep * inv_freq
    return inv_freq, yarn.attention_factor(factor)


# xPos's decay rates: pair i of a rotation of `rot` features decays as zeta_i^distance.
def _xpos_zeta(rot: int) -> np.ndarray:
    return (np.arange(rot // 2, dtype=np.float64) * 2.0 / rot + 0.4) / 1.4  # [rot/2] in [0.29, 1)


# The largest |exponent| of the decay a logit may carry (`xpos_max_span`):
# e^80 ~ 5.5e34 leaves float32 (3.4e38) a margin of 6e3 for |q·k|, and the
# query's and key's own factors stay within e^±40 of 1 about the row's centre.
_XPOS_MAX_EXPONENT = 80.0


def xpos(
    x: Array,
    positions: Array,
    *,
    key: bool,
    reference: Array | None = None,
    max_timescale: float = 10_000.0,
    scale_base: float = 512.0,
) -> Array:
    """xPos (Sun et al. 2022): RoPE whose rotated pairs decay with distance.

    Pair i of a query at position n is multiplied by `zeta_i^(n/scale_base)`,
    of a key at m by `zeta_i^(-m/scale_base)`, `zeta_i = (2i/H + 0.4) / 1.4`,
    so the logit carries `zeta_i^((n - m)/scale_base)`: shift invariant, and
    (for keys behind the query, as in causal attention) smaller the further
    back the key is, the faster the higher the frequency.

    The factors themselves are not shift invariant: at absolute positions in
    float32 the query's underflows and the key's overflows from n ~ 36k
    (`zeta_0^(n/512)` < 1e-38 at scale_base 512; the logit reads NaN). So
    positions are measured from `reference`, a position per row shared by
    every query and key that meet in a logit: `n - r` and `m - r` replace n
    and m in the angles and the factors, which changes nothing in `q·k`
    (the rotation and the decay depend on `n - m` only) and keeps both
    finite and exact at any absolute position, for rows spanning up to
    `xpos_max_span` positions (`xpos_reference`: the row's centre).

    Args:
      x: `[B, T, N, H]` queries (`key=False`) or keys (`key=True`); H even.
      positions: int `[B, T]`.
      key: scale as keys (`zeta^-m`) rather than queries (`zeta^n`).
      reference: int `[B, 1]` (or broadcastable to `positions`), the same
        for the queries and the keys of a logit; None: 0 (the paper's
        absolute form, finite below ~36k only).
      max_timescale: RoPE's base wavelength.
      scale_base: the decay's length scale (the paper's 512).

    Returns:
      `[B, T, N, H]`, dtype of `x`.
    """
    rot = x.shape[-1] // 2 * 2
    if rot == 0:
        return x
    inv_freq, _ = rope_frequencies(rot, max_timescale)
    positions = jnp.asarray(positions)
    if reference is not None:  # exact in integers, before any rounding
        positions = positions - jnp.asarray(reference, positions.dtype)
    positions = positions.astype(jnp.float32)
    power = positions[..., None] / scale_base  # [B, T, 1]
    if key:
        power = -power
    log_zeta = jnp.asarray(np.log(_xpos_zeta(rot)), jnp.float32)
    magnitude = jnp.exp(power * log_zeta.reshape((1,) * positions.ndim + (-1,)))  # [B, T, H/2]
    return _rotate_half(x, positions, inv_freq, rot, magnitude)


def xpos_reference(*positions: Array) -> Array:
    """The reference `xpos` measures a row from: the centre `(lo + hi) // 2`
    of the lowest and highest position in the row across `positions`.

    The centre, not the first position, halves the largest factor: a row
    spanning D positions puts every query and key within D/2 of it.

    Args:
      positions: int arrays `[B, ...]` (e.g. the queries' `[B, T]` and the
        keys' `[B, S]`), one row per batch row.

    Returns:
      int32 `[B, 1]`.
    """
    rows = [jnp.asarray(p, jnp.int32).reshape(p.shape[0], -1) for p in positions]  # [B, *]
    lo = functools.reduce(jnp.minimum, [r.min(axis=1) for r in rows])  # [B]
    hi = functools.reduce(jnp.maximum, [r.max(axis=1) for r in rows])
    return (lo + (hi - lo) // 2)[:, None]


def xpos_max_span(scale_base: float = 512.0) -> int:
    """The widest row (highest minus lowest position) whose every xPos logit
    stays finite and exact in float32: 32,695 at the paper's scale_base 512.

    A key D positions ahead of its query multiplies their logit by
    `zeta_0^(-D/scale_base)` (xPos grows to the right): the formula's own
    size, whatever the factorisation, bounded here by e^80. Causal layers
    compute these logits too before masking them, so the bound is the same
    for them. Within it, `xpos_reference`'s centre keeps every query's and
    key's factor within e^±40 of 1, far from float32's subnormals.
    """
    return int(_XPOS_MAX_EXPONENT * scale_base / -math.log(_xpos_zeta(2)[0]))


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


# --- score mods -------------------------------------------------------------------
#
# Relative terms as `jattn.ScoreMod`s: functions of one logit and its (query,
# key) positions, applied inside the tiles of every implementation, so no
# `[B, N, T, S]` bias is ever built. Each `fn` is written for the Pallas
# kernels too: it indexes its parameters only with `head` (a scalar per
# program in the kernels) or with small static indices, reads a table at a
# computed bucket / distance (with a scalar `head`) as a chain of
# compare-and-selects over the table's static axis (`where(bucket == b,
# table[head, b], acc)`, never a gather with a tile of indices; see
# `_select_table`), and is otherwise elementwise jnp math. In every fn below
# `i` is the query position and `j` the key position.


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def _select_table(table: Array, head: Array, index: Array) -> Array:
    """`table[head, index]` for a table `[N, R]`, exactly (one value is
    selected, nothing summed), in the form each implementation can run.

    A scalar `head` (a Pallas program: one head per program) reads the table
    as a chain of compare-and-selects over its static axis, `where(index ==
    b, table[head, b], acc)`, which Triton and Mosaic lower (no gather with
    a tile of indices). An index array `head` (the xla and chunked paths,
    all heads of a tile at once) uses XLA's gather: the same values, and on
    the CPU the chain's autodiff would carry R tile-sized masked copies of
    the cotangent (measured: 2x the time and 4x the temporaries of the
    gather at L = 1024, `benchmarks/score_mod.py`).
    """
    if jnp.ndim(head) == 0:
        out = table[head, 0]
        for b in range(1, table.shape[1]):
            out = jnp.where(index == b, table[head, b], out)
        return out
    return _gather_table(table, head, index)


@jax.custom_vjp
def _gather_table(table: Array, head: Array, index: Array) -> Array:
    """`table[head, index]` by gather, for index arrays `head` and `index`
    that broadcast together (xla, chunked), with a backward that scatters
    rows (`_gather_table_bwd`)."""
    return table[head, index]


def _gather_table_fwd(table, head, index):
    return _gather_table(table, head, index), (table, head, index)


def _gather_table_bwd(res, ct):
    """The table's gradient as one scatter-add of rows: the cotangent laid out
    as `[X, heads]` (X: the entries `index` varies over) added into a
    `[R, heads]` buffer at `index`, one update of all heads per entry. The
    autodiff of the gather scatters every element on its own (2-index
    scatter, one update per head and entry), which on the CPU was most of
    the T5 score mod's time: 52 ms against ~9 ms for this form on a 512 x
    512 tile of 8 heads (`benchmarks/score_mod.py`, docs/benchmarks.md)."""
    table, head, index = res
    laid = _heads_and_positions(ct, head, index, heads_first=False)
    if laid is None:  # no [X, heads] layout
        _, pull = jax.vjp(lambda tb: tb[head, index], table)
        return pull(ct)[0], None, None
    ctm, heads, at = laid  # [X, heads], [heads], [X]
    rows = jnp.zeros((table.shape[1], ctm.shape[1]), ct.dtype).at[at].add(ctm)  # [R, heads]
    d_table = jnp.zeros(table.shape, ct.dtype).at[heads].add(rows.T)  # [N, R]
    return d_table.astype(table.dtype), None, None


def _heads_and_positions(ct: Array, head: Array, position: Array, *, heads_first: bool):
    """A score mod tile's cotangent `ct` as a `[heads, X]` (or `[X, heads]`)
    matrix, with the head index of each row and the position argument of
    each column, for the custom backwards of the table read and FIRE.

    `head` and `position` broadcast against `ct` along their own axes; None
    when they share an axis or `ct` varies along another (no such layout:
    the caller falls back to autodiff)."""
    nd = ct.ndim
    hr = jnp.reshape(head, (1,) * (nd - jnp.ndim(head)) + jnp.shape(head))
    xr = jnp.reshape(position, (1,) * (nd - jnp.ndim(position)) + jnp.shape(position))
    hv = [a for a in range(nd) if hr.shape[a] > 1]
    xv = [a for a in range(nd) if xr.shape[a] > 1]
    rest = [a for a in range(nd) if a not in hv and a not in xv]
    if set(hv) & set(xv) or any(ct.shape[a] > 1 for a in rest):
        return None
    order = (hv + xv if heads_first else xv + hv) + rest
    nh = int(np.prod([ct.shape[a] for a in hv], dtype=np.int64))

    def lay_out(v, varying):  # broadcast over its varying axes, in `order`, flattened
        full = [ct.shape[a] if a in varying else 1 for a in range(nd)]
        return jnp.transpose(jnp.broadcast_to(v, full), order).reshape(-1)

    ctm = jnp.transpose(ct, order).reshape((nh, -1) if heads_first else (-1, nh))
    return ctm, lay_out(hr, hv), lay_out(xr, xv)


_gather_table.defvjp(_gather_table_fwd, _gather_table_bwd)


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

    slopes = _f32(slopes)
    if mode == "causal":
        return ScoreMod(_alibi_causal, slopes, "alibi_causal")
    if mode == "symmetric":
        return ScoreMod(_alibi_symmetric, slopes, "alibi_symmetric")
    if mode == "offset":
        offset = slopes if offset is None else _f32(offset)
        return ScoreMod(_alibi_offset, {"slopes": slopes, "offset": offset}, "alibi_offset")
    if mode == "asymmetric":
        if right_slopes is None:
            raise ValueError("alibi_score_mod: mode 'asymmetric' needs right_slopes [N]")
        params = {"left": slopes, "right": _f32(right_slopes)}
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
    return _select_table(tab, head, t5_relative_bucket(d, num_buckets, max_distance, bidirectional))


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
    return _select_table(tab, head, jnp.clip(d, -k, k) + k)


def transformer_xl_tables(
    w_r: Array, u: Array, v: Array, max_distance: int, scale: float
) -> tuple[Array, Array]:
    """Dai et al.'s (Transformer-XL) relative attention as Shaw's per-head key
    table plus a per-head distance bias.

    Their logit of query i and key j is `(q_i + u)·k_j + (q_i + v)·W_R R(i - j)`
    (times `scale`), with R the sinusoidal embedding of the distance and
    per-head u, v `[N, H]`, W_R `[D, N, H]`. Splitting
    `(q + v)·W_R R = (q + u)·W_R R + (v - u)·W_R R`, attention over the
    queries `q + u` with Shaw's key table `W_R R(i - j)` `[N, 2k+1, H]`
    gives the first two terms, and the last, a function of (head, distance)
    alone, is a Shaw bias table `[N, 2k+1]` (already scaled, as score mods
    act on scaled logits). The tables are O(k); attention's Shaw term then
    costs O(T·k) a head, linear in L for a fixed clip k (with k ~ L, as the
    scheme's default clip, it is O(L^2) like the logits themselves).

    Distances are clipped at k (Shaw's id `r = clip(j - i, -k, k) + k`, so
    `i - j = k - r`).

    Args:
      w_r: `[D, N, H]`, the projection of the relative embedding.
      u, v: `[N, H]`, the content and position biases.
      max_distance: the clip distance k.
      scale: the logits' scale (`1/sqrt(H)`).

    Returns:
      float32 `(key_table [N, 2k+1, H], bias_table [N, 2k+1])`.
    """
    k = int(max_distance)
    d = w_r.shape[0]
    w_r, u, v = _f32(w_r), _f32(u), _f32(v)
    distances = k - jnp.arange(2 * k + 1)  # [R]: i - j of relative id r
    rel = sinusoidal(distances, d)  # [R, D]
    key_table = jnp.einsum("RD,DNH->NRH", rel, w_r)  # [N, R, H]
    bias = scale * jnp.einsum("NH,NRH->NR", v - u, key_table)  # [N, R]
    return key_table, bias


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

    params = {"r1": _f32(r1), "r2": _f32(r2)}
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
    acc = jnp.zeros_like(x)
    for k in range(dim // 2):
        acc = acc + jnp.cos(x * float(10_000.0 ** (-2.0 * k / dim)))
    inv = num_heads / (8.0 * np.arange(1, num_heads + 1))  # [N]
    inv = jnp.asarray(inv, jnp.float32).reshape((num_heads,) + (1,) * x.ndim)
    return (acc - dim / 2)[None] * inv


def _sandwich(inv_scale, head, d, *, dim):
    x = d.astype(jnp.float32)
    acc = jnp.zeros_like(x)
    for k in range(dim // 2):  # d/2 cosines; constants, so the kernels lower it
        acc = acc + jnp.cos(x * float(10_000.0 ** (-2.0 * k / dim)))
    return (acc - dim / 2) * inv_scale[head]


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
    inv = jnp.asarray(num_heads / (8.0 * np.arange(1, num_heads + 1)), jnp.float32)  # [N]
    return ScoreMod.from_distance(with_settings(_sandwich, dim=dim), inv, name="sandwich")


def init_fire_params(key: Array, num_heads: int, hidden: int = 32) -> dict:
    """Initial FIRE parameters (see `fire_score_mod`).

    `w1, b1 [hidden]` (the MLP's input layer, shared by the heads), `w2
    [N, hidden]`, `b2 [N]` (one output per head), and the unconstrained
    `c` and `L` scalars (`softplus(c) = 1`, `softplus(L) = 512` at init).
    """
    k1, k2 = jax.random.split(key)
    inv_softplus = lambda y: float(np.log(np.expm1(y)))  # noqa: E731
    return {
        "w1": jax.random.normal(k1, (hidden,), jnp.float32),
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (num_heads, hidden), jnp.float32) / np.sqrt(hidden),
        "b2": jnp.zeros((num_heads,), jnp.float32),
        "c": jnp.asarray(inv_softplus(1.0), jnp.float32),
        "L": jnp.asarray(inv_softplus(512.0), jnp.float32),
    }


def _fire_units(w1, b1, w2, b2, x, head):
    """FIRE's MLP, one hidden unit at a time: `b2[head] + sum_h w2[head, h]
    relu(x w1[h] + b1[h])` (static indices and `head` only: lowerable in the
    kernels; no hidden axis is added to the tile)."""
    out = b2[head]
    for h in range(w1.shape[0]):
        out = out + w2[head, h] * jax.nn.relu(x * w1[h] + b1[h])
    return out


@jax.custom_vjp
def _fire_tile(w1, b1, w2, b2, x, head):
    """`_fire_units` for an index-array `head` (xla, chunked), with a matmul backward."""
    return _fire_units(w1, b1, w2, b2, x, head)


def _fire_tile_fwd(w1, b1, w2, b2, x, head):
    return _fire_tile(w1, b1, w2, b2, x, head), (w1, b1, w2, b2, x, head)


def _fire_tile_bwd(res, ct):
    """The MLP's backward as matmuls over the hidden axis: the cotangent laid
    out as `[heads, X]` (X: the position pairs), the units as `[X, hidden]`.
    Autodiff of the unit loop costs 64 tile-sized reductions instead (8x the
    time and 5x the temporaries on a 512 x 512 tile of 8 heads, CPU)."""
    w1, b1, w2, b2, x, head = res
    laid = _heads_and_positions(ct, head, x, heads_first=True)
    if laid is None:  # no [heads, X] layout
        _, pull = jax.vjp(_fire_units, w1, b1, w2, b2, x, head)
        return pull(ct)[:5] + (None,)
    ctm, idx, xs = laid  # [heads, X], [heads], [X]
    hp = jax.lax.Precision.HIGHEST
    a = xs[:, None] * w1[None, :] + b1[None, :]  # [X, hidden]
    d_w2 = jnp.zeros_like(w2).at[idx].add(jnp.dot(ctm, jax.nn.relu(a), precision=hp))
    d_b2 = jnp.zeros_like(b2).at[idx].add(jnp.sum(ctm, axis=1))
    da = jnp.where(a > 0, jnp.dot(ctm.T, w2[idx], precision=hp), 0.0)  # [X, hidden]
    d_w1 = jnp.sum(da * xs[:, None], axis=0)
    d_b1 = jnp.sum(da, axis=0)
    dx = jnp.dot(da, w1, precision=hp).reshape(jnp.shape(x))
    return d_w1, d_b1, d_w2, d_b2, dx, None


_fire_tile.defvjp(_fire_tile_fwd, _fire_tile_bwd)


def _fire_input(params, i, j):
    """FIRE's MLP input `ψ(|i - j|) / ψ(max(L, i))`, `ψ(x) = log(c x + 1)`."""
    c = jax.nn.softplus(params["c"])
    thr = jax.nn.softplus(params["L"])
    d = jnp.abs(i - j).astype(jnp.float32)
    return jnp.log(c * d + 1.0) / jnp.log(c * jnp.maximum(thr, i.astype(jnp.float32)) + 1.0)


def _fire(params, score, batch, head, i, j):
    x = _fire_input(params, i, j)
    mlp = _fire_units if jnp.ndim(head) == 0 else _fire_tile  # a Pallas program, or all heads
    return score + mlp(params["w1"], params["b1"], params["w2"], params["b2"], x, head)


def _fire_views(params, batch, head, i, j):
    """What FIRE's MLP reads on one Pallas tile: `w1`, `b1`, the head's row
    `w2[head]`, `b2[head]` and the normalised distance `x` `[bq, bk]`."""
    x = _fire_input(params, i, j)
    return params["w1"], params["b1"], params["w2"][head], params["b2"][head], x


def _pick(v: Array, units: Array, h) -> Array:
    """`v[h]` of a vector without slicing (Triton-safe): a one-hot sum."""
    return jnp.sum(jnp.where(units == h, v, 0.0))


def _fire_core(views):
    """FIRE's MLP on a tile as a loop over the hidden units (`_fire_units`'s
    sum, in the same order), for the kernels: one unit's pre-activation is
    live at a time, and the kernel holds one loop body, not 32 copies."""
    w1, b1, w2h, b2h, x = views
    units = jax.lax.broadcasted_iota(jnp.int32, w1.shape, 0)

    def unit(h, out):
        a = x * _pick(w1, units, h) + _pick(b1, units, h)
        return out + _pick(w2h, units, h) * jnp.maximum(a, 0.0)

    return jax.lax.fori_loop(0, w1.shape[0], unit, jnp.zeros_like(x) + b2h)


def _fire_core_vjp(views, ct):
    """`_fire_core`'s backward, unit by unit, recomputing each pre-activation
    (relu's derivative 0 at 0, as jax.nn.relu's): `d w2[head, h] = sum(ct
    relu(a_h))`, `d a_h = ct w2[head, h] [a_h > 0]`, `d w1[h] = sum(d a_h x)`,
    `d b1[h] = sum(d a_h)`, `d x = sum_h d a_h w1[h]`, `d b2[head] = sum(ct)`."""
    w1, b1, w2h, b2h, x = views
    units = jax.lax.broadcasted_iota(jnp.int32, w1.shape, 0)

    def unit(h, carry):
        dx, dw1, db1, dw2 = carry
        w1h = _pick(w1, units, h)
        a = x * w1h + _pick(b1, units, h)
        da = jnp.where(a > 0, ct * _pick(w2h, units, h), 0.0)
        hit = units == h
        dw2 = dw2 + jnp.where(hit, jnp.sum(ct * jnp.maximum(a, 0.0)), 0.0)
        dw1 = dw1 + jnp.where(hit, jnp.sum(da * x), 0.0)
        db1 = db1 + jnp.where(hit, jnp.sum(da), 0.0)
        return dx + da * w1h, dw1, db1, dw2

    zeros = jnp.zeros_like(w1)
    init = (jnp.zeros_like(x), zeros, zeros, jnp.zeros_like(w2h))
    dx, dw1, db1, dw2 = jax.lax.fori_loop(0, w1.shape[0], unit, init)
    return dw1, db1, dw2, jnp.sum(ct).astype(jnp.result_type(b2h)), dx


with_tile_parts(_fire, TileParts(_fire_views, _fire_core, _fire_core_vjp))


def fire_score_mod(params: dict):
    """FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions
    Improves Long Context Transformers") as a score mod:

        score + f(ψ(|i - j|) / ψ(max(L, i))),   ψ(x) = log(c·x + 1),

    `f` a one-hidden-layer ReLU MLP from the scalar input to one value per
    head, with learned `c = softplus(params["c"]) > 0` and threshold `L =
    softplus(params["L"]) > 0` (positive by construction, so ψ stays finite).
    The paper writes `i - j` for causal attention; `|i - j|` equals it
    there and keeps the term finite for bidirectional attention.

    Triton-safe: the MLP runs unit by unit over the static hidden size with
    static indices (`w1[h]`) and `head` (`w2[head, h]`); no hidden axis is
    added to the tile. With an index-array `head` (xla, chunked) the same
    forward has a hand-written backward made of matmuls over the hidden axis
    (`_fire_tile_bwd`). The Pallas kernels run its `TileParts` instead
    (`_fire_core`: the units as a loop, with a hand-written backward that
    recomputes each unit), which keeps the dq kernels' registers from
    spilling and their compile short (`jattn bench aot`, docs/gpu.md).

    Args:
      params: from `init_fire_params` (or trained).

    Returns:
      a `jattn.ScoreMod` with params `params`.
    """

    return ScoreMod(_fire, params, "fire")


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

    return ScoreMod(_softcap, _f32(cap), "softcap")
