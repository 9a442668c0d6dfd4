"""How the Triton kernels multiply float32 operands (issue 25, item 3).

- `tf32_split` gives two TF32 values (low 13 bits of the float32 pattern
  zero) whose sum is the input to 2^-22 relative; `dot` at "tf32x3" is
  within float32 rounding of the float64 product, one TF32 pass is not.
- `triton_split`, Triton's own TF32x3 split as interpret mode runs it for
  the dq tiles, rounds as Triton's PTX does: float32's largest values give
  an Inf head, which a 0 weight turns into NaN; the kernels hand those
  tiles halved keys and values (`config.halve_kv`), and their recomputed
  probabilities never exceed 1 (`tile_math.recomputed_probs`), so a key
  or value at ±3.4e38 leaves every gradient finite.
- The kernels at the default ("tf32x3") and at "ieee", forward and every
  gradient, against the float64 oracle in interpret mode, where the TF32
  passes' products are exact as on the GPU (their operands are TF32
  values): the default's error is stated in docs/gpu.md from this test's
  shapes (`measured_errors`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flash_harness import GRAD_NAMES, _normal_form, _oracle, _pallas_vjp, _qkv

from jattn.attention.pallas import flash_attention as fa
from jattn.attention.pallas import tile_dot, tile_math, triton_backward
from jattn.attention.pallas.config import halve_kv

SHAPE = (2, 128, 128, 4, 2, 64)  # B, T, S, N, K, H
TF32_MASK = (1 << 13) - 1


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


def test_tf32_split_is_two_tf32_values_summing_to_the_input():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 4096),
            np.float32([0.0, -0.0, 1.0, -1.0, 2.0**-126, 3.0e38, 1.0 + 2.0**-11]),
        ]
    ).astype(np.float32)
    hi, lo = jax.jit(tile_dot.tf32_split)(jnp.asarray(x))
    assert not np.any(_bits(hi) & TF32_MASK) and not np.any(_bits(lo) & TF32_MASK)
    x64 = x.astype(np.float64)
    err = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - x64)
    assert np.all(err <= 2.0**-22 * np.abs(x64)), float(
        np.max(err / np.maximum(np.abs(x64), 1e-300))
    )
    # The head alone is TF32's rounding: up to 2^-11 relative (what one pass keeps).
    head = np.abs(np.asarray(hi, np.float64) - x64)
    assert np.all(head <= 2.0**-11 * np.abs(x64))
    assert np.max(head / np.maximum(np.abs(x64), 1e-300)) > 2.0**-14  # it does round


def test_tf32_split_keeps_float32_extremes_finite():
    """Rounding float32's largest values to TF32 would carry into the
    exponent (±Inf, then NaN behind a 0 weight); they are truncated instead:
    finite TF32 halves summing to the input."""
    big = np.finfo(np.float32).max
    x = np.float32([big, -big, np.nextafter(big, 0), 3.4025e38, -3.4025e38, 3.40e38])
    hi, lo = jax.jit(tile_dot.tf32_split)(jnp.asarray(x))
    hi, lo = np.asarray(hi), np.asarray(lo)
    assert np.all(np.isfinite(hi)) and np.all(np.isfinite(lo))
    assert not np.any(_bits(hi) & TF32_MASK) and not np.any(_bits(lo) & TF32_MASK)
    x64 = x.astype(np.float64)
    err = np.abs(hi.astype(np.float64) + lo.astype(np.float64) - x64)
    assert np.all(err <= 2.0**-22 * np.abs(x64))
    assert np.all(np.abs(hi.astype(np.float64) - x64) <= 2.0**-10 * np.abs(x64))


def test_triton_split_rounds_as_tritons_ptx():
    """Heads rounded to nearest, ties away (`cvt.rna.tf32.f32`), as
    `tf32_round` does away from the extremes; tails the float32 remainders
    read as TF32 (truncated): the pair sums to the input within 2^-22."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-20, 20, 4096)).astype(np.float32)
    hi, lo = jax.jit(tile_dot.triton_split)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(hi), np.asarray(tile_dot.tf32_round(x)))
    assert not np.any(_bits(hi) & TF32_MASK) and not np.any(_bits(lo) & TF32_MASK)
    x64 = x.astype(np.float64)
    err = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - x64)
    assert np.all(err <= 2.0**-22 * np.abs(x64))


def test_tritons_split_overflows_at_float32_max_and_halved_keys_do_not():
    """What the GPU's dq tiles compute with Triton's TF32x3: `dS · K` with a
    masked key (dS = 0) at ±3.40e38 is NaN in every entry, since the key's
    head rounds to ±Inf. With the keys halved and the product doubled (what
    the kernels do) it is the float64 product to float32 accuracy."""
    big = np.finfo(np.float32).max
    rng = np.random.default_rng(3)
    ds = rng.standard_normal((16, 32)).astype(np.float32)
    k = rng.standard_normal((32, 8)).astype(np.float32)
    ds[:, 5], k[5, ::2], k[5, 1::2] = 0.0, big, -big  # key 5 masked, at float32's extremes
    x3 = tile_dot.TRITON_X3_INTERPRET
    # From 0x7F7FF000 (3.401993e38) up, the rounding carries into the exponent.
    edge = np.int32([0x7F7FF000, 0x7F7FEFFF]).view(np.float32)
    with jax.debug_nans(False), jax.debug_infs(False):
        heads, _ = tile_dot.triton_split(jnp.float32([big, -big, *edge]))
        raw = tile_dot.dot(jnp.asarray(ds), jnp.asarray(k), (1, 0), x3)
    assert np.asarray(heads).tolist()[:3] == [np.inf, -np.inf, np.inf]
    assert np.isfinite(np.asarray(heads)[3])
    assert np.all(np.isnan(np.asarray(raw)))
    halved = tile_dot.dot(jnp.asarray(ds), jnp.asarray(k) * 0.5, (1, 0), x3) * 2.0
    want = ds.astype(np.float64) @ np.where(ds[:1].T == 0, 0.0, k.astype(np.float64))
    scale = np.abs(ds).astype(np.float64) @ np.where(ds[:1].T == 0, 0.0, np.abs(k))
    assert np.max(np.abs(np.asarray(halved, np.float64) - want) / scale) <= 4 * 2.0**-24 * 32


def test_halve_kv_where_tritons_split_runs():
    """Halved keys and values exactly where `with_triton_x3` hands the dots
    to Triton's split (compiled for a GPU, or interpreted) at float32 and
    the default precision; untouched at "ieee", in bf16 and on the TPU."""
    nf32 = _normal_form(_qkv(84, 1, 40, 40, 2, 2, 16), is_causal=True, max_distance=0)
    nf16 = _normal_form(
        _qkv(84, 1, 40, 40, 2, 2, 16, dtype=jnp.bfloat16), is_causal=True, max_distance=0
    )
    key, value = nf32.key, nf32.value
    ins = fa.KernelInputs(**{f: None for f in fa.KernelInputs._fields})._replace(
        key=key, value=value
    )
    for backend in ("gpu", "interpret"):
        cfg = fa.prepare(nf32, fa.KernelOptions(backend=backend)).bwd_cfg
        halved_cfg, halved = halve_kv(cfg, ins)
        assert halved_cfg.kv_halved and (halved_cfg.kv_unscale, halved_cfg.qk_scale) == (
            2.0,
            2.0 * cfg.scale,
        )
        np.testing.assert_array_equal(np.asarray(halved.key) * 2, np.asarray(key))
        np.testing.assert_array_equal(np.asarray(halved.value) * 2, np.asarray(value))
    for nf, opts in (
        (nf32, fa.KernelOptions(backend="gpu", precision="ieee")),
        (nf16, fa.KernelOptions(backend="gpu")),
        (nf32, fa.KernelOptions(backend="tpu_interpret")),
    ):
        cfg = fa.prepare(nf, opts).bwd_cfg
        k = nf.key
        out_cfg, out = halve_kv(cfg, ins._replace(key=k, value=nf.value))
        assert out_cfg is cfg and out.key is k and cfg.qk_scale == cfg.scale


def test_recomputed_probs_are_weights():
    lse = np.float32([[2.0], [tile_math.EMPTY_LSE], [1e35]])
    s = np.float32([[1.0, 2.0, -np.inf], [5.0, -np.inf, 1e30], [1.0000001e35, 0.9999999e35, 1e35]])
    with jax.debug_infs(False):  # -inf logits are what invisible entries hold
        p = np.asarray(tile_math.recomputed_probs(jnp.asarray(s), jnp.asarray(lse)))
    np.testing.assert_array_equal(p[0], [0.5, 1.0, 0.0])
    np.testing.assert_array_equal(p[1], [0.0, 0.0, 0.0])  # a row with nothing visible
    # Logits past 2^22 whose recomputation overshoots the forward's lse: 1, not Inf.
    np.testing.assert_array_equal(p[2], [1.0, 0.0, 1.0])


def test_without_halved_keys_the_dq_tiles_overflow(monkeypatch):
    """The split backward in interpret mode (Triton's split by hand in its
    dq tiles) with keys and values at ±3.40e38 behind padding: dq is that of
    the same inputs without them, bit for bit; with the halving turned off
    it is NaN, which is what a GPU computed before the halving (docs/gpu.md,
    "float32's largest values on a GPU")."""
    inputs = _qkv(85, 1, 48, 48, 2, 1, 12)
    seg = np.int32([[1] * 40 + [0] * 8])
    inputs |= {"q_segment_ids": jnp.asarray(seg), "kv_segment_ids": jnp.asarray(seg)}
    big = np.finfo(np.float32).max
    k, v = np.array(inputs["key"]), np.array(inputs["value"])
    k[:, 40:, :, ::2], k[:, 40:, :, 1::2] = big, -big
    v[:, 40:, :, ::2], v[:, 40:, :, 1::2] = -big, big
    extreme = inputs | {"key": jnp.asarray(k), "value": jnp.asarray(v)}
    cot = jnp.asarray(np.random.default_rng(9).standard_normal((1, 48, 2, 12)), jnp.float32)

    def dq(x):
        kw = dict(is_causal=True, max_distance=0, block_q=16, block_k=16)
        with jax.debug_nans(False), jax.debug_infs(False):
            return np.asarray(_pallas_vjp(x, cot, **kw)[1]["query"])

    clean = dq(inputs)
    assert np.all(np.isfinite(clean))
    np.testing.assert_array_equal(dq(extreme), clean)
    monkeypatch.setattr(triton_backward, "halve_kv", lambda cfg, ins: (cfg, ins))
    jax.clear_caches()  # the backward above was traced with the halving
    try:
        unhalved = dq(extreme)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    # Every query of the one tile that holds the hidden keys (rows 32-47).
    assert np.all(np.isnan(unhalved[:, 32:])), np.isnan(unhalved).any(axis=(0, 2, 3))
    np.testing.assert_array_equal(unhalved[:, :32], clean[:, :32])


@pytest.mark.parametrize("contract", [(1, 1), (1, 0), (0, 0)])
def test_tf32x3_dot_is_float32_accurate(contract):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((64, 32) if contract == (0, 0) else (48, 32)).astype(np.float32)
    if contract == (1, 0):
        b = rng.standard_normal((32, 48)).astype(np.float32)
    sub = "ij,kj->ik" if contract == (1, 1) else "ij,jk->ik" if contract == (1, 0) else "ji,jk->ik"
    want = np.einsum(sub, a.astype(np.float64), b.astype(np.float64))
    scale = np.einsum(sub, np.abs(a).astype(np.float64), np.abs(b).astype(np.float64))

    def run(precision, x, y):
        out = tile_dot.dot(jnp.asarray(x), jnp.asarray(y), contract, precision)
        return np.asarray(out, np.float64)

    err3 = np.max(np.abs(run("tf32x3", a, b) - want) / scale)
    err_ieee = np.max(np.abs(run("ieee", a, b) - want) / scale)
    rounded = (tile_dot.tf32_round(a), tile_dot.tf32_round(b))
    one_pass = np.max(np.abs(run("ieee", *rounded) - want) / scale)
    assert err3 <= 4 * 2.0**-24 * 64 and err3 <= 4 * max(err_ieee, 2.0**-24), (err3, err_ieee)
    assert one_pass > 30 * err3  # one TF32 pass is what "tf32x3" avoids


@functools.partial(jax.jit, static_argnames=("precision", "backward"))
def _vjp(inputs, cot, *, precision, backward):
    diff = {name: inputs[name] for name in ("query", "key", "value", "rel_key", "rel_value")}

    def f(diff):
        nf = _normal_form({**inputs, **diff}, is_causal=True, max_distance=8)
        return fa.flash_attention(
            nf, block_q=32, block_k=32, backend="interpret", precision=precision, backward=backward
        )[0]

    out, vjp = jax.vjp(f, diff)
    return out, vjp(cot)[0]


def measured_errors(precision: str, backward: str = "split") -> dict[str, float]:
    """Max |kernel - float64| / max |float64| of the output and each gradient
    (causal, Shaw key and value tables, GQA; `SHAPE`)."""
    inputs = _qkv(7, *SHAPE)
    rng = np.random.default_rng(8)
    r, h = 17, SHAPE[-1]
    inputs["rel_key"] = jnp.asarray(rng.standard_normal((r, h)), jnp.float32)
    inputs["rel_value"] = jnp.asarray(rng.standard_normal((r, h)), jnp.float32)
    b, t, _, n = SHAPE[:4]
    cot = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    out, grads = _vjp(inputs, cot, precision=precision, backward=backward)
    want, want_grads = _oracle(inputs, cot, is_causal=True, max_distance=8)
    errs = {"out": (out, want)} | {
        f"d{n}": (grads[n], want_grads[n]) for n in GRAD_NAMES if inputs.get(n) is not None
    }
    return {
        name: float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))
        for name, (g, w) in errs.items()
    }


@pytest.mark.parametrize("backward", ["split", "fused"])
def test_default_precision_is_float32_accurate(backward):
    default = measured_errors("tf32x3", backward)
    ieee = measured_errors("ieee", backward)
    print(f"\n{backward} tf32x3: {default}\n{backward} ieee:   {ieee}")
    assert set(default) == {"out", "dquery", "dkey", "dvalue", "drel_key", "drel_value"}
    for name, err in default.items():
        assert err <= 2e-6, (name, err)  # the suite's float32 tolerance is 2e-5
        assert err <= 8 * ieee[name] + 1e-7, (name, err, ieee[name])
