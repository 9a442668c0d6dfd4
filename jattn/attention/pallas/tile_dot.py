"""The flash kernels' tile products: `dot` at their float32 precisions, and the TF32 split.

Every dot accumulates in float32; bf16 / fp16 operands multiply natively
(tensor cores). Float32 operands have two precisions (`PRECISIONS`, the
kernels' `precision` argument):
- "tf32x3" (the default): each operand is split into a TF32 head and a
  TF32 tail (`tf32_split`, 10+1-bit significands, exact in float32) and
  three dots are summed, tails first: `lo_a·hi_b + hi_a·lo_b + hi_a·hi_b`
  (the dropped `lo_a·lo_b` and the tails' rounding are ~2^-22 of each
  product). The passes run at `Precision.HIGH`, which the Triton lowering
  (jax 0.10-0.12) maps to TF32 tensor-core instructions; their operands are
  already TF32 values, so the products are exact there as in interpret mode
  (where the CPU multiplies in float32): the CPU tests measure the GPU's
  arithmetic, up to summation order. One exception: the compiled dq tiles
  (the split dq kernel and the fused kernel's dq half) and the distance
  tiles' gradient kernel leave the split to Triton
  (`TRITON_X3`, its TF32x3 algorithm: the same three passes, which ptxas
  compiles without spills at float32 and head dim 128 where the hand split
  spilled). Interpret mode runs those tiles through `triton_split`, Triton's
  split done by hand (`TRITON_X3_INTERPRET`): heads rounded as its PTX
  rounds them (`cvt.rna.tf32.f32`, with no guard: from |x| >= 3.40199e38
  the head is ±Inf), tails the float32 differences as a TF32 product reads
  them (truncated). So the CPU tests see what the GPU's dq tiles compute,
  the overflow included; the kernels give those tiles halved keys and
  values (`config.halve_kv`), which no finite float32 overflows.
- "ieee": `Precision.HIGHEST`, float32 FMAs with no tensor cores (Triton's
  IEEE input precision; without it Triton would run one TF32 pass, 10-bit
  mantissas).
The Mosaic (TPU) kernels always use "ieee" (HIGHEST: the MXU's 6-pass bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

__all__ = [
    "DEFAULT_PRECISION",
    "PRECISIONS",
    "TRITON_X3",
    "TRITON_X3_INTERPRET",
    "dot",
    "dot_precision",
    "tf32_round",
    "tf32_split",
    "triton_split",
]

PRECISIONS = ("tf32x3", "ieee")  # float32 operands; the first is the default
DEFAULT_PRECISION = PRECISIONS[0]
# "tf32x3" done by Triton itself (its TF32x3 input precision, through
# `lax.DotAlgorithmPreset.TF32_TF32_F32_X3`): the same three passes, split
# inside Triton's dot lowering. Not a user's choice: the compiled GPU code
# whose ptxas registers it leaves spill-free (the dq tiles and the
# distance-tiles kernel at float32 and head dim 128, docs/gpu.md) gets it
# instead of "tf32x3" (`with_triton_x3`). XLA:CPU has no such algorithm, so
# interpret mode always splits by hand.
TRITON_X3 = "tf32x3_triton"
# The same code interpreted: Triton's split by hand (`triton_split`), each
# pass a float32 product of TF32 values (exact, as on the tensor cores).
TRITON_X3_INTERPRET = "tf32x3_triton_interpret"


def dot_precision(dtype, precision: str = "ieee") -> lax.Precision | lax.DotAlgorithmPreset | None:
    """The precision of each pass of a kernel dot with operands of `dtype`:
    HIGH (TF32, on split operands) for float32 at "tf32x3", HIGHEST (IEEE)
    for float32 at "ieee", Triton's own three passes at `TRITON_X3`, the
    native product (None) for 16-bit floats."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    if precision == TRITON_X3:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.HIGH if precision == "tf32x3" else lax.Precision.HIGHEST


def triton_split(x: Array) -> tuple[Array, Array]:
    """`(hi, lo)` as Triton's TF32x3 forms them (its F32DotTC pass, jax
    0.10-0.12): `hi = cvt.rna.tf32.f32(x)`, rounded to nearest with ties
    away and no guard near float32's largest value, so |x| >= 3.40199e38
    gives ±Inf (and `lo` the opposite Inf); `lo = x - hi` in float32, which
    the TF32 product reads truncated to TF32. For interpret mode, where
    XLA:CPU has no TF32x3 algorithm: the CPU then computes what the GPU's
    dq tiles do, their overflow included."""
    hi = _tf32(x, jnp.bool_(False))
    return hi, _tf32(x - hi, jnp.bool_(True))


_TF32_DROP = -0x2000  # keeps sign, exponent and 10 mantissa bits
_NEAR_MAX = 0x7F7FF000  # |x| from here up rounds past float32's largest finite value


def _near_max(x: Array) -> Array:
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return (bits & jnp.int32(0x7FFFFFFF)) >= jnp.int32(_NEAR_MAX)


def _tf32(x: Array, truncate: Array) -> Array:
    """`x` to TF32, rounded (ties away from zero) or, where `truncate`,
    truncated toward zero. Integer work only, and Inf only where rounding
    carries past float32's largest value (|x| >= 3.40199e38, which
    `tf32_round` and `tf32_split` truncate instead: a debug_infs run of the
    interpret-mode kernels would stop at one)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    half = jnp.where(truncate, jnp.int32(0), jnp.int32(0x1000))
    return lax.bitcast_convert_type((bits + half) & jnp.int32(_TF32_DROP), jnp.float32)


def tf32_round(x: Array) -> Array:
    """float32 `x` rounded to the nearest TF32 value (10 stored mantissa
    bits; ties away from zero): the low 13 bits of the float32 pattern
    cleared after adding half of their range. Finite in, finite out: within
    half a TF32 step of float32's largest value (|x| >= 3.4025e38) rounding
    would carry into the exponent and give ±Inf, which a 0 weight turns into
    NaN, so such an `x` is truncated instead."""
    return _tf32(x, _near_max(x))


def tf32_split(x: Array) -> tuple[Array, Array]:
    """`(hi, lo)`, both TF32 values, with `hi + lo = x` to ~2^-22 relative:
    `hi = tf32(x)`, `lo = tf32(x - hi)` (the difference is exact in float32).
    Near float32's largest value both are truncated toward zero, so that
    `|hi + lo| <= |x|` and the three-pass product cannot overflow where the
    exact one does not."""
    near = _near_max(x)
    hi = _tf32(x, near)
    return hi, _tf32(x - hi, near)


def dot(a: Array, b: Array, contract: tuple[int, int], precision: str = "ieee") -> Array:
    """2-D `a · b` contracting axis `contract[0]` of `a` with `contract[1]`
    of `b`, accumulated in float32; float32 operands at `precision` (one of
    `PRECISIONS`: three TF32 passes or IEEE, or the dq tiles' `TRITON_X3`
    and `TRITON_X3_INTERPRET`), see the module docstring."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    prec = dot_precision(a.dtype, precision)

    def one(x, y):
        return lax.dot_general(x, y, dims, precision=prec, preferred_element_type=jnp.float32)

    if precision == TRITON_X3_INTERPRET and jnp.dtype(a.dtype) == jnp.float32:
        split = triton_split
    elif prec == lax.Precision.HIGH:
        split = tf32_split
    else:
        return one(a, b)
    (a_hi, a_lo), (b_hi, b_lo) = split(a), split(b)
    return (one(a_lo, b_hi) + one(a_hi, b_lo)) + one(a_hi, b_hi)
