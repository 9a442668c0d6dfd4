"""The Mosaic GPU kernels' tile ring: one warpgroup streams tiles, the others compute.

Every Mosaic GPU kernel of jattn (`mosaic_gpu_forward`, `mosaic_gpu_backward`)
runs `compute_wgs` compute warpgroups and one memory warpgroup in each block.
The memory warpgroup copies a sequence of tiles (the key and value tiles of a
query tile, or the query-side tiles of a key tile) from global memory into a
ring of `stages` shared-memory slots with the TMA unit, so the copy of the
next tiles overlaps the compute warpgroups' work on this one. Two barriers a
slot carry the protocol:

- `ready[buffer][slot]`: the TMA copy of that buffer's tile has landed (one
  barrier per buffer, since each copy arrives on its barrier once with its
  own byte count);
- `consumed[slot]`: every compute warpgroup is done reading the slot
  (`compute_wgs` arrivals), so the memory warpgroup may refill it.

Both sides walk the same steps 0, 1, ..., count - 1 in order (step i in slot
`i % stages`), waiting on each barrier once a phase, which is what Mosaic
GPU's phase tracking expects. A compute warpgroup that has nothing to do
with a step (a causal tile past its own rows) still waits for it and
releases it (`skip`): the other warpgroup of its block may need the tile,
and a barrier phase cannot be left out.

The two roles are the two branches of one `lax.cond` (`specialise`), not
two `pl.when`s one after the other: with two `if`s, whatever the memory
warpgroup's code reads (barrier and shared-memory addresses computed before
the split) is live, for ptxas, through all of the compute code, where the
accumulators leave no register for it, and it spilled (docs/gpu.md, "The
Mosaic GPU variant").

Why a hand-written ring and not `plgpu.emit_pipeline_warp_specialized`:
the causal kernels stream a number of tiles known only at run time (the
visible ones), per block, and the warpgroups of one block need different
sub-ranges of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = [
    "MEMORY_REGISTERS",
    "Ring",
    "compute_registers",
    "feed",
    "feed_keys_values",
    "release",
    "skip",
    "specialise",
    "take",
]

# Registers a thread of the memory warpgroup keeps: it only issues TMA copies
# and waits on barriers, so setmaxnreg's floor, 24, as FlashAttention 3's
# TMA producer beside two consumer warpgroups; the compute warpgroups get the
# rest of the SM's 64K (`compute_registers`: 240 with two). At 40 (232 for
# the compute ones) the causal dk/dv kernel at head dim 128 spilled under jax
# 0.12.1's lowering (docs/gpu.md, "The Mosaic GPU variant").
MEMORY_REGISTERS = 24
_SM_REGISTERS = 65536
_WARPGROUP_THREADS = 128


def compute_registers(compute_wgs: int) -> int:
    """Registers a compute thread may take with `compute_wgs` compute warpgroups
    beside the memory one: what the SM's 64K leave, rounded down to a multiple
    of 8 (`setmaxnreg`'s granule) and capped at 240 (two compute warpgroups
    get 240, as in FlashAttention 3 with TMA loads)."""
    left = _SM_REGISTERS - _WARPGROUP_THREADS * MEMORY_REGISTERS
    return min(240, left // (compute_wgs * _WARPGROUP_THREADS) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class Ring:
    """The shared-memory ring of one kernel: `buffers[b]` `[stages, *tile]`,
    `ready[b]` (a barrier a slot, per buffer) and `consumed` (a barrier a
    slot, `compute_wgs` arrivals)."""

    buffers: tuple
    ready: tuple
    consumed: object
    stages: int

    def slot(self, step):
        return lax.rem(step, jnp.asarray(self.stages, jnp.int32))


def feed(ring: Ring, count, sources: Callable[[jax.Array], tuple]) -> None:
    """The memory warpgroup: copies steps `0 .. count - 1` into the ring.
    `sources(step)` gives the global-memory refs of that step's tiles, one a
    buffer. A slot is refilled once every compute warpgroup released it;
    at the end it waits for the release of the last `stages` steps too, so
    that it has seen every phase of the `consumed` barriers (Pallas's
    interpret mode checks that; on the GPU it costs the block nothing, the
    compute warpgroups being the last to finish anyway)."""

    @pl.loop(0, count)
    def _(step):
        slot = ring.slot(step)

        @pl.when(step >= ring.stages)
        def _():
            plgpu.barrier_wait(ring.consumed.at[slot])

        for buffer, ready, src in zip(ring.buffers, ring.ready, sources(step), strict=True):
            plgpu.copy_gmem_to_smem(src, buffer.at[slot], ready.at[slot])

    @pl.loop(jnp.maximum(count - ring.stages, 0), count)
    def _(step):
        plgpu.barrier_wait(ring.consumed.at[ring.slot(step)])


def feed_keys_values(ring: Ring, count, k_ref, v_ref, batch, head, group: int, bk: int) -> None:
    """The memory warpgroup of a kernel that streams one query head's keys and
    values (the forward and the dq kernel): gives up registers, then `feed`s the
    `bk`-key tiles `0 .. count - 1` of kv head `head // group`."""
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
    kv_head = lax.div(head, jnp.int32(group))

    def sources(j):
        keys = (batch, pl.ds(j * bk, bk), kv_head)
        return k_ref.at[keys], v_ref.at[keys]

    feed(ring, count, sources)


def specialise(wg, compute_wgs: int, compute: Callable[[], None], memory: Callable[[], None]):
    """Runs `compute()` in warpgroups `0 .. compute_wgs - 1` and `memory()` in
    the last one, as the two exclusive branches of one conditional (see the
    module docstring for why not two `pl.when`s)."""
    lax.cond(wg < compute_wgs, compute, memory)


def take(ring: Ring, step) -> tuple:
    """A compute warpgroup: waits for step `step`'s tiles; the slot's views
    of every buffer."""
    slot = ring.slot(step)
    for ready in ring.ready:
        plgpu.barrier_wait(ready.at[slot])
    return tuple(buffer.at[slot] for buffer in ring.buffers)


def release(ring: Ring, step) -> None:
    """A compute warpgroup is done reading step `step`'s slot."""
    plgpu.barrier_arrive(ring.consumed.at[ring.slot(step)])


def skip(ring: Ring, lo, hi) -> None:
    """A compute warpgroup passes steps `lo .. hi - 1` it has no work in."""

    @pl.loop(lo, hi)
    def _(step):
        take(ring, step)
        release(ring, step)
