"""Compile every Pallas kernel variant for an H100 (sm_90a) ahead of time, with no GPU.

What ptxas says of each Triton kernel (registers, spill stores and loads,
stack) and what its launch asks for (shared memory), per variant: plain,
segments (packed rows), window, dropout, Shaw key/value tables, and the
score mods of `jattn.positions` applied in the kernels (ALiBi: a slope per
head; T5: a per-head bucket table read by a compare-and-select chain;
softcap: tanh; FIRE: a 32-unit MLP per logit); bfloat16 and float32; head
dims 64 and 128; split (dq + dk/dv kernels) and fused backward. One variant
is one `jax.jit` of the forward and its vjp, the vjp including the Shaw
tables' and the score mod's parameters (T = S = 200, causal, GQA 4 query
heads over 2 kv heads, B = 1), compiled in its own child process
with its own timeout: a compiler abort or a 200 s float32 compile costs that
variant only and becomes a row (`timeout after N s`, `crash: SIGABRT`).

How, on a CPU-only host:
- `jax.experimental.topologies.get_topology_desc(platform="cuda",
  target_config=H100_TARGET_CONFIG, topology="1x1x1")` gives a compile-only
  H100 (the CUDA plugin must be installed: `pip install -e ".[aot]"` in its
  own venv, jax[cuda12] 0.10.2 with ptxas 12.9); inputs are
  `ShapeDtypeStruct`s sharded to it and `jax.jit(f).trace(...).lower()
  .compile()` runs XLA's GPU compiler, Triton to PTX, and `ptxas
  -arch=sm_90a -v`.
- `JAX_PLATFORMS=cpu`: the plugin then skips its driver check (there is no
  driver) and still serves the topology; `TF_CPP_VMODULE=
  subprocess_compilation=3` logs ptxas's `-v` output, parsed here;
  `--xla_dump_to` writes the thunk sequence (each launch's shared memory)
  and the PTX (whose `mma` instructions say whether the dots use tensor
  cores), read here and deleted unless `--keep-dumps`.
- The H100's `GpuTargetConfigProto` (text format) is written below from the
  H100 SXM5 80GB's published properties (jaxlib 0.10.2 ships no such file;
  XLA reads these fields when no device is attached). `--target-config FILE`
  takes another one.

    python benchmarks/aot.py                                  # every variant
    python benchmarks/aot.py --variants '*-bfloat16-*' --timeout-s 120
    python benchmarks/aot.py --variants 't5-bfloat16-*' --block-q 16 --block-k 32
    python benchmarks/aot.py --variants 'plain-bfloat16-h128-split' \
        --dq-blocks 64 32 --dkv-blocks 32 64 --dq-warps 4 --dkv-warps 4
    python benchmarks/aot.py --list
    python benchmarks/aot.py --target tpu                     # the Mosaic kernels
                                                              # (benchmarks/_tpu_aot.py)
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# NVIDIA H100 SXM5 80GB (compute capability 9.0): CUDA C Programming Guide,
# "Technical Specifications per Compute Capability", and the H100 datasheet.
H100_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152          # 48 KiB without opt-in
  shared_memory_per_core: 233472          # 228 KiB per SM
  shared_memory_per_block_optin: 232448   # 227 KiB per block with opt-in
  threads_per_core_limit: 2048
  core_count: 132                         # SMs of the SXM5 part
  fpus_per_core: 128                      # FP32 lanes per SM
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000         # 3.35 TB/s HBM3
  l2_cache_size: 52428800                 # 50 MiB
  clock_rate_ghz: 1.98                    # boost clock
  device_memory_size: 84942979072         # 80 GB
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# Features that are a `score_mod` (alibi and sandwich: distance-table mods,
# whose per-logit form the kernels run).
SCORE_MODS = ("alibi", "t5", "softcap", "fire", "sandwich")
FEATURES = ("plain", "segments", "window", "dropout", "shaw", *SCORE_MODS)
DTYPES = ("bfloat16", "float32")
HEAD_DIMS = (64, 128)
BACKWARDS = ("split", "fused")
SHAPE = dict(b=1, t=200, n=4, kh=2)  # as the CUDA lowering tests
SHAW_K = 16
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128  # T5's defaults; unidirectional (causal)
FIRE_HIDDEN = 32  # init_fire_params' default
SOFTCAP = 50.0  # Gemma 2's attention cap
MODULE = "jattn_aot_variant"  # the jitted function's name: its HLO module is jit_<name>
COLUMNS = [
    "variant",
    "kernel",
    "compiled",
    "registers",
    "spill_stores",
    "spill_loads",
    "stack",
    "shared_memory",
    "mma",
    "compile_s",
    "status",
]


def variants() -> list[str]:
    """Every variant name, `feature-dtype-hH-backward`."""
    grid = itertools.product(FEATURES, DTYPES, HEAD_DIMS, BACKWARDS)
    return [f"{f}-{d}-h{h}-{b}" for f, d, h, b in grid]


def parse_variant(name: str) -> dict:
    feature, dtype, head, backward = name.split("-")
    if feature not in FEATURES or dtype not in DTYPES or backward not in BACKWARDS:
        raise ValueError(f"aot: unknown variant {name!r}; see --list")
    return dict(feature=feature, dtype=dtype, head_dim=int(head[1:]), backward=backward)


# --------------------------------------------------------------------------------------
# The child: compile one variant.


def score_mod_of(feature: str, num_heads: int):
    """The `jattn.ScoreMod` of a score-mod feature, with concrete float32
    parameters (the child replaces them by sharded `ShapeDtypeStruct`s of the
    same shapes; `fn` is what gets compiled)."""
    import jax
    import jax.numpy as jnp

    from jattn import positions

    if feature == "alibi":
        return positions.alibi_score_mod(positions.alibi_slopes(num_heads), mode="causal")
    if feature == "t5":
        table = jnp.zeros((num_heads, T5_BUCKETS), jnp.float32)  # [N, buckets]
        return positions.t5_score_mod(table, max_distance=T5_MAX_DISTANCE, bidirectional=False)
    if feature == "softcap":
        return positions.softcap_score_mod(SOFTCAP)
    if feature == "sandwich":
        return positions.sandwich_score_mod(num_heads)
    if feature == "fire":
        return positions.fire_score_mod(
            positions.init_fire_params(jax.random.key(0), num_heads, FIRE_HIDDEN)
        )
    raise ValueError(f"aot: {feature!r} is not a score-mod feature; one of {SCORE_MODS}")


def _variant_fn(
    feature: str,
    backward: str,
    precision: str | None = None,
    interpret: bool = False,
    tiles: dict | None = None,
    backend: str | None = None,
):
    """`f(q, k, v, ct, extra) -> (out, grads)` of one variant: the forward and
    its vjp through `flash_attention(..., interpret=False)` (the Triton
    kernels, as on a GPU; `backend="tpu"`: the Mosaic kernels, as on a TPU,
    `benchmarks/_tpu_aot.py`) at the kernels' float32 `precision` (None: their
    default, "tf32x3"; "ieee" the IEEE FMAs). The vjp is taken with respect
    to q, k, v and the `extra` entries named `rel_*` (Shaw tables) and `mod`
    (the score mod's params); `interpret=True` runs the same function in
    interpret mode (the tests). `tiles`: `block_q`, `block_k`, `num_warps` overriding
    the kernels' defaults (forward and backward alike), `backward_blocks`,
    `backward_warps` (both backward kernels) and `dq_blocks`, `dkv_blocks`,
    `dq_warps`, `dkv_warps` (each backward kernel alone), to try other
    tiles (the flags of the same names, `flash_kwargs`)."""
    import dataclasses

    import jax

    import jattn
    from jattn.attention.pallas import flash_attention as fa

    def forward(q, k, v, extra):
        kw = dict(is_causal=True)
        if feature == "segments":
            kw.update(extra)
        elif feature == "window":
            kw["local_window_size"] = (64, 0)
        elif feature == "dropout":
            kw.update(dropout_rate=0.1, dropout_rng=extra["dropout_rng"])
        elif feature == "shaw":
            kw["relative"] = jattn.ShawRelative(
                key=extra["rel_key"], value=extra["rel_value"], max_distance=SHAW_K
            )
        elif feature in SCORE_MODS:
            mod = score_mod_of(feature, q.shape[2])
            kw["score_mod"] = dataclasses.replace(mod, params=extra["mod"])
        vis, rest = jattn.masks.split_keywords(kw)
        drop = jattn.dropout.Dropout(rest.pop("dropout_rate", 0.0), rest.pop("dropout_rng", None))
        nf = jattn.normalise(q, k, v, visibility=vis, dropout=drop, **rest)
        mode = dict(backend=backend) if backend else dict(interpret=interpret)
        return fa.flash_attention(
            nf, backward=backward, precision=precision, **mode, **flash_kwargs(tiles)
        )[0]

    def differentiable(name):
        return name.startswith("rel_") or name == "mod"

    def jattn_aot_variant(q, k, v, ct, extra):
        diff = {n: x for n, x in extra.items() if differentiable(n)}
        fixed = {n: x for n, x in extra.items() if not differentiable(n)}
        out, vjp = jax.vjp(lambda q, k, v, d: forward(q, k, v, {**fixed, **d}), q, k, v, diff)
        return out, vjp(ct)

    return jattn_aot_variant


PER_KERNEL = ("dq_blocks", "dkv_blocks", "dq_warps", "dkv_warps")


def flash_kwargs(tiles: dict | None) -> dict:
    """`flash_attention`'s keyword arguments of the tile overrides `tiles`
    (`_tiles`): the per-kernel ones in one `BackwardTiles`."""
    from jattn.attention.pallas.config import BackwardTiles

    tiles = dict(tiles or {})
    per_kernel = {n: tiles.pop(n) for n in PER_KERNEL if n in tiles}
    for name in ("backward_blocks", *PER_KERNEL[:2]):
        for source in (tiles, per_kernel):
            if source.get(name) is not None:
                source[name] = tuple(source[name])
    if per_kernel:
        tiles["backward_tiles"] = BackwardTiles(**per_kernel)
    return tiles


def variant_inputs(spec: dict, sds) -> tuple:
    """`(q, k, v, ct, extra)` of a variant as `sds(shape, dtype)` (sharded
    `ShapeDtypeStruct`s on the compile-only device): `q`, `ct` `[B, T, N, H]`,
    `k`, `v` `[B, T, K, H]`, and the feature's extra inputs."""
    import jax
    import jax.numpy as jnp

    b, t, n, kh, h = SHAPE["b"], SHAPE["t"], SHAPE["n"], SHAPE["kh"], spec["head_dim"]
    dtype = jnp.dtype(spec["dtype"])
    q, ct = sds((b, t, n, h), dtype), sds((b, t, n, h), dtype)
    k = v = sds((b, t, kh, h), dtype)
    extra = {}
    if spec["feature"] == "segments":
        for key in ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions"):
            extra[key] = sds((b, t), jnp.int32)
    elif spec["feature"] == "dropout":
        extra["dropout_rng"] = sds((2,), jnp.uint32)
    elif spec["feature"] == "shaw":
        extra["rel_key"] = sds((2 * SHAW_K + 1, h), jnp.float32)
        extra["rel_value"] = sds((2 * SHAW_K + 1, h), jnp.float32)
    elif spec["feature"] in SCORE_MODS:
        params = score_mod_of(spec["feature"], n).params
        extra["mod"] = jax.tree.map(lambda x: sds(jnp.shape(x), jnp.result_type(x)), params)
    return q, k, v, ct, extra


def child_main(
    name: str, target_config: str, precision: str | None = None, tiles: dict | None = None
) -> int:
    import jax
    import jaxlib
    from jax.experimental import topologies

    spec = parse_variant(name)
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target_config, topology="1x1x1"
    )
    device = topology.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    fn = jax.jit(_variant_fn(spec["feature"], spec["backward"], precision, tiles=tiles))
    inputs = variant_inputs(spec, sds)
    start = time.perf_counter()
    jax.eval_shape(fn, *inputs)  # fills the kernels' static block maps outside the mesh
    from jattn.attention.pallas.backend import cuda_target

    with cuda_target(device.device_kind):
        lowered = fn.trace(*inputs).lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    result = dict(
        precision=precision or "tf32x3 (default)",
        tiles=", ".join(f"{k} {_flag_value(v)}" for k, v in (tiles or {}).items()) or "default",
        device=device.device_kind,
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        lower_s=round(lowered_at - start, 2),
        compile_s=round(done - lowered_at, 2),
    )
    print("AOT_RESULT " + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------
# Reading what the compiler said.

_PTXAS_BLOCK = re.compile(
    r"Compiling entry function '(?P<name>\w+)' for '(?P<arch>sm_\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
    r"(?P<loads>\d+) bytes spill loads.*?Used (?P<registers>\d+) registers",
    re.S,
)
_PTXAS_VERSION = re.compile(r"ptxas with version (\S+)")
_LAUNCH = re.compile(r"\] (?P<name>\w+) grid: .*?shared_memory: (?P<bytes>\d+) bytes")
_MMA = re.compile(r"^\s*(?:@%p\d+\s+)?(?:wgmma\.mma_async|mma\.sync)", re.M)


def parse_ptxas(log: str) -> dict[str, dict]:
    """ptxas `-v` figures of each jattn kernel in a compile log (XLA logs
    each ptxas run's output as one message, so a block is contiguous)."""
    kernels = {}
    for chunk in re.split(r"\n(?=[IWEF]\d{4} )", log):
        for m in _PTXAS_BLOCK.finditer(chunk):
            if m["name"].startswith("jattn_"):
                kernels[m["name"]] = dict(
                    arch=m["arch"],
                    registers=int(m["registers"]),
                    spill_stores=int(m["stores"]),
                    spill_loads=int(m["loads"]),
                    stack=int(m["stack"]),
                )
    return kernels


def ptxas_version(log: str) -> str:
    m = _PTXAS_VERSION.search(log)
    return m[1] if m else "?"


def parse_launches(thunks: str) -> dict[str, int]:
    """Shared memory (bytes) of each jattn kernel launch in a thunk sequence dump."""
    return {m["name"]: int(m["bytes"]) for m in _LAUNCH.finditer(thunks) if m["name"]}


def count_mma(ptx_files: list[str]) -> dict[str, int]:
    """Tensor-core instructions (`mma.sync`, `wgmma.mma_async`) in the PTX of
    each jattn kernel: 0 means the dots run as FMAs."""
    counts = {}
    for path in ptx_files:
        with open(path) as f:
            text = f.read()
        entries = list(re.finditer(r"\.entry (\w+)\(", text))
        for m, after in zip(entries, [*entries[1:], None][: len(entries)], strict=True):
            if m[1].startswith("jattn_"):
                body = text[m.start() : after.start() if after else len(text)]
                counts[m[1]] = len(_MMA.findall(body))
    return counts


def _dump_files(dump: str, suffix: str) -> list[str]:
    if not os.path.isdir(dump):
        return []
    return [os.path.join(dump, f) for f in sorted(os.listdir(dump)) if f.endswith(suffix)]


# --------------------------------------------------------------------------------------
# The parent: run the children, write the table.


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def run_variant(name: str, args, dump_root: str) -> tuple[list[dict], dict]:
    """Compile one variant in a child process: its kernel rows and the child's result."""
    dump = os.path.join(dump_root, name)
    os.makedirs(dump, exist_ok=True)
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="0",
        TF_CPP_VMODULE="subprocess_compilation=3",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
        XLA_FLAGS=" ".join(
            filter(
                None,
                [
                    env.get("XLA_FLAGS"),
                    f"--xla_dump_to={dump}",
                    f"--xla_dump_hlo_module_re=.*{MODULE}.*",
                ],
            )
        ),
    )
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
    cmd += ["--target-config", args.target_config] if args.target_config else []
    cmd += ["--precision", args.precision] if args.precision else []
    cmd += tile_flags(_tiles(args))
    start = time.perf_counter()
    log_path = os.path.join(dump, "compile.log")
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=args.timeout_s)
            status = "ok" if rc == 0 else (f"crash: {_signal_name(rc)}" if rc < 0 else f"exit {rc}")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its ptxas processes
            proc.wait()
            status = f"timeout after {args.timeout_s:.0f} s"
    wall = time.perf_counter() - start
    with open(log_path, errors="replace") as f:
        log = f.read()
    result = {}
    for line in log.splitlines():
        if line.startswith("AOT_RESULT "):
            result = json.loads(line[len("AOT_RESULT ") :])
    result.update(ptxas=ptxas_version(log), wall_s=round(wall, 1))
    if status.startswith("exit"):
        lines = [ln for ln in log.splitlines() if ln.strip() and ln[:1] not in "IW "]
        status += ": " + (lines[-1][:160] if lines else "no output")
    kernels = parse_ptxas(log)
    launches = {}
    for path in _dump_files(dump, "thunk_sequence.txt"):
        with open(path) as f:
            launches.update(parse_launches(f.read()))
    mma = count_mma(_dump_files(dump, ".ptx"))
    rows = []
    for kernel in sorted(set(kernels) | {k for k in launches if k.startswith("jattn_")}):
        ptx = kernels.get(kernel, {})
        rows.append(
            dict(
                variant=name,
                kernel=kernel,
                compiled="yes" if status == "ok" else "no",
                registers=ptx.get("registers", ""),
                spill_stores=ptx.get("spill_stores", ""),
                spill_loads=ptx.get("spill_loads", ""),
                stack=ptx.get("stack", ""),
                shared_memory=launches.get(kernel, ""),
                mma=mma.get(kernel, ""),
                compile_s=result.get("compile_s", round(wall, 1)),
                status=status,
            )
        )
    if not rows:  # nothing reached ptxas: one row for the variant
        rows.append(dict.fromkeys(COLUMNS, ""))
        rows[-1].update(variant=name, compiled="no", compile_s=round(wall, 1), status=status)
    if status == "ok" and not args.keep_dumps:
        shutil.rmtree(dump, ignore_errors=True)
    return rows, result


def write_table(path: str, rows: list[dict], header: dict) -> None:
    """The markdown table at `path` and the same rows as CSV beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(os.path.splitext(path)[0] + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"AOT compile for {header.get('device', '?')} (sm_90a), jax {header.get('jax', '?')}, "
        f"jaxlib {header.get('jaxlib', '?')}, ptxas {header.get('ptxas', '?')}; "
        f"T = {SHAPE['t']}, causal, GQA {SHAPE['n']}/{SHAPE['kh']}, Shaw k = {SHAW_K}; "
        f"float32 dots {header.get('precision', '?')}; tiles {header.get('tiles', '?')}. "
        "Bytes for spills, stack and shared memory; mma: tensor-core instructions in the PTX.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def has_cuda_plugin() -> bool:
    """Whether jax's CUDA plugin (CUDA 12 or 13) is installed (looked up, not imported)."""
    try:
        return any(
            importlib.util.find_spec(f"jax_plugins.xla_cuda{major}") is not None
            for major in (12, 13)
        )
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


TILE_FLAGS = ("block_q", "block_k", "num_warps", "backward_blocks", "backward_warps", *PER_KERNEL)
PAIR_FLAGS = ("backward_blocks", "dq_blocks", "dkv_blocks")  # two numbers: block_q block_k


def _tiles(args) -> dict:
    """The tile overrides given on the command line (see `flash_kwargs`)."""
    return {n: getattr(args, n) for n in TILE_FLAGS if getattr(args, n) is not None}


def tile_flags(tiles: dict) -> list[str]:
    """The command-line flags of the tile overrides `tiles` (for the child)."""
    flags = []
    for name, value in tiles.items():
        flags += [f"--{name.replace('_', '-')}", *_flag_value(value).split()]
    return flags


def _flag_value(value) -> str:
    """A tile flag's value as the command line writes it (`16 32` for a pair)."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


TARGETS = ("cuda", "tpu")


def split_target(argv) -> tuple[str, list[str]]:
    """`--target` and the other arguments (those of the target's own parser)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--target", choices=TARGETS, default="cuda")
    known, rest = pre.parse_known_args(argv)
    return known.target, rest


def main(argv=None) -> int:
    target, argv = split_target(argv)
    if target == "tpu":  # the Mosaic kernels for TPU v5e / v6e: their own options
        sys.path.insert(0, HERE)
        import _tpu_aot

        return _tpu_aot.main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--target",
        choices=TARGETS,
        default="cuda",
        help="cuda: an H100, sm_90a (these options); tpu: TPU v5e and v6e "
        "(benchmarks/_tpu_aot.py; see --target tpu --help)",
    )
    parser.add_argument("--variants", nargs="*", default=["*"], help="names or globs (--list)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per variant")
    parser.add_argument("--out", default=os.path.join("runs", "bench", "aot.md"))
    parser.add_argument("--dump-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--keep-dumps", action="store_true")
    parser.add_argument("--target-config", default=None, help="GpuTargetConfigProto text file")
    parser.add_argument(
        "--precision",
        default=None,
        choices=["tf32x3", "ieee"],
        help="the kernels' float32 precision (default: theirs, tf32x3)",
    )
    for flag in ("--block-q", "--block-k", "--num-warps"):
        parser.add_argument(flag, type=int, default=None, help="override the default (all kernels)")
    for flag in ("--backward-blocks", "--dq-blocks", "--dkv-blocks"):
        parser.add_argument(
            flag, type=int, nargs=2, default=None, metavar=("BLOCK_Q", "BLOCK_K"),
            help="the backward's tiles (both kernels, the dq kernel's, the dk/dv kernel's)",
        )  # fmt: skip
    for flag in ("--backward-warps", "--dq-warps", "--dkv-warps"):
        parser.add_argument(flag, type=int, default=None, help="the backward kernels' warps")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        config = H100_TARGET_CONFIG
        if args.target_config:
            with open(args.target_config) as f:
                config = f.read()
        return child_main(args.child, config, args.precision, _tiles(args))
    names = [v for v in variants() if any(fnmatch.fnmatch(v, p) for p in args.variants)]
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print(f"aot: no variant matches {args.variants}; see --list", file=sys.stderr)
        return 2
    if not has_cuda_plugin():
        print(
            "aot: needs jax's CUDA plugin for the compile-only H100 (ptxas included): "
            'pip install -e ".[aot]" in a venv of its own',
            file=sys.stderr,
        )
        return 2
    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="jattn_aot_")
    rows, header = [], {}
    start = time.perf_counter()
    for i, name in enumerate(names):
        new, result = run_variant(name, args, dump_root)
        header = {**result, **header} if header else result
        rows += new
        write_table(args.out, rows, header)
        worst = max((r["spill_stores"] or 0 for r in new if r["spill_stores"] != ""), default="-")
        elapsed = time.perf_counter() - start
        print(
            f"[{elapsed:7.1f}s] {i + 1}/{len(names)} {name}: {new[0]['status']}, "
            f"{sum(1 for r in new if r['kernel'])} "
            f"kernel(s), compile {new[0]['compile_s']} s, max spill stores {worst}",
            flush=True,
        )
    if not args.dump_dir:
        shutil.rmtree(dump_root, ignore_errors=True)
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.csv")
    return 0 if all(r["compiled"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
