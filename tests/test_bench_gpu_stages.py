"""benchmarks/gpu.py's stage runner, on the CPU (issue 17).

Each cell runs in a child process with its own timeout: a cell that aborts
the process (as an LLVM compile failure does) or hangs is recorded as
failed, its XLA dump and output are kept, and the next cell runs. Without a
GPU the script refuses at once. The children here run the script's `noop`
cell (no jax import), so these tests take seconds; the real CPU smoke run is
tests/test_pallas.py::test_bench_gpu_cpu_smoke.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu as bench_gpu  # noqa: E402
from gpu import Cell, StageRunner  # noqa: E402  (the stage runner, in the script itself)


def _runner(tmp_path, **kw):
    return StageRunner(
        SCRIPT, str(tmp_path / "rows.csv"), bench_gpu.COLUMNS, str(tmp_path / "dumps"),
        log=lambda msg: None, **kw,
    )  # fmt: skip


def _csv(tmp_path) -> list[dict]:
    with open(tmp_path / "rows.csv") as f:
        return list(csv.DictReader(f))


def test_abort_and_hang_cost_one_cell_each(tmp_path):
    runner = _runner(tmp_path)
    cells = [
        Cell("abort", dict(kind="noop", inject="abort"), timeout_s=60, expect_s=1),
        Cell("hang", dict(kind="noop", inject="hang"), timeout_s=3, expect_s=1),
        Cell("after", dict(kind="noop"), timeout_s=60, expect_s=1),
    ]
    t0 = time.perf_counter()
    ok = runner.run_stage("smoke", cells, budget_s=120)
    assert not ok and time.perf_counter() - t0 < 30
    rows = {r["cell"]: r for r in _csv(tmp_path)}
    assert rows["abort"]["status"] == "FAIL crash: SIGABRT"
    assert rows["hang"]["status"] == "FAIL timeout after 3 s"
    assert rows["after"]["status"] == "ok" and rows["after"]["note"].startswith("noop")
    # The failing cells keep their dump folder and output; the passing one's is gone.
    for name in ("abort", "hang"):
        kept = rows[name]["dump"]
        assert os.path.isdir(kept) and os.path.exists(os.path.join(kept, "output.txt"))
    assert sorted(os.listdir(tmp_path / "dumps")) == ["smoke-abort", "smoke-hang"]


def test_children_get_an_xla_dump_folder_and_shared_values(tmp_path):
    runner = _runner(tmp_path, keep_dumps=True)
    runner.shared["peak"] = 123.0
    (row,) = runner.run("check", Cell("one", dict(kind="noop"), timeout_s=60))
    assert row["status"] == "ok" and row["stage"] == "check"
    seen = json.loads(row["note"].removeprefix("noop "))
    assert f"--xla_dump_to={row['dump']}" in seen["xla_flags"]
    assert seen["shared"] == {"peak": 123.0}
    assert os.path.isdir(row["dump"])  # kept: keep_dumps


def test_stage_budget_skips_cells_that_would_not_fit(tmp_path):
    runner = _runner(tmp_path)
    cells = [
        Cell("fits", dict(kind="noop"), 60, expect_s=1),
        Cell("big", dict(kind="noop"), 60, 1e4),
    ]
    assert runner.run_stage("sweep", cells, budget_s=100)
    assert [(r["cell"], r["status"]) for r in _csv(tmp_path)] == [
        ("fits", "ok"),
        ("big", "skip: stage budget"),
    ]


def test_refuses_without_a_gpu_within_seconds(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--stage", "smoke", "--out", str(tmp_path / "x.csv")],
        capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert time.perf_counter() - t0 < 10
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no GPU" in proc.stderr and "--cpu-smoke" in proc.stderr
    assert not (tmp_path / "x.csv").exists()


def test_a_cell_glob_that_matches_nothing_is_refused(tmp_path, capsys):
    """A mistyped or renamed `--only` glob would drop its cells from a window silently."""
    out = str(tmp_path / "x.csv")
    argv = ["--stage", "check", "sweep", "--cpu-smoke", "--out", out, "--only"]
    assert bench_gpu.main([*argv, "check/f32*", "check/nothing*", "sweep/bwd*"]) == 2
    assert "--only ['check/nothing*']: no cell" in capsys.readouterr().err
    assert bench_gpu.main([*argv, "headline/*"]) == 2  # a cell, but of no stage asked for
    assert not os.path.exists(out)


def test_gpu_detection_without_initialising_jax(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    monkeypatch.setattr(bench_gpu.shutil, "which", lambda name: None)
    assert "no NVIDIA driver" in bench_gpu.gpu_unavailable(cpu_smoke=False)
    assert bench_gpu.gpu_unavailable(cpu_smoke=True) is None
    monkeypatch.setattr(bench_gpu.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert bench_gpu.gpu_unavailable(cpu_smoke=False) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert "excludes the GPU" in bench_gpu.gpu_unavailable(cpu_smoke=False)


@pytest.mark.parametrize("stage", bench_gpu.STAGES)
def test_stages_are_planned_to_fit_their_budgets(stage):
    # Expected times of the fixed stages fit their budgets on the GPU, and
    # every cell's timeout bounds what one bad cell can cost.
    cells = bench_gpu.BUILDERS[stage](False)
    assert cells and len({c.name for c in cells}) == len(cells)
    if stage in bench_gpu.BUDGET_S:
        assert sum(c.expect_s for c in cells) <= bench_gpu.BUDGET_S[stage]
    assert all(c.timeout_s <= 180 for c in cells)


def test_headline_ratios():
    rows = [
        dict(stage="headline", cell="cudnn", mode="fwd+bwd", ms="10.0"),
        dict(stage="headline", cell="pallas", mode="fwd+bwd", ms="12.0"),
        dict(stage="headline", cell="pallas_shaw", mode="fwd+bwd", ms="18.0"),
        dict(stage="headline", cell="pallas_alibi", mode="fwd+bwd", ms="13.2"),
        dict(stage="headline", cell="pallas_t5", mode="fwd", ms="3.0"),  # no plain fwd: no ratio
    ]
    lines = bench_gpu.ratios(rows)
    assert "headline fwd+bwd: pallas/cudnn time = 1.20 (goal <= 1.6)" in lines
    assert "headline fwd+bwd: pallas_shaw/pallas time = 1.50 (goal <= 1.3)" in lines
    assert "headline fwd+bwd: pallas_alibi/pallas time = 1.10 (goal <= 1.3)" in lines
    assert len(lines) == 3, lines


def test_a_stage_never_overruns_its_budget(tmp_path):
    # A hanging cell is cut at what is left of the stage budget, not at its
    # own (longer) timeout.
    runner = _runner(tmp_path)
    hang = Cell("hang", dict(kind="noop", inject="hang"), timeout_s=600, expect_s=1)
    t0 = time.perf_counter()
    assert not runner.run_stage("headline", [hang], budget_s=4)
    assert time.perf_counter() - t0 < 15
    (row,) = _csv(tmp_path)
    assert row["status"].startswith("FAIL timeout after")
