"""lab/gpu_train.py: the GPU window's training arms held to the CPU seeds' losses."""

import csv
import json
import os
import runpy

import pytest

from jattn.analysis.stats import prediction_interval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB = runpy.run_path(os.path.join(ROOT, "lab", "gpu_train.py"))


def _csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_the_committed_reference_is_five_cpu_seeds_of_the_windows_arm():
    ref = LAB["_read"](LAB["REFERENCE"])
    assert sorted(int(r["seed"]) for r in ref) == [0, 1, 2, 3, 4]
    # The window's training stage: 300 steps of 128 rows, six logged losses.
    assert {(r["steps"], r["batch_size"]) for r in ref} == {("300", "128")}
    assert all(len(r["losses"].split()) == 6 for r in ref)
    mean, low, high = prediction_interval([float(r["final_loss"]) for r in ref])
    assert 0 < low < mean < high and all(float(r["steps_per_s"]) > 0 for r in ref)


def test_reference_row_reads_a_runs_workdir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(seed=3, batch_size=128)))
    lines = [dict(step=s, **{"train/loss": 1.0 / s, "train/steps_per_sec": 0.9 + s / 1000})
             for s in (150, 300)]  # fmt: skip
    lines.insert(1, {"step": 150, "eval/validation/loss": 2.0})  # not a training line
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    row = LAB["reference_row"](str(tmp_path))
    assert row == dict(seed=3, steps=300, batch_size=128, final_loss="0.00333",
                       steps_per_s="1.200", losses="150:0.0067 300:0.0033")  # fmt: skip


def test_an_arm_inside_the_interval_agrees_one_outside_does_not(tmp_path, capsys):
    losses = (0.60, 0.62, 0.64, 0.61, 0.63)
    ref = [dict(seed=s, steps="300", batch_size="128", final_loss=str(x), losses="",
                steps_per_s="1.0") for s, x in enumerate(losses)]  # fmt: skip
    ref_path, train = tmp_path / "ref.csv", tmp_path / "train.csv"
    _csv(ref_path, ref)
    _, low, high = prediction_interval(losses)
    arm = dict(status="ok", steps="300", batch_size="128", steps_per_s="25.0")
    arms = [dict(arm, arm="default", final_loss=str(high - 1e-4)),
            dict(arm, arm="xla", final_loss=str(high + 1e-4)),
            dict(arm, arm="short", final_loss="0.62", steps="4"),
            dict(arm, arm="failed", final_loss="0.62", status="exit 1")]  # fmt: skip
    _csv(train, arms)
    assert LAB["main"]([str(train), "--reference", str(ref_path)]) == 1
    rows = LAB["_read"](tmp_path / "train_vs_cpu.csv")
    assert [(r["arm"], r["vs_cpu"], r["speedup_vs_cpu"]) for r in rows] == [
        ("default", "within", "25.0"), ("xla", "OUTSIDE", "25.0")]  # fmt: skip
    out = capsys.readouterr().out
    assert "default: final loss" in out and "OUTSIDE the CPU seeds' 95% prediction" in out
    # Only comparable arms inside: exit 0; none comparable (the dry run): nothing written.
    _csv(train, arms[:1])
    assert LAB["main"]([str(train), "--reference", str(ref_path)]) == 0
    os.remove(tmp_path / "train_vs_cpu.csv")
    _csv(train, arms[2:3])
    assert LAB["main"]([str(train), "--reference", str(ref_path)]) == 0
    assert "nothing to compare" in capsys.readouterr().out
    assert not (tmp_path / "train_vs_cpu.csv").exists()


def test_needs_a_csv_or_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        LAB["main"]([])
    assert LAB["main"]([str(tmp_path / "train.csv")]) == 1  # the training stage wrote none
    assert "the training stage wrote no rows" in capsys.readouterr().err
