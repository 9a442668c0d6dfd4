"""Train-step throughput: jattn's Transformer against the same model from flax stock layers,
or (`--peak`) one config's train step against this machine's matmul rate.

    jattn bench train                     # a few sizes, this machine
    jattn bench train --sizes numbers --steps 30
    jattn bench train --peak --config configs/reverse_digits.py
    jattn bench train --peak --config configs/kazemnejad.py:copy,sinusoidal \
        --config.model.architecture=decoder_only

`--peak`: the train step a real run takes (`benchmarks/_step.py`), its flop
count (XLA's cost analysis of the compiled step), its time (fastest of
`--rounds` rounds of `--steps` steps), the same process's float32 matmul rate
on `--matmul-size` square operands (fastest of the same rounds, interleaved
with the step's so both see the same machine load), and the ratio of the
step's flop rate to the matmul rate: the headline, since on a shared machine
both halves slow down together. Then a `jax.profiler` trace of
`--profile-steps` steps, classified by XLA op category
(`benchmarks/_profile.py`), and the largest category that is not arithmetic.

Both models are the paper's post-norm encoder-decoder with shared, scaled
embeddings and sinusoidal positions, of the same sizes; the stock one is
built from `nn.Embed`, `nn.MultiHeadDotProductAttention`, `nn.Dense`,
`nn.LayerNorm` and `nn.Dropout`, with flax's boolean masks for padding,
packing (segment ids) and causality. Both are trained by the same jitted
step (`jattn.train.steps.make_train_step`: label-smoothed cross entropy,
Adam, dropout on) on the same packed batches of the `numbers` task, in the
same process. Reported: compile time, milliseconds a step (median of the
timed steps), and tokens a second (non-padding source + target tokens).
The table is printed last.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _platform import HELP as PLATFORM_HELP  # noqa: E402
from _platform import select_platform  # noqa: E402

select_platform()  # where it is started, unless --platform names one

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _profile import ARITHMETIC, CATEGORIES, breakdown  # noqa: E402
from _step import build_step, device_batch  # noqa: E402

from jattn import data as data_lib  # noqa: E402
from jattn.cli.common import load_config_from_args, parse_with_overrides  # noqa: E402
from jattn.models import Transformer, TransformerConfig  # noqa: E402
from jattn.positions import sinusoidal  # noqa: E402
from jattn.train import steps  # noqa: E402
from jattn.train.config import ConfigError  # noqa: E402

# name -> (d_model, heads, layers per stack, d_ff, rows, max_len)
SIZES = {
    "numbers": (64, 4, 2, 256, 32, 64),
    "small": (128, 4, 2, 512, 16, 128),
    "medium": (256, 8, 3, 1024, 8, 256),
}


class StockLayer(nn.Module):
    """One post-norm encoder (cross=False) or decoder (cross=True) layer of stock flax layers."""

    config: TransformerConfig
    cross: bool

    @nn.compact
    def __call__(self, x, self_mask, encoded=None, cross_mask=None, *, train: bool):
        cfg = self.config

        def mha(name):
            return nn.MultiHeadDotProductAttention(
                num_heads=cfg.num_heads,
                qkv_features=cfg.d_model,
                out_features=cfg.d_model,
                use_bias=False,
                dropout_rate=0.0,
                deterministic=True,
                name=name,
            )

        def block(x, h, name):
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=not train)
            return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, name=name)(x + h)

        x = block(x, mha("self_attention")(x, x, mask=self_mask), "self_attention_norm")
        if self.cross:
            h = mha("cross_attention")(x, encoded, mask=cross_mask)
            x = block(x, h, "cross_attention_norm")
        h = nn.Dense(cfg.d_ff, name="wi")(x)
        h = nn.Dense(cfg.d_model, name="wo")(nn.relu(h))
        return block(x, h, "mlp_norm")


class StockTransformer(nn.Module):
    """The same encoder-decoder as `jattn.models.Transformer(config)`, from stock layers."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        inputs,
        targets,
        *,
        inputs_segment_ids,
        targets_segment_ids,
        inputs_positions,
        targets_positions,
        train: bool = False,
    ):
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.d_model**-0.5)
        )

        def embed_and_position(tokens, positions):
            x = embed(tokens) * math.sqrt(cfg.d_model) + sinusoidal(positions, cfg.d_model)
            return nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)

        # Masks [B, 1, T, S]: same segment, not padding, and (decoder) causal.
        enc_mask = nn.combine_masks(
            nn.make_attention_mask(inputs_segment_ids, inputs_segment_ids, jnp.equal),
            nn.make_attention_mask(inputs_segment_ids > 0, inputs_segment_ids > 0),
        )
        dec_mask = nn.combine_masks(
            nn.make_attention_mask(targets_segment_ids, targets_segment_ids, jnp.equal),
            nn.make_attention_mask(targets_segment_ids > 0, targets_segment_ids > 0),
            nn.make_causal_mask(targets),
        )
        cross_mask = nn.combine_masks(
            nn.make_attention_mask(targets_segment_ids, inputs_segment_ids, jnp.equal),
            nn.make_attention_mask(targets_segment_ids > 0, inputs_segment_ids > 0),
        )
        x = embed_and_position(inputs, inputs_positions)
        for i in range(cfg.num_layers):
            x = StockLayer(cfg, cross=False, name=f"encoder_{i}")(x, enc_mask, train=train)
        # Shift right within each packed segment: position 0 gets the start token 0.
        shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
        shifted = jnp.where(targets_positions == 0, 0, shifted)
        y = embed_and_position(shifted, targets_positions)
        for i in range(cfg.num_layers):
            y = StockLayer(cfg, cross=True, name=f"decoder_{i}")(
                y, dec_mask, x, cross_mask, train=train
            )
        return embed.attend(y).astype(jnp.float32)


def batches(rows: int, max_len: int, count: int) -> tuple[list[dict[str, np.ndarray]], int]:
    task = data_lib.load("numbers")
    it = iter(data_lib.make_loader(task, "train", batch_size=rows, max_len=max_len, seed=0))
    return [next(it) for _ in range(count)], task.tokenizer.vocab_size


def prepare(model, data) -> dict:
    """Initialises `model` and compiles the shared train step (timed)."""
    tx = optax.adam(1e-3, b1=0.9, b2=0.98, eps=1e-9)
    step_fn = jax.jit(
        steps.make_train_step(model, tx, lambda c: 1e-3, label_smoothing=0.1),
        donate_argnums=(0,),
    )
    first = {k: jnp.asarray(v) for k, v in data[0].items()}
    params = model.init(
        jax.random.key(0),
        first["inputs"],
        first["targets"],
        **steps.model_kwargs(first),
    )["params"]
    params = nn.meta.unbox(params)
    state = steps.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(1)),
    )
    t0 = time.perf_counter()
    state, m = step_fn(state, first)
    jax.block_until_ready(m)
    return {
        "step_fn": step_fn,
        "state": state,
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "compile_s": time.perf_counter() - t0,
        "times": [],
        "tokens": [],
        "loss": float(m["loss"]),
    }


def time_steps(run: dict, data, count: int) -> None:
    """Times `count` more steps of a prepared run (appends to its lists)."""
    for _ in range(count):
        batch = {k: jnp.asarray(v) for k, v in data[(len(run["times"]) + 1) % len(data)].items()}
        t0 = time.perf_counter()
        run["state"], m = run["step_fn"](run["state"], batch)
        jax.block_until_ready(m)
        run["times"].append(time.perf_counter() - t0)
        run["tokens"].append(float(m["tokens"]))
    run["loss"] = float(m["loss"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jattn bench train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default=None, help=PLATFORM_HELP)
    parser.add_argument("--sizes", default="numbers,small", help=f"from {sorted(SIZES)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, models interleaved")
    parser.add_argument("--impl", default="xla", help="jattn attention_impl (xla, chunked)")
    parser.add_argument(
        "--peak",
        action="store_true",
        help="time --config's train step against this process's fp32 matmul rate, "
        "with a profiler breakdown (--config.key=value overrides apply)",
    )
    parser.add_argument("--config", help="with --peak: config spec, e.g. configs/reverse_digits.py")
    parser.add_argument(
        "--matmul-size", type=int, default=2048, help="with --peak: N of the NxN @ NxN matmul"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=5, help="with --peak: steps in the profiler trace"
    )
    args, overrides = parse_with_overrides(parser, argv if argv is not None else sys.argv[1:])
    if args.peak:
        if not args.config:
            parser.error("--peak needs --config FILE[:ARG]")
        if min(args.steps, args.rounds, args.matmul_size, args.profile_steps) < 1:
            parser.error("--steps, --rounds, --matmul-size and --profile-steps must be at least 1")
        peak(args, overrides)
        return 0
    if overrides:
        parser.error("--config.key=value overrides go with --peak")
    rows_out = []
    for name in args.sizes.split(","):
        d, h, layers, ff, rows, max_len = SIZES[name]
        data, vocab = batches(rows, max_len, 8)
        config = TransformerConfig(
            vocab_size=math.ceil(vocab / 8) * 8,
            d_model=d,
            num_heads=h,
            num_layers=layers,
            d_ff=ff,
            max_len=max_len,
            dropout_rate=0.1,
            position="sinusoidal",
            attention_impl=args.impl,
        )
        runs = {
            "jattn": prepare(Transformer(config), data),
            "flax stock": prepare(StockTransformer(config), data),
        }
        # Interleave the models round by round (order alternating), so machine
        # noise hits both alike; each round also gives a paired time ratio.
        ratios = []
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            before = {k: len(v["times"]) for k, v in runs.items()}
            for model_name in order:
                time_steps(runs[model_name], data, args.steps)
            med = {k: statistics.median(v["times"][before[k] :]) for k, v in runs.items()}
            ratios.append(med["jattn"] / med["flax stock"])
            print(
                f"{name:8s} round {r}: jattn {med['jattn'] * 1e3:7.2f} ms, "
                f"flax stock {med['flax stock'] * 1e3:7.2f} ms",
                flush=True,
            )
        for model_name, run in runs.items():
            ms = statistics.median(run["times"]) * 1e3
            ratio = statistics.median(ratios) if model_name == "jattn" else 1.0
            rows_out.append((name, model_name, run, ms, ratio))

    print()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores; "
        f"{args.rounds} interleaved rounds of {args.steps} steps after compilation; "
        f"jattn attention_impl={args.impl}; time ratio = median over rounds of "
        "jattn / flax stock"
    )
    header = "| size | model | params | compile s | ms/step | tokens/s | time ratio | loss |"
    print(header)
    print("|" + "---|" * 8)
    for name, model_name, run, ms, ratio in rows_out:
        d, h, layers, ff, rows, max_len = SIZES[name]
        label = f"{name} (d{d}, {layers}+{layers}L, {rows}x{max_len})"
        tok_s = statistics.mean(run["tokens"]) / (ms / 1e3)
        print(
            f"| {label} | {model_name} | {run['params']:,} | {run['compile_s']:.1f} | "
            f"{ms:.2f} | {tok_s:,.0f} | {ratio:.2f} | {run['loss']:.3f} |"
        )
    return 0


# -- --peak: one config's step against the machine ---------------------------------------


def _load() -> str:
    """The 1-minute load average (what else this shared machine is running)."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def _flops(compiled) -> float:
    """XLA's flop count of a compiled program (`cost_analysis`, a dict or a list of one)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost["flops"])


def measure_peak(config, *, steps: int, rounds: int, matmul_size: int) -> dict:
    """The step's flops and fastest time, and the fp32 matmul rate, rounds interleaved.

    Returns a dict with the compiled step, a state and batches to run it on, and
    ``flops``, ``step_s`` (fastest round, seconds a step), ``matmul_flops``,
    ``matmul_s`` (fastest round), ``rows`` (the batch shape, text).
    """
    b = build_step(config, 1, steps)
    batches = [device_batch(seeds[0]) for seeds in b["batches"]]
    compiled = jax.jit(b["step"], donate_argnums=(0,)).lower(b["states"][0], batches[0]).compile()
    state, _ = compiled(b["states"][0], batches[0])  # warm: the first run allocates
    jax.block_until_ready(state)
    n = matmul_size
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32)
    w = jax.random.normal(kb, (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul).lower(a, w).compile()  # [N, N] @ [N, N], float32
    matmul(a, w).block_until_ready()
    step_s, matmul_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        matmul(a, w).block_until_ready()
        matmul_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for x in batches:  # dispatched back to back, as a run's loop does
            state, _ = compiled(state, x)
        jax.block_until_ready(state)
        step_s.append((time.perf_counter() - t0) / len(batches))
    (rows, s), t = batches[0]["inputs"].shape, batches[0]["targets"].shape[1]
    return {
        "compiled": compiled,
        "state": state,
        "batches": batches,
        "flops": _flops(compiled),
        "step_s": min(step_s),
        "matmul_flops": 2.0 * n**3,
        "matmul_s": min(matmul_s),
        "rows": f"{rows}x({s}+{t})",
    }


def profile_step(run: dict, steps: int) -> dict:
    """`_profile.breakdown` of a `jax.profiler` trace of `steps` more steps of `run`."""
    compiled, state, batches = run["compiled"], run["state"], run["batches"]
    text = compiled.as_text()
    module = text.split(None, 2)[1].rstrip(",")  # "HloModule jit_train_step, ..."
    with tempfile.TemporaryDirectory(prefix="jattn_peak_") as log_dir:
        with jax.profiler.trace(log_dir):
            for i in range(steps):
                state, _ = compiled(state, batches[i % len(batches)])
            jax.block_until_ready(state)
        run["state"] = state
        return breakdown(log_dir, text, module, steps)


def peak_tables(spec: str, overrides, run: dict, prof: dict, *, rounds: int, steps: int) -> str:
    """The measures table and the breakdown table, as markdown, with the largest
    cost that is not arithmetic named under them."""
    step_rate = run["flops"] / run["step_s"]
    mm_rate = run["matmul_flops"] / run["matmul_s"]
    n = round((run["matmul_flops"] / 2) ** (1 / 3))
    extra = "".join(f" --config.{k}={v}" for k, v in overrides)
    lines = [
        f"`--config {spec}{extra}`, rows {run['rows']}; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cores",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| step flops (XLA cost analysis) | {run['flops'] / 1e9:.3f} GFLOP |",
        f"| step time (fastest of {rounds} rounds of {steps} steps) | "
        f"{run['step_s'] * 1e3:.2f} ms |",
        f"| step flop rate | {step_rate / 1e9:.2f} GFLOP/s |",
        f"| fp32 matmul {n}x{n} @ {n}x{n} (fastest of {rounds}) | "
        f"{run['matmul_s'] * 1e3:.1f} ms, {mm_rate / 1e9:.2f} GFLOP/s |",
        f"| ratio (step flop rate / matmul rate) | {step_rate / mm_rate:.3f} |",
        "",
        f"Breakdown: `jax.profiler` trace of {prof['steps']} steps, "
        f"{prof['window_ns'] / 1e6:.2f} ms a step traced; {prof['ops']} op events, "
        f"{prof['unknown']} not found in the module",
        "",
        "| category | ms/step | share |",
        "|---|---:|---:|",
    ]
    window = prof["window_ns"]
    for cat in CATEGORIES:
        ns = prof["ns"][cat]
        lines.append(f"| {cat} | {ns / 1e6:.2f} | {100 * ns / window:.1f}% |")
    rest = {c: prof["ns"][c] for c in CATEGORIES if c not in ARITHMETIC}
    worst = max(rest, key=rest.get)
    arith = sum(prof["ns"][c] for c in ARITHMETIC)
    lines += ["", "Costliest instructions (exclusive ms a step traced):", ""]
    lines += ["| ms/step | instruction | category | jax op_name |", "|---:|---|---|---|"]
    for t, name, cat, where in prof["top"]:
        where = where.replace("|", "/")
        where = where if len(where) <= 110 else "..." + where[-107:]
        lines.append(f"| {t / 1e6:.2f} | {name} | {cat} | `{where}` |")
    lines += [
        "",
        f"arithmetic (matmuls and attention dots): {100 * arith / window:.1f}% of the step; "
        f"largest cost that is not arithmetic: {worst} ({100 * rest[worst] / window:.1f}%)",
    ]
    return "\n".join(lines)


def peak(args, overrides) -> None:
    """`--peak`: measures, profiles and prints the two tables for `args.config`."""
    load_before = _load()
    try:
        config = load_config_from_args(args.config, overrides)
    except ConfigError as e:
        print(f"jattn bench train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    run = measure_peak(config, steps=args.steps, rounds=args.rounds, matmul_size=args.matmul_size)
    prof = profile_step(run, args.profile_steps) | {"steps": args.profile_steps}
    print(f"load average (1 min): {load_before} before, {_load()} after", flush=True)
    print()
    print(peak_tables(args.config, overrides, run, prof, rounds=args.rounds, steps=args.steps))


if __name__ == "__main__":
    sys.exit(main())
