"""The ablation runner: a tiny real grid (two schemes, a few steps) writes
every output, a second invocation trains nothing, and the emitted cluster
commands are the same runs."""

from __future__ import annotations

import csv
import json
import multiprocessing
import os
import pathlib

import pytest

from jattn.analysis import emit, expand, main_ablate, parallel, run_grid
from jattn.analysis.grid import checked_configs, run_base
from jattn.cli.slurm import resources, slurm_script
from jattn.train.config import ConfigError, apply_overrides, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "experiments" / "positional.py") + ":tiny"
# In-process `jattn ablate` calls that may compile: keep this process's jax config (the
# persistent compilation cache) untouched, as tests/test_cli.py does.
NO_CACHE = ["--compilation_cache_dir="]


def test_grid_expansion_names_and_overrides(tmp_path):
    exp = load_config(str(ROOT / "experiments" / "positional.py"))
    runs = expand(exp, str(tmp_path))
    assert len(runs) == 8 * 3
    names = [r.name for r in runs]
    assert names[0] == "position=none,seed=0" and "position=sinusoidal+shaw,seed=2" in names
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


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    """The tiny grid trained once, one job after another in this process."""
    workdir = tmp_path_factory.mktemp("abl") / "abl"
    assert (
        main_ablate(TINY, str(workdir), [], emit_fmt=None, report_only=False, repo_root=str(ROOT))
        == 0
    )
    return workdir


def _run_results(workdir: pathlib.Path) -> dict[str, tuple[float, list[str]]]:
    """Each run's final training loss and its decoded test_longer predictions."""
    out = {}
    for final in sorted(workdir.glob("runs/*/final_metrics.json")):
        decoded = (final.parent / "decodes" / "test_longer.jsonl").read_text().splitlines()
        preds = [json.loads(line)["prediction"] for line in decoded]
        out[final.parent.name] = (json.loads(final.read_text())["train/loss"], preds)
    return out


@pytest.mark.slow
def test_tiny_ablation_writes_outputs_and_resumes(tiny_grid, tmp_path, capsys):
    workdir = tiny_grid
    for name in ("results.csv", "results.md", "loss_curves.png", "accuracy_by_length.png"):
        assert (workdir / name).stat().st_size > 0, name
    assert (workdir / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(workdir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["position=sinusoidal,seed=0", "position=shaw,seed=0"]
    assert all(r["status"] == "finished" and float(r["train/loss"]) > 0 for r in rows)
    md = (workdir / "results.md").read_text()
    assert "| position=shaw | 1 |" in md
    # The library keeps no record of the machine: that is the lab's (lab/grid.py),
    # whose appendix every rendering of the report carries.
    assert not (workdir / "sessions.jsonl").exists() and "## Cost" not in md
    appendix = workdir / "report_appendix.md"
    appendix.write_text("## Cost\n\nwhat the lab recorded\n")
    try:
        main_ablate(TINY, str(workdir), [], emit_fmt=None, report_only=True, repo_root=str(ROOT))
        assert "## Cost\n\nwhat the lab recorded\n" in (workdir / "results.md").read_text()
    finally:
        appendix.unlink()

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


@pytest.mark.slow
def test_jobs_side_by_side_train_the_same_runs_each_on_its_own_cpus(tiny_grid, tmp_path, capsys):
    """`--jobs 2`: both runs train at once, each pinned to one CPU with its output in
    its own log, and give the sequential grid's results (up to float32 rounding: a
    pinned process has fewer XLA threads), then a rerun trains nothing."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")  # CI and this project's machines have 2
    workdir = tmp_path / "jobs"
    args = (TINY, str(workdir), [])
    kwargs = dict(emit_fmt=None, report_only=False, repo_root=str(ROOT), parallel_jobs=2)
    assert main_ablate(*args, **kwargs) == 0
    out = capsys.readouterr().out
    slots = parallel.cpu_slots(2)
    assert f"2 runs at once, on CPUs {','.join(map(str, slots[0]))} | " in out
    for name in ("position-sinusoidal_seed-0", "position-shaw_seed-0"):
        log = (workdir / "logs" / f"{name}.log").read_text()
        assert f"workdir: {workdir / 'runs' / name}" in log  # the job's own output
        assert "step 6:" in log
    assert out.count("done in") == 2 and "on CPU " in out
    status = json.loads((workdir / "ablation_status.json").read_text())
    assert set(status.values()) == {"finished"} and len(status) == 2
    got, want = _run_results(workdir), _run_results(tiny_grid)
    assert got.keys() == want.keys() and len(got) == 2
    for name, (loss, preds) in want.items():
        assert got[name][0] == pytest.approx(loss, rel=1e-5), name
        assert got[name][1] == preds, name
    assert main_ablate(*args, **kwargs) == 0
    assert "2 already finished, 0 to train" in capsys.readouterr().out


def test_cpu_slots_cut_the_cpus_into_contiguous_even_shares():
    assert parallel.cpu_slots(2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    assert parallel.cpu_slots(2, [3, 1]) == [(1,), (3,)]
    assert parallel.cpu_slots(1, [5, 7]) == [(5, 7)]
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"--jobs {bad}: must be between 1 and the 2 CPU"):
            parallel.cpu_slots(bad, [0, 1])


def test_a_failed_job_is_named_with_its_log(tmp_path):
    """A job that raises ends as `JobFailed` naming it and its log, which holds the
    traceback; nothing is left running."""
    exp = load_config(TINY)
    runs = expand(exp, str(tmp_path))
    from jattn.analysis.grid import checked_configs

    configs = checked_configs(exp, runs, str(ROOT))
    with configs[0].unlocked():
        configs[0].dataset = "no_such_dataset"
    lines = []
    with pytest.raises(parallel.JobFailed) as e:
        parallel.train_jobs(
            [0], runs, configs, str(tmp_path),
            slots=[(sorted(os.sched_getaffinity(0))[0],)], log=lines.append,
            on_done=lambda status: pytest.fail(f"no job finished: {status}"),
            progress=lambda number, done, what: f"[{number}] {what}",
        )  # fmt: skip
    message = str(e.value)
    assert "position=sinusoidal,seed=0 (ConfigError" in message
    assert "log: logs/position-sinusoidal_seed-0.log" in message
    log = (tmp_path / "logs" / "position-sinusoidal_seed-0.log").read_text()
    assert "Traceback" in log and "no_such_dataset" in log
    assert any("FAILED" in line for line in lines)
    assert not multiprocessing.active_children()


def test_cli_jobs_flag_is_checked_before_anything_runs(tmp_path, capsys):
    from jattn.cli import main

    base = ["ablate", "--config", TINY, "--workdir", str(tmp_path / "w"), *NO_CACHE]
    assert main([*base, "--jobs", "0"]) == 2
    assert "--jobs 0: must be between 1 and the" in capsys.readouterr().err
    assert main([*base, "--jobs", "2", "--emit", "commands"]) == 2
    assert "--jobs: only when training" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_grid_with_the_old_groups_layout_is_refused_in_one_line(tmp_path):
    """Seed programs of an earlier jattn kept stacked checkpoints in DIR/groups/: a
    grid with runs left to train is refused (they would restart from step 0), with
    how to finish it; nothing is trained."""
    (tmp_path / "groups" / "position-sinusoidal" / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        main_ablate(
            TINY, str(tmp_path), [("grid.seed.values", "0,1")], emit_fmt=None,
            report_only=False, repo_root=str(ROOT),
        )  # fmt: skip
    assert f"{tmp_path / 'groups'} holds the stacked checkpoints" in str(e.value)
    assert "git checkout" in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_a_seeds_key_in_a_grid_is_a_one_line_error_naming_the_seed_axis(tmp_path, capsys):
    """`seeds` (several seeds in one program, an earlier jattn's) is refused for every
    run of a grid before anything trains, naming what replaces it: the seed axis."""
    from jattn.cli import main

    argv = ["ablate", "--config", TINY, "--workdir", str(tmp_path / "w"), *NO_CACHE,
            "--config.train.seeds=0,1"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config.seeds was removed" in err
    assert "`jattn ablate --jobs N`" in err and "grid.seed.values" in err
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_cli_refuses_a_grid_another_ablate_is_training(tmp_path, capsys):
    """The grid directory's lock (the one `jattn train` takes on a run's) is held
    here as a second `jattn ablate` would find it: refused in one line naming
    the holder, before any run directory or data is written."""
    from jattn.cli import main
    from jattn.train.workdir import WorkdirLock

    grid = tmp_path / "grid"
    with WorkdirLock(str(grid)):
        status = main(["ablate", "--config", TINY, "--workdir", str(grid), *NO_CACHE])
        err = capsys.readouterr().err
    assert status == 3  # as `jattn train` on a locked run (docs/reliability.md)
    assert f"workdir {grid} is in use by pid {os.getpid()}" in err
    assert err.count("\n") == 1
    assert not (grid / "runs").exists() and not (grid / "experiment.json").exists()


def test_cli_emit_and_bad_key(tmp_path, capsys):
    from jattn.cli import main

    assert main(["ablate", "--config", TINY, "--workdir", str(tmp_path), "--emit", "commands"]) == 0
    assert capsys.readouterr().out.count("jattn train") == 2
    status = main(
        [
            "ablate",
            "--config",
            TINY,
            "--workdir",
            str(tmp_path),
            "--config.grid.seed.valuez=1",
            *NO_CACHE,
        ]  # fmt: skip
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
    assert len(lines) == 24 and all("--config.num_train_steps=4" in line for line in lines)
    assert main([*argv, "--config.train.num_train_step=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "jattn ablate: error: --config.train.num_train_step: unknown config key "
        "'num_train_step' in train (did you mean 'num_train_steps'?)"
    )
    assert main([*argv, "--config.train.model.d_model=wide"]) == 2
    assert "--config.train.model.d_model='wide': not a valid int" in capsys.readouterr().err


EMPTY_AXIS = """
import ml_collections

def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.base = "configs/smoke.py"
    c.train = ml_collections.ConfigDict()
    c.grid = ml_collections.ConfigDict()
    c.grid.position = ml_collections.ConfigDict({"key": "model.position", "values": "none"})
    c.grid.seed = ml_collections.ConfigDict({"key": "seed", "values": VALUES})
    c.metrics = ("train/loss",)
    return c
"""


@pytest.mark.parametrize("values", ['""', '" , "', "()", "[]", "(0, 1)"])
def test_an_empty_grid_axis_is_a_one_line_error(tmp_path, capsys, values):
    """An axis without values (a string, or an empty tuple or list in the experiment
    file) stops the grid in one line naming it, not a type error about a run of seed
    "()"; a tuple of values is a list of values."""
    from jattn.cli import main

    path = tmp_path / "exp.py"
    path.write_text(EMPTY_AXIS.replace("VALUES", values))
    argv = ["ablate", "--config", str(path), "--workdir", str(tmp_path / "w"), "--emit", "commands"]
    status = main(argv)
    out, err = capsys.readouterr()
    if values == "(0, 1)":
        assert status == 0 and out.count("--config.seed=") == 2, err
        return
    assert status == 2 and out == ""
    assert err == "jattn ablate: error: grid.seed.values is empty: the grid would have no runs\n"


def test_a_missing_experiment_file_is_a_one_line_error(tmp_path, capsys):
    from jattn.cli import main

    missing = str(tmp_path / "experiments" / "nope.py")
    for spec in (missing, missing + ":tiny"):
        assert main(["ablate", "--config", spec, "--workdir", str(tmp_path / "w"), *NO_CACHE]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err.startswith(f"jattn ablate: error: --config: no such config file {missing!r}")


@pytest.mark.parametrize("emit_fmt", [None, "slurm", "commands"])
def test_every_run_of_a_grid_is_checked_before_anything_runs(tmp_path, capsys, emit_fmt):
    """A bad value of an axis is found by the same `check_config` as `jattn train`, for
    every run at once: one line names each bad run; nothing trains, nothing is printed."""
    from jattn.cli import main

    workdir = tmp_path / "abl"
    argv = ["ablate", "--config", TINY, "--workdir", str(workdir), *NO_CACHE,
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
                 "#SBATCH --signal=TERM@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 f"#SBATCH --output={workdir}/slurm-%A_%a.out"):  # fmt: skip
        assert want in lines, want
    assert not any("gpus" in line or "--partition" in line for line in lines)
    jattn = str(pathlib.Path(sys.executable).parent / "jattn")
    tasks = [line for line in lines if line.startswith(("  0) ", "  1) "))]
    assert len(tasks) == 2
    for task in tasks:
        assert f"srun --kill-on-bad-exit=1 {jattn} train --config " in task
        assert task.endswith("--config.progress_bar=false) ;;")
        assert "--config.progress_bar=true" not in task.lower()
    assert "--config.model.position=shaw" in tasks[1]
    assert f"--workdir {workdir}/runs/position-shaw_seed-0" in tasks[1]
    assert not workdir.exists()


# `srun` and `scontrol` as this machine lacks them: srun stands for the run (it leaves the
# run's folder finished, or not, or fails), scontrol records what it was asked. The scripts'
# own shell runs for real.
# A stopped run leaves its checkpoint of step $STEP (orbax's step folder).
_FAKE_SRUN = """#!/bin/bash
while [ "$#" -gt 0 ] && [ "$1" != "--workdir" ]; do shift; done
mkdir -p "$2/checkpoints/$STEP"
[ "$RUN" = finished ] && echo "{}" > "$2/final_metrics.json"
[ "$RUN" = failed ] && exit 1
exit 0
"""
_FAKE_SCONTROL = '#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n'


@pytest.mark.parametrize("script", ["ablate --emit slurm", "launch/slurm.sbatch"])
def test_a_slurm_task_stopped_before_its_last_step_requeues_itself(script, tmp_path, capsys):
    """SLURM's --requeue requeues after a node failure or a preemption, not at the time
    limit: a run the limit's SIGTERM stopped (exit 0, no final_metrics.json) is requeued
    by the script, once it has saved a newer checkpoint than it found (a limit too short
    to save one would requeue forever); a finished run is not, and a failed one stops
    the script first."""
    import subprocess  # noqa: PLC0415

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    workdir = tmp_path / "abl"
    if script.startswith("ablate"):
        argv = ["ablate", "--config", TINY, "--workdir", str(workdir), "--emit", "slurm"]
        status, text, _ = _slurm(argv, capsys)
        assert status == 0
        path = tmp_path / "grid.sbatch"
        path.write_text(text)
        run_dir = workdir / "runs" / "position-sinusoidal_seed-0"  # task 0
    else:
        path, run_dir = ROOT / script, workdir
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77",
               SLURM_ARRAY_TASK_ID="0", SLURM_SUBMIT_DIR=str(ROOT), WORKDIR=str(workdir),
               SCONTROL_LOG=str(tmp_path / "scontrol.log"))  # fmt: skip

    def submit(run, *args, step=100):
        log = tmp_path / "scontrol.log"
        log.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(path), *args], env=dict(env, RUN=run, STEP=str(step)),
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        return proc, log.read_text() if log.exists() else ""

    proc, asked = submit("stopped")
    assert proc.returncode == 0, proc.stderr
    assert asked == "requeue 77\n" and "at step 100, before its last" in proc.stderr, (
        asked,
        proc.stderr,
    )
    # The requeued job: stopped again, further on.
    (run_dir / "checkpoints" / "900.orbax-checkpoint-tmp-3").mkdir()  # a save cut short: no step
    proc, asked = submit("stopped", step=250)
    assert proc.returncode == 0 and asked == "requeue 77\n", (proc.stderr, asked)
    # Stopped again with nothing newer than step 250 saved: no requeue, a failed task.
    proc, asked = submit("stopped", step=250)
    assert proc.returncode == 1 and asked == "", (proc.returncode, asked)
    assert "no checkpoint newer than step 250; not requeued" in proc.stderr, proc.stderr
    proc, asked = submit("finished")
    assert proc.returncode == 0 and (run_dir / "final_metrics.json").exists(), proc.stderr
    assert asked == "", asked
    (run_dir / "final_metrics.json").unlink()
    proc, asked = submit("failed")
    assert proc.returncode != 0 and asked == "", (proc.returncode, asked)
    if script == "launch/slurm.sbatch":  # its folder is WORKDIR, which the check reads
        proc, asked = submit("stopped", "--workdir=elsewhere")
        assert proc.returncode == 2 and "not --workdir" in proc.stderr and asked == ""


def test_the_launch_script_requeues_as_the_emitted_grid_does():
    """launch/slurm.sbatch and `jattn ablate --emit slurm` decide a requeue with the same
    lines: the blocks of `jattn.cli.slurm`, verbatim in the script."""
    from jattn.cli import slurm  # noqa: PLC0415

    text = (ROOT / "launch" / "slurm.sbatch").read_text()
    assert slurm.BEFORE + "srun " in text
    assert text.endswith(slurm.REQUEUE)


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
    from jattn.analysis import plots, report

    rows = _fake_runs(tmp_path, {"attention": ["flash", "chunked"], "seed": [0, 1]})
    assert report.group_keys(rows) == ["attention"]
    title = plots.loss_curves_title(report.group_keys(rows), validation=True)
    assert title.startswith("Training and validation loss per attention\n")
    assert "positional" not in title and "dashed: validation" in title
    two = plots.loss_curves_title(["position", "d_model"], validation=False)
    assert two.startswith("Training loss per position, d_model\n") and "dashed" not in two
    assert "(one group)" in plots.loss_curves_title([], validation=False)


def test_loss_curves_png_with_seeds_and_validation(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from jattn.analysis import plots, report

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
    assert plots.plot_loss_curves(report.loss_curves(rows), report.group_keys(rows), str(path))
    monkeypatch.undo()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert shown["title"].startswith("Training and validation loss per position")
    seeds = [ln for ln in shown["lines"] if ln[0] is not None]
    assert len(seeds) == 2 * 2 * 2  # groups x seeds x (train, validation)
    assert all(alpha >= 0.4 and width >= 1.0 for alpha, width, _ in seeds)
    assert sum(style == "--" for *_, style in shown["lines"]) == 2 * 2 + 2  # seeds + means
    assert not plots.plot_loss_curves({}, [], str(tmp_path / "none.png"))  # nothing to plot


def test_a_validation_loss_evaluated_once_is_drawn(tmp_path, monkeypatch):
    """A run that evaluated once has a validation curve of one point, which a plain
    line does not draw: every validation curve (and any one-point curve) has markers."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from jattn.analysis import plots, report

    rows = _fake_runs(tmp_path, {"position": ["rope"], "seed": [0, 1]}, with_val=False)
    for r in rows:  # one evaluation, at the last step
        with open(os.path.join(r["run"].workdir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": 4, "eval/validation/loss": 0.9}) + "\n")
    drawn = []
    real_savefig = plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn.extend(
            (len(ln.get_xdata()), ln.get_linestyle(), ln.get_marker()) for ln in fig.axes[0].lines
        )
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    assert plots.plot_loss_curves(report.loss_curves(rows), ["position"], str(tmp_path / "l.png"))
    validation = [d for d in drawn if d[1] == "--"]
    assert len(validation) == 2 + 1  # each seed's point and their mean
    assert all(n == 1 and marker not in (None, "", " ", "None") for n, _, marker in validation)
    training = [d for d in drawn if d[1] == "-"]
    assert training and all(n == 4 and marker == "None" for n, _, marker in training)


def test_report_shows_only_metrics_the_runs_have():
    from jattn.analysis import report

    wanted = ["eval/validation/exact_match", "eval/validation/bleu", "eval/validation/chrf"]
    finished = [{"final": {"eval/validation/exact_match": 1.0, "eval/validation/chrf": 90.0}}]
    assert report.reported_metrics(finished + [{"final": None}], wanted) == [
        "eval/validation/exact_match",
        "eval/validation/chrf",
    ]
    assert report.reported_metrics([{"final": None}], wanted) == wanted  # nothing to tell yet


def _fake_grid(tmp_path, em, *, num_decoded=20, check=None, reference=""):
    """A finished grid without training: `em` maps run name -> {split: exact match};
    each run gets final_metrics.json (with eval/<split>/num_decoded unless it is None),
    decodes/<split>.jsonl (k correct of N, inputs 3 tokens long in validation, 12 in
    test_longer), metrics.jsonl, and `check` as data_check.json (unless None)."""
    import json

    import ml_collections

    from jattn.analysis.grid import expand

    positions = list(dict.fromkeys(n.split(",")[0].split("=")[1] for n in em))
    seeds = list(dict.fromkeys(n.split(",")[1].split("=")[1] for n in em))
    exp = ml_collections.ConfigDict(
        {
            "base": "configs/numbers.py",
            "train": {},
            "grid": {
                "position": {"key": "model.position", "values": ",".join(positions)},
                "seed": {"key": "seed", "values": ",".join(seeds)},
            },
            "metrics": (
                "eval/test_longer/exact_match",
                "eval/validation/exact_match",
                "eval/validation/chrf",
                "eval/validation/bleu",
                "num_params",
            ),
            "reference": reference,
        }
    )
    runs = expand(exp, str(tmp_path))
    configs = []
    for run in runs:
        position, seed = run.axes["position"], int(run.axes["seed"])
        configs.append(
            ml_collections.ConfigDict(
                {"num_train_steps": 800, "seed": seed, "model": {"position": position}}
            )
        )
        os.makedirs(os.path.join(run.workdir, "decodes"))
        final = {"step": 800, "preempted": False, "num_params": 234_496, "train/loss": 0.01}
        for split, value in em[run.name].items():
            n = num_decoded or 20
            k = round(value * n)
            final[f"eval/{split}/exact_match"] = k / n
            if num_decoded is not None:
                final[f"eval/{split}/num_decoded"] = n
            if split == "validation":
                final["eval/validation/chrf"] = 90.0 + 10 * k / n
            with open(os.path.join(run.workdir, "decodes", f"{split}.jsonl"), "w") as f:
                for i in range(n):
                    length = 3 if split == "validation" else 12
                    row = {"step": 800, "correct": i < k, "input_tokens": length + i % 2}
                    f.write(json.dumps(row) + "\n")
        with open(os.path.join(run.workdir, "final_metrics.json"), "w") as f:
            json.dump(final, f)
        with open(os.path.join(run.workdir, "metrics.jsonl"), "w") as f:
            for step in (400, 800):
                f.write(json.dumps({"step": step, "train/loss": 1.0 / step}) + "\n")
        if check is not None:
            with open(os.path.join(run.workdir, "data_check.json"), "w") as f:
                json.dump(check(run.name) if callable(check) else check, f)
    return exp, runs, configs


def _names(positions, seeds):
    return [f"position={p},seed={s}" for p in positions for s in seeds]


CHECK = {
    "validation": {"examples": 1000, "producible": 1.0, "longer_than_train": 0.0},
    "test_longer": {"examples": 500, "producible": 1.0, "longer_than_train": 1.0},
    "train": {"max_target_tokens": 64, "max_input_tokens": 7},
}


def test_results_md_intervals_noise_column_and_wilson_per_run(tmp_path):
    """Groups: mean [95% t interval] over seeds; the comparison column against the
    best group on the first metric (Welch, or the counts where no seed varies);
    per run k/N with its Wilson interval, 0/N as an upper bound; the data check."""
    from jattn.analysis import report

    longer = {"shaw": [0.9, 0.95, 1.0], "rope": [0.5, 0.55, 0.45], "none": [0.85, 0.95, 1.0]}
    valid = {"shaw": 1.0, "rope": 1.0, "none": 0.0}
    em = {
        f"position={p},seed={s}": {"validation": valid[p], "test_longer": longer[p][s]}
        for p in longer
        for s in range(3)
    }
    exp, runs, configs = _fake_grid(tmp_path, em, check=CHECK)
    summary = report.write_report(exp, runs, configs, str(tmp_path), status=None)
    md = (tmp_path / "results.md").read_text()
    assert summary["markdown"] == md and summary["reference"] == "position=shaw"
    assert (
        "evaluation at its final step (num_train_steps = 800), with no checkpoint selection" in md
    )
    head = (
        "| group | seeds | eval/test_longer/exact_match | eval/validation/exact_match | "
        "eval/validation/chrf | num_params | vs position=shaw (eval/test_longer/exact_match) |"
    )
    assert head in md and "bleu" not in head
    # 0.95 ± 4.303 * 0.05 / sqrt(3) = [0.826, 1.074], clipped to 1.
    assert (
        "| position=shaw | 3 | 0.950 [0.826, 1.000] | 1.000 [1.000, 1.000] | "
        "100.0 [100.0, 100.0] | 234,496 | reference |"
    ) in md
    assert "| position=rope | 3 | 0.500 [0.376, 0.624] | " in md
    rope = next(line for line in md.splitlines() if line.startswith("| position=rope |"))
    assert rope.endswith("| differs (p<0.001, Holm p<0.001) |")
    none = next(line for line in md.splitlines() if line.startswith("| position=none |"))
    assert "| within noise (p=" in none and "counts" not in none
    assert "Welch's t-test over seeds;" in md and "two-proportion" in md
    assert "adjusted by Holm's method for the 2 comparisons made" in md
    # The comparisons section: its parts, each side's fit per seed, the machine.
    section = md[md.index("## Comparisons with the reference") :]
    rope_row = next(line for line in section.splitlines() if line.startswith("| position=rope |"))
    cells = [c.strip() for c in rope_row.strip("|").split(" | ")]
    assert cells[:3] == ["position=rope", "position=shaw", "welch"]
    assert cells[5] == "differs" and cells[-2:] == ["3 of 3 (lowest 1.000)"] * 2
    none_row = next(line for line in section.splitlines() if line.startswith("| position=none |"))
    assert none_row.rstrip(" |").endswith("0 of 3 (lowest 0.000) | 3 of 3 (lowest 1.000)")
    machine = report.comparisons_lib.machine()
    assert f"cores; jax {machine['jax']}, jaxlib {machine['jaxlib']}." in section
    assert "float32 results move across CPUs" in section
    assert "Reference: position=shaw (the best mean eval/test_longer/exact_match)." in md
    # Per run: k/N and Wilson; 0/20 reads as its upper bound z²/(20 + z²) = 16.11%.
    assert "| position=none,seed=0 | validation | 0/20 (0.00%) | ≤ 16.11% |" in md
    assert "| position=shaw,seed=2 | test_longer | 20/20 (100.00%) | ≥ 83.89% |" in md
    low, high = report.stats.wilson_interval(18, 20)
    assert f"| position=shaw,seed=0 | test_longer | 18/20 (90.00%) | [{100 * low:.2f}%, " in md
    assert f"{100 * high:.2f}%] |" in md
    # The data check, from the first run; all agree.
    assert "| test_longer | 500 | 20 | 100.0% | 100.0% | - |" in md
    assert "| validation | 1,000 | 20 | 100.0% | 0.0% | - |" in md
    assert "From run position=shaw,seed=0; training: targets up to 64 tokens" in md
    assert "every run agrees" in md
    # Fit inside the training lengths: NoPE's validation 0/20 in every seed.
    assert "| position=none | 3 | 0.000, 0.000, 0.000 | 0.000 | not fitted (0 of 3) |" in md
    assert "| position=shaw | 3 | 1.000, 1.000, 1.000 | 1.000 | fitted (3 of 3) |" in md
    assert "Groups not fitted in every seed: position=none, 0 of 3 seeds." in md
    for name in ("results.csv", "loss_curves.png", "accuracy_by_length.png", "exact_match.png"):
        assert (tmp_path / name).exists(), name
    assert summary["plots"] == ["loss_curves.png", "accuracy_by_length.png", "exact_match.png"]


def test_a_written_report_is_its_own_refresh(tmp_path):
    """`jattn.analysis.refresh` rebuilds from results.csv exactly what the report wrote
    from the workdirs: group table, Holm cells and comparisons section, machine line kept."""
    from jattn.analysis import refresh, report

    longer = {"shaw": [0.9, 0.95, 1.0], "rope": [0.5, 0.55, 0.45], "none": [0.85, 0.95, 1.0]}
    em = {
        f"position={p},seed={s}": {"validation": 1.0 - 0.2 * s, "test_longer": longer[p][s]}
        for p in longer
        for s in range(3)
    }
    exp, runs, configs = _fake_grid(tmp_path, em, check=CHECK, num_decoded=40)
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "## Comparisons with the reference" in md and "Machine: " in md
    assert refresh.refresh(str(tmp_path)) == md


def test_the_data_check_table_says_how_many_examples_were_decoded(tmp_path):
    """1,024 validation examples checked, 256 decoded by the final evaluation: the
    table shows both (exact match is over the 256), not "1,024" alone."""
    from jattn.analysis import report

    check = {**CHECK, "validation": {**CHECK["validation"], "examples": 1024}}
    em = {n: {"validation": 0.5} for n in _names(["rope", "shaw"], [0])}
    exp, runs, configs = _fake_grid(tmp_path, em, num_decoded=256, check=check)
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "| split | examples | decoded | producible targets |" in md
    assert "| validation | 1,024 | 256 | 100.0% | 0.0% | - |" in md
    assert "| position=rope,seed=0 | validation | 128/256 (50.00%) |" in md
    assert "| test_longer | 500 | - | 100.0% |" in md  # checked, not evaluated


def test_zero_variance_groups_fall_back_to_the_counts(tmp_path):
    """Every seed 1.000 against every seed 0.000: Welch is undefined, the pooled
    counts (40/40 against 0/40) decide; an explicit reference is used."""
    from jattn.analysis import report

    em = {n: {"test_longer": 1.0 if "shaw" in n else 0.0} for n in _names(["rope", "shaw"], [0, 1])}
    exp, runs, configs = _fake_grid(tmp_path, em, reference="position=rope")
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "vs position=rope (eval/test_longer/exact_match)" in md
    assert "| position=rope | 2 | 0.000 [0.000, 0.000] | 234,496 | reference |" in md
    assert (
        "| position=shaw | 2 | 1.000 [1.000, 1.000] | 234,496 | "
        "differs (p<0.001, Holm p<0.001, counts) |" in md
    )
    assert "Reference: position=rope (set by the experiment's `reference`)." in md
    assert "Data check: not checked (test_longer; no run has data_check.json)." in md
    groups = report.groups_of(report.collect(runs, configs, exp), ["eval/test_longer/exact_match"])
    assert groups["position=shaw"].pooled("test_longer") == (40, 40)
    bad = exp.copy_and_resolve_references()
    bad.reference = "position=shwa"
    with pytest.raises(ConfigError, match="shwa"):
        report.check_reference(bad, runs)
    md = report.write_report(bad, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "`reference` 'position=shwa' is not a group of this grid" in md


def test_unproducible_split_is_never_a_zero(tmp_path):
    """A split whose targets are not all producible reads "unproducible (x% of targets)"
    in both tables, with a line saying why, and stays out of the length plot."""
    from jattn.analysis import report

    check = {
        **CHECK,
        "test_longer": {
            "examples": 500,
            "producible": 0.875,
            "longer_than_train": 1.0,
            "unseen_tokens": ["m", "l"],
        },
    }
    em = {n: {"validation": 0.5, "test_longer": 0.0} for n in _names(["rope", "shaw"], [0, 1])}
    exp, runs, configs = _fake_grid(tmp_path, em, check=check)
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "| test_longer | 500 | 20 | 87.5% | 100.0% | `m` `l` |" in md
    assert "| position=rope | 2 | unproducible (12.5% of targets) | 0.500 [0.500, 0.500] |" in md
    assert "| position=shaw,seed=1 | test_longer | unproducible (12.5% of targets) | - |" in md
    assert "| position=shaw,seed=1 | validation | 10/20 (50.00%) | [" in md
    assert "test_longer: 12.5% of its targets cannot be produced from what training shows" in md
    assert "| 0.000 [" not in md and "| 0/20" not in md  # no silent zero anywhere
    # Nothing to compare on (the first metric is unproducible everywhere): said so.
    assert "| vs " not in md and "No comparison column: no group has" in md
    rows = report.collect(runs, configs, exp)
    series = report.exact_match_series(report.groups_of(rows, list(exp.metrics)), exp.metrics)
    assert series["test_longer"] == {"position=rope": None, "position=shaw": None}
    table, train, left_out = report.accuracy_by_length(rows)
    assert left_out == ["test_longer"] and train == (1, 7)
    assert dict(table["position=shaw"]) == {3: [10, 20], 4: [10, 20]}  # pooled over 2 seeds


def test_runs_that_disagree_and_runs_without_num_decoded(tmp_path):
    """Old runs (no eval/<split>/num_decoded) take k/N from their final decodes;
    a data check that differs between runs is said."""
    from jattn.analysis import report

    def check(name):
        producible = 0.5 if "shaw" in name else 1.0
        return {**CHECK, "validation": {**CHECK["validation"], "producible": producible}}

    em = {n: {"validation": 0.25} for n in _names(["rope", "shaw"], [0])}
    exp, runs, configs = _fake_grid(tmp_path, em, num_decoded=None, check=check)
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "| position=rope,seed=0 | validation | 5/20 (25.00%) | [" in md
    assert "runs disagree: position=shaw,seed=0 differ" in md
    assert "| position=rope | 1 | 0.250 (1 seed) |" in md
    assert "| position=shaw | 1 | unproducible (50.0% of targets) |" in md
    exp.reference = "position=shaw"  # an unproducible reference compares with nothing
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "| position=shaw | 1 | unproducible (50.0% of targets) |" in md
    exp.metrics = ("eval/validation/exact_match",)
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    assert "| position=rope | 1 | 0.250 (1 seed) | - (the reference is unproducible) |" in md


def test_report_plots_are_pngs_with_intervals(tmp_path, monkeypatch):
    """accuracy_by_length.png: one Wilson band per group and the training lengths
    shaded; exact_match.png: error bars per split."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from jattn.analysis import plots, report

    em = {n: {"validation": 0.75, "test_longer": 0.25} for n in _names(["rope", "shaw"], [0, 1])}
    exp, runs, configs = _fake_grid(tmp_path, em, check=CHECK)
    rows = report.collect(runs, configs, exp)
    seen = []
    real_savefig = plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        ax = fig.axes[0]
        seen.append((len(ax.collections), ax.get_xlabel(), ax.get_title()))
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    assert plots.plot_accuracy_by_length(*report.accuracy_by_length(rows), str(tmp_path / "a.png"))
    groups = report.groups_of(rows, list(exp.metrics))
    series = report.exact_match_series(groups, list(exp.metrics))
    assert series == {
        "test_longer": {"position=rope": [0.25, 0.25], "position=shaw": [0.25, 0.25]},
        "validation": {"position=rope": [0.75, 0.75], "position=shaw": [0.75, 0.75]},
    }
    assert plots.plot_exact_match(series, str(tmp_path / "e.png"))
    monkeypatch.undo()
    for name in ("a.png", "e.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    (bands, xlabel, _), (_, _, title) = seen
    assert bands == 2  # one Wilson band per group
    assert xlabel.startswith("input length (tokens")
    assert "95% t interval" in title
    table, train, _ = report.accuracy_by_length(rows)
    # Per seed, decodes alternate lengths (3, 4 in validation; 12, 13 in test_longer) and
    # the first k are correct: validation 15/20 -> 8/10 at 3, 7/10 at 4; test_longer 5/20
    # -> 3/10 at 12, 2/10 at 13. Two seeds pooled:
    assert train == (1, 7)
    assert dict(table["position=rope"]) == {3: [16, 20], 4: [14, 20], 12: [6, 20], 13: [4, 20]}
    assert report.exact_match_series(groups, ["num_params"]) == {}
    assert not plots.plot_exact_match({}, str(tmp_path / "none.png"))


def test_intervals_are_clipped_to_where_a_metric_can_lie():
    """A t interval over three seeds can leave [0, 1] (or go below 0 for a loss);
    the table clips it, as it does for exact match."""
    from jattn.analysis.report import fmt_mean_ci

    assert fmt_mean_ci([0.0, 0.0, 0.3], "eval/test_longer/length_match") == "0.100 [0.000, 0.530]"
    assert fmt_mean_ci([0.001, 0.002, 0.03], "train/loss").split("[")[1].startswith("0.000,")
    assert fmt_mean_ci([0.0, 0.0, 0.3], "eval/test_longer/other").split("[")[1].startswith("-")


@pytest.mark.parametrize(
    "spec",
    sorted(p.name for p in (ROOT / "experiments").glob("[!_]*.py"))
    + [
        "decoder_only.py:long",
        "decoder_only.py:data_dependent",
        "decoder_only.py:data_dependent_long",
        "positional.py:duplicate",
        "positional.py:shaw_clip",
        "scan.py:long",
    ],
)
def test_every_published_grid_starts(spec, tmp_path, capsys):
    """Each grid of experiments/ (as the README runs it) passes the checks made before
    anything trains, its `reference` included: `--emit commands` prints one command
    per run and exits 0. (experiments/decoder_only.py named its reference in another
    axis order than the group names and was refused at start.)"""
    from jattn.cli import main

    path = f"{ROOT / 'experiments'}/{spec}"
    assert main(["ablate", "--config", path, "--workdir", str(tmp_path), "--emit", "commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and all(line.startswith("jattn train --config ") for line in lines)


def test_a_reference_names_its_group_in_any_axis_order():
    from jattn.analysis.report import match_group

    names = ["position=rope,task=copy", "position=t5,task=copy"]
    assert match_group("task=copy,position=t5", names) == "position=t5,task=copy"
    assert match_group("position=rope,task=copy", names) == "position=rope,task=copy"
    assert match_group("task=copy", names) is None
    assert match_group("position=t5,task=reverse", names) is None


def test_with_a_task_axis_each_group_is_compared_on_its_own_task():
    """The comparison column of a grid over tasks: a reverse group against the
    reference scheme on reverse, not on copy (an axis over `dataset` is one
    the reference follows; `reference_within` names more)."""
    import ml_collections

    from jattn.analysis.report import Group, group_table, reference_of, reference_within

    names = [f"task={t},position={p}" for t in ("copy", "reverse") for p in ("none", "t5")]
    ref = "task=copy,position=none"
    assert reference_of("task=reverse,position=t5", ref, ("task",), names) == names[2]
    assert reference_of("task=reverse,position=t5", ref, (), names) == ref
    assert reference_of("task=other,position=t5", ref, ("task",), names) is None
    exp = ml_collections.ConfigDict(
        {
            "grid": {
                "task": {"key": "dataset", "values": "copy,reverse"},
                "position": {"key": "model.position", "values": "none,t5"},
                "size": {"key": "model.d_model", "values": "32,64"},
            },
            "reference_within": "size",
        }
    )
    assert reference_within(exp) == ("task", "size")
    # copy: t5 equals none; reverse: t5 = none on reverse, far below none on copy.
    em = {names[0]: [0.9, 0.92, 0.94], names[1]: [0.9, 0.92, 0.94],
          names[2]: [0.1, 0.12, 0.14], names[3]: [0.1, 0.12, 0.14]}  # fmt: skip
    metric = "eval/test_longer/exact_match"
    groups = {n: Group(n, seeds=3, values={metric: v}) for n, v in em.items()}
    table, notes = group_table(groups, [metric], ref, ("task",))
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}
    assert rows[names[2]].endswith("| reference |")  # none on reverse: its own reference
    assert "within noise" in rows[names[3]]  # t5 on reverse against none on reverse
    assert "same task" in table.splitlines()[0] and "the group's own task" in notes[1]
    across, _ = group_table(groups, [metric], ref)  # without: reverse t5 against copy none
    assert "within noise" not in across.splitlines()[5]


# -- a base config per run: ``{axis}`` in ``base`` ---------------------------------------

DELETANG = str(ROOT / "experiments" / "deletang.py")


def test_a_base_with_an_axis_field_gives_each_run_its_own_config(tmp_path):
    """Delétang's grid: ``configs/chomsky.py:{task}``, so each task trains with its own
    row lengths, not those of one task with another's data set."""
    exp = load_config(DELETANG)
    reference = "task=even_pairs/test100,position=rope,random=0"
    overrides = [("grid.seed.values", "0"), ("grid.position.values", "rope")]
    apply_overrides(exp, [*overrides, ("reference", reference)])
    runs = expand(exp, str(tmp_path))
    configs = checked_configs(exp, runs, str(ROOT))
    lengths = {}
    for run, config in zip(runs, configs, strict=True):
        task = run.axes["task"]
        assert run_base(exp, run) == f"configs/chomsky.py:{task}"
        alone = load_config(str(ROOT / "configs" / "chomsky.py") + ":" + task.replace("/", ","))
        assert config.dataset == alone.dataset == task
        lengths[task] = (config.max_input_len, config.max_len, config.eval_max_len)
        assert lengths[task] == (alone.max_input_len, alone.max_len, alone.eval_max_len)
    assert len(set(lengths.values())) == 3, lengths  # three tasks, three row shapes
    cmds = emit(exp, str(tmp_path), fmt="commands", repo_root=str(ROOT), config_spec=DELETANG)
    for run, line in zip(runs, cmds.strip().splitlines(), strict=True):
        task = run.axes["task"]
        assert f"--config {ROOT}/configs/chomsky.py:{task} " in line, line
    script = slurm_script(
        exp, str(tmp_path), repo_root=str(ROOT), config_spec=DELETANG, slurm=resources(exp)
    )
    assert all(f"chomsky.py:{run.axes['task']} " in script for run in runs)


def test_a_base_field_that_is_no_axis_is_one_line_naming_the_axes(tmp_path, capsys):
    from jattn.cli import main

    argv = ["ablate", "--config", TINY, "--workdir", str(tmp_path), "--emit", "commands",
            "--config.base=configs/chomsky.py:{taks}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "names {taks}, which is not an axis of the grid" in err, err
    assert "(axes: position, seed)" in err, err
