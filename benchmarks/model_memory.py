"""Benchmark: a whole model's compiled temporary memory, one positional scheme
against another, forward and backward.

    python benchmarks/model_memory.py --lengths 4096
    jattn bench model_memory --lengths 2048 4096 --positions none alibi t5 --out runs/bench/mm.md

The encoder-decoder Transformer (1+1 layers, d_model 256, 8 heads, d_ff
1024, vocabulary 1024 by default; no dropout) on `[1, L]` sources and
targets: the gradient of its mean token cross-entropy with respect to every
parameter, through `attention_impl` (default "chunked"). For each scheme in
`--positions` the figure is XLA's `memory_analysis().temp_size_in_bytes` of
the jitted program (compiled, never run, so the machine's load does not
change it and large L costs only compile time), and its ratio to
`position="none"` in the same run.

The peer row "t5, bias materialised" is the T5 scheme as the models built it
before score mods: its bias `[N, L, L]` computed in full
(the table read at every position pair's bucket) and read inside
attention, so it and its gradient are `[T, S]`-sized arrays. It shows what the score
mods save (`--no-materialised` leaves it out), and the fast test in
tests/test_model_memory.py uses it to show that its measure sees such an
array.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp

from jattn import positions as pos_lib
from jattn.cli.common import normalize_flags
from jattn.models import SCHEMES, Transformer, TransformerConfig
from jattn.models.schemes import T5, register
from jattn.score_mod import ScoreMod

MIB = 2**20
POSITIONS = ("none", "rope", "shaw", "alibi", "t5", "fire", "kerple", "xpos")
MATERIALISED = "t5_materialised"


def _read_bias(bias, score, batch, head, i, j):
    """`score + bias[head, i, j]`: a precomputed `[N, L, L]` term read per logit."""
    return score + bias[head, i, j]


@dataclasses.dataclass(frozen=True)
class MaterialisedT5(T5):
    """T5 with its bias built as a `[N, max_len, max_len]` array, its table
    read at every position pair's bucket, as the models did before score mods
    (the same values as T5's score mod), and read per logit."""

    def score_mod(self, module, cfg, site, state):
        table = super().score_mod(module, cfg, site, state).params  # [N, buckets]
        pos = jnp.arange(cfg.max_len, dtype=jnp.int32)
        buckets = pos_lib.t5_relative_bucket(
            pos[None, :] - pos[:, None],  # kv - q
            self.options(cfg).num_buckets,
            self.options(cfg).max_distance,
            bidirectional=not site.causal,
        )  # [L, L]
        bias = jnp.take(table, buckets, axis=1)  # [N, L, L], as the models built it
        return ScoreMod(_read_bias, bias, MATERIALISED)


def materialised_scheme() -> MaterialisedT5:
    """The peer scheme, registered under `MATERIALISED` on first use."""
    if MATERIALISED not in SCHEMES:
        register(MaterialisedT5(MATERIALISED))
    return SCHEMES[MATERIALISED]


def model_config(position: str, length: int, **sizes) -> TransformerConfig:
    """The measured model: 1+1 layers, d_model 256, 8 heads unless `sizes` say otherwise."""
    kw = dict(vocab_size=1024, d_model=256, num_heads=8, num_layers=1, d_ff=1024)
    kw.update(sizes)
    return TransformerConfig(
        **kw, dropout_rate=0.0, max_len=length, position=position, attention_impl="chunked"
    )


def model_temp_bytes(cfg: TransformerConfig, length: int, batch: int = 1) -> int:
    """XLA's compiled temporary bytes of the gradient of the model's loss on
    `[batch, length]` sources and targets (compiled, not run)."""
    model = Transformer(cfg)
    tokens = jnp.ones((batch, length), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, tokens))

    def loss(p, inputs, targets):
        logits = model.apply(p, inputs, targets)  # [B, T, V]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    spec = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def run(args) -> list[dict]:
    names = list(args.positions)
    if "none" not in names:
        names.insert(0, "none")
    if args.materialised:
        materialised_scheme()
        names.append(MATERIALISED)
    sizes = dict(
        vocab_size=args.vocab,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        d_ff=args.d_ff,
    )
    rows = []
    for length in args.lengths:
        for name in names:
            t0 = time.perf_counter()
            cfg = model_config(name, length, **sizes)
            if args.impl:
                cfg = dataclasses.replace(cfg, attention_impl=args.impl)
            temp = model_temp_bytes(cfg, length, args.batch)
            took = time.perf_counter() - t0
            print(f"compiled L={length} {name}: {temp / MIB:,.1f} MiB ({took:.0f} s)", flush=True)
            rows.append(dict(L=length, position=name, temp=temp))
        base = next(r["temp"] for r in rows if r["L"] == length and r["position"] == "none")
        for r in rows:
            if r["L"] == length:
                r["vs_none"] = r["temp"] / base
    return rows


def _label(name: str) -> str:
    return "t5, bias materialised [N,T,S] (before score mods)" if name == MATERIALISED else name


def table(rows) -> str:
    out = [
        "| L | position | compiled temporaries (MiB) | vs none |",
        "|---:|---|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['L']} | {_label(r['position'])} | {r['temp'] / MIB:,.1f} | {r['vs_none']:.2f}x |"
        )
    return "\n".join(out) + "\n"


def main(argv=None):
    argv = normalize_flags(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096], help="L (default 4096)")
    p.add_argument(
        "--positions",
        nargs="+",
        default=list(POSITIONS),
        help=f"schemes (default {' '.join(POSITIONS)}; none is always measured)",
    )
    p.add_argument("--no-materialised", dest="materialised", action="store_false")
    p.add_argument("--impl", default="chunked", help="attention_impl (default chunked)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=1, help="layers per stack (default 1)")
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    head = (
        f"jax {jax.__version__}, backend {jax.default_backend()}; encoder-decoder "
        f"{args.layers}+{args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"d_ff {args.d_ff}, vocab {args.vocab}, batch {args.batch}, float32, "
        f"attention_impl={args.impl!r}, forward+backward"
    )
    print(head, flush=True)
    text = head + "\n\n" + table(run(args))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
