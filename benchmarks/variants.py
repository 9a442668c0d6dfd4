"""Train-step time of config variants, interleaved in one process.

    jattn bench variants --config configs/scan.py:shaw \\
        "rows 64:" "rows 32:max_len=32,max_input_len=20,batch_size=32"

Each ARM is `NAME:key=value,key=value` (overrides as `--config.key=value`
takes them, on `--config`; `NAME:` alone is the config as it is). For every
arm, in this one process: the train step a real run takes
(`benchmarks/_step.py`), compiled, then timed over `--steps` of that arm's
own training batches; the arms alternate in `--rounds` rounds (forward, then
backward order), because this machine's speed drifts by 1.2-2x between
minutes and days, so only arms timed side by side compare. Reported per arm:
the median and the fastest round (ms a step of one seed), the non-padding
tokens a step (inputs + targets), ms per 1,000 of them (rows of another shape
pack a few more or fewer examples a step), both ratios to the first arm, and
whether its train state after all its steps is the first arm's bit for bit
(every arm starts from the same state and takes as many steps; an arm with
other batches than the first's is not compared). The table is printed last.

What it answers: which row shape, dtype or model option makes a grid's runs
cheaper per example, before any grid is rerun on it (docs/benchmarks.md,
"Making a grid's runs cheaper").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _platform import HELP as PLATFORM_HELP  # noqa: E402
from _platform import select_platform  # noqa: E402

select_platform()  # where it is started, unless --platform names one

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _step import build_step, device_batch  # noqa: E402

from jattn.cli.common import normalize_flags  # noqa: E402
from jattn.train import apply_overrides, load_config  # noqa: E402


def parse_arm(text: str) -> tuple[str, list[tuple[str, str]]]:
    """`"NAME:k=v,k=v"` -> (NAME, [(k, v), ...]); a clear error on anything else."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"arm {text!r}: expected NAME:key=value,... (NAME: alone for none)")
    overrides = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"arm {name!r}: override {item!r} is not key=value")
        overrides.append((key.strip(), value.strip()))
    return name.strip(), overrides


def tokens(batch) -> int:
    """Non-padding input and target tokens of one batch."""
    return int((batch["inputs"] > 0).sum() + (batch["targets"] > 0).sum())


def same_state(arm: dict, base: dict) -> str:
    """Whether `arm`'s train state equals `base`'s bit for bit ("yes"), or by how
    much it differs (largest difference relative to the largest value); "-"
    when the arms trained on other batches."""
    if arm is base:
        return "-"
    pairs = zip(arm["batches"], base["batches"], strict=True)
    if any(
        a.keys() != b.keys() or any(not np.array_equal(a[k], b[k]) for k in a) for a, b in pairs
    ):
        return "- (other batches)"
    worst = 0.0
    for x, y in zip(jax.tree.leaves(arm["state"]), jax.tree.leaves(base["state"]), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if not np.array_equal(x, y):
            x, y = x.astype(np.float64), y.astype(np.float64)
            worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return "yes" if worst == 0.0 else f"no ({worst:.1e})"


def time_arms(
    spec: str, arms: list[tuple[str, list[tuple[str, str]]]], steps: int, rounds: int
) -> list[dict]:
    """Each arm (`parse_arm`'s name and overrides) compiled, then timed in rounds."""
    built = []
    for name, overrides in arms:
        config = apply_overrides(load_config(spec), overrides)
        b = build_step(config, 1, steps)
        batches = [device_batch(seeds[0]) for seeds in b["batches"]]
        step = jax.jit(b["step"])
        state, _ = step(b["states"][0], batches[0])  # compile
        jax.block_until_ready(state)
        (rows, s), t = batches[0]["inputs"].shape, batches[0]["targets"].shape[1]
        shape = f"{rows}x({s}+{t})"
        tok = sum(tokens(x) for x in batches) / steps
        built.append(
            {"name": name, "step": step, "state": state, "batches": batches, "ms": []}
            | {"rows": shape, "tokens": tok}
        )
        print(f"compiled {name}: rows {shape}, {tok:.0f} tokens a step", flush=True)

    def run(arm):
        state = arm["state"]
        t0 = time.perf_counter()
        for x in arm["batches"]:
            state, _ = arm["step"](state, x)
        jax.block_until_ready(state)
        arm["state"] = state
        arm["ms"].append(1000 * (time.perf_counter() - t0) / steps)

    for r in range(rounds):
        for arm in built if r % 2 == 0 else built[::-1]:
            run(arm)
        times = ", ".join(f"{a['name']} {a['ms'][-1]:.1f}" for a in built)
        print(f"round {r + 1}/{rounds}: {times} ms", flush=True)
    for arm in built:
        arm["same"] = same_state(arm, built[0])
        arm["median"] = statistics.median(arm["ms"])
        arm["best"] = min(arm["ms"])
        arm["per_1k"] = 1000 * arm["median"] / arm["tokens"]
    return built


def table(spec: str, built: list[dict]) -> str:
    base = built[0]
    lines = [
        f"`{spec}`, ms a step of one seed (median of rounds; fastest round)",
        "",
        "| arm | rows | tokens/step | ms/step | fastest | ms per 1k tokens | step / first "
        "| per token / first | state = first's |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for a in built:
        step_ratio = a["median"] / base["median"]
        token_ratio = a["per_1k"] / base["per_1k"]
        lines.append(
            f"| {a['name']} | {a['rows']} | {a['tokens']:.0f} | {a['median']:.1f} | "
            f"{a['best']:.1f} | {a['per_1k']:.1f} | {step_ratio:.2f}x | {token_ratio:.2f}x "
            f"| {a['same']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="jattn bench variants", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--platform", default=None, help=PLATFORM_HELP)
    parser.add_argument("--config", required=True, help="config spec, e.g. configs/scan.py:shaw")
    parser.add_argument("arms", nargs="+", help='"NAME:key=value,..." (the first is the baseline)')
    parser.add_argument("--steps", type=int, default=15, help="timed steps an arm a round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, arms alternating")
    args = parser.parse_args(normalize_flags(argv if argv is not None else sys.argv[1:]))
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    try:
        arms = [parse_arm(a) for a in args.arms]
    except ValueError as e:
        parser.error(str(e))
    if len({name for name, _ in arms}) != len(arms):
        parser.error("arm names must differ")
    built = time_arms(args.config, arms, args.steps, args.rounds)
    print()
    print(table(args.config, built))
    return 0


if __name__ == "__main__":
    sys.exit(main())
