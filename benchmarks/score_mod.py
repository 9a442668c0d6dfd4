"""Benchmark: score mods inside the tiles against a materialised bias.

At the attention level (one batch row, 8 heads, head dim 32 by default),
forward+backward (gradients to query, key, value and the positional
parameters), in one run on the same inputs:

- chunked, plain (no positional term): the baseline;
- chunked + every score mod the built-in schemes of `jattn.models.SCHEMES`
  build in a causal (or, with --no-causal, a bidirectional) layer of
  `--heads` heads at the config's defaults (T5: 32 buckets; FIRE: 32 hidden
  units), parameters from each scheme's initialisers: the catalogue
  tests/registry_mods.py, which the kernel tests run too, so a new scheme
  is timed with no edit here; a distance-table mod (`ScoreMod.from_distance`)
  twice, read from its table and per logit (its `fn` on every logit);
- chunked + the T5 term read as `table[head, bucket]` with the gather's
  own autodiff backward (a scatter-add of every element), which the T5 mod
  used before its table read got a row-scatter backward;
- chunked + the T5 bias materialised as `[1, N, T, S]` (what the models did
  before score mods: the table read at every position pair's bucket, handed
  over as `bias`);
- xla, plain and with the T5 score mod, where its compiled temporaries fit
  in --max-gib.

For each cell: XLA's compiled temporary bytes (`jax.jit(...).lower(...)
.compile().memory_analysis()`, read before anything runs) and the median wall
time, timed round-robin over the cells (each timed call after an untimed one
of the same cell) so a change in machine load hits all cells alike. Ratios
are against chunked plain. Prints the table last and writes it as CSV.

    python benchmarks/score_mod.py --length 4096
    jattn bench score_mod --length 2048 --repeats 3 --out runs/bench/score_mod.csv
    jattn bench score_mod --tile-pieces --repeats 9   # the T5 mod's pieces on one tile
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import positions
from jattn.cli.common import normalize_flags
from jattn.score_mod import with_settings

MIB = 2**20
ROOT = pathlib.Path(__file__).resolve().parent.parent


def registry_mods():
    """tests/registry_mods.py, the catalogue of the registry's score mods."""
    if "registry_mods" not in sys.modules:  # its dataclass needs it registered
        path = ROOT / "tests" / "registry_mods.py"
        spec = importlib.util.spec_from_file_location("registry_mods", path)
        sys.modules["registry_mods"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["registry_mods"])
    return sys.modules["registry_mods"]


def _t5_autodiff(tab, score, batch, head, i, j, *, bidirectional):
    """The T5 term with the gather's own autodiff backward (the same values)."""
    return score + tab[head, positions.t5_relative_bucket(j - i, 32, 128, bidirectional)]


def cells(num_heads: int, causal: bool, length: int) -> dict:
    """name -> (implementation, params, fn(params, q_pos, kv_pos) -> (bias,
    score_mod[, row_col_bias])), for `length` queries and keys."""
    mods = registry_mods().builtin_mods(sites=(causal,), num_heads=num_heads)
    t5 = next(b.mod for b in mods.values() if b.mod.name == "t5")  # 32 buckets, [N, 32]
    bidirectional = not causal

    def plain(p, qp, kp):
        return None, None

    def with_params(mod):  # the mod with the cell's (differentiated) parameters
        return lambda p, qp, kp: (None, dataclasses.replace(mod, params=p))

    def per_logit(mod):  # a distance-table mod without its table: fn on every logit
        return lambda p, qp, kp: (None, jattn.ScoreMod(mod.fn, p, mod.name))

    def t5_autodiff(table, qp, kp):
        fn = with_settings(_t5_autodiff, bidirectional=bidirectional)
        return None, jattn.ScoreMod(fn, table, "t5_autodiff")

    def t5_bias(table, qp, kp):
        rel = kp[:, None, :] - qp[:, :, None]  # [1, T, S]
        buckets = positions.t5_relative_bucket(rel, 32, 128, bidirectional)
        bias = jnp.take(table, buckets, axis=1)  # [N, 1, T, S]
        return jnp.transpose(bias, (1, 0, 2, 3)), None  # [1, N, T, S]

    out = {"chunked plain": ("chunked", None, plain)}
    for label, built in mods.items():
        out[f"chunked + {label} score mod"] = ("chunked", built.mod.params, with_params(built.mod))
        if built.mod.distance is not None:  # the table (above) against the per-logit form
            cell = f"chunked + {label} score mod, per logit"
            out[cell] = ("chunked", built.mod.params, per_logit(built.mod))
    out["chunked + t5 score mod, autodiff scatter"] = ("chunked", t5.params, t5_autodiff)
    out["chunked + t5 bias [1,N,T,S]"] = ("chunked", t5.params, t5_bias)
    gates = jnp.full((1, length, num_heads), 4.0, jnp.float32)  # σ(4): f ≈ 0.982
    out["chunked + forget gate (row and column terms)"] = ("chunked", gates, forget_gate)
    out["xla plain"] = ("xla", None, plain)
    out["xla + t5 score mod"] = ("xla", t5.params, with_params(t5))
    return out


def forget_gate(z, qp, kp):
    """The Forgetting Transformer's gates as `row_col_bias`: `c` the cumulative
    log sigmoid of the pre-activations `z` `[1, T, N]` (the cell's parameters)."""
    c = positions.segment_cumsum(jax.nn.log_sigmoid(z), None)  # [1, T, N]
    return None, None, positions.forget_row_col(c, c)


def cell_fn(impl: str, term, causal: bool):
    """Gradient of a sum of the output w.r.t. query, key, value and params."""

    def f(q, k, v, params):
        def loss(q, k, v, params):
            b, t = q.shape[:2]
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            bias, mod, *row_col = term(params, pos, pos)
            out = jattn.dot_product_attention(
                q, k, v, bias, is_causal=causal, score_mod=mod, implementation=impl,
                row_col_bias=row_col[0] if row_col else None,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, params)

    return f


def time_round_robin(compiled_cells, repeats: int) -> list[float]:
    ts = [[] for _ in compiled_cells]
    for _ in range(repeats):
        for (compiled, a), out in zip(compiled_cells, ts, strict=True):
            jax.block_until_ready(compiled(*a))  # warm
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*a))
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def run(args) -> list[dict]:
    rng = np.random.default_rng(0)
    b, t, n, h = 1, args.length, args.heads, args.head_dim
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32) for _ in range(3))
    rows, ready = [], []
    for name, (impl, params, term) in cells(n, args.causal, t).items():
        if args.only and name not in args.only:
            continue
        a = (q, k, v, params)
        t0 = time.perf_counter()
        compiled = jax.jit(cell_fn(impl, term, args.causal)).lower(*a).compile()
        mem = compiled.memory_analysis()
        temp = None if mem is None else mem.temp_size_in_bytes
        row = dict(L=t, cell=name, temp_mib=None if temp is None else temp / MIB, seconds=None)
        print(f"compiled {name}: {row['temp_mib']:.1f} MiB ({time.perf_counter() - t0:.0f} s)")
        if temp is not None and temp > args.max_gib * 2**30:
            row["note"] = f"skipped: over --max-gib {args.max_gib}"
        else:
            ready.append((len(rows), (compiled, a)))
        rows.append(row)
    seconds = time_round_robin([c for _, c in ready], args.repeats)
    for (i, _), s in zip(ready, seconds, strict=True):
        rows[i]["seconds"] = s
    base = next((r for r in rows if r["cell"] == "chunked plain"), None)
    for r in rows:
        r.setdefault("note", "")
        ok = base is not None and base["seconds"] and r["seconds"]
        r["time_vs_plain"] = r["seconds"] / base["seconds"] if ok else None
        ok = base is not None and base["temp_mib"] and r["temp_mib"] is not None
        r["temp_vs_plain"] = r["temp_mib"] / base["temp_mib"] if ok else None
    return rows


def tile_pieces(num_heads: int, block: int, repeats: int) -> str:
    """Where the T5 mod's time goes on one chunked tile `[1, N, 1, block,
    block]` (causal positions): an elementwise op, the buckets, the forward
    (buckets and gather), and `jax.vjp` (forward and backward, gradients to
    the table and the logits) with the table read's row-scatter backward
    (now) and with the gather's own autodiff (before). Round-robin medians."""
    from jattn.attention import scores  # noqa: PLC0415

    rng = np.random.default_rng(0)
    tab = jnp.asarray(rng.normal(size=(num_heads, 32)), jnp.float32)
    s = jnp.asarray(rng.normal(size=(1, num_heads, 1, block, block)), jnp.float32)
    qp = jnp.arange(2 * block, 3 * block, dtype=jnp.int32)[None]  # [1, t]
    kp = jnp.arange(block, 2 * block, dtype=jnp.int32)[None] + 100  # [1, s]
    head = jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1, 1, 1)

    def bucket():  # [1, 1, 1, t, s]
        rel = kp[:, None, None, None, :] - qp[:, None, None, :, None]
        return positions.t5_relative_bucket(rel, 32, 128, False)

    def t5_now(tab, s):
        mod = positions.t5_score_mod(tab, bidirectional=False)
        return scores.apply_grouped_score_mod(mod, s, jnp.arange(1), 0, qp, kp)

    def t5_before(tab, s):
        return s + tab[head, bucket()]

    def vjp_of(f):
        def g(tab, s):
            out, pull = jax.vjp(f, tab, s)
            return pull(out)

        return g

    pieces = {
        "elementwise op (x 1.0001)": lambda tab, s: s * 1.0001,
        "buckets (log, division, clip)": lambda tab, s: s + bucket().astype(jnp.float32),
        "buckets + gather (forward)": t5_now,
        "fwd+bwd, row-scatter backward (now)": vjp_of(t5_now),
        "fwd+bwd, autodiff scatter (before)": vjp_of(t5_before),
    }
    compiled = [(jax.jit(f).lower(tab, s).compile(), (tab, s)) for f in pieces.values()]
    seconds = time_round_robin(compiled, repeats)
    out = [
        f"| piece, one {block} x {block} tile of {num_heads} heads | median (ms) |",
        "|---|---:|",
    ]
    out += [f"| {k} | {1e3 * t:.2f} |" for k, t in zip(pieces, seconds, strict=True)]
    return "\n".join(out)


def table(rows) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    out = [
        "| L | cell | compiled temporaries (MiB) | vs chunked plain | fwd+bwd (ms) "
        "| vs chunked plain | note |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ms = None if r["seconds"] is None else 1e3 * r["seconds"]
        out.append(
            f"| {r['L']} | {r['cell']} | {f(r['temp_mib'], ',.1f')} | "
            f"{f(r['temp_vs_plain'], '.2f')}x | {f(ms, ',.0f')} | "
            f"{f(r['time_vs_plain'], '.2f')}x | {r['note']} |"
        )
    return "\n".join(out)


def main(argv=None):
    argv = normalize_flags(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=4096, help="T = S (default 4096)")
    p.add_argument("--heads", type=int, default=8, help="heads N (default 8)")
    p.add_argument("--head-dim", type=int, default=32, help="head dimension H (default 32)")
    p.add_argument(
        "--no-causal", dest="causal", action="store_false", help="full instead of causal attention"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument(
        "--max-gib", type=float, default=6.0, help="skip timing a cell above this many GiB"
    )
    p.add_argument("--only", nargs="*", help="cells to run (names as printed)")
    p.add_argument(
        "--tile-pieces",
        action="store_true",
        help="instead: time the T5 mod's pieces on one 512 x 512 tile",
    )
    p.add_argument(
        "--out",
        default=os.path.join("runs", "bench", "score_mod.csv"),
        help="CSV path for the table (default %(default)s)",
    )
    args = p.parse_args(argv)
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}, "
        f"B=1 N={args.heads} H={args.head_dim} L={args.length} causal={args.causal} float32",
        flush=True,
    )
    if args.tile_pieces:
        print(tile_pieces(args.heads, 512, args.repeats))
        return 0
    rows = run(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {args.out}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
