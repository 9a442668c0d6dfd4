"""The host allocator's effect on a train step: glibc's defaults against
`jattn.train.allocator.tune_host_allocator`, measured in the same run, on the
platform it is started on (`--platform cpu` for the CPU's step, as measured
so far: the allocator matters where the host runs the step).

    jattn bench allocator                       # the positional grid's model
    jattn bench allocator --config configs/numbers.py --steps 50 --rounds 5

Each setting runs in its own fresh process (the settings are process-wide):
it compiles the config's train step, runs `--steps` steps `--rounds` times on
real batches, and reports the median milliseconds a step with, over the timed
steps, the cores it kept busy (CPU time / wall time), the share of a core
spent in the kernel, and the page faults a step. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"glibc defaults": "default", "tuned (jattn)": "tuned"}


def child(spec: str, steps: int, rounds: int) -> dict:
    """Times the train step in this process (run with the allocator already set)."""
    import jax  # noqa: PLC0415
    from flax import linen as nn  # noqa: PLC0415

    from jattn.models import Transformer  # noqa: PLC0415
    from jattn.train import load_config  # noqa: PLC0415
    from jattn.train import steps as steps_lib  # noqa: PLC0415
    from jattn.train.allocator import describe  # noqa: PLC0415
    from jattn.train.config import read_parts  # noqa: PLC0415
    from jattn.train.load import open_task, train_loader  # noqa: PLC0415
    from jattn.train.optim import make_optimizer  # noqa: PLC0415

    parts = read_parts(load_config(spec))
    task = open_task(parts.data)
    model = Transformer(parts.model.build(task.tokenizer.vocab_size))
    tx, schedule = make_optimizer(parts.optimizer)
    init_boxed = steps_lib.make_init(model, tx, parts.data, rows=1)
    state = jax.jit(lambda r: nn.meta.unbox(init_boxed(r)))(jax.random.key_data(jax.random.key(0)))
    it = iter(train_loader(task, parts.data))
    batches = [jax.tree.map(jax.numpy.asarray, next(it)) for _ in range(steps)]
    step = jax.jit(
        steps_lib.make_train_step(model, tx, schedule, label_smoothing=parts.step.label_smoothing)
    )
    state, _ = step(state, batches[0])  # compile
    jax.block_until_ready(state)
    times, cpu, sys_, faults = [], 0.0, 0.0, 0
    for _ in range(rounds):
        t0, c0, r0 = time.perf_counter(), os.times(), resource.getrusage(resource.RUSAGE_SELF)
        for b in batches:
            state, _ = step(state, b)
        jax.block_until_ready(state)
        t1, c1, r1 = time.perf_counter(), os.times(), resource.getrusage(resource.RUSAGE_SELF)
        times.append(t1 - t0)
        cpu += (c1.user - c0.user) + (c1.system - c0.system)
        sys_ += c1.system - c0.system
        faults += r1.ru_minflt - r0.ru_minflt
    wall = sum(times)
    return {
        "allocator": describe(),
        "ms": 1000 * statistics.median(times) / steps,
        "cores": cpu / wall,
        "kernel": sys_ / wall,
        "faults": faults / (steps * rounds),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="jattn bench allocator", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--platform",
        default=None,
        help="jax platform to run on (cpu, cuda, rocm, tpu); default: where it is started "
        "(JAX_PLATFORMS, else jax's choice)",
    )
    parser.add_argument("--config", default=str(ROOT / "configs" / "reverse_digits.py"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.platform:  # the children inherit it
        os.environ["JAX_PLATFORMS"] = args.platform
    if args.child:
        from jattn.train.allocator import tune_host_allocator  # noqa: PLC0415

        tune_host_allocator()  # a no-op in the "default" child (JATTN_HOST_ALLOCATOR=default)
        print(json.dumps(child(args.config, args.steps, args.rounds)))
        return 0
    rows = {}
    for name, setting in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k != "JATTN_HOST_ALLOCATOR"}
        if setting == "default":
            env["JATTN_HOST_ALLOCATOR"] = "default"  # as set by hand: glibc left alone
        cmd = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps)]
        cmd += ["--rounds", str(args.rounds), "--child", setting]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name}: {rows[name]}", flush=True)
    base = rows["glibc defaults"]["ms"]
    print(f"\n{os.cpu_count()} CPU(s); {args.config}; {args.steps} steps x {args.rounds} rounds\n")
    print(
        "| allocator | ms a step | vs glibc defaults | cores busy | kernel (cores) "
        "| page faults a step |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['ms']:.1f} | {r['ms'] / base:.2f}x | {r['cores']:.2f} | "
            f"{r['kernel']:.2f} | {r['faults']:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
