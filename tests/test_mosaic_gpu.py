"""The Mosaic GPU kernels (`flash_attention(backend="mosaic_gpu")`) without a GPU:
what they refuse (one line each), their tiles, their CUDA lowering (an
abstract H100), the AOT script's Mosaic GPU rows, and, in Pallas's Mosaic GPU
interpret mode (slow), their output and gradients against float64."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn.attention.pallas import flash_attention as fa
from jattn.attention.pallas import mosaic_gpu_attention as mga
from jattn.attention.pallas.backend import cuda_target
from jattn.attention.pallas.mosaic_gpu_stream import MEMORY_REGISTERS, compute_registers

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_aot_mgpu", ROOT / "benchmarks" / "aot.py")
aot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aot)


def _qkv(b=1, t=128, s=128, n=4, kh=2, h=64, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, ct = (jax.random.normal(x, (b, t, n, h), dtype) for x in (ks[0], ks[3]))
    k, v = (jax.random.normal(x, (b, s, kh, h), dtype) for x in ks[1:3])
    return q, k, v, ct


def _nf(q, k, v, causal=True, **kw):
    vis, rest = jattn.visibility.split_keywords(dict(kw, is_causal=causal))
    if "dropout_rate" in rest:
        rate, rng = rest.pop("dropout_rate"), rest.pop("dropout_rng")
        rest["dropout"] = jattn.dropout.Dropout(rate, rng)
    return jattn.normalise(q, k, v, visibility=vis, **rest)


# --------------------------------------------------------------------------------------
# Refusals: everything but the plain case, in one line.


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, v: dict(bias=jnp.zeros((1, 1, 128, 128))), "got bias"),
        (lambda q, k, v: dict(mask=jnp.ones((1, 1, 128, 128), bool)), "got mask"),
        (lambda q, k, v: dict(local_window_size=(16, 0)), "got local_window_size"),
        (
            lambda q, k, v: dict(query_seq_lengths=jnp.array([100], jnp.int32)),
            "segment_ids_or_lengths",
        ),
        (
            lambda q, k, v: dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
            "got dropout",
        ),
        (
            lambda q, k, v: dict(relative=jattn.ShawRelative(jnp.zeros((5, 64)), None, 2)),
            "got relative",
        ),
        (
            lambda q, k, v: dict(score_mod=jattn.positions.softcap_score_mod(5.0)),
            "got score_mod",
        ),
    ],
)
def test_refuses_every_feature_in_one_line(change, match):
    q, k, v, _ = _qkv()
    nf = _nf(q, k, v, **change(q, k, v))
    with pytest.raises(ValueError, match=match) as e:
        fa.flash_attention(nf, backend="mosaic_gpu")
    assert "\n" not in str(e.value) and str(e.value).startswith("flash_attention(backend=")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dtype=jnp.float32), "all bfloat16 or all float16"),
        (dict(h=32), r"head dims \(64, 128\)"),
        (dict(t=200, s=200), "multiple of 128"),
        (dict(t=128, s=192), "key lengths of 128"),
    ],
)
def test_refuses_dtypes_head_dims_and_ragged_lengths(kw, match):
    q, k, v, _ = _qkv(**kw)
    with pytest.raises(ValueError, match=match):
        fa.flash_attention(_nf(q, k, v), backend="mosaic_gpu")


def test_refuses_the_triton_keywords():
    q, k, v, _ = _qkv()
    for kw in (dict(block_q=64), dict(backward="fused"), dict(num_warps=4)):
        with pytest.raises(ValueError, match="takes none of " + next(iter(kw))):
            fa.flash_attention(_nf(q, k, v), backend="mosaic_gpu", **kw)


def test_plain_problem_accepts_the_plain_case():
    q, k, v, _ = _qkv(t=256, s=384, n=4, kh=1, h=128, dtype=jnp.float16)
    assert mga.plain_problem(_nf(q, k, v, causal=False)) is None
    assert mga.plain_problem(_nf(q, k, v, causal=True, scale=0.3)) is None


# --------------------------------------------------------------------------------------
# Tiles.


def test_tiles_lengths_and_checks():
    assert mga.Tiles().multiple == (128, 128)
    assert mga.Tiles(block_k=192, dkv_block_q=256).multiple == (256, 384)
    assert mga.Tiles(compute_wgs=1).multiple == (64, 128)
    assert mga.check_tiles(mga.Tiles(stages=3)) == mga.Tiles(stages=3)
    for bad, match in (
        (dict(block_k=96), "block_k must be 64"),
        (dict(dq_block_k=512), "dq_block_k must be 64"),
        (dict(compute_wgs=3), "compute_wgs must be 1 or 2"),
        (dict(stages=1), "stages must be 2"),
    ):
        with pytest.raises(ValueError, match=match):
            mga.check_tiles(mga.Tiles(**bad))


def test_compute_registers_fill_the_sm():
    # 64K registers: the memory warpgroup's 24 a thread (setmaxnreg's floor), the rest
    # to the compute ones, in setmaxnreg's granule of 8 (two compute warpgroups:
    # FlashAttention 3's 240 beside a TMA producer), capped at 240.
    assert MEMORY_REGISTERS >= 24 and MEMORY_REGISTERS % 8 == 0  # setmaxnreg's range
    assert compute_registers(2) == 240
    assert compute_registers(1) == 240
    for wgs in (1, 2):
        assert 128 * (wgs * compute_registers(wgs) + MEMORY_REGISTERS) <= 65536
        assert compute_registers(wgs) % 8 == 0


# --------------------------------------------------------------------------------------
# CUDA lowering (no GPU: an abstract H100).


@pytest.mark.parametrize("causal", [True, False])
def test_lowers_for_cuda_as_three_mosaic_gpu_kernels(causal):
    sds = jax.ShapeDtypeStruct
    q, k = sds((1, 256, 4, 128), jnp.bfloat16), sds((1, 256, 2, 128), jnp.bfloat16)

    def f(q, k, v, ct):
        out, pull = jax.vjp(lambda *a: fa.flash_attention(_nf(*a, causal), backend="mosaic_gpu")[0],
                            q, k, v)  # fmt: skip
        return out, pull(ct)

    jax.eval_shape(f, q, k, k, q)
    with cuda_target():
        text = jax.jit(f).trace(q, k, k, q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == 3, "expected the forward, dq and dk/dv kernels"
    assert "triton" not in text


# --------------------------------------------------------------------------------------
# benchmarks/aot.py's Mosaic GPU target.

MGPU_LOG = """\
ptxas info    : Compiling entry function 'jattn_mgpu_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for jattn_mgpu_fwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas warning : Registers are spilled to local memory in function 'jattn_mgpu_dkv_mosaic_gpu_kernel', 16 bytes spill stores, 28 bytes spill loads
ptxas info    : Compiling entry function 'jattn_mgpu_dkv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for jattn_mgpu_dkv_mosaic_gpu_kernel
    24 bytes stack frame, 16 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 24 bytes cumulative stack size, 1 bytes smem
.visible .entry jattn_mgpu_fwd_mosaic_gpu_kernel(
\t{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 0, 0; }
}
"""  # noqa: E501


def test_aot_mosaic_gpu_variants_and_strict_rows():
    assert aot.variants("mosaic_gpu") == [
        f"mgpu-{m}-bfloat16-h{h}" for m in ("causal", "full") for h in (64, 128)
    ]
    assert aot.parse_variant("mgpu-full-bfloat16-h128") == dict(
        mgpu=False, dtype="bfloat16", head_dim=128
    )
    with pytest.raises(ValueError, match="unknown variant"):
        aot.parse_variant("mgpu-full-float32-h128")
    kernels = aot.parse_ptxas(MGPU_LOG)
    assert set(kernels) == {"jattn_mgpu_fwd_mosaic_gpu_kernel", "jattn_mgpu_dkv_mosaic_gpu_kernel"}
    mma = aot.count_mma([], (MGPU_LOG,), aot._WGMMA_INLINE)
    assert mma == {"jattn_mgpu_fwd_mosaic_gpu_kernel": 1}
    warnings = aot.ptxas_warnings(MGPU_LOG)
    assert len(warnings) == 1
    rows = {k: aot.strict_status(dict(kernel=k, status="ok", **f), warnings)
            for k, f in kernels.items()}  # fmt: skip
    assert rows["jattn_mgpu_fwd_mosaic_gpu_kernel"]["status"] == "ok"
    dkv = rows["jattn_mgpu_dkv_mosaic_gpu_kernel"]["status"]
    assert dkv.startswith("FAIL: spill_stores 16 B; spill_loads 28 B; ptxas warning")


def test_aot_mosaic_gpu_refuses_tiles(capsys):
    with pytest.raises(SystemExit):
        aot.main(["--target", "mosaic_gpu", "--block-q", "64"])
    assert "takes no tiles" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# Interpret mode against float64 (the dots are jnp's there: `mosaic_gpu_forward.accumulate`).


def _interpret_params():
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:  # pragma: no cover - jax versions before the GPU interpreter
        pytest.skip(f"jax {jax.__version__} has no Pallas Mosaic GPU interpret mode")
    return InterpretGPUParams()


@pytest.mark.slow
@pytest.mark.parametrize(
    "causal,t,s,n,kh,h,wide",
    [
        (True, 256, 256, 2, 1, 64, False),
        (False, 128, 256, 2, 2, 64, False),
        (True, 256, 256, 4, 2, 64, True),
    ],
)
def test_interpret_matches_float64(causal, t, s, n, kh, h, wide):
    """Output, dq, dk and dv against the "xla" path in float64, bf16's bound
    (3e-2 of the largest reference value): several key tiles a block
    (`block_k=64`), GQA (the dk/dv kernel's steps over the group's heads),
    the causal passed, diagonal and full tiles; `wide`: 128-row query tiles
    in the dk/dv kernel and 128-row key tiles in the dq kernel, so that a
    diagonal tile holds both warpgroups' keys and a passed tile is none."""
    wide_tiles = dict(dkv_block_q=128, dq_block_k=128) if wide else {}
    tiles = mga.Tiles(block_k=64, **wide_tiles, interpret=_interpret_params())
    q, k, v, ct = _qkv(1, t, s, n, kh, h, seed=3)

    def run(fn, *a):
        out, pull = jax.vjp(fn, *a)
        return [out, *pull(ct.astype(out.dtype))]

    mgpu = lambda q, k, v: mga.mosaic_gpu_attention(_nf(q, k, v, causal), tiles)[0]
    # The interpreter fills fresh buffers with NaN (a read before a write shows
    # as NaN in the results, which the bound below fails), in callbacks on its
    # own threads: debug_nans off process-wide while it runs.
    nans = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", False)
    try:
        got = jax.block_until_ready(jax.jit(lambda *a: run(mgpu, *a))(q, k, v))
    finally:
        jax.config.update("jax_debug_nans", nans)

    def xla(q, k, v):
        return jattn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    with jax.enable_x64(True):
        want = run(xla, *(x.astype(jnp.float64) for x in (q, k, v)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.max(np.abs(g - w)) / np.max(np.abs(w))
        assert err <= 3e-2, (name, err)
