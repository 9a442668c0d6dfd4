"""The attention contracts of tests/attention_contract.py, once per implementation.

Each class only says how to call its implementation: xla (the readable
reference), chunked with small 4 x 5 tiles so every case crosses tile
borders and ends on a ragged tile, and the Pallas kernels in interpret mode:
the Triton-style kernels (`implementation="pallas"` on the CPU) and the
Mosaic (TPU) kernels (`tpu_interpret`: the TPU grid, scalar prefetch and
index maps), both with 16-row query tiles.
"""

from __future__ import annotations

from attention_contract import AttentionContract

from jattn.attention import IMPLEMENTATIONS
from jattn.attention.pallas import flash_attention as fa


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
