"""Seeds in one program (`--config.seeds=0,1`) under the single run's faults: a damaged
member checkpoint, an unwritable or full disk, nonsense row lengths, divergence, a
workdir of the old stacked layout; and the program's progress bar counting every
seed's tokens."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
from fault_harness import DAMAGE, error_line, losses, run_cli, smoke_config, steps_on_disk

from jattn.train import ConfigError, TrainingDivergedError, train_and_evaluate
from jattn.train.metrics import MetricsWriter, Progress, TrainMetrics, program_tokens_per_sec

SEEDS = (0, 1)
PROGRAM = {"seeds": "0,1", "num_train_steps": 30, "keep_checkpoints": 3}


@pytest.fixture(scope="module")
def seed_reference(pristine_data, tmp_path_factory):
    """The uninterrupted 30-step program of seeds 0 and 1: (workdir, {seed: losses}).
    Each member's checkpoints 10, 20, 30 in its own workdir."""
    workdir = tmp_path_factory.mktemp("seed_reference")
    train_and_evaluate(smoke_config(pristine_data, **PROGRAM), str(workdir))
    return workdir, {s: losses(workdir / f"seed-{s}") for s in SEEDS}


@pytest.fixture
def killed_program(seed_reference, tmp_path):
    """A copy of the reference as a program killed after its step-20 saves leaves it:
    every member's steps 10 and 20, metrics up to step 30, no final metrics."""

    run = tmp_path / "run"
    shutil.copytree(seed_reference[0], run)
    for s in SEEDS:
        shutil.rmtree(run / f"seed-{s}" / "checkpoints" / "30")
        (run / f"seed-{s}" / "final_metrics.json").unlink()
        assert steps_on_disk(run / f"seed-{s}") == [10, 20]
    return run


@pytest.mark.parametrize("damage", ["truncated chunk", "emptied step"])
def test_a_damaged_newest_member_step_falls_back_to_the_previous_one(
    damage, seed_reference, killed_program, pristine_data, capsys
):
    """Seed 0's step 20 damaged: every member resumes from 10 (the newest step all
    of them restore), steps 11-30 retrained with every seed's reference losses, one
    warning naming the damage, one setting seed 1's step 20 aside, both kept."""
    _, ref = seed_reference
    DAMAGE[damage](killed_program / "seed-0" / "checkpoints" / "20")
    final = train_and_evaluate(smoke_config(pristine_data, **PROGRAM), str(killed_program))
    assert final["step"] == 30 and sorted(final["members"]) == list(SEEDS)
    for s in SEEDS:
        got = losses(killed_program / f"seed-{s}")
        assert sorted(got) == list(range(1, 31)), s
        np.testing.assert_allclose(
            [got[k] for k in got], [ref[s][k] for k in got], rtol=1e-6, err_msg=f"seed {s}"
        )
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "checkpoint step 20" in line]
    assert len(warnings) == 2 and all(w.startswith("warning:") for w in warnings), warnings
    assert sum("is newer than step 10" in w for w in warnings) == 1, warnings
    assert "resuming at step 10" in err
    for s in SEEDS:
        assert list((killed_program / f"seed-{s}" / "checkpoints.skipped").iterdir())
        assert steps_on_disk(killed_program / f"seed-{s}")[-1] == 30


def test_divergence_never_rotates_out_the_last_sane_member_checkpoint(
    seed_reference, tmp_path, pristine_data, capsys
):
    """The finished program continued at a huge learning rate, saving every 2 steps
    and keeping 1: each member's checkpoints of insane steps rotate, step 30 stays."""

    run = tmp_path / "run"
    shutil.copytree(seed_reference[0], run)
    config = smoke_config(
        pristine_data,
        **{**PROGRAM, "num_train_steps": 46, "keep_checkpoints": 1},
        learning_rate=30.0,
        allow_schedule_change=True,
        checkpoint_every_steps=2,
    )
    try:
        train_and_evaluate(config, str(run))
    except TrainingDivergedError:  # a seed went NaN; the other finished
        pass
    assert max(max(losses(run / f"seed-{s}").values()) for s in SEEDS) > 100  # it diverged
    assert all(30 in steps_on_disk(run / f"seed-{s}") for s in SEEDS)
    assert "step 30 stays the last sane one" in capsys.readouterr().err


def test_a_read_only_workdir_is_refused_at_start(pristine_data, small_disk, cli_env):
    (small_disk / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    start = time.monotonic()
    proc = run_cli(small_disk / "run", pristine_data, cli_env, "--config.seeds=0,1")
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "read-only filesystem" in error_line(proc.stderr)
    assert time.monotonic() - start < 60


def test_a_full_disk_stops_at_the_first_save_in_one_line(pristine_data, small_disk, cli_env):
    """2 MiB hold the program's files and a checkpoint or two of each member, not all."""
    proc = run_cli(small_disk / "run", pristine_data, cli_env, "--config.seeds=0,1",
                   "--config.keep_checkpoints=40", timeout=120)  # fmt: skip
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "disk full" in error_line(proc.stderr)
    assert len(proc.stderr.splitlines()) < 30  # no wall of orbax errors


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_len": 2}, "drops"),
        ({"eval_splits": "validaton"}, "['validaton'] not a split of 'copy/tiny'"),
        ({"eval_splits": "validation", "best_metric": "eval/validation/exact_mach"},
         "best_metric='eval/validation/exact_mach' is not a metric this run logs"),
    ],
)  # fmt: skip
def test_nonsense_data_settings_are_refused_before_anything_is_written(
    pristine_data, tmp_path, overrides, message
):
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(smoke_config(pristine_data, seeds="0,1", **overrides), str(tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value)
    written = [str(p) for p in tmp_path.rglob("*") if p.is_file()]
    assert not written, written  # no config, metrics or checkpoint in any seed's workdir


def test_the_program_log_reports_dropped_rows_and_every_seeds_tokens(
    pristine_data, tmp_path, capsys
):
    config = smoke_config(
        pristine_data, seeds="0,1", max_len=12, num_train_steps=4, progress_bar=True
    )
    train_and_evaluate(config, str(tmp_path))
    err = capsys.readouterr().err
    assert "note: max_len=12" in err
    shown = [float(v.replace(",", "")) for v in re.findall(r"tok_s\(2 seeds\)=([\d,]+)", err)]
    assert shown and shown[-1] > 0, err[-2000:]


def test_program_tokens_per_sec_sums_every_seeds_tokens():
    trackers = []
    for tokens in (100.0, 300.0):
        t = TrainMetrics(
            MetricsWriter("/nonexistent", enabled=False), Progress(1, 0, enabled=False)
        )
        metrics = {"loss": 1.0, "accuracy": 0.5, "tokens": tokens, "grad_norm": 1.0,
                   "learning_rate": 1e-3}  # fmt: skip
        t.push(1, metrics)
        t.log(1)
        trackers.append(t)
    rates = [t.logged_tokens_per_sec for t in trackers]
    assert all(r > 0 for r in rates)
    assert program_tokens_per_sec(trackers) == pytest.approx(sum(rates))
    assert program_tokens_per_sec([]) == 0


def test_a_stop_while_the_members_write_their_final_files_is_finished_by_a_rerun(
    pristine_data, seed_reference, tmp_path
):
    """Every member saved the last step, then the program stopped before seed 1's
    final_metrics.json was written: a rerun must not call seed 1 finished, and writes
    it (from its last step: no training, the final evaluation again)."""
    run = tmp_path / "run"
    shutil.copytree(seed_reference[0], run)
    final = run / "seed-1" / "final_metrics.json"
    want = json.loads(final.read_text())
    final.unlink()
    result = train_and_evaluate(smoke_config(pristine_data, **PROGRAM), str(run))
    got = json.loads(final.read_text())
    assert sorted(result["members"]) == [0, 1] and result["step"] == 30
    assert got["step"] == want["step"] == 30
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6)
    assert steps_on_disk(run / "seed-1")[-1] == 30
    assert losses(run / "seed-1") == seed_reference[1][1]  # nothing was trained again


def test_a_workdir_of_the_old_stacked_layout_is_refused_in_one_line(
    pristine_data, seed_reference, tmp_path
):
    """A seed program started by an earlier jattn kept its stacked checkpoints in
    WORKDIR/checkpoints and the members' only at the end: not resumed (it would
    start again from step 0), but refused, saying how to finish it."""
    run = tmp_path / "run"
    shutil.copytree(seed_reference[0], run)
    for s in SEEDS:
        (run / f"seed-{s}" / "final_metrics.json").unlink()
        shutil.rmtree(run / f"seed-{s}" / "checkpoints")
    (run / "checkpoints" / "20").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(smoke_config(pristine_data, **PROGRAM), str(run))
    assert "stacked checkpoints" in str(e.value) and "git checkout" in str(e.value)
    assert "\n" not in str(e.value)
    assert not list((run / "seed-0").glob("metrics.*.jsonl"))  # nothing archived or trained
