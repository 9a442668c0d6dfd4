"""Decoding throughput: cross-attention keys/values cached against recomputed.

Greedy and beam search on random-weight models, `cross_cache=True` (projected
once a call) and False (every step) in alternating rounds, their tokens checked
equal; the last column counts the matrix products in one step of XLA's compiled
loop (XLA may hoist the projection out itself). docs/benchmarks.md, "Decoding".

    python benchmarks/decode.py --sizes smoke numbers small small-mqa
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (reads --platform before jax starts)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _profile import parse_hlo  # noqa: E402

from jattn.models import Transformer, TransformerConfig, decoding  # noqa: E402

VOCAB = 1000
# name -> (d_model, heads, kv heads, layers per stack, d_ff); None: configs/smoke.py's model
SIZES = dict(smoke=None, numbers=(64, 4, 4, 2, 256), small=(128, 4, 4, 2, 512))
SIZES["small-mqa"] = (128, 4, 1, 2, 512)


def model_config(name: str, max_len: int) -> TransformerConfig:
    """The named size with sinusoidal positions and no dropout."""
    if SIZES[name] is None:
        from jattn.train import build_model_config  # noqa: PLC0415
        from jattn.train.config import load_config  # noqa: PLC0415

        cfg = build_model_config(load_config(str(h.ROOT / "configs" / "smoke.py")), VOCAB)
        return dataclasses.replace(cfg, vocab_size=VOCAB, max_len=max_len, dropout_rate=0.0)
    d, n, k, layers, f = SIZES[name]
    sizes = dict(d_model=d, num_heads=n, num_kv_heads=k, num_layers=layers, d_ff=f)
    kw = dict(dropout_rate=0.0, max_len=max_len, position="sinusoidal")
    return TransformerConfig(vocab_size=VOCAB, **sizes, **kw)


def source_batch(rows: int, length: int, seed: int = 0) -> np.ndarray:
    """int `[rows, length]` random tokens, each row padded after a random length >= length/2."""
    rng = np.random.default_rng(seed)
    x = rng.integers(2, VOCAB, (rows, length)).astype(np.int32)
    for i, n in enumerate(rng.integers(length // 2, length + 1, rows)):
        x[i, n:] = 0
    return x


def loop_dots(hlo: str) -> int:
    """`dot` ops inside the while loops of compiled HLO text (`_profile.parse_hlo`),
    following the computations they call (fusions, nested loops, conditions)."""
    instructions, computations = parse_hlo(hlo)
    todo, seen = [c for i in instructions.values() if i.opcode == "while" for c in i.calls], set()
    while todo:
        if (comp := todo.pop()) not in seen:
            seen.add(comp)
            todo += [c for n in computations.get(comp, []) for c in instructions[n].calls]
    return sum(instructions[n].opcode == "dot" for c in seen for n in computations.get(c, []))


def bench(name: str, args) -> list[dict]:
    cfg = model_config(name, max(args.source, args.steps))
    model = Transformer(cfg)
    x = jnp.asarray(source_batch(args.batch, args.source))
    y = jnp.ones((1, args.steps), jnp.int32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x[:1], y)["params"])
    heads = f"{cfg.num_heads}/{cfg.num_kv_heads} heads"
    size = f"{name} (d{cfg.d_model}, {heads}, {cfg.num_layers}+{cfg.num_layers}L)"
    beam = (jnp.float32(0.6), args.steps, args.beam)
    searches = {  # name -> (jitted search, its arguments after model, params, inputs)
        "greedy": (decoding.greedy_search, (args.steps,)),
        f"beam {args.beam}": (decoding.beam_search_with_scores, beam),
    }
    rows = []
    for search, (fn, rest) in searches.items():
        runs = []
        for cached in (False, True):
            search_fn = functools.partial(fn, model, cross_cache=cached)
            call = jax.jit(lambda p, x, f=search_fn, rest=rest: f(p, x, *rest))
            t0 = time.perf_counter()
            out = jax.block_until_ready(call(params, x))  # the first call compiles
            runs.append(dict(call=call, compile_s=time.perf_counter() - t0, out=out))
            runs[-1]["dots"] = loop_dots(call.lower(params, x).compile().as_text())
        if not np.array_equal(runs[0]["out"][0], runs[1]["out"][0]):
            raise SystemExit(f"{name} {search}: the cached path decoded different tokens")
        # The two paths alternate (and their order), so drift in the machine's speed hits both.
        cells = [lambda call=run["call"]: call(params, x) for run in runs]
        times = h.rounds(cells, args.repeats, warm=False, alternate=True)
        for cached, run, t in zip((False, True), runs, times, strict=True):
            sec, steps = statistics.median(t), int(run["out"][-1])
            rows.append(
                dict(size=size, search=search, path="cached" if cached else "recompute",
                     compile_s=run["compile_s"], ms=1e3 * sec, steps=steps, steps_per_s=steps / sec,
                     tokens_per_s=args.batch * steps / sec, dots=run["dots"])
            )  # fmt: skip
            print(f"{size} {search} {rows[-1]['path']}: {1e3 * sec:.1f} ms", flush=True)
        rows[-1]["speedup"] = rows[-2]["ms"] / rows[-1]["ms"]
    return rows


def render(rows: list[dict]) -> str:
    out = [
        [r["size"], r["search"], r["path"], f"{r['compile_s']:.1f}", f"{r['ms']:,.1f}", r["steps"],
         f"{r['steps_per_s']:,.1f}", f"{r['tokens_per_s']:,.0f}", f"{r.get('speedup', 1.0):.2f}x",
         r["dots"]]
        for r in rows
    ]  # fmt: skip
    header = ["size", "search", "path", "compile s", "ms/call", "steps", "steps/s", "tokens/s"]
    return h.table([*header, "speed-up", "dots in loop"], out, "lllrrrrrrr")


def main(argv=None) -> int:
    p = h.parser(__doc__)
    p.add_argument("--repeats", type=int, default=7, help="timed calls of each path")
    sizes = ["smoke", "numbers", "small"]
    p.add_argument("--sizes", nargs="+", default=sizes, choices=SIZES, help="model sizes")
    p.add_argument("--batch", type=int, default=32, help="source rows B")
    p.add_argument("--source", type=int, default=64, help="source length S")
    p.add_argument("--steps", type=int, default=64, help="target steps (max_length)")
    p.add_argument("--beam", type=int, default=4, help="beam size W")
    args = h.parse(p, argv)
    rows = [r for name in args.sizes for r in bench(name, args)]
    print(f"\nbatch {args.batch}, source length {args.source}, {args.steps} target steps, "
          f"beam {args.beam}, {jax.devices()[0].platform}, jax {jax.__version__}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")  # fmt: skip
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
