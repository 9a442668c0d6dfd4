"""The atomic backward (`backward="atomic"`) in interpret mode, against float64 and the split one.

`jattn.attention.pallas.atomic_backward`: the dk/dv kernel alone, adding
each tile's dq (and the Shaw key term's gradient, the row sums of dS) into
float32 buffers with atomic adds. Every case runs the output and every
gradient against the float64 oracle (tests/oracle.py, through
`flash_harness._check`; the xla path where dropout is on) and against the
split backward on the same inputs: causal GQA, packed segments with Shaw
terms and a bias with both axes, cross lengths with padding under MQA, a
window and dropout, score mods with a params gradient (and a distance-table
mod), row and column terms. Then the refusals (the Mosaic kernels, a dq
kernel's tiles), the kernels it runs, and its lowering for CUDA (Triton IR,
atomics included) on this host. Shapes stay at T <= 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_pallas_score_mod as mods
import test_row_col as row_col
from flash_harness import (
    F32_TOL,
    GRAD_NAMES,
    _check,
    _close,
    _lower_vjp,
    _normal_form,
    _packed,
    _pallas_vjp,
    _qkv,
    kernel_outputs,
)

from jattn import positions
from jattn.attention.pallas import flash_attention as fa

MAIN = (2, 64, 64, 4, 2, 16, 8)  # B, T, S, N, K, H, Hv (as tests/test_pallas.py)
CROSS = (2, 24, 56, 4, 1, 16)  # MQA; T and S pad to the 16-row tiles
RAGGED = (2, 40, 36, 2, 2, 16)
# Atomic against split: float32 terms summed in another order (dq per tile, then
# scaled), and the split backward's dq tiles multiply as a GPU's do, through Triton's
# TF32x3 split (`tile_dot.triton_split`: tails truncated) where the atomic kernel splits
# by hand (tails rounded): terms ~2^-22 of a product apart. So agreement to a few
# float32 roundings of the largest value (1.8e-6 seen: a score mod's params gradient).
SPLIT_TOL = 4e-6


def _case(name: str):
    """`(inputs, keywords of _check)` of one named case."""
    rng = np.random.default_rng(11)
    if name == "causal+gqa+bias_rows":  # dS summed over keys: added atomically
        b, t, _, n = MAIN[:4]
        inputs = _qkv(12, *MAIN)
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, n, t, 1)), jnp.float32)
        return inputs, dict(is_causal=True, block_q=32, block_k=16)
    if name == "packed+shaw+bias_full":  # Shaw key term's gradient added; dS tiles stored
        b, t, s, n, _, h, hv = MAIN
        inputs = _qkv(13, *MAIN)
        seg, pos = _packed(b, [20, 9, 27, 8])
        inputs.update(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
        inputs["rel_key"] = jnp.asarray(rng.standard_normal((n, 7, h)), jnp.float32)
        inputs["rel_value"] = jnp.asarray(rng.standard_normal((7, hv)), jnp.float32)
        inputs["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
        return inputs, dict(is_causal=True, max_distance=3, block_q=16, block_k=32)
    if name == "cross_mqa+padding+mask+bias_keys+window":
        b, t, s, n = CROSS[:4]
        inputs = _qkv(14, *CROSS)
        inputs["mask"] = rng.random((1, n, t, s)) > 0.2  # per head: a per-head block map
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, 1, 1, s)), jnp.float32)
        return inputs, dict(window=(9, 20))
    if name == "dropout+window+far_shaw":  # far tiles on both sides: ids 0 and 2k
        inputs = _qkv(15, *RAGGED)
        inputs["rel_key"] = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
        inputs["dropout_rng"] = jax.random.PRNGKey(16)
        return inputs, dict(window=(12, 12), max_distance=2, dropout_rate=0.25)
    raise ValueError(name)


def _split_grads(inputs, kw: dict):
    """The split backward's output and gradients on the same call."""
    rng = np.random.default_rng(1000)  # `_check`'s cotangent
    q, v = inputs["query"], inputs["value"]
    cot = jnp.asarray(rng.standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32))
    return _pallas_vjp(inputs, cot, backward="split", **kw)


CASES = [
    "causal+gqa+bias_rows",
    "packed+shaw+bias_full",
    "cross_mqa+padding+mask+bias_keys+window",
    "dropout+window+far_shaw",
]


@pytest.mark.parametrize("case", CASES)
def test_atomic_backward_matches_float64_and_the_split_backward(case):
    inputs, kw = _case(case)
    out, grads = _check(inputs, backward="atomic", **kw)
    kw = dict(block_q=16, block_k=16, is_causal=False, max_distance=0) | kw
    split_out, split = _split_grads(inputs, kw)
    # One forward kernel; its output to float32 rounding, not bit for bit: the two vjps
    # are other XLA programs around it (seen 7e-7 apart on outputs near 3, under the
    # suite's -O0 flags, once the split backward changed).
    _close("out (atomic vs split)", out, np.asarray(split_out, np.float64), 1e-6)
    for name in GRAD_NAMES:
        if inputs.get(name) is not None:
            want = np.asarray(split[name], np.float64)
            # A bias without a key axis: 0 up to rounding (see `_check`), so absolutely.
            if name == "bias" and np.shape(inputs["bias"])[-1] == 1:
                _close("dbias (atomic vs split)", grads[name], want, F32_TOL, absolute=True)
            else:
                _close(f"d{name} (atomic vs split)", grads[name], want, SPLIT_TOL)


@pytest.mark.parametrize("name", ["per_batch", mods.SHAW_BIAS])
def test_score_mods_and_their_params_gradient(name):
    # A mod indexing its params by batch row and head: each dk/dv program's
    # partial sums of the params' gradient; a distance-table mod (Shaw's bias):
    # Toeplitz tiles, whose gradient kernel runs on the atomic backward's
    # tiling. Packed rows with a padding tail, GQA, causal.
    inputs, mod = mods._packed_padded_inputs(), mods._mod(name)
    cot = mods._cot(inputs)
    got = mods._pallas(inputs, mod, cot, is_causal=True, backend="interpret", backward="atomic")
    mods._compare(got, mods._reference(inputs, mod, cot, is_causal=True))
    split = mods._pallas(inputs, mod, cot, is_causal=True, backend="interpret")
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(split[1]), strict=True):
        _close("gradient (atomic vs split)", g, np.asarray(w, np.float64), SPLIT_TOL)


@pytest.mark.parametrize("layout,kv_heads,s", [("packed", 2, None), ("cross", 1, 11)])
def test_row_and_column_terms(layout, kv_heads, s):
    # The row sums of dS added atomically, the column sums by the dk/dv
    # kernel; packed under a soft-cap (so the row term's gradient is not 0),
    # and cross-attention under MQA.
    problem = row_col._problem(3, row_col.T, s or row_col.T, kv_heads)
    q, k, v, a, c, ct = (np.asarray(x, np.float32).astype(np.float64) for x in problem)
    kw = row_col.LAYOUTS[layout]()
    mod = positions.softcap_score_mod(row_col.CAP) if layout == "packed" else None
    attend = functools.partial(
        fa.flash_attention, backend="interpret", block_q=16, block_k=16, backward="atomic"
    )
    got = row_col._vjp(attend, jnp.float32, q, k, v, a, c, ct, mod, **kw)
    want = row_col._reference(q, k, v, a, c, ct, mod, **kw)
    if mod is not None:
        assert np.max(np.abs(want[1][3])) > 1e-2  # a row-term gradient to check
    row_col._assert_matches(got, want, row_col.F32_RTOL)


# --------------------------------------------------------------------------------------
# What it runs, what it refuses, and its lowering.


def test_one_kernel_on_the_dkv_tiles_and_the_refusals():
    # The dk/dv kernel's tiles are the backward's; no dq kernel runs.
    inputs = _qkv(17, *RAGGED)
    nf = _normal_form(inputs, is_causal=True, max_distance=0)
    tiles = fa.BackwardTiles(dkv_blocks=(16, 32), dkv_warps=2)
    opts = fa.KernelOptions(backend="gpu", backward="atomic", backward_tiles=tiles)
    pre = fa.prepare(nf, opts)
    assert (pre.bwd_cfg.block_q, pre.bwd_cfg.block_k, pre.bwd_cfg.num_warps) == (16, 32, 2)
    assert pre.bwd_cfg.dkv_tiling is None and pre.fixed.dkv_maps is None

    def loss(q):
        out, _ = fa.flash_attention(nf.replace(query=q), backend="interpret", backward="atomic")
        return jnp.sum(out)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(nf.query)
    assert kernel_outputs(jaxpr, "jattn_flash_bwd_atomic") == [3]  # dk, dv, dq
    assert kernel_outputs(jaxpr, "jattn_flash_dq") == kernel_outputs(jaxpr, "jattn_flash_dkv") == []
    # A dq kernel's tiles are refused, not ignored; the Mosaic kernels have none of it.
    with pytest.raises(ValueError, match='backward="atomic" runs no dq kernel'):
        fa.prepare(nf, opts._replace(backward_tiles=fa.BackwardTiles(dq_blocks=(16, 16))))
    with pytest.raises(ValueError, match="runs no dq kernel"):
        fa.prepare(nf, opts._replace(backward_tiles=fa.BackwardTiles(dq_warps=8)))
    with pytest.raises(ValueError, match="'atomic' exists for the Triton kernels only"):
        fa.flash_attention(nf, block_q=8, backend="tpu_interpret", backward="atomic")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda(dtype):
    # Triton IR for an abstract H100, every feature at once: the atomic adds
    # (dq, the Shaw key term's gradient) at a query head's rows of a kv
    # head's block, the dS tiles of a full bias, a window and dropout.
    text = _lower_vjp(
        "cuda", "gpu", dtype, t=200, h=64, causal=True, packed=True, shaw=True,
        bias_shape=(1, 4, 200, 200), mask_shape=(1, 4, 1, 200), window=(64, 0),
        dropout_rate=0.1, backward="atomic",
    )  # fmt: skip
    assert "jattn_flash_fwd" in text and "jattn_flash_bwd_atomic" in text
    assert "jattn_flash_dq" not in text and "jattn_flash_dkv" not in text
    # The Triton module's op table (bytecode in the custom call) names the atomic op.
    assert "\\00atomic_rmw\\00" in text, "no atomic add in the Triton IR"
