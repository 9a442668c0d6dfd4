"""`jattn ablate` trains the seeds of a group in one program, and falls back to one
run per seed where it must, saying why; the grid's run workdirs are the seeds'."""

from __future__ import annotations

import csv
import json
import pathlib

import ml_collections
import pytest

from jattn.analysis import expand, main_ablate
from jattn.analysis.grid import apply_experiment_overrides, checked_configs
from jattn.analysis.seed_groups import plan, program_members
from jattn.train.config import load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "experiments" / "positional.py") + ":tiny"


def _experiment(overrides):
    return apply_experiment_overrides(load_config(TINY), overrides, str(ROOT))


def test_plan_groups_seeds_and_names_each_fallback(tmp_path):
    exp = _experiment([("grid.position.values", "sinusoidal,shaw"), ("grid.seed.values", "0,1,2")])
    runs = expand(exp, str(tmp_path))
    configs = checked_configs(exp, runs, str(ROOT))
    jobs = plan(exp, runs, configs, range(len(runs)))
    assert [(j.runs, j.program) for j in jobs] == [((0, 1, 2), True), ((3, 4, 5), True)]
    # A finished seed leaves the others of its group; a lone seed trains alone.
    jobs = plan(exp, runs, configs, [1, 2, 5])
    assert [(j.runs, j.program) for j in jobs] == [((1, 2), True), ((5,), False)]
    off = plan(exp, runs, configs, range(3), one_program=False)
    assert [j.runs for j in off] == [(0,), (1,), (2,)] and "--one-run-per-seed" in off[0].note

    pallas = _experiment([("grid.seed.values", "0,1"), ("train.model.attention_impl", "pallas")])
    runs = expand(pallas, str(tmp_path))
    jobs = plan(pallas, runs, checked_configs(pallas, runs, str(ROOT)), range(len(runs)))
    assert not any(j.program for j in jobs) and len(jobs) == len(runs)
    assert "attention_impl='pallas' is a custom kernel" in jobs[0].note

    heads = _experiment([("grid.seed.key", "model.num_heads"), ("grid.seed.values", "1,2")])
    runs = expand(heads, str(tmp_path))
    jobs = plan(heads, runs, checked_configs(heads, runs, str(ROOT)), range(len(runs)))
    assert not any(j.program for j in jobs)
    assert "no `seed` axis" in jobs[0].note and "differ in more than the seed" in jobs[0].note


def test_a_learning_rate_axis_joins_its_groups_into_one_program(tmp_path):
    """Runs that differ by seed and learning rate (or warmup) are one program's
    members; the program is named by the grid's other axes."""
    exp = _experiment([("grid.position.values", "sinusoidal,shaw"), ("grid.seed.values", "0,1")])
    with exp.unlocked():
        exp.grid.lr = ml_collections.ConfigDict({"key": "learning_rate", "values": "0.001,0.003"})
    runs = expand(exp, str(tmp_path))
    configs = checked_configs(exp, runs, str(ROOT))
    jobs = plan(exp, runs, configs, range(len(runs)))
    assert [(j.name, j.program, len(j.runs)) for j in jobs] == [
        ("position=sinusoidal", True, 4),
        ("position=shaw", True, 4),
    ]
    members = program_members(configs, jobs[0].runs)
    assert [(m.seed, dict(m.hparams)) for m in members] == [
        (int(configs[i].seed), {"learning_rate": configs[i].learning_rate}) for i in jobs[0].runs
    ]
    assert {m.name for m in members} == {
        f"learning_rate-{lr}_seed-{s}" for lr in ("0.001", "0.003") for s in (0, 1)
    }


@pytest.mark.slow
def test_one_program_per_group_equals_one_run_per_seed(tmp_path, capsys):
    overrides = [("grid.position.values", "sinusoidal"), ("grid.seed.values", "0,1")]
    results = {}
    for mode, one_program in (("program", True), ("runs", False)):
        workdir = tmp_path / mode
        status = main_ablate(
            TINY,
            str(workdir),
            overrides,
            emit_fmt=None,
            report_only=False,
            repo_root=str(ROOT),
            one_program=one_program,
        )
        assert status == 0
        out = capsys.readouterr().out
        assert ("position=sinusoidal: 2 runs in one program" in out) == one_program, out
        with open(workdir / "results.csv") as f:
            rows = list(csv.DictReader(f))
        assert [r["run"] for r in rows] == [
            "position=sinusoidal,seed=0",
            "position=sinusoidal,seed=1",
        ]
        assert all(r["status"] == "finished" for r in rows)
        results[mode] = {}
        for r in rows:
            run_dir = workdir / "runs" / r["run"].replace("=", "-").replace(",", "_")
            final = json.loads((run_dir / "final_metrics.json").read_text())
            decoded = (run_dir / "decodes" / "test_longer.jsonl").read_text().splitlines()
            preds = [json.loads(line)["prediction"] for line in decoded]
            results[mode][r["run"]] = (final["train/loss"], preds)
    for name, (loss, preds) in results["runs"].items():
        got_loss, got_preds = results["program"][name]
        assert got_loss == pytest.approx(loss, rel=1e-5), name
        assert got_preds == preds, name
    # A second invocation trains nothing.
    main_ablate(
        TINY, str(tmp_path / "program"), overrides, emit_fmt=None, report_only=False,
        repo_root=str(ROOT),
    )  # fmt: skip
    assert "2 already finished, 0 to train" in capsys.readouterr().out


def test_a_learning_rate_sweep_trains_as_one_program_into_the_grids_run_dirs(tmp_path, capsys):
    """End to end: each run directory of the grid holds the member with its own
    learning rate (a member written into another run's directory would fail)."""
    from jattn.analysis.runner import run_grid  # noqa: PLC0415

    exp = _experiment([("grid.position.values", "sinusoidal"), ("grid.seed.values", "0")])
    with exp.unlocked():
        exp.grid.lr = ml_collections.ConfigDict({"key": "learning_rate", "values": "0.001,0.003"})
        exp.reference = ""
    run_grid(exp, str(tmp_path), repo_root=str(ROOT))
    out = capsys.readouterr().out
    assert "position=sinusoidal: 2 runs in one program" in out, out
    finals = {}
    for run in expand(exp, str(tmp_path)):
        config = json.loads((pathlib.Path(run.workdir) / "config.json").read_text())
        assert config["learning_rate"] == float(run.axes["lr"]), run.name
        finals[run.name] = json.loads(
            (pathlib.Path(run.workdir) / "final_metrics.json").read_text()
        )
        assert finals[run.name]["step"] == config["num_train_steps"]
    losses = [f["train/loss"] for f in finals.values()]
    assert len(set(losses)) == 2, losses
    # Each member's workdir is its only checkpoint layout: no stacked one.
    assert not (tmp_path / "groups").exists()
    for run in expand(exp, str(tmp_path)):
        assert (pathlib.Path(run.workdir) / "checkpoints" / "6").is_dir(), run.name


def test_a_grid_with_the_old_groups_layout_is_refused_in_one_line(tmp_path):
    """Seed programs of an earlier jattn kept stacked checkpoints in DIR/groups/: a
    grid with runs left to train is refused (they would restart from step 0), with
    how to finish it; nothing is trained."""
    from jattn.train import ConfigError  # noqa: PLC0415

    (tmp_path / "groups" / "position-sinusoidal" / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        main_ablate(
            TINY, str(tmp_path), [("grid.seed.values", "0,1")], emit_fmt=None,
            report_only=False, repo_root=str(ROOT),
        )  # fmt: skip
    assert "groups" in str(e.value) and "git checkout" in str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("metrics.jsonl"))
