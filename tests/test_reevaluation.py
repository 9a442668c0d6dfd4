"""`jattn ablate --reevaluate`: a grid's finished runs evaluated again from their kept
checkpoints, without training.

Contracts, on the tiny grid trained once: a run evaluated before a metric
existed (its teacher-forced sequence accuracy struck from its final metrics)
gets it back equal to the last digit to what training computed, and every
metric it recorded equals its re-evaluation; the decodes are rewritten the
same; the report gains the column and says what was compared. A recorded
number that the checkpoint does not give is named with both values; a
checkpoint that does not verify stops the re-evaluation in one line naming
the run; the flag's conflicts are refused before anything runs.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from jattn.analysis import main_ablate

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "experiments" / "positional.py") + ":tiny"
NO_CACHE = ["--compilation_cache_dir="]  # keep this process's jax config as it is
NEW = ("tf_sequence_accuracy", "num_evaluated")
EM = "eval/test_longer/exact_match"


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    """The tiny grid (two runs, a few steps) trained once."""
    workdir = tmp_path_factory.mktemp("reeval") / "grid"
    status = main_ablate(TINY, str(workdir), [], emit_fmt=None, report_only=False,
                         repo_root=str(ROOT))  # fmt: skip
    assert status == 0
    return workdir


def _finals(workdir: pathlib.Path) -> dict[str, dict]:
    return {
        p.parent.name: json.loads(p.read_text()) for p in workdir.glob("runs/*/final_metrics.json")
    }


def _write(path: pathlib.Path, value) -> None:
    path.write_text(json.dumps(value))


def true_step(finals: dict[str, dict]) -> int:
    (step,) = {f["step"] for f in finals.values()}
    return step


def _reevaluate(workdir) -> int:
    from jattn.cli import main

    return main(["ablate", "--config", TINY, "--workdir", str(workdir), "--reevaluate", *NO_CACHE])


@pytest.mark.slow
def test_reevaluation_gives_back_the_metric_and_every_recorded_number(tiny_grid, tmp_path, capsys):
    workdir = tmp_path / "grid"
    shutil.copytree(tiny_grid, workdir)
    trained = _finals(workdir)
    assert len(trained) == 2 and all(f"eval/test_longer/{NEW[0]}" in f for f in trained.values())
    decodes = {p: p.read_text() for p in workdir.glob("runs/*/decodes/*.jsonl")}
    for name, final in trained.items():  # as a run evaluated before the metric existed
        older = {k: v for k, v in final.items() if not k.endswith(NEW)}
        _write(workdir / "runs" / name / "final_metrics.json", older)
    (workdir / "results.md").unlink()

    assert _reevaluate(workdir) == 0
    assert _finals(workdir) == trained  # the struck metric back, every other one the same
    assert {p: p.read_text() for p in decodes} == decodes
    for name, final in trained.items():
        record = json.loads((workdir / "runs" / name / "reevaluation.json").read_text())
        evaluated = [k for k in final if k.startswith("eval/") and not k.endswith(NEW)]
        assert record == {
            "step": final["step"],
            "equal": len(evaluated),
            "changed": {},
            "added": sorted(k for k in final if k.endswith(NEW)),
        }
    grid_record = json.loads((workdir / "reevaluation.json").read_text())
    assert sorted(grid_record["runs"]) == ["position=shaw,seed=0", "position=sinusoidal,seed=0"]
    assert grid_record["machine"]["cores"] >= 1 and grid_record["wall_s"] > 0
    md = (workdir / "results.md").read_text()
    section = md[md.index("## Re-evaluated from the kept checkpoints") :]
    assert "The final checkpoints of the 2 runs were evaluated again from 20" in section
    assert "equal their re-evaluation to the last digit, and none differs." in section
    assert "Added: `eval/test_longer/num_evaluated`, `eval/test_longer/tf_sequence_accuracy`" in (
        section
    )
    assert f"| {EM} | eval/test_longer/tf_sequence_accuracy |" in md

    # A recorded number the checkpoint does not give is named, with both values.
    shaw = workdir / "runs" / "position-shaw_seed-0" / "final_metrics.json"
    true = trained["position-shaw_seed-0"][EM]
    _write(shaw, {**trained["position-shaw_seed-0"], EM: true + 0.125})
    capsys.readouterr()
    assert _reevaluate(workdir) == 0
    assert f"changed: {EM} {true + 0.125} -> {true}" in capsys.readouterr().out
    record = json.loads((shaw.parent / "reevaluation.json").read_text())
    assert record["changed"] == {EM: [true + 0.125, true]} and record["added"] == []
    md = (workdir / "results.md").read_text()
    assert "and 1 differ:" in md
    assert f"| position=shaw,seed=0 | {EM} | {true + 0.125!r} | {true!r} |" in md
    assert json.loads(shaw.read_text())[EM] == true

    # A final checkpoint that does not verify: one line naming the run, exit 2.
    (shaw.parent / "checkpoints" / str(true_step(trained)) / "state" / "_METADATA").unlink()
    assert _reevaluate(workdir) == 2
    err = capsys.readouterr().err
    assert "jattn ablate: error: reevaluate position=shaw,seed=0: load_run: " in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_flag_is_refused_with_jobs_or_report_only(tmp_path, capsys):
    from jattn.cli import main

    base = ["ablate", "--config", TINY, "--workdir", str(tmp_path / "w"), "--reevaluate"]
    assert main([*base, "--jobs", "2", *NO_CACHE]) == 2
    assert "--jobs: only when training" in capsys.readouterr().err
    assert main([*base, "--report-only", *NO_CACHE]) == 2
    assert "--reevaluate: not with --emit or --report-only" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
