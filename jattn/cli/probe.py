"""`jattn probe`: interventions on a trained run's checkpoint.

    jattn probe --workdir runs/positional/runs/position-shaw_seed-0 --out probe/ \\
        [--split validation] [--examples 4]

Writes into ``--out``:

- ``weight_vs_effect.png``: per source position of a few examples, the mean
  cross-attention weight against the drop in log p(reference) when that
  position is hidden from every cross-attention layer;
- ``head_ablation.md``: the heads whose ablation costs the most (drop in
  reference log-probability and in token accuracy, teacher-forced);
- ``probe.json``: the numbers behind both.

The run is opened with `jattn.train.load_run`; the probes are those of
`jattn.analysis.probe`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from jattn.cli.common import fail, normalize_flags

__all__ = ["probe_command"]

PROG = "jattn probe"


def make_parser() -> argparse.ArgumentParser:
    """The command's argument parser (the tests read every flag and its help)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="a run directory (jattn train)")
    parser.add_argument("--out", required=True, help="where the plot and tables go")
    parser.add_argument(
        "--split", default="validation", help="the task's split to probe (default %(default)s)"
    )
    parser.add_argument(
        "--examples", type=int, default=4, help="examples of the split probed (default 4)"
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument("--top", type=int, default=10, help="heads listed in the table")
    return parser


def _head_table(heads: list[dict], top: int, *, examples: int, split: str, step: int, workdir: str):
    lines = [
        f"Head ablation on {examples} `{split}` examples, checkpoint step {step} "
        f"of `{workdir}` (teacher-forced; drop = unablated minus ablated).",
        "",
        "| layer | head | drop in log p(reference) | drop in token accuracy |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {h['layer']} | {h['head']} | {h['logprob_drop']:.3f} | {h['accuracy_drop']:.3f} |"
        for h in heads[:top]
    ]
    return lines


def probe_command(argv: Sequence[str]) -> int:
    """`jattn probe`: returns the exit status."""
    import numpy as np  # noqa: PLC0415

    from jattn.analysis import probe  # noqa: PLC0415
    from jattn.train.load import load_run  # noqa: PLC0415

    args = make_parser().parse_args(normalize_flags(argv))
    try:
        with probe.quiet_checkpoint_metadata():
            run = load_run(args.workdir, args.step)
        task = run.task
    except (FileNotFoundError, ValueError) as e:
        return fail(PROG, str(e))
    if args.split not in task.splits:
        return fail(PROG, f"unknown split {args.split!r}; the task has {', '.join(task.splits)}")
    model, params = run.model, run.params
    inputs, targets, texts = probe.encode_examples(task, args.split, args.examples)
    os.makedirs(args.out, exist_ok=True)

    effects = probe.source_position_effects(model, params, inputs, targets)
    labels = [probe.example_label(t) for t in texts]
    probe.plot_weight_vs_effect(effects, os.path.join(args.out, "weight_vs_effect.png"), labels)
    heads = probe.head_ablation_table(model, params, inputs, targets)
    lines = _head_table(
        heads, args.top, examples=len(texts), split=args.split, step=run.step, workdir=args.workdir
    )
    with open(os.path.join(args.out, "head_ablation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(
            {
                "step": run.step,
                "examples": texts,
                "weight": np.nan_to_num(effects["weight"], nan=-1).tolist(),
                "effect": np.nan_to_num(effects["effect"], nan=0).tolist(),
                "base_logprob": effects["base"].tolist(),
                "heads": heads,
            },
            f,
            indent=1,
        )
    corr = probe.weight_effect_correlation(effects)
    print("\n".join(lines))
    print(
        f"\ncorrelation of attention weight and hiding effect over source positions: "
        f"{corr:.3f}\nwrote {args.out}/weight_vs_effect.png, head_ablation.md, probe.json"
    )
    return 0
