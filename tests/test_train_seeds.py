"""Several seeds in one vmapped program (`config.seeds`) against separate single runs.

Real pieces throughout: `configs/smoke.py`, real data, real orbax checkpoints,
a real subprocess killed with SIGKILL. The program's seeds must give each
seed's single-run losses (within 1e-5 relative: a batched matmul may round
differently from an unbatched one), exactly its decodes, and its workdir
layout; a killed program resumes to the uninterrupted losses; a diverged seed
is named and the others finish.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import run_helpers
from run_helpers import REPO, SMOKE, decodes, losses

from jattn.train import (
    ConfigError,
    TrainingDivergedError,
    check_config,
    read_metrics,
    train_and_evaluate,
)

STEPS = {"num_train_steps": 20, "eval_every_steps": 20, "checkpoint_every_steps": 10}
smoke_config = functools.partial(run_helpers.smoke_config, **STEPS)  # a call's keys win


def layout(workdir) -> set[str]:
    """The top-level names of a run's workdir (checkpoint steps and event files aside)."""
    return {p.name for p in Path(workdir).iterdir()} | {
        f"decodes/{p.name}" for p in (Path(workdir) / "decodes").iterdir()
    }


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """Seeds 0, 1, 2 of the smoke config in one program: (workdir, result)."""
    workdir = tmp_path_factory.mktemp("group")
    result = train_and_evaluate(smoke_config(seeds="0,1,2"), str(workdir))
    return workdir, result


def test_seeds_in_one_program_equal_separate_runs(group, tmp_path):
    workdir, result = group
    assert sorted(result["members"]) == [0, 1, 2] and not result["diverged"]
    finals = {}
    for seed in (0, 1, 2):
        single = tmp_path / f"single{seed}"
        final = train_and_evaluate(smoke_config(seed=seed), str(single))
        seed_dir = workdir / f"seed-{seed}"
        got, want = losses(seed_dir), losses(single)
        assert sorted(got) == sorted(want) == list(range(1, 21))
        np.testing.assert_allclose(
            [got[s] for s in want], list(want.values()), rtol=1e-5, err_msg=f"seed {seed}"
        )
        mine = json.loads((seed_dir / "final_metrics.json").read_text())
        np.testing.assert_allclose(mine["train/loss"], final["train/loss"], rtol=1e-5)
        assert mine["step"] == 20
        assert decodes(seed_dir) == decodes(single) and decodes(single)
        assert layout(seed_dir) == layout(single)
        assert (seed_dir / "config.json").read_text() == (single / "config.json").read_text()
        assert list((seed_dir / "tb").iterdir()), "no TensorBoard events"
        metas = [
            json.loads((d / "checkpoints" / "20" / "meta" / "metadata").read_text())
            for d in (seed_dir, single)
        ]
        assert metas[0]["vocab_sha256"] == metas[1]["vocab_sha256"]  # resumable as a single run
        finals[seed] = final["train/loss"]
    # The seeds really differ (a program that trained seed 0 thrice would fail above,
    # but say it plainly).
    assert len({round(v, 6) for v in finals.values()}) == 3


def test_vmap_program_equals_separate_runs_within_rounding(group, tmp_path, capsys):
    """The batched form: the same per-seed losses up to rounding, the same decodes, and
    a memory line in the run log."""
    workdir, _ = group
    train_and_evaluate(smoke_config(seeds="0,1", seed_program="vmap"), str(tmp_path))
    err = capsys.readouterr().err
    assert "in one program (vmap)" in err and "seeds fit 90% of the" in err
    for seed in (0, 1):
        got, want = losses(tmp_path / f"seed-{seed}"), losses(workdir / f"seed-{seed}")
        np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)
        assert decodes(tmp_path / f"seed-{seed}") == decodes(workdir / f"seed-{seed}")


def test_finished_program_returns_without_training(group):
    workdir, result = group
    again = train_and_evaluate(smoke_config(seeds="0,1,2"), str(workdir))
    assert again["step"] == 20
    assert {s: f["train/loss"] for s, f in again["members"].items()} == {
        s: f["train/loss"] for s, f in result["members"].items()
    }


def test_seed_keys_are_checked():
    with pytest.raises(ConfigError, match="repeats a seed"):
        check_config(smoke_config(seeds="0,1,1"))
    with pytest.raises(ConfigError, match="seed_mesh_axis"):
        check_config(smoke_config(seed_mesh_axis="seeds"))
    with pytest.raises(ConfigError, match="custom kernel"):
        train_and_evaluate(smoke_config(seeds="0,1", **{"model.attention_impl": "pallas"}), "/x")


def test_a_diverged_seed_is_named_and_the_others_finish(group, tmp_path):
    workdir, _ = group
    config = smoke_config(seeds="0,1", debug_nan_at_step=7, debug_nan_seed=1, eval_splits="()")
    with pytest.raises(TrainingDivergedError, match=r"seed 1: non-finite loss \(nan\) at step 7"):
        train_and_evaluate(config, str(tmp_path))
    # Seed 0 went on, as if nothing happened (evaluation does not touch training).
    got, want = losses(tmp_path / "seed-0"), losses(workdir / "seed-0")
    assert sorted(got) == list(range(1, 21))
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)
    assert json.loads((tmp_path / "seed-0" / "final_metrics.json").read_text())["step"] == 20
    # Seed 1 stopped logging before the NaN step and has no final metrics.
    assert max(losses(tmp_path / "seed-1")) == 6
    assert not (tmp_path / "seed-1" / "final_metrics.json").exists()
    # Seed 1 saved nothing after it diverged: its newest checkpoint is its last good
    # state (none here: it diverged before the first save), and seed 0's checkpoints
    # name it, so a resume leaves it out.
    assert not list((tmp_path / "seed-1" / "checkpoints").glob("[0-9]*"))
    meta = json.loads(
        (tmp_path / "seed-0" / "checkpoints" / "20" / "meta" / "metadata").read_text()
    )
    assert set(meta["diverged"]) == {"1"}
    assert "seed 1: non-finite loss" in meta["diverged"]["1"]
    assert not (tmp_path / "checkpoints").exists()  # no stacked checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("num", [1, 3])
def test_sigkill_then_resume_equals_the_uninterrupted_program(group, tmp_path, num):
    """A program of `num` members (1: a plain run in the workdir; 3: seeds 0, 1, 2)
    killed after its step-10 checkpoints resumes bit for bit: the steps it trains
    again give the losses the killed process logged, and a 3-member program the
    uninterrupted one's (the smoke schedule is constant, so a 40-step run's first 20
    steps are the 20-step reference's). A plain run is the 3-member program's seed 0
    up to rounding (one unmapped step against a `lax.map` over members)."""
    workdir, _ = group
    dirs = [tmp_path] if num == 1 else [tmp_path / f"seed-{s}" for s in range(num)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable, "-m", "jattn.cli", "train", "--config", SMOKE, "--workdir", str(tmp_path),
        "--config.eval_splits=()", "--config.progress_bar=false",
        "--config.num_train_steps=40", "--config.checkpoint_every_steps=10",
        "--config.eval_every_steps=40",
    ] + (["--config.seeds=0,1,2"] if num == 3 else [])  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    complete = dirs[-1] / "checkpoints" / "10" / "meta"
    deadline = time.monotonic() + 300
    while not complete.exists() or _logged(dirs[-1]) <= 10:
        assert proc.poll() is None, f"run exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, "no checkpoint at step 10 in 300 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    seen = _logged(dirs[-1])
    assert 10 < seen < 40, seen
    saved = [int(p.name) for p in (dirs[0] / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) < seen, (saved, seen)  # steps after the last checkpoint were lost
    killed = [losses(run) for run in dirs]
    subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True, timeout=600)
    for seed, run in enumerate(dirs):
        got, want = losses(run), losses(workdir / f"seed-{seed}")
        assert sorted(got) == list(range(1, 41))
        again = [s for s in killed[seed] if s > max(saved)]
        assert again and [got[s] for s in again] == [killed[seed][s] for s in again], seed
        np.testing.assert_allclose(
            [got[s] for s in want], list(want.values()), rtol=0 if num == 3 else 1e-6
        )


def _logged(seed_dir: Path) -> int:
    rows = [r["step"] for r in read_metrics(str(seed_dir)) if "train/loss" in r]
    return max(rows, default=0)


SHARDED_SCRIPT = """
import json, sys
import jax
from jattn.train import load_config, apply_overrides, train_and_evaluate, read_metrics, ConfigError
assert jax.device_count() == 2, jax.devices()
out = {}
common = [("num_train_steps", "6"), ("eval_splits", "()"), ("mesh_shape", "(2,1,1)")]
for axis in ("", "data"):
    c = apply_overrides(load_config(sys.argv[1]), common + [("seeds", "0,1"),
                        ("seed_mesh_axis", axis)])
    train_and_evaluate(c, f"{sys.argv[2]}/{axis or 'replicated'}")
    out[axis or "replicated"] = {
        s: [r["train/loss"] for r in read_metrics(f"{sys.argv[2]}/{axis or 'replicated'}/seed-{s}")
            if "train/loss" in r] for s in (0, 1)}
try:
    c = apply_overrides(load_config(sys.argv[1]), common + [("seeds", "0,1,2"),
                        ("seed_mesh_axis", "data")])
    train_and_evaluate(c, sys.argv[2] + "/bad")
except ConfigError as e:
    out["error"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_seed_axis_replicated_or_sharded_over_a_mesh_axis(group, tmp_path):
    """Two CPU devices: the seed axis replicated over data parallelism, or sharded over
    the data axis (one seed a device), gives each seed its losses."""
    workdir, _ = group
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, SMOKE, str(tmp_path)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    for mode in ("replicated", "data"):
        for seed in (0, 1):
            want = losses(workdir / f"seed-{seed}")
            np.testing.assert_allclose(
                out[mode][str(seed)], [want[s] for s in range(1, 7)], rtol=2e-5, err_msg=mode
            )
    assert "do not divide 3 seeds" in out["error"]


def test_a_seed_finished_by_a_single_run_is_left_out_and_reported(group, tmp_path):
    """Seed 0 already trained as a single run in its seed workdir: the program trains
    seed 1 alone and returns both seeds' final metrics under their own seeds."""
    workdir, _ = group
    single = train_and_evaluate(smoke_config(seed=0), str(tmp_path / "seed-0"))
    result = train_and_evaluate(smoke_config(seeds="0,1"), str(tmp_path))
    assert sorted(result["members"]) == [0, 1]
    assert result["members"][0]["train/loss"] == single["train/loss"]
    assert "train/seeds_in_program" not in result["members"][0]  # not retrained
    assert result["members"][1]["train/seeds_in_program"] == 1
    np.testing.assert_allclose(
        result["members"][1]["train/loss"],
        json.loads((workdir / "seed-1" / "final_metrics.json").read_text())["train/loss"],
        rtol=1e-5,
    )
