"""The ablation runner: a tiny real grid (two schemes, a few steps) writes
every output, a second invocation trains nothing, and the emitted cluster
commands are the same runs."""

from __future__ import annotations

import csv
import os
import pathlib

import pytest

from jattn.analysis import emit, expand, main_ablate, run_grid
from jattn.cli.slurm import resources, slurm_script
from jattn.train.config import ConfigError, apply_overrides, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "experiments" / "positional.py") + ":tiny"


def test_grid_expansion_names_and_overrides(tmp_path):
    exp = load_config(str(ROOT / "experiments" / "positional.py"))
    runs = expand(exp, str(tmp_path))
    assert len(runs) == 8 * 2
    names = [r.name for r in runs]
    assert names[0] == "position=none,seed=0" and "position=sinusoidal+shaw,seed=1" in names
    assert len(set(r.workdir for r in runs)) == len(runs)
    shaw = next(r for r in runs if r.name == "position=shaw,seed=1")
    assert ("model.position", "shaw") in shaw.overrides and ("seed", "1") in shaw.overrides
    assert shaw.group == "position=shaw"


def test_bad_grid_key_fails_before_training(tmp_path):
    exp = load_config(TINY)
    apply_overrides(exp, [("grid.position.key", "model.positon")])
    with pytest.raises(ConfigError, match="positon"):
        run_grid(exp, str(tmp_path), repo_root=str(ROOT))


def test_emit_commands_and_slurm(tmp_path):
    exp = load_config(TINY)
    cmds = emit(exp, str(tmp_path), fmt="commands", repo_root=str(ROOT), config_spec=TINY)
    lines = cmds.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("jattn train --config ") for line in lines)
    assert "--config.model.position=shaw" in lines[1]
    with pytest.raises(ValueError, match="jattn.cli.slurm"):
        emit(exp, str(tmp_path), fmt="slurm", repo_root=str(ROOT), config_spec=TINY)
    script = slurm_script(
        exp, str(tmp_path), repo_root=str(ROOT), config_spec=TINY, slurm=resources(exp)
    )
    assert "#SBATCH --array=0-1" in script and "--config.model.position=shaw" in script


@pytest.mark.slow
def test_tiny_ablation_writes_outputs_and_resumes(tmp_path, capsys):
    workdir = tmp_path / "abl"
    assert (
        main_ablate(TINY, str(workdir), [], emit_fmt=None, report_only=False, repo_root=str(ROOT))
        == 0
    )
    for name in ("results.csv", "results.md", "loss_curves.png", "accuracy_by_length.png"):
        assert (workdir / name).stat().st_size > 0, name
    assert (workdir / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(workdir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["position=sinusoidal,seed=0", "position=shaw,seed=0"]
    assert all(r["status"] == "finished" and float(r["train/loss"]) > 0 for r in rows)
    md = (workdir / "results.md").read_text()
    assert "| position=shaw | 1 |" in md

    finals = sorted(workdir.glob("runs/*/final_metrics.json"))
    stamps = [os.stat(p).st_mtime_ns for p in finals]
    capsys.readouterr()
    main_ablate(TINY, str(workdir), [], emit_fmt=None, report_only=False, repo_root=str(ROOT))
    out = capsys.readouterr().out
    assert "2 already finished, 0 to train" in out
    assert [os.stat(p).st_mtime_ns for p in finals] == stamps  # nothing retrained

    # The probe opens a run of the grid from its checkpoint.
    from jattn.cli import main

    out = tmp_path / "probe"
    run_dir = workdir / "runs" / "position-shaw_seed-0"
    assert main(["probe", "--workdir", str(run_dir), "--out", str(out), "--examples", "2"]) == 0
    assert (out / "weight_vs_effect.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "head_ablation.md").read_text()
    assert "| decoder/layer_0/cross_attention |" in table
    assert main(["probe", "--workdir", str(tmp_path), "--out", str(out)]) == 2  # not a run


def test_cli_emit_and_bad_key(tmp_path, capsys):
    from jattn.cli import main

    assert main(["ablate", "--config", TINY, "--workdir", str(tmp_path), "--emit", "commands"]) == 0
    assert capsys.readouterr().out.count("jattn train") == 2
    status = main(
        ["ablate", "--config", TINY, "--workdir", str(tmp_path), "--config.grid.seed.valuez=1"]
    )
    assert status == 2
    assert "valuez" in capsys.readouterr().err


def test_any_training_key_can_be_overridden_from_the_command_line(tmp_path, capsys):
    """`--config.train.KEY` reaches every run for any key of the base training config,
    set by the experiment or not, typed like that key; a misspelt key is one line."""
    from jattn.analysis import apply_experiment_overrides, training_config
    from jattn.cli import main

    full = str(ROOT / "experiments" / "positional.py")  # its train section sets no steps
    exp = apply_experiment_overrides(
        load_config(full),
        [("train.num_train_steps", "4"), ("train.model.d_model", "32"),
         ("train.eval_splits", "('validation',)"), ("grid.seed.values", "0")],
        repo_root=str(ROOT),
    )  # fmt: skip
    assert exp.train.num_train_steps == 4 and exp.train.model.d_model == 32
    runs = expand(exp, str(tmp_path))
    assert len(runs) == 8
    config = training_config(exp, runs[0], str(ROOT))
    assert (config.num_train_steps, config.model.d_model) == (4, 32)
    assert config.eval_splits == ("validation",) and config.model.position == "none"

    argv = ["ablate", "--config", full, "--workdir", str(tmp_path), "--emit", "commands"]
    assert main([*argv, "--config.train.num_train_steps=4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 16 and all("--config.num_train_steps=4" in line for line in lines)
    assert main([*argv, "--config.train.num_train_step=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "jattn ablate: error: --config.train.num_train_step: unknown config key "
        "'num_train_step' in train (did you mean 'num_train_steps'?)"
    )
    assert main([*argv, "--config.train.model.d_model=wide"]) == 2
    assert "--config.train.model.d_model='wide': not a valid int" in capsys.readouterr().err


@pytest.mark.parametrize("emit_fmt", [None, "slurm", "commands"])
def test_every_run_of_a_grid_is_checked_before_anything_runs(tmp_path, capsys, emit_fmt):
    """A bad value of an axis is found by the same `check_config` as `jattn train`, for
    every run at once: one line names each bad run; nothing trains, nothing is printed."""
    from jattn.cli import main

    workdir = tmp_path / "abl"
    argv = ["ablate", "--config", TINY, "--workdir", str(workdir),
            "--config.grid.position.values=rope,rotary,t5,nope"]  # fmt: skip
    if emit_fmt:
        argv += ["--emit", emit_fmt]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err
    assert err.startswith("jattn ablate: error: 2 of 4 runs of the grid are invalid")
    assert "run 2 (position=rotary,seed=0): " in err and "run 4 (position=nope,seed=0): " in err
    assert "rotary" in err and "is not a positional scheme" in err
    assert "run 1 " not in err and "run 3 " not in err
    assert not workdir.exists()  # nothing trained, not even the ablation directory made


def test_grid_checks_run_values_of_training_keys(tmp_path):
    from jattn.analysis.grid import checked_configs

    exp = load_config(TINY)
    apply_overrides(exp, [("grid.seed.key", "batch_size"), ("grid.seed.values", "8,0")])
    runs = expand(exp, str(tmp_path))
    with pytest.raises(ConfigError) as e:
        checked_configs(exp, runs, str(ROOT))
    message = str(e.value)
    assert "run 2 (position=sinusoidal,seed=0): config.batch_size must be a positive int" in message
    assert "run 4 (position=shaw,seed=0): config.batch_size" in message
    assert "run 1 " not in message and "run 3 " not in message


def _slurm(argv, capsys):
    from jattn.cli import main

    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err.strip()


def test_emit_slurm_follows_the_launch_script_conventions(tmp_path, capsys):
    """srun, requeue with SIGTERM before the limit, the venv's own jattn, no progress bar;
    a CPU task by default (no GPU line)."""
    import sys

    workdir = tmp_path / "abl"
    argv = ["ablate", "--config", TINY, "--workdir", str(workdir), "--emit", "slurm"]
    status, script, _ = _slurm(argv, capsys)
    assert status == 0
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ("#SBATCH --array=0-1", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --time=04:00:00",
                 "#SBATCH --signal=TERM@120", "#SBATCH --requeue",
                 f"#SBATCH --output={workdir}/slurm-%A_%a.out"):  # fmt: skip
        assert want in lines, want
    assert not any("gpus" in line or "--partition" in line for line in lines)
    jattn = str(pathlib.Path(sys.executable).parent / "jattn")
    tasks = [line for line in lines if line.startswith(("  0) ", "  1) "))]
    assert len(tasks) == 2
    for task in tasks:
        assert f"srun --kill-on-bad-exit=1 {jattn} train --config " in task
        assert task.endswith("--config.progress_bar=false ;;")
        assert "--config.progress_bar=true" not in task.lower()
    assert "--config.model.position=shaw" in tasks[1]
    assert f"--workdir {workdir}/runs/position-shaw_seed-0" in tasks[1]
    assert not workdir.exists()


def test_emit_slurm_resources_from_flags_and_experiment(tmp_path, capsys):
    exp_file = tmp_path / "exp.py"
    exp_file.write_text(
        "import runpy\n"
        "import ml_collections\n"
        f"pos = runpy.run_path({str(ROOT / 'experiments' / 'positional.py')!r})\n"
        "def get_config(arg=None):\n"
        "    c = pos['get_config']('tiny')\n"
        "    c.slurm = ml_collections.ConfigDict({'partition': 'long', 'gpus_per_node': 2,\n"
        "                                         'time': '1-00:00:00'})\n"
        "    return c\n"
    )
    base = ["ablate", "--config", str(exp_file), "--workdir", str(tmp_path / "w"),
            "--emit", "slurm"]  # fmt: skip
    status, script, err = _slurm(base, capsys)
    assert status == 0, err
    lines = script.splitlines()
    assert {"#SBATCH --partition=long", "#SBATCH --gpus-per-node=2",
            "#SBATCH --time=1-00:00:00", "#SBATCH --cpus-per-task=4"} <= set(lines)  # fmt: skip
    flags = ["--slurm-partition", "gpu", "--slurm-nodes", "2", "--slurm-gpus-per-node", "8",
             "--slurm-cpus-per-task", "32", "--slurm-time", "24:00:00",
             "--slurm-signal-seconds", "300"]  # fmt: skip
    status, script, err = _slurm([*base, *flags], capsys)
    assert status == 0, err
    lines = script.splitlines()
    assert {"#SBATCH --partition=gpu", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8",
            "#SBATCH --cpus-per-task=32", "#SBATCH --time=24:00:00",
            "#SBATCH --signal=TERM@300"} <= set(lines)  # fmt: skip
    # The experiment's section is a config like any other: overridable, checked.
    status, script, err = _slurm([*base, "--config.slurm.partition=short"], capsys)
    assert status == 0 and "#SBATCH --partition=short" in script.splitlines()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--slurm-time", "2"], "signal_seconds=120 must be shorter than the time limit"),
        (["--slurm-time", "4h"], "--slurm-time='4h': use MM, HH:MM:SS"),
        (["--slurm-nodes", "0"], "nodes must be >= 1"),
        (["--slurm-gpus-per-node", "-1"], "gpus_per_node must be >= 0"),
    ],
)
def test_emit_slurm_rejects_bad_resources(tmp_path, capsys, extra, message):
    argv = ["ablate", "--config", TINY, "--workdir", str(tmp_path), "--emit", "slurm", *extra]
    status, out, err = _slurm(argv, capsys)
    assert status == 2 and out == ""
    assert err.startswith("jattn ablate: error: ") and message in err


def test_slurm_flags_need_emit_slurm(tmp_path, capsys):
    argv = ["ablate", "--config", TINY, "--workdir", str(tmp_path), "--slurm-nodes", "2"]
    status, out, err = _slurm([*argv, "--emit", "commands"], capsys)
    assert status == 2 and "--slurm-nodes: only with --emit slurm" in err and out == ""


# -- the report's plots and tables (jattn.analysis.report) -------------------------------


def _fake_runs(tmp_path, grid, with_val=True):
    """Runs of a grid {axis: values} with a short metrics.jsonl each."""
    import itertools
    import json

    from jattn.analysis.grid import Run

    rows = []
    keys = list(grid)
    for values in itertools.product(*grid.values()):
        axes = dict(zip(keys, values, strict=True))
        name = ",".join(f"{k}={v}" for k, v in axes.items())
        workdir = tmp_path / name.replace("=", "-").replace(",", "_")
        workdir.mkdir()
        with open(workdir / "metrics.jsonl", "w") as f:
            for step in (1, 2, 3, 4):
                row = {"step": step, "train/loss": 3.0 / step + 0.01 * axes.get("seed", 0)}
                if with_val and step % 2 == 0:
                    row["eval/validation/loss"] = 3.5 / step
                f.write(json.dumps(row) + "\n")
        run = Run(name=name, axes=axes, overrides=(), workdir=str(workdir))
        rows.append({"run": run, "config": None, "axes": axes, "final": None})
    return rows


def test_loss_curve_title_comes_from_the_grid_keys(tmp_path):
    from jattn.analysis import report

    rows = _fake_runs(tmp_path, {"attention": ["flash", "chunked"], "seed": [0, 1]})
    assert report.group_keys(rows) == ["attention"]
    title = report.loss_curves_title(report.group_keys(rows), validation=True)
    assert title.startswith("Training and validation loss per attention\n")
    assert "positional" not in title and "dashed: validation" in title
    two = report.loss_curves_title(["position", "d_model"], validation=False)
    assert two.startswith("Training loss per position, d_model\n") and "dashed" not in two
    assert "(one group)" in report.loss_curves_title([], validation=False)


def test_loss_curves_png_with_seeds_and_validation(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from jattn.analysis import report

    rows = _fake_runs(tmp_path, {"position": ["rope", "shaw"], "seed": [0, 1]})
    shown = {}
    real_savefig = plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        ax = fig.axes[0]
        shown["title"] = ax.get_title()
        shown["lines"] = [
            (ln.get_alpha(), ln.get_linewidth(), ln.get_linestyle()) for ln in ax.lines
        ]
        return real_savefig(fig, *args, **kwargs)

    path = tmp_path / "loss_curves.png"
    monkeypatch.setattr(plt.Figure, "savefig", spy)
    assert report.plot_loss_curves(rows, str(path))
    monkeypatch.undo()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert shown["title"].startswith("Training and validation loss per position")
    seeds = [ln for ln in shown["lines"] if ln[0] is not None]
    assert len(seeds) == 2 * 2 * 2  # groups x seeds x (train, validation)
    assert all(alpha >= 0.4 and width >= 1.0 for alpha, width, _ in seeds)
    assert sum(style == "--" for *_, style in shown["lines"]) == 2 * 2 + 2  # seeds + means
    assert not report.plot_loss_curves([], str(tmp_path / "none.png"))  # nothing to plot


def test_report_shows_only_metrics_the_runs_have():
    from jattn.analysis import report

    wanted = ["eval/validation/exact_match", "eval/validation/bleu", "eval/validation/chrf"]
    finished = [{"final": {"eval/validation/exact_match": 1.0, "eval/validation/chrf": 90.0}}]
    assert report.reported_metrics(finished + [{"final": None}], wanted) == [
        "eval/validation/exact_match",
        "eval/validation/chrf",
    ]
    assert report.reported_metrics([{"final": None}], wanted) == wanted  # nothing to tell yet
