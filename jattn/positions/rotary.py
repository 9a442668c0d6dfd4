"""Rotary embeddings: RoPE, its scalings for longer contexts (PI, NTK,
YaRN in the paper's and Hugging Face's conventions) and the decaying xPos.

Shapes: B batch, T length, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = [
    "ROPE_SCALINGS",
    "YARN_CONVENTIONS",
    "YarnOptions",
    "rope",
    "rope_frequencies",
    "xpos",
    "xpos_max_span",
    "xpos_reference",
]


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
