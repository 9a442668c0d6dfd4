"""Benchmark: score mods inside the tiles against a materialised bias; a table's gradient.

Forward+backward at the attention level: chunked plain (the baseline), chunked
with every built-in scheme's score mod (tests/registry_mods.py: a new scheme is
timed with no edit here; a distance-table mod also per logit), the T5 term
with the gather's autodiff backward and as a materialised `[1, N, T, S]` bias
(what came before), xla plain and with T5: compiled temporaries and round-robin
times against chunked plain. `--table-gradient`: why a distance-table mod moves
a trained model's numbers.

    python benchmarks/score_mod.py --length 4096
    python benchmarks/score_mod.py --table-gradient t5 --implementation chunked
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (reads --platform before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jattn  # noqa: E402
from jattn import positions  # noqa: E402
from jattn.score_mod import with_settings  # noqa: E402

BASE = "chunked plain"


def _t5_autodiff(tab, score, batch, head, i, j, *, bidirectional):
    """The T5 term with the gather's own autodiff backward (the same values)."""
    return score + tab[head, positions.t5_relative_bucket(j - i, 32, 128, bidirectional)]


def cells_of(num_heads: int, causal: bool, length: int) -> dict:
    """name -> (implementation, params, fn(params, positions) -> (bias, score_mod[,
    row_col_bias])), for `length` queries and keys."""
    sys.path.insert(0, str(h.ROOT / "tests"))
    import registry_mods  # noqa: PLC0415  (the registry's score mods, the kernel tests' too)

    mods = registry_mods.builtin_mods(sites=(causal,), num_heads=num_heads)
    t5 = next(b.mod for b in mods.values() if b.mod.name == "t5")  # 32 buckets, [N, 32]

    with_params = lambda mod: lambda p, pos: (None, dataclasses.replace(mod, params=p))
    per_logit = lambda mod: lambda p, pos: (None, jattn.ScoreMod(mod.fn, p, mod.name))  # no table

    def t5_autodiff(table, pos):
        fn = with_settings(_t5_autodiff, bidirectional=not causal)
        return None, jattn.ScoreMod(fn, table, "t5_autodiff")

    def t5_bias(table, pos):
        rel = pos[:, None, :] - pos[:, :, None]  # [1, T, S]
        buckets = positions.t5_relative_bucket(rel, 32, 128, not causal)
        return jnp.transpose(jnp.take(table, buckets, axis=1), (1, 0, 2, 3)), None  # [1, N, T, S]

    plain = lambda p, pos: (None, None)
    out = {BASE: ("chunked", None, plain)}
    for label, built in mods.items():
        out[f"chunked + {label} score mod"] = ("chunked", built.mod.params, with_params(built.mod))
        if built.mod.distance is not None:  # the table (above) against the per-logit form
            out[f"chunked + {label} score mod, per logit"] = (
                "chunked", built.mod.params, per_logit(built.mod))  # fmt: skip
    out["chunked + t5 score mod, autodiff scatter"] = ("chunked", t5.params, t5_autodiff)
    out["chunked + t5 bias [1,N,T,S]"] = ("chunked", t5.params, t5_bias)
    gates = jnp.full((1, length, num_heads), 4.0, jnp.float32)  # pre-activations, σ(4) ≈ 0.982
    out["chunked + forget gate (row and column terms)"] = ("chunked", gates, forget_gate)
    out["xla plain"] = ("xla", None, plain)
    out["xla + t5 score mod"] = ("xla", t5.params, with_params(t5))
    return out


def forget_gate(z, pos):
    """The Forgetting Transformer's gates as `row_col_bias`: `(c, −c)`, `c` the
    cumulative log sigmoid of the pre-activations `z` `[1, T, N]`."""
    c = positions.segment_cumsum(jax.nn.log_sigmoid(z), None)  # [1, T, N]
    return None, None, positions.forget_row_col(c, c)


def cell_fn(impl: str, term, causal: bool):
    """Gradient of a sum of the output w.r.t. query, key, value and params."""

    def loss(q, k, v, params):
        b, t = q.shape[:2]
        bias, mod, *row_col = term(params, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
        kw = dict(is_causal=causal, score_mod=mod, implementation=impl)
        kw.update(row_col_bias=row_col[0] if row_col else None)
        return jnp.sum(jattn.dot_product_attention(q, k, v, bias, **kw).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 3))


def run(args) -> list[dict]:
    rng = np.random.default_rng(0)
    shape = (1, args.length, args.heads, args.head_dim)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3))
    known = cells_of(args.heads, args.causal, args.length)
    if bad := set(args.only or ()) - set(known):
        raise SystemExit(f"score_mod.py: --only: no cell {sorted(bad)}; cells: {list(known)}")
    cells = {
        name: (cell_fn(impl, term, args.causal), (q, k, v, params))
        for name, (impl, params, term) in known.items()
        if not args.only or name in args.only
    }
    out = h.time_cells(cells, args.repeats, args.max_gib)
    base = out.get(BASE, {})
    vs = lambda r: dict(time_vs_plain=h.ratio(r["seconds"], base.get("seconds")),
                        temp_vs_plain=h.ratio(r["temp_mib"], base.get("temp_mib")))  # fmt: skip
    return [dict(L=args.length, cell=name, **r, **vs(r)) for name, r in out.items()]


def table_gradient(name: str, implementation: str, b: int, t: int | None) -> str:
    """`--table-gradient`: a distance mod read from its table against per logit (4
    heads of 16, bidirectional): the same logits, a gradient summed in another order."""
    n, hd, t = 4, 16, t or 64
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v = (jax.random.normal(kk, (b, t, n, hd), jnp.float64) for kk in keys[:3])
        params = 0.5 * jax.random.normal(keys[3], (n, 32) if name == "t5" else (n,), jnp.float64)
        if name == "alibi":
            params = jnp.abs(params) + 0.1

        def loss(p, q, k, v, table: bool):
            mod = positions.t5_score_mod(p, max_distance=128, bidirectional=True)
            if name == "alibi":
                mod = positions.alibi_score_mod(p, mode="symmetric")
            mod = mod if table else dataclasses.replace(mod, distance=None)
            out = jattn.dot_product_attention(q, k, v, score_mod=mod, implementation=implementation)
            return jnp.sum(out * jnp.cos(out)), out

        grad = jax.grad(loss, has_aux=True)
        g_table, out_table = grad(*(x.astype(jnp.float32) for x in (params, q, k, v)), True)
        g_logit, out_logit = grad(*(x.astype(jnp.float32) for x in (params, q, k, v)), False)
        g64, _ = grad(params, q, k, v, False)
        scale = float(jnp.max(jnp.abs(g64)))
        rel = lambda a, ref: float(jnp.max(jnp.abs(a.astype(jnp.float64) - ref))) / scale
        ratio = "max abs(g_{} - g_{}) / max abs(g_float64)"
        same = bool(jnp.all(out_table == out_logit))
        rows = [
            ("outputs bit-identical (table vs per logit, float32)", same),
            ("params' gradients bit-identical", bool(jnp.all(g_table == g_logit))),
            (ratio.format("table", "logit"), f"{rel(g_table, g_logit.astype(jnp.float64)):.2e}"),
            (ratio.format("table", "float64"), f"{rel(g_table, g64):.2e}"),
            (ratio.format("logit", "float64"), f"{rel(g_logit, g64):.2e}"),
        ]  # fmt: skip
    head = f"{name}, implementation={implementation}, B={b} T=S={t} N={n} H={hd}, bidirectional"
    versions = f"jax {jax.__version__} on {jax.default_backend()}"
    return f"{head}, {versions}\n\n" + h.table(["measure", "value"], rows)


def table(rows) -> str:
    out = [
        [r["L"], r["cell"], h.fmt(r["temp_mib"], ",.1f"), h.fmt(r["temp_vs_plain"], ".2f") + "x",
         h.fmt(r["seconds"] and 1e3 * r["seconds"], ",.0f"), h.fmt(r["time_vs_plain"], ".2f") + "x",
         r["note"]]
        for r in rows
    ]  # fmt: skip
    header = ["L", "cell", "compiled temporaries (MiB)", "vs chunked plain", "fwd+bwd (ms)"]
    return h.table([*header, "vs chunked plain", "note"], out, "rlrrrr")


def main(argv=None):
    p = h.parser(__doc__, out="score_mod.csv")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, every cell once a round")
    p.add_argument("--max-gib", type=float, default=6.0, help="skip timing a cell over this")
    p.add_argument("--length", type=int, help="T = S (default 4096; --table-gradient 64)")
    p.add_argument("--heads", type=int, default=8, help="heads N")
    p.add_argument("--head-dim", type=int, default=32, help="head dimension H")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="not causal")
    p.add_argument("--only", nargs="*", help="cells to run (names as printed)")
    p.add_argument("--table-gradient", choices=("t5", "alibi"), help="the mod's table gradient")
    p.add_argument("--implementation", choices=("xla", "chunked"), default="xla", help="its path")
    p.add_argument("--batch", type=int, default=16, help="--table-gradient: rows B")
    args = h.parse(p, argv)
    if args.table_gradient:
        print(table_gradient(args.table_gradient, args.implementation, args.batch, args.length))
        return 0
    args.length = args.length or 4096
    where = f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}"
    print(f"{where}, B=1 N={args.heads} H={args.head_dim} L={args.length} causal={args.causal}",
          "float32")  # fmt: skip
    rows = run(args)
    h.write_csv(args.out, rows)
    print(f"\nwrote {args.out}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
