"""The prepared GPU window's CPU dry run, end to end, so that it cannot rot.

`scripts/gpu_window.sh OUTDIR --cpu` runs the window's stages (probe, the
float64 check, the Delétang tape model's training under the default rule and
xla, the headline and backward-sweep timing) with tiny shapes on the CPU, in
the real child processes and with the real tfds data the kit prepares
(here in the session's data directory, as scripts/gpu_kit.sh does into
.gpukit/data). The kit's wheels are not installed here (GPU_WINDOW_NO_KIT):
they are cp312 builds for the GPU image, proven by scripts/gpu_kit_check.sh.
"""

import csv
import math
import os
import runpy
import subprocess
import sys

import pytest

import jattn.data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # four stages of child processes (~4 minutes on a shared 2-core CPU)
def test_gpu_window_cpu_dry_run(tmp_path, data_dir):
    for name in runpy.run_path(os.path.join(ROOT, "benchmarks", "gpu.py"))["DATASETS"]:
        jattn.data.load(name, data_dir=data_dir)
    out = tmp_path / "window"
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        GPU_WINDOW_DATA=data_dir,
        GPU_WINDOW_NO_KIT="1",
        JAX_PLATFORMS="cpu",
    )
    cmd = ["bash", os.path.join(ROOT, "scripts", "gpu_window.sh"), str(out), "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    log = (out / "window.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-5000:]
    # The window's output is a few files (a GPU machine returns at most 8).
    assert sorted(os.listdir(out)) == ["check.csv", "timing.csv", "train.csv", "window.log"]
    for stage in ("probe", "paths", "check", "contract", "train", "verdict", "timing"):
        assert f"stage {stage}: rc=0" in log, log[-3000:]
    assert "devices [CpuDevice(id=0)]" in log and "IMPORT FAILED" not in log
    assert "1 passed" in log.split("stage contract (")[1].split("stage contract:")[0], log[-3000:]
    # Each config's attention path (`jattn configs --paths`), the training stage's too.
    paths = log.split("attention paths of training on cpu")[1].split("stage paths: rc=0")[0]
    assert "configs/chomsky.py:reverse_string,test100\n" in paths, paths
    assert paths.count("implementation=None -> 'xla'") >= 5 and "does not load" not in paths

    check = [r for r in _rows(out / "check.csv") if r["stage"] == "check"]
    assert any(r["status"] == "PASS" for r in check), check
    assert all(r["status"].startswith(("PASS", "skip")) for r in check), check

    train = _rows(out / "train.csv")
    assert [r["arm"] for r in train] == ["default", "xla"]
    for r in train:
        assert r["status"] == "ok" and r["steps"] == "4", r
        assert math.isfinite(float(r["final_loss"])) and float(r["steps_per_s"]) > 0, r
        assert float(r["input_wait_ms"]) > 0 and r["device"].endswith("cpu (1 process(es))")
    # Same data, same seed, same model: xla and the default path train alike
    # (float32 on the CPU; the GPU run compares them statistically).
    losses = [[float(x.split(":")[1]) for x in r["losses"].split()] for r in train]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    # 4 steps of 16 rows are not the CPU reference's 300 of 128: held to nothing.
    assert "gpu_train: no arm ran the reference's 300 steps of 128 rows" in log

    timing = [r for r in _rows(out / "timing.csv") if r["stage"] in ("headline", "sweep")]
    assert {r["stage"] for r in timing} == {"headline", "sweep"}, timing
    assert all(r["status"].startswith(("ok", "skip")) for r in timing), timing
    assert any(r["status"] == "ok" for r in timing), timing
    # A score mod's headline cell (ALiBi's; T5's is the same code): the <= 1.3x goal's.
    assert [r["status"] for r in timing if r["cell"] == "pallas_alibi"] == ["ok", "ok"], timing


def test_gpu_window_keeps_its_deadline(tmp_path):
    """`WINDOW_TOTAL_S` bounds the whole window: each stage's timeout is cut to
    what is left, and a stage with no time left is not started (and fails the
    window), so a lent machine's command ends when it was told to."""
    out = tmp_path / "window"
    env = dict(os.environ, PYTHON=sys.executable, GPU_WINDOW_NO_KIT="1", JAX_PLATFORMS="cpu",
               WINDOW_TOTAL_S="30", GPU_WINDOW_DATA=str(tmp_path / "no_data"),
               WINDOW_TIMING_ONLY="headline/pallas_t5 sweep/dq*")  # fmt: skip
    cmd = ["bash", os.path.join(ROOT, "scripts", "gpu_window.sh"), str(out), "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    log = (out / "window.log").read_text()
    assert proc.returncode == 1, log
    assert "stage probe: rc=0" in log and "stage timing: not started (window deadline, 30 s)" in log
    # A second window's cells replace the first's (WINDOW_TIMING_ONLY), globs unexpanded.
    assert "timing cells: headline/pallas_t5 sweep/dq*\n" in log, log
    took = int(log.strip().splitlines()[-2].split("done in ")[1].split(" s")[0])
    assert took <= 30, log


def test_a_window_runs_the_stages_it_is_asked_for(tmp_path):
    """WINDOW_STAGES picks stages (the kit and the probe always run): a second call on
    the same machine can spend the device time left on the timing stage alone; an
    unknown stage name is refused before anything runs."""
    out = tmp_path / "window"
    env = dict(os.environ, PYTHON=sys.executable, GPU_WINDOW_NO_KIT="1", JAX_PLATFORMS="cpu",
               WINDOW_TOTAL_S="40", GPU_WINDOW_DATA=str(tmp_path / "no_data"),
               WINDOW_STAGES="timing", WINDOW_TIMING_ONLY="headline/peak")  # fmt: skip
    cmd = ["bash", os.path.join(ROOT, "scripts", "gpu_window.sh"), str(out), "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    log = (out / "window.log").read_text()
    started = [line.split("stage ")[1].split(" ")[0] for line in log.splitlines()
               if "] stage " in line and "(timeout" in line]  # fmt: skip
    assert started == ["probe", "timing"], log
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(env, WINDOW_STAGES="timing sweep"))  # fmt: skip
    assert proc.returncode == 2 and "unknown stage sweep" in proc.stderr, proc.stderr


def _bash_array(text: str, name: str) -> list[str]:
    """The words of the bash array `name=(...)` in `text`."""
    import shlex  # noqa: PLC0415

    body = text.split(f"{name}=(", 1)[1].split(")", 1)[0]
    return shlex.split(body, comments=True)


def test_every_cell_glob_of_the_gpu_window_names_a_cell():
    """`benchmarks/gpu.py --only` skips a glob that matches no cell, silently: a cell
    renamed in benchmarks/gpu.py would drop out of the window unnoticed. Each glob the
    window gives on a GPU (and the second window's list in docs/gpu.md) matches a
    cell of the GPU's (not the dry run's) cell lists."""
    import fnmatch  # noqa: PLC0415
    import re  # noqa: PLC0415

    builders = runpy.run_path(os.path.join(ROOT, "benchmarks", "gpu.py"))["BUILDERS"]
    names = [f"{stage}/{c.name}" for stage, build in builders.items() for c in build(False)]
    with open(os.path.join(ROOT, "scripts", "gpu_window.sh")) as f:
        gpu_branch = f.read().split("\n  smoke=()\n", 1)[1].split("\nfi\n", 1)[0]
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        second = re.search(r"`WINDOW_TIMING_ONLY='([^']+)'", f.read())
    assert second, "docs/gpu.md gives the second window's WINDOW_TIMING_ONLY"
    globs = _bash_array(gpu_branch, "check_only") + _bash_array(gpu_branch, "timing_only")
    globs += second.group(1).split()
    assert len(globs) >= 10, globs
    unmatched = [g for g in globs if not fnmatch.filter(names, g)]
    assert not unmatched, f"globs that name no cell: {unmatched}; cells: {names}"
