"""The GPU window's benchmarks: jattn's Pallas flash kernels in stages, and a training stage.

Written for one H200 in a 15-minute window: docs/gpu.md ("The benchmark in
stages") says what each stage holds and why. Every cell runs in a child process
with its own timeout (`StageRunner`; `_gpu_cells.py` is what a child does), so a
compiler abort or a hang costs that cell only; rows go to `--out` as each
finishes. This process never imports jax: it would hold GPU memory. FLOPs are
model FLOPs: forward `4·B·N·T·S·H`, halved when causal, forward+backward 3.5x.
Stages: probe, smoke, check (the float64 gate), headline, sweep (while `--budget-s`
lasts). `--train`: `jattn train` children on the Delétang tape model (`CONFIG`),
the default rule against xla, each with its wait for input; data from scripts/gpu_kit.sh.

    python benchmarks/gpu.py --stage smoke check headline sweep --budget-s 150
    python benchmarks/gpu.py --stage smoke --cpu-smoke          # CPU, interpret mode
    python benchmarks/gpu.py --train --out OUT/train.csv --total-s 150 [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

STAGES = ("smoke", "check", "headline", "sweep")
BUDGET_S = {"smoke": 100.0, "check": 600.0, "headline": 330.0}  # check: 23 cells, 575 s
CPU_SLOWDOWN = 3.0  # --cpu-smoke: the fixed stages' budgets times this
COLUMNS = ["stage", "cell", "impl", "mode", "L", "batch", "heads", "head_dim", "causal", "dtype",
           "backward", "blocks", "warps", "ms", "tflops", "frac_peak", "max_rel_err", "tol",
           "status", "seconds", "note", "dump"]  # fmt: skip
CONFIG = "configs/chomsky.py:reverse_string,test100"
# What scripts/gpu_kit.sh prepares for this stage.
DATASETS = ("reverse_string/test100",)
ARMS = (("default", None), ("xla", "xla"))
TRAIN_COLUMNS = ("arm", "status", "steps", "batch_size", "final_loss", "losses", "steps_per_s",
           "input_wait_ms", "wall_s", "device", "note")  # fmt: skip
START = time.perf_counter()
PASSED = ("ok", "PASS", "skip")  # how a row's status starts when it did not fail
log = lambda msg: print(f"[{time.perf_counter() - START:6.1f}s] {msg}", flush=True)


# The stage runner: cells in child processes, each with its own timeout. No jax here.
@dataclass(frozen=True)
class Cell:
    """One unit of work in its own process: its JSON `spec`, wall-clock limit, and
    `expect_s`, what it should take (a stage starts it only while that fits)."""

    name: str
    spec: dict = field(hash=False)
    timeout_s: float
    expect_s: float = 10.0


class StageRunner:
    """Runs cells of `script` (its `--cell` mode) one after another, appending rows to
    `csv_path`, each cell's XLA dump and output under `dump_dir` (kept when it fails,
    or with `keep_dumps`). A row's `share` reaches later cells as `spec["shared"]`."""

    def __init__(self, script, csv_path, columns, dumps, *, env=None, keep_dumps=False, log=print):
        self.script, self.csv_path, self.columns, self.dump_dir = script, csv_path, columns, dumps
        self.env, self.keep_dumps, self.log = dict(env or {}), keep_dumps, log
        self.rows, self.shared = [], {}
        os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
        os.makedirs(dumps, exist_ok=True)

    def _write(self, row: dict) -> None:
        new = not os.path.exists(self.csv_path) or os.path.getsize(self.csv_path) == 0
        with open(self.csv_path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({c: row.get(c, "") for c in self.columns})
        self.rows.append(row)

    def run(self, stage: str, cell: Cell, timeout_s: float | None = None) -> list[dict]:
        """Runs one cell (for at most `timeout_s`) as `script --cell JSON --rows FILE`, the
        child appending a row as each measurement finishes; its rows (a failure row
        where the child died)."""
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in cell.name)
        cell_dir = os.path.join(self.dump_dir, f"{stage}-{safe}")
        shutil.rmtree(cell_dir, ignore_errors=True)
        os.makedirs(cell_dir)
        rows_path, env = os.path.join(cell_dir, "rows.jsonl"), dict(os.environ, **self.env)
        dump = f"--xla_dump_to={cell_dir} --xla_dump_hlo_as_text"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {dump}".strip()
        spec, log = json.dumps(dict(cell.spec, shared=self.shared)), f"{cell_dir}/output.txt"
        cmd = [sys.executable, self.script, "--cell", spec, "--rows", rows_path]
        timeout_s = cell.timeout_s if timeout_s is None else timeout_s
        child = h.run_child(cmd, log, timeout_s=timeout_s, env=env)
        rows = []
        if os.path.exists(rows_path):
            with open(rows_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        if child.status != "ok":
            tail = child.output[-300:].strip().replace("\n", " | ")
            rows.append(dict(status=f"FAIL {child.status}", note=tail))
        failed = any(not str(r.get("status", "ok")).startswith(PASSED) for r in rows)
        kept = self.keep_dumps or failed
        seconds = f"{child.seconds:.1f}"
        rows = [dict(stage=stage, cell=cell.name, status="ok", seconds=seconds) | r for r in rows]
        for r in rows:
            self.shared.update(r.get("share") or {})
            self._write(r | {"dump": cell_dir} if kept else r)
        if kept:
            self.log(f"{stage}/{cell.name}: kept {cell_dir} (XLA dump, output.txt)")
        else:
            shutil.rmtree(cell_dir, ignore_errors=True)
        return self.rows[len(self.rows) - len(rows) :]

    def run_stage(self, stage: str, cells: list[Cell], budget_s: float) -> bool:
        """Runs `cells` in order while each fits `budget_s` (by its `expect_s`; the rest
        a "skip: stage budget" row), timeouts cut to what is left; whether all passed."""
        t0, ok = time.perf_counter(), True
        for cell in cells:
            used = time.perf_counter() - t0
            if used + cell.expect_s > budget_s:
                self._write(dict(stage=stage, cell=cell.name, status="skip: stage budget"))
                self.log(f"{stage}/{cell.name}: skipped (stage budget {budget_s:.0f} s)")
                continue
            for r in self.run(stage, cell, min(cell.timeout_s, budget_s - used)):
                shown = [f"{k}={v}" for k, v in r.items() if v not in ("", None)]
                self.log(f"{stage}/{cell.name}: " + " ".join(
                    x for x in shown if x.split("=")[0] not in ("stage", "cell", "share")
                ))  # fmt: skip
                ok &= str(r["status"]).startswith(PASSED)
        self.log(f"stage {stage}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
        return ok


# Which cells make a stage.
def _smoke_cells(cpu: bool) -> list[Cell]:
    # (B, T, N, K, H, causal, shaw)
    plain, shaw = [(1, 40, 2, 1, 16, True, False)], [(1, 40, 2, 1, 16, False, True)]
    if not cpu:
        plain = [(2, 256, 4, 2, 64, True, False), (1, 1000, 4, 4, 128, False, False)]
        shaw = [(1, 512, 4, 2, 128, True, True)]
    dtype, times = ("float32", (120.0, 25.0)) if cpu else ("bfloat16", (90.0, 30.0))
    cells = dict(pallas=(plain, "split"), pallas_shaw=(shaw, "split"))
    cells["fused"] = (plain[:1] + shaw, "fused")
    return [Cell(name, dict(kind="smoke", shapes=shapes, dtype=dtype, backward=backward), *times)
            for name, (shapes, backward) in cells.items()]  # fmt: skip


def _check_cells(cpu: bool) -> list[Cell]:
    # (B, T, S, N, K, H, dtype, causal, packed, shaw, window, dropout). First what training
    # runs: float32 at the configs' head dims (the main job's 64 / 4 heads = 16, causal
    # and packed; the Delétang tape model's 64 / 8 = 8, bidirectional, packed, dropout 0.1).
    f32, bf16 = "float32", "bfloat16"
    cases = {
        "f32_h16_packed_causal": (4, 128, 128, 4, 4, 16, f32, True, True, False, None, 0.0),
        "f32_h8_packed_dropout": (4, 128, 128, 8, 8, 8, f32, False, True, False, None, 0.1),
        "f32_causal_gqa": (2, 256, 256, 4, 2, 64, f32, True, False, False, None, 0.0),
        "bf16_h128_ragged": (2, 200, 200, 4, 4, 128, bf16, False, False, False, None, 0.0),
        "bf16_packed_shaw": (2, 256, 256, 4, 2, 64, bf16, True, True, True, None, 0.0),
        "f32_cross_mqa_shaw": (1, 136, 300, 4, 1, 64, f32, False, False, True, None, 0.0),
        "bf16_window_dropout": (2, 256, 256, 4, 2, 64, bf16, True, True, True, (48, 0), 0.1),
        "f32_window2_dropout": (1, 200, 200, 4, 1, 64, f32, False, False, False, (32, 16), 0.2),
    }
    # The score mods in the kernels, (B, T, N, K, H, dtype), causal; a few cells a
    # shape, so that a slow compile (T5 and Sandwich at float32) costs a part. At default
    # positions a distance mod (ALiBi, T5, Sandwich, KERPLE, Shaw's bias) runs from
    # distance tiles; packed (training's shape, "_packed") it runs per logit in the tiles.
    groups = [["alibi", "t5", "softcap"], ["fire", "sandwich"], ["kerple", "shaw_bias"]]
    shapes = {"f32_h16_packed": (4, 128, 4, 4, 16, f32), "f32_h128": (1, 256, 4, 2, 128, f32),
              "bf16_h64": (2, 200, 4, 2, 64, bf16)}  # fmt: skip
    if cpu:
        cases = {
            "f32_packed_shaw": (1, 40, 40, 2, 1, 16, f32, True, True, True, None, 0.0),
            "f32_window_dropout": (1, 40, 40, 2, 1, 16, f32, False, False, True, (6, 3), 0.2),
        }
        groups = [["alibi", "t5"]]
        shapes = {"f32_packed": (1, 40, 2, 1, 16, f32), "f32": (1, 40, 2, 1, 16, f32)}
    timeout, expect = (180.0, 40.0) if cpu else (120.0, 25.0)
    # Both backwards everywhere, the atomic one (dq by atomic adds) too where GQA, Shaw,
    # packing, windows and dropout meet.
    both, atomic = ["split", "fused"], ("gqa", "packed_shaw", "window_dropout")
    cells = [Cell(name, dict(kind="check", name=name, case=case, backwards=both + ["atomic"]
                             * name.endswith(atomic)), timeout, expect)
             for name, case in cases.items()]  # fmt: skip
    # After training's two cells: cuDNN through jax.nn, bf16 (its dtypes; on the CPU
    # jax.nn's xla path in its place, for the cells' inputs and references), then the
    # Mosaic GPU kernels (plain bf16; lengths multiples of 128): nothing trusts them
    # before this passes. On the CPU, or a GPU that is no sm_90, a skip row.
    plain = {
        "cudnn_bf16_h128_causal": ("cudnn", (2, 512, 512, 4, 4, 128, bf16, True)),
        "cudnn_bf16_h64_gqa": ("cudnn", (2, 256, 256, 4, 2, 64, bf16, False)),
        # What else the rule sends to cuDNN (`rule._CUDNN_FEATURES`): a left window and
        # lengths; a mask and a bias.
        "cudnn_bf16_h64_window_lengths": ("cudnn", (2, 256, 256, 4, 2, 64, bf16, True)),
        "cudnn_bf16_h128_mask_bias": ("cudnn", (2, 256, 256, 4, 4, 128, bf16, False)),
        "mgpu_bf16_h128_causal_gqa": ("mosaic_gpu", (2, 512, 512, 4, 2, 128, bf16, True)),
        "mgpu_bf16_h64": ("mosaic_gpu", (1, 256, 384, 4, 4, 64, bf16, False)),
    }
    plain = [(n, "xla_jax" if cpu and i == "cudnn" else i, c) for n, (i, c) in plain.items()]
    for i, (name, impl, case) in enumerate(plain):
        spec = dict(kind="check", name=name, impl=impl, backwards=["-"])
        spec["case"] = (*case, False, False, (64, 0) if "window" in name else None, 0.0)
        spec["inputs"] = [f for f in ("lengths", "mask", "bias") if f in name]
        cells.insert(2 + i, Cell(name, spec, timeout, expect))
    # The score mods' cells; training's packed shape's right after cuDNN's and Mosaic's.
    mods = [Cell(f"mods_{name}_{m[0]}", dict(kind="check_mods", shape=shape, mods=m,
                 backwards=both, packed="packed" in name), timeout + 30.0, expect)
            for name, shape in shapes.items() for m in groups]  # fmt: skip
    cells[2 + len(plain) : 2 + len(plain)] = [c for c in mods if c.spec["packed"]]
    return cells + [c for c in mods if not c.spec["packed"]]


def _time_cell(name, cpu, timeout, expect, **spec) -> Cell:
    base = dict(kind="time", L=8192, head_dim=128, causal=True, dtype="bfloat16", tokens=16384,
                d_model=2048, min_time=0.2, modes=["fwd+bwd", "fwd"])  # fmt: skip
    if cpu:
        base.update(L=64, head_dim=32, tokens=64, d_model=64, min_time=0.0, dtype="float32")
        spec = {k: v for k, v in spec.items() if k not in ("L", "head_dim")}
    return Cell(name, dict(base, **spec), timeout, expect)


def _headline_cells(cpu: bool) -> list[Cell]:
    timeout, expect = (120.0, 30.0) if cpu else (150.0, 45.0)
    impls = {"cudnn": dict(impl="xla_jax" if cpu else "cudnn")}
    for shaw in (False, True):
        impls[f"pallas{'_shaw' * shaw}"] = dict(impl="pallas", backward="split", shaw=shaw)
        impls[f"pallas{'_shaw' * shaw}_fused"] = dict(impl="pallas", backward="fused", shaw=shaw)
    impls |= {f"pallas_{m}": dict(impl="pallas", backward="split", mod=m) for m in ("alibi", "t5")}
    cells = [Cell("peak", dict(kind="peak", n=256 if cpu else 8192), 60.0, 10.0)]
    return cells + [_time_cell(name, cpu, timeout, expect, **s) for name, s in impls.items()]


def _sweep_cells(cpu: bool) -> list[Cell]:
    time_cell = lambda name, **spec: _time_cell(name, cpu, 120.0, 30.0, **spec)
    cells = []
    # (block_q, block_k, warps) of every kernel, then of the backward's two (the
    # forward at its default: the first H200 run's backward took 85% of the
    # headline's fwd+bwd at 32x32, 4 warps).
    tiles = [(16, 16, None), (32, 16, None)] if cpu else [
        (64, 64, 8), (128, 128, 8), (64, 128, 4), (128, 32, 4), (128, 64, 4)]  # fmt: skip
    for bq, bk, warps in tiles:
        for backward in ("split", "fused"):
            spec = dict(impl="pallas", block_q=bq, block_k=bk, backward=backward, num_warps=warps)
            cells.append(time_cell(f"pallas[{bq}x{bk}w{warps}]{backward}", **spec))
    bwd_tiles = [(16, 16, 2)] if cpu else [(64, 64, 4), (64, 64, 8), (128, 32, 4), (128, 32, 8),
                                           (128, 64, 8), (64, 128, 8), (128, 128, 8)]  # fmt: skip
    for bq, bk, warps in bwd_tiles:
        spec = dict(impl="pallas", backward="split", modes=["fwd+bwd"])
        spec.update(backward_blocks=[bq, bk], backward_warps=warps)
        cells.append(time_cell(f"bwd[{bq}x{bk}w{warps}]split", **spec))
    # sweep/mgpu*, after the Triton backward's tiles (issue 50): the Mosaic GPU kernels at
    # the headline shape, causal and not, with cuDNN and the Triton kernels beside them.
    for mask, impl in itertools.product(("causal", "noncausal"), ("mosaic_gpu", "cudnn", "pallas")):
        name = "mgpu_" + mask if impl == "mosaic_gpu" else f"mgpu_{impl}_{mask}"
        impl = "xla_jax" if cpu and impl == "cudnn" else impl
        cells.append(time_cell(name, impl=impl, causal=mask == "causal"))
    # Each backward kernel on its own tiles (`flash_attention(backward_tiles=)`): the
    # dq kernel's swept with the dk/dv kernel's fixed at the fastest shared tile of the
    # first H200 run (128x32, 4 warps), then the other way round. The Triton
    # tutorial's and tokamax's pairs are dq 128x32 (queries x keys) and dk/dv 32x128.
    # After each dk/dv tiling, atomic[...]: that kernel alone, adding dq by atomic adds.
    fixed = (16, 16, 2) if cpu else (128, 32, 4)
    sweeps = {"dq": [(32, 16, 2)], "dkv": [(16, 32, 2)]} if cpu else {
        "dq": [(64, 64, 4), (128, 64, 8), (128, 128, 8), (64, 32, 4), (128, 32, 8)],
        "dkv": [(32, 128, 4), (32, 128, 8), (64, 128, 8), (64, 64, 4), (32, 64, 4)]}  # fmt: skip
    for kernel, tiles in sweeps.items():
        other = "dkv" if kernel == "dq" else "dq"
        for bq, bk, warps in tiles:
            spec = dict(impl="pallas", backward="split", modes=["fwd+bwd"])
            spec |= {f"{kernel}_blocks": [bq, bk], f"{kernel}_warps": warps}
            spec |= {f"{other}_blocks": list(fixed[:2]), f"{other}_warps": fixed[2]}
            cells.append(time_cell(f"{kernel}[{bq}x{bk}w{warps}]split", **spec))
            if kernel == "dkv":
                spec = dict(impl="pallas", backward="atomic", modes=["fwd+bwd"])
                spec.update(backward_blocks=[bq, bk], backward_warps=warps)
                cells.append(time_cell(f"atomic[{bq}x{bk}w{warps}]", **spec))
    if not cpu:
        for t in (2048, 32768):
            cells += [time_cell(f"{impl}_L{t}", impl=impl, L=t) for impl in ("cudnn", "pallas")]
        for name, spec in (("H64", dict(head_dim=64)), ("noncausal", dict(causal=False))):
            cells += [time_cell(f"{i}_{name}", impl=i, **spec) for i in ("pallas", "cudnn")]
        cells.append(time_cell("chunked", impl="chunked", modes=["fwd"]))
        cells.append(time_cell("xla_L2048", impl="xla_jax", L=2048))
    return cells


BUILDERS = dict(
    smoke=_smoke_cells, check=_check_cells, headline=_headline_cells, sweep=_sweep_cells
)


# The training stage (--train): `jattn train` children, default path against xla.
def run_arm(name, impl, args, tmp, timeout_s) -> dict:
    """One `jattn train` child; its row: status, the logged losses, the last
    interval's steps/s and wait for input (metrics.jsonl), and its `devices:` line."""
    workdir, steps = os.path.join(tmp, name), args.steps  # six logs, one eval batch
    cmd = [sys.executable, "-m", "jattn.cli", "train", "--config", CONFIG, "--workdir", workdir,
           "--compilation-cache-dir", ""]  # fmt: skip
    settings = dict(data_dir=args.data_dir, num_train_steps=steps, batch_size=args.batch_size)
    settings.update(log_every_steps=max(1, steps // 6), eval_every_steps=steps)
    settings.update(checkpoint_every_steps=steps, eval_max_batches=1, eval_decode_examples=0)
    settings["model.architecture"] = "encoder_only"
    settings |= {"model.attention_impl": impl} if impl else {}
    cmd += [f"--config.{k}={v}" for k, v in settings.items()]
    print(f"[train] {name}: {' '.join(cmd[1:])} (timeout {timeout_s:.0f} s)", flush=True)
    done = h.run_child(cmd, workdir + ".log", timeout_s=timeout_s, env=h.child_env(), cwd=h.ROOT)
    # The tail of the child's output goes to the window's log (progress bars dropped).
    lines = [ln.strip() for ln in done.output.replace("\r", "\n").splitlines()]
    lines = [ln for ln in lines if ln and "%|" not in ln]
    print("\n".join(f"[train {name}] {ln}" for ln in lines[-25:]), flush=True)
    device = next((ln[len("devices:") :] for ln in lines if ln.startswith("devices:")), "")
    note = "" if done.status == "ok" else "".join(lines[-1:])[:200]
    row = dict(arm=name, status=done.status, batch_size=args.batch_size, note=note,
               wall_s=f"{done.seconds:.1f}", device=device.split(";")[0].strip())  # fmt: skip
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        train = [r for r in map(json.loads, filter(str.strip, f)) if "train/loss" in r]
    if train:
        last, losses = train[-1], " ".join(f"{r['step']}:{r['train/loss']:.4f}" for r in train)
        got = lambda key, spec: format(last.get(f"train/{key}", float("nan")), spec)
        row.update(steps=last["step"], final_loss=got("loss", ".5f"), losses=losses)
        row.update(
            steps_per_s=got("steps_per_sec", ".3f"), input_wait_ms=got("input_wait_ms", ".2f")
        )
    return row


def train(args) -> int:
    """`--train`: the window's training stage (the module docstring); the CSV's rows."""
    smoke, args.data_dir = args.cpu_smoke, os.path.abspath(args.data_dir)
    args.steps, args.batch_size = args.steps or (300, 4)[smoke], args.batch_size or (128, 16)[smoke]
    if not os.path.isdir(args.data_dir):
        print(f"gpu.py --train: no prepared data in {args.data_dir} (scripts/gpu_kit.sh)")
        return 2
    deadline, rows = time.monotonic() + (args.total_s or 150.0), []
    with tempfile.TemporaryDirectory(prefix="jattn_gpu_train_") as tmp:
        for i, (name, impl) in enumerate(ARMS):
            share = (deadline - time.monotonic()) / (len(ARMS) - i)
            if share < 10:
                rows.append({"arm": name, "status": "skipped", "note": "no time left"})
                continue
            rows.append(run_arm(name, impl, args, tmp, share))
    h.write_csv(args.out, rows, TRAIN_COLUMNS)
    for row in rows:
        print(f"[train] {row}", flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def gpu_unavailable(cpu_smoke: bool) -> str | None:
    """Why there is no GPU to run on, from the environment alone (the parent never
    initialises jax: it would take GPU memory from the children)."""
    if cpu_smoke:
        return None
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return f"JAX_PLATFORMS={platforms!r} excludes the GPU"
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return "no NVIDIA driver here (/dev/nvidiactl and nvidia-smi are missing)"
    return None


def ratios(rows: list[dict]) -> list[str]:
    """The headline goals (issue 50): pallas / cudnn time <= 1.6; Shaw, ALiBi, T5 / plain <= 1.3."""
    ms = {(r["cell"], r.get("mode")): float(r["ms"]) for r in rows
          if r.get("ms") and r.get("stage") == "headline"}  # fmt: skip
    pairs = [("pallas", "cudnn", 1.6), ("pallas_fused", "cudnn", 1.6)]
    pairs += [("pallas_shaw", "pallas", 1.3), ("pallas_shaw_fused", "pallas_fused", 1.3)]
    pairs += [(f"pallas_{m}", "pallas", 1.3) for m in ("alibi", "t5")]
    pairs = [(a, b, goal, m) for a, b, goal in pairs for m in ("fwd+bwd", "fwd")]
    return [f"headline {m}: {a}/{b} time = {ms[a, m] / ms[b, m]:.2f} (goal <= {goal})"
            for a, b, goal, m in pairs if (a, m) in ms and (b, m) in ms]  # fmt: skip


def main(argv=None) -> int:
    p = h.parser(__doc__, out="bench_gpu.csv")
    add = p.add_argument
    add("--stage", nargs="+", default=list(STAGES), choices=(*STAGES, "all"), help="in order")
    add("--dump-dir", help="per-cell XLA dumps and logs (default: beside --out)")
    add("--budget-s", type=float, default=150.0, help="time for the sweep stage")
    add("--total-s", type=float, help="limit of the whole run (--train: default 150 s)")
    add("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, interpret mode")
    add("--continue-on-fail", action="store_true", help="time even after a failed smoke/check")
    add("--keep-dumps", action="store_true", help="keep the dumps of passing cells too")
    inject = "STAGE/CELL=abort|hang"
    add("--inject", action="append", default=[], metavar=inject, help="simulate a failed cell")
    add("--only", nargs="+", metavar="STAGE/CELL", help="cells matching globs ('sweep/bwd*')")
    add("--train", action="store_true", help="the training stage instead (its own CSV)")
    add("--data-dir", default=str(h.ROOT / ".gpukit" / "data"), help="--train: prepared data")
    add("--steps", type=int, help="--train: steps (default 300; 4 with --cpu-smoke)")
    add("--batch-size", type=int, help="--train: rows (default 128; 16 with --cpu-smoke)")
    add("--cell", help=argparse.SUPPRESS)
    add("--rows", help=argparse.SUPPRESS)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)  # no jattn (no jax) import here
    if args.cell:  # a child: `inject` simulates a compiler abort or hang, `noop` the tests'
        spec = json.loads(args.cell)
        if inject := spec.get("inject"):
            dict(abort=os.abort, hang=lambda: time.sleep(3600))[inject]()
        if spec["kind"] == "noop":
            seen = dict(xla_flags=os.environ.get("XLA_FLAGS"), shared=spec.get("shared"))
            with open(args.rows, "a") as f:
                f.write(json.dumps(dict(status="ok", note="noop " + json.dumps(seen))) + "\n")
            return 0
        import _gpu_cells  # noqa: PLC0415  (jax: in the child only)

        _gpu_cells.CELL_KINDS[spec["kind"]](spec, args.rows)
        return 0
    if args.train:
        return train(args)
    if reason := gpu_unavailable(args.cpu_smoke):
        print(f"bench_gpu: error: no GPU: {reason}. Use --cpu-smoke for the CPU check.",
              file=sys.stderr)  # fmt: skip
        return 2
    stages = list(STAGES) if "all" in args.stage else args.stage
    built = {s: {f"{s}/{c.name}": c for c in BUILDERS[s](args.cpu_smoke)} for s in stages}
    known = [name for cells in built.values() for name in cells]
    if bad := [g for g in args.only or () if not fnmatch.filter(known, g)]:
        print(f"bench_gpu: error: --only {bad}: no cell of {stages}", file=sys.stderr)
        return 2
    inject = dict(x.split("=", 1) for x in args.inject)
    dump_dir = args.dump_dir or f"{os.path.dirname(os.path.abspath(args.out))}/bench_gpu_dumps"
    env = {"JAX_PLATFORMS": "cpu"} if args.cpu_smoke else {}
    runner = StageRunner(os.path.abspath(__file__), args.out, COLUMNS, dump_dir, env=env, log=log)
    (probe,) = runner.run("probe", Cell("backend", dict(kind="probe"), 120.0))[:1]
    log(f"backend: {probe.get('note', '')}")
    platform = probe.get("share", {}).get("platform")
    if not str(probe["status"]).startswith("ok") or (not args.cpu_smoke and platform != "gpu"):
        print(f"bench_gpu: error: no usable GPU backend (jax platform {platform!r}): "
              f"{probe['status']}", file=sys.stderr)  # fmt: skip
        return 2
    ok = True
    for stage in stages:
        cells = [dataclasses.replace(c, spec=c.spec | {"inject": inject.get(name)})
                 for name, c in built[stage].items()
                 if any(fnmatch.fnmatch(name, g) for g in args.only or "*")]  # fmt: skip
        budget = BUDGET_S.get(stage, args.budget_s)
        if args.cpu_smoke and stage in BUDGET_S:
            budget *= CPU_SLOWDOWN  # interpret mode on a shared CPU: same cells, more time
        if args.total_s is not None:
            budget = min(budget, args.total_s - (time.perf_counter() - START))
        stage_ok = runner.run_stage(stage, cells, budget)
        ok &= stage_ok
        for line in ratios(runner.rows) if stage == "headline" else []:
            log(line)
        if not stage_ok and stage in ("smoke", "check") and not args.continue_on_fail:
            log(f"stopping after the failed {stage} stage (--continue-on-fail times anyway)")
            break
    log(f"rows in {args.out}; {'all passed' if ok else 'SOME CELLS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
