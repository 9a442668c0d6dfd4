"""The flash kernels' GPU readiness, on the CPU (issue 17).

- Backend choice fails loudly: a GPU without Pallas's Triton backend raises
  `PallasBackendError` naming the jax version (simulated by hiding the
  module), never a silent switch to Mosaic GPU; `kernel_report` says what
  would run.
- The fused one-kernel backward against the float64 oracle (and the xla
  path with dropout), forward and every gradient, in interpret mode, and
  lowered for CUDA; refused for the Mosaic kernels.
- The reference kernels' practices: the kernels' base-2 lse comes back in
  natural units, float32 dots are three TF32 passes by default (IEEE on
  request) and 16-bit ones native, tiles by dtype and head dim, warps by
  tile rows, block maps cached per shape equal the per-call ones.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import normal_form
from flash_harness import (
    BF16_TOL,
    _check,
    _check_debug_mode,
    _lower_vjp,
    _normal_form,
    _packed,
    _qkv,
)

import jattn
from jattn.attention.pallas import backend as kb
from jattn.attention.pallas import blockmap, tile_dot
from jattn.attention.pallas import flash_attention as fa
from jattn.attention.pallas.config import with_triton_x3

JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
TRITON_DEPRECATION = "Pallas Triton backend is deprecated"
MAIN = (2, 64, 64, 4, 2, 16, 8)  # B, T, S, N, K, H, Hv (as tests/test_pallas.py)
RAGGED = (2, 40, 36, 2, 2, 16)


# --------------------------------------------------------------------------------------
# Backend choice.


@pytest.fixture
def no_triton(monkeypatch):
    """Pallas's Triton backend made unimportable, as in a jax build without it."""
    for name in kb.TRITON_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def test_an_explicit_backend_is_checked():
    """`flash_attention(backend=...)` names the kernel family and mode; an
    unknown one, or one given together with `interpret`, is a one-line error."""
    nf = _normal_form(_qkv(1, 1, 8, 8, 2, 2, 16), is_causal=True, max_distance=0)
    with pytest.raises(ValueError, match="backend 'cuda' is not one of"):
        fa.flash_attention(nf, backend="cuda")
    with pytest.raises(ValueError, match="not both"):
        fa.flash_attention(nf, backend="interpret", interpret=True)


def test_missing_triton_fails_loudly(no_triton, monkeypatch):
    inputs = _qkv(1, 1, 40, 40, 2, 2, 16)
    nf = _normal_form(inputs, is_causal=True, max_distance=0)
    with pytest.raises(kb.PallasBackendError, match=f"jax {jax.__version__}.*cannot import"):
        fa.flash_attention(nf, block_q=None, block_k=None, backend="gpu")
    with pytest.raises(kb.PallasBackendError, match="does not fall back to Mosaic GPU"):
        kb.triton_compiler_params(4, 2)
    # On a GPU host the public entry refuses before tracing anything.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(kb.PallasBackendError, match="jattn.s Triton kernels"):
        fa.flash_attention(nf)
    with pytest.raises(kb.PallasBackendError):
        kb.kernel_report(8192, 8192, 128)
    assert "UNAVAILABLE" in kb.describe_backend()


def test_private_lowering_module_moved_is_not_a_failure(monkeypatch):
    # jax may move its private Triton registration module between versions:
    # only the public module (or a failing dependency) decides. From jax 0.11
    # the public module imports the private one itself (and would fail with it
    # hidden), so it is imported first: the same state whatever ran before.
    importlib.import_module(kb.TRITON_PUBLIC)
    monkeypatch.setitem(sys.modules, kb.TRITON_PRIVATE, None)
    kb.check_triton()
    monkeypatch.setitem(sys.modules, kb.TRITON_PUBLIC, None)
    with pytest.raises(kb.PallasBackendError, match="pallas.triton"):
        kb.check_triton()


def test_triton_present_selects_triton(monkeypatch):
    # The check passes, the parameters are Triton's (what selects the Triton
    # lowering; jax 0.10's default GPU backend is Mosaic GPU), and the report says
    # what a GPU call would run.
    kb.check_triton()
    from jax.experimental.pallas import triton as pltriton

    params = kb.triton_compiler_params(8, 3)
    assert isinstance(params, pltriton.CompilerParams) and params.num_warps == 8
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kb.resolve_backend(None) == "gpu"
    report = kb.kernel_report(8192, 8192, 128, dtype=jnp.bfloat16)
    assert report["backend"] == "triton" and jax.__version__ in report["versions"]
    assert report["forward_blocks"] == (128, 64) and report["forward_warps"] == 8
    assert report["backward_blocks"] == (32, 32) and report["backward_warps"] == 4
    assert "bfloat16" in report["precision"]
    shaw = kb.kernel_report(8192, 8192, 128, shaw=True, backward="fused", dtype=jnp.float32)
    assert shaw["forward_blocks"] == (16, 32) and shaw["backward_blocks"] == (16, 32)
    assert shaw["backward"] == "fused" and "tf32x3" in shaw["precision"]
    # float32 at head dim 128: 8 warps in every kernel, the backward (split
    # or fused) unpipelined (what ptxas compiles without spills, docs/gpu.md).
    assert (shaw["forward_warps"], shaw["backward_warps"], shaw["backward_stages"]) == (8, 8, 1)
    split = kb.kernel_report(8192, 8192, 128, dtype=jnp.float32)
    assert (split["forward_warps"], split["backward_warps"], split["backward_stages"]) == (8, 8, 1)
    narrow = kb.kernel_report(8192, 8192, 64, dtype=jnp.float32)
    assert (narrow["backward_warps"], narrow["backward_stages"]) == (4, 2)
    shaw = kb.kernel_report(8192, 8192, 64, shaw=True, dtype=jnp.bfloat16)
    assert shaw["forward_blocks"] == (64, 64) and shaw["forward_warps"] == 8
    mod = kb.kernel_report(8192, 8192, 64, score_mod=True, dtype=jnp.bfloat16)
    assert mod["forward_blocks"] == (128, 64) and mod["backward_blocks"] == (16, 32)
    assert mod["backward_warps"] == 4  # a heavy mod (T5's select chain)
    light = kb.kernel_report(8192, 8192, 128, score_mod=True, light_mod=True, dtype=jnp.bfloat16)
    assert light["forward_blocks"] == (64, 64) and light["forward_warps"] == 8
    assert light["backward_blocks"] == (16, 32) and light["backward_warps"] == 2
    loop = kb.kernel_report(8192, 8192, 64, score_mod=True, loop_mod=True, dtype=jnp.float32)
    assert loop["forward_blocks"] == (32, 64) and loop["forward_warps"] == 4
    assert kb.kernel_report(8192, 8192, 64, loop_mod=True)["forward_blocks"] == (128, 64)
    ieee = kb.kernel_report(8192, 8192, 64, dtype=jnp.float32, precision="ieee")
    assert "IEEE" in ieee["precision"] and ieee["backward_blocks"] == (16, 32)
    assert "Triton kernels" in kb.describe_backend()


def test_a_score_mods_tiles_and_warps_follow_its_cost():
    """`prepare` measures a score mod's tile backward (`backward_cost`) and
    picks its GPU tiles and warps by it (what `python benchmarks/aot.py` compiles
    without bf16 spills, docs/gpu.md): 16x32 backward tiles, 2 warps for a
    light mod (ALiBi, FIRE's loop), 4 for a heavy one (T5's select chain);
    at head dim 128 a 64x64 forward with 8 warps. Positions given
    explicitly keep T5 per logit; at default positions it reads distance
    tiles instead (a distance mod: no per-logit spec to measure)."""
    from jattn import positions
    from jattn.attention.pallas import score_mod_checks, score_mod_tiles

    inputs = _qkv(5, 1, 128, 128, 4, 2, 128)
    q, k, v = (jnp.asarray(inputs[n], jnp.bfloat16) for n in ("query", "key", "value"))
    mods = {
        "alibi": positions.alibi_score_mod(positions.alibi_slopes(4), mode="causal"),
        "fire": positions.fire_score_mod(positions.init_fire_params(jax.random.PRNGKey(0), 4)),
        "t5": positions.t5_score_mod(jnp.zeros((4, 32)), bidirectional=False),
    }
    positions_given = dict(q_positions=jnp.arange(128)[None], kv_positions=jnp.arange(128)[None])
    costs = {}
    for name, mod in mods.items():
        pre = fa.prepare(
            normal_form(q, k, v, is_causal=True, score_mod=mod, **positions_given),
            fa.KernelOptions(backend="gpu"),
        )
        spec = pre.fwd_cfg.score_mod
        assert spec is not None and not pre.fwd_cfg.distance_tiles, name
        costs[name] = score_mod_checks.backward_cost(spec, 16, 32)
        assert (pre.fwd_cfg.block_q, pre.fwd_cfg.block_k, pre.fwd_cfg.num_warps) == (64, 64, 8)
        is_light = costs[name] <= score_mod_checks.LIGHT_MOD_COST
        assert (pre.bwd_cfg.block_q, pre.bwd_cfg.block_k) == (16, 32), name
        assert pre.bwd_cfg.num_warps == (2 if is_light else 4), name
    light = score_mod_checks.LIGHT_MOD_COST
    assert costs["alibi"] <= light and costs["fire"] <= light and costs["t5"] > light
    # At default positions T5 (a distance mod) reads Toeplitz tiles: no per-logit spec.
    pre = fa.prepare(
        normal_form(q, k, v, is_causal=True, score_mod=mods["t5"]), fa.KernelOptions(backend="gpu")
    )
    assert pre.fwd_cfg.score_mod is None and pre.fwd_cfg.distance_tiles == 128
    # float32 at head dim 64: a mod whose forward loops (FIRE's MLP) takes a
    # 32x64 forward with 4 warps (128x64 spilled 144 B); the others keep 128x64.
    q32, k32, v32 = (
        jnp.asarray(inputs[n], jnp.float32)[..., :64] for n in ("query", "key", "value")
    )
    for name, mod in mods.items():
        spec = score_mod_tiles.mod_spec(mod, "gpu")[0]
        assert score_mod_checks.has_loop(spec) == (name == "fire"), name
        nf = normal_form(q32, k32, v32, is_causal=True, score_mod=mod, **positions_given)
        pre = fa.prepare(nf, fa.KernelOptions(backend="gpu"))
        fwd = (pre.fwd_cfg.block_q, pre.fwd_cfg.block_k, pre.fwd_cfg.num_warps)
        assert fwd == ((32, 64, 4) if name == "fire" else (128, 64, 8)), name
        assert (pre.bwd_cfg.block_q, pre.bwd_cfg.block_k) == (16, 32), name
    # Without a mod, nothing changes: 32x32 backward, 4 warps (head dim 128).
    pre = fa.prepare(normal_form(q, k, v, is_causal=True), fa.KernelOptions(backend="gpu"))
    assert (pre.bwd_cfg.block_q, pre.bwd_cfg.num_warps, pre.fwd_cfg.block_q) == (32, 4, 128)


def test_report_on_cpu_and_bad_options():
    report = kb.kernel_report(40, 40, 16)
    assert report["backend"].startswith("interpret") and report["forward_warps"] is None
    assert "interpret mode" in kb.describe_backend()
    with pytest.raises(ValueError, match="backward must be one of"):
        kb.kernel_report(40, 40, 16, backward="interleaved")
    nf = _normal_form(_qkv(1, *RAGGED), is_causal=False, max_distance=0)
    with pytest.raises(ValueError, match="fused.*Triton kernels only"):
        fa.flash_attention(nf, block_q=8, block_k=None, backend="tpu_interpret", backward="fused")


# --------------------------------------------------------------------------------------
# The fused backward against the oracle (every gradient) and the split one.


def _packed_shaw(dtype=np.float32):
    b, t, _, _, _, h, hv = MAIN
    seg, pos = _packed(b, [20, 9, 27, 8])
    inputs = _qkv(6, *MAIN, dtype=dtype)
    rng = np.random.default_rng(7)
    inputs.update(
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=pos,
        kv_positions=pos,
        rel_key=jnp.asarray(rng.standard_normal((7, h)), dtype),
        rel_value=jnp.asarray(rng.standard_normal((7, hv)), dtype),
    )
    return inputs


@pytest.mark.parametrize(
    "case",
    [
        "packed+shaw+bias_full",  # nT = 4 != nS = 2; dS tiles written by the dq half
        "ragged+mask+bias_keys",  # T=40, S=36; bias gradient summed over queries (dk/dv half)
        "gqa+bias_rows",  # bias [B, N, T, 1]: summed over keys (dq half)
        "mqa_cross+head_mask+shaw_far",  # per-head block map, FULL_LEFT/RIGHT tiles
    ],
)
def test_fused_backward_matches_oracle(case):
    kw = dict(backward="fused")
    rng = np.random.default_rng(70)
    if case == "packed+shaw+bias_full":
        inputs = _packed_shaw()
        b, t, s, n = MAIN[:4]
        inputs["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
        kw.update(is_causal=True, max_distance=3, block_q=16, block_k=32)
    elif case == "ragged+mask+bias_keys":
        b, t, s = RAGGED[:3]
        inputs = _qkv(71, *RAGGED)
        inputs["mask"] = rng.random((b, 1, t, s)) > 0.3
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, 1, 1, s)), jnp.float32)
    elif case == "gqa+bias_rows":
        b, t, _, n = MAIN[:4]
        inputs = _qkv(72, *MAIN)
        inputs["bias"] = jnp.asarray(rng.standard_normal((b, n, t, 1)), jnp.float32)
        kw.update(is_causal=True, block_q=32, block_k=16)
    else:
        shape = (2, 24, 56, 4, 1, 16)
        b, t, s, n, _, h = shape
        inputs = _qkv(73, *shape)
        inputs["mask"] = rng.random((1, n, t, s)) > 0.2
        inputs["rel_key"] = jnp.asarray(rng.standard_normal((n, 7, h)), jnp.float32)
        inputs["rel_value"] = jnp.asarray(rng.standard_normal((7, h)), jnp.float32)
        kw.update(max_distance=3)
    _check(inputs, **kw)


def test_fused_backward_window_dropout_bf16():
    # Dropout: the reference is the xla path (same keep mask); then bf16
    # against the oracle with a local window.
    inputs = _packed_shaw()
    inputs["dropout_rng"] = jax.random.PRNGKey(74)
    kw = dict(is_causal=True, max_distance=3, window=(10, 0), backward="fused")
    dropped, _ = _check(inputs, dropout_rate=0.3, **kw)
    kept, _ = _check(inputs, **kw)
    assert not np.allclose(dropped, kept, atol=1e-3)
    _check(_packed_shaw(jnp.bfloat16), tol=BF16_TOL, **kw)


@pytest.mark.parametrize("setting", ["debug_nans", "debug_infs"])
def test_fused_backward_strict_jax_settings(setting):
    # Eager, with dead rows, a window and dropout: no NaN or Inf anywhere
    # (the halves' untouched output blocks included), the xla path's values.
    _check_debug_mode(setting, backend="interpret", block_q=16, block_k=16, backward="fused")


def test_fused_backward_lowers_for_cuda():
    # jattn neither hides nor adds to jax's Triton deprecation warning (jax >=
    # 0.11 warns on every Triton lowering; docs/gpu.md): it reaches the caller.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        text = _lower_vjp(
            "cuda",
            "gpu",
            jnp.bfloat16,
            t=200,
            h=64,
            causal=True,
            packed=True,
            shaw=True,
            bias_shape=(1, 4, 200, 200),
            mask_shape=(1, 4, 1, 200),
            window=(64, 0),
            dropout_rate=0.1,
            backward="fused",
        )
    deprecated = [w for w in seen if TRITON_DEPRECATION in str(w.message)]
    assert bool(deprecated) == (JAX_VERSION >= (0, 11)), [str(w.message) for w in seen]
    assert "jattn_flash_fwd" in text and "jattn_flash_bwd_fused" in text
    assert "jattn_flash_dq" not in text and "jattn_flash_dkv" not in text


# --------------------------------------------------------------------------------------
# exp2, precision, warps, cached block maps.


def test_lse_is_natural_log():
    # The kernels keep a base-2 lse; the caller gets log Σ exp(logits).
    inputs = _qkv(80, *RAGGED)
    q, k, v = (np.asarray(inputs[x], np.float64) for x in ("query", "key", "value"))
    _, lse = jattn.dot_product_attention(
        inputs["query"],
        inputs["key"],
        inputs["value"],
        is_causal=True,
        implementation="pallas",
        return_residual=True,
    )
    logits = np.einsum("btnh,bsnh->btns", q, k) / np.sqrt(q.shape[-1])  # N = K here
    t, s = logits.shape[1], logits.shape[3]
    logits = np.where(np.tril(np.ones((t, s), bool))[None, :, None, :], logits, -np.inf)
    want = np.log(np.sum(np.exp(logits), axis=-1))  # [B, T, N]
    np.testing.assert_allclose(np.asarray(lse), want, rtol=1e-5, atol=1e-5)


def _kernel_dots(closed_jaxpr) -> list[tuple[str, object]]:
    """`(kernel name, eqn)` of every dot_general inside a pallas_call, in order."""
    found = []

    def walk(jaxpr, kernel):
        for eqn in jaxpr.eqns:
            if kernel is not None and eqn.primitive.name == "dot_general":
                found.append((kernel, eqn))
            inner_kernel = kernel
            if eqn.primitive.name == "pallas_call":
                inner_kernel = str(eqn.params["name"])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, inner_kernel)

    walk(closed_jaxpr.jaxpr, None)
    return found


def _kernel_dot_precisions(closed_jaxpr) -> list:
    """(operand dtype, precision) of every dot_general inside a pallas_call."""
    return [
        (str(eqn.invars[0].aval.dtype), eqn.params["precision"])
        for _, eqn in _kernel_dots(closed_jaxpr)
    ]


def _kernel_dot_dims(closed_jaxpr) -> dict[str, list]:
    """`{kernel name: [(lhs contracting dims, rhs contracting dims), ...]}`
    of the dot_generals inside each pallas_call."""
    found: dict[str, list] = {}
    for kernel, eqn in _kernel_dots(closed_jaxpr):
        (lhs, rhs), _ = eqn.params["dimension_numbers"]
        found.setdefault(kernel, []).append((tuple(lhs), tuple(rhs)))
    return found


def _grad_jaxpr(nf, **kwargs):
    """The jaxpr of the query gradient of the summed output of the Triton kernels
    compiled for the GPU (16x16 tiles), `kwargs` passed to `flash_attention`."""

    def loss(q):
        out, _ = fa.flash_attention(
            nf.replace(query=q), block_q=16, block_k=16, backend="gpu", **kwargs
        )
        return jnp.sum(out.astype(jnp.float32))

    return jax.make_jaxpr(jax.grad(loss))(nf.query)


@pytest.mark.parametrize("backward", ["split", "fused"])
def test_backward_dots_need_no_transposed_operand(backward):
    # The dk/dv tiles are computed transposed (Sᵀ = k·qᵀ, dPᵀ = v·dOᵀ), so
    # dV += Pᵀ·dO and dK += dSᵀ·q contract the lhs's columns: no kernel dot
    # contracts an operand's rows (a transposed operand, which Triton moves
    # through shared memory); the dk/dv tiles run two of each (bf16: native).
    inputs = _qkv(83, *RAGGED, dtype=jnp.bfloat16)
    nf = _normal_form(inputs, is_causal=True, max_distance=2)
    dims = _kernel_dot_dims(_grad_jaxpr(nf, backward=backward))
    nt, nn = ((1,), (1,)), ((1,), (0,))  # a·bᵀ and a·b
    assert all(d in (nt, nn) for ds in dims.values() for d in ds), dims
    if backward == "split":
        dkv = [ds for name, ds in dims.items() if "dkv" in name]
        # One copy of the tile per loop and branch (`tile_loop`), 2 + 2 dots each.
        assert len(dkv) == 1 and dkv[0].count(nt) == dkv[0].count(nn) >= 2, dims


@pytest.mark.parametrize(
    "dtype, precision",
    [(jnp.float32, None), (jnp.float32, "tf32x3"), (jnp.float32, "ieee"), (jnp.bfloat16, None)],
)
def test_kernel_dots_have_explicit_precision(dtype, precision):
    # Triton runs float32 dots as one TF32 pass unless told otherwise;
    # interpret mode is exact. Every in-kernel float32 dot is a TF32 pass
    # (HIGH) on split operands by default, three per product, except in the
    # compiled dq kernel, whose products are Triton's own three passes (the
    # TF32x3 algorithm, one dot each: spill-free at head dim 128); or IEEE
    # (HIGHEST) on request; bf16 dots are native.
    inputs = _qkv(81, *RAGGED, dtype=dtype)
    nf = _normal_form(inputs, is_causal=True, max_distance=0)
    dots = _kernel_dot_precisions(_grad_jaxpr(nf, precision=precision))
    kernel_dots = [p for d, p in dots if d == jnp.dtype(dtype).name]
    assert all(d == jnp.dtype(dtype).name for d, _ in dots), dots
    high = (jax.lax.Precision.HIGH, jax.lax.Precision.HIGH)
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    if dtype == jnp.float32 and precision != "ieee":
        assert kernel_dots.count(high) >= 15, kernel_dots  # 3 passes of: forward 2, dk/dv 3
        assert kernel_dots.count(x3) >= 2, kernel_dots  # dq 2, one dot each
        assert all(p in (high, x3) for p in kernel_dots), kernel_dots
    elif dtype == jnp.float32:
        assert len(kernel_dots) >= 5
        assert all(p == highest for p in kernel_dots), kernel_dots
    else:
        assert len(kernel_dots) >= 5  # forward 2, dq 2, dk/dv 3
        assert all(p is None or p == (None, None) for p in kernel_dots), kernel_dots
    assert tile_dot.dot_precision(jnp.float32) == jax.lax.Precision.HIGHEST
    assert tile_dot.dot_precision(jnp.float32, "tf32x3") == jax.lax.Precision.HIGH
    assert tile_dot.dot_precision(jnp.bfloat16, "tf32x3") is None
    assert tile_dot.dot_precision(jnp.float32, tile_dot.TRITON_X3) == x3
    assert tile_dot.dot_precision(jnp.bfloat16, tile_dot.TRITON_X3) is None


def test_the_fused_kernels_dq_half_leaves_tf32x3_to_triton():
    # One kernel, two halves: the dk/dv half splits by hand (HIGH passes), the
    # dq half uses Triton's TF32x3 (ptxas then compiles every float32
    # head-dim-128 fused variant spill-free, docs/gpu.md).
    nf = _normal_form(_qkv(82, *RAGGED), is_causal=True, max_distance=0)
    dots = [p for _, p in _kernel_dot_precisions(_grad_jaxpr(nf, backward="fused"))]
    high = (jax.lax.Precision.HIGH, jax.lax.Precision.HIGH)
    x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert dots.count(x3) >= 2 and dots.count(high) >= 15, dots
    assert set(dots) <= {high, x3}, dots


def test_precision_is_checked():
    nf = _normal_form(_qkv(83, *RAGGED), is_causal=True, max_distance=0)
    with pytest.raises(ValueError, match="precision must be one of"):
        fa.flash_attention(nf, precision="tf32")
    with pytest.raises(ValueError, match="precision must be one of"):
        kb.kernel_report(40, 40, 16, precision="highest")
    pre = fa.prepare(nf, fa.KernelOptions(backend="gpu"))
    assert pre.fwd_cfg.precision == pre.bwd_cfg.precision == "tf32x3"
    # Triton's own TF32x3 only where asked for "tf32x3" and compiled for a GPU;
    # not a precision a caller can name.
    assert with_triton_x3(pre.bwd_cfg).precision == tile_dot.TRITON_X3
    pre = fa.prepare(nf, fa.KernelOptions(backend="gpu", precision="ieee"))
    assert pre.fwd_cfg.precision == pre.bwd_cfg.precision == "ieee"
    assert with_triton_x3(pre.bwd_cfg).precision == "ieee"
    pre = fa.prepare(nf, fa.KernelOptions(backend="interpret"))
    assert with_triton_x3(pre.bwd_cfg).precision == tile_dot.TRITON_X3_INTERPRET
    with pytest.raises(ValueError, match="precision must be one of"):
        fa.flash_attention(nf, precision=tile_dot.TRITON_X3)


def test_warps_by_tile_rows():
    assert [kb.default_warps(bq) for bq in (16, 32, 64, 128, 256)] == [4, 4, 4, 8, 8]
    assert kb.default_warps(64, shaw_forward=True) == 8
    assert kb.default_warps(32, shaw_forward=True) == 4
    inputs = _qkv(82, 1, 256, 256, 2, 2, 64, dtype=jnp.bfloat16)
    nf = _normal_form(inputs, is_causal=True, max_distance=0)
    pre = fa.prepare(nf, fa.KernelOptions(backend="gpu"))
    assert (pre.fwd_cfg.block_q, pre.fwd_cfg.num_warps) == (128, 8)
    assert (pre.bwd_cfg.block_q, pre.bwd_cfg.num_warps) == (64, 4)
    pre = fa.prepare(nf, fa.KernelOptions(backend="gpu", num_warps=2))
    assert pre.fwd_cfg.num_warps == pre.bwd_cfg.num_warps == 2
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        fa.prepare(nf, fa.KernelOptions(backend="gpu", num_warps=6))


@pytest.mark.parametrize(
    "causal,window,dist,t,s,bq,bk",
    [(True, None, None, 40, 36, 16, 32), (False, (5, 3), 2, 64, 48, 16, 16)],
)
def test_cached_block_maps_equal_per_call_maps(causal, window, dist, t, s, bq, bk):
    pt, ps = -(-t // bq) * bq, -(-s // bk) * bk
    rules = dict(causal=causal, window=window, max_distance=dist)
    shapes = dict(seq_q=t, seq_k=s, block_q=bq, block_k=bk, padded_q=pt, padded_k=ps)
    static = blockmap.static_tiling(batch=2, **rules, **shapes)
    pos = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (2, n))  # noqa: E731
    vis = jattn.Visibility(
        is_causal=causal, local_window_size=window, q_positions=pos(t), kv_positions=pos(s)
    )
    meta = dict(vis=vis, mask=None, max_distance=dist, seq_k=s, batch=2)
    dynamic = blockmap.tiling(meta, bq, bk, pt, ps)
    for a, b in zip(static, dynamic, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(np.unique(np.asarray(static.classes))) >= 2  # not a trivial map
    # Cached: a second call builds nothing new.
    before = blockmap.static_maps.cache_info().hits
    blockmap.static_tiling(batch=3, **rules, **shapes)
    assert blockmap.static_maps.cache_info().hits == before + 1


def test_default_positions_flag_and_replace():
    inputs = _qkv(83, *RAGGED)
    nf = _normal_form(inputs, is_causal=True, max_distance=0)
    assert nf.visibility.default_positions
    moved = nf.visibility.replace(q_positions=nf.visibility.q_positions + 3)
    assert not moved.default_positions
    # None (as the block map's value without positions) keeps the flag.
    assert nf.visibility.replace(q_positions=None, kv_positions=None).default_positions
    given = _normal_form({**inputs, "q_positions": np.zeros((2, 40), np.int32)},
                         is_causal=True, max_distance=0)  # fmt: skip
    assert not given.visibility.default_positions
    # Shifted positions give a different causal map than the cached one.
    out = functools.partial(fa.flash_attention, block_q=16, block_k=16, backend="interpret")
    a, _ = out(nf)
    b, _ = out(nf.replace(visibility=moved))
    assert not np.allclose(np.asarray(a), np.asarray(b))


def test_view_composes_one_indexer():
    # The fused backward reads the split kernels' blocks through Views of its
    # larger blocks; each access must stay one indexer (Triton's limit).
    from jax.experimental import pallas as pl

    from jattn.attention.pallas.triton_forward import View

    class Ref:
        shape, dtype = (64, 4, 32), jnp.float32

        def __getitem__(self, idx):
            return idx

    rows = pl.ds(16, 16)
    view = View(Ref(), (rows, 2))  # [16, 32]: rows 16-31 of head 2
    assert view.shape == (16, 32) and view.dtype == jnp.float32
    assert view[...] == (rows, 2, slice(None))
    assert view[(slice(None), 5)] == (rows, 2, 5)  # a Shaw column
    assert view[pl.ds(4, 8), 3] == (pl.ds(20, 8), 2, 3)  # offsets compose
    assert View(Ref(), (1,))[..., pl.ds(0, 8)] == (1, slice(None), pl.ds(0, 8))
    with pytest.raises(ValueError, match="only pl.ds"):
        view[slice(0, 4)]
