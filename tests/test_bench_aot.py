"""benchmarks/aot.py without the CUDA plugin or libtpu: the variant
grid, what a score-mod variant computes (its function in interpret mode
against float64, the mod's params in the vjp), the refusal, and the parsers
of what ptxas and XLA write (on text in the formats ptxas 12.9 and jaxlib
0.10.2 print, as seen in a real run)."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_aot", ROOT / "benchmarks" / "aot.py")
aot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aot)

PTXAS_LOG = """\
I1201 08:36:27.747641   14270 subprocess_compilation.cc:201] Using /v/nvidia/cuda_nvcc/bin/ptxas with version 12.9.86
I1201 08:36:28.167523   14269 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'jattn_flash_fwd' for 'sm_90a'
ptxas info    : Function properties for jattn_flash_fwd
    8408 bytes stack frame, 31048 bytes spill stores, 58372 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers
ptxas info    : Compile time = 191.051 ms

I1201 08:36:28.190724   14269 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'input_pad_reduce_fusion' for 'sm_90a'
ptxas info    : Function properties for input_pad_reduce_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 21 registers, used 0 barriers
I1201 08:36:28.519465   14270 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'jattn_flash_dq' for 'sm_90a'
ptxas info    : Function properties for jattn_flash_dq
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 126 registers, used 1 barriers
"""  # noqa: E501

THUNKS = """\
004: kCustomKernel [source       | next=005 (1)] loop_pad_fusion grid: [2, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
005: kCustomKernel [prev=004 (1) | next=006 (1)] jattn_flash_fwd grid: [2, 1, 4] threads: [256, 1, 1]  shared_memory: 65536 bytes
008: kCustomKernel [prev=007 (1) | next=009 (1)] jattn_flash_dq grid: [4, 1, 4] threads: [128, 1, 1]  shared_memory: 49152 bytes
"""  # noqa: E501
# jax 0.12's thunk sequence names a launch's kernel and shared memory so.
THUNKS_012 = """\
006: kCustomKernel [prev=005 (1) | next=007 (1)] kernel=loop_pad_fusion, launch dimensions=blocks: {2, 1, 1}, threads/block: {128, 1, 1}, cluster_dim=nullopt, shmem_bytes=0, use_pdl=true
012: kCustomKernel [prev=011 (1) | next=013 (1)] kernel=jattn_flash_dkv, profile_annotation=pallas_call.11, launch dimensions=blocks: {8, 1, 2}, threads/block: {128, 1, 1}, cluster_dim=nullopt, shmem_bytes=40960, use_pdl=true
"""  # noqa: E501

PTX = """\
.visible .entry jattn_flash_fwd(
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, 0, 1, 1, 0, 0;
\t@%p14 wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, 0, 1, 1, 0, 0;
}
.visible .entry loop_pad_fusion(
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
}
"""


def test_variant_grid_covers_every_kernel_option():
    names = aot.variants()
    assert len(names) == len(set(names)) == 12 * 2 * 2 * 3
    assert "shaw-float32-h128-fused" in names and "dropout-bfloat16-h64-split" in names
    assert "plain-bfloat16-h128-atomic" in names
    for mod in ("alibi", "t5", "softcap", "fire", "kerple", "shaw_bias"):
        assert f"{mod}-bfloat16-h128-fused" in names and f"{mod}-float32-h64-split" in names
    assert aot.parse_variant("window-float32-h64-fused") == dict(
        feature="window", dtype="float32", head_dim=64, backward="fused"
    )
    with pytest.raises(ValueError, match="unknown variant"):
        aot.parse_variant("rope-float32-h64-fused")


def test_ptxas_figures_of_jattn_kernels_only():
    kernels = aot.parse_ptxas(PTXAS_LOG)
    assert set(kernels) == {"jattn_flash_fwd", "jattn_flash_dq"}
    assert kernels["jattn_flash_fwd"] == dict(
        arch="sm_90a", registers=32, spill_stores=31048, spill_loads=58372, stack=8408
    )
    assert kernels["jattn_flash_dq"]["registers"] == 126
    assert kernels["jattn_flash_dq"]["spill_stores"] == 0
    assert aot.ptxas_version(PTXAS_LOG) == "12.9.86"


def test_shared_memory_and_tensor_core_counts(tmp_path):
    launches = aot.parse_launches(THUNKS)
    assert launches["jattn_flash_fwd"] == 65536 and launches["jattn_flash_dq"] == 49152
    assert aot.parse_launches(THUNKS_012) == {"loop_pad_fusion": 0, "jattn_flash_dkv": 40960}
    ptx = tmp_path / "k.ptx"
    ptx.write_text(PTX)
    # Counted per entry: the fusion's mma is not the kernel's.
    assert aot.count_mma([str(ptx)]) == {"jattn_flash_fwd": 2}


def test_refuses_without_the_cuda_plugin(capsys):
    if aot.installed("cuda"):
        pytest.skip("the CUDA plugin is installed here: the refusal cannot be seen")
    assert aot.main(["--variants", "plain-bfloat16-h64-split"]) == 2
    assert 'pip install -e ".[aot]"' in capsys.readouterr().err
    assert aot.main(["--variants", "nothing*"]) == 2


def test_backward_tile_flags_reach_each_kernel_and_the_child(monkeypatch):
    # --dq-blocks / --dkv-blocks / --dq-warps / --dkv-warps become one
    # BackwardTiles; --backward-blocks / --backward-warps stay flash_attention's
    # own (both kernels). (The parent hands a child its own flags.)
    from jattn.attention.pallas.config import BackwardTiles

    seen = []
    monkeypatch.setattr(aot, "child_main", lambda name, cfg, prec, tiles: seen.append(tiles) or 0)
    argv = ["--dq-blocks", "64", "32", "--dkv-blocks", "32", "64", "--dkv-warps", "8"]
    argv += ["--backward-blocks", "16", "16", "--backward-warps", "2", "--block-q", "128"]
    assert aot.main(["--child", "plain-bfloat16-h128-split", *argv]) == 0
    assert aot.flash_kwargs(seen[0]) == dict(
        block_q=128,
        backward_blocks=(16, 16),
        backward_warps=2,
        backward_tiles=BackwardTiles(dq_blocks=(64, 32), dkv_blocks=(32, 64), dkv_warps=8),
    )
    assert aot.flash_kwargs({"block_k": 32}) == {"block_k": 32}  # no BackwardTiles unasked


# --------------------------------------------------------------------------------------
# What a score-mod variant compiles: causal attention with the mod, and the
# vjp to q, k, v and the mod's params; run here in interpret mode.


def _reference(q, k, v, ct, mod):
    """Float64 `(out, (dq, dk, dv, dparams))` of causal GQA attention on the
    materialised modified logits."""
    b, t, n, h = q.shape
    f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
    with jax.enable_x64(True), jax.debug_infs(False):  # the masked logits are -inf

        def f(q, k, v, params):
            rep = n // k.shape[2]
            k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
            logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)  # [B, N, T, S]
            i = jnp.arange(t, dtype=jnp.int32)
            logits = mod.fn(
                params,
                logits,
                jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
                jnp.arange(n, dtype=jnp.int32)[None, :, None, None],
                i[None, None, :, None],
                i[None, None, None, :],
            )
            logits = jnp.where(i[None, None, None, :] <= i[None, None, :, None], logits, -jnp.inf)
            w = jax.nn.softmax(logits, axis=-1)
            return jnp.einsum("bnts,bsnv->btnv", w, v)

        out, vjp = jax.vjp(f, f64(q), f64(k), f64(v), jax.tree.map(f64, mod.params))
        return np.asarray(out), jax.tree.map(np.asarray, vjp(f64(ct)))


def _err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-6)


# T5's compare-and-select chain and FIRE's 32-unit MLP take 15-40 s each in
# interpret mode on this machine.
_SLOW_MODS = ("t5", "fire")


@pytest.mark.parametrize(
    "feature",
    [pytest.param(f, marks=pytest.mark.slow) if f in _SLOW_MODS else f for f in aot.SCORE_MODS],
)
def test_score_mod_variant_matches_float64_with_params_gradient(feature):
    b, t, n, kh, h = 1, 32, 4, 2, 16
    rng = np.random.default_rng(0)
    q, ct = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
    mod = aot.score_mod_of(feature, n)
    # Random params of the variant's shapes (its T5 table is zeros; a softcap
    # of 2 bends these logits visibly).
    leaves, tree = jax.tree.flatten(mod.params)
    new = [jnp.asarray(0.5 * rng.standard_normal(jnp.shape(x)), jnp.float32) for x in leaves]
    if feature == "softcap":
        new = [jnp.asarray(2.0, jnp.float32)]
    if feature == "kerple":  # r1, r2 > 0
        new = [jnp.abs(x) + 0.1 for x in new]
    params = jax.tree.unflatten(tree, new)
    fn = jax.jit(aot._variant_fn(feature, "split", interpret=True))
    out, (dq, dk, dv, diff) = fn(q, k, v, ct, {"mod": params})
    want_out, (wq, wk, wv, wparams) = _reference(q, k, v, ct, mod.__class__(mod.fn, params))
    for got, want in ((out, want_out), (dq, wq), (dk, wk), (dv, wv)):
        assert _err(got, want) <= 2e-5
    got_p, want_p = jax.tree.leaves(diff["mod"]), jax.tree.leaves(wparams)
    assert len(got_p) == len(want_p) == len(leaves)
    largest = max(float(np.max(np.abs(w))) for w in want_p)
    for g, w in zip(got_p, want_p, strict=True):
        # Leaves near 0 against 1% of the largest; an exactly-zero gradient (FIRE's
        # per-head constant: its Σ dS is 0) is the rounding of the terms it sums, held to
        # the largest leaf's scale, as the GPU check does (`_gpu_cells._leaf_scale`).
        size = float(np.max(np.abs(w)))
        scale = largest if size < 1e-6 * largest else max(size, 0.01 * largest, 1e-6)
        assert float(np.max(np.abs(np.asarray(g) - w))) / scale <= 1e-4


# --------------------------------------------------------------------------------------
# `--target tpu` without libtpu: the grid, the readers of what libtpu writes
# (a compiled module's text and a Mosaic dump, in the formats libtpu 0.0.42.1
# writes, as seen in a real run), the rows, and the variant's function on the
# Mosaic kernels in interpret mode.

tpu = aot

# One custom call of a compiled module (its serialized Mosaic body shortened).
HLO = """\
  %pad_bitcast_fusion = bf16[1,4,256,128]{3,2,1,0:T(8,128)(2,1)S(1)} fusion(%copy.8), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(f)/jvp()/transpose" stack_frame_id=14}
  %jvp_jattn_flash_fwd_tpu_.1 = (bf16[1,4,256,128]{3,2,1,0:T(8,128)(2,1)S(1)}, f32[1,4,256,1]{3,2,1,0:T(8,128)S(1)}) custom-call(%copy-done.3, %copy-done.5), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={}}, metadata={op_name="jit(f)/jvp(jattn_flash_fwd_tpu)/pallas_call" stack_frame_id=33}, backend_config={"flag_configs":[],"scoped_memory_configs":[],"custom_call_config":{"body":"TUzvUgFNTElS","needs_layout_passes":true},"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"196608"}],"retry_config":{"retry_count":"0"}}
  %transpose_jvp_jattn_flash_dq_tpu__.1 = bf16[1,4,256,128]{3,2,1,0:T(8,128)(2,1)S(1)} custom-call(%copy-done.3), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/transpose(jvp(jattn_flash_dq_tpu))/pallas_call" stack_frame_id=7}, backend_config={"custom_call_config":{"body":"TUzv"},"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"65536"},{"memory_space":"1","offset":"65536","size":"512"}]}
  %cc = f32[4]{0} custom-call(%p), custom_call_target="SomethingElse"
"""  # noqa: E501

# The forward kernel's signature after Mosaic's memref layout inference
# (T = S = 200 bf16, h128, causal: 128x128 tiles, positions as columns / rows).
MOSAIC_FUNC = """\
func.func @jattn_flash_fwd_tpu(%arg0: i32
, %arg1: i32
, %arg2: i32
, %arg3: i32
, %arg4: memref<4xi32, #tpu.tiled<(128),[1]>, #tpu.memory_space<smem>>
, %arg5: memref<8xi32, #tpu.tiled<(128),[1]>, #tpu.memory_space<smem>>
, %arg6: memref<2xi32, #tpu.tiled<(128),[1]>, #tpu.memory_space<smem>>
, %arg7: memref<1x1x128x128xbf16, #tpu.tiled<(8,128)(2,1),[16,16,1,1]>, #tpu.memory_space<vmem>>
, %arg8: memref<1x1x128x128xbf16, #tpu.tiled<(8,128)(2,1),[16,16,1,1]>, #tpu.memory_space<vmem>>
, %arg9: memref<1x1x128x128xbf16, #tpu.tiled<(8,128)(2,1),[16,16,1,1]>, #tpu.memory_space<vmem>>
, %arg10: memref<1x128x1xi32, #tpu.tiled<(8,128),[16,1,1]>, #tpu.memory_space<vmem>>
, %arg11: memref<1x1x128xi32, #tpu.tiled<(1,128),[1,1,1]>, #tpu.memory_space<vmem>>
, %arg12: memref<1x1x128x128xbf16, #tpu.tiled<(8,128)(2,1),[16,16,1,1]>, #tpu.memory_space<vmem>>
, %arg13: memref<1x1x128x1xf32, #tpu.tiled<(8,128),[16,16,1,1]>, #tpu.memory_space<vmem>>
, %arg14: memref<128x1xf32, #tpu.tiled<(8,128),[1,1]>, #tpu.memory_space<vmem>>
, %arg15: memref<128x1xf32, #tpu.tiled<(8,128),[1,1]>, #tpu.memory_space<vmem>>
, %arg16: memref<128x128xf32, #tpu.tiled<(8,128),[1,1]>, #tpu.memory_space<vmem>>)
 attributes {dimension_semantics = [#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<arbitrary>], iteration_bounds = array<i64: 1, 4, 2, 2>, scalar_prefetch = 3 : i64, scratch_operands = 3 : i64, tpu.core_type = #tpu.core_type<tc>
, window_params = [{transform_indices = @transform_0, window_bounds = array<i64: 1, 1, 128, 128>}, {transform_indices = @transform_1, window_bounds = array<i64: 1, 1, 128, 128>}, {transform_indices = @transform_2, window_bounds = array<i64: 1, 1, 128, 128>}, {transform_indices = @transform_3, window_bounds = array<i64: 1, 128, 1>}, {transform_indices = @transform_4, window_bounds = array<i64: 1, 1, 128>}, {transform_indices = @transform_5, window_bounds = array<i64: 1, 1, 128, 128>}, {transform_indices = @transform_6, window_bounds = array<i64: 1, 1, 128, 1>}]} {
""".replace("\n", "")  # noqa: E501


def test_tpu_variant_grid_both_chips_split_backward_only():
    names = tpu.variants("tpu")
    assert len(names) == len(set(names)) == 12 * 2 * 2 * 2
    assert "t5-float32-h64-split-v6e" in names and "shaw-bfloat16-h128-split-v5e" in names
    assert not any("fused" in n for n in names)  # the Mosaic family has no fused backward
    assert set(tpu.CI_SUBSET) <= set(names)
    assert tpu.parse_variant("window-float32-h64-split-v6e") == dict(
        feature="window", dtype="float32", head_dim=64, backward="split", chip="v6e"
    )
    for bad in ("window-float32-h64-fused-v5e", "window-float32-h64-split-v4", "plain-bf16"):
        with pytest.raises(ValueError, match="unknown variant"):
            tpu.parse_variant(bad)


def test_target_flag_picks_the_grid_and_keeps_cuda_default(capsys):
    assert aot.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == aot.variants("cuda")
    assert aot.main(["--target", "tpu", "--ci", "--list"]) == 0
    assert capsys.readouterr().out.split() == list(aot.CI_SUBSET)
    for argv in (["--target", "rocm"], ["--target", "tpu", "--precision", "ieee", "--list"]):
        with pytest.raises(SystemExit) as e:
            aot.main(argv)
        assert e.value.code == 2


def test_custom_calls_and_scoped_vmem_of_each_kernel():
    kernels, targets = tpu.parse_custom_calls(HLO)
    assert targets == ["SomethingElse", "tpu_custom_call"]
    assert kernels == {
        "jattn_flash_fwd_tpu": dict(custom_call="tpu_custom_call", scoped_vmem=196608),
        "jattn_flash_dq_tpu": dict(custom_call="tpu_custom_call", scoped_vmem=65536 + 512),
    }


def test_block_vmem_in_mosaic_tiled_layouts():
    # bf16 128x128 blocks: 32 KiB; an int32 [128, 1] column pads to 128 lanes
    # (64 KiB); an int32 [1, 128] row to one (1, 128) tile; float32 [128, 1] as
    # the column. Windows: q, k, v, q positions, kv positions, out, lse.
    assert tpu.memref_bytes([1, 1, 128, 128], "bf16", [8, 128]) == 128 * 128 * 2
    assert tpu.memref_bytes([1, 128, 1], "i32", [8, 128]) == 128 * 128 * 4
    assert tpu.memref_bytes([1, 1, 128], "i32", [1, 128]) == 128 * 4
    assert tpu.memref_bytes([4], "i32", [128]) == 128 * 4
    assert tpu.memref_bytes([12, 33], "f32", [8, 128]) == 16 * 128 * 4
    k = tpu.parse_mosaic_kernel("module {\n  " + MOSAIC_FUNC + "\n}")
    windows = 4 * 32768 + 65536 + 512 + 65536  # q, k, v, out; q pos; kv pos; lse
    scratch = 65536 + 65536 + 65536  # running max and sum [128, 1], accumulator [128, 128]
    assert k == dict(
        name="jattn_flash_fwd_tpu", grid="1x4x2x2", block_vmem=2 * windows, scratch_vmem=scratch
    )
    assert tpu.parse_mosaic_kernel("no kernel here") is None


def test_rows_per_kernel_failure_row_and_vmem_limit():
    result = dict(
        kernels={
            "jattn_flash_dq_tpu": dict(custom_call="tpu_custom_call", scoped_vmem=10),
            "jattn_flash_fwd_tpu": dict(custom_call="tpu_custom_call", scoped_vmem=20),
        },
        compile_s=1.5,
        hbm_peak=99,
    )
    mosaic = {"jattn_flash_fwd_tpu": dict(grid="1x4x2x2", block_vmem=100)}
    rows = tpu.kernel_rows("plain-bfloat16-h64-split-v5e", "ok", result, mosaic, 9.0)
    assert [r["kernel"] for r in rows] == ["jattn_flash_fwd_tpu", "jattn_flash_dq_tpu"]
    assert rows[0]["vmem"] == 120 and rows[1]["vmem"] == "" and rows[0]["chip"] == "v5e"
    assert all(r["compiled"] == "yes" and r["compile_s"] == 1.5 for r in rows)
    assert tpu.over_limit(rows) == []
    rows[0]["vmem"] = tpu.SCOPED_VMEM_LIMIT["v5e"] + 1
    assert tpu.over_limit(rows) == ["plain-bfloat16-h64-split-v5e jattn_flash_fwd_tpu"]
    failed = tpu.kernel_rows("t5-float32-h64-split-v6e", "exit 1: boom", {}, {}, 3.25)
    assert len(failed) == 1 and failed[0]["compiled"] == "no" and failed[0]["compile_s"] == 3.2
    assert failed[0]["status"] == "exit 1: boom" and set(failed[0]) == set(tpu.COLUMNS["tpu"])


def test_tpu_refuses_without_libtpu_or_its_venv(capsys, monkeypatch):
    if aot.installed("tpu"):
        pytest.skip("libtpu is installed in this interpreter: the refusal cannot be seen")
    monkeypatch.setattr(aot, "VENV_TPU", "/nonexistent/.venv-tpu/bin/python")
    assert aot.child_python("tpu") is None and aot.child_python("tpu", "/x/python") == "/x/python"
    assert aot.main(["--target", "tpu", "--variants", "plain-bfloat16-h64-split-v5e"]) == 2
    assert 'pip install -e ".[aot-tpu]"' in capsys.readouterr().err
    assert aot.main(["--target", "tpu", "--variants", "nothing*"]) == 2


def test_tpu_variant_function_matches_float64_in_interpret_mode():
    # What the TPU children compile (backend="tpu"), run on the Mosaic
    # kernels in interpret mode: causal GQA attention and its vjp.
    b, t, n, kh, h = 1, 24, 4, 2, 16
    rng = np.random.default_rng(1)
    q, ct = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
    fn = jax.jit(aot._variant_fn("plain", "split", backend="tpu_interpret"))
    out, (dq, dk, dv, diff) = fn(q, k, v, ct, {})
    identity = type("Identity", (), dict(fn=staticmethod(lambda p, s, *_: s), params={}))
    want_out, (wq, wk, wv, _) = _reference(q, k, v, ct, identity)
    assert diff == {}
    for got, want in ((out, want_out), (dq, wq), (dk, wk), (dv, wv)):
        assert _err(got, want) <= 2e-5
