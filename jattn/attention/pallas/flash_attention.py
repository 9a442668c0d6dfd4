"""`implementation="pallas"`: tiled flash attention with a custom VJP.

The public entry `flash_attention` receives the normal form of
`jattn.attention`; `preparation.prepare` pads it and builds what the kernels
read (tile sizes, the Shaw key term as a per-query table `qr`, the block
maps, the static `KernelConfig`s); this module then runs the forward kernel,
whose custom VJP runs the backward, recomputing probabilities from the saved
log-sum-exp: the Triton kernels (`triton_forward`, `triton_backward`,
`fused_backward`) on GPUs and in interpret mode, the Mosaic ones
(`mosaic_forward`, `mosaic_backward`) on TPU. Both take the same padded
inputs (`config.KernelInputs`) and block map and return the same layouts,
so everything here is shared. The backward is `backward="split"` (a dq
kernel and a dk/dv kernel) or, for the Triton kernels, `"fused"` (one
kernel, see `fused_backward`) or `"atomic"` (the dk/dv kernel alone, dq
added into float32 by atomic adds, see `atomic_backward`). The Shaw value term comes back from the
kernel as the weight mass per relative id (`pr`, `[B, T, N, 2k+1]`),
multiplied by the value table here.

Backend choice is `jattn.attention.pallas.backend`'s: on a GPU the Triton lowering or
a `PallasBackendError`, never a silent switch to Mosaic GPU.

The kernels' logits and log-sum-exp are in base 2 (`tile_math`); the lse
returned here is converted back to natural units.

Dropout: the normal form's int32 `[2]` seed goes to the kernels as a tiny
input; each kernel rebuilds a tile's keep mask from `jattn.dropout.keep` at
global indices, so the xla, chunked and pallas paths drop the same weights.
Rows are normalised by the weights before dropout (lse unchanged), the
output and the Shaw value masses `pr` use the dropped ones.

Non-finite keys and values: `prepare` zeroes every non-finite entry of the
key and value (`scores.finite_keys`, in XLA before the kernels) and the
forward kernel reads keys with a NaN row added where one was
(`_forward_keys`), so a query that sees such a key returns NaN as in
jax.nn, while a query that does not (masked, causal, another segment,
padding) never meets it: its weight 0 multiplies a finite 0, not NaN. The
backward kernels read the zeroed keys (a row that saw a NaN has a NaN lse
and output, so its gradients are NaN anyway). The kernels themselves are
unchanged.

A row with nothing visible: the kernels store a finite sentinel lse
(`tile_math.EMPTY_LSE`, so `exp(s - lse)` is 0 in the backward and no
pallas_call output is Inf under `jax.debug_infs`), reported here as
`EMPTY_ROW_LSE`.

Score mods (`jattn.ScoreMod`): the params' leaves go to every kernel as small
whole-array inputs; each kernel applies `fn` to each tile's natural logits
(after the Shaw key term and the bias, before visibility) and, in the
backward, pulls `dS` back through `jax.vjp` of `fn` on the tile: to the raw
logits (hence q, k, `qr` and the bias) and, in the dq kernels, to the params
as per-program partial sums `[nT, B, N, *leaf]` summed here (no atomics).
`score_mod_tiles` rewrites `fn` into what the kernels lower and refuses,
by name, what they cannot; a call whose params need no gradient skips the
partial sums (symbolic zeros, as for the bias).

A distance-table mod (`ScoreMod.from_distance`) with default positions
does not reach the kernels as a mod: `prepare` builds its
Toeplitz tiles for the forward and the backward tiling (`distance_tiles`),
which stand in for the mod's leaves in the custom VJP; the kernels add them
(`KernelConfig.distance_tiles`), `fn` is never lowered (nor refused), and
the tiles' gradient comes from `triton_distance_grad` /
`mosaic_distance_grad`, all of it on the backward tiling's copy (both are
windows of one table).

Gradients of the Shaw tables and of `q` through `qr`, and of the value table
through `pr`, follow by autodiff of the XLA steps around the kernel. The bias
gradient is reduced to the bias's broadcast shape; a bias with both a query
and a key axis gets its gradient through a `[B, N, T, S]` float32 buffer
(the size of such a bias broadcast over batch and heads).

Row and column terms (`row_col_bias=(a, c)`): `prepare` pads them to
`[B, N, Tp, 1]` and `[B, N, 1, Sp]` float32, which every kernel reads as
two more biases (`config.ROW_DIMS`, `COL_DIMS`: its bias BlockSpecs and
loaders, a query tile's `a` and a key tile's `c`) and adds to the logits
with the bias, before the score mod, as xla and chunked do. Their gradients
are dS summed over keys, accumulated by the dq kernel as it walks a query
tile's key tiles, and over queries, by the dk/dv kernel for its key tile
(`config.row_sums`, `col_sums`; one sum also serves a bias broadcast over
keys or over queries): `[B, N, Tp]` and `[B, N, Sp]`, never `[T, S]`. A call
whose terms need no gradient skips both sums (symbolic zeros).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jattn.attention.normal_form import EMPTY_ROW_LSE, NormalForm
from jattn.attention.pallas import tile_math, triton_backward, triton_forward
from jattn.attention.pallas.backend import (
    BACKENDS,
    MOSAIC_GPU,
    TPU_BACKENDS,
    check_backward,
    check_block,
    check_precision,
    default_blocks,
    matmul_precision_name,
    resolve_backend,
)
from jattn.attention.pallas.blockmap import block_map, run_bounds
from jattn.attention.pallas.config import (
    BackwardTiles,
    FixedInputs,
    KernelConfig,
    KernelInputs,
    TileMaps,
    dbias_kind,
    dkv_config,
)
from jattn.attention.pallas.preparation import KernelOptions, Prepared, prepare

Array = jax.Array

__all__ = [
    "BackwardTiles",
    "KernelOptions",
    "Prepared",
    "block_map",
    "check_backward",
    "check_block",
    "check_precision",
    "default_blocks",
    "flash_attention",
    "flash_core",
    "kernel_inputs",
    "matmul_precision_name",
    "prepare",
    "run_bounds",
]

_TPU_BACKENDS = TPU_BACKENDS
_HIGHEST = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------------------
# Kernel call with its custom VJP. `fixed` holds what gets no gradient: positions,
# segment ids, the integer mask, the dropout seed, block maps and bounds.


def _kernels(cfg: KernelConfig):
    """`(forward, dq, dkv)` kernel wrappers of the config's backend."""
    if cfg.backend in _TPU_BACKENDS:
        if cfg.backward != "split":
            raise ValueError(
                f"flash_attention: backward={cfg.backward!r} exists for the Triton kernels only "
                "(GPU and interpret mode); the Mosaic (TPU) backward is split"
            )
        from jattn.attention.pallas import mosaic_backward, mosaic_forward

        return (
            mosaic_forward.flash_forward,
            mosaic_backward.flash_dq,
            mosaic_backward.flash_dkv,
        )
    return (
        triton_forward.flash_forward,
        triton_backward.flash_dq,
        triton_backward.flash_dkv,
    )


def kernel_inputs(
    q, k, v, qr, bias, fixed: FixedInputs, maps: TileMaps, mod=None, tiles=None, row_col=None
) -> KernelInputs:
    """The inputs of one kernel call, on the tiling of `maps` (kernel-level API:
    with `prepare`'s outputs, what the kernels and their tests are called on).
    `tiles`: that tiling's distance tiles (`distance_tiles`), or None;
    `row_col`: the padded row and column terms `(a [B, N, Tp, 1], c [B, N,
    1, Sp])`, or None."""
    row, col = (None, None) if row_col is None else row_col
    return KernelInputs(
        mod_params=mod,
        distance_tiles=tiles,
        query=q,
        key=k,
        value=v,
        key_term=qr,
        bias=bias,
        row_bias=row,
        col_bias=col,
        q_positions=fixed.q_positions,
        kv_positions=fixed.kv_positions,
        q_segments=fixed.q_segments,
        kv_segments=fixed.kv_segments,
        mask=fixed.mask,
        dropout_seed=fixed.dropout_seed,
        tile_classes=maps.classes,
        row_bounds=maps.row_bounds,
        col_bounds=maps.col_bounds,
    )


def flash_core(
    fwd_cfg: KernelConfig, bwd_cfg: KernelConfig, q, k, v, qr, bias, fixed, mod=None, row_col=None
):
    """The kernels with their custom VJP; `mod` the score mod's leaves or None,
    `row_col` the padded row and column terms (`Prepared.row_col`) or None.

    Kernel-level API over `prepare`'s outputs: returns `(o, lse, pr)` and is
    differentiable in q, k, v, qr, bias, `mod` and `row_col` (the lse's
    cotangent is ignored)."""
    return _flash_vjp(fwd_cfg, bwd_cfg, q, k, v, qr, bias, fixed, mod, row_col)


def _forward_keys(k: Array, fixed: FixedInputs) -> Array:
    """The keys the forward kernel reads: `k` (non-finite entries zeroed)
    plus the NaN poison of keys that had one, so their logits are NaN where
    visible and selected away where not."""
    return k if fixed.key_poison is None else k + fixed.key_poison


def _split_mod(cfg: KernelConfig, mod):
    """`(leaves, (forward tiles, dq tiles, dk/dv tiles))`: with distance tiles
    the mod's "leaves" are the three tilings' tiles (`prepare`; one array
    where two tilings agree), else `(mod, (None, None, None))`."""
    if cfg.distance_tiles:
        return None, mod
    return mod, (None, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_vjp(fwd_cfg: KernelConfig, bwd_cfg: KernelConfig, q, k, v, qr, bias, fixed, mod, rc):
    leaves, (tiles, *_) = _split_mod(fwd_cfg, mod)
    keys = _forward_keys(k, fixed)
    ins = kernel_inputs(q, keys, v, qr, bias, fixed, fixed.forward_maps, leaves, tiles, rc)
    return _kernels(fwd_cfg)[0](fwd_cfg, ins)


def _flash_core_fwd(fwd_cfg, bwd_cfg, q, k, v, qr, bias, fixed, mod, rc):
    # symbolic_zeros=True: primals arrive as CustomVJPPrimal(value, perturbed),
    # which tells whether the bias needs a gradient at all (a fixed ALiBi bias
    # or a mask given as a bias does not, and its [B, N, T, S] buffer is skipped).
    is_primal = lambda x: isinstance(x, CustomVJPPrimal)
    want_dbias = bias is not None and bias.perturbed
    # The same for the score mod's params (a fixed softcap needs no gradient
    # pass) and for the row and column terms.
    want_dmod = mod is not None and any(x.perturbed for x in mod)
    want_drc = rc is not None and any(x.perturbed for x in rc)
    q, k, v, qr, bias, mod, fixed, rc = jax.tree.map(
        lambda p: p.value, (q, k, v, qr, bias, mod, fixed, rc), is_leaf=is_primal
    )
    forward = _kernels(fwd_cfg)[0]
    leaves, (tiles, *_) = _split_mod(fwd_cfg, mod)
    keys = _forward_keys(k, fixed)
    ins = kernel_inputs(q, keys, v, qr, bias, fixed, fixed.forward_maps, leaves, tiles, rc)
    o, lse, pr = forward(fwd_cfg, ins)
    # Static via pytree structure: an empty array where a gradient is wanted, else None.
    wants = (want_dbias, want_dmod, want_drc)
    flags = tuple(jnp.zeros((0,), jnp.float32) if w else None for w in wants)
    return (o, lse, pr), (q, k, v, qr, bias, mod, fixed, rc, o, lse, pr, *flags)


def _reduce_bias_grad(db: Array, kind: str, bias: Array) -> Array:
    """Sum the kernel's bias gradient down to the (padded) bias shape."""
    if kind == "rows":
        db = db[..., None]  # [B, N, Tp, 1]
    elif kind == "cols":
        db = db[:, :, None, :]  # [B, N, 1, Sp]
    axes = tuple(a for a in range(4) if bias.shape[a] == 1 and db.shape[a] != 1)
    return jnp.sum(db, axis=axes, keepdims=True).astype(bias.dtype)


def _instantiate(ct):
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


def _flash_core_bwd(fwd_cfg, bwd_cfg, res, cts):
    q, k, v, qr, bias, mod, fixed, rc, o, lse, pr, want_dbias, want_dmod, want_drc = res
    # The lse is a residual (as in jax.nn): its cotangent is ignored.
    do, _, dpr = (None if c is None else _instantiate(c) for c in cts)
    if bias is not None and want_dbias is None:
        bwd_cfg = dataclasses.replace(bwd_cfg, bias_grad=False)
    if rc is not None and want_drc is None:
        bwd_cfg = dataclasses.replace(bwd_cfg, row_col_grad=False)
    if bwd_cfg.score_mod is not None and want_dmod is None:
        spec = dataclasses.replace(bwd_cfg.score_mod, grad=False)
        bwd_cfg = dataclasses.replace(bwd_cfg, score_mod=spec)
    delta = jnp.einsum(
        "BTNE,BTNE->BNT", do.astype(jnp.float32), o.astype(jnp.float32)
    )  # [B, N, Tp]
    if pr is not None:
        dpr = dpr.astype(jnp.float32)
        delta = delta + jnp.einsum("BTNR,BTNR->BNT", pr, dpr)
    leaves, (_, tiles, dkv_tiles) = _split_mod(bwd_cfg, mod)
    ins = kernel_inputs(q, k, v, qr, bias, fixed, fixed.backward_maps, leaves, tiles, rc)
    ins = ins._replace(d_out=do.astype(q.dtype), lse=lse, delta=delta, d_value_mass=dpr)
    _, flash_dq, flash_dkv = _kernels(bwd_cfg)
    if bwd_cfg.backward == "fused":
        from jattn.attention.pallas import fused_backward

        dq, dqr, db_q, rows, dk, dv, cols, d_mod = fused_backward.flash_dq_dkv(bwd_cfg, ins)
    elif bwd_cfg.backward == "atomic":
        from jattn.attention.pallas import atomic_backward

        dq, dqr, db_q, rows, dk, dv, cols, d_mod = atomic_backward.flash_dkv_dq(bwd_cfg, ins)
    else:
        dq, dqr, db_q, rows, d_mod = flash_dq(bwd_cfg, ins)
        dkv_ins = ins  # the dk/dv kernel on its own tiling, when it has one
        if fixed.dkv_maps is not None:
            dkv_ins = ins._replace(
                tile_classes=fixed.dkv_maps.classes,
                row_bounds=fixed.dkv_maps.row_bounds,
                col_bounds=fixed.dkv_maps.col_bounds,
                distance_tiles=dkv_tiles,
            )
        dk, dv, cols = flash_dkv(dkv_config(bwd_cfg), dkv_ins)
    dbias = None
    kind = dbias_kind(bwd_cfg)
    if kind is not None:
        dbias = _reduce_bias_grad({"full": db_q, "rows": rows, "cols": cols}[kind], kind, bias)
    d_rc = None  # [B, N, Tp, 1], [B, N, 1, Sp]: the row and column sums of dS
    if want_drc is not None:
        d_rc = (rows[..., None].astype(rc[0].dtype), cols[:, :, None, :].astype(rc[1].dtype))
    if bwd_cfg.distance_tiles:
        # All of the tiles' gradient goes to the backward tiling's copy: both
        # are the same table's windows, so the params' gradient is whole.
        d_tiles = None
        if want_dmod is not None:
            if bwd_cfg.backend in _TPU_BACKENDS:
                from jattn.attention.pallas import mosaic_distance_grad as distance_grad
            else:
                from jattn.attention.pallas import triton_distance_grad as distance_grad
            d_tiles = distance_grad.flash_dtiles(bwd_cfg, ins)
        d_mod = (None, d_tiles, None)
    else:
        d_mod = _reduce_mod_grads(bwd_cfg, mod, d_mod)
    return dq, dk, dv, dqr, dbias, None, d_mod, d_rc


def _reduce_mod_grads(cfg: KernelConfig, mod, partials):
    """The score mod's params gradient: the dq programs' partial sums
    `[nT, B, N, *leaf]` summed (no atomics in the kernels), one per
    differentiable leaf; None for the others, or without a gradient."""
    if mod is None:
        return None
    if not cfg.mod_grad:
        return tuple(None for _ in mod)
    it = iter(partials)
    out = []
    for x, d in zip(mod, cfg.score_mod.differentiable, strict=True):
        out.append(jnp.sum(next(it), axis=(0, 1, 2)).astype(x.dtype) if d else None)
    return tuple(out)


_flash_vjp.defvjp(_flash_core_fwd, _flash_core_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------
# Public entry.


def flash_attention(
    nf: NormalForm,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    backward: str = "split",
    num_warps: int | None = None,
    precision: str | None = None,
    backend: str | None = None,
    backward_blocks: tuple[int, int] | None = None,
    backward_warps: int | None = None,
    backward_tiles: BackwardTiles | None = None,
) -> tuple[Array, Array]:
    """Tiled flash attention of a normal form (see `jattn.attention.normal_form`).

    Args:
      nf: the checked call.
      block_q, block_k: tile sizes for the forward and backward kernels
        (default per backend, see `default_blocks`); powers of two >= 16 on
        the GPU; on TPU multiples of 8 and of 128 (block_k, unless one tile
        holds every key).
      interpret: run the (Triton-style) kernels in Pallas interpret mode;
        None = on unless the default backend is a GPU or a TPU.
      backward: "split" (dq and dk/dv kernels), "fused" (one kernel) or
        "atomic" (the dk/dv kernel alone, adding each tile's dq into a
        float32 buffer with atomic adds: `atomic_backward`; not bitwise
        deterministic, the adds' order varies). The last two: Triton kernels
        only. The variants differ in how the kernels are launched, not in
        what they compute, so they are one keyword; "atomic" takes its
        tiles from `backward_blocks` / `backward_warps` or
        `backward_tiles.dkv_*` (it has no dq kernel to tile).
      num_warps: Triton warps of every kernel (default by tile rows,
        `backend.default_warps`); ignored elsewhere.
      precision: how the Triton kernels (GPU and interpret mode) multiply
        float32 operands: "tf32x3" (None, the default: three TF32
        tensor-core passes on split operands, ~float32 accuracy, see
        `tile_dot.dot`) or "ieee" (float32 FMAs, no tensor cores; slower,
        and its compile spills far more). 16-bit operands always multiply
        natively; the Mosaic (TPU) kernels always use HIGHEST.
      backend: the kernel family and mode explicitly, instead of by the
        default device: "gpu" / "interpret" (the Triton kernels, compiled or
        in Pallas interpret mode), "tpu" / "tpu_interpret" (the Mosaic
        kernels), "mosaic_gpu" (the Mosaic GPU kernels for sm_90a, plain
        attention only: `mosaic_gpu_attention`, which refuses the rest and
        every keyword below in one line). The compiled families lower on
        any machine (to check a kernel for CUDA or TPU from a CPU); give
        `interpret` or `backend`, not both.
      backward_blocks, backward_warps: `(block_q, block_k)` and Triton warps
        of the backward kernels only, over `block_q`/`block_k`/`num_warps`
        and the defaults: the backward's best tiles need not be the
        forward's (the GPU benchmark's sweep times them apart).
      backward_tiles: the split backward's tiles and warps per kernel
        (`config.BackwardTiles`: the dq kernel's and the dk/dv kernel's),
        over `backward_blocks` / `backward_warps` for the kernel whose
        field is given; `backward="fused"` takes only tiles that agree.

    Returns:
      `out [B, T, N, Hv]` in the dtype of `query` and `lse [B, T, N]` float32.

    Raises:
      backend.PallasBackendError: on a GPU whose jax lacks the Pallas Triton
        backend (named with the jax version; there is no fallback).
      ValueError: an unknown `backend`, or both `interpret` and `backend`.
    """
    if backend is None:
        backend = resolve_backend(interpret)
    elif interpret is not None:
        raise ValueError("flash_attention: give interpret= or backend=, not both")
    elif backend not in BACKENDS:
        raise ValueError(f"flash_attention: backend {backend!r} is not one of {BACKENDS}")
    options = KernelOptions(
        backend, block_q, block_k, backward, num_warps, precision, backward_blocks,
        backward_warps, backward_tiles,
    )  # fmt: skip
    if backend == MOSAIC_GPU:
        return _mosaic_gpu(nf, options)
    return _flash_attention(nf, options)


def _mosaic_gpu(nf: NormalForm, options: KernelOptions) -> tuple[Array, Array]:
    """The Mosaic GPU kernels, which take none of the Triton kernels' keywords."""
    from jattn.attention.pallas import mosaic_gpu_attention

    given = [
        f for f in options._fields[1:] if getattr(options, f) != KernelOptions._field_defaults[f]
    ]
    if given:
        raise ValueError(
            f'flash_attention(backend="mosaic_gpu") takes none of {", ".join(given)} '
            "(its tiles are mosaic_gpu_attention.Tiles)"
        )
    return mosaic_gpu_attention.mosaic_gpu_attention(nf)


def _flash_attention(nf: NormalForm, options: KernelOptions) -> tuple[Array, Array]:
    """`flash_attention` for an explicit backend (`options.backend`): "gpu" /
    "interpret" (the Triton kernels, compiled or interpreted), "tpu" /
    "tpu_interpret" (the Mosaic kernels). The compiled paths can be lowered
    on any machine (tests lower them for CUDA and TPU on the CPU)."""
    t = nf.query.shape[1]
    hv = nf.value.shape[-1]
    pre = prepare(nf, options)
    o, lse, pr = flash_core(
        pre.fwd_cfg,
        pre.bwd_cfg,
        pre.q,
        pre.k,
        pre.v,
        pre.qr,
        pre.bias,
        pre.fixed,
        pre.mod,
        pre.row_col,
    )
    out = o[:, :t, :, :hv].astype(jnp.float32)  # [B, T, N, Hv]
    if nf.rel_value is not None:
        pr = pr[:, :t, :, : nf.rel_value.shape[1]]  # [B, T, N, R]
        out = out + jnp.einsum(
            "BTNR,NRE->BTNE", pr, nf.rel_value.astype(jnp.float32), precision=_HIGHEST
        )
    lse = jnp.swapaxes(lse[:, :, :t], 1, 2)  # [B, T, N]
    # Base 2 -> natural; the kernels' empty rows -> the normal form's sentinel.
    lse = jnp.where(lse == tile_math.EMPTY_LSE, EMPTY_ROW_LSE, lse * tile_math.LN2)
    return out.astype(nf.query.dtype), lse
