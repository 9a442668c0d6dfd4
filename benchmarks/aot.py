"""Compile every Pallas kernel variant ahead of time for a device this host lacks.

A variant: one `jax.jit` of a feature's forward and its vjp, by dtype, head dim and
backward, compiled only, for an H100 (`--target cuda`: the Triton kernels;
`--target mosaic_gpu`: the Mosaic GPU ones, plain case, where a spill or a ptxas
warning fails it) or TPU v5e and v6e (`--target tpu`: the Mosaic kernels), each in
a child with a timeout (`_harness.run_child`), so an abort costs that variant only.
A row a kernel, from the compiler's own output. Shapes, columns and venvs:
docs/gpu.md ("Compiled for an H100 without one") and docs/tpu.md.

    python benchmarks/aot.py --variants 't5-bfloat16-*' --block-q 16 --block-k 32
    python benchmarks/aot.py --variants 'plain-bfloat16-h128-split' \\
        --dq-blocks 64 32 --dkv-blocks 32 64 --dq-warps 4 --dkv-warps 4
    python benchmarks/aot.py --target tpu --ci                # CI's subset (v5e)
    python benchmarks/aot.py --target mosaic_gpu --out docs/aot/mosaic_gpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import jattn  # noqa: E402
from jattn import positions  # noqa: E402
from jattn.attention.pallas import flash_attention as fa  # noqa: E402
from jattn.attention.pallas.backend import cuda_target  # noqa: E402
from jattn.attention.pallas.config import BackwardTiles  # noqa: E402

H100_TARGET_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h100.txtpb")

# Features that are a `score_mod` (alibi and sandwich: distance-table mods,
# whose per-logit form the kernels run).
SCORE_MODS = ("alibi", "t5", "softcap", "fire", "sandwich", "kerple", "shaw_bias")
FEATURES = ("plain", "segments", "window", "dropout", "shaw", *SCORE_MODS)
DTYPES = ("bfloat16", "float32")
HEAD_DIMS = (64, 128)
BACKWARDS = {"cuda": ("split", "fused", "atomic"), "tpu": ("split",)}  # Mosaic: split only
# The Mosaic GPU variants: plain attention, causal or not ("full"), bf16, at a length
# its tiles divide (`mosaic_gpu_attention.Tiles.multiple`).
MGPU_MASKS = ("causal", "full")
MGPU_SHAPE = dict(b=1, t=1024, n=4, kh=2)
SHAPE = dict(b=1, t=200, n=4, kh=2)  # as the CUDA lowering tests
SHAW_K = 16
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128  # T5's defaults; unidirectional (causal)
FIRE_HIDDEN = 32  # init_fire_params' default
SOFTCAP = 50.0  # Gemma 2's attention cap
MODULE = "jattn_aot_variant"  # the jitted function's name: its HLO module is jit_<name>
PTXAS_PROCESS = "--xla_gpu_enable_libnvjitlink=false --xla_gpu_enable_libnvptxcompiler=false"
# TPU chip -> (topology name, a placeholder accelerator type for libtpu); a 1x1 is refused.
CHIPS = {"v5e": ("v5e:2x2", "v5litepod-4"), "v6e": ("v6e:2x2", "v6e-4")}
SCOPED_VMEM_LIMIT = {"v5e": 16 << 20, "v6e": 32 << 20}  # XLA's default scoped VMEM limit
CI_SUBSET = tuple(f"{f}-bfloat16-h128-split-v5e" for f in ("plain", "shaw", "alibi"))
COLUMNS = {
    "cuda": ["variant", "kernel", "compiled", "registers", "spill_stores", "spill_loads",
             "stack", "shared_memory", "mma", "compile_s", "status"],
    "tpu": ["variant", "chip", "kernel", "compiled", "grid", "scoped_vmem", "block_vmem",
            "vmem", "custom_call", "hbm_peak", "compile_s", "status"],
}  # fmt: skip
COLUMNS["mosaic_gpu"] = COLUMNS["cuda"]
PER_KERNEL = ("dq_blocks", "dkv_blocks", "dq_warps", "dkv_warps")
TILE_FLAGS = ("block_q", "block_k", "num_warps", "backward_blocks", "backward_warps", *PER_KERNEL)
VENV_TPU = os.path.join(h.ROOT, ".venv-tpu", "bin", "python")


def variants(target: str = "cuda") -> list[str]:
    """Every variant name: `feature-dtype-hH-backward`, and `-chip` on a TPU;
    `mgpu-{causal,full}-bfloat16-hH` for Mosaic GPU."""
    if target == "mosaic_gpu":
        return [f"mgpu-{m}-bfloat16-h{hd}" for m in MGPU_MASKS for hd in HEAD_DIMS]
    chips = list(CHIPS) if target == "tpu" else [None]
    grid = itertools.product(FEATURES, DTYPES, HEAD_DIMS, BACKWARDS[target], chips)
    return ["-".join(filter(None, (f, d, f"h{hd}", b, c))) for f, d, hd, b, c in grid]


def parse_variant(name: str) -> dict:
    """A variant's feature, dtype, head dim, backward (and chip, on a TPU)."""
    parts = name.split("-")
    if parts[0] == "mgpu":
        if name not in variants("mosaic_gpu"):
            raise ValueError(f"aot: unknown variant {name!r}; see --list")
        return dict(mgpu=parts[1] == "causal", dtype=parts[2], head_dim=int(parts[3][1:]))
    target = "tpu" if len(parts) == 5 else "cuda"
    if len(parts) < 4 or name not in variants(target):
        raise ValueError(f"aot: unknown variant {name!r}; see --list")
    spec = dict(feature=parts[0], dtype=parts[1], head_dim=int(parts[2][1:]), backward=parts[3])
    return spec | ({"chip": parts[4]} if target == "tpu" else {})


# The child: compile one variant.
def score_mod_of(feature: str, num_heads: int):
    """The `jattn.ScoreMod` of a score-mod feature, with concrete float32 parameters."""
    if feature == "alibi":
        return positions.alibi_score_mod(positions.alibi_slopes(num_heads), mode="causal")
    if feature == "t5":
        table = jnp.zeros((num_heads, T5_BUCKETS), jnp.float32)  # [N, buckets]
        return positions.t5_score_mod(table, max_distance=T5_MAX_DISTANCE, bidirectional=False)
    if feature == "softcap":
        return positions.softcap_score_mod(SOFTCAP)
    if feature == "sandwich":
        return positions.sandwich_score_mod(num_heads)
    if feature == "kerple":  # r1, r2 > 0 (the paper clamps them so)
        return positions.kerple_score_mod(*(jnp.full((num_heads,), 0.5, jnp.float32),) * 2)
    if feature == "shaw_bias":
        return positions.shaw_bias_score_mod(jnp.zeros((num_heads, 2 * SHAW_K + 1)), SHAW_K)
    if feature == "fire":
        key = jax.random.key(0)
        return positions.fire_score_mod(positions.init_fire_params(key, num_heads, FIRE_HIDDEN))
    raise ValueError(f"aot: {feature!r} is not a score-mod feature; one of {SCORE_MODS}")


def _variant_fn(feature, backward, precision=None, interpret=False, tiles=None, backend=None):
    """`f(q, k, v, ct, extra) -> (out, grads)`: `flash_attention` and its vjp (to q, k, v
    and `extra`'s `rel_*` and `mod`); `tiles`: the overrides (`flash_kwargs`)."""

    def forward(q, k, v, extra):
        kw = dict(is_causal=True)
        if feature == "segments":
            kw.update(extra)
        elif feature == "window":
            kw["local_window_size"] = (64, 0)
        elif feature == "dropout":
            kw.update(dropout_rate=0.1, dropout_rng=extra["dropout_rng"])
        elif feature == "shaw":
            kw["relative"] = jattn.ShawRelative(extra["rel_key"], extra["rel_value"], SHAW_K)
        elif feature in SCORE_MODS:
            mod = score_mod_of(feature, q.shape[2])
            kw["score_mod"] = dataclasses.replace(mod, params=extra["mod"])
        mode = dict(backend=backend) if backend else dict(interpret=interpret)
        vis, rest = jattn.visibility.split_keywords(kw)
        drop = jattn.dropout.Dropout(rest.pop("dropout_rate", 0.0), rest.pop("dropout_rng", None))
        nf = jattn.normalise(q, k, v, visibility=vis, dropout=drop, **rest)
        kw = dict(backward=backward, precision=precision, **mode, **flash_kwargs(tiles))
        return fa.flash_attention(nf, **kw)[0]

    def jattn_aot_variant(q, k, v, ct, extra):
        diff = {n: x for n, x in extra.items() if n.startswith("rel_") or n == "mod"}
        fixed = {n: x for n, x in extra.items() if n not in diff}
        out, vjp = jax.vjp(lambda q, k, v, d: forward(q, k, v, {**fixed, **d}), q, k, v, diff)
        return out, vjp(ct)

    return jattn_aot_variant


def _mgpu_fn(causal: bool):
    """`f(q, k, v, ct) -> (out, grads)` through `flash_attention(backend="mosaic_gpu")`."""

    def forward(q, k, v):
        nf = jattn.normalise(q, k, v, visibility=jattn.Visibility(is_causal=causal))
        return fa.flash_attention(nf, backend="mosaic_gpu")[0]

    def jattn_aot_variant(q, k, v, ct):
        out, vjp = jax.vjp(forward, q, k, v)
        return out, vjp(ct)

    return jattn_aot_variant


def flash_kwargs(tiles: dict | None) -> dict:
    """`flash_attention`'s keyword arguments of the tile overrides `tiles` (the flags
    of the same names): pairs as tuples, the per-kernel ones in one `BackwardTiles`."""
    tiles = {n: tuple(v) if isinstance(v, list | tuple) else v for n, v in (tiles or {}).items()}
    per_kernel = {n: tiles.pop(n) for n in PER_KERNEL if n in tiles}
    return tiles | ({"backward_tiles": BackwardTiles(**per_kernel)} if per_kernel else {})


def variant_inputs(spec: dict, sds) -> tuple:
    """`(q, k, v, ct, extra)` of a variant as `sds(shape, dtype)`: `q`, `ct` `[B, T, N, H]`."""
    b, t, n, kh, hd = SHAPE["b"], SHAPE["t"], SHAPE["n"], SHAPE["kh"], spec["head_dim"]
    dtype, feature = jnp.dtype(spec["dtype"]), spec["feature"]
    q, ct, k = sds((b, t, n, hd), dtype), sds((b, t, n, hd), dtype), sds((b, t, kh, hd), dtype)
    extra = {}
    if feature == "segments":
        for key in ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions"):
            extra[key] = sds((b, t), jnp.int32)
    elif feature == "dropout":
        extra["dropout_rng"] = sds((2,), jnp.uint32)
    elif feature == "shaw":
        extra["rel_key"] = extra["rel_value"] = sds((2 * SHAW_K + 1, hd), jnp.float32)
    elif feature in SCORE_MODS:
        params = score_mod_of(feature, n).params
        extra["mod"] = jax.tree.map(lambda x: sds(jnp.shape(x), jnp.result_type(x)), params)
    return q, k, k, ct, extra


def child_main(name: str, target_config: str | None, precision=None, tiles=None) -> int:
    """Compiles variant `name` (CUDA: for `target_config`) and prints ``AOT_RESULT
    {json}`` (an exception: ``AOT_ERROR`` and its first line, then the traceback)."""
    spec, tiles = parse_variant(name), tiles or {}
    tpu, mgpu = "chip" in spec, "mgpu" in spec
    where = dict(topology_name=CHIPS[spec["chip"]][0], platform="tpu") if tpu else dict(
        platform="cuda", target_config=target_config, topology="1x1x1"
    )  # fmt: skip
    device = topologies.get_topology_desc(**where).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    kw = dict(tiles=tiles, backend="tpu" if tpu else None)
    sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sharding)
    if mgpu:  # Mosaic GPU: XLA's compile runs its pipeline and ptxas (MOSAIC_GPU_DUMP_*)
        b, t, n, kh = MGPU_SHAPE.values()
        q, k = (sds((b, t, x, spec["head_dim"]), jnp.bfloat16) for x in (n, kh))
        fn, inputs = jax.jit(_mgpu_fn(spec["mgpu"])), (q, k, k, q)
        tiles = {"mosaic_gpu_attention.Tiles()": "(default)"}
    else:
        fn = jax.jit(_variant_fn(spec["feature"], spec["backward"], precision, **kw))
        inputs = variant_inputs(spec, sds)
    start = time.perf_counter()
    try:
        if tpu:
            lowered = fn.trace(*inputs).lower()
        else:
            jax.eval_shape(fn, *inputs)  # fills the kernels' static block maps outside the mesh
            with cuda_target(device.device_kind):
                lowered = fn.trace(*inputs).lower()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
    except Exception as e:  # one line for the table; the traceback stays in the log
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"AOT_ERROR {type(e).__name__}: {first}"[:400], flush=True)
        raise
    text = [f"{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in tiles.items()]
    result = dict(
        device=device.device_kind, jax=jax.__version__, jaxlib=jaxlib.__version__,
        tiles=", ".join(text) or "default", lower_s=round(lowered_at - start, 2),
        compile_s=round(time.perf_counter() - lowered_at, 2),
    )  # fmt: skip
    if tpu:
        kernels, targets = parse_custom_calls(compiled.as_text())
        peak = getattr(compiled.memory_analysis(), "peak_memory_in_bytes", "")
        result.update(kernels=kernels, custom_calls=targets, hbm_peak=peak)
        result["libtpu"] = importlib.metadata.version("libtpu")
    else:
        result["precision"] = "bf16 wgmma" if mgpu else precision or "tf32x3 (default)"
    print("AOT_RESULT " + json.dumps(result), flush=True)
    return 0


# Reading what the compilers said.
_PTXAS_BLOCK = re.compile(
    r"Compiling entry function '(?P<name>\w+)' for '(?P<arch>sm_\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
    r"(?P<loads>\d+) bytes spill loads.*?Used (?P<registers>\d+) registers",
    re.S,
)
_PTXAS_VERSION = re.compile(r"ptxas with version (\S+)")
_LAUNCH = re.compile(r"(?:\] |kernel=)(?P<name>\w+)[ ,].*?(?:memory: |shmem_bytes=)(?P<bytes>\d+)")
_MMA = re.compile(r"^\s*(?:@%p\d+\s+)?(?:wgmma\.mma_async|mma\.sync)", re.M)
_WGMMA_INLINE = re.compile(r"wgmma\.mma_async")  # Mosaic GPU's: inside inline-asm braces
_CALL = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_OP_NAME = re.compile(r'op_name="[^"]*?(?P<kernel>jattn_\w+?)\)*/pallas_call')
_SCOPED = re.compile(r'"used_scoped_memory_configs":\[(?P<configs>[^\]]*)\]')
_SIZE = re.compile(r'"size":"(\d+)"')
_FUNC = re.compile(r"func\.func @(?P<name>\w+)\((?P<args>.*?)\) attributes \{(?P<attrs>.*)$", re.M)
_MEMREF = re.compile(
    r"memref<(?P<dims>(?:\d+x)*)(?P<dtype>\w+), #tpu\.tiled<\((?P<tile>[\d,]+)\)[^>]*>, "
    r"#tpu\.memory_space<(?P<space>\w+)>>"
)
ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "ui32": 4, "i16": 2, "i8": 1, "i1": 1}
KERNEL_ORDER = ("_fwd", "_dq", "_dkv")  # a variant's TPU rows: forward, then backward


def parse_ptxas(log: str) -> dict[str, dict]:
    """ptxas `-v` figures of each jattn kernel in a compile log (XLA logs
    each ptxas run's output as one message, so a block is contiguous)."""
    kernels = {}
    for chunk in re.split(r"\n(?=[IWEF]\d{4} )", log):
        for m in _PTXAS_BLOCK.finditer(chunk):
            if m["name"].startswith("jattn_"):
                r, st, lo, sk = (int(m[k]) for k in ("registers", "stores", "loads", "stack"))
                kernels[m["name"]] = dict(arch=m["arch"], registers=r, spill_stores=st,
                                          spill_loads=lo, stack=sk)  # fmt: skip
    return kernels


_PTXAS_WARNING = re.compile(r"^ptxas warning\s*:.*$", re.M)


def ptxas_warnings(log: str) -> list[str]:
    """The warning lines ptxas printed (`ptxas warning : ...`), each once."""
    return sorted(set(_PTXAS_WARNING.findall(log)))


def strict_status(row: dict, warnings: list[str]) -> dict:
    """A Mosaic GPU kernel's row, a spill or a ptxas warning (one naming a function:
    that kernel's only) made a failure: their tiles are chosen to have none."""
    spills = [c for c in ("spill_stores", "spill_loads") if row.get(c) not in ("", 0, None)]
    named = re.compile(r"function '(\w+)'")
    mine = [w for w in warnings if (m := named.search(w)) is None or m[1] == row.get("kernel")]
    problems = [f"{c} {row[c]} B" for c in spills] + mine
    if row["status"] == "ok" and problems:
        row = row | dict(status="FAIL: " + "; ".join(problems)[:200])
    return row


def ptxas_version(log: str) -> str:
    return m[1] if (m := _PTXAS_VERSION.search(log)) else "?"


def parse_launches(thunks: str) -> dict[str, int]:
    """Shared memory (bytes) of each kernel launch in a thunk sequence dump (jax 0.10-0.12)."""
    return {m["name"]: int(m["bytes"]) for m in _LAUNCH.finditer(thunks)}


def count_mma(ptx_files: list[str], texts: tuple[str, ...] = (), pattern=_MMA) -> dict[str, int]:
    """Tensor-core instructions (`pattern`) in each jattn kernel's PTX (files, or
    `texts` such as a log Mosaic GPU printed it in): 0 means the dots run as FMAs."""
    counts = {}
    for text in [*map(_read, ptx_files), *texts]:  # an entry's body runs to the next entry
        for body in re.split(r"(?=\.entry \w+\()", text):
            if m := re.match(r"\.entry (jattn_\w+)\(", body):
                counts[m[1]] = len(pattern.findall(body))
    return counts


def parse_custom_calls(hlo: str) -> tuple[dict[str, dict], list[str]]:
    """`({kernel: {custom_call, scoped_vmem}}, every custom-call target)` of
    a compiled TPU module's text (`compiled.as_text()`)."""
    kernels, targets = {}, []
    for line in hlo.splitlines():
        if call := _CALL.search(line):
            targets.append(call["target"])
        if call and (name := _OP_NAME.search(line)):
            scoped = _SCOPED.search(line)
            size = sum(int(x) for x in _SIZE.findall(scoped["configs"])) if scoped else None
            kernels[name["kernel"]] = dict(custom_call=call["target"], scoped_vmem=size)
    return kernels, sorted(set(targets))


def memref_bytes(dims: list[int], dtype: str, tile: list[int]) -> int:
    """Bytes of a memref in a tiled layout: its last dims padded to the tile."""
    lead, last = dims[: len(dims) - len(tile)], dims[len(dims) - len(tile) :]
    padded = [math.ceil(d / t) * t for d, t in zip(last, tile, strict=True)]
    return math.prod(lead) * math.prod(padded) * ITEMSIZE[dtype]


def parse_mosaic_kernel(text: str) -> dict | None:
    """`{name, grid, block_vmem, scratch_vmem}` of the kernel in one Mosaic dump after
    memref layout inference (windows: two buffers each; scratch: the last ones)."""
    if not (func := _FUNC.search(text)):
        return None
    vmem = [
        memref_bytes([int(d) for d in m["dims"].split("x") if d], m["dtype"],
                     [int(t) for t in m["tile"].split(",")])
        for m in _MEMREF.finditer(func["args"])
        if m["space"] == "vmem"
    ]  # fmt: skip
    scratch = re.search(r"scratch_operands = (\d+)", func["attrs"])
    windows = len(vmem) - (int(scratch[1]) if scratch else 0)
    bounds = re.search(r"iteration_bounds = array<i64: ([\d, ]+)>", func["attrs"])
    grid = "x".join(bounds[1].replace(" ", "").split(",")) if bounds else ""
    return dict(name=func["name"], grid=grid, block_vmem=2 * sum(vmem[:windows]),
                scratch_vmem=sum(vmem[windows:]))  # fmt: skip


def _files(folder: str, suffix: str) -> list[str]:
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return [os.path.join(folder, f) for f in names if f.endswith(suffix)]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _rows(target, name, status, result, wall, kernels: dict) -> list[dict]:
    """A row per kernel (its `kernels[kernel]` figures), or one for the variant when
    none got as far as the compiler's report."""
    compiled, seconds = "yes" if status == "ok" else "no", result.get("compile_s", round(wall, 1))
    common = dict(variant=name, compiled=compiled, compile_s=seconds, status=status)
    if target == "tpu":
        common["chip"] = name.rsplit("-", 1)[1]
    if not kernels:
        failed = dict(compiled="no", compile_s=round(wall, 1))
        return [dict.fromkeys(COLUMNS[target], "") | common | failed]
    return [common | {"kernel": kernel} | figures for kernel, figures in kernels.items()]


def cuda_rows(name: str, status: str, result: dict, log: str, dump: str, wall: float):
    """One row per Triton kernel of a variant (or one for the variant when none compiled)."""
    kernels = parse_ptxas(log)
    launches = {}
    for path in _files(dump, "thunk_sequence.txt"):
        launches.update(parse_launches(_read(path)))
    mma = count_mma(_files(dump, ".ptx"))
    names = sorted(set(kernels) | {k for k in launches if k.startswith("jattn_")})
    figures = {k: {c: kernels.get(k, {}).get(c, "") for c in COLUMNS["cuda"][3:7]} for k in names}
    for k in names:
        figures[k].update(shared_memory=launches.get(k, ""), mma=mma.get(k, ""))
    return _rows("cuda", name, status, result, wall, figures)


def kernel_rows(name: str, status: str, result: dict, mosaic: dict[str, dict], wall: float):
    """One row per Mosaic kernel of a variant (or one for the variant when none compiled)."""
    calls, figures = result.get("kernels", {}), {}
    order = lambda k: (next((i for i, w in enumerate(KERNEL_ORDER) if w in k), 9), k)
    for kernel in sorted(set(calls) | set(mosaic), key=order):
        call, mo = calls.get(kernel, {}), mosaic.get(kernel, {})
        scoped, block = call.get("scoped_vmem"), mo.get("block_vmem")
        total = scoped + block if scoped is not None and block is not None else ""
        figures[kernel] = dict(
            grid=mo.get("grid", ""), scoped_vmem="" if scoped is None else scoped, vmem=total,
            block_vmem="" if block is None else block, custom_call=call.get("custom_call", ""),
            hbm_peak=result.get("hbm_peak", ""),
        )  # fmt: skip
    return _rows("tpu", name, status, result, wall, figures)


def over_limit(rows: list[dict]) -> list[str]:
    """TPU kernels whose VMEM exceeds their chip's default scoped VMEM limit."""
    return [f"{r['variant']} {r['kernel']}" for r in rows
            if r["vmem"] != "" and r["vmem"] > SCOPED_VMEM_LIMIT[r["chip"]]]  # fmt: skip


# The parent: a child a variant, the table.
def run_variant(name: str, args, dump_root: str) -> tuple[list[dict], dict]:
    """Compile one variant in a child process: its kernel rows and the child's result."""
    dump = os.path.join(dump_root, name)
    os.makedirs(os.path.join(dump, "mosaic"), exist_ok=True)
    env = h.child_env(JAX_PLATFORMS="cpu")  # CUDA: the plugin then skips its driver check
    if args.target == "tpu":  # what libtpu needs to serve a topology on a host that is no TPU VM
        env.update(TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost")
        env["TPU_ACCELERATOR_TYPE"] = CHIPS[parse_variant(name)["chip"]][1]
        flags = f"--xla_mosaic_dump_to={os.path.join(dump, 'mosaic')}"
        env["LIBTPU_INIT_ARGS"] = " ".join(filter(None, [env.get("LIBTPU_INIT_ARGS"), flags]))
    else:  # ptxas's -v report in the log (ptxas as a process: 0.12 links in-process, silent)
        env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="subprocess_compilation=3")
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*{MODULE}.* {PTXAS_PROCESS}"
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), flags]))
    if args.target == "mosaic_gpu":  # Mosaic GPU prints ptxas's report and the PTX itself
        env.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
    cmd = [args.python, os.path.abspath(__file__), *args.argv, "--child", name]  # the same flags
    child = h.run_child(cmd, os.path.join(dump, "compile.log"), timeout_s=args.timeout_s, env=env)
    tagged = dict(ln.split(" ", 1) for ln in child.output.splitlines()
                  if ln.startswith(("AOT_RESULT ", "AOT_ERROR ")))  # fmt: skip
    result, error = json.loads(tagged.get("AOT_RESULT", "{}")), tagged.get("AOT_ERROR", "")
    result.update(ptxas=ptxas_version(child.output), wall_s=round(child.seconds, 1))
    status = child.status
    if status.startswith("exit"):
        lines = [ln for ln in child.output.splitlines() if ln.strip() and ln[:1] not in "IW "]
        status += ": " + (error or (lines[-1][:200] if lines else "no output"))
    if args.target == "tpu":
        mosaic = {}
        for path in _files(os.path.join(dump, "mosaic"), "-post-infer-memref-layout.txt"):
            if kernel := parse_mosaic_kernel(_read(path)):
                mosaic[kernel["name"]] = kernel
        rows = kernel_rows(name, status, result, mosaic, child.seconds)
    else:
        rows = cuda_rows(name, status, result, child.output, dump, child.seconds)
    if args.target == "mosaic_gpu":  # its PTX and ptxas's report are in the log
        mma, warnings = count_mma([], (child.output,), _WGMMA_INLINE), ptxas_warnings(child.output)
        rows = [strict_status(r | {"mma": mma.get(r["kernel"], "")}, warnings) for r in rows]
        status = rows[0]["status"]
    if status == "ok" and not args.keep_dumps:
        shutil.rmtree(dump, ignore_errors=True)
    return rows, result


def write_table(path: str, rows: list[dict], header: dict, target: str) -> None:
    """The markdown table at `path` and the same rows as CSV beside it."""
    h.write_csv(os.path.splitext(path)[0] + ".csv", rows, COLUMNS[target])
    versions = f"jax {header.get('jax', '?')}, jaxlib {header.get('jaxlib', '?')}"
    shape = f"T = {SHAPE['t']}, causal, GQA {SHAPE['n']}/{SHAPE['kh']}, Shaw k = {SHAW_K}"
    tiles, calls = f"tiles {header.get('tiles', '?')}", ", ".join(header.get("custom_calls", []))
    title = {
        "tpu": f"AOT compile for TPU v5e and v6e (compile-only), {versions}, libtpu "
        f"{header.get('libtpu', '?')}; {shape}; {tiles}; module custom calls {calls or '?'}. "
        "Bytes: scoped_vmem (libtpu), block_vmem (pipelined blocks, two buffers each), vmem "
        "(their sum), hbm_peak (the whole module).",
        "mosaic_gpu": f"AOT compile of the Mosaic GPU kernels (plain attention) for "
        f"{header.get('device', '?')} (sm_90a), {versions}, ptxas {header.get('ptxas', '?')}; "
        f"B = {MGPU_SHAPE['b']}, T = S = {MGPU_SHAPE['t']}, GQA {MGPU_SHAPE['n']}/"
        f"{MGPU_SHAPE['kh']}; {tiles}. A spill or a ptxas warning fails a kernel. Registers: "
        "what ptxas allots at launch (the compute warpgroups raise theirs with setmaxnreg); "
        "bytes for spills and stack; mma: wgmma instructions in the PTX.",
        "cuda": f"AOT compile for {header.get('device', '?')} (sm_90a), {versions}, ptxas "
        f"{header.get('ptxas', '?')}; {shape}; float32 dots {header.get('precision', '?')}; "
        f"{tiles}. Bytes for spills, stack and shared memory; mma: tensor-core instructions "
        "in the PTX.",
    }[target]
    cells = [[r[c] for c in COLUMNS[target]] for r in rows]
    with open(path, "w") as f:
        f.write(title + "\n\n" + h.table(COLUMNS[target], cells) + "\n")


def _tiles(args) -> dict:
    """The tile overrides given on the command line (see `flash_kwargs`)."""
    return {n: getattr(args, n) for n in TILE_FLAGS if getattr(args, n) is not None}


def installed(target: str) -> bool:
    """Whether this interpreter has (not imported) jax's CUDA 12/13 plugin, or libtpu."""
    names = ["libtpu"] if target == "tpu" else [f"jax_plugins.xla_cuda{v}" for v in (12, 13)]
    try:
        return any(importlib.util.find_spec(n) for n in names)
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def child_python(target: str, given: str | None = None) -> str | None:
    """The children's interpreter: `--python`; this one if `installed`; else, on a TPU,
    the checkout's .venv-tpu."""
    if given or installed(target):
        return given or sys.executable
    return VENV_TPU if target == "tpu" and os.access(VENV_TPU, os.X_OK) else None


REFUSAL = dict(
    cuda="needs jax's CUDA plugin for the compile-only H100 (ptxas included): pip "
    'install -e ".[aot]" in a venv of its own',
    tpu="needs libtpu for the compile-only "
    'TPUs: python3 -m venv .venv-tpu && .venv-tpu/bin/pip install -e ".[aot-tpu]"',
)
REFUSAL["mosaic_gpu"] = REFUSAL["cuda"]  # the same CUDA plugin compiles it


def main(argv=None) -> int:
    p = h.parser(__doc__)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per variant")
    p.add_argument("--out", help="the table (default runs/bench/aot.md, aot_tpu.md on a TPU)")
    targets = ("cuda", "tpu", "mosaic_gpu")
    p.add_argument("--target", choices=targets, default="cuda", help="the device kind")
    p.add_argument("--variants", nargs="*", default=["*"], help="names or globs (--list)")
    p.add_argument("--ci", action="store_true", help=f"TPU: CI's subset, {', '.join(CI_SUBSET)}")
    p.add_argument("--dump-dir", default=None, help="default: a temporary folder")
    p.add_argument("--keep-dumps", action="store_true", help="keep the dumps of compiled variants")
    p.add_argument("--target-config", default=None, help="CUDA: a GpuTargetConfigProto text file")
    precisions = ["tf32x3", "ieee"]
    p.add_argument("--precision", choices=precisions, help="CUDA: the kernels' float32 dots")
    for flag in ("--block-q", "--block-k", "--num-warps"):
        p.add_argument(flag, type=int, default=None, help="override the default (all kernels)")
    for flag in ("--backward-blocks", "--dq-blocks", "--dkv-blocks"):
        p.add_argument(flag, type=int, nargs=2, metavar=("BQ", "BK"), help="backward tiles")
    for flag in ("--backward-warps", "--dq-warps", "--dkv-warps"):
        p.add_argument(flag, type=int, default=None, help="the backward kernels' warps")
    p.add_argument("--python", default=None, help="the children's interpreter")
    p.add_argument("--list", action="store_true", help="list the variants and stop")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = h.parse(p, argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--list"]
    cuda_only = set(_tiles(args)) - {"block_q", "block_k"} or args.precision or args.target_config
    if args.target == "tpu" and cuda_only:
        p.error("--target tpu takes no --precision, --target-config or tiles but --block-q/k")
    if args.target == "mosaic_gpu" and (_tiles(args) or args.precision):
        p.error("--target mosaic_gpu takes no tiles or --precision (its Tiles are fixed)")
    if args.child:
        config = _read(args.target_config or H100_TARGET_CONFIG)
        return child_main(args.child, config, args.precision, _tiles(args))
    suffix = {"cuda": "", "tpu": "_tpu", "mosaic_gpu": "_mosaic_gpu"}[args.target]
    args.out = args.out or os.path.join(h.OUT_DIR, f"aot{suffix}.md")
    patterns = list(CI_SUBSET) if args.ci else args.variants
    names = [v for v in variants(args.target) if any(fnmatch.fnmatch(v, x) for x in patterns)]
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print(f"aot: no variant matches {patterns}; see --list", file=sys.stderr)
        return 2
    if (python := child_python(args.target, args.python)) is None:
        print(f"aot --target {args.target}: {REFUSAL[args.target]} (in {h.ROOT})", file=sys.stderr)
        return 2
    args.python = python
    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="jattn_aot_")
    rows, header, start = [], {}, time.perf_counter()
    for i, name in enumerate(names):
        new, result = run_variant(name, args, dump_root)
        header, rows = {**result, **header}, rows + new
        write_table(args.out, rows, header, args.target)
        figure = "vmem" if args.target == "tpu" else "spill_stores"
        worst = max((r[figure] for r in new if r[figure] != ""), default="-")
        print(f"[{time.perf_counter() - start:7.1f}s] {i + 1}/{len(names)} {name}: "
              f"{new[0]['status']}, {sum(1 for r in new if r['kernel'])} kernel(s), "
              f"compile {new[0]['compile_s']} s, max {figure} {worst}", flush=True)  # fmt: skip
    if not args.dump_dir:
        shutil.rmtree(dump_root, ignore_errors=True)
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.csv")
    failed = sorted({r["variant"] for r in rows
                     if r["compiled"] != "yes" or str(r["status"]).startswith("FAIL")})  # fmt: skip
    over = over_limit(rows) if args.target == "tpu" else []
    for kernel in over:
        print(f"aot --target tpu: {kernel} is over the default scoped VMEM limit", flush=True)
    if failed:
        print(f"aot: {len(failed)} variant(s) failed: {failed}")
    return 0 if not failed and not over else 1


if __name__ == "__main__":
    sys.exit(main())
