"""Damaged checkpoints, lost checkpoints, divergence: the run resumes from the newest
step that restores, with one warning line per skipped step and nothing lost."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from fault_harness import DAMAGE, empty_step, losses, smoke_config, steps_on_disk

from jattn.train import TrainingDivergedError, train_and_evaluate


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_step_falls_back_to_the_previous_one(
    damage, reference, run_copy, pristine_data, capsys
):
    """Step 40 damaged: resumed from 30, steps 31-40 retrained with the reference's
    losses, one warning naming step 40, the damaged step kept aside (not deleted)."""
    _, ref = reference
    (run_copy / "final_metrics.json").unlink()
    DAMAGE[damage](run_copy / "checkpoints" / "40")
    final = train_and_evaluate(smoke_config(pristine_data), str(run_copy))
    assert final["step"] == 40
    got = losses(run_copy)
    assert sorted(got) == list(range(1, 41))
    np.testing.assert_allclose([got[s] for s in got], [ref[s] for s in got], rtol=1e-6)
    warnings = [
        line for line in capsys.readouterr().err.splitlines() if "checkpoint step 40" in line
    ]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), warnings
    assert list((run_copy / "checkpoints.skipped").iterdir())
    assert steps_on_disk(run_copy)[-1] == 40


def test_a_stray_empty_step_is_ignored(run_copy, pristine_data, capsys):
    (run_copy / "checkpoints" / "55").mkdir()
    final = train_and_evaluate(smoke_config(pristine_data), str(run_copy))
    assert final["step"] == 40  # the finished run, as it was
    assert "warning: checkpoint step 55 is empty; skipped it" in capsys.readouterr().err
    assert steps_on_disk(run_copy) == [30, 40]


def test_every_checkpoint_gone_restarts_and_keeps_the_old_metrics(
    reference, run_copy, pristine_data, capsys
):
    _, ref = reference
    before = (run_copy / "metrics.jsonl").read_text()
    shutil.rmtree(run_copy / "checkpoints")
    train_and_evaluate(smoke_config(pristine_data), str(run_copy))
    (archived,) = run_copy.glob("metrics.*.jsonl")
    assert archived.read_text() == before
    assert "the earlier metrics are kept in" in capsys.readouterr().err
    got = losses(run_copy)
    np.testing.assert_allclose([got[s] for s in got], [ref[s] for s in got], rtol=1e-6)


def test_divergence_never_rotates_out_the_last_sane_checkpoint(run_copy, pristine_data, capsys):
    """A huge learning rate with a save every 2 steps and keep_checkpoints=1: the
    losses explode, the checkpoints of insane steps rotate, step 40 stays."""
    (run_copy / "final_metrics.json").unlink()
    config = smoke_config(
        pristine_data,
        num_train_steps=56,
        learning_rate=30.0,
        allow_schedule_change=True,
        checkpoint_every_steps=2,
        keep_checkpoints=1,
    )
    try:
        train_and_evaluate(config, str(run_copy))
    except TrainingDivergedError as e:  # NaN eventually: the message names step 40
        assert "Last good (sane-loss) checkpoint: step 40" in str(e)
    assert max(losses(run_copy).values()) > 100  # it did diverge
    assert 40 in steps_on_disk(run_copy)
    assert "step 40 stays the last sane one" in capsys.readouterr().err


def test_load_run_skips_an_incomplete_newest_step(run_copy):
    from jattn.train import load_run

    empty_step(run_copy / "checkpoints" / "40")
    assert load_run(str(run_copy)).step == 30
