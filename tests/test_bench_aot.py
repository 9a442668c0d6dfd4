"""`jattn bench aot` (benchmarks/aot.py) without the CUDA plugin: the variant
grid, the refusal, and the parsers of what ptxas and XLA write (on text in
the formats ptxas 12.9 and jaxlib 0.10.2 print, as seen in a real run)."""

from __future__ import annotations

import importlib.util
import pathlib

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
    assert len(names) == len(set(names)) == 5 * 2 * 2 * 2
    assert "shaw-float32-h128-fused" in names and "dropout-bfloat16-h64-split" in names
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
    ptx = tmp_path / "k.ptx"
    ptx.write_text(PTX)
    # Counted per entry: the fusion's mma is not the kernel's.
    assert aot.count_mma([str(ptx)]) == {"jattn_flash_fwd": 2}


def test_refuses_without_the_cuda_plugin(capsys):
    if aot.has_cuda_plugin():
        pytest.skip("the CUDA plugin is installed here: the refusal cannot be seen")
    assert aot.main(["--variants", "plain-bfloat16-h64-split"]) == 2
    assert 'pip install -e ".[aot]"' in capsys.readouterr().err
    assert aot.main(["--variants", "nothing*"]) == 2
