"""Decoding throughput: cross-attention keys/values cached against recomputed.

    python benchmarks/decode.py                       # smoke, numbers, small
    python benchmarks/decode.py --sizes small --repeats 5
    jattn bench decode --batch 32 --source 64 --steps 64

Greedy and beam search (`jattn.decoding`) on random-weight models, each in
both paths in the same process: `cross_cache=True` (the default: the encoder
output is projected into every decoder layer's cross-attention keys/values
once per decode call) and `cross_cache=False` (projected again at every step,
as before the cache). The tokens of the two paths are checked to be equal.
The vocabulary is large enough (1000) that random weights rarely pick EOS,
so every call runs all `--steps` steps; the steps actually run are reported.

Reported per (size, search, path): compile seconds (first call), the
median wall time of a decode call over `--repeats` rounds that alternate
the two paths (encoder, prefill and the step loop; the source is encoded in
both paths), decoder steps a
second and target tokens a second (rows × steps / time, beams not counted),
the cached path's speed-up, and the matrix products of one step of XLA's
compiled loop (`dot` ops in the while body, fusions followed).

That last column matters: XLA's while-loop invariant code motion may hoist
the recompute path's projection out of the loop by itself, and then both
paths compile to the same loop. To see what recomputing costs where the
compiler does not, run with the pass off:

    XLA_FLAGS=--xla_disable_hlo_passes=while-loop-invariant-code-motion \\
        python benchmarks/decode.py

The table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _platform import HELP as PLATFORM_HELP  # noqa: E402
from _platform import select_platform  # noqa: E402

select_platform()  # where it is started, unless --platform names one

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jattn.cli.common import normalize_flags  # noqa: E402
from jattn.models import Transformer, TransformerConfig, decoding  # noqa: E402

VOCAB = 1000
# name -> (d_model, heads, kv heads, layers per stack, d_ff); None: configs/smoke.py's model
SIZES = {
    "smoke": None,
    "numbers": (64, 4, 4, 2, 256),
    "small": (128, 4, 4, 2, 512),
    "small-mqa": (128, 4, 1, 2, 512),
}


def model_config(name: str, max_len: int) -> TransformerConfig:
    """The named size with sinusoidal positions and no dropout."""
    if SIZES[name] is None:
        from jattn.train import build_model_config  # noqa: PLC0415
        from jattn.train.config import load_config  # noqa: PLC0415

        cfg = build_model_config(load_config("configs/smoke.py"), VOCAB)
        return dataclasses.replace(cfg, vocab_size=VOCAB, max_len=max_len, dropout_rate=0.0)
    d, n, k, layers, f = SIZES[name]
    return TransformerConfig(
        vocab_size=VOCAB,
        d_model=d,
        num_heads=n,
        num_kv_heads=k,
        num_layers=layers,
        d_ff=f,
        dropout_rate=0.0,
        max_len=max_len,
        position="sinusoidal",
    )


def source_batch(rows: int, length: int, seed: int = 0) -> np.ndarray:
    """int `[rows, length]` random tokens, each row padded after a random length >= length/2."""
    rng = np.random.default_rng(seed)
    x = rng.integers(2, VOCAB, (rows, length)).astype(np.int32)
    for i, n in enumerate(rng.integers(length // 2, length + 1, rows)):
        x[i, n:] = 0
    return x


def loop_dots(hlo: str) -> int:
    """`dot` ops inside the while loops of compiled HLO text, following the
    computations they call (fusions, nested loops, conditionals)."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    callee = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\s]+)")

    def count(comp: str, seen: set) -> int:
        if comp in seen or comp not in comps:
            return 0
        seen.add(comp)
        n = 0
        for line in comps[comp]:
            n += len(re.findall(r" dot\(", line))
            for group in callee.findall(line):
                for sub in group.rstrip(",").split(","):
                    n += count(sub.strip().lstrip("%"), seen)
        return n

    bodies = {
        body for lines in comps.values() for line in lines
        for body in re.findall(r"\bbody=%?([\w.\-]+)", line)
    }  # fmt: skip
    seen: set = set()
    return sum(count(body, seen) for body in sorted(bodies))


def first_call(fn) -> tuple[float, object]:
    """Seconds of the first (compiling) call and its result."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t0, out


def bench(name: str, args) -> list[dict]:
    cfg = model_config(name, max(args.source, args.steps))
    model = Transformer(cfg)
    x = jnp.asarray(source_batch(args.batch, args.source))
    y = jnp.ones((1, args.steps), jnp.int32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x[:1], y)["params"])
    size = (
        f"{name} (d{cfg.d_model}, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
        f"{cfg.num_layers}+{cfg.num_layers}L)"
    )
    searches = {  # name -> (jitted search, its arguments after model, params, inputs)
        "greedy": (decoding.greedy_search, (args.steps,)),
        f"beam {args.beam}": (
            decoding.beam_search_with_scores,
            (jnp.float32(0.6), args.steps, args.beam),
        ),
    }
    rows = []
    for search, (fn, rest) in searches.items():
        runs = {}
        for cached in (False, True):
            call = jax.jit(
                lambda p, x, fn=fn, rest=rest, c=cached: fn(model, p, x, *rest, cross_cache=c)
            )
            compile_s, out = first_call(lambda call=call: call(params, x))
            dots = loop_dots(call.lower(params, x).compile().as_text())
            runs[cached] = dict(call=call, compile_s=compile_s, out=out, dots=dots, times=[])
        if not np.array_equal(runs[False]["out"][0], runs[True]["out"][0]):
            raise SystemExit(f"{name} {search}: the cached path decoded different tokens")
        # Rounds alternate the two paths (and their order), so drift in this
        # machine's speed hits both alike.
        for r in range(args.repeats):
            for cached in (False, True) if r % 2 == 0 else (True, False):
                t0 = time.perf_counter()
                jax.block_until_ready(runs[cached]["call"](params, x))
                runs[cached]["times"].append(time.perf_counter() - t0)
        for cached in (False, True):
            run = runs[cached]
            sec, steps = statistics.median(run["times"]), int(run["out"][-1])
            rows.append(
                dict(
                    size=size,
                    search=search,
                    path="cached" if cached else "recompute",
                    compile_s=run["compile_s"],
                    ms=1e3 * sec,
                    steps=steps,
                    steps_per_s=steps / sec,
                    tokens_per_s=args.batch * steps / sec,
                    dots=run["dots"],
                )
            )
            print(f"{size} {search} {rows[-1]['path']}: {1e3 * sec:.1f} ms", flush=True)
        rows[-1]["speedup"] = rows[-2]["ms"] / rows[-1]["ms"]
    return rows


def render(rows: list[dict]) -> str:
    out = [
        "| size | search | path | compile s | ms/call | steps | steps/s | tokens/s | speed-up "
        "| dots in loop |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "1.00x"
        out.append(
            f"| {r['size']} | {r['search']} | {r['path']} | {r['compile_s']:.1f} | "
            f"{r['ms']:,.1f} | {r['steps']} | {r['steps_per_s']:,.1f} | "
            f"{r['tokens_per_s']:,.0f} | {speedup} | {r['dots']} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        nargs="+",
        default=["smoke", "numbers", "small"],
        choices=SIZES,
        help="model sizes (default smoke numbers small)",
    )
    p.add_argument("--platform", default=None, help=PLATFORM_HELP)
    p.add_argument("--batch", type=int, default=32, help="source rows B")
    p.add_argument("--source", type=int, default=64, help="source length S")
    p.add_argument("--steps", type=int, default=64, help="target steps (max_length)")
    p.add_argument("--beam", type=int, default=4, help="beam size W")
    p.add_argument("--repeats", type=int, default=7, help="timed calls of each path")
    args = p.parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    rows = [r for name in args.sizes for r in bench(name, args)]
    print()
    print(
        f"batch {args.batch}, source length {args.source}, {args.steps} target steps, "
        f"beam {args.beam}, {jax.devices()[0].platform}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
