"""Train-step time: jattn's Transformer against stock flax layers, a config's arms, the machine.

Default: the post-norm encoder-decoder built from jattn's layers and from
flax's stock ones (`nn.MultiHeadDotProductAttention` and boolean masks), one
jitted step training both on the same `numbers` batches, alternating step by
step. Arms (`NAME:key=value,...`, overrides of `--config`): each arm's step as a
real run takes it (`_harness.train_steps`), the arms alternating in rounds
(only arms timed side by side compare on this machine), against the first arm,
its final state compared bit for bit. `--allocator`: glibc's defaults against
`jattn.train.allocator.tune_host_allocator`, a process each. `--peak`: the
step's flop rate against the fp32 matmul rate timed in the same rounds, then a
`jax.profiler` trace by op category (`_profile.py`). `--data`: the input
pipeline's throughput and packing, what feeds the step. docs/benchmarks.md reads each.

    python benchmarks/train.py --sizes numbers --steps 30
    python benchmarks/train.py --config configs/scan.py:shaw "rows 64:" \\
        "rows 32:max_len=32,max_input_len=20,batch_size=32"
    python benchmarks/train.py --allocator --config configs/reverse_digits.py
    python benchmarks/train.py --peak --config configs/reverse_digits.py
    python benchmarks/train.py --data [--data-dir DIR] [--num-batches 50]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402  (reads --platform before jax starts)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _profile import ARITHMETIC, CATEGORIES, breakdown  # noqa: E402

from jattn import data as data_lib  # noqa: E402
from jattn.cli.common import load_config_from_args, parse_with_overrides  # noqa: E402
from jattn.models import Transformer, TransformerConfig  # noqa: E402
from jattn.positions import sinusoidal  # noqa: E402
from jattn.train import apply_overrides, load_config, steps  # noqa: E402
from jattn.train.config import ConfigError  # noqa: E402

# name -> (d_model, heads, layers per stack, d_ff, rows, max_len)
SIZES = dict(numbers=(64, 4, 2, 256, 32, 64), small=(128, 4, 2, 512, 16, 128))
SIZES["medium"] = (256, 8, 3, 1024, 8, 256)


class StockLayer(nn.Module):
    """One post-norm encoder (cross=False) or decoder (cross=True) layer of stock flax layers."""

    config: TransformerConfig
    cross: bool

    @nn.compact
    def __call__(self, x, self_mask, encoded=None, cross_mask=None, *, train: bool):
        cfg = self.config
        mha = functools.partial(
            nn.MultiHeadDotProductAttention, num_heads=cfg.num_heads, qkv_features=cfg.d_model,
            out_features=cfg.d_model, use_bias=False, dropout_rate=0.0, deterministic=True,
        )  # fmt: skip

        def block(x, h, name):
            h = nn.Dropout(cfg.dropout_rate)(h, deterministic=not train)
            return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, name=name)(x + h)

        x = block(x, mha(name="self_attention")(x, x, mask=self_mask), "self_attention_norm")
        if self.cross:
            h = mha(name="cross_attention")(x, encoded, mask=cross_mask)
            x = block(x, h, "cross_attention_norm")
        h = nn.Dense(cfg.d_model, name="wo")(nn.relu(nn.Dense(cfg.d_ff, name="wi")(x)))
        return block(x, h, "mlp_norm")


class StockTransformer(nn.Module):
    """The same encoder-decoder as `jattn.models.Transformer(config)`, from stock layers."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, targets, *, train: bool = False, **ids):
        """`ids`: ``{inputs,targets}_{segment_ids,positions}``, as `steps.model_kwargs` gives."""
        cfg = self.config
        init = nn.initializers.normal(cfg.d_model**-0.5)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init)
        seg_in, seg_out = ids["inputs_segment_ids"], ids["targets_segment_ids"]

        def embed_and_position(tokens, positions):
            x = embed(tokens) * math.sqrt(cfg.d_model) + sinusoidal(positions, cfg.d_model)
            return nn.Dropout(cfg.dropout_rate)(x, deterministic=not train)

        def mask(q, kv, *more):  # [B, 1, T, S]: same segment, not padding, and more
            same = nn.make_attention_mask(q, kv, jnp.equal)
            return nn.combine_masks(same, nn.make_attention_mask(q > 0, kv > 0), *more)

        x = embed_and_position(inputs, ids["inputs_positions"])
        for i in range(cfg.num_layers):
            x = StockLayer(cfg, False, name=f"encoder_{i}")(x, mask(seg_in, seg_in), train=train)
        # Shift right within each packed segment: position 0 gets the start token 0.
        shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
        shifted = jnp.where(ids["targets_positions"] == 0, 0, shifted)
        y = embed_and_position(shifted, ids["targets_positions"])
        dec_mask = mask(seg_out, seg_out, nn.make_causal_mask(targets))
        for i in range(cfg.num_layers):
            layer = StockLayer(cfg, cross=True, name=f"decoder_{i}")
            y = layer(y, dec_mask, x, mask(seg_out, seg_in), train=train)
        return embed.attend(y).astype(jnp.float32)


def prepare(model, batches) -> dict:
    """Initialises `model`, compiles the shared train step (timed), and ``step``: a
    cell of `_harness.rounds` taking one more step, on the next batch."""
    tx = optax.adam(1e-3, b1=0.9, b2=0.98, eps=1e-9)
    step = steps.make_train_step(model, tx, lambda c: 1e-3, label_smoothing=0.1)
    step_fn, first = jax.jit(step, donate_argnums=(0,)), batches[0]
    ids = steps.model_kwargs(first)
    params = nn.meta.unbox(model.init(jax.random.key(0), first["inputs"], first["targets"], **ids))
    params = params["params"]
    rng = jax.random.key_data(jax.random.key(1))
    state = steps.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rng)
    t0 = time.perf_counter()
    run = {"params": sum(x.size for x in jax.tree.leaves(params)), "times": [], "tokens": []}
    run["state"], _ = jax.block_until_ready(step_fn(state, first))
    run["compile_s"] = time.perf_counter() - t0

    def one():
        batch = batches[(len(run["tokens"]) + 1) % len(batches)]
        run["state"], run["last"] = step_fn(run["state"], batch)
        run["tokens"].append(run["last"]["tokens"])
        return run["last"]

    run["step"] = one
    return run


def compare(args) -> None:
    """jattn's Transformer against the stock one: the table of `main` without --peak."""
    rows_out = []
    for name in args.sizes.split(","):
        d, heads, layers, ff, rows, max_len = SIZES[name]
        task = data_lib.load("numbers")
        it = iter(data_lib.make_loader(task, "train", batch_size=rows, max_len=max_len, seed=0))
        data = [jax.tree.map(jnp.asarray, next(it)) for _ in range(8)]
        sizes = dict(d_model=d, num_heads=heads, num_layers=layers, d_ff=ff, max_len=max_len)
        vocab = math.ceil(task.tokenizer.vocab_size / 8) * 8
        config = TransformerConfig(vocab_size=vocab, **sizes, dropout_rate=0.1,
                                   position="sinusoidal", attention_impl=args.impl)  # fmt: skip
        runs = {"jattn": prepare(Transformer(config), data)}
        runs["flax stock"] = prepare(StockTransformer(config), data)
        # The models alternate step by step (and their order round by round), so
        # machine noise hits both alike; each round also gives a paired time ratio.
        ratios = []
        for r in range(args.rounds):
            cells = [run["step"] for run in runs.values()]
            times = h.rounds(cells, args.steps, warm=False, alternate=r % 2 == 1)
            med = {k: statistics.median(t) for k, t in zip(runs, times, strict=True)}
            for run, t in zip(runs.values(), times, strict=True):
                run["times"] += t
            ratios.append(med["jattn"] / med["flax stock"])
            ms = {k: f"{v * 1e3:7.2f}" for k, v in med.items()}
            print(f"{name:8s} round {r}: jattn {ms['jattn']} ms, flax stock {ms['flax stock']} ms")
        for model_name, run in runs.items():
            ms = statistics.median(run["times"]) * 1e3
            tok_s = float(np.mean([float(x) for x in run["tokens"]])) / (ms / 1e3)
            ratio = statistics.median(ratios) if model_name == "jattn" else 1.0
            label = f"{name} (d{d}, {layers}+{layers}L, {rows}x{max_len})"
            rows_out.append(
                [label, model_name, f"{run['params']:,}", f"{run['compile_s']:.1f}", f"{ms:.2f}",
                 f"{tok_s:,.0f}", f"{ratio:.2f}", f"{float(run['last']['loss']):.3f}"]
            )  # fmt: skip
    device = f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores"
    rounds = f"{args.rounds} interleaved rounds of {args.steps} steps after compilation"
    print(f"\n{device}; {rounds}; jattn attention_impl={args.impl}; time ratio = median over "
          "rounds of jattn / flax stock")  # fmt: skip
    header = ["size", "model", "params", "compile s", "ms/step", "tokens/s", "time ratio", "loss"]
    print(h.table(header, rows_out))


def main(argv=None) -> int:
    parser = h.parser(__doc__)
    parser.add_argument("arms", nargs="*", help='"NAME:key=value,..." of --config (first: base)')
    parser.add_argument("--steps", type=int, help="timed steps a round (10; arms 15; allocator 40)")
    parser.add_argument("--rounds", type=int, help="rounds, interleaved (4; arms 6; allocator 3)")
    parser.add_argument("--sizes", default="numbers,small", help=f"from {sorted(SIZES)}")
    parser.add_argument("--impl", default="xla", help="jattn attention_impl (xla, chunked)")
    parser.add_argument("--config", help="config spec of arms, --allocator and --peak")
    parser.add_argument("--allocator", action="store_true", help="glibc's against jattn's tuning")
    parser.add_argument("--allocator-child", help=argparse.SUPPRESS)
    peak_help = "--config's step against the fp32 matmul rate (--config.key=value overrides)"
    parser.add_argument("--peak", action="store_true", help=peak_help)
    parser.add_argument("--matmul-size", type=int, default=2048, help="with --peak: N of N x N")
    parser.add_argument("--data", action="store_true", help="the input pipeline's throughput")
    parser.add_argument("--data-dir", help="--data: tfds data dir (default: a temp dir)")
    parser.add_argument("--tasks", default="numbers,numbers/en,reverse", help="--data: tasks")
    parser.add_argument("--max-lens", default="32,64", help="--data: target row lengths")
    parser.add_argument("--max-input-lens", default="0,16", help="--data: input rows, 0: max_len")
    parser.add_argument("--batch-size", type=int, default=64, help="--data: rows a batch")
    parser.add_argument("--num-batches", type=int, default=50, help="--data: batches per row")
    parser.add_argument("--profile-steps", type=int, default=5, help="with --peak: traced steps")
    args, overrides = parse_with_overrides(parser, argv if argv is not None else sys.argv[1:])
    allocator, arms = args.allocator or args.allocator_child, bool(args.arms)
    steps, rounds = (40, 3) if allocator else (15, 6) if arms else (10, 4)
    args.steps, args.rounds = args.steps or steps, args.rounds or rounds
    if min(args.steps, args.rounds, args.matmul_size, args.profile_steps) < 1:
        parser.error("--steps, --rounds, --matmul-size and --profile-steps must be at least 1")
    needs = "--peak" if args.peak else "--allocator" if allocator else "arms" if arms else ""
    if needs and not args.config:
        parser.error(f"{needs} needs --config FILE[:ARG]")
    if overrides and not args.peak:
        parser.error("--config.key=value overrides go with --peak")
    if args.allocator_child:
        from jattn.train.allocator import tune_host_allocator  # noqa: PLC0415

        tune_host_allocator()  # a no-op in the "default" child (JATTN_HOST_ALLOCATOR=default)
        print(json.dumps(allocator_child(args.config, args.steps, args.rounds)))
    elif args.data:
        pipeline(args)
    elif args.peak:
        peak(args, overrides)
    elif args.allocator:
        print(allocators(args))
    elif arms:
        try:
            arms = [parse_arm(a) for a in args.arms]
        except ValueError as e:
            parser.error(str(e))
        if len({name for name, _ in arms}) != len(arms):
            parser.error("arm names must differ")
        print("\n" + table(args.config, time_arms(args.config, arms, args.steps, args.rounds)))
    else:
        compare(args)
    return 0


# Arms of one config, and the host allocator.
def parse_arm(text: str) -> tuple[str, list[tuple[str, str]]]:
    """`"NAME:k=v,k=v"` -> (NAME, [(k, v), ...]); a clear error on anything else."""
    name, sep, rest = text.partition(":")
    items = [s.strip() for s in rest.split(",") if s.strip()]
    if not sep or not name.strip():
        raise ValueError(f"arm {text!r}: expected NAME:key=value,... (NAME: alone for none)")
    if bad := next((i for i in items if "=" not in i or i.startswith("=")), None):
        raise ValueError(f"arm {name!r}: override {bad!r} is not key=value")
    return name.strip(), [tuple(x.strip() for x in i.split("=", 1)) for i in items]


def same_state(arm: dict, base: dict) -> str:
    """Whether `arm`'s final state is `base`'s bit for bit, or by how much it differs;
    "-" when they trained on other batches or have other parameters (another scheme's)."""
    if arm is base:
        return "-"
    flat = lambda a: [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
    ours, theirs = arm["batches"], base["batches"]
    same = jax.tree.structure(ours) == jax.tree.structure(theirs)
    pairs = zip(flat(ours), flat(theirs), strict=False)
    if not same or any(not np.array_equal(a, b) for a, b in pairs):
        return "- (other batches)"
    ours, theirs = flat(arm["state"]), flat(base["state"])
    if [x.shape for x in ours] != [y.shape for y in theirs]:
        return "- (other parameters)"
    pairs = zip(ours, theirs, strict=True)
    worst = max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) for x, y in pairs)
    return "yes" if worst == 0.0 else f"no ({worst:.1e})"


def time_arms(spec: str, arms: list, steps: int, rounds: int) -> list[dict]:
    """Each arm (`parse_arm`'s name and overrides) compiled, then timed in rounds."""
    built = []
    for name, overrides in arms:
        arm = h.train_steps(apply_overrides(load_config(spec), overrides), steps)
        arm["name"] = name
        real = [int((x["inputs"] > 0).sum() + (x["targets"] > 0).sum()) for x in arm["batches"]]
        arm["tokens"] = sum(real) / steps  # non-padding input and target tokens a step
        built.append(arm)
        print(f"compiled {name}: rows {arm['rows']}, {arm['tokens']:.0f} tokens a step", flush=True)

    def progress(r, times):
        pairs = zip(built, times, strict=True)
        line = ", ".join(f"{a['name']} {1000 * t[-1] / steps:.1f}" for a, t in pairs)
        print(f"round {r + 1}/{rounds}: {line} ms", flush=True)

    cells = [arm["run"] for arm in built]
    times = h.rounds(cells, rounds, warm=False, alternate=True, each_round=progress)
    for arm, t in zip(built, times, strict=True):
        arm["ms"] = [1000 * x / steps for x in t]
        arm["same"] = same_state(arm, built[0])
        arm["median"], arm["best"] = statistics.median(arm["ms"]), min(arm["ms"])
        arm["per_1k"] = 1000 * arm["median"] / arm["tokens"]
    return built


def table(spec: str, built: list[dict]) -> str:
    base = built[0]
    rows = [
        [a["name"], a["rows"], f"{a['tokens']:.0f}", f"{a['median']:.1f}", f"{a['best']:.1f}",
         f"{a['per_1k']:.1f}", f"{a['median'] / base['median']:.2f}x",
         f"{a['per_1k'] / base['per_1k']:.2f}x", a["same"]]
        for a in built
    ]  # fmt: skip
    header = ["arm", "rows", "tokens/step", "ms/step", "fastest", "ms per 1k tokens"]
    header += ["step / first", "per token / first", "state = first's"]
    title = f"`{spec}`, ms a step of one seed (median of rounds; fastest round)"
    return title + "\n\n" + h.table(header, rows, "llrrrrrr")


SETTINGS = {"glibc defaults": "default", "tuned (jattn)": "tuned"}


def allocator_child(spec: str, steps: int, rounds: int) -> dict:
    """The step's times and costs in this process, its allocator already set."""
    from jattn.train.allocator import describe  # noqa: PLC0415

    run = h.train_steps(load_config(spec), steps)["run"]
    c0, r0 = os.times(), resource.getrusage(resource.RUSAGE_SELF)
    (times,) = h.rounds([run], rounds, warm=False)
    c1, r1 = os.times(), resource.getrusage(resource.RUSAGE_SELF)
    wall, cpu = sum(times), c1.user - c0.user + c1.system - c0.system
    return dict(allocator=describe(), ms=1000 * statistics.median(times) / steps, cores=cpu / wall,
                kernel=(c1.system - c0.system) / wall,
                faults=(r1.ru_minflt - r0.ru_minflt) / (steps * rounds))  # fmt: skip


def allocators(args) -> str:
    """`--allocator`: each setting's `allocator_child`, in a process of its own."""
    rows = {}
    for name, setting in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k != "JATTN_HOST_ALLOCATOR"}
        if setting == "default":
            env["JATTN_HOST_ALLOCATOR"] = "default"  # as set by hand: glibc left alone
        cmd = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps)]
        cmd += ["--rounds", str(args.rounds), "--allocator-child", setting]
        with tempfile.NamedTemporaryFile(suffix=".log") as log:
            done = h.run_child(cmd, log.name, env=env, cwd=h.ROOT)
        if done.status != "ok":
            raise SystemExit(f"{name}: {done.status}\n{done.output}")
        rows[name] = json.loads(done.output.strip().splitlines()[-1])
        print(f"{name}: {rows[name]}", flush=True)
    base = rows["glibc defaults"]["ms"]
    cells = [[name, f"{r['ms']:.1f}", f"{r['ms'] / base:.2f}x", f"{r['cores']:.2f}",
              f"{r['kernel']:.2f}", f"{r['faults']:,.0f}"] for name, r in rows.items()]  # fmt: skip
    header = ["allocator", "ms a step", "vs glibc defaults", "cores busy", "kernel (cores)"]
    head = f"{os.cpu_count()} CPU(s); {args.config}; {args.steps} steps x {args.rounds} rounds"
    return f"\n{head}\n\n" + h.table([*header, "page faults a step"], cells)


# The input pipeline (--data).
DATA_COLUMNS = (("examples_per_s", "examples/s", "{:,.0f}"),
                ("batches_per_s", "batches/s", "{:.1f}"),
                ("examples_per_row", "examples/row", "{:.2f}"),
                ("inputs_efficiency", "inputs real/all", "{:.3f}"),
                ("targets_efficiency", "targets real/all", "{:.3f}"),
                ("dropped_fraction", "dropped", "{:.3f}"))  # fmt: skip


def pipeline(args) -> str:
    """`--data`: a row per (task, max_len, max_input_len, pack): the pipeline alone
    (one thread, no prefetch), packing and dropped examples; printed as it grows."""
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="jattn_bench_data_")
    header = ["task", "max_len", "max_input_len", "pack"] + [title for _, title, _ in DATA_COLUMNS]
    lines = [f"Input pipeline, batch {args.batch_size} rows, {args.num_batches} batches, "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "",
             h.table(header, [])]  # fmt: skip
    print("\n".join(lines), flush=True)
    for name in args.tasks.split(","):
        task = data_lib.load(name, data_dir=data_dir)
        for max_len in (int(x) for x in args.max_lens.split(",")):
            for input_len in (int(x) or max_len for x in args.max_input_lens.split(",")):
                for pack in (True, False):
                    stats = data_lib.measure_loader(
                        task, "train", batch_size=args.batch_size, max_len=max_len,
                        max_input_len=input_len, num_batches=args.num_batches, pack=pack,
                    )  # fmt: skip
                    cells = [name, max_len, input_len, "yes" if pack else "no"]
                    cells += [fmt.format(stats[key]) for key, _, fmt in DATA_COLUMNS]
                    lines.append(h.table(header, [cells]).splitlines()[-1])
                    print(lines[-1], flush=True)
    return "\n".join(lines)


# --peak: one config's step against the machine.
def measure_peak(config, *, steps: int, rounds: int, matmul_size: int) -> dict:
    """`_harness.train_steps` of `config` with its ``flops``, fastest ``step_s`` and the
    fp32 matmul's ``matmul_s`` (timed in the same rounds) and ``matmul_flops``."""
    run = h.train_steps(config, steps, donate=True)
    n = matmul_size
    a, w = (jax.random.normal(k, (n, n), jnp.float32) for k in jax.random.split(jax.random.key(0)))
    matmul = jax.jit(jnp.matmul).lower(a, w).compile()  # [N, N] @ [N, N], float32
    matmul(a, w).block_until_ready()
    matmul_s, step_s = h.rounds([lambda: matmul(a, w), run["run"]], rounds, warm=False)
    cost = run["compiled"].cost_analysis()  # a dict, or a list of one
    run["flops"] = float((cost[0] if isinstance(cost, list | tuple) else cost)["flops"])
    run.update(step_s=min(step_s) / steps, matmul_s=min(matmul_s), matmul_flops=2.0 * n**3)
    return run


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
    measures = [
        ("step flops (XLA cost analysis)", f"{run['flops'] / 1e9:.3f} GFLOP"),
        (f"step time (fastest of {rounds} rounds of {steps} steps)",
         f"{run['step_s'] * 1e3:.2f} ms"),
        ("step flop rate", f"{step_rate / 1e9:.2f} GFLOP/s"),
        (f"fp32 matmul {n}x{n} @ {n}x{n} (fastest of {rounds})",
         f"{run['matmul_s'] * 1e3:.1f} ms, {mm_rate / 1e9:.2f} GFLOP/s"),
        ("ratio (step flop rate / matmul rate)", f"{step_rate / mm_rate:.3f}"),
    ]  # fmt: skip
    window = prof["window_ns"]
    shares = [(c, f"{prof['ns'][c] / 1e6:.2f}", f"{100 * prof['ns'][c] / window:.1f}%")
              for c in CATEGORIES]  # fmt: skip
    rest = {c: prof["ns"][c] for c in CATEGORIES if c not in ARITHMETIC}
    worst = max(rest, key=rest.get)
    arith = sum(prof["ns"][c] for c in ARITHMETIC)
    clip = lambda w: w if len(w) <= 110 else "..." + w[-107:]
    top = [[f"{t / 1e6:.2f}", name, cat, f"`{clip(w.replace('|', '/'))}`"]
           for t, name, cat, w in prof["top"]]  # fmt: skip
    return "\n\n".join([  # paragraphs
        f"`--config {spec}{extra}`, rows {run['rows']}; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cores",
        h.table(["measure", "value"], measures, "lr"),
        f"Breakdown: `jax.profiler` trace of {prof['steps']} steps, "
        f"{prof['window_ns'] / 1e6:.2f} ms a step traced; {prof['ops']} op events, "
        f"{prof['unknown']} not found in the module",
        h.table(["category", "ms/step", "share"], shares, "lrr"),
        "Costliest instructions (exclusive ms a step traced):",
        h.table(["ms/step", "instruction", "category", "jax op_name"], top, "r"),
        f"arithmetic (matmuls and attention dots): {100 * arith / window:.1f}% of the step; "
        f"largest cost that is not arithmetic: {worst} ({100 * rest[worst] / window:.1f}%)",
    ])  # fmt: skip


def peak(args, overrides) -> None:
    """`--peak`: measures, profiles and prints the two tables for `args.config`."""
    load = lambda: f"{os.getloadavg()[0]:.2f}"  # what else the machine runs
    load_before = load()
    try:
        config = load_config_from_args(args.config, overrides)
    except ConfigError as e:
        print(f"benchmarks/train.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    run = measure_peak(config, steps=args.steps, rounds=args.rounds, matmul_size=args.matmul_size)
    prof = profile_step(run, args.profile_steps) | {"steps": args.profile_steps}
    print(f"load average (1 min): {load_before} before, {load()} after\n", flush=True)
    print(peak_tables(args.config, overrides, run, prof, rounds=args.rounds, steps=args.steps))


if __name__ == "__main__":
    sys.exit(main())
