"""Which Pallas backend runs the flash kernels, chosen loudly, and with
which configuration.

The kernels come in two families: Triton-style (`triton_forward`,
`triton_backward`, `fused_backward`; GPUs, and interpret mode on the CPU) and
Mosaic TPU (`mosaic_forward`, `mosaic_backward`); a third, Mosaic GPU for
the plain case (`mosaic_gpu_attention`), runs only when named
(`backend="mosaic_gpu"`, `MOSAIC_GPU`). Pallas picks its GPU
lowering from the type of `compiler_params`: Triton's `CompilerParams`
select Triton. With `None`, jax 0.10 follows the `jax_pallas_use_mosaic_gpu`
flag, which defaults to Mosaic GPU; jax 0.11 and 0.12 have no such flag and
lower `pl.pallas_call` with Triton (Mosaic GPU is selected by its own
parameters or `plgpu.kernel`). A Triton-style kernel sent to Mosaic GPU
fails deep in the compiler with errors that say nothing about the cause, so
on a GPU this module always passes Triton's parameters and, when the Triton
backend cannot be imported, raises `PallasBackendError` naming the jax /
jaxlib versions and what is missing. There is no fallback: a silent switch
to another kernel would make every benchmark lie.

From jax 0.11 every Triton lowering warns "The Pallas Triton backend is
deprecated and will be removed" (a `DeprecationWarning`). jattn leaves it
as jax emits it (docs/gpu.md: the kernels stay Triton, the jax versions
known to work, how to see the warning).

The configuration a call picks is decided here too: tile sizes per backend
(`default_blocks`, checked by `check_block`), Triton warps by tile rows
(`default_warps`), the backward variant (`BACKWARD_VARIANTS`) and the name
of the dots' precision (`matmul_precision_name`, see `tile_dot.dot`).
`kernel_report` says what a call of a given shape would run (backend, tile
sizes, warps, stages, matmul precision, backward variant), for users and for
the first line of `benchmarks/gpu.py`.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from jattn.attention.pallas.tile_dot import DEFAULT_PRECISION, PRECISIONS, dot_precision

__all__ = [
    "BACKENDS",
    "BACKWARD_VARIANTS",
    "MOSAIC_GPU",
    "PallasBackendError",
    "TRITON_MODULES",
    "TRITON_PRIVATE",
    "TRITON_PUBLIC",
    "check_triton",
    "cuda_target",
    "default_warps",
    "check_backward",
    "check_block",
    "check_precision",
    "default_blocks",
    "describe_backend",
    "kernel_report",
    "matmul_precision_name",
    "pad_size",
    "pow2_size",
    "resolve_backend",
    "triton_compiler_params",
]

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
TPU_BACKENDS = ("tpu", "tpu_interpret")
# The Mosaic GPU kernels (plain attention only, sm_90a; `mosaic_gpu_attention`):
# never chosen by default, only by name.
MOSAIC_GPU = "mosaic_gpu"
# Every kernel backend `flash_attention(backend=...)` takes: Triton, Mosaic TPU,
# Mosaic GPU.
BACKENDS = ("gpu", "interpret", *TPU_BACKENDS, MOSAIC_GPU)
# "split": a dq kernel and a dk/dv kernel (each recomputes the probabilities);
# "fused": one kernel whose programs do either (one launch, one set of
# inputs), as jax's reference kernel does; "atomic": the dk/dv kernel alone,
# dq added into float32 by atomic adds (`atomic_backward`).
BACKWARD_VARIANTS = ("split", "fused", "atomic")

# The modules the Triton lowering needs: the public parameter class, and the
# lowering registration (private; it imports jaxlib's Triton bindings, which a
# jaxlib without GPU Triton support lacks).
TRITON_PUBLIC = "jax.experimental.pallas.triton"
TRITON_PRIVATE = "jax._src.pallas.triton.pallas_call_registration"
TRITON_MODULES = (TRITON_PUBLIC, TRITON_PRIVATE)


class PallasBackendError(RuntimeError):
    """The backend `implementation="pallas"` needs is not available."""


def _versions() -> str:
    try:
        import jaxlib

        jaxlib_version = getattr(jaxlib, "__version__", "?")
    except ImportError:  # pragma: no cover - jax always ships with a jaxlib
        jaxlib_version = "missing"
    return f"jax {jax.__version__}, jaxlib {jaxlib_version}"


def check_triton() -> None:
    """Raise `PallasBackendError` unless Pallas's Triton backend imports.

    Cheap after the first call (imports are cached by Python).
    """
    for name in TRITON_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            # A private module that merely moved in another jax version is no
            # evidence of a missing backend (its dependencies failing is).
            path_missing = isinstance(e, ModuleNotFoundError) and name.startswith(str(e.name))
            if name == TRITON_PRIVATE and path_missing:
                continue
            raise PallasBackendError(
                'implementation="pallas" on a GPU runs jattn\'s Triton kernels, but '
                f"{_versions()} cannot import {name} ({e}). Install a jax with the "
                'Pallas Triton backend (pip install "jax[cuda12]"; the jaxlib must '
                "ship gpu_triton), or use implementation='xla', 'chunked' or 'cudnn'. "
                "jattn does not fall back to Mosaic GPU (jax 0.10's default Pallas GPU "
                "backend): the kernels are written for Triton."
            ) from e


def triton_compiler_params(num_warps: int | None, num_stages: int | None):
    """Triton `CompilerParams`: passing them is what selects the Triton
    lowering (without them jax 0.10 uses Mosaic GPU by default)."""
    check_triton()
    from jax.experimental.pallas import triton as pltriton

    params = getattr(pltriton, "CompilerParams", None)
    if params is None:  # pragma: no cover - depends on the jax build
        raise PallasBackendError(
            f"{_versions()}: jax.experimental.pallas.triton has no CompilerParams; "
            "jattn's Triton kernels need it to select the Triton lowering"
        )
    return params(num_warps=num_warps, num_stages=num_stages)


def resolve_backend(interpret: bool | None) -> str:
    """The kernel backend of a call: "interpret" (Triton-style kernels in
    Pallas interpret mode), "gpu" (Triton) or "tpu" (Mosaic).

    `interpret=None` interprets unless the default device is a GPU or a TPU.
    On a GPU the Triton backend is checked here, before anything is traced.
    """
    platform = jax.default_backend()
    if interpret is None:
        interpret = platform not in (*GPU_PLATFORMS, "tpu")
    if interpret:
        return "interpret"
    if platform == "tpu":
        return "tpu"
    check_triton()
    return "gpu"


def default_warps(
    block_q: int,
    *,
    shaw_forward: bool = False,
    mod_forward: bool = False,
    light_mod: bool = False,
    wide_f32: bool = False,
) -> int:
    """Triton warps of a kernel by its tile rows: 4 warps (128 threads)
    cover 64 rows, 8 from 128 rows. jax's reference kernels use 4 below
    128x128 tiles: more warps on a 64-row tile split the rows of the dots
    too thinly and add register pressure without more parallel work. The
    Shaw forward's 64-row tile (bf16) is the exception: it carries the
    `[bq, Rp]` value-term masses and the gathered key-term tile besides the
    output, 255 registers a thread at 4 warps (spilling at head dim 128,
    `python benchmarks/aot.py`), so it gets 8; so does a forward with a score mod
    (`mod_forward`: FIRE's loop at head dim 128 spilled 96 B at 64x64 with
    4 warps, none with 8). A light score mod's 16-row backward tiles
    (`light_mod`, `score_mod_checks.LIGHT_MOD_COST`) get 2 warps: at 4,
    ALiBi's dk/dv kernel at head dim 64 spilled 8 B with 96 registers, and
    none at 2; a heavy one (T5's select chain) keeps 4, where 2 spill.
    float32 at head dim > 64 (`wide_f32`) takes 8 in every kernel: three
    TF32 passes keep two copies of each operand, and `[rows, 128]` float32
    accumulators sat at 255 registers a thread with 4 warps, spilling
    12-768 B in every backward kernel (docs/gpu.md)."""
    if wide_f32 or block_q >= 128 or ((shaw_forward or mod_forward) and block_q >= 64):
        return 8
    return 2 if light_mod and block_q <= 16 else 4


def default_backward_stages(*, wide_f32: bool) -> int:
    """Triton pipeline stages of the backward kernels: 2 (the next K/V or
    Q/dO tiles loaded while this one computes), 1 for float32 at head dim
    > 64 (`wide_f32`). Those kernels sit at 255 registers a thread, and a
    second stage's buffers cost the registers that ptxas then spills: with
    2 stages the fused kernel spilled 8-20 B in 5 float32 head-dim-128
    variants under ptxas 13.5 (jax 0.11's CUDA 13 plugin); with 1, every
    kernel of the 20 variants spills 0 B under ptxas 12.9 and 13.5
    (docs/gpu.md). The split backward had gone to 1 stage first; the fused
    kernel followed once Triton's TF32x3 took over its dq half (before, 1
    stage spilled more there)."""
    return 1 if wide_f32 else 2


# --------------------------------------------------------------------------------------
# The kernel configuration: tile sizes, their checks, precision.


def pad_size(x: int, m: int) -> int:
    return -(-x // m) * m


def pow2_size(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_blocks(
    backend: str,
    t: int,
    s: int,
    shaw: bool = False,
    head_dim: int = 64,
    dtype="bfloat16",
    score_mod: bool = False,
    loop_mod: bool = False,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Default `((block_q, block_k) forward, (block_q, block_k) backward)`.

    GPU, chosen by what ptxas reports for sm_90a (`python benchmarks/aot.py`,
    docs/gpu.md): no spills in bfloat16 and 16 KB of shared memory to spare.
    - bfloat16 / fp16 forward 128x64; 64x64 with Shaw terms (whose `[bq,
      Rp]` accumulators add register pressure). Backward 64x64 at head dim
      <= 64 without Shaw terms, else 32x32: the dk/dv kernels hold two
      `[bk, H]` float32 accumulators and the fused kernel both kernels'
      state, which at 64x64 and head dim 128 (or with the Shaw tiles at any
      head dim) sit at ptxas's 255-register cap and spill. With a score mod
      the bfloat16 backward is 16x32: the dq and fused kernels also hold the
      mod's vjp on the tile and its params' partial gradient (T5's table
      through a 32-way select chain spilled 24-844 B at 64x64 and 32x32;
      ALiBi 4 B in the h128 fused kernel); 16x32 spills none of them. With
      a score mod at head dim > 64 the bfloat16 forward is 64x64 (8 warps,
      `default_warps`): FIRE's loop spilled 84 B at 128x64.
    - float32 (three TF32 passes on split operands: two copies of each
      operand live): forward 128x64 at head dim <= 64 (32x64 with Shaw
      terms), 32x32 above (16x32 with Shaw terms; a 64x64 tile there asks
      256 KB of shared memory, over the H100's 227 KB); backward 16x32.
      The fewest spills of the tiles tried. A score mod whose forward runs
      a loop (`loop_mod`, `score_mod_checks.has_loop`: FIRE's MLP) takes a
      32x64 forward at head dim <= 64 too: FIRE's spilled 144 B at 128x64
      (8 warps) and 260 B at 64x64, none at 32x64 (4 warps), with ptxas
      12.9 and 13.5 alike.
    Powers of two >= 16 capped by the sequence lengths. TPU: 128x128 for
    both (the MXU's tile; `block_k` a multiple of the 128 lanes unless one
    tile holds every key). Interpret mode: 128x128 capped by the lengths
    (fewer, larger tiles run faster on the CPU).
    """
    if backend == "interpret":
        fwd = (min(128, t), min(128, s))
        return fwd, fwd
    if backend in TPU_BACKENDS:
        # Queries: sublane tiles of 8; keys: lane tiles of 128 (or one tile).
        fwd = (min(128, pad_size(t, 8)), 128 if s > 128 else pad_size(s, 8))
        return fwd, fwd
    cap_t, cap_s = max(16, pow2_size(t)), max(16, pow2_size(s))
    f32, wide = jnp.dtype(dtype) == jnp.float32, head_dim > 64
    if f32:
        if wide:
            fwd = (16, 32) if shaw else (32, 32)
        else:
            fwd = (32, 64) if shaw or loop_mod else (128, 64)
        bwd = (16, 32)
    else:
        fwd = (64 if shaw or (score_mod and wide) else 128, 64)
        bwd = (16, 32) if score_mod else (32, 32) if shaw or wide else (64, 64)
    return (min(fwd[0], cap_t), min(fwd[1], cap_s)), (min(bwd[0], cap_t), min(bwd[1], cap_s))


def matmul_precision_name(dtype, precision: str | None = None) -> str:
    """How the Triton kernels multiply operands of `dtype` at `precision`
    (see `tile_dot.dot`)."""
    precision = check_precision(precision)
    if dot_precision(dtype, precision) is None:
        return f"{jnp.dtype(dtype).name} inputs, float32 accumulation"
    if precision == "tf32x3":
        return "float32 as three TF32 tensor-core passes (tf32x3), float32 accumulation"
    return "float32 IEEE (Precision.HIGHEST, no tensor cores)"


def check_precision(precision: str | None) -> str:
    """The kernels' float32 precision: None -> the default ("tf32x3")."""
    if precision is None:
        return DEFAULT_PRECISION
    if precision not in PRECISIONS:
        raise ValueError(
            f"flash_attention: precision must be one of {PRECISIONS} (or None), got {precision!r}"
        )
    return precision


def check_backward(backward: str) -> str:
    if backward not in BACKWARD_VARIANTS:
        raise ValueError(
            f"flash_attention: backward must be one of {BACKWARD_VARIANTS}, got {backward!r}"
        )
    return backward


def check_block(name: str, value: int, backend: str, length: int) -> int:
    value = int(value)
    if value < 1:
        raise ValueError(f"flash_attention: {name} must be positive, got {value}")
    if backend == "gpu" and (value < 16 or value & (value - 1)):
        raise ValueError(
            f"flash_attention: on the GPU {name} must be a power of two >= 16, got {value}"
        )
    if backend in TPU_BACKENDS:
        if value % 8:
            raise ValueError(f"flash_attention: on TPU {name} must be a multiple of 8, got {value}")
        is_key_block = name == "block_k" or name.endswith("blocks[1]")
        if is_key_block and value % 128 and value < length:
            raise ValueError(
                f"flash_attention: on TPU {name} must be a multiple of 128 unless one "
                f"tile holds every key (key length {length}), got {value}"
            )
    return value


H100_KIND = "NVIDIA H100 80GB HBM3"  # an H100 SXM's `device_kind`


def cuda_target(device_kind: str = H100_KIND, num_cores: int = 132):
    """The context to lower Triton kernels for CUDA on a host with no GPU
    (the tests' CUDA lowerings, `benchmarks/aot.py`'s compiles).

    jax 0.10 lowers Triton for compute capability 9.0 when it finds no GPU;
    from 0.11 the Triton lowering asks the device for its compute capability
    and, with none, raises "No supported GPU devices found, please specify an
    abstract GPU device using AbstractDevice". An abstract mesh of one
    abstract device (an H100 by default) names it on every version (0.10.2
    ignores it); tracing and lowering must both happen inside it, and
    nothing may run eagerly there (`jax.eval_shape` first fills the kernels'
    cached block maps).
    """
    device = jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=num_cores, platform="cuda"
    )
    # Auto, not the default Explicit: under an explicit mesh jax 0.12 gives
    # traced values a sharding, and its Triton lowering of a reduction then
    # keeps the input's spec for a lower-rank output (a score mod's params
    # gradient) and fails.
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.sharding.AbstractMesh((1,), ("cuda_target",), auto, abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def describe_backend() -> str:
    """One line: platform, jax / jaxlib versions and the kernel family
    `implementation="pallas"` runs here (or why it cannot run)."""
    platform = jax.default_backend()
    if platform in GPU_PLATFORMS:
        try:
            check_triton()
            family = "Triton kernels (compiled)"
        except PallasBackendError as e:
            family = f"UNAVAILABLE: {e}"
    elif platform == "tpu":
        family = "Mosaic TPU kernels (compiled)"
    else:
        family = "Triton-style kernels in Pallas interpret mode"
    return f"{_versions()}, platform {platform}: {family}"


def kernel_report(
    t: int,
    s: int,
    head_dim: int,
    *,
    dtype="bfloat16",
    shaw: bool = False,
    score_mod: bool = False,
    light_mod: bool = False,
    loop_mod: bool = False,
    blocks: tuple[int | None, int | None] = (None, None),
    backward: str = "split",
    interpret: bool | None = None,
    precision: str | None = None,
) -> dict:
    """What `implementation="pallas"` would run for query length `t`, key
    length `s` and head dim `head_dim` here: a dict with the backend,
    versions, tile sizes, warps and stages (forward and backward), the
    matmul precision and the backward variant. `score_mod`: a score mod is
    applied; `light_mod`: and it is light (`score_mod_checks.backward_cost`
    at most `LIGHT_MOD_COST`, which the call itself measures); `loop_mod`:
    and its forward runs a loop (`score_mod_checks.has_loop`); `blocks`:
    `flash_attention`'s `(block_q, block_k)`, None for the default. Raises
    `PallasBackendError` where the call itself would."""
    backend = resolve_backend(interpret)
    f32 = jnp.dtype(dtype) == jnp.float32
    (fq, fk), (bq, bk) = default_blocks(
        backend, t, s, shaw, head_dim, dtype, score_mod, loop_mod=score_mod and loop_mod
    )
    block_q, block_k = blocks
    if block_q is not None:
        fq = bq = check_block("block_q", block_q, backend, t)
    if block_k is not None:
        fk = bk = check_block("block_k", block_k, backend, s)
    gpu = backend == "gpu"
    names = {"gpu": "triton", "interpret": "interpret (triton-style)", "tpu": "mosaic_tpu"}
    return dict(
        backend=names[backend],
        platform=jax.default_backend(),
        versions=_versions(),
        forward_blocks=(fq, fk),
        backward_blocks=(bq, bk),
        forward_warps=default_warps(
            fq, shaw_forward=shaw, mod_forward=score_mod, wide_f32=f32 and head_dim > 64
        )
        if gpu
        else None,
        backward_warps=default_warps(
            bq, light_mod=score_mod and light_mod and not f32, wide_f32=f32 and head_dim > 64
        )
        if gpu
        else None,
        forward_stages=3 if gpu else None,
        backward_stages=default_backward_stages(wide_f32=f32 and head_dim > 64) if gpu else None,
        precision=matmul_precision_name(dtype, "ieee" if backend == "tpu" else precision),
        backward=check_backward(backward),
        exp="exp2 (log2(e) folded into the scale)",
    )
