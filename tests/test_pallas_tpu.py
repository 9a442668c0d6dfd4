"""The Mosaic (TPU) flash kernels against the float64 oracle, and their lowering.

The kernels of `jattn.attention.pallas.mosaic_forward` / `mosaic_backward` run here in
Pallas interpret mode
(`backend="tpu_interpret"`: same grid, scalar prefetch, scratch and index
maps as on a TPU), forward and every gradient, and are lowered for TPU with
`lowering_platforms=("tpu",)`, which runs Mosaic's own checks of block
shapes, layouts and operations on this CPU-only machine. What no test here
can show is that libtpu then compiles them and how fast they run.

The contracts every implementation meets run for these kernels in
tests/test_attention_contract.py (`TestPallasTpuInterpret`, one key tile);
this file holds the TPU tile geometry. Key tiles on TPU are multiples of 128
lanes, so the shapes that exercise several key tiles (and FULL / SKIP tiles)
have S = 200: two key tiles, the second ragged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flash_harness import (
    _check,
    _check_debug_mode,
    _lower_vjp,
    _normal_form,
    _packed,
    _qkv,
)

from jattn.attention.pallas import flash_attention as fa

TPU = "tpu_interpret"
# B, T, S, N, K, H (, Hv): two ragged key tiles of 128; one key tile (S = 36).
LONG = (1, 200, 200, 2, 1, 16, 8)
FAR = (1, 200, 256, 2, 1, 16, 8)  # S a multiple of 128: key tiles can be FULL
CROSS = (2, 40, 200, 4, 2, 16)
SHORT = (2, 40, 36, 2, 2, 16)


def check(inputs, **kw):
    kw.setdefault("block_q", 16)
    kw.setdefault("block_k", None)
    return _check(inputs, backend=TPU, **kw)


@pytest.mark.parametrize(
    "block_q,block_k,case",
    [
        (8, 128, "plain"),  # block_q != block_k, both sides ragged
        (16, None, "mask+bias_keys"),  # bias [B, 1, 1, S]: summed over queries
        (8, None, "bias_rows"),  # bias [B, N, T, 1]: summed over keys
    ],
)
def test_blocks_ragged_bias_and_mask(block_q, block_k, case):
    shape = SHORT if case == "bias_rows" else CROSS
    b, t, s, n = shape[:4]
    inputs = _qkv(20, *shape)
    rng = np.random.default_rng(21)
    if case == "mask+bias_keys":
        inputs["mask"] = rng.random((b, 1, t, s)) > 0.3
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, 1, 1, s)), jnp.float32)
    if case == "bias_rows":
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, n, t, 1)), jnp.float32)
    check(inputs, block_q=block_q, block_k=block_k)


def test_causal_full_bias_skips_and_full_tiles():
    # T = S = 200, causal: the (query tile, key tile 1) blocks above the
    # diagonal are SKIP, those below FULL; the full bias gradient is written
    # for every tile, zero where skipped.
    b, t, s, n = LONG[:4]
    inputs = _qkv(22, *LONG)
    inputs["bias"] = jnp.asarray(np.random.default_rng(23).standard_normal((1, n, t, s)))
    _, grads = check(inputs, is_causal=True)
    above = np.triu(np.ones((t, s), bool), k=1)
    assert np.all(np.asarray(grads["bias"])[:, :, above] == 0.0)


def test_mqa_per_head_mask_scalar_bias():
    # One kv head for four query heads; a per-head mask gives a per-head block map.
    shape = (2, 40, 200, 4, 1, 16)
    b, t, s, n = shape[:4]
    inputs = _qkv(26, *shape)
    inputs["mask"] = np.random.default_rng(27).random((1, n, t, s)) > 0.5
    inputs["bias"] = jnp.asarray([[[[0.3]]]], jnp.float32)
    check(inputs)


def _packed_inputs(dtype=np.float32, per_head=False):
    b, t, _, n, _, h, hv = LONG
    seg, pos = _packed(b, [90, 9, 77, 24])
    inputs = _qkv(28, *LONG, dtype=dtype)
    rng = np.random.default_rng(29)
    lead = (n,) if per_head else ()
    inputs.update(
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=pos,
        kv_positions=pos,
        rel_key=jnp.asarray(rng.standard_normal((*lead, 7, h)), dtype),
        rel_value=jnp.asarray(rng.standard_normal((*lead, 7, hv)), dtype),
    )
    return inputs


@pytest.mark.parametrize("causal,dist", [(False, 3), (True, 20)])
def test_shaw_per_head_tables_far_tiles(causal, dist):
    # T = 200, S = 256 with k = 3: query tiles 0-6 see key tile 1 entirely
    # more than k ahead (FULL_RIGHT, id 2k), tiles 9-12 see key tile 0 more
    # than k behind (FULL_LEFT, id 0); k = 20 with causal: SKIP and near tiles.
    b, t, s, n, _, h, hv = FAR
    inputs = _qkv(31, *FAR)
    rng = np.random.default_rng(32)
    r = 2 * dist + 1
    inputs["rel_key"] = jnp.asarray(rng.standard_normal((n, r, h)), jnp.float32)
    inputs["rel_value"] = jnp.asarray(rng.standard_normal((n, r, hv)), jnp.float32)
    check(inputs, is_causal=causal, max_distance=dist)


def test_tpu_block_validation():
    inputs = _qkv(33, *CROSS)
    nf = _normal_form(inputs, is_causal=False, max_distance=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        fa.flash_attention(nf, block_q=12, block_k=None, backend=TPU)
    with pytest.raises(ValueError, match="block_k must be a multiple of 128"):
        fa.flash_attention(nf, block_q=8, block_k=64, backend=TPU)
    # The backward's own key tiles obey the same layout.
    with pytest.raises(ValueError, match=r"backward_blocks\[1\] must be a multiple of 128"):
        fa.flash_attention(nf, backward_blocks=(8, 64), backend=TPU)
    assert fa.default_blocks("tpu", 8192, 8192) == ((128, 128), (128, 128))
    assert fa.default_blocks("tpu", 20, 36) == ((24, 40), (24, 40))


# --------------------------------------------------------------------------------------
# Lowering for TPU (Mosaic), forward and backward: no TPU needed.


def _lower_for_tpu(dtype, **kw):
    # T = 300: three key tiles of 128, the last ragged; head dim 128 (a lane tile).
    return _lower_vjp("tpu", "tpu", dtype, t=300, h=128, **kw)


@pytest.mark.parametrize(
    "dtype,causal,packed,shaw,bias_shape,mask_shape,window,dropout",
    [
        (jnp.bfloat16, True, False, False, None, None, None, 0.0),
        (jnp.bfloat16, True, True, True, (1, 4, 300, 300), (1, 4, 1, 300), None, 0.0),
        (jnp.float32, False, False, True, (1, 1, 1, 300), None, None, 0.0),
        (jnp.float32, False, False, False, (1, 4, 300, 1), (1, 1, 300, 300), None, 0.0),
        # Local window and dropout (keep-mask hash in-kernel, seed scalar-prefetched).
        (jnp.bfloat16, True, True, True, (1, 4, 300, 300), None, (64, 0), 0.1),
        (jnp.float32, False, False, False, (1, 1, 1, 300), (1, 1, 300, 300), (32, 160), 0.2),
    ],
)
def test_tpu_path_lowers_to_mosaic(
    dtype, causal, packed, shaw, bias_shape, mask_shape, window, dropout
):
    text = _lower_for_tpu(
        dtype,
        causal=causal,
        packed=packed,
        shaw=shaw,
        bias_shape=bias_shape,
        mask_shape=mask_shape,
        window=window,
        dropout_rate=dropout,
    )
    assert text.count("tpu_custom_call") >= 3, "expected the forward, dq and dk/dv kernels"
    for name in ("jattn_flash_fwd_tpu", "jattn_flash_dq_tpu", "jattn_flash_dkv_tpu"):
        assert name in text


# --------------------------------------------------------------------------------------
# Local windows, dropout and strict jax settings in the Mosaic kernels.


@pytest.mark.parametrize("case,window", [("int+bias_full", 40), ("packed+shaw+causal", (12, 0))])
def test_local_window(case, window):
    # T = S = 200, 16 x 128 tiles: a window of 40 leaves key tile 1 out of
    # reach of query tiles 0-4 (SKIP); its full bias gradient is 0 there.
    if case == "packed+shaw+causal":
        check(_packed_inputs(), is_causal=True, max_distance=3, window=window)
        return
    b, t, s, n = LONG[:4]
    inputs = _qkv(60, *LONG)
    inputs["bias"] = jnp.asarray(np.random.default_rng(61).standard_normal((1, n, t, s)))
    _, grads = check(inputs, window=window)
    far = np.abs(np.arange(s)[None, :] - np.arange(t)[:, None]) > window
    assert np.all(np.asarray(grads["bias"])[:, :, far] == 0.0)


@pytest.mark.parametrize(
    "case", ["short+broadcast_batch", "cross_gqa+mask+bias_keys", "packed+shaw+window", "far_shaw"]
)
def test_dropout_matches_xla(case):
    kw = dict(dropout_rate=0.3)
    if case == "short+broadcast_batch":
        inputs = _qkv(62, *SHORT)  # MHA, one key tile, one keep mask for both rows
        kw.update(broadcast_batch=True, is_causal=True)
    elif case == "cross_gqa+mask+bias_keys":
        b, t, s, n = CROSS[:4]
        inputs = _qkv(63, *CROSS)
        rng = np.random.default_rng(64)
        inputs["mask"] = rng.random((b, 1, t, s)) > 0.3
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, 1, 1, s)), jnp.float32)
    elif case == "packed+shaw+window":
        inputs = _packed_inputs()
        kw.update(is_causal=True, max_distance=3, window=(30, 0), dropout_rate=0.5)
    else:  # S = 256, k = 3, not causal: FULL_LEFT / FULL_RIGHT key tiles with dropout
        b, t, s, n, _, h, hv = FAR
        inputs = _qkv(65, *FAR)
        rng = np.random.default_rng(66)
        inputs["rel_key"] = jnp.asarray(rng.standard_normal((n, 7, h)), jnp.float32)
        inputs["rel_value"] = jnp.asarray(rng.standard_normal((n, 7, hv)), jnp.float32)
        kw.update(max_distance=3, dropout_rate=0.2)
    inputs["dropout_rng"] = jax.random.PRNGKey(67)
    out, _ = check(inputs, **kw)
    no_drop = {k: v for k, v in kw.items() if k not in ("dropout_rate", "broadcast_batch")}
    kept, _ = check(inputs, **no_drop)
    assert not np.allclose(out, kept, atol=1e-3)


@pytest.mark.parametrize("setting", ["rank_promotion_raise", "debug_infs", "debug_nans"])
def test_strict_jax_settings(setting):
    _check_debug_mode(setting, backend=TPU, block_q=8, block_k=None)
