"""GPU benchmark of jattn's Pallas flash kernels, in stages that fit a 15-minute window.

Written for one H200 with jax 0.10 or 0.11. Every cell runs in its own child
process with its own timeout (`benchmarks/_gpu_stages.py` runs them,
`benchmarks/_gpu_cells.py` is what a child does), so a compiler abort or a
hang costs that cell only; its XLA dump and output are kept under
`--dump-dir`. Rows are appended to `--out` (CSV) as each finishes. This
process never imports jax's GPU backend: it would hold GPU memory.

0. probe (~10 s): jax / jaxlib versions, devices, the backend and kernel
   configuration `implementation="pallas"` picks here
   (`jattn.attention.pallas.backend.kernel_report`). Without a GPU the script refuses
   (status 2) before starting anything heavy.
1. smoke (< 1 min): compile and run forward + gradient of the Pallas kernels,
   plain and Shaw, split and fused backward, on a few small shapes.
2. check (< 3 min): outputs and every gradient against the float64 "xla"
   path, split and fused backward, with thresholds for the precision the
   kernels use (float32: IEEE dots, tolerance 1e-4 of the largest reference
   value; bf16: 3e-2). Stops the run on a failure (`--continue-on-fail`).
3. headline (< 5 min): bf16 matmul peak, then L = 8192, causal, bf16, head
   dim 128 (B = 2, 16 heads): cuDNN, Pallas split and fused, Pallas Shaw
   (k = 16); prints pallas/cudnn (goal <= 1.25) and Shaw/plain (<= 1.3).
4. sweep (--budget-s): tile sizes and warps at the headline shape, then
   other lengths, head dim 64, non-causal, chunked and xla.

FLOPs (model FLOPs, recomputation not counted): forward `4·B·N·T·S·H`,
halved when causal; forward+backward 3.5x that; Shaw rows use the plain count.

    python benchmarks/gpu.py --stage smoke check headline sweep --budget-s 150
    python benchmarks/gpu.py --stage smoke --cpu-smoke          # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _gpu_stages import Cell, StageRunner  # noqa: E402

STAGES = ("smoke", "check", "headline", "sweep")
BUDGET_S = {"smoke": 100.0, "check": 360.0, "headline": 300.0}
CPU_SLOWDOWN = 3.0  # --cpu-smoke: the fixed stages' budgets times this
COLUMNS = [
    "stage",
    "cell",
    "impl",
    "mode",
    "L",
    "batch",
    "heads",
    "head_dim",
    "causal",
    "dtype",
    "backward",
    "blocks",
    "warps",
    "ms",
    "tflops",
    "frac_peak",
    "max_rel_err",
    "tol",
    "status",
    "seconds",
    "note",
    "dump",
]
START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# Parent side: which cells make a stage.


def _smoke_cells(cpu: bool) -> list[Cell]:
    if cpu:
        plain, shaw, dtype = (
            [(1, 40, 2, 1, 16, True, False)],
            [(1, 40, 2, 1, 16, False, True)],
            "float32",
        )
    else:
        plain = [(2, 256, 4, 2, 64, True, False), (1, 1000, 4, 4, 128, False, False)]
        shaw, dtype = [(1, 512, 4, 2, 128, True, True)], "bfloat16"
    spec = lambda shapes, backward: dict(
        kind="smoke", shapes=shapes, dtype=dtype, backward=backward
    )  # noqa: E731
    timeout, expect = (120.0, 25.0) if cpu else (90.0, 30.0)
    return [
        Cell("pallas", spec(plain, "split"), timeout, expect),
        Cell("pallas_shaw", spec(shaw, "split"), timeout, expect),
        Cell("fused", spec(plain[:1] + shaw, "fused"), timeout, expect),
    ]


def _check_cells(cpu: bool) -> list[Cell]:
    # (B, T, S, N, K, H, dtype, causal, packed, shaw, window, dropout)
    cases = {
        # What training runs first: float32 at the configs' head dims (the main
        # job's 64 / 4 heads = 16, causal and packed; the Delétang tape model's
        # 64 / 8 = 8, bidirectional, packed, dropout 0.1).
        "f32_h16_packed_causal": (4, 128, 128, 4, 4, 16, "float32", True, True, False, None, 0.0),
        "f32_h8_packed_dropout": (4, 128, 128, 8, 8, 8, "float32", False, True, False, None, 0.1),
        "f32_causal_gqa": (2, 256, 256, 4, 2, 64, "float32", True, False, False, None, 0.0),
        "bf16_h128_ragged": (2, 200, 200, 4, 4, 128, "bfloat16", False, False, False, None, 0.0),
        "bf16_packed_shaw": (2, 256, 256, 4, 2, 64, "bfloat16", True, True, True, None, 0.0),
        "f32_cross_mqa_shaw": (1, 136, 300, 4, 1, 64, "float32", False, False, True, None, 0.0),
        "bf16_window_dropout": (2, 256, 256, 4, 2, 64, "bfloat16", True, True, True, (48, 0), 0.1),
        "f32_window2_dropout": (
            1,
            200,
            200,
            4,
            1,
            64,
            "float32",
            False,
            False,
            False,
            (32, 16),
            0.2,
        ),
    }
    if cpu:
        cases = {
            "f32_packed_shaw": (1, 40, 40, 2, 1, 16, "float32", True, True, True, None, 0.0),
            "f32_window_dropout": (1, 40, 40, 2, 1, 16, "float32", False, False, True, (6, 3), 0.2),
        }
    timeout, expect = (180.0, 40.0) if cpu else (120.0, 25.0)
    cells = [
        Cell(
            name,
            dict(kind="check", name=name, case=case, backwards=["split", "fused"]),
            timeout,
            expect,
        )
        for name, case in cases.items()
    ]
    if not cpu:  # cuDNN through jax.nn, bf16 (its dtypes), for what the rule sends there
        cudnn = {
            "cudnn_bf16_h128_causal": (2, 512, 512, 4, 4, 128, "bfloat16", True),
            "cudnn_bf16_h64_gqa": (2, 256, 256, 4, 2, 64, "bfloat16", False),
        }
        for n, (name, case) in enumerate(cudnn.items()):
            spec = dict(kind="check", name=name, impl="cudnn", backwards=["-"])
            spec["case"] = (*case, False, False, None, 0.0)
            cells.insert(2 + n, Cell(name, spec, timeout, expect))  # after training's two
    # The score mods in the kernels, (B, T, N, K, H, dtype), causal; two cells
    # a shape so that a slow compile (T5 and Sandwich at float32) costs half.
    groups = [["alibi", "t5", "softcap"], ["fire", "sandwich"]]
    shapes = {
        "f32_h128": (1, 256, 4, 2, 128, "float32"),
        "bf16_h64": (2, 200, 4, 2, 64, "bfloat16"),
    }
    if cpu:
        groups, shapes = [["alibi", "t5"]], {"f32": (1, 40, 2, 1, 16, "float32")}
    for name, shape in shapes.items():
        for mods in groups:
            spec = dict(kind="check_mods", shape=shape, mods=mods, backwards=["split", "fused"])
            cells.append(Cell(f"mods_{name}_{mods[0]}", spec, timeout + 30.0, expect))
    return cells


def _time_cell(name, cpu, timeout, expect, **spec) -> Cell:
    base = dict(
        kind="time",
        L=8192,
        head_dim=128,
        causal=True,
        dtype="bfloat16",
        tokens=16384,
        d_model=2048,
        min_time=0.2,
        modes=["fwd+bwd", "fwd"],
    )
    if cpu:
        base.update(L=64, head_dim=32, tokens=64, d_model=64, min_time=0.0, dtype="float32")
        spec = {k: v for k, v in spec.items() if k not in ("L", "head_dim")}
    return Cell(name, dict(base, **spec), timeout, expect)


def _headline_cells(cpu: bool) -> list[Cell]:
    timeout, expect = (120.0, 30.0) if cpu else (150.0, 45.0)
    cells = [Cell("peak", dict(kind="peak", n=256 if cpu else 8192), 60.0, 10.0)]
    impls = [("cudnn", dict(impl="xla_jax" if cpu else "cudnn"))]
    impls += [("pallas", dict(impl="pallas", backward="split"))]
    impls += [("pallas_fused", dict(impl="pallas", backward="fused"))]
    impls += [("pallas_shaw", dict(impl="pallas", backward="split", shaw=True))]
    impls += [("pallas_shaw_fused", dict(impl="pallas", backward="fused", shaw=True))]
    return cells + [_time_cell(name, cpu, timeout, expect, **spec) for name, spec in impls]


def _sweep_cells(cpu: bool) -> list[Cell]:
    timeout, expect = (120.0, 30.0) if cpu else (120.0, 30.0)
    tiles = (
        [(16, 16), (32, 16)]
        if cpu
        else [(64, 64, 8), (128, 128, 8), (64, 128, 4), (128, 32, 4), (128, 64, 4)]
    )
    cells = []
    for tile in tiles:
        bq, bk, *warps = tile
        for backward in ("split", "fused"):
            spec = dict(
                impl="pallas",
                block_q=bq,
                block_k=bk,
                backward=backward,
                warps=warps[0] if warps else None,
            )
            cells.append(
                _time_cell(
                    f"pallas[{bq}x{bk}w{spec['warps']}]{backward}", cpu, timeout, expect, **spec
                )
            )
    # The backward's own tiles, the forward at its default (the first H200
    # run: the backward took 85% of the headline's fwd+bwd at 32x32, 4 warps).
    bwd_tiles = [(16, 16, 2)] if cpu else [
        (64, 64, 4), (64, 64, 8), (128, 32, 4), (128, 32, 8),
        (128, 64, 8), (64, 128, 8), (128, 128, 8),
    ]  # fmt: skip
    for bq, bk, warps in bwd_tiles:
        spec = dict(
            impl="pallas",
            backward="split",
            backward_blocks=[bq, bk],
            backward_warps=warps,
            modes=["fwd+bwd"],
        )
        cells.append(_time_cell(f"bwd[{bq}x{bk}w{warps}]split", cpu, timeout, expect, **spec))
    # Each backward kernel on its own tiles (`flash_attention(backward_tiles=)`):
    # the dq kernel's swept with the dk/dv kernel's fixed at the fastest
    # shared tile of the first H200 run (128x32, 4 warps), then the other way
    # round; (block_q, block_k, warps). The Triton tutorial's and tokamax's
    # pairs are dq 128x32 (queries x keys) and dk/dv 32x128.
    fixed = (16, 16, 2) if cpu else (128, 32, 4)
    dq_tiles = [(32, 16, 2)] if cpu else [
        (64, 64, 4), (128, 64, 8), (128, 128, 8), (64, 32, 4), (128, 32, 8),
    ]  # fmt: skip
    dkv_tiles = [(16, 32, 2)] if cpu else [
        (32, 128, 4), (32, 128, 8), (64, 128, 8), (64, 64, 4), (32, 64, 4),
    ]  # fmt: skip
    for kernel, tiles in (("dq", dq_tiles), ("dkv", dkv_tiles)):
        for bq, bk, warps in tiles:
            mine, other = (
                dict(blocks=[bq, bk], warps=warps),
                dict(blocks=list(fixed[:2]), warps=fixed[2]),
            )
            dq, dkv = (mine, other) if kernel == "dq" else (other, mine)
            spec = dict(
                impl="pallas",
                backward="split",
                dq_blocks=dq["blocks"],
                dq_warps=dq["warps"],
                dkv_blocks=dkv["blocks"],
                dkv_warps=dkv["warps"],
                modes=["fwd+bwd"],
            )
            name = f"{kernel}[{bq}x{bk}w{warps}]split"
            cells.append(_time_cell(name, cpu, timeout, expect, **spec))
    if not cpu:
        for t in (2048, 32768):
            for impl in ("cudnn", "pallas"):
                cells.append(_time_cell(f"{impl}_L{t}", cpu, timeout, expect, impl=impl, L=t))
        cells.append(_time_cell("pallas_H64", cpu, timeout, expect, impl="pallas", head_dim=64))
        cells.append(_time_cell("cudnn_H64", cpu, timeout, expect, impl="cudnn", head_dim=64))
        cells.append(
            _time_cell("pallas_noncausal", cpu, timeout, expect, impl="pallas", causal=False)
        )
        cells.append(
            _time_cell("cudnn_noncausal", cpu, timeout, expect, impl="cudnn", causal=False)
        )
        cells.append(_time_cell("chunked", cpu, timeout, expect, impl="chunked", modes=["fwd"]))
        cells.append(_time_cell("xla_L2048", cpu, timeout, expect, impl="xla_jax", L=2048))
    return cells


BUILDERS = {
    "smoke": _smoke_cells,
    "check": _check_cells,
    "headline": _headline_cells,
    "sweep": _sweep_cells,
}


def gpu_unavailable(cpu_smoke: bool) -> str | None:
    """Why there is no GPU to run on, from the environment alone (the parent
    never initialises jax: it would take GPU memory from the children)."""
    if cpu_smoke:
        return None
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return f"JAX_PLATFORMS={platforms!r} excludes the GPU"
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return "no NVIDIA driver here (/dev/nvidiactl and nvidia-smi are missing)"
    return None


def ratios(rows: list[dict]) -> list[str]:
    """The headline goals: pallas / cudnn time <= 1.25, Shaw / plain <= 1.3."""
    ms = {
        (r["cell"], r.get("mode")): float(r["ms"])
        for r in rows
        if r.get("ms") and r.get("stage") == "headline"
    }
    lines = []
    pairs = [("pallas", "cudnn", 1.25), ("pallas_fused", "cudnn", 1.25)]
    pairs += [("pallas_shaw", "pallas", 1.3), ("pallas_shaw_fused", "pallas_fused", 1.3)]
    for num, den, goal in pairs:
        for mode in ("fwd+bwd", "fwd"):
            if (num, mode) in ms and (den, mode) in ms:
                r = ms[(num, mode)] / ms[(den, mode)]
                lines.append(f"headline {mode}: {num}/{den} time = {r:.2f} (goal <= {goal})")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stage",
        nargs="+",
        default=list(STAGES),
        choices=(*STAGES, "all"),
        help="stages to run, in order (default: all)",
    )
    ap.add_argument(
        "--out",
        default=os.path.join("runs", "bench", "bench_gpu.csv"),
        help="CSV of rows (appended)",
    )
    ap.add_argument(
        "--dump-dir", default=None, help="per-cell XLA dumps and logs (default: beside --out)"
    )
    ap.add_argument("--budget-s", type=float, default=150.0, help="time for the sweep stage")
    ap.add_argument(
        "--total-s",
        type=float,
        default=None,
        help="hard limit for the whole run: each stage's budget is cut to what is left",
    )
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on the CPU, interpret mode"
    )
    ap.add_argument(
        "--continue-on-fail", action="store_true", help="time even after a smoke/check failure"
    )
    ap.add_argument("--keep-dumps", action="store_true", help="keep the dumps of passing cells too")
    ap.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="STAGE/CELL=abort|hang",
        help="simulate a compiler abort or hang in one cell (checks the isolation)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="STAGE/CELL",
        help="run only the cells matching these globs (e.g. 'sweep/bwd*')",
    )
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cell:
        import _gpu_cells

        return _gpu_cells.cell_main(json.loads(args.cell), args.rows)
    reason = gpu_unavailable(args.cpu_smoke)
    if reason:
        print(
            f"bench_gpu: error: no GPU: {reason}. Use --cpu-smoke for the CPU check.",
            file=sys.stderr,
        )
        return 2
    stages = list(STAGES) if "all" in args.stage else args.stage
    inject = dict(x.split("=", 1) for x in args.inject)
    dump_dir = args.dump_dir or os.path.join(
        os.path.dirname(os.path.abspath(args.out)), "bench_gpu_dumps"
    )
    env = {"JAX_PLATFORMS": "cpu"} if args.cpu_smoke else {}
    runner = StageRunner(os.path.abspath(__file__), args.out, COLUMNS, dump_dir, env=env, log=log)
    (probe,) = runner.run("probe", Cell("backend", dict(kind="probe"), 120.0))[:1]
    log(f"backend: {probe.get('note', '')}")
    platform = probe.get("share", {}).get("platform")
    if not str(probe["status"]).startswith("ok") or (not args.cpu_smoke and platform != "gpu"):
        print(
            f"bench_gpu: error: no usable GPU backend (jax platform {platform!r}): "
            f"{probe['status']}",
            file=sys.stderr,
        )
        return 2
    ok = True
    for stage in stages:
        cells = BUILDERS[stage](args.cpu_smoke)
        cells = [
            Cell(
                c.name,
                dict(c.spec, inject=inject.get(f"{stage}/{c.name}")),
                c.timeout_s,
                c.expect_s,
            )
            for c in cells
        ]
        if args.only:
            cells = [
                c for c in cells if any(fnmatch.fnmatch(f"{stage}/{c.name}", g) for g in args.only)
            ]
        budget = BUDGET_S.get(stage, args.budget_s)
        if args.cpu_smoke and stage in BUDGET_S:
            budget *= CPU_SLOWDOWN  # interpret mode on a shared CPU: same cells, more time
        if args.total_s is not None:
            budget = min(budget, args.total_s - (time.perf_counter() - START))
        stage_ok = runner.run_stage(stage, cells, budget)
        ok &= stage_ok
        if stage == "headline":
            for line in ratios(runner.rows):
                log(line)
        if not stage_ok and stage in ("smoke", "check") and not args.continue_on_fail:
            log(f"stopping after the failed {stage} stage (--continue-on-fail times anyway)")
            break
    log(f"rows in {args.out}; {'all passed' if ok else 'SOME CELLS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
