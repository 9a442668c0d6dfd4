"""The GPU window's training arms held to the CPU's: the same losses within seed noise?

    python lab/gpu_train.py OUT/train.csv                  # after the window's training stage
    python lab/gpu_train.py --reference-from RUN [RUN ...]  # (re)make the CPU reference

The window's training stage (`benchmarks/gpu.py --train`) trains the Delétang tape
model (`configs/chomsky.py:reverse_string,test100`, encoder-only, 300 steps of 128
rows) on the GPU under the default rule and under xla. A GPU cannot give the CPU's
digits (TF32 matmuls, other reduction orders), so each arm is held to the CPU's
seeds instead. The reference (`REFERENCE`) is five CPU runs of the same command
(seeds 0-4, `jattn train` with the stage's settings, one at a time on the 2-core
development machine); the rule: **an arm agrees with the CPU when its final
training loss lies in the five seeds' 95% prediction interval**
(`jattn.analysis.stats.prediction_interval`, the interval one more seed falls in
95% of the time): the GPU run is read as one more seed, its rounding other, its
loss distribution the same. Beside it, the arm's steps/s over the CPU seeds' mean
(the step time on the GPU against the CPU's).

Writes `train_vs_cpu.csv` beside the window's CSV and prints one line an arm. Exit
status 1 when an arm that ran the reference's steps and rows lies outside, else 0
(also when none did: the CPU dry run's 4 steps of 16 rows are not comparable).

Why in the lab, not in benchmarks/gpu.py: the window measures; judging a
measurement against this repository's own reference runs is the lab's bookkeeping,
as a grid's cost is (`lab/grid.py`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jattn.analysis.stats import prediction_interval  # noqa: E402

REFERENCE = os.path.join(ROOT, "docs", "gpu_runs", "cpu_reference_reverse_string.csv")
COLUMNS = ("seed", "steps", "batch_size", "final_loss", "losses", "steps_per_s")
VERDICT_COLUMNS = ("arm", "steps", "batch_size", "final_loss", "cpu_low", "cpu_high", "vs_cpu",
                   "steps_per_s", "cpu_steps_per_s", "speedup_vs_cpu")  # fmt: skip


def _read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _write(path: str, rows: Sequence[dict], columns: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def reference_row(run_dir: str) -> dict:
    """One CPU run's reference row from its workdir: the config's seed and batch, and
    from metrics.jsonl the logged losses, the last loss and the last interval's steps/s."""
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, filter(str.strip, f)) if "train/loss" in r]
    if not train:
        raise ValueError(f"{run_dir}: no train/loss in metrics.jsonl")
    last = train[-1]
    return dict(
        seed=config["seed"], steps=last["step"], batch_size=config["batch_size"],
        final_loss=f"{last['train/loss']:.5f}", steps_per_s=f"{last['train/steps_per_sec']:.3f}",
        losses=" ".join(f"{r['step']}:{r['train/loss']:.4f}" for r in train),
    )  # fmt: skip


def hold(arms: Sequence[dict], reference: Sequence[dict]) -> list[dict]:
    """The verdict row of each arm that ran the reference's steps and rows (the rule in
    the module docstring); arms that did not are left out."""
    _, low, high = prediction_interval([float(r["final_loss"]) for r in reference])
    cpu_rate = sum(float(r["steps_per_s"]) for r in reference) / len(reference)
    same = (reference[0]["steps"], reference[0]["batch_size"])
    rows = []
    for arm in arms:
        if (arm.get("steps"), arm.get("batch_size")) != same or arm.get("status") != "ok":
            continue
        loss, rate = float(arm["final_loss"]), float(arm["steps_per_s"])
        rows.append(dict(
            arm=arm["arm"], steps=arm["steps"], batch_size=arm["batch_size"], final_loss=loss,
            cpu_low=f"{low:.5f}", cpu_high=f"{high:.5f}",
            vs_cpu="within" if low <= loss <= high else "OUTSIDE",
            steps_per_s=rate, cpu_steps_per_s=f"{cpu_rate:.3f}",
            speedup_vs_cpu=f"{rate / cpu_rate:.1f}",
        ))  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_csv", nargs="?", help="the window's train.csv")
    p.add_argument("--reference", default=REFERENCE, help="the CPU seeds' CSV")
    p.add_argument("--reference-from", nargs="+", metavar="RUN", help="CPU workdirs: write it")
    args = p.parse_args(argv)
    if args.reference_from:
        _write(args.reference, [reference_row(d) for d in args.reference_from], COLUMNS)
        print(f"gpu_train: wrote {args.reference} ({len(args.reference_from)} runs)")
        return 0
    if not args.train_csv:
        p.error("give the window's train.csv (or --reference-from)")
    if not os.path.exists(args.train_csv):  # the training stage failed before writing it
        print(f"gpu_train: no {args.train_csv}: the training stage wrote no rows", file=sys.stderr)
        return 1
    reference = _read(args.reference)
    rows = hold(_read(args.train_csv), reference)
    if not rows:
        print(f"gpu_train: no arm ran the reference's {reference[0]['steps']} steps of "
              f"{reference[0]['batch_size']} rows: nothing to compare")  # fmt: skip
        return 0
    _write(os.path.join(os.path.dirname(os.path.abspath(args.train_csv)), "train_vs_cpu.csv"),
           rows, VERDICT_COLUMNS)  # fmt: skip
    for r in rows:
        print(f"gpu_train: {r['arm']}: final loss {r['final_loss']:.5f} {r['vs_cpu']} the CPU "
              f"seeds' 95% prediction interval [{r['cpu_low']}, {r['cpu_high']}]; "
              f"{r['speedup_vs_cpu']}x the CPU's steps/s")  # fmt: skip
    return 1 if any(r["vs_cpu"] != "within" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
