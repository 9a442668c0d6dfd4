"""The Pallas flash kernel (interpret mode on the CPU) against the float64 oracle.

The contracts every implementation meets (causal, packing, dead rows,
padding, bf16, shift invariance, the shared oracle cases) run for these
kernels in tests/test_attention_contract.py; this file holds what is the
kernel's own: block sizes and ragged tiles, bias and mask kinds, far Shaw
tiles, the block map, windows, dropout, lowering. Every attention case checks
the output and all gradients (query, key, value, bias, Shaw key and value
tables) against `tests/oracle.py`. Compiled
functions are shared: one jitted vjp keyed by its static arguments, so cases
with the same shapes and flags compile once. Shapes stay small (interpret
mode runs the kernel body as XLA loops on the CPU); the GPU path is checked
by lowering it to Triton IR for CUDA, which needs no GPU.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import kernel_oracle
import numpy as np
import pytest
from attention_cases import normal_form
from flash_harness import (
    F32_TOL,
    _check,
    _check_debug_mode,
    _lower_vjp,
    _normal_form,
    _packed,
    _pallas_vjp,
    _qkv,
    cuda_target,
    intermediate_shapes,
    window_mask,
)

import jattn
import jattn.attention.xla
from jattn.attention.pallas import flash_attention as fa
from jattn.attention.pallas import tile_math as ft
from jattn.attention.pallas import triton_forward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------
# Forward and backward against the oracle.


# Shape families (few distinct shapes keep compilation and the eager oracle cheap):
# ragged B=2, T=40, S=36, N=K=2, H=16; main B=2, T=S=64, N=4, K=2, H=16, Hv=8;
# cross B=2, T=24, S=56, N=4, K=1 (MQA), H=16.
RAGGED = (2, 40, 36, 2, 2, 16)
MAIN = (2, 64, 64, 4, 2, 16, 8)
CROSS = (2, 24, 56, 4, 1, 16)


@pytest.mark.parametrize(
    "block_q,block_k,case",
    [
        (32, 16, "causal+bias_full"),  # bias [1, N, T, S]: gradient summed over batch
        (16, 32, "mask+bias_keys"),  # bias [B, 1, 1, S]: gradient summed over queries
    ],
)
def test_blocks_and_ragged_lengths(block_q, block_k, case):
    # T=40, S=36: neither a multiple of any block; padded tails are masked.
    b, t, s, n, _, _ = RAGGED
    inputs = _qkv(0, *RAGGED)
    rng = np.random.default_rng(1)
    if case == "causal+bias_full":
        inputs["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
    if case == "mask+bias_keys":
        inputs["mask"] = rng.random((b, 1, t, s)) > 0.3
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, 1, 1, s)), jnp.float32)
    _check(inputs, is_causal=case.startswith("causal"), block_q=block_q, block_k=block_k)


@pytest.mark.parametrize("backward", ["split", "fused"])
def test_backward_tiles_apart_from_the_forward(backward):
    # backward_blocks tiles the backward kernels alone (the GPU's best
    # backward tiles are not the forward's): a 32x16 forward with a 16x32
    # backward over ragged lengths and Shaw terms still matches the oracle,
    # and the forward's output is the same bits as with one tiling for both.
    inputs = _qkv(6, *RAGGED)
    out, _ = _check(
        inputs, is_causal=True, max_distance=3, block_q=32, block_k=16,
        backward=backward, backward_blocks=(16, 32),
    )  # fmt: skip
    same, _ = _check(inputs, is_causal=True, max_distance=3, block_q=32, block_k=16)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


@pytest.mark.parametrize(
    "case,tiles",
    [
        # Shaw terms, causal, ragged lengths: dq on 32x16, dk/dv on 16x32.
        ("shaw", fa.BackwardTiles(dq_blocks=(32, 16), dkv_blocks=(16, 32))),
        # Only the dk/dv kernel's tiles given: dq keeps backward_blocks (16x16).
        ("window+bias_keys", fa.BackwardTiles(dkv_blocks=(32, 64), dkv_warps=8)),
        # GQA, a bias per query row, dropout: dq 16x64, dk/dv 64x16.
        ("gqa+bias_rows+dropout", fa.BackwardTiles(dq_blocks=(16, 64), dkv_blocks=(64, 16))),
    ],
)
def test_dq_and_dkv_kernels_on_their_own_tiles(case, tiles):
    # backward_tiles gives the split backward's two kernels their own tiles
    # (the dq kernel loops over key tiles, the dk/dv kernel over query tiles
    # and the heads of a kv head): the gradients still match the oracle and
    # the forward's output is the same bits as with one backward tiling.
    inputs = _qkv(8, *(MAIN if case.startswith("gqa") else RAGGED))
    (b, t, n, _), s = inputs["query"].shape, inputs["key"].shape[1]
    rng = np.random.default_rng(9)
    kw = dict(is_causal=True, block_q=32, block_k=16, backward_blocks=(16, 16))
    if case == "shaw":
        kw["max_distance"] = 3
    if case.startswith("window"):
        kw.update(is_causal=False, window=(5, 3))
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, 1, 1, s)), jnp.float32)
    if case.startswith("gqa"):
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, n, t, 1)), jnp.float32)
        inputs["dropout_rng"] = jax.random.PRNGKey(3)
        kw["dropout_rate"] = 0.25
    out, _ = _check(inputs, backward_tiles=tiles, **kw)
    same, _ = _check(inputs, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


def test_backward_tiles_per_kernel_configure_each_kernel():
    # backward_blocks / backward_warps give both kernels; a BackwardTiles
    # field overrides it for its kernel; equal tilings keep one config.
    nf = normal_form(*(_qkv(0, *RAGGED)[x] for x in ("query", "key", "value")))
    pre = fa.prepare(
        nf, fa.KernelOptions(block_q=32, block_k=16, backend="gpu", backward_blocks=(16, 64))
    )
    assert pre.bwd_cfg.dkv_tiling is None and pre.dkv_cfg is pre.bwd_cfg
    assert pre.fixed.dkv_maps is None
    tiles = fa.BackwardTiles(dkv_blocks=(64, 16), dq_warps=2, dkv_warps=8)
    pre = fa.prepare(
        nf,
        fa.KernelOptions(
            block_q=32, block_k=16, backend="gpu", backward_blocks=(16, 64), backward_tiles=tiles
        ),
    )
    assert (pre.bwd_cfg.block_q, pre.bwd_cfg.block_k, pre.bwd_cfg.num_warps) == (16, 64, 2)
    assert (pre.dkv_cfg.block_q, pre.dkv_cfg.block_k, pre.dkv_cfg.num_warps) == (64, 16, 8)
    assert pre.fixed.dkv_maps.classes.shape[-2:] == (64 // 64, 64 // 16)  # Tp = Sp = 64
    assert pre.q.shape[1] == 64 and pre.k.shape[1] == 64  # padded to every tiling
    # Warps alone differing still give the dk/dv kernel its own config.
    pre = fa.prepare(
        nf,
        fa.KernelOptions(
            block_q=None, block_k=None, backend="gpu", backward_tiles=fa.BackwardTiles(dkv_warps=2)
        ),
    )
    assert pre.dkv_cfg.num_warps == 2 and pre.fixed.dkv_maps is None
    with pytest.raises(ValueError, match='backward="fused" runs one tiling'):
        fa.prepare(nf, fa.KernelOptions("gpu", backward="fused", backward_tiles=fa.BackwardTiles(
            dq_blocks=(16, 16), dkv_blocks=(32, 16))))  # fmt: skip
    with pytest.raises(ValueError, match='backward="fused" runs one kernel'):
        fa.prepare(nf, fa.KernelOptions(
            "gpu", backward="fused", backward_tiles=fa.BackwardTiles(dkv_warps=2)))  # fmt: skip
    with pytest.raises(ValueError, match=r"backward_tiles.dkv_blocks\[1\] must be a power of two"):
        fa.flash_attention(nf, backward_tiles=fa.BackwardTiles(dkv_blocks=(16, 48)), backend="gpu")
    with pytest.raises(ValueError, match="backward_tiles.dq_warps must be a power of two"):
        fa.flash_attention(nf, backward_tiles=fa.BackwardTiles(dq_warps=3), backend="gpu")
    with pytest.raises(ValueError, match="backward_tiles must be a BackwardTiles"):
        fa.flash_attention(nf, backward_tiles=((16, 16), (16, 16)), backend="gpu")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_per_kernel_backward_tiles_lower_to_triton():
    # The transposed dk/dv tiles and each kernel's own tiles and warps lower
    # for an abstract H100: three Triton kernels, each with its warps
    # (forward 8 at 128 rows, dq 4, dk/dv 2 as given).
    sds = jax.ShapeDtypeStruct
    q, k = sds((1, 256, 4, 64), jnp.bfloat16), sds((1, 256, 2, 64), jnp.bfloat16)
    tiles = fa.BackwardTiles(dq_blocks=(64, 32), dkv_blocks=(32, 128), dq_warps=4, dkv_warps=2)

    def f(q, k, v, ct):
        def attend(q, k, v):
            nf = normal_form(q, k, v, is_causal=True, local_window_size=(100, 0))
            return fa.flash_attention(nf, backend="gpu", backward_tiles=tiles)[0]

        return jax.vjp(attend, q, k, v)[1](ct)

    jax.eval_shape(f, q, k, k, q)  # the cached block maps, outside the abstract mesh
    with cuda_target():
        text = jax.jit(f).trace(q, k, k, q).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("jattn_flash_fwd", "jattn_flash_dq", "jattn_flash_dkv"):
        assert name in text
    warps = sorted(int(w) for w in re.findall(r"num_warps = (\d+) : i32", text))
    assert warps == [2, 4, 8], warps


def test_backward_tiles_apart_from_the_forward_in_the_mosaic_kernels():
    # The same on the TPU family (interpret mode): key tiles hold every key
    # (Mosaic's layout rule at S = 36), the backward's query tiles are half
    # the forward's.
    inputs = _qkv(7, *RAGGED)
    _check(
        inputs, is_causal=True, max_distance=3, block_q=16, block_k=40,
        backend="tpu_interpret", backward_blocks=(8, 40),
    )  # fmt: skip
    # Each Mosaic backward kernel on its own query tiles.
    _check(
        inputs, is_causal=True, max_distance=3, block_q=16, block_k=40, backend="tpu_interpret",
        backward_tiles=fa.BackwardTiles(dq_blocks=(8, 40), dkv_blocks=(32, 40)),
    )  # fmt: skip


def test_causal_gqa_and_bias_per_query():
    b, t, _, n, _, _, _ = MAIN
    inputs = _qkv(2, *MAIN)  # Hv != H
    inputs["bias"] = jnp.asarray(
        np.random.default_rng(3).standard_normal((b, n, t, 1)), jnp.float32
    )
    _check(inputs, is_causal=True)


def test_cross_attention_mqa_head_mask_scalar_bias():
    # T != S, one kv head for four query heads, a per-head mask (per-head block
    # map) and a scalar bias (gradient summed over everything).
    b, t, s, n, _, _ = CROSS
    inputs = _qkv(4, *CROSS)
    rng = np.random.default_rng(5)
    inputs["mask"] = rng.random((1, n, t, s)) > 0.5
    inputs["bias"] = jnp.asarray([[[[0.3]]]], jnp.float32)
    _check(inputs)


def test_segment_without_keys_and_causal_before_all_keys():
    # Cross attention where some queries' segment has no keys at all and some
    # queries sit (causally) before every key: those rows are exactly 0.
    inputs = _qkv(13, *CROSS)
    inputs["q_segment_ids"] = np.tile(np.int32([1] * 8 + [2] * 8 + [3] * 8), (2, 1))
    inputs["kv_segment_ids"] = np.tile(np.int32([1] * 28 + [3] * 28), (2, 1))
    inputs["q_positions"] = np.tile(np.int32([*range(-4, 4), *range(8), *range(8)]), (2, 1))
    inputs["kv_positions"] = np.tile(np.int32([*range(28), *range(28)]), (2, 1))
    out, grads = _check(inputs, is_causal=True)
    dead = [0, 1, 2, 3, *range(8, 16)]
    assert np.all(np.asarray(out)[:, dead] == 0.0)
    assert np.all(np.asarray(grads["query"])[:, dead] == 0.0)


def _packed_inputs(dtype=np.float32):
    b, t, _, _, _, h, hv = MAIN
    seg, pos = _packed(b, [20, 9, 27, 8])
    inputs = _qkv(6, *MAIN, dtype=dtype)
    rng = np.random.default_rng(7)
    r = 2 * 3 + 1
    inputs.update(
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=pos,
        kv_positions=pos,
        rel_key=jnp.asarray(rng.standard_normal((r, h)), dtype),
        rel_value=jnp.asarray(rng.standard_normal((r, hv)), dtype),
    )
    return inputs


PACKED_KW = dict(is_causal=True, max_distance=3, block_q=16, block_k=16)


@pytest.mark.parametrize(
    "tables,causal,dist",
    [
        ("key_per_head", False, 3),  # far tiles on both sides: ids 0 and 2k
        ("value_shared", True, 0),  # k = 0: a single relative id
        ("both_shared", False, 20),  # k > block: fewer constant tiles
        ("both_per_head", True, 3),
    ],
)
def test_shaw_relative(tables, causal, dist):
    _, _, _, n, _, h, hv = MAIN
    inputs = _qkv(9, *MAIN)
    rng = np.random.default_rng(10)
    r = 2 * dist + 1
    lead = (n,) if tables.endswith("per_head") else ()
    if tables.startswith(("key", "both")):
        inputs["rel_key"] = jnp.asarray(rng.standard_normal((*lead, r, h)), jnp.float32)
    if tables.startswith(("value", "both")):
        inputs["rel_value"] = jnp.asarray(rng.standard_normal((*lead, r, hv)), jnp.float32)
    _check(inputs, is_causal=causal, max_distance=dist)


# --------------------------------------------------------------------------------------
# The kernel's own contract against the plain-JAX reference beside it.


@pytest.mark.parametrize("window,dropout_rate", [(None, 0.0), ((20, 0), 0.3)])
def test_kernel_parts_and_custom_vjp_match_reference(window, dropout_rate):
    inputs = _packed_inputs()
    rng = np.random.default_rng(15)
    inputs["bias"] = jnp.asarray(rng.standard_normal((2, 4, 64, 64)), jnp.float32)
    inputs["dropout_rng"] = jax.random.PRNGKey(16)
    nf = _normal_form(
        inputs, is_causal=True, max_distance=3, window=window, dropout_rate=dropout_rate
    )
    q, k, v = nf.query, nf.key, nf.value
    kw = {f.name: getattr(nf, f.name) for f in dataclasses.fields(nf)}
    vis = nf.visibility
    kw.update({f.name: getattr(vis, f.name) for f in dataclasses.fields(vis)})
    kw["window"] = vis.local_window_size
    pre = fa.prepare(nf, fa.KernelOptions(block_q=16, block_k=32, backend="interpret"))
    assert pre.fwd_cfg.use_qr and pre.fwd_cfg.use_pr
    ins = fa.kernel_inputs(pre.q, pre.k, pre.v, pre.qr, pre.bias, pre.fixed, pre.fixed.forward_maps)
    o, lse, pr = jax.jit(functools.partial(triton_forward.flash_forward, pre.fwd_cfg))(ins)
    names = ("mask", "is_causal", "q_segment_ids", "kv_segment_ids", "q_positions")
    names += ("kv_positions", "max_distance", "scale", "window", "dropout_seed", "dropout_rate")
    ref_kw = {name: kw[name] for name in names}

    def ref(q, k, v, qr, bias):
        parts = kernel_oracle.reference_parts
        o, lse, pr = parts(q, k, v, qr=qr, bias=bias, with_pr=True, **ref_kw)
        return o, pr, lse

    want_o, want_pr, want_lse = jax.jit(ref)(q, k, v, pre.qr, kw["bias"])
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pr, want_pr, rtol=1e-5, atol=1e-6)
    # The kernels' lse is in base 2 (exp2 with log2(e) folded into the scale).
    np.testing.assert_allclose(lse * ft.LN2, want_lse, rtol=1e-5, atol=1e-5)

    # The custom VJP with respect to the kernel's own inputs, including the
    # Shaw key-term table qr and the bias.
    cot_o = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    cot_pr = jnp.asarray(rng.standard_normal(pr.shape), jnp.float32)
    # The core also returns the lse, a residual whose cotangent is ignored.
    core = lambda *a: fa.flash_core(pre.fwd_cfg, pre.bwd_cfg, *a, pre.fixed)[::2]  # noqa: E731
    vjp_of = lambda f, args, cots: jax.vjp(f, *args)[1](cots)  # noqa: E731
    primals = (pre.q, pre.k, pre.v, pre.qr, pre.bias)
    got = jax.jit(functools.partial(vjp_of, core))(primals, (cot_o, cot_pr))
    want = jax.jit(functools.partial(vjp_of, lambda *a: ref(*a)[:2]))(primals, (cot_o, cot_pr))
    for name, g, w in zip(("q", "k", "v", "qr", "bias"), got, want, strict=True):
        scale = float(np.max(np.abs(w)))
        assert float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) <= F32_TOL * scale, name


# --------------------------------------------------------------------------------------
# Block map: skipping is sound, FULL tiles are really full.


def _dense_tiles(x: np.ndarray, bq: int, bk: int, nt: int, ns: int) -> np.ndarray:
    """`[..., T, S]` -> `[..., nT, nS, bq, bk]`, padding with False."""
    t, s = x.shape[-2:]
    pad = [(0, 0)] * (x.ndim - 2) + [(0, nt * bq - t), (0, ns * bk - s)]
    x = np.pad(x, pad)
    x = x.reshape(*x.shape[:-2], nt, bq, ns, bk)
    return np.moveaxis(x, -3, -2)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (False, (3, 2))])
def test_block_map_is_sound(causal, window):
    rng = np.random.default_rng(16)
    b, t, s, bq, bk, dist = 2, 96, 88, 16, 32, 5
    seg, pos = _packed(b, [64, 20, 12])
    kv_seg, kv_pos = seg[:, :s], pos[:, :s]
    mask = np.ones((b, 1, t, s), bool)
    mask[0, :, 48:64, :] = False  # a whole row of tiles invisible
    mask[1, :, 70:, 3] = rng.random(t - 70) > 0.5
    tp, sp = 96, 96
    cls = np.asarray(
        fa.block_map(
            vis=jattn.Visibility(
                is_causal=causal,
                local_window_size=window,
                q_positions=jnp.asarray(pos),
                kv_positions=jnp.asarray(kv_pos),
                q_segment_ids=jnp.asarray(seg),
                kv_segment_ids=jnp.asarray(kv_seg),
            ).normalised(b, t, s),
            mask=jnp.asarray(mask),
            max_distance=dist,
            seq_k=s,
            block_q=bq,
            block_k=bk,
            padded_q=tp,
            padded_k=sp,
            batch=b,
        )
    )
    nt, ns = tp // bq, sp // bk
    assert cls.shape == (b, 1, nt, ns)
    vis = (seg[:, :, None] == kv_seg[:, None, :])[:, None] & mask
    if causal:
        vis &= (kv_pos[:, None, :] <= pos[:, :, None])[:, None]
    without_window = vis
    if window is not None:
        d = kv_pos[:, None, :] - pos[:, :, None]  # [B, T, S]
        vis = vis & ((d >= -window[0]) & (d <= window[1]))[:, None]
    rel = np.clip(kv_pos[:, None, :] - pos[:, :, None], -dist, dist) + dist
    real = np.ones((t, s), bool)
    vis_t = _dense_tiles(vis, bq, bk, nt, ns)  # [B, 1, nT, nS, bq, bk]
    rel_t = _dense_tiles(rel[:, None] + 1, bq, bk, nt, ns) - 1  # -1 = padding
    real_t = _dense_tiles(real, bq, bk, nt, ns)
    q_real = (np.arange(tp) < t).reshape(nt, bq)
    for bi, ti, si in np.ndindex(b, nt, ns):
        c = cls[bi, 0, ti, si]
        v, r = vis_t[bi, 0, ti, si], rel_t[bi, 0, ti, si]
        rows = q_real[ti]
        if c == ft.SKIP:
            assert not v.any(), (bi, ti, si)
        elif c in (ft.FULL_LEFT, ft.FULL_RIGHT):
            assert real_t[ti, si][rows].all() and v[rows].all(), (bi, ti, si)
            assert np.all(r[rows] == (0 if c == ft.FULL_LEFT else 2 * dist)), (bi, ti, si)
    found = set(np.unique(cls).tolist())
    if window is None:
        assert {ft.SKIP, ft.PARTIAL, ft.FULL_LEFT} <= found
        assert (ft.FULL_RIGHT in found) == (not causal)
    else:  # the window alone makes tiles SKIP that the other rules leave visible
        outside = (cls[:, 0] == ft.SKIP) & _dense_tiles(without_window, bq, bk, nt, ns)[:, 0].any(
            axis=(-1, -2)
        )
        assert outside.sum() >= 3 and ft.PARTIAL in found
    # Loop bounds: nothing outside [lo, hi) is visited, [flo, fhi) is all FULL.
    bounds = np.asarray(fa.run_bounds(jnp.asarray(cls)))
    for bi, ti in np.ndindex(b, nt):
        lo, flo, fhi, hi = bounds[bi, 0, ti]
        row = cls[bi, 0, ti]
        assert lo <= flo <= fhi <= hi
        assert np.all(row[:lo] == ft.SKIP) and np.all(row[hi:] == ft.SKIP)
        assert np.all(row[flo:fhi] >= ft.FULL_LEFT)


# --------------------------------------------------------------------------------------
# The GPU path: lowers to Triton IR (no GPU needed), validates its block sizes.


def _lower_for_cuda(dtype, **kw):
    # T = 200: not a multiple of the blocks.
    return _lower_vjp("cuda", "gpu", dtype, t=200, h=64, **kw)


@pytest.mark.parametrize(
    "dtype,causal,packed,shaw,bias_shape,mask_shape,window,dropout",
    [
        (jnp.bfloat16, True, False, False, None, None, None, 0.0),
        (jnp.bfloat16, True, True, True, (1, 4, 200, 200), (1, 4, 1, 200), None, 0.0),
        (jnp.float32, False, False, True, (1, 1, 1, 200), None, None, 0.0),
        # Local window and dropout (keep-mask hash in-kernel, seed input).
        (jnp.bfloat16, True, True, True, (1, 4, 200, 200), None, (64, 0), 0.1),
        (jnp.float32, False, False, False, (1, 1, 1, 200), (1, 1, 200, 200), (32, 16), 0.2),
    ],
)
# jax >= 0.11 warns that its Pallas Triton backend is deprecated on every
# Triton lowering (tests/test_kernel_variants.py checks that it reaches users).
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_gpu_path_lowers_to_triton(
    dtype, causal, packed, shaw, bias_shape, mask_shape, window, dropout
):
    # For an abstract H100 (`jattn.attention.pallas.backend.cuda_target`): no GPU needed, on
    # every jax version CI runs.
    text = _lower_for_cuda(
        dtype,
        causal=causal,
        packed=packed,
        shaw=shaw,
        bias_shape=bias_shape,
        mask_shape=mask_shape,
        window=window,
        dropout_rate=dropout,
    )
    calls = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call")
    assert calls >= 3, "expected the forward, dq and dk/dv Triton kernels"
    for name in ("jattn_flash_fwd", "jattn_flash_dq", "jattn_flash_dkv"):
        assert name in text


def test_block_size_validation():
    inputs = _qkv(17, 1, 40, 40, 2, 2, 16)
    nf = _normal_form(inputs, is_causal=False, max_distance=0)
    with pytest.raises(ValueError, match="power of two"):
        fa.flash_attention(nf, block_q=24, block_k=None, backend="gpu")
    with pytest.raises(ValueError, match="block_k must be positive"):
        fa.flash_attention(nf, block_q=None, block_k=0)
    with pytest.raises(ValueError, match=r"backward_blocks\[1\] must be a power of two"):
        fa.flash_attention(nf, backward_blocks=(16, 48), backend="gpu")
    with pytest.raises(ValueError, match=r"backward_blocks is \(block_q, block_k\)"):
        fa.flash_attention(nf, backward_blocks=(16,))
    with pytest.raises(ValueError, match="backward_warps must be a power of two"):
        fa.flash_attention(nf, backward_warps=3, backend="gpu")
    # The backward's tiles and warps reach its kernels' config, and only theirs.
    pre = fa.prepare(
        nf,
        fa.KernelOptions(
            block_q=32, block_k=16, backend="gpu", backward_blocks=(16, 64), backward_warps=2
        ),
    )
    assert (pre.fwd_cfg.block_q, pre.fwd_cfg.block_k) == (32, 16)
    assert (pre.bwd_cfg.block_q, pre.bwd_cfg.block_k, pre.bwd_cfg.num_warps) == (16, 64, 2)
    assert pre.fwd_cfg.num_warps != 2
    # The GPU tiles by dtype, head dim and Shaw terms (what ptxas compiles
    # without bf16 spills and within the shared memory, docs/gpu.md).
    blocks = {
        (dtype, h, shaw): fa.default_blocks("gpu", 8192, 8192, shaw, h, dtype)
        for dtype in ("bfloat16", "float32")
        for h in (64, 128)
        for shaw in (False, True)
    }
    assert blocks == {
        ("bfloat16", 64, False): ((128, 64), (64, 64)),
        ("bfloat16", 64, True): ((64, 64), (32, 32)),
        ("bfloat16", 128, False): ((128, 64), (32, 32)),
        ("bfloat16", 128, True): ((64, 64), (32, 32)),
        ("float32", 64, False): ((128, 64), (16, 32)),
        ("float32", 64, True): ((32, 64), (16, 32)),
        ("float32", 128, False): ((32, 32), (16, 32)),
        ("float32", 128, True): ((16, 32), (16, 32)),
    }
    # A score mod takes 16x32 in the backward (its vjp and params' gradient
    # live in the dq and fused kernels) and, in bf16 at head dim 128, a
    # 64-row forward; float32 keeps its forward tiles.
    for (dtype, h, shaw), (fwd, _) in blocks.items():
        with_mod = fa.default_blocks("gpu", 8192, 8192, shaw, h, dtype, score_mod=True)
        fwd = (64, 64) if dtype == "bfloat16" and h == 128 else fwd
        assert with_mod == (fwd, (16, 32)), (dtype, h, shaw)
    # A looping mod (FIRE) narrows the float32 forward at head dim 64 only.
    for (dtype, h, shaw), (fwd, _) in blocks.items():
        loop = fa.default_blocks("gpu", 8192, 8192, shaw, h, dtype, score_mod=True, loop_mod=True)
        fwd = (64, 64) if dtype == "bfloat16" and h == 128 else fwd
        fwd = (32, 64) if dtype == "float32" and h == 64 else fwd
        assert loop == (fwd, (16, 32)), (dtype, h, shaw)
    assert fa.default_blocks("interpret", 64, 64, score_mod=True) == ((64, 64), (64, 64))
    assert fa.default_blocks("gpu", 8192, 8192) == ((128, 64), (64, 64))
    assert fa.default_blocks("gpu", 20, 5) == ((32, 16), (32, 16))


# --------------------------------------------------------------------------------------
# The GPU benchmark script runs (tiny CPU configuration, interpret mode).


@pytest.mark.slow  # child processes import jax and compile the kernels (~45 s)
def test_bench_gpu_cpu_smoke(tmp_path):
    # The staged GPU script end to end on the CPU: probe, then the smoke stage's
    # cells, each in a child process, rows written as they finish, status 0. (No
    # wall-time assertion: speed is the benchmarks' to report; the timeout only
    # stops a hang.)
    out = tmp_path / "bench.csv"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py")]
    cmd += ["--stage", "smoke", "--cpu-smoke", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "backend: jax" in proc.stdout and "interpret mode" in proc.stdout
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["stage"] == "probe" and rows[0]["status"] == "ok"
    smoke = rows[1:]
    assert {r["cell"] for r in smoke} == {"pallas", "pallas_shaw", "fused"}
    assert {r["impl"] for r in smoke} == {"pallas", "pallas_shaw"}
    assert {r["backward"] for r in smoke} == {"split", "fused"}
    assert all(r["stage"] == "smoke" and r["status"] == "ok" for r in smoke), smoke
    assert not os.listdir(tmp_path / "bench_gpu_dumps")  # passing cells leave no dump


@pytest.mark.slow
def test_bench_gpu_cpu_check_stage(tmp_path):
    # The check stage's cells on the CPU (tiny shapes, interpret mode): the
    # float64 references run on the host device (on a GPU they must: cuBLAS
    # has no float64 GEMM), dropout keys and score-mod params included, and
    # every comparison passes with float32-level errors.
    out = tmp_path / "bench.csv"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py")]
    cmd += ["--stage", "check", "--cpu-smoke", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        rows = [r for r in csv.DictReader(f) if r["stage"] == "check"]
    # The Mosaic GPU cells need an sm_90 GPU: on the CPU each is a skip row saying so.
    skipped = [r for r in rows if r["status"].startswith("skip")]
    assert {r["cell"] for r in skipped} == {"mgpu_bf16_h128_causal_gqa", "mgpu_bf16_h64"}
    assert all("needs an sm_90 GPU" in r["status"] for r in skipped), skipped
    rows = [r for r in rows if r not in skipped]
    cells = {"f32_packed_shaw", "f32_window_dropout", "mods_f32_alibi", "mods_f32_packed_alibi"}
    # cuDNN's cells (what the rule sends it: windows, lengths, masks, bias) on the CPU run
    # jax.nn's xla path on their inputs: the inputs and the float64 reference agree.
    nn = {"cudnn_bf16_h128_causal", "cudnn_bf16_h64_gqa", "cudnn_bf16_h64_window_lengths",
          "cudnn_bf16_h128_mask_bias"}  # fmt: skip
    assert {r["cell"] for r in rows} == cells | nn
    assert {r["impl"] for r in rows if r["cell"] in nn} == {"xla_jax"}
    assert {"pallas_alibi", "pallas_t5"} <= {r["impl"] for r in rows}
    # The atomic backward is checked beside the other two where Shaw, packing, a
    # window and dropout meet (before the window times it, sweep/atomic*).
    backwards = {(r["cell"], r["backward"]) for r in rows}
    for cell in ("f32_packed_shaw", "f32_window_dropout"):
        assert {(cell, b) for b in ("split", "fused", "atomic")} <= backwards, backwards
    assert all(r["status"] == "PASS" for r in rows), rows
    kernels = [r for r in rows if r["cell"] not in nn]  # float32; the nn cells are bf16
    errors = [float(e) for r in kernels for e in re.findall(r"[\d.]+e[-+]\d+", r["max_rel_err"])]
    assert len(errors) >= len(kernels) and max(errors) < 1e-5, errors


# --------------------------------------------------------------------------------------
# Count what is materialised.


@pytest.mark.parametrize("extra", [{}, {"window": (10, 0), "dropout_rate": 0.3}])
def test_no_quadratic_tensor_with_segments_and_shaw(extra):
    # Forward and backward with causal, segments, positions and both Shaw
    # tables (and a local window and dropout): no value anywhere has two axes
    # as long as the sequences (no [T, S] mask or keep mask, no [T, S, H]
    # table), only O(T) and O(tiles^2) ones.
    inputs = _packed_inputs()
    inputs["dropout_rng"] = jax.random.PRNGKey(0)
    cot = jnp.ones((2, 64, 4, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(functools.partial(_pallas_vjp, **PACKED_KW, **extra))(inputs, cot)
    shapes = intermediate_shapes(jaxpr)
    assert len(shapes) > 50
    quadratic = [s for s in shapes if sum(d >= 64 for d in s[0]) >= 2]
    assert not quadratic, quadratic[:5]
    # The detector does see the [B, N, T, S] logits of the xla reference.
    nf = _normal_form(inputs, is_causal=True, max_distance=3)
    xla = jax.make_jaxpr(lambda q: jattn.attention.xla.attention_xla(nf.replace(query=q)))(nf.query)
    assert any(sum(d >= 64 for d in s[0]) >= 2 for s in intermediate_shapes(xla))


def test_fixed_bias_gets_no_gradient_buffer():
    # A bias that is not differentiated (fixed ALiBi, a mask as a bias) must
    # not cost the [B, N, T, S] float32 gradient buffer; a trained one does.
    b, t, _, n, _, _, hv = MAIN
    inputs = _qkv(18, *MAIN)
    inputs["bias"] = jnp.asarray(np.random.default_rng(19).standard_normal((b, n, t, t)))
    nf = _normal_form(inputs, is_causal=True, max_distance=0)
    q = nf.query
    kw = {"bias": nf.bias.astype(jnp.float32)}

    def loss(q, bias):
        out, _ = fa.flash_attention(nf.replace(query=q, bias=bias), block_q=16, block_k=16)
        return jnp.sum(out)

    full = ((b, n, t, t), "float32")
    only_q = intermediate_shapes(jax.make_jaxpr(jax.grad(loss))(q, kw["bias"]))
    both = intermediate_shapes(jax.make_jaxpr(jax.grad(loss, (0, 1)))(q, kw["bias"]))
    assert full not in only_q
    assert full in both
    g_only = jax.jit(jax.grad(loss))(q, kw["bias"])
    g_both = jax.jit(jax.grad(loss, (0, 1)))(q, kw["bias"])[0]
    np.testing.assert_array_equal(np.asarray(g_only), np.asarray(g_both))


# --------------------------------------------------------------------------------------
# Local windows: the rule per element in PARTIAL tiles, tiles outside it skipped.


@pytest.mark.parametrize(
    "case,window",
    [
        ("int", 5),  # symmetric window, several tiles of each row out of reach
        ("pair+causal+bias_full", (12, 4)),  # GQA, Hv != H; causal cuts the right side
        ("pair+mask", (3, 17)),  # asymmetric, a random mask inside the window
        ("packed+shaw", (6, 2)),  # windows on positions restart per packed segment
    ],
)
def test_local_window(case, window):
    if case == "int":
        inputs, kw = _qkv(50, *RAGGED), {}
    elif case == "packed+shaw":
        inputs, kw = _packed_inputs(), dict(is_causal=True, max_distance=3)
    else:
        b, t, s, n = MAIN[:4]
        inputs, kw = _qkv(51, *MAIN), dict(is_causal=case.endswith("bias_full"))
        rng = np.random.default_rng(52)
        if case.endswith("bias_full"):
            inputs["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
        else:
            inputs["mask"] = rng.random((b, 1, t, s)) > 0.3
    _check(inputs, window=window, **kw)


def test_window_tiles_outside_are_skipped_and_not_visited():
    # prepare's block map (T = S = 128, 16 x 16 tiles, window (20, 5)): a tile
    # is SKIP exactly when the window leaves none of its pairs visible, and
    # the row / column loop bounds [lo, hi) hold exactly the other tiles.
    inputs = _qkv(53, 1, 128, 128, 2, 2, 16)
    nf = _normal_form(inputs, is_causal=False, max_distance=0, window=(20, 5))
    pre = fa.prepare(nf, fa.KernelOptions(block_q=16, block_k=16, backend="interpret"))
    assert pre.fwd_cfg.use_pos and pre.fwd_cfg.window == (20, 5)
    maps = pre.fixed.forward_maps
    cls = np.asarray(maps.classes)[0, 0]  # [nT, nS]
    near = _dense_tiles(window_mask(inputs, (20, 5))[0, 0], 16, 16, 8, 8)  # [nT, nS, 16, 16]
    want_skip = ~near.any(axis=(-1, -2))
    assert want_skip.sum() > 30  # most tiles are out of reach
    np.testing.assert_array_equal(cls == ft.SKIP, want_skip)
    np.testing.assert_array_equal(cls == ft.PARTIAL, near.any((-1, -2)) & ~near.all((-1, -2)))
    for bounds, live in (
        (maps.row_bounds, ~want_skip),
        (maps.col_bounds, ~want_skip.T),
    ):
        lo, _, _, hi = np.asarray(bounds)[0, 0]  # [nT] each
        for row in range(8):
            idx = np.flatnonzero(live[row])
            assert (lo[row], hi[row]) == (idx[0], idx[-1] + 1)
            assert hi[row] - lo[row] <= 4  # 16 + 25 keys in reach: at most 4 of 8 tiles


# --------------------------------------------------------------------------------------
# Attention-weight dropout: the kernels drop exactly the xla path's weights.


@pytest.mark.parametrize(
    "case",
    ["ragged+broadcast_batch", "gqa+causal+bias_full", "packed+shaw+window", "shaw_far+mask"],
)
def test_dropout_matches_xla(case):
    kw = dict(dropout_rate=0.3)
    if case == "ragged+broadcast_batch":
        inputs = _qkv(54, *RAGGED)  # MHA, ragged tiles, one keep mask for both rows
        kw.update(broadcast_batch=True)
    elif case == "gqa+causal+bias_full":
        b, t, s, n = MAIN[:4]
        inputs = _qkv(55, *MAIN)
        rng = np.random.default_rng(56)
        inputs["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
        kw.update(is_causal=True, block_q=32, block_k=16)
    elif case == "packed+shaw+window":
        inputs = _packed_inputs()
        kw.update(is_causal=True, max_distance=3, window=(10, 0), dropout_rate=0.5)
    else:  # non-causal Shaw k = 3: FULL_LEFT / FULL_RIGHT tiles with dropout
        b, t, s, n, _, h, hv = MAIN
        inputs = _qkv(57, *MAIN)
        rng = np.random.default_rng(58)
        inputs["rel_key"] = jnp.asarray(rng.standard_normal((n, 7, h)), jnp.float32)
        inputs["rel_value"] = jnp.asarray(rng.standard_normal((7, hv)), jnp.float32)
        inputs["mask"] = rng.random((b, 1, t, s)) > 0.1
        kw.update(max_distance=3, dropout_rate=0.2)
    inputs["dropout_rng"] = jax.random.PRNGKey(59)
    out, _ = _check(inputs, **kw)
    # Not vacuous: the same call without dropout differs.
    no_drop = {k: v for k, v in kw.items() if k not in ("dropout_rate", "broadcast_batch")}
    kept, _ = _check(inputs, **no_drop)
    assert not np.allclose(out, kept, atol=1e-3)


# --------------------------------------------------------------------------------------
# Strict jax settings: rank promotion "raise", debug_infs, debug_nans (eager).


@pytest.mark.parametrize("setting", ["rank_promotion_raise", "debug_infs", "debug_nans"])
def test_strict_jax_settings(setting):
    _check_debug_mode(setting, backend="interpret", block_q=16, block_k=16)
