"""`jattn bench aot --target tpu`: the Mosaic (TPU) kernels compiled by libtpu
for compile-only TPU v5e and v6e devices, with no TPU.

The same grid as the CUDA target (benchmarks/aot.py): plain, segments,
window, dropout, Shaw and each built-in score mod; bfloat16 and float32;
head dims 64 and 128; one `jax.jit` of the forward and its vjp (T = S = 200,
causal, GQA 4/2, B = 1), for each chip. The backward is "split" only: the
Mosaic family has no fused backward (`flash_attention._kernels`). Each
variant compiles in its own child process with its own timeout.

How, on a CPU-only host:
- `jax.experimental.topologies.get_topology_desc(topology_name="v5e:2x2",
  platform="tpu")` gives compile-only TPU devices when libtpu is installed
  (`pip install -e ".[aot-tpu]"` in a venv of its own, .venv-tpu; a 1x1
  topology is refused, 2x2 works). `TPU_SKIP_MDS_QUERY` and placeholder
  `TPU_ACCELERATOR_TYPE` / `TPU_WORKER_HOSTNAMES` keep libtpu from asking a
  metadata server for a TPU VM that is not there.
- `jax.jit(f).trace(...).lower().compile()` then runs XLA's TPU compiler and
  Mosaic's, kernel by kernel (`tpu_custom_call`s).

What each kernel row reports, all read from libtpu's own output:
- `scoped_vmem`: the kernel's scoped VMEM (its scratch and Mosaic's
  internal scratch), `used_scoped_memory_configs` of its custom call in the
  compiled module;
- `block_vmem`: its pipelined blocks, two buffers each, in the tiled layouts
  Mosaic chose (`--xla_mosaic_dump_to`, the memref types after layout
  inference: a `[bq, 1]` float32 column takes `bq x 128` lanes);
- `vmem`: their sum, against the default scoped VMEM limit (16 MiB on v5e,
  32 MiB on v6e); `grid`: the kernel's iteration bounds;
- per variant: the module's custom-call targets and its HBM peak
  (`memory_analysis`).
Timing needs a TPU: nothing here runs a kernel.

    python benchmarks/aot.py --target tpu                    # every variant, both chips
    python benchmarks/aot.py --target tpu --ci               # CI's subset (v5e)
    python benchmarks/aot.py --target tpu --variants 'shaw-*-v6e' --keep-dumps
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import importlib.util
import itertools
import json
import math
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
sys.path.insert(0, HERE)

import aot  # noqa: E402  (benchmarks/aot.py: the variants, their function and inputs)

# Chip -> (topology name, a placeholder accelerator type for libtpu).
CHIPS = {"v5e": ("v5e:2x2", "v5litepod-4"), "v6e": ("v6e:2x2", "v6e-4")}
BACKWARDS = ("split",)  # the Mosaic family's only backward
SCOPED_VMEM_LIMIT = {"v5e": 16 << 20, "v6e": 32 << 20}  # XLA's default scoped VMEM limit
CI_SUBSET = tuple(
    f"{f}-bfloat16-h128-split-v5e" for f in ("plain", "shaw", "alibi")
)  # `--ci`: what scripts/test.sh compiles on every run
COLUMNS = [
    "variant",
    "chip",
    "kernel",
    "compiled",
    "grid",
    "scoped_vmem",
    "block_vmem",
    "vmem",
    "custom_call",
    "hbm_peak",
    "compile_s",
    "status",
]
KERNEL_ORDER = ("_fwd", "_dq", "_dkv")  # rows of a variant: forward, then backward
ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "ui32": 4, "i16": 2, "i8": 1, "i1": 1}


def variants() -> list[str]:
    """Every TPU variant name, `feature-dtype-hH-split-chip`."""
    grid = itertools.product(aot.FEATURES, aot.DTYPES, aot.HEAD_DIMS, BACKWARDS, CHIPS)
    return [f"{f}-{d}-h{h}-{b}-{c}" for f, d, h, b, c in grid]


def parse_variant(name: str) -> dict:
    parts = name.split("-")
    if len(parts) != 5 or parts[3] not in BACKWARDS or parts[4] not in CHIPS:
        raise ValueError(f"aot --target tpu: unknown variant {name!r}; see --list")
    spec = aot.parse_variant("-".join(parts[:4]))
    return dict(spec, chip=parts[4])


def libtpu_env(chip: str) -> dict[str, str]:
    """What libtpu needs to serve a compile-only topology on a host that is no TPU VM."""
    return dict(
        TPU_SKIP_MDS_QUERY="1",
        TPU_ACCELERATOR_TYPE=CHIPS[chip][1],
        TPU_WORKER_HOSTNAMES="localhost",
        JAX_PLATFORMS="cpu",
    )


# --------------------------------------------------------------------------------------
# Reading what libtpu wrote.

_CALL = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_OP_NAME = re.compile(r'op_name="[^"]*?(?P<kernel>jattn_\w+?)\)*/pallas_call')
_SCOPED = re.compile(r'"used_scoped_memory_configs":\[(?P<configs>[^\]]*)\]')
_SIZE = re.compile(r'"size":"(\d+)"')


def parse_custom_calls(hlo: str) -> tuple[dict[str, dict], list[str]]:
    """`({kernel: {custom_call, scoped_vmem}}, every custom-call target)` of
    a compiled module's text (`compiled.as_text()`)."""
    kernels, targets = {}, []
    for line in hlo.splitlines():
        call = _CALL.search(line)
        if not call:
            continue
        targets.append(call["target"])
        name = _OP_NAME.search(line)
        if name:
            scoped = _SCOPED.search(line)
            size = sum(int(x) for x in _SIZE.findall(scoped["configs"])) if scoped else None
            kernels[name["kernel"]] = dict(custom_call=call["target"], scoped_vmem=size)
    return kernels, sorted(set(targets))


_FUNC = re.compile(r"func\.func @(?P<name>\w+)\((?P<args>.*?)\) attributes \{(?P<attrs>.*)$", re.M)
_MEMREF = re.compile(
    r"memref<(?P<dims>(?:\d+x)*)(?P<dtype>\w+), #tpu\.tiled<\((?P<tile>[\d,]+)\)[^>]*>, "
    r"#tpu\.memory_space<(?P<space>\w+)>>"
)


def memref_bytes(dims: list[int], dtype: str, tile: list[int]) -> int:
    """Bytes of a memref in a tiled layout: its last dims padded to the tile."""
    lead, last = dims[: len(dims) - len(tile)], dims[len(dims) - len(tile) :]
    padded = [math.ceil(d / t) * t for d, t in zip(last, tile, strict=True)]
    return math.prod(lead) * math.prod(padded) * ITEMSIZE[dtype]


def parse_mosaic_kernel(text: str) -> dict | None:
    """`{name, grid, block_vmem, scratch_vmem}` of the kernel in one Mosaic
    dump after memref layout inference: the windows (pipelined blocks, two
    buffers each) and the scratch operands (the last `scratch_operands`
    VMEM memrefs), in bytes."""
    func = _FUNC.search(text)
    if not func:
        return None
    vmem = [
        memref_bytes(
            [int(d) for d in m["dims"].split("x") if d],
            m["dtype"],
            [int(t) for t in m["tile"].split(",")],
        )
        for m in _MEMREF.finditer(func["args"])
        if m["space"] == "vmem"
    ]
    scratch = re.search(r"scratch_operands = (\d+)", func["attrs"])
    n_scratch = int(scratch[1]) if scratch else 0
    bounds = re.search(r"iteration_bounds = array<i64: ([\d, ]+)>", func["attrs"])
    windows = vmem[: len(vmem) - n_scratch]
    return dict(
        name=func["name"],
        grid="x".join(bounds[1].replace(" ", "").split(",")) if bounds else "",
        block_vmem=2 * sum(windows),
        scratch_vmem=sum(vmem[len(vmem) - n_scratch :]),
    )


def mosaic_kernels(dump: str) -> dict[str, dict]:
    """`parse_mosaic_kernel` of every kernel Mosaic compiled into `dump`."""
    out = {}
    if os.path.isdir(dump):
        for f in sorted(os.listdir(dump)):
            if f.endswith("-post-infer-memref-layout.txt"):
                with open(os.path.join(dump, f)) as fh:
                    k = parse_mosaic_kernel(fh.read())
                if k:
                    out[k["name"]] = k
    return out


def kernel_rows(name: str, status: str, result: dict, mosaic: dict[str, dict], wall: float):
    """One row per kernel (or one for the variant when none compiled)."""
    chip = name.rsplit("-", 1)[1]
    calls = result.get("kernels", {})
    rows = []
    order = lambda k: (next((i for i, w in enumerate(KERNEL_ORDER) if w in k), 9), k)  # noqa: E731
    for kernel in sorted(set(calls) | set(mosaic), key=order):
        call, mo = calls.get(kernel, {}), mosaic.get(kernel, {})
        scoped, block = call.get("scoped_vmem"), mo.get("block_vmem")
        total = scoped + block if scoped is not None and block is not None else ""
        rows.append(
            dict(
                variant=name,
                chip=chip,
                kernel=kernel,
                compiled="yes" if status == "ok" else "no",
                grid=mo.get("grid", ""),
                scoped_vmem="" if scoped is None else scoped,
                block_vmem="" if block is None else block,
                vmem=total,
                custom_call=call.get("custom_call", ""),
                hbm_peak=result.get("hbm_peak", ""),
                compile_s=result.get("compile_s", round(wall, 1)),
                status=status,
            )
        )
    if not rows:
        rows.append(dict.fromkeys(COLUMNS, ""))
        rows[-1].update(variant=name, chip=chip, compiled="no", compile_s=round(wall, 1))
        rows[-1]["status"] = status
    return rows


def over_limit(rows: list[dict]) -> list[str]:
    """Kernels whose VMEM exceeds their chip's default scoped VMEM limit."""
    return [
        f"{r['variant']} {r['kernel']}"
        for r in rows
        if r["vmem"] != "" and r["vmem"] > SCOPED_VMEM_LIMIT[r["chip"]]
    ]


# --------------------------------------------------------------------------------------
# The child: compile one variant for one chip.


def child_main(name: str, tiles: dict | None = None) -> int:
    import importlib.metadata

    import jax
    import jaxlib
    from jax.experimental import topologies

    spec = parse_variant(name)
    topology = topologies.get_topology_desc(topology_name=CHIPS[spec["chip"]][0], platform="tpu")
    device = topology.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    fn = jax.jit(aot._variant_fn(spec["feature"], spec["backward"], tiles=tiles, backend="tpu"))
    start = time.perf_counter()
    try:
        lowered = fn.trace(*aot.variant_inputs(spec, sds)).lower()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
    except Exception as e:  # one line for the table; the traceback stays in the log
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"AOT_ERROR {type(e).__name__}: {first}"[:400], flush=True)
        raise
    done = time.perf_counter()
    kernels, targets = parse_custom_calls(compiled.as_text())
    memory = compiled.memory_analysis()
    result = dict(
        device=device.device_kind,
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        libtpu=importlib.metadata.version("libtpu"),
        tiles=", ".join(f"{k} {v}" for k, v in (tiles or {}).items()) or "default",
        lower_s=round(lowered_at - start, 2),
        compile_s=round(done - lowered_at, 2),
        kernels=kernels,
        custom_calls=targets,
        hbm_peak=getattr(memory, "peak_memory_in_bytes", ""),
    )
    print("AOT_RESULT " + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------
# The parent.


def run_variant(name: str, args, dump_root: str) -> tuple[list[dict], dict]:
    dump = os.path.join(dump_root, name)
    mosaic_dump = os.path.join(dump, "mosaic")
    os.makedirs(mosaic_dump, exist_ok=True)
    env = dict(os.environ)
    env.update(libtpu_env(parse_variant(name)["chip"]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["LIBTPU_INIT_ARGS"] = " ".join(
        filter(None, [env.get("LIBTPU_INIT_ARGS"), f"--xla_mosaic_dump_to={mosaic_dump}"])
    )
    cmd = [args.python, os.path.abspath(__file__), "--child", name]
    for flag, value in _tiles(args).items():
        cmd += [f"--{flag.replace('_', '-')}", str(value)]
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timeout after {args.timeout_s:.0f} s"
    wall = time.perf_counter() - start
    with open(log_path, errors="replace") as f:
        log = f.read()
    result, error = {}, ""
    for line in log.splitlines():
        if line.startswith("AOT_RESULT "):
            result = json.loads(line[len("AOT_RESULT ") :])
        elif line.startswith("AOT_ERROR "):
            error = line[len("AOT_ERROR ") :]
    result["wall_s"] = round(wall, 1)
    if status.startswith("exit"):
        lines = [ln for ln in log.splitlines() if ln.strip() and ln[:1] not in "IW "]
        status += ": " + (error or (lines[-1][:200] if lines else "no output"))
    rows = kernel_rows(name, status, result, mosaic_kernels(mosaic_dump), wall)
    if status == "ok" and not args.keep_dumps:
        shutil.rmtree(dump, ignore_errors=True)
    return rows, result


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _tiles(args) -> dict:
    return {n: getattr(args, n) for n in ("block_q", "block_k") if getattr(args, n) is not None}


def write_table(path: str, rows: list[dict], header: dict) -> None:
    """The markdown table at `path` and the same rows as CSV beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(os.path.splitext(path)[0] + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    s = aot.SHAPE
    lines = [
        f"AOT compile for TPU v5e and v6e (compile-only), jax {header.get('jax', '?')}, "
        f"jaxlib {header.get('jaxlib', '?')}, libtpu {header.get('libtpu', '?')}; "
        f"T = {s['t']}, causal, GQA {s['n']}/{s['kh']}, Shaw k = {aot.SHAW_K}; "
        f"tiles {header.get('tiles', '?')}; module custom calls "
        f"{', '.join(header.get('custom_calls', [])) or '?'}. Bytes: scoped_vmem "
        "(libtpu), block_vmem (pipelined blocks, two buffers each), vmem (their sum), "
        "hbm_peak (the whole module).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def has_libtpu() -> bool:
    """Whether libtpu is installed here (looked up, not imported)."""
    return importlib.util.find_spec("libtpu") is not None


VENV_PYTHON = os.path.join(ROOT, ".venv-tpu", "bin", "python")


def child_python(given: str | None) -> str | None:
    """The interpreter of the children: `--python`, else this one if it has
    libtpu, else the checkout's .venv-tpu (so `jattn bench aot --target tpu`
    also works from the main venv, whose jattn CLI needs the training
    extras that .venv-tpu lacks); None if there is none."""
    if given:
        return given
    if has_libtpu():
        return sys.executable
    return VENV_PYTHON if os.access(VENV_PYTHON, os.X_OK) else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="aot.py --target tpu", description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="*", default=["*"], help="names or globs (--list)")
    parser.add_argument("--ci", action="store_true", help=f"CI's subset: {', '.join(CI_SUBSET)}")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per variant")
    parser.add_argument("--out", default=os.path.join("runs", "bench", "aot_tpu.md"))
    parser.add_argument("--dump-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--keep-dumps", action="store_true")
    for flag in ("--block-q", "--block-k"):
        parser.add_argument(flag, type=int, default=None, help="override the default (all kernels)")
    parser.add_argument(
        "--python", default=None, help="the children's interpreter (default: see child_python)"
    )
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, _tiles(args))
    patterns = list(CI_SUBSET) if args.ci else args.variants
    names = [v for v in variants() if any(fnmatch.fnmatch(v, p) for p in patterns)]
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print(f"aot --target tpu: no variant matches {patterns}; see --list", file=sys.stderr)
        return 2
    args.python = child_python(args.python)
    if args.python is None:
        print(
            "aot --target tpu: needs libtpu for the compile-only TPUs: "
            f'python3 -m venv .venv-tpu && .venv-tpu/bin/pip install -e ".[aot-tpu]" (in {ROOT})',
            file=sys.stderr,
        )
        return 2
    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="jattn_aot_tpu_")
    rows, header = [], {}
    start = time.perf_counter()
    for i, name in enumerate(names):
        new, result = run_variant(name, args, dump_root)
        header = {**result, **header} if header else result
        rows += new
        write_table(args.out, rows, header)
        vmem = max((r["vmem"] for r in new if r["vmem"] != ""), default="-")
        print(
            f"[{time.perf_counter() - start:7.1f}s] {i + 1}/{len(names)} {name}: "
            f"{new[0]['status']}, {sum(1 for r in new if r['kernel'])} kernel(s), "
            f"compile {new[0]['compile_s']} s, max vmem {vmem} B",
            flush=True,
        )
    if not args.dump_dir:
        shutil.rmtree(dump_root, ignore_errors=True)
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.csv")
    failed = [r["variant"] for r in rows if r["compiled"] != "yes"]
    for kernel in over_limit(rows):
        print(f"aot --target tpu: {kernel} is over the default scoped VMEM limit", flush=True)
    if failed:
        print(f"aot --target tpu: {len(set(failed))} variant(s) failed: {sorted(set(failed))}")
    return 0 if not failed and not over_limit(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
