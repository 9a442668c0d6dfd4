"""Memory accounting for a Transformer config: attention logits per layer and
the decoding KV cache, counted in closed form and checked against XLA.

    python benchmarks/memory.py --config base --lengths 512 2048 8192
    jattn bench memory --out docs/memory.md

Two tables:

1. Attention logits of one layer (encoder self-attention, T = S = L, and the
   causal decoder self-attention) for the xla, chunked and Pallas paths, with
   XLA's compiled temporary memory of the xla path (compiled, never run, so
   large L costs nothing) and the ratio of the two.
2. KV cache of greedy decoding for the same model as MHA, GQA (kv heads =
   heads / 4) and MQA, at each context length: the formula, and the bytes of
   the "cache" collection the model itself allocates (`jax.eval_shape` of
   `jattn.decoding.init_cache`).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from jattn.attention import memory
from jattn.cli.common import normalize_flags

MIB = 2**20


def _model_config(name: str, vocab: int):
    from jattn.models import TransformerConfig  # noqa: PLC0415

    if name == "base":
        return TransformerConfig.base(vocab)
    if name == "big":
        return TransformerConfig.big(vocab)
    if name == "numbers":
        return TransformerConfig(
            vocab_size=vocab,
            d_model=64,
            num_heads=4,
            num_kv_heads=4,
            num_layers=2,
            d_ff=256,
            dropout_rate=0.1,
            max_len=128,
        )
    raise ValueError(f"--config must be base, big or numbers, got {name!r}")


def logits_rows(cfg, lengths, batch, check_xla: bool):
    n, h = cfg.num_heads, cfg.d_model // cfg.num_heads
    rows = []
    for length in lengths:
        for kind, causal in (("encoder self", False), ("decoder self (causal)", True)):
            row = dict(L=length, attention=kind)
            for impl in ("xla", "chunked", "pallas"):
                m = memory.attention_logits_bytes(batch, n, length, length, implementation=impl)
                row[impl] = m.total
            row["xla_compiled"] = None
            if check_xla:
                row["xla_compiled"] = memory.xla_attention_temp_bytes(
                    batch, n, length, length, h, is_causal=causal
                )
            rows.append(row)
    return rows


def cache_rows(cfg, lengths, batch, check_model: bool):
    from dataclasses import replace  # noqa: PLC0415

    from jattn.models import Transformer, decoding  # noqa: PLC0415

    h = cfg.d_model // cfg.num_heads
    variants = (("MHA", cfg.num_heads), ("GQA", max(1, cfg.num_heads // 4)), ("MQA", 1))
    rows = []
    for length in lengths:
        for name, kv in variants:
            formula = memory.kv_cache_bytes(
                num_layers=cfg.num_layers,
                num_kv_heads=kv,
                context=length,
                head_dim=h,
                batch=batch,
                dtype=cfg.compute_dtype,
            )
            model_bytes = None
            if check_model:
                c = replace(cfg, num_kv_heads=kv, max_len=max(cfg.max_len, length))
                shapes = jax.eval_shape(
                    lambda c=c, n=length: decoding.init_cache(Transformer(c), batch, n)
                )
                model_bytes = sum(
                    x.size * x.dtype.itemsize
                    for path, x in jax.tree_util.tree_leaves_with_path(shapes)
                    if "cached_" in jax.tree_util.keystr(path)
                )
            rows.append(
                dict(
                    L=length, variant=f"{name} (kv heads {kv})", formula=formula, model=model_bytes
                )
            )
    return rows


def _mib(x):
    return "-" if x is None else f"{x / MIB:,.1f}"


def render(cfg_name, cfg, batch, lrows, crows) -> str:
    out = [
        f"Model `{cfg_name}`: d_model {cfg.d_model}, {cfg.num_heads} heads, "
        f"{cfg.num_layers}+{cfg.num_layers} layers, batch {batch}, float32.",
        "",
        "Attention logits of one layer (MiB; arrays live at once in the forward pass):",
        "",
        "| L | attention | xla | chunked (512x512 tiles) | pallas (on-chip, per program) "
        "| xla, XLA's compiled figure | formula / XLA |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in lrows:
        ratio = "-" if not r["xla_compiled"] else f"{r['xla'] / r['xla_compiled']:.3f}"
        out.append(
            f"| {r['L']} | {r['attention']} | {_mib(r['xla'])} | {_mib(r['chunked'])} | "
            f"{_mib(r['pallas'])} | {_mib(r['xla_compiled'])} | {ratio} |"
        )
    out += [
        "",
        "KV cache for decoding, all decoder layers (MiB):",
        "",
        "| context | variant | formula | model's cache collection |",
        "|---:|---|---:|---:|",
    ]
    for r in crows:
        out.append(f"| {r['L']} | {r['variant']} | {_mib(r['formula'])} | {_mib(r['model'])} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="base", help="base | big | numbers")
    p.add_argument("--vocab", type=int, default=37000, help="vocabulary size (default 37000)")
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[256, 1024, 4096],
        help="sequence lengths L (default 256 1024 4096)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--no-check", action="store_true", help="formulas only, compile nothing")
    p.add_argument("--out", default=None, help="also write the tables (markdown) here")
    args = p.parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    cfg = _model_config(args.config, args.vocab)
    lrows = logits_rows(cfg, args.lengths, args.batch, not args.no_check)
    crows = cache_rows(cfg, args.lengths, args.batch, not args.no_check)
    text = render(args.config, cfg, args.batch, lrows, crows)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing-free compiles
    sys.exit(main())
