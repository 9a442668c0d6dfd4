"""The attention contracts of tests/attention_contract.py, once per implementation.

Each class only says how to call its implementation: xla (the readable
reference), chunked with small 4 x 5 tiles so every case crosses tile
borders and ends on a ragged tile, and the Pallas kernels in interpret mode:
the Triton-style kernels (`implementation="pallas"` on the CPU) and the
Mosaic (TPU) kernels (`tpu_interpret`: the TPU grid, scalar prefetch and
index maps), both with 16-row query tiles.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from attention_cases import normal_form
from attention_contract import AttentionContract

import jattn
from jattn.attention import IMPLEMENTATIONS
from jattn.attention.chunked_problem import plan_tiles
from jattn.attention.pallas import flash_attention as fa
from jattn.attention.pallas.blockmap import block_map
from jattn.attention.tiles import SKIP


def _xla(nf):
    return IMPLEMENTATIONS["xla"](nf)


def _chunked(nf):
    return IMPLEMENTATIONS["chunked"](nf, block_q=4, block_k=5)


def _pallas(nf):
    return IMPLEMENTATIONS["pallas"](nf, block_q=16, block_k=16)


def _pallas_tpu(nf):
    # One key tile (TPU key tiles are multiples of 128 lanes or hold every key).
    return fa.flash_attention(
        nf, block_q=16, block_k=None, backend="tpu_interpret", backward="split", num_warps=None
    )


class TestXla(AttentionContract):
    attend = _xla
    name = "xla"


class TestChunked(AttentionContract):
    attend = _chunked
    name = "chunked"


class TestPallas(AttentionContract):
    attend = _pallas
    name = "pallas"


class TestPallasTpuInterpret(AttentionContract):
    attend = _pallas_tpu


def _pallas_fused(nf):
    return IMPLEMENTATIONS["pallas"](nf, block_q=16, block_k=16, backward="fused")


def _pallas_atomic(nf):
    return IMPLEMENTATIONS["pallas"](nf, block_q=16, block_k=16, backward="atomic")


def _contract(attend):
    return type("Contract", (AttentionContract,), {"attend": attend})()


# The fused and atomic backwards (`TestPallas` runs the split one) hold the
# float32-extremes contract too: their tiles split float32 operands for the tensor
# cores as the split kernels do, and the atomic one adds dq from its dk/dv tiles.
# The rest of the contract is the same kernel code's.
OTHER_BACKWARDS = [
    pytest.param(_pallas_fused, id="fused"),
    pytest.param(_pallas_atomic, id="atomic"),
]


@pytest.mark.parametrize("attend", OTHER_BACKWARDS)
@pytest.mark.parametrize("rule", ["segment_0", "mask"])
def test_other_backwards_never_see_float32_max_behind_masks(attend, rule):
    _contract(attend).test_float32_max_behind_masks_is_never_seen(rule)


@pytest.mark.parametrize("attend", OTHER_BACKWARDS)
def test_other_backwards_take_float32_max_in_visible_keys(attend):
    _contract(attend).test_float32_max_in_visible_keys_and_values()


def test_padded_tiles_are_skipped():
    """A tile of padding only, given as segment id 0 or as lengths, is
    SKIP in the chunked plan and in the kernels' block map (docs/design.md:
    "padded tiles are skipped"); a tile with one real token is not."""
    b, t, bq = 2, 48, 16
    x = np.zeros((b, t, 1, 8), np.float32)
    ids = np.where(np.arange(t) < 20, 1, 0)[None].repeat(b, 0).astype(np.int32)  # tile 2 padding
    ones = np.ones_like(ids)
    lengths = np.full(b, 20, np.int32)
    for padding in (
        dict(q_segment_ids=ids, kv_segment_ids=ids),
        dict(
            q_segment_ids=ones,
            kv_segment_ids=ones,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
        ),
    ):
        nf = normal_form(x, x, x, **padding)
        plan = np.asarray(plan_tiles(nf, bq, bq).cls)  # [nT, nS]
        classes = np.asarray(
            block_map(
                vis=nf.visibility.replace(q_positions=None, kv_positions=None),
                mask=None,
                max_distance=None,
                seq_k=t,
                block_q=bq,
                block_k=bq,
                padded_q=t,
                padded_k=t,
                batch=b,
            )
        )  # [B, 1, nT, nS]
        for cls in (plan, classes[0, 0], classes[1, 0]):
            assert np.all(cls[2, :] == SKIP) and np.all(cls[:, 2] == SKIP), cls
            assert np.all(cls[:2, :2] != SKIP), cls


def test_the_public_call_takes_a_traced_scale():
    """The call of issue 38 (jax.jit over the scale, as jax.nn allows)."""
    q = np.random.default_rng(0).standard_normal((1, 5, 2, 4)).astype(np.float32)
    f = jax.jit(lambda q, k, v, s: jattn.dot_product_attention(q, k, v, scale=s))
    np.testing.assert_allclose(
        f(q, q, q, 0.7), jattn.dot_product_attention(q, q, q, scale=0.7), rtol=1e-6, atol=1e-6
    )
