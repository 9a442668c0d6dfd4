"""Seeds in one program against the same seeds trained one after another.

    jattn bench seeds                                   # the positional grid's model
    jattn bench seeds --seeds 3,5 --steps 300
    jattn bench seeds --config configs/numbers.py --seeds 3 --eval

For each count N of `--seeds`, in this one process: N sequential runs of the
config (seeds 0 ... N-1, each a fresh `jattn train`: build, compile, train,
final checkpoint), then one run with ``seeds=0,...,N-1`` (every seed in one
vmapped program, `jattn.train.members`). Both use a persistent compilation
cache, as `jattn ablate` does, so a sequential run after the first skips most
of its compilation. Reported: wall time of each side and their ratio, steps a
second (the steady rate, compilation left out) of one run and of the program,
and how far the program's per-seed final training losses are from the
sequential runs' (relative), with, under `--eval`, whether every decoded
output is the same. Evaluation is off unless `--eval` (it is the same work
either way; the final evaluation of the positional grid decodes 2,048
examples per run). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_step.py

import jax  # noqa: E402

from jattn.cli.common import enable_compilation_cache, normalize_flags  # noqa: E402
from jattn.train import apply_overrides, load_config, train_and_evaluate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _config(spec: str, steps: int, evaluate: bool, **keys):
    overrides = {
        "num_train_steps": steps,
        "eval_every_steps": steps,
        "checkpoint_every_steps": steps,
        "log_every_steps": min(50, steps),
        "progress_bar": False,
        **({} if evaluate else {"eval_splits": "()"}),
        **keys,
    }
    return apply_overrides(load_config(spec), [(k, str(v)) for k, v in overrides.items()])


def _decodes(workdir: Path) -> list[str]:
    out = []
    for path in sorted((workdir / "decodes").glob("*.jsonl")):
        out += [json.loads(line)["prediction"] for line in path.read_text().splitlines()]
    return out


def bench(spec: str, num_seeds: int, steps: int, evaluate: bool, root: Path, program: str):
    seq_dir, prog_dir = root / f"seq{num_seeds}", root / f"prog{num_seeds}"
    t0 = time.perf_counter()
    seq = [
        train_and_evaluate(_config(spec, steps, evaluate, seed=s), str(seq_dir / f"seed-{s}"))
        for s in range(num_seeds)
    ]
    t_seq = time.perf_counter() - t0
    seeds = ",".join(str(s) for s in range(num_seeds))
    t0 = time.perf_counter()
    config = _config(spec, steps, evaluate, seeds=seeds, seed_program=program)
    prog = train_and_evaluate(config, str(prog_dir))
    t_prog = time.perf_counter() - t0
    rel = max(
        abs(prog["members"][s]["train/loss"] - seq[s]["train/loss"]) / abs(seq[s]["train/loss"])
        for s in range(num_seeds)
    )
    same = all(
        _decodes(prog_dir / f"seed-{s}") == _decodes(seq_dir / f"seed-{s}")
        for s in range(num_seeds)
    )
    return {
        "seeds": num_seeds,
        "sequential_s": t_seq,
        "program_s": t_prog,
        "ratio": t_prog / t_seq,
        "run_steps_per_s": sum(r["train/steps_per_sec"] or 0 for r in seq) / num_seeds,
        "program_steps_per_s": prog["members"][0]["train/steps_per_sec"],
        "max_rel_loss_diff": rel,
        "decodes_equal": same if evaluate else None,
    }


def steady(spec: str, num_seeds: int, steps: int, rounds: int) -> dict:
    """Milliseconds a step of all seeds, compiled programs only (no data loading, no
    logging): the single run's jitted step called once a seed, against one `lax.map`
    program and one `jax.vmap` program; the three alternate in `rounds` rounds (this
    machine's load drifts by 2x within minutes) and the medians are reported."""
    import statistics  # noqa: PLC0415

    import jax.numpy as jnp  # noqa: PLC0415
    from _step import build_step, device_batch  # noqa: PLC0415

    from jattn.train import members  # noqa: PLC0415

    built = build_step(load_config(spec), num_seeds, steps)
    states, batches, step = built["states"], built["batches"], built["step"]
    one = jax.jit(step)
    programs = {k: jax.jit(members.over_members(step, k)) for k in ("map", "vmap")}
    stacked = [device_batch(members.stack(b)) for b in batches]

    def time_single() -> float:
        sts = list(states)
        t0 = time.perf_counter()
        for bs in batches:
            for i in range(num_seeds):
                sts[i], m = one(sts[i], bs[i])
        jax.block_until_ready(sts)
        return (time.perf_counter() - t0) / steps

    def time_program(kind) -> float:
        st = jax.tree.map(jnp.asarray, members.stack(states))
        t0 = time.perf_counter()
        for b in stacked:
            st, m = programs[kind](st, b)
        jax.block_until_ready(st)
        return (time.perf_counter() - t0) / steps

    time_single(), time_program("map"), time_program("vmap")  # compile
    times = {"single": [], "map": [], "vmap": []}
    for r in range(rounds):
        order = ["single", "map", "vmap"] if r % 2 == 0 else ["vmap", "map", "single"]
        for name in order:
            times[name].append(time_single() if name == "single" else time_program(name))
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def _num(value) -> str:
    return "-" if not value else f"{value:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jattn bench seeds", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "reverse_digits.py"))
    parser.add_argument("--seeds", default="3,5", help="seed counts, e.g. 3,5")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval", action="store_true", help="evaluate and compare decodes")
    parser.add_argument(
        "--program", default="auto", choices=["auto", "map", "vmap"], help="config.seed_program"
    )
    parser.add_argument(
        "--steady-rounds", type=int, default=0, help="> 0: only the interleaved step timing"
    )
    parser.add_argument("--keep", default="", help="keep the runs in this folder")
    args = parser.parse_args(normalize_flags(argv if argv is not None else sys.argv[1:]))
    if args.steady_rounds > 0:
        print(
            "| seeds | S single steps (ms) | map (ms) | vmap (ms) | map / single | vmap / single |"
        )
        print("|---|---|---|---|---|---|")
        for n in args.seeds.split(","):
            t = steady(args.config, int(n), min(args.steps, 30), args.steady_rounds)
            print(
                f"| {n} | {t['single']:.1f} | {t['map']:.1f} | {t['vmap']:.1f} | "
                f"{t['map'] / t['single']:.2f}x | {t['vmap'] / t['single']:.2f}x |",
                flush=True,
            )
        return 0
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_seeds_"))
    enable_compilation_cache(str(root / "xla_cache"))
    print(
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, {os.cpu_count()} CPU(s); "
        f"{args.config}, {args.steps} steps, eval {'on' if args.eval else 'off'}, "
        f"seed_program={args.program}",
        flush=True,
    )
    rows = [
        bench(args.config, int(n), args.steps, args.eval, root, args.program)
        for n in args.seeds.split(",")
    ]
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        "| seeds | N sequential runs (s) | one program (s) | program / sequential | "
        "steps/s, one run | steps/s, program | max rel. loss diff | decodes equal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "-" if r["decodes_equal"] is None else ("yes" if r["decodes_equal"] else "NO")
        print(
            f"| {r['seeds']} | {r['sequential_s']:.1f} | {r['program_s']:.1f} | "
            f"{r['ratio']:.2f}x | {_num(r['run_steps_per_s'])} | "
            f"{_num(r['program_steps_per_s'])} | "
            f"{r['max_rel_loss_diff']:.1e} | {same} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
