"""The lab's grid wrapper (`lab/grid.py`): each session of `jattn ablate` recorded,
and the grid's report carrying what they cost.

The library writes no record of the machine (tests/test_ablation.py); this
checkout's wrapper does, around the real command: a SIGTERM mid-grid is passed
on and the session reads "preempted", the rerun that finishes it "finished",
and the report rendered after it has the "Cost" section from `report_appendix.md`
(which any rendering carries: tests/test_ablation.py).
"""

import json
import subprocess
import sys

import pytest
from fault_harness import REPO

TINY = str(REPO / "experiments" / "positional.py") + ":tiny"
GRID = str(REPO / "lab" / "grid.py")


def _grid(workdir, env, *extra) -> list[str]:
    return [sys.executable, GRID, "--config", TINY, "--workdir", str(workdir), *extra]


def _outcomes(workdir) -> list[str]:
    lines = (workdir / "sessions.jsonl").read_text().splitlines()
    return [json.loads(line)["outcome"] for line in lines]


@pytest.mark.slow
def test_a_preempted_and_a_finishing_session_are_recorded_and_reported(cli_env, tmp_path):
    workdir = tmp_path / "abl"
    first = subprocess.Popen(
        _grid(workdir, cli_env), env=cli_env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    seen = []
    for line in first.stdout:
        seen.append(line)
        if line.startswith("[1/2]"):  # the first run has started: preempt the grid
            first.terminate()
    assert first.wait(timeout=600) == 0, "".join(seen)[-3000:]
    assert any(x.startswith("ablation: preempted") for x in seen), "".join(seen)[-3000:]
    assert _outcomes(workdir) == ["preempted"]
    appendix = (workdir / "report_appendix.md").read_text()
    assert "## Cost" in appendix and "| preempted |" in appendix

    again = subprocess.run(
        _grid(workdir, cli_env), env=cli_env, cwd=REPO, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "to train" in again.stdout and "the report counts this session" in again.stdout
    assert _outcomes(workdir) == ["preempted", "finished"]
    md = (workdir / "results.md").read_text()
    assert "2 runs x 6 steps; wall time" in md and "over 2 session(s)" in md
    started = [json.loads(x)["started"] for x in (workdir / "sessions.jsonl").open()]
    assert all(f"| {s} |" in md for s in started)

    # A session with nothing to train costs nothing; the report keeps its Cost.
    idle = subprocess.run(
        _grid(workdir, cli_env), env=cli_env, cwd=REPO, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert idle.returncode == 0 and "2 already finished, 0 to train" in idle.stdout
    assert _outcomes(workdir) == ["preempted", "finished"]
    assert "the report counts this session" not in idle.stdout  # nothing new to count
    assert "over 2 session(s)" in (workdir / "results.md").read_text()


def test_a_refused_config_records_no_session(cli_env, tmp_path):
    workdir = tmp_path / "abl"
    proc = subprocess.run(
        _grid(workdir, cli_env, "--config.no_such_key=1"), env=cli_env, cwd=REPO,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode != 0 and "no_such_key" in proc.stderr, proc.stderr[-3000:]
    assert not (workdir / "sessions.jsonl").exists()
    assert not (workdir / "report_appendix.md").exists()
