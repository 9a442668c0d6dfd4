"""Why a distance-table mod moves a trained model's numbers: the same forward,
a table gradient summed in another order.

    python benchmarks/table_gradient.py
    python benchmarks/table_gradient.py --mod t5 --implementation chunked

A built-in distance mod (T5's buckets, ALiBi, KERPLE, Sandwich) is read in the
xla and chunked paths from a table evaluated once per call
(`jattn.attention.distance_table`), or per logit when its `distance` form is
dropped. The logits are the same values either way; the gradient of the
mod's params is not the same sum: per logit, every logit's cotangent goes to
its bucket; from the table, each distance's diagonal is summed first, then
the distances into buckets. This prints, for one attention call at the main
job's shapes (16 rows of 64 tokens, 4 heads of 16, bidirectional), whether
the outputs are bit-identical, the largest difference between the two
params' gradients, and each one's largest error against the float64
gradient: float32 rounding, which training amplifies over many steps.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import jattn  # noqa: E402
from jattn import positions  # noqa: E402

MODS = {
    "t5": lambda p: positions.t5_score_mod(p, max_distance=128, bidirectional=True),
    "alibi": lambda p: positions.alibi_score_mod(p, mode="symmetric"),
}
PARAMS = {"t5": (4, 32), "alibi": (4,)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mod", choices=sorted(MODS), default="t5")
    parser.add_argument("--implementation", choices=("xla", "chunked"), default="xla")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args(argv)

    b, t, n, h = args.batch, args.length, 4, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.float64) for kk in keys[:3])
    params = 0.5 * jax.random.normal(keys[3], PARAMS[args.mod], jnp.float64)
    if args.mod == "alibi":
        params = jnp.abs(params) + 0.1

    def loss(p, q, k, v, table: bool):
        mod = MODS[args.mod](p)
        if not table:
            mod = dataclasses.replace(mod, distance=None)
        out = jattn.dot_product_attention(
            q, k, v, score_mod=mod, implementation=args.implementation
        )
        return jnp.sum(out * jnp.cos(out)), out

    f32 = [x.astype(jnp.float32) for x in (params, q, k, v)]
    grad = jax.grad(loss, has_aux=True)
    g_table, out_table = grad(*f32, True)
    g_logit, out_logit = grad(*f32, False)
    g64, _ = grad(params, q, k, v, False)
    scale = float(jnp.max(jnp.abs(g64)))

    def rel(a, ref):
        return float(jnp.max(jnp.abs(a.astype(jnp.float64) - ref))) / scale

    rows = [
        (
            "outputs bit-identical (table vs per logit, float32)",
            str(bool(jnp.all(out_table == out_logit))),
        ),
        ("params' gradients bit-identical", str(bool(jnp.all(g_table == g_logit)))),
        (
            "max abs(g_table - g_logit) / max abs(g_float64)",
            f"{rel(g_table, g_logit.astype(jnp.float64)):.2e}",
        ),
        ("max abs(g_table - g_float64) / max abs(g_float64)", f"{rel(g_table, g64):.2e}"),
        ("max abs(g_logit - g_float64) / max abs(g_float64)", f"{rel(g_logit, g64):.2e}"),
    ]
    print(
        f"{args.mod}, implementation={args.implementation}, B={b} T=S={t} N={n} H={h}, "
        f"bidirectional, jax {jax.__version__} on {jax.default_backend()}\n"
    )
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
