"""Memory a Transformer takes, compiled and never run (so the machine's load does not move it).

Default: a layer's attention logits (xla, chunked, Pallas) counted in closed
form (`jattn.attention.memory`) against XLA's compiled temporaries, and the KV
cache (MHA, GQA, MQA) against the model's own "cache" collection. `--schemes`:
the whole model's temporaries (the gradient of its loss on `[1, L]` rows) with
each scheme, against `position="none"`, and the peer: T5's bias `[N, L, L]`
materialised as before score mods (tests/test_model_memory.py uses it to show
that the measure sees such an array).

    python benchmarks/memory.py --config base --lengths 512 2048 4096 --out docs/memory.md
    python benchmarks/memory.py --schemes --lengths 2048 4096 --positions none alibi t5
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (reads --platform before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jattn import positions as pos_lib  # noqa: E402
from jattn.attention import memory  # noqa: E402
from jattn.models import SCHEMES, Transformer, TransformerConfig, decoding  # noqa: E402
from jattn.models.schemes import T5, register  # noqa: E402
from jattn.score_mod import ScoreMod  # noqa: E402

MIB = 2**20
POSITIONS = ("none", "rope", "shaw", "alibi", "t5", "fire", "kerple", "xpos")
MATERIALISED = "t5_materialised"


def _mib(x) -> str:
    return h.fmt(x and x / MIB, ",.1f")


def config_of(name: str, vocab: int) -> TransformerConfig:
    """`--config`: the base or big model of the paper, or the numbers task's."""
    if name in ("base", "big"):
        return getattr(TransformerConfig, name)(vocab)
    if name == "numbers":
        sizes = dict(d_model=64, num_heads=4, num_kv_heads=4, num_layers=2, d_ff=256)
        return TransformerConfig(vocab_size=vocab, **sizes, dropout_rate=0.1, max_len=128)
    raise ValueError(f"--config must be base, big or numbers, got {name!r}")


def accounting(name: str, cfg, lengths, batch: int, check: bool) -> str:
    """The two tables of the default mode, as markdown."""
    n, hd = cfg.num_heads, cfg.d_model // cfg.num_heads
    logits, cache = [], []
    for length in lengths:
        for kind, causal in (("encoder self", False), ("decoder self (causal)", True)):
            shape = (batch, n, length, length)
            counts = [memory.attention_logits_bytes(*shape, implementation=impl).total
                      for impl in ("xla", "chunked", "pallas")]  # fmt: skip
            xla = check and memory.xla_attention_temp_bytes(*shape, hd, is_causal=causal)
            ratio = f"{counts[0] / xla:.3f}" if xla else "-"
            logits.append([length, kind, *map(_mib, counts), _mib(xla or None), ratio])
        for label, kv in (("MHA", n), ("GQA", max(1, n // 4)), ("MQA", 1)):
            formula = memory.kv_cache_bytes(
                num_layers=cfg.num_layers, num_kv_heads=kv, context=length, head_dim=hd,
                batch=batch, dtype=cfg.compute_dtype,
            )  # fmt: skip
            model = None
            if check:
                c = dataclasses.replace(cfg, num_kv_heads=kv, max_len=max(cfg.max_len, length))
                shapes = jax.eval_shape(partial(decoding.init_cache, Transformer(c), batch, length))
                model = sum(x.size * x.dtype.itemsize
                            for path, x in jax.tree_util.tree_leaves_with_path(shapes)
                            if "cached_" in jax.tree_util.keystr(path))  # fmt: skip
            cache.append([length, f"{label} (kv heads {kv})", _mib(formula), _mib(model)])
    header = ["L", "attention", "xla", "chunked (512x512 tiles)", "pallas (on-chip, per program)"]
    return "\n".join([
        f"Model `{name}`: d_model {cfg.d_model}, {cfg.num_heads} heads, "
        f"{cfg.num_layers}+{cfg.num_layers} layers, batch {batch}, float32.",
        "",
        "Attention logits of one layer (MiB; arrays live at once in the forward pass):",
        "",
        h.table([*header, "xla, XLA's compiled figure", "formula / XLA"], logits, "rlrrrrr"),
        "",
        "KV cache for decoding, all decoder layers (MiB):",
        "",
        h.table(["context", "variant", "formula", "model's cache collection"], cache, "rlrr"),
    ])  # fmt: skip


def _read_bias(bias, score, batch, head, i, j):
    """`score + bias[head, i, j]`: a precomputed `[N, L, L]` term read per logit."""
    return score + bias[head, i, j]


@dataclasses.dataclass(frozen=True)
class MaterialisedT5(T5):
    """T5 with its bias built as `[N, max_len, max_len]` (its table read at every
    position pair's bucket), as the models did before score mods, read per logit."""

    def score_mod(self, module, cfg, site, state):
        table = super().score_mod(module, cfg, site, state).params  # [N, buckets]
        pos, o = jnp.arange(cfg.max_len, dtype=jnp.int32), self.options(cfg)
        rel = pos[None, :] - pos[:, None]  # kv - q: [L, L]
        buckets = pos_lib.t5_relative_bucket(rel, o.num_buckets, o.max_distance, not site.causal)
        bias = jnp.take(table, buckets, axis=1)  # [N, L, L], as the models built it
        return ScoreMod(_read_bias, bias, MATERIALISED)


def materialised_scheme() -> MaterialisedT5:
    """The peer scheme, registered under `MATERIALISED` on first use."""
    if MATERIALISED not in SCHEMES:
        register(MaterialisedT5(MATERIALISED))
    return SCHEMES[MATERIALISED]


def model_config(position: str, length: int, **sizes) -> TransformerConfig:
    """The measured model: 1+1 layers, d_model 256, 8 heads unless `sizes` say otherwise."""
    kw = dict(vocab_size=1024, d_model=256, num_heads=8, num_layers=1, d_ff=1024) | sizes
    kw |= dict(dropout_rate=0.0, max_len=length, position=position, attention_impl="chunked")
    return TransformerConfig(**kw)


def model_temp_bytes(cfg: TransformerConfig, length: int, batch: int = 1) -> int:
    """XLA's compiled temporary bytes of the gradient of the model's loss on
    `[batch, length]` sources and targets (compiled, not run)."""
    model = Transformer(cfg)
    tokens = jnp.ones((batch, length), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, tokens))

    def loss(p, inputs, targets):
        logp = jax.nn.log_softmax(model.apply(p, inputs, targets).astype(jnp.float32))  # [B, T, V]
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    spec = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def schemes(args) -> str:
    """The table of `--schemes`, as markdown."""
    names = ["none"] * ("none" not in args.positions) + list(args.positions)
    if args.materialised:
        materialised_scheme()
        names.append(MATERIALISED)
    sizes = dict(vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads)
    sizes.update(num_layers=args.layers, d_ff=args.d_ff)
    rows = []
    for length in args.lengths:
        temps = {}
        for name in names:
            t0 = time.perf_counter()
            cfg = dataclasses.replace(model_config(name, length, **sizes), attention_impl=args.impl)
            temps[name] = model_temp_bytes(cfg, length, args.batch)
            took = time.perf_counter() - t0
            print(f"compiled L={length} {name}: {_mib(temps[name])} MiB ({took:.0f} s)", flush=True)
        peer = {MATERIALISED: "t5, bias materialised [N,T,S] (before score mods)"}
        for name, temp in temps.items():
            rows.append([length, peer.get(name, name), _mib(temp), f"{temp / temps['none']:.2f}x"])
    return h.table(["L", "position", "compiled temporaries (MiB)", "vs none"], rows, "rlrr")


def main(argv=None):
    p = h.parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", help="L (default 256 1024 4096; schemes 4096)")
    p.add_argument("--batch", type=int, default=1, help="rows B")
    p.add_argument("--vocab", type=int, help="vocabulary (default 37000; --schemes 1024)")
    p.add_argument("--out", default=None, help="also write the tables (markdown) here")
    p.add_argument("--config", default="base", help="base | big | numbers")
    p.add_argument("--no-check", action="store_true", help="formulas only, compile nothing")
    p.add_argument("--schemes", action="store_true", help="a whole model's, scheme by scheme")
    p.add_argument("--positions", nargs="+", default=list(POSITIONS), help="--schemes: schemes")
    p.add_argument("--no-materialised", dest="materialised", action="store_false", help="no peer")
    p.add_argument("--impl", default="chunked", help="--schemes: attention_impl")
    for flag, default in (("--d-model", 256), ("--heads", 8), ("--d-ff", 1024), ("--layers", 1)):
        p.add_argument(flag, type=int, default=default, help="--schemes: the model's")
    args = h.parse(p, argv)
    if args.schemes:
        args.lengths, args.vocab = args.lengths or [4096], args.vocab or 1024
        head = (f"jax {jax.__version__}, backend {jax.default_backend()}; encoder-decoder "
                f"{args.layers}+{args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
                f"d_ff {args.d_ff}, vocab {args.vocab}, batch {args.batch}, float32, "
                f"attention_impl={args.impl!r}, forward+backward")  # fmt: skip
        print(head, flush=True)
        text = f"\n{head}\n\n{schemes(args)}\n"
    else:
        cfg = config_of(args.config, args.vocab or 37000)
        lengths = args.lengths or [256, 1024, 4096]
        text = accounting(args.config, cfg, lengths, args.batch, not args.no_check) + "\n"
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text.lstrip("\n"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
