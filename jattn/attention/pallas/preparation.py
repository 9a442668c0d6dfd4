"""What a flash call prepares before its kernels run: tiles, padding, tables, block maps, configs.

`prepare(nf, options)` turns the normal form of `jattn.attention` into the
kernels' padded inputs and static configs (`Prepared`), all in XLA:

1. the tiles and Triton warps of the forward kernel and of each backward
   kernel: the backend's defaults (`backend.default_blocks`,
   `backend.default_warps`), under `block_q` / `block_k` / `num_warps`, under
   `backward_blocks` / `backward_warps` for the backward only, under
   `BackwardTiles` for the dq or the dk/dv kernel alone (`_tilings`,
   `_backward_warps`; `backward="atomic"` has the dk/dv kernel's only,
   `_atomic_tiles`);
2. the Shaw tables moved out of the inner loop: the key term becomes a
   per-query table `qr = scale * q @ key_tableᵀ` (`[B, T, N, 2k+1]`, one XLA
   matmul) that the kernel reads one column per relative id; the value term
   comes back from the kernel as the weight mass per relative id (`pr`),
   which `flash_attention` multiplies by the value table. Neither a
   `[T, S, H]` tensor nor a `[T, S]` mask ever exists;
3. lengths padded to every tiling (and head dims to powers of two on the
   GPU); padded keys are masked in-kernel, padded queries sliced away by
   the caller;
4. per tiling, the block map: per (query tile, key tile) a class of
   `jattn.attention.tiles` (SKIP / PARTIAL / FULL_LEFT / FULL_RIGHT) from
   the tiles' min/max positions and segment ids, the causal and
   local-window rules and, if given, the user mask; and per row / column
   the loop bounds, so tiles outside a window are never visited. It is
   O((T/bq)·(S/bk)), and a function of the shapes alone (built once in
   numpy, `blockmap.static_tiling`) when nothing in it depends on the data;
5. a score mod's leaves in kernel shapes, checked lowerable at every tiling
   (`score_mod_checks`), or a distance-table mod's Toeplitz tiles, one set
   per distinct tiling (`distance_tiles`);
6. non-finite key and value entries zeroed (`scores.finite_keys`), the
   keys that had one marked by a NaN poison the forward kernel adds back;
7. the row and column terms (`row_col_bias`) in float32, zero-padded to
   `[B, N, Tp, 1]` and `[B, N, 1, Sp]`: the kernels read them as biases of
   those shapes (`config.ROW_DIMS`, `COL_DIMS`), O(T + S) a head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jattn.attention import scores
from jattn.attention.normal_form import NormalForm
from jattn.attention.pallas import distance_tiles, score_mod_checks, score_mod_tiles
from jattn.attention.pallas.backend import (
    TPU_BACKENDS,
    check_backward,
    check_block,
    check_precision,
    default_backward_stages,
    default_blocks,
    default_warps,
    pad_size,
    pow2_size,
)
from jattn.attention.pallas.blockmap import static_tiling, tiling
from jattn.attention.pallas.config import (
    BackwardTiles,
    FixedInputs,
    KernelConfig,
    TileMaps,
    dkv_config,
)
from jattn.attention.tiles import pad_axis

Array = jax.Array

__all__ = ["KernelOptions", "Prepared", "prepare"]

_HIGHEST = jax.lax.Precision.HIGHEST

# (block_q, block_k) of one kernel's tiling.
Blocks = tuple[int, int]


class Prepared(NamedTuple):
    """Padded kernel inputs and static configs of one call (see `prepare`)."""

    fwd_cfg: KernelConfig
    bwd_cfg: KernelConfig
    q: Array  # [B, Tp, N, Hp]
    k: Array  # [B, Sp, K, Hp]
    v: Array  # [B, Sp, K, Hvp]
    qr: Array | None  # [B, Tp, N, Rp] float32
    bias: Array | None  # [B|1, N|1, Tp|1, Sp|1]
    mod: tuple[Array, ...] | None  # the score mod's leaves, in kernel shapes
    fixed: FixedInputs  # positions, segment ids, int mask, dropout seed, block maps
    # The row and column terms, float32 [B, N, Tp, 1] and [B, N, 1, Sp] (zero padding).
    row_col: tuple[Array, Array] | None = None

    @property
    def dkv_cfg(self) -> KernelConfig:
        """The split backward's dk/dv kernel's config (`config.dkv_config`)."""
        return dkv_config(self.bwd_cfg)


def _check_warps(num_warps, backward_warps, tiles: BackwardTiles) -> None:
    """Every warp count given is a power of two (Triton's)."""
    warp_args = (
        ("num_warps", num_warps),
        ("backward_warps", backward_warps),
        ("backward_tiles.dq_warps", tiles.dq_warps),
        ("backward_tiles.dkv_warps", tiles.dkv_warps),
    )
    for name, warps in warp_args:
        if warps is not None and (warps < 1 or warps & (warps - 1)):
            raise ValueError(f"flash_attention: {name} must be a power of two, got {warps}")


def _tilings(
    nf: NormalForm,
    backend: str,
    backward: str,
    spec,
    block_q: int | None,
    block_k: int | None,
    backward_blocks: Blocks | None,
    tiles: BackwardTiles,
) -> tuple[Blocks, Blocks, Blocks]:
    """`(forward, dq, dk/dv)` tiles: the defaults under `block_q` / `block_k`,
    under `backward_blocks` (the backward's), under `tiles` (one backward
    kernel's); the dq kernel's tiling is the backward config's own (also the
    fused kernel's, the Mosaic kernels' and the distance tiles' gradient's)."""
    t, s = nf.query.shape[1], nf.value.shape[1]
    h, hv = nf.query.shape[-1], nf.value.shape[-1]
    (fwd_q, fwd_k), (bwd_q, bwd_k) = default_blocks(
        backend,
        t,
        s,
        nf.shaw,
        max(h, hv),
        nf.query.dtype,
        score_mod=nf.score_mod is not None,
        loop_mod=spec is not None and backend == "gpu" and score_mod_checks.has_loop(spec),
    )
    if block_q is not None:
        fwd_q = bwd_q = check_block("block_q", block_q, backend, t)
    if block_k is not None:
        fwd_k = bwd_k = check_block("block_k", block_k, backend, s)

    def blocks(name: str, given, default: Blocks) -> Blocks:
        if given is None:
            return default
        if len(given) != 2:
            raise ValueError(f"flash_attention: {name} is (block_q, block_k), got {given!r}")
        return (
            check_block(f"{name}[0]", given[0], backend, t),
            check_block(f"{name}[1]", given[1], backend, s),
        )

    bwd = blocks("backward_blocks", backward_blocks, (bwd_q, bwd_k))
    dq = blocks("backward_tiles.dq_blocks", tiles.dq_blocks, bwd)
    dkv = blocks("backward_tiles.dkv_blocks", tiles.dkv_blocks, bwd)
    if backward == "fused" and dkv != dq:
        raise ValueError(
            'flash_attention: backward="fused" runs one tiling for dq and dk/dv, got dq tiles '
            f"{dq} and dk/dv tiles {dkv}"
        )
    return (fwd_q, fwd_k), dq, dkv


def _mod_inputs(nf: NormalForm, backend: str, spec, leaves, tilings, padded_t, padded_s):
    """The score mod's kernel inputs: a distance-table mod's Toeplitz tiles, one
    per tiling (`fn` never runs in a kernel), or the leaves of a mod checked
    lowerable at every tiling; None without a mod."""
    if distance_tiles.applies(nf, backend):
        n = nf.query.shape[2]
        build = functools.partial(distance_tiles.build, nf.score_mod, n, padded_t, padded_s)
        built: dict[Blocks, Array] = {}  # one tile set per distinct tiling
        for blocks in tilings:
            if blocks not in built:
                built[blocks] = build(*blocks)
        return tuple(built[blocks] for blocks in tilings)
    if spec is None:
        return None
    for bq, bk in set(tilings):
        score_mod_checks.check_lowerable(spec, backend, bq, bk)
    return score_mod_tiles.kernel_leaves(spec, leaves)


def _backward_warps(
    nf: NormalForm,
    spec,
    dq: Blocks,
    dkv: Blocks,
    tiles: BackwardTiles,
    backward: str,
    backward_warps: int | None,
    num_warps: int | None,
) -> tuple[int, tuple[int, int, int] | None]:
    """`(dq kernel's warps, the dk/dv kernel's own tiling or None)`: each
    kernel's from `tiles`, else `backward_warps`, else `num_warps`, else the
    default (`backend.default_warps`); the dk/dv kernel has a tiling of its
    own where its tiles or warps differ from dq's."""
    dtype = nf.query.dtype
    wide_f32 = _wide_f32(nf)

    def light_mod(bq: int, bk: int) -> bool:
        # A light score mod's 16-bit backward tiles take 2 warps (backend.default_warps).
        return (
            spec is not None
            and dtype != jnp.float32
            and score_mod_checks.backward_cost(spec, bq, bk) <= score_mod_checks.LIGHT_MOD_COST
        )

    def warps(own: int | None, bq: int, bk: int) -> int:
        return (
            own
            or backward_warps
            or num_warps
            or default_warps(bq, light_mod=light_mod(bq, bk), wide_f32=wide_f32)
        )

    dq_warps = warps(tiles.dq_warps, *dq)
    dkv_warps = warps(tiles.dkv_warps, *dkv)
    if dkv == dq and dkv_warps == dq_warps:
        return dq_warps, None
    if backward == "fused":
        raise ValueError(
            'flash_attention: backward="fused" runs one kernel; give it one warp count, '
            f"got dq {dq_warps} and dk/dv {dkv_warps}"
        )
    return dq_warps, (*dkv, dkv_warps)


def _wide_f32(nf: NormalForm) -> bool:
    """float32 at head dim > 64: 8 warps (`backend.default_warps`), backward stages."""
    width = max(nf.query.shape[-1], nf.value.shape[-1])
    return nf.query.dtype == jnp.float32 and width > 64


def _atomic_tiles(tiles: BackwardTiles) -> BackwardTiles:
    """`backward="atomic"` runs the dk/dv kernel alone: its tiles and warps
    become the whole backward's (the dq tiling of the config, as for the
    fused kernel), and a dq kernel's own are refused, not ignored."""
    if tiles.dq_blocks is not None or tiles.dq_warps is not None:
        raise ValueError(
            'flash_attention: backward="atomic" runs no dq kernel; give its tiles as '
            "backward_blocks / backward_warps or backward_tiles.dkv_blocks / dkv_warps"
        )
    return dataclasses.replace(tiles, dq_blocks=tiles.dkv_blocks, dq_warps=tiles.dkv_warps)


class KernelOptions(NamedTuple):
    """How a flash call runs its kernels, as `flash_attention`'s keywords give it
    (each documented there): one value from the public call to `prepare`.

    `backend` is explicit here ("gpu", "interpret", "tpu", "tpu_interpret");
    None tiles and warps take the backend's defaults.
    """

    backend: str
    block_q: int | None = None
    block_k: int | None = None
    backward: str = "split"
    num_warps: int | None = None
    precision: str | None = None
    backward_blocks: tuple[int, int] | None = None
    backward_warps: int | None = None
    backward_tiles: BackwardTiles | None = None


def prepare(nf: NormalForm, options: KernelOptions) -> Prepared:
    """Everything before the kernels: tile sizes, padding, the Shaw key-term
    table, block maps and bounds, static configs (see the module docstring)."""
    block_q, block_k, backend = options.block_q, options.block_k, options.backend
    backward, num_warps = options.backward, options.num_warps
    backward_blocks, backward_warps = options.backward_blocks, options.backward_warps
    check_backward(backward)
    precision = check_precision(options.precision)
    tiles_ = options.backward_tiles or BackwardTiles()
    if not isinstance(tiles_, BackwardTiles):
        raise ValueError(
            f"flash_attention: backward_tiles must be a BackwardTiles, got {type(tiles_).__name__}"
        )
    _check_warps(num_warps, backward_warps, tiles_)
    if backward == "atomic":
        tiles_ = _atomic_tiles(tiles_)
    query, key, value, bias, mask = nf.query, nf.key, nf.value, nf.bias, nf.mask
    b, t, n, h = query.shape
    _, s, kh, hv = value.shape
    use_qr, use_pr = nf.rel_key is not None, nf.rel_value is not None
    # A per-logit score mod's spec (a distance mod read from Toeplitz tiles
    # has none: its function never runs in a kernel).
    use_tiles = distance_tiles.applies(nf, backend)
    spec = leaves = None
    if nf.score_mod is not None and not use_tiles:
        spec, leaves = score_mod_tiles.mod_spec(nf.score_mod, backend)
    fwd, dq, dkv = _tilings(nf, backend, backward, spec, block_q, block_k, backward_blocks, tiles_)
    tilings = (fwd, dq, dkv)  # the forward's, the dq kernel's and the dk/dv kernel's
    # Lengths padded to every tiling; on the GPU head dims and the relative
    # tables' width padded to powers of two (Triton blocks).
    padded_t = pad_size(t, math.lcm(*(bq for bq, _ in tilings)))
    padded_s = pad_size(s, math.lcm(*(bk for _, bk in tilings)))
    gpu = backend == "gpu"
    padded_h = max(16, pow2_size(h)) if gpu else h
    padded_hv = max(16, pow2_size(hv)) if gpu else hv
    num_rel = 2 * nf.max_distance + 1
    padded_rel = max(16, pow2_size(num_rel)) if gpu else num_rel
    vis = nf.visibility
    map_pos = vis.is_causal or nf.shaw or vis.local_window_size is not None
    # A score mod reads the positions of every tile (the block map does not).
    use_pos = map_pos or (nf.score_mod is not None and not use_tiles)
    use_seg = vis.segments
    mod = _mod_inputs(nf, backend, spec, leaves, tilings, padded_t, padded_s)
    f32 = jnp.float32

    # Shaw key term as a per-query table (scaled), padded to the table width.
    qr = None
    if use_qr:
        qr = nf.scale * jnp.einsum(
            "BTNH,NRH->BTNR",
            query.astype(f32),
            nf.rel_key.astype(f32),
            precision=_HIGHEST,
        )  # [B, T, N, R]
        qr = pad_axis(pad_axis(qr, 3, padded_rel), 1, padded_t)

    # Non-finite key / value entries zeroed; poison [B, S, K] marks their keys.
    key, value, poison = scores.finite_keys(key, value, nf.assume_finite)
    # One dtype for the kernel's dots (the Triton dot needs equal operand types).
    q = pad_axis(pad_axis(query, 3, padded_h), 1, padded_t)
    k = pad_axis(pad_axis(key.astype(query.dtype), 3, padded_h), 1, padded_s)
    v = pad_axis(pad_axis(value.astype(query.dtype), 3, padded_hv), 1, padded_s)

    def full_axes(x):  # which of (B, N, T, S) x has in full
        return tuple(bool(x.shape[a] == size) for a, size in enumerate((b, n, t, s)))

    def pad_lengths(x, dims):
        x = pad_axis(x, 2, padded_t) if dims[2] else x
        return pad_axis(x, 3, padded_s) if dims[3] else x

    bias_padded = bias_dims = None
    if bias is not None:
        bias_dims = full_axes(bias)
        bias_padded = pad_lengths(bias, bias_dims)
    row_col = None
    if nf.row_bias is not None:
        row = pad_axis(nf.row_bias.astype(f32), 2, padded_t)[..., None]  # [B, N, Tp, 1]
        col = pad_axis(nf.col_bias.astype(f32), 2, padded_s)[:, :, None, :]  # [B, N, 1, Sp]
        row_col = (row, col)
    mask_padded = mask_dims = None
    if mask is not None:
        mask_dims = full_axes(mask)
        # int8 for Triton; int32 for Mosaic, whose int8 blocks need 32-row tiles.
        mask_padded = pad_lengths(
            mask.astype(jnp.int32 if backend in TPU_BACKENDS else jnp.int8), mask_dims
        )

    map_args = dict(
        vis=vis if map_pos else vis.replace(q_positions=None, kv_positions=None),
        mask=mask,
        max_distance=nf.max_distance if nf.shaw else None,
        seq_k=s,
        batch=b,
    )
    edge = lambda x, size: pad_axis(x, 1, size, "edge")

    def maps(bq: int, bk: int) -> TileMaps:
        # Nothing data-dependent (default positions, no segments or mask):
        # the map is a function of the shapes alone, built once in numpy and
        # cached (`blockmap.static_tiling`); else built in XLA per call.
        if vis.default_positions and not use_seg and mask is None:
            return static_tiling(
                batch=b,
                causal=vis.is_causal,
                window=vis.local_window_size,
                max_distance=nf.max_distance if nf.shaw else None,
                seq_q=t,
                seq_k=s,
                block_q=bq,
                block_k=bk,
                padded_q=padded_t,
                padded_k=padded_s,
            )
        return tiling(map_args, bq, bk, padded_t, padded_s)

    fixed = FixedInputs(
        q_positions=edge(vis.q_positions, padded_t) if use_pos else None,
        kv_positions=edge(vis.kv_positions, padded_s) if use_pos else None,
        q_segments=edge(vis.q_segment_ids, padded_t) if use_seg else None,
        kv_segments=edge(vis.kv_segment_ids, padded_s) if use_seg else None,
        mask=mask_padded,
        dropout_seed=nf.dropout_seed,  # int32 [2] or None
        forward_maps=maps(*fwd),
        backward_maps=maps(*dq),
        key_poison=pad_axis(poison, 1, padded_s)[..., None].astype(query.dtype),
        dkv_maps=maps(*dkv) if dkv != dq else None,
    )
    common = dict(
        seq_k=s,
        num_heads=n,
        num_kv_heads=kh,
        scale=float(nf.scale),
        causal=vis.is_causal,
        max_distance=int(nf.max_distance),
        use_pos=use_pos,
        use_seg=use_seg,
        use_qr=use_qr,
        use_pr=use_pr,
        bias_dims=bias_dims,
        row_col=row_col is not None,
        mask_dims=mask_dims,
        map_per_head=fixed.forward_maps.classes.shape[1] > 1,
        num_rel=padded_rel,
        backend=backend,
        window=vis.local_window_size,
        dropout_rate=float(nf.dropout_rate) if nf.dropout else 0.0,
        dropout_broadcast_batch=nf.dropout_broadcast_batch,
        backward=backward,
        score_mod=spec,
        precision=precision,
        distance_tiles=padded_t if use_tiles else 0,
    )
    dq_warps, dkv_tiling = _backward_warps(
        nf, spec, dq, dkv, tiles_, backward, backward_warps, num_warps
    )
    wide_f32 = _wide_f32(nf)
    fwd_cfg = KernelConfig(
        block_q=fwd[0],
        block_k=fwd[1],
        num_warps=num_warps
        or default_warps(
            fwd[0], shaw_forward=nf.shaw, mod_forward=spec is not None, wide_f32=wide_f32
        ),
        num_stages=3,
        **common,
    )
    bwd_cfg = KernelConfig(
        block_q=dq[0],
        block_k=dq[1],
        num_warps=dq_warps,
        num_stages=default_backward_stages(wide_f32=wide_f32),
        dkv_tiling=dkv_tiling,
        **common,
    )
    return Prepared(fwd_cfg, bwd_cfg, q, k, v, qr, bias_padded, mod, fixed, row_col)
