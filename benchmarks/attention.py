"""Benchmark: jattn's attention implementations against jax.nn.dot_product_attention.

In one run on the same inputs, forward and forward+backward time and XLA's
compiled temporaries of `jax.nn.dot_product_attention` (the peer), jattn "xla"
and "chunked" ("pallas" with --pallas: interpret mode on a CPU), and Shaw
relative attention (k = 16) against the `[T, S, H]` gather of tensor2tensor.
Cells over --max-gib are reported and skipped; the rest are timed round-robin.
`--window W`: causal with `local_window_size=(W, 0)`, chunked (with and
without the window) against jax.nn, ending with time(L2) / time(L1) (about 2
for doubling L at O(L·W), 4 at O(L²)). `--reverse-scan`: stick-breaking
attention and CoPE against softmax (`reverse_scan`). The GPU benchmark is gpu.py.

    python benchmarks/attention.py --lengths 512 1024 2048 4096 8192
    python benchmarks/attention.py --window 512 --heads 4 --max-gib 6 --repeats 3
    python benchmarks/attention.py --reverse-scan --lengths 4096 --repeats 3
"""

from __future__ import annotations

import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (reads --platform before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from jattn.attention import cope as cope_lib  # noqa: E402
from jattn.attention import scores as scores_lib  # noqa: E402
from jattn.attention.cope import cope_attention_xla  # noqa: E402
from jattn.attention.stick_breaking import stick_breaking_attention_xla  # noqa: E402

PEER = "jax.nn (xla)"
# Shaw's key term read by a broadcast take_along_axis: `scores.rel_gather`'s peer.
take_along = mock.patch.object(scores_lib, "rel_gather", scores_lib.rel_gather_by_take_along)


def t2t_shaw(q, k, v, rel_k, rel_v, *, causal):
    """Shaw et al. the way tensor2tensor writes it: gather `[T, S, H]` tables."""
    t, s, h = q.shape[1], k.shape[1], q.shape[-1]
    kk = rel_k.shape[0] // 2
    r = jnp.clip(jnp.arange(s)[None, :] - jnp.arange(t)[:, None], -kk, kk) + kk
    ek, ev = rel_k[r], rel_v[r]  # [T, S, H]: the O(L^2 H) tensors
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) + jnp.einsum("BTNH,TSH->BNTS", q, ek)
    logits = logits / np.sqrt(h)
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -1e30)
    w = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("BNTS,BSNV->BTNV", w, v) + jnp.einsum("BNTS,TSV->BTNV", w, ev)


def candidates(with_pallas: bool, window: int | None = None) -> dict:
    """name -> fn(q, k, v, rel_k, rel_v, causal); with `window`, the --window cells."""

    def _jattn(impl: str, shaw: bool = False, window=None):
        return lambda q, k, v, rk, rv, causal: jattn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl, local_window_size=window,
            relative=jattn.ShawRelative(rk, rv, (rk.shape[0] - 1) // 2) if shaw else None,
        )  # fmt: skip

    if window is not None:
        w = (window, 0)
        peer = lambda q, k, v, rk, rv, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, local_window_size=w)  # fmt: skip
        return {PEER: peer, "jattn chunked": _jattn("chunked", window=w),
                "jattn chunked no window": _jattn("chunked")}  # fmt: skip
    out = {
        PEER: lambda q, k, v, rk, rv, c: jax.nn.dot_product_attention(q, k, v, is_causal=c),
        "jattn xla": _jattn("xla"),
        "jattn chunked": _jattn("chunked"),
        "jattn chunked + shaw": _jattn("chunked", True),
        "jattn xla + shaw": _jattn("xla", True),
        "jattn chunked + shaw, take_along": take_along(_jattn("chunked", True)),
        "jattn xla + shaw, take_along": take_along(_jattn("xla", True)),
        "t2t gather shaw": lambda q, k, v, rk, rv, c: t2t_shaw(q, k, v, rk, rv, causal=c),
    }
    if with_pallas:
        out |= {"jattn pallas": _jattn("pallas"), "jattn pallas + shaw": _jattn("pallas", True)}
    return out


def cell_fn(fn, mode, causal):
    """The function one cell times: forward, or the gradient of a sum."""
    if mode == "fwd":
        return lambda *a: fn(*a, causal)
    loss = lambda *a: jnp.sum(fn(*a, causal).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def run(args, cands: dict) -> list[dict]:
    """One row per (length, implementation, pass): every cell compiled, then timed."""
    rng = np.random.default_rng(0)
    b, n, hd, kd = args.batch, args.heads, args.head_dim, args.max_distance
    cells = {}
    for length in args.lengths:
        qkv = (jnp.asarray(rng.normal(size=(b, length, n, hd)), args.dtype) for _ in range(3))
        rel = (jnp.asarray(0.1 * rng.normal(size=(2 * kd + 1, hd)), args.dtype) for _ in range(2))
        inputs = (*qkv, *rel)
        for name in [c for c in cands if not args.only or c in args.only]:
            for mode in args.modes:
                cells[length, name, mode] = (cell_fn(cands[name], mode, args.causal), inputs)
    out = h.time_cells(cells, args.repeats, args.max_gib)
    rows = []
    for (length, name, mode), r in out.items():  # against the peer at the same length and pass
        peer = out.get((length, PEER, mode), {})
        ms = r["seconds"] and 1e3 * r["seconds"]
        rows.append(dict(L=length, impl=name, mode=mode, causal=args.causal, dtype=args.dtype,
                         ms=ms, temp_mib=r["temp_mib"], note=r["note"],
                         time_vs_jax_nn=h.ratio(r["seconds"], peer.get("seconds")),
                         mem_vs_jax_nn=h.ratio(r["temp_mib"], peer.get("temp_mib"))))  # fmt: skip
    return rows


def reverse_scan(args) -> str:
    """`--reverse-scan`: stick-breaking attention and CoPE, tiled and materialised
    (`*_xla`), against chunked softmax; causal, forward+backward, head dim 64."""
    r = np.random.default_rng(0)
    shape = (1, args.lengths[0], args.heads, 64)
    q, k, v = (jnp.asarray(r.normal(size=shape), jnp.float32) for _ in range(3))
    e = jnp.asarray(r.normal(size=(args.npos_max, 64)), jnp.float32)  # CoPE's table
    tiles = dict(block_q=args.block, block_k=args.block)
    # CoPE traced with the lookup by two take_along_axis: the flat lookup's peer.
    gathers = mock.patch.object(cope_lib, "lookup", cope_lib.lookup_by_gathers)
    cells = {
        "softmax chunked": lambda q, k, v, e: jattn.dot_product_attention(
            q, k, v, is_causal=True, implementation="chunked"
        ),
        "stick-breaking": lambda q, k, v, e: jattn.stick_breaking_attention(q, k, v, **tiles),
        "cope": lambda q, k, v, e: jattn.cope_attention(q, k, v, e, **tiles),
        "cope, gathers": gathers(lambda q, k, v, e: jattn.cope_attention(q, k, v, e, **tiles)),
        "stick-breaking xla": lambda q, k, v, e: stick_breaking_attention_xla(q, k, v),
        "cope xla": lambda q, k, v, e: cope_attention_xla(q, k, v, e),
        "cope xla, gathers": gathers(cope_attention_xla),
    }
    grad = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2, 3))
    cells = {name: (grad(fn), (q, k, v, e)) for name, fn in cells.items()}
    out = h.time_cells(cells, args.repeats, args.max_gib)
    base, rows = out["softmax chunked"]["seconds"], []
    for name, c in out.items():
        timed = [f"{c['seconds']:.4f}", f"{c['seconds'] / base:.2f}"] if c["seconds"] else []
        rows.append([name, f"{c['temp_mib']:.1f}", *(timed or ["over --max-gib", ""])])
    head = f"L={shape[1]} heads={args.heads} block={args.block} {jax.devices()[0].platform}\n"
    return head + h.table(["cell", "temp MiB", "median s (fwd+bwd)", "x softmax chunked"], rows)


def table(rows) -> str:
    header = ["L", "implementation", "pass", "time (ms)", "temp memory (MiB)", "time / jax.nn"]
    cells = [
        [r["L"], r["impl"], r["mode"], h.fmt(r["ms"], ".1f"), h.fmt(r["temp_mib"], ".1f"),
         h.fmt(r["time_vs_jax_nn"], ".2f"), h.fmt(r["mem_vs_jax_nn"], ".3f"), r["note"]]
        for r in rows
    ]  # fmt: skip
    return h.table([*header, "memory / jax.nn", "note"], cells, "rllrrrr")


def growth(rows) -> str:
    """time(L2) / time(L1) per implementation and pass, L1 and L2 the smallest and
    largest length measured."""
    l1, l2 = min(r["L"] for r in rows), max(r["L"] for r in rows)
    out = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            t = {r["L"]: r["ms"] for r in rows if r["impl"] == impl and r["mode"] == mode}
            a, b = t.get(l1), t.get(l2)
            ratio = "-" if not a or not b else f"{b / a:.2f}"
            out.append([impl, mode, h.fmt(a, ".1f"), h.fmt(b, ".1f"), ratio])
    header = ["implementation", "pass", f"ms at L={l1}", f"ms at L={l2}"]
    return h.table([*header, f"time({l2}) / time({l1})"], out, "llrrr")


def main(argv=None):
    p = h.parser(__doc__, out="bench_attention.csv")
    p.add_argument("--lengths", type=int, nargs="+", help="default 512 .. 8192 (see the doc)")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--heads", type=int, help="heads N (default 8; --reverse-scan 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension H")
    p.add_argument("--max-distance", type=int, default=16, help="Shaw clipping distance k")
    p.add_argument("--dtype", default="float32", help="input dtype")
    modes = ("fwd", "fwd+bwd")
    p.add_argument("--modes", nargs="+", choices=modes, help="default both; --window fwd+bwd")
    p.add_argument("--window", type=int, help="causal, local_window_size=(W, 0), against jax.nn")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="not causal")
    p.add_argument("--pallas", action="store_true", help="also time the Pallas kernel")
    p.add_argument("--only", nargs="*", help="implementations to run (names as printed)")
    p.add_argument("--repeats", type=int, help="timed rounds (default 3; --reverse-scan 5)")
    p.add_argument("--max-gib", type=float, help="skip a cell above this (default 8; scan 4)")
    p.add_argument("--reverse-scan", action="store_true", help="stick-breaking and CoPE instead")
    p.add_argument("--npos-max", type=int, default=64, help="--reverse-scan: CoPE's table rows")
    p.add_argument("--block", type=int, default=128, help="--reverse-scan: square tiles")
    args = h.parse(p, argv)
    scan, windowed = args.reverse_scan, args.window is not None
    args.heads, args.repeats = args.heads or (4 if scan else 8), args.repeats or (5 if scan else 3)
    args.max_gib = args.max_gib or (4.0 if scan else 8.0)
    default = [1024] if scan else [8192, 16384] if windowed else [512, 1024, 2048, 4096, 8192]
    args.lengths = args.lengths or default
    args.modes = args.modes or (["fwd+bwd"] if windowed else list(modes))
    if scan:
        print(reverse_scan(args))
        return 0
    window = f" local_window_size=({args.window}, 0)" if windowed else ""
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}, "
          f"B={args.batch} N={args.heads} H={args.head_dim} causal={args.causal} {args.dtype}"
          f"{window}", flush=True)  # fmt: skip
    rows = run(args, candidates(args.pallas, args.window))
    h.write_csv(args.out, rows)
    print(f"\nwrote {args.out}\n")
    print(table(rows))
    if windowed:
        print("\n" + growth(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
