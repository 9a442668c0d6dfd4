"""Benchmark: jattn's attention implementations against jax.nn.dot_product_attention.

Measures, in one run on the same inputs, forward and forward+backward wall time
and XLA's compiled temporary memory (`lower(...).compile().memory_analysis()`)
for

- `jax.nn.dot_product_attention` (the peer; implementation="xla" on CPU),
- jattn "xla" and "chunked" (and "pallas" with --pallas; interpret mode on CPU
  is a correctness tool, far too slow to time meaningfully),
- Shaw relative attention (k=16, key and value tables) through jattn, against
  the straightforward formulation that gathers the `[T, S, H]` tables as
  tensor2tensor does.

Memory is read from the compiled executable before anything runs, so a
configuration that would need more than --max-gib is reported and skipped
instead of exhausting the machine. Prints the table last and writes it as CSV.

`--window W` is the sliding-window mode: causal attention with
`local_window_size=(W, 0)`, forward+backward by default, at L=8192 and 16384
unless --lengths is given, for jattn "chunked" (with and without the window)
and `jax.nn.dot_product_attention(local_window_size=...)` where it fits in
--max-gib. The chunked path visits only the tiles inside the window, so its
time grows as O(L·W); the table ends with time(L2) / time(L1) per
implementation (about 2 for doubling L at O(L·W), 4 at O(L²)). Every cell
is compiled first and the timed calls go round-robin over the cells (each
after an untimed call of the same cell), so a change in load on a shared
machine hits all cells alike.

`--gpu` is the GPU mode: everything after it goes to `benchmarks/gpu.py`
(stages smoke, check, headline, sweep, each cell in its own process; see
docs/gpu.md). Without a GPU it refuses at once (from the environment,
before anything compiles, and without initialising jax's GPU backend on a
GPU machine), except with `--cpu-smoke`, the tiny interpret-mode run of the
script itself.

The table goes to `runs/bench/` unless --out says otherwise.

    python benchmarks/attention.py --lengths 512 1024 2048 4096 8192
    jattn bench attention --lengths 4096 --out docs/bench_attention_cpu.csv
    jattn bench attention --window 512 --heads 4 --max-gib 6 --repeats 3
    python benchmarks/attention.py --gpu --out docs/bench_gpu.csv
    jattn bench attention --gpu --stage smoke --cpu-smoke   # the GPU script's own check, on the CPU
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.cli.common import normalize_flags


def t2t_shaw(q, k, v, rel_k, rel_v, *, causal):
    """Shaw et al. the way tensor2tensor writes it: gather `[T, S, H]` tables."""
    t, s, h = q.shape[1], k.shape[1], q.shape[-1]
    kk = rel_k.shape[0] // 2
    r = jnp.clip(jnp.arange(s)[None, :] - jnp.arange(t)[:, None], -kk, kk) + kk
    ek = rel_k[r]  # [T, S, H]  <- the O(L^2 H) tensor
    ev = rel_v[r]  # [T, S, Hv]
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) + jnp.einsum("BTNH,TSH->BNTS", q, ek)
    logits = logits / np.sqrt(h)
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -1e30)
    w = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("BNTS,BSNV->BTNV", w, v) + jnp.einsum("BNTS,TSV->BTNV", w, ev)


def candidates(with_pallas: bool):
    """name -> (fn(q, k, v, rel_k, rel_v, causal), uses_shaw)."""

    def jattn_impl(impl, shaw):
        def f(q, k, v, rk, rv, causal):
            rel = jattn.ShawRelative(rk, rv, (rk.shape[0] - 1) // 2) if shaw else None
            return jattn.dot_product_attention(
                q, k, v, is_causal=causal, relative=rel, implementation=impl
            )

        return f

    out = {
        "jax.nn (xla)": (
            lambda q, k, v, rk, rv, c: jax.nn.dot_product_attention(q, k, v, is_causal=c),
            False,
        ),
        "jattn xla": (jattn_impl("xla", False), False),
        "jattn chunked": (jattn_impl("chunked", False), False),
        "jattn chunked + shaw": (jattn_impl("chunked", True), True),
        "jattn xla + shaw": (jattn_impl("xla", True), True),
        "t2t gather shaw": (lambda q, k, v, rk, rv, c: t2t_shaw(q, k, v, rk, rv, causal=c), True),
    }
    if with_pallas:
        out["jattn pallas"] = (jattn_impl("pallas", False), False)
        out["jattn pallas + shaw"] = (jattn_impl("pallas", True), True)
    return out


def window_candidates(window: int):
    """name -> (fn(q, k, v, rel_k, rel_v, causal), uses_shaw) for --window:
    a left window of `window` keys (`local_window_size=(window, 0)`)."""
    w = (window, 0)

    def chunked(win):
        def f(q, k, v, rk, rv, causal):
            return jattn.dot_product_attention(
                q, k, v, is_causal=causal, local_window_size=win, implementation="chunked"
            )

        return f

    def peer(q, k, v, rk, rv, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=w)

    return {
        "jax.nn (xla)": (peer, False),
        "jattn chunked": (chunked(w), False),
        "jattn chunked no window": (chunked(None), False),
    }


def measure(fn, args, repeats):
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = None if mem is None else mem.temp_size_in_bytes
    return compiled, temp


def time_it(compiled, args, repeats):
    jax.block_until_ready(compiled(*args))  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_round_robin(cells, repeats):
    """Median seconds of each `(compiled, args)` cell, timed in rounds that
    visit every cell once, so a change in machine load hits all cells alike
    (what ratios between cells need on a shared machine). Each visit makes
    an untimed call first, so no cell is timed cold after another cell's
    working set (jax.nn's GiB of logits) went through the caches."""
    ts = [[] for _ in cells]
    for _ in range(repeats):
        for (compiled, a), out in zip(cells, ts, strict=True):
            jax.block_until_ready(compiled(*a))  # warm
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*a))
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def cell_fn(fn, mode, causal):
    """The function one cell times: forward, or the gradient of a sum."""
    if mode == "fwd":
        return lambda q, k, v, rk, rv: fn(q, k, v, rk, rv, causal)

    def f(q, k, v, rk, rv):
        def loss(q, k, v, rk, rv):
            return jnp.sum(fn(q, k, v, rk, rv, causal).astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, rk, rv)

    return f


def run(args, cands: dict, *, interleave: bool = False) -> list[dict]:
    """One row per (length, implementation, pass). With `interleave`, every
    cell is compiled first and then timed round-robin (`time_round_robin`)."""
    rng = np.random.default_rng(0)
    b, n, h, kd = args.batch, args.heads, args.head_dim, args.max_distance
    dtype = jnp.dtype(args.dtype)
    rows, pending = [], []
    names = [c for c in cands if not args.only or c in args.only]
    for length in args.lengths:
        q, k, v = (jnp.asarray(rng.normal(size=(b, length, n, h)), dtype) for _ in range(3))
        rk = jnp.asarray(0.1 * rng.normal(size=(2 * kd + 1, h)), dtype)
        rv = jnp.asarray(0.1 * rng.normal(size=(2 * kd + 1, h)), dtype)
        for name in names:
            for mode in args.modes:
                f = cell_fn(cands[name][0], mode, args.causal)
                row = dict(L=length, impl=name, mode=mode, causal=args.causal, dtype=args.dtype)
                row.update(ms=None, temp_mib=None, note="")
                try:
                    compiled, temp = measure(f, (q, k, v, rk, rv), args.repeats)
                    row["temp_mib"] = None if temp is None else temp / 2**20
                    if temp is not None and temp > args.max_gib * 2**30:
                        row["note"] = f"skipped: needs {temp / 2**30:.1f} GiB"
                    elif interleave:
                        pending.append((row, (compiled, (q, k, v, rk, rv))))
                    else:
                        row["ms"] = 1e3 * time_it(compiled, (q, k, v, rk, rv), args.repeats)
                except Exception as e:  # report and carry on with the other cells
                    row["note"] = f"error: {type(e).__name__}: {str(e)[:80]}"
                rows.append(row)
                if not interleave:
                    print(format_row(row), flush=True)
    if interleave:
        medians = time_round_robin([cell for _, cell in pending], args.repeats)
        for (row, _), t in zip(pending, medians, strict=True):
            row["ms"] = 1e3 * t
        for row in rows:
            print(format_row(row), flush=True)
    return rows


def format_row(r):
    ms = "-" if r["ms"] is None else f"{r['ms']:.1f}"
    mem = "-" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
    return f"{r['L']:>6} {r['impl']:<22} {r['mode']:<8} {ms:>10} {mem:>11}  {r['note']}"


def with_ratios(rows):
    """Time and memory relative to the peer (jax.nn) and Shaw against plain
    chunked, at the same length and mode."""

    def find(length, impl, mode):
        for r in rows:
            if r["L"] == length and r["impl"] == impl and r["mode"] == mode:
                return r
        return None

    for r in rows:
        peer = find(r["L"], "jax.nn (xla)", r["mode"])
        r["time_vs_jax_nn"] = (r["ms"] / peer["ms"]) if peer and peer["ms"] and r["ms"] else None
        r["mem_vs_jax_nn"] = (
            r["temp_mib"] / peer["temp_mib"]
            if peer and peer["temp_mib"] and r["temp_mib"] is not None
            else None
        )
    return rows


def table(rows) -> str:
    head = (
        "| L | implementation | pass | time (ms) | temp memory (MiB) | time / jax.nn | "
        "memory / jax.nn | note |\n|---:|---|---|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        lines.append(
            f"| {r['L']} | {r['impl']} | {r['mode']} | {f(r['ms'], '.1f')} | "
            f"{f(r['temp_mib'], '.1f')} | {f(r['time_vs_jax_nn'], '.2f')} | "
            f"{f(r['mem_vs_jax_nn'], '.3f')} | {r['note']} |"
        )
    return "\n".join(lines)


def growth(rows) -> str:
    """Markdown table of time(L2) / time(L1) per implementation and pass,
    for the smallest and largest length measured."""
    lengths = sorted({r["L"] for r in rows})
    if len(lengths) < 2:
        return ""
    l1, l2 = lengths[0], lengths[-1]
    lines = [
        f"| implementation | pass | ms at L={l1} | ms at L={l2} | time({l2}) / time({l1}) |",
        "|---|---|---:|---:|---:|",
    ]
    for impl in dict.fromkeys(r["impl"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            t = {r["L"]: r["ms"] for r in rows if r["impl"] == impl and r["mode"] == mode}
            a, b = t.get(l1), t.get(l2)
            ratio = "-" if not a or not b else f"{b / a:.2f}"
            fa = "-" if a is None else f"{a:.1f}"
            fb = "-" if b is None else f"{b:.1f}"
            lines.append(f"| {impl} | {mode} | {fa} | {fb} | {ratio} |")
    return "\n".join(lines)


def gpu_mode(argv) -> int:
    """`--gpu [args ...]`: the prepared GPU benchmark, benchmarks/gpu.py.

    Refuses (status 2, one line, nothing compiled) when there is no GPU,
    unless `--cpu-smoke` or `--help` is among the arguments. On a GPU this
    process never initialises jax's GPU backend (it would hold GPU memory
    while the script's child processes run the cells): the script's own
    environment check decides, and jax is asked only to word the refusal.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu.py")
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reason = module.gpu_unavailable(cpu_smoke=False)
    if not {"--cpu-smoke", "-h", "--help"} & set(argv) and reason:
        print(
            f"bench attention: error: --gpu needs a GPU, but jax.default_backend() is "
            f"{jax.default_backend()!r} ({reason}); use --gpu --cpu-smoke for "
            "the tiny CPU check of the GPU script",
            file=sys.stderr,
        )
        return 2
    return module.main(argv)


def main(argv=None):
    argv = normalize_flags(sys.argv[1:] if argv is None else argv)  # --head_dim: --head-dim
    if "--gpu" in argv:
        return gpu_mode([a for a in argv if a != "--gpu"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lengths", type=int, nargs="+", help="default 512 ... 8192; with --window 8192 16384"
    )
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", type=int, default=8, help="heads N (default 8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension H (default 64)")
    p.add_argument(
        "--max-distance", type=int, default=16, help="Shaw clipping distance k (default 16)"
    )
    p.add_argument("--dtype", default="float32", help="input dtype (default float32)")
    p.add_argument(
        "--modes", nargs="+", choices=["fwd", "fwd+bwd"], help="default both; with --window fwd+bwd"
    )
    p.add_argument(
        "--window",
        type=int,
        help="sliding-window mode: causal, local_window_size=(W, 0), chunked against jax.nn",
    )
    p.add_argument(
        "--no-causal", dest="causal", action="store_false", help="full instead of causal attention"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls per cell (default 3)")
    p.add_argument(
        "--max-gib",
        type=float,
        default=8.0,
        help="skip a cell whose compiled temporary memory exceeds this",
    )
    p.add_argument("--pallas", action="store_true", help="also time the Pallas kernel")
    p.add_argument("--only", nargs="*", help="implementations to run (names as printed)")
    p.add_argument(
        "--out",
        default=os.path.join("runs", "bench", "bench_attention.csv"),
        help="CSV path for the table (default %(default)s)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="GPU mode: the arguments go to benchmarks/gpu.py (its --help lists them; "
        "--cpu-smoke runs its tiny check on the CPU); refuses at once without a GPU",
    )
    args = p.parse_args(argv)
    windowed = args.window is not None
    if args.lengths is None:
        args.lengths = [8192, 16384] if windowed else [512, 1024, 2048, 4096, 8192]
    if args.modes is None:
        args.modes = ["fwd+bwd"] if windowed else ["fwd", "fwd+bwd"]
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"devices {jax.devices()}, B={args.batch} N={args.heads} H={args.head_dim} "
        f"causal={args.causal} {args.dtype}"
        + (f" local_window_size=({args.window}, 0)" if windowed else ""),
        flush=True,
    )
    cands = window_candidates(args.window) if windowed else candidates(args.pallas)
    rows = with_ratios(run(args, cands, interleave=windowed))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {args.out}\n")
    print(table(rows))
    if windowed:
        print("\n" + growth(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
