"""`flash_attention(nf, backend="mosaic_gpu")`: the Mosaic GPU kernels, plain attention only.

The Triton kernels (`triton_forward`, `triton_backward`) carry every
feature of the normal form; these carry the plain case at Hopper's
instructions (wgmma from shared memory, TMA copies, a memory warpgroup
beside the compute ones: `mosaic_gpu_forward`, `mosaic_gpu_backward`), the
road past what Triton's lowering reaches. What they take, and everything
else refused in one line by `plain_problem`:

- query, key and value bfloat16 or float16, all one dtype; head dim 64 or
  128, the value's the key's; K kv heads dividing the N query heads (GQA);
- causal (query i sees key j <= i, default positions) or not;
- no bias, mask, segment ids, positions, window, dropout, Shaw tables,
  score mod or row/column terms;
- lengths multiples of the tiles (`Tiles.multiple`, 128 by default):
  ragged ends are not masked in these kernels.

Non-finite keys and values are handled as the Triton path does (the
normal form's contract): entries zeroed before the kernels and a NaN
poison added to the keys the forward reads, so only a query that sees a
non-finite key gets NaN (`scores.finite_keys`; skipped with
`assume_finite`). The custom VJP runs the forward, then `delta =
rowsum(dO * O)` in XLA, then the dq and dk/dv kernels.

The kernels run on an sm_90a GPU (H100, H200); on this project's CPUs they
lower for CUDA, compile for a compile-only H100 (`benchmarks/aot.py
--target mosaic_gpu`) and run in Pallas's Mosaic GPU interpret mode
(`Tiles(interpret=...)`, the tests), where the dots are jnp's
(`mosaic_gpu_forward.accumulate`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jattn.attention import scores
from jattn.attention.normal_form import NormalForm

Array = jax.Array

__all__ = ["DTYPES", "HEAD_DIMS", "Tiles", "check_tiles", "mosaic_gpu_attention", "plain_problem"]

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
_ROWS = 64  # a compute warpgroup's rows (`mosaic_gpu_backward.ROWS`)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernels' static tiling (hashable: a custom VJP's static argument).

    Each compute warpgroup owns 64 rows (one wgmma M tile): query rows in
    the forward and dq kernels, key rows in the dk/dv kernel; a block runs
    `compute_wgs` of them beside the memory warpgroup. `block_k`: the key
    tile the forward streams; `dq_block_k`: the dq kernel's; `dkv_block_q`:
    the query tile the dk/dv kernel streams; `stages`: ring slots.
    `interpret`: None to compile, or a Pallas `InterpretGPUParams` (CPU
    tests). The defaults are the tiles the AOT table holds spill-free for
    sm_90a at head dims 64 and 128 (docs/gpu.md, "The Mosaic GPU variant"):
    the forward's 128-key tiles keep `S` and `O` at 64 registers each a
    thread at head dim 128; the backward's 64-wide tiles leave room for dk
    and dv's two `[64, H]` accumulators.
    """

    block_k: int = 128
    dq_block_k: int = 64
    dkv_block_q: int = 64
    compute_wgs: int = 2
    stages: int = 2
    interpret: object = None

    @property
    def block_q(self) -> int:
        return _ROWS

    @property
    def multiple(self) -> tuple[int, int]:
        """What the query and key lengths must be multiples of: a block's
        rows (`compute_wgs` x 64) and every tile streamed along them."""
        rows = self.compute_wgs * _ROWS
        return math.lcm(rows, self.dkv_block_q), math.lcm(rows, self.block_k, self.dq_block_k)


def check_tiles(tiles: Tiles) -> Tiles:
    """`tiles` if the kernels can run it, else a one-line `ValueError`: key
    and query tiles multiples of 64 (the 128-byte swizzle of a bf16 row,
    and wgmma's N granule), 1 or 2 compute warpgroups, 2 to 4 stages."""
    if not isinstance(tiles, Tiles):
        raise ValueError(f"mosaic_gpu: tiles must be a Tiles, got {type(tiles).__name__}")
    for name in ("block_k", "dq_block_k", "dkv_block_q"):
        value = getattr(tiles, name)
        if value < 64 or value % 64 or value > 256:
            raise ValueError(f"mosaic_gpu: {name} must be 64, 128, 192 or 256, got {value}")
    if tiles.compute_wgs not in (1, 2):
        raise ValueError(f"mosaic_gpu: compute_wgs must be 1 or 2, got {tiles.compute_wgs}")
    if not 2 <= tiles.stages <= 4:
        raise ValueError(f"mosaic_gpu: stages must be 2, 3 or 4, got {tiles.stages}")
    return tiles


def plain_problem(nf: NormalForm, tiles: Tiles = Tiles()) -> str | None:
    """Why the Mosaic GPU kernels cannot run `nf` (one line), or None."""
    features = dict(
        bias=nf.bias is not None,
        mask=nf.mask is not None,
        segment_ids_or_lengths=nf.visibility.q_segment_ids is not None,
        positions=not nf.visibility.default_positions,
        local_window_size=nf.visibility.local_window_size is not None,
        dropout=nf.dropout,
        relative=nf.shaw,
        score_mod=nf.score_mod is not None,
        row_col_bias=nf.row_bias is not None,
    )
    if given := [name for name, on in features.items() if on]:
        return f"runs plain attention only (causal or not), got {', '.join(given)}"
    q, k, v = nf.query, nf.key, nf.value
    dtypes = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        return f"takes query, key and value all bfloat16 or all float16, got {sorted(dtypes)}"
    h, hv = q.shape[-1], v.shape[-1]
    if h not in HEAD_DIMS or hv != h:
        return f"takes head dims {HEAD_DIMS} (value's = key's), got {h} and {hv}"
    (mt, ms), t, s = tiles.multiple, q.shape[1], k.shape[1]
    if t % mt or s % ms:
        return f"takes query lengths a multiple of {mt} and key lengths of {ms}, got {t} and {s}"
    return None


def mosaic_gpu_attention(nf: NormalForm, tiles: Tiles = Tiles()) -> tuple[Array, Array]:
    """`(out [B, T, N, H] q.dtype, lse [B, T, N] float32, natural units)` of a
    plain normal form by the Mosaic GPU kernels; `ValueError` (one line)
    for anything else."""
    tiles = check_tiles(tiles)
    if problem := plain_problem(nf, tiles):
        raise ValueError(f'flash_attention(backend="mosaic_gpu") {problem}')
    key, value, poison = scores.finite_keys(nf.key, nf.value, nf.assume_finite)
    causal = bool(nf.visibility.is_causal)
    out, lse = _attention(causal, float(nf.scale), tiles, nf.query, key, value, poison)
    return out, jnp.swapaxes(lse, 1, 2) * math.log(2.0)  # base 2 -> natural


def _forward(causal, scale, tiles, q, k, v, poison):
    from jattn.attention.pallas import mosaic_gpu_forward

    keys = k + poison[..., None].astype(k.dtype)  # NaN rows where a key was not finite
    return mosaic_gpu_forward.flash_forward(q, keys, v, causal=causal, scale=scale, tiles=tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(causal, scale, tiles, q, k, v, poison):
    return _forward(causal, scale, tiles, q, k, v, poison)


def _attention_fwd(causal, scale, tiles, q, k, v, poison):
    out, lse = _forward(causal, scale, tiles, q, k, v, poison)
    return (out, lse), (q, k, v, poison, out, lse)


def _attention_bwd(causal, scale, tiles, res, cts):
    from jattn.attention.pallas import mosaic_gpu_backward

    q, k, v, poison, out, lse = res
    do = cts[0].astype(q.dtype)  # the lse's cotangent is ignored, as in the Triton path
    delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32))
    kw = dict(causal=causal, scale=scale, tiles=tiles)
    dq = mosaic_gpu_backward.flash_dq(q, k, v, do, lse, delta, **kw)
    dk, dv = mosaic_gpu_backward.flash_dkv(q, k, v, do, lse, delta, **kw)
    return dq, dk, dv, jnp.zeros_like(poison)


_attention.defvjp(_attention_fwd, _attention_bwd)
