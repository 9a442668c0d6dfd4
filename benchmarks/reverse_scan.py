"""Benchmark: stick-breaking attention and CoPE (the reverse scan) against softmax.

At the attention level (one batch row, `--heads` heads, head dim 64),
causal, forward+backward (gradients to query, key, value and CoPE's table),
in one run on the same inputs:

- softmax, `jattn.dot_product_attention(implementation="chunked")`: the baseline;
- `jattn.stick_breaking_attention` and `jattn.cope_attention` (tiled, the
  reverse scan over key tiles, `--block` square tiles);
- their materialised references (`*_xla`), where the compiled temporaries
  fit in --max-gib.

For each cell: XLA's compiled temporary bytes (read before anything runs)
and the median wall time, timed round-robin (each timed call after an
untimed one of the same cell). Ratios are against softmax chunked.

    python benchmarks/reverse_scan.py --length 1024
    jattn bench reverse_scan --length 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.attention import cope, stick_breaking
from jattn.cli.common import normalize_flags

MIB = 2**20


def cells(block: int) -> dict:
    """name -> fn(q, k, v, table) -> out."""
    return {
        "softmax chunked": lambda q, k, v, e: jattn.dot_product_attention(
            q, k, v, is_causal=True, implementation="chunked"
        ),
        "stick-breaking": lambda q, k, v, e: jattn.stick_breaking_attention(
            q, k, v, block_q=block, block_k=block
        ),
        "cope": lambda q, k, v, e: jattn.cope_attention(q, k, v, e, block_q=block, block_k=block),
        "stick-breaking xla": lambda q, k, v, e: stick_breaking.stick_breaking_attention_xla(
            q, k, v
        ),
        "cope xla": lambda q, k, v, e: cope.cope_attention_xla(q, k, v, e),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--npos-max", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-gib", type=float, default=4.0)
    args = p.parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    r = np.random.default_rng(0)
    shape = (1, args.length, args.heads, 64)
    q, k, v = (jnp.asarray(r.normal(size=shape), jnp.float32) for _ in range(3))
    e = jnp.asarray(r.normal(size=(args.npos_max, 64)), jnp.float32)
    compiled, temp = {}, {}
    for name, fn in cells(args.block).items():
        grad = jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a)), argnums=(0, 1, 2, 3)))
        c = grad.lower(q, k, v, e).compile()
        temp[name] = c.memory_analysis().temp_size_in_bytes
        if temp[name] <= args.max_gib * 2**30:
            compiled[name] = c
    times = {name: [] for name in compiled}
    for _ in range(args.repeats):
        for name, c in compiled.items():
            jax.block_until_ready(c(q, k, v, e))
            start = time.perf_counter()
            jax.block_until_ready(c(q, k, v, e))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["softmax chunked"])
    print(f"L={args.length} heads={args.heads} block={args.block} {jax.devices()[0].platform}")
    print("| cell | temp MiB | median s (fwd+bwd) | x softmax chunked |")
    print("|---|---|---|---|")
    for name in temp:
        if name in times:
            med = statistics.median(times[name])
            row = f"| {name} | {temp[name] / MIB:.1f} | {med:.4f} | {med / base:.2f} |"
        else:
            row = f"| {name} | {temp[name] / MIB:.1f} | over --max-gib | |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
