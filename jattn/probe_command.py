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
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import numpy as np


def load_run(workdir: str, step: int | None = None):
    """`(model, params, task, config, step)`: the trained run (see
    `jattn.train.load_run`) and its task, for the tokenizer and the splits."""
    from jattn import data as data_lib  # noqa: PLC0415
    from jattn.train.restore import load_run as load_trained  # noqa: PLC0415

    run = load_trained(workdir, step)
    c = run.config
    task = data_lib.load(
        c.dataset,
        data_dir=c.get("data_dir"),
        tokenizer=c.get("tokenizer", "char"),
        vocab_size=c.get("vocab_size", 8000),
        source_key=c.get("source_key"),
        target_key=c.get("target_key"),
    )
    return run.model, run.params, task, c, run.step


def encode_examples(task, split: str, count: int):
    """`(inputs [n, S], targets [n, T], texts)`: the first `count` examples of
    `split`, tokenized and padded with 0."""
    src = task.source(split)
    texts = [src[i] for i in range(min(count, len(src)))]
    ins = [task.tokenizer.encode(t["inputs"]) for t in texts]
    outs = [task.tokenizer.encode(t["targets"]) for t in texts]

    def pad(rows):
        width = max(len(r) for r in rows)
        return np.array([r + [0] * (width - len(r)) for r in rows], np.int32)

    return pad(ins), pad(outs), texts


def probe_command(argv: Sequence[str]) -> int:
    from jattn import probe  # noqa: PLC0415
    from jattn.cli import _fail  # noqa: PLC0415

    prog = "jattn probe"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="a run directory (jattn train)")
    parser.add_argument("--out", required=True, help="where the plot and tables go")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--examples", type=int, default=4)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument("--top", type=int, default=10, help="heads listed in the table")
    args = parser.parse_args(argv)
    try:
        model, params, task, _, step = load_run(args.workdir, args.step)
    except (FileNotFoundError, ValueError) as e:
        return _fail(prog, str(e))
    if args.split not in task.splits:
        return _fail(prog, f"unknown split {args.split!r}; the task has {', '.join(task.splits)}")
    inputs, targets, texts = encode_examples(task, args.split, args.examples)
    os.makedirs(args.out, exist_ok=True)

    effects = probe.source_position_effects(model, params, inputs, targets)
    labels = [f"{t['inputs']} -> {t['targets'][:24]}" for t in texts]
    probe.plot_weight_vs_effect(effects, os.path.join(args.out, "weight_vs_effect.png"), labels)
    heads = probe.head_ablation_table(model, params, inputs, targets)

    lines = [
        f"Head ablation on {len(texts)} `{args.split}` examples, checkpoint step {step} "
        f"of `{args.workdir}` (teacher-forced; drop = unablated minus ablated).",
        "",
        "| layer | head | drop in log p(reference) | drop in token accuracy |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {h['layer']} | {h['head']} | {h['logprob_drop']:.3f} | {h['accuracy_drop']:.3f} |"
        for h in heads[: args.top]
    ]
    with open(os.path.join(args.out, "head_ablation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(
            {
                "step": step,
                "examples": texts,
                "weight": np.nan_to_num(effects["weight"], nan=-1).tolist(),
                "effect": np.nan_to_num(effects["effect"], nan=0).tolist(),
                "base_logprob": effects["base"].tolist(),
                "heads": heads,
            },
            f,
            indent=1,
        )
    corr = _weight_effect_correlation(effects)
    print("\n".join(lines))
    print(
        f"\ncorrelation of attention weight and hiding effect over source positions: "
        f"{corr:.3f}\nwrote {args.out}/weight_vs_effect.png, head_ablation.md, probe.json"
    )
    return 0


def _weight_effect_correlation(effects) -> float:
    w, e = effects["weight"].ravel(), effects["effect"].ravel()
    ok = np.isfinite(w) & np.isfinite(e)
    if ok.sum() < 3 or np.std(w[ok]) == 0 or np.std(e[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(w[ok], e[ok])[0, 1])
